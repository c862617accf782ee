//! `namdb cluster`: a local cluster of memory-server and compute-node processes on
//! this host, started detached and described by a cluster file (`DIR/cluster.json`)
//! that `namdb cluster down|status` and `namdb kv` read.

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand, ValueEnum};
use memory_server::{ClusterToken, parse_bytes};
use serde::{Deserialize, Serialize};
use std::fs::{File, TryLockError};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

/// The cluster file's name in the cluster directory.
pub const CLUSTER_FILE: &str = "cluster.json";
/// The directory `cluster` commands use without `--dir`.
pub const DEFAULT_DIR: &str = "namdb-cluster";
/// The table `cluster up` creates, and `namdb kv` uses without `--table`.
pub const DEFAULT_TABLE: &str = "kv";
/// How long a process may take to say it is listening: above a compute node's slowest
/// start, with a backup memory server stopped (its ask bounded by
/// `compute_node::memory_servers::BACKUP_ANSWER_LIMIT`, 10 s, then the primary's 30 s
/// bound on the Persist that opening the database makes), after which the node exits
/// naming the backup, an error worth showing rather than "not ready".
const START_TIMEOUT: Duration = Duration::from_secs(60);
/// While a process is not ready, a line says so this often.
const START_NOTE_EVERY: Duration = Duration::from_secs(5);
/// How long `down` waits after SIGTERM before SIGKILL.
const STOP_TIMEOUT: Duration = Duration::from_secs(10);
/// How long `down` waits for a process it SIGKILLed to be gone.
const KILL_TIMEOUT: Duration = Duration::from_secs(5);
/// The most memory servers or compute nodes `up` starts: each is a process with its
/// threads and memory, and a host runs out of both long before this.
const MAX_PROCESSES: u64 = 64;

/// Set by SIGINT, SIGTERM or SIGHUP once [`catch_interrupts`] ran. The processes `up` starts
/// are detached (a terminal's Ctrl-C does not reach them), so `up` must stop them
/// itself when interrupted, before the cluster file that names them is written.
fn interrupted() -> &'static Arc<AtomicBool> {
    static FLAG: OnceLock<Arc<AtomicBool>> = OnceLock::new();
    FLAG.get_or_init(|| Arc::new(AtomicBool::new(false)))
}

/// Which of those signals came (the last one), for the exit status.
fn interrupting_signal() -> &'static Arc<AtomicUsize> {
    static SIGNAL: OnceLock<Arc<AtomicUsize>> = OnceLock::new();
    SIGNAL.get_or_init(|| Arc::new(AtomicUsize::new(0)))
}

/// Turns SIGINT, SIGTERM and SIGHUP (the terminal closed) into [`interrupted`]; a
/// second one ends the process at once, with the shell's status for it, as without
/// the handler.
pub(crate) fn catch_interrupts() -> Result<()> {
    use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
    for signal in [SIGINT, SIGTERM, SIGHUP] {
        let register = || -> std::io::Result<()> {
            signal_hook::flag::register_conditional_shutdown(
                signal,
                128 + signal,
                Arc::clone(interrupted()),
            )?;
            signal_hook::flag::register_usize(
                signal,
                Arc::clone(interrupting_signal()),
                signal as usize,
            )?;
            signal_hook::flag::register(signal, Arc::clone(interrupted()))?;
            Ok(())
        };
        register().context("cannot handle SIGINT, SIGTERM and SIGHUP")?;
    }
    Ok(())
}

/// `up` stopped by a signal, after stopping what it had started: `main` exits with
/// the shell's status for the signal (130 for Ctrl-C), as for a command without
/// a handler.
#[derive(Debug)]
pub struct Interrupted {
    pub signal: i32,
}

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.signal == signal_hook::consts::SIGPIPE {
            return f.write_str(
                "the output's reader went away (broken pipe): stopped the processes started \
                 so far",
            );
        }
        f.write_str("interrupted: stopped the processes started so far")
    }
}

impl std::error::Error for Interrupted {}

/// Stops a command that checks [`check_interrupted`] as SIGPIPE would have, had it not
/// been ignored: its output's reader went away, so nobody is left to see what it does,
/// and it ends as if interrupted (status 141), after cleaning up.
pub(crate) fn interrupt_for_broken_pipe() {
    interrupting_signal().store(signal_hook::consts::SIGPIPE as usize, Ordering::Relaxed);
    interrupted().store(true, Ordering::Relaxed);
}

/// The line of `say!`.
pub(crate) fn say_line(line: std::fmt::Arguments) {
    use std::io::Write;
    let mut stderr = std::io::stderr().lock();
    if let Err(e) = writeln!(stderr, "{line}")
        && e.kind() == std::io::ErrorKind::BrokenPipe
    {
        interrupt_for_broken_pipe();
    }
}

/// Whether an interrupt (or [`interrupt_for_broken_pipe`]) came.
pub(crate) fn is_interrupted() -> bool {
    interrupted().load(Ordering::Relaxed)
}

pub(crate) fn check_interrupted() -> Result<()> {
    if interrupted().load(Ordering::Relaxed) {
        let signal = interrupting_signal().load(Ordering::Relaxed) as i32;
        return Err(Interrupted { signal }.into());
    }
    Ok(())
}

#[derive(Subcommand, Debug)]
pub enum ClusterCommand {
    /// Start memory servers and compute nodes on this host, detached, and write the
    /// cluster file DIR/cluster.json.
    Up(UpArgs),
    /// Stop every process of the cluster file (SIGTERM, then SIGKILL after 10 s) and
    /// remove the file.
    Down(DirArg),
    /// Say which processes of the cluster file are alive.
    Status(DirArg),
    /// Start a process of the cluster file again that is not running (it died or was
    /// killed), with the command line `up` gave it, at its recorded address. A dead
    /// backup restarted this way is attached again by its primary, which copies its
    /// state there; a memory server restarted without its data refuses to start if its
    /// backup holds state (promote the backup instead).
    Restart(RestartArgs),
}

#[derive(Args, Debug)]
pub struct RestartArgs {
    /// The process, as `cluster status` names it (`memory-server-0`,
    /// `memory-server-0-backup`, `compute-node-1`, …).
    #[arg(value_name = "NAME")]
    pub name: String,
    #[command(flatten)]
    pub dir: DirArg,
}

#[derive(Args, Debug)]
pub struct DirArg {
    /// The cluster's directory: its token, logs and cluster file.
    #[arg(long, value_name = "DIR", default_value = DEFAULT_DIR)]
    pub dir: PathBuf,
}

#[derive(Args, Debug)]
pub struct UpArgs {
    /// Memory-server processes to start.
    #[arg(long, value_name = "M", default_value_t = 2,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=MAX_PROCESSES))]
    pub memory_servers: usize,
    /// Compute-node processes to start: at most 16, the oracle's slots, which their
    /// workers share evenly (one worker per core at most).
    #[arg(long, value_name = "C", default_value_t = 1,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new()
              .range(1..=txn::DEFAULT_SLOTS as u64))]
    pub compute_nodes: usize,
    /// Fabric backend of the memory servers.
    #[arg(long, value_enum)]
    pub backend: LocalBackend,
    #[command(flatten)]
    pub dir: DirArg,
    /// Bytes of data regions each memory server exports.
    #[arg(long, value_name = "BYTES", value_parser = parse_bytes, default_value = "64MiB")]
    pub size: u64,
    /// Records the `kv` table holds.
    #[arg(long, value_name = "N", default_value_t = 16384,
          value_parser = clap::value_parser!(u64).range(1..=1 << 32))]
    pub table_capacity: u64,
    /// Largest value of the `kv` table, in bytes (at most 16360: a compute node's
    /// transaction holds 4 versions of a record in a quarter of its 256 KiB buffer).
    #[arg(long, value_name = "BYTES", default_value_t = 256,
          value_parser = clap::value_parser!(u32).range(1..=16 << 20))]
    pub value_cap: u32,
    /// Make the memory servers durable: memory server i keeps its data in
    /// DATA_DIR/memory-server-i (see `namdb memory-server --data-dir`).
    #[arg(long, value_name = "DATA_DIR")]
    pub data_dir: Option<PathBuf>,
    /// Copies of each memory server: 2 starts a backup per memory server
    /// (`memory-server-i-backup`, `--backup`; with --data-dir in
    /// DATA_DIR/memory-server-i-backup) and the primary with `--backup-at` it, and gives
    /// compute nodes `PRIMARY|BACKUP` addresses, so a compute node that cannot reach a
    /// primary promotes its backup. With --data-dir, a backup's directory promoted in
    /// an earlier run is swapped with its primary's first (the promoted data serves as
    /// the primary, the old primary's directory becomes the backup).
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..=2))]
    pub replicas: u8,
}

/// The backends a cluster of processes on one host can use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LocalBackend {
    Shm,
    Tcp,
}

impl LocalBackend {
    pub fn name(self) -> &'static str {
        match self {
            LocalBackend::Shm => "shm",
            LocalBackend::Tcp => "tcp",
        }
    }
}

/// One process of the cluster.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessEntry {
    /// `memory-server-0`, `compute-node-1`, …
    pub name: String,
    pub pid: u32,
    /// The gRPC address.
    pub address: String,
    /// Where its stdout and stderr go.
    pub log: PathBuf,
    /// The Prometheus endpoint (`http://ADDR/metrics`), if it serves one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metrics: Option<String>,
    /// Its namdb arguments (`memory-server --listen …`), for `cluster restart`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub args: Vec<String>,
}

/// `DIR/cluster.json`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterFile {
    pub token_file: PathBuf,
    pub backend: LocalBackend,
    pub memory_servers: Vec<ProcessEntry>,
    pub compute_nodes: Vec<ProcessEntry>,
    /// With `up --replicas 2`: memory server i's backup, at position i.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub memory_server_backups: Vec<ProcessEntry>,
}

impl ClusterFile {
    /// The cluster file at `path`, or in it when `path` is the cluster's directory (what
    /// `cluster up --dir` names, and where a user looks for the cluster).
    pub fn read(path: &Path) -> Result<ClusterFile> {
        let inside;
        let path = if path.is_dir() {
            inside = path.join(CLUSTER_FILE);
            &inside
        } else {
            path
        };
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read the cluster file {}", path.display()))?;
        serde_json::from_str(&text)
            .with_context(|| format!("{} is not a namdb cluster file", path.display()))
    }

    /// Written to a temporary file and renamed over `path`: a crash or a full disk
    /// never leaves a cut-short cluster file naming half the processes.
    fn write(&self, path: &Path) -> Result<()> {
        let text = serde_json::to_string_pretty(self)?;
        let tmp = path.with_extension("json.tmp");
        std::fs::write(&tmp, text + "\n")
            .and_then(|()| std::fs::rename(&tmp, path))
            .with_context(|| format!("cannot write the cluster file {}", path.display()))
    }

    /// Every process, compute nodes first, primaries before their backups (the order to
    /// stop them in).
    fn processes(&self) -> impl Iterator<Item = &ProcessEntry> {
        self.compute_nodes
            .iter()
            .chain(&self.memory_servers)
            .chain(&self.memory_server_backups)
    }

    /// The cluster's token, from the file the cluster file names. A missing one is not
    /// told to `namdb token generate` it, as a server's would be: every process of the
    /// cluster holds the old token, which a new one would not match.
    pub fn token(&self) -> Result<ClusterToken> {
        if !self.token_file.exists() {
            bail!(
                "the cluster's token file {} does not exist (moved or removed?): the \
                 cluster's processes hold that token, so a new one would not match them; \
                 put the file back, or start a new cluster",
                self.token_file.display()
            );
        }
        Ok(ClusterToken::from_file(&self.token_file)?)
    }
}

pub fn run(cmd: ClusterCommand) -> Result<()> {
    match cmd {
        ClusterCommand::Up(args) => up(&args),
        ClusterCommand::Down(d) => down(&d.dir),
        ClusterCommand::Restart(r) => restart(&r.dir.dir, &r.name),
        ClusterCommand::Status(d) => {
            if !status(&d.dir)? {
                // As `kv`'s failure: a script can tell a degraded cluster.
                std::process::exit(1);
            }
            Ok(())
        }
    }
}

/// Whether process `pid` runs: some thread of it has not exited. A process is gone
/// only once it is a zombie waiting to be reaped (or reaped): its first thread can be a
/// zombie while the others are still being torn down, and a parent waiting for it then
/// still finds nothing to reap.
pub fn alive(pid: u32) -> bool {
    alive_under(Path::new("/proc"), pid)
}

/// [`alive`], reading the process table mounted at `proc_root`.
fn alive_under(proc_root: &Path, pid: u32) -> bool {
    let state = |stat: &Path| {
        std::fs::read_to_string(stat).ok().and_then(|stat| {
            // The state follows the command name, which is in parentheses.
            let (_, rest) = stat.rsplit_once(')')?;
            rest.split_whitespace().next().map(str::to_string)
        })
    };
    let process = proc_root.join(pid.to_string());
    let Some(leader) = state(&process.join("stat")) else {
        return false;
    };
    if leader != "Z" && leader != "X" {
        return true;
    }
    // Threads other than the first leave the list as they finish exiting.
    std::fs::read_dir(process.join("task")).is_ok_and(|threads| {
        threads.filter_map(|t| t.ok()).any(|t| {
            t.file_name() != pid.to_string().as_str() && state(&t.path().join("stat")).is_some()
        })
    })
}

/// Whether `pid` is still the process the cluster started: alive, and its command
/// line names the cluster's token file (so a reused pid is never signalled).
fn ours(pid: u32, token_file: &Path) -> bool {
    alive(pid) && cluster_member(pid, token_file).is_some()
}

/// A namdb memory server or compute node of the cluster whose token file is
/// `token_file` (its command line names that file, relative to its working directory or
/// not): its command (`memory-server` or `compute-node`) and `--listen` address (empty
/// if it has none).
fn cluster_member(pid: u32, token_file: &Path) -> Option<(String, String)> {
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let args: Vec<&[u8]> = cmdline.split(|&b| b == 0).collect();
    let is_server = |a: &[u8]| a == b"memory-server" || a == b"compute-node";
    if !args.get(1).is_some_and(|a| is_server(a)) {
        return None;
    }
    let value_of = |flag: &str| -> Option<String> {
        let flag = flag.as_bytes();
        args.iter().enumerate().find_map(|(i, a)| {
            if *a == flag {
                args.get(i + 1)
                    .map(|v| String::from_utf8_lossy(v).into_owned())
            } else {
                a.strip_prefix(flag)
                    .and_then(|rest| rest.strip_prefix(b"="))
                    .map(|v| String::from_utf8_lossy(v).into_owned())
            }
        })
    };
    let named = PathBuf::from(value_of("--token-file")?);
    let resolved = if named.is_absolute() {
        named
    } else {
        std::fs::read_link(format!("/proc/{pid}/cwd"))
            .ok()?
            .join(named)
    };
    let same = |a: &Path, b: &Path| match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => a == b,
    };
    same(&resolved, token_file).then(|| {
        (
            String::from_utf8_lossy(args[1]).into_owned(),
            value_of("--listen").unwrap_or_default(),
        )
    })
}

/// This cluster's memory servers and compute nodes running under pids the cluster file
/// does not record (started again by hand after one of its processes died), each as
/// the recorded entry of the same `--listen` address with its pid, or, if none
/// matches, under a name of its own.
fn started_by_hand(file: &ClusterFile) -> Vec<ProcessEntry> {
    let recorded: Vec<u32> = file.processes().map(|p| p.pid).collect();
    cluster_members(&file.token_file)
        .into_iter()
        .filter(|(pid, _, _)| !recorded.contains(pid))
        .map(
            |(pid, command, listen)| match file.processes().find(|p| p.address == listen) {
                Some(entry) => ProcessEntry {
                    pid,
                    ..entry.clone()
                },
                None => ProcessEntry {
                    name: format!("a {command} of this cluster (--listen {listen})"),
                    pid,
                    address: listen,
                    log: PathBuf::from(format!("/proc/{pid}/fd/2")),
                    metrics: None,
                    args: Vec::new(),
                },
            },
        )
        .collect()
}

/// Every running memory server and compute node naming `token_file` (see
/// [`cluster_member`]), by pid: (pid, command, `--listen` address).
fn cluster_members(token_file: &Path) -> Vec<(u32, String, String)> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut found: Vec<(u32, String, String)> = entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| pid != std::process::id() && alive(pid))
        .filter_map(|pid| {
            let (command, listen) = cluster_member(pid, token_file)?;
            Some((pid, command, listen))
        })
        .collect();
    found.sort_by_key(|&(pid, _, _)| pid);
    found
}

/// Says which processes `down` had to SIGKILL.
fn report_killed(killed: &[String]) {
    for name in killed {
        println!(
            "{name} did not stop within {} s of SIGTERM; killed it (SIGKILL)",
            STOP_TIMEOUT.as_secs()
        );
    }
}

fn signal(pid: u32, signal: rustix::process::Signal) {
    if let Some(pid) = rustix::process::Pid::from_raw(pid as i32) {
        let _ = rustix::process::kill_process(pid, signal);
    }
}

/// Stops what `up` started if it fails half-way.
struct StartedGuard {
    started: Vec<ProcessEntry>,
    token_file: PathBuf,
    armed: bool,
}

impl StartedGuard {
    /// Starts process `i` of `namdb COMMAND` (`memory-server` or `compute-node`) with
    /// the arguments every process takes and `extra`, and waits until it is ready.
    fn start(&mut self, dir: &Path, command: &str, i: usize, extra: &[&str]) -> Result<()> {
        self.start_named(dir, command, &format!("{command}-{i}"), extra)
    }

    /// As [`StartedGuard::start`], for a process named `name`.
    fn start_named(&mut self, dir: &Path, command: &str, name: &str, extra: &[&str]) -> Result<()> {
        let token = self.token_file.display().to_string();
        let mut argv = vec![command, "--listen", "127.0.0.1:0", "--token-file", &token];
        argv.extend_from_slice(&["--metrics-listen", "127.0.0.1:0"]);
        argv.extend_from_slice(extra);
        let argv: Vec<String> = argv.into_iter().map(String::from).collect();
        let what = command.replace('-', " ");
        let entry = spawn(name, &what, &argv, &dir.join(format!("{name}.log")))?;
        self.started.push(entry);
        Ok(())
    }
}

impl Drop for StartedGuard {
    fn drop(&mut self) {
        if self.armed {
            stop_all(self.started.iter().rev(), &self.token_file);
        }
    }
}

/// Spawns `namdb ARGS` detached (its own process group, so a terminal's Ctrl-C does not
/// reach it) with stdout and stderr to `log`, and waits for its line `WHAT listening on
/// ADDR …`; a metrics line `metrics listening on ADDR` before it is recorded too.
pub(crate) fn spawn(name: &str, what: &str, args: &[String], log: &Path) -> Result<ProcessEntry> {
    let out = std::fs::File::create(log)
        .with_context(|| format!("cannot create the log file {}", log.display()))?;
    let err = out.try_clone()?;
    let exe = std::env::current_exe().context("cannot find the namdb executable")?;
    let mut child = Command::new(exe)
        .args(args)
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .process_group(0)
        .spawn()
        .with_context(|| format!("cannot start {name}"))?;
    let pid = child.id();
    let mut entry = ProcessEntry {
        name: name.to_string(),
        pid,
        address: String::new(),
        log: log.to_path_buf(),
        metrics: None,
        args: args.to_vec(),
    };
    let started = Instant::now();
    let deadline = started + START_TIMEOUT;
    let mut next_note = started + START_NOTE_EVERY;
    let prefix = format!("{what} listening on ");
    loop {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        for line in text.lines() {
            if let Some(addr) = line
                .strip_prefix("metrics listening on ")
                .and_then(|rest| rest.split_whitespace().next())
            {
                entry.metrics = Some(addr.to_string());
            }
            if let Some(addr) = line
                .strip_prefix(&prefix)
                .and_then(|rest| rest.split_whitespace().next())
            {
                entry.address = addr.to_string();
                // Never waited for here: whoever inherits it once this command exits
                // reaps it.
                drop(child);
                return Ok(entry);
            }
        }
        if interrupted().load(Ordering::Relaxed) {
            let _ = child.kill();
            let _ = child.wait();
            check_interrupted()?;
        }
        if let Some(exit) = child.try_wait()? {
            bail!(
                "{name} exited ({exit}) before it was ready; its log {} says:\n{}",
                log.display(),
                tail(&text)
            );
        }
        if Instant::now() >= next_note {
            let waited = next_note - started;
            next_note += START_NOTE_EVERY;
            let last = match text.lines().last() {
                Some(line) => format!("its log's last line: {line}"),
                None => "its log is empty so far".to_string(),
            };
            say!(
                "{name} is not ready after {} s (given up at {} s); {last}",
                waited.as_secs(),
                START_TIMEOUT.as_secs(),
            );
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            bail!(
                "{name} was not ready after {} s; its log {} says:\n{}",
                START_TIMEOUT.as_secs(),
                log.display(),
                tail(&text)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Refuses, before anything starts, a `--value-cap` the compute nodes' transactions
/// cannot hold (they run with txn's default buffer).
pub(crate) fn check_value_cap(value_cap: u32) -> Result<()> {
    let versions = txn::TableSpec::new(DEFAULT_TABLE, value_cap, 1).versions;
    let options = txn::Options::default();
    let largest = options.largest_value_cap(versions);
    if value_cap > largest {
        bail!(
            "--value-cap {value_cap} is too large: a compute node's transaction holds values \
             of up to {largest} bytes (the {versions} versions of a record must fit a quarter \
             of its {} KiB buffer)",
            options.scratch_bytes >> 10
        );
    }
    Ok(())
}

/// The last lines of a log, for an error message.
pub(crate) fn tail(text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    // A process that failed ends with its error report, which under RUST_BACKTRACE
    // (inherited from the user's shell) anyhow follows with a backtrace dozens of lines
    // long: the report is what to show, and the lines just before it.
    if let Some(error) = lines.iter().rposition(|l| l.starts_with("Error: ")) {
        let end = lines[error..]
            .iter()
            .position(|l| l.starts_with("Stack backtrace:"))
            .map_or(lines.len(), |n| error + n);
        let start = error.saturating_sub(5);
        let shown = &lines[start..end.min(error + 20)];
        return shown.join("\n").trim_end().to_string();
    }
    lines[lines.len().saturating_sub(10)..].join("\n")
}

fn up(args: &UpArgs) -> Result<()> {
    if args.memory_servers == 0 || args.compute_nodes == 0 {
        bail!("a cluster needs at least one memory server and one compute node");
    }
    check_value_cap(args.value_cap)?;
    // What each memory server would refuse at its start, refused before any starts
    // (they run with the default --region-size).
    memory_server::RegionPlan::new(args.size, memory_server::DEFAULT_REGION_SIZE)
        .context("no memory server can serve that --size")?;
    if args.dir.dir.exists() && !args.dir.dir.is_dir() {
        bail!("{} is not a directory", args.dir.dir.display());
    }
    std::fs::create_dir_all(&args.dir.dir)
        .with_context(|| format!("cannot create {}", args.dir.dir.display()))?;
    // Absolute, so that the cluster file means the same from any directory.
    let dir = std::fs::canonicalize(&args.dir.dir)?;
    // Held until `up` returns: two `up`s in one directory would share its logs, and
    // the second would read the first one's processes as its own.
    let lock_path = dir.join("up.lock");
    let lock = File::create(&lock_path)
        .with_context(|| format!("cannot create {}", lock_path.display()))?;
    match lock.try_lock() {
        Ok(()) => {}
        Err(TryLockError::WouldBlock) => bail!(
            "another `namdb cluster up` is starting a cluster in {}",
            args.dir.dir.display()
        ),
        Err(TryLockError::Error(e)) => {
            return Err(e).with_context(|| format!("cannot lock {}", lock_path.display()));
        }
    }
    catch_interrupts()?;
    let cluster_file = dir.join(CLUSTER_FILE);
    if cluster_file.exists() {
        bail!(
            "a cluster is already described by {}; `namdb cluster down --dir {}` first",
            cluster_file.display(),
            args.dir.dir.display()
        );
    }
    let token_file = dir.join("token");
    if !token_file.exists() {
        memory_server::generate_token_file(&token_file)?;
    }
    let token = ClusterToken::from_file(&token_file)?;
    // Before anything starts on the data directories: a backup promoted in the last
    // run holds memory server i's newest data and must come back as its primary.
    if let Some(data_dir) = &args.data_dir {
        for i in 0..args.memory_servers {
            if let Some(line) = settle_failover(data_dir, i)? {
                println!("{line}");
            }
        }
    }
    let mut guard = StartedGuard {
        started: Vec::new(),
        token_file: token_file.clone(),
        armed: true,
    };
    let mut backups = Vec::new();
    for i in 0..args.memory_servers {
        let size = args.size.to_string();
        let base = vec!["--backend", args.backend.name(), "--size", &size];
        // Absolute, so that the cluster's processes agree whatever their directory.
        let data_dir = |suffix: &str| -> Result<Option<String>> {
            Ok(args
                .data_dir
                .as_ref()
                .map(|d| {
                    let mut dir = memory_server_data_dir(d, i).into_os_string();
                    dir.push(suffix);
                    std::path::absolute(PathBuf::from(dir))
                })
                .transpose()?
                .map(|d| d.display().to_string()))
        };
        check_interrupted()?;
        // The backup first: the primary attaches to it when it starts.
        let backup_addr = if args.replicas >= 2 {
            let mut extra = base.clone();
            // Once promoted and given a backup, it rejoins when fenced in turn.
            extra.extend(["--backup", "--rejoin-when-fenced"]);
            let d = data_dir("-backup")?;
            if let Some(d) = &d {
                extra.extend(["--data-dir", d]);
            }
            guard.start_named(
                &dir,
                "memory-server",
                &format!("memory-server-{i}-backup"),
                &extra,
            )?;
            // Left among the started, so that a failure later stops it too.
            let entry = guard.started.last().expect("just started").clone();
            let addr = entry.address.clone();
            backups.push(entry);
            Some(addr)
        } else {
            None
        };
        let mut extra = base.clone();
        let d = data_dir("")?;
        if let Some(d) = &d {
            extra.extend(["--data-dir", d]);
        }
        if let Some(b) = &backup_addr {
            // A primary fenced while it lived (stopped, hung, cut off) comes back as the
            // backup of the server promoted in its place by itself.
            extra.extend(["--backup-at", b, "--rejoin-when-fenced"]);
        }
        guard.start(&dir, "memory-server", i, &extra)?;
    }
    let addrs: Vec<String> = guard
        .started
        .iter()
        .filter(|e| !e.name.ends_with("-backup"))
        .enumerate()
        .map(|(i, e)| match backups.get(i) {
            Some(b) => format!("{}|{}", e.address, b.address),
            None => e.address.clone(),
        })
        .collect();
    // Each worker holds an oracle slot: the nodes share them evenly, so the last one
    // started finds its share free.
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let workers = (txn::DEFAULT_SLOTS as usize / args.compute_nodes).clamp(1, cores);
    // One at a time: the first opens the database on the memory servers.
    for i in 0..args.compute_nodes {
        check_interrupted()?;
        guard.start(
            &dir,
            "compute-node",
            i,
            &[
                "--memory-servers",
                &addrs.join(","),
                "--workers",
                &workers.to_string(),
            ],
        )?;
    }
    let (memory, compute): (Vec<_>, Vec<_>) = guard
        .started
        .iter()
        .filter(|e| !e.name.ends_with("-backup"))
        .cloned()
        .partition(|e| e.name.starts_with("memory-server"));
    let file = ClusterFile {
        token_file: token_file.clone(),
        backend: args.backend,
        memory_servers: memory,
        compute_nodes: compute,
        memory_server_backups: backups,
    };
    let runtime = crate::kv_cmd::runtime()?;
    let kept = runtime.block_on(async {
        let client = compute_node::client::Client::connect(&file.compute_nodes[0].address, &token)
            .await
            .with_context(|| format!("cannot reach {}", file.compute_nodes[0].name))?;
        match client
            .create_table(DEFAULT_TABLE, args.value_cap, args.table_capacity)
            .await
        {
            Ok(_) => Ok(None),
            // Durable memory servers brought back up: the table and its data are kept.
            Err(s) if s.code() == tonic::Code::AlreadyExists => {
                let tables = client.list_tables().await.map_err(|s| {
                    anyhow::anyhow!("cannot list the tables: {}", memory_server::status_text(&s))
                })?;
                Ok(tables
                    .iter()
                    .find(|t| t.name == DEFAULT_TABLE)
                    .map(|t| kept_table_note(t.value_cap, t.capacity, args)))
            }
            Err(s) => {
                let hint = if s.message().contains("no room") {
                    ": give the memory servers more --size, or the table a smaller \
                     --table-capacity or --value-cap"
                } else {
                    ""
                };
                bail!(
                    "cannot create the table {DEFAULT_TABLE}: {}{hint}",
                    memory_server::status_text(&s)
                )
            }
        }
    })?;
    check_interrupted()?;
    file.write(&cluster_file)?;
    guard.armed = false;
    for p in file
        .memory_servers
        .iter()
        .chain(&file.memory_server_backups)
        .chain(&file.compute_nodes)
    {
        println!("{} pid {} listening on {}", p.name, p.pid, p.address);
    }
    if let Some(note) = kept {
        println!("{note}");
    }
    println!(
        "cluster up ({} backend, table {DEFAULT_TABLE}); cluster file {}",
        args.backend.name(),
        cluster_file.display()
    );
    Ok(())
}

/// Memory server `i`'s data directory under a cluster's `--data-dir`.
pub(crate) fn memory_server_data_dir(data_dir: &Path, i: usize) -> PathBuf {
    data_dir.join(format!("memory-server-{i}"))
}

/// `dir` with `suffix` appended to its last component.
fn suffixed(dir: &Path, suffix: &str) -> PathBuf {
    let mut s = dir.as_os_str().to_os_string();
    s.push(suffix);
    PathBuf::from(s)
}

/// After a failover, memory server `i`'s newest data is in its backup's directory
/// (DATA_DIR/memory-server-i-backup, which records the promotion), and its primary's
/// directory holds older data: started as they are, the old primary's state transfer
/// would overwrite the newer data (and the promoted directory refuses to be a
/// backup). This swaps the two directories' names, so that the promoted one is
/// memory server i's primary again and the old primary's becomes its backup, which the
/// primary's attach then overwrites whole (it is not clean: every piece is sent, zeros
/// included). Returns the line to print when it did something.
///
/// The swap is three renames (`memory-server-i` to `memory-server-i.swapping`, the
/// backup's to `memory-server-i`, the `.swapping` one to the backup's), each made
/// durable (fsync of DATA_DIR) before the next. Which directory is the primary's never
/// depends on where the swap stopped: it is the one that records the promotion, which
/// moves with it, and each name holds at most one directory at any moment. An
/// interrupted swap is finished here on the next `up` (before anything else), from
/// whichever of the two intermediate states it is in; a state the swap cannot have
/// left (a directory under all three names, or under neither primary nor backup name)
/// is refused rather than guessed at. Both directories are locked (the memory server's
/// own data-directory lock) while they are renamed, so no server uses them meanwhile.
fn settle_failover(data_dir: &Path, i: usize) -> Result<Option<String>> {
    let primary = memory_server_data_dir(data_dir, i);
    let backup = suffixed(&primary, "-backup");
    let transit = suffixed(&primary, ".swapping");
    let parent = primary.parent().unwrap_or(Path::new("."));
    let rename = |from: &Path, to: &Path| -> Result<()> {
        std::fs::rename(from, to)
            .with_context(|| format!("cannot rename {} to {}", from.display(), to.display()))?;
        File::open(parent)
            .and_then(|d| d.sync_all())
            .with_context(|| format!("cannot sync the directory {}", parent.display()))
    };
    let lock = |dir: &Path| -> Result<Option<File>> {
        if !dir.is_dir() {
            return Ok(None);
        }
        memory_server::lock_data_dir(dir)
            .map(Some)
            .map_err(|e| anyhow::anyhow!("{e}"))
    };
    let promotion = |dir: &Path| -> Result<Option<memory_server::Promotion>> {
        if !dir.is_dir() {
            return Ok(None);
        }
        memory_server::recorded_promotion(dir).map_err(|e| anyhow::anyhow!("{e}"))
    };
    let mut done = None;
    if transit.exists() {
        let _locks = [lock(&transit)?, lock(&primary)?, lock(&backup)?];
        match (primary.exists(), backup.exists()) {
            // Stopped after the first rename.
            (false, true) => {
                rename(&backup, &primary)?;
                rename(&transit, &backup)?;
            }
            // Stopped after the second.
            (true, false) => rename(&transit, &backup)?,
            _ => bail!(
                "{} is left from an interrupted swap of {} and {} (after a failover), but \
                 {}: this is no state the swap leaves, so it cannot be finished safely. The \
                 directory that records a promotion (its `meta` has a `promoted` line) holds \
                 the newest data: name it {}, name the old primary's {}, and run `cluster \
                 up` again",
                transit.display(),
                primary.display(),
                backup.display(),
                if primary.exists() {
                    "both of those exist too"
                } else {
                    "neither of those exists"
                },
                primary.display(),
                backup.display()
            ),
        }
        done = Some(format!(
            "memory-server-{i}: finished an interrupted swap: {} is the primary's data \
             directory (promoted after a failover), {} the backup's",
            primary.display(),
            backup.display()
        ));
    }
    let promoted = match (promotion(&primary)?, promotion(&backup)?) {
        (_, None) => return Ok(done),
        (None, Some(p)) => p,
        (Some(p), Some(b)) => bail!(
            "both {} (promoted on {}, replication epoch {}) and {} (promoted on {}, epoch {}) \
             record a promotion, so neither may start as the backup: the one of the higher \
             epoch holds the newer data (its primary stopped before recording that its \
             backup held its state). Move the other directory out of {} (a fresh backup \
             directory is created and receives a full copy) and name the newer one {}",
            primary.display(),
            p.at_utc(),
            p.epoch,
            backup.display(),
            b.at_utc(),
            b.epoch,
            data_dir.display(),
            primary.display()
        ),
    };
    let _locks = [lock(&primary)?, lock(&backup)?];
    let old_primary = primary.exists();
    if old_primary {
        rename(&primary, &transit)?;
    }
    rename(&backup, &primary)?;
    if old_primary {
        rename(&transit, &backup)?;
    }
    Ok(Some(format!(
        "memory-server-{i}: {} was promoted to primary on {} (its primary failed); swapped \
         it with {}: it is memory-server-{i}'s data directory now{}",
        backup.display(),
        promoted.at_utc(),
        primary.display(),
        if old_primary {
            ", and the old primary's becomes the backup's (a backup started on it receives \
             a full copy)"
        } else {
            ""
        }
    )))
}

/// SIGTERM to each of `entries` still ours, then waits; SIGKILL to those left after
/// [`STOP_TIMEOUT`]. Returns the names of the processes killed.
pub(crate) fn stop_all<'a>(
    entries: impl Iterator<Item = &'a ProcessEntry>,
    token_file: &Path,
) -> Vec<String> {
    let running: Vec<&ProcessEntry> = entries.filter(|p| ours(p.pid, token_file)).collect();
    for p in &running {
        signal(p.pid, rustix::process::Signal::TERM);
    }
    let deadline = Instant::now() + STOP_TIMEOUT;
    while running.iter().any(|p| alive(p.pid)) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut killed = Vec::new();
    for p in running.iter().filter(|p| alive(p.pid)) {
        signal(p.pid, rustix::process::Signal::KILL);
        killed.push(p.name.clone());
    }
    // What returns has stopped: a caller may start others on the same ports and files.
    let deadline = Instant::now() + KILL_TIMEOUT;
    while running.iter().any(|p| alive(p.pid)) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    killed
}

/// The cluster file in `dir` and its path, or `None` after saying `none` there is.
fn existing(dir: &Path, none: &str) -> Result<Option<(PathBuf, ClusterFile)>> {
    let path = dir.join(CLUSTER_FILE);
    if !path.exists() {
        println!("{none}: {} does not exist", path.display());
        return Ok(None);
    }
    let file = ClusterFile::read(&path)?;
    Ok(Some((path, file)))
}

/// Stops what a cluster file that cannot be read would have named: the memory servers
/// and compute nodes whose command line names `DIR/token`, the token file `up` makes
/// there. The unreadable file is kept beside, renamed, for whoever wants to look.
fn down_unreadable(dir: &Path, path: &Path, why: &anyhow::Error) -> Result<()> {
    let token_file = dir.join("token");
    let found: Vec<ProcessEntry> = cluster_members(&token_file)
        .into_iter()
        .map(|(pid, command, listen)| ProcessEntry {
            name: format!("{command} at {listen}"),
            pid,
            address: listen,
            log: PathBuf::new(),
            metrics: None,
            args: Vec::new(),
        })
        .collect();
    let kept = path.with_extension("json.unreadable");
    std::fs::rename(path, &kept)
        .with_context(|| format!("cannot move the cluster file {} aside", path.display()))?;
    println!(
        "the cluster file cannot be read ({why:#}); it is kept as {}",
        kept.display()
    );
    report_killed(&stop_all(found.iter(), &token_file));
    sweep_leftovers();
    println!(
        "cluster down ({} process{} naming {} stopped)",
        found.len(),
        if found.len() == 1 { "" } else { "es" },
        token_file.display()
    );
    Ok(())
}

/// Removes the sockets that processes of a cluster killed by hand (SIGKILL, which
/// runs no cleanup) left in the temporary directory: a memory server's and a compute
/// node's are named by pid, and are otherwise swept only when another one starts.
pub(crate) fn sweep_leftovers() {
    let tmp = std::env::temp_dir();
    for prefix in [crate::memory_server_cmd::SOCKET_PREFIX, "namdb-compute-"] {
        fabric::shm::sweep_leftovers(&tmp, prefix);
    }
}

fn down(dir: &Path) -> Result<()> {
    let path = dir.join(CLUSTER_FILE);
    if !path.exists() {
        println!("no cluster to stop: {} does not exist", path.display());
        return Ok(());
    }
    let file = match ClusterFile::read(&path) {
        Ok(file) => file,
        Err(why) => return down_unreadable(dir, &path, &why),
    };
    let running = file
        .processes()
        .filter(|p| ours(p.pid, &file.token_file))
        .count();
    let by_hand = started_by_hand(&file);
    for p in &by_hand {
        println!(
            "{} runs as pid {}, started by hand; stopping it too",
            p.name, p.pid
        );
    }
    report_killed(&stop_all(
        file.processes().chain(&by_hand),
        &file.token_file,
    ));
    sweep_leftovers();
    std::fs::remove_file(&path)
        .with_context(|| format!("cannot remove the cluster file {}", path.display()))?;
    let gone = file.processes().count() - running;
    let plural = |n: usize| if n == 1 { "" } else { "es" };
    if gone == 0 {
        println!(
            "cluster down ({running} process{} stopped)",
            plural(running)
        );
    } else {
        println!(
            "cluster down ({running} process{} stopped, {gone} had exited already)",
            plural(running),
        );
    }
    Ok(())
}

/// Whether process `pid` is stopped (SIGSTOP, or a debugger): alive, answering nothing.
fn stopped(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        stat.rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state == "T" || state == "t")
    })
}

/// ` --dir DIR` for a command about the cluster in `dir`, unless that is the default.
fn dir_flag(dir: &Path) -> String {
    if dir == Path::new(DEFAULT_DIR) {
        String::new()
    } else {
        format!(" --dir {}", dir.display())
    }
}

/// `args` with the value of `--listen` replaced by `address`.
fn listening_at(args: &[String], address: &str) -> Vec<String> {
    let mut out = args.to_vec();
    if let Some(i) = out.iter().position(|a| a == "--listen")
        && let Some(value) = out.get_mut(i + 1)
    {
        *value = address.to_string();
    }
    out
}

/// What `up` says of a `kv` table its durable memory servers brought back: kept as it
/// was made, which `--value-cap` and `--table-capacity` do not change (they were taken
/// without a word, and the table then refused the larger values asked for).
fn kept_table_note(value_cap: u32, capacity: u64, args: &UpArgs) -> String {
    let mut ignored = Vec::new();
    if value_cap != args.value_cap {
        ignored.push(format!("--value-cap {}", args.value_cap));
    }
    if capacity != args.table_capacity {
        ignored.push(format!("--table-capacity {}", args.table_capacity));
    }
    let mut note = format!(
        "table {DEFAULT_TABLE} exists already (values up to {value_cap} bytes, made for \
         {capacity} records); kept with its data"
    );
    if !ignored.is_empty() {
        note.push_str(&format!(
            ": {} {} to a new table only (a table keeps what it was made with; `namdb kv \
             create-table` makes another)",
            ignored.join(" and "),
            if ignored.len() == 1 {
                "applies"
            } else {
                "apply"
            }
        ));
    }
    note
}

/// Starts the process `name` of the cluster file in `dir` again, at its address, and
/// records its new pid. Its previous log is kept beside the new one.
fn restart(dir: &Path, name: &str) -> Result<()> {
    let path = dir.join(CLUSTER_FILE);
    if !path.exists() {
        bail!(
            "no cluster: {} does not exist (start one with `namdb cluster up`)",
            path.display()
        );
    }
    let mut file = ClusterFile::read(&path)?;
    let by_hand = started_by_hand(&file);
    let token_file = file.token_file.clone();
    let names: Vec<String> = file.processes().map(|p| p.name.clone()).collect();
    let primary = file.memory_servers.iter().any(|p| p.name == name);
    // A backup's primary, whose state it waits for once started.
    let backup_of = file
        .memory_server_backups
        .iter()
        .position(|p| p.name == name)
        .and_then(|i| file.memory_servers.get(i))
        .map(|p| (p.name.clone(), p.pid));

    // The other of its pair, if that was promoted: this one comes back as its backup.
    let partner = if ours(pid_of(&file, name), &token_file) {
        None
    } else {
        promoted_partner(&file, name).cloned()
    };
    let Some(entry) = file
        .memory_servers
        .iter_mut()
        .chain(&mut file.memory_server_backups)
        .chain(&mut file.compute_nodes)
        .find(|p| p.name == name)
    else {
        bail!(
            "the cluster in {} has no process named `{}`; its processes are {}",
            dir.display(),
            txn::echo(name),
            names.join(", ")
        );
    };
    if ours(entry.pid, &token_file) {
        bail!(
            "{name} is running (pid {}); stop it first to start it again",
            entry.pid
        );
    }
    if let Some(h) = by_hand.iter().find(|h| h.name == name) {
        bail!(
            "{name} is running as pid {}, started by hand; stop it first to start it again",
            h.pid
        );
    }
    let Some(command) = entry.args.first().cloned() else {
        bail!(
            "the cluster file {} does not record {name}'s command line (an older namdb \
             wrote it): start the cluster again (`namdb cluster down`, then `up`)",
            path.display()
        );
    };
    let mut args = listening_at(&entry.args, &entry.address);
    if let Some(promoted) = &partner {
        args = crate::memory_server_cmd::as_backup_of(&args, &promoted.address);
        println!(
            "{} was promoted in {name}'s place: starting {name} as its backup",
            promoted.name
        );
    }
    let kept = |flag: &str| entry.args.iter().any(|a| a == flag);
    if primary && !kept("--data-dir") && !kept("--backup-at") {
        // Its memory was the only copy: starting it again cannot bring that back, and a
        // user who expects it to should hear so before, not from the next `kv`.
        say!(
            "warning: {name} keeps no data directory and has no backup, so what it held was \
             lost with its process: it starts empty, and the compute nodes refuse it (\"it \
             holds no cluster\"). To start over, run `namdb cluster down`, then `namdb \
             cluster up` (with --data-dir DIR or --replicas 2, to survive this next time)."
        );
    }
    if entry.log.exists() {
        let previous = entry.log.with_extension("previous.log");
        std::fs::rename(&entry.log, &previous)
            .with_context(|| format!("cannot keep {}'s previous log aside", entry.log.display()))?;
        println!("{name}'s previous log is kept as {}", previous.display());
    }
    let started = spawn(name, &command.replace('-', " "), &args, &entry.log)?;
    let (pid, address) = (started.pid, started.address.clone());
    // The recorded arguments keep `--listen` as up gave it, so that the next restart
    // replaces it the same way.
    *entry = ProcessEntry {
        args: entry.args.clone(),
        ..started
    };
    file.write(&path)?;
    println!("{name} started again as pid {pid}, listening on {address}");
    if let Some(promoted) = partner {
        wait_for_backup_sync(name, &address, &promoted.name, promoted.pid, &token_file)?;
    } else if let Some((primary, primary_pid)) = backup_of {
        wait_for_backup_sync(name, &address, &primary, primary_pid, &token_file)?;
    }
    Ok(())
}

/// The other memory server of `name`'s pair (`memory-server-i` and
/// `memory-server-i-backup`), when it runs and was promoted: it serves in `name`'s
/// place, and `name` comes back as its backup.
fn promoted_partner<'f>(file: &'f ClusterFile, name: &str) -> Option<&'f ProcessEntry> {
    let partner = match name.strip_suffix("-backup") {
        Some(primary) => file.memory_servers.iter().find(|p| p.name == primary)?,
        None => {
            let backup_name = format!("{name}-backup");
            file.memory_server_backups
                .iter()
                .find(|b| b.name == backup_name)?
        }
    };
    // A stopped partner would hold the connection without answering.
    if !ours(partner.pid, &file.token_file) || stopped(partner.pid) {
        return None;
    }
    let token = ClusterToken::from_file(&file.token_file).ok()?;
    let client = memory_server::blocking::Client::connect_within(
        &partner.address,
        &token,
        Duration::from_secs(3),
    )
    .ok()?;
    (client.server().role == memory_server::Role::Promoted).then_some(partner)
}

/// How long `restart` of a backup waits for its primary to copy its state there: the
/// primary attaches within a second, then copies what it holds, seconds per GiB.
const BACKUP_SYNC_TIMEOUT: Duration = Duration::from_secs(120);

/// Waits until backup `name` at `address` holds its primary's whole state again (it
/// can be promoted, and writes it no longer stops), saying every 5 s that it waits;
/// returns at once if the primary does not run. Not synced in time is a warning, not
/// an error: the backup runs, and the primary goes on trying.
fn wait_for_backup_sync(
    name: &str,
    address: &str,
    primary: &str,
    primary_pid: u32,
    token_file: &Path,
) -> Result<()> {
    let token = ClusterToken::from_file(token_file)?;
    let started = Instant::now();
    let mut next_note = started + START_NOTE_EVERY;
    loop {
        if !ours(primary_pid, token_file) {
            println!(
                "{primary} is not running: {name} gets its state once {primary} is started \
                 again (`namdb cluster restart {primary}`)"
            );
            return Ok(());
        }
        let synced = memory_server::blocking::Client::connect_within(
            address,
            &token,
            Duration::from_secs(5),
        )
        .is_ok_and(|c| c.server().synced);
        if synced {
            println!(
                "{name} holds {primary}'s whole state again after {:.1} s: writes go on, \
                 and it can take over if {primary} fails",
                started.elapsed().as_secs_f64()
            );
            return Ok(());
        }
        check_interrupted()?;
        if started.elapsed() > BACKUP_SYNC_TIMEOUT {
            say!(
                "warning: {name} does not hold {primary}'s state yet after {} s; {primary} \
                 goes on attaching to it (its log says how far it got). Until then writes \
                 on {primary} fail and {name} cannot take over.",
                BACKUP_SYNC_TIMEOUT.as_secs()
            );
            return Ok(());
        }
        if Instant::now() >= next_note {
            next_note += START_NOTE_EVERY;
            say!(
                "waiting for {primary} to copy its state to {name} ({} s so far)",
                started.elapsed().as_secs()
            );
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The recorded pid of the process `name` (0, which no process has, if none).
fn pid_of(file: &ClusterFile, name: &str) -> u32 {
    file.processes()
        .find(|p| p.name == name)
        .map_or(0, |p| p.pid)
}

/// What `status` says of the primary memory server `name`, not running, whose backup
/// was promoted and serves in its place.
fn promoted_in_place_of(file: &ClusterFile, name: &str) -> Option<String> {
    file.memory_servers.iter().find(|p| p.name == name)?;
    let backup = promoted_partner(file, name)?;
    Some(format!(
        "its backup {} was promoted and serves in its place (`namdb cluster restart {name}` \
         starts it again as that server's backup)",
        backup.name
    ))
}

/// Prints each process's state; false if one of them does not run (or is stopped),
/// or there is no cluster: a script's `status && …` must not go on with nothing up.
fn status(dir: &Path) -> Result<bool> {
    let Some((_, file)) = existing(dir, "no cluster")? else {
        return Ok(false);
    };
    let by_hand = started_by_hand(&file);
    // Primaries whose backup serves in their place, and why they stay down.
    let replaced: Vec<(String, String)> = file
        .memory_servers
        .iter()
        .filter(|p| !ours(p.pid, &file.token_file))
        .filter(|p| !by_hand.iter().any(|h| h.name == p.name))
        .filter_map(|p| promoted_in_place_of(&file, &p.name).map(|why| (p.name.clone(), why)))
        .collect();
    let (mut not_running, mut paused, mut total) = (0, 0, 0);
    for p in file
        .memory_servers
        .iter()
        .chain(&file.memory_server_backups)
        .chain(&file.compute_nodes)
    {
        total += 1;
        let running = if ours(p.pid, &file.token_file) {
            Some((p.pid, String::new()))
        } else {
            by_hand
                .iter()
                .find(|h| h.name == p.name)
                .map(|h| (h.pid, format!(" as pid {}, started by hand", h.pid)))
        };
        let state = match running {
            Some((pid, _)) if stopped(pid) => {
                paused += 1;
                format!("stopped (SIGSTOP: it answers nothing; `kill -CONT {pid}` resumes it)")
            }
            Some((_, how)) => match replaced
                .iter()
                .find(|(primary, _)| p.name == format!("{primary}-backup"))
            {
                Some((primary, _)) => format!("alive{how}, promoted: serves in {primary}'s place"),
                None => format!("alive{how}{}", replication_note(&file, p)),
            },
            None => {
                not_running += 1;
                match replaced.iter().find(|(primary, _)| *primary == p.name) {
                    Some((_, why)) => format!("not running: {why}"),
                    None => format!(
                        "not running (`namdb cluster restart {}{}` starts it again)",
                        p.name,
                        dir_flag(dir)
                    ),
                }
            }
        };
        let metrics = p
            .metrics
            .as_ref()
            .map(|m| format!(", metrics http://{m}/metrics"))
            .unwrap_or_default();
        println!(
            "{} pid {} {} {state} (log {}{metrics})",
            p.name,
            p.pid,
            p.address,
            p.log.display()
        );
    }
    for h in by_hand
        .iter()
        .filter(|h| !file.processes().any(|p| p.name == h.name))
    {
        println!("{} pid {} alive, started by hand", h.name, h.pid);
    }
    let summary = status_summary(not_running, paused, total);
    if !summary.is_empty() {
        println!("{summary}");
    }
    Ok(not_running + paused == 0)
}

/// What a running memory server of a replicated cluster is in its pair, as its Hello
/// says (bounded: a server that does not answer gets no note): after a failover and a
/// rejoin the pair is the other way round, which its names no longer tell.
fn replication_note(file: &ClusterFile, p: &ProcessEntry) -> String {
    let is_server = file
        .memory_servers
        .iter()
        .chain(&file.memory_server_backups)
        .any(|m| m.name == p.name);
    if file.memory_server_backups.is_empty() || !is_server {
        return String::new();
    }
    let Ok(token) = ClusterToken::from_file(&file.token_file) else {
        return String::new();
    };
    let Ok(client) =
        memory_server::blocking::Client::connect_within(&p.address, &token, Duration::from_secs(2))
    else {
        return String::new();
    };
    let server = client.server();
    // A server whose backup says it was promoted in its place is fenced, which its
    // own Hello does not tell.
    let partner = match (server.role, &server.backup_at) {
        (memory_server::Role::Primary | memory_server::Role::Promoted, Some(backup)) => {
            memory_server::blocking::Client::connect_within(backup, &token, Duration::from_secs(2))
                .ok()
                .map(|c| {
                    (
                        backup.clone(),
                        c.server().role,
                        c.server().backup_at.clone(),
                    )
                })
        }
        _ => None,
    };
    pair_note(server, partner)
}

/// [`replication_note`]'s words for a server's Hello (`server`) and, for one that
/// replicates, its backup's role and backup as the backup (at the address given)
/// answered. A backup that says it was promoted and has no backup was promoted over
/// the server (the rule `memory-server --rejoin-when-fenced` follows); one promoted
/// with a backup is the stale side of a later failover, or has another backup.
fn pair_note(
    server: &memory_server::ServerInfo,
    partner: Option<(String, memory_server::Role, Option<String>)>,
) -> String {
    use memory_server::Role;
    if let Some((at, Role::Promoted, None)) = partner
        && matches!(server.role, Role::Primary | Role::Promoted)
    {
        return format!(
            ", fenced: its backup at {at} was promoted in its place, and it acknowledges no \
             write (started with --rejoin-when-fenced it becomes that server's backup within \
             seconds)"
        );
    }
    match (server.role, &server.backup_at, server.synced) {
        (Role::Primary, _, _) => ", primary".into(),
        (Role::Promoted, Some(_), _) => ", promoted: serves as the primary, with a backup".into(),
        (Role::Promoted, None, _) => ", promoted: serves as the primary, without a backup".into(),
        (Role::Backup, _, true) => ", backup (holds its primary's state)".into(),
        (Role::Backup, _, false) => ", backup (does not hold its primary's state yet)".into(),
        (Role::Standalone, _, _) => String::new(),
    }
}

/// The last line of `status`: how many processes do not run and how many are stopped,
/// each counted as what it is; empty when all run.
fn status_summary(not_running: usize, paused: usize, total: usize) -> String {
    let is_are = |n: usize| if n == 1 { "is" } else { "are" };
    let mut parts = Vec::new();
    if not_running > 0 {
        parts.push(format!("{not_running} {} not running", is_are(not_running)));
    }
    if paused > 0 {
        parts.push(format!("{paused} {} stopped", is_are(paused)));
    }
    if parts.is_empty() {
        return String::new();
    }
    format!("of {total} processes, {}", parts.join(" and "))
}

#[cfg(test)]
mod tests {
    /// A primary or promoted server is called fenced when the backup it replicates to
    /// says it was promoted and has no backup; a backup that is not promoted, or
    /// promoted with a backup (this server: the backup is the stale side; another: not
    /// this pair's business), or one that did not answer leaves it as it says.
    #[test]
    fn a_primary_is_called_fenced_once_its_backup_says_it_was_promoted() {
        use memory_server::Role;
        let hello = |role, backup_at: Option<&str>| memory_server::ServerInfo {
            node: fabric::NodeId(1),
            backend: "tcp".into(),
            version: String::new(),
            protocol: String::new(),
            durable: true,
            boot: 1,
            role,
            synced: true,
            primary_silence: None,
            backup_at: backup_at.map(String::from),
        };
        let primary = hello(Role::Primary, Some("b:2"));
        let asked =
            |role, backup: Option<&str>| Some(("b:2".to_string(), role, backup.map(String::from)));
        let promoted = hello(Role::Promoted, Some("b:2"));
        for server in [&primary, &promoted] {
            let note = super::pair_note(server, asked(Role::Promoted, None));
            assert!(
                note.starts_with(", fenced: its backup at b:2 was promoted"),
                "{note}"
            );
        }
        for partner in [
            None,
            asked(Role::Backup, None),
            asked(Role::Promoted, Some("p:1")),
            asked(Role::Promoted, Some("elsewhere:3")),
        ] {
            assert_eq!(super::pair_note(&primary, partner.clone()), ", primary");
            assert_eq!(
                super::pair_note(&promoted, partner),
                ", promoted: serves as the primary, with a backup"
            );
        }
        assert_eq!(
            super::pair_note(&hello(Role::Promoted, None), None),
            ", promoted: serves as the primary, without a backup"
        );
    }

    /// An error report followed by anyhow's backtrace (RUST_BACKTRACE=1 inherited):
    /// the report is shown with the lines before it, the backtrace is not.
    #[test]
    fn a_logs_tail_is_its_error_report_without_the_backtrace() {
        let mut log: Vec<String> = (0..10).map(|i| format!("line {i}")).collect();
        log.push("Error: cannot open the database".into());
        log.push(String::new());
        log.push("Caused by:".into());
        log.push("    backup at 127.0.0.1:1 failed".into());
        log.push(String::new());
        log.push("Stack backtrace:".into());
        log.extend((0..40).map(|i| format!("  {i}: frame")));
        let shown = tail(&log.join("\n"));
        assert!(shown.starts_with("line 5\n"), "{shown}");
        assert!(
            shown.ends_with("Caused by:\n    backup at 127.0.0.1:1 failed"),
            "{shown}"
        );
        assert!(!shown.contains("frame"), "{shown}");
        // Without a report, the last ten lines.
        let plain: Vec<String> = (0..30).map(|i| format!("line {i}")).collect();
        assert_eq!(tail(&plain.join("\n")).lines().next(), Some("line 20"));
    }

    use super::*;

    #[test]
    fn the_status_summary_counts_stopped_processes_as_stopped() {
        assert_eq!(status_summary(0, 0, 3), "");
        assert_eq!(status_summary(1, 0, 3), "of 3 processes, 1 is not running");
        assert_eq!(status_summary(0, 1, 3), "of 3 processes, 1 is stopped");
        assert_eq!(
            status_summary(2, 1, 5),
            "of 5 processes, 2 are not running and 1 is stopped"
        );
    }

    /// A fake process table: process `pid` whose threads are in `states` (the first
    /// thread's first).
    fn proc_table(pid: u32, states: &[&str]) -> tempfile::TempDir {
        let root = tempfile::tempdir().unwrap();
        let process = root.path().join(pid.to_string());
        for (i, state) in states.iter().enumerate() {
            let stat = format!("{} (namdb (x)) {state} 1 2 3\n", pid + i as u32);
            if i == 0 {
                std::fs::create_dir_all(&process).unwrap();
                std::fs::write(process.join("stat"), &stat).unwrap();
            }
            let thread = process.join("task").join((pid + i as u32).to_string());
            std::fs::create_dir_all(&thread).unwrap();
            std::fs::write(thread.join("stat"), &stat).unwrap();
        }
        root
    }

    #[test]
    fn a_process_whose_first_thread_is_a_zombie_is_alive_while_another_thread_runs() {
        let alive = |states: &[&str]| alive_under(proc_table(40, states).path(), 40);
        assert!(alive(&["S"]));
        assert!(alive(&["R", "S"]));
        assert!(alive(&["Z", "R"]), "a thread is still exiting");
        assert!(alive(&["Z", "D", "X"]));
        assert!(!alive(&["Z"]), "waits to be reaped");
        assert!(!alive(&["X"]));
        assert!(!alive_under(proc_table(40, &["S"]).path(), 41));
    }

    #[test]
    fn this_process_is_alive_and_a_free_pid_is_not() {
        assert!(alive(std::process::id()));
        assert!(!alive(u32::MAX));
        assert!(!ours(std::process::id(), Path::new("/no/such/token")));
    }

    #[test]
    fn cluster_files_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let entry = ProcessEntry {
            name: "memory-server-0".into(),
            pid: 7,
            address: "127.0.0.1:1".into(),
            log: dir.path().join("m.log"),
            metrics: Some("127.0.0.1:2".into()),
            args: vec![
                "memory-server".into(),
                "--listen".into(),
                "127.0.0.1:0".into(),
            ],
        };
        let file = ClusterFile {
            token_file: dir.path().join("token"),
            backend: LocalBackend::Shm,
            memory_servers: vec![entry.clone()],
            compute_nodes: vec![ProcessEntry {
                name: "compute-node-0".into(),
                metrics: None,
                ..entry.clone()
            }],
            memory_server_backups: Vec::new(),
        };
        let path = dir.path().join(CLUSTER_FILE);
        file.write(&path).unwrap();
        assert_eq!(ClusterFile::read(&path).unwrap(), file);
        assert!(std::fs::read_to_string(&path).unwrap().contains("\"shm\""));
    }

    #[test]
    fn a_restart_listens_at_the_recorded_address() {
        let args: Vec<String> = ["memory-server", "--listen", "127.0.0.1:0", "--backup"]
            .map(String::from)
            .into();
        assert_eq!(
            listening_at(&args, "127.0.0.1:7700"),
            ["memory-server", "--listen", "127.0.0.1:7700", "--backup"]
        );
    }

    /// A data directory holding only a metadata file (promoted or not) and a file
    /// that says whose it is.
    fn data_dir(dir: &Path, whose: &str, promoted: bool) {
        std::fs::create_dir_all(dir).unwrap();
        let promotion = if promoted {
            "epoch 1\npromoted 1700000000\n"
        } else {
            ""
        };
        std::fs::write(
            dir.join("meta"),
            format!(
                "namdb memory-server data directory\nformat 1\nboot 2\napplied_journal 0\n\
                 applied_seq 0\n{promotion}region catalog 1048576\n"
            ),
        )
        .unwrap();
        std::fs::write(dir.join("whose"), whose).unwrap();
    }

    fn whose(dir: &Path) -> String {
        std::fs::read_to_string(dir.join("whose")).unwrap_or_else(|_| "absent".into())
    }

    #[test]
    fn a_promoted_backup_directory_becomes_the_primarys_even_after_an_interrupted_swap() {
        let d = tempfile::tempdir().unwrap();
        let (p, b, t) = (
            d.path().join("memory-server-0"),
            d.path().join("memory-server-0-backup"),
            d.path().join("memory-server-0.swapping"),
        );
        let state = || (whose(&p), whose(&b), t.exists());
        let swapped = || ("promoted".to_string(), "old".to_string(), false);

        // Nothing promoted: nothing moves, nothing is said.
        data_dir(&p, "old", false);
        data_dir(&b, "promoted", false);
        assert_eq!(settle_failover(d.path(), 0).unwrap(), None);
        assert_eq!(state(), ("old".into(), "promoted".into(), false));

        // The backup was promoted: the names swap, once.
        data_dir(&b, "promoted", true);
        let line = settle_failover(d.path(), 0).unwrap().unwrap();
        assert!(
            line.contains("was promoted to primary on 2023-11-14 22:13:20 UTC")
                && line.contains("receives a full copy"),
            "{line}"
        );
        assert_eq!(state(), swapped());
        assert_eq!(settle_failover(d.path(), 0).unwrap(), None);
        assert_eq!(state(), swapped());

        // Interrupted after the second rename (the old primary's directory in
        // transit, the promoted one at the primary's name), then after the first (the
        // promoted one still at the backup's name).
        std::fs::rename(&b, &t).unwrap();
        let line = settle_failover(d.path(), 0).unwrap().unwrap();
        assert!(line.contains("finished an interrupted swap"), "{line}");
        assert_eq!(state(), swapped());
        std::fs::rename(&b, &t).unwrap();
        std::fs::rename(&p, &b).unwrap();
        let line = settle_failover(d.path(), 0).unwrap().unwrap();
        assert!(line.contains("finished an interrupted swap"), "{line}");
        assert_eq!(state(), swapped());

        // A state no swap leaves is refused, not guessed at.
        data_dir(&t, "stray", false);
        let err = settle_failover(d.path(), 0).unwrap_err().to_string();
        assert!(err.contains("both of those exist too"), "{err}");
        std::fs::remove_dir_all(&t).unwrap();

        // Both promoted: refused, naming both.
        data_dir(&b, "old", true);
        let err = settle_failover(d.path(), 0).unwrap_err().to_string();
        assert!(err.contains("record a promotion"), "{err}");
        std::fs::remove_dir_all(&b).unwrap();

        // No old primary's directory: the promoted one just takes the primary's name.
        std::fs::rename(&p, &b).unwrap();
        let line = settle_failover(d.path(), 0).unwrap().unwrap();
        assert!(!line.contains("full copy"), "{line}");
        assert_eq!((whose(&p), b.exists()), ("promoted".into(), false));

        // A server running on a directory stops the swap.
        std::fs::rename(&p, &b).unwrap();
        data_dir(&p, "old", false);
        let held = memory_server::lock_data_dir(&p).unwrap();
        let err = settle_failover(d.path(), 0).unwrap_err().to_string();
        assert!(err.contains("in use by another memory server"), "{err}");
        drop(held);
        settle_failover(d.path(), 0).unwrap().unwrap();
        assert_eq!(state(), swapped());
    }
}
