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

fn store(seed: u64) -> TxnKv {
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
    TxnKv::new(db, table)
}

fn check(
    workload: &dyn Workload,
    txns: u64,
    seed: u64,
) -> (verify::workload::RunSummary, verify::index::HistoryIndex) {
    let store = store(seed);
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
    assert_eq!(report.verdict(), Verdict::Valid, "\n{report}");
    assert!(
        run.committed > 0 && run.aborted > 0,
        "no contention: {run:?}"
    );
    assert_eq!(run.unknown, 0, "{run:?}");
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
