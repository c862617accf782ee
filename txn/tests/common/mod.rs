//! What the recovery test binaries share: a small two-server database with short
//! leases and an accounts table, and ([`sim`]) durable servers a test can restart.

#![allow(dead_code)]

pub mod sim;

use std::sync::Arc;
use std::time::Duration;
use txn::index::IndexShape;
use txn::{Database, Options, Table, TableSpec};

pub fn val(n: i64) -> Vec<u8> {
    n.to_le_bytes().to_vec()
}

pub fn num(v: Option<Vec<u8>>) -> i64 {
    i64::from_le_bytes(v.expect("present")[..8].try_into().unwrap())
}

/// [`database`] with 16 slots and accounts 0..8 at 100.
pub fn cluster() -> (Database, Arc<Table>) {
    with_accounts(16)
}

/// [`database`] with `slots` slots and accounts 0..8 at 100.
pub fn with_accounts(slots: u32) -> (Database, Arc<Table>) {
    let (db, t) = database(slots);
    let mut c = db.client().unwrap();
    c.run(0, |x| {
        for k in 0..8 {
            x.insert(&t, k, val(100))?;
        }
        Ok(())
    })
    .unwrap();
    (db, t)
}

/// Two servers, `slots` oracle slots, short leases, and an empty accounts table.
pub fn database(slots: u32) -> (Database, Arc<Table>) {
    let db = Database::embedded(Options {
        servers: 2,
        server_bytes: 64 << 20,
        slots,
        oracle: short_leases(),
        wait_visible: false,
        ..Options::default()
    })
    .unwrap();
    let t = db
        .create_table(TableSpec {
            name: "accounts".into(),
            versions: 4,
            value_cap: 16,
            capacity: 256,
            partitions: 0,
            placement: txn::Placement::RoundRobin,
            index: IndexShape {
                buckets: 32,
                slots: 8,
            },
        })
        .unwrap();
    (db, t)
}

/// Oracle leases of 80 ms, ticks every 2 ms: a stalled or dead holder is fenced soon.
pub fn short_leases() -> timestamp::OracleConfig {
    timestamp::OracleConfig {
        tick_interval: Duration::from_millis(2),
        lease_timeout: Duration::from_millis(80),
        ..timestamp::OracleConfig::default()
    }
}
