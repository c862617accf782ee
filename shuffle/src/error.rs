//! What can go wrong in a shuffle.

use fabric::{FabricError, WcStatus};
use std::time::Duration;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum ShuffleError {
    #[error("fabric: {0}")]
    Fabric(#[from] FabricError),
    /// A work request completed with an error: the peer died, a key was bad, or the
    /// queue pair was flushed.
    #[error("{what} failed: {status}")]
    Completion {
        what: &'static str,
        status: WcStatus,
    },
    /// The stream did not end in time. For UD this is how a lost datagram shows up:
    /// `expected` packets were announced by the source, `received` arrived.
    #[error(
        "timed out after {waited:?} waiting for {what}{}",
        counts.map(|(e, r)| format!(" ({r} of {e} packets from the slowest source arrived; datagrams were lost)")).unwrap_or_default()
    )]
    Timeout {
        what: String,
        waited: Duration,
        counts: Option<(u64, u64)>,
    },
    /// The out-of-band exchange between nodes failed (a peer went away, bad bytes).
    #[error("exchange with peers: {0}")]
    Exchange(String),
    #[error("invalid argument: {0}")]
    Invalid(String),
    /// A message that does not decode: corrupted, or from a mismatched peer.
    #[error("malformed message from {from}: {why}")]
    Malformed { from: String, why: String },
    #[error("buffer pool exhausted: {pinned} bytes pinned, limit {limit}")]
    PoolExhausted { pinned: u64, limit: u64 },
}

pub type Result<T, E = ShuffleError> = std::result::Result<T, E>;
