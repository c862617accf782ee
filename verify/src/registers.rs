//! What register reads show by their values alone, for histories the white-box checker
//! cannot replay (no `rid`/`cid`, or some missing).
//!
//! Registers reveal no version order, so without timestamps nothing can say whether a
//! read saw the right version. Its value can still say where it came from: a read of a
//! register must return `null` or a value another transaction wrote as its last write to
//! the key (its own writes were checked while indexing). So, with the white-box names,
//! since these are the same reads the white-box checker would report:
//!
//! - `uncommitted-read`: the value was written only by aborted transactions (G1a when
//!   the reader committed);
//! - `intermediate-read`: only by transactions that overwrote it before ending (G1b);
//! - `impossible-read`: by no other transaction at all.
//!
//! A transaction of unknown outcome may have committed, so its last write explains a
//! read (the read shows it did commit). Everything else about a register read (stale,
//! future, first-committer-wins) needs timestamps: the reads that pass here are counted
//! as not checked against a snapshot, and the report's verdict says so.

use crate::anomaly::{AnomalyKind, Explained, Findings};
use crate::history::Status;
use crate::index::{HistoryIndex, KeyKind, ReadRec, Seen};
use std::collections::HashMap;

/// What the value check covered.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RegisterSummary {
    /// Register reads whose value was checked.
    pub reads_checked: u64,
    /// Register reads that nothing here could fault but that could still be wrong for
    /// their snapshot (stale or from the future): a checked value, or `null` on a key
    /// another transaction wrote.
    pub unplaced: u64,
}

/// Up to two distinct transactions, enough to find one that is not the reader.
#[derive(Clone, Copy, Default)]
struct Two([Option<(u32, u32)>; 2]);

impl Two {
    /// Keeps `(txn, write)` unless its transaction is already kept or two are.
    fn add(&mut self, txn: u32, write: u32) {
        for slot in &mut self.0 {
            match slot {
                Some((t, _)) if *t == txn => return,
                Some(_) => {}
                None => {
                    *slot = Some((txn, write));
                    return;
                }
            }
        }
    }

    /// A kept write by a transaction other than `reader`.
    fn other_than(&self, reader: u32) -> Option<u32> {
        self.0
            .iter()
            .flatten()
            .find(|(t, _)| *t != reader)
            .map(|&(_, w)| w)
    }
}

/// The writes of one value to one register, by what the value can explain.
#[derive(Default)]
struct ValueWriters {
    /// Last writes to the key by transactions that committed or may have.
    last: Two,
    /// Writes by aborted transactions.
    aborted: Two,
    /// Earlier writes, overwritten within the same (not aborted) transaction.
    overwritten: Two,
}

impl ValueWriters {
    fn any(&self) -> bool {
        [self.last, self.aborted, self.overwritten]
            .iter()
            .any(|two| two.0[0].is_some())
    }
}

/// Checks every register read's value; adds what it finds to `findings`.
pub fn check(index: &HistoryIndex, findings: &mut Findings) -> RegisterSummary {
    let mut summary = RegisterSummary::default();
    let is_register = |key: u32| index.keys[key as usize].kind == KeyKind::Register;
    if !index.reads.iter().any(|r| is_register(r.key)) {
        return summary;
    }
    let aborted = |txn: u32| index.txns[txn as usize].status == Status::Aborted;
    // Hashed by (key, value), not searched per read: a store that returns one bad value
    // to many reads, or a bank's repeated balances, would make searching quadratic.
    let mut by_value: HashMap<(u32, i64), ValueWriters> = HashMap::new();
    // Per key, transactions whose write might be visible: a `null` read of a key one of
    // them wrote may be stale.
    let mut key_writers: Vec<Two> = vec![Two::default(); index.keys.len()];
    for (w, write) in index.writes.iter().enumerate() {
        if write.append {
            continue;
        }
        let (w, txn) = (w as u32, write.txn);
        let entry = by_value.entry((write.key, write.value)).or_default();
        if aborted(txn) {
            entry.aborted.add(txn, w);
        } else {
            key_writers[write.key as usize].add(txn, w);
            if write.last_in_txn {
                entry.last.add(txn, w);
            } else {
                entry.overwritten.add(txn, w);
            }
        }
    }
    let none = ValueWriters::default();
    for read in &index.reads {
        if !is_register(read.key) {
            continue;
        }
        let value = match read.seen {
            Seen::Value(v) => v,
            Seen::Absent => {
                if key_writers[read.key as usize]
                    .other_than(read.txn)
                    .is_some()
                {
                    summary.unplaced += 1;
                }
                continue;
            }
            // Own writes and contradictions were settled while indexing.
            _ => continue,
        };
        summary.reads_checked += 1;
        let writers = by_value.get(&(read.key, value)).unwrap_or(&none);
        if writers.last.other_than(read.txn).is_some() {
            summary.unplaced += 1;
            continue;
        }
        let (kind, how) = if let Some(w) = writers.aborted.other_than(read.txn) {
            let writer = index.label(index.writes[w as usize].txn);
            (
                AnomalyKind::UncommittedRead,
                format!("written by {writer}, which aborted"),
            )
        } else if let Some(w) = writers.overwritten.other_than(read.txn) {
            (
                AnomalyKind::IntermediateRead,
                overwritten(index, w as usize),
            )
        } else if writers.any() {
            (
                AnomalyKind::ImpossibleRead,
                "a value no other transaction wrote (it wrote it itself, after this read)".into(),
            )
        } else {
            (
                AnomalyKind::ImpossibleRead,
                "a value no transaction wrote".into(),
            )
        };
        findings.add(kind, || explain(index, read, value, &how));
    }
    summary
}

/// `which T1 overwrote with 20 before committing`, naming the value that replaced it.
fn overwritten(index: &HistoryIndex, w: usize) -> String {
    let write = &index.writes[w];
    let writer = index.label(write.txn);
    let later = index.writes[w + 1..]
        .iter()
        .take_while(|x| x.txn == write.txn)
        .find(|x| x.key == write.key && !x.append)
        .map_or(String::new(), |x| format!(" with {}", x.value));
    let ending = match index.txns[write.txn as usize].status {
        Status::Committed => "before committing",
        _ => "before it ended",
    };
    format!("which {writer} overwrote{later} {ending}")
}

fn explain(index: &HistoryIndex, read: &ReadRec, value: i64, how: &str) -> Explained {
    let meta = &index.txns[read.txn as usize];
    let key = index.key_name(read.key);
    Explained::new(
        format!(
            "{} read {key}={value}, {how} (checked by its value alone)",
            index.label(read.txn)
        ),
        vec![meta.id],
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::history::ReadValue;
    use crate::index::tests::{r, txn, w};
    use Status::*;

    fn reg(v: i64) -> ReadValue {
        ReadValue::Register(v)
    }

    fn run(txns: Vec<crate::history::Txn>) -> (RegisterSummary, Findings) {
        let index = HistoryIndex::from_txns(txns).expect("indexes");
        let mut findings = Findings::default();
        let summary = check(&index, &mut findings);
        (summary, findings)
    }

    fn kinds(findings: &Findings) -> Vec<(AnomalyKind, u64)> {
        findings.iter().map(|(k, f)| (k, f.count)).collect()
    }

    fn summary_of(findings: &Findings, kind: AnomalyKind) -> String {
        findings
            .iter()
            .find(|(k, _)| *k == kind)
            .expect("found")
            .1
            .examples[0]
            .summary
            .clone()
    }

    #[test]
    fn reads_of_committed_values_pass_but_stay_unplaced() {
        let (summary, findings) = run(vec![
            txn(1, Committed, vec![w("x", 1)]),
            txn(
                2,
                Committed,
                vec![r("x", reg(1)), r("y", ReadValue::Absent)],
            ),
            // Of unknown outcome: reading its write shows it committed.
            txn(3, Unknown, vec![w("x", 2)]),
            txn(4, Aborted, vec![r("x", reg(2)), r("x", reg(2))]),
            // Null before anyone else's write may be stale: unplaced.
            txn(5, Committed, vec![r("x", ReadValue::Absent), w("x", 3)]),
        ]);
        assert!(findings.is_empty(), "{:?}", kinds(&findings));
        assert_eq!(
            summary,
            RegisterSummary {
                reads_checked: 3,
                unplaced: 4
            }
        );
    }

    #[test]
    fn a_value_nobody_wrote_is_an_impossible_read() {
        let (summary, findings) = run(vec![
            txn(1, Committed, vec![w("x", 1)]),
            txn(2, Committed, vec![r("x", reg(7))]),
            txn(3, Aborted, vec![r("x", reg(8))]),
            txn(4, Committed, vec![r("x", reg(9)), w("x", 9)]),
        ]);
        assert_eq!(kinds(&findings), vec![(AnomalyKind::ImpossibleRead, 3)]);
        let (_, found) = findings.iter().next().expect("found");
        assert_eq!(
            found.examples[0].summary,
            "T2 read x=7, a value no transaction wrote (checked by its value alone)"
        );
        assert!(
            found.examples[2]
                .summary
                .contains("T4 read x=9, a value no other transaction wrote"),
            "{}",
            found.examples[2].summary
        );
        assert_eq!(summary.unplaced, 0);
    }

    #[test]
    fn aborted_and_overwritten_values_are_uncommitted_and_intermediate_reads() {
        let (_, findings) = run(vec![
            txn(1, Aborted, vec![w("x", 1)]),
            txn(2, Committed, vec![r("x", reg(1))]),
            txn(3, Committed, vec![w("y", 5), w("y", 6)]),
            txn(4, Committed, vec![r("y", reg(5))]),
        ]);
        assert_eq!(
            kinds(&findings),
            vec![
                (AnomalyKind::UncommittedRead, 1),
                (AnomalyKind::IntermediateRead, 1)
            ]
        );
        assert_eq!(
            summary_of(&findings, AnomalyKind::UncommittedRead),
            "T2 read x=1, written by T1, which aborted (checked by its value alone)"
        );
        assert_eq!(
            summary_of(&findings, AnomalyKind::IntermediateRead),
            "T4 read y=5, which T3 overwrote with 6 before committing (checked by its value \
             alone)"
        );
    }

    #[test]
    fn a_value_also_written_last_by_a_committed_transaction_is_explained() {
        // Values need not be unique (a bank's balances repeat): any committed last write
        // of the value explains the read.
        let (summary, findings) = run(vec![
            txn(1, Aborted, vec![w("x", 1)]),
            txn(2, Committed, vec![w("x", 1), w("x", 2)]),
            txn(3, Committed, vec![w("x", 1)]),
            txn(4, Committed, vec![r("x", reg(1))]),
        ]);
        assert!(findings.is_empty(), "{:?}", kinds(&findings));
        assert_eq!(summary.unplaced, 1);
    }
}
