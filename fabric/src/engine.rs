//! The queue-pair engine of the backends that execute work requests on the posting
//! thread (sim, shm).
//!
//! It owns everything a queue pair means that does not depend on where the peer is:
//! the state machine, send-queue depth and selective signaling, the RNR backlog and its
//! retries, error completions and flushes, posted receives and delivery into them. A
//! [`Transport`] supplies the rest: how one work request reaches the peer (where a
//! remote region is, how a message gets into the peer's receive queue) and what, if
//! anything, arrives only when the queue pair is polled.
//!
//! Lock order: a queue pair's send side before any receive side; completion-queue
//! locks last. No thread ever holds two send sides, so posting in both directions at
//! once cannot deadlock.

use crate::addr::{Access, LocalBuf, NodeId, QpEndpoint, UdDest};
use crate::cq::{CqEntry, CqInner, Progress, SoftCq};
use crate::device::{QpConfig, QpKind, QueuePair};
use crate::error::{FabricError, QpState, Result, WcStatus};
use crate::memory;
use crate::registry::{self, RegEntry, Registry};
use crate::sync::{self, AtomicU8, AtomicU32, AtomicU64, Mutex, Ordering};
use crate::validate::validate;
use crate::wr::{Completion, GRH_BYTES, RecvWr, SendWr, Src, WcOpcode, WrOp};
use std::collections::VecDeque;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

pub(crate) const INIT: u8 = 0;
pub(crate) const READY: u8 = 1;
pub(crate) const ERROR: u8 = 2;
pub(crate) const DESTROYED: u8 = 3;

pub(crate) fn state_of(raw: u8) -> QpState {
    match raw {
        INIT => QpState::Init,
        READY => QpState::Ready,
        _ => QpState::Error,
    }
}

/// The limits a queue pair was created with.
pub(crate) struct Caps {
    pub(crate) max_send_wr: u32,
    pub(crate) max_recv_wr: u32,
    pub(crate) max_inline: u32,
    pub(crate) rnr_retry: u8,
    pub(crate) rnr_timer: Duration,
    pub(crate) transport_timeout: Duration,
    pub(crate) qkey: u32,
}

impl Caps {
    /// Checks a configuration as `ibv_create_qp` would.
    pub(crate) fn of(config: &QpConfig) -> Result<Caps> {
        if config.rnr_retry > 7 {
            return Err(FabricError::InvalidWorkRequest(format!(
                "rnr_retry is 0..=7, got {}",
                config.rnr_retry
            )));
        }
        if config.max_send_wr == 0 || config.max_recv_wr == 0 {
            return Err(FabricError::InvalidWorkRequest(
                "queue depths must be at least 1".into(),
            ));
        }
        if config.transport_timeout.is_zero() {
            return Err(FabricError::InvalidWorkRequest(
                "the transport timeout must be more than zero".into(),
            ));
        }
        Ok(Caps {
            max_send_wr: config.max_send_wr,
            max_recv_wr: config.max_recv_wr,
            max_inline: config.max_inline,
            rnr_retry: config.rnr_retry,
            rnr_timer: config.rnr_timer,
            transport_timeout: config.transport_timeout,
            qkey: config.qkey,
        })
    }
}

/// What every software backend's `create_qp` starts from: the queue pair's completion
/// queues, its checked limits and a fresh endpoint.
pub(crate) struct NewQp {
    pub(crate) endpoint: QpEndpoint,
    pub(crate) kind: QpKind,
    pub(crate) caps: Caps,
    pub(crate) send_cq: Arc<CqInner>,
    pub(crate) recv_cq: Arc<CqInner>,
}

impl NewQp {
    /// Checks `config` and numbers the queue pair from `next_qpn`.
    pub(crate) fn prepare(config: &QpConfig, node: NodeId, next_qpn: &AtomicU32) -> Result<NewQp> {
        let send_cq = SoftCq::inner_of(&config.send_cq)?;
        let recv_cq = SoftCq::inner_of(&config.recv_cq)?;
        let caps = Caps::of(config)?;
        let qpn = next_qpn.fetch_add(1, Ordering::Relaxed);
        Ok(NewQp {
            endpoint: QpEndpoint { node, qpn },
            kind: config.kind,
            caps,
            send_cq,
            recv_cq,
        })
    }

    /// UD queue pairs are ready at once; RC ones once connected.
    pub(crate) fn initial_state(&self) -> u8 {
        if self.kind == QpKind::Ud { READY } else { INIT }
    }
}

/// What a backend adds to the engine. One value per queue pair.
pub(crate) trait Transport: Send + Sync + Sized + 'static {
    /// The connected peer of an RC queue pair.
    type Peer: Send;
    /// The backend's part of a queue pair's send side (caches, random source, …).
    type SendState: Send;
    /// The backend's part of a queue pair's receive side.
    type RecvState: Send;

    /// The local regions, where lkeys resolve.
    fn registry(&self) -> &Registry;
    fn peer_node(peer: &Self::Peer) -> NodeId;
    /// Resolves the peer an RC queue pair connects to.
    fn connect(&self, qp: &Qp<Self>, to: QpEndpoint) -> Result<Self::Peer>;
    /// Rejects at post time what only the backend can judge (e.g. an unknown UD peer).
    fn check_post(&self, _wr: &SendWr<'_>) -> Result<()> {
        Ok(())
    }
    /// Executes one send work request of a queue pair that is up.
    fn execute(
        &self,
        qp: &Qp<Self>,
        side: &mut SendSide<Self>,
        wr: &SendWr<'_>,
        visible: Option<Instant>,
    ) -> Result<u32, Fail>;
    /// Starts loading the responder's memory that `wr` will touch (a hint; it may do
    /// nothing), for each work request of a doorbell before any runs: their cache
    /// misses then overlap instead of each waiting on the one before, as an RNIC has
    /// several requests in flight. `wr` is not validated yet.
    fn prefetch(&self, _side: &mut SendSide<Self>, _wr: &SendWr<'_>) {}
    /// Called before a `post_send`'s work requests execute, and [`Transport::end_post`]
    /// after them, under the send lock: what a transport holds across one doorbell
    /// (shm: one entry into the peer's memory).
    fn begin_post(&self, _side: &mut SendSide<Self>) {}
    fn end_post(&self, _side: &mut SendSide<Self>) {}
    /// When the completion of `wr`, posted now, becomes visible: `None` for at once.
    fn visible_at(&self, _state: &mut Self::SendState, _wr: &SendWr<'_>) -> Option<Instant> {
        None
    }
    /// Delivers whatever has arrived for the queue pair; returns whether a poller (see
    /// `CqInner::add_poller`) must keep polling it.
    fn progress_recv(&self, qp: &Qp<Self>, rq: &mut RecvSide<Self>) -> bool;
    /// Called before the queue pair enters the error state and flushes its receives:
    /// messages already accepted for it are delivered first.
    fn settle(&self, _qp: &Qp<Self>, _rq: &mut RecvSide<Self>) {}
    /// A receive was appended to the receive queue (its last entry).
    fn receive_posted(&self, _rq: &mut RecvSide<Self>) {}
    /// Every posted receive was flushed.
    fn receives_flushed(&self, _rq: &mut RecvSide<Self>) {}
    /// The queue pair's state changed.
    fn state_changed(&self, _state: u8) {}
    /// Whether the queue pair may leave the error state towards `peer`.
    fn recover(&self, _peer: Option<&mut Self::Peer>) -> Result<()> {
        Ok(())
    }
    /// The queue pair is gone: forget it.
    fn destroyed(&self, qp: &Qp<Self>);
}

/// Why a work request did not complete successfully.
pub(crate) enum Fail {
    Status(WcStatus),
    /// A SEND or WRITE_WITH_IMM found no posted receive: RNR, retry later.
    NotReady,
    /// The way to the peer is momentarily full (a shared-memory ring): retry later,
    /// without counting against the RNR budget.
    #[cfg_attr(fabric_loom, allow(dead_code))] // only shm's rings fill up
    Busy,
}

impl From<WcStatus> for Fail {
    fn from(s: WcStatus) -> Fail {
        Fail::Status(s)
    }
}

/// What a message delivery found at the receiver.
pub(crate) enum Delivery {
    Delivered,
    NoReceive,
    TooSmall,
    ReceiverDown,
}

/// The bytes of a message.
pub(crate) enum Payload<'a> {
    /// A slice of word memory: a registered region or a ring.
    Words {
        words: &'a [AtomicU64],
        offset: u64,
        len: u32,
    },
    Bytes(&'a [u8]),
    /// A message of this length that did not travel, because the sender already knew
    /// the receive buffer was too small for it.
    #[cfg_attr(fabric_loom, allow(dead_code))] // only shm's rings carry such notices
    Absent(u32),
    /// A message of this length that the sender already placed in the receive buffer.
    #[cfg_attr(fabric_loom, allow(dead_code))] // only shm places messages directly
    Placed(u32),
}

impl Payload<'_> {
    pub(crate) fn len(&self) -> u32 {
        match self {
            Payload::Words { len, .. } | Payload::Absent(len) | Payload::Placed(len) => *len,
            Payload::Bytes(b) => b.len() as u32,
        }
    }

    /// Copies the payload to `offset` of `dst`.
    pub(crate) fn copy_to(&self, dst: &[AtomicU64], offset: u64) {
        match self {
            Payload::Words {
                words,
                offset: from,
                len,
            } => memory::copy_between(words, *from, dst, offset, *len as u64),
            Payload::Bytes(b) => memory::copy_in(dst, offset, b),
            Payload::Absent(_) | Payload::Placed(_) => {}
        }
    }

    pub(crate) fn to_vec(&self) -> Vec<u8> {
        match self {
            Payload::Words { words, offset, len } => {
                let mut v = vec![0; *len as usize];
                memory::copy_out(words, *offset, &mut v);
                v
            }
            Payload::Bytes(b) => b.to_vec(),
            Payload::Absent(_) | Payload::Placed(_) => Vec::new(),
        }
    }
}

/// The payload of a SEND or WRITE: a checked local buffer, or inline data.
pub(crate) fn payload_of<'c>(
    cache: &'c mut KeyCache,
    registry: &Registry,
    src: Src<'c>,
) -> Result<Payload<'c>, WcStatus> {
    Ok(match src {
        Src::Buf(b) => Payload::Words {
            words: local(cache, registry, b, false)?.mem.words(),
            offset: b.offset,
            len: b.len,
        },
        Src::Inline(data) => Payload::Bytes(data),
    })
}

pub(crate) fn in_bounds(len: u64, offset: u64, n: u64) -> bool {
    offset.checked_add(n).is_some_and(|end| end <= len)
}

/// Resolves a local buffer, as the NIC checks an lkey.
pub(crate) fn local<'c>(
    cache: &'c mut KeyCache,
    registry: &Registry,
    buf: LocalBuf,
    write: bool,
) -> Result<&'c RegEntry, WcStatus> {
    let region = cache
        .get(buf.lkey, registry)
        .ok_or(WcStatus::LocalProtection)?;
    if !in_bounds(region.len, buf.offset, buf.len as u64)
        || (write && !region.access.contains(Access::LOCAL_WRITE))
    {
        return Err(WcStatus::LocalProtection);
    }
    Ok(region)
}

/// The word an atomic targets in checked remote memory: 8-byte aligned, or it is a
/// remote access error.
pub(crate) fn atomic_word(words: &[AtomicU64], offset: u64) -> Result<&AtomicU64, WcStatus> {
    if !offset.is_multiple_of(8) {
        return Err(WcStatus::RemoteAccess);
    }
    Ok(&words[(offset / 8) as usize])
}

/// Executes the CAS or FETCH_ADD `op` on `word` and lands the old value at `offset` of
/// `result` (a checked local buffer). Returns the completion's byte count.
pub(crate) fn apply_atomic(op: &WrOp<'_>, word: &AtomicU64, result: &RegEntry, offset: u64) -> u32 {
    let old = match *op {
        WrOp::Cas { compare, swap, .. } => {
            match word.compare_exchange(compare, swap, Ordering::AcqRel, Ordering::Acquire) {
                Ok(old) | Err(old) => old,
            }
        }
        WrOp::FetchAdd { add, .. } => word.fetch_add(add, Ordering::AcqRel),
        _ => unreachable!("only atomics reach apply_atomic"),
    };
    memory::copy_in(result.mem.words(), offset, &old.to_le_bytes());
    8
}

/// A few recently used regions, so the common case resolves a key without touching
/// the shared region table. A hit is checked against the entry's `live` flag, so a
/// deregistered region is never used through the cache.
#[derive(Default)]
pub(crate) struct KeyCache {
    entries: [Option<Arc<RegEntry>>; 4],
    victim: usize,
}

impl KeyCache {
    pub(crate) fn get(&mut self, key: u32, registry: &Registry) -> Option<&RegEntry> {
        let hit = self
            .entries
            .iter()
            .position(|e| e.as_ref().is_some_and(|e| e.key == key));
        let index = match hit {
            Some(i) if self.entries[i].as_ref()?.live.load(Ordering::Acquire) => i,
            Some(i) => {
                self.entries[i] = None;
                return None;
            }
            None => {
                let entry = registry::lookup(registry, key)?;
                let i = self.victim;
                self.victim = (self.victim + 1) % self.entries.len();
                self.entries[i] = Some(entry);
                i
            }
        };
        self.entries[index].as_deref()
    }
}

/// A receive-queue completion as a completion queue takes it.
pub(crate) fn recv_entry(wc: Completion, visible_at: Option<Instant>) -> CqEntry {
    CqEntry {
        wc,
        retires: 0,
        send_queue: None,
        visible_at,
    }
}

/// The completion of a receive flushed by the error state.
pub(crate) fn flushed_receive(wr_id: u64, qpn: u32) -> CqEntry {
    recv_entry(
        Completion {
            wr_id,
            status: WcStatus::WrFlush,
            opcode: WcOpcode::Recv,
            qpn,
            ..Completion::default()
        },
        None,
    )
}

/// The completion of a receive consumed by a WRITE_WITH_IMM of `len` bytes.
pub(crate) fn write_imm_completion(
    recv: &PostedRecv,
    len: u32,
    imm: Option<u32>,
    qpn: u32,
    src: QpEndpoint,
) -> Completion {
    Completion {
        wr_id: recv.wr_id,
        status: WcStatus::Success,
        opcode: WcOpcode::RecvWriteImm,
        byte_len: len,
        imm,
        qpn,
        src: Some(src),
    }
}

/// Lands a message in `recv` (behind a zeroed GRH on UD) and returns the receive's
/// completion: `LocalLength`, with nothing written, if the buffer is too small.
pub(crate) fn land(
    recv: &PostedRecv,
    payload: &Payload<'_>,
    imm: Option<u32>,
    qpn: u32,
    src: QpEndpoint,
    ud: bool,
) -> Completion {
    let grh = if ud { GRH_BYTES } else { 0 };
    let needed = payload.len() as u64 + grh as u64;
    let mut wc = Completion {
        wr_id: recv.wr_id,
        status: WcStatus::Success,
        opcode: WcOpcode::Recv,
        byte_len: needed as u32,
        imm,
        qpn,
        src: Some(src),
    };
    if needed > recv.len as u64 || matches!(payload, Payload::Absent(_)) {
        wc.status = WcStatus::LocalLength;
        wc.byte_len = 0;
        return wc;
    }
    if ud {
        memory::copy_in(
            recv.region.mem.words(),
            recv.offset,
            &[0; GRH_BYTES as usize],
        );
    }
    payload.copy_to(recv.region.mem.words(), recv.offset + grh as u64);
    wc
}

/// A send-queue completion; it retires `retires` work requests of `send_queue`.
pub(crate) fn send_entry(
    wc: Completion,
    retires: u32,
    send_queue: &Arc<AtomicU32>,
    visible_at: Option<Instant>,
) -> CqEntry {
    CqEntry {
        wc,
        retires,
        send_queue: Some(send_queue.clone()),
        visible_at,
    }
}

pub(crate) struct PostedRecv {
    pub(crate) wr_id: u64,
    pub(crate) region: Arc<RegEntry>,
    pub(crate) offset: u64,
    pub(crate) len: u32,
}

pub(crate) struct SendSide<T: Transport> {
    pub(crate) peer: Option<T::Peer>,
    /// Work requests waiting behind an RNR-deferred SEND, in posting order.
    backlog: VecDeque<Deferred>,
    /// Work requests posted since the last completion this queue pair generated.
    unretired: u32,
    pub(crate) local_keys: KeyCache,
    pub(crate) state: T::SendState,
    /// Completions of the current batch, pushed to the CQ under one lock.
    completions: Vec<CqEntry>,
}

pub(crate) struct RecvSide<T: Transport> {
    pub(crate) queue: VecDeque<PostedRecv>,
    pub(crate) state: T::RecvState,
}

/// A send work request that could not run yet, with owned inline data.
struct Deferred {
    wr_id: u64,
    signaled: bool,
    op: WrOp<'static>,
    inline: Option<Vec<u8>>,
    dest: Option<UdDest>,
    /// When the receiver was first found not ready; `None` while only busy.
    rnr_since: Option<Instant>,
}

impl Deferred {
    fn new(wr: &SendWr<'_>, rnr_since: Option<Instant>) -> Deferred {
        let (op, inline) = match wr.op {
            WrOp::Write { local, remote, imm } => {
                let (local, inline) = own_src(local);
                (WrOp::Write { local, remote, imm }, inline)
            }
            WrOp::Send { local, imm } => {
                let (local, inline) = own_src(local);
                (WrOp::Send { local, imm }, inline)
            }
            WrOp::Read { local, remote } => (WrOp::Read { local, remote }, None),
            WrOp::Cas {
                local,
                remote,
                compare,
                swap,
            } => (
                WrOp::Cas {
                    local,
                    remote,
                    compare,
                    swap,
                },
                None,
            ),
            WrOp::FetchAdd { local, remote, add } => (WrOp::FetchAdd { local, remote, add }, None),
        };
        Deferred {
            wr_id: wr.wr_id,
            signaled: wr.signaled,
            op,
            inline,
            dest: wr.dest,
            rnr_since,
        }
    }

    fn as_wr(&self) -> SendWr<'_> {
        let with_inline = |local: Src<'static>| match (&self.inline, local) {
            (Some(data), _) => Src::Inline(data.as_slice()),
            (None, l) => l,
        };
        let op = match self.op {
            WrOp::Write { local, remote, imm } => WrOp::Write {
                local: with_inline(local),
                remote,
                imm,
            },
            WrOp::Send { local, imm } => WrOp::Send {
                local: with_inline(local),
                imm,
            },
            other => other,
        };
        SendWr {
            wr_id: self.wr_id,
            op,
            signaled: self.signaled,
            dest: self.dest,
        }
    }
}

fn own_src(src: Src<'_>) -> (Src<'static>, Option<Vec<u8>>) {
    match src {
        Src::Buf(b) => (Src::Buf(b), None),
        Src::Inline(d) => (Src::Inline(&[]), Some(d.to_vec())),
    }
}

/// A queue pair of a software backend.
pub(crate) struct Qp<T: Transport> {
    me: Weak<Qp<T>>,
    pub(crate) transport: T,
    pub(crate) endpoint: QpEndpoint,
    pub(crate) kind: QpKind,
    pub(crate) caps: Caps,
    state: AtomicU8,
    pub(crate) send_cq: Arc<CqInner>,
    pub(crate) recv_cq: Arc<CqInner>,
    /// Send work requests posted and not yet retired by a polled completion.
    sq_outstanding: Arc<AtomicU32>,
    sq: Mutex<SendSide<T>>,
    pub(crate) rq: Mutex<RecvSide<T>>,
}

/// What became of one execution attempt.
enum Outcome {
    Done,
    /// Waits in the backlog; retried on the next poll or post.
    Deferred,
}

impl<T: Transport> Qp<T> {
    pub(crate) fn new(
        transport: T,
        new: NewQp,
        send_state: T::SendState,
        recv_state: T::RecvState,
    ) -> Arc<Qp<T>> {
        let qp = Arc::new_cyclic(|me| Qp {
            me: me.clone(),
            transport,
            state: AtomicU8::new(new.initial_state()),
            endpoint: new.endpoint,
            kind: new.kind,
            caps: new.caps,
            send_cq: new.send_cq,
            recv_cq: new.recv_cq,
            sq_outstanding: Arc::new(AtomicU32::new(0)),
            sq: Mutex::new(SendSide {
                peer: None,
                backlog: VecDeque::new(),
                unretired: 0,
                local_keys: KeyCache::default(),
                state: send_state,
                completions: Vec::new(),
            }),
            rq: Mutex::new(RecvSide {
                queue: VecDeque::new(),
                state: recv_state,
            }),
        });
        qp.transport.state_changed(qp.raw_state());
        qp
    }

    pub(crate) fn raw_state(&self) -> u8 {
        self.state.load(Ordering::Acquire)
    }

    pub(crate) fn is_up(&self) -> bool {
        self.raw_state() == READY
    }

    fn set_state(&self, state: u8) {
        self.state.store(state, Ordering::Release);
        self.transport.state_changed(state);
    }

    /// This queue pair as the CQs' progress hook sees it.
    pub(crate) fn as_progress(&self) -> Option<Arc<dyn Progress>> {
        self.me.upgrade().map(|me| me as Arc<dyn Progress>)
    }

    fn run_backlog(&self, side: &mut SendSide<T>) {
        while let Some(mut deferred) = side.backlog.pop_front() {
            let wr = deferred.as_wr();
            if !self.is_up() {
                self.complete(side, &wr, WcStatus::WrFlush, 0, None);
                continue;
            }
            let visible = self.transport.visible_at(&mut side.state, &wr);
            let result = self.transport.execute(self, side, &wr, visible);
            let rnr_since = match result {
                Err(Fail::NotReady) => Some(deferred.rnr_since.unwrap_or_else(Instant::now)),
                _ => deferred.rnr_since,
            };
            match result {
                Err(Fail::NotReady) if self.rnr_exhausted(rnr_since) => {
                    self.complete(side, &wr, WcStatus::RnrRetryExceeded, 0, visible);
                    self.fail();
                }
                Err(Fail::NotReady | Fail::Busy) => {
                    deferred.rnr_since = rnr_since;
                    side.backlog.push_front(deferred);
                    return;
                }
                done => {
                    self.finish(side, &wr, done, visible);
                }
            }
        }
    }

    fn rnr_exhausted(&self, since: Option<Instant>) -> bool {
        self.caps.rnr_retry < 7
            && since.is_some_and(|since| {
                since.elapsed() >= self.caps.rnr_timer * (self.caps.rnr_retry as u32 + 1)
            })
    }

    /// Records the completion of an executed request: success if signaled, any error.
    fn finish(
        &self,
        side: &mut SendSide<T>,
        wr: &SendWr<'_>,
        result: Result<u32, Fail>,
        visible: Option<Instant>,
    ) {
        match result {
            Ok(byte_len) => {
                if wr.signaled {
                    self.complete(side, wr, WcStatus::Success, byte_len, visible);
                }
            }
            Err(Fail::Status(status)) => {
                self.complete(side, wr, status, 0, visible);
                self.fail();
            }
            Err(Fail::NotReady | Fail::Busy) => unreachable!("deferred by the caller"),
        }
    }

    /// Runs `wr` now, or queues it behind (or as) deferred work.
    fn execute_or_defer(&self, side: &mut SendSide<T>, wr: &SendWr<'_>) -> Outcome {
        if !side.backlog.is_empty() {
            side.backlog.push_back(Deferred::new(wr, None));
            return Outcome::Deferred;
        }
        let visible = self.transport.visible_at(&mut side.state, wr);
        match self.transport.execute(self, side, wr, visible) {
            Err(Fail::NotReady) => {
                side.backlog
                    .push_back(Deferred::new(wr, Some(Instant::now())));
                Outcome::Deferred
            }
            Err(Fail::Busy) => {
                side.backlog.push_back(Deferred::new(wr, None));
                Outcome::Deferred
            }
            done => {
                self.finish(side, wr, done, visible);
                Outcome::Done
            }
        }
    }

    /// Moves the queue pair to the error state and flushes every outstanding work
    /// request: deferred sends (on the next pass of the backlog loop) and receives.
    fn fail(&self) {
        let mut rq = sync::lock(&self.rq);
        self.transport.settle(self, &mut rq);
        if self.raw_state() != DESTROYED {
            self.set_state(ERROR);
        }
        self.flush_receives(&mut rq);
    }

    /// Breaks the queue pair from its receive side (whose lock the caller holds).
    #[cfg_attr(fabric_loom, allow(dead_code))] // used by shm, which loom builds leave out
    pub(crate) fn fail_receiver(&self, rq: &mut RecvSide<T>) {
        if self.raw_state() != DESTROYED {
            self.set_state(ERROR);
        }
        self.flush_receives(rq);
    }

    pub(crate) fn flush_receives(&self, rq: &mut RecvSide<T>) {
        self.transport.receives_flushed(rq);
        for recv in rq.queue.drain(..) {
            self.recv_cq
                .push(flushed_receive(recv.wr_id, self.endpoint.qpn));
        }
    }

    /// Records a completion for `wr`; it retires every work request since the last one.
    fn complete(
        &self,
        side: &mut SendSide<T>,
        wr: &SendWr<'_>,
        status: WcStatus,
        byte_len: u32,
        visible_at: Option<Instant>,
    ) {
        let wc = Completion {
            wr_id: wr.wr_id,
            status,
            opcode: wr.op.opcode(),
            byte_len,
            qpn: self.endpoint.qpn,
            ..Completion::default()
        };
        let entry = send_entry(wc, side.unretired, &self.sq_outstanding, visible_at);
        side.completions.push(entry);
        side.unretired = 0;
    }

    /// Places a message in the next posted receive of this queue pair (the receiver).
    /// A receive too small for it completes with `LocalLength` and breaks the queue pair.
    pub(crate) fn deliver_locked(
        &self,
        rq: &mut RecvSide<T>,
        payload: &Payload<'_>,
        imm: Option<u32>,
        src: QpEndpoint,
        ud: bool,
        visible: Option<Instant>,
    ) -> Delivery {
        if !self.is_up() {
            return Delivery::ReceiverDown;
        }
        let Some(recv) = rq.queue.pop_front() else {
            return Delivery::NoReceive;
        };
        let wc = land(&recv, payload, imm, self.endpoint.qpn, src, ud);
        let landed = wc.status.is_ok();
        self.recv_cq.push(recv_entry(wc, visible));
        if !landed {
            self.set_state(ERROR);
            self.flush_receives(rq);
            return Delivery::TooSmall;
        }
        Delivery::Delivered
    }

    /// Completes `recv` as consumed by a WRITE_WITH_IMM of `len` bytes.
    pub(crate) fn complete_write_imm(
        &self,
        recv: PostedRecv,
        len: u32,
        imm: Option<u32>,
        src: QpEndpoint,
        visible: Option<Instant>,
    ) {
        let wc = write_imm_completion(&recv, len, imm, self.endpoint.qpn, src);
        self.recv_cq.push(recv_entry(wc, visible));
    }

    fn post_send(&self, wrs: &[SendWr<'_>]) -> Result<()> {
        if self.raw_state() == INIT {
            return Err(FabricError::InvalidState {
                state: QpState::Init,
                action: "posting sends before connect",
            });
        }
        let mut guard = sync::lock(&self.sq);
        let side = &mut *guard;
        if !side.backlog.is_empty() {
            self.run_backlog(side);
        }
        let outstanding = self.sq_outstanding.load(Ordering::Acquire);
        let room = self.caps.max_send_wr.saturating_sub(outstanding) as usize;
        let peer = side.peer.as_ref().map(T::peer_node);
        if wrs.len() > 1 && side.backlog.is_empty() && self.is_up() {
            for wr in &wrs[..wrs.len().min(room)] {
                self.transport.prefetch(side, wr);
            }
        }
        let mut result = Ok(());
        let mut posted = 0;
        self.transport.begin_post(side);
        for (index, wr) in wrs.iter().enumerate() {
            let check = if index >= room {
                Err(FabricError::QueueFull {
                    queue: "send",
                    depth: self.caps.max_send_wr,
                })
            } else {
                validate(self.kind, peer, self.caps.max_inline, wr)
                    .and_then(|()| self.transport.check_post(wr))
            };
            if let Err(e) = check {
                result = Err(FabricError::Post {
                    index,
                    source: Box::new(e),
                });
                break;
            }
            posted += 1;
            side.unretired += 1;
            if !self.is_up() {
                self.complete(side, wr, WcStatus::WrFlush, 0, None);
                continue;
            }
            self.execute_or_defer(side, wr);
        }
        self.transport.end_post(side);
        self.sq_outstanding.fetch_add(posted, Ordering::AcqRel);
        self.send_cq.push_many(&mut side.completions);
        let waiting = !side.backlog.is_empty();
        drop(guard);
        if waiting && let Some(me) = self.as_progress() {
            self.send_cq.add_waiting(me);
        }
        result
    }

    fn post_recv(&self, wrs: &[RecvWr]) -> Result<()> {
        let mut rq = sync::lock(&self.rq);
        for (index, wr) in wrs.iter().enumerate() {
            let reject = |e: FabricError| FabricError::Post {
                index,
                source: Box::new(e),
            };
            let region = registry::lookup(self.transport.registry(), wr.buf.lkey)
                .filter(|r| r.live.load(Ordering::Acquire))
                .ok_or_else(|| {
                    reject(FabricError::InvalidWorkRequest(format!(
                        "no registered region with lkey {:#x}",
                        wr.buf.lkey
                    )))
                })?;
            if !in_bounds(region.len, wr.buf.offset, wr.buf.len as u64) {
                return Err(reject(FabricError::OutOfBounds {
                    offset: wr.buf.offset,
                    len: wr.buf.len as u64,
                    region_len: region.len,
                }));
            }
            if !region.access.contains(Access::LOCAL_WRITE) {
                return Err(reject(FabricError::InvalidWorkRequest(
                    "a receive buffer needs LOCAL_WRITE access".into(),
                )));
            }
            if rq.queue.len() >= self.caps.max_recv_wr as usize {
                return Err(reject(FabricError::QueueFull {
                    queue: "receive",
                    depth: self.caps.max_recv_wr,
                }));
            }
            rq.queue.push_back(PostedRecv {
                wr_id: wr.wr_id,
                region,
                offset: wr.buf.offset,
                len: wr.buf.len,
            });
            self.transport.receive_posted(&mut rq);
            if self.raw_state() == ERROR {
                self.flush_receives(&mut rq);
            }
        }
        Ok(())
    }

    fn connect(&self, to: QpEndpoint) -> Result<()> {
        if self.kind != QpKind::Rc {
            return Err(FabricError::InvalidWorkRequest(
                "only RC queue pairs connect".into(),
            ));
        }
        let mut side = sync::lock(&self.sq);
        match self.raw_state() {
            INIT => {}
            s => {
                return Err(FabricError::InvalidState {
                    state: state_of(s),
                    action: "connect (already connected)",
                });
            }
        }
        side.peer = Some(self.transport.connect(self, to)?);
        self.set_state(READY);
        Ok(())
    }

    fn recover(&self) -> Result<()> {
        let mut guard = sync::lock(&self.sq);
        let side = &mut *guard;
        self.run_backlog(side);
        self.send_cq.push_many(&mut side.completions);
        if self.raw_state() == ERROR {
            self.transport.recover(side.peer.as_mut())?;
            let next = if self.kind == QpKind::Ud || side.peer.is_some() {
                READY
            } else {
                INIT
            };
            self.set_state(next);
        }
        Ok(())
    }

    fn destroy(&self) {
        self.set_state(DESTROYED);
        // Drops the peer, so two connected queue pairs do not keep each other alive.
        let peer = sync::lock(&self.sq).peer.take();
        drop(peer);
        self.transport.destroyed(self);
    }
}

impl<T: Transport> Progress for Qp<T> {
    /// Gives waiting work a chance to run: deferred sends retry, and whatever arrived
    /// for the receive side is delivered. Returns whether deferred sends still wait;
    /// arrivals that need polling for good are a poller's business (`poll_arrivals`),
    /// so a queue pair leaves the waiting list once its backlog is gone.
    fn progress(&self) -> bool {
        let mut guard = sync::lock(&self.sq);
        let side = &mut *guard;
        if !side.backlog.is_empty() {
            self.run_backlog(side);
            self.send_cq.push_many(&mut side.completions);
        }
        let waiting = !side.backlog.is_empty();
        drop(guard);
        let mut rq = sync::lock(&self.rq);
        self.transport.progress_recv(self, &mut rq);
        waiting
    }

    fn poll_arrivals(&self) -> bool {
        let mut rq = sync::lock(&self.rq);
        self.transport.progress_recv(self, &mut rq)
    }
}

/// The handle `create_qp` returns. Dropping it destroys the queue pair.
pub(crate) struct QpHandle<T: Transport>(pub(crate) Arc<Qp<T>>);

impl<T: Transport> Drop for QpHandle<T> {
    fn drop(&mut self) {
        self.0.destroy();
    }
}

impl<T: Transport> QueuePair for QpHandle<T> {
    fn endpoint(&self) -> QpEndpoint {
        self.0.endpoint
    }
    fn kind(&self) -> QpKind {
        self.0.kind
    }
    fn state(&self) -> QpState {
        state_of(self.0.raw_state())
    }
    fn connect(&self, peer: QpEndpoint) -> Result<()> {
        self.0.connect(peer)
    }
    fn post_send(&self, wrs: &[SendWr<'_>]) -> Result<()> {
        self.0.post_send(wrs)
    }
    fn send_queue_depth(&self) -> u32 {
        self.0.caps.max_send_wr
    }
    fn post_recv(&self, wrs: &[RecvWr]) -> Result<()> {
        self.0.post_recv(wrs)
    }
    fn recover(&self) -> Result<()> {
        self.0.recover()
    }
}
