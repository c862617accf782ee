//! A node's own share: every design delivers exactly the multiset sent when a node
//! is among its own destinations, alone (its own partition), in a multicast group
//! with other nodes (a buffer one destination consumes in place while the others
//! READ or receive it), and when it is the only node. The RD designs hand such buffers
//! to their own receiver without a copy; a lost or doubled buffer on that path shows
//! here as a wrong count or checksum. Threads that both send and receive consume their
//! own node's buffers in place (or, told so, send them through the fabric like the
//! rest); the same checks hold for every design either way.

use fabric::Device;
use fabric::sim::{SimConfig, SimNetwork};
use shuffle::testing::{Checksum, mix, tuple};
use shuffle::{
    Buffering, Design, EndpointConfig, Groups, LocalExchange, Node, OwnPartition, Shuffle,
    receive_all, send_and_receive,
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

/// How a node runs its threads.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Threads {
    /// `THREADS` senders and `THREADS` receivers.
    Split,
    /// `THREADS` threads that each send and receive.
    Interleaved(OwnPartition),
}

/// Adds a received payload of (a, b) tuples to `into`.
fn take(into: &mut Checksum, data: &shuffle::Received) {
    let words = data.payload();
    assert_eq!(words.len() % 2, 0, "half a tuple");
    for t in words.chunks_exact(2) {
        into.add(t[0].load(Ordering::Relaxed), t[1].load(Ordering::Relaxed));
    }
}

/// What the node received, and how many buffers it consumed in place.
fn node_side(
    node: &Node,
    design: Design,
    config: &EndpointConfig,
    seed: u64,
    threads: Threads,
) -> (Checksum, u64) {
    let opened = shuffle::open(node, design, config).unwrap();
    let g = groups(node.nodes(), node.rank());
    let mut shuffle = Shuffle::new(opened, g.clone(), THREADS).unwrap();
    if let Threads::Interleaved(own) = threads {
        shuffle = shuffle.with_own_partition(own);
    }
    let received = Mutex::new(Checksum::default());
    let send = |w: &mut shuffle::ShuffleWriter<'_>, tid: usize| {
        for i in 0..TUPLES {
            let t = tuple(seed, node.rank(), tid, i);
            w.push(group_of(t[0], &g), &t)?;
        }
        Ok(())
    };
    std::thread::scope(|s| {
        for tid in 0..THREADS {
            let (shuffle, send, received) = (&shuffle, &send, &received);
            if threads == Threads::Split {
                s.spawn(move || {
                    let mut w = shuffle.writer(tid);
                    send(&mut w, tid).unwrap();
                    w.finish().unwrap();
                });
                let endpoint = shuffle.receiver(tid);
                s.spawn(move || {
                    let mut mine = Checksum::default();
                    receive_all(&*endpoint, |data| take(&mut mine, data)).unwrap();
                    received.lock().unwrap().merge(&mine);
                });
            } else {
                s.spawn(move || {
                    let mut mine = Checksum::default();
                    send_and_receive(shuffle, tid, |w| send(w, tid), |data| take(&mut mine, data))
                        .unwrap();
                    received.lock().unwrap().merge(&mine);
                });
            }
        }
    });
    (received.into_inner().unwrap(), shuffle.consumed_in_place())
}

fn check(design: Design, nodes: usize, buffering: Buffering, seed: u64, threads: Threads) {
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
    let got: Vec<(Checksum, u64)> = std::thread::scope(|s| {
        let hs: Vec<_> = exchanges
            .into_iter()
            .map(|x| {
                let device = net.add_node() as Arc<dyn Device>;
                let config = &config;
                s.spawn(move || {
                    let node = Node::join(device, Arc::new(x), 1 << 30).unwrap();
                    node_side(&node, design, config, seed, threads)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let what = format!("{design}, {nodes} nodes, {buffering:?}, {threads:?}");
    let sums: Vec<Checksum> = got.iter().map(|(c, _)| *c).collect();
    assert_eq!(sums, expected(nodes, seed), "{what}");
    for (rank, &(_, in_place)) in got.iter().enumerate() {
        // The node's share of its own tuples (groups 0 and 1, about 64 KiB) fills its
        // buffers many times over: 512-byte ones, and MTU-sized ones under UD.
        if threads == Threads::Interleaved(OwnPartition::InPlace) {
            assert!(
                in_place >= 10,
                "{what}: node {rank} consumed {in_place} in place"
            );
        } else {
            assert_eq!(in_place, 0, "{what}: node {rank}");
        }
    }
}

fn buffering(nodes: usize) -> Buffering {
    if nodes.is_multiple_of(2) {
        Buffering::Fixed { per_peer: 3 }
    } else {
        Buffering::Adaptive {
            initial: 1,
            max_per_peer: 6,
            keep_waiting: 1,
        }
    }
}

#[test]
fn every_design_delivers_exactly_what_a_node_sends_itself() {
    for (k, design) in Design::ALL.into_iter().enumerate() {
        for nodes in [1, 2, 3] {
            check(
                design,
                nodes,
                buffering(nodes),
                40 + k as u64,
                Threads::Split,
            );
        }
    }
}

#[test]
fn threads_that_also_receive_consume_their_own_nodes_buffers_in_place_or_through_the_fabric() {
    for (k, design) in Design::ALL.into_iter().enumerate() {
        for nodes in [1, 2, 3] {
            for own in [OwnPartition::InPlace, OwnPartition::Fabric] {
                let threads = Threads::Interleaved(own);
                check(design, nodes, buffering(nodes), 60 + k as u64, threads);
            }
        }
    }
}
