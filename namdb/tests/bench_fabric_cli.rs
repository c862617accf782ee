//! `namdb bench fabric` as a user runs it: the built binary, its exit status, its
//! JSON output and its error messages.

mod common;

use serde_json::Value;
use std::path::PathBuf;
use std::process::{Command, Output};

fn namdb(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_namdb"))
        .args(args)
        .output()
        .expect("the namdb binary runs")
}

/// A path in the temp directory no other test (or concurrent run) uses.
fn temp_path(name: &str) -> PathBuf {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    std::env::temp_dir().join(format!("namdb-{name}-{}-{nanos}.json", std::process::id()))
}

/// Runs `namdb bench fabric ARGS --json TMP`, asserts it succeeded, and returns its
/// output and the JSON rows it wrote.
fn bench_rows(name: &str, args: &[&str]) -> (Output, Vec<Value>) {
    let path = temp_path(name);
    let mut argv = vec!["bench", "fabric"];
    argv.extend_from_slice(args);
    argv.extend_from_slice(&["--json", path.to_str().expect("temp path is UTF-8")]);
    let out = namdb(&argv);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "namdb failed: {stderr}");
    let text = std::fs::read_to_string(&path).expect("JSON file written");
    let _ = std::fs::remove_file(&path);
    let rows: Vec<Value> = serde_json::from_str(&text).expect("JSON is a list");
    (out, rows)
}

#[test]
fn short_run_writes_every_row_to_json() {
    let (out, rows) = bench_rows(
        "bench-fabric",
        &["--backend", "sim", "--duration-ms", "20", "--threads", "1"],
    );

    let fields = [
        "backend",
        "op",
        "bytes",
        "threads",
        "ops_per_sec",
        "gb_per_sec",
        "p50_ns",
        "p99_ns",
    ];
    for row in &rows {
        for f in fields {
            assert!(row.get(f).is_some(), "row lacks `{f}`: {row}");
        }
        let ops = row["ops_per_sec"]
            .as_f64()
            .expect("ops_per_sec is a number");
        let gbs = row["gb_per_sec"].as_f64().expect("gb_per_sec is a number");
        let p50 = row["p50_ns"].as_u64().expect("p50_ns is an integer");
        let p99 = row["p99_ns"].as_u64().expect("p99_ns is an integer");
        assert!(ops > 0.0 && gbs > 0.0, "no throughput: {row}");
        assert!(p99 >= p50 && p50 > 0, "bad percentiles: {row}");
    }

    let expected = [
        ("read", 64),
        ("read", 4096),
        ("read", 65536),
        ("write", 64),
        ("write", 4096),
        ("write", 65536),
        ("cas", 8),
        ("fetch_add", 8),
        ("send_recv", 4096),
    ];
    for (op, bytes) in expected {
        let found = rows.iter().filter(|r| {
            r["op"] == op && r["bytes"] == bytes && r["threads"] == 1 && r["backend"] == "sim"
        });
        assert_eq!(
            found.count(),
            1,
            "expected one {op} {bytes} B row in {rows:?}"
        );
    }
    let memcpy: Vec<_> = rows.iter().filter(|r| r["op"] == "memcpy").collect();
    assert_eq!(memcpy.len(), 1, "expected one memcpy row in {rows:?}");
    assert_eq!(memcpy[0]["threads"], 1);
    assert_eq!(
        rows.len(),
        expected.len() + 1,
        "unexpected rows in {rows:?}"
    );

    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("memcpy reference"), "{stdout}");
}

#[test]
fn unknown_cost_model_fails_with_the_choices() {
    let out = namdb(&["bench", "fabric", "--cost", "nosuch"]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("nosuch") && stderr.contains("fdr4x") && stderr.contains("edr4x"),
        "unclear message: {stderr}"
    );
}

#[test]
fn unwritable_json_path_fails_before_measuring() {
    let dir = temp_path("no-such-dir");
    let path = dir.join("out.json");
    let path_arg = path.to_str().expect("temp path is UTF-8");
    let out = namdb(&["bench", "fabric", "--json", path_arg]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("JSON output file") && stderr.contains(path_arg),
        "unclear message: {stderr}"
    );
    // Nothing was measured: the run stopped at the bad path.
    assert!(!stderr.contains("thread(s)…"), "{stderr}");
}

#[test]
fn tcp_backend_runs_over_loopback() {
    let (out, rows) = bench_rows(
        "bench-fabric-tcp",
        &[
            "--backend",
            "tcp",
            "--duration-ms",
            "20",
            "--threads",
            "1",
            "--ops",
            "read,cas",
        ],
    );
    let tcp_rows: Vec<&Value> = rows.iter().filter(|r| r["backend"] == "tcp").collect();
    assert_eq!(tcp_rows.len(), 4, "read 64/4096/65536 and cas: {rows:?}");
    let sim_rows = rows.iter().filter(|r| r["backend"] == "sim").count();
    assert_eq!(
        sim_rows, 4,
        "the sim is measured next to tcp in the same run: {rows:?}"
    );
    assert!(
        tcp_rows
            .iter()
            .all(|r| r["ops_per_sec"].as_f64().unwrap_or(0.0) > 0.0)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("300 k batched"),
        "tcp goals printed: {stdout}"
    );
    // Once, for tcp's row: not again for the sim's row beside it.
    assert_eq!(stdout.matches("300 k batched").count(), 1, "{stdout}");
}

#[test]
fn shm_backend_runs_with_sim_as_its_reference() {
    let (out, rows) = bench_rows(
        "bench-fabric-shm",
        &[
            "--backend",
            "shm",
            "--duration-ms",
            "20",
            "--threads",
            "1",
            "--ops",
            "read,send_recv",
        ],
    );
    for backend in ["shm", "sim"] {
        let of: Vec<&Value> = rows.iter().filter(|r| r["backend"] == backend).collect();
        assert_eq!(
            of.len(),
            4,
            "read 64/4096/65536 and send_recv on {backend}: {rows:?}"
        );
        assert!(
            of.iter()
                .all(|r| r["ops_per_sec"].as_f64().unwrap_or(0.0) > 0.0)
        );
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let goals = stdout
        .lines()
        .filter(|l| l.starts_with("goal shm within 2× of sim per operation"))
        .count();
    assert_eq!(goals, 4, "one ratio per shm row: {stdout}");
}

#[test]
fn a_cost_model_on_tcp_is_refused() {
    for backend in ["tcp", "shm"] {
        let out = namdb(&["bench", "fabric", "--backend", backend, "--cost", "fdr4x"]);
        assert!(!out.status.success());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains("sim") && stderr.contains(backend),
            "{stderr}"
        );
    }
}

#[test]
fn connect_measures_a_separately_started_memory_server() {
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    let out = namdb(&["token", "generate", token.to_str().unwrap()]);
    assert!(out.status.success());
    let server = common::start_server("tcp", &token);
    let (out, rows) = bench_rows(
        "bench-fabric-connect",
        &[
            "--backend",
            "tcp",
            "--connect",
            &server.control,
            "--token-file",
            token.to_str().unwrap(),
            "--duration-ms",
            "20",
            "--threads",
            "1",
        ],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("send_recv skipped"), "{stderr}");
    // read/write × 3 sizes, cas, fetch_add; and memcpy.
    assert_eq!(
        rows.iter().filter(|r| r["backend"] == "tcp").count(),
        8,
        "{rows:?}"
    );
    assert!(rows.iter().all(|r| r["op"] != "send_recv"));

    let wrong = namdb(&[
        "bench",
        "fabric",
        "--backend",
        "shm",
        "--connect",
        &server.control,
        "--token-file",
        token.to_str().unwrap(),
    ]);
    assert!(!wrong.status.success());
    assert!(String::from_utf8_lossy(&wrong.stderr).contains("serves the tcp backend"));

    // SEND/RECV alone leaves nothing a memory server can be measured on.
    let nothing = namdb(&[
        "bench",
        "fabric",
        "--backend",
        "tcp",
        "--connect",
        &server.control,
        "--token-file",
        token.to_str().unwrap(),
        "--ops",
        "send_recv",
    ]);
    assert!(!nothing.status.success());
    let said = String::from_utf8_lossy(&nothing.stderr);
    assert!(said.contains("nothing to measure"), "{said}");
}

/// The README tells users to measure a running server with `--connect`: the writes
/// must land in space no table uses, and every key must survive.
#[test]
fn connect_to_a_running_cluster_leaves_its_data_alone() {
    let c = common::Cluster::up(&[
        "--memory-servers",
        "2",
        "--compute-nodes",
        "1",
        "--backend",
        "tcp",
        "--size",
        "32MiB",
    ]);
    let cwd = c.cwd();
    let mut expected = String::new();
    for key in 1..=30 {
        let value = format!("value-{key}");
        common::ok(cwd, &["kv", "put", &key.to_string(), &value]);
        expected += &format!("{key}\t{value}\n");
    }
    assert_eq!(common::ok(cwd, &["kv", "scan"]), expected);
    let json = c.json();
    let token = json["token_file"].as_str().unwrap();
    let bench = |addr: &str, more: &[&str]| {
        let mut argv = vec![
            "bench",
            "fabric",
            "--backend",
            "tcp",
            "--connect",
            addr,
            "--token-file",
            token,
            "--duration-ms",
            "20",
        ];
        argv.extend_from_slice(more);
        common::namdb_here(&argv)
    };
    let writes = ["--threads", "2", "--ops", "write,cas,fetch_add"];
    for server in json["memory_servers"].as_array().unwrap() {
        let addr = server["address"].as_str().unwrap();
        let first = bench(addr, &writes);
        let said = common::stderr(&first);
        assert!(first.status.success(), "{said}");
        assert!(
            said.contains("region borrowed from the memory server"),
            "{said}"
        );
        // More than one session may hold: refused before anything is allocated.
        let big = bench(
            addr,
            &["--threads", "17", "--batch", "1024", "--ops", "write"],
        );
        assert!(!big.status.success());
        let said = common::stderr(&big);
        assert!(
            said.contains("lends no 1140850688 bytes") && said.contains("--ops read"),
            "{said}"
        );
    }
    assert_eq!(common::ok(cwd, &["kv", "scan"]), expected);
    for key in [1, 15, 30] {
        assert_eq!(
            common::ok(cwd, &["kv", "get", &key.to_string()]),
            format!("value-{key}\n")
        );
    }
    // Writes still work where the table lives.
    common::ok(cwd, &["kv", "put", "31", "later"]);
    assert_eq!(common::ok(cwd, &["kv", "get", "31"]), "later\n");
}

/// A bench killed with SIGKILL runs no code to give its space back: the memory server
/// frees the region it lent once the bench's session lease runs out, so kills one
/// after another never use the server's space up. (Before, the space came from the
/// data regions' allocation cursors and a killed bench kept it allocated for ever: on
/// this server the second run found no space left.)
#[test]
fn a_killed_connect_bench_leaves_no_space_behind() {
    use std::process::Stdio;
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    assert!(
        namdb(&["token", "generate", token.to_str().unwrap()])
            .status
            .success()
    );
    // The server lends room for one run's 512 KiB, not two.
    let mut server = common::ServerProcess::start(
        "tcp",
        &token,
        &[
            "--size",
            "768KiB",
            "--max-borrowed",
            "768KiB",
            "--session-lease",
            "2",
        ],
    );
    let secret = memory_server::ClusterToken::from_file(&token).unwrap();
    let control = memory_server::blocking::Client::connect(&server.control, &secret).unwrap();
    let addr = server.control.clone();
    let args = |ms: &str| {
        [
            "bench",
            "fabric",
            "--backend",
            "tcp",
            "--connect",
            &addr,
            "--token-file",
            token.to_str().unwrap(),
            "--ops",
            "write",
            "--threads",
            "1",
            "--batch",
            "8",
            "--duration-ms",
            ms,
        ]
        .map(String::from)
    };
    for run in 0..2 {
        let mut bench = Command::new(env!("CARGO_BIN_EXE_namdb"))
            .args(args("600000"))
            .env("RUST_BACKTRACE", "0")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // Killed once it measures, i.e. holds its space.
        let said = common::read_stderr_until(&mut bench, "write 64 B").join("\n");
        assert!(said.contains("region borrowed"), "run {run}: {said}");
        assert_eq!(control.stats().unwrap().session_region_bytes, 512 << 10);
        common::send_signal(bench.id(), "-9");
        bench.wait().unwrap();
        let freed = std::time::Instant::now();
        loop {
            let stats = control.stats().unwrap();
            if stats.session_region_bytes == 0 && stats.sessions == 1 {
                break;
            }
            assert!(
                freed.elapsed() < std::time::Duration::from_secs(30),
                "the server still holds the killed bench's space: {stats:?}"
            );
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        // The server says what the dead session kept until its lease ran out (logged
        // just after the session left the counts above, so it may come a little later).
        loop {
            let said = server.stderr();
            let expired = said
                .lines()
                .filter(|l| {
                    l.contains("session lease expired")
                        && l.contains("regions=1")
                        && l.contains("borrowed_bytes=524288")
                })
                .count();
            if expired == run + 1 {
                break;
            }
            assert!(
                freed.elapsed() < std::time::Duration::from_secs(60),
                "run {run}: no expiry line with what the session held: {said}"
            );
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
    }
    let last = common::namdb_here(&args("20").each_ref().map(String::as_str));
    assert!(last.status.success(), "{}", common::text(&last));
    assert_eq!(control.stats().unwrap().session_region_bytes, 0);
}

/// All clients together borrow at most the server's cap (`--max-borrowed`), and a run
/// refused by it says so and what to change.
#[test]
fn a_server_lends_no_more_than_its_cap() {
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    assert!(
        namdb(&["token", "generate", token.to_str().unwrap()])
            .status
            .success()
    );
    let server =
        common::ServerProcess::start("tcp", &token, &["--size", "4MiB", "--max-borrowed", "1MiB"]);
    let bench = |batch: &str| {
        namdb(&[
            "bench",
            "fabric",
            "--backend",
            "tcp",
            "--connect",
            &server.control,
            "--token-file",
            token.to_str().unwrap(),
            "--ops",
            "write",
            "--threads",
            "1",
            "--batch",
            batch,
            "--duration-ms",
            "20",
        ])
    };
    // 32 × 64 KiB: 2 MiB, which one session may borrow, but not this server.
    let refused = bench("32");
    assert!(!refused.status.success());
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(
        said.contains("lends no 2097152 bytes")
            && said.contains("past 1048576 bytes")
            && said.contains("--max-borrowed")
            && said.contains("smaller --batch"),
        "{said}"
    );
    let fits = bench("16");
    assert!(
        fits.status.success(),
        "{}",
        String::from_utf8_lossy(&fits.stderr)
    );
}

/// An operation listed twice was measured once, silently: the run was not the one
/// asked for. Refused as the other bad lists are (status 1), naming the flag and the
/// operation, however it was spelt.
#[test]
fn an_operation_listed_twice_is_refused() {
    for ops in [
        &["--ops", "read,cas,read"][..],
        &["--ops", "faa", "--ops", "fetch-add"],
    ] {
        let mut argv = vec!["bench", "fabric", "--duration-ms", "1"];
        argv.extend_from_slice(ops);
        let out = namdb(&argv);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{ops:?}: {stderr}");
        let twice = if ops[1].starts_with("read") {
            "read"
        } else {
            "fetch_add"
        };
        assert!(
            stderr.contains(&format!("--ops lists {twice} twice")),
            "{ops:?}: {stderr}"
        );
    }
}
