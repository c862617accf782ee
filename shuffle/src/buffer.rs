//! Registered transmission buffers and the views the endpoint API hands out.
//!
//! Every buffer has the same layout: a [`HEADER_BYTES`] header the endpoint fills in at
//! `put_data` (payload length, state, source), the payload, and a [`TRAILER_BYTES`]
//! trailer that the seal-byte notification of the WR design uses. Buffer memory is
//! region memory, which other processes and the NIC touch too, so it is only ever
//! accessed through atomic words; payloads are therefore whole 8-byte words, which is
//! also what the column tuples we shuffle are made of.

use fabric::{LocalBuf, Region, RemoteAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

pub const HEADER_BYTES: u32 = 16;
pub const TRAILER_BYTES: u32 = 8;
const HEADER_WORDS: usize = (HEADER_BYTES / 8) as usize;

/// Whether more buffers follow from a source endpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum State {
    MoreData,
    /// The last buffer from this source endpoint.
    Depleted,
}

impl State {
    pub fn code(self) -> u8 {
        match self {
            State::MoreData => 0,
            State::Depleted => 1,
        }
    }
    pub fn from_code(code: u8) -> Option<State> {
        match code {
            0 => Some(State::MoreData),
            1 => Some(State::Depleted),
            _ => None,
        }
    }
}

/// The header every message carries at the start of its buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    pub payload_bytes: u32,
    pub state: State,
    /// Design-specific flags (8 bits).
    pub flags: u8,
    /// The sending endpoint's id (see [`crate::endpoint_id`]).
    pub source: u32,
    /// Design-specific: an inlined credit, a packet count, a sequence number.
    pub extra: u32,
}

impl Header {
    pub fn encode(&self) -> [u64; 2] {
        [
            self.payload_bytes as u64
                | (self.state.code() as u64) << 32
                | (self.flags as u64) << 40,
            self.source as u64 | (self.extra as u64) << 32,
        ]
    }

    /// `None` when the words are not a header (an unknown state code).
    pub fn decode(words: [u64; 2]) -> Option<Header> {
        Some(Header {
            payload_bytes: words[0] as u32,
            state: State::from_code((words[0] >> 32) as u8)?,
            flags: (words[0] >> 40) as u8,
            source: words[1] as u32,
            extra: (words[1] >> 32) as u32,
        })
    }
}

/// A registered buffer: `len` bytes at `offset` in a region.
#[derive(Clone)]
pub struct Buffer {
    region: Arc<Region>,
    offset: u64,
    len: u32,
}

impl std::fmt::Debug for Buffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Buffer(rkey {:#x} +{} len {})",
            self.region.rkey(),
            self.offset,
            self.len
        )
    }
}

impl Buffer {
    /// # Panics
    /// If the range is not word-aligned or lies outside the region: a bug in the pool.
    pub fn new(region: Arc<Region>, offset: u64, len: u32) -> Buffer {
        assert!(
            offset.is_multiple_of(8) && len.is_multiple_of(8),
            "unaligned buffer"
        );
        assert!(
            offset + len as u64 <= region.len(),
            "buffer outside its region"
        );
        Buffer {
            region,
            offset,
            len,
        }
    }
    pub fn region(&self) -> &Arc<Region> {
        &self.region
    }
    pub fn offset(&self) -> u64 {
        self.offset
    }
    pub fn len(&self) -> u32 {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The whole buffer as a scatter/gather element.
    pub fn local(&self) -> LocalBuf {
        self.region.buf(self.offset, self.len)
    }
    /// `len` bytes from `at` within the buffer.
    pub fn local_range(&self, at: u32, len: u32) -> LocalBuf {
        debug_assert!(at + len <= self.len);
        self.region.buf(self.offset + at as u64, len)
    }
    /// Where a peer finds byte `at` of this buffer.
    pub fn remote(&self, at: u32) -> RemoteAddr {
        self.region.remote_addr(self.offset + at as u64)
    }
    /// The buffer's memory as words.
    pub fn words(&self) -> &[AtomicU64] {
        let first = (self.offset / 8) as usize;
        &self.region.memory().words()[first..first + (self.len / 8) as usize]
    }
    /// Whether two handles name the same memory.
    pub fn same(&self, other: &Buffer) -> bool {
        Arc::ptr_eq(&self.region, &other.region) && self.offset == other.offset
    }
    pub fn write_header(&self, header: &Header) {
        let w = self.words();
        let [a, b] = header.encode();
        w[0].store(a, Ordering::Relaxed);
        w[1].store(b, Ordering::Release);
    }
    /// Reads a header `at` bytes into the buffer (UD receives put the GRH first).
    pub fn read_header(&self, at: u32) -> Option<Header> {
        let w = &self.words()[(at / 8) as usize..];
        Header::decode([w[0].load(Ordering::Acquire), w[1].load(Ordering::Acquire)])
    }
}

/// A buffer being filled by one thread: what `acquire` returns and `put_data` takes.
#[derive(Debug)]
pub struct SendBuf {
    buf: Buffer,
    words: usize,
    capacity: usize,
    /// The first payload word, cached because appending a tuple is the hot loop of every
    /// shuffle and finding the region's words is a virtual call.
    payload: std::ptr::NonNull<AtomicU64>,
}

// SAFETY: `payload` points into the memory of `buf`'s region, which `buf` keeps alive
// (`Arc<Region>`) and which never moves (`Memory::words` is a stable array). The words
// are atomics, so sharing or sending the pointer creates no data race.
unsafe impl Send for SendBuf {}
// SAFETY: as above; through `&SendBuf` the words are only read or stored atomically.
unsafe impl Sync for SendBuf {}

impl SendBuf {
    /// A send view over `buf` with room for `payload_capacity` bytes (at most what fits
    /// between header and trailer).
    pub fn new(buf: Buffer, payload_capacity: u32) -> SendBuf {
        let fits = buf.len().saturating_sub(HEADER_BYTES + TRAILER_BYTES);
        let capacity = (payload_capacity.min(fits) / 8) as usize;
        let words = buf.words();
        let first = words.as_ptr().wrapping_add(HEADER_WORDS.min(words.len()));
        let payload = std::ptr::NonNull::new(first.cast_mut()).expect("slices are non-null");
        SendBuf {
            buf,
            words: 0,
            capacity,
            payload,
        }
    }
    pub fn buffer(&self) -> &Buffer {
        &self.buf
    }
    pub fn into_buffer(self) -> Buffer {
        self.buf
    }
    /// Payload words this buffer holds.
    pub fn capacity_words(&self) -> usize {
        self.capacity
    }
    pub fn len_words(&self) -> usize {
        self.words
    }
    pub fn payload_bytes(&self) -> u32 {
        (self.words * 8) as u32
    }
    pub fn is_empty(&self) -> bool {
        self.words == 0
    }
    pub fn is_full(&self) -> bool {
        self.words == self.capacity
    }
    pub fn remaining_words(&self) -> usize {
        self.capacity - self.words
    }
    pub fn clear(&mut self) {
        self.words = 0;
    }
    /// The payload area, for callers that fill it in bulk and then call
    /// [`SendBuf::set_len_words`].
    pub fn payload(&self) -> &[AtomicU64] {
        // SAFETY: `capacity` words from `payload` lie inside the buffer (checked in
        // `new` against its length), and the buffer's memory outlives `self`.
        unsafe { std::slice::from_raw_parts(self.payload.as_ptr(), self.capacity) }
    }
    /// The payload words not filled yet, for a caller that fills them from the front
    /// and then calls [`SendBuf::set_unfilled_words`].
    pub fn unfilled(&self) -> &[AtomicU64] {
        &self.payload()[self.words..]
    }
    /// Marks all but the last `left` payload words filled.
    ///
    /// # Panics
    /// If `left` exceeds the capacity.
    pub fn set_unfilled_words(&mut self, left: usize) {
        assert!(
            left <= self.capacity,
            "{left} unfilled words exceed the buffer"
        );
        self.words = self.capacity - left;
    }
    /// # Panics
    /// If `words` exceeds the capacity.
    pub fn set_len_words(&mut self, words: usize) {
        assert!(words <= self.capacity, "{words} words exceed the buffer");
        self.words = words;
    }
    /// Appends one word; `false` (and nothing written) when the buffer is full.
    #[inline]
    pub fn push(&mut self, word: u64) -> bool {
        if self.words == self.capacity {
            return false;
        }
        self.payload()[self.words].store(word, Ordering::Relaxed);
        self.words += 1;
        true
    }
    /// Appends a tuple of words whole; `false` (and nothing written) when it does not fit.
    #[inline]
    pub fn push_tuple(&mut self, tuple: &[u64]) -> bool {
        if self.capacity - self.words < tuple.len() {
            return false;
        }
        let at = self.words;
        for (cell, &w) in self.payload()[at..at + tuple.len()].iter().zip(tuple) {
            cell.store(w, Ordering::Relaxed);
        }
        self.words += tuple.len();
        true
    }
    /// Appends as many whole tuples of `tuples` as fit and returns how many it took.
    /// One bounds check per call instead of per tuple, and a loop of independent loads
    /// and stores that the CPU can run ahead on: the bulk path of runs of tuples bound
    /// for one group (a broadcast).
    #[inline]
    pub fn extend_tuples<const W: usize>(&mut self, tuples: &[[u64; W]]) -> usize {
        let fit = (self.capacity - self.words).checked_div(W).unwrap_or(0);
        let take = tuples.len().min(fit);
        let at = self.words;
        let cells = &self.payload()[at..at + take * W];
        let input = tuples.as_flattened();
        let words = &input[..take * W];
        // A cache line of words per step: one prefetch (into the input beyond what fits
        // here too: the next buffer copies it), and an inner copy of a fixed length
        // that the compiler unrolls.
        const LINE: usize = 8;
        const AHEAD: usize = fabric::PREFETCH_AHEAD_BYTES / 8;
        let (lines_to, lines_from) = (cells.chunks_exact(LINE), words.chunks_exact(LINE));
        let (tail_to, tail_from) = (lines_to.remainder(), lines_from.remainder());
        for (l, (to, from)) in lines_to.zip(lines_from).enumerate() {
            fabric::prefetch(input, l * LINE + AHEAD);
            for k in 0..LINE {
                to[k].store(from[k], Ordering::Relaxed);
            }
        }
        for (to, &from) in tail_to.iter().zip(tail_from) {
            to.store(from, Ordering::Relaxed);
        }
        self.words += take * W;
        take
    }
}

/// A buffer of received data: what `get_data` returns and `release` takes back.
#[derive(Debug)]
pub struct Received {
    pub state: State,
    /// The sending endpoint's id.
    pub source: u32,
    buf: Buffer,
    /// Byte offset of the payload within `buf`.
    payload_at: u32,
    payload_bytes: u32,
    /// Design-private: what `release` needs to hand the buffer back (a remote address,
    /// a slot number).
    pub(crate) token: u64,
}

impl Received {
    /// Wraps a delivered buffer whose header starts `header_at` bytes in.
    pub(crate) fn new(buf: Buffer, header_at: u32, header: &Header, token: u64) -> Received {
        Received {
            state: header.state,
            source: header.source,
            payload_at: header_at + HEADER_BYTES,
            payload_bytes: header.payload_bytes,
            buf,
            token,
        }
    }
    /// The filled part of a sending buffer, as its own node's receiver would get it,
    /// read where it lies (see [`crate::OwnPartition::InPlace`]). No design's `release`
    /// takes it: the sender fills the buffer again.
    pub(crate) fn in_place(buf: &SendBuf, source: u32) -> Received {
        Received {
            state: State::MoreData,
            source,
            buf: buf.buffer().clone(),
            payload_at: HEADER_BYTES,
            payload_bytes: buf.payload_bytes(),
            token: 0,
        }
    }
    pub fn payload_bytes(&self) -> u32 {
        self.payload_bytes
    }
    pub fn len_words(&self) -> usize {
        (self.payload_bytes / 8) as usize
    }
    pub fn is_empty(&self) -> bool {
        self.payload_bytes == 0
    }
    /// The payload as words.
    pub fn payload(&self) -> &[AtomicU64] {
        let first = (self.payload_at / 8) as usize;
        &self.buf.words()[first..first + self.len_words()]
    }
    /// Copies the payload out.
    pub fn to_words(&self) -> Vec<u64> {
        self.payload()
            .iter()
            .map(|w| w.load(Ordering::Relaxed))
            .collect()
    }
    /// The buffer the payload lies in. Read it, never write it: under MQ/RD a buffer
    /// from the node's own sender is that sender's, read in place and possibly shared
    /// by the other destinations of its group.
    pub fn buffer(&self) -> &Buffer {
        &self.buf
    }
    pub(crate) fn into_parts(self) -> (Buffer, u64) {
        (self.buf, self.token)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::BufferPool;
    use fabric::sim::{SimConfig, SimNetwork};

    #[test]
    fn bulk_appends_take_whole_tuples_until_the_buffer_is_full() {
        let net = SimNetwork::new(SimConfig::default());
        let pool = BufferPool::new(net.add_node(), 256, 1, 512);
        // Room for 7 words: 3 tuples of 2, with one word left over.
        let mut buf = SendBuf::new(pool.take().unwrap(), 56);
        buf.push(99);
        let tuples: Vec<[u64; 2]> = (0..5).map(|i| [i, 100 + i]).collect();
        assert_eq!(
            buf.extend_tuples(&tuples),
            3,
            "3 whole tuples after the first word"
        );
        assert_eq!(buf.len_words(), 7);
        assert!(buf.is_full());
        assert_eq!(
            buf.extend_tuples(&tuples[3..]),
            0,
            "a full buffer takes nothing"
        );
        let words: Vec<u64> = buf.payload()[..7]
            .iter()
            .map(|w| w.load(Ordering::Relaxed))
            .collect();
        assert_eq!(words, [99, 0, 100, 1, 101, 2, 102]);

        let mut wide = SendBuf::new(pool.take().unwrap(), 56);
        assert_eq!(
            wide.extend_tuples(&[[1u64, 2, 3]; 4]),
            2,
            "3-word tuples: 2 fit"
        );
        assert_eq!(wide.len_words(), 6);
        assert_eq!(wide.extend_tuples::<0>(&[[]; 3]), 0);
    }

    #[test]
    fn headers_round_trip_and_reject_unknown_states() {
        let h = Header {
            payload_bytes: 65_512,
            state: State::Depleted,
            flags: 0xa5,
            source: 7,
            extra: u32::MAX,
        };
        assert_eq!(Header::decode(h.encode()), Some(h));
        let mut bad = h.encode();
        bad[0] |= 9 << 32;
        assert_eq!(Header::decode(bad), None);
    }
}
