//! The oracle protocol on the sim backend, one scenario per test, with a manual clock
//! so that leases and tick schedules are deterministic.
#![cfg(not(timestamp_loom))]

use fabric::sim::SimConfig;
use std::sync::Arc;
use std::time::Duration;
use timestamp::testkit::SimOracle;
use timestamp::{
    Clock, Layout, LeaseGates, ManualClock, OracleConfig, OracleError, Outcome, SlotHandle,
    SlotState,
};

const TICK: Duration = Duration::from_millis(1);
const LEASE: Duration = Duration::from_millis(20);

fn config() -> OracleConfig {
    OracleConfig {
        tick_interval: TICK,
        lease_timeout: LEASE,
        ..OracleConfig::default()
    }
}

fn cluster(bits: u64, slots: u32) -> SimOracle {
    SimOracle::new(SimConfig::default(), Layout::new(bits, slots).unwrap()).unwrap()
}

fn handles(o: &SimOracle, n: usize, clock: &Arc<ManualClock>) -> Vec<SlotHandle> {
    (0..n)
        .map(|_| o.client(config(), clock.clone() as Arc<dyn Clock>).unwrap())
        .collect()
}

#[test]
fn a_commit_becomes_visible_once_marked() {
    let o = cluster(1024, 2);
    let clock = ManualClock::new();
    let h = handles(&o, 2, &clock);
    assert_eq!(h[0].read_timestamp().unwrap(), 0, "genesis");
    let a = h[0].next_commit_ts().unwrap();
    let b = h[1].next_commit_ts().unwrap();
    assert_eq!((a, b), (2, 1), "slot 0 starts at S, slot 1 at 1");
    h[0].mark(a, Outcome::Committed).unwrap();
    assert_eq!(h[0].read_timestamp().unwrap(), 0, "1 is still undecided");
    h[1].mark(b, Outcome::Aborted).unwrap();
    assert_eq!(h[0].read_timestamp().unwrap(), 2);
    assert_eq!(h[1].read_timestamp().unwrap(), 2);
    let s = h[0].stats();
    assert_eq!((s.committed, s.aborted), (1, 0));
    assert_eq!(h[1].stats().aborted, 1);
}

#[test]
fn an_observer_reads_timestamps_but_owns_none() {
    let o = cluster(1024, 2);
    let clock = ManualClock::new();
    let holder = o.client(config(), clock.clone() as Arc<dyn Clock>).unwrap();
    let observer = o
        .observer(config(), clock.clone() as Arc<dyn Clock>)
        .unwrap();
    // The other slot stays free, so nothing waits for the observer, which never
    // ticks: a registered second handle would hold the prefix at its first
    // timestamp until its lease ran out.
    let mut last = 0;
    for _ in 0..5 {
        last = holder.next_commit_ts().unwrap();
        holder.mark(last, Outcome::Committed).unwrap();
    }
    assert!(holder.read_timestamp().unwrap() >= last);
    assert!(observer.read_timestamp().unwrap() >= last);
    assert!(o.true_prefix(1).unwrap() > last);
    assert!(!observer.is_active());
    assert!(matches!(
        observer.next_commit_ts(),
        Err(OracleError::Released)
    ));
    observer.tick().unwrap();
    assert!(
        observer.release().is_err(),
        "an observer has nothing to release"
    );
}

#[test]
fn marks_of_many_timestamps_share_fetch_adds_and_decide_each() {
    let o = cluster(1024, 2);
    let clock = ManualClock::new();
    let h = handles(&o, 2, &clock);
    let mine: Vec<u64> = (0..5).map(|_| h[0].next_commit_ts().unwrap()).collect();
    let theirs: Vec<u64> = (0..5).map(|_| h[1].next_commit_ts().unwrap()).collect();
    // A timestamp that is not outstanding refuses the whole batch: nothing is decided.
    let mut batch: Vec<(u64, Outcome)> = mine.iter().map(|&t| (t, Outcome::Committed)).collect();
    batch.push((mine[4] + 2, Outcome::Committed));
    assert!(matches!(
        h[0].mark_many(&batch),
        Err(OracleError::NotOutstanding { .. })
    ));
    assert_eq!(h[0].stats().committed, 0);
    batch.pop();
    batch[1].1 = Outcome::Aborted;
    h[0].mark_many(&batch).unwrap();
    assert_eq!(
        h[1].read_timestamp().unwrap(),
        0,
        "slot 1's timestamps are undecided"
    );
    let theirs: Vec<(u64, Outcome)> = theirs.iter().map(|&t| (t, Outcome::Committed)).collect();
    h[1].mark_many(&theirs).unwrap();
    assert_eq!(
        h[1].read_timestamp().unwrap(),
        10,
        "every one of 1..=10 is decided"
    );
    let s = h[0].stats();
    assert_eq!((s.committed, s.aborted), (4, 1));
    assert!(
        matches!(
            h[0].mark(mine[0], Outcome::Committed),
            Err(OracleError::NotOutstanding { .. })
        ),
        "a timestamp is decided once"
    );
}

#[test]
fn bad_marks_are_refused() {
    let o = cluster(1024, 2);
    let clock = ManualClock::new();
    let h = handles(&o, 2, &clock);
    let a = h[0].next_commit_ts().unwrap();
    assert_eq!(
        h[0].mark(a + 1, Outcome::Committed),
        Err(OracleError::NotOutstanding { ts: a + 1 })
    );
    assert_eq!(
        h[1].mark(a, Outcome::Committed),
        Err(OracleError::NotOutstanding { ts: a })
    );
    h[0].mark(a, Outcome::Committed).unwrap();
    assert_eq!(
        h[0].mark(a, Outcome::Committed),
        Err(OracleError::NotOutstanding { ts: a })
    );
    assert!(o.is_decided(a).unwrap());
}

#[test]
fn marks_in_any_order_and_many_rounds_of_wrap() {
    // V = 16, 2 slots: 100 rounds of the vector, marks out of order within a slot.
    let o = cluster(16, 2);
    let clock = ManualClock::new();
    let h = handles(&o, 2, &clock);
    let mut last = 0;
    for _ in 0..400 {
        let mut taken = Vec::new();
        for hd in &h {
            for _ in 0..2 {
                match hd.next_commit_ts() {
                    Ok(t) => taken.push((hd, t)),
                    Err(OracleError::WrapBlocked { .. }) => {}
                    Err(e) => panic!("{e}"),
                }
            }
        }
        for (hd, t) in taken.into_iter().rev() {
            hd.mark(t, Outcome::Committed).unwrap();
        }
        let rid = h[0].read_timestamp().unwrap();
        assert!(rid >= last, "read timestamp went back from {last} to {rid}");
        assert_eq!(rid + 1, o.true_prefix(rid + 1).unwrap());
        last = rid;
        clock.advance(TICK);
        h[0].tick().unwrap();
        h[1].tick().unwrap();
    }
    assert!(last >= 16 * 90, "only reached {last}");
}

#[test]
fn a_position_is_not_reused_before_its_previous_timestamp_is_decided() {
    let o = cluster(16, 2);
    let clock = ManualClock::new();
    let h = handles(&o, 2, &clock);
    let held = h[1].next_commit_ts().unwrap();
    assert_eq!(held, 1);
    // Slot 0 runs on: 2, 4, 6, 8 are within V/2 = 8 of the prefix (1); 10 is not, and
    // far from reusing the position of an undecided timestamp, it must wait.
    let mut got = Vec::new();
    let err = loop {
        match h[0].next_commit_ts() {
            Ok(t) => {
                h[0].mark(t, Outcome::Committed).unwrap();
                got.push(t);
            }
            Err(e) => break e,
        }
    };
    assert_eq!(
        err,
        OracleError::WrapBlocked {
            ts: 10,
            blocked_by: 2,
            prefix: 1
        }
    );
    assert_eq!(got, [2, 4, 6, 8]);
    assert!(matches!(
        h[0].acquire_commit_ts(3),
        Err(OracleError::Stalled { attempts: 3, .. })
    ));
    h[1].mark(held, Outcome::Committed).unwrap();
    assert_eq!(h[0].acquire_commit_ts(3).unwrap(), 10);
}

#[test]
fn an_idle_slot_stalls_the_prefix_at_most_one_tick_interval() {
    let o = cluster(60_000, 3);
    let clock = ManualClock::new();
    let h = handles(&o, 3, &clock);
    // Slot 2 commits far ahead; slots 0 and 1 are idle but tick.
    let mut top = 0;
    for _ in 0..500 {
        let t = h[2].next_commit_ts().unwrap();
        h[2].mark(t, Outcome::Committed).unwrap();
        top = t;
    }
    assert!(h[2].read_timestamp().unwrap() < top);
    // The idle slots' ticks are due one interval after their last one.
    let mut elapsed = Duration::ZERO;
    while h[2].read_timestamp().unwrap() < top {
        assert!(
            elapsed <= TICK,
            "the prefix still stalls after {elapsed:?} (bound {TICK:?})"
        );
        for hd in &h[..2] {
            hd.tick().unwrap();
        }
        clock.advance(TICK / 4);
        elapsed += TICK / 4;
    }
    assert_eq!(h[2].read_timestamp().unwrap(), top);
    assert!(h[0].stats().skipped > 0 && h[1].stats().skipped > 0);
    // The skipped timestamps are spent: the idle slots' next ones are beyond `top`.
    assert!(h[0].next_commit_ts().unwrap() > top);
    assert!(h[1].next_commit_ts().unwrap() > top);
}

#[test]
fn an_expired_slot_is_fenced_and_skipped_and_its_holder_learns_it() {
    let o = cluster(1024, 2);
    let clock = ManualClock::new();
    let h = handles(&o, 2, &clock);
    // Slot 1's holder takes 1 and goes silent: no ticks, no marks.
    let lost = h[1].next_commit_ts().unwrap();
    let t = h[0].next_commit_ts().unwrap();
    h[0].mark(t, Outcome::Committed).unwrap();
    let mut fenced_at = None;
    for step in 0..200u32 {
        clock.advance(TICK);
        let r = h[0].tick().unwrap();
        if r.fenced.is_some() {
            assert_eq!(r.fenced, Some(1));
            fenced_at = Some(Duration::from_millis(step as u64 + 1));
            break;
        }
    }
    let fenced_at = fenced_at.expect("slot 1 was never fenced");
    assert!(
        fenced_at >= LEASE,
        "fenced after {fenced_at:?}, lease {LEASE:?}"
    );
    assert!(
        fenced_at <= LEASE + 4 * TICK,
        "fenced only after {fenced_at:?}"
    );
    assert_eq!(o.lease(1).unwrap().state, SlotState::Fenced);
    // Its timestamps were skipped: the prefix covers the commit above them.
    assert!(o.is_decided(lost).unwrap());
    assert!(h[0].read_timestamp().unwrap() >= t);
    // The old holder comes back: its next decision renews first and fails.
    assert_eq!(
        h[1].mark(lost, Outcome::Committed),
        Err(OracleError::Fenced { slot: 1 })
    );
    assert_eq!(h[1].next_commit_ts(), Err(OracleError::Fenced { slot: 1 }));
    assert!(!h[1].is_active());
    // It re-registers: slot 1 is free again for it, and it starts above what the
    // fencer may skip.
    assert_eq!(h[1].rejoin().unwrap(), 1);
    let fresh = h[1].next_commit_ts().unwrap();
    assert!(fresh > lost);
    h[1].mark(fresh, Outcome::Committed).unwrap();
    let mut next = h[0].next_commit_ts().unwrap();
    h[0].mark(next, Outcome::Committed).unwrap();
    for _ in 0..8 {
        clock.advance(TICK);
        h[0].tick().unwrap();
        h[1].tick().unwrap();
    }
    next = next.max(fresh);
    let rid = h[0].read_timestamp().unwrap();
    assert!(
        rid >= next,
        "rid {rid} fresh {fresh} next {next} true {}",
        o.true_prefix(1).unwrap()
    );
}

/// A holder whose clock says its lease is fresh (its check passed just before its
/// thread was descheduled, as this clock that stands still says) is fenced by a handle
/// of its own process. Sharing lease gates: while the holder is inside its gate the
/// fence waits (the slot stays owned, nothing is skipped for it); once the holder is
/// out, the fence goes through, and the holder's later decision is refused, where
/// without the gates it lands on a timestamp the fencer decided already.
#[test]
fn a_fence_in_the_holders_process_waits_for_its_gate_and_then_shuts_it() {
    for shared in [true, false] {
        let o = cluster(1024, 2);
        let clock = ManualClock::new();
        let fencer = o.client(config(), clock.clone() as Arc<dyn Clock>).unwrap();
        let late = o
            .client(config(), ManualClock::new() as Arc<dyn Clock>)
            .unwrap();
        if shared {
            let gates = LeaseGates::new();
            fencer.share_gates(gates.clone());
            late.share_gates(gates);
        }
        let lost = late.next_commit_ts().unwrap();
        let t = fencer.next_commit_ts().unwrap();
        fencer.mark(t, Outcome::Committed).unwrap();
        let inside = late.lease_guard().unwrap();
        let mut fenced = None;
        for _ in 0..60 {
            clock.advance(TICK);
            fenced = fenced.or(fencer.tick().unwrap().fenced);
        }
        if shared {
            assert_eq!(fenced, None, "fenced while the holder was inside its gate");
            assert_eq!(o.lease(1).unwrap().state, SlotState::Owned);
            assert!(!o.is_decided(lost).unwrap());
            assert!(fencer.stats().fences_waited > 0);
        } else {
            assert_eq!(fenced, Some(1));
        }
        drop(inside);
        for _ in 0..4 {
            clock.advance(TICK);
            fenced = fenced.or(fencer.tick().unwrap().fenced);
        }
        assert_eq!(fenced, Some(1));
        assert!(o.is_decided(lost).unwrap());
        let marked = late.mark(lost, Outcome::Committed);
        if shared {
            assert_eq!(marked, Err(OracleError::Fenced { slot: 1 }));
            assert!(o.is_decided(lost).unwrap(), "decided once");
        } else {
            // The lease assumption broken: the late mark toggles the decision back.
            assert_eq!(marked, Ok(()));
            assert!(!o.is_decided(lost).unwrap(), "decided twice");
        }
    }
}

#[test]
fn a_live_slot_that_ticks_is_never_fenced() {
    let o = cluster(1024, 2);
    let clock = ManualClock::new();
    let h = handles(&o, 2, &clock);
    // Slot 1 holds a timestamp for a long time (a slow commit) but keeps ticking.
    let slow = h[1].next_commit_ts().unwrap();
    let t = h[0].next_commit_ts().unwrap();
    h[0].mark(t, Outcome::Committed).unwrap();
    for _ in 0..(LEASE.as_millis() * 5) {
        clock.advance(TICK);
        assert_eq!(h[0].tick().unwrap().fenced, None);
        h[1].tick().unwrap();
    }
    assert!(h[1].is_active());
    assert_eq!(h[0].read_timestamp().unwrap(), slow - 1);
    h[1].mark(slow, Outcome::Committed).unwrap();
    assert!(h[0].read_timestamp().unwrap() >= t);
}

#[test]
fn released_slots_are_skipped_for_and_can_be_claimed_again() {
    let o = cluster(1024, 3);
    let clock = ManualClock::new();
    let h = handles(&o, 3, &clock);
    let t = h[1].next_commit_ts().unwrap();
    assert_eq!(h[1].release(), Err(OracleError::Outstanding { count: 1 }));
    h[1].mark(t, Outcome::Committed).unwrap();
    h[1].release().unwrap();
    assert_eq!(o.lease(1).unwrap().state, SlotState::Free);
    assert_eq!(h[1].next_commit_ts(), Err(OracleError::Released));
    // Slot 0 commits ahead; slot 2 idles and ticks; nobody holds slot 1.
    let mut top = 0;
    for _ in 0..50 {
        let t = h[0].next_commit_ts().unwrap();
        h[0].mark(t, Outcome::Committed).unwrap();
        top = t;
    }
    for _ in 0..8 {
        clock.advance(TICK);
        h[0].tick().unwrap();
        h[2].tick().unwrap();
    }
    assert!(h[0].read_timestamp().unwrap() >= top);
    assert!(h[0].stats().skipped_for_others + h[2].stats().skipped_for_others > 0);
    // A new node claims the free slot and starts beyond what was skipped for it.
    let newcomer = o.client(config(), clock.clone()).unwrap();
    assert_eq!(newcomer.slot(), 1);
    let n = newcomer.next_commit_ts().unwrap();
    assert!(n > top && n % 3 == 1, "{n}");
    assert!(!o.is_decided(n).unwrap());
}

#[test]
fn registration_checks_the_region_and_the_slot_count() {
    let o = cluster(64, 2);
    let clock = ManualClock::new();
    let _h = handles(&o, 2, &clock);
    assert!(matches!(
        o.client(config(), clock.clone()),
        Err(OracleError::NoFreeSlot { slots: 2 })
    ));
    // A region that holds no oracle.
    let other = cluster(64, 2);
    other.region.store_u64(0, 42).unwrap();
    assert!(matches!(
        other.client(config(), clock.clone()),
        Err(OracleError::NotAnOracle { magic: 42 })
    ));
    let bad = OracleConfig {
        window_bytes: 12,
        ..config()
    };
    assert!(matches!(
        o.client(bad, clock.clone()),
        Err(OracleError::InvalidConfig(_))
    ));
    let bad = OracleConfig {
        lease_timeout: TICK,
        ..config()
    };
    assert!(matches!(
        o.client(bad, clock),
        Err(OracleError::InvalidConfig(_))
    ));
}

#[test]
fn coroutines_share_one_handle() {
    let o = cluster(4096, 2);
    let clock = ManualClock::new();
    let h = handles(&o, 2, &clock);
    let other = h[1].next_commit_ts().unwrap();
    let (a, b) = (&h[0], &h[1]);
    let rids = futures::executor::block_on(async {
        let commits = (0..16).map(|_| async {
            let t = a.next_commit_ts()?;
            let before = a.read_timestamp_async().await?;
            assert!(before < t);
            a.mark(t, Outcome::Committed)?;
            a.read_timestamp_async().await
        });
        let blocker = async {
            let r = b.read_timestamp_async().await?;
            b.mark(other, Outcome::Committed)?;
            Ok::<u64, OracleError>(r)
        };
        let (rids, blocked) = futures::join!(futures::future::join_all(commits), blocker);
        assert_eq!(blocked.unwrap(), other - 1);
        rids
    });
    for r in rids {
        // Slot 1 has not decided 3 yet (and may not have decided 1 when it was read).
        assert!(r.unwrap() <= 2);
    }
    // Slot 1 idles; its tick skips up to slot 0's last commit.
    clock.advance(TICK);
    h[1].tick().unwrap();
    assert_eq!(h[0].read_timestamp().unwrap(), 2 * 16);
}

#[test]
fn reads_are_one_window_in_steady_state() {
    let o = cluster(60_000, 2);
    let clock = ManualClock::new();
    let h = handles(&o, 2, &clock);
    h[0].read_timestamp().unwrap();
    let before = h[0].stats();
    for _ in 0..1000 {
        for hd in &h {
            let t = hd.next_commit_ts().unwrap();
            hd.mark(t, Outcome::Committed).unwrap();
        }
        h[0].read_timestamp().unwrap();
    }
    let after = h[0].stats();
    assert_eq!(after.read_timestamps - before.read_timestamps, 1000);
    assert_eq!(after.window_reads - before.window_reads, 1000);
    assert!((after.window_bytes - before.window_bytes) <= 1000 * 256);
}

/// An oracle carved out of a larger region at an offset (as txn's catalog places it in
/// a data region) works through `register_at`, and nothing outside it is touched.
#[test]
fn an_oracle_at_an_offset_of_a_region() {
    let o = cluster(1024, 2);
    let layout = o.layout;
    let base = 4096u64;
    let region = o
        .server
        .register(base + layout.region_bytes() + 64, fabric::Access::ALL)
        .unwrap();
    // Neighbours' bytes, which the oracle must leave alone.
    for off in (0..region.len()).step_by(8) {
        region.store_u64(off, 0xa5a5_a5a5_a5a5_a5a5).unwrap();
    }
    for (i, w) in layout.image().iter().enumerate() {
        region.store_u64(base + i as u64 * 8, *w).unwrap();
    }
    let clock = ManualClock::new();
    let h: Vec<SlotHandle> = (0..2)
        .map(|_| {
            let (dev, qp, cq) = o.connect(o.net.add_node()).unwrap();
            SlotHandle::register_at(
                dev.as_ref(),
                qp,
                cq,
                region.remote(),
                base,
                config(),
                clock.clone() as Arc<dyn Clock>,
            )
            .unwrap()
        })
        .collect();
    assert_eq!(h[0].layout(), layout);
    let a = h[0].next_commit_ts().unwrap();
    let b = h[1].next_commit_ts().unwrap();
    h[0].mark(a, Outcome::Committed).unwrap();
    h[1].mark(b, Outcome::Committed).unwrap();
    assert_eq!(h[0].read_timestamp().unwrap(), a.max(b));
    for off in (0..base).chain(base + layout.region_bytes()..region.len()) {
        if off % 8 == 0 {
            assert_eq!(
                region.load_u64(off).unwrap(),
                0xa5a5_a5a5_a5a5_a5a5,
                "{off}"
            );
        }
    }
    // A base that leaves no room for the header, or is not a word offset, is refused.
    let (dev, qp, cq) = o.connect(o.net.add_node()).unwrap();
    assert!(matches!(
        SlotHandle::register_at(
            dev.as_ref(),
            qp,
            cq,
            region.remote(),
            base + 4,
            config(),
            clock.clone() as Arc<dyn Clock>,
        ),
        Err(OracleError::InvalidConfig(_))
    ));
}

/// Read timestamps of `readers`, round-robin, until `waiter`'s covers `cid`: how many
/// rounds it took, or `None` after `limit` rounds. No tick runs meanwhile.
fn rounds_until_visible(
    waiter: &SlotHandle,
    others: &[&SlotHandle],
    cid: u64,
    limit: u32,
) -> Option<u32> {
    for round in 1..=limit {
        if waiter.read_timestamp().unwrap() >= cid {
            return Some(round);
        }
        for h in others {
            h.read_timestamp().unwrap();
        }
    }
    None
}

/// `writer` commits a timestamp; then both read until the writer's read timestamp
/// covers it. Returns the timestamp and how many rounds of reads that took.
fn commit_and_wait(writer: &SlotHandle, reader: &SlotHandle, limit: u32) -> (u64, u32) {
    let t = writer.acquire_commit_ts(4).unwrap();
    writer.mark(t, Outcome::Committed).unwrap();
    let rounds = rounds_until_visible(writer, &[reader], t, limit)
        .unwrap_or_else(|| panic!("commit {t} not visible after {limit} rounds of reads"));
    (t, rounds)
}

/// Without ticks (the manual clock never moves and nobody calls `tick`), two holders
/// among 16 slots (14 free) see each other's commits after a few read timestamps:
/// the reads skip the free slots with CAS and a holder the prefix waits for skips
/// its own unused timestamps.
#[test]
fn commits_become_visible_through_reads_alone() {
    let o = cluster(60_000, 16);
    let clock = ManualClock::new();
    let h = handles(&o, 2, &clock);
    let mut worst = 0;
    for i in 0..300 {
        let (t, rounds) = commit_and_wait(&h[i % 2], &h[(i + 1) % 2], 50);
        worst = worst.max(rounds);
        assert!(o.true_prefix(t).unwrap() > t);
    }
    eprintln!("worst: {worst} rounds of reads");
    assert!(worst <= 4, "a commit needed {worst} rounds of reads");
    assert!(h[0].stats().skipped_for_others + h[1].stats().skipped_for_others > 0);
    assert!(h[0].stats().skipped + h[1].stats().skipped > 0);
}

/// The same with uneven rates: holder A commits 100 times for each commit of B, and
/// both read; every commit of either becomes visible within a few rounds.
#[test]
fn uneven_commit_rates_keep_visibility_prompt() {
    let o = cluster(60_000, 16);
    let clock = ManualClock::new();
    let h = handles(&o, 2, &clock);
    let (a, b) = (&h[0], &h[1]);
    let mut worst = 0;
    for i in 0..1000 {
        let (writer, reader) = if i % 100 == 99 { (b, a) } else { (a, b) };
        let (_, rounds) = commit_and_wait(writer, reader, 50);
        worst = worst.max(rounds);
    }
    eprintln!("worst: {worst} rounds of reads");
    assert!(worst <= 4, "a commit needed {worst} rounds of reads");
    assert_eq!(a.stats().committed, 990);
    assert_eq!(b.stats().committed, 10);
}

/// A node that claims a free slot the reads have skipped ahead starts at the raised
/// horizon, above every timestamp skipped for the slot, and its commits become
/// visible through reads as well; the holders learn from the failed horizon raise
/// that the slot is taken and stop skipping for it.
#[test]
fn a_claimer_of_a_slot_skipped_ahead_starts_above_the_skips() {
    let o = cluster(60_000, 4);
    let clock = ManualClock::new();
    let h = handles(&o, 2, &clock);
    let mut top = 0;
    for i in 0..50 {
        top = commit_and_wait(&h[i % 2], &h[(i + 1) % 2], 20).0;
    }
    let skipped_before = h[0].stats().skipped_for_others + h[1].stats().skipped_for_others;
    assert!(skipped_before > 0);
    let horizon = o.lease(2).unwrap().horizon * timestamp::layout::BLOCK;
    assert!(
        horizon > top,
        "the free slot's horizon {horizon} was raised past {top}"
    );
    let c = o.client(config(), clock.clone()).unwrap();
    assert_eq!(c.slot(), 2);
    let t = c.acquire_commit_ts(4).unwrap();
    assert!(
        t >= horizon && !o.is_decided(t).unwrap(),
        "{t} below {horizon} or decided"
    );
    c.mark(t, Outcome::Committed).unwrap();
    let rounds = rounds_until_visible(&c, &[&h[0], &h[1]], t, 20);
    assert!(
        rounds.is_some(),
        "the claimer's commit {t} never became visible"
    );
    for hd in &h {
        assert!(hd.read_timestamp().unwrap() >= t);
        let u = hd.acquire_commit_ts(4).unwrap();
        hd.mark(u, Outcome::Committed).unwrap();
    }
    // The claimer's next timestamps were not skipped by the others.
    let next = c.acquire_commit_ts(4).unwrap();
    assert!(!o.is_decided(next).unwrap());
    c.mark(next, Outcome::Committed).unwrap();
    assert!(rounds_until_visible(&c, &[&h[0], &h[1]], next, 20).is_some());
}

/// Commits one at a time on `h`, each followed by a read timestamp, with no tick and
/// a clock that never moves: `commits` of them, or fewer if more than `max_stalls`
/// passes find no commit timestamp (`acquire_commit_ts` reads timestamps itself
/// before it gives up, so a stalled pass is still work). Returns the commits made,
/// the stalled passes, and the window READs per commit made.
fn commit_alone(h: &SlotHandle, commits: u64, max_stalls: u64) -> (u64, u64, f64) {
    let before = h.stats();
    let (mut made, mut stalls, mut last) = (0, 0, 0);
    while made < commits && stalls <= max_stalls {
        match h.acquire_commit_ts(4) {
            Ok(t) => {
                h.mark(t, Outcome::Committed).unwrap();
                made += 1;
                last = t;
            }
            Err(OracleError::Stalled { .. }) => stalls += 1,
            Err(e) => panic!("acquire: {e}"),
        }
        h.read_timestamp().unwrap();
    }
    if made == commits {
        // A read skips for free slots through one window (2048 timestamps) at most,
        // and the prefix may lag the holder by up to the wrap margin, V/2.
        let reads = 2 + (h.layout().bits() / 2 / 2048) as usize;
        assert!(
            (0..reads).any(|_| h.read_timestamp().unwrap() >= last),
            "the last commit {last} is not visible after {reads} reads"
        );
    }
    let reads = (h.stats().window_reads - before.window_reads) as f64;
    (made, stalls, reads / made.max(1) as f64)
}

/// One active holder among many free slots, with read timestamps alone (no ticks):
/// the reads skip for every free slot, so the holder's commits never wait for the
/// wrap margin and each costs about one window READ however many slots are free.
/// A handle that knew only the leases its claim read (the first 16 slots) took the
/// others for owned and never skipped for them: it stalled for good after V/(2S)
/// commits (234 at 128 slots), with 64 window READs per stalled pass.
#[test]
fn one_holder_among_many_free_slots_commits_through_reads_alone() {
    for slots in [17, 128, 1024, 4096] {
        let o = cluster(60_000, slots);
        let clock = ManualClock::new();
        let h = o.client(config(), clock.clone() as Arc<dyn Clock>).unwrap();
        // Four rounds of the vector, at least 500 commits.
        let commits = (4 * 60_000 / slots as u64).max(500);
        let (made, stalls, reads) = commit_alone(&h, commits, commits / 10);
        assert_eq!(
            made, commits,
            "{slots} slots: {made} of {commits} commits, {stalls} stalled passes"
        );
        // A commit moves the prefix S timestamps, a window READ covers 2048, and
        // acquire_commit_ts reads once per pass while the wrap margin holds it back.
        let bound = 2.0 + slots as f64 / 2048.0;
        assert!(
            reads <= bound,
            "{slots} slots: {reads:.2} window READs per commit (bound {bound:.2}), {stalls} stalled passes"
        );
    }
}

/// A handle that registered while other slots were held learns, at its first tick
/// that finds one of them free, that all of them were released: one stale sighting
/// re-reads the slot table, so the prefix does not wait two ticks per released slot.
#[test]
fn slots_released_after_registration_are_learned_together() {
    const OTHERS: usize = 40;
    let o = cluster(60_000, OTHERS as u32 + 1);
    let clock = ManualClock::new();
    let others = handles(&o, OTHERS, &clock);
    let h = o.client(config(), clock.clone() as Arc<dyn Clock>).unwrap();
    assert_eq!(h.slot(), OTHERS as u32);
    for other in &others {
        other.release().unwrap();
    }
    let t = h.acquire_commit_ts(4).unwrap();
    h.mark(t, Outcome::Committed).unwrap();
    let mut ticks = 0;
    while h.read_timestamp().unwrap() < t {
        ticks += 1;
        assert!(
            ticks <= 4,
            "the prefix {} still waits for released slots after {ticks} ticks",
            h.known_read_timestamp()
        );
        clock.advance(TICK);
        h.tick().unwrap();
    }
    // From here on the reads skip for all of them, as for slots free from the start.
    let (made, stalls, _) = commit_alone(&h, 1000, 100);
    assert_eq!(made, 1000, "{stalls} stalled passes");
}

/// A slot can change hands without its heartbeat showing it: a fence that finds an
/// earlier fence's mark on the heartbeat ends the lease with one CAS on the lease
/// word. The holder's next renewal reads the lease back and stops holding.
#[test]
fn a_renewal_finds_a_lease_that_changed_under_it() {
    let o = cluster(1024, 2);
    let clock = ManualClock::new();
    let h = handles(&o, 1, &clock);
    let holder = &h[0];
    holder.renew().unwrap();
    let mine = holder.held_lease();
    let taken = timestamp::Lease {
        state: SlotState::Fenced,
        tag: mine.next_tag(),
        ..mine
    };
    o.region
        .store_u64(o.layout.lease_offset(holder.slot()), taken.encode())
        .unwrap();
    assert_eq!(
        holder.renew(),
        Err(OracleError::Fenced {
            slot: holder.slot()
        })
    );
    assert!(!holder.is_active());
    assert_eq!(
        holder.next_commit_ts(),
        Err(OracleError::Fenced { slot: 0 })
    );
}
