//! The SQ/SR endpoints (§5.3): SEND/RECV over UD, used by SESQ/SR and MESQ/SR.
//!
//! A SEND endpoint has one UD queue pair for every destination and a RECEIVE endpoint
//! one for every source (a node's own endpoints included: a datagram to oneself is
//! just another datagram). Messages are at most [`fabric::UD_MTU`] bytes, header
//! included; receive buffers have [`fabric::GRH_BYTES`] in front for the GRH.
//!
//! Flow control is the absolute credit of §5.2 with every source sharing the receive
//! queue: the receiver attributes its posted receives to sources (the credit of a
//! source is the number attributed to it, ever) and tells the source in a small credit
//! datagram, every `credit_every` releases and when idle. UD has no WRITE; a credit
//! datagram may be lost or reordered, which absolute credit makes harmless, and an idle
//! receiver repeats its credit every few milliseconds so a lost one cannot stall a
//! sender. A datagram lost on the way also takes its credit with it: a receiver that
//! has heard nothing from a source for a quarter of the timeout while receives are
//! still attributed to it posts as many again (at most `max_per_peer` in all), so a
//! loss shows up as a count mismatch below, not as a stalled sender.
//!
//! End of stream by counts (§5.3): a Depleted put_data sends every node of the lane a
//! header-only datagram carrying the number of data datagrams sent to it, and a second
//! copy where credit is left over (a lost end of stream is then rarer; the receiver
//! ignores the repeat).
//! The receiver finishes a source once that many arrived, in any order (the end may
//! arrive first); if they do not within the timeout, `get_data` fails with
//! [`ShuffleError::Timeout`] and the counts.

use crate::buffer::{Buffer, HEADER_BYTES, Header, Received, SendBuf, State};
use crate::credit::{self, CONTROL_WR, POLL_BATCH, RecvBook, SendCredit};
use crate::endpoint::{
    Backoff, EndpointConfig, Lane, Pair, RecvEndpoint, SendEndpoint, attempt_while_progressing,
    check_destinations, retry_until, wait_for_data,
};
use crate::error::{Result, ShuffleError};
use crate::node::Node;
use crate::pool::{BufferPool, Circulation};
use fabric::{
    Access, Completion, CompletionQueue, GRH_BYTES, LocalBuf, QpConfig, QpEndpoint, QueuePair,
    RecvWr, Region, SendWr, Src, UD_MTU, UdDest,
};
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::Poll;
use std::time::{Duration, Instant};

/// Header flag of a credit datagram (receiver → sender).
const CREDIT_FLAG: u8 = 1;
/// A credit receive slot: GRH and header.
const CREDIT_SLOT: u32 = 64;
/// Credit receive wr_ids carry this bit.
const CREDIT_WR: u64 = 1 << 62;
/// Copies of the end of stream each destination gets.
const END_COPIES: usize = 2;
/// How often an idle receiver repeats its credit.
const CREDIT_REPEAT: Duration = Duration::from_millis(2);

#[derive(Serialize, Deserialize)]
struct Wiring {
    send_qpn: u32,
    recv_qpn: u32,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Opens this node's endpoints of one lane. Collective.
pub(crate) fn open(node: &Node, config: &EndpointConfig, lane: Lane) -> Result<Pair> {
    let dev = node.device();
    let nodes = node.nodes();
    let me = node.rank();
    dev.add_peer(dev.node(), &dev.address())?;
    let initial = config.buffering.initial().max(1);
    let max_per_peer = config.buffering.max_per_peer().max(initial);
    let send_pool = node.pool(UD_MTU);
    let recv_pool = node.pool(UD_MTU + GRH_BYTES);
    let credit_slots = (4 * nodes + 16) as u32;

    // Queue depths: every send buffer to every node and the ends of stream; receives
    // for every source (with adaptive growth and loss make-up) and the credit
    // datagrams sent between two polls (due ones and the idle repeats).
    let send_depth = (max_per_peer * nodes * lane.sharers.max(1) + END_COPIES + 16) * nodes;
    let recv_depth = 3 * max_per_peer * nodes + 16;
    let credit_depth = (2 * max_per_peer + 64) * nodes;
    let send_cq = dev.create_cq((send_depth + credit_slots as usize) as u32)?;
    let recv_cq = dev.create_cq((recv_depth + credit_depth) as u32)?;
    let mut c = QpConfig::ud(&send_cq);
    c.max_send_wr = send_depth as u32;
    c.max_recv_wr = credit_slots;
    let send_qp = dev.create_qp(&c)?;
    let mut c = QpConfig::ud(&recv_cq);
    c.max_send_wr = credit_depth as u32;
    c.max_recv_wr = recv_depth as u32;
    let recv_qp = dev.create_qp(&c)?;

    let credit_region =
        Arc::new(dev.register((credit_slots * CREDIT_SLOT) as u64, Access::LOCAL_WRITE)?);
    for slot in 0..credit_slots {
        send_qp.post_recv(&[RecvWr {
            wr_id: CREDIT_WR | slot as u64,
            buf: credit_region.buf((slot * CREDIT_SLOT) as u64, CREDIT_SLOT),
        }])?;
    }

    let tag = format!("sqsr lane {}/{}", lane.lane, lane.lanes);
    let all: Vec<Wiring> = node.all_gather(
        &tag,
        &Wiring {
            send_qpn: send_qp.endpoint().qpn,
            recv_qpn: recv_qp.endpoint().qpn,
        },
    )?;
    let to = |r: usize, qpn: u32| UdDest {
        endpoint: QpEndpoint {
            node: node.fabric_id(r),
            qpn,
        },
        qkey: QpConfig::DEFAULT_QKEY,
    };

    let receiver = UdReceiver {
        id: lane.endpoint_id(me),
        lane,
        timeout: config.timeout,
        max_per_peer,
        pool: recv_pool.clone(),
        cq: recv_cq,
        qp: Some(recv_qp),
        senders: (0..nodes).map(|r| to(r, all[r].send_qpn)).collect(),
        state: Mutex::new(RecvState {
            book: RecvBook::new(nodes, config.buffering, config.credit_every),
            slots: HashMap::new(),
            next_wr: 0,
            ready: VecDeque::new(),
            heard: vec![Instant::now(); nodes],
            topped: vec![0; nodes],
            repeated: Instant::now(),
        }),
    };
    {
        let mut st = lock(&receiver.state);
        for s in 0..nodes {
            for _ in 0..initial {
                receiver.post_one(&mut st, s, recv_pool.take()?, false)?;
            }
        }
    }
    let sender = UdSender {
        id: lane.endpoint_id(me),
        lane,
        timeout: config.timeout,
        cq: send_cq,
        qp: Some(send_qp),
        receivers: (0..nodes).map(|r| to(r, all[r].recv_qpn)).collect(),
        credit_region,
        state: Mutex::new(SendState {
            circulation: Circulation::new(
                send_pool.clone(),
                config.buffering,
                nodes * lane.sharers.max(1),
            )?,
            credit: SendCredit::new(nodes, initial as u64),
            data_sent: vec![0; nodes],
            inflight: HashMap::new(),
            next_wr: 0,
            depleted: false,
        }),
        pool: send_pool,
    };
    node.all_gather(&format!("{tag} ready"), &())?;
    Ok((Arc::new(sender), Arc::new(receiver)))
}

struct SendState {
    circulation: Circulation,
    credit: SendCredit,
    /// Data datagrams sent to each destination (what the end of stream announces).
    data_sent: Vec<u64>,
    inflight: HashMap<u64, (Buffer, usize)>,
    next_wr: u64,
    depleted: bool,
}

struct UdSender {
    id: u32,
    lane: Lane,
    timeout: Duration,
    cq: Arc<dyn CompletionQueue>,
    qp: Option<Arc<dyn QueuePair>>,
    /// Each rank's receiver queue pair.
    receivers: Vec<UdDest>,
    credit_region: Arc<Region>,
    state: Mutex<SendState>,
    pool: Arc<BufferPool>,
}

#[derive(Clone, Copy)]
enum Outgoing {
    Data { wr_id: u64, local: LocalBuf },
    End,
}

impl UdSender {
    fn qp(&self) -> &Arc<dyn QueuePair> {
        self.qp.as_ref().expect("open until dropped")
    }

    /// Polls send completions and credit datagrams.
    fn reap(&self, st: &mut SendState) -> Result<()> {
        let mut wcs = [Completion::default(); POLL_BATCH];
        loop {
            let n = credit::poll(&self.cq, &mut wcs)?;
            let mut done = Vec::new();
            for wc in &wcs[..n] {
                if wc.wr_id != CONTROL_WR && wc.wr_id & CREDIT_WR != 0 {
                    credit::check(wc, "a credit RECV")?;
                    self.credit_arrived(st, wc)?;
                    continue;
                }
                credit::check(wc, "a datagram SEND")?;
                if let Some((_, left)) = st.inflight.get_mut(&wc.wr_id) {
                    *left -= 1;
                    if *left == 0 {
                        done.push(st.inflight.remove(&wc.wr_id).expect("present").0);
                    }
                }
            }
            st.circulation.ready(done);
            if n < wcs.len() {
                return Ok(());
            }
        }
    }

    fn credit_arrived(&self, st: &mut SendState, wc: &Completion) -> Result<()> {
        let slot = (wc.wr_id & !CREDIT_WR) as u32;
        let buf = Buffer::new(
            self.credit_region.clone(),
            (slot * CREDIT_SLOT) as u64,
            CREDIT_SLOT,
        );
        let header = (wc.byte_len >= GRH_BYTES + HEADER_BYTES)
            .then(|| buf.read_header(GRH_BYTES))
            .flatten();
        let nodes = self.receivers.len();
        // Anything else that lands here is ignored: datagrams are not ours to trust.
        if let Some(h) = header
            && h.flags & CREDIT_FLAG != 0
            && let Some(rank) = credit::rank_of(h.source, self.lane, nodes)
        {
            st.credit.update(rank, h.extra as u64);
        }
        self.qp().post_recv(&[RecvWr {
            wr_id: wc.wr_id,
            buf: buf.local(),
        }])?;
        Ok(())
    }

    /// Spends a credit for `dest` and posts the message; waits for the credit unless
    /// `best_effort`, in which case it returns `false` at once when there is none.
    fn send_to(&self, dest: usize, what: Outgoing, best_effort: bool) -> Result<bool> {
        let mut backoff = Backoff::new(self.timeout);
        loop {
            {
                let mut st = lock(&self.state);
                self.reap(&mut st)?;
                if st.credit.try_spend(dest) {
                    let to = self.receivers[dest];
                    match what {
                        Outgoing::Data { wr_id, local } => {
                            st.data_sent[dest] += 1;
                            self.qp().post_send(&[SendWr::send(wr_id, local).to(to)])?;
                        }
                        Outgoing::End => {
                            let bytes = credit::header_bytes(&Header {
                                payload_bytes: 0,
                                state: State::Depleted,
                                flags: 0,
                                source: self.id,
                                extra: st.data_sent[dest] as u32,
                            });
                            self.qp().post_send(&[SendWr::send(
                                CONTROL_WR,
                                Src::Inline(&bytes),
                            )
                            .to(to)])?;
                        }
                    }
                    return Ok(true);
                }
                if best_effort {
                    return Ok(false);
                }
            }
            if !backoff.wait() {
                let st = lock(&self.state);
                return Err(ShuffleError::Timeout {
                    what: format!(
                        "credit from rank {dest} at send endpoint {} ({} sent, credit {})",
                        self.id, st.credit.sent[dest], st.credit.credit[dest]
                    ),
                    waited: backoff.waited(),
                    counts: None,
                });
            }
        }
    }
}

impl SendEndpoint for UdSender {
    fn id(&self) -> u32 {
        self.id
    }

    fn acquire(&self) -> Result<SendBuf> {
        retry_until(
            self.timeout,
            || format!("a free buffer at send endpoint {}", self.id),
            || {
                let mut st = lock(&self.state);
                self.reap(&mut st)?;
                Ok(st.circulation.take()?.map(|b| SendBuf::new(b, UD_MTU)))
            },
        )
    }

    fn put_data(&self, buf: SendBuf, dests: &[usize], state: State) -> Result<()> {
        let nodes = self.receivers.len();
        check_destinations(dests, nodes)?;
        {
            let mut st = lock(&self.state);
            if st.depleted {
                return Err(ShuffleError::Invalid(format!(
                    "send endpoint {} already ended its stream",
                    self.id
                )));
            }
            st.depleted = state == State::Depleted;
        }
        let payload = buf.payload_bytes();
        if dests.is_empty() || (payload == 0 && state == State::Depleted) {
            lock(&self.state).circulation.ready([buf.into_buffer()]);
        } else {
            let b = buf.into_buffer();
            b.write_header(&Header {
                payload_bytes: payload,
                state: State::MoreData,
                flags: 0,
                source: self.id,
                extra: 0,
            });
            let local = b.local_range(0, HEADER_BYTES + payload);
            let wr_id = {
                let mut st = lock(&self.state);
                let id = st.next_wr;
                st.next_wr += 1;
                st.inflight.insert(id, (b, dests.len()));
                id
            };
            for &d in dests {
                self.send_to(d, Outgoing::Data { wr_id, local }, false)?;
            }
        }
        if state == State::Depleted {
            // The first copy waits for credit; the others go only where credit is
            // left (a receiver may finish on the first and never credit again).
            for copy in 0..END_COPIES {
                for d in 0..nodes {
                    self.send_to(d, Outgoing::End, copy > 0)?;
                }
            }
        }
        Ok(())
    }
}

impl Drop for UdSender {
    fn drop(&mut self) {
        self.qp = None;
        let st = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        for (_, (b, _)) in st.inflight.drain() {
            self.pool.give(b);
        }
    }
}

struct RecvState {
    book: RecvBook,
    /// Posted receives: wr_id → buffer (the receive queue is shared by all sources).
    slots: HashMap<u64, Buffer>,
    next_wr: u64,
    ready: VecDeque<Received>,
    /// When each source was last heard from.
    heard: Vec<Instant>,
    /// Receives added per source to make up for credit lost with lost datagrams.
    topped: Vec<usize>,
    /// When the credit was last repeated.
    repeated: Instant,
}

struct UdReceiver {
    id: u32,
    lane: Lane,
    timeout: Duration,
    max_per_peer: usize,
    pool: Arc<BufferPool>,
    cq: Arc<dyn CompletionQueue>,
    qp: Option<Arc<dyn QueuePair>>,
    /// Each rank's sender queue pair, for credit datagrams.
    senders: Vec<UdDest>,
    state: Mutex<RecvState>,
}

impl UdReceiver {
    fn qp(&self) -> &Arc<dyn QueuePair> {
        self.qp.as_ref().expect("open until dropped")
    }

    /// Posts `buf`, attributed to `source`; sends the credit when it is due.
    fn post_one(
        &self,
        st: &mut RecvState,
        source: usize,
        buf: Buffer,
        released: bool,
    ) -> Result<()> {
        let wr_id = st.next_wr;
        st.next_wr += 1;
        self.qp().post_recv(&[RecvWr {
            wr_id,
            buf: buf.local(),
        }])?;
        st.slots.insert(wr_id, buf);
        if !released {
            st.book.owned[source] += 1;
        }
        if st.book.posted_one(source, released) {
            self.write_credit(st, source)?;
        }
        Ok(())
    }

    fn send_credit(&self, source: usize, credit: u64) -> Result<()> {
        let bytes = credit::header_bytes(&Header {
            payload_bytes: 0,
            state: State::MoreData,
            flags: CREDIT_FLAG,
            source: self.id,
            extra: credit.min(u32::MAX as u64) as u32,
        });
        self.qp()
            .post_send(&[SendWr::send(CONTROL_WR, Src::Inline(&bytes)).to(self.senders[source])])?;
        Ok(())
    }

    fn write_credit(&self, st: &mut RecvState, source: usize) -> Result<()> {
        if let Some(credit) = st.book.take_credit(source) {
            self.send_credit(source, credit)?;
        }
        Ok(())
    }

    fn poll(&self, st: &mut RecvState) -> Result<usize> {
        let mut wcs = [Completion::default(); POLL_BATCH];
        let mut arrived = 0;
        loop {
            let n = credit::poll(&self.cq, &mut wcs)?;
            for wc in &wcs[..n] {
                if wc.wr_id == CONTROL_WR {
                    credit::check(wc, "a credit SEND")?;
                    continue;
                }
                credit::check(wc, "a datagram RECV")?;
                let Some(buf) = st.slots.remove(&wc.wr_id) else {
                    continue;
                };
                arrived += self.arrival(st, buf, wc.byte_len)? as usize;
            }
            if n < wcs.len() {
                break;
            }
        }
        for s in st.book.end_batch() {
            let buf = self.pool.take()?;
            self.post_one(st, s, buf, false)?;
            self.write_credit(st, s)?;
        }
        st.book.settle();
        Ok(arrived)
    }

    fn arrival(&self, st: &mut RecvState, buf: Buffer, len: u32) -> Result<bool> {
        let nodes = self.senders.len();
        let malformed = |why: String| ShuffleError::Malformed {
            from: format!("a datagram to receive endpoint {}", self.id),
            why,
        };
        if len < GRH_BYTES + HEADER_BYTES {
            return Err(malformed(format!("{len} bytes")));
        }
        let header = buf
            .read_header(GRH_BYTES)
            .ok_or_else(|| malformed("not a message header".into()))?;
        let source = credit::rank_of(header.source, self.lane, nodes).ok_or_else(|| {
            malformed(format!("from endpoint {}, not of this lane", header.source))
        })?;
        if header.flags & CREDIT_FLAG != 0
            || header.payload_bytes % 8 != 0
            || GRH_BYTES + HEADER_BYTES + header.payload_bytes > len
        {
            return Err(malformed(format!(
                "{} payload bytes in {len} (flags {:#x})",
                header.payload_bytes, header.flags
            )));
        }
        st.heard[source] = Instant::now();
        match header.state {
            State::MoreData => {
                st.book.arrival(source, true);
                st.ready
                    .push_back(Received::new(buf, GRH_BYTES, &header, source as u64));
                Ok(true)
            }
            State::Depleted => {
                st.book.arrival(source, false);
                st.book.end(source, header.extra as u64)?;
                st.book.settle();
                if st.book.finished[source] {
                    st.book.owned[source] -= 1;
                    self.pool.give(buf);
                } else {
                    self.post_one(st, source, buf, true)?;
                }
                Ok(false)
            }
        }
    }

    /// What an idle receiver does: write due credit, repeat it now and then (a credit
    /// datagram may have been lost), and make up for credit lost with lost datagrams.
    fn idle(&self, st: &mut RecvState) -> Result<()> {
        let nodes = self.senders.len();
        for s in 0..nodes {
            if !st.book.finished[s] {
                self.write_credit(st, s)?;
            }
        }
        let now = Instant::now();
        if now.duration_since(st.repeated) < CREDIT_REPEAT {
            return Ok(());
        }
        st.repeated = now;
        for s in 0..nodes {
            if st.book.finished[s] {
                continue;
            }
            let outstanding = st.book.outstanding(s) as usize;
            if outstanding > 0
                && now.duration_since(st.heard[s]) > self.timeout / 4
                && st.topped[s] < self.max_per_peer
            {
                let k = outstanding.min(self.max_per_peer - st.topped[s]);
                tracing::debug!(
                    endpoint = self.id,
                    source = s,
                    k,
                    "no datagram for a while: making up for credit lost with them"
                );
                for _ in 0..k {
                    let buf = self.pool.take()?;
                    self.post_one(st, s, buf, false)?;
                }
                st.topped[s] += k;
                st.heard[s] = now;
                self.write_credit(st, s)?;
            }
            self.send_credit(s, st.book.posted[s])?;
        }
        Ok(())
    }

    /// One try of GETDATA; sets `progressed` when it polled something in short of data.
    fn attempt(&self, progressed: &mut bool) -> Result<Poll<Option<Received>>> {
        let mut guard = lock(&self.state);
        let st = &mut *guard;
        if let Some(answer) = credit::ready_or_ended(&mut st.ready, &st.book) {
            return Ok(answer);
        }
        *progressed = self.poll(st)? > 0 || st.book.all_finished();
        if !*progressed {
            self.idle(st)?;
        }
        Ok(Poll::Pending)
    }
}

impl RecvEndpoint for UdReceiver {
    fn id(&self) -> u32 {
        self.id
    }

    fn get_data(&self) -> Result<Option<Received>> {
        wait_for_data(
            self.timeout,
            |progressed| self.attempt(progressed),
            |waited| lock(&self.state).book.timeout(self.id, waited),
        )
    }

    fn try_get_data(&self) -> Result<Poll<Option<Received>>> {
        attempt_while_progressing(|progressed| self.attempt(progressed))
    }

    fn release(&self, data: Received) -> Result<()> {
        let (buf, source) = data.into_parts();
        let source = source as usize;
        let mut st = lock(&self.state);
        if source >= self.senders.len() {
            return Err(ShuffleError::Invalid(format!(
                "a buffer from rank {source} released to receive endpoint {}",
                self.id
            )));
        }
        if st.book.retire_on_release(source) {
            st.book.owned[source] -= 1;
            self.pool.give(buf);
            return Ok(());
        }
        self.post_one(&mut st, source, buf, true)
    }
}

impl Drop for UdReceiver {
    fn drop(&mut self) {
        self.qp = None;
        let st = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        for (_, b) in st.slots.drain() {
            self.pool.give(b);
        }
    }
}
