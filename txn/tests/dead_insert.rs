//! A node killed mid-insert, between the two doorbells of a batched insert (the index
//! claim, then the address). In its own test binary: the crash points of the other
//! recovery tests (`txn::crash::panic_at_on_this_thread`) arm the process for good,
//! and armed, every insert goes one step at a time, so no commit would die between
//! the claim and the address here.

mod common;

use common::{cluster, num, val};
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};
use txn::{Database, Table};

/// A node's commit (inserting key 100, and moving 10 out of account 1 if `also_put`)
/// dies between its index claim and the address: the node is gone. Returns the
/// commit's CID.
fn die_after_claiming(db: &Database, t: &Arc<Table>, also_put: bool) -> u64 {
    let (looked, go, cid) = dying_inserter(db, t, also_put);
    looked.recv().unwrap();
    go.send(()).unwrap();
    cid.recv().unwrap()
}

/// As [`die_after_claiming`], in steps: the node looks key 100 up (the first
/// receiver hears when), commits once told to (the sender), and its commit's CID comes
/// on the second receiver once it died.
fn dying_inserter(
    db: &Database,
    t: &Arc<Table>,
    also_put: bool,
) -> (mpsc::Receiver<()>, mpsc::Sender<()>, mpsc::Receiver<u64>) {
    let (looked, go, cid, _) = claiming_inserter(db, t, also_put, || {
        panic!("the node dies after its index claim")
    });
    (looked, go, cid)
}

/// What a claimer of key 100 that outlives its stall ends with.
type Ended = std::thread::JoinHandle<std::thread::Result<txn::Result<Option<u64>>>>;

/// A node's commit of key 100 that runs `in_stall` between its index claim and the
/// address, as [`dying_inserter`]; if `in_stall` returns, the commit goes on, and the
/// returned handle answers its outcome.
fn claiming_inserter(
    db: &Database,
    t: &Arc<Table>,
    also_put: bool,
    in_stall: impl FnOnce() + Send + 'static,
) -> (
    mpsc::Receiver<()>,
    mpsc::Sender<()>,
    mpsc::Receiver<u64>,
    Ended,
) {
    let (db, t) = (db.clone(), t.clone());
    let (looked_tx, looked) = mpsc::channel();
    let (go, go_rx) = mpsc::channel();
    let (cid_tx, cid) = mpsc::channel();
    let ended = std::thread::spawn(move || {
        let mut client = db.client().unwrap();
        // A stall (unlike the crash points) keeps the commit's batched steps; dying in
        // it is dying between the claim's doorbell and the address's.
        txn::crash::stall_at_on_this_thread(
            "after-insert-blocks",
            Box::new(move |c| {
                cid_tx.send(c).unwrap();
                in_stall()
            }),
        )
        .unwrap();
        let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| {
            let mut x = client.begin().unwrap();
            if also_put {
                let a = num(x.get(&t, 1).unwrap());
                x.put(&t, 1, val(a - 10)).unwrap();
            }
            x.insert(&t, 100, val(7)).unwrap();
            looked_tx.send(()).unwrap();
            go_rx.recv().unwrap();
            x.commit()
        }));
        if outcome.is_err() {
            // Dead: nothing of the node may run on, its worker included.
            std::mem::forget(client);
        }
        outcome
    });
    (looked, go, cid, ended)
}

/// A node killed between its batched insert's claim of an index slot (the key word's
/// CAS, posted with the block's WRITE) and the WRITE of the slot's address (posted with
/// the locks) leaves the key claimed with no address: every lookup reads it as an
/// insert in progress. Recovery of its slot must settle that claim, or the key can be
/// neither read nor inserted again, for good (the chaos harness's final read failed
/// on such a key, "conflict", with no record locked).
#[test]
fn a_node_dead_between_its_index_claim_and_the_address_leaves_the_key_usable() {
    let (db, t) = cluster();
    die_after_claiming(&db, &t, true);
    assert_eq!(
        db.unpublished_index_slots().unwrap(),
        [txn::UnpublishedSlot {
            table: "accounts".into(),
            key: 100
        }]
    );
    let mut survivor = db.client().unwrap();
    let start = Instant::now();
    while db.recoveries().is_empty() || !db.locked_records().unwrap().is_empty() {
        survivor.run(3, |x| x.put(&t, 5, val(1))).unwrap();
        survivor.tick().unwrap();
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "not recovered after 10 s; locked: {:?}",
            db.locked_records().unwrap()
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    let report = &db.recoveries()[0];
    assert_eq!(
        (report.rolled_forward, report.rolled_back),
        (0, 1),
        "{report:?}"
    );
    assert_eq!(db.unpublished_index_slots().unwrap(), []);
    // The dead commit had no record: nothing of it is there, and key 100 is absent
    // (not an insert in progress for ever).
    let mut x = survivor.begin().unwrap();
    assert_eq!(num(x.get(&t, 1).unwrap()), 100);
    match x.get(&t, 100) {
        Ok(v) => assert_eq!(v, None),
        Err(e) => panic!("key 100 unreadable after the recovery: {e}"),
    }
    drop(x);
    survivor
        .run(3, |x| x.insert(&t, 100, val(8)))
        .expect("key 100 can be inserted after the recovery");
    let mut x = survivor.begin().unwrap();
    assert_eq!(num(x.get(&t, 100).unwrap()), 8);
    drop(x);
    assert!(db.locked_records().unwrap().is_empty());
}

/// As above, but nobody commits afterwards and the dead commit locked no record
/// anyone reads: only readers of the claimed key are left to notice the dead node. A
/// lookup that finds the claim pending past the lock patience finds the claimer's
/// locked block and has its holder checked, as a read that meets a lock does. Before,
/// the key stayed unreadable for as long as nobody committed.
#[test]
fn readers_alone_of_a_key_a_dead_node_claimed_get_it_settled() {
    let (db, t) = cluster();
    die_after_claiming(&db, &t, false);
    assert_eq!(db.unpublished_index_slots().unwrap().len(), 1);
    let mut reader = db.client().unwrap();
    let start = Instant::now();
    loop {
        let mut x = reader.begin().unwrap();
        let read = x.get(&t, 100);
        drop(x);
        match read {
            Ok(v) => {
                assert_eq!(v, None, "the dead insert is rolled back");
                break;
            }
            Err(txn::TxnError::Conflict { .. }) => {}
            Err(e) => panic!("{e}"),
        }
        reader.tick().unwrap();
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "key 100 still pending after 20 s: {:?}",
            db.unpublished_index_slots().unwrap()
        );
    }
    assert_eq!(db.recoveries().len(), 1);
    assert_eq!(db.unpublished_index_slots().unwrap(), []);
    assert!(db.locked_records().unwrap().is_empty());
}

/// Reads key 100 until it reads (ticking, so that what a reader suspects is fenced),
/// for up to 20 s; what it read.
fn read_until_settled(db: &Database, t: &Arc<Table>) -> Option<Vec<u8>> {
    let mut reader = db.client().unwrap();
    let start = Instant::now();
    loop {
        let mut x = reader.begin().unwrap();
        let read = x.get(t, 100);
        drop(x);
        match read {
            Ok(v) => return v,
            Err(txn::TxnError::Conflict { .. }) => {}
            Err(e) => panic!("{e}"),
        }
        reader.tick().unwrap();
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "key 100 still unreadable after 20 s; unpublished {:?}, locked {:?}",
            db.unpublished_index_slots().unwrap(),
            db.locked_records().unwrap()
        );
    }
}

/// Two inserters of key 100. One read it absent and then lost its claim's CAS to a
/// node that died holding the claim (no address), and is descheduled right after,
/// its block locked, while the dead node's recovery runs: that recovery finds a
/// second locked block of the key, waits twice the lease for it, then leaves the slot
/// to "the key's other inserter". The loser was never fenced (nobody ticked while
/// the recovery waited), so its lease renews and it aborts as a duplicate,
/// releasing its block, but a loser has no address to publish: before, nothing
/// settled the slot after that, the key stayed unreadable ("index slot pending too
/// long", no lock anywhere) and uninsertable for good.
#[test]
fn a_claim_left_to_a_losing_inserter_of_the_key_is_settled() {
    claim_left_to_a_loser(|| panic!("the node dies after its index claim"));
}

/// As above, but the claimer is not dead: descheduled between its claim and the
/// address for as long as all that took, it is fenced, and its commit goes on only
/// after the slot was settled and key 100 inserted again. Its commit then publishes
/// its won slot after the failed lease check (a won slot gets its address whatever
/// happens); before, by a WRITE, which pointed the key back at the claimer's
/// tombstone and lost the committed insert.
#[test]
fn a_fenced_claimer_cannot_unsettle_its_slot() {
    let (resume, resumed) = mpsc::channel::<()>();
    let (db, t, claimer) = claim_left_to_a_loser(move || resumed.recv().unwrap());
    resume.send(()).unwrap();
    match claimer.join().unwrap() {
        Ok(Err(txn::TxnError::Fenced { .. })) => {}
        other => panic!("the claimer's commit should end fenced: {other:?}"),
    }
    // A fresh client: no cached address.
    let mut x = db.client().unwrap();
    let mut x = x.begin().unwrap();
    assert_eq!(
        x.get(&t, 100).unwrap().map(|v| num(Some(v))),
        Some(8),
        "the insert after the settle is kept"
    );
    drop(x);
    assert!(db.locked_records().unwrap().is_empty());
    assert_eq!(db.unpublished_index_slots().unwrap(), []);
}

/// The scenario of [`a_claim_left_to_a_losing_inserter_of_the_key_is_settled`], the
/// claimer running `in_stall` between its claim and the address, up to key 100
/// settled and then inserted (value 8) by another client. Returns the claimer's end.
fn claim_left_to_a_loser(
    in_stall: impl FnOnce() + Send + 'static,
) -> (Database, Arc<Table>, Ended) {
    let (db, t) = cluster();
    // The claimer's client first: the loser's later slot hands out later CIDs, so the
    // claimer's commit is the one that stalls the prefix and is fenced first.
    let (claimer_looked, claimer_go, claimer_cid, claimer) =
        claiming_inserter(&db, &t, false, in_stall);
    claimer_looked.recv().unwrap();
    let (looked_tx, looked) = mpsc::channel();
    let (go_tx, go) = mpsc::channel::<()>();
    let (stalled_tx, stalled) = mpsc::channel();
    let (resume_tx, resume) = mpsc::channel::<()>();
    let loser = {
        let (db, t) = (db.clone(), t.clone());
        std::thread::spawn(move || {
            let mut client = db.client().unwrap();
            let mut x = client.begin().unwrap();
            // Absent: its commit will claim without reading the bucket again.
            x.insert(&t, 100, val(9)).unwrap();
            let suspended = x.suspend();
            looked_tx.send(()).unwrap();
            go.recv().unwrap();
            // A fresh lease, so that the claimer's lapses first and its slot is the
            // one fenced.
            client.tick().unwrap();
            txn::crash::stall_at_on_this_thread(
                "after-insert-blocks",
                Box::new(move |cid| {
                    stalled_tx.send(cid).unwrap();
                    resume.recv().unwrap();
                }),
            )
            .unwrap();
            let x = client.resume(suspended);
            x.commit()
        })
    };
    looked.recv().unwrap();
    claimer_go.send(()).unwrap();
    let dead = claimer_cid.recv().unwrap();
    go_tx.send(()).unwrap();
    let loser_cid = stalled.recv_timeout(Duration::from_secs(10)).unwrap();
    // The claimer's block and the loser's, both locked; the slot claimed.
    let mut locked: Vec<(u64, u64)> = db
        .locked_records()
        .unwrap()
        .into_iter()
        .map(|r| (r.key, r.cid))
        .collect();
    locked.sort();
    let mut expected = vec![(100, dead), (100, loser_cid)];
    expected.sort();
    assert_eq!(locked, expected);
    assert_eq!(db.unpublished_index_slots().unwrap().len(), 1);
    // A survivor commits and ticks until the claimer's slot is recovered, and no
    // longer: its next ticks would fence the descheduled loser too.
    let slots = u64::from(db.options().slots);
    let mut survivor = db.client().unwrap();
    // One commit decides a timestamp beyond the stalled ones, so that ticks fence
    // what stalls the prefix; then only ticks (a commit's begin ticks too, and may
    // run more than one).
    survivor.run(3, |x| x.put(&t, 5, val(1))).unwrap();
    let start = Instant::now();
    while db.recoveries().is_empty() {
        survivor.tick().unwrap();
        assert!(start.elapsed() < Duration::from_secs(10), "not recovered");
        std::thread::sleep(Duration::from_millis(2));
    }
    let report = db.recoveries()[0].clone();
    assert_eq!(
        report.slot as u64,
        dead % slots,
        "claimer {dead}, loser {loser_cid}: {report:?}"
    );
    assert_eq!((report.rolled_forward, report.rolled_back), (0, 1));
    resume_tx.send(()).unwrap();
    match loser.join().unwrap() {
        Err(txn::TxnError::DuplicateKey { key: 100, .. }) => {}
        other => panic!(
            "the loser should abort as a duplicate, unfenced: {other:?}; claimer {dead}, \
             loser {loser_cid}, {:?}",
            db.recoveries()
        ),
    }
    assert!(db.locked_records().unwrap().is_empty());
    assert_eq!(
        read_until_settled(&db, &t),
        None,
        "neither insert committed"
    );
    assert_eq!(db.unpublished_index_slots().unwrap(), []);
    survivor
        .run(3, |x| x.insert(&t, 100, val(8)))
        .expect("key 100 can be inserted once settled");
    let mut x = survivor.begin().unwrap();
    assert_eq!(num(x.get(&t, 100).unwrap()), 8);
    drop(x);
    assert!(db.locked_records().unwrap().is_empty());
    assert_eq!(db.unpublished_index_slots().unwrap(), []);
    (db, t, claimer)
}

/// A commit dies between its index claim and the address on durable servers, and
/// another insert into the same index bucket persists the bucket (with the claim) and
/// the arena counter, not the dead commit's block, which nothing persists. Then the
/// key's server restarts (alone, or with server 0: the repair then resolves every
/// lock) before any recovery ran: the claim comes back without the block, so no lock
/// names the claimer and no resolve settles the slot. Before, the key stayed
/// unreadable and uninsertable for good; the restart repair settles it now (a lookup
/// past the lock patience would too).
#[test]
fn a_restart_that_keeps_a_dead_claim_but_not_its_block_leaves_the_key_usable() {
    for first in [false, true] {
        let mut cluster = common::sim::Cluster::new(2);
        let restarted;
        {
            let db = cluster.open();
            let t = common::sim::accounts(&db);
            let part = t.partition_of(100);
            let p = &t.partitions[part];
            restarted = if first || p.server == 0 {
                vec![0, 1]
            } else {
                vec![p.server]
            };
            let neighbour = (101..)
                .find(|&k| {
                    t.partition_of(k) == part
                        && p.index.shape.bucket_of(k) == p.index.shape.bucket_of(100)
                })
                .unwrap();
            die_after_claiming(&db, &t, false);
            db.client()
                .unwrap()
                .run(3, |x| x.insert(&t, neighbour, val(1)))
                .unwrap();
            assert_eq!(db.unpublished_index_slots().unwrap().len(), 1);
            // The nodes go with the servers' restart.
            std::mem::forget(db);
        }
        cluster.restart(&restarted);
        let db = cluster.open();
        let report = db.restart_report().expect("a restart recovery ran");
        assert_eq!(report.restarted, restarted);
        let t = db.table("accounts").unwrap();
        assert!(db.locked_records().unwrap().is_empty(), "{restarted:?}");
        // The claim came back (the neighbour's persist), its block did not: the
        // repair settled it.
        assert_eq!(report.claims_settled, 1, "{report:?}");
        assert_eq!(db.unpublished_index_slots().unwrap(), [], "{restarted:?}");
        assert_eq!(
            read_until_settled(&db, &t),
            None,
            "{restarted:?}: the dead insert is gone"
        );
        assert_eq!(db.unpublished_index_slots().unwrap(), [], "{restarted:?}");
        let mut c = db.client().unwrap();
        c.run(3, |x| x.insert(&t, 100, val(8)))
            .expect("key 100 can be inserted after the restart");
        let mut x = c.begin().unwrap();
        assert_eq!(num(x.get(&t, 100).unwrap()), 8, "{restarted:?}");
        drop(x);
        assert!(db.locked_records().unwrap().is_empty(), "{restarted:?}");
    }
}
