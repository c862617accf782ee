//! Held doorbells: a thread that runs many coroutines may let the batches they post
//! through [`crate::AsyncQp`] wait, and ring them all at once between its rounds.
//!
//! On hardware a doorbell is one MMIO write, and holding it buys nothing. Where a
//! doorbell costs a system call and a wake-up of the peer (the tcp backend: one
//! `write` per batch, one read and one response at the responder), the batches of a
//! round of coroutines then cross in one `write` per queue pair, and the responder
//! answers them with one. Backends that ring at once ignore the hold.
//!
//! Only batches posted through `AsyncQp` wait: their futures are polled again, by the
//! executor that rings between rounds. A backend still rings a held doorbell by itself
//! when the thread has polled its queue pair many times without ringing (a future
//! awaited some other way inside a round), so a hold can slow a thread, never stop it.

use std::cell::{Cell, RefCell};
use std::marker::PhantomData;
use std::sync::Arc;

/// A queue pair with batches held back for the thread's next ring.
pub(crate) trait HeldDoorbell {
    /// Sends what was held.
    fn ring(&self);
}

thread_local! {
    static HOLDING: Cell<bool> = const { Cell::new(false) };
    static IN_ASYNC_POST: Cell<bool> = const { Cell::new(false) };
    static HELD: RefCell<Vec<Arc<dyn HeldDoorbell>>> = const { RefCell::new(Vec::new()) };
}

/// The hold of this thread's doorbells (see the module doc); dropping it rings them.
pub struct DoorbellHold {
    /// Whether this guard started the hold (a nested one leaves it to the outer).
    outermost: bool,
    /// The hold is the thread's: not `Send`.
    _thread: PhantomData<*const ()>,
}

/// Holds this thread's doorbells until [`DoorbellHold::ring`] or the guard's drop.
pub fn hold_doorbells() -> DoorbellHold {
    let outermost = !HOLDING.with(|h| h.replace(true));
    DoorbellHold {
        outermost,
        _thread: PhantomData,
    }
}

impl DoorbellHold {
    /// Rings every doorbell held since the last ring; the hold goes on.
    pub fn ring(&self) {
        ring_held_doorbells();
    }
}

impl Drop for DoorbellHold {
    fn drop(&mut self) {
        if self.outermost {
            HOLDING.with(|h| h.set(false));
            ring_held_doorbells();
        }
    }
}

/// Rings the doorbells this thread holds, if any (for a wait that polls a future
/// itself, inside a round).
pub fn ring_held_doorbells() {
    loop {
        let next = HELD.with(|held| held.borrow_mut().pop());
        match next {
            Some(qp) => qp.ring(),
            None => return,
        }
    }
}

/// Runs `post` (an `AsyncQp`'s post) marked as one whose doorbell may be held.
pub(crate) fn async_post<T>(post: impl FnOnce() -> T) -> T {
    let outer = IN_ASYNC_POST.with(|p| p.replace(true));
    let out = post();
    IN_ASYNC_POST.with(|p| p.set(outer));
    out
}

/// Whether the post under way may hold its doorbell.
pub(crate) fn may_hold() -> bool {
    HOLDING.with(|h| h.get()) && IN_ASYNC_POST.with(|p| p.get())
}

/// Remembers `qp` for the thread's next ring; the caller holds its batches meanwhile
/// and calls this once per ring.
pub(crate) fn hold(qp: Arc<dyn HeldDoorbell>) {
    HELD.with(|held| held.borrow_mut().push(qp));
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    struct Counted(AtomicUsize);

    impl HeldDoorbell for Counted {
        fn ring(&self) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    #[test]
    fn only_async_posts_under_a_hold_may_wait() {
        assert!(!async_post(may_hold));
        let hold = hold_doorbells();
        assert!(!may_hold(), "a post made directly rings at once");
        assert!(async_post(may_hold));
        {
            let _inner = hold_doorbells();
            assert!(async_post(may_hold));
        }
        assert!(
            async_post(may_hold),
            "a nested hold's end does not end the outer"
        );
        drop(hold);
        assert!(!async_post(may_hold));
    }

    #[test]
    fn a_ring_and_the_end_of_the_hold_ring_what_was_held() {
        let qp = Arc::new(Counted(AtomicUsize::new(0)));
        let guard = hold_doorbells();
        hold(qp.clone());
        assert_eq!(qp.0.load(Ordering::Relaxed), 0);
        guard.ring();
        assert_eq!(qp.0.load(Ordering::Relaxed), 1);
        guard.ring();
        assert_eq!(qp.0.load(Ordering::Relaxed), 1, "rung once per hold()");
        hold(qp.clone());
        drop(guard);
        assert_eq!(qp.0.load(Ordering::Relaxed), 2);
    }
}
