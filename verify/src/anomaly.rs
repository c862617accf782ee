//! The anomalies the checkers report, and the collector that counts them and keeps a
//! few explained examples of each.

use std::collections::BTreeMap;
use std::fmt;

/// Everything a checker can find wrong with a history.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum AnomalyKind {
    // Found while indexing the history, before either checker runs.
    /// A read contradicts the transaction's own earlier reads or writes of the key.
    Internal,
    /// Two reads of a list key are not prefixes of one another: no single version order
    /// explains both.
    IncompatibleOrder,

    // Black-box (Elle-style, values only).
    /// A cycle of write-write dependencies.
    G0,
    /// A committed transaction read an element appended by an aborted transaction.
    G1a,
    /// A committed transaction read a state that its writer later overwrote within
    /// itself.
    G1b,
    /// A cycle of write-write and write-read dependencies with at least one write-read.
    G1c,
    /// A cycle with exactly one read-write anti-dependency.
    GSingle,
    /// A cycle with two or more read-write anti-dependencies: write skew.
    G2,
    /// A read returned the same element twice.
    DuplicateElements,
    /// A read returned an element no transaction appended.
    GarbageRead,

    // White-box (the system's own timestamps).
    /// A read returned a committed version older than the newest one its snapshot holds.
    StaleRead,
    /// A read returned a version committed after its snapshot.
    FutureRead,
    /// A read returned a write of a transaction that aborted or never committed.
    UncommittedRead,
    /// A read returned a state its writer overwrote before committing.
    IntermediateRead,
    /// A read returned a value no version of the key ever had.
    ImpossibleRead,
    /// A read returned the right value but named the wrong version.
    WrongVersion,
    /// Two committed transactions with overlapping [rid, cid] wrote the same key.
    FirstCommitterWins,
    /// A committed transaction's CID is not above its read timestamp.
    CommitBeforeSnapshot,
    /// Two committed transactions share a CID.
    DuplicateCid,
    /// A session read from a snapshot older than its own last commit.
    Session,
    /// A transaction missed a commit that returned before it began.
    RealTime,

    // Workload invariants.
    /// A snapshot of every bank account does not sum to the bank's total.
    BankTotal,
    /// A committed transfer created or destroyed money.
    BankNotConserved,
    /// An account balance went below zero.
    NegativeBalance,
}

impl AnomalyKind {
    /// The name in reports.
    pub fn name(self) -> &'static str {
        use AnomalyKind::*;
        match self {
            Internal => "internal",
            IncompatibleOrder => "incompatible-order",
            G0 => "G0",
            G1a => "G1a",
            G1b => "G1b",
            G1c => "G1c",
            GSingle => "G-single",
            G2 => "G2",
            DuplicateElements => "duplicate-elements",
            GarbageRead => "garbage-read",
            StaleRead => "stale-read",
            FutureRead => "future-read",
            UncommittedRead => "uncommitted-read",
            IntermediateRead => "intermediate-read",
            ImpossibleRead => "impossible-read",
            WrongVersion => "wrong-version",
            FirstCommitterWins => "first-committer-wins",
            CommitBeforeSnapshot => "commit-before-snapshot",
            DuplicateCid => "duplicate-cid",
            Session => "session",
            RealTime => "real-time",
            BankTotal => "bank-total",
            BankNotConserved => "bank-not-conserved",
            NegativeBalance => "negative-balance",
        }
    }

    /// What the anomaly means, for the report.
    pub fn description(self) -> &'static str {
        use AnomalyKind::*;
        match self {
            Internal => "a read contradicts the transaction's own earlier reads or writes",
            IncompatibleOrder => "two reads of a list are not prefixes of one another",
            G0 => "write cycle (ww edges only)",
            G1a => "aborted read: a committed transaction saw an aborted transaction's write",
            G1b => {
                "intermediate read: a committed transaction saw a state its writer later overwrote"
            }
            G1c => "circular information flow (ww and wr edges)",
            GSingle => "cycle with exactly one anti-dependency (rw edge): e.g. a lost update",
            G2 => "cycle with two or more anti-dependencies: write skew",
            DuplicateElements => "a read returned an element twice",
            GarbageRead => "a read returned an element no transaction appended",
            StaleRead => "a read missed the newest version its snapshot holds",
            FutureRead => "a read saw a version committed after its snapshot",
            UncommittedRead => "a read saw a write that never committed",
            IntermediateRead => "a read saw a state its writer overwrote before committing",
            ImpossibleRead => "a read returned a value the key never had",
            WrongVersion => "a read named a version other than the one its value came from",
            FirstCommitterWins => "concurrent committed transactions wrote the same key",
            CommitBeforeSnapshot => "a commit timestamp not above its read timestamp",
            DuplicateCid => "two committed transactions share a commit timestamp",
            Session => "a session did not see its own last commit",
            RealTime => "a transaction missed a commit that returned before it began",
            BankTotal => "a snapshot of all accounts does not sum to the bank's total",
            BankNotConserved => "a transfer created or destroyed money",
            NegativeBalance => "an account balance went below zero",
        }
    }

    /// Whether a history showing this anomaly can still be snapshot isolation. Only
    /// write skew can.
    pub fn allowed_under_si(self) -> bool {
        self == AnomalyKind::G2
    }
}

impl fmt::Display for AnomalyKind {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One anomaly, explained: a one-line summary and, for cycles, one line per edge.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Anomaly {
    pub kind: AnomalyKind,
    pub summary: String,
    pub details: Vec<String>,
    /// The ids of the transactions involved, in the order the explanation names them.
    pub txns: Vec<u64>,
}

/// The anomalies of one kind: how many there were and the first few, explained.
#[derive(Clone, Debug, Default)]
pub struct KindFindings {
    pub count: u64,
    pub examples: Vec<Anomaly>,
}

/// Counts every anomaly found and keeps up to `max_examples` explained examples of each
/// kind. Explanations are built only for the examples kept, so a history with millions
/// of anomalies costs no more than counting them.
#[derive(Clone, Debug)]
pub struct Findings {
    max_examples: usize,
    by_kind: BTreeMap<AnomalyKind, KindFindings>,
}

impl Findings {
    pub const DEFAULT_EXAMPLES: usize = 5;

    pub fn new(max_examples: usize) -> Findings {
        Findings {
            max_examples,
            by_kind: BTreeMap::new(),
        }
    }

    /// Counts one anomaly of `kind`; `explain` runs only if it becomes an example.
    pub fn add(&mut self, kind: AnomalyKind, explain: impl FnOnce() -> Explained) {
        let entry = self.by_kind.entry(kind).or_default();
        entry.count += 1;
        if entry.examples.len() < self.max_examples {
            let Explained {
                summary,
                details,
                txns,
            } = explain();
            entry.examples.push(Anomaly {
                kind,
                summary,
                details,
                txns,
            });
        }
    }

    pub fn count(&self, kind: AnomalyKind) -> u64 {
        self.by_kind.get(&kind).map_or(0, |k| k.count)
    }

    /// Every kind found, most fundamental first, with its count and examples.
    pub fn iter(&self) -> impl Iterator<Item = (AnomalyKind, &KindFindings)> {
        self.by_kind.iter().map(|(kind, found)| (*kind, found))
    }

    pub fn is_empty(&self) -> bool {
        self.by_kind.is_empty()
    }

    /// Whether anything found rules out snapshot isolation.
    pub fn violates_si(&self) -> bool {
        self.by_kind.keys().any(|kind| !kind.allowed_under_si())
    }
}

impl Default for Findings {
    fn default() -> Self {
        Findings::new(Findings::DEFAULT_EXAMPLES)
    }
}

/// The explanation part of an [`Anomaly`], built by the checker that found it.
pub struct Explained {
    pub summary: String,
    pub details: Vec<String>,
    pub txns: Vec<u64>,
}

impl Explained {
    pub fn new(summary: String, txns: Vec<u64>) -> Explained {
        Explained {
            summary,
            details: Vec::new(),
            txns,
        }
    }
}

/// A list for a report: short lists whole, long ones by their last few elements, since
/// the end is where reads and appends meet.
pub fn show_list(elements: &[i64]) -> String {
    const SHOWN: usize = 6;
    let shown: Vec<String> = elements
        .iter()
        .skip(elements.len().saturating_sub(SHOWN))
        .map(i64::to_string)
        .collect();
    if elements.len() > SHOWN {
        format!("[…{} more, {}]", elements.len() - SHOWN, shown.join(", "))
    } else {
        format!("[{}]", shown.join(", "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_everything_but_keeps_only_the_first_examples() {
        let mut findings = Findings::new(2);
        let mut explained = 0;
        for i in 0..5 {
            findings.add(AnomalyKind::G1a, || {
                explained += 1;
                Explained::new(format!("case {i}"), vec![i])
            });
        }
        assert_eq!(findings.count(AnomalyKind::G1a), 5);
        assert_eq!(explained, 2);
        let (_, g1a) = findings.iter().next().expect("one kind");
        assert_eq!(g1a.examples[1].summary, "case 1");
        assert!(findings.violates_si());
    }

    #[test]
    fn only_write_skew_is_allowed_under_si() {
        let mut findings = Findings::default();
        findings.add(AnomalyKind::G2, || Explained::new("skew".into(), vec![]));
        assert!(!findings.violates_si());
        findings.add(AnomalyKind::GSingle, || {
            Explained::new("lost".into(), vec![])
        });
        assert!(findings.violates_si());
        assert_eq!(findings.count(AnomalyKind::GSingle), 1);
    }

    #[test]
    fn long_lists_show_their_end() {
        assert_eq!(show_list(&[]), "[]");
        assert_eq!(show_list(&[1, 2, 3]), "[1, 2, 3]");
        assert_eq!(
            show_list(&(1..=10).collect::<Vec<_>>()),
            "[…4 more, 5, 6, 7, 8, 9, 10]"
        );
    }
}
