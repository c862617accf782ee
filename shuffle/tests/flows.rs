//! DFI-style flows over real endpoint designs on the sim backend: N nodes as threads of
//! this process, each with one set of endpoints that all its flows share.

use fabric::Device;
use fabric::sim::{SimConfig, SimNetwork};
use shuffle::flow::{
    Aggregate, Column, FlowConfig, FlowError, FlowNet, FlowSpec, Mode, Schema, Value, all_threads,
    pack_bytes, unpack_bytes,
};
use shuffle::testing::mix;
use shuffle::{Design, EndpointConfig, LocalExchange, Node, open};
use std::collections::BTreeMap;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The designs the flows are tested over: all eight.
fn designs() -> Vec<Design> {
    Design::ALL.to_vec()
}

/// Runs `body` on every node of a `nodes`-node sim network whose endpoints (design
/// `design`, `threads` threads, small buffers so that flows span many of them) are
/// shared by one flow net per node; shuts the nets down and returns each node's result.
fn run_nodes<T: Send>(
    design: Design,
    nodes: usize,
    threads: usize,
    config: FlowConfig,
    body: impl Fn(&FlowNet) -> T + Sync,
) -> Vec<T> {
    let net = SimNetwork::new(SimConfig::default());
    let devices: Vec<Arc<dyn Device>> = (0..nodes)
        .map(|_| net.add_node() as Arc<dyn Device>)
        .collect();
    let exchanges = LocalExchange::group(nodes, Duration::from_secs(30));
    let endpoint_config = EndpointConfig {
        threads,
        message_bytes: 1024,
        timeout: Duration::from_secs(5),
        ..EndpointConfig::default()
    };
    std::thread::scope(|s| {
        let hs: Vec<_> = exchanges
            .into_iter()
            .zip(devices)
            .map(|(x, device)| {
                let (config, endpoint_config, body) = (config.clone(), &endpoint_config, &body);
                s.spawn(move || {
                    let node = Arc::new(Node::join(device, Arc::new(x), 1 << 30).unwrap());
                    let opened = open(&node, design, endpoint_config)
                        .unwrap_or_else(|e| panic!("{design}: {e}"));
                    let flows = FlowNet::new(node, opened, config).unwrap();
                    let out = body(&flows);
                    flows.shutdown().unwrap_or_else(|e| panic!("{design}: {e}"));
                    out
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("node panicked"))
            .collect()
    })
}

fn kv() -> Schema {
    Schema::new(vec![Column::u64("k"), Column::u64("v")], "k").unwrap()
}

/// Tuple `i` of source `(rank, thread)`: a key among `keys`, and a value unique to it.
fn tuple(rank: usize, thread: usize, i: u64, keys: u64) -> [u64; 2] {
    let v = ((rank as u64) << 40) | ((thread as u64) << 32) | i;
    [mix(v) % keys, v]
}

fn sent_by(places: &[(usize, usize)], n: u64, keys: u64) -> Vec<Vec<u64>> {
    let mut all: Vec<Vec<u64>> = places
        .iter()
        .flat_map(|&(r, t)| (0..n).map(move |i| tuple(r, t, i, keys).to_vec()))
        .collect();
    all.sort();
    all
}

/// Runs the flow `spec` with every declared source pushing `n` tuples of [`tuple`] and
/// every target collecting; returns `(target index, sorted tuples)` of every target.
fn push_and_collect(
    design: Design,
    nodes: usize,
    threads: usize,
    spec: &FlowSpec,
    n: u64,
    keys: u64,
) -> Vec<(usize, Vec<Vec<u64>>)> {
    let per_node = run_nodes(design, nodes, threads, FlowConfig::default(), |net| {
        let flow = net.declare(spec.clone()).unwrap();
        let me = net.rank();
        std::thread::scope(|s| {
            for &(_, t) in spec.sources.iter().filter(|p| p.0 == me) {
                let mut src = flow.source(t).unwrap();
                s.spawn(move || {
                    for i in 0..n {
                        src.push(&tuple(me, t, i, keys)).unwrap();
                    }
                    src.close().unwrap();
                });
            }
            let hs: Vec<_> = spec
                .targets
                .iter()
                .filter(|p| p.0 == me)
                .map(|&(_, t)| {
                    let mut tgt = flow.target(t).unwrap();
                    s.spawn(move || {
                        let mut got = tgt.collect_all().unwrap();
                        got.sort();
                        (tgt.index(), got)
                    })
                })
                .collect();
            hs.into_iter()
                .map(|h| h.join().unwrap())
                .collect::<Vec<_>>()
        })
    });
    per_node.into_iter().flatten().collect()
}

#[test]
fn shuffle_flow_by_key_hash_delivers_every_tuple_once_with_each_key_at_one_target() {
    let (nodes, threads, n, keys) = (3, 2, 1500, 101);
    for design in designs() {
        let places = all_threads(nodes, threads);
        let spec = FlowSpec::shuffle("by-hash", kv())
            .sources(places.clone())
            .targets(places.clone());
        let got = push_and_collect(design, nodes, threads, &spec, n, keys);
        assert_eq!(got.len(), places.len());
        let mut owner = BTreeMap::new();
        let mut all = Vec::new();
        for (ti, tuples) in got {
            for t in tuples {
                let o = *owner.entry(t[0]).or_insert(ti);
                assert_eq!(o, ti, "{design}: key {} at targets {o} and {ti}", t[0]);
                all.push(t);
            }
        }
        all.sort();
        assert!(
            all == sent_by(&places, n, keys),
            "{design}: multiset differs"
        );
        assert!(
            owner
                .values()
                .collect::<std::collections::BTreeSet<_>>()
                .len()
                > 1
        );
    }
}

#[test]
fn shuffle_flow_with_a_routing_function_delivers_exactly_the_routed_multisets() {
    let (nodes, threads, n, keys) = (3, 2, 1000, 60);
    let targets = all_threads(nodes, threads);
    // Sources on two of the nodes only: N:M with N != M.
    let sources: Vec<_> = all_threads(2, threads);
    let spec = FlowSpec::shuffle("by-fn", kv())
        .sources(sources.clone())
        .targets(targets.clone())
        .route(|t| (t[0] % 6) as usize);
    for design in designs() {
        let got = push_and_collect(design, nodes, threads, &spec, n, keys);
        let all = sent_by(&sources, n, keys);
        assert_eq!(got.len(), 6);
        for (ti, tuples) in got {
            let want: Vec<_> = all
                .iter()
                .filter(|t| (t[0] % 6) as usize == ti)
                .cloned()
                .collect();
            assert!(!want.is_empty());
            assert!(
                tuples == want,
                "{design}: target {ti} got {} of {}",
                tuples.len(),
                want.len()
            );
        }
    }
}

#[test]
fn replicate_flow_delivers_every_tuple_to_every_target() {
    let (nodes, threads, n, keys) = (3, 2, 800, 1000);
    let sources = vec![(0, 0), (1, 1), (2, 0)];
    let targets = all_threads(nodes, threads);
    let spec = FlowSpec::replicate("rep", kv())
        .sources(sources.clone())
        .targets(targets.clone());
    for design in designs() {
        let got = push_and_collect(design, nodes, threads, &spec, n, keys);
        assert_eq!(got.len(), targets.len());
        let want = sent_by(&sources, n, keys);
        for (ti, tuples) in got {
            assert!(
                tuples == want,
                "{design}: target {ti} got {} of {}",
                tuples.len(),
                want.len()
            );
        }
    }
}

/// `(k, a i64, x f64)` tuples for the combiner tests.
fn kax(rank: usize, thread: usize, i: u64, keys: u64) -> [u64; 3] {
    let [k, v] = tuple(rank, thread, i, keys);
    let a = (v % 2001) as i64 - 1000;
    [k, a as u64, ((v % 17) as f64 * 0.5).to_bits()]
}

#[test]
fn combiner_flow_delivers_sum_count_min_max_per_key() {
    let (nodes, threads, n, keys) = (3, 2, 1200, 37);
    let schema = Schema::new(
        vec![Column::u64("k"), Column::i64("a"), Column::f64("x")],
        "k",
    )
    .unwrap();
    let aggs = vec![
        Aggregate::sum("a"),
        Aggregate::count(),
        Aggregate::min("a"),
        Aggregate::max("a"),
        Aggregate::sum("x"),
        Aggregate::max("x"),
    ];
    let sources = all_threads(nodes, threads);
    // Two targets, each owning part of the keys; node 2 only sends.
    let targets = vec![(0, 1), (1, 0)];
    let mut want: BTreeMap<u64, (i64, u64, i64, i64, f64, f64)> = BTreeMap::new();
    for &(r, t) in &sources {
        for i in 0..n {
            let [k, a, x] = kax(r, t, i, keys);
            let (a, x) = (a as i64, f64::from_bits(x));
            let e = want
                .entry(k)
                .or_insert((0, 0, i64::MAX, i64::MIN, 0.0, f64::MIN));
            e.0 += a;
            e.1 += 1;
            e.2 = e.2.min(a);
            e.3 = e.3.max(a);
            e.4 += x;
            e.5 = e.5.max(x);
        }
    }
    for design in designs() {
        for mode in [Mode::Bandwidth, Mode::Latency] {
            let spec = FlowSpec::combiner("agg", schema.clone(), aggs.clone())
                .sources(sources.clone())
                .targets(targets.clone())
                .mode(mode);
            // A small table, so that sources flush it several times.
            let config = FlowConfig {
                combiner_entries: 8,
                ..FlowConfig::default()
            };
            let got = run_nodes(design, nodes, threads, config, |net| {
                let flow = net.declare(spec.clone()).unwrap();
                let me = net.rank();
                std::thread::scope(|s| {
                    for t in 0..threads {
                        let mut src = flow.source(t).unwrap();
                        s.spawn(move || {
                            for i in 0..n {
                                src.push(&kax(me, t, i, keys)).unwrap();
                            }
                            src.close().unwrap();
                        });
                    }
                    let hs: Vec<_> = targets
                        .iter()
                        .filter(|p| p.0 == me)
                        .map(|&(_, t)| {
                            let tgt = flow.target(t).unwrap();
                            s.spawn(move || tgt.combined().unwrap())
                        })
                        .collect();
                    hs.into_iter()
                        .map(|h| h.join().unwrap())
                        .collect::<Vec<_>>()
                })
            });
            let per_target: Vec<_> = got.into_iter().flatten().collect();
            assert_eq!(per_target.len(), 2);
            assert!(
                per_target.iter().all(|c| !c.is_empty()),
                "{design}: a target got no keys"
            );
            let mut have = BTreeMap::new();
            for c in per_target.into_iter().flatten() {
                let [
                    Value::I64(sum),
                    Value::U64(count),
                    Value::I64(min),
                    Value::I64(max),
                    Value::F64(xs),
                    Value::F64(xm),
                ] = c.values[..]
                else {
                    panic!("{design}: unexpected value types {c:?}")
                };
                let dup = have.insert(c.key[0], (sum, count, min, max, xs, xm));
                assert!(dup.is_none(), "{design}: key {} at two targets", c.key[0]);
            }
            // Halves of small integers: the f64 sums are exact in any order.
            assert_eq!(have, want, "{design} {mode:?}");
        }
    }
}

#[test]
fn latency_mode_delivers_each_push_while_the_source_is_open() {
    for design in designs() {
        let (to_source, from_target) = mpsc::channel::<u64>();
        let from_target = Mutex::new(from_target);
        let spec = FlowSpec::shuffle("ping", kv())
            .sources([(0, 0)])
            .targets([(1, 0)])
            .mode(Mode::Latency);
        run_nodes(design, 2, 1, FlowConfig::default(), |net| {
            let flow = net.declare(spec.clone()).unwrap();
            if net.rank() == 0 {
                let mut src = flow.source(0).unwrap();
                let from_target = from_target.lock().unwrap();
                for i in 0..3u64 {
                    src.push(&[i, 100 + i]).unwrap();
                    // The target must hold this tuple before the source sends more or
                    // closes: a flow that waits for a full buffer or for the close
                    // never gets here.
                    let echoed = from_target
                        .recv_timeout(Duration::from_secs(20))
                        .unwrap_or_else(|_| panic!("{design}: push {i} did not arrive alone"));
                    assert_eq!(echoed, 100 + i);
                }
                src.close().unwrap();
            } else {
                let mut tgt = flow.target(0).unwrap();
                for i in 0..3u64 {
                    let t = tgt.next_tuple().unwrap().expect("a tuple before the end");
                    assert_eq!(t, [i, 100 + i]);
                    to_source.send(t[1]).unwrap();
                }
                assert!(tgt.next_tuple().unwrap().is_none());
            }
        });
    }
}

#[test]
fn two_flows_multiplexed_over_one_endpoint_set_each_deliver_their_own_data() {
    let (nodes, threads, n) = (3, 2, 1000);
    let wide = Schema::new(
        vec![Column::u64("k"), Column::u64("v"), Column::bytes("tag", 8)],
        "k",
    )
    .unwrap();
    let places = all_threads(nodes, threads);
    for design in designs() {
        let got = run_nodes(design, nodes, threads, FlowConfig::default(), |net| {
            let a = net
                .declare(
                    FlowSpec::shuffle("a", kv())
                        .sources(places.clone())
                        .targets(places.clone()),
                )
                .unwrap();
            let b = net
                .declare(
                    FlowSpec::shuffle("b", wide.clone())
                        .sources(places.clone())
                        .targets(places.clone())
                        .route(|t| (t[1] % 6) as usize),
                )
                .unwrap();
            assert_ne!(a.id(), b.id());
            let me = net.rank();
            std::thread::scope(|s| {
                for t in 0..threads {
                    let (mut sa, mut sb) = (a.source(t).unwrap(), b.source(t).unwrap());
                    s.spawn(move || {
                        // Interleaved on the same thread and endpoint.
                        for i in 0..n {
                            let x = tuple(me, t, i, 50);
                            sa.push(&x).unwrap();
                            sb.push(&[x[0], x[1], 0xb]).unwrap();
                        }
                        sa.close().unwrap();
                        sb.close().unwrap();
                    });
                }
                let hs: Vec<_> = (0..threads)
                    .map(|t| {
                        let (mut ta, mut tb) = (a.target(t).unwrap(), b.target(t).unwrap());
                        // Each target consumed by its own thread: the sources push
                        // into both, so neither may wait for the other's end.
                        let hb = s.spawn(move || tb.collect_all().unwrap());
                        s.spawn(move || {
                            let ga = ta.collect_all().unwrap();
                            (ta.index(), ga, hb.join().unwrap())
                        })
                    })
                    .collect();
                hs.into_iter()
                    .map(|h| h.join().unwrap())
                    .collect::<Vec<_>>()
            })
        });
        let (mut all_a, mut all_b) = (Vec::new(), Vec::new());
        for (ti, ga, gb) in got.into_iter().flatten() {
            assert!(ga.iter().all(|t| t.len() == 2), "{design}: b's tuples in a");
            assert!(
                gb.iter().all(|t| t.len() == 3 && t[2] == 0xb),
                "{design}: a in b"
            );
            assert!(gb.iter().all(|t| (t[1] % 6) as usize == ti));
            all_a.extend(ga);
            all_b.extend(gb.into_iter().map(|t| t[..2].to_vec()));
        }
        all_a.sort();
        all_b.sort();
        let want = sent_by(&places, n, 50);
        assert!(all_a == want, "{design}: flow a");
        assert!(all_b == want, "{design}: flow b");
    }
}

/// A two-stage pipeline on the same threads and endpoints: a shuffle whose targets
/// feed a combiner, with some nodes racing ahead into stage two while others still
/// consume stage one. Flow "late" is pushed in full before anyone consumes it, far
/// more than the endpoints buffer: its sources wait for credit, and its unconsumed
/// data must not keep stage one's targets from their data.
#[test]
fn stages_share_endpoints_and_unconsumed_flows_do_not_block_others() {
    let (nodes, threads, n, keys) = (3, 2, 1500, 23);
    let places = all_threads(nodes, threads);
    let config = FlowConfig {
        window: 2,
        timeout: Duration::from_secs(15),
        ..FlowConfig::default()
    };
    for design in designs() {
        let got = run_nodes(design, nodes, threads, config.clone(), |net| {
            let stage1 = net
                .declare(
                    FlowSpec::shuffle("stage1", kv())
                        .sources(places.clone())
                        .targets(places.clone()),
                )
                .unwrap();
            let stage2 = net
                .declare(
                    FlowSpec::combiner("stage2", kv(), vec![Aggregate::sum("v")])
                        .sources(places.clone())
                        .targets([(0, 0)]),
                )
                .unwrap();
            let late = net
                .declare(
                    FlowSpec::shuffle("late", kv())
                        .sources(places.clone())
                        .targets(places.clone()),
                )
                .unwrap();
            let me = net.rank();
            let (done_tx, done_rx) = mpsc::channel::<()>();
            std::thread::scope(|s| {
                for t in 0..threads {
                    let mut src = late.source(t).unwrap();
                    s.spawn(move || {
                        for i in 0..n {
                            src.push(&tuple(me, t, i, keys)).unwrap();
                        }
                        src.close().unwrap();
                    });
                    let mut src = stage1.source(t).unwrap();
                    s.spawn(move || {
                        for i in 0..n {
                            src.push(&tuple(me, t, i, keys)).unwrap();
                        }
                        src.close().unwrap();
                    });
                }
                let stage_hs: Vec<_> = (0..threads)
                    .map(|t| {
                        let mut tgt = stage1.target(t).unwrap();
                        let mut next = stage2.source(t).unwrap();
                        let done_tx = done_tx.clone();
                        s.spawn(move || {
                            let mut seen = 0u64;
                            while let Some(x) = tgt.next_tuple().unwrap() {
                                next.push(x).unwrap();
                                seen += 1;
                            }
                            next.close().unwrap();
                            done_tx.send(()).unwrap();
                            seen
                        })
                    })
                    .collect();
                drop(done_tx);
                let sums = (me == 0).then(|| {
                    let tgt = stage2.target(0).unwrap();
                    s.spawn(move || tgt.combined().unwrap())
                });
                // Only once stage one is consumed here does anyone consume "late".
                for _ in 0..threads {
                    done_rx.recv().unwrap();
                }
                let late_hs: Vec<_> = (0..threads)
                    .map(|t| {
                        let mut tgt = late.target(t).unwrap();
                        s.spawn(move || tgt.collect_all().unwrap().len() as u64)
                    })
                    .collect();
                let seen: u64 = stage_hs.into_iter().map(|h| h.join().unwrap()).sum();
                let late_seen: u64 = late_hs.into_iter().map(|h| h.join().unwrap()).sum();
                (seen, late_seen, sums.map(|h| h.join().unwrap()))
            })
        });
        let total = (nodes * threads) as u64 * n;
        assert_eq!(
            got.iter().map(|g| g.0).sum::<u64>(),
            total,
            "{design}: stage one"
        );
        assert_eq!(
            got.iter().map(|g| g.1).sum::<u64>(),
            total,
            "{design}: late"
        );
        let mut want = BTreeMap::new();
        for (r, t) in places.clone() {
            for i in 0..n {
                let [k, v] = tuple(r, t, i, keys);
                let e = want.entry(k).or_insert(0u64);
                *e = e.wrapping_add(v);
            }
        }
        let sums: BTreeMap<u64, u64> = got[0]
            .2
            .as_ref()
            .unwrap()
            .iter()
            .map(|c| match c.values[..] {
                [Value::U64(s)] => (c.key[0], s),
                _ => panic!("{c:?}"),
            })
            .collect();
        assert_eq!(sums, want, "{design}: stage two");
    }
}

#[test]
fn misuse_is_reported_clearly() {
    let design = designs()[0];
    let bytes_schema = Schema::new(vec![Column::u64("k"), Column::bytes("b", 12)], "k").unwrap();
    run_nodes(design, 2, 2, FlowConfig::default(), |net| {
        let me = net.rank();
        let places = all_threads(2, 2);
        // Declarations that make no sense fail on every node alike, before any exchange.
        let e = net
            .declare(FlowSpec::shuffle("none", kv()).sources(places.clone()))
            .unwrap_err();
        assert!(matches!(e, FlowError::Declaration { .. }), "{e}");
        let e = net
            .declare(
                FlowSpec::shuffle("far", kv())
                    .sources(places.clone())
                    .targets([(5, 0)]),
            )
            .unwrap_err();
        assert!(e.to_string().contains("node 5 of 2"), "{e}");
        let e = net
            .declare(
                FlowSpec::combiner("bytes", bytes_schema.clone(), vec![Aggregate::max("b")])
                    .sources(places.clone())
                    .targets(places.clone()),
            )
            .unwrap_err();
        assert!(e.to_string().contains("byte column"), "{e}");
        net.declare(
            FlowSpec::shuffle("once", kv())
                .sources(places.clone())
                .targets(places.clone()),
        )
        .unwrap();
        let e = net
            .declare(
                FlowSpec::shuffle("once", kv())
                    .sources(places.clone())
                    .targets(places.clone()),
            )
            .unwrap_err();
        assert!(e.to_string().contains("already declared"), "{e}");
        // Nodes that disagree on a declaration are told so.
        let targets = if me == 0 { vec![(0, 0)] } else { vec![(1, 0)] };
        let e = net
            .declare(
                FlowSpec::shuffle("disagree", kv())
                    .sources(places.clone())
                    .targets(targets),
            )
            .unwrap_err();
        assert!(
            matches!(e, FlowError::Mismatch { rank, .. } if rank != me),
            "{e}"
        );

        let flow = net
            .declare(
                FlowSpec::shuffle("f", kv())
                    .sources(places.clone())
                    .targets([(0, 0), (1, 1)])
                    .route(|t| t[0] as usize),
            )
            .unwrap();
        // Thread 1 of node 0 and thread 0 of node 1 are no targets.
        let not_target = if me == 0 { 1 } else { 0 };
        let e = flow.target(not_target).err().unwrap();
        assert!(
            matches!(e, FlowError::NotDeclared { role: "target", .. }),
            "{e}"
        );
        assert!(matches!(
            flow.source(7).err().unwrap(),
            FlowError::NotDeclared { role: "source", .. }
        ));
        let mut src = flow.source(0).unwrap();
        assert!(matches!(
            flow.source(0).err().unwrap(),
            FlowError::Taken { .. }
        ));
        let e = src.push(&[1, 2, 3]).unwrap_err();
        assert!(
            matches!(
                e,
                FlowError::TupleWidth {
                    expected: 2,
                    got: 3,
                    ..
                }
            ),
            "{e}"
        );
        let e = src.push(&[9, 0]).unwrap_err();
        assert!(
            matches!(
                e,
                FlowError::UnknownTarget {
                    target: 9,
                    targets: 2,
                    ..
                }
            ),
            "{e}"
        );
        let e = src.push_to(2, &[0, 0]).unwrap_err();
        assert!(
            matches!(e, FlowError::UnknownTarget { target: 2, .. }),
            "{e}"
        );
        src.push(&[me as u64, 42]).unwrap();
        src.close().unwrap();
        let e = src.push(&[0, 1]).unwrap_err();
        assert!(matches!(e, FlowError::Closed { .. }), "{e}");
        assert!(e.to_string().contains("is closed"), "{e}");
        assert!(matches!(src.close().unwrap_err(), FlowError::Closed { .. }));
        flow.source(1).unwrap().close().unwrap();
        let mut tgt = flow.target(me).unwrap();
        assert!(matches!(
            flow.target(me).err().unwrap(),
            FlowError::Taken { .. }
        ));
        let got = tgt.collect_all().unwrap();
        assert_eq!(got, vec![vec![me as u64, 42]]);
        let e = flow.target(me).err().unwrap();
        assert!(matches!(e, FlowError::Taken { .. }));
        drop(tgt);
        let e = net
            .declare(
                FlowSpec::shuffle("g", kv())
                    .sources(places.clone())
                    .targets(places.clone()),
            )
            .unwrap();
        let mut t = e.target(0).unwrap();
        for th in 0..2 {
            e.source(th).unwrap().close().unwrap();
        }
        // A shuffle flow has no aggregates to combine; its tuples are consumed as is.
        assert!(t.next_tuple().unwrap().is_none());
        let e2 = e.target(1).unwrap().combined().unwrap_err();
        assert!(matches!(e2, FlowError::WrongKind { .. }), "{e2}");
    });
}

#[test]
fn a_target_whose_source_never_closes_times_out_naming_it() {
    let design = designs()[0];
    let config = FlowConfig {
        timeout: Duration::from_millis(300),
        ..FlowConfig::default()
    };
    run_nodes(design, 2, 1, config, |net| {
        let flow = net
            .declare(
                FlowSpec::shuffle("stuck", kv())
                    .sources([(0, 0)])
                    .targets([(1, 0)])
                    .mode(Mode::Latency),
            )
            .unwrap();
        if net.rank() == 0 {
            let mut src = flow.source(0).unwrap();
            src.push(&[1, 1]).unwrap();
            // Never closed; kept until the target gave up.
            let _ = net.declare(
                FlowSpec::shuffle("barrier", kv())
                    .sources([(0, 0)])
                    .targets([(0, 0)]),
            );
        } else {
            let mut tgt = flow.target(0).unwrap();
            assert_eq!(tgt.next_tuple().unwrap(), Some(&[1u64, 1][..]));
            let e = tgt.next_tuple().unwrap_err();
            assert!(matches!(e, FlowError::Timeout { .. }), "{e}");
            assert!(e.to_string().contains("[(0, 0)]"), "{e}");
            let _ = net.declare(
                FlowSpec::shuffle("barrier", kv())
                    .sources([(0, 0)])
                    .targets([(0, 0)]),
            );
        }
    });
}

#[test]
fn bandwidth_mode_fills_whole_buffers_and_latency_mode_sends_each_push() {
    let n = 500u64;
    for design in designs() {
        for mode in [Mode::Bandwidth, Mode::Latency] {
            let spec = FlowSpec::shuffle("sizes", kv())
                .sources([(0, 0)])
                .targets([(1, 0)])
                .mode(mode);
            let got = run_nodes(design, 2, 1, FlowConfig::default(), |net| {
                let flow = net.declare(spec.clone()).unwrap();
                // Tuples of two words after the two words of flow header.
                let per_buffer = (net.payload_words() - 2) / 2;
                if net.rank() == 0 {
                    let mut src = flow.source(0).unwrap();
                    for i in 0..n {
                        src.push(&[i, i]).unwrap();
                    }
                    src.close().unwrap();
                    (per_buffer, Vec::new())
                } else {
                    let mut tgt = flow.target(0).unwrap();
                    let mut sizes = Vec::new();
                    let mut seen = Vec::new();
                    while let Some(b) = tgt.next_batch().unwrap() {
                        seen.extend(b.tuples().map(|t| t.to_vec()));
                        sizes.push(b.len());
                    }
                    seen.sort();
                    assert!(seen == (0..n).map(|i| vec![i, i]).collect::<Vec<_>>());
                    (per_buffer, sizes)
                }
            });
            let (per_buffer, sizes) = (got[1].0, &got[1].1);
            assert!(per_buffer > 1 && (per_buffer as u64) < n);
            match mode {
                Mode::Bandwidth => {
                    let (last, full) = sizes.split_last().unwrap();
                    assert!(full.iter().all(|&s| s == per_buffer), "{design}: {sizes:?}");
                    assert!(*last <= per_buffer && *last > 0);
                    assert_eq!(sizes.len(), (n as usize).div_ceil(per_buffer));
                }
                Mode::Latency => {
                    assert!(sizes.iter().all(|&s| s == 1), "{design}: {sizes:?}");
                }
            }
        }
    }
}

#[test]
fn combiner_flow_groups_by_a_multi_word_byte_key() {
    let (nodes, threads, n) = (2, 2, 600u64);
    let names = [
        "ada",
        "grace hopper",
        "barbara liskov",
        "edsger w. dijkstra",
    ];
    let schema = Schema::new(vec![Column::bytes("name", 20), Column::u64("v")], "name").unwrap();
    let spec = FlowSpec::combiner(
        "names",
        schema,
        vec![Aggregate::count(), Aggregate::sum("v")],
    )
    .sources(all_threads(nodes, threads))
    .targets(all_threads(nodes, threads));
    for design in [Design::ALL[0], Design::ALL[3]] {
        let got = run_nodes(design, nodes, threads, FlowConfig::default(), |net| {
            let flow = net.declare(spec.clone()).unwrap();
            std::thread::scope(|s| {
                for t in 0..threads {
                    let mut src = flow.source(t).unwrap();
                    s.spawn(move || {
                        for i in 0..n {
                            let mut tuple =
                                pack_bytes(names[i as usize % 4].as_bytes(), 3).unwrap();
                            tuple.push(i);
                            src.push(&tuple).unwrap();
                        }
                        src.close().unwrap();
                    });
                }
                let hs: Vec<_> = (0..threads)
                    .map(|t| {
                        let tgt = flow.target(t).unwrap();
                        s.spawn(move || tgt.combined().unwrap())
                    })
                    .collect();
                hs.into_iter()
                    .flat_map(|h| h.join().unwrap())
                    .collect::<Vec<_>>()
            })
        });
        let mut have: Vec<(String, Vec<Value>)> = got
            .into_iter()
            .flatten()
            .map(|c| {
                let bytes = unpack_bytes(&c.key);
                let name = String::from_utf8(bytes)
                    .unwrap()
                    .trim_end_matches('\0')
                    .to_string();
                (name, c.values)
            })
            .collect();
        have.sort_by(|a, b| a.0.cmp(&b.0));
        let sources = (nodes * threads) as u64;
        let mut want: Vec<(String, Vec<Value>)> = names
            .iter()
            .enumerate()
            .map(|(j, name)| {
                let vs: Vec<u64> = (0..n).filter(|i| *i as usize % 4 == j).collect();
                let count = vs.len() as u64 * sources;
                let sum = vs.iter().sum::<u64>() * sources;
                (name.to_string(), vec![Value::U64(count), Value::U64(sum)])
            })
            .collect();
        want.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(have, want, "{design}");
    }
}
