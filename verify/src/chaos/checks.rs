//! The checks a chaos run must pass, over the merged history of every node and the
//! database as the harness finds it at the end.
//!
//! - **snapshot isolation**: the Elle-style black-box checker on the list-append keys
//!   (plus the index's own `internal` and `incompatible-order` checks). Transactions in
//!   flight when their node died are `unknown`: the checker counts one as committed
//!   exactly when a read observed one of its appends. The white-box checker needs a
//!   commit timestamp for every write that may have taken effect, which an unknown
//!   transaction does not have, so it runs only on histories without such writes;
//!   otherwise register reads (the bank's) get the value check of [`registers`].
//! - **bank**: every snapshot of all accounts sums to the total, transfers conserve it,
//!   and the final audit (after recovery) still finds it.
//! - **acknowledged writes survive, atomically**: every element a transaction appended
//!   and was told committed is in the final read of its key, in its order; an aborted
//!   transaction's elements are in none; an unknown transaction's are all there or
//!   none; every list any transaction read is a prefix of the key's final list.
//! - **no lock remains**: once recovery is done, no record is locked.

use crate::anomaly::{Findings, show_list};
use crate::elle;
use crate::history::{Op, ReadValue, Status, Txn};
use crate::index::HistoryIndex;
use crate::registers;
use crate::whitebox;
use crate::workload::Bank;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

/// How many problems a failed check lists; the count covers them all.
const SHOWN: usize = 10;

/// The verdict of one check.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckResult {
    pub name: String,
    pub passed: bool,
    /// One line: what was checked, or what went wrong.
    pub summary: String,
    /// The first problems found (or notes, for a check that passed).
    pub details: Vec<String>,
}

impl CheckResult {
    /// Passed if `problems` is empty, else failed listing the first few.
    pub fn from_problems(name: &str, what: String, problems: Vec<String>) -> CheckResult {
        let passed = problems.is_empty();
        let summary = if passed {
            what
        } else {
            format!("{} problem(s); {what}", problems.len())
        };
        CheckResult {
            name: name.into(),
            passed,
            summary,
            details: problems.into_iter().take(SHOWN).collect(),
        }
    }
}

/// A record found locked.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lock {
    pub table: String,
    pub key: u64,
    pub cid: u64,
}

/// Snapshot isolation, black-box on the list keys (and white-box when the history
/// allows it; see the module doc).
pub fn snapshot_isolation(txns: &[Txn], index: &HistoryIndex) -> CheckResult {
    let mut findings: Findings = index.findings.clone();
    let elle = elle::check(index, &mut findings);
    let mut notes = Vec::new();
    let unknown_writers = txns
        .iter()
        .filter(|t| t.status == Status::Unknown && t.ops.iter().any(is_write))
        .count();
    let whitebox_ran = if unknown_writers == 0 {
        match whitebox::check(index, &mut findings) {
            Ok(w) => {
                notes.push(format!(
                    "white-box: {} reads checked against {} committed versions",
                    w.reads_checked, w.versions
                ));
                true
            }
            Err(reason) => {
                notes.push(format!("white-box skipped: {reason}"));
                false
            }
        }
    } else {
        notes.push(format!(
            "white-box skipped: {unknown_writers} transactions of unknown outcome wrote, and \
             none has a commit timestamp"
        ));
        false
    };
    if !whitebox_ran {
        // Values alone still show a register read of a write that was aborted or never
        // made; the bank check covers what a stale balance would break.
        let r = registers::check(index, &mut findings);
        if r.reads_checked > 0 {
            notes.push(format!(
                "register reads checked by value alone: {}",
                r.reads_checked
            ));
        }
    }
    let stats = index.stats();
    let what = format!(
        "{} transactions ({} committed, {} aborted, {} unknown of which {} observed to \
         commit); {} list keys, {} dependency edges",
        stats.txns,
        stats.committed,
        stats.aborted,
        stats.unknown,
        stats.unknown_observed,
        elle.list_keys,
        elle.edges
    );
    if !elle.incomplete.is_empty() {
        notes.push(format!(
            "inconclusive: {} cyclic components were not fully searched",
            elle.incomplete.len()
        ));
    }
    let mut problems = Vec::new();
    for (kind, found) in findings.iter() {
        if kind.allowed_under_si() {
            notes.push(format!(
                "{kind}: {} (allowed under snapshot isolation)",
                found.count
            ));
            continue;
        }
        for example in &found.examples {
            problems.push(format!("{kind}: {}", example.summary));
        }
        let more = found.count - found.examples.len() as u64;
        if more > 0 {
            problems.push(format!("{kind}: … and {more} more"));
        }
    }
    let mut result = CheckResult::from_problems("snapshot isolation", what, problems);
    if result.passed {
        result.details = notes;
    }
    result
}

fn is_write(op: &Op) -> bool {
    matches!(op, Op::Append { .. } | Op::Write { .. })
}

/// The bank invariant over the whole history, and the final audit `final_audit` (the
/// id of a committed transaction that read every account after recovery).
pub fn bank(
    bank: &Bank,
    txns: &[Txn],
    index: &HistoryIndex,
    final_audit: Option<u64>,
) -> CheckResult {
    let mut findings = Findings::default();
    bank.check(index, &mut findings);
    let mut problems = Vec::new();
    for (kind, found) in findings.iter() {
        for example in &found.examples {
            problems.push(format!("{kind}: {}", example.summary));
        }
        let more = found.count - found.examples.len() as u64;
        if more > 0 {
            problems.push(format!("{kind}: … and {more} more"));
        }
    }
    let audits = txns
        .iter()
        .filter(|t| {
            t.status == Status::Committed
                && (0..bank.accounts).all(|i| {
                    let name = Bank::account(i);
                    t.ops
                        .iter()
                        .any(|op| matches!(op, Op::Read { key, .. } if *key == name))
                })
        })
        .count();
    let final_total = final_audit.and_then(|id| txns.iter().find(|t| t.id == id));
    let final_total = match final_total {
        Some(t) if t.status == Status::Committed => {
            let mut sum = 0i64;
            let mut missing = Vec::new();
            for i in 0..bank.accounts {
                let name = Bank::account(i);
                let read = t.ops.iter().find_map(|op| match op {
                    Op::Read { key, value, .. } if *key == name => Some(value),
                    _ => None,
                });
                match read {
                    Some(ReadValue::Register(v)) => sum += v,
                    Some(ReadValue::Absent) | None => missing.push(name),
                    Some(ReadValue::List(_)) => missing.push(name),
                }
            }
            if !missing.is_empty() {
                problems.push(format!(
                    "the final audit T{} found no balance for {}",
                    t.id,
                    missing.join(", ")
                ));
            } else if sum != bank.total() {
                problems.push(format!(
                    "the final audit T{} found a total of {sum}, not the initial {}",
                    t.id,
                    bank.total()
                ));
            }
            Some(sum)
        }
        Some(t) => {
            problems.push(format!("the final audit T{} did not commit", t.id));
            None
        }
        None => {
            problems.push("there is no final audit of the accounts".into());
            None
        }
    };
    let what = format!(
        "{} accounts, total {}; {audits} committed audits; final total {}",
        bank.accounts,
        bank.total(),
        final_total.map_or("unknown".into(), |s| s.to_string())
    );
    CheckResult::from_problems("bank invariant", what, problems)
}

/// Acknowledged appends survive, atomically and in order; `final_lists` is every list
/// key's content read after recovery.
pub fn acknowledged(txns: &[Txn], final_lists: &BTreeMap<String, Vec<i64>>) -> CheckResult {
    // Where each element sits in its key's final list.
    let positions: HashMap<(&str, i64), usize> = final_lists
        .iter()
        .flat_map(|(key, list)| {
            list.iter()
                .enumerate()
                .map(move |(i, &e)| ((key.as_str(), e), i))
        })
        .collect();
    let mut problems = Vec::new();
    let mut appended: HashMap<(&str, i64), u64> = HashMap::new();
    let (mut acknowledged, mut unknown_in, mut unknown_out) = (0u64, 0u64, 0u64);
    for t in txns {
        // This transaction's appends, per key, in order.
        let mut own: BTreeMap<&str, Vec<i64>> = BTreeMap::new();
        for op in &t.ops {
            match op {
                Op::Append { key, element } => {
                    appended.insert((key.as_str(), *element), t.id);
                    own.entry(key).or_default().push(*element);
                }
                Op::Read {
                    key,
                    value: ReadValue::List(list),
                    ..
                } => {
                    let mine = own.get(key.as_str()).map_or(0, Vec::len);
                    let snapshot = &list[..list.len().saturating_sub(mine)];
                    let last = final_lists.get(key).map_or(&[][..], Vec::as_slice);
                    if !last.starts_with(snapshot) {
                        problems.push(format!(
                            "T{} read {key}={} (its snapshot part), which is not a prefix of \
                             the final {}",
                            t.id,
                            show_list(snapshot),
                            show_list(last)
                        ));
                    }
                }
                _ => {}
            }
        }
        if own.is_empty() {
            continue;
        }
        let mut present = 0;
        let mut total = 0;
        for (key, elements) in &own {
            if !final_lists.contains_key(*key) {
                problems.push(format!(
                    "T{} appended to {key}, which the final reads did not cover",
                    t.id
                ));
                continue;
            }
            let at: Vec<Option<usize>> = elements
                .iter()
                .map(|&e| positions.get(&(*key, e)).copied())
                .collect();
            total += at.len();
            present += at.iter().flatten().count();
            let found: Vec<usize> = at.iter().flatten().copied().collect();
            if found.windows(2).any(|w| w[1] != w[0] + 1) {
                problems.push(format!(
                    "T{} appended {} to {key}, but the final list holds them at positions \
                     {found:?}, not in order one after another",
                    t.id,
                    show_list(elements)
                ));
            }
            if t.status == Status::Committed {
                for (&e, _) in elements.iter().zip(&at).filter(|(_, p)| p.is_none()) {
                    problems.push(format!(
                        "lost: T{} appended {e} to {key} and was acknowledged committed, but \
                         the final read of {key} lacks it",
                        t.id
                    ));
                }
            }
        }
        match t.status {
            Status::Committed => acknowledged += 1,
            Status::Aborted if present > 0 => problems.push(format!(
                "T{} aborted, yet {present} of its {total} appended elements are in the \
                 database",
                t.id
            )),
            Status::Aborted => {}
            Status::Unknown if present > 0 && present < total => problems.push(format!(
                "T{} (outcome unknown) is partly in the database: {present} of its {total} \
                 appended elements",
                t.id
            )),
            Status::Unknown if present > 0 => unknown_in += 1,
            Status::Unknown => unknown_out += 1,
        }
    }
    for (key, list) in final_lists {
        for &e in list {
            if !appended.contains_key(&(key.as_str(), e)) {
                problems.push(format!(
                    "the final read of {key} holds {e}, which no transaction appended"
                ));
            }
        }
    }
    let elements: usize = final_lists.values().map(Vec::len).sum();
    let what = format!(
        "{acknowledged} acknowledged appending transactions, against the final state of {} \
         keys ({elements} elements); of those in flight at a crash, {unknown_in} took \
         effect whole and {unknown_out} not at all",
        final_lists.len()
    );
    CheckResult::from_problems("acknowledged writes", what, problems)
}

/// An index slot found claimed for a key with no address written.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnpublishedSlot {
    pub table: String,
    pub key: u64,
}

/// No record may stay locked, and no key's index slot claimed without its address,
/// once recovery has had `waited`: either keeps every reader of the key waiting (and
/// then failing) for good.
pub fn no_locks(locks: &[Lock], unpublished: &[UnpublishedSlot], waited: Duration) -> CheckResult {
    let waited_s = waited.as_secs_f64();
    let problems = locks
        .iter()
        .map(|l| {
            format!(
                "{}: key {} is still locked by cid {} after {waited_s:.1} s",
                l.table, l.key, l.cid
            )
        })
        .chain(unpublished.iter().map(|u| {
            format!(
                "{}: key {}'s index slot is claimed with no address after {waited_s:.1} s (an \
                 insert that never finished: the key can be neither read nor inserted)",
                u.table, u.key
            )
        }))
        .collect();
    let what = match (locks.is_empty(), unpublished.is_empty()) {
        (true, true) => "no record locked, no index slot left claimed",
        (false, true) => "records left locked",
        (true, false) => "index slots left claimed without an address",
        (false, false) => "records left locked, index slots left claimed without an address",
    };
    CheckResult::from_problems(
        "no lock remains",
        format!("{what} (checked every table, {waited_s:.1} s after the nodes stopped)"),
        problems,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(id: u64, status: Status, ops: Vec<Op>) -> Txn {
        let mut txn = Txn::new(id, id % 3, status);
        txn.ops = ops;
        txn
    }

    fn append(key: &str, element: i64) -> Op {
        Op::Append {
            key: key.into(),
            element,
        }
    }

    fn read(key: &str, list: &[i64]) -> Op {
        Op::Read {
            key: key.into(),
            value: ReadValue::List(list.to_vec()),
            version: None,
        }
    }

    fn reg(key: &str, v: i64) -> Op {
        Op::Read {
            key: key.into(),
            value: ReadValue::Register(v),
            version: None,
        }
    }

    fn write(key: &str, v: i64) -> Op {
        Op::Write {
            key: key.into(),
            value: v,
        }
    }

    /// A small chaos history: appends committed, aborted and in flight, and the final
    /// read taken after recovery.
    fn history() -> (Vec<Txn>, BTreeMap<String, Vec<i64>>) {
        let txns = vec![
            t(1, Status::Committed, vec![read("l1", &[]), append("l1", 1)]),
            t(
                2,
                Status::Committed,
                vec![read("l1", &[1]), append("l1", 2), append("l1", 3)],
            ),
            t(3, Status::Aborted, vec![read("l1", &[1]), append("l1", 9)]),
            // In flight when its node died, rolled forward by recovery.
            t(4, Status::Unknown, vec![read("l2", &[]), append("l2", 4)]),
            // In flight, rolled back.
            t(5, Status::Unknown, vec![read("l2", &[]), append("l2", 5)]),
            t(
                6,
                Status::Committed,
                vec![read("l1", &[1, 2, 3]), read("l2", &[4])],
            ),
        ];
        let finals = BTreeMap::from([("l1".to_string(), vec![1, 2, 3]), ("l2".into(), vec![4])]);
        (txns, finals)
    }

    fn with_final_reads(mut txns: Vec<Txn>, finals: &BTreeMap<String, Vec<i64>>) -> Vec<Txn> {
        let reads = finals.iter().map(|(k, l)| read(k, l)).collect();
        txns.push(t(100, Status::Committed, reads));
        txns
    }

    #[test]
    fn a_sound_history_passes_every_check() {
        let (txns, finals) = history();
        let result = acknowledged(&txns, &finals);
        assert!(result.passed, "{result:?}");
        assert!(
            result
                .summary
                .contains("1 took effect whole and 1 not at all"),
            "{result:?}"
        );
        let all = with_final_reads(txns, &finals);
        let index = HistoryIndex::from_txns(all.clone()).expect("indexes");
        let si = snapshot_isolation(&all, &index);
        assert!(si.passed, "{si:?}");
        assert!(
            si.details.iter().any(|d| d.contains("white-box skipped")),
            "{si:?}"
        );
        assert!(no_locks(&[], &[], Duration::from_secs(1)).passed);
    }

    #[test]
    fn a_lost_acknowledged_append_fails() {
        let (txns, mut finals) = history();
        finals.insert("l1".into(), vec![1, 2]);
        let result = acknowledged(&txns, &finals);
        assert!(!result.passed);
        assert!(
            result
                .details
                .iter()
                .any(|d| d.starts_with("lost: T2 appended 3 to l1")),
            "{result:?}"
        );
        // T6 read [1, 2, 3]: no longer a prefix of what is left.
        assert!(
            result.details.iter().any(|d| d.contains("T6 read l1=")),
            "{result:?}"
        );
        // The black-box checker, given the doctored final read, sees it too.
        let all = with_final_reads(txns, &finals);
        let index = HistoryIndex::from_txns(all.clone()).expect("indexes");
        assert!(!snapshot_isolation(&all, &index).passed);
    }

    #[test]
    fn partial_aborted_and_reordered_effects_fail() {
        let (mut txns, mut finals) = history();
        // T2's two appends, only one of them there, out of order with T1's.
        txns[1].status = Status::Unknown;
        finals.insert("l1".into(), vec![2, 1]);
        let result = acknowledged(&txns[..2], &finals);
        assert!(!result.passed);
        let text = result.details.join("\n");
        assert!(
            text.contains("T2 (outcome unknown) is partly in the database"),
            "{text}"
        );
        assert!(
            text.contains("T1 read l1=[]") || text.contains("T2 read l1=[1]"),
            "{text}"
        );

        let (txns, mut finals) = history();
        finals.insert("l1".into(), vec![1, 2, 3, 9]);
        let result = acknowledged(&txns, &finals);
        assert!(
            result
                .details
                .iter()
                .any(|d| d.contains("T3 aborted, yet 1 of its 1")),
            "{result:?}"
        );
        finals.insert("l1".into(), vec![1, 2, 3, 77]);
        let result = acknowledged(&txns, &finals);
        assert!(
            result
                .details
                .iter()
                .any(|d| d.contains("holds 77, which no transaction")),
            "{result:?}"
        );
        finals.remove("l2");
        let result = acknowledged(&txns, &finals);
        assert!(
            result.details.iter().any(|d| d.contains("did not cover")),
            "{result:?}"
        );
    }

    fn bank_history(final_total_shift: i64) -> Vec<Txn> {
        vec![
            t(
                1,
                Status::Committed,
                vec![write("acct0", 10), write("acct1", 10)],
            ),
            t(
                2,
                Status::Committed,
                vec![
                    reg("acct0", 10),
                    reg("acct1", 10),
                    write("acct0", 4),
                    write("acct1", 16),
                ],
            ),
            // A transfer in flight at a crash, rolled forward.
            t(
                3,
                Status::Unknown,
                vec![
                    reg("acct0", 4),
                    reg("acct1", 16),
                    write("acct0", 3),
                    write("acct1", 17),
                ],
            ),
            t(
                4,
                Status::Committed,
                vec![reg("acct0", 3), reg("acct1", 17 + final_total_shift)],
            ),
        ]
    }

    #[test]
    fn the_bank_check_passes_a_conserving_history_and_fails_a_changed_total() {
        let b = Bank {
            accounts: 2,
            initial_balance: 10,
            ..Bank::default()
        };
        let txns = bank_history(0);
        let index = HistoryIndex::from_txns(txns.clone()).expect("indexes");
        let result = bank(&b, &txns, &index, Some(4));
        assert!(result.passed, "{result:?}");
        assert!(result.summary.contains("final total 20"), "{result:?}");

        let txns = bank_history(5);
        let index = HistoryIndex::from_txns(txns.clone()).expect("indexes");
        let result = bank(&b, &txns, &index, Some(4));
        assert!(!result.passed);
        let text = result.details.join("\n");
        assert!(text.contains("a total of 25, not the initial 20"), "{text}");
        assert!(text.contains("bank-total"), "{text}");

        let txns = bank_history(0);
        let index = HistoryIndex::from_txns(txns.clone()).expect("indexes");
        let result = bank(&b, &txns, &index, None);
        assert!(!result.passed);
        assert!(result.details[0].contains("no final audit"), "{result:?}");
    }

    #[test]
    fn a_leftover_lock_fails() {
        let lock = Lock {
            table: "chaos_lists".into(),
            key: 42,
            cid: 1234,
        };
        let result = no_locks(&[lock], &[], Duration::from_millis(2500));
        assert!(!result.passed);
        assert_eq!(
            result.details,
            ["chaos_lists: key 42 is still locked by cid 1234 after 2.5 s"]
        );
    }

    #[test]
    fn a_key_left_claimed_in_the_index_fails() {
        let slot = UnpublishedSlot {
            table: "chaos_lists".into(),
            key: 59,
        };
        let result = no_locks(&[], &[slot], Duration::from_millis(100));
        assert!(!result.passed);
        assert!(
            result
                .summary
                .contains("index slots left claimed without an address"),
            "{result:?}"
        );
        assert_eq!(
            result.details,
            [
                "chaos_lists: key 59's index slot is claimed with no address after 0.1 s (an \
                 insert that never finished: the key can be neither read nor inserted)"
            ]
        );
    }

    #[test]
    fn a_lost_update_is_a_snapshot_isolation_violation() {
        let txns = vec![
            t(1, Status::Committed, vec![read("l1", &[]), append("l1", 1)]),
            t(2, Status::Committed, vec![read("l1", &[]), append("l1", 2)]),
            t(3, Status::Committed, vec![read("l1", &[1, 2])]),
        ];
        let index = HistoryIndex::from_txns(txns.clone()).expect("indexes");
        let result = snapshot_isolation(&txns, &index);
        assert!(!result.passed);
        assert!(result.details[0].starts_with("G-single"), "{result:?}");
    }
}
