//! Recovery of a dead compute node's commits (DESIGN.md, "Data layout": a locked header
//! names its holder, so a dead node's locks can be found and resolved).
//!
//! A worker holds an oracle slot under a lease. When the lease lapses, another node's
//! tick fences the slot (the `timestamp` crate) and this module resolves what the
//! holder left. A tick fences a slot that stalls the prefix, which needs a later
//! timestamp decided; with nothing committing (readers only, or writers that all
//! conflict on the dead holder's locks) nothing is, so a reader that gives up on a
//! lock held too long also names the holder's slot to its worker's oracle handle
//! (`SlotHandle::suspect`), whose next ticks fence the slot if its lease lapsed.
//!
//! This module then reads the slot's commit-log ring, and scans every table for
//! headers locked by a CID of that slot (CIDs of slot s are ≡ s mod S). A lock whose
//! CID has a complete log record belongs to a committed transaction and is rolled
//! forward (the logged value installed unless it already is, then unlocked at the
//! CID); any other lock is released (an updated record gets its header back, a block
//! the commit created becomes a tombstone at CID 0, as the abort path does). The
//! fence already decided the slot's undecided timestamps, so the prefix moves on;
//! readers wait for the locks meanwhile, as they would for a slow install.
//!
//! A commit persists its installs only after all of them (durable servers), so a
//! holder that died installing may have left installs that are visible, built on by
//! later commits, and not durable. Before the guard says clean (the ring may then be
//! reused, and no record says those writes exist), every block the ring's records
//! wrote is persisted as it is now, with the index bucket and arena counter of the
//! ones a record inserted ([`Written`]).
//!
//! The log ring is read before the scan: the slot's next holder overwrites it only
//! after recovery ended (the guard word, see [`crate::commitlog`]), and a lock found
//! after that point cannot belong to the dead holder. Exactly one node resolves a
//! holder (CAS of the guard to `recovering`); one that stalls (its own lease lapsed)
//! is taken over after [`TAKEOVER`]. A lock's CID does not say which holder of the
//! slot took it, so a recovery that was taken over must post nothing more (the slot
//! may have a new holder, locking records with CIDs of the slot): it holds its guard
//! under a lease, checked before each resolve (`Claim`).
//!
//! The dead holder must not post anything after its lease lapsed: the commit path
//! checks the lease (a clock read) before posting each step, the lease assumption the
//! oracle makes too. A thread stopped for longer than the lease between that check and
//! its doorbell breaks it. For a holder in the fencer's own process (workers of one
//! `Database`) the lease gates close that window: the fence waits until the step the
//! holder posted under its check has completed, and refuses the holder's later steps
//! (`timestamp::gate`). For a holder in another process, memory-side fencing closes
//! it: before the fence goes on, every memory server ends the holder's sessions
//! ([`fence_holder`]), and a destroyed queue pair waits for a request of its peer
//! that is inside the server's memory. A recovery checks its claim before each
//! resolve in the same way, under [`TAKEOVER`] rather than a lease, and is not gated.

use crate::commitlog::{self, EntryKind, Guard, LogRecord};
use crate::conn::Conn;
use crate::error::{Result, TxnError};
use crate::index::{self, RemoteIndex, Slot};
use crate::layout::{self, Header, VERSIONS_OFFSET, Version};
use crate::store::{Database, Table, lock};
use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant, SystemTime};

/// How long a recovery may stall (its guard word unchanged) before another node takes
/// it over.
pub const TAKEOVER: Duration = Duration::from_secs(5);

/// Renews the caller's own oracle lease if it is due (a clock read otherwise). A
/// worker recovering another holder's commits, or waiting for another's recovery
/// before it adopts a slot, calls it as it goes: that can take longer than a lease
/// (seconds, for a takeover), and a holder that stopped renewing is taken for dead
/// and fenced, its own commits recovered in turn.
pub(crate) type KeepLease<'a> = &'a dyn Fn();
/// Bytes of the scratch region recovery reads through.
pub(crate) const SCRATCH: u64 = 1 << 20;

/// What one recovery did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecoveryReport {
    pub slot: u32,
    /// The lease tag of the holder whose work was resolved.
    pub holder_tag: u16,
    /// Locks of committed transactions, installed and released.
    pub rolled_forward: u64,
    /// Locks of transactions that had not committed, released.
    pub rolled_back: u64,
    pub blocks_scanned: u64,
    /// Complete records found in the slot's log ring.
    pub log_records: u64,
    pub took: Duration,
    pub finished_at: SystemTime,
}

/// A record left locked (see [`Database::locked_records`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LockedRecord {
    pub table: String,
    pub key: u64,
    /// The CID of the lock's holder.
    pub cid: u64,
}

/// An index slot claimed for a key and never given its address (see
/// [`Database::unpublished_index_slots`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnpublishedSlot {
    pub table: String,
    pub key: u64,
}

/// A recovery held by a test once it began: its guard says recovering, so every other
/// node waits for it (or takes it over after [`TAKEOVER`]), as for a recovering node
/// starved of CPU. Made by [`crate::crash::starve_at_with_recovery_held_on_this_thread`];
/// dropping it (or [`RecoveryHold::release`]) lets the recovery go on.
pub struct RecoveryHold {
    pub(crate) state: Arc<HoldState>,
}

/// What a [`RecoveryHold`] and the recovery it holds share.
#[derive(Default)]
pub(crate) struct HoldState {
    phase: Mutex<HoldPhase>,
    changed: Condvar,
    /// The recovery stalls after its look at the guard that follows the stall, as one
    /// descheduled between that look and its scan (the look cannot protect it).
    pub(crate) past_check: bool,
}

#[derive(Default)]
struct HoldPhase {
    /// The commit whose slot's recovery is to be held, once it stalled.
    cid: Option<u64>,
    /// The holder tag of the recovery that stalls in the hold.
    held: Option<u16>,
    released: bool,
    /// The held recovery returned (whatever it did).
    ended: bool,
}

impl HoldState {
    pub(crate) fn new(past_check: bool) -> HoldState {
        HoldState {
            past_check,
            ..HoldState::default()
        }
    }

    pub(crate) fn set_cid(&self, cid: u64) {
        lock(&self.phase).cid = Some(cid);
    }

    /// Called by the recovery of holder `tag`: blocks until the hold is released.
    fn stall(&self, tag: u16) {
        let mut phase = lock(&self.phase);
        phase.held = Some(tag);
        self.changed.notify_all();
        while !phase.released {
            phase = self.changed.wait(phase).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Waits up to `patience` for a recovery to stall in the hold; whether one did.
    pub(crate) fn wait_until_held(&self, patience: Duration) -> bool {
        self.wait_until(patience, |phase| phase.held.is_some())
    }

    /// Waits up to `patience` for `reached` of the phase; whether it was.
    fn wait_until(&self, patience: Duration, reached: impl Fn(&HoldPhase) -> bool) -> bool {
        let deadline = Instant::now() + patience;
        let mut phase = lock(&self.phase);
        while !reached(&phase) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            phase = self
                .changed
                .wait_timeout(phase, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        true
    }

    fn release(&self) {
        lock(&self.phase).released = true;
        self.changed.notify_all();
    }

    fn end(&self) {
        lock(&self.phase).ended = true;
        self.changed.notify_all();
    }
}

/// Marks the held recovery ended when it returns, by any path.
struct EndOnDrop(Arc<HoldState>);

impl Drop for EndOnDrop {
    fn drop(&mut self) {
        self.0.end();
    }
}

impl RecoveryHold {
    /// The commit whose slot's recovery is held, once it stalled.
    pub fn cid(&self) -> Option<u64> {
        lock(&self.state.phase).cid
    }

    /// Whether a recovery stalls in the hold now.
    pub fn is_holding(&self) -> bool {
        let phase = lock(&self.state.phase);
        phase.held.is_some() && !phase.released
    }

    /// Lets the held recovery go on (it resolves the commit, unless another node took
    /// it over meanwhile).
    pub fn release(self) {}

    /// Lets the held recovery go on and waits up to `patience` for it to return;
    /// whether it did.
    pub fn release_and_wait(self, patience: Duration) -> bool {
        let state = self.state.clone();
        drop(self);
        state.wait_until(patience, |phase| phase.ended)
    }
}

impl Drop for RecoveryHold {
    fn drop(&mut self) {
        self.state.release();
    }
}

/// A fresh nonzero id for the `by` field of a guard.
pub(crate) fn nonce() -> u32 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    (h.finish() as u32) | 1
}

impl Database {
    /// Every record of every table whose header is locked. Once all commits ended and
    /// every dead node's work was resolved, there are none.
    pub fn locked_records(&self) -> Result<Vec<LockedRecord>> {
        let tables = self.tables()?;
        let mut conns = self.recovery_conns();
        let mut found = Vec::new();
        for table in &tables {
            for part in 0..table.partitions.len() {
                scan_headers(&mut conns, table, part, &mut |_, word, raw| {
                    let h = Header::decode(word);
                    if h.locked {
                        found.push(LockedRecord {
                            table: table.name.clone(),
                            key: layout::key_word(raw),
                            cid: h.cid,
                        });
                    }
                    Ok(())
                })?;
            }
        }
        Ok(found)
    }

    /// Index slots whose key is claimed and whose address was never written: an insert
    /// in progress, or one whose node died between the two and whose recovery has not
    /// settled it yet. Every lookup of such a key waits (then `Conflict`), so, like a
    /// lock, none may be left once recovery is done (the chaos harness checks both).
    pub fn unpublished_index_slots(&self) -> Result<Vec<UnpublishedSlot>> {
        let tables = self.tables()?;
        let mut conns = self.recovery_conns();
        let mut found = Vec::new();
        for table in &tables {
            for p in &table.partitions {
                found.extend(
                    unpublished_keys(&mut conns[p.server], p)?
                        .into_iter()
                        .map(|key| UnpublishedSlot {
                            table: table.name.clone(),
                            key,
                        }),
                );
            }
        }
        Ok(found)
    }

    /// The recoveries this process ran, oldest first.
    pub fn recoveries(&self) -> Vec<RecoveryReport> {
        lock(&self.shared.recoveries).clone()
    }

    /// Blocks until this process has finished one more recovery of the oracle slot
    /// commit `cid` was made in than it had when called, or `patience` has passed;
    /// returns whether it did. For tests that starve a thread past its lease inside a
    /// commit ([`crate::crash::stall_at_on_this_thread`]): the stall ends once the
    /// slot was fenced and recovered under it.
    pub fn wait_for_recovery_of(&self, cid: u64, patience: Duration) -> bool {
        let slot = (cid % u64::from(self.options().slots)) as u32;
        let count = || {
            lock(&self.shared.recoveries)
                .iter()
                .filter(|r| r.slot == slot)
                .count()
        };
        let before = count();
        let deadline = Instant::now() + patience;
        while count() == before {
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        true
    }

    /// Resolves the work of the holder of `slot` whose lease tag is `holder_tag`, if
    /// its guard still says it is active: what a fencer does. Returns `None` when
    /// another node resolves it or did already.
    pub(crate) fn resolve_holder(
        &self,
        slot: u32,
        holder_tag: u16,
        keep_lease: KeepLease,
    ) -> Result<Option<RecoveryReport>> {
        let active = Guard::Active { tag: holder_tag }.encode();
        let log = self.shared.catalog.commit_log();
        let tables = self.tables()?;
        let mut conns = self.recovery_conns();
        let mut claim = Claim::new(log.guard(slot), holder_tag, keep_lease);
        let recovering = claim.word;
        if conns[commitlog::SERVER].cas(log.guard(slot), active, recovering)? != active {
            return Ok(None);
        }
        let held = lock(&self.shared.recovery_hold)
            .take_if(|(s, _)| *s == slot)
            .map(|(_, hold)| hold);
        let _ended = held.as_ref().map(|hold| EndOnDrop(hold.clone()));
        if let Some(hold) = held {
            // Without the connections: what waits for this recovery reads the guard
            // through them.
            drop(conns);
            hold.stall(holder_tag);
            conns = self.recovery_conns();
            if !hold.past_check
                && conns[commitlog::SERVER].read_word(log.guard(slot))? != recovering
            {
                // Taken over meanwhile ([`TAKEOVER`]): resolved by another.
                return Ok(None);
            }
        }
        let report = match recover(self, &tables, &mut conns, slot, holder_tag, &mut claim) {
            Ok(Some(report)) => report,
            Ok(None) => return Ok(None),
            Err(e) => {
                // Given back, so that the next resolver (this node's next tick, the
                // slot's next claimer) starts at once instead of waiting [`TAKEOVER`]
                // for a recovery that ended. What this one did is redone harmlessly:
                // resolving a lock and persisting a block are idempotent.
                let _ = conns[commitlog::SERVER].cas(log.guard(slot), claim.word, active);
                return Err(e);
            }
        };
        conns[commitlog::SERVER].cas(
            log.guard(slot),
            claim.word,
            Guard::Clean { tag: holder_tag }.encode(),
        )?;
        drop(conns);
        lock(&self.shared.recoveries).push(report.clone());
        Ok(Some(report))
    }

    /// Makes slot `slot`'s log ours (holder `tag`, just claimed): resolves a previous
    /// holder that did not end cleanly (or waits for the node resolving it), then
    /// marks the guard active for us.
    ///
    /// A guard about a holder whose tag is later than ours means we were fenced before
    /// we adopted (a claimer stopped for longer than its lease) and the slot has a new
    /// holder, alive perhaps and locking records with CIDs of this slot, which a scan
    /// cannot tell from a dead holder's: that fails with [`OracleError::Fenced`] (the
    /// worker rejoins) rather than resolve it. Tags grow by one per change of holder
    /// (a claim, a fence) and wrap at [`timestamp::layout::TAG_BITS`]; a tag up to half
    /// the range ahead of ours is later.
    ///
    /// [`OracleError::Fenced`]: timestamp::OracleError::Fenced
    pub(crate) fn adopt_slot(&self, slot: u32, tag: u16, keep_lease: KeepLease) -> Result<()> {
        let log = self.shared.catalog.commit_log();
        let guard = log.guard(slot);
        let held = lock(&self.shared.adoption_hold).take();
        let _ended = held.as_ref().map(|hold| EndOnDrop(hold.clone()));
        if let Some(hold) = held {
            hold.stall(tag);
        }
        let mut watching: Option<(u64, Instant)> = None;
        loop {
            keep_lease();
            let word = {
                let mut conns = self.recovery_conns();
                conns[commitlog::SERVER].read_word(guard)?
            };
            let decoded = Guard::decode(word)?;
            let (Guard::Clean { tag: t }
            | Guard::Active { tag: t }
            | Guard::Recovering { tag: t, .. }) = decoded;
            if later_tag(t, tag) {
                return Err(timestamp::OracleError::Fenced { slot }.into());
            }
            match decoded {
                Guard::Active { tag: t } if t == tag => return Ok(()),
                Guard::Clean { .. } => {
                    let mut conns = self.recovery_conns();
                    if self.shared.incarnation != 0 {
                        // Before the guard names us: a fencer in another process that
                        // finds `active(tag)` finds who to fence here too.
                        let holder = commitlog::Holder {
                            tag,
                            incarnation: self.shared.incarnation,
                        };
                        conns[commitlog::SERVER]
                            .write_bytes(log.holder(slot), &holder.encode().to_le_bytes())?;
                    }
                    let mine = Guard::Active { tag }.encode();
                    if conns[commitlog::SERVER].cas(guard, word, mine)? == word {
                        return Ok(());
                    }
                }
                Guard::Active { tag: t } => {
                    self.resolve_holder(slot, t, keep_lease)?;
                }
                Guard::Recovering { tag: t, .. } => {
                    if !self.take_over_if_stalled(slot, t, word, &mut watching, keep_lease)? {
                        std::thread::sleep(Duration::from_millis(1));
                    }
                }
            }
        }
    }

    /// One look at a recovery of holder `tag` of `slot` that is under way (its guard
    /// `word` says `Recovering`): takes it over once the word stayed the same for
    /// [`TAKEOVER`] (`watching` remembers since when). Returns whether anything changed
    /// since the last look (else the caller waits a little before the next).
    fn take_over_if_stalled(
        &self,
        slot: u32,
        tag: u16,
        word: u64,
        watching: &mut Option<(u64, Instant)>,
        keep_lease: KeepLease,
    ) -> Result<bool> {
        match *watching {
            Some((w, since)) if w == word && since.elapsed() >= TAKEOVER => {
                let guard = self.shared.catalog.commit_log().guard(slot);
                let tables = self.tables()?;
                let mut conns = self.recovery_conns();
                let mut claim = Claim::new(guard, tag, keep_lease);
                if conns[commitlog::SERVER].cas(guard, word, claim.word)? == word
                    && let Some(report) = recover(self, &tables, &mut conns, slot, tag, &mut claim)?
                {
                    conns[commitlog::SERVER].cas(
                        guard,
                        claim.word,
                        Guard::Clean { tag }.encode(),
                    )?;
                    drop(conns);
                    lock(&self.shared.recoveries).push(report);
                }
                Ok(true)
            }
            Some((w, _)) if w == word => Ok(false),
            _ => {
                *watching = Some((word, Instant::now()));
                Ok(true)
            }
        }
    }

    /// One step towards the resolution of holder `holder_tag` of `slot`, whose lease
    /// the caller knows is over (fenced, or released): `true` once its work is
    /// resolved (the slot's guard is about another holder, or clean). A holder no one
    /// began to resolve is resolved here, as the slot's next claimer would; a recovery
    /// stalled for [`TAKEOVER`] is taken over. `watching` is for the takeover, kept
    /// between steps.
    pub(crate) fn step_resolution(
        &self,
        slot: u32,
        holder_tag: u16,
        watching: &mut Option<(u64, Instant)>,
        keep_lease: KeepLease,
    ) -> Result<bool> {
        let guard = self.shared.catalog.commit_log().guard(slot);
        let word = self.recovery_conns()[commitlog::SERVER].read_word(guard)?;
        match Guard::decode(word)? {
            Guard::Active { tag } if tag == holder_tag => {
                // Resolved here, or begun by another whose CAS came first: the guard
                // is no longer active for the holder, so this recurses once.
                self.resolve_holder(slot, tag, keep_lease)?;
                self.step_resolution(slot, holder_tag, watching, keep_lease)
            }
            Guard::Recovering { tag, .. } if tag == holder_tag => {
                self.take_over_if_stalled(slot, tag, word, watching, keep_lease)?;
                Ok(false)
            }
            _ => Ok(true),
        }
    }

    /// Marks slot `slot`'s log clean on a worker's orderly exit (no commit in flight).
    pub(crate) fn leave_slot(&self, slot: u32, tag: u16) -> Result<()> {
        let log = self.shared.catalog.commit_log();
        let mut conns = self.recovery_conns();
        conns[commitlog::SERVER].cas(
            log.guard(slot),
            Guard::Active { tag }.encode(),
            Guard::Clean { tag }.encode(),
        )?;
        Ok(())
    }
}

/// Whether lease tag `t` is of a later holder of a slot than tag `ours` (both wrap
/// at [`timestamp::layout::TAG_BITS`]; fewer than half the range of changes of holder
/// happen while one node is stopped).
/// The [`timestamp::RemoteFence`] of a database on memory-server processes: the holder
/// of `slot` under lease `tag`, whose heartbeat this node's fencer stopped, may be a
/// compute node of another process that only paused, between a lease check and its
/// post, and would post late into what its recovery resolves. If the slot's holder
/// word names another incarnation under that tag, every memory server ends that
/// incarnation's sessions (destroying the queue pairs it posts through) before the
/// fence goes on. False (try again on a later tick) while a server did not do it.
pub(crate) fn fence_holder(db: &Database, slot: u32, tag: u16) -> bool {
    let at = db.shared.catalog.commit_log().holder(slot);
    let word = match db.recovery_conns()[commitlog::SERVER].read_word(at) {
        Ok(word) => word,
        Err(e) => {
            tracing::warn!(
                slot,
                "cannot read the holder of oracle slot {slot} to fence it: {e}"
            );
            return false;
        }
    };
    let holder = commitlog::Holder::decode(word);
    // Another tag: the holder of `tag` never got as far as naming itself, so it never
    // posted a commit step under the slot.
    if holder.tag != tag || holder.incarnation == 0 || holder.incarnation == db.shared.incarnation {
        return true;
    }
    if lock(&db.shared.fenced).contains(&holder.incarnation) {
        return true;
    }
    for (server, link) in db.shared.servers.iter().enumerate() {
        if let Err(e) = link.fence(holder.incarnation) {
            tracing::warn!(
                slot,
                server,
                "memory server {server} did not fence compute node {:#x}, holder of oracle \
                 slot {slot}: {e}; trying again",
                holder.incarnation
            );
            return false;
        }
    }
    lock(&db.shared.fenced).insert(holder.incarnation);
    tracing::warn!(
        slot,
        "fenced compute node {:#x} at every memory server: it held oracle slot {slot} \
         (lease tag {tag}) and stopped renewing its lease",
        holder.incarnation
    );
    true
}

fn later_tag(t: u16, ours: u16) -> bool {
    let range = 1u32 << timestamp::layout::TAG_BITS;
    let ahead = (u32::from(t) + range - u32::from(ours) % range) % range;
    ahead != 0 && ahead < range / 2
}

/// A recovery's hold on its guard word: a lease, as a slot holder's on its slot.
///
/// Another node takes a recovery over once its guard word stayed the same for
/// [`TAKEOVER`] of that node's clock, watched from when it first read the word (so
/// after we wrote it). Once taken over, the recovery must post nothing more: the
/// taker resolves the same locks, marks the guard clean, and the slot's next holder
/// then commits under CIDs of the same slot, which the scan cannot tell from the dead
/// holder's (a header names a CID, not a holder), and a block it read may have been
/// resolved and locked again since. So before each resolve the recovery checks that
/// less than `TAKEOVER / 2` of its own clock passed since it posted the guard word it
/// holds; past that it renews it, CASing a fresh `by` in (a changed word restarts
/// every watcher's wait), and gives up if the CAS fails (taken over). The lease
/// assumptions of the oracle (`timestamp::slot`) apply: clock rates differ by less
/// than 2×, and a node is not stopped for `TAKEOVER / 2` between a check and the post
/// after it. A recovery slower than `TAKEOVER` (many tables) is no longer taken over
/// while it makes progress, either.
struct Claim<'a> {
    guard: fabric::RemoteAddr,
    tag: u16,
    /// The guard word as we last wrote it.
    word: u64,
    /// When we posted `word` (or before).
    since: Instant,
    /// The recovering worker's own lease, kept alive as the guard is.
    keep_lease: KeepLease<'a>,
}

impl<'a> Claim<'a> {
    /// Made just before the CAS that writes its `word`, a recovering guard of holder
    /// `tag` that names this recovery alone.
    fn new(guard: fabric::RemoteAddr, tag: u16, keep_lease: KeepLease<'a>) -> Claim<'a> {
        Claim {
            guard,
            tag,
            word: Guard::Recovering { tag, by: nonce() }.encode(),
            since: Instant::now(),
            keep_lease,
        }
    }

    /// Whether the recovery still holds its guard (renewed if due, with the worker's
    /// own lease); `false` once it was taken over, and then it must post nothing more.
    fn keep(&mut self, conns: &mut [Conn]) -> Result<bool> {
        (self.keep_lease)();
        if self.since.elapsed() < TAKEOVER / 2 {
            return Ok(true);
        }
        let renewed = Guard::Recovering {
            tag: self.tag,
            by: nonce(),
        }
        .encode();
        let posted = Instant::now();
        if conns[commitlog::SERVER].cas(self.guard, self.word, renewed)? != self.word {
            tracing::warn!(
                tag = self.tag,
                stalled = ?self.since.elapsed(),
                "a recovery stalled past its lease was taken over; it stops"
            );
            return Ok(false);
        }
        self.word = renewed;
        self.since = posted;
        Ok(true)
    }
}

/// Resolves every lock held by a CID of `slot` (see the module doc), while `claim`
/// holds: `None` once the recovery was taken over (another finishes it).
fn recover(
    db: &Database,
    tables: &[Arc<Table>],
    conns: &mut [Conn],
    slot: u32,
    holder_tag: u16,
    claim: &mut Claim,
) -> Result<Option<RecoveryReport>> {
    let started = Instant::now();
    let keep_lease = claim.keep_lease;
    let slots = db.shared.catalog.oracle().layout.slots() as u64;
    let records = read_ring(db, conns, slot)?;
    let mut report = RecoveryReport {
        slot,
        holder_tag,
        rolled_forward: 0,
        rolled_back: 0,
        blocks_scanned: 0,
        log_records: records.len() as u64,
        took: Duration::ZERO,
        finished_at: SystemTime::now(),
    };
    let mut plan = crate::durable::PersistPlan::default();
    let written = Written::by(records.values());
    // Blocks the records wrote that another holder has locked: (table, part, addr,
    // key, kind, header as scanned).
    let mut busy = Vec::new();
    for table in tables {
        for part in 0..table.partitions.len() {
            let mut held = Vec::new();
            report.blocks_scanned += scan_headers(conns, table, part, &mut |addr, word, raw| {
                keep_lease();
                let h = Header::decode(word);
                if h.locked && h.cid % slots == slot as u64 {
                    held.push((addr, h.cid, raw.to_vec()));
                } else if let Some((key, kind)) = written.get(table.id, part, addr) {
                    if h.locked {
                        busy.push((table.clone(), part, addr, key, kind, word));
                    } else {
                        add_written(&mut plan, table, part, addr, key, kind);
                    }
                }
                Ok(())
            })?;
            for (addr, cid, raw) in held {
                if !claim.keep(conns)? {
                    return Ok(None);
                }
                let patience = 2 * db.shared.options.oracle.lease_timeout;
                if resolve(
                    conns,
                    table,
                    part,
                    addr,
                    cid,
                    &raw,
                    records.get(&cid),
                    patience,
                )? {
                    report.rolled_forward += 1;
                } else {
                    report.rolled_back += 1;
                }
                // Durable before the guard says clean and the ring may be reused.
                let key = layout::key_word(&raw);
                crate::transaction::add_insert(&mut plan, table, part, addr, key);
            }
        }
    }
    // A lock another holder took on a block the records wrote ends in its commit's
    // persist, in its recovery's, or (an abort, which persists nothing) in the header
    // put back: wait for that, so the block is persisted here. Aborts happen before a
    // commit logs, within its lease; a lock held longer is a commit past its log
    // record or a holder that is fenced, and either persists the block.
    let deadline = Instant::now() + 2 * db.shared.options.oracle.lease_timeout;
    while !busy.is_empty() && Instant::now() < deadline {
        keep_lease();
        std::thread::sleep(Duration::from_millis(1));
        let mut still = Vec::with_capacity(busy.len());
        for (table, part, addr, key, kind, word) in busy {
            let p = &table.partitions[part];
            if conns[p.server].read_word(p.data.at(addr))? == word {
                still.push((table, part, addr, key, kind, word));
            } else {
                add_written(&mut plan, &table, part, addr, key, kind);
            }
        }
        busy = still;
    }
    db.shared
        .durability
        .persist_blocking_keeping(plan, keep_lease)?;
    report.took = started.elapsed();
    report.finished_at = SystemTime::now();
    if report.rolled_forward + report.rolled_back > 0 {
        tracing::info!(
            slot = report.slot,
            holder_tag = report.holder_tag,
            rolled_forward = report.rolled_forward,
            rolled_back = report.rolled_back,
            blocks_scanned = report.blocks_scanned,
            took = ?report.took,
            "recovered a dead holder's commits"
        );
    }
    Ok(Some(report))
}

/// The blocks a set of log records wrote, by (table, partition, address): the key,
/// and whether a record inserted it (else the kind of some write of it).
///
/// A commit persists its installs only once all of them are done, so a holder that
/// died installing leaves some installed, visible and built on, but not durable; and
/// once its slot's ring is reused, no record says they must be. Whoever resolves a
/// dead holder (or repairs a restart, which frees every ring) persists every block
/// its records wrote first, as they are now.
pub(crate) struct Written(HashMap<(u32, usize, u64), (u64, EntryKind)>);

impl Written {
    pub(crate) fn by<'a>(records: impl Iterator<Item = &'a LogRecord>) -> Written {
        let mut written = HashMap::new();
        for e in records.flat_map(|r| &r.entries) {
            written
                .entry((e.table, e.part as usize, e.addr))
                .and_modify(|(_, kind)| {
                    // An insert's index entry is persisted whatever came after it.
                    if e.kind == EntryKind::Insert {
                        *kind = EntryKind::Insert;
                    }
                })
                .or_insert((e.key, e.kind));
        }
        Written(written)
    }

    pub(crate) fn get(&self, table: u32, part: usize, addr: u64) -> Option<(u64, EntryKind)> {
        self.0.get(&(table, part, addr)).copied()
    }
}

/// Adds block `addr` to `plan`, with what makes it reachable if a record inserted it.
pub(crate) fn add_written(
    plan: &mut crate::durable::PersistPlan,
    table: &Table,
    part: usize,
    addr: u64,
    key: u64,
    kind: EntryKind,
) {
    if kind == EntryKind::Insert {
        crate::transaction::add_insert(plan, table, part, addr, key);
    } else {
        crate::transaction::add_block(plan, table, part, addr);
    }
}

/// Resolves one lock held by `cid` on block `addr` (bytes `raw` as read, locked):
/// rolled forward (`true`) if `record` commits it, else released.
///
/// A block the commit created is left a tombstone, and an index slot its key was
/// claimed in without an address is given this block's ([`settle_claim`], waiting up
/// to `patience` for another live inserter of the key to show itself).
#[allow(clippy::too_many_arguments)]
pub(crate) fn resolve(
    conns: &mut [Conn],
    table: &Arc<Table>,
    part: usize,
    addr: u64,
    cid: u64,
    raw: &[u8],
    record: Option<&LogRecord>,
    patience: Duration,
) -> Result<bool> {
    let p = &table.partitions[part];
    let conn = &mut conns[p.server];
    let shape = table.shape;
    let block = layout::decode(raw, shape)?;
    let newest = block.versions.first().map_or(0, |v| v.cid);
    let locked = Header::locked_by(cid).encode();
    let header_at = p.data.at(addr);
    let versions_at = p.data.at(addr + VERSIONS_OFFSET);
    let versions_len = (shape.block_bytes() - VERSIONS_OFFSET) as usize;
    match record {
        Some(record) => {
            let entry = record.entry(table.id, part, addr).ok_or_else(|| {
                TxnError::Invalid(format!(
                    "block {addr} of table {} is locked by {cid}, whose log record does not write it",
                    table.name
                ))
            })?;
            // An update's install may have landed before the crash (the versions are
            // written before the unlock); an insert's block holds its version already.
            if entry.kind != EntryKind::Insert && newest != cid {
                let value = (entry.kind == EntryKind::Update).then_some(entry.value.as_slice());
                let mut bytes = vec![0u8; versions_len];
                layout::write_installed(raw, cid, value, shape, &mut bytes)?;
                conn.write_bytes(versions_at, &bytes)?;
            }
            conn.cas(header_at, locked, Header::unlocked(cid).encode())?;
            Ok(true)
        }
        None if newest == cid => {
            // Created by the commit (only an insert writes a version before the log
            // record): a tombstone at CID 0, as an abort leaves it.
            let bytes = layout::encode_versions(
                &[Version {
                    cid: 0,
                    value: None,
                }],
                shape,
            )?;
            conn.write_bytes(versions_at, &bytes)?;
            conn.cas(header_at, locked, Header::unlocked(0).encode())?;
            settle_claim(conns, table, part, addr, block.key, patience)?;
            Ok(false)
        }
        None => {
            conn.cas(header_at, locked, Header::unlocked(newest).encode())?;
            Ok(false)
        }
    }
}

/// Gives `key`'s index slot, if it is claimed without an address, the address of
/// block `addr`: a tombstone a dead holder's insert created and recovery just
/// unlocked. A holder killed between its claim's CAS and the WRITE of the address
/// (they go in different doorbells) left the key claimed, and every lookup of a
/// claimed slot without an address waits for an insert in progress: the key could be
/// neither read (`Conflict`, "index slot pending too long") nor inserted again.
///
/// The claim does not say whose it is, so the address goes in only when no one else
/// can publish there. Every inserter WRITEs its block, locked, before its claim's CAS
/// on the same queue pair and keeps it locked until it has published (a commit's
/// install and an abort's release come after the address), so if the slot has no
/// address both before and after a scan of the partition, its claimer's block was
/// locked throughout that scan. A scan that finds no locked block of `key` but `addr`
/// means the claimer is a holder whose block was resolved, which under the lease
/// assumption posts nothing more. (A fenced commit publishes its won slots after its
/// epoch check fails, by CAS from no address: it changes nothing once the slot was
/// settled, here or by a lookup.) Another locked block of the key is waited for, up to
/// `patience` (it publishes, aborts or is recovered); past that the slot is left as it
/// is. If that block's holder won the claim it publishes, and if it is recovered its
/// recovery settles the slot; but a loser of the claim's race that aborts in time has
/// no address to publish, so the first lookup that finds the slot still pending past
/// the lock patience, with no block of the key locked, settles it
/// ([`Database::settle_pending_claim`]).
fn settle_claim(
    conns: &mut [Conn],
    table: &Arc<Table>,
    part: usize,
    addr: u64,
    key: u64,
    patience: Duration,
) -> Result<()> {
    let p = &table.partitions[part];
    let unpublished = |conns: &mut [Conn]| unpublished_slot(&mut conns[p.server], p, key);
    let deadline = Instant::now() + patience;
    loop {
        if unpublished(conns)?.is_none() {
            return Ok(());
        }
        let others = locked_blocks_of(conns, table, part, key)?
            .iter()
            .filter(|&&(at, _)| at != addr)
            .count();
        let Some(slot) = unpublished(conns)? else {
            return Ok(());
        };
        if others == 0 {
            conns[p.server].cas(slot, 0, RemoteIndex::address_word(addr))?;
            return Ok(());
        }
        if Instant::now() >= deadline {
            tracing::warn!(
                table = %table.name,
                key,
                others,
                "an index slot claimed without an address is left to the key's other inserter"
            );
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// The keys claimed without an address in partition `p`'s index.
pub(crate) fn unpublished_keys(conn: &mut Conn, p: &crate::store::Partition) -> Result<Vec<u64>> {
    let (start, bytes) = p.index.region_range();
    // Whole slots per READ.
    let chunk = (SCRATCH / index::SLOT_BYTES).max(1) * index::SLOT_BYTES;
    let mut found = Vec::new();
    let mut at = 0;
    while at < bytes {
        let n = chunk.min(bytes - at);
        let read = conn.read_bytes(start.offset_by(at), n)?;
        found.extend(index::slots_in_bytes(&read).filter_map(|slot| match slot {
            Slot::Claimed { key } => Some(key),
            _ => None,
        }));
        at += n;
    }
    Ok(found)
}

/// The address word of `key`'s index slot in partition `p`, if the key is claimed
/// there without an address.
fn unpublished_slot(
    conn: &mut Conn,
    p: &crate::store::Partition,
    key: u64,
) -> Result<Option<fabric::RemoteAddr>> {
    if RemoteIndex::key_word(key).is_err() {
        return Ok(None);
    }
    let (bucket, len) = p.index.bucket_range(key);
    let bytes = conn.read_bytes(bucket, len)?;
    Ok(
        match RemoteIndex::locate(index::slots_in_bytes(&bytes), key) {
            Some((i, Slot::Claimed { .. })) => {
                Some(p.index.address_word_at(p.index.slot_at(key, i)))
            }
            _ => None,
        },
    )
}

/// What [`Database::settle_pending_claim`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PendingClaim {
    /// A block of the key is locked, by this commit timestamp: the claimer's, or
    /// another inserter's of the key; the holder is the one to check on.
    Held(u64),
    /// The slot has an address (now, or settled here).
    Settled,
}

impl Database {
    /// Looks at `key`'s index slot in partition `part`, claimed without an address for
    /// longer than the lock patience, and settles it if its claimer is gone.
    ///
    /// The claimer's block is locked until the address is in (see [`settle_claim`]):
    /// a locked block of the key names the holder to check on, or with no commit
    /// deciding later timestamps a dead claimer would never be fenced. With none, and
    /// the slot unpublished before and after the scan, the claimer's block was
    /// resolved by recovery, whose [`settle_claim`] left the slot to another locked
    /// inserter of the key: a loser of the claim's race, which aborts with no address
    /// to publish (or a restart lost the claimer's block and kept the claim). Nobody
    /// else will settle it then, and the key would stay unreadable and uninsertable
    /// for good; so the slot gets a fresh block of its own, a tombstone at CID 0 as an
    /// aborted insert leaves (a later insert of the key reuses it), by CAS from no
    /// address. A fresh block, because the claimer's cannot be told from a loser's,
    /// which its worker may reuse for another key. A claimer fenced but not dead
    /// publishes by CAS from no address too, so it cannot point the key back at its
    /// tombstone.
    ///
    /// Reads the whole partition: only for a claim that stayed pending past the lock
    /// patience.
    pub(crate) fn settle_pending_claim(
        &self,
        table: &Table,
        part: usize,
        key: u64,
    ) -> Result<PendingClaim> {
        settle_pending(self, &mut self.recovery_conns(), table, part, key)
    }
}

/// [`Database::settle_pending_claim`] through `conns`.
pub(crate) fn settle_pending(
    db: &Database,
    conns: &mut [Conn],
    table: &Table,
    part: usize,
    key: u64,
) -> Result<PendingClaim> {
    let p = &table.partitions[part];
    if unpublished_slot(&mut conns[p.server], p, key)?.is_none() {
        return Ok(PendingClaim::Settled);
    }
    if let Some(&(_, cid)) = locked_blocks_of(conns, table, part, key)?.last() {
        return Ok(PendingClaim::Held(cid));
    }
    let Some(slot) = unpublished_slot(&mut conns[p.server], p, key)? else {
        return Ok(PendingClaim::Settled);
    };
    let conn = &mut conns[p.server];
    let i = conn.fetch_add(p.data.at(p.arena), 1)?;
    if i >= p.capacity {
        return Err(TxnError::TableFull {
            table: table.id,
            name: table.name.clone(),
            capacity: table.capacity(),
        });
    }
    let addr = table.block_offset(part, i);
    let block = layout::Block {
        header: Header::unlocked(0),
        key,
        versions: vec![Version {
            cid: 0,
            value: None,
        }],
    };
    conn.write_bytes(p.data.at(addr), &layout::encode(&block, table.shape)?)?;
    // The block and the counter durable before any index entry names them.
    let mut plan = crate::durable::PersistPlan::default();
    crate::transaction::add_block(&mut plan, table, part, addr);
    plan.add(
        p.server,
        crate::durable::PersistRange::plain(p.data.at(p.arena), 8),
    );
    db.shared.durability.persist_blocking(plan)?;
    let conn = &mut conns[p.server];
    if conn.cas(slot, 0, RemoteIndex::address_word(addr))? == 0 {
        tracing::warn!(
            table = %table.name,
            key,
            block = addr,
            "an index slot claimed by an inserter that is gone was given a tombstone"
        );
        let mut plan = crate::durable::PersistPlan::default();
        crate::transaction::add_insert(&mut plan, table, part, addr, key);
        db.shared.durability.persist_blocking(plan)?;
    }
    Ok(PendingClaim::Settled)
}

/// The locked blocks of `key` in a partition, in address order: (address, CID of the
/// lock's holder). What tells whether an inserter of the key may still publish in its
/// claimed index slot (see [`settle_claim`]).
fn locked_blocks_of(
    conns: &mut [Conn],
    table: &Table,
    part: usize,
    key: u64,
) -> Result<Vec<(u64, u64)>> {
    let mut locked = Vec::new();
    scan_headers(conns, table, part, &mut |at, word, raw| {
        let header = Header::decode(word);
        if header.locked && layout::key_word(raw) == key {
            locked.push((at, header.cid));
        }
        Ok(())
    })?;
    Ok(locked)
}

/// Reads every allocated block of a partition in large READs and hands each block's
/// address, header word and bytes to `each`. Returns the blocks read.
pub(crate) fn scan_headers(
    conns: &mut [Conn],
    table: &Table,
    part: usize,
    each: &mut impl FnMut(u64, u64, &[u8]) -> Result<()>,
) -> Result<u64> {
    let p = &table.partitions[part];
    let conn = &mut conns[p.server];
    let allocated = conn.read_word(p.data.at(p.arena))?.min(p.capacity);
    let block_bytes = table.shape.block_bytes();
    let chunk = (SCRATCH / block_bytes).max(1);
    let mut i = 0;
    while i < allocated {
        let n = chunk.min(allocated - i);
        let first = table.block_offset(part, i);
        let bytes = conn.read_bytes(p.data.at(first), n * block_bytes)?;
        for b in 0..n {
            let raw = &bytes[(b * block_bytes) as usize..((b + 1) * block_bytes) as usize];
            each(first + b * block_bytes, layout::header_word(raw), raw)?;
        }
        i += n;
    }
    Ok(allocated)
}

/// The records of a ring, by CID (for tests and tools).
pub fn read_log(db: &Database, slot: u32) -> Result<HashMap<u64, LogRecord>> {
    read_ring(db, &mut db.recovery_conns(), slot)
}

/// A slot's ring, read and parsed.
pub(crate) fn read_ring(
    db: &Database,
    conns: &mut [Conn],
    slot: u32,
) -> Result<HashMap<u64, LogRecord>> {
    let log = db.shared.catalog.commit_log();
    let ring = conns[commitlog::SERVER].read_bytes(log.ring(slot), log.ring_bytes())?;
    Ok(commitlog::parse_ring(&ring))
}
