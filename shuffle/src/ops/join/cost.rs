//! The cost model of Binnig et al. §5.1–5.2, with its constants measured on this
//! machine.
//!
//! With `w` the tuple width (16 bytes here), `|R|`, `|S|` the tuples per node,
//! `c_mem` the cost of touching a byte in memory and `c_net` of sending one:
//!
//! - `T_part(X) = 2·c_mem·w|X| + c_net·w|X|` (read at the sender, ship, write at the
//!   receiver) and `T_join(R, S) = 2·c_mem·(w|R| + w|S|)` (a radix join's two passes),
//!   so `T_GHJ = (w|R| + w|S|)·(4·c_mem + c_net)`.
//! - `T_GHJ+Red = T_mem(R) + T_net(b_R) + T_part(R) + T_part(sel·S) + T_join(R, sel·S)`:
//!   we reduce S only (the paper's general form with `sel_R(b_S) = 1`), and `sel`
//!   includes the filter's false positives.
//! - RDMA GHJ: the WRITEs run in the background, so partitioning costs `T_mem(R) +
//!   T_mem(S)`; we take `max(c_mem, c_net)` per byte instead of `c_mem`, which is the
//!   paper's figure whenever the network is the faster of the two and does not
//!   pretend a slower network is free.
//! - RRJ: one partitioning pass with the network in the background and one join
//!   pass: `T_RRJ = (w|R| + w|S|)·(max(c_mem, c_net) + c_mem)`, the paper's
//!   `2·c_mem·(w|R| + w|S|)` when `c_net ≤ c_mem`.
//!
//! `c_mem` is measured as the time per byte of all of a node's threads scanning a
//! large array at once ([`measure_memory`]); `c_net` from a calibration shuffle
//! on the backend and design the join uses ([`measure_network`]): its time per byte
//! minus the `2·c_mem` of reading at the sender and writing at the receiver.

use super::repartition::{self, Plan};
use super::{Algorithm, Tuple};
use crate::endpoint::Design;
use crate::error::Result;
use crate::node::Node;
use serde::{Deserialize, Serialize};
use std::time::{Duration, Instant};

/// Bytes per tuple: a key and a payload of 8 bytes each.
pub const TUPLE_BYTES: f64 = 16.0;

/// The measured constants, seconds per byte.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct CostParams {
    pub c_mem: f64,
    /// Over the send/receive design the grace hash joins use.
    pub c_net: f64,
    /// Over the WRITE design the RDMA joins use.
    pub c_net_rdma: f64,
}

/// A predicted runtime and its parts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Prediction {
    pub seconds: f64,
    pub memory_seconds: f64,
    pub network_seconds: f64,
}

/// The sizes a prediction needs, per node.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Workload {
    pub r_tuples: f64,
    pub s_tuples: f64,
    /// Fraction of S that passes the filter, false positives included.
    pub selectivity: f64,
    /// Bytes of the Bloom filter each node receives.
    pub bloom_bytes: f64,
}

/// The model's runtime of `algorithm` on `work`.
pub fn predict(params: &CostParams, algorithm: Algorithm, work: &Workload) -> Prediction {
    let w = TUPLE_BYTES;
    let (r, s) = (w * work.r_tuples, w * work.s_tuples);
    let mem = |bytes: f64| bytes * params.c_mem;
    match algorithm {
        Algorithm::Ghj => Prediction {
            memory_seconds: 4.0 * mem(r + s),
            network_seconds: (r + s) * params.c_net,
            seconds: (r + s) * (4.0 * params.c_mem + params.c_net),
        },
        Algorithm::GhjBloom => {
            let s_kept = s * work.selectivity;
            let memory = mem(r) + 2.0 * mem(r + s_kept) + 2.0 * mem(r + s_kept);
            let network = (work.bloom_bytes + r + s_kept) * params.c_net;
            Prediction {
                seconds: memory + network,
                memory_seconds: memory,
                network_seconds: network,
            }
        }
        Algorithm::RdmaGhj | Algorithm::Rrj => {
            let overlapped = params.c_mem.max(params.c_net_rdma);
            let join_passes = if algorithm == Algorithm::Rrj {
                1.0
            } else {
                2.0
            };
            Prediction {
                seconds: (r + s) * (overlapped + join_passes * params.c_mem),
                memory_seconds: (1.0 + join_passes) * mem(r + s),
                network_seconds: (r + s) * params.c_net_rdma,
            }
        }
    }
}

/// Seconds per byte for `threads` threads to scan `bytes` bytes of memory at once
/// (the best of three scans, after a first one that faults the pages in).
pub fn measure_memory(threads: usize, bytes: usize) -> f64 {
    let words: Vec<u64> = (0..(bytes / 8).max(threads) as u64).collect();
    let per = words.len().div_ceil(threads.max(1));
    let mut best = Duration::MAX;
    for _ in 0..4 {
        let started = Instant::now();
        let sums: u64 = std::thread::scope(|s| {
            let hs: Vec<_> = words
                .chunks(per)
                .map(|c| s.spawn(move || c.iter().fold(0u64, |a, &x| a.wrapping_add(x))))
                .collect();
            hs.into_iter()
                .map(|h| h.join().expect("scan thread panicked"))
                .fold(0, u64::wrapping_add)
        });
        std::hint::black_box(sums);
        best = best.min(started.elapsed());
    }
    best.as_secs_f64() / (words.len() * 8) as f64
}

/// Seconds per byte a node's shuffle adds beyond `2·c_mem`, measured by
/// repartitioning `tuples` generated tuples per node with `design` (the better of two
/// runs), with the joins' threading (`interleave`: see [`Plan::interleave`]).
/// Collective.
pub fn measure_network(
    node: &Node,
    design: Design,
    (threads, interleave): (usize, bool),
    message_bytes: u32,
    tuples: u64,
    c_mem: f64,
) -> Result<f64> {
    let data: Vec<Tuple> = (0..tuples)
        .map(|i| [super::hash::hash(i ^ (node.rank() as u64) << 48), i])
        .collect();
    let plan = Plan {
        design,
        threads,
        message_bytes,
        timeout: Duration::from_secs(30),
        parts: 1,
        bloom_words: None,
        interleave,
    };
    // The better of two runs: the first also warms the buffer pool up. Their phases
    // are the calibration's, not a join's: nobody reads them.
    let unread = crate::progress::Progress::default();
    let mut best = Duration::MAX;
    for _ in 0..2 {
        best = best.min(repartition::run(node, &data, &[], &plan, &unread)?.seconds);
    }
    let per_byte = best.as_secs_f64() / (tuples.max(1) as f64 * TUPLE_BYTES);
    Ok((per_byte - 2.0 * c_mem).max(0.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_formulas_are_the_papers() {
        let p = CostParams {
            c_mem: 1e-9,
            c_net: 3e-9,
            c_net_rdma: 0.5e-9,
        };
        let work = Workload {
            r_tuples: 1e6,
            s_tuples: 1e6,
            selectivity: 1.0,
            bloom_bytes: 0.0,
        };
        let bytes = 32e6;
        let ghj = predict(&p, Algorithm::Ghj, &work).seconds;
        assert!((ghj - bytes * 7e-9).abs() < 1e-9);
        // RRJ is the paper's 2·c_mem·(w|R| + w|S|) when the network is faster.
        let rrj = predict(&p, Algorithm::Rrj, &work).seconds;
        assert!((rrj - 2.0 * bytes * 1e-9).abs() < 1e-9);
        let rdma = predict(&p, Algorithm::RdmaGhj, &work).seconds;
        assert!((rdma - 3.0 * bytes * 1e-9).abs() < 1e-9);
        // With everything passing, the Bloom variant pays the filter's scan on top.
        let bloom = predict(&p, Algorithm::GhjBloom, &work).seconds;
        assert!((bloom - ghj - 16e6 * 1e-9).abs() < 1e-9);
        // The paper's simplified form for a reduced S only: less than GHJ below ~0.8.
        let quarter = Workload {
            selectivity: 0.25,
            ..work
        };
        assert!(predict(&p, Algorithm::GhjBloom, &quarter).seconds < ghj);
    }

    #[test]
    fn memory_is_measured_as_a_plausible_rate() {
        let c = measure_memory(1, 8 << 20);
        // Between 0.1 GB/s and 1 TB/s.
        assert!(c > 1e-12 && c < 1e-8, "{c}");
    }
}
