//! Transactions: snapshot reads at RID, buffered writes, and the RSI commit protocol
//! (DESIGN.md, "RSI"), as futures ([`AsyncTransaction`], many per worker thread) or
//! blocking calls ([`Transaction`], the same code driven by `block_on`).
//!
//! - **Read.** A block is found through the address cache or one index READ, then READ
//!   together with its header word in one doorbell; it is accepted only if both headers
//!   are equal and unlocked (seqlock, [`crate::layout::accept`]), else re-read. The
//!   newest version with CID ≤ RID is returned; none kept is
//!   [`TxnError::SnapshotTooOld`]. A record is read once per transaction (later reads
//!   return the same snapshot), and a transaction sees its own writes. `get_many` puts
//!   all its index READs, then all its block READs, in one doorbell per memory server.
//! - **Scan.** Each partition's arena is READ in large chunks, each chunk twice in one
//!   doorbell: a block whose header is equal in both copies and unlocked was not
//!   written in between (installs change the header before and after writing), the
//!   others are re-read one by one with the seqlock.
//! - **Commit.** (1) CID from the worker's slot, no communication. (2) First committer
//!   wins: a written record whose header CID (as read) is above RID aborts before any
//!   lock. (3) New records: a block from the partition's arena counter (FETCH_ADD, a
//!   few blocks at a time per worker), WRITE the block locked by CID, CAS the index
//!   slot from empty (losing the race is `DuplicateKey` for
//!   [`AsyncTransaction::insert`], `Conflict` for a `put`), then WRITE the slot's
//!   address; batched over all inserts, the claim in the slot the key's lookup found
//!   first empty, and the address WRITEs in step 4's doorbell. (4) Lock and validate
//!   every updated record with one CAS each, one doorbell per memory server, expecting
//!   the header read. (5) The commit record ([`crate::commitlog`]): the CID and the write
//!   set, one WRITE into the worker's slot's log ring on server 0; once it is complete
//!   the transaction is committed, whatever happens to this node. (6) Install: per
//!   record a WRITE of the versions (new one at the head, older ones shifted) and a CAS
//!   of the header from locked to `CID`, one doorbell per server. (7) Mark CID
//!   committed, unsignaled, batched with the marks of the worker's other coroutines.
//!   With `Options::wait_visible` (the default), commit then waits until the oracle's
//!   prefix includes CID, so transactions that begin after it returns see it.
//! - **Under the lease.** Every step is posted only after checking that the worker
//!   still holds its slot under a live lease (a clock read; a renewal when half the
//!   lease has passed). A worker fenced meanwhile gives the commit up to recovery
//!   ([`TxnError::Fenced`]: posts nothing more, releases nothing), which rolls it
//!   forward if its record is complete and back otherwise ([`crate::recovery`]).
//! - **Abort** (in commit, or [`AsyncTransaction::abort`]): every lock taken is released
//!   with CAS to the header it replaced; a new block (published or not) becomes a
//!   tombstone at CID 0 and is unlocked (a published one is reused by a later insert of
//!   the key); the CID is still marked (aborted), or the prefix would stall.
//!
//! A reader blocked by a lock for over a second gets `Conflict`; a dead holder's locks
//! are resolved by recovery once its slot is fenced.

use crate::commitlog::{self, EntryKind, EntryRef};
use crate::crash::{self, CrashPoint};
use crate::durable::{PersistPlan, PersistRange};
use crate::error::{Result, TxnError};
use crate::index::{AddressWord, Claimed, Lookup, RemoteIndex};
use crate::layout::{
    self, Block, Header, LayoutError, VERSIONS_OFFSET, Version, Visible, VisibleRaw,
};
use crate::recovery::PendingClaim;
use crate::runtime::{block_on, yield_now};
use crate::store::Table;
use crate::worker::{Epoch, Worker};
use fabric::{Region, SendWr};
use smallvec::SmallVec;
use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};
use timestamp::Outcome;

/// How long a reader waits for a lock or a pending index slot before giving up.
const LOCK_PATIENCE: Duration = Duration::from_secs(1);

/// What the transaction saw of a record.
#[derive(Clone, Debug)]
enum Seen {
    /// Not in the index.
    Absent,
    /// Its block at `addr` of partition `part`, as read (unlocked, valid), and the
    /// block's header.
    Block {
        part: usize,
        addr: u64,
        header: Header,
        /// Where the block's bytes are in the transaction's arena.
        raw: Range<usize>,
    },
}

struct SeenEntry {
    table: u32,
    key: u64,
    seen: Seen,
}

struct Write {
    table: Arc<Table>,
    key: u64,
    /// `None` deletes.
    value: Option<Vec<u8>>,
    /// Made by `insert`: losing an index race is `DuplicateKey`, not `Conflict`.
    insert: bool,
}

/// A transaction's state, apart from the worker it runs on: what a driver keeps
/// between calls when the transaction must not borrow its client (see
/// [`Transaction::suspend`]).
pub struct Suspended {
    rid: u64,
    parts: Option<Parts>,
}

/// A transaction's working memory, pooled by its worker so that a transaction
/// allocates next to nothing: a registered buffer (reads land there, commits are
/// staged there), what it saw (the blocks' bytes in one arena), what it wrote.
pub(crate) struct Parts {
    buffer: Region,
    seen: Vec<SeenEntry>,
    /// Where each record is in `seen`, once it holds more than [`SEEN_SCAN`]: a big
    /// transaction (a report over thousands of rows) must not search linearly.
    seen_at: HashMap<(u32, u64), usize, foldhash::fast::FixedState>,
    writes: Vec<Write>,
    bytes: Vec<u8>,
    /// For keys the index did not hold when the transaction looked: the slot an
    /// insert of the key claims, from that look, so the commit need not READ the
    /// bucket again. (table, key, slot offset in the index region).
    claim_hints: SmallVec<[(u32, u64, u64); 4]>,
    /// Where a commit encodes what it stages in `buffer` (new blocks, installs, its
    /// log record), kept across transactions so a commit does not allocate for them.
    staging: Vec<u8>,
}

/// Records a transaction looks up by scanning; above this, through `seen_at`.
const SEEN_SCAN: usize = 32;

impl Parts {
    pub(crate) fn new(buffer: Region) -> Parts {
        Parts {
            buffer,
            seen: Vec::new(),
            seen_at: HashMap::default(),
            writes: Vec::new(),
            bytes: Vec::new(),
            claim_hints: SmallVec::new(),
            staging: Vec::new(),
        }
    }

    /// Forgets the last transaction, keeping the capacity.
    pub(crate) fn clear(&mut self) {
        self.seen.clear();
        self.seen_at.clear();
        self.writes.clear();
        self.bytes.clear();
        self.claim_hints.clear();
    }

    fn claim_hint(&self, table: u32, key: u64) -> Option<u64> {
        self.claim_hints
            .iter()
            .find(|h| h.0 == table && h.1 == key)
            .map(|h| h.2)
    }

    fn seen_of(&self, table: u32, key: u64) -> Option<&Seen> {
        if self.seen.len() <= SEEN_SCAN {
            return self
                .seen
                .iter()
                .find(|s| s.table == table && s.key == key)
                .map(|s| &s.seen);
        }
        self.seen_at.get(&(table, key)).map(|&i| &self.seen[i].seen)
    }

    fn add_seen(&mut self, entry: SeenEntry) {
        self.seen.push(entry);
        match self.seen.len() {
            n if n <= SEEN_SCAN => {}
            n if n == SEEN_SCAN + 1 => {
                for (i, s) in self.seen.iter().enumerate() {
                    self.seen_at.insert((s.table, s.key), i);
                }
            }
            n => {
                let s = &self.seen[n - 1];
                self.seen_at.insert((s.table, s.key), n - 1);
            }
        }
    }

    fn write_of(&self, table: u32, key: u64) -> Option<&Write> {
        self.writes
            .iter()
            .find(|w| w.table.id == table && w.key == key)
    }
}

/// A transaction running on a [`Worker`], as futures. It ends with
/// [`AsyncTransaction::commit`] or [`AsyncTransaction::abort`]; dropped unfinished it
/// aborts (nothing is locked before commit, so nothing needs releasing).
pub struct AsyncTransaction<'w> {
    worker: &'w Worker,
    st: Suspended,
}

/// A cursor over a transaction's buffer.
struct Area {
    next: u64,
    len: u64,
}

impl Area {
    fn new(buffer: &Region) -> Area {
        Area {
            next: 0,
            len: buffer.len(),
        }
    }

    fn take(&mut self, bytes: u64) -> Result<u64> {
        let at = self.next;
        if at + bytes > self.len {
            return Err(TxnError::Invalid(format!(
                "write set too large: the transaction needs more than its {}-byte buffer (Options::scratch_bytes); split it into smaller transactions",
                self.len
            )));
        }
        self.next += bytes.next_multiple_of(8);
        Ok(at)
    }
}

/// The buffer a commit needs, counted before it takes a timestamp or allocates a
/// block: past the log record the commit is decided, and running out of buffer there
/// would leave it half installed for recovery; and blocks allocated for a commit that
/// then cannot stage them would be lost to the table.
struct CommitRoom {
    durable: bool,
    /// The log record's words: head (magic, CID, count) and checksum, then entries.
    record_words: u64,
    /// From the lock step on, besides the log record: lock results and installs.
    other: u64,
    /// The insert step, which reuses the buffer before the lock step: each new block
    /// staged whole, and its index claim's result.
    insert_step: u64,
    inserts: u64,
}

impl CommitRoom {
    fn new(durable: bool) -> CommitRoom {
        CommitRoom {
            durable,
            record_words: 4,
            other: 0,
            insert_step: 0,
            inserts: 0,
        }
    }

    fn add(&mut self, w: &Write, seen: Option<&Seen>) {
        let value_words = w.value.as_ref().map_or(0, |v| v.len().div_ceil(8)) as u64;
        match seen {
            Some(Seen::Block { .. }) => {
                let versions = w.table.shape.block_bytes() - VERSIONS_OFFSET;
                // Lock result, installed versions, unlock result.
                self.other += 8 + versions.next_multiple_of(8) + 8;
                self.record_words += 4 + value_words;
            }
            Some(Seen::Absent) => {
                self.other += 8;
                self.record_words += 4 + if self.durable { value_words } else { 0 };
                self.insert_step += w.table.shape.block_bytes().next_multiple_of(8) + 8;
                self.inserts += 1;
            }
            None => {}
        }
    }

    fn check(&self, have: u64, writes: usize) -> Result<()> {
        let need = (self.other + self.record_words * 8).max(self.insert_step);
        if need > have {
            return Err(TxnError::Invalid(format!(
                "write set too large: committing {} writes ({} of them new keys) needs {need} \
                 bytes of buffer, and a transaction has {have} (Options::scratch_bytes): \
                 split it into smaller transactions",
                writes, self.inserts
            )));
        }
        Ok(())
    }
}

/// Which commit a step belongs to: its CID and the slot holding it ran under.
#[derive(Clone, Copy)]
struct Step {
    cid: u64,
    epoch: Epoch,
}

/// Work requests for several memory servers, posted one doorbell per server and
/// awaited together. Each server's requests are kept apart as they are pushed, in
/// order, so posting copies nothing.
struct Batches<'a> {
    per_server: SmallVec<[(usize, SmallVec<[SendWr<'a>; 8]>); 2]>,
}

impl<'a> Batches<'a> {
    fn new() -> Batches<'a> {
        Batches {
            per_server: SmallVec::new(),
        }
    }

    fn push(&mut self, server: usize, wr: SendWr<'a>) {
        match self.per_server.iter_mut().find(|(s, _)| *s == server) {
            Some((_, list)) => list.push(wr),
            None => self.per_server.push((server, smallvec::smallvec![wr])),
        }
    }

    async fn run(&mut self, worker: &Worker) -> Result<()> {
        self.post_all(worker).await
    }

    /// [`Batches::run`] for a commit step: posted only while the worker still holds
    /// the commit's epoch under a live lease (and inside its lease gate until done).
    async fn run_step(&mut self, worker: &Worker, step: Step) -> Result<()> {
        self.run_step_past(worker, step, None).await
    }

    /// [`Batches::run_step`] passing crash point `at` between the lease check and
    /// the post.
    async fn run_step_past(
        &mut self,
        worker: &Worker,
        step: Step,
        at: Option<CrashPoint>,
    ) -> Result<()> {
        if self.per_server.is_empty() {
            return Ok(());
        }
        let _inside = worker.check_epoch(step.epoch, step.cid)?;
        if let Some(at) = at {
            crash::point(at, step.cid);
        }
        self.post_all(worker).await
    }

    /// Posts every server's requests as they are (their ids and signaling set in
    /// place) and waits for all.
    async fn post_all(&mut self, worker: &Worker) -> Result<()> {
        match &mut self.per_server[..] {
            [] => Ok(()),
            [(s, wrs)] => Ok(worker.conn(*s).run_in_place(wrs).await?),
            // Two servers, most commits' steps: no allocation.
            [(a, a_wrs), (b, b_wrs)] => {
                futures::future::try_join(
                    worker.conn(*a).run_in_place(a_wrs),
                    worker.conn(*b).run_in_place(b_wrs),
                )
                .await?;
                Ok(())
            }
            lists => {
                futures::future::try_join_all(
                    lists
                        .iter_mut()
                        .map(|(s, wrs)| Box::pin(worker.conn(*s).run_in_place(wrs))),
                )
                .await?;
                Ok(())
            }
        }
    }
}

impl<'w> AsyncTransaction<'w> {
    pub(crate) fn new(worker: &'w Worker, rid: u64) -> Result<AsyncTransaction<'w>> {
        let parts = worker.take_parts()?;
        Ok(AsyncTransaction {
            worker,
            st: Suspended {
                rid,
                parts: Some(parts),
            },
        })
    }

    /// Continues a suspended transaction on the worker it began on.
    pub fn resume(worker: &'w Worker, state: Suspended) -> AsyncTransaction<'w> {
        AsyncTransaction { worker, st: state }
    }

    /// Detaches the transaction's state from its worker.
    pub fn suspend(mut self) -> Suspended {
        Suspended {
            rid: self.st.rid,
            parts: self.st.parts.take(),
        }
    }

    /// The read timestamp.
    pub fn rid(&self) -> u64 {
        self.st.rid
    }

    fn p(&self) -> &Parts {
        self.st
            .parts
            .as_ref()
            .expect("a live transaction has its parts")
    }

    fn p_mut(&mut self) -> &mut Parts {
        self.st
            .parts
            .as_mut()
            .expect("a live transaction has its parts")
    }

    fn buffer(&self) -> &Region {
        &self.p().buffer
    }

    fn write_of(&self, table: u32, key: u64) -> Option<&Write> {
        self.p().write_of(table, key)
    }

    fn seen_of(&self, table: u32, key: u64) -> Option<&Seen> {
        self.p().seen_of(table, key)
    }

    /// Whether this transaction has buffered a write of `key`.
    pub fn wrote(&self, table: &Table, key: u64) -> bool {
        self.write_of(table.id, key).is_some()
    }

    /// The value of `key` in this transaction's snapshot, with its own writes applied.
    pub async fn get(&mut self, table: &Arc<Table>, key: u64) -> Result<Option<Vec<u8>>> {
        if let Some(w) = self.write_of(table.id, key) {
            return Ok(w.value.clone());
        }
        self.see(table, &[key]).await?;
        let p = self.p();
        let seen = p.seen_of(table.id, key).expect("just read");
        visible_value(seen, &p.bytes, table, key, self.st.rid)
    }

    /// The values of `keys` (each as [`AsyncTransaction::get`] returns it), read with
    /// one doorbell per memory server for the index and one for the blocks.
    pub async fn get_many(
        &mut self,
        table: &Arc<Table>,
        keys: &[u64],
    ) -> Result<Vec<Option<Vec<u8>>>> {
        self.see(table, keys).await?;
        keys.iter()
            .map(|&key| match self.write_of(table.id, key) {
                Some(w) => Ok(w.value.clone()),
                None => visible_value(
                    self.seen_of(table.id, key).expect("just read"),
                    &self.p().bytes,
                    table,
                    key,
                    self.st.rid,
                ),
            })
            .collect()
    }

    /// The CID of the version `get` would return the value of (`None` if absent): for
    /// histories and tests.
    pub async fn get_version(&mut self, table: &Arc<Table>, key: u64) -> Result<Option<u64>> {
        self.see(table, &[key]).await?;
        let rid = self.st.rid;
        match self.seen_of(table.id, key).expect("just read") {
            Seen::Absent => Ok(None),
            Seen::Block { raw, .. } => {
                match layout::visible_raw(&self.p().bytes[raw.clone()], rid, table.shape) {
                    VisibleRaw::Version {
                        cid,
                        value: Some(_),
                    } => Ok(Some(cid)),
                    VisibleRaw::Version { .. } | VisibleRaw::Absent => Ok(None),
                    VisibleRaw::TooOld => Err(TxnError::SnapshotTooOld {
                        table: table.id,
                        name: table.name.clone(),
                        key,
                        rid,
                    }),
                }
            }
        }
    }

    /// Buffers a write of `key` (an update, or a new record if the key is absent).
    pub async fn put(&mut self, table: &Arc<Table>, key: u64, value: Vec<u8>) -> Result<()> {
        self.buffer_write(table, key, Some(value), false).await
    }

    /// Buffers a new record: [`TxnError::DuplicateKey`] if the key exists in the
    /// snapshot (or this transaction wrote it), or is inserted concurrently.
    pub async fn insert(&mut self, table: &Arc<Table>, key: u64, value: Vec<u8>) -> Result<()> {
        if self.get(table, key).await?.is_some() {
            // The get sees this transaction's own write first.
            let by_this_txn = self
                .write_of(table.id, key)
                .map(|w| if w.insert { "inserted" } else { "written" });
            return Err(TxnError::DuplicateKey {
                table: table.id,
                name: table.name.clone(),
                key,
                by_this_txn,
            });
        }
        self.buffer_write(table, key, Some(value), true).await
    }

    /// Like [`AsyncTransaction::insert`], but the key's absence is checked at commit,
    /// together with the transaction's other such inserts (one doorbell per table and
    /// memory server instead of a round trip each): a key that exists makes `commit`
    /// fail with [`TxnError::DuplicateKey`], before anything is locked.
    pub async fn insert_later(
        &mut self,
        table: &Arc<Table>,
        key: u64,
        value: Vec<u8>,
    ) -> Result<()> {
        if self.seen_of(table.id, key).is_some() || self.write_of(table.id, key).is_some() {
            return self.insert(table, key, value).await;
        }
        if value.len() > table.shape.value_cap as usize {
            return Err(LayoutError::ValueTooLarge {
                len: value.len(),
                cap: table.shape.value_cap,
            }
            .into());
        }
        if key == u64::MAX {
            return Err(TxnError::Invalid("key u64::MAX is reserved".into()));
        }
        self.p_mut().writes.push(Write {
            table: table.clone(),
            key,
            value: Some(value),
            insert: true,
        });
        Ok(())
    }

    /// Reads the records of [`AsyncTransaction::insert_later`]'s inserts, batched per
    /// table; fails if one exists in the snapshot.
    async fn check_later_inserts(&mut self) -> Result<()> {
        let mut unseen: SmallVec<[(Arc<Table>, u64); 8]> = SmallVec::new();
        for w in &self.p().writes {
            if self.seen_of(w.table.id, w.key).is_none() {
                unseen.push((w.table.clone(), w.key));
            }
        }
        if unseen.is_empty() {
            return Ok(());
        }
        unseen.sort_unstable_by_key(|(t, k)| (t.id, *k));
        unseen.dedup_by_key(|(t, k)| (t.id, *k));
        self.look_up_new_keys(&unseen).await?;
        for group in unseen.chunk_by(|a, b| a.0.id == b.0.id) {
            let keys: SmallVec<[u64; 8]> = group.iter().map(|(_, k)| *k).collect();
            self.see(&group[0].0, &keys).await?;
        }
        let rid = self.st.rid;
        for (table, key) in &unseen {
            let seen = self.seen_of(table.id, *key).expect("just read");
            if visible_value(seen, &self.p().bytes, table, *key, rid)?.is_some() {
                return Err(TxnError::DuplicateKey {
                    table: table.id,
                    name: table.name.clone(),
                    key: *key,
                    by_this_txn: None,
                });
            }
        }
        Ok(())
    }

    /// The index lookups of keys to insert that the worker has no address for, all
    /// tables in one doorbell per server: a key the index does not hold is seen
    /// [`Seen::Absent`], with the slot its insert will claim. Keys the index holds, or
    /// is inserting, are left to [`AsyncTransaction::see`].
    async fn look_up_new_keys(&mut self, keys: &[(Arc<Table>, u64)]) -> Result<()> {
        let worker = self.worker;
        let p = self.p_mut();
        let mut at = 0;
        let mut places: SmallVec<[(usize, u64); 8]> = SmallVec::new();
        let mut batches = Batches::new();
        for (n, (table, key)) in keys.iter().enumerate() {
            if worker.cached_addr(table.id, *key).is_some() {
                continue;
            }
            let index = &table.partitions[table.partition_of(*key)].index;
            let bytes = index.shape.probe_bytes();
            if at + bytes > p.buffer.len() {
                break;
            }
            let server = table.partitions[table.partition_of(*key)].server;
            batches.push(
                server,
                index.bucket_read(*key, p.buffer.buf(at, bytes as u32)),
            );
            places.push((n, at));
            at += bytes;
        }
        batches.run(worker).await?;
        let mut words = BucketWords::new();
        for (n, at) in places {
            let (table, key) = &keys[n];
            let index = &table.partitions[table.partition_of(*key)].index;
            read_bucket(&p.buffer, at, index.shape.probe_bytes(), &mut words)?;
            // Unsettled by the probe: `see` reads the whole bucket.
            if index.find_probed(&words, *key)? != Some(Lookup::Absent) {
                continue;
            }
            p.add_seen(SeenEntry {
                table: table.id,
                key: *key,
                seen: Seen::Absent,
            });
            // The probe holds an empty slot: the first, which the insert claims.
            if let Ok(slot) = index.claim_slot(&words, *key) {
                p.claim_hints.push((table.id, *key, slot));
            }
        }
        Ok(())
    }

    /// Buffers the deletion of `key`: [`TxnError::NotFound`] if it does not exist in the
    /// snapshot (with this transaction's writes applied).
    pub async fn delete(&mut self, table: &Arc<Table>, key: u64) -> Result<()> {
        if self.get(table, key).await?.is_none() {
            return Err(TxnError::NotFound(format!(
                "key {key} in table {}",
                table.name
            )));
        }
        self.buffer_write(table, key, None, false).await
    }

    async fn buffer_write(
        &mut self,
        table: &Arc<Table>,
        key: u64,
        value: Option<Vec<u8>>,
        insert: bool,
    ) -> Result<()> {
        if let Some(v) = &value
            && v.len() > table.shape.value_cap as usize
        {
            return Err(LayoutError::ValueTooLarge {
                len: v.len(),
                cap: table.shape.value_cap,
            }
            .into());
        }
        if key == u64::MAX {
            return Err(TxnError::Invalid("key u64::MAX is reserved".into()));
        }
        // The commit compares against the header read now.
        self.see(table, &[key]).await?;
        if value.is_none() && matches!(self.seen_of(table.id, key), Some(Seen::Absent)) {
            // Deleting a key the snapshot lacks undoes this transaction's own insert: the
            // commit has nothing to write there (it would otherwise insert the deletion,
            // as a row with an empty value).
            self.p_mut()
                .writes
                .retain(|w| !(w.table.id == table.id && w.key == key));
            return Ok(());
        }
        match self
            .p_mut()
            .writes
            .iter_mut()
            .find(|w| w.table.id == table.id && w.key == key)
        {
            Some(w) => {
                w.value = value;
                w.insert |= insert;
            }
            None => self.p_mut().writes.push(Write {
                table: table.clone(),
                key,
                value,
                insert,
            }),
        }
        Ok(())
    }

    /// The records of `table` visible in this snapshot (with this transaction's writes
    /// applied) for which `filter(key, value)` holds, in key order.
    pub async fn scan(
        &mut self,
        table: &Arc<Table>,
        mut filter: impl FnMut(u64, &[u8]) -> bool,
    ) -> Result<Vec<(u64, Vec<u8>)>> {
        let rid = self.st.rid;
        let mut rows: BTreeMap<u64, Vec<u8>> = BTreeMap::new();
        for part in 0..table.partitions.len() {
            self.scan_partition(
                table,
                part,
                &mut |key, block| match block.visible(rid, table.shape) {
                    Visible::Version(v) => {
                        if let Some(value) = &v.value {
                            rows.insert(key, value.clone());
                        }
                        Ok(())
                    }
                    Visible::Absent => Ok(()),
                    Visible::TooOld => Err(TxnError::SnapshotTooOld {
                        table: table.id,
                        name: table.name.clone(),
                        key,
                        rid,
                    }),
                },
            )
            .await?;
        }
        for w in self.p().writes.iter().filter(|w| w.table.id == table.id) {
            match &w.value {
                Some(v) => rows.insert(w.key, v.clone()),
                None => rows.remove(&w.key),
            };
        }
        Ok(rows.into_iter().filter(|(k, v)| filter(*k, v)).collect())
    }

    /// Reads every allocated block of a partition, consistently (see the module doc),
    /// and hands each to `each`.
    async fn scan_partition(
        &self,
        table: &Table,
        part: usize,
        each: &mut impl FnMut(u64, &Block) -> Result<()>,
    ) -> Result<()> {
        let p = &table.partitions[part];
        let worker = self.worker;
        let buffer = self.buffer();
        let conn = worker.conn(p.server);
        conn.run(&[SendWr::read(0, buffer.buf(0, 8), p.data.at(p.arena))])
            .await?;
        let allocated = buffer.load_u64(0)?.min(p.capacity);
        let block_bytes = table.shape.block_bytes();
        let chunk = ((buffer.len() / 2) / block_bytes).max(1);
        let mut i = 0;
        while i < allocated {
            let n = chunk.min(allocated - i);
            let bytes = n * block_bytes;
            let remote = p.data.at(table.block_offset(part, i));
            conn.run(&[
                SendWr::read(0, buffer.buf(0, bytes as u32), remote),
                SendWr::read(0, buffer.buf(bytes, bytes as u32), remote),
            ])
            .await?;
            let first = buffer.to_vec(0, bytes as usize)?;
            let second = buffer.to_vec(bytes, bytes as usize)?;
            for b in 0..n {
                let at = (b * block_bytes) as usize;
                let raw = &first[at..at + block_bytes as usize];
                let after = u64::from_le_bytes(second[at..at + 8].try_into().expect("8 bytes"));
                let block = match layout::accept(raw, after, table.shape) {
                    Ok(block) => block,
                    Err(LayoutError::Torn { .. } | LayoutError::Locked { .. }) => {
                        let addr = table.block_offset(part, i + b);
                        // The key word never changes once written.
                        let key = layout::key_word(raw);
                        let mut bytes = Vec::new();
                        let (_, raw) =
                            read_block(worker, buffer, 0, &mut bytes, table, part, key, addr)
                                .await?;
                        layout::decode(&bytes[raw], table.shape)?
                    }
                    Err(e) => return Err(e.into()),
                };
                if !block.versions.is_empty() {
                    each(block.key, &block)?;
                }
            }
            i += n;
        }
        Ok(())
    }

    /// Reads the records of `keys` this transaction has not seen yet.
    async fn see(&mut self, table: &Arc<Table>, keys: &[u64]) -> Result<()> {
        if let [key] = keys
            && self.seen_of(table.id, *key).is_some()
        {
            return Ok(());
        }
        let mut todo: SmallVec<[u64; 4]> = keys
            .iter()
            .copied()
            .filter(|&k| self.seen_of(table.id, k).is_none())
            .collect();
        todo.sort_unstable();
        todo.dedup();
        if todo.is_empty() {
            return Ok(());
        }
        // The common case, one record whose address is cached: one doorbell.
        if let [key] = todo[..]
            && let Some(addr) = self.worker.cached_addr(table.id, key)
        {
            let part = table.partition_of(key);
            let worker = self.worker;
            let p = self.p_mut();
            let (header, raw) =
                read_block(worker, &p.buffer, 0, &mut p.bytes, table, part, key, addr).await?;
            p.add_seen(SeenEntry {
                table: table.id,
                key,
                seen: Seen::Block {
                    part,
                    addr,
                    header,
                    raw,
                },
            });
            return Ok(());
        }
        let per =
            (table.shape.block_bytes() + 8).max(table.partitions[0].index.shape.bucket_bytes());
        let chunk = (self.buffer().len() / per).max(1) as usize;
        for keys in todo.chunks(chunk) {
            let worker = self.worker;
            let p = self.p_mut();
            let found = fetch(worker, &p.buffer, &mut p.bytes, table, keys).await?;
            for (&key, seen) in keys.iter().zip(found) {
                p.add_seen(SeenEntry {
                    table: table.id,
                    key,
                    seen,
                });
            }
        }
        Ok(())
    }

    /// Ends the transaction without effect (nothing is locked before commit).
    pub fn abort(self) {}

    /// Runs the commit protocol. Returns the CID, or `None` for a read-only transaction
    /// (which takes no timestamp). On error the transaction is aborted.
    pub async fn commit(mut self) -> Result<Option<u64>> {
        let worker = self.worker;
        if self.p().writes.is_empty() {
            worker.count(|s| s.committed += 1);
            return Ok(None);
        }
        if let Err(e) = self.check_later_inserts().await {
            worker.count(|s| s.aborted += 1);
            return Err(e);
        }
        let rid = self.st.rid;
        // First committer wins, checked before taking a timestamp or any lock; and
        // the room the commit will need in the buffer.
        let mut room = CommitRoom::new(worker.database().is_durable());
        for w in &self.p().writes {
            let seen = self.seen_of(w.table.id, w.key);
            if let Some(Seen::Block { header, .. }) = seen
                && header.cid > rid
            {
                worker.count(|s| {
                    s.aborted += 1;
                    s.conflicts += 1;
                });
                return Err(TxnError::Conflict {
                    table: w.table.id,
                    name: w.table.name.clone(),
                    key: w.key,
                    why: "first committer wins: written after the snapshot",
                });
            }
            room.add(w, seen);
        }
        if let Err(e) = room.check(self.p().buffer.len(), self.p().writes.len()) {
            worker.count(|s| s.aborted += 1);
            return Err(e);
        }
        let (cid, epoch) = worker.commit_timestamp()?;
        let step = Step { cid, epoch };
        let mut held = Held::default();
        let mut parts = self
            .st
            .parts
            .take()
            .expect("a live transaction has its parts");
        let mut staging = std::mem::take(&mut parts.staging);
        let result = run_commit(worker, &parts, step, &mut held, &mut staging).await;
        parts.staging = staging;
        if let Some(at) = held.log_at {
            worker.log_finished(epoch, at);
        }
        let outcome = match result {
            Ok(()) => {
                crash::point(CrashPoint::AfterInstall, cid);
                worker.decide(cid, Outcome::Committed);
                worker.count(|s| s.committed += 1);
                Ok(Some(cid))
            }
            Err(e @ TxnError::Fenced { .. }) => {
                // The slot is fenced: its fencer decided the timestamp and recovery
                // owns the locks, so nothing of ours may be posted any more.
                worker.count(|s| s.abandoned += 1);
                worker.note_fenced(cid, epoch, held.logged);
                Err(e)
            }
            Err(e) if held.logged => {
                // The log record is complete: the transaction is committed, and what
                // it still locks is rolled forward by recovery, never released here.
                worker.break_off(cid, &e);
                worker.decide(cid, Outcome::Committed);
                worker.count(|s| s.committed += 1);
                Err(match e {
                    e @ TxnError::Persist { .. } => e,
                    cause => TxnError::CommittedUnconfirmed {
                        cid,
                        cause: Box::new(cause),
                    },
                })
            }
            Err(e) => {
                // Only a holder still under its lease may release: after a fence the
                // locks are recovery's, and a late tombstone could clobber a block that
                // recovery freed and a later insert reused.
                let inside = match worker.check_epoch(epoch, cid) {
                    Ok(inside) => inside,
                    Err(fenced @ TxnError::Fenced { .. }) => {
                        worker.count(|s| s.abandoned += 1);
                        worker.note_fenced(cid, epoch, false);
                        worker.return_parts(parts);
                        return Err(fenced);
                    }
                    Err(unchecked) => {
                        worker.count(|s| s.abandoned += 1);
                        worker.break_off_unchecked(cid, &unchecked);
                        worker.return_parts(parts);
                        return Err(unchecked);
                    }
                };
                let released = release(worker, &parts, cid, &held).await;
                drop(inside);
                if released.is_ok() {
                    // Released blocks hold a tombstone; unreachable ones can hold the
                    // next insert, or every failed insert would cost the table a block.
                    for f in held.fresh.iter().filter(|f| !f.maybe_indexed) {
                        if f.block < f.table.partitions[f.part].capacity {
                            worker.add_spare_blocks(f.table.id, f.part, f.block..f.block + 1);
                        }
                    }
                }
                worker.decide(cid, Outcome::Aborted);
                worker.count(|s| {
                    s.aborted += 1;
                    match e {
                        TxnError::Conflict { .. } => s.conflicts += 1,
                        TxnError::DuplicateKey { .. } => s.duplicate_keys += 1,
                        _ => {}
                    }
                });
                released.and(Err(e))
            }
        };
        worker.return_parts(parts);
        // Past the decision, a failure to publish it must not read as an abort.
        let unconfirmed = |cid, cause| TxnError::CommittedUnconfirmed {
            cid,
            cause: Box::new(cause),
        };
        match outcome {
            Ok(Some(cid)) if worker.database().options().wait_visible => {
                // Let the other coroutines queue their marks: one flush and one oracle
                // read then serve them all.
                yield_now().await;
                worker
                    .wait_visible(cid)
                    .await
                    .map_err(|e| unconfirmed(cid, e))?;
                Ok(Some(cid))
            }
            Ok(Some(cid)) => {
                worker.flush_marks().map_err(|e| unconfirmed(cid, e))?;
                Ok(Some(cid))
            }
            other => {
                worker.flush_marks()?;
                other
            }
        }
    }
}

impl Drop for AsyncTransaction<'_> {
    fn drop(&mut self) {
        if let Some(parts) = self.st.parts.take() {
            self.worker.return_parts(parts);
        }
    }
}

fn visible_value(
    seen: &Seen,
    bytes: &[u8],
    table: &Table,
    key: u64,
    rid: u64,
) -> Result<Option<Vec<u8>>> {
    match seen {
        Seen::Absent => Ok(None),
        Seen::Block { raw, .. } => match layout::visible_raw(&bytes[raw.clone()], rid, table.shape)
        {
            VisibleRaw::Version { value, .. } => Ok(value.map(<[u8]>::to_vec)),
            VisibleRaw::Absent => Ok(None),
            VisibleRaw::TooOld => Err(TxnError::SnapshotTooOld {
                table: table.id,
                name: table.name.clone(),
                key,
                rid,
            }),
        },
    }
}

/// Finds and reads the blocks of `keys` (distinct; they fit the buffer): index READs
/// for the keys not in the address cache in one doorbell per server, then block and
/// header READs for all in one doorbell per server, retrying the torn and the locked.
async fn fetch(
    worker: &Worker,
    buffer: &Region,
    arena: &mut Vec<u8>,
    table: &Table,
    keys: &[u64],
) -> Result<SmallVec<[Seen; 8]>> {
    let start = Instant::now();
    // A transaction reads a few records at a time: nothing here allocates for them.
    let mut addrs: SmallVec<[Option<(usize, u64)>; 8]> = keys
        .iter()
        .map(|&k| {
            let p = table.partition_of(k);
            worker.cached_addr(table.id, k).map(|a| (p, a))
        })
        .collect();
    let mut absent: SmallVec<[bool; 8]> = smallvec::smallvec![false; keys.len()];
    // Per key: whether its probe left it unsettled, so the next READ takes the bucket.
    let mut whole: SmallVec<[bool; 8]> = smallvec::smallvec![false; keys.len()];
    // The keys whose claim left pending was settled already. Only a claim pending past
    // the lock patience adds one, so the list starts empty rather than as a flag per
    // key, which a fetch of more than eight keys allocated for every time.
    let mut settled: SmallVec<[usize; 1]> = SmallVec::new();
    // Index lookups, again for slots still being inserted.
    loop {
        let missing: SmallVec<[usize; 8]> = (0..keys.len())
            .filter(|&i| addrs[i].is_none() && !absent[i])
            .collect();
        if missing.is_empty() {
            break;
        }
        let mut batches = Batches::new();
        let mut at = 0;
        // Per missing key: where its READ lands and how many bytes it took.
        let mut places: SmallVec<[(u64, u64); 8]> = SmallVec::new();
        for &i in &missing {
            let p = &table.partitions[table.partition_of(keys[i])];
            let bytes = if whole[i] {
                p.index.shape.bucket_bytes()
            } else {
                p.index.shape.probe_bytes()
            };
            batches.push(
                p.server,
                p.index.bucket_read(keys[i], buffer.buf(at, bytes as u32)),
            );
            places.push((at, bytes));
            at += bytes;
        }
        batches.run(worker).await?;
        // A key whose slot is claimed with no address yet (an insert in progress).
        let mut pending = None;
        let mut words = BucketWords::new();
        for (&i, &(at, bytes)) in missing.iter().zip(&places) {
            let part = table.partition_of(keys[i]);
            let index = &table.partitions[part].index;
            read_bucket(buffer, at, bytes, &mut words)?;
            match index.find_probed(&words, keys[i])? {
                Some(Lookup::Found(a)) => {
                    worker.cache_addr(table.id, keys[i], a);
                    addrs[i] = Some((part, a));
                }
                Some(Lookup::Absent) => absent[i] = true,
                Some(Lookup::Pending) => pending = Some(i),
                None => whole[i] = true,
            }
        }
        if let Some(i) = pending {
            if start.elapsed() > LOCK_PATIENCE {
                // A claim names no one: its claimer's locked block does, or its
                // absence says the claimer is gone and the slot needs settling.
                if !settled.contains(&i) {
                    let part = table.partition_of(keys[i]);
                    match worker
                        .database()
                        .settle_pending_claim(table, part, keys[i])?
                    {
                        PendingClaim::Held(holder) => worker.suspect_holder(holder),
                        PendingClaim::Settled => {
                            // Look again: the slot has an address now.
                            settled.push(i);
                            continue;
                        }
                    }
                }
                return Err(TxnError::Conflict {
                    table: table.id,
                    name: table.name.clone(),
                    key: keys[i],
                    why: "index slot pending too long",
                });
            }
            yield_now().await;
        }
    }
    // Block reads: block, then its header again, per key; torn or locked ones again.
    let block_bytes = table.shape.block_bytes();
    // Per key: the accepted block's header and where its bytes are in the arena.
    type Accepted = Option<(Header, Range<usize>)>;
    let mut blocks: SmallVec<[Accepted; 8]> = smallvec::smallvec![None; keys.len()];
    loop {
        let todo: SmallVec<[usize; 8]> = (0..keys.len())
            .filter(|&i| addrs[i].is_some() && blocks[i].is_none())
            .collect();
        if todo.is_empty() {
            break;
        }
        let mut batches = Batches::new();
        for (slot, &i) in todo.iter().enumerate() {
            let (part, addr) = addrs[i].expect("has an address");
            let p = &table.partitions[part];
            let at = slot as u64 * (block_bytes + 8);
            batches.push(
                p.server,
                SendWr::read(0, buffer.buf(at, block_bytes as u32), p.data.at(addr)),
            );
            batches.push(
                p.server,
                SendWr::read(0, buffer.buf(at + block_bytes, 8), p.data.at(addr)),
            );
        }
        batches.run(worker).await?;
        let mut retry = None;
        for (slot, &i) in todo.iter().enumerate() {
            let at = slot as u64 * (block_bytes + 8);
            let raw = copy_to_arena(buffer, at, block_bytes, arena)?;
            let after = buffer.load_u64(at + block_bytes)?;
            match layout::accept_raw(&arena[raw.clone()], after, table.shape) {
                Ok(header) => blocks[i] = Some((header, raw)),
                Err(e) => {
                    arena.truncate(raw.start);
                    match e {
                        LayoutError::Torn { .. } => worker.count(|s| s.torn_retries += 1),
                        LayoutError::Locked { holder } => {
                            worker.count(|s| s.locked_retries += 1);
                            retry = Some((i, holder));
                        }
                        e => return Err(e.into()),
                    }
                }
            }
        }
        if let Some((i, holder)) = retry
            && start.elapsed() > LOCK_PATIENCE
        {
            worker.suspect_holder(holder);
            return Err(TxnError::Conflict {
                table: table.id,
                name: table.name.clone(),
                key: keys[i],
                why: "record locked too long",
            });
        }
        if blocks
            .iter()
            .zip(&addrs)
            .any(|(b, a)| a.is_some() && b.is_none())
        {
            yield_now().await;
        }
    }
    Ok(addrs
        .into_iter()
        .zip(blocks)
        .map(|(addr, block)| match (addr, block) {
            (Some((part, addr)), Some((header, raw))) => Seen::Block {
                part,
                addr,
                header,
                raw,
            },
            _ => Seen::Absent,
        })
        .collect())
}

/// A bucket's words as READ into a transaction's buffer; a 32-slot bucket's fit inline.
type BucketWords = SmallVec<[u64; 64]>;

/// Copies `bytes` of a bucket (all of it, or a probe) READ at `at` of `buffer` into
/// `words`.
fn read_bucket(buffer: &Region, at: u64, bytes: u64, words: &mut BucketWords) -> Result<()> {
    words.clear();
    words.resize((bytes / 8) as usize, 0);
    Ok(buffer.read_words(at, words)?)
}

/// Appends `len` bytes of `buffer` from `at` to `arena`: where they are.
fn copy_to_arena(buffer: &Region, at: u64, len: u64, arena: &mut Vec<u8>) -> Result<Range<usize>> {
    let start = arena.len();
    arena.resize(start + len as usize, 0);
    buffer.read(at, &mut arena[start..])?;
    Ok(start..arena.len())
}

/// The seqlock read of one block, into `buffer` at `at`: retried until both headers
/// are equal and unlocked. Returns the header and where the block's bytes (validated)
/// are in `arena`.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn read_block(
    worker: &Worker,
    buffer: &Region,
    at: u64,
    arena: &mut Vec<u8>,
    table: &Table,
    part: usize,
    key: u64,
    addr: u64,
) -> Result<(Header, Range<usize>)> {
    let p = &table.partitions[part];
    let bytes = table.shape.block_bytes();
    let mut start = None;
    loop {
        worker
            .conn(p.server)
            .run(&[
                SendWr::read(0, buffer.buf(at, bytes as u32), p.data.at(addr)),
                SendWr::read(0, buffer.buf(at + bytes, 8), p.data.at(addr)),
            ])
            .await?;
        let raw = copy_to_arena(buffer, at, bytes, arena)?;
        let after = buffer.load_u64(at + bytes)?;
        let accepted = layout::accept_raw(&arena[raw.clone()], after, table.shape);
        if accepted.is_err() {
            arena.truncate(raw.start);
        }
        match accepted {
            Ok(header) => return Ok((header, raw)),
            Err(LayoutError::Torn { .. }) => worker.count(|s| s.torn_retries += 1),
            Err(LayoutError::Locked { holder }) => {
                worker.count(|s| s.locked_retries += 1);
                if start.get_or_insert_with(Instant::now).elapsed() > LOCK_PATIENCE {
                    worker.suspect_holder(holder);
                    return Err(TxnError::Conflict {
                        table: table.id,
                        name: table.name.clone(),
                        key,
                        why: "record locked too long",
                    });
                }
            }
            Err(e) => return Err(e.into()),
        }
        yield_now().await;
    }
}

/// What a commit holds, for the abort path.
#[derive(Default)]
struct Held {
    /// Updated records locked by this commit: indices into the write set.
    locked: SmallVec<[usize; 4]>,
    /// New blocks this commit wrote locked (published in the index or not): (table,
    /// partition, addr, key).
    created: Vec<(Arc<Table>, usize, u64, u64)>,
    /// Blocks this commit allocated for its inserts, in insert order; those no index
    /// slot can point to go back to the worker's spare blocks if the commit fails.
    fresh: SmallVec<[FreshBlock; 4]>,
    /// Where the commit's log record is in the worker's ring, once placed.
    log_at: Option<u64>,
    /// The log record is complete: the transaction is committed whatever happens next.
    logged: bool,
}

/// A block a commit allocated for an insert.
struct FreshBlock {
    table: Arc<Table>,
    part: usize,
    block: u64,
    /// A claim or index insert naming it was posted and not seen to fail: an index slot
    /// may point at it, so it is never reused.
    maybe_indexed: bool,
}

/// Where a commit's insert gets its block.
#[derive(Clone, Copy)]
enum Allocation {
    /// One the worker allocated ahead.
    Spare { part: usize, block: u64 },
    /// The first of `chunk` blocks a FETCH_ADD returns at `at` of the buffer.
    Fetched { part: usize, at: u64, chunk: u64 },
}

/// How a commit's insert claims its index slot.
#[derive(Clone, Copy)]
enum BucketClaim {
    /// In the slot the transaction's lookup found for it.
    Slot(u64),
    /// In the bucket READ at this offset of the buffer.
    Read(u64),
    /// With [`RemoteIndex::insert`], after the batch.
    OneByOne,
}

/// An index slot a commit's batched insert won, with the address to publish in it.
struct WonSlot {
    server: usize,
    index: RemoteIndex,
    /// The slot's offset in the index region.
    slot: u64,
    /// The block's address, as the slot's address word.
    address: AddressWord,
}

/// The WRITEs that publish the addresses of won index slots.
fn publish_writes(won: &[WonSlot]) -> Batches<'_> {
    let mut batches = Batches::new();
    for slot in won {
        batches.push(
            slot.server,
            slot.index.publish_write(slot.slot, &slot.address),
        );
    }
    batches
}

/// Publishes the addresses of won index slots, one doorbell per server, off the
/// lock step's path: after a failed claim or a failed lease check, so possibly fenced.
/// By CAS from no address rather than WRITE: once fenced, recovery may have resolved
/// the block, and a slot it could not settle then is settled by the first reader
/// that finds no claimer's lock ([`crate::Database::settle_pending_claim`]), with
/// another block a later insert of the key may already hold; a late WRITE would
/// point the key back at the tombstone and lose that insert.
async fn publish(worker: &Worker, buffer: &Region, won: &[WonSlot]) -> Result<()> {
    let mut area = Area::new(buffer);
    let mut batches = Batches::new();
    for slot in won {
        let res = area.take(8)?;
        batches.push(
            slot.server,
            slot.index
                .publish_cas(slot.slot, slot.address, buffer.buf(res, 8)),
        );
    }
    batches.run(worker).await
}

/// What losing an index insert means to the commit.
fn index_error(w: &Write, e: crate::index::IndexError) -> TxnError {
    match e {
        crate::index::IndexError::DuplicateKey { .. } => duplicate_error(w),
        e => e.into(),
    }
}

/// The key of `w` is in the index already: a second `insert` of a key is
/// `DuplicateKey`; a `put` racing an insert of the key is a `Conflict`.
fn duplicate_error(w: &Write) -> TxnError {
    if w.insert {
        TxnError::DuplicateKey {
            table: w.table.id,
            name: w.table.name.clone(),
            key: w.key,
            by_this_txn: None,
        }
    } else {
        TxnError::Conflict {
            table: w.table.id,
            name: w.table.name.clone(),
            key: w.key,
            why: "inserted concurrently",
        }
    }
}

/// What the log record says of a new block: (table, partition, key, addr, value).
type LoggedInsert<'a> = (u32, usize, u64, u64, &'a [u8]);

async fn run_commit(
    worker: &Worker,
    st: &Parts,
    step: Step,
    held: &mut Held,
    staging: &mut Vec<u8>,
) -> Result<()> {
    let cid = step.cid;
    let buffer = &st.buffer;
    let locked = Header::locked_by(cid).encode();
    let seen = |w: &Write| st.seen_of(w.table.id, w.key);
    // New records: allocate (from the worker's spare blocks, or one FETCH_ADD for a
    // few), write the blocks locked, publish them in the index.
    // What the log record says of the new blocks: (table, partition, key, addr).
    let mut logged_inserts: SmallVec<[LoggedInsert<'_>; 4]> = SmallVec::new();
    let durable = worker.database().is_durable();
    let inserts: SmallVec<[&Write; 8]> = st
        .writes
        .iter()
        .filter(|w| matches!(seen(w), Some(Seen::Absent)))
        .collect();
    // Index slots this commit won and has yet to publish: their address WRITEs go in
    // the lock step's doorbell.
    let mut won: SmallVec<[WonSlot; 4]> = SmallVec::new();
    if !inserts.is_empty() {
        // Unarmed, all inserts share three doorbells per server: the allocations (with
        // the READ of any bucket the transaction's lookup did not leave a slot for),
        // the blocks' WRITEs with the slots' claims, and the addresses with the locks;
        // one at a time, four inserts took fourteen round trips. With crash points
        // armed, inserts go one at a time so a crash can land between the steps; an
        // insert whose bucket another insert of the batch claims in, or whose claim
        // loses a race, goes one at a time after the batch.
        let batched = !crash::armed();
        let mut area = Area::new(buffer);
        let mut counters: SmallVec<[Allocation; 8]> = SmallVec::new();
        let mut bucket_claims: SmallVec<[BucketClaim; 4]> = SmallVec::new();
        let mut buckets_claimed: SmallVec<[(u32, usize, u64); 4]> = SmallVec::new();
        let mut batches = Batches::new();
        for w in &inserts {
            let part = w.table.partition_of(w.key);
            let p = &w.table.partitions[part];
            match worker.take_spare_block(w.table.id, part) {
                Some(block) => counters.push(Allocation::Spare { part, block }),
                None => {
                    let at = area.take(8)?;
                    let chunk = crate::worker::allocation_chunk(p.capacity);
                    batches.push(
                        p.server,
                        SendWr::fetch_add(0, buffer.buf(at, 8), p.data.at(p.arena), chunk),
                    );
                    counters.push(Allocation::Fetched { part, at, chunk });
                }
            }
            let bucket = (w.table.id, part, p.index.shape.bucket_of(w.key));
            if !batched || buckets_claimed.contains(&bucket) {
                bucket_claims.push(BucketClaim::OneByOne);
                continue;
            }
            if let Some(slot) = st.claim_hint(w.table.id, w.key) {
                buckets_claimed.push(bucket);
                bucket_claims.push(BucketClaim::Slot(slot));
                continue;
            }
            let bytes = p.index.shape.bucket_bytes();
            match area.take(bytes) {
                Ok(at) => {
                    buckets_claimed.push(bucket);
                    batches.push(
                        p.server,
                        p.index.bucket_read(w.key, buffer.buf(at, bytes as u32)),
                    );
                    bucket_claims.push(BucketClaim::Read(at));
                }
                Err(_) => bucket_claims.push(BucketClaim::OneByOne),
            }
        }
        batches.run_step(worker, step).await?;
        let mut blocks: SmallVec<[(usize, u64); 8]> = SmallVec::new();
        for (w, allocation) in inserts.iter().zip(&counters) {
            match *allocation {
                Allocation::Spare { part, block } => blocks.push((part, block)),
                Allocation::Fetched { part, at, chunk } => {
                    let first = buffer.load_u64(at)?;
                    blocks.push((part, first));
                    let end = first
                        .saturating_add(chunk)
                        .min(w.table.partitions[part].capacity);
                    worker.add_spare_blocks(w.table.id, part, first.saturating_add(1)..end);
                }
            }
        }
        // Claims: the first empty slot of each bucket READ. A claim that fails here
        // (a duplicate, a full bucket) fails the commit after the blocks are written,
        // so the abort path finds them all; no slot is claimed then.
        let fresh = held.fresh.len();
        held.fresh.extend(
            inserts
                .iter()
                .zip(&blocks)
                .map(|(w, &(part, block))| FreshBlock {
                    table: w.table.clone(),
                    part,
                    block,
                    maybe_indexed: false,
                }),
        );
        let mut claims: SmallVec<[Option<u64>; 4]> = SmallVec::new();
        let mut claim_error = None;
        let mut words = BucketWords::new();
        for (w, claim) in inserts.iter().zip(&bucket_claims) {
            let at = match *claim {
                BucketClaim::OneByOne => {
                    claims.push(None);
                    continue;
                }
                BucketClaim::Slot(slot) => {
                    claims.push(Some(slot));
                    continue;
                }
                BucketClaim::Read(at) => at,
            };
            let p = &w.table.partitions[w.table.partition_of(w.key)];
            read_bucket(buffer, at, p.index.shape.bucket_bytes(), &mut words)?;
            match p.index.claim_slot(&words, w.key) {
                Ok(slot) => claims.push(Some(slot)),
                Err(e) => {
                    claim_error.get_or_insert(index_error(w, e));
                    claims.push(None);
                }
            }
        }
        let mut area = Area::new(buffer);
        let mut batches = Batches::new();
        let mut placed: SmallVec<[(usize, u64); 8]> = SmallVec::new();
        for (w, &(part, i)) in inserts.iter().zip(&blocks) {
            let p = &w.table.partitions[part];
            if i >= p.capacity {
                return Err(TxnError::TableFull {
                    table: w.table.id,
                    name: w.table.name.clone(),
                    capacity: w.table.capacity(),
                });
            }
            let addr = w.table.block_offset(part, i);
            layout::encode_inserted_into(
                Header::locked_by(cid),
                w.key,
                cid,
                w.value.as_deref().unwrap_or_default(),
                w.table.shape,
                staging,
            )?;
            let at = area.take(staging.len() as u64)?;
            buffer.write(at, staging)?;
            batches.push(
                p.server,
                SendWr::write(0, buffer.buf(at, staging.len() as u32), p.data.at(addr)),
            );
            placed.push((part, addr));
        }
        // Each claim's CAS goes after its block's WRITE on the same queue pair: the
        // slot's address, written only once the claim is won, never points at an
        // unwritten block.
        let mut claim_results: SmallVec<[Option<u64>; 4]> = SmallVec::new();
        for (n, (w, claim)) in inserts.iter().zip(&claims).enumerate() {
            let result = match (claim, &claim_error) {
                (Some(slot), None) => {
                    held.fresh[fresh + n].maybe_indexed = true;
                    let p = &w.table.partitions[w.table.partition_of(w.key)];
                    let res = area.take(8)?;
                    batches.push(
                        p.server,
                        p.index.claim_cas(*slot, w.key, buffer.buf(res, 8))?,
                    );
                    Some(res)
                }
                _ => None,
            };
            claim_results.push(result);
        }
        for (w, &(part, addr)) in inserts.iter().zip(&placed) {
            held.created.push((w.table.clone(), part, addr, w.key));
            // A durable cluster logs the value: a restart may lose the block.
            let value = if durable {
                w.value.as_deref().unwrap_or(&[])
            } else {
                &[]
            };
            logged_inserts.push((w.table.id, part, w.key, addr, value));
        }
        batches.run_step(worker, step).await?;
        crash::point(CrashPoint::AfterInsertBlocks, cid);
        if let Some(e) = claim_error {
            return Err(e);
        }
        let mut one_by_one: SmallVec<[usize; 4]> = SmallVec::new();
        for (n, (w, result)) in inserts.iter().zip(&claim_results).enumerate() {
            let (part, addr) = placed[n];
            let Some(res) = result else {
                one_by_one.push(n);
                continue;
            };
            match RemoteIndex::claimed(buffer.load_u64(*res)?, w.key)? {
                Claimed::Won => won.push(WonSlot {
                    server: w.table.partitions[part].server,
                    index: w.table.partitions[part].index,
                    slot: claims[n].expect("claimed"),
                    address: AddressWord::of(addr),
                }),
                Claimed::Duplicate => {
                    held.fresh[fresh + n].maybe_indexed = false;
                    claim_error.get_or_insert(duplicate_error(w));
                }
                Claimed::Lost => {
                    held.fresh[fresh + n].maybe_indexed = false;
                    one_by_one.push(n);
                }
            }
        }
        if claim_error.is_some() || !one_by_one.is_empty() {
            // Won slots are published before anything else can fail.
            publish(worker, buffer, &won).await?;
            won.clear();
        }
        if let Some(e) = claim_error {
            return Err(e);
        }
        let index_at = Area::new(buffer).take(0)?;
        for n in one_by_one {
            let w = inserts[n];
            let (part, addr) = placed[n];
            let p = &w.table.partitions[part];
            let inside = worker.check_epoch(step.epoch, cid)?;
            held.fresh[fresh + n].maybe_indexed = true;
            let inserted = p
                .index
                .insert(worker.conn(p.server), buffer, index_at, w.key, addr)
                .await;
            drop(inside);
            match inserted {
                Ok(()) => {}
                Err(e) => return Err(index_error(w, e)),
            }
        }
        crash::point(CrashPoint::AfterIndex, cid);
    }
    // Lock and validate the updated records: one CAS each, one doorbell per server.
    let mut area = Area::new(buffer);
    let mut updates: SmallVec<[_; 4]> = SmallVec::new();
    for (wi, w) in st.writes.iter().enumerate() {
        if let Some(Seen::Block {
            part,
            addr,
            header,
            raw,
        }) = seen(w)
        {
            let res = area.take(8)?;
            updates.push((wi, w, *part, *addr, (*header, &st.bytes[raw.clone()]), res));
        }
    }
    if !updates.is_empty() || !won.is_empty() {
        let mut batches = publish_writes(&won);
        for (_, w, part, addr, block, res) in &updates {
            let p = &w.table.partitions[*part];
            batches.push(
                p.server,
                SendWr::cas(
                    0,
                    buffer.buf(*res, 8),
                    p.data.at(*addr),
                    block.0.encode(),
                    locked,
                ),
            );
        }
        let inside = match worker.check_epoch(step.epoch, cid) {
            Ok(inside) => inside,
            Err(e) => {
                // A won slot gets its address whatever happens, or its key stays
                // pending.
                publish(worker, buffer, &won).await?;
                return Err(e);
            }
        };
        batches.run(worker).await?;
        drop(inside);
        let mut conflict = None;
        for (wi, w, _, _, block, res) in &updates {
            let found = buffer.load_u64(*res)?;
            if found == block.0.encode() {
                held.locked.push(*wi);
            } else {
                let found = Header::decode(found);
                if found.locked {
                    worker.suspect_holder(found.cid);
                }
                if conflict.is_none() {
                    conflict = Some((&w.table, w.key));
                }
            }
        }
        if let Some((table, key)) = conflict {
            return Err(TxnError::Conflict {
                table: table.id,
                name: table.name.clone(),
                key,
                why: "record locked or changed since it was read",
            });
        }
    }
    crash::point(CrashPoint::AfterLock, cid);
    // The commit record, before any install: from here the transaction is committed.
    let entries: SmallVec<[EntryRef<'_>; 8]> = logged_inserts
        .iter()
        .map(|&(table, part, key, addr, value)| EntryRef {
            table,
            part,
            kind: EntryKind::Insert,
            key,
            addr,
            value,
        })
        .chain(updates.iter().map(|(_, w, part, addr, _, _)| EntryRef {
            table: w.table.id,
            part: *part,
            kind: if w.value.is_some() {
                EntryKind::Update
            } else {
                EntryKind::Delete
            },
            key: w.key,
            addr: *addr,
            value: w.value.as_deref().unwrap_or(&[]),
        }))
        .collect();
    commitlog::encode_into(cid, &entries, staging);
    let record = &staging[..];
    let (log_at, remote) = loop {
        match worker.log_place(step.epoch, cid, record.len() as u64)? {
            Some(placed) => break placed,
            None => yield_now().await,
        }
    };
    held.log_at = Some(log_at);
    let staged = area.take(record.len() as u64)?;
    buffer.write(staged, record)?;
    let mut batches = Batches::new();
    batches.push(
        commitlog::SERVER,
        SendWr::write(0, buffer.buf(staged, record.len() as u32), remote),
    );
    batches.run_step(worker, step).await?;
    held.logged = true;
    if durable {
        // Durable before any install: whatever a restart keeps of the installs
        // (on a server that did not restart) has its record behind it.
        let mut plan = PersistPlan::default();
        plan.add(
            commitlog::SERVER,
            PersistRange::plain(remote, record.len() as u64),
        );
        worker.persist(plan).await?;
    }
    crash::point(CrashPoint::AfterLog, cid);
    let fault = &worker.database().shared.fail_after_log;
    // A load first: the swap alone would be a contended write on every commit.
    if fault.load(std::sync::atomic::Ordering::Relaxed)
        && fault.swap(false, std::sync::atomic::Ordering::Relaxed)
    {
        return Err(TxnError::Invalid(format!(
            "commit {cid}: a failure injected after its log record"
        )));
    }
    // Install: WRITE the versions and CAS-unlock, one doorbell per server. With crash
    // points armed, in two halves, so a crash can land between them.
    let split = if crash::armed() {
        (updates.len() + held.created.len()) / 2
    } else {
        usize::MAX
    };
    let mut halves = [Batches::new(), Batches::new()];
    let mut installed = 0;
    let mut results: SmallVec<[_; 4]> = SmallVec::new();
    let unlock = |batches: &mut Batches<'_>, p: &crate::store::Partition, addr: u64, res: u64| {
        batches.push(
            p.server,
            SendWr::cas(
                0,
                buffer.buf(res, 8),
                p.data.at(addr),
                locked,
                Header::unlocked(cid).encode(),
            ),
        );
    };
    for (_, w, part, addr, block, _) in &updates {
        let p = &w.table.partitions[*part];
        let len = (w.table.shape.block_bytes() - VERSIONS_OFFSET) as usize;
        // write_installed writes every byte: no need to zero what is reused.
        if staging.len() < len {
            staging.resize(len, 0);
        }
        let bytes = &mut staging[..len];
        layout::write_installed(block.1, cid, w.value.as_deref(), w.table.shape, bytes)?;
        let at = area.take(bytes.len() as u64)?;
        buffer.write(at, bytes)?;
        let res = area.take(8)?;
        let batches = &mut halves[usize::from(installed >= split)];
        installed += 1;
        batches.push(
            p.server,
            SendWr::write(
                0,
                buffer.buf(at, bytes.len() as u32),
                p.data.at(addr + VERSIONS_OFFSET),
            ),
        );
        unlock(batches, p, *addr, res);
        results.push((*addr, res));
    }
    for (table, part, addr, _) in &held.created {
        let p = &table.partitions[*part];
        let res = area.take(8)?;
        let batches = &mut halves[usize::from(installed >= split)];
        installed += 1;
        unlock(batches, p, *addr, res);
        results.push((*addr, res));
    }
    halves[0]
        .run_step_past(worker, step, Some(CrashPoint::InstallPosting))
        .await?;
    crash::point(CrashPoint::MidInstall, cid);
    halves[1].run_step(worker, step).await?;
    // From here the commit is visible to readers; it must be marked committed.
    let plan = durable.then(|| {
        let mut plan = PersistPlan::default();
        for (_, w, part, addr, _, _) in &updates {
            add_block(&mut plan, w.table.as_ref(), *part, *addr);
        }
        for (table, part, addr, key) in &held.created {
            add_insert(&mut plan, table, *part, *addr, *key);
        }
        plan
    });
    held.locked.clear();
    held.created.clear();
    for (addr, res) in results {
        let old = buffer.load_u64(res)?;
        if old != locked {
            return Err(TxnError::Invalid(format!(
                "lock of block {addr} lost during install (header {old:#x})"
            )));
        }
    }
    if let Some(plan) = plan {
        // Before the acknowledgement, and before the record's ring space is reused.
        worker.persist(plan).await?;
    }
    Ok(())
}

/// Adds a block (its header guards the copy) to a persist plan.
pub(crate) fn add_block(plan: &mut PersistPlan, table: &Table, part: usize, addr: u64) {
    let p = &table.partitions[part];
    plan.add(
        p.server,
        PersistRange::block(p.data.at(addr), table.shape.block_bytes()),
    );
}

/// Adds a block a commit created, with what makes it reachable: the arena counter
/// that allocated it and the index bucket of its key.
pub(crate) fn add_insert(plan: &mut PersistPlan, table: &Table, part: usize, addr: u64, key: u64) {
    add_block(plan, table, part, addr);
    let p = &table.partitions[part];
    plan.add(p.server, PersistRange::plain(p.data.at(p.arena), 8));
    let (bucket, len) = p.index.bucket_range(key);
    plan.add(p.server, PersistRange::plain(bucket, len));
}

/// The abort path: releases every lock a failed commit holds, one doorbell per server.
async fn release(worker: &Worker, st: &Parts, cid: u64, held: &Held) -> Result<()> {
    let buffer = &st.buffer;
    let locked = Header::locked_by(cid).encode();
    let mut area = Area::new(buffer);
    let mut staged = Vec::new();
    for (table, _, _, _) in &held.created {
        let bytes = layout::encode_versions(
            &[Version {
                cid: 0,
                value: None,
            }],
            table.shape,
        )?;
        let at = area.take(bytes.len() as u64)?;
        buffer.write(at, &bytes)?;
        staged.push((at, bytes.len() as u32));
    }
    let res = area.take(8)?;
    let mut batches = Batches::new();
    for ((table, part, addr, _), (at, len)) in held.created.iter().zip(&staged) {
        let p = &table.partitions[*part];
        batches.push(
            p.server,
            SendWr::write(0, buffer.buf(*at, *len), p.data.at(addr + VERSIONS_OFFSET)),
        );
        batches.push(
            p.server,
            SendWr::cas(
                0,
                buffer.buf(res, 8),
                p.data.at(*addr),
                locked,
                Header::unlocked(0).encode(),
            ),
        );
    }
    for &wi in &held.locked {
        let w = &st.writes[wi];
        if let Some(Seen::Block {
            part, addr, header, ..
        }) = st.seen_of(w.table.id, w.key)
        {
            let p = &w.table.partitions[*part];
            batches.push(
                p.server,
                SendWr::cas(
                    0,
                    buffer.buf(res, 8),
                    p.data.at(*addr),
                    locked,
                    header.encode(),
                ),
            );
        }
    }
    batches.run(worker).await?;
    if worker.database().is_durable() && !held.created.is_empty() {
        // A durable cluster keeps the tombstones of created blocks, so that index
        // entries and counters a restart keeps never point at lost blocks.
        let mut plan = PersistPlan::default();
        for (table, part, addr, key) in &held.created {
            add_insert(&mut plan, table, *part, *addr, *key);
        }
        worker.persist(plan).await?;
    }
    Ok(())
}

/// A blocking transaction of a [`crate::Client`]: [`AsyncTransaction`] driven by
/// `block_on`. Its commit advances the client's session.
pub struct Transaction<'c> {
    inner: AsyncTransaction<'c>,
    last_cid: &'c mut u64,
}

impl<'c> Transaction<'c> {
    pub(crate) fn new(inner: AsyncTransaction<'c>, last_cid: &'c mut u64) -> Transaction<'c> {
        Transaction { inner, last_cid }
    }

    pub fn rid(&self) -> u64 {
        self.inner.rid()
    }
    pub fn wrote(&self, table: &Table, key: u64) -> bool {
        self.inner.wrote(table, key)
    }
    pub fn get(&mut self, table: &Arc<Table>, key: u64) -> Result<Option<Vec<u8>>> {
        block_on(self.inner.get(table, key))
    }
    pub fn get_many(&mut self, table: &Arc<Table>, keys: &[u64]) -> Result<Vec<Option<Vec<u8>>>> {
        block_on(self.inner.get_many(table, keys))
    }
    pub fn get_version(&mut self, table: &Arc<Table>, key: u64) -> Result<Option<u64>> {
        block_on(self.inner.get_version(table, key))
    }
    pub fn put(&mut self, table: &Arc<Table>, key: u64, value: Vec<u8>) -> Result<()> {
        block_on(self.inner.put(table, key, value))
    }
    pub fn insert(&mut self, table: &Arc<Table>, key: u64, value: Vec<u8>) -> Result<()> {
        block_on(self.inner.insert(table, key, value))
    }
    pub fn delete(&mut self, table: &Arc<Table>, key: u64) -> Result<()> {
        block_on(self.inner.delete(table, key))
    }
    pub fn scan(
        &mut self,
        table: &Arc<Table>,
        filter: impl FnMut(u64, &[u8]) -> bool,
    ) -> Result<Vec<(u64, Vec<u8>)>> {
        block_on(self.inner.scan(table, filter))
    }
    /// See [`AsyncTransaction::commit`].
    pub fn commit(self) -> Result<Option<u64>> {
        let cid = block_on(self.inner.commit())?;
        if let Some(c) = cid {
            *self.last_cid = (*self.last_cid).max(c);
        }
        Ok(cid)
    }
    pub fn abort(self) {}

    /// Detaches the transaction from its client, for drivers that keep a transaction
    /// between calls without borrowing the client; [`crate::Client::resume`] continues
    /// it.
    pub fn suspend(self) -> Suspended {
        self.inner.suspend()
    }
}
