//! `namdb memory-server` and `namdb token` as a user runs them: the built binary, its
//! exit status and its messages.
//!
//! No cross-process fabric backend exists yet, so no memory-server process can start
//! for real; these tests cover everything up to that point. The SIGTERM test belongs
//! here once `--backend tcp` works.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn namdb(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_namdb"))
        .args(args)
        .output()
        .expect("the namdb binary runs")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn memory_server(backend: &str, token_file: &Path, size: &str) -> Output {
    namdb(&[
        "memory-server",
        "--listen",
        "127.0.0.1:0",
        "--backend",
        backend,
        "--size",
        size,
        "--token-file",
        token_file.to_str().expect("UTF-8 temp path"),
    ])
}

fn token_file(dir: &tempfile::TempDir, content: &str, mode: u32) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let path = dir.path().join("token");
    std::fs::write(&path, content).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
    path
}

const GOOD_TOKEN: &str = "0123456789abcdef0123456789abcdef\n";

#[test]
fn missing_token_file_is_named_with_the_fix() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("absent-token");
    let out = memory_server("tcp", &path, "1MiB");
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("does not exist")
            && err.contains(path.to_str().unwrap())
            && err.contains("namdb token generate"),
        "unclear message: {err}"
    );
}

#[test]
fn short_and_empty_tokens_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let short = token_file(&dir, "too-short\n", 0o600);
    let out = memory_server("tcp", &short, "1MiB");
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("9 bytes") && err.contains("at least 16"),
        "{err}"
    );

    let empty = token_file(&dir, " \n", 0o600);
    let out = memory_server("tcp", &empty, "1MiB");
    assert!(!out.status.success());
    assert!(stderr(&out).contains("is empty"), "{}", stderr(&out));
}

#[test]
fn unknown_backend_lists_the_choices() {
    let dir = tempfile::tempdir().unwrap();
    let path = token_file(&dir, GOOD_TOKEN, 0o600);
    let out = memory_server("infiniband", &path, "1MiB");
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("infiniband")
            && err.contains("sim")
            && err.contains("tcp")
            && err.contains("shm"),
        "{err}"
    );
}

#[test]
fn backends_that_cannot_serve_a_process_say_so() {
    let dir = tempfile::tempdir().unwrap();
    let path = token_file(&dir, GOOD_TOKEN, 0o600);
    for (backend, says) in [
        ("sim", "in-process only"),
        ("tcp", "not available yet"),
        ("shm", "not available yet"),
    ] {
        let out = memory_server(backend, &path, "1MiB");
        assert!(!out.status.success(), "{backend} must not start");
        let err = stderr(&out);
        assert!(err.contains(says), "{backend}: {err}");
        // Nothing claims to be listening.
        assert!(out.stdout.is_empty(), "{backend}: {:?}", out.stdout);
    }
}

#[test]
fn bad_sizes_are_explained() {
    let dir = tempfile::tempdir().unwrap();
    let path = token_file(&dir, GOOD_TOKEN, 0o600);
    let out = memory_server("tcp", &path, "12X");
    assert!(!out.status.success());
    assert!(stderr(&out).contains("unknown unit"), "{}", stderr(&out));
    let out = memory_server("tcp", &path, "1001");
    assert!(!out.status.success());
    assert!(stderr(&out).contains("multiple of 8"), "{}", stderr(&out));
}

#[test]
fn a_token_file_others_can_read_is_warned_about() {
    let dir = tempfile::tempdir().unwrap();
    let path = token_file(&dir, GOOD_TOKEN, 0o644);
    let out = memory_server("tcp", &path, "1MiB");
    let err = stderr(&out);
    assert!(err.contains("0644") && err.contains("chmod 600"), "{err}");
}

#[test]
fn missing_arguments_are_named() {
    let out = namdb(&[
        "memory-server",
        "--listen",
        "127.0.0.1:0",
        "--backend",
        "tcp",
    ]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("--size") && err.contains("--token-file"),
        "{err}"
    );
}

#[test]
fn token_generate_writes_a_private_token_once() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cluster.token");
    let path_arg = path.to_str().unwrap();

    let out = namdb(&["token", "generate", path_arg]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(String::from_utf8_lossy(&out.stdout).contains(path_arg));
    let token = std::fs::read_to_string(&path).unwrap();
    assert_eq!(token.len(), 65, "{token:?}");
    assert!(token.trim_end().chars().all(|c| c.is_ascii_hexdigit()));
    let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);

    let again = namdb(&["token", "generate", path_arg]);
    assert!(!again.status.success());
    assert!(
        stderr(&again).contains("refusing to overwrite"),
        "{}",
        stderr(&again)
    );
    assert_eq!(std::fs::read_to_string(&path).unwrap(), token);

    // The memory server accepts it: what stops it is the backend, not the token.
    let out = memory_server("tcp", &path, "1MiB");
    let err = stderr(&out);
    assert!(err.contains("not available yet"), "{err}");
    assert!(!err.contains("token"), "{err}");
}
