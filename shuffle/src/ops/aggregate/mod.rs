//! Distributed aggregation over the shuffle: `SELECT k, SUM(v), COUNT(*), AVG(v),
//! MIN(v), MAX(v) … GROUP BY k` over `(k: u64, v: i64)` tuples spread over the nodes.
//!
//! Every node runs [`aggregate`] on its fragment (collective). Each of its worker
//! threads takes a contiguous slice of the fragment; each node also runs one receiving
//! thread per endpoint lane that merges whatever arrives into its own [`GroupTable`].
//! A group is owned by one node (high bits of the key's hash, [`table::owner`]), so
//! the owners' tables, each the merge of its lanes' tables, are the result. What moves
//! is either raw tuples or partial states ([`State`]: count, min, max and an `i128`
//! sum, so AVG is exactly sum/count), and an owner merges both kinds into the same
//! table ([`wire`]).
//!
//! The algorithms (Shatdal's thesis ch. 4; Binnig et al., VLDB 2016 §5.3):
//!
//! - [`Algorithm::TwoPhase`] (§4.2.1): a worker aggregates its whole slice locally,
//!   then ships one partial per group to the owner, which merges (the global phase).
//! - [`Algorithm::Repartitioning`] (§4.2.2): workers ship every raw tuple to its owner,
//!   which aggregates.
//! - [`Algorithm::AdaptiveTwoPhase`] (§4.3.2): Two Phase while the local table stays
//!   within its memory budget ([`AggConfig::local_groups`]). The first tuple of a group
//!   that does not fit makes the worker ship the partials it has (freeing the table)
//!   and repartition the rest of its slice raw. It also switches when local
//!   aggregation visibly does not pay: a window of [`GROWTH_WINDOW`] tuples (after
//!   the first) that created a new group for more than half of them (a partial is
//!   three times as wide as a raw tuple, so such a table would ship more than the raw
//!   tuples; waiting for the table to fill only adds the cost of a large table).
//! - [`Algorithm::AdaptiveRepartitioning`] (§4.3.3): Repartitioning, while the worker
//!   counts the distinct groups it sends. Once it has seen too few groups for the
//!   tuples processed (every group 16 times on average, or fewer than the crossover
//!   threshold after [`AggConfig::init_segment`] tuples) it switches to Adaptive Two
//!   Phase for the rest; with as many groups as the threshold it stops counting and
//!   stays.
//! - [`Algorithm::Sampling`] (§4.3.1): every node samples its fragment, counts the
//!   groups in the sample, and the nodes agree (all-gather, the largest count) on Two
//!   Phase if fewer than the crossover threshold ([`AggConfig::crossover`]) were found,
//!   Repartitioning otherwise. Shatdal's sample is ten times the threshold, which at a
//!   large threshold is most of a fragment; we sample a twentieth of the fragment
//!   (capped at ten times the threshold) in blocks of [`SAMPLE_BLOCK`] tuples (his
//!   page sampling) and compare the groups found with the number a sample of that
//!   size shows for exactly the threshold of uniform groups
//!   ([`crossover_in_sample`]). Sampling stops as soon as the answer is known: at
//!   that many groups (many), or once every group found was seen
//!   [`SAMPLE_SATURATION`] times on average (few; a departure: with skewed groups a
//!   rare group may go unseen, which a full sample could have caught).
//! - [`Algorithm::RdmaAgg`] (VLDB 2016 §5.3): each worker pre-aggregates in a
//!   cache-sized table ([`AggConfig::cache_groups`]); tuples of groups that do not fit
//!   go to the overflow partition of their owner, i.e. into the open message to that
//!   node, which the endpoint transmits (one-sided WRITEs with the WR designs) while
//!   the scan continues. At the end of the slice the table's partials follow; owners
//!   merge partitions on as many receiving threads as there are lanes.
//!
//! Departures from the thesis, where the setting differs: there is no disk, so Two
//! Phase's table simply grows (the memory budget matters only to the adaptive
//! algorithms, as the switching point Shatdal proposes); decisions are taken per worker
//! thread (each adapts to what it sees, as the thesis's nodes do) and Adaptive
//! Repartitioning's switch is local, without the end-of-phase broadcast, which is
//! correct because owners merge raw and partial records alike.

mod table;
mod wire;

pub use table::{GroupTable, KeySet, State, hash, owner};
pub use wire::Sent;

use crate::endpoint::{Design, EndpointConfig, Endpoints, Transport, open};
use crate::error::{Result, ShuffleError};
use crate::flow::Agg;
use crate::node::Node;
use crate::operator::{Groups, Shuffle, receive_all, send_and_receive};
use crate::progress::{CHUNK, Phase, Progress};
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use wire::Outbox;

/// An aggregate function of a query.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AggFn {
    Sum,
    Count,
    Avg,
    Min,
    Max,
}

impl From<Agg> for AggFn {
    fn from(a: Agg) -> AggFn {
        match a {
            Agg::Sum => AggFn::Sum,
            Agg::Count => AggFn::Count,
            Agg::Min => AggFn::Min,
            Agg::Max => AggFn::Max,
        }
    }
}

/// One aggregate's final value.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum AggValue {
    Sum(i128),
    Count(u64),
    /// Exact: `sum / count`; [`AggValue::as_f64`] rounds it.
    Avg {
        sum: i128,
        count: u64,
    },
    Min(i64),
    Max(i64),
}

impl AggValue {
    pub fn as_f64(&self) -> f64 {
        match *self {
            AggValue::Sum(s) => s as f64,
            AggValue::Count(c) => c as f64,
            AggValue::Avg { sum, count } => sum as f64 / count as f64,
            AggValue::Min(v) | AggValue::Max(v) => v as f64,
        }
    }
}

impl State {
    /// The final value of `f` for this group.
    pub fn value(&self, f: AggFn) -> AggValue {
        match f {
            AggFn::Sum => AggValue::Sum(self.sum),
            AggFn::Count => AggValue::Count(self.count),
            AggFn::Avg => AggValue::Avg {
                sum: self.sum,
                count: self.count,
            },
            AggFn::Min => AggValue::Min(self.min),
            AggFn::Max => AggValue::Max(self.max),
        }
    }
}

/// One result row: the group and one value per aggregate of the query, in order.
#[derive(Clone, Debug, PartialEq)]
pub struct GroupRow {
    pub key: u64,
    pub values: Vec<AggValue>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Algorithm {
    TwoPhase,
    Repartitioning,
    AdaptiveTwoPhase,
    AdaptiveRepartitioning,
    Sampling,
    RdmaAgg,
}

impl Algorithm {
    pub const ALL: [Algorithm; 6] = [
        Algorithm::TwoPhase,
        Algorithm::Repartitioning,
        Algorithm::AdaptiveTwoPhase,
        Algorithm::AdaptiveRepartitioning,
        Algorithm::Sampling,
        Algorithm::RdmaAgg,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Algorithm::TwoPhase => "two-phase",
            Algorithm::Repartitioning => "repartitioning",
            Algorithm::AdaptiveTwoPhase => "adaptive-two-phase",
            Algorithm::AdaptiveRepartitioning => "adaptive-repartitioning",
            Algorithm::Sampling => "sampling",
            Algorithm::RdmaAgg => "rdma-agg",
        }
    }
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Algorithm {
    type Err = ShuffleError;
    fn from_str(s: &str) -> Result<Algorithm> {
        let norm = s.to_ascii_lowercase().replace('_', "-");
        let short = match norm.as_str() {
            "2p" | "twophase" => Some(Algorithm::TwoPhase),
            "rep" | "repart" => Some(Algorithm::Repartitioning),
            "a2p" | "atp" => Some(Algorithm::AdaptiveTwoPhase),
            "arep" | "ar" => Some(Algorithm::AdaptiveRepartitioning),
            "rdma" | "rdmaagg" => Some(Algorithm::RdmaAgg),
            _ => None,
        };
        short
            .or_else(|| Algorithm::ALL.into_iter().find(|a| a.name() == norm))
            .ok_or_else(|| {
                ShuffleError::Invalid(format!(
                    "unknown aggregation algorithm {s:?}: expected one of {}",
                    Algorithm::ALL.map(|a| a.name()).join(", ")
                ))
            })
    }
}

/// How a worker ended up aggregating.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Strategy {
    /// Local aggregation of the whole slice, partials shipped (Two Phase).
    TwoPhase,
    /// Raw tuples shipped (Repartitioning).
    Repartitioning,
    /// Started with local aggregation and switched to repartitioning.
    TwoPhaseThenRepartitioning,
    /// Started repartitioning and switched to (adaptive) local aggregation.
    RepartitioningThenTwoPhase,
    /// Repartitioning, switched to local aggregation, then back (its table filled).
    RepartitioningThenTwoPhaseThenRepartitioning,
    /// RDMA AGG's cache-sized pre-aggregation with overflow partitions.
    PreAggregation,
}

impl Strategy {
    pub fn name(self) -> &'static str {
        match self {
            Strategy::TwoPhase => "two-phase",
            Strategy::Repartitioning => "repartitioning",
            Strategy::TwoPhaseThenRepartitioning => "two-phase→repartitioning",
            Strategy::RepartitioningThenTwoPhase => "repartitioning→two-phase",
            Strategy::RepartitioningThenTwoPhaseThenRepartitioning => {
                "repartitioning→two-phase→repartitioning"
            }
            Strategy::PreAggregation => "pre-aggregation",
        }
    }

    /// Whether the worker switched algorithms.
    pub fn switched(self) -> bool {
        matches!(
            self,
            Strategy::TwoPhaseThenRepartitioning
                | Strategy::RepartitioningThenTwoPhase
                | Strategy::RepartitioningThenTwoPhaseThenRepartitioning
        )
    }
}

impl fmt::Display for Strategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Settings, the same on every node.
#[derive(Clone, Debug)]
pub struct AggConfig {
    pub design: Design,
    /// Worker threads per node (and endpoint lanes under the ME designs).
    pub threads: usize,
    /// Each worker also receives, and merges its own node's records straight from its
    /// sending buffers ([`crate::send_and_receive`]), instead of a receiving thread per
    /// endpoint lane beside the workers.
    pub interleave: bool,
    pub message_bytes: u32,
    /// How long a blocked send or receive waits without progress.
    pub timeout: Duration,
    /// The memory budget of a worker's local table, in groups: where Adaptive Two
    /// Phase switches to repartitioning.
    pub local_groups: usize,
    /// RDMA AGG's pre-aggregation table, in groups (sized to the cache).
    pub cache_groups: usize,
    /// Shatdal's crossover threshold in groups (sampling and Adaptive
    /// Repartitioning); `None`: the memory budget, the "large side" of §4.3.1.
    pub crossover: Option<usize>,
    /// Tuples Adaptive Repartitioning repartitions before it judges the number of
    /// groups; `None`: ten times the crossover threshold.
    pub init_segment: Option<usize>,
    /// Tuples each node samples; `None`: a twentieth of its fragment (at least
    /// [`SAMPLE_BLOCK`], at most ten times the crossover threshold).
    pub sample_tuples: Option<usize>,
    pub seed: u64,
    /// Where this node reports its phase and the tuples its workers went through (not a
    /// setting: each node's own).
    pub progress: Arc<Progress>,
}

/// The largest [`AggConfig::cache_groups`]: a table of 2^25 slots (1.5 GiB), far past
/// any cache, and allocated whole by every worker.
pub const MAX_CACHE_GROUPS: usize = 1 << 24;

impl Default for AggConfig {
    fn default() -> AggConfig {
        AggConfig {
            design: Design::new(Endpoints::Multi, Transport::MqWr),
            threads: 1,
            interleave: false,
            message_bytes: 64 << 10,
            timeout: Duration::from_secs(60),
            local_groups: 1 << 16,
            // 4096 groups in 16384 slots of 48 bytes: 768 KiB, within a core's L2.
            cache_groups: 1 << 12,
            crossover: None,
            init_segment: None,
            sample_tuples: None,
            seed: 0x5eed,
            progress: Arc::default(),
        }
    }
}

impl AggConfig {
    pub fn crossover(&self) -> usize {
        self.crossover.unwrap_or(self.local_groups)
    }
    pub fn init_segment(&self) -> usize {
        self.init_segment
            .unwrap_or_else(|| self.crossover().saturating_mul(10))
    }
    /// The sample size on a node holding `tuples` tuples.
    pub fn sample_tuples(&self, tuples: usize) -> usize {
        self.sample_tuples
            .unwrap_or_else(|| {
                (tuples / 20)
                    .max(SAMPLE_BLOCK)
                    .min(self.crossover().saturating_mul(10))
            })
            .min(tuples)
    }

    /// Whether the settings make sense; every aggregation checks them first.
    pub fn validate(&self) -> Result<()> {
        let bad = |what: &str| Err(ShuffleError::Invalid(format!("aggregation: {what}")));
        if self.threads == 0 {
            return bad("threads must be at least 1");
        }
        if self.local_groups == 0 {
            return bad("the memory budget (local_groups) must be at least 1 group");
        }
        if self.cache_groups == 0 {
            return bad("the cache table (cache_groups) must hold at least 1 group");
        }
        if self.cache_groups > MAX_CACHE_GROUPS {
            return bad(&format!(
                "the cache table (cache_groups) holds at most {MAX_CACHE_GROUPS} groups: it \
                 is allocated whole and meant to fit a core's cache, not {}",
                self.cache_groups
            ));
        }
        if self.crossover() == 0 {
            return bad("the crossover threshold must be at least 1 group");
        }
        Ok(())
    }
}

/// A node's fragment of the input, as columns.
#[derive(Clone, Copy, Debug)]
pub struct Input<'a> {
    pub keys: &'a [u64],
    pub values: &'a [i64],
}

impl<'a> Input<'a> {
    pub fn new(keys: &'a [u64], values: &'a [i64]) -> Result<Input<'a>> {
        if keys.len() != values.len() {
            return Err(ShuffleError::Invalid(format!(
                "aggregation input: {} keys but {} values",
                keys.len(),
                values.len()
            )));
        }
        Ok(Input { keys, values })
    }
    pub fn len(&self) -> usize {
        self.keys.len()
    }
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }
    fn slice(&self, from: usize, to: usize) -> Input<'a> {
        Input {
            keys: &self.keys[from..to],
            values: &self.values[from..to],
        }
    }
}

/// What one node did.
#[derive(Clone, Debug)]
pub struct Report {
    pub algorithm: Algorithm,
    /// How each worker ended up aggregating.
    pub strategies: Vec<Strategy>,
    /// Sampling only: the largest number of groups any node found in its sample.
    pub sampled_groups: Option<usize>,
    pub sent: Sent,
    /// Raw tuples and partials this node's receivers merged.
    pub received_records: u64,
    /// Opening the endpoints (collective: it ends when every node is wired).
    pub setup: Duration,
    /// The whole call, setup included.
    pub elapsed: Duration,
}

impl Report {
    /// The aggregation itself: the whole call but opening the endpoints.
    pub fn runtime(&self) -> Duration {
        self.elapsed.saturating_sub(self.setup)
    }

    pub fn switched_workers(&self) -> usize {
        self.strategies.iter().filter(|s| s.switched()).count()
    }
}

/// One node's outcome: the groups it owns, final, and what it did.
pub struct Outcome {
    pub groups: GroupTable,
    pub report: Report,
}

impl Outcome {
    /// The owned groups as rows with `aggs`' values, in no particular order.
    pub fn rows(&self, aggs: &[AggFn]) -> Vec<GroupRow> {
        self.groups
            .iter()
            .map(|(key, s)| GroupRow {
                key,
                values: aggs.iter().map(|&f| s.value(f)).collect(),
            })
            .collect()
    }
}

/// Aggregates `input`, this node's fragment, with `algorithm`. Collective: every node
/// calls it with the same algorithm and configuration; each returns the groups it
/// owns.
pub fn aggregate(
    node: &Node,
    algorithm: Algorithm,
    input: Input<'_>,
    config: &AggConfig,
) -> Result<Outcome> {
    config.validate()?;
    Input::new(input.keys, input.values)?;
    let started = Instant::now();
    let progress = &*config.progress;
    let (plan, sampled_groups) = match algorithm {
        Algorithm::Sampling => {
            progress.start(Phase::Sampling, 0);
            let sample = config.sample_tuples(input.len());
            let (found, _) = sample_groups(input, sample, config);
            let all: Vec<(u64, u64)> =
                node.all_gather("aggregation sample", &(found as u64, sample as u64))?;
            let many = all.iter().any(|&(found, sample)| {
                sample > 0
                    && found as f64 >= crossover_in_sample(config.crossover(), sample as usize)
            });
            let most = all.iter().map(|&(f, _)| f).max().unwrap_or(0) as usize;
            let plan = if many {
                Algorithm::Repartitioning
            } else {
                Algorithm::TwoPhase
            };
            (plan, Some(most))
        }
        other => (other, None),
    };
    progress.start(Phase::Opening, 0);
    let opening = Instant::now();
    let opened = open(
        node,
        config.design,
        &EndpointConfig {
            threads: config.threads,
            message_bytes: config.message_bytes,
            timeout: config.timeout,
            ..EndpointConfig::default()
        },
    )?;
    let setup = opening.elapsed();
    let shuffle = Shuffle::new(opened, Groups::repartition(node.nodes()), config.threads)?;
    let nodes = node.nodes();
    let threads = config.threads;
    progress.start(Phase::Aggregating, input.len() as u64);
    // Once the last worker is through, what remains is the owners merging.
    let working = AtomicUsize::new(threads);
    let work_through = |slice: Input<'_>, out: &mut Outbox<'_, '_>| -> Result<(Strategy, Sent)> {
        let strategy = work(plan, slice, out, config)?;
        if working.fetch_sub(1, Ordering::Relaxed) == 1 {
            progress.start(Phase::Merging, 0);
        }
        Ok((strategy, out.sent))
    };
    let slice_of = |tid: usize| {
        input.slice(
            input.len() * tid / threads,
            input.len() * (tid + 1) / threads,
        )
    };
    let (workers, receivers) = std::thread::scope(|s| {
        if config.interleave {
            let both: Vec<_> = (0..threads)
                .map(|tid| {
                    let (shuffle, work_through) = (&shuffle, &work_through);
                    s.spawn(move || {
                        let mut table = Merging::default();
                        let mut done = None;
                        let run = send_and_receive(
                            shuffle,
                            tid,
                            |w| {
                                done =
                                    Some(work_through(slice_of(tid), &mut Outbox::new(w, nodes))?);
                                Ok(())
                            },
                            |data| table.absorb(data.payload()),
                        );
                        // A malformed message is the cause of whatever else failed, and
                        // the workers' results are looked at first.
                        match (table.into_result(), run) {
                            (Err(e), _) => (Err(e), Ok((GroupTable::with_capacity(1), 0))),
                            (Ok(t), Err(e)) => (Err(e), Ok(t)),
                            (Ok(t), Ok(())) => (
                                done.ok_or_else(|| {
                                    ShuffleError::Invalid(
                                        "a worker returned without working".into(),
                                    )
                                }),
                                Ok(t),
                            ),
                        }
                    })
                })
                .collect();
            let (workers, receivers): (Vec<_>, Vec<_>) = both
                .into_iter()
                .map(|h| match h.join() {
                    Ok((w, r)) => (w, r),
                    Err(_) => (Err(panicked()), Err(panicked())),
                })
                .unzip();
            return (workers, receivers);
        }
        let workers: Vec<_> = (0..threads)
            .map(|tid| {
                let (shuffle, work_through) = (&shuffle, &work_through);
                s.spawn(move || -> Result<(Strategy, Sent)> {
                    let mut w = shuffle.writer(tid);
                    let done = work_through(slice_of(tid), &mut Outbox::new(&mut w, nodes))?;
                    w.finish()?;
                    Ok(done)
                })
            })
            .collect();
        let receivers: Vec<_> = (0..shuffle.lanes())
            .map(|lane| {
                let endpoint = shuffle.receiver(lane);
                s.spawn(move || -> Result<(GroupTable, u64)> {
                    let mut table = Merging::default();
                    receive_all(&*endpoint, |data| table.absorb(data.payload()))?;
                    table.into_result()
                })
            })
            .collect();
        let workers: Vec<Result<(Strategy, Sent)>> =
            workers.into_iter().map(|h| joined(h.join())).collect();
        let receivers: Vec<Result<(GroupTable, u64)>> =
            receivers.into_iter().map(|h| joined(h.join())).collect();
        (workers, receivers)
    });
    let mut strategies = Vec::with_capacity(threads);
    let mut sent = Sent::default();
    for w in workers {
        let (strategy, s) = w?;
        strategies.push(strategy);
        sent.raw += s.raw;
        sent.partials += s.partials;
    }
    let mut received_records = 0;
    let mut tables = Vec::with_capacity(receivers.len());
    for r in receivers {
        let (table, n) = r?;
        received_records += n;
        tables.push(table);
    }
    // The largest lane table absorbs the others.
    tables.sort_by_key(|t| std::cmp::Reverse(t.len()));
    let mut tables = tables.into_iter();
    let mut groups = tables
        .next()
        .unwrap_or_else(|| GroupTable::with_capacity(1));
    for t in tables {
        groups.absorb(&t);
    }
    Ok(Outcome {
        groups,
        report: Report {
            algorithm,
            strategies,
            sampled_groups,
            sent,
            received_records,
            setup,
            elapsed: started.elapsed(),
        },
    })
}

/// A thread's result, a panic turned into an error.
fn joined<T>(r: std::thread::Result<Result<T>>) -> Result<T> {
    r.unwrap_or_else(|_| Err(panicked()))
}

fn panicked() -> ShuffleError {
    ShuffleError::Invalid("an aggregation thread panicked".into())
}

/// What a receiving thread merges: its table, the records in it, and the first
/// malformed message (after which it merges nothing more).
struct Merging {
    table: GroupTable,
    records: u64,
    failed: Option<ShuffleError>,
}

impl Default for Merging {
    fn default() -> Merging {
        Merging {
            table: GroupTable::with_capacity(1024),
            records: 0,
            failed: None,
        }
    }
}

impl Merging {
    fn absorb(&mut self, payload: &[std::sync::atomic::AtomicU64]) {
        if self.failed.is_none() {
            match wire::absorb(&mut self.table, payload) {
                Ok(n) => self.records += n,
                Err(e) => self.failed = Some(e),
            }
        }
    }

    fn into_result(self) -> Result<(GroupTable, u64)> {
        self.failed.map_or(Ok((self.table, self.records)), Err)
    }
}

/// Tuples the sampling choice reads at a random place at a time: Shatdal samples
/// pages, which costs a sequential read each instead of a cache miss per tuple.
pub const SAMPLE_BLOCK: usize = 256;

/// The groups a uniform sample of `sample` tuples shows when there are exactly
/// `crossover` groups: `crossover·(1 − e^(−sample/crossover))`. Finding at least this
/// many means at least the crossover threshold of groups; with a sample of ten times
/// the threshold it is Shatdal's rule (the threshold itself, within 0.005%).
pub fn crossover_in_sample(crossover: usize, sample: usize) -> f64 {
    let c = crossover as f64;
    c * (1.0 - (-(sample as f64) / c).exp())
}

/// Sampling stops early, on the few-groups side, once it has read this many tuples
/// per group found: a uniform group is then missing from the sample with probability
/// e⁻³², so the count is complete and reading on could only repeat it. With few
/// groups this cuts the sample from up to ten times the crossover threshold to a few
/// thousand tuples, which was the sampling choice's whole cost (+9–11% over Two Phase
/// at 10³ groups).
pub const SAMPLE_SATURATION: usize = 32;

/// The fewest tuples sampling reads before it may stop early.
pub const MIN_EARLY_SAMPLE: usize = 16 * SAMPLE_BLOCK;

/// Groups found in `sample` tuples of `input` read in blocks at random places, counted
/// up to what [`crossover_in_sample`] asks for (beyond it the count does not matter),
/// or until [`SAMPLE_SATURATION`] says the count is complete.
/// Returns the groups found and the tuples read.
fn sample_groups(input: Input<'_>, sample: usize, config: &AggConfig) -> (usize, usize) {
    let n = input.len();
    let cap = crossover_in_sample(config.crossover(), sample).ceil() as usize;
    let mut seen = KeySet::new(cap.max(1));
    if sample >= n {
        for &k in input.keys {
            seen.insert(k, hash(k));
        }
        return (seen.len(), n);
    }
    let mut state = config.seed;
    let mut taken = 0;
    while taken < sample && !seen.full() {
        state = crate::testing::mix(state);
        let block = SAMPLE_BLOCK.min(sample - taken);
        let at = ((u128::from(state) * (n - block + 1) as u128) >> 64) as usize;
        for &k in &input.keys[at..at + block] {
            seen.insert(k, hash(k));
        }
        taken += block;
        if taken >= MIN_EARLY_SAMPLE && taken >= SAMPLE_SATURATION * seen.len() {
            break;
        }
    }
    (seen.len(), taken)
}

/// One worker's slice, aggregated with `plan` (never `Sampling`: decided before).
fn work(
    plan: Algorithm,
    input: Input<'_>,
    out: &mut Outbox<'_, '_>,
    config: &AggConfig,
) -> Result<Strategy> {
    let progress = &*config.progress;
    match plan {
        Algorithm::TwoPhase => {
            let mut table = GroupTable::with_capacity(1024);
            local(&mut table, input, usize::MAX, false, progress);
            out.partials_of(&mut table)?;
            Ok(Strategy::TwoPhase)
        }
        Algorithm::Repartitioning | Algorithm::Sampling => {
            repartition(input, out, progress)?;
            Ok(Strategy::Repartitioning)
        }
        Algorithm::AdaptiveTwoPhase => {
            if adaptive_two_phase(input, out, config)? {
                Ok(Strategy::TwoPhaseThenRepartitioning)
            } else {
                Ok(Strategy::TwoPhase)
            }
        }
        Algorithm::AdaptiveRepartitioning => {
            let observed = observe(input, out, config)?;
            if observed == input.len() {
                return Ok(Strategy::Repartitioning);
            }
            let rest = input.slice(observed, input.len());
            if adaptive_two_phase(rest, out, config)? {
                Ok(Strategy::RepartitioningThenTwoPhaseThenRepartitioning)
            } else {
                Ok(Strategy::RepartitioningThenTwoPhase)
            }
        }
        Algorithm::RdmaAgg => {
            pre_aggregate(input, out, config)?;
            Ok(Strategy::PreAggregation)
        }
    }
}

/// Adaptive Two Phase's early switch: a window of this many tuples (after the first)
/// that creates a new group for more than half of them.
pub const GROWTH_WINDOW: usize = 16384;

/// Folds tuples into `table` until a new group would exceed `limit` groups, or, with
/// `early`, until a window of [`GROWTH_WINDOW`] tuples after the first made new
/// groups for more than half its tuples; returns how many tuples it folded (and adds
/// them to `progress`, window by window).
fn local(
    table: &mut GroupTable,
    input: Input<'_>,
    limit: usize,
    early: bool,
    progress: &Progress,
) -> usize {
    let mut done = 0;
    let windows = input
        .keys
        .chunks(GROWTH_WINDOW)
        .zip(input.values.chunks(GROWTH_WINDOW));
    for (w, (keys, values)) in windows.enumerate() {
        let before = table.len();
        for (i, (&k, &v)) in keys.iter().zip(values).enumerate() {
            if !table.try_add(k, hash(k), v, limit) {
                progress.add(i as u64);
                return done + i;
            }
        }
        done += keys.len();
        progress.add(keys.len() as u64);
        if early && w > 0 && (table.len() - before) * 2 > keys.len() {
            return done;
        }
    }
    done
}

fn repartition(input: Input<'_>, out: &mut Outbox<'_, '_>, progress: &Progress) -> Result<()> {
    for (keys, values) in input.keys.chunks(CHUNK).zip(input.values.chunks(CHUNK)) {
        for (&k, &v) in keys.iter().zip(values) {
            out.raw(k, hash(k), v)?;
        }
        progress.add(keys.len() as u64);
    }
    Ok(())
}

/// Adaptive Two Phase over `input`; `true` if it switched to repartitioning.
fn adaptive_two_phase(
    input: Input<'_>,
    out: &mut Outbox<'_, '_>,
    config: &AggConfig,
) -> Result<bool> {
    let mut table = GroupTable::with_capacity(config.local_groups.min(1024));
    let progress = &*config.progress;
    let folded = local(&mut table, input, config.local_groups, true, progress);
    out.partials_of(&mut table)?;
    drop(table);
    if folded < input.len() {
        repartition(input.slice(folded, input.len()), out, progress)?;
        return Ok(true);
    }
    Ok(false)
}

/// A tuple is judged "few groups" when every group seen so far had this many tuples on
/// average: local aggregation would shrink what is shipped this much.
const FEW_GROUPS_REDUCTION: usize = 16;
/// Adaptive Repartitioning checks its count of groups this often (tuples).
const OBSERVE_EVERY: usize = 1024;

/// Adaptive Repartitioning's first phase: repartitions while counting groups, and
/// returns how many tuples it repartitioned before deciding to switch (the whole input
/// if it never does).
fn observe(input: Input<'_>, out: &mut Outbox<'_, '_>, config: &AggConfig) -> Result<usize> {
    let crossover = config.crossover();
    let init_segment = config.init_segment().max(1);
    let mut seen = KeySet::new(crossover);
    let mut done = 0;
    for chunk in input.keys.chunks(OBSERVE_EVERY) {
        for (i, &k) in chunk.iter().enumerate() {
            let h = hash(k);
            seen.insert(k, h);
            out.raw(k, h, input.values[done + i])?;
        }
        done += chunk.len();
        config.progress.add(chunk.len() as u64);
        if seen.full() {
            // As many groups as the threshold: Repartitioning is right; stop counting.
            repartition(input.slice(done, input.len()), out, &config.progress)?;
            return Ok(input.len());
        }
        if seen.len() * FEW_GROUPS_REDUCTION <= done || done >= init_segment {
            return Ok(done);
        }
    }
    Ok(input.len())
}

/// RDMA AGG's first phase: pre-aggregation in a cache-sized table, overflow tuples
/// shipped raw to their owners while the scan goes on, then the table's partials.
fn pre_aggregate(input: Input<'_>, out: &mut Outbox<'_, '_>, config: &AggConfig) -> Result<()> {
    let limit = config.cache_groups;
    let mut table = GroupTable::with_capacity(limit);
    for (keys, values) in input.keys.chunks(CHUNK).zip(input.values.chunks(CHUNK)) {
        for (&k, &v) in keys.iter().zip(values) {
            let h = hash(k);
            if !table.try_add(k, h, v, limit) {
                out.raw(k, h, v)?;
            }
        }
        config.progress.add(keys.len() as u64);
    }
    out.partials_of(&mut table)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sampling_threshold_follows_the_sample_size() {
        // Ten times the threshold: Shatdal's rule, the threshold itself.
        assert!((crossover_in_sample(100, 1000) - 100.0).abs() < 0.01);
        // A sample as large as the threshold shows 63% of its groups.
        assert!((crossover_in_sample(1000, 1000) - 632.1).abs() < 0.1);
    }

    #[test]
    fn block_samples_count_the_groups_they_see() {
        let keys: Vec<u64> = (0..100_000u64)
            .map(|i| crate::testing::mix(i) % 50)
            .collect();
        let values = vec![0i64; keys.len()];
        let input = Input::new(&keys, &values).unwrap();
        let config = AggConfig {
            crossover: Some(1000),
            ..AggConfig::default()
        };
        assert_eq!(config.sample_tuples(keys.len()), 5000);
        // 50 groups: complete long before 5000 tuples.
        assert_eq!(sample_groups(input, 5000, &config), (50, MIN_EARLY_SAMPLE));
        let many: Vec<u64> = (0..100_000u64).collect();
        let input = Input::new(&many, &values).unwrap();
        // Counting stops at what the threshold needs.
        let cap = crossover_in_sample(1000, 5000).ceil() as usize;
        assert_eq!(sample_groups(input, 5000, &config).0, cap);
    }

    #[test]
    fn sampling_stops_once_every_group_found_was_seen_often_enough() {
        let keys: Vec<u64> = (0..2_000_000u64)
            .map(|i| crate::testing::mix(i) % 1000)
            .collect();
        let values = vec![0i64; keys.len()];
        let input = Input::new(&keys, &values).unwrap();
        let config = AggConfig::default();
        let planned = config.sample_tuples(keys.len());
        assert_eq!(planned, 100_000);
        let (found, read) = sample_groups(input, planned, &config);
        assert_eq!(found, 1000);
        // The first whole block at or past 32 tuples per group found.
        assert_eq!(
            read,
            (SAMPLE_SATURATION * 1000).next_multiple_of(SAMPLE_BLOCK)
        );
        // Groups that keep appearing keep it reading: 20 000 groups need 640 000
        // tuples, more than planned.
        let spread: Vec<u64> = (0..2_000_000u64)
            .map(|i| crate::testing::mix(i) % 20_000)
            .collect();
        let input = Input::new(&spread, &values).unwrap();
        let (found, read) = sample_groups(input, planned, &config);
        assert_eq!(read, planned);
        assert!(found > 19_000, "{found}");
    }
}
