//! Recording a history while transactions run.
//!
//! A [`TxnRecord`] collects one transaction's operations as its client issues them; the
//! [`Recorder`] stamps it with wall-clock begin and end times and hands it to a
//! [`HistorySink`] the moment it ends, so a long run holds only its open transactions.
//! Ids are given out at begin, in begin order.

use crate::history::{JsonlWriter, Op, ReadValue, Status, Txn};
use std::io::{self, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// Where finished transactions go.
pub trait HistorySink: Send {
    fn record(&mut self, txn: &Txn) -> io::Result<()>;
}

impl<W: Write + Send> HistorySink for JsonlWriter<W> {
    fn record(&mut self, txn: &Txn) -> io::Result<()> {
        self.write(txn)
    }
}

/// Keeps the history in memory, for tests and small runs.
impl HistorySink for Vec<Txn> {
    fn record(&mut self, txn: &Txn) -> io::Result<()> {
        self.push(txn.clone());
        Ok(())
    }
}

/// Shared by every session of a run.
pub struct Recorder<S> {
    sink: Mutex<S>,
    next_id: AtomicU64,
    /// Wall-clock time at `started`, so timestamps are Unix nanoseconds that never go
    /// backwards within the run (the system clock alone may).
    epoch_ns: u64,
    started: Instant,
}

/// One transaction being recorded.
pub struct TxnRecord {
    txn: Txn,
}

impl<S: HistorySink> Recorder<S> {
    pub fn new(sink: S) -> Recorder<S> {
        let epoch_ns = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        Recorder {
            sink: Mutex::new(sink),
            next_id: AtomicU64::new(1),
            epoch_ns,
            started: Instant::now(),
        }
    }

    /// Nanoseconds since the Unix epoch, monotonic within this recorder.
    fn now_ns(&self) -> u64 {
        self.epoch_ns + self.started.elapsed().as_nanos() as u64
    }

    /// Starts recording a transaction of `session`; call before asking the store to
    /// begin, so that `begin_ns` precedes the snapshot.
    pub fn begin(&self, session: u64) -> TxnRecord {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let mut txn = Txn::new(id, session, Status::Unknown);
        txn.begin_ns = Some(self.now_ns());
        TxnRecord { txn }
    }

    pub fn committed(&self, record: TxnRecord, cid: Option<u64>) -> io::Result<()> {
        self.finish(record, Status::Committed, cid, None)
    }

    /// Records a committed transaction that ran apart from this recorder's clients
    /// and is recorded after the fact (its `record` begun then): its begin and end
    /// times are dropped, since the recording times would claim it ran later than it
    /// did, so the checkers place it by its timestamps alone.
    pub fn committed_untimed(&self, mut record: TxnRecord, cid: Option<u64>) -> io::Result<()> {
        record.txn.begin_ns = None;
        let mut txn = record.txn;
        txn.status = Status::Committed;
        txn.cid = cid;
        self.sink
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .record(&txn)
    }

    pub fn aborted(&self, record: TxnRecord, error: &str) -> io::Result<()> {
        self.finish(record, Status::Aborted, None, Some(error))
    }

    /// The commit's outcome is unknown; `cid` if the store had assigned one.
    pub fn unknown(&self, record: TxnRecord, error: &str, cid: Option<u64>) -> io::Result<()> {
        self.finish(record, Status::Unknown, cid, Some(error))
    }

    fn finish(
        &self,
        record: TxnRecord,
        status: Status,
        cid: Option<u64>,
        error: Option<&str>,
    ) -> io::Result<()> {
        let mut txn = record.txn;
        txn.status = status;
        txn.cid = cid;
        txn.error = error.map(str::to_string);
        txn.end_ns = Some(self.now_ns());
        self.sink
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .record(&txn)
    }

    pub fn into_sink(self) -> S {
        self.sink
            .into_inner()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

impl TxnRecord {
    pub fn set_read_timestamp(&mut self, rid: Option<u64>) {
        self.txn.rid = rid;
    }

    pub fn read(&mut self, key: &str, value: ReadValue, version: Option<u64>) {
        self.txn.ops.push(Op::Read {
            key: key.to_string(),
            value,
            version,
        });
    }

    pub fn write(&mut self, key: &str, value: i64) {
        self.txn.ops.push(Op::Write {
            key: key.to_string(),
            value,
        });
    }

    pub fn append(&mut self, key: &str, element: i64) {
        self.txn.ops.push(Op::Append {
            key: key.to_string(),
            element,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::history::HistoryReader;

    #[test]
    fn transactions_stream_out_as_they_end() {
        let recorder = Recorder::new(JsonlWriter::new(Vec::new()));
        let mut first = recorder.begin(1);
        let mut second = recorder.begin(2);
        first.set_read_timestamp(Some(4));
        first.read("x", ReadValue::List(vec![1]), Some(3));
        first.append("x", 2);
        second.write("y", 9);
        recorder.aborted(second, "conflict").expect("recorded");
        recorder.committed(first, Some(5)).expect("recorded");
        let bytes = recorder.into_sink().into_inner();
        let txns: Vec<Txn> = HistoryReader::new(&bytes[..])
            .collect::<Result<_, _>>()
            .expect("parses");
        assert_eq!(txns.len(), 2);
        let (aborted, committed) = (&txns[0], &txns[1]);
        assert_eq!(
            (aborted.id, aborted.status, aborted.error.as_deref()),
            (2, Status::Aborted, Some("conflict"))
        );
        assert_eq!(
            (committed.id, committed.rid, committed.cid),
            (1, Some(4), Some(5))
        );
        assert_eq!(committed.ops.len(), 2);
        let (begin, end) = (
            committed.begin_ns.expect("begin"),
            committed.end_ns.expect("end"),
        );
        assert!(begin <= aborted.begin_ns.expect("begin") && aborted.end_ns <= Some(end));
    }

    #[test]
    fn a_transaction_recorded_after_the_fact_carries_no_times() {
        let recorder = Recorder::new(Vec::new());
        let mut late = recorder.begin(3);
        late.set_read_timestamp(Some(7));
        late.write("x", 1);
        recorder.committed_untimed(late, Some(8)).expect("recorded");
        let txns = recorder.into_sink();
        let t = &txns[0];
        assert_eq!(
            (t.status, t.rid, t.cid),
            (Status::Committed, Some(7), Some(8))
        );
        assert_eq!((t.begin_ns, t.end_ns), (None, None));
        assert_eq!(t.ops.len(), 1);
    }
}
