//! The grace hash join (Binnig et al. §5.1.1): R and S are hash-partitioned over the
//! network with the classic two-sided path (SEND/RECV, the socket-like MEMQ/SR
//! design), then every node builds one hash table over its share of R and probes it
//! with its share of S.

use super::repartition::Plan;
use super::{Context, Local};
use crate::endpoint::{Design, Endpoints, Transport};

pub const DESIGN: Design = Design::new(Endpoints::Multi, Transport::MqSr);

pub(super) fn plan(cx: &Context) -> (Plan, Local) {
    (cx.plan(cx.design_or(DESIGN), 1, None), Local::HashTable)
}
