//! Read-only workers ([`txn::Database::reader`]): they read at snapshots like any
//! worker, hold no oracle slot, and so never hold back other workers' read
//! timestamps, however long they go without a tick.

use std::time::Duration;
use txn::{Database, Options, TableSpec, TxnError};

#[test]
fn a_reader_sees_commits_holds_back_nobody_and_cannot_write() {
    let db = Database::embedded(Options {
        oracle: timestamp::OracleConfig {
            tick_interval: Duration::from_millis(1),
            // A slot the reader held would stall every later read timestamp for this
            // long before anyone fenced it (and begin gives up after 10 s).
            lease_timeout: Duration::from_secs(120),
            ..timestamp::OracleConfig::default()
        },
        ..Options::default()
    })
    .unwrap();
    let t = db.create_table(TableSpec::new("t", 8, 64)).unwrap();
    let mut c = db.client().unwrap();
    c.run(0, |x| x.insert(&t, 1, 0u64.to_le_bytes().to_vec()))
        .unwrap();

    let reader = db.reader().unwrap();
    // The reader never ticks; every begin waits until the session's last commit is
    // visible, which a slot owned by the reader would prevent.
    for i in 1..=20u64 {
        c.run(0, |x| {
            let got = x.get(&t, 1)?.expect("present");
            assert_eq!(got, (i - 1).to_le_bytes().to_vec(), "sees its own commits");
            x.put(&t, 1, i.to_le_bytes().to_vec())
        })
        .unwrap();
    }

    assert!(reader.is_read_only());
    let mut x = txn::runtime::block_on(reader.begin(c.last_cid())).unwrap();
    assert_eq!(
        txn::runtime::block_on(x.get(&t, 1)).unwrap(),
        Some(20u64.to_le_bytes().to_vec())
    );
    txn::runtime::block_on(x.put(&t, 1, 99u64.to_le_bytes().to_vec())).unwrap();
    let err = txn::runtime::block_on(x.commit()).unwrap_err();
    assert!(
        matches!(&err, TxnError::Invalid(m) if m.contains("read-only")),
        "{err}"
    );
    // Read-only transactions commit (they take no timestamp).
    let mut x = txn::runtime::block_on(reader.begin(0)).unwrap();
    assert!(txn::runtime::block_on(x.get(&t, 1)).unwrap().is_some());
    assert_eq!(txn::runtime::block_on(x.commit()).unwrap(), None);
    drop(reader);
    // Dropping the reader released nothing that others needed.
    c.run(0, |x| x.put(&t, 1, 7u64.to_le_bytes().to_vec()))
        .unwrap();
}
