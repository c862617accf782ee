//! Snapshot scans: every row of a txn table visible at a read timestamp, read from the
//! memory servers with large, selectively signaled READs.
//!
//! Binnig et al. (VLDB 2016, §5) let analytical operators read the memory servers
//! directly while transactions run, instead of copying data to compute nodes first.
//! Here a scan reads each partition's record-block arena ([`txn::layout`]) in stripes of
//! many blocks, and judges every block as a transaction's read judges it:
//!
//! 1. **Snapshot.** A read timestamp (RID) is taken like a transaction's
//!    ([`txn::Worker::snapshot`]); a distributed scan shares one RID among all its
//!    scanners ([`txn::Worker::snapshot_at`]).
//! 2. **Used blocks only.** Each partition's arena counter is READ after the RID was
//!    taken: an insert takes its block before its commit timestamp is decided, so
//!    every record visible at the RID lies below it.
//! 3. **Large READs, few completions.** A stripe (`stripe_bytes`, 256 KiB by default)
//!    is READ twice back to back; `stripes_per_doorbell` stripes go out in one doorbell
//!    with only its last request signaled (on RC a signaled completion implies every
//!    earlier request on the queue pair completed), and `doorbells_in_flight` doorbells
//!    are outstanding at once, so decoding one overlaps the transfer of the next.
//! 4. **Torn and locked blocks.** A block whose header word is equal in both copies
//!    and unlocked was not installed in between (an install locks the header before
//!    its WRITE and changes it after), so its first copy is consistent. Any other
//!    block — torn, or locked by a commit (whose install WRITE may be under way, so
//!    even the versions older than the holder's cannot be trusted) — is re-read alone
//!    with the transactional seqlock read ([`txn::Snapshot::reread_block`]), which
//!    waits for the lock as a transaction does.
//! 5. **Visibility.** The newest version with CID ≤ RID is the row (a tombstone is no
//!    row; a block that never held a version that old is no row). If the block is
//!    full and every kept version is newer than the RID, the version the snapshot
//!    needs was dropped: the scan fails with [`ScanError::SnapshotTooOld`], never
//!    yields a newer or an absent value instead. [`scan_with_retry`] re-runs a scan
//!    at a fresh RID when the caller prefers that.
//!
//! Scan on a reader ([`txn::Database::reader`]): it holds no oracle slot, so a long
//! scan cannot hold back other workers' read timestamps. A scan on a slot-holding
//! worker still works: it ticks its worker every millisecond, as an idle worker must
//! ([`txn::Worker::tick`]), so it neither stalls others' commits for long nor loses
//! its lease.
//!
//! **Splitting.** Stripe `j` of partition `p` belongs to scanner `(p + j) mod n` of
//! `n` scanners ([`Scanner`], one per (node, thread)): every stripe has exactly one
//! owner whatever the arenas' fill, and a partition's stripes are dealt round robin,
//! so scanners share work evenly even when there are fewer partitions than scanners.
//! Each scanner reads the arena counters itself; a block beyond the counter one
//! scanner read was not allocated when it read it, so it is invisible at the RID.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::task::Poll;
use std::time::{Duration, Instant};
use thiserror::Error;
use txn::layout::{self, LayoutError, Visible, VisibleRaw};
use txn::{Snapshot, Stripe, Table, TxnError, Worker};

/// How often a scan ticks its worker's oracle slot.
const TICK_EVERY: Duration = Duration::from_millis(1);

/// How a scanner reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScanConfig {
    /// Bytes per READ (rounded down to whole blocks, at least one block).
    pub stripe_bytes: u64,
    /// Stripes per doorbell; each is READ twice and only the doorbell's last request
    /// is signaled.
    pub stripes_per_doorbell: usize,
    /// Doorbells outstanding at once.
    pub doorbells_in_flight: usize,
}

impl Default for ScanConfig {
    fn default() -> Self {
        ScanConfig {
            stripe_bytes: 256 << 10,
            stripes_per_doorbell: 4,
            doorbells_in_flight: 4,
        }
    }
}

impl ScanConfig {
    fn validate(&self) -> Result<(), ScanError> {
        if self.stripe_bytes == 0 || self.stripes_per_doorbell == 0 || self.doorbells_in_flight == 0
        {
            return Err(ScanError::Invalid(format!(
                "stripe bytes, stripes per doorbell and doorbells in flight must be positive: {self:?}"
            )));
        }
        if self.stripe_bytes > u32::MAX as u64 / 2 {
            return Err(ScanError::Invalid(format!(
                "a stripe of {} bytes is too large for one READ",
                self.stripe_bytes
            )));
        }
        Ok(())
    }

    /// Blocks per stripe for `table`.
    pub fn stripe_blocks(&self, table: &Table) -> u64 {
        (self.stripe_bytes / table.shape.block_bytes()).max(1)
    }
}

/// One of the scanners a distributed scan is split among: scanner `index` of `count`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Scanner {
    pub index: usize,
    pub count: usize,
}

impl Scanner {
    /// The only scanner: it reads everything.
    pub const ALONE: Scanner = Scanner { index: 0, count: 1 };

    /// Thread `thread` of `threads` on node `node` of `nodes`.
    pub fn new(
        node: usize,
        nodes: usize,
        thread: usize,
        threads: usize,
    ) -> Result<Scanner, ScanError> {
        if node >= nodes || thread >= threads {
            return Err(ScanError::Invalid(format!(
                "scanner (node {node} of {nodes}, thread {thread} of {threads}) does not exist"
            )));
        }
        Ok(Scanner {
            index: node * threads + thread,
            count: nodes * threads,
        })
    }

    /// Whether stripe `stripe` of partition `partition` is this scanner's.
    pub fn owns(&self, partition: usize, stripe: u64) -> bool {
        ((partition as u64 + stripe) % self.count as u64) as usize == self.index
    }
}

/// A row visible at the snapshot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Row<'a> {
    /// The partition it was read from.
    pub partition: usize,
    pub key: u64,
    pub value: &'a [u8],
}

/// What one scanner did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ScanStats {
    /// Blocks decoded (allocated blocks of this scanner's stripes).
    pub blocks: u64,
    /// Rows handed to the caller.
    pub rows: u64,
    /// Bytes READ in stripes (both copies).
    pub bytes_read: u64,
    /// Blocks re-read alone because their copies were torn or locked.
    pub rereads: u64,
    /// Doorbells rung for stripes (each with one signaled request).
    pub doorbells: u64,
}

impl std::ops::AddAssign for ScanStats {
    fn add_assign(&mut self, o: ScanStats) {
        self.blocks += o.blocks;
        self.rows += o.rows;
        self.bytes_read += o.bytes_read;
        self.rereads += o.rereads;
        self.doorbells += o.doorbells;
    }
}

#[derive(Debug, Error)]
pub enum ScanError {
    /// The version of `key` visible at `rid` is no longer kept: its block is full and
    /// every kept version is newer. Retry at a fresh read timestamp.
    #[error(
        "snapshot at RID {rid} is too old for table {table} key {key}: every kept version is newer and older ones were dropped"
    )]
    SnapshotTooOld { table: String, key: u64, rid: u64 },
    #[error("invalid scan: {0}")]
    Invalid(String),
    #[error("scan: {0}")]
    Txn(#[from] TxnError),
    /// The caller's row callback stopped the scan.
    #[error("scan stopped by its consumer: {0}")]
    Consumer(String),
}

/// What to do when a scan's snapshot turns out too old.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnTooOld {
    /// Return [`ScanError::SnapshotTooOld`].
    Fail,
    /// Run the whole scan again at a fresh read timestamp, up to `attempts` more times.
    Retry { attempts: u32 },
}

/// One doorbell's work: stripes of one partition.
struct Doorbell {
    partition: usize,
    stripes: Vec<Stripe>,
}

/// Scans `table` at `snapshot` for `scanner`'s stripes, handing each visible row to
/// `each` (in arena order per stripe, stripes in order per partition).
pub async fn scan_table(
    snapshot: &Snapshot<'_>,
    table: &Table,
    scanner: Scanner,
    config: &ScanConfig,
    mut each: impl FnMut(Row<'_>) -> Result<(), ScanError>,
) -> Result<ScanStats, ScanError> {
    config.validate()?;
    if scanner.count == 0 || scanner.index >= scanner.count {
        return Err(ScanError::Invalid(format!("{scanner:?} does not exist")));
    }
    let block_bytes = table.shape.block_bytes();
    let stripe_blocks = config.stripe_blocks(table);
    let slot_bytes = 2 * stripe_blocks * block_bytes * config.stripes_per_doorbell as u64;
    let mut doorbells = VecDeque::new();
    for part in 0..table.partitions.len() {
        let used = snapshot.used_blocks(table, part).await?;
        let mut current = Vec::new();
        for j in 0..used.div_ceil(stripe_blocks) {
            if !scanner.owns(part, j) {
                continue;
            }
            let first = j * stripe_blocks;
            current.push(Stripe {
                first,
                blocks: stripe_blocks.min(used - first),
                // Placed in a buffer slot when the doorbell is posted.
                at: 0,
            });
            if current.len() == config.stripes_per_doorbell {
                doorbells.push_back(Doorbell {
                    partition: part,
                    stripes: std::mem::take(&mut current),
                });
            }
        }
        if !current.is_empty() {
            doorbells.push_back(Doorbell {
                partition: part,
                stripes: current,
            });
        }
    }
    let mut stats = ScanStats::default();
    if doorbells.is_empty() {
        return Ok(stats);
    }
    let slots = config.doorbells_in_flight.min(doorbells.len());
    let buffer = snapshot
        .worker()
        .register_buffer(slot_bytes * slots as u64)?;
    let mut free: Vec<u64> = (0..slots as u64).map(|s| s * slot_bytes).collect();
    type Read<'a> = Pin<Box<dyn Future<Output = txn::Result<()>> + 'a>>;
    struct InFlight<'a> {
        doorbell: Doorbell,
        read: Read<'a>,
        done: Option<txn::Result<()>>,
    }
    let mut in_flight: VecDeque<InFlight<'_>> = VecDeque::new();
    let mut copies = Vec::new();
    let mut last_tick = Instant::now();
    let outcome: Result<(), ScanError> = async {
        loop {
            // A long scan keeps its worker's oracle slot moving: timestamps the slot holds
            // unused would hold back every node's read timestamp (and so every commit
            // that waits to be visible), and a lease left unrenewed is fenced.
            if last_tick.elapsed() >= TICK_EVERY {
                snapshot.worker().tick()?;
                last_tick = Instant::now();
            }
            while let Some(at) = free.pop() {
                let Some(mut d) = doorbells.pop_front() else {
                    break;
                };
                let mut next = at;
                for s in &mut d.stripes {
                    s.at = next;
                    next += 2 * s.blocks * block_bytes;
                }
                // The future owns a copy of the stripes; `d` keeps them for decoding.
                let stripes = d.stripes.clone();
                let part = d.partition;
                let buffer = &buffer;
                let read: Read<'_> =
                    Box::pin(
                        async move { snapshot.read_stripes(table, part, &stripes, buffer).await },
                    );
                stats.doorbells += 1;
                in_flight.push_back(InFlight {
                    doorbell: d,
                    read,
                    done: None,
                });
            }
            if in_flight.is_empty() {
                break;
            }
            // Drive every outstanding doorbell; decode the oldest once it completed.
            std::future::poll_fn(|cx| {
                for f in in_flight.iter_mut() {
                    if f.done.is_none()
                        && let Poll::Ready(r) = f.read.as_mut().poll(cx)
                    {
                        f.done = Some(r);
                    }
                }
                if in_flight.front().is_some_and(|f| f.done.is_some()) {
                    Poll::Ready(())
                } else {
                    Poll::Pending
                }
            })
            .await;
            let f = in_flight.pop_front().expect("the front completed");
            f.done.expect("completed")?;
            for s in &f.doorbell.stripes {
                let bytes = (s.blocks * block_bytes) as usize;
                copies.resize(2 * bytes, 0);
                buffer.read(s.at, &mut copies).map_err(TxnError::from)?;
                stats.bytes_read += 2 * bytes as u64;
                let (first, second) = copies.split_at(bytes);
                for b in 0..s.blocks {
                    let at = (b * block_bytes) as usize;
                    let raw = &first[at..at + block_bytes as usize];
                    let after = u64::from_le_bytes(second[at..at + 8].try_into().expect("8 bytes"));
                    let key = u64::from_le_bytes(raw[8..16].try_into().expect("8 bytes"));
                    stats.blocks += 1;
                    let emitted = match judge(raw, after, snapshot.rid(), table.shape) {
                        Ok(Judged::Row(v)) => {
                            each(Row {
                                partition: f.doorbell.partition,
                                key,
                                value: v,
                            })?;
                            true
                        }
                        Ok(Judged::NoRow) => false,
                        Ok(Judged::TooOld) => return Err(too_old(table, key, snapshot.rid())),
                        Ok(Judged::Reread) => {
                            stats.rereads += 1;
                            let block = snapshot
                                .reread_block(table, f.doorbell.partition, s.first + b, key)
                                .await?;
                            match block.visible(snapshot.rid(), table.shape) {
                                Visible::Version(v) => match &v.value {
                                    Some(value) => {
                                        each(Row {
                                            partition: f.doorbell.partition,
                                            key: block.key,
                                            value,
                                        })?;
                                        true
                                    }
                                    None => false,
                                },
                                Visible::Absent => false,
                                Visible::TooOld => {
                                    return Err(too_old(table, block.key, snapshot.rid()));
                                }
                            }
                        }
                        Err(e) => return Err(TxnError::from(e).into()),
                    };
                    stats.rows += emitted as u64;
                }
            }
            free.push(f.doorbell.stripes[0].at);
        }
        Ok(())
    }
    .await;
    if outcome.is_err() {
        // READs still in flight land in `buffer`: let them finish before it goes.
        for f in in_flight.iter_mut().filter(|f| f.done.is_none()) {
            let _ = f.read.as_mut().await;
        }
    }
    outcome.map(|()| stats)
}

/// What a block's stripe copies say about it at a read timestamp.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Judged<'a> {
    /// The value visible at the RID.
    Row(&'a [u8]),
    /// No row at the RID: a tombstone, or the record did not exist yet.
    NoRow,
    /// The version visible at the RID was dropped.
    TooOld,
    /// The copies cannot vouch for the block (torn, locked, or mixed bytes of an
    /// install that fail validation): read it alone with the seqlock.
    Reread,
}

/// Judges one block from its first stripe copy (`first`, the whole block) and its
/// header word in the second copy (`header_after`), read after the first.
pub fn judge(
    first: &[u8],
    header_after: u64,
    rid: u64,
    shape: txn::layout::BlockShape,
) -> Result<Judged<'_>, LayoutError> {
    match layout::accept_raw(first, header_after, shape) {
        Ok(_) => Ok(match layout::visible_raw(first, rid, shape) {
            VisibleRaw::Version { value: Some(v), .. } => Judged::Row(v),
            VisibleRaw::Version { value: None, .. } | VisibleRaw::Absent => Judged::NoRow,
            VisibleRaw::TooOld => Judged::TooOld,
        }),
        Err(
            LayoutError::Torn { .. } | LayoutError::Locked { .. } | LayoutError::Malformed { .. },
        ) => Ok(Judged::Reread),
        Err(e) => Err(e),
    }
}

fn too_old(table: &Table, key: u64, rid: u64) -> ScanError {
    ScanError::SnapshotTooOld {
        table: table.name.clone(),
        key,
        rid,
    }
}

/// [`scan_table`] on this thread, blocking.
pub fn scan_blocking(
    snapshot: &Snapshot<'_>,
    table: &Table,
    scanner: Scanner,
    config: &ScanConfig,
    each: impl FnMut(Row<'_>) -> Result<(), ScanError>,
) -> Result<ScanStats, ScanError> {
    txn::runtime::block_on(scan_table(snapshot, table, scanner, config, each))
}

/// Every row of `table` visible at `snapshot`, as (key, value) in key order: one
/// scanner, for single-node computations and checks.
pub fn collect(
    snapshot: &Snapshot<'_>,
    table: &Table,
    config: &ScanConfig,
) -> Result<Vec<(u64, Vec<u8>)>, ScanError> {
    let mut rows = Vec::new();
    scan_blocking(snapshot, table, Scanner::ALONE, config, |r| {
        rows.push((r.key, r.value.to_vec()));
        Ok(())
    })?;
    rows.sort_unstable_by_key(|(k, _)| *k);
    Ok(rows)
}

/// Runs `run` on a fresh snapshot of `worker`; if it fails with
/// [`ScanError::SnapshotTooOld`] and `policy` allows, runs it again on a newer
/// snapshot. `run` must start from scratch each time (what it gathered from a failed
/// attempt belongs to an abandoned snapshot). Returns its value and the RID it used.
pub fn scan_with_retry<T>(
    worker: &Worker,
    policy: OnTooOld,
    mut run: impl FnMut(&Snapshot<'_>) -> Result<T, ScanError>,
) -> Result<(T, u64), ScanError> {
    let attempts = match policy {
        OnTooOld::Fail => 0,
        OnTooOld::Retry { attempts } => attempts,
    };
    let mut attempt = 0;
    loop {
        let snapshot = txn::runtime::block_on(worker.snapshot())?;
        match run(&snapshot) {
            Err(ScanError::SnapshotTooOld { .. }) if attempt < attempts => attempt += 1,
            other => return other.map(|v| (v, snapshot.rid())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use txn::layout::{Block, BlockShape, Header, Version};

    #[test]
    fn every_stripe_has_exactly_one_owner() {
        for nodes in 1..4 {
            for threads in 1..4 {
                let scanners: Vec<Scanner> = (0..nodes)
                    .flat_map(|n| {
                        (0..threads).map(move |t| Scanner::new(n, nodes, t, threads).unwrap())
                    })
                    .collect();
                for part in 0..5 {
                    for stripe in 0..40 {
                        let owners = scanners.iter().filter(|s| s.owns(part, stripe)).count();
                        assert_eq!(owners, 1, "partition {part} stripe {stripe}");
                    }
                }
                // Round robin: each scanner owns a fair share of a long partition.
                for s in &scanners {
                    let owned = (0..60).filter(|&j| s.owns(0, j)).count();
                    assert_eq!(
                        owned,
                        60 / scanners.len() + usize::from(60 % scanners.len() > s.index)
                    );
                }
            }
        }
        assert!(Scanner::new(2, 2, 0, 1).is_err());
        assert!(Scanner::new(0, 1, 3, 3).is_err());
    }

    fn version(cid: u64, value: Option<&[u8]>) -> Version {
        Version {
            cid,
            value: value.map(<[u8]>::to_vec),
        }
    }

    /// The copies of a block with versions at 30 (deleted), 20 and 10.
    fn block(header: Header) -> (Vec<u8>, BlockShape) {
        let shape = BlockShape::new(3, 8).unwrap();
        let b = Block {
            header,
            key: 5,
            versions: vec![
                version(30, None),
                version(20, Some(b"twenty")),
                version(10, Some(b"ten")),
            ],
        };
        (layout::encode(&b, shape).unwrap(), shape)
    }

    #[test]
    fn judge_applies_visibility_and_distrusts_torn_and_locked_copies() {
        let (bytes, shape) = block(Header::unlocked(30));
        let h = Header::unlocked(30).encode();
        assert_eq!(judge(&bytes, h, 35, shape).unwrap(), Judged::NoRow);
        assert_eq!(judge(&bytes, h, 29, shape).unwrap(), Judged::Row(b"twenty"));
        assert_eq!(judge(&bytes, h, 20, shape).unwrap(), Judged::Row(b"twenty"));
        assert_eq!(judge(&bytes, h, 19, shape).unwrap(), Judged::Row(b"ten"));
        assert_eq!(judge(&bytes, h, 9, shape).unwrap(), Judged::TooOld);
        // An install happened between the copies: the header moved on.
        let moved = Header::unlocked(40).encode();
        assert_eq!(judge(&bytes, moved, 25, shape).unwrap(), Judged::Reread);
        // Or it is under way: locked in the second copy, or in both.
        let locking = Header::locked_by(40).encode();
        assert_eq!(judge(&bytes, locking, 25, shape).unwrap(), Judged::Reread);
        let (locked, _) = block(Header::locked_by(40));
        assert_eq!(judge(&locked, locking, 25, shape).unwrap(), Judged::Reread);
        // Half an install's bytes: version 1 equal to version 0 fails validation.
        let mut mixed = bytes.clone();
        let (v0, v1) = (
            shape.version_offset(0) as usize,
            shape.version_offset(1) as usize,
        );
        let first_version = mixed[v0..v1].to_vec();
        mixed[v1..v1 + first_version.len()].copy_from_slice(&first_version);
        assert_eq!(judge(&mixed, h, 25, shape).unwrap(), Judged::Reread);
        // A block of the wrong size is an error, not a row.
        assert!(judge(&bytes[..16], h, 25, shape).is_err());
        // A never-written block (zeroes) is no row.
        let zero = vec![0u8; shape.block_bytes() as usize];
        assert_eq!(judge(&zero, 0, 25, shape).unwrap(), Judged::NoRow);
    }

    #[test]
    fn bad_configs_are_rejected() {
        for bad in [
            ScanConfig {
                stripe_bytes: 0,
                ..ScanConfig::default()
            },
            ScanConfig {
                stripes_per_doorbell: 0,
                ..ScanConfig::default()
            },
            ScanConfig {
                doorbells_in_flight: 0,
                ..ScanConfig::default()
            },
            ScanConfig {
                stripe_bytes: u32::MAX as u64,
                ..ScanConfig::default()
            },
        ] {
            assert!(
                matches!(bad.validate(), Err(ScanError::Invalid(_))),
                "{bad:?}"
            );
        }
        assert!(ScanConfig::default().validate().is_ok());
    }
}
