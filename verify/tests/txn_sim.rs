//! verify's workloads run against txn through [`verify::txn_store::TxnKv`], recorded,
//! read back and checked by the white-box and Elle-style checkers, on the sim with
//! torn reads injected.

use fabric::sim::{Faults, SimConfig};
use std::time::Duration;
use txn::{Database, Options};
use verify::anomaly::Findings;
use verify::report::{Model, Verdict};
use verify::txn_store::TxnKv;
use verify::workload::{self, Bank, Checked, ListAppend, RunConfig, Schedule, Workload};

/// The store and its database (kept to report what recovery did when a check fails).
fn store(seed: u64) -> (TxnKv, Database) {
    let db = Database::embedded(Options {
        sim: SimConfig {
            faults: Faults {
                tear_probability: 0.2,
                tear_pause: Duration::from_micros(5),
                ..Faults::default()
            },
            seed,
            ..SimConfig::default()
        },
        ..Options::default()
    })
    .unwrap();
    let table = db.create_table(TxnKv::table_spec("kv", 1 << 16)).unwrap();
    (TxnKv::new(db.clone(), table), db)
}

fn check(
    workload: &dyn Workload,
    txns: u64,
    seed: u64,
) -> (verify::workload::RunSummary, verify::index::HistoryIndex) {
    let (store, db) = store(seed);
    let config = RunConfig {
        sessions: 4,
        txns,
        seed,
        schedule: Schedule::Threads,
    };
    let Checked { run, index, report } =
        workload::run_checked(&store, workload, &config, Model::SnapshotIsolation)
            .expect("the workload runs and its history reads back");
    assert!(
        report.whitebox.is_ok(),
        "white-box skipped: {:?}",
        report.whitebox
    );
    // Whether slots were fenced and recovered during the run: what to look at first
    // for an anomaly that only a lapsed lease explains (a stale read in one CI run).
    assert_eq!(
        report.verdict(),
        Verdict::Valid,
        "\n{report}\nrecoveries during the run: {:?}",
        db.recoveries()
    );
    assert!(
        run.committed > 0 && run.aborted > 0,
        "no contention: {run:?}"
    );
    assert_eq!(
        run.unknown,
        0,
        "{run:?}: {:?}; recoveries during the run: {:?}",
        store.indeterminate_reasons(),
        db.recoveries()
    );
    (run, index)
}

/// Transactions per run: 100 000 unless `TXN_VERIFY_TXNS` says otherwise.
fn txns() -> u64 {
    std::env::var("TXN_VERIFY_TXNS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(100_000)
}

#[test]
fn list_append_is_snapshot_isolation() {
    check(&ListAppend::default(), txns(), 11);
}

#[test]
fn bank_is_snapshot_isolation_and_balanced() {
    let bank = Bank::default();
    let (_, index) = check(&bank, txns(), 12);
    let mut findings = Findings::default();
    bank.check(&index, &mut findings);
    assert!(findings.is_empty(), "{findings:?}");
}

/// A fenced commit whose recovery stalls once begun (the recovering node starved too)
/// is not decided within the store's patience: it is recorded as indeterminate (the
/// history's `unknown`), naming the commit, not as committed or aborted and without
/// waiting on; released, the recovery decides it, and later reads show that.
#[test]
fn a_fenced_commit_not_decided_in_time_is_recorded_as_indeterminate() {
    use std::time::Instant;
    use verify::history::ReadValue;
    use verify::store::{StoreError, TxnStore};
    for (point, committed) in [("after-lock", false), ("after-log", true)] {
        let (db, table) = short_lease_db();
        // Well short of `txn::recovery::TAKEOVER`: a commit that waited on for the
        // recovery would take it over and record what it decided.
        let store = TxnKv::new(db.clone(), table.clone())
            .with_fenced_outcome_patience(Duration::from_millis(300));
        let fencer = {
            let table = table.clone();
            txn::crash::Fencer::spawn(&db, move |x| x.put(&table, 5, vec![0; 9])).unwrap()
        };
        let mut session = store.open_session();
        let mut t = store.begin(&mut session).unwrap();
        store.write(&mut t, "x", 7).unwrap();
        let hold = txn::crash::starve_at_with_recovery_held_on_this_thread(
            &db,
            point,
            Duration::from_secs(30),
        )
        .unwrap();
        let outcome = store.commit(&mut session, t);
        let cid = hold.cid().expect("the commit stalled");
        let why = match outcome {
            Err(StoreError::Indeterminate(why)) => why,
            other => panic!("{point}: not indeterminate: {other:?}"),
        };
        assert!(
            why.contains(&format!("commit {cid} abandoned to recovery"))
                && why.contains(&format!("the outcome of commit {cid} is still unknown")),
            "{point}: {why}"
        );
        // The reason is kept for a report, as the history keeps only the outcome.
        assert_eq!(store.indeterminate_reasons(), [why], "{point}");
        assert!(hold.is_holding(), "{point}: the recovery was taken over");
        hold.release();
        let deadline = Instant::now() + Duration::from_secs(30);
        while db.recoveries().is_empty() || !db.locked_records().unwrap().is_empty() {
            assert!(Instant::now() < deadline, "{point}: never recovered");
            std::thread::sleep(Duration::from_millis(2));
        }
        fencer.stop().unwrap();
        let mut t = store.begin(&mut session).unwrap();
        let read = store.read(&mut t, "x").unwrap();
        store.abort(&mut session, t);
        let expected = if committed {
            ReadValue::Register(7)
        } else {
            ReadValue::Absent
        };
        assert_eq!(read.value, expected, "{point}");
        if committed {
            assert_eq!(read.version, Some(cid), "{point}");
        }
    }
}

/// A commit whose worker's thread stalls past its lease (starved) is fenced and left
/// to recovery; the store records what recovery made of it rather than "unknown":
/// committed (at its CID, seen by the session's next transaction) when it stalled
/// after its log record, rolled back (an abort, nothing written) before.
#[test]
fn a_fenced_commit_is_recorded_as_what_recovery_made_of_it() {
    use verify::history::ReadValue;
    use verify::store::{StoreError, TxnStore};
    for (point, committed) in [("after-lock", false), ("after-log", true)] {
        let (db, table) = short_lease_db();
        let store = TxnKv::new(db.clone(), table.clone());
        let fencer = {
            let table = table.clone();
            txn::crash::Fencer::spawn(&db, move |x| x.put(&table, 5, vec![0; 9])).unwrap()
        };
        let mut session = store.open_session();
        let mut t = store.begin(&mut session).unwrap();
        store.write(&mut t, "x", 7).unwrap();
        txn::crash::starve_at_on_this_thread(&db, point, Duration::from_secs(30)).unwrap();
        let outcome = store.commit(&mut session, t);
        assert!(!db.recoveries().is_empty(), "{point}: not fenced");
        let mut t = store.begin(&mut session).unwrap();
        let read = store.read(&mut t, "x").unwrap();
        store.abort(&mut session, t);
        fencer.stop().unwrap();
        if committed {
            let cid = outcome.unwrap_or_else(|e| panic!("{point}: {e:?}"));
            assert!(cid.is_some(), "{point}");
            assert_eq!(read.value, ReadValue::Register(7), "{point}");
            assert_eq!(read.version, cid, "{point}");
        } else {
            match outcome {
                Err(StoreError::Other(why)) => assert!(why.contains("rolled back"), "{why}"),
                other => panic!("{point}: {other:?}"),
            }
            assert_eq!(read.value, ReadValue::Absent, "{point}");
        }
        assert!(db.locked_records().unwrap().is_empty(), "{point}");
    }
}

/// A database whose oracle leases are short (80 ms), so that a stalled commit is
/// fenced soon, whose sessions do not wait for their commits to be visible (the next
/// snapshot must include a commit by itself), and a table for [`TxnKv`].
fn short_lease_db() -> (Database, std::sync::Arc<txn::Table>) {
    let db = Database::embedded(Options {
        oracle: timestamp::OracleConfig {
            tick_interval: Duration::from_millis(2),
            lease_timeout: Duration::from_millis(80),
            ..timestamp::OracleConfig::default()
        },
        wait_visible: false,
        ..Options::default()
    })
    .unwrap();
    let table = db.create_table(TxnKv::table_spec("kv", 1 << 10)).unwrap();
    (db, table)
}

/// A session whose worker cannot be opened when the session is (here its device
/// cannot be made) opens one at a later begin, the failed begin reported as that
/// transaction's. Before, opening the session panicked: a chaos node starting up amid
/// faults died with "a client: Fabric(Completion { status: RetryExceeded, … })".
#[test]
fn a_session_opened_without_a_worker_gets_one_at_a_later_begin() {
    use fabric::Device;
    use fabric::sim::SimNetwork;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use verify::store::{StoreError, TxnStore};
    let net = SimNetwork::new(SimConfig::default());
    let refusing = Arc::new(AtomicBool::new(false));
    let devices: txn::DeviceFactory = {
        let refusing = refusing.clone();
        Arc::new(move || {
            if refusing.load(Ordering::SeqCst) {
                return Err(txn::TxnError::Invalid("no device now".into()));
            }
            Ok(net.add_node() as Arc<dyn Device>)
        })
    };
    let db = Database::embedded(Options {
        devices: Some(devices),
        ..Options::default()
    })
    .unwrap();
    let table = db.create_table(TxnKv::table_spec("kv", 1 << 10)).unwrap();
    let store = TxnKv::new(db.clone(), table);
    refusing.store(true, Ordering::SeqCst);
    let mut session = store.open_session();
    match store.begin(&mut session) {
        Err(StoreError::Other(why)) => assert!(
            why.contains("no worker for this session") && why.contains("no device now"),
            "{why}"
        ),
        Err(e) => panic!("not the missing worker: {e:?}"),
        Ok(_) => panic!("a worker without a device"),
    }
    refusing.store(false, Ordering::SeqCst);
    let txn = store
        .begin(&mut session)
        .expect("a worker once a device can be made");
    store.abort(&mut session, txn);
}
