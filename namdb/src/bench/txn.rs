//! `namdb bench txn`: RSI transactions on an embedded cluster.
//!
//! `--threads` worker threads each run `--coroutines` closed-loop clients as futures
//! on one [`txn::Worker`] (one oracle slot, one connection per memory server). A client
//! begins, runs one transaction of the workload and commits, then starts the next;
//! an aborted transaction counts by reason and is not retried.
//!
//! - `ycsb`: one key per transaction; a read with probability `--read-ratio`, else a
//!   read-modify-write of its 8-byte counter.
//! - `bank`: a transfer between two accounts (or, with probability `--read-ratio`, a
//!   read of two); at the end a scan checks that the money is all there.
//! - `list-append`: one to three operations on random keys, each a read (probability
//!   `--read-ratio`) or an append of a unique element, as verify's list-append. A list
//!   holds `--value-size` / 8 elements (by default as many as a table of
//!   [`LIST_TABLE_BYTES`] holds, up to 2048); the run stops when an append finds its
//!   list full, since from then on it would measure nothing but failed appends.
//!
//! `--history FILE` records every transaction in verify's JSON Lines format (check it
//! with `namdb verify FILE`); with `--no-wait-visible` its first line is a header
//! saying that real-time order was not promised. Throughput and latency count the transactions that
//! finished after the warm-up (the first tenth of the run, at most one second).

use crate::backend::BackendKind;
use crate::bench::JsonOut;
use anyhow::{Context, Result, bail, ensure};
use clap::{Args, ValueEnum};
use fabric::Device;
use fabric::tcp::TcpDevice;
use hdrhistogram::Histogram;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Zipf};
use serde::Serialize;
use std::cell::RefCell;
use std::fs::File;
use std::io::BufWriter;
use std::path::PathBuf;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};
use txn::{AsyncTransaction, Database, Options, Table, TableSpec, TxnError, Worker};
use verify::history::{JsonlWriter, ReadValue};
use verify::recorder::{Recorder, TxnRecord};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Workload {
    Ycsb,
    Bank,
    ListAppend,
}

/// `--zipf-theta`'s default.
const ZIPF_THETA: f64 = 0.99;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Dist {
    Uniform,
    Zipf,
}

#[derive(Args, Debug, Clone)]
pub struct TxnArgs {
    /// Fabric backend of the embedded cluster.
    #[arg(long, value_enum, default_value_t = BackendKind::Sim)]
    pub backend: BackendKind,
    /// Worker threads.
    #[arg(long, value_name = "T", default_value_t = 2,
          value_parser = clap::value_parser!(u32).range(1..=256))]
    pub threads: u32,
    /// Transactions in flight per thread, as coroutines.
    #[arg(long, value_name = "C", default_value_t = 8,
          value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub coroutines: u32,
    /// Keys (records, accounts or lists).
    #[arg(long, value_name = "K", default_value_t = 100_000,
          value_parser = clap::value_parser!(u64).range(2..=100_000_000))]
    pub keys: u64,
    #[arg(long, value_enum, default_value_t = Workload::Ycsb)]
    pub workload: Workload,
    /// Fraction of read-only operations.
    #[arg(long, value_name = "R", default_value_t = 0.0)]
    pub read_ratio: f64,
    /// Key distribution.
    #[arg(long, value_enum, default_value_t = Dist::Uniform)]
    pub dist: Dist,
    /// Skew of `--dist zipf` (0.99 unless given); refused with any other --dist.
    #[arg(long, value_name = "THETA")]
    pub zipf_theta: Option<f64>,
    /// Seconds to run.
    #[arg(long, value_name = "S", default_value_t = 5.0)]
    pub duration: f64,
    /// Bytes per value: 64 by default. For list-append, the largest list (8 bytes per
    /// element), by default sized for --keys (as many as 256 MiB of table holds, from
    /// 64 bytes to 16 KiB); the run stops when a list is full. Bank's balances are 8
    /// bytes (another size is refused).
    #[arg(long, value_name = "BYTES",
          value_parser = clap::value_parser!(u32).range(8..=65536))]
    pub value_size: Option<u32>,
    /// Memory servers of the embedded cluster (tables are partitioned over them).
    #[arg(long, value_name = "M", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..=64))]
    pub servers: u32,
    /// Let `commit` return before its commit is visible to transactions that begin
    /// afterwards (weaker: gives up real-time order; sessions still see their own).
    /// A `--history` then says so in its first line, and `namdb verify` skips its
    /// real-time check.
    #[arg(long)]
    pub no_wait_visible: bool,
    /// Record every transaction to FILE (verify's JSON Lines format).
    #[arg(long, value_name = "FILE")]
    pub history: Option<PathBuf>,
    /// Also write the result to FILE as a JSON object.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Run against the compute nodes of this cluster file (`namdb cluster up`), or of
    /// the cluster file in this directory, through gRPC instead of an embedded cluster;
    /// `--backend` and `--servers` come from the file.
    #[arg(long, value_name = "FILE")]
    pub cluster: Option<PathBuf>,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct Aborts {
    pub conflict: u64,
    pub duplicate_key: u64,
    pub snapshot_too_old: u64,
    pub list_full: u64,
}

/// The result, as printed and as written to `--json`.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// The embedded cluster's backend, or `grpc:<backend>` for `--cluster`.
    pub backend: String,
    pub workload: String,
    pub threads: u32,
    pub coroutines: u32,
    pub keys: u64,
    pub dist: String,
    pub read_ratio: f64,
    pub servers: u32,
    pub seconds: f64,
    pub committed: u64,
    pub aborted: u64,
    pub txn_per_sec: f64,
    pub abort_rate: f64,
    pub aborts: Aborts,
    /// Latency of the committed transactions; None (null) when none committed in the
    /// measured time, which printed as 0.0 µs read as instant commits.
    pub p50_us: Option<f64>,
    pub p99_us: Option<f64>,
    pub p999_us: Option<f64>,
    /// Oracle reads per committed transaction (shared by coroutines that began or
    /// waited together). None through gRPC, where the compute nodes do not report it,
    /// and when none committed.
    pub oracle_reads_per_txn: Option<f64>,
    /// For bank: whether the money summed to the initial total at the end.
    pub invariant_ok: Option<bool>,
    /// For list-append: why the run stopped before its --duration (a list was full),
    /// and `seconds` is then the time measured until it did.
    pub stopped_early: Option<String>,
}

pub(super) const BANK_BALANCE: i64 = 1000;

type HistoryRecorder = Recorder<JsonlWriter<BufWriter<File>>>;

/// The benchmark's table: every key, with room for an eighth more (list-append inserts).
/// Each server holds a partition, with its own index sized for the partition's keys:
/// a bucket per key on average, which on the default two servers is what every
/// partition had when each got an index of the whole table's size (with 16 servers
/// that took 8 times the memory; two keys a bucket measured about 1.5% slower).
fn table_spec(args: &TxnArgs) -> TableSpec {
    let capacity = args.keys + args.keys / 8 + 64;
    let mut spec = TableSpec::new("bench", value_cap(args), capacity);
    spec.index.buckets = capacity.div_ceil(u64::from(args.servers)).max(1);
    spec
}

/// Bytes of the benchmark's table over all servers: blocks and indexes, all of it
/// written by the load.
fn table_bytes(args: &TxnArgs) -> Result<u64> {
    let spec = table_spec(args);
    let block = txn::layout::BlockShape::new(spec.versions, spec.value_cap)?.block_bytes();
    Ok(spec.blocks_on(args.servers) * block + spec.index.region_bytes() * u64::from(args.servers))
}

/// Refuses, before anything starts, a table the embedded cluster could not hold in
/// the memory this host has available (the load writes all of it, and the kernel's
/// OOM killer would end the run), naming the most keys that fit.
fn ensure_table_fits(args: &TxnArgs) -> Result<()> {
    crate::bench::ensure_data_fits(
        &format!(
            "a table of {} keys (blocks of {} versions of {} bytes, and an index per server)",
            args.keys,
            table_spec(args).versions,
            value_cap(args)
        ),
        table_bytes(args)?,
        args.keys,
        "keys",
    )
}

/// The embedded cluster for a backend; shm's sockets live in `sockets`.
fn cluster_options(args: &TxnArgs, sockets: Option<&std::path::Path>) -> Result<Options> {
    ensure_table_fits(args)?;
    // Each server holds its share of the table's blocks and index, with room to spare
    // for the oracle and alignment.
    let table_bytes = table_bytes(args)?;
    // A transaction's buffer, and a slot's commit-log area, hold a block of the table
    // (values over about 16 KiB outgrow txn's defaults).
    let spec = table_spec(args);
    let scratch_bytes =
        Options::scratch_bytes_for(txn::layout::BlockShape::new(spec.versions, spec.value_cap)?);
    let log_bytes_per_slot = Options::default().log_bytes_per_slot.max(scratch_bytes);
    let per_server = table_bytes / args.servers as u64
        + table_bytes / 8
        + (16 << 20)
        + u64::from(args.threads) * log_bytes_per_slot;
    let mut options = Options {
        servers: args.servers as usize,
        server_bytes: per_server,
        // One slot per worker, plus the loader's (freed before the run starts).
        slots: args.threads,
        wait_visible: !args.no_wait_visible,
        scratch_bytes,
        log_bytes_per_slot,
        ..Options::default()
    };
    let token: [u8; 32] = rand::random();
    match args.backend {
        BackendKind::Sim => {}
        BackendKind::Shm => {
            let dir = sockets.context("the shm backend needs a directory for its sockets")?;
            options.devices = Some(compute_node::memory_servers::shm_devices(
                dir.to_path_buf(),
                token.to_vec(),
            ));
        }
        BackendKind::Tcp => {
            options.devices = Some(Arc::new(move || {
                let device: Arc<dyn Device> = TcpDevice::bind("127.0.0.1:0", &token)?;
                Ok(device)
            }));
        }
        BackendKind::Verbs => {
            // Fails here, before any table exists, without an RDMA device or the
            // `verbs` feature; the message says which.
            let open = move || {
                crate::backend::verbs_device(
                    &crate::backend::VerbsOptions::default(),
                    fabric::NodeId(rand::random()),
                    std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
                    &token,
                )
            };
            open()?;
            options.devices = Some(Arc::new(move || {
                open().map_err(|e| {
                    txn::TxnError::Fabric(fabric::FabricError::Backend(format!("{e:#}")))
                })
            }));
        }
    }
    Ok(options)
}

/// Bytes of table (all versions of every key's list) that list-append's lists are
/// sized to by default.
pub const LIST_TABLE_BYTES: u64 = 256 << 20;

pub(super) fn value_cap(args: &TxnArgs) -> u32 {
    match args.workload {
        Workload::Ycsb => args.value_size.unwrap_or(64),
        Workload::Bank => 8,
        Workload::ListAppend => args.value_size.unwrap_or_else(|| {
            let capacity = args.keys + args.keys / 8 + 64;
            let versions = u64::from(TableSpec::new("bench", 8, 1).versions);
            // Each version also has two words of its own.
            let per_version = LIST_TABLE_BYTES / (capacity * versions);
            (per_version.saturating_sub(16) / 8 * 8).clamp(64, 16 << 10) as u32
        }),
    }
}

/// Elements a list-append list holds.
fn list_elements(args: &TxnArgs) -> u32 {
    value_cap(args) / 8
}

pub fn run(args: &TxnArgs) -> Result<()> {
    ensure!(
        (0.0..=1.0).contains(&args.read_ratio),
        "--read-ratio must be between 0 and 1, got {}",
        args.read_ratio
    );
    // One message for every way out of the range: `inf` was told it was too short.
    ensure!(
        (0.001..=crate::tpcw_cmd::MAX_SECONDS).contains(&args.duration),
        "--duration must be at least a millisecond (0.001 s) and at most {} s (a day), got {}",
        crate::tpcw_cmd::MAX_SECONDS,
        args.duration
    );
    // Infinity passes `> 0` but makes every Zipf sample NaN, which its rejection
    // sampler never accepts: the run would hang after loading.
    if let Some(theta) = args.zipf_theta {
        // Taken without a word, and the run's keys drawn uniformly all the same.
        ensure!(
            args.dist == Dist::Zipf,
            "--zipf-theta {theta} applies only to --dist zipf (the keys are drawn \
             uniformly otherwise): add --dist zipf or drop --zipf-theta"
        );
        ensure!(
            theta > 0.0 && theta.is_finite(),
            "--zipf-theta must be a positive finite number, got {theta}"
        );
    }
    // Bank's balances are 8 bytes whatever --value-size says, which it took without a
    // word (its report then looked like one of larger values).
    if let (Workload::Bank, Some(size)) = (args.workload, args.value_size) {
        ensure!(
            size == 8,
            "--value-size {size} does not apply to bank, whose balances are 8 bytes; drop it"
        );
    }
    // Opened before the run, as the other benchmarks do: a bad path used to fail only
    // after the whole run, its results lost.
    let json = JsonOut::open_opt(args.json.as_deref())?;
    let report = JsonOut::unless_failed(json.as_ref(), measure(args))?;
    finish(&report, args, json.as_ref())
}

/// Loads the keys and runs the workload: on the embedded cluster, or through gRPC on
/// `--cluster`'s.
fn measure(args: &TxnArgs) -> Result<Report> {
    if let Some(file) = &args.cluster {
        return super::txn_grpc::run(args, file);
    }
    // Only shm needs a directory, so a run on another backend leaves nothing behind
    // even when killed with SIGKILL; shm's goes on Ctrl-C too.
    let sockets = match args.backend {
        BackendKind::Shm => {
            let dir = tempfile::Builder::new()
                .prefix("namdb-bench-txn-")
                .tempdir()
                .context("creating a directory for the cluster's sockets")?;
            let registered = crate::interrupt::remove_on_interrupt(dir.path())?;
            Some((dir, registered))
        }
        _ => None,
    };
    let db = Database::embedded(cluster_options(
        args,
        sockets.as_ref().map(|(dir, _)| dir.path()),
    )?)?;
    let table = db.create_table(table_spec(args))?;
    let recorder = match &args.history {
        Some(path) => {
            let mut writer = JsonlWriter::new(BufWriter::new(
                File::create(path).with_context(|| format!("creating {}", path.display()))?,
            ));
            if args.no_wait_visible {
                // Without it, `namdb verify` would report every commit a later
                // transaction missed as a real-time anomaly, which this mode allows.
                writer
                    .write_header(&no_wait_visible_header())
                    .context("writing the history")?;
                eprintln!(
                    "--no-wait-visible: the history says so in its first line, and `namdb \
                     verify` skips its real-time check (every other check runs)"
                );
            }
            Some(Recorder::new(writer))
        }
        None => None,
    };
    if args.workload != Workload::ListAppend {
        load(&db, &table, args, recorder.as_ref())?;
    } else {
        eprintln!(
            "list-append: each of the {} lists holds up to {} elements (--value-size {}); \
             the run stops when an append finds its list full",
            args.keys,
            list_elements(args),
            value_cap(args)
        );
    }
    let report = drive(&db, &table, args, recorder.as_ref())?;
    if let Some(r) = recorder {
        use std::io::Write;
        r.into_sink()
            .into_inner()
            .flush()
            .context("writing the history")?;
    }
    Ok(report)
}

/// The header of a history recorded with `--no-wait-visible`.
fn no_wait_visible_header() -> verify::history::Header {
    verify::history::Header {
        real_time: false,
        why: Some(
            "recorded by `namdb bench txn --no-wait-visible`, whose commits return before \
             they are visible to transactions that begin afterwards"
                .into(),
        ),
    }
}

/// Prints the report, writes `--json`, and fails if the bank lost money.
fn finish(report: &Report, args: &TxnArgs, json: Option<&JsonOut>) -> Result<()> {
    print(report, args);
    if let Some(json) = json {
        json.write(report)?;
    }
    if report.invariant_ok == Some(false) {
        bail!("the bank's money does not add up: a transaction was lost or torn");
    }
    Ok(())
}

pub(super) fn initial_value(args: &TxnArgs) -> Vec<u8> {
    match args.workload {
        Workload::Ycsb => {
            let mut v = vec![0u8; value_cap(args) as usize];
            v[..8].copy_from_slice(&0u64.to_le_bytes());
            v
        }
        Workload::Bank => BANK_BALANCE.to_le_bytes().to_vec(),
        Workload::ListAppend => Vec::new(),
    }
}

/// Loader transactions in flight.
const LOAD_COROUTINES: usize = 16;

/// Inserts every key (up to 64 per transaction, as many as a transaction's buffer
/// holds), [`LOAD_COROUTINES`] transactions in flight; recorded in the history, so that the checkers
/// know where the first values came from. (Lists start absent: nothing to load.)
fn load(
    db: &Database,
    table: &Arc<Table>,
    args: &TxnArgs,
    recorder: Option<&HistoryRecorder>,
) -> Result<()> {
    let worker = db.worker()?;
    let value = initial_value(args);
    let block = table.shape.block_bytes() + 64;
    let per_txn = (db.options().scratch_bytes / 2 / block).clamp(1, 64);
    // The loaders' session ids in the history: after every benchmark client's, one per
    // coroutine. A session is sequential, and the coroutines' transactions overlap:
    // under one id, each began before its predecessor in the session committed, which
    // the checker rightly reports as a session that did not see its own writes.
    let first_session = args.threads as u64 * args.coroutines as u64;
    let chunks = args.keys.div_ceil(per_txn);
    let next = std::cell::Cell::new(0u64);
    let started = Instant::now();
    let last_print = std::cell::Cell::new(Instant::now());
    let results = worker.run_coroutines(LOAD_COROUTINES, |c| {
        let session = first_session + c as u64;
        let (worker, next, value, last_print) = (&worker, &next, &value, &last_print);
        Box::pin(async move {
            loop {
                let chunk = next.get();
                if chunk >= chunks {
                    return Ok::<(), TxnError>(());
                }
                next.set(chunk + 1);
                let keys = chunk * per_txn..((chunk + 1) * per_txn).min(args.keys);
                let record = recorder.map(|r| r.begin(session));
                // The attempt that committed: its snapshot goes in the history too, or
                // the white-box checker cannot place the loaded values.
                let rid = std::cell::Cell::new(None);
                let (_, cid) = worker
                    .run(0, 10, async |txn: &mut AsyncTransaction<'_>| {
                        rid.set(Some(txn.rid()));
                        for k in keys.clone() {
                            txn.insert(table, k, value.clone()).await?;
                        }
                        Ok(())
                    })
                    .await?;
                if let (Some(rec), Some(mut record)) = (recorder, record) {
                    record.set_read_timestamp(rid.get());
                    for k in keys.clone() {
                        record.write(&key_name(k), counter(value));
                    }
                    rec.committed(record, cid)
                        .map_err(|e| TxnError::Invalid(format!("recording: {e}")))?;
                }
                if last_print.get().elapsed() > Duration::from_secs(1) {
                    last_print.set(Instant::now());
                    eprintln!(
                        "loading: {} of {} keys ({:.1} s)",
                        (chunk + 1) * per_txn,
                        args.keys,
                        started.elapsed().as_secs_f64()
                    );
                }
            }
        })
    });
    for r in results {
        r.context("loading the keys")?;
    }
    eprintln!(
        "loaded {} keys in {:.2} s",
        args.keys,
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// What one thread (or one gRPC client) measured after the warm-up.
pub(super) struct Tally {
    pub committed: u64,
    pub aborted: u64,
    pub aborts: Aborts,
    pub latency_ns: Histogram<u64>,
    pub oracle_reads: u64,
}

impl Tally {
    pub fn new() -> Result<Tally> {
        Ok(Tally {
            committed: 0,
            aborted: 0,
            aborts: Aborts::default(),
            latency_ns: Histogram::new_with_bounds(1, 60_000_000_000, 3)?,
            oracle_reads: 0,
        })
    }

    /// Counts a transaction that committed after `began`.
    pub fn commit(&mut self, began: Instant, finished: Instant) {
        self.committed += 1;
        let ns = (finished - began).as_nanos() as u64;
        self.latency_ns.saturating_record(ns.max(1));
    }

    pub fn add(&mut self, other: &Tally) -> Result<()> {
        self.committed += other.committed;
        self.aborted += other.aborted;
        self.aborts.conflict += other.aborts.conflict;
        self.aborts.duplicate_key += other.aborts.duplicate_key;
        self.aborts.snapshot_too_old += other.aborts.snapshot_too_old;
        self.aborts.list_full += other.aborts.list_full;
        self.oracle_reads += other.oracle_reads;
        self.latency_ns.add(&other.latency_ns)?;
        Ok(())
    }

    /// The report of a run of `args` measured over `seconds`; `oracle_reads` says
    /// whether the tally counted them.
    pub fn report(
        &self,
        args: &TxnArgs,
        backend: String,
        servers: u32,
        seconds: f64,
        oracle_reads: bool,
        invariant_ok: Option<bool>,
    ) -> Report {
        let (committed, aborted) = (self.committed, self.aborted);
        let us =
            |q: f64| (committed > 0).then(|| self.latency_ns.value_at_quantile(q) as f64 / 1000.0);
        Report {
            backend,
            workload: format!("{:?}", args.workload).to_lowercase(),
            threads: args.threads,
            coroutines: args.coroutines,
            keys: args.keys,
            dist: format!("{:?}", args.dist).to_lowercase(),
            read_ratio: args.read_ratio,
            servers,
            seconds,
            committed,
            aborted,
            txn_per_sec: committed as f64 / seconds,
            abort_rate: if committed + aborted == 0 {
                0.0
            } else {
                aborted as f64 / (committed + aborted) as f64
            },
            aborts: self.aborts.clone(),
            p50_us: us(0.5),
            p99_us: us(0.99),
            p999_us: us(0.999),
            oracle_reads_per_txn: (oracle_reads && committed > 0)
                .then(|| self.oracle_reads as f64 / committed as f64),
            invariant_ok,
            stopped_early: None,
        }
    }
}

/// The warm-up of a run of `duration`: a tenth, at most one second.
pub(super) fn warmup(duration: Duration) -> Duration {
    (duration / 10).min(Duration::from_secs(1))
}

pub(super) struct KeyPicker {
    keys: u64,
    zipf: Option<Zipf<f64>>,
}

impl KeyPicker {
    pub fn new(args: &TxnArgs) -> Result<KeyPicker> {
        let zipf = match args.dist {
            Dist::Uniform => None,
            Dist::Zipf => Some(
                Zipf::new(args.keys as f64, args.zipf_theta.unwrap_or(ZIPF_THETA))
                    .map_err(|e| anyhow::anyhow!("zipf distribution: {e}"))?,
            ),
        };
        Ok(KeyPicker {
            keys: args.keys,
            zipf,
        })
    }

    pub fn pick(&self, rng: &mut SmallRng) -> u64 {
        match &self.zipf {
            // Zipf ranks start at 1; spread the hot ranks over the key space so they do
            // not share index buckets or partitions by accident.
            Some(z) => {
                let rank = z.sample(rng) as u64 - 1;
                rank.wrapping_mul(0x9e37_79b9_7f4a_7c15) % self.keys
            }
            None => rng.random_range(0..self.keys),
        }
    }
}

fn drive(
    db: &Database,
    table: &Arc<Table>,
    args: &TxnArgs,
    recorder: Option<&HistoryRecorder>,
) -> Result<Report> {
    let picker = KeyPicker::new(args)?;
    let duration = Duration::from_secs_f64(args.duration);
    let warmup = warmup(duration);
    let barrier = Barrier::new(args.threads as usize);
    let run_start = Instant::now();
    // When an append first found its list full, and what to tell the user: the run
    // stops there, since every later transaction appending to that list would fail.
    let full: std::sync::OnceLock<(Instant, String)> = std::sync::OnceLock::new();
    let results: Vec<Result<Tally>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..args.threads)
            .map(|t| {
                let (picker, barrier, full) = (&picker, &barrier, &full);
                s.spawn(move || -> Result<Tally> {
                    let worker = db.worker()?;
                    barrier.wait();
                    let start = Instant::now();
                    let measure_from = start + warmup;
                    let end = start + duration;
                    let result = RefCell::new(Tally::new()?);
                    let reads_before = std::cell::Cell::new(None);
                    let outcomes = worker.run_coroutines(args.coroutines as usize, |c| {
                        let session = (t as u64) * args.coroutines as u64 + c as u64;
                        let (worker, result, reads_before) = (&worker, &result, &reads_before);
                        Box::pin(async move {
                            let mut rng = SmallRng::seed_from_u64(session * 7919 + 17);
                            let mut last_cid = 0u64;
                            let mut appended = 0i64;
                            // One clock read per transaction: its end is the next one's start.
                            let mut now = Instant::now();
                            loop {
                                if now >= end || full.get().is_some() {
                                    return Ok::<(), TxnError>(());
                                }
                                if now >= measure_from && reads_before.get().is_none() {
                                    reads_before.set(Some(worker.stats().oracle_reads));
                                }
                                let mut record = recorder.map(|r| r.begin(session));
                                let outcome = one_txn(
                                    worker,
                                    table,
                                    args,
                                    picker,
                                    &mut rng,
                                    last_cid,
                                    session,
                                    &mut appended,
                                    &mut record,
                                )
                                .await;
                                let finished = Instant::now();
                                let counted = now >= measure_from;
                                let began = std::mem::replace(&mut now, finished);
                                let mut r = result.borrow_mut();
                                match outcome {
                                    Ok(cid) => {
                                        if let Some(c) = cid {
                                            last_cid = last_cid.max(c);
                                        }
                                        if let (Some(rec), Some(record)) = (recorder, record) {
                                            rec.committed(record, cid).map_err(|e| {
                                                TxnError::Invalid(format!("recording: {e}"))
                                            })?;
                                        }
                                        if counted {
                                            r.commit(began, finished);
                                        }
                                    }
                                    Err(e) => {
                                        // The history records the kind, as verify's
                                        // own workloads do: the message names the key
                                        // and snapshot, and `namdb verify` counts
                                        // aborts by their `error`.
                                        let (reason, kind) = match &e {
                                            TxnError::Conflict { .. } => {
                                                (&mut r.aborts.conflict, "conflict")
                                            }
                                            TxnError::DuplicateKey { .. } => {
                                                (&mut r.aborts.duplicate_key, "duplicate_key")
                                            }
                                            TxnError::SnapshotTooOld { .. } => {
                                                (&mut r.aborts.snapshot_too_old, "snapshot_too_old")
                                            }
                                            TxnError::Layout(
                                                txn::layout::LayoutError::ValueTooLarge { .. },
                                            ) => {
                                                let _ = full.set((
                                                    finished,
                                                    format!(
                                                        "a list was full ({} elements, the \
                                                         most --value-size {} holds) after \
                                                         {:.2} s: give more --keys or a \
                                                         larger --value-size to run longer",
                                                        list_elements(args),
                                                        value_cap(args),
                                                        (finished - run_start).as_secs_f64()
                                                    ),
                                                ));
                                                (&mut r.aborts.list_full, "list_full")
                                            }
                                            _ => return Err(e),
                                        };
                                        if counted {
                                            *reason += 1;
                                            r.aborted += 1;
                                        }
                                        if let (Some(rec), Some(record)) = (recorder, record) {
                                            rec.aborted(record, kind).map_err(|e| {
                                                TxnError::Invalid(format!("recording: {e}"))
                                            })?;
                                        }
                                    }
                                }
                            }
                        })
                    });
                    for o in outcomes {
                        o.with_context(|| format!("worker thread {t}"))?;
                    }
                    let mut r = result.into_inner();
                    r.oracle_reads = worker.stats().oracle_reads - reads_before.get().unwrap_or(0);
                    Ok(r)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| bail!("a worker thread panicked"))
            })
            .collect()
    });
    let mut total = Tally::new()?;
    for r in results {
        total.add(&r?)?;
    }
    let stopped = full.into_inner();
    let seconds = match &stopped {
        Some((at, why)) => {
            if *at <= run_start + warmup {
                bail!(
                    "{why}; that was within the {:.2} s warm-up, so nothing was measured",
                    warmup.as_secs_f64()
                );
            }
            at.duration_since(run_start + warmup).as_secs_f64()
        }
        None => (duration - warmup).as_secs_f64(),
    };
    let invariant_ok = match args.workload {
        Workload::Bank => Some(bank_total(db, table)? == BANK_BALANCE * args.keys as i64),
        _ => None,
    };
    let mut report = total.report(
        args,
        args.backend.name().to_string(),
        args.servers,
        seconds,
        true,
        invariant_ok,
    );
    report.stopped_early = stopped.map(|(_, why)| why);
    Ok(report)
}

pub(super) fn counter(value: &[u8]) -> i64 {
    i64::from_le_bytes(value[..8].try_into().expect("values hold at least 8 bytes"))
}

fn list(value: &[u8]) -> Vec<i64> {
    value
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect()
}

fn key_name(key: u64) -> String {
    format!("k{key}")
}

/// One transaction of the workload; its commit timestamp.
#[allow(clippy::too_many_arguments)]
async fn one_txn(
    worker: &Worker,
    table: &Arc<Table>,
    args: &TxnArgs,
    picker: &KeyPicker,
    rng: &mut SmallRng,
    after: u64,
    session: u64,
    appended: &mut i64,
    record: &mut Option<TxnRecord>,
) -> Result<Option<u64>, TxnError> {
    let mut txn = worker.begin(after).await?;
    if let Some(r) = record {
        r.set_read_timestamp(Some(txn.rid()));
    }
    match args.workload {
        Workload::Ycsb => {
            let key = picker.pick(rng);
            let read_only = rng.random_bool(args.read_ratio);
            let value = txn.get(table, key).await?.ok_or_else(|| {
                TxnError::NotFound(format!("key {key} was loaded but is missing"))
            })?;
            let n = counter(&value);
            if let Some(r) = record {
                let version = txn.get_version(table, key).await?;
                r.read(&key_name(key), ReadValue::Register(n), version);
            }
            if !read_only {
                let mut next = value;
                next[..8].copy_from_slice(&(n + 1).to_le_bytes());
                txn.put(table, key, next).await?;
                if let Some(r) = record {
                    r.write(&key_name(key), n + 1);
                }
            }
        }
        Workload::Bank => {
            let a = picker.pick(rng);
            let mut b = picker.pick(rng);
            if b == a {
                b = (a + 1) % args.keys;
            }
            let values = txn.get_many(table, &[a, b]).await?;
            let (Some(va), Some(vb)) = (&values[0], &values[1]) else {
                return Err(TxnError::NotFound("an account is missing".into()));
            };
            let (ba, bb) = (counter(va), counter(vb));
            if let Some(r) = record {
                for (k, v) in [(a, ba), (b, bb)] {
                    let version = txn.get_version(table, k).await?;
                    r.read(&key_name(k), ReadValue::Register(v), version);
                }
            }
            let amount = rng.random_range(1..=10);
            if !rng.random_bool(args.read_ratio) && ba >= amount {
                txn.put(table, a, (ba - amount).to_le_bytes().to_vec())
                    .await?;
                txn.put(table, b, (bb + amount).to_le_bytes().to_vec())
                    .await?;
                if let Some(r) = record {
                    r.write(&key_name(a), ba - amount);
                    r.write(&key_name(b), bb + amount);
                }
            }
        }
        Workload::ListAppend => {
            let ops = rng.random_range(1..=3);
            for _ in 0..ops {
                let key = picker.pick(rng);
                let current = txn.get(table, key).await?;
                if rng.random_bool(args.read_ratio) {
                    if let Some(r) = record {
                        let version = txn.get_version(table, key).await?;
                        let value = match &current {
                            Some(v) => ReadValue::List(list(v)),
                            None => ReadValue::Absent,
                        };
                        r.read(&key_name(key), value, version);
                    }
                } else {
                    // Unique per session: the session in the high bits.
                    *appended += 1;
                    let element = ((session as i64) << 32) | *appended;
                    let mut bytes = current.unwrap_or_default();
                    bytes.extend_from_slice(&element.to_le_bytes());
                    txn.put(table, key, bytes).await?;
                    if let Some(r) = record {
                        r.append(&key_name(key), element);
                    }
                }
            }
        }
    }
    txn.commit().await
}

/// The sum of all balances, in one snapshot.
fn bank_total(db: &Database, table: &Arc<Table>) -> Result<i64> {
    let mut client = db.client()?;
    let mut txn = client.begin()?;
    let rows = txn.scan(table, |_, _| true)?;
    Ok(rows.iter().map(|(_, v)| counter(v)).sum())
}

fn print(r: &Report, args: &TxnArgs) {
    println!(
        "bench txn: {} on {}, {} threads x {} coroutines, {} keys ({}), read ratio {}, {} server(s)",
        r.workload, r.backend, r.threads, r.coroutines, r.keys, r.dist, r.read_ratio, r.servers
    );
    println!(
        "  committed {:>12}   {:>12.0} txn/s   over {:.2} s (after {:.2} s warm-up)",
        r.committed,
        r.txn_per_sec,
        r.seconds,
        warmup(Duration::from_secs_f64(args.duration)).as_secs_f64()
    );
    if let Some(why) = &r.stopped_early {
        println!("  stopped early: {why}");
    }
    println!(
        "  aborted   {:>12}   abort rate {:.2}%  (conflict {}, duplicate key {}, snapshot too old {}, list full {})",
        r.aborted,
        r.abort_rate * 100.0,
        r.aborts.conflict,
        r.aborts.duplicate_key,
        r.aborts.snapshot_too_old,
        r.aborts.list_full
    );
    println!("{}", latency_line(r));
    if let Some(ok) = r.invariant_ok {
        println!(
            "  bank invariant: {}",
            if ok { "money conserved" } else { "VIOLATED" }
        );
    }
    if args.workload == Workload::Ycsb && r.read_ratio == 0.0 && r.backend == "sim" {
        println!(
            "  goal: >= 1 M single-key read-modify-write txn/s on 2 cores on sim: {}",
            if r.txn_per_sec >= 1e6 {
                "met"
            } else {
                "not met"
            }
        );
    }
}

/// The report's latency line: none when nothing committed in the measured time.
fn latency_line(r: &Report) -> String {
    let oracle = match r.oracle_reads_per_txn {
        Some(n) => format!("   oracle reads per txn {n:.2}"),
        None => String::new(),
    };
    match (r.p50_us, r.p99_us, r.p999_us) {
        (Some(p50), Some(p99), Some(p999)) => {
            format!("  latency   p50 {p50:.1} us   p99 {p99:.1} us   p99.9 {p999:.1} us{oracle}")
        }
        _ => format!(
            "  latency   none: no transaction committed in the measured {:.2} s",
            r.seconds
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[test]
    fn a_run_with_nothing_committed_reports_no_latency() {
        let args = args(&["--keys", "100"]);
        let r = Tally::new()
            .unwrap()
            .report(&args, "sim".into(), 1, 0.0009, true, None);
        let json = serde_json::to_value(&r).unwrap();
        for field in ["p50_us", "p99_us", "p999_us", "oracle_reads_per_txn"] {
            assert!(json[field].is_null(), "{field}: {json}");
        }
        let line = latency_line(&r);
        assert_eq!(
            line, "  latency   none: no transaction committed in the measured 0.00 s",
            "{line}"
        );
        // A run that committed reports its figures as before.
        let mut tally = Tally::new().unwrap();
        let began = Instant::now();
        tally.commit(began, began + Duration::from_micros(20));
        tally.oracle_reads = 3;
        let r = tally.report(&args, "sim".into(), 1, 1.0, true, None);
        let line = latency_line(&r);
        assert!(
            line.starts_with("  latency   p50 20.0 us   p99 20.0 us")
                && line.ends_with("per txn 3.00"),
            "{line}"
        );
    }

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: TxnArgs,
    }

    fn args(line: &[&str]) -> TxnArgs {
        Cli::parse_from(std::iter::once("txn").chain(line.iter().copied())).args
    }

    #[test]
    fn list_append_sizes_its_lists_for_the_keys_unless_told() {
        let cap = |line: &[&str]| value_cap(&args(line));
        assert_eq!(
            cap(&["--workload", "list-append", "--keys", "100"]),
            16 << 10
        );
        assert_eq!(cap(&["--workload", "list-append", "--keys", "100000"]), 576);
        assert_eq!(
            cap(&["--workload", "list-append", "--keys", "100000000"]),
            64
        );
        assert_eq!(
            cap(&[
                "--workload",
                "list-append",
                "--keys",
                "100",
                "--value-size",
                "64"
            ]),
            64
        );
        assert_eq!(cap(&[]), 64);
        assert_eq!(cap(&["--value-size", "128"]), 128);
        assert_eq!(cap(&["--workload", "bank"]), 8);
    }

    /// Every server's partition has its own index: sized for its share of the keys,
    /// the indexes together take the same memory however many servers there are.
    #[test]
    fn the_indexes_together_do_not_grow_with_the_servers() {
        let bytes = |servers: &str| {
            table_bytes(&args(&["--keys", "1000000", "--servers", servers])).unwrap()
        };
        let (one, sixteen) = (bytes("1") as f64, bytes("16") as f64);
        // Only the arenas grow: by the partitions' headroom over an even share of the
        // keys (4σ of 62500 is 969 blocks a partition, 1.6% in all).
        assert!(
            sixteen / one < 1.02,
            "{one} bytes on 1 server, {sixteen} on 16"
        );
    }
}
