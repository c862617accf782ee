//! `namdb tpcw`: the TPC-W benchmark (the paper's checkout, or a TPC-W mix) on RSI
//! and on the baselines, in one harness and one run.
//!
//! RSI runs on an embedded sim cluster, or on memory-server processes this command
//! starts (`--backend shm|tcp`), or on several of these in turn (`--backend sim,shm`).
//! Each system is loaded with the same generated data, runs the same interactions for
//! `--duration` after a warm-up (or a sweep over the number of clients), and is
//! checked after every run (see `tpcw::runner`).

use crate::backend::BackendKind;
use crate::bench::{JsonOut, OutputFile};
use crate::cluster_cmd::{ProcessEntry, spawn, stop_all};
use anyhow::{Context, Result, bail, ensure};
use clap::{Args, ValueEnum};
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};
use tpcw::htap::Phase;
use tpcw::interactions::Mix;
use tpcw::rsi::{Room, Rsi};
use tpcw::runner::{self, DiskFloor, Ledger, RunConfig, RunReport};
use tpcw::schema::{Rel, Scale};
use tpcw::system::System;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum SystemKind {
    /// namdb's RDMA snapshot isolation on network-attached memory.
    Rsi,
    /// The paper's traditional snapshot isolation with two-phase commit: resource
    /// manager and transaction manager processes over TCP on this host.
    #[value(name = "2pc")]
    TwoPc,
    /// PostgreSQL at REPEATABLE READ over a socket (`scripts/postgres.sh` installs
    /// and starts a server unless `--postgres` names one).
    Postgres,
}

impl SystemKind {
    fn name(self) -> &'static str {
        match self {
            SystemKind::Rsi => "rsi",
            SystemKind::TwoPc => "2pc",
            SystemKind::Postgres => "postgres",
        }
    }
}

#[derive(Args, Debug, Clone)]
pub struct TpcwArgs {
    /// Systems to run, in this order, comma separated (e.g. `rsi,2pc,postgres`).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "rsi")]
    pub system: Vec<SystemKind>,
    /// RSI's fabrics, run in this order, comma separated: `sim` (embedded), or
    /// `shm`/`tcp` (memory-server processes), e.g. `sim,shm,tcp`.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "sim")]
    pub backend: Vec<BackendKind>,
    /// The paper's checkout transaction, or a TPC-W mix.
    #[arg(long, value_enum, default_value_t = Mix::Checkout)]
    pub mix: Mix,
    /// NUM_ITEMS.
    #[arg(long, value_name = "N", default_value_t = 100_000,
          value_parser = clap::value_parser!(u64).range(Scale::ITEMS))]
    pub items: u64,
    /// NUM_EBS: the population (2880 customers each) is sized for this many browsers.
    #[arg(long, value_name = "N", default_value_t = 10,
          value_parser = clap::value_parser!(u64).range(Scale::EBS))]
    pub ebs: u64,
    /// Bytes of an ITEM row (the paper's products are about 1 KB).
    #[arg(long, value_name = "BYTES", default_value_t = 1024,
          value_parser = clap::value_parser!(u32)
              .range(i64::from(Scale::MIN_ITEM_BYTES)..=i64::from(Scale::MAX_ITEM_BYTES)))]
    pub item_bytes: u32,
    /// Closed-loop clients (with `--sweep`: the most).
    #[arg(long, value_name = "N", default_value_t = 64,
          value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub clients: u32,
    /// Threads for RSI's clients (each runs clients as coroutines); the baselines
    /// block, so they get a thread per client.
    #[arg(long, value_name = "T",
          value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub threads: Option<u32>,
    /// Measured seconds per run.
    #[arg(long, value_name = "S", default_value_t = 10.0)]
    pub duration: f64,
    /// Seconds of warm-up before each measured run.
    #[arg(long, value_name = "S", default_value_t = 1.0)]
    pub warmup: f64,
    /// Run with 1, 2, 4, … up to `--clients` clients and plot throughput against
    /// clients (`--svg`).
    #[arg(long)]
    pub sweep: bool,
    /// Where `--sweep` draws its plot. Only a sweep draws one, so without `--sweep` it
    /// is refused rather than silently ignored.
    #[arg(
        long,
        value_name = "FILE",
        default_value = "tpcw-sweep.svg",
        requires = "sweep"
    )]
    pub svg: PathBuf,
    /// Start RSI's memory servers with a data directory each (under `--dir`), so
    /// every commit is persisted before it is acknowledged (shm and tcp only).
    #[arg(long)]
    pub durable: bool,
    /// Back all of RSI's memory-server memory before loading (the embedded sim's, or
    /// the memory-server processes' with their `--pin-memory`), as an RNIC pins
    /// registered memory, and fail if the host cannot spare it. Without this flag or
    /// `--lazy-memory` the memory is pinned when the host can spare it all, and backed
    /// as it is first touched (with a note saying so) when it cannot.
    #[arg(long, conflicts_with = "lazy_memory")]
    pub pin_memory: bool,
    /// Back RSI's memory-server memory only as it is first touched: the start is
    /// shorter (pinning took up to about 2 s per GiB of room here), but the run then
    /// waits on the kernel zeroing fresh pages (checkout on the sim measured about 15%
    /// slower, its p99 two to eight times higher).
    #[arg(long)]
    pub lazy_memory: bool,
    /// Versions each ITEM record keeps under RSI. The paper keeps one: a checkout
    /// reads and writes the fewest bytes, but a snapshot older than an item's latest
    /// update aborts (`SnapshotTooOld`), often on few items or many clients.
    #[arg(long, value_name = "N", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..=8))]
    pub item_versions: u32,
    /// Memory servers for RSI.
    #[arg(long, value_name = "M", default_value_t = 2,
          value_parser = clap::value_parser!(u32).range(1..=16))]
    pub memory_servers: u32,
    /// Resource managers (partitions) for 2pc; the paper uses 3.
    #[arg(long, value_name = "N", default_value_t = tpcw::twopc::DEFAULT_RESOURCE_MANAGERS as u32,
          value_parser = clap::value_parser!(u32).range(1..=64))]
    pub resource_managers: u32,
    /// Record the stocks of every N-th item for the snapshot-isolation checker
    /// (0: record nothing).
    #[arg(long, value_name = "N", default_value_t = 101)]
    pub sample_every: u64,
    /// Write every run's result to FILE as JSON.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Where the processes' logs go, memory servers' under `DIR/<backend>/` (default: a
    /// temporary directory, removed after, or kept and named if the run failed).
    #[arg(long, value_name = "DIR")]
    pub dir: Option<PathBuf>,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Use the PostgreSQL server at this connection string (its tables are replaced)
    /// instead of starting one.
    #[arg(long, value_name = "CONNINFO")]
    pub postgres: Option<String>,
    /// HTAP (RSI only): while the clients run, analytics nodes repeat TPC-W Best
    /// Sellers and Admin Confirm's related-items update as distributed queries over
    /// snapshot scans and the shuffle (`tpcw::htap`), compared with runs without them:
    /// after an unreported warm-up run, `--htap-rounds` rounds of both, in alternating
    /// order (alone, with, with, alone, …), and the median of each.
    #[arg(long)]
    pub htap: bool,
    /// Under `--htap`, rounds of the two runs (the clients alone and beside the
    /// analytics); the order alternates from round to round.
    #[arg(long, value_name = "N", default_value_t = 2,
          value_parser = clap::value_parser!(u32).range(1..=50))]
    pub htap_rounds: u32,
    /// Analytics nodes under `--htap` (one scanner thread each).
    #[arg(long, value_name = "N", default_value_t = 2,
          value_parser = clap::value_parser!(u32).range(1..=16))]
    pub analytics_nodes: u32,
    /// Under `--htap`, check every N-th Best Sellers answer against a single-node
    /// computation on the same snapshot (0: never).
    #[arg(long, value_name = "N", default_value_t = 5)]
    pub htap_check_every: u64,
    /// Under `--htap`, Best Sellers queries run between two related-items updates.
    #[arg(long, value_name = "N", default_value_t = 4,
          value_parser = clap::value_parser!(u32).range(0..=1000))]
    pub htap_best_sellers_per_related: u32,
    /// The script that installs and starts PostgreSQL (default: the copy of
    /// `scripts/postgres.sh` built into namdb, so an installed binary needs no source
    /// tree).
    #[arg(long, value_name = "FILE")]
    pub postgres_script: Option<PathBuf>,
    /// A run on a scratch PostgreSQL stops early when its database's filesystem has
    /// fewer MiB free than this (for tests: the default is what the start keeps free).
    #[arg(long, hide = true, value_name = "MIB", default_value_t = POSTGRES_DISK_RESERVE >> 20)]
    pub postgres_disk_floor_mib: u64,
}

/// The JSON document of a `namdb tpcw` run.
#[derive(Serialize)]
struct Output<'a> {
    mix: Mix,
    items: u64,
    ebs: u64,
    item_bytes: u32,
    runs: &'a [RunReport],
    #[serde(skip_serializing_if = "Option::is_none")]
    htap: Option<&'a HtapSummary>,
}

/// Both sides of an HTAP run.
#[derive(Serialize)]
struct HtapSummary {
    backend: String,
    clients: usize,
    /// Rounds of the two runs, in alternating order after a warm-up run.
    rounds: u32,
    /// The clients' interactions without analytics, and beside them: each phase's
    /// median run (the lower one of an even count).
    txn_per_sec_alone: f64,
    txn_per_sec_with_analytics: f64,
    /// Every run of each phase, in the order they ran.
    txn_per_sec_alone_runs: Vec<f64>,
    txn_per_sec_with_analytics_runs: Vec<f64>,
    /// The analytics beside the median run with them.
    analytics: tpcw::htap::HtapReport,
    /// The analytics beside every run with them, in the order they ran.
    analytics_runs: Vec<tpcw::htap::HtapReport>,
}

/// Clients the scratch PostgreSQL of `scripts/postgres.sh` takes.
const SCRATCH_POSTGRES_CLIENTS: usize = 290;
/// The longest `--duration` and `--warmup` taken (also by `bench txn`): a day.
pub(crate) const MAX_SECONDS: f64 = 86_400.0;
/// [`MAX_SECONDS`] for the benchmarks that take `--duration-ms`.
pub(crate) const MAX_MILLIS: u64 = MAX_SECONDS as u64 * 1000;

pub fn run(args: &TpcwArgs) -> Result<()> {
    // As `bench txn`: a shorter run measures next to nothing, and one under a
    // nanosecond measures zero seconds, which made its rates NaN.
    // One message for every way out of the range: `inf` was told it was too short.
    ensure!(
        (0.001..=MAX_SECONDS).contains(&args.duration),
        "--duration must be at least a millisecond (0.001 s) and at most {MAX_SECONDS} s \
         (a day), got {}",
        args.duration
    );
    ensure!(
        args.warmup >= 0.0 && args.warmup <= MAX_SECONDS,
        "--warmup must be between 0 and {MAX_SECONDS} s"
    );
    ensure!(
        !args.system.is_empty(),
        "--system needs at least one system"
    );
    // As --backend: a system listed twice ran twice, loading and checking it again, and
    // printed two rows for it.
    for (i, system) in args.system.iter().enumerate() {
        if args.system[..i].contains(system) {
            bail!("--system lists {} twice", system.name());
        }
    }
    let scale = Scale::new(args.items, args.ebs, args.item_bytes).map_err(anyhow::Error::msg)?;
    if args.system.contains(&SystemKind::TwoPc) {
        ensure_twopc_fits(&scale)?;
    }
    if args.system.contains(&SystemKind::Postgres) && args.postgres.is_none() {
        ensure_postgres_fits(&scale, &tpcw::postgres::scratch_parent())?;
    }
    ensure!(
        !args.backend.is_empty(),
        "--backend needs at least one backend"
    );
    for (i, backend) in args.backend.iter().enumerate() {
        if args.backend[..i].contains(backend) {
            bail!("--backend lists {} twice", backend.name());
        }
    }
    if args.durable && args.backend.contains(&BackendKind::Sim) {
        bail!("--durable needs memory-server processes: use --backend shm or tcp");
    }
    if args.backend.contains(&BackendKind::Verbs) {
        bail!("tpcw runs RSI on sim, shm or tcp (verbs needs RDMA hardware: use `bench txn`)");
    }
    if args.htap {
        ensure!(
            args.system == [SystemKind::Rsi],
            "--htap runs on RSI alone (--system rsi)"
        );
        ensure!(
            args.backend.len() == 1,
            "--htap runs on one backend: give --backend one"
        );
        ensure!(
            !args.sweep,
            "--htap measures one client count: drop --sweep"
        );
    }
    let dir = match &args.dir {
        Some(d) => {
            std::fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
            Workdir::Kept(d.clone())
        }
        None => {
            let dir = tempfile::Builder::new()
                .prefix("namdb-tpcw-")
                .tempdir()
                .context("creating a directory for the processes")?;
            let _on_interrupt = crate::interrupt::remove_on_interrupt(dir.path())?;
            Workdir::Temp { dir, _on_interrupt }
        }
    };
    let ran = run_in(args, &scale, dir.path());
    if ran.is_err() {
        dir.keep_if_used();
    }
    ran
}

/// The runs of [`run`], their files in `dir`.
fn run_in(args: &TpcwArgs, scale: &Scale, dir: &Path) -> Result<()> {
    let scale = *scale;
    let clients = client_counts(args);
    if args.system.contains(&SystemKind::Postgres) && args.postgres.is_none() {
        // scripts/postgres.sh's max_connections, less what PostgreSQL reserves and the
        // runner's own connections; checked before any system runs.
        let most = clients.iter().copied().max().unwrap_or(0);
        ensure!(
            most <= SCRATCH_POSTGRES_CLIENTS,
            "the scratch PostgreSQL serves at most {SCRATCH_POSTGRES_CLIENTS} clients \
             (max_connections 300), not {most}: use fewer --clients, or --postgres with a \
             server of your own"
        );
    }
    let json = JsonOut::open_opt(args.json.as_deref())?;
    // Claimed before the runs as `--json` is: a bad path fails at once.
    let plot = args
        .sweep
        .then(|| OutputFile::claim(&args.svg, "the --svg plot file"))
        .transpose()?;
    let ran = run_systems(args, &scale, &clients, dir);
    if let (Err(_), Some(plot)) = (&ran, &plot) {
        plot.discard();
    }
    let (reports, htap) = JsonOut::unless_failed(json.as_ref(), ran)?;
    print_summary(args, &reports);
    if let Some(h) = &htap {
        print_htap(h, args.mix);
    }
    if let Some(json) = &json {
        json.write(&Output {
            mix: args.mix,
            items: args.items,
            ebs: args.ebs,
            item_bytes: args.item_bytes,
            runs: &reports,
            htap: htap.as_ref(),
        })?;
    }
    if args.sweep {
        let mut lines: Vec<(&str, &str)> = Vec::new();
        for r in &reports {
            if !lines.contains(&(r.system.as_str(), r.backend.as_str())) {
                lines.push((&r.system, &r.backend));
            }
        }
        let series: Vec<crate::bench::plot::Series> = lines
            .iter()
            .map(|&(system, backend)| crate::bench::plot::Series {
                label: format!("{system} ({backend})"),
                points: reports
                    .iter()
                    .filter(|r| r.system == system && r.backend == backend)
                    .map(|r| (r.clients as f64, r.txn_per_sec))
                    .collect(),
            })
            .collect();
        let title = format!("TPC-W {} ({} items)", args.mix.name(), args.items);
        crate::bench::plot::line_svg(
            &args.svg,
            &title,
            crate::bench::plot::XAxis::Log10,
            &crate::bench::plot::Axes {
                x: "clients",
                y: "transactions per second",
            },
            &series,
        )
        .map_err(anyhow::Error::msg)?;
        if let Some(plot) = &plot {
            plot.keep();
        }
        println!("plot: {}", args.svg.display());
    }
    let failed: Vec<String> = reports
        .iter()
        .filter(|r| !r.checks_passed())
        .map(|r| format!("{} ({}) with {} clients", r.system, r.backend, r.clients))
        .collect();
    if !failed.is_empty() {
        bail!("checks failed: {}", failed.join(", "));
    }
    if let Some(h) = &htap
        && h.analytics.mismatches > 0
    {
        bail!(
            "{} of {} Best Sellers answers differ from the single-node computation",
            h.analytics.mismatches,
            h.analytics.checked
        );
    }
    Ok(())
}

/// Runs every `--system` in turn: their runs' reports, and the HTAP summary.
fn run_systems(
    args: &TpcwArgs,
    scale: &Scale,
    clients: &[usize],
    dir: &Path,
) -> Result<(Vec<RunReport>, Option<HtapSummary>)> {
    let mut reports = Vec::new();
    let mut htap = None;
    for &kind in &args.system {
        // RSI over several backends heads each backend's runs itself.
        if kind != SystemKind::Rsi || args.htap {
            eprintln!("== {} ==", kind.name());
        }
        let runs = match kind {
            SystemKind::Rsi if args.htap => {
                let (system, pinned) = start_rsi(args, args.backend[0], scale, clients, dir)?;
                let (runs, summary) = load_and_run_htap(&system, scale, args, clients[0])?;
                htap = Some(summary);
                with_pinning(runs, pinned)
            }
            SystemKind::Rsi => {
                let mut runs = Vec::new();
                // One cluster after another: each backend's runs have the machine alone.
                for &backend in &args.backend {
                    eprintln!("== {} ({}) ==", kind.name(), backend.name());
                    let (system, pinned) = start_rsi(args, backend, scale, clients, dir)?;
                    runs.extend(with_pinning(
                        load_and_run(&system, scale, args, clients)?,
                        pinned,
                    ));
                }
                runs
            }
            SystemKind::Postgres => {
                let (system, server) = match &args.postgres {
                    Some(conninfo) => (tpcw::postgres::Postgres::connect(conninfo)?, None),
                    None => {
                        let script = tpcw::postgres::Script::file_or(
                            args.postgres_script.clone(),
                            &tpcw::postgres::BUILT_IN,
                        );
                        eprintln!("starting PostgreSQL ({script})");
                        let (pg, server) = tpcw::postgres::Postgres::start_scratch(&script)?;
                        (pg, Some(server))
                    }
                };
                // A server of the user's own may be on another host: its disk is not
                // this process's to watch.
                let disk = server.as_ref().map(|server| DiskFloor {
                    dir: server.dir().to_path_buf(),
                    bytes: args.postgres_disk_floor_mib.saturating_mul(1 << 20),
                });
                load_and_run_watching(&system, scale, args, clients, disk)?
            }
            SystemKind::TwoPc => {
                let exe = std::env::current_exe().context("locating the namdb binary")?;
                let launch = tpcw::twopc::Launch::Processes { exe };
                let system = tpcw::twopc::TwoPc::start(launch, args.resource_managers as usize)?;
                load_and_run(&system, scale, args, clients)?
            }
        };
        reports.extend(runs);
    }
    Ok((reports, htap))
}

/// The client counts of the runs: `--clients`, or powers of two up to it.
fn client_counts(args: &TpcwArgs) -> Vec<usize> {
    let most = args.clients as usize;
    if !args.sweep {
        return vec![most];
    }
    let mut counts: Vec<usize> = std::iter::successors(Some(1usize), |c| Some(c * 2))
        .take_while(|&c| c < most)
        .collect();
    counts.push(most);
    counts
}

enum Workdir {
    /// Removed when dropped, and on Ctrl-C (the memory servers it holds the logs and
    /// sockets of stop with their parent).
    Temp {
        dir: tempfile::TempDir,
        _on_interrupt: crate::interrupt::Registered,
    },
    Kept(PathBuf),
}

impl Workdir {
    fn path(&self) -> &Path {
        match self {
            Workdir::Temp { dir, .. } => dir.path(),
            Workdir::Kept(p) => p,
        }
    }

    /// After a failed run: a temporary directory that processes used (the memory
    /// servers' logs, token and, with `--durable`, data) is kept, and said so, as the
    /// logs are what tells why a server failed or a check found a lost write; one left
    /// empty (the embedded sim, 2pc, PostgreSQL) goes as after a run that passed. An
    /// interrupt removes it whatever happened (see [`crate::interrupt`]).
    fn keep_if_used(self) {
        let Workdir::Temp { dir, _on_interrupt } = self else {
            return;
        };
        let used = std::fs::read_dir(dir.path()).is_ok_and(|mut d| d.next().is_some());
        if !used {
            return;
        }
        // Unregistered first: a Ctrl-C after this must not remove what was kept.
        drop(_on_interrupt);
        let kept = dir.keep();
        eprintln!(
            "the memory servers' files (their logs; with --durable, their data) are kept in \
             {} (remove it when done; --dir DIR puts them in DIR)",
            kept.display()
        );
    }
}

fn threads(args: &TpcwArgs) -> usize {
    args.threads
        .map(|t| t as usize)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(2, |n| n.get()))
}

/// Memory-server processes, stopped when dropped.
struct MemoryServers {
    entries: Vec<ProcessEntry>,
    token_file: PathBuf,
}

impl Drop for MemoryServers {
    fn drop(&mut self) {
        stop_all(self.entries.iter(), &self.token_file);
    }
}

/// Interactions per second the tables leave room for, by backend (a run beyond it
/// fails with a clear "table full" error).
fn interactions_per_sec(backend: BackendKind) -> f64 {
    match backend {
        // Room is memory (pinned whole by default), and the indexes are touched all
        // over early in a run: more than twice the rates measured here (README,
        // "TPC-W").
        BackendKind::Sim => 400_000.0,
        _ => 300_000.0,
    }
}

/// Refuses, before anything starts, a run whose tables' indexes and loaded rows do
/// not fit in the memory this host has available: they are touched from the start,
/// so the run would end with the kernel's OOM killer. (What the runs insert later the
/// runner watches: it stops a run early when memory runs low.) `bytes_for(s)` is what
/// the tables take with room for `s` seconds of runs.
///
/// On memory-server processes (`servers`: `Some(processes)`) every server's region
/// must fit whole as well: a server allocates its region's pages at start (shared
/// memory, which the kernel cannot reclaim) and refuses a region larger than what the
/// host has left. An HTAP run on shm (5 runs, sized for 300 000 interactions/s) asked
/// for two 11.7 GiB regions on a 24 GiB host, and the second server's refusal was the
/// first the user heard of it.
fn ensure_tables_fit(
    runs: usize,
    seconds: f64,
    backend: BackendKind,
    servers: Option<u64>,
    bytes_for: &dyn Fn(f64) -> tpcw::system::Result<tpcw::rsi::TableBytes>,
) -> Result<()> {
    let Some(host) = fabric::HostMemory::now() else {
        return Ok(());
    };
    tables_fit(&host, runs, seconds, backend, servers, bytes_for)
}

/// [`ensure_tables_fit`] on `host`, for `runs` runs of `seconds` in all.
fn tables_fit(
    host: &fabric::HostMemory,
    runs: usize,
    seconds: f64,
    backend: BackendKind,
    servers: Option<u64>,
    bytes_for: &dyn Fn(f64) -> tpcw::system::Result<tpcw::rsi::TableBytes>,
) -> Result<()> {
    let usable = host.spare();
    let bytes = bytes_for(seconds)?;
    let need = bytes.touched_from_the_start;
    let regions = |total: u64| servers.map_or(0, |n| n * region_per_server(total, n));
    if need <= usable && regions(bytes.total) <= usable {
        return Ok(());
    }
    // Tables grow linearly with the room: how long a run fits whole, inserts included,
    // even at the rate the room is sized for (and, on processes, with each server's
    // region within what the host can back).
    let fits = |total: u64| total <= usable && regions(total) <= usable;
    let (none, some) = (bytes_for(0.0)?.total, bytes_for(100.0)?.total);
    let hint = if fits(none) {
        let per_second = (some - none) as f64 / 100.0;
        let mut longest = ((usable - none) as f64 / per_second).floor();
        while longest > 0.0 && !fits(bytes_for(longest)?.total) {
            longest = (longest * 0.95).floor();
        }
        let each = (longest / runs as f64).floor();
        if runs == 1 {
            format!(
                "a --duration plus --warmup of up to about {each:.0} s fits, or use fewer --items"
            )
        } else {
            format!(
                "--duration plus --warmup of up to about {each:.0} s fit ({runs} runs: a sweep's \
                 client counts, or --htap's 2 × --htap-rounds + 1), or use fewer --items"
            )
        }
    } else {
        "use fewer --items or --ebs".to_string()
    };
    let rate = interactions_per_sec(backend);
    if need > usable {
        bail!(
            "with room for {seconds:.0} s of runs at up to {rate:.0} interactions/s, the \
             tables' indexes and loaded rows need {} MiB from the start, but this host has \
             {} MiB available and a run keeps {} MiB free: {hint}",
            need >> 20,
            host.available >> 20,
            host.reserve() >> 20
        )
    }
    let n = servers.unwrap_or(1);
    bail!(
        "with room for {seconds:.0} s of runs at up to {rate:.0} interactions/s, the {n} \
         memory-server processes need regions of {} MiB each, which they allocate whole \
         when they start: {} MiB in all, but this host has {} MiB available and a run \
         keeps {} MiB free: {hint}",
        region_per_server(bytes.total, n) >> 20,
        regions(bytes.total) >> 20,
        host.available >> 20,
        host.reserve() >> 20
    )
}

/// The region of each of `servers` memory servers for tables of `total` bytes. Hash
/// partitioning spreads rows evenly to within a few percent; the rest is the oracle's
/// and the catalog's.
fn region_per_server(total: u64, servers: u64) -> u64 {
    (total / servers + total / servers / 8 + (64 << 20)).next_multiple_of(2 << 20)
}

/// Refuses, before anything starts, a 2PC run whose loaded population would not fit in
/// the memory this host has available: its RMs hold every row on their heaps, so the
/// load would end with the kernel's OOM killer (hours into it, at large `--ebs`).
fn ensure_twopc_fits(scale: &Scale) -> Result<()> {
    let Some(host) = fabric::HostMemory::now() else {
        return Ok(());
    };
    let usable = host.spare();
    let need = tpcw::twopc::loaded_bytes(scale);
    if need <= usable {
        return Ok(());
    }
    let hint = ebs_hint(scale, usable, tpcw::twopc::loaded_bytes)?;
    bail!(
        "2pc's resource managers would hold about {} MiB once loaded ({} items, {} EBs), \
         but this host has {} MiB available and a run keeps {} MiB free: {hint}",
        need >> 20,
        scale.items,
        scale.ebs,
        host.available >> 20,
        host.reserve() >> 20
    )
}

/// What fits in `usable` bytes when `bytes(scale)` do not: the most `--ebs` at
/// `scale`'s items, or fewer items.
fn ebs_hint(scale: &Scale, usable: u64, bytes: fn(&Scale) -> u64) -> Result<String> {
    let fits = |ebs| {
        Scale::new(scale.items, ebs, scale.item_bytes)
            .map(|s| bytes(&s) <= usable)
            .map_err(anyhow::Error::msg)
    };
    if !fits(1)? {
        return Ok("use fewer --items".to_string());
    }
    // Bisected rather than extrapolated: the estimates sample the population, so they
    // are not exactly linear in the browsers, and the hint must name a size that fits.
    let (mut good, mut bad) = (1, scale.ebs.max(2));
    while bad - good > 1 {
        let mid = good + (bad - good) / 2;
        if fits(mid)? {
            good = mid;
        } else {
            bad = mid;
        }
    }
    Ok(format!("--ebs {good} or fewer fits"))
}

/// Disk space a scratch PostgreSQL leaves free beside its database: a full disk stops
/// the server mid-run, and the host needs room too.
const POSTGRES_DISK_RESERVE: u64 = 1 << 30;

/// Refuses, before a server starts, a scratch PostgreSQL run whose loaded database
/// would not fit on the filesystem of `parent`, where its directory goes: the load
/// would run for hours (at large `--ebs`) and end with a full disk.
fn ensure_postgres_fits(scale: &Scale, parent: &Path) -> Result<()> {
    // A filesystem that cannot say is let through, as a host without /proc/meminfo is.
    let Ok(fs) = rustix::fs::statvfs(parent) else {
        return Ok(());
    };
    let free = fs.f_bavail.saturating_mul(fs.f_frsize);
    postgres_fit(scale, parent, free)
}

/// [`ensure_postgres_fits`] with `free` bytes on `parent`'s filesystem.
fn postgres_fit(scale: &Scale, parent: &Path, free: u64) -> Result<()> {
    let usable = free.saturating_sub(POSTGRES_DISK_RESERVE);
    let need = tpcw::postgres::loaded_bytes(scale);
    if need <= usable {
        return Ok(());
    }
    let hint = ebs_hint(scale, usable, tpcw::postgres::loaded_bytes)?;
    bail!(
        "PostgreSQL would take about {} MiB of disk once loaded ({} items, {} EBs, its \
         write-ahead log included), but {} has {} MiB free and a run keeps {} MiB free: \
         {hint}, or point TMPDIR at a roomier filesystem, or use --postgres with a server \
         of your own",
        need >> 20,
        scale.items,
        scale.ebs,
        parent.display(),
        free >> 20,
        POSTGRES_DISK_RESERVE >> 20
    )
}

/// What the start-up line adds when the memory servers pin their memory.
fn pinning_note(pinning: &Pinning) -> &'static str {
    match pinning {
        Pinning::Pinned => ", pinning their memory (--lazy-memory skips it)",
        Pinning::Lazy { .. } => "",
    }
}

/// Whether RSI's memory servers back all of their memory before loading.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Pinning {
    Pinned,
    /// Backed as it is first touched; `note` says why when the user did not ask.
    Lazy {
        note: Option<String>,
    },
}

impl Pinning {
    fn pinned(&self) -> bool {
        *self == Pinning::Pinned
    }
}

/// [`Pinning`] for regions of `bytes` in all: what `--pin-memory` or `--lazy-memory`
/// asks for, else pinned when `host` can spare all of it. Pinning is the default
/// because lazily backed memory makes the run pay the kernel for every fresh page
/// (the indexes are written all over), which an RNIC's registered memory never does:
/// checkout on the sim measured 134 k txn/s lazily backed against 157 k pinned
/// (medians of three interleaved pairs). A host
/// that cannot say what it has pins, and `HeapMemory::pinned` checks nothing more.
fn pinning(args: &TpcwArgs, bytes: u64, host: Option<&fabric::HostMemory>) -> Pinning {
    if args.lazy_memory {
        return Pinning::Lazy { note: None };
    }
    match host {
        Some(host) if !args.pin_memory && bytes > host.spare() => Pinning::Lazy {
            note: Some(format!(
                "not pinning the memory servers' {} MiB: this host can spare {} MiB, so \
                 their memory is backed as it is first touched, and the run waits on the \
                 kernel zeroing fresh pages (slower, with a higher p99; a shorter \
                 --duration fits, and --lazy-memory asks for this without the note)",
                bytes >> 20,
                host.spare() >> 20
            )),
        },
        _ => Pinning::Pinned,
    }
}

/// Says so when memory-server regions are on ordinary pages, with the setting that
/// fixes it: TPC-W's random accesses over gigabytes of tables and indexes miss the TLB
/// on 4 KiB pages (checkout on shm measured about 10% slower than on huge pages). A
/// memfd region gets huge pages only from the host's reserved pool; the sim's regions
/// are anonymous memory on transparent huge pages and need nothing.
fn huge_page_hint(servers: &[std::sync::Arc<compute_node::RemoteServer>]) {
    // Only a hint: a server that cannot say is left out.
    let stats: Vec<_> = servers.iter().filter_map(|s| s.stats().ok()).collect();
    if let Some(note) = huge_page_note(&stats) {
        eprintln!("note: {note}");
    }
}

/// [`huge_page_hint`]'s words for the servers' `stats`, if any region is on ordinary
/// pages.
fn huge_page_note(stats: &[memory_server::Stats]) -> Option<String> {
    let regions: u64 = stats.iter().map(|s| u64::from(s.regions)).sum();
    let huge: u64 = stats.iter().map(|s| u64::from(s.huge_page_regions)).sum();
    let bytes: u64 = stats.iter().map(|s| s.bytes_allocated).sum();
    // Each region rounds up to whole 2 MiB pages.
    let pages = bytes.div_ceil(2 << 20) + regions;
    (huge < regions).then(|| {
        format!(
            "{} of {regions} memory-server regions are on 4 KiB pages (the host has too few \
             free huge pages); reserving {pages} (as root: `sysctl vm.nr_hugepages={pages}`) \
             puts them on 2 MiB pages, about 10% faster",
            regions - huge
        )
    })
}

fn start_rsi(
    args: &TpcwArgs,
    backend: BackendKind,
    scale: &Scale,
    clients: &[usize],
    dir: &Path,
) -> Result<(Rsi, bool)> {
    // An HTAP run measures the clients twice a round (alone, beside the analytics),
    // after a warm-up run.
    let runs = if args.htap {
        2 * args.htap_rounds as usize + 1
    } else {
        clients.len()
    };
    let seconds = runs as f64 * (args.duration + args.warmup);
    let versions = |rel: Rel| {
        if rel == Rel::Item && args.item_versions != 1 {
            Some(args.item_versions)
        } else if args.htap {
            tpcw::htap::htap_table_versions(rel)
        } else {
            None
        }
    };
    let all_clients: usize = clients.iter().sum();
    let servers = args.memory_servers as u64;
    let room_for = |seconds: f64| {
        Room::for_runs(
            args.mix,
            seconds,
            interactions_per_sec(backend),
            all_clients as u64,
        )
    };
    let bytes_for =
        |seconds: f64| tpcw::rsi::table_bytes(scale, &room_for(seconds), servers as u32, &versions);
    let processes = (backend != BackendKind::Sim).then_some(servers);
    ensure_tables_fit(runs, seconds, backend, processes, &bytes_for)?;
    let room = room_for(seconds);
    let per_server = region_per_server(bytes_for(seconds)?.total, servers);
    let pinning = pinning(
        args,
        per_server.saturating_mul(servers),
        fabric::HostMemory::now().as_ref(),
    );
    if let Pinning::Lazy { note: Some(note) } = &pinning {
        eprintln!("note: {note}");
    }
    let slots = threads(args) as u32
        + 4
        + if args.htap {
            args.analytics_nodes + 2
        } else {
            0
        };
    // A transaction's buffer, and a slot's commit-log area, for the largest write set
    // (16 KiB items outgrow txn's defaults).
    let scratch_bytes = tpcw::rsi::scratch_bytes_with(scale, &room, servers as u32, &versions)?;
    let mut options = txn::Options {
        servers: servers as usize,
        server_bytes: per_server,
        slots,
        scratch_bytes,
        sim: fabric::sim::SimConfig {
            pin_memory: pinning.pinned(),
            ..Default::default()
        },
        ..txn::Options::default()
    };
    options.oracle.lease_timeout = tpcw::rsi::BENCHMARK_LEASE;
    options.log_bytes_per_slot = options.log_bytes_per_slot.max(scratch_bytes);
    let mut system = match backend {
        BackendKind::Sim => {
            eprintln!(
                "embedded sim cluster: {servers} memory servers of {}{} MiB each{}",
                if pinning.pinned() { "" } else { "up to " },
                per_server >> 20,
                pinning_note(&pinning)
            );
            let started = Instant::now();
            let db = txn::Database::embedded(options)?;
            if pinning.pinned() {
                eprintln!("pinned in {:.1} s", started.elapsed().as_secs_f64());
            }
            Rsi::new(db, "sim".into(), room, Box::new(()))
        }
        backend => {
            // A directory per backend: a run over several starts a cluster for each.
            let dir = &dir.join(backend.name());
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
            let token_file = dir.join("token");
            memory_server::generate_token_file(&token_file)?;
            let token = memory_server::ClusterToken::from_file(&token_file)?;
            let mut servers_up = MemoryServers {
                entries: Vec::new(),
                token_file: token_file.clone(),
            };
            eprintln!(
                "starting {servers} {} memory servers of {} MiB each{}",
                backend.name(),
                per_server >> 20,
                pinning_note(&pinning)
            );
            for i in 0..servers {
                let name = format!("memory-server-{i}");
                let parent = std::process::id().to_string();
                let argv: Vec<String> = [
                    "memory-server",
                    // Killed before it stops them, this run must not leave them running
                    // (with their memory) behind it.
                    "--exit-with-parent",
                    &parent,
                    "--listen",
                    "127.0.0.1:0",
                    "--token-file",
                    &token_file.display().to_string(),
                    "--backend",
                    backend.name(),
                    "--size",
                    &per_server.to_string(),
                    // One region: a big table's partition must fit in one.
                    "--region-size",
                    &per_server.to_string(),
                ]
                .into_iter()
                .map(String::from)
                .chain(pinning.pinned().then(|| "--pin-memory".to_string()))
                .chain(
                    args.durable
                        .then(|| {
                            [
                                "--data-dir".to_string(),
                                dir.join(format!("{name}.data")).display().to_string(),
                            ]
                        })
                        .into_iter()
                        .flatten(),
                )
                .collect();
                let entry = spawn(
                    &name,
                    "memory server",
                    &argv,
                    &dir.join(format!("{name}.log")),
                )?;
                servers_up.entries.push(entry);
            }
            let addrs: Vec<String> = servers_up
                .entries
                .iter()
                .map(|e| e.address.clone())
                .collect();
            let remote = compute_node::connect(&addrs, &token, options)
                .context("connecting to the memory servers")?;
            // Outside the run's directory, so not removed with it on Ctrl-C.
            let sockets_on_interrupt = crate::interrupt::remove_on_interrupt(remote.sockets_dir())?;
            huge_page_hint(&remote.servers);
            let backend = if remote.db.is_durable() {
                format!("{}+durable", remote.backend)
            } else {
                remote.backend.clone()
            };
            let db = remote.db.clone();
            Rsi::new(
                db,
                backend,
                room,
                Box::new((remote, servers_up, sockets_on_interrupt)),
            )
        }
    };
    system.create_tables_with(scale, &versions)?;
    Ok((system, pinning.pinned()))
}

/// `runs` of RSI, saying whether its memory servers' memory was pinned.
fn with_pinning(runs: Vec<RunReport>, pinned: bool) -> Vec<RunReport> {
    runs.into_iter()
        .map(|run| RunReport {
            pinned_memory: Some(pinned),
            ..run
        })
        .collect()
}

/// Loads `system` with progress, then runs every client count.
fn load_and_run<S: System>(
    system: &S,
    scale: &Scale,
    args: &TpcwArgs,
    clients: &[usize],
) -> Result<Vec<RunReport>> {
    load_and_run_watching(system, scale, args, clients, None)
}

/// [`load_and_run`], each run stopping early when `disk`'s filesystem runs low.
fn load_and_run_watching<S: System>(
    system: &S,
    scale: &Scale,
    args: &TpcwArgs,
    clients: &[usize],
    disk: Option<DiskFloor>,
) -> Result<Vec<RunReport>> {
    load(system, scale)?;
    let mut ledger = Ledger::default();
    let mut reports = Vec::new();
    for &n in clients {
        let config = RunConfig {
            mix: args.mix,
            clients: n,
            threads: threads(args),
            warmup: Duration::from_secs_f64(args.warmup),
            duration: Duration::from_secs_f64(args.duration),
            sample_every: args.sample_every,
            progress: true,
            seed: args.seed,
            stop_below_available: runner::memory_floor(),
            stop_below_free_disk: disk.clone(),
            unknown_outcome_patience: runner::UNKNOWN_OUTCOME_PATIENCE,
        };
        eprintln!(
            "{} ({}): {} with {n} clients for {} s after {} s of warm-up",
            system.name(),
            system.backend(),
            args.mix.name(),
            args.duration,
            args.warmup
        );
        let report = runner::run(system, scale, &config, &mut ledger)?;
        eprintln!(
            "  {:.0} txn/s, abort rate {:.2}%, p50 {} µs, p99 {} µs",
            report.txn_per_sec,
            report.abort_rate * 100.0,
            latency_cell(report.p50_us),
            latency_cell(report.p99_us)
        );
        if let Some(why) = &report.stopped_early {
            eprintln!("  {why}");
        }
        if let Some(unknown) = &report.unknown_outcomes {
            eprintln!("  {unknown}");
        }
        reports.push(report);
    }
    Ok(reports)
}

/// The phases of `rounds` rounds of an HTAP comparison, in the order they run: alone
/// first in even rounds, with the analytics first in odd ones (alone, with, with,
/// alone, …), so that whatever changes over the runs (the tables grow, the machine
/// drifts) falls on both phases alike instead of always favouring the second.
fn htap_order(rounds: u32) -> Vec<Phase> {
    (0..rounds)
        .flat_map(|round| {
            if round % 2 == 0 {
                [Phase::Alone, Phase::WithAnalytics]
            } else {
                [Phase::WithAnalytics, Phase::Alone]
            }
        })
        .collect()
}

/// Loads RSI, runs the clients once unmeasured (the first run on freshly loaded
/// tables and freshly mapped memory ran faster or slower than any after it), then
/// `--htap-rounds` rounds of the clients alone and beside analytics nodes running
/// TPC-W's analytical queries (`tpcw::htap`), in [`htap_order`]; the summary compares
/// the two phases' median runs.
fn load_and_run_htap(
    system: &Rsi,
    scale: &Scale,
    args: &TpcwArgs,
    clients: usize,
) -> Result<(Vec<RunReport>, HtapSummary)> {
    load(system, scale)?;
    let config = RunConfig {
        mix: args.mix,
        clients,
        threads: threads(args),
        warmup: Duration::from_secs_f64(args.warmup),
        duration: Duration::from_secs_f64(args.duration),
        sample_every: args.sample_every,
        progress: true,
        seed: args.seed,
        stop_below_available: runner::memory_floor(),
        stop_below_free_disk: None,
        unknown_outcome_patience: runner::UNKNOWN_OUTCOME_PATIENCE,
    };
    let mut ledger = Ledger::default();
    let tables = tpcw::htap::Tables::of(system.tables());
    let htap_config = tpcw::htap::HtapConfig {
        nodes: args.analytics_nodes as usize,
        check_every: args.htap_check_every,
        best_sellers_per_related: args.htap_best_sellers_per_related,
        ..tpcw::htap::HtapConfig::default()
    };
    eprintln!("reading the item subjects");
    let subjects = {
        let worker = system.database().worker()?;
        tpcw::htap::item_subjects(&worker, &tables.item, &htap_config.scan)?
    };
    eprintln!(
        "rsi ({}): {} with {clients} clients, no analytics: a warm-up run, not reported",
        system.backend(),
        args.mix.name()
    );
    let warm_up = runner::run(system, scale, &config, &mut ledger)?;
    eprintln!("  {:.0} txn/s (warm-up)", warm_up.txn_per_sec);
    ensure!(
        warm_up.checks_passed(),
        "the checks of the warm-up run failed: {}",
        checks_line(&warm_up)
    );
    let mut reports = Vec::new();
    let mut analytics_of = Vec::new();
    let order = htap_order(args.htap_rounds);
    for (i, &phase) in order.iter().enumerate() {
        eprintln!(
            "rsi ({}): {} with {clients} clients, {} (run {} of {}, round {} of {})",
            system.backend(),
            args.mix.name(),
            match phase {
                Phase::Alone => "no analytics".to_string(),
                Phase::WithAnalytics => format!(
                    "beside {} analytics node{}",
                    htap_config.nodes,
                    if htap_config.nodes == 1 { "" } else { "s" }
                ),
            },
            i + 1,
            order.len(),
            i / 2 + 1,
            args.htap_rounds
        );
        let report = match phase {
            Phase::Alone => {
                let alone = runner::run(system, scale, &config, &mut ledger)?;
                eprintln!("  {:.0} txn/s", alone.txn_per_sec);
                alone
            }
            Phase::WithAnalytics => {
                let (with, analytics) = run_beside_analytics(
                    system,
                    scale,
                    &config,
                    &mut ledger,
                    &tables,
                    &subjects,
                    &htap_config,
                )?;
                analytics_of.push((reports.len(), analytics));
                with
            }
        };
        reports.push(RunReport {
            phase: Some(phase),
            ..report
        });
    }
    let of_phase = |phase: Phase| -> Vec<usize> {
        (0..reports.len())
            .filter(|&i| reports[i].phase == Some(phase))
            .collect()
    };
    // The median run of each phase (the lower one of an even count: a run that
    // happened), and the analytics of the median run beside them.
    let median = |runs: &[usize]| -> Result<usize> {
        let tps: Vec<f64> = runs.iter().map(|&i| reports[i].txn_per_sec).collect();
        crate::bench::median_run(&tps)
            .map(|m| runs[m])
            .context("an HTAP phase without runs")
    };
    let (alone, with) = (of_phase(Phase::Alone), of_phase(Phase::WithAnalytics));
    let (alone_median, with_median) = (median(&alone)?, median(&with)?);
    let analytics = analytics_of
        .iter()
        .find(|(i, _)| *i == with_median)
        .map(|(_, a)| a.clone())
        .context("the median run's analytics")?;
    let summary = HtapSummary {
        backend: system.backend(),
        clients,
        rounds: args.htap_rounds,
        txn_per_sec_alone: reports[alone_median].txn_per_sec,
        txn_per_sec_with_analytics: reports[with_median].txn_per_sec,
        txn_per_sec_alone_runs: alone.iter().map(|&i| reports[i].txn_per_sec).collect(),
        txn_per_sec_with_analytics_runs: with.iter().map(|&i| reports[i].txn_per_sec).collect(),
        analytics,
        analytics_runs: analytics_of.into_iter().map(|(_, a)| a).collect(),
    };
    Ok((reports, summary))
}

/// One run of the clients while the analytics nodes run until its measured period
/// ends: the clients' report, and the analytics'.
fn run_beside_analytics(
    system: &Rsi,
    scale: &Scale,
    config: &RunConfig,
    ledger: &mut Ledger,
    tables: &tpcw::htap::Tables,
    subjects: &std::collections::HashMap<u64, u8>,
    htap_config: &tpcw::htap::HtapConfig,
) -> Result<(RunReport, tpcw::htap::HtapReport)> {
    let stop = std::sync::atomic::AtomicBool::new(false);
    let run_done = std::sync::atomic::AtomicBool::new(false);
    let measured = config.warmup + config.duration;
    let rewrites = runner::ItemRewrites::default();
    let (with, analytics) = std::thread::scope(|s| {
        let analytics = s.spawn(|| {
            tpcw::htap::run_analytics(
                system.database(),
                tables,
                subjects,
                htap_config,
                &stop,
                &rewrites,
            )
        });
        // The analytics stop with the measured period (or when the run ends early).
        s.spawn(|| {
            let Some(start) = rewrites.wait_for_clients(&run_done) else {
                stop.store(true, std::sync::atomic::Ordering::Relaxed);
                return;
            };
            while start.elapsed() < measured && !run_done.load(std::sync::atomic::Ordering::Relaxed)
            {
                std::thread::sleep(Duration::from_millis(20));
            }
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
        });
        let with = runner::run_beside(system, scale, config, ledger, &rewrites);
        run_done.store(true, std::sync::atomic::Ordering::Relaxed);
        (
            with,
            analytics.join().expect("the analytics thread panicked"),
        )
    });
    let (with, analytics) = (with?, analytics?);
    eprintln!(
        "  {:.0} txn/s; {:.2} queries/s, {:.0} rows scanned/s",
        with.txn_per_sec, analytics.queries_per_sec, analytics.rows_scanned_per_sec
    );
    Ok((with, analytics))
}

fn print_htap(h: &HtapSummary, mix: Mix) {
    let a = &h.analytics;
    println!();
    println!(
        "HTAP (rsi, {}, {} clients, median of {} run{} each, alternating after a warm-up \
         run): {} {:.0} txn/s {}, {:.0} txn/s {} ({:.2}x)",
        h.backend,
        h.clients,
        h.rounds,
        if h.rounds == 1 { "" } else { "s" },
        mix.name(),
        h.txn_per_sec_alone,
        Phase::Alone.name(),
        h.txn_per_sec_with_analytics,
        Phase::WithAnalytics.name(),
        if h.txn_per_sec_alone > 0.0 {
            h.txn_per_sec_with_analytics / h.txn_per_sec_alone
        } else {
            0.0
        }
    );
    println!(
        "{:<15} {:>7} {:>10} {:>10} {:>10}",
        "query", "count", "per s", "p50 ms", "p99 ms"
    );
    // A query that never ran has no latency: a dash, not 0.0.
    let ms = |v: Option<f64>| v.map_or_else(|| "-".to_string(), |v| format!("{v:.1}"));
    println!(
        "{:<15} {:>7} {:>10.2} {:>10} {:>10}",
        "best sellers",
        a.best_sellers,
        a.best_sellers as f64 / a.seconds,
        ms(a.best_sellers_p50_ms),
        ms(a.best_sellers_p99_ms)
    );
    println!(
        "{:<15} {:>7} {:>10.2} {:>10} {:>10}",
        "related items",
        a.related_updates,
        a.related_updates as f64 / a.seconds,
        ms(a.related_p50_ms),
        ms(a.related_p99_ms)
    );
    println!(
        "{} analytics node{}: {:.2} queries/s, {:.0} rows scanned/s ({:.0} MB/s read), {} blocks re-read, {} retries at a fresh snapshot; Best Sellers checked against a single node: {} of {} equal",
        a.nodes,
        if a.nodes == 1 { "" } else { "s" },
        a.queries_per_sec,
        a.rows_scanned_per_sec,
        a.bytes_read as f64 / a.seconds / 1e6,
        a.rereads,
        a.too_old_retries,
        a.checked - a.mismatches,
        a.checked
    );
}

/// Loads the generated data, printing progress about once a second.
fn load<S: System>(system: &S, scale: &Scale) -> Result<()> {
    let started = Instant::now();
    let last = Mutex::new(Instant::now());
    eprintln!(
        "loading {} items, {} customers, {} orders into {} ({})",
        scale.items,
        scale.customers(),
        scale.orders(),
        system.name(),
        system.backend()
    );
    system.load(scale, &|rel: Rel, done, total| {
        let mut last = last.lock().unwrap_or_else(|e| e.into_inner());
        if last.elapsed() >= Duration::from_secs(1) || done == total {
            *last = Instant::now();
            eprintln!(
                "  {:>18}: {done:>9} of {total} ({:.1} s)",
                rel.name(),
                started.elapsed().as_secs_f64()
            );
        }
    })?;
    eprintln!("loaded in {:.1} s", started.elapsed().as_secs_f64());
    Ok(())
}

fn print_summary(args: &TpcwArgs, reports: &[RunReport]) {
    println!();
    println!(
        "TPC-W {} — {} items, {} EBs, {}-byte items, {} s per run",
        args.mix.name(),
        args.items,
        args.ebs,
        args.item_bytes,
        args.duration
    );
    // HTAP's two runs differ only in their phase: a column then tells them apart.
    let phases = reports.iter().any(|r| r.phase.is_some());
    let phase_cell = |phase: &str| {
        if phases {
            format!(" {phase:<14}")
        } else {
            String::new()
        }
    };
    println!(
        "{:<9} {:<11}{} {:>7} {:>13} {:>8} {:>10} {:>10} {:>11}  checks",
        "system",
        "backend",
        phase_cell("phase"),
        "clients",
        "txn/s",
        "aborts",
        "p50 µs",
        "p99 µs",
        "committed"
    );
    for r in reports {
        println!(
            "{:<9} {:<11}{} {:>7} {:>13.0} {:>7.2}% {:>10} {:>10} {:>11}  {}",
            r.system,
            r.backend,
            phase_cell(r.phase.map_or("", Phase::name)),
            r.clients,
            r.txn_per_sec,
            r.abort_rate * 100.0,
            latency_cell(r.p50_us),
            latency_cell(r.p99_us),
            r.committed,
            checks_line(r)
        );
    }
    for r in reports {
        if let Some(why) = &r.stopped_early {
            println!(
                "note: {} ({}) at {} clients {why}",
                r.system, r.backend, r.clients
            );
        }
        if let Some(unknown) = &r.unknown_outcomes {
            println!(
                "note: {} ({}) at {} clients: {unknown}",
                r.system, r.backend, r.clients
            );
        }
    }
    if args.mix != Mix::Checkout {
        for r in reports {
            println!(
                "\n{} ({}), {} clients{}, per interaction:",
                r.system,
                r.backend,
                r.clients,
                r.phase.map_or(String::new(), |p| format!(", {}", p.name()))
            );
            println!(
                "  {:<22} {:>12} {:>9} {:>10} {:>10}",
                "interaction", "txn/s", "aborts", "p50 µs", "p99 µs"
            );
            for i in &r.interactions {
                println!(
                    "  {:<22} {:>12.1} {:>9} {:>10} {:>10}",
                    i.interaction.name(),
                    i.txn_per_sec,
                    i.aborted,
                    latency_cell(i.p50_us),
                    latency_cell(i.p99_us)
                );
            }
        }
    }
    // Ratios of RSI to each baseline at the same client count.
    for r in reports.iter().filter(|r| r.system == "rsi") {
        for b in reports
            .iter()
            .filter(|b| b.system != "rsi" && b.clients == r.clients && b.txn_per_sec > 0.0)
        {
            println!(
                "rsi ({}) / {} at {} clients: {}",
                r.backend,
                b.system,
                r.clients,
                times(r.txn_per_sec / b.txn_per_sec)
            );
        }
    }
}

/// A ratio to at least two significant digits: with one decimal, durable RSI at 96
/// txn/s against 2PC's 4 363 printed as "0.0x".
fn times(ratio: f64) -> String {
    let decimals = if ratio > 0.0 && ratio.is_finite() {
        (1.0 - ratio.log10().floor()).clamp(1.0, 6.0) as usize
    } else {
        1
    };
    format!("{ratio:.decimals$}x")
}

/// A latency in µs, or a dash where nothing committed to have one.
fn latency_cell(us: Option<f64>) -> String {
    us.map_or_else(|| "-".to_string(), |us| format!("{us:.1}"))
}

fn checks_line(r: &RunReport) -> String {
    let c = &r.checks;
    let mut parts = vec![
        format!(
            "stock {}",
            if c.stock_conserved { "ok" } else { "VIOLATED" }
        ),
        format!("orders {}", if c.orders_present { "ok" } else { "MISSING" }),
    ];
    if let Some(v) = &c.history_verdict {
        parts.push(format!("SI {v} ({} txns)", c.history_txns));
    }
    parts.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: TpcwArgs,
    }

    const GIB: u64 = 1 << 30;

    /// A 16 GiB host with 12 GiB available, of which a run may take 11.
    fn host_with_11_gib_to_spare() -> fabric::HostMemory {
        fabric::HostMemory {
            total: 16 * GIB,
            available: 12 * GIB,
            swap_total: 0,
        }
    }

    /// Memory is pinned unless the host cannot spare it all (then backed lazily, with a
    /// note naming both sizes) or the user says otherwise; `--pin-memory` insists even
    /// where it will not fit, so the pinning itself reports the shortage.
    #[test]
    fn memory_is_pinned_by_default_when_the_host_can_spare_it() {
        let host = host_with_11_gib_to_spare();
        let parse = |extra: &[&str]| {
            Cli::try_parse_from(std::iter::once("tpcw").chain(extra.iter().copied()))
                .unwrap()
                .args
        };
        let default = parse(&[]);
        assert_eq!(pinning(&default, 11 * GIB, Some(&host)), Pinning::Pinned);
        assert_eq!(pinning(&default, 40 * GIB, None), Pinning::Pinned);
        match pinning(&default, 11 * GIB + 1, Some(&host)) {
            Pinning::Lazy { note: Some(note) } => {
                assert!(
                    note.contains("11264 MiB: this host can spare 11264 MiB"),
                    "{note}"
                )
            }
            other => panic!("pinned what does not fit: {other:?}"),
        }
        let lazy = parse(&["--lazy-memory"]);
        assert_eq!(
            pinning(&lazy, GIB, Some(&host)),
            Pinning::Lazy { note: None }
        );
        let insist = parse(&["--pin-memory"]);
        assert_eq!(pinning(&insist, 40 * GIB, Some(&host)), Pinning::Pinned);
        let both = Cli::try_parse_from(["tpcw", "--pin-memory", "--lazy-memory"]);
        assert!(
            both.is_err(),
            "--pin-memory and --lazy-memory both accepted"
        );
    }

    /// On memory-server processes the regions, allocated whole at start, must fit as
    /// well as what the tables touch from the start; the hint names a length that fits.
    /// Before, only the touched part was checked, and a run whose servers could not
    /// allocate their regions started and failed at the second server.
    #[test]
    fn a_run_is_refused_when_its_memory_servers_regions_do_not_fit() {
        let host = host_with_11_gib_to_spare();
        assert_eq!(host.spare(), 11 * GIB);
        let bytes_for = |s: f64| {
            Ok(tpcw::rsi::TableBytes {
                total: GIB + (s * 100.0) as u64 * (1 << 20),
                touched_from_the_start: GIB / 2 + (s * 10.0) as u64 * (1 << 20),
            })
        };
        let fit = |runs: usize, seconds: f64, backend, servers| {
            tables_fit(&host, runs, seconds, backend, servers, &bytes_for)
        };
        // 6.9 GiB of tables: two regions of 3.9 GiB fit.
        fit(5, 60.0, BackendKind::Shm, Some(2)).unwrap();
        // 10.8 GiB: on the sim only what is touched counts (1.5 GiB); two regions of
        // 6.1 GiB (12.2 in all) do not fit.
        fit(5, 100.0, BackendKind::Sim, None).unwrap();
        let err = fit(5, 100.0, BackendKind::Shm, Some(2))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("the 2 memory-server processes need regions of 6266 MiB each"),
            "{err}"
        );
        assert!(err.contains("12532 MiB in all"), "{err}");
        let each: f64 = err
            .split_once("of up to about ")
            .and_then(|(_, rest)| rest.split_once(' '))
            .and_then(|(n, _)| n.parse().ok())
            .unwrap_or_else(|| panic!("no length in: {err}"));
        assert!(err.contains("(5 runs"), "{err}");
        fit(5, 5.0 * each, BackendKind::Shm, Some(2)).unwrap();
        fit(5, 5.0 * (each + 1.0), BackendKind::Shm, Some(2)).unwrap_err();
        // What is touched from the start is checked as before.
        let err = fit(1, 1100.0, BackendKind::Sim, None)
            .unwrap_err()
            .to_string();
        assert!(err.contains("from the start"), "{err}");
    }

    #[test]
    fn a_postgres_database_beyond_the_free_disk_is_refused_with_what_fits() {
        let parent = Path::new("/scratch");
        let small = Scale::new(1000, 1, 1024).unwrap();
        postgres_fit(&small, parent, 100 << 30).unwrap();
        // The tester's run: 288 M customers.
        let huge = Scale::new(1000, 100_000, 1024).unwrap();
        let err = postgres_fit(&huge, parent, 100 << 30)
            .unwrap_err()
            .to_string();
        assert!(err.contains("/scratch has 102400 MiB free"), "{err}");
        let ebs: u64 = err
            .split("--ebs ")
            .nth(1)
            .and_then(|s| s.split(' ').next())
            .and_then(|s| s.parse().ok())
            .expect("a number of EBs");
        // What it names fits, and one more EB would not.
        let fits =
            |ebs| postgres_fit(&Scale::new(1000, ebs, 1024).unwrap(), parent, 100 << 30).is_ok();
        assert!(ebs > 1 && fits(ebs), "{err}");
        assert!(!fits(ebs + 1), "{err}");
        // 1 GiB of disk holds no database: not even the write-ahead log fits.
        let err = postgres_fit(&small, parent, 1 << 30)
            .unwrap_err()
            .to_string();
        assert!(err.contains("use fewer --items"), "{err}");
    }

    /// The clients alone always ran first (on freshly mapped memory, and before the
    /// tables grew): one small run reported them 1.21x faster beside the analytics.
    #[test]
    fn htap_rounds_alternate_which_phase_runs_first() {
        use Phase::{Alone as A, WithAnalytics as W};
        assert_eq!(htap_order(1), [A, W]);
        assert_eq!(htap_order(2), [A, W, W, A]);
        assert_eq!(htap_order(3), [A, W, W, A, A, W]);
        // Over whole pairs of rounds, each phase runs as often first as second.
        let order = htap_order(4);
        let first = |p| order.chunks(2).filter(|r| r[0] == p).count();
        assert_eq!(first(A), first(W));
        let cli = Cli::parse_from(["t", "--htap"]);
        assert_eq!(
            htap_order(cli.args.htap_rounds),
            [A, W, W, A],
            "the default"
        );
    }

    #[test]
    fn ratios_keep_two_significant_digits() {
        assert_eq!(times(96.0 / 4363.0), "0.022x");
        assert_eq!(times(0.39), "0.39x");
        assert_eq!(times(5.6), "5.6x");
        assert_eq!(times(15.24), "15.2x");
        assert_eq!(times(0.0), "0.0x");
    }

    #[test]
    fn sweeps_double_up_to_the_most_clients() {
        let cli = Cli::parse_from(["t", "--sweep", "--clients", "48"]);
        assert_eq!(client_counts(&cli.args), vec![1, 2, 4, 8, 16, 32, 48]);
        let cli = Cli::parse_from(["t", "--clients", "48"]);
        assert_eq!(client_counts(&cli.args), vec![48]);
    }

    #[test]
    fn the_huge_page_note_counts_the_pages_every_region_needs() {
        let server = |regions, huge_page_regions, bytes_allocated| memory_server::Stats {
            regions,
            huge_page_regions,
            bytes_allocated,
            ..Default::default()
        };
        // Two servers of a 1 MiB catalog region and a 100 MiB data region each.
        let small = server(2, 0, (1 << 20) + (100 << 20));
        let note = huge_page_note(&[small.clone(), small.clone()]).expect("a note");
        assert!(note.starts_with("4 of 4 memory-server regions"), "{note}");
        // 202 MiB in 101 pages, plus one page of rounding per region.
        assert!(note.contains("`sysctl vm.nr_hugepages=105`"), "{note}");
        let one_missing = server(2, 1, 101 << 20);
        let note = huge_page_note(&[server(2, 2, 101 << 20), one_missing]).expect("a note");
        assert!(note.starts_with("1 of 4"), "{note}");
        assert_eq!(huge_page_note(&[server(2, 2, 101 << 20)]), None);
        assert_eq!(huge_page_note(&[]), None);
    }
}
