//! The RDMA grace hash join (Binnig et al. §5.1.3): the grace hash join whose
//! repartitioning writes each full message straight into a buffer of the receiving
//! node with one-sided WRITEs (the MEMQ/WR design, completion-queue notification), so
//! the receiver's CPU only consumes data. The local phase is the grace hash join's.

use super::repartition::Plan;
use super::{Context, Local};
use crate::endpoint::{Design, Endpoints, Transport};

pub const DESIGN: Design = Design::new(Endpoints::Multi, Transport::MqWr);

pub(super) fn plan(cx: &Context) -> (Plan, Local) {
    (cx.plan(cx.design_or(DESIGN), 1, None), Local::HashTable)
}
