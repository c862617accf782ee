//! `namdb chaos`: a small run that kills, crashes (at every commit step) and pauses
//! compute nodes, fails its replicated (durable) memory server over to the backup, and
//! passes every check; and clear errors for bad arguments. The run uses
//! `--replicas 2` rather than adding a second run of its length: the memory-server
//! restart episode's recovery path (kill, restart on the data directory, nodes reopen
//! and repair) is covered by the process tests in `durable_cluster.rs`.

mod common;

use serde_json::Value;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn namdb(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_namdb"))
        .args(args)
        .env_remove("NAMDB_CRASH")
        .output()
        .expect("namdb runs")
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// `namdb chaos` with seed 11, two nodes and one replicated memory server, for
/// `duration` seconds, with `extra` arguments, writing its report to `json`.
fn seed_11_run(duration: &str, extra: &[&str], json: &Path) -> Output {
    let mut args = vec![
        "chaos",
        "--duration",
        duration,
        "--nodes",
        "2",
        "--servers",
        "1",
        "--sessions",
        "2",
        "--seed",
        "11",
        "--replicas",
        "2",
    ];
    args.extend_from_slice(extra);
    args.extend(["--json", json.to_str().unwrap()]);
    namdb(&args)
}

/// A [`seed_11_run`] with its files in a directory of its own (`run`, inside the
/// temporary directory returned) that must pass: the directory, the run's, its
/// output, and its report's action counts.
fn passing_seed_11_run(
    duration: &str,
    extra: &[&str],
) -> (tempfile::TempDir, std::path::PathBuf, String, Value) {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("chaos.json");
    let run = dir.path().join("run");
    let mut args = vec!["--dir", run.to_str().unwrap()];
    args.extend_from_slice(extra);
    let o = seed_11_run(duration, &args, &json);
    let out = text(&o);
    assert!(o.status.success(), "{out}");
    assert!(out.contains("verdict: PASSED"), "{out}");
    let report: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    (dir, run, out, report["actions"].clone())
}

#[test]
fn a_small_run_kills_crashes_at_every_step_pauses_stalls_fails_the_server_over_and_passes() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("chaos.json");
    // 37 s is what the plan needs to arm all seven crash points, stall a node past its
    // lease twice, restart the memory server's backup and fail the server over with a
    // 250 ms lease: two stalls, since one may run on unfenced on a loaded machine.
    let o = seed_11_run("37", &[], &json);
    let out = text(&o);
    assert!(o.status.success(), "{out}");
    assert!(out.contains("verdict: PASSED"), "{out}");
    let report: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(report["passed"], true, "{out}");
    assert_eq!(report["violations"].as_array().unwrap().len(), 0);

    let actions = &report["actions"];
    assert!(actions["kills"].as_u64().unwrap() >= 1, "{actions}");
    assert!(actions["pauses"].as_u64().unwrap() >= 1, "{actions}");
    // A node stopped past its lease was fenced by the other (at the memory servers,
    // then its slot), found that once resumed, and was started again.
    assert!(actions["stalls"].as_u64().unwrap() >= 1, "{actions}");
    assert!(
        actions["stalls_fenced"].as_u64().unwrap() >= 1,
        "{actions}\n{out}"
    );
    assert!(actions["fenced"].as_u64().unwrap() >= 1, "{actions}");
    assert!(actions["restarts"].as_u64().unwrap() >= 1, "{actions}");
    let points = report["crash_points"].as_object().unwrap();
    assert_eq!(points.len(), txn::crash::POINTS.len(), "{points:?}");
    for (point, counts) in points {
        assert!(
            counts["fired"].as_u64().unwrap() >= 1,
            "crash point {point} never fired: {counts}\n{out}"
        );
    }
    assert!(
        report["plan"]["uncovered_points"]
            .as_array()
            .unwrap()
            .is_empty()
    );

    // Memory server 0's primary (the oracle's) was killed for good; every node lost it
    // and came back on the backup, and the first to reopen promoted it and repaired
    // what the failover lost (the promoted backup's boot is new). Never restarted.
    assert_eq!(actions["server_failovers"], 1, "{actions}");
    // Before that, its backup was killed and started again, and its primary copied
    // its state there while commits went on: the failover found every write on it.
    assert_eq!(actions["backup_kills"], 1, "{actions}");
    assert_eq!(actions["backup_restarts"], 1, "{actions}");
    assert!(out.contains("1 backup kills, 1 backup restarts"), "{out}");
    assert_eq!(actions["server_kills"], 0, "{actions}");
    assert_eq!(actions["server_restarts"], 0, "{actions}");
    assert!(actions["reconnects"].as_u64().unwrap() >= 2, "{actions}");
    let restarts = report["server_restarts"].as_array().unwrap();
    assert_eq!(restarts.len(), 1, "{restarts:?}");
    for r in restarts {
        assert_eq!(r["server"], 0, "{r}");
        assert_eq!(r["failover"], true, "{r}");
        assert!(r["restarted_at_ms"].is_null(), "{r}");
        let repair = &r["repairs"][0];
        assert_eq!(repair["restarted"][0], 0, "{r}");
        assert!(repair["oracle_from"].as_u64().is_some(), "{r}");
        // Once missing from the event and the report: the restart report's count of
        // index claims settled.
        assert!(repair["claims_settled"].as_u64().is_some(), "{r}");
        assert!(
            r["commits_resumed_after_ms"].as_f64().is_some(),
            "{r}\n{out}"
        );
    }
    assert_eq!(report["server_restart_summary"]["unrepaired"], 0);
    assert_eq!(report["server_restart_summary"]["failovers"], 1);
    assert!(
        report["server_restart_summary"]["claims_settled"]
            .as_u64()
            .is_some()
    );
    assert!(out.contains(" index claims settled"), "{out}");
    assert!(
        out.contains("memory-server restarts: 0, failovers: 1 "),
        "{out}"
    );
    assert!(out.contains("server 0 failed over at "), "{out}");

    let recoveries = &report["recoveries"];
    assert!(recoveries["count"].as_u64().unwrap() >= 1, "{recoveries}");
    assert!(recoveries["death_to_recovered_max_ms"].as_f64().is_some());
    let deaths = report["deaths"].as_array().unwrap();
    assert!(deaths.iter().any(|d| d["cause"] == "kill"));
    assert!(deaths.iter().any(|d| d["cause"] == "fenced"), "{out}");
    assert!(deaths.iter().any(|d| d["cause"] == "server-failover"));
    assert!(
        deaths
            .iter()
            .any(|d| d["cause"].as_str().unwrap().starts_with("crash:"))
    );
    // After-log and later crashes are committed, so recovery rolls something forward.
    assert!(
        recoveries["rolled_forward"].as_u64().unwrap() >= 1,
        "{recoveries}"
    );

    let names: Vec<&str> = report["checks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            assert_eq!(c["passed"], true, "{c}");
            c["name"].as_str().unwrap()
        })
        .collect();
    assert_eq!(
        names,
        [
            "snapshot isolation",
            "bank invariant",
            "acknowledged writes",
            "no lock remains",
            "harness"
        ]
    );
    let throughput = &report["throughput"];
    // Commits come in bursts (lock waits, the backup's outage, node restarts): in some
    // runs most 100 ms buckets hold none. Then there is no baseline, and no dip
    // figure pretends otherwise.
    let median = throughput["median_per_bucket"].as_f64().unwrap();
    assert!(median >= 0.0, "{throughput}");
    for dip in throughput["dips"].as_array().unwrap() {
        assert_eq!(dip["ratio"].is_null(), median == 0.0, "{throughput}");
    }
    if median == 0.0 {
        assert!(out.contains("there is no baseline"), "{out}");
    }
    assert_eq!(
        throughput["dips"].as_array().unwrap().len(),
        deaths.len(),
        "{throughput}"
    );
    // Progress, not speed: every crash point fired on a commit and commits resumed
    // after the failover (above). A count after a fixed time was a speed assert: a
    // debug build under 4x load committed fewer than 1000 in the 30 s.
    assert!(
        report["history"]["committed"].as_u64().unwrap() > 0,
        "{out}"
    );
    // The length measured, at least the one asked for.
    let elapsed = report["elapsed_s"].as_f64().unwrap();
    assert!(elapsed >= 25.0, "{elapsed}");
    assert!(out.contains(&format!(" ran {elapsed:.1} s")), "{out}");
}

#[test]
fn bad_arguments_are_clear_errors() {
    let used = tempfile::tempdir().unwrap();
    std::fs::write(used.path().join("earlier.log"), "an earlier run").unwrap();
    let used = used.path().to_str().unwrap().to_string();
    let cases: [(&[&str], &str); 14] = [
        (&["--duration", "0"], "must be above 0"),
        // More nodes than the harness keeps up with: it once ran on, filling the disk.
        (&["--nodes", "20"], "--nodes"),
        (
            &[
                "--nodes",
                "1",
                "--sessions",
                "1",
                "--workload",
                "bank,list-append",
            ],
            "at least as many sessions",
        ),
        (&["--dir", &used], "not empty"),
        (&["--duration", "soon"], "is not a number of seconds"),
        (&["--nodes", "0"], "--nodes"),
        (&["--servers", "9"], "--servers"),
        (&["--workload", "bank,ledger"], "ledger"),
        // A repeat was dropped silently: the run was not the one asked for.
        (
            &["--workload", "bank,list-append,bank"],
            "--workload lists bank twice",
        ),
        (&["--backend", "sim"], "sim"),
        (&["--lease-ms", "5"], "--lease-ms"),
        (&["--replicas", "3"], "--replicas"),
        // Without a backup there is no failover: the flag was silently moot.
        (
            &["--stop-failed-primaries"],
            "--stop-failed-primaries is about failovers, which need a backup per server: add \
             --replicas 2",
        ),
        (
            &["--replicas", "1", "--rejoin-failed-primaries"],
            "--rejoin-failed-primaries is about failovers",
        ),
    ];
    for (args, expected) in cases {
        let mut argv = vec!["chaos"];
        argv.extend_from_slice(args);
        let o = namdb(&argv);
        let out = text(&o);
        assert!(!o.status.success(), "{args:?}: {out}");
        assert!(out.contains(expected), "{args:?}: {out}");
        assert!(!out.contains("panicked"), "{args:?}: {out}");
    }
}

#[test]
fn a_bad_crash_spec_stops_a_chaos_node_before_it_connects() {
    let dir = tempfile::tempdir().unwrap();
    let events = dir.path().join("e.jsonl");
    let o = Command::new(env!("CARGO_BIN_EXE_namdb"))
        .args([
            "chaos-node",
            "--memory-servers",
            "127.0.0.1:1",
            "--token-file",
            "/nonexistent",
            "--node",
            "0",
            "--incarnation",
            "1",
            "--sessions",
            "1",
            "--workload",
            "bank",
            "--lease-ms",
            "250",
            "--events",
            events.to_str().unwrap(),
            "--seed",
            "1",
        ])
        .env("NAMDB_CRASH", "after-lunch:0.5")
        .output()
        .unwrap();
    let out = text(&o);
    assert!(!o.status.success());
    assert!(
        out.contains("NAMDB_CRASH: unknown crash point `after-lunch`"),
        "{out}"
    );
}

/// A compute node still waiting for its memory servers ends once the harness closes
/// its stdin, as the harness does to stop it and as happens when the harness dies.
/// It used to keep retrying for up to a minute, outliving a harness stopped with
/// Ctrl-C.
#[test]
fn a_node_waiting_for_its_memory_servers_ends_when_the_harness_goes() {
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    common::ok(dir.path(), &["token", "generate", token.to_str().unwrap()]);
    // A loopback port nothing listens on once the listener is dropped.
    let unused = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let events = dir.path().join("node.events.jsonl");
    let mut node = Command::new(env!("CARGO_BIN_EXE_namdb"))
        .args(["chaos-node", "--memory-servers", &unused.to_string()])
        .arg("--token-file")
        .arg(&token)
        .args(["--node", "0", "--incarnation", "1", "--sessions", "1"])
        .args(["--workload", "bank", "--lease-ms", "250", "--seed", "1"])
        .arg("--events")
        .arg(&events)
        .env_remove("NAMDB_CRASH")
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    common::read_stderr_until(&mut node, "cannot open the database yet");
    drop(node.stdin.take());
    // Well below the minute the node would have gone on trying.
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = node.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = node.kill();
            let _ = node.wait();
            panic!("the node outlived its harness by 30 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(!status.success(), "{status}");
}

/// A failover whose backup does not hold its primary's state by the time the harness
/// gives up waiting is skipped, not carried out: the backup would rightly refuse
/// Promote, and the nodes would retry it until the run hung (the harness carried the
/// failover out anyway). The hidden hooks keep server 0's backup unsynced after its
/// restart (its primary waits 10 minutes before copying its state again) and make the
/// harness give up after 5 s instead of 60.
#[test]
fn a_failover_to_a_backup_that_never_syncs_is_skipped_and_fails_the_run() {
    let (status, out, report) = run_failover_harness(&["--give-up-after-ms", "5000"]);
    assert_eq!(status.code(), Some(1), "{out}");
    assert!(!out.contains("panicked"), "{out}");
    assert!(out.contains("verdict: FAILED"), "{out}");
    let why = "memory server 0's backup does not hold its primary's state yet";
    assert!(
        out.contains(&format!(
            "server_failover of memory server 0 gave up waiting after 5s: {why}; not carried out"
        )),
        "{out}"
    );
    assert_eq!(report["passed"], false, "{out}");
    let executed = report["executed"].as_array().unwrap();
    let server: Vec<(&str, &str)> = executed
        .iter()
        .filter(|e| {
            e["action"].as_str().unwrap().contains("server")
                || e["action"].as_str().unwrap().contains("backup")
        })
        .map(|e| {
            (
                e["action"].as_str().unwrap(),
                e["outcome"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(server.len(), 3, "{server:?}");
    assert_eq!(server[0].0, "backup_kill", "{server:?}");
    assert_eq!(server[1].0, "backup_restart", "{server:?}");
    assert_eq!(
        server[2],
        ("server_failover", format!("skipped: {why}").as_str()),
        "{server:?}"
    );
    // The primary was never killed: nothing failed over, no node lost its server.
    let actions = &report["actions"];
    assert_eq!(actions["server_failovers"], 0, "{actions}");
    assert_eq!(actions["reconnects"], 0, "{actions}");
    assert!(report["server_restarts"].as_array().unwrap().is_empty());
    let harness_check = report["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "harness")
        .unwrap();
    assert_eq!(harness_check["passed"], false, "{harness_check}");
    assert!(
        harness_check["details"]
            .as_array()
            .unwrap()
            .iter()
            .any(|d| d.as_str().unwrap().contains(why)),
        "{harness_check}"
    );
    // The workload's own checks are unaffected by the skip.
    for c in report["checks"].as_array().unwrap() {
        if c["name"] != "harness" {
            assert_eq!(c["passed"], true, "{c}");
        }
    }
}

/// A failover that waits for a stopped backup (SIGSTOP: it keeps its connections and
/// answers nothing) is given up on and reported, and the harness ends cleanly: the
/// backup is let go on before the servers stop, and progress goes on to the end. The
/// hidden hooks stop server 0's backup as soon as it is started again until the
/// failover has waited for it, keep it unsynced (its primary waits 10 minutes before
/// copying its state), and make the harness give up on the failover after 20 s.
///
/// That asking the backup never holds up the harness's loop (it used to, 5 s per ask)
/// is shown by `backup_watch::tests`, with an ask that hangs until the test lets it
/// go; a count of progress lines here would measure the host's speed.
#[test]
fn the_harness_keeps_running_while_a_backup_does_not_answer() {
    let (status, out, report) =
        run_failover_harness(&["--give-up-after-ms", "20000", "--stop-restarted-backups"]);
    // Failed: the failover was given up on, which is a harness problem.
    assert_eq!(status.code(), Some(1), "{out}");
    assert!(!out.contains("panicked"), "{out}");
    let executed = report["executed"].as_array().unwrap();
    let find = |action: &str| {
        executed
            .iter()
            .find(|e| e["action"] == action)
            .unwrap_or_else(|| panic!("no {action} in {executed:?}"))
    };
    let restart = find("backup_restart");
    assert!(
        restart["outcome"].as_str().unwrap().contains("stopped"),
        "{restart}"
    );
    let failover = find("server_failover");
    assert_eq!(
        failover["outcome"],
        "skipped: memory server 0's backup does not hold its primary's state yet",
        "{failover}"
    );
    // The failover waited at least the last 20 s before it was given up on (its wait
    // began at its planned time plus the slip of the actions before it).
    let gave_up_at = failover["at_ms"].as_f64().unwrap() / 1000.0;
    let waited_from = gave_up_at - 20.0;
    assert!(
        failover["planned_ms"].as_f64().unwrap() / 1000.0 <= waited_from,
        "{failover}"
    );

    // Progress lines ("  12.3 s  456 committed (...)") went on while it waited.
    let progress_while_waiting = out
        .lines()
        .filter(|l| l.contains(" committed ("))
        .filter_map(|l| l.split_whitespace().next()?.parse::<f64>().ok())
        .filter(|&t| t >= waited_from && t <= gave_up_at)
        .count();
    assert!(progress_while_waiting > 0, "{out}");
}

/// Runs the harness for 20 s with one node and one replicated server (seed 11: the
/// shortest run whose plan kills and restarts server 0's backup and then fails server
/// 0 over), with server 0's backup kept unsynced after its restart (its primary waits
/// 10 minutes before copying its state again) and `hooks` besides. Answers the exit
/// status, the harness's output and its JSON report (null when it wrote none).
fn run_failover_harness(hooks: &[&str]) -> (std::process::ExitStatus, String, Value) {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("chaos.json");
    let log = dir.path().join("chaos.log");
    let out_file = std::fs::File::create(&log).unwrap();
    let mut harness = Command::new(env!("CARGO_BIN_EXE_namdb"))
        .args([
            "chaos",
            "--duration",
            "20",
            "--nodes",
            "1",
            "--servers",
            "1",
        ])
        .args(["--sessions", "2", "--seed", "11", "--replicas", "2"])
        .args(["--resync-delay-ms", "600000"])
        .args(hooks)
        .arg("--json")
        .arg(&json)
        .env_remove("NAMDB_CRASH")
        .stdin(Stdio::null())
        .stdout(out_file.try_clone().unwrap())
        .stderr(out_file)
        .spawn()
        .unwrap();
    // Generous: the run takes about half a minute alone, a few times that on a loaded
    // host. Carrying a failover out to an unsynced backup left the nodes retrying
    // promotion for a minute per start, and the harness could not open the database
    // after the run.
    let deadline = Instant::now() + Duration::from_secs(600);
    let status = loop {
        if let Some(status) = harness.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = harness.kill();
            let _ = harness.wait();
            panic!(
                "the harness did not end within 10 minutes:\n{}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let out = std::fs::read_to_string(&log).unwrap();
    let report = std::fs::read_to_string(&json)
        .ok()
        .and_then(|j| serde_json::from_str(&j).ok())
        .unwrap_or(Value::Null);
    (status, out, report)
}

/// A short chaos run in its own temporary directory (`TMPDIR`, where its run
/// directory goes), output not yet set.
fn chaos_in(tmp: &std::path::Path, duration: &str) -> Command {
    let mut run = Command::new(env!("CARGO_BIN_EXE_namdb"));
    run.args([
        "chaos",
        "--duration",
        duration,
        "--nodes",
        "1",
        "--servers",
        "1",
        "--sessions",
        "2",
        "--seed",
        "5",
        "--no-server-restarts",
    ])
    .env("TMPDIR", tmp)
    .env_remove("NAMDB_CRASH")
    .env_remove("RUST_BACKTRACE")
    .stdin(Stdio::null());
    run
}

/// The run directory its first line names ("…; files in DIR"), and the processes
/// running on it (their --token-file is in it).
fn run_dir_and_processes(first_line: &str) -> (std::path::PathBuf, Vec<u32>) {
    let dir = first_line
        .rsplit_once("files in ")
        .map(|(_, d)| std::path::PathBuf::from(d.trim()))
        .unwrap_or_else(|| panic!("no run directory in {first_line:?}"));
    let pids = common::processes_naming(dir.join("token"));
    (dir, pids)
}

/// Reads `child`'s stderr lines up to the one containing `until`, returning them.
fn stderr_until(
    lines: &mut impl Iterator<Item = std::io::Result<String>>,
    until: &str,
) -> Vec<String> {
    let mut seen = Vec::new();
    for line in lines.by_ref() {
        let line = line.unwrap();
        let found = line.contains(until);
        seen.push(line);
        if found {
            return seen;
        }
    }
    panic!("the run ended before {until:?}: {seen:?}");
}

/// Whether anything is left in the run's TMPDIR.
fn leftovers(tmp: &std::path::Path) -> Vec<std::path::PathBuf> {
    std::fs::read_dir(tmp)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect()
}

/// A run of `seconds` in TMPDIR `tmp` whose stderr is piped, once its faults began:
/// the child, the rest of its stderr, what it said so far and its processes.
struct StartedRun {
    child: std::process::Child,
    lines: std::io::Lines<std::io::BufReader<std::process::ChildStderr>>,
    seen: Vec<String>,
    pids: Vec<u32>,
}

fn start_run(tmp: &std::path::Path, seconds: &str, stdout: Stdio) -> StartedRun {
    use std::io::BufRead;
    let mut child = chaos_in(tmp, seconds)
        .stdout(stdout)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(child.stderr.take().unwrap()).lines();
    let seen = stderr_until(&mut lines, "faults begin");
    let (dir, pids) = run_dir_and_processes(&seen[0]);
    assert!(!pids.is_empty(), "no process names {}", dir.display());
    StartedRun {
        child,
        lines,
        seen,
        pids,
    }
}

/// Nothing of the run is left: no file in its TMPDIR, none of its processes.
fn assert_nothing_left(tmp: &std::path::Path, pids: &[u32], said: &str) {
    assert_eq!(leftovers(tmp), Vec::<std::path::PathBuf>::new(), "{said}");
    common::assert_ended(pids, Duration::from_secs(30), "run processes");
}

/// `namdb chaos | head -1`, or with its stdout closed outright: the report's writes
/// fail once the run is over. Before, the first failed write panicked the process out
/// (status 141) and its run directory (90 MB for a default run) stayed behind. Now a
/// passed run ends with the same status, having removed its directory as any passed
/// run does, and left no process running.
#[test]
fn a_run_whose_report_reader_went_away_removes_its_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let StartedRun {
        mut child,
        lines,
        seen,
        pids,
    } = start_run(tmp.path(), "3", Stdio::piped());
    // Closed before the run writes anything there.
    drop(child.stdout.take());
    let rest: Vec<String> = lines.map(Result::unwrap).collect();
    let status = child.wait().unwrap();
    let said = format!("{}\n{}", seen.join("\n"), rest.join("\n"));
    assert_eq!(status.code(), Some(141), "{status:?}: {said}");
    assert!(!said.contains("panicked"), "{said}");
    assert_nothing_left(tmp.path(), &pids, &said);
}

/// `namdb chaos 2>&1 | head`: the progress lines' reader goes away mid-run. That
/// stops the run as an interrupt does: its processes stopped, its directory removed,
/// status 141. Before, the next progress line panicked the process out and left the
/// directory behind, and the memory server to notice its parent's end by itself.
#[test]
fn a_run_whose_progress_reader_went_away_stops_as_if_interrupted() {
    let tmp = tempfile::tempdir().unwrap();
    let StartedRun {
        mut child,
        lines,
        pids,
        ..
    } = start_run(tmp.path(), "120", Stdio::null());
    drop(lines);
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(141), "{status:?}");
    assert_nothing_left(tmp.path(), &pids, "");
}

/// Ctrl-C (SIGINT to the harness alone; its memory servers run in their own process
/// group) stops the run: its processes stopped, its directory removed, status 130.
/// Before, the signal's default action ended the harness at once and left its
/// directory behind.
#[test]
fn an_interrupted_run_stops_its_processes_and_removes_its_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let StartedRun {
        mut child,
        lines,
        pids,
        ..
    } = start_run(tmp.path(), "120", Stdio::null());
    let reader = std::thread::spawn(move || lines.map(Result::unwrap).collect::<Vec<_>>());
    common::send_signal(child.id(), "-INT");
    let status = child.wait().unwrap();
    let said = reader.join().unwrap().join("\n");
    assert_eq!(status.code(), Some(130), "{status:?}: {said}");
    assert!(
        said.contains("interrupted: stopped the processes"),
        "{said}"
    );
    assert_nothing_left(tmp.path(), &pids, &said);
}

/// A failover that stops the primary (SIGSTOP, as a hung host: it keeps its
/// connections and answers nothing) instead of killing it: the nodes find the primary
/// silent through its backup, exit as having lost the server, and the nodes started
/// again promote the backup, all while the primary is stopped; every check passes.
/// Before, nodes waited for the HTTP/2 keep-alive (half a minute) twice.
#[test]
fn a_failover_of_a_stopped_primary_is_carried_out_by_the_nodes_and_passes() {
    let (_dir, run, out, actions) = passing_seed_11_run("20", &["--stop-failed-primaries"]);
    assert_eq!(actions["server_failovers"], 1, "{actions}");
    assert_eq!(actions["stopped_primaries"], 1, "{actions}");
    assert_eq!(actions["stopped_primaries_failed_over"], 1, "{out}");
    assert!(
        out.contains("its backup was promoted while it was stopped in 1"),
        "{out}"
    );
    // A node running when the primary stopped found it silent through its backup.
    let said_lost = std::fs::read_dir(&run).unwrap().any(|e| {
        let path = e.unwrap().path();
        path.file_name()
            .unwrap()
            .to_str()
            .unwrap()
            .starts_with("node")
            && std::fs::read_to_string(&path).is_ok_and(|log| {
                log.contains("lost memory server 0")
                    && log.contains("did not answer within")
                    && log.contains("has not heard from it for")
            })
    });
    assert!(said_lost, "{out}");
}

/// A failed-over primary rejoins as its promoted backup's backup
/// (`--rejoin-failed-primaries`): server 0 fails over, its old primary comes back at
/// its address with `--backup-of`, the promoted server copies its state there while
/// commits go on, and the pair fails over again the other way round, promoting the
/// old primary's process; then the other rejoins too. Every check passes.
#[test]
fn a_failed_over_primary_rejoins_as_the_backup_and_the_pair_fails_over_again_and_passes() {
    let (_dir, run, out, actions) = passing_seed_11_run("40", &["--rejoin-failed-primaries"]);
    assert_eq!(actions["server_failovers"], 2, "{actions}");
    assert_eq!(actions["primary_rejoins"], 2, "{actions}");
    // The second failover promoted the process started on the old primary's data
    // directory as the backup.
    let promoted_after_rejoining = std::fs::read_dir(&run).unwrap().any(|e| {
        let path = e.unwrap().path();
        let name = path.file_name().unwrap().to_str().unwrap().to_string();
        name.starts_with("memory-server-0.as-backup.")
            && name.ends_with(".log")
            && std::fs::read_to_string(&path).is_ok_and(|log| {
                log.contains("backup of the promoted server at")
                    && log.contains("promoted: serving compute nodes")
            })
    });
    assert!(promoted_after_rejoining, "{out}");
}

/// A stopped primary rejoins by itself (`--stop-failed-primaries
/// --rejoin-failed-primaries`, so every server runs with `--rejoin-when-fenced`): once
/// the nodes promoted its backup the harness resumes it, and the same process finds
/// itself fenced and starts again as the promoted server's backup, which copies its
/// state there while commits go on. The pair then fails over the other way round (the
/// process that was first promoted stopped, resumed, rejoining in turn), and the
/// checker finds every acknowledged write.
#[test]
fn a_stopped_primary_resumed_rejoins_by_itself_and_the_pair_fails_over_again_and_passes() {
    let (_dir, run, out, actions) = passing_seed_11_run(
        "40",
        &["--stop-failed-primaries", "--rejoin-failed-primaries"],
    );
    assert_eq!(actions["server_failovers"], 2, "{actions}");
    assert_eq!(actions["stopped_primaries_failed_over"], 2, "{actions}");
    assert_eq!(actions["primaries_rejoined_by_themselves"], 2, "{actions}");
    assert_eq!(actions["primary_rejoins"], 2, "{actions}");
    assert!(
        out.contains("(2 by themselves, resumed after their fence)"),
        "{out}"
    );
    // No process was started for a rejoin: each server's first log holds its fence,
    // its start as the backup, and (the second failover) its promotion.
    let logs: Vec<String> = std::fs::read_dir(&run)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            let name = p.file_name().unwrap().to_str().unwrap();
            name.starts_with("memory-server-0") && name.ends_with(".log")
        })
        .map(|p| std::fs::read_to_string(p).unwrap())
        .collect();
    let rejoined = logs
        .iter()
        .filter(|log| {
            log.contains("was promoted in this one's place, which fenced this one")
                && log.contains("backup of the promoted server at")
        })
        .count();
    assert_eq!(rejoined, 2, "{out}");
}
