//! The embedded `Database`: a sim cluster of one memory-server node holding, per table,
//! a data region (a bump counter word, then fixed-size blocks) and an index region,
//! plus the timestamp oracle region; and [`Client`]s, compute handles each on its own
//! sim node with one connection to the memory server and one oracle slot.
//!
//! Implemented: tables created in process ([`Database::create_table`]); the catalog
//! lives in the `Database` value, **not yet** in memory-server memory with CAS updates.
//! Each table is one partition on one server (no multi-partition arenas). Memory
//! servers other than the embedded sim one are not supported yet.
//!
//! A client's slot stalls every other client's read timestamps while it is held and
//! idle: a client calls [`timestamp::SlotHandle::tick`] in every `begin`, and releases
//! its slot when dropped, so drop clients that are done.

use crate::conn::Conn;
use crate::error::{Result, TxnError};
use crate::index::{IndexCache, IndexShape, RemoteIndex};
use crate::layout::BlockShape;
use crate::transaction::Transaction;
use fabric::sim::{SimConfig, SimNetwork};
use fabric::{Access, Device, QpConfig, QueuePair, Region, RemoteRegion};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use timestamp::{Layout, OracleConfig, SlotHandle, SystemClock};

/// Bytes of a client's scratch region: [0, READ_AREA) index buckets, [READ_AREA,
/// COMMIT_AREA) a block and its header for reads, [COMMIT_AREA, ..) commit buffers.
pub(crate) const SCRATCH_BYTES: u64 = 4 << 20;
pub(crate) const READ_AREA: u64 = 64 << 10;
pub(crate) const COMMIT_AREA: u64 = 1 << 20;

/// A table's definition.
#[derive(Clone, Debug)]
pub struct TableSpec {
    pub name: String,
    /// Versions kept per record.
    pub versions: u32,
    /// Largest value in bytes.
    pub value_cap: u32,
    /// Blocks the table's arena holds.
    pub capacity: u64,
    pub index: IndexShape,
}

/// A table as clients see it.
#[derive(Clone, Debug)]
pub struct Table {
    pub id: u32,
    pub name: String,
    pub shape: BlockShape,
    pub capacity: u64,
    /// The arena: word 0 is the bump counter (blocks handed out), blocks start at 8.
    pub data: RemoteRegion,
    pub index: RemoteIndex,
}

impl Table {
    /// The offset of block `i` in the data region.
    pub fn block_offset(&self, i: u64) -> u64 {
        8 + i * self.shape.block_bytes()
    }
}

/// Options of an embedded database.
#[derive(Clone, Debug)]
pub struct Options {
    pub sim: SimConfig,
    /// Oracle slots: the most clients at once.
    pub slots: u32,
    pub oracle: OracleConfig,
    /// `commit` returns only once the oracle's prefix includes the commit, so every
    /// transaction that begins after it returns sees it (real-time order, which
    /// verify's white-box checker demands). The wait needs the other live clients to
    /// tick; single-threaded code that interleaves clients turns it off and uses
    /// [`Client::begin_after`] instead.
    pub wait_visible: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            sim: SimConfig::default(),
            slots: 16,
            oracle: OracleConfig::default(),
            wait_visible: true,
        }
    }
}

pub(crate) struct Shared {
    net: SimNetwork,
    server: Arc<dyn Device>,
    oracle: Region,
    options: Options,
    tables: Mutex<Vec<Arc<Table>>>,
    /// The memory server's regions and queue pairs, kept so they stay registered and
    /// connected.
    keep: Mutex<Kept>,
}

#[derive(Default)]
struct Kept {
    regions: Vec<Region>,
    qps: Vec<Arc<dyn QueuePair>>,
}

/// An embedded namdb on a sim cluster.
#[derive(Clone)]
pub struct Database {
    shared: Arc<Shared>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Database {
    /// A sim network with one memory-server node holding a formatted oracle.
    pub fn embedded(options: Options) -> Result<Database> {
        let net = SimNetwork::new(options.sim.clone());
        let server: Arc<dyn Device> = net.add_node();
        let layout = Layout::new(timestamp::DEFAULT_BITS, options.slots)?;
        let oracle = server.register(layout.region_bytes(), Access::ALL)?;
        layout.format(&oracle)?;
        Ok(Database {
            shared: Arc::new(Shared {
                net,
                server,
                oracle,
                options,
                tables: Mutex::new(Vec::new()),
                keep: Mutex::new(Kept::default()),
            }),
        })
    }

    /// Registers the table's arena and index regions on the memory server.
    pub fn create_table(&self, spec: TableSpec) -> Result<Arc<Table>> {
        let shape = BlockShape::new(spec.versions, spec.value_cap)?;
        if spec.index.buckets == 0 || spec.index.slots == 0 {
            return Err(TxnError::Invalid(
                "the index needs buckets and slots".into(),
            ));
        }
        if spec.index.bucket_bytes() > READ_AREA
            || shape.block_bytes() + 8 > COMMIT_AREA - READ_AREA
        {
            return Err(TxnError::Invalid(
                "bucket or block too large for a client's scratch buffers".into(),
            ));
        }
        let mut tables = lock(&self.shared.tables);
        if tables.iter().any(|t| t.name == spec.name) {
            return Err(TxnError::Invalid(format!("table {} exists", spec.name)));
        }
        let data_bytes = 8 + spec.capacity * shape.block_bytes();
        let data = self.shared.server.register(data_bytes, Access::ALL)?;
        let index = self
            .shared
            .server
            .register(spec.index.region_bytes(), Access::ALL)?;
        let table = Arc::new(Table {
            id: tables.len() as u32,
            name: spec.name,
            shape,
            capacity: spec.capacity,
            data: data.remote(),
            index: RemoteIndex {
                region: index.remote(),
                shape: spec.index,
                scratch_offset: 0,
            },
        });
        lock(&self.shared.keep).regions.extend([data, index]);
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

    /// A compute handle on a new sim node: a connection to the memory server and a slot
    /// of the oracle (on its own queue pair).
    pub fn client(&self) -> Result<Client> {
        let sh = &self.shared;
        let node: Arc<dyn Device> = sh.net.add_node();
        let data_qp = self.connect(&node, 256)?;
        let conn = Conn::new(node.as_ref(), data_qp.0, data_qp.1, SCRATCH_BYTES)?;
        let (oqp, ocq) = self.connect(&node, timestamp::MIN_SEND_QUEUE * 2)?;
        let slot = SlotHandle::register(
            node.as_ref(),
            oqp,
            ocq,
            sh.oracle.remote(),
            sh.options.oracle.clone(),
            SystemClock::shared(),
        )?;
        Ok(Client {
            conn,
            slot,
            cache: HashMap::new(),
            last_cid: 0,
            stats: ClientStats::default(),
            wait_visible: sh.options.wait_visible,
        })
    }

    #[allow(clippy::type_complexity)]
    fn connect(
        &self,
        node: &Arc<dyn Device>,
        send_queue: u32,
    ) -> Result<(Arc<dyn QueuePair>, Arc<dyn fabric::CompletionQueue>)> {
        let sh = &self.shared;
        let ccq = node.create_cq(timestamp::MIN_CQ_CAPACITY * 4)?;
        let scq = sh.server.create_cq(16)?;
        let (sqp, qp) =
            fabric::connect_rc_with((sh.server.as_ref(), &scq), (node.as_ref(), &ccq), |c| {
                QpConfig {
                    max_send_wr: send_queue,
                    ..c
                }
            })?;
        lock(&sh.keep).qps.push(sqp);
        Ok((qp, ccq))
    }
}

/// Counters of one client.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ClientStats {
    /// Block reads rejected by the seqlock check because the headers differed.
    pub torn_retries: u64,
    /// Block reads retried because the record was locked.
    pub locked_retries: u64,
    pub committed: u64,
    pub aborted: u64,
    /// Times the oracle slot was fenced (idle past the lease timeout) and re-taken.
    pub rejoins: u64,
}

/// A compute handle: one thread's connection, oracle slot, address cache and session
/// (a client sees its own writes: `begin` waits until the read timestamp reaches the
/// client's last commit).
pub struct Client {
    pub(crate) conn: Conn,
    pub(crate) slot: SlotHandle,
    pub(crate) cache: AddrCache,
    pub(crate) last_cid: u64,
    pub(crate) stats: ClientStats,
    pub(crate) wait_visible: bool,
}

/// The address cache, per table.
pub(crate) type AddrCache = HashMap<u32, IndexCache>;

impl Client {
    /// Starts a transaction at the oracle's committed prefix, once it covers this
    /// client's last commit (a session sees its own writes).
    pub fn begin(&mut self) -> Result<Transaction<&mut Client>> {
        self.begin_after(0)
    }

    /// As [`Client::begin_after`], for a transaction that owns the client until it
    /// ends; on error the client comes back with it.
    #[allow(clippy::result_large_err)]
    pub fn begin_owned(mut self, min: u64) -> Result<Transaction<Client>, (Client, TxnError)> {
        match self.wait_rid(min) {
            Ok(rid) => Ok(Transaction::new(self, rid)),
            Err(e) => Err((self, e)),
        }
    }

    /// As [`Client::begin`], with a snapshot that also includes timestamp `min` (for
    /// example another session's commit this one must see). The wait needs every other
    /// live client to keep calling `begin` or [`Client::tick`]; a client idle for the
    /// oracle's lease timeout is fenced by the waiters and re-registers on its next
    /// call.
    pub fn begin_after(&mut self, min: u64) -> Result<Transaction<&mut Client>> {
        let rid = self.wait_rid(min)?;
        Ok(Transaction::new(self, rid))
    }

    pub(crate) fn wait_rid(&mut self, min: u64) -> Result<u64> {
        let want = min.max(self.last_cid);
        let start = std::time::Instant::now();
        let rid = loop {
            self.tick()?;
            let rid = self.slot.read_timestamp()?;
            if rid >= want {
                break rid;
            }
            if start.elapsed() > std::time::Duration::from_secs(10) {
                return Err(TxnError::Invalid(format!(
                    "the read timestamp stayed at {rid}, below {want}"
                )));
            }
            std::hint::spin_loop();
        };
        Ok(rid)
    }

    /// Keeps this client's oracle slot moving (skips its unused timestamps, renews its
    /// lease); an idle client that others wait for calls it at least every tick
    /// interval. A slot that was fenced meanwhile is re-registered.
    pub fn tick(&mut self) -> Result<()> {
        match self.slot.tick() {
            Ok(_) => Ok(()),
            Err(timestamp::OracleError::Fenced { .. }) => {
                self.slot.rejoin()?;
                self.stats.rejoins += 1;
                Ok(())
            }
            Err(e) => Err(e.into()),
        }
    }

    pub fn stats(&self) -> ClientStats {
        self.stats
    }

    /// The highest commit timestamp of this session.
    pub fn last_cid(&self) -> u64 {
        self.last_cid
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        // Frees the slot so that others skip its timestamps; fails only if it was fenced.
        let _ = self.slot.release();
    }
}
