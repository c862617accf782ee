//! Transactions on durable memory-server processes (`--data-dir`): a compute node
//! commits, a memory server is killed with SIGKILL and started again on its data
//! directory, the compute node reconnects, and every acknowledged commit is there;
//! the first node to reconnect repairs what the restart lost (a restart of server 0
//! also starts the oracle afresh above every earlier commit).

mod common;

use common::ServerProcess;
use common::bank::{KEYS, OPENING, create, open, state, total, work};
use memory_server::ClusterToken;
use std::path::Path;
use std::time::Duration;

const TOKEN: &str = "namdb durable cluster test token";

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

fn addrs(servers: &[ServerProcess]) -> Vec<String> {
    servers.iter().map(|s| s.control.clone()).collect()
}

#[test]
fn acknowledged_commits_survive_memory_server_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, TOKEN).unwrap();
    let token = ClusterToken::new(TOKEN).unwrap();
    let data: Vec<_> = (0..2).map(|i| dir.path().join(format!("ms{i}"))).collect();
    let mut servers: Vec<ServerProcess> = data.iter().map(|d| start(&token_file, d)).collect();

    let cluster = open(&addrs(&servers), &token);
    assert!(cluster.db.is_durable());
    let t = create(&cluster);
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
        let cluster = open(&addrs(&servers), &token);
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
        assert_eq!(total(&state(&cluster, &t)), OPENING * KEYS as i64);
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
