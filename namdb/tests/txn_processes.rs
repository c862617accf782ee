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
    cluster_of("shm", count)
}

fn cluster_of(backend: &str, count: usize) -> Cluster {
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, TOKEN).unwrap();
    let servers = (0..count)
        .map(|_| ServerProcess::start(backend, &token_file, &["--size", "64MiB"]))
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

fn num(v: Option<Vec<u8>>) -> u64 {
    u64::from_le_bytes(v.expect("present")[..8].try_into().unwrap())
}

/// A compute node whose worker pauses past its oracle lease between the lease check
/// and the post of an install (descheduled, SIGSTOP, a VM pause), while a compute node
/// of another database (its own lease gates: another process, as far as fencing goes)
/// fences its slot, recovers its commit and writes the record again. Its install must
/// not land after that: before, nothing stopped it, and it put the older version back
/// over the newer one. Now the fencer has every memory server end the paused node's
/// sessions before its fence goes on, so the late install finds its queue pair
/// destroyed.
fn a_node_paused_past_its_lease_is_fenced_at_the_memory_servers(backend: &str) {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;
    let c = cluster_of(backend, 2);
    let options = Options {
        oracle: timestamp::OracleConfig {
            tick_interval: Duration::from_millis(2),
            lease_timeout: Duration::from_millis(150),
            ..timestamp::OracleConfig::default()
        },
        ..Options::default()
    };
    let paused = compute_node::connect(&c.addrs(), &c.token, options.clone()).unwrap();
    let t = paused
        .db
        .create_table(txn::TableSpec::new("fenced", 64, 64))
        .unwrap();
    paused
        .db
        .client()
        .unwrap()
        .run(0, |x| {
            x.insert(&t, 1, 100u64.to_le_bytes().to_vec())?;
            x.insert(&t, 5, 0u64.to_le_bytes().to_vec())
        })
        .unwrap();
    let other = compute_node::connect(&c.addrs(), &c.token, options).unwrap();
    let theirs = other.db.table("fenced").unwrap();
    let fencer = {
        let t = theirs.clone();
        txn::crash::Fencer::spawn(&other.db, move |x| {
            x.put(&t, 5, 1u64.to_le_bytes().to_vec())
        })
        .unwrap()
    };
    let recovered = std::sync::Arc::new(AtomicBool::new(false));
    let stalled = std::sync::Arc::new(std::sync::Mutex::new(None));
    {
        let (db, t, recovered, stalled) = (
            other.db.clone(),
            theirs.clone(),
            recovered.clone(),
            stalled.clone(),
        );
        txn::crash::stall_at_on_this_thread(
            "install-posting",
            Box::new(move |cid| {
                *stalled.lock().unwrap() = Some(cid);
                if db.wait_for_recovery_of(cid, Duration::from_secs(20)) {
                    recovered.store(true, Ordering::SeqCst);
                    // The record moves on while this node still "sleeps".
                    db.client()
                        .unwrap()
                        .run(10, |x| x.put(&t, 1, 500u64.to_le_bytes().to_vec()))
                        .unwrap();
                }
            }),
        )
        .unwrap();
    }
    let mut client = paused.db.client().unwrap();
    let mut x = client.begin().unwrap();
    x.put(&t, 1, 42u64.to_le_bytes().to_vec()).unwrap();
    let committed = x.commit();
    let cid = stalled
        .lock()
        .unwrap()
        .expect("the commit stalled in its install step");
    assert!(
        recovered.load(Ordering::SeqCst),
        "the other node did not recover slot {} while the commit stalled",
        cid % u64::from(other.db.options().slots)
    );
    assert!(
        committed.is_err(),
        "the fenced node's commit reported success: {committed:?}"
    );
    let report = other
        .db
        .recoveries()
        .into_iter()
        .find(|r| u64::from(r.slot) == cid % u64::from(other.db.options().slots))
        .expect("a recovery of the paused node's slot");
    assert_eq!(report.rolled_forward, 1, "{report:?}");
    fencer.stop().unwrap();
    let mut reader = other.db.client().unwrap();
    let mut x = reader.begin().unwrap();
    let (value, version) = (
        num(x.get(&theirs, 1).unwrap()),
        x.get_version(&theirs, 1).unwrap(),
    );
    drop(x);
    assert_eq!(
        value, 500,
        "record 1 at version {version:?}: the fenced node's install (commit {cid}) landed \
         after its recovery"
    );
    // The fenced node's sessions are gone at every server; the other's work on.
    for server in &paused.servers {
        let gone = server
            .keep_alive()
            .expect_err("the fenced node kept its session");
        assert!(gone.to_string().contains("was fenced"), "{gone}");
    }
    for server in &other.servers {
        server.keep_alive().unwrap();
    }
    reader
        .run(3, |x| x.put(&theirs, 1, 43u64.to_le_bytes().to_vec()))
        .unwrap();
}

#[test]
fn a_node_paused_past_its_lease_is_fenced_at_shm_memory_servers() {
    a_node_paused_past_its_lease_is_fenced_at_the_memory_servers("shm");
}

#[test]
fn a_node_paused_past_its_lease_is_fenced_at_tcp_memory_servers() {
    a_node_paused_past_its_lease_is_fenced_at_the_memory_servers("tcp");
}
