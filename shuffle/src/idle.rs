//! What a thread does while one of its endpoint calls waits.
//!
//! A node whose threads each both send and receive
//! ([`crate::operator::send_and_receive`]) must drain its receive endpoint while a send
//! call waits for a free buffer, for credit or for its last buffers to be freed: those
//! come back only once the peers' receivers ran, and a peer's receiver may be the very
//! thread of that peer that waits on this node. So such a thread installs its receiving
//! as *idle work* for the duration of its sending, and every wait of an endpoint call
//! ([`crate::endpoint::Backoff`]) runs it before it spins, yields or sleeps.
//!
//! The work is kept per thread, so threads that only send or only receive, and every
//! other user of the endpoints, wait exactly as before. While the work runs it is out
//! of its slot: a wait inside it (a RELEASE waiting for ring room) does not run it
//! again.

use std::cell::Cell;
use std::ptr::NonNull;

/// What one round of idle work did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Idle {
    /// Nothing to do (or no work installed): the waiter may back off.
    Nothing,
    /// Something was done: the waiter should look again at once.
    Progress,
    /// The work failed and keeps its own error: the waiter should give up now.
    Failed,
}

type Work<'a> = dyn FnMut() -> Idle + 'a;
type Slot = Option<NonNull<Work<'static>>>;

thread_local! {
    static WORK: Cell<Slot> = const { Cell::new(None) };
}

/// Puts a slot's previous content back when dropped, on return and on unwind alike.
struct Restore(Slot);

impl Drop for Restore {
    fn drop(&mut self) {
        WORK.with(|w| w.set(self.0));
    }
}

/// Runs `f` with `work` as this thread's idle work.
pub fn with_idle_work<R>(work: &mut Work<'_>, f: impl FnOnce() -> R) -> R {
    let ptr = NonNull::from(work);
    // SAFETY: only the trait object's lifetime is erased (the pointer's layout is the
    // same). The pointer leaves the slot (`Restore`, which runs on unwind too) before
    // this function returns, so before the borrow of `work` ends, and it is
    // dereferenced only while in the slot, by this thread.
    let erased: NonNull<Work<'static>> = unsafe { std::mem::transmute(ptr) };
    let _restore = Restore(WORK.with(|w| w.replace(Some(erased))));
    f()
}

/// Runs this thread's idle work once, if it has any.
pub fn run_idle_work() -> Idle {
    let Some(mut work) = WORK.with(Cell::take) else {
        return Idle::Nothing;
    };
    let _reinstall = Restore(Some(work));
    // SAFETY: the pointer was in the slot, so `with_idle_work` still borrows the work
    // exclusively for this thread and nothing else uses it: `with_idle_work` does not
    // touch it while `f` runs, and it is out of the slot until `_reinstall` drops, so a
    // wait inside the work cannot reach it a second time.
    unsafe { work.as_mut()() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idle_work_runs_only_inside_its_scope_and_never_inside_itself() {
        let mut runs = 0;
        let mut nested = Vec::new();
        assert_eq!(run_idle_work(), Idle::Nothing);
        let mut work = || {
            runs += 1;
            nested.push(run_idle_work());
            Idle::Progress
        };
        let inside = with_idle_work(&mut work, || [run_idle_work(), run_idle_work()]);
        assert_eq!(inside, [Idle::Progress, Idle::Progress]);
        assert_eq!(run_idle_work(), Idle::Nothing, "work outlived its scope");
        assert_eq!(runs, 2);
        assert_eq!(
            nested,
            [Idle::Nothing, Idle::Nothing],
            "work ran inside itself"
        );
    }

    #[test]
    fn scopes_nest_and_another_thread_sees_none_of_them() {
        let mut outer = || Idle::Failed;
        with_idle_work(&mut outer, || {
            let mut inner = || Idle::Progress;
            with_idle_work(&mut inner, || assert_eq!(run_idle_work(), Idle::Progress));
            assert_eq!(run_idle_work(), Idle::Failed);
            let other = std::thread::spawn(run_idle_work).join().unwrap();
            assert_eq!(other, Idle::Nothing);
        });
        assert_eq!(run_idle_work(), Idle::Nothing);
    }

    #[test]
    fn a_panic_inside_the_scope_takes_the_work_out_of_the_slot() {
        let mut work = || Idle::Progress;
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            with_idle_work(&mut work, || panic!("sender failed"))
        }));
        assert!(caught.is_err());
        assert_eq!(run_idle_work(), Idle::Nothing);
    }
}
