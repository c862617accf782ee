//! Replicated memory-server processes (`--backup`, `--backup-at`): each logical server
//! is a primary and a backup process; a compute node (this test) commits, the primary
//! of a server is killed with SIGKILL, the node reconnects (which promotes the backup),
//! and every acknowledged commit is there; new commits go on. With data directories
//! and without (replication alone survives the loss of one process).

mod common;

use common::bank::{KEYS, OPENING, create, open, state, total, work};
use common::{ServerProcess, Stopped};
use memory_server::ClusterToken;
use std::path::Path;
use std::time::{Duration, Instant};

const TOKEN: &str = "namdb replication cluster test token";

/// A primary and its backup: the backup first, since the primary attaches at start.
struct Pair {
    primary: ServerProcess,
    backup: ServerProcess,
}

fn server(token_file: &Path, data_dir: Option<&Path>, extra: &[&str]) -> ServerProcess {
    let mut args = vec!["--size", "32MiB"];
    if let Some(d) = data_dir {
        args.extend([
            "--data-dir",
            d.to_str().unwrap(),
            "--checkpoint-interval",
            "0.2",
        ]);
    }
    args.extend_from_slice(extra);
    ServerProcess::start("shm", token_file, &args)
}

fn pair(token_file: &Path, dir: Option<&Path>, i: usize) -> Pair {
    let data = |role: &str| dir.map(|d| d.join(format!("ms{i}-{role}")));
    let backup = server(token_file, data("b").as_deref(), &["--backup"]);
    assert!(backup.line.contains(", backup"), "{}", backup.line);
    let primary = server(
        token_file,
        data("p").as_deref(),
        &["--backup-at", &backup.control],
    );
    assert!(
        primary.line.contains("primary of backup"),
        "{}",
        primary.line
    );
    Pair { primary, backup }
}

fn addrs(pairs: &[Pair]) -> Vec<String> {
    pairs
        .iter()
        .map(|p| format!("{}|{}", p.primary.control, p.backup.control))
        .collect()
}

fn failover(data_dirs: bool) {
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, TOKEN).unwrap();
    let token = ClusterToken::new(TOKEN).unwrap();
    let data = data_dirs.then(|| dir.path());
    let mut pairs: Vec<Pair> = (0..2).map(|i| pair(&token_file, data, i)).collect();

    let cluster = open(&addrs(&pairs), &token);
    assert!(cluster.db.is_durable(), "replicated servers persist");
    let t = create(&cluster);
    let mut last_cid = work(&cluster, &t, 0, 300);
    let mut expected = state(&cluster, &t);
    drop(cluster);

    let mut round = 300;
    for victim in [1usize, 0] {
        let killed = Instant::now();
        pairs[victim].primary.kill_9();
        let cluster = open(&addrs(&pairs), &token);
        let report = cluster
            .db
            .restart_report()
            .expect("the failover changed the server's boot: restart recovery ran");
        assert_eq!(report.restarted, vec![victim], "{report:?}");
        if victim == 0 {
            assert!(report.oracle_from.unwrap() > last_cid, "{report:?}");
        }
        assert_eq!(
            cluster.servers[victim].addr(),
            pairs[victim].backup.control,
            "server {victim} is served by its promoted backup"
        );
        let t = cluster.db.table("accounts").unwrap();
        // The first commit after the failover.
        let cid = work(&cluster, &t, round, 1);
        eprintln!(
            "failover of server {victim} (data dirs: {data_dirs}): {:?} from kill -9 to the first commit",
            killed.elapsed()
        );
        assert!(cid > last_cid, "{cid} after {last_cid}");
        let now = state(&cluster, &t);
        // Everything acknowledged before the kill, plus the one transfer just made.
        let diff: Vec<usize> = (0..expected.len())
            .filter(|&k| now[k] != expected[k])
            .collect();
        assert!(
            diff.len() <= 2,
            "after failing over server {victim}: {diff:?}"
        );
        assert_eq!(total(&now), OPENING * KEYS as i64);
        assert_eq!(now[KEYS as usize..], expected[KEYS as usize..]);
        let cid = work(&cluster, &t, round + 1, 100);
        last_cid = cid;
        round += 101;
        expected = state(&cluster, &t);
        assert!(cluster.db.locked_records().unwrap().is_empty());
        drop(cluster);
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_backup_takes_over_with_every_acknowledged_commit_durable() {
    failover(true);
}

#[test]
fn a_backup_takes_over_with_every_acknowledged_commit_in_memory() {
    failover(false);
}

/// A primary killed with SIGKILL ends no session: its backup keeps the dead primary's
/// session until the backup's session lease (3 s here) runs out, and refuses another
/// primary while it is live (a second live primary must not take the backup over:
/// memory-server's tests/replication.rs). Started again at once on its data directory,
/// the primary waits for that session to lapse, says so, and attaches; every commit
/// acknowledged before the kill is there.
#[test]
fn a_primary_killed_and_started_again_at_once_attaches_once_its_old_session_lapsed() {
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, TOKEN).unwrap();
    let token = ClusterToken::new(TOKEN).unwrap();
    let (primary_dir, backup_dir) = (dir.path().join("p"), dir.path().join("b"));
    let backup = server(
        &token_file,
        Some(&backup_dir),
        &["--backup", "--session-lease", "3"],
    );
    let at_backup = ["--backup-at", backup.control.as_str()];
    let mut primary = server(&token_file, Some(&primary_dir), &at_backup);
    let cluster = open(&[format!("{}|{}", primary.control, backup.control)], &token);
    let t = create(&cluster);
    work(&cluster, &t, 0, 100);
    let expected = state(&cluster, &t);
    drop(cluster);

    primary.kill_9();
    let killed = Instant::now();
    let mut again = server(&token_file, Some(&primary_dir), &at_backup);
    assert!(again.line.contains("primary of backup"), "{}", again.line);
    let stderr = again.stderr();
    assert!(
        stderr.contains("serves another primary whose session is live; waiting up to"),
        "{stderr}"
    );
    eprintln!("attached again {:?} after the kill", killed.elapsed());
    let cluster = open(&[format!("{}|{}", again.control, backup.control)], &token);
    let t = cluster.db.table("accounts").unwrap();
    assert_eq!(state(&cluster, &t), expected);
    work(&cluster, &t, 100, 10);
}

/// A child process killed and reaped when dropped.
struct Reaped(std::process::Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A compute node started while its server's backup is stopped (SIGSTOP: it keeps its
/// connections and answers nothing) cannot open the database, whose opening persists
/// and a primary acknowledges nothing its backup has not applied; it says so and
/// exits instead of waiting for the backup: a warning naming the backup it could not
/// ask, then the primary's error naming it. Nothing committed before is lost, and once
/// the backup goes on a compute node starts again. The old code waited for the
/// backup's Hello until the HTTP/2 keep-alive gave up, saying nothing about it.
#[test]
fn a_compute_node_started_while_a_backup_is_stopped_says_so_instead_of_waiting() {
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, TOKEN).unwrap();
    let token = ClusterToken::new(TOKEN).unwrap();
    let mut pairs = [pair(&token_file, None, 0)];
    let addrs = addrs(&pairs);
    let cluster = open(&addrs, &token);
    let t = create(&cluster);
    work(&cluster, &t, 0, 50);
    let expected = state(&cluster, &t);
    drop(cluster);

    let backup = pairs[0].backup.control.clone();
    let stopped = Stopped::stop(pairs[0].backup.child.id());
    let mut node = Reaped(
        std::process::Command::new(env!("CARGO_BIN_EXE_namdb"))
            .args(["compute-node", "--listen", "127.0.0.1:0", "--workers", "1"])
            .arg("--memory-servers")
            .arg(&addrs[0])
            .arg("--token-file")
            .arg(&token_file)
            .env("RUST_BACKTRACE", "0")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap(),
    );
    // Drained as it comes, so the node never blocks on a full pipe.
    let mut pipe = node.0.stderr.take().unwrap();
    let said = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = std::io::Read::read_to_string(&mut pipe, &mut text);
        text
    });
    let deadline = Instant::now() + Duration::from_secs(300);
    let status = loop {
        if let Some(status) = node.0.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = node.0.kill();
            let _ = node.0.wait();
            panic!(
                "the compute node still starts after 300 s; it said {}",
                said.join().unwrap()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let said = said.join().unwrap();
    let mut out = String::new();
    std::io::Read::read_to_string(&mut node.0.stdout.take().unwrap(), &mut out).unwrap();
    assert!(!status.success(), "it started: {out}{said}");
    assert!(!out.contains("listening on"), "{out}");
    assert!(
        said.contains(&format!(
            "cannot ask the backup memory server whether it was promoted (the memory server \
             at {backup} did not answer within"
        )),
        "{said}"
    );
    assert!(
        said.contains("cannot open the database") && said.contains(&format!("backup at {backup}")),
        "{said}"
    );

    // The backup goes on: the primary attaches to it again by itself and copies its
    // state there; then a compute node starts and every commit is there.
    drop(stopped);
    let deadline = Instant::now() + Duration::from_secs(120);
    while !pairs[0]
        .primary
        .stderr()
        .contains("backup holds this primary's whole state again")
    {
        assert!(
            Instant::now() < deadline,
            "the primary never attached to its backup again: {}",
            pairs[0].primary.stderr()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let node = ServerProcess::compute_node(&addrs, &token_file, &["--workers", "1"]);
    drop(node);
    let cluster = open(&addrs, &token);
    let t = cluster.db.table("accounts").unwrap();
    assert_eq!(state(&cluster, &t), expected);
}

/// A primary stopped with SIGSTOP keeps its connections open and answers nothing, so
/// only a bound tells it from a slow one. While it ran, idle, its backup heard from it
/// every few hundred milliseconds (its session renewals); once stopped, a compute node
/// connecting waits `PRIMARY_ANSWER_LIMIT` for its Hello, asks the backup, which has
/// not heard from it for longer than `PRIMARY_SILENCE`, and promotes the backup, with
/// every acknowledged commit there. Before, the node waited for the HTTP/2
/// keep-alive to give up (half a minute) and promoted without asking.
#[test]
fn a_stopped_primary_is_failed_over_once_its_backup_has_not_heard_from_it() {
    use compute_node::memory_servers::{BackupView, PRIMARY_SILENCE};
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, TOKEN).unwrap();
    let token = ClusterToken::new(TOKEN).unwrap();
    let pairs = [pair(&token_file, None, 0)];
    let addrs = addrs(&pairs);
    let cluster = open(&addrs, &token);
    let t = create(&cluster);
    work(&cluster, &t, 0, 100);
    let expected = state(&cluster, &t);
    drop(cluster);

    // Idle, the primary still renews its session at the backup.
    std::thread::sleep(PRIMARY_SILENCE / 2 + Duration::from_millis(500));
    let ask = || {
        memory_server::blocking::Client::connect_within(
            &pairs[0].backup.control,
            &token,
            Duration::from_secs(10),
        )
        .unwrap()
        .server()
        .clone()
    };
    let heard = ask().primary_silence.expect("a primary is attached");
    assert!(
        heard < Duration::from_secs(1),
        "an idle primary was last heard from {heard:?} ago"
    );
    assert!(matches!(
        BackupView::of(&ask()),
        BackupView::PrimaryAlive(_)
    ));

    let stopped = Stopped::stop(pairs[0].primary.child.id());
    let cluster = open(&addrs, &token);
    assert_eq!(cluster.servers[0].addr(), pairs[0].backup.control);
    assert_eq!(cluster.promotions.len(), 1, "{:?}", cluster.promotions);
    let why = &cluster.promotions[0];
    assert!(
        why.contains("did not answer within") && why.contains("has not heard from it for"),
        "{why}"
    );
    let t = cluster.db.table("accounts").unwrap();
    assert_eq!(state(&cluster, &t), expected);
    work(&cluster, &t, 100, 10);
    drop(cluster);
    drop(stopped);
}
