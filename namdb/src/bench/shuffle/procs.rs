//! Where the nodes of a shuffle run live: threads of this process on one sim network,
//! or node processes (`namdb shuffle-node`, hidden) spawned from this executable, one
//! per rank (see [`crate::bench::nodes`], which holds the machinery the multi-node
//! benchmarks share). Each node prints a [`NodeResult`].

use super::node::{Job, Method, NodeResult, STALL_LIMIT, run_node};
use crate::backend::BackendKind;
use crate::bench::nodes;
use anyhow::{Context, Result};
use std::time::Duration;

/// `namdb shuffle-node`: one node process of `namdb bench shuffle`.
pub use crate::bench::nodes::NodeArgs;

/// The hidden `namdb shuffle-node` subcommand.
pub fn node_main(args: &NodeArgs) -> Result<()> {
    let job: Job = serde_json::from_str(&args.job).context("--job")?;
    let exchange = nodes::connect(args)?;
    let device = match job.method {
        Method::Tcp => None,
        Method::Design(_) => Some(nodes::bind_device(args)?),
    };
    nodes::print_result(&run_node(&job, exchange, device)?)
}

/// Runs `job` on `nodes` nodes of `backend` and returns what each measured, by rank.
pub fn run(backend: BackendKind, nodes: usize, job: &Job) -> Result<Vec<NodeResult>> {
    match backend {
        BackendKind::Sim => nodes::run_threads(nodes, |exchange, device| {
            let device = match job.method {
                Method::Design(_) => Some(device),
                Method::Tcp => None,
            };
            run_node(job, exchange, device)
        }),
        _ => nodes::run_processes(
            "shuffle-node",
            backend,
            nodes,
            &serde_json::to_string(job)?,
            STALL_LIMIT + Duration::from_secs(5),
        ),
    }
}
