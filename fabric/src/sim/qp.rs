//! Queue pairs of the sim backend: where work requests execute.
//!
//! Lock order: a queue pair's send side before any receive side; completion-queue
//! locks last. No thread ever holds two send sides, so posting in both directions at
//! once cannot deadlock.

use super::cost::LatencyClass;
use super::{NetInner, NodeInner};
use crate::addr::{Access, LocalBuf, QpEndpoint, RemoteAddr, UdDest};
use crate::cq::{CqEntry, CqInner, Progress};
use crate::device::{QpConfig, QpKind, QueuePair};
use crate::error::{FabricError, QpState, Result, WcStatus};
use crate::memory;
use crate::registry::RegEntry;
use crate::sync::{self, AtomicU8, AtomicU32, Mutex, MutexGuard, Ordering};
use crate::validate::validate;
use crate::wr::{Completion, GRH_BYTES, RecvWr, SendWr, Src, UD_MTU, WcOpcode, WrOp};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::collections::VecDeque;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

const INIT: u8 = 0;
const READY: u8 = 1;
const ERROR: u8 = 2;
const DESTROYED: u8 = 3;

struct Caps {
    max_send_wr: u32,
    max_recv_wr: u32,
    max_inline: u32,
    rnr_retry: u8,
    rnr_timer: Duration,
    qkey: u32,
}

pub(crate) struct QpInner {
    me: Weak<QpInner>,
    net: Arc<NetInner>,
    node: Arc<NodeInner>,
    endpoint: QpEndpoint,
    kind: QpKind,
    caps: Caps,
    state: AtomicU8,
    send_cq: Arc<CqInner>,
    recv_cq: Arc<CqInner>,
    /// Send work requests posted and not yet retired by a polled completion.
    sq_outstanding: Arc<AtomicU32>,
    sq: Mutex<SendSide>,
    rq: Mutex<RecvSide>,
}

struct Peer {
    node: Arc<NodeInner>,
    qp: Arc<QpInner>,
}

struct SendSide {
    peer: Option<Peer>,
    /// Work requests waiting behind an RNR-deferred SEND, in posting order.
    backlog: VecDeque<Deferred>,
    /// Work requests posted since the last completion this queue pair generated.
    unretired: u32,
    local_keys: KeyCache,
    remote_keys: KeyCache,
    rng: SmallRng,
    last_visible: Option<Instant>,
    /// Completions of the current batch, pushed to the CQ under one lock.
    completions: Vec<CqEntry>,
}

struct PostedRecv {
    wr_id: u64,
    region: Arc<RegEntry>,
    offset: u64,
    len: u32,
}

struct Datagram {
    bytes: Vec<u8>,
    imm: Option<u32>,
    src: QpEndpoint,
}

struct RecvSide {
    queue: VecDeque<PostedRecv>,
    /// A UD datagram held back by reorder injection.
    held: Option<Datagram>,
}

/// A send work request that could not run yet (RNR), with owned inline data.
struct Deferred {
    wr_id: u64,
    signaled: bool,
    op: WrOp<'static>,
    inline: Option<Vec<u8>>,
    dest: Option<UdDest>,
    deadline: Option<Instant>,
}

impl Deferred {
    fn new(wr: &SendWr<'_>, deadline: Option<Instant>) -> Deferred {
        let (op, inline) = match wr.op {
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
            WrOp::Write { local, remote, imm } => {
                let (local, inline) = own_src(local);
                (WrOp::Write { local, remote, imm }, inline)
            }
            WrOp::Send { local, imm } => {
                let (local, inline) = own_src(local);
                (WrOp::Send { local, imm }, inline)
            }
        };
        Deferred {
            wr_id: wr.wr_id,
            signaled: wr.signaled,
            op,
            inline,
            dest: wr.dest,
            deadline,
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

/// A few recently used regions, so the common case resolves a key without touching
/// the shared region table. A hit is checked against the entry's `live` flag, so a
/// deregistered region is never used through the cache.
#[derive(Default)]
struct KeyCache {
    entries: [Option<Arc<RegEntry>>; 4],
    victim: usize,
}

impl KeyCache {
    fn get(&mut self, key: u32, node: &NodeInner) -> Option<&RegEntry> {
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
                let entry = node.region(key)?;
                let i = self.victim;
                self.victim = (self.victim + 1) % self.entries.len();
                self.entries[i] = Some(entry);
                i
            }
        };
        self.entries[index].as_deref()
    }
}

/// What became of a work request.
enum Outcome {
    Done {
        byte_len: u32,
    },
    Failed(WcStatus),
    /// A SEND or WRITE_WITH_IMM found no posted receive: RNR, retry later.
    NotReady,
}

/// Why a work request did not complete successfully.
enum Fail {
    Status(WcStatus),
    /// A SEND or WRITE_WITH_IMM found no posted receive: RNR, retry later.
    NotReady,
}

impl From<WcStatus> for Fail {
    fn from(s: WcStatus) -> Fail {
        Fail::Status(s)
    }
}

/// What a message delivery found at the receiver.
enum Delivery {
    Delivered,
    NoReceive,
    TooSmall,
    ReceiverDown,
}

/// The bytes of a SEND: a slice of a registered region, or inline data.
enum Payload<'a> {
    Region {
        region: &'a RegEntry,
        offset: u64,
        len: u32,
    },
    Bytes(&'a [u8]),
}

impl Payload<'_> {
    fn len(&self) -> u32 {
        match self {
            Payload::Region { len, .. } => *len,
            Payload::Bytes(b) => b.len() as u32,
        }
    }

    fn copy_to(&self, dst: &RegEntry, offset: u64) {
        match self {
            Payload::Region {
                region,
                offset: from,
                len,
            } => memory::copy_between(
                region.mem.words(),
                *from,
                dst.mem.words(),
                offset,
                *len as u64,
            ),
            Payload::Bytes(b) => memory::copy_in(dst.mem.words(), offset, b),
        }
    }

    fn to_vec(&self) -> Vec<u8> {
        match self {
            Payload::Region {
                region,
                offset,
                len,
            } => {
                let mut v = vec![0; *len as usize];
                memory::copy_out(region.mem.words(), *offset, &mut v);
                v
            }
            Payload::Bytes(b) => b.to_vec(),
        }
    }
}

fn payload_of<'c>(
    cache: &'c mut KeyCache,
    node: &NodeInner,
    src: Src<'c>,
) -> Result<Payload<'c>, WcStatus> {
    Ok(match src {
        Src::Buf(b) => Payload::Region {
            region: local(cache, node, b, false)?,
            offset: b.offset,
            len: b.len,
        },
        Src::Inline(data) => Payload::Bytes(data),
    })
}

/// The word a CAS or FETCH_ADD targets: remote-atomic access, 8-byte aligned.
fn atomic_target<'c>(
    cache: &'c mut KeyCache,
    node: &NodeInner,
    addr: RemoteAddr,
) -> Result<&'c crate::sync::AtomicU64, WcStatus> {
    let region = remote(cache, node, addr, 8, Access::REMOTE_ATOMIC)?;
    if !addr.offset.is_multiple_of(8) {
        return Err(WcStatus::RemoteAccess);
    }
    Ok(&region.mem.words()[(addr.offset / 8) as usize])
}

fn in_bounds(region: &RegEntry, offset: u64, len: u64) -> bool {
    offset.checked_add(len).is_some_and(|end| end <= region.len)
}

/// Resolves a local buffer, as the NIC checks an lkey.
fn local<'c>(
    cache: &'c mut KeyCache,
    node: &NodeInner,
    buf: LocalBuf,
    write: bool,
) -> Result<&'c RegEntry, WcStatus> {
    let region = cache.get(buf.lkey, node).ok_or(WcStatus::LocalProtection)?;
    if !in_bounds(region, buf.offset, buf.len as u64)
        || (write && !region.access.contains(Access::LOCAL_WRITE))
    {
        return Err(WcStatus::LocalProtection);
    }
    Ok(region)
}

/// Resolves a remote address at the responder, as the responder's NIC checks an rkey.
fn remote<'c>(
    cache: &'c mut KeyCache,
    node: &NodeInner,
    addr: RemoteAddr,
    len: u64,
    need: Access,
) -> Result<&'c RegEntry, WcStatus> {
    let region = cache.get(addr.rkey, node).ok_or(WcStatus::RemoteAccess)?;
    if !in_bounds(region, addr.offset, len) || !region.access.contains(need) {
        return Err(WcStatus::RemoteAccess);
    }
    Ok(region)
}

impl QpInner {
    pub(crate) fn new(
        net: Arc<NetInner>,
        node: Arc<NodeInner>,
        endpoint: QpEndpoint,
        config: &QpConfig,
        send_cq: Arc<CqInner>,
        recv_cq: Arc<CqInner>,
    ) -> Arc<QpInner> {
        let seed = net.config.seed ^ ((endpoint.node.0 as u64) << 32 | endpoint.qpn as u64);
        Arc::new_cyclic(|me| QpInner {
            me: me.clone(),
            net,
            node,
            endpoint,
            kind: config.kind,
            caps: Caps {
                max_send_wr: config.max_send_wr,
                max_recv_wr: config.max_recv_wr,
                max_inline: config.max_inline,
                rnr_retry: config.rnr_retry,
                rnr_timer: config.rnr_timer,
                qkey: config.qkey,
            },
            state: AtomicU8::new(if config.kind == QpKind::Ud {
                READY
            } else {
                INIT
            }),
            send_cq,
            recv_cq,
            sq_outstanding: Arc::new(AtomicU32::new(0)),
            sq: Mutex::new(SendSide {
                peer: None,
                backlog: VecDeque::new(),
                unretired: 0,
                local_keys: KeyCache::default(),
                remote_keys: KeyCache::default(),
                rng: SmallRng::seed_from_u64(seed),
                last_visible: None,
                completions: Vec::new(),
            }),
            rq: Mutex::new(RecvSide {
                queue: VecDeque::new(),
                held: None,
            }),
        })
    }

    fn raw_state(&self) -> u8 {
        self.state.load(Ordering::Acquire)
    }

    fn is_up(&self) -> bool {
        self.raw_state() == READY
    }
}

impl Progress for QpInner {
    /// Gives deferred work a chance to run: RNR-deferred sends retry, a held-back
    /// datagram is delivered. Returns whether work is still waiting.
    fn progress(&self) -> bool {
        let mut side = sync::lock(&self.sq);
        if !side.backlog.is_empty() {
            self.run_backlog(&mut side);
            self.send_cq.push_many(&mut side.completions);
        }
        let waiting = !side.backlog.is_empty();
        drop(side);
        let mut rq = sync::lock(&self.rq);
        if let Some(d) = rq.held.take() {
            let payload = Payload::Bytes(&d.bytes);
            self.deliver_locked(&mut rq, &payload, d.imm, d.src, true, None);
        }
        waiting
    }
}

impl QpInner {
    fn run_backlog(&self, side: &mut SendSide) {
        while let Some(deferred) = side.backlog.pop_front() {
            let wr = deferred.as_wr();
            if !self.is_up() {
                self.complete(side, &wr, WcStatus::WrFlush, 0, None);
                continue;
            }
            let visible = self.visible_at(side, &wr);
            match self.execute(side, &wr, visible) {
                Outcome::Done { byte_len } => {
                    if wr.signaled {
                        self.complete(side, &wr, WcStatus::Success, byte_len, visible);
                    }
                }
                Outcome::Failed(status) => {
                    self.complete(side, &wr, status, 0, visible);
                    self.fail(side);
                }
                Outcome::NotReady => {
                    if deferred.deadline.is_some_and(|d| Instant::now() >= d) {
                        self.complete(side, &wr, WcStatus::RnrRetryExceeded, 0, visible);
                        self.fail(side);
                    } else {
                        side.backlog.push_front(deferred);
                        return;
                    }
                }
            }
        }
    }

    /// Moves the queue pair to the error state and flushes every outstanding work
    /// request: deferred sends (on the next pass of the backlog loop) and receives.
    fn fail(&self, _side: &mut SendSide) {
        if self.raw_state() != DESTROYED {
            self.state.store(ERROR, Ordering::Release);
        }
        let mut rq = sync::lock(&self.rq);
        self.flush_receives(&mut rq);
    }

    fn flush_receives(&self, rq: &mut RecvSide) {
        rq.held = None;
        for recv in rq.queue.drain(..) {
            self.recv_cq.push(CqEntry {
                wc: Completion {
                    wr_id: recv.wr_id,
                    status: WcStatus::WrFlush,
                    opcode: WcOpcode::Recv,
                    qpn: self.endpoint.qpn,
                    ..Completion::default()
                },
                retires: 0,
                send_queue: None,
                visible_at: None,
            });
        }
    }

    /// Records a completion for `wr`; it retires every work request since the last one.
    fn complete(
        &self,
        side: &mut SendSide,
        wr: &SendWr<'_>,
        status: WcStatus,
        byte_len: u32,
        visible_at: Option<Instant>,
    ) {
        side.completions.push(CqEntry {
            wc: Completion {
                wr_id: wr.wr_id,
                status,
                opcode: wr.op.opcode(),
                byte_len,
                imm: None,
                qpn: self.endpoint.qpn,
                src: None,
            },
            retires: side.unretired,
            send_queue: Some(self.sq_outstanding.clone()),
            visible_at,
        });
        side.unretired = 0;
    }

    /// When the completion of `wr`, posted now, becomes visible: `None` (at once)
    /// unless a cost model or injected delay is configured.
    fn visible_at(&self, side: &mut SendSide, wr: &SendWr<'_>) -> Option<Instant> {
        let config = &self.net.config;
        if config.cost.is_none() && config.faults.completion_delay.is_none() {
            return None;
        }
        let now = Instant::now();
        let mut at = now;
        if let Some(model) = &config.cost {
            let class = match wr.op {
                WrOp::Read { .. } => LatencyClass::Read,
                WrOp::Cas { .. } | WrOp::FetchAdd { .. } => LatencyClass::Atomic,
                WrOp::Write { .. } | WrOp::Send { .. } => LatencyClass::Write,
            };
            at = sync::lock(&self.node.port).schedule(model, class, wr.op.payload_len(), now);
        }
        if let Some((lo, hi)) = config.faults.completion_delay {
            at += if hi > lo {
                side.rng.random_range(lo..=hi)
            } else {
                lo
            };
        }
        if let Some(last) = side.last_visible
            && last > at
        {
            at = last;
        }
        side.last_visible = Some(at);
        Some(at)
    }

    /// Splits a multi-word copy at a random 8-byte boundary when tear injection fires.
    fn tear_point(&self, rng: &mut SmallRng, remote_offset: u64, len: u64) -> Option<u64> {
        let p = self.net.config.faults.tear_probability;
        if p <= 0.0 || len <= 8 || !rng.random_bool(p.min(1.0)) {
            return None;
        }
        let first_boundary = (remote_offset / 8 + 1) * 8 - remote_offset;
        if first_boundary >= len {
            return None;
        }
        let boundaries = (len - first_boundary).div_ceil(8);
        Some(first_boundary + 8 * rng.random_range(0..boundaries))
    }

    /// Copies `len` bytes between regions, pausing in the middle when tear injection
    /// fires so that a concurrent WRITE can land between the halves.
    fn copy(
        &self,
        rng: &mut SmallRng,
        from: (&RegEntry, u64),
        to: (&RegEntry, u64),
        len: u64,
        remote_offset: u64,
    ) {
        let (src, src_off) = from;
        let (dst, dst_off) = to;
        let split = self.tear_point(rng, remote_offset, len).unwrap_or(len);
        memory::copy_between(src.mem.words(), src_off, dst.mem.words(), dst_off, split);
        if split < len {
            let until = Instant::now() + self.net.config.faults.tear_pause;
            while Instant::now() < until {
                std::thread::yield_now();
            }
            memory::copy_between(
                src.mem.words(),
                src_off + split,
                dst.mem.words(),
                dst_off + split,
                len - split,
            );
        }
    }

    fn execute(&self, side: &mut SendSide, wr: &SendWr<'_>, visible: Option<Instant>) -> Outcome {
        let result = match self.kind {
            QpKind::Rc => self.execute_rc(side, wr, visible),
            QpKind::Ud => self.execute_ud(side, wr, visible),
        };
        match result {
            Ok(byte_len) => Outcome::Done { byte_len },
            Err(Fail::Status(status)) => Outcome::Failed(status),
            Err(Fail::NotReady) => Outcome::NotReady,
        }
    }

    fn execute_rc(
        &self,
        side: &mut SendSide,
        wr: &SendWr<'_>,
        visible: Option<Instant>,
    ) -> Result<u32, Fail> {
        let SendSide {
            peer,
            local_keys,
            remote_keys,
            rng,
            ..
        } = side;
        let peer = peer.as_ref().ok_or(WcStatus::RetryExceeded)?;
        if !peer.qp.is_up() {
            return Err(WcStatus::RetryExceeded.into());
        }
        let node = &*self.node;
        match wr.op {
            WrOp::Read {
                local: buf,
                remote: addr,
            } => {
                let len = buf.len as u64;
                let target = local(local_keys, node, buf, true)?;
                let source = remote(remote_keys, &peer.node, addr, len, Access::REMOTE_READ)?;
                self.copy(
                    rng,
                    (source, addr.offset),
                    (target, buf.offset),
                    len,
                    addr.offset,
                );
                Ok(buf.len)
            }
            WrOp::Write {
                local: src,
                remote: addr,
                imm,
            } => {
                let len = src.len();
                let target = remote(remote_keys, &peer.node, addr, len, Access::REMOTE_WRITE)?;
                let source = match src {
                    Src::Buf(b) => Some((local(local_keys, node, b, false)?, b.offset)),
                    Src::Inline(_) => None,
                };
                // WRITE_WITH_IMM consumes a receive; without one the whole request is
                // refused (RNR) before any byte lands.
                let mut receiver = None;
                if imm.is_some() {
                    let mut rq = sync::lock(&peer.qp.rq);
                    if !peer.qp.is_up() {
                        return Err(WcStatus::RetryExceeded.into());
                    }
                    let recv = rq.queue.pop_front().ok_or(Fail::NotReady)?;
                    receiver = Some((rq, recv));
                }
                match (source, src) {
                    (Some(from), _) => {
                        self.copy(rng, from, (target, addr.offset), len, addr.offset)
                    }
                    (None, Src::Inline(data)) => {
                        memory::copy_in(target.mem.words(), addr.offset, data)
                    }
                    (None, Src::Buf(_)) => unreachable!("registered sources resolve above"),
                }
                if let Some((_rq, recv)) = receiver {
                    peer.qp.recv_cq.push(CqEntry {
                        wc: Completion {
                            wr_id: recv.wr_id,
                            status: WcStatus::Success,
                            opcode: WcOpcode::RecvWriteImm,
                            byte_len: len as u32,
                            imm,
                            qpn: peer.qp.endpoint.qpn,
                            src: Some(self.endpoint),
                        },
                        retires: 0,
                        send_queue: None,
                        visible_at: visible,
                    });
                }
                Ok(0)
            }
            WrOp::Send { local: src, imm } => {
                let payload = payload_of(local_keys, node, src)?;
                let mut rq = sync::lock(&peer.qp.rq);
                match peer
                    .qp
                    .deliver_locked(&mut rq, &payload, imm, self.endpoint, false, visible)
                {
                    Delivery::Delivered => Ok(0),
                    Delivery::NoReceive => Err(Fail::NotReady),
                    Delivery::TooSmall => Err(WcStatus::RemoteInvalidRequest.into()),
                    Delivery::ReceiverDown => Err(WcStatus::RetryExceeded.into()),
                }
            }
            WrOp::Cas {
                local: buf,
                remote: addr,
                compare,
                swap,
            } => {
                let word = atomic_target(remote_keys, &peer.node, addr)?;
                let result = local(local_keys, node, buf, true)?;
                let old =
                    match word.compare_exchange(compare, swap, Ordering::AcqRel, Ordering::Acquire)
                    {
                        Ok(old) | Err(old) => old,
                    };
                memory::copy_in(result.mem.words(), buf.offset, &old.to_le_bytes());
                Ok(8)
            }
            WrOp::FetchAdd {
                local: buf,
                remote: addr,
                add,
            } => {
                let word = atomic_target(remote_keys, &peer.node, addr)?;
                let result = local(local_keys, node, buf, true)?;
                let old = word.fetch_add(add, Ordering::AcqRel);
                memory::copy_in(result.mem.words(), buf.offset, &old.to_le_bytes());
                Ok(8)
            }
        }
    }

    fn execute_ud(
        &self,
        side: &mut SendSide,
        wr: &SendWr<'_>,
        visible: Option<Instant>,
    ) -> Result<u32, Fail> {
        let (WrOp::Send { local: src, imm }, Some(dest)) = (wr.op, wr.dest) else {
            unreachable!("validated at post time")
        };
        if src.len() > UD_MTU as u64 {
            return Err(WcStatus::LocalLength.into());
        }
        let payload = payload_of(&mut side.local_keys, &self.node, src)?;
        let faults = &self.net.config.faults;
        if faults.ud_drop_probability > 0.0
            && side.rng.random_bool(faults.ud_drop_probability.min(1.0))
        {
            return Ok(0);
        }
        // Datagrams to a missing queue pair or with the wrong Q_Key vanish, as on a wire.
        let Some(target) = self.net.qp(dest.endpoint) else {
            return Ok(0);
        };
        if target.kind != QpKind::Ud || target.caps.qkey != dest.qkey {
            return Ok(0);
        }
        let hold = faults.ud_reorder_probability > 0.0
            && side.rng.random_bool(faults.ud_reorder_probability.min(1.0));
        let mut rq = sync::lock(&target.rq);
        if hold && rq.held.is_none() {
            rq.held = Some(Datagram {
                bytes: payload.to_vec(),
                imm,
                src: self.endpoint,
            });
            drop(rq);
            target.recv_cq.add_waiting(target.clone());
            return Ok(0);
        }
        target.deliver_locked(&mut rq, &payload, imm, self.endpoint, true, visible);
        if let Some(d) = rq.held.take() {
            let held = Payload::Bytes(&d.bytes);
            target.deliver_locked(&mut rq, &held, d.imm, d.src, true, visible);
        }
        Ok(0)
    }

    /// Places a message in the next posted receive of this queue pair (the receiver).
    fn deliver_locked(
        &self,
        rq: &mut MutexGuard<'_, RecvSide>,
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
        let grh = if ud { GRH_BYTES } else { 0 };
        let needed = payload.len() as u64 + grh as u64;
        let mut wc = Completion {
            wr_id: recv.wr_id,
            status: WcStatus::Success,
            opcode: WcOpcode::Recv,
            byte_len: needed as u32,
            imm,
            qpn: self.endpoint.qpn,
            src: Some(src),
        };
        if needed > recv.len as u64 {
            wc.status = WcStatus::LocalLength;
            wc.byte_len = 0;
            self.recv_cq.push(CqEntry {
                wc,
                retires: 0,
                send_queue: None,
                visible_at: visible,
            });
            self.state.store(ERROR, Ordering::Release);
            self.flush_receives(rq);
            return Delivery::TooSmall;
        }
        if ud {
            memory::copy_in(
                recv.region.mem.words(),
                recv.offset,
                &[0; GRH_BYTES as usize],
            );
        }
        payload.copy_to(&recv.region, recv.offset + grh as u64);
        self.recv_cq.push(CqEntry {
            wc,
            retires: 0,
            send_queue: None,
            visible_at: visible,
        });
        Delivery::Delivered
    }

    fn post_send(&self, wrs: &[SendWr<'_>]) -> Result<()> {
        let state = self.raw_state();
        if state == INIT {
            return Err(FabricError::InvalidState {
                state: QpState::Init,
                action: "posting sends before connect",
            });
        }
        let mut side = sync::lock(&self.sq);
        if !side.backlog.is_empty() {
            self.run_backlog(&mut side);
        }
        let outstanding = self.sq_outstanding.load(Ordering::Acquire);
        let room = self.caps.max_send_wr.saturating_sub(outstanding) as usize;
        let mut result = Ok(());
        let mut posted = 0;
        for (index, wr) in wrs.iter().enumerate() {
            let check = if index >= room {
                Err(FabricError::QueueFull {
                    queue: "send",
                    depth: self.caps.max_send_wr,
                })
            } else {
                validate(
                    self.kind,
                    side.peer.as_ref().map(|p| p.node.id),
                    self.caps.max_inline,
                    wr,
                )
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
                self.complete(&mut side, wr, WcStatus::WrFlush, 0, None);
                continue;
            }
            if !side.backlog.is_empty() {
                side.backlog.push_back(Deferred::new(wr, None));
                continue;
            }
            let visible = self.visible_at(&mut side, wr);
            match self.execute(&mut side, wr, visible) {
                Outcome::Done { byte_len } => {
                    if wr.signaled {
                        self.complete(&mut side, wr, WcStatus::Success, byte_len, visible);
                    }
                }
                Outcome::Failed(status) => {
                    self.complete(&mut side, wr, status, 0, visible);
                    self.fail(&mut side);
                }
                Outcome::NotReady => {
                    let deadline = (self.caps.rnr_retry < 7).then(|| {
                        Instant::now() + self.caps.rnr_timer * (self.caps.rnr_retry as u32 + 1)
                    });
                    side.backlog.push_back(Deferred::new(wr, deadline));
                }
            }
        }
        self.sq_outstanding.fetch_add(posted, Ordering::AcqRel);
        self.send_cq.push_many(&mut side.completions);
        let waiting = !side.backlog.is_empty();
        drop(side);
        if waiting && let Some(me) = self.me.upgrade() {
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
            let region = self
                .node
                .region(wr.buf.lkey)
                .filter(|r| r.live.load(Ordering::Acquire))
                .ok_or_else(|| {
                    reject(FabricError::InvalidWorkRequest(format!(
                        "no registered region with lkey {:#x}",
                        wr.buf.lkey
                    )))
                })?;
            if !in_bounds(&region, wr.buf.offset, wr.buf.len as u64) {
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
            if self.raw_state() == ERROR {
                self.flush_receives(&mut rq);
            }
        }
        Ok(())
    }

    fn connect(&self, peer: QpEndpoint) -> Result<()> {
        if self.kind != QpKind::Rc {
            return Err(FabricError::InvalidWorkRequest(
                "only RC queue pairs connect".into(),
            ));
        }
        let qp = self
            .net
            .qp(peer)
            .filter(|q| q.kind == QpKind::Rc)
            .ok_or(FabricError::UnknownPeer(peer))?;
        let node = self
            .net
            .node(peer.node)
            .ok_or(FabricError::UnknownPeer(peer))?;
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
        side.peer = Some(Peer { node, qp });
        self.state.store(READY, Ordering::Release);
        Ok(())
    }

    fn recover(&self) -> Result<()> {
        let mut side = sync::lock(&self.sq);
        self.run_backlog(&mut side);
        self.send_cq.push_many(&mut side.completions);
        if self.raw_state() == ERROR {
            let next = if self.kind == QpKind::Ud || side.peer.is_some() {
                READY
            } else {
                INIT
            };
            self.state.store(next, Ordering::Release);
        }
        Ok(())
    }

    fn destroy(&self) {
        self.state.store(DESTROYED, Ordering::Release);
        // Drops the strong reference to the peer, so two connected queue pairs do not
        // keep each other alive.
        let peer = sync::lock(&self.sq).peer.take();
        drop(peer);
        self.node.forget_qp(self.endpoint.qpn);
    }
}

fn state_of(raw: u8) -> QpState {
    match raw {
        INIT => QpState::Init,
        READY => QpState::Ready,
        _ => QpState::Error,
    }
}

/// The handle `create_qp` returns. Dropping it destroys the queue pair.
pub(crate) struct SimQp {
    inner: Arc<QpInner>,
}

impl SimQp {
    pub(crate) fn new(inner: Arc<QpInner>) -> SimQp {
        SimQp { inner }
    }
}

impl Drop for SimQp {
    fn drop(&mut self) {
        self.inner.destroy();
    }
}

impl QueuePair for SimQp {
    fn endpoint(&self) -> QpEndpoint {
        self.inner.endpoint
    }
    fn kind(&self) -> QpKind {
        self.inner.kind
    }
    fn state(&self) -> QpState {
        state_of(self.inner.raw_state())
    }
    fn connect(&self, peer: QpEndpoint) -> Result<()> {
        self.inner.connect(peer)
    }
    fn post_send(&self, wrs: &[SendWr<'_>]) -> Result<()> {
        self.inner.post_send(wrs)
    }
    fn post_recv(&self, wrs: &[RecvWr]) -> Result<()> {
        self.inner.post_recv(wrs)
    }
    fn recover(&self) -> Result<()> {
        self.inner.recover()
    }
}
