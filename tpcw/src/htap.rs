//! HTAP on RSI: TPC-W's analytical interactions run as distributed queries over
//! snapshot scans and the shuffle while checkouts commit (Binnig et al., VLDB 2016,
//! §5: analytics read the memory servers directly, at a snapshot, beside OLTP).
//!
//! Analytics nodes (threads of this process, each a shuffle [`Node`] on its own sim
//! network, with a [`txn::Worker`] on the database) repeat two queries, each at one
//! read timestamp that node 0 takes and shares ([`Node::all_gather`]):
//!
//! - **Best Sellers** (TPC-W 1.8, clause 2.6.5.1): the items of a subject most sold in
//!   the 3333 most recent orders, top 50 by quantity. (1) Every node scans its share
//!   of ORDERS ([`shuffle::ops::scan`]) keeping its 3333 most recent (by `o_date`,
//!   then `o_id`: run-time ids come from per-client streams, so the largest id is not
//!   the newest); the local lists are gathered and cut to the global 3333. (2) Every
//!   node scans its share of ORDER_LINE and pushes `(ol_i_id, ol_qty)` of those orders'
//!   lines into a combiner flow (`SUM(qty)` per item, pre-aggregated at the sources)
//!   whose target is node 0. (3) Node 0 keeps the subject's items and ranks them
//!   (quantity descending, then id).
//! - **Admin Confirm's related items** (clause 2.16.5.2): for an item X, the five items
//!   most often bought with it. (1) The 10 000 most recent orders, as above. (2) A scan
//!   of ORDER_LINE finds those of them that contain X (gathered). (3) A second scan
//!   pushes the other lines of those orders into a combiner flow (`SUM(qty)` per
//!   item). (4) Node 0 writes the top five into X's `i_related1..5` with a transaction.
//!
//! Departures, and why: the item → subject dimension is read once at start (no
//! interaction changes `i_subject`, and ITEM keeps one version, so reading it at an
//! older snapshot while checkouts update stocks would fail); "bought with X" counts
//! the orders that contain X, where the specification goes through the customers who
//! bought X (one more pair of scans). ORDERS and ORDER_LINE keep two versions in an
//! HTAP run ([`htap_table_versions`]; ORDERS always does, see [`crate::rsi`]): a
//! one-version block inserted after the scan's RID cannot say the row did not exist
//! at the RID, so a scan would end in `SnapshotTooOld` at every concurrent insert;
//! two versions carry the insert's "absent before" mark.

use crate::runner::{ItemRewrite, ItemRewrites};
use crate::schema::{Item, Order, OrderLine, Rel, SUBJECTS};
use hdrhistogram::Histogram;
use serde::Serialize;
use shuffle::flow::{Aggregate, Column, FlowConfig, FlowNet, FlowSpec, Schema, Value, all_threads};
use shuffle::ops::scan::{self, OnTooOld, ScanConfig, ScanError, ScanStats, Scanner};
use shuffle::{Design, EndpointConfig, LocalExchange, Node};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use txn::runtime::block_on;
use txn::{Database, Snapshot, Table, TxnError, Worker};

/// Orders Best Sellers looks at (clause 2.6.5.1).
pub const BEST_SELLERS_WINDOW: usize = 3333;
/// Items Best Sellers returns.
pub const BEST_SELLERS: usize = 50;
/// Orders the related-items query looks at (clause 2.16.5.2).
pub const RELATED_WINDOW: usize = 10_000;

/// Versions of the tables an HTAP run scans (see the module doc).
pub fn htap_table_versions(rel: Rel) -> Option<u32> {
    matches!(rel, Rel::Orders | Rel::OrderLine).then_some(2)
}

/// Which of an HTAP run's two client runs a report is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Phase {
    /// The clients alone, for comparison.
    Alone,
    /// The clients beside the analytics nodes.
    WithAnalytics,
}

impl Phase {
    pub fn name(self) -> &'static str {
        match self {
            Phase::Alone => "alone",
            Phase::WithAnalytics => "with-analytics",
        }
    }
}

#[derive(Clone, Debug)]
pub struct HtapConfig {
    /// Analytics nodes (one scanner thread each).
    pub nodes: usize,
    /// Best Sellers queries per related-items update.
    pub best_sellers_per_related: u32,
    pub scan: ScanConfig,
    /// Check every N-th Best Sellers answer against a single-node computation on the
    /// same snapshot (0: never).
    pub check_every: u64,
    /// How long a related-items write fenced under its writer waits for recovery to
    /// decide it before the run fails saying the outcome is unknown
    /// ([`crate::runner::UNKNOWN_OUTCOME_PATIENCE`]; shorter in tests of that failure).
    pub unknown_outcome_patience: Duration,
}

impl Default for HtapConfig {
    fn default() -> Self {
        HtapConfig {
            nodes: 2,
            best_sellers_per_related: 4,
            scan: ScanConfig::default(),
            check_every: 0,
            unknown_outcome_patience: crate::runner::UNKNOWN_OUTCOME_PATIENCE,
        }
    }
}

/// Quantile `q` of a histogram of microseconds, in milliseconds; `None` when it is
/// empty (hdrhistogram answers 0 then, which read as an instant query).
fn quantile_ms(h: &Histogram<u64>, q: f64) -> Option<f64> {
    (!h.is_empty()).then(|| h.value_at_quantile(q) as f64 / 1000.0)
}

/// What the analytics side of a run did.
#[derive(Clone, Debug, Default, Serialize)]
pub struct HtapReport {
    pub nodes: usize,
    pub seconds: f64,
    pub best_sellers: u64,
    pub related_updates: u64,
    pub queries_per_sec: f64,
    /// Latencies: `None` (JSON null) when no such query ran, not a made-up 0.
    pub best_sellers_p50_ms: Option<f64>,
    pub best_sellers_p99_ms: Option<f64>,
    pub related_p50_ms: Option<f64>,
    pub related_p99_ms: Option<f64>,
    /// Blocks the scans decoded, over all nodes, per second of the run.
    pub rows_scanned_per_sec: f64,
    pub blocks_scanned: u64,
    pub bytes_read: u64,
    /// Blocks re-read alone (torn or locked in the stripe copies).
    pub rereads: u64,
    /// Queries run again at a fresh snapshot after `SnapshotTooOld`.
    pub too_old_retries: u64,
    /// Best Sellers answers compared with a single-node computation, and mismatches.
    pub checked: u64,
    pub mismatches: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum HtapError {
    #[error("scan: {0}")]
    Scan(#[from] ScanError),
    #[error("transaction: {0}")]
    Txn(#[from] TxnError),
    #[error("shuffle: {0}")]
    Shuffle(#[from] shuffle::ShuffleError),
    #[error("flow: {0}")]
    Flow(#[from] shuffle::flow::FlowError),
    #[error("bad data: {0}")]
    Data(String),
}

impl From<crate::codec::CodecError> for HtapError {
    fn from(e: crate::codec::CodecError) -> Self {
        HtapError::Data(e.to_string())
    }
}

pub type Result<T, E = HtapError> = std::result::Result<T, E>;

/// The tables the queries read: ITEM, ORDERS, ORDER_LINE.
#[derive(Clone)]
pub struct Tables {
    pub item: Arc<Table>,
    pub orders: Arc<Table>,
    pub order_line: Arc<Table>,
}

impl Tables {
    pub fn of(tables: &[Arc<Table>]) -> Tables {
        Tables {
            item: tables[Rel::Item.index()].clone(),
            orders: tables[Rel::Orders.index()].clone(),
            order_line: tables[Rel::OrderLine.index()].clone(),
        }
    }
}

/// Each item's subject (its index in [`SUBJECTS`]), read by one scan of ITEM (before
/// the checkouts start, see [`run_analytics`]).
pub fn item_subjects(
    worker: &Worker,
    item: &Table,
    config: &ScanConfig,
) -> Result<HashMap<u64, u8>> {
    let (subjects, _) = scan::scan_with_retry(worker, OnTooOld::Retry { attempts: 10 }, |s| {
        let mut subjects = HashMap::new();
        scan::scan_blocking(s, item, Scanner::ALONE, config, |row| {
            let it = Item::decode(row.value).map_err(|e| ScanError::Consumer(e.to_string()))?;
            let subject = SUBJECTS
                .iter()
                .position(|&x| x == it.i_subject)
                .ok_or_else(|| {
                    ScanError::Consumer(format!("item {} has subject {:?}", it.i_id, it.i_subject))
                })?;
            subjects.insert(row.key, subject as u8);
            Ok(())
        })?;
        Ok(subjects)
    })?;
    Ok(subjects)
}

/// Keeps the `n` largest `(o_date, o_id)`.
struct Newest {
    n: usize,
    heap: BinaryHeap<Reverse<(i64, u64)>>,
}

impl Newest {
    fn new(n: usize) -> Newest {
        Newest {
            n,
            heap: BinaryHeap::with_capacity(n + 1),
        }
    }
    fn add(&mut self, date: i64, id: u64) {
        if self.heap.len() < self.n {
            self.heap.push(Reverse((date, id)));
        } else if self
            .heap
            .peek()
            .is_some_and(|Reverse(min)| *min < (date, id))
        {
            self.heap.pop();
            self.heap.push(Reverse((date, id)));
        }
    }
    fn into_vec(self) -> Vec<(i64, u64)> {
        self.heap.into_iter().map(|Reverse(x)| x).collect()
    }
}

fn order_of(value: &[u8]) -> std::result::Result<Order, ScanError> {
    Order::decode(value).map_err(|e| ScanError::Consumer(e.to_string()))
}

fn line_of(value: &[u8]) -> std::result::Result<OrderLine, ScanError> {
    OrderLine::decode(value).map_err(|e| ScanError::Consumer(e.to_string()))
}

/// Ranks `(item, quantity)`: quantity descending, then item id.
fn rank(mut items: Vec<(u64, i64)>, keep: usize) -> Vec<(u64, i64)> {
    items.sort_unstable_by_key(|&(id, qty)| (Reverse(qty), id));
    items.truncate(keep);
    items
}

/// Best Sellers of `subject` at `snapshot`, on one scanner: the reference the
/// distributed answer is checked against.
pub fn best_sellers_single(
    snapshot: &Snapshot<'_>,
    tables: &Tables,
    subjects: &HashMap<u64, u8>,
    subject: u8,
    config: &ScanConfig,
) -> Result<Vec<(u64, i64)>> {
    let mut newest = Newest::new(BEST_SELLERS_WINDOW);
    for (_, v) in scan::collect(snapshot, &tables.orders, config)? {
        let o = order_of(&v)?;
        newest.add(o.o_date, o.o_id);
    }
    let recent: HashSet<u64> = newest.into_vec().into_iter().map(|(_, id)| id).collect();
    let mut qty: HashMap<u64, i64> = HashMap::new();
    for (_, v) in scan::collect(snapshot, &tables.order_line, config)? {
        let l = line_of(&v)?;
        if recent.contains(&l.ol_o_id) && subjects.get(&l.ol_i_id) == Some(&subject) {
            *qty.entry(l.ol_i_id).or_default() += l.ol_qty as i64;
        }
    }
    Ok(rank(qty.into_iter().collect(), BEST_SELLERS))
}

/// One analytics node: a shuffle node and its flows (its worker on the database is
/// apart, since snapshots borrow it).
struct AnalyticsNode<'a> {
    net: FlowNet,
    /// The same node the flows run on: for gathering small lists out of band.
    node: Arc<Node>,
    tables: &'a Tables,
    subjects: &'a HashMap<u64, u8>,
    config: &'a HtapConfig,
    rank: usize,
    nodes: usize,
    stats: ScanStats,
}

/// What node 0 learns of one query.
enum Answer {
    BestSellers(Vec<(u64, i64)>),
    Related(Vec<(u64, i64)>),
    /// Not node 0.
    Elsewhere,
}

fn qty_schema() -> Schema {
    Schema::new(vec![Column::u64("item"), Column::i64("qty")], "item").expect("a valid schema")
}

impl AnalyticsNode<'_> {
    fn node(&self) -> &Arc<Node> {
        &self.node
    }

    fn scanner(&self) -> Scanner {
        Scanner {
            index: self.rank,
            count: self.nodes,
        }
    }

    /// The ids of the `window` most recent orders at `snapshot`, on every node.
    fn recent_orders(
        &mut self,
        tag: &str,
        snapshot: &Snapshot<'_>,
        window: usize,
    ) -> Result<HashSet<u64>> {
        let mut newest = Newest::new(window);
        self.stats += scan::scan_blocking(
            snapshot,
            &self.tables.orders,
            self.scanner(),
            &self.config.scan,
            |row| {
                let o = order_of(row.value)?;
                newest.add(o.o_date, o.o_id);
                Ok(())
            },
        )?;
        let all = gather(self.node(), snapshot.worker(), tag, &newest.into_vec())?;
        let mut merged = Newest::new(window);
        for (date, id) in all.into_iter().flatten() {
            merged.add(date, id);
        }
        Ok(merged.into_vec().into_iter().map(|(_, id)| id).collect())
    }

    /// Scans ORDER_LINE, pushing `(item, qty)` of the lines `keep` accepts into a
    /// combiner flow to node 0, whose result node 0 returns.
    fn sum_lines(
        &mut self,
        name: &str,
        snapshot: &Snapshot<'_>,
        mut keep: impl FnMut(&OrderLine) -> bool,
    ) -> Result<Option<Vec<(u64, i64)>>> {
        let flow = self.net.declare(
            FlowSpec::combiner(name, qty_schema(), vec![Aggregate::sum("qty")])
                .sources(all_threads(self.nodes, 1))
                .targets([(0, 0)]),
        )?;
        let mut source = flow.source(0)?;
        let (table, scanner, config) = (
            self.tables.order_line.clone(),
            self.scanner(),
            self.config.scan,
        );
        std::thread::scope(|s| {
            // The target consumes on its own thread: a source blocks once its window
            // of unconsumed messages is full.
            let target = (self.rank == 0)
                .then(|| flow.target(0))
                .transpose()?
                .map(|t| s.spawn(move || t.combined()));
            let scanned = scan::scan_blocking(snapshot, &table, scanner, &config, |row| {
                let l = line_of(row.value)?;
                if keep(&l) {
                    source
                        .push(&[l.ol_i_id, l.ol_qty as i64 as u64])
                        .map_err(|e| ScanError::Consumer(e.to_string()))?;
                }
                Ok(())
            });
            // Close even after a failed scan, so the target ends.
            let closed = source.close();
            let combined = target
                .map(|h| {
                    wait_ticking(snapshot.worker(), &h)?;
                    h.join()
                        .expect("the combiner target thread panicked")
                        .map_err(HtapError::from)
                })
                .transpose();
            self.stats += scanned?;
            closed?;
            let combined = combined?;
            Ok(combined.map(|groups| {
                groups
                    .into_iter()
                    .filter_map(|g| match g.values[..] {
                        [Value::I64(qty)] => Some((g.key[0], qty)),
                        _ => None,
                    })
                    .collect()
            }))
        })
    }

    fn best_sellers(&mut self, q: u64, snapshot: &Snapshot<'_>, subject: u8) -> Result<Answer> {
        let recent = self.recent_orders(&format!("bs{q}-orders"), snapshot, BEST_SELLERS_WINDOW)?;
        let sums = self.sum_lines(&format!("bs{q}"), snapshot, |l| recent.contains(&l.ol_o_id))?;
        Ok(match sums {
            Some(sums) => Answer::BestSellers(rank(
                sums.into_iter()
                    .filter(|(id, _)| self.subjects.get(id) == Some(&subject))
                    .collect(),
                BEST_SELLERS,
            )),
            None => Answer::Elsewhere,
        })
    }

    fn related(&mut self, q: u64, snapshot: &Snapshot<'_>, x: u64) -> Result<Answer> {
        let recent = self.recent_orders(&format!("rel{q}-orders"), snapshot, RELATED_WINDOW)?;
        let mut with_x = Vec::new();
        self.stats += scan::scan_blocking(
            snapshot,
            &self.tables.order_line,
            self.scanner(),
            &self.config.scan,
            |row| {
                let l = line_of(row.value)?;
                if l.ol_i_id == x && recent.contains(&l.ol_o_id) {
                    with_x.push(l.ol_o_id);
                }
                Ok(())
            },
        )?;
        let with_x: HashSet<u64> = gather(
            self.node(),
            snapshot.worker(),
            &format!("rel{q}-with"),
            &with_x,
        )?
        .into_iter()
        .flatten()
        .collect();
        let sums = self.sum_lines(&format!("rel{q}"), snapshot, |l| {
            l.ol_i_id != x && with_x.contains(&l.ol_o_id)
        })?;
        Ok(match sums {
            Some(sums) => Answer::Related(rank(sums, 5)),
            None => Answer::Elsewhere,
        })
    }
}

/// Waits for `handle`'s thread while ticking `worker`: the analytics workers are
/// readers, which own no timestamps, but their ticks still help the prefix past
/// stalled slots.
fn wait_ticking<T>(worker: &Worker, handle: &std::thread::ScopedJoinHandle<'_, T>) -> Result<()> {
    while !handle.is_finished() {
        worker.tick()?;
        std::thread::sleep(Duration::from_micros(200));
    }
    Ok(())
}

/// [`Node::all_gather`], ticking `worker` while the other nodes catch up.
fn gather<T>(node: &Node, worker: &Worker, tag: &str, mine: &T) -> Result<Vec<T>>
where
    T: Serialize + serde::de::DeserializeOwned + Sync + Send,
{
    std::thread::scope(|s| {
        let h = s.spawn(|| node.all_gather(tag, mine));
        wait_ticking(worker, &h)?;
        Ok(h.join().expect("the gathering thread panicked")?)
    })
}

/// Writes `related` (best first) into item `x`'s related fields; slots left over keep
/// the item's current related items that are not already listed. The new version is
/// logged in `rewrites`.
///
/// A commit fenced under the writer (its thread starved past the lease) is not an
/// error: the writer learns what recovery made of it, logs the version if it
/// committed (the run's history needs it, as other clients read it) and tries again
/// if it was rolled back. Not learnt within `patience`, the outcome is unknown: an
/// error (logging the version either way would be a guess the run's history checks).
pub fn write_related(
    worker: &Worker,
    item: &Arc<Table>,
    x: u64,
    related: &[(u64, i64)],
    rewrites: &ItemRewrites,
    patience: Duration,
) -> Result<()> {
    /// Tries after commits rolled back by recovery: each was a fence, rare.
    const FENCED_TRIES: u32 = 3;
    for _ in 0..FENCED_TRIES {
        // What the last attempt read: a fenced commit returns no value.
        let mut read = None;
        let outcome = block_on(worker.run(0, 20, async |t| {
            let (stock, rid) = write_related_in(t, item, x, related).await?;
            read = Some((stock, rid));
            Ok(())
        }));
        let cid = match outcome {
            Ok(((), cid)) => cid,
            Err(TxnError::Fenced { cid }) => {
                match block_on(worker.fenced_outcome(cid, patience))? {
                    txn::FencedOutcome::Committed { cid } => Some(cid),
                    txn::FencedOutcome::RolledBack => continue,
                }
            }
            Err(e) => return Err(e.into()),
        };
        if let (Some(cid), Some((stock, rid))) = (cid, read) {
            rewrites.push(ItemRewrite {
                item: x,
                stock,
                rid,
                cid,
            });
        }
        return Ok(());
    }
    Err(HtapError::Data(format!(
        "the related items of item {x}: {FENCED_TRIES} commits in a row were fenced and \
         rolled back"
    )))
}

/// [`write_related`]'s transaction: the stock it kept and its snapshot.
async fn write_related_in(
    t: &mut txn::AsyncTransaction<'_>,
    item: &Arc<Table>,
    x: u64,
    related: &[(u64, i64)],
) -> std::result::Result<(i32, u64), TxnError> {
    let row = t
        .get(item, x)
        .await?
        .ok_or_else(|| TxnError::NotFound(format!("item {x}")))?;
    let mut it = Item::decode(&row).map_err(|e| TxnError::Invalid(e.to_string()))?;
    let mut ids: Vec<u64> = related.iter().map(|r| r.0).collect();
    for old in it.related() {
        if ids.len() < 5 && !ids.contains(&old) && old != x {
            ids.push(old);
        }
    }
    ids.resize(5, it.i_related1);
    [
        it.i_related1,
        it.i_related2,
        it.i_related3,
        it.i_related4,
        it.i_related5,
    ] = [ids[0], ids[1], ids[2], ids[3], ids[4]];
    t.put(item, x, it.encode()).await?;
    Ok((it.i_stock, t.rid()))
}

/// Runs the analytics nodes from when the clients of the run beside start (told by
/// `rewrites`) until `stop` is set; returns what they did. `subjects`
/// comes from [`item_subjects`], read before the checkouts start (ITEM keeps one
/// version, so a scan of it beside checkouts would keep finding newer stocks). The
/// related-items updates are logged in `rewrites`, for the history of the run beside
/// ([`crate::runner::run_beside`]).
pub fn run_analytics(
    db: &Database,
    tables: &Tables,
    subjects: &HashMap<u64, u8>,
    config: &HtapConfig,
    stop: &AtomicBool,
    rewrites: &ItemRewrites,
) -> Result<HtapReport> {
    if config.nodes == 0 {
        return Err(HtapError::Data(
            "HTAP needs at least one analytics node".into(),
        ));
    }
    let Some(started) = rewrites.wait_for_clients(stop) else {
        // The run beside failed before its clients started: nothing ran.
        return Ok(HtapReport {
            nodes: config.nodes,
            ..HtapReport::default()
        });
    };
    let network = fabric::sim::SimNetwork::new(fabric::sim::SimConfig::default());
    let exchanges = LocalExchange::group(config.nodes, Duration::from_secs(60));
    let results: Vec<Result<(Option<NodeZero>, ScanStats)>> = std::thread::scope(|s| {
        let handles: Vec<_> = exchanges
            .into_iter()
            .enumerate()
            .map(|(rank, exchange)| {
                let device: Arc<dyn fabric::Device> = network.add_node();
                s.spawn(move || {
                    let node = Arc::new(Node::join(device, Arc::new(exchange), 1 << 30)?);
                    let opened = shuffle::open(
                        &node,
                        Design::ALL[0],
                        &EndpointConfig {
                            threads: 1,
                            timeout: Duration::from_secs(60),
                            ..EndpointConfig::default()
                        },
                    )?;
                    let net = FlowNet::new(
                        node.clone(),
                        opened,
                        FlowConfig {
                            timeout: Duration::from_secs(60),
                            ..FlowConfig::default()
                        },
                    )?;
                    let mut me = AnalyticsNode {
                        net,
                        node,
                        tables,
                        subjects,
                        config,
                        rank,
                        nodes: config.nodes,
                        stats: ScanStats::default(),
                    };
                    // Holds no oracle slot, so its scans never hold back the
                    // checkouts' read timestamps.
                    let worker = db.reader()?;
                    let out = node_loop(&mut me, &worker, stop, rewrites);
                    let AnalyticsNode { net, stats, .. } = me;
                    let shut = net.shutdown();
                    let out = out?;
                    shut?;
                    Ok((out, stats))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("an analytics node panicked"))
            .collect()
    });
    let seconds = started.elapsed().as_secs_f64();
    let mut report = HtapReport {
        nodes: config.nodes,
        seconds,
        ..HtapReport::default()
    };
    let mut zero = None;
    for r in results {
        let (z, stats) = r?;
        report.blocks_scanned += stats.blocks;
        report.bytes_read += stats.bytes_read;
        report.rereads += stats.rereads;
        if z.is_some() {
            zero = z;
        }
    }
    let zero = zero.expect("node 0 reports");
    let ms = quantile_ms;
    report.best_sellers = zero.best_sellers.len();
    report.related_updates = zero.related.len();
    report.queries_per_sec = (report.best_sellers + report.related_updates) as f64 / seconds;
    report.best_sellers_p50_ms = ms(&zero.best_sellers, 0.5);
    report.best_sellers_p99_ms = ms(&zero.best_sellers, 0.99);
    report.related_p50_ms = ms(&zero.related, 0.5);
    report.related_p99_ms = ms(&zero.related, 0.99);
    report.rows_scanned_per_sec = report.blocks_scanned as f64 / seconds;
    report.too_old_retries = zero.too_old_retries;
    report.checked = zero.checked;
    report.mismatches = zero.mismatches;
    Ok(report)
}

/// What node 0 measures.
struct NodeZero {
    /// Query latencies in µs.
    best_sellers: Histogram<u64>,
    related: Histogram<u64>,
    too_old_retries: u64,
    checked: u64,
    mismatches: u64,
}

/// Node 0's decision for the next query, shared with every node.
#[derive(Clone, Copy, Debug, serde::Serialize, serde::Deserialize)]
struct Next {
    go: bool,
    rid: u64,
    /// A retry at a fresh snapshot of the same query.
    retry: bool,
}

fn node_loop(
    me: &mut AnalyticsNode<'_>,
    worker: &Worker,
    stop: &AtomicBool,
    rewrites: &ItemRewrites,
) -> Result<Option<NodeZero>> {
    let mut zero = NodeZero {
        best_sellers: Histogram::new(3).expect("a histogram"),
        related: Histogram::new(3).expect("a histogram"),
        too_old_retries: 0,
        checked: 0,
        mismatches: 0,
    };
    let mut q = 0u64;
    let mut attempt = 0u32;
    let mut query_started = Instant::now();
    let mut failed_too_old = false;
    let mut best_sellers_done = 0u64;
    loop {
        let mine = if me.rank == 0 {
            let go = !stop.load(Ordering::Relaxed);
            let rid = if go {
                block_on(worker.snapshot())?.rid()
            } else {
                0
            };
            Next {
                go,
                rid,
                retry: failed_too_old,
            }
        } else {
            Next {
                go: false,
                rid: 0,
                retry: false,
            }
        };
        let next = gather(me.node(), worker, &format!("next{q}"), &mine)?[0];
        if !next.go {
            break;
        }
        if !next.retry {
            attempt = 0;
            query_started = Instant::now();
        }
        let snapshot = block_on(worker.snapshot_at(next.rid))?;
        let cycle = me.config.best_sellers_per_related as u64 + 1;
        let round = q - u64::from(attempt);
        let is_related = round % cycle == cycle - 1;
        let subject = (round % SUBJECTS.len() as u64) as u8;
        // The related item: one that sells, spread over the catalog.
        let x = 1 + (round * 7919) % me.subjects.len().max(1) as u64;
        let outcome = if is_related {
            me.related(q, &snapshot, x)
        } else {
            me.best_sellers(q, &snapshot, subject)
        };
        // Every node learns whether any failed with a too-old snapshot, so all retry.
        let too_old = matches!(
            outcome,
            Err(HtapError::Scan(ScanError::SnapshotTooOld { .. }))
        );
        let any_too_old = gather(me.node(), worker, &format!("old{q}"), &too_old)?
            .into_iter()
            .any(|b| b);
        q += 1;
        // Retried for as long as the run goes on (node 0 ends every node once `stop` is
        // set, dropping a query still retrying): a fixed number of retries could run
        // out on a loaded machine, where each attempt is slower and meets more
        // concurrent updates, failing the whole run.
        if any_too_old {
            attempt += 1;
            zero.too_old_retries += 1;
            failed_too_old = true;
            continue;
        }
        failed_too_old = false;
        let answer = outcome?;
        match answer {
            Answer::BestSellers(top) => {
                best_sellers_done += 1;
                let elapsed = query_started.elapsed();
                zero.best_sellers
                    .record(elapsed.as_micros().max(1) as u64)
                    .expect("latency in range");
                if me.config.check_every > 0
                    && (best_sellers_done - 1).is_multiple_of(me.config.check_every)
                {
                    let want = best_sellers_single(
                        &snapshot,
                        me.tables,
                        me.subjects,
                        subject,
                        &me.config.scan,
                    )?;
                    zero.checked += 1;
                    if want != top {
                        zero.mismatches += 1;
                        tracing::error!(?want, got = ?top, rid = next.rid, "Best Sellers differs from the single-node answer");
                    }
                }
            }
            Answer::Related(related) => {
                // A writer only for the write: a slot held across the scans would
                // hold back every checkout's read timestamp between ticks.
                let writer = worker.database().worker()?;
                write_related(
                    &writer,
                    &me.tables.item,
                    x,
                    &related,
                    rewrites,
                    me.config.unknown_outcome_patience,
                )?;
                zero.related
                    .record(query_started.elapsed().as_micros().max(1) as u64)
                    .expect("latency in range");
            }
            Answer::Elsewhere => {}
        }
    }
    Ok((me.rank == 0).then_some(zero))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_query_that_never_ran_has_no_latency() {
        let mut h = Histogram::<u64>::new(3).unwrap();
        assert_eq!(quantile_ms(&h, 0.5), None);
        h.record(2500).unwrap();
        // 2500 µs, within the histogram's three significant digits.
        assert!(quantile_ms(&h, 0.5).is_some_and(|ms| (ms - 2.5).abs() < 0.01));
    }

    #[test]
    fn newest_keeps_the_latest_orders_by_date_then_id() {
        let mut n = Newest::new(3);
        for (date, id) in [(5, 1), (9, 2), (1, 3), (9, 1), (7, 8), (2, 9)] {
            n.add(date, id);
        }
        let mut got = n.into_vec();
        got.sort_unstable();
        assert_eq!(got, vec![(7, 8), (9, 1), (9, 2)]);
        let mut small = Newest::new(10);
        small.add(1, 1);
        assert_eq!(small.into_vec(), vec![(1, 1)]);
    }

    #[test]
    fn rank_orders_by_quantity_then_id_and_truncates() {
        let ranked = rank(vec![(4, 10), (2, 30), (9, 10), (1, 5), (3, 30)], 4);
        assert_eq!(ranked, vec![(2, 30), (3, 30), (4, 10), (9, 10)]);
    }
}
