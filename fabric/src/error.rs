//! Errors returned synchronously by fabric calls, and completion statuses.

use crate::addr::QpEndpoint;
use thiserror::Error;

/// The status of a completion, as `ibv_wc_status`. Anything other than `Success` moves
/// the queue pair to the error state, except `WrFlush`, which is the consequence of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum WcStatus {
    #[default]
    Success,
    /// A local length error: a message longer than the receive buffer or the UD MTU.
    LocalLength,
    /// A local protection error: a bad lkey, a local buffer out of bounds, or a local
    /// buffer without `LOCAL_WRITE` that the device had to write.
    LocalProtection,
    /// Flushed: the queue pair was already in the error state.
    WrFlush,
    /// The responder rejected the request (e.g. the peer's receive buffer was too small).
    RemoteInvalidRequest,
    /// A bad rkey, an out-of-bounds remote access, a missing remote access flag, or a
    /// misaligned atomic.
    RemoteAccess,
    /// The transport gave up: the peer queue pair is gone or in the error state.
    RetryExceeded,
    /// The peer had no receive posted for a SEND through every RNR retry.
    RnrRetryExceeded,
}

impl WcStatus {
    pub fn is_ok(self) -> bool {
        self == WcStatus::Success
    }
}

impl std::fmt::Display for WcStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = match self {
            WcStatus::Success => "success",
            WcStatus::LocalLength => "local length error",
            WcStatus::LocalProtection => "local protection error",
            WcStatus::WrFlush => "work request flushed (queue pair in error state)",
            WcStatus::RemoteInvalidRequest => "remote invalid request",
            WcStatus::RemoteAccess => {
                "remote access error (bad rkey, out of bounds, missing access flag or misaligned atomic)"
            }
            WcStatus::RetryExceeded => "transport retry exceeded (peer unreachable)",
            WcStatus::RnrRetryExceeded => "receiver not ready: RNR retries exceeded",
        };
        f.write_str(s)
    }
}

/// Errors from fabric calls themselves (as opposed to completions).
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum FabricError {
    #[error("access [{offset}, {offset}+{len}) is outside the region of {region_len} bytes")]
    OutOfBounds {
        offset: u64,
        len: u64,
        region_len: u64,
    },
    #[error("offset {offset} is not 8-byte aligned")]
    Misaligned { offset: u64 },
    #[error("the {queue} queue is full ({depth} outstanding work requests)")]
    QueueFull { queue: &'static str, depth: u32 },
    #[error("queue pair is in state {state:?}, which does not allow {action}")]
    InvalidState {
        state: QpState,
        action: &'static str,
    },
    #[error("invalid work request: {0}")]
    InvalidWorkRequest(String),
    #[error("work request {index} of the batch was rejected: {source}")]
    Post {
        index: usize,
        #[source]
        source: Box<FabricError>,
    },
    #[error("no queue pair at {0}")]
    UnknownPeer(QpEndpoint),
    #[error("the completion queue overran its capacity of {capacity} entries")]
    CqOverrun { capacity: u32 },
    #[error("object belongs to another device or backend: {0}")]
    ForeignObject(&'static str),
    #[error("work request {index} of the batch completed with error: {status}")]
    Completion { status: WcStatus, index: usize },
    #[error("the region's memory is on a device in another process; use READ/WRITE")]
    NotLocal,
    #[error("{0}")]
    Backend(String),
}

/// The state of a queue pair, as far as posting is concerned.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QpState {
    /// Created, receives may be posted, sends may not (RC not connected yet).
    Init,
    /// Ready to send.
    Ready,
    /// A completion failed; every later work request is flushed until `recover`.
    Error,
}

pub type Result<T, E = FabricError> = std::result::Result<T, E>;
