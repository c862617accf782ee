//! `namdb bench fabric`: throughput and latency of each verb on a fabric backend, and
//! this machine's memcpy bandwidth measured in the same run as the physical reference.
//!
//! Every (operation, size, threads) measurement brings up a fresh pair of nodes and
//! runs two phases of `--duration-ms` each:
//!
//! - throughput: each client thread owns a queue pair and completion queue connected to
//!   its own queue pair on the server node and targets its own slice of one server
//!   region. It posts batches of `--batch` work requests with one doorbell and only the
//!   last signaled, keeps [`PIPELINE_DEPTH`] batches in flight and polls completions n
//!   at a time. Ops/s is the sum over threads.
//! - latency: each thread posts one signaled work request at a time and waits for its
//!   completion; p50 and p99 come from the threads' merged histogram.
//!
//! SEND/RECV: each client thread has a receiving thread on the server side that keeps
//! [`RECV_BATCHES`] batches' worth of receives posted and re-posts each as it
//! completes. The client sends only against receives it knows are posted (credits), so
//! a SEND never meets an empty receive queue and RNR cannot occur. A message counts
//! when the sender's completion arrives: on RC that implies the receive consumed it, and
//! the receiving thread checks at the end that it saw exactly as many messages as were
//! sent. With N client threads this runs 2N threads.
//!
//! With `--connect`, the server is a memory server started separately, perhaps serving
//! a cluster: its tables must not be written. Runs that write (WRITE, CAS, FETCH_ADD)
//! target a region borrowed from the server for the run (`BorrowRegion`), which the
//! server frees when the run's session ends, even if the run is killed; READs alone
//! target the start of its first data region.
//!
//! Every completion status is checked; anything but success aborts with an error.

use super::JsonOut;
use crate::backend::{self, BackendKind, Nodes, ServerTarget};
use anyhow::{Context, Result, anyhow, bail, ensure};
use clap::{Args, ValueEnum};
use fabric::sim::CostModel;
use fabric::{
    Access, Completion, CompletionQueue, QpConfig, QueuePair, RecvWr, Region, RemoteAddr,
    RemoteRegion, SendWr, WcOpcode,
};
use hdrhistogram::Histogram;
use serde::Serialize;
use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::thread::{self, ScopedJoinHandle};
use std::time::{Duration, Instant};

/// Batches each client queue pair keeps in flight during the throughput phase: enough
/// that posting the next batch overlaps the completion of the previous ones.
const PIPELINE_DEPTH: u32 = 4;

/// SEND/RECV: batches' worth of receives each server queue pair keeps posted. Twice the
/// pipeline, so the sender rarely waits for the receiver to re-post.
const RECV_BATCHES: u32 = 2 * PIPELINE_DEPTH;

/// How long any wait may go without progress before the run is declared stuck. Far
/// above anything a working backend needs, even under a cost model.
const STALL_LIMIT: Duration = Duration::from_secs(10);

/// The memcpy reference copies a buffer well beyond any cache.
const MEMCPY_BYTES: usize = 64 << 20;
const MEMCPY_MIN_REPS: u32 = 3;

/// Latencies above this are recorded as this (a minute; nothing sane gets close).
const MAX_LATENCY_NS: u64 = 60_000_000_000;

#[derive(Args, Debug, Clone)]
pub struct FabricArgs {
    /// Fabric backend to measure; both nodes run in this process.
    #[arg(long, value_enum, default_value_t = BackendKind::Sim)]
    pub backend: BackendKind,
    /// Latency/bandwidth model for the sim backend: fdr4x or edr4x. Without it the sim
    /// runs as fast as the CPU allows.
    #[arg(long, value_name = "PROFILE", value_parser = backend::parse_cost)]
    pub cost: Option<CostModel>,
    /// Measure with 1, 2, …, N client threads.
    #[arg(long, value_name = "N", default_value_t = 2,
          value_parser = clap::value_parser!(u32).range(1..=256))]
    pub threads: u32,
    /// Length of each phase (throughput, then latency) of each measurement.
    /// At most a day, as every benchmark's duration.
    #[arg(long, value_name = "MS", default_value_t = 300,
          value_parser = clap::value_parser!(u64).range(1..=crate::tpcw_cmd::MAX_MILLIS))]
    pub duration_ms: u64,
    /// Only these operations (comma-separated or repeated); all by default.
    #[arg(long, value_enum, value_delimiter = ',')]
    pub ops: Vec<OpKind>,
    /// Work requests per doorbell in the throughput phase; only the last is signaled.
    #[arg(long, value_name = "N", default_value_t = 32,
          value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub batch: u32,
    /// Also write the results to FILE as a JSON list.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Measure against a memory server started separately (`namdb memory-server`):
    /// its gRPC control-plane address. The server's backend must be `--backend`.
    /// SEND/RECV is skipped: a memory server runs no receivers. Writes go to space
    /// allocated from the server's free space, so a cluster's tables are never touched.
    #[arg(long, value_name = "ADDR", requires = "token_file")]
    pub connect: Option<String>,
    /// The cluster token file, with `--connect`.
    #[arg(long, value_name = "FILE", requires = "connect")]
    pub token_file: Option<PathBuf>,
}

/// An operation the benchmark measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum OpKind {
    Read,
    Write,
    Cas,
    #[value(name = "fetch_add", alias = "fetch-add", alias = "faa")]
    FetchAdd,
    #[value(name = "send_recv", alias = "send-recv", alias = "send")]
    SendRecv,
}

impl OpKind {
    const ALL: [OpKind; 5] = [
        OpKind::Read,
        OpKind::Write,
        OpKind::Cas,
        OpKind::FetchAdd,
        OpKind::SendRecv,
    ];

    /// The name in the report and the JSON `op` field.
    fn name(self) -> &'static str {
        match self {
            OpKind::Read => "read",
            OpKind::Write => "write",
            OpKind::Cas => "cas",
            OpKind::FetchAdd => "fetch_add",
            OpKind::SendRecv => "send_recv",
        }
    }

    /// The payload sizes measured; atomics always move one 8-byte word.
    fn sizes(self) -> &'static [u32] {
        match self {
            OpKind::Read | OpKind::Write => &[64, 4 << 10, 64 << 10],
            OpKind::Cas | OpKind::FetchAdd => &[8],
            OpKind::SendRecv => &[4 << 10],
        }
    }

    /// Whether it changes the memory it targets. CAS does although its compare equals
    /// its swap: an RNIC's atomic is atomic only against other atomics, so one racing
    /// a WRITE of the same word can put the old value back.
    fn writes(self) -> bool {
        !matches!(self, OpKind::Read | OpKind::SendRecv)
    }

    /// What the sender's completion must say.
    fn opcode(self) -> WcOpcode {
        match self {
            OpKind::Read => WcOpcode::Read,
            OpKind::Write => WcOpcode::Write,
            OpKind::Cas => WcOpcode::CompareSwap,
            OpKind::FetchAdd => WcOpcode::FetchAdd,
            OpKind::SendRecv => WcOpcode::Send,
        }
    }
}

/// One measurement's operation and payload size.
#[derive(Clone, Copy, Debug)]
struct Case {
    op: OpKind,
    bytes: u32,
}

impl Case {
    /// Bytes of the server region one client thread targets.
    fn slice_bytes(self, batch: u32) -> u64 {
        let slots = if self.op == OpKind::SendRecv {
            batch * RECV_BATCHES
        } else {
            batch
        };
        slots as u64 * self.bytes as u64
    }

    /// Work request `index` of a batch: each touches its own `bytes`-sized slot of the
    /// local buffer and of the thread's remote slice.
    fn wr(self, index: u32, local: &Region, remote: RemoteAddr) -> SendWr<'static> {
        let offset = index as u64 * self.bytes as u64;
        let buf = local.buf(offset, self.bytes);
        let at = remote.offset_by(offset);
        let wr_id = index as u64;
        match self.op {
            OpKind::Read => SendWr::read(wr_id, buf, at),
            OpKind::Write => SendWr::write(wr_id, buf, at),
            // compare == swap: the word never changes, so every CAS succeeds and the
            // result does not depend on how threads interleave.
            OpKind::Cas => SendWr::cas(wr_id, buf, at, 0, 0),
            OpKind::FetchAdd => SendWr::fetch_add(wr_id, buf, at, 1),
            OpKind::SendRecv => SendWr::send(wr_id, buf),
        }
    }
}

/// One line of the report and one object of the JSON list.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    /// The fabric backend, or `host` for the memcpy reference.
    pub backend: &'static str,
    /// The sim cost model, when one was applied.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cost: Option<&'static str>,
    pub op: &'static str,
    pub bytes: u64,
    pub threads: u32,
    pub ops_per_sec: f64,
    /// Payload bytes moved per second, in units of 10^9 bytes.
    pub gb_per_sec: f64,
    pub p50_ns: u64,
    pub p99_ns: u64,
}

pub fn run(args: &FabricArgs) -> Result<()> {
    crate::bench::refuse_repeats("ops", &args.ops, |op| op.name().to_string())?;
    // Opened before the run so that a bad path fails at once, not after a minute.
    let json = JsonOut::open_opt(args.json.as_deref())?;
    let rows = JsonOut::unless_failed(json.as_ref(), measure_all(args))?;
    // Both outputs are attempted even if one fails, so a closed stdout or a full disk
    // does not lose the other copy of a long run's results.
    let written = json.as_ref().map(|json| json.write(&rows)).transpose();
    let printed = print_report(&mut std::io::stdout().lock(), args, &rows)
        .context("cannot print the report to stdout");
    written?;
    printed?;
    if let Some(json) = json {
        eprintln!("wrote {}", json.path().display());
    }
    Ok(())
}

fn cases(ops: &[OpKind]) -> Vec<Case> {
    OpKind::ALL
        .into_iter()
        .filter(|op| ops.is_empty() || ops.contains(op))
        .flat_map(|op| op.sizes().iter().map(move |&bytes| Case { op, bytes }))
        .collect()
}

/// The backends a run measures: the one asked for and, next to any other, the sim in
/// the same run, as the reference (for shm, also its goal: within 2× of the sim).
fn measured_backends(backend: BackendKind) -> Vec<BackendKind> {
    match backend {
        BackendKind::Sim => vec![BackendKind::Sim],
        other => vec![other, BackendKind::Sim],
    }
}

fn measure_all(args: &FabricArgs) -> Result<Vec<Row>> {
    let server = match (&args.connect, &args.token_file) {
        (Some(addr), Some(token)) => Some(backend::connect_server(args.backend, addr, token)?),
        _ => None,
    };
    let mut cases = cases(&args.ops);
    if server.is_some() && cases.iter().any(|c| c.op == OpKind::SendRecv) {
        eprintln!("note: send_recv skipped: a memory server runs no receivers");
        cases.retain(|c| c.op != OpKind::SendRecv);
        if cases.is_empty() {
            bail!(
                "nothing to measure: a memory server runs no receivers, so --connect \
                 measures one-sided operations only (--ops read,write,cas,fetch_add)"
            );
        }
    }
    let phase = Duration::from_millis(args.duration_ms);
    let Some(server) = &server else {
        let mut rows = measure_cases(args, &cases, None)?;
        rows.push(memcpy_reference(phase)?);
        return Ok(rows);
    };
    let (space, borrowed) = server_space(server, &cases, args)?;
    let measured = measure_cases(args, &cases, Some((server, space)));
    if let Some(region) = borrowed
        && let Err(e) = server.control.return_region(&region)
    {
        // The measurements are good either way, and the server frees the region when
        // this process's session ends.
        eprintln!(
            "warning: returning the borrowed region failed ({e}); the memory server frees \
             it when this run's session ends"
        );
    }
    let mut rows = measured?;
    rows.push(memcpy_reference(phase)?);
    Ok(rows)
}

/// Where the runs against a separately started memory server go. Anything that writes
/// goes to a region borrowed from the server for this run (`BorrowRegion`), so the
/// tables of a cluster using the server are never touched, and the server frees it
/// when the run ends, however it ends (killed, its session's lease runs out); READs
/// alone go to the start of its first data region, which they do not change.
fn server_space(
    server: &ServerTarget,
    cases: &[Case],
    args: &FabricArgs,
) -> Result<(Space, Option<RemoteRegion>)> {
    let need = cases
        .iter()
        .map(|c| c.slice_bytes(args.batch) * args.threads as u64)
        .max()
        .unwrap_or(0);
    if !cases.iter().any(|c| c.op.writes()) {
        let data = server.regions.data[0];
        return Ok((
            Space {
                data,
                offset: 0,
                len: data.len,
            },
            None,
        ));
    }
    let addr = &server.address;
    let need = need.next_multiple_of(8);
    let region = server.control.borrow_region(need).map_err(|e| {
        let hint = if e.code() == Some(tonic::Code::ResourceExhausted) {
            "measure with --ops read, or with fewer --threads or a smaller --batch"
        } else {
            "--ops read still measures it"
        };
        anyhow!(
            "the memory server at {addr} lends no {need} bytes for write, cas and \
             fetch_add: {e}; {hint}"
        )
    })?;
    eprintln!(
        "measuring in a {need}-byte region borrowed from the memory server (no table \
         uses it; the server frees it when this run ends or dies)"
    );
    Ok((
        Space {
            data: region,
            offset: 0,
            len: region.len,
        },
        Some(region),
    ))
}

/// Bytes of a separately started memory server that a run's requests go to.
#[derive(Clone, Copy, Debug)]
struct Space {
    data: RemoteRegion,
    offset: u64,
    len: u64,
}

/// Every (case, threads, backend) measurement, in order; with `server`, the run's own
/// backend is measured there.
fn measure_cases(
    args: &FabricArgs,
    cases: &[Case],
    server: Option<(&ServerTarget, Space)>,
) -> Result<Vec<Row>> {
    let backends = measured_backends(args.backend);
    let total = cases.len() * args.threads as usize * backends.len() + 1;
    let phase = Duration::from_millis(args.duration_ms);
    let mut rows = Vec::with_capacity(total);
    for case in cases {
        for threads in 1..=args.threads {
            // Back to back, so that both backends see the machine in the same state.
            for &backend in &backends {
                eprintln!(
                    "[{:>2}/{total}] {} {} {} B, {threads} thread(s)…",
                    rows.len() + 1,
                    backend.name(),
                    case.op.name(),
                    case.bytes
                );
                let target = server.filter(|_| backend == args.backend);
                let row =
                    measure(args, backend, target, *case, threads, phase).with_context(|| {
                        format!(
                            "benchmark of {} {} B with {threads} thread(s) on {} failed",
                            case.op.name(),
                            case.bytes,
                            backend.name()
                        )
                    })?;
                tracing::info!(?row, "measured");
                rows.push(row);
            }
        }
    }
    eprintln!(
        "[{total:>2}/{total}] memcpy {} MiB, 1 thread…",
        MEMCPY_BYTES >> 20
    );
    Ok(rows)
}

fn measure(
    args: &FabricArgs,
    backend: BackendKind,
    server: Option<(&ServerTarget, Space)>,
    case: Case,
    threads: u32,
    phase: Duration,
) -> Result<Row> {
    let nodes;
    let target = match server {
        Some((server, space)) => Target::Server(server, space),
        None => {
            nodes = backend::nodes(backend, args.cost)?;
            Target::InProcess(&nodes)
        }
    };
    let setup = Setup::new(&target, case, threads, args.batch)?;
    let measured = setup.run(phase);
    if let Target::Server(server, _) = target {
        // The server's queue pairs are per measurement; the session would end them
        // only at exit.
        for qpn in &setup.server_qpns {
            server.control.disconnect_qp(*qpn)?;
        }
    }
    let (ops_per_sec, latency) = measured?;
    let payload = case.bytes as f64;
    Ok(Row {
        backend: backend.name(),
        cost: args.cost.map(|c| c.name),
        op: case.op.name(),
        bytes: case.bytes as u64,
        threads,
        ops_per_sec,
        gb_per_sec: ops_per_sec * payload / 1e9,
        p50_ns: latency.value_at_quantile(0.5),
        p99_ns: latency.value_at_quantile(0.99),
    })
}

/// Flow control of one SEND/RECV pair, shared by its client and receiving threads.
#[derive(Default)]
struct Flow {
    /// Receives the server side has posted so far (a running total).
    posted: AtomicU64,
    /// Sends the client has posted so far.
    sent: AtomicU64,
    /// The client has finished sending: the receiver drains up to `sent` and stops.
    done: AtomicBool,
    /// One side failed: the other stops instead of waiting for it.
    abort: AtomicBool,
}

impl Flow {
    /// Waits until `count` more sends are covered by posted receives.
    fn reserve(&self, count: u64) -> Result<()> {
        let need = self.sent.load(Ordering::Relaxed) + count;
        if self.posted.load(Ordering::Acquire) >= need {
            return Ok(());
        }
        let since = Instant::now();
        while self.posted.load(Ordering::Acquire) < need {
            if self.abort.load(Ordering::Acquire) {
                bail!("the receiving thread stopped");
            }
            if since.elapsed() > STALL_LIMIT {
                bail!(
                    "no receive was re-posted for {STALL_LIMIT:?}: the receiving thread is stuck"
                );
            }
            // The receiving thread may share this core: let it run.
            thread::yield_now();
        }
        Ok(())
    }

    fn sent(&self, count: u64) {
        self.sent.fetch_add(count, Ordering::Release);
    }

    fn finish(&self, failed: bool) {
        if failed {
            self.abort.store(true, Ordering::Release);
        }
        self.done.store(true, Ordering::Release);
    }
}

/// Where a measurement's requests go.
enum Target<'a> {
    /// A fresh pair of nodes in this process.
    InProcess(&'a Nodes),
    /// A memory server started separately (`--connect`), and where in it.
    Server(&'a ServerTarget, Space),
}

/// The server's end of a pair, when it is in this process (it posts the receives of
/// SEND/RECV).
struct ServerSide {
    qp: Arc<dyn QueuePair>,
    cq: Arc<dyn CompletionQueue>,
}

/// One client thread's connection to the server node.
struct Pair {
    client_qp: Arc<dyn QueuePair>,
    client_cq: Arc<dyn CompletionQueue>,
    server: Option<ServerSide>,
    /// The client's source/target buffer: one slot per work request of a batch.
    local: Region,
    /// This thread's slice of the server region, as the client addresses it and as
    /// an offset for the server's own receives.
    remote: RemoteAddr,
    base: u64,
    flow: Flow,
}

/// The nodes, queue pairs and memory of one measurement.
struct Setup {
    case: Case,
    batch: u32,
    /// Receives each server queue pair keeps posted (SEND/RECV only).
    recv_slots: u32,
    /// The target region, when the server is in this process.
    server_region: Option<Region>,
    /// Queue pairs a separately started server made for this measurement.
    server_qpns: Vec<u32>,
    pairs: Vec<Pair>,
}

impl Setup {
    fn new(target: &Target<'_>, case: Case, threads: u32, batch: u32) -> Result<Setup> {
        let send_recv = case.op == OpKind::SendRecv;
        let recv_slots = if send_recv { batch * RECV_BATCHES } else { 1 };
        let slice = case.slice_bytes(batch);
        let (server_region, remote_region, start, client) = match target {
            Target::InProcess(nodes) => {
                let region = nodes
                    .server
                    .register(slice * threads as u64, Access::ALL)
                    .context("registering the server region")?;
                let remote = region.remote();
                (Some(region), remote, 0, nodes.client.clone())
            }
            Target::Server(server, space) => {
                ensure!(
                    space.len >= slice * threads as u64,
                    "the server's data region has {} bytes; this case needs {}",
                    space.len,
                    slice * threads as u64
                );
                (None, space.data, space.offset, server.client.clone())
            }
        };
        let send_depth = batch * PIPELINE_DEPTH;
        let mut pairs = Vec::with_capacity(threads as usize);
        let mut server_qpns = Vec::new();
        for t in 0..threads {
            // Room for every request in flight to complete, even all with errors, so
            // a failure shows its status rather than a CQ overrun.
            let client_cq = client.create_cq(send_depth + 16)?;
            let tune = |c| QpConfig {
                max_send_wr: send_depth,
                max_recv_wr: recv_slots,
                ..c
            };
            let (client_qp, server) = match target {
                Target::InProcess(nodes) => {
                    let server_cq = nodes.server.create_cq(recv_slots + 16)?;
                    let (client_qp, server_qp) = fabric::connect_rc_with(
                        (&*nodes.client, &client_cq),
                        (&*nodes.server, &server_cq),
                        tune,
                    )
                    .context("connecting a client queue pair to the server")?;
                    let server = ServerSide {
                        qp: server_qp,
                        cq: server_cq,
                    };
                    (client_qp, Some(server))
                }
                Target::Server(server, _) => {
                    let (qp, info) = server
                        .control
                        .connect_qp_with_config(&*server.client, &tune(QpConfig::rc(&client_cq)))
                        .with_context(|| {
                            format!(
                                "connecting a queue pair to the memory server at {}",
                                server.address
                            )
                        })?;
                    server_qpns.push(info.qpn);
                    (qp, None)
                }
            };
            let local = client
                .register(batch as u64 * case.bytes as u64, Access::LOCAL)
                .context("registering a client buffer")?;
            let base = t as u64 * slice;
            let pair = Pair {
                client_qp,
                client_cq,
                server,
                local,
                remote: remote_region.at(start + base),
                base,
                flow: Flow::default(),
            };
            if send_recv {
                let (Some(region), Some(server)) = (&server_region, &pair.server) else {
                    bail!("SEND/RECV needs the server in this process");
                };
                let recvs: Vec<RecvWr> = (0..recv_slots)
                    .map(|slot| recv_wr(region, base, case.bytes, slot as u64))
                    .collect();
                server
                    .qp
                    .post_recv(&recvs)
                    .context("posting the initial receives")?;
                pair.flow
                    .posted
                    .store(recvs.len() as u64, Ordering::Release);
            }
            pairs.push(pair);
        }
        tracing::debug!(?case, threads, batch, slice, "set up");
        Ok(Setup {
            case,
            batch,
            recv_slots,
            server_region,
            server_qpns,
            pairs,
        })
    }

    /// Runs both phases: returns the summed ops/s and the merged latency histogram.
    fn run(&self, phase: Duration) -> Result<(f64, Histogram<u64>)> {
        thread::scope(|s| {
            let receivers: Vec<_> = if self.case.op == OpKind::SendRecv {
                self.pairs
                    .iter()
                    .map(|pair| s.spawn(move || self.receive(pair)))
                    .collect()
            } else {
                Vec::new()
            };
            let measured = self.run_clients(phase);
            // Unconditionally, before anything can return: the receiving threads wait
            // for this, and the scope waits for them.
            for pair in &self.pairs {
                pair.flow.finish(measured.is_err());
            }
            let mut received = Ok(());
            for handle in receivers {
                let r = join(handle, "receiving");
                if received.is_ok() {
                    received = r;
                }
            }
            // A receiver's error is the cause of a client's "receiving thread stopped".
            received?;
            measured
        })
    }

    /// Runs `phase` on one thread per pair, all starting together.
    fn on_every_pair<T: Send>(&self, phase: impl Fn(&Pair) -> Result<T> + Sync) -> Result<Vec<T>> {
        let start = Barrier::new(self.pairs.len());
        thread::scope(|s| {
            let handles: Vec<_> = self
                .pairs
                .iter()
                .map(|pair| {
                    let (start, phase) = (&start, &phase);
                    s.spawn(move || {
                        start.wait();
                        phase(pair)
                    })
                })
                .collect();
            handles.into_iter().map(|h| join(h, "client")).collect()
        })
    }

    fn run_clients(&self, phase: Duration) -> Result<(f64, Histogram<u64>)> {
        let rates = self.on_every_pair(|pair| self.throughput(pair, phase))?;
        let histograms = self.on_every_pair(|pair| self.latency(pair, phase))?;

        let mut latency = new_histogram()?;
        for h in &histograms {
            latency
                .add(h)
                .map_err(|e| anyhow!("merging latency histograms: {e:?}"))?;
        }
        Ok((rates.iter().sum(), latency))
    }

    /// The throughput phase of one client thread: returns its ops/s.
    fn throughput(&self, pair: &Pair, phase: Duration) -> Result<f64> {
        let case = self.case;
        let last = self.batch - 1;
        let wrs: Vec<SendWr<'static>> = (0..self.batch)
            .map(|i| case.wr(i, &pair.local, pair.remote).signaled(i == last))
            .collect();
        let send_recv = case.op == OpKind::SendRecv;
        let mut wcs = [Completion::default(); 16];
        let mut stall = Stall::default();
        let mut in_flight = 0u32;
        let mut batches = 0u64;
        let mut posting = true;
        let start = Instant::now();
        let end = start + phase;
        loop {
            if posting {
                while in_flight < PIPELINE_DEPTH {
                    if send_recv {
                        pair.flow.reserve(self.batch as u64)?;
                    }
                    pair.client_qp
                        .post_send(&wrs)
                        .with_context(|| format!("posting a batch of {}", case.op.name()))?;
                    if send_recv {
                        pair.flow.sent(self.batch as u64);
                    }
                    in_flight += 1;
                }
                posting = Instant::now() < end;
            }
            if in_flight == 0 {
                break;
            }
            let n = pair
                .client_cq
                .poll(&mut wcs)
                .context("polling the client completion queue")?;
            if n == 0 {
                stall.idle("a batch's completion")?;
                continue;
            }
            stall.progress();
            for wc in &wcs[..n] {
                check(wc, case.op.opcode(), "client")?;
            }
            // One signaled completion per batch: more would mean a stray completion.
            ensure!(
                n as u32 <= in_flight,
                "{n} completions for {in_flight} batches in flight"
            );
            in_flight -= n as u32;
            batches += n as u64;
        }
        let elapsed = start.elapsed().as_secs_f64();
        Ok((batches * self.batch as u64) as f64 / elapsed)
    }

    /// The latency phase of one client thread: one signaled request at a time.
    fn latency(&self, pair: &Pair, phase: Duration) -> Result<Histogram<u64>> {
        let case = self.case;
        let wr = [case.wr(0, &pair.local, pair.remote).signaled(true)];
        let send_recv = case.op == OpKind::SendRecv;
        let mut hist = new_histogram()?;
        let mut wc = [Completion::default()];
        let mut stall = Stall::default();
        let end = Instant::now() + phase;
        loop {
            if send_recv {
                pair.flow.reserve(1)?;
            }
            let t0 = Instant::now();
            pair.client_qp
                .post_send(&wr)
                .with_context(|| format!("posting a {}", case.op.name()))?;
            if send_recv {
                pair.flow.sent(1);
            }
            loop {
                let n = pair
                    .client_cq
                    .poll(&mut wc)
                    .context("polling the client completion queue")?;
                if n == 1 {
                    break;
                }
                stall.idle("a completion")?;
            }
            let t1 = Instant::now();
            stall.progress();
            check(&wc[0], case.op.opcode(), "client")?;
            hist.saturating_record(ns(t1 - t0));
            if t1 >= end {
                break;
            }
        }
        Ok(hist)
    }

    /// The receiving thread of one SEND/RECV pair: re-posts each receive as it
    /// completes until the client is done and every message sent has arrived.
    fn receive(&self, pair: &Pair) -> Result<()> {
        let result = self.receive_loop(pair);
        if result.is_err() {
            pair.flow.finish(true);
        }
        result
    }

    fn receive_loop(&self, pair: &Pair) -> Result<()> {
        let bytes = self.case.bytes;
        let (Some(region), Some(server)) = (&self.server_region, &pair.server) else {
            bail!("SEND/RECV needs the server in this process");
        };
        let mut wcs = [Completion::default(); 32];
        let mut repost = Vec::with_capacity(wcs.len());
        let mut received = 0u64;
        let mut drain_since = None;
        loop {
            let n = server
                .cq
                .poll(&mut wcs)
                .context("polling the server completion queue")?;
            if n == 0 {
                if pair.flow.abort.load(Ordering::Acquire) {
                    return Ok(());
                }
                if pair.flow.done.load(Ordering::Acquire) {
                    let sent = pair.flow.sent.load(Ordering::Acquire);
                    if received == sent {
                        return Ok(());
                    }
                    ensure!(
                        received < sent,
                        "received {received} messages but only {sent} were sent"
                    );
                    let since = *drain_since.get_or_insert_with(Instant::now);
                    ensure!(
                        since.elapsed() < STALL_LIMIT,
                        "{} of {sent} messages sent never arrived",
                        sent - received
                    );
                }
                // The client may share this core: let it run.
                thread::yield_now();
                continue;
            }
            // Re-posted as they come rather than in batches: post_recv holds the receive
            // queue's lock across its whole list, so a long list blocks the sender
            // (batches of 32 halved the 1-thread rate on sim).
            repost.clear();
            for wc in &wcs[..n] {
                check(wc, WcOpcode::Recv, "server")?;
                ensure!(
                    wc.byte_len == bytes,
                    "a receive completed with {} bytes, expected {bytes}",
                    wc.byte_len
                );
                ensure!(
                    wc.wr_id < self.recv_slots as u64,
                    "a receive completed with unknown wr_id {}",
                    wc.wr_id
                );
                repost.push(recv_wr(region, pair.base, bytes, wc.wr_id));
            }
            server
                .qp
                .post_recv(&repost)
                .context("re-posting receives")?;
            pair.flow.posted.fetch_add(n as u64, Ordering::Release);
            received += n as u64;
        }
    }
}

/// The receive of `slot` in a receiving thread's slice starting at `base`.
fn recv_wr(region: &Region, base: u64, bytes: u32, slot: u64) -> RecvWr {
    RecvWr {
        wr_id: slot,
        buf: region.buf(base + slot * bytes as u64, bytes),
    }
}

fn check(wc: &Completion, opcode: WcOpcode, side: &str) -> Result<()> {
    ensure!(
        wc.status.is_ok(),
        "a {side} work request (wr_id {}, {opcode:?}, queue pair {}) completed with {:?}: {}",
        wc.wr_id,
        wc.qpn,
        wc.status,
        wc.status
    );
    ensure!(
        wc.opcode == opcode,
        "a {side} completion (wr_id {}) has opcode {:?}, expected {opcode:?}",
        wc.wr_id,
        wc.opcode
    );
    Ok(())
}

/// Detects a completion queue that stays empty: a backend bug must end the run with an
/// error, not hang it.
#[derive(Default)]
struct Stall {
    idle_polls: u32,
    since: Option<Instant>,
}

impl Stall {
    fn progress(&mut self) {
        self.idle_polls = 0;
        self.since = None;
    }

    fn idle(&mut self, awaited: &str) -> Result<()> {
        self.idle_polls += 1;
        // Reading the clock on every empty poll would slow the poll loop down. (A
        // mask, not `is_multiple_of`, which is newer than the workspace's MSRV.)
        if self.idle_polls & 1023 == 0 {
            let since = *self.since.get_or_insert_with(Instant::now);
            ensure!(
                since.elapsed() < STALL_LIMIT,
                "waited {STALL_LIMIT:?} for {awaited} without one arriving"
            );
        }
        Ok(())
    }
}

fn join<T>(handle: ScopedJoinHandle<'_, Result<T>>, what: &str) -> Result<T> {
    handle
        .join()
        .map_err(|_| anyhow!("a {what} thread panicked"))?
}

fn new_histogram() -> Result<Histogram<u64>> {
    Histogram::new_with_bounds(1, MAX_LATENCY_NS, 3)
        .map_err(|e| anyhow!("creating a latency histogram: {e:?}"))
}

fn ns(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// Single-threaded `copy_from_slice` of a buffer far larger than the caches: the
/// bandwidth a memory copy on this machine reaches, which bounds what any in-memory
/// backend can move. GB/s counts the bytes copied once (not read plus write).
fn memcpy_reference(phase: Duration) -> Result<Row> {
    let src = vec![0xa5u8; MEMCPY_BYTES];
    let mut dst = vec![0u8; MEMCPY_BYTES];
    // The first copy faults the destination's pages in; it is not measured.
    dst.copy_from_slice(&src);
    let mut hist = new_histogram()?;
    let mut reps = 0u32;
    let start = Instant::now();
    while reps < MEMCPY_MIN_REPS || start.elapsed() < phase {
        let t0 = Instant::now();
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut dst);
        hist.saturating_record(ns(t0.elapsed()));
        reps += 1;
    }
    let elapsed = start.elapsed().as_secs_f64();
    let ops_per_sec = reps as f64 / elapsed;
    Ok(Row {
        backend: "host",
        cost: None,
        op: "memcpy",
        bytes: MEMCPY_BYTES as u64,
        threads: 1,
        ops_per_sec,
        gb_per_sec: ops_per_sec * MEMCPY_BYTES as f64 / 1e9,
        p50_ns: hist.value_at_quantile(0.5),
        p99_ns: hist.value_at_quantile(0.99),
    })
}

fn print_report(out: &mut impl Write, args: &FabricArgs, rows: &[Row]) -> std::io::Result<()> {
    let cost = args.cost.map_or("no cost model", |c| c.name);
    writeln!(
        out,
        "namdb bench fabric: backend {} ({cost}), batches of {} × {PIPELINE_DEPTH} in flight, \
         {} ms per phase",
        args.backend.name(),
        args.batch,
        args.duration_ms
    )?;
    writeln!(out)?;
    writeln!(
        out,
        "{:<7} {:<10} {:>8} {:>7} {:>12} {:>9} {:>10} {:>10}",
        "backend", "op", "bytes", "threads", "ops/s", "GB/s", "p50", "p99"
    )?;
    for row in rows {
        writeln!(
            out,
            "{:<7} {:<10} {:>8} {:>7} {:>12} {:>9.3} {:>10} {:>10}",
            row.backend,
            row.op,
            row.bytes,
            row.threads,
            rate(row.ops_per_sec),
            row.gb_per_sec,
            latency(row.p50_ns),
            latency(row.p99_ns)
        )?;
    }
    writeln!(out)?;
    let memcpy = rows.iter().find(|r| r.op == "memcpy");
    if let Some(m) = memcpy {
        writeln!(
            out,
            "memcpy reference: {:.2} GB/s single-threaded ({} MiB copies)",
            m.gb_per_sec,
            m.bytes >> 20
        )?;
    }
    let best_read = rows
        .iter()
        .filter(|r| r.op == OpKind::Read.name() && r.backend == args.backend.name())
        .max_by(|a, b| a.gb_per_sec.total_cmp(&b.gb_per_sec));
    if let (Some(r), Some(m)) = (best_read, memcpy)
        && m.gb_per_sec > 0.0
    {
        writeln!(
            out,
            "best READ: {:.2} GB/s ({} B, {} thread(s)) = {:.1} % of memcpy",
            r.gb_per_sec,
            r.bytes,
            r.threads,
            100.0 * r.gb_per_sec / m.gb_per_sec
        )?;
    }
    // The goals are about the backend's own overhead; a cost model caps rates on purpose.
    if args.cost.is_none() {
        for line in goal_lines(args.backend, rows) {
            writeln!(out, "{line}")?;
        }
    }
    if rows.iter().any(|r| r.op == OpKind::SendRecv.name()) {
        writeln!(
            out,
            "note: send_recv counts a message at the sender's completion and runs a \
             receiving thread per client thread (2 × threads in all)"
        )?;
    }
    Ok(())
}

/// Each backend's performance goals (from its issue), checked against the rows.
fn goal_lines(backend: BackendKind, rows: &[Row]) -> Vec<String> {
    let verdict = |ok: bool| if ok { "met" } else { "NOT met" };
    let small = |r: &&Row, op: OpKind| r.bytes <= 64 && r.op == op.name();
    match backend {
        BackendKind::Sim => rows
            .iter()
            .filter(|r| r.backend == BackendKind::Sim.name())
            .filter(|r| small(r, OpKind::Read) || small(r, OpKind::Cas))
            .map(|row| {
                let per_thread = row.ops_per_sec / row.threads as f64;
                format!(
                    "goal ≥ 10 M ops/s per core, batched {} {} B, {} thread(s): {} per thread — {}",
                    row.op,
                    row.bytes,
                    row.threads,
                    rate(per_thread),
                    verdict(per_thread >= 10e6)
                )
            })
            .collect(),
        BackendKind::Tcp => rows
            .iter()
            .filter(|r| r.backend == BackendKind::Tcp.name())
            .filter(|r| r.threads == 1 && small(r, OpKind::Read))
            .flat_map(|row| {
                [
                    format!(
                        "goal ≥ 300 k batched 64 B READs/s from one thread: {} — {}",
                        rate(row.ops_per_sec),
                        verdict(row.ops_per_sec >= 300e3)
                    ),
                    format!(
                        "goal unbatched 64 B READ p50 ≤ 50 µs: {} — {}",
                        latency(row.p50_ns),
                        verdict(row.p50_ns <= 50_000)
                    ),
                ]
            })
            .collect(),
        // Soft-RoCE figures are emulation figures; hardware has no goal here yet.
        BackendKind::Verbs => Vec::new(),
        BackendKind::Shm => rows
            .iter()
            .filter(|r| r.backend == BackendKind::Shm.name())
            .filter_map(|shm| {
                let sim = rows.iter().find(|r| {
                    r.backend == BackendKind::Sim.name()
                        && (r.op, r.bytes, r.threads) == (shm.op, shm.bytes, shm.threads)
                })?;
                let (batched, p50) = shm_vs_sim(shm, sim);
                Some(format!(
                    "goal shm within 2× of sim per operation, {} {} B, {} thread(s): \
                     {batched:.2}× batched, {p50:.2}× p50 — {}",
                    shm.op,
                    shm.bytes,
                    shm.threads,
                    verdict(batched <= 2.0 && p50 <= 2.0)
                ))
            })
            .collect(),
    }
}

/// How many times longer an operation takes on shm than on the sim: batched (from the
/// throughput phase) and alone (p50 latency).
fn shm_vs_sim(shm: &Row, sim: &Row) -> (f64, f64) {
    let batched = sim.ops_per_sec / shm.ops_per_sec.max(f64::MIN_POSITIVE);
    let p50 = shm.p50_ns as f64 / sim.p50_ns.max(1) as f64;
    (batched, p50)
}

fn rate(per_sec: f64) -> String {
    if per_sec >= 1e6 {
        format!("{:.2} M", per_sec / 1e6)
    } else if per_sec >= 1e3 {
        format!("{:.1} k", per_sec / 1e3)
    } else {
        format!("{per_sec:.1}")
    }
}

fn latency(ns: u64) -> String {
    if ns < 10_000 {
        format!("{ns} ns")
    } else if ns < 1_000_000 {
        format!("{:.1} µs", ns as f64 / 1e3)
    } else {
        format!("{:.2} ms", ns as f64 / 1e6)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_op_and_size_is_planned() {
        let all = cases(&[]);
        let names: Vec<(&str, u32)> = all.iter().map(|c| (c.op.name(), c.bytes)).collect();
        assert_eq!(
            names,
            [
                ("read", 64),
                ("read", 4096),
                ("read", 65536),
                ("write", 64),
                ("write", 4096),
                ("write", 65536),
                ("cas", 8),
                ("fetch_add", 8),
                ("send_recv", 4096),
            ]
        );
        assert_eq!(cases(&[OpKind::Cas]).len(), 1);
    }

    #[test]
    fn a_short_measurement_of_every_op_succeeds() {
        let args = FabricArgs {
            backend: BackendKind::Sim,
            cost: None,
            threads: 2,
            duration_ms: 5,
            ops: Vec::new(),
            batch: 8,
            json: None,
            connect: None,
            token_file: None,
        };
        for backend in [BackendKind::Sim, BackendKind::Shm] {
            for case in cases(&[]) {
                let row = measure(&args, backend, None, case, 2, Duration::from_millis(5))
                    .expect("measures");
                assert_eq!(row.backend, backend.name());
                assert!(row.ops_per_sec > 0.0, "{row:?}");
                assert!(row.p99_ns >= row.p50_ns && row.p50_ns > 0, "{row:?}");
            }
        }
    }

    fn row(backend: BackendKind, ops_per_sec: f64, p50_ns: u64) -> Row {
        Row {
            backend: backend.name(),
            cost: None,
            op: "read",
            bytes: 64,
            threads: 1,
            ops_per_sec,
            gb_per_sec: 0.0,
            p50_ns,
            p99_ns: p50_ns,
        }
    }

    #[test]
    fn shm_goals_compare_with_sim_in_the_same_run() {
        assert_eq!(
            measured_backends(BackendKind::Shm),
            [BackendKind::Shm, BackendKind::Sim]
        );
        assert_eq!(
            measured_backends(BackendKind::Tcp),
            [BackendKind::Tcp, BackendKind::Sim]
        );
        let rows = [
            row(BackendKind::Shm, 10e6, 300),
            row(BackendKind::Sim, 30e6, 100),
        ];
        let lines = goal_lines(BackendKind::Shm, &rows);
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert!(
            lines[0].contains("3.00× batched, 3.00× p50 — NOT met"),
            "{lines:?}"
        );
        let rows = [
            row(BackendKind::Shm, 20e6, 150),
            row(BackendKind::Sim, 30e6, 100),
        ];
        let lines = goal_lines(BackendKind::Shm, &rows);
        assert!(
            lines[0].contains("1.50× batched, 1.50× p50 — met"),
            "{lines:?}"
        );
    }

    #[test]
    fn measurements_work_under_a_cost_model() {
        let args = FabricArgs {
            backend: BackendKind::Sim,
            cost: CostModel::by_name("fdr4x"),
            threads: 1,
            duration_ms: 5,
            ops: Vec::new(),
            batch: 4,
            json: None,
            connect: None,
            token_file: None,
        };
        for op in [OpKind::Read, OpKind::SendRecv] {
            let case = Case { op, bytes: 4096 };
            let row = measure(
                &args,
                BackendKind::Sim,
                None,
                case,
                1,
                Duration::from_millis(5),
            )
            .expect("measures");
            // A READ round trip is modelled at 2 µs.
            assert!(row.p50_ns >= 1_000, "{row:?}");
        }
    }
}
