//! Sessions of a chaos node: run a workload's transactions until told to stop, writing
//! each one to the node's event file before its commit (`pending`) and after it
//! (`done`), and the workloads they run.
//!
//! Unlike [`crate::workload::run`], a session runs for as long as the node lives, and
//! transaction ids and sessions must be unique across every process of a run, so both
//! carry the node incarnation's number.

use super::events::{EventWriter, NodeEvent};
use crate::history::{Op, ReadValue, Status, Txn};
use crate::store::{StoreError, TxnStore};
use crate::workload::{Action, TxnProgram, Workload};
use rand::Rng;
use rand::rngs::StdRng;
use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Transaction ids and session numbers of one incarnation: its number in the top bits,
/// so no two processes of a run ever give out the same one.
pub struct Ids {
    incarnation: u64,
    next: AtomicU64,
}

impl Ids {
    pub const MAX_INCARNATION: u64 = (1 << 23) - 1;

    pub fn new(incarnation: u64) -> Result<Ids, String> {
        if incarnation > Self::MAX_INCARNATION {
            return Err(format!(
                "incarnation {incarnation} is above {}",
                Self::MAX_INCARNATION
            ));
        }
        Ok(Ids {
            incarnation,
            next: AtomicU64::new(1),
        })
    }

    pub fn txn(&self) -> u64 {
        (self.incarnation << 40) | self.next.fetch_add(1, Ordering::Relaxed)
    }

    pub fn session(&self, s: u64) -> u64 {
        (self.incarnation << 16) | (s & 0xffff)
    }

    /// The incarnation a transaction id belongs to.
    pub fn incarnation_of(txn: u64) -> u64 {
        txn >> 40
    }
}

/// Unix nanoseconds that never go backwards within the process.
pub struct Clock {
    epoch_ns: u64,
    started: Instant,
}

impl Default for Clock {
    /// A clock on the process's one base: every clock of a process reads the same
    /// time. Each used to take its own (the wall clock, then the monotonic one), and a
    /// thread preempted between the two put its sessions microseconds off the others':
    /// a session's begin then seemed to follow another's commit it had in fact
    /// preceded, a false real-time anomaly (seen in CI on a loaded machine).
    fn default() -> Self {
        static BASE: std::sync::OnceLock<(u64, Instant)> = std::sync::OnceLock::new();
        let &(epoch_ns, started) =
            BASE.get_or_init(|| (unix_ns(SystemTime::now()), Instant::now()));
        Clock { epoch_ns, started }
    }
}

impl Clock {
    pub fn now_ns(&self) -> u64 {
        self.epoch_ns + self.started.elapsed().as_nanos() as u64
    }
}

pub fn unix_ns(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// Outcomes of a session's transactions.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SessionSummary {
    pub committed: u64,
    pub aborted: u64,
    pub unknown: u64,
}

/// Runs session number `session` (`handle`, opened on `store`) of `workload` until
/// `stop` is set.
#[allow(clippy::too_many_arguments)]
pub fn run_session<S: TxnStore>(
    store: &S,
    mut handle: S::Session,
    workload: &dyn Workload,
    ids: &Ids,
    session: u64,
    rng: &mut StdRng,
    out: &EventWriter,
    stop: &AtomicBool,
) -> io::Result<SessionSummary> {
    let clock = Clock::default();
    let session = ids.session(session);
    let mut summary = SessionSummary::default();
    while !stop.load(Ordering::Relaxed) {
        let txn = run_txn(
            store,
            &mut handle,
            workload.next_txn(rng),
            ids.txn(),
            session,
            &clock,
            out,
        )?;
        match txn.status {
            Status::Committed => summary.committed += 1,
            Status::Aborted => summary.aborted += 1,
            Status::Unknown => summary.unknown += 1,
        }
        // A failure other than a conflict (the store refusing work, e.g. while a dead
        // node's slot stalls the oracle) would otherwise spin through transactions.
        if txn.status != Status::Committed && txn.error.as_deref() == Some("other") {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    Ok(summary)
}

/// Runs one transaction of `program` to its end and writes it out: `pending` before
/// the commit, `done` after. Returns it as written last.
pub fn run_txn<S: TxnStore>(
    store: &S,
    session: &mut S::Session,
    mut program: Box<dyn TxnProgram>,
    id: u64,
    session_id: u64,
    clock: &Clock,
    out: &EventWriter,
) -> io::Result<Txn> {
    let mut record = Txn::new(id, session_id, Status::Unknown);
    record.begin_ns = Some(clock.now_ns());
    let finish = |mut record: Txn, status: Status, cid: Option<u64>, error: Option<&str>| {
        record.status = status;
        record.cid = cid;
        record.error = error.map(str::to_string);
        record.end_ns = Some(clock.now_ns());
        out.write(&NodeEvent::Done {
            txn: record.clone(),
        })?;
        Ok(record)
    };
    let mut txn = match store.begin(session) {
        Ok(txn) => txn,
        Err(e) => return finish(record, Status::Aborted, None, Some(e.kind())),
    };
    record.rid = store.read_timestamp(&txn);
    let mut last_read: Option<ReadValue> = None;
    loop {
        let action = program.next(last_read.as_ref());
        last_read = None;
        let done = match action {
            Action::Read(key) => store.read(&mut txn, &key).map(|result| {
                record.ops.push(Op::Read {
                    key,
                    value: result.value.clone(),
                    version: result.version,
                });
                last_read = Some(result.value);
            }),
            Action::Write(key, value) => store
                .write(&mut txn, &key, value)
                .map(|()| record.ops.push(Op::Write { key, value })),
            Action::Append(key, element) => store
                .append(&mut txn, &key, element)
                .map(|()| record.ops.push(Op::Append { key, element })),
            Action::Commit => {
                out.write(&NodeEvent::Pending {
                    txn: record.clone(),
                })?;
                return match store.commit(session, txn) {
                    Ok(cid) => finish(record, Status::Committed, cid, None),
                    Err(e @ StoreError::Indeterminate(_)) => {
                        finish(record, Status::Unknown, None, Some(e.kind()))
                    }
                    Err(e) => finish(record, Status::Aborted, None, Some(e.kind())),
                };
            }
            Action::Abort => {
                store.abort(session, txn);
                return finish(record, Status::Aborted, None, Some("client_abort"));
            }
        };
        if let Err(e) = done {
            store.abort(session, txn);
            return finish(record, Status::Aborted, None, Some(e.kind()));
        }
    }
}

/// List-append for many processes at once: keys are shared by every node, and an
/// element is appended only after a read in the same transaction shows the list
/// shorter than [`Self::LIMIT`], so snapshot isolation itself (first committer wins) keeps
/// every list within it (a list value has a fixed capacity in the store). A key
/// seen full moves this process's window of active keys past it. Elements carry the
/// incarnation in their top bits, so they are unique across the run.
pub struct SharedListAppend {
    pub active_keys: u64,
    pub max_ops: usize,
    pub read_fraction: f64,
    /// Transactions that end in a voluntary abort.
    pub abort_fraction: f64,
    state: Arc<KeyWindow>,
}

/// What the transactions of one process share: where its window of keys starts, and
/// the next element.
struct KeyWindow {
    first_open: AtomicU64,
    next_element: AtomicI64,
    element_base: i64,
    limit: usize,
}

impl SharedListAppend {
    /// The longest a list gets: a store value holds 32 words, and a transaction appends
    /// at most `max_ops` elements after its last read of a key.
    pub const LIMIT: usize = 24;
    /// Keys a process appends to at once, from the first it has not seen full.
    pub const ACTIVE_KEYS: u64 = 16;

    /// Starts at key number `first_key` (keys below it are taken to be full).
    pub fn new(incarnation: u64, first_key: u64) -> SharedListAppend {
        SharedListAppend {
            active_keys: Self::ACTIVE_KEYS,
            max_ops: 4,
            read_fraction: 0.4,
            abort_fraction: 0.03,
            state: Arc::new(KeyWindow {
                first_open: AtomicU64::new(first_key),
                next_element: AtomicI64::new(1),
                element_base: (incarnation as i64) << 32,
                limit: Self::LIMIT,
            }),
        }
    }

    pub fn key(n: u64) -> String {
        format!("l{n}")
    }

    /// The number of a key of this workload.
    pub fn key_number(key: &str) -> Option<u64> {
        key.strip_prefix('l')?.parse().ok()
    }
}

impl KeyWindow {
    fn element(&self) -> i64 {
        self.element_base | self.next_element.fetch_add(1, Ordering::Relaxed)
    }
}

impl Workload for SharedListAppend {
    fn next_txn(&self, rng: &mut StdRng) -> Box<dyn TxnProgram> {
        let first = self.state.first_open.load(Ordering::Relaxed);
        let ops = (0..rng.random_range(1..=self.max_ops.max(1)))
            .map(|_| {
                let key = first + rng.random_range(0..self.active_keys.max(1));
                (key, !rng.random_bool(self.read_fraction))
            })
            .collect();
        Box::new(SharedAppendTxn {
            window: self.state.clone(),
            ops,
            next: 0,
            reading: None,
            abort: rng.random_bool(self.abort_fraction),
        })
    }
}

struct SharedAppendTxn {
    window: Arc<KeyWindow>,
    /// (key number, whether to append after reading it).
    ops: Vec<(u64, bool)>,
    next: usize,
    /// The op whose read was issued last.
    reading: Option<(u64, bool)>,
    abort: bool,
}

impl TxnProgram for SharedAppendTxn {
    fn next(&mut self, last_read: Option<&ReadValue>) -> Action {
        if let Some((key, append)) = self.reading.take() {
            let len = match last_read {
                Some(ReadValue::List(list)) => list.len(),
                _ => 0,
            };
            if len >= self.window.limit {
                self.window.first_open.fetch_max(key + 1, Ordering::Relaxed);
            } else if append {
                return Action::Append(SharedListAppend::key(key), self.window.element());
            }
        }
        match self.ops.get(self.next) {
            Some(&(key, append)) => {
                self.next += 1;
                self.reading = Some((key, append));
                Action::Read(SharedListAppend::key(key))
            }
            None if self.abort => Action::Abort,
            None => Action::Commit,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chaos::checks;
    use crate::chaos::events::{merge, read_events};
    use crate::index::HistoryIndex;
    use crate::mem_store::MemStore;
    use rand::SeedableRng;

    #[test]
    fn sessions_run_until_stopped_and_their_history_checks_out() {
        let dir = tempfile::tempdir().expect("a directory");
        let path = dir.path().join("node.jsonl");
        let out = EventWriter::create(&path).expect("created");
        let store = MemStore::new();
        let ids = Ids::new(5).expect("ids");
        // A second incarnation starting past the first's keys, as a restarted node would.
        let workload = SharedListAppend::new(5, 3);
        let stop = AtomicBool::new(false);
        let summaries: Vec<SessionSummary> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..3)
                .map(|s| {
                    let (store, workload, ids, out, stop) = (&store, &workload, &ids, &out, &stop);
                    scope.spawn(move || {
                        let mut rng = StdRng::seed_from_u64(s);
                        let handle = store.open_session();
                        run_session(store, handle, workload, ids, s, &mut rng, out, stop)
                    })
                })
                .collect();
            std::thread::sleep(Duration::from_millis(100));
            stop.store(true, Ordering::Relaxed);
            handles
                .into_iter()
                .map(|h| h.join().expect("no panic").expect("written"))
                .collect()
        });
        let committed: u64 = summaries.iter().map(|s| s.committed).sum();
        assert!(committed > 10, "{summaries:?}");

        let events = read_events(&path).expect("reads");
        let pending = events
            .iter()
            .filter(|e| matches!(e, NodeEvent::Pending { .. }))
            .count();
        let txns = merge(events).expect("merges");
        assert!(pending as u64 >= committed);
        assert_eq!(
            txns.iter()
                .filter(|t| t.status == Status::Committed)
                .count() as u64,
            committed
        );
        let mut sessions = std::collections::BTreeSet::new();
        for t in &txns {
            assert_eq!(Ids::incarnation_of(t.id), 5);
            sessions.insert(t.session);
            for op in &t.ops {
                if let Op::Read {
                    key,
                    value: ReadValue::List(list),
                    ..
                } = op
                {
                    assert!(list.len() <= SharedListAppend::LIMIT + 4, "{list:?}");
                    assert!(SharedListAppend::key_number(key).expect("a list key") >= 3);
                }
                if let Op::Append { element, .. } = op {
                    assert_eq!(element >> 32, 5);
                }
            }
        }
        assert_eq!(sessions.len(), 3);
        let index = HistoryIndex::from_txns(txns.clone()).expect("indexes");
        let si = checks::snapshot_isolation(&txns, &index);
        assert!(si.passed, "{si:?}");
    }

    #[test]
    fn every_clock_of_a_process_reads_the_same_time() {
        let a = Clock::default();
        std::thread::sleep(Duration::from_millis(2));
        let b = std::thread::spawn(Clock::default).join().expect("a clock");
        assert_eq!((a.epoch_ns, a.started), (b.epoch_ns, b.started));
        let (x, y) = (a.now_ns(), b.now_ns());
        assert!(x <= y, "{x} then {y}");
    }

    #[test]
    fn full_keys_move_the_window_on() {
        let workload = SharedListAppend::new(1, 0);
        let mut program = SharedAppendTxn {
            window: workload.state.clone(),
            ops: vec![(2, true), (3, true)],
            next: 0,
            reading: None,
            abort: false,
        };
        assert_eq!(program.next(None), Action::Read("l2".into()));
        let full = ReadValue::List((0..SharedListAppend::LIMIT as i64).collect());
        assert_eq!(program.next(Some(&full)), Action::Read("l3".into()));
        assert_eq!(workload.state.first_open.load(Ordering::Relaxed), 3);
        assert_eq!(
            program.next(Some(&ReadValue::List(vec![7]))),
            Action::Append("l3".into(), (1 << 32) | 1)
        );
        assert_eq!(program.next(None), Action::Commit);
        assert!(Ids::new(Ids::MAX_INCARNATION + 1).is_err());
    }
}
