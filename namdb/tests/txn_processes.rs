//! Transactions on memory-server processes: a `Database` opened through the servers'
//! control planes (two shm memory servers, the catalog set up by this process), with
//! verify's workloads checked by both checkers.

mod common;

use common::ServerProcess;
use memory_server::ClusterToken;
use txn::{Options, TxnError};
use verify::anomaly::Findings;
use verify::report::{Model, Verdict};
use verify::txn_store::TxnKv;
use verify::workload::{self, Bank, Checked, ListAppend, RunConfig, Schedule, Workload};

const TOKEN: &str = "namdb txn process test token";

struct Cluster {
    servers: Vec<ServerProcess>,
    token: ClusterToken,
    _dir: tempfile::TempDir,
}

fn cluster(count: usize) -> Cluster {
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, TOKEN).unwrap();
    let servers = (0..count)
        .map(|_| ServerProcess::start("shm", &token_file, &["--size", "64MiB"]))
        .collect();
    Cluster {
        servers,
        token: ClusterToken::new(TOKEN).unwrap(),
        _dir: dir,
    }
}

impl Cluster {
    fn addrs(&self) -> Vec<String> {
        self.servers.iter().map(|s| s.control.clone()).collect()
    }
}

fn check(
    workload: &dyn Workload,
    store: &TxnKv,
    txns: u64,
    seed: u64,
) -> verify::index::HistoryIndex {
    let config = RunConfig {
        sessions: 4,
        txns,
        seed,
        schedule: Schedule::Threads,
    };
    let Checked { run, index, report } =
        workload::run_checked(store, workload, &config, Model::SnapshotIsolation)
            .expect("the workload runs and its history reads back");
    assert!(
        report.whitebox.is_ok(),
        "white-box skipped: {:?}",
        report.whitebox
    );
    assert_eq!(report.verdict(), Verdict::Valid, "\n{report}");
    assert!(run.committed > txns / 4, "{run:?}");
    assert_eq!(run.unknown, 0, "{run:?}");
    index
}

#[test]
fn list_append_and_bank_on_two_shm_memory_server_processes() {
    let c = cluster(2);
    let remote = compute_node::connect(&c.addrs(), &c.token, Options::default()).unwrap();
    assert_eq!(remote.backend, "shm");
    let db = &remote.db;
    assert_eq!(db.servers(), 2);
    let table = db
        .create_table(TxnKv::table_spec("lists", 1 << 14))
        .unwrap();
    assert_eq!(table.partitions.len(), 2);
    assert!(
        table.partitions.iter().any(|p| p.server == 1),
        "a partition on the second server"
    );
    let txns = std::env::var("TXN_VERIFY_TXNS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(4000);
    check(
        &ListAppend::default(),
        &TxnKv::new(db.clone(), table),
        txns,
        21,
    );

    let accounts = db.create_table(TxnKv::table_spec("bank", 1 << 12)).unwrap();
    let bank = Bank::default();
    let index = check(&bank, &TxnKv::new(db.clone(), accounts), txns / 5, 22);
    let mut findings = Findings::default();
    bank.check(&index, &mut findings);
    assert!(findings.is_empty(), "{findings:?}");
}

#[test]
fn a_second_compute_node_finds_tables_and_data_of_the_first() {
    let c = cluster(2);
    let a = compute_node::connect(&c.addrs(), &c.token, Options::default()).unwrap();
    let t =
        a.db.create_table(txn::TableSpec::new("shared", 16, 1024))
            .unwrap();
    let mut client = a.db.client().unwrap();
    client
        .run(0, |x| {
            for k in 0..100u64 {
                x.insert(&t, k, k.to_le_bytes().to_vec())?;
            }
            Ok(())
        })
        .unwrap();
    drop(client);

    // Another compute node: its own sessions, devices and oracle slot; the catalog
    // (already set up) tells it where the table and the oracle are.
    let b = compute_node::connect(&c.addrs(), &c.token, Options::default()).unwrap();
    let tb = b.db.table("shared").unwrap();
    assert_eq!(tb.id, t.id);
    let mut client = b.db.client().unwrap();
    let mut x = client.begin().unwrap();
    let rows = x.scan(&tb, |_, _| true).unwrap();
    assert_eq!(rows.len(), 100);
    assert!(matches!(
        x.insert(&tb, 5, vec![1]),
        Err(TxnError::DuplicateKey { .. })
    ));
    drop(x);
    assert!(matches!(b.db.table("nope"), Err(TxnError::NotFound(_))));
    // The servers listed in another order are a different cluster: refused, not
    // corrupted.
    let mut reversed = c.addrs();
    reversed.reverse();
    assert!(compute_node::connect(&reversed, &c.token, Options::default()).is_err());
}

#[test]
fn a_wrong_token_or_a_dead_server_is_a_clear_error() {
    let c = cluster(1);
    let bad = ClusterToken::new("not the cluster's token").unwrap();
    let err = compute_node::connect(&c.addrs(), &bad, Options::default())
        .err()
        .expect("refused");
    assert!(err.to_string().contains(&c.addrs()[0]), "{err}");
    let err = compute_node::connect(&["127.0.0.1:1".to_string()], &c.token, Options::default())
        .err()
        .expect("refused");
    assert!(err.to_string().contains("127.0.0.1:1"), "{err}");
}
