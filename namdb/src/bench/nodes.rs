//! Node processes of the multi-node benchmarks (`bench shuffle`, `bench join`, `bench
//! aggregate`): one process per rank, spawned from this executable with a hidden
//! subcommand, each binding its own device with node id = rank; or, on the sim
//! backend, threads of this process on one sim network.
//!
//! Wiring: rank 0 binds the exchange's listener on 127.0.0.1, port 0, and prints
//! `exchange ADDR` on stdout; this process then starts ranks 1..N with `--exchange
//! ADDR`, and every node joins a `shuffle::TcpExchange`. The cluster token (shm, tcp,
//! verbs) travels in the environment (`NAMDB_SHUFFLE_TOKEN`), never on a command line.
//! Each node prints `result JSON` on stdout when done ([`print_result`]); errors go to
//! its stderr, which this process shows when a node fails.
//!
//! Progress: while a run goes on, each node process prints `progress STEP PHASE DONE
//! TOTAL` lines ([`Snapshot::report`]) on stdout from a [`Progress`] of its own
//! ([`report_progress`]), which this process reads into a [`Progress`] per node
//! ([`run_processes_with_progress`]); on sim the node threads update those directly. [`reporting`] prints a line of them on
//! stderr at an interval while the run lasts.

use crate::backend::{BackendKind, VerbsOptions, verbs_device};
use anyhow::{Context, Result, anyhow, bail, ensure};
use clap::Args;
use fabric::shm::ShmDevice;
use fabric::sim::{SimConfig, SimNetwork};
use fabric::tcp::TcpDevice;
use fabric::{Device, NodeId};
use serde::Serialize;
use serde::de::DeserializeOwned;
use shuffle::progress::{Phase, Progress, Snapshot};
use shuffle::{Exchange, LocalExchange, TcpExchange};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const TOKEN_ENV: &str = "NAMDB_SHUFFLE_TOKEN";

/// The pid of the benchmark process that started a node process.
const PARENT_ENV: &str = "NAMDB_NODE_PARENT";

/// How long the nodes may take to find each other.
pub const JOIN_TIMEOUT: Duration = Duration::from_secs(60);

/// The arguments of a hidden node subcommand (`namdb shuffle-node`, `namdb join-node`,
/// `namdb aggregate-node`).
#[derive(Args, Debug)]
pub struct NodeArgs {
    #[arg(long, value_enum)]
    pub backend: BackendKind,
    #[arg(long)]
    pub rank: usize,
    #[arg(long)]
    pub nodes: usize,
    /// Rank 0's exchange address; rank 0 itself listens and prints it.
    #[arg(long)]
    pub exchange: Option<SocketAddr>,
    /// Directory of the shm sockets.
    #[arg(long)]
    pub socket_dir: Option<PathBuf>,
    /// The run, as JSON.
    #[arg(long)]
    pub job: String,
}

/// Pins the calling thread, and so every thread it starts from now on, to node
/// `rank`'s cores: `threads_per_node` consecutive CPUs of those this process may use,
/// rank by rank, wrapping around when the nodes want more than there are. Returns the
/// CPUs. The scheduler otherwise starts two nodes' workers on one core now and then
/// and moves one only after some milliseconds, which turns runs of tens of
/// milliseconds bimodal.
pub fn pin_node(rank: usize, threads_per_node: usize) -> Result<Vec<usize>> {
    use rustix::thread::{CpuSet, sched_setaffinity};
    let cpus = allowed_cpus()?;
    ensure!(!cpus.is_empty(), "this process may run on no CPU");
    let per_node = threads_per_node.max(1);
    let mine: Vec<usize> = (0..per_node)
        .map(|t| cpus[(rank * per_node + t) % cpus.len()])
        .collect();
    let mut set = CpuSet::new();
    for &c in &mine {
        set.set(c);
    }
    sched_setaffinity(None, &set)
        .with_context(|| format!("pinning node {rank} to CPUs {mine:?}"))?;
    Ok(mine)
}

/// The CPUs the calling thread may run on, in order.
pub fn allowed_cpus() -> Result<Vec<usize>> {
    use rustix::thread::{CpuSet, sched_getaffinity};
    let allowed = sched_getaffinity(None).context("reading this thread's CPUs")?;
    Ok((0..CpuSet::MAX_CPU)
        .filter(|&c| allowed.is_set(c))
        .collect())
}

/// Ends this node process, and removes the socket directory, once the benchmark that
/// started it is gone. A benchmark stopped by a signal only it received (`kill PID`,
/// `timeout`, a CI job cancelled; a terminal's Ctrl-C reaches the nodes too) or killed
/// with SIGKILL runs no code to stop its nodes, which otherwise ran their job to the
/// end, minutes on a large one, with nobody to read the result. Nodes started by
/// hand (no parent recorded) are left alone.
pub fn exit_with_parent(args: &NodeArgs) -> Result<()> {
    let Ok(parent) = std::env::var(PARENT_ENV) else {
        return Ok(());
    };
    let parent: u32 = parent
        .parse()
        .with_context(|| format!("{PARENT_ENV} holds no pid: `{parent}`"))?;
    // Reparented (to init or a subreaper) once the parent is gone.
    let started_by_parent = move || {
        rustix::process::getppid().is_some_and(|p| p.as_raw_nonzero().get() as u32 == parent)
    };
    ensure!(
        started_by_parent(),
        "the benchmark that started this node (pid {parent}) has exited"
    );
    let dir = args.socket_dir.clone();
    std::thread::Builder::new()
        .name("exit-with-parent".into())
        .spawn(move || {
            while started_by_parent() {
                std::thread::sleep(Duration::from_millis(200));
            }
            if let Some(dir) = dir {
                let _ = std::fs::remove_dir_all(dir);
            }
            eprintln!("the benchmark that started this node (pid {parent}) has exited");
            std::process::exit(1);
        })
        .context("starting the thread that watches the benchmark process")?;
    Ok(())
}

/// A node process's exchange: rank 0 listens and prints its address, the others join.
pub fn connect(args: &NodeArgs) -> Result<Arc<dyn Exchange>> {
    Ok(if args.rank == 0 {
        let listener = TcpListener::bind("127.0.0.1:0").context("binding the exchange")?;
        let mut out = std::io::stdout().lock();
        writeln!(out, "exchange {}", listener.local_addr()?)?;
        out.flush()?;
        Arc::new(TcpExchange::accept(listener, args.nodes, JOIN_TIMEOUT)?)
    } else {
        let addr = args.exchange.context("ranks above 0 need --exchange")?;
        Arc::new(TcpExchange::join(
            args.rank,
            args.nodes,
            addr,
            JOIN_TIMEOUT,
        )?)
    })
}

/// A node process's device on its backend.
pub fn bind_device(args: &NodeArgs) -> Result<Arc<dyn Device>> {
    bind_device_instance(args, 0)
}

/// The `instance`th device of a node process that binds a fresh device per run
/// (instance 0 is [`bind_device`]'s): on shm each instance has its own socket.
pub fn bind_device_instance(args: &NodeArgs, instance: usize) -> Result<Arc<dyn Device>> {
    let token = std::env::var(TOKEN_ENV)
        .ok()
        .and_then(|t| hex::decode(t).ok())
        .with_context(|| format!("{TOKEN_ENV} holds no hex token"))?;
    let id = NodeId(args.rank as u32);
    Ok(match args.backend {
        BackendKind::Sim => bail!("the sim backend runs its nodes as threads, not processes"),
        BackendKind::Shm => {
            let dir = args.socket_dir.as_ref().context("shm needs --socket-dir")?;
            let name = match instance {
                0 => format!("node{}.sock", args.rank),
                i => format!("node{}-{i}.sock", args.rank),
            };
            ShmDevice::bind_as(dir.join(name), &token, id)?
        }
        BackendKind::Tcp => TcpDevice::bind_as("127.0.0.1:0", &token, id)?,
        BackendKind::Verbs => verbs_device(
            &VerbsOptions::default(),
            id,
            SocketAddr::from(([127, 0, 0, 1], 0)),
            &token,
        )?,
    })
}

/// Prints a node's `result JSON` line for the process that started it.
pub fn print_result(result: &impl Serialize) -> Result<()> {
    let mut out = std::io::stdout().lock();
    writeln!(out, "result {}", serde_json::to_string(result)?)?;
    out.flush()?;
    Ok(())
}

/// The most a node process waits between its progress reports.
const REPORT_EVERY: Duration = Duration::from_millis(250);

/// Prints `progress` on this node process's stdout every `progress_ms` (at most
/// [`REPORT_EVERY`]), for as long as the process runs, from a thread of its own.
pub fn report_progress(progress: Arc<Progress>, progress_ms: u64) -> Result<()> {
    let every = REPORT_EVERY.min(Duration::from_millis(progress_ms.max(1)));
    std::thread::Builder::new()
        .name("progress".into())
        .spawn(move || {
            loop {
                std::thread::sleep(every);
                let mut out = std::io::stdout().lock();
                if writeln!(out, "progress {}", progress.snapshot().report())
                    .and_then(|()| out.flush())
                    .is_err()
                {
                    // Nobody reads the lines any more.
                    return;
                }
            }
        })
        .context("starting the progress thread")?;
    Ok(())
}

/// Fresh progress for `nodes` nodes.
pub fn progress_of(nodes: usize) -> Vec<Arc<Progress>> {
    (0..nodes).map(|_| Arc::default()).collect()
}

/// Runs `body`, printing `line(time since the start)` on stderr every `every` until
/// it returns.
pub fn reporting<R>(
    every: Duration,
    line: impl Fn(Duration) -> String + Sync,
    body: impl FnOnce() -> R,
) -> R {
    let (stop, stopped) = mpsc::channel::<()>();
    std::thread::scope(|s| {
        let line = &line;
        s.spawn(move || {
            let start = Instant::now();
            while let Err(mpsc::RecvTimeoutError::Timeout) = stopped.recv_timeout(every) {
                eprintln!("{}", line(start.elapsed()));
            }
        });
        let out = body();
        drop(stop);
        out
    })
}

/// The node furthest behind ([`Snapshot::behind`]).
pub fn furthest_behind(progress: &[Arc<Progress>]) -> Snapshot {
    progress
        .iter()
        .map(|p| p.snapshot())
        .min_by(Snapshot::behind)
        .unwrap_or(Snapshot {
            step: 0,
            phase: Phase::Done,
            done: 0,
            total: 0,
        })
}

/// `done of total`, in millions when the total is a million or more.
fn count_of(done: u64, total: u64) -> String {
    if total >= 1_000_000 {
        format!("{:.1} M of {:.1} M", done as f64 / 1e6, total as f64 / 1e6)
    } else {
        format!("{done} of {total}")
    }
}

/// `probing: 1.2 M of 2.0 M tuples (60%)`, or the phase alone when it counts nothing.
pub fn phase_text(s: &Snapshot) -> String {
    if s.total == 0 {
        return s.phase.name().to_string();
    }
    format!(
        "{}: {} tuples ({:.0}%)",
        s.phase.name(),
        count_of(s.done, s.total),
        100.0 * s.done as f64 / s.total as f64
    )
}

/// The start of every progress line: the time since the run started.
pub fn progress_prefix(at: Duration) -> String {
    format!("        {:5.1} s  ", at.as_secs_f64())
}

/// Runs `node` on `nodes` threads of this process, each with its own exchange and a
/// device of one sim network, and returns their results by rank.
pub fn run_threads<R: Send>(
    nodes: usize,
    node: impl Fn(Arc<dyn Exchange>, Arc<dyn Device>) -> Result<R> + Sync,
) -> Result<Vec<R>> {
    let net = SimNetwork::new(SimConfig::default());
    let exchanges = LocalExchange::group(nodes, JOIN_TIMEOUT);
    let results: Vec<Result<R>> = std::thread::scope(|s| {
        let hs: Vec<_> = exchanges
            .into_iter()
            .map(|x| {
                let device = net.add_node() as Arc<dyn Device>;
                let node = &node;
                s.spawn(move || node(Arc::new(x), device))
            })
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow!("a node thread panicked")))
            })
            .collect()
    });
    results
        .into_iter()
        .enumerate()
        .map(|(r, res)| res.with_context(|| format!("node {r}")))
        .collect()
}

/// A started node process and what it printed.
struct NodeProc {
    rank: usize,
    child: Child,
    stderr: Arc<Mutex<String>>,
}

/// Kills the node processes still running when a run is abandoned.
struct Procs(Vec<NodeProc>);

impl Drop for Procs {
    fn drop(&mut self) {
        for p in &mut self.0 {
            if matches!(p.child.try_wait(), Ok(None)) {
                let _ = p.child.kill();
                let _ = p.child.wait();
            }
        }
    }
}

/// What every node process of a run is started with.
struct Launch<'a> {
    subcommand: &'a str,
    backend: BackendKind,
    nodes: usize,
    dir: &'a std::path::Path,
    job: &'a str,
    token: &'a str,
    lines: mpsc::Sender<(usize, String)>,
}

fn spawn(l: &Launch<'_>, rank: usize, exchange: Option<SocketAddr>) -> Result<NodeProc> {
    let Launch {
        subcommand,
        backend,
        nodes,
        dir,
        job,
        token,
        ..
    } = *l;
    let lines = l.lines.clone();
    let exe = std::env::current_exe().context("finding this executable")?;
    let mut cmd = Command::new(exe);
    cmd.arg(subcommand)
        .args(["--backend", backend.name()])
        .args(["--rank", &rank.to_string(), "--nodes", &nodes.to_string()])
        .arg("--socket-dir")
        .arg(dir)
        .args(["--job", job])
        .env(TOKEN_ENV, token)
        .env(PARENT_ENV, std::process::id().to_string())
        // The report shows a failing node's error, not a backtrace of it.
        .env("RUST_BACKTRACE", "0")
        .env("RUST_LIB_BACKTRACE", "0")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let Some(addr) = exchange {
        cmd.args(["--exchange", &addr.to_string()]);
    }
    let mut child = cmd
        .spawn()
        .with_context(|| format!("starting node process {rank}"))?;
    let stdout = child.stdout.take().expect("piped");
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if lines.send((rank, line)).is_err() {
                break;
            }
        }
    });
    let stderr = Arc::new(Mutex::new(String::new()));
    let mut pipe = child.stderr.take().expect("piped");
    let sink = stderr.clone();
    std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n) = pipe.read(&mut buf) {
            if n == 0 {
                break;
            }
            sink.lock()
                .unwrap_or_else(|e| e.into_inner())
                .push_str(&String::from_utf8_lossy(&buf[..n]));
        }
    });
    Ok(NodeProc {
        rank,
        child,
        stderr,
    })
}

/// A node's error: what it printed from `Error:` on, else its last lines of stderr.
fn tail(p: &NodeProc) -> String {
    let text = p.stderr.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    let from = lines
        .iter()
        .rposition(|l| l.starts_with("Error: "))
        .unwrap_or(lines.len().saturating_sub(6));
    lines[from..]
        .iter()
        .take(12)
        .copied()
        .collect::<Vec<_>>()
        .join("\n")
}

/// Runs `job` (JSON) on `nodes` node processes of `backend`, each started as `namdb
/// SUBCOMMAND`, and returns the result each printed, by rank. Once one node fails, the
/// others get `grace` (they may be blocked on it until their own timeouts), then are
/// killed.
/// Takes each node's progress reports ([`report_progress`]) into `progress[rank]` as
/// they arrive.
pub fn run_processes_with_progress<R: DeserializeOwned>(
    subcommand: &str,
    backend: BackendKind,
    nodes: usize,
    job: &str,
    grace: Duration,
    progress: &[Arc<Progress>],
) -> Result<Vec<R>> {
    run_processes_watched(subcommand, backend, nodes, job, grace, &mut |rank, line| {
        if let (Some(report), Some(p)) = (line.strip_prefix("progress "), progress.get(rank))
            && let Some(s) = Snapshot::parse(report)
        {
            p.set(s);
        }
    })
}

/// [`run_processes_with_progress`], handing every other line a node prints on stdout
/// (its rank and the line) to `on_line` as it arrives.
fn run_processes_watched<R: DeserializeOwned>(
    subcommand: &str,
    backend: BackendKind,
    nodes: usize,
    job: &str,
    grace: Duration,
    on_line: &mut dyn FnMut(usize, &str),
) -> Result<Vec<R>> {
    let dir = tempfile::Builder::new()
        .prefix("namdb-nodes-")
        .tempdir()
        .context("creating a directory for the node sockets")?;
    // The node processes end with their parent; their sockets must go with it too.
    let _registered = crate::interrupt::remove_on_interrupt(dir.path())?;
    let token = hex::encode(rand::random::<[u8; 32]>());
    let (tx, rx) = mpsc::channel();
    let launch = Launch {
        subcommand,
        backend,
        nodes,
        dir: dir.path(),
        job,
        token: &token,
        lines: tx,
    };
    let mut procs = Procs(Vec::with_capacity(nodes));
    procs.0.push(spawn(&launch, 0, None)?);
    let deadline = Instant::now() + JOIN_TIMEOUT;
    let addr: SocketAddr = loop {
        match rx.recv_timeout(Duration::from_millis(50)) {
            Ok((0, line)) if line.starts_with("exchange ") => {
                break line["exchange ".len()..]
                    .parse()
                    .context("node 0 printed a bad exchange address")?;
            }
            Ok(_) | Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => bail!("node 0 closed its stdout"),
        }
        if let Some(status) = procs.0[0].child.try_wait()? {
            bail!(
                "node 0 exited ({status}) before wiring: {}",
                tail(&procs.0[0])
            );
        }
        if Instant::now() > deadline {
            bail!("node 0 printed no exchange address within {JOIN_TIMEOUT:?}");
        }
    };
    for rank in 1..nodes {
        procs.0.push(spawn(&launch, rank, Some(addr))?);
    }
    drop(launch);

    let mut failed: Option<usize> = None;
    let mut failed_at: Option<Instant> = None;
    let mut done = vec![false; nodes];
    let mut results: Vec<Option<R>> = (0..nodes).map(|_| None).collect();
    while done.iter().any(|d| !d) {
        while let Ok((rank, line)) = rx.try_recv() {
            if let Some(json) = line.strip_prefix("result ") {
                results[rank] = Some(
                    serde_json::from_str(json)
                        .with_context(|| format!("node {rank} printed a bad result"))?,
                );
            } else {
                on_line(rank, &line);
            }
        }
        for p in &mut procs.0 {
            if done[p.rank] {
                continue;
            }
            if let Some(status) = p.child.try_wait()? {
                done[p.rank] = true;
                if !status.success() && failed.is_none() {
                    failed = Some(p.rank);
                    failed_at = Some(Instant::now());
                }
            }
        }
        if failed_at.is_some_and(|t| t.elapsed() > grace) {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    // The stdout readers may still hold the last lines.
    let settle = Instant::now() + Duration::from_secs(2);
    while results.iter().any(Option::is_none) && failed.is_none() && Instant::now() < settle {
        match rx.recv_timeout(Duration::from_millis(50)) {
            Ok((rank, line)) => {
                if let Some(json) = line.strip_prefix("result ") {
                    results[rank] = Some(serde_json::from_str(json)?);
                }
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
            Err(mpsc::RecvTimeoutError::Timeout) => {}
        }
    }
    if let Some(first) = failed {
        // Let the stderr readers catch up so the messages are complete.
        std::thread::sleep(Duration::from_millis(50));
        let first_tail = tail(&procs.0[first]);
        let status = procs.0[first].child.try_wait().ok().flatten();
        let others: Vec<String> = procs
            .0
            .iter()
            .filter(|p| p.rank != first)
            .map(|p| (p.rank, tail(p)))
            .filter(|(_, t)| !t.is_empty() && *t != first_tail)
            .map(|(r, t)| format!("node {r}: {t}"))
            .collect();
        let mut msg = format!(
            "node {first} exited ({}): {first_tail}",
            status.map_or_else(|| "killed".to_string(), |s| s.to_string())
        );
        if !others.is_empty() {
            msg.push_str("\nother nodes:\n");
            msg.push_str(&others.join("\n"));
        }
        bail!(msg);
    }
    results
        .into_iter()
        .enumerate()
        .map(|(r, res)| res.ok_or_else(|| anyhow!("node {r} exited without a result")))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_text_names_the_phase_and_its_count() {
        let at = |phase, done, total| Snapshot {
            step: 0,
            phase,
            done,
            total,
        };
        assert_eq!(
            phase_text(&at(Phase::Opening, 0, 0)),
            "opening the endpoints"
        );
        assert_eq!(
            phase_text(&at(Phase::Probing, 1_200_000, 2_000_000)),
            "probing: 1.2 M of 2.0 M tuples (60%)"
        );
        assert_eq!(
            phase_text(&at(Phase::Aggregating, 250, 1000)),
            "aggregating: 250 of 1000 tuples (25%)"
        );
        assert_eq!(
            phase_text(&at(Phase::Shuffling, 180_224, 2_000_000)),
            "shuffling: 0.2 M of 2.0 M tuples (9%)"
        );
    }

    fn allowed() -> Vec<usize> {
        allowed_cpus().unwrap()
    }

    #[test]
    fn nodes_are_pinned_to_their_own_cpus_rank_by_rank() {
        let cpus = allowed();
        // On threads of their own: pinning is inherited by what they start.
        let pinned = |rank: usize, threads: usize| {
            std::thread::spawn(move || {
                let mine = pin_node(rank, threads).unwrap();
                let child = std::thread::spawn(allowed).join().unwrap();
                (mine, allowed(), child)
            })
            .join()
            .unwrap()
        };
        let (mine, now, child) = pinned(0, 1);
        assert_eq!(mine, vec![cpus[0]]);
        assert_eq!(now, mine);
        assert_eq!(child, mine, "a thread started after pinning inherits it");
        let (mine, _, _) = pinned(1, 1);
        assert_eq!(mine, vec![cpus[1 % cpus.len()]]);
        // More nodes than CPUs wrap around.
        let (mine, _, _) = pinned(cpus.len(), 1);
        assert_eq!(mine, vec![cpus[0]]);
        let (mine, now, _) = pinned(0, 2);
        assert_eq!(mine, vec![cpus[0], cpus[1 % cpus.len()]]);
        let mut want = mine.clone();
        want.dedup();
        assert_eq!(now, want);
        assert_eq!(allowed(), cpus, "the test's own thread stays unpinned");
    }
}
