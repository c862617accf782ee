//! `namdb bench aggregate` as a user runs it: small data on the sim backend (threads)
//! and on shm (node processes), every algorithm next to DuckDB (from PyPI, in the venv
//! `scripts/duckdb.sh` makes), the JSON and SVG outputs, and the errors bad arguments
//! give.

mod common;

use common::{namdb_here as namdb, text};
use serde_json::Value;
use std::path::{Path, PathBuf};

const ALGORITHMS: [&str; 6] = [
    "two-phase",
    "repartitioning",
    "adaptive-two-phase",
    "adaptive-repartitioning",
    "sampling",
    "rdma-agg",
];

#[test]
fn every_algorithm_and_duckdb_agree_and_the_adaptive_ones_switch() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("agg.json");
    let svg = dir.path().join("svg");
    let out = namdb(&[
        "bench",
        "aggregate",
        "--backend",
        "sim",
        "--nodes",
        "2",
        "--threads",
        "2",
        "--tuples",
        "4000",
        "--groups",
        "1,100,6000",
        "--local-groups",
        "64",
        "--cache-groups",
        "32",
        "--repeat",
        "1",
        "--duckdb-threads",
        "1",
        "--json",
        json.to_str().unwrap(),
        "--svg",
        svg.to_str().unwrap(),
        "--no-pin",
    ]);
    assert!(out.status.success(), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("than DuckDB ("), "{stdout}");
    assert!(stdout.contains("nodes not pinned"), "{stdout}");
    let report: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(report["pinned"], false);
    assert_eq!(report["nodes"], 2);
    assert_eq!(report["local_groups"], 64);
    assert!(report["duckdb_version"].is_string(), "{report}");
    let rows = report["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 3 * (ALGORITHMS.len() + 1));
    let row = |algorithm: &str, groups: u64| -> &Value {
        rows.iter()
            .find(|r| r["algorithm"] == algorithm && r["groups"] == groups)
            .unwrap_or_else(|| panic!("no row for {algorithm} at {groups} groups"))
    };
    for groups in [1u64, 100, 6000] {
        for a in ALGORITHMS.iter().chain(&["duckdb"]) {
            let r = row(a, groups);
            assert_eq!(r["verified"], true, "{r}");
            assert!(r["runtime_ms"].as_f64().unwrap() > 0.0, "{r}");
            assert!(r["tuples_per_sec"].as_f64().unwrap() > 0.0, "{r}");
            assert_eq!(r["tuples"], 8000, "{r}");
            // Uniform keys over 8000 tuples: every group of 1 and 100 occurs.
            if groups <= 100 {
                assert_eq!(r["result_groups"], groups, "{r}");
            }
        }
        // Every tuple either went raw or was folded into a shipped partial.
        assert_eq!(row("repartitioning", groups)["raw_tuples_sent"], 8000);
        assert_eq!(row("two-phase", groups)["raw_tuples_sent"], 0);
    }
    let strategies = |a: &str, g: u64| row(a, g)["strategies"].clone();
    // Few groups: Adaptive Repartitioning switches to local aggregation, the sampling
    // choice picks Two Phase; many groups (6000 against a budget of 64 per worker):
    // Adaptive Two Phase switches to repartitioning, sampling picks Repartitioning.
    assert_eq!(
        strategies("adaptive-repartitioning", 1)["repartitioning→two-phase"],
        4
    );
    assert_eq!(strategies("sampling", 1)["two-phase"], 4);
    assert_eq!(strategies("adaptive-two-phase", 1)["two-phase"], 4);
    assert_eq!(
        strategies("adaptive-two-phase", 6000)["two-phase→repartitioning"],
        4
    );
    assert_eq!(strategies("sampling", 6000)["repartitioning"], 4);
    // A sample of 256 tuples shows 62.8 groups when there are exactly 64 (the
    // threshold); counting stops there.
    assert_eq!(row("sampling", 6000)["sampled_groups"], 63);
    assert!(row("sampling", 1)["sampled_groups"] == 1);
    let summary = report["summary"].as_array().unwrap();
    assert_eq!(summary.len(), 3);
    for s in summary {
        assert!(s["best_speedup_vs_duckdb"].as_f64().unwrap() > 0.0, "{s}");
        assert_eq!(
            s["adaptive_vs_best_fixed_pct"].as_object().unwrap().len(),
            3,
            "{s}"
        );
    }
    let svg = std::fs::read_to_string(svg.join("aggregate_runtime.svg")).unwrap();
    assert!(svg.contains("adaptive-two-phase") && svg.contains("duckdb"));
}

#[test]
fn node_processes_on_shm_aggregate_too() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("agg.json");
    let out = namdb(&[
        "bench",
        "aggregate",
        "--backend",
        "shm",
        "--nodes",
        "3",
        "--tuples",
        "3000",
        "--groups",
        "1,5000",
        "--local-groups",
        "64",
        "--cache-groups",
        "32",
        "--repeat",
        "2",
        "--duckdb-threads",
        "1",
        "--threading",
        "interleaved",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("backend shm, 3 nodes"), "{stdout}");
    // Workers that also receive (the sim test runs them split).
    assert!(stdout.contains("worker thread(s) interleaved"), "{stdout}");
    assert!(
        stdout.contains("nodes pinned to their own cores"),
        "{stdout}"
    );
    let report: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(report["pinned"], true);
    assert_eq!(report["threading"], "interleaved");
    assert_eq!(report["backend"], "shm");
    assert_eq!(report["nodes"], 3);
    let rows = report["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 2 * (ALGORITHMS.len() + 1));
    let row = |algorithm: &str, groups: u64| -> &Value {
        rows.iter()
            .find(|r| r["algorithm"] == algorithm && r["groups"] == groups)
            .unwrap_or_else(|| panic!("no row for {algorithm} at {groups} groups"))
    };
    for groups in [1u64, 5000] {
        for a in ALGORITHMS {
            let r = row(a, groups);
            assert_eq!(r["verified"], true, "{r}");
            assert_eq!(r["backend"], "shm", "{r}");
            assert_eq!(r["nodes"], 3, "{r}");
            assert_eq!(r["tuples"], 9000, "{r}");
            assert_eq!(r["runs_ms"].as_array().unwrap().len(), 2, "{r}");
            assert!(r["runtime_ms"].as_f64().unwrap() > 0.0, "{r}");
            // One worker on each of the three nodes.
            let workers: u64 = r["strategies"]
                .as_object()
                .unwrap()
                .values()
                .map(|n| n.as_u64().unwrap())
                .sum();
            assert_eq!(workers, 3, "{r}");
        }
        assert_eq!(row("duckdb", groups)["verified"], true);
        assert_eq!(row("repartitioning", groups)["raw_tuples_sent"], 9000);
        assert_eq!(row("two-phase", groups)["raw_tuples_sent"], 0);
    }
    assert_eq!(row("two-phase", 1)["result_groups"], 1);
    assert_eq!(
        row("duckdb", 5000)["result_groups"],
        row("rdma-agg", 5000)["result_groups"]
    );
    assert_eq!(
        row("adaptive-repartitioning", 1)["strategies"]["repartitioning→two-phase"],
        3
    );
    assert_eq!(
        row("adaptive-two-phase", 5000)["strategies"]["two-phase→repartitioning"],
        3
    );
}

#[test]
fn bad_arguments_are_clear_errors() {
    for (args, want) in [
        (&["--nodes", "0"][..], "0 is not in 1..=64"),
        (&["--groups", "0"][..], "at least 1 group"),
        (&["--groups", "100000"][..], "exceed"),
        (&["--groups", "ten"][..], "not a number"),
        (&["--groups", "sweep,10"][..], "cannot be combined"),
        (
            &["--algorithms", "fastest"][..],
            "unknown aggregation algorithm",
        ),
        (&["--design", "XX/YY"][..], "unknown design"),
        (&["--local-groups", "0"][..], "--local-groups"),
        (&["--algorithms", "all,fastest"][..], "\"fastest\""),
        // Allocated whole: u64::MAX once spun for ever sizing the table.
        (
            &["--cache-groups", "18446744073709551615"][..],
            "--cache-groups",
        ),
        (&["--duckdb-threads", "0"][..], "--duckdb-threads"),
        (&["--crossover", "0"][..], "--crossover"),
        (
            &["--tuples", "4294967296", "--groups", "10"][..],
            "tuples per node",
        ),
    ] {
        let mut argv = vec!["bench", "aggregate", "--repeat", "1"];
        if !args.contains(&"--tuples") {
            argv.extend_from_slice(&["--tuples", "100"]);
        }
        argv.extend_from_slice(args);
        let out = namdb(&argv);
        assert!(!out.status.success(), "{args:?} succeeded");
        let t = text(&out);
        assert!(t.contains(want), "{args:?}: {t}");
    }
}

/// A group count or algorithm listed twice ran once, silently: refused (status 1, as
/// the other bad lists), naming the flag and the entry, however it was spelt.
#[test]
fn a_group_count_or_algorithm_listed_twice_is_refused() {
    for (args, want) in [
        (&["--groups", "10,1_0"][..], "--groups lists 10 twice"),
        (
            &["--groups", "sweep,sweep"][..],
            "--groups lists sweep twice",
        ),
        (
            &["--algorithms", "sampling,two-phase,sampling"][..],
            "--algorithms lists sampling twice",
        ),
    ] {
        let mut argv = vec!["bench", "aggregate", "--repeat", "1", "--tuples", "100"];
        argv.extend_from_slice(args);
        let out = namdb(&argv);
        let t = text(&out);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {t}");
        assert!(t.contains(want), "{args:?}: {t}");
    }
}

/// The directory for DuckDB's column files (the whole data set) is made before the
/// runs; a Ctrl-C used to leave it behind, as a hidden `.tmpXXXXXX`.
#[test]
fn an_interrupted_run_leaves_no_temporary_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let entries = || {
        std::fs::read_dir(tmp.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect::<Vec<_>>()
    };
    let code = common::interrupt_at_line(
        std::process::Command::new(env!("CARGO_BIN_EXE_namdb"))
            .args([
                "bench",
                "aggregate",
                "--tuples",
                "4000000",
                "--groups",
                "10",
            ])
            .args(["--repeat", "5"])
            .env("TMPDIR", tmp.path()),
        "generating",
        || {
            assert!(
                !entries().is_empty(),
                "no directory was made before the runs"
            )
        },
    );
    assert_eq!(code, Some(130));
    assert_eq!(entries(), Vec::<std::ffi::OsString>::new(), "left behind");
}

/// `kill -INT` of the benchmark alone (not the terminal's Ctrl-C, which signals the
/// whole process group) used to leave the DuckDB peer running until its query ended.
/// The peer here is a stand-in script (`NAMDB_DUCKDB_SCRIPT`) that, as
/// `scripts/duckdb.sh` does, execs a long-running process, so that it would outlive
/// the test unless killed with its parent.
#[test]
fn the_duckdb_peer_dies_with_an_interrupted_run() {
    use std::os::unix::fs::PermissionsExt;
    use std::time::Duration;
    let dir = tempfile::tempdir().unwrap();
    let marker = format!("namdb-test-duckdb-peer-{}", std::process::id());
    let script = dir.path().join("peer.sh");
    std::fs::write(
        &script,
        format!("#!/usr/bin/env bash\nexec -a {marker} sleep 600\n"),
    )
    .unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_namdb"))
        .args(["bench", "aggregate", "--tuples", "1000", "--groups", "10"])
        .args(["--algorithms", "two-phase", "--repeat", "1"])
        .env("NAMDB_DUCKDB_SCRIPT", &script)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut peer = None;
    common::wait_while_running(&mut child, Duration::from_secs(120), "DuckDB peer", || {
        peer = common::processes_naming(&marker).first().copied();
        peer.is_some()
    });
    let peer = peer.unwrap();
    assert_eq!(
        common::parent_of(peer),
        Some(child.id()),
        "not the run's child"
    );
    assert_eq!(common::interrupt(&mut child), Some(130));
    common::assert_ended(&[peer], Duration::from_secs(30), "the DuckDB peer");
}

/// The DuckDB script used to be found in the source tree the binary was built from,
/// and its venv in that tree's `target/`. Both come from the binary now and namdb's
/// cache directory: run from a directory with no repository around, the peer uses the
/// venv of the cache directory (`NAMDB_CACHE_DIR` here: a stand-in whose python
/// leaves a mark and runs the tests' venv; or, with no venv yet, one the run makes
/// there) and leaves nothing in its current directory.
#[test]
fn the_duckdb_peer_runs_from_anywhere_with_the_venv_of_the_cache_directory() {
    use std::os::unix::fs::PermissionsExt;
    let home = std::env::var_os("HOME").map(PathBuf::from);
    let venv = std::env::var_os("NAMDB_DUCKDB_VENV")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("NAMDB_CACHE_DIR").map(|d| Path::new(&d).join("duckdb-venv")))
        .or_else(|| {
            std::env::var_os("XDG_CACHE_HOME")
                .map(PathBuf::from)
                .or_else(|| home.map(|h| h.join(".cache")))
                .map(|c| c.join("namdb/duckdb-venv"))
        })
        .expect("HOME is set");
    let tmp = tempfile::tempdir().unwrap();
    let (cwd, cache, scratch) = (
        tmp.path().join("cwd"),
        tmp.path().join("cache"),
        tmp.path().join("tmp"),
    );
    for dir in [&cwd, &cache, &scratch] {
        std::fs::create_dir(dir).unwrap();
    }
    let used = cache.join("duckdb-venv/used");
    // Without a venv yet, the run makes one in the cache directory.
    if venv.join("bin/python").exists() {
        let python = cache.join("duckdb-venv/bin/python");
        std::fs::create_dir_all(python.parent().unwrap()).unwrap();
        std::fs::write(
            &python,
            format!(
                "#!/bin/sh\ntouch '{}'\nexec '{}' \"$@\"\n",
                used.display(),
                venv.join("bin/python").display()
            ),
        )
        .unwrap();
        std::fs::set_permissions(&python, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_namdb"))
        .args(["bench", "aggregate", "--tuples", "1000", "--groups", "10"])
        .args(["--algorithms", "two-phase", "--repeat", "1"])
        .current_dir(&cwd)
        .env("NAMDB_CACHE_DIR", &cache)
        .env("TMPDIR", &scratch)
        .env_remove("NAMDB_DUCKDB_VENV")
        .env_remove("NAMDB_DUCKDB_SCRIPT")
        .output()
        .unwrap();
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    assert!(t.contains("duckdb"), "{t}");
    if venv.join("bin/python").exists() {
        assert!(used.exists(), "the venv of the cache directory went unused");
    } else {
        assert!(
            cache.join("duckdb-venv/bin/python").exists(),
            "no venv was made in the cache directory"
        );
    }
    assert_eq!(
        std::fs::read_dir(&cwd).unwrap().count(),
        0,
        "left in its cwd"
    );
    assert_eq!(
        std::fs::read_dir(&scratch).unwrap().count(),
        0,
        "left in TMPDIR"
    );
}

/// Two runs started together on a machine without the DuckDB venv (the unit tests of
/// `namdb` do that) each ran `python3 -m venv` on the same directory, and one failed on
/// the other's half-made tree ("File exists"). Now one makes it while the other waits.
/// Here `python3` is a stand-in on PATH whose venv takes 2 s to make, fails on a
/// directory that exists (as a half-made one did), and whose pip "installs" by leaving a
/// mark its python checks for.
#[test]
fn installs_started_together_make_the_duckdb_venv_once() {
    use std::os::unix::fs::PermissionsExt;
    let tmp = tempfile::tempdir().unwrap();
    let bin = tmp.path().join("bin");
    std::fs::create_dir(&bin).unwrap();
    let made = tmp.path().join("made");
    let python3 = bin.join("python3");
    std::fs::write(
        &python3,
        r#"#!/usr/bin/env bash
[[ $1 == -m && $2 == venv ]] || exit 9
mkdir "$3" || exit 1
echo "$3" >> "$MADE"
sleep 2
mkdir "$3/bin"
printf '#!/usr/bin/env bash\n[[ -e "$(dirname "$0")/installed" ]]\n' > "$3/bin/python"
printf '#!/usr/bin/env bash\ntouch "$(dirname "$0")/installed"\n' > "$3/bin/pip"
chmod +x "$3/bin/python" "$3/bin/pip"
"#,
    )
    .unwrap();
    std::fs::set_permissions(&python3, std::fs::Permissions::from_mode(0o755)).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/duckdb.sh");
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let venv = tmp.path().join("cache/duckdb-venv");
    let installs: Vec<_> = (0..2)
        .map(|_| {
            std::process::Command::new("bash")
                .arg(&script)
                .arg("install")
                .env("PATH", &path)
                .env("MADE", &made)
                .env("NAMDB_DUCKDB_VENV", &venv)
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for install in installs {
        let out = install.wait_with_output().unwrap();
        assert!(out.status.success(), "{}", text(&out));
    }
    assert_eq!(
        std::fs::read_to_string(&made).unwrap().lines().count(),
        1,
        "the venv was made more than once"
    );
    let check = std::process::Command::new("bash")
        .arg(&script)
        .arg("check")
        .env("NAMDB_DUCKDB_VENV", &venv)
        .status()
        .unwrap();
    assert!(check.success(), "the venv made is not usable");
}

/// A run showed nothing between a group count's header and its results, minutes of
/// silence on large fragments. The nodes now report the run they are at, its phase and
/// the tuples their workers went through, and the benchmark prints a line of the node
/// furthest behind every `--progress-ms` (hidden; a second by default) on stderr.
#[test]
fn a_long_run_shows_its_progress_before_its_result() {
    let out = namdb(&[
        "bench",
        "aggregate",
        "--backend",
        "shm",
        "--nodes",
        "2",
        "--tuples",
        "1000000",
        "--groups",
        "1000",
        "--algorithms",
        "repartitioning",
        "--repeat",
        "1",
        "--duckdb-threads",
        "1",
        "--progress-ms",
        "20",
    ]);
    assert!(out.status.success(), "{}", text(&out));
    let stderr = common::stderr(&out);
    let progress = common::progress_between(
        &stderr,
        |l| l.starts_with("[1/1] 1000 groups"),
        |l| l.trim_start().starts_with("repartitioning ") && l.contains(" ms "),
    );
    assert!(!progress.is_empty(), "no progress line: {stderr}");
    // The workers' counts crossed the process boundary while they ran.
    assert!(
        progress
            .iter()
            .any(|l| l.contains("repartitioning, run 1 of 1: aggregating: ")
                && l.contains(" of 1.0 M tuples (")
                && !l.contains("aggregating: 0.0 M")),
        "no line of tuples aggregated: {stderr}"
    );
}
