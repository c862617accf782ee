//! The RSI commit protocol on the embedded sim cluster.

use fabric::sim::{Faults, SimConfig};
use std::sync::Arc;
use std::time::Duration;
use txn::index::IndexShape;
use txn::{Client, Database, Options, Table, TableSpec, TxnError};

fn db(sim: SimConfig) -> (Database, Arc<Table>) {
    // Ticks always due: single-threaded tests tick idle clients so others' read
    // timestamps move.
    let db = Database::embedded(Options {
        sim,
        oracle: timestamp::OracleConfig {
            tick_interval: Duration::from_micros(20),
            ..timestamp::OracleConfig::default()
        },
        wait_visible: false,
        ..Options::default()
    })
    .unwrap();
    let t = db
        .create_table(TableSpec {
            name: "t".into(),
            versions: 4,
            value_cap: 64,
            capacity: 1024,
            partitions: 0,
            placement: txn::Placement::RoundRobin,
            index: IndexShape {
                buckets: 64,
                slots: 8,
            },
        })
        .unwrap();
    (db, t)
}

fn num(v: &Option<Vec<u8>>) -> u64 {
    u64::from_le_bytes(v.as_deref().unwrap()[..8].try_into().unwrap())
}

fn val(n: u64) -> Vec<u8> {
    n.to_le_bytes().to_vec()
}

#[test]
fn single_thread_semantics() {
    let (db, t) = db(SimConfig::default());
    assert!(matches!(db.table("nope"), Err(TxnError::NotFound(_))));
    let mut c = db.client().unwrap();
    let mut x = c.begin().unwrap();
    assert_eq!(x.get(&t, 1).unwrap(), None);
    x.put(&t, 1, b"one".to_vec()).unwrap();
    x.insert(&t, 2, b"two".to_vec()).unwrap();
    assert_eq!(x.get(&t, 1).unwrap(), Some(b"one".to_vec()), "own write");
    assert!(matches!(
        x.insert(&t, 2, b"again".to_vec()),
        Err(TxnError::DuplicateKey { key: 2, .. })
    ));
    let cid1 = x.commit().unwrap().expect("a writer gets a CID");

    let mut x = c.begin().unwrap();
    assert!(x.rid() >= cid1, "the session sees its own commit");
    assert_eq!(x.get(&t, 1).unwrap(), Some(b"one".to_vec()));
    assert_eq!(x.get_version(&t, 2).unwrap(), Some(cid1));
    assert!(matches!(
        x.insert(&t, 1, b"dup".to_vec()),
        Err(TxnError::DuplicateKey { key: 1, .. })
    ));
    x.put(&t, 1, b"uno".to_vec()).unwrap();
    let cid2 = x.commit().unwrap().unwrap();
    assert!(cid2 > cid1);

    // Aborted and failed transactions leave nothing behind.
    let mut x = c.begin().unwrap();
    x.put(&t, 1, b"never".to_vec()).unwrap();
    x.abort();
    let mut x = c.begin().unwrap();
    assert_eq!(x.get(&t, 1).unwrap(), Some(b"uno".to_vec()));
    assert!(matches!(
        x.put(&t, 3, vec![0; 65]),
        Err(TxnError::Layout(_))
    ));
    assert_eq!(x.commit().unwrap(), None, "read-only takes no CID");

    // Old snapshots keep reading old versions; too old is an error.
    let mut old = db.client().unwrap();
    let mut snap = old.begin().unwrap();
    let rid = snap.rid();
    for i in 0..4 {
        let mut x = c.begin().unwrap();
        x.put(&t, 1, val(i)).unwrap();
        x.commit().unwrap();
    }
    match snap.get(&t, 1) {
        Err(TxnError::SnapshotTooOld { rid: r, .. }) => assert_eq!(r, rid),
        other => panic!("expected SnapshotTooOld, got {other:?}"),
    }
    assert_eq!(snap.get(&t, 2).unwrap(), Some(b"two".to_vec()));
}

#[test]
fn same_key_exactly_one_commits() {
    let (db, t) = db(SimConfig::default());
    let mut a = db.client().unwrap();
    let mut b = db.client().unwrap();
    let cid = {
        let mut x = a.begin().unwrap();
        x.put(&t, 7, val(0)).unwrap();
        x.commit().unwrap().unwrap()
    };
    b.tick().unwrap();
    let mut ta = a.begin().unwrap();
    let mut tb = b.begin_after(cid).unwrap();
    let va = num(&ta.get(&t, 7).unwrap());
    let vb = num(&tb.get(&t, 7).unwrap());
    ta.put(&t, 7, val(va + 1)).unwrap();
    tb.put(&t, 7, val(vb + 1)).unwrap();
    let cid = ta.commit().unwrap().unwrap();
    assert!(matches!(
        tb.commit(),
        Err(TxnError::Conflict { key: 7, .. })
    ));
    a.tick().unwrap();
    let mut x = b.begin_after(cid).unwrap();
    assert_eq!(num(&x.get(&t, 7).unwrap()), 1, "no lost update");
}

/// A writer that reads nothing before another transaction commits the key still
/// loses: the header it reads has a CID above its snapshot, and only the first
/// committer wins. (Its lock CAS alone would succeed: it expects the header it read.)
#[test]
fn first_committer_wins_for_blind_writes() {
    let (db, t) = db(SimConfig::default());
    let mut a = db.client().unwrap();
    let mut b = db.client().unwrap();
    let cid0 = {
        let mut x = a.begin().unwrap();
        x.put(&t, 1, val(0)).unwrap();
        x.commit().unwrap().unwrap()
    };
    let mut tb = b.begin_after(cid0).unwrap();
    let cid = {
        let mut x = a.begin().unwrap();
        x.put(&t, 1, val(10)).unwrap();
        x.commit().unwrap().unwrap()
    };
    assert!(tb.rid() < cid);
    tb.put(&t, 1, val(20)).unwrap();
    match tb.commit() {
        Err(TxnError::Conflict { key: 1, why, .. }) => assert!(why.contains("first committer")),
        other => panic!("expected a first-committer-wins conflict, got {other:?}"),
    }
    a.tick().unwrap();
    let mut x = b.begin_after(cid).unwrap();
    assert_eq!(num(&x.get(&t, 1).unwrap()), 10);
}

/// A commit that locks one record and fails on another releases the first lock.
#[test]
fn abort_releases_locks() {
    let (db, t) = db(SimConfig::default());
    let mut a = db.client().unwrap();
    let mut b = db.client().unwrap();
    let cid0 = {
        let mut x = a.begin().unwrap();
        x.put(&t, 1, val(1)).unwrap();
        x.put(&t, 2, val(2)).unwrap();
        x.commit().unwrap().unwrap()
    };
    let mut tb = b.begin_after(cid0).unwrap();
    tb.get(&t, 1).unwrap();
    tb.get(&t, 2).unwrap();
    {
        let mut x = a.begin().unwrap();
        x.put(&t, 2, val(20)).unwrap();
        x.commit().unwrap();
    }
    tb.put(&t, 1, val(100)).unwrap();
    tb.put(&t, 2, val(200)).unwrap();
    assert!(matches!(
        tb.commit(),
        Err(TxnError::Conflict { key: 2, .. })
    ));
    assert_eq!(b.stats().aborted, 1);
    let before = a.stats().locked_retries;
    b.tick().unwrap();
    let mut x = a.begin().unwrap();
    assert_eq!(num(&x.get(&t, 1).unwrap()), 1, "key 1 unlocked, unchanged");
    x.put(&t, 1, val(11)).unwrap();
    x.commit().unwrap();
    assert_eq!(a.stats().locked_retries, before);

    // A failed insert leaves the key insertable.
    b.tick().unwrap();
    let mut ta = a.begin().unwrap();
    let mut tb = b.begin().unwrap();
    ta.insert(&t, 50, val(5)).unwrap();
    ta.put(&t, 1, val(12)).unwrap();
    tb.put(&t, 1, val(13)).unwrap();
    let cid = tb.commit().unwrap().unwrap();
    assert!(matches!(
        ta.commit(),
        Err(TxnError::Conflict { key: 1, .. })
    ));
    b.tick().unwrap();
    let mut x = a.begin_after(cid).unwrap();
    assert_eq!(x.get(&t, 50).unwrap(), None);
    x.insert(&t, 50, val(6)).unwrap();
    let cid = x.commit().unwrap().unwrap();
    a.tick().unwrap();
    let mut x = b.begin_after(cid).unwrap();
    assert_eq!(num(&x.get(&t, 50).unwrap()), 6);
}

/// Concurrent inserts of one key: exactly one wins.
#[test]
fn concurrent_insert_is_duplicate() {
    let (db, t) = db(SimConfig::default());
    let mut a = db.client().unwrap();
    let mut b = db.client().unwrap();
    let mut ta = a.begin().unwrap();
    let mut tb = b.begin().unwrap();
    ta.insert(&t, 9, val(1)).unwrap();
    tb.insert(&t, 9, val(2)).unwrap();
    ta.commit().unwrap();
    assert!(matches!(
        tb.commit(),
        Err(TxnError::DuplicateKey { key: 9, .. })
    ));
}

const ACCOUNTS: u64 = 5;
const TOTAL: u64 = 1000;

fn transfer(
    c: &mut Client,
    t: &Arc<Table>,
    after: u64,
    from: u64,
    to: u64,
) -> Result<bool, TxnError> {
    let mut x = c.begin_after(after)?;
    let a = num(&x.get(t, from)?);
    let b = num(&x.get(t, to)?);
    if a == 0 {
        return Ok(false);
    }
    x.put(t, from, val(a - 1))?;
    x.put(t, to, val(b + 1))?;
    x.commit()?;
    Ok(true)
}

/// Bank on threads with torn reads injected: every snapshot sums to the total (no
/// read skew, no torn value), and the final balances conserve money (no lost update).
/// The seqlock must have rejected torn reads for the test to count.
#[test]
fn bank_under_tear_injection() {
    let (db, t) = db(SimConfig {
        faults: Faults {
            tear_probability: 0.5,
            tear_pause: Duration::from_micros(20),
            ..Faults::default()
        },
        seed: 7,
        ..SimConfig::default()
    });
    let setup = {
        let mut c = db.client().unwrap();
        let mut x = c.begin().unwrap();
        for k in 0..ACCOUNTS {
            x.insert(&t, k, val(TOTAL / ACCOUNTS)).unwrap();
        }
        x.commit().unwrap().unwrap()
    };
    let stop = std::sync::atomic::AtomicBool::new(false);
    let (moved, audits, torn) = std::thread::scope(|s| {
        let workers: Vec<_> = (0..2u64)
            .map(|w| {
                let (db, t) = (db.clone(), t.clone());
                s.spawn(move || {
                    let mut c = db.client().unwrap();
                    let mut moved = 0u64;
                    for i in 0..1500u64 {
                        let from = (i * 7 + w) % ACCOUNTS;
                        let to = (from + 1 + (i + w) % (ACCOUNTS - 1)) % ACCOUNTS;
                        match transfer(&mut c, &t, setup, from, to) {
                            Ok(true) => moved += 1,
                            Ok(false) | Err(TxnError::Conflict { .. }) => {}
                            Err(e) => panic!("{e}"),
                        }
                    }
                    (moved, c.stats())
                })
            })
            .collect();
        let auditor = {
            let (db, t, stop) = (db.clone(), t.clone(), &stop);
            s.spawn(move || {
                let mut c = db.client().unwrap();
                let mut audits = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) || audits < 10 {
                    let mut x = c.begin_after(setup).unwrap();
                    let mut sum = 0;
                    for k in 0..ACCOUNTS {
                        match x.get(&t, k) {
                            Ok(v) => sum += num(&v),
                            Err(TxnError::SnapshotTooOld { .. }) => {
                                sum = TOTAL;
                                break;
                            }
                            Err(e) => panic!("{e}"),
                        }
                    }
                    assert_eq!(sum, TOTAL, "a snapshot must sum to the total");
                    x.commit().unwrap();
                    audits += 1;
                }
                (audits, c.stats())
            })
        };
        let results: Vec<_> = workers.into_iter().map(|h| h.join().unwrap()).collect();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let (audits, astats) = auditor.join().unwrap();
        let torn: u64 =
            results.iter().map(|(_, s)| s.torn_retries).sum::<u64>() + astats.torn_retries;
        (results.iter().map(|(m, _)| m).sum::<u64>(), audits, torn)
    });
    let mut c = db.client().unwrap();
    let mut x = c.begin_after(setup).unwrap();
    let sum: u64 = (0..ACCOUNTS).map(|k| num(&x.get(&t, k).unwrap())).sum();
    assert_eq!(sum, TOTAL);
    assert!(moved > 100, "transfers committed: {moved}");
    assert!(audits >= 10);
    assert!(torn > 0, "tear injection never produced a torn block read");
}
