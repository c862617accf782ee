//! The snapshot scan against transactional reads on an embedded database (sim
//! backend): a scan at RID returns exactly what a transaction at RID reads key by key,
//! also while transfers commit concurrently with torn operations injected, and a
//! version no longer kept ends in `SnapshotTooOld` (or a retry at a newer snapshot).

use fabric::sim::{Faults, SimConfig};
use shuffle::ops::scan::{
    self, OnTooOld, ScanConfig, ScanError, ScanStats, Scanner, scan_blocking, scan_with_retry,
};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;
use txn::runtime::block_on;
use txn::{Database, Options, Snapshot, Table, TableSpec, TxnError, Worker};

fn db(sim: SimConfig, servers: usize) -> Database {
    Database::embedded(Options {
        sim,
        servers,
        server_bytes: 32 << 20,
        ..Options::default()
    })
    .unwrap()
}

fn table(db: &Database, name: &str, versions: u32, capacity: u64, partitions: u32) -> Arc<Table> {
    db.create_table(TableSpec {
        versions,
        partitions,
        ..TableSpec::new(name, 24, capacity)
    })
    .unwrap()
}

/// Small stripes and few slots, so a small table takes many doorbells, several in
/// flight, and stripes of one doorbell span partitions' tails.
fn small_stripes(table: &Table) -> ScanConfig {
    ScanConfig {
        stripe_bytes: 5 * table.shape.block_bytes(),
        stripes_per_doorbell: 3,
        doorbells_in_flight: 2,
    }
}

fn val(n: i64) -> Vec<u8> {
    n.to_le_bytes().to_vec()
}

fn num(v: &[u8]) -> i64 {
    i64::from_le_bytes(v[..8].try_into().unwrap())
}

/// What a transaction at `rid` reads for each of `keys` (present ones only).
fn per_key(
    worker: &Worker,
    table: &Arc<Table>,
    rid: u64,
    keys: &[u64],
) -> Result<BTreeMap<u64, Vec<u8>>, TxnError> {
    block_on(async {
        let mut t = worker.begin_at(rid).await?;
        assert_eq!(t.rid(), rid);
        let values = t.get_many(table, keys).await?;
        t.abort();
        Ok(keys
            .iter()
            .zip(values)
            .filter_map(|(k, v)| v.map(|v| (*k, v)))
            .collect())
    })
}

fn scan_map(
    snapshot: &Snapshot<'_>,
    table: &Table,
    scanner: Scanner,
    config: &ScanConfig,
) -> Result<(BTreeMap<u64, Vec<u8>>, ScanStats), ScanError> {
    let mut rows = BTreeMap::new();
    let stats = scan_blocking(snapshot, table, scanner, config, |r| {
        assert_eq!(
            r.partition,
            table.partition_of(r.key),
            "row from the wrong partition"
        );
        let twice = rows.insert(r.key, r.value.to_vec());
        assert!(twice.is_none(), "key {} scanned twice", r.key);
        Ok(())
    })?;
    Ok((rows, stats))
}

/// Inserts, updates and deletes in several commits; snapshots between them must each
/// scan to what a transaction at their RID reads, and a distributed scan over several
/// scanners covers each row exactly once.
#[test]
fn scan_equals_transactional_reads_at_every_snapshot() {
    let db = db(SimConfig::default(), 2);
    let t = table(&db, "scanned", 4, 600, 3);
    let worker = db.worker().unwrap();
    let mut client = db.client().unwrap();
    let universe: Vec<u64> = (0..400).collect();
    let mut rids = Vec::new();
    let snapshot_rid = |w: &Worker| block_on(w.snapshot()).unwrap().rid();
    rids.push(snapshot_rid(&worker));
    client
        .run(0, |x| {
            for k in 0..300 {
                x.insert(&t, k, val(k as i64))?;
            }
            Ok(())
        })
        .unwrap();
    rids.push(snapshot_rid(&worker));
    client
        .run(0, |x| {
            for k in (0..300).step_by(3) {
                x.put(&t, k, val(1000 + k as i64))?;
            }
            for k in (1..300).step_by(7) {
                x.delete(&t, k)?;
            }
            Ok(())
        })
        .unwrap();
    rids.push(snapshot_rid(&worker));
    client
        .run(0, |x| {
            for k in 300..400 {
                x.insert(&t, k, val(k as i64))?;
            }
            // Deleted, then inserted again.
            x.put(&t, 8, val(-8))?;
            for k in (0..300).step_by(6) {
                x.put(&t, k, val(2000 + k as i64))?;
            }
            Ok(())
        })
        .unwrap();
    rids.push(snapshot_rid(&worker));
    let config = small_stripes(&t);
    let mut previous: Option<BTreeMap<u64, Vec<u8>>> = None;
    for &rid in &rids {
        let snapshot = block_on(worker.snapshot_at(rid)).unwrap();
        let (rows, stats) = scan_map(&snapshot, &t, Scanner::ALONE, &config).unwrap();
        let want = per_key(&worker, &t, rid, &universe).unwrap();
        assert_eq!(rows, want, "scan at RID {rid}");
        assert_eq!(stats.rows, want.len() as u64);
        assert!(
            previous.as_ref() != Some(&rows),
            "every snapshot differs from the one before"
        );
        previous = Some(rows.clone());
        // Split among 2 nodes × 3 threads: together exactly the single scan.
        let mut union = BTreeMap::new();
        let mut total = ScanStats::default();
        for node in 0..2 {
            for thread in 0..3 {
                let scanner = Scanner::new(node, 2, thread, 3).unwrap();
                let (part, stats) = scan_map(&snapshot, &t, scanner, &config).unwrap();
                for (k, v) in part {
                    assert!(
                        union.insert(k, v).is_none(),
                        "key {k} scanned by two scanners"
                    );
                }
                total += stats;
            }
        }
        assert_eq!(union, rows);
        assert_eq!(total.rows, rows.len() as u64);
        assert_eq!(total.blocks, stats.blocks, "every used block decoded once");
    }
    // The latest snapshot shows the last writes.
    let last = scan::collect(
        &block_on(worker.snapshot()).unwrap(),
        &t,
        &ScanConfig::default(),
    )
    .unwrap();
    let last: BTreeMap<u64, i64> = last.into_iter().map(|(k, v)| (k, num(&v))).collect();
    assert_eq!(last[&6], 2006);
    assert_eq!(last[&3], 1003);
    assert_eq!(last[&8], -8);
    assert!(!last.contains_key(&1));
    // 43 deleted; 8 and the seven multiples of 6 among them (36, 78, …) written again.
    assert_eq!(last.len(), 400 - 43 + 1 + 7);
}

/// A block whose kept versions are all newer than the snapshot: the scan fails with
/// `SnapshotTooOld` naming table, key and RID (as a transaction's read does), and with
/// retries it succeeds at a newer snapshot.
#[test]
fn version_no_longer_kept_is_an_error_or_a_retry() {
    let db = db(SimConfig::default(), 1);
    // Two versions: an inserted block keeps its value and the "absent before" mark.
    let t = table(&db, "short", 2, 64, 1);
    let worker = db.worker().unwrap();
    let mut client = db.client().unwrap();
    client
        .run(0, |x| {
            for k in 0..10 {
                x.insert(&t, k, val(k as i64))?;
            }
            Ok(())
        })
        .unwrap();
    let old = block_on(worker.snapshot()).unwrap();
    for round in 1..=2 {
        client.run(0, |x| x.put(&t, 4, val(100 * round))).unwrap();
    }
    match scan::collect(&old, &t, &ScanConfig::default()) {
        Err(ScanError::SnapshotTooOld { table, key, rid }) => {
            assert_eq!((table.as_str(), key, rid), ("short", 4, old.rid()));
        }
        other => panic!("expected SnapshotTooOld, got {other:?}"),
    }
    assert!(matches!(
        per_key(&worker, &t, old.rid(), &[4]),
        Err(TxnError::SnapshotTooOld { key: 4, .. })
    ));
    // Other keys at the old snapshot are still readable one by one.
    assert_eq!(per_key(&worker, &t, old.rid(), &[3]).unwrap()[&3], val(3));
    assert!(matches!(
        scan_with_retry(&worker, OnTooOld::Fail, |_fresh| scan::collect(
            &old,
            &t,
            &ScanConfig::default()
        )),
        Err(ScanError::SnapshotTooOld { .. })
    ));
    // Retrying: the first attempt's snapshot is made too old by two updates landing
    // right after it; the second attempt sees them.
    let mut attempts = 0;
    let (rows, rid) = scan_with_retry(&worker, OnTooOld::Retry { attempts: 3 }, |s| {
        attempts += 1;
        if attempts == 1 {
            for round in 3..=4 {
                client.run(0, |x| x.put(&t, 7, val(100 * round))).unwrap();
            }
        }
        scan::collect(s, &t, &ScanConfig::default())
    })
    .unwrap();
    assert_eq!(attempts, 2);
    let rows: BTreeMap<u64, Vec<u8>> = rows.into_iter().collect();
    assert_eq!(
        rows,
        per_key(&worker, &t, rid, &(0..10).collect::<Vec<_>>()).unwrap()
    );
    assert_eq!(rows[&7], val(400));
    assert_eq!(rows[&4], val(200));
}

const ACCOUNTS: u64 = 64;
const TOTAL: i64 = 64_000;

/// Transfers commit on two threads, with READs and WRITEs torn by injected pauses,
/// while a third thread scans: every scan sums to the total and equals a
/// transaction's key-by-key reads at its RID. A scan that trusted a torn or locked
/// block, or picked the wrong version, would miss or double money.
#[test]
fn scans_are_consistent_while_transfers_commit() {
    let db = db(
        SimConfig {
            faults: Faults {
                tear_probability: 0.3,
                tear_pause: Duration::from_micros(20),
                ..Faults::default()
            },
            seed: 11,
            ..SimConfig::default()
        },
        2,
    );
    let t = table(&db, "accounts", 6, 2 * ACCOUNTS, 2);
    let keys: Vec<u64> = (0..ACCOUNTS).collect();
    let setup = {
        let mut c = db.client().unwrap();
        c.run(0, |x| {
            for &k in &keys {
                x.insert(&t, k, val(TOTAL / ACCOUNTS as i64))?;
            }
            Ok(())
        })
        .unwrap()
        .1
        .unwrap()
    };
    let stop = AtomicBool::new(false);
    let moved_so_far = AtomicU64::new(0);
    let (scans, rereads, moved) = std::thread::scope(|s| {
        let movers: Vec<_> = (0..2u64)
            .map(|w| {
                let (db, t, stop, moved_so_far) = (db.clone(), t.clone(), &stop, &moved_so_far);
                s.spawn(move || {
                    let mut c = db.client().unwrap();
                    let mut moved = 0u64;
                    let mut i = w;
                    while !stop.load(Ordering::Relaxed) {
                        i += 2;
                        let from = (i * 7) % ACCOUNTS;
                        let to = (from + 1 + i % (ACCOUNTS - 1)) % ACCOUNTS;
                        let r = c.begin_after(setup).and_then(|mut x| {
                            let a = num(&x.get(&t, from)?.unwrap());
                            let b = num(&x.get(&t, to)?.unwrap());
                            x.put(&t, from, val(a - 1))?;
                            x.put(&t, to, val(b + 1))?;
                            x.commit()
                        });
                        match r {
                            Ok(_) => {
                                moved += 1;
                                moved_so_far.fetch_add(1, Ordering::Relaxed);
                            }
                            Err(TxnError::Conflict { .. } | TxnError::SnapshotTooOld { .. }) => {}
                            Err(e) => panic!("{e}"),
                        }
                    }
                    moved
                })
            })
            .collect();
        // Stops the movers however this thread leaves (a failed assertion too), or
        // the scope would wait for them forever.
        let _stop = StopOnDrop(&stop);
        let worker = db.worker().unwrap();
        let config = small_stripes(&t);
        let mut scans = 0;
        let mut rereads = 0;
        let mut compared = 0;
        // Enough scans compared, and enough transfers under them.
        while compared < 12 || moved_so_far.load(Ordering::Relaxed) < 400 {
            let (rows, stats, rid) =
                match scan_with_retry(&worker, OnTooOld::Retry { attempts: 20 }, |snap| {
                    let (rows, stats) = scan_map(snap, &t, Scanner::ALONE, &config)?;
                    Ok((rows, stats, snap.rid()))
                }) {
                    Ok((v, _)) => v,
                    Err(e) => panic!("{e}"),
                };
            scans += 1;
            rereads += stats.rereads;
            assert_eq!(rows.len() as u64, ACCOUNTS, "every account, once");
            assert_eq!(
                rows.values().map(|v| num(v)).sum::<i64>(),
                TOTAL,
                "scan at RID {rid}"
            );
            match per_key(&worker, &t, rid, &keys) {
                Ok(want) => {
                    assert_eq!(rows, want, "scan vs reads at RID {rid}");
                    compared += 1;
                }
                // The versions moved on between the scan and the reads.
                Err(TxnError::SnapshotTooOld { .. }) => {}
                Err(e) => panic!("{e}"),
            }
        }
        drop(_stop);
        let moved: u64 = movers.into_iter().map(|m| m.join().unwrap()).sum();
        (scans, rereads, moved)
    });
    assert!(moved > 0, "transfers committed during the scans");
    eprintln!("{scans} scans, {rereads} blocks re-read, {moved} transfers");
    let final_rows = scan::collect(
        &block_on(db.worker().unwrap().snapshot()).unwrap(),
        &t,
        &ScanConfig::default(),
    )
    .unwrap();
    assert_eq!(final_rows.iter().map(|(_, v)| num(v)).sum::<i64>(), TOTAL);
}

struct StopOnDrop<'a>(&'a AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// A consumer that stops the scan gets its error back, and the worker scans on.
#[test]
fn a_consumer_error_stops_the_scan_and_the_worker_goes_on() {
    let db = db(SimConfig::default(), 1);
    let t = table(&db, "stopped", 2, 400, 1);
    let mut client = db.client().unwrap();
    client
        .run(0, |x| {
            for k in 0..300 {
                x.insert(&t, k, val(k as i64))?;
            }
            Ok(())
        })
        .unwrap();
    let worker = db.worker().unwrap();
    let snapshot = block_on(worker.snapshot()).unwrap();
    let config = small_stripes(&t);
    let mut seen = 0;
    let stopped = scan_blocking(&snapshot, &t, Scanner::ALONE, &config, |_| {
        seen += 1;
        if seen == 17 {
            return Err(ScanError::Consumer("enough".into()));
        }
        Ok(())
    });
    assert!(matches!(stopped, Err(ScanError::Consumer(ref why)) if why == "enough"));
    assert_eq!(seen, 17);
    assert_eq!(scan::collect(&snapshot, &t, &config).unwrap().len(), 300);
    let bad = ScanConfig {
        stripes_per_doorbell: 0,
        ..config
    };
    assert!(matches!(
        scan::collect(&snapshot, &t, &bad),
        Err(ScanError::Invalid(_))
    ));
    let nobody = Scanner { index: 3, count: 3 };
    assert!(matches!(
        scan_blocking(&snapshot, &t, nobody, &config, |_| Ok(())),
        Err(ScanError::Invalid(_))
    ));
}
