//! One node's side of a shuffle benchmark run, the same whether the node is a thread
//! (sim) or a process (shm, tcp, verbs): generate and permute the fragment, measure
//! memcpy, set up (endpoints of a design, or the sockets of the TCP baseline), shuffle
//! with T sender and T receiver threads, and check what arrived.
//!
//! Verification: before the run each node sums, per destination, the checksum
//! (`shuffle::testing::Checksum`) of the tuples it will send there; after the run the
//! nodes all-gather those, and each checks that what its receivers consumed equals the
//! merge of what every source sent to it. Count, wrapping sum and xor of a mixed hash
//! must all agree, so a lost, duplicated or corrupted tuple fails the run.

use anyhow::{Context, Result, anyhow, bail, ensure};
use fabric::Device;
use rand::SeedableRng;
use rand::seq::SliceRandom;
use serde::{Deserialize, Serialize};
use shuffle::testing::{Checksum, tuple};
use shuffle::{
    Buffering, EndpointConfig, Exchange, Groups, Node, Notify, OwnPartition, Phase, Progress,
    Received, Shuffle, ShuffleWriter, receive_all,
};
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Bytes a node pins for its buffer pools at most.
const PIN_LIMIT: u64 = 1 << 30;

/// How long a blocked endpoint call or socket may go without progress.
pub const STALL_LIMIT: Duration = Duration::from_secs(20);

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Pattern {
    Repartition,
    Broadcast,
}

impl Pattern {
    pub fn name(self) -> &'static str {
        match self {
            Pattern::Repartition => "repartition",
            Pattern::Broadcast => "broadcast",
        }
    }
}

/// What a run shuffles with.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Method {
    /// One of the eight designs, by its paper name (`MEMQ/WR`).
    Design(String),
    /// The sockets baseline: a loopback TCP connection per pair of nodes.
    Tcp,
}

/// One run, as every node of it sees it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Job {
    pub method: Method,
    pub pattern: Pattern,
    pub threads: usize,
    /// Tuples in each node's fragment.
    pub tuples: u64,
    pub seed: u64,
    pub message_bytes: u32,
    /// `adaptive` or `bdp`.
    pub buffering: String,
    pub notify: String,
    /// How often a node process reports its [`Progress`] to the benchmark, in ms
    /// ([`crate::bench::nodes::report_progress`]); its count is the payload bytes its
    /// receivers consumed, added a whole buffer at a time.
    pub progress_ms: u64,
    /// Each of the `threads` threads of a node both sends and receives
    /// ([`shuffle::send_and_receive`]), instead of `threads` senders and `threads`
    /// receivers. Designs only.
    #[serde(default)]
    pub interleave: bool,
    /// With `interleave`: the node's own tuples go through the fabric's loopback
    /// instead of being consumed in place ([`shuffle::OwnPartition`]).
    #[serde(default)]
    pub own_via_fabric: bool,
    /// Pin the node to its own `threads` cores ([`crate::bench::nodes::pin_node`]).
    #[serde(default)]
    pub pin: bool,
}

/// What one node measured.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct NodeResult {
    pub rank: usize,
    /// Payload bytes this node's receivers consumed (its own partition included).
    pub received_bytes: u64,
    /// From the start barrier until this node's senders and receivers were done.
    pub seconds: f64,
    pub memcpy_gb_per_sec: f64,
    /// The fragment partitioned with nothing sent ([`partition_gb_per_sec`]).
    pub partition_gb_per_sec: f64,
    /// A repartitioning node's whole work with nothing sent ([`work_alone_gb_per_sec`]);
    /// `None` in a broadcast.
    #[serde(default)]
    pub work_alone_gb_per_sec: Option<f64>,
    pub setup_ms: f64,
    pub pinned_bytes: u64,
    /// The CPUs this node's threads may run on, as the system reports them after the
    /// run: its own with [`Job::pin`], else all this process may use.
    pub cpus: Vec<usize>,
}

/// The barrier of the exchange: an all-gather of nothing.
fn barrier(x: &dyn Exchange, tag: &str) -> Result<()> {
    x.all_gather(tag, Vec::new())?;
    Ok(())
}

fn gather<T: Serialize + for<'a> Deserialize<'a>>(
    x: &dyn Exchange,
    tag: &str,
    mine: &T,
) -> Result<Vec<T>> {
    let bytes = serde_json::to_vec(mine).expect("in-memory encoding");
    x.all_gather(tag, bytes)?
        .iter()
        .enumerate()
        .map(|(r, b)| serde_json::from_slice(b).with_context(|| format!("{tag} from rank {r}")))
        .collect()
}

/// This node's fragment of R(a, b): `tuples` tuples, `a` uniform, `b` unique, in a
/// random order.
pub fn fragment(seed: u64, rank: usize, tuples: u64) -> Vec<[u64; 2]> {
    let mut frag: Vec<[u64; 2]> = (0..tuples).map(|i| tuple(seed, rank, 0, i)).collect();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ (rank as u64 + 1) << 32);
    frag.shuffle(&mut rng);
    frag
}

/// Per destination rank, the checksum of what this node sends there.
fn sent_checksums(frag: &[[u64; 2]], pattern: Pattern, nodes: usize, rank: usize) -> Vec<Checksum> {
    let mut out = vec![Checksum::default(); nodes];
    match pattern {
        Pattern::Repartition => {
            for &[a, b] in frag {
                out[shuffle::testing::partition(a, nodes)].add(a, b);
            }
        }
        Pattern::Broadcast => {
            let mut one = Checksum::default();
            for &[a, b] in frag {
                one.add(a, b);
            }
            for (r, c) in out.iter_mut().enumerate() {
                if r != rank {
                    *c = one;
                }
            }
        }
    }
    out
}

/// Timed tries of each reference (memcpy, partitioning alone); the fastest counts, so
/// that one try descheduled on a busy machine does not lower the reference the
/// shuffle is compared with. Every node takes the same tries between the same
/// barriers as the others.
const REFERENCE_TRIES: usize = 3;

/// The fastest of [`REFERENCE_TRIES`] runs of `once`, which returns the seconds it took.
fn fastest(mut once: impl FnMut() -> f64) -> f64 {
    (0..REFERENCE_TRIES)
        .map(|_| once())
        .fold(f64::INFINITY, f64::min)
        .max(1e-9)
}

/// GB/s of copying the fragment's bytes into another (already touched) array.
fn memcpy_gb_per_sec(frag: &[[u64; 2]]) -> f64 {
    let mut dst = vec![[0u64; 2]; frag.len()];
    // The first copy faults the destination's pages in; the later ones are measured.
    dst.copy_from_slice(frag);
    let secs = fastest(|| {
        let t0 = Instant::now();
        dst.copy_from_slice(std::hint::black_box(frag));
        std::hint::black_box(&mut dst);
        t0.elapsed().as_secs_f64()
    });
    (frag.len() * 16) as f64 / secs / 1e9
}

/// GB/s of partitioning the fragment on `a` over `groups` groups into buffers of
/// `message_bytes` that are reused at once, with nothing sent: a repartitioning
/// sender with a core to itself and no other work. A node that also moves and
/// consumes what it receives on the same core receives less than this (uniform keys:
/// a node receives about what it sends).
fn partition_gb_per_sec(frag: &[[u64; 2]], groups: usize, message_bytes: u32) -> f64 {
    let out = message_buffers(groups.max(1), message_bytes);
    let secs = fastest(|| {
        let t0 = Instant::now();
        scatter(frag, &out, |_, _| {});
        std::hint::black_box(&out);
        t0.elapsed().as_secs_f64()
    });
    (frag.len() * 16) as f64 / secs / 1e9
}

/// `count` zeroed buffers of the whole tuples a message of `message_bytes` holds.
fn message_buffers(count: usize, message_bytes: u32) -> Vec<Vec<AtomicU64>> {
    (0..count).map(|_| message_buffer(message_bytes)).collect()
}

/// A zeroed buffer of the whole tuples a message of `message_bytes` holds.
fn message_buffer(message_bytes: u32) -> Vec<AtomicU64> {
    let words = ((message_bytes as usize / 8) & !1).max(2);
    (0..words).map(|_| AtomicU64::new(0)).collect()
}

/// Partitions `frag` on `a` over `out.len()` groups into the buffers `out` with the
/// loop `ShuffleWriter::push_partitioned` runs for that many groups; `full(group,
/// words)` sees a buffer that filled before it is filled again. Returns each buffer's
/// filled words at the end.
fn scatter(
    frag: &[[u64; 2]],
    out: &[Vec<AtomicU64>],
    mut full: impl FnMut(usize, usize),
) -> Vec<usize> {
    if let Ok(two) = <&[Vec<AtomicU64>; 2]>::try_from(out) {
        return scatter_into_two(frag, two, full).to_vec();
    }
    let groups = out.len();
    let mut fill = vec![0usize; groups];
    // The input prefetch of `ShuffleWriter::push_partitioned`.
    let (ahead, per_line) = shuffle::operator::prefetch_stride::<2>();
    for (i, t) in frag.iter().enumerate() {
        if i.is_multiple_of(per_line) {
            fabric::prefetch(frag, i + ahead);
        }
        let g = shuffle::testing::partition(t[0], groups);
        let buf = &out[g];
        if fill[g] + 2 > buf.len() {
            full(g, fill[g]);
            fill[g] = 0;
        }
        let f = fill[g];
        buf[f].store(t[0], Ordering::Relaxed);
        buf[f + 1].store(t[1], Ordering::Relaxed);
        fill[g] = f + 2;
    }
    fill
}

/// Partitions `frag` over two groups into the two buffers `out` with the loop
/// `ShuffleWriter::push_partitioned` runs for two groups; `full(group, words)` sees a
/// buffer that filled before it is filled again. Returns each buffer's filled words at
/// the end.
fn scatter_into_two(
    frag: &[[u64; 2]],
    out: &[Vec<AtomicU64>; 2],
    mut full: impl FnMut(usize, usize),
) -> [usize; 2] {
    let group_of = |t: &[u64; 2]| shuffle::testing::partition(t[0], 2);
    let mut rest = [&out[0][..], &out[1][..]];
    let mut tuples = frag;
    while !tuples.is_empty() {
        let copied = shuffle::scatter::two_groups(tuples, &group_of, &mut rest);
        tuples = &tuples[copied..];
        if let Some(stopped) = tuples.first() {
            let g = group_of(stopped);
            full(g, out[g].len() - rest[g].len());
            rest[g] = &out[g];
        }
    }
    [0, 1].map(|g| out[g].len() - rest[g].len())
}

/// GB/s of a repartitioning node's whole work on its one core with nothing sent:
/// partitioning the fragment as [`partition_gb_per_sec`] does, then, per full buffer,
/// consuming it in place (the bench's checksum) when it is this node's own, or else
/// making the copy a software backend makes of it ([`fabric::copy_between`]) into a
/// receive buffer and consuming that, as the peer's buffer this node receives
/// instead (uniform keys: a node receives about what it sends). What a shuffle that
/// moves its data between processes on the same cores cannot exceed, transport aside.
fn work_alone_gb_per_sec(frag: &[[u64; 2]], groups: usize, rank: usize, message_bytes: u32) -> f64 {
    let secs = fastest(|| {
        let t0 = Instant::now();
        std::hint::black_box(work_alone(frag, groups, rank, message_bytes));
        t0.elapsed().as_secs_f64()
    });
    (frag.len() * 16) as f64 / secs / 1e9
}

/// One run of [`work_alone_gb_per_sec`]'s work; the checksum of every tuple consumed.
fn work_alone(frag: &[[u64; 2]], groups: usize, rank: usize, message_bytes: u32) -> Checksum {
    let out = message_buffers(groups.max(1), message_bytes);
    let received = message_buffer(message_bytes);
    let mut sum = Checksum::default();
    let mut consume = |group: usize, filled: usize| {
        let full = &out[group][..filled];
        if group == rank {
            sum.add_payload(full);
        } else {
            fabric::copy_between(full, 0, &received, 0, filled as u64 * 8);
            sum.add_payload(&received[..filled]);
        }
    };
    let filled = scatter(frag, &out, &mut consume);
    for (group, words) in filled.into_iter().enumerate() {
        consume(group, words);
    }
    sum
}

/// The part of the fragment sender thread `tid` of `threads` scans.
fn slice(frag: &[[u64; 2]], tid: usize, threads: usize) -> &[[u64; 2]] {
    let n = frag.len();
    &frag[n * tid / threads..n * (tid + 1) / threads]
}

/// Parses `--buffering` for a message size.
pub fn buffering(name: &str, message_bytes: u32) -> Result<Buffering> {
    match name {
        "adaptive" => Ok(Buffering::default()),
        // The §6.1 baseline, for a 100 Gb/s port and a 4 µs round trip.
        "bdp" => Ok(Buffering::bandwidth_delay(
            12.5e9,
            Duration::from_micros(4),
            message_bytes,
        )),
        other => bail!("unknown buffering {other:?}: expected adaptive or bdp"),
    }
}

/// Runs `job` as rank `exchange.rank()`. `device` is this node's fabric device (a
/// design's run needs one; the TCP baseline does not).
pub fn run_node(
    job: &Job,
    exchange: Arc<dyn Exchange>,
    device: Option<Arc<dyn Device>>,
    progress: &Progress,
) -> Result<NodeResult> {
    let rank = exchange.rank();
    let nodes = exchange.nodes();
    ensure!(job.threads >= 1, "threads must be at least 1");
    if job.pin {
        crate::bench::nodes::pin_node(rank, job.threads)?;
    }
    progress.enter(Phase::Preparing);
    let frag = fragment(job.seed, rank, job.tuples);
    let sent = sent_checksums(&frag, job.pattern, nodes, rank);

    barrier(&*exchange, "memcpy")?;
    let memcpy = memcpy_gb_per_sec(&frag);
    barrier(&*exchange, "partition")?;
    let partition = partition_gb_per_sec(&frag, nodes, job.message_bytes);
    let work_alone = match job.pattern {
        Pattern::Repartition => {
            barrier(&*exchange, "work alone")?;
            Some(work_alone_gb_per_sec(&frag, nodes, rank, job.message_bytes))
        }
        Pattern::Broadcast => None,
    };

    progress.enter(Phase::Opening);
    let (outcome, pinned_bytes) = match &job.method {
        Method::Design(name) => {
            let device = device.context("a design needs a fabric device")?;
            let node = Node::join(device, exchange.clone(), PIN_LIMIT)?;
            let outcome = run_design(job, name, &node, &frag, progress)?;
            (outcome, node.pinned_bytes())
        }
        Method::Tcp => {
            ensure!(
                !job.interleave,
                "the TCP baseline has separate sender and receiver threads only"
            );
            (run_tcp(job, &*exchange, &frag, progress)?, 0)
        }
    };
    progress.enter(Phase::Verifying);
    let Outcome {
        setup_ms,
        seconds,
        received,
    } = outcome;

    let all_sent: Vec<Vec<(u64, u64, u64)>> = gather(
        &*exchange,
        "sent checksums",
        &sent
            .iter()
            .map(|c| (c.count, c.sum, c.xor))
            .collect::<Vec<_>>(),
    )?;
    let mut want = Checksum::default();
    for (src, per_dest) in all_sent.iter().enumerate() {
        let &(count, sum, xor) = per_dest
            .get(rank)
            .ok_or_else(|| anyhow!("rank {src} sent {} checksums", per_dest.len()))?;
        want.merge(&Checksum { count, sum, xor });
    }
    let method = match &job.method {
        Method::Design(d) => d.as_str(),
        Method::Tcp => "tcp",
    };
    ensure!(
        received == want,
        "VERIFICATION FAILED: {method} {}: node {rank} received {} tuples (sum {:#x}, xor \
         {:#x}), but was sent {} (sum {:#x}, xor {:#x})",
        job.pattern.name(),
        received.count,
        received.sum,
        received.xor,
        want.count,
        want.sum,
        want.xor
    );
    progress.enter(Phase::Done);
    Ok(NodeResult {
        rank,
        received_bytes: received.count * 16,
        seconds,
        memcpy_gb_per_sec: memcpy,
        partition_gb_per_sec: partition,
        work_alone_gb_per_sec: work_alone,
        setup_ms,
        pinned_bytes,
        cpus: crate::bench::nodes::allowed_cpus()?,
    })
}

struct Outcome {
    setup_ms: f64,
    seconds: f64,
    received: Checksum,
}

/// Spawns a scoped thread named `name`, so that a profile tells a node's senders from
/// its receivers (`perf report --comm shuffle-send-0`). Like `Scope::spawn`, it panics
/// only if the system cannot start a thread.
fn spawn_named<'scope, 'env, T: Send + 'scope>(
    scope: &'scope std::thread::Scope<'scope, 'env>,
    name: String,
    f: impl FnOnce() -> T + Send + 'scope,
) -> std::thread::ScopedJoinHandle<'scope, T> {
    std::thread::Builder::new()
        .name(name)
        .spawn_scoped(scope, f)
        .expect("failed to spawn thread")
}

/// Collects the first error of several threads.
fn first_error<T>(results: impl IntoIterator<Item = std::thread::Result<Result<T>>>) -> Result<()> {
    let mut first = None;
    for r in results {
        let r = r.unwrap_or_else(|_| Err(anyhow!("a shuffle thread panicked")));
        if let Err(e) = r {
            first.get_or_insert(e);
        }
    }
    first.map_or(Ok(()), Err)
}

fn run_design(
    job: &Job,
    name: &str,
    node: &Node,
    frag: &[[u64; 2]],
    progress: &Progress,
) -> Result<Outcome> {
    let design: shuffle::Design = name.parse()?;
    let config = EndpointConfig {
        threads: job.threads,
        message_bytes: job.message_bytes,
        buffering: buffering(&job.buffering, job.message_bytes)?,
        notify: job.notify.parse::<Notify>()?,
        timeout: STALL_LIMIT,
        ..EndpointConfig::default()
    };
    let t0 = Instant::now();
    let opened = shuffle::open(node, design, &config)?;
    let groups = match job.pattern {
        Pattern::Repartition => Groups::repartition(node.nodes()),
        Pattern::Broadcast => Groups::broadcast(node.nodes(), node.rank()),
    };
    let shuffle =
        Shuffle::new(opened, groups, job.threads)?.with_own_partition(if job.own_via_fabric {
            OwnPartition::Fabric
        } else {
            OwnPartition::InPlace
        });
    let setup_ms = t0.elapsed().as_secs_f64() * 1e3;

    node.all_gather("start", &())?;
    progress.enter(Phase::Shuffling);
    let start = Instant::now();
    let nodes = node.nodes();
    let received = Mutex::new(Checksum::default());
    let send = |w: &mut ShuffleWriter<'_>, tid: usize| -> shuffle::Result<()> {
        let mine = slice(frag, tid, job.threads);
        match job.pattern {
            Pattern::Repartition => {
                w.push_partitioned(mine, |t| shuffle::testing::partition(t[0], nodes))
            }
            // Every tuple goes to the one group: whole buffers at a time.
            Pattern::Broadcast => w.push_all(0, mine),
        }
    };
    let add_up = |tally: Tally| -> Result<()> {
        ensure!(!tally.odd, "a received buffer held half a tuple");
        received
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .merge(&tally.sum);
        Ok(())
    };
    std::thread::scope(|s| {
        let mut threads = Vec::new();
        for tid in 0..job.threads {
            let (shuffle, send, add_up) = (&shuffle, &send, &add_up);
            if job.interleave {
                threads.push(spawn_named(s, format!("shuffle-{tid}"), move || {
                    let mut tally = Tally::default();
                    shuffle::send_and_receive(
                        shuffle,
                        tid,
                        |w| send(w, tid),
                        |data| tally.add(data, progress),
                    )?;
                    add_up(tally)
                }));
                continue;
            }
            threads.push(spawn_named(s, format!("shuffle-send-{tid}"), move || {
                let mut w = shuffle.writer(tid);
                send(&mut w, tid)?;
                w.finish()?;
                Ok(())
            }));
            let endpoint = shuffle.receiver(tid);
            threads.push(spawn_named(s, format!("shuffle-recv-{tid}"), move || {
                let mut tally = Tally::default();
                receive_all(&*endpoint, |data| tally.add(data, progress))?;
                add_up(tally)
            }));
        }
        first_error(threads.into_iter().map(|h| h.join()))
    })?;
    let seconds = start.elapsed().as_secs_f64();
    node.all_gather("end", &())?;
    Ok(Outcome {
        setup_ms,
        seconds,
        received: received.into_inner().unwrap_or_else(|e| e.into_inner()),
    })
}

/// What a receiving thread consumed.
#[derive(Default)]
struct Tally {
    sum: Checksum,
    /// A buffer held half a tuple.
    odd: bool,
}

impl Tally {
    fn add(&mut self, data: &Received, progress: &Progress) {
        let words = data.payload();
        progress.add(words.len() as u64 * 8);
        self.odd |= !self.sum.add_payload(words);
    }
}

/// Writes all of `bytes` to a socket that may be non-blocking (its reading side, a
/// clone of the same file, is).
fn write_fully(s: &mut TcpStream, mut bytes: &[u8]) -> Result<()> {
    let mut stalled = Instant::now();
    while !bytes.is_empty() {
        match s.write(bytes) {
            Ok(0) => bail!("a peer closed its connection"),
            Ok(n) => {
                bytes = &bytes[n..];
                stalled = Instant::now();
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                ensure!(
                    stalled.elapsed() < STALL_LIMIT,
                    "a peer read nothing for {STALL_LIMIT:?}"
                );
                std::thread::sleep(Duration::from_micros(20));
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e).context("writing to a peer"),
        }
    }
    Ok(())
}

/// Prefetches [`fabric::PREFETCH_AHEAD_BYTES`] ahead of tuple `i`, once per cache line,
/// as `ShuffleWriter::push_partitioned` does for the designs, so the baseline's scan is
/// no slower than theirs.
fn read_ahead(tuples: &[[u64; 2]], i: usize) {
    if i.is_multiple_of(4) {
        fabric::prefetch(tuples, i + fabric::PREFETCH_AHEAD_BYTES / 16);
    }
}

fn tuple_bytes(t: &[u64; 2], out: &mut Vec<u8>) {
    out.extend_from_slice(&t[0].to_le_bytes());
    out.extend_from_slice(&t[1].to_le_bytes());
}

/// The sockets baseline: a loopback TCP connection per pair of nodes; sender threads
/// partition into per-destination buffers of `message_bytes` and write each full one
/// to its destination's socket; receiver threads poll their share of the sockets.
/// A node's own partition goes straight to its checksum.
fn run_tcp(job: &Job, x: &dyn Exchange, frag: &[[u64; 2]], progress: &Progress) -> Result<Outcome> {
    let rank = x.rank();
    let nodes = x.nodes();
    let t0 = Instant::now();
    let listener = TcpListener::bind("127.0.0.1:0").context("tcp baseline: listen")?;
    let ports: Vec<u16> = gather(x, "tcp ports", &listener.local_addr()?.port())?;
    let mut peers: Vec<Option<TcpStream>> = (0..nodes).map(|_| None).collect();
    // Connect to every higher rank (its listener is bound already), accept the lower.
    for (r, &port) in ports.iter().enumerate().skip(rank + 1) {
        let mut s = TcpStream::connect(("127.0.0.1", port))
            .with_context(|| format!("tcp baseline: connect to rank {r}"))?;
        s.write_all(&(rank as u32).to_le_bytes())?;
        peers[r] = Some(s);
    }
    for _ in 0..rank {
        let (mut s, _) = listener.accept().context("tcp baseline: accept")?;
        let mut hello = [0; 4];
        s.read_exact(&mut hello)?;
        let r = u32::from_le_bytes(hello) as usize;
        ensure!(
            r < rank && peers[r].is_none(),
            "tcp baseline: unexpected hello from rank {r}"
        );
        peers[r] = Some(s);
    }
    let mut writers: Vec<Option<Mutex<TcpStream>>> = Vec::with_capacity(nodes);
    let mut readers: Vec<TcpStream> = Vec::new();
    for p in peers.into_iter().flatten() {
        let w = p.try_clone()?;
        p.set_nonblocking(true)?;
        readers.push(p);
        writers.push(Some(Mutex::new(w)));
    }
    writers.insert(rank, None);
    let setup_ms = t0.elapsed().as_secs_f64() * 1e3;

    barrier(x, "tcp start")?;
    progress.enter(Phase::Shuffling);
    let start = Instant::now();
    let message = (job.message_bytes as usize).max(16) / 16 * 16;
    let unfinished = AtomicUsize::new(job.threads);
    let received = Mutex::new(Checksum::default());
    let receiver_threads = job.threads.min(readers.len());
    let mut shares: Vec<Vec<TcpStream>> = (0..receiver_threads).map(|_| Vec::new()).collect();
    for (i, r) in readers.into_iter().enumerate() {
        shares[i % receiver_threads.max(1)].push(r);
    }
    std::thread::scope(|s| {
        let writers = &writers;
        let senders: Vec<_> = (0..job.threads)
            .map(|tid| {
                let (unfinished, received) = (&unfinished, &received);
                s.spawn(move || -> Result<()> {
                    let send = |dest: usize, buf: &mut Vec<u8>| -> Result<()> {
                        if let Some(w) = &writers[dest] {
                            write_fully(&mut w.lock().unwrap_or_else(|e| e.into_inner()), buf)?;
                        }
                        buf.clear();
                        Ok(())
                    };
                    let mut local = Checksum::default();
                    match job.pattern {
                        Pattern::Repartition => {
                            let mut out: Vec<Vec<u8>> =
                                (0..nodes).map(|_| Vec::with_capacity(message)).collect();
                            let mine = slice(frag, tid, job.threads);
                            for (i, t) in mine.iter().enumerate() {
                                // The designs' senders read ahead the same way.
                                read_ahead(mine, i);
                                let d = shuffle::testing::partition(t[0], nodes);
                                if d == rank {
                                    local.add(t[0], t[1]);
                                    continue;
                                }
                                tuple_bytes(t, &mut out[d]);
                                if out[d].len() >= message {
                                    send(d, &mut out[d])?;
                                }
                            }
                            for (d, buf) in out.iter_mut().enumerate() {
                                if !buf.is_empty() {
                                    send(d, buf)?;
                                }
                            }
                        }
                        Pattern::Broadcast => {
                            let mut buf = Vec::with_capacity(message);
                            let mine = slice(frag, tid, job.threads);
                            for (i, t) in mine.iter().enumerate() {
                                read_ahead(mine, i);
                                tuple_bytes(t, &mut buf);
                                if buf.len() >= message {
                                    broadcast(writers, &buf)?;
                                    buf.clear();
                                }
                            }
                            if !buf.is_empty() {
                                broadcast(writers, &buf)?;
                            }
                        }
                    }
                    // A node's own partition skips the sockets and counts at once.
                    progress.add(local.count * 16);
                    received
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .merge(&local);
                    if unfinished.fetch_sub(1, Ordering::AcqRel) == 1 {
                        // The last sender ends every stream: the peers read end of file.
                        for w in writers.iter().flatten() {
                            w.lock()
                                .unwrap_or_else(|e| e.into_inner())
                                .shutdown(Shutdown::Write)?;
                        }
                    }
                    Ok(())
                })
            })
            .collect();
        let receivers: Vec<_> = shares
            .into_iter()
            .map(|sockets| {
                let received = &received;
                s.spawn(move || -> Result<()> {
                    let mine = poll_sockets(sockets, message, progress)?;
                    received
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .merge(&mine);
                    Ok(())
                })
            })
            .collect();
        first_error(senders.into_iter().chain(receivers).map(|h| h.join()))
    })?;
    let seconds = start.elapsed().as_secs_f64();
    barrier(x, "tcp end")?;
    Ok(Outcome {
        setup_ms,
        seconds,
        received: received.into_inner().unwrap_or_else(|e| e.into_inner()),
    })
}

fn broadcast(writers: &[Option<Mutex<TcpStream>>], buf: &[u8]) -> Result<()> {
    for w in writers.iter().flatten() {
        write_fully(&mut w.lock().unwrap_or_else(|e| e.into_inner()), buf)?;
    }
    Ok(())
}

/// Reads every socket of `sockets` (non-blocking) to its end, consuming whole tuples.
fn poll_sockets(sockets: Vec<TcpStream>, message: usize, progress: &Progress) -> Result<Checksum> {
    let mut sum = Checksum::default();
    // Per socket: bytes of a tuple split across reads.
    let mut open: Vec<(TcpStream, Vec<u8>)> = sockets
        .into_iter()
        .map(|s| (s, Vec::with_capacity(16)))
        .collect();
    let mut buf = vec![0u8; message.max(4096) + 16];
    let mut idle = 0u32;
    let mut stalled = Instant::now();
    while !open.is_empty() {
        let mut moved = false;
        let mut i = 0;
        while i < open.len() {
            let (sock, carry) = &mut open[i];
            let n = carry.len();
            buf[..n].copy_from_slice(carry);
            match sock.read(&mut buf[n..]) {
                Ok(0) => {
                    ensure!(carry.is_empty(), "a peer's stream ended inside a tuple");
                    open.swap_remove(i);
                    moved = true;
                    continue;
                }
                Ok(got) => {
                    let total = n + got;
                    let whole = total / 16 * 16;
                    // The carried bytes (under a tuple) were not counted before.
                    progress.add(whole as u64);
                    for t in buf[..whole].chunks_exact(16) {
                        let a = u64::from_le_bytes(t[..8].try_into().expect("8 bytes"));
                        let b = u64::from_le_bytes(t[8..].try_into().expect("8 bytes"));
                        sum.add(a, b);
                    }
                    carry.clear();
                    carry.extend_from_slice(&buf[whole..total]);
                    moved = true;
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(e).context("reading from a peer"),
            }
            i += 1;
        }
        if moved {
            idle = 0;
            stalled = Instant::now();
        } else {
            idle += 1;
            ensure!(
                stalled.elapsed() < STALL_LIMIT,
                "tcp baseline: nothing arrived for {STALL_LIMIT:?}"
            );
            if idle < 64 {
                std::hint::spin_loop();
            } else if idle < 256 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(20));
            }
        }
    }
    Ok(sum)
}

#[cfg(test)]
mod tests {
    use super::*;
    use shuffle::LocalExchange;

    #[test]
    fn fragments_are_permutations_with_unique_b() {
        let f = fragment(7, 3, 1000);
        let mut bs: Vec<u64> = f.iter().map(|t| t[1]).collect();
        assert_ne!(bs, (0..1000).map(|i| 3u64 << 48 | i).collect::<Vec<_>>());
        bs.sort_unstable();
        assert_eq!(bs, (0..1000).map(|i| 3u64 << 48 | i).collect::<Vec<_>>());
    }

    /// The work-alone reference consumes every tuple of the fragment once, whichever
    /// loop partitions it (two groups or the general one) and whether a buffer is this
    /// node's own or copied first, including the partly filled last buffers.
    #[test]
    fn the_work_alone_reference_consumes_every_tuple_once() {
        let frag = fragment(5, 1, 10_007);
        let mut whole = Checksum::default();
        for &[a, b] in &frag {
            whole.add(a, b);
        }
        for groups in [1, 2, 3, 5] {
            for rank in [0, groups - 1] {
                for message_bytes in [16, 1000, 65536] {
                    let got = work_alone(&frag, groups, rank, message_bytes);
                    assert_eq!(
                        got, whole,
                        "{groups} groups, rank {rank}, {message_bytes} B"
                    );
                }
            }
        }
    }

    #[test]
    fn tcp_baseline_delivers_exactly_what_was_sent() {
        for pattern in [Pattern::Repartition, Pattern::Broadcast] {
            let job = Job {
                method: Method::Tcp,
                pattern,
                threads: 2,
                tuples: 5000,
                seed: 3,
                message_bytes: 1000,
                buffering: "adaptive".into(),
                notify: "cq".into(),
                progress_ms: 1000,
                interleave: false,
                own_via_fabric: false,
                pin: false,
            };
            let xs = LocalExchange::group(3, Duration::from_secs(20));
            let results: Vec<_> = std::thread::scope(|s| {
                let hs: Vec<_> = xs
                    .into_iter()
                    .map(|x| {
                        let job = &job;
                        s.spawn(move || run_node(job, Arc::new(x), None, &Progress::default()))
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap().unwrap()).collect()
            });
            let total: u64 = results.iter().map(|r| r.received_bytes).sum();
            let want = match pattern {
                Pattern::Repartition => 3 * 5000 * 16,
                Pattern::Broadcast => 3 * 2 * 5000 * 16,
            };
            assert_eq!(total, want, "{pattern:?}");
        }
    }
}
