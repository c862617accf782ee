//! Typed errors of the transaction layer.

use crate::catalog::CatalogError;
use crate::index::IndexError;
use crate::layout::LayoutError;
use fabric::FabricError;
use thiserror::Error;
use timestamp::OracleError;

/// Characters of a client's input (a table name, a word of a command) an error message
/// shows at most: every legal table name whole (at most
/// [`MAX_NAME`](crate::catalog::MAX_NAME) bytes).
pub const ECHO_CHARS: usize = 64;

/// `input` as an error message shows it: control characters escaped, so the message
/// stays one line, and cut after [`ECHO_CHARS`] characters with an ellipsis and its full
/// length, so a megabyte of input does not make a megabyte of message.
pub fn echo(input: &str) -> String {
    let mut shown = String::new();
    for c in input.chars().take(ECHO_CHARS) {
        if c.is_control() {
            shown.extend(c.escape_default());
        } else {
            shown.push(c);
        }
    }
    if input.chars().nth(ECHO_CHARS).is_some() {
        shown.push_str(&format!("… ({} bytes)", input.len()));
    }
    shown
}

#[derive(Debug, Error)]
pub enum TxnError {
    /// The transaction lost a write-write conflict (first committer wins, or a record
    /// it writes was locked or changed since it was read) and was aborted.
    /// (`table` is the table's id; `name` its name, which the message gives.)
    #[error("conflict on table {name} key {key}: {why}")]
    Conflict {
        table: u32,
        name: String,
        key: u64,
        why: &'static str,
    },
    /// No version of the record old enough for the snapshot is kept any more.
    #[error("snapshot {rid} too old for table {name} key {key}")]
    SnapshotTooOld {
        table: u32,
        name: String,
        key: u64,
        rid: u64,
    },
    /// `by_this_txn` says how the transaction made the key exist itself (`inserted` or
    /// `written`), if it did: "already exists" read as if another had.
    #[error("{}", match by_this_txn {
        Some(how) => format!("key {key} was {how} by this transaction already (table {name})"),
        None => format!("key {key} already exists in table {name}"),
    })]
    DuplicateKey {
        table: u32,
        name: String,
        key: u64,
        by_this_txn: Option<&'static str>,
    },
    #[error("not found: {0}")]
    NotFound(String),
    /// `capacity` is what the table was made for; it may hold more records when full
    /// (each partition has room beyond its even share, see
    /// `catalog::blocks_per_partition`), so "full (2 records)" of a table holding ten
    /// was wrong.
    #[error(
        "table {name} is full: a partition has no free block (the table was made for \
         {capacity} records, spread over its partitions by key hash; a deleted key keeps \
         its block)"
    )]
    TableFull {
        table: u32,
        name: String,
        capacity: u64,
    },
    #[error("invalid request: {0}")]
    Invalid(String),
    #[error("the transaction already ended")]
    Ended,
    /// This worker's oracle slot was fenced (its lease lapsed) while the transaction
    /// committed: the commit was left to recovery, which rolls it forward if its log
    /// record is complete and back otherwise. Its outcome is unknown to the caller
    /// until [`crate::Worker::fenced_outcome`] (on the same worker) learns it.
    #[error(
        "commit {cid} abandoned: this worker's lease lapsed and its slot was fenced; recovery decides its outcome"
    )]
    Fenced { cid: u64 },
    /// The commit is decided committed (its log record is complete: recovery finishes
    /// what this worker could not), but a step after the decision failed, so whether
    /// others see it yet is not confirmed. Never to be retried as if aborted.
    #[error("commit {cid} is committed, but a step after that failed: {cause}")]
    CommittedUnconfirmed { cid: u64, cause: Box<TxnError> },
    /// This worker stopped committing after one of its commits was left half
    /// installed (see the message); a new worker can go on.
    #[error("worker out of service: {0}")]
    Broken(String),
    /// A durable memory server did not make a range durable (it died, or its disk
    /// failed): what the commit wrote may not survive a restart of that server.
    #[error("memory server {server} did not persist: {why}")]
    Persist { server: usize, why: String },
    #[error(transparent)]
    Layout(#[from] LayoutError),
    #[error(transparent)]
    Index(IndexError),
    #[error("oracle: {0}")]
    Oracle(#[from] OracleError),
    #[error("fabric: {0}")]
    Fabric(#[from] FabricError),
    #[error("catalog: {0}")]
    Catalog(CatalogError),
}

impl From<CatalogError> for TxnError {
    fn from(e: CatalogError) -> Self {
        match e {
            CatalogError::Fabric(f) => TxnError::Fabric(f),
            CatalogError::Layout(l) => TxnError::Layout(l),
            CatalogError::NotFound(name) => TxnError::NotFound(format!("table {}", echo(&name))),
            e => TxnError::Catalog(e),
        }
    }
}

impl From<IndexError> for TxnError {
    fn from(e: IndexError) -> Self {
        match e {
            IndexError::Fabric(f) => TxnError::Fabric(f),
            e => TxnError::Index(e),
        }
    }
}

impl TxnError {
    /// Whether running the transaction again may succeed: it lost a conflict or its
    /// snapshot was too old, through no fault of its own.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            TxnError::Conflict { .. } | TxnError::SnapshotTooOld { .. }
        )
    }
}

pub type Result<T, E = TxnError> = std::result::Result<T, E>;

#[cfg(test)]
mod echo_tests {
    use super::*;

    #[test]
    fn echo_bounds_and_escapes_input() {
        assert_eq!(echo("accounts"), "accounts");
        assert_eq!(echo(""), "");
        let name = "n".repeat(ECHO_CHARS);
        assert_eq!(echo(&name), name);
        let long = "é".repeat(10_000);
        let shown = echo(&long);
        assert_eq!(shown, format!("{}… (20000 bytes)", "é".repeat(ECHO_CHARS)));
        assert_eq!(echo("a\nb\0"), "a\\nb\\u{0}");
        // Escaping cannot make a message unbounded either.
        assert!(echo(&"\u{1}".repeat(100_000)).len() < 64 * 8 + 32);
    }
}
