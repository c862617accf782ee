//! The workloads, run against the in-memory reference store and against deliberately
//! broken versions of it, recorded to JSON Lines, read back and checked: the correct
//! store must pass and each broken one must be flagged with the anomaly its bug causes.

use verify::anomaly::{AnomalyKind, Findings};
use verify::history::{HistoryReader, JsonlWriter, Txn};
use verify::index::HistoryIndex;
use verify::mem_store::{Flaw, MemStore};
use verify::recorder::Recorder;
use verify::report::{self, Model, Report, Verdict};
use verify::workload::{self, Bank, Checked, ListAppend, Registers, RunConfig, Schedule, Workload};

trait Counts {
    fn count(&self, kind: AnomalyKind) -> u64;
    fn kinds(&self) -> Vec<(AnomalyKind, u64)>;
}

impl Counts for Checked {
    fn count(&self, kind: AnomalyKind) -> u64 {
        self.report.findings.count(kind)
    }

    fn kinds(&self) -> Vec<(AnomalyKind, u64)> {
        self.report
            .findings
            .iter()
            .map(|(k, f)| (k, f.count))
            .collect()
    }
}

fn run(flaw: Flaw, workload: &dyn Workload, schedule: Schedule, txns: u64, seed: u64) -> Checked {
    let store = MemStore::with_flaw(flaw);
    let config = RunConfig {
        sessions: 8,
        txns,
        seed,
        schedule,
    };
    let checked = workload::run_checked(&store, workload, &config, Model::SnapshotIsolation)
        .expect("the workload runs and its history reads back");
    assert!(
        checked.report.whitebox.is_ok(),
        "white-box skipped: {:?}",
        checked.report.whitebox
    );
    checked
}

fn assert_valid(checked: &Checked) {
    assert_eq!(
        checked.report.verdict(),
        Verdict::Valid,
        "\n{}",
        checked.report
    );
    // Contention, or the run proves little: some transactions must have lost a
    // first-committer-wins race.
    assert!(
        checked.run.aborted > 0 && checked.run.committed > 0,
        "{:?}",
        checked.run
    );
}

#[test]
fn the_reference_store_passes_list_append_interleaved() {
    let checked = run(
        Flaw::None,
        &ListAppend::default(),
        Schedule::Interleaved,
        4000,
        1,
    );
    assert_valid(&checked);
    let stats = checked.index.stats();
    assert_eq!(stats.txns, 4000);
    assert!(stats.list_keys > 100, "keys rotate: {stats:?}");
    assert!(
        checked.report.blackbox.edges > 4000,
        "{:?}",
        checked.report.blackbox
    );
}

#[test]
fn the_reference_store_passes_every_workload_on_threads() {
    for workload in [
        &ListAppend::default() as &dyn Workload,
        &Registers::default(),
        &Bank::default(),
    ] {
        let checked = run(Flaw::None, workload, Schedule::Threads, 3000, 2);
        assert_eq!(
            checked.report.verdict(),
            Verdict::Valid,
            "\n{}",
            checked.report
        );
    }
}

#[test]
fn the_reference_store_keeps_the_bank_balanced() {
    let bank = Bank::default();
    let checked = run(Flaw::None, &bank, Schedule::Interleaved, 3000, 3);
    assert_valid(&checked);
    let mut findings = Findings::default();
    bank.check(&checked.index, &mut findings);
    assert!(findings.is_empty(), "{:?}", findings);
}

#[test]
fn without_first_committer_wins_updates_are_lost() {
    let checked = run(
        Flaw::NoFirstCommitterWins,
        &ListAppend::default(),
        Schedule::Interleaved,
        3000,
        4,
    );
    assert_eq!(checked.report.verdict(), Verdict::Invalid);
    assert!(
        checked.count(AnomalyKind::FirstCommitterWins) > 0,
        "{:?}",
        checked.kinds()
    );
    // Two appends to a list both based on one snapshot: reader -rw-> other writer -ww->
    // reader, one anti-dependency.
    assert!(
        checked.count(AnomalyKind::GSingle) > 0,
        "{:?}",
        checked.kinds()
    );
    for kind in [
        AnomalyKind::G1a,
        AnomalyKind::G1b,
        AnomalyKind::StaleRead,
        AnomalyKind::UncommittedRead,
    ] {
        assert_eq!(checked.count(kind), 0, "{kind}: {:?}", checked.kinds());
    }

    let bank = Bank::default();
    let checked = run(
        Flaw::NoFirstCommitterWins,
        &bank,
        Schedule::Interleaved,
        3000,
        5,
    );
    assert!(
        checked.count(AnomalyKind::FirstCommitterWins) > 0,
        "{:?}",
        checked.kinds()
    );
    let mut findings = Findings::default();
    bank.check(&checked.index, &mut findings);
    assert!(
        findings.count(AnomalyKind::BankTotal) > 0,
        "lost updates lose money: {findings:?}"
    );
}

#[test]
fn reading_uncommitted_data_is_caught_both_ways() {
    let checked = run(
        Flaw::DirtyReads,
        &ListAppend::default(),
        Schedule::Interleaved,
        3000,
        6,
    );
    assert_eq!(checked.report.verdict(), Verdict::Invalid);
    // Black-box: reads of aborted appends and of a transaction's first of two appends.
    assert!(checked.count(AnomalyKind::G1a) > 0, "{:?}", checked.kinds());
    assert!(checked.count(AnomalyKind::G1b) > 0, "{:?}", checked.kinds());
    // White-box: the same reads, named by the writer's fate.
    assert!(
        checked.count(AnomalyKind::UncommittedRead) > 0,
        "{:?}",
        checked.kinds()
    );
    assert!(
        checked.count(AnomalyKind::FutureRead) > 0,
        "{:?}",
        checked.kinds()
    );

    let checked = run(
        Flaw::DirtyReads,
        &Registers::default(),
        Schedule::Interleaved,
        3000,
        7,
    );
    assert!(
        checked.count(AnomalyKind::UncommittedRead) > 0,
        "{:?}",
        checked.kinds()
    );
}

#[test]
fn stale_snapshots_are_caught_by_the_clock_and_the_session() {
    let checked = run(
        Flaw::StaleSnapshots,
        &ListAppend::default(),
        Schedule::Interleaved,
        3000,
        8,
    );
    assert_eq!(checked.report.verdict(), Verdict::Invalid);
    assert!(
        checked.count(AnomalyKind::RealTime) > 0,
        "{:?}",
        checked.kinds()
    );
    assert!(
        checked.count(AnomalyKind::Session) > 0,
        "{:?}",
        checked.kinds()
    );
    // Each snapshot is still consistent and first committer still wins: a valid
    // history under generalized snapshot isolation, which values alone cannot fault.
    for kind in [
        AnomalyKind::G0,
        AnomalyKind::G1a,
        AnomalyKind::G1b,
        AnomalyKind::G1c,
        AnomalyKind::GSingle,
        AnomalyKind::StaleRead,
        AnomalyKind::FirstCommitterWins,
    ] {
        assert_eq!(checked.count(kind), 0, "{kind}: {:?}", checked.kinds());
    }
}

/// Runs `workload` on `store` and checks the history with every timestamp removed, as a
/// recorder that cannot see the store's timestamps would write it.
fn run_without_timestamps(store: &MemStore, workload: &dyn Workload, seed: u64) -> Report {
    let recorder = Recorder::new(JsonlWriter::new(Vec::new()));
    let config = RunConfig {
        sessions: 8,
        txns: 3000,
        seed,
        schedule: Schedule::Interleaved,
    };
    workload::run(store, workload, &recorder, &config).expect("the workload runs");
    let jsonl = recorder.into_sink().into_inner();
    let txns = HistoryReader::new(&jsonl[..]).map(|t| {
        let t = t.expect("the history reads back");
        Txn {
            rid: None,
            cid: None,
            begin_ns: None,
            end_ns: None,
            ..t
        }
    });
    let index = HistoryIndex::from_txns(txns).expect("indexes");
    report::check(&index, Model::SnapshotIsolation)
}

#[test]
fn without_timestamps_dirty_register_reads_are_still_caught() {
    let report = run_without_timestamps(
        &MemStore::with_flaw(Flaw::DirtyReads),
        &Registers::default(),
        7,
    );
    assert!(report.whitebox.is_err());
    assert_eq!(report.verdict(), Verdict::Invalid, "\n{report}");
    // Registers write unique values, so a read of a pending write that then aborted is
    // one no committed transaction wrote.
    assert!(
        report.findings.count(AnomalyKind::UncommittedRead) > 0,
        "\n{report}"
    );

    // The correct store's reads all check out by value, yet none is placed in a
    // snapshot: not valid, not a violation.
    let report = run_without_timestamps(&MemStore::new(), &Registers::default(), 7);
    assert_eq!(report.verdict(), Verdict::Inconclusive, "\n{report}");
    assert!(report.findings.is_empty(), "\n{report}");
    assert!(report.unchecked_register_reads() > 0);
}
