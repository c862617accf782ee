//! The list-append workload: the one whose histories reveal version orders.

use super::{Action, Script, TxnProgram, Workload};
use rand::Rng;
use rand::rngs::StdRng;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Mutex, PoisonError};

/// Transactions of 1..=`max_ops` operations, each a whole-list read or an append of a
/// new element, over `active_keys` keys at a time. A key is retired after
/// `appends_per_key` appends and replaced by a fresh one, so lists stay short and a
/// long history stays cheap to check (as in Elle's `max-writes-per-key`).
pub struct ListAppend {
    pub active_keys: usize,
    pub appends_per_key: u64,
    pub max_ops: usize,
    pub read_fraction: f64,
    /// Transactions that end in a voluntary abort.
    pub abort_fraction: f64,
    keys: Mutex<KeyPool>,
    next_element: AtomicI64,
}

struct KeyPool {
    /// (key number, appends handed out) per active slot.
    slots: Vec<(u64, u64)>,
    next_key: u64,
}

impl ListAppend {
    pub fn new(active_keys: usize, appends_per_key: u64, max_ops: usize) -> ListAppend {
        let active_keys = active_keys.max(1);
        ListAppend {
            active_keys,
            appends_per_key: appends_per_key.max(1),
            max_ops: max_ops.max(1),
            read_fraction: 0.5,
            abort_fraction: 0.05,
            keys: Mutex::new(KeyPool {
                slots: (0..active_keys as u64).map(|k| (k, 0)).collect(),
                next_key: active_keys as u64,
            }),
            next_element: AtomicI64::new(1),
        }
    }
}

impl Default for ListAppend {
    fn default() -> Self {
        ListAppend::new(8, 16, 4)
    }
}

impl Workload for ListAppend {
    fn next_txn(&self, rng: &mut StdRng) -> Box<dyn TxnProgram> {
        let ops = rng.random_range(1..=self.max_ops);
        let mut actions = Vec::with_capacity(ops + 1);
        let mut pool = self.keys.lock().unwrap_or_else(PoisonError::into_inner);
        for _ in 0..ops {
            let slot = rng.random_range(0..pool.slots.len());
            let key = format!("l{}", pool.slots[slot].0);
            if rng.random_bool(self.read_fraction) {
                actions.push(Action::Read(key));
                continue;
            }
            // Unique across all keys, so an element alone names its append.
            let element = self.next_element.fetch_add(1, Ordering::Relaxed);
            actions.push(Action::Append(key, element));
            pool.slots[slot].1 += 1;
            if pool.slots[slot].1 >= self.appends_per_key {
                pool.slots[slot] = (pool.next_key, 0);
                pool.next_key += 1;
            }
        }
        actions.push(if rng.random_bool(self.abort_fraction) {
            Action::Abort
        } else {
            Action::Commit
        });
        Box::new(Script::new(actions))
    }
}
