//! Nodes whose threads each both send and receive (`shuffle::send_and_receive`): every
//! design delivers exactly the multiset sent, with one thread per node and with
//! several, with a straggler, under UD reordering and delayed completions, and with so
//! few buffers that sending waits on the peers' receiving all the time. Two such nodes
//! would wait on each other for ever if a thread's waits did not receive; a lost
//! datagram still ends in the timeout that reports it.

use fabric::sim::{Faults, SimConfig};
use fabric::{Device, NodeId};
use shuffle::testing::{Pattern, Run, run_on, run_sim};
use shuffle::{Buffering, Design, Endpoints, Notify, ShuffleError, Transport};
use std::sync::Arc;
use std::time::Duration;

fn run(design: Design, nodes: usize, threads: usize, tuples: u64) -> Run {
    let mut r = Run::new(design, nodes, threads, tuples);
    r.interleave = true;
    // Small buffers, so that a run is many of them and rings wrap.
    r.config.message_bytes = 512;
    r.config.timeout = Duration::from_secs(15);
    r
}

fn check(r: &Run, sim: SimConfig) {
    if let Err(e) = run_sim(r, sim) {
        panic!(
            "{} (notify {}) {:?} nodes {} threads {} {:?} straggler {:?}: {e}",
            r.design,
            r.config.notify,
            r.pattern,
            r.nodes,
            r.threads,
            r.config.buffering,
            r.straggler
        );
    }
}

/// One buffer per peer: a sender has to wait for the peers' receivers after every
/// buffer it sends to them.
const ONE_BUFFER: Buffering = Buffering::Fixed { per_peer: 1 };
const ADAPTIVE: Buffering = Buffering::Adaptive {
    initial: 1,
    max_per_peer: 8,
    keep_waiting: 1,
};

#[test]
fn every_design_delivers_the_exact_multiset_when_each_thread_sends_and_receives() {
    for design in Design::ALL {
        let mut k = 0;
        for nodes in [2, 3] {
            for threads in [1, 2] {
                for pattern in [Pattern::Repartition, Pattern::Broadcast] {
                    let mut r = run(design, nodes, threads, 1500);
                    r.pattern = pattern;
                    r.seed = 20 + k;
                    r.config.buffering = if k % 2 == 1 {
                        ADAPTIVE
                    } else if design.endpoints == Endpoints::Single && threads > 1 {
                        // The threads sharing the endpoint each hold a buffer per group
                        // while they fill them.
                        Buffering::Fixed {
                            per_peer: threads + 1,
                        }
                    } else {
                        ONE_BUFFER
                    };
                    r.bulk = k % 3 == 0;
                    k += 1;
                    check(&r, SimConfig::default());
                }
            }
        }
    }
}

#[test]
fn every_notification_of_the_write_designs_works_interleaved() {
    for design in Design::ALL
        .into_iter()
        .filter(|d| d.transport == Transport::MqWr)
    {
        for notify in [Notify::Seal, Notify::MessageQueue] {
            let mut r = run(design, 2, 1, 2000);
            r.config.notify = notify;
            r.config.buffering = ONE_BUFFER;
            check(&r, SimConfig::default());
        }
    }
}

#[test]
fn a_straggler_and_a_faulty_network_lose_nothing() {
    for design in Design::ALL {
        let mut r = run(design, 3, 1, 1000);
        r.straggler = Some(Duration::from_millis(1));
        r.config.buffering = ONE_BUFFER;
        check(&r, SimConfig::default());

        let mut r = run(design, 3, 2, 1000);
        r.pattern = Pattern::Broadcast;
        let faults = if design.transport == Transport::SqSr {
            Faults {
                ud_reorder_probability: 0.3,
                ..Faults::default()
            }
        } else {
            Faults {
                tear_probability: 0.3,
                completion_delay: Some((Duration::ZERO, Duration::from_micros(50))),
                ..Faults::default()
            }
        };
        let sim = SimConfig {
            faults,
            seed: 3,
            ..SimConfig::default()
        };
        check(&r, sim);
    }
}

#[test]
fn a_lost_datagram_still_ends_in_a_timeout_with_the_counts() {
    for design in Design::ALL
        .into_iter()
        .filter(|d| d.transport == Transport::SqSr)
    {
        let mut r = run(design, 2, 1, 3000);
        r.config.timeout = Duration::from_millis(300);
        let sim = SimConfig {
            faults: Faults {
                ud_drop_probability: 0.05,
                ..Faults::default()
            },
            seed: 5,
            ..SimConfig::default()
        };
        match run_sim(&r, sim) {
            Err(ShuffleError::Timeout {
                counts: Some((expected, received)),
                ..
            }) => assert!(received < expected, "{design}: {received} of {expected}"),
            other => panic!("{design}: expected a timeout with counts, got {other:?}"),
        }
    }
}

#[test]
fn every_design_runs_interleaved_between_shm_devices() {
    let dir = std::env::temp_dir().join(format!("namdb-interleaved-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (k, design) in Design::ALL.into_iter().enumerate() {
        let devices: Vec<Arc<dyn Device>> = (0..2)
            .map(|i| {
                fabric::shm::ShmDevice::bind_as(
                    dir.join(format!("{k}-{i}.sock")),
                    b"interleaved test",
                    NodeId(i as u32 + 1),
                )
                .unwrap() as Arc<dyn Device>
            })
            .collect();
        let mut r = run(design, 2, 1, 3000);
        r.config.buffering = ONE_BUFFER;
        if let Err(e) = run_on(&r, devices) {
            panic!("{design} on shm: {e}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
