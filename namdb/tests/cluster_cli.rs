//! `namdb cluster` and `namdb kv` as a user runs them: a local cluster of processes
//! in a temporary directory, one transaction per `kv` command, the metrics endpoint,
//! and `cluster down`.

mod common;

use common::{
    Cluster, alive, kill_9_and_wait, namdb, ok, processes_naming, send_signal, stderr, stdout,
    stop_and_wait,
};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::Command;

/// The body of `GET /metrics` at `addr`.
fn scrape(addr: &str) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n")
        .unwrap();
    let mut response = String::new();
    s.read_to_string(&mut response).unwrap();
    assert!(response.starts_with("HTTP/1.1 200 OK"), "{response}");
    response
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_string())
        .unwrap()
}

/// The value of the sample line `name value` in an exposition.
fn sample(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
}

/// A cluster of one memory server with its backup (shm) and one compute node.
/// `cluster up` arguments: two tcp memory servers, each with a backup, all with data
/// directories under `data`.
const DURABLE_REPLICATED_TCP: [&str; 10] = [
    "--backend",
    "tcp",
    "--size",
    "16MiB",
    "--table-capacity",
    "1024",
    "--replicas",
    "2",
    "--data-dir",
    "data",
];

fn one_replicated_memory_server() -> Cluster {
    Cluster::up(&[
        "--memory-servers",
        "1",
        "--backend",
        "shm",
        "--size",
        "16MiB",
        "--table-capacity",
        "1024",
        "--replicas",
        "2",
    ])
}

#[test]
fn a_local_cluster_serves_kv_commands_and_metrics_and_comes_down() {
    let c = Cluster::up(&[
        "--memory-servers",
        "2",
        "--compute-nodes",
        "1",
        "--backend",
        "shm",
        "--size",
        "16MiB",
    ]);
    let cwd = c.cwd();
    let json = c.json();
    assert_eq!(json["backend"], "shm");
    assert_eq!(json["memory_servers"].as_array().unwrap().len(), 2);
    assert_eq!(json["compute_nodes"].as_array().unwrap().len(), 1);
    let pids = c.pids();
    assert!(pids.iter().all(|&p| alive(p)), "{pids:?}");
    let token = PathBuf::from(json["token_file"].as_str().unwrap());
    let mut running = processes_naming(&token);
    running.sort();
    let mut expected = pids.clone();
    expected.sort();
    assert_eq!(running, expected);

    ok(cwd, &["kv", "put", "7", "hello"]);
    ok(cwd, &["kv", "put", "9", "world"]);
    ok(cwd, &["kv", "put", "12", "later"]);
    assert_eq!(ok(cwd, &["kv", "get", "7"]), "hello\n");
    assert_eq!(ok(cwd, &["kv", "scan"]), "7\thello\n9\tworld\n12\tlater\n");
    assert_eq!(
        ok(cwd, &["kv", "scan", "--from", "8", "--to", "12"]),
        "9\tworld\n"
    );
    assert_eq!(ok(cwd, &["kv", "scan", "--limit", "1"]), "7\thello\n");
    // `--to` is exclusive, 0 included: an empty range, not "no bound".
    assert_eq!(ok(cwd, &["kv", "scan", "--to", "0"]), "");
    assert_eq!(ok(cwd, &["kv", "scan", "--from", "9", "--to", "9"]), "");
    ok(cwd, &["kv", "delete", "7"]);
    let missing = namdb(cwd, &["kv", "get", "7"]);
    assert_eq!(missing.status.code(), Some(1), "{}", stderr(&missing));
    assert!(
        stderr(&missing).contains("not found"),
        "{}",
        stderr(&missing)
    );
    // Bytes that are not text go in as hex and come out as hex; text with a newline
    // comes out as hex too, so that every row stays one line.
    ok(cwd, &["kv", "put", "20", "--hex", "0x00ff0a"]);
    assert_eq!(ok(cwd, &["kv", "get", "20"]), "0x00ff0a\n");
    ok(cwd, &["kv", "put", "21", "two\nlines"]);
    // Text that starts with 0x comes out as hex, told apart from the byte it spells.
    ok(cwd, &["kv", "put", "22", "0xff"]);
    ok(cwd, &["kv", "put", "23", "--hex", "ff"]);
    assert_eq!(
        ok(cwd, &["kv", "scan", "--from", "20"]),
        "20\t0x00ff0a\n21\t0x74776f0a6c696e6573\n22\t0x30786666\n23\t0xff\n"
    );
    // A failure is status 2, "not found" 1: a script tells them apart.
    let bad = namdb(cwd, &["kv", "put", "24", "--hex", "xyz"]);
    assert_eq!(bad.status.code(), Some(2), "{}", stderr(&bad));
    assert!(stderr(&bad).contains("is not hex"), "{}", stderr(&bad));
    // The file named explicitly, from elsewhere.
    let file = c.file();
    let elsewhere = tempfile::tempdir().unwrap();
    assert_eq!(
        ok(
            elsewhere.path(),
            &["kv", "get", "9", "--cluster", file.to_str().unwrap()]
        ),
        "world\n"
    );
    let unknown = namdb(cwd, &["kv", "get", "1", "--table", "nosuch"]);
    assert!(!unknown.status.success());
    assert!(stderr(&unknown).contains("nosuch"), "{}", stderr(&unknown));

    let status = ok(cwd, &["cluster", "status"]);
    assert_eq!(status.matches(" alive ").count(), 3, "{status}");

    let compute_metrics = json["compute_nodes"][0]["metrics"].as_str().unwrap();
    let text = scrape(compute_metrics);
    let commits = sample(&text, "namdb_commits_total").expect("a commit counter");
    assert!(commits >= 4.0, "{text}");
    assert!(
        // 7, 9, 12 and 20 to 23; the put of bad hex never left the command.
        sample(&text, "namdb_rpcs_total{method=\"Put\"}") == Some(7.0),
        "{text}"
    );
    assert!(
        sample(&text, "namdb_commit_latency_seconds_count").unwrap() >= commits,
        "{text}"
    );
    let memory_metrics = json["memory_servers"][0]["metrics"].as_str().unwrap();
    let text = scrape(memory_metrics);
    assert!(
        sample(&text, "namdb_memory_sessions").unwrap() >= 1.0,
        "{text}"
    );
    assert!(
        sample(&text, "namdb_memory_regions_bytes").unwrap() >= (16 << 20) as f64,
        "{text}"
    );

    let down = ok(cwd, &["cluster", "down"]);
    assert!(down.contains("cluster down"), "{down}");
    assert!(!c.file().exists());
    for pid in pids {
        assert!(!alive(pid), "process {pid} outlived `cluster down`");
    }
    let again = ok(cwd, &["cluster", "down"]);
    assert!(again.contains("no cluster to stop"), "{again}");
    // Nothing runs, so `status` fails, as for a process that died.
    let o = namdb(cwd, &["cluster", "status"]);
    assert_eq!(o.status.code(), Some(1), "{}", stdout(&o));
    assert!(stdout(&o).contains("no cluster"), "{}", stdout(&o));
}

/// clap quoted a rejected value whole, and so did the parsers beneath it: a
/// 10 000-character key came back as 10 000 characters. Every value is quoted as
/// client input is elsewhere (`txn::echo`: 64 characters, then its length).
#[test]
fn a_rejected_argument_is_quoted_only_in_part() {
    let long = "9".repeat(10_000);
    let shown = format!("{}… (10000 bytes)", "9".repeat(64));
    let with_value = |flag: &str| format!("{flag}={long}");
    let cases: Vec<Vec<String>> = vec![
        vec!["kv".into(), "get".into(), format!("{long}x")],
        vec![
            "kv".into(),
            "put".into(),
            "1".into(),
            "v".into(),
            format!("--{long}"),
        ],
        vec!["bench".into(), "shuffle".into(), with_value("--nodes")],
        vec![
            "bench".into(),
            "shuffle".into(),
            "--notify".into(),
            long.clone(),
        ],
        vec![
            "bench".into(),
            "shuffle".into(),
            "--design".into(),
            long.clone(),
        ],
        vec![long.clone()],
    ];
    for args in cases {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = common::namdb_here(&args);
        let err = stderr(&out);
        let name: Vec<String> = args.iter().map(|a| a.chars().take(20).collect()).collect();
        assert!(!out.status.success(), "{name:?} succeeded");
        assert!(err.len() < 1000, "{name:?}: {} bytes: {err}", err.len());
        assert!(err.contains(&shown[..40]), "{name:?}: {err}");
        assert!(!err.contains(&long[..65]), "{name:?}: {err}");
    }
}

#[test]
fn kv_without_a_cluster_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let o = namdb(dir.path(), &["kv", "get", "1"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("no cluster file"), "{}", stderr(&o));
}

#[test]
fn the_reserved_key_is_refused_as_the_usage_says() {
    // Refused before any cluster is looked for: the usage's range was 0 to u64::MAX,
    // and the compute node then refused u64::MAX once a transaction had begun.
    let dir = tempfile::tempdir().unwrap();
    let o = namdb(dir.path(), &["kv", "put", "18446744073709551615", "v"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains(
            "`18446744073709551615` is reserved (u64::MAX): keys are whole numbers from 0 to \
             18446744073709551614"
        ),
        "{}",
        stderr(&o)
    );
}

#[test]
fn a_scan_with_its_bounds_swapped_is_refused() {
    // It printed nothing and succeeded, as if the table had no key in the range.
    let dir = tempfile::tempdir().unwrap();
    let o = namdb(dir.path(), &["kv", "scan", "--from", "5", "--to", "1"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("--from 5 is above --to 1: the range holds no key"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn a_missing_token_file_is_not_told_to_be_generated_again() {
    // It said "create one with `namdb token generate FILE`", whose new token no
    // process of the cluster would accept.
    let c = Cluster::up(&[
        "--memory-servers",
        "1",
        "--backend",
        "shm",
        "--size",
        "16MiB",
        "--table-capacity",
        "1024",
    ]);
    let token = c.cwd().join("namdb-cluster/token");
    let aside = c.cwd().join("token.aside");
    std::fs::rename(&token, &aside).unwrap();
    let o = namdb(c.cwd(), &["kv", "get", "1"]);
    std::fs::rename(&aside, &token).unwrap();
    assert_eq!(o.status.code(), Some(2));
    let err = stderr(&o);
    assert!(
        err.contains("token file") && err.contains("does not exist (moved or removed?)"),
        "{err}"
    );
    assert!(!err.contains("token generate"), "{err}");
    assert_eq!(namdb(c.cwd(), &["kv", "get", "1"]).status.code(), Some(1));
}

#[test]
fn a_value_cap_the_compute_nodes_cannot_hold_is_refused_in_terms_of_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let o = namdb(
        dir.path(),
        &[
            "cluster",
            "up",
            "--memory-servers",
            "1",
            "--compute-nodes",
            "1",
            "--backend",
            "shm",
            "--value-cap",
            "20000",
        ],
    );
    let err = stderr(&o);
    assert!(!o.status.success(), "{err}");
    assert!(
        err.contains("--value-cap 20000 is too large: a compute node's transaction holds values of up to 16360 bytes"),
        "{err}"
    );
    assert!(!err.contains("scratch_bytes"), "{err}");
    // Refused before anything started.
    assert!(!dir.path().join("namdb-cluster").exists(), "{err}");
}

#[test]
fn a_cluster_on_tcp_with_two_compute_nodes_comes_up_and_down() {
    let c = Cluster::up(&[
        "--memory-servers",
        "1",
        "--compute-nodes",
        "2",
        "--backend",
        "tcp",
        "--size",
        "16MiB",
        "--table-capacity",
        "1024",
        "--data-dir",
        "data",
    ]);
    ok(c.cwd(), &["kv", "put", "1", "one"]);
    assert_eq!(ok(c.cwd(), &["kv", "get", "1"]), "one\n");
    // A stopped compute node still accepts connections but never answers: kv goes on
    // to the next one (it waited for its whole --timeout, then blamed the memory
    // servers).
    let first = c.json()["compute_nodes"][0]["pid"].as_u64().unwrap() as u32;
    stop_and_wait(first);
    let got = namdb(c.cwd(), &["kv", "--timeout", "20s", "get", "1"]);
    send_signal(first, "-CONT");
    assert!(got.status.success(), "{}", stderr(&got));
    assert_eq!(stdout(&got), "one\n");
    // A second `up` in the same directory refuses.
    let twice = namdb(c.cwd(), &["cluster", "up", "--backend", "tcp"]);
    assert!(!twice.status.success());
    assert!(stderr(&twice).contains("already"), "{}", stderr(&twice));
    let pids = c.pids();
    assert_eq!(pids.len(), 3);
    ok(c.cwd(), &["cluster", "down"]);
    assert!(pids.iter().all(|&p| !alive(p)), "{pids:?}");
    // --data-dir made the memory server durable in its own directory.
    let log = std::fs::read_to_string(c.cwd().join("namdb-cluster/memory-server-0.log")).unwrap();
    let data = c.cwd().join("data/memory-server-0");
    assert!(
        log.contains(&format!("data dir {} new (boot 1)", data.display())),
        "{log}"
    );
    assert!(data.join("meta").exists());
    // The durable cluster comes up again on its data, keeping the table `kv`.
    let again = namdb(
        c.cwd(),
        &[
            "cluster",
            "up",
            "--memory-servers",
            "1",
            "--backend",
            "tcp",
            "--size",
            "16MiB",
            "--table-capacity",
            "1024",
            "--value-cap",
            "512",
            "--data-dir",
            "data",
        ],
    );
    assert!(again.status.success(), "{}", stderr(&again));
    // Said after the processes, with the flag that changed nothing (it was taken
    // without a word, and the table then refused values over 256 bytes).
    let said = stdout(&again);
    let lines: Vec<&str> = said.lines().collect();
    assert!(lines[0].contains("listening on"), "{said}");
    assert!(
        said.contains(
            "table kv exists already (values up to 256 bytes, made for 1024 records); kept \
             with its data: --value-cap 512 applies to a new table only"
        ),
        "{said}"
    );
    assert_eq!(ok(c.cwd(), &["kv", "get", "1"]), "one\n");
    ok(c.cwd(), &["cluster", "down"]);
}

#[test]
fn an_interrupted_up_stops_the_processes_it_started() {
    // Ctrl-C, and the terminal closing.
    for signal in ["-INT", "-HUP"] {
        interrupt_up(signal);
    }
}

fn interrupt_up(signal: &str) {
    let dir = tempfile::tempdir().unwrap();
    let up = Command::new(env!("CARGO_BIN_EXE_namdb"))
        .current_dir(dir.path())
        .args(["cluster", "up", "--backend", "shm", "--size", "16MiB"])
        .args(["--memory-servers", "8"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Interrupted once the first memory server runs, with seven more to start.
    let log = dir.path().join("namdb-cluster/memory-server-0.log");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while !std::fs::read_to_string(&log).is_ok_and(|t| t.contains("listening on")) {
        assert!(
            std::time::Instant::now() < deadline,
            "no memory server came up"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    send_signal(up.id(), signal);
    let o = up.wait_with_output().unwrap();
    // The shell's status for the signal, as a command without a handler would end.
    let status = match signal {
        "-INT" => 130,
        "-HUP" => 129,
        other => panic!("no status known for {other}"),
    };
    assert_eq!(o.status.code(), Some(status), "{signal}: {}", stderr(&o));
    assert!(
        stderr(&o).contains("interrupted"),
        "{signal}: {}",
        stderr(&o)
    );
    let cluster_dir = dir.path().join("namdb-cluster");
    assert!(!cluster_dir.join("cluster.json").exists());
    let token = std::fs::canonicalize(cluster_dir.join("token")).unwrap();
    let left = processes_naming(&token);
    assert!(left.is_empty(), "{signal}: still running: {left:?}");
}

#[test]
fn a_process_that_cannot_start_is_named_with_its_log() {
    let dir = tempfile::tempdir().unwrap();
    // No memory server can keep its data in a file.
    let data = dir.path().join("data");
    std::fs::create_dir(&data).unwrap();
    std::fs::write(data.join("memory-server-0"), "not a directory").unwrap();
    let o = namdb(
        dir.path(),
        &[
            "cluster",
            "up",
            "--backend",
            "shm",
            "--size",
            "1MiB",
            "--data-dir",
            data.to_str().unwrap(),
        ],
    );
    assert!(!o.status.success());
    let said = stderr(&o);
    assert!(
        said.contains("memory-server-0") && said.contains("memory-server-0.log"),
        "{said}"
    );
    assert!(!dir.path().join("namdb-cluster/cluster.json").exists());
}

/// A size no memory server can serve is refused before anything starts (it used to be
/// refused by the first memory server, once started), and nothing is left behind.
#[test]
fn a_size_no_memory_server_serves_is_refused_before_anything_starts() {
    let dir = tempfile::tempdir().unwrap();
    for (size, why) in [("0", "at least 8 bytes"), ("1", "multiple of 8 bytes")] {
        let o = namdb(
            dir.path(),
            &["cluster", "up", "--backend", "shm", "--size", size],
        );
        assert!(!o.status.success());
        let said = stderr(&o);
        assert!(
            said.contains("--size") && said.contains(why) && !said.contains("memory-server-0"),
            "{size}: {said}"
        );
        assert!(
            !dir.path().join("namdb-cluster").exists(),
            "{size}: nothing is created"
        );
    }
}

#[test]
fn the_shell_runs_single_commands_and_explicit_transactions() {
    let c = Cluster::up(&[
        "--backend",
        "shm",
        "--size",
        "16MiB",
        "--table-capacity",
        "1024",
    ]);
    let mut shell = Command::new(env!("CARGO_BIN_EXE_namdb"))
        .current_dir(c.cwd())
        .arg("shell")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // A line that is not UTF-8 (the tenth) is that line's error; the rest runs.
    let script = b"put 1 a b\nget 1\nbegin\nput 2 x\nget 2\nabort\nget 2\n\
                  begin\nput 3 y\nput 4 \xff\xfe\nget nosuch\ncommit\n# a comment\nscan\n\
                  del 1\nget 1\nbegin\nput 5 z\n";
    shell.stdin.take().unwrap().write_all(script).unwrap();
    let o = shell.wait_with_output().unwrap();
    // A script with failed lines says which, and exits as a failed `kv` does.
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert_eq!(
        stdout(&o),
        "a b\nbegun\nx\naborted\nbegun\ncommitted\n1\ta b\n3\ty\nbegun\n\
         aborted the open transaction\n"
    );
    let said = stderr(&o);
    assert!(said.contains("not found: key 2"), "{said}");
    assert!(said.contains("`nosuch` is not a key"), "{said}");
    assert!(said.contains("line 10 is not UTF-8 text"), "{said}");
    assert!(said.contains("not found: key 1"), "{said}");
    assert!(
        said.ends_with("namdb shell: 2 lines failed (10, 11)\n"),
        "{said}"
    );
    // The open transaction at the end of input was aborted.
    let missing = namdb(c.cwd(), &["kv", "get", "5"]);
    assert_eq!(missing.status.code(), Some(1));

    // Puts refused for their size, over the table's value cap (256) or over the gRPC
    // message limit (4 MiB), leave the transaction open: the others commit.
    let mut shell = Command::new(env!("CARGO_BIN_EXE_namdb"))
        .current_dir(c.cwd())
        .arg("shell")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut script = b"begin\nput 20 first\nput 21 ".to_vec();
    script.extend(vec![b'v'; 300]);
    script.extend(b"\nput 22 ");
    script.extend(vec![b'w'; 5 << 20]);
    script.extend(b"\nput 23 last\ncommit\n");
    let mut stdin = shell.stdin.take().unwrap();
    let writer = std::thread::spawn(move || stdin.write_all(&script));
    let o = shell.wait_with_output().unwrap();
    writer.join().unwrap().unwrap();
    let said = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{said}");
    assert_eq!(stdout(&o), "begun\ncommitted\n", "{said}");
    assert!(
        said.contains("exceeds the table's value cap of 256 bytes"),
        "{said}"
    );
    assert!(said.contains("limit of 4194304 bytes (4 MiB)"), "{said}");
    assert!(!said.contains("has ended"), "{said}");
    assert!(
        said.ends_with("namdb shell: 2 lines failed (3, 4)\n"),
        "{said}"
    );
    for (key, value) in [("20", "first\n"), ("23", "last\n")] {
        let o = namdb(c.cwd(), &["kv", "get", key]);
        assert_eq!(stdout(&o), value, "{}", stderr(&o));
    }
}

#[test]
fn a_failure_after_the_processes_started_stops_them_all() {
    let dir = tempfile::tempdir().unwrap();
    // Every process starts, but the table does not fit in the memory servers.
    let o = namdb(
        dir.path(),
        &[
            "cluster",
            "up",
            "--backend",
            "shm",
            "--size",
            "16MiB",
            "--table-capacity",
            "100000000",
        ],
    );
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("cannot create the table kv"),
        "{}",
        stderr(&o)
    );
    let cluster_dir = dir.path().join("namdb-cluster");
    assert!(cluster_dir.join("compute-node-0.log").exists());
    assert!(!cluster_dir.join("cluster.json").exists());
    let token = std::fs::canonicalize(cluster_dir.join("token")).unwrap();
    let left = processes_naming(&token);
    assert!(left.is_empty(), "still running: {left:?}");
}

#[test]
fn bench_txn_runs_through_the_compute_nodes_of_a_cluster() {
    let c = Cluster::up(&["--backend", "shm", "--size", "16MiB"]);
    let file = c.file();
    let json = c.cwd().join("r.json");
    // What the run printed, on stdout and stderr.
    let bench = |workload: &str, value_size: &str, keys: &str| {
        let o = namdb(
            c.cwd(),
            &[
                "bench",
                "txn",
                "--cluster",
                file.to_str().unwrap(),
                "--workload",
                workload,
                "--value-size",
                value_size,
                "--threads",
                "2",
                "--coroutines",
                "2",
                "--keys",
                keys,
                "--duration",
                "0.5",
                "--json",
                json.to_str().unwrap(),
            ],
        );
        assert!(o.status.success(), "{}", stderr(&o));
        stdout(&o) + &stderr(&o)
    };
    let said = bench("bank", "8", "500");
    assert!(said.contains("grpc:shm"), "{said}");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(v["backend"], "grpc:shm");
    assert_eq!(v["workload"], "bank");
    assert_eq!(v["servers"], 2);
    assert_eq!(v["invariant_ok"], true);
    assert!(v["committed"].as_u64().unwrap() > 0, "{v}");
    assert!(v["oracle_reads_per_txn"].is_null(), "{v}");
    assert!(v["p99_us"].as_f64().unwrap() >= v["p50_us"].as_f64().unwrap());
    // ycsb has a table of its own: it runs after bank (whose 8-byte table it was
    // refused before, or with --value-size 8 wrote counters into the balances), and
    // bank then finds its balances as it left them.
    let said = bench("ycsb", "16", "200");
    assert!(!said.contains("using the existing table"), "{said}");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(v["workload"], "ycsb");
    assert!(v["committed"].as_u64().unwrap() > 0, "{v}");
    // The table exists now: a second run uses it.
    let said = bench("bank", "8", "500");
    assert!(
        said.contains("using the existing table bench_bank"),
        "{said}"
    );
    // A table without all the keys (an interrupted load, or fewer --keys) gets the
    // missing ones, and the bank's total holds over them.
    let said = bench("bank", "8", "600");
    assert!(said.contains("loading the missing keys"), "{said}");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(v["invariant_ok"], true, "{v}");
    let o = namdb(
        c.cwd(),
        &[
            "bench",
            "txn",
            "--cluster",
            file.to_str().unwrap(),
            "--workload",
            "bank",
            "--keys",
            "5000",
        ],
    );
    assert!(!o.status.success());
    assert!(stderr(&o).contains("room for 626 keys"), "{}", stderr(&o));
    // A ycsb run whose values do not fit the table is refused, naming the size to use.
    let o = namdb(
        c.cwd(),
        &[
            "bench",
            "txn",
            "--cluster",
            file.to_str().unwrap(),
            "--value-size",
            "32",
            "--keys",
            "200",
        ],
    );
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains(
            "table bench exists with values of 16 bytes, not the 32 of --value-size: use \
             --value-size 16"
        ),
        "{}",
        stderr(&o)
    );
    // The compute node served the transactions.
    let metrics = c.json()["compute_nodes"][0]["metrics"]
        .as_str()
        .unwrap()
        .to_string();
    let commits = sample(&scrape(&metrics), "namdb_commits_total").unwrap();
    assert!(commits >= v["committed"].as_f64().unwrap(), "{commits}");
}

#[test]
fn a_replicated_cluster_starts_a_backup_per_memory_server_and_stops_it() {
    let c = Cluster::up(&[
        "--memory-servers",
        "2",
        "--backend",
        "shm",
        "--size",
        "16MiB",
        "--replicas",
        "2",
    ]);
    let cwd = c.cwd();
    let json = c.json();
    let primaries = json["memory_servers"].as_array().unwrap().clone();
    let backups = json["memory_server_backups"].as_array().unwrap().clone();
    assert_eq!((primaries.len(), backups.len()), (2, 2));
    for (i, (p, b)) in primaries.iter().zip(&backups).enumerate() {
        assert_eq!(b["name"], format!("memory-server-{i}-backup"));
        let log =
            |e: &serde_json::Value| std::fs::read_to_string(e["log"].as_str().unwrap()).unwrap();
        assert!(log(b).contains(", backup"), "{}", log(b));
        let attached = format!("primary of backup {}", b["address"].as_str().unwrap());
        assert!(log(p).contains(&attached), "{}", log(p));
    }
    // The compute node runs on replicated servers: its Persists reach both copies.
    ok(cwd, &["kv", "put", "7", "replicated"]);
    assert_eq!(ok(cwd, &["kv", "get", "7"]), "replicated\n");
    let status = ok(cwd, &["cluster", "status"]);
    assert!(status.contains("memory-server-1-backup pid"), "{status}");
    let pids: Vec<u32> = backups
        .iter()
        .map(|b| b["pid"].as_u64().unwrap() as u32)
        .collect();
    assert!(pids.iter().all(|&p| alive(p)), "{pids:?}");
    ok(cwd, &["cluster", "down"]);
    for pid in pids {
        assert!(!alive(pid), "backup {pid} outlived `cluster down`");
    }
}

#[test]
fn a_memory_server_restarted_without_its_data_is_reported_lost() {
    let c = Cluster::up(&[
        "--memory-servers",
        "1",
        "--backend",
        "tcp",
        "--size",
        "16MiB",
        "--table-capacity",
        "1024",
    ]);
    ok(c.cwd(), &["kv", "put", "1", "one"]);
    let server = c.json()["memory_servers"][0].clone();
    let pid = server["pid"].as_u64().unwrap() as u32;
    let address = server["address"].as_str().unwrap().to_string();
    // The same server again, on the address the compute node knows, without its data.
    let mut argv: Vec<String> = std::fs::read(format!("/proc/{pid}/cmdline"))
        .unwrap()
        .split(|&b| b == 0)
        .filter(|a| !a.is_empty())
        .skip(1)
        .map(|a| String::from_utf8(a.to_vec()).unwrap())
        .collect();
    let listen = argv.iter().position(|a| a == "--listen").unwrap() + 1;
    argv[listen] = address;
    kill_9_and_wait(pid);
    let mut again = Command::new(env!("CARGO_BIN_EXE_namdb"))
        .current_dir(c.cwd())
        .args(&argv)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // The compute node reconnects, and says the data is gone: it once set up a new,
    // empty cluster on the server and answered "not found: table kv".
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    // Asserted once the server is stopped: a failing test must not leave it running.
    let said = loop {
        let o = namdb(c.cwd(), &["kv", "get", "1"]);
        let said = stderr(&o);
        if said.contains("no longer holds")
            || said.contains("table kv")
            || std::time::Instant::now() > deadline
        {
            break said;
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
    };
    let _ = again.kill();
    let _ = again.wait();
    assert!(said.contains("no longer holds the cluster"), "{said}");
    assert!(said.contains("--data-dir"), "{said}");
}

/// A compute node killed and started again by hand (its own command line, the token
/// file named relative to the working directory) is this cluster's: `status` shows it
/// alive under its new pid, and `down` stops it.
#[test]
fn a_process_restarted_by_hand_is_seen_and_stopped() {
    let c = Cluster::up(&[
        "--backend",
        "shm",
        "--size",
        "16MiB",
        "--compute-nodes",
        "1",
    ]);
    let json = c.json();
    let node = &json["compute_nodes"][0];
    let old_pid = node["pid"].as_u64().unwrap() as u32;
    let address = node["address"].as_str().unwrap().to_string();
    let cmdline = std::fs::read(format!("/proc/{old_pid}/cmdline")).unwrap();
    let mut args: Vec<String> = cmdline
        .split(|&b| b == 0)
        .filter(|a| !a.is_empty())
        .skip(1)
        .map(|a| String::from_utf8(a.to_vec()).unwrap())
        .collect();
    for (i, a) in args.clone().iter().enumerate() {
        match a.as_str() {
            "--listen" => args[i + 1] = address.clone(),
            "--token-file" => args[i + 1] = "namdb-cluster/token".into(),
            _ => {}
        }
    }
    // A stopped memory server answers nothing: `status` says so and fails.
    let server = json["memory_servers"][0]["pid"].as_u64().unwrap() as u32;
    stop_and_wait(server);
    let o = namdb(c.cwd(), &["cluster", "status"]);
    send_signal(server, "-CONT");
    assert_eq!(o.status.code(), Some(1), "{}", stdout(&o));
    assert!(
        stdout(&o).contains(&format!(
            "stopped (SIGSTOP: it answers nothing; `kill -CONT {server}`"
        )),
        "{}",
        stdout(&o)
    );
    assert!(
        stdout(&o).ends_with("of 3 processes, 1 is stopped\n"),
        "{}",
        stdout(&o)
    );
    kill_9_and_wait(old_pid);
    let o = namdb(c.cwd(), &["cluster", "status"]);
    assert_eq!(o.status.code(), Some(1), "{}", stdout(&o));
    assert!(
        stdout(&o).ends_with("of 3 processes, 1 is not running\n"),
        "{}",
        stdout(&o)
    );
    let log = std::fs::File::create(c.cwd().join("by-hand.log")).unwrap();
    let mut by_hand = Command::new(env!("CARGO_BIN_EXE_namdb"))
        .current_dir(c.cwd())
        .args(&args)
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while !std::fs::read_to_string(c.cwd().join("by-hand.log"))
        .unwrap()
        .contains("listening on")
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the node never listened"
        );
        assert!(by_hand.try_wait().unwrap().is_none(), "the node exited");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let new_pid = by_hand.id();
    let status = ok(c.cwd(), &["cluster", "status"]);
    assert!(
        status.contains(&format!(
            "compute-node-0 pid {old_pid} {address} alive as pid {new_pid}, started by hand"
        )),
        "{status}"
    );
    let down = ok(c.cwd(), &["cluster", "down"]);
    assert!(
        down.contains(&format!(
            "compute-node-0 runs as pid {new_pid}, started by hand; stopping it too"
        )),
        "{down}"
    );
    // `down` waited for it to exit.
    assert!(
        by_hand.try_wait().unwrap().is_some(),
        "pid {new_pid} still runs"
    );
}

/// Every worker holds one of the oracle's 16 slots: 16 compute nodes share them, one
/// worker each, and all of them serve.
#[test]
fn as_many_compute_nodes_as_the_oracle_has_slots_come_up() {
    let c = Cluster::up(&[
        "--backend",
        "shm",
        "--size",
        "16MiB",
        "--compute-nodes",
        "16",
    ]);
    let json = c.json();
    let nodes = json["compute_nodes"].as_array().unwrap();
    assert_eq!(nodes.len(), 16);
    for node in nodes {
        let log = std::fs::read_to_string(node["log"].as_str().unwrap()).unwrap();
        assert!(log.contains("(1 worker, 2 memory servers"), "{log}");
    }
    ok(c.cwd(), &["kv", "put", "3", "three"]);
    assert_eq!(ok(c.cwd(), &["kv", "get", "3"]), "three\n");
    let o = namdb(c.cwd(), &["cluster", "up", "--compute-nodes", "17"]);
    assert!(stderr(&o).contains("17 is not in 1..=16"), "{}", stderr(&o));
}

/// A tester's report: after a failover to memory-server-1's backup, `cluster down` and
/// `cluster up` brought the dead primary's directory back as the primary, and its
/// state transfer overwrote the promoted backup's newer data: acknowledged writes were
/// lost without a word.
#[test]
fn writes_acknowledged_after_a_failover_survive_cluster_down_and_up() {
    let args = DURABLE_REPLICATED_TCP;
    let c = Cluster::up(&args);
    let cwd = c.cwd();
    for k in 1..=10 {
        ok(cwd, &["kv", "put", &k.to_string(), "before"]);
    }
    let pid = c.json()["memory_servers"][1]["pid"].as_u64().unwrap() as u32;
    kill_9_and_wait(pid);
    // The compute node promotes memory-server-1's backup and goes on (a command that
    // meets the failover may fail: it is tried again until acknowledged).
    for k in 1..=10 {
        kv_until_ok(cwd, &["put", &k.to_string(), "after"]);
    }
    ok(cwd, &["cluster", "down"]);
    let mut up = vec!["cluster", "up"];
    up.extend_from_slice(&args);
    let said = ok(cwd, &up);
    let all_after: String = (1..=10).map(|k| format!("{k}\tafter\n")).collect();
    assert_eq!(ok(cwd, &["kv", "scan"]), all_after);
    let swapped: Vec<&str> = said.lines().filter(|l| l.contains("promoted")).collect();
    assert_eq!(swapped.len(), 1, "{said}");
    assert!(
        swapped[0].starts_with("memory-server-1: ")
            && swapped[0].contains("memory-server-1-backup was promoted to primary on")
            && swapped[0].contains("receives a full copy"),
        "{said}"
    );
    // The cluster works, replicated again: memory-server-1's primary (the promoted
    // directory) attached the old primary's directory as its backup.
    ok(cwd, &["kv", "put", "11", "new"]);
    assert_eq!(ok(cwd, &["kv", "get", "11"]), "new\n");
    let json = c.json();
    let log = std::fs::read_to_string(json["memory_servers"][1]["log"].as_str().unwrap()).unwrap();
    let attached = format!(
        "primary of backup {}",
        json["memory_server_backups"][1]["address"]
            .as_str()
            .unwrap()
    );
    assert!(log.contains(&attached), "{log}");
    // A second restart changes nothing more (the promotion is no longer recorded once
    // the backup held the promoted server's whole state).
    ok(cwd, &["cluster", "down"]);
    let said = ok(cwd, &up);
    assert!(!said.contains("promoted"), "{said}");
    let mut all = all_after;
    all.push_str("11\tnew\n");
    assert_eq!(ok(cwd, &["kv", "scan"]), all);
}

/// The old primary comes back as the promoted server's backup on its own data
/// directory (which takes the promoted server's whole state and epoch), so the
/// promoted directory no longer records the promotion: `down` and `up` start the two
/// directories under their names again, no swap, with every acknowledged write, and
/// the pair fails over again.
#[test]
fn a_primary_back_as_its_promoted_backups_backup_keeps_every_write_across_down_and_up() {
    let args = DURABLE_REPLICATED_TCP;
    let c = Cluster::up(&args);
    let cwd = c.cwd();
    ok(cwd, &["kv", "put", "1", "before"]);
    let pid = |list: &str| c.json()[list][0]["pid"].as_u64().unwrap() as u32;
    kill_9_and_wait(pid("memory_servers"));
    kv_until_ok(cwd, &["put", "2", "promoted"]);
    let said = ok(cwd, &["cluster", "restart", "memory-server-0"]);
    assert!(
        said.contains("memory-server-0 holds memory-server-0-backup's whole state"),
        "{said}"
    );
    // Right after the backup reported itself synced (what `restart` waits for), so
    // its log line may come a little later.
    let log_path = c.json()["memory_server_backups"][0]["log"]
        .as_str()
        .unwrap()
        .to_string();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let log = std::fs::read_to_string(&log_path).unwrap();
        if log.contains("the promotion is no longer recorded") {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the promoted server forgets its promotion once its backup is synced: {log}"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    ok(cwd, &["kv", "put", "3", "two copies"]);
    ok(cwd, &["cluster", "down"]);
    let mut up = vec!["cluster", "up"];
    up.extend_from_slice(&args);
    let said = ok(cwd, &up);
    assert!(!said.contains("promoted"), "no swap: {said}");
    let all = "1\tbefore\n2\tpromoted\n3\ttwo copies\n";
    assert_eq!(ok(cwd, &["kv", "scan"]), all);
    // Replicated again, the first way round.
    kill_9_and_wait(pid("memory_servers"));
    assert_eq!(kv_until_ok(cwd, &["scan"]), all);
}

/// Runs `kv ARGS` until it succeeds (a command that meets a failover or a re-attach
/// may fail), for at most 60 s; answers its standard output.
fn kv_until_ok(cwd: &std::path::Path, args: &[&str]) -> String {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let mut argv = vec!["kv", "--timeout", "20s"];
    argv.extend_from_slice(args);
    loop {
        let o = namdb(cwd, &argv);
        if o.status.success() {
            return stdout(&o);
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{argv:?}: {}",
            stderr(&o)
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
}

/// After a failover, `status` offered `cluster restart` for the dead primary, and the
/// restarted primary exited at once: a promoted backup takes no primary. Then the
/// restart was refused, and the cluster ran on one copy until `down`. Now `restart`
/// starts the old primary as the promoted server's backup (which copies its state
/// there while it serves), so the pair can fail over again, either way round.
#[test]
fn a_primary_whose_backup_was_promoted_comes_back_as_its_backup_and_the_pair_fails_over_again() {
    let c = one_replicated_memory_server();
    let cwd = c.cwd();
    ok(cwd, &["kv", "put", "1", "before"]);
    let server = |list: &str| c.json()[list][0].clone();
    let pid = |list: &str| server(list)["pid"].as_u64().unwrap() as u32;
    kill_9_and_wait(pid("memory_servers"));
    // A write makes the compute node promote the backup.
    kv_until_ok(cwd, &["put", "2", "promoted"]);
    let o = namdb(cwd, &["cluster", "status"]);
    assert_eq!(o.status.code(), Some(1));
    let said = stdout(&o);
    assert!(
        said.contains(
            "not running: its backup memory-server-0-backup was promoted and serves in its \
             place (`namdb cluster restart memory-server-0` starts it again as that server's \
             backup)"
        ) && said.contains("alive, promoted: serves in memory-server-0's place"),
        "{said}"
    );

    let o = namdb(cwd, &["cluster", "restart", "memory-server-0"]);
    assert!(o.status.success(), "{}{}", stdout(&o), stderr(&o));
    let said = stdout(&o);
    assert!(
        said.contains("memory-server-0-backup was promoted in memory-server-0's place: starting memory-server-0 as its backup")
            && said.contains("memory-server-0 holds memory-server-0-backup's whole state"),
        "{said}"
    );
    let log = std::fs::read_to_string(server("memory_servers")["log"].as_str().unwrap()).unwrap();
    assert!(log.contains("backup of the promoted server at"), "{log}");
    // The names no longer say which serves; `status` does.
    let said = ok(cwd, &["cluster", "status"]);
    let line = |name: &str| {
        said.lines()
            .find(|l| l.starts_with(&format!("{name} pid")))
            .unwrap_or_default()
            .to_string()
    };
    assert!(
        line("memory-server-0").contains("alive, backup (holds its primary's state)")
            && line("memory-server-0-backup")
                .contains("alive, promoted: serves as the primary, with a backup"),
        "{said}"
    );
    // Writes now wait for the new backup too.
    ok(cwd, &["kv", "put", "3", "two copies again"]);

    // The promoted server dies: the compute node promotes the old primary, its backup.
    kill_9_and_wait(pid("memory_server_backups"));
    kv_until_ok(cwd, &["put", "4", "back on the first"]);
    let o = namdb(cwd, &["cluster", "restart", "memory-server-0-backup"]);
    assert!(o.status.success(), "{}{}", stdout(&o), stderr(&o));
    assert!(
        stdout(&o).contains("memory-server-0-backup holds memory-server-0's whole state"),
        "{}",
        stdout(&o)
    );
    ok(cwd, &["kv", "put", "5", "and back"]);
    kill_9_and_wait(pid("memory_servers"));
    assert_scan_after_failover(
        cwd,
        &[
            "1\tbefore",
            "2\tpromoted",
            "3\ttwo copies again",
            "4\tback on the first",
            "5\tand back",
        ],
    );
}

/// A primary stopped (SIGSTOP, as a hung or cut-off host) long enough for the compute
/// node to promote its backup is fenced; resumed, it used to stay up failing every
/// Persist until an operator stopped it. Started by `cluster up` with
/// `--rejoin-when-fenced`, it sees the promotion and starts again, in the same
/// process, as the promoted server's backup: two copies again with nobody restarting
/// anything. Then the same the other way round, and the pair fails over with every
/// write.
#[test]
fn a_primary_resumed_after_its_backup_was_promoted_rejoins_as_its_backup_by_itself() {
    let c = one_replicated_memory_server();
    let cwd = c.cwd();
    ok(cwd, &["kv", "put", "1", "before"]);
    let server = |list: &str| c.json()[list][0].clone();
    let pid = |list: &str| server(list)["pid"].as_u64().unwrap() as u32;
    // Stops `name` (pid `stopped`) until the compute node promotes the other of the
    // pair for a write, resumes it, and waits for it to say it is that one's backup.
    let fail_over_and_rejoin = |stopped: u32, name: &str, write: &[&str]| {
        stop_and_wait(stopped);
        let resume = Resume(stopped);
        kv_until_ok(cwd, write);
        drop(resume);
        // Within the partner check's period (1 s) and a restart of the process.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        loop {
            let said = stdout(&namdb(cwd, &["cluster", "status"]));
            let rejoined = said.lines().any(|l| {
                l.starts_with(&format!("{name} pid {stopped} "))
                    && l.contains("alive, backup (holds its primary's state)")
            });
            if rejoined {
                assert!(
                    said.contains("alive, promoted: serves as the primary, with a backup"),
                    "{said}"
                );
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{name}, fenced, did not rejoin as the backup: {said}"
            );
            std::thread::sleep(std::time::Duration::from_millis(200));
        }
    };
    fail_over_and_rejoin(
        pid("memory_servers"),
        "memory-server-0",
        &["put", "2", "promoted"],
    );
    let log = std::fs::read_to_string(server("memory_servers")["log"].as_str().unwrap()).unwrap();
    assert!(
        log.contains("was promoted in this one's place, which fenced this one: starting again")
            && log.contains("backup of the promoted server at"),
        "{log}"
    );
    ok(cwd, &["kv", "put", "3", "two copies again"]);
    // The other way round: the backup `up` started (plain --backup), promoted and given
    // a backup since, knows its partner as the backup it replicates to.
    fail_over_and_rejoin(
        pid("memory_server_backups"),
        "memory-server-0-backup",
        &["put", "4", "back on the first"],
    );
    ok(cwd, &["kv", "put", "5", "and two copies"]);
    // The promoted server dies: the compute node promotes the rejoined one.
    kill_9_and_wait(pid("memory_servers"));
    assert_scan_after_failover(
        cwd,
        &[
            "1\tbefore",
            "2\tpromoted",
            "3\ttwo copies again",
            "4\tback on the first",
            "5\tand two copies",
        ],
    );
}

/// Every row of `kv scan`, once a compute node serves again after a failover, is
/// `rows`, in key order.
fn assert_scan_after_failover(cwd: &std::path::Path, rows: &[&str]) {
    let scan = kv_until_ok(cwd, &["scan"]);
    assert_eq!(scan.lines().collect::<Vec<_>>(), rows, "{scan}");
}

/// A dead backup stops writes only until `cluster restart` starts it again: its
/// primary attaches to the new process by itself and copies its state there, so the
/// backup can take over afterwards with every acknowledged write.
#[test]
fn a_backup_restarted_after_it_died_takes_the_primarys_state_and_writes_resume() {
    let c = one_replicated_memory_server();
    let cwd = c.cwd();
    ok(cwd, &["kv", "put", "1", "before"]);
    let backup = c.json()["memory_server_backups"][0].clone();
    let pid = backup["pid"].as_u64().unwrap() as u32;
    kill_9_and_wait(pid);
    // Nothing is acknowledged with one copy while the backup is gone.
    let o = namdb(cwd, &["kv", "put", "2", "while down"]);
    assert!(!o.status.success(), "{}", stdout(&o));
    assert!(stderr(&o).contains("backup at"), "{}", stderr(&o));
    let o = namdb(cwd, &["cluster", "status"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stdout(&o).contains(
            "memory-server-0-backup pid {pid} {} not running (`namdb cluster restart \
             memory-server-0-backup` starts it again)"
                .replace("{pid}", &pid.to_string())
                .replace("{}", backup["address"].as_str().unwrap())
                .as_str()
        ),
        "{}",
        stdout(&o)
    );

    // Wrong names and running processes are refused, naming what there is.
    let o = namdb(cwd, &["cluster", "restart", "memory-server-7"]);
    assert!(!o.status.success(), "{}", stdout(&o));
    assert!(
        stderr(&o).contains("no process named `memory-server-7`")
            && stderr(&o).contains("memory-server-0-backup"),
        "{}",
        stderr(&o)
    );
    let o = namdb(cwd, &["cluster", "restart", "memory-server-0"]);
    assert!(!o.status.success(), "{}", stdout(&o));
    assert!(
        stderr(&o).contains("memory-server-0 is running"),
        "{}",
        stderr(&o)
    );

    let o = namdb(cwd, &["cluster", "restart", "memory-server-0-backup"]);
    assert!(o.status.success(), "{}", stderr(&o));
    // A backup gets its primary's state: nothing to warn of.
    assert!(!stderr(&o).contains("warning"), "{}", stderr(&o));
    let said = stdout(&o);
    assert!(
        said.contains(&format!(
            "listening on {}",
            backup["address"].as_str().unwrap()
        )),
        "{said}"
    );
    let restarted = c.json()["memory_server_backups"][0]["pid"]
        .as_u64()
        .unwrap() as u32;
    assert!(restarted != pid && alive(restarted));
    // `restart` returned once the primary copied its whole state there (before, a
    // write right after it failed while the primary attached, and a failover before
    // the copy ended found a backup that (rightly) refused promotion).
    assert!(
        said.contains("memory-server-0-backup holds memory-server-0's whole state again"),
        "{said}"
    );
    ok(cwd, &["cluster", "status"]);
    ok(cwd, &["kv", "put", "3", "after"]);

    // The primary dies: the restarted backup takes over with every write.
    let primary = c.json()["memory_servers"][0]["pid"].as_u64().unwrap() as u32;
    kill_9_and_wait(primary);
    let scan = kv_until_ok(cwd, &["scan"]);
    let rows: Vec<&str> = scan.lines().collect();
    assert!(
        rows.contains(&"1\tbefore") && rows.contains(&"3\tafter"),
        "{scan}"
    );
    // The unacknowledged write may or may not be there, never half of it.
    assert!(
        rows.iter()
            .all(|r| ["1\tbefore", "2\twhile down", "3\tafter"].contains(r)),
        "{scan}"
    );
}

/// A cluster file naming another cluster's token: `kv` says the node refused the
/// token, not that it did not answer.
#[test]
fn a_cluster_file_with_the_wrong_token_says_so() {
    let c = Cluster::up(&["--backend", "shm", "--size", "16MiB"]);
    let other = c.cwd().join("other.token");
    std::fs::write(&other, "ab".repeat(32)).unwrap();
    std::fs::set_permissions(&other, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let mut json = c.json();
    json["token_file"] = serde_json::Value::String(other.display().to_string());
    let bad = c.cwd().join("bad.json");
    std::fs::write(&bad, json.to_string()).unwrap();
    let o = namdb(
        c.cwd(),
        &["kv", "get", "1", "--cluster", bad.to_str().unwrap()],
    );
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("its health check failed: wrong credentials"),
        "{}",
        stderr(&o)
    );
}

/// A cluster file cut short (a full disk, a stray edit): `down` still stops the
/// cluster's processes, found by the token file they name, and keeps the file aside.
#[test]
fn down_stops_the_processes_of_an_unreadable_cluster_file() {
    let c = Cluster::up(&["--backend", "shm", "--size", "16MiB"]);
    let token = std::fs::canonicalize(c.cwd().join("namdb-cluster/token")).unwrap();
    assert_eq!(processes_naming(&token).len(), 3);
    let text = std::fs::read_to_string(c.file()).unwrap();
    std::fs::write(c.file(), &text[..text.len() / 2]).unwrap();
    let said = ok(c.cwd(), &["cluster", "down"]);
    assert!(said.contains("the cluster file cannot be read"), "{said}");
    assert!(said.contains("cluster down (3 processes naming"), "{said}");
    assert!(processes_naming(&token).is_empty());
    assert!(!c.file().exists());
    assert!(
        c.cwd()
            .join("namdb-cluster/cluster.json.unreadable")
            .exists()
    );
    // And a new cluster comes up in its place.
    ok(
        c.cwd(),
        &["cluster", "up", "--backend", "shm", "--size", "16MiB"],
    );
}

/// A memory server with neither a data directory nor a backup held the only copy of
/// its data in its memory: `cluster restart` starts it again, but says first that what
/// it held is gone and how to start over, rather than leaving that to the next `kv`.
#[test]
fn restarting_a_memory_server_that_kept_nothing_says_its_data_is_gone() {
    let c = Cluster::up(&[
        "--memory-servers",
        "2",
        "--backend",
        "shm",
        "--size",
        "16MiB",
        "--table-capacity",
        "1024",
    ]);
    let cwd = c.cwd();
    ok(cwd, &["kv", "put", "1", "x"]);
    let pid = c.json()["memory_servers"][1]["pid"].as_u64().unwrap() as u32;
    kill_9_and_wait(pid);
    let o = namdb(cwd, &["cluster", "restart", "memory-server-1"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let said = stderr(&o);
    assert!(
        said.contains("warning: memory-server-1 keeps no data directory and has no backup")
            && said.contains("lost with its process")
            && said.contains("namdb cluster down"),
        "{said}"
    );
    assert!(stdout(&o).contains("started again"), "{}", stdout(&o));
}

/// `kv tables` and `kv create-table`: a second table made from the command line takes
/// `kv --table`, keeps its own value cap, and a name is taken once.
#[test]
fn kv_creates_and_lists_tables() {
    let c = Cluster::up(&[
        "--memory-servers",
        "2",
        "--backend",
        "shm",
        "--size",
        "16MiB",
        "--table-capacity",
        "1024",
    ]);
    let cwd = c.cwd();
    let said = ok(
        cwd,
        &[
            "kv",
            "create-table",
            "small",
            "--capacity",
            "100",
            "--value-cap",
            "8",
        ],
    );
    assert!(
        said.contains("created table small for 100 records of up to 8 bytes"),
        "{said}"
    );
    let o = namdb(cwd, &["kv", "create-table", "small"]);
    assert!(!o.status.success(), "{}", stdout(&o));
    assert!(stderr(&o).contains("small"), "{}", stderr(&o));

    let listed = ok(cwd, &["kv", "tables"]);
    let rows: Vec<&str> = listed.lines().collect();
    // The second column is what a table is made for, not what it holds (none yet).
    assert_eq!(
        rows[0], "table\tcapacity\tvalue cap\tpartitions",
        "{listed}"
    );
    assert!(
        rows.iter().any(|r| r.starts_with("kv\t1024\t256\t")),
        "{listed}"
    );
    assert!(
        rows.iter().any(|r| r.starts_with("small\t100\t8\t")),
        "{listed}"
    );

    ok(cwd, &["kv", "--table", "small", "put", "1", "eight..."]);
    assert_eq!(
        ok(cwd, &["kv", "--table", "small", "get", "1"]),
        "eight...\n"
    );
    // --cluster takes the cluster's directory as well as its file.
    assert_eq!(
        ok(
            cwd,
            &[
                "kv",
                "--table",
                "small",
                "get",
                "1",
                "--cluster",
                "namdb-cluster"
            ]
        ),
        "eight...\n"
    );
    // The kv table does not have the key; the small one refuses a value over its cap.
    assert_eq!(namdb(cwd, &["kv", "get", "1"]).status.code(), Some(1));
    let o = namdb(cwd, &["kv", "--table", "small", "put", "2", "nine....."]);
    assert!(!o.status.success(), "{}", stdout(&o));
    assert!(
        stderr(&o).contains("value cap of 8 bytes") && stderr(&o).contains("table `small`"),
        "{}",
        stderr(&o)
    );
}

/// Processes of a cluster killed by hand (SIGKILL: no cleanup) leave their shm
/// sockets in the temporary directory; `down` removes them.
#[test]
fn down_removes_what_killed_processes_left() {
    let c = Cluster::up(&[
        "--memory-servers",
        "1",
        "--compute-nodes",
        "1",
        "--backend",
        "shm",
    ]);
    let json = c.json();
    let server = json["memory_servers"][0]["pid"].as_u64().unwrap() as u32;
    let node = json["compute_nodes"][0]["pid"].as_u64().unwrap() as u32;
    let tmp = std::env::temp_dir();
    let socket = tmp.join(format!("namdb-memory-server-{server}.sock"));
    let node_dirs = || -> Vec<PathBuf> {
        std::fs::read_dir(&tmp)
            .unwrap()
            .flatten()
            .filter(|e| {
                e.file_name()
                    .to_str()
                    .is_some_and(|n| n.starts_with(&format!("namdb-compute-{node}-")))
            })
            .map(|e| e.path())
            .collect()
    };
    assert!(socket.exists(), "{}", socket.display());
    assert_eq!(node_dirs().len(), 1);
    let mut sockets = vec![socket.clone()];
    for dir in node_dirs() {
        sockets.extend(std::fs::read_dir(dir).unwrap().flatten().map(|e| e.path()));
    }
    for pid in [server, node] {
        send_signal(pid, "-9");
    }
    // Gone once nobody listens any more: the last of a killed process's threads may
    // close its sockets a moment after the process shows as a zombie. (Another test's
    // process starting meanwhile may have swept them already.)
    let refused = |s: &PathBuf| {
        use std::io::ErrorKind::{ConnectionRefused, NotFound};
        matches!(std::os::unix::net::UnixStream::connect(s),
                 Err(e) if matches!(e.kind(), ConnectionRefused | NotFound))
    };
    let killed = std::time::Instant::now();
    while !sockets.iter().all(refused) {
        assert!(
            killed.elapsed() < std::time::Duration::from_secs(20),
            "{sockets:?}"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let down = ok(c.cwd(), &["cluster", "down"]);
    assert!(down.contains("2 had exited already"), "{down}");
    assert!(!socket.exists(), "{} left behind", socket.display());
    assert_eq!(node_dirs(), Vec::<PathBuf>::new());
}

/// `cluster restart` of a compute node while its memory server's backup is stopped
/// (SIGSTOP: it keeps its connections and answers nothing): the node cannot open the
/// database (that persists, and the primary waits for its backup up to 30 s), so it
/// exits within about 40 s naming the backup. `restart` says every 5 s that it is not
/// ready yet and what its log says, and waits long enough to show the node's own error.
/// Before, it gave up after 30 s, silently, with "not ready". Once the backup goes on,
/// the node starts and nothing was lost.
#[test]
fn restarting_a_compute_node_while_a_backup_is_stopped_says_why_it_cannot_start() {
    let c = one_replicated_memory_server();
    let cwd = c.cwd();
    ok(cwd, &["kv", "put", "1", "before"]);
    let json = c.json();
    let node = json["compute_nodes"][0]["pid"].as_u64().unwrap() as u32;
    kill_9_and_wait(node);
    let backup = &json["memory_server_backups"][0];
    let backup_pid = backup["pid"].as_u64().unwrap() as u32;
    stop_and_wait(backup_pid);
    let o = namdb(cwd, &["cluster", "restart", "compute-node-0"]);
    send_signal(backup_pid, "-CONT");
    let said = stderr(&o);
    assert!(!o.status.success(), "{}", stdout(&o));
    assert!(
        said.contains("compute-node-0 is not ready after 5 s (given up at 60 s)"),
        "{said}"
    );
    assert!(
        said.contains("compute-node-0 exited") && !said.contains("was not ready after"),
        "{said}"
    );
    assert!(
        said.contains(&format!(
            "backup at {}",
            backup["address"].as_str().unwrap()
        )),
        "{said}"
    );
    // The primary attaches to its backup again within a second or so of it going on
    // (until then a Persist fails at once, naming the backup).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let o = namdb(cwd, &["cluster", "restart", "compute-node-0"]);
        if o.status.success() {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline && stderr(&o).contains("backup at"),
            "{}",
            stderr(&o)
        );
        std::thread::sleep(std::time::Duration::from_millis(500));
    }
    assert_eq!(ok(cwd, &["kv", "get", "1"]), "before\n");
}

/// `cluster restart` whose stderr's reader went away while it waited for the process
/// it started (here a compute node that cannot open the database while its memory
/// server's backup is stopped: `restart` says every 5 s that it is not ready) stops
/// that process and ends with SIGPIPE's status. Before, its "not ready" line panicked
/// (status 141 too) and left the node starting on its own, unrecorded in the cluster
/// file: once the backup went on it served at the recorded address of a node `cluster
/// status` called dead.
#[test]
fn a_restart_whose_stderr_reader_went_away_stops_the_process_it_started() {
    let c = one_replicated_memory_server();
    let cwd = c.cwd();
    ok(cwd, &["kv", "put", "1", "before"]);
    let json = c.json();
    let node = &json["compute_nodes"][0];
    kill_9_and_wait(node["pid"].as_u64().unwrap() as u32);
    // Names this cluster's compute nodes alone.
    let args: Vec<&str> = node["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    let servers = args[args.iter().position(|&a| a == "--memory-servers").unwrap() + 1];
    let backup = json["memory_server_backups"][0]["pid"].as_u64().unwrap() as u32;
    stop_and_wait(backup);
    let resume = Resume(backup);
    let mut restart = Command::new(env!("CARGO_BIN_EXE_namdb"))
        .current_dir(cwd)
        .args(["cluster", "restart", "compute-node-0"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(restart.stderr.take());
    let status = restart.wait().unwrap();
    assert_eq!(status.code(), Some(141), "{status}");
    assert_eq!(
        processes_naming(servers),
        Vec::<u32>::new(),
        "the compute node restart started outlived it"
    );
    drop(resume);
    // It starts normally now, and nothing was lost.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let o = namdb(cwd, &["cluster", "restart", "compute-node-0"]);
        if o.status.success() {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{}", stderr(&o));
        std::thread::sleep(std::time::Duration::from_millis(500));
    }
    assert_eq!(ok(cwd, &["kv", "get", "1"]), "before\n");
}

/// `cluster restart` of a backup whose primary is not running returns at once, saying
/// the backup gets its state once the primary is started again, rather than waiting
/// for a copy nobody makes.
#[test]
fn restarting_a_backup_whose_primary_is_down_says_so_and_returns() {
    let c = one_replicated_memory_server();
    let cwd = c.cwd();
    let json = c.json();
    kill_9_and_wait(json["memory_server_backups"][0]["pid"].as_u64().unwrap() as u32);
    kill_9_and_wait(json["memory_servers"][0]["pid"].as_u64().unwrap() as u32);
    let said = ok(cwd, &["cluster", "restart", "memory-server-0-backup"]);
    assert!(
        said.contains(
            "memory-server-0 is not running: memory-server-0-backup gets its state once \
             memory-server-0 is started again"
        ),
        "{said}"
    );
}

/// A commit to a compute node that was killed (SIGKILL) after the transaction began:
/// the connection is refused, so the commit was never sent and nothing took effect.
/// Before, the shell said "the commit's outcome is unknown … it may have taken effect".
/// The open transaction's writes are lost with the node, and the key stays absent.
#[test]
fn a_commit_to_a_dead_compute_node_says_it_was_not_sent() {
    let c = Cluster::up(&[
        "--backend",
        "shm",
        "--size",
        "16MiB",
        "--table-capacity",
        "1024",
    ]);
    let json = c.json();
    let node = json["compute_nodes"][0]["pid"].as_u64().unwrap() as u32;
    let address = json["compute_nodes"][0]["address"]
        .as_str()
        .unwrap()
        .to_string();
    // "seven" once the put went through: the node holds the open transaction.
    let (shell, mut stdin, mut out) = shell_answering(
        c.cwd(),
        &[],
        b"begin\nput 7 seven\nget 7\n",
        &["begun\n", "seven\n"],
    );
    kill_9_and_wait(node);
    // Refused once nobody listens any more (a killed process's last threads may close
    // its sockets a moment after it shows as gone).
    let killed = std::time::Instant::now();
    while TcpStream::connect(address.trim_start_matches("http://")).is_ok() {
        assert!(killed.elapsed() < std::time::Duration::from_secs(20));
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    // The next command finds no node either, and says why: before, "tcp connect error"
    // alone.
    stdin.write_all(b"commit\nget 7\n").unwrap();
    drop(stdin);
    let mut rest = String::new();
    out.read_to_string(&mut rest).unwrap();
    let o = shell.wait_with_output().unwrap();
    let said = stderr(&o);
    assert_eq!(rest, "", "{said}");
    assert!(
        said.contains("the commit was not sent") && said.contains("nothing took effect"),
        "{said}"
    );
    assert!(!said.contains("may have taken effect"), "{said}");
    assert!(!said.contains("unknown"), "{said}");
    assert!(said.contains("Connection refused"), "{said}");
    // The shell then looks for another compute node, and says why it found none once:
    // before, "tcp connect error: tcp connect error".
    assert!(said.contains("cannot reach compute-node-0"), "{said}");
    assert!(
        said.contains("line 5: begin failed: tcp connect error: Connection refused"),
        "{said}"
    );
    assert_eq!(said.matches("tcp connect error").count(), 4, "{said}");
    // `kv` reaches no node to begin with: it fails (2) before any commit, not as an
    // unknown outcome (3).
    let o = namdb(c.cwd(), &["kv", "put", "7", "x"]);
    let said = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{said}");
    assert!(said.contains("cannot reach compute-node-0"), "{said}");
    assert!(!said.contains("unknown"), "{said}");
}

/// `shell --timeout` gives up on a line as `kv --timeout` on its transaction: with the
/// memory servers stopped (SIGSTOP, on tcp: their one-sided operations wait), a command
/// of the open transaction and a command of its own each fail after a second, saying
/// so; the open transaction ends, and the script goes on. Before, the shell had no
/// --timeout (`unexpected argument '--timeout' found`) and waited as long as the
/// compute node did.
#[test]
fn the_shell_gives_up_on_a_line_after_its_timeout() {
    let c = Cluster::up(&["--backend", "tcp", "--size", "16MiB"]);
    let cwd = c.cwd();
    ok(cwd, &["kv", "put", "1", "one"]);
    let (shell, mut stdin, mut out) = shell_answering(
        cwd,
        &["--timeout", "1s"],
        b"begin\nget 1\n",
        &["begun\n", "one\n"],
    );
    // Both servers: keys 1 and 3 live on the one that does not hold the oracle, and
    // a missing key's lookup needs only its own server, so with the oracle's server
    // alone stopped `get 3` answered "not found" whenever the worker was not busy
    // with the oracle at that moment (a CI run failed so).
    let resume: Vec<Resume> = c.json()["memory_servers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|server| {
            let pid = server["pid"].as_u64().unwrap() as u32;
            stop_and_wait(pid);
            Resume(pid)
        })
        .collect();
    // Key 3 was not read before (a key the transaction read already may be answered
    // from what it read).
    stdin.write_all(b"get 3\nget 1\ncommit\n").unwrap();
    drop(stdin);
    let mut rest = String::new();
    out.read_to_string(&mut rest).unwrap();
    let o = shell.wait_with_output().unwrap();
    drop(resume);
    let said = stderr(&o);
    assert_eq!(rest, "", "{said}");
    assert_eq!(o.status.code(), Some(2), "{said}");
    let gave_up = "no answer from the compute node within 1s";
    assert!(
        said.contains(&format!(
            "line 3: the transaction has ended (given up): {gave_up}"
        )),
        "{said}"
    );
    assert!(said.contains(&format!("line 4: {gave_up}")), "{said}");
    assert!(said.contains("line 5: no transaction is open"), "{said}");
    assert!(
        said.ends_with("namdb shell: 3 lines failed (3, 4, 5)\n"),
        "{said}"
    );
    // Nothing was lost once the server goes on.
    assert_eq!(ok(cwd, &["kv", "get", "1"]), "one\n");
}

/// SIGCONTs a process the test stopped when dropped, so that a failing assertion does
/// not leave it stopped (holding its cluster's ports and the test's temporary dir).
struct Resume(u32);

impl Drop for Resume {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-CONT", &self.0.to_string()])
            .status();
    }
}

/// `kv` while a memory server is stopped (SIGSTOP: it keeps its connections and
/// answers nothing) on tcp, whose one-sided operations to it then wait (up to the 30 s
/// patience of txn and the oracle): the compute node's workers are stuck in them, yet
/// its health check answers (NOT_SERVING, naming the workers and, once the node can
/// tell, the memory server), as does its metrics endpoint, and `kv` says the node is up
/// but not serving, and why.
/// Before, the health check waited on the workers, and `kv` waited its fixed 3 s for it
/// whatever its --timeout, then said "cannot reach compute-node-0 … (is the cluster
/// up?)", "it did not answer a health check within 3s", and a scrape waited as long as
/// the workers (up to 30 s). Nothing is lost once the server
/// goes on.
#[test]
fn kv_while_a_memory_server_is_stopped_says_the_compute_node_is_up_and_why_it_cannot_serve() {
    let c = Cluster::up(&["--backend", "tcp", "--size", "16MiB"]);
    let cwd = c.cwd();
    ok(cwd, &["kv", "put", "1", "one"]);
    let json = c.json();
    let server = &json["memory_servers"][0];
    let pid = server["pid"].as_u64().unwrap() as u32;
    let named = format!("memory server 0 at {}", server["address"].as_str().unwrap());
    stop_and_wait(pid);
    let resume = Resume(pid);
    // A --timeout below the health check's 3 s bounds its wait, and the node, told
    // so (grpc-timeout), gives its workers half of it.
    let o = namdb(cwd, &["kv", "--timeout", "1s", "get", "1"]);
    let said = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{said}");
    assert!(
        said.contains("is up but not serving: workers 0, 1 of 2 did not answer within 500ms"),
        "{said}"
    );
    // Its metrics endpoint answers too, saying why it has no counters to show.
    let metrics = scrape(json["compute_nodes"][0]["metrics"].as_str().unwrap());
    assert!(
        metrics
            .contains("# the workers did not answer: workers 0, 1 of 2 did not answer within 1s"),
        "{metrics}"
    );
    // The memory server is named once the node's own question to it has gone
    // unanswered for a while (and, past its keep-alive, as the reason it reconnects).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    for args in [["get", "1", ""], ["put", "1", "x"]].iter().cycle() {
        let args: Vec<&str> = ["kv", "--timeout", "2s"]
            .into_iter()
            .chain(args.iter().copied().filter(|a| !a.is_empty()))
            .collect();
        let o = namdb(cwd, &args);
        let said = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {said}");
        assert!(
            said.contains("compute-node-0 at") && said.contains("is up but not serving"),
            "{args:?}: {said}"
        );
        assert!(!said.contains("cannot reach"), "{args:?}: {said}");
        assert!(!said.contains("unknown"), "{args:?}: {said}");
        if said.contains(&named) {
            break;
        }
        assert!(
            said.contains("workers 0, 1 of 2 did not answer within 1s"),
            "{args:?}: {said}"
        );
        assert!(
            std::time::Instant::now() < deadline,
            "the stopped server was never named: {said}"
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    drop(resume);
    // The put above never ran; the value is still there once the server goes on.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(90);
    loop {
        let o = namdb(cwd, &["kv", "get", "1"]);
        if o.status.success() {
            assert_eq!(stdout(&o), "one\n");
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{}", stderr(&o));
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
}

/// `namdb shell ARGS` in `cwd`, fed `script`, once it answered the lines `expected`:
/// the process, its stdin and the rest of its stdout.
fn shell_answering(
    cwd: &std::path::Path,
    args: &[&str],
    script: &[u8],
    expected: &[&str],
) -> (
    std::process::Child,
    std::process::ChildStdin,
    std::io::BufReader<std::process::ChildStdout>,
) {
    use std::io::{BufRead, Write};
    let mut shell = Command::new(env!("CARGO_BIN_EXE_namdb"))
        .current_dir(cwd)
        .arg("shell")
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = shell.stdin.take().unwrap();
    let mut out = std::io::BufReader::new(shell.stdout.take().unwrap());
    stdin.write_all(script).unwrap();
    stdin.flush().unwrap();
    for expected in expected {
        let mut line = String::new();
        out.read_line(&mut line).unwrap();
        assert_eq!(line, *expected);
    }
    (shell, stdin, out)
}
