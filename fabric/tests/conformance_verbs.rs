//! The conformance suite on the verbs backend: every device a `VerbsDevice` on the
//! first RDMA device of the host (Soft-RoCE in CI, inside a QEMU guest:
//! `scripts/softroce-vm.sh`).
//!
//! Without an RDMA device each case says so and passes vacuously, unless
//! `NAMDB_VERBS_REQUIRED=1` (as in the guest), which makes that a failure.
#![cfg(all(feature = "verbs", target_os = "linux", not(fabric_loom)))]

use fabric::conformance::Backend;
use fabric::verbs::{AtomicResultOrder, VerbsConfig, VerbsDevice};
use fabric::{Device, NodeId};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

struct Verbs;

const TOKEN: &[u8] = b"verbs conformance token";

fn open(node: u32) -> fabric::Result<Arc<VerbsDevice>> {
    VerbsDevice::open(&VerbsConfig::new(NodeId(node)), TOKEN)
}

impl Verbs {
    /// The backend, or `None` (after saying why) when there is no RDMA device and none
    /// is required.
    fn available() -> Option<Verbs> {
        match open(0) {
            Ok(_) => Some(Verbs),
            Err(e) if std::env::var_os("NAMDB_VERBS_REQUIRED").is_some() => {
                panic!("NAMDB_VERBS_REQUIRED is set, but: {e}")
            }
            Err(e) => {
                eprintln!("skipped: the verbs backend needs an RDMA device: {e}");
                None
            }
        }
    }
}

impl Backend for Verbs {
    fn devices(&self, nodes: usize) -> Vec<Arc<dyn Device>> {
        // Node ids unique in this process: a UD receive names its sender by them.
        static NEXT: AtomicU32 = AtomicU32::new(1);
        (0..nodes)
            .map(|_| {
                open(NEXT.fetch_add(1, Ordering::Relaxed)).expect("open the RDMA device")
                    as Arc<dyn Device>
            })
            .collect()
    }
}

fabric::conformance_tests!(match Verbs::available() {
    Some(backend) => backend,
    None => return,
});

/// The device found the order its NIC writes atomic results in (rxe: host order) by
/// a FETCH_ADD to itself at open; an RDMA device that loops back leaves nothing
/// unchecked.
#[test]
fn atomic_result_byte_order_is_probed_at_open() {
    let Some(_) = Verbs::available() else { return };
    let device = open(0).expect("open the RDMA device");
    assert_ne!(device.atomic_result_order(), AtomicResultOrder::Unchecked);
}

#[test]
fn without_a_device_the_error_names_the_problem() {
    match open(0) {
        Ok(device) => assert_eq!(device.backend(), "verbs"),
        Err(e) => assert!(e.to_string().starts_with("no RDMA device found"), "{e}"),
    }
}
