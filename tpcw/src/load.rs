//! Loading the generated data through any [`System`]'s transactions: every runner
//! thread inserts batches of rows, many transactions in flight per thread where the
//! system allows.

use crate::generate;
use crate::schema::{Rel, Scale, order_line_key};
use crate::system::{Engine, Error, Result, Session, System};
use std::sync::atomic::{AtomicU64, Ordering};

/// What is generated per id, and under which relation its progress counts: an order
/// brings its lines and its credit-card transaction.
pub const UNITS: [Rel; 7] = [
    Rel::Country,
    Rel::Author,
    Rel::Item,
    Rel::Customer,
    Rel::Address,
    Rel::Orders,
    Rel::NewProducts,
];

/// The rows generated for `id` of unit `rel` (see [`UNITS`]), as (relation, key, row).
pub fn generated_rows(scale: &Scale, rel: Rel, id: u64, out: &mut Vec<(Rel, u64, Vec<u8>)>) {
    match rel {
        Rel::Country => out.push((rel, id, generate::country(id).encode())),
        Rel::Author => out.push((rel, id, generate::author(id).encode())),
        Rel::Item => out.push((rel, id, generate::item(scale, id).encode())),
        Rel::Customer => out.push((rel, id, generate::customer(scale, id).encode())),
        Rel::Address => out.push((rel, id, generate::address(scale, id).encode())),
        Rel::Orders => {
            let (order, lines, cc) = generate::order(scale, id);
            out.push((Rel::Orders, id, order.encode()));
            for l in lines {
                out.push((Rel::OrderLine, order_line_key(id, l.ol_id), l.encode()));
            }
            out.push((Rel::CcXacts, id, cc.encode()));
        }
        Rel::NewProducts => {
            let rows = generate::new_products(scale);
            if let Some(row) = rows.get(id as usize - 1) {
                out.push((rel, row.np_subject, row.encode()));
            }
        }
        Rel::OrderLine | Rel::CcXacts | Rel::ShoppingCart | Rel::ShoppingCartLine => {}
    }
}

/// Loads every unit of `scale` with `threads` threads, `batch` ids per transaction
/// and up to `in_flight` transactions per thread.
pub fn load_through_transactions<S: System>(
    system: &S,
    scale: &Scale,
    threads: usize,
    batch: u64,
    progress: &(dyn Fn(Rel, u64, u64) + Sync),
) -> Result<()> {
    let in_flight = system.max_clients_per_thread().min(16);
    for rel in UNITS {
        let total = scale.rows(rel);
        let next = AtomicU64::new(1);
        let done = AtomicU64::new(0);
        let results: Vec<Result<()>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..threads)
                .map(|t| {
                    let (next, done) = (&next, &done);
                    s.spawn(move || -> Result<()> {
                        let engine = system.engine(t)?;
                        let outcomes = engine.run_clients(in_flight, |_| {
                            let engine = &engine;
                            Box::pin(async move {
                                let mut rows = Vec::new();
                                loop {
                                    let first = next.fetch_add(batch, Ordering::Relaxed);
                                    if first > total {
                                        return Ok(());
                                    }
                                    let last = (first + batch - 1).min(total);
                                    rows.clear();
                                    for id in first..=last {
                                        generated_rows(scale, rel, id, &mut rows);
                                    }
                                    insert_all(engine, &rows).await?;
                                    let n = done.fetch_add(last - first + 1, Ordering::Relaxed)
                                        + (last - first + 1);
                                    progress(rel, n, total);
                                }
                            })
                        });
                        outcomes.into_iter().collect()
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err(Error::System("a loader thread panicked".into())))
                })
                .collect()
        });
        for r in results {
            r?;
        }
    }
    Ok(())
}

/// Inserts `rows` in one transaction, retrying aborts (a loader has no conflicts
/// unless the system is under other load; then it must still finish).
async fn insert_all<E: Engine>(engine: &E, rows: &[(Rel, u64, Vec<u8>)]) -> Result<()> {
    let mut attempts = 0;
    loop {
        let mut txn = engine.begin(0).await?;
        let mut outcome = Ok(());
        for (rel, key, row) in rows {
            outcome = txn.insert(*rel, *key, row.clone()).await;
            if outcome.is_err() {
                break;
            }
        }
        let outcome = match outcome {
            Ok(()) => engine.commit(txn).await.map(|_| ()),
            Err(e) => {
                engine.abort(txn);
                Err(e)
            }
        };
        match outcome {
            Err(Error::Aborted { .. }) if attempts < 100 => attempts += 1,
            other => return other,
        }
    }
}
