//! Distributed aggregation on the sim backend: every algorithm, on 2 and 3 nodes, must
//! produce exactly what a single-node GROUP BY over all nodes' tuples produces, and the
//! adaptive algorithms must switch when (and only when) the data calls for it.

use fabric::Device;
use fabric::sim::{SimConfig, SimNetwork};
use shuffle::ops::aggregate::{
    AggConfig, AggFn, AggValue, Algorithm, Input, MAX_CACHE_GROUPS, Outcome, State, Strategy,
    aggregate,
};
use shuffle::testing::mix;
use shuffle::{Design, LocalExchange, Node};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

/// Per node: keys and values.
type Fragments = Vec<(Vec<u64>, Vec<i64>)>;

/// Runs `algorithm` on one sim node per fragment.
fn run(algorithm: Algorithm, data: &Fragments, config: &AggConfig) -> Vec<Outcome> {
    let nodes = data.len();
    let net = SimNetwork::new(SimConfig::default());
    let devices: Vec<Arc<dyn Device>> = (0..nodes)
        .map(|_| net.add_node() as Arc<dyn Device>)
        .collect();
    let exchanges = LocalExchange::group(nodes, Duration::from_secs(30));
    std::thread::scope(|s| {
        let hs: Vec<_> = exchanges
            .into_iter()
            .zip(devices)
            .zip(data)
            .map(|((x, device), (keys, values))| {
                s.spawn(move || {
                    let node = Node::join(device, Arc::new(x), 1 << 30).unwrap();
                    let input = Input::new(keys, values).unwrap();
                    aggregate(&node, algorithm, input, config)
                        .unwrap_or_else(|e| panic!("{algorithm}: {e}"))
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("node panicked"))
            .collect()
    })
}

/// The straightforward single-node GROUP BY.
fn reference(data: &Fragments) -> BTreeMap<u64, (i128, u64, i64, i64)> {
    let mut m: BTreeMap<u64, (i128, u64, i64, i64)> = BTreeMap::new();
    for (keys, values) in data {
        for (&k, &v) in keys.iter().zip(values) {
            let e = m.entry(k).or_insert((0, 0, i64::MAX, i64::MIN));
            e.0 += i128::from(v);
            e.1 += 1;
            e.2 = e.2.min(v);
            e.3 = e.3.max(v);
        }
    }
    m
}

const QUERY: [AggFn; 5] = [AggFn::Sum, AggFn::Count, AggFn::Avg, AggFn::Min, AggFn::Max];

/// Every group exactly once over all nodes, on its owner, with every aggregate exact.
fn check(algorithm: Algorithm, data: &Fragments, outcomes: &[Outcome]) {
    let want = reference(data);
    let mut got: BTreeMap<u64, Vec<AggValue>> = BTreeMap::new();
    for (rank, o) in outcomes.iter().enumerate() {
        for row in o.rows(&QUERY) {
            assert_eq!(
                shuffle::ops::aggregate::owner(shuffle::ops::aggregate::hash(row.key), data.len()),
                rank,
                "{algorithm}: group {} on a node that does not own it",
                row.key
            );
            assert!(
                got.insert(row.key, row.values).is_none(),
                "{algorithm}: group {} twice",
                row.key
            );
        }
    }
    assert_eq!(got.len(), want.len(), "{algorithm}: number of groups");
    for (k, (sum, count, min, max)) in want {
        let values = got
            .get(&k)
            .unwrap_or_else(|| panic!("{algorithm}: group {k} missing"));
        assert_eq!(
            values,
            &vec![
                AggValue::Sum(sum),
                AggValue::Count(count),
                AggValue::Avg { sum, count },
                AggValue::Min(min),
                AggValue::Max(max),
            ],
            "{algorithm}: group {k}"
        );
        let avg = values[2].as_f64();
        assert!(
            (avg - sum as f64 / count as f64).abs() < 1e-9,
            "{algorithm}"
        );
    }
}

/// `per_node` tuples on each of `nodes` nodes, keys from `key(rank, i)`, values in
/// [-1000, 1000].
fn generate(nodes: usize, per_node: usize, key: impl Fn(usize, u64) -> u64) -> Fragments {
    (0..nodes)
        .map(|r| {
            let keys = (0..per_node as u64).map(|i| key(r, i)).collect();
            let values = (0..per_node as u64)
                .map(|i| (mix((r as u64) << 32 ^ i ^ 0xabc) % 2001) as i64 - 1000)
                .collect();
            (keys, values)
        })
        .collect()
}

/// Small buffers so that a run spans many messages, a memory budget of 64 groups, an
/// RDMA AGG cache table of 32.
fn config(threads: usize) -> AggConfig {
    AggConfig {
        threads,
        message_bytes: 1024,
        timeout: Duration::from_secs(20),
        local_groups: 64,
        cache_groups: 32,
        ..AggConfig::default()
    }
}

fn strategies(outcomes: &[Outcome]) -> Vec<Strategy> {
    outcomes
        .iter()
        .flat_map(|o| o.report.strategies.iter().copied())
        .collect()
}

fn all_are(outcomes: &[Outcome], want: Strategy) -> bool {
    strategies(outcomes).iter().all(|&s| s == want)
}

/// Runs every algorithm on `data` and checks each result; returns the outcomes.
fn every_algorithm(data: &Fragments, config: &AggConfig) -> Vec<(Algorithm, Vec<Outcome>)> {
    Algorithm::ALL
        .into_iter()
        .map(|a| {
            let out = run(a, data, config);
            check(a, data, &out);
            (a, out)
        })
        .collect()
}

#[test]
fn one_group() {
    for nodes in [2, 3] {
        let data = generate(nodes, 3000, |_, _| 42);
        for (a, out) in every_algorithm(&data, &config(2)) {
            match a {
                Algorithm::TwoPhase | Algorithm::AdaptiveTwoPhase => {
                    assert!(all_are(&out, Strategy::TwoPhase), "{a}")
                }
                Algorithm::AdaptiveRepartitioning => assert!(
                    all_are(&out, Strategy::RepartitioningThenTwoPhase),
                    "{a}: {:?}",
                    strategies(&out)
                ),
                Algorithm::Sampling => {
                    assert!(all_are(&out, Strategy::TwoPhase), "{a}");
                    assert_eq!(out[0].report.sampled_groups, Some(1));
                }
                Algorithm::RdmaAgg => {
                    assert!(out.iter().all(|o| o.report.sent.raw == 0), "{a}");
                    assert_eq!(
                        out.iter().map(|o| o.report.sent.partials).sum::<u64>(),
                        2 * nodes as u64,
                        "{a}: one partial per worker"
                    );
                }
                Algorithm::Repartitioning => {
                    assert!(all_are(&out, Strategy::Repartitioning), "{a}");
                    assert_eq!(
                        out.iter().map(|o| o.report.sent.raw).sum::<u64>(),
                        3000 * nodes as u64
                    );
                }
            }
        }
    }
}

#[test]
fn few_groups() {
    for nodes in [2, 3] {
        let data = generate(nodes, 4000, |r, i| mix(i * 31 + r as u64) % 10);
        for (a, out) in every_algorithm(&data, &config(2)) {
            let expected = match a {
                Algorithm::TwoPhase | Algorithm::AdaptiveTwoPhase | Algorithm::Sampling => {
                    Strategy::TwoPhase
                }
                Algorithm::Repartitioning => Strategy::Repartitioning,
                Algorithm::AdaptiveRepartitioning => Strategy::RepartitioningThenTwoPhase,
                Algorithm::RdmaAgg => Strategy::PreAggregation,
            };
            assert!(all_are(&out, expected), "{a}: {:?}", strategies(&out));
            let received: u64 = out.iter().map(|o| o.report.received_records).sum();
            let sent: u64 = out
                .iter()
                .map(|o| o.report.sent.raw + o.report.sent.partials)
                .sum();
            assert_eq!(received, sent, "{a}: every record sent was merged");
        }
    }
}

#[test]
fn many_groups_make_the_adaptive_algorithms_switch() {
    for nodes in [2, 3] {
        // 5000 groups against a budget of 64: every worker's slice has far more.
        let data = generate(nodes, 6000, |r, i| mix(i ^ (r as u64) << 40) % 5000);
        for (a, out) in every_algorithm(&data, &config(2)) {
            match a {
                Algorithm::AdaptiveTwoPhase => assert!(
                    all_are(&out, Strategy::TwoPhaseThenRepartitioning),
                    "{a}: {:?}",
                    strategies(&out)
                ),
                Algorithm::AdaptiveRepartitioning | Algorithm::Repartitioning => {
                    assert!(all_are(&out, Strategy::Repartitioning), "{a}")
                }
                Algorithm::Sampling => {
                    assert!(all_are(&out, Strategy::Repartitioning), "{a}");
                    assert!(out[0].report.sampled_groups.unwrap() >= 64);
                }
                Algorithm::TwoPhase => assert!(all_are(&out, Strategy::TwoPhase)),
                Algorithm::RdmaAgg => {
                    for o in &out {
                        assert!(o.report.sent.raw > 0, "overflow partitions were shipped");
                        assert!(o.report.sent.partials <= 2 * 32, "the table held 32 groups");
                    }
                }
            }
            if a == Algorithm::AdaptiveTwoPhase {
                for (o, (keys, _)) in out.iter().zip(&data) {
                    // Each worker shipped the partials of its full table, then every
                    // tuple from the first of a 65th group on raw.
                    assert_eq!(o.report.sent.partials, 2 * 64, "{a}");
                    let raw: usize = [&keys[..3000], &keys[3000..]]
                        .iter()
                        .map(|slice| slice.len() - first_beyond(slice, 64))
                        .sum();
                    assert_eq!(o.report.sent.raw, raw as u64, "{a}");
                }
            }
        }
    }
}

/// The index of the first key that is the `budget + 1`-th distinct one.
fn first_beyond(keys: &[u64], budget: usize) -> usize {
    let mut seen = std::collections::HashSet::new();
    keys.iter()
        .position(|k| seen.insert(*k) && seen.len() > budget)
        .unwrap_or(keys.len())
}

#[test]
fn adaptive_repartitioning_switches_back_when_its_table_fills() {
    // 300 groups: fewer than the crossover (512) in the first segment, so it switches
    // to local aggregation, whose budget (64 groups) then overflows.
    let data = generate(2, 6000, |r, i| mix(i * 7 + r as u64) % 300);
    let config = AggConfig {
        crossover: Some(512),
        init_segment: Some(1024),
        ..config(2)
    };
    let out = run(Algorithm::AdaptiveRepartitioning, &data, &config);
    check(Algorithm::AdaptiveRepartitioning, &data, &out);
    assert!(
        all_are(&out, Strategy::RepartitioningThenTwoPhaseThenRepartitioning),
        "{:?}",
        strategies(&out)
    );
    assert!(out.iter().all(|o| o.report.switched_workers() == 2));
}

#[test]
fn adaptive_two_phase_gives_up_early_on_tables_that_keep_growing() {
    // Every key distinct: the second window of 16384 tuples creates a group for each,
    // long before the (large) memory budget fills.
    let data = generate(2, 40_000, |r, i| (r as u64) << 32 | i);
    let config = AggConfig {
        local_groups: 1 << 20,
        ..config(1)
    };
    let out = run(Algorithm::AdaptiveTwoPhase, &data, &config);
    check(Algorithm::AdaptiveTwoPhase, &data, &out);
    assert!(all_are(&out, Strategy::TwoPhaseThenRepartitioning));
    for o in &out {
        let folded = 2 * shuffle::ops::aggregate::GROWTH_WINDOW as u64;
        assert_eq!(o.report.sent.partials, folded);
        assert_eq!(o.report.sent.raw, 40_000 - folded);
    }
    // A few groups per window never trigger it.
    let data = generate(2, 40_000, |r, i| mix(i ^ (r as u64) << 32) % 3000);
    let out = run(Algorithm::AdaptiveTwoPhase, &data, &config);
    check(Algorithm::AdaptiveTwoPhase, &data, &out);
    assert!(all_are(&out, Strategy::TwoPhase));
}

#[test]
fn skewed_groups() {
    for nodes in [2, 3] {
        // Half the tuples in group 0, the rest spread over 2000 groups; node 0 holds
        // twice as much as the others.
        let data: Fragments = (0..nodes)
            .map(|r| {
                let n = if r == 0 { 8000u64 } else { 4000 };
                let keys = (0..n)
                    .map(|i| {
                        let h = mix(i ^ (r as u64) << 50);
                        if h.is_multiple_of(2) { 0 } else { h % 2000 }
                    })
                    .collect();
                let values = (0..n).map(|i| (i as i64 % 97) - 48).collect();
                (keys, values)
            })
            .collect();
        every_algorithm(&data, &config(2));
    }
}

#[test]
fn negative_and_extreme_values() {
    for nodes in [2, 3] {
        let mut data = generate(nodes, 2000, |r, i| mix(i + (r as u64) * 1000) % 50);
        for (_, values) in &mut data {
            for (i, v) in values.iter_mut().enumerate() {
                *v = match i % 5 {
                    0 => i64::MIN,
                    1 => i64::MAX,
                    _ => -(*v).abs() - 1,
                };
            }
        }
        // Keys at the ends of the range are ordinary groups.
        data[0].0[0] = u64::MAX;
        data[0].0[1] = 0;
        every_algorithm(&data, &config(2));
    }
}

#[test]
fn empty_input_on_some_or_all_nodes() {
    for nodes in [2, 3] {
        let none: Fragments = vec![(vec![], vec![]); nodes];
        for (_, out) in every_algorithm(&none, &config(2)) {
            assert!(out.iter().all(|o| o.groups.is_empty()));
        }
        let mut some = generate(nodes, 500, |_, i| i % 70);
        some[0] = (vec![], vec![]);
        every_algorithm(&some, &config(3));
    }
}

#[test]
fn a_single_endpoint_design_and_one_thread_agree() {
    let data = generate(2, 3000, |r, i| mix(i ^ r as u64) % 400);
    for design in ["SEMQ/SR", "SESQ/SR", "MEMQ/RD"] {
        let config = AggConfig {
            design: design.parse::<Design>().unwrap(),
            ..config(1)
        };
        every_algorithm(&data, &config);
    }
}

/// Workers that also receive: each merges what arrives, its own node's records
/// straight from its sending buffers, into a table of its own; every algorithm still
/// gives every group exactly once, with few and with many groups, one and several
/// threads, and a design whose one endpoint the threads share.
#[test]
fn workers_that_also_receive_agree() {
    for (nodes, groups) in [(2, 7), (3, 400), (2, 5000)] {
        let data = generate(nodes, 4000, |r, i| mix((i * 17) ^ r as u64) % groups);
        for (threads, design) in [
            (1, "MEMQ/WR"),
            (2, "MEMQ/WR"),
            (2, "SEMQ/SR"),
            (2, "MESQ/SR"),
        ] {
            let config = AggConfig {
                design: design.parse::<Design>().unwrap(),
                interleave: true,
                ..config(threads)
            };
            every_algorithm(&data, &config);
        }
    }
}

#[test]
fn bad_arguments_are_clear_errors() {
    let err = Input::new(&[1, 2], &[1]).unwrap_err().to_string();
    assert!(err.contains("2 keys but 1 values"), "{err}");
    let err = "nope".parse::<Algorithm>().unwrap_err().to_string();
    assert!(err.contains("two-phase"), "{err}");
    for a in Algorithm::ALL {
        assert_eq!(a.name().parse::<Algorithm>().unwrap(), a);
    }
    let net = SimNetwork::new(SimConfig::default());
    let x = LocalExchange::group(1, Duration::from_secs(5))
        .pop()
        .unwrap();
    let node = Node::join(net.add_node(), Arc::new(x), 1 << 30).unwrap();
    let input = Input::new(&[1], &[1]).unwrap();
    for bad in [
        AggConfig {
            threads: 0,
            ..AggConfig::default()
        },
        AggConfig {
            local_groups: 0,
            ..AggConfig::default()
        },
        AggConfig {
            cache_groups: 0,
            ..AggConfig::default()
        },
        // Allocated whole by every worker: a huge one once wrapped the sizing loop
        // into spinning for ever, or aborted the process.
        AggConfig {
            cache_groups: usize::MAX,
            ..AggConfig::default()
        },
        AggConfig {
            cache_groups: MAX_CACHE_GROUPS + 1,
            ..AggConfig::default()
        },
    ] {
        let err = aggregate(&node, Algorithm::TwoPhase, input, &bad)
            .err()
            .expect("rejected");
        assert!(err.to_string().contains("aggregation:"), "{err}");
    }
    // A single node aggregates alone.
    let out = aggregate(
        &node,
        Algorithm::AdaptiveTwoPhase,
        input,
        &AggConfig::default(),
    )
    .unwrap();
    assert_eq!(out.groups.get(1), Some(State::of(1)));
}
