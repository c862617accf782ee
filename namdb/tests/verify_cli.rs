//! `namdb verify` and `namdb bench verify` as a user runs them: the built binary on
//! history files, its exit status, its report and its error messages.

mod common;

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

fn namdb(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_namdb"))
        .args(args)
        .output()
        .expect("the namdb binary runs")
}

/// A history file in the temp directory that no other test (or concurrent run) uses;
/// removed when dropped.
struct TempHistory(PathBuf);

impl TempHistory {
    fn new(name: &str, lines: &[&str]) -> TempHistory {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let path = std::env::temp_dir().join(format!(
            "namdb-verify-{name}-{}-{nanos}.jsonl",
            std::process::id()
        ));
        std::fs::write(&path, lines.join("\n") + "\n").expect("history written");
        TempHistory(path)
    }

    fn path(&self) -> &str {
        self.0.to_str().expect("temp path is UTF-8")
    }
}

impl Drop for TempHistory {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Two sessions appending to x and y with timestamps; T3 sees both; a write skew
/// between T1 and T2 (each read the key the other wrote, before it was written).
const VALID: &[&str] = &[
    r#"{"id":1,"session":1,"status":"committed","rid":0,"cid":1,"begin_ns":10,"end_ns":20,"ops":[{"f":"r","key":"x","value":null},{"f":"append","key":"y","value":1}]}"#,
    r#"{"id":2,"session":2,"status":"committed","rid":0,"cid":2,"begin_ns":11,"end_ns":30,"ops":[{"f":"r","key":"y","value":[]},{"f":"append","key":"x","value":1}]}"#,
    r#"{"id":3,"session":1,"status":"committed","rid":2,"begin_ns":40,"end_ns":50,"ops":[{"f":"r","key":"x","value":[1],"version":2},{"f":"r","key":"y","value":[1],"version":1}]}"#,
    r#"{"id":4,"session":2,"status":"aborted","rid":2,"error":"conflict","begin_ns":41,"end_ns":51,"ops":[{"f":"append","key":"x","value":9}]}"#,
];

#[test]
fn a_valid_history_exits_zero_and_reports_write_skew_as_allowed() {
    let history = TempHistory::new("valid", VALID);
    let out = namdb(&["verify", history.path(), "--model", "si"]);
    let stdout = text(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{stdout}\n{}",
        text(&out.stderr)
    );
    assert!(
        stdout.contains(
            "history: 4 transactions: 3 committed, 1 aborted, 0 unknown (errors: conflict 1)"
        ),
        "{stdout}"
    );
    assert!(
        stdout.contains(
            "white-box (system timestamps): 4 reads checked against 2 committed versions"
        ),
        "{stdout}"
    );
    assert!(stdout.contains("G2: 1 (cycle with two or more anti-dependencies: write skew; allowed under snapshot isolation)"), "{stdout}");
    assert!(
        stdout.contains("verdict: VALID under snapshot isolation"),
        "{stdout}"
    );
    assert!(stdout.contains("checked in "), "{stdout}");
}

#[test]
fn a_lost_update_exits_one_with_its_cycle_explained() {
    let history = TempHistory::new(
        "lost-update",
        &[
            r#"{"id":1,"session":1,"status":"committed","rid":0,"cid":1,"ops":[{"f":"r","key":"x","value":null},{"f":"append","key":"x","value":1}]}"#,
            r#"{"id":2,"session":2,"status":"committed","rid":0,"cid":2,"ops":[{"f":"r","key":"x","value":null},{"f":"append","key":"x","value":2}]}"#,
            r#"{"id":3,"session":1,"status":"committed","rid":2,"ops":[{"f":"r","key":"x","value":[1,2]}]}"#,
        ],
    );
    let out = namdb(&["verify", history.path()]);
    let stdout = text(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    for expected in [
        "G-single: 1",
        "T2 -rw(x)-> T1: T2 read x=[] and T1 appended 1, the first element of x",
        "T1 -ww(x)-> T2: T2 appended 2 right after T1's 1 in x's version order",
        "first-committer-wins: 1",
        "T1 and T2 both wrote x and both committed",
        "counts: G-single 1, first-committer-wins 1",
        "verdict: INVALID under snapshot isolation (G-single, first-committer-wins)",
    ] {
        assert!(
            stdout.contains(expected),
            "missing {expected:?} in:\n{stdout}"
        );
    }
}

#[test]
fn a_malformed_line_exits_two_naming_the_line() {
    let history = TempHistory::new(
        "malformed",
        &[
            VALID[0],
            "",
            r#"{"id":2,"session":2,"status":"committed","ops":[{"f":"append","key":"x","value":"one"}]}"#,
        ],
    );
    let out = namdb(&["verify", history.path()]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("is not a usable history: line 3, column "),
        "{stderr}"
    );
    assert!(
        stderr.contains("an integer, a list of integers or null"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(out.stdout.is_empty());
}

#[test]
fn a_repeated_id_and_a_missing_file_are_clear_errors() {
    let history = TempHistory::new("repeated", &[VALID[0], VALID[0]]);
    let out = namdb(&["verify", history.path()]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("line 2: transaction 1: the id appears twice in the history"),
        "{stderr}"
    );

    // Nothing to check is not a valid history.
    let empty = TempHistory::new("empty", &["", "   "]);
    let out = namdb(&["verify", empty.path()]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("holds no transactions: there is nothing to check"),
        "{stderr}"
    );

    let out = namdb(&["verify", "/nonexistent/history.jsonl"]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("cannot open /nonexistent/history.jsonl"),
        "{stderr}"
    );
}

/// Runs `namdb verify` on `lines`; returns the exit status and standard output.
fn verify_lines(name: &str, lines: &[&str]) -> (Option<i32>, String) {
    let history = TempHistory::new(name, lines);
    let out = namdb(&["verify", history.path()]);
    let stdout = text(&out.stdout);
    assert!(out.stderr.is_empty(), "{}", text(&out.stderr));
    (out.status.code(), stdout)
}

#[test]
fn without_timestamps_a_register_read_of_a_value_nobody_wrote_exits_one() {
    let (code, stdout) = verify_lines(
        "garbage-register",
        &[
            r#"{"id":1,"session":1,"status":"committed","ops":[{"f":"w","key":"x","value":1}]}"#,
            r#"{"id":2,"session":2,"status":"committed","ops":[{"f":"r","key":"x","value":7}]}"#,
        ],
    );
    assert_eq!(code, Some(1), "{stdout}");
    for expected in [
        "impossible-read: 1",
        "T2 read x=7, a value no transaction wrote (checked by its value alone)",
        "verdict: INVALID under snapshot isolation (impossible-read)",
    ] {
        assert!(
            stdout.contains(expected),
            "missing {expected:?} in:\n{stdout}"
        );
    }
}

#[test]
fn without_timestamps_a_committed_read_of_an_aborted_write_exits_one() {
    let (code, stdout) = verify_lines(
        "aborted-register",
        &[
            r#"{"id":1,"session":1,"status":"aborted","ops":[{"f":"w","key":"x","value":1}]}"#,
            r#"{"id":2,"session":2,"status":"committed","ops":[{"f":"r","key":"x","value":1}]}"#,
        ],
    );
    assert_eq!(code, Some(1), "{stdout}");
    for expected in [
        "uncommitted-read: 1",
        "T2 read x=1, written by T1, which aborted",
        "verdict: INVALID under snapshot isolation (uncommitted-read)",
    ] {
        assert!(
            stdout.contains(expected),
            "missing {expected:?} in:\n{stdout}"
        );
    }
}

#[test]
fn register_reads_without_timestamps_are_inconclusive_not_valid() {
    // The read's value is right, but whether x=1 was the newest version its snapshot
    // held needs timestamps; one transaction without a rid is enough to lose them.
    let (code, stdout) = verify_lines(
        "unplaced-register",
        &[
            r#"{"id":1,"session":1,"status":"committed","rid":0,"cid":1,"ops":[{"f":"w","key":"x","value":1}]}"#,
            r#"{"id":2,"session":2,"status":"committed","ops":[{"f":"r","key":"x","value":1}]}"#,
        ],
    );
    assert_eq!(code, Some(3), "{stdout}");
    for expected in [
        "white-box (system timestamps): skipped, T2 read without a rid",
        "register reads by value alone: 1 checked",
        "verdict: INCONCLUSIVE under snapshot isolation: nothing forbidden found, but 1 \
         register read was not checked against a snapshot (the white-box checker skipped: T2 \
         read without a rid)",
    ] {
        assert!(
            stdout.contains(expected),
            "missing {expected:?} in:\n{stdout}"
        );
    }
    assert!(!stdout.contains("VALID under"), "{stdout}");
}

/// Before, "line 1: cannot read the history: Is a directory (os error 21)", as if the
/// history were broken at its first line.
#[test]
fn a_directory_exits_two_saying_a_history_file_was_expected() {
    let dir = std::env::temp_dir();
    let shown = dir.to_str().expect("temp path is UTF-8");
    let out = namdb(&["verify", shown]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "{shown} is a directory; expected a history file (JSON lines"
        )),
        "{stderr}"
    );
    assert!(!stderr.contains("line 1"), "{stderr}");
}

#[test]
fn a_line_that_is_not_an_object_exits_two_naming_the_line() {
    let history = TempHistory::new("array-line", &[VALID[0], r#"[1,2,"committed"]"#]);
    let out = namdb(&["verify", history.path()]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains(
            "is not a usable history: line 2, column 1: invalid type: sequence, expected a \
             JSON object (one transaction)"
        ),
        "{stderr}"
    );
    assert!(out.stdout.is_empty());
}

#[test]
fn a_history_can_come_from_standard_input() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_namdb"))
        .args(["verify", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the namdb binary runs");
    child
        .stdin
        .take()
        .expect("stdin is piped")
        .write_all((VALID.join("\n") + "\n").as_bytes())
        .expect("history written");
    let out = child.wait_with_output().expect("namdb finishes");
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("verdict: VALID"));
}

#[test]
fn bench_verify_generates_and_checks_a_history() {
    let out = namdb(&["bench", "verify", "--txns", "3000", "--runs", "2"]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    assert_eq!(stdout.matches("run ").count(), 2, "{stdout}");
    assert!(stdout.contains("verify: 3000 transactions ("), "{stdout}");
    assert!(stdout.contains("median of 2"), "{stdout}");
}

#[test]
fn bench_verify_refuses_a_history_larger_than_the_disk() {
    let tmp = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_namdb"))
        .args(["bench", "verify", "--txns", "18446744073709551615"])
        .env("TMPDIR", tmp.path())
        .output()
        .unwrap();
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("a history of 18446744073709551615 transactions needs about"),
        "{stderr}"
    );
    assert!(stderr.contains("use at most about --txns "), "{stderr}");
    assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 0);
}

#[test]
fn bench_verify_keeps_its_history_only_where_asked() {
    let dir = tempfile::tempdir().unwrap();
    let history = dir.path().join("h.jsonl");
    let out = namdb(&[
        "bench",
        "verify",
        "--txns",
        "2000",
        "--runs",
        "1",
        "--history",
        history.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let kept = namdb(&["verify", history.to_str().unwrap()]);
    assert_eq!(kept.status.code(), Some(0), "{}", text(&kept.stderr));
    assert!(text(&kept.stdout).contains("verdict: VALID"));

    // Interrupted while it writes hundreds of megabytes: nothing stays behind.
    let tmp = tempfile::tempdir().unwrap();
    let stderr = tempfile::NamedTempFile::new().unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_namdb"))
        .args(["bench", "verify", "--txns", "3000000", "--runs", "1"])
        .env("TMPDIR", tmp.path())
        .stdout(Stdio::null())
        .stderr(stderr.reopen().unwrap())
        .spawn()
        .unwrap();
    let started = std::time::Instant::now();
    while !std::fs::read_to_string(stderr.path())
        .unwrap()
        .contains("generating")
    {
        assert!(
            started.elapsed().as_secs() < 30,
            "no sign of generation: {}",
            std::fs::read_to_string(stderr.path()).unwrap()
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    // Well into the generation, whose file is then megabytes long.
    std::thread::sleep(std::time::Duration::from_millis(500));
    assert_eq!(child.try_wait().unwrap(), None, "finished too soon");
    common::send_signal(child.id(), "-INT");
    child.wait().unwrap();
    let left: Vec<_> = std::fs::read_dir(tmp.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}
