//! Where the nodes of a shuffle run live: threads of this process on one sim network,
//! or node processes (`namdb shuffle-node`, hidden) spawned from this executable, one
//! per rank (see [`crate::bench::nodes`], which holds the machinery the multi-node
//! benchmarks share). Each node prints a [`NodeResult`]. While a run goes on, its
//! progress is printed on stderr (see [`nodes::reporting`]).

use super::bytes_name;
use super::node::{Job, Method, NodeResult, Pattern, STALL_LIMIT, run_node};
use crate::backend::BackendKind;
use crate::bench::nodes;
use anyhow::{Context, Result};
use shuffle::{Phase, Progress};
use std::sync::Arc;
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
    let progress = Arc::new(Progress::default());
    nodes::report_progress(progress.clone(), job.progress_ms)?;
    nodes::print_result(&run_node(&job, exchange, device, &progress)?)
}

/// Runs `job` on `nodes` nodes of `backend` and returns what each measured, by rank.
/// Prints a progress line on stderr every `job.progress_ms` until the run ends.
pub fn run(backend: BackendKind, nodes: usize, job: &Job) -> Result<Vec<NodeResult>> {
    let progress = nodes::progress_of(nodes);
    let every = Duration::from_millis(job.progress_ms.max(1));
    let line = |at| progress_line(at, &progress, job, nodes);
    nodes::reporting(every, line, || match backend {
        BackendKind::Sim => nodes::run_threads(nodes, |exchange, device| {
            let device = match job.method {
                Method::Design(_) => Some(device),
                Method::Tcp => None,
            };
            let mine = &progress[exchange.rank()];
            run_node(job, exchange, device, mine)
        }),
        _ => nodes::run_processes_with_progress(
            "shuffle-node",
            backend,
            nodes,
            &serde_json::to_string(job)?,
            STALL_LIMIT + Duration::from_secs(5),
            &progress,
        ),
    })
}

/// Payload bytes all nodes receive in a run of `job` on `nodes` nodes.
fn expected_bytes(job: &Job, nodes: usize) -> u64 {
    let per_node = job.tuples * 16;
    let nodes = nodes as u64;
    match job.pattern {
        Pattern::Repartition => nodes * per_node,
        Pattern::Broadcast => nodes * nodes.saturating_sub(1) * per_node,
    }
}

/// A progress line: time since the run started, the phase of the node furthest
/// behind, and the bytes received by all nodes so far.
fn progress_line(at: Duration, progress: &[Arc<Progress>], job: &Job, nodes: usize) -> String {
    let phase = progress
        .iter()
        .map(|p| p.phase())
        .min()
        .unwrap_or(Phase::Done);
    let received: u64 = progress.iter().map(|p| p.done()).sum();
    let mut line = format!("{}{}", nodes::progress_prefix(at), phase.name());
    if received > 0 || phase >= Phase::Shuffling {
        let expected = expected_bytes(job, nodes);
        line.push_str(&format!(
            ": {} of {} received ({:.0}%)",
            bytes_name(received),
            bytes_name(expected),
            100.0 * received as f64 / expected.max(1) as f64
        ));
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(pattern: Pattern) -> Job {
        Job {
            method: Method::Tcp,
            pattern,
            threads: 1,
            tuples: 1 << 20,
            seed: 7,
            message_bytes: 1 << 16,
            buffering: "adaptive".into(),
            notify: "cq".into(),
            progress_ms: 1000,
            interleave: false,
            own_via_fabric: false,
            pin: false,
        }
    }

    #[test]
    fn the_line_shows_the_slowest_phase_and_the_bytes_received_of_all() {
        let nodes = nodes::progress_of(2);
        let at = Duration::from_millis(1500);
        let repartition = job(Pattern::Repartition);
        assert_eq!(
            progress_line(at, &nodes, &repartition, 2),
            "          1.5 s  preparing the fragments"
        );
        nodes[0].enter(Phase::Shuffling);
        nodes[0].add(8 << 20);
        nodes[1].enter(Phase::Opening);
        assert_eq!(
            progress_line(at, &nodes, &repartition, 2),
            "          1.5 s  opening the endpoints: 8.0 MiB of 32.0 MiB received (25%)"
        );
        nodes[1].enter(Phase::Shuffling);
        nodes[1].add(8 << 20);
        assert_eq!(
            progress_line(at, &nodes, &job(Pattern::Broadcast), 2),
            "          1.5 s  shuffling: 16.0 MiB of 32.0 MiB received (50%)"
        );
    }
}
