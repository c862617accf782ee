//! The RDMA radix join (Binnig et al. §5.2, "RRJ"): the radix join's partitioning
//! pass and the network pass are one. Each sending thread partitions its fragments
//! into `nodes × parts` partitions through software-managed buffers (one block per
//! partition, the fan-out sized so that those buffers and each resulting partition
//! fit the L2 cache, see [`super::radix`]), and full blocks go to the owning node in
//! messages written there with one-sided WRITEs (MEMQ/WR). Each node then joins its
//! `parts` partitions with cache-resident hash tables, with no second pass.

use super::repartition::{BLOCK, Plan};
use super::{Context, Local};

pub(super) fn plan(cx: &Context) -> (Plan, Local) {
    let per_node = cx.total_r.div_ceil(cx.nodes as u64);
    let parts = super::radix::partitions_per_node(per_node, cx.nodes, cx.cache_bytes, BLOCK * 16);
    (
        cx.plan(cx.design_or(super::rdma_ghj::DESIGN), parts, None),
        Local::Radix,
    )
}
