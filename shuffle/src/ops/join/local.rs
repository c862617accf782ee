//! The local join phases, after the network pass.
//!
//! - [`hash_join`]: the grace hash joins' local phase: one table over all of the
//!   node's R (built by every thread), probed with each receiving thread's S.
//! - [`radix_join`]: the radix join's: the network pass already split the node's R and
//!   S into cache-sized partitions, so threads take partitions one by one (dynamic
//!   assignment absorbs skew), build a cache-resident table over R's and probe it
//!   with S's.

use super::repartition::Collected;
use super::table::{LocalTable, SharedTable};
use super::{RowSink, Tuple};
use crate::error::Result;
use crate::progress::{Phase, Progress, counted};
use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};

fn join_threads<S: Send>(
    threads: usize,
    work: impl Fn(usize) -> Result<S> + Sync,
) -> Result<Vec<S>> {
    std::thread::scope(|sc| {
        let hs: Vec<_> = (0..threads)
            .map(|t| {
                let work = &work;
                sc.spawn(move || work(t))
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("join thread panicked"))
            .collect()
    })
}

/// Joins R (`parts[0]` of every receiver) with S (`parts[1]`), one sink per thread.
pub fn hash_join<S: RowSink>(
    collected: &[Collected],
    threads: usize,
    make_sink: &(impl Fn(usize) -> S + Sync),
    progress: &Progress,
) -> Result<Vec<S>> {
    let r_len = collected.iter().map(|c| c.parts[0].len()).sum();
    progress.start(Phase::Building, r_len as u64);
    let mut r_all: Vec<Tuple> = Vec::with_capacity(r_len);
    for c in collected {
        r_all.extend_from_slice(&c.parts[0]);
    }
    let table = SharedTable::build(&r_all, threads, progress)?;
    let s_len: usize = collected.iter().map(|c| c.parts[1].len()).sum();
    progress.start(Phase::Probing, s_len as u64);
    join_threads(threads, |t| {
        let mut sink = make_sink(t);
        // Thread t probes the S of receivers t, t + threads, …
        for c in collected.iter().skip(t).step_by(threads) {
            let Ok(()) = counted::<_, Infallible>(progress, &c.parts[1], |s| {
                table.probe(s[0], |r| sink.row(s[0], r, s[1]));
                Ok(())
            });
        }
        Ok(sink)
    })
}

/// Joins local partition `p` of R (`parts[p]`) with S's (`parts[parts + p]`) for every
/// `p`, one sink per thread.
pub fn radix_join<S: RowSink>(
    collected: &[Collected],
    parts: usize,
    threads: usize,
    make_sink: &(impl Fn(usize) -> S + Sync),
    progress: &Progress,
) -> Result<Vec<S>> {
    let s_len: usize = collected
        .iter()
        .flat_map(|c| &c.parts[parts..])
        .map(Vec::len)
        .sum();
    progress.start(Phase::Joining, s_len as u64);
    let next = AtomicUsize::new(0);
    join_threads(threads, |t| {
        let mut sink = make_sink(t);
        let mut table = LocalTable::default();
        let mut r_part: Vec<Tuple> = Vec::new();
        loop {
            let p = next.fetch_add(1, Ordering::Relaxed);
            if p >= parts {
                break;
            }
            r_part.clear();
            for c in collected {
                r_part.extend_from_slice(&c.parts[p]);
            }
            // Partitions are cache-sized: one count each.
            let probed: usize = collected.iter().map(|c| c.parts[parts + p].len()).sum();
            if r_part.is_empty() {
                progress.add(probed as u64);
                continue;
            }
            table.build(&r_part)?;
            for c in collected {
                for s in &c.parts[parts + p] {
                    table.probe(&r_part, s[0], |r| sink.row(s[0], r, s[1]));
                }
            }
            progress.add(probed as u64);
        }
        Ok(sink)
    })
}
