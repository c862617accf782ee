//! The arithmetic of the bit vector: where a timestamp's bit is, what its value means,
//! the add that decides it, and the scan of a window of words. Pure functions, so the
//! protocol's reasoning can be tested without a fabric.
//!
//! Timestamp t lives at position `t mod V` in round `t / V`. Every decision at a
//! position toggles its bit, and positions are reused in order (t + V only after t is
//! decided), so a bit equals the parity of the decisions made there: t is decided iff
//! `bit == (t / V + 1) & 1` — the design's `bit == (t / V) & 1` with rounds counted
//! from 1. In even rounds a decision adds 2^b (0 → 1), in odd rounds it adds −2^b
//! (1 → 0); the decider is the only writer of that bit, so the add never carries.
//!
//! Why reading words independently is sound: a bit that reads "decided" for t is
//! true, because the only other way to reach that value is a decision of t + 2V,
//! which needs t + V and so t decided first. A bit that reads "undecided" may be stale,
//! which only makes a scan stop early. So a scan over words loaded at different
//! moments (a torn READ) still yields a prefix of truly decided timestamps.
//!
//! Why holders stay within V/2 of their known prefix (a stricter form of "t − V must
//! be decided"): a position is reused for t + V once t is decided, which a reader whose
//! known prefix is still below t does not know; it would read t as undecided and stop
//! there for good. With every handed-out t below `known + V/2`, a reused position lies
//! more than V/2 behind every holder's prefix, so a reader lagging less than V/2 never
//! meets one, and one that lags more catches up through the published prefix hint.

/// Where timestamp `ts` lives in a vector of `bits` bits: (word, bit in word).
pub(crate) fn position(bits: u64, ts: u64) -> (u64, u32) {
    let p = ts % bits;
    (p / 64, (p % 64) as u32)
}

/// Whether `ts` falls in an odd round (its bit reads 0 once decided).
pub(crate) fn odd_round(bits: u64, ts: u64) -> bool {
    (ts / bits) & 1 == 1
}

/// The bits of `word` whose timestamps are decided, when all of them are in a round
/// of parity `odd`.
pub(crate) fn decided_bits(word: u64, odd: bool) -> u64 {
    if odd { !word } else { word }
}

/// The FETCH_ADD operand that decides the timestamps at bits `mask` of one word, all
/// in a round of parity `odd`: the sum of their 2^b, added or subtracted. Because each
/// of those bits is known to hold the undecided value, the sum never carries.
pub(crate) fn decide_add(mask: u64, odd: bool) -> u64 {
    if odd { mask.wrapping_neg() } else { mask }
}

/// What one window of the vector says, read from the word that holds `start`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Scan {
    /// The first undecided timestamp at or after `start`, if the window holds one.
    pub gap: Option<u64>,
    /// The highest decided timestamp in the window at or after `start`.
    pub frontier: Option<u64>,
    /// The first timestamp after the window: where the next window starts if it held
    /// no gap.
    pub end: u64,
}

/// Scans `words`, the vector words from the one that holds `start` onward (at most up
/// to the end of the vector), for the first undecided timestamp at or after `start`.
/// Every position in the window stands for exactly one timestamp, `start` plus its
/// distance from `start`'s position, because the window never crosses the end of the
/// vector.
pub(crate) fn scan(bits: u64, start: u64, words: &[u64]) -> Scan {
    scan_until(bits, start, words, u64::MAX)
}

/// [`scan`] for a read timestamp, which needs only the gap: it stops at the first
/// undecided timestamp and leaves `frontier` unset.
pub(crate) fn scan_to_gap(bits: u64, start: u64, words: &[u64]) -> Scan {
    scan_words(bits, start, words, u64::MAX, true)
}

/// [`scan`], looking only at timestamps below `limit`.
pub(crate) fn scan_until(bits: u64, start: u64, words: &[u64], limit: u64) -> Scan {
    scan_words(bits, start, words, limit, false)
}

fn scan_words(bits: u64, start: u64, words: &[u64], limit: u64, stop_at_gap: bool) -> Scan {
    let p0 = start % bits;
    let w0 = p0 / 64;
    let odd = odd_round(bits, start);
    let end_pos = ((w0 + words.len() as u64) * 64)
        .min(bits)
        .min(p0.saturating_add(limit.saturating_sub(start)))
        .max(p0);
    let mut gap = None;
    let mut frontier = None;
    for (i, &word) in words.iter().enumerate() {
        let base = (w0 + i as u64) * 64;
        if base >= end_pos {
            break;
        }
        let mut valid = u64::MAX;
        if base < p0 {
            valid &= u64::MAX << (p0 - base);
        }
        if end_pos - base < 64 {
            valid &= (1u64 << (end_pos - base)) - 1;
        }
        let decided = decided_bits(word, odd) & valid;
        let undecided = !decided & valid;
        if gap.is_none() && undecided != 0 {
            gap = Some(base + undecided.trailing_zeros() as u64);
            if stop_at_gap {
                break;
            }
        }
        if decided != 0 {
            frontier = Some(base + 63 - decided.leading_zeros() as u64);
        }
    }
    let ts = |pos: u64| start + (pos - p0);
    Scan {
        gap: gap.map(ts),
        frontier: frontier.map(ts),
        end: ts(end_pos),
    }
}

/// The first timestamp whose bit is bit 0 of the `i`-th word of a window read from
/// `start` (the window's first word may begin before `start`).
fn word_base(bits: u64, start: u64, i: usize) -> u64 {
    let p0 = start % bits;
    start - p0 + (p0 / 64 + i as u64) * 64
}

/// The highest decided timestamp at or after `start` in a window read from `start`,
/// leaving out the bits `ignore(base)` returns for the word whose bit 0 is timestamp
/// `base`. The read path uses it for the highest decision of a slot that is not known
/// to be free: what an active slot's holder may be waiting to see covered, unlike the
/// skips made for free slots ahead of everyone.
pub(crate) fn last_decided_except(
    bits: u64,
    start: u64,
    words: &[u64],
    ignore: impl Fn(u64) -> u64,
) -> Option<u64> {
    let p0 = start % bits;
    let odd = odd_round(bits, start);
    for (i, &word) in words.iter().enumerate().rev() {
        let base = word_base(bits, start, i);
        let pos = base % bits;
        let mut valid = u64::MAX;
        if pos < p0 {
            valid &= u64::MAX.checked_shl((p0 - pos) as u32).unwrap_or(0);
        }
        if bits - pos < 64 {
            valid &= (1u64 << (bits - pos)) - 1;
        }
        let decided = decided_bits(word, odd) & valid & !ignore(base);
        if decided != 0 {
            return Some(base + 63 - decided.leading_zeros() as u64);
        }
    }
    None
}

/// Per word of a window read from `start`, the bits of the undecided timestamps in
/// `[from, upto]` that the rule allows: `(index in words, mask)` for the words with
/// any. `from` must be at or after `start`; only bits inside the window count.
///
/// The rule sees a word at a time, `allow(base, candidates)` with bit b standing for
/// timestamp `base + b`, and returns the candidates it allows (other bits it returns
/// are ignored): the read path runs this on every read timestamp that finds a gap,
/// and a word at a time lets the rule hold its state once per word instead of per
/// bit.
pub(crate) fn skippable(
    bits: u64,
    start: u64,
    words: &[u64],
    from: u64,
    upto: u64,
    allow: impl Fn(u64, u64) -> u64,
) -> Vec<(usize, u64)> {
    let odd = odd_round(bits, start);
    let mut out = Vec::new();
    for (i, &word) in words.iter().enumerate() {
        let base = word_base(bits, start, i);
        if base > upto {
            break;
        }
        let Some(in_range) = bit_range(
            from.saturating_sub(base),
            (upto - base).min(bits - 1 - base % bits),
        ) else {
            continue;
        };
        let candidates = !decided_bits(word, odd) & in_range;
        if candidates == 0 {
            continue;
        }
        let mask = allow(base, candidates) & candidates;
        if mask != 0 {
            out.push((i, mask));
        }
    }
    out
}

/// The bits `lo..=hi` of a word, clipped to its 64 bits; `None` when that is empty.
fn bit_range(lo: u64, hi: u64) -> Option<u64> {
    let hi = hi.min(63);
    (lo <= hi).then(|| (u64::MAX >> (63 - hi)) & (u64::MAX << lo))
}

/// The first timestamp after a window of `words` words read from `start`.
pub(crate) fn window_end(bits: u64, start: u64, words: u64) -> u64 {
    let p0 = start % bits;
    let end_pos = ((p0 / 64 + words) * 64).min(bits).max(p0);
    start + (end_pos - p0)
}

/// The words a window read from `start` covers: from `start`'s word, at most
/// `max_words`, never past the end of the vector.
pub(crate) fn window_words(bits: u64, start: u64, max_words: u64) -> (u64, u64) {
    let (w0, _) = position(bits, start);
    let total = bits.div_ceil(64);
    (w0, max_words.min(total - w0))
}

/// The owner's timestamps in `[from, to]` (inclusive), `from` being one of its own,
/// grouped by vector word: `(word, mask, odd round)` in increasing timestamp order.
/// Consecutive timestamps in one word share a round because the range is shorter than
/// V when callers respect the wrap rule.
pub(crate) fn own_masks(bits: u64, slots: u64, from: u64, to: u64) -> Vec<(u64, u64, bool)> {
    let mut out: Vec<(u64, u64, bool)> = Vec::new();
    let mut t = from;
    while t <= to {
        let (word, bit) = position(bits, t);
        let odd = odd_round(bits, t);
        match out.last_mut() {
            Some((w, mask, o)) if *w == word && *o == odd => *mask |= 1 << bit,
            _ => out.push((word, 1 << bit, odd)),
        }
        t += slots;
    }
    out
}

#[cfg(all(test, not(timestamp_loom)))]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A reference model: decided flags per timestamp, rendered into vector words.
    fn render(bits: u64, decided_upto_round: &[(u64, bool)]) -> Vec<u64> {
        let mut words = vec![0u64; bits.div_ceil(64) as usize];
        for &(ts, decided) in decided_upto_round {
            // The bit is the parity of decisions at the position: rounds before ts's
            // are all decided, plus ts itself if decided.
            let decisions = ts / bits + u64::from(decided);
            let (w, b) = position(bits, ts);
            if decisions & 1 == 1 {
                words[w as usize] |= 1 << b;
            } else {
                words[w as usize] &= !(1 << b);
            }
        }
        words
    }

    proptest! {
        /// The early-exit scan of the read path finds the same gap as the full scan,
        /// and covers the same range when there is none.
        #[test]
        fn scan_to_gap_agrees_with_scan(
            words in proptest::collection::vec(any::<u64>(), 1..8),
            start_bit in 0u64..64,
            round in 0u64..3,
        ) {
            let bits = 64 * 8;
            let start = round * bits + start_bit;
            let full = scan(bits, start, &words);
            let fast = scan_to_gap(bits, start, &words);
            prop_assert_eq!(fast.gap, full.gap);
            if full.gap.is_none() {
                prop_assert_eq!(fast.end, full.end);
            }
        }
    }

    #[test]
    fn adds_toggle_exactly_the_masked_bits() {
        let word = 0b1010_0000u64;
        assert_eq!(word.wrapping_add(decide_add(0b0101, false)), 0b1010_0101);
        assert_eq!(word.wrapping_add(decide_add(0b1010_0000, true)), 0);
    }

    #[test]
    fn scan_finds_the_first_gap_and_the_frontier() {
        let bits = 200;
        // Round 0, timestamps 0..10 decided, 10 not, 11 and 150 decided.
        let mut cells: Vec<(u64, bool)> = (0..200).map(|t| (t, t < 10)).collect();
        cells[11].1 = true;
        cells[150].1 = true;
        let words = render(bits, &cells);
        let s = scan(bits, 3, &words);
        assert_eq!(s.gap, Some(10));
        assert_eq!(s.frontier, Some(150));
        assert_eq!(s.end, 200);
        // From the second word on, only 150 is decided.
        let s = scan(bits, 64, &words[1..]);
        assert_eq!(s.gap, Some(64));
        assert_eq!(s.frontier, Some(150));
    }

    #[test]
    fn scan_in_an_odd_round_reads_zero_as_decided() {
        let bits = 64;
        // Round 1: timestamps 64..100 decided, the rest of round 1 not.
        let cells: Vec<(u64, bool)> = (64..128).map(|t| (t, t < 100)).collect();
        let words = render(bits, &cells);
        let s = scan(bits, 70, &words);
        assert_eq!(s.gap, Some(100));
        assert_eq!(s.frontier, Some(99));
        assert_eq!(s.end, 128);
    }

    #[test]
    fn the_highest_decision_can_leave_slots_out() {
        let bits = 200;
        // Decided: 0..10, 11, 130 and 150; timestamps are owned by slot t % 4.
        let mut cells: Vec<(u64, bool)> = (0..200).map(|t| (t, t < 10)).collect();
        for t in [11, 130, 150] {
            cells[t].1 = true;
        }
        let words = render(bits, &cells);
        let all = |_| 0;
        assert_eq!(last_decided_except(bits, 3, &words, all), Some(150));
        // Leaving out slot 2 leaves out 150 and 130, both of slot 2.
        let slot2 = |base: u64| {
            (0..64)
                .filter(|b| (base + b) % 4 == 2)
                .fold(0, |m, b| m | 1 << b)
        };
        assert_eq!(last_decided_except(bits, 3, &words, slot2), Some(11));
        // Bits before `start` do not count.
        assert_eq!(last_decided_except(bits, 12, &words[..1], all), None);
        assert_eq!(last_decided_except(bits, 5, &words[..1], all), Some(11));
    }

    #[test]
    fn skippable_bits_are_undecided_in_range_and_allowed() {
        let bits = 200;
        let cells: Vec<(u64, bool)> = (0..200).map(|t| (t, t < 10 || t == 14)).collect();
        let words = render(bits, &cells);
        // Slot 2 of 4 from 10 to 70: 10 (word 0), 18.., 14 is decided.
        let plan = skippable(bits, 3, &words, 10, 70, each_timestamp(|t| t % 4 == 2));
        let want0 = (10..64)
            .filter(|t| t % 4 == 2 && *t != 14)
            .fold(0u64, |m, t| m | 1 << t);
        assert_eq!(plan, vec![(0, want0), (1, 1 << (66 - 64) | 1 << (70 - 64))]);
        // The last word holds positions 192..199 only.
        let plan = skippable(bits, 190, &words[2..], 190, 400, |_, all| all);
        assert_eq!(plan, vec![(0, 0b11 << 62), (1, 0xff)]);
    }

    #[test]
    fn own_masks_group_by_word_and_round() {
        // V = 8, S = 2: slot 1 owns 1, 3, 5, 7 | 9, 11 (round 1).
        let m = own_masks(8, 2, 1, 11);
        assert_eq!(m, vec![(0, 0b1010_1010, false), (0, 0b0000_1010, true)]);
    }

    /// A word-at-a-time rule for [`skippable`] from a rule on single timestamps.
    fn each_timestamp(may_skip: impl Fn(u64) -> bool) -> impl Fn(u64, u64) -> u64 {
        move |base, candidates| {
            let mut rest = candidates;
            let mut mask = 0u64;
            while rest != 0 {
                let b = rest.trailing_zeros();
                rest &= rest - 1;
                if may_skip(base + u64::from(b)) {
                    mask |= 1 << b;
                }
            }
            mask
        }
    }

    /// `skippable` by its definition, one bit at a time.
    fn skippable_bit_by_bit(
        bits: u64,
        start: u64,
        words: &[u64],
        from: u64,
        upto: u64,
        may_skip: impl Fn(u64) -> bool,
    ) -> Vec<(usize, u64)> {
        let odd = odd_round(bits, start);
        let mut out = Vec::new();
        for (i, &word) in words.iter().enumerate() {
            let base = word_base(bits, start, i);
            if base > upto {
                break;
            }
            let undecided = !decided_bits(word, odd);
            let mut mask = 0u64;
            for b in 0..64u64 {
                let t = base + b;
                if t >= from
                    && t <= upto
                    && (base % bits) + b < bits
                    && undecided & (1 << b) != 0
                    && may_skip(t)
                {
                    mask |= 1 << b;
                }
            }
            if mask != 0 {
                out.push((i, mask));
            }
        }
        out
    }

    proptest! {
        /// The masked `skippable` plans exactly the bits its definition names, for
        /// any window, range and rule, including windows that end mid-word at V.
        #[test]
        fn skippable_matches_its_definition(
            bits in 8u64..300,
            round in 0u64..4,
            decided in proptest::collection::vec(any::<bool>(), 300),
            start_off in 0u64..300,
            from_off in 0u64..400,
            len in 0u64..400,
            max_words in 1u64..6,
            modulus in 1u64..5,
        ) {
            let base = round * bits;
            let cells: Vec<(u64, bool)> =
                (0..bits).map(|i| (base + i, decided[i as usize])).collect();
            let words = render(bits, &cells);
            let start = base + start_off % bits;
            let (w0, n) = window_words(bits, start, max_words);
            let window = &words[w0 as usize..(w0 + n) as usize];
            let from = start + from_off % (bits + 64);
            let upto = from + len;
            let rule = |t: u64| !t.is_multiple_of(modulus);
            prop_assert_eq!(
                skippable(bits, start, window, from, upto, each_timestamp(rule)),
                skippable_bit_by_bit(bits, start, window, from, upto, rule)
            );
        }
    }

    proptest! {
        /// The scan agrees with a direct search over the model, wherever it starts and
        /// however far the window reaches.
        #[test]
        fn scan_matches_the_model(
            bits in 8u64..300,
            round in 0u64..4,
            decided in proptest::collection::vec(any::<bool>(), 300),
            start_off in 0u64..300,
            max_words in 1u64..6,
        ) {
            let base = round * bits;
            let cells: Vec<(u64, bool)> =
                (0..bits).map(|i| (base + i, decided[i as usize])).collect();
            let words = render(bits, &cells);
            let start = base + start_off % bits;
            let (w0, n) = window_words(bits, start, max_words);
            let s = scan(bits, start, &words[w0 as usize..(w0 + n) as usize]);
            let end = (base + ((w0 + n) * 64).min(bits)).max(start);
            prop_assert_eq!(s.end, end);
            let in_window = |t: u64| t >= start && t < end;
            let want_gap = (start..end).find(|&t| !decided[(t - base) as usize]);
            prop_assert_eq!(s.gap, want_gap);
            let want_frontier = (start..end).rev().find(|&t| decided[(t - base) as usize]);
            prop_assert_eq!(s.frontier, want_frontier);
            if let Some(g) = s.gap { prop_assert!(in_window(g)); }
        }
    }
}
