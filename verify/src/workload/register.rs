//! The read-write register workload.

use super::{Action, Script, TxnProgram, Workload};
use rand::Rng;
use rand::rngs::StdRng;
use std::sync::atomic::{AtomicI64, Ordering};

/// Transactions of 1..=`max_ops` reads and blind writes over `keys` registers. Every
/// written value is unique, so a wrong read names the write it came from.
pub struct Registers {
    pub keys: usize,
    pub max_ops: usize,
    pub read_fraction: f64,
    /// Transactions that end in a voluntary abort.
    pub abort_fraction: f64,
    next_value: AtomicI64,
}

impl Registers {
    pub fn new(keys: usize, max_ops: usize) -> Registers {
        Registers {
            keys: keys.max(1),
            max_ops: max_ops.max(1),
            read_fraction: 0.5,
            abort_fraction: 0.05,
            next_value: AtomicI64::new(1),
        }
    }
}

impl Default for Registers {
    fn default() -> Self {
        Registers::new(8, 4)
    }
}

impl Workload for Registers {
    fn next_txn(&self, rng: &mut StdRng) -> Box<dyn TxnProgram> {
        let ops = rng.random_range(1..=self.max_ops);
        let mut actions: Vec<Action> = (0..ops)
            .map(|_| {
                let key = format!("r{}", rng.random_range(0..self.keys));
                if rng.random_bool(self.read_fraction) {
                    Action::Read(key)
                } else {
                    Action::Write(key, self.next_value.fetch_add(1, Ordering::Relaxed))
                }
            })
            .collect();
        actions.push(if rng.random_bool(self.abort_fraction) {
            Action::Abort
        } else {
            Action::Commit
        });
        Box::new(Script::new(actions))
    }
}
