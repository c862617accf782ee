//! What a memory server reports about itself.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// The RPCs of both services (control plane and remote verbs), for counting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Rpc {
    Hello,
    Authenticate,
    ListRegions,
    Connect,
    Disconnect,
    KeepAlive,
    EndSession,
    Fence,
    Stats,
    Persist,
    BorrowRegion,
    ReturnRegion,
    DeviceInfo,
    AddPeer,
    RegisterRegion,
    DeregisterRegion,
    CreateCq,
    DestroyCq,
    PollCq,
    CreateQp,
    ConnectQp,
    PostSend,
    PostRecv,
    QueryQp,
    RecoverQp,
    DestroyQp,
}

impl Rpc {
    const ALL: [Rpc; 26] = [
        Rpc::Hello,
        Rpc::Authenticate,
        Rpc::ListRegions,
        Rpc::Connect,
        Rpc::Disconnect,
        Rpc::KeepAlive,
        Rpc::EndSession,
        Rpc::Fence,
        Rpc::Stats,
        Rpc::Persist,
        Rpc::BorrowRegion,
        Rpc::ReturnRegion,
        Rpc::DeviceInfo,
        Rpc::AddPeer,
        Rpc::RegisterRegion,
        Rpc::DeregisterRegion,
        Rpc::CreateCq,
        Rpc::DestroyCq,
        Rpc::PollCq,
        Rpc::CreateQp,
        Rpc::ConnectQp,
        Rpc::PostSend,
        Rpc::PostRecv,
        Rpc::QueryQp,
        Rpc::RecoverQp,
        Rpc::DestroyQp,
    ];

    /// The method name in the proto.
    pub fn name(self) -> &'static str {
        match self {
            Rpc::Hello => "Hello",
            Rpc::Authenticate => "Authenticate",
            Rpc::ListRegions => "ListRegions",
            Rpc::Connect => "ConnectQueuePair",
            Rpc::Disconnect => "DisconnectQueuePair",
            Rpc::KeepAlive => "KeepAlive",
            Rpc::EndSession => "EndSession",
            Rpc::Fence => "Fence",
            Rpc::Stats => "Stats",
            Rpc::Persist => "Persist",
            Rpc::BorrowRegion => "BorrowRegion",
            Rpc::ReturnRegion => "ReturnRegion",
            Rpc::DeviceInfo => "DeviceInfo",
            Rpc::AddPeer => "AddPeer",
            Rpc::RegisterRegion => "RegisterRegion",
            Rpc::DeregisterRegion => "DeregisterRegion",
            Rpc::CreateCq => "CreateCq",
            Rpc::DestroyCq => "DestroyCq",
            Rpc::PollCq => "PollCq",
            Rpc::CreateQp => "CreateQp",
            Rpc::ConnectQp => "ConnectQp",
            Rpc::PostSend => "PostSend",
            Rpc::PostRecv => "PostRecv",
            Rpc::QueryQp => "QueryQp",
            Rpc::RecoverQp => "RecoverQp",
            Rpc::DestroyQp => "DestroyQp",
        }
    }
}

/// Counters bumped by the control plane (never by the data path, which the server does
/// not see).
#[derive(Default)]
pub(crate) struct Counters {
    rpcs: [AtomicU64; Rpc::ALL.len()],
    auth_failures: AtomicU64,
}

impl Counters {
    pub fn rpc(&self, rpc: Rpc) {
        self.rpcs[rpc as usize].fetch_add(1, Ordering::Relaxed);
    }

    pub fn auth_failure(&self) {
        self.auth_failures.fetch_add(1, Ordering::Relaxed);
    }

    pub fn rpc_counts(&self) -> BTreeMap<String, u64> {
        Rpc::ALL
            .iter()
            .map(|&r| {
                (
                    r.name().to_string(),
                    self.rpcs[r as usize].load(Ordering::Relaxed),
                )
            })
            .collect()
    }

    pub fn auth_failures(&self) -> u64 {
        self.auth_failures.load(Ordering::Relaxed)
    }
}

/// A snapshot of a memory server's statistics.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Stats {
    /// Bytes of memory backing regions, after rounding to pages.
    pub bytes_allocated: u64,
    /// Bytes registered with the device.
    pub bytes_registered: u64,
    pub regions: u32,
    pub huge_page_regions: u32,
    pub sessions: u32,
    pub queue_pairs: u32,
    pub uptime: Duration,
    /// RPCs received since start, by method name (every method is present).
    pub rpc_counts: BTreeMap<String, u64>,
    /// Refused Authenticate calls.
    pub auth_failures: u64,
    /// Whether the server keeps a data directory (the rest is zero when not).
    pub durable: bool,
    /// Starts on the data directory, this one included.
    pub boot: u64,
    /// Persist requests accepted, the ranges they named, and the bytes journaled.
    pub persist_requests: u64,
    pub persist_ranges: u64,
    pub journaled_bytes: u64,
    /// Journal fdatasyncs (one per group commit).
    pub journal_fsyncs: u64,
    /// Checkpoints since start, and how long the last one took.
    pub checkpoints: u64,
    pub last_checkpoint: Duration,
    /// Bytes of the regions live sessions hold (borrowed, or registered through remote
    /// verbs), on top of `bytes_allocated`.
    pub session_region_bytes: u64,
}

impl Stats {
    /// How many times `method` was called (0 for a name the server does not know).
    pub fn rpc_count(&self, method: &str) -> u64 {
        self.rpc_counts.get(method).copied().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_are_per_method() {
        let c = Counters::default();
        c.rpc(Rpc::Hello);
        c.rpc(Rpc::Hello);
        c.rpc(Rpc::Stats);
        c.auth_failure();
        let counts = c.rpc_counts();
        assert_eq!(counts.len(), Rpc::ALL.len());
        assert_eq!(counts["Hello"], 2);
        assert_eq!(counts["Stats"], 1);
        assert_eq!(counts["ConnectQueuePair"], 0);
        assert_eq!(c.auth_failures(), 1);
    }
}
