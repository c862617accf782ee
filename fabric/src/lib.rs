//! `fabric`: the namdb verbs abstraction.
//!
//! The API follows ibverbs closely so that the hardware backend is a thin mapping and
//! the protocols above never rely on more than an RDMA NIC gives:
//!
//! - [`Device`]: a node's NIC and protection domain; registers [`Region`]s with
//!   [`Access`] flags. A remote address is `(node, rkey, offset)` ([`RemoteAddr`]).
//! - [`QueuePair`]: RC (connected, reliable, ordered) or UD (datagrams of at most
//!   [`UD_MTU`] bytes, unordered, lossy). [`QueuePair::post_send`] takes a batch of
//!   [`SendWr`] with one doorbell; [`QueuePair::post_recv`] posts receives.
//! - [`CompletionQueue`]: polled n at a time for [`Completion`]s.
//! - Errors behave as on hardware: a bad rkey, an out-of-bounds access, a missing access
//!   flag or a misaligned atomic completes with [`WcStatus::RemoteAccess`] and moves the
//!   queue pair to the error state, which flushes every later request; a SEND with no
//!   posted receive is retried (RNR) and then fails with [`WcStatus::RnrRetryExceeded`].
//! - [`AsyncQp`]: futures for one request or a batch, driven by polling the CQ.
//!
//! Backends: [`sim`] (in-process, deterministic, fault injection, cost model, loom),
//! `tcp`, `shm`, and, with the `verbs` feature, `verbs` (rdma-core).
//! Region memory is heap memory ([`HeapMemory`]) or, on Linux, a shareable memfd
//! mapping on huge pages where possible (`memfd::MemfdMemory`).
//! The [`conformance`] suite is what every backend must pass.

mod addr;
mod async_qp;
pub mod conformance;
mod cq;
mod device;
mod doorbell;
mod engine;
mod error;
#[cfg(not(fabric_loom))]
mod handshake;
#[cfg(all(target_os = "linux", not(fabric_loom)))]
pub mod memfd;
mod memory;
mod region;
mod registry;
#[cfg(not(fabric_loom))]
mod serve;
#[cfg(all(target_os = "linux", not(fabric_loom)))]
pub mod shm;
pub mod sim;
mod sync;
#[cfg(not(fabric_loom))]
pub mod tcp;
mod validate;
#[cfg(all(feature = "verbs", target_os = "linux", not(fabric_loom)))]
pub mod verbs;
mod wr;

pub use addr::{Access, LocalBuf, NodeId, QpEndpoint, RemoteAddr, RemoteRegion, UdDest};
pub use async_qp::{AsyncQp, Batch, CqDriver};
pub use device::{CompletionQueue, Device, QpConfig, QpKind, QueuePair};
pub use doorbell::{DoorbellHold, hold_doorbells, ring_held_doorbells};
pub use error::{FabricError, QpState, Result, WcStatus};
#[cfg(all(target_os = "linux", not(fabric_loom)))]
pub use memfd::{HugePages, MemfdError, MemfdMemory};
pub use memory::{
    ElsewhereMemory, HeapMemory, HostMemory, Memory, PREFETCH_AHEAD_BYTES, copy_between, prefetch,
};
pub use region::Region;
pub use sync::Ordering;
pub use wr::{Completion, GRH_BYTES, RecvWr, SendWr, Src, UD_MTU, WcOpcode, WrOp};

use std::sync::Arc;

/// Creates an RC queue pair on each of two devices and connects them to each other,
/// each with its own completion queue for sends and receives.
pub fn connect_rc(
    a: (&dyn Device, &Arc<dyn CompletionQueue>),
    b: (&dyn Device, &Arc<dyn CompletionQueue>),
) -> Result<(Arc<dyn QueuePair>, Arc<dyn QueuePair>)> {
    connect_rc_with(a, b, |c| c)
}

/// As [`connect_rc`], with the configurations adjusted by `tune` first.
pub fn connect_rc_with(
    a: (&dyn Device, &Arc<dyn CompletionQueue>),
    b: (&dyn Device, &Arc<dyn CompletionQueue>),
    tune: impl Fn(QpConfig) -> QpConfig,
) -> Result<(Arc<dyn QueuePair>, Arc<dyn QueuePair>)> {
    a.0.add_peer(b.0.node(), &b.0.address())?;
    b.0.add_peer(a.0.node(), &a.0.address())?;
    let qa = a.0.create_qp(&tune(QpConfig::rc(a.1)))?;
    let qb = b.0.create_qp(&tune(QpConfig::rc(b.1)))?;
    qa.connect(qb.endpoint())?;
    qb.connect(qa.endpoint())?;
    Ok((qa, qb))
}
