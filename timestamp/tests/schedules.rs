//! Property tests: random schedules of several slot holders on one sim network, run
//! single-threaded so that each schedule is one deterministic interleaving, against a
//! ground truth read from the server's memory by CPU.
//!
//! After every step: a read timestamp never covers a timestamp that a holder still
//! owns undecided, never goes backwards (per handle) and never passes the true prefix;
//! a timestamp is handed out only when the previous one at its position is decided
//! (and within V/2 of the prefix); a decided timestamp stays decided (nothing
//! double-toggles). At the end, once every holder finishes and ticks, the prefix
//! passes every timestamp ever handed out, as seen from every handle.
#![cfg(not(timestamp_loom))]

use fabric::sim::SimConfig;
use proptest::prelude::*;
use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;
use timestamp::testkit::SimOracle;
use timestamp::{Clock, Layout, ManualClock, OracleConfig, OracleError, Outcome, SlotHandle};

const TICK: Duration = Duration::from_millis(1);
const LEASE: Duration = Duration::from_millis(8);

#[derive(Clone, Debug)]
enum Step {
    Take(usize),
    Mark(usize, usize),
    Read(usize),
    Tick(usize),
    Advance(u8),
    Release(usize),
    Rejoin(usize),
    /// The holder's process dies (its handle is dropped with whatever it held) and a
    /// new one takes its place: a fresh handle claims a free or fenced slot, or takes
    /// over a lapsed one.
    Replace(usize),
}

fn step(holders: usize) -> impl Strategy<Value = Step> {
    let h = 0..holders;
    prop_oneof![
        6 => h.clone().prop_map(Step::Take),
        6 => (h.clone(), any::<usize>()).prop_map(|(h, i)| Step::Mark(h, i)),
        3 => h.clone().prop_map(Step::Read),
        3 => h.clone().prop_map(Step::Tick),
        2 => (0u8..4).prop_map(Step::Advance),
        1 => h.clone().prop_map(Step::Release),
        1 => h.clone().prop_map(Step::Rejoin),
        1 => h.prop_map(Step::Replace),
    ]
}

fn config() -> OracleConfig {
    OracleConfig {
        tick_interval: TICK,
        lease_timeout: LEASE,
        reserve: 64,
        ..OracleConfig::default()
    }
}

struct Run {
    o: SimOracle,
    clock: Arc<ManualClock>,
    handles: Vec<SlotHandle>,
    /// Per holder: timestamps handed out and not marked.
    pending: Vec<BTreeSet<u64>>,
    marked: BTreeSet<u64>,
    truth: u64,
    last_rid: Vec<u64>,
    /// Slots held by handles that were dropped ([`Step::Replace`]): nothing fences
    /// one unless it stalls a commit, so at the end they are suspected.
    dead: Vec<u32>,
}

impl Run {
    fn new(bits: u64, slots: u32, holders: usize) -> Run {
        let o = SimOracle::new(SimConfig::default(), Layout::new(bits, slots).unwrap()).unwrap();
        let clock = ManualClock::new();
        let handles: Vec<SlotHandle> = (0..holders)
            .map(|_| o.client(config(), clock.clone() as Arc<dyn Clock>).unwrap())
            .collect();
        Run {
            o,
            clock,
            handles,
            pending: vec![BTreeSet::new(); holders],
            marked: BTreeSet::new(),
            truth: 1,
            last_rid: vec![0; holders],
            dead: Vec::new(),
        }
    }

    /// Whether holder `h` still holds its slot on the server (not fenced).
    fn holds(&self, h: usize) -> bool {
        let hd = &self.handles[h];
        hd.is_active() && self.o.lease(hd.slot()).unwrap() == hd.held_lease()
    }

    fn apply(&mut self, s: &Step) -> Result<(), TestCaseError> {
        match *s {
            Step::Take(h) => match self.handles[h].next_commit_ts() {
                Ok(t) => {
                    let v = self.o.layout.bits();
                    prop_assert!(
                        t < v || t - v < self.truth,
                        "{t} handed out while {} is undecided",
                        t - v
                    );
                    prop_assert!(t < self.truth + v / 2, "{t} is V/2 beyond {}", self.truth);
                    prop_assert!(
                        !self.holds(h) || !self.o.is_decided(t).unwrap(),
                        "{t} handed out decided"
                    );
                    self.pending[h].insert(t);
                }
                Err(
                    OracleError::RenewalDue
                    | OracleError::WrapBlocked { .. }
                    | OracleError::ReservationExhausted { .. }
                    | OracleError::Fenced { .. }
                    | OracleError::Released,
                ) => {}
                Err(e) => prop_assert!(false, "next_commit_ts: {e}"),
            },
            Step::Mark(h, i) => {
                let Some(&t) = self.pending[h].iter().nth(i % self.pending[h].len().max(1)) else {
                    return Ok(());
                };
                match self.handles[h].mark(t, Outcome::Committed) {
                    Ok(()) => {
                        self.pending[h].remove(&t);
                        self.marked.insert(t);
                    }
                    Err(OracleError::Fenced { .. }) => {
                        // In doubt: the fencer may have skipped them.
                        self.pending[h].clear();
                    }
                    Err(e) => prop_assert!(false, "mark: {e}"),
                }
            }
            Step::Read(h) => {
                let rid = self.handles[h].read_timestamp().unwrap();
                self.check_rid(h, rid)?;
            }
            Step::Tick(h) => match self.handles[h].tick() {
                // A tick that was not due reports the cached prefix, not a fresh one.
                Ok(r) if r.ran => self.check_rid(h, r.prefix - 1)?,
                Ok(_) => {}
                Err(OracleError::Fenced { .. }) => self.pending[h].clear(),
                Err(e) => prop_assert!(false, "tick: {e}"),
            },
            Step::Advance(n) => self.clock.advance(TICK * n as u32),
            Step::Release(h) => {
                if self.pending[h].is_empty() {
                    match self.handles[h].release() {
                        Ok(()) | Err(OracleError::Fenced { .. } | OracleError::Released) => {}
                        Err(e) => prop_assert!(false, "release: {e}"),
                    }
                }
            }
            Step::Replace(h) => {
                let fresh = self
                    .o
                    .observer(config(), self.clock.clone() as Arc<dyn Clock>)
                    .unwrap();
                // A claim, not a take-over: that waits for a lease to lapse on a clock
                // that does not move here. With no slot free, a later Rejoin claims.
                match fresh.rejoin() {
                    Ok(_) | Err(OracleError::NoFreeSlot { .. }) => {}
                    Err(e) => prop_assert!(false, "claim_taking_over: {e}"),
                }
                // The old holder's undecided timestamps die with it.
                if self.handles[h].is_active() {
                    self.dead.push(self.handles[h].slot());
                }
                self.pending[h].clear();
                self.last_rid[h] = 0;
                self.handles[h] = fresh;
            }
            Step::Rejoin(h) => {
                if !self.handles[h].is_active() {
                    self.pending[h].clear();
                    match self.handles[h].rejoin() {
                        Ok(_) | Err(OracleError::NoFreeSlot { .. }) => {}
                        Err(e) => prop_assert!(false, "rejoin: {e}"),
                    }
                }
            }
        }
        self.check_state()
    }

    /// Refreshes the ground truth. The scan from the server's memory is a reader too
    /// and must not start V/2 behind, so it starts from the freshest handle's known
    /// prefix (each is a truthful lower bound).
    fn refresh(&mut self) {
        let freshest = self
            .handles
            .iter()
            .map(|h| h.known_read_timestamp() + 1)
            .max();
        let from = self.truth.max(freshest.unwrap_or(1));
        self.truth = self.o.true_prefix(from).unwrap();
    }

    fn check_rid(&mut self, h: usize, rid: u64) -> Result<(), TestCaseError> {
        self.refresh();
        let last = self.last_rid[h];
        prop_assert!(
            rid >= last,
            "holder {h}'s read timestamp went back: {last} → {rid}"
        );
        prop_assert!(
            rid < self.truth,
            "read timestamp {rid} passes the true prefix {}",
            self.truth
        );
        self.last_rid[h] = rid;
        Ok(())
    }

    fn check_state(&mut self) -> Result<(), TestCaseError> {
        self.refresh();
        for h in 0..self.handles.len() {
            if !self.holds(h) {
                continue;
            }
            if let Some(&low) = self.pending[h].first() {
                prop_assert!(
                    low >= self.truth,
                    "the prefix {} covers {low}, still undecided by holder {h}",
                    self.truth
                );
            }
        }
        for &t in self.marked.range(self.truth..) {
            prop_assert!(self.o.is_decided(t).unwrap(), "marked {t} reads undecided");
        }
        Ok(())
    }

    /// Every holder decides what it holds and rejoins; then each must be able to take
    /// and decide a fresh timestamp, and every handle's read timestamp must reach
    /// every decision (timestamps a fenced holder left undecided are in doubt and
    /// need not become visible, but they must not stop anything after them).
    fn finish(&mut self) -> Result<(), TestCaseError> {
        for h in 0..self.handles.len() {
            let pending: Vec<u64> = std::mem::take(&mut self.pending[h]).into_iter().collect();
            for t in pending {
                match self.handles[h].mark(t, Outcome::Committed) {
                    Ok(()) => {
                        self.marked.insert(t);
                        self.refresh();
                    }
                    Err(OracleError::Fenced { .. }) => {}
                    Err(e) => prop_assert!(false, "mark: {e}"),
                }
            }
        }
        let mut fresh = vec![false; self.handles.len()];
        for round in 0..400 {
            for (h, done) in fresh.iter_mut().enumerate() {
                let hd = &self.handles[h];
                // A replaced holder's new handle may find every slot owned, one by
                // the holder it replaced: as a node whose reads wait on a dead
                // holder's lock, the others suspect it, and their ticks fence it. A
                // handle watches one suspect at a time: the dead take turns.
                if !self.dead.is_empty() {
                    hd.suspect(self.dead[round / 20 % self.dead.len()]);
                }
                if !hd.is_active() {
                    let _ = hd.rejoin();
                }
                if !*done && hd.is_active() {
                    match hd.acquire_commit_ts(1) {
                        Ok(t) => match hd.mark(t, Outcome::Committed) {
                            Ok(()) => {
                                self.marked.insert(t);
                                *done = true;
                                self.refresh();
                            }
                            Err(OracleError::Fenced { .. }) => {}
                            Err(e) => prop_assert!(false, "mark: {e}"),
                        },
                        Err(OracleError::Stalled { .. } | OracleError::Fenced { .. }) => {}
                        Err(e) => prop_assert!(false, "acquire_commit_ts: {e}"),
                    }
                }
                match self.handles[h].tick() {
                    Ok(_) | Err(OracleError::Fenced { .. }) => {}
                    Err(e) => prop_assert!(false, "tick: {e}"),
                }
                // The ground truth is a reader too: it must not fall V/2 behind.
                self.refresh();
            }
            self.clock.advance(TICK);
            let target = self.marked.last().copied().unwrap_or(0);
            let mut lowest = u64::MAX;
            for h in 0..self.handles.len() {
                let rid = self.handles[h].read_timestamp().unwrap();
                self.check_rid(h, rid)?;
                lowest = lowest.min(rid);
            }
            if lowest >= target && fresh.iter().all(|&f| f) {
                return Ok(());
            }
        }
        prop_assert!(
            false,
            "stalled: read timestamps {:?}, highest decision {:?}, fresh commits {fresh:?}, truth {}",
            self.last_rid,
            self.marked.last(),
            self.truth
        );
        Ok(())
    }
}

proptest! {
    // 96 cases keep `cargo test` quick; PROPTEST_CASES=5000 for a deeper search.
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(96),
        ..ProptestConfig::default()
    })]

    #[test]
    fn random_schedules_keep_the_invariants(
        bits in prop_oneof![Just(16u64), Just(64), Just(200)],
        holders in 2usize..4,
        steps in proptest::collection::vec(step(3), 1..250),
    ) {
        let mut run = Run::new(bits, holders as u32, holders);
        for s in &steps {
            if let Step::Take(h) | Step::Mark(h, _) | Step::Read(h) | Step::Tick(h)
                | Step::Release(h) | Step::Rejoin(h) | Step::Replace(h) = *s
                && h >= holders
            {
                continue;
            }
            run.apply(s)?;
        }
        run.finish()?;
    }

    /// More holders than slots: some fail to register at first and join later, when
    /// a slot is released or fenced.
    #[test]
    fn holders_come_and_go(
        steps in proptest::collection::vec(step(3), 1..250),
    ) {
        let mut run = Run::new(64, 3, 3);
        for s in &steps {
            run.apply(s)?;
        }
        run.finish()?;
    }

    /// More slots than holders: read timestamps and ticks skip for free slots all the
    /// time, and holders that die leave fenced slots that others skip for and new
    /// holders claim.
    #[test]
    fn holders_die_among_free_slots(
        bits in prop_oneof![Just(64u64), Just(200), Just(512)],
        slots in 3u32..7,
        steps in proptest::collection::vec(step(2), 1..300),
    ) {
        let mut run = Run::new(bits, slots, 2);
        for s in &steps {
            run.apply(s)?;
        }
        run.finish()?;
    }
}
