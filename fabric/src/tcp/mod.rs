//! The `tcp` backend: hosts without RDMA NICs.
//!
//! Every device runs a soft-NIC: a TCP listener whose per-connection responder threads
//! execute one-sided operations on the device's registered memory and deliver SENDs to
//! its queue pairs, with every protection check (rkey, bounds, access flags,
//! alignment) on the responder's side. An RC queue pair is one TCP connection from
//! requester to responder; a batch of work requests is one frame (one write: the
//! doorbell), frames are pipelined, and responses come back in order, so RC ordering
//! is TCP's. UD queue pairs are datagrams over UDP on the same port number, demultiplexed
//! by queue-pair number. Connections authenticate with the cluster token (mutual
//! HMAC-SHA256 challenge-response; the token never crosses the wire).
//!
//! The requester side has no threads: polling a completion queue reads whatever
//! responses have arrived, as a NIC's completions would. (A destroyed queue pair's
//! connection is closed on a short-lived thread, so that no request is lost to a reset.)

mod qp;
mod responder;
mod wire;

use crate::addr::{Access, NodeId};
use crate::cq::SoftCq;
use crate::device::{CompletionQueue, Device, QpConfig, QueuePair};
use crate::engine::NewQp;
use crate::error::{FabricError, Result};
use crate::memory::{HeapMemory, Memory};
use crate::region::Region;
use crate::registry::{self, Registry};
use crate::serve::{Connections, Server};
use qp::{QpShared, TcpQp};
use std::collections::HashMap;
use std::io::ErrorKind;
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs, UdpSocket};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, RwLock, Weak};
use std::time::Duration;

pub(crate) struct TcpNode {
    id: NodeId,
    addr: SocketAddr,
    token: Vec<u8>,
    regions: Registry,
    qps: RwLock<HashMap<u32, Weak<QpShared>>>,
    next_qpn: AtomicU32,
    peers: RwLock<HashMap<NodeId, SocketAddr>>,
    udp: UdpSocket,
    shutdown: AtomicBool,
    /// Live responder connections, so that shutting the device down closes them.
    connections: Connections<TcpStream>,
}

impl AsRef<Registry> for TcpNode {
    fn as_ref(&self) -> &Registry {
        &self.regions
    }
}

impl TcpNode {
    pub(crate) fn qp(&self, qpn: u32) -> Option<Arc<QpShared>> {
        self.qps
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&qpn)?
            .upgrade()
    }

    fn forget_qp(&self, qpn: u32) {
        self.qps
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&qpn);
    }

    pub(crate) fn peer(&self, node: NodeId) -> Option<SocketAddr> {
        self.peers
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&node)
            .copied()
    }
}

impl Server<TcpStream> for TcpNode {
    fn connections(&self) -> &Connections<TcpStream> {
        &self.connections
    }

    fn is_shut_down(&self) -> bool {
        self.shutdown.load(Ordering::Acquire)
    }
}

/// A tcp device: one node with its soft-NIC. Dropping it stops the soft-NIC.
pub struct TcpDevice {
    node: Arc<TcpNode>,
}

impl TcpDevice {
    /// Binds the soft-NIC to `addr` (e.g. `127.0.0.1:0` for an ephemeral port) with a
    /// random node id. Peers must present the same cluster `token`.
    pub fn bind(addr: &str, token: &[u8]) -> Result<Arc<TcpDevice>> {
        TcpDevice::bind_as(addr, token, NodeId(rand::random()))
    }

    /// As [`TcpDevice::bind`], with a chosen node id (unique in the cluster).
    pub fn bind_as(addr: &str, token: &[u8], id: NodeId) -> Result<Arc<TcpDevice>> {
        if token.is_empty() {
            return Err(FabricError::Backend("the cluster token is empty".into()));
        }
        let io =
            |what: &str, e: std::io::Error| FabricError::Backend(format!("{what} {addr}: {e}"));
        // UD uses the UDP port of the listener's number. With an ephemeral port the
        // kernel picks a free TCP port whose UDP twin may be taken (by another process's
        // ephemeral UDP socket): then another TCP port is tried.
        let ephemeral = addr.rsplit_once(':').is_some_and(|(_, port)| port == "0");
        let mut attempts = 0;
        let (listener, bound, udp) = loop {
            attempts += 1;
            let listener = TcpListener::bind(addr).map_err(|e| io("cannot listen on", e))?;
            let bound = listener
                .local_addr()
                .map_err(|e| io("cannot read the address of", e))?;
            // Peers dial the address this device advertises; a wildcard names no host.
            if bound.ip().is_unspecified() {
                return Err(FabricError::Backend(format!(
                    "cannot advertise the wildcard address {bound}: bind the soft-NIC to the \
                     address peers reach this host at (e.g. 10.0.0.5:0, or 127.0.0.1:0 on one \
                     host)"
                )));
            }
            match UdpSocket::bind(bound) {
                Ok(udp) => break (listener, bound, udp),
                Err(e) if ephemeral && e.kind() == ErrorKind::AddrInUse && attempts < 32 => {}
                Err(e) => return Err(io("cannot bind UDP on", e)),
            }
        };
        udp.set_read_timeout(Some(Duration::from_millis(50)))
            .map_err(|e| io("cannot configure UDP on", e))?;
        let node = Arc::new(TcpNode {
            id,
            addr: bound,
            token: token.to_vec(),
            regions: Registry::default(),
            qps: RwLock::new(HashMap::new()),
            next_qpn: AtomicU32::new(1),
            peers: RwLock::new(HashMap::new()),
            udp,
            shutdown: AtomicBool::new(false),
            connections: Connections::new(),
        });
        let accept_node = node.clone();
        std::thread::Builder::new()
            .name(format!("tcp-nic-{}", bound.port()))
            .spawn(move || responder::accept_loop(accept_node, listener))
            .map_err(|e| io("cannot start the soft-NIC for", e))?;
        let udp_node = node.clone();
        std::thread::Builder::new()
            .name(format!("tcp-ud-{}", bound.port()))
            .spawn(move || responder::datagram_loop(udp_node))
            .map_err(|e| io("cannot start the UD receiver for", e))?;
        Ok(Arc::new(TcpDevice { node }))
    }

    /// The socket address the soft-NIC listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.node.addr
    }
}

impl Drop for TcpDevice {
    fn drop(&mut self) {
        self.node.shutdown.store(true, Ordering::Release);
        // Wakes the accept loop, which sees the flag and exits.
        let _ = TcpStream::connect_timeout(&self.node.addr, Duration::from_millis(100));
        self.node.connections.close_all();
    }
}

/// Parses `tcp:HOST:PORT`.
fn parse_address(address: &str) -> Result<SocketAddr> {
    let rest = address.strip_prefix("tcp:").ok_or_else(|| {
        FabricError::Backend(format!(
            "`{address}` is not a tcp address (expected tcp:HOST:PORT)"
        ))
    })?;
    rest.to_socket_addrs()
        .map_err(|e| FabricError::Backend(format!("cannot resolve `{address}`: {e}")))?
        .next()
        .ok_or_else(|| FabricError::Backend(format!("`{address}` resolves to nothing")))
}

impl Device for TcpDevice {
    fn node(&self) -> NodeId {
        self.node.id
    }

    fn backend(&self) -> &'static str {
        "tcp"
    }

    fn address(&self) -> String {
        format!("tcp:{}", self.node.addr)
    }

    fn add_peer(&self, node: NodeId, address: &str) -> Result<()> {
        let addr = parse_address(address)?;
        self.node
            .peers
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(node, addr);
        Ok(())
    }

    fn register(&self, len: u64, access: Access) -> Result<Region> {
        let memory = HeapMemory::new(len).map_err(|e| FabricError::Backend(e.to_string()))?;
        self.register_memory(Arc::new(memory), len, access)
    }

    fn register_memory(&self, mem: Arc<dyn Memory>, len: u64, access: Access) -> Result<Region> {
        registry::register_region(&self.node, self.node.id, mem, len, access)
    }

    fn create_cq(&self, capacity: u32) -> Result<Arc<dyn CompletionQueue>> {
        SoftCq::create(capacity)
    }

    fn create_qp(&self, config: &QpConfig) -> Result<Arc<dyn QueuePair>> {
        let new = NewQp::prepare(config, self.node.id, &self.node.next_qpn)?;
        let qpn = new.endpoint.qpn;
        let shared = QpShared::new(self.node.clone(), new);
        self.node
            .qps
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(qpn, Arc::downgrade(&shared));
        Ok(Arc::new(TcpQp::new(shared)))
    }
}

#[cfg(test)]
mod tests;
