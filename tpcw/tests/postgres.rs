//! `tpcw::postgres` against a real server, started once for the whole binary through
//! `scripts/postgres.sh` in a scratch directory (stopped and deleted when the binary
//! exits). Each test works in a database of its own, so they run in parallel.

use std::collections::HashMap;
use std::future::Future;
use std::pin::pin;
use std::sync::{Barrier, Mutex, OnceLock};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};
use tpcw::generate;
use tpcw::load::UNITS;
use tpcw::postgres::{LocalServer, Postgres, Script};
use tpcw::schema::*;
use tpcw::system::{AbortReason, Engine, Error, Session, System};

struct Shared {
    conn_str: String,
    _server: LocalServer,
}

fn server() -> &'static Shared {
    static SERVER: OnceLock<Result<Shared, String>> = OnceLock::new();
    let shared = SERVER.get_or_init(|| {
        let (_, server) = Postgres::start_scratch(&Script::BuiltIn(&tpcw::postgres::BUILT_IN))
            .map_err(|e| e.to_string())?;
        Ok(Shared {
            conn_str: server.connection_string().to_string(),
            _server: server,
        })
    });
    match shared {
        Ok(shared) => shared,
        Err(e) => panic!("cannot start PostgreSQL: {e}"),
    }
}

fn conn_str_of(name: &str) -> String {
    let base = &server().conn_str;
    let conn_str = base.replace("dbname=tpcw", &format!("dbname={name}"));
    assert_ne!(
        &conn_str, base,
        "the script's connection string names dbname=tpcw"
    );
    conn_str
}

/// A fresh database `name` with empty tables.
fn database(name: &str) -> Postgres {
    // CREATE DATABASE copies template1, which must be idle: one at a time.
    static CREATING: Mutex<()> = Mutex::new(());
    {
        let _one = CREATING.lock().unwrap_or_else(|e| e.into_inner());
        let mut admin = postgres::Client::connect(&server().conn_str, postgres::NoTls).unwrap();
        admin
            .batch_execute(&format!("DROP DATABASE IF EXISTS {name}"))
            .unwrap();
        admin
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .unwrap();
    }
    let pg = Postgres::connect(&conn_str_of(name)).unwrap();
    pg.create_schema().unwrap();
    pg
}

/// The system's futures never wait, so one poll completes them.
fn now<F: Future>(future: F) -> F::Output {
    let mut future = pin!(future);
    match future
        .as_mut()
        .poll(&mut Context::from_waker(Waker::noop()))
    {
        Poll::Ready(output) => output,
        Poll::Pending => panic!("a PostgreSQL future was not ready at its first poll"),
    }
}

fn reason(outcome: Result<impl std::fmt::Debug, Error>) -> AbortReason {
    match outcome {
        Err(Error::Aborted { reason, .. }) => reason,
        other => panic!("expected an abort, got {other:?}"),
    }
}

/// Commits a transaction that writes `row` at `key` with `put`.
fn put_committed<E: Engine>(engine: &E, rel: Rel, key: u64, row: &[u8]) {
    let mut txn = now(engine.begin(0)).unwrap();
    now(txn.put(rel, key, row.to_vec())).unwrap();
    now(engine.commit(txn)).unwrap();
}

fn get_committed<E: Engine>(engine: &E, rel: Rel, key: u64) -> Option<Vec<u8>> {
    let mut txn = now(engine.begin(0)).unwrap();
    let row = now(txn.get(rel, key)).unwrap();
    now(engine.commit(txn)).unwrap();
    row
}

fn scale() -> Scale {
    Scale::new(1000, 1, 1024).unwrap()
}

/// For each relation: a key, a row for it, and a different row for the same key.
fn samples() -> Vec<(Rel, u64, Vec<u8>, Vec<u8>)> {
    let s = scale();
    let mut out = Vec::new();
    // The largest key PostgreSQL's BIGINT holds.
    let co_id = i64::MAX as u64;
    let country = Country {
        co_id,
        ..generate::country(7)
    };
    let changed = Country {
        co_exchange: 0.1 + 0.2,
        co_currency: "Ünïcode €".into(),
        ..country.clone()
    };
    out.push((Rel::Country, co_id, country.encode(), changed.encode()));
    let author = generate::author(3);
    let changed = Author {
        a_dob: i64::MIN,
        ..author.clone()
    };
    out.push((Rel::Author, 3, author.encode(), changed.encode()));
    let item = generate::item(&s, 5);
    let mut changed = item.encode();
    Item::set_stock(&mut changed, -7).unwrap();
    out.push((Rel::Item, 5, item.encode(), changed));
    // A customer registered during a run, with the longest user name a stream id makes.
    let c_id = stream_id((1 << 27) - 2, 4);
    let customer = generate::registered_customer(&s, c_id, 11, 9, generate::NOW);
    assert_eq!(customer.c_uname.len(), UNAME_MAX as usize);
    let changed = Customer {
        c_balance: -12_345,
        c_last_o_id: stream_id(9, 5),
        c_discount: i32::MAX as u32,
        ..customer.clone()
    };
    out.push((Rel::Customer, c_id, customer.encode(), changed.encode()));
    let address = generate::address(&s, 11);
    let changed = Address {
        addr_street2: String::new(),
        ..address.clone()
    };
    out.push((Rel::Address, 11, address.encode(), changed.encode()));
    let (order, lines, cc) = generate::order(&s, 4);
    let changed = Order {
        o_status: "SHIPPED".into(),
        o_ship_date: order.o_ship_date + 1,
        ..order.clone()
    };
    out.push((Rel::Orders, 4, order.encode(), changed.encode()));
    let line = lines.last().unwrap().clone();
    let changed = OrderLine {
        ol_qty: 0,
        ol_comments: "x".repeat(100),
        ..line.clone()
    };
    let key = order_line_key(4, line.ol_id);
    out.push((Rel::OrderLine, key, line.encode(), changed.encode()));
    let changed = CcXact {
        cx_xact_amt: cc.cx_xact_amt * 2,
        ..cc.clone()
    };
    out.push((Rel::CcXacts, 4, cc.encode(), changed.encode()));
    let sc_id = stream_id(3, 1);
    let cart = ShoppingCart {
        sc_id,
        sc_time: generate::NOW,
        sc_num_lines: 2,
    };
    let changed = ShoppingCart {
        sc_num_lines: 3,
        ..cart.clone()
    };
    out.push((Rel::ShoppingCart, sc_id, cart.encode(), changed.encode()));
    let cart_line = ShoppingCartLine {
        scl_sc_id: sc_id,
        scl_qty: 3,
        scl_i_id: 17,
    };
    let changed = ShoppingCartLine {
        scl_qty: 4,
        ..cart_line.clone()
    };
    let key = cart_line_key(sc_id, 1);
    out.push((
        Rel::ShoppingCartLine,
        key,
        cart_line.encode(),
        changed.encode(),
    ));
    let newest = generate::new_products(&s)[5].clone();
    let mut changed = newest.clone();
    changed.publish(generate::NOW + 1, 7);
    out.push((
        Rel::NewProducts,
        newest.np_subject,
        newest.encode(),
        changed.encode(),
    ));
    out
}

#[test]
fn every_relation_round_trips_through_put_get_get_many_and_delete() {
    let pg = database("round_trip");
    let engine = pg.engine(0).unwrap();
    let samples = samples();
    assert_eq!(samples.len(), Rel::ALL.len());
    for (rel, key, row, changed) in samples {
        let missing = key ^ 16;
        let what = rel.name();
        let mut txn = now(engine.begin(0)).unwrap();
        assert_eq!(now(txn.get(rel, key)).unwrap(), None, "{what}");
        now(txn.insert(rel, key, row.clone())).unwrap();
        assert_eq!(
            now(txn.get(rel, key)).unwrap(),
            Some(row.clone()),
            "{what}: own insert"
        );
        now(engine.commit(txn)).unwrap();

        let mut txn = now(engine.begin(0)).unwrap();
        assert_eq!(
            now(txn.get(rel, key)).unwrap().as_ref(),
            Some(&row),
            "{what}"
        );
        assert_eq!(
            now(txn.get_many(rel, &[key, missing, key])).unwrap(),
            vec![Some(row.clone()), None, Some(row.clone())],
            "{what}"
        );
        assert_eq!(
            now(txn.get_many(rel, &[])).unwrap(),
            Vec::<Option<Vec<u8>>>::new()
        );
        now(txn.put(rel, key, changed.clone())).unwrap();
        assert_eq!(
            now(txn.get(rel, key)).unwrap().as_ref(),
            Some(&changed),
            "{what}"
        );
        now(engine.commit(txn)).unwrap();
        assert_eq!(
            get_committed(&engine, rel, key).as_ref(),
            Some(&changed),
            "{what}"
        );

        // put of an absent row inserts it.
        let mut txn = now(engine.begin(0)).unwrap();
        now(txn.delete(rel, key)).unwrap();
        assert_eq!(now(txn.get(rel, key)).unwrap(), None, "{what}: own delete");
        now(txn.put(rel, key, row.clone())).unwrap();
        now(engine.commit(txn)).unwrap();
        assert_eq!(
            get_committed(&engine, rel, key).as_ref(),
            Some(&row),
            "{what}"
        );

        let mut txn = now(engine.begin(0)).unwrap();
        now(txn.delete(rel, key)).unwrap();
        now(txn.delete(rel, missing)).unwrap();
        now(engine.commit(txn)).unwrap();
        let mut txn = now(engine.begin(0)).unwrap();
        assert_eq!(
            now(txn.get_many(rel, &[key])).unwrap(),
            vec![None],
            "{what}"
        );
        now(engine.commit(txn)).unwrap();

        // A row stored under a key it does not belong to is refused.
        let mut txn = now(engine.begin(0)).unwrap();
        match now(txn.put(rel, missing, row.clone())) {
            Err(Error::Data(message)) => assert!(message.contains("cannot be stored"), "{message}"),
            other => panic!("{what}: a misplaced row gave {other:?}"),
        }
        engine.abort(txn);
    }
}

#[test]
fn values_beyond_bigint_and_bad_rows_are_refused() {
    let pg = database("beyond_bigint");
    let engine = pg.engine(0).unwrap();
    let mut txn = now(engine.begin(0)).unwrap();
    match now(txn.get(Rel::Item, 1 << 63)) {
        Err(Error::Data(message)) => assert!(message.contains("BIGINT"), "{message}"),
        other => panic!("key 2^63 gave {other:?}"),
    }
    let item = Item {
        i_a_id: u64::MAX,
        ..generate::item(&scale(), 1)
    };
    match now(txn.insert(Rel::Item, 1, item.encode())) {
        Err(Error::Data(message)) => assert!(message.contains("item.i_a_id"), "{message}"),
        other => panic!("an author id of 2^64 - 1 gave {other:?}"),
    }
    match now(txn.put(Rel::Item, 1, vec![1, 2, 3])) {
        Err(Error::Data(_)) => {}
        other => panic!("a row that does not decode gave {other:?}"),
    }
    let long_name = Country {
        co_name: "x".repeat(51),
        ..generate::country(1)
    };
    match now(txn.insert(Rel::Country, 1, long_name.encode())) {
        Err(Error::Data(message)) => assert!(message.contains("too long"), "{message}"),
        other => panic!("a 51-character country name gave {other:?}"),
    }
    engine.abort(txn);
    // The failed transaction left the engine usable.
    assert_eq!(get_committed(&engine, Rel::Country, 1), None);
}

#[test]
fn duplicate_insert_aborts_with_duplicate_key() {
    let pg = database("duplicate");
    let engine = pg.engine(0).unwrap();
    let row = generate::country(1).encode();
    let mut txn = now(engine.begin(0)).unwrap();
    now(txn.insert(Rel::Country, 1, row.clone())).unwrap();
    now(engine.commit(txn)).unwrap();

    let other = Country {
        co_id: 1,
        ..generate::country(2)
    }
    .encode();
    let mut txn = now(engine.begin(0)).unwrap();
    assert_eq!(
        reason(now(txn.insert(Rel::Country, 1, other.clone()))),
        AbortReason::DuplicateKey
    );
    // The transaction is over: later statements and the commit report the abort.
    assert_eq!(
        reason(now(txn.get(Rel::Country, 1))),
        AbortReason::DuplicateKey
    );
    assert_eq!(reason(now(engine.commit(txn))), AbortReason::DuplicateKey);

    // Twice in one transaction.
    let mut txn = now(engine.begin(0)).unwrap();
    let third = generate::country(2).encode();
    now(txn.insert(Rel::Country, 2, third.clone())).unwrap();
    assert_eq!(
        reason(now(txn.insert(Rel::Country, 2, third))),
        AbortReason::DuplicateKey
    );
    engine.abort(txn);

    assert_eq!(get_committed(&engine, Rel::Country, 1), Some(row));
    assert_eq!(get_committed(&engine, Rel::Country, 2), None);
}

#[test]
fn an_engine_runs_one_transaction_at_a_time() {
    let pg = database("one_at_a_time");
    let engine = pg.engine(0).unwrap();
    assert_eq!(pg.max_clients_per_thread(), 1);
    assert_eq!((pg.name(), pg.backend().as_str()), ("postgres", "tcp"));
    let txn = now(engine.begin(0)).unwrap();
    match now(engine.begin(0)) {
        Err(Error::System(message)) => assert!(message.contains("one transaction"), "{message}"),
        Err(e) => panic!("a second begin gave {e:?}"),
        Ok(_) => panic!("a second begin on one connection succeeded"),
    }
    engine.abort(txn);
    // Clients run one after another, their outputs in order.
    let outputs = engine.run_clients(3, |client| {
        let engine = &engine;
        Box::pin(async move {
            let mut txn = engine.begin(0).await?;
            let key = client as u64 + 1;
            txn.insert(Rel::Country, key, generate::country(key).encode())
                .await?;
            engine.commit(txn).await.map(|_| key)
        })
    });
    let outputs: Vec<u64> = outputs.into_iter().map(Result::unwrap).collect();
    assert_eq!(outputs, vec![1, 2, 3]);
}

#[test]
fn concurrent_updates_of_one_row_let_exactly_one_commit() {
    let pg = database("write_conflict");
    let item = generate::item(&scale(), 8);
    put_committed(&pg.engine(0).unwrap(), Rel::Item, 8, &item.encode());
    let with_stock = |stock| {
        let mut row = item.encode();
        Item::set_stock(&mut row, stock).unwrap();
        row
    };
    let both_read = Barrier::new(2);
    let first_wrote = Barrier::new(2);
    let (first, second) = std::thread::scope(|s| {
        let first = s.spawn(|| {
            let engine = pg.engine(0).unwrap();
            let mut txn = now(engine.begin(0)).unwrap();
            now(txn.get(Rel::Item, 8)).unwrap();
            both_read.wait();
            now(txn.put(Rel::Item, 8, with_stock(1))).unwrap();
            first_wrote.wait();
            // The second writer is now waiting for this one's row lock.
            std::thread::sleep(Duration::from_millis(300));
            now(engine.commit(txn)).map(|_| ())
        });
        let second = s.spawn(|| {
            let engine = pg.engine(1).unwrap();
            let mut txn = now(engine.begin(0)).unwrap();
            now(txn.get(Rel::Item, 8)).unwrap();
            both_read.wait();
            first_wrote.wait();
            let started = Instant::now();
            let outcome = now(txn.put(Rel::Item, 8, with_stock(2)));
            let waited = started.elapsed();
            let outcome = outcome.and_then(|()| now(engine.commit(txn)).map(|_| ()));
            (outcome, waited)
        });
        (first.join().unwrap(), second.join().unwrap())
    });
    first.unwrap();
    let (second, waited) = second;
    assert_eq!(reason(second), AbortReason::Conflict);
    assert!(
        waited >= Duration::from_millis(200),
        "waited only {waited:?}"
    );
    let engine = pg.engine(0).unwrap();
    let row = get_committed(&engine, Rel::Item, 8).unwrap();
    assert_eq!(Item::stock_of(&row).unwrap(), 1);
}

#[test]
fn a_deadlock_aborts_one_transaction_with_conflict() {
    let pg = database("deadlock");
    let engine = pg.engine(0).unwrap();
    for key in [1, 2] {
        put_committed(&engine, Rel::Country, key, &generate::country(key).encode());
    }
    let both_locked = Barrier::new(2);
    let outcomes: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = [(1u64, 2u64), (2, 1)]
            .into_iter()
            .enumerate()
            .map(|(thread, (mine, theirs))| {
                let (pg, both_locked) = (&pg, &both_locked);
                s.spawn(move || {
                    let engine = pg.engine(thread).unwrap();
                    let mut txn = now(engine.begin(0)).unwrap();
                    let changed = |key| {
                        Country {
                            co_name: format!("by {thread}"),
                            ..generate::country(key)
                        }
                        .encode()
                    };
                    now(txn.put(Rel::Country, mine, changed(mine))).unwrap();
                    both_locked.wait();
                    match now(txn.put(Rel::Country, theirs, changed(theirs))) {
                        Ok(()) => now(engine.commit(txn)).map(|_| ()),
                        Err(e) => {
                            engine.abort(txn);
                            Err(e)
                        }
                    }
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let committed = outcomes.iter().filter(|o| o.is_ok()).count();
    assert_eq!(committed, 1, "{outcomes:?}");
    for outcome in outcomes.into_iter().filter(Result::is_err) {
        assert_eq!(reason(outcome), AbortReason::Conflict);
    }
}

#[test]
fn a_snapshot_does_not_see_a_later_commit() {
    let pg = database("snapshot");
    let reader = pg.engine(0).unwrap();
    let writer = pg.engine(1).unwrap();
    let before = generate::country(5);
    let after = Country {
        co_name: "renamed".into(),
        ..before.clone()
    };
    put_committed(&writer, Rel::Country, 5, &before.encode());

    let mut old = now(reader.begin(0)).unwrap();
    assert_eq!(
        now(old.get(Rel::Country, 5)).unwrap(),
        Some(before.encode())
    );
    put_committed(&writer, Rel::Country, 5, &after.encode());
    put_committed(&writer, Rel::Country, 6, &generate::country(6).encode());
    assert_eq!(
        now(old.get(Rel::Country, 5)).unwrap(),
        Some(before.encode())
    );
    assert_eq!(
        now(old.get_many(Rel::Country, &[6, 5])).unwrap(),
        vec![None, Some(before.encode())]
    );
    // First committer wins: the snapshot's writer cannot overwrite the newer version.
    assert_eq!(
        reason(now(old.put(Rel::Country, 5, before.encode()))),
        AbortReason::Conflict
    );
    reader.abort(old);

    assert_eq!(
        get_committed(&reader, Rel::Country, 5),
        Some(after.encode())
    );
}

#[test]
fn the_loader_loads_every_generated_row() {
    let pg = database("load");
    let scale = scale();
    // A row the load must replace: it creates the tables afresh.
    put_committed(
        &pg.engine(0).unwrap(),
        Rel::Country,
        500,
        &generate::country(500).encode(),
    );
    let reported = Mutex::new(HashMap::new());
    let started = Instant::now();
    pg.load(&scale, &|rel, done, total| {
        let mut reported = reported.lock().unwrap();
        let (seen, _) = reported.entry(rel).or_insert((0, total));
        *seen = done.max(*seen);
    })
    .unwrap();
    eprintln!(
        "loaded items={} ebs={} in {:.2} s",
        scale.items,
        scale.ebs,
        started.elapsed().as_secs_f64()
    );
    let reported = reported.into_inner().unwrap();
    for unit in UNITS {
        assert_eq!(
            reported.get(&unit),
            Some(&(scale.rows(unit), scale.rows(unit))),
            "progress of {}",
            unit.name()
        );
    }

    let order_lines: u64 = (1..=scale.orders())
        .map(|o_id| u64::from(generate::order(&scale, o_id).0.o_num_lines))
        .sum();
    let mut client = postgres::Client::connect(&conn_str_of("load"), postgres::NoTls).unwrap();
    for rel in Rel::ALL {
        let expected = match rel {
            Rel::OrderLine => order_lines,
            _ => scale.rows(rel),
        };
        let count: i64 = client
            .query_one(&format!("SELECT COUNT(*) FROM {}", rel.name()), &[])
            .unwrap()
            .get(0);
        assert_eq!(count as u64, expected, "rows of {}", rel.name());
    }

    // Rows read back as generated, and the keys are in place.
    let engine = pg.engine(0).unwrap();
    let (order, lines, cc) = generate::order(&scale, scale.orders());
    let mut txn = now(engine.begin(0)).unwrap();
    let line_keys: Vec<u64> = lines
        .iter()
        .map(|l| order_line_key(order.o_id, l.ol_id))
        .collect();
    assert_eq!(
        now(txn.get_many(Rel::OrderLine, &line_keys)).unwrap(),
        lines.iter().map(|l| Some(l.encode())).collect::<Vec<_>>()
    );
    assert_eq!(
        now(txn.get(Rel::CcXacts, order.o_id)).unwrap(),
        Some(cc.encode())
    );
    assert_eq!(
        now(txn.get(Rel::Item, 17)).unwrap(),
        Some(generate::item(&scale, 17).encode())
    );
    assert_eq!(
        now(txn.get(Rel::Customer, scale.customers())).unwrap(),
        Some(generate::customer(&scale, scale.customers()).encode())
    );
    assert_eq!(
        reason(now(txn.insert(Rel::Orders, order.o_id, order.encode()))),
        AbortReason::DuplicateKey
    );
    engine.abort(txn);
}

#[test]
fn bad_connections_give_clear_errors() {
    let message = |conn_str: &str| match Postgres::connect(conn_str) {
        Err(Error::System(message)) => message,
        Err(e) => panic!("{conn_str}: {e:?}"),
        Ok(_) => panic!("{conn_str}: connected"),
    };
    let bad = message("host=127.0.0.1 port=notaport");
    assert!(
        bad.contains("invalid PostgreSQL connection string"),
        "{bad}"
    );

    let closed_port = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().port()
    };
    let refused = message(&format!(
        "host=127.0.0.1 port={closed_port} user=namdb dbname=tpcw"
    ));
    assert!(
        refused.contains(&format!(
            "cannot connect to PostgreSQL at namdb@127.0.0.1:{closed_port}/tpcw"
        )),
        "{refused}"
    );

    let no_database = message(&conn_str_of("no_such_database"));
    assert!(
        no_database.contains("cannot connect") && no_database.contains("no_such_database"),
        "{no_database}"
    );

    let dir = tempfile::tempdir().unwrap();
    match Postgres::start_local(&Script::File(dir.path().join("missing.sh")), dir.path()) {
        Err(Error::System(message)) => {
            assert!(message.contains("missing.sh start"), "{message}")
        }
        Err(e) => panic!("a missing script gave {e:?}"),
        Ok(_) => panic!("a missing script started a server"),
    }
}
