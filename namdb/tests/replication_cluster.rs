//! Replicated memory-server processes (`--backup`, `--backup-at`): each logical server
//! is a primary and a backup process; a compute node (this test) commits, the primary
//! of a server is killed with SIGKILL, the node reconnects (which promotes the backup),
//! and every acknowledged commit is there; new commits go on. With data directories
//! and without (replication alone survives the loss of one process).

mod common;

use common::ServerProcess;
use compute_node::memory_servers::{RemoteCluster, connect};
use memory_server::ClusterToken;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};
use txn::index::IndexShape;
use txn::{Options, Table, TableSpec};

const TOKEN: &str = "namdb replication cluster test token";
const KEYS: u64 = 24;

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

fn open(pairs: &[Pair], token: &ClusterToken) -> RemoteCluster {
    let addrs: Vec<String> = pairs
        .iter()
        .map(|p| format!("{}|{}", p.primary.control, p.backup.control))
        .collect();
    connect(
        &addrs,
        token,
        Options {
            wait_visible: false,
            ..Options::default()
        },
    )
    .unwrap()
}

fn val(n: i64) -> Vec<u8> {
    n.to_le_bytes().to_vec()
}

fn num(v: Option<Vec<u8>>) -> i64 {
    i64::from_le_bytes(v.expect("present")[..8].try_into().unwrap())
}

/// Every key's value as a snapshot sees it.
fn state(cluster: &RemoteCluster, t: &Arc<Table>) -> Vec<Option<Vec<u8>>> {
    let mut c = cluster.db.client().unwrap();
    let mut x = c.begin().unwrap();
    (0..KEYS)
        .chain(1000..1100)
        .map(|k| x.get(t, k).unwrap())
        .collect()
}

/// Transfers between accounts, with an insert now and then: `rounds` commits.
fn work(cluster: &RemoteCluster, t: &Arc<Table>, from_round: u64, rounds: u64) -> u64 {
    let mut c = cluster.db.client().unwrap();
    for i in from_round..from_round + rounds {
        let (a, b) = (i % KEYS, (i * 5 + 1) % KEYS);
        if a == b {
            continue;
        }
        c.run(10, |x| {
            let va = num(x.get(t, a)?);
            let vb = num(x.get(t, b)?);
            x.put(t, a, val(va - 3))?;
            x.put(t, b, val(vb + 3))?;
            if i % 7 == 0 {
                x.insert(t, 1000 + i % 100, val(i as i64))
                    .or_else(|e| match e {
                        txn::TxnError::DuplicateKey { .. } => Ok(()),
                        e => Err(e),
                    })?;
            }
            Ok(())
        })
        .unwrap();
    }
    c.last_cid()
}

fn failover(data_dirs: bool) {
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, TOKEN).unwrap();
    let token = ClusterToken::new(TOKEN).unwrap();
    let data = data_dirs.then(|| dir.path());
    let mut pairs: Vec<Pair> = (0..2).map(|i| pair(&token_file, data, i)).collect();

    let cluster = open(&pairs, &token);
    assert!(cluster.db.is_durable(), "replicated servers persist");
    let t = cluster
        .db
        .create_table(TableSpec {
            name: "accounts".into(),
            versions: 4,
            value_cap: 16,
            capacity: 4096,
            partitions: 0,
            placement: txn::Placement::RoundRobin,
            index: IndexShape {
                buckets: 256,
                slots: 8,
            },
        })
        .unwrap();
    let mut c = cluster.db.client().unwrap();
    c.run(0, |x| {
        for k in 0..KEYS {
            x.insert(&t, k, val(1000))?;
        }
        Ok(())
    })
    .unwrap();
    drop(c);
    let mut last_cid = work(&cluster, &t, 0, 300);
    let mut expected = state(&cluster, &t);
    drop(cluster);

    let mut round = 300;
    for victim in [1usize, 0] {
        let killed = Instant::now();
        pairs[victim].primary.kill_9();
        let cluster = open(&pairs, &token);
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
        let total: i64 = now[..KEYS as usize].iter().map(|v| num(v.clone())).sum();
        assert_eq!(total, 1000 * KEYS as i64);
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
