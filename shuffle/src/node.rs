//! A node of a shuffle: its device, its place among the nodes, the exchange that wires
//! it to the others, and its registered buffer pools.

use crate::error::{Result, ShuffleError};
use crate::exchange::Exchange;
use crate::pool::BufferPool;
use fabric::{Device, NodeId};
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

/// Buffers registered per chunk.
const CHUNK_BUFFERS: usize = 16;

pub struct Node {
    rank: usize,
    nodes: usize,
    device: Arc<dyn Device>,
    exchange: Arc<dyn Exchange>,
    fabric_ids: Vec<NodeId>,
    pools: Mutex<BTreeMap<u32, Arc<BufferPool>>>,
    pin_limit: u64,
}

impl Node {
    /// Joins the shuffle: tells every other node how to reach this device and learns
    /// how to reach theirs. Collective. `pin_limit` caps the bytes each buffer pool
    /// registers.
    pub fn join(
        device: Arc<dyn Device>,
        exchange: Arc<dyn Exchange>,
        pin_limit: u64,
    ) -> Result<Node> {
        let rank = exchange.rank();
        let nodes = exchange.nodes();
        if nodes == 0 || rank >= nodes {
            return Err(ShuffleError::Invalid(format!(
                "rank {rank} of {nodes} nodes"
            )));
        }
        let mine = (
            device.node().0,
            device.address(),
            device.backend().to_string(),
        );
        let node = Node {
            rank,
            nodes,
            device,
            exchange,
            fabric_ids: Vec::new(),
            pools: Mutex::new(BTreeMap::new()),
            pin_limit,
        };
        let all: Vec<(u32, String, String)> = node.all_gather("node addresses", &mine)?;
        let mut ids = Vec::with_capacity(nodes);
        for (r, (id, address, backend)) in all.into_iter().enumerate() {
            if backend != mine.2 {
                return Err(ShuffleError::Invalid(format!(
                    "rank {r} runs the {backend} backend, this node {}",
                    mine.2
                )));
            }
            if r != rank {
                node.device.add_peer(NodeId(id), &address)?;
            }
            ids.push(NodeId(id));
        }
        Ok(Node {
            fabric_ids: ids,
            ..node
        })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }
    pub fn nodes(&self) -> usize {
        self.nodes
    }
    pub fn device(&self) -> &Arc<dyn Device> {
        &self.device
    }
    /// The fabric node id of rank `rank`.
    pub fn fabric_id(&self, rank: usize) -> NodeId {
        self.fabric_ids[rank]
    }
    /// The rank of fabric node `id`, if it is one of ours.
    pub fn rank_of(&self, id: NodeId) -> Option<usize> {
        self.fabric_ids.iter().position(|&x| x == id)
    }

    /// The pool of `buffer_bytes` buffers, created on first use.
    pub fn pool(&self, buffer_bytes: u32) -> Arc<BufferPool> {
        let mut pools = self.pools.lock().unwrap_or_else(|e| e.into_inner());
        pools
            .entry(buffer_bytes.next_multiple_of(8))
            .or_insert_with(|| {
                Arc::new(BufferPool::new(
                    self.device.clone(),
                    buffer_bytes,
                    CHUNK_BUFFERS,
                    self.pin_limit,
                ))
            })
            .clone()
    }

    /// Bytes registered by all of this node's pools.
    pub fn pinned_bytes(&self) -> u64 {
        let pools = self.pools.lock().unwrap_or_else(|e| e.into_inner());
        pools.values().map(|p| p.pinned_bytes()).sum()
    }

    /// A typed all-gather over the exchange: every rank's `mine`, by rank.
    pub fn all_gather<T: Serialize + DeserializeOwned>(
        &self,
        tag: &str,
        mine: &T,
    ) -> Result<Vec<T>> {
        let bytes = postcard::to_allocvec(mine).expect("in-memory encoding");
        self.exchange
            .all_gather(tag, bytes)?
            .iter()
            .enumerate()
            .map(|(r, b)| {
                postcard::from_bytes(b).map_err(|e| ShuffleError::Malformed {
                    from: format!("rank {r}"),
                    why: format!("{tag}: {e}"),
                })
            })
            .collect()
    }
}
