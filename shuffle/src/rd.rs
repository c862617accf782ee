//! The MQ/RD (RDMA READ over RC) endpoints.

use crate::endpoint::{EndpointConfig, Lane, Pair};
use crate::error::{Result, ShuffleError};
use crate::node::Node;

/// Opens this node's endpoints of one lane. Collective.
pub(crate) fn open(node: &Node, config: &EndpointConfig, lane: Lane) -> Result<Pair> {
    let _ = (node, config, lane);
    Err(ShuffleError::Invalid(
        "the MQ/RD (RDMA READ over RC) design is not built yet".into(),
    ))
}
