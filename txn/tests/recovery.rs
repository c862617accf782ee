//! Crash-atomic commits and recovery: a worker dies at each commit step (an
//! in-process crash point that panics on its thread; the worker is then leaked, so it
//! neither releases its locks nor its slot, as a dead process would not), another
//! worker's tick fences the dead slot once its lease lapses and resolves its locks
//! from the commit log (a fence needs a later timestamp decided, so the survivor
//! keeps committing elsewhere meanwhile). A transaction is committed exactly when its log record was
//! complete: from `after-log` on, the transfer and the insert are there; before it,
//! neither is, and no lock remains either way.

mod common;

use common::{cluster, database, num, val, with_accounts};
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::{Duration, Instant};
use txn::{Database, Table};

/// Runs, on a thread of its own, a transfer of 10 from account 1 to account 2 (on
/// different servers) that also inserts key 100, dying at `point`.
fn die_at(db: &Database, t: &Arc<Table>, point: &'static str) {
    let (db, t) = (db.clone(), t.clone());
    std::thread::spawn(move || {
        let mut client = db.client().unwrap();
        txn::crash::panic_at_on_this_thread(point).unwrap();
        let died = std::panic::catch_unwind(AssertUnwindSafe(|| {
            let mut x = client.begin().unwrap();
            let a = num(x.get(&t, 1).unwrap());
            let b = num(x.get(&t, 2).unwrap());
            x.put(&t, 1, val(a - 10)).unwrap();
            x.put(&t, 2, val(b + 10)).unwrap();
            x.insert(&t, 100, val(7)).unwrap();
            x.commit()
        }));
        assert!(
            died.is_err(),
            "the crash point {point} did not fire: {died:?}"
        );
        // A dead node releases nothing.
        std::mem::forget(client);
    })
    .join()
    .unwrap();
}

#[test]
fn a_crash_at_every_commit_step_is_recovered_atomically() {
    for (i, point) in txn::crash::POINTS.iter().enumerate() {
        let (db, t) = cluster();
        die_at(&db, &t, point);
        let committed = i >= 3; // after-log and later
        let mut survivor = db.client().unwrap();
        let start = Instant::now();
        loop {
            // A dead slot is fenced once it holds back a later decided timestamp: the
            // survivor keeps committing elsewhere (record 5).
            survivor.run(3, |x| x.put(&t, 5, val(1))).unwrap();
            survivor.tick().unwrap();
            let recovered = !db.recoveries().is_empty();
            if recovered && db.locked_records().unwrap().is_empty() {
                break;
            }
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "{point}: not recovered after 10 s; locked: {:?}",
                db.locked_records().unwrap()
            );
            std::thread::sleep(Duration::from_millis(2));
        }
        let report = &db.recoveries()[0];
        // Locks the dead commit held at that step: the new block, then both records
        // too; mid-install the first half (one of three) is installed already.
        let expected_locks = match *point {
            "after-insert-blocks" | "after-index" => 1,
            "mid-install" => 2,
            "after-install" => 0,
            _ => 3,
        };
        assert_eq!(
            report.rolled_forward + report.rolled_back,
            expected_locks,
            "{point}: {report:?}"
        );
        if *point != "after-install" {
            assert_eq!(report.rolled_forward > 0, committed, "{point}: {report:?}");
        }
        // The prefix moves on past the dead slot, and the database is atomic.
        let mut x = survivor.begin().unwrap();
        let a = num(x.get(&t, 1).unwrap());
        let b = num(x.get(&t, 2).unwrap());
        let inserted = x.get(&t, 100).unwrap();
        assert_eq!(a + b, 200, "{point}");
        if committed {
            assert_eq!((a, b), (90, 110), "{point}");
            assert_eq!(inserted, Some(val(7)), "{point}");
        } else {
            assert_eq!((a, b), (100, 100), "{point}");
            assert_eq!(inserted, None, "{point}");
        }
        drop(x);
        // Both records are writable again, and key 100 can be inserted if it is not
        // there.
        survivor
            .run(3, |x| {
                let a = num(x.get(&t, 1)?);
                x.put(&t, 1, val(a + 1))?;
                if x.get(&t, 100)?.is_none() {
                    x.insert(&t, 100, val(8))?;
                }
                Ok(())
            })
            .unwrap();
        assert!(db.locked_records().unwrap().is_empty(), "{point}");
    }
}

#[test]
fn readers_alone_get_a_dead_holders_locks_resolved() {
    // Nobody commits after the death, so no later timestamp is decided and the prefix
    // never stalls on the dead slot: only the readers that wait for its locks can
    // notice it. Before they did, the records stayed locked for ever.
    let (db, t) = cluster();
    die_at(&db, &t, "after-log");
    let mut reader = db.client().unwrap();
    let start = Instant::now();
    let (a, b) = loop {
        let mut x = reader.begin().unwrap();
        let read = x.get(&t, 1).and_then(|a| Ok((a, x.get(&t, 2)?)));
        drop(x);
        match read {
            Ok((a, b)) => break (num(a), num(b)),
            Err(txn::TxnError::Conflict { .. }) => {}
            Err(e) => panic!("{e}"),
        }
        reader.tick().unwrap();
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "still locked after 20 s: {:?}",
            db.locked_records().unwrap()
        );
    };
    assert_eq!((a, b), (90, 110), "the logged transfer is rolled forward");
    assert_eq!(db.recoveries().len(), 1);
    assert!(db.locked_records().unwrap().is_empty());
}

#[test]
fn committed_records_are_in_the_log_and_clean_exits_leave_no_work() {
    let (db, t) = cluster();
    let mut c = db.client().unwrap();
    c.run(0, |x| x.put(&t, 3, val(5))).unwrap();
    let cid = c.last_cid();
    let slot = (0..db.options().slots)
        .find(|&s| txn::recovery::read_log(&db, s).unwrap().contains_key(&cid))
        .expect("the commit's record is in its slot's log");
    let record = &txn::recovery::read_log(&db, slot).unwrap()[&cid];
    assert_eq!(record.entries.len(), 1);
    assert_eq!(record.entries[0].key, 3);
    assert_eq!(record.entries[0].value, val(5));
    drop(c);
    // A worker that ends cleanly leaves nothing to recover: a new one adopts its slot
    // without running a recovery.
    let c = db.client().unwrap();
    drop(c);
    assert!(db.recoveries().is_empty());
    assert!(db.locked_records().unwrap().is_empty());
}

/// Every oracle slot is held by a dead worker and no live holder is left to fence
/// them (a node in a crash loop): a new worker takes a slot over once its holder was
/// silent for the lease timeout, and resolves what the holder left.
#[test]
fn a_new_worker_takes_over_a_slot_when_every_holder_is_gone() {
    let (db, t) = database(2);
    db.client()
        .unwrap()
        .run(0, |x| {
            x.insert(&t, 1, val(100))?;
            x.insert(&t, 2, val(100))
        })
        .unwrap();
    // One holder dies halfway through installing a commit, the other idle.
    die_at(&db, &t, "mid-install");
    std::mem::forget(db.client().unwrap());
    assert!(!db.locked_records().unwrap().is_empty());
    let mut first = db.client().expect("a slot taken over");
    // The second takes the other slot over while the first ticks, as a live worker
    // does (a holder that stays silent for the lease timeout counts as gone).
    let taking = {
        let db = db.clone();
        std::thread::spawn(move || db.client())
    };
    while !taking.is_finished() {
        first.tick().unwrap();
        std::thread::sleep(Duration::from_millis(2));
    }
    let mut second = taking.join().unwrap().expect("the other slot taken over");
    assert!(
        db.locked_records().unwrap().is_empty(),
        "the dead commit resolved"
    );
    let mut x = first.begin().unwrap();
    assert_eq!(
        (
            num(x.get(&t, 1).unwrap()),
            num(x.get(&t, 2).unwrap()),
            num(x.get(&t, 100).unwrap())
        ),
        (90, 110, 7)
    );
    drop(x);
    first.run(3, |x| x.put(&t, 1, val(1))).unwrap();
    second.run(3, |x| x.put(&t, 2, val(2))).unwrap();
    // With both slots held by live workers, a third is refused.
    let refused = {
        let db = db.clone();
        std::thread::spawn(move || db.client().map(drop))
    };
    while !refused.is_finished() {
        first.tick().unwrap();
        second.tick().unwrap();
        std::thread::sleep(Duration::from_millis(2));
    }
    assert!(matches!(
        refused.join().unwrap(),
        Err(txn::TxnError::Oracle(timestamp::OracleError::NoFreeSlot {
            slots: 2
        }))
    ));
}

/// A fenced commit whose recovery stalls once it began (the recovering node starved
/// too) is still undecided when the asker's patience runs out: `fenced_outcome` says
/// so, naming the commit, rather than wait on or guess, and leaves the recovery alone;
/// once the recovery goes on it decides the commit, nothing lost or doubled.
#[test]
fn a_fenced_commit_whose_recovery_stalls_is_unknown_past_the_patience() {
    for (point, committed) in [("after-lock", false), ("after-log", true)] {
        let (db, t) = cluster();
        let fencer = fencer(&db, &t);
        let mut client = db.client().unwrap();
        let hold = txn::crash::starve_at_with_recovery_held_on_this_thread(
            &db,
            point,
            Duration::from_secs(30),
        )
        .unwrap();
        let mut x = client.begin().unwrap();
        x.put(&t, 1, val(90)).unwrap();
        x.insert(&t, 100, val(7)).unwrap();
        let cid = match x.commit() {
            Err(txn::TxnError::Fenced { cid }) => cid,
            other => panic!("{point}: not fenced: {other:?}"),
        };
        assert_eq!(hold.cid(), Some(cid), "{point}");
        let worker = client.worker();
        let asked = txn::runtime::block_on(worker.fenced_outcome(cid, Duration::from_millis(300)));
        let Err(txn::TxnError::Invalid(why)) = asked else {
            panic!("{point}: decided while its recovery stalls: {asked:?}");
        };
        assert!(
            why.contains(&format!("the outcome of commit {cid} is still unknown")),
            "{point}: {why}"
        );
        assert!(hold.is_holding(), "{point}: the recovery was taken over");
        hold.release();
        let deadline = Instant::now() + Duration::from_secs(30);
        while db.recoveries().is_empty() || !db.locked_records().unwrap().is_empty() {
            assert!(
                Instant::now() < deadline,
                "{point}: the recovery never finished"
            );
            std::thread::sleep(Duration::from_millis(2));
        }
        fencer.stop().unwrap();
        let mut x = client.begin().unwrap();
        let seen = (num(x.get(&t, 1).unwrap()), x.get(&t, 100).unwrap());
        if committed {
            assert_eq!(seen, (90, Some(val(7))), "{point}");
        } else {
            assert_eq!(seen, (100, None), "{point}");
        }
    }
}

/// A worker whose thread stalls mid-commit past its lease (a thread starved of CPU)
/// finds its commit fenced, and learns what recovery made of it: committed from
/// `after-log` on (the record was complete), rolled back before; the data agrees, and
/// the answer is given once.
#[test]
fn a_fenced_commit_learns_its_outcome_once_recovery_decided_it() {
    // A stall leaves the installs in one step (crash points split them), so from
    // `mid-install` on every lease check is behind: those commits are not fenced.
    for (i, point) in txn::crash::POINTS[..4].iter().enumerate() {
        let (db, t) = cluster();
        let fencer = fencer(&db, &t);
        let mut client = db.client().unwrap();
        txn::crash::starve_at_on_this_thread(&db, point, Duration::from_secs(30)).unwrap();
        let mut x = client.begin().unwrap();
        let a = num(x.get(&t, 1).unwrap());
        let b = num(x.get(&t, 2).unwrap());
        x.put(&t, 1, val(a - 10)).unwrap();
        x.put(&t, 2, val(b + 10)).unwrap();
        x.insert(&t, 100, val(7)).unwrap();
        let cid = match x.commit() {
            Err(txn::TxnError::Fenced { cid }) => cid,
            other => panic!("{point}: not fenced: {other:?}"),
        };
        let worker = client.worker();
        let outcome =
            txn::runtime::block_on(worker.fenced_outcome(cid, Duration::from_secs(30))).unwrap();
        let committed = i >= 3;
        let expected = if committed {
            txn::FencedOutcome::Committed { cid }
        } else {
            txn::FencedOutcome::RolledBack
        };
        assert_eq!(outcome, expected, "{point}");
        let again = txn::runtime::block_on(worker.fenced_outcome(cid, Duration::from_secs(1)));
        assert!(
            matches!(again, Err(txn::TxnError::Invalid(_))),
            "{point}: {again:?}"
        );
        fencer.stop().unwrap();
        let mut x = client.begin().unwrap();
        let (a, b) = (num(x.get(&t, 1).unwrap()), num(x.get(&t, 2).unwrap()));
        let inserted = x.get(&t, 100).unwrap();
        if committed {
            assert_eq!(((a, b), inserted), ((90, 110), Some(val(7))), "{point}");
        } else {
            assert_eq!(((a, b), inserted), ((100, 100), None), "{point}");
        }
        drop(x);
        assert!(db.locked_records().unwrap().is_empty(), "{point}");
    }
}

/// A recovery stalled after its last look at its guard, for longer than
/// `txn::recovery::TAKEOVER` (its node starved of CPU, or stopped), is taken over and
/// finished by another node, and the slot gets a new holder, which locks a record of
/// its own (with a CID of the same slot) in a commit. When the stalled recovery goes
/// on, it must leave that lock alone: releasing it under the live commit would let
/// another write the record meanwhile (a lost update).
#[test]
fn a_stalled_recovery_that_was_taken_over_leaves_a_later_holders_locks_alone() {
    // Two slots: the fencer's, and the one the starved holder, then the new one, holds.
    let (db, t) = with_accounts(2);
    let fencer = fencer(&db, &t);
    let (starved, hold, dead) = starved_write_of_key_1(
        &db,
        &t,
        txn::crash::starve_at_with_recovery_held_past_its_check_on_this_thread,
    );
    assert!(hold.is_holding());
    // The new holder of the slot: it waits for the stalled recovery, takes it over
    // after TAKEOVER, and adopts the slot once that recovery finished.
    let mut next = db.client().unwrap();
    let slots = 2;
    let (cid, locked, committed) =
        increment_key_2_letting_go(&db, &t, &mut next, hold, move |cid| {
            assert_eq!(cid % slots, dead % slots, "the new holder has another slot")
        });
    assert!(
        locked.iter().any(|l| l.key == 2 && l.cid == cid),
        "the stale recovery released the lock of commit {cid} of the slot's next holder \
         under it; locked then: {locked:?}"
    );
    assert_eq!(committed.unwrap(), Some(cid));
    // Held in the recovery for seconds, the fencer's own slot may have been fenced
    // meanwhile: what it failed with is not what this test is about.
    let _ = fencer.stop();
    let mut x = next.begin().unwrap();
    assert_eq!(
        (num(x.get(&t, 1).unwrap()), num(x.get(&t, 2).unwrap())),
        (100, 101)
    );
    drop(x);
    assert!(db.locked_records().unwrap().is_empty());
    drop(starved);
}

/// A worker stopped between its claim of an oracle slot and its adoption of the
/// slot's commit log, for longer than its lease, is fenced; the slot's next holder
/// adopts the log and locks a record in a commit. When the stopped worker goes on, it
/// must not take that live holder for a dead one and resolve its locks (a lost
/// update): its adoption fails as fenced instead.
#[test]
fn a_claimer_fenced_before_it_adopted_leaves_the_next_holders_locks_alone() {
    // Two slots: the fencer's, and the one the stopped claimer, then the new one, holds.
    let (db, t) = with_accounts(2);
    let fencer = fencer(&db, &t);
    let hold = txn::crash::hold_next_slot_adoption(&db);
    let stopped = {
        let db = db.clone();
        std::thread::spawn(move || db.client().map(std::mem::forget))
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while !hold.is_holding() {
        assert!(Instant::now() < deadline, "the adoption was not held");
        std::thread::sleep(Duration::from_millis(2));
    }
    // Takes the stopped claimer's slot once its lease lapsed.
    let mut next = db.client().unwrap();
    let (cid, locked, committed) = increment_key_2_letting_go(&db, &t, &mut next, hold, |_| {});
    assert!(
        locked.iter().any(|l| l.key == 2 && l.cid == cid),
        "the stopped claimer released the lock of commit {cid} of the slot's next holder \
         under it; locked then: {locked:?}"
    );
    assert_eq!(committed.unwrap(), Some(cid));
    match stopped.join().unwrap() {
        Err(txn::TxnError::Oracle(timestamp::OracleError::Fenced { .. })) => {}
        other => panic!("the stopped claimer adopted the slot: {other:?}"),
    }
    fencer.stop().unwrap();
    let mut x = next.begin().unwrap();
    assert_eq!(num(x.get(&t, 2).unwrap()), 101);
    drop(x);
    assert!(db.locked_records().unwrap().is_empty());
}

/// A worker that claims the slot of a holder whose recovery is under way waits for
/// that recovery before it adopts the slot's log; here the recovery stalls, and the
/// wait lasts until the claimer takes it over (`TAKEOVER`, seconds against an 80 ms
/// lease), then recovers the holder itself. It keeps its own lease all the while:
/// before, it renewed nothing, another worker's ticks fenced it as dead, and its first
/// commit had to claim a slot anew (in a chaos run, a process starting up was fenced
/// 350 ms after it connected).
#[test]
fn a_claimer_waiting_for_a_stalled_recovery_keeps_its_own_lease() {
    // Three slots: two fencers, and the one the starved holder, then the claimer, holds.
    let (db, t) = with_accounts(3);
    // One fencer's tick recovers the starved holder and is held there; the other
    // keeps ticking, and fences whoever stops renewing.
    let (first, second) = (fencer(&db, &t), fencer(&db, &t));
    let (starved, hold, dead) = starved_write_of_key_1(
        &db,
        &t,
        txn::crash::starve_at_with_recovery_held_on_this_thread,
    );
    assert!(hold.is_holding());
    let waited = Instant::now();
    let mut claimer = db.client().unwrap();
    assert!(
        waited.elapsed() > Duration::from_millis(800),
        "the claimer did not wait for the stalled recovery ({:?}): the test shows nothing",
        waited.elapsed()
    );
    let ((), cid) = claimer.run(0, |x| x.put(&t, 3, val(7))).unwrap();
    let cid = cid.expect("a commit that wrote");
    assert_eq!(
        claimer.stats().rejoins,
        0,
        "the claimer was fenced while it waited for the recovery"
    );
    assert_eq!(cid % 3, dead % 3, "the claimer has another slot");
    assert!(hold.release_and_wait(Duration::from_secs(30)));
    // Held in the recovery for seconds, the first fencer's own slot may have been
    // fenced meanwhile (its tick waits there, unlike the claimer's adoption).
    let _ = (first.stop(), second.stop());
    let mut x = claimer.begin().unwrap();
    assert_eq!(
        num(x.get(&t, 1).unwrap()),
        100,
        "the starved commit rolled back"
    );
    drop(x);
    assert!(db.locked_records().unwrap().is_empty());
    drop(starved);
}

/// How a test starves this thread's next commit at a crash point with its recovery
/// held (one of `txn::crash::starve_at_with_recovery_held_*`).
type StarveWithRecoveryHeld =
    fn(&Database, &'static str, Duration) -> Result<txn::RecoveryHold, String>;

/// A new client's commit writing key 1 of `t`, starved by `starve` after its lock until
/// fenced: the client, the held recovery and the commit's CID.
fn starved_write_of_key_1(
    db: &Database,
    t: &Arc<Table>,
    starve: StarveWithRecoveryHeld,
) -> (txn::Client, txn::RecoveryHold, u64) {
    let mut client = db.client().unwrap();
    let hold = starve(db, "after-lock", Duration::from_secs(30)).unwrap();
    let mut x = client.begin().unwrap();
    x.put(t, 1, val(90)).unwrap();
    let dead = match x.commit() {
        Err(txn::TxnError::Fenced { cid }) => cid,
        other => panic!("not fenced: {other:?}"),
    };
    (client, hold, dead)
}

/// Commits to key 5 of `t` and ticks until stopped (see [`txn::crash::Fencer`]).
fn fencer(db: &Database, t: &Arc<Table>) -> txn::crash::Fencer {
    let t = t.clone();
    txn::crash::Fencer::spawn(db, move |x| x.put(&t, 5, val(1))).unwrap()
}

/// A commit of `client` that adds one to key 2 of `t`; once it holds its lock it lets
/// `hold` go and waits for what was held to return, then notes which records are
/// locked (`check` sees its CID first). Answers the CID, those records and what the
/// commit returned.
fn increment_key_2_letting_go(
    db: &Database,
    t: &Arc<Table>,
    client: &mut txn::Client,
    hold: txn::RecoveryHold,
    check: impl Fn(u64) + Send + 'static,
) -> (u64, Vec<txn::LockedRecord>, txn::Result<Option<u64>>) {
    let seen = Arc::new(std::sync::Mutex::new(None));
    {
        let (db, seen) = (db.clone(), seen.clone());
        txn::crash::stall_at_on_this_thread(
            "after-lock",
            Box::new(move |cid| {
                check(cid);
                assert!(
                    hold.release_and_wait(Duration::from_secs(30)),
                    "what was held did not return"
                );
                *seen.lock().unwrap() = Some((cid, db.locked_records().unwrap()));
            }),
        )
        .unwrap();
    }
    let mut x = client.begin().unwrap();
    let a = num(x.get(t, 2).unwrap());
    x.put(t, 2, val(a + 1)).unwrap();
    let committed = x.commit();
    let (cid, locked) = seen.lock().unwrap().take().expect("the commit stalled");
    (cid, locked, committed)
}

/// A commit whose thread is descheduled past its lease between its install's lease
/// check and the install's post (a loaded machine), while another worker of the
/// process fences its slot. Before the lease gate (`timestamp::gate`) the fence went
/// on: recovery rolled the commit forward and released its locks, a later commit
/// wrote record 1 anew, and then the late install put the older version back over
/// the newer one, which readers lost (the shape of a stale read in one CI run of
/// verify's `txn_sim`). Now the fence waits until the step has completed: the slot is
/// fenced and recovered only after it, and no later commit is undone.
#[test]
fn a_commit_descheduled_inside_its_install_step_is_not_overtaken_by_its_recovery() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let (db, t) = cluster();
    let fencer = fencer(&db, &t);
    let overtaken = Arc::new(AtomicBool::new(false));
    let stalled = Arc::new(std::sync::Mutex::new(None));
    {
        let (db, t, overtaken, stalled) =
            (db.clone(), t.clone(), overtaken.clone(), stalled.clone());
        txn::crash::stall_at_on_this_thread(
            "install-posting",
            Box::new(move |cid| {
                *stalled.lock().unwrap() = Some(cid);
                // Ten leases, or until the slot was recovered meanwhile.
                if db.wait_for_recovery_of(cid, Duration::from_millis(800)) {
                    overtaken.store(true, Ordering::SeqCst);
                    let (db, t) = (db.clone(), t.clone());
                    std::thread::spawn(move || {
                        db.client().unwrap().run(10, |x| x.put(&t, 1, val(500)))
                    })
                    .join()
                    .unwrap()
                    .unwrap();
                }
            }),
        )
        .unwrap();
    }
    let mut client = db.client().unwrap();
    let mut x = client.begin().unwrap();
    x.put(&t, 1, val(42)).unwrap();
    let committed = x.commit();
    let cid = stalled
        .lock()
        .unwrap()
        .expect("the commit stalled in its install step");
    let slot = (cid % u64::from(db.options().slots)) as u32;
    // The stall outlasted the lease: the slot is fenced and recovered, after it.
    let start = Instant::now();
    while !db.recoveries().iter().any(|r| r.slot == slot)
        || !db.locked_records().unwrap().is_empty()
    {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "slot {slot} not fenced and recovered after the stall; locked: {:?}",
            db.locked_records().unwrap()
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    fencer.stop().unwrap();
    let mut reader = db.client().unwrap();
    let mut x = reader.begin().unwrap();
    let (value, version) = (num(x.get(&t, 1).unwrap()), x.get_version(&t, 1).unwrap());
    drop(x);
    let overtaken = overtaken.load(Ordering::SeqCst);
    assert_eq!(
        value,
        if overtaken { 500 } else { 42 },
        "record 1 at version {version:?} (the stalled commit {cid}: {committed:?}); the \
         slot was recovered during the stall: {overtaken}"
    );
    assert!(
        !overtaken,
        "the slot was recovered while its commit was posting"
    );
    assert_eq!(committed.unwrap(), Some(cid));
    assert_eq!(version, Some(cid));
    // And the record takes later commits.
    reader.run(3, |x| x.put(&t, 1, val(43))).unwrap();
    let mut x = reader.begin().unwrap();
    assert_eq!(num(x.get(&t, 1).unwrap()), 43);
}

/// A commit whose lease checks fail with a transport error after its lock step (the
/// oracle's memory server did not answer: the worker cannot tell whether it still
/// holds its slot) may neither post its log record nor release its lock or decide its
/// timestamp, since any of them could land after a fence. Before, the abort path
/// returned the error without a decision and the worker went on committing under its
/// lease, its timestamp undecided for good: every reader of the oracle waited behind
/// it for as long as it lived, and here `begin_after` gave up after 10 s ("the read
/// timestamp stayed at …"). Now the worker
/// stops (broken), its lease lapses, the fencer decides the timestamp and recovery
/// releases the lock.
#[test]
fn a_commit_that_cannot_check_its_lease_stops_its_worker_not_the_oracle() {
    let (db, t) = cluster();
    let fencer = fencer(&db, &t);
    let mut client = db.client().unwrap();
    let (x, a) = increment_key_1(&mut client, &t);
    // The lock step's check passes; the log step's and the abort path's fail.
    txn::crash::fail_lease_checks_on_this_thread(1, 2);
    let failed = x.commit();
    assert!(
        matches!(failed, Err(txn::TxnError::Oracle(_))),
        "{failed:?}"
    );
    let cid = txn::crash::failed_lease_check_cid().expect("a lease check failed");
    let read = read_after_beside(&db, &t, cid, client, &format!("commit {cid} failed"));
    assert_eq!(read, a, "the failed commit is rolled back");
    fencer.stop().unwrap();
    assert!(db.locked_records().unwrap().is_empty());
}

/// A worker whose queued timestamp decisions could not be posted (a transport error:
/// some may have landed, so they cannot be posted again) stops, so that its lease
/// lapses and a fence decides them. Before, the batch was dropped and the worker went
/// on under its lease: the committed timestamp stayed undecided for good, and
/// `begin_after` it gave up after 10 s.
#[test]
fn a_worker_whose_decisions_could_not_be_posted_stops_rather_than_the_oracle() {
    let (db, t) = cluster();
    let fencer = fencer(&db, &t);
    let mut client = db.client().unwrap();
    let (x, a) = increment_key_1(&mut client, &t);
    // The commit flushes its decision at its end.
    txn::crash::fail_next_decisions_on_this_thread();
    let cid = match x.commit() {
        Err(txn::TxnError::CommittedUnconfirmed { cid, .. }) => cid,
        other => panic!("{other:?}"),
    };
    let read = read_after_beside(&db, &t, cid, client, &format!("[{cid}]"));
    assert_eq!(read, a + 1, "the commit stands");
    fencer.stop().unwrap();
    assert!(db.locked_records().unwrap().is_empty());
}

/// Record 1 of `t`, read by a new client in a transaction that begins after `cid`,
/// while `failed` (whose worker left `cid` behind) is kept busy as a session would,
/// until it says it is broken, naming `cid` as `named`: a worker that cannot decide
/// its timestamp must not hold the oracle back.
fn read_after_beside(
    db: &Database,
    t: &Arc<Table>,
    cid: u64,
    mut failed: txn::Client,
    named: &str,
) -> i64 {
    let reader = {
        let (db, t) = (db.clone(), t.clone());
        std::thread::spawn(move || -> txn::Result<i64> {
            let mut reader = db.client()?;
            let mut x = reader.begin_after(cid)?;
            Ok(num(x.get(&t, 1)?))
        })
    };
    while !reader.is_finished() {
        match failed.begin() {
            Ok(x) => drop(x),
            Err(txn::TxnError::Broken(why)) => {
                assert!(why.contains(named), "{why}");
                break;
            }
            Err(e) => panic!("{e}"),
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    reader.join().unwrap().unwrap()
}

/// A transaction of `client` that adds one to key 1 of `t`, not committed yet, and
/// the value it read.
fn increment_key_1<'c>(client: &'c mut txn::Client, t: &Arc<Table>) -> (txn::Transaction<'c>, i64) {
    let mut x = client.begin().unwrap();
    let a = num(x.get(t, 1).unwrap());
    x.put(t, 1, val(a + 1)).unwrap();
    (x, a)
}
