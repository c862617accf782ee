//! The MQ/RD endpoints (§5.4, Algorithm 4): the receiver READs from the sender's
//! buffers.
//!
//! Every lane endpoint has an RC queue pair to every rank's lane endpoint (its own
//! node's included). Two rings per (sender, receiver) pair (see [`crate::ring`]):
//!
//! - **ValidArr**, at the receiver: PUTDATA writes the key (rkey and offset) and the
//!   length of a filled buffer there for every destination. The end of the stream is
//!   an entry of its own (the [`END`] flag), after the last buffer.
//! - **FreeArr**, at the sender: RELEASE writes the key of the remote buffer back.
//!   A buffer returns to the sender's [`Circulation`] once every destination freed it.
//!
//! GETDATA takes ValidArr entries, READs each buffer (header and payload) into a local
//! buffer of its own circulation and returns it. A sender that ends its stream waits
//! until all of its buffers were read and freed: the buffers are its memory, and a
//! receiver may still be reading them after the sender's last PUTDATA.
//!
//! **The node's own partition is not copied.** A ValidArr entry from the receiver's
//! own rank names a buffer of the sender of the same lane, in this process: READing
//! it would only copy local memory into other local memory. The sender hands such a
//! buffer to its receiver through a [`Handoff`] (keyed like the ValidArr entry) before
//! it writes the entry, and GETDATA returns the sender's buffer itself, read in place
//! through its atomic words. Everything else is as for a remote source: the entry
//! travels through the ValidArr ring (the loopback queue pair), RELEASE writes the key
//! back to FreeArr, and the sender reuses the buffer only once every destination freed
//! it. OpenMPI treats a rank's own block of an Alltoallv the same way (a local copy,
//! not a message); the paper does not single out a node's own partition (its
//! repartition sends to every node, the sender included, through the NIC).

use crate::buffer::{Buffer, HEADER_BYTES, Header, Received, SendBuf, State};
use crate::endpoint::{
    Backoff, EndpointConfig, Lane, Pair, RecvEndpoint, SendEndpoint, check_destinations, no_data,
    retry_until, wait_for_data,
};
use crate::error::{Result, ShuffleError};
use crate::node::Node;
use crate::pool::Circulation;
use crate::ring::{self, Consumer, Layout, Mesh, Producer};
use fabric::{Access, Region, RemoteAddr, SendWr, WcStatus};
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::Poll;
use std::time::Duration;

/// The auxiliary bits of a ValidArr entry that mark the end of a stream; otherwise the
/// auxiliary value is the number of bytes to READ.
const END: u32 = 1 << 31;
/// Work request ids: ring entries, index write-backs, READs (with the read's id).
const WR_ENTRY: u64 = 1;
const WR_REPORT: u64 = 2;
const WR_READ: u64 = 1 << 63;

/// Buffers the sender of a lane gives to the receiver of the same lane, by ValidArr
/// key: its own rank's share, which the receiver reads in place instead of READing.
type Handoff = Arc<Mutex<HashMap<u64, Buffer>>>;

/// What a rank tells the others when a lane opens.
#[derive(Serialize, Deserialize)]
struct Wiring {
    send_qpns: Vec<u32>,
    recv_qpns: Vec<u32>,
    send_ctrl: u32,
    recv_ctrl: u32,
    cap: u64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
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
    let send_circ = Circulation::new(pool.clone(), config.buffering, nodes)?;
    let recv_circ = Circulation::new(pool, config.buffering, nodes)?;
    let mine = Wiring {
        send_qpns: send_mesh.qpns(),
        recv_qpns: recv_mesh.qpns(),
        send_ctrl: send_ctrl.rkey(),
        recv_ctrl: recv_ctrl.rkey(),
        cap: layout.cap,
    };
    let all: Vec<Wiring> = node.all_gather(&format!("mq/rd lane {}", lane.lane), &mine)?;
    if let Some(r) = all.iter().position(|w| w.cap != layout.cap) {
        return Err(ShuffleError::Invalid(format!(
            "rank {r} opened MQ/RD with rings of {} entries, this node {}",
            all[r].cap, layout.cap
        )));
    }
    let send_qpns: Vec<Vec<u32>> = all.iter().map(|w| w.send_qpns.clone()).collect();
    let recv_qpns: Vec<Vec<u32>> = all.iter().map(|w| w.recv_qpns.clone()).collect();
    ring::connect_pairs(rank, &send_mesh, &recv_mesh, &send_qpns, &recv_qpns)?;
    // Every queue pair is connected before anyone writes.
    node.all_gather(&format!("mq/rd lane {} wired", lane.lane), &())?;
    let peers = send_mesh.peers.clone();
    let handoff: Handoff = Arc::default();
    let at = |r: usize, rkey: u32, word: usize| RemoteAddr {
        node: peers[r],
        rkey,
        offset: word as u64 * 8,
    };
    let sender = RdSender {
        id: lane.endpoint_id(rank),
        rank,
        handoff: handoff.clone(),
        nodes,
        timeout: config.timeout,
        layout,
        ctrl: send_ctrl,
        st: Mutex::new(SendSide {
            mesh: send_mesh,
            circ: send_circ,
            valid: (0..nodes).map(|_| Producer::new(layout.cap)).collect(),
            valid_at: (0..nodes)
                .map(|j| at(j, all[j].recv_ctrl, layout.ring_word(rank)))
                .collect(),
            free: (0..nodes).map(|_| Consumer::new(layout.cap)).collect(),
            free_report: (0..nodes)
                .map(|j| at(j, all[j].recv_ctrl, layout.index_word(rank)))
                .collect(),
            inflight: HashMap::new(),
            ended: false,
            end_sent: vec![false; nodes],
        }),
    };
    let receiver = RdReceiver {
        id: lane.endpoint_id(rank),
        rank,
        handoff,
        nodes,
        timeout: config.timeout,
        layout,
        ctrl: recv_ctrl,
        sources: (0..nodes).map(|r| lane.endpoint_id(r)).collect(),
        st: Mutex::new(RecvSide {
            mesh: recv_mesh,
            circ: recv_circ,
            valid: (0..nodes).map(|_| Consumer::new(layout.cap)).collect(),
            valid_report: (0..nodes)
                .map(|i| at(i, all[i].send_ctrl, layout.index_word(rank)))
                .collect(),
            free: (0..nodes).map(|_| Producer::new(layout.cap)).collect(),
            free_at: (0..nodes)
                .map(|i| at(i, all[i].send_ctrl, layout.ring_word(rank)))
                .collect(),
            pending: VecDeque::new(),
            reading: HashMap::new(),
            next_read: 0,
            ready: VecDeque::new(),
            held: HashMap::new(),
            ended: vec![false; nodes],
            n_ended: 0,
            failed: vec![None; nodes],
        }),
    };
    Ok((Arc::new(sender), Arc::new(receiver)))
}

struct RdSender {
    id: u32,
    rank: usize,
    /// This rank's share, for the receiver of this lane.
    handoff: Handoff,
    nodes: usize,
    timeout: Duration,
    layout: Layout,
    /// FreeArr rings (one per receiver) and the consumed counts of ValidArr rings.
    ctrl: Arc<Region>,
    st: Mutex<SendSide>,
}

struct SendSide {
    mesh: Mesh,
    circ: Circulation,
    /// ValidArr at each receiver.
    valid: Vec<Producer>,
    valid_at: Vec<RemoteAddr>,
    /// FreeArr from each receiver, here.
    free: Vec<Consumer>,
    /// Where each receiver wants the consumed count of its FreeArr here.
    free_report: Vec<RemoteAddr>,
    /// Buffers out for reading, by key, with the receivers that have yet to free them.
    inflight: HashMap<u64, (Buffer, usize)>,
    ended: bool,
    /// Receivers this stream's end was written to.
    end_sent: Vec<bool>,
}

impl RdSender {
    /// Polls completions and FreeArr rings; returns freed buffers to circulation.
    fn progress(&self, s: &mut SendSide) -> Result<()> {
        let polled = s.mesh.poll()?;
        for &wc in &polled {
            // A receiver that has this stream's end may finish and go away before the
            // acknowledgement of the end (or of a write before it) comes back: no error.
            if wc.status != WcStatus::Success && !s.mesh.peer_of(&wc).is_some_and(|p| s.end_sent[p])
            {
                return Err(ring::completion_error(
                    "an RDMA WRITE to a receiver's ValidArr",
                    &wc,
                ));
            }
        }
        s.mesh.reuse(polled);
        let words = self.ctrl.memory().words();
        let mut back = Vec::new();
        for j in 0..self.nodes {
            let ring = self.layout.ring(words, j);
            while let Some((key, _)) = s.free[j].pop(ring) {
                let Some(entry) = s.inflight.get_mut(&key) else {
                    return Err(ShuffleError::Malformed {
                        from: format!("rank {j}"),
                        why: format!("freed buffer {key:#x}, which is not out for reading"),
                    });
                };
                entry.1 -= 1;
                if entry.1 == 0 {
                    back.push(s.inflight.remove(&key).expect("present").0);
                }
            }
            // After the end of the stream a receiver is free to go: write nothing more
            // to it (the ring has room for every buffer still out).
            if !s.end_sent[j]
                && let Some(n) = s.free[j].report()
            {
                let to = s.free_report[j];
                s.mesh.write_inline(j, WR_REPORT, &n.to_le_bytes(), to)?;
            }
        }
        if !back.is_empty() {
            s.circ.ready(back);
        }
        Ok(())
    }

    /// Writes a ValidArr entry to receiver `d`, waiting for room.
    fn push(&self, d: usize, value: u64, aux: u32) -> Result<()> {
        let mut backoff = Backoff::new(self.timeout);
        let words = self.ctrl.memory().words();
        loop {
            {
                let mut s = lock(&self.st);
                let consumed = words[self.layout.index_word(d)].load(Ordering::Acquire);
                if s.valid[d].has_room(consumed) {
                    let (at, entry) = s.valid[d].push(value, aux);
                    let to = s.valid_at[d].offset_by(at as u64 * 8);
                    s.mesh.write_entry(d, None, WR_ENTRY, entry, to)?;
                    s.end_sent[d] |= aux & END != 0;
                    return Ok(());
                }
                self.progress(&mut s)?;
            }
            if !backoff.wait() {
                return Err(ShuffleError::Timeout {
                    what: format!("room in rank {d}'s ValidArr"),
                    waited: backoff.waited(),
                    counts: None,
                });
            }
        }
    }
}

impl SendEndpoint for RdSender {
    fn id(&self) -> u32 {
        self.id
    }

    fn acquire(&self) -> Result<SendBuf> {
        retry_until(
            self.timeout,
            || "a free send buffer (receivers have not freed theirs)".into(),
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
                let key = ring::buffer_key(buffer.region().rkey(), buffer.offset());
                if dests.contains(&self.rank) {
                    // Before the ValidArr entry is written: the receiver looks it up
                    // when the entry arrives.
                    lock(&self.handoff).insert(key, buffer.clone());
                }
                s.inflight.insert(key, (buffer, dests.len()));
                drop(s);
                for &d in dests {
                    self.push(d, key, HEADER_BYTES + payload_bytes)?;
                }
            }
        }
        if state == State::MoreData {
            return Ok(());
        }
        for d in 0..self.nodes {
            self.push(d, 0, END)?;
        }
        lock(&self.st).ended = true;
        // Linger until every buffer was read and freed and every WRITE completed.
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
                let s = lock(&self.st);
                return Err(ShuffleError::Timeout {
                    what: format!(
                        "receivers to read and free the last {} buffers",
                        s.inflight.len()
                    ),
                    waited: backoff.waited(),
                    counts: None,
                });
            }
        }
    }
}

struct RdReceiver {
    id: u32,
    rank: usize,
    /// The buffers of this rank's sender of this lane, read in place.
    handoff: Handoff,
    nodes: usize,
    timeout: Duration,
    layout: Layout,
    /// ValidArr rings (one per sender) and the consumed counts of FreeArr rings.
    ctrl: Arc<Region>,
    /// The endpoint id of each rank's sender of this lane.
    sources: Vec<u32>,
    st: Mutex<RecvSide>,
}

struct RecvSide {
    mesh: Mesh,
    circ: Circulation,
    valid: Vec<Consumer>,
    valid_report: Vec<RemoteAddr>,
    free: Vec<Producer>,
    free_at: Vec<RemoteAddr>,
    /// ValidArr entries waiting for a local buffer: (source rank, key, bytes).
    pending: VecDeque<(usize, u64, u32)>,
    /// READs in flight, by id.
    reading: HashMap<u64, (usize, u64, Buffer)>,
    next_read: u64,
    ready: VecDeque<Received>,
    /// Returned buffers, by token (the read id): their source and remote key.
    held: HashMap<u64, (usize, u64)>,
    ended: Vec<bool>,
    n_ended: usize,
    /// WRITEs to a sender (FreeArr entries, consumed counts) that failed. A sender
    /// that ended its stream may be gone, which is no error.
    failed: Vec<Option<WcStatus>>,
}

impl RdReceiver {
    fn progress(&self, s: &mut RecvSide) -> Result<()> {
        let polled = s.mesh.poll()?;
        for &wc in &polled {
            if wc.wr_id & WR_READ != 0 {
                let id = wc.wr_id & !WR_READ;
                let Some((src, key, buf)) = s.reading.remove(&id) else {
                    continue;
                };
                if wc.status != WcStatus::Success {
                    return Err(ring::completion_error(
                        "an RDMA READ of a sender's buffer",
                        &wc,
                    ));
                }
                let header = buf
                    .read_header(0)
                    .filter(|h| {
                        h.source == self.sources[src] && h.payload_bytes + HEADER_BYTES <= buf.len()
                    })
                    .ok_or_else(|| ShuffleError::Malformed {
                        from: format!("rank {src}"),
                        why: "a READ buffer without a valid header".into(),
                    })?;
                s.held.insert(id, (src, key));
                s.ready.push_back(Received::new(buf, 0, &header, id));
            } else if wc.status != WcStatus::Success {
                match s.mesh.peer_of(&wc) {
                    Some(p) => {
                        s.failed[p].get_or_insert(wc.status);
                    }
                    None => return Err(ring::completion_error("an RDMA WRITE", &wc)),
                }
            }
        }
        s.mesh.reuse(polled);
        let words = self.ctrl.memory().words();
        for i in 0..self.nodes {
            let ring = self.layout.ring(words, i);
            let mut popped = false;
            while let Some((key, aux)) = s.valid[i].pop(ring) {
                popped = true;
                if aux & END != 0 {
                    if !s.ended[i] {
                        s.ended[i] = true;
                        s.n_ended += 1;
                    }
                } else if i == self.rank {
                    self.take_local(s, key, aux)?;
                } else {
                    s.pending.push_back((i, key, aux));
                }
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
        while let Some(&(src, key, bytes)) = s.pending.front() {
            let Some(buf) = s.circ.take()? else { break };
            s.pending.pop_front();
            if bytes > buf.len() || bytes < HEADER_BYTES {
                return Err(ShuffleError::Malformed {
                    from: format!("rank {src}"),
                    why: format!("a buffer of {bytes} bytes to read"),
                });
            }
            let id = s.next_read;
            s.next_read += 1;
            let remote = ring::key_addr(s.mesh.peers[src], key);
            s.mesh.post(
                src,
                &[SendWr::read(
                    WR_READ | id,
                    buf.local_range(0, bytes),
                    remote,
                )],
            )?;
            s.reading.insert(id, (src, key, buf));
        }
        Ok(())
    }

    /// A ValidArr entry from this rank: the buffer is this lane's sender's, in this
    /// process, and is returned as it is instead of READ into one of ours.
    fn take_local(&self, s: &mut RecvSide, key: u64, bytes: u32) -> Result<()> {
        let malformed = |why: String| ShuffleError::Malformed {
            from: format!("rank {} (this node)", self.rank),
            why,
        };
        let buf = lock(&self.handoff)
            .remove(&key)
            .ok_or_else(|| malformed(format!("buffer {key:#x} was not handed over")))?;
        let header = buf
            .read_header(0)
            .filter(|h| {
                h.source == self.sources[self.rank]
                    && h.payload_bytes + HEADER_BYTES == bytes
                    && bytes <= buf.len()
            })
            .ok_or_else(|| malformed(format!("buffer {key:#x} without a valid header")))?;
        let id = s.next_read;
        s.next_read += 1;
        s.held.insert(id, (self.rank, key));
        s.ready.push_back(Received::new(buf, 0, &header, id));
        Ok(())
    }

    /// A failed WRITE to a sender that has not ended: the sender is gone.
    fn check_failed(&self, s: &RecvSide) -> Result<()> {
        match (0..self.nodes).find_map(|p| s.failed[p].filter(|_| !s.ended[p])) {
            Some(status) => Err(ShuffleError::Completion {
                what: "an RDMA WRITE to a sender",
                status,
            }),
            None => Ok(()),
        }
    }
}

impl RecvEndpoint for RdReceiver {
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
        // Every stream ended and was read; once the last FreeArr entries have landed
        // (the senders wait for them) there is nothing more.
        if s.n_ended == self.nodes
            && s.pending.is_empty()
            && s.reading.is_empty()
            && s.mesh.outstanding_total() == 0
        {
            return Ok(Poll::Ready(None));
        }
        self.check_failed(&s)?;
        Ok(Poll::Pending)
    }

    fn release(&self, data: Received) -> Result<()> {
        let (buf, token) = data.into_parts();
        let (src, key) = {
            let mut s = lock(&self.st);
            let Some(held) = s.held.remove(&token) else {
                return Err(ShuffleError::Invalid(
                    "release of a buffer this endpoint did not return".into(),
                ));
            };
            // A buffer of this rank's sender goes back to it through FreeArr only.
            if held.0 != self.rank {
                s.circ.ready([buf]);
            }
            held
        };
        let words = self.ctrl.memory().words();
        let mut backoff = Backoff::new(self.timeout);
        loop {
            {
                let mut s = lock(&self.st);
                if s.failed[src].is_some() {
                    // The sender ended and went away, or it is dead: then say so.
                    return self.check_failed(&s);
                }
                let consumed = words[self.layout.index_word(src)].load(Ordering::Acquire);
                if s.free[src].has_room(consumed) {
                    let (at, entry) = s.free[src].push(key, 0);
                    let to = s.free_at[src].offset_by(at as u64 * 8);
                    return s.mesh.write_entry(src, None, WR_ENTRY, entry, to);
                }
                self.progress(&mut s)?;
            }
            if !backoff.wait() {
                return Err(ShuffleError::Timeout {
                    what: format!("room in rank {src}'s FreeArr"),
                    waited: backoff.waited(),
                    counts: None,
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exchange::LocalExchange;
    use fabric::Device;
    use fabric::sim::{SimConfig, SimNetwork};

    /// Two nodes; rank 0 sends one buffer to itself and one to rank 1. Its own comes
    /// back as the very buffer it sent (read in place), rank 1's as a copy of it.
    #[test]
    fn a_nodes_own_buffer_is_read_in_place_and_a_peers_is_read_into_a_copy() {
        let net = SimNetwork::new(SimConfig::default());
        let config = EndpointConfig {
            message_bytes: 512,
            timeout: Duration::from_secs(15),
            ..EndpointConfig::default()
        };
        let lane = Lane {
            lane: 0,
            lanes: 1,
            sharers: 1,
        };
        let exchanges = LocalExchange::group(2, Duration::from_secs(30));
        std::thread::scope(|s| {
            for x in exchanges {
                let device = net.add_node() as Arc<dyn Device>;
                let (config, lane) = (&config, lane);
                s.spawn(move || {
                    let node = Node::join(device, Arc::new(x), 1 << 30).unwrap();
                    let rank = node.rank();
                    let (send, recv) = open(&node, config, lane).unwrap();
                    let mut sent = Vec::new();
                    if rank == 0 {
                        for (dest, word) in [(0, 100), (1, 200)] {
                            let mut buf = send.acquire().unwrap();
                            assert!(buf.push_tuple(&[word, word + 1]));
                            sent.push(buf.buffer().clone());
                            send.put_data(buf, &[dest], State::MoreData).unwrap();
                        }
                    }
                    let ender = std::thread::spawn(move || {
                        let buf = send.acquire().unwrap();
                        send.put_data(buf, &[], State::Depleted).unwrap();
                    });
                    let mut got = Vec::new();
                    while let Some(data) = recv.get_data().unwrap() {
                        got.push((data.to_words(), data.buffer().clone()));
                        recv.release(data).unwrap();
                    }
                    ender.join().unwrap();
                    assert_eq!(got.len(), 1, "rank {rank}");
                    let (words, buffer) = &got[0];
                    if rank == 0 {
                        assert_eq!(words, &[100, 101]);
                        assert!(
                            buffer.same(&sent[0]),
                            "rank 0 got {buffer:?}, sent {sent:?}"
                        );
                    } else {
                        assert_eq!(words, &[200, 201]);
                    }
                });
            }
        });
    }
}
