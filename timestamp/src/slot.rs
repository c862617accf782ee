//! The client side of the oracle: a [`SlotHandle`] holds one slot and hands out its
//! commit timestamps, decides them, computes read timestamps, and keeps the whole
//! vector moving (idle skips, fencing) from its [`SlotHandle::tick`].
//!
//! Costs:
//! - [`SlotHandle::next_commit_ts`]: no communication (a local cursor).
//! - [`SlotHandle::mark`]: one FETCH_ADD, unsignaled (one in [`SIGNAL_EVERY`] is
//!   signaled to retire the others).
//! - [`SlotHandle::read_timestamp`]: one READ of at most 256 bytes from the known
//!   prefix while the prefix moves less than a window (2048 timestamps) between two
//!   reads; more READs only to catch up. When the prefix waits for a free slot: a
//!   hint READ and a doorbell of CAS (once per window's worth of progress, as they
//!   skip the free slots through the window); when it waits for this slot's unused
//!   cursor (see below): FETCH_ADDs, unsignaled; a hint CAS per V/10 of progress.
//! - [`SlotHandle::tick`]: every `tick_interval`, one READ (window + hint, one
//!   doorbell), plus FETCH_ADDs to skip own timestamps, a heartbeat every
//!   `lease_timeout / 4`, and reads/CAS of another slot only while that slot stalls
//!   the prefix.
//!
//! Leases. A holder bumps its heartbeat word (CAS from its last value) and reads its
//! lease word back in one doorbell at least every `lease_timeout / 4`. Another node
//! that sees the stalling slot's lease and heartbeat unchanged for `lease_timeout` of
//! *its own* clock fences it with CAS. The holder stops deciding timestamps once
//! `lease_timeout / 2` of its own clock has passed since it posted the last renewal
//! that found its lease intact, and renews first. So no clocks are compared across
//! nodes; safety needs only that clock rates differ by less than 2× and that a posted
//! mark lands within `lease_timeout / 2` (RC transport retries are far shorter), the
//! usual lease assumptions.
//!
//! Skipping without ticks. A commit is visible once every lower timestamp is decided,
//! so the prefix must not wait for slots that do not commit. Read timestamps do the
//! skipping (ticks remain the bound for idle holders that do not read):
//! - A holder whose unused cursor is the gap skips its own timestamps up to the
//!   highest decision in the window of a slot it does not know to be free, as a tick
//!   does — at once if it lags that decision by a few of its timestamps, else when
//!   the cursor is the gap at two reads in a row (then up to the far hint as well):
//!   FETCH_ADD, only its own, only above every handed-out timestamp, under a
//!   confirmed lease (`ensure_lease`) and horizon, and within the wrap margin.
//! - A handle remembers every slot's lease word as last seen. When the gap belongs to
//!   a slot seen free or fenced, it raises the horizons of such slots in the window
//!   (CAS on the lease) and decides their undecided timestamps below the horizon
//!   through the window, at most V/4 ahead, with one CAS per word. Why a lease seen
//!   earlier is a safe bound: horizons never go down (a claim takes the horizon or
//!   more, a release leaves the cursor, which is at or above it, a fence keeps it,
//!   skippers only raise it), so every holder after the sighting starts at or above
//!   the horizon seen, and the one before it ended (release: all decided; fence: the
//!   usual lease assumption that its marks landed). A CAS changes nothing if the word
//!   changed since it was read, so it never undoes a decision, and a failed lease CAS
//!   teaches the slot's new lease (a claimed slot is then known as owned). Like a
//!   tick's skips, these need the prefix hint, read in the same read timestamp, not
//!   to be ahead of the window's start: a reader more than V/2 behind could read a
//!   reused position as undecided. V/4 keeps a claimer (which starts at the horizon)
//!   within the wrap margin of the prefix it knows.
//!
//! [`SIGNAL_EVERY`]: crate::link::SIGNAL_EVERY

use crate::cells;
use crate::clock::Clock;
use crate::error::{OracleError, Result};
use crate::gate::{Gate, LeaseGates, LeaseGuard};
use crate::layout::{
    BLOCK, HEADER_WORDS, Layout, Lease, MAX_HORIZON, OFF_FAR_HINT, OFF_PREFIX_HINT, SLOT_BYTES,
    SlotState,
};
use crate::link::{BUFFER_BYTES, Link, Op};
use fabric::{CompletionQueue, Device, QueuePair, RemoteRegion};
use std::cell::RefCell;
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

/// How a client runs the protocol.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OracleConfig {
    /// How often [`SlotHandle::tick`] does work. A live but idle slot stalls the prefix
    /// for at most this long (plus one round trip) if its holder calls `tick` at least
    /// this often: the configured idle bound.
    pub tick_interval: Duration,
    /// A slot whose lease and heartbeat do not change for this long, as another node's
    /// clock measures it, is fenced. Its holder renews every quarter of it.
    pub lease_timeout: Duration,
    /// Timestamps a holder reserves ahead of its cursor when it raises its horizon;
    /// 0 picks V / 4. Larger means fewer CAS, and a longer reach for a dead slot.
    pub reserve: u64,
    /// Bytes of the vector one window READ covers: 8..=256, a multiple of 8.
    pub window_bytes: u32,
}

impl Default for OracleConfig {
    fn default() -> Self {
        OracleConfig {
            tick_interval: Duration::from_millis(1),
            lease_timeout: Duration::from_millis(250),
            reserve: 0,
            window_bytes: BUFFER_BYTES,
        }
    }
}

impl OracleConfig {
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(OracleError::InvalidConfig(m));
        if self.tick_interval.is_zero() {
            return bad("tick_interval must be positive".into());
        }
        if self.lease_timeout < self.tick_interval * 4 {
            return bad(format!(
                "lease_timeout ({:?}) must be at least 4 tick intervals ({:?}), so ticks can renew in time",
                self.lease_timeout, self.tick_interval
            ));
        }
        if self.window_bytes < 8
            || self.window_bytes > BUFFER_BYTES
            || !self.window_bytes.is_multiple_of(8)
        {
            return bad(format!(
                "window_bytes must be a multiple of 8 in 8..={BUFFER_BYTES}, got {}",
                self.window_bytes
            ));
        }
        Ok(())
    }
}

/// What became of a commit timestamp. The vector records only that it is decided;
/// the outcome feeds the handle's statistics.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Outcome {
    Committed,
    Aborted,
}

/// Counters of one handle, for benchmarks and diagnostics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SlotStats {
    pub committed: u64,
    pub aborted: u64,
    /// Own timestamps decided without use (idle skips).
    pub skipped: u64,
    /// Other slots' timestamps decided for them (free or fenced slots), and by read
    /// timestamps also this slot's inherited ones.
    pub skipped_for_others: u64,
    /// Read timestamps computed, and the READs and bytes they took.
    pub read_timestamps: u64,
    pub window_reads: u64,
    pub window_bytes: u64,
    pub renewals: u64,
    pub horizon_raises: u64,
    pub fences: u64,
    /// Fences that found the holder (in this process) still posting under its lease,
    /// and left the slot to a later tick.
    pub fences_waited: u64,
}

/// What one [`SlotHandle::tick`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TickReport {
    /// Whether the tick was due and did work.
    pub ran: bool,
    /// The first undecided timestamp as now known.
    pub prefix: u64,
    pub skipped_own: u64,
    pub skipped_for_others: u64,
    /// A slot this tick fenced.
    pub fenced: Option<u32>,
    /// The lease word the fence left on that slot (state fenced, the holder's tag
    /// bumped once): whoever resolves the dead holder's work identifies it by this.
    pub fenced_lease: Option<Lease>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Status {
    Active,
    Fenced,
    Released,
}

/// How many of its own timestamps a holder may lag behind another holder's decision
/// before a read timestamp skips its cursor at once (see `skip_own_behind`).
const BEHIND: u64 = 4;

/// The heartbeat word's top bit: set by a fencer, cleared by the next holder.
const BEAT_FENCED: u64 = 1 << 63;

/// What one tick read: the header's hints and one or two windows of the vector.
struct Observation {
    hint: u64,
    far: u64,
    gap: Option<u64>,
    frontier: Option<u64>,
    /// Where the first window ends.
    end: u64,
    /// Where everything read ends.
    covered_end: u64,
    w0: u64,
    n1: u64,
    /// The first window's words, then (from word 0) the second's.
    words: Vec<u64>,
}

impl Observation {
    fn word(&self, w: u64) -> Option<u64> {
        if w >= self.w0 && w < self.w0 + self.n1 {
            return Some(self.words[(w - self.w0) as usize]);
        }
        let second = &self.words[self.n1 as usize..];
        second.get(w as usize).copied()
    }
}

/// Another slot that stalls the prefix, and when its lease was last seen to change.
#[derive(Clone, Copy, Debug)]
struct Watch {
    slot: u32,
    lease: u64,
    beat: u64,
    since: Duration,
}

struct State {
    /// The gates of this process's holders, if shared ([`SlotHandle::share_gates`]).
    gates: Option<Arc<LeaseGates>>,
    /// This holding's gate in `gates`.
    gate: Option<Arc<Gate>>,
    slot: u32,
    status: Status,
    /// Our lease word as we last wrote or confirmed it.
    lease: Lease,
    /// The next own timestamp to hand out.
    cursor: u64,
    /// Where this holder started. The slot's undecided timestamps below it are
    /// inherited from earlier holders or skippers; others may still be skipping them,
    /// so this holder decides them with CAS, never FETCH_ADD.
    inherited_below: u64,
    /// First undecided timestamp as far as this handle knows (monotone, truthful).
    known: u64,
    /// Handed-out timestamps in order, with whether each is still undecided.
    pending: VecDeque<(u64, bool)>,
    /// Our heartbeat word as we last set it.
    beat: u64,
    /// When the last renewal that found our lease intact was posted.
    confirmed_at: Duration,
    renewed_at: Duration,
    next_tick: Duration,
    hint_seen: u64,
    far_seen: u64,
    highest_marked: u64,
    last_gap: Option<u64>,
    watch: Option<Watch>,
    /// A slot a caller suspects is dead though it stalls no prefix ([`SlotHandle::suspect`]),
    /// and the watch of its lease.
    suspect: Option<u32>,
    suspect_watch: Option<Watch>,
    /// The cursor at which a read timestamp last found the prefix waiting for this
    /// slot (see `skip_own_behind`).
    stalled_at: Option<u64>,
    /// Every slot's lease as last seen on the server (registration's read of the
    /// table, the returns of lease CASes, stall checks); ours is `lease`. A slot never
    /// seen reads as owned. Horizons only grow, so a free or fenced slot's horizon
    /// seen once stays a safe bound for skipping for it (see the module doc).
    leases: Vec<Lease>,
    /// For each residue r of a word's first timestamp mod S: the bits of that word
    /// whose slots `leases` shows free or fenced (never this handle's own active slot).
    free_bits: Vec<u64>,
    stats: SlotStats,
}

impl State {
    /// Before any claim: no slot, the prefix known from the oracle's header.
    fn unclaimed(header: &[u64; HEADER_WORDS], layout: Layout) -> State {
        State {
            slot: 0,
            status: Status::Released,
            lease: Lease {
                state: SlotState::Free,
                tag: 0,
                horizon: 0,
            },
            cursor: 0,
            beat: 0,
            inherited_below: 0,
            known: header[6].max(1),
            pending: VecDeque::new(),
            confirmed_at: Duration::ZERO,
            renewed_at: Duration::ZERO,
            next_tick: Duration::ZERO,
            hint_seen: header[6],
            far_seen: header[7],
            highest_marked: 0,
            last_gap: None,
            watch: None,
            suspect: None,
            suspect_watch: None,
            stalled_at: None,
            leases: vec![UNSEEN; layout.slots() as usize],
            free_bits: vec![0; layout.slots() as usize],
            stats: SlotStats::default(),
            gates: None,
            gate: None,
        }
    }

    /// Whether others may skip for `slot` as far as this handle knows.
    fn known_free(&self, slot: u32) -> bool {
        let own = slot == self.slot && self.status == Status::Active;
        !own && self.leases[slot as usize].state != SlotState::Owned
    }

    /// Below which timestamp this handle may decide `slot`'s undecided timestamps with
    /// CAS: a free or fenced slot's horizon (a claimer starts at it), or, for our own
    /// slot, where this holder started (what it inherited below that may be skipped
    /// by others too, so it is decided with CAS as well).
    fn cas_bound(&self, slot: u32) -> u64 {
        if slot == self.slot && self.status == Status::Active {
            return self.inherited_below;
        }
        let lease = self.leases[slot as usize];
        if lease.state == SlotState::Owned {
            0
        } else {
            lease.horizon * BLOCK
        }
    }

    /// The bits of `candidates` (bit b standing for timestamp `base + b`) below their
    /// slot's [`State::cas_bound`]: the skip plan's rule, a word at a time, since the
    /// read path asks it about every timestamp it skips for others (thousands per
    /// read timestamp that skips, with a single client).
    fn below_cas_bounds(&self, base: u64, candidates: u64) -> u64 {
        let s = self.leases.len() as u64;
        let mut rest = candidates;
        let mut allowed = 0u64;
        // The slot of the last bit looked at, carried forward bit by bit: a division
        // per candidate cost more than the rest of the plan.
        let (mut slot, mut at) = (base % s, 0u64);
        while rest != 0 {
            let b = u64::from(rest.trailing_zeros());
            rest &= rest - 1;
            slot += b - at;
            at = b;
            while slot >= s {
                slot -= s;
            }
            if base + b < self.cas_bound(slot as u32) {
                allowed |= 1 << b;
            }
        }
        allowed
    }

    fn rebuild_free_bits(&mut self) {
        let s = self.leases.len() as u64;
        for r in 0..s {
            let mut bits = 0u64;
            for b in 0..64 {
                if self.known_free(((r + b) % s) as u32) {
                    bits |= 1 << b;
                }
            }
            self.free_bits[r as usize] = bits;
        }
    }

    /// Records the lease words of the slots from `first` on, as one read of the slot
    /// table returned them (lease and heartbeat word per slot), and rebuilds the free
    /// bits once rather than per slot (a table of thousands of slots would otherwise
    /// cost a rebuild per slot). Our own held slot keeps what we wrote or confirmed.
    fn note_table(&mut self, first: u32, entries: &[u64]) {
        let mut changed = false;
        for (i, entry) in entries.chunks_exact(2).enumerate() {
            let slot = first + i as u32;
            if slot == self.slot && self.status == Status::Active {
                continue;
            }
            let Ok(lease) = Lease::decode(entry[0]) else {
                continue;
            };
            let was_free = self.known_free(slot);
            self.leases[slot as usize] = lease;
            changed |= was_free != self.known_free(slot);
        }
        if changed {
            self.rebuild_free_bits();
        }
    }

    /// Records a slot's lease word as seen on the server.
    fn note_lease(&mut self, slot: u32, word: u64) {
        let Ok(lease) = Lease::decode(word) else {
            return;
        };
        let was_free = self.known_free(slot);
        self.leases[slot as usize] = lease;
        if was_free != self.known_free(slot) {
            self.rebuild_free_bits();
        }
    }
}

/// Whether `NAMDB_ORACLE_CHECK_DECISIONS` asks for decisions to be checked (read once).
fn check_decisions() -> bool {
    static CHECK: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *CHECK.get_or_init(|| std::env::var_os("NAMDB_ORACLE_CHECK_DECISIONS").is_some())
}

/// In the decisions check ([`check_decisions`]), a line on stderr about what a handle
/// did to the oracle, stamped with the wall clock, the process and the thread: with
/// every process's lines together, a decision made twice can be traced to both.
fn trace(what: std::fmt::Arguments<'_>) {
    if check_decisions() {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        eprintln!(
            "namdb oracle trace {}.{:06} pid {} {:?}: {what}",
            now.as_secs(),
            now.subsec_micros(),
            std::process::id(),
            std::thread::current().id()
        );
    }
}

/// What a handle assumes of a slot it has not seen: owned, so that it neither skips
/// for it nor leaves its decisions out of the frontier.
const UNSEEN: Lease = Lease {
    state: SlotState::Owned,
    tag: 0,
    horizon: 0,
};

/// One slot of the oracle, held by this client.
///
/// A handle belongs to one thread (it is `Send`, not `Sync`); coroutines on that
/// thread share it by reference: every method but [`SlotHandle::read_timestamp_async`]
/// completes without yielding, and concurrent async reads each use their own buffer.
/// A thread that wants more commit throughput than one slot's ordering allows holds
/// several handles.
pub struct SlotHandle {
    link: Link,
    layout: Layout,
    config: OracleConfig,
    clock: Arc<dyn Clock>,
    st: RefCell<State>,
}

impl SlotHandle {
    /// Opens the oracle in `oracle` (on the node `qp` is connected to) and claims a
    /// free or fenced slot. `qp` and `cq` are this handle's alone; see
    /// [`crate::MIN_SEND_QUEUE`] and [`crate::MIN_CQ_CAPACITY`].
    pub fn register(
        device: &dyn Device,
        qp: Arc<dyn QueuePair>,
        cq: Arc<dyn CompletionQueue>,
        oracle: RemoteRegion,
        config: OracleConfig,
        clock: Arc<dyn Clock>,
    ) -> Result<SlotHandle> {
        Self::register_at(device, qp, cq, oracle, 0, config, clock)
    }

    /// As [`SlotHandle::register`], for an oracle that starts `base` bytes into
    /// `region` rather than at its start (one carved out of a data region, as txn's
    /// catalog does). `base` must be a multiple of 8.
    pub fn register_at(
        device: &dyn Device,
        qp: Arc<dyn QueuePair>,
        cq: Arc<dyn CompletionQueue>,
        region: RemoteRegion,
        base: u64,
        config: OracleConfig,
        clock: Arc<dyn Clock>,
    ) -> Result<SlotHandle> {
        let handle = Self::observe_at(device, qp, cq, region, base, config, clock)?;
        handle.claim()?;
        Ok(handle)
    }

    /// As [`SlotHandle::register_at`], but if every slot is owned, waits up to the
    /// lease timeout for one whose holder is gone, fences it and claims it (the
    /// holder's unfinished work is then the caller's to resolve, as a fencer's is).
    #[allow(clippy::too_many_arguments)]
    pub fn register_taking_over_at(
        device: &dyn Device,
        qp: Arc<dyn QueuePair>,
        cq: Arc<dyn CompletionQueue>,
        region: RemoteRegion,
        base: u64,
        config: OracleConfig,
        clock: Arc<dyn Clock>,
    ) -> Result<SlotHandle> {
        let handle = Self::observe_at(device, qp, cq, region, base, config, clock)?;
        handle.claim_taking_over()?;
        Ok(handle)
    }

    /// Claims a free or fenced slot for an observer ([`SlotHandle::observe_at`]), or,
    /// if every slot is owned, takes one over as [`SlotHandle::register_taking_over_at`]
    /// does. Share the gates first ([`SlotHandle::share_gates`]), so that a take-over
    /// of a holder in this process waits for its work in flight.
    pub fn claim_taking_over(&self) -> Result<u32> {
        match self.claim() {
            Err(OracleError::NoFreeSlot { .. }) => self.take_over_lapsed(),
            other => other,
        }
    }

    /// Opens the oracle as [`SlotHandle::register_at`] does, but claims no slot: an
    /// observer, for read-only work such as analytical scans. It takes read timestamps
    /// and its ticks help the prefix along (skipping for free slots, fencing stalled
    /// ones), but it owns no timestamps, so however long it goes without a tick it
    /// never stalls the prefix, and it cannot hand out commit timestamps
    /// ([`OracleError::Released`]).
    pub fn observe_at(
        device: &dyn Device,
        qp: Arc<dyn QueuePair>,
        cq: Arc<dyn CompletionQueue>,
        region: RemoteRegion,
        base: u64,
        config: OracleConfig,
        clock: Arc<dyn Clock>,
    ) -> Result<SlotHandle> {
        config.validate()?;
        if !base.is_multiple_of(8) || base > region.len {
            return Err(OracleError::InvalidConfig(format!(
                "oracle base {base} is not a word offset inside a region of {} bytes",
                region.len
            )));
        }
        let link = Link::new(device, qp, cq, region, base)?;
        let mut header = [0u64; HEADER_WORDS];
        link.read(0, &mut header)?;
        let layout = Layout::from_header(&header, region.len - base)?;
        let handle = SlotHandle {
            link,
            layout,
            config,
            clock,
            st: RefCell::new(State::unclaimed(&header, layout)),
        };
        // Read timestamps skip only for slots known to be free, and a slot never seen
        // counts as owned; a handle that knew only the slots its claim looked at (the
        // first few) left every later free slot to the ticks, one slot per two ticks,
        // and with many free slots its own commits hit the wrap margin long before.
        handle.refresh_leases()?;
        Ok(handle)
    }

    /// Reads the whole slot table (a doorbell of 256-byte READs per `Link::run`'s
    /// worth of buffers) and records every slot's lease: at registration, and when a
    /// tick finds a slot free or fenced that this handle still took for owned (one
    /// stale sighting suggests others are stale too, as when nodes leave together).
    /// Returns each slot's lease word and heartbeat.
    fn refresh_leases(&self) -> Result<Vec<(u64, u64)>> {
        let slots = self.layout.slots();
        let mut table = Vec::with_capacity(slots as usize);
        let per_read = (BUFFER_BYTES as u64 / SLOT_BYTES) as u32;
        let batch = self.link.idle_buffers().max(1) as u32;
        let mut first = 0;
        while first < slots {
            let mut ops = Vec::with_capacity(batch as usize);
            let mut at = first;
            while at < slots && ops.len() < batch as usize {
                let n = per_read.min(slots - at);
                ops.push(Op::Read {
                    remote: self.layout.lease_offset(at),
                    words: 2 * n,
                });
                at += n;
            }
            let mut entries = vec![0u64; 2 * (at - first) as usize];
            self.link.run(&ops, &mut entries)?;
            self.st.borrow_mut().note_table(first, &entries);
            table.extend(entries.chunks_exact(2).map(|e| (e[0], e[1])));
            first = at;
        }
        Ok(table)
    }

    pub fn layout(&self) -> Layout {
        self.layout
    }
    pub fn config(&self) -> &OracleConfig {
        &self.config
    }
    /// The slot this handle holds (or held, once fenced or released).
    pub fn slot(&self) -> u32 {
        self.st.borrow().slot
    }
    pub fn stats(&self) -> SlotStats {
        self.st.borrow().stats
    }
    /// The last read timestamp this handle computed, without communication.
    pub fn known_read_timestamp(&self) -> u64 {
        self.st.borrow().known - 1
    }
    /// Commit timestamps handed out and not yet marked.
    pub fn outstanding(&self) -> usize {
        self.st.borrow().pending.len()
    }
    /// Whether `ts` is a commit timestamp this handle handed out under its current
    /// claim and has not marked: what [`SlotHandle::mark_many`] accepts. A timestamp
    /// of an earlier claim (before a fence and [`SlotHandle::rejoin`]) is not: the
    /// fence decided it.
    pub fn is_outstanding(&self, ts: u64) -> bool {
        let st = self.st.borrow();
        st.pending
            .binary_search_by_key(&ts, |&(t, _)| t)
            .is_ok_and(|i| st.pending[i].1)
    }
    /// The lease word this handle believes it holds (what it last wrote or confirmed).
    pub fn held_lease(&self) -> Lease {
        self.st.borrow().lease
    }
    /// Whether the slot is held (not fenced, not released) as far as this handle
    /// knows; a fence shows at the next renewal.
    pub fn is_active(&self) -> bool {
        self.st.borrow().status == Status::Active
    }

    fn reserve_ts(&self) -> u64 {
        if self.config.reserve == 0 {
            (self.layout.bits() / 4).max(BLOCK)
        } else {
            self.config.reserve
        }
    }

    /// A horizon (in blocks) that covers `ts` and the reserve beyond it.
    fn horizon_for(&self, ts: u64) -> u64 {
        ts.saturating_add(1)
            .saturating_add(self.reserve_ts())
            .div_ceil(BLOCK)
            .min(MAX_HORIZON)
    }

    /// The first timestamp of `slot` at or after `from` (never the genesis, 0).
    fn first_own(&self, slot: u32, from: u64) -> u64 {
        let s = self.layout.slots() as u64;
        let t = from + (slot as u64 + s - from % s) % s;
        if t == 0 { s } else { t }
    }

    fn active(&self) -> Result<()> {
        let st = self.st.borrow();
        match st.status {
            Status::Active => Ok(()),
            Status::Fenced => Err(OracleError::Fenced { slot: st.slot }),
            Status::Released => Err(OracleError::Released),
        }
    }

    /// Claims a free or fenced slot: scans the slot table and CASes the first one it
    /// finds to owned, with a fresh tag and a reservation. The new holder starts at
    /// the slot's horizon: everything of the slot below it was decided, or may be
    /// skipped by others, and nothing above it was touched.
    fn claim(&self) -> Result<u32> {
        let slots = self.layout.slots();
        let per_read = (BUFFER_BYTES as u64 / SLOT_BYTES) as u32;
        let mut first = 0;
        while first < slots {
            let n = per_read.min(slots - first);
            let mut entries = [0u64; (BUFFER_BYTES / 8) as usize];
            let words = &mut entries[..2 * n as usize];
            self.link.read(self.layout.lease_offset(first), words)?;
            {
                let mut st = self.st.borrow_mut();
                for i in 0..n {
                    st.note_lease(first + i, words[2 * i as usize]);
                }
            }
            for i in 0..n {
                if self.claim_slot(first + i, words[2 * i as usize])? {
                    return Ok(first + i);
                }
            }
            first += n;
        }
        Err(OracleError::NoFreeSlot { slots })
    }

    /// Claims `slot`, whose lease word was read as `word`, if it is free or fenced,
    /// and makes it this handle's.
    fn claim_slot(&self, slot: u32, word: u64) -> Result<bool> {
        let Some((mine, start, posted)) = self.try_claim(slot, word)? else {
            return Ok(false);
        };
        // Once more, now that the slot is ours: a rival claimer's clearing between
        // ours and our lease CAS would otherwise fail our first renewal.
        let beat = self.restart_heartbeat(slot)?;
        let mut st = self.st.borrow_mut();
        st.beat = beat;
        st.slot = slot;
        st.status = Status::Active;
        st.lease = mine;
        st.cursor = start;
        st.inherited_below = start;
        st.pending.clear();
        st.confirmed_at = posted;
        st.renewed_at = posted;
        st.next_tick = posted;
        st.last_gap = None;
        st.watch = None;
        st.leases[slot as usize] = mine;
        st.rebuild_free_bits();
        st.gate = st
            .gates
            .as_ref()
            .map(|gates| gates.register(slot, mine.tag));
        Ok(true)
    }

    /// With every slot owned, watches them for `lease_timeout` of this handle's clock
    /// and fences and claims the first whose lease and heartbeat stayed unchanged (its
    /// holder is gone: a live one renews every quarter of that), or claims one that
    /// came free meanwhile. Fencing is otherwise left to ticks of live holders, which
    /// fence a slot once it stalls the prefix; when every holder died (a node in a
    /// crash loop, its new processes dying before their first ticks) no tick is left
    /// to do it, and without this no worker could ever start again.
    fn take_over_lapsed(&self) -> Result<u32> {
        let watched = self.refresh_leases()?;
        let since = self.clock.now();
        let started = std::time::Instant::now();
        let pause = (self.config.lease_timeout / 8).clamp(
            std::time::Duration::from_millis(1),
            std::time::Duration::from_millis(20),
        );
        // A clock that does not move (a test's) must not hold the caller for ever.
        let give_up = self.config.lease_timeout * 4 + std::time::Duration::from_secs(1);
        while started.elapsed() < give_up {
            std::thread::sleep(pause);
            let now = self.refresh_leases()?;
            for (slot, &(word, _)) in now.iter().enumerate() {
                if Lease::decode(word)?.state != SlotState::Owned
                    && self.claim_slot(slot as u32, word)?
                {
                    return Ok(slot as u32);
                }
            }
            if self.clock.now().saturating_sub(since) < self.config.lease_timeout {
                continue;
            }
            for (slot, (&(word, beat), &seen)) in now.iter().zip(&watched).enumerate() {
                if (word, beat) != seen || Lease::decode(word)?.state != SlotState::Owned {
                    continue;
                }
                if let Some(taken) = self.fence(slot as u32, word, beat)?
                    && self.claim_slot(slot as u32, taken.encode())?
                {
                    return Ok(slot as u32);
                }
            }
            break;
        }
        Err(OracleError::NoFreeSlot {
            slots: self.layout.slots(),
        })
    }

    /// CASes `slot`'s lease from `word` (as read) to owned, unless it is owned; read
    /// timestamps raise free slots' horizons all the time, so a CAS that lost to a
    /// raise tries again from the word it found, a few times. Returns our lease,
    /// where we start and when the CAS was posted.
    fn try_claim(&self, slot: u32, mut word: u64) -> Result<Option<(Lease, u64, Duration)>> {
        for _ in 0..4 {
            let lease = Lease::decode(word)?;
            if lease.state == SlotState::Owned {
                return Ok(None);
            }
            let start = self.first_own(slot, lease.horizon * BLOCK);
            // The heartbeat first: a fence leaves its mark there, and a fencer that
            // finds the mark on an owned slot finishes the fence on the lease word at
            // once, whoever owns it by then. Cleared only after our lease CAS, it
            // would let a fencer end our claim before we ever used it, with nothing
            // to tell us: our renewals CAS the heartbeat, which that fencer leaves as
            // it is (two holders of one slot deciding the same timestamps).
            self.restart_heartbeat(slot)?;
            let mine = Lease {
                state: SlotState::Owned,
                tag: lease.next_tag(),
                horizon: self.horizon_for(start).max(lease.horizon),
            };
            let posted = self.clock.now();
            let old = self
                .link
                .cas(self.layout.lease_offset(slot), word, mine.encode())?;
            if old == word {
                trace(format_args!(
                    "claimed slot {slot}: {lease:?} -> {mine:?}, starts at {start}"
                ));
                return Ok(Some((mine, start, posted)));
            }
            self.st.borrow_mut().note_lease(slot, old);
            word = old;
        }
        Ok(None)
    }

    /// Starts the heartbeat of a slot just claimed: clears a fencer's mark and moves
    /// the counter on, so that no CAS prepared against an earlier holder's value can
    /// succeed (the counter never repeats).
    fn restart_heartbeat(&self, slot: u32) -> Result<u64> {
        let off = self.layout.heartbeat_offset(slot);
        let mut cur = [0u64];
        self.link.read(off, &mut cur)?;
        let mut cur = cur[0];
        for _ in 0..8 {
            let next = (cur & !BEAT_FENCED).wrapping_add(1) & !BEAT_FENCED;
            let old = self.link.cas(off, cur, next)?;
            if old == cur {
                return Ok(next);
            }
            cur = old;
        }
        Err(OracleError::Corrupt(format!(
            "the heartbeat of slot {slot} keeps changing under its new holder"
        )))
    }

    /// Claims a slot again after this handle's was fenced or released. Timestamps
    /// outstanding under the old slot are in doubt: a fencer may have skipped them.
    pub fn rejoin(&self) -> Result<u32> {
        if self.active().is_ok() {
            return Ok(self.slot());
        }
        self.claim()
    }

    /// The next commit timestamp of this slot, without communication.
    ///
    /// Fails with [`OracleError::RenewalDue`] once half the lease timeout has passed
    /// since the lease was last confirmed (a clock read, no communication), with
    /// [`OracleError::WrapBlocked`] unless `ts − V/2` is inside the known
    /// prefix (so `ts − V`, whose bit position `ts` reuses, is long decided; see
    /// `cells` for why the margin), and with [`OracleError::ReservationExhausted`]
    /// when the slot must raise its horizon first; [`SlotHandle::acquire_commit_ts`]
    /// does both and retries.
    pub fn next_commit_ts(&self) -> Result<u64> {
        self.active()?;
        let now = self.clock.now();
        let mut st = self.st.borrow_mut();
        // A holder that may have been fenced learns it before its caller does any
        // commit work under the timestamp.
        if now.saturating_sub(st.confirmed_at) >= self.config.lease_timeout / 2 {
            return Err(OracleError::RenewalDue);
        }
        let t = st.cursor;
        if t >= st.lease.horizon * BLOCK {
            return Err(OracleError::ReservationExhausted {
                ts: t,
                horizon: st.lease.horizon * BLOCK,
            });
        }
        let reach = self.reach();
        if t >= self.margin_base(&st, st.known) + reach {
            return Err(OracleError::WrapBlocked {
                ts: t,
                blocked_by: t - reach,
                prefix: st.known,
            });
        }
        st.cursor = t + self.layout.slots() as u64;
        st.pending.push_back((t, true));
        Ok(t)
    }

    /// How far beyond its known prefix a holder may decide timestamps: V/2.
    fn reach(&self) -> u64 {
        self.layout.bits() / 2
    }

    /// What a decision's wrap margin counts from: the known prefix `known`, but never
    /// more than V/8 beyond the prefix hint this handle has seen. So every decision
    /// anyone makes lies below the published hint + 5V/8, and a reader that finds the
    /// hint at or below the start of its window knows no position in the window was
    /// reused (that would need a decision V beyond it). Publishing the hint (ticks,
    /// read timestamps, at V/10) keeps this from holding anyone back.
    fn margin_base(&self, st: &State, known: u64) -> u64 {
        known.min(st.hint_seen + self.layout.bits() / 8)
    }

    /// [`SlotHandle::next_commit_ts`], renewing the lease, raising the horizon or
    /// refreshing the read timestamp as needed, up to `attempts` times.
    pub fn acquire_commit_ts(&self, attempts: u32) -> Result<u64> {
        for _ in 0..attempts.max(1) {
            match self.next_commit_ts() {
                Ok(t) => return Ok(t),
                Err(OracleError::ReservationExhausted { ts, .. }) => self.raise_horizon(ts)?,
                Err(OracleError::RenewalDue) => self.renew()?,
                Err(OracleError::WrapBlocked { ts, .. }) => {
                    self.announce_blocked(ts)?;
                    self.read_timestamp()?;
                    crate::spin();
                }
                Err(e) => return Err(e),
            }
        }
        match self.next_commit_ts() {
            Err(
                e @ (OracleError::ReservationExhausted { .. }
                | OracleError::RenewalDue
                | OracleError::WrapBlocked { .. }),
            ) => Err(OracleError::Stalled {
                attempts,
                last: Box::new(e),
            }),
            other => other,
        }
    }

    /// Posts the FETCH_ADDs that decide the bits `mask` of vector word `word` (in a
    /// round of parity `odd`) per entry, unsignaled. Each add relies on its bits being
    /// undecided: an add on a decided bit undoes it and carries into the bits above,
    /// other slots' timestamps. With `NAMDB_ORACLE_CHECK_DECISIONS` set, the adds wait
    /// for their old values instead, and one that met a decided bit is reported on
    /// stderr with this handle's state (a diagnostic: it costs a round trip per batch).
    fn post_decisions(&self, masks: &[(u64, u64, bool)], what: &str) -> Result<()> {
        if !check_decisions() {
            let adds: Vec<(u64, u64)> = masks
                .iter()
                .map(|&(w, m, odd)| (self.layout.word_offset(w), cells::decide_add(m, odd)))
                .collect();
            return self.link.post_adds(&adds);
        }
        let batch = self.link.idle_buffers().max(1);
        for chunk in masks.chunks(batch) {
            let ops: Vec<Op> = chunk
                .iter()
                .map(|&(w, m, odd)| Op::FetchAdd {
                    remote: self.layout.word_offset(w),
                    add: cells::decide_add(m, odd),
                })
                .collect();
            let mut old = vec![0u64; ops.len()];
            self.link.run(&ops, &mut old)?;
            for (&(w, m, odd), &was) in chunk.iter().zip(&old) {
                let twice = m & cells::decided_bits(was, odd);
                if twice != 0 {
                    let st = self.st.borrow();
                    trace(format_args!(
                        "DOUBLE {what} of slot {} decided bits {twice:#x} of word {w} (odd round {odd}) that were decided already: word was {was:#x}, mask {m:#x}; cursor {}, inherited below {}, known {}, hint {}, far {}, lease {:?}, status {:?}",
                        st.slot,
                        st.cursor,
                        st.inherited_below,
                        st.known,
                        st.hint_seen,
                        st.far_seen,
                        st.lease,
                        st.status
                    ));
                }
            }
        }
        Ok(())
    }

    /// Decides `ts`, a commit timestamp this handle handed out: one FETCH_ADD of ±2^b
    /// on its word, unsignaled.
    pub fn mark(&self, ts: u64, outcome: Outcome) -> Result<()> {
        self.mark_many(&[(ts, outcome)])
    }

    /// Decides several timestamps this handle handed out, as a worker whose coroutines
    /// finish commits together does: timestamps that share a word of the vector (a
    /// slot's consecutive ones do) are decided by one FETCH_ADD of the sum of their
    /// ±2^b, and all the adds go in one doorbell, unsignaled. Nothing is posted unless
    /// every timestamp is outstanding.
    pub fn mark_many(&self, decided: &[(u64, Outcome)]) -> Result<()> {
        self.active()?;
        let mut indices = Vec::with_capacity(decided.len());
        {
            let st = self.st.borrow();
            for &(ts, _) in decided {
                match st.pending.binary_search_by_key(&ts, |&(t, _)| t) {
                    Ok(i) if st.pending[i].1 && !indices.contains(&i) => indices.push(i),
                    _ => return Err(OracleError::NotOutstanding { ts }),
                }
            }
        }
        let _inside = self.lease_guard()?;
        let v = self.layout.bits();
        // (word, bits, odd round): a wrap splits one word's timestamps in two rounds.
        let mut masks: Vec<(u64, u64, bool)> = Vec::with_capacity(decided.len());
        for &(ts, _) in decided {
            let (word, bit) = cells::position(v, ts);
            let odd = cells::odd_round(v, ts);
            match masks.iter_mut().find(|(w, _, o)| *w == word && *o == odd) {
                Some((_, mask, _)) => *mask |= 1 << bit,
                None => masks.push((word, 1 << bit, odd)),
            }
        }
        self.post_decisions(&masks, "mark")?;
        let mut st = self.st.borrow_mut();
        for (&i, &(ts, outcome)) in indices.iter().zip(decided) {
            st.pending[i].1 = false;
            st.highest_marked = st.highest_marked.max(ts);
            match outcome {
                Outcome::Committed => st.stats.committed += 1,
                Outcome::Aborted => st.stats.aborted += 1,
            }
        }
        while st.pending.front().is_some_and(|&(_, undecided)| !undecided) {
            st.pending.pop_front();
        }
        Ok(())
    }

    /// The read timestamp: the end of the run of decided timestamps, scanned from the
    /// known prefix onward. Never below an earlier result of this handle.
    ///
    /// One READ while the prefix has moved less than a window since this handle's
    /// last look and more than not at all. A gap right at the known prefix, or none in
    /// a whole round, is what a handle that fell more than V/2 behind (a long pause)
    /// would see where positions were reused meanwhile; then it also reads the
    /// published prefix hint and, if that is ahead, scans again from there.
    ///
    /// The window that holds the gap also tells what this handle can do at once so
    /// that the prefix moves on without waiting for anyone's tick (see
    /// [`SlotHandle::skip_behind`]): skip its own unused timestamps up to the highest
    /// decision of a slot not known to be free (FETCH_ADDs, no waiting), and, when the
    /// gap belongs to a slot known to be free or fenced, decide that slot's and the
    /// other free slots' timestamps through the window with CAS (a hint READ and a
    /// doorbell of CAS, once per window's worth of progress).
    pub fn read_timestamp(&self) -> Result<u64> {
        let max_words = self.window_words();
        let mut buf = [0u64; (BUFFER_BYTES / 8) as usize];
        let (mut hinted, mut hint) = (false, None);
        // Catch up with the published prefix first: a handle idle while the prefix
        // moved more than V/2 would otherwise scan reused positions and settle on a
        // stale gap (a read timestamp below commits that have returned).
        let mut hints = [0u64; 2];
        self.link.read(OFF_PREFIX_HINT, &mut hints)?;
        self.adopt_hints(hints);
        loop {
            let first = self.st.borrow().known;
            let mut start = first;
            let mut found = None;
            let mut n = 0;
            for _ in 0..self.max_windows() {
                let (w0, len) = cells::window_words(self.layout.bits(), start, max_words);
                n = len as usize;
                self.link.read(self.layout.word_offset(w0), &mut buf[..n])?;
                self.note_window(len);
                let scan = cells::scan_to_gap(self.layout.bits(), start, &buf[..n]);
                if scan.gap.is_some() {
                    found = scan.gap;
                    break;
                }
                start = scan.end;
            }
            if !hinted && found.is_none_or(|g| g == first) {
                hinted = true;
                // The far hint comes along (same READ): a holder the prefix waits
                // for skips up to it (see `skip_own_behind`).
                let mut hints = [0u64; 2];
                self.link.read(OFF_PREFIX_HINT, &mut hints)?;
                if self.adopt_hints(hints) {
                    continue;
                }
                // Read after the window: it vouches for the window (skip_free_behind).
                hint = Some(hints[0]);
            }
            return self.conclude(start, &mut buf[..n], found, hint);
        }
    }

    /// [`SlotHandle::read_timestamp`] as a future, for coroutines that share this
    /// handle on one thread.
    ///
    /// Its skips (see [`SlotHandle::read_timestamp`]) run without yielding: their
    /// round trips are rare, and they are skipped while other coroutines' reads hold
    /// every scratch buffer (the next read or tick does them).
    pub async fn read_timestamp_async(&self) -> Result<u64> {
        let max_words = self.window_words();
        let (mut hinted, mut hint) = (false, None);
        // As in `read_timestamp`: the published prefix first.
        let hints = self.link.read_async(OFF_PREFIX_HINT, 2).await?;
        self.adopt_hints([hints[0], hints[1]]);
        loop {
            let first = self.st.borrow().known;
            let mut start = first;
            let mut found = None;
            let mut words = Vec::new();
            for _ in 0..self.max_windows() {
                let (w0, n) = cells::window_words(self.layout.bits(), start, max_words);
                words = self
                    .link
                    .read_async(self.layout.word_offset(w0), n as u32)
                    .await?;
                self.note_window(n);
                let scan = cells::scan_to_gap(self.layout.bits(), start, &words);
                if scan.gap.is_some() {
                    found = scan.gap;
                    break;
                }
                start = scan.end;
            }
            if !hinted && found.is_none_or(|g| g == first) {
                hinted = true;
                let hints = self.link.read_async(OFF_PREFIX_HINT, 2).await?;
                if self.adopt_hints([hints[0], hints[1]]) {
                    continue;
                }
                hint = Some(hints[0]);
            }
            return self.conclude(start, &mut words, found, hint);
        }
    }

    /// Moves the known prefix up to a published prefix hint, and notes the far hint
    /// (the two header words from the prefix hint on); whether the prefix moved.
    fn adopt_hints(&self, [hint, far]: [u64; 2]) -> bool {
        let mut st = self.st.borrow_mut();
        st.hint_seen = st.hint_seen.max(hint);
        st.far_seen = st.far_seen.max(far);
        if hint > st.known {
            st.known = hint;
            return true;
        }
        false
    }

    /// Ends a read timestamp whose scan found `gap` in `words`, the window read from
    /// `start`, and the prefix hint if it was read after the window: skips what can
    /// be skipped at once and returns the read timestamp.
    fn conclude(
        &self,
        start: u64,
        words: &mut [u64],
        gap: Option<u64>,
        hint: Option<u64>,
    ) -> Result<u64> {
        let Some(gap) = gap else {
            return Err(self.runaway());
        };
        let gap = match self.skip_behind(start, words, gap, hint) {
            Ok(moved) => moved.unwrap_or(gap),
            // The read itself stands; the caller learns of the fence from its next
            // decision, renewal or tick, as without the skip.
            Err(OracleError::Fenced { .. } | OracleError::Released) => gap,
            Err(e) => return Err(e),
        };
        let rid = self.settle(gap)?;
        // Read timestamps move the prefix faster than ticks come: they publish it too,
        // or every holder's wrap margin would stall at the hint + V/8.
        if self.link.idle_buffers() > 0 {
            self.publish_prefix_hint()?;
        }
        Ok(rid)
    }

    /// Decides at once what this handle may decide so that the prefix moves past
    /// `gap`, the first undecided timestamp of `words` (the window read from `start`),
    /// instead of waiting for the ticks of others: first the timestamps of free and
    /// fenced slots ([`SlotHandle::skip_free_behind`]), then, if that leaves the gap at
    /// this slot's cursor, its own unused ones ([`SlotHandle::skip_own_behind`]).
    ///
    /// Returns the first undecided timestamp the window shows afterwards, if the CAS
    /// skips moved it (the FETCH_ADDs of own skips show at the next read).
    fn skip_behind(
        &self,
        start: u64,
        words: &mut [u64],
        gap: u64,
        hint: Option<u64>,
    ) -> Result<Option<u64>> {
        // The common case, one look: the gap is another active slot's (or a handed-out
        // one of ours) and nothing of ours lies beyond others' windows.
        let window_ts = self.window_words() * 64;
        let idle = {
            let st = self.st.borrow();
            let owner = (gap % self.layout.slots() as u64) as u32;
            let ours = st.status == Status::Active && owner == st.slot;
            !st.known_free(owner)
                && !(ours && (gap < st.inherited_below || gap == st.cursor))
                && !(st.highest_marked >= st.far_seen + window_ts
                    && st.highest_marked >= gap + window_ts)
        };
        // Another coroutine's reads may hold every buffer: skip nothing then.
        if idle || self.link.idle_buffers() == 0 {
            return Ok(None);
        }
        let moved = self.skip_free_behind(start, words, gap, hint)?;
        self.skip_own_behind(start, words, moved.unwrap_or(gap))?;
        // Our decisions beyond what others' windows reach (a slot claimed far ahead
        // commits there) wait for their holders to skip up to them; the far hint
        // tells them, as a tick's would. Once per window of our progress at most: a
        // holder far ahead of the prefix would otherwise CAS it at every read.
        let (highest, far) = {
            let st = self.st.borrow();
            (st.highest_marked, st.far_seen)
        };
        if highest >= far + window_ts && highest >= gap + window_ts {
            self.announce_far(highest)?;
        }
        Ok(moved)
    }

    /// When `gap` belongs to a slot known to be free or fenced (or to this slot's
    /// inherited range), decides the undecided timestamps of every such slot from
    /// `gap` on, through the window or V/4, one CAS per word, after raising the
    /// horizons that do not cover them (CAS on the lease words). So the prefix passes
    /// free slots once per window's worth of progress, not once per timestamp.
    ///
    /// Like a tick's skips, this needs the prefix hint, read in the same read
    /// timestamp, not ahead of `start` (a reader lagging more than V/2 could take a
    /// reused position for an undecided timestamp), so it costs a hint READ unless
    /// the read path has just read the hint. Returns the window's first undecided
    /// timestamp afterwards, if anything was skipped.
    fn skip_free_behind(
        &self,
        start: u64,
        words: &mut [u64],
        gap: u64,
        hint: Option<u64>,
    ) -> Result<Option<u64>> {
        let v = self.layout.bits();
        let s = self.layout.slots() as u64;
        let owner = (gap % s) as u32;
        let helps = {
            let st = self.st.borrow();
            st.known_free(owner)
                || (st.status == Status::Active && owner == st.slot && gap < st.inherited_below)
        };
        // Free slots are skipped V/4 ahead at most (the wrap margin allows V/2): a
        // node that claims one starts at its horizon, which must stay within the wrap
        // margin of the prefix it knows (a published hint may lag V/10), or its first
        // commit would wait.
        let end = cells::window_end(v, start, words.len() as u64);
        let base = self.margin_base(&self.st.borrow(), gap);
        let limit = end.min(base + self.reach() / 2) - 1;
        if !helps || limit < gap {
            return Ok(None);
        }
        let hint = match hint {
            Some(h) => h,
            None => {
                let mut hints = [0u64; 2];
                self.link.read(OFF_PREFIX_HINT, &mut hints)?;
                self.adopt_hints(hints);
                hints[0]
            }
        };
        if hint > start {
            return Ok(None);
        }
        self.raise_free_horizons(gap, limit)?;
        let w0 = (start % v) / 64;
        let allow =
            |base: u64, candidates: u64| self.st.borrow().below_cas_bounds(base, candidates);
        let mut plan = cells::skippable(v, start, words, gap, limit, allow);
        let mut skipped = 0;
        // A CAS that lost to another skipper's or a holder's decision in its word
        // learns the word and tries again, a few times.
        for _ in 0..4 {
            if plan.is_empty() {
                break;
            }
            let mut lost = Vec::new();
            let batch = self.link.idle_buffers().max(1);
            for chunk in plan.chunks(batch) {
                let ops: Vec<Op> = chunk
                    .iter()
                    .map(|&(i, mask)| Op::Cas {
                        remote: self.layout.word_offset(w0 + i as u64),
                        compare: words[i],
                        swap: words[i] ^ mask,
                    })
                    .collect();
                let mut old = vec![0u64; ops.len()];
                self.link.run(&ops, &mut old)?;
                for (&(i, mask), &was) in chunk.iter().zip(&old) {
                    if was == words[i] {
                        trace(format_args!(
                            "skipped free: word {} mask {mask:#x} (was {was:#x}), window from {start}, gap {gap}, limit {limit}",
                            w0 + i as u64
                        ));
                        words[i] ^= mask;
                        skipped += mask.count_ones() as u64;
                    } else {
                        words[i] = was;
                        lost.push(i);
                    }
                }
            }
            plan = cells::skippable(v, start, words, gap, limit, allow);
            plan.retain(|(i, _)| lost.contains(i));
        }
        if skipped == 0 {
            return Ok(None);
        }
        self.st.borrow_mut().stats.skipped_for_others += skipped;
        Ok(Some(cells::scan_to_gap(v, start, words).gap.unwrap_or(end)))
    }

    /// When `gap` is this slot's cursor, skips its unused timestamps up to the highest
    /// decision in the window of a slot not known to be free, as a tick would
    /// (`skip_own`: FETCH_ADDs, unsignaled; lease, horizon and wrap margin checked
    /// there) — if that decision is [`BEHIND`] of this slot's timestamps (and a
    /// word's worth of timestamps, so that few slots do not skip at every small drift)
    /// or more ahead, or the gap was the cursor at the previous read too (the holder
    /// did not decide it meanwhile).
    ///
    /// Why not always: a holder that commits all the time and keeps pace decides its
    /// cursor by committing soon enough; skipping at once would only burn its
    /// timestamps and a FETCH_ADD per read. One that falls behind (another holder
    /// commits faster) would hold every later commit back for as long as it lags, so it
    /// jumps ahead. Why free slots' decisions are left out: the CAS skips decide them
    /// ahead of everyone, and counting them would make every holder chase the window's
    /// end.
    fn skip_own_behind(&self, start: u64, words: &[u64], gap: u64) -> Result<()> {
        let again = {
            let mut st = self.st.borrow_mut();
            if st.status != Status::Active || st.cursor != gap {
                return Ok(());
            }
            st.stalled_at.replace(gap) == Some(gap)
        };
        let v = self.layout.bits();
        let s = self.layout.slots() as u64;
        let (frontier, far) = {
            let st = self.st.borrow();
            let f = cells::last_decided_except(v, start, words, |base| {
                st.free_bits[(base % s) as usize]
            });
            (f, st.far_seen)
        };
        // The far hint, which a read read with the prefix hint when the prefix did
        // not move, stands for a decision beyond the window, such as the first commits
        // of a node that claimed a slot far ahead.
        let frontier = if again {
            frontier.max(Some(far))
        } else {
            frontier
        };
        let due = |f: u64| f > gap && (again || f >= gap + (BEHIND * s).max(BLOCK));
        if let Some(f) = frontier.filter(|&f| due(f)) {
            // The wrap margin, with `gap` as the known prefix.
            let base = self.margin_base(&self.st.borrow(), gap);
            self.skip_own(f.min(base + self.reach() - 1))?;
        }
        Ok(())
    }

    /// Raises, with CAS on their lease words, the horizons of the slots known to be
    /// free or fenced that own a timestamp in `[from, upto]` at or above their
    /// horizon, to cover `upto` and V/16 beyond (so that it is rare; and little, for
    /// the next holder starts at the horizon, see [`SlotHandle::skip_behind`]). A CAS
    /// that fails teaches the slot's current lease instead: a claimed slot is then
    /// known as owned, and is neither skipped nor left out of the frontier.
    fn raise_free_horizons(&self, from: u64, upto: u64) -> Result<()> {
        let s = self.layout.slots() as u64;
        let want = (upto + 1 + self.layout.bits() / 16)
            .div_ceil(BLOCK)
            .min(MAX_HORIZON);
        let mut raises: Vec<(u32, Lease)> = Vec::new();
        {
            let st = self.st.borrow();
            for t in from..=upto.min(from + s - 1) {
                let slot = (t % s) as u32;
                // The slot's last timestamp in the range.
                let last = upto - (upto % s + s - slot as u64) % s;
                let lease = st.leases[slot as usize];
                if st.known_free(slot) && last >= lease.horizon * BLOCK && want > lease.horizon {
                    raises.push((slot, lease));
                }
            }
        }
        let raised = |lease: Lease| {
            Lease {
                horizon: want,
                ..lease
            }
            .encode()
        };
        let batch = self.link.idle_buffers().max(1);
        for chunk in raises.chunks(batch) {
            let ops: Vec<Op> = chunk
                .iter()
                .map(|&(slot, lease)| Op::Cas {
                    remote: self.layout.lease_offset(slot),
                    compare: lease.encode(),
                    swap: raised(lease),
                })
                .collect();
            let mut old = vec![0u64; ops.len()];
            self.link.run(&ops, &mut old)?;
            let mut st = self.st.borrow_mut();
            for (&(slot, lease), &was) in chunk.iter().zip(&old) {
                let now = if was == lease.encode() {
                    trace(format_args!(
                        "raised free slot {slot}: {lease:?} -> horizon {want}"
                    ));
                    raised(lease)
                } else {
                    was
                };
                st.note_lease(slot, now);
            }
        }
        Ok(())
    }

    /// The read timestamp from the first undecided timestamp a read found.
    fn settle(&self, gap: u64) -> Result<u64> {
        let mut st = self.st.borrow_mut();
        st.known = st.known.max(gap);
        st.stats.read_timestamps += 1;
        Ok(st.known - 1)
    }

    fn note_window(&self, words: u64) {
        let mut st = self.st.borrow_mut();
        st.stats.window_reads += 1;
        st.stats.window_bytes += words * 8;
    }

    fn window_words(&self) -> u64 {
        self.config.window_bytes as u64 / 8
    }

    /// A whole round of windows, plus one for a start in the middle of a word.
    fn max_windows(&self) -> u64 {
        let per = self.config.window_bytes as u64 / 8;
        self.layout.words().div_ceil(per) + 1
    }

    fn runaway(&self) -> OracleError {
        OracleError::Corrupt(format!(
            "no undecided timestamp within a round of {} from {}: the vector holds more decided timestamps than can be",
            self.layout.bits(),
            self.st.borrow().known
        ))
    }

    /// Makes sure the lease is good for deciding timestamps: renews first once half
    /// the timeout has passed since the last confirmed renewal was posted.
    ///
    /// It costs a clock read while the lease is fresh, and fails with
    /// [`OracleError::Fenced`] once another node fenced us. Before posting work that is
    /// only safe under the lease (a commit's locks, log record and installs), take
    /// [`SlotHandle::lease_guard`] instead.
    pub fn ensure_lease(&self) -> Result<()> {
        let now = self.clock.now();
        let confirmed_at = self.st.borrow().confirmed_at;
        if now.saturating_sub(confirmed_at) < self.config.lease_timeout / 2 {
            return Ok(());
        }
        self.renew()
    }

    /// [`SlotHandle::ensure_lease`] for work posted under it: the returned guard must
    /// live until that work has completed. With gates shared, a fence by a handle of
    /// this process waits for it, and once such a fence began, this fails with
    /// [`OracleError::Fenced`] (see [`crate::gate`]).
    pub fn lease_guard(&self) -> Result<LeaseGuard> {
        let gate = self.st.borrow().gate.clone();
        let guard = match gate {
            Some(gate) => match Gate::enter(&gate) {
                Some(guard) => guard,
                None => {
                    let mut st = self.st.borrow_mut();
                    if st.status == Status::Active {
                        st.status = Status::Fenced;
                    }
                    return Err(OracleError::Fenced { slot: st.slot });
                }
            },
            None => LeaseGuard::none(),
        };
        self.ensure_lease()?;
        Ok(guard)
    }

    /// Shares `gates` with this handle: its holdings register there, and its fences of
    /// a holding registered there wait for that holder's work in flight (see
    /// [`crate::gate`]). Give every handle of a process the same gates.
    pub fn share_gates(&self, gates: Arc<LeaseGates>) {
        let mut st = self.st.borrow_mut();
        st.gate = (st.status == Status::Active).then(|| gates.register(st.slot, st.lease.tag));
        st.gates = Some(gates);
    }

    /// Bumps the heartbeat with CAS from the value this holder last wrote, and reads
    /// the lease word back in the same doorbell. A fencer CASes the same heartbeat
    /// (from the value it watched to that value with the fenced bit), so of a late
    /// renewal and a fence exactly one succeeds: a holder whose renewal went through
    /// cannot have been fenced before it. A lease word that is not ours ends the
    /// holding too.
    pub fn renew(&self) -> Result<()> {
        self.active()?;
        let (slot, beat) = {
            let st = self.st.borrow();
            (st.slot, st.beat)
        };
        let posted = self.clock.now();
        let next = beat.wrapping_add(1) & !BEAT_FENCED;
        // The lease word comes back in the same doorbell: a fence shows on the
        // heartbeat, but a claim, a release or a fence that found another's mark on
        // the heartbeat changes only the lease.
        let mut out = [0u64; 2];
        self.link.run(
            &[
                Op::Cas {
                    remote: self.layout.heartbeat_offset(slot),
                    compare: beat,
                    swap: next,
                },
                Op::Read {
                    remote: self.layout.lease_offset(slot),
                    words: 1,
                },
            ],
            &mut out,
        )?;
        let [old, lease] = out;
        let mut st = self.st.borrow_mut();
        st.renewed_at = posted;
        if old != beat || lease != st.lease.encode() {
            st.status = Status::Fenced;
            return Err(OracleError::Fenced { slot });
        }
        st.beat = next;
        st.confirmed_at = posted;
        st.stats.renewals += 1;
        Ok(())
    }

    /// Raises this slot's horizon so that it covers `ts` and the reserve beyond.
    fn raise_horizon(&self, ts: u64) -> Result<()> {
        self.active()?;
        let (slot, cur) = {
            let st = self.st.borrow();
            (st.slot, st.lease)
        };
        let want = Lease {
            horizon: self.horizon_for(ts).max(cur.horizon + 1).min(MAX_HORIZON),
            ..cur
        };
        if want.horizon == cur.horizon {
            return Err(OracleError::Corrupt(format!(
                "slot {slot} reached the largest horizon"
            )));
        }
        let posted = self.clock.now();
        let old = self
            .link
            .cas(self.layout.lease_offset(slot), cur.encode(), want.encode())?;
        let mut st = self.st.borrow_mut();
        if old != cur.encode() {
            st.status = Status::Fenced;
            return Err(OracleError::Fenced { slot });
        }
        trace(format_args!("raised own slot {slot}: {cur:?} -> {want:?}"));
        st.lease = want;
        st.confirmed_at = posted;
        st.renewed_at = posted;
        st.stats.horizon_raises += 1;
        Ok(())
    }

    /// Keeps the vector moving; call it at least every `tick_interval` (it returns at
    /// once when not due). It renews the lease when due, reads the window at the known
    /// prefix together with the header's hints (one doorbell; a second window past
    /// the end of the vector when the first reaches it), skips this slot's unused
    /// timestamps below the highest decided one it sees, raises the horizon ahead of
    /// need, and, when another slot has stalled the prefix since the previous tick,
    /// checks that slot: a free or fenced slot is skipped for, an owned one whose
    /// lease has not changed for `lease_timeout` is fenced and then skipped for.
    pub fn tick(&self) -> Result<TickReport> {
        let now = self.clock.now();
        let mut report = TickReport {
            prefix: self.st.borrow().known,
            ..TickReport::default()
        };
        if now < self.st.borrow().next_tick {
            return Ok(report);
        }
        report.ran = true;
        self.st.borrow_mut().next_tick = now + self.config.tick_interval;
        let active = self.active().is_ok();
        if active
            && now.saturating_sub(self.st.borrow().renewed_at) >= self.config.lease_timeout / 4
        {
            self.renew()?;
        }
        let s = self.layout.slots() as u64;
        // A few windows at most: more only while this slot itself was the stall, or to
        // catch up with the hint.
        for _ in 0..4 {
            let start = self.st.borrow().known;
            let obs = self.observe(start)?;
            if obs.hint > start {
                let mut st = self.st.borrow_mut();
                st.known = st.known.max(obs.hint);
                continue;
            }
            let Some(gap) = obs.gap else {
                let mut st = self.st.borrow_mut();
                st.known = st.known.max(obs.end);
                continue;
            };
            {
                let mut st = self.st.borrow_mut();
                st.known = st.known.max(gap);
            }
            // Deciding anything at or beyond gap + V/2 would break the wrap margin.
            let reach_end = self.margin_base(&self.st.borrow(), gap) + self.reach();
            let far = Some(obs.far).filter(|&f| f > gap);
            let Some(frontier) = obs
                .frontier
                .filter(|&f| f > gap)
                .max(far)
                .map(|f| f.min(reach_end - 1))
            else {
                // Nothing decided beyond the gap: nobody waits for it.
                self.st.borrow_mut().last_gap = Some(gap);
                break;
            };
            let (me, inherited_below) = {
                let st = self.st.borrow();
                (st.slot as u64, st.inherited_below)
            };
            let owner = gap % s;
            let mut progressed = false;
            if active {
                let skipped = self.skip_own(frontier)?;
                report.skipped_own += skipped;
                progressed |= skipped > 0 && owner == me;
                if owner == me && gap < inherited_below {
                    let upto = frontier.min(inherited_below - 1).min(obs.covered_end - 1);
                    let skipped = self.cas_skip(gap, upto, &obs)?;
                    report.skipped_own += skipped;
                    self.st.borrow_mut().stats.skipped += skipped;
                    progressed |= skipped > 0;
                }
            }
            let stuck = self.st.borrow().last_gap == Some(gap);
            self.st.borrow_mut().last_gap = Some(gap);
            // A slot known to be free or fenced is skipped for at once; an owned one
            // only once it stalled the prefix at two ticks in a row.
            let known_free = self.st.borrow().known_free(owner as u32);
            if (stuck || known_free) && (!active || owner != me) {
                let (fenced, skipped) = self.unstall(owner as u32, gap, frontier, &obs, now)?;
                if report.fenced.is_none()
                    && let Some((slot, lease)) = fenced
                {
                    report.fenced = Some(slot);
                    report.fenced_lease = Some(lease);
                }
                report.skipped_for_others += skipped;
            }
            if !progressed {
                break;
            }
        }
        if report.fenced.is_none()
            && let Some((slot, lease)) = self.check_suspect(now)?
        {
            report.fenced = Some(slot);
            report.fenced_lease = Some(lease);
        }
        self.publish_hints()?;
        if active {
            let (cursor, horizon) = {
                let st = self.st.borrow();
                (st.cursor, st.lease.horizon * BLOCK)
            };
            if horizon.saturating_sub(cursor) < self.reserve_ts() / 2 {
                self.raise_horizon(cursor)?;
            }
        }
        report.prefix = self.st.borrow().known;
        Ok(report)
    }

    /// Reads the header's hints and the window at `start` in one doorbell, plus the
    /// start of the next round when the window reaches the end of the vector (so that
    /// timestamps just past the wrap count as seen).
    fn observe(&self, start: u64) -> Result<Observation> {
        let v = self.layout.bits();
        let max_words = self.window_words();
        let (w0, n1) = cells::window_words(v, start, max_words);
        let wraps = w0 + n1 == self.layout.words();
        let n2 = if wraps { max_words.min(w0 + 1) } else { 0 };
        let ops = [
            Op::Read {
                remote: OFF_PREFIX_HINT,
                words: 2,
            },
            Op::Read {
                remote: self.layout.word_offset(w0),
                words: n1 as u32,
            },
            Op::Read {
                remote: self.layout.word_offset(0),
                words: n2 as u32,
            },
        ];
        let nops = if wraps { 3 } else { 2 };
        let mut out = vec![0u64; 2 + (n1 + n2) as usize];
        self.link.run(&ops[..nops], &mut out)?;
        let words = out.split_off(2);
        let scan1 = cells::scan(v, start, &words[..n1 as usize]);
        self.note_window(n1);
        let (gap, frontier, covered_end) = if wraps {
            self.note_window(n2);
            let scan2 =
                cells::scan_until(v, scan1.end, &words[n1 as usize..], start + self.reach());
            (
                scan1.gap.or(scan2.gap),
                scan1.frontier.max(scan2.frontier),
                scan2.end,
            )
        } else {
            (scan1.gap, scan1.frontier, scan1.end)
        };
        let mut st = self.st.borrow_mut();
        st.hint_seen = st.hint_seen.max(out[0]);
        st.far_seen = st.far_seen.max(out[1]);
        Ok(Observation {
            hint: out[0],
            far: out[1],
            gap,
            frontier,
            end: scan1.end,
            covered_end,
            w0,
            n1,
            words,
        })
    }

    /// Decides, unused, this slot's timestamps from the cursor up to `frontier` (a
    /// timestamp another slot already decided or holds): one FETCH_ADD per word.
    fn skip_own(&self, frontier: u64) -> Result<u64> {
        let (cursor, horizon) = {
            let st = self.st.borrow();
            (st.cursor, st.lease.horizon * BLOCK)
        };
        if frontier < cursor {
            return Ok(0);
        }
        if frontier >= horizon {
            self.raise_horizon(frontier)?;
        }
        let _inside = self.lease_guard()?;
        let s = self.layout.slots() as u64;
        let v = self.layout.bits();
        // The caller keeps the frontier below the known prefix + V/2: the wrap margin
        // holds for every timestamp skipped.
        let masks = cells::own_masks(v, s, cursor, frontier);
        trace(format_args!(
            "skip_own slot {}: {cursor} to {frontier}",
            self.st.borrow().slot
        ));
        self.post_decisions(&masks, "skip_own")?;
        let count = masks.iter().map(|&(_, m, _)| m.count_ones() as u64).sum();
        let mut st = self.st.borrow_mut();
        st.cursor = cursor + count * s;
        st.stats.skipped += count;
        Ok(count)
    }

    /// Looks at `owner`, whose timestamp `gap` has stalled the prefix since the last
    /// tick: skips for it if it is free or fenced, fences it if its lease has not
    /// changed for `lease_timeout` of our clock.
    fn unstall(
        &self,
        owner: u32,
        gap: u64,
        frontier: u64,
        obs: &Observation,
        now: Duration,
    ) -> Result<(Option<(u32, Lease)>, u64)> {
        let mut entry = [0u64; 2];
        self.link
            .read(self.layout.lease_offset(owner), &mut entry)?;
        let (word, beat) = (entry[0], entry[1]);
        let lease = Lease::decode(word)?;
        let stale = !self.st.borrow().known_free(owner) && lease.state != SlotState::Owned;
        self.st.borrow_mut().note_lease(owner, word);
        if stale {
            self.refresh_leases()?;
        }
        let mut fenced = None;
        let lease = match lease.state {
            SlotState::Free | SlotState::Fenced => lease,
            SlotState::Owned => {
                match self.fence_if_lapsed(owner, word, beat, now, |st| &mut st.watch)? {
                    Some(taken) => {
                        fenced = Some((owner, taken));
                        taken
                    }
                    None => return Ok((None, 0)),
                }
            }
        };
        let skipped = self.skip_for(owner, lease, gap, frontier, obs)?;
        Ok((fenced, skipped))
    }

    /// Fences `owner`'s owned slot, whose lease entry was just read as `word` and
    /// `beat`, once the same entry was seen `lease_timeout` apart in the watch
    /// `watch` picks (a live holder renews its heartbeat well within that). The fence
    /// takes two steps: the heartbeat against the value watched, so that a renewal
    /// since then wins instead, then the lease, which tells skippers and claimers the
    /// slot is up for grabs. Returns the lease the fence left.
    fn fence_if_lapsed(
        &self,
        owner: u32,
        word: u64,
        beat: u64,
        now: Duration,
        watch: fn(&mut State) -> &mut Option<Watch>,
    ) -> Result<Option<Lease>> {
        if beat & BEAT_FENCED == 0 {
            let mut st = self.st.borrow_mut();
            let w = watch(&mut st);
            match *w {
                Some(seen) if seen.slot == owner && seen.lease == word && seen.beat == beat => {
                    if now.saturating_sub(seen.since) < self.config.lease_timeout {
                        return Ok(None);
                    }
                }
                _ => {
                    *w = Some(Watch {
                        slot: owner,
                        lease: word,
                        beat,
                        since: now,
                    });
                    return Ok(None);
                }
            }
            *w = None;
        }
        self.fence(owner, word, beat)
    }

    /// Fences `owner`'s slot, whose lease entry was read as `word` and `beat`, now
    /// (the caller saw it unchanged for the lease timeout): see
    /// [`SlotHandle::fence_if_lapsed`]. Returns the lease the fence left.
    fn fence(&self, owner: u32, word: u64, beat: u64) -> Result<Option<Lease>> {
        let lease = Lease::decode(word)?;
        if beat & BEAT_FENCED == 0 {
            let off = self.layout.heartbeat_offset(owner);
            if self.link.cas(off, beat, beat | BEAT_FENCED)? != beat {
                return Ok(None);
            }
        }
        // The holder cannot renew any more, but it may still be posting under a lease
        // check it passed; if it is in this process, wait for that (a later tick
        // comes back here: the heartbeat shows the fence begun).
        let gates = self.st.borrow().gates.clone();
        if let Some(gates) = gates
            && !gates.close(owner, lease.tag)
        {
            self.st.borrow_mut().stats.fences_waited += 1;
            return Ok(None);
        }
        // Also finishes a fencer that stopped after the heartbeat.
        let taken = Lease {
            state: SlotState::Fenced,
            tag: lease.next_tag(),
            horizon: lease.horizon,
        };
        let old = self
            .link
            .cas(self.layout.lease_offset(owner), word, taken.encode())?;
        if old != word {
            self.st.borrow_mut().note_lease(owner, old);
            return Ok(None);
        }
        trace(format_args!("fenced slot {owner}: {lease:?} -> {taken:?}"));
        let mut st = self.st.borrow_mut();
        st.stats.fences += 1;
        st.note_lease(owner, taken.encode());
        if let Some(gates) = &st.gates {
            gates.forget(owner, lease.tag);
        }
        Ok(Some(taken))
    }

    /// Asks the next ticks to check whether `slot`'s holder is alive, and to fence its
    /// slot if its lease lapsed, as they do for a slot that stalls the prefix. For a
    /// holder found by what it left rather than by the prefix: a reader waiting on a
    /// lock whose holder died must not wait for someone to commit, since a read-only
    /// workload decides no timestamp, and the prefix never stalls on the dead slot.
    pub fn suspect(&self, slot: u32) {
        let mut st = self.st.borrow_mut();
        if slot < self.layout.slots() && !(st.status == Status::Active && st.slot == slot) {
            st.suspect = Some(slot);
        }
    }

    /// The tick's check of a suspect ([`SlotHandle::suspect`]): the slot fenced, if it
    /// was; a suspect found free, fenced or alive is dropped.
    fn check_suspect(&self, now: Duration) -> Result<Option<(u32, Lease)>> {
        let Some(owner) = self.st.borrow().suspect else {
            return Ok(None);
        };
        let mut entry = [0u64; 2];
        self.link
            .read(self.layout.lease_offset(owner), &mut entry)?;
        let (word, beat) = (entry[0], entry[1]);
        self.st.borrow_mut().note_lease(owner, word);
        let alive_since_watched = self
            .st
            .borrow()
            .suspect_watch
            .is_some_and(|w| w.slot == owner && (w.lease != word || w.beat != beat));
        if Lease::decode(word)?.state != SlotState::Owned || alive_since_watched {
            let mut st = self.st.borrow_mut();
            st.suspect = None;
            st.suspect_watch = None;
            return Ok(None);
        }
        let fenced = self.fence_if_lapsed(owner, word, beat, now, |st| &mut st.suspect_watch)?;
        if fenced.is_some() {
            let mut st = self.st.borrow_mut();
            st.suspect = None;
            st.suspect_watch = None;
        }
        Ok(fenced.map(|lease| (owner, lease)))
    }

    /// Decides, for a free or fenced slot, its undecided timestamps from `gap` to
    /// `frontier`, with CAS per word: unlike FETCH_ADD, a CAS that lost a race
    /// changes nothing, so any number of nodes may do this at once. The slot's
    /// horizon bounds it, so that a node claiming the slot meanwhile (which starts at
    /// the horizon) never shares a timestamp with us; it is raised first if needed.
    fn skip_for(
        &self,
        owner: u32,
        mut lease: Lease,
        gap: u64,
        frontier: u64,
        obs: &Observation,
    ) -> Result<u64> {
        let off = self.layout.lease_offset(owner);
        if frontier >= lease.horizon * BLOCK {
            let raised = Lease {
                horizon: (frontier + 1).div_ceil(BLOCK).min(MAX_HORIZON),
                ..lease
            };
            let old = self.link.cas(off, lease.encode(), raised.encode())?;
            if old != lease.encode() {
                self.st.borrow_mut().note_lease(owner, old);
                return Ok(0);
            }
            self.st.borrow_mut().note_lease(owner, raised.encode());
            trace(format_args!(
                "raised stalling slot {owner}: {lease:?} -> {raised:?}"
            ));
            lease = raised;
        }
        let upto = frontier
            .min(lease.horizon * BLOCK - 1)
            .min(obs.covered_end - 1);
        let skipped = self.cas_skip(gap, upto, obs)?;
        self.st.borrow_mut().stats.skipped_for_others += skipped;
        Ok(skipped)
    }

    /// Decides the undecided timestamps of `from`'s slot in `[from, upto]`, all inside
    /// what `obs` read, with one CAS per word (retried a few times when other bits of
    /// the word change meanwhile).
    fn cas_skip(&self, from: u64, upto: u64, obs: &Observation) -> Result<u64> {
        if upto < from {
            return Ok(0);
        }
        let v = self.layout.bits();
        let s = self.layout.slots() as u64;
        let mut skipped = 0;
        for (w, mask, odd) in cells::own_masks(v, s, from, upto) {
            let Some(mut cur) = obs.word(w) else {
                continue;
            };
            for _ in 0..4 {
                let undecided = mask & !cells::decided_bits(cur, odd);
                if undecided == 0 {
                    break;
                }
                let next = cur ^ undecided;
                let old = self.link.cas(self.layout.word_offset(w), cur, next)?;
                if old == cur {
                    trace(format_args!(
                        "skipped slot of {from} to {upto}: word {w} mask {undecided:#x} (was {cur:#x})"
                    ));
                    skipped += undecided.count_ones() as u64;
                    break;
                }
                cur = old;
            }
        }
        Ok(skipped)
    }

    /// Publishes, with CAS so that they only grow: the known prefix once it is a tenth
    /// of a round ahead of the header's (new handles start scanning from it, and a
    /// handle that fell behind catches up from it); and, in the far hint, a timestamp
    /// other slots' ticks would not see in their first window but should skip up to:
    /// this slot's highest decision when it lies beyond that window, or its cursor
    /// while the wrap margin blocks it (a holder that claimed a slot far ahead waits
    /// for the others to skip up to it, and they would not know to otherwise).
    fn publish_hints(&self) -> Result<()> {
        let (known, highest, cursor) = {
            let st = self.st.borrow();
            (st.known, st.highest_marked, st.cursor)
        };
        self.publish_prefix_hint()?;
        let window_ts = self.window_words() * 64;
        if highest >= known + window_ts {
            self.announce_far(highest)?;
        }
        let base = self.margin_base(&self.st.borrow(), known);
        if self.active().is_ok() && cursor >= base + self.reach() {
            self.announce_blocked(cursor)?;
        }
        Ok(())
    }

    /// Announces `cursor`, blocked by the wrap margin, as the far hint — only while it
    /// is where this holder started: a node that claimed a slot far ahead needs the
    /// others to skip up to it. A holder that got ahead by skipping (a tick or a read
    /// skipped its cursor up to the far hint or the frontier) must not: every other
    /// holder would skip up to it in turn and be blocked there too, a ratchet that
    /// kept all holders at the wrap edge and the prefix V/2 behind their commits.
    fn announce_blocked(&self, cursor: u64) -> Result<()> {
        let fresh = {
            let st = self.st.borrow();
            st.cursor == st.inherited_below && cursor == st.cursor
        };
        if fresh {
            self.announce_far(cursor)?;
        }
        Ok(())
    }

    /// Publishes the known prefix as the prefix hint (CAS, so it only grows) once it is
    /// a tenth of a round ahead of the hint last seen.
    fn publish_prefix_hint(&self) -> Result<()> {
        let (known, hint) = {
            let st = self.st.borrow();
            (st.known, st.hint_seen)
        };
        if known > hint && known - hint >= (self.layout.bits() / 10).max(1) {
            let old = self.link.cas(OFF_PREFIX_HINT, hint, known)?;
            let mut st = self.st.borrow_mut();
            st.hint_seen = st.hint_seen.max(if old == hint { known } else { old });
        }
        Ok(())
    }

    /// Raises the far hint to `ts` unless it is there already.
    fn announce_far(&self, ts: u64) -> Result<()> {
        let mut far = self.st.borrow().far_seen;
        for _ in 0..4 {
            if far >= ts {
                break;
            }
            let old = self.link.cas(OFF_FAR_HINT, far, ts)?;
            far = if old == far { ts } else { old };
        }
        self.st.borrow_mut().far_seen = far;
        Ok(())
    }

    /// Gives the slot up: every handed-out timestamp must be marked. The slot becomes
    /// free with its horizon at this handle's cursor: others may skip its unused
    /// timestamps from there, and its next holder starts there.
    pub fn release(&self) -> Result<()> {
        self.active()?;
        let (slot, cur, cursor, outstanding) = {
            let st = self.st.borrow();
            (st.slot, st.lease, st.cursor, st.pending.len())
        };
        if outstanding > 0 {
            return Err(OracleError::Outstanding { count: outstanding });
        }
        let free = Lease {
            state: SlotState::Free,
            tag: cur.next_tag(),
            horizon: cursor.div_ceil(BLOCK).min(MAX_HORIZON),
        };
        let old = self
            .link
            .cas(self.layout.lease_offset(slot), cur.encode(), free.encode())?;
        let mut st = self.st.borrow_mut();
        if old != cur.encode() {
            st.status = Status::Fenced;
            return Err(OracleError::Fenced { slot });
        }
        trace(format_args!("released slot {slot}: {cur:?} -> {free:?}"));
        st.status = Status::Released;
        if let Some(gates) = &st.gates {
            gates.forget(slot, cur.tag);
        }
        st.gate = None;
        // Others may skip for the slot now, and so may this handle.
        st.note_lease(slot, free.encode());
        Ok(())
    }

    /// The remote region this handle talks to (the oracle starts at the `base` it was
    /// registered with).
    pub fn oracle(&self) -> RemoteRegion {
        self.link.remote()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// The word-at-a-time rule allows exactly the candidates below their slot's
        /// CAS bound, for slot counts below and above a word's 64 bits.
        #[test]
        fn below_cas_bounds_matches_cas_bound_per_timestamp(
            slots in 1u32..200,
            word in 0u64..48,
            candidates in any::<u64>(),
            horizons in proptest::collection::vec((0u8..3, 0u64..40), 200),
        ) {
            let layout = Layout::new(64 * 64, slots).unwrap();
            let mut st = State::unclaimed(&[0; HEADER_WORDS], layout);
            for (slot, lease) in st.leases.iter_mut().enumerate() {
                let (state, horizon) = horizons[slot];
                lease.state = match state {
                    0 => SlotState::Free,
                    1 => SlotState::Owned,
                    _ => SlotState::Fenced,
                };
                lease.horizon = horizon;
            }
            let base = word * 64;
            let want = (0..64u64)
                .filter(|&b| candidates & (1 << b) != 0)
                .filter(|&b| base + b < st.cas_bound(((base + b) % u64::from(slots)) as u32))
                .fold(0u64, |m, b| m | 1 << b);
            prop_assert_eq!(st.below_cas_bounds(base, candidates), want);
        }
    }
}
