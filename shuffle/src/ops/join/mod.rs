//! Distributed joins over the shuffle: the four algorithms of Binnig et al., "The End
//! of Slow Networks" (VLDB 2016) §5.1–5.2, and the paper's cost model.
//!
//! Every node holds fragments of R and S, tuples `(key, payload)` of two `u64`s, and
//! calls [`join`] with the same algorithm and configuration (it is collective). Each
//! algorithm is a network pass that hash-partitions both relations over the nodes
//! ([`repartition`]) followed by a local join:
//!
//! | algorithm | network pass | local join |
//! |---|---|---|
//! | [`Algorithm::Ghj`] ([`ghj`]) | SEND/RECV (MEMQ/SR) | one hash table over the node's R |
//! | [`Algorithm::GhjBloom`] ([`ghj_bloom`]) | as GHJ, S filtered by a Bloom filter over all of R | as GHJ |
//! | [`Algorithm::RdmaGhj`] ([`rdma_ghj`]) | one-sided WRITEs (MEMQ/WR) | as GHJ |
//! | [`Algorithm::Rrj`] ([`rrj`]) | WRITEs, radix-partitioned to a cache-sized fan-out | cache-resident partition joins |
//!
//! Result rows `(key, r_payload, s_payload)` go to a [`RowSink`] per joining thread:
//! a closure, a [`RowSummary`] (count and order-independent checksums, what the
//! benchmark compares) or [`Materialized`] rows. [`cost`] holds the model and the
//! measurement of its constants, [`data`] the generator of the benchmark's inputs.

pub mod bloom;
pub mod cost;
pub mod data;
pub mod ghj;
pub mod ghj_bloom;
pub mod hash;
mod local;
pub mod radix;
pub mod rdma_ghj;
pub mod repartition;
pub mod rrj;
pub mod table;

use crate::endpoint::Design;
use crate::error::{Result, ShuffleError};
use crate::node::Node;
use crate::progress::Progress;
use repartition::Plan;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A tuple: key, payload.
pub type Tuple = [u64; 2];

/// One of the paper's joins.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Algorithm {
    Ghj,
    GhjBloom,
    RdmaGhj,
    Rrj,
}

impl Algorithm {
    pub const ALL: [Algorithm; 4] = [
        Algorithm::Ghj,
        Algorithm::GhjBloom,
        Algorithm::RdmaGhj,
        Algorithm::Rrj,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Algorithm::Ghj => "ghj",
            Algorithm::GhjBloom => "ghj-bloom",
            Algorithm::RdmaGhj => "rdma-ghj",
            Algorithm::Rrj => "rrj",
        }
    }

    /// The endpoint design the algorithm uses unless told otherwise.
    pub fn design(self) -> Design {
        match self {
            Algorithm::Ghj | Algorithm::GhjBloom => ghj::DESIGN,
            Algorithm::RdmaGhj | Algorithm::Rrj => rdma_ghj::DESIGN,
        }
    }
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Algorithm {
    type Err = ShuffleError;
    fn from_str(s: &str) -> Result<Algorithm> {
        match s.to_ascii_lowercase().replace('_', "-").as_str() {
            "ghj" => Ok(Algorithm::Ghj),
            "ghj-bloom" | "ghj+bloom" | "ghj-red" | "ghj+red" => Ok(Algorithm::GhjBloom),
            "rdma-ghj" => Ok(Algorithm::RdmaGhj),
            "rrj" | "rdma-radix" => Ok(Algorithm::Rrj),
            _ => Err(ShuffleError::Invalid(format!(
                "unknown join {s:?}: expected ghj, ghj-bloom, rdma-ghj or rrj"
            ))),
        }
    }
}

/// How a join runs; the same on every node.
#[derive(Clone, Debug)]
pub struct JoinConfig {
    /// Sending, receiving and joining threads per node (each phase has this many).
    pub threads: usize,
    /// Message (buffer) size, header included.
    pub message_bytes: u32,
    /// Bloom filter bits per R key (GHJ+Bloom).
    pub bloom_bits_per_key: u32,
    /// The cache the radix join sizes its fan-out to; `None`: this machine's L2.
    pub cache_bytes: Option<usize>,
    /// Overrides the algorithm's endpoint design.
    pub design: Option<Design>,
    /// The network pass runs `threads` threads that each both send and receive
    /// ([`crate::send_and_receive`]; a node's own tuples are filed straight from its
    /// sending buffers), instead of `threads` senders and `threads` receivers.
    pub interleave: bool,
    /// How long a blocked step waits before it fails.
    pub timeout: Duration,
    /// Where this node reports its phase and count while the join runs (not a setting:
    /// each node's own).
    pub progress: Arc<Progress>,
}

impl Default for JoinConfig {
    fn default() -> JoinConfig {
        JoinConfig {
            threads: 1,
            message_bytes: 64 << 10,
            bloom_bits_per_key: 10,
            cache_bytes: None,
            design: None,
            interleave: false,
            timeout: Duration::from_secs(30),
            progress: Arc::default(),
        }
    }
}

impl JoinConfig {
    fn check(&self) -> Result<()> {
        let bad = |why: String| Err(ShuffleError::Invalid(why));
        if self.threads == 0 || self.threads > 1024 {
            return bad(format!("{} join threads: expected 1..=1024", self.threads));
        }
        if self.message_bytes < 1024 {
            return bad(format!(
                "messages of {} bytes cannot hold a block of {} tuples",
                self.message_bytes,
                repartition::BLOCK
            ));
        }
        if !(1..=64).contains(&self.bloom_bits_per_key) {
            return bad(format!(
                "{} Bloom filter bits per key: expected 1..=64",
                self.bloom_bits_per_key
            ));
        }
        if self.cache_bytes == Some(0) {
            return bad("a cache of 0 bytes".into());
        }
        Ok(())
    }
}

/// Where result rows go; one per joining thread.
pub trait RowSink: Send {
    fn row(&mut self, key: u64, r_payload: u64, s_payload: u64);
}

impl<F: FnMut(u64, u64, u64) + Send> RowSink for F {
    #[inline]
    fn row(&mut self, key: u64, r_payload: u64, s_payload: u64) {
        self(key, r_payload, s_payload)
    }
}

/// An order-independent summary of result rows: equal multisets of rows give equal
/// summaries, and a lost, duplicated or altered row changes the count, the checksums
/// or the sums.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RowSummary {
    pub count: u64,
    pub hash_sum: u64,
    pub hash_xor: u64,
    /// Sums of the payloads read as `i64` (what `sum(r.v)` in SQL gives).
    pub r_sum: i128,
    pub s_sum: i128,
}

impl RowSummary {
    #[inline]
    pub fn add(&mut self, key: u64, r_payload: u64, s_payload: u64) {
        let h = hash::hash(
            key.wrapping_mul(0x9e37_79b9_7f4a_7c15)
                ^ r_payload.wrapping_mul(0xc2b2_ae3d_27d4_eb4f)
                ^ s_payload.wrapping_mul(0x1656_67b1_9e37_79f9),
        );
        self.count += 1;
        self.hash_sum = self.hash_sum.wrapping_add(h);
        self.hash_xor ^= h;
        self.r_sum += r_payload as i64 as i128;
        self.s_sum += s_payload as i64 as i128;
    }

    pub fn merge(&mut self, other: &RowSummary) {
        self.count += other.count;
        self.hash_sum = self.hash_sum.wrapping_add(other.hash_sum);
        self.hash_xor ^= other.hash_xor;
        self.r_sum += other.r_sum;
        self.s_sum += other.s_sum;
    }
}

impl RowSink for RowSummary {
    #[inline]
    fn row(&mut self, key: u64, r_payload: u64, s_payload: u64) {
        self.add(key, r_payload, s_payload);
    }
}

/// Result rows collected as `[key, r_payload, s_payload]`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Materialized(pub Vec<[u64; 3]>);

impl RowSink for Materialized {
    #[inline]
    fn row(&mut self, key: u64, r_payload: u64, s_payload: u64) {
        self.0.push([key, r_payload, s_payload]);
    }
}

/// What one node measured and moved in a join.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct JoinStats {
    pub algorithm: String,
    pub design: String,
    pub nodes: usize,
    pub threads: usize,
    /// This node's input fragments.
    pub r_in: u64,
    pub s_in: u64,
    /// Tuples this node sent (S after the filter).
    pub r_sent: u64,
    pub s_sent: u64,
    /// Tuples this node joined after the network pass.
    pub r_joined: u64,
    pub s_joined: u64,
    pub bytes_sent: u64,
    pub partitions_per_node: usize,
    pub cache_bytes: usize,
    pub bloom_words: usize,
    /// The combined filter's expected false-positive rate.
    pub bloom_false_positive_rate: f64,
    /// Result rows this node produced: filled by [`join_summary`]; [`join`] leaves it
    /// 0, its sinks see the rows.
    pub rows: u64,
    /// Opening the endpoints (not part of the runtime).
    pub setup_secs: f64,
    /// Building the local Bloom filter (part of the network pass).
    pub bloom_secs: f64,
    /// The network pass: from the barrier after setup until all data arrived here.
    pub partition_secs: f64,
    /// The local join.
    pub join_secs: f64,
    /// The runtime: the network pass and the local join.
    pub total_secs: f64,
}

/// The local phase an algorithm uses.
pub(crate) enum Local {
    HashTable,
    Radix,
}

/// What the algorithms' planning needs.
pub(crate) struct Context<'a> {
    config: &'a JoinConfig,
    nodes: usize,
    /// R tuples over all nodes.
    total_r: u64,
    /// The smallest cache of the nodes.
    cache_bytes: usize,
}

impl Context<'_> {
    fn design_or(&self, default: Design) -> Design {
        self.config.design.unwrap_or(default)
    }
    fn plan(&self, design: Design, parts: usize, bloom_words: Option<usize>) -> Plan {
        Plan {
            design,
            threads: self.config.threads,
            message_bytes: self.config.message_bytes,
            timeout: self.config.timeout,
            parts,
            bloom_words,
            interleave: self.config.interleave,
        }
    }
}

/// Joins this node's fragments `r` and `s` with the other nodes' by `algorithm`.
/// Collective: every node calls it with the same algorithm and configuration. Result
/// rows go to the sinks `make_sink(thread)` returns, one per joining thread, which
/// come back with this node's statistics. Every result row is produced on exactly one
/// node.
pub fn join<S, F>(
    node: &Node,
    algorithm: Algorithm,
    r: &[Tuple],
    s: &[Tuple],
    config: &JoinConfig,
    make_sink: F,
) -> Result<(Vec<S>, JoinStats)>
where
    S: RowSink,
    F: Fn(usize) -> S + Sync,
{
    config.check()?;
    let cache = config.cache_bytes.unwrap_or_else(radix::l2_cache_bytes);
    let sizes: Vec<(u64, u64, u64, String)> = node.all_gather(
        "join: sizes",
        &(
            r.len() as u64,
            s.len() as u64,
            cache as u64,
            algorithm.name().to_string(),
        ),
    )?;
    if let Some((_, _, _, other)) = sizes.iter().find(|x| x.3 != algorithm.name()) {
        return Err(ShuffleError::Invalid(format!(
            "this node runs {algorithm}, another {other}"
        )));
    }
    let cx = Context {
        config,
        nodes: node.nodes(),
        total_r: sizes.iter().map(|x| x.0).sum(),
        cache_bytes: sizes.iter().map(|x| x.2 as usize).min().unwrap_or(cache),
    };
    let (plan, local) = match algorithm {
        Algorithm::Ghj => ghj::plan(&cx),
        Algorithm::GhjBloom => ghj_bloom::plan(&cx),
        Algorithm::RdmaGhj => rdma_ghj::plan(&cx),
        Algorithm::Rrj => rrj::plan(&cx),
    };
    let moved = repartition::run(node, r, s, &plan, &config.progress)?;
    let joined_at = Instant::now();
    let progress = &*config.progress;
    let sinks = match local {
        Local::HashTable => local::hash_join(&moved.collected, plan.threads, &make_sink, progress)?,
        Local::Radix => local::radix_join(
            &moved.collected,
            plan.parts,
            plan.threads,
            &make_sink,
            progress,
        )?,
    };
    let join_secs = joined_at.elapsed().as_secs_f64();
    let count = |rel: usize| -> u64 {
        moved
            .collected
            .iter()
            .flat_map(|c| &c.parts[rel * plan.parts..(rel + 1) * plan.parts])
            .map(|p| p.len() as u64)
            .sum()
    };
    let stats = JoinStats {
        algorithm: algorithm.name().into(),
        design: plan.design.to_string(),
        nodes: node.nodes(),
        threads: plan.threads,
        r_in: r.len() as u64,
        s_in: s.len() as u64,
        r_sent: moved.r_sent,
        s_sent: moved.s_sent,
        r_joined: count(0),
        s_joined: count(1),
        bytes_sent: moved.bytes_sent,
        partitions_per_node: plan.parts,
        cache_bytes: cx.cache_bytes,
        bloom_words: plan.bloom_words.unwrap_or(0),
        bloom_false_positive_rate: moved
            .filter
            .as_ref()
            .map_or(0.0, |f| f.false_positive_rate()),
        rows: 0,
        setup_secs: moved.setup.as_secs_f64(),
        bloom_secs: moved.bloom.as_secs_f64(),
        partition_secs: moved.seconds.as_secs_f64(),
        join_secs,
        total_secs: moved.seconds.as_secs_f64() + join_secs,
    };
    Ok((sinks, stats))
}

/// [`join`] into one [`RowSummary`] of this node's result rows.
pub fn join_summary(
    node: &Node,
    algorithm: Algorithm,
    r: &[Tuple],
    s: &[Tuple],
    config: &JoinConfig,
) -> Result<(RowSummary, JoinStats)> {
    let (sinks, mut stats) = join(node, algorithm, r, s, config, |_| RowSummary::default())?;
    let mut total = RowSummary::default();
    for sink in &sinks {
        total.merge(sink);
    }
    stats.rows = total.count;
    Ok((total, stats))
}

/// The straightforward single-node join: every row of `r ⋈ s` on the key, into
/// `sink`. The reference the distributed joins are checked against.
pub fn reference_join(r: &[Tuple], s: &[Tuple], sink: &mut impl RowSink) {
    let mut by_key: HashMap<u64, Vec<u64>> = HashMap::with_capacity(r.len());
    for t in r {
        by_key.entry(t[0]).or_default().push(t[1]);
    }
    for t in s {
        if let Some(payloads) = by_key.get(&t[0]) {
            for &p in payloads {
                sink.row(t[0], p, t[1]);
            }
        }
    }
}
