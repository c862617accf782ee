//! In-process fencing: a fence waits out the work its holder posted under the lease.
//!
//! A lease alone cannot stop a holder whose thread was descheduled between its lease
//! check and its post: it posts late, after a fencer decided its timestamps and a
//! recovery released its locks (a late install then overwrites a newer version). Real
//! memory-side fencing needs the memory server's help; holders in the fencer's own
//! process (the threads of one compute node, everything of an embedded database) can
//! be fenced exactly without it:
//! - a holder enters its slot's [`Gate`] before its lease check and leaves it once what
//!   it posted under that check has completed ([`LeaseGuard`]);
//! - a fencer, once its heartbeat CAS won (the holder can no longer renew), closes the
//!   gate and fences the lease only when nobody is inside; until then it leaves the
//!   slot owned and tries again on a later tick.
//!
//! Whether the gate is closed and how many are inside share one atomic word, changed
//! only by read-modify-writes: those are totally ordered, so either the holder's entry
//! comes first and the fencer's close sees it inside, or the close comes first and the
//! entry sees it closed. (Two words, a store and a load on each side, would need
//! sequential consistency, which loom does not model.) Holders in other processes are
//! not registered here: for them the fencer asks its [`RemoteFence`], if one is set
//! (txn's has the memory servers end the holder's sessions, destroying the queue pairs
//! it posts through), and goes on only once that is done. Without one they stay under
//! the lease assumption, and so does the network delay of what the holder posted
//! unsignaled before it left (a mark on tcp).

#[cfg(timestamp_loom)]
use loom::sync::atomic::{AtomicU32, Ordering};
use std::collections::HashMap;
#[cfg(not(timestamp_loom))]
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

/// Fences the holding of a slot (its slot and lease tag) by a holder of another
/// process, whose heartbeat the fencer already stopped: true once the holder can post
/// nothing more, or if it is not another process's after all; false to leave the slot
/// owned and try again on a later tick (the holder's servers did not answer).
pub type RemoteFence = Box<dyn Fn(u32, u16) -> bool + Send + Sync>;

/// The gates of one process's holders of one oracle, by slot: share one among every
/// [`crate::SlotHandle`] of a process ([`crate::SlotHandle::share_gates`]).
#[derive(Default)]
pub struct LeaseGates {
    by_slot: Mutex<HashMap<u32, (u16, Arc<Gate>)>>,
    remote: OnceLock<RemoteFence>,
}

impl LeaseGates {
    pub fn new() -> Arc<LeaseGates> {
        Arc::new(LeaseGates::default())
    }

    /// A new open gate for the holding of `slot` under lease tag `tag`, replacing any
    /// earlier holding's.
    pub fn register(&self, slot: u32, tag: u16) -> Arc<Gate> {
        let gate = Arc::new(Gate::default());
        self.lock().insert(slot, (tag, gate.clone()));
        gate
    }

    /// Sets how holders of other processes are fenced; false if one was set already.
    pub fn set_remote_fence(&self, fence: RemoteFence) -> bool {
        self.remote.set(fence).is_ok()
    }

    /// Closes the gate of the holding of `slot` under `tag`, if it is in this process,
    /// and says whether the fence may go on: nobody is inside it, or, not registered
    /// here, the [`RemoteFence`] (if any) fenced it. A closed gate stays closed.
    pub fn close(&self, slot: u32, tag: u16) -> bool {
        let gate = match self.lock().get(&slot) {
            Some((t, gate)) if *t == tag => gate.clone(),
            _ => return self.remote.get().is_none_or(|fence| fence(slot, tag)),
        };
        gate.close()
    }

    /// Forgets the holding of `slot` under `tag` (released, or fenced for good).
    pub fn forget(&self, slot: u32, tag: u16) {
        let mut by_slot = self.lock();
        if by_slot.get(&slot).is_some_and(|(t, _)| *t == tag) {
            by_slot.remove(&slot);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u32, (u16, Arc<Gate>)>> {
        // The map is left consistent by every operation: a panic elsewhere while it
        // was held does not make it wrong.
        self.by_slot.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The bit of [`Gate`]'s word that says it is closed; the bits below count who is in.
const CLOSED: u32 = 1 << 31;

/// One holding's gate: whether a fencer closed it, and how many of its holder's posts
/// are inside, in one word.
#[derive(Default)]
pub struct Gate {
    state: AtomicU32,
}

impl Gate {
    /// Enters: `None` once the gate is closed (the holder is being fenced).
    pub fn enter(gate: &Arc<Gate>) -> Option<LeaseGuard> {
        if gate.state.fetch_add(1, Ordering::AcqRel) & CLOSED != 0 {
            gate.state.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        Some(LeaseGuard {
            gate: Some(gate.clone()),
        })
    }

    /// Closes the gate; true if nobody is inside (nobody can enter any more).
    pub fn close(&self) -> bool {
        // Acquire: what those inside posted happened before they left.
        self.state.fetch_or(CLOSED, Ordering::AcqRel) & !CLOSED == 0
    }

    pub fn is_closed(&self) -> bool {
        self.state.load(Ordering::Acquire) & CLOSED != 0
    }
}

/// A holder inside its gate: hold it from the lease check until what was posted
/// under that check has completed. A guard of a holder with no gate (not shared, or
/// an observer) guards nothing.
#[must_use = "the guard must live until the work posted under the lease completed"]
pub struct LeaseGuard {
    gate: Option<Arc<Gate>>,
}

impl LeaseGuard {
    /// A guard that guards nothing (no gate registered).
    pub fn none() -> LeaseGuard {
        LeaseGuard { gate: None }
    }
}

impl Drop for LeaseGuard {
    fn drop(&mut self) {
        if let Some(gate) = &self.gate {
            // Release: what was posted inside happened before a close that sees
            // nobody in.
            gate.state.fetch_sub(1, Ordering::Release);
        }
    }
}

#[cfg(all(test, not(timestamp_loom)))]
mod tests {
    use super::*;

    #[test]
    fn a_closed_gate_lets_nobody_in_and_drains_when_the_last_leaves() {
        let gates = LeaseGates::new();
        let gate = gates.register(3, 7);
        let first = Gate::enter(&gate).expect("open");
        let second = Gate::enter(&gate).expect("open");
        assert!(!gates.close(3, 7), "two inside");
        assert!(Gate::enter(&gate).is_none(), "closed");
        drop(first);
        assert!(!gates.close(3, 7), "one inside");
        drop(second);
        assert!(gates.close(3, 7));
        assert!(Gate::enter(&gate).is_none(), "stays closed");
    }

    #[test]
    fn holdings_of_other_processes_go_to_the_remote_fence() {
        use std::sync::atomic::AtomicBool;
        let gates = LeaseGates::new();
        let asked = Arc::new(Mutex::new(Vec::new()));
        let answer = Arc::new(AtomicBool::new(false));
        let (a, b) = (asked.clone(), answer.clone());
        assert!(gates.set_remote_fence(Box::new(move |slot, tag| {
            a.lock().unwrap().push((slot, tag));
            b.load(std::sync::atomic::Ordering::SeqCst)
        })));
        assert!(!gates.set_remote_fence(Box::new(|_, _| true)), "set once");
        let gate = gates.register(3, 7);
        assert!(gates.close(3, 7), "ours, nobody inside");
        assert!(gate.is_closed());
        assert!(!gates.close(4, 1), "the remote fence has not fenced it yet");
        answer.store(true, std::sync::atomic::Ordering::SeqCst);
        assert!(gates.close(4, 1));
        assert_eq!(*asked.lock().unwrap(), [(4, 1), (4, 1)], "never for ours");
    }

    #[test]
    fn only_the_registered_holding_is_closed() {
        let gates = LeaseGates::new();
        let gate = gates.register(3, 7);
        let _inside = Gate::enter(&gate).unwrap();
        // Another tag (an earlier or later holder) or another slot: not ours to wait on.
        assert!(gates.close(3, 8));
        assert!(gates.close(4, 7));
        assert!(!gate.is_closed());
        // A new holding of the slot replaces the old one's gate.
        let newer = gates.register(3, 8);
        let _in_newer = Gate::enter(&newer).unwrap();
        assert!(
            gates.close(3, 7),
            "the old holding is not registered any more"
        );
        assert!(!newer.is_closed());
        gates.forget(3, 7);
        assert!(
            !gates.close(3, 8),
            "forgetting another tag keeps the holding"
        );
        gates.forget(3, 8);
        assert!(gates.close(3, 8), "forgotten");
    }
}
