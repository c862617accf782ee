//! The in-process `sim` backend.
//!
//! Every operation applies at post time, on the posting thread, so interleavings are
//! those of the threads that post and nothing else: deterministic for one thread, and
//! explorable by loom under `cfg(fabric_loom)`. Faults (torn reads, UD reordering and
//! drops, delays) and a latency/bandwidth cost model are opt-in through [`SimConfig`].

mod cost;
mod qp;

pub use cost::CostModel;

use crate::addr::{Access, NodeId, QpEndpoint};
use crate::cq::SoftCq;
use crate::device::{CompletionQueue, Device, QpConfig, QueuePair};
use crate::engine::{NewQp, QpHandle};
use crate::error::{FabricError, Result};
use crate::memory::{HeapMemory, Memory};
use crate::region::Region;
use crate::registry::{self, Registry};
use crate::sync::{self, AtomicU32, Mutex, RwLock};
use qp::{SimPort, SimQpInner, SimRecv, SimSend};
use std::collections::HashMap;
use std::sync::{Arc, Weak};
use std::time::Duration;

/// Fault injection. All off by default.
#[derive(Clone, Debug, PartialEq)]
pub struct Faults {
    /// Probability that a multi-word READ or WRITE pauses at a random 8-byte boundary,
    /// so a concurrent WRITE can land in the middle of it.
    pub tear_probability: f64,
    /// How long a torn operation pauses between its halves.
    pub tear_pause: Duration,
    /// Probability that a UD datagram is held back and delivered after the next one.
    pub ud_reorder_probability: f64,
    /// Probability that a UD datagram is dropped.
    pub ud_drop_probability: f64,
    /// Extra delay, uniform in the range, before each completion becomes visible.
    pub completion_delay: Option<(Duration, Duration)>,
    /// Every WRITE that spans more than one 8-byte word places its last word first,
    /// pauses for `tear_pause`, then places the rest: a NIC that does not place a
    /// message in address order, as the IBA allows. The network's devices then say
    /// so ([`crate::Device::orders_write_placement`]).
    pub write_last_word_first: bool,
}

impl Default for Faults {
    fn default() -> Faults {
        Faults {
            tear_probability: 0.0,
            tear_pause: Duration::from_micros(20),
            ud_reorder_probability: 0.0,
            ud_drop_probability: 0.0,
            completion_delay: None,
            write_last_word_first: false,
        }
    }
}

impl Faults {
    /// Every fault at a rate that tests hit often: what the conformance suite runs with.
    pub fn aggressive() -> Faults {
        Faults {
            tear_probability: 0.5,
            tear_pause: Duration::from_micros(20),
            ud_reorder_probability: 0.3,
            ud_drop_probability: 0.0,
            completion_delay: Some((Duration::ZERO, Duration::from_micros(50))),
            // Not a fault against the model, which promises placement in address
            // order; tests that want it turn it on.
            write_last_word_first: false,
        }
    }
}

/// Configuration of a simulated network.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SimConfig {
    pub faults: Faults,
    pub cost: Option<CostModel>,
    /// Seeds every random choice the sim makes (fault injection).
    pub seed: u64,
    /// Back every page of a region when it is registered ([`HeapMemory::pinned`]), as
    /// an RNIC pins registered memory, rather than as it is first touched. Costs the
    /// whole of each region in memory and setup time (the kernel zeroes it then);
    /// saves a run the page faults. Off by default: tests make many large regions
    /// and touch little of them.
    pub pin_memory: bool,
}

/// A simulated network: create one, add nodes, and connect their queue pairs.
#[derive(Clone)]
pub struct SimNetwork {
    inner: Arc<NetInner>,
}

pub(crate) struct NetInner {
    pub(crate) config: SimConfig,
    nodes: RwLock<Vec<Arc<NodeInner>>>,
}

impl NetInner {
    pub(crate) fn node(&self, id: NodeId) -> Option<Arc<NodeInner>> {
        sync::read(&self.nodes).get(id.0 as usize).cloned()
    }

    pub(crate) fn qp(&self, ep: QpEndpoint) -> Option<Arc<SimQpInner>> {
        self.node(ep.node)?.qp(ep.qpn)
    }
}

impl SimNetwork {
    pub fn new(config: SimConfig) -> SimNetwork {
        SimNetwork {
            inner: Arc::new(NetInner {
                config,
                nodes: RwLock::new(Vec::new()),
            }),
        }
    }

    pub fn config(&self) -> &SimConfig {
        &self.inner.config
    }

    /// Adds a node (a device) to the network.
    pub fn add_node(&self) -> Arc<SimDevice> {
        let mut nodes = sync::write(&self.inner.nodes);
        let node = Arc::new(NodeInner {
            id: NodeId(nodes.len() as u32),
            regions: Registry::default(),
            qps: RwLock::new(HashMap::new()),
            next_qpn: AtomicU32::new(1),
            port: Mutex::new(cost::Port::new()),
        });
        nodes.push(node.clone());
        Arc::new(SimDevice {
            net: self.inner.clone(),
            node,
        })
    }
}

pub(crate) struct NodeInner {
    pub(crate) id: NodeId,
    regions: Registry,
    qps: RwLock<HashMap<u32, Weak<SimQpInner>>>,
    next_qpn: AtomicU32,
    pub(crate) port: Mutex<cost::Port>,
}

impl AsRef<Registry> for NodeInner {
    fn as_ref(&self) -> &Registry {
        &self.regions
    }
}

impl NodeInner {
    #[cfg(test)]
    pub(crate) fn region(&self, key: u32) -> Option<Arc<crate::registry::RegEntry>> {
        registry::lookup(&self.regions, key)
    }

    pub(crate) fn qp(&self, qpn: u32) -> Option<Arc<SimQpInner>> {
        sync::read(&self.qps).get(&qpn)?.upgrade()
    }

    pub(crate) fn forget_qp(&self, qpn: u32) {
        sync::write(&self.qps).remove(&qpn);
    }
}

/// One node of a [`SimNetwork`].
pub struct SimDevice {
    net: Arc<NetInner>,
    node: Arc<NodeInner>,
}

impl Device for SimDevice {
    fn node(&self) -> NodeId {
        self.node.id
    }

    fn backend(&self) -> &'static str {
        "sim"
    }

    fn orders_write_placement(&self) -> bool {
        !self.net.config.faults.write_last_word_first
    }

    fn address(&self) -> String {
        format!("sim:{}", self.node.id.0)
    }

    /// Every node of a network reaches every other; this only checks that the address
    /// names `node` in this network.
    fn add_peer(&self, node: NodeId, address: &str) -> Result<()> {
        if address != format!("sim:{}", node.0) {
            return Err(FabricError::Backend(format!(
                "`{address}` is not the sim address of {node} (expected `sim:{}`)",
                node.0
            )));
        }
        if self.net.node(node).is_none() {
            return Err(FabricError::Backend(format!(
                "{node} is not part of this sim network"
            )));
        }
        Ok(())
    }

    fn register(&self, len: u64, access: Access) -> Result<Region> {
        let memory = if self.net.config.pin_memory {
            HeapMemory::pinned(len).map_err(|e| {
                FabricError::Backend(format!("cannot pin a region of {len} bytes: {e}"))
            })?
        } else {
            HeapMemory::new(len).map_err(|e| FabricError::Backend(e.to_string()))?
        };
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
        let endpoint = new.endpoint;
        let seed = self.net.config.seed ^ ((endpoint.node.0 as u64) << 32 | endpoint.qpn as u64);
        let port = SimPort {
            net: self.net.clone(),
            node: self.node.clone(),
        };
        let inner = crate::engine::Qp::new(port, new, SimSend::new(seed), SimRecv::default());
        sync::write(&self.node.qps).insert(endpoint.qpn, Arc::downgrade(&inner));
        Ok(Arc::new(QpHandle(inner)))
    }
}

#[cfg(all(test, not(fabric_loom)))]
mod tests {
    use super::*;

    #[test]
    fn reused_slots_get_fresh_keys() {
        let net = SimNetwork::new(SimConfig::default());
        let dev = net.add_node();
        let first = dev.register(64, Access::ALL).unwrap();
        let old_key = first.rkey();
        drop(first);
        let second = dev.register(64, Access::ALL).unwrap();
        assert_ne!(
            second.rkey(),
            old_key,
            "a stale rkey must not name the new region"
        );
        assert!(dev.node.region(old_key).is_none());
        assert!(dev.node.region(second.rkey()).is_some());
    }

    #[test]
    #[cfg(target_os = "linux")]
    fn pinning_networks_back_regions_when_registered() {
        use crate::memory::resident_bytes;
        const BYTES: u64 = 16 << 20;
        let resident = |config: SimConfig| {
            let dev = SimNetwork::new(config).add_node();
            let region = dev.register(BYTES, Access::ALL).unwrap();
            resident_bytes(region.memory().words())
        };
        let pinning = SimConfig {
            pin_memory: true,
            ..SimConfig::default()
        };
        assert_eq!(resident(pinning), BYTES);
        assert!(resident(SimConfig::default()) < BYTES / 4);
    }

    #[test]
    fn peers_are_checked_against_the_network() {
        let net = SimNetwork::new(SimConfig::default());
        let (a, b) = (net.add_node(), net.add_node());
        assert_eq!(b.address(), "sim:1");
        a.add_peer(b.node(), &b.address()).unwrap();
        assert!(a.add_peer(b.node(), "sim:7").is_err());
        assert!(a.add_peer(NodeId(9), "sim:9").is_err());
    }

    #[test]
    fn garbage_keys_resolve_to_nothing() {
        let net = SimNetwork::new(SimConfig::default());
        let dev = net.add_node();
        let _r = dev.register(64, Access::ALL).unwrap();
        for key in [0, 1, 0xff, u32::MAX, 0x0000_0200] {
            assert!(dev.node.region(key).is_none(), "key {key:#x}");
        }
    }

    #[test]
    fn registering_more_than_the_memory_is_refused() {
        let net = SimNetwork::new(SimConfig::default());
        let dev = net.add_node();
        let mem = Arc::new(HeapMemory::new(64).unwrap());
        assert!(matches!(
            dev.register_memory(mem, 65, Access::ALL),
            Err(FabricError::OutOfBounds { .. })
        ));
    }

    #[test]
    fn qps_of_another_backend_are_foreign() {
        struct OtherCq;
        impl CompletionQueue for OtherCq {
            fn poll(&self, _: &mut [crate::Completion]) -> Result<usize> {
                Ok(0)
            }
            fn capacity(&self) -> u32 {
                1
            }
            fn as_any(&self) -> &dyn std::any::Any {
                self
            }
        }
        let net = SimNetwork::new(SimConfig::default());
        let dev = net.add_node();
        let other: Arc<dyn CompletionQueue> = Arc::new(OtherCq);
        assert!(matches!(
            dev.create_qp(&QpConfig::rc(&other)),
            Err(FabricError::ForeignObject(_))
        ));
    }
}
