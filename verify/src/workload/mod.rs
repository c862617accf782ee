//! Workloads: generators of transactions whose histories the checkers can judge, and
//! the driver that runs them against a [`TxnStore`](crate::store::TxnStore) while
//! recording the history.
//!
//! - [`ListAppend`]: appends of unique elements and whole-list reads over a rotating
//!   set of keys, so every read reveals a version order (both checkers).
//! - [`Registers`]: blind writes of unique values and reads (white-box only).
//! - [`Bank`]: transfers between accounts and audits of all of them; the total must
//!   be the same in every snapshot ([`Bank::check`]).
//!
//! A transaction is a [`TxnProgram`]: a small state machine handed the result of each
//! read before choosing its next action, so transfers can depend on balances and one
//! thread can step many transactions in turn.

mod bank;
mod checked;
mod driver;
mod list_append;
mod register;

pub use bank::Bank;
pub use checked::{Checked, CheckedRunError, run_checked};
pub use driver::{RunConfig, RunError, RunSummary, Schedule, run};
pub use list_append::ListAppend;
pub use register::Registers;

use crate::history::ReadValue;
use rand::rngs::StdRng;
use std::collections::VecDeque;

/// What a transaction does next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    Read(String),
    Write(String, i64),
    Append(String, i64),
    Commit,
    /// Give up voluntarily (recorded with error `client_abort`).
    Abort,
}

/// One transaction's logic.
pub trait TxnProgram: Send {
    /// The next action; `last_read` is what the previous action read, if it read.
    fn next(&mut self, last_read: Option<&ReadValue>) -> Action;
}

/// A source of transactions.
pub trait Workload: Sync {
    /// A transaction to run, alone and committed, before any session starts.
    fn setup(&self) -> Option<Box<dyn TxnProgram>> {
        None
    }

    fn next_txn(&self, rng: &mut StdRng) -> Box<dyn TxnProgram>;
}

/// A transaction decided in advance: its actions whatever it reads.
pub struct Script(VecDeque<Action>);

impl Script {
    /// `actions` should end in `Commit` or `Abort`; a script that runs out commits.
    pub fn new(actions: impl IntoIterator<Item = Action>) -> Script {
        Script(actions.into_iter().collect())
    }
}

impl TxnProgram for Script {
    fn next(&mut self, _: Option<&ReadValue>) -> Action {
        self.0.pop_front().unwrap_or(Action::Commit)
    }
}
