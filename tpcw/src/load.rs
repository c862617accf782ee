//! Loading the generated data through any [`System`]'s transactions: every runner
//! thread inserts batches of rows, many transactions in flight per thread where the
//! system allows.

use crate::generate;
use crate::schema::{Rel, Scale, order_line_key};
use crate::system::{AbortReason, Engine, Error, Result, Session, System};
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

/// The generated population: how many rows, and their encoded bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Population {
    pub rows: u64,
    pub bytes: u64,
}

/// Ids of a unit sampled by [`population`]: enough that the rows' random lengths
/// average out to within a few percent.
const POPULATION_SAMPLE: u64 = 256;

/// Estimates [`Population`] for `scale` without generating it: each unit's rows and
/// bytes per id, averaged over ids spread across its range, times its ids. (An order
/// brings 1 to 5 lines and text fields have random lengths, so no closed form holds.)
pub fn population(scale: &Scale) -> Population {
    let mut total = Population { rows: 0, bytes: 0 };
    let mut rows = Vec::new();
    for unit in UNITS {
        let ids = scale.rows(unit);
        let sample = ids.min(POPULATION_SAMPLE);
        if sample == 0 {
            continue;
        }
        rows.clear();
        for i in 0..sample {
            generated_rows(scale, unit, 1 + i * ids / sample, &mut rows);
        }
        let bytes: u64 = rows.iter().map(|(_, _, row)| row.len() as u64).sum();
        // Scaled in u128: ids times a sample's bytes can pass u64 before the division.
        let scale_up = |n: u64| (u128::from(n) * u128::from(ids) / u128::from(sample)) as u64;
        total.rows = total.rows.saturating_add(scale_up(rows.len() as u64));
        total.bytes = total.bytes.saturating_add(scale_up(bytes));
    }
    total
}

/// Loads every unit of `scale` with `threads` threads, `batch` ids per transaction
/// and up to `in_flight` transactions per thread. `progress(rel, rows, total)` is
/// called one call at a time, with `rows` growing, the last call with the total.
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
        // The most rows reported: progress is reported under it, so that it only ever
        // grows and ends at the total. Each thread's own count, reported unordered,
        // once ended a relation's progress short of its total (2472 of 2592).
        let reported = std::sync::Mutex::new(0);
        let results: Vec<Result<()>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..threads)
                .map(|t| {
                    let (next, done, reported) = (&next, &done, &reported);
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
                                    let mut most = reported
                                        .lock()
                                        .unwrap_or_else(std::sync::PoisonError::into_inner);
                                    if n > *most {
                                        *most = n;
                                        progress(rel, n, total);
                                    }
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
/// unless the system is under other load; then it must still finish). A commit of
/// unknown outcome (its worker fenced: under 4x load a loader thread starved past its
/// lease, and the load failed) is tried again too. Recovery decides it all or
/// nothing and no one else inserts these keys, so a retry that finds a row present
/// finds the whole batch committed.
async fn insert_all<E: Engine>(engine: &E, rows: &[(Rel, u64, Vec<u8>)]) -> Result<()> {
    let mut attempts = 0;
    let mut unknown = false;
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
            Err(Error::Aborted {
                reason: AbortReason::DuplicateKey,
                ..
            }) if unknown => return Ok(()),
            Err(Error::Unknown { .. }) if attempts < 100 => {
                unknown = true;
                attempts += 1;
            }
            Err(Error::Aborted { .. }) if attempts < 100 => attempts += 1,
            other => return other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_population_estimate_is_close_to_what_is_generated() {
        let scale = Scale::new(1_000, 2, 1024).unwrap();
        let mut generated = Population { rows: 0, bytes: 0 };
        let mut rows = Vec::new();
        for unit in UNITS {
            for id in 1..=scale.rows(unit) {
                rows.clear();
                generated_rows(&scale, unit, id, &mut rows);
                generated.rows += rows.len() as u64;
                generated.bytes += rows.iter().map(|(_, _, r)| r.len() as u64).sum::<u64>();
            }
        }
        let estimate = population(&scale);
        let off = |a: u64, b: u64| (a as f64 / b as f64 - 1.0).abs();
        assert!(
            off(estimate.rows, generated.rows) < 0.05
                && off(estimate.bytes, generated.bytes) < 0.05,
            "estimate {estimate:?} against {generated:?}"
        );
        // Ten times the browsers: the customers' share grows tenfold.
        let bigger = population(&Scale::new(1_000, 20, 1024).unwrap());
        assert!(
            bigger.rows > 8 * estimate.rows,
            "{bigger:?} against {estimate:?}"
        );
    }
}
