//! txn as a [`TxnStore`]: verify's workloads drive a [`txn::Database`] as a black box
//! (sessions are blocking clients; a transaction owns its session's client while it
//! runs, suspended between calls, since verify calls `read` and `write` with the
//! transaction alone).
//!
//! Values are a type tag byte (register or list) and then 8-byte words.

use crate::history::ReadValue;
use crate::store::{ReadResult, StoreError, TxnStore};
use std::sync::Arc;
use std::time::Duration;
use txn::{Client, Database, FencedOutcome, Suspended, Table, TableSpec, Transaction, TxnError};

const REGISTER: u8 = 0;
const LIST: u8 = 1;

/// How long a commit fenced under its worker ([`TxnError::Fenced`]) waits for recovery
/// to decide it before it is recorded as of unknown outcome: more than recovery's
/// `txn::recovery::TAKEOVER` (5 s), so a recovery whose node died is taken over in
/// time, and less than the chaos harness's 20 s for a node to stop.
pub const FENCED_OUTCOME_PATIENCE: Duration = Duration::from_secs(10);

/// txn as a verify store: one [`Database`] table holding registers and lists.
pub struct TxnKv {
    db: Database,
    table: Arc<Table>,
    /// See [`TxnKv::with_fenced_outcome_patience`].
    fenced_patience: Duration,
    /// The first few reasons commits were recorded as of unknown outcome
    /// ([`TxnKv::indeterminate_reasons`]).
    indeterminate: std::sync::Mutex<Vec<String>>,
}

/// Reasons [`TxnKv::indeterminate_reasons`] keeps.
const REASONS_KEPT: usize = 4;

pub struct Session {
    client: Option<Client>,
    /// The CID of this session's last fenced commit that recovery rolled forward: the
    /// client does not know it as its own commit, so its next snapshots must be told
    /// to include it (a session sees its own last commit).
    after: u64,
}

pub struct Txn {
    client: Client,
    rid: u64,
    state: Option<Suspended>,
}

impl Txn {
    fn with<T>(
        &mut self,
        f: impl FnOnce(&mut Transaction<'_>) -> Result<T, TxnError>,
    ) -> Result<T, TxnError> {
        let mut txn = self
            .client
            .resume(self.state.take().expect("a live transaction"));
        let result = f(&mut txn);
        self.state = Some(txn.suspend());
        result
    }
}

impl TxnKv {
    /// The table a `TxnKv` keeps its keys in: values are a type tag and up to 32
    /// 8-byte words (registers or lists), 8 versions kept.
    pub fn table_spec(name: &str, capacity: u64) -> TableSpec {
        TableSpec {
            versions: 8,
            ..TableSpec::new(name, 1 + 8 * 32, capacity)
        }
    }

    pub fn new(db: Database, table: Arc<Table>) -> TxnKv {
        TxnKv {
            db,
            table,
            fenced_patience: FENCED_OUTCOME_PATIENCE,
            indeterminate: std::sync::Mutex::new(Vec::new()),
        }
    }

    /// Why the first few commits recorded as of unknown outcome were (the history
    /// keeps only that they were): what a test that expects none reports.
    pub fn indeterminate_reasons(&self) -> Vec<String> {
        self.indeterminate
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// How long a fenced commit waits for recovery to decide it before it is
    /// recorded as of unknown outcome ([`StoreError::Indeterminate`]):
    /// [`FENCED_OUTCOME_PATIENCE`] unless set here (tests of that record).
    pub fn with_fenced_outcome_patience(self, patience: Duration) -> TxnKv {
        TxnKv {
            fenced_patience: patience,
            ..self
        }
    }

    /// A verify key's record key: FNV-1a of the name, the same in every process.
    fn key(&self, key: &str) -> u64 {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in key.bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        // u64::MAX is reserved by the index.
        h.min(u64::MAX - 1)
    }
}

fn decode(v: Option<Vec<u8>>) -> Result<ReadValue, StoreError> {
    let Some(v) = v else {
        return Ok(ReadValue::Absent);
    };
    let words: Vec<i64> = v[1..]
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
        .collect();
    match v[0] {
        REGISTER if words.len() == 1 => Ok(ReadValue::Register(words[0])),
        LIST => Ok(ReadValue::List(words)),
        t => Err(StoreError::Other(format!("bad type tag {t}"))),
    }
}

fn encode(tag: u8, words: &[i64]) -> Vec<u8> {
    let mut v = vec![tag];
    for w in words {
        v.extend_from_slice(&w.to_le_bytes());
    }
    v
}

fn map(e: TxnError) -> StoreError {
    match e {
        TxnError::Conflict { .. } | TxnError::DuplicateKey { .. } => StoreError::Conflict,
        TxnError::SnapshotTooOld { .. } => StoreError::SnapshotTooOld,
        e => StoreError::Other(e.to_string()),
    }
}

impl TxnStore for TxnKv {
    type Session = Session;
    type Txn = Txn;

    fn open_session(&self) -> Session {
        // A worker that cannot be opened now (its process being fenced at the memory
        // servers, say) is opened by the session's first begin instead, which reports
        // the failure as that transaction's. A chaos node starting up amid faults
        // panicked here: "a client: Fabric(Completion { status: RetryExceeded, … })".
        let client = match self.db.client() {
            Ok(client) => Some(client),
            Err(e) => {
                tracing::warn!(error = %e, "no worker for a new session yet");
                None
            }
        };
        Session { client, after: 0 }
    }

    fn begin(&self, session: &mut Session) -> Result<Self::Txn, StoreError> {
        // None after a broken worker was dropped (below), or when none could be opened
        // with the session: the session goes on with a new one.
        let mut client = match session.client.take() {
            Some(client) => client,
            None => self
                .db
                .client()
                .map_err(|e| StoreError::Other(format!("no worker for this session: {e}")))?,
        };
        let begun = client
            .begin_after(session.after)
            .map(|t| (t.rid(), t.suspend()));
        match begun {
            Ok((rid, state)) => Ok(Txn {
                client,
                rid,
                state: Some(state),
            }),
            Err(TxnError::Broken(why)) => {
                // A broken worker (a commit it could not finish, left to recovery)
                // never begins again: dropped, its slot lapses and is recovered, and
                // the next begin opens a new one.
                drop(client);
                Err(StoreError::Other(format!("worker broken ({why})")))
            }
            Err(e) => {
                session.client = Some(client);
                Err(map(e))
            }
        }
    }

    fn read_timestamp(&self, txn: &Self::Txn) -> Option<u64> {
        Some(txn.rid)
    }

    fn read(&self, txn: &mut Self::Txn, key: &str) -> Result<ReadResult, StoreError> {
        let k = self.key(key);
        let table = &self.table;
        let (own, value, version) = txn
            .with(|t| {
                Ok((
                    t.wrote(table, k),
                    t.get(table, k)?,
                    t.get_version(table, k)?,
                ))
            })
            .map_err(map)?;
        let value = decode(value)?;
        // A register overwritten by this transaction shows its own value, no version;
        // a list shows the snapshot's version followed by its own appends.
        let version = match value {
            ReadValue::Absent => None,
            ReadValue::Register(_) if own => None,
            _ => version,
        };
        Ok(ReadResult { value, version })
    }

    fn write(&self, txn: &mut Self::Txn, key: &str, value: i64) -> Result<(), StoreError> {
        let k = self.key(key);
        let table = &self.table;
        if let ReadValue::List(_) = decode(txn.with(|t| t.get(table, k)).map_err(map)?)? {
            return Err(StoreError::WrongType(key.into()));
        }
        txn.with(|t| t.put(table, k, encode(REGISTER, &[value])))
            .map_err(map)
    }

    fn append(&self, txn: &mut Self::Txn, key: &str, element: i64) -> Result<(), StoreError> {
        let k = self.key(key);
        let table = &self.table;
        let mut list = match decode(txn.with(|t| t.get(table, k)).map_err(map)?)? {
            ReadValue::Absent => Vec::new(),
            ReadValue::List(l) => l,
            ReadValue::Register(_) => return Err(StoreError::WrongType(key.into())),
        };
        list.push(element);
        txn.with(|t| t.put(table, k, encode(LIST, &list)))
            .map_err(map)
    }

    fn commit(&self, session: &mut Session, txn: Self::Txn) -> Result<Option<u64>, StoreError> {
        let Txn {
            mut client, state, ..
        } = txn;
        let result = client.resume(state.expect("a live transaction")).commit();
        let result = match result {
            // Abandoned to recovery: what recovery made of it is known once it has
            // decided, and a decided outcome lets the checker hold the commit to
            // "nothing acknowledged is lost" (or an abort to "no effect") rather than
            // leave it unknown.
            Err(TxnError::Fenced { cid }) => match txn::runtime::block_on(
                client.worker().fenced_outcome(cid, self.fenced_patience),
            ) {
                Ok(FencedOutcome::Committed { cid }) => {
                    session.after = session.after.max(cid);
                    Ok(Some(cid))
                }
                Ok(FencedOutcome::RolledBack) => Err(StoreError::Other(format!(
                    "commit {cid} rolled back: its worker was fenced before its log record \
                     was complete"
                ))),
                Err(e) => Err(StoreError::Indeterminate(format!(
                    "commit {cid} abandoned to recovery (its worker was fenced), outcome not \
                     learnt: {e}"
                ))),
            },
            Ok(cid) => Ok(cid),
            Err(TxnError::Conflict { .. } | TxnError::DuplicateKey { .. }) => {
                Err(StoreError::Conflict)
            }
            Err(TxnError::SnapshotTooOld { .. }) => Err(StoreError::SnapshotTooOld),
            // Failing after its locks, a commit may have installed.
            Err(e) => Err(StoreError::Indeterminate(e.to_string())),
        };
        if let Err(StoreError::Indeterminate(why)) = &result {
            let mut kept = self.indeterminate.lock().unwrap_or_else(|e| e.into_inner());
            if kept.len() < REASONS_KEPT {
                // Said where it happens too: a process killed later keeps no report.
                tracing::warn!(why, "a commit of unknown outcome");
                kept.push(why.clone());
            }
        }
        session.client = Some(client);
        result
    }

    fn abort(&self, session: &mut Session, txn: Self::Txn) {
        let Txn {
            mut client, state, ..
        } = txn;
        client.resume(state.expect("a live transaction")).abort();
        session.client = Some(client);
    }
}
