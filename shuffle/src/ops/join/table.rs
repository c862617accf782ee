//! Local build and probe: chained hash tables over arrays, without a per-tuple
//! allocation. A table indexes an existing slice of R tuples: `heads` holds, per
//! bucket, the index of the last tuple inserted there, `next` links each tuple to the
//! one inserted before it. Buckets are a power of two at least the tuple count (load
//! factor ≤ 1), chosen by the hash's low bits.
//!
//! [`SharedTable`] is the grace hash join's local phase: one table over all of a
//! node's R, built by every thread at once (inserting is an atomic swap on the head),
//! the "no partitioning" join whose random accesses miss the cache once R outgrows
//! it. [`LocalTable`] is the radix join's: one thread builds it over a cache-sized
//! partition and reuses its arrays for the next one.

use super::Tuple;
use super::hash::{bucket, hash};
use crate::error::{Result, ShuffleError};
use crate::progress::{CHUNK, Progress};
use std::sync::atomic::{AtomicU32, Ordering};

const EMPTY: u32 = u32::MAX;

fn check_len(len: usize) -> Result<()> {
    if len >= EMPTY as usize {
        return Err(ShuffleError::Invalid(format!(
            "{len} build tuples on one node: a local hash table indexes at most {}",
            EMPTY - 1
        )));
    }
    Ok(())
}

/// A table over `tuples` built by several threads.
pub struct SharedTable<'a> {
    tuples: &'a [Tuple],
    heads: Vec<AtomicU32>,
    next: Vec<u32>,
    mask: usize,
}

impl<'a> SharedTable<'a> {
    /// Builds the table with `threads` threads, each inserting a contiguous range.
    /// Builds the table over `tuples` with `threads` threads, adding the tuples inserted
    /// to `progress` as they go in.
    pub fn build(
        tuples: &'a [Tuple],
        threads: usize,
        progress: &Progress,
    ) -> Result<SharedTable<'a>> {
        check_len(tuples.len())?;
        let buckets = tuples.len().max(1).next_power_of_two();
        let mask = buckets - 1;
        let heads: Vec<AtomicU32> = (0..buckets).map(|_| AtomicU32::new(EMPTY)).collect();
        let mut next = vec![EMPTY; tuples.len()];
        let chunk = tuples.len().div_ceil(threads.max(1)).max(1);
        std::thread::scope(|s| {
            for (c, links) in next.chunks_mut(chunk).enumerate() {
                let heads = &heads;
                let start = c * chunk;
                let mine = &tuples[start..start + links.len()];
                s.spawn(move || {
                    let pieces = mine.chunks(CHUNK).zip(links.chunks_mut(CHUNK));
                    for (p, (mine, links)) in pieces.enumerate() {
                        let start = start + p * CHUNK;
                        for (i, (t, link)) in mine.iter().zip(links.iter_mut()).enumerate() {
                            let b = bucket(hash(t[0]), mask);
                            // Relaxed: the probe phase starts after this scope joins.
                            *link = heads[b].swap((start + i) as u32, Ordering::Relaxed);
                        }
                        progress.add(mine.len() as u64);
                    }
                });
            }
        });
        Ok(SharedTable {
            tuples,
            heads,
            next,
            mask,
        })
    }

    /// Calls `found` with the payload of every R tuple whose key is `key`.
    #[inline]
    pub fn probe(&self, key: u64, mut found: impl FnMut(u64)) {
        let mut i = self.heads[bucket(hash(key), self.mask)].load(Ordering::Relaxed);
        while i != EMPTY {
            let t = &self.tuples[i as usize];
            if t[0] == key {
                found(t[1]);
            }
            i = self.next[i as usize];
        }
    }
}

/// A single-threaded table whose arrays are reused from one partition to the next.
#[derive(Default)]
pub struct LocalTable {
    heads: Vec<u32>,
    next: Vec<u32>,
    mask: usize,
}

impl LocalTable {
    /// Indexes `tuples`, forgetting what was indexed before.
    pub fn build(&mut self, tuples: &[Tuple]) -> Result<()> {
        check_len(tuples.len())?;
        let buckets = tuples.len().max(1).next_power_of_two();
        self.mask = buckets - 1;
        self.heads.clear();
        self.heads.resize(buckets, EMPTY);
        self.next.clear();
        self.next.resize(tuples.len(), EMPTY);
        for (i, t) in tuples.iter().enumerate() {
            let b = bucket(hash(t[0]), self.mask);
            self.next[i] = self.heads[b];
            self.heads[b] = i as u32;
        }
        Ok(())
    }

    /// Calls `found` with the payload of every tuple of `tuples` (the slice the table
    /// was built over) whose key is `key`.
    #[inline]
    pub fn probe(&self, tuples: &[Tuple], key: u64, mut found: impl FnMut(u64)) {
        let mut i = self.heads[bucket(hash(key), self.mask)];
        while i != EMPTY {
            let t = &tuples[i as usize];
            if t[0] == key {
                found(t[1]);
            }
            i = self.next[i as usize];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn matches_of(table_probe: impl Fn(u64, &mut Vec<u64>), key: u64) -> Vec<u64> {
        let mut out = Vec::new();
        table_probe(key, &mut out);
        out.sort_unstable();
        out
    }

    #[test]
    fn both_tables_find_every_duplicate_and_nothing_else() {
        let tuples: Vec<Tuple> = (0..1000u64).map(|i| [i % 100, i]).collect();
        let shared = SharedTable::build(&tuples, 3, &Progress::default()).unwrap();
        let mut local = LocalTable::default();
        local.build(&[[5, 5]]).unwrap();
        local.build(&tuples).unwrap();
        for key in [0u64, 7, 99, 100, u64::MAX] {
            let want: Vec<u64> = tuples
                .iter()
                .filter(|t| t[0] == key)
                .map(|t| t[1])
                .collect();
            let got_shared = matches_of(|k, out| shared.probe(k, |p| out.push(p)), key);
            let got_local = matches_of(|k, out| local.probe(&tuples, k, |p| out.push(p)), key);
            assert_eq!(got_shared, want);
            assert_eq!(got_local, want);
        }
    }

    #[test]
    fn empty_tables_find_nothing() {
        let shared = SharedTable::build(&[], 2, &Progress::default()).unwrap();
        shared.probe(0, |_| panic!("found in an empty table"));
        let mut local = LocalTable::default();
        local.build(&[]).unwrap();
        local.probe(&[], 0, |_| panic!("found in an empty table"));
    }
}
