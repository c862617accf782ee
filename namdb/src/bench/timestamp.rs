//! `namdb bench timestamp`: the bit-vector oracle under load.
//!
//! One memory-server node holds a V-bit oracle with `--slots` slots; `--threads`
//! client threads each hold one slot over their own RC queue pair. Each thread loops
//! like an RSI worker: take a commit timestamp (no communication), mark it committed
//! (one unsignaled FETCH_ADD), and every `--read-every` commits compute a read
//! timestamp (one READ of at most 256 B in steady state), interleaved with the
//! commits; it also calls the slot's `tick` every 64 passes, which does work once per
//! tick interval. Slots beyond the threads stay free (16 slots, 2 threads by default),
//! so the others skip for them. With `--wait` a thread instead waits after each mark
//! until its read timestamp covers the commit, as a client that commits and then
//! waits for its commit to become visible does (txn's `wait_visible`).
//!
//! Reported: marked commits/s and read timestamps/s (sums over threads), bytes READ
//! per read timestamp, the prefix lag at each read: how many timestamps the read
//! timestamp trails the highest timestamp any thread had marked by then (p50, p99),
//! and the visibility latency: the time from the mark of a commit to the first read
//! timestamp of the same thread that covers it (p50, p99; one commit at a time is
//! timed, so that the clock is not read per commit).

use crate::backend::{self, BackendKind};
use crate::bench::JsonOut;
use anyhow::{Context, Result, anyhow, bail};
use clap::Args;
use fabric::{Access, QpConfig};
use hdrhistogram::Histogram;
use serde::Serialize;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};
use timestamp::{
    Layout, MIN_CQ_CAPACITY, MIN_SEND_QUEUE, OracleConfig, OracleError, Outcome, SlotHandle,
    SlotStats, SystemClock,
};

/// How long a thread may go without a commit timestamp before the run is called stuck.
const STALL_LIMIT: Duration = Duration::from_secs(10);

#[derive(Args, Debug, Clone)]
pub struct TimestampArgs {
    /// Fabric backend: `sim` in this process, `shm` or `tcp` with the oracle in a
    /// separate memory-server node.
    #[arg(long, value_enum, default_value_t = BackendKind::Sim)]
    pub backend: BackendKind,
    /// Slots of the oracle (at least --threads).
    #[arg(long, value_name = "S", default_value_t = 16,
          value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub slots: u32,
    /// Client threads, each holding one slot.
    #[arg(long, value_name = "T", default_value_t = 2,
          value_parser = clap::value_parser!(u32).range(1..=256))]
    pub threads: u32,
    /// Bits of the vector (V).
    #[arg(long, value_name = "V", default_value_t = timestamp::DEFAULT_BITS)]
    pub bits: u64,
    /// Read timestamps per commit: one every N commits (1 = one per commit, as in
    /// RSI where each transaction begins with a read timestamp; 0 = none).
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub read_every: u32,
    /// Commits decided together (`SlotHandle::mark_many`), as a worker whose
    /// coroutines finish commits together does: 1 marks each commit on its own.
    #[arg(long, value_name = "N", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub mark_batch: u32,
    /// Wait after each mark until a read timestamp covers the commit (commit, then
    /// wait for visibility); `--read-every` is then unused.
    #[arg(long)]
    pub wait: bool,
    /// Length of the run.
    /// At most a day, as every benchmark's duration.
    #[arg(long, value_name = "MS", default_value_t = 1000,
          value_parser = clap::value_parser!(u64).range(1..=crate::tpcw_cmd::MAX_MILLIS))]
    pub duration_ms: u64,
    /// Also write the result to FILE as a JSON object.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
}

/// The result, as printed and as written to `--json`.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub backend: &'static str,
    pub slots: u32,
    pub threads: u32,
    pub bits: u64,
    pub read_every: u32,
    pub mark_batch: u32,
    pub wait: bool,
    pub commits_per_sec: f64,
    pub rids_per_sec: f64,
    pub bytes_per_rid: f64,
    pub lag_p50: u64,
    pub lag_p99: u64,
    /// Nanoseconds from the mark of a commit to the first read timestamp of the same
    /// thread that covers it.
    pub visible_p50_ns: u64,
    pub visible_p99_ns: u64,
    /// Own timestamps skipped by idle ticks, and timestamps skipped for free slots.
    pub skipped: u64,
    pub skipped_for_others: u64,
    /// Times a thread, descheduled past its lease, found its slot fenced and took one
    /// again (a loaded machine; 0 on a quiet one).
    pub slots_retaken: u64,
    pub duration_ms: u64,
}

pub fn run(args: &TimestampArgs) -> Result<()> {
    if args.threads > args.slots {
        bail!(
            "--threads {} needs at least as many --slots (got {}): each thread holds a slot",
            args.threads,
            args.slots
        );
    }
    let layout = Layout::new(args.bits, args.slots).context("invalid oracle shape")?;
    let json = JsonOut::open_opt(args.json.as_deref())?;
    let report = JsonOut::unless_failed(json.as_ref(), measure(args, layout))?;
    print(&report);
    if let Some(json) = &json {
        json.write(&report)?;
        eprintln!("wrote {}", json.path().display());
    }
    Ok(())
}

/// What one thread measured.
struct ThreadResult {
    stats: SlotStats,
    lag: Histogram<u64>,
    visible: Histogram<u64>,
    /// Times the thread's slot was fenced and taken again.
    retaken: u64,
}

fn measure(args: &TimestampArgs, layout: Layout) -> Result<Report> {
    let nodes = backend::nodes(args.backend, None)?;
    let region = nodes
        .server
        .register(layout.region_bytes(), Access::ALL)
        .context("registering the oracle region")?;
    layout.format(&region)?;
    let clock = SystemClock::shared();
    let mut handles = Vec::new();
    let mut server_qps = Vec::new();
    for _ in 0..args.threads {
        let ccq = nodes.client.create_cq(MIN_CQ_CAPACITY * 2)?;
        let scq = nodes.server.create_cq(16)?;
        let (qp, sqp) = fabric::connect_rc_with(
            (nodes.client.as_ref(), &ccq),
            (nodes.server.as_ref(), &scq),
            |c| QpConfig {
                max_send_wr: MIN_SEND_QUEUE * 2,
                ..c
            },
        )
        .context("connecting a client to the oracle")?;
        server_qps.push(sqp);
        let h = SlotHandle::register(
            nodes.client.as_ref(),
            qp,
            ccq,
            region.remote(),
            OracleConfig::default(),
            clock.clone(),
        )
        .context("registering a slot")?;
        handles.push(h);
    }
    // Highest timestamp each thread has marked, on its own cache line.
    let marked: Arc<Vec<Padded>> = Arc::new((0..args.threads).map(|_| Padded::default()).collect());
    let start = Arc::new(Barrier::new(args.threads as usize));
    let duration = Duration::from_millis(args.duration_ms);
    let began = Instant::now();
    let results: Vec<Result<ThreadResult>> = thread::scope(|s| {
        let workers: Vec<_> = handles
            .into_iter()
            .enumerate()
            .map(|(i, h)| {
                let marked = marked.clone();
                let start = start.clone();
                let shape = Shape {
                    read_every: args.read_every,
                    mark_batch: args.mark_batch,
                    wait: args.wait,
                };
                s.spawn(move || worker(h, i, &marked, &start, duration, shape))
            })
            .collect();
        workers
            .into_iter()
            .map(|w| {
                w.join()
                    .map_err(|_| anyhow!("a benchmark thread panicked"))?
            })
            .collect()
    });
    let elapsed = began.elapsed().as_secs_f64();
    drop(server_qps);
    let mut lag = new_histogram()?;
    let mut visible = new_histogram()?;
    let mut total = SlotStats::default();
    let mut retaken = 0;
    for r in results {
        let r = r?;
        retaken += r.retaken;
        lag.add(&r.lag)
            .map_err(|e| anyhow!("merging histograms: {e:?}"))?;
        visible
            .add(&r.visible)
            .map_err(|e| anyhow!("merging histograms: {e:?}"))?;
        total.committed += r.stats.committed;
        total.read_timestamps += r.stats.read_timestamps;
        total.window_bytes += r.stats.window_bytes;
        total.skipped += r.stats.skipped;
        total.skipped_for_others += r.stats.skipped_for_others;
    }
    let rids = total.read_timestamps.max(1) as f64;
    Ok(Report {
        backend: args.backend.name(),
        slots: args.slots,
        threads: args.threads,
        bits: args.bits,
        read_every: args.read_every,
        mark_batch: args.mark_batch,
        wait: args.wait,
        commits_per_sec: total.committed as f64 / elapsed,
        rids_per_sec: total.read_timestamps as f64 / elapsed,
        bytes_per_rid: if total.read_timestamps == 0 {
            0.0
        } else {
            total.window_bytes as f64 / rids
        },
        lag_p50: lag.value_at_quantile(0.5),
        lag_p99: lag.value_at_quantile(0.99),
        visible_p50_ns: visible.value_at_quantile(0.5),
        visible_p99_ns: visible.value_at_quantile(0.99),
        skipped: total.skipped,
        skipped_for_others: total.skipped_for_others,
        slots_retaken: retaken,
        duration_ms: args.duration_ms,
    })
}

#[derive(Default)]
#[repr(align(128))]
struct Padded(AtomicU64);

fn worker(
    h: SlotHandle,
    me: usize,
    marked: &[Padded],
    start: &Barrier,
    duration: Duration,
    shape: Shape,
) -> Result<ThreadResult> {
    let Shape {
        read_every,
        mark_batch,
        wait,
    } = shape;
    let mut undecided = Vec::with_capacity(mark_batch as usize);
    let mut lag = new_histogram()?;
    let mut visible = new_histogram()?;
    // The commit being timed, and when it was marked.
    let mut timed: Option<(u64, Instant)> = None;
    // The stats so far cover registration; the run's are the difference.
    let before = h.stats();
    start.wait();
    let end = Instant::now() + duration;
    // Commits marked, and passes of the loop.
    let mut n = 0u64;
    let mut passes = 0u64;
    let mut blocked_since: Option<Instant> = None;
    let mut retaken = 0u64;
    loop {
        passes += 1;
        // The clock is read once per 256 passes, not per commit.
        if passes.is_multiple_of(256) && Instant::now() >= end {
            break;
        }
        // `tick` is due every `tick_interval` (1 ms by default); a scheduler calls it on
        // a timer, not per commit, and so does this loop (every 64 passes is far more
        // often than that).
        if passes.is_multiple_of(64)
            && let Err(e) = h.tick()
        {
            retake_if_fenced(&h, e, &mut retaken)?;
            undecided.clear();
        }
        let t = match h.next_commit_ts() {
            Ok(t) => t,
            Err(_) => match h.acquire_commit_ts(64) {
                Ok(t) => t,
                // The wrap margin holds this slot back until the other threads
                // catch up (one descheduled for a few ms is enough): that is
                // back-pressure, not failure, unless it lasts.
                Err(OracleError::Stalled { .. }) => {
                    // Our own undecided timestamps may be what holds the prefix back.
                    if !undecided.is_empty() {
                        if let Err(e) = h.mark_many(&undecided) {
                            retake_if_fenced(&h, e, &mut retaken)?;
                        }
                        undecided.clear();
                    }
                    let since = *blocked_since.get_or_insert_with(Instant::now);
                    if since.elapsed() > STALL_LIMIT {
                        bail!("no commit timestamp for {STALL_LIMIT:?}: the prefix is stuck");
                    }
                    thread::yield_now();
                    continue;
                }
                Err(e) => {
                    retake_if_fenced(&h, e, &mut retaken)?;
                    undecided.clear();
                    continue;
                }
            },
        };
        blocked_since = None;
        undecided.push((t, Outcome::Committed));
        if undecided.len() < mark_batch as usize {
            continue;
        }
        if let Err(e) = h.mark_many(&undecided) {
            retake_if_fenced(&h, e, &mut retaken)?;
            undecided.clear();
            continue;
        }
        marked[me].0.store(t, Ordering::Relaxed);
        if timed.is_none() {
            timed = Some((t, Instant::now()));
        }
        let mut read = |h: &SlotHandle| -> Result<u64> {
            let top = marked
                .iter()
                .map(|m| m.0.load(Ordering::Relaxed))
                .max()
                .unwrap_or(0);
            let rid = h.read_timestamp()?;
            lag.saturating_record(top.saturating_sub(rid));
            if let Some((cid, at)) = timed
                && rid >= cid
            {
                visible.saturating_record(at.elapsed().as_nanos() as u64);
                timed = None;
            }
            Ok(rid)
        };
        if wait {
            // Commit, then wait for visibility: read (and tick, as a waiting client
            // does) until the read timestamp covers this commit.
            let since = Instant::now();
            let mut spins = 0u32;
            while read(&h)? < t {
                if let Err(e) = h.tick() {
                    // The fence decided `t` (unused), so the wait still ends.
                    retake_if_fenced(&h, e, &mut retaken)?;
                }
                spins += 1;
                if spins.is_multiple_of(1024) && since.elapsed() > STALL_LIMIT {
                    bail!("commit {t} not visible after {STALL_LIMIT:?}: the prefix is stuck");
                }
            }
            n += undecided.len() as u64;
            undecided.clear();
            continue;
        }
        for _ in undecided.drain(..) {
            n += 1;
            if read_every > 0 && n.is_multiple_of(read_every as u64) {
                read(&h)?;
            }
        }
    }
    let after = h.stats();
    let stats = SlotStats {
        committed: after.committed - before.committed,
        read_timestamps: after.read_timestamps - before.read_timestamps,
        window_bytes: after.window_bytes - before.window_bytes,
        skipped: after.skipped - before.skipped,
        skipped_for_others: after.skipped_for_others - before.skipped_for_others,
        ..after
    };
    Ok(ThreadResult {
        stats,
        lag,
        visible,
        retaken,
    })
}

/// After `e`: if it is a fence of this thread's slot (the thread was descheduled past
/// its lease, as on a loaded machine; the fencer decided its undecided timestamps),
/// takes a slot again, as a txn worker does, and counts it; any other error ends the
/// run.
fn retake_if_fenced(h: &SlotHandle, e: OracleError, retaken: &mut u64) -> Result<()> {
    match e {
        OracleError::Fenced { .. } => {
            h.rejoin()?;
            *retaken += 1;
            Ok(())
        }
        e => Err(e.into()),
    }
}

/// The workload of one thread.
#[derive(Clone, Copy)]
struct Shape {
    read_every: u32,
    mark_batch: u32,
    wait: bool,
}

fn new_histogram() -> Result<Histogram<u64>> {
    Histogram::new_with_bounds(1, 1 << 40, 3).map_err(|e| anyhow!("creating a histogram: {e:?}"))
}

fn print(r: &Report) {
    let reads = if r.wait {
        "each commit waits until visible".to_string()
    } else if r.read_every == 0 {
        "no read timestamps but the ticks'".to_string()
    } else {
        format!("a read timestamp every {} commits", r.read_every)
    };
    println!(
        "namdb bench timestamp: backend {}, V = {}, {} slots, {} threads, {reads}, marks in batches of {}, {} ms",
        r.backend, r.bits, r.slots, r.threads, r.mark_batch, r.duration_ms
    );
    println!();
    println!("{:<28} {:>14}", "marked commits/s", rate(r.commits_per_sec));
    println!("{:<28} {:>14}", "read timestamps/s", rate(r.rids_per_sec));
    println!("{:<28} {:>14.1}", "bytes READ per read ts", r.bytes_per_rid);
    println!("{:<28} {:>14}", "prefix lag p50 (timestamps)", r.lag_p50);
    println!("{:<28} {:>14}", "prefix lag p99 (timestamps)", r.lag_p99);
    println!(
        "{:<28} {:>14}",
        "visible after p50",
        micros(r.visible_p50_ns)
    );
    println!(
        "{:<28} {:>14}",
        "visible after p99",
        micros(r.visible_p99_ns)
    );
    println!("{:<28} {:>14}", "own timestamps skipped", r.skipped);
    println!(
        "{:<28} {:>14}",
        "skipped for free slots", r.skipped_for_others
    );
    if r.slots_retaken > 0 {
        println!(
            "{:<28} {:>14}",
            "slots fenced and re-taken", r.slots_retaken
        );
    }
    println!();
    // The throughput goal is the sim's: elsewhere the fabric's own costs dominate.
    if r.backend == "sim" {
        let goal = r.commits_per_sec >= 5e6;
        println!(
            "goal ≥ 5 M marked commits/s on sim: {} — {}",
            rate(r.commits_per_sec),
            if goal { "met" } else { "NOT met" }
        );
    }
    if r.read_every == 0 && !r.wait {
        // The few reads left are the ticks' catching up, not what the goal is about.
        return;
    }
    println!(
        "goal ≤ 256 B READ per read timestamp: {:.1} B — {}",
        r.bytes_per_rid,
        if r.bytes_per_rid <= 256.0 {
            "met"
        } else {
            "NOT met"
        }
    );
}

fn micros(ns: u64) -> String {
    format!("{:.2} µs", ns as f64 / 1e3)
}

fn rate(per_sec: f64) -> String {
    if per_sec >= 1e6 {
        format!("{:.2} M", per_sec / 1e6)
    } else if per_sec >= 1e3 {
        format!("{:.1} k", per_sec / 1e3)
    } else {
        format!("{per_sec:.1}")
    }
}
