//! The commit log (DESIGN.md, "RSI", commit step 3): what makes a commit crash-atomic.
//!
//! Each oracle slot has an area in memory-server memory (server 0, right after the
//! oracle, one allocation; see the catalog's word map). A worker holding slot s writes,
//! after its locks are taken and validated and before any install, one record per
//! commit into s's area: the CID and the whole write set (table, partition, block
//! address, key, kind, value). A transaction is committed exactly when its record is
//! complete: the record ends in a checksum word over everything before it, so a record
//! cut short by a crash (or overwritten in part) never parses.
//!
//! # Area layout (little-endian words)
//!
//! ```text
//! 0        guard   state:2 | tag:16 | by:32                          (CAS only)
//!                    0 clean(tag): nothing of holder `tag` needs resolving
//!                    1 active(tag): holder `tag` may hold locks and records
//!                    2 recovering(tag, by): node `by` resolves holder `tag`'s locks
//! [8, 64)  zero
//! [64, …)  the ring of records, each:
//!            MAGIC | words << 32, cid, entries,
//!            per entry: table | partition << 32 | kind << 48, key, addr, value bytes,
//!                       the value padded to 8 bytes,
//!            checksum of all the words before it
//! ```
//!
//! The guard serializes the resolution of a dead holder's work: a fencer or the next
//! claimer of the slot CASes `active(tag)` to `recovering(tag, by)`, and only the
//! winner resolves; a claimer waits for `clean` before it writes records of its own, so
//! nobody overwrites a dead holder's records while they may still be needed.

use crate::error::{Result, TxnError};
use fabric::{RemoteAddr, RemoteRegion};
use std::collections::{BTreeSet, HashMap};
use timestamp::Layout;

/// The smallest commit-log area per slot.
pub const MIN_AREA_BYTES: u64 = 4 << 10;
/// The default commit-log area per slot: room for a few hundred in-flight commits of
/// a few KiB each.
pub const DEFAULT_AREA_BYTES: u64 = 256 << 10;
/// The memory server holding the commit log.
pub const SERVER: usize = 0;
const HEADER_BYTES: u64 = 64;
/// `"NLOG"` in the low half of a record's first word.
const MAGIC: u64 = u32::from_le_bytes(*b"NLOG") as u64;

/// Where the slots' areas are: `slots` areas of `area_bytes`, from `offset` of `data`
/// (a region of server [`SERVER`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LogLocation {
    pub data: RemoteRegion,
    pub offset: u64,
    pub area_bytes: u64,
    pub slots: u32,
}

impl LogLocation {
    /// The areas that follow an oracle of `layout` at `oracle_offset` of `data`.
    pub fn after_oracle(
        data: RemoteRegion,
        oracle_offset: u64,
        layout: &Layout,
        area_bytes: u64,
    ) -> std::result::Result<LogLocation, String> {
        if area_bytes < MIN_AREA_BYTES || !area_bytes.is_multiple_of(8) {
            return Err(format!(
                "a commit-log area of {area_bytes} bytes (at least {MIN_AREA_BYTES}, a multiple of 8)"
            ));
        }
        let offset = oracle_offset
            .checked_add(layout.region_bytes())
            .and_then(|end| end.checked_next_multiple_of(64))
            .ok_or_else(|| format!("an oracle at {oracle_offset} ends past 2^64"))?;
        Ok(LogLocation {
            data,
            offset,
            area_bytes,
            slots: layout.slots(),
        })
    }

    /// Bytes of all areas.
    pub fn bytes(&self) -> u64 {
        self.area_bytes * self.slots as u64
    }

    fn area(&self, slot: u32) -> u64 {
        debug_assert!(slot < self.slots);
        self.offset + slot as u64 * self.area_bytes
    }

    /// Slot `slot`'s guard word.
    pub fn guard(&self, slot: u32) -> RemoteAddr {
        self.data.at(self.area(slot))
    }

    /// Where slot `slot`'s ring starts.
    pub fn ring(&self, slot: u32) -> RemoteAddr {
        self.data.at(self.area(slot) + HEADER_BYTES)
    }

    /// Bytes of each ring.
    pub fn ring_bytes(&self) -> u64 {
        self.area_bytes - HEADER_BYTES
    }
}

/// A slot's guard word (see the module doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Guard {
    Clean { tag: u16 },
    Active { tag: u16 },
    Recovering { tag: u16, by: u32 },
}

impl Guard {
    pub fn encode(self) -> u64 {
        let (state, tag, by) = match self {
            Guard::Clean { tag } => (0u64, tag, 0),
            Guard::Active { tag } => (1, tag, 0),
            Guard::Recovering { tag, by } => (2, tag, by),
        };
        state << 62 | (tag as u64) << 32 | by as u64
    }

    pub fn decode(word: u64) -> Result<Guard> {
        let tag = (word >> 32) as u16;
        let by = word as u32;
        match word >> 62 {
            0 if by == 0 => Ok(Guard::Clean { tag }),
            1 if by == 0 => Ok(Guard::Active { tag }),
            2 => Ok(Guard::Recovering { tag, by }),
            _ => Err(TxnError::Invalid(format!(
                "commit-log guard word {word:#018x} is corrupt"
            ))),
        }
    }
}

/// What a log entry does to its record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EntryKind {
    /// A new version of an existing block.
    Update = 0,
    /// A tombstone version of an existing block.
    Delete = 1,
    /// A block the commit created (written locked with its version already).
    Insert = 2,
}

/// One write of a committed transaction.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LogEntry {
    pub table: u32,
    pub part: u16,
    pub kind: EntryKind,
    pub key: u64,
    /// The block's offset in its partition's data region.
    pub addr: u64,
    /// The new value: empty for deletes, and for inserts (whose block holds it
    /// already) unless the memory servers are durable, when a restart may lose the
    /// block and recovery writes it again from here.
    pub value: Vec<u8>,
}

/// A complete record found in an area.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LogRecord {
    pub cid: u64,
    pub entries: Vec<LogEntry>,
}

impl LogRecord {
    /// The entry that writes block `addr` of `table`'s partition `part`.
    pub fn entry(&self, table: u32, part: usize, addr: u64) -> Option<&LogEntry> {
        self.entries
            .iter()
            .find(|e| e.table == table && e.part as usize == part && e.addr == addr)
    }
}

/// An entry as the commit path hands it to [`encode`], borrowing the value.
pub struct EntryRef<'a> {
    pub table: u32,
    pub part: usize,
    pub kind: EntryKind,
    pub key: u64,
    pub addr: u64,
    pub value: &'a [u8],
}

/// Bytes of the record of `entries`: a multiple of 8.
pub fn encoded_len(entries: &[EntryRef<'_>]) -> u64 {
    let words = 3
        + entries
            .iter()
            .map(|e| 4 + e.value.len().div_ceil(8))
            .sum::<usize>()
        + 1;
    words as u64 * 8
}

/// A record's bytes: a multiple of 8, ending in its checksum.
pub fn encode(cid: u64, entries: &[EntryRef<'_>]) -> Vec<u8> {
    let mut out = Vec::with_capacity(encoded_len(entries) as usize);
    encode_with(cid, entries, &mut |bytes: &[u8]| {
        out.extend_from_slice(bytes);
        Ok(())
    })
    .expect("a vector takes every byte");
    out
}

/// [`encode`] straight into `buffer` at `at` (8-byte aligned), where the commit
/// WRITEs it from: no intermediate copy of the values. Returns the record's length.
pub fn encode_into(
    cid: u64,
    entries: &[EntryRef<'_>],
    buffer: &fabric::Region,
    at: u64,
) -> Result<u64> {
    let mut next = at;
    encode_with(cid, entries, &mut |bytes: &[u8]| {
        buffer.write(next, bytes)?;
        next += bytes.len() as u64;
        Ok(())
    })?;
    Ok(next - at)
}

/// The record's bytes, in order, to `out`: words, and each value followed by the zeros
/// that pad it to a word.
fn encode_with(
    cid: u64,
    entries: &[EntryRef<'_>],
    out: &mut dyn FnMut(&[u8]) -> std::result::Result<(), fabric::FabricError>,
) -> Result<()> {
    let mut w = RecordWriter {
        sum: Checksum::new(),
        out,
    };
    w.word(MAGIC | (encoded_len(entries) / 8) << 32)?;
    w.word(cid)?;
    w.word(entries.len() as u64)?;
    for e in entries {
        w.word(e.table as u64 | (e.part as u64) << 32 | (e.kind as u64) << 48)?;
        w.word(e.key)?;
        w.word(e.addr)?;
        w.word(e.value.len() as u64)?;
        w.value(e.value)?;
    }
    let total = w.sum.finish();
    (w.out)(&total.to_le_bytes())?;
    Ok(())
}

/// Hands a record's bytes to its destination, summing its words on the way.
struct RecordWriter<'o> {
    sum: Checksum,
    out: &'o mut dyn FnMut(&[u8]) -> std::result::Result<(), fabric::FabricError>,
}

impl RecordWriter<'_> {
    fn word(&mut self, w: u64) -> std::result::Result<(), fabric::FabricError> {
        self.sum.add(w);
        (self.out)(&w.to_le_bytes())
    }

    /// The value's whole words in one piece (one copy), then its last, partial word
    /// padded with zeros.
    fn value(&mut self, value: &[u8]) -> std::result::Result<(), fabric::FabricError> {
        let whole = value.len() / 8 * 8;
        for w in value[..whole].chunks_exact(8) {
            self.sum
                .add(u64::from_le_bytes(w.try_into().expect("8 bytes")));
        }
        (self.out)(&value[..whole])?;
        if whole < value.len() {
            let mut tail = [0u8; 8];
            tail[..value.len() - whole].copy_from_slice(&value[whole..]);
            self.word(u64::from_le_bytes(tail))?;
        }
        Ok(())
    }
}

/// The record checksum: a multiply-rotate mix over words, so any changed or missing
/// word changes it, and a zeroed area never checks out (the seed is not zero).
struct Checksum {
    h: u64,
    words: u64,
}

impl Checksum {
    fn new() -> Checksum {
        Checksum {
            h: 0x6e61_6d64_625f_6c67,
            words: 0,
        }
    }
    fn add(&mut self, w: u64) {
        self.h = (self.h ^ w)
            .wrapping_mul(0x9e37_79b9_7f4a_7c15)
            .rotate_left(29);
        self.words += 1;
    }
    fn finish(&self) -> u64 {
        self.h ^ (self.words * 8)
    }
}

fn checksum(bytes: &[u8]) -> u64 {
    let mut sum = Checksum::new();
    for w in bytes.chunks_exact(8) {
        sum.add(u64::from_le_bytes(w.try_into().expect("8 bytes")));
    }
    sum.finish()
}

/// Every complete record in a ring's bytes, by CID. Stale records of earlier laps
/// parse too; a CID appears in at most one record, as CIDs are never reused.
pub fn parse_ring(bytes: &[u8]) -> HashMap<u64, LogRecord> {
    let mut found = HashMap::new();
    let word = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"));
    let mut at = 0;
    while at + 32 <= bytes.len() {
        let w = word(at);
        if w & u32::MAX as u64 == MAGIC
            && let Some(record) = parse_record(bytes, at, (w >> 32) as usize)
        {
            at += ((w >> 32) as usize) * 8;
            found.insert(record.cid, record);
        } else {
            at += 8;
        }
    }
    found
}

fn parse_record(bytes: &[u8], at: usize, words: usize) -> Option<LogRecord> {
    let end = at.checked_add(words.checked_mul(8)?)?;
    if words < 4 || end > bytes.len() {
        return None;
    }
    let body = &bytes[at..end - 8];
    let sum = u64::from_le_bytes(bytes[end - 8..end].try_into().ok()?);
    if checksum(body) != sum {
        return None;
    }
    let word = |i: usize| u64::from_le_bytes(body[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
    let cid = word(1);
    let count = word(2) as usize;
    let mut i = 3;
    let mut entries = Vec::with_capacity(count.min(words));
    for _ in 0..count {
        if (i + 4) * 8 > body.len() {
            return None;
        }
        let head = word(i);
        let kind = match (head >> 48) & 0xff {
            0 => EntryKind::Update,
            1 => EntryKind::Delete,
            2 => EntryKind::Insert,
            _ => return None,
        };
        let len = word(i + 3) as usize;
        let from = (i + 4) * 8;
        let to = from.checked_add(len)?;
        if to > body.len() {
            return None;
        }
        entries.push(LogEntry {
            table: head as u32,
            part: (head >> 32) as u16,
            kind,
            key: word(i + 1),
            addr: word(i + 2),
            value: body[from..to].to_vec(),
        });
        i += 4 + len.div_ceil(8);
    }
    Some(LogRecord { cid, entries })
}

/// A worker's place in its slot's ring: records go one after another, and a record
/// may be overwritten only once the commit that wrote it has finished (installed, or
/// given up to recovery), so every record recovery may need is intact.
#[derive(Debug)]
pub(crate) struct Ring {
    cap: u64,
    /// Bytes handed out so far (a position that only grows; the ring offset is it
    /// modulo `cap`).
    head: u64,
    /// Starts of the records whose commits have not finished.
    inflight: BTreeSet<u64>,
}

impl Ring {
    pub(crate) fn new(cap: u64) -> Ring {
        Ring {
            cap,
            head: 0,
            inflight: BTreeSet::new(),
        }
    }

    /// Room for a record of `len` bytes: its position, or `None` while the oldest
    /// unfinished record is in the way (try again after other commits finish).
    pub(crate) fn place(&mut self, len: u64) -> Result<Option<u64>> {
        if len > self.cap {
            return Err(TxnError::Invalid(format!(
                "the commit's log record of {len} bytes exceeds the commit-log area of {} bytes per slot; commit fewer or smaller writes at once",
                self.cap
            )));
        }
        let mut start = self.head;
        if start % self.cap + len > self.cap {
            start = start.next_multiple_of(self.cap);
        }
        let end = start + len;
        if let Some(&oldest) = self.inflight.first()
            && end > oldest + self.cap
        {
            return Ok(None);
        }
        self.head = end;
        self.inflight.insert(start);
        Ok(Some(start))
    }

    /// The ring offset of position `at`.
    pub(crate) fn offset(&self, at: u64) -> u64 {
        at % self.cap
    }

    /// The commit whose record is at `at` has finished.
    pub(crate) fn finished(&mut self, at: u64) {
        self.inflight.remove(&at);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(kind: EntryKind, key: u64, value: &[u8]) -> EntryRef<'_> {
        EntryRef {
            table: 3,
            part: 1,
            kind,
            key,
            addr: 4096 + key * 64,
            value,
        }
    }

    #[test]
    fn records_round_trip_and_torn_ones_do_not_parse() {
        let a = encode(
            17,
            &[
                entry(EntryKind::Update, 5, b"hello"),
                entry(EntryKind::Insert, 6, b""),
                entry(EntryKind::Delete, 7, b""),
            ],
        );
        let b = encode(33, &[entry(EntryKind::Update, 9, &[7u8; 20])]);
        let mut ring = vec![0u8; 8];
        ring.extend_from_slice(&a);
        ring.extend_from_slice(&b);
        ring.extend_from_slice(&[0u8; 40]);
        let found = parse_ring(&ring);
        assert_eq!(found.len(), 2);
        let r = &found[&17];
        assert_eq!(r.entries.len(), 3);
        assert_eq!(r.entries[0].value, b"hello");
        assert_eq!(r.entries[1].kind, EntryKind::Insert);
        assert_eq!(
            r.entry(3, 1, 4096 + 7 * 64).unwrap().kind,
            EntryKind::Delete
        );
        assert_eq!(found[&33].entries[0].value, vec![7u8; 20]);
        // A crash in the middle of writing b: its tail never arrived.
        let mut torn = ring.clone();
        let b_at = 8 + a.len();
        for byte in &mut torn[b_at + b.len() - 16..b_at + b.len()] {
            *byte = 0;
        }
        let found = parse_ring(&torn);
        assert!(found.contains_key(&17) && !found.contains_key(&33));
        // One flipped bit anywhere in a record voids it.
        let mut flipped = ring;
        flipped[8 + 40] ^= 4;
        assert!(!parse_ring(&flipped).contains_key(&17));
    }

    #[test]
    fn records_encoded_into_a_buffer_equal_encoded_ones_padding_included() {
        use fabric::sim::{SimConfig, SimNetwork};
        use fabric::{Access, Device};
        let net = SimNetwork::new(SimConfig::default());
        let device: std::sync::Arc<dyn Device> = net.add_node();
        let buffer = device.register(4096, Access::LOCAL).unwrap();
        for len in 0..=17usize {
            let value: Vec<u8> = (0..len as u8).map(|b| b.wrapping_mul(37) | 1).collect();
            let entries = [
                entry(EntryKind::Update, 5, &value),
                entry(EntryKind::Insert, 6, b"abc"),
            ];
            // Stale bytes where the record goes: the padding must overwrite them.
            buffer.write(0, &[0xffu8; 4096]).unwrap();
            let len_written = encode_into(41, &entries, &buffer, 64).unwrap();
            let want = encode(41, &entries);
            assert_eq!(len_written, want.len() as u64, "value of {len} bytes");
            assert_eq!(encoded_len(&entries), want.len() as u64);
            assert_eq!(
                buffer.to_vec(64, want.len()).unwrap(),
                want,
                "value of {len} bytes"
            );
            assert_eq!(buffer.to_vec(64 + want.len() as u64, 8).unwrap(), [0xff; 8]);
            assert_eq!(parse_ring(&want)[&41].entries[0].value, value);
        }
    }

    #[test]
    fn guards_round_trip_and_garbage_is_an_error() {
        for g in [
            Guard::Clean { tag: 0 },
            Guard::Active { tag: 513 },
            Guard::Recovering { tag: 9, by: 77 },
        ] {
            assert_eq!(Guard::decode(g.encode()).unwrap(), g);
        }
        assert_eq!(Guard::decode(0).unwrap(), Guard::Clean { tag: 0 });
        assert!(Guard::decode(3 << 62).is_err());
    }

    #[test]
    fn the_ring_never_overwrites_an_unfinished_record() {
        let mut ring = Ring::new(100);
        let a = ring.place(40).unwrap().unwrap();
        let b = ring.place(40).unwrap().unwrap();
        assert_eq!((a, b), (0, 40));
        // 80 + 40 > 100: the next lap, but a (0..40) is unfinished.
        assert_eq!(ring.place(40).unwrap(), None);
        ring.finished(a);
        let c = ring.place(40).unwrap().unwrap();
        assert_eq!((c, ring.offset(c)), (100, 0));
        // b (40..80) is in the way of 140..180.
        assert_eq!(ring.place(40).unwrap(), None);
        ring.finished(b);
        assert_eq!(ring.place(40).unwrap(), Some(140));
        assert!(ring.place(101).is_err());
    }
}
