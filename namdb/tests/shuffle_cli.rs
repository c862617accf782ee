//! `namdb bench shuffle` as a user runs it: the designs on the sim (threads) and on shm
//! (node processes), the TCP and MPI baselines, the JSON and SVG outputs, and the
//! errors bad arguments give. Small fragments, so the whole file stays short on two
//! cores.

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

mod common;

use common::{namdb_here as namdb, text};

/// Runs `namdb bench shuffle ARGS --json TMP`; returns the output and, if it
/// succeeded, the rows.
fn shuffle(args: &[&str]) -> (Output, Option<Vec<Value>>) {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("runs.json");
    let mut argv = vec!["bench", "shuffle"];
    argv.extend_from_slice(args);
    argv.extend_from_slice(&["--json", path.to_str().expect("UTF-8 path")]);
    let out = namdb(&argv);
    let rows = out.status.success().then(|| {
        let text = std::fs::read_to_string(&path).expect("JSON file written");
        serde_json::from_str(&text).expect("JSON is a list")
    });
    (out, rows)
}

const FIELDS: [&str; 11] = [
    "design",
    "backend",
    "pattern",
    "nodes",
    "threads",
    "message_bytes",
    "gb_per_sec",
    "memcpy_gb_per_sec",
    "pinned_bytes",
    "setup_ms",
    "seconds",
];

/// Every row has the fields, is verified, and moved what the pattern implies.
fn check_rows(rows: &[Value], nodes: u64, threads: u64, tuples: u64) {
    for r in rows {
        for f in FIELDS {
            assert!(r.get(f).is_some(), "row lacks `{f}`: {r}");
        }
        assert_eq!(r["nodes"], nodes, "{r}");
        assert_eq!(r["verified"], true, "{r}");
        assert!(r["gb_per_sec"].as_f64().unwrap() > 0.0, "{r}");
        assert!(r["memcpy_gb_per_sec"].as_f64().unwrap() > 0.0, "{r}");
        // Measured by every node of a design or of the TCP baseline; MPI's program does not.
        match r["design"].as_str() {
            Some("mpi") => assert!(r["partition_gb_per_sec"].is_null(), "{r}"),
            _ => assert!(r["partition_gb_per_sec"].as_f64().unwrap() > 0.0, "{r}"),
        }
        // A repartitioning node's whole work alone, likewise; a broadcast has none.
        match (r["design"].as_str(), r["pattern"].as_str()) {
            (Some("mpi"), _) | (_, Some("broadcast")) => {
                assert!(r["work_alone_gb_per_sec"].is_null(), "{r}")
            }
            _ => assert!(r["work_alone_gb_per_sec"].as_f64().unwrap() > 0.0, "{r}"),
        }
        assert!(r["seconds"].as_f64().unwrap() > 0.0, "{r}");
        assert!(r["setup_ms"].as_f64().unwrap() >= 0.0, "{r}");
        if r["design"] != "mpi" {
            assert_eq!(r["threads"], threads, "{r}");
        }
        let per_node = tuples * 16;
        let want = match r["pattern"].as_str().unwrap() {
            "repartition" => nodes * per_node,
            "broadcast" => nodes * (nodes - 1) * per_node,
            p => panic!("pattern {p}"),
        };
        assert_eq!(r["received_bytes"], want, "{r}");
        let design = r["design"].as_str().unwrap();
        if design != "tcp" && design != "mpi" {
            assert!(r["pinned_bytes"].as_u64().unwrap() > 0, "{r}");
        }
    }
}

fn designs_of(rows: &[Value]) -> Vec<&str> {
    rows.iter().map(|r| r["design"].as_str().unwrap()).collect()
}

#[test]
fn sim_designs_run_and_are_verified() {
    let (out, rows) = shuffle(&[
        "--backend",
        "sim",
        "--design",
        "MEMQ/SR,SESQ/SR",
        "--nodes",
        "3",
        "--threads",
        "2",
        "--tuples",
        "20000",
        "--baselines",
        "none",
    ]);
    let rows = rows.unwrap_or_else(|| panic!("failed: {}", text(&out)));
    check_rows(&rows, 3, 2, 20000);
    assert_eq!(
        designs_of(&rows),
        ["MEMQ/SR", "SESQ/SR", "MEMQ/SR", "SESQ/SR"],
        "{rows:?}"
    );
    // The RC design sends messages of --message-bytes (64 KiB by default); the UD one
    // datagrams of the MTU, whatever --message-bytes says.
    let sizes: Vec<u64> = rows
        .iter()
        .map(|r| r["message_bytes"].as_u64().unwrap())
        .collect();
    assert_eq!(sizes, [65536, 4096, 65536, 4096], "{rows:?}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout
            .lines()
            .any(|l| l.starts_with("SESQ/SR") && l.contains(" 4 KiB ")),
        "{stdout}"
    );
    assert!(stdout.contains("repartition: best design"), "{stdout}");
    assert!(
        stdout
            .lines()
            .any(|l| l.starts_with("repartition: best design") && l.contains("of the work alone")),
        "{stdout}"
    );
    assert!(stdout.contains("broadcast: best design"), "{stdout}");
}

#[test]
fn repeat_reports_the_median_run_of_each_row() {
    let (out, rows) = shuffle(&[
        "--backend",
        "sim",
        "--design",
        "MEMQ/SR,SEMQ/WR",
        "--tuples",
        "5000",
        "--pattern",
        "repartition",
        "--baselines",
        "none",
        "--repeat",
        "3",
    ]);
    let rows = rows.unwrap_or_else(|| panic!("failed: {}", text(&out)));
    check_rows(&rows, 2, 1, 5000);
    assert_eq!(designs_of(&rows), ["MEMQ/SR", "SEMQ/WR"], "{rows:?}");
    for r in &rows {
        let mut runs: Vec<f64> = r["gb_per_sec_runs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect();
        assert_eq!(runs.len(), 3, "{r}");
        runs.sort_by(f64::total_cmp);
        assert_eq!(r["gb_per_sec"].as_f64().unwrap(), runs[1], "{r}");
    }
    let t = text(&out);
    assert!(t.contains("round 3 of 3"), "{t}");
    assert!(t.contains("the median of 3 runs"), "{t}");
}

#[test]
fn wr_designs_run_in_every_notification_mode() {
    for notify in ["seal", "mq", "cq"] {
        let (out, rows) = shuffle(&[
            "--backend",
            "sim",
            "--design",
            "SEMQ/WR,MEMQ/WR",
            "--notify",
            notify,
            "--tuples",
            "5000",
            "--pattern",
            "repartition",
            "--baselines",
            "none",
        ]);
        let rows = rows.unwrap_or_else(|| panic!("{notify}: {}", text(&out)));
        assert_eq!(rows.len(), 2, "{notify}: {}", text(&out));
        check_rows(&rows, 2, 1, 5000);
    }
}

#[test]
fn shm_processes_run_every_built_design_and_the_tcp_baseline() {
    let (out, rows) = shuffle(&[
        "--backend",
        "shm",
        "--design",
        "all",
        "--nodes",
        "3",
        "--threads",
        "2",
        "--tuples",
        "20000",
        "--baselines",
        "tcp",
    ]);
    let rows = rows.unwrap_or_else(|| panic!("failed: {}", text(&out)));
    check_rows(&rows, 3, 2, 20000);
    let tcp: Vec<&Value> = rows.iter().filter(|r| r["design"] == "tcp").collect();
    assert_eq!(tcp.len(), 2, "{rows:?}");
    assert!(tcp.iter().all(|r| r["backend"] == "loopback"));
    for r in rows.iter().filter(|r| r["design"] != "tcp") {
        assert_eq!(r["backend"], "shm", "{r}");
    }
    assert!(rows.iter().all(|r| r["transport"].is_null()), "{rows:?}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("design") && stdout.contains("tcp"),
        "{stdout}"
    );
}

/// The CPUs this process may run on.
fn allowed_cpus() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// `--threading split,interleaved` runs every design both ways, in node processes:
/// rows of both kinds, each verified, told apart in the JSON and the table. With
/// `--pin` each node process ran on a CPU of its own.
#[test]
fn designs_run_interleaved_and_pinned_in_node_processes() {
    let (out, rows) = shuffle(&[
        "--backend",
        "shm",
        "--design",
        "MEMQ/RD,SESQ/SR,SEMQ/WR",
        "--threading",
        "split,interleaved",
        "--own-partition",
        "in-place,fabric",
        "--pin",
        "--nodes",
        "2",
        "--tuples",
        "20000",
        "--baselines",
        "tcp",
    ]);
    let rows = rows.unwrap_or_else(|| panic!("failed: {}", text(&out)));
    check_rows(&rows, 2, 1, 20000);
    for r in &rows {
        assert_eq!(r["pinned"], true, "{r}");
        let cpus: Vec<Vec<u64>> = serde_json::from_value(r["node_cpus"].clone()).unwrap();
        assert_eq!(cpus.len(), 2, "{r}");
        assert!(cpus.iter().all(|c| c.len() == 1), "one CPU per node: {r}");
        if allowed_cpus() >= 2 {
            assert_ne!(cpus[0], cpus[1], "the nodes shared a CPU: {r}");
        }
    }
    let runs: Vec<(&str, &str, &str)> = rows
        .iter()
        .filter(|r| r["pattern"] == "repartition")
        .map(|r| {
            (
                r["design"].as_str().unwrap(),
                r["threading"].as_str().unwrap(),
                r["own_partition"].as_str().unwrap(),
            )
        })
        .collect();
    let mut want = Vec::new();
    for design in ["MEMQ/RD", "SESQ/SR", "SEMQ/WR"] {
        want.push((design, "split", "fabric"));
        want.push((design, "interleaved", "in-place"));
        want.push((design, "interleaved", "fabric"));
    }
    want.push(("tcp", "split", "fabric"));
    assert_eq!(runs, want, "{rows:?}");
    // A broadcasting node sends itself nothing: each design runs once per threading.
    let broadcasts: Vec<(&str, &str)> = rows
        .iter()
        .filter(|r| r["pattern"] == "broadcast")
        .map(|r| {
            assert_eq!(r["own_partition"], "-", "{r}");
            (
                r["design"].as_str().unwrap(),
                r["threading"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(broadcasts.len(), 7, "{broadcasts:?}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    for own in [" in-place ", " fabric "] {
        assert!(
            stdout.lines().any(|l| l.starts_with("SEMQ/WR")
                && l.contains(" interleaved ")
                && l.contains(own)),
            "{stdout}"
        );
    }
}

/// The MPI script and its C source used to be found in the source tree the binary was
/// built from, and the program built into its `target/mpi`: an installed binary had
/// neither. They are built in now; run from a directory with no repository around, the
/// baseline builds into namdb's cache directory (`NAMDB_CACHE_DIR` here) and leaves
/// nothing in its current directory, and no message or `--help` names the source tree.
#[test]
fn mpi_baseline_runs_from_anywhere_or_says_openmpi_is_missing() {
    let source_tree = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let source_tree = source_tree.display().to_string();
    let installed = Command::new(source_tree.clone() + "/scripts/mpi.sh")
        .arg("check")
        .status()
        .expect("scripts/mpi.sh runs")
        .success();
    let tmp = tempfile::tempdir().unwrap();
    let (cwd, cache) = (tmp.path().join("cwd"), tmp.path().join("cache"));
    std::fs::create_dir(&cwd).unwrap();
    let namdb = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_namdb"))
            .current_dir(&cwd)
            .env("NAMDB_CACHE_DIR", &cache)
            .env_remove("MPI_BUILD_DIR")
            .env_remove("NAMDB_MPI_SCRIPT")
            .env("RUST_BACKTRACE", "0")
            .args(args)
            .output()
            .unwrap()
    };
    for bench in ["shuffle", "join", "aggregate"] {
        let help = text(&namdb(&["bench", bench, "--help"]));
        assert!(!help.contains(&source_tree), "bench {bench} --help: {help}");
    }
    let json = tmp.path().join("runs.json");
    let out = namdb(&[
        "bench",
        "shuffle",
        "--design",
        "none",
        "--nodes",
        "2",
        "--tuples",
        "20000",
        "--baselines",
        "mpi",
        "--pin",
        "--json",
        json.to_str().unwrap(),
    ]);
    let t = text(&out);
    assert!(!t.contains(&source_tree), "{t}");
    if installed {
        assert!(out.status.success(), "failed: {t}");
        let rows: Vec<Value> =
            serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        check_rows(&rows, 2, 1, 20000);
        assert_eq!(rows.len(), 2, "{rows:?}");
        assert!(rows.iter().all(|r| r["design"] == "mpi"));
        // Ranks bound to cores (`--pin`): OpenMPI ran with the binding and said nothing.
        assert!(rows.iter().all(|r| r["pinned"] == true), "{rows:?}");
        // A backend the designs' rows also name (it was OpenMPI's `vader`, which no
        // other row does); the transport beside it.
        for r in &rows {
            assert_eq!(r["backend"], "shm", "{r}");
            assert_eq!(r["transport"], "vader", "{r}");
        }
        assert!(
            cache.join("mpi/mpi-shuffle").is_file(),
            "not built in the cache"
        );
    } else {
        assert!(!out.status.success());
        assert!(t.contains("OpenMPI is not installed"), "{t}");
    }
    assert_eq!(
        std::fs::read_dir(&cwd).unwrap().count(),
        0,
        "left in its cwd"
    );
}

#[test]
fn sweep_draws_svgs() {
    let dir = tempfile::tempdir().unwrap();
    let svg: PathBuf = dir.path().join("svg");
    let (out, rows) = shuffle(&[
        "--design",
        "none",
        "--baselines",
        "tcp",
        "--tuples",
        "20000",
        "--pattern",
        "repartition",
        "--sweep-message-sizes",
        "--svg",
        svg.to_str().unwrap(),
    ]);
    let rows = rows.unwrap_or_else(|| panic!("failed: {}", text(&out)));
    let sizes: Vec<u64> = rows
        .iter()
        .map(|r| r["message_bytes"].as_u64().unwrap())
        .collect();
    assert_eq!(sizes, [4096, 16384, 65536, 262144, 1048576]);
    for f in [
        "shuffle-repartition-message-size.svg",
        "shuffle-designs.svg",
    ] {
        let s = std::fs::read_to_string(svg.join(f)).unwrap_or_else(|e| panic!("{f}: {e}"));
        assert!(s.starts_with("<svg") && s.contains("tcp"), "{f}");
    }
}

#[test]
fn bad_arguments_are_refused_clearly() {
    for (args, want) in [
        (&["--design", "MEMQ/XX"][..], "unknown design"),
        (&["--nodes", "0"][..], "--nodes"),
        (&["--tuples", "0"][..], "--tuples"),
        (&["--backend", "carrier-pigeon"][..], "possible values"),
        (&["--notify", "smoke"][..], "unknown notification"),
        (&["--repeat", "0"][..], "--repeat"),
        (&["--design", "all,MEMQ/XX"][..], "unknown design"),
        (&["--design", "none,MEMQ/WR"][..], "cannot be combined"),
        // 64 GiB a node: refused up front, not an allocation failure.
        (&["--tuples", "4294967296"][..], "tuples per node"),
        (
            &["--design", "none", "--baselines", "none"][..],
            "nothing to run",
        ),
        // The sweep sets the message sizes: a --message-bytes beside it was ignored.
        (
            &["--sweep-message-sizes", "--message-bytes", "8192"][..],
            "cannot be used with",
        ),
        // Named as what it is, not as --baselines none alone.
        (
            &["--design", "none", "--baselines", "tcp,none"][..],
            "cannot be combined",
        ),
        // A split node cannot consume its own tuples in place: the flag would be ignored.
        (
            &["--own-partition", "fabric"][..],
            "--own-partition applies to interleaved nodes only",
        ),
    ] {
        let mut argv = vec!["bench", "shuffle"];
        argv.extend_from_slice(args);
        let out = namdb(&argv);
        assert!(!out.status.success(), "{args:?} succeeded");
        let t = text(&out);
        assert!(t.contains(want), "{args:?}: {t}");
    }
}

/// A design or baseline listed twice ran once, silently: refused (status 1, as the
/// other bad lists), naming the flag and the entry, however it was spelt.
#[test]
fn a_design_or_baseline_listed_twice_is_refused() {
    for (args, want) in [
        (
            &["--design", "MEMQ/WR,SESQ/SR,memq/wr"][..],
            "--design lists memq/wr twice",
        ),
        (&["--design", "all,all"][..], "--design lists all twice"),
        (&["--design", "none,none"][..], "--design lists none twice"),
        (
            &["--design", "none", "--baselines", "tcp,tcp"][..],
            "--baselines lists tcp twice",
        ),
        (
            &["--threading", "interleaved,split,interleaved"][..],
            "--threading lists interleaved twice",
        ),
        (
            &[
                "--threading",
                "interleaved",
                "--own-partition",
                "fabric,in-place,fabric",
            ][..],
            "--own-partition lists fabric twice",
        ),
    ] {
        let mut argv = vec!["bench", "shuffle", "--tuples", "100"];
        argv.extend_from_slice(args);
        let out = namdb(&argv);
        let t = text(&out);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {t}");
        assert!(t.contains(want), "{args:?}: {t}");
    }
}

/// A long run showed nothing between its header and its result, minutes of silence on
/// a large fragment. The node processes now report their phase and the bytes they
/// received, and the benchmark prints a line of them every `--progress-ms` (hidden;
/// a second by default) on stderr while the run goes on.
#[test]
fn a_long_run_shows_its_progress_before_its_result() {
    let (out, rows) = shuffle(&[
        "--backend",
        "shm",
        "--design",
        "MEMQ/WR",
        "--baselines",
        "none",
        "--pattern",
        "repartition",
        "--tuples",
        "500000",
        "--progress-ms",
        "20",
    ]);
    let rows = rows.unwrap_or_else(|| panic!("failed: {}", text(&out)));
    check_rows(&rows, 2, 1, 500_000);
    let stderr = common::stderr(&out);
    let progress = common::progress_between(
        &stderr,
        |l| l.starts_with("[ 1/1]"),
        |l| l.contains("GB/s per node"),
    );
    assert!(!progress.is_empty(), "no progress line: {stderr}");
    // The receivers' counts crossed the process boundary while they ran.
    assert!(
        progress.iter().any(|l| l.contains("shuffling: ")
            && l.contains(" of 15.3 MiB received (")
            && !l.contains("shuffling: 0.0 KiB")),
        "no line of bytes received while shuffling: {stderr}"
    );
}

/// A benchmark stopped by a signal only it receives (`kill PID`, `timeout`; a
/// terminal's Ctrl-C reaches the whole process group) or killed outright runs no code
/// to stop its node processes: they end on their own, and take the socket directory
/// with them. (Before, they ran their job to the end, with nobody to read it.)
#[test]
fn node_processes_end_with_the_benchmark() {
    use std::process::Stdio;
    use std::time::{Duration, Instant};
    for signal in ["-TERM", "-KILL"] {
        let mut bench = Command::new(env!("CARGO_BIN_EXE_namdb"))
            .args(["bench", "shuffle", "--backend", "shm", "--nodes", "2"])
            .args(["--design", "SESQ/SR", "--baselines", "none"])
            .args(["--pattern", "repartition", "--tuples", "5000000"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let parent = bench.id();
        let started = Instant::now();
        let nodes = loop {
            let nodes: Vec<u32> = common::processes_naming("shuffle-node")
                .into_iter()
                .filter(|&pid| common::parent_of(pid) == Some(parent))
                .collect();
            if nodes.len() == 2 {
                break nodes;
            }
            assert!(
                started.elapsed() < Duration::from_secs(120),
                "{signal}: the node processes did not start"
            );
            std::thread::sleep(Duration::from_millis(50));
        };
        let cmdline = std::fs::read(format!("/proc/{}/cmdline", nodes[0])).unwrap();
        let args: Vec<&[u8]> = cmdline.split(|&b| b == 0).collect();
        let at = args.iter().position(|a| *a == b"--socket-dir").unwrap();
        let dir = PathBuf::from(String::from_utf8(args[at + 1].to_vec()).unwrap());
        assert!(dir.is_dir(), "{}", dir.display());
        common::send_signal(parent, signal);
        bench.wait().unwrap();
        let stopped = Instant::now();
        while nodes.iter().any(|&pid| common::alive(pid)) {
            assert!(
                stopped.elapsed() < Duration::from_secs(20),
                "{signal}: node processes {nodes:?} outlived the benchmark"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        assert!(!dir.exists(), "{signal}: {} left behind", dir.display());
    }
}

/// The live children of `pid`.
fn children_of(pid: u32) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&p| common::parent_of(p) == Some(pid) && common::alive(p))
        .collect()
}

/// `scripts/mpi.sh check`: OpenMPI is on PATH.
fn openmpi_installed() -> bool {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/mpi.sh");
    Command::new(script)
        .arg("check")
        .status()
        .expect("scripts/mpi.sh runs")
        .success()
}

/// The MPI baseline reported nothing until its end. Its rank 0 now appends its phase
/// and the tuples it sent to a file between the rounds of the exchange, and the
/// benchmark prints them like the other runs' progress while the run goes on.
#[test]
fn an_mpi_run_shows_its_progress_before_its_result() {
    if !openmpi_installed() {
        eprintln!("OpenMPI is not installed: no MPI run to watch");
        return;
    }
    let (out, rows) = shuffle(&[
        "--design",
        "none",
        "--baselines",
        "mpi",
        "--pattern",
        "repartition",
        // Small messages: tens of thousands of rounds. With 400 000 tuples a quiet
        // machine ran the exchange in less than one 10 ms progress period (CI,
        // 2026-12-07: "shuffling: 0 of 400000" then "verifying"); ten times as many
        // last several periods even so.
        "--tuples",
        "4000000",
        "--message-bytes",
        "256",
        "--progress-ms",
        "10",
    ]);
    let rows = rows.unwrap_or_else(|| panic!("failed: {}", text(&out)));
    check_rows(&rows, 2, 1, 4_000_000);
    let stderr = common::stderr(&out);
    let progress = common::progress_between(
        &stderr,
        |l| l.starts_with("[ 1/1] mpi"),
        |l| l.contains("GB/s per node"),
    );
    assert!(!progress.is_empty(), "no progress line: {stderr}");
    assert!(
        progress
            .iter()
            .any(|l| l.contains("mpi repartition: shuffling: ")
                && l.contains(" of 4.0 M tuples (")
                && !l.contains("(0%)")),
        "no line of tuples sent while shuffling: {stderr}"
    );
}

/// The MPI baseline's mpirun and its ranks end with the benchmark too, however it is
/// stopped. (Before, a benchmark stopped by SIGTERM or SIGKILL left them running.)
#[test]
fn mpi_ends_with_the_benchmark() {
    use std::process::Stdio;
    use std::time::{Duration, Instant};
    if !openmpi_installed() {
        eprintln!("OpenMPI is not installed: no mpirun to stop");
        return;
    }
    for signal in ["-TERM", "-KILL"] {
        let mut bench = Command::new(env!("CARGO_BIN_EXE_namdb"))
            .args(["bench", "shuffle", "--design", "none", "--baselines", "mpi"])
            // Small messages: a run of about half a minute, which mpirun left alone
            // finishes long after the limit below.
            .args(["--tuples", "20000000", "--message-bytes", "128"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let started = Instant::now();
        let (mpirun, ranks) = loop {
            let mpirun = children_of(bench.id());
            if let [mpirun] = mpirun[..] {
                let ranks = children_of(mpirun);
                if ranks.len() == 2 {
                    break (mpirun, ranks);
                }
            }
            assert!(
                started.elapsed() < Duration::from_secs(120),
                "{signal}: mpirun and its ranks did not start"
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        common::send_signal(bench.id(), signal);
        bench.wait().unwrap();
        let stopped = Instant::now();
        let all: Vec<u32> = ranks.iter().copied().chain([mpirun]).collect();
        while all.iter().any(|&pid| common::alive(pid)) {
            assert!(
                stopped.elapsed() < Duration::from_secs(10),
                "{signal}: mpirun and its ranks {all:?} outlived the benchmark"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// `--svg` is created when the run starts (a bad path fails at once); a run
/// interrupted before its figures are drawn removes what it created, parents
/// included, instead of leaving empty directories where figures were expected.
#[test]
fn an_interrupted_run_leaves_no_svg_directory() {
    let dir = tempfile::tempdir().unwrap();
    let svg = dir.path().join("figures/shuffle");
    let mut bench = Command::new(env!("CARGO_BIN_EXE_namdb"));
    bench
        .args(["bench", "shuffle", "--design", "SESQ/SR"])
        .args(["--baselines", "none", "--pattern", "repartition"])
        .args(["--tuples", "20000000", "--svg"])
        .arg(&svg);
    let status = common::interrupt_at_line(&mut bench, " 1/1]", || {
        assert!(svg.is_dir(), "{} was not created", svg.display())
    });
    assert_eq!(status, Some(130));
    assert!(!dir.path().join("figures").exists());
}
