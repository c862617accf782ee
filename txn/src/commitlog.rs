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
//! 8        holder  tag:16 | incarnation:48: who holds the slot under lease `tag`
//!                    (written by the holder before its guard says active(tag); 0 by
//!                    databases of one process, whose holders need no memory-side fence)
//! [16, 64) zero
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

    /// Slot `slot`'s holder word ([`Holder`]).
    pub fn holder(&self, slot: u32) -> RemoteAddr {
        self.data.at(self.area(slot) + 8)
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

/// Which compute-node incarnation holds a slot under a lease tag: what a fencer in
/// another process has the memory servers fence (see the module doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Holder {
    pub tag: u16,
    /// 48 bits.
    pub incarnation: u64,
}

impl Holder {
    /// The bits of an incarnation a holder word keeps.
    pub const INCARNATION_MASK: u64 = (1 << 48) - 1;

    pub fn encode(self) -> u64 {
        (self.tag as u64) << 48 | (self.incarnation & Holder::INCARNATION_MASK)
    }

    pub fn decode(word: u64) -> Holder {
        Holder {
            tag: (word >> 48) as u16,
            incarnation: word & Holder::INCARNATION_MASK,
        }
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

/// A record's bytes: a multiple of 8, ending in its checksum.
pub fn encode(cid: u64, entries: &[EntryRef<'_>]) -> Vec<u8> {
    let mut out = Vec::new();
    encode_into(cid, entries, &mut out);
    out
}

/// [`encode`] into `out` (cleared first), so a worker reuses one buffer for the
/// records of all its commits.
pub fn encode_into(cid: u64, entries: &[EntryRef<'_>], out: &mut Vec<u8>) {
    let words = 3
        + entries
            .iter()
            .map(|e| 4 + e.value.len().div_ceil(8))
            .sum::<usize>()
        + 1;
    out.clear();
    out.reserve(words * 8);
    let push = |out: &mut Vec<u8>, w: u64| out.extend_from_slice(&w.to_le_bytes());
    push(out, MAGIC | (words as u64) << 32);
    push(out, cid);
    push(out, entries.len() as u64);
    for e in entries {
        push(
            out,
            e.table as u64 | (e.part as u64) << 32 | (e.kind as u64) << 48,
        );
        push(out, e.key);
        push(out, e.addr);
        push(out, e.value.len() as u64);
        out.extend_from_slice(e.value);
        out.resize(out.len().next_multiple_of(8), 0);
    }
    let sum = checksum(out);
    push(out, sum);
    debug_assert_eq!(out.len(), words * 8);
}

/// Independent multiply-rotate chains, one per word position mod `LANES`: one chain
/// is a multiply's latency per word, and a commit's record is kilobytes of values.
const LANES: usize = 4;

fn checksum(bytes: &[u8]) -> u64 {
    // Each lane's step is a bijection of its state for a given word, so any changed
    // word changes its lane; the lanes fold in order, and the length is mixed in, so
    // a missing word changes the sum too. A zeroed area never checks out (the seeds
    // are not zero).
    let mut lanes: [u64; LANES] = std::array::from_fn(|i| 0x6e61_6d64_625f_6c67 ^ i as u64);
    let mix = |h: u64, w: u64| (h ^ w).wrapping_mul(0x9e37_79b9_7f4a_7c15).rotate_left(29);
    let mut blocks = bytes.chunks_exact(8 * LANES);
    for block in &mut blocks {
        for (i, lane) in lanes.iter_mut().enumerate() {
            let w = u64::from_le_bytes(block[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
            *lane = mix(*lane, w);
        }
    }
    for (i, w) in blocks.remainder().chunks_exact(8).enumerate() {
        lanes[i] = mix(lanes[i], u64::from_le_bytes(w.try_into().expect("8 bytes")));
    }
    let folded = lanes.iter().fold(0x6c67_5f62_646d_616e, |h, &l| mix(h, l));
    folded ^ (bytes.len() as u64)
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
    fn every_word_of_a_record_is_checked() {
        // A value of 43 bytes: the record's words fill whole lane blocks and a tail.
        let value: Vec<u8> = (0..43).collect();
        let mut record = Vec::new();
        // A reused buffer holding a longer record first: nothing of it is left over.
        encode_into(9, &[entry(EntryKind::Update, 1, &[0xee; 300])], &mut record);
        encode_into(21, &[entry(EntryKind::Update, 4, &value)], &mut record);
        assert_eq!(record, encode(21, &[entry(EntryKind::Update, 4, &value)]));
        assert!(parse_ring(&record).contains_key(&21));
        for word in 0..record.len() / 8 {
            for bit in [0, 37, 63] {
                let mut bad = record.clone();
                bad[word * 8 + bit / 8] ^= 1 << (bit % 8);
                assert!(
                    !parse_ring(&bad).contains_key(&21),
                    "a flipped bit {bit} of word {word} went unnoticed"
                );
            }
        }
        // Two words of the value swapped between lanes.
        let mut swapped = record.clone();
        let (a, b) = (7 * 8, 8 * 8);
        for i in 0..8 {
            swapped.swap(a + i, b + i);
        }
        assert_ne!(swapped, record);
        assert!(!parse_ring(&swapped).contains_key(&21));
        // The same body one word shorter, with its sum over what is left.
        let body = &record[..record.len() - 16];
        assert_ne!(checksum(body), checksum(&record[..record.len() - 8]));
        assert_ne!(checksum(&[0u8; 64]), 0);
    }

    #[test]
    fn holder_words_round_trip_and_keep_48_bits_of_the_incarnation() {
        for h in [
            Holder {
                tag: 0,
                incarnation: 1,
            },
            Holder {
                tag: u16::MAX,
                incarnation: Holder::INCARNATION_MASK,
            },
            Holder {
                tag: 513,
                incarnation: 0x1234_5678_9abc,
            },
        ] {
            assert_eq!(Holder::decode(h.encode()), h);
        }
        let wide = Holder {
            tag: 2,
            incarnation: 0xffff_0000_0000_0001,
        };
        assert_eq!(
            Holder::decode(wide.encode()),
            Holder {
                tag: 2,
                incarnation: 1
            }
        );
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
