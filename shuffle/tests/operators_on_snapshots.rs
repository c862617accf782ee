//! The analytical operators fed by snapshot scans while transactions commit: two
//! analytics nodes scan their shares of two txn tables at one shared read timestamp,
//! then aggregate and join them over the shuffle with every algorithm. Each result
//! must equal the straightforward single-node computation on the same snapshot (one
//! scanner reading everything at that RID), round after round while transfers and
//! group moves commit on other threads.

use fabric::Device;
use fabric::sim::{SimConfig, SimNetwork};
use shuffle::ops::aggregate::{self, AggConfig, Input};
use shuffle::ops::join::{self, JoinConfig, RowSummary, Tuple};
use shuffle::ops::scan::{self, ScanConfig, ScanError, Scanner};
use shuffle::{LocalExchange, Node};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;
use txn::runtime::block_on;
use txn::{Database, Options, Snapshot, Table, TableSpec};

const ORDERS: u64 = 300;
const GROUPS: u64 = 12;
const NODES: usize = 2;

/// An order row: its group and amount.
fn order(group: u64, amount: i64) -> Vec<u8> {
    let mut v = group.to_le_bytes().to_vec();
    v.extend_from_slice(&amount.to_le_bytes());
    v
}

fn decode(v: &[u8]) -> (u64, i64) {
    (
        u64::from_le_bytes(v[..8].try_into().unwrap()),
        i64::from_le_bytes(v[8..16].try_into().unwrap()),
    )
}

fn table(db: &Database, name: &str, capacity: u64) -> Arc<Table> {
    db.create_table(TableSpec {
        versions: 4,
        partitions: 2,
        ..TableSpec::new(name, 16, capacity)
    })
    .unwrap()
}

/// One side's rows at a snapshot: orders as (group, amount), groups as (group, label).
struct Rows {
    orders: Vec<(u64, i64)>,
    groups: Vec<(u64, i64)>,
}

fn scan_share(
    snapshot: &Snapshot<'_>,
    tables: (&Table, &Table),
    scanner: Scanner,
    config: &ScanConfig,
) -> Result<Rows, ScanError> {
    let mut rows = Rows {
        orders: Vec::new(),
        groups: Vec::new(),
    };
    scan::scan_blocking(snapshot, tables.0, scanner, config, |r| {
        rows.orders.push(decode(r.value));
        Ok(())
    })?;
    scan::scan_blocking(snapshot, tables.1, scanner, config, |r| {
        rows.groups.push((r.key, decode(r.value).1));
        Ok(())
    })?;
    Ok(rows)
}

/// At one fresh RID: every row (one scanner alone) and each node's share (scanned by a
/// reader of its own at that RID, as a node of its own would). The writers may
/// overwrite a version the scans still need, on a slow machine; the scans then fail
/// with `SnapshotTooOld` (never a wrong row), and the round starts over at a newer
/// RID, as an analytics query would.
fn scan_round(
    db: &Database,
    tables: (&Table, &Table),
    config: &ScanConfig,
) -> (u64, Rows, Vec<Rows>) {
    let mut too_old = 0;
    loop {
        let attempt = || -> Result<(u64, Rows, Vec<Rows>), ScanError> {
            let reader = db.reader().unwrap();
            let snapshot = block_on(reader.snapshot()).unwrap();
            let rid = snapshot.rid();
            let all = scan_share(&snapshot, tables, Scanner::ALONE, config)?;
            let mut shares = Vec::with_capacity(NODES);
            for rank in 0..NODES {
                let reader = db.reader().unwrap();
                let snapshot = block_on(reader.snapshot_at(rid)).unwrap();
                let scanner = Scanner::new(rank, NODES, 0, 1).unwrap();
                shares.push(scan_share(&snapshot, tables, scanner, config)?);
            }
            Ok((rid, all, shares))
        };
        match attempt() {
            Ok(round) => return round,
            Err(ScanError::SnapshotTooOld { .. }) if too_old < 50 => too_old += 1,
            Err(e) => panic!("scan after {too_old} too-old snapshots: {e}"),
        }
    }
}

fn tuples(rows: &[(u64, i64)]) -> Vec<Tuple> {
    rows.iter().map(|&(k, v)| [k, v as u64]).collect()
}

#[test]
fn aggregates_and_joins_of_live_snapshots_equal_single_node_answers() {
    let db = Database::embedded(Options {
        sim: SimConfig::default(),
        servers: 2,
        server_bytes: 32 << 20,
        ..Options::default()
    })
    .unwrap();
    let orders = table(&db, "orders", 512);
    let groups = table(&db, "groups", 64);
    let mut c = db.client().unwrap();
    c.run(0, |x| {
        for k in 0..ORDERS {
            x.insert(&orders, k, order(k % GROUPS, 100 + k as i64))?;
        }
        // Groups 0..GROUPS-2 exist; the last one has orders but no group row.
        for g in 0..GROUPS - 1 {
            x.insert(&groups, g, order(g, -(g as i64) * 7))?;
        }
        Ok(())
    })
    .unwrap();

    let stop = AtomicBool::new(false);
    let commits = AtomicU64::new(0);
    let scan_config = ScanConfig {
        stripe_bytes: 7 * orders.shape.block_bytes(),
        ..ScanConfig::default()
    };
    std::thread::scope(|s| {
        // Transfers between orders and moves between groups, all the time.
        for seed in 0..2u64 {
            let (db, orders, stop, commits) = (&db, &orders, &stop, &commits);
            s.spawn(move || {
                let mut c = db.client().unwrap();
                let mut i = seed;
                while !stop.load(Ordering::Relaxed) {
                    i = i
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    let (a, b) = ((i >> 20) % ORDERS, (i >> 40) % ORDERS);
                    if a == b {
                        continue;
                    }
                    let moved = c.run(5, |x| {
                        let (ga, va) = decode(&x.get(orders, a)?.expect("order a"));
                        let (gb, vb) = decode(&x.get(orders, b)?.expect("order b"));
                        x.put(orders, a, order(ga, va - 5))?;
                        x.put(orders, b, order((gb + i % 3) % GROUPS, vb + 5))
                    });
                    if moved.is_ok() {
                        commits.fetch_add(1, Ordering::Relaxed);
                    }
                }
            });
        }

        // Stops the writers however this thread leaves the scope: a failed assertion
        // must fail the test, not wait forever for them.
        struct StopOnDrop<'a>(&'a AtomicBool);
        impl Drop for StopOnDrop<'_> {
            fn drop(&mut self) {
                self.0.store(true, Ordering::Relaxed);
            }
        }
        let _stop_writers = StopOnDrop(&stop);
        let mut last_commits = 0;
        for round in 0..3 {
            // Let some transactions commit between rounds.
            while commits.load(Ordering::Relaxed) < last_commits + 20 {
                std::thread::sleep(Duration::from_millis(1));
            }
            last_commits = commits.load(Ordering::Relaxed);
            let (rid, all, shares) = scan_round(&db, (&orders, &groups), &scan_config);
            assert_eq!(all.orders.len() as u64, ORDERS);
            let shared: usize = shares.iter().map(|r| r.orders.len()).sum();
            assert_eq!(shared as u64, ORDERS, "the shares cover every order once");

            // The single-node answers on this snapshot.
            let mut want_groups: BTreeMap<u64, (i128, u64, i64, i64)> = BTreeMap::new();
            for &(g, v) in &all.orders {
                let e = want_groups.entry(g).or_insert((0, 0, i64::MAX, i64::MIN));
                e.0 += v as i128;
                e.1 += 1;
                e.2 = e.2.min(v);
                e.3 = e.3.max(v);
            }
            let total: i128 = want_groups.values().map(|e| e.0).sum();
            assert_eq!(total, (0..ORDERS as i128).map(|k| 100 + k).sum::<i128>());
            let mut want_join = RowSummary::default();
            join::reference_join(&tuples(&all.groups), &tuples(&all.orders), &mut want_join);

            // The distributed answers: each node scans its share at the same RID.
            let net = SimNetwork::new(SimConfig::default());
            let exchanges = LocalExchange::group(NODES, Duration::from_secs(30));
            let per_node: Vec<_> = std::thread::scope(|s| {
                let hs: Vec<_> = exchanges
                    .into_iter()
                    .zip(&shares)
                    .map(|(x, mine)| {
                        let device: Arc<dyn Device> = net.add_node();
                        s.spawn(move || {
                            let node = Node::join(device, Arc::new(x), 1 << 30).unwrap();
                            let keys: Vec<u64> = mine.orders.iter().map(|o| o.0).collect();
                            let values: Vec<i64> = mine.orders.iter().map(|o| o.1).collect();
                            let mut aggregated = Vec::new();
                            for algorithm in aggregate::Algorithm::ALL {
                                let out = aggregate::aggregate(
                                    &node,
                                    algorithm,
                                    Input::new(&keys, &values).unwrap(),
                                    &AggConfig::default(),
                                )
                                .unwrap_or_else(|e| panic!("{algorithm}: {e}"));
                                let groups: Vec<(u64, (i128, u64, i64, i64))> = out
                                    .groups
                                    .iter()
                                    .map(|(k, st)| (k, (st.sum, st.count, st.min, st.max)))
                                    .collect();
                                aggregated.push((algorithm, groups));
                            }
                            let mut joined = Vec::new();
                            for algorithm in join::Algorithm::ALL {
                                let (summary, _) = join::join_summary(
                                    &node,
                                    algorithm,
                                    &tuples(&mine.groups),
                                    &tuples(&mine.orders),
                                    &JoinConfig::default(),
                                )
                                .unwrap_or_else(|e| panic!("{algorithm}: {e}"));
                                joined.push((algorithm, summary));
                            }
                            (aggregated, joined)
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect()
            });

            for (i, algorithm) in aggregate::Algorithm::ALL.iter().enumerate() {
                let mut got = BTreeMap::new();
                for (aggregated, _) in &per_node {
                    for &(k, st) in &aggregated[i].1 {
                        assert!(got.insert(k, st).is_none(), "{algorithm}: group {k} twice");
                    }
                }
                assert_eq!(got, want_groups, "{algorithm}, round {round}, rid {rid}");
            }
            for (i, algorithm) in join::Algorithm::ALL.iter().enumerate() {
                let mut got = RowSummary::default();
                for (_, joined) in &per_node {
                    got.merge(&joined[i].1);
                }
                assert_eq!(got, want_join, "{algorithm}, round {round}, rid {rid}");
            }
        }
    });
    assert!(
        commits.load(Ordering::Relaxed) >= 60,
        "transactions ran meanwhile"
    );
}
