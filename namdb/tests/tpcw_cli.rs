//! `namdb tpcw` end to end: the three systems in one run (RSI on three backends), RSI on memory-server
//! processes with a TPC-W mix, a sweep with its plot, and bad arguments.

mod common;

use common::{
    assert_ended, interrupt_at_line, interrupt_when, namdb, ok, parent_of, processes_naming, stderr,
};
use serde_json::Value;

/// A small database: fast to load, and small enough that stocks restock often.
const SMALL: [&str; 10] = [
    "--items",
    "1000",
    "--ebs",
    "1",
    "--warmup",
    "0.2",
    "--sample-every",
    "7",
    "--duration",
    "1",
];

fn args<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    let mut v = vec!["tpcw"];
    v.extend_from_slice(&SMALL);
    v.extend_from_slice(extra);
    v
}

fn runs(json: &Value) -> &Vec<Value> {
    json["runs"].as_array().expect("runs is an array")
}

fn assert_checked(run: &Value) {
    let c = &run["checks"];
    assert_eq!(c["stock_conserved"], true, "{run}");
    assert_eq!(c["orders_present"], true, "{run}");
    // PostgreSQL gives the history no commit timestamps, so its register reads cannot
    // be placed in snapshots: inconclusive, never valid (nor invalid).
    let verdict = if run["system"] == "postgres" {
        "inconclusive"
    } else {
        "valid"
    };
    assert_eq!(c["history_verdict"], verdict, "{run}");
    assert!(c["items_checked"].as_u64().unwrap() > 0, "{run}");
}

#[test]
fn checkout_on_rsi_2pc_and_postgres_in_one_run() {
    // RSI on every backend that needs no RDMA hardware, one cluster after another.
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("out.json");
    let json_arg = json.display().to_string();
    let out = ok(
        dir.path(),
        &args(&[
            "--system",
            "rsi,2pc,postgres",
            "--backend",
            "sim,shm,tcp",
            "--clients",
            "6",
            "--json",
            &json_arg,
        ]),
    );
    // The summary table names every system, and the ratios compare RSI with each.
    for system in ["rsi ", "2pc ", "postgres "] {
        assert!(out.contains(system), "{out}");
    }
    for backend in ["sim", "shm", "tcp"] {
        assert!(
            out.contains(&format!("rsi ({backend}) / 2pc at 6 clients:")),
            "{out}"
        );
        assert!(
            out.contains(&format!("rsi ({backend}) / postgres at 6 clients:")),
            "{out}"
        );
    }
    let json: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(json["mix"], "checkout");
    let runs = runs(&json);
    let systems: Vec<&str> = runs.iter().map(|r| r["system"].as_str().unwrap()).collect();
    assert_eq!(systems, ["rsi", "rsi", "rsi", "2pc", "postgres"]);
    for run in runs {
        for field in [
            "system",
            "backend",
            "clients",
            "txn_per_sec",
            "abort_rate",
            "p50_us",
            "p99_us",
            "committed",
        ] {
            assert!(!run[field].is_null(), "{field} missing in {run}");
        }
        assert_eq!(run["clients"], 6);
        assert!(run["committed"].as_u64().unwrap() > 10, "{run}");
        assert!(run["txn_per_sec"].as_f64().unwrap() > 0.0);
        assert!(run["p99_us"].as_f64().unwrap() >= run["p50_us"].as_f64().unwrap());
        assert_checked(run);
    }
    let backends: Vec<&str> = runs[..4]
        .iter()
        .map(|r| r["backend"].as_str().unwrap())
        .collect();
    assert_eq!(backends, ["sim", "shm", "tcp", "tcp"]);
    // By default RSI's memory servers pin their memory when the host can spare it (a
    // run this small always fits); the baselines have no memory servers.
    let pinned: Vec<&Value> = runs.iter().map(|r| &r["pinned_memory"]).collect();
    assert_eq!(
        pinned,
        [
            &Value::Bool(true),
            &Value::Bool(true),
            &Value::Bool(true),
            &Value::Null,
            &Value::Null
        ]
    );
}

/// Also with the memory servers' memory pinned up front, and two versions per item.
#[test]
fn a_mix_on_durable_shm_memory_server_processes() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("out.json");
    let json_arg = json.display().to_string();
    let logs = dir.path().join("logs");
    let logs_arg = logs.display().to_string();
    let out = ok(
        dir.path(),
        &args(&[
            "--backend",
            "shm",
            // Durable servers: the mix's inserts, deletes and updates all persist.
            "--durable",
            "--mix",
            "ordering",
            "--clients",
            "8",
            "--json",
            &json_arg,
            "--dir",
            &logs_arg,
            "--pin-memory",
            // Items with two versions: sized into the tables and each buffer.
            "--item-versions",
            "2",
        ]),
    );
    assert!(out.contains("per interaction"), "{out}");
    let json: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let run = &runs(&json)[0];
    assert_eq!(run["backend"], "shm+durable");
    assert_eq!(run["mix"], "ordering");
    assert_checked(run);
    let names: Vec<&str> = run["interactions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["interaction"].as_str().unwrap())
        .collect();
    for expected in [
        "buy_confirm",
        "shopping_cart",
        "product_detail",
        "buy_request",
    ] {
        assert!(names.contains(&expected), "{names:?}");
    }
    // The memory servers ran as processes, logging where asked, and pinned their
    // memory as asked.
    let log = std::fs::read_to_string(logs.join("shm").join("memory-server-0.log")).unwrap();
    assert!(log.contains("pinned"), "{log}");
}

/// Also with the embedded memory servers' memory pinned up front.
#[test]
fn a_sweep_draws_throughput_against_clients() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("sweep.json");
    let svg = dir.path().join("sweep.svg");
    let (json_arg, svg_arg) = (json.display().to_string(), svg.display().to_string());
    let mut a = args(&[
        "--sweep",
        "--clients",
        "4",
        "--json",
        &json_arg,
        "--svg",
        &svg_arg,
        "--pin-memory",
    ]);
    // Shorter points: three of them.
    a[10] = "0.5";
    let o = namdb(dir.path(), &a);
    let log = stderr(&o);
    assert!(o.status.success(), "{log}");
    assert!(
        log.contains("pinning their memory") && log.contains("pinned in"),
        "{log}"
    );
    let json: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let clients: Vec<u64> = runs(&json)
        .iter()
        .map(|r| r["clients"].as_u64().unwrap())
        .collect();
    assert_eq!(clients, [1, 2, 4]);
    for run in runs(&json) {
        assert_checked(run);
    }
    let plot = std::fs::read_to_string(&svg).unwrap();
    assert!(plot.starts_with("<svg") && plot.contains("rsi (sim)"));
    assert_eq!(plot.matches("<circle").count(), 3, "one marker per point");
}

/// After a warm-up run, two rounds of the clients alone and beside the analytics, in
/// alternating order (the clients alone always ran first, which biased the
/// comparison), each run labelled so and the summary the medians; every item sampled, so the related-items updates rewrite sampled items the checkouts then read
/// (the history once lacked those versions: "SI invalid", wrong-version).
#[test]
fn htap_alternates_its_runs_after_a_warm_up_and_checks_them() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("htap.json");
    let json_arg = json.display().to_string();
    let mut a = args(&[
        "--htap",
        "--mix",
        "ordering",
        "--clients",
        "4",
        "--analytics-nodes",
        "1",
        // Every other query an update: a debug build on a loaded machine ran fewer
        // than five queries in its second, so the default (four Best Sellers per
        // update) left none to count (CI run 3).
        "--htap-best-sellers-per-related",
        "1",
        "--json",
        &json_arg,
        // Five runs' room, backed only as touched: a shorter start.
        "--lazy-memory",
    ]);
    assert_eq!(a[7], "--sample-every");
    a[8] = "1";
    let out = ok(dir.path(), &a);
    assert!(
        out.contains(
            "HTAP (rsi, sim, 4 clients, median of 2 runs each, alternating after a warm-up \
             run): ordering "
        ),
        "{out}"
    );
    for phase in ["alone", "with-analytics"] {
        assert!(
            out.contains(&format!("rsi (sim), 4 clients, {phase}, per interaction:")),
            "{out}"
        );
        assert!(
            out.lines()
                .any(|l| l.starts_with("rsi ") && l.contains(&format!(" {phase} "))),
            "no summary row for {phase}: {out}"
        );
    }
    let json: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let phases: Vec<&str> = runs(&json)
        .iter()
        .map(|r| r["phase"].as_str().unwrap())
        .collect();
    assert_eq!(
        phases,
        ["alone", "with-analytics", "with-analytics", "alone"],
        "the warm-up run is not reported, and the second round runs in reverse"
    );
    let htap = &json["htap"];
    assert_eq!(htap["rounds"], 2);
    for (phase, runs_of) in [
        ("alone", "txn_per_sec_alone_runs"),
        ("with-analytics", "txn_per_sec_with_analytics_runs"),
    ] {
        let tps: Vec<f64> = runs(&json)
            .iter()
            .filter(|r| r["phase"] == phase)
            .map(|r| r["txn_per_sec"].as_f64().unwrap())
            .collect();
        let listed: Vec<f64> = htap[runs_of]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect();
        assert_eq!(listed, tps, "{runs_of}");
        // The lower median of two runs: the slower.
        let median = htap[runs_of.trim_end_matches("_runs")].as_f64().unwrap();
        assert_eq!(median, tps[0].min(tps[1]), "{runs_of}");
    }
    for run in runs(&json) {
        assert_checked(run);
        assert_eq!(run["pinned_memory"], false, "{run}");
    }
    // Of the runs beside the analytics, not only the reported median one: a debug
    // build on a loaded machine runs few queries in a second.
    let analytics_runs = htap["analytics_runs"].as_array().unwrap();
    assert_eq!(analytics_runs.len(), 2);
    assert!(
        analytics_runs
            .iter()
            .map(|a| a["related_updates"].as_u64().unwrap())
            .sum::<u64>()
            > 0,
        "{htap}"
    );
}

/// The PostgreSQL script's default was a path into the source tree this binary was
/// built from, which an installed binary has not: it is built in now, and runs from any
/// current directory; `--postgres-script` still names another.
#[test]
fn postgres_starts_with_the_built_in_script_from_any_directory() {
    let elsewhere = tempfile::tempdir().unwrap();
    let help = ok(elsewhere.path(), &["tpcw", "--help"]);
    let source_tree = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap();
    assert!(
        !help.contains(&source_tree.display().to_string()),
        "--help names the source tree: {help}"
    );
    let o = namdb(
        elsewhere.path(),
        &args(&["--system", "postgres", "--clients", "2"]),
    );
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("starting PostgreSQL (the built-in scripts/postgres.sh)"),
        "{err}"
    );
    assert_eq!(
        std::fs::read_dir(elsewhere.path()).unwrap().count(),
        0,
        "the run left files in its current directory"
    );
    let o = namdb(
        elsewhere.path(),
        &args(&["--system", "postgres", "--postgres-script", "missing.sh"]),
    );
    assert!(!o.status.success());
    let err = stderr(&o);
    assert!(err.contains("missing.sh start"), "{err}");
    assert!(!err.contains("loading "), "{err}");
}

/// The start refuses a scratch PostgreSQL whose loaded database would not fit the
/// disk, but a long run's orders and order lines grow it further: the run watches the
/// free space of the database's directory and stops early, reporting what it measured,
/// below a floor (1 GiB; a hidden flag sets one no disk clears, so the first look stops
/// the run without filling the disk). Before, it ran on until the disk was full.
#[test]
fn a_postgres_run_stops_early_when_its_disk_runs_low() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("out.json");
    let out = ok(
        dir.path(),
        &[
            "tpcw",
            "--system",
            "postgres",
            "--items",
            "1000",
            "--ebs",
            "1",
            "--warmup",
            "0",
            "--duration",
            "600",
            "--clients",
            "2",
            "--postgres-disk-floor-mib",
            "1099511627776",
            "--json",
            json.to_str().unwrap(),
        ],
    );
    let json: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let run = &runs(&json)[0];
    let why = run["stopped_early"]
        .as_str()
        .unwrap_or_else(|| panic!("{run}"));
    assert!(why.contains("stopped after"), "{why}");
    assert!(
        why.contains("the disk of ") && why.contains("ran low"),
        "{why}"
    );
    assert!(
        why.contains("namdb-postgres-"),
        "not the database's directory: {why}"
    );
    assert!(run["seconds"].as_f64().unwrap() < 600.0, "{run}");
    // Checked, whatever the clients committed before the first look stopped them.
    assert_eq!(run["checks"]["stock_conserved"], true, "{run}");
    assert_eq!(run["checks"]["orders_present"], true, "{run}");
    assert!(
        out.contains("note: postgres (tcp) at 2 clients stopped after"),
        "{out}"
    );
}

#[test]
fn bad_arguments_are_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    for (bad, expect) in [
        (
            vec!["tpcw", "--items", "10"],
            "invalid value '10' for '--items <N>'",
        ),
        (
            vec!["tpcw", "--ebs", "0"],
            "invalid value '0' for '--ebs <N>'",
        ),
        // It ran twice, loading and checking it again.
        (
            vec![
                "tpcw",
                "--system",
                "rsi,rsi",
                "--items",
                "1000",
                "--ebs",
                "1",
                "--clients",
                "1",
                "--duration",
                "0.01",
                "--warmup",
                "0",
            ],
            "--system lists rsi twice",
        ),
        (
            vec!["tpcw", "--item-bytes", "64"],
            "invalid value '64' for '--item-bytes <BYTES>'",
        ),
        // Once turned into one thread, where `--clients 0` is refused.
        (
            vec!["tpcw", "--threads", "0"],
            "invalid value '0' for '--threads <T>'",
        ),
        (
            vec!["tpcw", "--duration", "0"],
            "--duration must be at least a millisecond",
        ),
        // Once told that it was shorter than a millisecond.
        (
            vec!["tpcw", "--duration", "inf"],
            "at most 86400 s (a day), got inf",
        ),
        // Measured as zero seconds, it printed NaN txn/s.
        (
            vec!["tpcw", "--duration", "1e-12"],
            "--duration must be at least a millisecond",
        ),
        // Only a sweep draws a plot: `--svg` alone once ran and drew nothing.
        (
            vec!["tpcw", "--svg", "plot.svg"],
            "the following required arguments were not provided:\n  --sweep",
        ),
        // Output paths are opened before the runs, which once ran whole before
        // failing to write.
        (
            vec!["tpcw", "--json", "."],
            "cannot open JSON output file .",
        ),
        (
            vec!["tpcw", "--json", "missing/out.json"],
            "cannot open JSON output file missing/out.json",
        ),
        (
            vec!["tpcw", "--sweep", "--svg", "missing/sweep.svg"],
            "cannot open the --svg plot file missing/sweep.svg",
        ),
        (
            vec!["tpcw", "--backend", "verbs"],
            "verbs needs RDMA hardware",
        ),
        (vec!["tpcw", "--system", "oracle"], "invalid value 'oracle'"),
        (vec!["tpcw", "--clients", "0"], "--clients"),
        // Refused before RSI runs, not after it and the load.
        (
            vec!["tpcw", "--system", "rsi,postgres", "--clients", "320"],
            "at most 290 clients",
        ),
        (
            vec!["tpcw", "--durable"],
            "--durable needs memory-server processes",
        ),
        (
            vec!["tpcw", "--durable", "--backend", "shm,sim"],
            "--durable needs memory-server processes",
        ),
        (
            vec!["tpcw", "--backend", "sim,shm,sim"],
            "--backend lists sim twice",
        ),
        (
            vec!["tpcw", "--htap", "--backend", "sim,shm"],
            "--htap runs on one backend",
        ),
        // Room for 10^12 s of orders once overflowed, and the sim then aborted
        // allocating it.
        (
            vec!["tpcw", "--duration", "1e12"],
            "and at most 86400 s (a day), got 1000000000000",
        ),
        (vec!["tpcw", "--warmup", "nan"], "--warmup must be between"),
        // A day of room: indexes of terabytes, touched from the start. Refused before
        // anything starts, with the longest run that fits.
        (
            vec!["tpcw", "--duration", "86400"],
            "MiB from the start, but this host has",
        ),
        // 2 billion rows on the RMs' heaps: refused before the load, which the OOM
        // killer once ended hours in.
        (
            vec!["tpcw", "--system", "2pc", "--ebs", "100000"],
            "EBs), but this host has",
        ),
        // 288 M customers: refused before a server starts, not once the disk is full.
        (
            vec!["tpcw", "--system", "postgres", "--ebs", "100000"],
            "write-ahead log included), but",
        ),
    ] {
        let o = namdb(dir.path(), &bad);
        assert!(!o.status.success(), "{bad:?} succeeded");
        let err = stderr(&o);
        assert!(err.contains(expect), "{bad:?}: {err}");
        assert!(!err.contains("loading "), "{bad:?} loaded first: {err}");
    }
}

#[test]
fn memory_servers_stop_when_the_run_is_killed() {
    use std::time::{Duration, Instant};
    let dir = tempfile::tempdir().unwrap();
    let mut run = std::process::Command::new(env!("CARGO_BIN_EXE_namdb"))
        .current_dir(dir.path())
        // What the killed run cannot remove lands in the test's directory.
        .env("TMPDIR", dir.path())
        .args(["tpcw", "--backend", "shm", "--items", "1000", "--ebs", "1"])
        .args(["--duration", "5", "--warmup", "0"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    let servers = loop {
        let servers: Vec<u32> = processes_naming("memory-server")
            .into_iter()
            .filter(|&pid| parent_of(pid) == Some(run.id()))
            .collect();
        if servers.len() == 2 {
            break servers;
        }
        assert!(Instant::now() < deadline, "no memory servers started");
        std::thread::sleep(Duration::from_millis(20));
    };
    // As the OOM killer or `kill -9` would: no chance to stop them.
    run.kill().unwrap();
    run.wait().unwrap();
    assert_ended(&servers, Duration::from_secs(20), "memory servers");
}

#[test]
fn an_interrupted_run_leaves_no_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let entries = || std::fs::read_dir(tmp.path()).unwrap().count();
    let code = interrupt_when(
        std::process::Command::new(env!("CARGO_BIN_EXE_namdb"))
            .args(["tpcw", "--items", "1000", "--ebs", "1", "--duration", "60"])
            .env("TMPDIR", tmp.path()),
        "directory",
        || entries() > 0,
        std::time::Duration::from_millis(500),
    );
    assert_eq!(code, Some(130));
    assert_eq!(entries(), 0, "the run's directory is left");
}

/// The `--json` and `--svg` files are created when the run starts (so a bad path fails
/// at once); a Ctrl-C used to leave them behind, empty.
#[test]
fn an_interrupted_run_removes_the_output_files_it_created() {
    let tmp = tempfile::tempdir().unwrap();
    let (json, svg) = (tmp.path().join("out.json"), tmp.path().join("out.svg"));
    let existing = tmp.path().join("existing.json");
    std::fs::write(&existing, "earlier results\n").unwrap();
    for out in [
        vec![
            "--json",
            json.to_str().unwrap(),
            "--sweep",
            "--svg",
            svg.to_str().unwrap(),
        ],
        vec!["--json", existing.to_str().unwrap()],
    ] {
        // Once the clients run, the files have long been opened. Runs of 5 s: a
        // sweep of 20 s runs sized its tables for 147 s of them, 15 GiB, more than
        // this host had free while the other tests of this binary ran.
        let code = interrupt_at_line(
            std::process::Command::new(env!("CARGO_BIN_EXE_namdb"))
                .args(["tpcw", "--items", "1000", "--ebs", "1", "--duration", "5"])
                .args(out),
            "clients for 5 s",
            || {},
        );
        assert_eq!(code, Some(130));
    }
    assert!(!json.exists(), "the created --json is left");
    assert!(!svg.exists(), "the created --svg is left");
    assert_eq!(
        std::fs::read_to_string(&existing).unwrap(),
        "earlier results\n",
        "an existing --json must be left as it was"
    );
}

/// On memory-server processes, this process's shm sockets live in a directory of the
/// compute-node library's (`namdb-compute-PID-…`), outside the run's: a Ctrl-C left
/// it behind until a later run swept it.
#[test]
fn an_interrupted_run_on_memory_server_processes_leaves_no_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let ours = || {
        std::fs::read_dir(tmp.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            // The memory servers remove their own sockets as they end, after us.
            .filter(|name| !name.starts_with("namdb-memory-server-"))
            .collect::<Vec<_>>()
    };
    let code = interrupt_at_line(
        std::process::Command::new(env!("CARGO_BIN_EXE_namdb"))
            .args(["tpcw", "--backend", "shm", "--items", "1000", "--ebs", "1"])
            .args(["--duration", "20"])
            .env("TMPDIR", tmp.path()),
        "clients for 20 s",
        || {
            assert!(
                ours().iter().any(|n| n.starts_with("namdb-compute-")),
                "no sockets directory: {:?}",
                ours()
            )
        },
    );
    assert_eq!(code, Some(130));
    assert_eq!(ours(), Vec::<String>::new(), "left behind");
}

/// A run on memory-server processes that fails (here: one of them killed mid-run)
/// keeps its temporary directory, whose memory-server logs tell why a server failed,
/// and says where. Before, the directory went with the failed run, logs and all.
#[test]
fn a_failed_run_on_memory_server_processes_keeps_their_logs_and_says_where() {
    use std::io::BufRead;
    use std::time::{Duration, Instant};
    let tmp = tempfile::tempdir().unwrap();
    let mut run = std::process::Command::new(env!("CARGO_BIN_EXE_namdb"))
        .env("TMPDIR", tmp.path())
        .env_remove("RUST_BACKTRACE")
        .args(["tpcw", "--backend", "shm", "--items", "1000", "--ebs", "1"])
        .args(["--duration", "3", "--warmup", "0"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(run.stderr.take().unwrap()).lines();
    let mut said = Vec::new();
    for line in lines.by_ref() {
        let line = line.unwrap();
        let measuring = line.contains("clients for 3 s");
        said.push(line);
        if measuring {
            break;
        }
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    let server = loop {
        let ours: Vec<u32> = processes_naming("memory-server")
            .into_iter()
            .filter(|&pid| parent_of(pid) == Some(run.id()))
            .collect();
        if let Some(&pid) = ours.first() {
            break pid;
        }
        assert!(Instant::now() < deadline, "no memory server: {said:?}");
        std::thread::sleep(Duration::from_millis(20));
    };
    common::kill_9_and_wait(server);
    said.extend(lines.map(Result::unwrap));
    let status = run.wait().unwrap();
    let said = said.join("\n");
    assert_eq!(status.code(), Some(1), "{said}");
    let kept = said
        .split_once("their data) are kept in ")
        .and_then(|(_, rest)| rest.split(' ').next())
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| panic!("no kept directory named: {said}"));
    assert!(kept.starts_with(tmp.path()), "{said}");
    let log = kept.join("shm").join("memory-server-1.log");
    assert!(
        std::fs::read_to_string(&log).is_ok_and(|l| l.contains("listening on")),
        "{}: {said}",
        log.display()
    );
}
