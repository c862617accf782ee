//! Which byte order a NIC writes atomic results in, found by trying.
//!
//! ibverbs takes `compare_add` and `swap` in host order, but the old value an atomic
//! fetches travels in network byte order, and NICs differ in how they place it in the
//! local buffer (some Mellanox generations leave it big-endian). The fabric promises
//! the region's byte order: the little-endian encoding of the word. So a device opens
//! by connecting two queue pairs of its own to each other and fetching a known word
//! with FETCH_ADD 0; a byte-swapped answer makes the backend swap every atomic result.

use super::cq::VerbsCq;
use super::qp::VerbsQp;
use super::{AtomicResultOrder, DeviceShared, allocate};
use crate::addr::{Access, QpEndpoint};
use crate::device::{CompletionQueue, QpConfig, QueuePair};
use crate::error::{FabricError, Result, WcStatus};
use crate::wr::{Completion, SendWr};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A word whose bytes all differ, so any reordering shows.
const PATTERN: u64 = 0x0102_0304_0506_0708;

/// How long the probe waits for its completion: far above a loopback round trip, even
/// under emulation.
const PATIENCE: Duration = Duration::from_secs(5);

/// The order this device's NIC writes atomic results in; `Unchecked` if the loopback
/// probe cannot run; an error if the NIC writes something that is neither.
pub(crate) fn atomic_result_order(shared: &Arc<DeviceShared>) -> Result<AtomicResultOrder> {
    match fetch_pattern(shared) {
        Ok(got) if got == PATTERN => Ok(AtomicResultOrder::Host),
        Ok(got) if got == PATTERN.swap_bytes() => Ok(AtomicResultOrder::Network),
        Ok(got) => Err(FabricError::Backend(format!(
            "verbs: the NIC returned {got:#018x} for an atomic fetch of {PATTERN:#018x}, \
             in neither host nor network byte order; its atomics cannot be used"
        ))),
        Err(_) => Ok(AtomicResultOrder::Unchecked),
    }
}

/// FETCH_ADD 0 of `PATTERN` between two queue pairs of this device; the raw result.
fn fetch_pattern(shared: &Arc<DeviceShared>) -> Result<u64> {
    let cq: Arc<dyn CompletionQueue> = Arc::new(VerbsCq::new(shared, 4)?);
    let config = QpConfig {
        max_send_wr: 4,
        max_recv_wr: 1,
        ..QpConfig::rc(&cq)
    };
    let (a, b) = (
        VerbsQp::create(shared, &config)?,
        VerbsQp::create(shared, &config)?,
    );
    let endpoint = |qp: &VerbsQp| QpEndpoint {
        node: shared.node,
        qpn: qp.qpn(),
    };
    a.connect_at(endpoint(&b), shared.local)?;
    b.connect_at(endpoint(&a), shared.local)?;
    let region = allocate(shared, 16, Access::ALL)?;
    region.store_u64(0, PATTERN)?;
    a.post_send(&[SendWr::fetch_add(
        0,
        region.buf(8, 8),
        region.remote_addr(0),
        0,
    )])?;
    let deadline = Instant::now() + PATIENCE;
    let mut out = [Completion::default()];
    while cq.poll(&mut out)? == 0 {
        if Instant::now() > deadline {
            return Err(FabricError::Backend("verbs: no loopback completion".into()));
        }
        std::thread::yield_now();
    }
    if out[0].status != WcStatus::Success {
        return Err(FabricError::Completion {
            status: out[0].status,
            index: 0,
        });
    }
    region.load_u64(8)
}
