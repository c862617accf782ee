//! Runs of tuples handed over in bulk (`ShuffleWriter::push_all` for a broadcast,
//! `push_partitioned` for a repartition) arrive exactly as sent, on every design,
//! across buffer boundaries; a bad group is a clear error.

use fabric::Device;
use fabric::sim::{SimConfig, SimNetwork};
use shuffle::testing::{Pattern, Run, run_sim};
use shuffle::{
    Design, EndpointConfig, Groups, LocalExchange, Node, Shuffle, ShuffleError, open, receive_all,
};
use std::sync::Arc;
use std::time::Duration;

fn check(r: &Run) {
    if let Err(e) = run_sim(r, SimConfig::default()) {
        panic!(
            "{} {:?} {} nodes × {} threads, {} B messages: {e}",
            r.design, r.pattern, r.nodes, r.threads, r.config.message_bytes
        );
    }
}

#[test]
fn every_design_delivers_bulk_runs_exactly() {
    for design in Design::ALL {
        for (nodes, threads) in [(2, 1), (3, 2)] {
            for pattern in [Pattern::Repartition, Pattern::Broadcast] {
                // A bulk call spans several 1 KiB buffers, or part of an 8 KiB one.
                for message_bytes in [1024, 8192] {
                    let mut r = Run::new(design, nodes, threads, 3001);
                    r.config.message_bytes = message_bytes;
                    r.config.timeout = Duration::from_secs(10);
                    r.pattern = pattern;
                    r.bulk = true;
                    check(&r);
                }
            }
        }
    }
}

#[test]
fn a_group_out_of_range_is_an_error_and_the_stream_still_ends() {
    // One group, and two (both to the node itself), which take the two-cursor loop;
    // 1 KiB buffers, so the tuples before the bad one fill several.
    for groups in [
        Groups::repartition(1),
        Groups::multicast(vec![vec![0], vec![0]]),
    ] {
        a_group_out_of_range_is_an_error_with(groups);
    }
}

fn a_group_out_of_range_is_an_error_with(groups: Groups) {
    let net = SimNetwork::new(SimConfig::default());
    let device = net.add_node() as Arc<dyn Device>;
    let exchange = LocalExchange::group(1, Duration::from_secs(10)).remove(0);
    let node = Node::join(device, Arc::new(exchange), 1 << 24).unwrap();
    let config = EndpointConfig {
        message_bytes: 1024,
        ..EndpointConfig::default()
    };
    let opened = open(&node, Design::ALL[3], &config).unwrap();
    let group_count = groups.len();
    let shuffle = Shuffle::new(opened, groups, 1).unwrap();
    let tuples: Vec<[u64; 2]> = (0..300).map(|i| [i, i]).collect();
    let bad = |t: &[u64; 2]| {
        if t[0] == 280 {
            7
        } else {
            t[0] as usize % group_count
        }
    };
    // A receiver drains the node's endpoint meanwhile: the buffers' credit comes back.
    let mut got: Vec<u64> = std::thread::scope(|s| {
        let receiver = s.spawn(|| {
            let mut got = Vec::new();
            receive_all(&*shuffle.receiver(0), |data| {
                got.extend(data.to_words().iter().step_by(2))
            })
            .map(|()| got)
        });
        let mut w = shuffle.writer(0);
        match w.push_partitioned(&tuples, bad) {
            Err(ShuffleError::Invalid(msg)) => assert!(msg.contains("group 7"), "{msg}"),
            other => panic!("expected an invalid-group error, got {other:?}"),
        }
        // Every way of naming a group checks it.
        let invalid = |r: shuffle::Result<()>| matches!(r, Err(ShuffleError::Invalid(_)));
        assert!(invalid(w.push(group_count, &[1, 2])));
        assert!(invalid(w.push_all(3, &tuples)));
        assert!(invalid(w.flush(2)));
        assert!(w.buffer(9).is_err());
        w.finish().unwrap();
        receiver.join().unwrap().unwrap()
    });
    got.sort_unstable();
    assert_eq!(
        got,
        (0..280).collect::<Vec<u64>>(),
        "the tuples before the bad one went out, each once, no others"
    );
}
