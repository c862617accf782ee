//! `namdb bench join` as a user runs it: every join on the sim backend (threads) and
//! on shm (node processes), DuckDB on the same data, the JSON and SVG outputs, and the
//! errors bad arguments give. Small fragments, so the file stays short on two cores.

use serde_json::Value;

mod common;

use common::{namdb_here as namdb, text};

const ROW_FIELDS: [&str; 12] = [
    "join",
    "selectivity",
    "runtime_ms",
    "tuples_per_sec",
    "predicted_ms",
    "partition_ms",
    "local_join_ms",
    "s_sent",
    "rows",
    "r_sum",
    "s_sum",
    "verified",
];

/// Runs the bench with `extra` arguments and returns its report.
fn bench(extra: &[&str], nodes: u64, r: u64, s: u64) -> (Value, String, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("temp dir");
    let json = dir.path().join("join.json");
    let svg = dir.path().join("svg");
    let (nodes_s, r_s, s_s) = (nodes.to_string(), r.to_string(), s.to_string());
    let mut argv = vec![
        "bench",
        "join",
        "--nodes",
        &nodes_s,
        "--r-tuples",
        &r_s,
        "--s-tuples",
        &s_s,
        "--repeat",
        "1",
        "--json",
        json.to_str().unwrap(),
        "--svg",
        svg.to_str().unwrap(),
    ];
    argv.extend_from_slice(extra);
    let out = namdb(&argv);
    assert!(out.status.success(), "{}", text(&out));
    let report: Value =
        serde_json::from_str(&std::fs::read_to_string(&json).expect("JSON written")).unwrap();
    (report, text(&out), dir)
}

#[test]
fn every_join_agrees_with_duckdb_on_the_sim_backend() {
    let (report, out, dir) = bench(
        &[
            "--backend",
            "sim",
            "--threads",
            "2",
            "--selectivity",
            "0.25,1.0",
        ],
        2,
        20_000,
        30_000,
    );
    let runs = report["runs"].as_array().unwrap();
    // Four joins and DuckDB at two selectivities.
    assert_eq!(runs.len(), 10, "{report}");
    for r in runs {
        for f in ROW_FIELDS {
            assert!(r.get(f).is_some(), "run lacks `{f}`: {r}");
        }
        assert_eq!(r["verified"], true, "{r}");
        assert!(r["runtime_ms"].as_f64().unwrap() > 0.0);
    }
    for sel in [0.25, 1.0] {
        let of: Vec<&Value> = runs
            .iter()
            .filter(|r| r["selectivity"].as_f64() == Some(sel))
            .collect();
        let duck = of
            .iter()
            .find(|r| r["join"] == "duckdb")
            .expect("DuckDB ran");
        let rows = duck["rows"].as_u64().unwrap();
        // About `sel` of the 60 000 S tuples find their partner.
        let want = sel * 60_000.0;
        assert!(
            (rows as f64 - want).abs() < 0.05 * 60_000.0,
            "{sel}: {rows}"
        );
        for r in &of {
            assert_eq!(r["rows"], duck["rows"], "{r}");
            assert_eq!(r["r_sum"], duck["r_sum"], "{r}");
            assert_eq!(r["s_sum"], duck["s_sum"], "{r}");
            if r["join"] != "duckdb" {
                assert!(r["predicted_ms"].as_f64().unwrap() > 0.0, "{r}");
            }
        }
        let bloom = of.iter().find(|r| r["join"] == "ghj-bloom").unwrap();
        let ghj = of.iter().find(|r| r["join"] == "ghj").unwrap();
        assert_eq!(ghj["s_sent"], 60_000);
        if sel < 0.5 {
            assert!(bloom["s_sent"].as_u64().unwrap() < 30_000, "{bloom}");
        }
    }
    assert!(report["cost"]["c_mem"].as_f64().unwrap() > 0.0);
    assert_eq!(report["rrj_over_ghj"].as_array().unwrap().len(), 2);
    assert_eq!(report["best_over_duckdb"].as_array().unwrap().len(), 2);
    assert!(out.contains("radix join vs GHJ"), "{out}");
    assert!(out.contains("best distributed join vs DuckDB"), "{out}");
    let svg = std::fs::read_to_string(dir.path().join("svg/join-runtime.svg")).unwrap();
    assert!(svg.contains("rrj") && svg.contains("duckdb"));
    assert!(dir.path().join("svg/join-model.svg").exists());
}

/// Node processes, with split threads (as on the sim) and with threads that each both
/// send and receive: the same rows either way.
#[test]
fn node_processes_on_shm_join_too() {
    let mut rows = Vec::new();
    for threading in ["split", "interleaved"] {
        let (report, out, _dir) = bench(
            &[
                "--backend",
                "shm",
                "--joins",
                "ghj-bloom,rrj",
                "--selectivity",
                "0.5",
                "--no-duckdb",
                "--threading",
                threading,
            ],
            3,
            5_000,
            5_000,
        );
        assert_eq!(report["threading"], threading);
        assert!(out.contains(&format!("thread(s) {threading},")), "{out}");
        let runs = report["runs"].as_array().unwrap();
        assert_eq!(runs.len(), 2);
        assert_eq!(runs[0]["rows"], runs[1]["rows"]);
        assert!(runs.iter().all(|r| r["verified"] == true));
        assert!(runs[0]["rows"].as_u64().unwrap() > 5_000);
        rows.push(runs[0]["rows"].clone());
    }
    assert_eq!(rows[0], rows[1]);
}

#[test]
fn bad_arguments_are_clear_errors() {
    for (args, expect) in [
        (vec!["--joins", "nope"], "unknown join"),
        (vec!["--joins", "all,nope"], "unknown join \"nope\""),
        (
            vec!["--r-tuples", "10", "--s-tuples", "2147483648"],
            "use at most about",
        ),
        (vec!["--selectivity", "1.5"], "not within"),
        (vec!["--nodes", "0"], "0"),
    ] {
        let mut argv = vec!["bench", "join", "--no-duckdb"];
        argv.extend_from_slice(&args);
        let out = namdb(&argv);
        assert!(!out.status.success());
        assert!(text(&out).contains(expect), "{args:?}: {}", text(&out));
    }
}

/// A selectivity given twice was merged twice into its summary, which then disagreed
/// with DuckDB; later it silently ran once. A join given twice ran once. Both are
/// refused (status 1, as the other bad lists), naming the flag and the entry.
#[test]
fn a_selectivity_or_join_listed_twice_is_refused() {
    for (args, want) in [
        (
            vec!["--selectivity", "0.25,1.0,0.250"],
            "--selectivity lists 0.25 twice",
        ),
        (vec!["--joins", "rrj,ghj,RRJ"], "--joins lists RRJ twice"),
    ] {
        let mut argv = vec![
            "bench",
            "join",
            "--no-duckdb",
            "--repeat",
            "1",
            "--r-tuples",
            "100",
            "--s-tuples",
            "100",
        ];
        argv.extend_from_slice(&args);
        let out = namdb(&argv);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {}", text(&out));
        assert!(text(&out).contains(want), "{args:?}: {}", text(&out));
    }
}

/// A run showed nothing between its header and its first result, minutes of silence
/// on large fragments. The nodes now report the run they are at, its phase and the
/// tuples it went through, and the benchmark prints a line of the node furthest behind
/// every `--progress-ms` (hidden; a second by default) on stderr.
#[test]
fn a_long_run_shows_its_progress_before_its_result() {
    let out = namdb(&[
        "bench",
        "join",
        "--backend",
        "shm",
        "--nodes",
        "2",
        "--r-tuples",
        "400000",
        "--s-tuples",
        "400000",
        "--selectivity",
        "0.5",
        "--joins",
        "ghj",
        "--repeat",
        "2",
        "--no-duckdb",
        "--progress-ms",
        "20",
    ]);
    let all = text(&out);
    assert!(out.status.success(), "{all}");
    let stderr = common::stderr(&out);
    let progress = common::progress_between(
        &stderr,
        |l| l.contains("join(s) ×"),
        |l| l.trim_start().starts_with("ghj ") && l.contains(" ms (model "),
    );
    assert!(!progress.is_empty(), "no progress line: {stderr}");
    // The nodes' counts crossed the process boundary while the joins ran.
    let counted = |phase: &str| {
        progress.iter().any(|l| {
            l.contains("ghj at selectivity 0.5, run ")
                && l.contains(&format!("{phase}: "))
                && l.contains(" tuples (")
                && !l.contains(&format!("{phase}: 0 of"))
        })
    };
    assert!(
        ["shuffling", "building", "probing"]
            .iter()
            .any(|p| counted(p)),
        "no line of a join's phase with a count: {stderr}"
    );
}
