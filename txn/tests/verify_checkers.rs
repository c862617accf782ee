//! verify's workloads run against txn through `verify::store::TxnStore`, recorded, read
//! back and checked by the white-box and Elle-style checkers, on the sim with torn
//! reads injected.
//!
//! Sessions run on threads (`Schedule::Threads`). The interleaved schedule does not
//! fit yet: a session waiting in `begin` for its own last commit needs every other
//! client to tick its oracle slot, which a client parked between steps does not do.
//!
//! A transaction here owns its session's client (verify calls `read` and `write` with
//! the transaction alone), suspended between calls.

use fabric::sim::{Faults, SimConfig};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use txn::index::IndexShape;
use txn::{Client, Database, Options, Suspended, Table, TableSpec, Transaction, TxnError};
use verify::anomaly::Findings;
use verify::history::{JsonlWriter, ReadValue};
use verify::index::load_jsonl;
use verify::recorder::Recorder;
use verify::report::{self, Model, Verdict};
use verify::store::{ReadResult, StoreError, TxnStore};
use verify::workload::{self, Bank, ListAppend, RunConfig, Schedule, Workload};

const REGISTER: u8 = 0;
const LIST: u8 = 1;

struct Store {
    db: Database,
    table: Arc<Table>,
    keys: Mutex<HashMap<String, u64>>,
}

struct Session {
    client: Option<Client>,
}

struct Txn {
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

impl Store {
    fn new(seed: u64) -> Store {
        let db = Database::embedded(Options {
            sim: SimConfig {
                faults: Faults {
                    tear_probability: 0.2,
                    tear_pause: Duration::from_micros(5),
                    ..Faults::default()
                },
                seed,
                ..SimConfig::default()
            },
            ..Options::default()
        })
        .unwrap();
        let table = db
            .create_table(TableSpec {
                name: "kv".into(),
                versions: 8,
                value_cap: 1 + 8 * 32,
                capacity: 1 << 16,
                partitions: 0,
                placement: txn::Placement::RoundRobin,
                index: IndexShape {
                    buckets: 1 << 12,
                    slots: 16,
                },
            })
            .unwrap();
        Store {
            db,
            table,
            keys: Mutex::new(HashMap::new()),
        }
    }

    fn key(&self, key: &str) -> u64 {
        let mut keys = self.keys.lock().unwrap();
        let n = keys.len() as u64;
        *keys.entry(key.to_string()).or_insert(n)
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

impl TxnStore for Store {
    type Session = Session;
    type Txn = Txn;

    fn open_session(&self) -> Session {
        Session {
            client: Some(self.db.client().expect("a client")),
        }
    }

    fn begin(&self, session: &mut Session) -> Result<Self::Txn, StoreError> {
        let client = session
            .client
            .take()
            .ok_or_else(|| StoreError::Other("session already in a transaction".into()))?;
        let mut client = client;
        let begun = client.begin().map(|t| (t.rid(), t.suspend()));
        match begun {
            Ok((rid, state)) => Ok(Txn {
                client,
                rid,
                state: Some(state),
            }),
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
        session.client = Some(client);
        result.map_err(|e| match e {
            TxnError::Conflict { .. } | TxnError::DuplicateKey { .. } => StoreError::Conflict,
            TxnError::SnapshotTooOld { .. } => StoreError::SnapshotTooOld,
            // Failing after its locks, a commit may have installed.
            e => StoreError::Indeterminate(e.to_string()),
        })
    }

    fn abort(&self, session: &mut Session, txn: Self::Txn) {
        let Txn {
            mut client, state, ..
        } = txn;
        client.resume(state.expect("a live transaction")).abort();
        session.client = Some(client);
    }
}

fn check(
    workload: &dyn Workload,
    txns: u64,
    seed: u64,
) -> (verify::workload::RunSummary, verify::index::HistoryIndex) {
    let store = Store::new(seed);
    let recorder = Recorder::new(JsonlWriter::new(Vec::new()));
    let config = RunConfig {
        sessions: 4,
        txns,
        seed,
        schedule: Schedule::Threads,
    };
    let run = workload::run(&store, workload, &recorder, &config).expect("the workload runs");
    let jsonl = recorder.into_sink().into_inner();
    let index = load_jsonl(&jsonl[..], Findings::DEFAULT_EXAMPLES).expect("history reads back");
    let report = report::check(&index, Model::SnapshotIsolation);
    assert!(
        report.whitebox.is_ok(),
        "white-box skipped: {:?}",
        report.whitebox
    );
    assert_eq!(report.verdict(), Verdict::Valid, "\n{report}");
    assert!(
        run.committed > 0 && run.aborted > 0,
        "no contention: {run:?}"
    );
    assert_eq!(run.unknown, 0, "{run:?}");
    (run, index)
}

#[test]
fn list_append_is_snapshot_isolation() {
    let txns = std::env::var("TXN_VERIFY_TXNS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(4000);
    check(&ListAppend::default(), txns, 11);
}

#[test]
fn bank_is_snapshot_isolation_and_balanced() {
    let bank = Bank::default();
    let (_, index) = check(&bank, 4000, 12);
    let mut findings = Findings::default();
    bank.check(&index, &mut findings);
    assert!(findings.is_empty(), "{findings:?}");
}
