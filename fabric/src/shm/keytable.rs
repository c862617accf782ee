//! The key table: a device's exported regions, in a small memfd that peers map read-only,
//! so a requester checks an rkey (liveness, bounds, access flags) with a few atomic
//! loads and no syscall, as an RNIC checks it in its own memory.
//!
//! Layout (64-bit little-endian words): a header of [`HEADER_WORDS`] (magic, state,
//! slot count), then two words per slot. A region key names its slot (`(slot + 1) << 8
//! | generation`, the registry's keys), so a lookup is one index:
//!
//! - word 0: `key << 32 | access << 1 | live`, 0 when the slot is empty;
//! - word 1: the region's length in bytes.
//!
//! The owner writes a slot seqlock-style (clear word 0, write the length, then word 0
//! with Release); a reader loads word 0, the length, and word 0 again, and trusts the
//! pair only if word 0 did not change. A stale key never matches a reused slot: the
//! generation in the key differs. The owner marks the header closed when its device
//! shuts down, which peers see on their next request.

use crate::addr::Access;
use crate::memfd::{HugePages, MemfdMemory};
use crate::memory::Memory;
use crate::sync::{AtomicU64, Ordering};
use std::sync::atomic::fence;

/// Slots in a key table: exported regions a device can have live at once.
pub(crate) const SLOTS: usize = 16384;
const HEADER_WORDS: usize = 8;
const MAGIC: u64 = u64::from_le_bytes(*b"NAMDBKEY");
const W_MAGIC: usize = 0;
const W_STATE: usize = 1;
const W_SLOTS: usize = 2;
const OPEN: u64 = 1;
const CLOSED: u64 = 2;
const WORDS: usize = HEADER_WORDS + 2 * SLOTS;

fn slot_of(key: u32) -> Option<usize> {
    ((key >> 8) as usize)
        .checked_sub(1)
        .filter(|&slot| slot < SLOTS)
}

fn entry_word(key: u32, access: Access) -> u64 {
    (key as u64) << 32 | (access.bits() as u64) << 1 | 1
}

/// The owner's side.
pub(crate) struct KeyTable {
    mem: MemfdMemory,
}

impl KeyTable {
    pub(crate) fn create() -> Result<KeyTable, String> {
        let mem =
            MemfdMemory::with_huge_pages("namdb-shm-keys", (WORDS * 8) as u64, HugePages::Never)
                .map_err(|e| format!("cannot create the key table: {e}"))?;
        let w = mem.words();
        w[W_SLOTS].store(SLOTS as u64, Ordering::Relaxed);
        w[W_STATE].store(OPEN, Ordering::Relaxed);
        w[W_MAGIC].store(MAGIC, Ordering::Release);
        Ok(KeyTable { mem })
    }

    pub(crate) fn memory(&self) -> &MemfdMemory {
        &self.mem
    }

    /// Makes `key` visible to peers; false if its slot is beyond the table.
    pub(crate) fn publish(&self, key: u32, access: Access, len: u64) -> bool {
        let Some(slot) = slot_of(key) else {
            return false;
        };
        let w = &self.mem.words()[HEADER_WORDS + 2 * slot..][..2];
        w[0].store(0, Ordering::Relaxed);
        fence(Ordering::Release);
        w[1].store(len, Ordering::Relaxed);
        w[0].store(entry_word(key, access), Ordering::Release);
        true
    }

    /// Withdraws `key`: every lookup that starts after this returns nothing.
    pub(crate) fn withdraw(&self, key: u32) {
        if let Some(slot) = slot_of(key) {
            let word = &self.mem.words()[HEADER_WORDS + 2 * slot];
            // Only this key's entry: a later registration may own the slot already.
            let _ = word.fetch_update(Ordering::AcqRel, Ordering::Acquire, |w| {
                (w >> 32 == key as u64).then_some(0)
            });
        }
    }

    pub(crate) fn close(&self) {
        self.mem.words()[W_STATE].store(CLOSED, Ordering::Release);
    }
}

/// A peer's key table, mapped read-only. Everything in it is the peer's word: lookups
/// bound what they read by the mapping, and callers bound what they access by their
/// own mapping of the region.
pub(crate) struct PeerKeys {
    mem: MemfdMemory,
}

impl PeerKeys {
    pub(crate) fn new(mem: MemfdMemory) -> Result<PeerKeys, String> {
        let w = mem.words();
        if w.len() < WORDS
            || w[W_MAGIC].load(Ordering::Acquire) != MAGIC
            || w[W_SLOTS].load(Ordering::Relaxed) != SLOTS as u64
        {
            return Err("the peer's key table has an unknown layout".into());
        }
        Ok(PeerKeys { mem })
    }

    /// Whether the peer's device is still up (it closes the table when it shuts down).
    pub(crate) fn is_open(&self) -> bool {
        self.mem.words()[W_STATE].load(Ordering::Acquire) == OPEN
    }

    /// The access flags and length of live region `key`.
    pub(crate) fn lookup(&self, key: u32) -> Option<(Access, u64)> {
        let slot = slot_of(key)?;
        let w: &[AtomicU64] = &self.mem.words()[HEADER_WORDS + 2 * slot..][..2];
        let first = w[0].load(Ordering::Acquire);
        if first >> 32 != key as u64 || first & 1 == 0 {
            return None;
        }
        let len = w[1].load(Ordering::Relaxed);
        fence(Ordering::Acquire);
        if w[0].load(Ordering::Relaxed) != first {
            return None;
        }
        let access = Access::from_bits_truncate(((first & 0xffff_ffff) >> 1) as u32);
        Some((access, len))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer_view(t: &KeyTable) -> PeerKeys {
        let fd = t.memory().read_only_fd().unwrap();
        PeerKeys::new(MemfdMemory::from_peer(fd, false).unwrap()).unwrap()
    }

    #[test]
    fn published_keys_are_seen_and_withdrawn_ones_are_not() {
        let t = KeyTable::create().unwrap();
        let p = peer_view(&t);
        assert!(p.is_open());
        let key = (5 + 1) << 8 | 3;
        assert!(t.publish(key, Access::REMOTE_READ, 4096));
        assert_eq!(p.lookup(key), Some((Access::REMOTE_READ, 4096)));
        assert_eq!(p.lookup(key + 1), None, "another generation of the slot");
        t.withdraw(key);
        assert_eq!(p.lookup(key), None);
        t.close();
        assert!(!p.is_open());
    }

    #[test]
    fn a_withdrawal_of_a_stale_key_leaves_the_new_one() {
        let t = KeyTable::create().unwrap();
        let p = peer_view(&t);
        let (old, new) = ((1 << 8) | 1, (1 << 8) | 2);
        t.publish(old, Access::ALL, 8);
        t.publish(new, Access::ALL, 16);
        t.withdraw(old);
        assert_eq!(p.lookup(new), Some((Access::ALL, 16)));
    }

    #[test]
    fn keys_outside_the_table_resolve_to_nothing() {
        let t = KeyTable::create().unwrap();
        let p = peer_view(&t);
        assert!(!t.publish(((SLOTS as u32) + 1) << 8 | 1, Access::ALL, 8));
        for key in [0, 1, 0xff, u32::MAX] {
            assert_eq!(p.lookup(key), None, "{key:#x}");
        }
    }

    #[test]
    fn garbage_is_not_a_key_table() {
        let m = MemfdMemory::with_huge_pages("garbage", 4096, HugePages::Never).unwrap();
        let fd = m.read_only_fd().unwrap();
        assert!(PeerKeys::new(MemfdMemory::from_peer(fd, false).unwrap()).is_err());
    }
}
