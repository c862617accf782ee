//! The 2PC system end to end, servers on threads of the test process (the `namdb`
//! crate's `twopc_processes` test runs them as processes).

use super::client::{Client, block_on};
use super::protocol::{MAX_FRAME_BYTES, RmResponse, TmResponse, decode};
use super::*;
use crate::generate;
use crate::load::UNITS;
use crate::schema::order_line_key;
use crate::system::{AbortReason, Engine, Session};
use std::io::{Read, Write as _};
use std::net::TcpStream;
use std::sync::Barrier;
use std::sync::atomic::{AtomicU64, Ordering};

fn cluster(resource_managers: usize) -> TwoPc {
    TwoPc::start(Launch::Threads, resource_managers).expect("the cluster starts")
}

fn reason(outcome: Result<impl std::fmt::Debug>) -> AbortReason {
    match outcome {
        Err(Error::Aborted { reason, .. }) => reason,
        other => panic!("expected an abort, got {other:?}"),
    }
}

/// `count` keys of `rel` owned by RM `rm` of `partitions`.
fn keys_on(rel: Rel, rm: usize, partitions: usize, count: usize) -> Vec<u64> {
    (1..)
        .filter(|&k| resource_manager_of(rel, k, partitions) == rm)
        .take(count)
        .collect()
}

fn commit_puts(client: &Client, rel: Rel, rows: &[(u64, &[u8])]) -> u64 {
    block_on(async {
        let mut txn = client.begin(0).await?;
        for &(key, row) in rows {
            txn.put(rel, key, row.to_vec()).await?;
        }
        client.commit(txn).await
    })
    .expect("commits")
    .cid
    .expect("a writer takes a CID")
}

#[test]
fn a_transaction_reads_its_own_writes() {
    let system = cluster(3);
    let client = system.client().unwrap();
    let rel = Rel::Item;
    let cid = block_on(async {
        let mut txn = client.begin(0).await?;
        txn.insert(rel, 1, b"one".to_vec()).await?;
        txn.put(rel, 2, b"two".to_vec()).await?;
        assert_eq!(txn.get(rel, 1).await?, Some(b"one".to_vec()));
        txn.delete(rel, 2).await?;
        assert_eq!(txn.get(rel, 2).await?, None);
        txn.put(rel, 1, b"uno".to_vec()).await?;
        assert_eq!(
            txn.get_many(rel, &[1, 2, 3, 1]).await?,
            vec![Some(b"uno".to_vec()), None, None, Some(b"uno".to_vec())]
        );
        // Another relation's key 1 is another row.
        assert_eq!(txn.get(Rel::Author, 1).await?, None);
        client.commit(txn).await
    })
    .unwrap()
    .cid
    .unwrap();
    let rows = block_on(async {
        let mut txn = client.begin(cid).await?;
        assert!(txn.read_timestamp().unwrap() >= cid);
        txn.get_many(rel, &[1, 2]).await
    })
    .unwrap();
    assert_eq!(rows, vec![Some(b"uno".to_vec()), None]);
}

#[test]
fn a_snapshot_excludes_commits_after_it_began() {
    let system = cluster(3);
    let (old_reader, writer) = (system.client().unwrap(), system.client().unwrap());
    let keys: Vec<u64> = (1..=12).collect();
    let first: Vec<(u64, &[u8])> = keys.iter().map(|&k| (k, &b"v1"[..])).collect();
    let first_cid = commit_puts(&writer, Rel::Customer, &first);
    block_on(async {
        let mut old = old_reader.begin(0).await?;
        let second: Vec<(u64, &[u8])> = keys.iter().map(|&k| (k, &b"v2"[..])).collect();
        let cid = commit_puts(&writer, Rel::Customer, &second);
        assert!(old.read_timestamp().unwrap() < cid);
        // Read only now, after the commit returned: still the old snapshot.
        let rows = old.get_many(Rel::Customer, &keys).await?;
        assert!(
            rows.iter().all(|r| r.as_deref() == Some(&b"v1"[..])),
            "{rows:?}"
        );
        // A version is its writer's CID as the snapshot sees it, whatever the
        // transaction wrote itself; absent rows have none.
        assert_eq!(old.version(Rel::Customer, 1).await?, Some(first_cid));
        old.put(Rel::Customer, 2, b"own".to_vec()).await?;
        assert_eq!(old.version(Rel::Customer, 2).await?, Some(first_cid));
        assert_eq!(old.version(Rel::Customer, 13).await?, None);
        // Its write of a key committed after its snapshot aborts.
        assert_eq!(reason(old_reader.commit(old).await), AbortReason::Conflict);
        // A transaction that begins after the commit returned sees it, even one of
        // another client that names no CID.
        let mut new = old_reader.begin(0).await?;
        // Asked before any read: the version comes from the RM.
        assert_eq!(new.version(Rel::Customer, 5).await?, Some(cid));
        let rows = new.get_many(Rel::Customer, &keys).await?;
        assert!(
            rows.iter().all(|r| r.as_deref() == Some(&b"v2"[..])),
            "{rows:?}"
        );
        // Read-only: no CID, no message to the TM.
        assert_eq!(old_reader.commit(new).await?.cid, None);
        Ok::<_, Error>(())
    })
    .unwrap();
}

#[test]
fn a_commit_returns_only_once_every_earlier_commit_is_visible() {
    use super::protocol::{RmRequest, serve_frames};
    use super::resource_manager::Store;
    use super::server::Server;
    use super::transaction_manager::TransactionManager;
    use std::sync::{Arc, Mutex, mpsc};
    const SLOW_KEY: u64 = 1;
    // An RM that holds back its COMMIT acknowledgement for the transaction writing
    // SLOW_KEY, and says when that transaction has prepared.
    let store = Arc::new(Store::new());
    let (prepared_tx, prepared_rx) = mpsc::channel();
    let prepared_tx = Mutex::new(prepared_tx);
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let rm = Server::start(listener, "slow-rm", move |stream| {
        let store = store.clone();
        let prepared_tx = prepared_tx.lock().unwrap().clone();
        let mut slow_cid = None;
        serve_frames(stream, RmResponse::Failed, |request: RmRequest| {
            match &request {
                RmRequest::Prepare { cid, writes, .. }
                    if writes.iter().any(|w| w.key == SLOW_KEY) =>
                {
                    slow_cid = Some(*cid);
                    let _ = prepared_tx.send(*cid);
                }
                RmRequest::Commit { cid } if slow_cid == Some(*cid) => {
                    std::thread::sleep(std::time::Duration::from_millis(300));
                }
                _ => {}
            }
            store.handle(request)
        })
    })
    .unwrap();
    let any_port = SocketAddr::from((Ipv4Addr::LOCALHOST, 0));
    let tm = TransactionManager::start(any_port, vec![rm.local_addr()]).unwrap();
    let (slow, fast) = (
        Client::connect(tm.local_addr()).unwrap(),
        Client::connect(tm.local_addr()).unwrap(),
    );
    std::thread::scope(|s| {
        let slow = s.spawn(move || commit_puts(&slow, Rel::Item, &[(SLOW_KEY, b"slow")]));
        let slow_cid = prepared_rx
            .recv_timeout(std::time::Duration::from_secs(10))
            .unwrap();
        let fast_cid = commit_puts(&fast, Rel::Item, &[(2, b"fast")]);
        assert!(slow_cid < fast_cid);
        // The fast commit returned: it and the slow one before it are visible.
        assert!(tm.read_timestamp() >= fast_cid);
        assert_eq!(slow.join().unwrap(), slow_cid);
    });
}

#[test]
fn the_first_committer_wins() {
    let system = cluster(3);
    let (a, b) = (system.client().unwrap(), system.client().unwrap());
    commit_puts(&a, Rel::Item, &[(7, b"0")]);
    block_on(async {
        let mut first = a.begin(0).await?;
        let mut second = b.begin(0).await?;
        first.put(Rel::Item, 7, b"a".to_vec()).await?;
        second.put(Rel::Item, 7, b"b".to_vec()).await?;
        a.commit(first).await?;
        assert_eq!(reason(b.commit(second).await), AbortReason::Conflict);
        let mut check = b.begin(0).await?;
        assert_eq!(check.get(Rel::Item, 7).await?, Some(b"a".to_vec()));
        Ok::<_, Error>(())
    })
    .unwrap();
}

#[test]
fn of_two_concurrent_writers_of_a_key_exactly_one_commits() {
    let system = cluster(3);
    let rounds = 30;
    let barrier = Barrier::new(2);
    let (commits, unexpected) = (AtomicU64::new(0), std::sync::Mutex::new(Vec::new()));
    std::thread::scope(|s| {
        for writer in 0..2u8 {
            let (system, barrier) = (&system, &barrier);
            let (commits, unexpected) = (&commits, &unexpected);
            s.spawn(move || {
                let client = system.client().unwrap();
                // Every round passes both barriers whatever happens (failures are
                // collected, not panicked on), so neither thread is left waiting.
                for round in 0..rounds {
                    let begun = block_on(async {
                        let mut txn = client.begin(0).await?;
                        txn.put(Rel::Item, round, vec![writer]).await?;
                        Ok::<_, Error>(txn)
                    });
                    // Both have begun before either commits.
                    barrier.wait();
                    let outcome = begun.and_then(|txn| block_on(client.commit(txn)));
                    barrier.wait();
                    match outcome {
                        Ok(_) => {
                            commits.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(Error::Aborted {
                            reason: AbortReason::Conflict,
                            ..
                        }) => {}
                        Err(e) => unexpected
                            .lock()
                            .unwrap()
                            .push(format!("round {round}: {e}")),
                    }
                }
            });
        }
    });
    assert_eq!(unexpected.into_inner().unwrap(), Vec::<String>::new());
    assert_eq!(commits.load(Ordering::Relaxed), rounds);
}

#[test]
fn inserting_a_present_key_aborts_with_duplicate_key() {
    let system = cluster(3);
    let client = system.client().unwrap();
    block_on(async {
        let mut txn = client.begin(0).await?;
        txn.insert(Rel::Orders, 5, b"first".to_vec()).await?;
        let cid = client.commit(txn).await?.cid.unwrap();

        let mut txn = client.begin(cid).await?;
        txn.insert(Rel::Orders, 6, b"fresh".to_vec()).await?;
        txn.insert(Rel::Orders, 5, b"again".to_vec()).await?;
        let outcome = client.commit(txn).await;
        assert_eq!(reason(outcome), AbortReason::DuplicateKey);

        // Deleting its own insert does not delete the row that was there.
        let mut txn = client.begin(cid).await?;
        txn.insert(Rel::Orders, 5, b"again".to_vec()).await?;
        txn.delete(Rel::Orders, 5).await?;
        assert_eq!(txn.get(Rel::Orders, 5).await?, None);
        let outcome = client.commit(txn).await;
        assert_eq!(reason(outcome), AbortReason::DuplicateKey);

        // Nothing of the aborted transactions was installed.
        let mut txn = client.begin(0).await?;
        assert_eq!(txn.get(Rel::Orders, 6).await?, None);
        assert_eq!(txn.get(Rel::Orders, 5).await?, Some(b"first".to_vec()));
        // A key the transaction wrote itself is refused at once.
        txn.put(Rel::Orders, 8, b"mine".to_vec()).await?;
        let outcome = txn.insert(Rel::Orders, 8, b"again".to_vec()).await;
        assert_eq!(reason(outcome), AbortReason::DuplicateKey);
        client.abort(txn);

        // After a delete the key may be inserted again.
        let mut txn = client.begin(0).await?;
        txn.delete(Rel::Orders, 5).await?;
        client.commit(txn).await?;
        let mut txn = client.begin(0).await?;
        txn.insert(Rel::Orders, 5, b"reborn".to_vec()).await?;
        client.commit(txn).await?;
        Ok::<_, Error>(())
    })
    .unwrap();
}

#[test]
fn a_snapshot_older_than_the_kept_versions_is_too_old() {
    let system = cluster(1);
    let client = system.client().unwrap();
    commit_puts(&client, Rel::Item, &[(1, b"0")]);
    block_on(async {
        let mut old = client.begin(0).await?;
        for v in 1..=resource_manager::VERSIONS_KEPT as u8 {
            commit_puts(&client, Rel::Item, &[(1, &[v])]);
        }
        assert_eq!(
            reason(old.get(Rel::Item, 1).await),
            AbortReason::SnapshotTooOld
        );
        // A key never written is still readable at that snapshot.
        assert_eq!(old.get(Rel::Item, 2).await?, None);
        Ok::<_, Error>(())
    })
    .unwrap();
}

#[test]
fn begin_after_an_unknown_commit_is_refused() {
    let system = cluster(1);
    let client = system.client().unwrap();
    let outcome = block_on(async { client.begin(1_000).await.map(|_| ()) });
    match outcome {
        Err(Error::System(message)) => assert!(message.contains("never handed out"), "{message}"),
        other => panic!("expected a system error, got {other:?}"),
    }
}

fn balance(row: Option<Vec<u8>>) -> i64 {
    let row = row.expect("every account exists");
    i64::from_le_bytes(row.try_into().expect("a balance is 8 bytes"))
}

#[test]
fn concurrent_transfers_over_three_resource_managers_conserve_the_total() {
    const ACCOUNTS: u64 = 12;
    const INITIAL: i64 = 100;
    let system = cluster(3);
    let accounts: Vec<u64> = (1..=ACCOUNTS).collect();
    let setup = system.client().unwrap();
    let rows: Vec<(u64, Vec<u8>)> = accounts
        .iter()
        .map(|&a| (a, INITIAL.to_le_bytes().to_vec()))
        .collect();
    let rows: Vec<(u64, &[u8])> = rows.iter().map(|(a, r)| (*a, &r[..])).collect();
    commit_puts(&setup, Rel::Customer, &rows);
    // The accounts span every RM.
    for rm in 0..3 {
        assert!(
            accounts
                .iter()
                .any(|&a| resource_manager_of(Rel::Customer, a, 3) == rm)
        );
    }
    let (committed, aborted) = (AtomicU64::new(0), AtomicU64::new(0));
    std::thread::scope(|s| {
        for thread in 0..4u64 {
            let (system, accounts) = (&system, &accounts);
            let (committed, aborted) = (&committed, &aborted);
            s.spawn(move || {
                let client = system.client().unwrap();
                let mut last = 0;
                for i in 0..40u64 {
                    let from = (thread * 7 + i * 5) % ACCOUNTS + 1;
                    let to = (thread * 3 + i * 11 + 1) % ACCOUNTS + 1;
                    let outcome = block_on(async {
                        let mut txn = client.begin(last).await?;
                        if i % 5 == 0 {
                            // An audit: one snapshot of every account.
                            let all = txn.get_many(Rel::Customer, accounts).await?;
                            let total: i64 = all.into_iter().map(balance).sum();
                            assert_eq!(total, INITIAL * ACCOUNTS as i64);
                        }
                        if from != to {
                            let pair = txn.get_many(Rel::Customer, &[from, to]).await?;
                            let [a, b]: [Option<Vec<u8>>; 2] = pair.try_into().unwrap();
                            let amount = (i as i64 % 9) + 1;
                            let (a, b) = (balance(a) - amount, balance(b) + amount);
                            txn.put(Rel::Customer, from, a.to_le_bytes().to_vec())
                                .await?;
                            txn.put(Rel::Customer, to, b.to_le_bytes().to_vec()).await?;
                        }
                        client.commit(txn).await
                    });
                    match outcome {
                        Ok(done) => {
                            last = done.cid.unwrap_or(last);
                            committed.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(Error::Aborted { .. }) => {
                            aborted.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => panic!("transfer failed: {e}"),
                    }
                }
            });
        }
    });
    let total: i64 = block_on(async {
        let mut txn = setup.begin(0).await?;
        txn.get_many(Rel::Customer, &accounts).await
    })
    .unwrap()
    .into_iter()
    .map(balance)
    .sum();
    assert_eq!(total, INITIAL * ACCOUNTS as i64);
    assert!(
        committed.load(Ordering::Relaxed) >= 40,
        "{committed:?} {aborted:?}"
    );
}

#[test]
fn the_generic_loader_loads_a_small_scale() {
    let system = cluster(3);
    let scale = Scale::new(1000, 1, 1024).unwrap();
    let reported = std::sync::Mutex::new(std::collections::BTreeMap::new());
    system
        .load(&scale, &|rel, done, total| {
            let mut reported = reported.lock().unwrap();
            let seen = reported.entry(rel).or_insert((0, total));
            seen.0 = seen.0.max(done);
        })
        .unwrap();
    let reported = reported.into_inner().unwrap();
    for rel in UNITS {
        assert_eq!(
            reported.get(&rel),
            Some(&(scale.rows(rel), scale.rows(rel))),
            "{rel:?}"
        );
    }
    let client = system.engine(0).unwrap();
    block_on(async {
        let mut txn = client.begin(0).await?;
        let items: Vec<u64> = (1..=scale.items).collect();
        let rows = txn.get_many(Rel::Item, &items).await?;
        for (id, row) in items.iter().zip(rows) {
            assert_eq!(row, Some(generate::item(&scale, *id).encode()), "item {id}");
        }
        for id in [1, scale.customers() / 2, scale.customers()] {
            let row = txn.get(Rel::Customer, id).await?;
            assert_eq!(row, Some(generate::customer(&scale, id).encode()));
        }
        let last = scale.orders();
        let (order, lines, cc) = generate::order(&scale, last);
        assert_eq!(txn.get(Rel::Orders, last).await?, Some(order.encode()));
        assert_eq!(txn.get(Rel::CcXacts, last).await?, Some(cc.encode()));
        let keys: Vec<u64> = lines
            .iter()
            .map(|l| order_line_key(last, l.ol_id))
            .collect();
        let rows = txn.get_many(Rel::OrderLine, &keys).await?;
        let expected: Vec<_> = lines.iter().map(|l| Some(l.encode())).collect();
        assert_eq!(rows, expected);
        assert_eq!(txn.get(Rel::Orders, last + 1).await?, None);
        Ok::<_, Error>(())
    })
    .unwrap();
}

#[test]
fn a_killed_resource_manager_is_a_system_error_naming_it() {
    let system = cluster(3);
    let client = system.client().unwrap();
    let dead = system.resource_managers()[1].to_string();
    let on_dead = keys_on(Rel::Item, 1, 3, 1)[0];
    let on_live = keys_on(Rel::Item, 0, 3, 1)[0];
    commit_puts(&client, Rel::Item, &[(on_dead, b"x"), (on_live, b"y")]);
    system.kill_resource_manager(1).unwrap();
    let expect_named = |outcome: Result<()>| match outcome {
        Err(Error::System(message)) => {
            assert!(
                message.contains("resource manager 1") && message.contains(&dead),
                "{message}"
            );
        }
        other => panic!("expected a system error, got {other:?}"),
    };
    block_on(async {
        let mut txn = client.begin(0).await?;
        expect_named(txn.get(Rel::Item, on_dead).await.map(|_| ()));
        // The other partitions still answer.
        assert_eq!(txn.get(Rel::Item, on_live).await?, Some(b"y".to_vec()));
        txn.put(Rel::Item, on_dead, b"z".to_vec()).await?;
        expect_named(client.commit(txn).await.map(|_| ()));
        Ok::<_, Error>(())
    })
    .unwrap();
    expect_named(system.client().map(|_| ()));
}

#[test]
fn a_killed_transaction_manager_is_a_system_error_naming_it() {
    let system = cluster(2);
    let client = system.client().unwrap();
    let tm = system.transaction_manager().to_string();
    system.kill_transaction_manager();
    let outcome = block_on(async { client.begin(0).await.map(|_| ()) });
    match outcome {
        Err(Error::System(message)) => {
            assert!(
                message.contains("transaction manager") && message.contains(&tm),
                "{message}"
            );
        }
        other => panic!("expected a system error, got {other:?}"),
    }
}

/// Writes `bytes` raw on a new connection to `addr` and returns the one frame
/// answered, then checks that the server closed the connection.
fn raw_exchange(addr: SocketAddr, bytes: &[u8]) -> Vec<u8> {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .unwrap();
    stream.write_all(bytes).unwrap();
    let mut len = [0u8; 4];
    stream.read_exact(&mut len).unwrap();
    let mut payload = vec![0u8; u32::from_le_bytes(len) as usize];
    stream.read_exact(&mut payload).unwrap();
    let mut rest = Vec::new();
    stream.read_to_end(&mut rest).unwrap();
    assert!(
        rest.is_empty(),
        "the server closed the connection after its answer"
    );
    payload
}

#[test]
fn malformed_frames_get_an_error_and_the_servers_go_on() {
    let system = cluster(2);
    let rm = system.resource_managers()[0];
    let too_long = ((MAX_FRAME_BYTES + 1) as u32).to_le_bytes();
    let garbage = [3, 0, 0, 0, 0xff, 0xff, 0xff];
    for bytes in [&too_long[..], &garbage[..]] {
        match decode::<RmResponse>(&raw_exchange(rm, bytes)).unwrap() {
            RmResponse::Failed(message) => {
                assert!(message.contains("closing the connection"), "{message}")
            }
            other => panic!("expected an error answer, got {other:?}"),
        }
        match decode::<TmResponse>(&raw_exchange(system.transaction_manager(), bytes)).unwrap() {
            TmResponse::Failed(message) => {
                assert!(message.contains("closing the connection"), "{message}")
            }
            other => panic!("expected an error answer, got {other:?}"),
        }
    }
    // Half a frame, then a hang-up.
    let mut stream = TcpStream::connect(rm).unwrap();
    stream.write_all(&[9, 0, 0, 0, 1]).unwrap();
    drop(stream);
    let client = system.client().unwrap();
    commit_puts(&client, Rel::Item, &[(1, b"still serving")]);
}

#[test]
fn a_server_that_dies_at_start_is_explained() {
    // `sh twopc resource-manager …` looks for a script named `twopc` and fails.
    let launch = Launch::Processes {
        exe: PathBuf::from("/bin/sh"),
    };
    match TwoPc::start(launch, 2) {
        Err(Error::System(message)) => {
            assert!(message.contains("resource manager 0"), "{message}");
            assert!(message.contains("exited with"), "{message}");
            assert!(message.contains("twopc"), "its stderr is quoted: {message}");
        }
        Err(other) => panic!("expected a system error, got {other}"),
        Ok(_) => panic!("sh is no 2PC server"),
    }
    let launch = Launch::Processes {
        exe: PathBuf::from("/nonexistent/namdb"),
    };
    let message = TwoPc::start(launch, 1).err().unwrap().to_string();
    assert!(
        message.contains("cannot start resource manager 0"),
        "{message}"
    );
}
