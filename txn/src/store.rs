//! The `Database`: a cluster of memory servers holding, per table partition, an arena
//! (a bump counter word, then fixed-size blocks) and an index, plus the timestamp
//! oracle; and the compute-side handles ([`Worker`]s) that run transactions on it.
//!
//! A compute node reaches a memory server through a [`MemoryServerLink`], which makes
//! connected RC queue pairs. `txn` knows nothing about processes or gRPC (DESIGN.md,
//! "Crates"): the embedded cluster implements the link with in-process sim nodes, and
//! the binary implements it over the memory server's control plane.
//!
//! The catalog ([`crate::catalog`]) lives in the memory servers' `catalog` regions:
//! any compute node opens it (the first one sets it up and formats the oracle), and
//! creates and finds tables there with CAS, so a database is opened on memory servers
//! that other compute nodes use too ([`Database::open`]). [`Database::embedded`]
//! brings up in-process memory servers first.

use crate::catalog::{
    CATALOG_BYTES, Catalog, CatalogError, CatalogOptions, ServerRegions, TableDef, TableSpec,
};
use crate::conn::Conn;
use crate::durable::{Durability, Persistence};
use crate::error::{Result, TxnError};
use crate::index::RemoteIndex;
use crate::layout::BlockShape;
use crate::worker::{Client, Worker};
use fabric::sim::{SimConfig, SimNetwork};
use fabric::{Access, CompletionQueue, Device, QpConfig, QueuePair, Region, RemoteRegion};
use std::sync::{Arc, Mutex};
use timestamp::OracleConfig;

/// Reaches one memory server: makes RC queue pairs on a compute node's device that are
/// connected to it.
pub trait MemoryServerLink: Send + Sync {
    /// A new RC queue pair on `local`, whose send completions go to `cq`, connected to
    /// this server, allowing `send_queue` outstanding sends.
    fn connect(
        &self,
        local: &Arc<dyn Device>,
        cq: &Arc<dyn CompletionQueue>,
        send_queue: u32,
    ) -> Result<Arc<dyn QueuePair>>;

    /// A durable server's persist service ([`crate::durable`]); `None` for a server
    /// that keeps nothing across a restart.
    fn persistence(&self) -> Option<Arc<dyn Persistence>> {
        None
    }

    /// How many times a durable server has started on its stored state (1 on its
    /// first start); 0 for a server that keeps nothing.
    fn boot(&self) -> u64 {
        0
    }

    /// The compute-node incarnation this link's sessions belong to (48 bits, the same
    /// for every link of one database, fresh for each opening), which another node
    /// fences through [`MemoryServerLink::fence`] once this one's oracle lease lapsed;
    /// 0 for a server that cannot fence (in-process servers, whose holders are all of
    /// one process and fenced exactly by its lease gates).
    fn incarnation(&self) -> u64 {
        0
    }

    /// Memory-side fencing: has this server end every session of `incarnation`, so
    /// nothing it posts from now on reaches the server's memory, and refuse it from
    /// then on.
    fn fence(&self, incarnation: u64) -> Result<()> {
        Err(TxnError::Invalid(format!(
            "this memory server cannot fence incarnation {incarnation:#x}"
        )))
    }
}

/// One partition of a table: an arena and an index on one memory server.
#[derive(Clone, Debug)]
pub struct Partition {
    /// Which memory server of the cluster holds it.
    pub server: usize,
    /// The region holding the arena.
    pub data: RemoteRegion,
    /// Offset of the arena in `data`: its bump counter word, then the blocks.
    pub arena: u64,
    /// Blocks the arena holds.
    pub capacity: u64,
    pub index: RemoteIndex,
}

/// A table as compute nodes see it.
#[derive(Clone, Debug)]
pub struct Table {
    pub id: u32,
    pub name: String,
    pub shape: BlockShape,
    pub partitions: Vec<Partition>,
    /// The records it was made for (its partitions' blocks hold more: headroom for
    /// keys that hash unevenly).
    records: u64,
}

impl Table {
    /// The partition holding `key`.
    pub fn partition_of(&self, key: u64) -> usize {
        // The high half of the hash: the index's bucket choice uses the low bits.
        ((crate::index::mix(key) >> 32) % self.partitions.len() as u64) as usize
    }

    /// The offset of block `i` of partition `p` in that partition's data region.
    pub fn block_offset(&self, p: usize, i: u64) -> u64 {
        self.partitions[p].arena + 8 + i * self.shape.block_bytes()
    }

    /// The records it was made for (`TableSpec::capacity`): that many distinct keys
    /// fit, however they hash to its partitions.
    pub fn capacity(&self) -> u64 {
        self.records
    }
}

/// Makes the devices of an embedded cluster: one per memory server and one per
/// worker, each a node that can reach the others (for example shm devices on sockets
/// in one directory).
pub type DeviceFactory = Arc<dyn Fn() -> Result<Arc<dyn Device>> + Send + Sync>;

/// Oracle slots of a cluster set up with default options: each worker of every compute
/// node holds one.
pub const DEFAULT_SLOTS: u32 = 16;

/// Options of a database.
#[derive(Clone)]
pub struct Options {
    /// The sim network of an embedded cluster, unless `devices` is given.
    pub sim: SimConfig,
    /// Where an embedded cluster's devices come from instead of a sim network.
    pub devices: Option<DeviceFactory>,
    /// Memory servers of an embedded cluster.
    pub servers: usize,
    /// Bytes of data each embedded memory server exports (zeroed memory, touched as
    /// tables fill).
    pub server_bytes: u64,
    /// How long a node waits for another's catalog bootstrap or table creation before
    /// taking it over.
    pub catalog_wait: std::time::Duration,
    /// Oracle slots (the most workers at once), if this node sets the catalog up.
    pub slots: u32,
    pub oracle: OracleConfig,
    /// `commit` returns only once the oracle's prefix includes the commit, so every
    /// transaction that begins after it returns sees it (real-time order, which
    /// verify's white-box checker demands). The wait needs the other live workers to
    /// keep reading timestamps or ticking.
    pub wait_visible: bool,
    /// Bytes of each in-flight transaction's registered buffer (reads land there and
    /// commit requests are staged there): bounds a transaction's write set.
    pub scratch_bytes: u64,
    /// Bytes of each oracle slot's commit-log area, if this node sets the catalog up:
    /// bounds the log records of a worker's commits in flight at once.
    pub log_bytes_per_slot: u64,
    /// The cluster the servers must hold ([`Database::cluster_id`] of an earlier open),
    /// for a node reconnecting after a restart: servers that came back without it are
    /// an error, never a new, empty cluster set up in its place.
    pub cluster: Option<u64>,
    /// How long a commit waits for a replicated memory server whose backup is away:
    /// its primary refuses Persists until it has attached to the backup again (it
    /// retries every second, then copies its state there), and the commit makes its
    /// Persist again until then. Past it the commit is left for recovery, and its
    /// worker stops, as for any failed Persist.
    pub persist_patience: std::time::Duration,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            sim: SimConfig::default(),
            devices: None,
            servers: 1,
            server_bytes: 256 << 20,
            catalog_wait: std::time::Duration::from_secs(10),
            slots: DEFAULT_SLOTS,
            oracle: OracleConfig::default(),
            wait_visible: true,
            scratch_bytes: 256 << 10,
            log_bytes_per_slot: crate::commitlog::DEFAULT_AREA_BYTES,
            cluster: None,
            persist_patience: std::time::Duration::from_secs(15),
        }
    }
}

impl Options {
    /// The largest `value_cap` of a table keeping `versions` versions that these
    /// options' transactions hold: [`Database::create_table`] wants a block (and 8
    /// bytes) in a quarter of a transaction's buffer, `scratch_bytes`.
    pub fn largest_value_cap(&self, versions: u32) -> u32 {
        let room = self.scratch_bytes / 4;
        let fits =
            |cap: u32| BlockShape::new(versions, cap).is_ok_and(|s| s.block_bytes() + 8 <= room);
        if !fits(0) {
            return 0;
        }
        let (mut lo, mut hi) = (0u32, u32::MAX);
        while lo < hi {
            let mid = lo + (hi - lo).div_ceil(2);
            if fits(mid) {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        lo
    }

    /// The `scratch_bytes` (at least the default, a multiple of 4 KiB) whose
    /// transactions hold a table's blocks of `shape`. A commit's log record holds its
    /// write set: `log_bytes_per_slot` should be at least as large.
    pub fn scratch_bytes_for(shape: BlockShape) -> u64 {
        (4 * (shape.block_bytes() + 8))
            .next_multiple_of(4 << 10)
            .max(Options::default().scratch_bytes)
    }
}

impl std::fmt::Debug for Options {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Options")
            .field("sim", &self.sim)
            .field("devices", &self.devices.as_ref().map(|_| "custom"))
            .field("servers", &self.servers)
            .field("server_bytes", &self.server_bytes)
            .field("slots", &self.slots)
            .field("oracle", &self.oracle)
            .field("wait_visible", &self.wait_visible)
            .field("scratch_bytes", &self.scratch_bytes)
            .field("log_bytes_per_slot", &self.log_bytes_per_slot)
            .field("cluster", &self.cluster)
            .field("persist_patience", &self.persist_patience)
            .finish()
    }
}

pub(crate) struct Shared {
    /// Where workers' devices come from.
    devices_for_workers: DeviceFactory,
    pub(crate) servers: Vec<Arc<dyn MemoryServerLink>>,
    pub(crate) catalog: Catalog,
    pub(crate) options: Options,
    pub(crate) durability: Durability,
    /// Fault injection: the next commit to complete its log record fails right after.
    pub(crate) fail_after_log: std::sync::atomic::AtomicBool,
    /// What the restart recovery this node ran at open did, if it ran one.
    pub(crate) restart: Mutex<Option<crate::restart::RestartReport>>,
    /// Connections for catalog work (one per server), on their own device.
    admin: Mutex<Vec<Conn>>,
    _admin_device: Arc<dyn Device>,
    /// Tables seen so far, by id.
    tables: Mutex<Vec<Option<Arc<Table>>>>,
    /// Recoveries this process ran.
    pub(crate) recoveries: Mutex<Vec<crate::recovery::RecoveryReport>>,
    /// Tests: the slot whose next recovery stalls once it began, and its hold
    /// ([`crate::crash::starve_at_with_recovery_held_on_this_thread`]).
    pub(crate) recovery_hold: Mutex<Option<(u32, Arc<crate::recovery::HoldState>)>>,
    /// The next slot adoption stalls in this hold (tests, [`crate::crash::hold_next_slot_adoption`]).
    pub(crate) adoption_hold: Mutex<Option<Arc<crate::recovery::HoldState>>>,
    /// The oracle lease gates of this process's workers: a fence of one of them waits
    /// for the commit step it posted under its lease ([`timestamp::gate`]).
    pub(crate) lease_gates: Arc<timestamp::LeaseGates>,
    /// This database's incarnation ([`MemoryServerLink::incarnation`]; 0: none).
    pub(crate) incarnation: u64,
    /// Incarnations of other nodes this one had every memory server fence.
    pub(crate) fenced: Mutex<std::collections::HashSet<u64>>,
    /// Embedded servers' regions, kept registered for as long as the database lives.
    _keep: Vec<Region>,
}

/// A namdb database: memory servers, the oracle, the tables.
#[derive(Clone)]
pub struct Database {
    pub(crate) shared: Arc<Shared>,
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// An in-process memory server on the sim network.
struct SimServer {
    device: Arc<dyn Device>,
    /// The server ends of connections, kept so they stay connected.
    qps: Mutex<Vec<Arc<dyn QueuePair>>>,
}

impl MemoryServerLink for SimServer {
    fn connect(
        &self,
        local: &Arc<dyn Device>,
        cq: &Arc<dyn CompletionQueue>,
        send_queue: u32,
    ) -> Result<Arc<dyn QueuePair>> {
        let scq = self.device.create_cq(16)?;
        let (sqp, qp) =
            fabric::connect_rc_with((self.device.as_ref(), &scq), (local.as_ref(), cq), |c| {
                QpConfig {
                    max_send_wr: send_queue,
                    ..c
                }
            })?;
        lock(&self.qps).push(sqp);
        Ok(qp)
    }
}

/// Send queue of an admin connection.
const ADMIN_SEND_QUEUE: u32 = 256;

impl Database {
    /// An embedded cluster: `options.servers` in-process memory servers (nodes of a sim
    /// network, or devices from `options.devices`), each exporting a `catalog` region
    /// and `server_bytes` of data, as a memory-server process does.
    pub fn embedded(options: Options) -> Result<Database> {
        if options.servers == 0 {
            return Err(TxnError::Invalid("a cluster needs a memory server".into()));
        }
        let factory: DeviceFactory = match &options.devices {
            Some(f) => f.clone(),
            None => {
                let net = SimNetwork::new(options.sim.clone());
                Arc::new(move || Ok(net.add_node() as Arc<dyn Device>))
            }
        };
        let mut keep = Vec::new();
        let mut servers = Vec::with_capacity(options.servers);
        for _ in 0..options.servers {
            let device = factory()?;
            let catalog = device.register(CATALOG_BYTES, Access::ALL)?;
            let data = device.register(options.server_bytes.max(4096), Access::ALL)?;
            let regions = ServerRegions {
                catalog: catalog.remote(),
                data: vec![data.remote()],
            };
            keep.extend([catalog, data]);
            let link: Arc<dyn MemoryServerLink> = Arc::new(SimServer {
                device,
                qps: Mutex::new(Vec::new()),
            });
            servers.push((link, regions));
        }
        Database::open_with(servers, factory, options, keep)
    }

    /// A database on memory servers that already run (and that other compute nodes may
    /// share): each reached through its link, with its region directory. The catalog
    /// is set up by the first node to open it. Compute-side devices come from
    /// `devices`.
    pub fn open(
        servers: Vec<(Arc<dyn MemoryServerLink>, ServerRegions)>,
        devices: DeviceFactory,
        options: Options,
    ) -> Result<Database> {
        Database::open_with(servers, devices, options, Vec::new())
    }

    fn open_with(
        servers: Vec<(Arc<dyn MemoryServerLink>, ServerRegions)>,
        devices: DeviceFactory,
        options: Options,
        keep: Vec<Region>,
    ) -> Result<Database> {
        if servers.is_empty() {
            return Err(TxnError::Invalid("a cluster needs a memory server".into()));
        }
        if options.scratch_bytes < crate::catalog::MIN_SCRATCH {
            return Err(TxnError::Invalid(format!(
                "scratch_bytes must be at least {}",
                crate::catalog::MIN_SCRATCH
            )));
        }
        let admin_device = devices()?;
        let mut admin = Vec::with_capacity(servers.len());
        for (link, _) in &servers {
            let cq = admin_device.create_cq(ADMIN_SEND_QUEUE * 2)?;
            let qp = link.connect(&admin_device, &cq, ADMIN_SEND_QUEUE)?;
            // Big enough for recovery's scans, which use these connections too.
            admin.push(Conn::new(
                admin_device.as_ref(),
                qp,
                cq,
                crate::recovery::SCRATCH,
            )?);
        }
        let (links, regions): (Vec<_>, Vec<_>) = servers.into_iter().unzip();
        let incarnation = links[0].incarnation();
        if links.iter().any(|l| l.incarnation() != incarnation)
            || incarnation & !crate::commitlog::Holder::INCARNATION_MASK != 0
        {
            return Err(TxnError::Invalid(
                "the memory-server links name different incarnations (or one past 48 bits); \
                 one database has one"
                    .into(),
            ));
        }
        let durability = Durability::new(
            links.iter().map(|l| l.persistence()).collect(),
            options.persist_patience,
        )?;
        let boots: Vec<u64> = links.iter().map(|l| l.boot()).collect();
        let catalog = Catalog::open(
            &mut admin,
            regions,
            &CatalogOptions {
                oracle_bits: timestamp::DEFAULT_BITS,
                oracle_slots: options.slots,
                log_bytes_per_slot: options.log_bytes_per_slot,
                wait: options.catalog_wait,
                cluster: options.cluster,
            },
        )?;
        let shared = Shared {
            devices_for_workers: devices,
            servers: links,
            catalog,
            options,
            durability,
            fail_after_log: Default::default(),
            restart: Mutex::new(None),
            admin: Mutex::new(admin),
            _admin_device: admin_device,
            tables: Mutex::new(Vec::new()),
            recoveries: Mutex::new(Vec::new()),
            recovery_hold: Mutex::new(None),
            adoption_hold: Mutex::new(None),
            lease_gates: timestamp::LeaseGates::new(),
            incarnation,
            fenced: Mutex::new(Default::default()),
            _keep: keep,
        };
        let db = Database {
            shared: Arc::new(shared),
        };
        if incarnation != 0 {
            let weak = Arc::downgrade(&db.shared);
            db.shared
                .lease_gates
                .set_remote_fence(Box::new(move |slot, tag| {
                    weak.upgrade().is_none_or(|shared| {
                        crate::recovery::fence_holder(&Database { shared }, slot, tag)
                    })
                }));
        }
        if db.is_durable() {
            // Nothing may use the oracle or the data before a restarted server's
            // losses are repaired, so the repair runs before the database is handed
            // out (or this node waits for the node running it).
            let report = crate::restart::after_open(&db, &boots)?;
            *lock(&db.shared.restart) = report;
        }
        Ok(db)
    }

    /// Whether the memory servers are durable ([`crate::durable`]).
    /// The cluster's identity, set when its catalog was first set up: the same for
    /// every node and every open of the same cluster.
    pub fn cluster_id(&self) -> u64 {
        self.shared.catalog.cluster_id()
    }

    pub fn is_durable(&self) -> bool {
        self.shared.durability.is_durable()
    }

    /// Fault injection for tests of what runs workers: the next commit (of any worker
    /// of this database handle) fails right after its log record is complete, as if a
    /// memory server failed then. It is committed, its locks stay, and its worker
    /// breaks ([`crate::TxnError::Broken`]) until recovery finishes the commit.
    #[doc(hidden)]
    pub fn fail_next_commit_after_log(&self) {
        self.shared
            .fail_after_log
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// What the restart recovery this node ran when it opened the database did.
    pub fn restart_report(&self) -> Option<crate::restart::RestartReport> {
        lock(&self.shared.restart).clone()
    }

    /// Makes the catalog regions durable after they changed.
    pub(crate) fn persist_catalog(&self) -> Result<()> {
        persist_catalog(&self.shared)
    }

    pub fn options(&self) -> &Options {
        &self.shared.options
    }

    /// Memory servers in the cluster.
    pub fn servers(&self) -> usize {
        self.shared.servers.len()
    }

    /// Creates a table in the catalog: its partitions' arenas and indexes are carved out
    /// of the memory servers' data regions. `partitions: 0` means one per server.
    pub fn create_table(&self, mut spec: TableSpec) -> Result<Arc<Table>> {
        if spec.versions == 0 {
            BlockShape::new(spec.versions, spec.value_cap)?;
        }
        // Control characters (a newline, a tab) would garble every listing of tables
        // (`namdb kv tables` is TAB-separated) and every message naming one.
        if spec.name.chars().any(char::is_control) {
            return Err(TxnError::Invalid(format!(
                "a table name is text without control characters (a newline, a tab, NUL), \
                 not `{}`",
                crate::echo(&spec.name)
            )));
        }
        if spec.name.is_empty() || spec.name.len() > crate::catalog::MAX_NAME {
            return Err(TxnError::Invalid(format!(
                "a table name has 1 to {} bytes, not {}",
                crate::catalog::MAX_NAME,
                match spec.name.len() {
                    0 => "0".to_string(),
                    n => format!("{n} (`{}`)", crate::echo(&spec.name)),
                }
            )));
        }
        if spec.capacity == 0 {
            return Err(TxnError::Invalid("a table needs a capacity".into()));
        }
        let scratch = self.shared.options.scratch_bytes;
        if spec.index.bucket_bytes() > scratch / 4 {
            return Err(TxnError::Invalid(format!(
                "an index bucket ({} bytes) must fit a quarter of a transaction's buffer \
                 ({scratch} bytes, Options::scratch_bytes)",
                spec.index.bucket_bytes(),
            )));
        }
        // A shape too large to describe at all (a value cap near 4 GiB) is refused in
        // the same words as one too large for the buffer: what the caller can change is
        // the value cap.
        let fits = |value_cap| {
            BlockShape::new(spec.versions, value_cap)
                .is_ok_and(|s| s.block_bytes() + 8 <= scratch / 4)
        };
        if !fits(spec.value_cap) {
            if !fits(0) {
                return Err(TxnError::Invalid(format!(
                    "a table of {} versions is too large even for empty values: a block must \
                     fit a quarter of a transaction's {scratch}-byte buffer \
                     (Options::scratch_bytes); keep fewer versions (4 by default)",
                    spec.versions
                )));
            }
            let largest = self.shared.options.largest_value_cap(spec.versions);
            return Err(TxnError::Invalid(format!(
                "values of up to {} bytes are too large: a transaction here holds values of \
                 up to {largest} bytes in a table of {} versions (a block must fit a quarter \
                 of its {scratch}-byte buffer, Options::scratch_bytes)",
                spec.value_cap, spec.versions,
            )));
        }
        if spec.partitions == 0 {
            spec.partitions = self.servers() as u32;
        }
        let def = {
            let mut admin = lock(&self.shared.admin);
            self.shared.catalog.create_table(&mut admin, &spec)?
        };
        self.persist_catalog()?;
        Ok(self.remember(def))
    }

    fn remember(&self, def: TableDef) -> Arc<Table> {
        let table = Arc::new(Table::from_def(def));
        let mut tables = lock(&self.shared.tables);
        let id = table.id as usize;
        if tables.len() <= id {
            tables.resize(id + 1, None);
        }
        tables[id].get_or_insert(table).clone()
    }

    /// The table called `name`, from the catalog (created by any compute node).
    pub fn table(&self, name: &str) -> Result<Arc<Table>> {
        // No table has such a name: said without reading the catalog.
        if name.is_empty() {
            return Err(TxnError::Invalid(
                "no table named: the table name is empty (unset?)".into(),
            ));
        }
        if name.len() > crate::catalog::MAX_NAME {
            return Err(TxnError::NotFound(format!(
                "table {}: table names have at most {} bytes",
                crate::echo(name),
                crate::catalog::MAX_NAME
            )));
        }
        if let Some(t) = lock(&self.shared.tables)
            .iter()
            .flatten()
            .find(|t| t.name == name)
        {
            return Ok(t.clone());
        }
        let def = {
            let mut admin = lock(&self.shared.admin);
            self.shared.catalog.table(&mut admin, name)
        };
        match def {
            Ok(def) => Ok(self.remember(def)),
            Err(CatalogError::NotFound(_)) => {
                Err(TxnError::NotFound(format!("table {}", crate::echo(name))))
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Every table in the catalog.
    pub fn tables(&self) -> Result<Vec<Arc<Table>>> {
        let defs = {
            let mut admin = lock(&self.shared.admin);
            self.shared.catalog.tables(&mut admin)?
        };
        Ok(defs.into_iter().map(|d| self.remember(d)).collect())
    }

    /// The connections catalog work and recovery share (one per server).
    pub(crate) fn recovery_conns(&self) -> std::sync::MutexGuard<'_, Vec<Conn>> {
        lock(&self.shared.admin)
    }

    /// A new compute-side device.
    pub(crate) fn new_device(&self) -> Result<Arc<dyn Device>> {
        (self.shared.devices_for_workers)()
    }

    /// A worker: one thread's connections (one per memory server), oracle slot, address
    /// cache and buffers, for running many transactions at once as futures.
    pub fn worker(&self) -> Result<Worker> {
        Worker::new(self.clone())
    }

    /// A worker for read-only work (analytical scans, read-only transactions) that
    /// holds no oracle slot: it owns no timestamps, so it never holds back other
    /// nodes' read timestamps however long it goes between ticks, as a slot holder
    /// busy with a long scan would. Committing writes on it is an error.
    pub fn reader(&self) -> Result<Worker> {
        Worker::new_reader(self.clone())
    }

    /// A blocking client: a [`Worker`] with one session.
    pub fn client(&self) -> Result<Client> {
        Ok(Client::new(self.worker()?))
    }
}

impl Table {
    fn from_def(def: TableDef) -> Table {
        Table {
            id: def.id,
            name: def.name,
            shape: def.shape,
            records: def.capacity,
            partitions: def
                .partitions
                .iter()
                .map(|p| Partition {
                    server: p.server as usize,
                    data: p.data,
                    arena: p.arena_offset,
                    capacity: p.capacity,
                    index: RemoteIndex {
                        region: p.data,
                        base: p.index_offset,
                        shape: p.index,
                    },
                })
                .collect(),
        }
    }
}

/// Makes every server's catalog region durable (table definitions, allocation
/// cursors): small, and changed only by bootstrap and table creation.
pub(crate) fn persist_catalog(shared: &Shared) -> Result<()> {
    let mut plan = crate::durable::PersistPlan::default();
    for (s, regions) in shared.catalog.servers().iter().enumerate() {
        plan.add(
            s,
            crate::durable::PersistRange::plain(regions.catalog.at(0), regions.catalog.len),
        );
    }
    shared.durability.persist_blocking(plan)
}
