//! A node killed mid-insert, between the two doorbells of a batched insert (the index
//! claim, then the address). In its own test binary: the crash points of the other
//! recovery tests (`txn::crash::panic_at_on_this_thread`) arm the process for good,
//! and armed, every insert goes one step at a time, so no commit would die between
//! the claim and the address here.

mod common;

use common::{cluster, num, val};
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::{Duration, Instant};
use txn::{Database, Table};

/// A node's commit (inserting key 100, and moving 10 out of account 1 if `also_put`)
/// dies between its index claim and the address: the node is gone.
fn die_after_claiming(db: &Database, t: &Arc<Table>, also_put: bool) {
    let (db, t) = (db.clone(), t.clone());
    std::thread::spawn(move || {
        let mut client = db.client().unwrap();
        // A stall (unlike the crash points) keeps the commit's batched steps; dying in
        // it is dying between the claim's doorbell and the address's.
        txn::crash::stall_at_on_this_thread(
            "after-insert-blocks",
            Box::new(|_| panic!("the node dies after its index claim")),
        )
        .unwrap();
        let died = std::panic::catch_unwind(AssertUnwindSafe(|| {
            let mut x = client.begin().unwrap();
            if also_put {
                let a = num(x.get(&t, 1).unwrap());
                x.put(&t, 1, val(a - 10)).unwrap();
            }
            x.insert(&t, 100, val(7)).unwrap();
            x.commit()
        }));
        assert!(died.is_err(), "the stall did not run: {died:?}");
        std::mem::forget(client);
    })
    .join()
    .unwrap();
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
