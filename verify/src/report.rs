//! Runs both checkers on an indexed history and states the verdict. When the white-box
//! checker cannot run, register reads get the value check ([`registers`]) instead, and
//! those it cannot place in a snapshot keep the verdict from being plain valid.

use crate::anomaly::Findings;
use crate::elle::{self, ElleSummary};
use crate::index::{HistoryIndex, HistoryStats};
use crate::registers::{self, RegisterSummary};
use crate::whitebox::{self, WhiteBoxSummary};
use std::fmt;
use std::time::{Duration, Instant};

/// The consistency model a history is checked against.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Model {
    /// Snapshot isolation: snapshot reads and first-committer-wins; write skew allowed.
    #[default]
    SnapshotIsolation,
}

impl Model {
    pub fn name(self) -> &'static str {
        match self {
            Model::SnapshotIsolation => "snapshot isolation",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    Valid,
    /// Something the model forbids was found.
    Invalid,
    /// Nothing forbidden was found, but part of the history could not be checked: a
    /// cycle search ran out of budget, or register reads could not be checked against
    /// a snapshot (no timestamps for the white-box checker).
    Inconclusive,
}

pub struct Report {
    pub model: Model,
    pub stats: HistoryStats,
    /// What the white-box checker covered, or why it could not run.
    pub whitebox: Result<WhiteBoxSummary, String>,
    pub blackbox: ElleSummary,
    /// The value check of register reads, run when the white-box checker could not.
    pub registers: Option<RegisterSummary>,
    pub findings: Findings,
    pub whitebox_time: Duration,
    pub blackbox_time: Duration,
}

/// Checks `index` with both checkers.
pub fn check(index: &HistoryIndex, model: Model) -> Report {
    let mut findings = index.findings.clone();
    let started = Instant::now();
    let whitebox = whitebox::check(index, &mut findings);
    // The white-box read rule covers everything the value check would find, so running
    // both would report each bad register read twice.
    let registers = whitebox
        .is_err()
        .then(|| registers::check(index, &mut findings));
    let whitebox_time = started.elapsed();
    let started = Instant::now();
    let blackbox = elle::check(index, &mut findings);
    let blackbox_time = started.elapsed();
    Report {
        model,
        stats: index.stats().clone(),
        whitebox,
        blackbox,
        registers,
        findings,
        whitebox_time,
        blackbox_time,
    }
}

impl Report {
    pub fn verdict(&self) -> Verdict {
        match self.model {
            Model::SnapshotIsolation if self.findings.violates_si() => Verdict::Invalid,
            _ if !self.blackbox.incomplete.is_empty() => Verdict::Inconclusive,
            _ if self.unchecked_register_reads() > 0 => Verdict::Inconclusive,
            _ => Verdict::Valid,
        }
    }

    /// Register reads no checker could hold to a snapshot: their values were checked,
    /// but without timestamps a stale or future read looks like a correct one.
    pub fn unchecked_register_reads(&self) -> u64 {
        self.registers.as_ref().map_or(0, |r| r.unplaced)
    }
}

/// `1 register read was` / `2 register reads were`.
fn register_reads(n: u64) -> String {
    if n == 1 {
        "1 register read was".into()
    } else {
        format!("{n} register reads were")
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        let s = &self.stats;
        let observed = if s.unknown > 0 {
            format!(" ({} of them observed to commit)", s.unknown_observed)
        } else {
            String::new()
        };
        let errors: Vec<String> = s
            .errors
            .iter()
            .map(|(kind, n)| format!("{kind} {n}"))
            .collect();
        let errors = if errors.is_empty() {
            String::new()
        } else {
            format!(" (errors: {})", errors.join(", "))
        };
        writeln!(
            f,
            "history: {} transactions: {} committed, {} aborted, {} unknown{observed}{errors}; \
             {} sessions; {} list keys, {} register keys; {} reads, {} writes",
            s.txns,
            s.committed,
            s.aborted,
            s.unknown,
            s.sessions,
            s.list_keys,
            s.register_keys,
            s.reads,
            s.writes
        )?;
        match &self.whitebox {
            Ok(w) => {
                writeln!(
                    f,
                    "white-box (system timestamps): {} reads checked against {} committed \
                     versions [{:.2} s]",
                    w.reads_checked,
                    w.versions,
                    self.whitebox_time.as_secs_f64()
                )?;
                if let Some(why) = &w.real_time_skipped {
                    writeln!(
                        f,
                        "  real-time order not checked (a transaction need not see a commit \
                         that returned before it began): {why}"
                    )?;
                }
            }
            Err(reason) => writeln!(f, "white-box (system timestamps): skipped, {reason}")?,
        }
        if let Some(r) = &self.registers
            && r.reads_checked + r.unplaced > 0
        {
            writeln!(
                f,
                "  register reads by value alone: {} checked (each must be another \
                 transaction's last write to the key, not aborted); {} not checked against a \
                 snapshot",
                r.reads_checked,
                register_reads(r.unplaced)
            )?;
        }
        let b = &self.blackbox;
        writeln!(
            f,
            "black-box (Elle, list-append): {} list keys, {} dependency edges, {} cyclic \
             components (largest {} transactions) [{:.2} s]",
            b.list_keys,
            b.edges,
            b.components,
            b.largest_component,
            self.blackbox_time.as_secs_f64()
        )?;
        if s.register_keys > 0 {
            let how = if self.whitebox.is_ok() {
                "white-box only"
            } else {
                "by value alone (above)"
            };
            writeln!(
                f,
                "  registers reveal no version order: their reads are checked {how}"
            )?;
        }
        for size in &b.incomplete {
            writeln!(
                f,
                "  a cyclic component of {size} transactions was not fully searched (budget spent)"
            )?;
        }

        if !self.findings.is_empty() {
            writeln!(f, "\nanomalies:")?;
        }
        for (kind, found) in self.findings.iter() {
            let allowed = if kind.allowed_under_si() {
                "allowed under snapshot isolation"
            } else {
                "forbidden"
            };
            writeln!(
                f,
                "  {kind}: {} ({}; {allowed})",
                found.count,
                kind.description()
            )?;
            for (i, example) in found.examples.iter().enumerate() {
                writeln!(f, "    {}. {}", i + 1, example.summary)?;
                for line in &example.details {
                    writeln!(f, "         {line}")?;
                }
            }
            let more = found.count - found.examples.len() as u64;
            if more > 0 {
                writeln!(f, "    … and {more} more")?;
            }
        }

        let counts: Vec<String> = self
            .findings
            .iter()
            .map(|(kind, found)| format!("{kind} {}", found.count))
            .collect();
        if !counts.is_empty() {
            writeln!(f, "\ncounts: {}", counts.join(", "))?;
        }
        let model = match &self.whitebox {
            Ok(w) if w.real_time_skipped.is_some() => {
                format!("{} (real-time order not checked)", self.model.name())
            }
            _ => self.model.name().to_string(),
        };
        match self.verdict() {
            Verdict::Valid => writeln!(f, "verdict: VALID under {model}"),
            Verdict::Inconclusive => {
                let mut gaps = Vec::new();
                if !self.blackbox.incomplete.is_empty() {
                    gaps.push("not every cycle was searched".to_string());
                }
                let unchecked = self.unchecked_register_reads();
                if unchecked > 0 {
                    let reason = self.whitebox.as_ref().err().map_or("", String::as_str);
                    gaps.push(format!(
                        "{} not checked against a snapshot (the white-box checker skipped: \
                         {reason})",
                        register_reads(unchecked)
                    ));
                }
                writeln!(
                    f,
                    "verdict: INCONCLUSIVE under {model}: nothing forbidden found, but {}",
                    gaps.join(", and ")
                )
            }
            Verdict::Invalid => {
                let forbidden: Vec<&str> = self
                    .findings
                    .iter()
                    .filter(|(kind, _)| !kind.allowed_under_si())
                    .map(|(kind, _)| kind.name())
                    .collect();
                writeln!(
                    f,
                    "verdict: INVALID under {model} ({})",
                    forbidden.join(", ")
                )
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::history::Status::*;
    use crate::history::{Op, ReadValue, Status, Txn};
    use crate::index::tests::{append, r, rl, txn, w};
    use proptest::prelude::*;

    /// Operations over a handful of keys and values, so that random histories collide
    /// often: repeated reads, reused elements, reads of aborted writes, cycles.
    fn small_op() -> impl Strategy<Value = Op> {
        let list_read = prop::collection::vec(0..6i64, 0..4).prop_map(ReadValue::List);
        prop_oneof![
            (0..2u8, 0..6i64).prop_map(|(k, element)| Op::Append {
                key: format!("l{k}"),
                element
            }),
            (0..2u8, 0..6i64).prop_map(|(k, value)| Op::Write {
                key: format!("r{k}"),
                value
            }),
            (0..2u8, list_read, prop::option::of(0..8u64)).prop_map(|(k, value, version)| {
                Op::Read {
                    key: format!("l{k}"),
                    value,
                    version,
                }
            }),
            (0..2u8, prop::option::of(0..6i64), prop::option::of(0..8u64)).prop_map(
                |(k, v, version)| {
                    let value = v.map_or(ReadValue::Absent, ReadValue::Register);
                    Op::Read {
                        key: format!("r{k}"),
                        value,
                        version,
                    }
                }
            ),
        ]
    }

    fn small_history() -> impl Strategy<Value = Vec<Txn>> {
        let status = prop_oneof![
            Just(Status::Committed),
            Just(Status::Aborted),
            Just(Status::Unknown)
        ];
        let txn = (
            0..3u64,
            status,
            prop::option::of(0..8u64),
            prop::option::of(0..8u64),
            prop::option::of(0..20u64),
            prop::option::of(0..20u64),
            prop::collection::vec(small_op(), 0..5),
        );
        prop::collection::vec(txn, 0..8).prop_map(|txns| {
            txns.into_iter()
                .enumerate()
                .map(
                    |(i, (session, status, rid, cid, begin_ns, end_ns, ops))| Txn {
                        rid,
                        cid,
                        begin_ns,
                        end_ns,
                        ops,
                        ..Txn::new(i as u64 + 1, session, status)
                    },
                )
                .collect()
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1024))]

        /// Whatever a history holds, indexing it gives an error or a report, and the
        /// report renders: no input may crash the checkers.
        #[test]
        fn any_history_is_checked_without_crashing(txns in small_history()) {
            if let Ok(index) = HistoryIndex::from_txns(txns) {
                let report = check(&index, Model::SnapshotIsolation);
                prop_assert!(report.to_string().contains("verdict: "));
            }
        }
    }

    fn reg(v: i64) -> ReadValue {
        ReadValue::Register(v)
    }

    fn report_of(txns: Vec<Txn>) -> (Verdict, String) {
        let index = HistoryIndex::from_txns(txns).expect("indexes");
        let report = check(&index, Model::SnapshotIsolation);
        (report.verdict(), report.to_string())
    }

    fn assert_contains(text: &str, expected: &[&str]) {
        for e in expected {
            assert!(text.contains(e), "missing {e:?} in:\n{text}");
        }
    }

    #[test]
    fn without_timestamps_a_register_value_nobody_wrote_is_invalid() {
        let (verdict, text) = report_of(vec![
            txn(1, Committed, vec![w("x", 1)]),
            txn(2, Committed, vec![r("x", reg(7))]),
        ]);
        assert_eq!(verdict, Verdict::Invalid, "{text}");
        assert_contains(
            &text,
            &[
                "white-box (system timestamps): skipped, the history carries no timestamps",
                "impossible-read: 1 (a read returned a value the key never had; forbidden)",
                "T2 read x=7, a value no transaction wrote (checked by its value alone)",
                "registers reveal no version order: their reads are checked by value alone",
                "verdict: INVALID under snapshot isolation (impossible-read)",
            ],
        );
    }

    #[test]
    fn without_timestamps_a_committed_read_of_an_aborted_write_is_invalid() {
        let (verdict, text) = report_of(vec![
            txn(1, Aborted, vec![w("x", 1)]),
            txn(2, Committed, vec![r("x", reg(1))]),
        ]);
        assert_eq!(verdict, Verdict::Invalid, "{text}");
        assert_contains(
            &text,
            &[
                "T2 read x=1, written by T1, which aborted",
                "verdict: INVALID under snapshot isolation (uncommitted-read)",
            ],
        );
    }

    #[test]
    fn one_read_without_a_rid_still_gets_its_value_checked() {
        let mut writer = Txn::new(1, 1, Committed);
        (writer.rid, writer.cid) = (Some(0), Some(1));
        writer.ops = vec![w("x", 1)];
        let (verdict, text) = report_of(vec![writer, txn(2, Committed, vec![r("x", reg(7))])]);
        assert_eq!(verdict, Verdict::Invalid, "{text}");
        assert_contains(
            &text,
            &[
                "white-box (system timestamps): skipped, T2 read without a rid",
                "T2 read x=7, a value no transaction wrote",
            ],
        );
    }

    #[test]
    fn register_reads_no_checker_can_place_make_the_verdict_inconclusive() {
        let (verdict, text) = report_of(vec![
            txn(1, Committed, vec![w("x", 1)]),
            txn(2, Committed, vec![r("x", reg(1))]),
            txn(3, Committed, vec![r("x", ReadValue::Absent)]),
        ]);
        assert_eq!(verdict, Verdict::Inconclusive, "{text}");
        assert_contains(
            &text,
            &[
                "register reads by value alone: 1 checked",
                "2 register reads were not checked against a snapshot",
                "verdict: INCONCLUSIVE under snapshot isolation: nothing forbidden found, but \
                 2 register reads were not checked against a snapshot (the white-box checker \
                 skipped: the history carries no timestamps (rid, cid))",
            ],
        );

        // With timestamps the white-box checker places the same reads: valid.
        let mut writer = txn(1, Committed, vec![w("x", 1)]);
        (writer.rid, writer.cid) = (Some(0), Some(1));
        let mut reader = txn(2, Committed, vec![r("x", reg(1))]);
        reader.rid = Some(1);
        let mut null_reader = txn(3, Committed, vec![r("x", ReadValue::Absent)]);
        null_reader.rid = Some(0);
        let timed = vec![writer, reader, null_reader];
        let (verdict, text) = report_of(timed);
        assert_eq!(verdict, Verdict::Valid, "{text}");
        assert_contains(
            &text,
            &["registers reveal no version order: their reads are checked white-box only"],
        );
    }

    #[test]
    fn write_skew_is_valid_and_a_lost_update_is_not() {
        let skew = HistoryIndex::from_txns([
            txn(1, Committed, vec![rl("x", &[]), append("y", 1)]),
            txn(2, Committed, vec![rl("y", &[]), append("x", 1)]),
            txn(3, Committed, vec![rl("x", &[1]), rl("y", &[1])]),
        ])
        .expect("indexes");
        let report = check(&skew, Model::SnapshotIsolation);
        assert_eq!(report.verdict(), Verdict::Valid);
        let text = report.to_string();
        assert!(
            text.contains(
                "white-box (system timestamps): skipped, the history carries no timestamps"
            ),
            "{text}"
        );
        assert!(
            text.contains("G2: 1 (cycle with two or more anti-dependencies"),
            "{text}"
        );
        assert!(
            text.ends_with("verdict: VALID under snapshot isolation\n"),
            "{text}"
        );

        let lost = HistoryIndex::from_txns([
            txn(1, Committed, vec![rl("x", &[]), append("x", 1)]),
            txn(2, Committed, vec![rl("x", &[]), append("x", 2)]),
            txn(3, Committed, vec![rl("x", &[1, 2])]),
        ])
        .expect("indexes");
        let report = check(&lost, Model::SnapshotIsolation);
        assert_eq!(report.verdict(), Verdict::Invalid);
        let text = report.to_string();
        assert!(text.contains("counts: G-single 1"), "{text}");
        assert!(
            text.contains("T2 -rw(x)-> T1: T2 read x=[] and T1 appended 1, the first element of x"),
            "{text}"
        );
        assert!(
            text.ends_with("verdict: INVALID under snapshot isolation (G-single)\n"),
            "{text}"
        );
    }
}
