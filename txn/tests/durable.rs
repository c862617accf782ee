//! Restart recovery on durable memory servers, in process ([`common::sim`]: a restart
//! keeps only what was persisted). The processes-and-disk version of this runs in
//! namdb's tests.

mod common;

use common::sim::{Cluster, Disk, Link, Server, accounts};
use fabric::{CompletionQueue, Device, QueuePair};
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use txn::{Database, DeviceFactory, MemoryServerLink, Options, ServerRegions, Table};

fn val(n: i64) -> Vec<u8> {
    n.to_le_bytes().to_vec()
}

fn num(v: Option<Vec<u8>>) -> i64 {
    i64::from_le_bytes(v.expect("present")[..8].try_into().unwrap())
}

#[test]
fn acknowledged_commits_survive_restarts() {
    let mut cluster = Cluster::new(2);
    let (before, last_cid) = {
        let db = cluster.open();
        assert!(db.is_durable());
        assert!(db.restart_report().is_none());
        let t = accounts(&db);
        let mut c = db.client().unwrap();
        c.run(0, |x| {
            for k in 0..16 {
                x.insert(&t, k, val(100))?;
            }
            Ok(())
        })
        .unwrap();
        for i in 0..200u64 {
            let (from, to) = (i % 16, (i * 7 + 3) % 16);
            if from == to {
                continue;
            }
            c.run(5, |x| {
                let a = num(x.get(&t, from)?);
                let b = num(x.get(&t, to)?);
                x.put(&t, from, val(a - 1))?;
                x.put(&t, to, val(b + 1))?;
                if i % 10 == 0 {
                    x.insert(&t, 1000 + i, val(i as i64))?;
                }
                if i % 50 == 49 {
                    x.delete(&t, 1000 + i - 49)?;
                }
                Ok(())
            })
            .unwrap();
        }
        let mut x = c.begin().unwrap();
        let before: Vec<Option<Vec<u8>>> = (0..16)
            .chain(1000..1200)
            .map(|k| x.get(&t, k).unwrap())
            .collect();
        drop(x);
        (before, c.last_cid())
    };
    for restarted in [vec![1], vec![0], vec![0, 1]] {
        cluster.restart(&restarted);
        let db = cluster.open();
        let report = db.restart_report().expect("a restart recovery ran");
        assert_eq!(report.restarted, restarted);
        if restarted.contains(&0) {
            assert!(report.oracle_from.unwrap() > last_cid, "{report:?}");
        }
        let t = db.table("accounts").unwrap();
        let mut c = db.client().unwrap();
        let mut x = c.begin().unwrap();
        let after: Vec<Option<Vec<u8>>> = (0..16)
            .chain(1000..1200)
            .map(|k| x.get(&t, k).unwrap())
            .collect();
        assert_eq!(after, before, "after restarting {restarted:?}");
        drop(x);
        // The cluster goes on: new commits, above every earlier CID.
        c.run(3, |x| {
            let a = num(x.get(&t, 0)?);
            x.put(&t, 0, val(a))
        })
        .unwrap();
        assert!(c.last_cid() > last_cid);
        assert!(db.locked_records().unwrap().is_empty());
    }
}

#[test]
fn a_crash_at_every_commit_step_then_a_restart_of_every_server_is_atomic() {
    for (i, point) in txn::crash::POINTS.iter().enumerate() {
        let mut cluster = Cluster::new(2);
        {
            let db = cluster.open();
            let t = accounts(&db);
            let mut c = db.client().unwrap();
            c.run(0, |x| {
                for k in 0..8 {
                    x.insert(&t, k, val(100))?;
                }
                Ok(())
            })
            .unwrap();
            let (db2, t2) = (db.clone(), t.clone());
            std::thread::spawn(move || {
                let mut client = db2.client().unwrap();
                txn::crash::panic_at_on_this_thread(point).unwrap();
                let died = std::panic::catch_unwind(AssertUnwindSafe(|| {
                    let mut x = client.begin().unwrap();
                    let a = num(x.get(&t2, 1).unwrap());
                    let b = num(x.get(&t2, 2).unwrap());
                    x.put(&t2, 1, val(a - 10)).unwrap();
                    x.put(&t2, 2, val(b + 10)).unwrap();
                    x.insert(&t2, 100, val(7)).unwrap();
                    x.commit()
                }));
                assert!(died.is_err(), "the crash point {point} did not fire");
                std::mem::forget(client);
            })
            .join()
            .unwrap();
            // The whole cluster goes down with the dead commit in flight.
            std::mem::forget(c);
            std::mem::forget(db);
        }
        cluster.restart(&[0, 1]);
        let db = cluster.open();
        let report = db.restart_report().expect("a restart recovery ran");
        let t = db.table("accounts").unwrap();
        let mut c = db.client().unwrap();
        let mut x = c.begin().unwrap();
        let a = num(x.get(&t, 1).unwrap());
        let b = num(x.get(&t, 2).unwrap());
        let inserted = x.get(&t, 100).unwrap();
        drop(x);
        let committed = i >= 3; // after-log and later
        if committed {
            assert_eq!(
                (a, b, inserted),
                (90, 110, Some(val(7))),
                "{point}: {report:?}"
            );
        } else {
            assert_eq!((a, b, inserted), (100, 100, None), "{point}: {report:?}");
        }
        assert!(db.locked_records().unwrap().is_empty(), "{point}");
        // Every record is writable, and key 100 insertable if absent.
        c.run(3, |x| {
            let a = num(x.get(&t, 1)?);
            x.put(&t, 1, val(a + 1))?;
            if x.get(&t, 100)?.is_none() {
                x.insert(&t, 100, val(8))?;
            }
            Ok(())
        })
        .unwrap();
    }
}

/// A commit whose log record cannot be made durable is committed (the record is
/// complete in memory) but holds its locks: its worker stops, lets its lease lapse,
/// and another worker's fence finishes the commit.
#[test]
fn a_worker_whose_commit_cannot_persist_stops_and_recovery_finishes_the_commit() {
    let cluster = Cluster::new(2);
    let db = cluster.open();
    let t = accounts(&db);
    let mut other = db.client().unwrap();
    other
        .run(0, |x| {
            x.insert(&t, 1, val(100))?;
            x.insert(&t, 2, val(100))
        })
        .unwrap();
    // The broken worker lives on its own thread and ticks all along, as a compute
    // node's worker loop does: those ticks must neither renew its lease nor skip its
    // timestamps, or its locks would stay forever.
    let (broke_tx, broke_rx) = std::sync::mpsc::channel();
    let stop = Arc::new(AtomicBool::new(false));
    let ticker = {
        let (db, t, disks, stop) = (db.clone(), t.clone(), cluster.disks.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut broken = db.client().unwrap();
            for disk in &disks {
                disk.failing.store(true, Ordering::SeqCst);
            }
            let mut x = broken.begin().unwrap();
            x.put(&t, 1, val(90)).unwrap();
            x.put(&t, 2, val(110)).unwrap();
            let err = x.commit().unwrap_err();
            assert!(
                matches!(err, txn::TxnError::Persist { .. }),
                "the commit fails on the persist: {err}"
            );
            for disk in &disks {
                disk.failing.store(false, Ordering::SeqCst);
            }
            assert!(matches!(broken.begin(), Err(txn::TxnError::Broken(_))));
            broke_tx.send(()).unwrap();
            while !stop.load(Ordering::SeqCst) {
                broken.tick().unwrap();
                std::thread::sleep(Duration::from_millis(1));
            }
        })
    };
    broke_rx.recv().unwrap();
    assert!(!db.locked_records().unwrap().is_empty(), "the locks stay");
    // The other worker commits, so the broken slot's unused timestamps stall the
    // prefix and its lease is checked.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let mut key = 1000;
    while !db.locked_records().unwrap().is_empty() {
        // 400 rounds of at least 2 ms each outlast the 80 ms lease many times over.
        assert!(
            std::time::Instant::now() < deadline && key < 1400,
            "the broken worker's commit was never recovered"
        );
        key += 1;
        other.run(3, |x| x.insert(&t, key, val(1))).unwrap();
        other.tick().unwrap();
        std::thread::sleep(Duration::from_millis(2));
    }
    stop.store(true, Ordering::SeqCst);
    ticker.join().unwrap();
    assert_eq!(other.stats().recoveries, 1);
    let mut x = other.begin().unwrap();
    assert_eq!(
        (num(x.get(&t, 1).unwrap()), num(x.get(&t, 2).unwrap())),
        (90, 110)
    );
    drop(x);
    other
        .run(3, |x| {
            let a = num(x.get(&t, 1)?);
            x.put(&t, 1, val(a + 1))
        })
        .unwrap();
}

/// A cluster of two servers with the accounts table and one account at 100 on
/// server 1: its key, and the keys of server 0 from 1000 on (for another worker's
/// inserts).
fn an_account_on_server_1() -> (
    Cluster,
    Database,
    Arc<Table>,
    u64,
    impl Iterator<Item = u64>,
) {
    let cluster = Cluster::new(2);
    let db = cluster.open();
    let t = accounts(&db);
    let on =
        |t: &Table, key: u64, server: usize| t.partitions[t.partition_of(key)].server == server;
    let key = (1..).find(|&k| on(&t, k, 1)).unwrap();
    db.client()
        .unwrap()
        .run(0, |x| x.insert(&t, key, val(100)))
        .unwrap();
    let table = t.clone();
    let server_0_keys = (1000..).filter(move |&k| on(&table, k, 0));
    (cluster, db, t, key, server_0_keys)
}

/// A commit waiting on a slow disk far longer than the lease keeps its slot: another
/// worker, committing and ticking meanwhile, must not fence it (which would abandon
/// the commit, its outcome left to recovery).
#[test]
fn a_commit_waiting_on_a_slow_disk_keeps_its_lease() {
    // The slow commit updates a record of server 1, whose disk is slow; the other
    // worker's records and every commit record are on server 0, whose disk is fast.
    let (cluster, db, t, slow_key, mut fast_keys) = an_account_on_server_1();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let slow = {
        let (db, t) = (db.clone(), t.clone());
        std::thread::spawn(move || {
            let mut c = db.client().unwrap();
            ready_tx.send(()).unwrap();
            go_rx.recv().unwrap();
            let mut x = c.begin().unwrap();
            x.put(&t, slow_key, val(90)).unwrap();
            x.commit()
        })
    };
    ready_rx.recv().unwrap();
    let mut other = db.client().unwrap();
    // 400 ms per persist, five times the 80 ms lease.
    cluster.disks[1].slow_ms.store(400, Ordering::SeqCst);
    go_tx.send(()).unwrap();
    // Meanwhile the other worker keeps deciding timestamps, which the slow commit's
    // holds back, and its ticks look at the slow worker's lease.
    while !slow.is_finished() {
        other.tick().unwrap();
        let key = fast_keys.next().unwrap();
        let _ = other.run(3, |x| x.insert(&t, key, val(1)));
        std::thread::sleep(Duration::from_millis(1));
    }
    let outcome = slow.join().unwrap();
    assert!(
        matches!(outcome, Ok(Some(_))),
        "the slow commit: {outcome:?}"
    );
    assert_eq!(other.stats().recoveries, 0, "nobody fenced the slow worker");
    assert!(db.locked_records().unwrap().is_empty(), "fully installed");
}

/// Sets `key` to `value` in a transaction of its own on `worker`.
async fn put_one(worker: &txn::Worker, t: &Arc<Table>, key: u64, value: i64) -> txn::Result<()> {
    worker
        .run(0, 0, async |x: &mut txn::AsyncTransaction<'_>| {
            x.put(t, key, val(value)).await
        })
        .await
        .map(|_| ())
}

/// A thread sleeps while its commits wait for a disk (the disk's server needs the
/// CPU), but only when every coroutine it runs waits: one coroutine still working is
/// not held up by the others' sleeps.
#[test]
fn a_thread_sleeps_for_persists_only_when_all_its_coroutines_wait_for_them() {
    let (cluster, db, t, slow_key, _) = an_account_on_server_1();
    cluster.disks[1].slow_ms.store(200, Ordering::SeqCst);
    let worker = db.worker().unwrap();
    // Alone, the committing coroutine lets its thread sleep while the disk works.
    let alone = worker.run_coroutines(1, |_| Box::pin(put_one(&worker, &t, slow_key, 1)));
    alone.into_iter().next().unwrap().unwrap();
    let slept_alone = worker.stats().persist_wait_sleeps;
    assert!(slept_alone > 0, "a thread with nothing else to do sleeps");

    // Beside a coroutine that keeps working until the commit is done: no sleep.
    let done = std::cell::Cell::new(false);
    let turns = std::cell::Cell::new(0u64);
    let outcomes = worker.run_coroutines(2, |i| {
        let (worker, t, done, turns) = (&worker, &t, &done, &turns);
        Box::pin(async move {
            if i == 0 {
                let outcome = put_one(worker, t, slow_key, 2).await;
                done.set(true);
                return outcome;
            }
            while !done.get() {
                turns.set(turns.get() + 1);
                txn::runtime::yield_now().await;
            }
            Ok(())
        })
    });
    for o in outcomes {
        o.unwrap();
    }
    assert!(turns.get() > 0);
    assert_eq!(
        worker.stats().persist_wait_sleeps,
        slept_alone,
        "slept while a coroutine still worked ({} turns of it)",
        turns.get()
    );
}

/// A commit whose Persist a replicated primary refuses for now (its backup is away
/// until the primary has attached to it again) makes it again until acknowledged,
/// keeping its lease: it commits once the backup is back, and its worker goes on.
/// Before, the commit was left for recovery, its worker stopped, and its lease lapsed,
/// which fenced its whole process (every compute node, after a backup's restart).
#[test]
fn a_commit_waits_for_a_backup_away_and_keeps_its_lease() {
    let (cluster, db, t, away_key, mut fast_keys) = an_account_on_server_1();
    let mut waiting = db.client().unwrap();
    let mut other = db.client().unwrap();
    cluster.disks[1].refusing.store(true, Ordering::SeqCst);
    let committer = {
        let t = t.clone();
        std::thread::spawn(move || {
            let outcome = waiting.run(0, |x| x.put(&t, away_key, val(90)));
            (waiting, outcome)
        })
    };
    // 600 ms away, over seven times the 80 ms lease; the other worker keeps deciding
    // timestamps, which the waiting commit holds back, and ticking, which looks at
    // the waiting worker's lease. (Its own commits wait meanwhile too: each begins
    // after its last, which the waiting commit's timestamp holds back.)
    let back_at = std::time::Instant::now() + Duration::from_millis(600);
    let back = {
        let disk = cluster.disks[1].clone();
        std::thread::spawn(move || {
            std::thread::sleep(back_at - std::time::Instant::now());
            disk.refusing.store(false, Ordering::SeqCst);
        })
    };
    while !committer.is_finished() {
        other.tick().unwrap();
        let key = fast_keys.next().unwrap();
        let _ = other.run(3, |x| x.insert(&t, key, val(1)));
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(
        std::time::Instant::now() >= back_at,
        "the commit did not wait for the backup"
    );
    back.join().unwrap();
    let (mut waiting, outcome) = committer.join().unwrap();
    let ((), cid) = outcome.expect("the commit, once the backup was back");
    assert!(cid.is_some());
    // Idle since, the waiting worker may have been fenced (it does not tick), but not
    // while it waited: no recovery found its commit's locks.
    let recoveries = db.recoveries();
    assert!(
        recoveries
            .iter()
            .all(|r| r.rolled_forward == 0 && r.rolled_back == 0),
        "the waiting worker was fenced while it waited: {recoveries:?}"
    );
    assert_eq!(waiting.stats().rejoins, 0);
    assert!(db.locked_records().unwrap().is_empty(), "fully installed");
    // Its worker goes on.
    waiting
        .run(0, |x| {
            let v = num(x.get(&t, away_key)?);
            x.put(&t, away_key, val(v + 1))
        })
        .unwrap();
    let mut x = waiting.begin().unwrap();
    assert_eq!(num(x.get(&t, away_key).unwrap()), 91);
}

/// Past `persist_patience` a commit refused for now fails as any failed Persist does:
/// committed, left for recovery, its worker stopped.
#[test]
fn a_commit_refused_past_its_patience_is_left_for_recovery() {
    let cluster = Cluster::new(2);
    let db = cluster.open_with(txn::Options {
        persist_patience: Duration::from_millis(300),
        ..txn::Options::default()
    });
    let t = accounts(&db);
    let mut c = db.client().unwrap();
    c.run(0, |x| x.insert(&t, 1, val(100))).unwrap();
    for disk in &cluster.disks {
        disk.refusing.store(true, Ordering::SeqCst);
    }
    let started = std::time::Instant::now();
    let mut x = c.begin().unwrap();
    x.put(&t, 1, val(90)).unwrap();
    let err = x.commit().unwrap_err();
    assert!(
        started.elapsed() >= Duration::from_millis(300),
        "gave up before the patience: {:?}",
        started.elapsed()
    );
    match &err {
        txn::TxnError::Persist { why, .. } => {
            assert!(
                why.contains("the backup is away") && why.contains("patience"),
                "{why}"
            )
        }
        other => panic!("not a Persist error: {other}"),
    }
    assert!(matches!(c.begin(), Err(txn::TxnError::Broken(_))));
}

#[test]
fn a_cluster_mixing_durable_and_volatile_servers_is_refused() {
    let cluster = Cluster::new(1);
    struct Volatile(Arc<Server>);
    impl MemoryServerLink for Volatile {
        fn connect(
            &self,
            local: &Arc<dyn Device>,
            cq: &Arc<dyn CompletionQueue>,
            send_queue: u32,
        ) -> txn::Result<Arc<dyn QueuePair>> {
            Link(self.0.clone()).connect(local, cq, send_queue)
        }
    }
    let other = Server::start(&cluster.net, &Arc::new(Disk::default()));
    let net = cluster.net.clone();
    let devices: DeviceFactory = Arc::new(move || Ok(net.add_node() as Arc<dyn Device>));
    let links: Vec<(Arc<dyn MemoryServerLink>, ServerRegions)> = vec![
        (
            Arc::new(Link(cluster.servers[0].clone())),
            cluster.servers[0].server_regions(),
        ),
        (Arc::new(Volatile(other.clone())), other.server_regions()),
    ];
    let err = Database::open(links, devices, Options::default())
        .err()
        .expect("refused");
    assert!(
        err.to_string()
            .contains("1 of 2 memory servers are durable"),
        "{err}"
    );
}

/// Runs `shape` on a thread of its own, dying halfway through installing the commit:
/// the first half of its writes is installed (visible, unlocked) but not persisted,
/// the rest still locked. Returns the dead commit's slot and CID.
fn die_mid_install(
    db: &Database,
    t: &Arc<Table>,
    shape: fn(&mut txn::Transaction<'_>, &Arc<Table>),
) -> (u32, u64) {
    let (db2, t2) = (db.clone(), t.clone());
    std::thread::spawn(move || {
        let mut client = db2.client().unwrap();
        txn::crash::panic_at_on_this_thread("mid-install").unwrap();
        let died = std::panic::catch_unwind(AssertUnwindSafe(|| {
            let mut x = client.begin().unwrap();
            shape(&mut x, &t2);
            x.commit()
        }));
        assert!(died.is_err(), "the crash point did not fire");
        std::mem::forget(client);
    })
    .join()
    .unwrap();
    dead_record(db)
}

/// The slot and CID of the log record that inserts key 100 (the dead commit's).
fn dead_record(db: &Database) -> (u32, u64) {
    (0..4)
        .find_map(|slot| {
            txn::recovery::read_log(db, slot)
                .unwrap()
                .into_values()
                .find(|r| r.entries.iter().any(|e| e.key == 100))
                .map(|r| (slot, r.cid))
        })
        .expect("the dead commit's log record")
}

/// New workers claim slots and commit until slot `slot`'s ring no longer holds `cid`.
fn reuse_ring(db: &Database, t: &Arc<Table>, slot: u32, cid: u64) {
    let mut workers = Vec::new();
    let mut key = 5000;
    while txn::recovery::read_log(db, slot)
        .unwrap()
        .contains_key(&cid)
    {
        assert!(workers.len() < 16, "slot {slot} was never reused");
        let mut c = db.client().unwrap();
        key += 1;
        c.run(3, |x| x.insert(t, key, val(1))).unwrap();
        workers.push(c);
    }
    std::mem::forget(workers);
}

fn values(db: &Database, keys: &[u64]) -> Vec<(u64, Option<i64>)> {
    let t = db.table("accounts").unwrap();
    let mut c = db.client().unwrap();
    let mut x = c.begin().unwrap();
    keys.iter()
        .map(|&k| (k, x.get(&t, k).unwrap().map(|v| num(Some(v)))))
        .collect()
}

/// A node dies halfway through installing a commit; another node's recovery finishes
/// it, and the slot's next holder then reuses the log ring, so the record is gone. The
/// half installed before the crash must be durable by then: a restart of every server
/// afterwards keeps the whole commit.
#[test]
fn a_commit_recovered_mid_install_is_durable_before_its_log_record_is_reused() {
    type Shape = fn(&mut txn::Transaction<'_>, &Arc<Table>);
    let transfer: Shape = |x, t| {
        x.put(t, 1, val(90)).unwrap();
        x.put(t, 2, val(110)).unwrap();
        x.insert(t, 100, val(7)).unwrap();
    };
    // Inserts only: the first half installed is a new key, reachable through an index
    // bucket no later update of the key persists.
    let two_inserts: Shape = |x, t| {
        x.insert(t, 100, val(7)).unwrap();
        x.insert(t, 101, val(8)).unwrap();
    };
    for (name, shape, expected) in [
        (
            "transfer",
            transfer,
            vec![(1, Some(90)), (2, Some(110)), (100, Some(7))],
        ),
        (
            "two inserts",
            two_inserts,
            vec![(100, Some(7)), (101, Some(8))],
        ),
    ] {
        let mut cluster = Cluster::new(2);
        {
            let db = cluster.open();
            let t = accounts(&db);
            let mut other = db.client().unwrap();
            other
                .run(0, |x| {
                    x.insert(&t, 1, val(100))?;
                    x.insert(&t, 2, val(100))
                })
                .unwrap();
            let (slot, cid) = die_mid_install(&db, &t, shape);
            // The other worker commits and ticks until its fence recovers the dead one.
            let deadline = std::time::Instant::now() + Duration::from_secs(20);
            let mut key = 1000;
            while db.recoveries().is_empty() {
                assert!(
                    std::time::Instant::now() < deadline,
                    "{name}: never recovered"
                );
                key += 1;
                other.run(3, |x| x.insert(&t, key, val(1))).unwrap();
                other.tick().unwrap();
                std::thread::sleep(Duration::from_millis(2));
            }
            let report = db.recoveries()[0].clone();
            assert_eq!(report.slot, slot, "{name}");
            assert!(report.rolled_forward > 0, "{name}: {report:?}");
            reuse_ring(&db, &t, slot, cid);
            std::mem::forget(other);
            std::mem::forget(db);
        }
        cluster.restart(&[0, 1]);
        let db = cluster.open();
        let keys: Vec<u64> = expected.iter().map(|&(k, _)| k).collect();
        assert_eq!(
            values(&db, &keys),
            expected,
            "{name}: after a restart of every server"
        );
    }
}

/// The same with a failover instead of a recovery: server 0 (the oracle's and the
/// log's) restarts while the dead commit is half installed on server 1. The repair
/// frees every ring, so what the record wrote on server 1 must be durable before: a
/// later restart of server 1 keeps it.
#[test]
fn a_commit_repaired_mid_install_stays_durable_on_the_server_that_kept_its_memory() {
    let mut cluster = Cluster::new(2);
    let (on_1, on_0);
    {
        let db = cluster.open();
        let t = accounts(&db);
        let server_of = |key: u64| t.partitions[t.partition_of(key)].server;
        on_1 = (1..).find(|&k| server_of(k) == 1).unwrap();
        on_0 = (1..).find(|&k| server_of(k) == 0).unwrap();
        db.client()
            .unwrap()
            .run(0, |x| {
                x.insert(&t, on_1, val(100))?;
                x.insert(&t, on_0, val(100))
            })
            .unwrap();
        // The first write (installed before the crash) is on server 1.
        static KEYS: std::sync::OnceLock<(u64, u64)> = std::sync::OnceLock::new();
        KEYS.set((on_1, on_0)).unwrap();
        die_mid_install(&db, &t, |x, t| {
            let &(on_1, on_0) = KEYS.get().unwrap();
            x.put(t, on_1, val(90)).unwrap();
            x.put(t, on_0, val(110)).unwrap();
            x.insert(t, 100, val(7)).unwrap();
        });
        std::mem::forget(db);
    }
    cluster.restart(&[0]);
    {
        let db = cluster.open();
        let report = db.restart_report().expect("a restart recovery ran");
        assert!(report.locks_rolled_forward > 0, "{report:?}");
        let t = db.table("accounts").unwrap();
        // The record survived server 0's restart.
        let (slot, cid) = dead_record(&db);
        reuse_ring(&db, &t, slot, cid);
        std::mem::forget(db);
    }
    cluster.restart(&[1]);
    let db = cluster.open();
    assert_eq!(
        values(&db, &[on_1, on_0, 100]),
        vec![(on_1, Some(90)), (on_0, Some(110)), (100, Some(7))],
        "after server 1 restarted too"
    );
}

/// The fencer of a dead holder cannot persist what its recovery resolved (the disk
/// fails, as a replicated primary's Persists do while its backup is away): it gives
/// its claim on the slot's guard back and tries again on its later ticks, so the
/// holder's locks are resolved soon after the disk works, with nobody else around.
/// Before, the guard stayed claimed by a recovery that had ended, and only another
/// node watching it for `TAKEOVER` (5 s) took it over; with none, the locks stayed.
#[test]
fn a_recovery_that_cannot_persist_gives_its_claim_back_and_is_tried_again() {
    let cluster = Cluster::new(2);
    let db = cluster.open();
    let t = accounts(&db);
    let mut reader = db.client().unwrap();
    reader
        .run(0, |x| {
            x.insert(&t, 1, val(100))?;
            x.insert(&t, 2, val(100))
        })
        .unwrap();
    die_mid_install(&db, &t, |x, t| {
        x.put(t, 1, val(90)).unwrap();
        x.put(t, 2, val(110)).unwrap();
        x.insert(t, 100, val(7)).unwrap();
    });
    assert!(!db.locked_records().unwrap().is_empty());
    for disk in &cluster.disks {
        disk.failing.store(true, Ordering::SeqCst);
    }
    // Only readers run: one that waits for a lock too long names the holder, and its
    // ticks fence it and resolve its work.
    let read = |reader: &mut txn::Client| {
        let mut x = reader.begin()?;
        let a = x.get(&t, 1)?;
        let b = x.get(&t, 2)?;
        Ok::<_, txn::TxnError>((num(a), num(b)))
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let failed = loop {
        assert!(
            std::time::Instant::now() < deadline,
            "the dead holder was never fenced"
        );
        let _ = read(&mut reader);
        if let Err(e) = reader.tick() {
            break e;
        }
        std::thread::sleep(Duration::from_millis(2));
    };
    assert!(
        matches!(failed, txn::TxnError::Persist { .. }),
        "the recovery fails on its persist: {failed}"
    );
    for disk in &cluster.disks {
        disk.failing.store(false, Ordering::SeqCst);
    }
    // The first try resolved what it could before its persist failed, but the slot's
    // guard is not clean: the blocks its records wrote are not known durable.
    assert!(db.recoveries().is_empty());
    let disk_back = std::time::Instant::now();
    while db.recoveries().is_empty() {
        assert!(
            disk_back.elapsed() < Duration::from_secs(3),
            "the recovery was not finished 3 s after the disk works again"
        );
        reader.tick().unwrap();
        std::thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(reader.stats().recoveries, 1);
    assert!(db.locked_records().unwrap().is_empty());
    // Atomic either way: the reader's snapshot may precede the dead commit, which never
    // returned to its caller.
    let values = read(&mut reader).unwrap();
    assert!(
        values == (90, 110) || values == (100, 100),
        "a torn transfer: {values:?}"
    );
}
