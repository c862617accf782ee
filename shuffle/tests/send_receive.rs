//! The SEND/RECV designs (SESQ/SR, MESQ/SR, SEMQ/SR, MEMQ/SR) deliver exactly the
//! multiset that was sent, on every backend, under reordering and stragglers, and a
//! lost datagram ends in a timeout that says so.

use fabric::sim::{Faults, SimConfig};
use fabric::{Device, NodeId};
use shuffle::testing::{Pattern, Run, run_on, run_sim};
use shuffle::{Buffering, Design, Endpoints, ShuffleError, Transport};
use std::sync::Arc;
use std::time::Duration;

const SR: [Design; 4] = [
    Design::new(Endpoints::Single, Transport::SqSr),
    Design::new(Endpoints::Multi, Transport::SqSr),
    Design::new(Endpoints::Single, Transport::MqSr),
    Design::new(Endpoints::Multi, Transport::MqSr),
];

fn is_ud(d: Design) -> bool {
    d.transport == Transport::SqSr
}

/// A run small enough for debug builds: RC messages of 1 KiB so that streams are
/// many messages long.
fn run(design: Design, nodes: usize, threads: usize, tuples: u64) -> Run {
    let mut r = Run::new(design, nodes, threads, tuples);
    r.config.message_bytes = 1024;
    r.config.timeout = Duration::from_secs(10);
    r
}

fn check(r: &Run, sim: SimConfig) {
    if let Err(e) = run_sim(r, sim) {
        panic!(
            "{} {:?} nodes {} threads {} {:?}: {e}",
            r.design, r.pattern, r.nodes, r.threads, r.config.buffering
        );
    }
}

const FIXED: Buffering = Buffering::Fixed { per_peer: 2 };
const ADAPTIVE: Buffering = Buffering::Adaptive {
    initial: 1,
    max_per_peer: 8,
    keep_waiting: 1,
};

#[test]
fn every_sr_design_delivers_the_exact_multiset() {
    for design in SR {
        for nodes in [2, 3] {
            for threads in [1, 3] {
                for pattern in [Pattern::Repartition, Pattern::Broadcast] {
                    for buffering in [FIXED, ADAPTIVE] {
                        let mut r = run(design, nodes, threads, 2000);
                        r.pattern = pattern;
                        r.config.buffering = buffering;
                        check(&r, SimConfig::default());
                    }
                }
            }
        }
    }
}

#[test]
fn stragglers_and_credit_every_one_and_many() {
    for design in SR {
        for (credit_every, buffering) in [
            (1, FIXED),
            (4, ADAPTIVE),
            (2, Buffering::Fixed { per_peer: 1 }),
        ] {
            let mut r = run(design, 3, 2, 1500);
            r.straggler = Some(Duration::from_millis(1));
            r.config.credit_every = credit_every;
            r.config.buffering = buffering;
            check(&r, SimConfig::default());
        }
    }
}

#[test]
fn ud_designs_survive_reordering() {
    for design in SR.into_iter().filter(|d| is_ud(*d)) {
        for (nodes, threads, pattern) in [
            (2, 1, Pattern::Repartition),
            (3, 3, Pattern::Repartition),
            (3, 2, Pattern::Broadcast),
        ] {
            for buffering in [FIXED, ADAPTIVE] {
                let mut r = run(design, nodes, threads, 3000);
                r.pattern = pattern;
                r.config.buffering = buffering;
                let sim = SimConfig {
                    faults: Faults {
                        ud_reorder_probability: 0.3,
                        ..Faults::default()
                    },
                    seed: 11,
                    ..SimConfig::default()
                };
                check(&r, sim);
            }
        }
    }
}

#[test]
fn a_lost_datagram_ends_in_a_timeout_with_the_counts() {
    for design in SR.into_iter().filter(|d| is_ud(*d)) {
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
fn every_sr_design_runs_on_shm() {
    let dir = std::env::temp_dir().join(format!("namdb-sr-shm-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (k, design) in SR.into_iter().enumerate() {
        let nodes = 2;
        let devices: Vec<Arc<dyn Device>> = (0..nodes)
            .map(|i| {
                fabric::shm::ShmDevice::bind_as(
                    dir.join(format!("{k}-{i}.sock")),
                    b"sr test",
                    NodeId(i as u32 + 1),
                )
                .unwrap() as Arc<dyn Device>
            })
            .collect();
        let r = run(design, nodes, 2, 500);
        if let Err(e) = run_on(&r, devices) {
            panic!("{design} on shm: {e}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn every_sr_design_runs_on_tcp() {
    for design in SR {
        let nodes = 2;
        let devices: Vec<Arc<dyn Device>> = (0..nodes)
            .map(|i| {
                fabric::tcp::TcpDevice::bind_as("127.0.0.1:0", b"sr test", NodeId(i as u32 + 1))
                    .unwrap() as Arc<dyn Device>
            })
            .collect();
        let r = run(design, nodes, 2, 500);
        if let Err(e) = run_on(&r, devices) {
            panic!("{design} on tcp: {e}");
        }
    }
}

/// On tcp, a sender gone for good (queue pairs and device closed) right after its
/// stream: the receiver's next credit WRITE to it fails and flushes the receives left
/// for it, in the same poll as the sender's end of stream. Nothing was lost, so the
/// receiver ends cleanly; and the sender was allowed to go only once its end of stream
/// had been delivered (a Depleted put_data waits for its SENDs' completions).
#[test]
fn a_sender_closing_right_after_its_stream_loses_nothing() {
    use shuffle::endpoint::{EndpointConfig, open};
    use shuffle::{LocalExchange, Node, State};
    use std::sync::mpsc::channel;

    let design = Design::new(Endpoints::Single, Transport::MqSr);
    let config = EndpointConfig {
        message_bytes: 1024,
        buffering: Buffering::Fixed { per_peer: 4 },
        credit_every: 1,
        timeout: Duration::from_secs(10),
        ..EndpointConfig::default()
    };
    let device = |id| -> Arc<dyn Device> {
        fabric::tcp::TcpDevice::bind_as("127.0.0.1:0", b"sr test", NodeId(id)).unwrap()
    };
    // Rank 1's device is closed with it: nothing else may hold it.
    let (device_a, device_b) = (device(1), device(2));
    let mut exchanges = LocalExchange::group(2, Duration::from_secs(30));
    let (xb, xa) = (exchanges.pop().unwrap(), exchanges.pop().unwrap());
    let (took_both, b_may_end) = channel::<()>();
    let (b_gone, a_may_release) = channel::<()>();
    let config = &config;
    std::thread::scope(|s| {
        let b = s.spawn(move || -> shuffle::Result<()> {
            let node = Node::join(device_b.clone(), Arc::new(xb), 1 << 30)?;
            let opened = open(&node, design, config)?;
            let (tx, rx) = (&opened.senders[0], &opened.receivers[0]);
            for word in [7u64, 8] {
                let mut buf = tx.acquire()?;
                assert!(buf.push(word));
                tx.put_data(buf, &[0], State::MoreData)?;
            }
            b_may_end.recv().unwrap();
            tx.put_data(tx.acquire()?, &[], State::Depleted)?;
            while let Some(r) = rx.get_data()? {
                rx.release(r)?;
            }
            drop(opened);
            drop(node);
            assert_eq!(
                Arc::strong_count(&device_b),
                1,
                "rank 1's device is still held"
            );
            drop(device_b);
            b_gone.send(()).unwrap();
            Ok(())
        });
        let a = s.spawn(move || -> shuffle::Result<()> {
            let node = Node::join(device_a, Arc::new(xa), 1 << 30)?;
            let opened = open(&node, design, config)?;
            let (tx, rx) = (&opened.senders[0], &opened.receivers[0]);
            tx.put_data(tx.acquire()?, &[], State::Depleted)?;
            let first = rx.get_data()?.expect("a message");
            let second = rx.get_data()?.expect("a message");
            took_both.send(()).unwrap();
            a_may_release.recv().unwrap();
            // Credit WRITEs to the departed sender: they fail, and flush our receives.
            rx.release(first)?;
            rx.release(second)?;
            if let Some(r) = rx.get_data()? {
                panic!("an unexpected message from rank {}", r.source);
            }
            Ok(())
        });
        b.join().unwrap().expect("rank 1");
        a.join().unwrap().expect("rank 0");
    });
}
