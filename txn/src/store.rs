//! The `Database`: a cluster of memory servers holding, per table partition, an arena
//! (a bump counter word, then fixed-size blocks) and an index, plus the timestamp
//! oracle; and the compute-side handles ([`Worker`]s) that run transactions on it.
//!
//! A compute node reaches a memory server through a [`MemoryServerLink`], which makes
//! connected RC queue pairs. `txn` knows nothing about processes or gRPC (DESIGN.md,
//! "Crates"): the embedded cluster implements the link with in-process sim nodes, and
//! the binary implements it over the memory server's control plane.
//!
//! Implemented: tables created in process ([`Database::create_table`]) with their
//! partitions spread round robin over the memory servers; the table list lives in the
//! `Database` value, **not yet** in memory-server memory.

use crate::error::{Result, TxnError};
use crate::index::{IndexShape, RemoteIndex};
use crate::layout::BlockShape;
use crate::worker::{Client, Worker};
use fabric::sim::{SimConfig, SimNetwork};
use fabric::{Access, CompletionQueue, Device, QpConfig, QueuePair, Region, RemoteRegion};
use std::sync::{Arc, Mutex};
use timestamp::{Layout, OracleConfig};

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
}

/// A table's definition.
#[derive(Clone, Debug)]
pub struct TableSpec {
    pub name: String,
    /// Versions kept per record.
    pub versions: u32,
    /// Largest value in bytes.
    pub value_cap: u32,
    /// Blocks the table holds, over all partitions.
    pub capacity: u64,
    /// Partitions, spread round robin over the memory servers; 0 means one per server.
    pub partitions: u32,
    /// The index of each partition.
    pub index: IndexShape,
}

impl TableSpec {
    /// A table of `capacity` records of up to `value_cap` bytes, keeping 4 versions, one
    /// partition per memory server, with an index of 16-slot buckets at two records per
    /// bucket on average (a bucket overflows with probability ~1e-10).
    pub fn new(name: &str, value_cap: u32, capacity: u64) -> TableSpec {
        TableSpec {
            name: name.into(),
            versions: 4,
            value_cap,
            capacity,
            partitions: 0,
            index: IndexShape {
                buckets: (capacity / 2).max(1),
                slots: 16,
            },
        }
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

    /// Blocks over all partitions.
    pub fn capacity(&self) -> u64 {
        self.partitions.iter().map(|p| p.capacity).sum()
    }
}

/// Makes the devices of an embedded cluster: one per memory server and one per
/// worker, each a node that can reach the others (for example shm devices on sockets
/// in one directory).
pub type DeviceFactory = Arc<dyn Fn() -> Result<Arc<dyn Device>> + Send + Sync>;

/// Options of a database.
#[derive(Clone)]
pub struct Options {
    /// The sim network of an embedded cluster, unless `devices` is given.
    pub sim: SimConfig,
    /// Where an embedded cluster's devices come from instead of a sim network.
    pub devices: Option<DeviceFactory>,
    /// Memory servers of an embedded cluster.
    pub servers: usize,
    /// Oracle slots: the most workers at once.
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
}

impl Default for Options {
    fn default() -> Self {
        Options {
            sim: SimConfig::default(),
            devices: None,
            servers: 1,
            slots: 16,
            oracle: OracleConfig::default(),
            wait_visible: true,
            scratch_bytes: 256 << 10,
        }
    }
}

impl std::fmt::Debug for Options {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Options")
            .field("sim", &self.sim)
            .field("devices", &self.devices.as_ref().map(|_| "custom"))
            .field("servers", &self.servers)
            .field("slots", &self.slots)
            .field("oracle", &self.oracle)
            .field("wait_visible", &self.wait_visible)
            .field("scratch_bytes", &self.scratch_bytes)
            .finish()
    }
}

pub(crate) struct Shared {
    /// Where workers' devices come from.
    devices_for_workers: DeviceFactory,
    pub(crate) servers: Vec<Arc<dyn MemoryServerLink>>,
    /// The oracle's region and the server that holds it.
    pub(crate) oracle: (usize, RemoteRegion),
    pub(crate) options: Options,
    tables: Mutex<Vec<Arc<Table>>>,
    /// Embedded servers' devices, for registering table regions.
    devices: Vec<Arc<dyn Device>>,
    /// Regions kept registered for as long as the database lives.
    keep: Mutex<Vec<Region>>,
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

impl Database {
    /// An embedded cluster: `options.servers` memory-server nodes (on a sim network, or
    /// devices from `options.devices`), the oracle formatted on the first.
    pub fn embedded(options: Options) -> Result<Database> {
        if options.servers == 0 {
            return Err(TxnError::Invalid("a cluster needs a memory server".into()));
        }
        if options.scratch_bytes < 4096 {
            return Err(TxnError::Invalid(
                "scratch_bytes must be at least 4096".into(),
            ));
        }
        let factory: DeviceFactory = match &options.devices {
            Some(f) => f.clone(),
            None => {
                let net = SimNetwork::new(options.sim.clone());
                Arc::new(move || Ok(net.add_node() as Arc<dyn Device>))
            }
        };
        let devices = (0..options.servers)
            .map(|_| factory())
            .collect::<Result<Vec<_>>>()?;
        let layout = Layout::new(timestamp::DEFAULT_BITS, options.slots)?;
        let oracle = devices[0].register(layout.region_bytes(), Access::ALL)?;
        layout.format(&oracle)?;
        let servers = devices
            .iter()
            .map(|d| {
                Arc::new(SimServer {
                    device: d.clone(),
                    qps: Mutex::new(Vec::new()),
                }) as Arc<dyn MemoryServerLink>
            })
            .collect();
        Ok(Database {
            shared: Arc::new(Shared {
                devices_for_workers: factory,
                servers,
                oracle: (0, oracle.remote()),
                options,
                tables: Mutex::new(Vec::new()),
                devices,
                keep: Mutex::new(vec![oracle]),
            }),
        })
    }

    pub fn options(&self) -> &Options {
        &self.shared.options
    }

    /// Memory servers in the cluster.
    pub fn servers(&self) -> usize {
        self.shared.servers.len()
    }

    /// Creates a table: per partition, an arena region and an index region on its
    /// memory server.
    pub fn create_table(&self, spec: TableSpec) -> Result<Arc<Table>> {
        let shape = BlockShape::new(spec.versions, spec.value_cap)?;
        if spec.name.is_empty() || spec.name.len() > 64 {
            return Err(TxnError::Invalid(format!(
                "a table name has 1 to 64 bytes, got {:?}",
                spec.name
            )));
        }
        if spec.index.buckets == 0 || spec.index.slots == 0 {
            return Err(TxnError::Invalid(
                "the index needs buckets and slots".into(),
            ));
        }
        if spec.capacity == 0 {
            return Err(TxnError::Invalid("a table needs a capacity".into()));
        }
        let scratch = self.shared.options.scratch_bytes;
        if spec.index.bucket_bytes() > scratch / 4 || shape.block_bytes() + 8 > scratch / 4 {
            return Err(TxnError::Invalid(format!(
                "a bucket ({} bytes) or block ({} bytes) must fit a quarter of a transaction's buffer ({scratch} bytes, Options::scratch_bytes)",
                spec.index.bucket_bytes(),
                shape.block_bytes()
            )));
        }
        let mut tables = lock(&self.shared.tables);
        if tables.iter().any(|t| t.name == spec.name) {
            return Err(TxnError::Invalid(format!("table {} exists", spec.name)));
        }
        let servers = self.shared.devices.len();
        let count = if spec.partitions == 0 {
            servers as u64
        } else {
            spec.partitions as u64
        };
        let per_partition = spec.capacity.div_ceil(count);
        let mut partitions = Vec::with_capacity(count as usize);
        let mut kept = Vec::new();
        for p in 0..count as usize {
            let server = p % servers;
            let device = &self.shared.devices[server];
            let data = device.register(8 + per_partition * shape.block_bytes(), Access::ALL)?;
            let index = device.register(spec.index.region_bytes(), Access::ALL)?;
            partitions.push(Partition {
                server,
                data: data.remote(),
                arena: 0,
                capacity: per_partition,
                index: RemoteIndex {
                    region: index.remote(),
                    base: 0,
                    shape: spec.index,
                },
            });
            kept.extend([data, index]);
        }
        let table = Arc::new(Table {
            id: tables.len() as u32,
            name: spec.name,
            shape,
            partitions,
        });
        lock(&self.shared.keep).extend(kept);
        tables.push(table.clone());
        Ok(table)
    }

    /// The table called `name`.
    pub fn table(&self, name: &str) -> Result<Arc<Table>> {
        lock(&self.shared.tables)
            .iter()
            .find(|t| t.name == name)
            .cloned()
            .ok_or_else(|| TxnError::NotFound(format!("table {name}")))
    }

    /// Every table.
    pub fn tables(&self) -> Vec<Arc<Table>> {
        lock(&self.shared.tables).clone()
    }

    /// A new compute-side device (a node of the embedded network).
    pub(crate) fn new_device(&self) -> Result<Arc<dyn Device>> {
        (self.shared.devices_for_workers)()
    }

    /// A worker: one thread's connections (one per memory server), oracle slot, address
    /// cache and buffers, for running many transactions at once as futures.
    pub fn worker(&self) -> Result<Worker> {
        Worker::new(self.clone())
    }

    /// A blocking client: a [`Worker`] with one session.
    pub fn client(&self) -> Result<Client> {
        Ok(Client::new(self.worker()?))
    }
}
