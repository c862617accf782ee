//! `namdb bench shuffle`: the microbenchmark of Liu, Yin and Blanas (TODS 2019, §7.1)
//! for the eight endpoint designs of the `shuffle` crate, with a TCP sockets baseline
//! and an OpenMPI baseline in the same run.
//!
//! Each node holds a fragment of R(a, b) (`--tuples` tuples of two 8-byte columns, a
//! uniform, b unique), randomly permuted; it opens the endpoints (timed: `setup_ms`),
//! waits at a barrier, scans its fragment with `--threads` sender threads and
//! repartitions it on `a mod N` (or broadcasts it to every other node) while as many
//! receiver threads consume every tuple into a checksum, which is checked exactly
//! against what the other nodes sent (see [`node`]). Per run it reports the bytes
//! received per node per second (the median over nodes, the minimum alongside), the
//! memcpy bandwidth of the same fragment measured in the same run, the bytes pinned
//! for buffers and the setup time. Where nodes live: see [`procs`].

mod mpi;
pub mod node;
mod plot;
pub mod procs;

use crate::backend::BackendKind;
use crate::bench::{JsonOut, SvgDir, ensure_data_fits, parse_names};
use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use node::{Job, Method, NodeResult, Pattern};
use serde::Serialize;
use shuffle::{Design, Notify, Transport};
use std::io::Write;
use std::path::{Path, PathBuf};

/// The message sizes of `--sweep-message-sizes`.
const SWEEP: [u32; 5] = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20];

#[derive(Args, Debug, Clone)]
pub struct ShuffleArgs {
    /// Designs by their paper names (SESQ/SR, MESQ/SR, SEMQ/SR, MEMQ/SR, SEMQ/RD,
    /// MEMQ/RD, SEMQ/WR, MEMQ/WR), comma-separated, `all`, or `none` (the baselines
    /// only).
    #[arg(long, value_delimiter = ',', default_value = "all")]
    pub design: Vec<String>,
    /// Fabric backend: sim runs the nodes as threads of this process; shm, tcp and
    /// verbs as node processes.
    #[arg(long, value_enum, default_value_t = BackendKind::Sim)]
    pub backend: BackendKind,
    /// Nodes (N).
    #[arg(long, value_name = "N", default_value_t = 2,
          value_parser = clap::value_parser!(u32).range(2..=64))]
    pub nodes: u32,
    /// Sender threads per node, and as many receiver threads (`--threading split`);
    /// threads that each both send and receive (`--threading interleaved`).
    #[arg(long, value_name = "T", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..=64))]
    pub threads: u32,
    /// How a design's node runs its T threads, comma-separated to run both: split
    /// (T senders and T receivers) or interleaved (T threads that each send and
    /// receive, so a node with a core per thread never trades a core between a
    /// sender and a receiver). The TCP baseline always runs split.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "split")]
    pub threading: Vec<ThreadingArg>,
    /// How an interleaved node gets the tuples it sends itself, comma-separated to run
    /// both: in-place (consumed in the sending buffer once it fills, no copy; the
    /// default) or fabric (sent through the fabric's loopback like the rest, as the
    /// paper's operator and a split node do).
    #[arg(long, value_enum, value_delimiter = ',')]
    pub own_partition: Option<Vec<OwnPartitionArg>>,
    /// Tuples in each node's fragment of R (16 bytes each).
    #[arg(long, value_name = "X", default_value_t = 1_000_000,
          value_parser = clap::value_parser!(u64).range(1..=1 << 32))]
    pub tuples: u64,
    /// Transmission pattern.
    #[arg(long, value_enum, default_value_t = PatternArg::Both)]
    pub pattern: PatternArg,
    /// Message (buffer) size of the RC designs and of the baselines, header included.
    #[arg(long, value_name = "B", default_value_t = 64 << 10,
          value_parser = clap::value_parser!(u32).range(64..=(16 << 20)))]
    pub message_bytes: u32,
    /// Run every RC design and baseline at 4 KiB, 16 KiB, 64 KiB, 256 KiB and 1 MiB.
    #[arg(long, conflicts_with = "message_bytes")]
    pub sweep_message_sizes: bool,
    /// Buffers in circulation: adaptive (§6.2) or bdp (fixed, bandwidth-delay product).
    #[arg(long, value_enum, default_value_t = BufferingArg::Adaptive)]
    pub buffering: BufferingArg,
    /// How a WR receiver learns of data: seal, mq or cq.
    #[arg(long, default_value = "cq", value_parser = parse_notify)]
    pub notify: Notify,
    /// Baselines in the same run: tcp, mpi (comma-separated), or none. Default tcp,mpi;
    /// without OpenMPI installed the MPI baseline is then skipped with a note, while an
    /// explicit `--baselines mpi` fails.
    #[arg(long, value_enum, value_delimiter = ',')]
    pub baselines: Option<Vec<BaselineArg>>,
    /// Pin each node to its own T cores (node r on CPUs rT … rT+T−1 of those this
    /// process may use, wrapping around when there are fewer), and bind each MPI rank
    /// to a core. Unpinned, the scheduler now and then starts two nodes on one core and
    /// moves one only milliseconds later, which splits runs of 0.1 s into a fast and a
    /// slow kind. Split threading puts a node's sender and receiver threads on its T
    /// cores.
    #[arg(long)]
    pub pin: bool,
    /// Seed of the generated fragments.
    #[arg(long, default_value_t = 7)]
    pub seed: u64,
    /// Runs of every design and baseline, round robin (so drift in the machine's speed
    /// reaches them alike); each reports its median run.
    #[arg(long, value_name = "R", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..=100))]
    pub repeat: u32,
    /// Also write the runs to FILE as a JSON list.
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

fn parse_notify(s: &str) -> Result<Notify, String> {
    s.parse().map_err(|e: shuffle::ShuffleError| e.to_string())
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum PatternArg {
    Repartition,
    Broadcast,
    Both,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BufferingArg {
    Adaptive,
    Bdp,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ThreadingArg {
    Split,
    Interleaved,
}

/// The name of a run's threading in the report and the JSON.
fn threading_name(interleave: bool) -> &'static str {
    if interleave { "interleaved" } else { "split" }
}

impl ThreadingArg {
    pub fn name(self) -> &'static str {
        threading_name(self == ThreadingArg::Interleaved)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum OwnPartitionArg {
    InPlace,
    Fabric,
}

/// How a run's nodes got their own tuples, in the report and the JSON: `-` in a
/// broadcast, where a node sends itself nothing.
fn own_partition_name(job: &Job) -> &'static str {
    if job.pattern == Pattern::Broadcast {
        "-"
    } else if job.interleave && !job.own_via_fabric {
        "in-place"
    } else {
        "fabric"
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BaselineArg {
    Tcp,
    Mpi,
    None,
}

/// One run: a line of the table and an object of the JSON list.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    /// A design's paper name, or `tcp` / `mpi` for the baselines.
    pub design: String,
    /// The fabric backend; `loopback` for the TCP baseline, `shm` for MPI, whose ranks
    /// talk through shared memory whatever `--backend` says.
    pub backend: String,
    /// MPI's transport beneath `backend`: `vader`, OpenMPI's shared-memory BTL
    /// (`None` for the other rows).
    pub transport: Option<String>,
    pub pattern: &'static str,
    pub nodes: usize,
    pub threads: usize,
    /// `split` (`threads` senders and as many receivers per node), `interleaved`
    /// (`threads` threads that each do both), or `-` for MPI (a rank is one thread).
    pub threading: &'static str,
    /// How a node got the tuples it sent itself: `in-place` (an interleaved node
    /// consumed them in its sending buffers), `fabric` (through the fabric's or the
    /// socket's loopback), or `-` in a broadcast (a node sends itself nothing) and for
    /// MPI (its Alltoallv copies a rank's own block).
    pub own_partition: &'static str,
    pub message_bytes: u32,
    pub tuples: u64,
    /// Bytes received per node per second, 10^9 units: the median over nodes.
    pub gb_per_sec: f64,
    /// The slowest node's.
    pub gb_per_sec_min: f64,
    /// Each node copying its fragment into another array, all at once (median).
    pub memcpy_gb_per_sec: f64,
    /// Each node partitioning its fragment over the nodes with nothing sent, all at
    /// once (median; `None` for MPI, whose program does not measure it).
    pub partition_gb_per_sec: Option<f64>,
    /// Each node doing a repartition's whole work on its core with nothing sent:
    /// partitioning, the copy of what goes to other nodes, and consuming every tuple,
    /// all at once (median; `None` in a broadcast and for MPI). What a one-core node
    /// cannot exceed whatever its transport.
    pub work_alone_gb_per_sec: Option<f64>,
    /// Bytes registered for buffers, the most over nodes (0 for the baselines).
    pub pinned_bytes: u64,
    /// Each node pinned to its own cores (`--pin`; MPI: each rank bound to a core).
    pub pinned: bool,
    /// Per node by rank, the CPUs it could run on, as the system reported them after
    /// the run (`None` for MPI).
    pub node_cpus: Option<Vec<Vec<usize>>>,
    /// Opening the endpoints (connecting the sockets; MPI_Init), the slowest node.
    pub setup_ms: f64,
    /// The shuffle, the slowest node.
    pub seconds: f64,
    /// Bytes received, all nodes.
    pub received_bytes: u64,
    /// Every node received exactly what was sent to it (a run that fails this fails).
    pub verified: bool,
    pub buffering: &'static str,
    pub notify: String,
    /// Every run's `gb_per_sec` in the order they ran (`--repeat`); the row's other
    /// figures are the median run's.
    pub gb_per_sec_runs: Vec<f64>,
}

impl Row {
    /// The design or baseline, and the threading when it is not the default.
    pub fn label(&self) -> String {
        match (self.threading, self.own_partition) {
            ("interleaved", "fabric") => format!("{} interleaved, own via fabric", self.design),
            ("interleaved", _) => format!("{} interleaved", self.design),
            _ => self.design.clone(),
        }
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        0.0
    } else if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn summarize(args: &ShuffleArgs, job: &Job, design: String, results: &[NodeResult]) -> Row {
    let rates: Vec<f64> = results
        .iter()
        .map(|r| r.received_bytes as f64 / r.seconds.max(1e-9) / 1e9)
        .collect();
    Row {
        design,
        backend: match job.method {
            Method::Tcp => "loopback".into(),
            Method::Design(_) => args.backend.name().into(),
        },
        transport: None,
        pattern: job.pattern.name(),
        nodes: results.len(),
        threads: job.threads,
        threading: threading_name(job.interleave),
        own_partition: own_partition_name(job),
        message_bytes: job.message_bytes,
        tuples: job.tuples,
        gb_per_sec: median(rates.clone()),
        gb_per_sec_min: rates.iter().copied().fold(f64::INFINITY, f64::min),
        memcpy_gb_per_sec: median(results.iter().map(|r| r.memcpy_gb_per_sec).collect()),
        partition_gb_per_sec: Some(median(
            results.iter().map(|r| r.partition_gb_per_sec).collect(),
        )),
        work_alone_gb_per_sec: results
            .iter()
            .map(|r| r.work_alone_gb_per_sec)
            .collect::<Option<Vec<f64>>>()
            .map(median),
        pinned_bytes: results.iter().map(|r| r.pinned_bytes).max().unwrap_or(0),
        pinned: job.pin,
        node_cpus: Some(results.iter().map(|r| r.cpus.clone()).collect()),
        setup_ms: results.iter().map(|r| r.setup_ms).fold(0.0, f64::max),
        seconds: results.iter().map(|r| r.seconds).fold(0.0, f64::max),
        received_bytes: results.iter().map(|r| r.received_bytes).sum(),
        verified: true,
        buffering: buffering_name(args.buffering),
        notify: args.notify.to_string(),
        gb_per_sec_runs: Vec::new(),
    }
}

/// Of the rows of several rounds, the median run of each design, baseline, pattern
/// and message size (the lower median of an even count: a run that happened), in the
/// order of the first round, with every run's throughput beside it.
fn median_runs(all: Vec<Row>) -> Vec<Row> {
    let key = |r: &Row| (r.label(), r.pattern, r.message_bytes);
    let mut groups: Vec<Vec<Row>> = Vec::new();
    for row in all {
        match groups.iter_mut().find(|g| key(&g[0]) == key(&row)) {
            Some(g) => g.push(row),
            None => groups.push(vec![row]),
        }
    }
    groups
        .into_iter()
        .map(|mut runs| {
            let rates: Vec<f64> = runs.iter().map(|r| r.gb_per_sec).collect();
            runs.sort_by(|a, b| a.gb_per_sec.total_cmp(&b.gb_per_sec));
            let mut row = runs.swap_remove((runs.len() - 1) / 2);
            row.gb_per_sec_runs = rates;
            row
        })
        .collect()
}

fn buffering_name(b: BufferingArg) -> &'static str {
    match b {
        BufferingArg::Adaptive => "adaptive",
        BufferingArg::Bdp => "bdp",
    }
}

/// The designs asked for.
fn designs(names: &[String]) -> Result<Vec<Design>> {
    let nones = names
        .iter()
        .filter(|n| n.trim().eq_ignore_ascii_case("none"))
        .count();
    if nones > 0 {
        if nones > 1 {
            bail!("--design lists none twice");
        }
        if names.len() > 1 {
            bail!("--design none cannot be combined with designs");
        }
        return Ok(Vec::new());
    }
    parse_names("design", names, &Design::ALL)
}

fn patterns(p: PatternArg) -> Vec<Pattern> {
    match p {
        PatternArg::Repartition => vec![Pattern::Repartition],
        PatternArg::Broadcast => vec![Pattern::Broadcast],
        PatternArg::Both => vec![Pattern::Repartition, Pattern::Broadcast],
    }
}

/// The message sizes a design (`rc`) or baseline runs at. The UD designs send
/// datagrams of at most [`fabric::UD_MTU`] bytes whatever `--message-bytes` says, so
/// that is what their rows report and what their buffering and partitioning
/// reference are sized for.
fn sizes(args: &ShuffleArgs, rc: bool) -> Vec<u32> {
    if !rc {
        vec![fabric::UD_MTU]
    } else if args.sweep_message_sizes {
        SWEEP.to_vec()
    } else {
        vec![args.message_bytes]
    }
}

fn size_name(b: u32) -> String {
    if b >= 1 << 20 && b.is_multiple_of(1 << 20) {
        format!("{} MiB", b >> 20)
    } else if b >= 1024 && b.is_multiple_of(1024) {
        format!("{} KiB", b >> 10)
    } else {
        format!("{b} B")
    }
}

/// A byte count to one decimal in KiB, MiB or GiB.
fn bytes_name(b: u64) -> String {
    let b = b as f64;
    if b >= (1u64 << 30) as f64 {
        format!("{:.1} GiB", b / (1u64 << 30) as f64)
    } else if b >= (1 << 20) as f64 {
        format!("{:.1} MiB", b / (1 << 20) as f64)
    } else {
        format!("{:.1} KiB", b / 1024.0)
    }
}

pub fn run(args: &ShuffleArgs) -> Result<()> {
    let designs = designs(&args.design)?;
    // The nodes' fragments, and the buffers and copies of what they send and
    // receive: measured at about twice the fragments' bytes.
    ensure_data_fits(
        "the shuffle's data",
        (args.tuples * 16)
            .saturating_mul(u64::from(args.nodes))
            .saturating_mul(2),
        args.tuples,
        "tuples per node",
    )?;
    if let Some(b) = &args.baselines {
        crate::bench::refuse_repeats("baselines", b, |b| crate::bench::value_name(*b))?;
    }
    crate::bench::refuse_repeats("threading", &args.threading, |t| {
        crate::bench::value_name(*t)
    })?;
    if let Some(own) = &args.own_partition {
        crate::bench::refuse_repeats("own-partition", own, |o| crate::bench::value_name(*o))?;
        if !args.threading.contains(&ThreadingArg::Interleaved) {
            bail!(
                "--own-partition applies to interleaved nodes only (a split node's sender \
                 cannot consume: its own tuples always go through the fabric); add \
                 --threading interleaved"
            );
        }
    }
    if let Some(b) = &args.baselines
        && b.contains(&BaselineArg::None)
        && b.len() > 1
    {
        bail!("--baselines none cannot be combined with other baselines");
    }
    if designs.is_empty()
        && args
            .baselines
            .as_ref()
            .is_some_and(|b| b.contains(&BaselineArg::None))
    {
        bail!("--design none and --baselines none leave nothing to run");
    }
    let (want_tcp, want_mpi, mpi_explicit) = match &args.baselines {
        None => (true, true, false),
        Some(b) if b.contains(&BaselineArg::None) => (false, false, false),
        Some(b) => (
            b.contains(&BaselineArg::Tcp),
            b.contains(&BaselineArg::Mpi),
            b.contains(&BaselineArg::Mpi),
        ),
    };
    let mpi_ok = if want_mpi {
        match mpi::available() {
            Ok(()) => true,
            Err(why) if mpi_explicit => bail!("the MPI baseline cannot run: {why}"),
            Err(why) => {
                eprintln!("note: skipping the MPI baseline: {why}");
                false
            }
        }
    } else {
        false
    };
    let svg = SvgDir::claim_opt(args.svg.as_deref())?;
    let json = JsonOut::open_opt(args.json.as_deref())?;
    let rows = JsonOut::unless_failed(json.as_ref(), measure(args, &designs, want_tcp, mpi_ok));
    let rows = SvgDir::unless_failed(svg.as_ref(), rows)?;
    if let Some(json) = &json {
        json.write(&rows)?;
        eprintln!("wrote {}", json.path().display());
    }
    if let Some(svg) = &svg {
        let dir = svg.path();
        for f in SvgDir::unless_failed(Some(svg), draw(dir, args, &rows))? {
            eprintln!("wrote {}", f.display());
        }
        svg.keep();
    }
    print_report(&mut std::io::stdout().lock(), args, &rows)
        .context("cannot print the report to stdout")?;
    Ok(())
}

/// A planned run.
enum Plan {
    Node(Job),
    Mpi { message_bytes: u32 },
}

fn measure(args: &ShuffleArgs, designs: &[Design], tcp: bool, mpi: bool) -> Result<Vec<Row>> {
    let threads = args.threads as usize;
    let own_ways: Vec<bool> = match &args.own_partition {
        Some(own) => own.iter().map(|&o| o == OwnPartitionArg::Fabric).collect(),
        None => vec![false],
    };
    let job = |method: Method, pattern: Pattern, message_bytes: u32, interleave: bool| Job {
        method,
        pattern,
        threads,
        tuples: args.tuples,
        seed: args.seed,
        message_bytes,
        buffering: buffering_name(args.buffering).into(),
        notify: args.notify.to_string(),
        progress_ms: args.progress_ms,
        interleave,
        own_via_fabric: false,
        pin: args.pin,
    };
    let mut plans = Vec::new();
    for pattern in patterns(args.pattern) {
        for d in designs {
            for &threading in &args.threading {
                let interleave = threading == ThreadingArg::Interleaved;
                // A broadcasting node sends itself nothing: one way is all there is.
                let ways = if interleave && pattern == Pattern::Repartition {
                    &own_ways[..]
                } else {
                    &[false][..]
                };
                for &own_via_fabric in ways {
                    for b in sizes(args, d.transport != Transport::SqSr) {
                        let method = Method::Design(d.to_string());
                        plans.push(Plan::Node(Job {
                            own_via_fabric,
                            ..job(method, pattern, b, interleave)
                        }));
                    }
                }
            }
        }
        if tcp {
            for b in sizes(args, true) {
                plans.push(Plan::Node(job(Method::Tcp, pattern, b, false)));
            }
        }
    }
    if mpi {
        for b in sizes(args, true) {
            plans.push(Plan::Mpi { message_bytes: b });
        }
    }
    let total = plans.len();
    let repeat = args.repeat as usize;
    let mut rows = Vec::new();
    for round in 0..repeat {
        if repeat > 1 {
            eprintln!("round {} of {repeat}", round + 1);
        }
        for (i, plan) in plans.iter().enumerate() {
            measure_plan(args, plan, (i, total), &mut rows)?;
        }
    }
    Ok(median_runs(rows))
}

/// Runs one planned run, the `i`-th of `total`, adding its rows to `rows`.
fn measure_plan(
    args: &ShuffleArgs,
    plan: &Plan,
    (i, total): (usize, usize),
    rows: &mut Vec<Row>,
) -> Result<()> {
    let (nodes, threads) = (args.nodes as usize, args.threads as usize);
    match plan {
        Plan::Node(job) => {
            let name = match &job.method {
                Method::Design(d) => d.clone(),
                Method::Tcp => "tcp".into(),
            };
            eprintln!(
                "[{:>2}/{total}] {name} {}, {} messages, {nodes} nodes × {threads} thread(s) \
                 {}{} on {}…",
                i + 1,
                job.pattern.name(),
                size_name(job.message_bytes),
                threading_name(job.interleave),
                if job.interleave && job.own_via_fabric {
                    " (own tuples via the fabric)"
                } else {
                    ""
                },
                if job.method == Method::Tcp {
                    "loopback TCP"
                } else {
                    args.backend.name()
                },
            );
            let results = match procs::run(args.backend, nodes, job) {
                Ok(r) => r,
                Err(e) => {
                    return Err(e.context(format!(
                        "{name} {} with {} messages on {} failed",
                        job.pattern.name(),
                        size_name(job.message_bytes),
                        args.backend.name()
                    )));
                }
            };
            let row = summarize(args, job, name, &results);
            eprintln!(
                "        {:.3} GB/s per node (min {:.3}), memcpy {:.2} GB/s, partition {:.2} GB/s, \
                 {}setup {:.1} ms",
                row.gb_per_sec,
                row.gb_per_sec_min,
                row.memcpy_gb_per_sec,
                row.partition_gb_per_sec.unwrap_or_default(),
                row.work_alone_gb_per_sec
                    .map_or_else(String::new, |w| format!("work alone {w:.2} GB/s, ")),
                row.setup_ms
            );
            rows.push(row);
        }
        &Plan::Mpi { message_bytes } => {
            let pattern = match args.pattern {
                PatternArg::Repartition => "repartition",
                PatternArg::Broadcast => "broadcast",
                PatternArg::Both => "both",
            };
            eprintln!(
                "[{:>2}/{total}] mpi {pattern}, {} messages, {nodes} ranks on {} (OpenMPI's {})…",
                i + 1,
                size_name(message_bytes),
                mpi::BACKEND,
                mpi::TRANSPORT
            );
            let lines = mpi::run(
                nodes,
                args.tuples,
                pattern,
                message_bytes,
                args.seed,
                args.progress_ms,
                args.pin,
            )?;
            for l in lines {
                let pattern = match l.pattern.as_str() {
                    "repartition" => Pattern::Repartition,
                    "broadcast" => Pattern::Broadcast,
                    other => bail!("MPI reported an unknown pattern {other:?}"),
                };
                eprintln!(
                    "        {}: {:.3} GB/s per node (min {:.3}), memcpy {:.2} GB/s",
                    pattern.name(),
                    l.gb_per_sec,
                    l.gb_per_sec_min,
                    l.memcpy_gb_per_sec
                );
                rows.push(Row {
                    design: "mpi".into(),
                    backend: mpi::BACKEND.into(),
                    transport: Some(mpi::TRANSPORT.into()),
                    pattern: pattern.name(),
                    nodes: l.nodes,
                    threads: l.threads,
                    threading: "-",
                    own_partition: "-",
                    message_bytes: l.message_bytes,
                    tuples: args.tuples,
                    gb_per_sec: l.gb_per_sec,
                    gb_per_sec_min: l.gb_per_sec_min,
                    memcpy_gb_per_sec: l.memcpy_gb_per_sec,
                    partition_gb_per_sec: None,
                    work_alone_gb_per_sec: None,
                    pinned_bytes: 0,
                    pinned: args.pin,
                    node_cpus: None,
                    setup_ms: l.setup_ms,
                    seconds: l.seconds,
                    received_bytes: l.received_bytes,
                    verified: l.verified,
                    buffering: "-",
                    notify: "-".into(),
                    gb_per_sec_runs: Vec::new(),
                });
            }
        }
    }
    Ok(())
}

fn is_baseline(r: &Row) -> bool {
    r.design == "tcp" || r.design == "mpi"
}

fn best<'a>(rows: &'a [Row], pattern: &str, pick: impl Fn(&Row) -> bool) -> Option<&'a Row> {
    rows.iter()
        .filter(|r| r.pattern == pattern && pick(r))
        .max_by(|a, b| a.gb_per_sec.total_cmp(&b.gb_per_sec))
}

/// The ratio lines: the best design against memcpy, MPI and TCP, per pattern.
pub fn ratio_lines(rows: &[Row]) -> Vec<String> {
    let mut out = Vec::new();
    for pattern in ["repartition", "broadcast"] {
        let Some(d) = best(rows, pattern, |r| !is_baseline(r)) else {
            if rows.iter().any(|r| r.pattern == pattern) {
                out.push(format!("{pattern}: no design ran"));
            }
            continue;
        };
        let mut line = format!(
            "{pattern}: best design {} ({}) {:.3} GB/s = {:.1}% of memcpy ({:.2} GB/s)",
            d.label(),
            size_name(d.message_bytes),
            d.gb_per_sec,
            100.0 * d.gb_per_sec / d.memcpy_gb_per_sec.max(1e-9),
            d.memcpy_gb_per_sec
        );
        if let (Some(p), "repartition") = (d.partition_gb_per_sec, pattern) {
            line.push_str(&format!(
                ", {:.1}% of partitioning alone ({p:.2} GB/s)",
                100.0 * d.gb_per_sec / p.max(1e-9)
            ));
        }
        if let Some(w) = d.work_alone_gb_per_sec {
            line.push_str(&format!(
                ", {:.1}% of the work alone ({w:.2} GB/s)",
                100.0 * d.gb_per_sec / w.max(1e-9)
            ));
        }
        for base in ["mpi", "tcp"] {
            match best(rows, pattern, |r| r.design == base) {
                Some(b) => line.push_str(&format!(
                    ", {:.2}× {} ({:.3} GB/s)",
                    d.gb_per_sec / b.gb_per_sec.max(1e-9),
                    base.to_uppercase(),
                    b.gb_per_sec
                )),
                None => line.push_str(&format!(", {} not run", base.to_uppercase())),
            }
        }
        out.push(line);
    }
    out
}

fn print_report(out: &mut impl Write, args: &ShuffleArgs, rows: &[Row]) -> std::io::Result<()> {
    writeln!(
        out,
        "namdb bench shuffle: backend {}, {} nodes × {} thread(s), {} tuples (16 B) per node, \
         {} buffering, {} notification, {}",
        args.backend.name(),
        args.nodes,
        args.threads,
        args.tuples,
        buffering_name(args.buffering),
        args.notify,
        if args.pin {
            "each node pinned to its own cores"
        } else {
            "not pinned"
        }
    )?;
    writeln!(
        out,
        "GB/s: bytes received per node per second, median over nodes (min: the slowest node); \
         memcpy: each node copying its fragment, in the same run; partition: each node \
         partitioning it over the nodes with nothing sent, in the same run; work: each node \
         doing a repartition's whole work with nothing sent (partitioning, the copy of what \
         goes to other nodes, consuming every tuple), in the same run (what a node that \
         also sends and receives on one core cannot exceed); every run verified"
    )?;
    if args.repeat > 1 {
        writeln!(
            out,
            "each row: the median of {} runs, round robin over the rows (runs' GB/s in the JSON)",
            args.repeat
        )?;
    }
    writeln!(out)?;
    writeln!(
        out,
        "{:<9} {:<11} {:<8} {:<11} {:>8} {:>9} {:>9} {:>9} {:>9} {:>9} {:>10} {:>9} {:>8}",
        "design",
        "threading",
        "own",
        "pattern",
        "message",
        "GB/s",
        "min GB/s",
        "memcpy",
        "partition",
        "work",
        "pinned",
        "setup ms",
        "seconds"
    )?;
    for r in rows {
        writeln!(
            out,
            "{:<9} {:<11} {:<8} {:<11} {:>8} {:>9.3} {:>9.3} {:>9.2} {:>9} {:>9} {:>10} {:>9.1} {:>8.3}",
            r.design,
            r.threading,
            r.own_partition,
            r.pattern,
            size_name(r.message_bytes),
            r.gb_per_sec,
            r.gb_per_sec_min,
            r.memcpy_gb_per_sec,
            r.partition_gb_per_sec
                .map_or_else(|| "-".to_string(), |p| format!("{p:.2}")),
            r.work_alone_gb_per_sec
                .map_or_else(|| "-".to_string(), |w| format!("{w:.2}")),
            if is_baseline(r) {
                "-".to_string()
            } else {
                bytes_name(r.pinned_bytes)
            },
            r.setup_ms,
            r.seconds
        )?;
    }
    writeln!(out)?;
    for l in ratio_lines(rows) {
        writeln!(out, "{l}")?;
    }
    Ok(())
}

/// The SVGs: per pattern, throughput against message size (one line per design and
/// baseline; with `--sweep-message-sizes`) and the best throughput per design.
fn draw(dir: &Path, args: &ShuffleArgs, rows: &[Row]) -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    let mut names: Vec<String> = Vec::new();
    for r in rows {
        if !names.contains(&r.label()) {
            names.push(r.label());
        }
    }
    let title_tail = format!(
        "{} nodes × {} thread(s), {}",
        args.nodes,
        args.threads,
        args.backend.name()
    );
    let mut per_design = Vec::new();
    for pattern in ["repartition", "broadcast"] {
        let of: Vec<&Row> = rows.iter().filter(|r| r.pattern == pattern).collect();
        if of.is_empty() {
            continue;
        }
        if args.sweep_message_sizes {
            let series: Vec<plot::Series> = names
                .iter()
                .map(|n| plot::Series {
                    label: n.clone(),
                    points: of
                        .iter()
                        .filter(|r| &r.label() == n)
                        .map(|r| (r.message_bytes as f64, r.gb_per_sec))
                        .collect(),
                })
                .filter(|s| s.points.len() > 1)
                .collect();
            let path = dir.join(format!("shuffle-{pattern}-message-size.svg"));
            plot::line_svg(
                &path,
                &format!("{pattern}: throughput vs message size ({title_tail})"),
                plot::XAxis::MessageBytes,
                &series,
            )
            .map_err(anyhow::Error::msg)?;
            files.push(path);
        }
        per_design.push(plot::Series {
            label: pattern.to_string(),
            points: names
                .iter()
                .enumerate()
                .filter_map(|(i, n)| {
                    best(rows, pattern, |r| &r.label() == n).map(|r| (i as f64, r.gb_per_sec))
                })
                .collect(),
        });
    }
    let path = dir.join("shuffle-designs.svg");
    plot::line_svg(
        &path,
        &format!("throughput per design, best message size ({title_tail})"),
        plot::XAxis::Categories(&names),
        &per_design,
    )
    .map_err(anyhow::Error::msg)?;
    files.push(path);
    Ok(files)
}
