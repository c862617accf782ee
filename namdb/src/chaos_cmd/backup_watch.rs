//! Asks a backup, off the harness's executor loop, whether it holds its primary's
//! whole state. The ask is a bounded connect (5 s against a stopped or wedged backup);
//! made on the loop, each one held up progress lines, pause resumption and node
//! polling for that long, and the loop asked again at once while a failover waited.

use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

/// The least time between two asks of one backup.
const ASK_EVERY: Duration = Duration::from_millis(100);

/// Asks whether the backup at an address holds its primary's whole state; false when
/// it does not answer.
pub(super) type Ask = dyn Fn(&str) -> bool + Send + 'static;

/// One backup's watcher thread and what it last learnt.
pub(super) struct BackupWatch {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

struct Shared {
    state: Mutex<State>,
    wake: Condvar,
}

struct State {
    address: String,
    /// Bumped each time the backup is started: an answer from an earlier process is
    /// stale, whenever it arrives.
    start: u64,
    /// The start the backup was seen synced in; it stays synced until started again.
    synced_in: Option<u64>,
    /// The harness asked since the last ask: the thread asks only on demand, so that
    /// nothing connects to a backup nobody waits for.
    wanted: bool,
    stop: bool,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // Every update is a single statement, so a poisoned lock holds valid state.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl BackupWatch {
    /// Starts watching the backup at `address` (just started, so not synced), named
    /// `name` in errors and thread names.
    pub(super) fn spawn(name: &str, address: &str, ask: Box<Ask>) -> std::io::Result<BackupWatch> {
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                address: address.to_string(),
                start: 0,
                synced_in: None,
                wanted: false,
                stop: false,
            }),
            wake: Condvar::new(),
        });
        let thread = std::thread::Builder::new()
            .name(format!("{name} watch"))
            .spawn({
                let shared = shared.clone();
                move || watch(&shared, &*ask)
            })?;
        Ok(BackupWatch {
            shared,
            thread: Some(thread),
        })
    }

    /// Whether the backup was seen holding its primary's whole state since it was last
    /// started. Never waits for the backup: a missing answer, or one from before its
    /// last start, is false, and the watcher is told to ask.
    pub(super) fn synced(&self) -> bool {
        let mut st = self.shared.lock();
        if st.synced_in == Some(st.start) {
            return true;
        }
        st.wanted = true;
        drop(st);
        self.shared.wake.notify_all();
        false
    }

    /// The backup was started again, at `address`: what was learnt about the process
    /// before is forgotten.
    pub(super) fn restarted(&self, address: &str) {
        let mut st = self.shared.lock();
        st.start += 1;
        st.address = address.to_string();
        st.synced_in = None;
        st.wanted = false;
    }

    /// Tells the thread to end; it does once an ask under way returns.
    pub(super) fn stop(&self) {
        self.shared.lock().stop = true;
        self.shared.wake.notify_all();
    }
}

impl Drop for BackupWatch {
    fn drop(&mut self) {
        self.stop();
        if let Some(thread) = self.thread.take() {
            // An ask is bounded, so this ends; a panic in `ask` has already been said
            // on stderr and leaves nothing to clean up.
            let _ = thread.join();
        }
    }
}

fn watch(shared: &Shared, ask: &Ask) {
    let mut st = shared.lock();
    loop {
        if st.stop {
            return;
        }
        if !st.wanted || st.synced_in == Some(st.start) {
            st = shared.wake.wait(st).unwrap_or_else(PoisonError::into_inner);
            continue;
        }
        st.wanted = false;
        let (start, address) = (st.start, st.address.clone());
        drop(st);
        let synced = ask(&address);
        st = shared.lock();
        if synced && st.start == start {
            st.synced_in = Some(start);
        }
        // Spaced out: the loop wants an answer every few milliseconds while it waits.
        st = shared
            .wake
            .wait_timeout_while(st, ASK_EVERY, |st| !st.stop)
            .unwrap_or_else(PoisonError::into_inner)
            .0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;
    use std::time::Instant;

    /// A backup under the test's control: each ask reports its address and waits for
    /// the test's answer.
    fn controlled() -> (Box<Ask>, mpsc::Receiver<String>, mpsc::Sender<bool>) {
        let (asked_tx, asked) = mpsc::channel();
        let (answer, answer_rx) = mpsc::channel::<bool>();
        let answer_rx = Mutex::new(answer_rx);
        let ask = Box::new(move |address: &str| {
            let _ = asked_tx.send(address.to_string());
            answer_rx
                .lock()
                .unwrap()
                .recv_timeout(Duration::from_secs(60))
                .unwrap_or(false)
        });
        (ask, asked, answer)
    }

    fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while !cond() {
            assert!(
                Instant::now() < deadline,
                "{what} did not happen within 60 s"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// While an ask is under way (a backup that does not answer), `synced` answers at
    /// once, false; the answer counts once it arrives, and only for the process it
    /// came from.
    #[test]
    fn answers_arrive_in_the_background_and_only_count_for_their_start() {
        let (ask, asked, answer) = controlled();
        let watch = BackupWatch::spawn("backup-0", "127.0.0.1:1", ask).unwrap();
        let wait = Duration::from_secs(60);
        assert!(
            asked.recv_timeout(Duration::from_millis(50)).is_err(),
            "asked before anyone wanted to know"
        );
        assert!(!watch.synced());
        assert_eq!(asked.recv_timeout(wait).unwrap(), "127.0.0.1:1");
        // The ask hangs, as against a stopped backup: `synced` does not wait for it.
        for _ in 0..1000 {
            assert!(!watch.synced());
        }
        answer.send(true).unwrap();
        eventually("the answer", || watch.synced());

        // Started again: the earlier process's answer no longer counts.
        watch.restarted("127.0.0.1:2");
        assert!(!watch.synced());
        assert_eq!(asked.recv_timeout(wait).unwrap(), "127.0.0.1:2");
        // An answer that was under way across a restart is stale too.
        watch.restarted("127.0.0.1:3");
        answer.send(true).unwrap();
        assert!(!watch.synced());
        assert_eq!(asked.recv_timeout(wait).unwrap(), "127.0.0.1:3");
        assert!(!watch.synced());
        answer.send(false).unwrap();
        assert_eq!(asked.recv_timeout(wait).unwrap(), "127.0.0.1:3");
        answer.send(true).unwrap();
        eventually("the answer after the restart", || watch.synced());
        drop(watch);
        assert!(
            matches!(asked.recv(), Err(mpsc::RecvError)),
            "the thread ended with the watch (it held the sender)"
        );
    }

    /// Dropping the watch ends its thread even while an ask is under way (once the
    /// ask returns).
    #[test]
    fn the_thread_ends_with_the_watch() {
        let (ask, asked, answer) = controlled();
        let watch = BackupWatch::spawn("backup-0", "127.0.0.1:1", ask).unwrap();
        assert!(!watch.synced());
        asked.recv_timeout(Duration::from_secs(60)).unwrap();
        let dropped = std::thread::spawn(move || drop(watch));
        answer.send(false).unwrap();
        dropped.join().unwrap();
        assert!(matches!(asked.recv(), Err(mpsc::RecvError)));
    }
}
