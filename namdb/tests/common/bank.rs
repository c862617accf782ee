//! A bank of accounts on a database opened through memory-server processes, for the
//! tests that kill memory servers: transfers with an insert now and then, and the
//! state a snapshot sees, to compare before and after a kill.

use compute_node::memory_servers::{RemoteCluster, connect};
use memory_server::ClusterToken;
use std::sync::Arc;
use txn::index::IndexShape;
use txn::{Options, Table, TableSpec};

/// Accounts; inserts go to keys 1000..1100.
pub const KEYS: u64 = 24;
/// Each account's opening balance.
pub const OPENING: i64 = 1000;

/// Opens the database on the memory servers at `addrs`.
pub fn open(addrs: &[String], token: &ClusterToken) -> RemoteCluster {
    connect(
        addrs,
        token,
        Options {
            wait_visible: false,
            ..Options::default()
        },
    )
    .unwrap()
}

pub fn val(n: i64) -> Vec<u8> {
    n.to_le_bytes().to_vec()
}

pub fn num(v: Option<Vec<u8>>) -> i64 {
    i64::from_le_bytes(v.expect("present")[..8].try_into().unwrap())
}

/// Creates the `accounts` table with [`KEYS`] accounts of [`OPENING`].
pub fn create(cluster: &RemoteCluster) -> Arc<Table> {
    let t = cluster
        .db
        .create_table(TableSpec {
            name: "accounts".into(),
            versions: 4,
            value_cap: 16,
            capacity: 4096,
            partitions: 0,
            placement: txn::Placement::RoundRobin,
            index: IndexShape {
                buckets: 256,
                slots: 8,
            },
        })
        .unwrap();
    let mut c = cluster.db.client().unwrap();
    c.run(0, |x| {
        for k in 0..KEYS {
            x.insert(&t, k, val(OPENING))?;
        }
        Ok(())
    })
    .unwrap();
    t
}

/// Every key's value as a snapshot sees it.
pub fn state(cluster: &RemoteCluster, t: &Arc<Table>) -> Vec<Option<Vec<u8>>> {
    let mut c = cluster.db.client().unwrap();
    let mut x = c.begin().unwrap();
    (0..KEYS)
        .chain(1000..1100)
        .map(|k| x.get(t, k).unwrap())
        .collect()
}

/// The sum of the accounts in `state`.
pub fn total(state: &[Option<Vec<u8>>]) -> i64 {
    state[..KEYS as usize].iter().map(|v| num(v.clone())).sum()
}

/// Transfers between accounts, with an insert now and then: `rounds` commits.
/// Returns the last CID.
pub fn work(cluster: &RemoteCluster, t: &Arc<Table>, from_round: u64, rounds: u64) -> u64 {
    let mut c = cluster.db.client().unwrap();
    for i in from_round..from_round + rounds {
        let (a, b) = (i % KEYS, (i * 5 + 1) % KEYS);
        if a == b {
            continue;
        }
        c.run(10, |x| {
            let va = num(x.get(t, a)?);
            let vb = num(x.get(t, b)?);
            x.put(t, a, val(va - 3))?;
            x.put(t, b, val(vb + 3))?;
            if i % 7 == 0 {
                x.insert(t, 1000 + i % 100, val(i as i64))
                    .or_else(|e| match e {
                        txn::TxnError::DuplicateKey { .. } => Ok(()),
                        e => Err(e),
                    })?;
            }
            Ok(())
        })
        .unwrap();
    }
    c.last_cid()
}
