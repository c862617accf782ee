//! The grace hash join with a semi-join reduction (Binnig et al. §5.1.2, "GHJ+Red"):
//! every node builds a Bloom filter over its fragment of R, the filters are
//! broadcast and OR-ed into one over all of R on every node, and S is filtered with it
//! before it is shuffled, so S tuples without a partner mostly never cross the
//! network. The rest is the grace hash join, on the same two-sided design.

use super::repartition::Plan;
use super::{Context, Local};

pub(super) fn plan(cx: &Context) -> (Plan, Local) {
    let words = super::bloom::BloomFilter::with_capacity(cx.total_r, cx.config.bloom_bits_per_key)
        .len_words();
    (
        cx.plan(cx.design_or(super::ghj::DESIGN), 1, Some(words)),
        Local::HashTable,
    )
}
