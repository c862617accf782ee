//! A node's own share: every design delivers exactly the multiset sent when a node
//! is among its own destinations, alone (its own partition), in a multicast group
//! with other nodes (a buffer one destination consumes in place while the others
//! READ or receive it), and when it is the only node. The RD designs hand such buffers
//! to their own receiver without a copy; a lost or doubled buffer on that path shows
//! here as a wrong count or checksum.

use fabric::Device;
use fabric::sim::{SimConfig, SimNetwork};
use shuffle::testing::{Checksum, mix, tuple};
use shuffle::{
    Buffering, Design, EndpointConfig, Groups, LocalExchange, Node, Shuffle, receive_all,
};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

const THREADS: usize = 2;
const TUPLES: u64 = 3000;

/// Group 0: the node itself; group 1: every node; group 2: every other node.
fn groups(nodes: usize, me: usize) -> Groups {
    let mut sets = vec![vec![me], (0..nodes).collect()];
    if nodes > 1 {
        sets.push((0..nodes).filter(|&r| r != me).collect());
    }
    Groups::multicast(sets)
}

fn group_of(a: u64, groups: &Groups) -> usize {
    (mix(a) % groups.len() as u64) as usize
}

fn expected(nodes: usize, seed: u64) -> Vec<Checksum> {
    let mut out = vec![Checksum::default(); nodes];
    for rank in 0..nodes {
        let g = groups(nodes, rank);
        for tid in 0..THREADS {
            for i in 0..TUPLES {
                let [a, b] = tuple(seed, rank, tid, i);
                for &d in g.members(group_of(a, &g)) {
                    out[d].add(a, b);
                }
            }
        }
    }
    out
}

fn node_side(node: &Node, design: Design, config: &EndpointConfig, seed: u64) -> Checksum {
    let opened = shuffle::open(node, design, config).unwrap();
    let g = groups(node.nodes(), node.rank());
    let shuffle = Shuffle::new(opened, g.clone(), THREADS).unwrap();
    let received = Mutex::new(Checksum::default());
    std::thread::scope(|s| {
        for tid in 0..THREADS {
            let (shuffle, g) = (&shuffle, &g);
            s.spawn(move || {
                let mut w = shuffle.writer(tid);
                for i in 0..TUPLES {
                    let t = tuple(seed, node.rank(), tid, i);
                    w.push(group_of(t[0], g), &t).unwrap();
                }
                w.finish().unwrap();
            });
        }
        for tid in 0..THREADS {
            let (endpoint, received) = (shuffle.receiver(tid), &received);
            s.spawn(move || {
                let mut mine = Checksum::default();
                receive_all(&*endpoint, |data| {
                    let words = data.payload();
                    assert_eq!(words.len() % 2, 0, "half a tuple");
                    for t in words.chunks_exact(2) {
                        mine.add(t[0].load(Ordering::Relaxed), t[1].load(Ordering::Relaxed));
                    }
                })
                .unwrap();
                received.lock().unwrap().merge(&mine);
            });
        }
    });
    received.into_inner().unwrap()
}

fn check(design: Design, nodes: usize, buffering: Buffering, seed: u64) {
    let net = SimNetwork::new(SimConfig::default());
    let config = EndpointConfig {
        threads: THREADS,
        // Small buffers: many of them, so every buffer is reused many times.
        message_bytes: 512,
        buffering,
        timeout: Duration::from_secs(15),
        ..EndpointConfig::default()
    };
    let exchanges = LocalExchange::group(nodes, Duration::from_secs(30));
    let got: Vec<Checksum> = std::thread::scope(|s| {
        let hs: Vec<_> = exchanges
            .into_iter()
            .map(|x| {
                let device = net.add_node() as Arc<dyn Device>;
                let config = &config;
                s.spawn(move || {
                    let node = Node::join(device, Arc::new(x), 1 << 30).unwrap();
                    node_side(&node, design, config, seed)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(
        got,
        expected(nodes, seed),
        "{design}, {nodes} nodes, {buffering:?}"
    );
}

#[test]
fn every_design_delivers_exactly_what_a_node_sends_itself() {
    for (k, design) in Design::ALL.into_iter().enumerate() {
        for nodes in [1, 2, 3] {
            let buffering = if nodes % 2 == 0 {
                Buffering::Fixed { per_peer: 3 }
            } else {
                Buffering::Adaptive {
                    initial: 1,
                    max_per_peer: 6,
                    keep_waiting: 1,
                }
            };
            check(design, nodes, buffering, 40 + k as u64);
        }
    }
}
