//! Queue pairs of the tcp backend: the requester side (encoding batches, reading
//! responses when the completion queue is polled) and the receive queue that the
//! responder delivers into.

use super::TcpNode;
use super::wire::{self, Attach, Op, Request};
use crate::addr::{Access, LocalBuf, QpEndpoint};
use crate::cq::{CqEntry, CqInner, Progress};
use crate::device::{QpKind, QueuePair};
use crate::doorbell::{self, HeldDoorbell};
pub(crate) use crate::engine::Delivery;
use crate::engine::{
    self, Caps, DESTROYED, ERROR, INIT, NewQp, Payload, PostedRecv, READY, state_of,
};
use crate::error::{FabricError, QpState, Result, WcStatus};
use crate::memory;
use crate::registry::{self, RegEntry};
use crate::validate::validate;
use crate::wr::{Completion, RecvWr, SendWr, Src, UD_MTU, WcOpcode, WrOp};
use std::collections::VecDeque;
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicU8, AtomicU32, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

/// A work request posted and not yet completed, in posting order.
struct Inflight {
    wr_id: u64,
    signaled: bool,
    opcode: WcOpcode,
    /// The responder may hold it until a receive is posted ([`may_wait_for_a_receive`]).
    may_wait: bool,
    /// Sent to the responder: resolved by its response. Otherwise resolved locally
    /// with `status` once everything before it has been.
    sent: bool,
    status: WcStatus,
    /// Where a READ's data or an atomic's old value lands.
    result: Option<(Arc<RegEntry>, u64, u32)>,
}

struct Link {
    peer: QpEndpoint,
    stream: Option<TcpStream>,
}

/// Reads of this thread's sockets in a row that found nothing, after which it gives
/// its core away once: the soft-NIC serving them (a memory server's responder thread)
/// may be waiting for it, on a host with fewer cores than busy threads.
const IDLE_READS_BEFORE_YIELD: u32 = 16;

thread_local! {
    static IDLE_READS: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// Counts a read of this thread's sockets that found something (`got`) or nothing,
/// yielding after every [`IDLE_READS_BEFORE_YIELD`] empty ones in a row.
fn note_read(got: bool) {
    IDLE_READS.with(|idle| {
        let n = if got { 0 } else { idle.get() + 1 };
        idle.set(n);
        if n > 0 && n.is_multiple_of(IDLE_READS_BEFORE_YIELD) {
            std::thread::yield_now();
        }
    });
}

/// Whether the responder may hold `op` until a receive is posted (RNR): its silence is
/// then no sign of a dead peer.
fn may_wait_for_a_receive(op: &WrOp<'_>) -> bool {
    matches!(op, WrOp::Send { .. } | WrOp::Write { imm: Some(_), .. })
}

/// Polls of a queue pair whose doorbell is held after which it rings by itself: a
/// round of a thread's coroutines polls it once per coroutine, and a thread that polls
/// it far more without ringing is waiting on it some other way.
const POLLS_BEFORE_A_HELD_DOORBELL_RINGS: u32 = 256;

/// Bytes one read of a queue pair's socket takes at most.
const READ_CHUNK: usize = 64 * 1024;

struct SendSide {
    link: Option<Link>,
    inflight: VecDeque<Inflight>,
    /// Resolved work requests since the last completion.
    unretired: u32,
    /// A local error was found at post time: everything after it is flushed unsent.
    doomed: bool,
    /// Frames in `out` wait for the posting thread's ring (`crate::doorbell`).
    held: bool,
    /// Polls of this queue pair since its doorbell was held.
    polls_while_held: u32,
    /// Since when requests on the wire have gone without a sign of the responder (a
    /// response read, or bytes it took): the transport timer. `None` while nothing is
    /// owed.
    silent_since: Option<Instant>,
    out: Vec<u8>,
    inbuf: Vec<u8>,
    /// What one read of the socket lands in, kept: zeroing 64 KiB anew for every read
    /// was about a sixth of a TPC-W run's time on this backend.
    chunk: Box<[u8]>,
    datagram: Vec<u8>,
    completions: Vec<CqEntry>,
}

pub(crate) struct QpShared {
    me: Weak<QpShared>,
    node: Arc<TcpNode>,
    endpoint: QpEndpoint,
    kind: QpKind,
    caps: Caps,
    state: AtomicU8,
    send_cq: Arc<CqInner>,
    recv_cq: Arc<CqInner>,
    sq_outstanding: Arc<AtomicU32>,
    sq: Mutex<SendSide>,
    rq: Mutex<VecDeque<PostedRecv>>,
    receive_posted: Condvar,
    /// How many of its responders' one-sided requests are touching memory now, and
    /// whether it was destroyed ([`MEMORY_CLOSED`]): changed by read-modify-writes only,
    /// so an entry and the destruction are totally ordered.
    in_memory: AtomicU32,
}

/// [`QpShared::in_memory`]'s mark of a destroyed queue pair.
const MEMORY_CLOSED: u32 = 1 << 31;

/// A responder's one-sided request inside its queue pair's memory gate.
pub(crate) struct InMemory<'a>(&'a AtomicU32);

impl Drop for InMemory<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Release);
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl QpShared {
    pub(crate) fn new(node: Arc<TcpNode>, new: NewQp) -> Arc<QpShared> {
        Arc::new_cyclic(|me| QpShared {
            me: me.clone(),
            node,
            endpoint: new.endpoint,
            kind: new.kind,
            state: AtomicU8::new(new.initial_state()),
            caps: new.caps,
            send_cq: new.send_cq,
            recv_cq: new.recv_cq,
            sq_outstanding: Arc::new(AtomicU32::new(0)),
            sq: Mutex::new(SendSide {
                link: None,
                inflight: VecDeque::new(),
                unretired: 0,
                doomed: false,
                held: false,
                polls_while_held: 0,
                silent_since: None,
                out: Vec::new(),
                inbuf: Vec::new(),
                chunk: vec![0; READ_CHUNK].into_boxed_slice(),
                datagram: Vec::new(),
                completions: Vec::new(),
            }),
            rq: Mutex::new(VecDeque::new()),
            receive_posted: Condvar::new(),
            in_memory: AtomicU32::new(0),
        })
    }

    /// Lets a responder's one-sided request touch memory through this queue pair, if it
    /// is up, until the guard drops. Destroying the queue pair waits for the requests
    /// inside, so once it returned nothing more the peer sent touches memory (a memory
    /// server's fence of a paused compute node relies on it).
    pub(crate) fn enter_memory(&self) -> Option<InMemory<'_>> {
        let before = self.in_memory.fetch_add(1, Ordering::AcqRel);
        let inside = InMemory(&self.in_memory);
        (before & MEMORY_CLOSED == 0 && self.is_up()).then_some(inside)
    }

    pub(crate) fn kind(&self) -> QpKind {
        self.kind
    }

    pub(crate) fn qkey(&self) -> u32 {
        self.caps.qkey
    }

    pub(crate) fn is_up(&self) -> bool {
        self.state.load(Ordering::Acquire) == READY
    }

    fn set_error(&self) {
        let _ = self
            .state
            .compare_exchange(READY, ERROR, Ordering::AcqRel, Ordering::Acquire);
        let mut rq = lock(&self.rq);
        self.flush_receives(&mut rq);
    }

    fn flush_receives(&self, rq: &mut VecDeque<PostedRecv>) {
        for recv in rq.drain(..) {
            self.recv_cq
                .push(engine::flushed_receive(recv.wr_id, self.endpoint.qpn));
        }
    }

    // ------------------------------------------------------------ receive side

    /// Places a message in the next posted receive (called by the responder, or by the
    /// UD receiver with `ud` set, which prepends the GRH).
    pub(crate) fn deliver(
        &self,
        payload: &[u8],
        imm: Option<u32>,
        src: QpEndpoint,
        ud: bool,
    ) -> Delivery {
        let mut rq = lock(&self.rq);
        if !self.is_up() {
            return Delivery::ReceiverDown;
        }
        let Some(recv) = rq.pop_front() else {
            return Delivery::NoReceive;
        };
        let wc = engine::land(
            &recv,
            &Payload::Bytes(payload),
            imm,
            self.endpoint.qpn,
            src,
            ud,
        );
        let landed = wc.status.is_ok();
        self.recv_cq.push(engine::recv_entry(wc, None));
        if !landed {
            self.state.store(ERROR, Ordering::Release);
            self.flush_receives(&mut rq);
            return Delivery::TooSmall;
        }
        Delivery::Delivered
    }

    /// Consumes a receive for a WRITE_WITH_IMM, running `write` only once one is there.
    pub(crate) fn deliver_write_imm(
        &self,
        len: u32,
        imm: Option<u32>,
        src: QpEndpoint,
        write: &dyn Fn(),
    ) -> Delivery {
        let mut rq = lock(&self.rq);
        if !self.is_up() {
            return Delivery::ReceiverDown;
        }
        let Some(recv) = rq.pop_front() else {
            return Delivery::NoReceive;
        };
        write();
        let wc = engine::write_imm_completion(&recv, len, imm, self.endpoint.qpn, src);
        self.recv_cq.push(engine::recv_entry(wc, None));
        Delivery::Delivered
    }

    /// Blocks until a receive may have been posted, or `timeout` passes.
    pub(crate) fn wait_for_receive(&self, timeout: Duration) {
        let rq = lock(&self.rq);
        if rq.is_empty() && self.is_up() {
            let _ = self.receive_posted.wait_timeout(rq, timeout);
        }
    }

    // ------------------------------------------------------------ send side

    fn complete(
        &self,
        side: &mut SendSide,
        wr_id: u64,
        opcode: WcOpcode,
        status: WcStatus,
        byte_len: u32,
    ) {
        let wc = Completion {
            wr_id,
            status,
            opcode,
            byte_len,
            qpn: self.endpoint.qpn,
            ..Completion::default()
        };
        let entry = engine::send_entry(wc, side.unretired, &self.sq_outstanding, None);
        side.completions.push(entry);
        side.unretired = 0;
    }

    /// Resolves one in-flight request with `status`, emitting its completion if it is
    /// signaled or failed; a failure (other than a flush) breaks the queue pair.
    fn resolve(&self, side: &mut SendSide, entry: &Inflight, status: WcStatus, byte_len: u32) {
        side.unretired += 1;
        if status != WcStatus::Success || entry.signaled {
            self.complete(side, entry.wr_id, entry.opcode, status, byte_len);
        }
        if status != WcStatus::Success && status != WcStatus::WrFlush {
            side.doomed = true;
            self.set_error();
        }
    }

    /// Resolves the unsent requests at the head of the queue.
    fn resolve_unsent(&self, side: &mut SendSide) {
        while side.inflight.front().is_some_and(|e| !e.sent) {
            let entry = side.inflight.pop_front().expect("front exists");
            let status = if self.is_up() || entry.status != WcStatus::Success {
                entry.status
            } else {
                WcStatus::WrFlush
            };
            self.resolve(side, &entry, status, 0);
        }
    }

    /// The connection is gone: the oldest request fails as a transport timeout would,
    /// and everything else is flushed.
    ///
    /// An idle queue pair stays up, as on hardware, where only a request that times out
    /// reveals a dead peer: the next request fails instead.
    fn link_lost(&self, side: &mut SendSide) {
        if let Some(link) = side.link.as_mut() {
            link.stream = None;
        }
        if !side.inflight.iter().any(|e| e.sent) {
            return;
        }
        let mut first = true;
        while let Some(entry) = side.inflight.pop_front() {
            let status = if first && entry.sent {
                WcStatus::RetryExceeded
            } else {
                WcStatus::WrFlush
            };
            first = false;
            self.resolve(side, &entry, status, 0);
        }
        side.doomed = true;
        self.set_error();
    }

    /// Reads whatever responses have arrived and resolves their requests.
    fn read_responses(&self, side: &mut SendSide) {
        if side.held && !side.out.is_empty() {
            side.polls_while_held += 1;
            if side.polls_while_held >= POLLS_BEFORE_A_HELD_DOORBELL_RINGS {
                self.flush_out(side);
            }
        }
        let Some(stream) = side.link.as_mut().and_then(|l| l.stream.as_mut()) else {
            return;
        };
        let mut lost = false;
        let mut got = false;
        loop {
            match stream.read(&mut side.chunk[..]) {
                Ok(0) => {
                    lost = true;
                    break;
                }
                Ok(n) => {
                    got = true;
                    side.inbuf.extend_from_slice(&side.chunk[..n]);
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(_) => {
                    lost = true;
                    break;
                }
            }
        }
        note_read(got);
        if got {
            side.silent_since = Some(Instant::now());
        } else if side
            .silent_since
            .is_some_and(|t| t.elapsed() >= self.caps.transport_timeout)
            && !side.inflight.iter().any(|e| e.sent && e.may_wait)
        {
            // The responder neither answered nor took bytes for the whole timeout, and
            // no request of ours may be waiting (RNR) for a receive: a dead or stopped
            // peer, as a NIC's transport retries would conclude.
            lost = true;
        }
        // Frames are applied in place, the bytes taken out of `side` meanwhile.
        let mut inbuf = std::mem::take(&mut side.inbuf);
        let mut consumed = 0;
        loop {
            let body = match wire::next_frame(&inbuf[consumed..]) {
                Ok(Some(body)) => body,
                Ok(None) => break,
                Err(_) => {
                    lost = true;
                    break;
                }
            };
            consumed += 4 + body.len();
            if self.apply_responses(side, body).is_err() {
                lost = true;
                break;
            }
        }
        inbuf.drain(..consumed);
        side.inbuf = inbuf;
        if lost {
            self.link_lost(side);
        }
        if !side.inflight.iter().any(|e| e.sent) {
            side.silent_since = None;
        }
    }

    fn apply_responses(
        &self,
        side: &mut SendSide,
        body: &[u8],
    ) -> std::result::Result<(), wire::WireError> {
        let (kind, count, mut c) = wire::frame_header(body)?;
        if kind != wire::KIND_RESPONSES {
            return Err(wire::WireError(format!(
                "expected responses, got frame kind {kind}"
            )));
        }
        for _ in 0..count {
            let Some(entry) = side.inflight.pop_front() else {
                return Err(wire::WireError("a response to no request".into()));
            };
            if !entry.sent {
                return Err(wire::WireError("a response to a request never sent".into()));
            }
            let status_byte = c.u8("status")?;
            let status = wire::status_from(status_byte)
                .ok_or_else(|| wire::WireError(format!("unknown status {status_byte}")))?;
            let mut byte_len = 0;
            if status == WcStatus::Success {
                match (entry.opcode, &entry.result) {
                    (WcOpcode::Read, Some((region, offset, len))) => {
                        let data = c.take(*len as usize, "READ data")?;
                        memory::copy_in(region.mem.words(), *offset, data);
                        byte_len = *len;
                    }
                    (WcOpcode::CompareSwap | WcOpcode::FetchAdd, Some((region, offset, _))) => {
                        let old = c.take(8, "atomic result")?;
                        memory::copy_in(region.mem.words(), *offset, old);
                        byte_len = 8;
                    }
                    _ => {}
                }
            }
            self.resolve(side, &entry, status, byte_len);
            self.resolve_unsent(side);
        }
        Ok(())
    }

    /// Writes the encoded frames, reading responses whenever the socket is full so that
    /// neither side can block the other.
    fn flush_out(&self, side: &mut SendSide) {
        let out = std::mem::take(&mut side.out);
        let mut written = 0;
        while written < out.len() {
            let Some(stream) = side.link.as_mut().and_then(|l| l.stream.as_mut()) else {
                break;
            };
            match stream.write(&out[written..]) {
                Ok(0) => {
                    self.link_lost(side);
                    break;
                }
                Ok(n) => {
                    written += n;
                    // The responder takes bytes: it is alive, and owes what they hold.
                    side.silent_since = Some(Instant::now());
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    self.read_responses(side);
                    std::thread::yield_now();
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => {
                    self.link_lost(side);
                    break;
                }
            }
        }
        side.out = out;
        side.out.clear();
    }

    fn local(&self, buf: LocalBuf, write: bool) -> std::result::Result<Arc<RegEntry>, WcStatus> {
        let region = registry::lookup(&self.node.regions, buf.lkey)
            .filter(|r| r.live.load(Ordering::Acquire))
            .ok_or(WcStatus::LocalProtection)?;
        let in_bounds = buf
            .offset
            .checked_add(buf.len as u64)
            .is_some_and(|end| end <= region.len);
        if !in_bounds || (write && !region.access.contains(Access::LOCAL_WRITE)) {
            return Err(WcStatus::LocalProtection);
        }
        Ok(region)
    }

    /// Encodes one RC request into the current frame, or returns the local error that
    /// stops it.
    fn encode(
        &self,
        side: &mut SendSide,
        wr: &SendWr<'_>,
    ) -> std::result::Result<Option<(Arc<RegEntry>, u64, u32)>, WcStatus> {
        let payload_from = |src: Src<'_>, out: &mut Vec<u8>| -> std::result::Result<(), WcStatus> {
            match src {
                Src::Inline(d) => out.extend_from_slice(d),
                Src::Buf(b) => {
                    let region = self.local(b, false)?;
                    let at = out.len();
                    out.resize(at + b.len as usize, 0);
                    memory::copy_out(region.mem.words(), b.offset, &mut out[at..]);
                }
            }
            Ok(())
        };
        let header = |op, rkey, offset, len, a, b, imm| Request {
            op,
            rkey,
            offset,
            len,
            a,
            b,
            imm,
            payload: &[],
        };
        let mut payload = Vec::new();
        let (request, result) = match wr.op {
            WrOp::Read { local, remote } => {
                let region = self.local(local, true)?;
                (
                    header(Op::Read, remote.rkey, remote.offset, local.len, 0, 0, 0),
                    Some((region, local.offset, local.len)),
                )
            }
            WrOp::Write { local, remote, imm } => {
                payload_from(local, &mut payload)?;
                let op = if imm.is_some() {
                    Op::WriteImm
                } else {
                    Op::Write
                };
                (
                    header(
                        op,
                        remote.rkey,
                        remote.offset,
                        local.len() as u32,
                        0,
                        0,
                        imm.unwrap_or(0),
                    ),
                    None,
                )
            }
            WrOp::Send { local, imm } => {
                payload_from(local, &mut payload)?;
                let op = if imm.is_some() { Op::SendImm } else { Op::Send };
                (
                    header(op, 0, 0, local.len() as u32, 0, 0, imm.unwrap_or(0)),
                    None,
                )
            }
            WrOp::Cas {
                local,
                remote,
                compare,
                swap,
            } => {
                let region = self.local(local, true)?;
                (
                    header(Op::Cas, remote.rkey, remote.offset, 8, compare, swap, 0),
                    Some((region, local.offset, 8)),
                )
            }
            WrOp::FetchAdd { local, remote, add } => {
                let region = self.local(local, true)?;
                (
                    header(Op::FetchAdd, remote.rkey, remote.offset, 8, add, 0, 0),
                    Some((region, local.offset, 8)),
                )
            }
        };
        wire::put_request(
            &mut side.out,
            &Request {
                payload: &payload,
                ..request
            },
        );
        Ok(result)
    }

    /// Sends a UD datagram; UD completes at once.
    fn send_datagram(&self, side: &mut SendSide, wr: &SendWr<'_>) -> WcStatus {
        let (WrOp::Send { local, imm }, Some(dest)) = (wr.op, wr.dest) else {
            return WcStatus::LocalProtection;
        };
        if local.len() > UD_MTU as u64 {
            return WcStatus::LocalLength;
        }
        let mut payload = Vec::new();
        match local {
            Src::Inline(d) => payload.extend_from_slice(d),
            Src::Buf(b) => match self.local(b, false) {
                Ok(region) => {
                    payload.resize(b.len as usize, 0);
                    memory::copy_out(region.mem.words(), b.offset, &mut payload);
                }
                Err(e) => return e,
            },
        }
        let Some(addr) = self.node.peer(dest.endpoint.node) else {
            return WcStatus::Success;
        };
        let datagram = wire::Datagram {
            dst_qpn: dest.endpoint.qpn,
            qkey: dest.qkey,
            src_node: self.endpoint.node.0,
            src_qpn: self.endpoint.qpn,
            imm,
            payload: &payload,
        };
        wire::encode_datagram(&mut side.datagram, &datagram);
        // UD is unreliable: a datagram the kernel refuses is a datagram lost.
        let _ = self.node.udp.send_to(&side.datagram, addr);
        WcStatus::Success
    }

    fn post_send(&self, wrs: &[SendWr<'_>]) -> Result<()> {
        if self.state.load(Ordering::Acquire) == INIT {
            return Err(FabricError::InvalidState {
                state: QpState::Init,
                action: "posting sends before connect",
            });
        }
        let mut guard = lock(&self.sq);
        let side = &mut *guard;
        self.read_responses(side);
        let peer = side.link.as_ref().map(|l| l.peer.node);
        let room =
            self.caps
                .max_send_wr
                .saturating_sub(self.sq_outstanding.load(Ordering::Acquire)) as usize;
        let mut result = Ok(());
        let mut posted = 0u32;
        let mut frame: Option<(usize, u16)> = None;
        for (index, wr) in wrs.iter().enumerate() {
            let check = if index >= room {
                Err(FabricError::QueueFull {
                    queue: "send",
                    depth: self.caps.max_send_wr,
                })
            } else {
                validate(self.kind, peer, self.caps.max_inline, wr).and_then(|()| {
                    match (self.kind, wr.dest) {
                        (QpKind::Ud, Some(d)) if self.node.peer(d.endpoint.node).is_none() => {
                            Err(FabricError::UnknownPeer(d.endpoint))
                        }
                        _ => Ok(()),
                    }
                })
            };
            if let Err(e) = check {
                result = Err(FabricError::Post {
                    index,
                    source: Box::new(e),
                });
                break;
            }
            posted += 1;
            let opcode = wr.op.opcode();
            let mut entry = Inflight {
                wr_id: wr.wr_id,
                signaled: wr.signaled,
                opcode,
                may_wait: may_wait_for_a_receive(&wr.op),
                sent: false,
                status: WcStatus::WrFlush,
                result: None,
            };
            if side.doomed || !self.is_up() {
                side.inflight.push_back(entry);
                continue;
            }
            if self.kind == QpKind::Ud {
                entry.status = self.send_datagram(side, wr);
                side.inflight.push_back(entry);
                continue;
            }
            if side.link.as_ref().is_none_or(|l| l.stream.is_none()) {
                entry.status = WcStatus::RetryExceeded;
                side.doomed = true;
                side.inflight.push_back(entry);
                continue;
            }
            let (start, count) = *frame
                .get_or_insert_with(|| (wire::begin_frame(&mut side.out, wire::KIND_REQUESTS), 0));
            let mark = side.out.len();
            match self.encode(side, wr) {
                Ok(result) => {
                    entry.sent = true;
                    entry.result = result;
                    frame = Some((start, count + 1));
                    if count + 1 == u16::MAX {
                        wire::finish_frame(&mut side.out, start, count + 1);
                        frame = None;
                    }
                }
                Err(status) => {
                    side.out.truncate(mark);
                    entry.status = status;
                    side.doomed = true;
                }
            }
            side.inflight.push_back(entry);
        }
        match frame {
            Some((start, 0)) => side.out.truncate(start),
            Some((start, count)) => wire::finish_frame(&mut side.out, start, count),
            None => {}
        }
        self.sq_outstanding.fetch_add(posted, Ordering::AcqRel);
        if !side.out.is_empty() {
            if !doorbell::may_hold() {
                self.flush_out(side);
            } else if !side.held {
                match self.me.upgrade() {
                    Some(me) => {
                        side.held = true;
                        side.polls_while_held = 0;
                        doorbell::hold(me);
                    }
                    None => self.flush_out(side),
                }
            }
        }
        self.resolve_unsent(side);
        self.send_cq.push_many(&mut side.completions);
        let waiting = !side.inflight.is_empty();
        drop(guard);
        if waiting && let Some(me) = self.me.upgrade() {
            self.send_cq.add_waiting(me);
        }
        result
    }

    fn post_recv(&self, wrs: &[RecvWr]) -> Result<()> {
        let mut rq = lock(&self.rq);
        for (index, wr) in wrs.iter().enumerate() {
            let reject = |e: FabricError| FabricError::Post {
                index,
                source: Box::new(e),
            };
            let region = self.local(wr.buf, true).map_err(|_| {
                reject(FabricError::InvalidWorkRequest(format!(
                    "receive buffer {:?} is not a registered, writable range",
                    wr.buf
                )))
            })?;
            if rq.len() >= self.caps.max_recv_wr as usize {
                return Err(reject(FabricError::QueueFull {
                    queue: "receive",
                    depth: self.caps.max_recv_wr,
                }));
            }
            rq.push_back(PostedRecv {
                wr_id: wr.wr_id,
                region,
                offset: wr.buf.offset,
                len: wr.buf.len,
            });
            if self.state.load(Ordering::Acquire) == ERROR {
                self.flush_receives(&mut rq);
            }
        }
        self.receive_posted.notify_all();
        Ok(())
    }

    fn dial(&self, peer: QpEndpoint) -> Result<TcpStream> {
        let addr = self
            .node
            .peer(peer.node)
            .ok_or(FabricError::UnknownPeer(peer))?;
        let fail =
            |what: String| FabricError::Backend(format!("connecting to {peer} at {addr}: {what}"));
        let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5))
            .map_err(|e| fail(e.to_string()))?;
        stream.set_nodelay(true).map_err(|e| fail(e.to_string()))?;
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .map_err(|e| fail(e.to_string()))?;
        let attach = Attach {
            src_node: self.endpoint.node.0,
            src_qpn: self.endpoint.qpn,
            dst_qpn: peer.qpn,
            rnr_retry: self.caps.rnr_retry,
            rnr_timer_us: self.caps.rnr_timer.as_micros().min(u32::MAX as u128) as u32,
        };
        let node = wire::client_handshake(&mut stream, &self.node.token, attach).map_err(fail)?;
        if node != peer.node.0 {
            return Err(fail(format!("the peer is node{node}, not {}", peer.node)));
        }
        stream
            .set_read_timeout(None)
            .map_err(|e| fail(e.to_string()))?;
        stream
            .set_nonblocking(true)
            .map_err(|e| fail(e.to_string()))?;
        Ok(stream)
    }

    fn connect(&self, peer: QpEndpoint) -> Result<()> {
        if self.kind != QpKind::Rc {
            return Err(FabricError::InvalidWorkRequest(
                "only RC queue pairs connect".into(),
            ));
        }
        let mut side = lock(&self.sq);
        let raw = self.state.load(Ordering::Acquire);
        if raw != INIT {
            return Err(FabricError::InvalidState {
                state: state_of(raw),
                action: "connect (already connected)",
            });
        }
        let stream = self.dial(peer)?;
        side.link = Some(Link {
            peer,
            stream: Some(stream),
        });
        self.state.store(READY, Ordering::Release);
        Ok(())
    }

    fn recover(&self) -> Result<()> {
        let mut guard = lock(&self.sq);
        let side = &mut *guard;
        if self.state.load(Ordering::Acquire) != ERROR {
            return Ok(());
        }
        // Whatever the old connection still owed is flushed; a fresh connection gives
        // a fresh responder, as RESET → RTS resets the hardware's sequence numbers.
        while let Some(entry) = side.inflight.pop_front() {
            self.resolve(side, &entry, WcStatus::WrFlush, 0);
        }
        self.send_cq.push_many(&mut side.completions);
        side.inbuf.clear();
        side.doomed = false;
        if let Some(link) = side.link.as_mut() {
            link.stream = None;
            let peer = link.peer;
            link.stream = Some(self.dial(peer)?);
        }
        self.state.store(READY, Ordering::Release);
        Ok(())
    }

    fn destroy(&self) {
        self.state.store(DESTROYED, Ordering::Release);
        // A responder's request already past its check finishes first (a copy or an
        // atomic: microseconds).
        self.in_memory.fetch_or(MEMORY_CLOSED, Ordering::AcqRel);
        while self.in_memory.load(Ordering::Acquire) & !MEMORY_CLOSED != 0 {
            std::thread::yield_now();
        }
        let stream = lock(&self.sq).link.take().and_then(|l| l.stream);
        if let Some(stream) = stream {
            close_without_reset(stream);
        }
        self.receive_posted.notify_all();
        self.node.forget_qp(self.endpoint.qpn);
    }
}

/// How long a destroyed queue pair's connection waits for the responder to finish.
const LINGER: Duration = Duration::from_secs(10);

/// Closes a destroyed queue pair's connection without losing the requests written to
/// it. Closing a socket with unread data (responses never polled) is an abortive close:
/// the kernel sends a reset and discards what it has not yet transmitted, so requests
/// that were posted, and accepted by the kernel, would never reach the responder.
/// Instead the write side is shut (the FIN goes after the last request) and responses
/// are discarded until the responder, having executed everything, closes its end; on
/// a thread of its own, because the responder may take a while (an RNR wait) and
/// destroying a queue pair does not wait for its peer.
fn close_without_reset(stream: TcpStream) {
    let _ = stream.shutdown(Shutdown::Write);
    let drain = move || {
        let mut stream = stream;
        if stream.set_nonblocking(false).is_err() || stream.set_read_timeout(Some(LINGER)).is_err()
        {
            return;
        }
        let mut sink = [0u8; 64 * 1024];
        loop {
            match stream.read(&mut sink) {
                Ok(0) => return,
                Ok(_) => {}
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => return,
            }
        }
    };
    // Without a thread the stream is dropped here: a plain close, as before.
    let _ = std::thread::Builder::new()
        .name("tcp-qp-close".into())
        .spawn(drain);
}

impl HeldDoorbell for QpShared {
    fn ring(&self) {
        let mut guard = lock(&self.sq);
        let side = &mut *guard;
        side.held = false;
        if !side.out.is_empty() {
            self.flush_out(side);
        }
        self.resolve_unsent(side);
        self.send_cq.push_many(&mut side.completions);
    }
}

impl Progress for QpShared {
    fn progress(&self) -> bool {
        let mut guard = lock(&self.sq);
        let side = &mut *guard;
        self.read_responses(side);
        self.resolve_unsent(side);
        self.send_cq.push_many(&mut side.completions);
        !side.inflight.is_empty()
    }
}

/// The handle `create_qp` returns. Dropping it destroys the queue pair and closes its
/// connection.
pub(crate) struct TcpQp {
    shared: Arc<QpShared>,
}

impl TcpQp {
    pub(crate) fn new(shared: Arc<QpShared>) -> TcpQp {
        TcpQp { shared }
    }
}

impl Drop for TcpQp {
    fn drop(&mut self) {
        self.shared.destroy();
    }
}

impl QueuePair for TcpQp {
    fn endpoint(&self) -> QpEndpoint {
        self.shared.endpoint
    }
    fn kind(&self) -> QpKind {
        self.shared.kind
    }
    fn state(&self) -> QpState {
        state_of(self.shared.state.load(Ordering::Acquire))
    }
    fn connect(&self, peer: QpEndpoint) -> Result<()> {
        self.shared.connect(peer)
    }
    fn post_send(&self, wrs: &[SendWr<'_>]) -> Result<()> {
        self.shared.post_send(wrs)
    }
    fn send_queue_depth(&self) -> u32 {
        self.shared.caps.max_send_wr
    }
    fn post_recv(&self, wrs: &[RecvWr]) -> Result<()> {
        self.shared.post_recv(wrs)
    }
    fn recover(&self) -> Result<()> {
        self.shared.recover()
    }
}
