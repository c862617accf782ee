//! The two-phase-commit baseline of the TPC-W harness (`tpcw::twopc`) with its servers
//! as `namdb twopc …` processes: transactions across them (and verify's workloads,
//! checked for snapshot isolation), a killed resource manager, malformed bytes, and
//! how the server processes end.

use std::io::{BufRead, BufReader, Read, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tpcw::schema::Rel;
use tpcw::system::AbortReason;
use tpcw::system::{Engine, Error, Session, System};
use tpcw::twopc::client::{Client, Suspended, block_on};
use tpcw::twopc::{Launch, TwoPc, resource_manager_of};
use verify::history::ReadValue;
use verify::report::{Model, Verdict};
use verify::store::{ReadResult, StoreError, TxnStore};
use verify::workload::{self, Bank, Checked, ListAppend, RunConfig, Schedule, Workload};

fn namdb() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_namdb"))
}

fn cluster(resource_managers: usize) -> TwoPc {
    TwoPc::start(Launch::Processes { exe: namdb() }, resource_managers)
        .expect("the 2PC processes start")
}

fn balance(row: Option<Vec<u8>>) -> i64 {
    i64::from_le_bytes(
        row.expect("every account exists")
            .try_into()
            .expect("8 bytes"),
    )
}

fn put_all(client: &Client, rows: &[(u64, i64)]) -> Result<Option<u64>, Error> {
    block_on(async {
        let mut txn = client.begin(0).await?;
        for &(key, value) in rows {
            txn.put(Rel::Customer, key, value.to_le_bytes().to_vec())
                .await?;
        }
        Ok(client.commit(txn).await?.cid)
    })
}

#[test]
fn transfers_across_resource_manager_processes_conserve_the_total() {
    const ACCOUNTS: u64 = 9;
    const INITIAL: i64 = 50;
    let system = cluster(3);
    assert_eq!((system.name(), system.backend().as_str()), ("2pc", "tcp"));
    let accounts: Vec<u64> = (1..=ACCOUNTS).collect();
    let initial: Vec<(u64, i64)> = accounts.iter().map(|&a| (a, INITIAL)).collect();
    put_all(&system.engine(0).unwrap(), &initial).unwrap();
    let committed = AtomicU64::new(0);
    std::thread::scope(|s| {
        for thread in 0..3u64 {
            let (system, accounts, committed) = (&system, &accounts, &committed);
            s.spawn(move || {
                let client = system.engine(thread as usize).unwrap();
                let mut last = 0;
                for i in 0..30u64 {
                    let from = (thread + i * 2) % ACCOUNTS + 1;
                    let to = (thread * 4 + i * 7 + 1) % ACCOUNTS + 1;
                    let outcome = block_on(async {
                        let mut txn = client.begin(last).await?;
                        let all = txn.get_many(Rel::Customer, accounts).await?;
                        let all: Vec<i64> = all.into_iter().map(balance).collect();
                        assert_eq!(all.iter().sum::<i64>(), INITIAL * ACCOUNTS as i64);
                        if from != to {
                            let (a, b) = (all[from as usize - 1] - 3, all[to as usize - 1] + 3);
                            txn.put(Rel::Customer, from, a.to_le_bytes().to_vec())
                                .await?;
                            txn.put(Rel::Customer, to, b.to_le_bytes().to_vec()).await?;
                        }
                        client.commit(txn).await
                    });
                    match outcome {
                        Ok(done) => {
                            last = done.cid.unwrap_or(last);
                            committed.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(Error::Aborted { .. }) => {}
                        Err(e) => panic!("a transfer failed: {e}"),
                    }
                }
            });
        }
    });
    assert!(committed.load(Ordering::Relaxed) >= 30);
    let rows = block_on(async {
        let client = system.engine(0)?;
        let mut txn = client.begin(0).await?;
        txn.get_many(Rel::Customer, &accounts).await
    });
    let total: i64 = rows.unwrap().into_iter().map(balance).sum();
    assert_eq!(total, INITIAL * ACCOUNTS as i64);

    // Dropping the system ends its processes: nothing listens any more.
    let addrs: Vec<SocketAddr> = std::iter::once(system.transaction_manager())
        .chain(system.resource_managers().iter().copied())
        .collect();
    drop(system);
    for addr in addrs {
        assert!(TcpStream::connect(addr).is_err(), "{addr} still accepts");
    }
}

#[test]
fn a_killed_resource_manager_process_is_named_in_the_error() {
    let system = cluster(3);
    let client = system.client().unwrap();
    let key = (1..)
        .find(|&k| resource_manager_of(Rel::Customer, k, 3) == 2)
        .unwrap();
    put_all(&client, &[(key, 1)]).unwrap();
    let dead = system.resource_managers()[2].to_string();
    system.kill_resource_manager(2).unwrap();
    let expect_named = |outcome: Result<(), Error>| match outcome {
        Err(Error::System(message)) => {
            assert!(
                message.contains("resource manager 2") && message.contains(&dead),
                "{message}"
            );
            message
        }
        other => panic!("expected a system error, got {other:?}"),
    };
    let read = block_on(async {
        let mut txn = client.begin(0).await?;
        txn.get(Rel::Customer, key).await.map(|_| ())
    });
    expect_named(read);
    expect_named(put_all(&client, &[(key, 2)]).map(|_| ()));
    // A new client learns how the process ended.
    let message = expect_named(system.client().map(|_| ()));
    assert!(message.contains("signal: 9"), "{message}");
}

#[test]
fn malformed_bytes_do_not_crash_a_resource_manager_process() {
    let system = cluster(1);
    let rm = system.resource_managers()[0];
    for garbage in [
        &[0xff, 0xff, 0xff, 0xff][..],
        &[4, 0, 0, 0, 9, 9, 9, 9][..],
        &b"GET / HTTP/1.1\r\n\r\n"[..],
    ] {
        let mut stream = TcpStream::connect(rm).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        stream.write_all(garbage).unwrap();
        // An error frame, then the server hangs up.
        let mut answer = Vec::new();
        stream.read_to_end(&mut answer).unwrap();
        let text = String::from_utf8_lossy(&answer);
        assert!(text.contains("closing the connection"), "{text:?}");
    }
    let client = system.client().expect("the process still serves");
    assert!(put_all(&client, &[(1, 1)]).unwrap().is_some());
}

/// A `namdb twopc …` child and its listening address.
fn spawn_server(args: &[&str]) -> (Child, String) {
    let mut child = Command::new(namdb())
        .arg("twopc")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = line
        .strip_prefix("listening on ")
        .unwrap_or_else(|| panic!("not a listening line: {line:?}"))
        .trim()
        .to_string();
    (child, addr)
}

#[test]
fn server_processes_exit_cleanly_on_sigterm_and_on_stdin_close() {
    let (mut rm, rm_addr) = spawn_server(&["resource-manager", "--listen", "127.0.0.1:0"]);
    let (mut tm, _) = spawn_server(&[
        "transaction-manager",
        "--listen",
        "127.0.0.1:0",
        "--resource-managers",
        &rm_addr,
        "--exit-on-stdin-close",
    ]);
    drop(tm.stdin.take());
    assert!(tm.wait().unwrap().success());
    let pid = rustix::process::Pid::from_child(&rm);
    rustix::process::kill_process(pid, rustix::process::Signal::TERM).unwrap();
    assert!(rm.wait().unwrap().success());

    // A transaction manager whose resource manager is not there says which.
    let output = Command::new(namdb())
        .args(["twopc", "transaction-manager", "--listen", "127.0.0.1:0"])
        .args(["--resource-managers", &rm_addr])
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains(&format!("resource manager 0 at {rm_addr}")),
        "{stderr}"
    );
}

/// The 2PC system as a verify store: every verify key is a row of relation `rel`
/// (one per run, since runs reuse key names), its value a type tag (register or list)
/// and 8-byte words.
struct TwoPcKv<'a> {
    system: &'a TwoPc,
    rel: Rel,
}

const REGISTER: u8 = 0;
const LIST: u8 = 1;

struct KvSession {
    client: Option<Client>,
    last_cid: u64,
}

struct KvTxn {
    client: Client,
    txn: Option<Suspended>,
    rid: Option<u64>,
    /// Keys this transaction wrote.
    wrote: std::collections::HashSet<u64>,
}

impl KvTxn {
    fn with<T>(
        &mut self,
        f: impl AsyncFnOnce(&mut tpcw::twopc::client::Txn<'_>) -> Result<T, Error>,
    ) -> Result<T, StoreError> {
        let suspended = self
            .txn
            .take()
            .ok_or_else(|| StoreError::Other("the transaction is gone".into()))?;
        let mut txn = self.client.resume(suspended);
        let outcome = block_on(f(&mut txn));
        self.txn = Some(txn.suspend());
        outcome.map_err(store_error)
    }
}

/// FNV-1a of the name: a verify key's row key.
fn kv_key(key: &str) -> u64 {
    key.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

fn kv_decode(row: Option<Vec<u8>>) -> Result<ReadValue, StoreError> {
    let Some(row) = row else {
        return Ok(ReadValue::Absent);
    };
    let (tag, words) = row
        .split_first()
        .ok_or_else(|| StoreError::Other("an empty row".into()))?;
    let words: Vec<i64> = words
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect();
    match *tag {
        REGISTER if words.len() == 1 => Ok(ReadValue::Register(words[0])),
        LIST => Ok(ReadValue::List(words)),
        t => Err(StoreError::Other(format!("bad type tag {t}"))),
    }
}

fn kv_encode(tag: u8, words: &[i64]) -> Vec<u8> {
    std::iter::once(tag)
        .chain(words.iter().flat_map(|w| w.to_le_bytes()))
        .collect()
}

fn store_error(e: Error) -> StoreError {
    match e {
        Error::Aborted {
            reason: AbortReason::SnapshotTooOld,
            ..
        } => StoreError::SnapshotTooOld,
        Error::Aborted { .. } => StoreError::Conflict,
        e => StoreError::Other(e.to_string()),
    }
}

impl TxnStore for TwoPcKv<'_> {
    type Session = KvSession;
    type Txn = KvTxn;

    fn open_session(&self) -> KvSession {
        KvSession {
            client: Some(self.system.client().expect("a client connects")),
            last_cid: 0,
        }
    }

    fn begin(&self, session: &mut KvSession) -> Result<KvTxn, StoreError> {
        let client = session
            .client
            .take()
            .ok_or_else(|| StoreError::Other("the session is in a transaction".into()))?;
        let begun =
            block_on(client.begin(session.last_cid)).map(|t| (t.read_timestamp(), t.suspend()));
        match begun {
            Ok((rid, txn)) => Ok(KvTxn {
                client,
                txn: Some(txn),
                rid,
                wrote: Default::default(),
            }),
            Err(e) => {
                session.client = Some(client);
                Err(store_error(e))
            }
        }
    }

    fn read_timestamp(&self, txn: &KvTxn) -> Option<u64> {
        txn.rid
    }

    fn read(&self, txn: &mut KvTxn, key: &str) -> Result<ReadResult, StoreError> {
        let (rel, k) = (self.rel, kv_key(key));
        let (row, version) =
            txn.with(async |t| Ok((t.get(rel, k).await?, t.version(rel, k).await?)))?;
        let value = kv_decode(row)?;
        // A register this transaction overwrote shows its own value, which has no
        // version; a list shows the snapshot's version and then its own appends.
        let version = match value {
            ReadValue::Absent => None,
            ReadValue::Register(_) if txn.wrote.contains(&k) => None,
            _ => version,
        };
        Ok(ReadResult { value, version })
    }

    fn write(&self, txn: &mut KvTxn, key: &str, value: i64) -> Result<(), StoreError> {
        let (rel, k) = (self.rel, kv_key(key));
        if let ReadValue::List(_) = kv_decode(txn.with(async |t| t.get(rel, k).await)?)? {
            return Err(StoreError::WrongType(key.into()));
        }
        txn.wrote.insert(k);
        txn.with(async |t| t.put(rel, k, kv_encode(REGISTER, &[value])).await)
    }

    fn append(&self, txn: &mut KvTxn, key: &str, element: i64) -> Result<(), StoreError> {
        let (rel, k) = (self.rel, kv_key(key));
        let mut list = match kv_decode(txn.with(async |t| t.get(rel, k).await)?)? {
            ReadValue::Absent => Vec::new(),
            ReadValue::List(list) => list,
            ReadValue::Register(_) => return Err(StoreError::WrongType(key.into())),
        };
        list.push(element);
        txn.wrote.insert(k);
        txn.with(async |t| t.put(rel, k, kv_encode(LIST, &list)).await)
    }

    fn commit(&self, session: &mut KvSession, txn: KvTxn) -> Result<Option<u64>, StoreError> {
        let KvTxn { client, txn, .. } = txn;
        let outcome = match txn {
            Some(txn) => block_on(client.commit(client.resume(txn))),
            None => Err(Error::System("the transaction is gone".into())),
        };
        session.client = Some(client);
        match outcome {
            Ok(done) => {
                session.last_cid = done.cid.unwrap_or(session.last_cid);
                Ok(done.cid)
            }
            Err(e @ Error::Aborted { .. }) => Err(store_error(e)),
            // A failure after the write set left: it may have been installed.
            Err(e) => Err(StoreError::Indeterminate(e.to_string())),
        }
    }

    fn abort(&self, session: &mut KvSession, txn: KvTxn) {
        session.client = Some(txn.client);
    }
}

fn check(workload: &dyn Workload, store: &TwoPcKv, schedule: Schedule, seed: u64) -> Checked {
    let config = RunConfig {
        sessions: 4,
        txns: 1500,
        seed,
        schedule,
    };
    let checked = workload::run_checked(store, workload, &config, Model::SnapshotIsolation)
        .expect("the workload runs and its history reads back");
    assert!(
        checked.report.whitebox.is_ok(),
        "white-box skipped: {:?}",
        checked.report.whitebox
    );
    assert_eq!(
        checked.report.verdict(),
        Verdict::Valid,
        "\n{}",
        checked.report
    );
    assert!(checked.run.committed > config.txns / 4, "{:?}", checked.run);
    assert_eq!(checked.run.unknown, 0, "{:?}", checked.run);
    checked
}

#[test]
fn verify_workloads_over_resource_manager_processes_are_snapshot_isolated() {
    let system = cluster(3);
    let store = |rel| TwoPcKv {
        system: &system,
        rel,
    };
    check(
        &ListAppend::default(),
        &store(Rel::Item),
        Schedule::Threads,
        31,
    );
    check(
        &ListAppend::default(),
        &store(Rel::Author),
        Schedule::Interleaved,
        32,
    );
    let bank = Bank::default();
    let checked = check(&bank, &store(Rel::Country), Schedule::Interleaved, 33);
    let mut findings = verify::anomaly::Findings::default();
    bank.check(&checked.index, &mut findings);
    assert!(findings.is_empty(), "{findings:?}");
}

#[test]
fn namdb_tpcw_runs_the_2pc_system_and_its_checks_pass() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("run.json");
    let output = Command::new(namdb())
        .args(["tpcw", "--system", "2pc", "--resource-managers", "2"])
        .args(["--items", "1000", "--ebs", "1", "--clients", "2"])
        .args(["--duration", "1", "--warmup", "0", "--sample-every", "7"])
        .arg("--json")
        .arg(&json)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let run = &report["runs"][0];
    assert_eq!(run["system"], "2pc", "{report}");
    assert_eq!(run["backend"], "tcp", "{report}");
    assert!(run["committed"].as_u64().unwrap() > 0, "{report}");
    assert_eq!(run["checks"]["stock_conserved"], true, "{report}");
    assert_eq!(run["checks"]["orders_present"], true, "{report}");
    assert_eq!(run["checks"]["history_verdict"], "valid", "{report}");
}
