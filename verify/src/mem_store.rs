//! An in-memory multi-version store with snapshot isolation: the reference the checkers
//! are shown to accept, and, with a deliberate [`Flaw`], the broken stores they are
//! shown to catch.
//!
//! One mutex guards everything: a commit validates, takes the next CID and installs its
//! versions atomically, so the committed prefix is simply the last CID and a
//! transaction's snapshot is the last CID when it began. Writes are buffered in the
//! transaction until commit.

use crate::history::ReadValue;
use crate::store::{ReadResult, StoreError, TxnStore};
use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, PoisonError};

/// A deliberate isolation bug.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flaw {
    /// Correct snapshot isolation.
    None,
    /// Commits without checking for newer versions of the keys written: lost updates.
    NoFirstCommitterWins,
    /// Reads see other transactions' uncommitted writes on top of the newest committed
    /// version, ignoring the snapshot.
    DirtyReads,
    /// Snapshots lag the committed prefix by up to two commits, even behind the
    /// session's own last commit.
    StaleSnapshots,
}

pub struct MemStore {
    flaw: Flaw,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    last_cid: u64,
    next_txn: u64,
    keys: HashMap<String, KeyState>,
    /// Uncommitted writes by key, in the order they were made (only kept for
    /// `Flaw::DirtyReads`).
    pending: HashMap<String, Vec<(u64, Buffered)>>,
}

#[derive(Default)]
struct KeyState {
    /// (cid, payload) in CID order.
    versions: Vec<(u64, Payload)>,
    /// A list key's committed elements; version i holds a prefix of them.
    elements: Vec<i64>,
}

#[derive(Clone, Copy)]
enum Payload {
    Register(i64),
    ListLen(usize),
}

#[derive(Clone, Copy, Debug)]
enum Buffered {
    Write(i64),
    Append(i64),
}

pub struct MemSession {
    last_cid: u64,
}

pub struct MemTxn {
    id: u64,
    rid: u64,
    writes: Vec<(String, Buffered)>,
}

impl MemStore {
    pub fn new() -> MemStore {
        MemStore::with_flaw(Flaw::None)
    }

    pub fn with_flaw(flaw: Flaw) -> MemStore {
        MemStore {
            flaw,
            state: Mutex::new(State::default()),
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // A panic elsewhere cannot leave the state half-updated: every update is
        // validated before anything is changed.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Default for MemStore {
    fn default() -> Self {
        MemStore::new()
    }
}

impl KeyState {
    /// The newest version with CID ≤ `ts`, as a value and its CID.
    fn at(&self, ts: u64) -> (ReadValue, Option<u64>) {
        let visible = self.versions.partition_point(|(cid, _)| *cid <= ts);
        match visible.checked_sub(1).map(|v| self.versions[v]) {
            None => (ReadValue::Absent, None),
            Some((cid, Payload::Register(v))) => (ReadValue::Register(v), Some(cid)),
            Some((cid, Payload::ListLen(len))) => {
                (ReadValue::List(self.elements[..len].to_vec()), Some(cid))
            }
        }
    }
}

/// `value` with `ops` applied in order.
fn apply(
    mut value: ReadValue,
    ops: impl Iterator<Item = Buffered>,
    key: &str,
) -> Result<ReadValue, StoreError> {
    for op in ops {
        value = match (value, op) {
            (ReadValue::List(_), Buffered::Write(_)) => {
                return Err(StoreError::WrongType(format!("write to list {key}")));
            }
            (ReadValue::Register(_), Buffered::Append(_)) => {
                return Err(StoreError::WrongType(format!("append to register {key}")));
            }
            (_, Buffered::Write(v)) => ReadValue::Register(v),
            (ReadValue::List(mut list), Buffered::Append(e)) => {
                list.push(e);
                ReadValue::List(list)
            }
            (ReadValue::Absent, Buffered::Append(e)) => ReadValue::List(vec![e]),
        };
    }
    Ok(value)
}

impl TxnStore for MemStore {
    type Session = MemSession;
    type Txn = MemTxn;

    fn open_session(&self) -> MemSession {
        MemSession { last_cid: 0 }
    }

    fn begin(&self, session: &mut MemSession) -> Result<MemTxn, StoreError> {
        let mut state = self.state();
        let id = state.next_txn;
        state.next_txn += 1;
        let rid = match self.flaw {
            Flaw::StaleSnapshots => state.last_cid.saturating_sub(id % 3),
            // The committed prefix never falls behind a session's commits here, but a
            // store whose prefix can lag waits for it; the max says what must hold.
            _ => state.last_cid.max(session.last_cid),
        };
        Ok(MemTxn {
            id,
            rid,
            writes: Vec::new(),
        })
    }

    fn read_timestamp(&self, txn: &MemTxn) -> Option<u64> {
        Some(txn.rid)
    }

    fn read(&self, txn: &mut MemTxn, key: &str) -> Result<ReadResult, StoreError> {
        let state = self.state();
        let committed = state.keys.get(key);
        let (base, version) = match (self.flaw, committed) {
            (_, None) => (ReadValue::Absent, None),
            (Flaw::DirtyReads, Some(k)) => k.at(u64::MAX),
            (_, Some(k)) => k.at(txn.rid),
        };
        let others: Vec<Buffered> = match self.flaw {
            Flaw::DirtyReads => state.pending.get(key).map_or(Vec::new(), |p| {
                p.iter()
                    .filter(|(id, _)| *id != txn.id)
                    .map(|(_, op)| *op)
                    .collect()
            }),
            _ => Vec::new(),
        };
        let own = txn
            .writes
            .iter()
            .filter(|(k, _)| k == key)
            .map(|(_, op)| *op);
        let value = apply(base, others.into_iter().chain(own), key)?;
        Ok(ReadResult { value, version })
    }

    fn write(&self, txn: &mut MemTxn, key: &str, value: i64) -> Result<(), StoreError> {
        self.buffer(txn, key, Buffered::Write(value));
        Ok(())
    }

    fn append(&self, txn: &mut MemTxn, key: &str, element: i64) -> Result<(), StoreError> {
        self.buffer(txn, key, Buffered::Append(element));
        Ok(())
    }

    fn commit(&self, session: &mut MemSession, txn: MemTxn) -> Result<Option<u64>, StoreError> {
        let mut state = self.state();
        state.forget_pending(&txn);
        if txn.writes.is_empty() {
            return Ok(None);
        }
        // Validate everything before changing anything.
        let mut installs: Vec<(&str, ReadValue)> = Vec::new();
        for (key, _) in &txn.writes {
            if installs.iter().any(|(k, _)| k == key) {
                continue;
            }
            let (latest, latest_cid) = state
                .keys
                .get(key.as_str())
                .map_or((ReadValue::Absent, None), |k| k.at(u64::MAX));
            if self.flaw != Flaw::NoFirstCommitterWins
                && latest_cid.is_some_and(|cid| cid > txn.rid)
            {
                return Err(StoreError::Conflict);
            }
            let ops = txn
                .writes
                .iter()
                .filter(|(k, _)| k == key)
                .map(|(_, op)| *op);
            installs.push((key, apply(latest, ops, key)?));
        }
        let cid = state.last_cid + 1;
        for (key, value) in installs {
            let k = state.keys.entry(key.to_string()).or_default();
            let payload = match value {
                ReadValue::Register(v) => Payload::Register(v),
                ReadValue::List(list) => {
                    k.elements = list;
                    Payload::ListLen(k.elements.len())
                }
                ReadValue::Absent => continue,
            };
            k.versions.push((cid, payload));
        }
        state.last_cid = cid;
        session.last_cid = cid;
        Ok(Some(cid))
    }

    fn abort(&self, _session: &mut MemSession, txn: MemTxn) {
        self.state().forget_pending(&txn);
    }
}

impl MemStore {
    fn buffer(&self, txn: &mut MemTxn, key: &str, op: Buffered) {
        if self.flaw == Flaw::DirtyReads {
            self.state()
                .pending
                .entry(key.to_string())
                .or_default()
                .push((txn.id, op));
        }
        txn.writes.push((key.to_string(), op));
    }
}

impl State {
    fn forget_pending(&mut self, txn: &MemTxn) {
        for (key, _) in &txn.writes {
            if let Some(pending) = self.pending.get_mut(key) {
                pending.retain(|(id, _)| *id != txn.id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn list(elements: &[i64]) -> ReadValue {
        ReadValue::List(elements.to_vec())
    }

    #[test]
    fn snapshots_hide_later_commits_and_first_committer_wins() {
        let store = MemStore::new();
        let (mut s1, mut s2) = (store.open_session(), store.open_session());
        let mut t1 = store.begin(&mut s1).expect("begins");
        let mut t2 = store.begin(&mut s2).expect("begins");
        store.append(&mut t1, "x", 1).expect("appends");
        assert_eq!(store.read(&mut t1, "x").expect("reads").value, list(&[1]));
        assert_eq!(store.commit(&mut s1, t1), Ok(Some(1)));
        let seen = store.read(&mut t2, "x").expect("reads");
        assert_eq!((seen.value, seen.version), (ReadValue::Absent, None));
        store.append(&mut t2, "x", 2).expect("appends");
        assert_eq!(store.commit(&mut s2, t2), Err(StoreError::Conflict));

        let mut t3 = store.begin(&mut s2).expect("begins");
        let seen = store.read(&mut t3, "x").expect("reads");
        assert_eq!((seen.value, seen.version), (list(&[1]), Some(1)));
        assert_eq!(
            store.commit(&mut s2, t3),
            Ok(None),
            "read-only takes no cid"
        );
    }

    #[test]
    fn without_first_committer_wins_both_commit() {
        let store = MemStore::with_flaw(Flaw::NoFirstCommitterWins);
        let (mut s1, mut s2) = (store.open_session(), store.open_session());
        let mut t1 = store.begin(&mut s1).expect("begins");
        let mut t2 = store.begin(&mut s2).expect("begins");
        store.write(&mut t1, "x", 1).expect("writes");
        store.write(&mut t2, "x", 2).expect("writes");
        assert_eq!(store.commit(&mut s1, t1), Ok(Some(1)));
        assert_eq!(store.commit(&mut s2, t2), Ok(Some(2)));
    }

    #[test]
    fn dirty_reads_see_pending_writes_until_they_abort() {
        let store = MemStore::with_flaw(Flaw::DirtyReads);
        let (mut s1, mut s2) = (store.open_session(), store.open_session());
        let mut t1 = store.begin(&mut s1).expect("begins");
        let mut t2 = store.begin(&mut s2).expect("begins");
        store.write(&mut t1, "x", 7).expect("writes");
        assert_eq!(
            store.read(&mut t2, "x").expect("reads").value,
            ReadValue::Register(7)
        );
        store.abort(&mut s1, t1);
        assert_eq!(
            store.read(&mut t2, "x").expect("reads").value,
            ReadValue::Absent
        );
    }

    #[test]
    fn stale_snapshots_can_miss_the_sessions_own_commit() {
        let store = MemStore::with_flaw(Flaw::StaleSnapshots);
        let mut s = store.open_session();
        let mut missed = false;
        for i in 0..6 {
            let mut t = store.begin(&mut s).expect("begins");
            let rid = store.read_timestamp(&t).expect("has rid");
            missed |= rid < s.last_cid;
            store.write(&mut t, "x", i).expect("writes");
            // Stale snapshots conflict with the newer versions they miss.
            let _ = store.commit(&mut s, t);
        }
        assert!(missed);
    }

    #[test]
    fn mixing_lists_and_registers_is_an_error() {
        let store = MemStore::new();
        let mut s = store.open_session();
        let mut t = store.begin(&mut s).expect("begins");
        store.write(&mut t, "x", 1).expect("buffered");
        store.append(&mut t, "x", 2).expect("buffered");
        assert!(matches!(
            store.read(&mut t, "x"),
            Err(StoreError::WrongType(_))
        ));
        assert!(matches!(
            store.commit(&mut s, t),
            Err(StoreError::WrongType(_))
        ));
    }
}
