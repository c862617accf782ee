//! One node's side of `namdb bench join`, the same whether the node is a thread (sim)
//! or a process (shm, tcp, verbs): measure the cost model's constants, then per
//! selectivity generate the node's fragments of R and S and run every join on them,
//! `repeat` times each, summarizing the result rows.

use anyhow::{Context, Result, ensure};
use fabric::Device;
use serde::{Deserialize, Serialize};
use shuffle::ops::join::cost::{self, CostParams};
use shuffle::ops::join::data::DataSpec;
use shuffle::ops::join::{self, Algorithm, JoinConfig, JoinStats, RowSummary};
use shuffle::{Exchange, Node, Phase, Progress};
use std::sync::Arc;
use std::time::Duration;

/// Bytes a node pins for its buffer pools at most.
const PIN_LIMIT: u64 = 1 << 30;

/// How long a blocked step of a join may go without progress.
pub const STALL_LIMIT: Duration = Duration::from_secs(60);

/// The memory scanned to measure `c_mem`.
const MEMORY_PROBE_BYTES: usize = 64 << 20;

/// The run, as every node sees it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Job {
    pub joins: Vec<Algorithm>,
    pub selectivities: Vec<f64>,
    pub threads: usize,
    pub r_tuples: u64,
    pub s_tuples: u64,
    pub seed: u64,
    pub message_bytes: u32,
    pub bloom_bits_per_key: u32,
    pub repeat: usize,
    /// Tuples per node of the calibration shuffles that measure `c_net`.
    pub calibration_tuples: u64,
    /// How often a node process reports its progress, in ms.
    pub progress_ms: u64,
    /// The network pass's threads each both send and receive ([`JoinConfig::interleave`]).
    #[serde(default)]
    pub interleave: bool,
}

impl Job {
    /// The joins this job runs, in order (step `i` of a node's [`Progress`] is the
    /// `i`th): the selectivity, the join and its repetition.
    pub fn runs(&self) -> impl Iterator<Item = (f64, Algorithm, usize)> + '_ {
        self.selectivities.iter().flat_map(move |&sel| {
            self.joins
                .iter()
                .flat_map(move |&a| (0..self.repeat.max(1)).map(move |rep| (sel, a, rep)))
        })
    }

    pub fn spec(&self, nodes: usize, selectivity: f64) -> DataSpec {
        DataSpec {
            seed: self.seed,
            nodes,
            r_tuples: self.r_tuples,
            s_tuples: self.s_tuples,
            selectivity,
        }
    }
}

/// One join at one selectivity on this node.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct NodeRun {
    pub algorithm: Algorithm,
    pub selectivity: f64,
    /// This node's result rows (the same in every repetition).
    pub summary: RowSummary,
    /// Per repetition.
    pub stats: Vec<JoinStats>,
}

/// What one node measured.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct NodeOutput {
    pub rank: usize,
    pub cost: CostParams,
    pub runs: Vec<NodeRun>,
}

/// Runs the job on this node, reporting to `progress` (its step: the run, in the order
/// of [`Job::runs`]).
pub fn run_node(
    job: &Job,
    exchange: Arc<dyn Exchange>,
    device: Arc<dyn Device>,
    progress: Arc<Progress>,
) -> Result<NodeOutput> {
    progress.enter(Phase::Calibrating);
    let node = Node::join(device, exchange, PIN_LIMIT)?;
    let config = JoinConfig {
        threads: job.threads,
        message_bytes: job.message_bytes,
        bloom_bits_per_key: job.bloom_bits_per_key,
        timeout: STALL_LIMIT,
        progress: progress.clone(),
        interleave: job.interleave,
        ..JoinConfig::default()
    };
    let c_mem = cost::measure_memory(job.threads, MEMORY_PROBE_BYTES);
    let net = |design| {
        cost::measure_network(
            &node,
            design,
            (job.threads, job.interleave),
            job.message_bytes,
            job.calibration_tuples,
            c_mem,
        )
        .with_context(|| format!("the calibration shuffle over {design}"))
    };
    let cost = CostParams {
        c_mem,
        c_net: net(join::ghj::DESIGN)?,
        c_net_rdma: net(join::rdma_ghj::DESIGN)?,
    };
    let mut runs = Vec::new();
    let mut step = 0;
    for &selectivity in &job.selectivities {
        progress.set_step(step);
        progress.start(Phase::Preparing, 0);
        let (r, s) = job.spec(node.nodes(), selectivity).fragment(node.rank())?;
        for &algorithm in &job.joins {
            let mut stats = Vec::with_capacity(job.repeat);
            let mut summary = None;
            for _ in 0..job.repeat.max(1) {
                // Not the last run's phase under this run's name.
                progress.start(Phase::Opening, 0);
                progress.set_step(step);
                step += 1;
                let (got, st) = join::join_summary(&node, algorithm, &r, &s, &config)
                    .with_context(|| format!("{algorithm} at selectivity {selectivity}"))?;
                ensure!(
                    summary.is_none_or(|prev| prev == got),
                    "{algorithm} at selectivity {selectivity} gave different rows when repeated"
                );
                summary = Some(got);
                stats.push(st);
            }
            runs.push(NodeRun {
                algorithm,
                selectivity,
                summary: summary.unwrap_or_default(),
                stats,
            });
        }
    }
    progress.set_step(step);
    progress.start(Phase::Done, 0);
    Ok(NodeOutput {
        rank: node.rank(),
        cost,
        runs,
    })
}
