//! `namdb bench join`: the join experiment of Binnig et al. (VLDB 2016 §5.4, Figure
//! 8a) — runtime against the Bloom filter's selectivity for the grace hash join, the
//! grace hash join with a Bloom-filter reduction, the RDMA grace hash join and the
//! RDMA radix join (`shuffle::ops::join`) — with the paper's cost model predicted
//! beside each measurement and DuckDB on the same data in the same run.
//!
//! Each node holds `--r-tuples` tuples of R and `--s-tuples` of S (16 bytes each; R's
//! keys unique, the given fraction of S with a partner, see
//! `shuffle::ops::join::data`). The nodes first measure the model's constants: `c_mem`
//! scanning memory with all threads, `c_net` with a calibration shuffle over each
//! design the joins use. Then, per selectivity, every join runs `--repeat` times; the
//! runtime of a run is the slowest node's network pass plus local join (endpoint
//! setup excluded), and the median run is reported. The result rows are summarized
//! (count, checksums, payload sums) and must agree between all joins and with
//! DuckDB's `count(*)`, `sum(r.v)`, `sum(s.v)` over the union of all fragments (DuckDB
//! gets `nodes × threads` threads); a mismatch fails the run. Where nodes live: see
//! [`crate::bench::nodes`].

pub mod node;

use crate::backend::BackendKind;
use crate::bench::duckdb::{self, Table};
use crate::bench::nodes;
use crate::bench::plot::{self, Axes, Series, XAxis};
use crate::bench::shuffle::ThreadingArg;
use crate::bench::{JsonOut, SvgDir, ensure_data_fits, median_run, parse_names};
use anyhow::{Context, Result, bail, ensure};
use clap::Args;
use node::{Job, NodeOutput, STALL_LIMIT};
use serde::Serialize;
use shuffle::ops::join::cost::{self, CostParams, Workload};
use shuffle::ops::join::{Algorithm, JoinStats, RowSummary};
use shuffle::{Phase, Progress};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

#[derive(Args, Debug, Clone)]
pub struct JoinArgs {
    /// Fabric backend: sim runs the nodes as threads of this process; shm, tcp and
    /// verbs as node processes.
    #[arg(long, value_enum, default_value_t = BackendKind::Sim)]
    pub backend: BackendKind,
    /// Nodes.
    #[arg(long, value_name = "N", default_value_t = 2,
          value_parser = clap::value_parser!(u32).range(1..=64))]
    pub nodes: u32,
    /// Threads per node for each phase (sending, receiving, joining).
    #[arg(long, value_name = "T", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..=64))]
    pub threads: u32,
    /// How the network pass runs its T threads: split (T senders and T receivers) or
    /// interleaved (T threads that each send and receive, and file their own node's
    /// tuples straight from their sending buffers).
    #[arg(long, value_enum, default_value_t = ThreadingArg::Split)]
    pub threading: ThreadingArg,
    /// R tuples per node.
    #[arg(long, value_name = "X", default_value_t = 1_000_000,
          value_parser = clap::value_parser!(u64).range(0..=1 << 31))]
    pub r_tuples: u64,
    /// S tuples per node.
    #[arg(long, value_name = "Y", default_value_t = 1_000_000,
          value_parser = clap::value_parser!(u64).range(0..=1 << 31))]
    pub s_tuples: u64,
    /// Bloom filter selectivities: the fractions of S with a partner in R.
    #[arg(long, value_delimiter = ',', default_value = "0.25,0.5,0.75,1.0")]
    pub selectivity: Vec<f64>,
    /// Joins: ghj, ghj-bloom, rdma-ghj, rrj (comma-separated) or all.
    #[arg(long, value_delimiter = ',', default_value = "all")]
    pub joins: Vec<String>,
    /// Runs per join and selectivity (the median is reported); DuckDB runs as often
    /// after a warm-up.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..=100))]
    pub repeat: u64,
    /// Message (buffer) size, header included.
    #[arg(long, value_name = "B", default_value_t = 64 << 10,
          value_parser = clap::value_parser!(u32).range(1024..=(16 << 20)))]
    pub message_bytes: u32,
    /// Bloom filter bits per R key.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub bloom_bits: u32,
    /// Skip the DuckDB peer (the joins are then checked only against each other).
    #[arg(long)]
    pub no_duckdb: bool,
    /// Seed of the generated fragments.
    #[arg(long, default_value_t = 7)]
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

/// One line of the table: a join (or DuckDB) at one selectivity.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    /// A join's name, or `duckdb`.
    pub join: String,
    pub design: String,
    pub selectivity: f64,
    /// The median run (the lower median of an even `--repeat`: a run that happened):
    /// its slowest node's network pass + local join. The row's other figures are the
    /// same run's.
    pub runtime_ms: f64,
    pub runs_ms: Vec<f64>,
    /// R and S tuples of all nodes per second of runtime.
    pub tuples_per_sec: f64,
    /// The cost model's runtime (0 for DuckDB).
    pub predicted_ms: f64,
    pub predicted_network_ms: f64,
    pub predicted_memory_ms: f64,
    /// The network pass and local join of the node that set the median run's time:
    /// they sum to `runtime_ms`.
    pub partition_ms: f64,
    pub local_join_ms: f64,
    /// The median run's slowest endpoint setup (not part of the runtime).
    pub setup_ms: f64,
    /// S tuples shipped, all nodes (after the Bloom filter).
    pub s_sent: u64,
    pub bytes_sent: u64,
    pub partitions_per_node: usize,
    pub bloom_false_positive_rate: f64,
    /// Result rows and the sums of their R and S payloads.
    pub rows: u64,
    pub r_sum: i128,
    pub s_sum: i128,
    /// Agreed with every other join and with DuckDB.
    pub verified: bool,
}

/// The whole run, as `--json` writes it.
#[derive(Debug, Serialize)]
pub struct Report {
    pub backend: String,
    pub nodes: usize,
    pub threads: usize,
    /// The network pass's threads: `split` or `interleaved`.
    pub threading: &'static str,
    pub r_tuples: u64,
    pub s_tuples: u64,
    pub repeat: usize,
    /// The model's constants, averaged over nodes (seconds per byte).
    pub cost: CostParams,
    pub duckdb_version: Option<String>,
    pub duckdb_threads: usize,
    pub runs: Vec<Row>,
    /// RRJ's runtime over GHJ's, per selectivity (below 1: the radix join is faster).
    pub rrj_over_ghj: Vec<(f64, f64)>,
    /// The fastest distributed join's runtime over DuckDB's, per selectivity.
    pub best_over_duckdb: Vec<(f64, String, f64)>,
    pub summary: Vec<String>,
}

/// Of every node's repetitions (`per_node[node][rep]`), each run's time (its slowest
/// node's network pass plus local join, in ms), the median run ([`median_run`]) and
/// the stats of the node that set its time: their network pass and local join sum to
/// the reported runtime.
fn median_join_run<'a>(per_node: &[&'a [JoinStats]]) -> Option<(Vec<f64>, usize, &'a JoinStats)> {
    let repeats = per_node.iter().map(|r| r.len()).min()?;
    let slowest: Vec<&JoinStats> = (0..repeats)
        .map(|rep| {
            per_node
                .iter()
                .map(|r| &r[rep])
                .max_by(|a, b| a.total_secs.total_cmp(&b.total_secs))
        })
        .collect::<Option<_>>()?;
    let runs_ms: Vec<f64> = slowest.iter().map(|s| s.total_secs * 1e3).collect();
    let m = median_run(&runs_ms)?;
    Some((runs_ms, m, slowest[m]))
}

/// The hidden `namdb join-node` subcommand.
pub fn node_main(args: &nodes::NodeArgs) -> Result<()> {
    let job: Job = serde_json::from_str(&args.job).context("--job")?;
    let exchange = nodes::connect(args)?;
    let device = nodes::bind_device(args)?;
    let progress = Arc::new(Progress::default());
    nodes::report_progress(progress.clone(), job.progress_ms)?;
    nodes::print_result(&node::run_node(&job, exchange, device, progress)?)
}

/// A progress line: the run the node furthest behind is at, its phase and count.
fn progress_line(at: Duration, progress: &[Arc<Progress>], job: &Job) -> String {
    let behind = nodes::furthest_behind(progress);
    let mut line = nodes::progress_prefix(at);
    // Calibrating and preparing come before a run (and before the node starts).
    if behind.phase > Phase::Preparing
        && let Some((sel, join, rep)) = job.runs().nth(behind.step as usize)
    {
        line.push_str(&format!(
            "{join} at selectivity {sel}, run {} of {}: ",
            rep + 1,
            job.repeat.max(1)
        ));
    }
    line.push_str(&nodes::phase_text(&behind));
    line
}

pub fn run(args: &JoinArgs) -> Result<()> {
    let joins = parse_names("joins", &args.joins, &Algorithm::ALL)?;
    ensure!(!args.selectivity.is_empty(), "no selectivity given");
    for &s in &args.selectivity {
        ensure!(
            (0.0..=1.0).contains(&s),
            "selectivity {s} is not within 0..=1"
        );
    }
    // The report keys its rows by selectivity: one given twice was merged twice into
    // its summary, and then silently run once.
    crate::bench::refuse_repeats("selectivity", &args.selectivity, f64::to_string)?;
    ensure!(
        args.r_tuples * (args.nodes as u64) < u64::from(u32::MAX),
        "R of {} tuples over all nodes exceeds a node's hash table in the worst case",
        args.r_tuples * args.nodes as u64
    );
    // Each node's fragments of R and S, what it receives of both, its partitions and
    // R's hash table: measured at about three times the fragments' bytes.
    let per_node = (args.r_tuples + args.s_tuples) * 16;
    ensure_data_fits(
        "the join's data",
        per_node
            .saturating_mul(u64::from(args.nodes))
            .saturating_mul(3),
        args.r_tuples.max(args.s_tuples),
        "R or S tuples per node",
    )?;
    let svg = SvgDir::claim_opt(args.svg.as_deref())?;
    let json = JsonOut::open_opt(args.json.as_deref())?;
    let report = JsonOut::unless_failed(json.as_ref(), measure(args, &joins));
    let report = SvgDir::unless_failed(svg.as_ref(), report)?;
    if let Some(json) = &json {
        json.write(&report)?;
        eprintln!("wrote {}", json.path().display());
    }
    if let Some(svg) = &svg {
        let dir = svg.path();
        for f in SvgDir::unless_failed(Some(svg), draw(dir, &report))? {
            eprintln!("wrote {}", f.display());
        }
        svg.keep();
    }
    print_report(&mut std::io::stdout().lock(), &report)
        .context("cannot print the report to stdout")?;
    let failed: Vec<String> = report
        .runs
        .iter()
        .filter(|r| !r.verified)
        .map(|r| format!("{} at {}", r.join, r.selectivity))
        .collect();
    if !failed.is_empty() {
        bail!("results disagree: {}", failed.join(", "));
    }
    Ok(())
}

fn measure(args: &JoinArgs, joins: &[Algorithm]) -> Result<Report> {
    let nodes = args.nodes as usize;
    let threads = args.threads as usize;
    let job = Job {
        joins: joins.to_vec(),
        selectivities: args.selectivity.clone(),
        threads,
        r_tuples: args.r_tuples,
        s_tuples: args.s_tuples,
        seed: args.seed,
        message_bytes: args.message_bytes,
        bloom_bits_per_key: args.bloom_bits,
        repeat: args.repeat as usize,
        calibration_tuples: args.r_tuples.clamp(1 << 14, 1 << 20),
        progress_ms: args.progress_ms,
        interleave: args.threading == ThreadingArg::Interleaved,
    };
    eprintln!(
        "{} join(s) × {} selectivities × {} run(s) on {nodes} {} node(s) × {threads} thread(s) \
         {}, {} R + {} S tuples per node…",
        joins.len(),
        args.selectivity.len(),
        args.repeat,
        args.backend.name(),
        args.threading.name(),
        args.r_tuples,
        args.s_tuples
    );
    let progress = nodes::progress_of(nodes);
    let every = Duration::from_millis(args.progress_ms);
    let line = |at| progress_line(at, &progress, &job);
    let outputs: Vec<NodeOutput> = nodes::reporting(every, line, || match args.backend {
        BackendKind::Sim => nodes::run_threads(nodes, |x, d| {
            let mine = progress[x.rank()].clone();
            node::run_node(&job, x, d, mine)
        }),
        backend => nodes::run_processes_with_progress(
            "join-node",
            backend,
            nodes,
            &serde_json::to_string(&job)?,
            STALL_LIMIT + Duration::from_secs(5),
            &progress,
        ),
    })?;
    let avg = |f: fn(&CostParams) -> f64| {
        outputs.iter().map(|o| f(&o.cost)).sum::<f64>() / outputs.len().max(1) as f64
    };
    let params = CostParams {
        c_mem: avg(|c| c.c_mem),
        c_net: avg(|c| c.c_net),
        c_net_rdma: avg(|c| c.c_net_rdma),
    };
    let duckdb_threads = nodes * threads;
    let mut runs = Vec::new();
    let mut duckdb_version = None;
    let mut duckdb_reported_threads = duckdb_threads;
    for &selectivity in &args.selectivity {
        let mut of_sel: Vec<Row> = joins
            .iter()
            .map(|&a| summarize(args, &job, &params, &outputs, a, selectivity))
            .collect::<Result<_>>()?;
        let first = of_sel.first().map(|r| (r.rows, r.r_sum, r.s_sum));
        let summaries: Vec<RowSummary> = joins
            .iter()
            .map(|&a| merged_summary(&outputs, a, selectivity))
            .collect();
        let agree = summaries.windows(2).all(|w| w[0] == w[1]);
        let duck = if args.no_duckdb {
            None
        } else {
            eprintln!("DuckDB at selectivity {selectivity}…");
            let t = duckdb_run(
                &job,
                nodes,
                selectivity,
                args.repeat as usize,
                duckdb_threads,
            )?;
            duckdb_version = Some(t.version.clone());
            duckdb_reported_threads = t.threads;
            let result = (
                u64::try_from(t.value(0, 0)?).context("DuckDB's count")?,
                t.value(0, 1)?,
                t.value(0, 2)?,
            );
            Some((t, result))
        };
        let duck_agrees = duck.as_ref().is_none_or(|(_, d)| Some(*d) == first);
        for row in &mut of_sel {
            row.verified = agree && duck_agrees;
            eprintln!(
                "  {:<9} sel {selectivity:<4} {:>9.1} ms (model {:>8.1} ms), {} rows{}",
                row.join,
                row.runtime_ms,
                row.predicted_ms,
                row.rows,
                if row.verified { "" } else { "  MISMATCH" }
            );
        }
        runs.extend(of_sel);
        if let Some((t, (count, r_sum, s_sum))) = duck {
            let total = nodes as f64 * (args.r_tuples + args.s_tuples) as f64;
            eprintln!(
                "  duckdb    sel {selectivity:<4} {:>9.1} ms, {count} rows",
                t.median_ms
            );
            runs.push(Row {
                join: "duckdb".into(),
                design: "-".into(),
                selectivity,
                runtime_ms: t.median_ms,
                runs_ms: t.runs_ms.clone(),
                tuples_per_sec: total / (t.median_ms / 1e3).max(1e-12),
                predicted_ms: 0.0,
                predicted_network_ms: 0.0,
                predicted_memory_ms: 0.0,
                partition_ms: 0.0,
                local_join_ms: 0.0,
                setup_ms: t.load_ms,
                s_sent: 0,
                bytes_sent: 0,
                partitions_per_node: 0,
                bloom_false_positive_rate: 0.0,
                rows: count,
                r_sum,
                s_sum,
                verified: agree && duck_agrees,
            });
        }
    }
    let (rrj_over_ghj, best_over_duckdb, summary) = ratios(&args.selectivity, &runs);
    Ok(Report {
        backend: args.backend.name().into(),
        threading: args.threading.name(),
        nodes,
        threads,
        r_tuples: args.r_tuples,
        s_tuples: args.s_tuples,
        repeat: args.repeat as usize,
        cost: params,
        duckdb_version,
        duckdb_threads: duckdb_reported_threads,
        runs,
        rrj_over_ghj,
        best_over_duckdb,
        summary,
    })
}

fn merged_summary(outputs: &[NodeOutput], algorithm: Algorithm, selectivity: f64) -> RowSummary {
    let mut total = RowSummary::default();
    for o in outputs {
        for run in &o.runs {
            if run.algorithm == algorithm && run.selectivity == selectivity {
                total.merge(&run.summary);
            }
        }
    }
    total
}

/// The row of `algorithm` at `selectivity` from every node's runs.
fn summarize(
    args: &JoinArgs,
    job: &Job,
    params: &CostParams,
    outputs: &[NodeOutput],
    algorithm: Algorithm,
    selectivity: f64,
) -> Result<Row> {
    let per_node: Vec<&node::NodeRun> = outputs
        .iter()
        .map(|o| {
            o.runs
                .iter()
                .find(|r| r.algorithm == algorithm && r.selectivity == selectivity)
                .with_context(|| {
                    format!("node {} did not run {algorithm} at {selectivity}", o.rank)
                })
        })
        .collect::<Result<_>>()?;
    let stats: Vec<&[JoinStats]> = per_node.iter().map(|r| &r.stats[..]).collect();
    let (runs_ms, m, slowest) = median_join_run(&stats)
        .with_context(|| format!("{algorithm} at {selectivity}: no runs"))?;
    let runtime_ms = runs_ms[m];
    // Every figure of the row is the median run's.
    let of_median: Vec<_> = per_node.iter().map(|r| &r.stats[m]).collect();
    let s_in: u64 = of_median.iter().map(|s| s.s_in).sum();
    let s_sent: u64 = of_median.iter().map(|s| s.s_sent).sum();
    let nodes = outputs.len();
    let work = Workload {
        r_tuples: job.r_tuples as f64,
        s_tuples: job.s_tuples as f64,
        selectivity: if s_in == 0 {
            1.0
        } else {
            s_sent as f64 / s_in as f64
        },
        bloom_bytes: (of_median[0].bloom_words * 8 * nodes.saturating_sub(1)) as f64,
    };
    let predicted = cost::predict(params, algorithm, &work);
    let summary = merged_summary(outputs, algorithm, selectivity);
    let total = nodes as f64 * (args.r_tuples + args.s_tuples) as f64;
    Ok(Row {
        join: algorithm.name().into(),
        design: of_median[0].design.clone(),
        selectivity,
        runtime_ms,
        runs_ms,
        tuples_per_sec: total / (runtime_ms / 1e3).max(1e-12),
        predicted_ms: predicted.seconds * 1e3,
        predicted_network_ms: predicted.network_seconds * 1e3,
        predicted_memory_ms: predicted.memory_seconds * 1e3,
        partition_ms: slowest.partition_secs * 1e3,
        local_join_ms: slowest.join_secs * 1e3,
        setup_ms: of_median.iter().map(|s| s.setup_secs).fold(0.0, f64::max) * 1e3,
        s_sent,
        bytes_sent: of_median.iter().map(|s| s.bytes_sent).sum(),
        partitions_per_node: of_median[0].partitions_per_node,
        bloom_false_positive_rate: of_median[0].bloom_false_positive_rate,
        rows: summary.count,
        r_sum: summary.r_sum,
        s_sum: summary.s_sum,
        verified: false,
    })
}

/// Loads the union of every node's fragments into DuckDB and times the join there.
fn duckdb_run(
    job: &Job,
    nodes: usize,
    selectivity: f64,
    repeat: usize,
    threads: usize,
) -> Result<duckdb::Timing> {
    let spec = job.spec(nodes, selectivity);
    let (mut rk, mut rv, mut sk, mut sv) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for rank in 0..nodes {
        let (r, s) = spec.fragment(rank)?;
        rk.extend(r.iter().map(|t| t[0] as i64));
        rv.extend(r.iter().map(|t| t[1] as i64));
        sk.extend(s.iter().map(|t| t[0] as i64));
        sv.extend(s.iter().map(|t| t[1] as i64));
    }
    // Removed on Ctrl-C too: DuckDB's column files are the whole data set.
    let dir = crate::interrupt::TempDir::new("namdb-join-duckdb-")?;
    duckdb::run(
        dir.path(),
        &[
            Table {
                name: "r",
                columns: vec![("k", &rk), ("v", &rv)],
            },
            Table {
                name: "s",
                columns: vec![("k", &sk), ("v", &sv)],
            },
        ],
        "SELECT count(*), sum(r.v), sum(s.v) FROM r JOIN s USING (k)",
        repeat,
        threads,
    )
}

type Ratios = (Vec<(f64, f64)>, Vec<(f64, String, f64)>, Vec<String>);

fn ratios(selectivities: &[f64], runs: &[Row]) -> Ratios {
    let find = |join: &str, sel: f64| runs.iter().find(|r| r.join == join && r.selectivity == sel);
    let mut rrj_over_ghj = Vec::new();
    let mut best_over_duckdb = Vec::new();
    for &sel in selectivities {
        if let (Some(rrj), Some(ghj)) = (find("rrj", sel), find("ghj", sel)) {
            rrj_over_ghj.push((sel, rrj.runtime_ms / ghj.runtime_ms.max(1e-9)));
        }
        let best = runs
            .iter()
            .filter(|r| r.selectivity == sel && r.join != "duckdb")
            .min_by(|a, b| a.runtime_ms.total_cmp(&b.runtime_ms));
        if let (Some(best), Some(duck)) = (best, find("duckdb", sel)) {
            best_over_duckdb.push((
                sel,
                best.join.clone(),
                best.runtime_ms / duck.runtime_ms.max(1e-9),
            ));
        }
    }
    let mut summary = Vec::new();
    if !rrj_over_ghj.is_empty() {
        let parts: Vec<String> = rrj_over_ghj
            .iter()
            .map(|(s, q)| format!("{s}: {:.2}×", 1.0 / q.max(1e-12)))
            .collect();
        summary.push(format!(
            "radix join vs GHJ (GHJ time / RRJ time; above 1: RRJ faster): {}",
            parts.join(", ")
        ));
    }
    if !best_over_duckdb.is_empty() {
        let parts: Vec<String> = best_over_duckdb
            .iter()
            .map(|(s, j, q)| format!("{s}: {j} {q:.2}×"))
            .collect();
        summary.push(format!(
            "best distributed join vs DuckDB (its time / DuckDB's; goal ≤ 1.5): {}",
            parts.join(", ")
        ));
    }
    (rrj_over_ghj, best_over_duckdb, summary)
}

fn print_report(out: &mut impl Write, report: &Report) -> std::io::Result<()> {
    writeln!(
        out,
        "namdb bench join: backend {}, {} nodes × {} thread(s) {}, {} R + {} S tuples (16 B) \
         per node, median of {} run(s); DuckDB {} with {} threads",
        report.backend,
        report.nodes,
        report.threads,
        report.threading,
        report.r_tuples,
        report.s_tuples,
        report.repeat,
        report.duckdb_version.as_deref().unwrap_or("not run"),
        report.duckdb_threads
    )?;
    writeln!(
        out,
        "cost model constants: c_mem {:.3} ns/B ({:.2} GB/s), c_net {:.3} ns/B (send/receive), \
         {:.3} ns/B (WRITE)",
        report.cost.c_mem * 1e9,
        1e-9 / report.cost.c_mem.max(1e-18),
        report.cost.c_net * 1e9,
        report.cost.c_net_rdma * 1e9
    )?;
    writeln!(
        out,
        "runtime: the slowest node's network pass + local join; model: the paper's formulas \
         with these constants"
    )?;
    writeln!(out)?;
    writeln!(
        out,
        "{:<10} {:>5} {:>10} {:>10} {:>10} {:>9} {:>9} {:>7} {:>10} {:>11} {:>8}",
        "join",
        "sel",
        "ms",
        "model ms",
        "Mtuples/s",
        "net ms",
        "local ms",
        "parts",
        "S sent",
        "rows",
        "verified"
    )?;
    for r in &report.runs {
        let model = if r.join == "duckdb" {
            "-".to_string()
        } else {
            format!("{:.1}", r.predicted_ms)
        };
        writeln!(
            out,
            "{:<10} {:>5} {:>10.1} {:>10} {:>10.2} {:>9.1} {:>9.1} {:>7} {:>10} {:>11} {:>8}",
            r.join,
            r.selectivity,
            r.runtime_ms,
            model,
            r.tuples_per_sec / 1e6,
            r.partition_ms,
            r.local_join_ms,
            r.partitions_per_node,
            r.s_sent,
            r.rows,
            if r.verified { "yes" } else { "NO" }
        )?;
    }
    writeln!(out)?;
    for l in &report.summary {
        writeln!(out, "{l}")?;
    }
    Ok(())
}

/// `join-runtime.svg`: measured runtime against selectivity per join and DuckDB;
/// `join-model.svg`: the model's runtime per join.
fn draw(dir: &Path, report: &Report) -> Result<Vec<PathBuf>> {
    let mut names: Vec<&str> = Vec::new();
    for r in &report.runs {
        if !names.contains(&r.join.as_str()) {
            names.push(&r.join);
        }
    }
    let series = |value: fn(&Row) -> f64, skip_duckdb: bool| -> Vec<Series> {
        names
            .iter()
            .filter(|n| !(skip_duckdb && **n == "duckdb"))
            .map(|n| Series {
                label: n.to_string(),
                points: report
                    .runs
                    .iter()
                    .filter(|r| r.join == *n)
                    .map(|r| (r.selectivity, value(r)))
                    .collect(),
            })
            .collect()
    };
    let tail = format!(
        "{} nodes × {} thread(s), {}, {} R + {} S per node",
        report.nodes, report.threads, report.backend, report.r_tuples, report.s_tuples
    );
    let axes = Axes {
        x: "Bloom filter selectivity",
        y: "runtime (ms)",
    };
    let mut files = Vec::new();
    let path = dir.join("join-runtime.svg");
    plot::line_svg(
        &path,
        &format!("join runtime ({tail})"),
        XAxis::Linear,
        &axes,
        &series(|r| r.runtime_ms, false),
    )
    .map_err(anyhow::Error::msg)?;
    files.push(path);
    let path = dir.join("join-model.svg");
    plot::line_svg(
        &path,
        &format!("cost model ({tail})"),
        XAxis::Linear,
        &axes,
        &series(|r| r.predicted_ms, true),
    )
    .map_err(anyhow::Error::msg)?;
    files.push(path);
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stats(partition_ms: f64, join_ms: f64, setup_ms: f64) -> JoinStats {
        JoinStats {
            partition_secs: partition_ms / 1e3,
            join_secs: join_ms / 1e3,
            total_secs: (partition_ms + join_ms) / 1e3,
            setup_secs: setup_ms / 1e3,
            ..JoinStats::default()
        }
    }

    /// An even --repeat once reported the mean of the two middle runs, and each phase
    /// as the mean of its own middle runs: figures of no run, which did not add up.
    #[test]
    fn the_median_of_an_even_count_is_one_run_whose_phases_sum_to_it() {
        // Runs (slowest node): 30, 10, 40, 20 ms; node 1 sets runs 0 and 3's time.
        let node0 = [
            stats(5.0, 5.0, 1.0),
            stats(2.0, 8.0, 9.0),
            stats(35.0, 5.0, 1.0),
            stats(1.0, 1.0, 2.0),
        ];
        let node1 = [
            stats(10.0, 20.0, 3.0),
            stats(1.0, 1.0, 1.0),
            stats(1.0, 1.0, 1.0),
            stats(15.0, 5.0, 1.0),
        ];
        let (runs_ms, m, slowest) = median_join_run(&[&node0, &node1]).unwrap();
        for (got, want) in runs_ms.iter().zip([30.0, 10.0, 40.0, 20.0]) {
            assert!((got - want).abs() < 1e-9, "{runs_ms:?}");
        }
        // 20 ms, the lower of the middle two (not 25), from node 1's run 3.
        assert_eq!(m, 3);
        assert_eq!(slowest, &node1[3]);
        let (p, j) = (slowest.partition_secs * 1e3, slowest.join_secs * 1e3);
        assert!(
            (p + j - runs_ms[m]).abs() < 1e-9,
            "{p} + {j} != {}",
            runs_ms[m]
        );
        assert_eq!(median_join_run(&[&node0, &[]]), None);
    }
}
