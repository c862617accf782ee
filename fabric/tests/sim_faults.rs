//! Sim-only behaviour: the fault injectors and the cost model do what they claim.
#![cfg(not(fabric_loom))]

use fabric::conformance::{Fixture, drain, exec, wait};
use fabric::sim::{CostModel, Faults, SimConfig, SimNetwork};
use fabric::{Access, Device, QpConfig, RecvWr, SendWr, Src, UdDest, WcStatus};
use std::sync::Arc;
use std::time::{Duration, Instant};

struct Sim(SimConfig);

impl fabric::conformance::Backend for Sim {
    fn devices(&self, nodes: usize) -> Vec<Arc<dyn Device>> {
        let net = SimNetwork::new(self.0.clone());
        (0..nodes)
            .map(|_| net.add_node() as Arc<dyn Device>)
            .collect()
    }
}

fn ud_burst(config: SimConfig, n: u64) -> Vec<u32> {
    let net = SimNetwork::new(config);
    let (a, b) = (net.add_node(), net.add_node());
    let (a_cq, b_cq) = (a.create_cq(4096).unwrap(), b.create_cq(4096).unwrap());
    let a_qp = a.create_qp(&QpConfig::ud(&a_cq)).unwrap();
    let b_qp = b.create_qp(&QpConfig::ud(&b_cq)).unwrap();
    let inbox = b.register(n * 64, Access::LOCAL_WRITE).unwrap();
    let recvs: Vec<RecvWr> = (0..n)
        .map(|i| RecvWr {
            wr_id: i,
            buf: inbox.buf(i * 64, 64),
        })
        .collect();
    b_qp.post_recv(&recvs).unwrap();
    let dest = UdDest {
        endpoint: b_qp.endpoint(),
        qkey: QpConfig::DEFAULT_QKEY,
    };
    for i in 0..n {
        let wc = exec(
            &a_qp,
            &a_cq,
            SendWr::send_imm(i, Src::Inline(b"d"), i as u32).to(dest),
        );
        assert_eq!(wc.status, WcStatus::Success);
    }
    drain(&b_cq, Duration::from_millis(50))
        .iter()
        .map(|wc| wc.imm.unwrap())
        .collect()
}

#[test]
fn ud_reordering_is_injected() {
    let got = ud_burst(
        SimConfig {
            faults: Faults {
                ud_reorder_probability: 0.3,
                ..Faults::default()
            },
            seed: 3,
            ..SimConfig::default()
        },
        300,
    );
    assert_eq!(got.len(), 300, "reordering loses nothing");
    assert!(
        got.windows(2).any(|w| w[0] > w[1]),
        "no datagram was reordered"
    );
    let mut sorted = got.clone();
    sorted.sort_unstable();
    assert_eq!(sorted, (0..300).collect::<Vec<_>>());
}

#[test]
fn ud_drops_are_injected() {
    let got = ud_burst(
        SimConfig {
            faults: Faults {
                ud_drop_probability: 0.25,
                ..Faults::default()
            },
            seed: 5,
            ..SimConfig::default()
        },
        400,
    );
    assert!(
        (200..390).contains(&got.len()),
        "{} of 400 arrived with a 25% drop rate",
        got.len()
    );
}

#[test]
fn without_faults_ud_keeps_order() {
    let got = ud_burst(SimConfig::default(), 100);
    assert_eq!(got, (0..100).collect::<Vec<_>>());
}

#[test]
fn cost_model_delays_completions_by_latency_and_bandwidth() {
    let model = CostModel::FDR4X;
    let f = Fixture::new(&Sim(SimConfig {
        cost: Some(model),
        ..SimConfig::default()
    }));
    let len = 64 * 1024u32;
    let start = Instant::now();
    f.client_qp
        .post_send(&[SendWr::read(
            1,
            f.local.buf(0, len),
            f.remote.remote_addr(0),
        )])
        .unwrap();
    let wc = wait(&f.client_cq, 1)[0];
    let elapsed = start.elapsed();
    assert_eq!(wc.status, WcStatus::Success);
    let modelled = model.read_latency + model.serialisation(len as u64);
    assert!(
        elapsed >= modelled,
        "a 64 KiB READ completed after {elapsed:?}, before its modelled {modelled:?}"
    );
}

#[test]
fn injected_delay_holds_completions_back_in_order() {
    let f = Fixture::new(&Sim(SimConfig {
        faults: Faults {
            completion_delay: Some((Duration::from_millis(5), Duration::from_millis(10))),
            ..Faults::default()
        },
        ..SimConfig::default()
    }));
    let wrs: Vec<SendWr> = (0..8)
        .map(|i| SendWr::read(i, f.local.buf(0, 8), f.remote.remote_addr(0)))
        .collect();
    let start = Instant::now();
    f.client_qp.post_send(&wrs).unwrap();
    let mut out = [fabric::Completion::default(); 8];
    assert_eq!(
        f.client_cq.poll(&mut out).unwrap(),
        0,
        "nothing is visible at once"
    );
    let got = wait(&f.client_cq, 8);
    assert!(start.elapsed() >= Duration::from_millis(5));
    assert_eq!(
        got.iter().map(|c| c.wr_id).collect::<Vec<_>>(),
        (0..8).collect::<Vec<_>>()
    );
}

#[test]
fn same_seed_same_faults() {
    let config = SimConfig {
        faults: Faults {
            ud_reorder_probability: 0.3,
            ud_drop_probability: 0.1,
            ..Faults::default()
        },
        seed: 42,
        ..SimConfig::default()
    };
    assert_eq!(ud_burst(config.clone(), 200), ud_burst(config, 200));
}

#[test]
fn completion_queue_overrun_is_reported() {
    let net = SimNetwork::new(SimConfig::default());
    let (a, b) = (net.add_node(), net.add_node());
    let small = a.create_cq(4).unwrap();
    let bcq = b.create_cq(4).unwrap();
    let (qa, _qb) = fabric::connect_rc((a.as_ref(), &small), (b.as_ref(), &bcq)).unwrap();
    let r = b.register(64, Access::ALL).unwrap();
    let l = a.register(64, Access::ALL).unwrap();
    let wrs: Vec<SendWr> = (0..5)
        .map(|i| SendWr::read(i, l.buf(0, 8), r.remote_addr(0)))
        .collect();
    qa.post_send(&wrs).unwrap();
    let mut out = [fabric::Completion::default(); 8];
    assert!(matches!(
        small.poll(&mut out),
        Err(fabric::FabricError::CqOverrun { capacity: 4 })
    ));
}

/// Under `write_last_word_first`, a WRITE's last word is visible while its first is
/// still old (registered and inline sources alike), the devices say they do not order
/// placement, and the whole WRITE has landed by its completion.
#[test]
fn writes_can_place_their_last_word_first() {
    let pause = Duration::from_millis(200);
    let f = Fixture::new(&Sim(SimConfig {
        faults: Faults {
            write_last_word_first: true,
            tear_pause: pause,
            ..Faults::default()
        },
        ..SimConfig::default()
    }));
    assert!(!f.server.orders_write_placement());
    const WORDS: u64 = 4;
    for (round, inline) in [(1u64, false), (2, true)] {
        let block: Vec<u8> = (0..WORDS).flat_map(|_| round.to_le_bytes()).collect();
        f.local.write(0, &block).unwrap();
        let at = f.remote.remote_addr(0);
        let wr = if inline {
            SendWr::write(round, Src::Inline(&block), at)
        } else {
            SendWr::write(round, f.local.buf(0, WORDS as u32 * 8), at)
        };
        let first_when_last_landed = std::thread::scope(|s| {
            let watcher = s.spawn(|| {
                let deadline = Instant::now() + Duration::from_secs(10);
                while f.remote.load_u64((WORDS - 1) * 8).unwrap() != round {
                    assert!(Instant::now() < deadline, "the last word never landed");
                    std::hint::spin_loop();
                }
                f.remote.load_u64(0).unwrap()
            });
            assert_eq!(f.run(wr).status, WcStatus::Success);
            watcher.join().unwrap()
        });
        assert_eq!(
            first_when_last_landed,
            round - 1,
            "inline {inline}: the first word had landed with the last ({pause:?} apart)"
        );
        for w in 0..WORDS {
            assert_eq!(f.remote.load_u64(w * 8).unwrap(), round, "word {w}");
        }
    }
}
