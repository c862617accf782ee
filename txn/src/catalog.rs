//! The catalog in memory-server memory (DESIGN.md, "Data layout": catalog): tables,
//! block shapes, partitions across memory servers, index locations and the timestamp
//! oracle's location, created and updated by any compute node with CAS. There is no
//! master.
//!
//! A cluster is an ordered list of memory servers ([`ServerRegions`]: its `catalog`
//! region and its `data.N` regions). Server 0's catalog region is *the* catalog. Every
//! server's catalog region (server 0's included) also holds the allocation cursors of
//! that server's data regions, so allocations on a server are atomics on that server.
//!
//! # Word map (little-endian 64-bit words, byte offsets)
//!
//! ```text
//! server 0's catalog region
//!   0            state      kind:2 | attempt:6 | token:56          (CAS only)
//!                             kind 0 empty (the whole word 0), 1 initializing by
//!                             `token`, 2 ready (bootstrapped by `token`), 3 invalid
//!   64 + 64·a    bootstrap record of attempt a (a < 8), 8 words:
//!                  magic "NAMDBCAT", version, servers N, token, oracle data region
//!                  (on server 0), oracle offset, oracle V (bits),
//!                  oracle S (slots) | commit log KiB per slot << 32
//!                  (the commit log's S areas follow the oracle in its allocation,
//!                  from the next 64-byte boundary; see `crate::commitlog`)
//!   [576, 4 Ki)  zero (servers 1..: their membership words at 2048)
//!   4 Ki         cluster identity (a bootstrap token, CAS from 0)
//!   8 Ki …       restart recovery's guard and recorded boots (`crate::restart`)
//!   [.., 32 Ki)  zero
//!   64 Ki + 1 Ki·i   table entry i (table id i), 128 words:
//!     0            claim     kind:2 | name hash:30 | token:32      (CAS only)
//!                              kind 0 free, 1 claimed, 2 complete, 3 abandoned
//!     1            name length (1..=64 bytes)
//!     2..10        name, zero-padded
//!     10           versions | value_cap << 32
//!     11           capacity (blocks, whole table)
//!     12           partitions P (1..=32)
//!     13           blocks per partition, `blocks_per_partition(capacity, P)` (the
//!                  even share ceil(capacity / P) in catalogs of earlier versions)
//!     14, 15       index buckets, index slots (per partition)
//!     16           checksum of words 1..128 (this word taken as 0)
//!     17 + 3p      partition p: server | data region << 32, arena offset, index offset
//! every server's catalog region
//!   32 Ki + 8·r  cursor of data.r: bytes handed out from its start   (CAS only)
//! ```
//!
//! A partition's space is one allocation in one data region: the arena (a bump counter
//! word, then the blocks; block i at `arena_offset + 8 + i · block_bytes`), then, from
//! the next 64-byte boundary, its index (`IndexShape::region_bytes`). A table's space
//! is never freed or reused, and data regions start zeroed, so freshly allocated space
//! is an empty arena and an empty index.
//!
//! # Concurrency
//!
//! - **Bootstrap, once.** A node that reads the empty state (and an all-zero header
//!   page) CASes it to `initializing(0, its token)`. Exactly one CAS from 0 succeeds;
//!   the winner allocates the oracle in a data region of server 0 (like any other
//!   allocation, below), WRITEs its image ([`timestamp::Layout::image`]), then in one
//!   doorbell WRITEs its bootstrap record and CASes the state to `ready(attempt,
//!   token)`. RC executes them in order, so a node that sees `ready` finds the record
//!   and the oracle complete; before that nobody knows where the oracle is, which is
//!   what makes its plain WRITEs safe (as the CPU stores of `Layout::format` are).
//! - **A bootstrapper that dies** leaves `initializing(a, t)`. Others wait for the word
//!   to change; if it stays the same for [`CatalogOptions::wait`] (of the waiter's own
//!   clock) they take over by CAS to `initializing(a + 1, own token)`, and the winner
//!   bootstraps afresh. Each attempt writes only *its own* record and its own freshly
//!   allocated oracle, and can publish only by a CAS from its own `initializing` word,
//!   so a slow (not dead) earlier bootstrapper can neither publish nor clobber what
//!   the later one wrote: it gets [`CatalogError::BootstrapLost`] and leaks its oracle
//!   space. After 8 attempts the error is [`CatalogError::BootstrapStalled`].
//! - **Allocation**: READ the cursor, CAS it from `c` to `c + size` (size rounded to
//!   64) if that fits the region, retry with the value the failed CAS returned. A
//!   cursor grows (but for the one exception below), and each success owns
//!   `[c, c + size)`: ranges never overlap.
//!   CAS rather than FETCH_ADD so that a request that does not fit leaves the cursor
//!   alone (a smaller one may still fit) and the error is clean. The exceptions:
//!   space [`borrow`]ed by a tool is zeroed and then given back by a CAS from its end
//!   to its start, which succeeds only while it is still the last allocation, so
//!   everything past a cursor stays unowned and zero; and a table creation that fails
//!   before its entry is published gives back its space the same way (nothing wrote
//!   into it, so it needs no zeroing; nobody else knows of it).
//! - **Table ids**: entries are claimed by CAS of their claim word from 0, in order: a
//!   node claims entry i only after reading entries 0..i as claimed. So claimed entries
//!   form a prefix (a reader stops at the first free one), and exactly one node owns
//!   each entry: two creators never share an id. The body is WRITten and published by
//!   a CAS `claimed → complete` in the same doorbell; readers use complete entries only.
//! - **Space before the claim.** Entries are never freed (a claimed entry going back to
//!   free would break the prefix; and one handed to a second creator could still
//!   receive the body WRITE of a stalled first one, which lands even though its
//!   publishing CAS then fails). So a creation first checks the name (the scan below,
//!   up to the first free entry), then checks every partition's room on every server
//!   from the cursors (reads only: a table that does not fit is refused with nothing
//!   allocated and no entry taken), allocates all partitions (a concurrent allocation
//!   that took the room meanwhile makes it give back the ones it got), and only then
//!   claims an entry and publishes. Round robin is from the id it expected (the first
//!   free entry it read); if another creator claims that one first, the table lands on
//!   a later id with that placement. A creator that loses a race for its name gives
//!   its space back, which succeeds unless something was allocated after it in the
//!   same region (then that space leaks).
//! - **Unique names**: the claim word carries a 30-bit hash of the name, so the name's
//!   claim is atomic with the id's. A creator, scanning entries in order before
//!   claiming, compares every entry of the same hash: complete → it reads the name and
//!   fails with [`CatalogError::TableExists`] if equal; claimed (in progress) → it
//!   waits until it is complete or abandoned. Of two creators of one name, one claims
//!   the lower entry first; the other claims a higher one only after reading the lower
//!   one as claimed (its CAS on it failed, or it read it taken), hence sees the hash,
//!   waits, and finds the name: exactly one succeeds. Nobody waits while holding a
//!   claim, so waits do not form cycles.
//! - **A creator that dies** after claiming leaves a claimed entry: readers skip it,
//!   and a creator of the same name waits [`CatalogOptions::wait`], then CASes it to
//!   abandoned. If that creator was only slow, its publishing CAS (from `claimed`)
//!   fails and it gets [`CatalogError::CreateLost`]: uniqueness holds either way, and
//!   the slow creator gives its space back (its entry stays abandoned, so nobody
//!   reads the body it wrote). A creator whose publish fails with a fabric error
//!   cannot know whether it published: it abandons its claim (a CAS that fails if it
//!   did publish) and keeps the space. Entries of dead or stalled creators are used
//!   up for good, as is the space of a dead one (no garbage collection yet), but only
//!   those: no failure to allocate takes an entry.
//!
//! Everything read is validated (record, checksum, name hash, shapes, bounds within the
//! regions the caller gave): corruption is [`CatalogError::Corrupt`] or
//! [`CatalogError::NotACatalog`], never a panic or an access out of bounds.
//!
//! The catalog uses each [`Conn`]'s scratch region from offset 0 (at least
//! [`MIN_SCRATCH`] bytes); `conns[s]` must be connected to server s.

use crate::conn::Conn;
use crate::index::IndexShape;
use crate::layout::{BlockShape, LayoutError};
use fabric::{FabricError, RemoteAddr, RemoteRegion, SendWr};
use std::time::{Duration, Instant};
use thiserror::Error;
use timestamp::{Layout, OracleError};

/// `"NAMDBCAT"` as a little-endian word.
pub const MAGIC: u64 = u64::from_le_bytes(*b"NAMDBCAT");
/// Bumped whenever the encoding of any catalog word changes.
pub const VERSION: u64 = 3;
/// The longest table name, in bytes.
pub const MAX_NAME: usize = 64;
/// The most partitions a table has.
pub const MAX_PARTITIONS: u32 = 32;
/// The most data regions a server may have (the memory server's own limit).
pub const MAX_DATA_REGIONS: usize = 4096;
/// Bytes of a connection's scratch region the catalog needs.
pub const MIN_SCRATCH: u64 = 8 << 10;
/// Allocations start on 64-byte boundaries (a cache line: neighbours' atomics do not
/// share one).
pub const ALIGN: u64 = 64;
/// Bytes of a `catalog` region: the header page, the allocation cursors and 960
/// table entries (memory servers export 1 MiB).
pub const CATALOG_BYTES: u64 = 1 << 20;

const HEADER_PAGE: u64 = 4096;
const STATE: u64 = 0;
const RECORDS: u64 = 64;
/// In every server's header page but server 0's: which cluster the server belongs to
/// (two words: `MEMBER_TAG | index` and the cluster's identity), so that a server is
/// never bootstrapped into a second cluster, nor listed at another position.
const MEMBER: u64 = 2048;
const MEMBER_TAG: u64 = u64::from_le_bytes(*b"\0\0\0\0MEMB");
/// In server 0's catalog region: the cluster's identity, fixed by CAS from zero by the
/// first bootstrap attempt that claims members (a takeover keeps it). A random token
/// rather than where server 0's catalog is, which changes when a durable server
/// restarts.
const CLUSTER_ID: u64 = 4096;
const MEMBER_INDEX: u64 = (1 << 32) - 1;
const RECORD_WORDS: usize = 8;
const MAX_ATTEMPTS: u64 = 8;
const CURSORS: u64 = 32 << 10;
const TABLES: u64 = 64 << 10;
const ENTRY_BYTES: u64 = 1024;
const ENTRY_WORDS: usize = (ENTRY_BYTES / 8) as usize;
const ENTRIES_PER_READ: u64 = 4;
const NAME_WORDS: usize = MAX_NAME / 8;
const W_NAME_LEN: usize = 1;
const W_NAME: usize = 2;
const W_SHAPE: usize = W_NAME + NAME_WORDS;
const W_CAPACITY: usize = W_SHAPE + 1;
const W_PARTITIONS: usize = W_CAPACITY + 1;
const W_PER_PART: usize = W_PARTITIONS + 1;
const W_BUCKETS: usize = W_PER_PART + 1;
const W_SLOTS: usize = W_BUCKETS + 1;
const W_CHECKSUM: usize = W_SLOTS + 1;
const W_PARTS: usize = W_CHECKSUM + 1;
const PART_WORDS: usize = 3;
const _: () = assert!(W_PARTS + PART_WORDS * MAX_PARTITIONS as usize <= ENTRY_WORDS);
const _: () = assert!(RECORDS + MAX_ATTEMPTS * RECORD_WORDS as u64 * 8 <= HEADER_PAGE);
const _: () = assert!(CURSORS + MAX_DATA_REGIONS as u64 * 8 <= TABLES);

/// Between polls of a word another node is expected to change.
const POLL: Duration = Duration::from_micros(50);

#[derive(Debug, Error)]
pub enum CatalogError {
    #[error("not a namdb catalog: {0}")]
    NotACatalog(String),
    #[error(
        "catalog version mismatch: the catalog has version {found}, this node speaks {expected}"
    )]
    VersionMismatch { found: u64, expected: u64 },
    #[error("the catalog is corrupt: {0}")]
    Corrupt(String),
    #[error("the catalog describes {catalog} memory servers, this node was given {given}")]
    ClusterMismatch { catalog: u64, given: usize },
    #[error(
        "catalog bootstrap by node {token:#x} (attempt {attempt}) made no progress for {waited:?}, and all {MAX_ATTEMPTS} takeovers are used up: the bootstrapping nodes died; re-create server 0's catalog region"
    )]
    BootstrapStalled {
        token: u64,
        attempt: u64,
        waited: Duration,
    },
    #[error(
        "this node's catalog bootstrap (attempt {attempt}) stalled and was taken over by another node"
    )]
    BootstrapLost { attempt: u64 },
    #[error(
        "memory server {index} ({what}): list the memory servers in the order of the cluster they were set up in, and do not share a server between clusters"
    )]
    Membership { index: usize, what: String },
    #[error(
        "memory server 0 no longer holds the cluster this node opened ({why}): a memory \
         server restarted without a data directory (--data-dir) loses what it held, so \
         the cluster's data is gone; bring the cluster up anew"
    )]
    ClusterLost { why: String },
    #[error("invalid: {0}")]
    Invalid(String),
    #[error("table {} exists", crate::echo(.0))]
    TableExists(String),
    #[error("table {} not found", crate::echo(.0))]
    NotFound(String),
    #[error("the catalog is full: {0} tables")]
    CatalogFull(u32),
    #[error(
        "memory server {server} has no room for {}: the roomiest of its {regions} data regions has {free} bytes free",
        room_wanted(.partitions, .bytes)
    )]
    ServerFull {
        server: u32,
        /// One allocation (a partition's arena and index), rounded up to [`ALIGN`].
        bytes: u64,
        /// How many of them the server was to hold (a table may put several
        /// partitions on one server).
        partitions: u32,
        regions: usize,
        /// The most free bytes in one of its data regions when it was checked.
        free: u64,
    },
    #[error(
        "the creation of table {0} stalled and was abandoned by another node; nothing was created, retry"
    )]
    CreateLost(String),
    #[error(transparent)]
    Layout(#[from] LayoutError),
    #[error("oracle: {0}")]
    Oracle(#[from] OracleError),
    #[error("fabric: {0}")]
    Fabric(#[from] FabricError),
}

pub type Result<T, E = CatalogError> = std::result::Result<T, E>;

fn room_wanted(partitions: &u32, bytes: &u64) -> String {
    match partitions {
        1 => format!("{bytes} bytes"),
        n => format!("{n} partitions of {bytes} bytes each"),
    }
}

/// One memory server as a compute node knows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerRegions {
    /// Its `catalog` region.
    pub catalog: RemoteRegion,
    /// Its `data.0`, `data.1`, … regions, in order.
    pub data: Vec<RemoteRegion>,
}

#[derive(Clone, Debug)]
pub struct CatalogOptions {
    /// V of the oracle, if this node bootstraps the catalog.
    pub oracle_bits: u64,
    /// S of the oracle (the most compute threads holding a slot at once), likewise.
    pub oracle_slots: u32,
    /// Bytes of each slot's commit-log area (a multiple of 1 KiB, at least
    /// [`crate::commitlog::MIN_AREA_BYTES`]), likewise.
    pub log_bytes_per_slot: u64,
    /// How long a node waits for another node's bootstrap or table creation to make
    /// progress before it takes the work over (it must be far above how long those
    /// take: a few round trips).
    pub wait: Duration,
    /// The cluster the servers must hold (see [`crate::Options::cluster`]).
    pub cluster: Option<u64>,
}

impl Default for CatalogOptions {
    fn default() -> Self {
        CatalogOptions {
            oracle_bits: timestamp::DEFAULT_BITS,
            oracle_slots: 64,
            log_bytes_per_slot: crate::commitlog::DEFAULT_AREA_BYTES,
            wait: Duration::from_secs(10),
            cluster: None,
        }
    }
}

/// Where the timestamp oracle is: `layout.region_bytes()` bytes at `offset` in `data`,
/// data region `region` of server 0. Open it with
/// `timestamp::SlotHandle::register_at(…, data, offset, …)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OracleLocation {
    pub server: u32,
    pub region: u32,
    pub data: RemoteRegion,
    pub offset: u64,
    pub layout: Layout,
}

/// Space handed out by [`Catalog::allocate`]: `[offset, offset + bytes)` of `data`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Allocation {
    pub server: u32,
    pub region: u32,
    pub data: RemoteRegion,
    pub offset: u64,
    /// The size asked for, rounded up to [`ALIGN`].
    pub bytes: u64,
}

/// Which server each partition goes to.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub enum Placement {
    /// Partition p of table `id` on server `(id + p) mod N`: partitions spread over
    /// the servers, and tables' first partitions too.
    #[default]
    RoundRobin,
    /// Partition p on server `servers[p]`.
    Servers(Vec<u32>),
}

/// What [`Catalog::create_table`] creates.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TableSpec {
    /// 1..=64 bytes.
    pub name: String,
    pub versions: u32,
    pub value_cap: u32,
    /// Blocks, over all partitions.
    pub capacity: u64,
    pub partitions: u32,
    /// The index of each partition.
    pub index: IndexShape,
    pub placement: Placement,
}

impl TableSpec {
    /// A table of `capacity` records of up to `value_cap` bytes, keeping 4 versions, one
    /// partition per memory server (`partitions: 0`, resolved when the table is
    /// created), with an index of 16-slot buckets at two records per bucket on average
    /// (a bucket overflows with probability ~1e-10).
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
            placement: Placement::RoundRobin,
        }
    }

    /// Blocks the table's arenas take over all partitions (see
    /// [`blocks_per_partition`]) when created on `servers` memory servers.
    pub fn blocks_on(&self, servers: u32) -> u64 {
        let partitions = match self.partitions {
            0 => servers.max(1),
            p => p,
        };
        blocks_per_partition(self.capacity, partitions).saturating_mul(u64::from(partitions))
    }
}

/// Blocks each of `partitions` partitions gets for a table of `capacity` records.
/// Keys go to partitions by hash, so `capacity` distinct keys do not split evenly:
/// an even share, `ceil(capacity / partitions)`, made a table of 16384 refuse inserts
/// (`TableFull`) at about 16200 keys. Each partition gets four standard deviations
/// of the binomial count over its even share (3% at 16384 keys over 2 partitions), so
/// that `capacity` keys fit but for odds of about 3e-5 per partition.
pub fn blocks_per_partition(capacity: u64, partitions: u32) -> u64 {
    let p = u64::from(partitions.max(1));
    let share = capacity.div_ceil(p);
    if p == 1 {
        return share;
    }
    let mean = capacity as f64 / p as f64;
    let sd = (mean * (1.0 - 1.0 / p as f64)).sqrt();
    share.saturating_add((4.0 * sd).ceil() as u64 + 1)
}

/// A table as the catalog describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TableDef {
    pub id: u32,
    pub name: String,
    pub shape: BlockShape,
    /// Records it was made for (each partition has [`blocks_per_partition`] blocks).
    pub capacity: u64,
    pub partitions: Vec<PartitionDef>,
}

/// One partition: its arena and its index, both in `data` on server `server`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PartitionDef {
    pub server: u32,
    /// The index of `data` among the server's data regions.
    pub region: u32,
    pub data: RemoteRegion,
    /// The arena's bump counter word (blocks handed out); blocks follow it.
    pub arena_offset: u64,
    /// Blocks the arena holds.
    pub capacity: u64,
    pub index_offset: u64,
    pub index: IndexShape,
}

impl PartitionDef {
    /// The offset in `data` of block `i` of a table of `shape`.
    pub fn block_offset(&self, shape: BlockShape, i: u64) -> u64 {
        self.arena_offset + 8 + i * shape.block_bytes()
    }
}

impl TableDef {
    pub fn versions(&self) -> u32 {
        self.shape.versions
    }
    pub fn value_cap(&self) -> u32 {
        self.shape.value_cap
    }
}

/// A compute node's handle on the catalog: the cluster it was opened with, the oracle
/// location, and the node's token (which names its claims).
#[derive(Clone, Debug)]
pub struct Catalog {
    cluster_id: u64,
    servers: Vec<ServerRegions>,
    oracle: OracleLocation,
    log: crate::commitlog::LogLocation,
    token: u64,
    wait: Duration,
}

// ---- word encodings ----

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Empty,
    Init { attempt: u64, token: u64 },
    Ready { attempt: u64, token: u64 },
}

const TOKEN56: u64 = (1 << 56) - 1;

fn encode_state(s: State) -> u64 {
    match s {
        State::Empty => 0,
        State::Init { attempt, token } => 1 << 62 | attempt << 56 | token & TOKEN56,
        State::Ready { attempt, token } => 2 << 62 | attempt << 56 | token & TOKEN56,
    }
}

fn decode_state(w: u64) -> Result<State> {
    let (attempt, token) = ((w >> 56) & 0x3f, w & TOKEN56);
    match w >> 62 {
        0 if w == 0 => Ok(State::Empty),
        1 if attempt < MAX_ATTEMPTS => Ok(State::Init { attempt, token }),
        2 if attempt < MAX_ATTEMPTS => Ok(State::Ready { attempt, token }),
        _ => Err(CatalogError::NotACatalog(format!(
            "state word {w:#018x} is no catalog state"
        ))),
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Claim {
    Free,
    Claimed,
    Complete,
    Abandoned,
}

const HASH_MASK: u64 = (1 << 30) - 1;

fn encode_claim(kind: Claim, hash: u64, token: u64) -> u64 {
    let k = match kind {
        Claim::Free => return 0,
        Claim::Claimed => 1u64,
        Claim::Complete => 2,
        Claim::Abandoned => 3,
    };
    k << 62 | (hash & HASH_MASK) << 32 | (token & 0xffff_ffff)
}

fn claim_kind(w: u64) -> Claim {
    match w >> 62 {
        _ if w == 0 => Claim::Free,
        1 => Claim::Claimed,
        2 => Claim::Complete,
        // A nonzero word of kind 0 is garbage; treated as abandoned it is skipped,
        // and a garbage entry that claims to be complete fails validation.
        _ => Claim::Abandoned,
    }
}

fn claim_hash(w: u64) -> u64 {
    (w >> 32) & HASH_MASK
}

/// FNV-1a of the name, folded to the claim word's 30 bits.
fn name_hash(name: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    (h ^ h >> 30 ^ h >> 60) & HASH_MASK
}

fn checksum(words: &[u64]) -> u64 {
    let mut h: u64 = 0x9e37_79b9_7f4a_7c15;
    for (i, &w) in words.iter().enumerate() {
        let w = if i + 1 == W_CHECKSUM { 0 } else { w };
        h = (h ^ w).rotate_left(23).wrapping_mul(0xbf58_476d_1ce4_e5b9) ^ i as u64;
    }
    h
}

/// A token that names this node's claims: random per call, never 0 in its low 32 or
/// 56 bits.
fn fresh_token() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    h.write_u32(std::process::id());
    if let Ok(t) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
        h.write_u128(t.as_nanos());
    }
    h.finish() | 1
}

// ---- verbs on a Conn ----

fn read_words(conn: &mut Conn, at: RemoteAddr, words: usize) -> Result<Vec<u64>> {
    let bytes = words as u64 * 8;
    if bytes > conn.scratch().len() {
        return Err(CatalogError::Invalid(format!(
            "a read of {bytes} bytes does not fit the connection's scratch region"
        )));
    }
    let local = conn.scratch().buf(0, bytes as u32);
    conn.run(&mut [SendWr::read(0, local, at)])?;
    let mut out = vec![0u64; words];
    conn.scratch().read_words(0, &mut out)?;
    Ok(out)
}

/// CAS; returns the old value (the swap happened iff it equals `compare`).
fn cas(conn: &mut Conn, at: RemoteAddr, compare: u64, swap: u64) -> Result<u64> {
    Ok(conn.cas(at, compare, swap)?)
}

fn to_bytes(words: &[u64]) -> Vec<u8> {
    words.iter().flat_map(|w| w.to_le_bytes()).collect()
}

/// WRITEs `words` at `at`, through the scratch region, a scratch-full per doorbell.
fn write_words(conn: &mut Conn, at: RemoteAddr, words: &[u64]) -> Result<()> {
    Ok(conn.write_bytes(at, &to_bytes(words))?)
}

/// WRITEs `words` at `at`, then CASes `word` — one doorbell, executed in that order —
/// and returns the CAS's old value: the publish step of bootstrap and table creation.
fn write_then_cas(
    conn: &mut Conn,
    at: RemoteAddr,
    words: &[u64],
    word: RemoteAddr,
    compare: u64,
    swap: u64,
) -> Result<u64> {
    let bytes = words.len() as u64 * 8;
    if bytes + 8 > conn.scratch().len() {
        return Err(CatalogError::Invalid(format!(
            "a write of {bytes} bytes does not fit the connection's scratch region"
        )));
    }
    conn.scratch().write(8, &to_bytes(words))?;
    let (data, result) = (
        conn.scratch().buf(8, bytes as u32),
        conn.scratch().buf(0, 8),
    );
    conn.run(&mut [
        SendWr::write(0, data, at),
        SendWr::cas(0, result, word, compare, swap),
    ])?;
    Ok(conn.scratch().load_u64(0)?)
}

fn round_up(bytes: u64) -> Option<u64> {
    bytes.checked_next_multiple_of(ALIGN)
}

fn check_conns(conns: &[Conn], servers: &[ServerRegions]) -> Result<()> {
    if conns.len() != servers.len() {
        return Err(CatalogError::Invalid(format!(
            "{} connections for {} memory servers",
            conns.len(),
            servers.len()
        )));
    }
    if let Some(s) = conns.iter().position(|c| c.scratch().len() < MIN_SCRATCH) {
        return Err(CatalogError::Invalid(format!(
            "the connection to server {s} has a scratch region below {MIN_SCRATCH} bytes"
        )));
    }
    Ok(())
}

// ---- allocation ----

fn cursor_at(servers: &[ServerRegions], server: u32, region: u32) -> RemoteAddr {
    servers[server as usize]
        .catalog
        .at(CURSORS + region as u64 * 8)
}

/// One step of allocation: CAS data region `region`'s cursor from `seen` to
/// `seen + size`; the old value (the step won iff it equals `seen`).
fn try_bump(
    conns: &mut [Conn],
    servers: &[ServerRegions],
    server: u32,
    region: u32,
    seen: u64,
    size: u64,
) -> Result<u64> {
    let at = cursor_at(servers, server, region);
    cas(&mut conns[server as usize], at, seen, seen + size)
}

fn allocate(
    conns: &mut [Conn],
    servers: &[ServerRegions],
    server: u32,
    bytes: u64,
) -> Result<Allocation> {
    let s = servers.get(server as usize).ok_or_else(|| {
        CatalogError::Invalid(format!("server {server} of a cluster of {}", servers.len()))
    })?;
    let size = match round_up(bytes) {
        Some(size) if bytes > 0 => size,
        _ => {
            return Err(CatalogError::Invalid(format!(
                "cannot allocate {bytes} bytes"
            )));
        }
    };
    let mut free = 0;
    for (r, data) in s.data.iter().enumerate() {
        let region = r as u32;
        let at = cursor_at(servers, server, region);
        let mut cursor = read_words(&mut conns[server as usize], at, 1)?[0];
        loop {
            check_cursor(server, r, cursor, data)?;
            if data.len - cursor < size {
                free = free.max(data.len - cursor);
                break;
            }
            let old = try_bump(conns, servers, server, region, cursor, size)?;
            if old == cursor {
                return Ok(Allocation {
                    server,
                    region,
                    data: *data,
                    offset: cursor,
                    bytes: size,
                });
            }
            cursor = old;
        }
    }
    Err(CatalogError::ServerFull {
        server,
        bytes: size,
        partitions: 1,
        regions: s.data.len(),
        free,
    })
}

fn check_cursor(server: u32, region: usize, cursor: u64, data: &RemoteRegion) -> Result<()> {
    if !cursor.is_multiple_of(ALIGN) || cursor > data.len {
        return Err(CatalogError::Corrupt(format!(
            "the cursor of server {server} data.{region} is {cursor}, in a region of {} bytes",
            data.len
        )));
    }
    Ok(())
}

/// The cursors of server `server`'s data regions, in order (a scratch-full per READ).
fn read_cursors(conn: &mut Conn, servers: &[ServerRegions], server: u32) -> Result<Vec<u64>> {
    let regions = servers[server as usize].data.len();
    let per_read = (conn.scratch().len() / 8) as usize;
    let mut out = Vec::with_capacity(regions);
    while out.len() < regions {
        let n = per_read.min(regions - out.len());
        let at = cursor_at(servers, server, out.len() as u32);
        out.extend(read_words(conn, at, n)?);
    }
    for (r, (&cursor, data)) in out.iter().zip(&servers[server as usize].data).enumerate() {
        check_cursor(server, r, cursor, data)?;
    }
    Ok(out)
}

/// Whether `count` allocations of `size` bytes (rounded) each would fit server
/// `server` as its cursors are now, placed as [`allocate`] places them (each in the
/// first region with room): `ServerFull` if not. Only reads: a creation refused here
/// has allocated nothing, not even on the servers that have room.
fn check_room(
    conns: &mut [Conn],
    servers: &[ServerRegions],
    server: u32,
    count: u32,
    size: u64,
) -> Result<()> {
    let mut cursors = read_cursors(&mut conns[server as usize], servers, server)?;
    let data = &servers[server as usize].data;
    let roomiest = cursors
        .iter()
        .zip(data)
        .map(|(c, d)| d.len - c)
        .max()
        .unwrap_or(0);
    for _ in 0..count {
        match cursors
            .iter_mut()
            .zip(data)
            .find(|(c, d)| d.len - **c >= size)
        {
            Some((c, _)) => *c += size,
            None => {
                return Err(CatalogError::ServerFull {
                    server,
                    bytes: size,
                    partitions: count,
                    regions: data.len(),
                    free: roomiest,
                });
            }
        }
    }
    Ok(())
}

/// Allocates `size` bytes on each server of `placement` (one allocation per entry),
/// all or nothing: every server's room is checked first ([`check_room`]), so a
/// creation that does not fit allocates nothing; if a concurrent allocation takes the
/// room between the check and an allocation, the ones already made are given back
/// ([`untake`]) before the error returns.
fn reserve(
    conns: &mut [Conn],
    servers: &[ServerRegions],
    placement: &[u32],
    size: u64,
) -> Result<Vec<Allocation>> {
    let mut counts = std::collections::BTreeMap::<u32, u32>::new();
    for &s in placement {
        *counts.entry(s).or_default() += 1;
    }
    for (&server, &count) in &counts {
        check_room(conns, servers, server, count, size)?;
    }
    let mut spaces = Vec::with_capacity(placement.len());
    for &server in placement {
        match allocate(conns, servers, server, size) {
            Ok(space) => spaces.push(space),
            Err(e) => {
                untake(conns, servers, &spaces);
                return Err(match e {
                    CatalogError::ServerFull {
                        server,
                        bytes,
                        regions,
                        free,
                        ..
                    } => CatalogError::ServerFull {
                        server,
                        bytes,
                        partitions: counts[&server],
                        regions,
                        free,
                    },
                    e => e,
                });
            }
        }
    }
    Ok(spaces)
}

/// Gives back `spaces` of a creation that failed before anyone could learn of them
/// (never published): each region's cursor is moved back over its space by a CAS
/// from the space's end to its start, last allocation first, so it succeeds exactly
/// while nothing was allocated after it. Nothing is zeroed: the catalog never writes
/// into a table's space, only the table's users do once it is published, so the
/// space is still as zero as it was past the cursor.
/// Space that cannot be given back stays allocated, unused (it leaks, as before).
/// Best effort: errors are ignored, the creation's own error is what matters.
fn untake(conns: &mut [Conn], servers: &[ServerRegions], spaces: &[Allocation]) {
    for space in spaces.iter().rev() {
        let at = cursor_at(servers, space.server, space.region);
        let end = space.offset + space.bytes;
        let _ = cas(&mut conns[space.server as usize], at, end, space.offset);
    }
}

// ---- bootstrap ----

fn record_at(c0: &RemoteRegion, attempt: u64) -> RemoteAddr {
    c0.at(RECORDS + attempt * RECORD_WORDS as u64 * 8)
}

/// The header page may hold, besides the state word, only the records of attempts up
/// to `attempt`: anything else means the region is not a (fresh) catalog.
fn check_clean(page: &[u64], attempt: Option<u64>) -> Result<()> {
    let records = RECORDS as usize / 8;
    let upto = attempt.map_or(0, |a| (a as usize + 1) * RECORD_WORDS);
    let dirty = page
        .iter()
        .enumerate()
        .skip(1)
        .any(|(i, &w)| w != 0 && !(records..records + upto).contains(&i));
    if dirty {
        return Err(CatalogError::NotACatalog(
            "the header holds data that no bootstrap wrote".into(),
        ));
    }
    Ok(())
}

/// The membership words server `index` of the cluster `id` carries.
fn membership(id: u64, index: usize) -> [u64; 2] {
    [MEMBER_TAG | index as u64, id]
}

/// Marks servers 1.. as members of this cluster, by CAS from zero (a takeover of a
/// stalled bootstrap finds its predecessor's identical marks). A server that belongs
/// to another cluster, or to this one at another position, stops the bootstrap.
fn claim_members(conns: &mut [Conn], servers: &[ServerRegions], token: u64) -> Result<()> {
    let id_at = servers[0].catalog.at(CLUSTER_ID);
    let id = match cas(&mut conns[0], id_at, 0, token)? {
        0 => token,
        earlier => earlier,
    };
    for (index, srv) in servers.iter().enumerate().skip(1) {
        let want = membership(id, index);
        for (i, w) in want.iter().enumerate() {
            let at = srv.catalog.at(MEMBER + 8 * i as u64);
            let old = cas(&mut conns[index], at, 0, *w)?;
            if old != 0 && old != *w {
                return Err(CatalogError::Membership {
                    index,
                    what:
                        "it already belongs to another cluster, or to this one at another position"
                            .into(),
                });
            }
        }
    }
    Ok(())
}

/// Checks that servers 1.. are this cluster's, at the positions given.
fn check_members(conns: &mut [Conn], servers: &[ServerRegions]) -> Result<()> {
    let id = read_words(&mut conns[0], servers[0].catalog.at(CLUSTER_ID), 1)?[0];
    for (index, srv) in servers.iter().enumerate().skip(1) {
        let got = read_words(&mut conns[index], srv.catalog.at(MEMBER), 2)?;
        if got[..] != membership(id, index)[..] {
            return Err(CatalogError::Membership {
                index,
                what: if got[0] == 0 {
                    "it holds no cluster: it restarted without a data directory (--data-dir), \
                     losing what it held, or it was never part of this one"
                        .into()
                } else {
                    format!(
                        "it is server {} of {} cluster",
                        got[0] & MEMBER_INDEX,
                        if got[1] == id { "this" } else { "another" }
                    )
                },
            });
        }
    }
    Ok(())
}

impl Catalog {
    pub fn cluster_id(&self) -> u64 {
        self.cluster_id
    }
}

/// One step of bootstrap: CAS the state word from `seen` to `next`; the old value.
fn try_state(conn: &mut Conn, c0: &RemoteRegion, seen: u64, next: State) -> Result<u64> {
    cas(conn, c0.at(STATE), seen, encode_state(next))
}

fn parse_record(
    rec: &[u64],
    servers: &[ServerRegions],
    attempt: u64,
    token: u64,
) -> Result<(OracleLocation, crate::commitlog::LogLocation)> {
    if rec[0] != MAGIC {
        return Err(CatalogError::NotACatalog(format!(
            "magic {:#018x} in the record of attempt {attempt}",
            rec[0]
        )));
    }
    if rec[1] != VERSION {
        return Err(CatalogError::VersionMismatch {
            found: rec[1],
            expected: VERSION,
        });
    }
    if rec[2] != servers.len() as u64 {
        return Err(CatalogError::ClusterMismatch {
            catalog: rec[2],
            given: servers.len(),
        });
    }
    if rec[3] != token {
        return Err(CatalogError::Corrupt(format!(
            "the record of attempt {attempt} names token {:#x}, the state word {token:#x}",
            rec[3]
        )));
    }
    let data = usize::try_from(rec[4])
        .ok()
        .and_then(|r| servers[0].data.get(r))
        .ok_or_else(|| {
            CatalogError::Corrupt(format!(
                "the oracle is in data.{}, which server 0 lacks",
                rec[4]
            ))
        })?;
    let slots = u32::try_from(rec[7] & u32::MAX as u64)
        .map_err(|_| CatalogError::Corrupt(format!("oracle slots {}", rec[7])))?;
    let log_area = (rec[7] >> 32) << 10;
    let layout = Layout::new(rec[6], slots)
        .map_err(|e| CatalogError::Corrupt(format!("oracle shape: {e}")))?;
    let offset = rec[5];
    let log = crate::commitlog::LogLocation::after_oracle(*data, offset, &layout, log_area)
        .map_err(CatalogError::Corrupt)?;
    if !offset.is_multiple_of(ALIGN)
        || offset
            .checked_add(layout.region_bytes())
            .and_then(|end| end.checked_add(log.bytes()))
            .is_none_or(|end| end > data.len)
    {
        return Err(CatalogError::Corrupt(format!(
            "the oracle at {offset} does not fit data.{} of {} bytes",
            rec[4], data.len
        )));
    }
    Ok((
        OracleLocation {
            server: 0,
            region: rec[4] as u32,
            data: *data,
            offset,
            layout,
        },
        log,
    ))
}

impl Catalog {
    /// Opens the catalog of the cluster `servers` (server 0's catalog region is the
    /// catalog), bootstrapping it if it is empty: exactly one node bootstraps, the
    /// others wait for it (and take over if it makes no progress for `options.wait`).
    /// `conns[s]` is a connection to server s.
    pub fn open(
        conns: &mut [Conn],
        servers: Vec<ServerRegions>,
        options: &CatalogOptions,
    ) -> Result<Catalog> {
        if servers.is_empty() || servers.len() > u32::MAX as usize {
            return Err(CatalogError::Invalid(format!(
                "a cluster of {} memory servers",
                servers.len()
            )));
        }
        check_conns(conns, &servers)?;
        for (s, srv) in servers.iter().enumerate() {
            if srv.data.len() > MAX_DATA_REGIONS {
                return Err(CatalogError::Invalid(format!(
                    "server {s} has {} data regions, at most {MAX_DATA_REGIONS} are supported",
                    srv.data.len()
                )));
            }
            if srv.catalog.len < TABLES + ENTRY_BYTES {
                return Err(CatalogError::Invalid(format!(
                    "server {s}'s catalog region has {} bytes, at least {} are needed",
                    srv.catalog.len,
                    TABLES + ENTRY_BYTES
                )));
            }
        }
        let token = fresh_token();
        let c0 = servers[0].catalog;
        // The state word last seen in `Init`, and since when.
        let mut watching: Option<(u64, Instant)> = None;
        loop {
            let page = read_words(&mut conns[0], c0.at(0), (HEADER_PAGE / 8) as usize)?;
            let member = (MEMBER / 8) as usize;
            if page[member] & !MEMBER_INDEX == MEMBER_TAG {
                return Err(CatalogError::Membership {
                    index: 0,
                    what: format!(
                        "listed first, it is server {} of another cluster",
                        page[member] & MEMBER_INDEX
                    ),
                });
            }
            let next = match decode_state(page[0])? {
                State::Ready { attempt, token: t } => {
                    // Read again, after having seen `ready`: the record is complete
                    // by then, whatever order the first READ's bytes arrived in.
                    let rec = read_words(&mut conns[0], record_at(&c0, attempt), RECORD_WORDS)?;
                    let (oracle, log) = parse_record(&rec, &servers, attempt, t)?;
                    let cluster_id = read_words(&mut conns[0], c0.at(CLUSTER_ID), 1)?[0];
                    if let Some(expected) = options.cluster
                        && expected != cluster_id
                    {
                        return Err(CatalogError::ClusterLost {
                            why: "it holds another cluster".into(),
                        });
                    }
                    check_members(conns, &servers)?;
                    return Ok(Catalog {
                        cluster_id,
                        servers,
                        oracle,
                        log,
                        token,
                        wait: options.wait,
                    });
                }
                State::Empty if options.cluster.is_some() => {
                    return Err(CatalogError::ClusterLost {
                        why: "it holds no cluster".into(),
                    });
                }
                State::Empty => {
                    check_clean(&page, None)?;
                    State::Init { attempt: 0, token }
                }
                State::Init { attempt, token: t } => {
                    check_clean(&page, Some(attempt))?;
                    match watching {
                        Some((w, since)) if w == page[0] => {
                            if since.elapsed() < options.wait {
                                std::thread::sleep(POLL);
                                continue;
                            }
                            if attempt + 1 >= MAX_ATTEMPTS {
                                return Err(CatalogError::BootstrapStalled {
                                    token: t,
                                    attempt,
                                    waited: since.elapsed(),
                                });
                            }
                            State::Init {
                                attempt: attempt + 1,
                                token,
                            }
                        }
                        _ => {
                            watching = Some((page[0], Instant::now()));
                            continue;
                        }
                    }
                }
            };
            if try_state(&mut conns[0], &c0, page[0], next)? == page[0] {
                let State::Init { attempt, .. } = next else {
                    unreachable!("only initializing states are claimed")
                };
                let (oracle, log) = Self::bootstrap(conns, &servers, options, attempt, token)?;
                let cluster_id = read_words(&mut conns[0], c0.at(CLUSTER_ID), 1)?[0];
                return Ok(Catalog {
                    cluster_id,
                    servers,
                    oracle,
                    log,
                    token,
                    wait: options.wait,
                });
            }
        }
    }

    /// The bootstrap of attempt `attempt`, whose `initializing` state this node holds.
    fn bootstrap(
        conns: &mut [Conn],
        servers: &[ServerRegions],
        options: &CatalogOptions,
        attempt: u64,
        token: u64,
    ) -> Result<(OracleLocation, crate::commitlog::LogLocation)> {
        claim_members(conns, servers, token)?;
        let layout = Layout::new(options.oracle_bits, options.oracle_slots)?;
        let area = options.log_bytes_per_slot;
        if area < crate::commitlog::MIN_AREA_BYTES
            || !area.is_multiple_of(1024)
            || area >> 10 > u32::MAX as u64
        {
            return Err(CatalogError::Invalid(format!(
                "a commit-log area of {area} bytes per slot: it must be a multiple of 1 KiB and at least {}",
                crate::commitlog::MIN_AREA_BYTES
            )));
        }
        let log_bytes = area * options.oracle_slots as u64;
        let oracle_bytes = round_up(layout.region_bytes())
            .ok_or_else(|| CatalogError::Invalid("the oracle is too large".into()))?;
        let space = allocate(conns, servers, 0, oracle_bytes + log_bytes)?;
        write_words(&mut conns[0], space.data.at(space.offset), &layout.image())?;
        let record = [
            MAGIC,
            VERSION,
            servers.len() as u64,
            token & TOKEN56,
            space.region as u64,
            space.offset,
            layout.bits(),
            layout.slots() as u64 | (area >> 10) << 32,
        ];
        let c0 = servers[0].catalog;
        let init = encode_state(State::Init { attempt, token });
        let ready = encode_state(State::Ready { attempt, token });
        let old = write_then_cas(
            &mut conns[0],
            record_at(&c0, attempt),
            &record,
            c0.at(STATE),
            init,
            ready,
        )?;
        if old != init {
            return Err(CatalogError::BootstrapLost { attempt });
        }
        let log =
            crate::commitlog::LogLocation::after_oracle(space.data, space.offset, &layout, area)
                .map_err(CatalogError::Invalid)?;
        Ok((
            OracleLocation {
                server: 0,
                region: space.region,
                data: space.data,
                offset: space.offset,
                layout,
            },
            log,
        ))
    }

    pub fn oracle(&self) -> OracleLocation {
        self.oracle
    }

    /// Where the slots' commit-log areas are.
    pub fn commit_log(&self) -> crate::commitlog::LogLocation {
        self.log
    }

    pub fn servers(&self) -> &[ServerRegions] {
        &self.servers
    }

    /// `bytes` (rounded up to [`ALIGN`]) of server `server`, from the first of its
    /// data regions with room; never overlapping another allocation.
    pub fn allocate(&self, conns: &mut [Conn], server: u32, bytes: u64) -> Result<Allocation> {
        check_conns(conns, &self.servers)?;
        allocate(conns, &self.servers, server, bytes)
    }

    fn max_tables(&self) -> u64 {
        ((self.servers[0].catalog.len - TABLES) / ENTRY_BYTES).min(u32::MAX as u64)
    }

    fn entry_at(&self, id: u64) -> RemoteAddr {
        self.servers[0].catalog.at(TABLES + id * ENTRY_BYTES)
    }

    /// Entries `first..` (up to [`ENTRIES_PER_READ`] of them) in one READ.
    fn read_entries(&self, conn: &mut Conn, first: u64) -> Result<Vec<Vec<u64>>> {
        let count = ENTRIES_PER_READ.min(self.max_tables() - first);
        let words = read_words(conn, self.entry_at(first), count as usize * ENTRY_WORDS)?;
        Ok(words.chunks(ENTRY_WORDS).map(<[u64]>::to_vec).collect())
    }

    /// A complete entry, decoded; a torn read (checksum mismatch) is read once more on
    /// its own, since the body was complete before the claim word said so.
    fn decode_complete(&self, conn: &mut Conn, id: u64, words: &[u64]) -> Result<TableDef> {
        match decode_entry(id, words, &self.servers) {
            Err(CatalogError::Corrupt(_)) => {
                let again = read_words(conn, self.entry_at(id), ENTRY_WORDS)?;
                decode_entry(id, &again, &self.servers)
            }
            other => other,
        }
    }

    /// Every complete table, in id order.
    pub fn tables(&self, conns: &mut [Conn]) -> Result<Vec<TableDef>> {
        check_conns(conns, &self.servers)?;
        let mut out = Vec::new();
        let mut id = 0;
        'scan: while id < self.max_tables() {
            for words in self.read_entries(&mut conns[0], id)? {
                match claim_kind(words[0]) {
                    // Claimed entries are a prefix: the first free one ends them.
                    Claim::Free => break 'scan,
                    Claim::Complete => out.push(self.decode_complete(&mut conns[0], id, &words)?),
                    Claim::Claimed | Claim::Abandoned => {}
                }
                id += 1;
            }
        }
        Ok(out)
    }

    /// The complete table called `name`.
    pub fn table(&self, conns: &mut [Conn], name: &str) -> Result<TableDef> {
        check_conns(conns, &self.servers)?;
        let hash = name_hash(name);
        let mut id = 0;
        'scan: while id < self.max_tables() {
            for words in self.read_entries(&mut conns[0], id)? {
                match claim_kind(words[0]) {
                    Claim::Free => break 'scan,
                    Claim::Complete if claim_hash(words[0]) == hash => {
                        let def = self.decode_complete(&mut conns[0], id, &words)?;
                        if def.name == name {
                            return Ok(def);
                        }
                    }
                    _ => {}
                }
                id += 1;
            }
        }
        Err(CatalogError::NotFound(name.into()))
    }

    /// One step of creation: CAS entry `id`'s claim word from `seen` to `next`; the old
    /// value.
    fn try_claim(&self, conn: &mut Conn, id: u64, seen: u64, next: u64) -> Result<u64> {
        cas(conn, self.entry_at(id), seen, next)
    }

    /// The first free entry from `from` on, for a creation of `name`, after checking
    /// every entry before it of the same name hash (see the module doc): a complete one
    /// of that name is `TableExists`, an in-progress one is waited for (and abandoned
    /// once stalled for `wait`). Entries `..from` must have been checked so already;
    /// entries never become free again, so that check still holds.
    fn first_free(&self, conn: &mut Conn, name: &str, from: u64) -> Result<u64> {
        let hash = name_hash(name);
        let mut id = from;
        // The last value seen of entry `id`'s claim word, and since when it is unchanged
        // (while it is an in-progress claim of the same hash).
        let mut seen: Option<u64> = None;
        let mut since = Instant::now();
        loop {
            if id >= self.max_tables() {
                return Err(CatalogError::CatalogFull(id as u32));
            }
            let word = match seen {
                Some(w) => w,
                None => read_words(conn, self.entry_at(id), 1)?[0],
            };
            let kind = claim_kind(word);
            if kind == Claim::Free {
                return Ok(id);
            }
            if kind == Claim::Abandoned || claim_hash(word) != hash {
                id += 1;
                seen = None;
                continue;
            }
            if kind == Claim::Complete {
                let words = read_words(conn, self.entry_at(id), ENTRY_WORDS)?;
                if self.decode_complete(conn, id, &words)?.name == name {
                    return Err(CatalogError::TableExists(name.into()));
                }
                id += 1;
                seen = None;
                continue;
            }
            // Claimed with the same hash: wait for it to be completed or abandoned.
            if since.elapsed() >= self.wait {
                let abandoned = encode_claim(Claim::Abandoned, hash, word);
                let old = self.try_claim(conn, id, word, abandoned)?;
                seen = Some(if old == word { abandoned } else { old });
                since = Instant::now();
                continue;
            }
            std::thread::sleep(POLL);
            let now = read_words(conn, self.entry_at(id), 1)?[0];
            if now != word {
                since = Instant::now();
            }
            seen = Some(now);
        }
    }

    /// Claims the first free entry from `from` on for `name` (`from` as in
    /// [`Catalog::first_free`]): the entry's id.
    fn claim_for(&self, conn: &mut Conn, name: &str, mine: u64, from: u64) -> Result<u64> {
        let mut id = from;
        loop {
            id = self.first_free(conn, name, id)?;
            if self.try_claim(conn, id, 0, mine)? == 0 {
                return Ok(id);
            }
            // Taken since it was read: look at what took it (a claim of the same
            // name is waited for), then go on from there.
        }
    }

    /// The server of each partition of `spec` for a table of id `id`.
    fn placement(&self, spec: &TableSpec, id: u64) -> Vec<u32> {
        let n = self.servers.len() as u64;
        (0..spec.partitions)
            .map(|p| match &spec.placement {
                Placement::RoundRobin => ((id + p as u64) % n) as u32,
                Placement::Servers(s) => s[p as usize],
            })
            .collect()
    }

    /// Creates a table: checks the name and finds the id it expects, allocates every
    /// partition's arena and index (all or nothing), then claims an id (unique name)
    /// and publishes the entry.
    ///
    /// Space comes before the claim so that a table that does not fit fails before it
    /// takes a catalog entry: entries are never freed, because claimed entries must stay
    /// a prefix and because a stalled creator whose claim was abandoned may still WRITE
    /// its body into the entry (its publishing CAS then fails, but the WRITE lands), so
    /// an entry handed to someone else could be overwritten. Only creators that die or
    /// stall between claim and publish (a few round trips) use entries up.
    pub fn create_table(&self, conns: &mut [Conn], spec: &TableSpec) -> Result<TableDef> {
        check_conns(conns, &self.servers)?;
        let plan = Plan::new(spec, self.servers.len())?;
        let claimed = encode_claim(Claim::Claimed, name_hash(&spec.name), self.token);
        // Round robin from the id this creation expects. Under contention the claim may
        // land on a later entry, and the table keeps this placement: each partition's
        // server is in its entry, the rule is only a way to spread tables.
        let expected = self.first_free(&mut conns[0], &spec.name, 0)?;
        let spaces = reserve(
            conns,
            &self.servers,
            &self.placement(spec, expected),
            plan.chunk,
        )?;
        let id = match self.claim_for(&mut conns[0], &spec.name, claimed, expected) {
            Ok(id) => id,
            Err(e) => {
                // Nothing published: nobody knows of the space.
                untake(conns, &self.servers, &spaces);
                return Err(e);
            }
        };
        self.fill(conns, spec, &plan, &spaces, id, claimed)
    }

    /// Publishes claimed entry `id` with the partitions in `spaces`; on failure gives
    /// the space back if the entry is certainly not published.
    fn fill(
        &self,
        conns: &mut [Conn],
        spec: &TableSpec,
        plan: &Plan,
        spaces: &[Allocation],
        id: u64,
        claimed: u64,
    ) -> Result<TableDef> {
        let partitions = spaces
            .iter()
            .map(|space| PartitionDef {
                server: space.server,
                region: space.region,
                data: space.data,
                arena_offset: space.offset,
                capacity: plan.per_part,
                index_offset: space.offset + plan.index_at,
                index: spec.index,
            })
            .collect();
        let def = TableDef {
            id: id as u32,
            name: spec.name.clone(),
            shape: plan.shape,
            capacity: spec.capacity,
            partitions,
        };
        let words = encode_entry(&def);
        let complete = encode_claim(Claim::Complete, claim_hash(claimed), claimed);
        let entry = self.entry_at(id);
        let body = RemoteAddr {
            offset: entry.offset + 8,
            ..entry
        };
        match write_then_cas(&mut conns[0], body, &words[1..], entry, claimed, complete) {
            Ok(old) if old == claimed => Ok(def),
            Ok(_) => {
                // Someone abandoned the claim: the entry stays abandoned (readers skip
                // it), so the body just written points nowhere anyone looks.
                untake(conns, &self.servers, spaces);
                Err(CatalogError::CreateLost(spec.name.clone()))
            }
            Err(e) => {
                // Whether the publish happened is unknown, so the space stays. Frees
                // the name if it did not; if it did, or someone abandoned the claim
                // already, this CAS fails harmlessly.
                let abandoned = encode_claim(Claim::Abandoned, claim_hash(claimed), self.token);
                let _ = self.try_claim(&mut conns[0], id, claimed, abandoned);
                Err(e)
            }
        }
    }
}

/// A validated [`TableSpec`]: the shape and the space each partition needs.
struct Plan {
    shape: BlockShape,
    per_part: u64,
    /// Where the index starts in a partition's allocation.
    index_at: u64,
    /// Bytes of a partition's allocation.
    chunk: u64,
}

fn check_name(name: &str) -> Result<()> {
    if name.is_empty() || name.len() > MAX_NAME || name.contains('\0') {
        return Err(CatalogError::Invalid(format!(
            "a table name has 1 to {MAX_NAME} bytes without NUL, not `{}`",
            crate::echo(name)
        )));
    }
    Ok(())
}

fn check_index(index: IndexShape) -> Option<u64> {
    if index.buckets == 0 || index.slots == 0 {
        return None;
    }
    index.buckets.checked_mul(index.slots as u64 * 16)
}

/// Bytes of an arena of `blocks` blocks: the counter word and the blocks.
fn arena_bytes(shape: BlockShape, blocks: u64) -> Option<u64> {
    blocks.checked_mul(shape.block_bytes())?.checked_add(8)
}

impl Plan {
    fn new(spec: &TableSpec, servers: usize) -> Result<Plan> {
        check_name(&spec.name)?;
        let shape = BlockShape::new(spec.versions, spec.value_cap)?;
        if spec.partitions == 0 || spec.partitions > MAX_PARTITIONS {
            return Err(CatalogError::Invalid(format!(
                "{} partitions; 1..={MAX_PARTITIONS} are allowed",
                spec.partitions
            )));
        }
        if spec.capacity == 0 {
            return Err(CatalogError::Invalid("a table needs capacity".into()));
        }
        if let Placement::Servers(s) = &spec.placement
            && (s.len() != spec.partitions as usize || s.iter().any(|&x| x as usize >= servers))
        {
            return Err(CatalogError::Invalid(format!(
                "placement {s:?} for {} partitions on {servers} servers",
                spec.partitions
            )));
        }
        let too_large = || CatalogError::Invalid(format!("table {} is too large", spec.name));
        let index_bytes = check_index(spec.index).ok_or_else(|| {
            CatalogError::Invalid(format!(
                "a capacity of {} records is too large (its index would have {} buckets of {} \
                 slots)",
                spec.capacity, spec.index.buckets, spec.index.slots
            ))
        })?;
        let per_part = blocks_per_partition(spec.capacity, spec.partitions);
        let index_at = arena_bytes(shape, per_part)
            .and_then(round_up)
            .ok_or_else(too_large)?;
        let chunk = index_at.checked_add(index_bytes).ok_or_else(too_large)?;
        Ok(Plan {
            shape,
            per_part,
            index_at,
            chunk,
        })
    }
}

fn encode_entry(def: &TableDef) -> Vec<u64> {
    let mut w = vec![0u64; ENTRY_WORDS];
    w[W_NAME_LEN] = def.name.len() as u64;
    let mut name = [0u8; MAX_NAME];
    name[..def.name.len()].copy_from_slice(def.name.as_bytes());
    for (i, c) in name.chunks_exact(8).enumerate() {
        w[W_NAME + i] = u64::from_le_bytes(c.try_into().expect("8-byte chunk"));
    }
    w[W_SHAPE] = def.shape.versions as u64 | (def.shape.value_cap as u64) << 32;
    w[W_CAPACITY] = def.capacity;
    w[W_PARTITIONS] = def.partitions.len() as u64;
    let first = def.partitions.first();
    w[W_PER_PART] = first.map_or(0, |p| p.capacity);
    w[W_BUCKETS] = first.map_or(0, |p| p.index.buckets);
    w[W_SLOTS] = first.map_or(0, |p| p.index.slots as u64);
    for (p, part) in def.partitions.iter().enumerate() {
        let at = W_PARTS + p * PART_WORDS;
        w[at] = part.server as u64 | (part.region as u64) << 32;
        w[at + 1] = part.arena_offset;
        w[at + 2] = part.index_offset;
    }
    w[W_CHECKSUM] = checksum(&w[1..]);
    w
}

/// Decodes and validates complete entry `id` against the cluster `servers`.
fn decode_entry(id: u64, w: &[u64], servers: &[ServerRegions]) -> Result<TableDef> {
    let bad = |why: String| CatalogError::Corrupt(format!("table entry {id}: {why}"));
    if w.len() != ENTRY_WORDS {
        return Err(bad(format!("{} words", w.len())));
    }
    if checksum(&w[1..]) != w[W_CHECKSUM] {
        return Err(bad("checksum mismatch".into()));
    }
    let len = w[W_NAME_LEN] as usize;
    if len == 0 || len > MAX_NAME {
        return Err(bad(format!("name length {}", w[W_NAME_LEN])));
    }
    let bytes: Vec<u8> = w[W_NAME..W_NAME + NAME_WORDS]
        .iter()
        .flat_map(|x| x.to_le_bytes())
        .collect();
    let name = std::str::from_utf8(&bytes[..len])
        .map_err(|_| bad("name is not UTF-8".into()))?
        .to_string();
    if check_name(&name).is_err() || bytes[len..].iter().any(|&b| b != 0) {
        return Err(bad("malformed name".into()));
    }
    if claim_hash(w[0]) != name_hash(&name) {
        return Err(bad(format!(
            "claim word {:#018x} is not of name {name:?}",
            w[0]
        )));
    }
    let shape = BlockShape::new(w[W_SHAPE] as u32, (w[W_SHAPE] >> 32) as u32)
        .map_err(|e| bad(e.to_string()))?;
    let count = w[W_PARTITIONS];
    if count == 0 || count > MAX_PARTITIONS as u64 {
        return Err(bad(format!("{count} partitions")));
    }
    let (capacity, per_part) = (w[W_CAPACITY], w[W_PER_PART]);
    // Catalogs written before partitions got headroom hold the even share.
    if capacity == 0
        || per_part < capacity.div_ceil(count)
        || per_part > blocks_per_partition(capacity, count as u32)
    {
        return Err(bad(format!(
            "capacity {capacity}, {per_part} per partition"
        )));
    }
    let index = IndexShape {
        buckets: w[W_BUCKETS],
        slots: u32::try_from(w[W_SLOTS]).map_err(|_| bad(format!("slots {}", w[W_SLOTS])))?,
    };
    let index_bytes = check_index(index).ok_or_else(|| bad(format!("index {index:?}")))?;
    let arena = arena_bytes(shape, per_part).ok_or_else(|| bad("arena too large".into()))?;
    let mut partitions = Vec::with_capacity(count as usize);
    for p in 0..count as usize {
        let at = W_PARTS + p * PART_WORDS;
        let (server, region) = (w[at] as u32, (w[at] >> 32) as u32);
        let (arena_offset, index_offset) = (w[at + 1], w[at + 2]);
        let data = servers
            .get(server as usize)
            .and_then(|s| s.data.get(region as usize))
            .ok_or_else(|| bad(format!("partition {p} on server {server} data.{region}")))?;
        let fits = |off: u64, bytes: u64| {
            off.is_multiple_of(8) && off.checked_add(bytes).is_some_and(|end| end <= data.len)
        };
        let disjoint = arena_offset.saturating_add(arena) <= index_offset
            || index_offset.saturating_add(index_bytes) <= arena_offset;
        if !arena_offset.is_multiple_of(ALIGN)
            || !fits(arena_offset, arena)
            || !fits(index_offset, index_bytes)
            || !disjoint
        {
            return Err(bad(format!(
                "partition {p}: arena at {arena_offset}, index at {index_offset} in a region of {} bytes",
                data.len
            )));
        }
        partitions.push(PartitionDef {
            server,
            region,
            data: *data,
            arena_offset,
            capacity: per_part,
            index_offset,
            index,
        });
    }
    Ok(TableDef {
        id: id as u32,
        name,
        shape,
        capacity,
        partitions,
    })
}

#[cfg(test)]
mod headroom_tests {
    use super::blocks_per_partition;

    #[test]
    fn one_partition_gets_the_capacity_and_more_get_headroom_over_an_even_share() {
        assert_eq!(blocks_per_partition(16384, 1), 16384);
        // Mean 8192, standard deviation 64: 4σ is 256, plus one.
        assert_eq!(blocks_per_partition(16384, 2), 8192 + 256 + 1);
        assert_eq!(blocks_per_partition(1, 32), 1 + 1 + 1);
        assert_eq!(blocks_per_partition(u64::MAX, 1), u64::MAX);
        assert!(blocks_per_partition(u64::MAX, 2) > u64::MAX / 2);
    }

    /// The keys a table of `capacity` is made for, hashed to partitions as the store
    /// does, fit: the even share did not (the tester's 16384 keys over 2 partitions).
    #[test]
    fn the_keys_a_table_is_made_for_fit_its_partitions() {
        let count = |capacity: u64, parts: u64, offset: u64| {
            let mut per = vec![0u64; parts as usize];
            for key in offset..offset + capacity {
                per[((crate::index::mix(key) >> 32) % parts) as usize] += 1;
            }
            per.into_iter().max().unwrap()
        };
        let mut even_share_overflowed = false;
        for (capacity, parts) in [(16384, 2), (1000, 3), (100_000, 5), (64, 2)] {
            for offset in [0, 1 << 20, 1 << 40] {
                let most = count(capacity, parts, offset);
                assert!(most <= blocks_per_partition(capacity, parts as u32));
                even_share_overflowed |= most > capacity.div_ceil(parts);
            }
        }
        assert!(even_share_overflowed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fabric::sim::{SimConfig, SimNetwork};
    use fabric::{Access, Device, QueuePair, Region};
    use std::sync::{Arc, Mutex};

    /// Sim memory servers, each with a zeroed catalog region and data regions.
    struct Cluster {
        net: SimNetwork,
        devices: Vec<Arc<dyn Device>>,
        catalogs: Vec<Region>,
        data: Vec<Vec<Region>>,
        /// Server-side queue pairs, kept so that connections stay up.
        keep: Mutex<Vec<Arc<dyn QueuePair>>>,
    }

    const CATALOG: u64 = 1 << 20;

    impl Cluster {
        /// `servers` servers, each with `regions` data regions of `bytes` bytes.
        fn new(servers: usize, regions: usize, bytes: u64) -> Cluster {
            Cluster::sized(regions, &vec![bytes; servers])
        }

        /// A server per entry of `bytes`, with `regions` data regions of that many bytes.
        fn sized(regions: usize, bytes: &[u64]) -> Cluster {
            let net = SimNetwork::new(SimConfig::default());
            let devices: Vec<Arc<dyn Device>> = bytes.iter().map(|_| net.add_node() as _).collect();
            let catalogs = devices
                .iter()
                .map(|d| d.register(CATALOG, Access::ALL).unwrap())
                .collect();
            let data = devices
                .iter()
                .zip(bytes)
                .map(|(d, &bytes)| {
                    (0..regions)
                        .map(|_| d.register(bytes, Access::ALL).unwrap())
                        .collect()
                })
                .collect();
            Cluster {
                net,
                devices,
                catalogs,
                data,
                keep: Mutex::new(Vec::new()),
            }
        }

        fn regions(&self) -> Vec<ServerRegions> {
            self.catalogs
                .iter()
                .zip(&self.data)
                .map(|(c, d)| ServerRegions {
                    catalog: c.remote(),
                    data: d.iter().map(Region::remote).collect(),
                })
                .collect()
        }

        /// A compute node: one connection to each server.
        fn node(&self) -> Vec<Conn> {
            let dev: Arc<dyn Device> = self.net.add_node();
            self.devices
                .iter()
                .map(|server| {
                    let ccq = dev.create_cq(64).unwrap();
                    let scq = server.create_cq(64).unwrap();
                    let (sqp, qp) =
                        fabric::connect_rc((server.as_ref(), &scq), (dev.as_ref(), &ccq)).unwrap();
                    self.keep.lock().unwrap().push(sqp);
                    Conn::new(dev.as_ref(), qp, ccq, 64 << 10).unwrap()
                })
                .collect()
        }

        fn open(&self, conns: &mut [Conn]) -> Result<Catalog> {
            Catalog::open(conns, self.regions(), &options())
        }

        fn cursor(&self, server: usize, region: usize) -> u64 {
            self.catalogs[server]
                .load_u64(CURSORS + region as u64 * 8)
                .unwrap()
        }
    }

    fn options() -> CatalogOptions {
        CatalogOptions {
            oracle_bits: 4096,
            oracle_slots: 8,
            log_bytes_per_slot: crate::commitlog::MIN_AREA_BYTES,
            ..CatalogOptions::default()
        }
    }

    fn spec(name: &str, partitions: u32) -> TableSpec {
        TableSpec {
            name: name.into(),
            versions: 2,
            value_cap: 16,
            capacity: 100,
            partitions,
            index: IndexShape {
                buckets: 16,
                slots: 4,
            },
            placement: Placement::RoundRobin,
        }
    }

    /// Every allocated range (oracle, arenas, indexes) as (server, region, start, end).
    fn ranges(catalog: &Catalog, tables: &[TableDef]) -> Vec<(u32, u32, u64, u64)> {
        let o = catalog.oracle();
        let mut out = vec![(0, o.region, o.offset, o.offset + o.layout.region_bytes())];
        for t in tables {
            for p in &t.partitions {
                let arena = arena_bytes(t.shape, p.capacity).unwrap();
                out.push((p.server, p.region, p.arena_offset, p.arena_offset + arena));
                out.push((
                    p.server,
                    p.region,
                    p.index_offset,
                    p.index_offset + p.index.region_bytes(),
                ));
            }
        }
        out
    }

    fn assert_disjoint(mut r: Vec<(u32, u32, u64, u64)>) {
        r.sort_unstable();
        for w in r.windows(2) {
            let (a, b) = (w[0], w[1]);
            assert!(
                (a.0, a.1) != (b.0, b.1) || a.3 <= b.2,
                "overlapping ranges {a:?} and {b:?}"
            );
        }
    }

    #[test]
    fn bootstrap_happens_once_under_a_race() {
        let c = Cluster::new(2, 1, 1 << 20);
        let nodes: Vec<Vec<Conn>> = (0..4).map(|_| c.node()).collect();
        let catalogs: Vec<Catalog> = std::thread::scope(|s| {
            let hs: Vec<_> = nodes
                .into_iter()
                .map(|mut conns| {
                    let c = &c;
                    s.spawn(move || c.open(&mut conns).unwrap())
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let oracle = catalogs[0].oracle();
        assert!(catalogs.iter().all(|k| k.oracle() == oracle));
        let layout = Layout::new(4096, 8).unwrap();
        assert_eq!(oracle.layout, layout);
        // Exactly one oracle (and commit log) was allocated: the cursor moved once, by
        // their size.
        assert_eq!(
            c.cursor(0, 0),
            round_up(layout.region_bytes()).unwrap() + 8 * crate::commitlog::MIN_AREA_BYTES
        );
        assert_eq!(c.cursor(1, 0), 0);
        for (i, w) in layout.image().iter().enumerate() {
            let at = oracle.offset + i as u64 * 8;
            assert_eq!(c.data[0][0].load_u64(at).unwrap(), *w, "oracle word {i}");
        }
        let state = decode_state(c.catalogs[0].load_u64(STATE).unwrap()).unwrap();
        assert!(matches!(state, State::Ready { attempt: 0, .. }));
        // A node that comes later opens the same catalog.
        let mut late = c.node();
        assert_eq!(c.open(&mut late).unwrap().oracle(), oracle);

        // The oracle works where the catalog says it is.
        let dev: Arc<dyn Device> = c.net.add_node();
        let ccq = dev.create_cq(timestamp::MIN_CQ_CAPACITY * 2).unwrap();
        let scq = c.devices[0].create_cq(16).unwrap();
        let (sqp, qp) =
            fabric::connect_rc_with((c.devices[0].as_ref(), &scq), (dev.as_ref(), &ccq), |q| {
                fabric::QpConfig {
                    max_send_wr: timestamp::MIN_SEND_QUEUE * 2,
                    ..q
                }
            })
            .unwrap();
        c.keep.lock().unwrap().push(sqp);
        let slot = timestamp::SlotHandle::register_at(
            dev.as_ref(),
            qp,
            ccq,
            oracle.data,
            oracle.offset,
            timestamp::OracleConfig::default(),
            timestamp::SystemClock::shared(),
        )
        .unwrap();
        let ts = slot.next_commit_ts().unwrap();
        slot.mark(ts, timestamp::Outcome::Committed).unwrap();
        slot.release().unwrap();
    }

    /// The steps whose atomicity everything rests on: of two nodes that read the same
    /// word, only the first CAS wins (a plain WRITE in their place would let both).
    #[test]
    fn stale_claims_lose() {
        let c = Cluster::new(1, 1, 1 << 20);
        let (mut a, mut b) = (c.node(), c.node());
        let c0 = c.regions()[0].catalog;
        // Bootstrap: both read the empty state.
        let init_a = State::Init {
            attempt: 0,
            token: 5,
        };
        let init_b = State::Init {
            attempt: 0,
            token: 6,
        };
        assert_eq!(try_state(&mut a[0], &c0, 0, init_a).unwrap(), 0);
        assert_eq!(
            try_state(&mut b[0], &c0, 0, init_b).unwrap(),
            encode_state(init_a),
            "the second bootstrapper must lose"
        );
        // Finish a's bootstrap by hand so the catalog opens.
        c.catalogs[0].store_u64(STATE, 0).unwrap();
        let cat_a = c.open(&mut a).unwrap();
        let cat_b = c.open(&mut b).unwrap();
        // Allocation: both read cursor `seen`.
        let servers = c.regions();
        let seen = c.cursor(0, 0);
        assert_eq!(try_bump(&mut a, &servers, 0, 0, seen, 64).unwrap(), seen);
        assert_eq!(
            try_bump(&mut b, &servers, 0, 0, seen, 64).unwrap(),
            seen + 64,
            "the second allocation of the same range must lose"
        );
        // Table ids: both see entry 0 free.
        let (wa, wb) = (
            encode_claim(Claim::Claimed, 1, cat_a.token),
            encode_claim(Claim::Claimed, 2, cat_b.token),
        );
        assert_eq!(cat_a.try_claim(&mut a[0], 0, 0, wa).unwrap(), 0);
        assert_eq!(cat_b.try_claim(&mut b[0], 0, 0, wb).unwrap(), wa);
        // b's creation moves on to entry 1.
        let t = cat_b.create_table(&mut b, &spec("t", 1)).unwrap();
        assert_eq!(t.id, 1);
    }

    #[test]
    fn concurrent_creates_get_distinct_ids_and_space() {
        let c = Cluster::new(3, 2, 1 << 20);
        let mut first = c.node();
        c.open(&mut first).unwrap();
        let nodes: Vec<Vec<Conn>> = (0..4).map(|_| c.node()).collect();
        let made: Vec<TableDef> = std::thread::scope(|s| {
            let hs: Vec<_> = nodes
                .into_iter()
                .enumerate()
                .map(|(t, mut conns)| {
                    let c = &c;
                    s.spawn(move || {
                        let cat = c.open(&mut conns).unwrap();
                        (0..6)
                            .map(|k| {
                                let p = 1 + (k % 3);
                                cat.create_table(&mut conns, &spec(&format!("n{t}.{k}"), p))
                                    .unwrap()
                            })
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            hs.into_iter().flat_map(|h| h.join().unwrap()).collect()
        });
        let mut ids: Vec<u32> = made.iter().map(|t| t.id).collect();
        ids.sort_unstable();
        assert_eq!(ids, (0..24).collect::<Vec<_>>(), "distinct ids, no holes");
        // Another node sees exactly what the creators got.
        let cat = c.open(&mut first).unwrap();
        let mut seen = cat.tables(&mut first).unwrap();
        let mut made = made;
        made.sort_by_key(|t| t.id);
        seen.sort_by_key(|t| t.id);
        assert_eq!(seen, made);
        let r = ranges(&cat, &seen);
        // Every range lies below its region's cursor, and none overlap.
        for &(s, reg, _, end) in &r {
            assert!(end <= c.cursor(s as usize, reg as usize));
        }
        assert_disjoint(r);
        for t in &seen {
            assert_eq!(cat.table(&mut first, &t.name).unwrap(), *t);
        }
    }

    #[test]
    fn concurrent_creates_of_one_name_have_one_winner() {
        let c = Cluster::new(2, 1, 4 << 20);
        let nodes: Vec<Vec<Conn>> = (0..4).map(|_| c.node()).collect();
        let wins: Vec<Vec<String>> = std::thread::scope(|s| {
            let hs: Vec<_> = nodes
                .into_iter()
                .map(|mut conns| {
                    let c = &c;
                    s.spawn(move || {
                        let cat = c.open(&mut conns).unwrap();
                        let mut won = Vec::new();
                        for k in 0..8 {
                            let name = format!("same{k}");
                            match cat.create_table(&mut conns, &spec(&name, 2)) {
                                Ok(t) => won.push(t.name),
                                Err(CatalogError::TableExists(n)) => assert_eq!(n, name),
                                Err(e) => panic!("{e}"),
                            }
                        }
                        won
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let mut all: Vec<String> = wins.into_iter().flatten().collect();
        all.sort();
        let want: Vec<String> = (0..8).map(|k| format!("same{k}")).collect();
        assert_eq!(all, want, "each name created exactly once");
        let mut conns = c.node();
        let cat = c.open(&mut conns).unwrap();
        let tables = cat.tables(&mut conns).unwrap();
        assert_eq!(tables.len(), 8);
        assert!(matches!(
            cat.create_table(&mut conns, &spec("same3", 1)),
            Err(CatalogError::TableExists(_))
        ));
    }

    #[test]
    fn a_stalled_claim_of_the_same_name_is_abandoned_and_its_creator_loses() {
        let c = Cluster::new(2, 1, 1 << 20);
        let (mut a, mut b) = (c.node(), c.node());
        let cat_a = c.open(&mut a).unwrap();
        let mut cat_b = c.open(&mut b).unwrap();
        cat_b.wait = Duration::from_millis(1);
        // a allocates "x" on server 0, claims it, and stalls before publishing.
        let mut s = spec("x", 1);
        s.placement = Placement::Servers(vec![0]);
        let plan = Plan::new(&s, 2).unwrap();
        let before = c.cursor(0, 0);
        let claimed = encode_claim(Claim::Claimed, name_hash("x"), cat_a.token);
        let expected = cat_a.first_free(&mut a[0], "x", 0).unwrap();
        let placement = cat_a.placement(&s, expected);
        let spaces = reserve(&mut a, &c.regions(), &placement, plan.chunk).unwrap();
        let id = cat_a.claim_for(&mut a[0], "x", claimed, expected).unwrap();
        assert_eq!(c.cursor(0, 0), before + plan.chunk.next_multiple_of(ALIGN));
        assert!(
            cat_b.tables(&mut b).unwrap().is_empty(),
            "readers skip claims"
        );
        // b gives up waiting, abandons a's claim and creates "x" itself, on server 1.
        s.placement = Placement::Servers(vec![1]);
        let t = cat_b.create_table(&mut b, &s).unwrap();
        assert_eq!(t.id, id as u32 + 1);
        // a wakes up: its publish fails, "x" stays b's, and a's space is given back.
        assert!(matches!(
            cat_a.fill(&mut a, &s, &plan, &spaces, id, claimed),
            Err(CatalogError::CreateLost(_))
        ));
        assert_eq!(c.cursor(0, 0), before);
        assert_eq!(cat_a.tables(&mut a).unwrap(), vec![t.clone()]);
        assert_eq!(cat_a.table(&mut a, "x").unwrap(), t);
    }

    /// The tester's report: thousands of creations too large for the cluster used up
    /// the 960 entries (each took one and abandoned it), and the catalog was full for
    /// good. A refused creation now takes no entry and allocates nothing.
    #[test]
    fn refused_creations_take_no_catalog_entry() {
        let c = Cluster::new(2, 1, 64 << 10);
        let mut conns = c.node();
        let cat = c.open(&mut conns).unwrap();
        let cursors = (c.cursor(0, 0), c.cursor(1, 0));
        let tables = cat.max_tables();
        assert_eq!(tables, 960);
        let mut big = spec("f", 2);
        big.capacity = 1 << 20;
        for i in 0..tables + 40 {
            big.name = format!("f{i}");
            match cat.create_table(&mut conns, &big) {
                Err(CatalogError::ServerFull { .. }) => {}
                other => panic!("creation {i}: {other:?}"),
            }
        }
        assert_eq!((c.cursor(0, 0), c.cursor(1, 0)), cursors);
        assert_eq!(c.catalogs[0].load_u64(TABLES).unwrap(), 0, "entry 0 free");
        let t = cat.create_table(&mut conns, &spec("small", 2)).unwrap();
        assert_eq!(t.id, 0);
        assert_eq!(cat.tables(&mut conns).unwrap(), vec![t]);
    }

    /// The tester's second report: a table whose partitions fit one server but not the
    /// other kept the space it got on the first, so a later table that needed that
    /// server's whole room failed with no table existing.
    #[test]
    fn a_refused_creation_allocates_nothing() {
        // Server 0 holds the oracle and the commit log (~100 KiB); server 1 is smaller
        // than what is left of server 0.
        let c = Cluster::sized(1, &[1 << 20, 256 << 10]);
        let mut conns = c.node();
        let cat = c.open(&mut conns).unwrap();
        let room0 = (1 << 20) - c.cursor(0, 0);
        assert!(room0 > 600 << 10, "{room0}");
        // A table of one block per partition: its chunk is its index and a block.
        let sized = |name: &str, placement: Vec<u32>, chunk: u64| {
            let mut s = spec(name, placement.len() as u32);
            s.capacity = placement.len() as u64;
            s.index = IndexShape {
                buckets: 1,
                slots: 1,
            };
            let base = Plan::new(&s, 2).unwrap().chunk;
            s.index.buckets += (chunk - base) / 16;
            s.placement = Placement::Servers(placement);
            assert_eq!(Plan::new(&s, 2).unwrap().chunk, chunk);
            s
        };
        // Partition 0 fits server 0, partition 1 does not fit server 1.
        let wide = sized("wide", vec![0, 1], 300 << 10);
        let err = cat.create_table(&mut conns, &wide).unwrap_err();
        assert!(
            matches!(
                err,
                CatalogError::ServerFull {
                    server: 1,
                    bytes: 307_200,
                    partitions: 1,
                    free: 262_144,
                    ..
                }
            ),
            "{err}"
        );
        let msg = err.to_string();
        assert!(
            msg.contains("memory server 1 has no room for 307200 bytes")
                && msg.contains("262144 bytes free"),
            "{msg}"
        );
        assert_eq!(c.cursor(0, 0), (1 << 20) - room0, "nothing allocated");
        assert_eq!(c.catalogs[0].load_u64(TABLES).unwrap(), 0, "entry 0 free");
        // Two partitions that each fit server 0 but not both together.
        let two = sized("two", vec![0, 0], room0 / 2 + 64);
        let err = cat.create_table(&mut conns, &two).unwrap_err();
        assert!(
            matches!(
                err,
                CatalogError::ServerFull {
                    server: 0,
                    partitions: 2,
                    ..
                }
            ),
            "{err}"
        );
        assert!(err.to_string().contains("2 partitions of"), "{err}");
        assert_eq!(c.cursor(0, 0), (1 << 20) - room0, "nothing allocated");
        // A table that needs server 0's whole room.
        let whole = sized("whole", vec![0], room0);
        let t = cat.create_table(&mut conns, &whole).unwrap();
        assert_eq!((t.id, t.partitions[0].server), (0, 0));
        assert_eq!(c.cursor(0, 0), 1 << 20);
        // And server 1's.
        let rest = sized("rest", vec![1], 256 << 10);
        assert_eq!(cat.create_table(&mut conns, &rest).unwrap().id, 1);
    }

    #[test]
    fn a_reopen_expecting_a_cluster_refuses_servers_that_lost_it() {
        let c = Cluster::new(2, 1, 1 << 20);
        let id = c.open(&mut c.node()).unwrap().cluster_id();
        assert_ne!(id, 0);
        let expecting = |cluster| CatalogOptions {
            cluster: Some(cluster),
            ..options()
        };
        let again = Catalog::open(&mut c.node(), c.regions(), &expecting(id)).unwrap();
        assert_eq!(again.cluster_id(), id);
        // Servers that came back empty: no new cluster set up in the old one's place.
        let empty = Cluster::new(2, 1, 1 << 20);
        let err = Catalog::open(&mut empty.node(), empty.regions(), &expecting(id)).unwrap_err();
        assert!(matches!(err, CatalogError::ClusterLost { .. }), "{err}");
        assert!(err.to_string().contains("--data-dir"), "{err}");
        let state = decode_state(empty.catalogs[0].load_u64(STATE).unwrap()).unwrap();
        assert_eq!(state, State::Empty, "nothing was set up");
        // Servers that hold another cluster.
        let other = empty.open(&mut empty.node()).unwrap().cluster_id();
        assert_ne!(other, id);
        let err = Catalog::open(&mut empty.node(), empty.regions(), &expecting(id)).unwrap_err();
        assert!(matches!(err, CatalogError::ClusterLost { .. }), "{err}");
    }

    #[test]
    fn a_stalled_bootstrap_is_taken_over_or_reported() {
        let c = Cluster::new(1, 1, 1 << 20);
        let (mut a, mut b) = (c.node(), c.node());
        let c0 = c.regions()[0].catalog;
        let opts = CatalogOptions {
            wait: Duration::from_millis(1),
            ..options()
        };
        // a takes the bootstrap and dies.
        let init_a = State::Init {
            attempt: 0,
            token: 7,
        };
        assert_eq!(try_state(&mut a[0], &c0, 0, init_a).unwrap(), 0);
        let cat = Catalog::open(&mut b, c.regions(), &opts).unwrap();
        let state = decode_state(c.catalogs[0].load_u64(STATE).unwrap()).unwrap();
        assert!(matches!(state, State::Ready { attempt: 1, .. }));
        // Had a only been slow, it could not publish over b.
        let err = Catalog::bootstrap(&mut a, &c.regions(), &opts, 0, 7).unwrap_err();
        assert!(
            matches!(err, CatalogError::BootstrapLost { attempt: 0 }),
            "{err}"
        );
        assert_eq!(c.open(&mut a).unwrap().oracle(), cat.oracle());

        // With every takeover used up, the error says what happened.
        let d = Cluster::new(1, 1, 1 << 20);
        let mut n = d.node();
        let last = State::Init {
            attempt: MAX_ATTEMPTS - 1,
            token: 9,
        };
        d.catalogs[0].store_u64(STATE, encode_state(last)).unwrap();
        let err = Catalog::open(&mut n, d.regions(), &opts).unwrap_err();
        assert!(
            matches!(err, CatalogError::BootstrapStalled { token: 9, .. }),
            "{err}"
        );
        assert!(err.to_string().contains("made no progress"));
    }

    #[test]
    fn allocation_runs_out_cleanly() {
        // Two data regions of 64 KiB on server 1; server 0 holds the oracle and the
        // commit log.
        let c = Cluster::new(2, 2, 64 << 10);
        let mut conns = c.node();
        let cat = c.open(&mut conns).unwrap();
        let mut got = Vec::new();
        loop {
            match cat.allocate(&mut conns, 1, 16_000) {
                Ok(a) => got.push(a),
                Err(CatalogError::ServerFull {
                    server: 1,
                    bytes: 16_000,
                    partitions: 1,
                    regions: 2,
                    free: 1536,
                }) => break,
                Err(e) => panic!("{e}"),
            }
        }
        assert_eq!(
            got.len(),
            8,
            "four of 16 000 (rounded to 16 000) in each 64 KiB region"
        );
        assert_disjoint(
            got.iter()
                .map(|a| (a.server, a.region, a.offset, a.offset + a.bytes))
                .collect(),
        );
        assert!(got.iter().all(|a| a.offset.is_multiple_of(ALIGN)));
        assert_eq!((c.cursor(1, 0), c.cursor(1, 1)), (64_000, 64_000));
        let c = Cluster::new(1, 1, 64 << 10);
        let mut conns = c.node();
        let cat = c.open(&mut conns).unwrap();
        // A request that does not fit leaves the cursor alone, so a smaller one fits.
        let before = c.cursor(0, 0);
        assert!(matches!(
            cat.allocate(&mut conns, 0, 64 << 10),
            Err(CatalogError::ServerFull { .. })
        ));
        assert_eq!(c.cursor(0, 0), before);
        cat.allocate(&mut conns, 0, 64).unwrap();
        // A table that does not fit is not created, and its name stays free.
        let mut big = spec("big", 1);
        big.capacity = 1 << 20;
        assert!(matches!(
            cat.create_table(&mut conns, &big),
            Err(CatalogError::ServerFull { .. })
        ));
        assert!(cat.tables(&mut conns).unwrap().is_empty());
        big.capacity = 4;
        big.index.buckets = 1;
        let t = cat.create_table(&mut conns, &big).unwrap();
        assert_eq!(t.id, 0, "the refused creation took no entry");
        assert!(matches!(
            cat.allocate(&mut conns, 5, 64),
            Err(CatalogError::Invalid(_))
        ));
    }

    #[test]
    fn partitions_go_round_robin_and_work_from_another_node() {
        let c = Cluster::new(3, 1, 1 << 20);
        let (mut a, mut b) = (c.node(), c.node());
        let cat_a = c.open(&mut a).unwrap();
        cat_a.create_table(&mut a, &spec("first", 1)).unwrap();
        let t = cat_a.create_table(&mut a, &spec("orders", 6)).unwrap();
        let servers: Vec<u32> = t.partitions.iter().map(|p| p.server).collect();
        assert_eq!(
            servers,
            vec![1, 2, 0, 1, 2, 0],
            "round robin from the table id"
        );
        // ceil(100 / 6) and four standard deviations of the binomial count.
        assert_eq!(t.partitions[0].capacity, 17 + 15 + 1);
        let mut placed = spec("placed", 2);
        placed.placement = Placement::Servers(vec![2, 2]);
        let p = cat_a.create_table(&mut a, &placed).unwrap();
        assert!(p.partitions.iter().all(|x| x.server == 2));
        placed.placement = Placement::Servers(vec![3, 0]);
        assert!(matches!(
            cat_a.create_table(&mut a, &placed),
            Err(CatalogError::Invalid(_))
        ));

        // Node B finds the table A created and uses its last block in partition 5.
        let cat_b = c.open(&mut b).unwrap();
        let tb = cat_b.table(&mut b, "orders").unwrap();
        assert_eq!(tb, t);
        let part = tb.partitions[5];
        let at = part.block_offset(tb.shape, part.capacity - 1);
        assert!(at + tb.shape.block_bytes() <= part.index_offset);
        let value = 0x1234_5678_9abc_def0u64.to_le_bytes();
        b[part.server as usize]
            .run(&mut [SendWr::write(
                0,
                fabric::Src::Inline(&value),
                part.data.at(at),
            )])
            .unwrap();
        assert_eq!(
            c.data[part.server as usize][part.region as usize]
                .load_u64(at)
                .unwrap(),
            0x1234_5678_9abc_def0
        );
        assert!(matches!(
            cat_b.table(&mut b, "nope"),
            Err(CatalogError::NotFound(_))
        ));
    }

    #[test]
    fn specs_are_validated() {
        let c = Cluster::new(1, 1, 1 << 20);
        let mut conns = c.node();
        let cat = c.open(&mut conns).unwrap();
        let bad = |f: &dyn Fn(&mut TableSpec)| {
            let mut s = spec("t", 1);
            f(&mut s);
            s
        };
        for s in [
            bad(&|s| s.name = String::new()),
            bad(&|s| s.name = "x".repeat(65)),
            bad(&|s| s.name = "a\0b".into()),
            bad(&|s| s.partitions = 0),
            bad(&|s| s.partitions = MAX_PARTITIONS + 1),
            bad(&|s| s.capacity = 0),
            bad(&|s| s.index.buckets = 0),
            bad(&|s| s.capacity = u64::MAX),
            bad(&|s| s.versions = 0),
        ] {
            assert!(cat.create_table(&mut conns, &s).is_err(), "{s:?}");
        }
        let ok = bad(&|s| s.name = "é".repeat(32));
        assert_eq!(cat.create_table(&mut conns, &ok).unwrap().name, ok.name);
        assert_eq!(cat.tables(&mut conns).unwrap().len(), 1);
    }

    #[test]
    fn garbage_and_corruption_are_errors_not_panics() {
        // A region full of a byte pattern.
        let c = Cluster::new(1, 1, 1 << 20);
        let mut conns = c.node();
        for off in (0..CATALOG).step_by(8) {
            c.catalogs[0].store_u64(off, 0xa5a5_a5a5_a5a5_a5a5).unwrap();
        }
        let err = c.open(&mut conns).unwrap_err();
        assert!(matches!(err, CatalogError::NotACatalog(_)), "{err}");
        // Pseudo-random words: whatever the state word decodes to, an error.
        let mut x = 0x2545_f491_4f6c_dd1du64;
        for round in 0..64 {
            for off in (0..HEADER_PAGE).step_by(8) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                c.catalogs[0].store_u64(off, x).unwrap();
            }
            let opts = CatalogOptions {
                wait: Duration::from_millis(1),
                ..options()
            };
            let r = Catalog::open(&mut conns, c.regions(), &opts);
            assert!(r.is_err(), "round {round}: garbage opened as a catalog");
        }
        // Only the state word set, the rest of the header garbage-free but no record.
        let c = Cluster::new(1, 1, 1 << 20);
        let mut conns = c.node();
        c.catalogs[0].store_u64(64 + 8, 1).unwrap();
        assert!(matches!(
            c.open(&mut conns),
            Err(CatalogError::NotACatalog(_))
        ));

        // A good catalog, then damage to its record and entries.
        let c = Cluster::new(2, 1, 1 << 20);
        let mut conns = c.node();
        let cat = c.open(&mut conns).unwrap();
        cat.create_table(&mut conns, &spec("t", 2)).unwrap();
        let rec = RECORDS;
        let cat0 = &c.catalogs[0];
        cat0.store_u64(rec + 8, VERSION + 1).unwrap();
        assert!(matches!(
            c.open(&mut conns),
            Err(CatalogError::VersionMismatch { found: 4, .. })
        ));
        cat0.store_u64(rec + 8, VERSION).unwrap();
        cat0.store_u64(rec, 42).unwrap();
        let err = c.open(&mut conns).unwrap_err();
        assert!(err.to_string().starts_with("not a namdb catalog"), "{err}");
        cat0.store_u64(rec, MAGIC).unwrap();
        let one = vec![c.regions()[0].clone()];
        assert!(matches!(
            Catalog::open(&mut conns[..1], one, &options()),
            Err(CatalogError::ClusterMismatch {
                catalog: 2,
                given: 1
            })
        ));
        let cat = c.open(&mut conns).unwrap();

        // A flipped bit in the body: checksum.
        let name_at = TABLES + W_NAME as u64 * 8;
        let name = cat0.load_u64(name_at).unwrap();
        cat0.store_u64(name_at, name ^ 1).unwrap();
        let err = cat.tables(&mut conns).unwrap_err();
        assert!(matches!(err, CatalogError::Corrupt(_)), "{err}");
        cat0.store_u64(name_at, name).unwrap();
        assert_eq!(cat.tables(&mut conns).unwrap().len(), 1);
        // Out-of-bounds offsets with a valid checksum: the bounds checks.
        let mut words = vec![0u64; ENTRY_WORDS];
        cat0.read_words(TABLES, &mut words).unwrap();
        for (word, value) in [
            (W_PARTS + 1, 1u64 << 40),
            (W_PARTS + 1, u64::MAX - 63),
            (W_PARTS, 7),
            (W_PARTS + 2, words[W_PARTS + 1]),
            (W_PARTITIONS, 0),
            (W_PARTITIONS, 1000),
            (W_SHAPE, 0),
            (W_NAME_LEN, 65),
            (W_BUCKETS, u64::MAX),
            (W_SLOTS, u64::MAX),
        ] {
            let mut bad = words.clone();
            bad[word] = value;
            bad[W_CHECKSUM] = checksum(&bad[1..]);
            for (i, w) in bad.iter().enumerate() {
                cat0.store_u64(TABLES + i as u64 * 8, *w).unwrap();
            }
            let err = cat.tables(&mut conns).unwrap_err();
            assert!(
                matches!(err, CatalogError::Corrupt(_)),
                "word {word}: {err}"
            );
            assert!(cat.table(&mut conns, "t").is_err());
        }
        // A cursor beyond its region.
        c.catalogs[1].store_u64(CURSORS, 1 << 40).unwrap();
        assert!(matches!(
            cat.allocate(&mut conns, 1, 64),
            Err(CatalogError::Corrupt(_))
        ));
    }
}
