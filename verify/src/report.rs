//! Runs both checkers on an indexed history and states the verdict.

use crate::anomaly::Findings;
use crate::elle::{self, ElleSummary};
use crate::index::{HistoryIndex, HistoryStats};
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
    /// Nothing forbidden was found, but a cycle search ran out of budget.
    Inconclusive,
}

pub struct Report {
    pub model: Model,
    pub stats: HistoryStats,
    /// What the white-box checker covered, or why it could not run.
    pub whitebox: Result<WhiteBoxSummary, String>,
    pub blackbox: ElleSummary,
    pub findings: Findings,
    pub whitebox_time: Duration,
    pub blackbox_time: Duration,
}

/// Checks `index` with both checkers.
pub fn check(index: &HistoryIndex, model: Model) -> Report {
    let mut findings = index.findings.clone();
    let started = Instant::now();
    let whitebox = whitebox::check(index, &mut findings);
    let whitebox_time = started.elapsed();
    let started = Instant::now();
    let blackbox = elle::check(index, &mut findings);
    let blackbox_time = started.elapsed();
    Report {
        model,
        stats: index.stats().clone(),
        whitebox,
        blackbox,
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
            _ => Verdict::Valid,
        }
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
            Ok(w) => writeln!(
                f,
                "white-box (system timestamps): {} reads checked against {} committed versions \
                 [{:.2} s]",
                w.reads_checked,
                w.versions,
                self.whitebox_time.as_secs_f64()
            )?,
            Err(reason) => writeln!(f, "white-box (system timestamps): skipped, {reason}")?,
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
            writeln!(
                f,
                "  registers reveal no version order: their reads are checked white-box only"
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
        let model = self.model.name();
        match self.verdict() {
            Verdict::Valid => writeln!(f, "verdict: VALID under {model}"),
            Verdict::Inconclusive => writeln!(
                f,
                "verdict: INCONCLUSIVE under {model}: nothing forbidden found, but not every \
                 cycle was searched"
            ),
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
    use crate::index::tests::{append, rl, txn};
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
