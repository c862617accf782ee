//! The runner: closed-loop clients (threads × clients per thread) run a mix against a
//! [`System`] for a warm-up and a measured duration; then the run is checked.
//!
//! - An interaction that aborts is retried until it commits (as a browser would
//!   resubmit) or the run ends; every abort is counted by reason. Latency is from the
//!   first attempt's begin to the commit.
//! - A commit of unknown outcome (its worker fenced: a thread starved past its lease)
//!   waits until recovery has decided it and then counts as what it was, a commit or
//!   an abort ([`AbortReason::Fenced`], retried); [`RunReport::unknown_outcomes`]
//!   says how many there were.
//! - Mixes with Best Sellers compute its lists once before the clients start; during
//!   the run one client at a time refreshes them when they are 30 s old
//!   ([`interactions::prime_best_sellers`]).
//! - Live progress goes to stderr once a second.
//! - Checks after every run: stock conservation (for every item sold since the load:
//!   generated stock − quantity sold + 21 × restocks = stock now, using the tallies
//!   of committed interactions — see [`Ledger`]), every acknowledged order present
//!   (each client's order stream holds exactly the orders it committed), and, when
//!   a sample is recorded, the snapshot-isolation checker on the history of the
//!   sampled items' stocks.

use crate::generate;
use crate::htap::Phase;
use crate::interactions::{self, Client, Effects, Interaction, Mix, Shared};
use crate::schema::{Item, Rel, Scale, stream_id};
use crate::system::{AbortReason, Committed, Engine, Error, Result, Session, System};
use hdrhistogram::Histogram;
use rand::SeedableRng;
use rand::rngs::SmallRng;
use serde::Serialize;
use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Barrier, Condvar, Mutex};
use std::time::{Duration, Instant};
use verify::history::{JsonlWriter, ReadValue};
use verify::recorder::{Recorder, TxnRecord};

#[derive(Clone, Debug)]
pub struct RunConfig {
    pub mix: Mix,
    /// Closed-loop clients in all.
    pub clients: usize,
    /// Threads they run on (systems whose calls block get one thread per client).
    pub threads: usize,
    pub warmup: Duration,
    pub duration: Duration,
    /// Record the stocks of items whose id is a multiple of this (0: no history).
    pub sample_every: u64,
    /// Print progress to stderr.
    pub progress: bool,
    pub seed: u64,
    /// Stop the run early, and report what it measured, when the host's available
    /// memory falls below this many bytes (0: never; [`memory_floor`] is a sensible
    /// floor). RSI's tables grow with every order, and the OOM killer would take the
    /// whole process, results and all.
    pub stop_below_available: u64,
    /// Stop the run early, and report what it measured, when the filesystem of this
    /// directory has fewer free bytes than this: a scratch PostgreSQL's database grows
    /// with every order, and a full disk stops the server mid-run.
    pub stop_below_free_disk: Option<DiskFloor>,
    /// How long a client waits to learn what became of a commit of unknown outcome
    /// before the run fails saying it could not ([`UNKNOWN_OUTCOME_PATIENCE`]; shorter
    /// only in tests of that failure).
    pub unknown_outcome_patience: Duration,
}

/// A directory whose filesystem must keep `bytes` free while a run goes on.
#[derive(Clone, Debug)]
pub struct DiskFloor {
    pub dir: std::path::PathBuf,
    pub bytes: u64,
}

impl DiskFloor {
    /// Why the run must stop, if the filesystem has fewer than `bytes` free now. A
    /// filesystem that cannot say is let through, as a host without /proc/meminfo is.
    fn breached(&self) -> Option<String> {
        let fs = rustix::fs::statvfs(&self.dir).ok()?;
        let free = fs.f_bavail.saturating_mul(fs.f_frsize);
        (free < self.bytes).then(|| {
            format!(
                "the disk of {} ran low ({} MiB free, the run stops below {} MiB)",
                self.dir.display(),
                free >> 20,
                self.bytes >> 20
            )
        })
    }
}

/// What the runs against one database have done since its load: the sales of committed
/// interactions per item, and the id streams used (each run takes new ones).
#[derive(Default)]
pub struct Ledger {
    /// Item → (quantity sold, restocks).
    pub sold: HashMap<u64, (i64, i64)>,
    /// Orders committed per stream.
    pub orders: Vec<u64>,
}

#[derive(Clone, Debug, Serialize)]
pub struct InteractionReport {
    pub interaction: Interaction,
    pub committed: u64,
    pub aborted: u64,
    pub txn_per_sec: f64,
    /// None (null) when the interaction never committed in the measured time: a
    /// latency of 0.0 µs read as instant commits.
    pub p50_us: Option<f64>,
    pub p99_us: Option<f64>,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct Checks {
    /// Items whose stock was checked (every item sold so far).
    pub items_checked: u64,
    pub stock_conserved: bool,
    /// Orders acknowledged so far, all found.
    pub orders_checked: u64,
    pub orders_present: bool,
    /// Transactions in the recorded sample, and the checker's verdict on them.
    pub history_txns: u64,
    pub history_verdict: Option<String>,
}

#[derive(Clone, Debug, Serialize)]
pub struct RunReport {
    pub system: String,
    pub backend: String,
    pub mix: Mix,
    pub clients: usize,
    pub threads: usize,
    pub seconds: f64,
    pub committed: u64,
    pub aborted: u64,
    pub txn_per_sec: f64,
    pub abort_rate: f64,
    pub aborts: BTreeMap<AbortReason, u64>,
    /// None (null) when nothing committed in the measured time.
    pub p50_us: Option<f64>,
    pub p99_us: Option<f64>,
    pub p999_us: Option<f64>,
    pub interactions: Vec<InteractionReport>,
    pub checks: Checks,
    /// Why the run stopped before its duration (`seconds` is then what it measured).
    pub stopped_early: Option<String>,
    /// Which of an HTAP run's two runs this is (set by the caller that runs both).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub phase: Option<Phase>,
    /// Commits whose outcome was unknown (the client's worker fenced under them) and
    /// was learnt after recovery decided it; absent when there were none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unknown_outcomes: Option<UnknownOutcomes>,
    /// Whether the memory servers' memory was all backed before the run (set by the
    /// caller that started them; absent for systems without memory servers).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pinned_memory: Option<bool>,
}

/// Commits of unknown outcome ([`Error::Unknown`]) a run learnt the outcome of, over
/// the whole run (warm-up included, unlike the other counts: each is a fence, worth
/// knowing about wherever it fell).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct UnknownOutcomes {
    /// Found committed: counted, in the measured period, as commits.
    pub committed: u64,
    /// Found rolled back: counted, in the measured period, as aborts
    /// ([`AbortReason::Fenced`]), and retried.
    pub rolled_back: u64,
}

impl std::fmt::Display for UnknownOutcomes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} commit(s) of unknown outcome (worker fenced) resolved: {} committed, {} \
             rolled back",
            self.committed + self.rolled_back,
            self.committed,
            self.rolled_back
        )
    }
}

impl RunReport {
    /// Whether every check passed (an inconclusive history check is not a failure).
    pub fn checks_passed(&self) -> bool {
        self.checks.stock_conserved
            && self.checks.orders_present
            && self.checks.history_verdict.as_deref() != Some("invalid")
    }
}

/// One interaction kind's counts on one thread.
struct KindTally {
    committed: u64,
    aborted: u64,
    latency_ns: Histogram<u64>,
}

struct ThreadTally {
    kinds: BTreeMap<Interaction, KindTally>,
    aborts: BTreeMap<AbortReason, u64>,
    sold: SalesTally,
    /// (stream, orders committed) of this thread's clients.
    orders: Vec<(u64, u64)>,
    /// Commits of unknown outcome learnt since the run began, warm-up included.
    unknown: UnknownOutcomes,
}

/// Item → (quantity sold, restocks) of one client thread. Updated three times a
/// checkout: a slot per item id (ids are dense, from 1), where a hash map costs two
/// cache misses per sale.
#[derive(Default)]
struct SalesTally {
    per_item: Vec<(i64, i64)>,
}

impl SalesTally {
    fn add(&mut self, item: u64, qty: i64, restocks: i64) {
        let i = item as usize;
        if i >= self.per_item.len() {
            self.per_item.resize(i + 1, (0, 0));
        }
        let e = &mut self.per_item[i];
        e.0 += qty;
        e.1 += restocks;
    }

    /// The items with sales, and their totals.
    fn iter(&self) -> impl Iterator<Item = (u64, (i64, i64))> + '_ {
        self.per_item
            .iter()
            .enumerate()
            .filter(|(_, t)| **t != (0, 0))
            .map(|(i, &t)| (i as u64, t))
    }
}

impl ThreadTally {
    fn new() -> ThreadTally {
        ThreadTally {
            kinds: BTreeMap::new(),
            aborts: BTreeMap::new(),
            sold: SalesTally::default(),
            orders: Vec::new(),
            unknown: UnknownOutcomes::default(),
        }
    }

    fn kind(&mut self, kind: Interaction) -> Result<&mut KindTally> {
        match self.kinds.entry(kind) {
            std::collections::btree_map::Entry::Occupied(e) => Ok(e.into_mut()),
            std::collections::btree_map::Entry::Vacant(e) => {
                let latency_ns = Histogram::new_with_bounds(1, 600_000_000_000, 3)
                    .map_err(|e| Error::System(format!("histogram: {e}")))?;
                Ok(e.insert(KindTally {
                    committed: 0,
                    aborted: 0,
                    latency_ns,
                }))
            }
        }
    }
}

type HistoryRecorder = Recorder<JsonlWriter<Vec<u8>>>;

/// Commits and aborts so far, warm-up included, for the progress lines.
struct Progress {
    /// One per client thread, each on its own cache line, counted at every commit and
    /// abort: one shared counter would be contended. Counts published in batches (256
    /// commits a client) left a slow run's lines at zero and put the warm-up's commits
    /// into the first measured line's rate.
    threads: Vec<ThreadCounts>,
    /// Set when the run stops before its end: clients stop at their next interaction.
    stop: AtomicBool,
}

#[derive(Default)]
#[repr(align(128))]
struct ThreadCounts {
    committed: AtomicU64,
    aborted: AtomicU64,
}

impl Progress {
    fn new(threads: usize) -> Progress {
        Progress {
            threads: (0..threads).map(|_| ThreadCounts::default()).collect(),
            stop: AtomicBool::new(false),
        }
    }

    fn committed(&self) -> u64 {
        self.threads
            .iter()
            .map(|t| t.committed.load(Ordering::Relaxed))
            .sum()
    }

    fn aborted(&self) -> u64 {
        self.threads
            .iter()
            .map(|t| t.aborted.load(Ordering::Relaxed))
            .sum()
    }
}

/// A progress line: counts since the run began, warm-up included.
#[derive(Clone, Debug)]
pub struct ProgressLine {
    /// Since the clients started.
    pub at: Duration,
    /// Whether the line covers the warm-up (it then covers nothing else).
    pub warmup: bool,
    /// Commits per second since the previous line.
    pub rate: f64,
    pub committed: u64,
    pub aborted: u64,
}

impl std::fmt::Display for ProgressLine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "  {:5.1} s{}  {:>10.0} txn/s  committed {}  aborted {}",
            self.at.as_secs_f64(),
            if self.warmup { " (warm-up)" } else { "" },
            self.rate,
            self.committed,
            self.aborted,
        )
    }
}

/// ITEM rows rewritten with their stock unchanged by writers beside the run's clients
/// (HTAP's related-items update). Each is a new version of the item's stock: the
/// run's history needs those of sampled items, or a later read naming that version
/// names one the history never saw (`wrong-version`).
///
/// It also tells the writers when the clients start. ITEM keeps one version, so a
/// writer that starts early rewrites the items the run's set-up reads (its Best
/// Sellers prime, the sampled stocks), and under load that set-up ran out of
/// attempts on `SnapshotTooOld`.
#[derive(Default)]
pub struct ItemRewrites {
    committed: Mutex<Vec<ItemRewrite>>,
    clients_started: Mutex<Option<Instant>>,
    clients_started_changed: Condvar,
}

/// One committed rewrite of an item row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ItemRewrite {
    pub item: u64,
    /// The stock the row kept.
    pub stock: i32,
    /// The snapshot the writer read the row at, and its commit timestamp.
    pub rid: u64,
    pub cid: u64,
}

impl ItemRewrites {
    pub fn push(&self, rewrite: ItemRewrite) {
        self.committed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(rewrite);
    }

    /// How many rewrites have committed so far.
    pub fn committed(&self) -> usize {
        self.committed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .len()
    }

    /// Waits until the clients of the run beside have started, and returns when they
    /// did; `None` once `stop` is set first (the run failed in its set-up).
    pub fn wait_for_clients(&self, stop: &AtomicBool) -> Option<Instant> {
        let mut started = self
            .clients_started
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(at) = *started {
                return Some(at);
            }
            if stop.load(Ordering::Relaxed) {
                return None;
            }
            // `stop` is set without this lock: look at it again now and then.
            started = self
                .clients_started_changed
                .wait_timeout(started, Duration::from_millis(20))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Tells the writers beside that the clients started at `at` (the runner does, once
    /// its set-up is done).
    pub fn clients_started(&self, at: Instant) {
        *self
            .clients_started
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(at);
        self.clients_started_changed.notify_all();
    }

    fn snapshot(&self) -> Vec<ItemRewrite> {
        self.committed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

/// The history session of the rewrites beside a run: one writer, one after another.
const REWRITER_SESSION: u64 = u64::MAX - 1;

/// Runs `config` on `system` (loaded at `scale`), then checks the database.
pub fn run<S: System>(
    system: &S,
    scale: &Scale,
    config: &RunConfig,
    ledger: &mut Ledger,
) -> Result<RunReport> {
    run_beside(system, scale, config, ledger, &ItemRewrites::default())
}

/// [`run`] beside a writer that rewrites ITEM rows and logs them in `rewrites`.
pub fn run_beside<S: System>(
    system: &S,
    scale: &Scale,
    config: &RunConfig,
    ledger: &mut Ledger,
    rewrites: &ItemRewrites,
) -> Result<RunReport> {
    let mut print = |line: &ProgressLine| {
        if config.progress {
            eprintln!("{line}");
        }
    };
    run_observed(system, scale, config, ledger, rewrites, &mut print)
}

/// [`run_beside`], handing each progress line to `on_line` (whatever
/// [`RunConfig::progress`] says) instead of printing it.
pub fn run_observed<S: System>(
    system: &S,
    scale: &Scale,
    config: &RunConfig,
    ledger: &mut Ledger,
    rewrites: &ItemRewrites,
    on_line: &mut dyn FnMut(&ProgressLine),
) -> Result<RunReport> {
    if config.clients == 0 {
        return Err(Error::System("a run needs at least one client".into()));
    }
    let per_thread_max = system.max_clients_per_thread().max(1);
    let threads = config
        .threads
        .max(config.clients.div_ceil(per_thread_max))
        .min(config.clients);
    let first_stream = ledger.orders.len() as u64;
    let streams = first_stream + config.clients as u64;
    let shared = Shared::new(*scale, streams, config.sample_every);
    let recorder = (config.sample_every > 0).then(|| Recorder::new(JsonlWriter::new(Vec::new())));
    let initial_rid = match &recorder {
        Some(rec) => record_initial_stocks(system, scale, config.sample_every, rec)?,
        None => None,
    };
    let primes_best_sellers = config
        .mix
        .weights()
        .iter()
        .any(|&(i, w)| i == Interaction::BestSellers && w > 0.0);
    let progress = Progress::new(threads);
    // Set before the clients start: with no warm-up their first interactions count.
    let measuring = AtomicBool::new(config.warmup.is_zero());
    let barrier = Barrier::new(threads + 1);
    let started = Mutex::new(None::<Instant>);
    let mut stopped = None;
    let tallies: Vec<Result<ThreadTally>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let (shared, recorder, progress, barrier, measuring) =
                    (&shared, recorder.as_ref(), &progress, &barrier, &measuring);
                let clients = config.clients / threads + usize::from(t < config.clients % threads);
                // Client c of thread t: a global index, its stream after the earlier runs'.
                let first_client: usize = (0..t)
                    .map(|u| config.clients / threads + usize::from(u < config.clients % threads))
                    .sum();
                s.spawn(move || {
                    let engine = system.engine(t).and_then(|engine| {
                        if t == 0 && primes_best_sellers {
                            prime_best_sellers(&engine, shared)?;
                        }
                        Ok(engine)
                    });
                    barrier.wait();
                    let engine = engine?;
                    let start = Instant::now();
                    let tally = RefCell::new(ThreadTally::new());
                    let outcomes = engine.run_clients(clients, |c| {
                        let client_index = (first_client + c) as u64;
                        let (engine, tally) = (&engine, &tally);
                        Box::pin(async move {
                            let stream = first_stream + client_index;
                            let rng = SmallRng::seed_from_u64(
                                config.seed ^ stream.wrapping_mul(0x9e37_79b9_7f4a_7c15),
                            );
                            let mut client = Client::new(stream, &shared.scale, rng);
                            let outcome = client_loop(
                                engine,
                                &mut client,
                                shared,
                                config,
                                start,
                                tally,
                                recorder,
                                progress,
                                &progress.threads[t],
                                measuring,
                            )
                            .await;
                            tally.borrow_mut().orders.push((stream, client.next_order));
                            outcome
                        })
                    });
                    for o in outcomes {
                        o?;
                    }
                    Ok(tally.into_inner())
                })
            })
            .collect();
        barrier.wait();
        let now = Instant::now();
        *started.lock().unwrap_or_else(|e| e.into_inner()) = Some(now);
        rewrites.clients_started(now);
        stopped = watch(config, &progress, &measuring, on_line);
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(Error::System("a client thread panicked".into())))
            })
            .collect()
    });
    let mut merged = ThreadTally::new();
    let mut first_error = None;
    for t in tallies {
        match t {
            Ok(t) => merge(&mut merged, t)?,
            Err(e) => {
                first_error.get_or_insert(e);
            }
        }
    }
    if let Some(e) = first_error {
        return Err(e);
    }
    for (item, (qty, restocks)) in merged.sold.iter() {
        let entry = ledger.sold.entry(item).or_default();
        entry.0 += qty;
        entry.1 += restocks;
    }
    ledger.orders.resize(streams as usize, 0);
    for &(stream, orders) in &merged.orders {
        ledger.orders[stream as usize] = orders;
    }
    let seconds = match &stopped {
        Some((measured, why)) if measured.is_zero() => {
            return Err(Error::System(format!(
                "the run stopped in its warm-up: {why}"
            )));
        }
        Some((measured, _)) => measured.as_secs_f64(),
        None => config.duration.as_secs_f64(),
    };
    let mut report = summarize(
        system.name(),
        system.backend(),
        config,
        threads,
        seconds,
        &merged,
    )?;
    report.stopped_early = stopped.map(|(measured, why)| {
        format!(
            "stopped after {:.1} s of {:.1} s: {why}",
            measured.as_secs_f64(),
            config.duration.as_secs_f64()
        )
    });
    if let Some(rec) = &recorder {
        record_rewrites(rec, rewrites, initial_rid, config.sample_every)?;
    }
    report.checks = check(system, ledger, recorder, config.progress)?;
    Ok(report)
}

/// Computes the best-seller lists the run's clients serve, before they start
/// ([`interactions::prime_best_sellers`]).
fn prime_best_sellers<E: Engine>(engine: &E, shared: &Shared) -> Result<()> {
    const ATTEMPTS: usize = 10;
    run_one(engine, async |engine: &E| {
        let mut last = None;
        for _ in 0..ATTEMPTS {
            let mut txn = engine.begin(0).await?;
            let outcome = match interactions::prime_best_sellers(&mut txn, shared).await {
                Ok(_) => engine.commit(txn).await.map(|_| ()),
                Err(e) => {
                    engine.abort(txn);
                    Err(e)
                }
            };
            match outcome {
                Err(e @ Error::Aborted { .. }) => last = Some(e),
                outcome => return outcome,
            }
        }
        Err(Error::System(format!(
            "computing the best sellers before the run aborted {ATTEMPTS} times; last: {}",
            last.expect("an abort")
        )))
    })
}

/// Below how much available memory a run on this host should stop early
/// ([`fabric::HostMemory::reserve`]: a checkout run on the sim grows by about
/// 200 MiB a second, and the checks after it need some); 0 where the host's memory
/// cannot be read.
pub fn memory_floor() -> u64 {
    fabric::HostMemory::now().map_or(0, |m| m.reserve())
}

/// Prints progress until the run ends, and flips `measuring` after the warm-up.
/// Stops the run early when the host runs low on memory or the database's disk runs
/// low on space, returning how long it was measured and why.
fn watch(
    config: &RunConfig,
    progress: &Progress,
    measuring: &AtomicBool,
    on_line: &mut dyn FnMut(&ProgressLine),
) -> Option<(Duration, String)> {
    /// How often the host's memory and the database's disk are looked at: a run on
    /// the sim grows by about 200 MiB a second.
    const MEMORY_EVERY: Duration = Duration::from_millis(200);
    let start = Instant::now();
    let end = start + config.warmup + config.duration;
    let mut last = (start, 0u64);
    let mut warm = config.warmup.is_zero();
    measuring.store(warm, Ordering::Relaxed);
    loop {
        let now = Instant::now();
        if now >= end {
            return None;
        }
        if !warm && now >= start + config.warmup {
            warm = true;
            measuring.store(true, Ordering::Relaxed);
        }
        let low_memory = (config.stop_below_available > 0)
            .then(fabric::HostMemory::now)
            .flatten()
            .filter(|memory| memory.available < config.stop_below_available)
            .map(|memory| {
                format!(
                    "the host ran low on memory ({} MiB available, the run stops below {} \
                     MiB)",
                    memory.available >> 20,
                    config.stop_below_available >> 20
                )
            });
        let low = low_memory.or_else(|| {
            config
                .stop_below_free_disk
                .as_ref()
                .and_then(DiskFloor::breached)
        });
        if let Some(why) = low {
            progress.stop.store(true, Ordering::Relaxed);
            // Taken after the store: a commit the clients counted finished before it.
            let stopped = Instant::now();
            eprintln!("  {why}: stopping the clients");
            return Some((
                stopped.saturating_duration_since(start + config.warmup),
                why,
            ));
        }
        let next = (last.0 + Duration::from_secs(1))
            .min(end)
            .min(now + MEMORY_EVERY)
            .min(if warm { end } else { start + config.warmup });
        std::thread::sleep(next.saturating_duration_since(Instant::now()));
        let now = Instant::now();
        let committed = progress.committed();
        let due = progress_line(
            last.0.duration_since(start),
            now.duration_since(start),
            config.warmup,
        );
        if let Some(in_warmup) = due {
            on_line(&ProgressLine {
                at: now.duration_since(start),
                warmup: in_warmup,
                rate: (committed - last.1) as f64 / now.duration_since(last.0).as_secs_f64(),
                committed,
                aborted: progress.aborted(),
            });
            last = (now, committed);
        }
    }
}

/// Whether a progress line is due at `now` for the interval since the last one, at
/// `last` (both since the run's start), and whether it covers the warm-up. Lines come
/// about once a second and at the warm-up's end, so that none mixes the warm-up into
/// a measured rate (a warm-up shorter than a second once did, unlabelled).
fn progress_line(last: Duration, now: Duration, warmup: Duration) -> Option<bool> {
    let in_warmup = last < warmup;
    let warmup_ends = in_warmup && now >= warmup;
    (warmup_ends || now.saturating_sub(last) >= Duration::from_millis(900)).then_some(in_warmup)
}

#[allow(clippy::too_many_arguments)]
async fn client_loop<E: Engine>(
    engine: &E,
    client: &mut Client,
    shared: &Shared,
    config: &RunConfig,
    start: Instant,
    tally: &RefCell<ThreadTally>,
    recorder: Option<&HistoryRecorder>,
    progress: &Progress,
    counts: &ThreadCounts,
    measuring: &AtomicBool,
) -> Result<()> {
    let picker = config.mix.picker();
    let end = start + config.warmup + config.duration;
    let mut now = Instant::now();
    while now < end && !progress.stop.load(Ordering::Relaxed) {
        let kind = picker.pick(&mut client.rng);
        let began = now;
        let measured = measuring.load(Ordering::Relaxed);
        let mut aborts = 0u64;
        // Of `aborts`, those inside the measured period.
        let mut counted_aborts = 0u64;
        loop {
            let mut record = recorder.map(|r| r.begin(client.stream));
            let mut txn = engine.begin(client.last_commit).await?;
            let rid = txn.read_timestamp();
            let outcome = match interactions::run(kind, &mut txn, client, shared).await {
                Ok(fx) => match engine.commit(txn).await {
                    Ok(c) => Ok((fx, c)),
                    Err(Error::Unknown { message, commit }) => {
                        let learnt = learn_outcome(
                            engine,
                            kind,
                            &message,
                            commit,
                            config.unknown_outcome_patience,
                        )
                        .await;
                        let mut t = tally.borrow_mut();
                        match learnt? {
                            Some(c) => {
                                t.unknown.committed += 1;
                                Ok((fx, c))
                            }
                            None => {
                                t.unknown.rolled_back += 1;
                                Err(Error::aborted(
                                    AbortReason::Fenced,
                                    format!("{message}; recovery rolled it back"),
                                ))
                            }
                        }
                    }
                    Err(e) => Err(e),
                },
                Err(e) => {
                    engine.abort(txn);
                    Err(e)
                }
            };
            match outcome {
                Ok((fx, committed)) => {
                    client.committed(&fx);
                    if let Some(cid) = committed.cid {
                        client.last_commit = cid;
                    }
                    if let (Some(rec), Some(r)) = (recorder, record.as_mut()) {
                        r.set_read_timestamp(rid);
                        if sample_ops(r, &fx, config.sample_every) {
                            rec.committed(record.take().expect("some"), committed.cid)
                                .map_err(|e| Error::System(format!("recording: {e}")))?;
                        }
                    }
                    let mut t = tally.borrow_mut();
                    for sale in &fx.sales {
                        t.sold
                            .add(sale.item, sale.qty as i64, i64::from(sale.restocked));
                    }
                    now = Instant::now();
                    if measured && in_window(now, end, progress) {
                        let k = t.kind(kind)?;
                        k.committed += 1;
                        k.aborted += counted_aborts;
                        k.latency_ns
                            .saturating_record((now - began).as_nanos().max(1) as u64);
                    } else if counted_aborts > 0 {
                        t.kind(kind)?.aborted += counted_aborts;
                    }
                    counts.committed.fetch_add(1, Ordering::Relaxed);
                    break;
                }
                Err(Error::Aborted { reason, .. }) => {
                    aborts += 1;
                    counts.aborted.fetch_add(1, Ordering::Relaxed);
                    now = Instant::now();
                    if measured && in_window(now, end, progress) {
                        counted_aborts += 1;
                        *tally.borrow_mut().aborts.entry(reason).or_default() += 1;
                    }
                    // A closed-loop client stops at the end of the run: an interaction
                    // that keeps aborting must not hold the run open past it.
                    if now >= end || progress.stop.load(Ordering::Relaxed) {
                        if counted_aborts > 0 {
                            tally.borrow_mut().kind(kind)?.aborted += counted_aborts;
                        }
                        break;
                    }
                    if aborts > 10_000 {
                        return Err(Error::System(format!(
                            "{} aborted 10000 times in a row; last: {reason:?}",
                            kind.name()
                        )));
                    }
                }
                Err(e) => return Err(e),
            }
        }
    }
    Ok(())
}

/// How long a client waits to learn what became of a commit of unknown outcome
/// ([`Error::Unknown`]): recovery scans every table, and one stalled on another node
/// is taken over only after `txn::recovery::TAKEOVER`.
pub const UNKNOWN_OUTCOME_PATIENCE: Duration = Duration::from_secs(120);

/// What became of a commit of `kind` that failed with [`Error::Unknown`]: `Some` if it
/// committed, `None` if recovery rolled it back. An error (ending the run) if the
/// engine cannot tell within `patience` ([`RunConfig::unknown_outcome_patience`]).
///
/// Either way the ledger and the history stay exact: a commit learnt committed is
/// counted and recorded like any other (with its commit timestamp, once transactions
/// that begin afterwards see it, as a commit returns), so the sales it made count for
/// stock conservation, its order for the order check, and the reads of its writes by
/// other clients find their writer in the history; one rolled back had no effect and
/// is retried, like an abort, with the same ids (its inserts were undone).
async fn learn_outcome<E: Engine>(
    engine: &E,
    kind: Interaction,
    message: &str,
    commit: Option<u64>,
    patience: Duration,
) -> Result<Option<Committed>> {
    let unknown = || format!("a {} commit's outcome is unknown ({message})", kind.name());
    let Some(commit) = commit else {
        return Err(Error::System(format!(
            "{}, and this system cannot tell which it was",
            unknown()
        )));
    };
    engine
        .outcome(commit, patience)
        .await
        .map_err(|e| Error::System(format!("{}, and it could not be learnt: {e}", unknown())))
}

/// Whether an interaction finished at `now` falls in the measured period: not after
/// its end, nor after the run was stopped early. The report divides by that period,
/// so counting what finished after it inflated the rate: a run stopped at its first
/// look reported 2.35 M txn/s from two commits in flight at the stop.
fn in_window(now: Instant, end: Instant, progress: &Progress) -> bool {
    now <= end && !progress.stop.load(Ordering::Relaxed)
}

fn item_key(item: u64) -> String {
    format!("item:{item}")
}

/// Adds the sampled items' stock reads and writes of `fx` to `record`; whether any.
fn sample_ops(record: &mut TxnRecord, fx: &Effects, every: u64) -> bool {
    let mut any = false;
    for sale in fx.sales.iter().filter(|s| s.item % every == 0) {
        record.read(
            &item_key(sale.item),
            ReadValue::Register(sale.before as i64),
            sale.version,
        );
        record.write(&item_key(sale.item), sale.after as i64);
        any = true;
    }
    for &(item, stock, version) in fx.stock_reads.iter().filter(|r| r.0 % every == 0) {
        record.read(&item_key(item), ReadValue::Register(stock as i64), version);
        any = true;
    }
    for &(item, stock, version) in fx.stock_rewrites.iter().filter(|r| r.0 % every == 0) {
        record.read(&item_key(item), ReadValue::Register(stock as i64), version);
        record.write(&item_key(item), stock as i64);
        any = true;
    }
    any
}

/// Records the sampled items' rewrites that the initial stocks (read at `initial_rid`)
/// do not already hold, in commit order. Recorded after the fact, so untimed.
fn record_rewrites(
    recorder: &HistoryRecorder,
    rewrites: &ItemRewrites,
    initial_rid: Option<u64>,
    every: u64,
) -> Result<()> {
    let mut after_initial: Vec<ItemRewrite> = rewrites
        .snapshot()
        .into_iter()
        .filter(|w| w.item % every == 0 && initial_rid.is_none_or(|rid| w.cid > rid))
        .collect();
    after_initial.sort_unstable_by_key(|w| w.cid);
    for w in after_initial {
        let mut record = recorder.begin(REWRITER_SESSION);
        record.set_read_timestamp(Some(w.rid));
        record.write(&item_key(w.item), w.stock as i64);
        recorder
            .committed_untimed(record, Some(w.cid))
            .map_err(|e| Error::System(format!("recording: {e}")))?;
    }
    Ok(())
}

/// Records the sampled items' stocks before the run as the transactions that wrote
/// them (grouped by version, so the white-box checker can replay the system's order);
/// returns the read timestamp they were read at.
fn record_initial_stocks<S: System>(
    system: &S,
    scale: &Scale,
    every: u64,
    recorder: &HistoryRecorder,
) -> Result<Option<u64>> {
    let items: Vec<u64> = (1..=scale.items).filter(|i| i % every == 0).collect();
    let engine = system.engine(0)?;
    let (by_version, rid) = run_one(&engine, async |engine: &S::Engine| {
        let mut by_version: BTreeMap<Option<u64>, Vec<(u64, i32)>> = BTreeMap::new();
        let mut txn = engine.begin(0).await?;
        let rid = txn.read_timestamp();
        for chunk in items.chunks(256) {
            let rows = txn.get_many(Rel::Item, chunk).await?;
            for (row, &id) in rows.into_iter().zip(chunk) {
                let row = row.ok_or_else(|| Error::Data(format!("item {id} is missing")))?;
                let version = txn.version(Rel::Item, id).await?;
                by_version
                    .entry(version)
                    .or_default()
                    .push((id, Item::stock_of(&row)?));
            }
        }
        engine.abort(txn);
        Ok((by_version, rid))
    })?;
    for (version, stocks) in by_version {
        let mut record = recorder.begin(u64::MAX);
        // A snapshot just below its commit: the load raced nothing. Without one the
        // white-box checker cannot run, and the clients' stock reads go unchecked.
        record.set_read_timestamp(version.map(|v| v.saturating_sub(1)));
        for (id, stock) in stocks {
            record.write(&item_key(id), stock as i64);
        }
        recorder
            .committed(record, version)
            .map_err(|e| Error::System(format!("recording: {e}")))?;
    }
    Ok(rid)
}

fn merge(into: &mut ThreadTally, from: ThreadTally) -> Result<()> {
    for (kind, k) in from.kinds {
        let t = into.kind(kind)?;
        t.committed += k.committed;
        t.aborted += k.aborted;
        t.latency_ns
            .add(&k.latency_ns)
            .map_err(|e| Error::System(format!("histogram: {e}")))?;
    }
    for (reason, n) in from.aborts {
        *into.aborts.entry(reason).or_default() += n;
    }
    for (item, (qty, restocks)) in from.sold.iter() {
        into.sold.add(item, qty, restocks);
    }
    into.orders.extend(from.orders);
    into.unknown.committed += from.unknown.committed;
    into.unknown.rolled_back += from.unknown.rolled_back;
    Ok(())
}

fn summarize(
    system: &str,
    backend: String,
    config: &RunConfig,
    threads: usize,
    seconds: f64,
    t: &ThreadTally,
) -> Result<RunReport> {
    let mut all = Histogram::<u64>::new_with_bounds(1, 600_000_000_000, 3)
        .map_err(|e| Error::System(format!("histogram: {e}")))?;
    let (mut committed, mut aborted) = (0, 0);
    let us = |h: &Histogram<u64>, q: f64| {
        (!h.is_empty()).then(|| h.value_at_quantile(q) as f64 / 1000.0)
    };
    let mut interactions = Vec::new();
    for (&kind, k) in &t.kinds {
        committed += k.committed;
        aborted += k.aborted;
        all.add(&k.latency_ns)
            .map_err(|e| Error::System(format!("histogram: {e}")))?;
        interactions.push(InteractionReport {
            interaction: kind,
            committed: k.committed,
            aborted: k.aborted,
            txn_per_sec: k.committed as f64 / seconds,
            p50_us: us(&k.latency_ns, 0.5),
            p99_us: us(&k.latency_ns, 0.99),
        });
    }
    Ok(RunReport {
        system: system.to_string(),
        backend,
        mix: config.mix,
        clients: config.clients,
        threads,
        seconds,
        committed,
        aborted,
        txn_per_sec: committed as f64 / seconds,
        abort_rate: if committed + aborted == 0 {
            0.0
        } else {
            aborted as f64 / (committed + aborted) as f64
        },
        aborts: t.aborts.clone(),
        p50_us: us(&all, 0.5),
        p99_us: us(&all, 0.99),
        p999_us: us(&all, 0.999),
        interactions,
        checks: Checks::default(),
        stopped_early: None,
        phase: None,
        unknown_outcomes: (t.unknown != UnknownOutcomes::default()).then_some(t.unknown),
        pinned_memory: None,
    })
}

/// The checks of the module's docs.
fn check<S: System>(
    system: &S,
    ledger: &Ledger,
    recorder: Option<HistoryRecorder>,
    progress: bool,
) -> Result<Checks> {
    let started = Instant::now();
    let engine = system.engine(0)?;
    let mut checks = Checks::default();
    let items: Vec<u64> = {
        let mut v: Vec<u64> = ledger.sold.keys().copied().collect();
        v.sort_unstable();
        v
    };
    // A read-only transaction over every sold item: writers that keep running (an
    // HTAP run's related-items updates) can make its one-version snapshot too old, so
    // it is retried at a fresh snapshot.
    let mut attempts = 0;
    let (bad_stock, missing_orders) = loop {
        checks.items_checked = 0;
        checks.orders_checked = 0;
        let outcome = run_one(&engine, async |engine: &S::Engine| {
            let (mut bad_stock, mut missing_orders) = (Vec::new(), Vec::new());
            let mut txn = engine.begin(0).await?;
            for chunk in items.chunks(256) {
                let rows = txn.get_many(Rel::Item, chunk).await?;
                for (row, &id) in rows.into_iter().zip(chunk) {
                    let row = row.ok_or_else(|| Error::Data(format!("item {id} is missing")))?;
                    let now = Item::stock_of(&row)? as i64;
                    let (sold, restocks) = ledger.sold[&id];
                    let expected = generate::initial_stock(id) as i64 - sold + 21 * restocks;
                    if now != expected {
                        bad_stock.push((id, expected, now));
                    }
                }
                checks.items_checked += chunk.len() as u64;
            }
            for (stream, &count) in ledger.orders.iter().enumerate() {
                let stream = stream as u64;
                // The first, the last, and the one after the last (which must not exist).
                let probes: Vec<u64> = [0, count.saturating_sub(1), count]
                    .into_iter()
                    .map(|seq| stream_id(stream, seq))
                    .collect();
                let rows = txn.get_many(Rel::Orders, &probes).await?;
                let present = count == 0 || (rows[0].is_some() && rows[1].is_some());
                if !present || rows[2].is_some() {
                    missing_orders.push((stream, count));
                }
                checks.orders_checked += count;
            }
            engine.abort(txn);
            Ok((bad_stock, missing_orders))
        });
        match outcome {
            Err(Error::Aborted {
                reason: AbortReason::SnapshotTooOld,
                ..
            }) if attempts < 20 => attempts += 1,
            other => break other?,
        }
    };
    checks.stock_conserved = bad_stock.is_empty();
    checks.orders_present = missing_orders.is_empty();
    for (id, expected, now) in bad_stock.iter().take(5) {
        eprintln!("stock check: item {id} has stock {now}, expected {expected}");
    }
    for (stream, count) in missing_orders.iter().take(5) {
        eprintln!(
            "order check: client stream {stream} committed {count} orders, the database disagrees"
        );
    }
    if let Some(rec) = recorder {
        let bytes = rec.into_sink().into_inner();
        let index = verify::index::load_jsonl(std::io::Cursor::new(bytes), 3)
            .map_err(|e| Error::System(format!("reading back the recorded history: {e}")))?;
        checks.history_txns = index.stats().txns;
        let report = verify::report::check(&index, verify::report::Model::SnapshotIsolation);
        let verdict = match report.verdict() {
            verify::report::Verdict::Valid => "valid",
            verify::report::Verdict::Invalid => "invalid",
            verify::report::Verdict::Inconclusive => "inconclusive",
        };
        let text = report.to_string();
        match verdict {
            "invalid" => eprintln!("history check:\n{text}"),
            // PostgreSQL exposes no commit timestamps to place its reads by: say why,
            // in a line, on every run.
            "inconclusive" => eprintln!(
                "history check: {}",
                text.lines()
                    .find(|l| l.starts_with("verdict:"))
                    .unwrap_or("inconclusive")
            ),
            _ => {}
        }
        checks.history_verdict = Some(verdict.to_string());
    }
    if progress {
        eprintln!(
            "checked {} items, {} orders{} in {:.1} s",
            checks.items_checked,
            checks.orders_checked,
            checks
                .history_verdict
                .as_ref()
                .map(|v| format!(", a history of {} transactions: {v}", checks.history_txns))
                .unwrap_or_default(),
            started.elapsed().as_secs_f64()
        );
    }
    Ok(checks)
}

/// Runs one future on `engine`'s thread.
pub fn run_one<E: Engine, T>(engine: &E, body: impl AsyncFnOnce(&E) -> Result<T>) -> Result<T> {
    let mut body = Some(body);
    engine
        .run_clients(1, |_| {
            let body = body
                .take()
                .expect("run_clients makes one future per client");
            Box::pin(body(engine))
        })
        .pop()
        .unwrap_or_else(|| Err(Error::System("the engine ran no client".into())))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The lines `watch` prints, as (when, whether warm-up), waking at `wakes` (ms).
    fn lines(warmup_ms: u64, wakes: impl IntoIterator<Item = u64>) -> Vec<(u64, bool)> {
        let mut last = 0;
        let mut printed = Vec::new();
        for now in wakes {
            let ms = Duration::from_millis;
            if let Some(in_warmup) = progress_line(ms(last), ms(now), ms(warmup_ms)) {
                printed.push((now, in_warmup));
                last = now;
            }
        }
        printed
    }

    #[test]
    fn what_never_committed_has_no_latency() {
        let config = RunConfig {
            mix: Mix::Ordering,
            clients: 1,
            threads: 1,
            warmup: Duration::ZERO,
            duration: Duration::from_millis(1),
            sample_every: 0,
            progress: false,
            seed: 1,
            stop_below_available: 0,
            stop_below_free_disk: None,
            unknown_outcome_patience: UNKNOWN_OUTCOME_PATIENCE,
        };
        let mut t = ThreadTally::new();
        let report = summarize("rsi", "sim".into(), &config, 1, 0.001, &t).unwrap();
        let json = serde_json::to_value(&report).unwrap();
        for field in ["p50_us", "p99_us", "p999_us"] {
            assert!(json[field].is_null(), "{field}: {json}");
        }
        // Admin Confirm aborted every time; Home committed once, in 40 µs.
        t.kind(Interaction::AdminConfirm).unwrap().aborted = 2;
        let home = t.kind(Interaction::Home).unwrap();
        home.committed = 1;
        home.latency_ns.record(40_000).unwrap();
        let report = summarize("rsi", "sim".into(), &config, 1, 0.001, &t).unwrap();
        let json = serde_json::to_value(&report).unwrap();
        assert!(
            json["p50_us"]
                .as_f64()
                .is_some_and(|us| (us - 40.0).abs() < 0.1),
            "{json}"
        );
        for i in json["interactions"].as_array().unwrap() {
            match i["interaction"].as_str().unwrap() {
                "home" => assert!(i["p99_us"].as_f64().is_some(), "{i}"),
                _ => assert!(i["p50_us"].is_null() && i["p99_us"].is_null(), "{i}"),
            }
        }
    }

    #[test]
    fn no_progress_line_mixes_the_warm_up_into_a_measured_rate() {
        // `watch` wakes every 200 ms and at the warm-up's end.
        let every_200_ms_and = |at: u64| {
            let mut wakes: Vec<u64> = (1..=15).map(|i| i * 200).collect();
            wakes.push(at);
            wakes.sort_unstable();
            wakes.dedup();
            wakes
        };
        assert_eq!(
            lines(500, every_200_ms_and(500)),
            [(500, true), (1400, false), (2400, false)]
        );
        assert_eq!(
            lines(1500, every_200_ms_and(1500)),
            [(1000, true), (1500, true), (2400, false)]
        );
        assert_eq!(
            lines(0, every_200_ms_and(0)),
            [(1000, false), (2000, false), (3000, false)]
        );
    }
}
