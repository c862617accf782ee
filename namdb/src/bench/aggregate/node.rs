//! One node's side of `namdb bench aggregate`, the same whether the node is a thread
//! (sim) or a process (shm, tcp, verbs; the hidden `namdb aggregate-node`): run one
//! algorithm on the node's fragment and reduce the groups it owns to a checksum at
//! once, so that runs do not pile up memory.

use super::{AggregateArgs, Check, fragment};
use crate::bench::nodes::{self, NodeArgs};
use anyhow::{Context, Result, ensure};
use fabric::Device;
use serde::{Deserialize, Serialize};
use shuffle::ops::aggregate::{AggConfig, Algorithm, Input, aggregate};
use shuffle::{Design, Exchange, Node, Phase, Progress};
use std::sync::Arc;
use std::time::Duration;

/// Bytes a node pins for its buffer pools at most.
const PIN_LIMIT: u64 = 1 << 30;

/// How long a blocked send or receive of an aggregation waits without progress.
pub const STALL_LIMIT: Duration = Duration::from_secs(60);

/// One group count's runs, as every node process sees them.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Job {
    pub seed: u64,
    /// Tuples per node.
    pub tuples: u64,
    pub groups: u64,
    /// Algorithm names, in order.
    pub algorithms: Vec<String>,
    pub repeat: u32,
    pub design: String,
    pub threads: usize,
    /// Workers that also receive ([`AggConfig::interleave`]).
    #[serde(default)]
    pub interleave: bool,
    pub message_bytes: u32,
    pub local_groups: usize,
    pub cache_groups: usize,
    pub crossover: Option<usize>,
    /// Pin each node to its own cores ([`nodes::pin_node`]).
    pub pin: bool,
    /// How often a node process reports its progress, in ms.
    pub progress_ms: u64,
}

impl Job {
    /// The aggregation settings (what [`Job::of`] took them from).
    pub fn config(&self) -> Result<AggConfig> {
        let design: Design = self.design.parse()?;
        Ok(AggConfig {
            design,
            threads: self.threads,
            interleave: self.interleave,
            message_bytes: self.message_bytes,
            timeout: STALL_LIMIT,
            local_groups: self.local_groups,
            cache_groups: self.cache_groups,
            crossover: self.crossover,
            seed: self.seed,
            ..AggConfig::default()
        })
    }

    /// The runs of `algorithms` at `groups` groups that `args` ask for.
    pub fn of(
        args: &AggregateArgs,
        config: &AggConfig,
        algorithms: &[Algorithm],
        groups: u64,
    ) -> Job {
        Job {
            seed: config.seed,
            tuples: args.tuples,
            groups,
            algorithms: algorithms.iter().map(|a| a.name().to_string()).collect(),
            repeat: args.repeat,
            design: args.design.clone(),
            threads: config.threads,
            interleave: config.interleave,
            message_bytes: config.message_bytes,
            local_groups: config.local_groups,
            cache_groups: config.cache_groups,
            crossover: config.crossover,
            pin: !args.no_pin,
            progress_ms: args.progress_ms,
        }
    }

    /// The algorithm and repetition of run `step` (round robin, see
    /// `super::run_nodes`), if there is one.
    pub fn run_of(algorithms: &[Algorithm], repeat: u32, step: u32) -> Option<(Algorithm, u32)> {
        let n = algorithms.len() as u32;
        let rep = step.checked_div(n)?;
        (rep < repeat).then(|| (algorithms[(step % n) as usize], rep))
    }

    pub fn algorithms(&self) -> Result<Vec<Algorithm>> {
        self.algorithms
            .iter()
            .map(|a| a.parse().map_err(anyhow::Error::from))
            .collect()
    }
}

/// One node's run: its result as a checksum, and what it did.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct NodeRun {
    pub check: Check,
    /// The aggregation, endpoint setup excluded.
    pub runtime: Duration,
    /// Opening the endpoints.
    pub setup: Duration,
    /// How each worker ended up aggregating.
    pub strategies: Vec<String>,
    pub sampled_groups: Option<usize>,
    pub raw_sent: u64,
    pub partials_sent: u64,
}

/// Runs `algorithm` once on this node (rank `exchange.rank()`) over `device`, then
/// waits for every node to finish (tagged `run`) before the device may go. `run` is
/// also the step the node's progress reports ([`Job::run_of`]).
pub fn run_one(
    device: Arc<dyn Device>,
    exchange: Arc<dyn Exchange>,
    algorithm: Algorithm,
    (keys, values): (&[u64], &[i64]),
    config: &AggConfig,
    run: usize,
) -> Result<NodeRun> {
    let rank = exchange.rank();
    config.progress.set_step(run as u32);
    config.progress.start(Phase::Opening, 0);
    let node = Node::join(device, exchange.clone(), PIN_LIMIT)?;
    let input = Input::new(keys, values)?;
    let outcome = aggregate(&node, algorithm, input, config)
        .with_context(|| format!("{algorithm} on node {rank}"))?;
    let mut check = Check::default();
    check.add(&outcome.groups);
    drop(outcome.groups);
    let r = outcome.report;
    exchange
        .all_gather(&format!("aggregate run {run} done"), Vec::new())
        .with_context(|| format!("node {rank} waiting for the others after {algorithm}"))?;
    drop(node);
    Ok(NodeRun {
        check,
        runtime: r.runtime(),
        setup: r.setup,
        strategies: r.strategies.iter().map(|s| s.name().to_string()).collect(),
        sampled_groups: r.sampled_groups,
        raw_sent: r.sent.raw,
        partials_sent: r.sent.partials,
    })
}

/// The hidden `namdb aggregate-node` subcommand: every algorithm of the job `repeat`
/// times on this node's fragment, round robin, each run on a freshly bound device
/// (endpoints of earlier runs left on a device would slow later runs down). Prints the
/// runs by algorithm, then repetition.
pub fn node_main(args: &NodeArgs) -> Result<()> {
    let job: Job = serde_json::from_str(&args.job).context("--job")?;
    ensure!(
        args.rank < args.nodes,
        "rank {} of {} nodes",
        args.rank,
        args.nodes
    );
    let progress = Arc::new(Progress::default());
    let config = AggConfig {
        progress: progress.clone(),
        ..job.config()?
    };
    let algorithms = job.algorithms()?;
    if job.pin {
        nodes::pin_node(args.rank, job.threads)?;
    }
    nodes::report_progress(progress.clone(), job.progress_ms)?;
    let exchange = nodes::connect(args)?;
    progress.start(Phase::Preparing, 0);
    let (keys, values) = fragment(job.seed, args.rank, job.tuples, job.groups);
    let mut runs: Vec<Vec<NodeRun>> = algorithms
        .iter()
        .map(|_| Vec::with_capacity(job.repeat as usize))
        .collect();
    let mut instance = 0;
    // Round robin (see `super::run_nodes`): every node runs the same sequence.
    for _ in 0..job.repeat {
        for (of_algorithm, &algorithm) in runs.iter_mut().zip(&algorithms) {
            let device = nodes::bind_device_instance(args, instance)
                .with_context(|| format!("binding node {}'s device", args.rank))?;
            of_algorithm.push(run_one(
                device,
                exchange.clone(),
                algorithm,
                (&keys, &values),
                &config,
                instance,
            )?);
            instance += 1;
        }
    }
    progress.set_step(instance as u32);
    progress.start(Phase::Done, 0);
    nodes::print_result(&runs)
}
