//! RSI: the TPC-W relations as namdb tables, transactions run by [`txn::Worker`]s
//! (many clients per thread as coroutines).
//!
//! Tables are sized up front ([`Room`]): the generated rows plus what the runs may add.
//! Versions per record follow the paper (§4.2: a block keeps n versions, reads fetch
//! the block, and the paper's own implementation keeps one): ITEM, whose 1 KB rows
//! every checkout reads and writes, and rows that are only inserted keep one; the
//! other updated rows two; the small per-subject index four. A snapshot that needs an
//! older version aborts with `SnapshotTooOld` and is retried.
//!
//! ORDERS is the exception among inserted rows and keeps two: Admin Confirm and Best
//! Sellers find each client stream's newest order by probing ids that may not exist
//! yet, and an order inserted after the reader's snapshot must read as absent there.
//! A one-version block cannot say "absent before" (the second version is the insert's
//! tombstone at CID 0), so every probe that met a concurrent insert aborted: under the
//! ordering mix Admin Confirm aborted 99% of its attempts (p99 about 1 s) and the
//! retries cost the mix a fifth of its throughput.

use crate::interactions::{Interaction, Mix};
use crate::load;
use crate::schema::{MAX_LINES, Rel, Scale, max_row_bytes};
use crate::system::{AbortReason, ClientFuture, Committed, Engine, Error, Result, Session, System};
use std::sync::Arc;
use std::time::Duration;
use txn::{AsyncTransaction, Database, FencedOutcome, Table, TableSpec, TxnError, Worker};

/// The oracle lease for a benchmark's workers (`txn::Options::oracle.lease_timeout`).
/// A benchmark has no dead nodes to detect, while a worker thread descheduled for
/// longer than the default quarter-second lease (a loaded machine, a debug build)
/// would be fenced and its commit given up to recovery. The runner survives that (it
/// waits for recovery and learns the outcome, [`Engine::outcome`]), but each one
/// stalls the prefix for a lease and costs a recovery's scan of every table.
pub const BENCHMARK_LEASE: Duration = Duration::from_secs(2);

/// Rows the runs may add beyond the generated data.
#[derive(Clone, Copy, Debug)]
pub struct Room {
    pub orders: u64,
    pub order_lines: u64,
    /// Credit-card transactions (Buy Confirm makes one per order; checkout none).
    pub cc_xacts: u64,
    /// Customers (with one address each).
    pub customers: u64,
    /// Carts: at most one per client.
    pub carts: u64,
}

impl Room {
    /// Room for `seconds` of runs of `mix` by up to `clients` clients (over all runs)
    /// at up to `per_sec` interactions a second.
    pub fn for_runs(mix: Mix, seconds: f64, per_sec: f64, clients: u64) -> Room {
        let share = |i: Interaction| {
            mix.weights()
                .iter()
                .filter(|w| w.0 == i)
                .map(|w| w.1 / 100.0)
                .sum::<f64>()
        };
        // Saturating (float-to-int casts saturate too): an absurd duration makes an
        // absurd size, which the caller refuses, rather than one that wrapped around.
        let rows =
            |fraction: f64| ((seconds * per_sec * fraction).ceil() as u64).saturating_add(1000);
        let checkouts = share(Interaction::Checkout);
        let confirms = share(Interaction::BuyConfirm);
        let orders = rows(checkouts + confirms);
        Room {
            orders,
            // Checkout makes three lines; a confirmed cart holds two on average and at
            // most MAX_LINES (an unlucky run ends with "table full").
            order_lines: rows(checkouts * 3.0 + confirms * 4.0),
            cc_xacts: rows(confirms),
            customers: rows(share(Interaction::BuyRequest) * 0.2),
            carts: clients.saturating_add(1000),
        }
    }
}

/// What the tables of `scale` with `room` are made of, partitioned over `servers`
/// memory servers.
pub fn table_specs(scale: &Scale, room: &Room, servers: u32) -> Vec<(Rel, TableSpec)> {
    table_specs_with(scale, room, servers, &|_| None)
}

/// [`table_specs`] with the versions of some relations overridden (`versions(rel)`),
/// as an HTAP run needs ([`crate::htap::htap_table_versions`]).
pub fn table_specs_with(
    scale: &Scale,
    room: &Room,
    servers: u32,
    versions: &dyn Fn(Rel) -> Option<u32>,
) -> Vec<(Rel, TableSpec)> {
    Rel::ALL
        .iter()
        .map(|&rel| {
            let versions_of = versions;
            let (rows, versions) = match rel {
                Rel::Country | Rel::Author => (scale.rows(rel), 1),
                Rel::Item => (scale.items, 1),
                Rel::Customer => (scale.customers().saturating_add(room.customers), 2),
                Rel::Address => (scale.addresses().saturating_add(room.customers), 1),
                // Probed for ids that may not exist yet (see the module doc).
                Rel::Orders => (scale.orders().saturating_add(room.orders), 2),
                Rel::CcXacts => (scale.orders().saturating_add(room.cc_xacts), 1),
                // Generated orders have one to five lines.
                Rel::OrderLine => ((scale.orders() * 5).saturating_add(room.order_lines), 1),
                Rel::ShoppingCart => (room.carts, 2),
                Rel::ShoppingCartLine => (room.carts.saturating_mul(MAX_LINES), 2),
                Rel::NewProducts => (scale.rows(rel), 4),
            };
            // Keys hash over partitions: room for an unlucky spread of few rows.
            let capacity = rows.saturating_add(rows / 16).saturating_add(256);
            let mut spec = TableSpec::new(rel.name(), max_row_bytes(rel, scale), capacity);
            spec.versions = versions_of(rel).unwrap_or(versions);
            // Each partition has its own index, sized for the partition's rows: 32-slot
            // buckets at 8 rows each on average overflow with probability ~1e-10, and
            // take half the memory of 16-slot buckets at 2 (the big indexes are written
            // at random places, so all of their memory is touched early in a run).
            spec.partitions = servers;
            spec.index.slots = 32;
            spec.index.buckets = (capacity.div_ceil(servers as u64) / 8).max(1);
            (rel, spec)
        })
        .collect()
}

/// Each transaction's buffer (`txn::Options::scratch_bytes`) for the tables of `scale`:
/// room for the largest write set an interaction makes, and never less than txn's
/// default. Buy Confirm is the largest: a full cart's items and cart lines updated
/// or deleted, the cart and the customer updated, and a few words per insert; each
/// written block is staged twice, as the log record's value and as the installed
/// versions. With 16 KiB items that is over txn's default of 256 KiB.
pub fn scratch_bytes(scale: &Scale, room: &Room, servers: u32) -> Result<u64> {
    scratch_bytes_with(scale, room, servers, &|_| None)
}

/// [`scratch_bytes`] for [`table_specs_with`].
pub fn scratch_bytes_with(
    scale: &Scale,
    room: &Room,
    servers: u32,
    versions: &dyn Fn(Rel) -> Option<u32>,
) -> Result<u64> {
    let specs = table_specs_with(scale, room, servers, versions);
    let block = |rel: Rel| -> Result<u64> {
        let (_, spec) = specs
            .iter()
            .find(|(r, _)| *r == rel)
            .expect("a spec for every relation");
        Ok(txn::layout::BlockShape::new(spec.versions, spec.value_cap)
            .map_err(|e| Error::System(e.to_string()))?
            .block_bytes())
    };
    let buy_confirm = MAX_LINES * (block(Rel::Item)? + block(Rel::ShoppingCartLine)?)
        + block(Rel::ShoppingCart)?
        + block(Rel::Customer)?
        + (MAX_LINES + 2) * 64;
    let admin_confirm = block(Rel::Item)? + block(Rel::NewProducts)?;
    let need = 2 * buy_confirm.max(admin_confirm) + 4096;
    Ok(need
        .max(txn::Options::default().scratch_bytes)
        .next_power_of_two())
}

/// Bytes of memory-server memory the tables need, over all `servers`.
pub fn bytes_needed(scale: &Scale, room: &Room, servers: u32) -> Result<u64> {
    bytes_needed_with(scale, room, servers, &|_| None)
}

/// [`bytes_needed`] for [`table_specs_with`].
pub fn bytes_needed_with(
    scale: &Scale,
    room: &Room,
    servers: u32,
    versions: &dyn Fn(Rel) -> Option<u32>,
) -> Result<u64> {
    Ok(table_bytes(scale, room, servers, versions)?.total)
}

/// What the tables take of memory-server memory, in bytes over all servers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TableBytes {
    /// Blocks and indexes for every row there is room for.
    pub total: u64,
    /// What is touched from the start: the indexes, which rows hash all over, and the
    /// blocks of the loaded rows. The rest fills as the runs insert.
    pub touched_from_the_start: u64,
}

/// [`TableBytes`] of the tables of [`table_specs_with`].
pub fn table_bytes(
    scale: &Scale,
    room: &Room,
    servers: u32,
    versions: &dyn Fn(Rel) -> Option<u32>,
) -> Result<TableBytes> {
    let mut bytes = TableBytes {
        total: 0,
        touched_from_the_start: 0,
    };
    for (rel, spec) in table_specs_with(scale, room, servers, versions) {
        let block = txn::layout::BlockShape::new(spec.versions, spec.value_cap)
            .map_err(|e| Error::System(e.to_string()))?
            .block_bytes();
        let index = spec
            .index
            .buckets
            .saturating_mul(spec.index.bucket_bytes())
            .saturating_mul(servers as u64);
        let blocks = spec.blocks_on(servers).saturating_mul(block);
        let loaded = scale.rows(rel).min(spec.capacity).saturating_mul(block);
        bytes.total = bytes.total.saturating_add(blocks).saturating_add(index);
        bytes.touched_from_the_start = bytes
            .touched_from_the_start
            .saturating_add(loaded)
            .saturating_add(index);
    }
    Ok(bytes)
}

pub struct Rsi {
    db: Database,
    backend: String,
    room: Room,
    tables: Arc<[Arc<Table>]>,
    /// What must live as long as the database (memory-server processes, sockets).
    _keep: Box<dyn Send + Sync>,
}

impl Rsi {
    /// RSI over `db`, whose tables `load` creates (or finds, if another node did).
    pub fn new(db: Database, backend: String, room: Room, keep: Box<dyn Send + Sync>) -> Rsi {
        Rsi {
            db,
            backend,
            room,
            tables: Arc::from(Vec::new()),
            _keep: keep,
        }
    }

    /// Creates the tables of `scale` (before [`System::load`] fills them).
    pub fn create_tables(&mut self, scale: &Scale) -> Result<()> {
        self.create_tables_with(scale, &|_| None)
    }

    /// [`Rsi::create_tables`] with the versions of some relations overridden.
    pub fn create_tables_with(
        &mut self,
        scale: &Scale,
        versions: &dyn Fn(Rel) -> Option<u32>,
    ) -> Result<()> {
        let mut tables = Vec::new();
        for (rel, spec) in table_specs_with(scale, &self.room, self.db.servers() as u32, versions) {
            let table = self
                .db
                .create_table(spec)
                .map_err(|e| Error::System(format!("creating table {}: {e}", rel.name())))?;
            tables.push(table);
        }
        self.tables = Arc::from(tables);
        Ok(())
    }
}

impl Rsi {
    pub fn database(&self) -> &Database {
        &self.db
    }

    /// The tables, indexed by [`Rel::index`] (empty before `create_tables`).
    pub fn tables(&self) -> &[Arc<Table>] {
        &self.tables
    }
}

fn map_err(e: TxnError) -> Error {
    match e {
        TxnError::Conflict { .. } => Error::aborted(AbortReason::Conflict, e.to_string()),
        TxnError::SnapshotTooOld { .. } => {
            Error::aborted(AbortReason::SnapshotTooOld, e.to_string())
        }
        TxnError::DuplicateKey { .. } => Error::aborted(AbortReason::DuplicateKey, e.to_string()),
        TxnError::Fenced { cid } => Error::Unknown {
            message: e.to_string(),
            commit: Some(cid),
        },
        TxnError::TableFull { name, capacity, .. } => Error::System(format!(
            "table {name} is full (made for {capacity} records): the run added more rows \
             than the room it was sized for; run for less time or give more room"
        )),
        e => Error::System(e.to_string()),
    }
}

impl System for Rsi {
    type Engine = RsiEngine;

    fn name(&self) -> &'static str {
        "rsi"
    }

    fn backend(&self) -> String {
        self.backend.clone()
    }

    fn engine(&self, _thread: usize) -> Result<RsiEngine> {
        if self.tables.len() != Rel::ALL.len() {
            return Err(Error::System(
                "the tables are not created yet (create_tables)".into(),
            ));
        }
        Ok(RsiEngine {
            worker: self.db.worker().map_err(map_err)?,
            tables: self.tables.clone(),
        })
    }

    fn max_clients_per_thread(&self) -> usize {
        4096
    }

    fn load(&self, scale: &Scale, progress: &(dyn Fn(Rel, u64, u64) + Sync)) -> Result<()> {
        let threads = std::thread::available_parallelism().map_or(2, |n| n.get().min(8));
        load::load_through_transactions(self, scale, threads, 8, progress)
    }
}

pub struct RsiEngine {
    worker: Worker,
    tables: Arc<[Arc<Table>]>,
}

pub struct RsiTxn<'a> {
    txn: AsyncTransaction<'a>,
    tables: &'a [Arc<Table>],
}

impl<'a> RsiTxn<'a> {
    /// The table of `rel`, borrowed for as long as the session (not from it), so the
    /// transaction can be used mutably beside it without an `Arc` clone per call.
    fn table(&self, rel: Rel) -> &'a Arc<Table> {
        &self.tables[rel.index()]
    }
}

impl Session for RsiTxn<'_> {
    async fn get(&mut self, rel: Rel, key: u64) -> Result<Option<Vec<u8>>> {
        let table = self.table(rel);
        self.txn.get(table, key).await.map_err(map_err)
    }

    async fn get_many(&mut self, rel: Rel, keys: &[u64]) -> Result<Vec<Option<Vec<u8>>>> {
        // The transaction splits big key sets to fit its buffer itself.
        let table = self.table(rel);
        self.txn.get_many(table, keys).await.map_err(map_err)
    }

    async fn put(&mut self, rel: Rel, key: u64, row: Vec<u8>) -> Result<()> {
        let table = self.table(rel);
        self.txn.put(table, key, row).await.map_err(map_err)
    }

    async fn insert(&mut self, rel: Rel, key: u64, row: Vec<u8>) -> Result<()> {
        let table = self.table(rel);
        // Checked at commit, batched with the transaction's other inserts.
        self.txn
            .insert_later(table, key, row)
            .await
            .map_err(map_err)
    }

    async fn delete(&mut self, rel: Rel, key: u64) -> Result<()> {
        let table = self.table(rel);
        self.txn.delete(table, key).await.map_err(map_err)
    }

    async fn version(&mut self, rel: Rel, key: u64) -> Result<Option<u64>> {
        let table = self.table(rel);
        self.txn.get_version(table, key).await.map_err(map_err)
    }

    fn read_timestamp(&self) -> Option<u64> {
        Some(self.txn.rid())
    }
}

impl Engine for RsiEngine {
    type Txn<'a> = RsiTxn<'a>;

    async fn begin(&self, after: u64) -> Result<RsiTxn<'_>> {
        Ok(RsiTxn {
            txn: self.worker.begin(after).await.map_err(map_err)?,
            tables: &self.tables,
        })
    }

    async fn commit<'a>(&'a self, txn: RsiTxn<'a>) -> Result<Committed> {
        let cid = txn.txn.commit().await.map_err(map_err)?;
        Ok(Committed { cid })
    }

    fn abort<'a>(&'a self, txn: RsiTxn<'a>) {
        txn.txn.abort();
    }

    async fn outcome(&self, commit: u64, patience: Duration) -> Result<Option<Committed>> {
        match self
            .worker
            .fenced_outcome(commit, patience)
            .await
            .map_err(map_err)?
        {
            FencedOutcome::Committed { cid } => Ok(Some(Committed { cid: Some(cid) })),
            FencedOutcome::RolledBack => Ok(None),
        }
    }

    fn run_clients<'a, T>(
        &'a self,
        clients: usize,
        make: impl FnMut(usize) -> ClientFuture<'a, T>,
    ) -> Vec<T> {
        self.worker.run_coroutines(clients, make)
    }
}
