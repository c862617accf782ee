//! Read-only snapshots for analytical scans (DESIGN.md "Shuffle (OLAP)"; Binnig et al.,
//! VLDB 2016, §5: analytics read the memory servers directly, at a read timestamp, while
//! transactions commit).
//!
//! A [`Snapshot`] is a read timestamp (RID) taken like a transaction's, on a
//! [`Worker`]'s connections, and the few READ-only primitives a scan operator needs:
//! how many blocks a partition's arena has handed out, large READs of block ranges
//! (each range twice in one doorbell, only the last request signaled), and the
//! transactional seqlock read of one block for the blocks those copies cannot vouch
//! for. It writes nothing, takes no commit timestamp and holds no lock, so it cannot
//! break an invariant of the commit protocol; what it reads is judged with
//! [`crate::layout`] exactly as a transaction's read is.

use crate::error::{Result, TxnError};
use crate::layout::Block;
use crate::store::Table;
use crate::transaction::{AsyncTransaction, read_block};
use crate::worker::Worker;
use fabric::{Access, Region, SendWr};
use std::cell::RefCell;
use std::rc::Rc;

/// A range of blocks of one partition and where its two copies land in a buffer: the
/// first at `at`, the second right after it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stripe {
    /// The first block's index in the partition's arena.
    pub first: u64,
    pub blocks: u64,
    /// Byte offset of the first copy in the buffer.
    pub at: u64,
}

/// A read-only view of the database at one read timestamp.
pub struct Snapshot<'w> {
    worker: &'w Worker,
    rid: u64,
    /// Where counters and single blocks are READ into, grown on demand.
    probe: RefCell<Option<Rc<Region>>>,
}

impl Worker {
    /// A snapshot that includes every commit that returned before this call (the read
    /// timestamp a transaction beginning now would get).
    pub async fn snapshot(&self) -> Result<Snapshot<'_>> {
        let tx = self.begin(0).await?;
        let rid = tx.rid();
        tx.abort();
        Ok(Snapshot::new(self, rid))
    }

    /// A snapshot at `rid`, a read timestamp another worker (possibly on another
    /// compute node) took: a distributed scan shares one. Waits until this worker's
    /// view of the oracle has reached `rid`, so every commit at or below it is decided.
    pub async fn snapshot_at(&self, rid: u64) -> Result<Snapshot<'_>> {
        self.read_timestamp(0, rid).await?;
        Ok(Snapshot::new(self, rid))
    }

    /// A transaction reading at `rid` (see [`Worker::snapshot_at`]): what a scan at
    /// `rid` is checked against. Committing it is safe (first committer wins compares
    /// against `rid`), though a snapshot this old aborts more often.
    pub async fn begin_at(&self, rid: u64) -> Result<AsyncTransaction<'_>> {
        self.read_timestamp(0, rid).await?;
        AsyncTransaction::new(self, rid)
    }

    /// A local buffer on this worker's device that a snapshot's READs can land in.
    pub fn register_buffer(&self, bytes: u64) -> Result<Region> {
        Ok(self.device().register(bytes.max(8), Access::LOCAL)?)
    }
}

impl<'w> Snapshot<'w> {
    fn new(worker: &'w Worker, rid: u64) -> Snapshot<'w> {
        Snapshot {
            worker,
            rid,
            probe: RefCell::new(None),
        }
    }

    /// The read timestamp.
    pub fn rid(&self) -> u64 {
        self.rid
    }

    pub fn worker(&self) -> &'w Worker {
        self.worker
    }

    fn probe(&self, bytes: u64) -> Result<Rc<Region>> {
        let mut probe = self.probe.borrow_mut();
        if let Some(r) = probe.as_ref()
            && r.len() >= bytes
        {
            return Ok(r.clone());
        }
        let r = Rc::new(self.worker.register_buffer(bytes.next_power_of_two())?);
        *probe = Some(r.clone());
        Ok(r)
    }

    /// Blocks partition `part` of `table` has handed out, read now. Called after the
    /// snapshot was taken, it covers every record visible at the RID: an insert takes
    /// its block before its commit timestamp can be decided.
    pub async fn used_blocks(&self, table: &Table, part: usize) -> Result<u64> {
        let p = partition(table, part)?;
        let probe = self.probe(8)?;
        self.worker
            .conn(p.server)
            .run(&[SendWr::read(0, probe.buf(0, 8), p.data.at(p.arena))])
            .await?;
        Ok(probe.load_u64(0)?.min(p.capacity))
    }

    /// READs each stripe of partition `part` twice into `buffer` (the second copy
    /// right after the first), all in one doorbell with only the last request
    /// signaled: on RC its completion means every earlier READ completed. A block
    /// whose header word is the same and unlocked in both copies was not written in
    /// between (an install locks the header before it writes and changes it after).
    pub async fn read_stripes(
        &self,
        table: &Table,
        part: usize,
        stripes: &[Stripe],
        buffer: &Region,
    ) -> Result<()> {
        let p = partition(table, part)?;
        let block_bytes = table.shape.block_bytes();
        let mut wrs = Vec::with_capacity(stripes.len() * 2);
        for s in stripes {
            let bytes = s.blocks * block_bytes;
            if s.blocks == 0
                || s.first + s.blocks > p.capacity
                || bytes > u32::MAX as u64
                || s.at + 2 * bytes > buffer.len()
            {
                return Err(TxnError::Invalid(format!(
                    "stripe {s:?} does not fit partition {part} of {} ({} blocks) or a {}-byte buffer",
                    table.name,
                    p.capacity,
                    buffer.len()
                )));
            }
            let remote = p.data.at(table.block_offset(part, s.first));
            wrs.push(SendWr::read(0, buffer.buf(s.at, bytes as u32), remote));
            wrs.push(SendWr::read(
                0,
                buffer.buf(s.at + bytes, bytes as u32),
                remote,
            ));
        }
        Ok(self.worker.conn(p.server).run(&wrs).await?)
    }

    /// Block `index` of partition `part`, read as a transaction reads it: the block and
    /// its header in one doorbell, retried while torn or locked ([`TxnError::Conflict`]
    /// if it stays locked for a second). `key` names the record in errors.
    pub async fn reread_block(
        &self,
        table: &Table,
        part: usize,
        index: u64,
        key: u64,
    ) -> Result<Block> {
        let p = partition(table, part)?;
        if index >= p.capacity {
            return Err(TxnError::Invalid(format!(
                "block {index} is beyond partition {part} of {} ({} blocks)",
                table.name, p.capacity
            )));
        }
        let probe = self.probe(table.shape.block_bytes() + 8)?;
        let mut bytes = Vec::new();
        let addr = table.block_offset(part, index);
        let (_, raw) =
            read_block(self.worker, &probe, 0, &mut bytes, table, part, key, addr).await?;
        Ok(crate::layout::decode(&bytes[raw], table.shape)?)
    }
}

fn partition(table: &Table, part: usize) -> Result<&crate::store::Partition> {
    table.partitions.get(part).ok_or_else(|| {
        TxnError::Invalid(format!(
            "table {} has {} partitions, not {}",
            table.name,
            table.partitions.len(),
            part + 1
        ))
    })
}
