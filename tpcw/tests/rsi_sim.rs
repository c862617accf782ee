//! TPC-W on RSI over an embedded sim cluster: load, every mix, and the checks.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tpcw::interactions::{Interaction, Mix};
use tpcw::rsi::{Room, Rsi, RsiEngine, RsiTxn};
use tpcw::runner::{self, Ledger, RunConfig};
use tpcw::schema::{Rel, Scale};
use tpcw::system::{AbortReason, ClientFuture, Committed, Engine, Error, Result, Session, System};
use txn::{Database, Options};

fn system(scale: &Scale, seconds: f64) -> Rsi {
    system_with(scale, seconds, &|_| None)
}

/// [`system`] with the versions of some relations overridden.
fn system_with(scale: &Scale, seconds: f64, versions: &dyn Fn(Rel) -> Option<u32>) -> Rsi {
    let rsi = unloaded(scale, seconds, versions);
    let loaded = std::sync::Mutex::new(std::collections::BTreeMap::new());
    rsi.load(scale, &|rel, done, total| {
        loaded.lock().unwrap().insert(rel, (done, total));
    })
    .unwrap();
    let loaded = loaded.into_inner().unwrap();
    assert_eq!(loaded[&Rel::Item], (scale.items, scale.items));
    assert_eq!(loaded[&Rel::Orders], (scale.orders(), scale.orders()));
    rsi
}

/// [`system_with`]'s tables, created and empty.
fn unloaded(scale: &Scale, seconds: f64, versions: &dyn Fn(Rel) -> Option<u32>) -> Rsi {
    unloaded_with_lease(scale, seconds, versions, tpcw::rsi::BENCHMARK_LEASE)
}

/// [`unloaded`] with workers' oracle lease `lease`.
fn unloaded_with_lease(
    scale: &Scale,
    seconds: f64,
    versions: &dyn Fn(Rel) -> Option<u32>,
    lease: Duration,
) -> Rsi {
    // Room for every mix the tests run: checkout makes the most orders, the ordering
    // mix the most of the rest.
    let (checkout, ordering) = (
        Room::for_runs(Mix::Checkout, seconds, 200_000.0, 64),
        Room::for_runs(Mix::Ordering, seconds, 200_000.0, 64),
    );
    let room = Room {
        orders: checkout.orders.max(ordering.orders),
        order_lines: checkout.order_lines.max(ordering.order_lines),
        cc_xacts: checkout.cc_xacts.max(ordering.cc_xacts),
        customers: checkout.customers.max(ordering.customers),
        carts: checkout.carts.max(ordering.carts),
    };
    let bytes = tpcw::rsi::bytes_needed_with(scale, &room, 2, versions).unwrap();
    let scratch_bytes = tpcw::rsi::scratch_bytes_with(scale, &room, 2, versions).unwrap();
    let db = Database::embedded(Options {
        servers: 2,
        server_bytes: bytes / 2 + bytes / 4 + (32 << 20),
        slots: 8,
        scratch_bytes,
        log_bytes_per_slot: scratch_bytes.max(Options::default().log_bytes_per_slot),
        // As `namdb tpcw` runs, unless a test wants its workers fenced sooner.
        oracle: {
            let mut oracle = Options::default().oracle;
            oracle.lease_timeout = lease;
            oracle
        },
        ..Options::default()
    })
    .unwrap();
    let mut rsi = Rsi::new(db, "sim".into(), room, Box::new(()));
    rsi.create_tables_with(scale, versions).unwrap();
    rsi
}

fn config(mix: Mix, clients: usize) -> RunConfig {
    RunConfig {
        mix,
        clients,
        threads: 2,
        warmup: Duration::from_millis(100),
        duration: Duration::from_millis(1500),
        sample_every: 7,
        progress: false,
        seed: 42,
        stop_below_available: 0,
        stop_below_free_disk: None,
        unknown_outcome_patience: runner::UNKNOWN_OUTCOME_PATIENCE,
    }
}

#[test]
fn every_mix_runs_and_passes_the_checks() {
    // Runs of a mix follow each other, each checked on its own, until the mix has
    // committed 50 and run 8 kinds of interaction: a single 1.5 s run committed 39 with
    // 8 test binaries running on two cores.
    const MAX_RUNS: usize = 20;
    let scale = Scale::new(1000, 1, 1024).unwrap();
    let rsi = system(&scale, 8.0);
    let mut ledger = Ledger::default();
    let mut streams = 0;
    for (mix, clients) in [
        (Mix::Checkout, 8),
        (Mix::Ordering, 6),
        (Mix::Shopping, 4),
        (Mix::Browsing, 4),
    ] {
        let (mut committed, mut history_txns, mut runs) = (0, 0, 0);
        let mut kinds = std::collections::BTreeSet::new();
        while committed <= 50 || history_txns <= 10 || (mix != Mix::Checkout && kinds.len() < 8) {
            assert!(
                runs < MAX_RUNS,
                "{mix:?}: {committed} committed, {history_txns} in the history, {kinds:?} \
                 in {runs} runs"
            );
            let report = runner::run(&rsi, &scale, &config(mix, clients), &mut ledger).unwrap();
            runs += 1;
            streams += clients;
            committed += report.committed;
            history_txns += report.checks.history_txns;
            kinds.extend(report.interactions.iter().map(|i| i.interaction));
            assert!(report.checks.stock_conserved, "{report:?}");
            assert!(report.checks.orders_present, "{report:?}");
            assert_eq!(
                report.checks.history_verdict.as_deref(),
                Some("valid"),
                "{report:?}"
            );
            assert!(report.checks.items_checked > 0);
            if mix == Mix::Checkout {
                assert_eq!(report.interactions.len(), 1);
                assert_eq!(report.interactions[0].interaction, Interaction::Checkout);
            }
        }
        if mix == Mix::Checkout {
            // 1000 items, 3 per checkout: the stock rule restocks many times.
            assert!(ledger.sold.values().any(|&(_, restocks)| restocks > 0));
        }
    }
    // Each run took new client streams.
    assert_eq!(ledger.orders.len(), streams);
}

/// Admin Confirm rewrites an item row with its stock unchanged: a new version of the
/// stock register, which the history must hold, or the next read of the item names a
/// version the checker never saw and the run fails as `wrong-version`. Every item is
/// sampled, so each Admin Confirm rewrites a sampled item. It is about 0.1% of the
/// ordering mix, and one run of 1.5 s on a loaded machine once held none; a rewrite
/// late in a run may not be read again in it, either. So runs follow each other
/// (each checked on its own) until ten (`ADMIN_CONFIRMS`) have committed: with the
/// rewrites left out of the history, every one of six such tests failed.
#[test]
fn admin_confirm_rewrites_are_in_the_checked_history() {
    const ADMIN_CONFIRMS: u64 = 10;
    // Far more than it takes even on a loaded machine (a run commits about one Admin
    // Confirm per thousand interactions: two runs on an idle machine, about seven
    // beside six busy loops on two cores), and `system`'s room (for 200 000
    // interactions a second) holds them all.
    const MAX_RUNS: usize = 40;
    let scale = Scale::new(1000, 1, 1024).unwrap();
    let rsi = system(&scale, 2.0);
    let config = RunConfig {
        sample_every: 1,
        ..config(Mix::Ordering, 8)
    };
    let mut ledger = Ledger::default();
    let (mut admin_confirms, mut runs) = (0, 0);
    while admin_confirms < ADMIN_CONFIRMS {
        assert!(
            runs < MAX_RUNS,
            "{admin_confirms} Admin Confirms committed in {runs} runs"
        );
        let report = runner::run(&rsi, &scale, &config, &mut ledger).unwrap();
        runs += 1;
        admin_confirms += report
            .interactions
            .iter()
            .find(|i| i.interaction == Interaction::AdminConfirm)
            .map_or(0, |i| i.committed);
        assert_eq!(
            report.checks.history_verdict.as_deref(),
            Some("valid"),
            "run {runs}: {report:?}"
        );
    }
}

/// Admin Confirm and Best Sellers find each stream's newest order by probing ids that
/// may not exist yet, so an order inserted after a reader's snapshot must read as
/// absent there. With one version per ORDERS block the insert cannot say "absent
/// before", the probe aborts with `SnapshotTooOld`, and under the ordering mix Admin
/// Confirm aborted 99% of its attempts, retrying for up to a second.
#[test]
fn an_order_inserted_after_a_snapshot_reads_as_absent_in_it() {
    let scale = Scale::new(1000, 1, 1024).unwrap();
    let rsi = system(&scale, 1.0);
    let orders = &rsi.tables()[Rel::Orders.index()];
    let (mut reader, mut writer) = (
        rsi.database().client().unwrap(),
        rsi.database().client().unwrap(),
    );
    // A stream no run uses.
    let key = tpcw::schema::stream_id(1 << 20, 0);
    let mut old = reader.begin().unwrap();
    let mut insert = writer.begin().unwrap();
    insert.insert(orders, key, vec![7; 40]).unwrap();
    insert.commit().unwrap();
    assert_eq!(old.get(orders, key).unwrap(), None);
    old.commit().unwrap();
    let mut new = reader.begin().unwrap();
    assert_eq!(new.get(orders, key).unwrap(), Some(vec![7; 40]));
}

/// With 16 KiB items a Buy Confirm of a full cart writes more than txn's default
/// buffer and commit-log area hold; `rsi::scratch_bytes` sizes both for it. In a debug
/// build beside another test this run also used to never end: every client that found
/// no best-seller lists computed them, the attempts slowed each other down until none
/// finished before a checkout updated an item it had read (`SnapshotTooOld`).
#[test]
fn the_ordering_mix_runs_with_the_largest_items() {
    let scale = Scale::new(1000, 1, 16_384).unwrap();
    let rsi = system(&scale, 3.0);
    let mut ledger = Ledger::default();
    let config = RunConfig {
        duration: Duration::from_millis(2500),
        ..config(Mix::Ordering, 32)
    };
    let report = runner::run(&rsi, &scale, &config, &mut ledger).unwrap();
    assert!(report.committed > 50, "{report:?}");
    assert!(report.checks.stock_conserved, "{report:?}");
}

/// A fault a test injects into RSI's reads of ITEM.
#[derive(Clone, Copy)]
enum Fault {
    /// Reads of more than 50 items in a transaction that read order lines (only
    /// computing the best-seller lists makes them) take 50 ms, so clients that
    /// compute the lists overlap.
    SlowBestSellerLists,
    /// Writes of items (a client's; the runner's checks only read) wait 5 ms, then
    /// abort as a conflict.
    ItemWritesConflict,
    /// Commits wait 20 ms first: a slow system, whose clients commit a few times each.
    SlowCommits,
    /// Of every three commits, one commits and one aborts, both answering that the
    /// outcome is unknown (as a worker fenced under load does), and one commits.
    UnknownCommits,
    /// Commit number `nth` (of any thread) stalls its thread at crash point `point`
    /// until another worker has fenced its slot and recovered it, as a thread starved
    /// of CPU past its lease is: the commit then ends fenced.
    StallCommit { point: &'static str, nth: u64 },
    /// As `StallCommit`, but the recovery of the stalled commit's slot stalls too once
    /// it began (the recovering worker starved as well), until the runner has asked
    /// for the commit's outcome: the commit is undecided for as long as the runner
    /// waits.
    StallCommitAndRecovery { point: &'static str, nth: u64 },
}

/// RSI with `fault` injected; counts the calls it slowed or failed.
struct Injected<'s> {
    rsi: &'s Rsi,
    fault: Fault,
    faulted: Arc<AtomicU64>,
    /// The commit timestamp of the commit [`Fault::StallCommit`] stalled, once its
    /// slot was recovered (0 before).
    stalled: Arc<AtomicU64>,
    held: Held,
}

/// What [`Fault::StallCommitAndRecovery`] holds: the stalled recovery, until an
/// outcome is asked for; then whether it was still held when the answer came.
#[derive(Clone, Default)]
struct Held {
    hold: Arc<std::sync::Mutex<Option<txn::RecoveryHold>>>,
    cid: Arc<AtomicU64>,
    at_answer: Arc<std::sync::atomic::AtomicBool>,
}

impl<'s> Injected<'s> {
    fn new(rsi: &'s Rsi, fault: Fault) -> Self {
        Injected {
            rsi,
            fault,
            faulted: Arc::default(),
            stalled: Arc::default(),
            held: Held::default(),
        }
    }
}

struct InjectedEngine {
    engine: RsiEngine,
    fault: Fault,
    faulted: Arc<AtomicU64>,
    stalled: Arc<AtomicU64>,
    held: Held,
    db: Database,
}

struct InjectedTxn<'a> {
    txn: RsiTxn<'a>,
    fault: Fault,
    faulted: &'a AtomicU64,
    read_order_lines: bool,
}

/// Waits `time` while the thread's other coroutines run.
async fn pause(time: Duration) {
    let until = Instant::now() + time;
    while Instant::now() < until {
        txn::runtime::yield_now().await;
    }
}

impl System for Injected<'_> {
    type Engine = InjectedEngine;
    fn name(&self) -> &'static str {
        self.rsi.name()
    }
    fn backend(&self) -> String {
        self.rsi.backend()
    }
    fn engine(&self, thread: usize) -> Result<InjectedEngine> {
        Ok(InjectedEngine {
            engine: self.rsi.engine(thread)?,
            fault: self.fault,
            faulted: self.faulted.clone(),
            stalled: self.stalled.clone(),
            held: self.held.clone(),
            db: self.rsi.database().clone(),
        })
    }
    fn max_clients_per_thread(&self) -> usize {
        self.rsi.max_clients_per_thread()
    }
    fn load(&self, scale: &Scale, progress: &(dyn Fn(Rel, u64, u64) + Sync)) -> Result<()> {
        self.rsi.load(scale, progress)
    }
}

impl Engine for InjectedEngine {
    type Txn<'a> = InjectedTxn<'a>;
    async fn begin(&self, after: u64) -> Result<InjectedTxn<'_>> {
        Ok(InjectedTxn {
            txn: self.engine.begin(after).await?,
            fault: self.fault,
            faulted: &self.faulted,
            read_order_lines: false,
        })
    }
    async fn commit<'a>(&'a self, txn: InjectedTxn<'a>) -> Result<Committed> {
        if let Fault::SlowCommits = self.fault {
            self.faulted.fetch_add(1, Ordering::Relaxed);
            pause(Duration::from_millis(20)).await;
        }
        if let Fault::UnknownCommits = self.fault {
            let unknown = || Error::Unknown {
                message: "injected: the outcome is unknown".into(),
                commit: None,
            };
            match self.faulted.fetch_add(1, Ordering::Relaxed) % 3 {
                0 => {
                    self.engine.commit(txn.txn).await?;
                    return Err(unknown());
                }
                1 => {
                    self.engine.abort(txn.txn);
                    return Err(unknown());
                }
                _ => {}
            }
        }
        if let Fault::StallCommit { point, nth } = self.fault
            && self.faulted.fetch_add(1, Ordering::Relaxed) == nth
        {
            let (db, stalled) = (self.db.clone(), self.stalled.clone());
            txn::crash::stall_at_on_this_thread(
                point,
                Box::new(move |cid| {
                    db.wait_for_recovery_of(cid, Duration::from_secs(60));
                    stalled.store(cid, Ordering::Relaxed);
                }),
            )
            .unwrap();
        }
        if let Fault::StallCommitAndRecovery { point, nth } = self.fault
            && self.faulted.fetch_add(1, Ordering::Relaxed) == nth
        {
            let hold = txn::crash::starve_at_with_recovery_held_on_this_thread(
                &self.db,
                point,
                Duration::from_secs(60),
            )
            .unwrap();
            *self.held.hold.lock().unwrap() = Some(hold);
        }
        let committed = self.engine.commit(txn.txn).await;
        if let Some(hold) = self.held.hold.lock().unwrap().as_ref()
            && let Some(cid) = hold.cid()
        {
            self.held.cid.store(cid, Ordering::Relaxed);
        }
        committed
    }
    fn abort<'a>(&'a self, txn: InjectedTxn<'a>) {
        self.engine.abort(txn.txn)
    }
    async fn outcome(&self, commit: u64, patience: Duration) -> Result<Option<Committed>> {
        let answer = self.engine.outcome(commit, patience).await;
        // Released once answered, so the run's clients held up by it can end.
        if let Some(hold) = self.held.hold.lock().unwrap().take() {
            self.held
                .at_answer
                .store(hold.is_holding(), Ordering::Relaxed);
        }
        answer
    }
    fn run_clients<'a, T>(
        &'a self,
        clients: usize,
        make: impl FnMut(usize) -> ClientFuture<'a, T>,
    ) -> Vec<T> {
        self.engine.run_clients(clients, make)
    }
}

impl Session for InjectedTxn<'_> {
    async fn get(&mut self, rel: Rel, key: u64) -> Result<Option<Vec<u8>>> {
        Ok(self.get_many(rel, &[key]).await?.pop().flatten())
    }
    async fn get_many(&mut self, rel: Rel, keys: &[u64]) -> Result<Vec<Option<Vec<u8>>>> {
        self.read_order_lines |= rel == Rel::OrderLine;
        if let Fault::SlowBestSellerLists = self.fault
            && rel == Rel::Item
            && self.read_order_lines
            && keys.len() > 50
        {
            self.faulted.fetch_add(1, Ordering::Relaxed);
            pause(Duration::from_millis(50)).await;
        }
        self.txn.get_many(rel, keys).await
    }
    async fn put(&mut self, rel: Rel, key: u64, row: Vec<u8>) -> Result<()> {
        if let Fault::ItemWritesConflict = self.fault
            && rel == Rel::Item
        {
            self.faulted.fetch_add(1, Ordering::Relaxed);
            pause(Duration::from_millis(5)).await;
            return Err(Error::aborted(AbortReason::Conflict, "injected"));
        }
        self.txn.put(rel, key, row).await
    }
    async fn insert(&mut self, rel: Rel, key: u64, row: Vec<u8>) -> Result<()> {
        self.txn.insert(rel, key, row).await
    }
    async fn delete(&mut self, rel: Rel, key: u64) -> Result<()> {
        self.txn.delete(rel, key).await
    }
    async fn version(&mut self, rel: Rel, key: u64) -> Result<Option<u64>> {
        self.txn.version(rel, key).await
    }
    fn read_timestamp(&self) -> Option<u64> {
        self.txn.read_timestamp()
    }
}

/// Computing the best-seller lists reads every item sold lately: one client does it
/// before the run and (every 30 s) one at a time during it, not every client that
/// finds them missing or stale, or the attempts slow each other down until none ends.
#[test]
fn the_best_seller_lists_are_computed_once_not_by_every_client() {
    let scale = Scale::new(1000, 1, 1024).unwrap();
    let rsi = system(&scale, 2.0);
    let mut ledger = Ledger::default();
    // Orders for the lists to count.
    runner::run(&rsi, &scale, &config(Mix::Checkout, 4), &mut ledger).unwrap();
    let injected = Injected::new(&rsi, Fault::SlowBestSellerLists);
    let config = RunConfig {
        duration: Duration::from_millis(500),
        ..config(Mix::Browsing, 32)
    };
    let report = runner::run(&injected, &scale, &config, &mut ledger).unwrap();
    let best_sellers = report
        .interactions
        .iter()
        .find(|i| i.interaction == Interaction::BestSellers)
        .expect("browsing runs Best Sellers");
    assert!(best_sellers.committed > 0, "{report:?}");
    assert_eq!(injected.faulted.load(Ordering::Relaxed), 1);
}

/// A closed-loop client stops at the end of the run, even in the middle of retrying
/// an interaction that keeps aborting: the run ends on time and reports the aborts.
#[test]
fn an_interaction_that_always_aborts_does_not_hold_the_run_open() {
    let scale = Scale::new(1000, 1, 1024).unwrap();
    let rsi = system(&scale, 1.0);
    let mut ledger = Ledger::default();
    let injected = Injected::new(&rsi, Fault::ItemWritesConflict);
    let config = RunConfig {
        // Every interaction measured: none ends before the run does.
        warmup: Duration::ZERO,
        duration: Duration::from_millis(300),
        ..config(Mix::Checkout, 4)
    };
    // Before the run's end stopped retries, each client retried 10 000 times (50 s)
    // and the run failed with "aborted 10000 times in a row".
    let report = runner::run(&injected, &scale, &config, &mut ledger).unwrap();
    assert_eq!(report.committed, 0, "{report:?}");
    assert!(report.aborted > 0, "{report:?}");
    assert_eq!(
        report.aborts.get(&AbortReason::Conflict),
        Some(&report.aborted)
    );
    assert!(report.checks.stock_conserved, "{report:?}");
    assert!(injected.faulted.load(Ordering::Relaxed) < 10_000);
}

/// The progress lines count every commit and abort at once. Clients used to publish
/// their counts every 256 commits, so the lines of a slow system (PostgreSQL, tcp,
/// durable) said 0 txn/s, and the warm-up's commits showed up in the first measured
/// line's rate.
#[test]
fn progress_lines_count_the_commits_of_a_slow_system() {
    let scale = Scale::new(1000, 1, 1024).unwrap();
    let rsi = system(&scale, 1.0);
    let injected = Injected::new(&rsi, Fault::SlowCommits);
    let config = RunConfig {
        warmup: Duration::from_millis(400),
        duration: Duration::from_millis(300),
        ..config(Mix::Checkout, 4)
    };
    let mut lines = Vec::new();
    let report = runner::run_observed(
        &injected,
        &scale,
        &config,
        &mut Ledger::default(),
        &Default::default(),
        &mut |line| lines.push(line.clone()),
    )
    .unwrap();
    let warmup = lines
        .iter()
        .find(|l| l.warmup)
        .unwrap_or_else(|| panic!("no warm-up line: {lines:?}"));
    assert!(warmup.committed > 0, "{lines:?}");
    // The clients committed a few times each, far from 256.
    assert!(injected.faulted.load(Ordering::Relaxed) < 256, "{report:?}");
}

/// A loader's commit of unknown outcome (its worker fenced: under 4x load a loader
/// thread starved past its lease, and the load failed) is tried again, whichever way
/// recovery decided it: every row ends up loaded once.
#[test]
fn a_load_goes_on_past_commits_of_unknown_outcome() {
    let scale = Scale::new(1000, 1, 1024).unwrap();
    let rsi = unloaded(&scale, 1.0, &|_| None);
    let injected = Injected::new(&rsi, Fault::UnknownCommits);
    let loaded = std::sync::Mutex::new(std::collections::BTreeMap::new());
    tpcw::load::load_through_transactions(&injected, &scale, 2, 8, &|rel, done, total| {
        loaded.lock().unwrap().insert(rel, (done, total));
    })
    .unwrap();
    assert!(injected.faulted.load(Ordering::Relaxed) > 30);
    let loaded = loaded.into_inner().unwrap();
    assert_eq!(loaded[&Rel::Item], (scale.items, scale.items));
    assert_eq!(loaded[&Rel::Orders], (scale.orders(), scale.orders()));
    let mut client = rsi.database().client().unwrap();
    let mut t = client.begin().unwrap();
    for (rel, last) in [(Rel::Item, scale.items), (Rel::Orders, scale.orders())] {
        let table = &rsi.tables()[rel.index()];
        for key in 1..=last {
            assert!(t.get(table, key).unwrap().is_some(), "{rel:?} {key}");
        }
    }
    // The run's checks read every relation the loader wrote.
    let report = runner::run(
        &rsi,
        &scale,
        &config(Mix::Checkout, 4),
        &mut Ledger::default(),
    )
    .unwrap();
    assert!(report.checks.stock_conserved, "{report:?}");
    assert!(report.checks.orders_present, "{report:?}");
}

/// A client whose commit ends fenced (its thread starved past the oracle lease, so
/// another worker fenced its slot and recovery decided the commit) does not end the
/// run: the runner waits for recovery's decision and counts the checkout as what it
/// was. Stalled after its log record, the checkout committed: its sales and order are
/// in the ledger, and it is in the history with its commit timestamp (other clients
/// read its stocks). Stalled before, it was rolled back: an abort, retried with the
/// same order id. The same under the ordering mix, whichever writer is stalled. Before,
/// every one of these runs failed with the worker's "commit … abandoned" error.
#[test]
fn a_commit_fenced_under_a_starved_client_is_resolved_and_the_run_goes_on() {
    let scale = Scale::new(1000, 1, 1024).unwrap();
    // A short lease, so the stall is short; the fence is what the test waits for.
    let rsi = unloaded_with_lease(&scale, 4.0, &|_| None, Duration::from_millis(500));
    rsi.load(&scale, &|_, _, _| {}).unwrap();
    let mut ledger = Ledger::default();
    // The ordering mix's writers (Buy Confirm, Shopping Cart, Buy Request, Admin
    // Confirm) change the client's own state too (its cart, customer, id streams).
    for (mix, clients, point, committed) in [
        (Mix::Checkout, 4, "after-log", true),
        (Mix::Checkout, 4, "after-lock", false),
        (Mix::Ordering, 6, "after-log", true),
        (Mix::Ordering, 6, "after-lock", false),
    ] {
        let injected = Injected::new(&rsi, Fault::StallCommit { point, nth: 50 });
        let run = RunConfig {
            warmup: Duration::ZERO,
            // Every item sampled: the stalled commit's stocks are in the history.
            sample_every: 1,
            ..config(mix, clients)
        };
        let report = runner::run(&injected, &scale, &run, &mut ledger)
            .unwrap_or_else(|e| panic!("{mix:?} stalled at {point}: the run failed: {e}"));
        let stalled = injected.stalled.load(Ordering::Relaxed);
        assert_ne!(
            stalled, 0,
            "{mix:?} {point}: no commit was stalled: {report:?}"
        );
        let unknown = report
            .unknown_outcomes
            .unwrap_or_else(|| panic!("{mix:?} {point}: no unknown outcome reported: {report:?}"));
        // Other fences (a loaded machine, a short lease) may add to the counts.
        if committed {
            assert!(unknown.committed >= 1, "{mix:?} {point}: {report:?}");
        } else {
            assert!(unknown.rolled_back >= 1, "{mix:?} {point}: {report:?}");
            assert!(
                report.aborts.get(&AbortReason::Fenced) >= Some(&1),
                "{mix:?} {point}: {report:?}"
            );
        }
        assert!(report.committed > 0, "{mix:?} {point}: {report:?}");
        assert!(report.checks.stock_conserved, "{mix:?} {point}: {report:?}");
        assert!(report.checks.orders_present, "{mix:?} {point}: {report:?}");
        assert_eq!(
            report.checks.history_verdict.as_deref(),
            Some("valid"),
            "{mix:?} {point}: {report:?}"
        );
        let json = serde_json::to_value(&report).unwrap();
        assert!(json["unknown_outcomes"].is_object(), "{json}");
    }
    assert!(rsi.database().locked_records().unwrap().is_empty());
}

/// A client whose commit ends fenced while the recovery of its slot stalls too (the
/// recovering worker starved as well) cannot learn the outcome within the runner's
/// patience: the run fails saying so, naming the commit, rather than wait on, count
/// the commit as either outcome, or panic; the failed run counts nothing in the
/// ledger; released, the recovery decides the commit and leaves no lock.
#[test]
fn a_run_fails_when_a_fenced_commits_outcome_is_not_learnt_in_time() {
    let scale = Scale::new(1000, 1, 1024).unwrap();
    let rsi = unloaded_with_lease(&scale, 4.0, &|_| None, Duration::from_millis(500));
    rsi.load(&scale, &|_, _, _| {}).unwrap();
    let mut ledger = Ledger::default();
    let first = runner::run(&rsi, &scale, &config(Mix::Checkout, 4), &mut ledger).unwrap();
    assert!(first.checks_passed(), "{first:?}");
    let (sold, orders) = (ledger.sold.clone(), ledger.orders.clone());
    let injected = Injected::new(
        &rsi,
        Fault::StallCommitAndRecovery {
            point: "after-log",
            nth: 10,
        },
    );
    let run = RunConfig {
        warmup: Duration::ZERO,
        // Well short of `txn::recovery::TAKEOVER`: a runner that waited on for the
        // recovery would take it over and learn what it decided.
        unknown_outcome_patience: Duration::from_secs(1),
        // One client per thread: another client of the stalled worker would commit,
        // rejoin the oracle, maybe in the fenced slot, and then wait for (and take
        // over) its recovery, blocking the thread, so the outcome would be learnt.
        ..config(Mix::Checkout, 2)
    };
    let err = match runner::run(&injected, &scale, &run, &mut ledger) {
        Ok(report) => panic!(
            "the run went on (stalled commit {}, held at the answer: {}): {report:?}",
            injected.held.cid.load(Ordering::Relaxed),
            injected.held.at_answer.load(Ordering::Relaxed)
        ),
        Err(e) => e,
    };
    let cid = injected.held.cid.load(Ordering::Relaxed);
    assert_ne!(cid, 0, "no commit stalled: {err}");
    let err = err.to_string();
    assert!(
        err.contains("commit's outcome is unknown") && err.contains("could not be learnt"),
        "{err}"
    );
    assert!(
        err.contains(&format!("the outcome of commit {cid} is still unknown")),
        "{err}"
    );
    assert!(
        injected.held.at_answer.load(Ordering::Relaxed),
        "the recovery was taken over before the runner gave up: {err}"
    );
    assert_eq!((ledger.sold, ledger.orders), (sold, orders));
    let db = rsi.database();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !db.locked_records().unwrap().is_empty() {
        assert!(Instant::now() < deadline, "the recovery never finished");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A run that finds the host low on memory stops its clients and reports what it
/// measured, checked, rather than grow until the OOM killer ends the process.
#[test]
fn a_run_stops_early_when_the_host_runs_low_on_memory() {
    let scale = Scale::new(1000, 1, 1024).unwrap();
    let rsi = system(&scale, 1.0);
    let mut ledger = Ledger::default();
    // More than any host has: the first look stops the run.
    let low = RunConfig {
        stop_below_available: u64::MAX,
        warmup: Duration::ZERO,
        duration: Duration::from_secs(60),
        ..config(Mix::Checkout, 4)
    };
    let report = runner::run(&rsi, &scale, &low, &mut ledger).unwrap();
    let why = report.stopped_early.as_deref().expect("stopped early");
    assert!(why.contains("low on memory"), "{why}");
    assert!(report.seconds < 60.0, "{report:?}");
    assert!(report.checks.stock_conserved && report.checks.orders_present);
    // Stopped in the warm-up, it measured nothing: an error that says so.
    let err = runner::run(
        &rsi,
        &scale,
        &RunConfig {
            warmup: Duration::from_secs(60),
            ..low
        },
        &mut ledger,
    )
    .unwrap_err();
    assert!(err.to_string().contains("warm-up"), "{err}");
    // The next run, with room to spare, runs its whole duration.
    let report = runner::run(&rsi, &scale, &config(Mix::Checkout, 4), &mut ledger).unwrap();
    assert_eq!(report.stopped_early, None);
    assert!(report.committed > 0);
}

/// A run whose database's disk runs low stops its clients and reports what it
/// measured, checked, as one low on memory does, rather than run on into a full disk
/// (PostgreSQL's tables grow with every order; `namdb tpcw` watches its directory).
#[test]
fn a_run_stops_early_when_the_database_disk_runs_low() {
    let scale = Scale::new(1000, 1, 1024).unwrap();
    let rsi = system(&scale, 1.0);
    let mut ledger = Ledger::default();
    let dir = tempfile::tempdir().unwrap();
    // More than any disk has: the first look stops the run.
    let low = RunConfig {
        stop_below_free_disk: Some(runner::DiskFloor {
            dir: dir.path().to_path_buf(),
            bytes: u64::MAX,
        }),
        warmup: Duration::ZERO,
        duration: Duration::from_secs(60),
        ..config(Mix::Checkout, 4)
    };
    let report = runner::run(&rsi, &scale, &low, &mut ledger).unwrap();
    let why = report.stopped_early.as_deref().expect("stopped early");
    assert!(
        why.contains("the disk of") && why.contains("ran low"),
        "{why}"
    );
    assert!(why.contains(&dir.path().display().to_string()), "{why}");
    assert!(report.seconds < 60.0, "{report:?}");
    assert!(report.checks.stock_conserved && report.checks.orders_present);
    // Only what finished before the stop counts, as the rate divides by the time up
    // to it: commits in flight at the stop made this run report millions per second.
    // (No debug build commits checkouts at 1 M/s; a slower machine only lowers it.)
    assert!(report.txn_per_sec < 1e6, "{report:?}");
    // A floor the disk clears lets the run take its whole duration.
    let roomy = RunConfig {
        stop_below_free_disk: Some(runner::DiskFloor {
            dir: dir.path().to_path_buf(),
            bytes: 1,
        }),
        ..config(Mix::Checkout, 4)
    };
    let report = runner::run(&rsi, &scale, &roomy, &mut ledger).unwrap();
    assert_eq!(report.stopped_early, None);
    assert!(report.committed > 0);
}

/// A run stopped early counts the interactions that finished before the stop, not
/// those in flight then: its rate divides by the time up to the stop. A run stopped at
/// its first look once reported 2.35 M txn/s from two commits that finished after it.
#[test]
fn a_run_stopped_early_counts_only_what_finished_before_the_stop() {
    let scale = Scale::new(1000, 1, 1024).unwrap();
    let rsi = system(&scale, 2.0);
    let dir = tempfile::tempdir().unwrap();
    // A filesystem that cannot be looked at is let through: the floor is breached
    // only once this directory exists, made at the first progress line that counts
    // commits, while every client is in the middle of a checkout.
    let appears = dir.path().join("appears");
    let run = RunConfig {
        stop_below_free_disk: Some(runner::DiskFloor {
            dir: appears.clone(),
            bytes: u64::MAX,
        }),
        warmup: Duration::ZERO,
        duration: Duration::from_secs(60),
        threads: 1,
        sample_every: 0,
        ..config(Mix::Checkout, 4)
    };
    let mut ledger = Ledger::default();
    let report = runner::run_observed(
        &rsi,
        &scale,
        &run,
        &mut ledger,
        &Default::default(),
        &mut |line| {
            if line.committed > 0 && !appears.exists() {
                std::fs::create_dir(&appears).unwrap();
            }
        },
    )
    .unwrap();
    assert!(report.stopped_early.is_some(), "{report:?}");
    assert!(report.checks.stock_conserved && report.checks.orders_present);
    // Every checkout that committed made one order, the ones that finished after
    // the stop included; the report counts only those before it.
    let orders: u64 = ledger.orders.iter().sum();
    assert!(report.committed > 0, "{report:?}");
    assert!(
        report.committed < orders,
        "{} counted of {orders} committed: the checkouts in flight at the stop were \
         counted",
        report.committed
    );
}

/// ITEM keeps the paper's one version unless asked (`namdb tpcw --item-versions`): a
/// snapshot older than an item's latest update then aborts, and with two it reads the
/// version before. (With 10 000 items the ordering mix aborted 5.3% of its
/// interactions as too old with one version, 0.7% with two.)
#[test]
fn a_second_item_version_serves_a_snapshot_older_than_the_update() {
    let scale = Scale::new(1000, 1, 1024).unwrap();
    for versions in [1, 2] {
        let rsi = system_with(&scale, 1.0, &|rel| (rel == Rel::Item).then_some(versions));
        let items = &rsi.tables()[Rel::Item.index()];
        let (mut reader, mut writer) = (
            rsi.database().client().unwrap(),
            rsi.database().client().unwrap(),
        );
        let mut fresh = reader.begin().unwrap();
        let before = fresh.get(items, 7).unwrap().expect("item 7 is loaded");
        fresh.commit().unwrap();
        let mut old = reader.begin().unwrap();
        let mut update = writer.begin().unwrap();
        let mut row = before.clone();
        tpcw::schema::Item::set_stock(&mut row, 1234).unwrap();
        update.put(items, 7, row).unwrap();
        update.commit().unwrap();
        match (versions, old.get(items, 7)) {
            (1, Err(txn::TxnError::SnapshotTooOld { .. })) => {}
            (2, Ok(Some(seen))) => assert_eq!(seen, before),
            (v, other) => panic!("{v} versions: {other:?}"),
        }
    }
}
