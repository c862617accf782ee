//! What the durability and replication tests share: a compute node with a session,
//! a queue pair to the server and scratch memory.
// Each test crate uses a part of it.
#![allow(dead_code)]

use fabric::conformance::exec;
use fabric::sim::SimNetwork;
use fabric::{
    Access, CompletionQueue, Device, QueuePair, Region, RemoteAddr, SendWr, Src, WcStatus,
};
use memory_server::{Client, ClusterToken, MemoryServer};
use std::sync::Arc;

/// A compute node: a session, a connected queue pair and scratch memory.
pub struct Node {
    pub client: Client,
    _dev: Arc<dyn Device>,
    cq: Arc<dyn CompletionQueue>,
    qp: Arc<dyn QueuePair>,
    local: Region,
}

impl Node {
    pub async fn connect(server: &MemoryServer, net: &SimNetwork, token: &ClusterToken) -> Node {
        let dev: Arc<dyn Device> = net.add_node();
        let cq = dev.create_cq(64).unwrap();
        let client = Client::connect(&server.local_addr().to_string(), token)
            .await
            .unwrap();
        let (qp, _) = client.connect_qp(&*dev, &cq).await.unwrap();
        let local = dev.register(4096, Access::ALL).unwrap();
        Node {
            client,
            _dev: dev,
            cq,
            qp,
            local,
        }
    }

    pub async fn data(&self, n: usize) -> (u32, RemoteAddr) {
        let dir = self.client.list_regions().await.unwrap();
        let r = dir.get(&format!("data.{n}")).unwrap().remote;
        (r.rkey, r.at(0))
    }

    pub fn write(&self, at: RemoteAddr, offset: u64, bytes: &[u8]) {
        let wc = exec(
            &self.qp,
            &self.cq,
            SendWr::write(1, Src::Inline(bytes), at.offset_by(offset)),
        );
        assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
    }

    pub fn read(&self, at: RemoteAddr, offset: u64, len: u32) -> Vec<u8> {
        let wc = exec(
            &self.qp,
            &self.cq,
            SendWr::read(2, self.local.buf(0, len), at.offset_by(offset)),
        );
        assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
        self.local.to_vec(0, len as usize).unwrap()
    }

    /// CAS on the word at `offset`; returns the value found.
    pub fn cas(&self, at: RemoteAddr, offset: u64, expect: u64, swap: u64) -> u64 {
        let wc = exec(
            &self.qp,
            &self.cq,
            SendWr::cas(
                3,
                self.local.buf(1024, 8),
                at.offset_by(offset),
                expect,
                swap,
            ),
        );
        assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
        self.local.load_u64(1024).unwrap()
    }
}
