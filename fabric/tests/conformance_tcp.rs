//! The conformance suite on the tcp backend: every device a soft-NIC on loopback.
#![cfg(not(fabric_loom))]

use fabric::Device;
use fabric::conformance::Backend;
use fabric::tcp::TcpDevice;
use std::sync::Arc;

struct Tcp;

impl Backend for Tcp {
    fn devices(&self, nodes: usize) -> Vec<Arc<dyn Device>> {
        (0..nodes)
            .map(|_| {
                TcpDevice::bind("127.0.0.1:0", b"conformance token").expect("bind")
                    as Arc<dyn Device>
            })
            .collect()
    }
    /// Datagrams travel over UDP, which may drop under load.
    fn ud_may_drop(&self) -> bool {
        true
    }
}

fabric::conformance_tests!(Tcp);
