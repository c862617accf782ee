//! The interface workloads drive: a transactional key-value store with sessions.
//!
//! It is what the transaction layer implements to be checked, kept to what a history
//! records. Sessions are explicit because snapshot isolation with sessions promises
//! that a session sees its own last commit; a session runs one transaction at a time,
//! and transactions hold no borrow of it, so one thread can interleave many sessions.

use crate::history::ReadValue;

/// Why an operation or a commit failed. Every failure aborts the transaction, except
/// `Indeterminate`, whose commit may or may not have taken effect.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// First committer wins: another transaction wrote a key since this one's snapshot.
    #[error("write-write conflict")]
    Conflict,
    /// The version the snapshot needs is no longer kept.
    #[error("snapshot too old")]
    SnapshotTooOld,
    /// The commit's outcome is unknown (e.g. the node failed mid-commit).
    #[error("commit outcome unknown: {0}")]
    Indeterminate(String),
    /// A list operation on a register or the reverse.
    #[error("wrong type: {0}")]
    WrongType(String),
    #[error("{0}")]
    Other(String),
}

impl StoreError {
    /// The `error` recorded in the history.
    pub fn kind(&self) -> &'static str {
        match self {
            StoreError::Conflict => "conflict",
            StoreError::SnapshotTooOld => "snapshot_too_old",
            StoreError::Indeterminate(_) => "indeterminate",
            StoreError::WrongType(_) => "wrong_type",
            StoreError::Other(_) => "other",
        }
    }
}

/// What a read returned.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReadResult {
    /// The register's value, the list's elements, or `Absent`.
    pub value: ReadValue,
    /// The CID of the version read, if the store exposes it.
    pub version: Option<u64>,
}

/// A transactional store the workloads can run against.
pub trait TxnStore: Sync {
    type Session: Send;
    type Txn: Send;

    fn open_session(&self) -> Self::Session;

    fn begin(&self, session: &mut Self::Session) -> Result<Self::Txn, StoreError>;

    /// The transaction's read timestamp, if the store has one.
    fn read_timestamp(&self, txn: &Self::Txn) -> Option<u64>;

    /// Reads a key, seeing the transaction's own earlier writes.
    fn read(&self, txn: &mut Self::Txn, key: &str) -> Result<ReadResult, StoreError>;

    /// Overwrites a register.
    fn write(&self, txn: &mut Self::Txn, key: &str, value: i64) -> Result<(), StoreError>;

    /// Appends an element to a list.
    fn append(&self, txn: &mut Self::Txn, key: &str, element: i64) -> Result<(), StoreError>;

    /// Commits; returns the commit timestamp, if the transaction took one (read-only
    /// transactions may not).
    fn commit(
        &self,
        session: &mut Self::Session,
        txn: Self::Txn,
    ) -> Result<Option<u64>, StoreError>;

    fn abort(&self, session: &mut Self::Session, txn: Self::Txn);
}
