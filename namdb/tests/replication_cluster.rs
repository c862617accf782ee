//! Replicated memory-server processes (`--backup`, `--backup-at`): each logical server
//! is a primary and a backup process; a compute node (this test) commits, the primary
//! of a server is killed with SIGKILL, the node reconnects (which promotes the backup),
//! and every acknowledged commit is there; new commits go on. With data directories
//! and without (replication alone survives the loss of one process).

mod common;

use common::ServerProcess;
use common::bank::{KEYS, OPENING, create, open, state, total, work};
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
