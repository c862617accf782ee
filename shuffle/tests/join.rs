//! The distributed joins against a straightforward single-node join of the same data,
//! on sim networks of 2 and 3 nodes (threads of this process).

use fabric::Device;
use fabric::sim::{SimConfig, SimNetwork};
use shuffle::ops::join::data::DataSpec;
use shuffle::ops::join::{
    Algorithm, JoinConfig, JoinStats, Materialized, RowSummary, Tuple, join, join_summary,
    reference_join,
};
use shuffle::{Design, LocalExchange, Node};
use std::sync::Arc;
use std::time::Duration;

type Fragments = Vec<(Vec<Tuple>, Vec<Tuple>)>;

/// Runs `body` on one node per fragment, each a thread with its own device.
fn on_nodes<T: Send>(
    nodes: usize,
    body: impl Fn(&Node, usize) -> shuffle::Result<T> + Sync,
) -> Vec<shuffle::Result<T>> {
    let net = SimNetwork::new(SimConfig::default());
    let exchanges = LocalExchange::group(nodes, Duration::from_secs(30));
    std::thread::scope(|s| {
        let hs: Vec<_> = exchanges
            .into_iter()
            .enumerate()
            .map(|(rank, x)| {
                let device = net.add_node() as Arc<dyn Device>;
                let body = &body;
                s.spawn(move || {
                    let node = Node::join(device, Arc::new(x), 1 << 30)?;
                    body(&node, rank)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("node panicked"))
            .collect()
    })
}

fn config(threads: usize) -> JoinConfig {
    JoinConfig {
        threads,
        message_bytes: 4 << 10,
        timeout: Duration::from_secs(20),
        ..JoinConfig::default()
    }
}

fn reference(frags: &Fragments) -> (RowSummary, Vec<[u64; 3]>) {
    let r: Vec<Tuple> = frags.iter().flat_map(|f| f.0.clone()).collect();
    let s: Vec<Tuple> = frags.iter().flat_map(|f| f.1.clone()).collect();
    let mut summary = RowSummary::default();
    reference_join(&r, &s, &mut summary);
    let mut rows = Materialized::default();
    reference_join(&r, &s, &mut rows);
    rows.0.sort_unstable();
    (summary, rows.0)
}

/// Runs `algorithm` on `frags` and returns the rows of all nodes (sorted) and the
/// nodes' statistics.
fn run(
    algorithm: Algorithm,
    frags: &Fragments,
    cfg: &JoinConfig,
) -> (Vec<[u64; 3]>, Vec<JoinStats>) {
    let results = on_nodes(frags.len(), |node, rank| {
        let (r, s) = &frags[rank];
        join(node, algorithm, r, s, cfg, |_| Materialized::default())
    });
    let mut rows = Vec::new();
    let mut stats = Vec::new();
    for (rank, res) in results.into_iter().enumerate() {
        let (sinks, st) = res.unwrap_or_else(|e| panic!("{algorithm} node {rank}: {e}"));
        for sink in sinks {
            rows.extend(sink.0);
        }
        stats.push(st);
    }
    rows.sort_unstable();
    (rows, stats)
}

fn summary_of(rows: &[[u64; 3]]) -> RowSummary {
    let mut s = RowSummary::default();
    for r in rows {
        s.add(r[0], r[1], r[2]);
    }
    s
}

/// Every algorithm's rows are exactly the reference's, and every tuple was joined on
/// exactly one node.
fn check_all(frags: &Fragments, cfg: &JoinConfig) {
    let (want_summary, want_rows) = reference(frags);
    let r_total: u64 = frags.iter().map(|f| f.0.len() as u64).sum();
    let s_total: u64 = frags.iter().map(|f| f.1.len() as u64).sum();
    for algorithm in Algorithm::ALL {
        let (rows, stats) = run(algorithm, frags, cfg);
        assert_eq!(summary_of(&rows), want_summary, "{algorithm}");
        assert_eq!(rows, want_rows, "{algorithm}");
        assert_eq!(
            stats.iter().map(|s| s.r_joined).sum::<u64>(),
            r_total,
            "{algorithm}"
        );
        let s_sent: u64 = stats.iter().map(|s| s.s_sent).sum();
        assert_eq!(
            stats.iter().map(|s| s.s_joined).sum::<u64>(),
            s_sent,
            "{algorithm}"
        );
        if algorithm != Algorithm::GhjBloom {
            assert_eq!(s_sent, s_total, "{algorithm}");
        }
    }
}

fn generated(nodes: usize, r: u64, s: u64, selectivity: f64) -> Fragments {
    let spec = DataSpec {
        seed: 11,
        nodes,
        r_tuples: r,
        s_tuples: s,
        selectivity,
    };
    (0..nodes)
        .map(|rank| spec.fragment(rank).unwrap())
        .collect()
}

#[test]
fn every_join_equals_the_single_node_join_on_two_and_three_nodes() {
    for nodes in [2, 3] {
        let frags = generated(nodes, 3000, 5000, 0.5);
        let (want, _) = reference(&frags);
        assert!(want.count > 2000, "the data must join: {want:?}");
        check_all(&frags, &config(1));
        check_all(&frags, &config(2));
    }
}

/// The network pass with threads that each both send and receive: a node files its
/// own tuples from its sending buffers, and the Bloom filter's waits receive the
/// other nodes' filter words on the same thread.
#[test]
fn every_join_equals_the_single_node_join_when_each_thread_sends_and_receives() {
    for nodes in [2, 3] {
        let frags = generated(nodes, 3000, 5000, 0.5);
        for threads in [1, 2] {
            let cfg = JoinConfig {
                interleave: true,
                ..config(threads)
            };
            check_all(&frags, &cfg);
        }
    }
}

#[test]
fn duplicate_keys_on_both_sides_give_every_pair() {
    // Keys 0..40 repeat in R and S on every node: 40 keys × (3·25) × (3·50) rows.
    let frags: Fragments = (0..3u64)
        .map(|rank| {
            let r = (0..1000).map(|i| [i % 40, rank << 32 | i]).collect();
            let s = (0..2000).map(|i| [(i * 7) % 40, rank << 32 | i]).collect();
            (r, s)
        })
        .collect();
    let (want, _) = reference(&frags);
    assert_eq!(want.count, 40 * 75 * 150);
    check_all(&frags, &config(2));
}

#[test]
fn empty_inputs_join_to_nothing_or_to_what_the_others_hold() {
    let full = generated(2, 500, 800, 1.0);
    let empty_r: Fragments = full.iter().map(|f| (Vec::new(), f.1.clone())).collect();
    let empty_s: Fragments = full.iter().map(|f| (f.0.clone(), Vec::new())).collect();
    let all_empty: Fragments = vec![(Vec::new(), Vec::new()); 2];
    let one_empty: Fragments = vec![full[0].clone(), (Vec::new(), Vec::new())];
    for frags in [&empty_r, &empty_s, &all_empty] {
        check_all(frags, &config(2));
        assert_eq!(reference(frags).0.count, 0);
    }
    check_all(&one_empty, &config(1));
}

#[test]
fn skewed_keys_join_correctly() {
    // 80% of S and a tenth of R carry key 42, so one node gets most of the work.
    let frags: Fragments = (0..3u64)
        .map(|rank| {
            let r = (0..600)
                .map(|i| [if i % 10 == 0 { 42 } else { rank * 1000 + i }, i])
                .collect();
            let s = (0..1500)
                .map(|i| {
                    [
                        if i % 5 != 0 { 42 } else { (i * 13) % 3000 },
                        rank << 20 | i,
                    ]
                })
                .collect();
            (r, s)
        })
        .collect();
    let (want, _) = reference(&frags);
    assert!(want.count > 3 * 1200 * 180);
    check_all(&frags, &config(2));
}

#[test]
fn the_bloom_filter_drops_what_has_no_partner_at_every_selectivity() {
    for selectivity in [0.25, 0.5, 0.75, 1.0] {
        let frags = generated(2, 4000, 8000, selectivity);
        let (want, _) = reference(&frags);
        let results = on_nodes(2, |node, rank| {
            let (r, s) = &frags[rank];
            join_summary(node, Algorithm::GhjBloom, r, s, &config(2))
        });
        let mut got = RowSummary::default();
        let mut s_sent = 0;
        for res in results {
            let (summary, stats) = res.unwrap();
            got.merge(&summary);
            s_sent += stats.s_sent;
            assert!(stats.bloom_words > 0);
            assert!(stats.bloom_false_positive_rate < 0.1, "{stats:?}");
        }
        assert_eq!(got, want, "selectivity {selectivity}");
        // Every S tuple with a partner passes; of the others only false positives.
        let s_total = 16_000.0;
        let sent = s_sent as f64 / s_total;
        assert!(sent >= want.count as f64 / s_total, "{selectivity}: {sent}");
        assert!(
            sent <= selectivity + 0.05,
            "{selectivity}: sent {sent} of S"
        );
    }
}

#[test]
fn partitioning_neither_loses_nor_duplicates_tuples() {
    // Nothing joins (selectivity 0), so only the tuple counts can tell: every tuple
    // sent must be joined on exactly one node, and the radix join's many partitions
    // (a tiny cache) must all be covered.
    let frags = generated(3, 2000, 3000, 0.0);
    let cfg = JoinConfig {
        cache_bytes: Some(16 << 10),
        ..config(2)
    };
    for algorithm in Algorithm::ALL {
        let (rows, stats) = run(algorithm, &frags, &cfg);
        assert!(rows.is_empty());
        assert_eq!(
            stats.iter().map(|s| s.r_joined).sum::<u64>(),
            6000,
            "{algorithm}"
        );
        assert_eq!(
            stats.iter().map(|s| s.r_sent).sum::<u64>(),
            6000,
            "{algorithm}"
        );
        let s_joined: u64 = stats.iter().map(|s| s.s_joined).sum();
        if algorithm == Algorithm::GhjBloom {
            assert!(s_joined < 9000 / 10, "{s_joined}");
        } else {
            assert_eq!(s_joined, 9000, "{algorithm}");
        }
        if algorithm == Algorithm::Rrj {
            assert!(stats[0].partitions_per_node > 1, "{:?}", stats[0]);
        }
    }
    // With matches, and many radix partitions.
    let frags = generated(2, 3000, 3000, 0.75);
    let (want, want_rows) = reference(&frags);
    let (rows, stats) = run(Algorithm::Rrj, &frags, &cfg);
    assert!(stats[0].partitions_per_node >= 4);
    assert_eq!(summary_of(&rows), want);
    assert_eq!(rows, want_rows);
}

#[test]
fn joins_run_over_other_designs_too() {
    let frags = generated(2, 1500, 2500, 0.5);
    let (want, _) = reference(&frags);
    for design in ["SEMQ/WR", "MEMQ/RD", "SEMQ/SR"] {
        let cfg = JoinConfig {
            design: Some(design.parse::<Design>().unwrap()),
            ..config(2)
        };
        for algorithm in [Algorithm::GhjBloom, Algorithm::Rrj] {
            let (rows, stats) = run(algorithm, &frags, &cfg);
            assert_eq!(summary_of(&rows), want, "{algorithm} over {design}");
            assert_eq!(stats[0].design, design);
        }
    }
}

#[test]
fn bad_arguments_are_clear_errors() {
    let frags = generated(2, 100, 100, 1.0);
    for cfg in [
        JoinConfig {
            threads: 0,
            ..config(1)
        },
        JoinConfig {
            message_bytes: 64,
            ..config(1)
        },
        JoinConfig {
            bloom_bits_per_key: 0,
            ..config(1)
        },
        JoinConfig {
            cache_bytes: Some(0),
            ..config(1)
        },
    ] {
        let results = on_nodes(2, |node, rank| {
            let (r, s) = &frags[rank];
            join_summary(node, Algorithm::Ghj, r, s, &cfg)
        });
        for res in results {
            let err = res.unwrap_err().to_string();
            assert!(err.contains("invalid argument"), "{err}");
        }
    }
    // Nodes that disagree on the algorithm fail instead of hanging.
    let results = on_nodes(2, |node, rank| {
        let (r, s) = &frags[rank];
        let algorithm = if rank == 0 {
            Algorithm::Ghj
        } else {
            Algorithm::Rrj
        };
        join_summary(node, algorithm, r, s, &config(1))
    });
    for res in results {
        let err = res.unwrap_err().to_string();
        assert!(err.contains("another"), "{err}");
    }
    assert!("nope".parse::<Algorithm>().is_err());
    for a in Algorithm::ALL {
        assert_eq!(a.name().parse::<Algorithm>().unwrap(), a);
    }
}

#[test]
fn the_network_constant_is_measured_collectively() {
    let c_mem = shuffle::ops::join::cost::measure_memory(1, 4 << 20);
    for interleave in [false, true] {
        let results = on_nodes(2, |node, _| {
            shuffle::ops::join::cost::measure_network(
                node,
                shuffle::ops::join::rdma_ghj::DESIGN,
                (1, interleave),
                4 << 10,
                20_000,
                c_mem,
            )
        });
        for res in results {
            let c_net = res.unwrap();
            // Finite, not negative, and below a microsecond per byte.
            assert!((0.0..1e-6).contains(&c_net), "{c_net}");
        }
    }
}

/// A node's progress ends where its last phase's work does: every tuple the joining
/// threads went through counted once, whichever thread counted it (a chunk's count
/// lost or counted twice shows as a count short of or past the total).
#[test]
fn a_node_counts_every_tuple_of_its_last_phase() {
    use shuffle::{Phase, Progress};
    let frags = generated(2, 50_000, 70_000, 0.5);
    for (algorithm, last) in [
        (Algorithm::GhjBloom, Phase::Probing),
        (Algorithm::Rrj, Phase::Joining),
    ] {
        let results = on_nodes(2, |node, rank| {
            let (r, s) = &frags[rank];
            let progress = Arc::new(Progress::default());
            let config = JoinConfig {
                progress: progress.clone(),
                ..config(3)
            };
            let (_, stats) = join_summary(node, algorithm, r, s, &config)?;
            Ok((progress.snapshot(), stats))
        });
        for res in results {
            let (seen, stats) = res.unwrap();
            assert_eq!(seen.phase, last, "{algorithm}");
            assert_eq!(
                (seen.done, seen.total),
                (stats.s_joined, stats.s_joined),
                "{algorithm}"
            );
        }
    }
}
