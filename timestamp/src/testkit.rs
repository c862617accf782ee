//! A sim cluster with an oracle, for this crate's tests, models and benchmarks: one
//! memory-server node holding the oracle region and client nodes connected to it.

use crate::clock::Clock;
use crate::error::Result;
use crate::layout::Layout;
use crate::link::{MIN_CQ_CAPACITY, MIN_SEND_QUEUE};
use crate::slot::{OracleConfig, SlotHandle};
use fabric::sim::{SimConfig, SimNetwork};
use fabric::{Access, Device, QpConfig, QueuePair, Region};
use std::sync::Arc;

/// The memory server of a sim network, holding a formatted oracle.
pub struct SimOracle {
    pub net: SimNetwork,
    pub server: Arc<dyn Device>,
    pub region: Region,
    pub layout: Layout,
    /// Server-side queue pairs, kept so that connections stay up.
    server_qps: std::sync::Mutex<Vec<Arc<dyn QueuePair>>>,
}

impl SimOracle {
    pub fn new(config: SimConfig, layout: Layout) -> Result<SimOracle> {
        let net = SimNetwork::new(config);
        let server: Arc<dyn Device> = net.add_node();
        let region = server.register(layout.region_bytes(), Access::ALL)?;
        layout.format(&region)?;
        Ok(SimOracle {
            net,
            server,
            region,
            layout,
            server_qps: std::sync::Mutex::new(Vec::new()),
        })
    }

    /// A new client node connected to the server, and a slot registered through it.
    pub fn client(&self, config: OracleConfig, clock: Arc<dyn Clock>) -> Result<SlotHandle> {
        let node: Arc<dyn Device> = self.net.add_node();
        let (device, qp, cq) = self.connect(node)?;
        SlotHandle::register(device.as_ref(), qp, cq, self.region.remote(), config, clock)
    }

    /// A new client node connected to the server, and an observer (no slot) on it.
    pub fn observer(&self, config: OracleConfig, clock: Arc<dyn Clock>) -> Result<SlotHandle> {
        let node: Arc<dyn Device> = self.net.add_node();
        let (device, qp, cq) = self.connect(node)?;
        SlotHandle::observe_at(
            device.as_ref(),
            qp,
            cq,
            self.region.remote(),
            0,
            config,
            clock,
        )
    }

    /// Connects `client` to the server with the queue sizes a slot handle needs.
    #[allow(clippy::type_complexity)]
    pub fn connect(
        &self,
        client: Arc<dyn Device>,
    ) -> Result<(
        Arc<dyn Device>,
        Arc<dyn QueuePair>,
        Arc<dyn fabric::CompletionQueue>,
    )> {
        let ccq = client.create_cq(MIN_CQ_CAPACITY * 2)?;
        let scq = self.server.create_cq(16)?;
        let (sqp, qp) =
            fabric::connect_rc_with((self.server.as_ref(), &scq), (client.as_ref(), &ccq), |c| {
                QpConfig {
                    max_send_wr: MIN_SEND_QUEUE * 2,
                    ..c
                }
            })?;
        self.server_qps
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(sqp);
        Ok((client, qp, ccq))
    }

    /// The true first undecided timestamp at or after `from`, by CPU loads on the
    /// server: what tests compare clients against. `from` must be within a round of
    /// the truth.
    pub fn true_prefix(&self, from: u64) -> Result<u64> {
        let v = self.layout.bits();
        let mut t = from;
        loop {
            let (w, b) = crate::cells::position(v, t);
            let word = self.region.load_u64(self.layout.word_offset(w))?;
            let decided = crate::cells::decided_bits(word, crate::cells::odd_round(v, t));
            if decided & (1 << b) == 0 {
                return Ok(t);
            }
            t += 1;
        }
    }

    /// Whether timestamp `ts` reads as decided, by a CPU load on the server.
    pub fn is_decided(&self, ts: u64) -> Result<bool> {
        let v = self.layout.bits();
        let (w, b) = crate::cells::position(v, ts);
        let word = self.region.load_u64(self.layout.word_offset(w))?;
        Ok(crate::cells::decided_bits(word, crate::cells::odd_round(v, ts)) & (1 << b) != 0)
    }

    /// The lease word of `slot`, decoded.
    pub fn lease(&self, slot: u32) -> Result<crate::layout::Lease> {
        crate::layout::Lease::decode(self.region.load_u64(self.layout.lease_offset(slot))?)
    }
}
