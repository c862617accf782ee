//! `namdb bench txn` as a user runs it: JSON fields, the bank's invariant, a recorded
//! history that `namdb verify` accepts, and clear errors for bad arguments.

mod common;

use serde_json::Value;
use std::path::Path;
use std::time::{Duration, Instant};

/// Runs `namdb bench txn ARGS`, which must succeed; its stdout.
fn bench(args: &[&str]) -> String {
    let mut all = vec!["bench", "txn"];
    all.extend_from_slice(args);
    common::ok(Path::new("."), &all)
}

/// Calls `run(n, duration)` with a duration of `seconds`, then twice as long each
/// time, until it gives what the test needs (at most `runs` runs). A fixed short run
/// could lack it on a loaded machine: 0.3 s of 64 KiB values committed none with three
/// test binaries running on two cores.
fn run_until<T>(mut seconds: f64, runs: usize, mut run: impl FnMut(usize, &str) -> Option<T>) -> T {
    for n in 0..runs {
        if let Some(done) = run(n, &seconds.to_string()) {
            return done;
        }
        seconds *= 2.0;
    }
    panic!("not in {runs} runs of up to {} s", seconds / 2.0);
}

/// The JSON report of `namdb bench txn` run into `json`.
fn report(json: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(json).unwrap()).unwrap()
}

/// Runs `namdb bench txn ARGS --duration S --json FILE` for 0.3 s, then longer
/// ([`run_until`], at most 8 runs, the last 38 s), until one commits; its stdout and
/// JSON report.
fn bench_until_a_commit(args: &[&str]) -> (String, Value) {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("r.json");
    run_until(0.3, 8, |_, duration| {
        let mut all = args.to_vec();
        all.extend_from_slice(&["--duration", duration, "--json", json.to_str().unwrap()]);
        let text = bench(&all);
        let v = report(&json);
        (v["committed"].as_u64().unwrap() > 0).then_some((text, v))
    })
}

/// `namdb verify FILE` must accept the history.
fn verifies(history: &Path) {
    common::ok(Path::new("."), &["verify", history.to_str().unwrap()]);
}

#[test]
fn ycsb_writes_the_json_fields() {
    let (text, v) =
        bench_until_a_commit(&["--threads", "2", "--coroutines", "4", "--keys", "2000"]);
    assert!(text.contains("txn/s"), "{text}");
    assert_eq!(v["backend"], "sim");
    assert_eq!(v["threads"], 2);
    assert_eq!(v["coroutines"], 4);
    assert!(v["txn_per_sec"].as_f64().unwrap() > 0.0, "{v}");
    assert!(v["committed"].as_u64().unwrap() > 0, "{v}");
    for f in ["abort_rate", "p50_us", "p99_us"] {
        assert!(v[f].as_f64().is_some(), "{f}: {v}");
    }
    assert!(v["p99_us"].as_f64().unwrap() >= v["p50_us"].as_f64().unwrap());
}

#[test]
fn bank_on_shm_keeps_its_money_and_its_history_verifies() {
    let dir = tempfile::tempdir().unwrap();
    // A skewed bank collides: runs go on until one had a conflict.
    let (v, history) = run_until(1.0, 5, |n, duration| {
        let json = dir.path().join(format!("r{n}.json"));
        let history = dir.path().join(format!("h{n}.jsonl"));
        bench(&[
            "--backend",
            "shm",
            "--workload",
            "bank",
            "--keys",
            "50",
            "--dist",
            "zipf",
            "--threads",
            "2",
            "--coroutines",
            "4",
            "--duration",
            duration,
            "--history",
            history.to_str().unwrap(),
            "--json",
            json.to_str().unwrap(),
        ]);
        let v = report(&json);
        assert_eq!(v["backend"], "shm");
        assert_eq!(v["invariant_ok"], true, "{v}");
        (v["aborts"]["conflict"].as_u64().unwrap() > 0).then_some((v, history))
    });
    assert!(v["committed"].as_u64().unwrap() > 0, "{v}");
    verifies(&history);
}

/// More keys than one load transaction takes: the loader's transactions run
/// concurrently, and the history once put them all in one session, which `namdb
/// verify` rejected as a session not seeing its own commit.
#[test]
fn a_history_loaded_by_many_transactions_verifies() {
    let dir = tempfile::tempdir().unwrap();
    let history = dir.path().join("h.jsonl");
    bench(&[
        "--workload",
        "bank",
        "--keys",
        "2000",
        "--duration",
        "0.3",
        "--history",
        history.to_str().unwrap(),
    ]);
    let loads = std::fs::read_to_string(&history)
        .unwrap()
        .lines()
        .filter(|l| l.contains(r#""value":1000"#))
        .count();
    assert!(
        loads > 1,
        "{loads} load transactions: the test needs several"
    );
    verifies(&history);
}

#[test]
fn list_append_history_verifies() {
    let dir = tempfile::tempdir().unwrap();
    // A history worth checking: runs go on until one recorded over 100 transactions.
    let history = run_until(1.0, 5, |n, duration| {
        let history = dir.path().join(format!("h{n}.jsonl"));
        bench(&[
            "--workload",
            "list-append",
            "--keys",
            "200",
            "--read-ratio",
            "0.5",
            "--value-size",
            "4096",
            "--coroutines",
            "8",
            "--duration",
            duration,
            "--history",
            history.to_str().unwrap(),
        ]);
        let lines = std::fs::read_to_string(&history).unwrap().lines().count();
        (lines > 100).then_some(history)
    });
    verifies(&history);
}

/// Commits acknowledged before they are visible break real-time order, as the flag
/// says: the history says so in its first line, and verify skips only that check.
#[test]
fn a_no_wait_visible_history_verifies_without_the_real_time_check() {
    let dir = tempfile::tempdir().unwrap();
    let history = dir.path().join("h.jsonl");
    let o = common::namdb_here(&[
        "bench",
        "txn",
        "--workload",
        "list-append",
        "--keys",
        "10",
        "--coroutines",
        "8",
        "--duration",
        "1",
        "--no-wait-visible",
        "--history",
        history.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", common::text(&o));
    assert!(
        common::stderr(&o).contains("`namdb verify` skips its real-time check"),
        "{}",
        common::text(&o)
    );
    let recorded = std::fs::read_to_string(&history).unwrap();
    let first: Value = serde_json::from_str(recorded.lines().next().unwrap()).unwrap();
    assert_eq!(first["header"]["real_time"], Value::Bool(false), "{first}");
    // Aborts are recorded by kind, not by a message naming the key and snapshot,
    // which made verify's count of errors one entry per key (a line of kilobytes).
    let errors: Vec<String> = recorded
        .lines()
        .skip(1)
        .filter_map(|l| {
            let t: Value = serde_json::from_str(l).unwrap();
            t["error"].as_str().map(str::to_string)
        })
        .collect();
    assert!(!errors.is_empty(), "10 keys, 16 clients: some conflict");
    assert!(
        errors.iter().all(
            |e| ["conflict", "duplicate_key", "snapshot_too_old", "list_full"]
                .contains(&e.as_str())
        ),
        "{:?}",
        &errors[..errors.len().min(5)]
    );
    let said = common::ok(Path::new("."), &["verify", history.to_str().unwrap()]);
    assert!(
        said.contains("real-time order not checked")
            && said.contains("--no-wait-visible")
            && said
                .contains("verdict: VALID under snapshot isolation (real-time order not checked)"),
        "{said}"
    );
    // Every other check still ran: the transactions were all checked.
    assert!(
        !said.contains("white-box (system timestamps): skipped"),
        "{said}"
    );
    let o = common::namdb_here(&[
        "bench",
        "txn",
        "--cluster",
        "nonexistent.json",
        "--no-wait-visible",
    ]);
    assert!(
        !o.status.success() && common::stderr(&o).contains("embedded cluster only"),
        "{}",
        common::text(&o)
    );
}

#[test]
fn list_append_on_few_keys_sizes_its_lists_and_stops_when_one_is_full() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("r.json");
    // 100 keys used to fill their 8-element lists at once and measure nothing but
    // "list full" aborts; the lists are now sized for the keys.
    bench(&[
        "--workload",
        "list-append",
        "--keys",
        "100",
        "--duration",
        "1",
        "--json",
        json.to_str().unwrap(),
    ]);
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert!(v["committed"].as_u64().unwrap() > 0, "{v}");
    assert!(v["aborts"]["list_full"].as_u64().unwrap() <= 16, "{v}");
    match v["stopped_early"].as_str() {
        None => assert_eq!(v["seconds"].as_f64().unwrap(), 0.9, "{v}"),
        Some(why) => assert!(why.starts_with("a list was full (2048 elements"), "{v}"),
    }
    // Lists too small for the run: full within the warm-up, nothing measured, and said.
    let (status, err) = stderr_within(
        &[
            "bench",
            "txn",
            "--workload",
            "list-append",
            "--keys",
            "100",
            "--value-size",
            "64",
            "--duration",
            "10",
        ],
        Duration::from_secs(30),
    );
    assert!(!status.success(), "{err}");
    assert!(
        err.contains("a list was full (8 elements, the most --value-size 64 holds) after")
            && err.contains("within the 1.00 s warm-up, so nothing was measured"),
        "{err}"
    );
}

#[test]
fn values_larger_than_txns_default_buffer_run() {
    let (_, v) = bench_until_a_commit(&["--keys", "100", "--value-size", "65536"]);
    assert!(v["committed"].as_u64().unwrap() > 0, "{v}");
}

/// Runs `namdb ARGS` and returns its standard error, killing it if it has not finished
/// within `limit`: a bad argument that hangs the run must fail the test, not hang it.
fn stderr_within(args: &[&str], limit: Duration) -> (std::process::ExitStatus, String) {
    use std::io::{Read, Seek};
    // A file rather than a pipe, which a chatty child could fill while nobody reads it.
    let mut err = tempfile::tempfile().unwrap();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_namdb"))
        .args(args)
        .env("RUST_BACKTRACE", "0")
        .stdout(std::process::Stdio::null())
        .stderr(err.try_clone().unwrap())
        .spawn()
        .expect("namdb runs");
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > limit {
            child.kill().unwrap();
            let _ = child.wait();
            panic!("namdb {args:?} still ran after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut text = String::new();
    err.rewind().unwrap();
    err.read_to_string(&mut text).unwrap();
    (status, text)
}

#[test]
fn bad_arguments_are_refused_clearly() {
    for (args, says) in [
        (vec!["--read-ratio", "2"], "--read-ratio"),
        (vec!["--duration", "0"], "--duration"),
        (vec!["--duration", "1e12"], "at most 86400 s"),
        (vec!["--workload", "tpcc"], "tpcc"),
        (vec!["--keys", "1"], "--keys"),
        // Taken without a word: bank's balances are 8 bytes.
        (
            vec![
                "--workload",
                "bank",
                "--value-size",
                "128",
                "--keys",
                "100",
                "--duration",
                "0.2",
            ],
            "--value-size 128 does not apply to bank, whose balances are 8 bytes",
        ),
        // Used to load the keys and then hang, sampling NaN forever.
        (
            vec![
                "--dist",
                "zipf",
                "--zipf-theta",
                "inf",
                "--keys",
                "100",
                "--duration",
                "0.5",
            ],
            "--zipf-theta must be a positive finite number, got inf",
        ),
        (
            vec!["--dist", "zipf", "--zipf-theta", "NaN"],
            "--zipf-theta",
        ),
        (vec!["--dist", "zipf", "--zipf-theta", "0"], "--zipf-theta"),
        // Taken without a word, the keys drawn uniformly all the same.
        (
            vec!["--zipf-theta", "0.5", "--keys", "100", "--duration", "0.2"],
            "--zipf-theta 0.5 applies only to --dist zipf",
        ),
        (
            vec!["--dist", "uniform", "--zipf-theta", "0.5"],
            "add --dist zipf or drop --zipf-theta",
        ),
        (vec!["--read-ratio", "NaN"], "--read-ratio"),
        (vec!["--read-ratio", "inf"], "--read-ratio"),
        // Once told that it was shorter than a millisecond.
        (
            vec!["--duration", "inf"],
            "at most 86400 s (a day), got inf",
        ),
        (vec!["--duration", "NaN"], "--duration"),
        // Terabytes of table: refused before anything is mapped or loaded (100 M
        // keys once loaded at a few hundred keys a second toward the OOM killer).
        (
            vec!["--keys", "100000000", "--value-size", "65536"],
            "use at most about",
        ),
        // A cluster's compute nodes run with txn's default buffer.
        (
            vec![
                "--cluster",
                "/nonexistent/cluster.json",
                "--value-size",
                "20000",
            ],
            "--value-size 20000 is too large for --cluster: a compute node's transaction \
             holds values of up to 16360 bytes",
        ),
    ] {
        let mut all = vec!["bench", "txn"];
        all.extend_from_slice(&args);
        let (status, err) = stderr_within(&all, Duration::from_secs(30));
        assert!(!status.success(), "{args:?} accepted");
        assert!(err.contains(says), "{args:?}: {err}");
    }
}

/// A `--json` that cannot be written fails the command before the run, not after it
/// (as the other benchmarks and `tpcw` do): the run's figures were lost.
#[test]
fn an_unwritable_json_path_fails_before_the_run() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("no-such-directory").join("r.json");
    let (status, err) = stderr_within(
        &[
            "bench",
            "txn",
            "--keys",
            "1000",
            "--duration",
            "0.3",
            "--json",
            json.to_str().unwrap(),
        ],
        Duration::from_secs(30),
    );
    assert!(!status.success(), "{err}");
    assert!(err.contains("cannot open JSON output file"), "{err}");
    assert!(!err.contains("loaded"), "the keys were loaded first: {err}");
}

/// The entries of `dir`.
fn entries(dir: &Path) -> Vec<std::ffi::OsString> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect()
}

#[test]
fn an_interrupted_run_leaves_no_temporary_directory() {
    let long_run = ["bench", "txn", "--keys", "1000", "--duration", "60"];
    let tmp = tempfile::tempdir().unwrap();
    // shm's socket directory goes on Ctrl-C, with the shell's status for it.
    let code = common::interrupt_when(
        std::process::Command::new(env!("CARGO_BIN_EXE_namdb"))
            .args(long_run)
            .args(["--backend", "shm"])
            .env("TMPDIR", tmp.path()),
        "directory",
        || !entries(tmp.path()).is_empty(),
        Duration::from_millis(300),
    );
    assert_eq!(code, Some(130));
    assert_eq!(entries(tmp.path()), Vec::<std::ffi::OsString>::new());

    // Other backends make no directory at all, so even SIGKILL leaves nothing.
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_namdb"))
        .args(long_run)
        .args(["--backend", "sim"])
        .env("TMPDIR", tmp.path())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(1000));
    assert_eq!(child.try_wait().unwrap(), None, "ended early");
    child.kill().unwrap();
    child.wait().unwrap();
    assert_eq!(entries(tmp.path()), Vec::<std::ffi::OsString>::new());
}
