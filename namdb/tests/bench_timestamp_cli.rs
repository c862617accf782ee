//! `namdb bench timestamp` as a user runs it: exit status, JSON fields, errors.

use serde_json::Value;
use std::process::Command;

mod common;

/// Runs `namdb bench timestamp ARGS`, which must succeed.
fn bench(args: &[&str]) -> std::process::Output {
    let out = Command::new(env!("CARGO_BIN_EXE_namdb"))
        .args(["bench", "timestamp"])
        .args(args)
        .output()
        .expect("the namdb binary runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

#[test]
fn short_run_writes_the_json_fields() {
    let path = std::env::temp_dir().join(format!("namdb-bench-ts-{}.json", std::process::id()));
    bench(&[
        "--backend",
        "sim",
        "--slots",
        "3",
        "--threads",
        "2",
        "--duration-ms",
        "50",
        "--json",
        path.to_str().expect("UTF-8 path"),
    ]);
    let text = std::fs::read_to_string(&path).expect("JSON written");
    let _ = std::fs::remove_file(&path);
    let v: Value = serde_json::from_str(&text).expect("JSON object");
    assert_eq!(v["backend"], "sim");
    assert_eq!(v["slots"], 3);
    assert_eq!(v["threads"], 2);
    for f in ["commits_per_sec", "rids_per_sec", "bytes_per_rid"] {
        assert!(v[f].as_f64().expect(f) > 0.0, "{f}: {v}");
    }
    assert!(v["lag_p99"].as_u64().is_some(), "{v}");
    assert!(v["visible_p99_ns"].as_u64().is_some(), "{v}");
    assert!(v["bytes_per_rid"].as_f64().unwrap() <= 512.0, "{v}");
}

#[test]
fn a_duration_over_a_day_is_refused() {
    for bench in ["timestamp", "fabric"] {
        let mut child = Command::new(env!("CARGO_BIN_EXE_namdb"))
            .args(["bench", bench, "--duration-ms", "18446744073709551614"])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("the namdb binary runs");
        // Taken, it would run for ever: give it a while to refuse, then fail.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while child.try_wait().expect("waits").is_none() {
            if std::time::Instant::now() > deadline {
                let _ = child.kill();
                panic!("bench {bench} took --duration-ms 2^64-2 and ran");
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let out = child.wait_with_output().expect("its output");
        assert!(!out.status.success(), "bench {bench} ran");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains("--duration-ms") && stderr.contains("86400000"),
            "{stderr}"
        );
    }
}

#[test]
fn more_threads_than_slots_is_refused() {
    let out = Command::new(env!("CARGO_BIN_EXE_namdb"))
        .args(["bench", "timestamp", "--slots", "1", "--threads", "2"])
        .output()
        .expect("the namdb binary runs");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--slots"));
}

#[test]
fn commit_then_wait_times_visibility() {
    let out = bench(&["--wait", "--duration-ms", "50"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("each commit waits until visible"), "{text}");
    assert!(text.contains("visible after p99"), "{text}");
}

/// The shm backend's sockets live in a temporary directory, which a Ctrl-C used to
/// leave behind (the process ended before any destructor ran).
#[test]
fn an_interrupted_shm_run_leaves_no_socket_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let entries = || std::fs::read_dir(tmp.path()).unwrap().count();
    let code = common::interrupt_when(
        Command::new(env!("CARGO_BIN_EXE_namdb"))
            .args(["bench", "timestamp", "--backend", "shm"])
            .args(["--duration-ms", "60000"])
            .env("TMPDIR", tmp.path()),
        "socket directory",
        || entries() > 0,
        std::time::Duration::from_millis(200),
    );
    assert_eq!(code, Some(130));
    assert_eq!(entries(), 0, "the socket directory is left");
}
