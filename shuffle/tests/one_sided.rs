//! The one-sided designs (MQ/RD and MQ/WR in its three notification modes) end to
//! end: exact multisets over the sim backend for 2 and 3 nodes, 1 and 3 threads,
//! repartition and broadcast, fixed and adaptive buffering, with a straggler and with
//! injected faults; one run of each design over the shm and tcp backends; and a dead
//! peer that ends in an error rather than a hang.

use fabric::sim::{Faults, SimConfig, SimNetwork};
use fabric::{Device, NodeId};
use shuffle::testing::{Pattern, Run, run_node, run_on, run_sim};
use shuffle::{
    Buffering, Design, EndpointConfig, Endpoints, LocalExchange, Node, Notify, ShuffleError,
    Transport,
};
use std::sync::Arc;
use std::time::{Duration, Instant};

const SERD: Design = Design::new(Endpoints::Single, Transport::MqRd);
const MERD: Design = Design::new(Endpoints::Multi, Transport::MqRd);
const SEWR: Design = Design::new(Endpoints::Single, Transport::MqWr);
const MEWR: Design = Design::new(Endpoints::Multi, Transport::MqWr);

const TOKEN: &[u8] = b"one-sided shuffle test";

fn run(design: Design, notify: Notify, nodes: usize, threads: usize, tuples: u64) -> Run {
    let mut run = Run::new(design, nodes, threads, tuples);
    // Small buffers: many buffers per run, so rings wrap and buffers circulate.
    run.config.message_bytes = 512;
    run.config.notify = notify;
    run.config.timeout = Duration::from_secs(15);
    run
}

fn describe(r: &Run) -> String {
    format!(
        "{} notify {} nodes {} threads {} {:?} {:?} straggler {:?}",
        r.design, r.config.notify, r.nodes, r.threads, r.pattern, r.config.buffering, r.straggler
    )
}

/// Every combination of nodes, threads, pattern, alternating the buffering policy,
/// then a straggler and a faulty network.
fn matrix(design: Design, notify: Notify) {
    let mut k = 0;
    for nodes in [2, 3] {
        for threads in [1, 3] {
            for pattern in [Pattern::Repartition, Pattern::Broadcast] {
                let mut r = run(design, notify, nodes, threads, 1500);
                r.pattern = pattern;
                r.seed = 11 + k;
                r.config.buffering = if k % 2 == 0 {
                    Buffering::Fixed {
                        per_peer: threads + 1,
                    }
                } else {
                    Buffering::Adaptive {
                        initial: 1,
                        max_per_peer: 8,
                        keep_waiting: 1,
                    }
                };
                k += 1;
                run_sim(&r, SimConfig::default())
                    .unwrap_or_else(|e| panic!("{}: {e}", describe(&r)));
            }
        }
    }
    for buffering in [Buffering::Fixed { per_peer: 4 }, Buffering::default()] {
        let mut r = run(design, notify, 3, 3, 1000);
        r.config.buffering = buffering;
        r.straggler = Some(Duration::from_millis(1));
        run_sim(&r, SimConfig::default()).unwrap_or_else(|e| panic!("{}: {e}", describe(&r)));
    }
    for (seed, pattern) in [(1, Pattern::Repartition), (2, Pattern::Broadcast)] {
        let mut r = run(design, notify, 3, 2, 1000);
        r.pattern = pattern;
        let sim = SimConfig {
            faults: Faults {
                tear_probability: 0.3,
                completion_delay: Some((Duration::ZERO, Duration::from_micros(50))),
                ..Faults::default()
            },
            seed,
            ..SimConfig::default()
        };
        run_sim(&r, sim).unwrap_or_else(|e| panic!("{} with faults: {e}", describe(&r)));
    }
}

#[test]
fn se_rd_delivers_exact_multisets() {
    matrix(SERD, Notify::default());
}

#[test]
fn me_rd_delivers_exact_multisets() {
    matrix(MERD, Notify::default());
}

#[test]
fn se_wr_seal_delivers_exact_multisets() {
    matrix(SEWR, Notify::Seal);
}

#[test]
fn se_wr_mq_delivers_exact_multisets() {
    matrix(SEWR, Notify::MessageQueue);
}

#[test]
fn se_wr_cq_delivers_exact_multisets() {
    matrix(SEWR, Notify::CompletionQueue);
}

#[test]
fn me_wr_seal_delivers_exact_multisets() {
    matrix(MEWR, Notify::Seal);
}

#[test]
fn me_wr_mq_delivers_exact_multisets() {
    matrix(MEWR, Notify::MessageQueue);
}

#[test]
fn me_wr_cq_delivers_exact_multisets() {
    matrix(MEWR, Notify::CompletionQueue);
}

/// Each one-sided design, MQ/WR in each notification mode.
fn one_sided_designs() -> [(Design, Notify); 5] {
    [
        (SERD, Notify::default()),
        (MERD, Notify::default()),
        (SEWR, Notify::Seal),
        (MEWR, Notify::MessageQueue),
        (SEWR, Notify::CompletionQueue),
    ]
}

/// One run of each design (MQ/WR in each notification mode) on real-process backends.
fn each_design(devices: impl Fn(usize) -> Vec<Arc<dyn Device>>) {
    for (design, notify) in one_sided_designs() {
        let mut r = run(design, notify, 3, 2, 800);
        r.pattern = if design == MERD {
            Pattern::Broadcast
        } else {
            Pattern::Repartition
        };
        run_on(&r, devices(r.nodes)).unwrap_or_else(|e| panic!("{}: {e}", describe(&r)));
    }
}

/// On a network whose WRITEs place their last word first (as the IBA allows, and rxe
/// does), every ring entry still arrives whole: its stamp goes in a WRITE of its own.
#[test]
fn each_design_survives_writes_that_place_their_last_word_first() {
    for (design, notify) in one_sided_designs() {
        for pattern in [Pattern::Repartition, Pattern::Broadcast] {
            let mut r = run(design, notify, 3, 2, 1000);
            r.pattern = pattern;
            let sim = SimConfig {
                faults: Faults {
                    write_last_word_first: true,
                    ..Faults::default()
                },
                ..SimConfig::default()
            };
            run_sim(&r, sim).unwrap_or_else(|e| panic!("{} last word first: {e}", describe(&r)));
        }
    }
}

#[cfg(target_os = "linux")]
#[test]
fn each_design_runs_on_shm() {
    let dir = tempfile::tempdir().unwrap();
    let round = std::sync::atomic::AtomicUsize::new(0);
    each_design(|nodes| {
        let k = round.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        (0..nodes)
            .map(|i| {
                let path = dir.path().join(format!("r{k}-n{i}.sock"));
                fabric::shm::ShmDevice::bind_as(path, TOKEN, NodeId(i as u32)).unwrap()
                    as Arc<dyn Device>
            })
            .collect()
    });
}

#[test]
fn each_design_runs_on_tcp() {
    each_design(|nodes| {
        (0..nodes)
            .map(|i| {
                fabric::tcp::TcpDevice::bind_as("127.0.0.1:0", TOKEN, NodeId(i as u32)).unwrap()
                    as Arc<dyn Device>
            })
            .collect()
    });
}

/// Node 1 opens the endpoints and stops. Node 0's shuffle must fail (a completion
/// error or a timeout), not hang.
fn dead_peer(design: Design, notify: Notify) {
    let net = SimNetwork::new(SimConfig::default());
    let mut r = run(design, notify, 2, 2, 2000);
    r.config.timeout = Duration::from_millis(500);
    let exchanges = LocalExchange::group(2, Duration::from_secs(10));
    let started = Instant::now();
    let results: Vec<Result<(), ShuffleError>> = std::thread::scope(|s| {
        let hs: Vec<_> = exchanges
            .into_iter()
            .enumerate()
            .map(|(rank, x)| {
                let device = net.add_node() as Arc<dyn Device>;
                let r = &r;
                s.spawn(move || {
                    let node = Node::join(device, Arc::new(x), 1 << 30)?;
                    if rank == 0 {
                        run_node(&node, r).map(|_| ())
                    } else {
                        let config = EndpointConfig { ..r.config.clone() };
                        let opened = shuffle::open(&node, r.design, &config)?;
                        drop(opened);
                        drop(node);
                        Ok(())
                    }
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let waited = started.elapsed();
    assert!(results[1].is_ok());
    let err = results[0]
        .as_ref()
        .expect_err("a shuffle with a dead peer succeeded");
    assert!(
        matches!(
            err,
            ShuffleError::Completion { .. } | ShuffleError::Timeout { .. }
        ),
        "{design} ({notify}): {err}"
    );
    assert!(
        waited < Duration::from_secs(20),
        "{design} ({notify}) took {waited:?} to fail"
    );
}

#[test]
fn a_dead_peer_is_an_error_not_a_hang() {
    dead_peer(SERD, Notify::default());
    dead_peer(MERD, Notify::default());
    for notify in [Notify::Seal, Notify::MessageQueue, Notify::CompletionQueue] {
        dead_peer(SEWR, notify);
        dead_peer(MEWR, notify);
    }
}
