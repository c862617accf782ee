//! Loom model of a lock word in a sim region, taken and released with remote CAS by
//! two compute nodes that increment a counter it protects.
//!
//! Run with `RUSTFLAGS="--cfg fabric_loom" cargo test -p fabric --test loom_lock --release`.
//! The correct protocol passes under every interleaving loom explores; the broken one
//! (the unlock CAS posted before the WRITE of the counter, in the same doorbell) is
//! caught as a lost update.
#![cfg(fabric_loom)]

use fabric::sim::{SimConfig, SimNetwork};
use fabric::{
    Access, Completion, CompletionQueue, Device, QueuePair, RemoteRegion, SendWr, Src, WcStatus,
};
use std::sync::Arc;

const LOCK: u64 = 0;
const COUNTER: u64 = 8;

fn wait_one(cq: &Arc<dyn CompletionQueue>) -> Completion {
    let mut out = [Completion::default(); 1];
    loop {
        if cq.poll(&mut out).expect("poll") == 1 {
            assert_eq!(out[0].status, WcStatus::Success, "{:?}", out[0]);
            return out[0];
        }
        loom::thread::yield_now();
    }
}

/// One critical section: CAS the lock 0 → 1 until it is ours, READ the counter, then
/// WRITE counter + 1 and CAS the lock 1 → 0 in one doorbell.
fn increment(
    client: &dyn Device,
    qp: &Arc<dyn QueuePair>,
    cq: &Arc<dyn CompletionQueue>,
    remote: RemoteRegion,
    unlock_first: bool,
) {
    let scratch = client.register(16, Access::LOCAL).expect("register");
    loop {
        qp.post_send(&[SendWr::cas(1, scratch.buf(0, 8), remote.at(LOCK), 0, 1)])
            .expect("post");
        wait_one(cq);
        if scratch.load_u64(0).expect("load") == 0 {
            break;
        }
        loom::thread::yield_now();
    }
    qp.post_send(&[SendWr::read(2, scratch.buf(8, 8), remote.at(COUNTER))])
        .expect("post");
    wait_one(cq);
    let next = (scratch.load_u64(8).expect("load") + 1).to_le_bytes();
    let write = SendWr::write(3, Src::Inline(&next), remote.at(COUNTER)).unsignaled();
    let unlock = SendWr::cas(4, scratch.buf(0, 8), remote.at(LOCK), 1, 0);
    let batch = if unlock_first {
        [unlock.unsignaled(), write.signaled(true)]
    } else {
        [write, unlock]
    };
    qp.post_send(&batch).expect("post");
    wait_one(cq);
}

/// Runs the model and returns how many interleavings loom explored.
fn model(unlock_first: bool) -> usize {
    let explored = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = explored.clone();
    let mut builder = loom::model::Builder::new();
    // Exhaustive: no preemption bound. The sim touches few shared objects per request,
    // so the full search stays small.
    builder.preemption_bound = None;
    builder.check(move || {
        counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let net = SimNetwork::new(SimConfig::default());
        let server = net.add_node();
        let region = server.register(16, Access::ALL).expect("register");
        let remote = region.remote();
        let workers: Vec<_> = (0..2)
            .map(|_| {
                let client: Arc<dyn Device> = net.add_node();
                let cq = client.create_cq(16).expect("cq");
                let scq = server.create_cq(16).expect("cq");
                let (server_qp, qp) =
                    fabric::connect_rc((server.as_ref(), &scq), (client.as_ref(), &cq))
                        .expect("connect");
                loom::thread::spawn(move || {
                    increment(client.as_ref(), &qp, &cq, remote, unlock_first);
                    drop(server_qp);
                })
            })
            .collect();
        for w in workers {
            w.join().expect("worker");
        }
        assert_eq!(
            region.load_u64(COUNTER).unwrap(),
            2,
            "an increment was lost"
        );
        assert_eq!(region.load_u64(LOCK).unwrap(), 0, "the lock was left taken");
    });
    explored.load(std::sync::atomic::Ordering::Relaxed)
}

#[test]
fn cas_lock_protects_the_counter() {
    let explored = model(false);
    eprintln!("loom explored {explored} interleavings of the CAS lock");
    // Two workers contending through the sim's queue pairs, completion queues and
    // region tables leave far more than a handful of schedules.
    assert!(
        explored > 100,
        "loom explored only {explored} interleavings"
    );
}

#[test]
fn unlocking_before_the_write_is_caught() {
    let caught = std::panic::catch_unwind(|| model(true));
    assert!(caught.is_err(), "loom must find the lost update");
}
