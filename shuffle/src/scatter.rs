//! Partitioning a run of tuples over two groups with both write cursors in registers:
//! the hot loop of a repartition between two nodes.
//!
//! Why a loop of its own: the general loop keeps each group's fill count in memory, so
//! every tuple loads the count the previous tuple of its group stored, at an address
//! known only once the tuple's key is hashed. On the cores these benchmarks run on
//! that load-after-store chain, not memory bandwidth, bounds the loop (about 4.8 GB/s
//! of 16-byte tuples, against 10–12 GB/s for the same copy into one buffer). With two
//! groups both cursors fit in registers and picking one is a conditional move, which
//! runs about 1.7× as fast. With three or more groups a select costs more than the
//! chain it removes (measured), so they keep the general loop.

use std::sync::atomic::{AtomicU64, Ordering};

/// Copies tuples of `tuples`, in order, into the unfilled words of their group's
/// buffer: `rest[g]` for `g = group_of(tuple)`, which shrinks from the front as it
/// fills. Stops before the first tuple whose group is neither 0 nor 1, or whose
/// group's rest has no room for it, and returns how many tuples it copied.
#[inline]
pub fn two_groups<const W: usize>(
    tuples: &[[u64; W]],
    group_of: &impl Fn(&[u64; W]) -> usize,
    rest: &mut [&[AtomicU64]; 2],
) -> usize {
    let (ahead, per_line) = crate::operator::prefetch_stride::<W>();
    let [mut first, mut second] = *rest;
    let mut copied = tuples.len();
    for (i, tuple) in tuples.iter().enumerate() {
        if i.is_multiple_of(per_line) {
            fabric::prefetch(tuples, i + ahead);
        }
        let group = group_of(tuple);
        if group > 1 {
            copied = i;
            break;
        }
        // Both selects compile to conditional moves: keys are random, a branch on the
        // group would mispredict every other tuple.
        let to_first = group == 0;
        let unfilled = if to_first { first } else { second };
        if unfilled.len() < W {
            copied = i;
            break;
        }
        let (slot, after) = unfilled.split_at(W);
        for (cell, &word) in slot.iter().zip(tuple) {
            cell.store(word, Ordering::Relaxed);
        }
        if to_first {
            first = after;
        } else {
            second = after;
        }
    }
    *rest = [first, second];
    copied
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(n: usize) -> Vec<AtomicU64> {
        (0..n).map(|_| AtomicU64::new(u64::MAX)).collect()
    }

    fn read(cells: &[AtomicU64]) -> Vec<u64> {
        cells.iter().map(|c| c.load(Ordering::Relaxed)).collect()
    }

    #[test]
    fn tuples_land_in_order_in_their_groups_buffer() {
        let (a, b) = (words(8), words(8));
        let tuples = [[10, 0], [21, 1], [12, 2], [23, 3], [25, 4]];
        let mut rest = [&a[..], &b[..]];
        let copied = two_groups(&tuples, &|t: &[u64; 2]| (t[0] % 2) as usize, &mut rest);
        assert_eq!(copied, 5);
        assert_eq!(read(&a)[..4], [10, 0, 12, 2]);
        assert_eq!(read(&b)[..6], [21, 1, 23, 3, 25, 4]);
        assert_eq!((rest[0].len(), rest[1].len()), (4, 2));
    }

    #[test]
    fn stops_before_a_tuple_that_does_not_fit_and_writes_nothing_of_it() {
        let (a, b) = (words(4), words(3));
        let tuples = [[1, 7], [3, 8], [2, 9]];
        let mut rest = [&a[..], &b[..]];
        let copied = two_groups(&tuples, &|t: &[u64; 2]| (t[0] % 2) as usize, &mut rest);
        // Group 1 holds one tuple of two words; its second would need 4 of 3.
        assert_eq!(copied, 1);
        assert_eq!(read(&b), [1, 7, u64::MAX]);
        assert_eq!(read(&a), [u64::MAX; 4]);
        assert_eq!(rest[1].len(), 1);
    }

    #[test]
    fn stops_before_a_group_out_of_range() {
        let (a, b) = (words(8), words(8));
        let tuples = [[0, 1], [5, 2], [1, 3]];
        let mut rest = [&a[..], &b[..]];
        let copied = two_groups(&tuples, &|t: &[u64; 2]| t[0] as usize, &mut rest);
        assert_eq!(copied, 1);
        assert_eq!(read(&a)[..2], [0, 1]);
        assert_eq!((rest[0].len(), rest[1].len()), (6, 8));
    }
}
