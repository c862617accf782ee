//! Compute-side handles: a [`Worker`] is one thread's share of the cluster (a
//! connection per memory server, an oracle slot, the address cache, registered
//! buffers), on which many transactions run at once as futures; a [`Client`] is a
//! worker with one session and blocking calls.
//!
//! Latency hiding (DESIGN.md, "RSI"): the coroutines of a worker share everything, so
//! the waits of one (its requests in flight, its commit becoming visible) are other
//! coroutines' working time. What they share is batched:
//!
//! - **Read timestamps.** `begin` needs a read timestamp taken after it was called
//!   (real-time order: it must see every commit that returned before). Coroutines that
//!   begin in the same round of the executor share one oracle read: `begin` yields
//!   once, and the first to run again reads for all.
//! - **Marks.** A decided commit timestamp is queued and all queued ones go out in one
//!   doorbell ([`timestamp::SlotHandle::mark_many`], coalesced per word) before the
//!   next oracle read, which is the first moment anyone could need them.

use crate::conn::AsyncConn;
use crate::error::{Result, TxnError};
use crate::index::IndexCache;
use crate::runtime::{self, yield_now};
use crate::store::Database;
use crate::transaction::{AsyncTransaction, Parts, Suspended, Transaction};
use fabric::{Access, Device};
use smallvec::SmallVec;
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::future::Future;
use std::ops::Range;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};
use timestamp::{Outcome, SlotHandle, SystemClock};

/// How long `begin` or a visibility wait may wait for the read timestamp to move.
const RID_PATIENCE: Duration = Duration::from_secs(10);
/// Fruitless oracle reads in a row after which a waiting worker yields its thread.
const IDLE_READS_BEFORE_YIELD: u64 = 8;
/// Send queue depth of a worker's connections.
const SEND_QUEUE: u32 = 4096;

/// Counters of one worker.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ClientStats {
    /// Block reads rejected by the seqlock check because the headers differed.
    pub torn_retries: u64,
    /// Block reads retried because the record was locked.
    pub locked_retries: u64,
    pub committed: u64,
    pub aborted: u64,
    /// Aborts by reason.
    pub conflicts: u64,
    pub duplicate_keys: u64,
    pub too_old: u64,
    /// Dead holders' commits this worker resolved after fencing their slots.
    pub recoveries: u64,
    /// Commits given up to recovery because this worker's slot was fenced under them.
    pub abandoned: u64,
    /// Times the oracle slot was fenced (idle past the lease timeout) and re-taken.
    pub rejoins: u64,
    /// Oracle reads for read timestamps (shared by the coroutines that needed them).
    pub oracle_reads: u64,
    /// Times the thread slept because everything it ran waited for persists.
    pub persist_wait_sleeps: u64,
}

#[derive(Default)]
struct RidState {
    /// Oracle reads started, and the number of the last one finished.
    started: u64,
    finished: u64,
    /// Whether a read is in flight.
    reading: bool,
    /// The highest read timestamp seen.
    rid: u64,
    /// Under [`Worker::run_coroutines`]: the executor's round, and the round of the
    /// last oracle read. One read per round serves every coroutine waiting: more
    /// would only see the same prefix, since nothing of this thread moved it.
    executor: bool,
    round: u64,
    read_round: u64,
}

/// Coroutines waiting for persists, and whether an executor reports its rounds.
///
/// A persist waits for a disk: spinning on it would take the CPU from the memory
/// servers' journal threads on a small host, so a thread whose coroutines all wait
/// for persists sleeps a little every few rounds. Only a whole round of waiting may
/// put the thread to sleep: when each waiting coroutine slept on every few of its own
/// turns, a round of 32 coroutines slept several times, and every coroutine's next
/// step (an RDMA completion already there) waited for all those sleeps.
#[derive(Default)]
struct PersistWaits {
    /// An executor calls [`Worker::end_round`] after each round.
    rounds_reported: bool,
    /// Turns in the current round that found their persist still pending.
    idle_turns: usize,
    /// Rounds in a row whose every turn found its persist pending.
    idle_rounds: u32,
    /// Turns in a row of a coroutine waiting alone (no rounds reported).
    idle_alone: u32,
}

/// Idle rounds (or turns, waiting alone) between two sleeps of the thread.
const PERSIST_IDLE_TURNS_BEFORE_SLEEP: u32 = 4;
const PERSIST_IDLE_SLEEP: std::time::Duration = std::time::Duration::from_micros(50);

/// One thread's compute handle. It is `Send` but not `Sync`: coroutines of the thread
/// that owns it share it by reference.
pub struct Worker {
    db: Database,
    device: Arc<dyn Device>,
    conns: Vec<AsyncConn>,
    slot: SlotHandle,
    caches: RefCell<Vec<IndexCache>>,
    /// Blocks this worker allocated ahead, by (table, partition): inserts take them
    /// without a FETCH_ADD of their own (see [`allocation_chunk`]).
    spare_blocks: RefCell<SpareBlocks>,
    /// Transactions' working memory, reused.
    parts: RefCell<Vec<Parts>>,
    stats: Cell<ClientStats>,
    marks: RefCell<Vec<(u64, Outcome)>>,
    rids: RefCell<RidState>,
    /// How this worker's coroutines waiting for persists pace their thread.
    persist_waits: RefCell<PersistWaits>,
    /// Oracle reads in a row that did not reach what their reader waited for.
    idle_reads: Cell<u64>,
    /// This worker's place in its slot's commit log.
    log: RefCell<SlotLog>,
    /// Why this worker stopped committing: a committed transaction of its own is
    /// left half installed, and only recovery (after its lease lapses) may finish it.
    broken: RefCell<Option<String>>,
    /// Holds no oracle slot: reads at snapshots, commits nothing.
    read_only: bool,
    /// Commits abandoned to recovery ([`TxnError::Fenced`]) whose outcome no one has
    /// asked for yet ([`Worker::fenced_outcome`]), by CID.
    fenced: RefCell<std::collections::BTreeMap<u64, FencedCommit>>,
    /// Holders this worker fenced whose work is not resolved yet: a recovery that
    /// failed (a Persist refused while a backup is away, a lost connection) gives its
    /// claim back, and the fencer tries again on its later ticks. Nobody else would
    /// until the slot's next claimer.
    unresolved: RefCell<Vec<Unresolved>>,
}

/// A holder fenced by this worker, still to resolve.
struct Unresolved {
    slot: u32,
    /// The lease the fence wrote (the holder's tag is the one before).
    fenced: timestamp::Lease,
    /// For the takeover of another node's stalled recovery of it.
    watching: Option<(u64, Instant)>,
}

/// What a commit abandoned to recovery knew when it stopped.
#[derive(Clone, Copy, Debug)]
struct FencedCommit {
    epoch: Epoch,
    /// Its log record was complete: recovery rolls it forward.
    logged: bool,
}

/// Fenced commits a worker remembers for [`Worker::fenced_outcome`]; past this, the
/// oldest are forgotten (a caller that never asks must not grow the map for good).
const MAX_FENCED_REMEMBERED: usize = 1024;

/// What became of a commit that failed with [`TxnError::Fenced`]
/// ([`Worker::fenced_outcome`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FencedOutcome {
    /// Its log record was complete: recovery rolled it forward at this CID, and
    /// transactions that begin from now on see it.
    Committed { cid: u64 },
    /// It had not logged: recovery released what it locked, and it has no effect.
    RolledBack,
}

/// Spare blocks by (table, partition): ranges of block numbers.
/// Transactions' parts a worker keeps for its next transactions.
const MAX_POOLED_PARTS: usize = 64;

type SpareBlocks = HashMap<(u32, usize), SmallVec<[Range<u64>; 2]>, foldhash::fast::FixedState>;

/// Blocks an insert allocates at once in a partition of `capacity` blocks: the one it
/// needs and the rest for the worker's next inserts, so most inserts need no
/// FETCH_ADD (a checkout's four inserts took four). At most 1/1024 of the partition
/// per worker and partition, so the spare blocks idle workers hold never fill a table
/// (tables are sized with 1/16 to spare); one block at a time for small tables, as
/// exact capacity matters there. Spare blocks a worker never uses stay zeroed, which
/// scans and recovery read as empty.
pub(crate) fn allocation_chunk(capacity: u64) -> u64 {
    (capacity / 1024).clamp(1, 16)
}

/// Which slot (and which holding of it) a worker's commits log under, and where.
struct SlotLog {
    epoch: Epoch,
    ring: crate::commitlog::Ring,
}

/// One holding of an oracle slot: the slot and the lease tag of its claim. A commit
/// posts its steps only while the worker's epoch is still the one it began under.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Epoch {
    pub(crate) slot: u32,
    pub(crate) tag: u16,
}

impl Worker {
    pub(crate) fn new(db: Database) -> Result<Worker> {
        Self::open(db, false)
    }

    /// A worker that holds no oracle slot ([`Database::reader`]).
    pub(crate) fn new_reader(db: Database) -> Result<Worker> {
        Self::open(db, true)
    }

    fn open(db: Database, read_only: bool) -> Result<Worker> {
        let shared = &db.shared;
        let device = db.new_device()?;
        let mut conns = Vec::with_capacity(shared.servers.len());
        for link in &shared.servers {
            let cq = device.create_cq(SEND_QUEUE * 2)?;
            let qp = link.connect(&device, &cq, SEND_QUEUE)?;
            conns.push(AsyncConn::new(qp, cq));
        }
        let oracle = shared.catalog.oracle();
        let ocq = device.create_cq(timestamp::MIN_CQ_CAPACITY * 4)?;
        let oqp = shared.servers[oracle.server as usize].connect(
            &device,
            &ocq,
            timestamp::MIN_SEND_QUEUE * 2,
        )?;
        let slot = SlotHandle::observe_at(
            device.as_ref(),
            oqp,
            ocq,
            oracle.data,
            oracle.offset,
            shared.options.oracle.clone(),
            SystemClock::shared(),
        )?;
        slot.share_gates(shared.lease_gates.clone());
        if !read_only {
            // A worker takes over a slot whose holder is gone if none is free: the
            // holder's commits are then resolved by adopt_slot below.
            slot.claim_taking_over()?;
        }
        let epoch = Epoch {
            slot: slot.slot(),
            tag: slot.held_lease().tag,
        };
        if !read_only {
            db.adopt_slot(epoch.slot, epoch.tag, &|| {
                let _ = slot.ensure_lease();
            })?;
        }
        let ring = crate::commitlog::Ring::new(shared.catalog.commit_log().ring_bytes());
        Ok(Worker {
            db: db.clone(),
            device,
            conns,
            slot,
            caches: RefCell::new(Vec::new()),
            spare_blocks: RefCell::new(SpareBlocks::default()),
            parts: RefCell::new(Vec::new()),
            stats: Cell::new(ClientStats::default()),
            marks: RefCell::new(Vec::new()),
            rids: RefCell::new(RidState::default()),
            persist_waits: RefCell::new(PersistWaits::default()),
            idle_reads: Cell::new(0),
            log: RefCell::new(SlotLog { epoch, ring }),
            broken: RefCell::new(None),
            read_only,
            fenced: RefCell::new(Default::default()),
            unresolved: RefCell::new(Vec::new()),
        })
    }

    /// Whether this worker holds no oracle slot and so cannot commit writes
    /// ([`Database::reader`]).
    pub fn is_read_only(&self) -> bool {
        self.read_only
    }

    pub fn database(&self) -> &Database {
        &self.db
    }

    pub(crate) fn device(&self) -> &Arc<dyn Device> {
        &self.device
    }

    pub fn stats(&self) -> ClientStats {
        self.stats.get()
    }

    pub(crate) fn count(&self, f: impl FnOnce(&mut ClientStats)) {
        let mut s = self.stats.get();
        f(&mut s);
        self.stats.set(s);
    }

    pub(crate) fn conn(&self, server: usize) -> &AsyncConn {
        &self.conns[server]
    }

    pub(crate) fn cached_addr(&self, table: u32, key: u64) -> Option<u64> {
        self.caches
            .borrow()
            .get(table as usize)
            .and_then(|c| c.get(key))
    }

    /// A block of `table`'s partition `part` this worker allocated ahead, if it has one.
    pub(crate) fn take_spare_block(&self, table: u32, part: usize) -> Option<u64> {
        let mut spare = self.spare_blocks.borrow_mut();
        let ranges = spare.get_mut(&(table, part))?;
        let block = ranges.iter_mut().find(|r| !r.is_empty())?.next();
        ranges.retain(|r| !r.is_empty());
        block
    }

    /// Keeps `blocks` of `table`'s partition `part` for this worker's later inserts.
    pub(crate) fn add_spare_blocks(&self, table: u32, part: usize, blocks: Range<u64>) {
        if !blocks.is_empty() {
            self.spare_blocks
                .borrow_mut()
                .entry((table, part))
                .or_default()
                .push(blocks);
        }
    }

    pub(crate) fn cache_addr(&self, table: u32, key: u64, addr: u64) {
        let mut caches = self.caches.borrow_mut();
        if caches.len() <= table as usize {
            caches.resize_with(table as usize + 1, IndexCache::default);
        }
        caches[table as usize].put(key, addr);
    }

    /// Working memory for one transaction (with its registered buffer), from the pool.
    pub(crate) fn take_parts(&self) -> Result<Parts> {
        if let Some(p) = self.parts.borrow_mut().pop() {
            return Ok(p);
        }
        let bytes = self.db.shared.options.scratch_bytes;
        Ok(Parts::new(self.device.register(bytes, Access::LOCAL)?))
    }

    /// Keeps `parts` for the next transaction, up to [`MAX_POOLED_PARTS`]: a burst of
    /// open transactions (a compute node's clients) would otherwise keep its buffers, a
    /// transaction's scratch each, for good. Coroutines that commit and begin again
    /// take back what they return, so the pool stays small under any steady load.
    pub(crate) fn return_parts(&self, mut parts: Parts) {
        let mut pool = self.parts.borrow_mut();
        if pool.len() < MAX_POOLED_PARTS {
            parts.clear();
            pool.push(parts);
        }
    }

    /// Transactions' buffers pooled now (for tests).
    pub fn pooled_parts(&self) -> usize {
        self.parts.borrow().len()
    }

    /// Queues the decision of a commit timestamp; see the module doc.
    pub(crate) fn decide(&self, cid: u64, outcome: Outcome) {
        self.marks.borrow_mut().push((cid, outcome));
    }

    /// Posts every queued decision, in one doorbell.
    ///
    /// A decision queued under a slot claim that was fenced since (a commit that
    /// finished while another coroutine found the fence and rejoined) is dropped: the
    /// fence decided that timestamp, and `mark_many` refuses the whole batch for one
    /// that is not outstanding. Sent along, it cost the batch's current decisions
    /// too, and a timestamp handed out, never decided by its live holder, stalls
    /// every reader of the oracle for good (found under load in `tpcw`'s tests).
    pub fn flush_marks(&self) -> Result<()> {
        let mut marks = std::mem::take(&mut *self.marks.borrow_mut());
        let queued = marks.len();
        marks.retain(|&(cid, _)| self.slot.is_outstanding(cid));
        if marks.len() < queued {
            tracing::debug!(
                dropped = queued - marks.len(),
                "decisions of commits under a fenced slot claim, decided by the fence"
            );
        }
        if !marks.is_empty() {
            let posted = if crate::crash::decisions_fail() {
                Err(crate::crash::injected_transport_error())
            } else {
                self.slot.mark_many(&marks)
            };
            match posted {
                // The fence decided the slot's timestamps, these among them, and its
                // recovery owns whatever our commits left: take a slot again (a
                // thread starved of CPU past its lease gets here, under load).
                Err(timestamp::OracleError::Fenced { .. }) => return self.rejoin(),
                // The decisions are gone with the batch (some may have landed, so
                // they cannot be posted again): only a fence can decide the rest, and
                // a live holder is never fenced. Stop, so that the lease lapses.
                Err(e) => {
                    let e = TxnError::from(e);
                    self.stop_committing(format!(
                        "the decisions of commits {:?} could not be posted ({e}); a fence decides them once this worker's lease lapses",
                        marks.iter().map(|m| m.0).collect::<Vec<_>>()
                    ));
                    return Err(e);
                }
                Ok(()) => {}
            }
        }
        Ok(())
    }

    /// Keeps the oracle slot moving (skips unused timestamps, renews the lease); a slot
    /// fenced meanwhile is re-taken.
    ///
    /// A tick that fences another node's slot resolves that holder's commits
    /// ([`crate::recovery`]) before it returns.
    ///
    /// A broken worker ([`TxnError::Broken`]) does not tick: its lease must lapse, so
    /// that a fencer's recovery finishes the commit it left half installed.
    pub fn tick(&self) -> Result<()> {
        if self.is_broken() {
            return Ok(());
        }
        match self.slot.tick() {
            Ok(report) => {
                if let (Some(slot), Some(fenced)) = (report.fenced, report.fenced_lease) {
                    self.unresolved.borrow_mut().push(Unresolved {
                        slot,
                        fenced,
                        watching: None,
                    });
                }
                self.resolve_fenced()
            }
            Err(timestamp::OracleError::Fenced { .. }) => self.rejoin(),
            Err(e) => Err(e.into()),
        }
    }

    /// Has the next ticks check whether the holder of commit timestamp `cid` (found
    /// holding a lock too long) is alive, and fence its slot and resolve its work if
    /// it is not: with no commit deciding later timestamps, nothing else would.
    pub(crate) fn suspect_holder(&self, cid: u64) {
        let slots = u64::from(self.slot.layout().slots());
        self.slot.suspect((cid % slots) as u32);
    }

    /// Resolves the work of the holders this worker fenced (each fence bumped its
    /// holder's tag once, to `fenced.tag`); those not resolved yet stay for the next
    /// tick. The first error is returned after every holder had its try.
    fn resolve_fenced(&self) -> Result<()> {
        if self.unresolved.borrow().is_empty() {
            return Ok(());
        }
        let pending = std::mem::take(&mut *self.unresolved.borrow_mut());
        let mut left = Vec::new();
        let mut failed = None;
        for mut holder in pending {
            match self.step_fenced(&mut holder) {
                Ok(true) => {}
                Ok(false) => left.push(holder),
                Err(e) => {
                    left.push(holder);
                    failed.get_or_insert(e);
                }
            }
        }
        self.unresolved.borrow_mut().extend(left);
        failed.map_or(Ok(()), Err)
    }

    /// One step towards the resolution of a fenced holder: `true` once the slot's
    /// guard is about another holder or clean. Resolved here if nobody began to
    /// (counted as this worker's recovery); otherwise as `Database::step_resolution`
    /// does for anyone waiting on a holder.
    fn step_fenced(&self, holder: &mut Unresolved) -> Result<bool> {
        use crate::commitlog::Guard;
        let log = self.db.shared.catalog.commit_log();
        let slot = holder.slot;
        let word = self.db.recovery_conns()[crate::commitlog::SERVER].read_word(log.guard(slot))?;
        let guard = Guard::decode(word)?;
        let (Guard::Clean { tag } | Guard::Active { tag } | Guard::Recovering { tag, .. }) = guard;
        let fenced = holder.fenced;
        if (timestamp::Lease { tag, ..fenced }).next_tag() != fenced.tag {
            return Ok(true);
        }
        if matches!(guard, Guard::Active { .. })
            && self
                .db
                .resolve_holder(slot, tag, &|| self.keep_lease())?
                .is_some()
        {
            self.count(|s| s.recoveries += 1);
            return Ok(true);
        }
        self.db
            .step_resolution(slot, tag, &mut holder.watching, &|| self.keep_lease())
    }

    /// Renews this worker's lease if due ([`crate::recovery::KeepLease`]): a failure
    /// (fenced meanwhile) shows at the next step that needs the lease.
    fn keep_lease(&self) {
        let _ = self.slot.ensure_lease();
    }

    /// Claims a slot again after ours was fenced, and takes its commit log over
    /// (resolving its previous holder first if need be). Commits in flight under the
    /// old slot fail their next step with [`TxnError::Fenced`].
    fn rejoin(&self) -> Result<()> {
        self.slot.rejoin()?;
        self.count(|s| s.rejoins += 1);
        let epoch = Epoch {
            slot: self.slot.slot(),
            tag: self.slot.held_lease().tag,
        };
        self.db
            .adopt_slot(epoch.slot, epoch.tag, &|| self.keep_lease())?;
        let ring = crate::commitlog::Ring::new(self.db.shared.catalog.commit_log().ring_bytes());
        *self.log.borrow_mut() = SlotLog { epoch, ring };
        Ok(())
    }

    /// A commit timestamp of this worker's slot (no communication, except now and
    /// then to renew the lease or raise the slot's reservation), and the epoch the
    /// commit runs under.
    pub(crate) fn commit_timestamp(&self) -> Result<(u64, Epoch)> {
        self.check_broken()?;
        if self.read_only {
            return Err(TxnError::Invalid(
                "a read-only worker (Database::reader) cannot commit writes: use Database::worker"
                    .into(),
            ));
        }
        let cid = match self.slot.acquire_commit_ts(1000) {
            Err(timestamp::OracleError::Fenced { .. }) => {
                self.rejoin()?;
                self.slot.acquire_commit_ts(1000)?
            }
            other => other?,
        };
        Ok((cid, self.log.borrow().epoch))
    }

    /// Whether this worker stopped committing after a commit it could not finish
    /// ([`TxnError::Broken`]); such a worker should be dropped and replaced.
    pub fn is_broken(&self) -> bool {
        self.broken.borrow().is_some()
    }

    fn check_broken(&self) -> Result<()> {
        match self.broken.borrow().as_ref() {
            Some(why) => Err(TxnError::Broken(why.clone())),
            None => Ok(()),
        }
    }

    /// Stops this worker committing: commit `cid` is logged but could not be
    /// installed (or made durable) because of `error`, so its locks stay for the
    /// recovery that follows this worker's lease.
    pub(crate) fn break_off(&self, cid: u64, error: &TxnError) {
        self.stop_committing(format!(
            "commit {cid} is committed but was left half installed ({error}); recovery finishes it once this worker's lease lapses"
        ));
    }

    /// Stops this worker committing: commit `cid` failed (not logged), and `error`
    /// says its lease could not be checked, so it may neither release its locks nor
    /// decide its timestamp (either could land after a fence). Going on under the
    /// lease would leave that timestamp undecided by a live holder, which holds back
    /// every reader of the oracle for as long as the worker lives (nobody fences a
    /// live holder); stopped, its lease lapses, a fencer decides the timestamp and
    /// recovery releases the locks.
    pub(crate) fn break_off_unchecked(&self, cid: u64, error: &TxnError) {
        self.stop_committing(format!(
            "commit {cid} failed and its lease could not be checked ({error}); recovery rolls it back once this worker's lease lapses"
        ));
    }

    /// Makes the worker broken for `why` ([`TxnError::Broken`]): it commits and ticks
    /// no more, so its lease lapses.
    fn stop_committing(&self, why: String) {
        tracing::warn!(%why, "this worker stops committing");
        *self.broken.borrow_mut() = Some(format!("{why}: open a new worker"));
    }

    /// Remembers commit `cid`, abandoned under `epoch` with its log record complete or
    /// not, for [`Worker::fenced_outcome`].
    pub(crate) fn note_fenced(&self, cid: u64, epoch: Epoch, logged: bool) {
        let mut fenced = self.fenced.borrow_mut();
        fenced.insert(cid, FencedCommit { epoch, logged });
        while fenced.len() > MAX_FENCED_REMEMBERED {
            fenced.pop_first();
        }
    }

    /// The outcome of commit `cid` of this worker, which failed with
    /// [`TxnError::Fenced`], once recovery has decided it; asked once per commit.
    ///
    /// A fenced commit posted nothing after its last completed step (every step
    /// checks the lease first), so it knows whether its log record is complete, and
    /// recovery decides by exactly that: complete, it rolls the commit forward,
    /// else back. This waits until the fenced holder's work is resolved (resolving
    /// it here if no one began to, taking over a recovery stalled for
    /// [`crate::recovery::TAKEOVER`]) and, for a commit, until the oracle's prefix
    /// includes it, as a commit waits with `wait_visible`; meanwhile the worker's
    /// other coroutines run. Fails if that takes longer than `patience`, or for a
    /// `cid` this worker did not abandon (or already answered for).
    pub async fn fenced_outcome(&self, cid: u64, patience: Duration) -> Result<FencedOutcome> {
        let Some(fenced) = self.fenced.borrow_mut().remove(&cid) else {
            return Err(TxnError::Invalid(format!(
                "commit {cid} was not abandoned to recovery by this worker, or its outcome \
                 was asked for already"
            )));
        };
        let deadline = Instant::now() + patience;
        let mut watching = None;
        let Epoch { slot, tag } = fenced.epoch;
        while !self
            .db
            .step_resolution(slot, tag, &mut watching, &|| self.keep_lease())?
        {
            if Instant::now() >= deadline {
                return Err(TxnError::Invalid(format!(
                    "the outcome of commit {cid} is still unknown after {patience:?}: the \
                     recovery of oracle slot {slot} (holder tag {tag}), whose lease lapsed \
                     under it, has not finished"
                )));
            }
            // Our own lease too must stay alive while we wait.
            if !self.is_broken() {
                self.tick()?;
            }
            let until = Instant::now() + Duration::from_millis(1);
            while Instant::now() < until {
                yield_now().await;
            }
        }
        if !fenced.logged {
            return Ok(FencedOutcome::RolledBack);
        }
        if self.db.options().wait_visible {
            self.wait_visible(cid).await?;
        }
        Ok(FencedOutcome::Committed { cid })
    }

    /// Persists `plan` on the durable servers, keeping this worker's lease while it
    /// waits (a clock read per turn; a renewal once half the lease has passed).
    pub(crate) async fn persist(&self, plan: crate::durable::PersistPlan) -> Result<()> {
        let waiting_turn = || {
            // A broken worker must let its lease lapse (recovery finishes its commit);
            // a fence shows at the next step.
            if !self.read_only && !self.is_broken() {
                let _ = self.slot.ensure_lease();
            }
            let mut waits = self.persist_waits.borrow_mut();
            if waits.rounds_reported {
                waits.idle_turns += 1;
                return;
            }
            drop(waits);
            self.idle_once(|w| &mut w.idle_alone);
        };
        self.db.shared.durability.persist(plan, waiting_turn).await
    }

    /// For an executor that polls this worker's coroutines in rounds: from now on it
    /// calls [`Worker::end_round`] after every round, until [`Worker::stop_rounds`].
    pub fn start_rounds(&self) {
        self.persist_waits.borrow_mut().rounds_reported = true;
    }

    /// The executor stopped reporting rounds.
    pub fn stop_rounds(&self) {
        *self.persist_waits.borrow_mut() = PersistWaits::default();
    }

    /// After a round of the executor that polled `polled` coroutines: if every one of
    /// them only found its persist still pending, for a few rounds in a row, the
    /// thread sleeps briefly (the disks it waits for need the CPU more).
    pub fn end_round(&self, polled: usize) {
        let mut waits = self.persist_waits.borrow_mut();
        let idle = polled > 0 && waits.idle_turns >= polled;
        waits.idle_turns = 0;
        if !idle {
            waits.idle_rounds = 0;
            return;
        }
        drop(waits);
        self.idle_once(|w| &mut w.idle_rounds);
    }

    /// Counts one more idle turn or round in `count`; every few, the thread sleeps.
    fn idle_once(&self, count: impl FnOnce(&mut PersistWaits) -> &mut u32) {
        let sleep = {
            let mut waits = self.persist_waits.borrow_mut();
            let idle = count(&mut waits);
            *idle += 1;
            idle.is_multiple_of(PERSIST_IDLE_TURNS_BEFORE_SLEEP)
        };
        if sleep {
            self.count(|s| s.persist_wait_sleeps += 1);
            std::thread::sleep(PERSIST_IDLE_SLEEP);
        }
    }

    /// Checks that the worker still holds `epoch` under a live lease, for a commit step
    /// of `cid` about to be posted: keep the guard until what is posted has completed,
    /// so that a fence by another worker of this process waits for it
    /// ([`timestamp::gate`]).
    pub(crate) fn check_epoch(&self, epoch: Epoch, cid: u64) -> Result<timestamp::LeaseGuard> {
        if crate::crash::lease_check_fails(cid) {
            return Err(crate::crash::injected_transport_error().into());
        }
        let inside = match self.slot.lease_guard() {
            Ok(inside) => inside,
            Err(timestamp::OracleError::Fenced { .. } | timestamp::OracleError::Released) => {
                return Err(TxnError::Fenced { cid });
            }
            Err(e) => return Err(e.into()),
        };
        if self.log.borrow().epoch != epoch {
            return Err(TxnError::Fenced { cid });
        }
        Ok(inside)
    }

    /// Room for a log record of `len` bytes in the ring of `epoch`: its position and
    /// remote address, or `None` while older commits of this worker still need theirs.
    pub(crate) fn log_place(
        &self,
        epoch: Epoch,
        cid: u64,
        len: u64,
    ) -> Result<Option<(u64, fabric::RemoteAddr)>> {
        let mut log = self.log.borrow_mut();
        if log.epoch != epoch {
            return Err(TxnError::Fenced { cid });
        }
        let Some(at) = log.ring.place(len)? else {
            return Ok(None);
        };
        let ring = self.db.shared.catalog.commit_log().ring(epoch.slot);
        Ok(Some((
            at,
            fabric::RemoteAddr {
                offset: ring.offset + log.ring.offset(at),
                ..ring
            },
        )))
    }

    /// The commit whose record is at `at` of `epoch`'s ring has finished with it.
    pub(crate) fn log_finished(&self, epoch: Epoch, at: u64) {
        let mut log = self.log.borrow_mut();
        if log.epoch == epoch {
            log.ring.finished(at);
        }
    }

    /// A read timestamp of at least `min`, from an oracle read that started after
    /// oracle read number `after` (0: any read).
    pub(crate) async fn read_timestamp(&self, after: u64, min: u64) -> Result<u64> {
        // The clock is read only every so many turns: waiting is the common case
        // under load, and a clock read costs as much as a sim verb.
        let mut start = None;
        let mut turns = 0u32;
        loop {
            let reading = {
                let st = self.rids.borrow();
                if st.finished > after && st.rid >= min {
                    return Ok(st.rid);
                }
                st.reading
            };
            turns = turns.wrapping_add(1);
            if turns.is_multiple_of(64)
                && start.get_or_insert_with(Instant::now).elapsed() > RID_PATIENCE
            {
                return Err(TxnError::Invalid(format!(
                    "the read timestamp stayed at {}, below {min}, for {RID_PATIENCE:?}: either nothing committed at {min} or later (a Begin's `after` must be a commit timestamp this cluster returned), or another compute node's slot stalls the oracle",
                    self.rids.borrow().rid
                )));
            }
            let read_this_round = {
                let st = self.rids.borrow();
                st.executor && st.read_round == st.round && st.finished > after
            };
            if reading || read_this_round {
                yield_now().await;
                continue;
            }
            self.flush_marks()?;
            self.tick()?;
            let number = {
                let mut st = self.rids.borrow_mut();
                st.started += 1;
                st.reading = true;
                st.read_round = st.round;
                st.started
            };
            let read = self.slot.read_timestamp_async().await;
            let rid = {
                let mut st = self.rids.borrow_mut();
                st.reading = false;
                if let Ok(rid) = read {
                    st.finished = st.finished.max(number);
                    st.rid = st.rid.max(rid);
                }
                read?
            };
            self.count(|s| s.oracle_reads += 1);
            // No holder hands out a timestamp more than V/2 past its known prefix (the
            // oracle's wrap margin), and this read began after the call: a `min` past
            // that was never handed out, so no commit returned it, and waiting for it
            // would blame whichever slot the prefix waits for.
            let reach = self.slot.layout().bits() / 2;
            if min > rid.saturating_add(reach + 1) {
                return Err(TxnError::Invalid(format!(
                    "timestamp {min} (the commit to begin after) is beyond every timestamp \
                     the oracle has handed out: the newest visible is {rid}, and none is \
                     handed out more than {reach} past that; pass a commit timestamp a \
                     commit returned, or 0"
                )));
            }
            if rid < min {
                // The prefix waits for other threads' slots. After a run of fruitless
                // reads, give the CPU away: on a host with more runnable threads than
                // cores, the thread we wait for may be waiting for this core.
                let idle = self.idle_reads.get() + 1;
                self.idle_reads.set(idle);
                if idle.is_multiple_of(IDLE_READS_BEFORE_YIELD) {
                    std::thread::yield_now();
                }
                yield_now().await;
            } else {
                self.idle_reads.set(0);
            }
        }
    }

    /// Waits until the oracle's prefix includes `cid`, so every transaction that
    /// begins afterwards sees it.
    pub(crate) async fn wait_visible(&self, cid: u64) -> Result<()> {
        self.read_timestamp(0, cid).await.map(|_| ())
    }

    /// Starts a transaction whose snapshot includes every commit that returned before
    /// this call and timestamp `after` (a session's last commit, so it sees its own
    /// writes).
    pub async fn begin(&self, after: u64) -> Result<AsyncTransaction<'_>> {
        self.check_broken()?;
        let started = self.rids.borrow().started;
        // Let the other coroutines that begin in this round join one oracle read.
        yield_now().await;
        let rid = self.read_timestamp(started, after).await?;
        AsyncTransaction::new(self, rid)
    }

    /// Runs `body` in a transaction, retrying it after conflicts (and snapshots too
    /// old) up to `retries` times with randomized exponential backoff; returns the
    /// body's value and the commit timestamp.
    pub async fn run<T>(
        &self,
        after: u64,
        retries: u32,
        mut body: impl AsyncFnMut(&mut AsyncTransaction<'_>) -> Result<T>,
    ) -> Result<(T, Option<u64>)> {
        let mut backoff = Backoff::new();
        let mut attempt = 0;
        loop {
            let mut txn = self.begin(after).await?;
            let outcome = match body(&mut txn).await {
                Ok(value) => txn.commit().await.map(|cid| (value, cid)),
                Err(e) => {
                    txn.abort();
                    Err(e)
                }
            };
            match settle(outcome, &mut attempt, retries) {
                Some(done) => return done,
                None => backoff.wait().await,
            }
        }
    }

    /// Runs `coroutines` futures made by `make(i)` concurrently on this thread until
    /// all finish, flushing batched marks between rounds.
    pub fn run_coroutines<'a, T>(
        &self,
        coroutines: usize,
        mut make: impl FnMut(usize) -> Pin<Box<dyn Future<Output = T> + 'a>>,
    ) -> Vec<T> {
        let futures = (0..coroutines).map(&mut make).collect();
        self.rids.borrow_mut().executor = true;
        self.start_rounds();
        // The batches a round's coroutines post cross together (one doorbell per queue
        // pair where a doorbell is a system call: tcp).
        let doorbells = fabric::hold_doorbells();
        let results = runtime::run_all(futures, |polled| {
            // A failed flush resurfaces at the next oracle read, which flushes again.
            let _ = self.flush_marks();
            self.rids.borrow_mut().round += 1;
            doorbells.ring();
            self.end_round(polled);
        });
        drop(doorbells);
        self.stop_rounds();
        self.rids.borrow_mut().executor = false;
        results
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // Every handed-out timestamp must be decided before the slot is freed for
        // others to skip.
        let _ = self.flush_marks();
        if self.is_broken() {
            // Holding on until the lease lapses hands the half-installed commit to
            // a fencer's recovery; a release would skip that.
            return;
        }
        let epoch = self.log.borrow().epoch;
        if self.slot.is_active() {
            let _ = self.db.leave_slot(epoch.slot, epoch.tag);
        }
        let _ = self.slot.release();
    }
}

/// The end of a `run` attempt: final (`Some`), or, for a retryable error with
/// attempts left, another try (`None`, the attempt counted).
fn settle<T>(outcome: Result<T>, attempt: &mut u32, retries: u32) -> Option<Result<T>> {
    match outcome {
        Err(e) if e.is_retryable() && *attempt < retries => {
            *attempt += 1;
            None
        }
        other => Some(other),
    }
}

/// Randomized exponential backoff between retries, yielding to the other coroutines
/// while it waits.
struct Backoff {
    next: Duration,
    seed: u64,
}

impl Backoff {
    const FIRST: Duration = Duration::from_micros(2);
    const MAX: Duration = Duration::from_millis(2);

    fn new() -> Backoff {
        use std::hash::{BuildHasher, Hasher};
        let seed = std::collections::hash_map::RandomState::new()
            .build_hasher()
            .finish();
        Backoff {
            next: Self::FIRST,
            seed: seed | 1,
        }
    }

    async fn wait(&mut self) {
        // xorshift: enough to spread retries of colliding transactions apart.
        self.seed ^= self.seed << 13;
        self.seed ^= self.seed >> 7;
        self.seed ^= self.seed << 17;
        let nanos = self.next.as_nanos() as u64;
        let wait = Duration::from_nanos(nanos / 2 + self.seed % (nanos / 2 + 1));
        self.next = (self.next * 2).min(Self::MAX);
        let until = Instant::now() + wait;
        while Instant::now() < until {
            yield_now().await;
        }
    }
}

/// A blocking handle: a [`Worker`] with one session (it sees its own writes).
pub struct Client {
    worker: Worker,
    last_cid: u64,
}

impl Client {
    pub(crate) fn new(worker: Worker) -> Client {
        Client {
            worker,
            last_cid: 0,
        }
    }

    pub fn worker(&self) -> &Worker {
        &self.worker
    }

    /// Starts a transaction that sees every commit that returned before this call,
    /// including this session's.
    pub fn begin(&mut self) -> Result<Transaction<'_>> {
        self.begin_after(0)
    }

    /// As [`Client::begin`], with a snapshot that also includes timestamp `min`.
    pub fn begin_after(&mut self, min: u64) -> Result<Transaction<'_>> {
        let after = min.max(self.last_cid);
        let txn = runtime::block_on(self.worker.begin(after))?;
        Ok(Transaction::new(txn, &mut self.last_cid))
    }

    /// Runs `body` in a transaction, retrying after conflicts up to `retries` times
    /// with backoff; returns the body's value and the commit timestamp.
    pub fn run<T>(
        &mut self,
        retries: u32,
        mut body: impl FnMut(&mut Transaction<'_>) -> Result<T>,
    ) -> Result<(T, Option<u64>)> {
        let mut backoff = Backoff::new();
        let mut attempt = 0;
        loop {
            let mut txn = self.begin()?;
            let outcome = match body(&mut txn) {
                Ok(value) => txn.commit().map(|cid| (value, cid)),
                Err(e) => {
                    txn.abort();
                    Err(e)
                }
            };
            match settle(outcome, &mut attempt, retries) {
                Some(done) => return done,
                None => runtime::block_on(backoff.wait()),
            }
        }
    }

    /// Continues a transaction suspended with [`Transaction::suspend`], which must have
    /// begun on this client.
    pub fn resume(&mut self, state: Suspended) -> Transaction<'_> {
        Transaction::new(
            AsyncTransaction::resume(&self.worker, state),
            &mut self.last_cid,
        )
    }

    /// Keeps the oracle slot moving; see [`Worker::tick`].
    pub fn tick(&mut self) -> Result<()> {
        self.worker.tick()
    }

    pub fn stats(&self) -> ClientStats {
        self.worker.stats()
    }

    /// The highest commit timestamp of this session.
    pub fn last_cid(&self) -> u64 {
        self.last_cid
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Options;
    use std::time::{Duration, Instant};

    /// A commit that finishes after another coroutine found its worker's slot fenced
    /// and took a slot again queues a decision of the fenced claim. Flushed with the
    /// decisions of the new claim, it made `mark_many` refuse them all, and the new
    /// claim's timestamp stayed undecided under a live holder: every read timestamp
    /// stopped there for good (`tpcw`'s tests under load: "the read timestamp stayed
    /// at …, for 10s").
    #[test]
    fn a_decision_of_a_fenced_claim_does_not_cost_the_new_claims_decisions() {
        let db = Database::embedded(Options {
            servers: 1,
            server_bytes: 16 << 20,
            slots: 4,
            oracle: timestamp::OracleConfig {
                tick_interval: Duration::from_millis(2),
                lease_timeout: Duration::from_millis(80),
                ..timestamp::OracleConfig::default()
            },
            ..Options::default()
        })
        .unwrap();
        let (worker, fencer) = (db.worker().unwrap(), db.worker().unwrap());
        // A commit takes its timestamp; its worker then stops renewing (a starved
        // thread) and the other worker fences its slot.
        let (old, _) = worker.commit_timestamp().unwrap();
        fencer.slot.suspect(worker.slot.slot());
        let deadline = Instant::now() + Duration::from_secs(30);
        while fencer.slot.tick().unwrap().fenced.is_none() {
            assert!(
                Instant::now() < deadline,
                "the stalled slot was never fenced"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        // Another coroutine finds the fence and takes a slot again; then the old
        // commit finishes, and a commit under the new claim too.
        worker.tick().unwrap();
        assert!(worker.slot.is_active());
        assert!(!worker.slot.is_outstanding(old));
        worker.decide(old, Outcome::Committed);
        let (new, _) = worker.commit_timestamp().unwrap();
        worker.decide(new, Outcome::Committed);
        worker.flush_marks().unwrap();
        assert!(
            !worker.slot.is_outstanding(new),
            "commit {new} of the new claim was never decided"
        );
        assert_eq!(worker.slot.outstanding(), 0);
    }
}
