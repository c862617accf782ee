//! The one hash function of the joins and how its bits are split.
//!
//! Every algorithm hashes a key once with a full-avalanche bijection (the MurmurHash3
//! 64-bit finalizer) and takes disjoint bits for each decision, so the decisions are
//! independent: the high bits pick the partition (node, and for the radix join the
//! partition within the node) by a multiply-shift range reduction, the low bits pick
//! the bucket of a local hash table, and the Bloom filter uses the low 32 bits for its
//! word and bits 32.. for the bits within it.

/// MurmurHash3's 64-bit finalizer: a bijection, so distinct keys never collide.
#[inline]
pub fn hash(key: u64) -> u64 {
    let mut h = key;
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^ (h >> 33)
}

/// The global partition of hash `h` among `fanout` partitions: `⌊h·fanout / 2⁶⁴⌋`,
/// from the high bits, uniform for any `fanout` (not only powers of two).
#[inline]
pub fn partition(h: u64, fanout: usize) -> usize {
    ((h as u128 * fanout as u128) >> 64) as usize
}

/// The bucket of hash `h` in a table of `mask + 1` buckets (a power of two).
#[inline]
pub fn bucket(h: u64, mask: usize) -> usize {
    h as usize & mask
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partitions_cover_the_range_evenly() {
        let fanout = 6;
        let mut counts = [0u32; 6];
        for k in 0..60_000u64 {
            counts[partition(hash(k), fanout)] += 1;
        }
        for c in counts {
            assert!((9_000..11_000).contains(&c), "{counts:?}");
        }
        assert_eq!(partition(u64::MAX, fanout), fanout - 1);
        assert_eq!(partition(0, fanout), 0);
    }

    #[test]
    fn hash_is_injective_on_a_sample() {
        let mut seen: Vec<u64> = (0..10_000u64).map(|k| hash(k << 20)).collect();
        seen.sort_unstable();
        seen.dedup();
        assert_eq!(seen.len(), 10_000);
    }
}
