//! Loom models of the oracle over the sim backend: tiny vectors, two slots.
//!
//! Run with `RUSTFLAGS="--cfg fabric_loom --cfg timestamp_loom"
//! CARGO_TARGET_DIR=target/loom cargo test -p timestamp --release --test loom_oracle`.
//!
//! - `prefix_and_wrap`: two holders decide their timestamps through more than a round
//!   of an 8-bit vector while reading timestamps; every read timestamp covers only
//!   timestamps whose holder had decided them, and none goes backwards.
//! - `renewal_races_fence`: a late holder renews while another node fences it; exactly
//!   one wins, and the stalled timestamp ends up decided exactly once.
//! - `late_mark_races_a_gated_fence`: a holder whose lease check passed (then it was
//!   descheduled) decides its timestamp while a handle of the same process fences its
//!   slot, the two sharing lease gates; the timestamp is decided exactly once (without
//!   the gates, a mark landing after the fencer's skip toggles it back).
//! - `free_skip_races_claim`: a holder's read timestamp skips two free slots (horizon
//!   raises and CAS on the vector word) while a new node claims one of them and
//!   decides its first timestamp; no timestamp is decided twice and the claimer's is
//!   never decided by the skipper.
//! - `a_fence_left_on_the_heartbeat_does_not_end_a_new_claim`: a new node claims a
//!   slot whose last holder was fenced (the fence's mark still on its heartbeat) while
//!   a live holder's tick checks that slot; the check never fences the new claim, or
//!   the new holder would go on deciding its timestamps beside the slot's next claimer.
#![cfg(all(fabric_loom, timestamp_loom))]

use fabric::sim::SimConfig;
use loom::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use timestamp::testkit::SimOracle;
use timestamp::{
    Clock, Layout, LeaseGates, ManualClock, OracleConfig, OracleError, Outcome, SlotHandle,
};

const TICK: Duration = Duration::from_millis(1);
const LEASE: Duration = Duration::from_millis(4);

fn config() -> OracleConfig {
    OracleConfig {
        tick_interval: TICK,
        lease_timeout: LEASE,
        reserve: 64,
        window_bytes: 8,
    }
}

fn setup(bits: u64) -> (Arc<SimOracle>, Arc<ManualClock>, SlotHandle, SlotHandle) {
    let o = oracle(bits, 2);
    let clock = ManualClock::new();
    let a = o.client(config(), clock.clone() as Arc<dyn Clock>).unwrap();
    let b = o.client(config(), clock.clone() as Arc<dyn Clock>).unwrap();
    (o, clock, a, b)
}

/// Takes `count` timestamps one after another, deciding each (after raising its
/// intent flag) and reading a timestamp after each decision.
fn run_holder(h: SlotHandle, count: usize, intent: Arc<Vec<AtomicBool>>) -> SlotHandle {
    let mut last = 0;
    for _ in 0..count {
        let t = loop {
            match h.acquire_commit_ts(1) {
                Ok(t) => break t,
                Err(OracleError::Stalled { .. }) => loom::thread::yield_now(),
                Err(e) => panic!("acquire: {e}"),
            }
        };
        intent[t as usize].store(true, Ordering::SeqCst);
        h.mark(t, Outcome::Committed).unwrap();
        let rid = h.read_timestamp().unwrap();
        assert!(rid >= last, "read timestamp went back: {last} → {rid}");
        for ts in 1..=rid {
            assert!(
                intent[ts as usize].load(Ordering::SeqCst),
                "read timestamp {rid} covers {ts}, never decided"
            );
        }
        last = rid;
    }
    h
}

/// Runs `f` as a loom model, with at most `preemptions` preemptions per execution, and
/// returns how many interleavings loom explored.
fn explore(preemptions: usize, f: impl Fn() + Sync + Send + 'static) -> usize {
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = Some(preemptions);
    // Registration and the sim's locks make one execution long, not wide.
    builder.max_branches = 200_000;
    let explored = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = explored.clone();
    builder.check(move || {
        counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        f();
    });
    explored.load(std::sync::atomic::Ordering::Relaxed)
}

/// An oracle of `bits` bits and `slots` slots on a sim memory server.
fn oracle(bits: u64, slots: u32) -> Arc<SimOracle> {
    Arc::new(SimOracle::new(SimConfig::default(), Layout::new(bits, slots).unwrap()).unwrap())
}

#[test]
fn prefix_and_wrap() {
    let n = explore(2, || {
        // V = 8, S = 2: slot 0 takes 2, 4, 6, 8 (8 reuses the position of 0), slot 1
        // takes 1, 3, 5, 7; the V/2 margin makes each wait for the other.
        let (o, _clock, a, b) = setup(8);
        let intent: Arc<Vec<AtomicBool>> =
            Arc::new((0..16).map(|_| AtomicBool::new(false)).collect());
        let ia = intent.clone();
        let ib = intent.clone();
        let ta = loom::thread::spawn(move || run_holder(a, 4, ia));
        let tb = loom::thread::spawn(move || run_holder(b, 4, ib));
        let a = ta.join().unwrap();
        let _b = tb.join().unwrap();
        assert_eq!(a.read_timestamp().unwrap(), 8);
        assert_eq!(o.true_prefix(1).unwrap(), 9);
    });
    eprintln!("loom explored {n} interleavings of two holders through a wrap");
    assert!(n > 100, "loom explored only {n} interleavings");
}

/// Slot 1 (`b`) takes 1 and goes quiet; slot 0 (`a`) decides 2, so 1 stalls the
/// prefix; `a`'s ticks see the stall, start watching slot 1, and wait out its lease on
/// `clock`: `a`'s next tick fences slot 1. Returns (1, 2).
fn stall_slot_1(a: &SlotHandle, b: &SlotHandle, clock: &ManualClock) -> (u64, u64) {
    let stalled = b.next_commit_ts().unwrap();
    assert_eq!(stalled, 1);
    let t = a.next_commit_ts().unwrap();
    a.mark(t, Outcome::Committed).unwrap();
    for _ in 0..3 {
        clock.advance(TICK);
        assert_eq!(a.tick().unwrap().fenced, None);
    }
    clock.advance(LEASE);
    (stalled, t)
}

#[test]
fn renewal_races_fence() {
    let n = explore(3, || {
        let (o, clock, a, b) = setup(16);
        let (stalled, t) = stall_slot_1(&a, &b, &clock);
        let fencer = loom::thread::spawn(move || {
            let r = a.tick().unwrap();
            (a, r.fenced)
        });
        let late = loom::thread::spawn(move || {
            let renewed = b.renew();
            if renewed.is_ok() {
                b.mark(stalled, Outcome::Committed).unwrap();
            }
            (b, renewed)
        });
        let (a, fenced) = fencer.join().unwrap();
        let (_b, renewed) = late.join().unwrap();
        // Decided exactly once: a second toggle would read undecided (and carry).
        assert!(o.is_decided(stalled).unwrap());
        assert!(o.is_decided(t).unwrap());
        assert!(!o.is_decided(3).unwrap());
        let rid = a.read_timestamp().unwrap();
        match renewed {
            Ok(()) => {
                assert_eq!(fenced, None, "fenced a holder whose renewal succeeded");
                // Slot 1 is held: its next timestamp, 3, waits for its holder.
                assert_eq!(rid, 2);
            }
            Err(OracleError::Fenced { slot: 1 }) => {
                assert_eq!(fenced, Some(1));
                // A fenced slot is skipped for by the next read timestamp.
                assert!(rid >= 3 && o.is_decided(3).unwrap(), "read {rid}");
            }
            Err(e) => panic!("renew: {e}"),
        }
    });
    eprintln!("loom explored {n} interleavings of a renewal racing a fence");
    assert!(n > 10, "loom explored only {n} interleavings");
}

#[test]
fn late_mark_races_a_gated_fence() {
    let n = explore(3, || {
        let o = oracle(16, 2);
        let clock = ManualClock::new();
        let a = o.client(config(), clock.clone() as Arc<dyn Clock>).unwrap();
        // The late holder's clock stands still: its lease checks pass without a
        // renewal, as one made right before its thread was descheduled would.
        let b = o
            .client(config(), ManualClock::new() as Arc<dyn Clock>)
            .unwrap();
        let gates = LeaseGates::new();
        a.share_gates(gates.clone());
        b.share_gates(gates);
        let (stalled, t) = stall_slot_1(&a, &b, &clock);
        let trace = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
        let trace_a = trace.clone();
        let fencer = {
            let clock = clock.clone();
            loom::thread::spawn(move || {
                // A fence that finds the holder inside its gate is left to a later
                // tick.
                for _ in 0..2 {
                    let r = a.tick().unwrap();
                    trace_a.lock().unwrap().push(format!("a: tick {r:?}"));
                    if let Some(slot) = r.fenced {
                        return (a, Some(slot));
                    }
                    clock.advance(TICK);
                    loom::thread::yield_now();
                }
                (a, None)
            })
        };
        let trace_b = trace.clone();
        let late = loom::thread::spawn(move || {
            trace_b.lock().unwrap().push("b: mark".into());
            let marked = b.mark(stalled, Outcome::Committed);
            trace_b
                .lock()
                .unwrap()
                .push(format!("b: marked {marked:?}"));
            (b, marked)
        });
        let (a, fenced) = fencer.join().unwrap();
        let (_b, marked) = late.join().unwrap();
        match marked {
            Ok(()) => {}
            Err(OracleError::Fenced { slot: 1 }) => {
                assert_eq!(fenced, Some(1), "refused a mark, yet no fence went through")
            }
            Err(e) => panic!("mark: {e}"),
        }
        // Decided exactly once: a second toggle would read undecided (and carry).
        assert!(
            o.is_decided(stalled).unwrap(),
            "{:?} marked: {marked:?}, fenced {fenced:?}, t {t} decided {:?}, a {:?}, b {:?}",
            trace.lock().unwrap(),
            o.is_decided(t),
            a.stats(),
            _b.stats()
        );
        assert!(o.is_decided(t).unwrap());
        assert!(a.read_timestamp().unwrap() >= t);
    });
    eprintln!("loom explored {n} interleavings of a late mark racing a gated fence");
    assert!(n > 10, "loom explored only {n} interleavings");
}

#[test]
fn free_skip_races_claim() {
    let n = explore(2, || {
        // V = 16, S = 3: slot 0 is held and decides 3, so the free slots 1 and 2 (1
        // and 2) hold the prefix back; the holder's next read skips them.
        let o = oracle(16, 3);
        let clock = ManualClock::new();
        let a = o.client(config(), clock.clone() as Arc<dyn Clock>).unwrap();
        assert_eq!(a.slot(), 0);
        let t = a.next_commit_ts().unwrap();
        assert_eq!(t, 3);
        a.mark(t, Outcome::Committed).unwrap();
        let o2 = o.clone();
        let claimer = loom::thread::spawn(move || {
            let c = o2.client(config(), clock as Arc<dyn Clock>).unwrap();
            assert_eq!(c.slot(), 1);
            // Either the claim came first (the slot starts at 1, below the skipper's
            // reach) or after the skipper raised the horizon (far ahead: wrap-blocked
            // on a vector this small, and nothing below it is the claimer's).
            match c.next_commit_ts() {
                Ok(mine) => {
                    assert!(!o2.is_decided(mine).unwrap(), "{mine} handed out decided");
                    c.mark(mine, Outcome::Committed).unwrap();
                    Some(mine)
                }
                Err(OracleError::WrapBlocked { ts, .. }) => {
                    assert!(ts >= 16, "blocked at {ts}");
                    None
                }
                Err(e) => panic!("next_commit_ts: {e}"),
            }
        });
        let rid = a.read_timestamp().unwrap();
        let mine = claimer.join().unwrap();
        // Decided exactly once: a skip and a mark of the same timestamp would toggle
        // its bit back to undecided.
        if let Some(m) = mine {
            assert!(o.is_decided(m).unwrap(), "{m} decided twice");
        }
        assert!(o.is_decided(3).unwrap());
        assert!(rid <= o.true_prefix(1).unwrap());
        // Once the claimer's timestamp is decided, reads get past everything up to 3.
        let after = a.read_timestamp().unwrap();
        if mine.is_some() {
            assert!(after >= 3 || !o.is_decided(2).unwrap(), "read {after}");
        }
    });
    eprintln!("loom explored {n} interleavings of a free-slot skip racing a claim");
    assert!(n > 10, "loom explored only {n} interleavings");
}

#[test]
fn a_fence_left_on_the_heartbeat_does_not_end_a_new_claim() {
    let n = explore(2, || {
        // Slot 1's holder `b` stalls the prefix and is fenced by `a`: slot 1 is then
        // fenced, with the fence's mark on its heartbeat.
        let (o, clock, a, b) = setup(16);
        stall_slot_1(&a, &b, &clock);
        assert_eq!(a.tick().unwrap().fenced, Some(1));
        drop(b);
        // `a` is asked to check slot 1 (as a reader blocked on its lock would) while a
        // new node claims it.
        a.suspect(1);
        clock.advance(TICK);
        let o2 = o.clone();
        let clock2 = clock.clone();
        let claimer = loom::thread::spawn(move || {
            let c = o2.client(config(), clock2 as Arc<dyn Clock>).unwrap();
            assert_eq!(c.slot(), 1);
            c
        });
        let report = a.tick().unwrap();
        let c = claimer.join().unwrap();
        assert_eq!(report.fenced, None, "the new claim was fenced at once");
        assert!(c.is_active());
        assert_eq!(
            o.lease(1).unwrap(),
            c.held_lease(),
            "slot 1 changed hands under its new holder"
        );
        c.renew().unwrap();
    });
    eprintln!("loom explored {n} interleavings of a claim racing a check of its slot");
    assert!(n > 10, "loom explored only {n} interleavings");
}
