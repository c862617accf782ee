//! The shared memory of two-sided operations: a queue pair's block, which tells
//! senders its state and its posted receives, and the rings that carry messages to it.
//!
//! **Queue-pair block** (created by the queue pair's owner, mapped read-only by peers),
//! 64-bit words: `state`, `qkey`, `posted` (receives posted so far), `flushed` (the
//! value of `posted` at the last flush: receives below it will never take a message),
//! `depth` (a power of two), padding to word 8, then two words per receive `n` at
//! `8 + 2 * (n % depth)`: `len | key << 32` and `offset`, where a nonzero `key` says the
//! receive buffer is at `offset` of region `key`, which peers may already write
//! (exported with `REMOTE_WRITE`), so a sender may place the message there itself. A
//! receive queue never holds more than `max_recv_wr <= depth` receives, so a sender
//! reading receive `n < posted` never sees it overwritten.
//!
//! **Ring** (created by the receiver for one sender, mapped read-write by that sender):
//! `tail` (bytes produced, word 0), `head` (bytes consumed, word 8, its own cache
//! line), `in_memory` (word 16, its own cache line too: 1 while one of the sender's
//! one-sided requests touches the receiver's device memory, on the sender's CPU; one
//! sender at a time, under its queue pair's send lock, so a store and no
//! read-modify-write), then [`RING_DATA`] or [`UD_RING_DATA`] bytes of records. A record is a
//! two-word header — `kind | has_imm << 8 | len << 32` and `imm | qkey << 32` — and the
//! payload, padded to 8 bytes. Records never wrap: one that does not fit before the end
//! is preceded by a pad record to the end. The producer publishes with a Release store
//! of `tail`, the consumer frees space with a Release store of `head`.
//!
//! Each side keeps its own copy of its own counter and treats the other's as untrusted:
//! a corrupt value breaks that ring, never the memory outside it.

use crate::engine::Payload;
use crate::memfd::{HugePages, MemfdMemory};
use crate::memory::Memory;
use crate::sync::Ordering;

/// Bytes of records in an RC ring; the largest RC message is this less the header.
pub(crate) const RING_DATA: u64 = 1 << 20;
/// Bytes of records in a UD ring (one per sender and receiver).
pub(crate) const UD_RING_DATA: u64 = 256 << 10;
const HEADER: u64 = 16;
const W_TAIL: usize = 0;
const W_HEAD: usize = 8;
const W_IN_MEMORY: usize = 16;
const DATA_WORD: usize = 24;

pub(crate) const KIND_PAD: u8 = 1;
pub(crate) const KIND_SEND: u8 = 2;
pub(crate) const KIND_WRITE_IMM: u8 = 3;
/// A SEND the sender knew to be too large for the receive: its payload did not travel.
pub(crate) const KIND_TOO_SMALL: u8 = 4;
/// A SEND whose payload the sender wrote into the receive buffer itself.
pub(crate) const KIND_PLACED: u8 = 5;

const B_STATE: usize = 0;
const B_QKEY: usize = 1;
const B_POSTED: usize = 2;
const B_FLUSHED: usize = 3;
const B_DEPTH: usize = 4;
const B_LENS: usize = 8;

fn memfd(name: &str, bytes: u64) -> Result<MemfdMemory, String> {
    MemfdMemory::with_huge_pages(name, bytes, HugePages::Never)
        .map_err(|e| format!("cannot create {name}: {e}"))
}

/// The owner's side of a queue-pair block.
pub(crate) struct QpBlock {
    mem: MemfdMemory,
    depth: u64,
}

impl QpBlock {
    pub(crate) fn create(max_recv_wr: u32, qkey: u32) -> Result<QpBlock, String> {
        let depth = (max_recv_wr as u64).next_power_of_two();
        let mem = memfd("namdb-shm-qp", (B_LENS as u64 + 2 * depth) * 8)?;
        let w = mem.words();
        w[B_QKEY].store(qkey as u64, Ordering::Relaxed);
        w[B_DEPTH].store(depth, Ordering::Release);
        Ok(QpBlock { mem, depth })
    }

    pub(crate) fn memory(&self) -> &MemfdMemory {
        &self.mem
    }

    pub(crate) fn set_state(&self, state: u8) {
        // SeqCst, as a sender's entry into memory and its state check after it
        // ([`Producer::enter_memory`]): a destroyed queue pair then either sees the
        // sender inside or is seen destroyed by it.
        self.mem.words()[B_STATE].store(state as u64, Ordering::SeqCst);
    }

    /// Publishes receive number `seq` (the count posted before it) of `len` bytes, and
    /// where a sender may place its message: `(key, offset)` of a region peers may write.
    pub(crate) fn post(&self, seq: u64, len: u32, place: Option<(u32, u64)>) {
        let w = self.mem.words();
        let at = B_LENS + 2 * (seq % self.depth) as usize;
        let (key, offset) = place.unwrap_or((0, 0));
        w[at].store(len as u64 | (key as u64) << 32, Ordering::Relaxed);
        w[at + 1].store(offset, Ordering::Relaxed);
        w[B_POSTED].store(seq + 1, Ordering::Release);
    }

    /// Receives below `posted` were flushed: no message may take them.
    pub(crate) fn flushed(&self, posted: u64) {
        self.mem.words()[B_FLUSHED].store(posted, Ordering::Release);
    }
}

/// A peer's queue-pair block, mapped read-only.
pub(crate) struct PeerBlock {
    mem: MemfdMemory,
    depth: u64,
}

impl PeerBlock {
    pub(crate) fn new(mem: MemfdMemory) -> Result<PeerBlock, String> {
        let w = mem.words();
        let depth = w.get(B_DEPTH).map_or(0, |d| d.load(Ordering::Acquire));
        if !depth.is_power_of_two() || (w.len() as u64) < B_LENS as u64 + 2 * depth {
            return Err("the peer's queue-pair block has an unknown layout".into());
        }
        Ok(PeerBlock { mem, depth })
    }

    pub(crate) fn state(&self) -> u8 {
        self.mem.words()[B_STATE].load(Ordering::Acquire) as u8
    }

    /// [`PeerBlock::state`] for a check after [`Producer::enter_memory`].
    pub(crate) fn state_after_entry(&self) -> u8 {
        self.mem.words()[B_STATE].load(Ordering::SeqCst) as u8
    }

    /// `(posted, flushed)`: receives posted so far, and how many of them were flushed.
    pub(crate) fn receives(&self) -> (u64, u64) {
        let w = self.mem.words();
        (
            w[B_POSTED].load(Ordering::Acquire),
            w[B_FLUSHED].load(Ordering::Acquire),
        )
    }

    pub(crate) fn depth(&self) -> u64 {
        self.depth
    }

    /// The length of receive `seq` and where a sender may place a message for it;
    /// valid while `seq < posted` and `posted - seq <= depth`.
    pub(crate) fn receive(&self, seq: u64) -> (u32, Option<(u32, u64)>) {
        let w = self.mem.words();
        let at = B_LENS + 2 * (seq % self.depth) as usize;
        let first = w[at].load(Ordering::Relaxed);
        let key = (first >> 32) as u32;
        let place = (key != 0).then(|| (key, w[at + 1].load(Ordering::Relaxed)));
        (first as u32, place)
    }
}

/// The bytes a record takes: only SENDs carry their payload.
fn record_size(kind: u8, len: u32) -> u64 {
    let body = if kind == KIND_SEND { len as u64 } else { 0 };
    HEADER + body.next_multiple_of(8)
}

/// Creates a ring of `data` bytes for one sender.
pub(crate) fn create_ring(data: u64) -> Result<MemfdMemory, String> {
    memfd("namdb-shm-ring", DATA_WORD as u64 * 8 + data)
}

fn data_bytes(mem: &MemfdMemory) -> u64 {
    (mem.words().len() as u64 - DATA_WORD as u64) * 8
}

/// Why a message could not be put in a ring.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum PushError {
    /// Not now: the receiver has not consumed enough yet.
    Full,
    /// Never: the message is larger than the ring.
    TooLarge,
    /// The receiver's side of the ring is corrupt.
    Broken,
}

/// The sender's side of a ring.
pub(crate) struct Producer {
    mem: MemfdMemory,
    cap: u64,
    tail: u64,
}

impl Producer {
    pub(crate) fn new(mem: MemfdMemory) -> Result<Producer, String> {
        if mem.words().len() <= DATA_WORD + 2 {
            return Err("the peer's ring is too small".into());
        }
        let cap = data_bytes(&mem);
        let tail = mem.words()[W_TAIL].load(Ordering::Acquire);
        Ok(Producer { mem, cap, tail })
    }

    /// Marks a one-sided request of this sender as touching the receiver's memory
    /// until the guard drops. Check the queue pair's state after this
    /// ([`PeerBlock::state_after_entry`]): its owner, destroying it, stores the state
    /// and then waits while the mark is set, so either it waits for this request or
    /// this request sees it destroyed (SeqCst, with the barrier of `barrier` between
    /// the owner's store and load). The caller holds the queue pair's send lock: one
    /// request (or `post_send`) of the sender is inside at a time.
    pub(crate) fn enter_memory(&self) -> InMemory<'_> {
        self.enter_memory_until_left();
        InMemory(&self.mem.words()[W_IN_MEMORY])
    }

    /// [`Producer::enter_memory`] without a guard: [`Producer::leave_memory`] must
    /// follow, on every path.
    pub(crate) fn enter_memory_until_left(&self) {
        let mark = &self.mem.words()[W_IN_MEMORY];
        if super::barrier::senders_skip_barrier() {
            // The owner's barrier stands in for ours (see `barrier`).
            mark.store(1, Ordering::Relaxed);
            std::sync::atomic::compiler_fence(Ordering::SeqCst);
        } else {
            mark.store(1, Ordering::SeqCst);
        }
    }

    pub(crate) fn leave_memory(&self) {
        self.mem.words()[W_IN_MEMORY].store(0, Ordering::Release);
    }

    /// Whether a record of `kind` for a message of `len` bytes fits now.
    pub(crate) fn check(&self, kind: u8, len: u32) -> Result<(), PushError> {
        self.reserve(record_size(kind, len)).map(|_| ())
    }

    /// Where a record of `need` bytes goes: `(pad before it, its position)`.
    fn reserve(&self, need: u64) -> Result<(u64, u64), PushError> {
        if need > self.cap {
            return Err(PushError::TooLarge);
        }
        let head = self.mem.words()[W_HEAD].load(Ordering::Acquire);
        if head > self.tail || self.tail - head > self.cap {
            return Err(PushError::Broken);
        }
        let pos = self.tail % self.cap;
        let pad = if need > self.cap - pos {
            self.cap - pos
        } else {
            0
        };
        if self.tail + pad + need - head > self.cap {
            return Err(PushError::Full);
        }
        Ok((pad, (pos + pad) % self.cap))
    }

    /// Appends a record and publishes it. Only a SEND's payload travels; the other
    /// kinds carry the message's length alone.
    pub(crate) fn push(
        &mut self,
        kind: u8,
        imm: Option<u32>,
        qkey: u32,
        payload: &Payload<'_>,
    ) -> Result<(), PushError> {
        let len = payload.len();
        let size = record_size(kind, len);
        let (pad, pos) = self.reserve(size)?;
        let words = self.mem.words();
        let data = DATA_WORD as u64 * 8;
        if pad > 0 {
            let at = (self.tail % self.cap) / 8;
            words[DATA_WORD + at as usize].store(KIND_PAD as u64, Ordering::Relaxed);
        }
        if kind == KIND_SEND {
            payload.copy_to(words, data + pos + HEADER);
        }
        let head0 = kind as u64 | (imm.is_some() as u64) << 8 | (len as u64) << 32;
        let head1 = imm.unwrap_or(0) as u64 | (qkey as u64) << 32;
        words[DATA_WORD + (pos / 8) as usize].store(head0, Ordering::Relaxed);
        words[DATA_WORD + (pos / 8) as usize + 1].store(head1, Ordering::Relaxed);
        self.tail += pad + size;
        words[W_TAIL].store(self.tail, Ordering::Release);
        Ok(())
    }
}

/// A record as the consumer found it. Its fields are the producer's word.
pub(crate) struct Record {
    pub(crate) kind: u8,
    pub(crate) len: u32,
    pub(crate) imm: Option<u32>,
    pub(crate) qkey: u32,
    /// Byte offset of the payload in the ring memory.
    payload_at: u64,
}

/// A sender's one-sided request inside the receiver's memory ([`Producer::enter_memory`]).
pub(crate) struct InMemory<'a>(&'a crate::sync::AtomicU64);

impl Drop for InMemory<'_> {
    fn drop(&mut self) {
        self.0.store(0, Ordering::Release);
    }
}

/// The receiver's side of a ring.
pub(crate) struct Consumer {
    mem: MemfdMemory,
    cap: u64,
    head: u64,
}

impl Consumer {
    pub(crate) fn new(mem: MemfdMemory) -> Consumer {
        let cap = data_bytes(&mem);
        Consumer { mem, cap, head: 0 }
    }

    /// Nonzero while a one-sided request of the sender is inside this device's memory
    /// ([`Producer::enter_memory`]); untrusted, like everything the sender writes.
    pub(crate) fn senders_in_memory(&self) -> u64 {
        self.mem.words()[W_IN_MEMORY].load(Ordering::SeqCst)
    }

    /// The next record, `Ok(None)` if there is none yet, `Err` if the producer broke the
    /// ring. The record stays in the ring until [`Consumer::consume`].
    pub(crate) fn next(&mut self) -> Result<Option<Record>, String> {
        let words = self.mem.words();
        let tail = words[W_TAIL].load(Ordering::Acquire);
        loop {
            if tail == self.head {
                return Ok(None);
            }
            if tail < self.head || tail - self.head > self.cap {
                return Err(format!("ring tail {tail} is not ahead of {}", self.head));
            }
            let pos = self.head % self.cap;
            let head0 = words[DATA_WORD + (pos / 8) as usize].load(Ordering::Relaxed);
            let kind = head0 as u8;
            if kind == KIND_PAD {
                self.head += self.cap - pos;
                continue;
            }
            let len = (head0 >> 32) as u32;
            let size = record_size(kind, len);
            if size > self.cap - pos {
                return Err(format!("a record of {size} bytes overruns the ring"));
            }
            if self.head + size > tail {
                return Err("a record ends past the ring's tail".into());
            }
            let head1 = words[DATA_WORD + (pos / 8) as usize + 1].load(Ordering::Relaxed);
            return Ok(Some(Record {
                kind,
                len,
                imm: (head0 >> 8 & 1 == 1).then_some(head1 as u32),
                qkey: (head1 >> 32) as u32,
                payload_at: DATA_WORD as u64 * 8 + pos + HEADER,
            }));
        }
    }

    /// The payload of `record`: in the ring for a SEND, already in the receive buffer
    /// when placed, absent otherwise.
    pub(crate) fn payload(&self, record: &Record) -> Payload<'_> {
        match record.kind {
            KIND_SEND => Payload::Words {
                words: self.mem.words(),
                offset: record.payload_at,
                len: record.len,
            },
            KIND_PLACED => Payload::Placed(record.len),
            _ => Payload::Absent(record.len),
        }
    }

    /// Frees `record`'s space for the producer.
    pub(crate) fn consume(&mut self, record: &Record) {
        self.head += record_size(record.kind, record.len);
        self.mem.words()[W_HEAD].store(self.head, Ordering::Release);
    }

    /// Drops every published record (the receiver can take none of them).
    pub(crate) fn discard(&mut self) {
        let tail = self.mem.words()[W_TAIL].load(Ordering::Acquire);
        if tail >= self.head && tail - self.head <= self.cap {
            self.head = tail;
            self.mem.words()[W_HEAD].store(self.head, Ordering::Release);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(data: u64) -> (Producer, Consumer) {
        let mem = create_ring(data).unwrap();
        let dup = mem.as_fd_owned();
        let producer = Producer::new(MemfdMemory::from_peer(dup, true).unwrap()).unwrap();
        (producer, Consumer::new(mem))
    }

    trait Dup {
        fn as_fd_owned(&self) -> std::os::fd::OwnedFd;
    }
    impl Dup for MemfdMemory {
        fn as_fd_owned(&self) -> std::os::fd::OwnedFd {
            use std::os::fd::AsFd;
            self.as_fd().try_clone_to_owned().unwrap()
        }
    }

    fn take(c: &mut Consumer) -> Option<(u8, Vec<u8>, Option<u32>)> {
        let r = c.next().unwrap()?;
        let bytes = c.payload(&r).to_vec();
        c.consume(&r);
        Some((r.kind, bytes, r.imm))
    }

    #[test]
    fn records_come_out_in_order_and_wrap_with_padding() {
        let (mut p, mut c) = pair(4096);
        for round in 0..50u32 {
            let a = vec![round as u8; 1000 + round as usize];
            let b = vec![!round as u8; 13];
            p.push(KIND_SEND, Some(round), 0, &Payload::Bytes(&a))
                .unwrap();
            p.push(KIND_SEND, None, 0, &Payload::Bytes(&b)).unwrap();
            assert_eq!(take(&mut c), Some((KIND_SEND, a, Some(round))));
            assert_eq!(take(&mut c), Some((KIND_SEND, b, None)));
            assert_eq!(take(&mut c), None);
        }
    }

    #[test]
    fn a_full_ring_refuses_until_consumed_and_huge_records_never_fit() {
        let (mut p, mut c) = pair(4096);
        let m = [7u8; 1000];
        let mut pushed = 0;
        while p.push(KIND_SEND, None, 0, &Payload::Bytes(&m)).is_ok() {
            pushed += 1;
        }
        assert_eq!(pushed, p.cap / record_size(KIND_SEND, 1000));
        assert_eq!(
            p.push(KIND_SEND, None, 0, &Payload::Bytes(&m)),
            Err(PushError::Full)
        );
        take(&mut c).unwrap();
        p.push(KIND_SEND, None, 0, &Payload::Bytes(&m)).unwrap();
        let huge = p.cap as u32;
        assert_eq!(p.check(KIND_SEND, huge), Err(PushError::TooLarge));
        assert_eq!(p.check(KIND_WRITE_IMM, huge), Err(PushError::Full));
    }

    #[test]
    fn a_corrupt_ring_is_an_error_not_a_wild_read() {
        let (mut p, mut c) = pair(4096);
        p.push(KIND_SEND, None, 0, &Payload::Bytes(&[1; 8]))
            .unwrap();
        // The producer lies about a record's length.
        p.mem.words()[DATA_WORD].store(KIND_SEND as u64 | 1 << 40, Ordering::Relaxed);
        assert!(c.next().is_err());
        // And about the tail.
        p.mem.words()[W_TAIL].store(1 << 40, Ordering::Release);
        assert!(c.next().is_err());
        // The consumer lies about the head.
        let (p, c) = pair(4096);
        c.mem.words()[W_HEAD].store(99, Ordering::Release);
        assert_eq!(p.check(KIND_SEND, 8), Err(PushError::Broken));
    }

    #[test]
    fn a_block_publishes_receives_and_state() {
        let b = QpBlock::create(100, 7).unwrap();
        let fd = b.memory().read_only_fd().unwrap();
        let peer = PeerBlock::new(MemfdMemory::from_peer(fd, false).unwrap()).unwrap();
        assert_eq!(peer.depth(), 128);
        b.post(0, 64, None);
        b.post(1, 32, Some((0x105, 4096)));
        assert_eq!(peer.receives(), (2, 0));
        assert_eq!(peer.receive(0), (64, None));
        assert_eq!(peer.receive(1), (32, Some((0x105, 4096))));
        b.flushed(2);
        assert_eq!(peer.receives(), (2, 2));
        b.set_state(crate::engine::READY);
        assert_eq!(peer.state(), crate::engine::READY);
    }
}
