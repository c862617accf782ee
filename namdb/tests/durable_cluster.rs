//! Transactions on durable memory-server processes (`--data-dir`): a compute node
//! commits, a memory server is killed with SIGKILL and started again on its data
//! directory, the compute node reconnects, and every acknowledged commit is there;
//! the first node to reconnect repairs what the restart lost (a restart of server 0
//! also starts the oracle afresh above every earlier commit).

mod common;

use common::ServerProcess;
use compute_node::memory_servers::{RemoteCluster, connect};
use memory_server::ClusterToken;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use txn::index::IndexShape;
use txn::{Options, Table, TableSpec};

const TOKEN: &str = "namdb durable cluster test token";
const KEYS: u64 = 24;

fn start(token_file: &Path, data_dir: &Path) -> ServerProcess {
    ServerProcess::start(
        "shm",
        token_file,
        &[
            "--size",
            "32MiB",
            "--data-dir",
            data_dir.to_str().unwrap(),
            "--checkpoint-interval",
            "0.2",
        ],
    )
}

fn open(servers: &[ServerProcess], token: &ClusterToken) -> RemoteCluster {
    let addrs: Vec<String> = servers.iter().map(|s| s.control.clone()).collect();
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

#[test]
fn acknowledged_commits_survive_memory_server_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, TOKEN).unwrap();
    let token = ClusterToken::new(TOKEN).unwrap();
    let data: Vec<_> = (0..2).map(|i| dir.path().join(format!("ms{i}"))).collect();
    let mut servers: Vec<ServerProcess> = data.iter().map(|d| start(&token_file, d)).collect();

    let cluster = open(&servers, &token);
    assert!(cluster.db.is_durable());
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
        servers[victim].kill_9();
        servers[victim] = start(&token_file, &data[victim]);
        assert!(
            servers[victim].line.contains("restored (boot 2"),
            "{}",
            servers[victim].line
        );
        let cluster = open(&servers, &token);
        let report = cluster
            .db
            .restart_report()
            .expect("the reconnecting node repairs the restart");
        assert_eq!(report.restarted, vec![victim], "{report:?}");
        if victim == 0 {
            assert!(report.oracle_from.unwrap() > last_cid, "{report:?}");
        }
        let t = cluster.db.table("accounts").unwrap();
        assert_eq!(
            state(&cluster, &t),
            expected,
            "after restarting server {victim}"
        );
        let total: i64 = state(&cluster, &t)[..KEYS as usize]
            .iter()
            .map(|v| num(v.clone()))
            .sum();
        assert_eq!(total, 1000 * KEYS as i64);
        // The cluster goes on, above every earlier commit.
        let cid = work(&cluster, &t, round, 100);
        assert!(cid > last_cid, "{cid} after {last_cid}");
        last_cid = cid;
        round += 100;
        expected = state(&cluster, &t);
        assert!(cluster.db.locked_records().unwrap().is_empty());
        drop(cluster);
        std::thread::sleep(Duration::from_millis(50));
    }
}
