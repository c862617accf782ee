//! Durable memory servers: a checkpoint (base files) plus a redo journal on local disk.
//!
//! Compute nodes change region memory with one-sided verbs the server never sees, so
//! durability is explicit, like persistent-memory flushes: a Persist request names byte
//! ranges, the server copies their current contents from region memory into the
//! journal, fsyncs (one fdatasync for every request that arrived meanwhile) and only
//! then replies. A restarted server holds, for every byte, the value of the last
//! completed Persist that covered it (zero if none did). See DEVELOPERS.md
//! ("Durability") for the layout and the reasoning.
//!
//! - [`meta`]: the metadata file and the atomic-replace helpers;
//! - [`journal`]: the journal format, its reader and the group-commit writer thread;
//! - [`store`]: the per-region base files the checkpoints apply the journal to;
//! - this module: opening (restoring) a directory, Persist's copy, checkpoints.

pub(crate) mod journal;
mod meta;
mod store;

use crate::proto;
use crate::regions::{RegionPlan, ServedRegion};
use crate::replica::Replicator;
use journal::{Msg, Pending, Tail, Writer};
use meta::Meta;
use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use store::Store;
use thiserror::Error;
use tokio::sync::oneshot;

/// The most range bytes one Persist may name: a request is copied into memory whole
/// and written in one batch.
pub const MAX_PERSIST_BYTES: u64 = 64 << 20;

/// Where and how a durable server keeps its data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DurabilityConfig {
    /// The data directory: metadata, base files, journals. Created if missing.
    pub dir: PathBuf,
    /// How often the journal is applied to the base files (and then deleted).
    pub checkpoint_interval: Duration,
    /// How long Persist waits for a guarded range's guard word to be unlocked and
    /// stable before it fails.
    pub guard_wait: Duration,
}

impl DurabilityConfig {
    pub const DEFAULT_CHECKPOINT_INTERVAL: Duration = Duration::from_secs(10);
    pub const DEFAULT_GUARD_WAIT: Duration = Duration::from_secs(10);

    pub fn new(dir: impl Into<PathBuf>) -> DurabilityConfig {
        DurabilityConfig {
            dir: dir.into(),
            checkpoint_interval: Self::DEFAULT_CHECKPOINT_INTERVAL,
            guard_wait: Self::DEFAULT_GUARD_WAIT,
        }
    }
}

/// What a durable server found in its data directory when it started.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RestoreReport {
    pub dir: PathBuf,
    /// Starts on this directory, this one included (1: it was new).
    pub boot: u64,
    /// Bytes copied from the base files into region memory: the 1 MiB pieces that hold
    /// data (holes and all-zero pieces are skipped).
    pub base_bytes: u64,
    /// Journals replayed on top, and their batches, entries and entry bytes.
    pub journals: u64,
    pub batches: u64,
    pub entries: u64,
    pub journal_bytes: u64,
    /// Bytes of an interrupted last write cut off the newest journal (never
    /// acknowledged).
    pub torn_bytes: u64,
    pub elapsed: Duration,
}

/// A promotion recorded in a data directory: a backup on it was promoted and has not
/// yet handed its whole state to a new backup, so it holds data newer than its old
/// primary's directory. See DEVELOPERS.md ("Replication").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Promotion {
    /// The replication epoch the promotion gave the data: one more than the larger of
    /// the backup's and its primary's.
    pub epoch: u64,
    /// When (Unix seconds).
    pub at_unix: u64,
}

impl Promotion {
    fn new(epoch: u64, at_unix: u64) -> Promotion {
        Promotion { epoch, at_unix }
    }

    /// The time of the promotion as `YYYY-MM-DD HH:MM:SS UTC`.
    pub fn at_utc(&self) -> String {
        let (days, secs) = (self.at_unix / 86_400, self.at_unix % 86_400);
        // Howard Hinnant's days-to-civil algorithm (proleptic Gregorian calendar).
        let z = days as i64 + 719_468;
        let era = z.div_euclid(146_097);
        let doe = z.rem_euclid(146_097);
        let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
        let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
        let mp = (5 * doy + 2) / 153;
        let day = doy - (153 * mp + 2) / 5 + 1;
        let month = if mp < 10 { mp + 3 } else { mp - 9 };
        let year = yoe + era * 400 + i64::from(month <= 2);
        format!(
            "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02} UTC",
            secs / 3600,
            secs / 60 % 60,
            secs % 60
        )
    }
}

/// The promotion the data directory `dir` records, if any (`None` too when it holds
/// no metadata yet). Reads the metadata file only; takes no lock.
pub fn recorded_promotion(dir: &Path) -> Result<Option<Promotion>, String> {
    Ok(Meta::read(dir)?.and_then(|m| m.promoted.map(|at| Promotion::new(m.epoch, at))))
}

/// Takes the lock a memory server holds on its data directory `dir` (which must
/// exist), so that no server starts on it while the returned file is open; an error
/// if a server uses it now.
pub fn lock_data_dir(dir: &Path) -> Result<File, String> {
    lock(dir)
}

/// Why a Persist was refused or failed.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum PersistError {
    #[error("range {index}: no region has rkey {rkey} (ListRegions lists them)")]
    UnknownRkey { index: usize, rkey: u32 },
    #[error(
        "range {index}: {len} bytes at offset {offset} do not fit in region `{region}` ({region_len} bytes)"
    )]
    OutOfRange {
        index: usize,
        region: String,
        offset: u64,
        len: u64,
        region_len: u64,
    },
    #[error(
        "range {index}: a guarded range starts with its 8-byte guard word, so it must be 8-byte aligned and at least 8 bytes long (offset {offset}, len {len})"
    )]
    BadGuard { index: usize, offset: u64, len: u64 },
    #[error(
        "the ranges hold more than {MAX_PERSIST_BYTES} bytes; split them into several requests"
    )]
    TooLarge,
    #[error(
        "the guard word at rkey {rkey} offset {offset} stayed {state} for {waited:?} (last value {value:#018x})"
    )]
    GuardBusy {
        rkey: u32,
        offset: u64,
        /// "locked" or "changing".
        state: &'static str,
        value: u64,
        waited: Duration,
    },
    #[error("the data directory is closed: the server is stopping")]
    Closed,
    #[error("{0}")]
    Disk(String),
}

/// A durable server's data directory, open: the journal writer and the checkpointer
/// run on their own threads (disk IO never blocks the async workers).
pub(crate) struct Durable {
    shared: Arc<Shared>,
    copier: Copier,
    report: RestoreReport,
    /// The boot in force: the report's, or a promoted backup's later one.
    boot: AtomicU64,
    checkpointer: Mutex<Option<(mpsc::Sender<()>, JoinHandle<()>)>>,
    writer: Mutex<Option<JoinHandle<()>>>,
}

/// What the writer, the checkpointer and Persist share.
struct Shared {
    dir: PathBuf,
    /// The journal thread's queue. Persist holds this lock from the copy of region
    /// memory until the copy is queued, so the journal's order is the copies' order:
    /// a Persist that copied later is replayed later, whatever thread got there first.
    /// `None` once closed.
    journal: Mutex<Option<mpsc::Sender<Msg>>>,
    /// Serialises checkpoints; owns the base files and the metadata in force.
    checkpoint: Mutex<CheckpointState>,
    counters: Arc<journal::Counters>,
    /// The directory's lock: released by `close` (once no thread uses the files), or
    /// when the last thread using them is gone.
    lock: Mutex<Option<File>>,
}

struct CheckpointState {
    store: Store,
    meta: Meta,
}

/// A copy that met a guard word it may not copy under (yet).
enum CopyFail {
    Busy {
        rkey: u32,
        offset: u64,
        state: &'static str,
        value: u64,
    },
    Fabric(String),
}

impl Durable {
    /// Opens (creating, or restoring into `regions`) the data directory of `config`.
    /// `regions` are the plan's regions in plan order, freshly created (zero), and not
    /// yet served to anyone.
    pub fn open(
        config: &DurabilityConfig,
        plan: &RegionPlan,
        regions: &[ServedRegion],
    ) -> Result<Durable, String> {
        let started = Instant::now();
        let dir = config.dir.clone();
        let shown = dir.display();
        std::fs::create_dir_all(&dir)
            .map_err(|e| format!("cannot create the data directory {shown}: {e}"))?;
        let lock = lock(&dir)?;
        let planned = plan.regions().to_vec();
        let mut report = RestoreReport {
            dir: dir.clone(),
            boot: 0,
            base_bytes: 0,
            journals: 0,
            batches: 0,
            entries: 0,
            journal_bytes: 0,
            torn_bytes: 0,
            elapsed: Duration::ZERO,
        };
        let io = |what: &'static str| {
            let dir = dir.clone();
            move |e: std::io::Error| format!("{what} in {}: {e}", dir.display())
        };
        let numbers = journal::list(&dir).map_err(io("cannot list the journals"))?;
        let (store, meta, active, next_seq) = match Meta::read(&dir)? {
            None => {
                if !numbers.is_empty() {
                    return Err(format!(
                        "the data directory {shown} holds journals but no metadata file: it \
                         was damaged (or `meta` was removed); refusing to start on it"
                    ));
                }
                if let Some(inner) = data_dir_within(&dir) {
                    return Err(format!(
                        "the data directory {shown} holds no memory server's data, but {} \
                         does (`namdb cluster up --data-dir DIR` keeps memory server i's \
                         data in DIR/memory-server-i): give that directory, or an empty \
                         one for a new server",
                        inner.display()
                    ));
                }
                let store =
                    Store::create(&dir, &planned).map_err(io("cannot create the base files"))?;
                let meta = Meta {
                    boot: 1,
                    applied_journal: 0,
                    applied_seq: 0,
                    epoch: 0,
                    promoted: None,
                    regions: planned,
                };
                meta.write(&dir)
                    .map_err(io("cannot write the metadata file"))?;
                (store, meta, 1, 1)
            }
            Some(mut meta) => {
                if let Some(d) = meta::plan_difference(&meta.regions, &planned) {
                    return Err(format!(
                        "the data directory {shown} was made for other regions: {d}; start the \
                         server with the --size and --region-size it was created with, or \
                         with another --data-dir"
                    ));
                }
                let store = Store::open(&dir, &planned)?;
                for (i, r) in regions.iter().enumerate() {
                    report.base_bytes += store.load(i, &r.region)?;
                }
                // Journals at or below the applied one are in the base files already:
                // a checkpoint recorded them and died before deleting them.
                for &n in numbers.iter().filter(|&&n| n <= meta.applied_journal) {
                    std::fs::remove_file(journal::path(&dir, n))
                        .map_err(io("cannot remove an applied journal"))?;
                }
                let pending: Vec<u64> = numbers
                    .iter()
                    .copied()
                    .filter(|&n| n > meta.applied_journal)
                    .collect();
                let mut next_seq = meta.applied_seq + 1;
                for (k, &n) in pending.iter().enumerate() {
                    let tail = if k + 1 == pending.len() {
                        Tail::CutTorn
                    } else {
                        Tail::Strict
                    };
                    let scanned = journal::scan(&journal::path(&dir, n), n, tail, next_seq, |e| {
                        let r = regions
                            .get(e.region as usize)
                            .ok_or_else(|| format!("a journal entry names region {}", e.region))?;
                        r.region.write(e.offset, e.bytes).map_err(|err| {
                            format!("replaying into region `{}`: {err}", r.info.name)
                        })
                    })?;
                    if scanned.torn_bytes > 0 || scanned.header_torn {
                        tracing::warn!(
                            journal = %journal::path(&dir, n).display(),
                            bytes = scanned.torn_bytes,
                            reason = scanned.torn_reason.as_deref().unwrap_or(""),
                            "cutting the interrupted last write off the journal (it was never acknowledged)"
                        );
                        journal::cut(&dir, n, &scanned)
                            .map_err(io("cannot cut the journal's torn tail"))?;
                        report.torn_bytes += scanned.torn_bytes;
                    }
                    if let Some(last) = scanned.last_seq {
                        next_seq = last + 1;
                    }
                    report.journals += 1;
                    report.batches += scanned.batches;
                    report.entries += scanned.entries;
                    report.journal_bytes += scanned.bytes;
                }
                meta.boot += 1;
                meta.write(&dir)
                    .map_err(io("cannot write the metadata file"))?;
                let active = numbers
                    .last()
                    .copied()
                    .unwrap_or(0)
                    .max(meta.applied_journal)
                    + 1;
                (store, meta, active, next_seq)
            }
        };
        let file = journal::create(&dir, active).map_err(io("cannot create a journal"))?;
        report.boot = meta.boot;
        report.elapsed = started.elapsed();

        let counters = Arc::new(journal::Counters::default());
        let (tx, rx) = mpsc::channel();
        let writer = Writer::new(&dir, file, active, next_seq, counters.clone());
        let writer = std::thread::Builder::new()
            .name("namdb-journal".into())
            .spawn(move || writer.run(rx))
            .map_err(|e| format!("cannot start the journal thread: {e}"))?;
        let shared = Arc::new(Shared {
            dir: dir.clone(),
            journal: Mutex::new(Some(tx)),
            checkpoint: Mutex::new(CheckpointState { store, meta }),
            counters,
            lock: Mutex::new(Some(lock)),
        });
        let (stop, stopped) = mpsc::channel();
        let interval = config.checkpoint_interval.max(Duration::from_millis(1));
        let checkpointer = {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name("namdb-checkpoint".into())
                .spawn(move || run_checkpoints(&shared, interval, &stopped))
                .map_err(|e| format!("cannot start the checkpoint thread: {e}"))?
        };
        Ok(Durable {
            shared,
            copier: Copier::new(regions, config.guard_wait),
            boot: AtomicU64::new(report.boot),
            report,
            checkpointer: Mutex::new(Some((stop, checkpointer))),
            writer: Mutex::new(Some(writer)),
        })
    }

    pub fn report(&self) -> &RestoreReport {
        &self.report
    }

    pub fn boot(&self) -> u64 {
        self.boot.load(Ordering::SeqCst)
    }

    pub fn counters(&self) -> &journal::Counters {
        &self.shared.counters
    }

    /// Validates `ranges`, copies them out of `regions` (waiting on guard words) and
    /// queues them for the journal, and for `replica` (a replicated primary's backup)
    /// in the same critical section, so both see the copies in one order. The first
    /// receiver answers once they are on disk, the second once the backup has them.
    /// `None` when the ranges hold no bytes. Blocks (guard waits): call off the async
    /// workers.
    pub fn persist(
        &self,
        regions: &[ServedRegion],
        ranges: &[proto::PersistRange],
        replica: Option<&Replicator>,
    ) -> Result<Option<PersistWaits>, PersistError> {
        self.copier.copy(
            regions,
            ranges,
            &self.shared.journal,
            Some(&self.shared.counters),
            |queue, entries, count, total| {
                let tx = queue.as_ref().ok_or(PersistError::Closed)?;
                // Shipped before journaled: both are queued under the lock, so the
                // order between them does not matter, only that each keeps the copies'.
                let shipped = replica
                    .map(|r| r.ship(entries.clone(), count))
                    .transpose()?;
                let (reply, wait) = oneshot::channel();
                tx.send(Msg::Persist(Pending {
                    entries,
                    count,
                    bytes: total,
                    reply,
                }))
                .map_err(|_| PersistError::Closed)?;
                Ok((Some(wait), shipped))
            },
        )
    }

    /// Queues entries a backup received from its primary for the journal (the
    /// caller orders them: one stream, applied one batch at a time).
    pub fn journal_entries(
        &self,
        entries: Vec<u8>,
        count: u32,
        bytes: u64,
    ) -> Result<oneshot::Receiver<Result<u64, String>>, PersistError> {
        let queue = self
            .shared
            .journal
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let tx = queue.as_ref().ok_or(PersistError::Closed)?;
        let (reply, wait) = oneshot::channel();
        tx.send(Msg::Persist(Pending {
            entries,
            count,
            bytes,
            reply,
        }))
        .map_err(|_| PersistError::Closed)?;
        Ok(wait)
    }

    /// The replication epoch of the data in force (see [`Promotion`]).
    pub fn epoch(&self) -> u64 {
        self.state().meta.epoch
    }

    /// The promotion the directory records, if any.
    pub fn promotion(&self) -> Option<Promotion> {
        let meta = &self.state().meta;
        meta.promoted.map(|at| Promotion::new(meta.epoch, at))
    }

    fn state(&self) -> std::sync::MutexGuard<'_, CheckpointState> {
        self.shared
            .checkpoint
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// Changes the metadata in force and writes it, durably (written, fsynced and
    /// renamed into place before this returns). Blocks on disk IO.
    fn update_meta(&self, change: impl FnOnce(&mut Meta)) -> Result<(), String> {
        let mut state = self.state();
        let mut meta = state.meta.clone();
        change(&mut meta);
        meta.write(&self.shared.dir)
            .map_err(|e| format!("{}: {e}", self.shared.dir.display()))?;
        self.boot.store(meta.boot, Ordering::SeqCst);
        state.meta = meta;
        Ok(())
    }

    /// Records a backup's promotion: its new boot, its new epoch and the time, in one
    /// atomic metadata update, so that a restart knows this directory holds data newer
    /// than its old primary's (and refuses to be a backup again).
    pub fn record_promotion(&self, boot: u64, epoch: u64) -> Result<Promotion, String> {
        let at = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        self.update_meta(|m| {
            m.boot = boot;
            m.epoch = epoch;
            m.promoted = Some(at);
        })?;
        Ok(Promotion::new(epoch, at))
    }

    /// Records the epoch of a primary this backup accepted, before its stream changes
    /// anything (a later attach compares against it).
    pub fn record_epoch(&self, epoch: u64) -> Result<(), String> {
        if self.epoch() == epoch {
            return Ok(());
        }
        self.update_meta(|m| m.epoch = epoch)
    }

    /// Forgets the promotion once a backup holds this primary's whole state: from then
    /// on the backup has every byte this directory has, so it no longer holds the only
    /// newer copy (and the backup, if it is promoted in turn, records its own).
    pub fn clear_promotion(&self) -> Result<(), String> {
        if self.state().meta.promoted.is_none() {
            return Ok(());
        }
        self.update_meta(|m| m.promoted = None)
    }

    /// Applies the journal to the base files now (what the checkpointer does every
    /// interval). Blocks on disk IO.
    #[cfg(test)]
    pub fn checkpoint(&self) -> Result<bool, String> {
        self.shared.checkpoint()
    }

    /// Stops the checkpointer, takes a last checkpoint, and stops the journal writer
    /// once everything queued is on disk. Blocks on disk IO.
    pub fn close(&self) -> Result<(), String> {
        let checkpointer = self
            .checkpointer
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some((stop, thread)) = checkpointer {
            drop(stop);
            let _ = thread.join();
        }
        let result = self.shared.checkpoint();
        let queue = self
            .shared
            .journal
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        drop(queue);
        let writer = self.writer.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(thread) = writer {
            let _ = thread.join();
        }
        // Even while something still holds this object, a new server may now open the
        // directory.
        self.shared
            .lock
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        result.map(|_| ())
    }

    /// Stops the background threads without waiting (a dropped server): the journal
    /// already holds every acknowledged byte, so no checkpoint is needed.
    pub fn abandon(&self) {
        self.checkpointer
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        self.shared
            .journal
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
    }
}

/// What a Persist waits for: the journal (durable servers) and the backup (replicated
/// primaries).
pub(crate) type PersistWaits = (
    Option<oneshot::Receiver<Result<u64, String>>>,
    Option<oneshot::Receiver<Result<(), crate::replica::Refusal>>>,
);

/// Validates Persist requests and copies their ranges out of region memory, for a
/// durable server and for a replicated primary without a data directory alike.
pub(crate) struct Copier {
    /// rkey to region index (plan order, as in the journal).
    rkeys: HashMap<u32, usize>,
    guard_wait: Duration,
}

impl Copier {
    pub fn new(regions: &[ServedRegion], guard_wait: Duration) -> Copier {
        let rkeys = regions
            .iter()
            .enumerate()
            .map(|(i, r)| (r.info.remote.rkey, i))
            .collect();
        Copier { rkeys, guard_wait }
    }

    /// Validates `ranges`, then copies them (waiting on guard words) while holding
    /// `order` and hands the entries to `send` under the same lock: whoever receives
    /// them receives them in the copies' order. `None` when the ranges hold no bytes.
    pub fn copy<L, T>(
        &self,
        regions: &[ServedRegion],
        ranges: &[proto::PersistRange],
        order: &Mutex<L>,
        counters: Option<&journal::Counters>,
        mut send: impl FnMut(&L, Vec<u8>, u32, u64) -> Result<T, PersistError>,
    ) -> Result<Option<T>, PersistError> {
        let mut total: u64 = 0;
        let mut resolved = Vec::with_capacity(ranges.len());
        for (index, r) in ranges.iter().enumerate() {
            let &i = self.rkeys.get(&r.rkey).ok_or(PersistError::UnknownRkey {
                index,
                rkey: r.rkey,
            })?;
            let region_len = regions[i].info.remote.len;
            if r.offset
                .checked_add(r.len)
                .is_none_or(|end| end > region_len)
            {
                return Err(PersistError::OutOfRange {
                    index,
                    region: regions[i].info.name.clone(),
                    offset: r.offset,
                    len: r.len,
                    region_len,
                });
            }
            if r.guarded && (!r.offset.is_multiple_of(8) || r.len < 8) {
                return Err(PersistError::BadGuard {
                    index,
                    offset: r.offset,
                    len: r.len,
                });
            }
            total = total.saturating_add(r.len);
            if total > MAX_PERSIST_BYTES {
                return Err(PersistError::TooLarge);
            }
            resolved.push((i, r));
        }
        if let Some(counters) = counters {
            counters.requests.fetch_add(1, Ordering::Relaxed);
            counters
                .ranges
                .fetch_add(ranges.len() as u64, Ordering::Relaxed);
        }
        if total == 0 {
            return Ok(None);
        }
        let started = Instant::now();
        let mut backoff = Duration::from_micros(20);
        loop {
            {
                let queue = order.lock().unwrap_or_else(|p| p.into_inner());
                let mut entries =
                    Vec::with_capacity(total as usize + resolved.len() * journal::ENTRY_HEADER_LEN);
                match copy(regions, &resolved, &mut entries) {
                    Ok(count) => return send(&queue, entries, count, total).map(Some),
                    Err(CopyFail::Fabric(e)) => return Err(PersistError::Disk(e)),
                    Err(CopyFail::Busy {
                        rkey,
                        offset,
                        state,
                        value,
                    }) => {
                        let waited = started.elapsed();
                        if waited >= self.guard_wait {
                            return Err(PersistError::GuardBusy {
                                rkey,
                                offset,
                                state,
                                value,
                                waited,
                            });
                        }
                    }
                }
            }
            // A lock is held for one commit's install (microseconds), so a short sleep
            // usually suffices; the cap keeps a long wait from spinning.
            std::thread::sleep(backoff);
            backoff = (backoff * 2).min(Duration::from_millis(1));
        }
    }
}

/// Copies every range into `out` as journal entries; fails without queuing anything if
/// a guard word is locked or moved during its range's copy.
fn copy(
    regions: &[ServedRegion],
    ranges: &[(usize, &proto::PersistRange)],
    out: &mut Vec<u8>,
) -> Result<u32, CopyFail> {
    let mut count = 0;
    for &(i, r) in ranges {
        if r.len == 0 {
            continue;
        }
        let region = &regions[i].region;
        let fabric = |e: fabric::FabricError| {
            CopyFail::Fabric(format!("reading region `{}`: {e}", regions[i].info.name))
        };
        let guard = if r.guarded {
            let g = region.load_u64(r.offset).map_err(fabric)?;
            if g >> 63 != 0 {
                return Err(CopyFail::Busy {
                    rkey: r.rkey,
                    offset: r.offset,
                    state: "locked",
                    value: g,
                });
            }
            Some(g)
        } else {
            None
        };
        journal::push_entry_header(out, i as u32, r.offset, r.len as u32);
        let start = out.len();
        out.resize(start + r.len as usize, 0);
        region.read(r.offset, &mut out[start..]).map_err(fabric)?;
        if let Some(before) = guard {
            // The copy loaded with Acquire, so this load cannot move before it: an
            // unchanged guard means no install ran (completed or not) during the copy.
            let after = region.load_u64(r.offset).map_err(fabric)?;
            if after != before {
                return Err(CopyFail::Busy {
                    rkey: r.rkey,
                    offset: r.offset,
                    state: "changing",
                    value: after,
                });
            }
        }
        count += 1;
    }
    Ok(count)
}

impl Shared {
    /// Closes the current journal and applies every closed one to the base files:
    /// entries in order, fsync the base files, record them applied (atomically), then
    /// delete them. A crash anywhere in between replays them on start, which is
    /// harmless: replaying a redo journal over a state that already holds some of it
    /// ends in the same bytes. Returns whether anything was applied.
    fn checkpoint(&self) -> Result<bool, String> {
        let mut state = self.checkpoint.lock().unwrap_or_else(|p| p.into_inner());
        let started = Instant::now();
        let (tx, rx) = mpsc::channel();
        self.journal
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .ok_or("the journal is closed")?
            .send(Msg::Rotate(tx))
            .map_err(|_| "the journal thread is gone")?;
        let rotated = rx.recv().map_err(|_| "the journal thread is gone")??;
        let dir_err = |e: std::io::Error| format!("{}: {e}", self.dir.display());
        let CheckpointState { store, meta } = &mut *state;
        let closed: Vec<u64> = journal::list(&self.dir)
            .map_err(dir_err)?
            .into_iter()
            .filter(|&n| n > meta.applied_journal && n < rotated.active)
            .collect();
        let Some(&last) = closed.last() else {
            return Ok(false);
        };
        let mut next_seq = meta.applied_seq + 1;
        let mut entries = 0;
        for &n in &closed {
            let scanned = journal::scan(
                &journal::path(&self.dir, n),
                n,
                Tail::Strict,
                next_seq,
                |e| store.apply(e.region, e.offset, e.bytes),
            )?;
            if let Some(s) = scanned.last_seq {
                next_seq = s + 1;
            }
            entries += scanned.entries;
        }
        store.sync()?;
        let mut applied = meta.clone();
        applied.applied_journal = last;
        applied.applied_seq = next_seq - 1;
        applied.write(&self.dir).map_err(dir_err)?;
        *meta = applied;
        for &n in &closed {
            std::fs::remove_file(journal::path(&self.dir, n)).map_err(dir_err)?;
        }
        meta::sync_dir(&self.dir).map_err(dir_err)?;
        let elapsed = started.elapsed();
        self.counters.checkpoints.fetch_add(1, Ordering::Relaxed);
        self.counters
            .last_checkpoint_us
            .store(elapsed.as_micros() as u64, Ordering::Relaxed);
        tracing::debug!(
            journals = closed.len(),
            entries,
            elapsed_ms = elapsed.as_millis() as u64,
            "checkpoint"
        );
        Ok(true)
    }
}

fn run_checkpoints(shared: &Shared, interval: Duration, stop: &mpsc::Receiver<()>) {
    while let Err(mpsc::RecvTimeoutError::Timeout) = stop.recv_timeout(interval) {
        if let Err(e) = shared.checkpoint() {
            tracing::warn!(
                "checkpoint failed (the journal still holds everything; retrying in {interval:?}): {e}"
            );
        }
    }
}

/// Takes the directory's lock: two servers writing one directory would corrupt it.
/// The kernel drops the lock when the process dies, however it dies.
/// A memory server's data directory directly inside `dir`, if there is one. A server
/// given its cluster's data directory instead of its own would otherwise start there as
/// a new, empty server, and the compute nodes would set up a new cluster on it.
fn data_dir_within(dir: &Path) -> Option<PathBuf> {
    let mut inner: Vec<PathBuf> = std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.is_dir() && matches!(Meta::read(p), Ok(Some(_))))
        .collect();
    inner.sort();
    inner.into_iter().next()
}

fn lock(dir: &Path) -> Result<File, String> {
    let path = dir.join("lock");
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(|e| format!("cannot open {}: {e}", path.display()))?;
    match rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => Ok(file),
        Err(rustix::io::Errno::WOULDBLOCK) => Err(format!(
            "the data directory {} is in use by another memory server",
            dir.display()
        )),
        Err(e) => Err(format!("cannot lock {}: {e}", path.display())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fabric::sim::{SimConfig, SimNetwork};

    #[test]
    fn promotion_times_read_as_utc_dates() {
        let at = |s| Promotion::new(1, s).at_utc();
        assert_eq!(at(0), "1970-01-01 00:00:00 UTC");
        assert_eq!(at(1_700_000_000), "2023-11-14 22:13:20 UTC");
        assert_eq!(at(951_868_799), "2000-02-29 23:59:59 UTC");
    }

    fn plan() -> RegionPlan {
        RegionPlan::new(8192, 4096).unwrap()
    }

    /// Fresh (zero) regions of `plan()` and the directory opened on them.
    fn open(dir: &Path, interval: Duration) -> Result<(Vec<ServedRegion>, Durable), String> {
        let dev = SimNetwork::new(SimConfig::default()).add_node();
        let regions = crate::regions::create(&plan(), &*dev, false).unwrap();
        let mut config = DurabilityConfig::new(dir);
        config.checkpoint_interval = interval;
        config.guard_wait = Duration::from_millis(50);
        let durable = Durable::open(&config, &plan(), &regions)?;
        Ok((regions, durable))
    }

    fn range(regions: &[ServedRegion], i: usize, offset: u64, len: u64) -> proto::PersistRange {
        proto::PersistRange {
            rkey: regions[i].info.remote.rkey,
            offset,
            len,
            guarded: false,
        }
    }

    fn persist(d: &Durable, regions: &[ServedRegion], ranges: &[proto::PersistRange]) -> u64 {
        let (wait, _) = d.persist(regions, ranges, None).unwrap().unwrap();
        wait.unwrap().blocking_recv().unwrap().unwrap()
    }

    const LONG: Duration = Duration::from_secs(3600);

    #[test]
    fn restores_journal_and_checkpoints_and_counts_boots() {
        let dir = tempfile::tempdir().unwrap();
        let (regions, d) = open(dir.path(), LONG).unwrap();
        assert_eq!(d.boot(), 1);
        regions[1].region.write(100, b"first").unwrap();
        regions[2].region.write(0, b"second").unwrap();
        let ranges = [range(&regions, 1, 100, 5), range(&regions, 2, 0, 6)];
        assert_eq!(persist(&d, &regions, &ranges), 11);
        // Applied to the base files; the next write goes to a new journal.
        assert!(d.checkpoint().unwrap());
        assert!(!d.checkpoint().unwrap(), "nothing new to apply");
        regions[1].region.write(100, b"FIRST").unwrap();
        persist(&d, &regions, &[range(&regions, 1, 100, 3)]);
        // Never persisted: must not come back.
        regions[1].region.write(200, b"lost").unwrap();
        // Dropped without close (as if killed): the journal alone carries the last one.
        d.abandon();
        drop(d);
        std::thread::sleep(Duration::from_millis(20));

        let (regions, d) = open(dir.path(), LONG).unwrap();
        assert_eq!(d.boot(), 2);
        let r = d.report();
        assert_eq!((r.journals, r.batches, r.journal_bytes), (1, 1, 3));
        assert_eq!(regions[1].region.to_vec(100, 5).unwrap(), b"FIRst");
        assert_eq!(regions[1].region.to_vec(200, 4).unwrap(), [0; 4]);
        assert_eq!(regions[2].region.to_vec(0, 6).unwrap(), b"second");
        d.close().unwrap();
        // The clean close checkpointed: nothing is left to replay.
        let (regions, d) = open(dir.path(), LONG).unwrap();
        assert_eq!((d.boot(), d.report().journals), (3, 1));
        assert_eq!(d.report().batches, 0);
        assert_eq!(regions[1].region.to_vec(100, 5).unwrap(), b"FIRst");
        // A second server on the same directory is refused while this one runs.
        let err = open(dir.path(), LONG).err().unwrap();
        assert!(err.contains("in use by another memory server"), "{err}");
        d.close().unwrap();
    }

    #[test]
    fn a_checkpoint_that_died_before_deleting_its_journal_is_harmless() {
        let dir = tempfile::tempdir().unwrap();
        let (regions, d) = open(dir.path(), LONG).unwrap();
        regions[1].region.write(8, b"old").unwrap();
        persist(&d, &regions, &[range(&regions, 1, 8, 3)]);
        let applied = std::fs::read(journal::path(dir.path(), 1)).unwrap();
        assert!(d.checkpoint().unwrap());
        regions[1].region.write(8, b"new").unwrap();
        persist(&d, &regions, &[range(&regions, 1, 8, 3)]);
        d.abandon();
        drop(d);
        std::thread::sleep(Duration::from_millis(20));
        // Journal 1 reappears as if its deletion never happened: it is applied already
        // (and older than journal 2), so replaying it would roll "new" back to "old".
        std::fs::write(journal::path(dir.path(), 1), applied).unwrap();
        let (regions, d) = open(dir.path(), LONG).unwrap();
        assert_eq!(regions[1].region.to_vec(8, 3).unwrap(), b"new");
        assert!(!journal::path(dir.path(), 1).exists());
        d.close().unwrap();
    }

    #[test]
    fn a_different_plan_or_a_damaged_directory_refuses_to_start() {
        let dir = tempfile::tempdir().unwrap();
        let (_, d) = open(dir.path(), LONG).unwrap();
        d.close().unwrap();
        drop(d);
        let dev = SimNetwork::new(SimConfig::default()).add_node();
        let other = RegionPlan::new(16384, 4096).unwrap();
        let regions = crate::regions::create(&other, &*dev, false).unwrap();
        let err = Durable::open(&DurabilityConfig::new(dir.path()), &other, &regions)
            .err()
            .unwrap();
        assert!(
            err.contains("made for other regions") && err.contains("--size"),
            "{err}"
        );
        std::fs::remove_file(dir.path().join(meta::META_FILE)).unwrap();
        let err = open(dir.path(), LONG).err().unwrap();
        assert!(err.contains("no metadata file"), "{err}");
    }

    #[test]
    fn the_directory_above_a_data_directory_is_refused_naming_it() {
        let cluster = tempfile::tempdir().unwrap();
        let own = cluster.path().join("memory-server-0");
        let (_, d) = open(&own, LONG).unwrap();
        d.close().unwrap();
        drop(d);
        let err = open(cluster.path(), LONG).err().unwrap();
        assert!(
            err.contains(&format!(
                "holds no memory server's data, but {} does",
                own.display()
            )),
            "{err}"
        );
        // Nothing was created beside it, and the server's own directory still opens.
        assert!(!cluster.path().join(meta::META_FILE).exists());
        let (_, d) = open(&own, LONG).unwrap();
        assert_eq!(d.boot(), 2);
        d.close().unwrap();
        // A directory with other files, or empty ones, is still a new server's.
        let other = tempfile::tempdir().unwrap();
        std::fs::create_dir(other.path().join("lost+found")).unwrap();
        std::fs::write(other.path().join("notes"), "x").unwrap();
        let (_, d) = open(other.path(), LONG).unwrap();
        assert_eq!(d.boot(), 1);
        d.close().unwrap();
    }

    #[test]
    fn the_background_checkpointer_applies_and_deletes_journals() {
        let dir = tempfile::tempdir().unwrap();
        let (regions, d) = open(dir.path(), Duration::from_millis(10)).unwrap();
        regions[1].region.write(0, b"x").unwrap();
        persist(&d, &regions, &[range(&regions, 1, 0, 1)]);
        let deadline = Instant::now() + Duration::from_secs(5);
        while d.counters().checkpoints.load(Ordering::Relaxed) == 0 {
            assert!(Instant::now() < deadline, "no checkpoint within 5 s");
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(journal::list(dir.path()).unwrap(), [2]);
        let base = std::fs::read(dir.path().join(store::file_name("data.0"))).unwrap();
        assert_eq!(base[0], b'x');
        d.close().unwrap();
    }
}
