//! The white-box checker: replays the system's own timestamps.
//!
//! From the committed writes it builds, per key, the versions in CID order (the log of
//! committed writes). Then:
//!
//! - every read returns the newest committed version with CID ≤ the reader's RID, and
//!   names that version when it names one (`stale-read`, `future-read`,
//!   `uncommitted-read`, `intermediate-read`, `impossible-read`, `wrong-version`);
//! - first committer wins: consecutive versions of a key come from transactions whose
//!   [RID, CID] intervals do not overlap (checking consecutive pairs suffices: if a
//!   later writer overlaps an earlier one it overlaps its immediate predecessor too);
//! - CIDs are unique and above their transaction's RID;
//! - a session's RID is at least the CID of every commit it made before;
//! - a transaction that began after another's commit returned has an RID at least that
//!   CID.
//!
//! Reads of a transaction's own writes were checked while indexing (`internal`).
//! Everything is sorting and binary search: O(n log n) in the history's size.

use crate::anomaly::{AnomalyKind, Explained, Findings, show_list};
use crate::index::{HistoryIndex, KeyKind, ReadRec, Seen};
use std::collections::HashMap;

/// Runs the white-box checks, or says why the history does not allow them.
pub fn check(index: &HistoryIndex, findings: &mut Findings) -> Result<WhiteBoxSummary, String> {
    missing_timestamps(index)?;
    let versions = build_versions(index);
    let mut checker = Checker {
        index,
        versions: &versions,
        findings,
        register_values: None,
    };
    checker.timestamps();
    checker.first_committer_wins();
    let reads = checker.reads();
    checker.sessions();
    let real_time_skipped = index.real_time_waived();
    if real_time_skipped.is_none() {
        checker.real_time();
    }
    Ok(WhiteBoxSummary {
        reads_checked: reads,
        versions: versions.iter().map(|v| v.cids.len() as u64).sum(),
        real_time_skipped,
    })
}

/// What the white-box checker covered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WhiteBoxSummary {
    pub reads_checked: u64,
    pub versions: u64,
    /// Why the real-time check did not run: the history's header said its recorder
    /// acknowledged commits before they were visible.
    pub real_time_skipped: Option<String>,
}

/// The white-box rules need a CID for every committed write and an RID for every read.
fn missing_timestamps(index: &HistoryIndex) -> Result<(), String> {
    if index
        .txns
        .iter()
        .all(|m| m.rid.is_none() && m.cid.is_none())
    {
        return Err("the history carries no timestamps (rid, cid)".into());
    }
    for (t, meta) in index.txns.iter().enumerate() {
        let t = t as u32;
        if meta.committed && meta.cid.is_none() && !index.txn_writes(t).is_empty() {
            return Err(format!("T{} committed writes without a cid", meta.id));
        }
        if meta.rid.is_none() && !index.txn_reads(t).is_empty() {
            return Err(format!("T{} read without a rid", meta.id));
        }
        if meta.committed && meta.cid.is_some() && meta.rid.is_none() {
            return Err(format!("T{} committed without a rid", meta.id));
        }
    }
    Ok(())
}

/// One key's committed versions in CID order.
#[derive(Default)]
struct KeyVersions {
    cids: Vec<u64>,
    /// The transaction that wrote each version.
    writers: Vec<u32>,
    /// Registers: each version's value.
    values: Vec<i64>,
    /// Lists: every committed element in version order; version i is `elements[..ends[i]]`.
    elements: Vec<i64>,
    ends: Vec<u32>,
    /// How long a prefix the key's longest observed list shares with `elements`, so a
    /// read stored as a prefix of it is checked with two comparisons.
    agreeing_prefix: u32,
}

impl KeyVersions {
    /// How many versions a snapshot at `rid` holds: the newest is `visible - 1`.
    fn visible(&self, rid: u64) -> usize {
        self.cids.partition_point(|&cid| cid <= rid)
    }

    fn list(&self, version: Option<usize>) -> &[i64] {
        version.map_or(&[], |v| &self.elements[..self.ends[v] as usize])
    }
}

fn build_versions(index: &HistoryIndex) -> Vec<KeyVersions> {
    // (key, cid, write): a committed transaction's writes; for a register only its
    // last write to the key is the version others can see.
    let mut log: Vec<(u32, u64, u32)> = index
        .writes
        .iter()
        .enumerate()
        .filter_map(|(w, write)| {
            let meta = &index.txns[write.txn as usize];
            let visible = meta.committed && (write.append || write.last_in_txn);
            Some((write.key, meta.cid.filter(|_| visible)?, w as u32))
        })
        .collect();
    log.sort_unstable();
    let mut versions: Vec<KeyVersions> = (0..index.keys.len())
        .map(|_| KeyVersions::default())
        .collect();
    for (key, cid, w) in log {
        let write = &index.writes[w as usize];
        let kv = &mut versions[key as usize];
        let same_version = kv.writers.last() == Some(&write.txn) && kv.cids.last() == Some(&cid);
        if write.append {
            kv.elements.push(write.value);
            if same_version {
                *kv.ends.last_mut().expect("a version exists") += 1;
                continue;
            }
            kv.ends.push(kv.elements.len() as u32);
        } else {
            kv.values.push(write.value);
        }
        kv.cids.push(cid);
        kv.writers.push(write.txn);
    }
    for (kv, info) in versions.iter_mut().zip(&index.keys) {
        kv.agreeing_prefix = kv
            .elements
            .iter()
            .zip(&info.longest)
            .take_while(|(a, b)| a == b)
            .count() as u32;
    }
    versions
}

struct Checker<'a> {
    index: &'a HistoryIndex,
    versions: &'a [KeyVersions],
    findings: &'a mut Findings,
    /// What wrote each register value, built on the first register read that needs
    /// explaining.
    register_values: Option<HashMap<(u32, i64), ValueWrites>>,
}

/// The writes of one value to one register.
#[derive(Default)]
struct ValueWrites {
    /// The committed versions holding it, in CID order.
    versions: Vec<u32>,
    /// A write of it by a transaction that did not commit.
    uncommitted: Option<u32>,
    /// Any write of it.
    any: Option<u32>,
}

impl Checker<'_> {
    fn label(&self, txn: u32) -> String {
        self.index.label(txn)
    }

    fn timestamps(&mut self) {
        let index = self.index;
        let mut by_cid: Vec<(u64, u32)> = Vec::new();
        for (t, meta) in index.txns.iter().enumerate() {
            let (Some(rid), Some(cid)) = (meta.rid, meta.cid) else {
                continue;
            };
            if !meta.committed {
                continue;
            }
            by_cid.push((cid, t as u32));
            if cid <= rid {
                self.findings.add(AnomalyKind::CommitBeforeSnapshot, || {
                    Explained::new(
                        format!(
                            "T{} committed at cid {cid}, not above its rid {rid}",
                            meta.id
                        ),
                        vec![meta.id],
                    )
                });
            }
        }
        by_cid.sort_unstable();
        for pair in by_cid.windows(2) {
            let [(cid, a), (next, b)] = [pair[0], pair[1]];
            if cid == next {
                let (a, b) = (index.txns[a as usize].id, index.txns[b as usize].id);
                self.findings.add(AnomalyKind::DuplicateCid, || {
                    Explained::new(
                        format!("T{a} and T{b} both committed at cid {cid}"),
                        vec![a, b],
                    )
                });
            }
        }
    }

    fn first_committer_wins(&mut self) {
        let index = self.index;
        for (key, kv) in self.versions.iter().enumerate() {
            for i in 1..kv.cids.len() {
                let (earlier, later) = (kv.writers[i - 1], kv.writers[i]);
                let later_rid = index.txns[later as usize].rid.unwrap_or(u64::MAX);
                if later_rid >= kv.cids[i - 1] {
                    continue;
                }
                let key = index.key_name(key as u32);
                let (a, b) = (
                    index.txns[earlier as usize].id,
                    index.txns[later as usize].id,
                );
                let (cid_a, cid_b) = (kv.cids[i - 1], kv.cids[i]);
                self.findings.add(AnomalyKind::FirstCommitterWins, || {
                    Explained::new(
                        format!(
                            "T{a} and T{b} both wrote {key} and both committed, though T{b}'s \
                             snapshot (rid {later_rid}) does not include T{a} (cid {cid_a}); \
                             T{b} should have aborted instead of committing at cid {cid_b}"
                        ),
                        vec![a, b],
                    )
                });
            }
        }
    }

    /// Checks every read against the versions its snapshot holds; returns how many.
    fn reads(&mut self) -> u64 {
        let index = self.index;
        let mut checked = 0;
        for read in &index.reads {
            let Some(rid) = index.txns[read.txn as usize].rid else {
                continue;
            };
            if matches!(read.seen, Seen::OwnWrite | Seen::Inconsistent) {
                continue;
            }
            checked += 1;
            let kv = &self.versions[read.key as usize];
            let visible = kv.visible(rid);
            let newest = visible.checked_sub(1);
            let value_ok = match self.index.keys[read.key as usize].kind {
                KeyKind::List => match read.seen {
                    Seen::Prefix(len) => {
                        len <= kv.agreeing_prefix && len as usize == kv.list(newest).len()
                    }
                    _ => self.index.snapshot_list(read) == Some(kv.list(newest)),
                },
                KeyKind::Register => match read.seen {
                    Seen::Value(v) => newest.map(|n| kv.values[n]) == Some(v),
                    _ => newest.is_none(),
                },
                KeyKind::Unknown => true,
            };
            if !value_ok {
                self.explain_wrong_read(read, rid, newest);
            } else if let Some(claimed) = read.version
                && Some(claimed) != newest.map(|n| kv.cids[n])
            {
                let reader = self.label(read.txn);
                let key = self.index.key_name(read.key);
                let actual =
                    newest.map_or("no version".into(), |n| format!("version {}", kv.cids[n]));
                self.findings.add(AnomalyKind::WrongVersion, || {
                    Explained::new(
                        format!(
                            "{reader} (rid {rid}) read {key} from {actual} but named version {claimed}"
                        ),
                        vec![self.index.txns[read.txn as usize].id],
                    )
                });
            }
        }
        checked
    }

    fn explain_wrong_read(&mut self, read: &ReadRec, rid: u64, newest: Option<usize>) {
        let index = self.index;
        let kv = &self.versions[read.key as usize];
        let key = index.key_name(read.key);
        let reader = self.label(read.txn);
        let reader_id = index.txns[read.txn as usize].id;
        let describe_version = |v: Option<usize>, shown: String| match v {
            Some(v) => format!(
                "{key}={shown} of {} (cid {})",
                self.label(kv.writers[v]),
                kv.cids[v]
            ),
            None => format!("{key}={shown} (no version)"),
        };
        let expected = match index.keys[read.key as usize].kind {
            KeyKind::List => describe_version(newest, show_list(kv.list(newest))),
            _ => describe_version(
                newest,
                newest.map_or("null".into(), |n| kv.values[n].to_string()),
            ),
        };
        let (kind, observed) = match index.keys[read.key as usize].kind {
            KeyKind::List => self.diagnose_list(read, newest),
            _ => self.diagnose_register(read, newest),
        };
        self.findings.add(kind, || {
            Explained::new(
                format!("{reader} (rid {rid}) read {observed}; its snapshot holds {expected}"),
                vec![reader_id],
            )
        });
    }

    /// Which version (or non-version) a wrong list read returned.
    fn diagnose_list(&self, read: &ReadRec, newest: Option<usize>) -> (AnomalyKind, String) {
        let index = self.index;
        let kv = &self.versions[read.key as usize];
        let key = index.key_name(read.key);
        let seen = index.snapshot_list(read).unwrap_or(&[]);
        let shown = format!("{key}={}", show_list(seen));
        let is_committed_prefix =
            seen.len() <= kv.elements.len() && kv.elements[..seen.len()] == *seen;
        if is_committed_prefix {
            if seen.is_empty() {
                return (
                    AnomalyKind::StaleRead,
                    format!("{shown}, the state before any version"),
                );
            }
            return match kv.ends.binary_search(&(seen.len() as u32)) {
                Ok(v) => {
                    let kind = if Some(v) > newest {
                        AnomalyKind::FutureRead
                    } else {
                        AnomalyKind::StaleRead
                    };
                    let writer = self.label(kv.writers[v]);
                    (
                        kind,
                        format!(
                            "{shown}, the version {writer} committed at cid {}",
                            kv.cids[v]
                        ),
                    )
                }
                Err(v) => {
                    let writer = self.label(kv.writers[v]);
                    (
                        AnomalyKind::IntermediateRead,
                        format!(
                            "{shown}, part way through {writer}'s appends (cid {})",
                            kv.cids[v]
                        ),
                    )
                }
            };
        }
        let differs = seen
            .iter()
            .zip(&kv.elements)
            .take_while(|(a, b)| a == b)
            .count();
        let element = seen[differs];
        match index.appender(read.key, element) {
            Some(write) if !index.txns[write.txn as usize].committed => (
                AnomalyKind::UncommittedRead,
                format!(
                    "{shown}, whose element {element} was appended by {}, which {}",
                    self.label(write.txn),
                    outcome(index, write.txn)
                ),
            ),
            Some(write) => (
                AnomalyKind::ImpossibleRead,
                format!(
                    "{shown}, which puts {}'s element {element} where no committed version has it",
                    self.label(write.txn)
                ),
            ),
            None => (
                AnomalyKind::ImpossibleRead,
                format!("{shown}, whose element {element} no transaction appended"),
            ),
        }
    }

    /// Which version (or non-version) a wrong register read returned.
    fn diagnose_register(
        &mut self,
        read: &ReadRec,
        newest: Option<usize>,
    ) -> (AnomalyKind, String) {
        let index = self.index;
        let kv = &self.versions[read.key as usize];
        let key = index.key_name(read.key);
        let Seen::Value(value) = read.seen else {
            return (
                AnomalyKind::StaleRead,
                format!("{key}=null, the state before any version"),
            );
        };
        let shown = format!("{key}={value}");
        // Built once, on the first wrong register read: a broken store may give
        // millions, and searching a hot key's versions for each would be quadratic.
        let by_value = self.register_values.get_or_insert_with(|| {
            let mut map: HashMap<(u32, i64), ValueWrites> = HashMap::new();
            for (key, kv) in self.versions.iter().enumerate() {
                for (v, value) in kv.values.iter().enumerate() {
                    let entry = map.entry((key as u32, *value)).or_default();
                    entry.versions.push(v as u32);
                }
            }
            for (w, write) in index.writes.iter().enumerate() {
                if !write.append {
                    let entry = map.entry((write.key, write.value)).or_default();
                    entry.any.get_or_insert(w as u32);
                    if !index.txns[write.txn as usize].committed {
                        entry.uncommitted.get_or_insert(w as u32);
                    }
                }
            }
            map
        });
        let empty = ValueWrites::default();
        let writes = by_value.get(&(read.key, value)).unwrap_or(&empty);
        let holding = &writes.versions;
        let named = read.version.and_then(|cid| {
            let v = kv.cids.partition_point(|&c| c < cid);
            (kv.cids.get(v) == Some(&cid) && kv.values[v] == value).then_some(v)
        });
        let first_after = holding.partition_point(|&v| Some(v as usize) <= newest);
        // Prefer the version the read named, then the nearest one after its snapshot,
        // then the nearest before.
        let pick = named
            .or_else(|| holding.get(first_after).map(|&v| v as usize))
            .or_else(|| first_after.checked_sub(1).map(|i| holding[i] as usize));
        if let Some(v) = pick {
            let kind = if Some(v) > newest {
                AnomalyKind::FutureRead
            } else {
                AnomalyKind::StaleRead
            };
            let writer = index.label(kv.writers[v]);
            return (
                kind,
                format!(
                    "{shown}, the version {writer} committed at cid {}",
                    kv.cids[v]
                ),
            );
        }
        if let Some(w) = writes.uncommitted {
            let write = &index.writes[w as usize];
            let writer = index.label(write.txn);
            return (
                AnomalyKind::UncommittedRead,
                format!(
                    "{shown}, written by {writer}, which {}",
                    outcome(index, write.txn)
                ),
            );
        }
        if let Some(w) = writes.any {
            let writer = index.label(index.writes[w as usize].txn);
            return (
                AnomalyKind::IntermediateRead,
                format!("{shown}, which {writer} overwrote before committing"),
            );
        }
        (
            AnomalyKind::ImpossibleRead,
            format!("{shown}, a value no transaction wrote"),
        )
    }

    fn sessions(&mut self) {
        let index = self.index;
        let mut order: Vec<u32> = (0..index.txns.len() as u32).collect();
        // Within a session, transactions run one after another: order them by when they
        // began, falling back to history order for histories without clocks.
        order.sort_by_key(|&t| {
            let meta = &index.txns[t as usize];
            (meta.session, meta.begin_ns.unwrap_or(0), t)
        });
        let mut last_commit: Option<(u64, u64, u32)> = None; // (session, cid, txn)
        for t in order {
            let meta = &index.txns[t as usize];
            if last_commit.is_some_and(|(session, _, _)| session != meta.session) {
                last_commit = None;
            }
            if let (Some(rid), Some((_, cid, earlier))) = (meta.rid, last_commit)
                && rid < cid
            {
                let (earlier, later, session) = (self.label(earlier), self.label(t), meta.session);
                self.findings.add(AnomalyKind::Session, || {
                    Explained::new(
                        format!(
                            "{later} of session {session} read from rid {rid}, older than \
                             {earlier}, which the same session committed earlier at cid {cid}"
                        ),
                        vec![index.txns[t as usize].id],
                    )
                });
            }
            if meta.committed
                && let Some(cid) = meta.cid
                && last_commit.is_none_or(|(_, last, _)| cid > last)
            {
                last_commit = Some((meta.session, cid, t));
            }
        }
    }

    fn real_time(&mut self) {
        let index = self.index;
        let mut commits: Vec<(u64, u64, u32)> = index
            .txns
            .iter()
            .enumerate()
            .filter(|(_, m)| m.committed)
            .filter_map(|(t, m)| Some((m.end_ns?, m.cid?, t as u32)))
            .collect();
        commits.sort_unstable();
        let mut begins: Vec<(u64, u64, u32)> = index
            .txns
            .iter()
            .enumerate()
            .filter_map(|(t, m)| Some((m.begin_ns?, m.rid?, t as u32)))
            .collect();
        begins.sort_unstable();
        // Sweep by begin time, keeping the highest CID among commits that had returned.
        let mut returned = 0;
        let mut newest: Option<(u64, u32)> = None; // (cid, txn)
        for (begin, rid, t) in begins {
            while returned < commits.len() && commits[returned].0 < begin {
                let (_, cid, committer) = commits[returned];
                if newest.is_none_or(|(best, _)| cid > best) {
                    newest = Some((cid, committer));
                }
                returned += 1;
            }
            if let Some((cid, committer)) = newest
                && rid < cid
            {
                let (earlier, later) = (self.label(committer), self.label(t));
                let end = index.txns[committer as usize].end_ns.unwrap_or(0);
                self.findings.add(AnomalyKind::RealTime, || {
                    Explained::new(
                        format!(
                            "{later} began at {begin} ns, after {earlier}'s commit (cid {cid}) \
                             returned at {end} ns, yet read from rid {rid}"
                        ),
                        vec![index.txns[t as usize].id],
                    )
                });
            }
        }
    }
}

fn outcome(index: &HistoryIndex, txn: u32) -> &'static str {
    match index.txns[txn as usize].status {
        crate::history::Status::Aborted => "aborted",
        crate::history::Status::Unknown => "never showed it committed",
        crate::history::Status::Committed => "committed",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::history::{Op, ReadValue, Status, Txn};
    use crate::index::tests::{append, r, rl, w};
    use Status::*;

    /// A transaction with timestamps: begins at `rid * 10` ns, ends at `cid * 10 + 5`.
    fn ts(id: u64, session: u64, status: Status, rid: u64, cid: Option<u64>, ops: Vec<Op>) -> Txn {
        let mut t = Txn::new(id, session, status);
        t.rid = Some(rid);
        t.cid = cid;
        t.begin_ns = Some(rid * 10);
        t.end_ns = Some(cid.unwrap_or(rid) * 10 + 5);
        t.ops = ops;
        t
    }

    fn run(txns: Vec<Txn>) -> Findings {
        let index = HistoryIndex::from_txns(txns).expect("indexes");
        let mut findings = Findings::default();
        check(&index, &mut findings).expect("white-box runs");
        findings
    }

    fn kinds(findings: &Findings) -> Vec<(AnomalyKind, u64)> {
        findings.iter().map(|(k, f)| (k, f.count)).collect()
    }

    fn first_summary(findings: &Findings) -> String {
        findings.iter().next().expect("a finding").1.examples[0]
            .summary
            .clone()
    }

    fn reg(v: i64) -> ReadValue {
        ReadValue::Register(v)
    }

    /// Three sessions over a register and a list, every read the newest version.
    fn valid() -> Vec<Txn> {
        vec![
            ts(
                1,
                1,
                Committed,
                0,
                Some(1),
                vec![w("x", 10), append("l", 1)],
            ),
            ts(
                2,
                2,
                Committed,
                1,
                Some(2),
                vec![r("x", reg(10)), append("l", 2), w("x", 20)],
            ),
            ts(3, 3, Aborted, 1, None, vec![rl("l", &[1]), append("l", 99)]),
            ts(
                4,
                1,
                Committed,
                2,
                None,
                vec![r("x", reg(20)), rl("l", &[1, 2])],
            ),
            ts(
                5,
                3,
                Committed,
                2,
                Some(3),
                vec![rl("l", &[1, 2]), append("l", 3), rl("l", &[1, 2, 3])],
            ),
        ]
    }

    #[test]
    fn a_valid_history_passes() {
        let findings = run(valid());
        assert!(findings.is_empty(), "{:?}", kinds(&findings));
    }

    #[test]
    fn an_old_version_is_a_stale_read() {
        let mut txns = valid();
        txns[3].ops[0] = r("x", reg(10));
        let findings = run(txns);
        assert_eq!(kinds(&findings), vec![(AnomalyKind::StaleRead, 1)]);
        assert_eq!(
            first_summary(&findings),
            "T4 (rid 2) read x=10, the version T1 committed at cid 1; its snapshot holds x=20 of T2 (cid 2)"
        );
    }

    #[test]
    fn a_version_from_after_the_snapshot_is_a_future_read() {
        let mut txns = valid();
        txns[1].ops[0] = r("x", reg(20));
        txns[2].ops[0] = rl("l", &[1, 2]);
        let findings = run(txns);
        assert_eq!(kinds(&findings), vec![(AnomalyKind::FutureRead, 2)]);
    }

    #[test]
    fn an_aborted_write_read_is_an_uncommitted_read() {
        let mut txns = valid();
        txns[3].ops[1] = rl("l", &[1, 2, 99]);
        let findings = run(txns);
        assert_eq!(kinds(&findings), vec![(AnomalyKind::UncommittedRead, 1)]);
        assert!(first_summary(&findings).contains("element 99 was appended by T3, which aborted"));
    }

    #[test]
    fn an_overwritten_register_value_is_an_intermediate_read() {
        let mut txns = valid();
        txns[1].ops.insert(1, w("x", 15));
        txns[3].ops[0] = r("x", reg(15));
        let findings = run(txns);
        assert_eq!(kinds(&findings), vec![(AnomalyKind::IntermediateRead, 1)]);
    }

    #[test]
    fn part_of_a_transactions_appends_is_an_intermediate_read() {
        let mut txns = valid();
        txns[1].ops.push(append("l", 4));
        txns[3].ops[1] = rl("l", &[1, 2]);
        txns[4].ops = vec![rl("l", &[1, 2, 4])];
        txns.push(ts(6, 4, Committed, 3, None, vec![rl("l", &[1, 2])]));
        let findings = run(txns);
        assert_eq!(kinds(&findings), vec![(AnomalyKind::IntermediateRead, 2)]);
    }

    #[test]
    fn values_nobody_wrote_are_impossible_reads() {
        let mut txns = valid();
        txns[3].ops[0] = r("x", reg(77));
        txns[3].ops[1] = rl("l", &[2, 1]);
        let findings = run(txns);
        assert_eq!(kinds(&findings), vec![(AnomalyKind::ImpossibleRead, 2)]);
    }

    #[test]
    fn a_misnamed_version_is_caught() {
        let mut txns = valid();
        txns[3].ops[0] = Op::Read {
            key: "x".into(),
            value: reg(20),
            version: Some(1),
        };
        let findings = run(txns);
        assert_eq!(kinds(&findings), vec![(AnomalyKind::WrongVersion, 1)]);
    }

    #[test]
    fn overlapping_writers_break_first_committer_wins() {
        let mut txns = valid();
        // T5 read from rid 1, before T2's write of l at cid 2.
        txns[4] = ts(
            5,
            3,
            Committed,
            1,
            Some(3),
            vec![rl("l", &[1]), append("l", 3)],
        );
        let findings = run(txns);
        assert_eq!(kinds(&findings), vec![(AnomalyKind::FirstCommitterWins, 1)]);
        assert!(first_summary(&findings).starts_with("T2 and T5 both wrote l"));
    }

    #[test]
    fn a_session_must_see_its_last_commit() {
        let mut txns = valid();
        // Session 1 committed T1 at cid 1; its next transaction reads from rid 0.
        txns[3] = ts(4, 1, Committed, 0, None, vec![]);
        txns[3].begin_ns = Some(100);
        let findings = run(txns);
        assert_eq!(
            kinds(&findings),
            vec![(AnomalyKind::Session, 1), (AnomalyKind::RealTime, 1)]
        );
    }

    #[test]
    fn a_transaction_must_see_commits_that_returned_before_it_began() {
        let mut txns = valid();
        txns.push(ts(6, 9, Committed, 1, None, vec![r("x", reg(10))]));
        txns[5].begin_ns = Some(1000);
        let findings = run(txns);
        assert_eq!(kinds(&findings), vec![(AnomalyKind::RealTime, 1)]);
        assert!(first_summary(&findings).contains("after T5's commit (cid 3)"));
    }

    #[test]
    fn a_header_without_real_time_skips_only_that_check() {
        let mut txns = valid();
        txns.push(ts(6, 9, Committed, 1, None, vec![r("x", reg(10))]));
        txns[5].begin_ns = Some(1000);
        // And a session that missed its own commit, which is still found.
        txns.push(ts(7, 1, Committed, 0, None, vec![]));
        txns[6].begin_ns = Some(2000);
        let header = crate::history::Header {
            real_time: false,
            why: Some("commits returned before they were visible".into()),
        };
        let index = HistoryIndex::from_txns(txns)
            .expect("indexes")
            .with_header(Some(header));
        let mut findings = Findings::default();
        let summary = check(&index, &mut findings).expect("white-box runs");
        assert_eq!(kinds(&findings), vec![(AnomalyKind::Session, 1)]);
        assert_eq!(
            summary.real_time_skipped.as_deref(),
            Some("commits returned before they were visible")
        );
        let report = crate::report::check(&index, crate::report::Model::SnapshotIsolation);
        let shown = report.to_string();
        assert!(
            shown.contains("real-time order not checked")
                && shown.contains("before they were visible"),
            "{shown}"
        );
    }

    #[test]
    fn bad_timestamps_are_reported() {
        let mut txns = valid();
        txns.push(ts(6, 9, Committed, 5, Some(5), vec![]));
        txns.push(ts(7, 9, Committed, 5, Some(3), vec![]));
        let findings = run(txns);
        assert_eq!(
            kinds(&findings),
            vec![
                (AnomalyKind::CommitBeforeSnapshot, 2),
                (AnomalyKind::DuplicateCid, 1)
            ]
        );
    }

    #[test]
    fn histories_without_timestamps_are_skipped_with_a_reason() {
        let index = HistoryIndex::from_txns([Txn::new(1, 1, Committed)]).expect("indexes");
        let reason = check(&index, &mut Findings::default()).expect_err("skipped");
        assert!(reason.contains("no timestamps"), "{reason}");
        let mut txns = valid();
        txns[1].cid = None;
        let index = HistoryIndex::from_txns(txns).expect("indexes");
        let reason = check(&index, &mut Findings::default()).expect_err("skipped");
        assert_eq!(reason, "T2 committed writes without a cid");
    }
}
