//! `namdb bench aggregate`: distributed aggregation against the number of groups
//! (Shatdal's thesis §4.4–4.5, Binnig et al. VLDB 2016 §5.4, Figure 8(b)), every
//! algorithm of `shuffle::ops::aggregate` next to DuckDB on the same data in the same
//! run.
//!
//! For each group count G, every node generates its fragment of R(k, v): `--tuples`
//! tuples, k uniform in [0, G), v uniform in [-10⁶, 10⁶]. Every algorithm then computes
//! `SELECT k, SUM(v), COUNT(*), AVG(v), MIN(v), MAX(v) FROM R GROUP BY k` over all
//! nodes (`--repeat` times; the median counts), and DuckDB runs the same query on the
//! whole of R inside an outer query that reduces the result to a checksum row (number
//! of groups, sums of the keys, sums, counts, minima and maxima, a key·count sum that
//! ties keys to their groups, and how many AVGs equal SUM/COUNT). Each algorithm's
//! result is reduced the same way and must equal a straightforward single-node GROUP
//! BY in this process and DuckDB's; a mismatch fails the run.
//!
//! Where nodes live (see [`crate::bench::nodes`]): on the sim backend, threads of this
//! process on one sim network; on shm, tcp and verbs, one node process per rank
//! (`namdb aggregate-node`, hidden), each generating its own fragment and binding its
//! own device. Every run gets fresh endpoints: on sim a new network and nodes, in a
//! node process a newly bound device (the processes of a group count serve all its
//! runs). Either way a node reduces its groups to a checksum at once
//! ([`node::run_one`]) and this process merges them.
//!
//! The runtime of an algorithm is the slowest node's aggregation, endpoint setup
//! excluded (reported separately): DuckDB's query time has no such step.

pub mod node;

use crate::backend::BackendKind;
use crate::bench::shuffle::ThreadingArg;
use crate::bench::{
    JsonOut, SvgDir, duckdb, ensure_data_fits, median_run, nodes, parse_names, plot,
};
use anyhow::{Context, Result, ensure};
use clap::Args;
use node::{Job, NodeRun, STALL_LIMIT};
use serde::{Deserialize, Serialize};
use shuffle::Design;
use shuffle::ops::aggregate::{AggConfig, Algorithm, GroupTable, MAX_CACHE_GROUPS, hash};
use shuffle::testing::mix;
use shuffle::{Phase, Progress};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

pub use node::node_main;

/// Values lie in [-VALUE_RANGE, VALUE_RANGE].
const VALUE_RANGE: u64 = 1_000_000;

#[derive(Args, Debug, Clone)]
pub struct AggregateArgs {
    /// Fabric backend: sim runs the nodes as threads of this process; shm, tcp and
    /// verbs as node processes.
    #[arg(long, value_enum, default_value_t = BackendKind::Sim)]
    pub backend: BackendKind,
    /// Nodes.
    #[arg(long, value_name = "N", default_value_t = 2,
          value_parser = clap::value_parser!(u32).range(1..=64))]
    pub nodes: u32,
    /// Worker threads per node (with `--threading split` each node also runs a
    /// receiving thread per lane).
    #[arg(long, value_name = "T", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..=64))]
    pub threads: u32,
    /// split: the workers send, and a receiving thread per endpoint lane merges what
    /// arrives; interleaved: each worker also receives, and merges its own node's
    /// records straight from its sending buffers.
    #[arg(long, value_enum, default_value_t = ThreadingArg::Split)]
    pub threading: ThreadingArg,
    /// Tuples per node.
    #[arg(long, value_name = "X", default_value_t = 1_000_000,
          value_parser = clap::value_parser!(u64).range(1..=1 << 32))]
    pub tuples: u64,
    /// Group counts, comma-separated, or `sweep`: 1, 10, 100, … up to the total
    /// number of tuples.
    #[arg(long, value_delimiter = ',', default_value = "sweep")]
    pub groups: Vec<String>,
    /// Algorithms (two-phase, repartitioning, adaptive-two-phase,
    /// adaptive-repartitioning, sampling, rdma-agg), comma-separated, or `all`.
    #[arg(long, value_delimiter = ',', default_value = "all")]
    pub algorithms: Vec<String>,
    /// The endpoint design of the shuffle.
    #[arg(long, default_value = "MEMQ/WR")]
    pub design: String,
    /// Message (buffer) size, header included.
    #[arg(long, value_name = "B", default_value_t = 64 << 10,
          value_parser = clap::value_parser!(u32).range(256..=(16 << 20)))]
    pub message_bytes: u32,
    /// The memory budget of a worker's local table, in groups (where Adaptive Two
    /// Phase switches).
    #[arg(long, value_name = "GROUPS", default_value_t = AggConfig::default().local_groups,
          value_parser = crate::at_least(1usize))]
    pub local_groups: usize,
    /// RDMA AGG's cache-sized pre-aggregation table, in groups.
    #[arg(long, value_name = "GROUPS", default_value_t = AggConfig::default().cache_groups,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new()
              .range(1..=MAX_CACHE_GROUPS as u64))]
    pub cache_groups: usize,
    /// Shatdal's crossover threshold in groups (sampling, Adaptive Repartitioning);
    /// default: the memory budget.
    #[arg(long, value_name = "GROUPS",
          value_parser = crate::at_least(1usize))]
    pub crossover: Option<usize>,
    /// Timed runs per algorithm and group count (the median is reported).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub repeat: u32,
    /// Leave the nodes' threads to the scheduler instead of pinning each node to its
    /// own cores (node r's T threads on CPUs rT … rT+T−1, wrapping around).
    #[arg(long)]
    pub no_pin: bool,
    /// DuckDB's threads; default: nodes × threads, the cores the algorithms use.
    #[arg(long, value_name = "N",
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1024))]
    pub duckdb_threads: Option<usize>,
    /// Seed of the generated data.
    #[arg(long, default_value_t = 11)]
    pub seed: u64,
    /// Also write the runs to FILE as JSON.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Draw SVG plots into DIR (created if missing).
    #[arg(long, value_name = "DIR")]
    pub svg: Option<PathBuf>,
    /// Milliseconds between the progress lines of a run (for tests).
    #[arg(long, hide = true, default_value_t = 1000,
          value_parser = clap::value_parser!(u64).range(1..=3_600_000))]
    pub progress_ms: u64,
}

/// One algorithm (or DuckDB) at one group count.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    /// An algorithm's name, or `duckdb`.
    pub algorithm: String,
    pub groups: u64,
    pub backend: String,
    pub nodes: usize,
    pub threads: usize,
    /// All nodes' tuples.
    pub tuples: u64,
    /// The median run (the lower median of an even `--repeat`: a run that happened);
    /// the row's other figures (setup, strategies, counts) are the same run's.
    pub runtime_ms: f64,
    pub runs_ms: Vec<f64>,
    pub tuples_per_sec: f64,
    /// Opening the endpoints in the median run, the slowest node (0 for DuckDB).
    pub setup_ms: f64,
    /// How the workers ended up aggregating: strategy → workers (over all nodes).
    pub strategies: BTreeMap<String, usize>,
    /// Sampling: the largest number of groups a node found in its sample.
    pub sampled_groups: Option<usize>,
    pub raw_tuples_sent: u64,
    pub partials_sent: u64,
    /// Groups in the result.
    pub result_groups: u64,
    /// The result equals the single-node GROUP BY and DuckDB's.
    pub verified: bool,
}

/// The per-group-count comparison.
#[derive(Clone, Debug, Serialize)]
pub struct Summary {
    pub groups: u64,
    pub best_fixed: Option<String>,
    pub best_fixed_ms: Option<f64>,
    /// Adaptive algorithm → its runtime over the better fixed algorithm's, in percent
    /// (positive: slower).
    pub adaptive_vs_best_fixed_pct: BTreeMap<String, f64>,
    pub best: Option<String>,
    pub best_ms: Option<f64>,
    pub duckdb_ms: Option<f64>,
    /// DuckDB's runtime over the best algorithm's: above 1, namdb is faster.
    pub best_speedup_vs_duckdb: Option<f64>,
}

#[derive(Serialize)]
struct Report<'a> {
    backend: &'a str,
    nodes: u32,
    threads: u32,
    threading: &'static str,
    tuples_per_node: u64,
    design: &'a str,
    local_groups: usize,
    cache_groups: usize,
    crossover: usize,
    /// Whether each node ran pinned to its own cores.
    pinned: bool,
    duckdb_version: Option<String>,
    rows: &'a [Row],
    summary: &'a [Summary],
}

/// The checksum row of a GROUP BY result (see the module docs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Check {
    groups: i128,
    keys: i128,
    sums: i128,
    counts: i128,
    mins: i128,
    maxes: i128,
    key_counts: i128,
    exact_avgs: i128,
}

impl Check {
    fn add(&mut self, table: &GroupTable) {
        for (k, s) in table.iter() {
            self.groups += 1;
            self.keys += i128::from(k);
            self.sums += s.sum;
            self.counts += i128::from(s.count);
            self.mins += i128::from(s.min);
            self.maxes += i128::from(s.max);
            self.key_counts += i128::from(k) * i128::from(s.count);
            // Our AVG is SUM/COUNT by construction (the state keeps both).
            self.exact_avgs += 1;
        }
    }

    fn merge(&mut self, o: &Check) {
        self.groups += o.groups;
        self.keys += o.keys;
        self.sums += o.sums;
        self.counts += o.counts;
        self.mins += o.mins;
        self.maxes += o.maxes;
        self.key_counts += o.key_counts;
        self.exact_avgs += o.exact_avgs;
    }
}

const DUCKDB_QUERY: &str = "SELECT count(*), sum(k), sum(s), sum(c), sum(mn), sum(mx), \
     sum(k * c), sum(CASE WHEN abs(a * c - s) <= 1e-6 * greatest(abs(s), 1) THEN 1 ELSE 0 END) \
     FROM (SELECT k, sum(v) AS s, count(*) AS c, min(v) AS mn, max(v) AS mx, avg(v) AS a \
     FROM r GROUP BY k)";

fn duckdb_check(t: &duckdb::Timing) -> Result<Check> {
    let v = |c| t.value(0, c);
    Ok(Check {
        groups: v(0)?,
        keys: v(1)?,
        sums: v(2)?,
        counts: v(3)?,
        mins: v(4)?,
        maxes: v(5)?,
        key_counts: v(6)?,
        exact_avgs: v(7)?,
    })
}

/// The group counts asked for.
fn group_counts(args: &AggregateArgs) -> Result<Vec<u64>> {
    let total = args.tuples * u64::from(args.nodes);
    if args.groups.iter().any(|g| g.eq_ignore_ascii_case("sweep")) {
        ensure!(
            args.groups
                .iter()
                .filter(|g| g.eq_ignore_ascii_case("sweep"))
                .count()
                == 1,
            "--groups lists sweep twice"
        );
        ensure!(
            args.groups.len() == 1,
            "--groups sweep cannot be combined with group counts"
        );
        return Ok(std::iter::successors(Some(1u64), |g| g.checked_mul(10))
            .take_while(|&g| g <= total)
            .collect());
    }
    let mut out = Vec::new();
    for g in &args.groups {
        let n: u64 = g
            .trim()
            .replace('_', "")
            .parse()
            .with_context(|| format!("--groups: {g:?} is not a number (or `sweep`)"))?;
        ensure!(n >= 1, "--groups: at least 1 group");
        ensure!(
            n <= total,
            "--groups: {n} groups exceed the {total} tuples of the run"
        );
        ensure!(
            n <= i64::MAX as u64,
            "--groups: keys must fit DuckDB's BIGINT"
        );
        out.push(n);
    }
    crate::bench::refuse_repeats("groups", &out, u64::to_string)?;
    ensure!(!out.is_empty(), "--groups: no group count given");
    Ok(out)
}

/// Node `rank`'s fragment for `groups` groups.
pub fn fragment(seed: u64, rank: usize, tuples: u64, groups: u64) -> (Vec<u64>, Vec<i64>) {
    let base = seed ^ (rank as u64) << 40;
    let keys = (0..tuples)
        .map(|i| ((u128::from(mix(base ^ i)) * u128::from(groups)) >> 64) as u64)
        .collect();
    let values = (0..tuples)
        .map(|i| (mix(!base ^ i) % (2 * VALUE_RANGE + 1)) as i64 - VALUE_RANGE as i64)
        .collect();
    (keys, values)
}

/// Every algorithm's runs at one group count: per algorithm, per run, per node.
type Runs = Vec<Vec<Vec<NodeRun>>>;

/// Runs `algorithms` `repeat` times each, round robin, on one node per fragment of
/// `data`, with fresh endpoints every run: on sim as threads of this process (a new network per
/// run), otherwise on node processes that generate their fragments themselves.
fn run_nodes(
    args: &AggregateArgs,
    algorithms: &[Algorithm],
    config: &AggConfig,
    groups: u64,
    data: &[(Vec<u64>, Vec<i64>)],
) -> Result<Runs> {
    let nodes = data.len();
    let progress = nodes::progress_of(nodes);
    let every = Duration::from_millis(args.progress_ms);
    let line = |at| progress_line(at, &progress, algorithms, args.repeat);
    if args.backend == BackendKind::Sim {
        let mut runs: Runs = algorithms
            .iter()
            .map(|_| Vec::with_capacity(args.repeat as usize))
            .collect();
        let mut run = 0;
        // Round robin: repetition r of every algorithm before repetition r + 1 of any,
        // so a slow spell of the machine falls on all algorithms alike instead of on
        // one algorithm's runs.
        nodes::reporting(every, line, || -> Result<()> {
            for _ in 0..args.repeat {
                for (of_algorithm, &a) in runs.iter_mut().zip(algorithms) {
                    of_algorithm.push(nodes::run_threads(nodes, |exchange, device| {
                        let rank = exchange.rank();
                        if !args.no_pin {
                            nodes::pin_node(rank, config.threads)?;
                        }
                        let config = AggConfig {
                            progress: progress[rank].clone(),
                            ..config.clone()
                        };
                        let (keys, values) = &data[rank];
                        let input = (&keys[..], &values[..]);
                        node::run_one(device, exchange, a, input, &config, run)
                    })?);
                    run += 1;
                }
            }
            Ok(())
        })?;
        return Ok(runs);
    }
    let job = Job::of(args, config, algorithms, groups);
    // By node, then algorithm, then run.
    let per_node: Vec<Vec<Vec<NodeRun>>> = nodes::reporting(every, line, || {
        nodes::run_processes_with_progress(
            "aggregate-node",
            args.backend,
            nodes,
            &serde_json::to_string(&job)?,
            STALL_LIMIT + Duration::from_secs(5),
            &progress,
        )
    })?;
    let mut runs: Runs = algorithms
        .iter()
        .map(|_| {
            (0..args.repeat)
                .map(|_| Vec::with_capacity(nodes))
                .collect()
        })
        .collect();
    for (rank, of_node) in per_node.into_iter().enumerate() {
        ensure!(
            of_node.len() == algorithms.len()
                && of_node.iter().all(|r| r.len() == args.repeat as usize),
            "node {rank} reported {} algorithms' runs, not {} × {}",
            of_node.len(),
            algorithms.len(),
            args.repeat
        );
        for (a, of_algorithm) in of_node.into_iter().enumerate() {
            for (i, run) in of_algorithm.into_iter().enumerate() {
                runs[a][i].push(run);
            }
        }
    }
    Ok(runs)
}

/// A progress line: the run the node furthest behind is at, its phase and count.
fn progress_line(
    at: Duration,
    progress: &[Arc<Progress>],
    algorithms: &[Algorithm],
    repeat: u32,
) -> String {
    let behind = nodes::furthest_behind(progress);
    let mut line = nodes::progress_prefix(at);
    if behind.phase != Phase::Preparing
        && let Some((a, rep)) = Job::run_of(algorithms, repeat, behind.step)
    {
        line.push_str(&format!("{a}, run {} of {repeat}: ", rep + 1));
    }
    line.push_str(&nodes::phase_text(&behind));
    line
}

fn row_of(
    args: &AggregateArgs,
    algorithm: Algorithm,
    groups: u64,
    runs: &[Vec<NodeRun>],
    want: &Check,
) -> Result<Row> {
    let tuples = args.tuples * u64::from(args.nodes);
    let mut runs_ms = Vec::new();
    let mut setup_ms = Vec::new();
    for run in runs {
        let mut check = Check::default();
        for o in run {
            check.merge(&o.check);
        }
        ensure!(
            check == *want,
            "{algorithm} with {groups} groups computed {check:?}, the single-node GROUP BY \
             {want:?}"
        );
        let slowest = |f: &dyn Fn(&NodeRun) -> Duration| {
            run.iter()
                .map(|o| f(o).as_secs_f64() * 1e3)
                .fold(0.0, f64::max)
        };
        runs_ms.push(slowest(&|o| o.runtime));
        setup_ms.push(slowest(&|o| o.setup));
    }
    // Every figure of the row is the median run's.
    let m = median_run(&runs_ms).context("no run")?;
    let of_median = &runs[m];
    let mut strategies = BTreeMap::new();
    for o in of_median {
        for s in &o.strategies {
            *strategies.entry(s.clone()).or_insert(0) += 1;
        }
    }
    let runtime_ms = runs_ms[m];
    Ok(Row {
        algorithm: algorithm.name().into(),
        groups,
        backend: args.backend.name().into(),
        nodes: args.nodes as usize,
        threads: args.threads as usize,
        tuples,
        runtime_ms,
        runs_ms,
        tuples_per_sec: tuples as f64 / (runtime_ms / 1e3).max(1e-9),
        setup_ms: setup_ms[m],
        strategies,
        sampled_groups: of_median.first().and_then(|o| o.sampled_groups),
        raw_tuples_sent: of_median.iter().map(|o| o.raw_sent).sum(),
        partials_sent: of_median.iter().map(|o| o.partials_sent).sum(),
        result_groups: want.groups as u64,
        verified: true,
    })
}

/// The single-node GROUP BY this process checks every algorithm against.
fn reference(data: &[(Vec<u64>, Vec<i64>)]) -> Check {
    let mut table = GroupTable::with_capacity(1024);
    for (keys, values) in data {
        for (&k, &v) in keys.iter().zip(values) {
            table.add(k, hash(k), v);
        }
    }
    let mut c = Check::default();
    c.add(&table);
    c
}

fn strategies_text(r: &Row) -> String {
    if r.strategies.len() == 1 {
        return r.strategies.keys().next().cloned().unwrap_or_default();
    }
    r.strategies
        .iter()
        .map(|(s, n)| format!("{s}×{n}"))
        .collect::<Vec<_>>()
        .join(" ")
}

fn summarize(groups: u64, rows: &[Row]) -> Summary {
    let at: Vec<&Row> = rows.iter().filter(|r| r.groups == groups).collect();
    let fastest = |pick: &dyn Fn(&Row) -> bool| {
        at.iter()
            .filter(|r| pick(r))
            .min_by(|a, b| a.runtime_ms.total_cmp(&b.runtime_ms))
            .copied()
    };
    let fixed = [Algorithm::TwoPhase.name(), Algorithm::Repartitioning.name()];
    let adaptive = [
        Algorithm::AdaptiveTwoPhase.name(),
        Algorithm::AdaptiveRepartitioning.name(),
        Algorithm::Sampling.name(),
    ];
    let best_fixed = fastest(&|r| fixed.contains(&r.algorithm.as_str()));
    let best = fastest(&|r| r.algorithm != "duckdb");
    let duckdb = fastest(&|r| r.algorithm == "duckdb");
    let adaptive_vs_best_fixed_pct = match best_fixed {
        Some(b) => at
            .iter()
            .filter(|r| adaptive.contains(&r.algorithm.as_str()))
            .map(|r| {
                (
                    r.algorithm.clone(),
                    100.0 * (r.runtime_ms / b.runtime_ms.max(1e-9) - 1.0),
                )
            })
            .collect(),
        None => BTreeMap::new(),
    };
    Summary {
        groups,
        best_fixed: best_fixed.map(|r| r.algorithm.clone()),
        best_fixed_ms: best_fixed.map(|r| r.runtime_ms),
        adaptive_vs_best_fixed_pct,
        best: best.map(|r| r.algorithm.clone()),
        best_ms: best.map(|r| r.runtime_ms),
        duckdb_ms: duckdb.map(|r| r.runtime_ms),
        best_speedup_vs_duckdb: match (best, duckdb) {
            (Some(b), Some(d)) => Some(d.runtime_ms / b.runtime_ms.max(1e-9)),
            _ => None,
        },
    }
}

pub fn run(args: &AggregateArgs) -> Result<()> {
    let algorithms = parse_names("algorithms", &args.algorithms, &Algorithm::ALL)?;
    let counts = group_counts(args)?;
    let design: Design = args.design.parse()?;
    ensure!(
        args.tuples * u64::from(args.nodes) <= i64::MAX as u64,
        "too many tuples"
    );
    let config = AggConfig {
        design,
        threads: args.threads as usize,
        interleave: args.threading == ThreadingArg::Interleaved,
        message_bytes: args.message_bytes,
        timeout: STALL_LIMIT,
        local_groups: args.local_groups,
        cache_groups: args.cache_groups,
        crossover: args.crossover,
        seed: args.seed,
        ..AggConfig::default()
    };
    config.validate()?;
    // The generated fragments (keys and values), the nodes' copies and what they
    // receive: measured at about two and a half times the fragments' bytes.
    ensure_data_fits(
        "the aggregation's data",
        (args.tuples * 16)
            .saturating_mul(u64::from(args.nodes))
            .saturating_mul(5)
            / 2,
        args.tuples,
        "tuples per node",
    )?;
    let svg = SvgDir::claim_opt(args.svg.as_deref())?;
    let json = JsonOut::open_opt(args.json.as_deref())?;
    let nodes = args.nodes as usize;
    let duckdb_threads = args.duckdb_threads.unwrap_or(nodes * args.threads as usize);
    // Removed on Ctrl-C too: DuckDB's column files are the whole data set.
    let scratch = crate::interrupt::TempDir::new("namdb-aggregate-duckdb-")?;
    let measured = (|| -> Result<(Vec<Row>, Option<String>)> {
        let mut rows = Vec::new();
        let mut duckdb_version = None;
        for (i, &groups) in counts.iter().enumerate() {
            eprintln!(
                "[{}/{}] {groups} groups: generating {} tuples on {nodes} nodes…",
                i + 1,
                counts.len(),
                args.tuples * nodes as u64
            );
            let data: Vec<(Vec<u64>, Vec<i64>)> = (0..nodes)
                .map(|r| fragment(args.seed, r, args.tuples, groups))
                .collect();
            let want = reference(&data);
            ensure!(want.groups >= 1, "the generated data has no group");
            let runs = run_nodes(args, &algorithms, &config, groups, &data)?;
            for (&a, a_runs) in algorithms.iter().zip(&runs) {
                let row = row_of(args, a, groups, a_runs, &want)?;
                eprintln!(
                    "        {:<24} {:>10.1} ms  {:>7.1} M tuples/s  {}",
                    a.name(),
                    row.runtime_ms,
                    row.tuples_per_sec / 1e6,
                    strategies_text(&row)
                );
                rows.push(row);
            }
            drop(runs);
            let keys: Vec<i64> = data
                .iter()
                .flat_map(|(k, _)| k.iter().map(|&k| k as i64))
                .collect();
            let values: Vec<i64> = data.iter().flat_map(|(_, v)| v.iter().copied()).collect();
            drop(data);
            let timing = duckdb::run(
                scratch.path(),
                &[duckdb::Table {
                    name: "r",
                    columns: vec![("k", &keys), ("v", &values)],
                }],
                DUCKDB_QUERY,
                args.repeat as usize,
                duckdb_threads,
            )
            .context("the DuckDB peer")?;
            let theirs = duckdb_check(&timing)?;
            ensure!(
                theirs == want,
                "DuckDB computed {theirs:?} for {groups} groups, the single-node GROUP BY {want:?}"
            );
            eprintln!(
                "        {:<24} {:>10.1} ms  {:>7.1} M tuples/s  ({} threads; loading took {:.0} ms)",
                "duckdb",
                timing.median_ms,
                keys.len() as f64 / timing.median_ms.max(1e-9) / 1e3,
                timing.threads,
                timing.load_ms
            );
            duckdb_version.get_or_insert(timing.version.clone());
            rows.push(Row {
                algorithm: "duckdb".into(),
                groups,
                backend: "duckdb".into(),
                nodes: 1,
                threads: timing.threads,
                tuples: keys.len() as u64,
                runtime_ms: timing.median_ms,
                runs_ms: timing.runs_ms.clone(),
                tuples_per_sec: keys.len() as f64 / (timing.median_ms / 1e3).max(1e-9),
                setup_ms: 0.0,
                strategies: BTreeMap::new(),
                sampled_groups: None,
                raw_tuples_sent: 0,
                partials_sent: 0,
                result_groups: theirs.groups as u64,
                verified: true,
            });
        }
        Ok((rows, duckdb_version))
    })();
    let measured = JsonOut::unless_failed(json.as_ref(), measured);
    let (rows, duckdb_version) = SvgDir::unless_failed(svg.as_ref(), measured)?;
    let summary: Vec<Summary> = counts.iter().map(|&g| summarize(g, &rows)).collect();
    if let Some(json) = &json {
        let report = Report {
            backend: args.backend.name(),
            nodes: args.nodes,
            threads: args.threads,
            threading: args.threading.name(),
            tuples_per_node: args.tuples,
            design: &args.design,
            local_groups: config.local_groups,
            cache_groups: config.cache_groups,
            crossover: config.crossover(),
            pinned: !args.no_pin,
            duckdb_version: duckdb_version.clone(),
            rows: &rows,
            summary: &summary,
        };
        json.write(&report)?;
        eprintln!("wrote {}", json.path().display());
    }
    if let Some(svg) = &svg {
        let f = SvgDir::unless_failed(Some(svg), draw(svg.path(), args, &rows))?;
        eprintln!("wrote {}", f.display());
        svg.keep();
    }
    print_report(
        &mut std::io::stdout().lock(),
        args,
        &config,
        duckdb_version.as_deref(),
        &rows,
        &summary,
    )
    .context("cannot print the report to stdout")
}

fn draw(dir: &Path, args: &AggregateArgs, rows: &[Row]) -> Result<PathBuf> {
    let mut names: Vec<&str> = Vec::new();
    for r in rows {
        if !names.contains(&r.algorithm.as_str()) {
            names.push(&r.algorithm);
        }
    }
    let lines: Vec<plot::Series> = names
        .iter()
        .map(|&n| plot::Series {
            label: n.to_string(),
            points: rows
                .iter()
                .filter(|r| r.algorithm == n)
                .map(|r| (r.groups as f64, r.runtime_ms))
                .collect(),
        })
        .collect();
    let path = dir.join("aggregate_runtime.svg");
    let title = format!(
        "GROUP BY runtime, {} nodes × {} threads on {}, {} tuples",
        args.nodes,
        args.threads,
        args.backend.name(),
        args.tuples * u64::from(args.nodes)
    );
    plot::line_svg(
        &path,
        &title,
        plot::XAxis::Log10,
        &plot::Axes {
            x: "groups",
            y: "runtime (ms)",
        },
        &lines,
    )
    .map_err(anyhow::Error::msg)?;
    Ok(path)
}

fn print_report(
    out: &mut impl Write,
    args: &AggregateArgs,
    config: &AggConfig,
    duckdb_version: Option<&str>,
    rows: &[Row],
    summary: &[Summary],
) -> std::io::Result<()> {
    writeln!(
        out,
        "namdb bench aggregate: backend {}, {} nodes × {} worker thread(s) {}, {} tuples per \
         node, design {}, memory budget {} groups per worker, cache table {} groups, crossover \
         {} groups; DuckDB {}",
        args.backend.name(),
        args.nodes,
        args.threads,
        args.threading.name(),
        args.tuples,
        args.design,
        config.local_groups,
        config.cache_groups,
        config.crossover(),
        duckdb_version.unwrap_or("-")
    )?;
    writeln!(
        out,
        "runtime: median of {} runs, the slowest node, endpoint setup excluded; every result \
         verified against a single-node GROUP BY and DuckDB; nodes {}",
        args.repeat,
        if args.no_pin {
            "not pinned"
        } else {
            "pinned to their own cores (DuckDB not pinned)"
        }
    )?;
    writeln!(out)?;
    writeln!(
        out,
        "{:>10} {:<24} {:>11} {:>11} {:>9} {:>12} {:>12}  strategy",
        "groups", "algorithm", "runtime ms", "M tuples/s", "setup ms", "raw sent", "partials"
    )?;
    for r in rows {
        writeln!(
            out,
            "{:>10} {:<24} {:>11.1} {:>11.2} {:>9.1} {:>12} {:>12}  {}",
            r.groups,
            r.algorithm,
            r.runtime_ms,
            r.tuples_per_sec / 1e6,
            r.setup_ms,
            r.raw_tuples_sent,
            r.partials_sent,
            strategies_text(r)
        )?;
    }
    writeln!(out)?;
    writeln!(
        out,
        "per group count: adaptive vs the better fixed algorithm (two-phase, repartitioning), \
         and the best algorithm vs DuckDB"
    )?;
    for s in summary {
        let mut line = format!("{:>10} groups:", s.groups);
        if let (Some(b), Some(ms)) = (&s.best_fixed, s.best_fixed_ms) {
            line.push_str(&format!(" better fixed {b} {ms:.1} ms;"));
        }
        for (a, pct) in &s.adaptive_vs_best_fixed_pct {
            line.push_str(&format!(" {a} {pct:+.1}%;"));
        }
        if let (Some(b), Some(x)) = (&s.best, s.best_speedup_vs_duckdb) {
            let against = if x >= 1.0 {
                format!("{x:.2}× faster than")
            } else {
                format!("{:.2}× slower than", 1.0 / x.max(1e-9))
            };
            line.push_str(&format!(
                " best {b} {:.1} ms = {against} DuckDB ({:.1} ms)",
                s.best_ms.unwrap_or(0.0),
                s.duckdb_ms.unwrap_or(0.0)
            ));
        }
        writeln!(out, "{line}")?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fragments_cover_the_groups_and_stay_in_range() {
        let (k, v) = fragment(3, 1, 10_000, 10);
        assert!(k.iter().all(|&k| k < 10));
        assert_eq!(
            k.iter().collect::<std::collections::BTreeSet<_>>().len(),
            10
        );
        assert!(v.iter().all(|&v| v.unsigned_abs() <= VALUE_RANGE));
        assert_ne!(fragment(3, 0, 100, 10).0, k[..100].to_vec());
    }

    /// An even --repeat once reported the mean of the two middle runs, its setup the
    /// mean of two other middle values, and its strategies and counts the last run's.
    #[test]
    fn the_row_of_an_even_count_is_the_lower_middle_run() {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            args: AggregateArgs,
        }
        let args = <Cli as clap::Parser>::parse_from(["t", "--repeat", "4"]).args;
        let run = |runtime: u64, setup: u64, strategy: &str, raw_sent: u64| NodeRun {
            check: Check::default(),
            runtime: Duration::from_millis(runtime),
            setup: Duration::from_millis(setup),
            strategies: vec![strategy.to_string()],
            sampled_groups: None,
            raw_sent,
            partials_sent: 0,
        };
        // Runs (slowest node): 30, 10, 40, 20 ms.
        let runs = vec![
            vec![run(30, 1, "a", 1), run(5, 7, "a", 1)],
            vec![run(10, 2, "b", 2), run(9, 2, "b", 2)],
            vec![run(40, 3, "c", 3), run(1, 1, "c", 3)],
            vec![run(2, 4, "d", 4), run(20, 5, "d", 4)],
        ];
        let row = row_of(&args, Algorithm::TwoPhase, 10, &runs, &Check::default()).unwrap();
        assert_eq!(row.runs_ms, [30.0, 10.0, 40.0, 20.0]);
        assert_eq!(row.runtime_ms, 20.0, "the lower middle run, not 25");
        assert_eq!(row.setup_ms, 5.0, "that run's slowest setup");
        assert_eq!(row.strategies, BTreeMap::from([("d".to_string(), 2)]));
        assert_eq!(row.raw_tuples_sent, 8);
    }

    #[test]
    fn the_summary_compares_adaptive_with_the_better_fixed_algorithm() {
        let row = |a: &str, ms: f64| Row {
            algorithm: a.into(),
            groups: 10,
            backend: "sim".into(),
            nodes: 2,
            threads: 1,
            tuples: 100,
            runtime_ms: ms,
            runs_ms: vec![ms],
            tuples_per_sec: 0.0,
            setup_ms: 0.0,
            strategies: BTreeMap::new(),
            sampled_groups: None,
            raw_tuples_sent: 0,
            partials_sent: 0,
            result_groups: 10,
            verified: true,
        };
        let rows = vec![
            row("two-phase", 10.0),
            row("repartitioning", 20.0),
            row("adaptive-two-phase", 11.0),
            row("duckdb", 30.0),
        ];
        let s = summarize(10, &rows);
        assert_eq!(s.best_fixed.as_deref(), Some("two-phase"));
        assert!((s.adaptive_vs_best_fixed_pct["adaptive-two-phase"] - 10.0).abs() < 1e-9);
        assert_eq!(s.best.as_deref(), Some("two-phase"));
        assert!((s.best_speedup_vs_duckdb.unwrap() - 3.0).abs() < 1e-9);
    }
}
