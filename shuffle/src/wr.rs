//! The MQ/WR endpoints (§5.5, Algorithms 5 and 6): the sender WRITEs into the
//! receiver's buffers.
//!
//! Every lane endpoint has an RC queue pair to every rank's lane endpoint (its own
//! node's included). The receiver owns the buffers: it advertises free ones to each
//! sender through **FreeArr**, a ring at the sender (see [`crate::ring`]) whose entries
//! carry the buffer's key (rkey and offset) and its slot number at the receiver.
//! PUTDATA takes the next advertised buffer of each destination, WRITEs header and
//! payload into it, and notifies the receiver as [`Notify`] says:
//!
//! - [`Notify::Seal`]: a second WRITE puts a seal word in the buffer's trailer (its
//!   last word); RC ordering lands it after the data. The receiver polls the trailer
//!   of the oldest buffer it advertised to each sender (a sender fills them in the
//!   order they were advertised) and clears the seal before advertising the buffer
//!   again.
//! - [`Notify::MessageQueue`]: a second WRITE pushes the slot and length into
//!   **ValidArr**, a ring at the receiver.
//! - [`Notify::CompletionQueue`]: one WRITE_WITH_IMM carries the slot as immediate
//!   data. The receiver posts receives ahead of its advertisements (credit, as in
//!   §5.2): never fewer than the buffers a sender may fill, in batches, so it may
//!   extend more credit than it has buffers out.
//!
//! The end of a stream is a header-only message with [`State::Depleted`] to every
//! receiver. RELEASE gives the buffer back to the receiver's [`Circulation`], and every
//! polling pass tops each sender's advertised buffers up to its target (the policy's
//! initial count; the adaptive policy raises a sender's target whenever it found the
//! sender had filled everything advertised, and fetches buffers from the pool when
//! none is waiting).

use crate::buffer::{Buffer, HEADER_BYTES, Header, Received, SendBuf, State, TRAILER_BYTES};
use crate::endpoint::{
    Backoff, EndpointConfig, Lane, Notify, Pair, RecvEndpoint, SendEndpoint, check_destinations,
    no_data, retry_until, wait_for_data,
};
use crate::error::{Result, ShuffleError};
use crate::node::Node;
use crate::pool::{Buffering, Circulation};
use crate::ring::{self, Consumer, Layout, Mesh, Producer};
use fabric::{Access, LocalBuf, RecvWr, Region, RemoteAddr, SendWr, Src, WcOpcode, WcStatus};
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::Poll;
use std::time::Duration;

/// The seal word (pollbuff).
const SEAL: u64 = 0x5EA1_5EA1_5EA1_5EA1;
/// Work request ids.
const WR_ENTRY: u64 = 1;
const WR_REPORT: u64 = 2;
const WR_MISC: u64 = 3;
const WR_RECV: u64 = 4;
/// Data WRITEs from a local buffer, with its id.
const WR_DATA: u64 = 1 << 63;
/// Receives posted at a time in the completion-queue mode.
const RECV_BATCH: u32 = 8;

#[derive(Serialize, Deserialize)]
struct Wiring {
    send_qpns: Vec<u32>,
    recv_qpns: Vec<u32>,
    send_ctrl: u32,
    recv_ctrl: u32,
    /// Ring capacity, notification mode, buffer bytes: must agree everywhere.
    shape: (u64, u8, u32),
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn notify_code(n: Notify) -> u8 {
    match n {
        Notify::Seal => 0,
        Notify::MessageQueue => 1,
        Notify::CompletionQueue => 2,
    }
}

/// Opens this node's endpoints of one lane. Collective.
pub(crate) fn open(node: &Node, config: &EndpointConfig, lane: Lane) -> Result<Pair> {
    ring::add_self(node)?;
    let nodes = node.nodes();
    let rank = node.rank();
    let layout = Layout {
        peers: nodes,
        cap: ring::ring_capacity(config.buffering.max_per_peer(), nodes),
    };
    let send_mesh = Mesh::create(node)?;
    let recv_mesh = Mesh::create(node)?;
    let access = Access::LOCAL_WRITE | Access::REMOTE_WRITE;
    let send_ctrl = Arc::new(node.device().register(layout.bytes(), access)?);
    let recv_ctrl = Arc::new(node.device().register(layout.bytes(), access)?);
    let pool = node.pool(config.message_bytes);
    let buf_bytes = pool.buffer_bytes();
    if buf_bytes < HEADER_BYTES + TRAILER_BYTES + 8 {
        return Err(ShuffleError::Invalid(format!(
            "buffers of {buf_bytes} bytes hold no payload"
        )));
    }
    let send_circ = Circulation::new(pool.clone(), config.buffering, nodes)?;
    let recv_circ = Circulation::new(pool, config.buffering, nodes)?;
    let shape = (layout.cap, notify_code(config.notify), buf_bytes);
    let mine = Wiring {
        send_qpns: send_mesh.qpns(),
        recv_qpns: recv_mesh.qpns(),
        send_ctrl: send_ctrl.rkey(),
        recv_ctrl: recv_ctrl.rkey(),
        shape,
    };
    let all: Vec<Wiring> = node.all_gather(&format!("mq/wr lane {}", lane.lane), &mine)?;
    if let Some(r) = all.iter().position(|w| w.shape != shape) {
        return Err(ShuffleError::Invalid(format!(
            "rank {r} opened MQ/WR as {:?} (ring entries, notification, buffer bytes), \
             this node as {shape:?}",
            all[r].shape
        )));
    }
    let send_qpns: Vec<Vec<u32>> = all.iter().map(|w| w.send_qpns.clone()).collect();
    let recv_qpns: Vec<Vec<u32>> = all.iter().map(|w| w.recv_qpns.clone()).collect();
    ring::connect_pairs(rank, &send_mesh, &recv_mesh, &send_qpns, &recv_qpns)?;
    // Every queue pair is connected before anyone writes.
    node.all_gather(&format!("mq/wr lane {} wired", lane.lane), &())?;
    let peers = send_mesh.peers.clone();
    let at = |r: usize, rkey: u32, word: usize| RemoteAddr {
        node: peers[r],
        rkey,
        offset: word as u64 * 8,
    };
    let sender = WrSender {
        id: lane.endpoint_id(rank),
        nodes,
        timeout: config.timeout,
        layout,
        notify: config.notify,
        buf_bytes,
        ctrl: send_ctrl,
        st: Mutex::new(SendSide {
            mesh: send_mesh,
            circ: send_circ,
            free: (0..nodes).map(|_| Consumer::new(layout.cap)).collect(),
            free_report: (0..nodes)
                .map(|j| at(j, all[j].recv_ctrl, layout.index_word(rank)))
                .collect(),
            remote_free: vec![VecDeque::new(); nodes],
            valid: (0..nodes).map(|_| Producer::new(layout.cap)).collect(),
            valid_at: (0..nodes)
                .map(|j| at(j, all[j].recv_ctrl, layout.ring_word(rank)))
                .collect(),
            inflight: HashMap::new(),
            next_local: 0,
            ended: false,
            end_sent: vec![false; nodes],
        }),
    };
    let zero = recv_ctrl.buf(0, 0);
    let receiver = WrReceiver {
        id: lane.endpoint_id(rank),
        nodes,
        timeout: config.timeout,
        layout,
        notify: config.notify,
        policy: config.buffering,
        ctrl: recv_ctrl,
        sources: (0..nodes).map(|r| lane.endpoint_id(r)).collect(),
        zero,
        st: Mutex::new(RecvSide {
            mesh: recv_mesh,
            circ: recv_circ,
            slots: Vec::new(),
            free_slots: Vec::new(),
            advertised: vec![VecDeque::new(); nodes],
            target: vec![config.buffering.initial().max(1); nodes],
            free: (0..nodes).map(|_| Producer::new(layout.cap)).collect(),
            free_at: (0..nodes)
                .map(|i| at(i, all[i].send_ctrl, layout.ring_word(rank)))
                .collect(),
            valid: (0..nodes).map(|_| Consumer::new(layout.cap)).collect(),
            valid_report: (0..nodes)
                .map(|i| at(i, all[i].send_ctrl, layout.index_word(rank)))
                .collect(),
            recv_posted: vec![0; nodes],
            ready: VecDeque::new(),
            ended: vec![false; nodes],
            n_ended: 0,
            failed: vec![None; nodes],
        }),
    };
    receiver.top_up(&mut lock(&receiver.st))?;
    Ok((Arc::new(sender), Arc::new(receiver)))
}

struct WrSender {
    id: u32,
    nodes: usize,
    timeout: Duration,
    layout: Layout,
    notify: Notify,
    buf_bytes: u32,
    /// FreeArr rings (one per receiver) and the consumed counts of ValidArr rings.
    ctrl: Arc<Region>,
    st: Mutex<SendSide>,
}

struct SendSide {
    mesh: Mesh,
    circ: Circulation,
    free: Vec<Consumer>,
    free_report: Vec<RemoteAddr>,
    /// Advertised remote buffers not used yet, per receiver: (key, slot).
    remote_free: Vec<VecDeque<(u64, u32)>>,
    valid: Vec<Producer>,
    valid_at: Vec<RemoteAddr>,
    /// Local buffers being written, by id, with the WRITEs still to complete.
    inflight: HashMap<u64, (Buffer, usize)>,
    next_local: u64,
    ended: bool,
    /// Receivers this stream's end was written to.
    end_sent: Vec<bool>,
}

impl WrSender {
    fn progress(&self, s: &mut SendSide) -> Result<()> {
        let mut back = Vec::new();
        let polled = s.mesh.poll()?;
        for &wc in &polled {
            // A receiver that has this stream's end may finish and go away before the
            // acknowledgement of the end (or of a write before it) comes back: no error.
            if wc.status != WcStatus::Success && !s.mesh.peer_of(&wc).is_some_and(|p| s.end_sent[p])
            {
                return Err(ring::completion_error("an RDMA WRITE to a receiver", &wc));
            }
            if wc.wr_id & WR_DATA != 0 {
                let id = wc.wr_id & !WR_DATA;
                if let Some(entry) = s.inflight.get_mut(&id) {
                    entry.1 -= 1;
                    if entry.1 == 0 {
                        back.push(s.inflight.remove(&id).expect("present").0);
                    }
                }
            }
        }
        s.mesh.reuse(polled);
        if !back.is_empty() {
            s.circ.ready(back);
        }
        let words = self.ctrl.memory().words();
        for j in 0..self.nodes {
            let ring = self.layout.ring(words, j);
            while let Some((key, slot)) = s.free[j].pop(ring) {
                s.remote_free[j].push_back((key, slot));
            }
            if !s.end_sent[j]
                && let Some(n) = s.free[j].report()
            {
                let to = s.free_report[j];
                s.mesh.write_inline(j, WR_REPORT, &n.to_le_bytes(), to)?;
            }
        }
        Ok(())
    }

    /// WRITEs `len` bytes of `src` into the next buffer receiver `d` advertised and
    /// notifies it, waiting for an advertised buffer (and ValidArr room).
    fn transmit(&self, d: usize, src: Src<'_>, wr_id: u64, end: bool) -> Result<()> {
        let mut backoff = Backoff::new(self.timeout);
        let words = self.ctrl.memory().words();
        loop {
            {
                let mut s = lock(&self.st);
                self.progress(&mut s)?;
                let room = self.notify != Notify::MessageQueue || {
                    let consumed = words[self.layout.index_word(d)].load(Ordering::Acquire);
                    s.valid[d].has_room(consumed)
                };
                if room && let Some((key, slot)) = s.remote_free[d].pop_front() {
                    let remote = ring::key_addr(s.mesh.peers[d], key);
                    let len = src.len() as u32;
                    s.end_sent[d] |= end;
                    return match self.notify {
                        Notify::Seal => {
                            let seal = SEAL.to_le_bytes();
                            let at = remote.offset_by((self.buf_bytes - TRAILER_BYTES) as u64);
                            s.mesh.post(
                                d,
                                &[
                                    SendWr::write(wr_id, src, remote),
                                    SendWr::write(WR_MISC, Src::Inline(&seal), at),
                                ],
                            )
                        }
                        Notify::MessageQueue => {
                            let (at, entry) = s.valid[d].push(slot as u64, len);
                            let to = s.valid_at[d].offset_by(at as u64 * 8);
                            let data = SendWr::write(wr_id, src, remote);
                            s.mesh.write_entry(d, Some(data), WR_ENTRY, entry, to)
                        }
                        Notify::CompletionQueue => s
                            .mesh
                            .post(d, &[SendWr::write_imm(wr_id, src, remote, slot)]),
                    };
                }
            }
            if !backoff.wait() {
                return Err(ShuffleError::Timeout {
                    what: format!("a free buffer at rank {d}"),
                    waited: backoff.waited(),
                    counts: None,
                });
            }
        }
    }
}

impl SendEndpoint for WrSender {
    fn id(&self) -> u32 {
        self.id
    }

    fn acquire(&self) -> Result<SendBuf> {
        retry_until(
            self.timeout,
            || "a free send buffer (WRITEs have not completed)".into(),
            || {
                let mut s = lock(&self.st);
                self.progress(&mut s)?;
                Ok(s.circ.take()?.map(|b| SendBuf::new(b, u32::MAX)))
            },
        )
    }

    fn put_data(&self, buf: SendBuf, dests: &[usize], state: State) -> Result<()> {
        check_destinations(dests, self.nodes)?;
        let payload_bytes = buf.payload_bytes();
        let buffer = buf.into_buffer();
        {
            let mut s = lock(&self.st);
            if dests.is_empty() || s.ended {
                if s.ended && !dests.is_empty() {
                    return Err(ShuffleError::Invalid(
                        "put_data after the end of the stream".into(),
                    ));
                }
                s.circ.ready([buffer]);
                if state == State::MoreData {
                    return Ok(());
                }
                if s.ended {
                    return Err(ShuffleError::Invalid("the stream ended twice".into()));
                }
            } else {
                buffer.write_header(&Header {
                    payload_bytes,
                    state: State::MoreData,
                    flags: 0,
                    source: self.id,
                    extra: 0,
                });
                let id = s.next_local;
                s.next_local += 1;
                let local = buffer.local_range(0, HEADER_BYTES + payload_bytes);
                s.inflight.insert(id, (buffer, dests.len()));
                drop(s);
                for &d in dests {
                    self.transmit(d, Src::Buf(local), WR_DATA | id, false)?;
                }
            }
        }
        if state == State::MoreData {
            return Ok(());
        }
        let end = Header {
            payload_bytes: 0,
            state: State::Depleted,
            flags: 0,
            source: self.id,
            extra: 0,
        }
        .encode();
        let mut bytes = [0u8; HEADER_BYTES as usize];
        bytes[..8].copy_from_slice(&end[0].to_le_bytes());
        bytes[8..].copy_from_slice(&end[1].to_le_bytes());
        for d in 0..self.nodes {
            self.transmit(d, Src::Inline(&bytes), WR_MISC, true)?;
        }
        lock(&self.st).ended = true;
        // Linger until every WRITE completed: errors are still this stream's.
        let mut backoff = Backoff::new(self.timeout);
        loop {
            {
                let mut s = lock(&self.st);
                self.progress(&mut s)?;
                if s.inflight.is_empty() && s.mesh.outstanding_total() == 0 {
                    return Ok(());
                }
            }
            if !backoff.wait() {
                return Err(ShuffleError::Timeout {
                    what: "the last WRITEs to complete".into(),
                    waited: backoff.waited(),
                    counts: None,
                });
            }
        }
    }
}

struct WrReceiver {
    id: u32,
    nodes: usize,
    timeout: Duration,
    layout: Layout,
    notify: Notify,
    policy: Buffering,
    /// ValidArr rings (one per sender) and the consumed counts of FreeArr rings.
    ctrl: Arc<Region>,
    sources: Vec<u32>,
    /// What receives for WRITE_WITH_IMM point at: nothing is written there.
    zero: LocalBuf,
    st: Mutex<RecvSide>,
}

struct RecvSide {
    mesh: Mesh,
    circ: Circulation,
    /// Buffers out to senders or to the application, by slot, with their source.
    slots: Vec<Option<(Buffer, usize)>>,
    free_slots: Vec<u32>,
    /// Slots advertised to each sender and not filled yet, oldest first.
    advertised: Vec<VecDeque<u32>>,
    /// Buffers to keep advertised to each sender.
    target: Vec<usize>,
    free: Vec<Producer>,
    free_at: Vec<RemoteAddr>,
    valid: Vec<Consumer>,
    valid_report: Vec<RemoteAddr>,
    recv_posted: Vec<u32>,
    ready: VecDeque<Received>,
    ended: Vec<bool>,
    n_ended: usize,
    /// WRITEs to a sender, or its receives, that failed. A sender that ended its
    /// stream may be gone, which is no error.
    failed: Vec<Option<WcStatus>>,
}

impl WrReceiver {
    /// Advertises buffers to every sender still sending, up to its target.
    fn top_up(&self, s: &mut RecvSide) -> Result<()> {
        let words = self.ctrl.memory().words();
        for i in 0..self.nodes {
            if s.ended[i] || s.failed[i].is_some() {
                continue;
            }
            if s.advertised[i].is_empty()
                && let Buffering::Adaptive { max_per_peer, .. } = self.policy
            {
                // The sender has filled everything it had: it may be starving.
                s.target[i] = (s.target[i] + 1).min(max_per_peer.max(1));
            }
            while s.advertised[i].len() < s.target[i] {
                let consumed = words[self.layout.index_word(i)].load(Ordering::Acquire);
                if !s.free[i].has_room(consumed) {
                    break;
                }
                let Some(buf) = s.circ.take()? else { break };
                if self.notify == Notify::Seal {
                    buf.words()[buf.words().len() - 1].store(0, Ordering::Release);
                }
                if self.notify == Notify::CompletionQueue
                    && s.recv_posted[i] <= s.advertised[i].len() as u32
                {
                    let wrs = [RecvWr {
                        wr_id: WR_RECV,
                        buf: self.zero,
                    }; RECV_BATCH as usize];
                    s.mesh.qps[i].post_recv(&wrs)?;
                    s.recv_posted[i] += RECV_BATCH;
                }
                let key = ring::buffer_key(buf.region().rkey(), buf.offset());
                let slot = match s.free_slots.pop() {
                    Some(slot) => {
                        s.slots[slot as usize] = Some((buf, i));
                        slot
                    }
                    None => {
                        s.slots.push(Some((buf, i)));
                        (s.slots.len() - 1) as u32
                    }
                };
                let (at, entry) = s.free[i].push(key, slot);
                let to = s.free_at[i].offset_by(at as u64 * 8);
                s.mesh.write_entry(i, None, WR_ENTRY, entry, to)?;
                s.advertised[i].push_back(slot);
            }
        }
        Ok(())
    }

    /// A buffer from sender `i` arrived in `slot`.
    fn deliver(&self, s: &mut RecvSide, i: usize, slot: u32) -> Result<()> {
        let malformed = |why: String| ShuffleError::Malformed {
            from: format!("rank {i}"),
            why,
        };
        let Some(pos) = s.advertised[i].iter().position(|&x| x == slot) else {
            return Err(malformed(format!(
                "a notification for slot {slot}, not advertised to it"
            )));
        };
        s.advertised[i].remove(pos);
        let buf = match &s.slots[slot as usize] {
            Some((b, _)) => b.clone(),
            None => return Err(malformed(format!("a notification for empty slot {slot}"))),
        };
        let header = buf
            .read_header(0)
            .filter(|h| {
                h.source == self.sources[i]
                    && h.payload_bytes + HEADER_BYTES + TRAILER_BYTES <= buf.len()
            })
            .ok_or_else(|| malformed("a buffer without a valid header".into()))?;
        if header.state == State::Depleted {
            if !s.ended[i] {
                s.ended[i] = true;
                s.n_ended += 1;
            }
            // Nothing more comes from this sender: take back what it did not use.
            let unused: Vec<u32> = s.advertised[i].drain(..).collect();
            for x in unused {
                self.recycle(s, x);
            }
            if header.payload_bytes == 0 {
                self.recycle(s, slot);
                return Ok(());
            }
        }
        s.ready
            .push_back(Received::new(buf, 0, &header, slot as u64));
        Ok(())
    }

    /// Slot `slot` is free again; its buffer goes back to circulation.
    fn recycle(&self, s: &mut RecvSide, slot: u32) {
        if let Some((buf, _)) = s.slots[slot as usize].take() {
            if self.notify == Notify::Seal {
                buf.words()[buf.words().len() - 1].store(0, Ordering::Release);
            }
            s.free_slots.push(slot);
            s.circ.ready([buf]);
        }
    }

    fn progress(&self, s: &mut RecvSide) -> Result<()> {
        let polled = s.mesh.poll()?;
        for &wc in &polled {
            let peer = s.mesh.peer_of(&wc);
            if wc.status != WcStatus::Success {
                match peer {
                    Some(p) => {
                        s.failed[p].get_or_insert(wc.status);
                    }
                    None => return Err(ring::completion_error("an RDMA WRITE", &wc)),
                }
                continue;
            }
            if wc.opcode == WcOpcode::RecvWriteImm {
                let (Some(p), Some(slot)) = (peer, wc.imm) else {
                    continue;
                };
                s.recv_posted[p] = s.recv_posted[p].saturating_sub(1);
                self.deliver(s, p, slot)?;
            }
        }
        s.mesh.reuse(polled);
        let words = self.ctrl.memory().words();
        match self.notify {
            Notify::CompletionQueue => {}
            Notify::MessageQueue => {
                for i in 0..self.nodes {
                    let ring = self.layout.ring(words, i);
                    let mut popped = false;
                    while let Some((slot, _)) = s.valid[i].pop(ring) {
                        popped = true;
                        self.deliver(s, i, slot as u32)?;
                    }
                    if popped
                        && !s.ended[i]
                        && s.failed[i].is_none()
                        && let Some(n) = s.valid[i].report()
                    {
                        let to = s.valid_report[i];
                        s.mesh.write_inline(i, WR_REPORT, &n.to_le_bytes(), to)?;
                    }
                }
            }
            Notify::Seal => {
                for i in 0..self.nodes {
                    while let Some(&slot) = s.advertised[i].front() {
                        let sealed = s.slots[slot as usize].as_ref().is_some_and(|(b, _)| {
                            b.words()[b.words().len() - 1].load(Ordering::Acquire) == SEAL
                        });
                        if !sealed {
                            break;
                        }
                        self.deliver(s, i, slot)?;
                    }
                }
            }
        }
        self.top_up(s)
    }

    fn check_failed(&self, s: &RecvSide) -> Result<()> {
        match (0..self.nodes).find_map(|p| s.failed[p].filter(|_| !s.ended[p])) {
            Some(status) => Err(ShuffleError::Completion {
                what: "an RDMA WRITE to a sender, or a receive from it",
                status,
            }),
            None => Ok(()),
        }
    }
}

impl RecvEndpoint for WrReceiver {
    fn id(&self) -> u32 {
        self.id
    }

    fn get_data(&self) -> Result<Option<Received>> {
        wait_for_data(
            self.timeout,
            |_| self.try_get_data(),
            |waited| no_data(lock(&self.st).n_ended, self.nodes, waited),
        )
    }

    fn try_get_data(&self) -> Result<Poll<Option<Received>>> {
        let mut s = lock(&self.st);
        self.progress(&mut s)?;
        if let Some(r) = s.ready.pop_front() {
            return Ok(Poll::Ready(Some(r)));
        }
        if s.n_ended == self.nodes && s.mesh.outstanding_total() == 0 {
            return Ok(Poll::Ready(None));
        }
        self.check_failed(&s)?;
        Ok(Poll::Pending)
    }

    fn release(&self, data: Received) -> Result<()> {
        let (buf, token) = data.into_parts();
        let mut s = lock(&self.st);
        let slot = token as u32;
        match &s.slots.get(slot as usize) {
            Some(Some((b, _))) if b.same(&buf) => {}
            _ => {
                return Err(ShuffleError::Invalid(
                    "release of a buffer this endpoint did not return".into(),
                ));
            }
        }
        self.recycle(&mut s, slot);
        self.top_up(&mut s)
    }
}
