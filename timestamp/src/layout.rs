//! Where the oracle's words live in its region, how they are encoded, and how a fresh
//! oracle is written.
//!
//! ```text
//! offset 0    header, 8 words:
//!               0 magic "NAMDBTSO"   1 version   2 V (bits)   3 S (slots)
//!               4 slot-table offset  5 bit-vector offset
//!               6 prefix hint (first undecided timestamp some client has seen)
//!               7 far hint (a decided timestamp beyond the windows readers scan)
//! offset 64   slot table, S entries of 2 words:
//!               lease      state:2 | tag:14 | horizon:48   (CAS only)
//!               heartbeat  counter bumped by the holder   (FETCH_ADD only)
//! aligned 64  bit vector, ceil(V / 64) words; timestamp t is bit t mod 64 of word
//!             (t mod V) / 64
//! ```
//!
//! Every word a remote atomic touches (the hint, leases, heartbeats, the vector) is
//! changed only through CAS or FETCH_ADD once the region is published. [`Layout::format`]
//! is the one exception: it runs on the memory server's CPU before the region is
//! handed to anyone, when no remote access can race with it.

use crate::error::OracleError;
use fabric::Region;

/// `"NAMDBTSO"` as a little-endian word.
pub const MAGIC: u64 = u64::from_le_bytes(*b"NAMDBTSO");
/// Bumped whenever the encoding of any word changes.
pub const VERSION: u64 = 1;
/// The paper's vector size.
pub const DEFAULT_BITS: u64 = 60_000;
/// The smallest vector accepted: the loom models run with 8.
pub const MIN_BITS: u64 = 8;
/// The largest vector accepted; far beyond any sensible setting, and it keeps word
/// indices comfortably inside `usize` on every host.
pub const MAX_BITS: u64 = 1 << 32;
/// Slots the layout accepts. A slot is a lease plus a heartbeat, so the bound is only
/// about keeping the slot table small enough to read at registration.
pub const MAX_SLOTS: u32 = 4096;
/// Timestamps per horizon unit: a lease's horizon is stored in blocks of 64, which
/// gives 2^54 timestamps of range in 48 bits (over a century at 5 M/s).
pub const BLOCK: u64 = 64;

pub const HEADER_BYTES: u64 = 64;
pub const SLOT_BYTES: u64 = 16;

pub(crate) const HEADER_WORDS: usize = 8;
pub(crate) const OFF_PREFIX_HINT: u64 = 48;
pub(crate) const OFF_FAR_HINT: u64 = 56;

const HORIZON_BITS: u32 = 48;
const HORIZON_MASK: u64 = (1 << HORIZON_BITS) - 1;
/// Width of a lease's tag, which wraps (bumped once per change of holder).
pub const TAG_BITS: u32 = 14;
const TAG_MASK: u64 = (1 << TAG_BITS) - 1;
pub(crate) const MAX_HORIZON: u64 = HORIZON_MASK;

/// The shape of an oracle: V bits and S slots, and the offsets that follow from them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    bits: u64,
    slots: u32,
}

impl Layout {
    /// Checks `bits` (V) and `slots` (S). V must give every slot at least two
    /// timestamps per round, or a slot could never hand out a timestamp whose
    /// predecessor at the same position is already decided.
    pub fn new(bits: u64, slots: u32) -> Result<Layout, OracleError> {
        if slots == 0 || slots > MAX_SLOTS {
            return Err(OracleError::InvalidLayout(format!(
                "slots must be 1..={MAX_SLOTS}, got {slots}"
            )));
        }
        if !(MIN_BITS..=MAX_BITS).contains(&bits) {
            return Err(OracleError::InvalidLayout(format!(
                "the vector must hold {MIN_BITS}..={MAX_BITS} bits, got {bits}"
            )));
        }
        if bits < 2 * slots as u64 {
            return Err(OracleError::InvalidLayout(format!(
                "{bits} bits cannot serve {slots} slots: at least 2 bits per slot are needed"
            )));
        }
        Ok(Layout { bits, slots })
    }

    /// V: timestamps per round of the vector.
    pub fn bits(&self) -> u64 {
        self.bits
    }
    /// S: how many slots share the timestamps.
    pub fn slots(&self) -> u32 {
        self.slots
    }
    /// Words of the bit vector (the last may be partly used).
    pub fn words(&self) -> u64 {
        self.bits.div_ceil(64)
    }
    pub fn slot_table_offset(&self) -> u64 {
        HEADER_BYTES
    }
    pub fn lease_offset(&self, slot: u32) -> u64 {
        HEADER_BYTES + slot as u64 * SLOT_BYTES
    }
    pub fn heartbeat_offset(&self, slot: u32) -> u64 {
        self.lease_offset(slot) + 8
    }
    /// The vector starts on a 64-byte boundary so that a window READ never shares a
    /// cache line with the slot table the heartbeats hammer.
    pub fn bits_offset(&self) -> u64 {
        (HEADER_BYTES + self.slots as u64 * SLOT_BYTES).next_multiple_of(64)
    }
    pub fn word_offset(&self, word: u64) -> u64 {
        self.bits_offset() + word * 8
    }
    /// Bytes the oracle's region must have.
    pub fn region_bytes(&self) -> u64 {
        self.bits_offset() + self.words() * 8
    }

    /// The header as it is stored.
    pub(crate) fn header_words(&self) -> [u64; HEADER_WORDS] {
        [
            MAGIC,
            VERSION,
            self.bits,
            self.slots as u64,
            self.slot_table_offset(),
            self.bits_offset(),
            1,
            0,
        ]
    }

    /// Recovers the layout from a header read out of a region of `region_len` bytes,
    /// checking everything a client relies on.
    pub(crate) fn from_header(
        words: &[u64; HEADER_WORDS],
        region_len: u64,
    ) -> Result<Layout, OracleError> {
        if words[0] != MAGIC {
            return Err(OracleError::NotAnOracle { magic: words[0] });
        }
        if words[1] != VERSION {
            return Err(OracleError::VersionMismatch {
                found: words[1],
                expected: VERSION,
            });
        }
        let slots = u32::try_from(words[3]).map_err(|_| {
            OracleError::Corrupt(format!("header slot count {} is out of range", words[3]))
        })?;
        let layout = Layout::new(words[2], slots)
            .map_err(|e| OracleError::Corrupt(format!("header describes no valid oracle: {e}")))?;
        if words[4] != layout.slot_table_offset() || words[5] != layout.bits_offset() {
            return Err(OracleError::Corrupt(format!(
                "header offsets ({}, {}) disagree with V={} S={}",
                words[4], words[5], layout.bits, layout.slots
            )));
        }
        if region_len < layout.region_bytes() {
            return Err(OracleError::RegionTooSmall {
                need: layout.region_bytes(),
                have: region_len,
            });
        }
        Ok(layout)
    }

    /// The words of a fresh oracle, [`Layout::region_bytes`] / 8 of them: header,
    /// every slot free, the vector with timestamp 0 (the genesis every read timestamp
    /// starts from) already decided. [`Layout::format`] stores them with the CPU; a
    /// compute node that carves an oracle out of a remote region WRITEs them there
    /// (txn's catalog), before anyone learns where the oracle is.
    pub fn image(&self) -> Vec<u64> {
        let mut words = vec![0u64; (self.region_bytes() / 8) as usize];
        words[..HEADER_WORDS].copy_from_slice(&self.header_words());
        for slot in 0..self.slots {
            words[(self.lease_offset(slot) / 8) as usize] = Lease::FREE_AT_START.encode();
        }
        // Bit 0 of word 0 is timestamp 0, decided in round 0.
        words[(self.word_offset(0) / 8) as usize] = 1;
        words
    }

    /// The words of an oracle whose timestamps below `start` (at least 1) are all
    /// decided and the rest undecided, every slot free with its horizon at `start` or
    /// just past it: a claimer's first timestamp is then above everything issued
    /// before. A cluster whose oracle was lost (its memory server restarted) goes on
    /// from one of these, `start` above every timestamp its data holds.
    pub fn image_from(&self, start: u64) -> Vec<u64> {
        let start = start.max(1);
        let mut words = vec![0u64; (self.region_bytes() / 8) as usize];
        words[..HEADER_WORDS].copy_from_slice(&self.header_words());
        words[(OFF_PREFIX_HINT / 8) as usize] = start;
        let free = Lease {
            horizon: start.div_ceil(BLOCK),
            ..Lease::FREE_AT_START
        };
        for slot in 0..self.slots {
            words[(self.lease_offset(slot) / 8) as usize] = free.encode();
        }
        // Each position holds the timestamp of [start, start + V) that maps to it,
        // undecided: in round r that reads as bit r & 1 (decided is (r + 1) & 1).
        for t in start..start + self.bits {
            let (word, bit) = crate::cells::position(self.bits, t);
            if crate::cells::odd_round(self.bits, t) {
                words[(self.word_offset(word) / 8) as usize] |= 1 << bit;
            }
        }
        words
    }

    /// Writes a fresh oracle ([`Layout::image`]) into `region` with CPU stores.
    ///
    /// Run this on the node that owns the region, before its remote key is handed to
    /// any client: CPU stores are not atomic against NIC atomics, which is harmless
    /// only while nobody else can reach the region.
    pub fn format(&self, region: &Region) -> Result<(), OracleError> {
        if region.len() < self.region_bytes() {
            return Err(OracleError::RegionTooSmall {
                need: self.region_bytes(),
                have: region.len(),
            });
        }
        for (i, w) in self.image().iter().enumerate() {
            region.store_u64(i as u64 * 8, *w)?;
        }
        Ok(())
    }
}

/// Who may write a slot's timestamps.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SlotState {
    /// Nobody holds it: any client may decide (skip) its timestamps below the horizon,
    /// with CAS, and raise the horizon with CAS.
    Free,
    /// A client holds it and alone decides its timestamps, with FETCH_ADD, below the
    /// horizon it reserved.
    Owned,
    /// Its holder's lease expired and another client took it away; from here on it is
    /// treated like `Free`. The old holder learns it from the changed word.
    Fenced,
}

/// The decoded lease word of a slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Lease {
    pub state: SlotState,
    /// Bumped on every change of holder, so that a CAS prepared against an earlier
    /// holder fails even if the horizon happens to be the same.
    pub tag: u16,
    /// In blocks of [`BLOCK`] timestamps. Owned: the holder may hand out or skip its
    /// timestamps below `horizon × BLOCK` and must raise it (CAS) to go further. Free
    /// or fenced: others may skip the slot's timestamps below it, and the next holder
    /// starts at it.
    pub horizon: u64,
}

impl Lease {
    pub(crate) const FREE_AT_START: Lease = Lease {
        state: SlotState::Free,
        tag: 0,
        horizon: 0,
    };

    pub fn encode(&self) -> u64 {
        let state: u64 = match self.state {
            SlotState::Free => 0,
            SlotState::Owned => 1,
            SlotState::Fenced => 2,
        };
        debug_assert!(self.horizon <= HORIZON_MASK);
        (state << 62)
            | ((self.tag as u64 & TAG_MASK) << HORIZON_BITS)
            | (self.horizon & HORIZON_MASK)
    }

    pub fn decode(word: u64) -> Result<Lease, OracleError> {
        let state = match word >> 62 {
            0 => SlotState::Free,
            1 => SlotState::Owned,
            2 => SlotState::Fenced,
            _ => {
                return Err(OracleError::Corrupt(format!(
                    "lease word {word:#018x} has the undefined state 3"
                )));
            }
        };
        Ok(Lease {
            state,
            tag: ((word >> HORIZON_BITS) & TAG_MASK) as u16,
            horizon: word & HORIZON_MASK,
        })
    }

    /// The tag the next holder (or fencer) writes.
    /// The tag of the next change of holder (a fence or a claim).
    pub fn next_tag(&self) -> u16 {
        ((self.tag as u64 + 1) & TAG_MASK) as u16
    }
}

#[cfg(all(test, not(timestamp_loom)))]
mod tests {
    use super::*;
    use fabric::Device;
    use fabric::sim::{SimConfig, SimNetwork};

    #[test]
    fn an_oracle_from_a_start_goes_on_above_it() {
        use crate::clock::SystemClock;
        use crate::slot::OracleConfig;
        use crate::testkit::SimOracle;
        use crate::{Outcome, cells};
        let layout = Layout::new(256, 4).unwrap();
        // Starts in even and odd rounds, at and off word and block boundaries.
        for start in [1, 63, 64, 255, 256, 257, 3 * 256 + 17, 1_000_003] {
            let oracle = SimOracle::new(SimConfig::default(), layout).unwrap();
            for (i, w) in layout.image_from(start).iter().enumerate() {
                oracle.region.store_u64(i as u64 * 8, *w).unwrap();
            }
            assert_eq!(
                oracle.true_prefix(start - 1).unwrap(),
                start,
                "start {start}"
            );
            for t in start..start + 256 {
                assert!(!oracle.is_decided(t).unwrap(), "{t} of start {start}");
            }
            for t in start.saturating_sub(256).max(1)..start {
                let (w, b) = cells::position(256, t);
                // Positions below start hold t + V undecided, which is t decided.
                let word = oracle.region.load_u64(layout.word_offset(w)).unwrap();
                let decided = cells::decided_bits(word, cells::odd_round(256, t));
                assert_ne!(decided & (1 << b), 0, "{t} of start {start}");
            }
            let slot = oracle
                .client(OracleConfig::default(), SystemClock::shared())
                .unwrap();
            // Free slots' timestamps below their horizon may be skipped at once.
            let rid = slot.read_timestamp().unwrap();
            assert!(
                rid >= start - 1 && rid < start.div_ceil(BLOCK) * BLOCK + 256,
                "{rid}"
            );
            let cid = slot.acquire_commit_ts(10).unwrap();
            assert!(cid >= start, "cid {cid} of start {start}");
            assert_eq!(cid % 4, slot.slot() as u64);
            slot.mark(cid, Outcome::Committed).unwrap();
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
            while slot.read_timestamp().unwrap() < cid {
                slot.tick().unwrap();
                assert!(
                    std::time::Instant::now() < deadline,
                    "prefix stuck below {cid}"
                );
            }
        }
    }

    #[test]
    fn layouts_are_validated() {
        assert!(Layout::new(60_000, 64).is_ok());
        assert!(Layout::new(8, 4).is_ok());
        assert!(Layout::new(8, 5).is_err());
        assert!(Layout::new(7, 1).is_err());
        assert!(Layout::new(1 << 40, 1).is_err());
        assert!(Layout::new(64, 0).is_err());
        assert!(Layout::new(1 << 20, MAX_SLOTS + 1).is_err());
    }

    #[test]
    fn offsets_do_not_overlap() {
        let l = Layout::new(60_000, 3).unwrap();
        assert_eq!(l.lease_offset(0), 64);
        assert_eq!(l.heartbeat_offset(2), 64 + 2 * 16 + 8);
        assert_eq!(l.bits_offset(), 128);
        assert_eq!(l.words(), 938);
        assert_eq!(l.region_bytes(), 128 + 938 * 8);
    }

    #[test]
    fn lease_words_round_trip() {
        for state in [SlotState::Free, SlotState::Owned, SlotState::Fenced] {
            let l = Lease {
                state,
                tag: 0x3fff,
                horizon: MAX_HORIZON,
            };
            assert_eq!(Lease::decode(l.encode()).unwrap(), l);
        }
        assert!(Lease::decode(3 << 62).is_err());
        let l = Lease {
            state: SlotState::Owned,
            tag: 0x3fff,
            horizon: 5,
        };
        assert_eq!(l.next_tag(), 0);
    }

    #[test]
    fn format_writes_a_header_that_reads_back() {
        let dev = SimNetwork::new(SimConfig::default()).add_node();
        let layout = Layout::new(100, 3).unwrap();
        let small = dev
            .register(layout.region_bytes() - 8, fabric::Access::ALL)
            .unwrap();
        assert!(matches!(
            layout.format(&small),
            Err(OracleError::RegionTooSmall { .. })
        ));
        let region = dev
            .register(layout.region_bytes(), fabric::Access::ALL)
            .unwrap();
        region.write(0, &[0xff; 64]).unwrap();
        layout.format(&region).unwrap();
        let mut header = [0u64; HEADER_WORDS];
        for (i, w) in header.iter_mut().enumerate() {
            *w = region.load_u64(i as u64 * 8).unwrap();
        }
        assert_eq!(Layout::from_header(&header, region.len()).unwrap(), layout);
        assert!(matches!(
            Layout::from_header(&header, region.len() - 1),
            Err(OracleError::RegionTooSmall { .. })
        ));
        assert_eq!(region.load_u64(layout.word_offset(0)).unwrap(), 1);
        let lease = Lease::decode(region.load_u64(layout.lease_offset(2)).unwrap()).unwrap();
        assert_eq!(lease, Lease::FREE_AT_START);

        let image = layout.image();
        assert_eq!(image.len() as u64 * 8, layout.region_bytes());
        for (i, w) in image.iter().enumerate() {
            assert_eq!(region.load_u64(i as u64 * 8).unwrap(), *w, "word {i}");
        }

        let mut bad = header;
        bad[0] = 0;
        assert!(matches!(
            Layout::from_header(&bad, region.len()),
            Err(OracleError::NotAnOracle { .. })
        ));
        let mut bad = header;
        bad[1] = 99;
        assert!(matches!(
            Layout::from_header(&bad, region.len()),
            Err(OracleError::VersionMismatch { .. })
        ));
        let mut bad = header;
        bad[5] += 8;
        assert!(matches!(
            Layout::from_header(&bad, region.len()),
            Err(OracleError::Corrupt(_))
        ));
    }
}
