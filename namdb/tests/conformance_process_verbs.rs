//! The conformance suite with the memory server as a separate process on the verbs
//! backend: the suite's server device is the process's own, driven over remote verbs,
//! and its client is a verbs device in this process. Queue-pair information crosses
//! between the processes over the memory server's gRPC control plane.
//!
//! Without an RDMA device each case says so and passes vacuously, unless
//! `NAMDB_VERBS_REQUIRED=1` (as in CI's Soft-RoCE guest), which makes that a failure.
#![cfg(all(feature = "verbs", target_os = "linux"))]

mod common;

use fabric::conformance::Backend;
use fabric::verbs::{VerbsConfig, VerbsDevice};
use fabric::{Device, NodeId};
use memory_server::ClusterToken;
use std::sync::Arc;

struct ProcessVerbs;

impl ProcessVerbs {
    fn available() -> Option<ProcessVerbs> {
        match VerbsDevice::open(&VerbsConfig::new(NodeId(0)), b"probe") {
            Ok(_) => Some(ProcessVerbs),
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

fn verbs_device(token: &ClusterToken) -> Arc<dyn Device> {
    let config = VerbsConfig::new(NodeId(rand::random()));
    VerbsDevice::open(&config, token.secret()).expect("open the RDMA device") as Arc<dyn Device>
}

impl Backend for ProcessVerbs {
    fn devices(&self, nodes: usize) -> Vec<Arc<dyn Device>> {
        common::process_devices("verbs", nodes, verbs_device)
    }
}

fabric::conformance_tests!(match ProcessVerbs::available() {
    Some(backend) => backend,
    None => return,
});

#[test]
fn a_fenced_incarnations_queue_pairs_reach_nothing() {
    if ProcessVerbs::available().is_some() {
        common::fence_cuts_off_an_incarnation("verbs", verbs_device);
    }
}
