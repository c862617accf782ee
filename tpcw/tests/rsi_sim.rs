//! TPC-W on RSI over an embedded sim cluster: load, every mix, and the checks.

use std::time::Duration;
use tpcw::interactions::{Interaction, Mix};
use tpcw::rsi::{Room, Rsi};
use tpcw::runner::{self, Ledger, RunConfig};
use tpcw::schema::{Rel, Scale};
use tpcw::system::System;
use txn::{Database, Options};

fn system(scale: &Scale, seconds: f64) -> Rsi {
    // Room for every mix the tests run: checkout makes the most orders, the ordering
    // mix the most of the rest.
    let (checkout, ordering) = (
        Room::for_runs(Mix::Checkout, seconds, 200_000.0, 64),
        Room::for_runs(Mix::Ordering, seconds, 200_000.0, 64),
    );
    let room = Room {
        orders: checkout.orders.max(ordering.orders),
        order_lines: checkout.order_lines.max(ordering.order_lines),
        cc_xacts: checkout.cc_xacts.max(ordering.cc_xacts),
        customers: checkout.customers.max(ordering.customers),
        carts: checkout.carts.max(ordering.carts),
    };
    let bytes = tpcw::rsi::bytes_needed(scale, &room, 2).unwrap();
    let scratch_bytes = tpcw::rsi::scratch_bytes(scale, &room, 2).unwrap();
    let db = Database::embedded(Options {
        servers: 2,
        server_bytes: bytes / 2 + bytes / 4 + (32 << 20),
        slots: 8,
        scratch_bytes,
        log_bytes_per_slot: scratch_bytes.max(Options::default().log_bytes_per_slot),
        ..Options::default()
    })
    .unwrap();
    let mut rsi = Rsi::new(db, "sim".into(), room, Box::new(()));
    rsi.create_tables(scale).unwrap();
    let loaded = std::sync::Mutex::new(std::collections::BTreeMap::new());
    rsi.load(scale, &|rel, done, total| {
        loaded.lock().unwrap().insert(rel, (done, total));
    })
    .unwrap();
    let loaded = loaded.into_inner().unwrap();
    assert_eq!(loaded[&Rel::Item], (scale.items, scale.items));
    assert_eq!(loaded[&Rel::Orders], (scale.orders(), scale.orders()));
    rsi
}

fn config(mix: Mix, clients: usize) -> RunConfig {
    RunConfig {
        mix,
        clients,
        threads: 2,
        warmup: Duration::from_millis(100),
        duration: Duration::from_millis(1500),
        sample_every: 7,
        progress: false,
        seed: 42,
    }
}

#[test]
fn every_mix_runs_and_passes_the_checks() {
    let scale = Scale::new(1000, 1, 1024).unwrap();
    let rsi = system(&scale, 8.0);
    let mut ledger = Ledger::default();
    for (mix, clients) in [
        (Mix::Checkout, 8),
        (Mix::Ordering, 6),
        (Mix::Shopping, 4),
        (Mix::Browsing, 4),
    ] {
        let report = runner::run(&rsi, &scale, &config(mix, clients), &mut ledger).unwrap();
        assert!(report.committed > 50, "{mix:?}: {report:?}");
        assert!(report.checks.stock_conserved, "{report:?}");
        assert!(report.checks.orders_present, "{report:?}");
        assert_eq!(
            report.checks.history_verdict.as_deref(),
            Some("valid"),
            "{report:?}"
        );
        assert!(report.checks.history_txns > 10, "{report:?}");
        assert!(report.checks.items_checked > 0);
        if mix == Mix::Checkout {
            assert_eq!(report.interactions.len(), 1);
            assert_eq!(report.interactions[0].interaction, Interaction::Checkout);
            // 1000 items, 3 per checkout: the stock rule restocks many times.
            assert!(ledger.sold.values().any(|&(_, restocks)| restocks > 0));
        } else {
            assert!(
                report.interactions.len() >= 8,
                "{mix:?}: {:?}",
                report.interactions
            );
        }
    }
    // Each run took new client streams.
    assert_eq!(ledger.orders.len(), 8 + 6 + 4 + 4);
}

/// Admin Confirm and Best Sellers find each stream's newest order by probing ids that
/// may not exist yet, so an order inserted after a reader's snapshot must read as
/// absent there. With one version per ORDERS block the insert cannot say "absent
/// before", the probe aborts with `SnapshotTooOld`, and under the ordering mix Admin
/// Confirm aborted 99% of its attempts, retrying for up to a second.
#[test]
fn an_order_inserted_after_a_snapshot_reads_as_absent_in_it() {
    let scale = Scale::new(1000, 1, 1024).unwrap();
    let rsi = system(&scale, 1.0);
    let orders = &rsi.tables()[Rel::Orders.index()];
    let (mut reader, mut writer) = (
        rsi.database().client().unwrap(),
        rsi.database().client().unwrap(),
    );
    // A stream no run uses.
    let key = tpcw::schema::stream_id(1 << 20, 0);
    let mut old = reader.begin().unwrap();
    let mut insert = writer.begin().unwrap();
    insert.insert(orders, key, vec![7; 40]).unwrap();
    insert.commit().unwrap();
    assert_eq!(old.get(orders, key).unwrap(), None);
    old.commit().unwrap();
    let mut new = reader.begin().unwrap();
    assert_eq!(new.get(orders, key).unwrap(), Some(vec![7; 40]));
}
