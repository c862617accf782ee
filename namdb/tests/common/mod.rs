//! What namdb's integration tests share: memory-server and compute-node processes,
//! and the conformance suite's devices with the server in that process.
// Each test crate compiles this module and uses a part of it.
#![allow(dead_code)]

pub mod bank;

use fabric::Device;
use memory_server::{ClusterToken, RemoteDevice};
use std::ffi::OsString;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

/// A `namdb memory-server` or `namdb compute-node` process, killed when dropped so that
/// a failing test leaves none behind.
pub struct ServerProcess {
    pub child: Child,
    /// The address it serves gRPC on, from its listening line.
    pub control: String,
    /// The listening line.
    pub line: String,
    // Kept open: the server's stdout is not for us to close under it.
    _stdout: BufReader<ChildStdout>,
    stderr: Arc<Mutex<String>>,
    stderr_reader: Option<JoinHandle<()>>,
}

impl ServerProcess {
    /// SIGKILL, and reap: the process gets no chance to clean up.
    pub fn kill_9(&mut self) {
        let status = Command::new("kill")
            .args(["-KILL", &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
        self.child.wait().unwrap();
    }

    /// Starts `namdb memory-server --listen 127.0.0.1:0 --backend BACKEND --token-file
    /// TOKEN_FILE` with `extra` arguments and waits until it is listening.
    pub fn start(backend: &str, token_file: &Path, extra: &[&str]) -> ServerProcess {
        let mut args: Vec<OsString> = [
            "memory-server",
            "--listen",
            "127.0.0.1:0",
            "--backend",
            backend,
            "--token-file",
        ]
        .map(OsString::from)
        .into();
        args.push(token_file.into());
        args.extend(extra.iter().map(OsString::from));
        ServerProcess::spawn(&args, "memory server")
    }

    /// Like [`ServerProcess::start`], listening on `listen` (e.g. to restart a server
    /// on the address its clients know).
    pub fn start_at(
        listen: &str,
        backend: &str,
        token_file: &Path,
        extra: &[&str],
    ) -> ServerProcess {
        let mut args: Vec<OsString> = [
            "memory-server",
            "--listen",
            listen,
            "--backend",
            backend,
            "--token-file",
        ]
        .map(OsString::from)
        .into();
        args.push(token_file.into());
        args.extend(extra.iter().map(OsString::from));
        ServerProcess::spawn(&args, "memory server")
    }

    /// Starts `namdb compute-node --listen 127.0.0.1:0 --memory-servers ADDRS
    /// --token-file TOKEN_FILE` with `extra` arguments and waits until it is listening.
    pub fn compute_node(
        memory_servers: &[String],
        token_file: &Path,
        extra: &[&str],
    ) -> ServerProcess {
        let mut args: Vec<OsString> = [
            "compute-node",
            "--listen",
            "127.0.0.1:0",
            "--memory-servers",
        ]
        .map(OsString::from)
        .into();
        args.push(memory_servers.join(",").into());
        args.push("--token-file".into());
        args.push(token_file.into());
        args.extend(extra.iter().map(OsString::from));
        ServerProcess::spawn(&args, "compute node")
    }

    /// Runs `namdb ARGS` and waits for its line `WHAT listening on ADDR …`.
    fn spawn(args: &[OsString], what: &str) -> ServerProcess {
        let mut child = Command::new(env!("CARGO_BIN_EXE_namdb"))
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("namdb starts");
        // Drained as it comes, so the server never blocks on a full pipe.
        let stderr = Arc::new(Mutex::new(String::new()));
        let mut pipe = child.stderr.take().expect("stderr is piped");
        let sink = stderr.clone();
        let stderr_reader = std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n @ 1..) = pipe.read(&mut buf) {
                sink.lock()
                    .unwrap()
                    .push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        });
        let mut stdout = BufReader::new(child.stdout.take().expect("stdout is piped"));
        let mut line = String::new();
        stdout.read_line(&mut line).expect("the server's stdout");
        let mut server = ServerProcess {
            child,
            control: String::new(),
            line,
            _stdout: stdout,
            stderr,
            stderr_reader: Some(stderr_reader),
        };
        let prefix = format!("{what} listening on ");
        match server
            .line
            .strip_prefix(&prefix)
            .and_then(|rest| rest.split_whitespace().next())
        {
            Some(addr) => server.control = addr.to_string(),
            None => {
                let status = server.child.wait();
                let said = server.stderr();
                panic!(
                    "the {what} did not start ({status:?}); it said {:?} and {said}",
                    server.line
                );
            }
        }
        server
    }

    /// What the server wrote to stderr so far; everything, once it has exited.
    pub fn stderr(&mut self) -> String {
        if let Ok(Some(_)) = self.child.try_wait()
            && let Some(reader) = self.stderr_reader.take()
        {
            let _ = reader.join();
        }
        self.stderr.lock().unwrap().clone()
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The token every test server and device of [`process_devices`] shares.
const CONFORMANCE_TOKEN: &str = "namdb conformance token, for tests only";

/// `nodes` devices for the conformance suite: the first is a fresh memory-server
/// process on `backend` with remote verbs allowed, driven through a
/// [`RemoteDevice`] (the process ends when that device and everything made from it
/// are gone); the others are devices of this process made by `local`.
pub fn process_devices(
    backend: &str,
    nodes: usize,
    local: impl Fn(&ClusterToken) -> Arc<dyn Device>,
) -> Vec<Arc<dyn Device>> {
    assert!(nodes >= 1, "the first device is the server");
    let token = ClusterToken::new(CONFORMANCE_TOKEN).expect("a valid token");
    let dir = tempfile::tempdir().expect("a temporary directory");
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, CONFORMANCE_TOKEN).expect("the token file");
    let server = ServerProcess::start(
        backend,
        &token_file,
        &["--size", "4MiB", "--allow-remote-verbs"],
    );
    let client = memory_server::blocking::Client::connect(&server.control, &token)
        .expect("a session with the memory server");
    let remote = RemoteDevice::with_attachment(client, Box::new(server))
        .expect("the memory server's device");
    let mut devices: Vec<Arc<dyn Device>> = vec![remote];
    devices.extend((1..nodes).map(|_| local(&token)));
    devices
}

/// What a compute-node incarnation fenced at a `backend` memory-server process still
/// reaches: nothing. Two sessions of one incarnation each connect a queue pair from a
/// device of this process (`local`) and WRITE; another incarnation fences the first;
/// then the fenced queue pairs' WRITE and CAS complete with an error and leave the
/// memory as it was, the incarnation is refused a new session, and the fencer's own
/// queue pair still works. This is the memory side of the recovery of another
/// process's commits: on verbs it is the NIC that stops the destroyed queue pairs.
pub fn fence_cuts_off_an_incarnation(
    backend: &str,
    local: impl Fn(&ClusterToken) -> Arc<dyn Device>,
) {
    use fabric::{Access, Completion, CompletionQueue, QueuePair, SendWr, Src, WcStatus};
    use memory_server::blocking::Client;
    use std::time::{Duration, Instant};

    fn run(qp: &dyn QueuePair, cq: &dyn CompletionQueue, wr: SendWr<'_>) -> Completion {
        qp.post_send(&[wr]).expect("posted");
        let mut out = [Completion::default(); 1];
        // Generous: a verbs requester retries a vanished responder for about 0.5 s,
        // and the Soft-RoCE guest runs under emulation.
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if cq.poll(&mut out).expect("poll") == 1 {
                return out[0];
            }
            assert!(Instant::now() < deadline, "no completion within 60 s");
            std::thread::sleep(Duration::from_micros(50));
        }
    }
    const PAUSED: u64 = 0x5eed;
    const FENCER: u64 = 0xbeef;
    let limit = Some(Duration::from_secs(30));

    let token = ClusterToken::new(CONFORMANCE_TOKEN).expect("a valid token");
    let dir = tempfile::tempdir().expect("a temporary directory");
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, CONFORMANCE_TOKEN).expect("the token file");
    let server = start_server(backend, &token_file);
    let device = local(&token);
    let cq = device.create_cq(64).expect("a completion queue");
    let buffer = device.register(8, Access::LOCAL).expect("a local buffer");

    let paused = Client::connect_as(&server.control, &token, PAUSED, limit).expect("a session");
    let paused_too =
        Client::connect_as(&server.control, &token, PAUSED, limit).expect("a second session");
    let target = paused
        .list_regions()
        .expect("the region directory")
        .get("data.0")
        .expect("a data region")
        .remote
        .at(0);
    let (qp, _) = paused.connect_qp(&*device, &cq).expect("a queue pair");
    let (qp_too, _) = paused_too.connect_qp(&*device, &cq).expect("a queue pair");
    let fencer = Client::connect_as(&server.control, &token, FENCER, limit).expect("a session");
    let (their_qp, _) = fencer.connect_qp(&*device, &cq).expect("a queue pair");
    let before = run(
        &*qp,
        &*cq,
        SendWr::write(1, Src::Inline(&1u64.to_le_bytes()), target),
    );
    assert_eq!(before.status, WcStatus::Success, "{before:?}");

    let report = fencer
        .fence(PAUSED, Duration::from_secs(30))
        .expect("the fence");
    assert_eq!(
        (report.sessions_ended, report.queue_pairs_destroyed),
        (2, 2),
        "{report:?}"
    );
    let late_write = run(
        &*qp,
        &*cq,
        SendWr::write(2, Src::Inline(&9u64.to_le_bytes()), target),
    );
    assert_ne!(late_write.status, WcStatus::Success, "{late_write:?}");
    let late_cas = run(
        &*qp_too,
        &*cq,
        SendWr::cas(3, buffer.buf(0, 8), target, 1, 7),
    );
    assert_ne!(late_cas.status, WcStatus::Success, "{late_cas:?}");
    let read = run(&*their_qp, &*cq, SendWr::read(4, buffer.buf(0, 8), target));
    assert_eq!(read.status, WcStatus::Success, "{read:?}");
    assert_eq!(
        buffer.load_u64(0).expect("the word read"),
        1,
        "a fenced incarnation's late request reached the memory"
    );
    match Client::connect_as(&server.control, &token, PAUSED, limit) {
        Ok(_) => panic!("a fenced incarnation got a session"),
        Err(e) => assert_eq!(e.code(), Some(tonic::Code::PermissionDenied), "{e}"),
    }
    Client::connect_as(&server.control, &token, PAUSED + 1, limit)
        .expect("another incarnation still gets a session");
}

/// A `backend` memory server with 4 MiB of data regions, checked to serve its data
/// path on that backend.
pub fn start_server(backend: &str, token_file: &Path) -> ServerProcess {
    let server = ServerProcess::start(backend, token_file, &["--size", "4MiB"]);
    assert!(
        server.line.contains(&format!("data path {backend}:")),
        "{}",
        server.line
    );
    server
}

// ----- `namdb cluster up` clusters, as a user runs them

/// Runs `namdb ARGS` in `cwd`.
pub fn namdb(cwd: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_namdb"))
        .current_dir(cwd)
        .args(args)
        .output()
        .expect("namdb runs")
}

/// Runs `namdb ARGS` in the test's directory, without backtraces (the benchmarks'
/// tests look for clear error messages).
pub fn namdb_here(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_namdb"))
        .args(args)
        .env("RUST_BACKTRACE", "0")
        .output()
        .expect("the namdb binary runs")
}

/// Standard output, then standard error.
pub fn text(o: &Output) -> String {
    format!("{}{}", stdout(o), stderr(o))
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// The progress lines (`   4.0 s  …`, trimmed) a benchmark printed on `stderr` after
/// the first line `header` accepts and before the first line after it `result` accepts.
/// Panics without such a header and result.
pub fn progress_between(
    stderr: &str,
    header: impl Fn(&str) -> bool,
    result: impl Fn(&str) -> bool,
) -> Vec<&str> {
    let lines: Vec<&str> = stderr.lines().collect();
    let start = lines.iter().position(|l| header(l));
    let end = start.and_then(|h| lines[h..].iter().position(|l| result(l)).map(|r| h + r));
    let (Some(start), Some(end)) = (start, end) else {
        panic!("no header or result line: {stderr}");
    };
    lines[start + 1..end]
        .iter()
        .map(|l| l.trim())
        .filter(|l| {
            l.split_once(" s  ")
                .is_some_and(|(t, _)| t.parse::<f64>().is_ok())
        })
        .collect()
}

/// Runs `namdb ARGS` and expects success.
pub fn ok(cwd: &Path, args: &[&str]) -> String {
    let o = namdb(cwd, args);
    assert!(
        o.status.success(),
        "namdb {args:?} failed ({}): {}{}",
        o.status,
        stdout(&o),
        stderr(&o)
    );
    stdout(&o)
}

/// A cluster in a temporary directory, brought down when dropped, so that a failing
/// test leaves no process behind.
pub struct Cluster {
    dir: tempfile::TempDir,
}

impl Cluster {
    pub fn up(args: &[&str]) -> Cluster {
        let dir = tempfile::tempdir().unwrap();
        let cluster = Cluster { dir };
        let mut argv = vec!["cluster", "up"];
        argv.extend_from_slice(args);
        ok(cluster.cwd(), &argv);
        cluster
    }

    pub fn cwd(&self) -> &Path {
        self.dir.path()
    }

    pub fn file(&self) -> PathBuf {
        self.cwd().join("namdb-cluster/cluster.json")
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(self.file()).unwrap()).unwrap()
    }

    pub fn pids(&self) -> Vec<u32> {
        let json = self.json();
        ["memory_servers", "compute_nodes"]
            .iter()
            .flat_map(|k| json[k].as_array().unwrap().clone())
            .map(|p| p["pid"].as_u64().unwrap() as u32)
            .collect()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = namdb(self.cwd(), &["cluster", "down"]);
    }
}

/// Whether `pid` runs (a zombie does not count).
pub fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        let state = stat.rsplit_once(')').map(|(_, rest)| rest.trim_start());
        !matches!(state.and_then(|s| s.chars().next()), Some('Z' | 'X') | None)
    })
}

/// The parent of `pid`, from `/proc/PID/stat` ("pid (comm) state ppid …").
pub fn parent_of(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = stat.rsplit_once(')')?;
    rest.split_whitespace().nth(1)?.parse().ok()
}

/// Pids of the running processes whose command line names `arg`.
pub fn processes_naming(arg: impl AsRef<std::ffi::OsStr>) -> Vec<u32> {
    let arg = arg.as_ref().as_encoded_bytes();
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|cmd| cmd.split(|&b| b == 0).any(|a| a == arg))
                && alive(pid)
        })
        .collect()
}

/// Sends `signal` (`"-INT"`, `"-9"`, …) to `pid` with kill(1).
pub fn send_signal(pid: u32, signal: &str) {
    let status = std::process::Command::new("kill")
        .args([signal, &pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success(), "kill {signal} {pid}: {status}");
}

/// SIGSTOPs `pid` and waits until /proc says it is stopped (`T`): the signal is
/// delivered after kill(1) returns, and what the test does next must meet a process
/// that answers nothing.
/// A process stopped with SIGSTOP, continued (SIGCONT) when dropped, so that a failing
/// test leaves no stopped process behind.
pub struct Stopped(u32);

impl Stopped {
    pub fn stop(pid: u32) -> Stopped {
        stop_and_wait(pid);
        Stopped(pid)
    }
}

impl Drop for Stopped {
    fn drop(&mut self) {
        // Not `send_signal`: the process may be gone by now, and a panic in a drop
        // that runs while a failing test unwinds would abort the run.
        let _ = Command::new("kill")
            .args(["-CONT", &self.0.to_string()])
            .status();
    }
}

pub fn stop_and_wait(pid: u32) {
    send_signal(pid, "-STOP");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while !std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rsplit_once(')')
            .is_some_and(|(_, r)| r.trim_start().starts_with('T'))
    }) {
        assert!(std::time::Instant::now() < deadline, "{pid} never stopped");
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// SIGKILLs `pid` and waits until it is gone.
pub fn kill_9_and_wait(pid: u32) {
    send_signal(pid, "-9");
    while alive(pid) {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// Sends SIGINT to `child` alone (not its process group, as a terminal's Ctrl-C would)
/// and returns its exit code.
pub fn interrupt(child: &mut Child) -> Option<i32> {
    send_signal(child.id(), "-INT");
    child.wait().unwrap().code()
}

/// Reads `child`'s piped stderr up to the first line that contains `line` and returns
/// the lines read; panics with them if the run ends first. The rest is read on a
/// thread: a closed pipe would fail the run's next progress line.
pub fn read_stderr_until(child: &mut Child, line: &str) -> Vec<String> {
    let mut lines = BufReader::new(child.stderr.take().expect("stderr piped")).lines();
    let mut seen = Vec::new();
    for read in lines.by_ref() {
        let read = read.unwrap();
        let found = read.contains(line);
        seen.push(read);
        if found {
            break;
        }
    }
    assert!(
        seen.last().is_some_and(|l| l.contains(line)),
        "the run never started: {seen:?}"
    );
    std::thread::spawn(move || lines.for_each(drop));
    seen
}

/// Starts `run` (stdout to null, stderr read), waits for its stderr line that contains
/// `line`, calls `then` (what must hold while it runs), interrupts it
/// ([`interrupt`]) and returns its exit code.
pub fn interrupt_at_line(run: &mut Command, line: &str, then: impl FnOnce()) -> Option<i32> {
    let mut child = run
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    read_stderr_until(&mut child, line);
    then();
    interrupt(&mut child)
}

/// Polls `ready` until it holds, asserting meanwhile that `child` runs; panics naming
/// `what` if it does not hold within `within`.
pub fn wait_while_running(
    child: &mut Child,
    within: std::time::Duration,
    what: &str,
    mut ready: impl FnMut() -> bool,
) {
    let started = std::time::Instant::now();
    while !ready() {
        if started.elapsed() > within {
            let _ = child.kill();
            let _ = child.wait();
            panic!("no {what}");
        }
        assert_eq!(child.try_wait().unwrap(), None, "ended early");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// Starts `run` (its output to null), waits until `ready` holds ([`wait_while_running`],
/// 30 s) and `settle` more, interrupts it ([`interrupt`]) and returns its exit code.
pub fn interrupt_when(
    run: &mut Command,
    what: &str,
    ready: impl FnMut() -> bool,
    settle: std::time::Duration,
) -> Option<i32> {
    let mut child = run
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_while_running(&mut child, std::time::Duration::from_secs(30), what, ready);
    std::thread::sleep(settle);
    interrupt(&mut child)
}

/// Waits up to `within` for every one of `pids` to end; kills those left and panics
/// naming `what` if any outlives it.
pub fn assert_ended(pids: &[u32], within: std::time::Duration, what: &str) {
    let deadline = std::time::Instant::now() + within;
    while pids.iter().any(|&p| alive(p)) {
        if std::time::Instant::now() > deadline {
            let left: Vec<u32> = pids.iter().copied().filter(|&p| alive(p)).collect();
            for &p in &left {
                // It may end in between.
                let _ = Command::new("kill")
                    .args(["-KILL", &p.to_string()])
                    .status();
            }
            panic!("{what} {left:?} outlived the run");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}
