//! The remote circular queues of the one-sided designs (FreeArr and ValidArr of §5.4
//! and §5.5), and the queue-pair mesh both designs wire their endpoints with.
//!
//! # The ring
//!
//! A single-producer/single-consumer ring of 16-byte entries that lives in the
//! *consumer's* registered memory. The producer writes entry `n` to slot `n mod cap`:
//! word 0 the value, word 1 a 32-bit auxiliary value in its low half and the *stamp*
//! `(n + 1) mod 2³²` in its high half, the entry's last four bytes. Where a WRITE's
//! bytes land in address order (the last word with Release) one WRITE carries it all;
//! where the device does not promise that ([`fabric::Device::orders_write_placement`]:
//! verbs), a first WRITE carries the value and the auxiliary value and a second one,
//! placed after it, the stamp. Either way a consumer that finds the stamp it expects
//! at its slot (loaded with Acquire) also finds the rest; a stale entry of an earlier
//! lap, or never-written zeroes, carry another stamp, and a stamp half-written (rxe
//! under TCG places bytes one by one) reads as the new one only once every byte that
//! differs has landed. The stamp is therefore the ring's published index: there is no
//! separate head word to get out of order with the entry.
//!
//! The consumer writes the count it has consumed back into a word in the *producer's*
//! memory (another WRITE, batched: once per polling pass that consumed anything). The
//! producer never has more than `cap` entries ahead of the last count it saw, so it
//! never overwrites an entry the consumer has not read; and the consumer reports a
//! count only after it has read the entries below it.
//!
//! The protocol half is independent of the fabric ([`Producer`], [`Consumer`] over
//! [`Words`]), which is what the loom model (`tests/loom_ring.rs`) checks.

use crate::error::{Result, ShuffleError};
use crate::node::Node;
use fabric::{
    Completion, CompletionQueue, QpConfig, QpEndpoint, QueuePair, RemoteAddr, SendWr, Src, WcOpcode,
};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// Words per ring entry.
pub const ENTRY_WORDS: usize = 2;
/// Bytes per ring entry.
pub const ENTRY_BYTES: u64 = 8 * ENTRY_WORDS as u64;

/// How the ring protocol touches memory: region words for real rings, loom atomics in
/// the model.
pub trait Words {
    fn load(&self, at: usize, order: Ordering) -> u64;
}

impl Words for [AtomicU64] {
    fn load(&self, at: usize, order: Ordering) -> u64 {
        self[at].load(order)
    }
}

/// Word 1 of entry `n` carrying `aux`: `aux` low, the stamp high.
pub fn stamp(n: u64, aux: u32) -> u64 {
    aux as u64 | (n.wrapping_add(1) as u32 as u64) << 32
}

/// Bytes of an entry before its stamp: what the first of two WRITEs carries.
const STAMP_OFFSET: usize = ENTRY_BYTES as usize - 4;

/// The producer's side: what it has pushed.
#[derive(Debug)]
pub struct Producer {
    cap: u64,
    head: u64,
}

impl Producer {
    pub fn new(cap: u64) -> Producer {
        assert!(cap > 0 && cap < u32::MAX as u64, "ring capacity {cap}");
        Producer { cap, head: 0 }
    }

    /// Whether another entry fits, given the consumed count the consumer last reported.
    pub fn has_room(&self, consumed: u64) -> bool {
        self.head.wrapping_sub(consumed) < self.cap
    }

    /// Pushes an entry: returns the word index of its slot within the ring and the two
    /// words to write there, in order (the stamp last). Call only with room.
    pub fn push(&mut self, value: u64, aux: u32) -> (usize, [u64; ENTRY_WORDS]) {
        let n = self.head;
        self.head += 1;
        (
            (n % self.cap) as usize * ENTRY_WORDS,
            [value, stamp(n, aux)],
        )
    }
}

/// The consumer's side: what it has taken and what it has reported.
#[derive(Debug)]
pub struct Consumer {
    cap: u64,
    tail: u64,
    reported: u64,
}

impl Consumer {
    pub fn new(cap: u64) -> Consumer {
        assert!(cap > 0 && cap < u32::MAX as u64, "ring capacity {cap}");
        Consumer {
            cap,
            tail: 0,
            reported: 0,
        }
    }

    /// The next entry `(value, aux)`, if it has arrived in `ring` (the ring's words).
    pub fn pop<W: Words + ?Sized>(&mut self, ring: &W) -> Option<(u64, u32)> {
        let at = (self.tail % self.cap) as usize * ENTRY_WORDS;
        let s = ring.load(at + 1, Ordering::Acquire);
        if (s >> 32) as u32 != self.tail.wrapping_add(1) as u32 {
            return None;
        }
        let value = ring.load(at, Ordering::Relaxed);
        self.tail += 1;
        Some((value, s as u32))
    }

    /// The count to write back to the producer, if it changed since the last report.
    pub fn report(&mut self) -> Option<u64> {
        (self.tail != self.reported).then(|| {
            self.reported = self.tail;
            self.tail
        })
    }
}

/// Where the rings of one endpoint side live in its control region: `peers` rings of
/// `cap` entries, then `peers` index words (the consumed counts of the rings this side
/// produces into, written back by their consumers).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Layout {
    pub peers: usize,
    pub cap: u64,
}

impl Layout {
    pub fn ring_word(&self, peer: usize) -> usize {
        peer * self.cap as usize * ENTRY_WORDS
    }
    pub fn ring_words(&self) -> usize {
        self.cap as usize * ENTRY_WORDS
    }
    /// Ring `peer`'s words within the side's control words.
    pub fn ring<'a>(&self, words: &'a [AtomicU64], peer: usize) -> &'a [AtomicU64] {
        &words[self.ring_word(peer)..self.ring_word(peer) + self.ring_words()]
    }
    pub fn index_word(&self, peer: usize) -> usize {
        self.peers * self.cap as usize * ENTRY_WORDS + peer
    }
    pub fn bytes(&self) -> u64 {
        (self.index_word(self.peers) as u64 + 1) * 8
    }
}

/// Entries a ring holds for `config`: every buffer that may be in flight between two
/// endpoints, plus the end-of-stream entry, so that a producer does not wait on a
/// consumer that is itself waiting.
pub(crate) fn ring_capacity(max_per_peer: usize, nodes: usize) -> u64 {
    (max_per_peer.max(1) * nodes.max(1) + 4) as u64
}

/// Encodes a buffer's place in its region as one word: rkey and word offset.
pub(crate) fn buffer_key(rkey: u32, offset: u64) -> u64 {
    ((rkey as u64) << 32) | (offset / 8)
}

/// The remote address of a buffer key on `node`.
pub(crate) fn key_addr(node: fabric::NodeId, key: u64) -> RemoteAddr {
    RemoteAddr {
        node,
        rkey: (key >> 32) as u32,
        offset: (key & 0xffff_ffff) * 8,
    }
}

/// Entry bytes as the inline source of a WRITE.
fn entry_bytes(words: [u64; ENTRY_WORDS]) -> [u8; ENTRY_BYTES as usize] {
    let mut b = [0u8; ENTRY_BYTES as usize];
    b[..8].copy_from_slice(&words[0].to_le_bytes());
    b[8..].copy_from_slice(&words[1].to_le_bytes());
    b
}

/// Send work requests one queue pair may have outstanding.
const SQ_DEPTH: u32 = 4096;
/// Receives one queue pair may have posted.
pub(crate) const RQ_DEPTH: u32 = 1024;

/// One endpoint side's RC queue pairs, one per rank (this node's own included), on one
/// completion queue, with the bookkeeping that keeps each send queue within its depth.
pub(crate) struct Mesh {
    pub cq: Arc<dyn CompletionQueue>,
    pub qps: Vec<Arc<dyn QueuePair>>,
    /// Fabric node ids by rank.
    pub peers: Vec<fabric::NodeId>,
    /// Queue-pair numbers by rank: a scan of a few words finds a completion's rank
    /// faster than hashing its number, and this runs for every completion.
    qpns: Vec<u32>,
    outstanding: Vec<u32>,
    /// Completions polled while making room, for the design to handle; between polls,
    /// the vector [`Mesh::poll`] handed out, given back for reuse.
    stash: Vec<Completion>,
    /// What one call of the completion queue's `poll` fills, kept so a poll does not
    /// initialize it anew.
    batch: Box<[Completion; POLL_BATCH]>,
    /// Whether the device places a WRITE's bytes in address order, so a ring entry
    /// takes one WRITE rather than two.
    ordered_placement: bool,
}

/// Completions taken from the completion queue per call.
const POLL_BATCH: usize = 32;

impl Mesh {
    /// Creates the queue pairs (unconnected). Not collective.
    pub fn create(node: &Node) -> Result<Mesh> {
        let nodes = node.nodes();
        let device = node.device();
        let cq = device.create_cq(nodes as u32 * (SQ_DEPTH + RQ_DEPTH))?;
        let mut config = QpConfig::rc(&cq);
        config.max_send_wr = SQ_DEPTH;
        config.max_recv_wr = RQ_DEPTH;
        config.max_inline = 64;
        let qps = (0..nodes)
            .map(|_| device.create_qp(&config))
            .collect::<fabric::Result<Vec<_>>>()?;
        let qpns = qps.iter().map(|q| q.endpoint().qpn).collect();
        Ok(Mesh {
            cq,
            qps,
            peers: (0..nodes).map(|r| node.fabric_id(r)).collect(),
            qpns,
            outstanding: vec![0; nodes],
            stash: Vec::new(),
            batch: Box::new([Completion::default(); POLL_BATCH]),
            ordered_placement: device.orders_write_placement(),
        })
    }

    /// This side's queue-pair numbers, by peer rank.
    pub fn qpns(&self) -> Vec<u32> {
        self.qpns.clone()
    }

    /// Connects queue pair `r` to `qpns[r]` on rank `r`.
    pub fn connect(&self, qpns: &[u32]) -> Result<()> {
        for (r, qp) in self.qps.iter().enumerate() {
            qp.connect(QpEndpoint {
                node: self.peers[r],
                qpn: qpns[r],
            })?;
        }
        Ok(())
    }

    /// The rank a completion's queue pair talks to.
    pub fn peer_of(&self, wc: &Completion) -> Option<usize> {
        self.qpns.iter().position(|&q| q == wc.qpn)
    }

    /// Polls the completion queue: everything stashed before plus what arrived. Hand
    /// the vector back with [`Mesh::reuse`] when done with it, so polling allocates
    /// nothing.
    pub fn poll(&mut self) -> Result<Vec<Completion>> {
        let mut out = std::mem::take(&mut self.stash);
        self.poll_into(&mut out)?;
        Ok(out)
    }

    /// Takes back a vector [`Mesh::poll`] returned, emptied, unless completions were
    /// stashed in the meantime.
    pub fn reuse(&mut self, mut polled: Vec<Completion>) {
        if self.stash.is_empty() {
            polled.clear();
            self.stash = polled;
        }
    }

    fn poll_into(&mut self, out: &mut Vec<Completion>) -> Result<()> {
        loop {
            let n = self.cq.poll(&mut self.batch[..])?;
            for wc in &self.batch[..n] {
                if !matches!(wc.opcode, WcOpcode::Recv | WcOpcode::RecvWriteImm)
                    && let Some(r) = self.peer_of(wc)
                {
                    self.outstanding[r] = self.outstanding[r].saturating_sub(1);
                }
                out.push(*wc);
            }
            if n < POLL_BATCH {
                return Ok(());
            }
        }
    }

    /// Send work requests posted and not yet completed, over all queue pairs.
    pub fn outstanding_total(&self) -> u32 {
        self.outstanding.iter().sum()
    }

    /// Posts signaled work requests to `peer`, first polling (into the stash) while the
    /// send queue is too full for them.
    pub fn post(&mut self, peer: usize, wrs: &[SendWr<'_>]) -> Result<()> {
        let n = wrs.len() as u32;
        if self.outstanding[peer] + n > SQ_DEPTH {
            let mut stash = std::mem::take(&mut self.stash);
            let r = self.poll_into(&mut stash);
            self.stash = stash;
            r?;
            if self.outstanding[peer] + n > SQ_DEPTH {
                return Err(ShuffleError::Invalid(format!(
                    "send queue to rank {peer} is full ({SQ_DEPTH} outstanding)"
                )));
            }
        }
        self.qps[peer].post_send(wrs)?;
        self.outstanding[peer] += n;
        Ok(())
    }

    /// Writes `bytes` (at most 64) inline to `to` over `peer`'s queue pair.
    pub fn write_inline(
        &mut self,
        peer: usize,
        wr_id: u64,
        bytes: &[u8],
        to: RemoteAddr,
    ) -> Result<()> {
        self.post(peer, &[SendWr::write(wr_id, Src::Inline(bytes), to)])
    }

    /// Writes ring entry `entry` (the words [`Producer::push`] gave) to `to` over
    /// `peer`'s queue pair, in one doorbell after `first` if given (the data the entry
    /// announces): one WRITE where the device places a WRITE's bytes in order, else
    /// two, the stamp after the rest (see the module docs).
    pub fn write_entry(
        &mut self,
        peer: usize,
        first: Option<SendWr<'_>>,
        wr_id: u64,
        entry: [u64; ENTRY_WORDS],
        to: RemoteAddr,
    ) -> Result<()> {
        let bytes = entry_bytes(entry);
        let whole = || SendWr::write(wr_id, Src::Inline(&bytes), to);
        let body = || SendWr::write(wr_id, Src::Inline(&bytes[..STAMP_OFFSET]), to);
        let stamp = || {
            SendWr::write(
                wr_id,
                Src::Inline(&bytes[STAMP_OFFSET..]),
                to.offset_by(STAMP_OFFSET as u64),
            )
        };
        match (first, self.ordered_placement) {
            (None, true) => self.post(peer, &[whole()]),
            (Some(first), true) => self.post(peer, &[first, whole()]),
            (None, false) => self.post(peer, &[body(), stamp()]),
            (Some(first), false) => self.post(peer, &[first, body(), stamp()]),
        }
    }
}

/// Wires every rank's `mesh_a` to every rank's `mesh_b` (a lane's senders to its
/// receivers) given everyone's queue-pair numbers: rank `i`'s `a[j]` connects to rank
/// `j`'s `b[i]` and vice versa.
pub(crate) fn connect_pairs(
    rank: usize,
    send: &Mesh,
    recv: &Mesh,
    all_send_qpns: &[Vec<u32>],
    all_recv_qpns: &[Vec<u32>],
) -> Result<()> {
    let to_recv: Vec<u32> = all_recv_qpns.iter().map(|q| q[rank]).collect();
    let to_send: Vec<u32> = all_send_qpns.iter().map(|q| q[rank]).collect();
    send.connect(&to_recv)?;
    recv.connect(&to_send)
}

/// Lets a device reach itself (RC queue pairs connected to queue pairs on the same
/// device): the node join only adds the other ranks.
pub(crate) fn add_self(node: &Node) -> Result<()> {
    let d = node.device();
    d.add_peer(node.fabric_id(node.rank()), &d.address())?;
    Ok(())
}

/// A completion error as the shuffle reports it.
pub(crate) fn completion_error(what: &'static str, wc: &Completion) -> ShuffleError {
    ShuffleError::Completion {
        what,
        status: wc.status,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ring(cap: u64) -> Vec<AtomicU64> {
        (0..cap as usize * ENTRY_WORDS)
            .map(|_| AtomicU64::new(0))
            .collect()
    }

    fn write(ring: &[AtomicU64], (at, words): (usize, [u64; 2])) {
        ring[at].store(words[0], Ordering::Relaxed);
        ring[at + 1].store(words[1], Ordering::Release);
    }

    #[test]
    fn entries_come_out_in_order_across_laps_and_room_follows_reports() {
        let cap = 3;
        let mem = ring(cap);
        let mut p = Producer::new(cap);
        let mut c = Consumer::new(cap);
        let mut consumed = 0;
        let mut next = 0u64;
        for round in 0..10u64 {
            while p.has_room(consumed) {
                write(&mem, p.push(next * 7, next as u32));
                next += 1;
            }
            assert_eq!(next - consumed, cap, "full after round {round}");
            let mut got = 0;
            while let Some((v, aux)) = c.pop(&mem[..]) {
                assert_eq!(v, aux as u64 * 7);
                got += 1;
            }
            assert_eq!(got, cap);
            consumed = c.report().unwrap();
            assert_eq!(c.report(), None);
        }
    }

    #[test]
    fn stale_and_empty_slots_are_not_entries() {
        let mem = ring(2);
        let mut c = Consumer::new(2);
        assert_eq!(c.pop(&mem[..]), None);
        let mut p = Producer::new(2);
        write(&mem, p.push(1, 0));
        write(&mem, p.push(2, 0));
        assert_eq!(c.pop(&mem[..]), Some((1, 0)));
        assert_eq!(c.pop(&mem[..]), Some((2, 0)));
        assert_eq!(c.pop(&mem[..]), None, "slot 0 still holds lap 0");
    }

    #[test]
    fn buffer_keys_round_trip() {
        let a = key_addr(fabric::NodeId(3), buffer_key(0xdead_beef, 8 * 1000));
        assert_eq!(a.rkey, 0xdead_beef);
        assert_eq!(a.offset, 8000);
        assert_eq!(a.node, fabric::NodeId(3));
    }
}
