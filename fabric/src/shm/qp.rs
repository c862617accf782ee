//! Queue pairs of the shm backend: the engine's [`Transport`] for peers in other
//! processes. One-sided requests run here, on the requester's CPU, against the peer's
//! memory as mapped from the fds it handed over; messages go into the ring the peer
//! gave this queue pair, and arrive at a receiver when it polls.
//!
//! Every check happens before any byte moves: the peer is alive, the rkey is live in
//! the peer's key table, the range is inside both the registered length and the
//! mapping, and the access flag is there.

use super::control;
use super::link::{AttachError, PeerLink};
use super::ring::{
    self, Consumer, KIND_PLACED, KIND_SEND, KIND_TOO_SMALL, KIND_WRITE_IMM, PeerBlock, Producer,
    PushError, QpBlock,
};
use super::{PeerProcess, ShmNode};
use crate::addr::{Access, NodeId, QpEndpoint, RemoteAddr};
use crate::device::QpKind;
use crate::engine::{
    self, Caps, Delivery, Fail, NewQp, Payload, Qp, READY, RecvSide, SendSide, Transport,
    in_bounds, payload_of,
};
use crate::error::{FabricError, Result, WcStatus};
use crate::memfd::MemfdMemory;
use crate::memory::{self, Memory};
use crate::registry::Registry;
use crate::sync::{self, AtomicU64};
use crate::wr::{SendWr, UD_MTU, WrOp};
use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::sync::Arc;
use std::time::Instant;

/// The most UD senders one queue pair accepts rings from.
const MAX_UD_SENDERS: usize = 1024;

/// An shm queue pair's way to its peers, and its own block.
pub(crate) struct ShmPort {
    node: Arc<ShmNode>,
    block: QpBlock,
}

impl ShmPort {
    pub(crate) fn new(node: Arc<ShmNode>, caps: &Caps) -> Result<ShmPort, String> {
        Ok(ShmPort {
            node,
            block: QpBlock::create(caps.max_recv_wr, caps.qkey)?,
        })
    }
}

pub(crate) type ShmQp = Qp<ShmPort>;

pub(crate) fn create(port: ShmPort, new: NewQp) -> Arc<ShmQp> {
    Qp::new(port, new, ShmSend::default(), ShmRecv::default())
}

/// The connected peer of an RC queue pair.
pub(crate) struct Peer {
    link: Arc<PeerLink>,
    block: PeerBlock,
    ring: Producer,
    /// Receives of the peer this side has used (a message is in the ring for each).
    consumed: u64,
}

impl Peer {
    fn is_up(&self) -> bool {
        self.link.is_alive() && self.block.state() == READY
    }

    /// Enters the peer's memory for one one-sided request, if the queue pair is still
    /// up once inside: its owner destroying it waits for the request to leave
    /// ([`ring::Producer::enter_memory`]), so that once a memory server fenced a node
    /// (ended its sessions), nothing the node still had under way writes afterwards.
    fn enter_memory(&self, in_post: bool) -> Result<Option<ring::InMemory<'_>>, WcStatus> {
        let inside = (!in_post).then(|| self.ring.enter_memory());
        if self.link.is_alive() && self.block.state_after_entry() == READY {
            #[cfg(test)]
            STALL_IN_MEMORY.with(|stall| {
                if let Some(stall) = stall.borrow_mut().as_mut() {
                    stall();
                }
            });
            Ok(inside)
        } else {
            Err(WcStatus::RetryExceeded)
        }
    }

    /// The number of the next receive a message may take, if one is posted.
    fn next_receive(&self) -> Option<u64> {
        let (posted, flushed) = self.block.receives();
        let next = self.consumed.max(flushed);
        (posted > next && posted - next <= self.block.depth()).then_some(next)
    }
}

#[cfg(test)]
thread_local! {
    /// Tests: what a request of this thread does once inside the peer's memory, before
    /// it touches it (a sender descheduled there).
    pub(crate) static STALL_IN_MEMORY: std::cell::RefCell<Option<Box<dyn FnMut()>>> =
        const { std::cell::RefCell::new(None) };
}

/// A few recently used regions of the peer, mapped, so the common case needs no lock.
#[derive(Default)]
struct RegionCache {
    entries: [Option<(u32, Arc<MemfdMemory>)>; 4],
    victim: usize,
}

impl RegionCache {
    fn get(&mut self, key: u32, link: &PeerLink, writable: bool) -> Option<&MemfdMemory> {
        let index = match self
            .entries
            .iter()
            .position(|e| e.as_ref().is_some_and(|(k, _)| *k == key))
        {
            Some(i) => i,
            None => {
                let mem = link.region(key, writable)?;
                // Like the link, let go of regions the owner deregistered.
                for e in &mut self.entries {
                    if e.as_ref()
                        .is_some_and(|(k, _)| link.keys().lookup(*k).is_none())
                    {
                        *e = None;
                    }
                }
                let i = match self.entries.iter().position(Option::is_none) {
                    Some(free) => free,
                    None => {
                        let i = self.victim;
                        self.victim = (self.victim + 1) % self.entries.len();
                        i
                    }
                };
                self.entries[i] = Some((key, mem));
                i
            }
        };
        self.entries[index].as_ref().map(|(_, m)| &**m)
    }

    fn forget(&mut self, key: u32) {
        for e in &mut self.entries {
            if e.as_ref().is_some_and(|(k, _)| *k == key) {
                *e = None;
            }
        }
    }
}

/// A UD destination as this queue pair knows it.
enum UdTarget {
    Ring {
        link: Arc<PeerLink>,
        block: PeerBlock,
        ring: Producer,
    },
    /// The peer has no such UD queue pair: datagrams to it vanish.
    Missing,
}

#[derive(Default)]
pub(crate) struct ShmSend {
    regions: RegionCache,
    ud: HashMap<QpEndpoint, UdTarget>,
    /// Inside the RC peer's memory for the whole of the current `post_send`
    /// ([`Transport::begin_post`]): its one-sided requests need no entry of their own.
    in_post: bool,
}

/// A ring some sender writes into this queue pair.
struct Inbound {
    from: QpEndpoint,
    ring: Consumer,
    /// The sender's process, if its control connection told: a destroyed queue pair
    /// waits for its requests in memory only while it runs.
    process: Option<PeerProcess>,
}

#[derive(Default)]
pub(crate) struct ShmRecv {
    /// Receives posted so far, as published in the block.
    posted: u64,
    inbound: Vec<Inbound>,
    /// RC: the one sender this queue pair accepts, from its first attach on.
    sender: Option<QpEndpoint>,
}

/// Resolves a remote range, as the responder's NIC checks an rkey: live in the peer's
/// key table, inside the registered length and the mapping, with `need` granted.
fn remote<'c>(
    cache: &'c mut RegionCache,
    link: &PeerLink,
    addr: RemoteAddr,
    len: u64,
    need: Access,
) -> Result<&'c [AtomicU64], WcStatus> {
    let Some((access, region_len)) = link.keys().lookup(addr.rkey) else {
        cache.forget(addr.rkey);
        link.forget_region(addr.rkey);
        return Err(WcStatus::RemoteAccess);
    };
    if !in_bounds(region_len, addr.offset, len) || !access.contains(need) {
        return Err(WcStatus::RemoteAccess);
    }
    let writable = access.intersects(Access::REMOTE_WRITE | Access::REMOTE_ATOMIC);
    let Some(mem) = cache.get(addr.rkey, link, writable) else {
        return Err(if link.is_alive() {
            WcStatus::RemoteAccess
        } else {
            WcStatus::RetryExceeded
        });
    };
    let words = mem.words();
    if !in_bounds(words.len() as u64 * 8, addr.offset, len) {
        return Err(WcStatus::RemoteAccess);
    }
    Ok(words)
}

/// The word a CAS or FETCH_ADD targets: remote-atomic access, 8-byte aligned.
fn atomic_target<'c>(
    cache: &'c mut RegionCache,
    link: &PeerLink,
    addr: RemoteAddr,
) -> Result<&'c AtomicU64, WcStatus> {
    let words = remote(cache, link, addr, 8, Access::REMOTE_ATOMIC)?;
    engine::atomic_word(words, addr.offset)
}

fn pushed(result: Result<(), PushError>) -> Result<(), Fail> {
    match result {
        Ok(()) => Ok(()),
        Err(PushError::Full) => Err(Fail::Busy),
        Err(PushError::TooLarge) => Err(WcStatus::LocalLength.into()),
        Err(PushError::Broken) => Err(WcStatus::RetryExceeded.into()),
    }
}

impl ShmPort {
    fn execute_rc(&self, side: &mut SendSide<ShmPort>, wr: &SendWr<'_>) -> Result<u32, Fail> {
        let SendSide {
            peer,
            local_keys,
            state,
            ..
        } = side;
        let peer = peer.as_mut().ok_or(WcStatus::RetryExceeded)?;
        // One-sided ops check the queue pair once inside its memory (`enter_memory`).
        let regions = &mut state.regions;
        let node = &self.node.regions;
        match wr.op {
            WrOp::Read {
                local: buf,
                remote: addr,
            } => {
                let _inside = peer.enter_memory(state.in_post)?;
                let target = engine::local(local_keys, node, buf, true)?;
                let source = remote(
                    regions,
                    &peer.link,
                    addr,
                    buf.len as u64,
                    Access::REMOTE_READ,
                )?;
                memory::copy_between(
                    source,
                    addr.offset,
                    target.mem.words(),
                    buf.offset,
                    buf.len as u64,
                );
                Ok(buf.len)
            }
            WrOp::Write {
                local: src,
                remote: addr,
                imm,
            } => {
                let len = src.len();
                let inside = peer.enter_memory(state.in_post)?;
                let target = remote(regions, &peer.link, addr, len, Access::REMOTE_WRITE)?;
                let payload = payload_of(local_keys, node, src)?;
                // WRITE_WITH_IMM consumes a receive; without one (or without room for
                // its notice) the whole request waits before any byte lands.
                let receive = match imm {
                    Some(_) => {
                        let seq = peer.next_receive().ok_or(Fail::NotReady)?;
                        pushed(peer.ring.check(KIND_WRITE_IMM, len as u32))?;
                        Some(seq)
                    }
                    None => None,
                };
                payload.copy_to(target, addr.offset);
                drop(inside);
                if let Some(seq) = receive {
                    pushed(
                        peer.ring
                            .push(KIND_WRITE_IMM, imm, 0, &Payload::Absent(len as u32)),
                    )?;
                    peer.consumed = seq + 1;
                }
                Ok(0)
            }
            WrOp::Send { local: src, imm } => {
                if !peer.is_up() {
                    return Err(WcStatus::RetryExceeded.into());
                }
                let payload = payload_of(local_keys, node, src)?;
                let seq = peer.next_receive().ok_or(Fail::NotReady)?;
                let (room, place) = peer.block.receive(seq);
                let len = payload.len();
                if len > room {
                    pushed(
                        peer.ring
                            .push(KIND_TOO_SMALL, imm, 0, &Payload::Absent(len)),
                    )?;
                    peer.consumed = seq + 1;
                    return Err(WcStatus::RemoteInvalidRequest.into());
                }
                // Placed directly when the receiver offers it and the key still checks
                // out; through the ring otherwise.
                let target = place.and_then(|(rkey, offset)| {
                    let at = RemoteAddr {
                        node: peer.link.node,
                        rkey,
                        offset,
                    };
                    remote(regions, &peer.link, at, len as u64, Access::REMOTE_WRITE)
                        .ok()
                        .map(|words| (words, offset))
                });
                match target {
                    Some((words, offset)) => {
                        pushed(peer.ring.check(KIND_PLACED, len))?;
                        payload.copy_to(words, offset);
                        pushed(peer.ring.push(KIND_PLACED, imm, 0, &Payload::Placed(len)))?;
                    }
                    None => pushed(peer.ring.push(KIND_SEND, imm, 0, &payload))?,
                }
                peer.consumed = seq + 1;
                Ok(0)
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
                let _inside = peer.enter_memory(state.in_post)?;
                let word = atomic_target(regions, &peer.link, addr)?;
                let result = engine::local(local_keys, node, buf, true)?;
                Ok(engine::apply_atomic(&wr.op, word, result, buf.offset))
            }
        }
    }

    /// Sends a datagram. UD senders learn nothing of delivery: a datagram that cannot
    /// go (no such queue pair, a full ring, a dead peer) is lost, and the send succeeds.
    fn execute_ud(
        &self,
        qp: &ShmQp,
        side: &mut SendSide<ShmPort>,
        wr: &SendWr<'_>,
    ) -> Result<u32, Fail> {
        let (WrOp::Send { local: src, imm }, Some(dest)) = (wr.op, wr.dest) else {
            unreachable!("validated at post time")
        };
        if src.len() > UD_MTU as u64 {
            return Err(WcStatus::LocalLength.into());
        }
        let payload = payload_of(&mut side.local_keys, &self.node.regions, src)?;
        let targets = &mut side.state.ud;
        // A destination that went away is forgotten, and its ring unmapped.
        if targets.get(&dest.endpoint).is_some_and(|t| match t {
            UdTarget::Ring { link, block, .. } => {
                !link.is_alive() || block.state() == engine::DESTROYED
            }
            UdTarget::Missing => false,
        }) {
            targets.remove(&dest.endpoint);
        }
        let target = match targets.entry(dest.endpoint) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(slot) => {
                let Ok(link) = self.node.link(dest.endpoint.node) else {
                    return Ok(0);
                };
                slot.insert(
                    match link.attach(control::KIND_UD, dest.endpoint.qpn, qp.endpoint.qpn) {
                        Ok((block, ring)) => UdTarget::Ring { link, block, ring },
                        Err(AttachError::Missing | AttachError::Refused(_)) => UdTarget::Missing,
                        Err(AttachError::Unreachable(_)) => return Ok(0),
                    },
                )
            }
        };
        if let UdTarget::Ring { ring, .. } = target {
            let _ = ring.push(KIND_SEND, imm, dest.qkey, &payload);
        }
        Ok(0)
    }

    /// Moves what arrived in the rings into posted receives, in ring order.
    fn drain(&self, qp: &ShmQp, rq: &mut RecvSide<ShmPort>) {
        let mut inbound = std::mem::take(&mut rq.state.inbound);
        let ud = qp.kind == QpKind::Ud;
        inbound.retain_mut(|sender| {
            let kept = self.drain_ring(qp, rq, sender, ud);
            if !kept && !ud {
                // A sender that corrupts its ring breaks the connection.
                qp.fail_receiver(rq);
            }
            kept
        });
        rq.state.inbound = inbound;
    }

    /// Drains one ring; false if the sender broke it.
    fn drain_ring(
        &self,
        qp: &ShmQp,
        rq: &mut RecvSide<ShmPort>,
        sender: &mut Inbound,
        ud: bool,
    ) -> bool {
        loop {
            let record = match sender.ring.next() {
                Ok(Some(r)) => r,
                Ok(None) => return true,
                Err(_) => return false,
            };
            // What the protocol does not allow breaks the ring, whatever the state.
            let allowed = match record.kind {
                KIND_SEND | KIND_TOO_SMALL => true,
                // Only into a receive offered for placement.
                KIND_PLACED => {
                    !ud && rq
                        .queue
                        .front()
                        .is_none_or(|r| r.region.access.contains(Access::REMOTE_WRITE))
                }
                KIND_WRITE_IMM => !ud,
                _ => false,
            };
            if !allowed {
                return false;
            }
            if !qp.is_up() {
                // Nothing can take it: the queue pair failed or was never connected.
                sender.ring.discard();
                return true;
            }
            if record.kind == KIND_WRITE_IMM {
                if let Some(recv) = rq.queue.pop_front() {
                    qp.complete_write_imm(recv, record.len, record.imm, sender.from, None);
                }
            } else if !ud || (record.qkey == qp.caps.qkey && record.len <= UD_MTU) {
                let payload = sender.ring.payload(&record);
                // No receive for it: a UD datagram is dropped; on RC it lost a race with
                // a flush, and the flush took its receive.
                let delivered = qp.deliver_locked(rq, &payload, record.imm, sender.from, ud, None);
                if matches!(delivered, Delivery::TooSmall) {
                    sender.ring.discard();
                    return true;
                }
            }
            sender.ring.consume(&record);
        }
    }
}

/// Gives sender `from` a ring into `qp`; returns the fds the sender maps (the block,
/// read-only, and the ring), or the status to refuse with.
pub(crate) fn attach(
    qp: &Arc<ShmQp>,
    from: QpEndpoint,
    process: Option<PeerProcess>,
) -> Result<(std::os::fd::OwnedFd, std::os::fd::OwnedFd), u8> {
    use std::os::fd::AsFd;
    let data = match qp.kind {
        QpKind::Rc => ring::RING_DATA,
        QpKind::Ud => ring::UD_RING_DATA,
    };
    let mem = ring::create_ring(data).map_err(|_| control::FAILED)?;
    let ring_fd = mem
        .as_fd()
        .try_clone_to_owned()
        .map_err(|_| control::FAILED)?;
    let block_fd = qp
        .transport
        .block
        .memory()
        .read_only_fd()
        .map_err(|_| control::FAILED)?;
    let mut rq = sync::lock(&qp.rq);
    let state = &mut rq.state;
    match qp.kind {
        QpKind::Rc => {
            if *state.sender.get_or_insert(from) != from {
                return Err(control::REFUSED);
            }
            state.inbound.clear();
        }
        QpKind::Ud => {
            // A sender attaching again (after its peer link broke) gets a fresh ring.
            state.inbound.retain(|i| i.from != from);
            if state.inbound.len() >= MAX_UD_SENDERS {
                return Err(control::REFUSED);
            }
        }
    }
    state.inbound.push(Inbound {
        from,
        ring: Consumer::new(mem),
        process,
    });
    drop(rq);
    if let Some(progress) = qp.as_progress() {
        qp.recv_cq.add_poller(progress);
    }
    Ok((block_fd, ring_fd))
}

impl Transport for ShmPort {
    type Peer = Peer;
    type SendState = ShmSend;
    type RecvState = ShmRecv;

    fn registry(&self) -> &Registry {
        &self.node.regions
    }

    fn peer_node(peer: &Peer) -> NodeId {
        peer.link.node
    }

    fn connect(&self, qp: &ShmQp, to: QpEndpoint) -> Result<Peer> {
        let link = self.node.link(to.node)?;
        let (block, ring) = link
            .attach(control::KIND_RC, to.qpn, qp.endpoint.qpn)
            .map_err(|e| match e {
                AttachError::Missing => FabricError::UnknownPeer(to),
                AttachError::Refused(why) | AttachError::Unreachable(why) => {
                    FabricError::Backend(format!("connecting to {to}: {why}"))
                }
            })?;
        Ok(Peer {
            link,
            block,
            ring,
            consumed: 0,
        })
    }

    fn check_post(&self, wr: &SendWr<'_>) -> Result<()> {
        match wr.dest {
            Some(d) if !self.node.knows(d.endpoint.node) => {
                Err(FabricError::UnknownPeer(d.endpoint))
            }
            _ => Ok(()),
        }
    }

    fn prefetch(&self, side: &mut SendSide<ShmPort>, wr: &SendWr<'_>) {
        let (Some(peer), Some((addr, len))) = (side.peer.as_ref(), wr.op.remote_span()) else {
            return;
        };
        if let Ok(words) = remote(
            &mut side.state.regions,
            &peer.link,
            addr,
            len,
            Access::empty(),
        ) {
            memory::prefetch_bytes(words, addr.offset, len);
        }
    }

    fn begin_post(&self, side: &mut SendSide<ShmPort>) {
        if let Some(peer) = &side.peer {
            peer.ring.enter_memory_until_left();
            side.state.in_post = true;
        }
    }

    fn end_post(&self, side: &mut SendSide<ShmPort>) {
        if std::mem::take(&mut side.state.in_post)
            && let Some(peer) = &side.peer
        {
            peer.ring.leave_memory();
        }
    }

    fn execute(
        &self,
        qp: &ShmQp,
        side: &mut SendSide<ShmPort>,
        wr: &SendWr<'_>,
        _visible: Option<Instant>,
    ) -> Result<u32, Fail> {
        match qp.kind {
            QpKind::Rc => self.execute_rc(side, wr),
            QpKind::Ud => self.execute_ud(qp, side, wr),
        }
    }

    fn progress_recv(&self, qp: &ShmQp, rq: &mut RecvSide<ShmPort>) -> bool {
        self.drain(qp, rq);
        qp.raw_state() != engine::DESTROYED
    }

    fn settle(&self, qp: &ShmQp, rq: &mut RecvSide<ShmPort>) {
        self.drain(qp, rq);
    }

    /// Publishes the receive; one in a region peers may write anyway is offered for
    /// direct placement, which spares the message its copy through the ring.
    fn receive_posted(&self, rq: &mut RecvSide<ShmPort>) {
        let Some(recv) = rq.queue.back() else { return };
        let place = recv
            .region
            .access
            .contains(Access::REMOTE_WRITE)
            .then_some((recv.region.key, recv.offset));
        self.block.post(rq.state.posted, recv.len, place);
        rq.state.posted += 1;
    }

    fn receives_flushed(&self, rq: &mut RecvSide<ShmPort>) {
        self.block.flushed(rq.state.posted);
    }

    fn state_changed(&self, state: u8) {
        self.block.set_state(state);
    }

    fn recover(&self, peer: Option<&mut Peer>) -> Result<()> {
        match peer {
            Some(p) if !p.link.is_alive() => Err(FabricError::Backend(format!(
                "{} is gone: nothing to reconnect to",
                p.link.node
            ))),
            _ => Ok(()),
        }
    }

    /// Also waits until no request of its RC sender is inside this device's memory
    /// ([`Peer::enter_memory`]), for as long as the sender's process runs (a stopped
    /// one may go on; a dead one cannot) and this device is not shutting down.
    fn destroyed(&self, qp: &ShmQp) {
        self.node.forget_qp(qp.endpoint.qpn);
        if qp.kind != QpKind::Rc {
            return;
        }
        // Taken out, so that the wait holds no lock: nothing is delivered from them
        // once the queue pair is destroyed.
        let inbound = std::mem::take(&mut sync::lock(&qp.rq).state.inbound);
        if !inbound.is_empty() {
            super::barrier::owner_barrier();
        }
        for inbound in &inbound {
            while inbound.ring.senders_in_memory() != 0
                && inbound.process.is_some_and(|p| p.runs())
                && !crate::serve::Server::is_shut_down(&*self.node)
            {
                std::thread::sleep(std::time::Duration::from_micros(100));
            }
        }
    }
}
