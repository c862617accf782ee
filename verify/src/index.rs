//! The compact, checkable form of a history, built in one streaming pass.
//!
//! Both checkers work from this index rather than from the transactions themselves:
//! keys are interned, operations are fixed-size records, and a list read is stored as a
//! length into its key's longest observed list. That is possible because every read of
//! a list key must be a prefix of one version order; the builder checks exactly that as
//! the reads stream past (a read that is not is an `incompatible-order` anomaly and is
//! kept whole, "detached"). A million transactions thus need a few hundred bytes each,
//! whatever the lists' lengths.
//!
//! The builder also checks what needs no other transaction: that each read agrees with
//! the transaction's own earlier reads and writes of the key (`internal`).

use crate::anomaly::{AnomalyKind, Explained, Findings, show_list};
use crate::history::{Header, HistoryError, HistoryReader, Op, ReadValue, Status, Txn};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::BufRead;

/// A history that cannot be indexed: it breaks a rule of the format itself.
#[derive(Debug, thiserror::Error)]
#[error("transaction {txn}: {message}")]
pub struct IndexError {
    pub txn: u64,
    pub message: String,
}

/// Whether a key holds a register (`w`, integer reads) or a list (`append`, list reads).
/// A key only ever read as `null` stays `Unknown`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyKind {
    Unknown,
    Register,
    List,
}

pub(crate) struct KeyInfo {
    pub(crate) name: String,
    pub(crate) kind: KeyKind,
    /// The longest list any read of this key returned (without the reader's own
    /// appends). Every compatible read is a prefix of it.
    pub(crate) longest: Vec<i64>,
    /// Index of the transaction whose read gave `longest`.
    pub(crate) longest_reader: u32,
}

pub(crate) struct TxnMeta {
    pub(crate) id: u64,
    pub(crate) session: u64,
    pub(crate) status: Status,
    /// Committed, or of unknown outcome but with a write that some read observed.
    pub(crate) committed: bool,
    pub(crate) rid: Option<u64>,
    pub(crate) cid: Option<u64>,
    pub(crate) begin_ns: Option<u64>,
    pub(crate) end_ns: Option<u64>,
    /// This transaction's records in `HistoryIndex::reads` and `::writes`.
    pub(crate) reads: (u32, u32),
    pub(crate) writes: (u32, u32),
}

/// What a read saw, in index form.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Seen {
    /// `null`: nothing written yet (for a list key, the empty list).
    Absent,
    /// A register's value, from the snapshot.
    Value(i64),
    /// The first n elements of the key's longest list: the snapshot part of the read,
    /// without the transaction's own appends at its end.
    Prefix(u32),
    /// A list incompatible with the longest one, kept whole in `detached`.
    Detached(u32),
    /// A register the transaction had written itself (already checked internally).
    OwnWrite,
    /// Contradicts the transaction's own operations; reported, then left out.
    Inconsistent,
}

pub(crate) struct ReadRec {
    pub(crate) txn: u32,
    pub(crate) key: u32,
    pub(crate) version: Option<u64>,
    pub(crate) seen: Seen,
}

pub(crate) struct WriteRec {
    pub(crate) txn: u32,
    pub(crate) key: u32,
    /// The appended element or the written value.
    pub(crate) value: i64,
    pub(crate) append: bool,
    /// The transaction's last write to this key: the one its committed version holds.
    pub(crate) last_in_txn: bool,
}

/// Counts that describe a history, for the report.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HistoryStats {
    pub txns: u64,
    pub committed: u64,
    pub aborted: u64,
    pub unknown: u64,
    /// Unknown-outcome transactions some read proves committed.
    pub unknown_observed: u64,
    pub sessions: u64,
    pub register_keys: u64,
    pub list_keys: u64,
    pub reads: u64,
    pub writes: u64,
    /// Aborted and unknown transactions by their `error`.
    pub errors: BTreeMap<String, u64>,
}

/// The indexed history; build it with [`IndexBuilder`], [`load_jsonl`] or
/// [`HistoryIndex::from_txns`].
pub struct HistoryIndex {
    pub(crate) keys: Vec<KeyInfo>,
    pub(crate) txns: Vec<TxnMeta>,
    pub(crate) reads: Vec<ReadRec>,
    pub(crate) writes: Vec<WriteRec>,
    pub(crate) detached: Vec<Vec<i64>>,
    /// (key, element) → the write that appended it.
    pub(crate) appends: HashMap<(u32, i64), u32>,
    /// `internal` and `incompatible-order` anomalies.
    pub(crate) findings: Findings,
    stats: HistoryStats,
    /// What the recorder promised (the history's first line), if it said.
    header: Option<Header>,
}

impl HistoryIndex {
    pub fn from_txns(txns: impl IntoIterator<Item = Txn>) -> Result<HistoryIndex, IndexError> {
        Self::from_txns_with_examples(txns, Findings::DEFAULT_EXAMPLES)
    }

    pub fn from_txns_with_examples(
        txns: impl IntoIterator<Item = Txn>,
        max_examples: usize,
    ) -> Result<HistoryIndex, IndexError> {
        let mut builder = IndexBuilder::new(max_examples);
        for txn in txns {
            builder.push(txn)?;
        }
        Ok(builder.finish())
    }

    pub fn stats(&self) -> &HistoryStats {
        &self.stats
    }

    pub fn header(&self) -> Option<&Header> {
        self.header.as_ref()
    }

    /// Why the real-time check does not apply, if the recorder said it does not.
    pub fn real_time_waived(&self) -> Option<String> {
        match &self.header {
            Some(h) if !h.real_time => Some(
                h.why
                    .clone()
                    .unwrap_or_else(|| "its header says real_time: false".into()),
            ),
            _ => None,
        }
    }

    /// The index with `header`, as a history whose first line it was.
    pub fn with_header(mut self, header: Option<Header>) -> HistoryIndex {
        self.header = header;
        self
    }

    pub(crate) fn key_id(&self, name: &str) -> Option<u32> {
        self.keys
            .iter()
            .position(|k| k.name == name)
            .map(|k| k as u32)
    }

    pub(crate) fn key_name(&self, key: u32) -> &str {
        &self.keys[key as usize].name
    }

    pub(crate) fn txn_reads(&self, txn: u32) -> &[ReadRec] {
        let (start, end) = self.txns[txn as usize].reads;
        &self.reads[start as usize..end as usize]
    }

    pub(crate) fn txn_writes(&self, txn: u32) -> &[WriteRec] {
        let (start, end) = self.txns[txn as usize].writes;
        &self.writes[start as usize..end as usize]
    }

    /// The snapshot part of a list read (`None` for register reads and left-out reads).
    pub(crate) fn snapshot_list(&self, read: &ReadRec) -> Option<&[i64]> {
        match read.seen {
            Seen::Absent => Some(&[]),
            Seen::Prefix(len) => Some(&self.keys[read.key as usize].longest[..len as usize]),
            Seen::Detached(i) => Some(&self.detached[i as usize]),
            Seen::Value(_) | Seen::OwnWrite | Seen::Inconsistent => None,
        }
    }

    /// The transaction that appended `element` to `key`, if any did.
    pub(crate) fn appender(&self, key: u32, element: i64) -> Option<&WriteRec> {
        self.appends
            .get(&(key, element))
            .map(|&w| &self.writes[w as usize])
    }

    /// `T<id>`, the way reports name a transaction.
    pub(crate) fn label(&self, txn: u32) -> String {
        format!("T{}", self.txns[txn as usize].id)
    }
}

/// What one transaction has established about one key so far, to check its next read.
#[derive(Default)]
struct LocalKey {
    /// The value the transaction must see now, once a read has told it.
    known: Option<ReadValue>,
    /// Its own appends to the key so far.
    own_appends: Vec<i64>,
    own_writes: u32,
    last_write_marked: bool,
}

/// Builds a [`HistoryIndex`] one transaction at a time.
pub struct IndexBuilder {
    index: HistoryIndex,
    key_ids: HashMap<String, u32>,
    txn_ids: HashSet<u64>,
    sessions: HashSet<u64>,
    /// The current transaction's keys (hashed: one transaction may touch thousands).
    local: HashMap<u32, LocalKey>,
}

impl IndexBuilder {
    pub fn new(max_examples: usize) -> IndexBuilder {
        IndexBuilder {
            index: HistoryIndex {
                keys: Vec::new(),
                txns: Vec::new(),
                reads: Vec::new(),
                writes: Vec::new(),
                detached: Vec::new(),
                appends: HashMap::new(),
                findings: Findings::new(max_examples),
                stats: HistoryStats::default(),
                header: None,
            },
            key_ids: HashMap::new(),
            txn_ids: HashSet::new(),
            sessions: HashSet::new(),
            local: HashMap::new(),
        }
    }

    pub fn push(&mut self, txn: Txn) -> Result<(), IndexError> {
        let error = |message: String| IndexError {
            txn: txn.id,
            message,
        };
        if !self.txn_ids.insert(txn.id) {
            return Err(error("the id appears twice in the history".into()));
        }
        let too_large = || error("the history has more than 2^32 - 1 records".into());
        let t = u32::try_from(self.index.txns.len()).map_err(|_| too_large())?;
        let reads_start = u32::try_from(self.index.reads.len()).map_err(|_| too_large())?;
        let writes_start = u32::try_from(self.index.writes.len()).map_err(|_| too_large())?;
        self.sessions.insert(txn.session);
        let stats = &mut self.index.stats;
        stats.txns += 1;
        match txn.status {
            Status::Committed => stats.committed += 1,
            Status::Aborted => stats.aborted += 1,
            Status::Unknown => stats.unknown += 1,
        }
        if txn.status != Status::Committed {
            let kind = txn.error.clone().unwrap_or_else(|| "unspecified".into());
            *stats.errors.entry(kind).or_default() += 1;
        }

        self.local.clear();
        for op in txn.ops {
            match op {
                Op::Append { key, element } => {
                    let key = self.key(key, KeyKind::List).map_err(error)?;
                    let w = u32::try_from(self.index.writes.len()).map_err(|_| too_large())?;
                    if let Some(&earlier) = self.index.appends.get(&(key, element)) {
                        let other = self.index.writes[earlier as usize].txn;
                        let other = self.index.txns.get(other as usize).map_or(txn.id, |m| m.id);
                        return Err(error(format!(
                            "element {element} is appended to key {:?} twice (also by \
                             transaction {other}); list-append elements must be unique per key",
                            self.index.keys[key as usize].name
                        )));
                    }
                    self.index.appends.insert((key, element), w);
                    self.push_write(t, key, element, true);
                    let local = self.local_key(key);
                    local.own_appends.push(element);
                    local.own_writes += 1;
                    match &mut local.known {
                        Some(ReadValue::List(list)) => list.push(element),
                        Some(known @ ReadValue::Absent) => *known = ReadValue::List(vec![element]),
                        _ => {}
                    }
                }
                Op::Write { key, value } => {
                    let key = self.key(key, KeyKind::Register).map_err(error)?;
                    self.push_write(t, key, value, false);
                    let local = self.local_key(key);
                    local.own_writes += 1;
                    local.known = Some(ReadValue::Register(value));
                }
                Op::Read {
                    key,
                    value,
                    version,
                } => {
                    let kind = match value {
                        ReadValue::Absent => KeyKind::Unknown,
                        ReadValue::Register(_) => KeyKind::Register,
                        ReadValue::List(_) => KeyKind::List,
                    };
                    let key = self.key(key, kind).map_err(error)?;
                    u32::try_from(self.index.reads.len()).map_err(|_| too_large())?;
                    self.push_read(t, txn.id, key, value, version);
                }
            }
        }
        self.mark_last_writes(writes_start);
        let stats = &mut self.index.stats;
        stats.reads = self.index.reads.len() as u64;
        stats.writes = self.index.writes.len() as u64;
        self.index.txns.push(TxnMeta {
            id: txn.id,
            session: txn.session,
            status: txn.status,
            committed: txn.status == Status::Committed,
            rid: txn.rid,
            cid: txn.cid,
            begin_ns: txn.begin_ns,
            end_ns: txn.end_ns,
            reads: (reads_start, self.index.reads.len() as u32),
            writes: (writes_start, self.index.writes.len() as u32),
        });
        Ok(())
    }

    pub fn finish(mut self) -> HistoryIndex {
        self.resolve_unknown_outcomes();
        let index = &mut self.index;
        index.stats.sessions = self.sessions.len() as u64;
        for key in &index.keys {
            match key.kind {
                KeyKind::Register => index.stats.register_keys += 1,
                KeyKind::List => index.stats.list_keys += 1,
                KeyKind::Unknown => {}
            }
        }
        self.index
    }

    /// The key's id, fixing its kind on first typed use.
    fn key(&mut self, name: String, kind: KeyKind) -> Result<u32, String> {
        let id = match self.key_ids.get(&name) {
            Some(&id) => id,
            None => {
                let id = self.index.keys.len() as u32;
                self.index.keys.push(KeyInfo {
                    name: name.clone(),
                    kind: KeyKind::Unknown,
                    longest: Vec::new(),
                    longest_reader: 0,
                });
                self.key_ids.insert(name, id);
                id
            }
        };
        let info = &mut self.index.keys[id as usize];
        match (info.kind, kind) {
            (_, KeyKind::Unknown) => {}
            (KeyKind::Unknown, _) => info.kind = kind,
            (have, want) if have != want => {
                return Err(format!(
                    "key {:?} is used both as a register and as a list",
                    info.name
                ));
            }
            _ => {}
        }
        Ok(id)
    }

    fn local_key(&mut self, key: u32) -> &mut LocalKey {
        self.local.entry(key).or_default()
    }

    fn push_write(&mut self, txn: u32, key: u32, value: i64, append: bool) {
        self.index.writes.push(WriteRec {
            txn,
            key,
            value,
            append,
            last_in_txn: false,
        });
    }

    /// Marks the transaction's last write to each key, using `local` (whose keys are
    /// exactly the ones it touched) to remember which keys are done.
    fn mark_last_writes(&mut self, start: u32) {
        for write in self.index.writes[start as usize..].iter_mut().rev() {
            if let Some(local) = self.local.get_mut(&write.key) {
                write.last_in_txn = !std::mem::replace(&mut local.last_write_marked, true);
            }
        }
    }

    fn push_read(
        &mut self,
        txn: u32,
        txn_id: u64,
        key: u32,
        value: ReadValue,
        version: Option<u64>,
    ) {
        let list_key = self.index.keys[key as usize].kind == KeyKind::List;
        let local = self.local_key(key);
        let own_writes = local.own_writes;
        // What the transaction's own operations say this read must return, if they say.
        let contradiction = match (&local.known, &value) {
            (Some(known), seen) if !same_value(known, seen, list_key) => Some(describe(known)),
            (None, _) if !local.own_appends.is_empty() => {
                let own_appends = &local.own_appends;
                let ends_with_own = match &value {
                    ReadValue::List(list) => list.ends_with(own_appends),
                    _ => false,
                };
                (!ends_with_own).then(|| {
                    format!(
                        "a list ending in its own appends {}",
                        show_list(own_appends)
                    )
                })
            }
            _ => None,
        };
        let own_appends = local.own_appends.len();
        // A contradicting read does not become what the transaction knows: later reads
        // are still held to what its own operations imply (and so, like every read
        // that passes, end with its own appends).
        if contradiction.is_none() {
            local.known = Some(value.clone());
        }
        let seen = if let Some(expected) = contradiction {
            let key_name = self.index.keys[key as usize].name.clone();
            self.index.findings.add(AnomalyKind::Internal, || {
                Explained::new(
                    format!(
                        "T{txn_id} read {key_name}={} but its own earlier operations imply {expected}",
                        describe(&value)
                    ),
                    vec![txn_id],
                )
            });
            Seen::Inconsistent
        } else {
            match value {
                ReadValue::Absent => Seen::Absent,
                ReadValue::Register(_) if own_writes > 0 => Seen::OwnWrite,
                ReadValue::Register(v) => Seen::Value(v),
                ReadValue::List(mut list) => {
                    list.truncate(list.len() - own_appends);
                    self.observe_list(txn, txn_id, key, list)
                }
            }
        };
        self.index.reads.push(ReadRec {
            txn,
            key,
            version,
            seen,
        });
    }

    /// Files a list read against the key's longest list: as a prefix of it (extending
    /// it if the read is longer), or detached when the two disagree.
    fn observe_list(&mut self, txn: u32, txn_id: u64, key: u32, list: Vec<i64>) -> Seen {
        let info = &mut self.index.keys[key as usize];
        let common = info.longest.len().min(list.len());
        if info.longest[..common] == list[..common] {
            if list.len() > info.longest.len() {
                info.longest = list;
                info.longest_reader = txn;
                return Seen::Prefix(info.longest.len() as u32);
            }
            return Seen::Prefix(list.len() as u32);
        }
        // The longest list may come from this very transaction, not yet indexed.
        let other = match self.index.txns.get(info.longest_reader as usize) {
            Some(meta) if info.longest_reader != txn => meta.id,
            _ => txn_id,
        };
        let (name, longest) = (&info.name, &info.longest);
        self.index.findings.add(AnomalyKind::IncompatibleOrder, || {
            Explained::new(
                format!(
                    "T{txn_id} read {name}={} but T{other} read {name}={}: neither is a prefix \
                     of the other, so no version order explains both",
                    show_list(&list),
                    show_list(longest)
                ),
                vec![txn_id, other],
            )
        });
        self.index.detached.push(list);
        Seen::Detached(self.index.detached.len() as u32 - 1)
    }

    /// An unknown-outcome transaction whose write was observed did commit: one of its
    /// appended elements is in a list some read returned, or a read names its CID.
    fn resolve_unknown_outcomes(&mut self) {
        let index = &mut self.index;
        if index.stats.unknown == 0 {
            return;
        }
        let mut observed = vec![false; index.txns.len()];
        let lists = index
            .keys
            .iter()
            .enumerate()
            .map(|(k, info)| (k as u32, &info.longest))
            .chain(index.reads.iter().filter_map(|r| match r.seen {
                Seen::Detached(i) => Some((r.key, &index.detached[i as usize])),
                _ => None,
            }));
        for (key, list) in lists {
            for element in list {
                if let Some(&w) = index.appends.get(&(key, *element)) {
                    observed[index.writes[w as usize].txn as usize] = true;
                }
            }
        }
        let unknown_cids: HashMap<u64, u32> = index
            .txns
            .iter()
            .enumerate()
            .filter(|(_, m)| m.status == Status::Unknown)
            .filter_map(|(t, m)| Some((m.cid?, t as u32)))
            .collect();
        if !unknown_cids.is_empty() {
            for read in &index.reads {
                if let Some(&t) = read.version.and_then(|v| unknown_cids.get(&v)) {
                    observed[t as usize] = true;
                }
            }
        }
        for (meta, seen) in index.txns.iter_mut().zip(observed) {
            if meta.status == Status::Unknown && seen {
                meta.committed = true;
                index.stats.unknown_observed += 1;
            }
        }
    }
}

/// Whether a read returned what the transaction already knew the key to hold. For a
/// list key `null` and `[]` are the same thing.
fn same_value(known: &ReadValue, seen: &ReadValue, list_key: bool) -> bool {
    let empty = |v: &ReadValue| matches!(v, ReadValue::List(l) if l.is_empty());
    known == seen
        || (list_key
            && (empty(known) || *known == ReadValue::Absent)
            && (empty(seen) || *seen == ReadValue::Absent))
}

fn describe(value: &ReadValue) -> String {
    match value {
        ReadValue::Absent => "null".into(),
        ReadValue::Register(v) => v.to_string(),
        ReadValue::List(list) => show_list(list),
    }
}

/// Indexes a JSON Lines history as it streams in; errors name the line.
pub fn load_jsonl(input: impl BufRead, max_examples: usize) -> Result<HistoryIndex, HistoryError> {
    let mut reader = HistoryReader::new(input);
    let mut builder = IndexBuilder::new(max_examples);
    while let Some(txn) = reader.next() {
        builder.push(txn?).map_err(|e| HistoryError::Invalid {
            line: reader.line(),
            message: e.to_string(),
        })?;
    }
    Ok(builder.finish().with_header(reader.header().cloned()))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Shorthand for hand-built histories in tests: `txn(id, status, ops)` with
    /// `r("x", list![1, 2])`, `append("x", 3)`, `w("y", 5)`.
    pub(crate) fn txn(id: u64, status: Status, ops: Vec<Op>) -> Txn {
        let mut t = Txn::new(id, id, status);
        t.ops = ops;
        t
    }

    pub(crate) fn r(key: &str, value: ReadValue) -> Op {
        Op::Read {
            key: key.into(),
            value,
            version: None,
        }
    }

    pub(crate) fn rl(key: &str, list: &[i64]) -> Op {
        r(key, ReadValue::List(list.to_vec()))
    }

    pub(crate) fn append(key: &str, element: i64) -> Op {
        Op::Append {
            key: key.into(),
            element,
        }
    }

    pub(crate) fn w(key: &str, value: i64) -> Op {
        Op::Write {
            key: key.into(),
            value,
        }
    }

    use Status::*;

    #[test]
    fn reads_become_prefixes_of_the_longest_list() {
        let index = HistoryIndex::from_txns([
            txn(1, Committed, vec![rl("x", &[1]), append("x", 2)]),
            txn(2, Committed, vec![rl("x", &[1, 2, 3])]),
            txn(3, Committed, vec![rl("x", &[]), r("x", ReadValue::Absent)]),
        ])
        .expect("indexes");
        assert_eq!(index.keys[0].longest, vec![1, 2, 3]);
        let seen: Vec<Seen> = index.reads.iter().map(|r| r.seen).collect();
        assert_eq!(
            seen,
            vec![
                Seen::Prefix(1),
                Seen::Prefix(3),
                Seen::Prefix(0),
                Seen::Absent
            ]
        );
        assert!(index.findings.is_empty());
        assert_eq!(index.stats().list_keys, 1);
    }

    #[test]
    fn own_appends_are_stripped_from_the_snapshot() {
        let index = HistoryIndex::from_txns([txn(
            1,
            Committed,
            vec![
                append("x", 5),
                rl("x", &[1, 5]),
                append("x", 6),
                rl("x", &[1, 5, 6]),
            ],
        )])
        .expect("indexes");
        assert!(index.findings.is_empty(), "{:?}", index.findings);
        assert_eq!(index.reads[0].seen, Seen::Prefix(1));
        assert_eq!(index.reads[1].seen, Seen::Prefix(1));
        assert!(!index.writes[0].last_in_txn);
        assert!(index.writes[1].last_in_txn);
    }

    #[test]
    fn a_read_contradicting_own_operations_is_internal() {
        let index = HistoryIndex::from_txns([
            txn(1, Committed, vec![append("x", 5), rl("x", &[1])]),
            txn(
                2,
                Committed,
                vec![w("y", 5), r("y", ReadValue::Register(4))],
            ),
            txn(3, Committed, vec![rl("z", &[1]), rl("z", &[1, 2])]),
            txn(
                4,
                Committed,
                vec![
                    r("y", ReadValue::Register(1)),
                    r("y", ReadValue::Register(1)),
                ],
            ),
        ])
        .expect("indexes");
        assert_eq!(index.findings.count(AnomalyKind::Internal), 3);
        let (_, internal) = index.findings.iter().next().expect("found");
        assert!(internal.examples[0].summary.contains("T1 read x=[1]"));
        assert_eq!(index.reads[0].seen, Seen::Inconsistent);
        assert_eq!(index.reads[3].seen, Seen::Inconsistent);
        assert_eq!(index.reads[5].seen, Seen::Value(1));
    }

    #[test]
    fn incompatible_reads_are_detached_and_reported() {
        let index = HistoryIndex::from_txns([
            txn(1, Committed, vec![rl("x", &[1, 2])]),
            txn(2, Committed, vec![rl("x", &[1, 3])]),
        ])
        .expect("indexes");
        assert_eq!(index.reads[1].seen, Seen::Detached(0));
        assert_eq!(index.findings.count(AnomalyKind::IncompatibleOrder), 1);
        let (_, found) = index.findings.iter().next().expect("found");
        assert_eq!(
            found.examples[0].summary,
            "T2 read x=[1, 3] but T1 read x=[1, 2]: neither is a prefix of the other, so no \
             version order explains both"
        );
    }

    #[test]
    fn reads_after_a_contradiction_are_held_to_the_transactions_own_operations() {
        let index = HistoryIndex::from_txns([
            txn(
                1,
                Committed,
                vec![rl("x", &[1, 2]), rl("x", &[1, 3]), rl("x", &[1, 3])],
            ),
            txn(
                2,
                Committed,
                vec![append("y", 5), rl("y", &[]), rl("y", &[])],
            ),
        ])
        .expect("indexes");
        assert_eq!(index.findings.count(AnomalyKind::Internal), 4);
        assert_eq!(index.findings.count(AnomalyKind::IncompatibleOrder), 0);
        let seen: Vec<Seen> = index.reads.iter().map(|r| r.seen).collect();
        assert_eq!(seen[0], Seen::Prefix(2));
        assert!(
            seen[1..].iter().all(|s| *s == Seen::Inconsistent),
            "{seen:?}"
        );
    }

    #[test]
    fn unknown_outcomes_count_as_committed_once_observed() {
        let index = HistoryIndex::from_txns([
            txn(1, Unknown, vec![append("x", 1)]),
            txn(2, Unknown, vec![append("x", 2)]),
            txn(3, Committed, vec![rl("x", &[1])]),
        ])
        .expect("indexes");
        assert!(index.txns[0].committed);
        assert!(!index.txns[1].committed);
        assert_eq!(index.stats().unknown_observed, 1);
    }

    #[test]
    fn broken_format_rules_are_errors() {
        let duplicate_id =
            HistoryIndex::from_txns([txn(1, Committed, vec![]), txn(1, Aborted, vec![])]);
        assert!(
            duplicate_id
                .err()
                .expect("error")
                .to_string()
                .contains("appears twice")
        );
        let mixed = HistoryIndex::from_txns([txn(1, Committed, vec![w("x", 1), append("x", 2)])]);
        assert!(
            mixed
                .err()
                .expect("error")
                .to_string()
                .contains("both as a register and as a list")
        );
        let repeated = HistoryIndex::from_txns([
            txn(1, Committed, vec![append("x", 2)]),
            txn(2, Committed, vec![append("x", 2)]),
        ]);
        let message = repeated.err().expect("error").to_string();
        assert!(message.starts_with("transaction 2: element 2"), "{message}");
    }

    #[test]
    fn load_errors_name_the_line() {
        let text = "{\"id\":1,\"session\":0,\"status\":\"committed\"}\n{\"id\":1,\"session\":0,\"status\":\"committed\"}\n";
        let err = load_jsonl(text.as_bytes(), 1).err().expect("duplicate id");
        assert_eq!(
            err.to_string(),
            "line 2: transaction 1: the id appears twice in the history"
        );
    }
}
