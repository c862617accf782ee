//! Errors of the oracle client.

use fabric::FabricError;
use thiserror::Error;

/// Why an oracle call failed. Every variant is something a caller can act on: fix its
/// input, refresh and retry, re-register, or give the connection up.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum OracleError {
    #[error("invalid oracle layout: {0}")]
    InvalidLayout(String),
    #[error("invalid oracle configuration: {0}")]
    InvalidConfig(String),
    #[error("the region holds no timestamp oracle (magic {magic:#018x})")]
    NotAnOracle { magic: u64 },
    #[error("the oracle has layout version {found}, this client speaks {expected}")]
    VersionMismatch { found: u64, expected: u64 },
    #[error("the oracle needs a region of {need} bytes, this one has {have}")]
    RegionTooSmall { need: u64, have: u64 },
    #[error("the oracle region is corrupt: {0}")]
    Corrupt(String),
    #[error("fabric error: {0}")]
    Fabric(#[from] FabricError),
    #[error("all {slots} slots of the oracle are held")]
    NoFreeSlot { slots: u32 },
    #[error("slot {slot} was fenced: its lease expired and another node took it; re-register")]
    Fenced { slot: u32 },
    #[error("the slot was released")]
    Released,
    #[error("timestamp {ts} is not an outstanding commit timestamp of this slot")]
    NotOutstanding { ts: u64 },
    #[error(
        "timestamp {ts} may not be used before {blocked_by} is decided (wrap rule; known prefix {prefix}): refresh the read timestamp and retry"
    )]
    WrapBlocked {
        ts: u64,
        blocked_by: u64,
        prefix: u64,
    },
    #[error(
        "timestamp {ts} is beyond the slot's reservation ({horizon}): call tick or acquire_commit_ts"
    )]
    ReservationExhausted { ts: u64, horizon: u64 },
    #[error(
        "the slot's lease must be renewed before it hands out or decides timestamps: call renew, tick or acquire_commit_ts"
    )]
    RenewalDue,
    #[error("{count} commit timestamps are still outstanding; mark them before releasing")]
    Outstanding { count: usize },
    #[error("the commit timestamp stayed blocked after {attempts} refreshes: {last}")]
    Stalled {
        attempts: u32,
        last: Box<OracleError>,
    },
}

pub type Result<T, E = OracleError> = std::result::Result<T, E>;
