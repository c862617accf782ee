//! The conformance suite with the memory server as a separate process on the tcp
//! backend: the suite's server device is the process's own, driven over remote verbs,
//! and its client is a tcp device in this process.

mod common;

use fabric::Device;
use fabric::conformance::Backend;
use fabric::tcp::TcpDevice;
use memory_server::ClusterToken;
use std::sync::Arc;

struct ProcessTcp;

fn tcp_device(token: &ClusterToken) -> Arc<dyn Device> {
    TcpDevice::bind("127.0.0.1:0", token.secret()).expect("bind") as Arc<dyn Device>
}

impl Backend for ProcessTcp {
    fn devices(&self, nodes: usize) -> Vec<Arc<dyn Device>> {
        common::process_devices("tcp", nodes, tcp_device)
    }
    /// Datagrams travel over UDP, which may drop under load.
    fn ud_may_drop(&self) -> bool {
        true
    }
}

fabric::conformance_tests!(ProcessTcp);

#[test]
fn a_fenced_incarnations_queue_pairs_reach_nothing() {
    common::fence_cuts_off_an_incarnation("tcp", tcp_device);
}
