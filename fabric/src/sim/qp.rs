//! Queue pairs of the sim backend: the engine's [`Transport`] for peers in the same
//! process. Every request applies at post time, directly on the peer's memory and
//! receive queue, with the sim's fault injection and cost model on top.

use super::cost::LatencyClass;
use super::{NetInner, NodeInner};
use crate::addr::{Access, NodeId, QpEndpoint, RemoteAddr};
use crate::device::QpKind;
use crate::engine::{
    self, Delivery, Fail, KeyCache, Payload, Qp, RecvSide, SendSide, Transport, in_bounds,
    payload_of,
};
use crate::error::{Result, WcStatus};
use crate::memory;
use crate::registry::{RegEntry, Registry};
use crate::sync;
use crate::wr::{SendWr, Src, UD_MTU, WrOp};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::sync::Arc;
use std::time::Instant;

/// A sim queue pair's way to the rest of the network.
pub(crate) struct SimPort {
    pub(crate) net: Arc<NetInner>,
    pub(crate) node: Arc<NodeInner>,
}

pub(crate) type SimQpInner = Qp<SimPort>;

pub(crate) struct Peer {
    node: Arc<NodeInner>,
    qp: Arc<SimQpInner>,
}

pub(crate) struct SimSend {
    remote_keys: KeyCache,
    rng: SmallRng,
    last_visible: Option<Instant>,
}

impl SimSend {
    pub(crate) fn new(seed: u64) -> SimSend {
        SimSend {
            remote_keys: KeyCache::default(),
            rng: SmallRng::seed_from_u64(seed),
            last_visible: None,
        }
    }
}

/// A UD datagram held back by reorder injection.
pub(crate) struct Datagram {
    bytes: Vec<u8>,
    imm: Option<u32>,
    src: QpEndpoint,
}

#[derive(Default)]
pub(crate) struct SimRecv {
    held: Option<Datagram>,
}

/// The word a CAS or FETCH_ADD targets: remote-atomic access, 8-byte aligned.
fn atomic_target<'c>(
    cache: &'c mut KeyCache,
    registry: &Registry,
    addr: RemoteAddr,
) -> Result<&'c crate::sync::AtomicU64, WcStatus> {
    let region = remote(cache, registry, addr, 8, Access::REMOTE_ATOMIC)?;
    engine::atomic_word(region.mem.words(), addr.offset)
}

/// Resolves a remote address at the responder, as the responder's NIC checks an rkey.
fn remote<'c>(
    cache: &'c mut KeyCache,
    registry: &Registry,
    addr: RemoteAddr,
    len: u64,
    need: Access,
) -> Result<&'c RegEntry, WcStatus> {
    let region = cache
        .get(addr.rkey, registry)
        .ok_or(WcStatus::RemoteAccess)?;
    if !in_bounds(region.len, addr.offset, len) || !region.access.contains(need) {
        return Err(WcStatus::RemoteAccess);
    }
    Ok(region)
}

impl SimPort {
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

    /// Where a WRITE of `len` bytes at `remote_offset` that places its last word
    /// first splits: the offset of that word within the WRITE, if the fault is on
    /// and the WRITE spans more than one word.
    fn last_word_first(&self, remote_offset: u64, len: u64) -> Option<u64> {
        if !self.net.config.faults.write_last_word_first || len == 0 {
            return None;
        }
        let last_word = (remote_offset + len - 1) / 8 * 8;
        (last_word > remote_offset).then(|| last_word - remote_offset)
    }

    fn pause_between_halves(&self) {
        let until = Instant::now() + self.net.config.faults.tear_pause;
        while Instant::now() < until {
            std::thread::yield_now();
        }
    }

    /// A WRITE's copy into `to`: in address order, or its last word first under the
    /// fault that places it so.
    fn write(&self, rng: &mut SmallRng, from: (&RegEntry, u64), to: (&RegEntry, u64), len: u64) {
        let Some(split) = self.last_word_first(to.1, len) else {
            return self.copy(rng, from, to, len, to.1);
        };
        let ((src, src_off), (dst, dst_off)) = (from, to);
        let (src, dst) = (src.mem.words(), dst.mem.words());
        memory::copy_between(src, src_off + split, dst, dst_off + split, len - split);
        self.pause_between_halves();
        memory::copy_between(src, src_off, dst, dst_off, split);
    }

    /// An inline WRITE's copy of `data` into `to`, likewise.
    fn write_inline(&self, data: &[u8], to: (&RegEntry, u64)) {
        let (dst, offset) = to;
        let words = dst.mem.words();
        let Some(split) = self.last_word_first(offset, data.len() as u64) else {
            return memory::copy_in(words, offset, data);
        };
        let (head, last) = data.split_at(split as usize);
        memory::copy_in(words, offset + split, last);
        self.pause_between_halves();
        memory::copy_in(words, offset, head);
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
            self.pause_between_halves();
            memory::copy_between(
                src.mem.words(),
                src_off + split,
                dst.mem.words(),
                dst_off + split,
                len - split,
            );
        }
    }

    fn execute_rc(
        &self,
        qp: &SimQpInner,
        side: &mut SendSide<SimPort>,
        wr: &SendWr<'_>,
        visible: Option<Instant>,
    ) -> Result<u32, Fail> {
        let SendSide {
            peer,
            local_keys,
            state,
            ..
        } = side;
        let SimSend {
            remote_keys, rng, ..
        } = state;
        let peer = peer.as_ref().ok_or(WcStatus::RetryExceeded)?;
        if !peer.qp.is_up() {
            return Err(WcStatus::RetryExceeded.into());
        }
        let node = &self.node.regions;
        let peer_regions = &peer.node.regions;
        match wr.op {
            WrOp::Read {
                local: buf,
                remote: addr,
            } => {
                let len = buf.len as u64;
                let target = engine::local(local_keys, node, buf, true)?;
                let source = remote(remote_keys, peer_regions, addr, len, Access::REMOTE_READ)?;
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
                let target = remote(remote_keys, peer_regions, addr, len, Access::REMOTE_WRITE)?;
                let source = match src {
                    Src::Buf(b) => Some((engine::local(local_keys, node, b, false)?, b.offset)),
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
                    (Some(from), _) => self.write(rng, from, (target, addr.offset), len),
                    (None, Src::Inline(data)) => self.write_inline(data, (target, addr.offset)),
                    (None, Src::Buf(_)) => unreachable!("registered sources resolve above"),
                }
                if let Some((_rq, recv)) = receiver {
                    peer.qp
                        .complete_write_imm(recv, len as u32, imm, qp.endpoint, visible);
                }
                Ok(0)
            }
            WrOp::Send { local: src, imm } => {
                let payload = payload_of(local_keys, node, src)?;
                let mut rq = sync::lock(&peer.qp.rq);
                match peer
                    .qp
                    .deliver_locked(&mut rq, &payload, imm, qp.endpoint, false, visible)
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
                ..
            }
            | WrOp::FetchAdd {
                local: buf,
                remote: addr,
                ..
            } => {
                let word = atomic_target(remote_keys, peer_regions, addr)?;
                let result = engine::local(local_keys, node, buf, true)?;
                Ok(engine::apply_atomic(&wr.op, word, result, buf.offset))
            }
        }
    }

    fn execute_ud(
        &self,
        qp: &SimQpInner,
        side: &mut SendSide<SimPort>,
        wr: &SendWr<'_>,
        visible: Option<Instant>,
    ) -> Result<u32, Fail> {
        let (WrOp::Send { local: src, imm }, Some(dest)) = (wr.op, wr.dest) else {
            unreachable!("validated at post time")
        };
        if src.len() > UD_MTU as u64 {
            return Err(WcStatus::LocalLength.into());
        }
        let rng = &mut side.state.rng;
        let payload = payload_of(&mut side.local_keys, &self.node.regions, src)?;
        let faults = &self.net.config.faults;
        if faults.ud_drop_probability > 0.0 && rng.random_bool(faults.ud_drop_probability.min(1.0))
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
            && rng.random_bool(faults.ud_reorder_probability.min(1.0));
        let mut rq = sync::lock(&target.rq);
        if hold && rq.state.held.is_none() {
            rq.state.held = Some(Datagram {
                bytes: payload.to_vec(),
                imm,
                src: qp.endpoint,
            });
            drop(rq);
            if let Some(progress) = target.as_progress() {
                target.recv_cq.add_waiting(progress);
            }
            return Ok(0);
        }
        target.deliver_locked(&mut rq, &payload, imm, qp.endpoint, true, visible);
        if let Some(d) = rq.state.held.take() {
            let held = Payload::Bytes(&d.bytes);
            target.deliver_locked(&mut rq, &held, d.imm, d.src, true, visible);
        }
        Ok(0)
    }
}

impl Transport for SimPort {
    type Peer = Peer;
    type SendState = SimSend;
    type RecvState = SimRecv;

    fn registry(&self) -> &Registry {
        &self.node.regions
    }

    fn peer_node(peer: &Peer) -> NodeId {
        peer.node.id
    }

    fn connect(&self, _qp: &SimQpInner, to: QpEndpoint) -> Result<Peer> {
        let unknown = crate::error::FabricError::UnknownPeer(to);
        let qp = self
            .net
            .qp(to)
            .filter(|q| q.kind == QpKind::Rc)
            .ok_or_else(|| unknown.clone())?;
        let node = self.net.node(to.node).ok_or(unknown)?;
        Ok(Peer { node, qp })
    }

    fn execute(
        &self,
        qp: &SimQpInner,
        side: &mut SendSide<SimPort>,
        wr: &SendWr<'_>,
        visible: Option<Instant>,
    ) -> Result<u32, Fail> {
        match qp.kind {
            QpKind::Rc => self.execute_rc(qp, side, wr, visible),
            QpKind::Ud => self.execute_ud(qp, side, wr, visible),
        }
    }

    fn prefetch(&self, side: &mut SendSide<SimPort>, wr: &SendWr<'_>) {
        let Some(peer) = side.peer.as_ref() else {
            return;
        };
        let Some((addr, len)) = wr.op.remote_span() else {
            return;
        };
        let keys = &mut side.state.remote_keys;
        if let Ok(region) = remote(keys, &peer.node.regions, addr, len, Access::empty()) {
            memory::prefetch_bytes(region.mem.words(), addr.offset, len);
        }
    }

    /// `None` (at once) unless a cost model or injected delay is configured.
    fn visible_at(&self, state: &mut SimSend, wr: &SendWr<'_>) -> Option<Instant> {
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
                state.rng.random_range(lo..=hi)
            } else {
                lo
            };
        }
        if let Some(last) = state.last_visible
            && last > at
        {
            at = last;
        }
        state.last_visible = Some(at);
        Some(at)
    }

    /// Delivers a held-back datagram; nothing else arrives later in the sim.
    fn progress_recv(&self, qp: &SimQpInner, rq: &mut RecvSide<SimPort>) -> bool {
        if let Some(d) = rq.state.held.take() {
            let payload = Payload::Bytes(&d.bytes);
            qp.deliver_locked(rq, &payload, d.imm, d.src, true, None);
        }
        false
    }

    fn receives_flushed(&self, rq: &mut RecvSide<SimPort>) {
        rq.state.held = None;
    }

    fn destroyed(&self, qp: &SimQpInner) {
        self.node.forget_qp(qp.endpoint.qpn);
    }
}
