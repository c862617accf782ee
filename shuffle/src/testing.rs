//! A checked shuffle run: what the tests of every design and the benchmark's
//! `--verify` use.
//!
//! Every sending thread generates its tuples `(a, b)` from `(seed, rank, thread, i)`,
//! so every receiver can compute exactly what it must receive: the count and an
//! order-independent checksum of the tuples sent to it, from every source: the count,
//! and the wrapping sum and the xor of `a·K ⊕ b` (one multiply, so that checking costs
//! a receiver about what the paper's receivers spend summing values). A lost,
//! duplicated or corrupted tuple, or `a` and `b` of different tuples paired up, changes
//! it.

use crate::buffer::Received;
use crate::endpoint::{Design, EndpointConfig, open};
use crate::error::{Result, ShuffleError};
use crate::exchange::LocalExchange;
use crate::node::Node;
use crate::operator::{Groups, Shuffle, ShuffleWriter, receive_all, send_and_receive};
use fabric::Device;
use fabric::sim::{SimConfig, SimNetwork};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// The transmission pattern of a run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pattern {
    /// Tuple `(a, b)` goes to node `a mod nodes`.
    Repartition,
    /// Every tuple goes to every other node.
    Broadcast,
}

/// A SplitMix64 step: the tuple generator and the checksum's hash.
pub fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Tuple `i` of thread `tid` on node `rank`.
pub fn tuple(seed: u64, rank: usize, tid: usize, i: u64) -> [u64; 2] {
    let b = (rank as u64) << 48 | (tid as u64) << 32 | i;
    [mix(seed ^ b), b]
}

/// The node a repartition sends key `a` to: `⌊a·nodes / 2⁶⁴⌋`, uniform for uniform
/// keys, and a multiply where `a mod nodes` would be a division per tuple.
#[inline]
pub fn partition(a: u64, nodes: usize) -> usize {
    ((a as u128 * nodes as u128) >> 64) as usize
}

/// The destination ranks of a tuple.
pub fn destination(pattern: Pattern, a: u64, nodes: usize) -> usize {
    match pattern {
        Pattern::Repartition => partition(a, nodes),
        Pattern::Broadcast => usize::MAX,
    }
}

/// An order-independent summary of a multiset of tuples.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Checksum {
    pub count: u64,
    pub sum: u64,
    pub xor: u64,
}

impl Checksum {
    #[inline]
    pub fn add(&mut self, a: u64, b: u64) {
        let h = a.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ b;
        self.count += 1;
        self.sum = self.sum.wrapping_add(h);
        self.xor ^= h;
    }
    pub fn merge(&mut self, o: &Checksum) {
        self.count += o.count;
        self.sum = self.sum.wrapping_add(o.sum);
        self.xor ^= o.xor;
    }
    /// Adds the tuples of a received payload; `false` if it ends in half a tuple.
    #[inline]
    pub fn add_payload(&mut self, words: &[AtomicU64]) -> bool {
        // A local per buffer: added straight into `self`, the compiler kept it in
        // memory, a store and a reload on every tuple's chain.
        let mut here = Checksum::default();
        for t in words.chunks_exact(2) {
            here.add(t[0].load(Ordering::Relaxed), t[1].load(Ordering::Relaxed));
        }
        self.merge(&here);
        words.len().is_multiple_of(2)
    }
}

/// What each node of a checked run must receive.
pub fn expected(
    pattern: Pattern,
    seed: u64,
    nodes: usize,
    threads: usize,
    tuples: u64,
) -> Vec<Checksum> {
    let mut out = vec![Checksum::default(); nodes];
    for rank in 0..nodes {
        for tid in 0..threads {
            for i in 0..tuples {
                let [a, b] = tuple(seed, rank, tid, i);
                match pattern {
                    Pattern::Repartition => out[destination(pattern, a, nodes)].add(a, b),
                    Pattern::Broadcast => {
                        for (r, c) in out.iter_mut().enumerate() {
                            if r != rank {
                                c.add(a, b);
                            }
                        }
                    }
                }
            }
        }
    }
    out
}

/// A checked run's parameters.
#[derive(Clone, Debug)]
pub struct Run {
    pub design: Design,
    pub pattern: Pattern,
    pub nodes: usize,
    pub threads: usize,
    /// Tuples each sending thread sends.
    pub tuples: u64,
    pub seed: u64,
    pub config: EndpointConfig,
    /// Sending thread 0 of node 0 sleeps this long every 64 tuples: a straggler.
    pub straggler: Option<Duration>,
    /// Senders hand over runs of [`BULK_RUN`] tuples at a time: a broadcast with
    /// [`crate::ShuffleWriter::push_all`], a repartition with
    /// [`crate::ShuffleWriter::push_partitioned`].
    pub bulk: bool,
    /// Each of a node's `threads` threads both sends and receives
    /// ([`crate::send_and_receive`]) instead of `threads` senders and `threads`
    /// receivers.
    pub interleave: bool,
}

/// Tuples per bulk call in a bulk run: odd, so runs straddle buffer boundaries.
pub const BULK_RUN: usize = 385;

impl Run {
    pub fn new(design: Design, nodes: usize, threads: usize, tuples: u64) -> Run {
        Run {
            design,
            pattern: Pattern::Repartition,
            nodes,
            threads,
            tuples,
            seed: 7,
            config: EndpointConfig {
                threads,
                ..EndpointConfig::default()
            },
            straggler: None,
            bulk: false,
            interleave: false,
        }
    }
}

/// Runs one node's side of `run`: `threads` senders and `threads` receivers, or
/// `threads` threads that do both, and returns what it received.
pub fn run_node(node: &Node, run: &Run) -> Result<Checksum> {
    let opened = open(node, run.design, &run.config)?;
    let groups = match run.pattern {
        Pattern::Repartition => Groups::repartition(node.nodes()),
        Pattern::Broadcast => Groups::broadcast(node.nodes(), node.rank()),
    };
    let shuffle = Shuffle::new(opened, groups, run.threads)?;
    let received = std::sync::Mutex::new(Checksum::default());
    let add_up = |mine: &Checksum| {
        received
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .merge(mine)
    };
    std::thread::scope(|s| -> Result<()> {
        let mut threads = Vec::new();
        for tid in 0..run.threads {
            let (shuffle, add_up) = (&shuffle, &add_up);
            threads.push(if run.interleave {
                s.spawn(move || -> Result<()> {
                    let mut mine = Checksum::default();
                    send_and_receive(
                        shuffle,
                        tid,
                        |w| write(w, run, node, tid),
                        |data| add_payload(&mut mine, data),
                    )?;
                    add_up(&mine);
                    Ok(())
                })
            } else {
                s.spawn(move || -> Result<()> {
                    let mut w = shuffle.writer(tid);
                    write(&mut w, run, node, tid)?;
                    w.finish()
                })
            });
            if !run.interleave {
                let endpoint = shuffle.receiver(tid);
                threads.push(s.spawn(move || -> Result<()> {
                    let mut mine = Checksum::default();
                    receive_all(&*endpoint, |data| add_payload(&mut mine, data))?;
                    add_up(&mine);
                    Ok(())
                }));
            }
        }
        let mut first_err = None;
        for h in threads {
            if let Err(e) = h.join().expect("shuffle thread panicked") {
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    })?;
    Ok(received.into_inner().unwrap_or_else(|e| e.into_inner()))
}

/// Sending thread `tid`'s tuples, one at a time or in bulk.
fn write(w: &mut ShuffleWriter<'_>, run: &Run, node: &Node, tid: usize) -> Result<()> {
    if run.bulk {
        return push_in_runs(w, run, node, tid);
    }
    for i in 0..run.tuples {
        let t = tuple(run.seed, node.rank(), tid, i);
        let g = match run.pattern {
            Pattern::Repartition => destination(run.pattern, t[0], node.nodes()),
            Pattern::Broadcast => 0,
        };
        w.push(g, &t)?;
        if let Some(pause) = run.straggler
            && node.rank() == 0
            && tid == 0
            && i % 64 == 63
        {
            std::thread::sleep(pause);
        }
    }
    Ok(())
}

/// Adds a received buffer's tuples; half a tuple spoils the count for good.
fn add_payload(mine: &mut Checksum, data: &Received) {
    if !mine.add_payload(data.payload()) {
        mine.count = u64::MAX / 2;
    }
}

/// A bulk sender: one call per run of [`BULK_RUN`] tuples.
fn push_in_runs(w: &mut ShuffleWriter<'_>, run: &Run, node: &Node, tid: usize) -> Result<()> {
    let all: Vec<[u64; 2]> = (0..run.tuples)
        .map(|i| tuple(run.seed, node.rank(), tid, i))
        .collect();
    for chunk in all.chunks(BULK_RUN) {
        match run.pattern {
            Pattern::Broadcast => w.push_all(0, chunk)?,
            Pattern::Repartition => {
                w.push_partitioned(chunk, |t| destination(run.pattern, t[0], node.nodes()))?
            }
        }
    }
    Ok(())
}

/// Runs `run` on a sim network of `run.nodes` nodes (threads of this process) and
/// checks every node received exactly the expected multiset.
pub fn run_sim(run: &Run, sim: SimConfig) -> Result<()> {
    let net = SimNetwork::new(sim);
    let devices = (0..run.nodes)
        .map(|_| net.add_node() as Arc<dyn Device>)
        .collect();
    run_on(run, devices)
}

/// Runs `run` with one node per device, each a thread of this process (any backend:
/// shm and tcp devices bound in this process work too), and checks every node
/// received exactly the expected multiset.
pub fn run_on(run: &Run, devices: Vec<Arc<dyn Device>>) -> Result<()> {
    if devices.len() != run.nodes {
        return Err(ShuffleError::Invalid(format!(
            "{} devices for {} nodes",
            devices.len(),
            run.nodes
        )));
    }
    let exchanges = LocalExchange::group(run.nodes, Duration::from_secs(30));
    let results: Vec<Result<Checksum>> = std::thread::scope(|s| {
        let hs: Vec<_> = exchanges
            .into_iter()
            .zip(devices)
            .map(|(x, device)| {
                s.spawn(move || {
                    let node = Node::join(device, Arc::new(x), 1 << 30)?;
                    run_node(&node, run)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("node panicked"))
            .collect()
    });
    let want = expected(run.pattern, run.seed, run.nodes, run.threads, run.tuples);
    for (rank, (got, want)) in results.into_iter().zip(want).enumerate() {
        let got = got?;
        if got != want {
            return Err(ShuffleError::Invalid(format!(
                "{}: node {rank} received {got:?}, expected {want:?}",
                run.design
            )));
        }
    }
    Ok(())
}
