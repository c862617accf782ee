//! How transaction-layer errors reach gRPC clients: one status code per kind of
//! failure (the table is in `compute.proto`), with the error's own message, and a word
//! on what became of the transaction.

use tonic::{Code, Status};
use txn::TxnError;
use txn::catalog::CatalogError;
use txn::index::IndexError;
use txn::layout::LayoutError;

/// The status code of `e`.
pub fn code_of(e: &TxnError) -> Code {
    match e {
        // Retryable: the client runs the transaction again.
        TxnError::Conflict { .. } | TxnError::SnapshotTooOld { .. } => Code::Aborted,
        TxnError::DuplicateKey { .. } => Code::AlreadyExists,
        TxnError::NotFound(_) => Code::NotFound,
        TxnError::TableFull { .. } => Code::ResourceExhausted,
        TxnError::Invalid(_) => Code::InvalidArgument,
        TxnError::Ended => Code::FailedPrecondition,
        TxnError::Layout(l) => match l {
            LayoutError::ValueTooLarge { .. } | LayoutError::Shape(_) => Code::InvalidArgument,
            // A block that does not decode: the data or this node is broken.
            _ => Code::Internal,
        },
        TxnError::Index(i) => match i {
            IndexError::DuplicateKey { .. } => Code::AlreadyExists,
            IndexError::ReservedKey => Code::InvalidArgument,
            IndexError::BucketFull { .. } => Code::ResourceExhausted,
            IndexError::Scratch(_) => Code::InvalidArgument,
            IndexError::Fabric(_) => Code::Unavailable,
        },
        TxnError::Oracle(_) | TxnError::Fabric(_) => Code::Unavailable,
        // The outcome is recovery's to decide: unknown until it has (the pool asks,
        // `fenced_rolled_back` / `fenced_undecided`).
        TxnError::Fenced { .. } => Code::Unknown,
        // Committed, but whether it survives a restart of that server is unknown.
        TxnError::Persist { .. } => Code::Unknown,
        // Committed, but whether others see it yet is unknown.
        TxnError::CommittedUnconfirmed { .. } => Code::Unknown,
        TxnError::Broken(_) => Code::Unavailable,
        TxnError::Catalog(c) => match c {
            CatalogError::TableExists(_) => Code::AlreadyExists,
            CatalogError::NotFound(_) => Code::NotFound,
            CatalogError::Invalid(_) | CatalogError::Layout(_) => Code::InvalidArgument,
            CatalogError::CatalogFull(_) | CatalogError::ServerFull { .. } => {
                Code::ResourceExhausted
            }
            // Nothing was created: the client may simply try again.
            CatalogError::CreateLost(_) => Code::Aborted,
            CatalogError::Fabric(_) | CatalogError::Oracle(_) => Code::Unavailable,
            _ => Code::Internal,
        },
    }
}

/// What became of the transaction when one of its requests failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fate {
    /// The request had no effect; the transaction is open as it was.
    Open,
    /// The transaction was aborted and its handle is gone.
    Aborted,
    /// Not a transaction's request (admin), or its end was the request (Commit).
    None,
}

/// Whether a transaction survives a request that failed with `e`: only a refused
/// argument (reserved key, value too large, unknown table, an insert of an existing
/// key) leaves it as it was; any other failure may have left it half-read, so it is
/// aborted.
pub fn keeps_transaction(e: &TxnError) -> bool {
    matches!(
        code_of(e),
        Code::InvalidArgument | Code::NotFound | Code::AlreadyExists
    )
}

/// The status a client gets for `e`.
pub fn status_of(e: &TxnError, fate: Fate) -> Status {
    let code = code_of(e);
    let mut message = match e {
        // Said in words a client who never heard of completions or oracles follows.
        TxnError::Oracle(_) | TxnError::Fabric(_) | TxnError::Index(IndexError::Fabric(_)) => {
            format!(
                "the memory servers did not answer as they should (stopped, overloaded or unreachable?): {e}"
            )
        }
        _ => e.to_string(),
    };
    match fate {
        Fate::Open => message.push_str("; the transaction is still open"),
        Fate::Aborted | Fate::None if code == Code::Aborted => {
            message.push_str("; the transaction was aborted: this is retryable, run it again")
        }
        // A commit that may have taken effect (or did) was not aborted.
        Fate::Aborted if code == Code::Unknown => {}
        Fate::Aborted => message.push_str("; the transaction was aborted"),
        Fate::None => {}
    }
    Status::new(code, message)
}

/// The status of a Commit fenced under its worker that recovery rolled back: it had
/// no effect, so unlike UNKNOWN it is safe to run again.
pub fn fenced_rolled_back(cid: u64) -> Status {
    Status::aborted(format!(
        "commit {cid} was rolled back: the worker running it was fenced (its oracle lease \
         lapsed while its thread was starved, before the commit's log record was complete), \
         and recovery undid it; the transaction had no effect: this is retryable, run it \
         again"
    ))
}

/// The status of a Commit fenced under its worker whose outcome could not be learnt
/// (`why`): UNKNOWN, as it may have taken effect.
pub fn fenced_undecided(cid: u64, why: &TxnError) -> Status {
    Status::unknown(format!(
        "commit {cid} was abandoned to recovery (the worker running it was fenced: its \
         oracle lease lapsed) and its outcome could not be learnt in time ({why}); it may \
         have taken effect"
    ))
}

/// The status of a transaction handle the node does not hold.
pub fn unknown_transaction(handle: u64, idle_timeout: std::time::Duration) -> Status {
    // 0 is what a request whose `txn` field was never set carries.
    let unset = if handle == 0 {
        " (is the request's `txn` set to the handle Begin returned?)"
    } else {
        ""
    };
    Status::not_found(format!(
        "unknown transaction {handle:#x}{unset}: it committed, aborted, expired after {idle_timeout:?} without a request, or never existed"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use fabric::FabricError;

    #[test]
    fn each_kind_of_failure_has_its_code() {
        let cases: Vec<(TxnError, Code)> = vec![
            (
                TxnError::Conflict {
                    table: 1,
                    name: "t".into(),
                    key: 2,
                    why: "first committer wins",
                },
                Code::Aborted,
            ),
            (
                TxnError::SnapshotTooOld {
                    table: 1,
                    name: "t".into(),
                    key: 2,
                    rid: 3,
                },
                Code::Aborted,
            ),
            (
                TxnError::DuplicateKey {
                    table: 1,
                    name: "t".into(),
                    key: 2,
                    by_this_txn: None,
                },
                Code::AlreadyExists,
            ),
            (TxnError::NotFound("table t".into()), Code::NotFound),
            (
                TxnError::TableFull {
                    table: 1,
                    name: "t".into(),
                    capacity: 8,
                },
                Code::ResourceExhausted,
            ),
            (TxnError::Invalid("key".into()), Code::InvalidArgument),
            (
                TxnError::Layout(LayoutError::ValueTooLarge { len: 9, cap: 8 }),
                Code::InvalidArgument,
            ),
            (
                TxnError::Layout(LayoutError::Malformed {
                    index: 0,
                    why: "x".into(),
                }),
                Code::Internal,
            ),
            (
                TxnError::Index(IndexError::ReservedKey),
                Code::InvalidArgument,
            ),
            (
                TxnError::Fabric(FabricError::Backend("gone".into())),
                Code::Unavailable,
            ),
            (
                TxnError::Catalog(CatalogError::TableExists("t".into())),
                Code::AlreadyExists,
            ),
            (
                TxnError::Catalog(CatalogError::CatalogFull(64)),
                Code::ResourceExhausted,
            ),
            (TxnError::Ended, Code::FailedPrecondition),
        ];
        for (e, code) in cases {
            assert_eq!(code_of(&e), code, "{e}");
            assert_eq!(status_of(&e, Fate::None).code(), code, "{e}");
        }
    }

    #[test]
    fn messages_say_what_became_of_the_transaction() {
        let conflict = TxnError::Conflict {
            table: 1,
            name: "t".into(),
            key: 7,
            why: "first committer wins",
        };
        let s = status_of(&conflict, Fate::Aborted);
        assert!(s.message().contains("table t key 7"), "{}", s.message());
        assert!(s.message().contains("retryable"), "{}", s.message());
        let too_large = TxnError::Layout(LayoutError::ValueTooLarge { len: 9, cap: 8 });
        assert!(keeps_transaction(&too_large));
        let s = status_of(&too_large, Fate::Open);
        assert!(s.message().contains("still open"), "{}", s.message());
        assert!(!keeps_transaction(&conflict));
        assert!(!keeps_transaction(&TxnError::Fabric(FabricError::Backend(
            "gone".into()
        ))));
        // A commit decided committed whose mark could not reach the oracle: never
        // "aborted", which a client would take as safe to run again.
        let unconfirmed = TxnError::CommittedUnconfirmed {
            cid: 42,
            cause: Box::new(TxnError::Fabric(FabricError::Backend("gone".into()))),
        };
        let s = status_of(&unconfirmed, Fate::Aborted);
        assert_eq!(s.code(), Code::Unknown);
        assert!(s.message().contains("is committed"), "{}", s.message());
        assert!(!s.message().contains("aborted"), "{}", s.message());
        // A fenced commit recovery decided rolled back is safe to run again; one whose
        // outcome could not be learnt is not, and never says "aborted".
        let s = fenced_rolled_back(9);
        assert_eq!(s.code(), Code::Aborted);
        assert!(s.message().contains("run it again"), "{}", s.message());
        let s = fenced_undecided(9, &TxnError::Invalid("still recovering".into()));
        assert_eq!(s.code(), Code::Unknown);
        assert!(s.message().contains("still recovering"), "{}", s.message());
        assert!(
            s.message().contains("may have taken effect"),
            "{}",
            s.message()
        );
        assert!(!s.message().contains("aborted"), "{}", s.message());
        let s = unknown_transaction(0x12, std::time::Duration::from_millis(300));
        assert_eq!(s.code(), Code::NotFound);
        assert!(s.message().contains("expired"), "{}", s.message());
        assert!(!s.message().contains("set"), "{}", s.message());
        let s = unknown_transaction(0, std::time::Duration::from_millis(300));
        assert!(s.message().contains("`txn` set"), "{}", s.message());
    }
}
