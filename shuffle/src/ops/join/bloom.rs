//! A register-blocked Bloom filter (Putze, Sanders and Singler, "Cache-, hash- and
//! space-efficient Bloom filters", 2007): a key sets [`BITS_PER_KEY_SET`] bits in one
//! 64-bit word, so an insert or a lookup touches one cache line.
//!
//! It is our own rather than a crate's because the semi-join reduction of Binnig et
//! al. §5.1.2 needs the filter as plain words: every node builds one over its
//! fragment of R with atomic ORs from several threads, ships it word ranges at a time
//! over the shuffle, and receivers OR the ranges into the combined filter in place.

use super::hash;
use std::sync::atomic::{AtomicU64, Ordering};

/// Bits a key sets in its word.
pub const BITS_PER_KEY_SET: u32 = 4;

/// The filter over `words` 64-bit words, shareable between threads.
pub struct BloomFilter {
    words: Vec<AtomicU64>,
}

impl BloomFilter {
    /// A filter of `bits_per_key` bits for `keys` keys (at least one word).
    pub fn with_capacity(keys: u64, bits_per_key: u32) -> BloomFilter {
        let words = (keys.saturating_mul(bits_per_key as u64) / 64).clamp(1, u32::MAX as u64);
        BloomFilter::with_words(words as usize)
    }

    /// An empty filter of `words` words (at least one, at most 2³² so that the
    /// word index fits the hash's low 32 bits).
    pub fn with_words(words: usize) -> BloomFilter {
        let words = words.clamp(1, u32::MAX as usize);
        BloomFilter {
            words: (0..words).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    pub fn len_words(&self) -> usize {
        self.words.len()
    }

    #[inline]
    fn locate(&self, h: u64) -> (usize, u64) {
        let word = ((h & 0xffff_ffff) * self.words.len() as u64) >> 32;
        let mut mask = 0u64;
        for i in 0..BITS_PER_KEY_SET {
            mask |= 1 << ((h >> (32 + 6 * i)) & 63);
        }
        (word as usize, mask)
    }

    /// Adds the key of hash `h` (see [`hash::hash`]).
    #[inline]
    pub fn insert_hash(&self, h: u64) {
        let (word, mask) = self.locate(h);
        // Skips the atomic write when the bits are already set (common for duplicates).
        if self.words[word].load(Ordering::Relaxed) & mask != mask {
            self.words[word].fetch_or(mask, Ordering::Relaxed);
        }
    }

    /// Whether the key of hash `h` may have been added (never false for one that was).
    #[inline]
    pub fn contains_hash(&self, h: u64) -> bool {
        let (word, mask) = self.locate(h);
        self.words[word].load(Ordering::Relaxed) & mask == mask
    }

    pub fn insert(&self, key: u64) {
        self.insert_hash(hash::hash(key));
    }
    pub fn contains(&self, key: u64) -> bool {
        self.contains_hash(hash::hash(key))
    }

    /// The words, to ship or merge.
    pub fn words(&self) -> &[AtomicU64] {
        &self.words
    }

    /// ORs `words` into this filter starting at word `at`; `false` (and nothing
    /// changed) when they do not fit.
    pub fn merge_at(&self, at: usize, words: impl ExactSizeIterator<Item = u64>) -> bool {
        if at
            .checked_add(words.len())
            .is_none_or(|end| end > self.words.len())
        {
            return false;
        }
        for (cell, w) in self.words[at..].iter().zip(words) {
            if w != 0 {
                cell.fetch_or(w, Ordering::Relaxed);
            }
        }
        true
    }

    /// The fraction of set bits: what decides the false-positive rate, about
    /// `fill^BITS_PER_KEY_SET`.
    pub fn fill(&self) -> f64 {
        let ones: u64 = self
            .words
            .iter()
            .map(|w| w.load(Ordering::Relaxed).count_ones() as u64)
            .sum();
        ones as f64 / (self.words.len() as f64 * 64.0)
    }

    /// The expected false-positive rate at the current fill (ignoring the variance of
    /// word loads, which blocking adds).
    pub fn false_positive_rate(&self) -> f64 {
        self.fill().powi(BITS_PER_KEY_SET as i32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_false_negatives_and_few_false_positives() {
        let filter = BloomFilter::with_capacity(20_000, 10);
        for k in 0..20_000u64 {
            filter.insert(k * 7 + 3);
        }
        assert!((0..20_000u64).all(|k| filter.contains(k * 7 + 3)));
        let false_positives = (0..100_000u64)
            .filter(|k| filter.contains(1 << 40 | k))
            .count();
        let rate = false_positives as f64 / 100_000.0;
        assert!(rate < 0.05, "false-positive rate {rate}");
        assert!(
            rate > 0.0,
            "a 10-bit filter with no false positives is suspicious"
        );
    }

    #[test]
    fn merged_filters_answer_for_both() {
        let a = BloomFilter::with_words(64);
        let b = BloomFilter::with_words(64);
        a.insert(1);
        b.insert(2);
        let words: Vec<u64> = b
            .words()
            .iter()
            .map(|w| w.load(Ordering::Relaxed))
            .collect();
        assert!(!a.merge_at(1, words.iter().copied()));
        assert!(a.merge_at(0, words.iter().copied()));
        assert!(a.contains(1) && a.contains(2));
    }
}
