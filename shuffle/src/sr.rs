//! The MQ/SR endpoints (§5.2): SEND/RECV over RC, used by SEMQ/SR and MEMQ/SR.
//!
//! Each SEND endpoint has one RC queue pair per destination node and each RECEIVE
//! endpoint one per source node, the sender's QP towards node `d` connected to node
//! `d`'s receiver QP for this node. A node also talks to itself: its sender's QP for
//! its own rank connects to its own receiver's QP for its own rank, two queue pairs of
//! the same device (every backend allows that; this module registers the device as its
//! own peer, which the tcp backend needs to find itself).
//!
//! Flow control is the stateless credit of §5.2 (see [`crate::credit`]): the receiver
//! posts receives per source and RDMA-WRITEs (inline) the absolute number posted into
//! the sender's credit word for it, every `credit_every` releases and whenever it is
//! idle with credit not yet written; the sender waits while `credit[dest] <= sent[dest]`.
//!
//! End of stream: a Depleted put_data sends, after any data, one header-only SEND
//! (inline) to *every* node of the lane carrying in `extra` the number of data messages
//! sent to it. RC delivers in order, so the receiver checks the count at once; it then
//! stops posting and crediting for that source. Send/receive parity: every SEND
//! consumed a credited receive; the receives a finished source never used are counted
//! (`posted - arrived`) and their buffers reclaimed when the endpoint closes.
//!
//! Teardown: a Depleted put_data returns only once every SEND of the endpoint, the
//! ends of stream included, has completed, i.e. been delivered into a receive. Only
//! then may the sender close its queue pairs (and its node its device): the receiver's
//! next credit WRITE to a closed queue pair fails, which puts the receiver's queue pair
//! in error and flushes its receives, and a message not yet delivered by then would be
//! lost. Once the end of stream is in, the receiver expects that flush and ignores it.

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
    Access, Completion, CompletionQueue, LocalBuf, QpConfig, QpEndpoint, QueuePair, RecvWr,
    RemoteAddr, SendWr, Src, WcOpcode,
};
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::Poll;
use std::time::Duration;

/// `wr_id` of a credit WRITE: this bit and the source rank.
const CREDIT_WRITE: u64 = 1 << 62;

/// What a node publishes about one lane.
#[derive(Serialize, Deserialize)]
struct Wiring {
    /// The sender's queue pair towards each destination rank.
    send_qpns: Vec<u32>,
    /// The receiver's queue pair from each source rank.
    recv_qpns: Vec<u32>,
    /// Where the sender's credit words are: word `r` is the credit from rank `r`.
    credit_rkey: u32,
    credit_offset: u64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Opens this node's endpoints of one lane. Collective.
pub(crate) fn open(node: &Node, config: &EndpointConfig, lane: Lane) -> Result<Pair> {
    let dev = node.device();
    let nodes = node.nodes();
    let me = node.rank();
    if config.message_bytes < HEADER_BYTES + crate::buffer::TRAILER_BYTES + 8 {
        return Err(ShuffleError::Invalid(format!(
            "messages of {} bytes hold no payload",
            config.message_bytes
        )));
    }
    // The self-connection: the tcp backend dials peers by address, itself included.
    dev.add_peer(dev.node(), &dev.address())?;

    let initial = config.buffering.initial().max(1);
    let max_per_peer = config.buffering.max_per_peer().max(initial);
    let pool = node.pool(config.message_bytes);

    // Queue depths: a send QP has at most every send buffer and the end of stream
    // outstanding; a receive QP its receives (with the adaptive growth) and the credit
    // WRITEs issued between two polls. The CQs hold all of them.
    let send_depth = max_per_peer * nodes * lane.sharers.max(1) + 16;
    let recv_depth = 2 * max_per_peer + 16;
    let credit_depth = 2 * max_per_peer + 64;
    let cq_size = |n: usize| (n as u32).max(64);
    let send_cq = dev.create_cq(cq_size(send_depth * nodes))?;
    let recv_cq = dev.create_cq(cq_size((recv_depth + credit_depth) * nodes))?;
    let send_qps = (0..nodes)
        .map(|_| {
            let mut c = QpConfig::rc(&send_cq);
            c.max_send_wr = send_depth as u32;
            c.max_recv_wr = 1;
            dev.create_qp(&c)
        })
        .collect::<fabric::Result<Vec<_>>>()?;
    let recv_qps = (0..nodes)
        .map(|_| {
            let mut c = QpConfig::rc(&recv_cq);
            c.max_send_wr = credit_depth as u32;
            c.max_recv_wr = recv_depth as u32;
            dev.create_qp(&c)
        })
        .collect::<fabric::Result<Vec<_>>>()?;
    let credit_region =
        Arc::new(dev.register(8 * nodes as u64, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?);
    let credit_words = Buffer::new(credit_region.clone(), 0, 8 * nodes as u32);

    let mine = Wiring {
        send_qpns: send_qps.iter().map(|q| q.endpoint().qpn).collect(),
        recv_qpns: recv_qps.iter().map(|q| q.endpoint().qpn).collect(),
        credit_rkey: credit_region.rkey(),
        credit_offset: 0,
    };
    let tag = format!("mqsr lane {}/{}", lane.lane, lane.lanes);
    let all: Vec<Wiring> = node.all_gather(&tag, &mine)?;
    for (r, w) in all.iter().enumerate() {
        if w.send_qpns.len() != nodes || w.recv_qpns.len() != nodes {
            return Err(ShuffleError::Malformed {
                from: format!("rank {r}"),
                why: "wiring for a different number of nodes".into(),
            });
        }
    }
    for (d, qp) in send_qps.iter().enumerate() {
        qp.connect(QpEndpoint {
            node: node.fabric_id(d),
            qpn: all[d].recv_qpns[me],
        })?;
    }
    let mut credit_at = Vec::with_capacity(nodes);
    for (s, qp) in recv_qps.iter().enumerate() {
        qp.connect(QpEndpoint {
            node: node.fabric_id(s),
            qpn: all[s].send_qpns[me],
        })?;
        credit_at.push(RemoteAddr {
            node: node.fabric_id(s),
            rkey: all[s].credit_rkey,
            offset: all[s].credit_offset + 8 * me as u64,
        });
    }

    let receiver = SrReceiver {
        id: lane.endpoint_id(me),
        lane,
        timeout: config.timeout,
        pool: pool.clone(),
        cq: recv_cq,
        qps: recv_qps,
        credit_at,
        state: Mutex::new(RecvState {
            book: RecvBook::new(nodes, config.buffering, config.credit_every),
            slots: HashMap::new(),
            next_wr: 0,
            ready: VecDeque::new(),
        }),
    };
    {
        let mut st = lock(&receiver.state);
        for s in 0..nodes {
            for _ in 0..initial {
                receiver.post_one(&mut st, s, pool.take()?, false)?;
            }
        }
    }
    let sender = SrSender {
        id: lane.endpoint_id(me),
        timeout: config.timeout,
        payload_capacity: config.message_bytes,
        cq: send_cq,
        qps: send_qps,
        credit_words,
        _credit_region: credit_region,
        state: Mutex::new(SendState {
            circulation: Circulation::new(
                pool.clone(),
                config.buffering,
                nodes * lane.sharers.max(1),
            )?,
            credit: SendCredit::new(nodes, initial as u64),
            inflight: HashMap::new(),
            ends_inflight: 0,
            next_wr: 0,
            depleted: false,
        }),
        pool,
    };
    // Nobody sends before every receiver has posted its initial receives.
    node.all_gather(&format!("{tag} ready"), &())?;
    Ok((Arc::new(sender), Arc::new(receiver)))
}

struct SendState {
    circulation: Circulation,
    credit: SendCredit,
    /// Buffers being transmitted: wr_id → (buffer, SEND completions still to come).
    inflight: HashMap<u64, (Buffer, usize)>,
    /// Ends of stream posted whose completion has not come yet.
    ends_inflight: usize,
    next_wr: u64,
    depleted: bool,
}

struct SrSender {
    id: u32,
    timeout: Duration,
    payload_capacity: u32,
    cq: Arc<dyn CompletionQueue>,
    qps: Vec<Arc<dyn QueuePair>>,
    /// Word `r`: the absolute credit rank `r`'s receiver wrote here.
    credit_words: Buffer,
    _credit_region: Arc<fabric::Region>,
    state: Mutex<SendState>,
    pool: Arc<BufferPool>,
}

impl SrSender {
    /// Polls send completions; buffers whose every SEND completed go back to Wait.
    fn reap(&self, st: &mut SendState) -> Result<()> {
        let mut wcs = [Completion::default(); POLL_BATCH];
        loop {
            let n = credit::poll(&self.cq, &mut wcs)?;
            let mut done = Vec::new();
            for wc in &wcs[..n] {
                if wc.wr_id == CONTROL_WR {
                    // An end of stream: the receiver has it once it finished with us,
                    // and may be gone before our completion is (a tcp ack lost with
                    // the closed connection), so any status will do. A receiver that
                    // did not get it reports the missing end itself.
                    st.ends_inflight = st.ends_inflight.saturating_sub(1);
                    continue;
                }
                credit::check(wc, "a SEND")?;
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

    fn read_credit(&self, st: &mut SendState, dest: usize) {
        let word = self.credit_words.words()[dest].load(std::sync::atomic::Ordering::Acquire);
        st.credit.update(dest, word);
    }

    /// Spends a credit for `dest`, waiting for one, and posts the message under the
    /// lock (so that messages to a destination go out in the order their credit was
    /// taken, and the end of stream counts exactly what went before it).
    fn send_to(&self, dest: usize, what: Outgoing) -> Result<()> {
        let mut backoff = Backoff::new(self.timeout);
        loop {
            {
                let mut st = lock(&self.state);
                self.read_credit(&mut st, dest);
                if st.credit.try_spend(dest) {
                    match what {
                        Outgoing::Data { wr_id, local } => {
                            self.qps[dest].post_send(&[SendWr::send(wr_id, local)])?;
                        }
                        Outgoing::End => {
                            // The data messages to `dest`: every SEND so far but this one.
                            let bytes = credit::header_bytes(&Header {
                                payload_bytes: 0,
                                state: State::Depleted,
                                flags: 0,
                                source: self.id,
                                extra: (st.credit.sent[dest] - 1) as u32,
                            });
                            self.qps[dest]
                                .post_send(&[SendWr::send(CONTROL_WR, Src::Inline(&bytes))])?;
                            st.ends_inflight += 1;
                        }
                    }
                    return Ok(());
                }
                self.reap(&mut st)?;
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

#[derive(Clone, Copy)]
enum Outgoing {
    Data {
        wr_id: u64,
        local: LocalBuf,
    },
    /// The header-only end of stream.
    End,
}

impl SendEndpoint for SrSender {
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
                Ok(st
                    .circulation
                    .take()?
                    .map(|b| SendBuf::new(b, self.payload_capacity)))
            },
        )
    }

    fn put_data(&self, buf: SendBuf, dests: &[usize], state: State) -> Result<()> {
        let nodes = self.qps.len();
        check_destinations(dests, nodes)?;
        {
            let mut st = lock(&self.state);
            if st.depleted {
                return Err(ShuffleError::Invalid(format!(
                    "send endpoint {} already ended its stream",
                    self.id
                )));
            }
            if state == State::Depleted {
                st.depleted = true;
            }
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
                self.send_to(d, Outgoing::Data { wr_id, local })?;
            }
        }
        if state == State::Depleted {
            for d in 0..nodes {
                self.send_to(d, Outgoing::End)?;
            }
            self.drain()?;
        }
        Ok(())
    }
}

impl SrSender {
    /// Waits until every SEND posted so far has completed: delivered (or failed, which
    /// for data is an error). After that, closing the queue pairs loses nothing.
    fn drain(&self) -> Result<()> {
        retry_until(
            self.timeout,
            || {
                let st = lock(&self.state);
                format!(
                    "the completions of the last SENDs at send endpoint {} ({} buffers, \
                     {} ends of stream outstanding)",
                    self.id,
                    st.inflight.len(),
                    st.ends_inflight
                )
            },
            || {
                let mut st = lock(&self.state);
                self.reap(&mut st)?;
                Ok((st.inflight.is_empty() && st.ends_inflight == 0).then_some(()))
            },
        )
    }
}

impl Drop for SrSender {
    fn drop(&mut self) {
        self.qps.clear();
        let st = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        for (_, (b, _)) in st.inflight.drain() {
            self.pool.give(b);
        }
    }
}

struct RecvState {
    book: RecvBook,
    /// Posted receives: wr_id → (source rank, buffer).
    slots: HashMap<u64, (usize, Buffer)>,
    next_wr: u64,
    ready: VecDeque<Received>,
}

struct SrReceiver {
    id: u32,
    lane: Lane,
    timeout: Duration,
    pool: Arc<BufferPool>,
    cq: Arc<dyn CompletionQueue>,
    qps: Vec<Arc<dyn QueuePair>>,
    /// Where each source's sender keeps the credit from this receiver.
    credit_at: Vec<RemoteAddr>,
    state: Mutex<RecvState>,
}

impl SrReceiver {
    /// Posts `buf` for `source`; writes the credit back when it is due.
    fn post_one(
        &self,
        st: &mut RecvState,
        source: usize,
        buf: Buffer,
        released: bool,
    ) -> Result<()> {
        let wr_id = st.next_wr;
        st.next_wr += 1;
        self.qps[source].post_recv(&[RecvWr {
            wr_id,
            buf: buf.local(),
        }])?;
        st.slots.insert(wr_id, (source, buf));
        if released && st.book.posted_one(source, true) {
            self.write_credit(st, source)?;
        } else if !released {
            st.book.owned[source] += 1;
            st.book.posted_one(source, false);
        }
        Ok(())
    }

    fn write_credit(&self, st: &mut RecvState, source: usize) -> Result<()> {
        if let Some(credit) = st.book.take_credit(source) {
            let bytes = credit.to_ne_bytes();
            self.qps[source].post_send(&[SendWr::write(
                CREDIT_WRITE | source as u64,
                Src::Inline(&bytes),
                self.credit_at[source],
            )])?;
        }
        Ok(())
    }

    /// Takes in completions; returns how many data messages arrived.
    fn poll(&self, st: &mut RecvState) -> Result<usize> {
        let mut wcs = [Completion::default(); POLL_BATCH];
        let mut arrived = 0;
        loop {
            let n = credit::poll(&self.cq, &mut wcs)?;
            for wc in &wcs[..n] {
                // Once a source's stream has wholly arrived, its sender may close its
                // queue pair, which fails a credit WRITE still on the way and flushes
                // our receives left for it: nothing is lost then. Its end of stream may
                // be in this very batch, before `settle` marks it finished.
                if wc.opcode == WcOpcode::Write || wc.wr_id & CREDIT_WRITE != 0 {
                    let source = (wc.wr_id & !CREDIT_WRITE) as usize;
                    if !(source < st.book.nodes() && st.book.complete(source)) {
                        credit::check(wc, "a credit WRITE")?;
                    }
                    continue;
                }
                let Some((source, buf)) = st.slots.remove(&wc.wr_id) else {
                    credit::check(wc, "a RECV")?;
                    continue;
                };
                if !wc.status.is_ok() && st.book.complete(source) {
                    st.book.owned[source] -= 1;
                    self.pool.give(buf);
                    continue;
                }
                credit::check(wc, "a RECV")?;
                arrived += self.arrival(st, source, buf, wc.byte_len)? as usize;
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

    /// A message from `source` landed in `buf`; whether it was data.
    fn arrival(&self, st: &mut RecvState, source: usize, buf: Buffer, len: u32) -> Result<bool> {
        let malformed = |why: String| ShuffleError::Malformed {
            from: format!("rank {source}"),
            why,
        };
        let header = buf
            .read_header(0)
            .ok_or_else(|| malformed("not a message header".into()))?;
        if header.source != self.lane.endpoint_id(source) {
            return Err(malformed(format!(
                "source endpoint {} on the connection of endpoint {}",
                header.source,
                self.lane.endpoint_id(source)
            )));
        }
        if header.payload_bytes % 8 != 0 || HEADER_BYTES + header.payload_bytes > len {
            return Err(malformed(format!(
                "{} payload bytes in a message of {len}",
                header.payload_bytes
            )));
        }
        match header.state {
            State::MoreData => {
                st.book.arrival(source, true);
                st.ready
                    .push_back(Received::new(buf, 0, &header, source as u64));
                Ok(true)
            }
            State::Depleted => {
                st.book.arrival(source, false);
                st.book.end(source, header.extra as u64)?;
                if st.book.data[source] != header.extra as u64 {
                    return Err(malformed(format!(
                        "end of stream after {} messages announced {}",
                        st.book.data[source], header.extra
                    )));
                }
                st.book.owned[source] -= 1;
                self.pool.give(buf);
                Ok(false)
            }
        }
    }

    fn flush_credits(&self, st: &mut RecvState) -> Result<()> {
        for s in 0..self.qps.len() {
            if !st.book.finished[s] {
                self.write_credit(st, s)?;
            }
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
            self.flush_credits(st)?;
        }
        Ok(Poll::Pending)
    }
}

impl RecvEndpoint for SrReceiver {
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
        if source >= self.qps.len() {
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

impl Drop for SrReceiver {
    fn drop(&mut self) {
        // Receives never matched (parity): reclaimed once their queue pairs are gone.
        self.qps.clear();
        let st = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        for (_, (_, b)) in st.slots.drain() {
            self.pool.give(b);
        }
    }
}
