//! `namdb chaos`: the chaos harness. Starts memory-server processes and compute-node
//! processes (`namdb chaos-node`, hidden) running the bank and list-append workloads,
//! carries out a seeded fault plan against the nodes (SIGKILL at random moments,
//! restarts with a commit-step crash point armed, SIGSTOP pauses, and stalls past the
//! lease, for another node to fence) and the memory
//! servers (kill and restart, or with `--replicas 2` failover to a backup), then stops them,
//! waits for recovery and checks what every node recorded (`verify::chaos`).
//!
//! Exit status: 0 when every check passed, 1 on any violation or harness error.

mod backup_watch;

use crate::cluster_cmd::tail;
use anyhow::{Context, Result, bail};
use backup_watch::BackupWatch;
use clap::{Args, ValueEnum};
use compute_node::RemoteCluster;
use compute_node::memory_servers::{BackupView, PRIMARY_ANSWER_LIMIT, ask_backup, backup_of};
use memory_server::ClusterToken;
use rand::SeedableRng;
use rand::rngs::StdRng;
use std::collections::{BTreeMap, HashSet};
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, ExitCode, ExitStatus, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime};
use verify::chaos::checks::{self, CheckResult, Lock, UnpublishedSlot};
use verify::chaos::events::{EventWriter, NodeEvent, Recovery, Repair, merge, read_events};
use verify::chaos::plan::{Action, FaultPlan, INSERT_POINTS, PlanConfig};
use verify::chaos::report::{
    self, ActionCounts, ChaosConfig, ChaosReport, Death, Executed, HistorySummary, PointCounts,
    ServerRestart, Throughput,
};
use verify::chaos::session::{Clock, Ids, SharedListAppend, run_session, run_txn, unix_ns};
use verify::history::{Op, ReadValue, Status, Txn};
use verify::index::HistoryIndex;
use verify::store::TxnStore;
use verify::txn_store::TxnKv;
use verify::workload::{Action as Step, Bank, Script, Workload};

const BANK_TABLE: &str = "chaos_bank";
const LIST_TABLE: &str = "chaos_lists";
/// Commits here after the run decide timestamps, which is what fences a slot left by a
/// node that died at the very end (a dead slot is fenced once a later timestamp is
/// decided). Not part of the checked history.
const TICK_TABLE: &str = "chaos_ticks";
const BUCKET_MS: u64 = 100;
const START_TIMEOUT: Duration = Duration::from_secs(60);
const STOP_TIMEOUT: Duration = Duration::from_secs(20);
/// How long the harness waits for a backup's Hello when it asks whether it is synced.
const BACKUP_ASK_TIMEOUT: Duration = Duration::from_secs(5);
/// The least time between two asks of a server's role while an action waits on it.
const ROLE_ASK_EVERY: Duration = Duration::from_millis(100);
/// A chaos node's exit status when it lost a memory server (killed, or restarted
/// under it): its connections to it are gone, so the harness starts it again once the
/// server is back, and the new process reopens the database (EX_TEMPFAIL).
const SERVER_LOST: i32 = 75;
/// A chaos node's exit status when it found itself fenced (stopped past its lease, or
/// a worker of it stopped renewing): another node fenced it at the memory servers and
/// recovered its commits, so its sessions are gone for good; the harness starts it
/// again (EX_PROTOCOL).
const FENCED: i32 = 76;
/// How long a stalled node has, once resumed, to find its sessions fenced and exit:
/// its fence check runs every 100 ms, and a debug build on a loaded machine is slow.
const STALL_SETTLE: Duration = Duration::from_millis(1500);
/// A stall waits until every node committed this recently, so that the others run
/// through it and have to fence it.
const COMMITS_FLOWING: Duration = Duration::from_millis(500);
/// How often a chaos node looks whether its memory servers still listen.
const PROBE_EVERY: Duration = Duration::from_millis(20);
/// How often it renews its sessions, which is how it learns that it was fenced.
const FENCE_CHECK_EVERY: Duration = Duration::from_millis(100);
/// How often it checks their boot numbers (a server restarted between two probes).
const BOOT_CHECK_EVERY: Duration = Duration::from_secs(1);
/// Checkpoints of the durable memory servers: short enough that a run's server
/// restarts come back from a checkpoint plus journal, not the journal alone; not
/// shorter, as a checkpoint every second cut throughput by two thirds here.
const CHECKPOINT_INTERVAL_S: &str = "5";

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, ValueEnum)]
pub enum ChaosWorkload {
    /// Transfers between accounts and audits of all of them.
    Bank,
    /// Whole-list reads and appends of unique elements, shared by every node.
    ListAppend,
}

impl ChaosWorkload {
    fn name(self) -> &'static str {
        match self {
            ChaosWorkload::Bank => "bank",
            ChaosWorkload::ListAppend => "list-append",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ChaosBackend {
    Shm,
    Tcp,
}

impl ChaosBackend {
    fn name(self) -> &'static str {
        match self {
            ChaosBackend::Shm => "shm",
            ChaosBackend::Tcp => "tcp",
        }
    }
}

#[derive(Args, Debug)]
pub struct ChaosArgs {
    /// Seconds of faults and workload, from the moment every node is ready.
    #[arg(long, value_name = "S", default_value = "30", value_parser = parse_seconds)]
    pub duration: f64,
    /// Compute-node processes.
    /// (At most 8: the harness follows every node's events on one thread, and more
    /// nodes write them faster than it reads on a 2-core host.)
    #[arg(long, value_name = "N", default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=8))]
    pub nodes: u32,
    /// Memory-server processes.
    #[arg(long, value_name = "M", default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=8))]
    pub servers: u32,
    /// Sessions (threads, each with its own oracle slot) per compute node.
    #[arg(long, value_name = "N", default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=16))]
    pub sessions: u32,
    #[arg(long, value_enum, default_value_t = ChaosBackend::Shm)]
    pub backend: ChaosBackend,
    /// Seed of the fault plan and the workloads; random by default (printed).
    #[arg(long, value_name = "N")]
    pub seed: Option<u64>,
    /// Workloads the sessions run, shared out round-robin.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "bank,list-append"
    )]
    pub workload: Vec<ChaosWorkload>,
    /// Oracle lease timeout: a dead node's slot is fenced and recovered after it.
    #[arg(long, value_name = "MS", default_value_t = 250, value_parser = clap::value_parser!(u64).range(20..=60_000))]
    pub lease_ms: u64,
    /// Write the report as JSON here.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Keep the run's files (logs, event files, memory-server data) here; by default a
    /// temporary directory, kept only when the run fails (an interrupted run removes
    /// it).
    #[arg(long, value_name = "DIR")]
    pub dir: Option<PathBuf>,
    /// Never kill and restart memory servers (runs of 20 s or more do by default).
    #[arg(long)]
    pub no_server_restarts: bool,
    /// Copies of each memory server: 2 gives each a backup process (`--backup`) that
    /// its primary streams to; memory-server episodes then kill a primary for good
    /// (failover) instead of restarting it, or kill a backup and start it again (its
    /// primary copies its state to it again), server 0's before its failover.
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..=2))]
    pub replicas: u8,
    /// With `--replicas 2`: a failover stops the primary (SIGSTOP, as a hung or cut-off
    /// host: it keeps its connections and answers nothing) instead of killing it. The
    /// nodes must find it silent through its backup and promote the backup; the harness
    /// kills the stopped primary once that happened (with `--rejoin-failed-primaries`,
    /// resumes it instead), and counts it a problem if it did not within a minute.
    #[arg(long)]
    pub stop_failed_primaries: bool,
    /// With `--replicas 2`: a failed-over primary comes back, once the nodes promoted
    /// its backup, at its address as that server's backup (`memory-server
    /// --backup-of`), which copies its state there while commits go on; the pair, the
    /// other way round, can fail over again (server 0 does, twice). With
    /// `--stop-failed-primaries` the stopped primary is resumed and rejoins by itself,
    /// in the same process (every server gets `memory-server --rejoin-when-fenced`).
    #[arg(long)]
    pub rejoin_failed_primaries: bool,
    /// Testing hook (hidden; DEVELOPERS.md, "Chaos harness"): how long a planned action
    /// may stay blocked before the harness gives up on it (60 s by default).
    #[arg(long, hide = true, value_name = "MS", default_value_t = START_TIMEOUT.as_millis() as u64)]
    pub give_up_after_ms: u64,
    /// Testing hook (hidden): the primaries' `--resync-delay-ms`, so that a backup
    /// started again stays unsynced that long.
    #[arg(long, hide = true, value_name = "MS")]
    pub resync_delay_ms: Option<u64>,
    /// Testing hook (hidden): SIGSTOP a backup as soon as a backup restart has started
    /// it, until the next action on its server is carried out or skipped (or the faults
    /// end): a backup that accepts connections and answers nothing.
    #[arg(long, hide = true)]
    pub stop_restarted_backups: bool,
}

/// One compute node of a chaos run (started by `namdb chaos`).
#[derive(Args, Debug)]
pub struct ChaosNodeArgs {
    #[arg(long, value_delimiter = ',', required = true)]
    /// Each `PRIMARY` or `PRIMARY|BACKUP`.
    pub memory_servers: Vec<String>,
    #[arg(long)]
    pub token_file: PathBuf,
    #[arg(long)]
    pub node: usize,
    #[arg(long)]
    pub incarnation: u64,
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=16))]
    pub sessions: u32,
    #[arg(long, value_enum, value_delimiter = ',', required = true)]
    pub workload: Vec<ChaosWorkload>,
    #[arg(long)]
    pub lease_ms: u64,
    #[arg(long)]
    pub events: PathBuf,
    #[arg(long)]
    pub seed: u64,
    /// The list-append key to start at: keys below it are full.
    #[arg(long, default_value_t = 0)]
    pub list_key_start: u64,
}

fn parse_seconds(input: &str) -> Result<f64, String> {
    let s: f64 = input
        .trim()
        .parse()
        .map_err(|_| format!("`{input}` is not a number of seconds"))?;
    if !s.is_finite() || s <= 0.0 || s > 86_400.0 {
        return Err(format!(
            "`{input}`: the duration must be above 0 and at most 86400 s"
        ));
    }
    Ok(s)
}

/// An armed node whose point has not fired keeps it armed at least this many times its
/// planned window before the plan's restart disarms it; the rest of the plan (and the
/// run's end) slips by the wait. After a backup's restart the nodes commit again only
/// once their broken workers are replaced: one window sometimes saw no commit.
const CRASH_PATIENCE: u32 = 3;
/// Past [`CRASH_PATIENCE`], a node stays armed until [`CRASH_PATIENCE_COMMITS`] of its
/// commits had their chance at its point ([`had_chance`]): time alone says nothing of
/// its chances. On a loaded machine, or while the cluster stalls (a backup outage), a
/// node can spend ten windows in a few commits; a bound of ten windows let
/// after-insert-blocks go unfired under load (CI: "crash point never fired"). At the
/// drawn odds (at least 0.25 a pass), 150 chances all missing is below 1e-18.
const CRASH_PATIENCE_COMMITS: u64 = 150;
/// Only a node that stops committing altogether (or a point its workloads never reach)
/// is given up on by time. Below [`START_TIMEOUT`], after which the plan's executor
/// counts a blocked action as a problem, so such a point is a note, not a failure.
const CRASH_PATIENCE_LIMIT: Duration = Duration::from_secs(40);

/// Whether a node armed for `waited` since it was ready, with `window` planned and
/// `chances` at its point so far, stays armed.
fn keeps_armed(waited: Duration, window: Duration, chances: u64, reachable: bool) -> bool {
    waited < window * CRASH_PATIENCE
        || (reachable && chances < CRASH_PATIENCE_COMMITS && waited < CRASH_PATIENCE_LIMIT)
}

/// Whether `txn`, committed by a node armed at `point`, had its chance to fire there.
/// Every committed write passes the lock, log and install steps. Only commits that
/// create records pass the insert steps; a node armed at one appends to fresh keys
/// ([`list_key_start`]), so its appending commits are the ones that would create a
/// record, unless another node created it first.
fn had_chance(point: &str, txn: &Txn) -> bool {
    txn.status == Status::Committed
        && txn.ops.iter().any(|op| match op {
            Op::Append { .. } => true,
            Op::Write { .. } => !INSERT_POINTS.contains(&point),
            Op::Read { .. } => false,
        })
}

/// The first list key of a node started now. An unarmed node starts one window behind
/// the newest key appended so far, so it shares the keys the others append to. A node
/// armed at an insert point starts past every key any node can be appending to (one
/// window past the newest the harness saw, and one more for the events not read yet),
/// so its first append creates a record: among shared keys it only ever created the
/// few new ones the others left it, and under load could pass no insert step at all.
fn list_key_start(max_list_key: u64, armed: Option<&str>) -> u64 {
    let window = SharedListAppend::ACTIVE_KEYS;
    match armed {
        Some(point) if INSERT_POINTS.contains(&point) => max_list_key + 2 * window,
        _ => max_list_key.saturating_sub(window),
    }
}

/// The workload of session `s` of node `node`: spread over nodes too, so with one
/// session a node, node i runs workload i.
fn session_workload(workloads: &[ChaosWorkload], node: usize, s: usize) -> ChaosWorkload {
    workloads[(s + node) % workloads.len()]
}

/// SIGKILLs `process`, a child of the harness never waited for since it started, and
/// reaps it, which also tells that its port and files are released. Returns when it
/// was signalled.
fn kill_and_reap(process: &crate::cluster_cmd::ProcessEntry, what: &str) -> Result<Instant> {
    let pid = rustix::process::Pid::from_raw(process.pid as i32)
        .with_context(|| format!("{what} has no pid"))?;
    let killed = Instant::now();
    rustix::process::kill_process(pid, rustix::process::Signal::KILL)
        .with_context(|| format!("cannot kill {what}"))?;
    rustix::process::waitpid(Some(pid), rustix::process::WaitOptions::empty())
        .with_context(|| format!("cannot wait for {what}"))?;
    Ok(killed)
}

/// The bank every process of a run uses.
fn bank() -> Bank {
    Bank {
        accounts: 8,
        initial_balance: 1000,
        max_transfer: 50,
        ..Bank::default()
    }
}

fn options(lease_ms: u64, slots: u32) -> txn::Options {
    let mut options = txn::Options {
        slots,
        ..txn::Options::default()
    };
    options.oracle.lease_timeout = Duration::from_millis(lease_ms);
    options
}

/// List keys a run may use: every append of a key means a 24-element list at most,
/// and a fast 2-core machine commits a few thousand appending transactions a second.
fn list_capacity(duration_s: f64) -> u64 {
    ((duration_s * 2000.0) as u64).clamp(8192, 1 << 20)
}

fn table_bytes(spec: &txn::TableSpec, servers: u64) -> Result<u64> {
    let block = txn::layout::BlockShape::new(spec.versions, spec.value_cap)
        .map_err(|e| anyhow::anyhow!("{e}"))?
        .block_bytes();
    Ok(spec.blocks_on(servers as u32) * block + spec.index.region_bytes() * servers)
}

// ----- the chaos node

pub fn node_main(args: &ChaosNodeArgs) -> Result<()> {
    txn::crash::arm_from_env().map_err(anyhow::Error::msg)?;
    let token = ClusterToken::from_file(&args.token_file)?;
    let out = EventWriter::create(&args.events)
        .with_context(|| format!("cannot create {}", args.events.display()))?;
    // The harness closes our stdin to stop us; it also closes if the harness dies.
    // Watched from the start: a node still waiting for the memory servers must not
    // outlive a harness stopped with Ctrl-C.
    let stop = Arc::new(AtomicBool::new(false));
    let stopper = stop.clone();
    std::thread::spawn(move || {
        let mut sink = Vec::new();
        let _ = std::io::stdin().read_to_end(&mut sink);
        stopper.store(true, Ordering::Relaxed);
    });
    let remote = connect_node(args, &token, &stop)?;
    if let Some(r) = remote.db.restart_report() {
        eprintln!("repaired memory-server restarts: {r:?}");
        out.write(&NodeEvent::Repair {
            repair: repair(&r, SystemTime::now()),
        })?;
    }
    watch_servers(&remote, &args.memory_servers, &token);
    let db = remote.db.clone();
    let ids = Ids::new(args.incarnation).map_err(anyhow::Error::msg)?;
    let bank_workload = bank();
    let lists = SharedListAppend::new(args.incarnation, args.list_key_start);
    let bank_store = TxnKv::new(db.clone(), db.table(BANK_TABLE)?);
    let list_store = TxnKv::new(db.clone(), db.table(LIST_TABLE)?);
    let sessions: Vec<(&TxnKv, &dyn Workload, _)> = (0..args.sessions as usize)
        .map(|s| {
            let (store, workload): (&TxnKv, &dyn Workload) =
                match session_workload(&args.workload, args.node, s) {
                    ChaosWorkload::Bank => (&bank_store, &bank_workload),
                    ChaosWorkload::ListAppend => (&list_store, &lists),
                };
            (store, workload, store.open_session())
        })
        .collect();
    out.write(&NodeEvent::Ready {
        node: args.node,
        incarnation: args.incarnation,
    })?;

    // The database's list of its recoveries only grows: report what is new since the
    // last look. (Not "each (slot, tag) once": a restart of server 0 resets the tags,
    // and the recoveries after it were never reported.)
    let mut reported = 0;
    let report_recoveries = |reported: &mut usize| -> Result<()> {
        for r in db.recoveries().iter().skip(*reported) {
            out.write(&NodeEvent::Recovery {
                recovery: recovery(r),
            })?;
            *reported += 1;
        }
        Ok(())
    };
    let results = std::thread::scope(|scope| -> Result<Vec<_>> {
        let handles: Vec<_> = sessions
            .into_iter()
            .enumerate()
            .map(|(s, (store, workload, handle))| {
                let (ids, out, stop) = (&ids, &out, &*stop);
                let seed = args.seed ^ (args.incarnation << 20) ^ s as u64;
                scope.spawn(move || {
                    let mut rng = StdRng::seed_from_u64(seed);
                    run_session(store, handle, workload, ids, s as u64, &mut rng, out, stop)
                })
            })
            .collect();
        while !handles.iter().all(|h| h.is_finished()) {
            report_recoveries(&mut reported)?;
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(handles.into_iter().map(|h| h.join()).collect())
    })?;
    for result in results {
        match result {
            Ok(summary) => {
                summary.context("cannot write an event")?;
            }
            Err(_) => bail!("a session panicked"),
        }
    }
    report_recoveries(&mut reported)?;
    Ok(())
}

/// The recoveries of the run, each once. Two processes can report one recovery (one
/// that finished after another took it over), and are merged by the holding they
/// resolved: slot and holder tag, within one life of the oracle. A restart of server
/// 0 resets the oracle's lease tags, so the holdings after it reuse the tags of the
/// holdings before: keyed by slot and tag alone, every recovery after a restart of
/// server 0 whose (slot, tag) was recovered earlier in the run was dropped (a 120 s
/// tcp run counted none after its last restart of server 0: "32 deaths were followed
/// by no recovery").
fn distinct_recoveries(
    reported: impl Iterator<Item = Recovery>,
    repairs: &[Repair],
) -> Vec<Recovery> {
    let mut oracle_restarts: Vec<u64> = repairs
        .iter()
        .filter(|r| r.restarted.contains(&0))
        .map(|r| r.finished_ns)
        .collect();
    oracle_restarts.sort_unstable();
    let mut seen = HashSet::new();
    reported
        .filter(|r| {
            let life = oracle_restarts.partition_point(|&at| at <= r.finished_ns);
            seen.insert((r.slot, r.holder_tag, life))
        })
        .collect()
}

/// Opens the database, trying again while a memory server is not (yet) back: the
/// harness starts nodes once every server listens, but a server restarted on its data
/// directory may still be restoring. Gives up once `stop` is set (the harness is gone
/// or stopping).
fn connect_node(
    args: &ChaosNodeArgs,
    token: &ClusterToken,
    stop: &AtomicBool,
) -> Result<RemoteCluster> {
    // Slots are set by the harness, which sets the catalog up.
    let deadline = Instant::now() + START_TIMEOUT;
    let mut backoff = Duration::from_millis(20);
    loop {
        match compute_node::connect(&args.memory_servers, token, options(args.lease_ms, 0)) {
            Ok(remote) => return Ok(remote),
            Err(e) if stop.load(Ordering::Relaxed) => {
                return Err(e).context(
                    "stopped by the harness (or it ended) before the database could be opened",
                );
            }
            Err(e) if Instant::now() < deadline => {
                eprintln!("cannot open the database yet ({e}); trying again in {backoff:?}");
                std::thread::sleep(backoff);
                backoff = (backoff * 2).min(Duration::from_millis(500));
            }
            Err(e) => {
                return Err(e).context("cannot open the database on the memory servers");
            }
        }
    }
}

/// Exits the process with [`FENCED`] once a memory server says this node was fenced,
/// and with [`SERVER_LOST`] once a memory server stops listening or comes back with
/// another boot number. Its connections to that server are gone for
/// good, so transactions cannot go on; what they did is in the event file (a commit
/// cut short is `pending`, i.e. unknown), and a new process reopens the database.
/// Watched is the process this node uses (a replicated server's primary, or its
/// backup once promoted): a dead primary is a lost server like any other, and the new
/// process fails over to the backup when it connects. A primary that does not answer
/// within [`PRIMARY_ANSWER_LIMIT`] (stopped: it still listens) is lost once its backup
/// has not heard from it either; one its backup still hears from is only slow.
fn watch_servers(remote: &RemoteCluster, specs: &[String], token: &ClusterToken) {
    use txn::MemoryServerLink;
    let boots: Vec<u64> = remote.servers.iter().map(|s| s.boot()).collect();
    let addrs: Vec<String> = remote
        .servers
        .iter()
        .map(|s| s.addr().to_string())
        .collect();
    let backups: Vec<Option<String>> = specs
        .iter()
        .zip(&addrs)
        .map(|(spec, serving)| backup_of(spec, serving).map(str::to_string))
        .collect();
    let token = token.clone();
    let servers = remote.servers.clone();
    std::thread::spawn(move || {
        let lost = |i: usize, why: String| -> ! {
            eprintln!("lost memory server {i} ({}): {why}; exiting", addrs[i]);
            std::process::exit(SERVER_LOST)
        };
        // Whether server `i`, which did not answer (`e`), is gone: a stopped primary
        // whose backup has not heard from it either (or was promoted).
        let judge = |i: usize, e: &memory_server::ClientError| {
            let (Some(backup), memory_server::ClientError::TimedOut { .. }) = (&backups[i], e)
            else {
                return;
            };
            match ask_backup(backup, &token) {
                Ok(BackupView::PrimaryAlive(_) | BackupView::NotABackup(_)) | Err(_) => {}
                Ok(view) => lost(i, format!("{e}, and its backup at {backup} {view}")),
            }
        };
        // Replicated primaries are asked within a bound, the others without.
        let limit = |i: usize| backups[i].as_ref().map(|_| PRIMARY_ANSWER_LIMIT);
        let mut last_boot_check = Instant::now();
        let mut last_fence_check = Instant::now();
        loop {
            std::thread::sleep(PROBE_EVERY);
            // The session renewal is what tells a node stopped past its lease that it
            // was fenced (its queue pairs are gone: nothing it posts lands).
            let fence_check = last_fence_check.elapsed() >= FENCE_CHECK_EVERY;
            if fence_check {
                last_fence_check = Instant::now();
            }
            for (i, server) in servers.iter().enumerate().filter(|_| fence_check) {
                let renewed = match limit(i) {
                    Some(limit) => server.keep_alive_within(limit),
                    None => server.keep_alive(),
                };
                if let Err(e) = renewed {
                    if e.was_fenced() {
                        eprintln!("fenced at memory server {i} ({}): {e}; exiting", addrs[i]);
                        std::process::exit(FENCED)
                    }
                    judge(i, &e);
                }
            }
            // A bare connect is cheap enough to run often; a dead server refuses it.
            for (i, addr) in addrs.iter().enumerate() {
                let Ok(sa) = addr.parse::<std::net::SocketAddr>() else {
                    continue;
                };
                if let Err(e) = std::net::TcpStream::connect_timeout(&sa, Duration::from_secs(1)) {
                    lost(i, format!("not listening: {e}"));
                }
            }
            if last_boot_check.elapsed() >= BOOT_CHECK_EVERY {
                last_boot_check = Instant::now();
                for (i, addr) in addrs.iter().enumerate() {
                    match memory_server::blocking::Client::connect_as(addr, &token, 0, limit(i)) {
                        Ok(c) if c.server().boot != boots[i] => {
                            lost(i, format!("restarted (boot {})", c.server().boot))
                        }
                        Ok(_) => {}
                        Err(e) => {
                            judge(i, &e);
                            if !matches!(e, memory_server::ClientError::TimedOut { .. }) {
                                lost(i, format!("cannot connect: {e}"));
                            }
                        }
                    }
                }
            }
        }
    });
}

/// The deaths that a recovery should have followed and none did. Not a kill of memory
/// server 0: its restart starts the oracle afresh with every slot free and resolves
/// every lock from the commit log (`txn::restart`), so no holder is left to recover;
/// what follows it is a repair, whose absence has its own note. Counted, those kills
/// made every run say "N deaths were followed by no recovery".
fn unrecovered_deaths(deaths: &[Death]) -> usize {
    deaths
        .iter()
        .filter(|d| d.recoveries == 0 && !(d.cause == "server-kill" && d.node == 0))
        .count()
}

fn repair(r: &txn::RestartReport, finished: SystemTime) -> Repair {
    Repair {
        restarted: r.restarted.clone(),
        log_records: r.log_records,
        reinstalled: r.reinstalled,
        locks_rolled_forward: r.locks_rolled_forward,
        locks_rolled_back: r.locks_rolled_back,
        claims_settled: r.claims_settled,
        blocks_scanned: r.blocks_scanned,
        oracle_from: r.oracle_from,
        took_us: r.took.as_micros() as u64,
        finished_ns: unix_ns(finished),
    }
}

fn recovery(r: &txn::RecoveryReport) -> Recovery {
    Recovery {
        slot: r.slot,
        holder_tag: r.holder_tag,
        rolled_forward: r.rolled_forward,
        rolled_back: r.rolled_back,
        blocks_scanned: r.blocks_scanned,
        took_us: r.took.as_micros() as u64,
        finished_ns: unix_ns(r.finished_at),
    }
}

// ----- the harness

pub fn run(args: &ChaosArgs) -> Result<ExitCode> {
    // Ctrl-C, SIGTERM, SIGHUP and a stderr whose reader went away all stop the run the
    // same way: the harness stops its processes, the temporary directory goes as after
    // a passed run (nothing failed: there is nothing to diagnose), and the process
    // ends with the shell's status for the signal.
    crate::cluster_cmd::catch_interrupts()?;
    crate::bench::refuse_repeats("workload", &args.workload, |w| w.name().to_string())?;
    let mut workloads = args.workload.clone();
    workloads.sort();
    let seed = args.seed.unwrap_or_else(rand::random);
    let sessions = args.nodes * args.sessions;
    if (sessions as usize) < workloads.len() {
        bail!(
            "{} workloads need at least as many sessions, but --nodes {} × --sessions {} \
             gives {sessions}",
            workloads.len(),
            args.nodes,
            args.sessions
        );
    }
    let (dir, temp) = match &args.dir {
        Some(dir) => {
            std::fs::create_dir_all(dir)
                .with_context(|| format!("cannot create {}", dir.display()))?;
            // An earlier run's data directories would be its memory servers' state.
            let used = std::fs::read_dir(dir)
                .with_context(|| format!("cannot read {}", dir.display()))?
                .next()
                .is_some();
            if used {
                bail!(
                    "{} is not empty (an earlier run's files?): give --dir an empty or new \
                     directory",
                    dir.display()
                );
            }
            (std::fs::canonicalize(dir)?, None)
        }
        None => {
            let temp = tempfile::Builder::new()
                .prefix("namdb-chaos-")
                .tempdir()
                .context("cannot create a temporary directory")?;
            (temp.path().to_path_buf(), Some(temp))
        }
    };
    if args.replicas < 2 {
        let failover_flag = [
            (args.stop_failed_primaries, "--stop-failed-primaries"),
            (args.rejoin_failed_primaries, "--rejoin-failed-primaries"),
        ]
        .into_iter()
        .find_map(|(given, flag)| given.then_some(flag));
        if let Some(flag) = failover_flag {
            bail!("{flag} is about failovers, which need a backup per server: add --replicas 2");
        }
    }
    let points: Vec<String> = txn::crash::POINTS.iter().map(|p| p.to_string()).collect();
    let plan = FaultPlan::generate(&PlanConfig {
        duration: Duration::from_secs_f64(args.duration),
        nodes: args.nodes as usize,
        servers: args.servers as usize,
        server_restarts: !args.no_server_restarts,
        failover: args.replicas >= 2,
        rejoin: args.rejoin_failed_primaries,
        lease_timeout: Duration::from_millis(args.lease_ms),
        points,
        seed,
    })
    .map_err(anyhow::Error::msg)?;
    say!(
        "chaos: seed {seed}; {} nodes × {} sessions, {} {} memory servers, {} s; plan: {} kills, \
         {} armed crashes, {} pauses, {} stalls, {} memory-server restarts, {} failovers, {} \
         backup restarts, {} primary rejoins; files in {}",
        args.nodes,
        args.sessions,
        match args.replicas {
            1 => args.servers.to_string(),
            r => format!("{} (×{r} replicas)", args.servers),
        },
        args.backend.name(),
        args.duration,
        plan.count("kill"),
        plan.count("crash"),
        plan.count("pause"),
        plan.count("stall"),
        plan.count("server_restart"),
        plan.count("server_failover"),
        plan.count("backup_restart"),
        plan.count("primary_rejoin"),
        dir.display()
    );
    let config = ChaosConfig {
        duration_s: args.duration,
        nodes: args.nodes as usize,
        sessions_per_node: args.sessions as usize,
        servers: args.servers as usize,
        backend: args.backend.name().into(),
        seed,
        workloads: workloads.iter().map(|w| w.name().to_string()).collect(),
        lease_ms: args.lease_ms,
    };
    let json = crate::bench::JsonOut::open_opt(args.json.as_deref())?;
    // The files an error names stay: the temporary directory is kept on failure too.
    let keep = |temp: Option<tempfile::TempDir>| {
        if let Some(temp) = temp {
            let kept = temp.keep();
            say!("the run's files are kept in {}", kept.display());
        }
    };
    let report = Harness::new(args, &workloads, &dir, seed).and_then(|mut harness| {
        let report = harness.run(&plan, config, &workloads);
        drop(harness);
        report
    });
    let report = match crate::bench::JsonOut::unless_failed(json.as_ref(), report) {
        Ok(report) => report,
        Err(e) => {
            if e.downcast_ref::<crate::cluster_cmd::Interrupted>()
                .is_none()
            {
                keep(temp);
            }
            return Err(e);
        }
    };
    // Written, not `print!`ed: a reader that went away (`| head`) panicked the process
    // out with status 141 before the JSON was written and the directory removed.
    let printed = {
        use std::io::Write;
        let mut stdout = std::io::stdout().lock();
        write!(stdout, "{report}").and_then(|()| stdout.flush())
    };
    // Both copies are attempted, and the directory kept or removed by the verdict,
    // whichever of them fails.
    let written = json.as_ref().map(|json| json.write(&report)).transpose();
    let code = if report.passed {
        ExitCode::SUCCESS
    } else {
        keep(temp);
        ExitCode::FAILURE
    };
    match printed {
        // The run is over; nobody reads its report there. As a Unix tool, the
        // shell's status for SIGPIPE, unless the run failed, which says more.
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {
            written?;
            Ok(if report.passed {
                ExitCode::from(128 + signal_hook::consts::SIGPIPE as u8)
            } else {
                code
            })
        }
        Err(e) => {
            written?;
            Err(anyhow::Error::new(e).context("cannot print the report to stdout"))
        }
        Ok(()) => {
            written?;
            Ok(code)
        }
    }
}

/// A running compute-node process.
struct NodeProc {
    child: Child,
    /// Dropped to stop the node.
    stdin: Option<ChildStdin>,
    incarnation: u64,
    log: PathBuf,
    armed: Option<String>,
    /// The armed point's chance per commit step.
    probability: f64,
    /// How long, once ready, an armed node gets to reach its point.
    window: Duration,
    ready_at: Option<Instant>,
    /// Commits of this incarnation that had their chance at its armed point.
    chances: u64,
    paused_until: Option<Instant>,
    /// Whether this incarnation was stopped at all (a pause or a stall).
    stopped_ever: bool,
    /// When a stall stopped it (ms into the run), until it is found fenced.
    stalled_at_ms: Option<f64>,
    /// When a stall of this incarnation ended: it then has [`STALL_SETTLE`] to find
    /// its fence and exit.
    resumed_at: Option<Instant>,
    /// When the harness last read a commit of this incarnation.
    last_commit: Option<Instant>,
    started: Instant,
    tail: Tail,
}

/// Reads an event file as it grows.
struct Tail {
    path: PathBuf,
    offset: u64,
    partial: Vec<u8>,
}

impl Tail {
    fn new(path: PathBuf) -> Tail {
        Tail {
            path,
            offset: 0,
            partial: Vec::new(),
        }
    }

    /// The events written since the last call. Malformed lines are skipped here; the
    /// full read at the end reports them.
    fn poll(&mut self) -> Vec<NodeEvent> {
        let Ok(mut file) = std::fs::File::open(&self.path) else {
            return Vec::new();
        };
        if file.seek(SeekFrom::Start(self.offset)).is_err() {
            return Vec::new();
        }
        let mut bytes = Vec::new();
        let Ok(n) = file.read_to_end(&mut bytes) else {
            return Vec::new();
        };
        self.offset += n as u64;
        self.partial.extend_from_slice(&bytes);
        let Some(end) = self.partial.iter().rposition(|&b| b == b'\n') else {
            return Vec::new();
        };
        let rest = self.partial.split_off(end + 1);
        let complete = std::mem::replace(&mut self.partial, rest);
        complete
            .split(|&b| b == b'\n')
            .filter(|l| !l.is_empty())
            .filter_map(|l| serde_json::from_slice(l).ok())
            .collect()
    }
}

struct Harness<'a> {
    args: &'a ChaosArgs,
    workloads: &'a [ChaosWorkload],
    dir: PathBuf,
    exe: PathBuf,
    token_file: PathBuf,
    token: ClusterToken,
    seed: u64,
    servers: Vec<crate::cluster_cmd::ProcessEntry>,
    /// With `--replicas 2`: each server's backup process.
    backups: Vec<crate::cluster_cmd::ProcessEntry>,
    /// Per backup: how many times it was started (its socket and log are numbered).
    backup_starts: Vec<u32>,
    /// Per backup: whether it holds its primary's whole state, learnt off the loop.
    backup_watches: Vec<BackupWatch>,
    /// Per backup: killed and not started again.
    backups_down: Vec<bool>,
    /// Per backup: stopped by `--stop-restarted-backups`.
    backups_stopped: Vec<bool>,
    /// Per server: its primary, stopped by a failover under `--stop-failed-primaries`,
    /// since when, and when its backup was last asked whether it was promoted.
    primaries_stopped: Vec<Option<(Instant, Instant)>>,
    /// Fixed control-plane ports, so a restarted server is where the nodes look: the
    /// primaries', then the backups'.
    ports: Vec<u16>,
    /// The primaries' addresses.
    addrs: Vec<String>,
    /// Servers whose primary was killed for good (their backup serves).
    failed_over: Vec<bool>,
    /// Servers whose pair is the other way round: the failed-over primary rejoined as
    /// the promoted backup's backup, so `servers[i]` was started as
    /// `memory-server-i-backup` and `backups[i]` as `memory-server-i` (its data
    /// directory and port).
    swapped: Vec<bool>,
    server_bytes: u64,
    /// Each server's boot (1 at the start, one more per restart).
    boots: Vec<u64>,
    /// Servers killed and not started again yet.
    servers_down: Vec<bool>,
    last_server_kill: Option<Instant>,
    /// Nodes that exited having lost a server, to start again once every server is up.
    lost: Vec<bool>,
    /// Nodes that exited fenced: started again by `poll` unless an action started them
    /// first.
    fenced_out: Vec<bool>,
    /// Per node: the crash point (with its probability and window) of an armed
    /// incarnation that was fenced or lost its server before the point fired. Its
    /// next process is armed again, or the point would go uncovered.
    rearm: Vec<Option<(String, f64, Duration)>>,
    server_restarts: Vec<ServerRestart>,
    repairs: Vec<Repair>,
    nodes: Vec<Option<NodeProc>>,
    next_incarnation: u64,
    event_files: Vec<PathBuf>,
    t0: Instant,
    t0_ns: u64,
    counts: ActionCounts,
    points: BTreeMap<String, PointCounts>,
    deaths: Vec<Death>,
    executed: Vec<Executed>,
    problems: Vec<String>,
    notes: Vec<String>,
    committed: u64,
    max_list_key: u64,
    /// Recoveries read so far, by holding (slot, tag, and the kills of server 0 so far:
    /// its restart resets the tags; see [`distinct_recoveries`]).
    recoveries_seen: HashSet<(u32, u16, usize)>,
    /// Kills of memory server 0, the oracle's.
    oracle_server_kills: usize,
    /// The last role asked of a server ([`Harness::role_of`]): its address, when, and
    /// its answer.
    role_asked: std::cell::RefCell<RoleAsked>,
}

type RoleAsked = Option<(String, Instant, Result<memory_server::Role, String>)>;

impl Drop for Harness<'_> {
    fn drop(&mut self) {
        for p in self.nodes.iter_mut().flatten() {
            let _ = p.child.kill();
            let _ = p.child.wait();
        }
        // No new asks; one under way ends when its backup goes, and the watches'
        // threads are joined as the field drops, after this.
        for w in &self.backup_watches {
            w.stop();
        }
        // A stopped backup (or primary) would hold SIGTERM until stop_all's deadline.
        self.resume_backups();
        for (i, stopped) in self.primaries_stopped.iter().enumerate() {
            if stopped.is_some() {
                signal_pid(self.servers[i].pid, rustix::process::Signal::CONT);
            }
        }
        crate::cluster_cmd::stop_all(self.servers.iter().chain(&self.backups), &self.token_file);
        // The nodes killed above (and by kill episodes since the last node started,
        // which sweeps its predecessors') left their socket directories in the
        // temporary directory: a run that stops early (an interrupt) reopens no
        // database after them, which would sweep them.
        crate::cluster_cmd::sweep_leftovers();
    }
}

impl<'a> Harness<'a> {
    fn new(
        args: &'a ChaosArgs,
        workloads: &'a [ChaosWorkload],
        dir: &Path,
        seed: u64,
    ) -> Result<Harness<'a>> {
        let token_file = dir.join("token");
        if token_file.exists() {
            std::fs::remove_file(&token_file)?;
        }
        memory_server::generate_token_file(&token_file)?;
        let token = ClusterToken::from_file(&token_file)?;
        Ok(Harness {
            args,
            workloads,
            dir: dir.to_path_buf(),
            exe: std::env::current_exe().context("cannot find the namdb executable")?,
            token_file,
            token,
            seed,
            servers: Vec::new(),
            backups: Vec::new(),
            backup_starts: Vec::new(),
            backup_watches: Vec::new(),
            backups_down: Vec::new(),
            backups_stopped: Vec::new(),
            primaries_stopped: Vec::new(),
            ports: Vec::new(),
            addrs: Vec::new(),
            failed_over: vec![false; args.servers as usize],
            swapped: vec![false; args.servers as usize],
            server_bytes: 0,
            boots: vec![0; args.servers as usize],
            servers_down: vec![false; args.servers as usize],
            last_server_kill: None,
            lost: vec![false; args.nodes as usize],
            fenced_out: vec![false; args.nodes as usize],
            rearm: vec![None; args.nodes as usize],
            server_restarts: Vec::new(),
            repairs: Vec::new(),
            nodes: (0..args.nodes).map(|_| None).collect(),
            next_incarnation: 1,
            event_files: Vec::new(),
            t0: Instant::now(),
            t0_ns: unix_ns(SystemTime::now()),
            counts: ActionCounts::default(),
            points: txn::crash::POINTS
                .iter()
                .map(|p| (p.to_string(), PointCounts::default()))
                .collect(),
            deaths: Vec::new(),
            executed: Vec::new(),
            problems: Vec::new(),
            notes: Vec::new(),
            committed: 0,
            max_list_key: 0,
            recoveries_seen: HashSet::new(),
            oracle_server_kills: 0,
            role_asked: std::cell::RefCell::new(None),
        })
    }

    /// The servers as compute nodes are given them: `PRIMARY|BACKUP` when replicated.
    /// A failed-over server keeps its dead primary first: connecting to it is refused
    /// at once, and connect then uses the (promoted) backup.
    fn server_specs(&self) -> Vec<String> {
        self.addrs
            .iter()
            .enumerate()
            .map(|(i, a)| match self.backups.get(i) {
                // The pair as first given: a swapped pair's primary is listed second.
                Some(_) if self.swapped[i] => format!("{a}|{}", self.servers[i].address),
                Some(b) => format!("{a}|{}", b.address),
                None => a.clone(),
            })
            .collect()
    }

    fn ms(&self, at: Instant) -> f64 {
        at.saturating_duration_since(self.t0).as_secs_f64() * 1000.0
    }

    fn run(
        &mut self,
        plan: &FaultPlan,
        config: ChaosConfig,
        workloads: &[ChaosWorkload],
    ) -> Result<ChaosReport> {
        let list_spec = TxnKv::table_spec(LIST_TABLE, list_capacity(self.args.duration));
        let bank_spec = TxnKv::table_spec(BANK_TABLE, 64);
        let tick_spec = txn::TableSpec::new(TICK_TABLE, 8, 16);
        let servers = self.args.servers as u64;
        let bytes = table_bytes(&list_spec, servers)?
            + table_bytes(&bank_spec, servers)?
            + table_bytes(&tick_spec, servers)?;
        // Partitions spread evenly to within a few percent; the rest is the oracle's
        // and the commit logs'.
        let per_server =
            (bytes / servers + bytes / servers / 8 + (64 << 20)).next_multiple_of(2 << 20);
        self.server_bytes = per_server;
        // Primaries', then (with replicas) backups', all picked before any binds.
        self.ports = free_ports(self.args.servers as usize * self.args.replicas as usize)?;
        for i in 0..self.args.servers as usize {
            self.start_memory_server(i)?;
        }
        let token = self.token.clone();
        // Every session of every incarnation alive at once, twice over (a restarted
        // node may come back before its old slots are fenced), and the harness's own.
        let slots = self.args.nodes * self.args.sessions * 2 + 4;
        let remote = compute_node::connect(
            &self.server_specs(),
            &token,
            options(self.args.lease_ms, slots),
        )
        .context("cannot open the database on the memory servers")?;
        let db = remote.db.clone();
        let bank_store = TxnKv::new(db.clone(), db.create_table(bank_spec)?);
        let list_store = TxnKv::new(db.clone(), db.create_table(list_spec)?);
        db.create_table(tick_spec)?;

        let own_events = self.dir.join("harness.events.jsonl");
        let out = EventWriter::create(&own_events)?;
        let ids = Ids::new(0).map_err(anyhow::Error::msg)?;
        let clock = Clock::default();
        let bank = bank();
        let with_bank = workloads.contains(&ChaosWorkload::Bank);
        if with_bank {
            let setup = bank.setup().context("the bank has a setup transaction")?;
            let mut session = bank_store.open_session();
            let txn = run_txn(&bank_store, &mut session, setup, ids.txn(), 0, &clock, &out)?;
            if txn.status != Status::Committed {
                bail!(
                    "the bank's setup transaction did not commit: {:?}",
                    txn.error
                );
            }
        }
        // The harness's connections would not survive a memory-server restart: it
        // opens the database again after the run.
        drop((bank_store, list_store, db, remote));

        for n in 0..self.args.nodes as usize {
            self.start_node(n, None)?;
        }
        let waiting = Instant::now();
        while self.nodes.iter().flatten().any(|p| p.ready_at.is_none()) {
            self.poll();
            if self.nodes.iter().any(Option::is_none) {
                let problems: Vec<String> = self
                    .problems
                    .iter()
                    .map(|p| format!("  {}", p.replace('\n', "\n    ")))
                    .collect();
                bail!(
                    "a compute node died while starting:\n{}",
                    problems.join("\n")
                );
            }
            if waiting.elapsed() > START_TIMEOUT {
                bail!("the compute nodes were not ready after {START_TIMEOUT:?}");
            }
            crate::cluster_cmd::check_interrupted()?;
            std::thread::sleep(Duration::from_millis(5));
        }
        self.t0 = Instant::now();
        self.t0_ns = unix_ns(SystemTime::now());
        say!("all {} nodes ready; faults begin", self.args.nodes);

        self.execute(plan);
        crate::cluster_cmd::check_interrupted()?;
        // A stall near the end gets its time to be found fenced, as one mid-run does,
        // and a primary stopped near the end its time to be failed over.
        while (0..self.nodes.len()).any(|n| self.stall_unsettled(n).is_some())
            || self.primaries_stopped.iter().any(Option::is_some)
        {
            crate::cluster_cmd::check_interrupted()?;
            self.poll();
            std::thread::sleep(Duration::from_millis(5));
        }
        for n in 0..self.nodes.len() {
            if let Some(p) = &self.nodes[n] {
                self.ran_on(n, p.incarnation, p.stalled_at_ms);
            }
        }
        self.resume_backups();
        self.settle_stopped_primaries(true);
        let end_ns = unix_ns(SystemTime::now());
        self.stop_nodes();

        let remote =
            compute_node::connect(&self.server_specs(), &token, options(self.args.lease_ms, 0))
                .context("cannot open the database again after the run")?;
        if let Some(r) = remote.db.restart_report() {
            self.repairs.push(repair(&r, SystemTime::now()));
        }
        let db = remote.db.clone();
        let bank_store = TxnKv::new(db.clone(), db.table(BANK_TABLE)?);
        let list_store = TxnKv::new(db.clone(), db.table(LIST_TABLE)?);
        let ticks = db.table(TICK_TABLE)?;

        // Recovery: commits decide timestamps, so any slot left by a dead node is
        // fenced and resolved; then no lock may remain. The wait ends as soon as none
        // does; its bound only decides when a lock left is a failure, and recoveries
        // on a loaded machine took up to 16 s after a death (CI's debug build).
        let recovery_timeout =
            Duration::from_millis(self.args.lease_ms * 20).max(Duration::from_secs(60));
        let waiting = Instant::now();
        let mut client = db.client()?;
        // An index slot claimed without its address (a node killed mid-insert) is
        // settled by the recovery that releases the insert's block.
        let (locks, unpublished) = loop {
            let _ = client.run(3, |t| t.put(&ticks, 1, vec![1]));
            let locks = db.locked_records()?;
            let unpublished = db.unpublished_index_slots()?;
            let clear = locks.is_empty() && unpublished.is_empty();
            if clear || waiting.elapsed() > recovery_timeout {
                break (locks, unpublished);
            }
            crate::cluster_cmd::check_interrupted()?;
            std::thread::sleep(Duration::from_millis(20));
        };
        let waited = waiting.elapsed();
        drop(client);

        // The final state, read after recovery, into the history.
        let mut history_events = Vec::new();
        for file in &self.event_files {
            // A node creates its file before it connects: one killed before that
            // (started, then stopped at once by the next action) recorded nothing.
            if !file.exists() {
                self.notes.push(format!(
                    "{} was never created: its node was stopped before it began",
                    file.display()
                ));
                continue;
            }
            history_events.extend(read_events(file).map_err(anyhow::Error::msg)?);
        }
        let own = db.recoveries();
        let from_harness = own.iter().map(recovery);
        let from_nodes = history_events.iter().filter_map(|e| match e {
            NodeEvent::Recovery { recovery } => Some(recovery.clone()),
            _ => None,
        });
        let mut repairs: Vec<Repair> = history_events
            .iter()
            .filter_map(|e| match e {
                NodeEvent::Repair { repair } => Some(repair.clone()),
                _ => None,
            })
            .collect();
        repairs.append(&mut self.repairs);
        let recoveries = distinct_recoveries(from_nodes.chain(from_harness), &repairs);
        let appended_keys: std::collections::BTreeSet<String> = history_events
            .iter()
            .filter_map(|e| match e {
                NodeEvent::Pending { txn } | NodeEvent::Done { txn } => Some(txn),
                _ => None,
            })
            .flat_map(|t| &t.ops)
            .filter_map(|op| match op {
                Op::Append { key, .. } => Some(key.clone()),
                _ => None,
            })
            .collect();
        let mut final_audit = None;
        if with_bank {
            let keys: Vec<String> = (0..bank.accounts).map(Bank::account).collect();
            let txn = self.final_read(&bank_store, &keys, &ids, &clock, &out)?;
            final_audit = txn.as_ref().map(|t| t.id);
        }
        let mut final_lists: BTreeMap<String, Vec<i64>> = BTreeMap::new();
        let keys: Vec<String> = appended_keys.into_iter().collect();
        for batch in keys.chunks(256) {
            let Some(txn) = self.final_read(&list_store, batch, &ids, &clock, &out)? else {
                continue;
            };
            for op in txn.ops {
                if let Op::Read { key, value, .. } = op {
                    let list = match value {
                        ReadValue::List(list) => list,
                        _ => Vec::new(),
                    };
                    final_lists.insert(key, list);
                }
            }
        }
        drop(out);
        history_events.extend(read_events(&own_events).map_err(anyhow::Error::msg)?);
        let txns = merge(history_events).map_err(anyhow::Error::msg)?;
        std::fs::write(
            self.dir.join("history.jsonl"),
            txns.iter()
                .map(|t| serde_json::to_string(t).map(|s| s + "\n"))
                .collect::<Result<String, _>>()?,
        )?;

        // The last point an interrupt stops the run at: the checks are its point, and
        // their verdict is reported even if one comes while they run.
        crate::cluster_cmd::check_interrupted()?;
        say!("checking {} transactions", txns.len());
        let index = HistoryIndex::from_txns(txns.iter().cloned())
            .map_err(|e| anyhow::anyhow!("the merged history is malformed: {e}"))?;
        let mut results: Vec<CheckResult> = vec![checks::snapshot_isolation(&txns, &index)];
        if with_bank {
            results.push(checks::bank(&bank, &txns, &index, final_audit));
        }
        if workloads.contains(&ChaosWorkload::ListAppend) {
            results.push(checks::acknowledged(&txns, &final_lists));
        }
        let locks: Vec<Lock> = locks
            .into_iter()
            .map(|l| Lock {
                table: l.table,
                key: l.key,
                cid: l.cid,
            })
            .collect();
        let unpublished: Vec<UnpublishedSlot> = unpublished
            .into_iter()
            .map(|u| UnpublishedSlot {
                table: u.table,
                key: u.key,
            })
            .collect();
        results.push(checks::no_locks(&locks, &unpublished, waited));
        results.push(CheckResult::from_problems(
            "harness",
            if self.problems.is_empty() {
                "every node started, stopped and died when told to; no planned action was \
                 given up on"
                    .into()
            } else {
                "not every node started, stopped or died when told to, or a planned action \
                 was given up on"
                    .into()
            },
            self.problems.clone(),
        ));

        let mut notes = std::mem::take(&mut self.notes);
        let mut deaths = std::mem::take(&mut self.deaths);
        let recovery_summary = report::attribute(&mut deaths, &recoveries, self.t0_ns);
        let commits = txns
            .iter()
            .filter(|t| t.status == Status::Committed && Ids::incarnation_of(t.id) != 0)
            .filter_map(|t| t.end_ns);
        let throughput = Throughput::new(
            report::timeline(commits, self.t0_ns, end_ns, BUCKET_MS),
            BUCKET_MS,
            &deaths,
        );
        let mut server_restarts = std::mem::take(&mut self.server_restarts);
        let server_restart_summary =
            report::attribute_repairs(&mut server_restarts, &repairs, self.t0_ns, &throughput);
        if server_restart_summary.unrepaired > 0 {
            notes.push(format!(
                "{} memory-server restarts were followed by no repair",
                server_restart_summary.unrepaired
            ));
        }
        let stats = index.stats();
        let history = HistorySummary {
            txns: stats.txns,
            committed: stats.committed,
            aborted: stats.aborted,
            unknown: stats.unknown,
            unknown_observed: stats.unknown_observed,
        };
        if !plan.uncovered_points.is_empty() {
            notes.push(format!(
                "the run is too short to arm every crash point ({} left out; {:.0} s covers all)",
                plan.uncovered_points.join(", "),
                plan.full_coverage_ms as f64 / 1000.0
            ));
        }
        let unfired: Vec<&str> = self
            .points
            .iter()
            .filter(|(_, c)| c.armed > 0 && c.fired == 0)
            .map(|(p, _)| p.as_str())
            .collect();
        if !unfired.is_empty() {
            notes.push(format!(
                "armed but never fired within its window: {}",
                unfired.join(", ")
            ));
        }
        let unrecovered = unrecovered_deaths(&deaths);
        if unrecovered > 0 {
            notes.push(format!("{unrecovered} deaths were followed by no recovery"));
        }
        let violations: Vec<String> = results
            .iter()
            .filter(|c| !c.passed)
            .map(|c| format!("{}: {}", c.name, c.summary))
            .collect();
        Ok(ChaosReport {
            config,
            plan: plan.clone(),
            executed: std::mem::take(&mut self.executed),
            actions: self.counts,
            crash_points: self.points.clone(),
            deaths,
            recoveries: recovery_summary,
            server_restarts,
            server_restart_summary,
            throughput,
            elapsed_s: Some(end_ns.saturating_sub(self.t0_ns) as f64 / 1e9),
            history,
            checks: results,
            passed: violations.is_empty(),
            violations,
            notes,
        })
    }

    /// One committed read-only transaction reading `keys`, after recovery. `None` (and
    /// a harness problem) if it cannot commit.
    fn final_read(
        &mut self,
        store: &TxnKv,
        keys: &[String],
        ids: &Ids,
        clock: &Clock,
        out: &EventWriter,
    ) -> Result<Option<Txn>> {
        let mut session = store.open_session();
        let mut last = None;
        let started = Instant::now();
        let mut attempts = 0;
        // The wait before it saw no lock and no index slot left claimed, and only the
        // harness runs: nothing should be in the way. (A run whose five attempts all
        // failed on "conflict" had a key left claimed in the index by a node killed
        // mid-insert, which no wait would have cleared.)
        while attempts < 5 {
            attempts += 1;
            let reads = keys.iter().map(|k| Step::Read(k.clone()));
            let program = Box::new(Script::new(reads.chain([Step::Commit])));
            let txn = run_txn(store, &mut session, program, ids.txn(), 0, clock, out)?;
            if txn.status == Status::Committed {
                return Ok(Some(txn));
            }
            last = txn.error;
            std::thread::sleep(Duration::from_millis(50));
        }
        self.problems.push(format!(
            "the final read of {} keys did not commit in {attempts} attempts over {:.1} s \
             ({last:?})",
            keys.len(),
            started.elapsed().as_secs_f64()
        ));
        Ok(None)
    }

    /// Starts memory server `i`'s backup (`--backup`, on its own data directory and
    /// fixed port): before the primary, which attaches to it when it starts.
    /// `namdb memory-server` arguments for server `name`, durable in the run's
    /// directory, listening on `port`.
    fn server_argv(&self, name: &str, port: u16) -> Vec<String> {
        let bytes = self.server_bytes.to_string();
        [
            "memory-server",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--backend",
            self.args.backend.name(),
            "--size",
            &bytes,
            "--region-size",
            &bytes,
            "--token-file",
            &self.token_file.display().to_string(),
            "--data-dir",
            &self.dir.join(name).display().to_string(),
            "--checkpoint-interval",
            CHECKPOINT_INTERVAL_S,
            // The harness killed outright must not leave its servers behind.
            "--exit-with-parent",
            &std::process::id().to_string(),
        ]
        .into_iter()
        .map(String::from)
        .chain(
            self.rejoins_by_itself()
                .then(|| "--rejoin-when-fenced".to_string()),
        )
        .collect()
    }

    /// Whether a failed-over primary rejoins by itself: stopped, then resumed once its
    /// backup was promoted, it finds itself fenced and starts again in the same process
    /// as that server's backup (`memory-server --rejoin-when-fenced`).
    fn rejoins_by_itself(&self) -> bool {
        self.args.stop_failed_primaries && self.args.rejoin_failed_primaries
    }

    /// The name (data directory) of server `i`'s backup process: the primary's once the
    /// pair is the other way round.
    fn backup_name(&self, i: usize) -> String {
        match self.swapped.get(i) {
            Some(true) => format!("memory-server-{i}"),
            _ => format!("memory-server-{i}-backup"),
        }
    }

    /// Server `i`'s backup's port (see [`Harness::backup_name`]).
    fn backup_port(&self, i: usize) -> u16 {
        let servers = self.args.servers as usize;
        match self.swapped.get(i) {
            Some(true) => self.ports[i],
            _ => self.ports[servers + i],
        }
    }

    /// Starts server `i`'s backup on its port: a plain backup its primary attaches to,
    /// or (`of`) the backup of the promoted server at that address, which it asks to
    /// attach.
    fn start_backup(&mut self, i: usize, of: Option<&str>) -> Result<()> {
        let (name, port) = (self.backup_name(i), self.backup_port(i));
        if self.backup_starts.len() <= i {
            self.backup_starts.resize(i + 1, 0);
        }
        self.backup_starts[i] += 1;
        let start = self.backup_starts[i];
        let suffix = match (start, self.swapped.get(i)) {
            // Apart from the logs and sockets of the primary it was.
            (n, Some(true)) => format!(".as-backup.{n}"),
            (1, _) => String::new(),
            (n, _) => format!(".{n}"),
        };
        let mut argv = self.server_argv(&name, port);
        match of {
            Some(promoted) => argv.extend(["--backup-of".into(), promoted.to_string()]),
            None => argv.insert(1, "--backup".into()),
        }
        // Once promoted it serves queue pairs: on a socket of its own, one per start
        // (a killed process leaves its socket file behind).
        if self.args.backend == ChaosBackend::Shm {
            argv.push("--socket".into());
            argv.push(
                self.dir
                    .join(format!("{name}{suffix}.sock"))
                    .display()
                    .to_string(),
            );
        }
        let log = self.dir.join(format!("{name}{suffix}.log"));
        let entry = crate::cluster_cmd::spawn(&name, "memory server", &argv, &log)?;
        match self.backup_watches.get(i) {
            Some(w) => w.restarted(&entry.address),
            None => {
                let token = self.token.clone();
                // Bounded: a stopped or wedged backup would hold a plain connect until
                // the HTTP/2 keep-alive, or for ever; it counts as unsynced.
                let ask = Box::new(move |address: &str| {
                    memory_server::blocking::Client::connect_within(
                        address,
                        &token,
                        BACKUP_ASK_TIMEOUT,
                    )
                    .is_ok_and(|c| c.server().synced)
                });
                let watch = BackupWatch::spawn(&name, &entry.address, ask)
                    .with_context(|| format!("cannot start watching {name}"))?;
                self.backup_watches.push(watch);
            }
        }
        match self.backups.get_mut(i) {
            Some(e) => *e = entry,
            None => self.backups.push(entry),
        }
        if self.backups_down.len() <= i {
            self.backups_down.resize(i + 1, false);
            self.backups_stopped.resize(i + 1, false);
        }
        self.backups_down[i] = false;
        self.backups_stopped[i] = false;
        Ok(())
    }

    /// Whether memory server `i`'s backup holds its primary's whole state (its Hello
    /// says so): a failover before that would find it refusing Promote, and the nodes
    /// could not come back. Never waits: a watcher thread asks (at most every 100 ms
    /// while this is asked), and until it has an answer from the backup's current
    /// process the backup counts as unsynced; once seen synced, it stays so until the
    /// backup starts again.
    fn backup_synced(&self, i: usize) -> bool {
        self.backup_watches.get(i).is_none_or(BackupWatch::synced)
    }

    /// Lets backups stopped by `--stop-restarted-backups` run again.
    fn resume_backups(&mut self) {
        for i in 0..self.backups_stopped.len() {
            self.resume_backup(i);
        }
    }

    /// Lets memory server `i`'s backup run again if `--stop-restarted-backups` stopped
    /// it.
    fn resume_backup(&mut self, i: usize) {
        if let Some(stopped) = self.backups_stopped.get_mut(i)
            && std::mem::take(stopped)
        {
            signal_pid(self.backups[i].pid, rustix::process::Signal::CONT);
        }
    }

    /// Starts memory server `i` (again) on its data directory and fixed port; the
    /// first time, with `--replicas 2`, its backup before it.
    fn start_memory_server(&mut self, i: usize) -> Result<()> {
        let name = format!("memory-server-{i}");
        if self.args.replicas >= 2 && self.backups.len() == i {
            self.start_backup(i, None)?;
        }
        self.boots[i] += 1;
        let boot = self.boots[i];
        let mut argv = self.server_argv(&name, self.ports[i]);
        if let Some(b) = self.backups.get(i) {
            argv.push("--backup-at".into());
            argv.push(b.address.clone());
            if let Some(ms) = self.args.resync_delay_ms {
                argv.push("--resync-delay-ms".into());
                argv.push(ms.to_string());
            }
        }
        // Each boot its own socket and log: nothing left by the killed process is
        // reused but its data directory.
        if self.args.backend == ChaosBackend::Shm {
            argv.push("--socket".into());
            argv.push(
                self.dir
                    .join(format!("{name}.{boot}.sock"))
                    .display()
                    .to_string(),
            );
        }
        let log = match boot {
            1 => self.dir.join(format!("{name}.log")),
            _ => self.dir.join(format!("{name}.{boot}.log")),
        };
        let entry = crate::cluster_cmd::spawn(&name, "memory server", &argv, &log)?;
        match self.addrs.get(i) {
            None => self.addrs.push(entry.address.clone()),
            Some(addr) if *addr != entry.address => bail!(
                "memory server {i} came back at {} instead of {addr}",
                entry.address
            ),
            Some(_) => {}
        }
        match self.servers.get_mut(i) {
            None => self.servers.push(entry),
            Some(e) => *e = entry,
        }
        self.servers_down[i] = false;
        Ok(())
    }

    /// SIGKILLs memory server `i` and waits for it to be gone; returns when it was
    /// signalled (tearing down its memory takes a while after that).
    fn kill_memory_server(&mut self, i: usize) -> Result<Instant> {
        let killed = kill_and_reap(&self.servers[i], &format!("memory server {i}"))?;
        self.servers_down[i] = true;
        self.last_server_kill = Some(killed);
        if i == 0 {
            self.oracle_server_kills += 1;
        }
        Ok(killed)
    }

    /// Starts compute node `n` as a new incarnation, with `armed` (point, probability,
    /// window).
    fn start_node(&mut self, n: usize, armed: Option<(&str, f64, Duration)>) -> Result<()> {
        self.fenced_out[n] = false;
        self.rearm[n] = None;
        let incarnation = self.next_incarnation;
        self.next_incarnation += 1;
        let events = self.dir.join(format!("node{n}-{incarnation}.events.jsonl"));
        let log = self.dir.join(format!("node{n}-{incarnation}.log"));
        let out = std::fs::File::create(&log)?;
        let workloads: Vec<&str> = self.workloads.iter().map(|w| w.name()).collect();
        let mut command = Command::new(&self.exe);
        command
            .arg("chaos-node")
            .arg("--memory-servers")
            .arg(self.server_specs().join(","))
            .arg("--token-file")
            .arg(&self.token_file)
            .args(["--node", &n.to_string()])
            .args(["--incarnation", &incarnation.to_string()])
            .args(["--sessions", &self.args.sessions.to_string()])
            .args(["--workload", &workloads.join(",")])
            .args(["--lease-ms", &self.args.lease_ms.to_string()])
            .arg("--events")
            .arg(&events)
            .args(["--seed", &self.seed.to_string()])
            .args([
                "--list-key-start",
                &list_key_start(self.max_list_key, armed.map(|(point, _, _)| point)).to_string(),
            ])
            .env_remove("NAMDB_CRASH")
            .stdin(Stdio::piped())
            .stdout(out.try_clone()?)
            .stderr(out);
        if let Some((point, p, _)) = armed {
            command.env("NAMDB_CRASH", format!("{point}:{p}"));
        }
        let mut child = command
            .spawn()
            .with_context(|| format!("cannot start compute node {n}"))?;
        let stdin = child.stdin.take();
        self.event_files.push(events.clone());
        self.nodes[n] = Some(NodeProc {
            child,
            stdin,
            incarnation,
            log,
            armed: armed.map(|(p, _, _)| p.to_string()),
            probability: armed.map_or(0.0, |(_, p, _)| p),
            window: armed.map_or(Duration::ZERO, |(_, _, w)| w),
            ready_at: None,
            chances: 0,
            paused_until: None,
            stopped_ever: false,
            stalled_at_ms: None,
            resumed_at: None,
            last_commit: None,
            started: Instant::now(),
            tail: Tail::new(events),
        });
        Ok(())
    }

    /// Kills each primary stopped by a failover (`--stop-failed-primaries`) once its
    /// backup was promoted, which the nodes do once they find the primary silent (or
    /// resumes it, when it is to rejoin by itself); or,
    /// `now` (the run is being torn down) or a minute after the stop, anyway, then
    /// counting it a problem that the backup was not promoted. The end of the faults
    /// waits for this, as for a stall's settling. Asks each backup at most twice a
    /// second (a bounded Hello; the backup runs).
    fn settle_stopped_primaries(&mut self, now: bool) {
        const ASK_EVERY: Duration = Duration::from_millis(500);
        const PROMOTION_LIMIT: Duration = Duration::from_secs(60);
        for i in 0..self.primaries_stopped.len() {
            let Some((since, asked)) = self.primaries_stopped[i] else {
                continue;
            };
            if !now && asked.elapsed() < ASK_EVERY {
                continue;
            }
            let view = ask_backup(&self.backups[i].address, &self.token);
            let promoted = matches!(view, Ok(BackupView::Promoted));
            if !promoted && !now && since.elapsed() < PROMOTION_LIMIT {
                self.primaries_stopped[i] = Some((since, Instant::now()));
                continue;
            }
            self.primaries_stopped[i] = None;
            if promoted {
                self.counts.stopped_primaries_failed_over += 1;
                if self.rejoins_by_itself() {
                    // Fenced now: it sees its backup promoted over it and rejoins
                    // as that server's backup (the plan's rejoin waits for that).
                    signal_pid(self.servers[i].pid, rustix::process::Signal::CONT);
                    continue;
                }
            } else {
                let said = match view {
                    Ok(view) => format!("its backup {view}"),
                    Err(e) => format!("its backup did not answer: {e}"),
                };
                self.problems.push(format!(
                    "memory server {i}'s primary was stopped {:.1} s ago and its backup was \
                     not promoted ({said})",
                    since.elapsed().as_secs_f64()
                ));
            }
            if let Err(e) = kill_and_reap(&self.servers[i], &format!("memory server {i}")) {
                self.problems.push(format!("{e:#}"));
            }
        }
    }

    /// Reads what the nodes wrote, resumes paused nodes whose time is up, and notices
    /// nodes that died on their own.
    fn poll(&mut self) {
        self.settle_stopped_primaries(false);
        if self.servers_down.iter().all(|d| !d) {
            for n in 0..self.nodes.len() {
                let rearm = self.rearm[n].clone();
                let armed = rearm.as_ref().map(|(p, pr, w)| (p.as_str(), *pr, *w));
                if self.fenced_out[n]
                    && self.nodes[n].is_none()
                    && let Err(e) = self.start_node(n, armed)
                {
                    self.problems
                        .push(format!("cannot start fenced compute node {n} again: {e:#}"));
                }
                if self.lost[n] && self.nodes[n].is_none() {
                    self.lost[n] = false;
                    match self.start_node(n, armed) {
                        Ok(()) => self.counts.reconnects += 1,
                        Err(e) => self
                            .problems
                            .push(format!("cannot start compute node {n} again: {e:#}")),
                    }
                }
            }
        }
        for n in 0..self.nodes.len() {
            let Some(mut p) = self.nodes[n].take() else {
                continue;
            };
            self.absorb(&mut p);
            if p.paused_until.is_some_and(|t| Instant::now() >= t) {
                signal(&p.child, rustix::process::Signal::CONT);
                p.paused_until = None;
                if p.stalled_at_ms.is_some() {
                    p.resumed_at = Some(Instant::now());
                }
            }
            match p.child.try_wait() {
                Ok(None) => {
                    if p.resumed_at.is_some_and(|at| at.elapsed() >= STALL_SETTLE) {
                        self.ran_on(n, p.incarnation, p.stalled_at_ms.take());
                    }
                    self.nodes[n] = Some(p);
                }
                Ok(Some(status)) => self.exited(n, p, status),
                Err(e) => {
                    self.problems
                        .push(format!("cannot wait for compute node {n}: {e}"));
                    self.nodes[n] = Some(p);
                }
            }
        }
    }

    fn absorb(&mut self, p: &mut NodeProc) {
        for event in p.tail.poll() {
            match event {
                NodeEvent::Ready { .. } => p.ready_at = Some(Instant::now()),
                NodeEvent::Done { txn } | NodeEvent::Pending { txn } => {
                    if txn.status == Status::Committed {
                        self.committed += 1;
                        p.last_commit = Some(Instant::now());
                    }
                    if p.armed
                        .as_deref()
                        .is_some_and(|point| had_chance(point, &txn))
                    {
                        p.chances += 1;
                    }
                    for op in &txn.ops {
                        if let Op::Append { key, .. } = op
                            && let Some(k) = SharedListAppend::key_number(key)
                        {
                            self.max_list_key = self.max_list_key.max(k);
                        }
                    }
                }
                NodeEvent::Recovery { recovery } => {
                    self.recoveries_seen.insert((
                        recovery.slot,
                        recovery.holder_tag,
                        self.oracle_server_kills,
                    ));
                }
                NodeEvent::Repair { .. } => {}
            }
        }
    }

    /// Node `n` exited without being killed by us: at its armed point, or a problem.
    fn exited(&mut self, n: usize, mut p: NodeProc, status: ExitStatus) {
        self.absorb(&mut p);
        let at = self.ms(Instant::now());
        let aborted = status.signal() == Some(rustix::process::Signal::ABORT.as_raw());
        // Lost a memory server the harness killed since the node started: expected,
        // and not a death of its own (the server's death is the one counted).
        let unfired = p
            .armed
            .clone()
            .map(|point| (point, p.probability, p.window));
        if status.code() == Some(SERVER_LOST)
            && self.last_server_kill.is_some_and(|k| k >= p.started)
        {
            self.lost[n] = true;
            self.rearm[n] = unfired;
            return;
        }
        // Fenced by another node: a death (at the stall, for a stalled node), after
        // which a new process opens the database. Fencing is per process, so a node is
        // also fenced when one of its workers stops committing on purpose (a commit
        // left half installed by a failed Persist, such as one refused past the persist
        // patience during a backup's outage, for recovery to finish once that
        // worker's lease lapsed): noted, not a problem.
        if status.code() == Some(FENCED) {
            if p.stalled_at_ms.is_none() {
                self.notes.push(format!(
                    "compute node {n} (incarnation {}) was fenced without a stall{}: one of its \
                     workers stopped renewing its lease",
                    p.incarnation,
                    if p.stopped_ever {
                        " (it had a short pause)"
                    } else {
                        ""
                    }
                ));
            }
            self.counts.fenced += 1;
            if p.stalled_at_ms.is_some() {
                self.counts.stalls_fenced += 1;
            }
            self.deaths.push(Death {
                node: n,
                incarnation: p.incarnation,
                cause: "fenced".into(),
                at_ms: p.stalled_at_ms.unwrap_or(at),
                recoveries: 0,
                recovered_after_ms: None,
            });
            // Not here: `exited` runs inside actions too (a kill finding the node
            // exited), which may start the node themselves.
            self.fenced_out[n] = true;
            if let Some((point, _, _)) = &unfired {
                self.notes.push(format!(
                    "compute node {n} (incarnation {}) was fenced before {point} fired: its \
                     next process is armed again",
                    p.incarnation
                ));
            }
            self.rearm[n] = unfired;
            return;
        }
        let cause = match &p.armed {
            Some(point) if aborted => {
                self.counts.crashes_fired += 1;
                self.points.entry(point.clone()).or_default().fired += 1;
                format!("crash:{point}")
            }
            _ => {
                let log = std::fs::read_to_string(&p.log).unwrap_or_default();
                self.problems.push(format!(
                    "compute node {n} (incarnation {}) exited unexpectedly ({status}); its log \
                     {} ends:\n{}",
                    p.incarnation,
                    p.log.display(),
                    tail(&log)
                ));
                "unexpected".into()
            }
        };
        self.deaths.push(Death {
            node: n,
            incarnation: p.incarnation,
            cause,
            at_ms: at,
            recoveries: 0,
            recovered_after_ms: None,
        });
    }

    /// SIGSTOPs node `n`, if it runs, for `for_ms` (`poll` resumes it).
    fn stop(&mut self, n: usize, for_ms: u64) -> Option<&mut NodeProc> {
        let p = self.nodes[n].as_mut()?;
        signal(&p.child, rustix::process::Signal::STOP);
        p.paused_until = Some(Instant::now() + Duration::from_millis(for_ms));
        p.stopped_ever = true;
        Some(p)
    }

    /// Why node `n`'s stall is not over yet, if it is not: it is still stopped, or
    /// resumed less than [`STALL_SETTLE`] ago and may not have read its fence yet.
    fn stall_unsettled(&self, n: usize) -> Option<String> {
        let p = self.nodes[n].as_ref()?;
        p.stalled_at_ms?;
        match p.resumed_at {
            None => Some(format!("compute node {n} is stalled")),
            Some(at) if at.elapsed() < STALL_SETTLE => Some(format!(
                "compute node {n} was stalled past its lease and may not have found its fence yet"
            )),
            Some(_) => None,
        }
    }

    /// A note if incarnation `incarnation` of node `n` was stalled (at
    /// `stalled_at_ms`) and still runs once its stall settled: no other node fenced it.
    /// Not a problem: another node fences a holder only once it needs the holder's
    /// timestamps or locks, a lease after it saw the need, which a cluster slowed by an
    /// outage may not reach within the stall; the stalled node then renews and goes on,
    /// as it may. That stalls are fenced at all is what the tests check
    /// ([`ActionCounts::stalls_fenced`]).
    fn ran_on(&mut self, n: usize, incarnation: u64, stalled_at_ms: Option<f64>) {
        if let Some(at_ms) = stalled_at_ms {
            self.notes.push(format!(
                "compute node {n} (incarnation {incarnation}) was stopped past its lease at \
                 {:.1} s and ran on: no other node had fenced it {STALL_SETTLE:?} after it \
                 resumed",
                at_ms / 1000.0
            ));
        }
    }

    /// SIGKILLs node `n` if it runs; returns the incarnation killed.
    fn kill(&mut self, n: usize) -> Option<u64> {
        let mut p = self.nodes[n].take()?;
        let _ = p.child.kill();
        let status = p.child.wait();
        self.absorb(&mut p);
        // It may have died on its own just before.
        if let Ok(status) = status
            && status.signal() != Some(rustix::process::Signal::KILL.as_raw())
        {
            self.exited(n, p, status);
            return None;
        }
        self.ran_on(n, p.incarnation, p.stalled_at_ms);
        self.counts.kills += 1;
        self.deaths.push(Death {
            node: n,
            incarnation: p.incarnation,
            cause: "kill".into(),
            at_ms: self.ms(Instant::now()),
            recoveries: 0,
            recovered_after_ms: None,
        });
        Some(p.incarnation)
    }

    /// Whether node `n`'s workloads reach crash point `point`: bank transfers create
    /// no records, so a node running only those never passes an insert step.
    fn can_reach(&self, n: usize, point: &str) -> bool {
        !INSERT_POINTS.contains(&point)
            || (0..self.args.sessions as usize)
                .any(|s| session_workload(self.workloads, n, s) == ChaosWorkload::ListAppend)
    }

    /// Why `action` cannot run yet, if it cannot.
    fn blocked(&self, action: &Action) -> Option<Blocked> {
        if let Action::FailoverMemoryServer { server } | Action::KillBackup { server } = *action
            && server < self.backups.len()
            && !self.backup_synced(server)
        {
            return Some(Blocked {
                reason: format!(
                    "memory server {server}'s backup does not hold its primary's state yet"
                ),
                skip: true,
            });
        }
        if let Action::RejoinAsBackup { server } = *action
            && let Some(reason) = self.not_ready_to_rejoin(server)
        {
            // Rejoining as the backup of a backup that was never promoted would be
            // refused (it takes no backup), and the old primary would exit.
            return Some(Blocked { reason, skip: true });
        }
        self.waits_for(action).map(|reason| Blocked {
            reason,
            skip: false,
        })
    }

    /// Why server `i`'s failed-over primary cannot rejoin yet, if so: a stopped
    /// primary must be gone (or resumed) and its backup promoted. A primary that
    /// rejoins by itself must also say it is a backup, which it does once it found
    /// itself fenced and started again as the promoted server's backup (in the same
    /// process, at the same address); given up on when it never does, since a fenced
    /// primary that stays one is what the run is to find.
    fn not_ready_to_rejoin(&self, i: usize) -> Option<String> {
        if self.primaries_stopped.get(i).is_some_and(Option::is_some) {
            return Some(format!(
                "memory server {i}'s stopped primary was not failed over yet"
            ));
        }
        let (who, process, wanted, not_yet) = if self.rejoins_by_itself() {
            (
                "old primary, resumed,",
                self.servers.get(i)?,
                memory_server::Role::Backup,
                "has not rejoined as the backup by itself yet",
            )
        } else {
            (
                "backup",
                self.backups.get(i)?,
                memory_server::Role::Promoted,
                "is not promoted yet: no node came back on it",
            )
        };
        match self.role_of(&process.address) {
            Ok(role) if role == wanted => None,
            Ok(role) => Some(format!(
                "memory server {i}'s {who} {not_yet} (it says {role:?})"
            )),
            Err(e) => Some(format!("memory server {i}'s {who} did not answer: {e}")),
        }
    }

    /// The role the server at `address` says it has (a bounded Hello), asked at most
    /// every [`ROLE_ASK_EVERY`]: the loop asks again every few milliseconds while an
    /// action waits on the answer, and each ask is a session at the server (73 in a
    /// few seconds of one rejoin's wait, all in its log).
    fn role_of(&self, address: &str) -> Result<memory_server::Role, String> {
        let mut last = self.role_asked.borrow_mut();
        if let Some((asked, at, role)) = &*last
            && asked == address
            && at.elapsed() < ROLE_ASK_EVERY
        {
            return role.clone();
        }
        let role = memory_server::blocking::Client::connect_within(
            address,
            &self.token,
            BACKUP_ASK_TIMEOUT,
        )
        .map(|c| c.server().role)
        .map_err(|e| e.to_string());
        *last = Some((address.to_string(), Instant::now(), role.clone()));
        role
    }

    /// Why `action` has nothing to act on, if so: the restart of a backup or server
    /// whose kill was skipped (or failed) would start a second process on the port of
    /// the one still running.
    fn moot(&self, action: &Action) -> Option<String> {
        match *action {
            Action::RestartBackup { server }
                if !self.backups_down.get(server).copied().unwrap_or(false) =>
            {
                Some(format!(
                    "memory server {server}'s backup is running: it was not killed"
                ))
            }
            // A rejoin skipped (its backup never promoted) leaves one copy: nothing
            // may kill it.
            Action::FailoverMemoryServer { server } if self.failed_over[server] => Some(format!(
                "memory server {server} failed over and its old primary did not rejoin: it \
                 has no backup to fail over to"
            )),
            Action::RestartMemoryServer { server }
                if !self.servers_down[server] && !self.failed_over[server] =>
            {
                Some(format!(
                    "memory server {server} is running: it was not killed"
                ))
            }
            _ => None,
        }
    }

    /// Why `action` should wait, if it should, where carrying it out after giving up
    /// on the wait is still sound: the episode only hits less running work (a node
    /// still starting), an armed node is disarmed, which is what giving up on its
    /// point means, or a stall's verdict is taken from what the harness saw so far.
    fn waits_for(&self, action: &Action) -> Option<String> {
        let n = action.node();
        match action {
            // Only once every node runs (again) after the last episode, so that the
            // kill hits running work (and a stalled node has another to fence it).
            Action::KillMemoryServer { .. }
            | Action::FailoverMemoryServer { .. }
            | Action::KillBackup { .. }
            | Action::Stall { .. } => {
                let not_ready = self
                    .nodes
                    .iter()
                    .enumerate()
                    .find(|(_, p)| p.as_ref().is_none_or(|p| p.ready_at.is_none()))
                    .map(|(n, _)| format!("compute node {n} is not ready"));
                if not_ready.is_some() || !matches!(action, Action::Stall { .. }) {
                    return not_ready;
                }
                // A stall is meant to be fenced by another node: only while every node
                // commits (not through a backup outage; the stalled node holds
                // timestamps the others need), and one stall at a time.
                return (0..self.nodes.len()).find_map(|other| {
                    self.stall_unsettled(other).or_else(|| {
                        let p = self.nodes[other].as_ref()?;
                        p.last_commit
                            .is_none_or(|at| at.elapsed() > COMMITS_FLOWING)
                            .then(|| {
                                format!(
                                    "compute node {other} has not committed in the last \
                                     {COMMITS_FLOWING:?}"
                                )
                            })
                    })
                });
            }
            Action::RestartMemoryServer { .. }
            | Action::RestartBackup { .. }
            | Action::RejoinAsBackup { .. } => return None,
            _ => {}
        }
        if let Some(reason) = self.stall_unsettled(n) {
            return Some(reason);
        }
        // Started again by `poll` on its next turn: an action before that (the plan's
        // restart, finding no process) would start it unarmed.
        if let Some((point, _, _)) = &self.rearm[n] {
            return Some(format!(
                "compute node {n} is to start again armed at {point}"
            ));
        }
        let p = self.nodes[n].as_ref()?;
        match action {
            Action::Kill { .. } | Action::Pause { .. } if p.ready_at.is_none() => {
                Some(format!("compute node {n} is not ready"))
            }
            Action::Restart { .. } => match (&p.armed, p.ready_at) {
                (Some(_), None) => Some(format!("armed compute node {n} is not ready")),
                (Some(point), Some(ready)) => {
                    let patient = keeps_armed(
                        ready.elapsed(),
                        p.window,
                        p.chances,
                        self.can_reach(n, point),
                    );
                    patient.then(|| format!("compute node {n} may still crash at {point}"))
                }
                _ => None,
            },
            _ => None,
        }
    }

    /// Carries out `plan`, then lets the nodes run to the end of the duration.
    fn execute(&mut self, plan: &FaultPlan) {
        let duration = Duration::from_secs_f64(self.args.duration);
        let mut slip = Duration::ZERO;
        let mut next = 0;
        let mut blocked_since: Option<Instant> = None;
        let give_up_after = Duration::from_millis(self.args.give_up_after_ms);
        let mut last_progress = Instant::now();
        let mut last_committed = 0;
        // Until an interrupt; the caller then stops.
        while !crate::cluster_cmd::is_interrupted() {
            self.poll();
            let now = Instant::now();
            if now.duration_since(last_progress) >= Duration::from_secs(1) {
                let rate = (self.committed - last_committed) as f64
                    / now.duration_since(last_progress).as_secs_f64();
                last_committed = self.committed;
                last_progress = now;
                self.progress(rate);
            }
            let Some(planned) = plan.actions.get(next) else {
                if now.duration_since(self.t0) >= duration + slip {
                    return;
                }
                std::thread::sleep(Duration::from_millis(5));
                continue;
            };
            let due = self.t0 + Duration::from_millis(planned.at_ms) + slip;
            if now < due {
                std::thread::sleep((due - now).min(Duration::from_millis(5)));
                continue;
            }
            let mut skipped = None;
            if let Some(Blocked { reason, skip }) = self.blocked(&planned.action) {
                let since = *blocked_since.get_or_insert(now);
                if now.duration_since(since) < give_up_after {
                    std::thread::sleep(Duration::from_millis(2));
                    continue;
                }
                let consequence = if skip {
                    "; not carried out"
                } else {
                    "; carried out anyway"
                };
                self.problems.push(format!(
                    "{} of {} {} gave up waiting after {give_up_after:?}: {reason}{consequence}",
                    planned.action.name(),
                    what(&planned.action),
                    planned.action.node()
                ));
                if skip {
                    skipped = Some(reason);
                }
            }
            if skipped.is_none() {
                skipped = self.moot(&planned.action);
            }
            blocked_since = None;
            // The stop lasts until the next action on the server has waited for it:
            // after that, nodes started by later actions would wait on it too.
            if planned.action.on_server() {
                self.resume_backup(planned.action.node());
            }
            slip = slip.max(now.duration_since(self.t0 + Duration::from_millis(planned.at_ms)));
            let outcome = match skipped {
                Some(reason) => {
                    say!(
                        "  skipped {} of {} {}: {reason}",
                        planned.action.name(),
                        what(&planned.action),
                        planned.action.node()
                    );
                    Ok(format!("skipped: {reason}"))
                }
                None => self.act(&planned.action),
            };
            let outcome = match outcome {
                Ok(outcome) => outcome,
                Err(e) => {
                    self.problems.push(format!(
                        "{} of {} {}: {e:#}",
                        planned.action.name(),
                        what(&planned.action),
                        planned.action.node()
                    ));
                    format!("failed: {e:#}")
                }
            };
            self.executed.push(Executed {
                at_ms: self.ms(now) as u64,
                planned_ms: planned.at_ms,
                action: planned.action.name().into(),
                node: planned.action.node(),
                outcome,
            });
            next += 1;
        }
    }

    fn act(&mut self, action: &Action) -> Result<String> {
        Ok(match action {
            Action::Kill { node } => match self.kill(*node) {
                Some(incarnation) => format!("killed incarnation {incarnation}"),
                None => "not running".into(),
            },
            Action::Crash {
                node,
                point,
                probability,
                window_ms,
            } => {
                if self.nodes[*node].is_some() {
                    self.kill(*node);
                }
                let window = Duration::from_millis(*window_ms);
                self.start_node(*node, Some((point, *probability, window)))?;
                self.counts.crashes_armed += 1;
                self.points.entry(point.clone()).or_default().armed += 1;
                format!("armed, window {window_ms} ms")
            }
            Action::Restart { node } => {
                let mut outcome = String::new();
                if self.nodes[*node]
                    .as_ref()
                    .is_some_and(|p| p.armed.is_some())
                {
                    let point = self.nodes[*node].as_ref().and_then(|p| p.armed.clone());
                    if let Some(incarnation) = self.kill(*node) {
                        outcome = format!(
                            "{} did not fire: killed incarnation {incarnation}; ",
                            point.unwrap_or_default()
                        );
                    }
                } else if let Some(incarnation) = self.kill(*node) {
                    outcome = format!("was running: killed incarnation {incarnation}; ");
                }
                self.start_node(*node, None)?;
                self.counts.restarts += 1;
                outcome + "started"
            }
            Action::KillMemoryServer { server } => {
                let killed = self.kill_memory_server(*server)?;
                self.counts.server_kills += 1;
                let at_ms = self.ms(killed);
                self.deaths.push(Death {
                    node: *server,
                    incarnation: self.boots[*server],
                    cause: "server-kill".into(),
                    at_ms,
                    recoveries: 0,
                    recovered_after_ms: None,
                });
                self.server_restarts.push(ServerRestart {
                    server: *server,
                    failover: false,
                    killed_at_ms: at_ms,
                    restarted_at_ms: None,
                    repairs: Vec::new(),
                    commits_resumed_after_ms: None,
                });
                format!("killed memory server boot {}", self.boots[*server])
            }
            Action::FailoverMemoryServer { server } => {
                if self.backups.get(*server).is_none() {
                    bail!("memory server {server} has no backup to fail over to");
                }
                let boot = self.boots[*server];
                let killed = if self.args.stop_failed_primaries {
                    signal_pid(self.servers[*server].pid, rustix::process::Signal::STOP);
                    let stopped = Instant::now();
                    if self.primaries_stopped.len() <= *server {
                        self.primaries_stopped.resize(*server + 1, None);
                    }
                    self.primaries_stopped[*server] = Some((stopped, stopped));
                    self.counts.stopped_primaries += 1;
                    // Nodes that find it silent exit as having lost the server.
                    self.last_server_kill = Some(stopped);
                    stopped
                } else {
                    self.kill_memory_server(*server)?
                };
                // Nothing to wait for: the backup is up, and the nodes that lost the
                // primary are started again at once (the first promotes the backup).
                self.servers_down[*server] = false;
                self.failed_over[*server] = true;
                self.counts.server_failovers += 1;
                let at_ms = self.ms(killed);
                self.deaths.push(Death {
                    node: *server,
                    incarnation: boot,
                    cause: "server-failover".into(),
                    at_ms,
                    recoveries: 0,
                    recovered_after_ms: None,
                });
                self.server_restarts.push(ServerRestart {
                    server: *server,
                    failover: true,
                    killed_at_ms: at_ms,
                    restarted_at_ms: None,
                    repairs: Vec::new(),
                    commits_resumed_after_ms: None,
                });
                if self.args.stop_failed_primaries {
                    format!("stopped primary boot {boot} (SIGSTOP); its backup takes over")
                } else {
                    format!("killed primary boot {boot} for good; its backup takes over")
                }
            }
            Action::KillBackup { server } => {
                if self.failed_over[*server] || self.backups.get(*server).is_none() {
                    bail!("memory server {server} has no backup to kill");
                }
                kill_and_reap(
                    &self.backups[*server],
                    &format!("memory server {server}'s backup"),
                )?;
                self.backups_down[*server] = true;
                // Reaped: its pid may be another process's now.
                self.backups_stopped[*server] = false;
                self.counts.backup_kills += 1;
                "killed its backup: commits on it fail until the backup is back".into()
            }
            Action::RestartBackup { server } => {
                self.start_backup(*server, None)?;
                self.counts.backup_restarts += 1;
                if self.args.stop_restarted_backups {
                    signal_pid(self.backups[*server].pid, rustix::process::Signal::STOP);
                    self.backups_stopped[*server] = true;
                    "its backup listening again, and stopped until the next action on its \
                     server (--stop-restarted-backups)"
                        .into()
                } else {
                    "its backup listening again (the primary attaches and copies its state)".into()
                }
            }
            Action::RejoinAsBackup { server } => {
                let i = *server;
                if !self.failed_over[i] || self.backups.get(i).is_none() {
                    bail!("memory server {i} did not fail over: no primary to rejoin");
                }
                // The promoted backup serves as the primary now; the dead primary's
                // entry is replaced by the process started in its place.
                let (servers, backups) = (&mut self.servers, &mut self.backups);
                std::mem::swap(&mut servers[i], &mut backups[i]);
                self.swapped[i] = !self.swapped[i];
                let promoted = self.servers[i].address.clone();
                let said = if self.rejoins_by_itself() {
                    // The same process, a backup now: whatever its watcher learnt of
                    // it as the other server's backup is stale.
                    let rejoined = &self.backups[i];
                    if let Some(w) = self.backup_watches.get(i) {
                        w.restarted(&rejoined.address);
                    }
                    self.backups_down[i] = false;
                    self.backups_stopped[i] = false;
                    self.counts.primaries_rejoined_by_themselves += 1;
                    format!(
                        "its old primary (pid {}), resumed, found itself fenced and rejoined by \
                         itself as the backup of the promoted {promoted}, which copies its state \
                         there",
                        rejoined.pid
                    )
                } else {
                    self.start_backup(i, Some(&promoted))?;
                    format!(
                        "its old primary listening again as the backup of the promoted \
                         {promoted}, which copies its state there"
                    )
                };
                self.failed_over[i] = false;
                self.counts.primary_rejoins += 1;
                said
            }
            Action::RestartMemoryServer { server } => {
                if self.failed_over[*server] {
                    bail!("memory server {server} failed over: its primary stays down");
                }
                self.start_memory_server(*server)?;
                self.counts.server_restarts += 1;
                let at_ms = self.ms(Instant::now());
                if let Some(r) = self
                    .server_restarts
                    .iter_mut()
                    .rev()
                    .find(|r| r.server == *server)
                {
                    r.restarted_at_ms = Some(at_ms);
                }
                format!("memory server boot {} listening", self.boots[*server])
            }
            Action::Pause { node, for_ms } => match self.stop(*node, *for_ms) {
                Some(_) => {
                    self.counts.pauses += 1;
                    format!("stopped for {for_ms} ms")
                }
                None => "not running".into(),
            },
            Action::Stall { node, for_ms } => {
                let at_ms = self.ms(Instant::now());
                match self.stop(*node, *for_ms) {
                    Some(p) => {
                        p.stalled_at_ms = Some(at_ms);
                        self.counts.stalls += 1;
                        format!("stopped for {for_ms} ms, past its lease")
                    }
                    None => "not running".into(),
                }
            }
        })
    }

    fn progress(&self, rate: f64) {
        let up = self
            .nodes
            .iter()
            .flatten()
            .filter(|p| p.ready_at.is_some())
            .count();
        say!(
            "  {:>6.1} s  {:>9} committed ({:>6.0}/s)  nodes up {up}/{}  kills {}  crashes \
             {}/{} fired  pauses {}  stalls {} ({} fenced)  nodes fenced {}  server restarts {}  failovers {}  \
             recoveries {}",
            self.ms(Instant::now()) / 1000.0,
            self.committed,
            rate,
            self.nodes.len(),
            self.counts.kills,
            self.counts.crashes_fired,
            self.counts.crashes_armed,
            self.counts.pauses,
            self.counts.stalls,
            self.counts.stalls_fenced,
            self.counts.fenced,
            self.counts.server_restarts,
            self.counts.server_failovers,
            self.recoveries_seen.len()
        );
    }

    /// Stops every node cleanly (closing its stdin) and waits for it.
    fn stop_nodes(&mut self) {
        for p in self.nodes.iter_mut().flatten() {
            if p.paused_until.take().is_some() {
                signal(&p.child, rustix::process::Signal::CONT);
            }
            p.stdin = None;
        }
        let deadline = Instant::now() + STOP_TIMEOUT;
        for n in 0..self.nodes.len() {
            let Some(mut p) = self.nodes[n].take() else {
                continue;
            };
            let status = loop {
                match p.child.try_wait() {
                    Ok(Some(status)) => break Some(status),
                    Ok(None) if Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(10))
                    }
                    _ => break None,
                }
            };
            self.absorb(&mut p);
            match status {
                Some(status) if status.success() => {}
                Some(status) => {
                    let log = std::fs::read_to_string(&p.log).unwrap_or_default();
                    self.problems.push(format!(
                        "compute node {n} (incarnation {}) failed at the end ({status}); its log \
                         {} ends:\n{}",
                        p.incarnation,
                        p.log.display(),
                        tail(&log)
                    ));
                }
                None => {
                    let _ = p.child.kill();
                    let _ = p.child.wait();
                    self.problems.push(format!(
                        "compute node {n} (incarnation {}) did not stop within {STOP_TIMEOUT:?}",
                        p.incarnation
                    ));
                }
            }
        }
    }
}

/// Why a planned action cannot run yet ([`Harness::blocked`]).
struct Blocked {
    reason: String,
    /// Not to be carried out once the harness gives up waiting: it would be wrong, not
    /// just less useful. A failover to a backup that does not hold its primary's
    /// state would leave the server with no copy a node can promote (the backup
    /// rightly refuses Promote, and every node would retry it until it gave up); a
    /// backup killed before it holds that state would cut short the state transfer of
    /// the episode before (two episodes on one server at once, which the plan rules
    /// out), and the failover planned after it would find the backup unsynced again.
    skip: bool,
}

fn what(action: &Action) -> &'static str {
    if action.on_server() {
        "memory server"
    } else {
        "compute node"
    }
}

/// A port on 127.0.0.1 nothing listens on now. The memory server binds it with
/// SO_REUSEADDR, so it gets it back after a kill.
/// `n` distinct free ports: each listener is held until all are picked, or the kernel
/// could hand out one port twice.
fn free_ports(n: usize) -> Result<Vec<u16>> {
    let listeners = (0..n)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").context("cannot find a free port"))
        .collect::<Result<Vec<_>>>()?;
    listeners
        .iter()
        .map(|l| Ok(l.local_addr()?.port()))
        .collect()
}

/// Sends `signal` to a child that has not been waited for (so its pid is still ours,
/// even if it has exited).
fn signal(child: &Child, signal: rustix::process::Signal) {
    signal_pid(child.id(), signal);
}

/// As [`signal`], for a child known by its pid (a memory server's `ProcessEntry`): one
/// the harness has not reaped, as `kill_and_reap` does with those it kills.
fn signal_pid(pid: u32, signal: rustix::process::Signal) {
    if let Some(pid) = rustix::process::Pid::from_raw(pid as i32) {
        let _ = rustix::process::kill_process(pid, signal);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A holding recovered again after a restart of server 0 (which resets the lease
    /// tags) is a recovery of its own; one reported twice within one life of the
    /// oracle is one. Before, every recovery of a (slot, tag) seen earlier was dropped.
    #[test]
    fn a_kill_of_server_0_needs_no_recovery_and_other_deaths_do() {
        let death = |node: usize, cause: &str, recoveries: u64| Death {
            node,
            incarnation: 1,
            cause: cause.into(),
            at_ms: 0.0,
            recoveries,
            recovered_after_ms: None,
        };
        let deaths = [
            death(0, "server-kill", 0),
            death(1, "server-kill", 0),
            death(0, "server-failover", 0),
            death(2, "kill", 0),
            death(1, "crash:after-log", 0),
            death(0, "kill", 3),
            death(1, "server-kill", 2),
        ];
        assert_eq!(unrecovered_deaths(&deaths), 4);
        assert_eq!(unrecovered_deaths(&deaths[..1]), 0);
    }

    #[test]
    fn recoveries_after_a_restart_of_server_0_are_counted() {
        let at = |s: u64| SystemTime::UNIX_EPOCH + Duration::from_secs(s);
        let restart = |servers: Vec<usize>, s: u64| {
            repair(
                &txn::RestartReport {
                    restarted: servers,
                    log_records: 0,
                    reinstalled: 0,
                    locks_rolled_forward: 0,
                    locks_rolled_back: 0,
                    claims_settled: 0,
                    blocks_scanned: 0,
                    oracle_from: None,
                    took: Duration::ZERO,
                },
                at(s),
            )
        };
        let recovered = |slot: u32, holder_tag: u16, s: u64| Recovery {
            slot,
            holder_tag,
            rolled_forward: 0,
            rolled_back: 0,
            blocks_scanned: 0,
            took_us: 0,
            finished_ns: s * 1_000_000_000,
        };
        let reported = vec![
            recovered(0, 1, 10),
            // The same holding, reported by a second process (a takeover).
            recovered(0, 1, 11),
            recovered(3, 1, 12),
            // Server 1's restart keeps the tags; server 0's resets them.
            recovered(0, 1, 25),
            recovered(0, 1, 35),
            recovered(0, 2, 36),
        ];
        let repairs = [restart(vec![1], 20), restart(vec![0], 30)];
        let kept: Vec<(u32, u16, u64)> = distinct_recoveries(reported.into_iter(), &repairs)
            .iter()
            .map(|r| (r.slot, r.holder_tag, r.finished_ns / 1_000_000_000))
            .collect();
        assert_eq!(kept, [(0, 1, 10), (3, 1, 12), (0, 1, 35), (0, 2, 36)]);
    }

    /// The repair event carries every count of the restart report; the index claims
    /// settled were once left out.
    #[test]
    fn a_repair_event_carries_the_restart_reports_counts() {
        let report = txn::RestartReport {
            restarted: vec![0, 2],
            log_records: 11,
            reinstalled: 3,
            locks_rolled_forward: 2,
            locks_rolled_back: 1,
            claims_settled: 4,
            blocks_scanned: 99,
            oracle_from: Some(77),
            took: Duration::from_micros(1500),
        };
        let event = repair(&report, SystemTime::UNIX_EPOCH + Duration::from_secs(1));
        assert_eq!(
            (
                event.restarted.as_slice(),
                event.log_records,
                event.reinstalled
            ),
            (&[0, 2][..], 11, 3)
        );
        assert_eq!(
            (event.locks_rolled_forward, event.locks_rolled_back),
            (2, 1)
        );
        assert_eq!((event.claims_settled, event.blocks_scanned), (4, 99));
        assert_eq!((event.oracle_from, event.took_us), (Some(77), 1500));
        assert_eq!(event.finished_ns, 1_000_000_000);
        let line = serde_json::to_value(NodeEvent::Repair { repair: event }).unwrap();
        assert_eq!(line["repair"]["claims_settled"], 4, "{line}");
    }

    #[test]
    fn free_ports_are_distinct() {
        // Bound one at a time and dropped, ports repeated about once in a thousand
        // sets of four; held together they cannot.
        for _ in 0..200 {
            let ports = free_ports(4).unwrap();
            let distinct: std::collections::HashSet<u16> = ports.iter().copied().collect();
            assert_eq!(distinct.len(), 4, "{ports:?}");
        }
    }

    #[test]
    fn an_armed_node_waits_for_its_chances_not_for_a_time() {
        let window = Duration::from_secs(1);
        // Under load a node can spend many windows in a few commits: it stays armed
        // (a bound of 10 windows let a point go unfired in CI).
        assert!(keeps_armed(window * 3, window, 149, true));
        assert!(keeps_armed(window * 11, window, 20, true));
        assert!(keeps_armed(Duration::from_secs(39), window, 149, true));
        // Enough chances, a node that stopped committing, or an unreachable point.
        assert!(!keeps_armed(window * 3, window, 150, true));
        assert!(!keeps_armed(CRASH_PATIENCE_LIMIT, window, 0, true));
        assert!(!keeps_armed(window * 3, window, 0, false));
        assert!(keeps_armed(window * 2, window, 1000, false));
        assert!(CRASH_PATIENCE_LIMIT < START_TIMEOUT);
    }

    #[test]
    fn chances_at_a_point_are_commits_that_reach_it() {
        let txn = |status, ops| Txn {
            ops,
            ..Txn::new(1, 1, status)
        };
        let append = vec![Op::Append {
            key: "l1".into(),
            element: 1,
        }];
        let write = vec![Op::Write {
            key: "a1".into(),
            value: 5,
        }];
        let read = vec![Op::Read {
            key: "l1".into(),
            value: ReadValue::Absent,
            version: None,
        }];
        for point in txn::crash::POINTS {
            assert!(had_chance(point, &txn(Status::Committed, append.clone())));
            assert!(!had_chance(point, &txn(Status::Committed, read.clone())));
            assert!(!had_chance(point, &txn(Status::Aborted, append.clone())));
            assert_eq!(
                had_chance(point, &txn(Status::Committed, write.clone())),
                !INSERT_POINTS.contains(point),
                "{point}"
            );
        }
    }

    #[test]
    fn a_node_armed_at_an_insert_step_appends_to_keys_no_node_has_created() {
        let window = SharedListAppend::ACTIVE_KEYS;
        // Any node's keys end within a window of the newest appended.
        assert_eq!(list_key_start(100, None), 100 - window);
        assert_eq!(list_key_start(100, Some("after-lock")), 100 - window);
        assert_eq!(list_key_start(3, None), 0);
        for point in INSERT_POINTS {
            assert!(list_key_start(100, Some(point)) > 100 + window, "{point}");
        }
    }

    #[test]
    fn durations_must_be_positive_and_finite() {
        assert_eq!(parse_seconds("2.5"), Ok(2.5));
        for bad in ["0", "-1", "nan", "inf", "1e9", "abc", ""] {
            assert!(parse_seconds(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_tail_returns_complete_lines_once() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("e.jsonl");
        let mut tail = Tail::new(path.clone());
        assert!(tail.poll().is_empty());
        let ready = r#"{"event":"ready","node":1,"incarnation":2}"#;
        std::fs::write(&path, format!("{ready}\n{}", &ready[..10])).unwrap();
        assert_eq!(
            tail.poll(),
            [NodeEvent::Ready {
                node: 1,
                incarnation: 2
            }]
        );
        std::fs::write(&path, format!("{ready}\n{ready}\n")).unwrap();
        assert_eq!(tail.poll().len(), 1);
        assert!(tail.poll().is_empty());
    }
}
