//! A transaction: snapshot reads at RID, buffered writes, and the RSI commit protocol
//! (DESIGN.md, "RSI").
//!
//! - **Read.** The block is found through the address cache or one index READ, then
//!   READ together with its header word in one doorbell; the block is accepted only if
//!   both headers are equal and unlocked (seqlock, [`crate::layout::accept`]), else
//!   re-read. The newest version with CID ≤ RID is returned; none kept is
//!   [`TxnError::SnapshotTooOld`]. A record is read once per transaction (later reads
//!   return the same snapshot), and a transaction sees its own writes.
//! - **Commit.** (1) CID from the client's slot, no communication. (2) New records:
//!   FETCH_ADD on the table's arena counter, WRITE the block locked by CID, CAS the index
//!   slot from empty (a concurrent insert of the key loses: `DuplicateKey` for
//!   [`Transaction::insert`], `Conflict` for a `put`). (3) Lock and validate every
//!   updated record with one CAS each, all in one doorbell, expecting the header read
//!   (unlocked, CID ≤ RID); a header read with CID above RID aborts before any CAS
//!   (first committer wins). (4) Install: per record a WRITE of the versions (new one at
//!   the head, older ones shifted) and a CAS of the header from locked to `CID`, all in
//!   one doorbell. (5) Mark CID committed, one unsignaled FETCH_ADD.
//!   With `Options::wait_visible` (the default), commit then waits until the oracle's
//!   prefix includes CID, so transactions that begin after it returns see it.
//! - **Abort** (in commit, or [`Transaction::abort`]): every lock taken is released with
//!   CAS to the header it replaced; a new record's block becomes a tombstone at CID 0
//!   (its index slot stays, so a later insert of the key reuses the block); the CID is
//!   still marked (aborted), or the prefix would stall.
//!
//! Not implemented yet: the crash-atomic commit record (DESIGN.md step 3) and recovery
//! of a dead node's locks (a reader blocked by a lock for over a second gets
//! `Conflict`), deletes, scans, `get_many`.

use crate::error::{Result, TxnError};
use crate::index::Lookup;
use crate::layout::{self, Block, Header, LayoutError, Version, Visible};
use crate::store::{COMMIT_AREA, Client, READ_AREA, SCRATCH_BYTES, Table};
use fabric::SendWr;
use std::borrow::BorrowMut;
use std::collections::{BTreeMap, HashMap};
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
    /// Its block at `addr`, as read (unlocked).
    Block { addr: u64, block: Block },
}

#[derive(Clone, Debug)]
struct Write {
    table: Arc<Table>,
    value: Vec<u8>,
    /// Made by `insert`: losing an index race is `DuplicateKey`, not `Conflict`.
    insert: bool,
}

/// A transaction of one [`Client`]; it ends with [`Transaction::commit`] or
/// [`Transaction::abort`] (dropping it unfinished aborts: nothing is locked before
/// commit, so nothing needs releasing).
///
/// `C` is how it holds its client: `&mut Client` from [`Client::begin`], or the
/// `Client` itself from [`Client::begin_owned`] (for drivers whose transactions must
/// not borrow their session), handed back by [`Transaction::commit_into`] and
/// [`Transaction::abort`].
pub struct Transaction<C: BorrowMut<Client>> {
    client: C,
    rid: u64,
    seen: HashMap<(u32, u64), Seen>,
    writes: BTreeMap<(u32, u64), Write>,
}

impl<C: BorrowMut<Client>> Transaction<C> {
    pub(crate) fn new(client: C, rid: u64) -> Transaction<C> {
        Transaction {
            client,
            rid,
            seen: HashMap::new(),
            writes: BTreeMap::new(),
        }
    }

    /// The read timestamp.
    pub fn rid(&self) -> u64 {
        self.rid
    }

    /// Whether this transaction has buffered a write of `key`.
    pub fn wrote(&self, table: &Table, key: u64) -> bool {
        self.writes.contains_key(&(table.id, key))
    }

    /// The value of `key` in this transaction's snapshot, with its own writes applied.
    pub fn get(&mut self, table: &Arc<Table>, key: u64) -> Result<Option<Vec<u8>>> {
        if let Some(w) = self.writes.get(&(table.id, key)) {
            return Ok(Some(w.value.clone()));
        }
        let rid = self.rid;
        let seen = self.see(table, key)?;
        visible_value(seen, table, key, rid)
    }

    /// The version CID `get` would return the value of (`None` if absent): for
    /// histories and tests.
    pub fn get_version(&mut self, table: &Arc<Table>, key: u64) -> Result<Option<u64>> {
        let rid = self.rid;
        match self.see(table, key)? {
            Seen::Absent => Ok(None),
            Seen::Block { block, .. } => match block.visible(rid, table.shape) {
                Visible::Version(v) if v.value.is_some() => Ok(Some(v.cid)),
                Visible::Version(_) | Visible::Absent => Ok(None),
                Visible::TooOld => Err(TxnError::SnapshotTooOld {
                    table: table.id,
                    key,
                    rid,
                }),
            },
        }
    }

    /// Buffers a write of `key` (an update, or a new record if the key is absent).
    pub fn put(&mut self, table: &Arc<Table>, key: u64, value: Vec<u8>) -> Result<()> {
        self.buffer(table, key, value, false)
    }

    /// Buffers a new record: [`TxnError::DuplicateKey`] if the key exists in the
    /// snapshot (or this transaction wrote it), or is inserted concurrently.
    pub fn insert(&mut self, table: &Arc<Table>, key: u64, value: Vec<u8>) -> Result<()> {
        if self.get(table, key)?.is_some() {
            return Err(TxnError::DuplicateKey {
                table: table.id,
                key,
            });
        }
        self.buffer(table, key, value, true)
    }

    fn buffer(&mut self, table: &Arc<Table>, key: u64, value: Vec<u8>, insert: bool) -> Result<()> {
        if value.len() > table.shape.value_cap as usize {
            return Err(LayoutError::ValueTooLarge {
                len: value.len(),
                cap: table.shape.value_cap,
            }
            .into());
        }
        // The commit compares against the header read now.
        self.see(table, key)?;
        let insert = insert || self.writes.get(&(table.id, key)).is_some_and(|w| w.insert);
        self.writes.insert(
            (table.id, key),
            Write {
                table: table.clone(),
                value,
                insert,
            },
        );
        Ok(())
    }

    /// Ends the transaction without effect (nothing is locked before commit) and
    /// hands back the client.
    pub fn abort(self) -> C {
        self.client
    }

    /// What the transaction saw of a record; read on first use.
    fn see(&mut self, table: &Arc<Table>, key: u64) -> Result<&Seen> {
        if !self.seen.contains_key(&(table.id, key)) {
            let seen = fetch(self.client.borrow_mut(), table, key)?;
            self.seen.insert((table.id, key), seen);
        }
        Ok(&self.seen[&(table.id, key)])
    }

    /// Runs the commit protocol. Returns the CID, or `None` for a read-only
    /// transaction (which takes no timestamp). On error the transaction is aborted.
    pub fn commit(self) -> Result<Option<u64>> {
        self.commit_into().1
    }

    /// [`Transaction::commit`], handing back the client.
    pub fn commit_into(mut self) -> (C, Result<Option<u64>>) {
        let result = self.run();
        (self.client, result)
    }

    fn run(&mut self) -> Result<Option<u64>> {
        let client = self.client.borrow_mut();
        if self.writes.is_empty() {
            client.stats.committed += 1;
            return Ok(None);
        }
        let cid = client.slot.acquire_commit_ts(1000)?;
        let mut state = CommitState::default();
        let result = run_commit(client, self.rid, cid, &self.seen, &self.writes, &mut state);
        match result {
            Ok(()) => {
                client.slot.mark(cid, Outcome::Committed)?;
                client.last_cid = client.last_cid.max(cid);
                client.stats.committed += 1;
                if client.wait_visible {
                    client.wait_rid(cid)?;
                }
                Ok(Some(cid))
            }
            Err(e) => {
                let released = release(client, cid, &self.seen, &state);
                let marked = client.slot.mark(cid, Outcome::Aborted);
                client.stats.aborted += 1;
                released?;
                marked?;
                Err(e)
            }
        }
    }
}

fn visible_value(seen: &Seen, table: &Table, key: u64, rid: u64) -> Result<Option<Vec<u8>>> {
    match seen {
        Seen::Absent => Ok(None),
        Seen::Block { block, .. } => match block.visible(rid, table.shape) {
            Visible::Version(v) => Ok(v.value.clone()),
            Visible::Absent => Ok(None),
            Visible::TooOld => Err(TxnError::SnapshotTooOld {
                table: table.id,
                key,
                rid,
            }),
        },
    }
}

/// Finds and reads a record's block.
fn fetch(client: &mut Client, table: &Table, key: u64) -> Result<Seen> {
    let start = Instant::now();
    let addr = loop {
        if let Some(a) = client.cache.get(&table.id).and_then(|c| c.get(key)) {
            break a;
        }
        match table.index.lookup(&mut client.conn, key)? {
            Lookup::Found(a) => {
                client.cache.entry(table.id).or_default().put(key, a);
                break a;
            }
            Lookup::Absent => return Ok(Seen::Absent),
            Lookup::Pending => {
                if start.elapsed() > LOCK_PATIENCE {
                    return Err(TxnError::Conflict {
                        table: table.id,
                        key,
                        why: "index slot pending too long",
                    });
                }
                std::hint::spin_loop();
            }
        }
    };
    let block = read_block(client, table, key, addr)?;
    Ok(Seen::Block { addr, block })
}

/// The seqlock read: READ the block and then its header word in one doorbell; retry
/// until both headers are equal and unlocked.
fn read_block(client: &mut Client, table: &Table, key: u64, addr: u64) -> Result<Block> {
    let bytes = table.shape.block_bytes();
    let header_at = READ_AREA + bytes;
    let start = Instant::now();
    loop {
        let scratch = client.conn.scratch();
        let mut wrs = [
            SendWr::read(0, scratch.buf(READ_AREA, bytes as u32), table.data.at(addr)),
            SendWr::read(0, scratch.buf(header_at, 8), table.data.at(addr)),
        ];
        client.conn.run(&mut wrs)?;
        let scratch = client.conn.scratch();
        let raw = scratch.to_vec(READ_AREA, bytes as usize)?;
        let after = scratch.load_u64(header_at)?;
        match layout::accept(&raw, after, table.shape) {
            Ok(block) => return Ok(block),
            Err(LayoutError::Torn { .. }) => client.stats.torn_retries += 1,
            Err(LayoutError::Locked { .. }) => {
                client.stats.locked_retries += 1;
                if start.elapsed() > LOCK_PATIENCE {
                    return Err(TxnError::Conflict {
                        table: table.id,
                        key,
                        why: "record locked too long",
                    });
                }
            }
            Err(e) => return Err(e.into()),
        }
        std::hint::spin_loop();
    }
}

/// What a commit holds, for the abort path.
#[derive(Default)]
struct CommitState {
    /// Updated records locked by this commit: (table, key).
    locked: Vec<(Arc<Table>, u64)>,
    /// New blocks this commit wrote locked and published in the index: (table, addr).
    created: Vec<(Arc<Table>, u64)>,
}

/// A cursor over the commit area of the scratch region.
struct Area {
    next: u64,
}

impl Area {
    fn take(&mut self, bytes: u64) -> Result<u64> {
        let at = self.next;
        if at + bytes > SCRATCH_BYTES {
            return Err(TxnError::Invalid(
                "write set too large for one commit's buffers".into(),
            ));
        }
        self.next += bytes.next_multiple_of(8);
        Ok(at)
    }
}

fn run_commit(
    client: &mut Client,
    rid: u64,
    cid: u64,
    seen: &HashMap<(u32, u64), Seen>,
    writes: &BTreeMap<(u32, u64), Write>,
    state: &mut CommitState,
) -> Result<()> {
    let locked = Header::locked_by(cid).encode();
    // First committer wins, checked before taking any lock.
    for (&(t, key), _) in writes.iter() {
        if let Some(Seen::Block { block, .. }) = seen.get(&(t, key))
            && block.header.cid > rid
        {
            return Err(TxnError::Conflict {
                table: t,
                key,
                why: "first committer wins: written after the snapshot",
            });
        }
    }
    // New records: allocate, write locked, publish in the index.
    for (&(t, key), w) in writes.iter() {
        if !matches!(seen.get(&(t, key)), Some(Seen::Absent)) {
            continue;
        }
        let table = &w.table;
        let mut area = Area { next: COMMIT_AREA };
        let counter_at = area.take(8)?;
        let scratch_buf = client.conn.scratch().buf(counter_at, 8);
        client
            .conn
            .run(&mut [SendWr::fetch_add(0, scratch_buf, table.data.at(0), 1)])?;
        let i = client.conn.scratch().load_u64(counter_at)?;
        if i >= table.capacity {
            return Err(TxnError::TableFull {
                table: t,
                capacity: table.capacity,
            });
        }
        let addr = table.block_offset(i);
        let block = Block::inserted(Header::locked_by(cid), cid, w.value.clone(), table.shape);
        let bytes = layout::encode(&block, table.shape)?;
        let at = area.take(bytes.len() as u64)?;
        client.conn.scratch().write(at, &bytes)?;
        let src = client.conn.scratch().buf(at, bytes.len() as u32);
        client
            .conn
            .run(&mut [SendWr::write(0, src, table.data.at(addr))])?;
        match table.index.insert(&mut client.conn, key, addr) {
            Ok(()) => {}
            Err(crate::index::IndexError::DuplicateKey { .. }) => {
                // The unpublished block is unreachable (leaked until GC exists).
                return Err(if w.insert {
                    TxnError::DuplicateKey { table: t, key }
                } else {
                    TxnError::Conflict {
                        table: t,
                        key,
                        why: "inserted concurrently",
                    }
                });
            }
            Err(e) => return Err(e.into()),
        }
        client.cache.entry(t).or_default().put(key, addr);
        state.created.push((table.clone(), addr));
    }
    // Lock and validate the updated records: one CAS each, one doorbell.
    let mut area = Area { next: COMMIT_AREA };
    let mut updates = Vec::new();
    for (&(t, key), w) in writes.iter() {
        if let Some(Seen::Block { addr, block }) = seen.get(&(t, key)) {
            let res = area.take(8)?;
            updates.push((t, key, w, *addr, block, res));
        }
    }
    if !updates.is_empty() {
        let scratch = client.conn.scratch();
        let mut wrs: Vec<SendWr<'_>> = updates
            .iter()
            .map(|(_, _, w, addr, block, res)| {
                SendWr::cas(
                    0,
                    scratch.buf(*res, 8),
                    w.table.data.at(*addr),
                    block.header.encode(),
                    locked,
                )
            })
            .collect();
        client.conn.run(&mut wrs)?;
        let mut conflict = None;
        for (t, key, w, _, block, res) in &updates {
            if client.conn.scratch().load_u64(*res)? == block.header.encode() {
                state.locked.push((w.table.clone(), *key));
            } else if conflict.is_none() {
                conflict = Some((*t, *key));
            }
        }
        if let Some((table, key)) = conflict {
            return Err(TxnError::Conflict {
                table,
                key,
                why: "record locked or changed since it was read",
            });
        }
    }
    // Install: WRITE the versions and CAS-unlock, all in one doorbell.
    // (block, CAS result buffer, versions buffer to WRITE (none for a new block), table)
    type Step = (u64, u64, Option<(u64, u32)>, Arc<Table>);
    let mut plan: Vec<Step> = Vec::new();
    for (_, _, w, addr, block, _) in &updates {
        let versions = block.with_new_version(
            Version {
                cid,
                value: Some(w.value.clone()),
            },
            w.table.shape,
        );
        let bytes = layout::encode_versions(&versions, w.table.shape)?;
        let at = area.take(bytes.len() as u64)?;
        client.conn.scratch().write(at, &bytes)?;
        let res = area.take(8)?;
        plan.push((*addr, res, Some((at, bytes.len() as u32)), w.table.clone()));
    }
    for (table, addr) in &state.created {
        let res = area.take(8)?;
        plan.push((*addr, res, None, table.clone()));
    }
    let scratch = client.conn.scratch();
    let mut wrs: Vec<SendWr<'_>> = Vec::with_capacity(plan.len() * 2);
    for (addr, res, data, table) in &plan {
        if let Some((at, len)) = data {
            wrs.push(SendWr::write(
                0,
                scratch.buf(*at, *len),
                table.data.at(addr + 8),
            ));
        }
        wrs.push(SendWr::cas(
            0,
            scratch.buf(*res, 8),
            table.data.at(*addr),
            locked,
            Header::unlocked(cid).encode(),
        ));
    }
    client.conn.run(&mut wrs)?;
    // From here the commit is visible to readers; it must be marked committed.
    state.locked.clear();
    state.created.clear();
    for (addr, res, _, _) in &plan {
        let old = client.conn.scratch().load_u64(*res)?;
        if old != locked {
            return Err(TxnError::Invalid(format!(
                "lock of block {addr} lost during install (header {old:#x})"
            )));
        }
    }
    Ok(())
}

/// The abort path: releases every lock a failed commit holds, in one doorbell.
fn release(
    client: &mut Client,
    cid: u64,
    seen: &HashMap<(u32, u64), Seen>,
    state: &CommitState,
) -> Result<()> {
    let locked = Header::locked_by(cid).encode();
    let mut area = Area { next: COMMIT_AREA };
    let mut bufs = Vec::new();
    for (table, _) in &state.created {
        let bytes = layout::encode_versions(
            &[Version {
                cid: 0,
                value: None,
            }],
            table.shape,
        )?;
        let at = area.take(bytes.len() as u64)?;
        client.conn.scratch().write(at, &bytes)?;
        bufs.push((at, bytes.len() as u32));
    }
    let res = area.take(8)?;
    let scratch = client.conn.scratch();
    let mut wrs: Vec<SendWr<'_>> = Vec::new();
    for ((table, addr), (at, len)) in state.created.iter().zip(&bufs) {
        wrs.push(SendWr::write(
            0,
            scratch.buf(*at, *len),
            table.data.at(addr + 8),
        ));
        wrs.push(SendWr::cas(
            0,
            scratch.buf(res, 8),
            table.data.at(*addr),
            locked,
            Header::unlocked(0).encode(),
        ));
    }
    for (table, key) in &state.locked {
        if let Some(Seen::Block { addr, block }) = seen.get(&(table.id, *key)) {
            wrs.push(SendWr::cas(
                0,
                scratch.buf(res, 8),
                table.data.at(*addr),
                locked,
                block.header.encode(),
            ));
        }
    }
    client.conn.run(&mut wrs)?;
    Ok(())
}
