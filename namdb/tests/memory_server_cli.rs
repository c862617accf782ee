//! `namdb memory-server` and `namdb token` as a user runs them: the built binary, its
//! exit status and its messages.
//!
//! A real server process on the tcp backend is started, used by a client in this
//! process over gRPC and the fabric, and stopped with SIGTERM.

mod common;

use common::{send_signal, start_server, stop_and_wait};
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
    {
        let (backend, says) = ("sim", "in-process only");
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
    // More than the host has: an error, where `fallocate` once woke the OOM killer.
    for backend in ["tcp", "shm"] {
        let out = namdb(&[
            "memory-server",
            "--listen",
            "127.0.0.1:0",
            "--backend",
            backend,
            "--size",
            "4TiB",
            "--region-size",
            "4TiB",
            "--token-file",
            path.to_str().unwrap(),
        ]);
        assert!(!out.status.success());
        let err = stderr(&out);
        assert!(
            err.contains("more than this host can back"),
            "{backend}: {err}"
        );
    }
}

#[test]
fn a_token_file_others_can_read_is_warned_about() {
    let dir = tempfile::tempdir().unwrap();
    let path = token_file(&dir, GOOD_TOKEN, 0o644);
    // sim stops right after reading the token, so the run ends with the warning printed.
    let out = memory_server("sim", &path, "1MiB");
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
    let out = memory_server("sim", &path, "1MiB");
    let err = stderr(&out);
    assert!(err.contains("in-process only"), "{err}");
    assert!(!err.contains("token"), "{err}");
}

#[test]
fn a_tcp_memory_server_serves_another_process_and_stops_on_sigterm() {
    serve_another_process_then_stop("tcp", |token, _| {
        fabric::tcp::TcpDevice::bind("127.0.0.1:0", token).unwrap()
    });
}

#[test]
fn an_shm_memory_server_serves_another_process_and_stops_on_sigterm() {
    serve_another_process_then_stop("shm", |token, dir| {
        fabric::shm::ShmDevice::bind(dir.join("client.sock"), token).unwrap()
    });
}

/// Starts a `backend` server process, uses it from this process through the control
/// plane and a client device made by `client`, stops it with SIGTERM, and checks the
/// client then sees a clean error.
fn serve_another_process_then_stop(
    backend: &str,
    client_device: impl Fn(&[u8], &Path) -> std::sync::Arc<dyn fabric::Device>,
) {
    use fabric::{Access, SendWr, Src, WcStatus};
    use memory_server::ClusterToken;
    let dir = tempfile::tempdir().unwrap();
    let path = token_file(&dir, GOOD_TOKEN, 0o600);
    let mut server = start_server(backend, &path);

    let token = ClusterToken::from_file(&path).unwrap();
    let client = memory_server::blocking::Client::connect(&server.control, &token).unwrap();
    assert_eq!(client.server().backend, backend);
    // Started without --allow-remote-verbs, it keeps its device to itself.
    let other = memory_server::blocking::Client::connect(&server.control, &token).unwrap();
    let refused = memory_server::RemoteDevice::new(other)
        .err()
        .expect("refused");
    assert!(
        refused.to_string().contains("--allow-remote-verbs"),
        "{refused}"
    );
    let regions = client.list_regions().unwrap();
    let data = regions.data().next().expect("a data region").remote;
    let device = client_device(token.secret(), dir.path());
    let cq = device.create_cq(64).unwrap();
    let (qp, _) = client.connect_qp(device.as_ref(), &cq).unwrap();
    let local = device.register(64, Access::ALL).unwrap();
    let run = |wr: SendWr<'_>| fabric::conformance::exec(&qp, &cq, wr);

    assert_eq!(
        run(SendWr::write(
            1,
            Src::Inline(b"in another process"),
            data.at(64)
        ))
        .status,
        WcStatus::Success
    );
    assert_eq!(
        run(SendWr::read(2, local.buf(0, 18), data.at(64))).status,
        WcStatus::Success
    );
    assert_eq!(local.to_vec(0, 18).unwrap(), b"in another process");
    assert_eq!(
        run(SendWr::cas(3, local.buf(24, 8), data.at(0), 0, 7)).status,
        WcStatus::Success
    );
    assert_eq!(
        run(SendWr::fetch_add(4, local.buf(32, 8), data.at(0), 1)).status,
        WcStatus::Success
    );
    assert_eq!(local.load_u64(32).unwrap(), 7);
    let out_of_bounds = run(SendWr::read(5, local.buf(0, 8), data.at(data.len)));
    assert_eq!(out_of_bounds.status, WcStatus::RemoteAccess);
    // The error broke the queue pair; recovering dials the server afresh.
    qp.recover().unwrap();
    assert_eq!(
        run(SendWr::read(8, local.buf(0, 8), data.at(0))).status,
        WcStatus::Success
    );
    assert_eq!(local.load_u64(0).unwrap(), 8);

    send_signal(server.child.id(), "-TERM");
    let exit = server.child.wait().unwrap();
    assert!(exit.success(), "{exit:?}");
    let err = server.stderr();
    assert!(err.contains("memory server stopped"), "{err}");

    // The server is gone: the next request fails cleanly, the rest are flushed.
    let wc = run(SendWr::read(6, local.buf(0, 8), data.at(0)));
    assert_eq!(wc.status, WcStatus::RetryExceeded, "{wc:?}");
    assert_eq!(
        run(SendWr::read(7, local.buf(0, 8), data.at(0))).status,
        WcStatus::WrFlush
    );
}

#[test]
fn a_wildcard_data_path_is_refused_with_the_fix() {
    let dir = tempfile::tempdir().unwrap();
    let path = token_file(&dir, GOOD_TOKEN, 0o600);
    let out = namdb(&[
        "memory-server",
        "--listen",
        "0.0.0.0:0",
        "--backend",
        "tcp",
        "--size",
        "1MiB",
        "--token-file",
        path.to_str().unwrap(),
    ]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("wildcard") && err.contains("--data-listen"),
        "{err}"
    );
    assert!(out.stdout.is_empty(), "nothing claims to be listening");
}

#[test]
fn a_flag_the_backend_would_ignore_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = token_file(&dir, GOOD_TOKEN, 0o600);
    let token = path.to_str().unwrap();
    for (backend, flag, value, says) in [
        (
            "shm",
            "--data-listen",
            "127.0.0.1:0",
            "--data-listen is for the tcp and verbs backends, and this server runs --backend shm",
        ),
        (
            "tcp",
            "--socket",
            "/tmp/x.sock",
            "--socket is for the shm backend, and this server runs --backend tcp",
        ),
        (
            "tcp",
            "--rdma-device",
            "rxe0",
            "--rdma-device is for the verbs backend",
        ),
        (
            "shm",
            "--gid-index",
            "1",
            "--gid-index is for the verbs backend",
        ),
    ] {
        let out = namdb(&[
            "memory-server",
            "--listen",
            "127.0.0.1:0",
            "--backend",
            backend,
            "--size",
            "1MiB",
            "--token-file",
            token,
            flag,
            value,
        ]);
        assert!(!out.status.success(), "{backend} {flag}");
        let err = stderr(&out);
        assert!(err.contains(says), "{backend} {flag}: {err}");
        assert!(out.stdout.is_empty(), "nothing claims to be listening");
    }
}

/// A memory server stopped with SIGSTOP keeps its connections open but answers
/// nothing: a call to it fails (the HTTP/2 keep-alive finds it silent) instead of
/// hanging until the server goes on.
#[test]
fn a_call_to_a_stopped_memory_server_fails_instead_of_hanging() {
    let dir = tempfile::tempdir().unwrap();
    let path = token_file(&dir, GOOD_TOKEN, 0o600);
    let server = start_server("tcp", &path);
    let token = memory_server::ClusterToken::from_file(&path).unwrap();
    let client = memory_server::blocking::Client::connect(&server.control, &token).unwrap();
    client.keep_alive().unwrap();
    let pid = server.child.id();
    stop_and_wait(pid);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(client.keep_alive());
    });
    let answer = rx.recv_timeout(std::time::Duration::from_secs(120));
    send_signal(pid, "-CONT");
    let err = answer
        .expect("the call to the stopped server still hangs after 120 s")
        .expect_err("a stopped server answered");
    let said = err.to_string();
    assert!(!said.is_empty(), "{said}");
}

/// The data path of a stopped tcp memory server: its soft-NIC keeps the connection open
/// and answers nothing. A READ to it used to stay outstanding for ever; it now fails
/// with `RetryExceeded` once the queue pair's transport timeout passes without a word,
/// and once the server goes on, a recovered queue pair reads what was written before.
#[test]
fn a_read_from_a_stopped_tcp_memory_server_fails_after_the_transport_timeout() {
    use fabric::{Access, Device, QpConfig, SendWr, Src, WcStatus};
    use std::time::{Duration, Instant};
    let dir = tempfile::tempdir().unwrap();
    let path = token_file(&dir, GOOD_TOKEN, 0o600);
    let mut server = start_server("tcp", &path);
    let token = memory_server::ClusterToken::from_file(&path).unwrap();
    let client = memory_server::blocking::Client::connect(&server.control, &token).unwrap();
    let data = client
        .list_regions()
        .unwrap()
        .data()
        .next()
        .expect("a data region")
        .remote;
    let device = fabric::tcp::TcpDevice::bind("127.0.0.1:0", token.secret()).unwrap();
    let cq = device.create_cq(64).unwrap();
    let timeout = Duration::from_millis(500);
    let config = QpConfig {
        transport_timeout: timeout,
        ..QpConfig::rc(&cq)
    };
    let (qp, _) = client
        .connect_qp_with_config(device.as_ref(), &config)
        .unwrap();
    let local = device.register(64, Access::ALL).unwrap();
    let run = |wr: SendWr<'_>| fabric::conformance::exec(&qp, &cq, wr);
    let written = run(SendWr::write(
        1,
        Src::Inline(b"before the stop"),
        data.at(64),
    ));
    assert_eq!(written.status, WcStatus::Success);

    let pid = server.child.id();
    stop_and_wait(pid);
    let started = Instant::now();
    let wc = run(SendWr::read(2, local.buf(0, 15), data.at(64)));
    let waited = started.elapsed();
    send_signal(pid, "-CONT");
    assert_eq!(wc.status, WcStatus::RetryExceeded, "{wc:?}");
    assert!(waited >= timeout, "failed after {waited:?}");

    qp.recover().unwrap();
    assert_eq!(
        run(SendWr::read(3, local.buf(0, 15), data.at(64))).status,
        WcStatus::Success
    );
    assert_eq!(local.to_vec(0, 15).unwrap(), b"before the stop");
    send_signal(pid, "-TERM");
    assert!(server.child.wait().unwrap().success());
}

/// `--backup-of` names a server that takes no backup (a standalone one here, and a
/// server that does not run): the new server exits, with the refusal and why, instead
/// of waiting as a backup nobody attaches to.
#[test]
fn a_backup_of_a_server_that_was_not_promoted_exits_with_the_refusal() {
    let dir = tempfile::tempdir().unwrap();
    let token = token_file(&dir, GOOD_TOKEN, 0o600);
    let standalone = start_server("tcp", &token);
    let backup_of = |addr: &str| {
        let mut args = small_tcp_server(&token);
        args.extend(["--backup-of", addr]);
        namdb(&args)
    };
    let o = backup_of(&standalone.control);
    assert!(!o.status.success());
    let said = stderr(&o);
    assert!(
        said.contains(&format!(
            "the server at {} did not take this one as its backup",
            standalone.control
        )) && said.contains("only a promoted server takes a new backup while it runs"),
        "{said}"
    );
    assert!(
        !String::from_utf8_lossy(&o.stdout).contains("listening on"),
        "it never served"
    );
    let nobody = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = nobody.local_addr().unwrap().to_string();
    drop(nobody);
    let o = backup_of(&addr);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains(&format!("cannot reach the promoted server at {addr}")),
        "{}",
        stderr(&o)
    );
}

/// `--rejoin-when-fenced` watches the other server of a replicated pair, so a
/// standalone server refuses the flag before serving rather than never rejoining.
#[test]
fn rejoin_when_fenced_on_a_server_without_a_pair_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let token = token_file(&dir, GOOD_TOKEN, 0o600);
    let mut args = small_tcp_server(&token);
    args.push("--rejoin-when-fenced");
    let o = namdb(&args);
    assert!(!o.status.success());
    let said = stderr(&o);
    assert!(
        said.contains("--rejoin-when-fenced is for a server of a replicated pair"),
        "{said}"
    );
    assert!(
        !String::from_utf8_lossy(&o.stdout).contains("listening on"),
        "it never served"
    );
}

/// The arguments of a 4 MiB memory server on tcp at a port of its choosing.
fn small_tcp_server(token: &std::path::Path) -> Vec<&str> {
    vec![
        "memory-server",
        "--listen",
        "127.0.0.1:0",
        "--backend",
        "tcp",
        "--size",
        "4MiB",
        "--token-file",
        token.to_str().unwrap(),
    ]
}
