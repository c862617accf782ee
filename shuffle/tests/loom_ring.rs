//! A loom model of the one-sided designs' remote ring (FreeArr/ValidArr): the real
//! `Producer`/`Consumer` protocol of `shuffle::ring` over loom atomics, with the
//! producer's RDMA WRITE of an entry modelled as the fabric performs it (the words in
//! address order, the last with Release) and the consumer's write-back of its consumed
//! count as a Release store the producer reads with Acquire.
//!
//! Run with
//! `RUSTFLAGS="--cfg shuffle_loom" CARGO_TARGET_DIR=target/loom cargo test -p shuffle --release --test loom_ring`.
//! `StampApart` is the two-WRITE entry of devices that do not place a WRITE in address
//! order. The `should_panic` models are wrong rings, to show the model can fail: an entry
//! whose stamp (the ring's published index) lands before its value, and a WRITE with no
//! ordering at all.

#![cfg(shuffle_loom)]

use loom::sync::Arc;
use loom::sync::atomic::AtomicU64;
use shuffle::ring::{Consumer, ENTRY_WORDS, Producer, Words};
use std::sync::atomic::Ordering;

struct Mem(Vec<AtomicU64>);

impl Words for Mem {
    fn load(&self, at: usize, order: Ordering) -> u64 {
        self.0[at].load(order)
    }
}

/// How the producer's WRITE of an entry lands in the consumer's memory.
#[derive(Clone, Copy, PartialEq)]
enum Landing {
    /// As the fabric does it: value, then the stamp with Release.
    InOrder,
    /// Wrong: the stamp (the published index) before the value.
    StampFirst,
    /// Wrong: both words Relaxed.
    Unordered,
    /// As on a device that does not place a WRITE in address order: a first WRITE
    /// lands the value and the auxiliary half of word 1 in any order (here the
    /// reverse), a second one the stamp half.
    StampApart,
}

fn model(cap: u64, entries: u64, landing: Landing) {
    loom::model(move || {
        let ring = Arc::new(Mem((0..cap as usize * ENTRY_WORDS)
            .map(|_| AtomicU64::new(0))
            .collect()));
        let consumed = Arc::new(AtomicU64::new(0));
        let producer = {
            let ring = ring.clone();
            let consumed = consumed.clone();
            loom::thread::spawn(move || {
                let mut p = Producer::new(cap);
                for n in 0..entries {
                    while !p.has_room(consumed.load(Ordering::Acquire)) {
                        loom::thread::yield_now();
                    }
                    let (at, [value, stamp]) = p.push(100 + n, n as u32);
                    match landing {
                        Landing::InOrder => {
                            ring.0[at].store(value, Ordering::Relaxed);
                            ring.0[at + 1].store(stamp, Ordering::Release);
                        }
                        Landing::StampFirst => {
                            ring.0[at + 1].store(stamp, Ordering::Release);
                            ring.0[at].store(value, Ordering::Relaxed);
                        }
                        Landing::StampApart => {
                            let stamp_half = 0xffff_ffff_0000_0000;
                            let old = ring.0[at + 1].load(Ordering::Relaxed);
                            let aux_only = (old & stamp_half) | (stamp & !stamp_half);
                            ring.0[at + 1].store(aux_only, Ordering::Relaxed);
                            ring.0[at].store(value, Ordering::Relaxed);
                            ring.0[at + 1].store(stamp, Ordering::Release);
                        }
                        Landing::Unordered => {
                            ring.0[at].store(value, Ordering::Relaxed);
                            ring.0[at + 1].store(stamp, Ordering::Relaxed);
                        }
                    }
                }
            })
        };
        let mut c = Consumer::new(cap);
        let mut got = 0;
        while got < entries {
            match c.pop(&*ring) {
                Some((value, aux)) => {
                    assert_eq!(aux as u64, got, "entries out of order");
                    assert_eq!(value, 100 + got, "entry {got} read before it landed");
                    got += 1;
                }
                None => loom::thread::yield_now(),
            }
            if let Some(n) = c.report() {
                consumed.store(n, Ordering::Release);
            }
        }
        producer.join().unwrap();
        assert_eq!(c.pop(&*ring), None, "an entry beyond the last");
    });
}

#[test]
fn entries_arrive_whole_in_order_and_are_never_overrun() {
    model(2, 3, Landing::InOrder);
}

#[test]
fn a_one_slot_ring_alternates() {
    model(1, 3, Landing::InOrder);
}

#[test]
fn a_stamp_written_apart_after_the_rest_suffices() {
    model(2, 3, Landing::StampApart);
}

#[test]
#[should_panic]
fn an_index_published_before_its_entry_is_caught() {
    model(2, 2, Landing::StampFirst);
}

#[test]
#[should_panic]
fn an_unordered_write_is_caught() {
    model(2, 2, Landing::Unordered);
}
