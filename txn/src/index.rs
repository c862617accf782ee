//! A remote hash index: unique `u64` keys to block addresses, in a memory-server region
//! (DESIGN.md, "Data layout": index).
//!
//! The region is `buckets` buckets of `slots` slots; a slot is two words:
//!
//! ```text
//! key word    0 = empty, else key + 1 (so key u64::MAX is not allowed)
//! addr word   0 = being inserted, else the block's offset + 1
//! ```
//!
//! - **Lookup**: one READ of the key's bucket. A slot whose key is set and whose address
//!   is not yet written is an insert in progress ([`Lookup::Pending`]). Slots are taken
//!   in order and never emptied, so the taken ones are a prefix of the bucket: a
//!   transaction first READs only the first [`PROBE_SLOTS`] slots, which settle the
//!   lookup unless all of them are taken ([`RemoteIndex::find_probed`]), and READs the
//!   whole bucket only then. A bucket is sized for its worst case, and most hold a few
//!   keys: the probe saves most of the bucket's cache misses on the memory server.
//! - **Insert**: READ the bucket; if the key is there, [`IndexError::DuplicateKey`];
//!   else CAS the first empty slot's key word from 0, and on success WRITE its address.
//!   A failed CAS re-reads the bucket. Keys are unique: slots are never emptied, and a
//!   winning CAS on the first empty slot of a read that did not hold the key means no
//!   other slot holds it (an inserter claiming a later slot read this one as taken,
//!   hence after this CAS, hence saw the key).
//! - A full bucket is [`IndexError::BucketFull`]; there is no overflow chaining or
//!   resizing yet, and no removal.
//!
//! [`IndexCache`] is the compute-side address cache: addresses never change once
//! inserted (no removal), so cached entries never go stale. Lookups fill it, inserts
//! do not: a worker inserting orders at 100 k/s would otherwise grow it by gigabytes
//! an hour with keys it may never read (and, in TPC-W checkout, every probe of the
//! grown map missed the CPU cache: 6% of the throughput).

use crate::conn::AsyncConn;
use fabric::{FabricError, LocalBuf, Region, RemoteRegion, SendWr};
use std::collections::HashMap;
use thiserror::Error;

/// Bytes of a slot: its key word, then its address word.
pub(crate) const SLOT_BYTES: u64 = 16;
/// Offset of a slot's address word in the slot.
const ADDRESS_WORD: u64 = 8;

/// Slots a transaction's first READ of a bucket covers: two cache lines.
pub const PROBE_SLOTS: u32 = 8;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct IndexShape {
    pub buckets: u64,
    pub slots: u32,
}

impl IndexShape {
    pub fn bucket_bytes(&self) -> u64 {
        self.slots as u64 * SLOT_BYTES
    }
    /// Bytes of a bucket's probe: its first [`PROBE_SLOTS`] slots.
    pub fn probe_bytes(&self) -> u64 {
        self.slots.min(PROBE_SLOTS) as u64 * SLOT_BYTES
    }
    /// Bytes of the index region (zeroed memory is an empty index).
    pub fn region_bytes(&self) -> u64 {
        self.buckets * self.bucket_bytes()
    }
    pub fn bucket_of(&self, key: u64) -> u64 {
        mix(key) % self.buckets
    }
}

/// splitmix64's finaliser: spreads sequential keys over buckets.
pub(crate) fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[derive(Debug, Error)]
pub enum IndexError {
    #[error("key {key} is already in the index (block at {addr:?})")]
    DuplicateKey { key: u64, addr: Option<u64> },
    #[error("bucket {bucket} of key {key} is full ({slots} slots); the index needs more buckets")]
    BucketFull { key: u64, bucket: u64, slots: u32 },
    #[error("key u64::MAX is reserved")]
    ReservedKey,
    #[error("the index's scratch buffer is too small for a bucket of {0} bytes")]
    Scratch(u64),
    #[error(transparent)]
    Fabric(#[from] FabricError),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lookup {
    Found(u64),
    Absent,
    /// The key is claimed and its address not yet written.
    Pending,
}

/// A slot, decoded from its two words (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Slot {
    Empty,
    /// `key` is claimed and its address not yet written.
    Claimed {
        key: u64,
    },
    Published {
        key: u64,
        addr: u64,
    },
}

impl Slot {
    pub(crate) fn decode(key_word: u64, address_word: u64) -> Slot {
        match (key_word, address_word) {
            (0, _) => Slot::Empty,
            (k, 0) => Slot::Claimed { key: k - 1 },
            (k, a) => Slot::Published {
                key: k - 1,
                addr: a - 1,
            },
        }
    }

    /// The key the slot holds, if it is taken.
    pub(crate) fn key(self) -> Option<u64> {
        match self {
            Slot::Empty => None,
            Slot::Claimed { key } | Slot::Published { key, .. } => Some(key),
        }
    }
}

/// The slots of READ words (a whole number of slots), in order.
pub(crate) fn slots(words: &[u64]) -> impl Iterator<Item = Slot> + '_ {
    words.chunks_exact(2).map(|s| Slot::decode(s[0], s[1]))
}

/// The slots of READ bytes (little-endian words, a whole number of slots), in order.
pub(crate) fn slots_in_bytes(bytes: &[u8]) -> impl Iterator<Item = Slot> + '_ {
    let word = |b: &[u8]| u64::from_le_bytes(b.try_into().expect("8 bytes"));
    bytes.chunks_exact(SLOT_BYTES as usize).map(move |s| {
        let (key_word, address_word) = s.split_at(ADDRESS_WORD as usize);
        Slot::decode(word(key_word), word(address_word))
    })
}

/// The index at `base` in `region` (on one memory server), seen from a compute node.
/// Buckets are READ into a caller's registered buffer.
#[derive(Clone, Copy, Debug)]
pub struct RemoteIndex {
    pub region: RemoteRegion,
    /// Offset of bucket 0 in the region.
    pub base: u64,
    pub shape: IndexShape,
}

/// Where an insert claims its slot, found in a bucket that does not hold the key.
enum Claim {
    Slot(u64),
}

impl RemoteIndex {
    /// The key word of a slot that holds `key`.
    pub(crate) fn key_word(key: u64) -> Result<u64, IndexError> {
        key.checked_add(1).ok_or(IndexError::ReservedKey)
    }

    /// The address word of a slot that maps its key to the block at `addr`.
    pub(crate) fn address_word(addr: u64) -> u64 {
        addr + 1
    }

    fn bucket_offset(&self, bucket: u64) -> u64 {
        self.base + bucket * self.shape.bucket_bytes()
    }

    /// Offset in the region of slot `i` of `key`'s bucket.
    pub(crate) fn slot_at(&self, key: u64, i: usize) -> u64 {
        self.bucket_offset(self.shape.bucket_of(key)) + i as u64 * SLOT_BYTES
    }

    /// Where the key word of the slot at `slot_at` is.
    pub(crate) fn key_word_at(&self, slot_at: u64) -> fabric::RemoteAddr {
        self.region.at(slot_at)
    }

    /// Where the address word of the slot at `slot_at` is.
    pub(crate) fn address_word_at(&self, slot_at: u64) -> fabric::RemoteAddr {
        self.region.at(slot_at + ADDRESS_WORD)
    }

    /// Where the whole index is, and its bytes (a whole number of slots).
    pub(crate) fn region_range(&self) -> (fabric::RemoteAddr, u64) {
        (self.region.at(self.base), self.shape.region_bytes())
    }

    /// The slot of a bucket (its `slots`, in order) that holds `key`, else its first
    /// empty slot, with its position in the bucket; `None` when every slot holds
    /// another key. Slots are taken in order, so an insert looks no further than the
    /// first empty one.
    pub(crate) fn locate(slots: impl Iterator<Item = Slot>, key: u64) -> Option<(usize, Slot)> {
        slots
            .enumerate()
            .find(|(_, s)| *s == Slot::Empty || s.key() == Some(key))
    }

    /// Where `key`'s bucket is, and its bytes.
    pub fn bucket_range(&self, key: u64) -> (fabric::RemoteAddr, u64) {
        (
            self.region
                .at(self.bucket_offset(self.shape.bucket_of(key))),
            self.shape.bucket_bytes(),
        )
    }

    /// The READ of the start of `key`'s bucket into `buf`, as many bytes as `buf` holds:
    /// the whole bucket ([`IndexShape::bucket_bytes`]) or a probe
    /// ([`IndexShape::probe_bytes`], see [`RemoteIndex::find_probed`]).
    pub fn bucket_read<'a>(&self, key: u64, buf: LocalBuf) -> SendWr<'a> {
        let remote = self
            .region
            .at(self.bucket_offset(self.shape.bucket_of(key)));
        SendWr::read(0, buf, remote)
    }

    /// What the first slots of `key`'s bucket, as READ (`words`, a whole number of
    /// slots), say about `key`: `None` when every one of them holds another key, so only
    /// the rest of the bucket can tell. An empty slot settles it: slots are taken in
    /// order, so every key taken before the READ began lies before the first slot the
    /// READ saw empty, as with a READ of the whole bucket.
    pub fn find_probed(&self, words: &[u64], key: u64) -> Result<Option<Lookup>, IndexError> {
        let lookup = Self::find(words, key)?;
        let whole = words.len() as u64 * 8 >= self.shape.bucket_bytes();
        let settled = lookup != Lookup::Absent || whole || slots(words).any(|s| s == Slot::Empty);
        Ok(settled.then_some(lookup))
    }

    /// What a READ bucket says about `key`.
    pub fn find(words: &[u64], key: u64) -> Result<Lookup, IndexError> {
        Self::key_word(key)?;
        // Every slot, not only up to the first empty one: the words of one READ are
        // not read at one instant, so a later slot may show a key claimed after the
        // READ saw an earlier one empty.
        for slot in slots(words) {
            match slot {
                Slot::Claimed { key: k } if k == key => return Ok(Lookup::Pending),
                Slot::Published { key: k, addr } if k == key => return Ok(Lookup::Found(addr)),
                _ => {}
            }
        }
        Ok(Lookup::Absent)
    }

    fn claim(&self, words: &[u64], key: u64) -> Result<Claim, IndexError> {
        Self::key_word(key)?;
        match Self::locate(slots(words), key) {
            Some((_, Slot::Claimed { .. })) => Err(IndexError::DuplicateKey { key, addr: None }),
            Some((_, Slot::Published { addr, .. })) => Err(IndexError::DuplicateKey {
                key,
                addr: Some(addr),
            }),
            Some((i, Slot::Empty)) => Ok(Claim::Slot(self.slot_at(key, i))),
            None => Err(IndexError::BucketFull {
                key,
                bucket: self.shape.bucket_of(key),
                slots: self.shape.slots,
            }),
        }
    }

    async fn read_bucket(
        &self,
        conn: &AsyncConn,
        buf: &Region,
        at: u64,
        key: u64,
    ) -> Result<Vec<u64>, IndexError> {
        let bytes = self.shape.bucket_bytes();
        if at + bytes > buf.len() {
            return Err(IndexError::Scratch(bytes));
        }
        conn.run(&[self.bucket_read(key, buf.buf(at, bytes as u32))])
            .await?;
        let mut words = vec![0u64; (bytes / 8) as usize];
        buf.read_words(at, &mut words)?;
        Ok(words)
    }

    /// One READ of the key's bucket, landing in `buf` at `at`.
    pub async fn lookup(
        &self,
        conn: &AsyncConn,
        buf: &Region,
        at: u64,
        key: u64,
    ) -> Result<Lookup, IndexError> {
        Self::key_word(key)?;
        let words = self.read_bucket(conn, buf, at, key).await?;
        Self::find(&words, key)
    }

    /// Inserts `key → addr`; exactly one of concurrent inserts of a key succeeds.
    /// Uses `bucket_bytes + 8` bytes of `buf` from `at`.
    pub async fn insert(
        &self,
        conn: &AsyncConn,
        buf: &Region,
        at: u64,
        key: u64,
        addr: u64,
    ) -> Result<(), IndexError> {
        Self::key_word(key)?;
        let result = at + self.shape.bucket_bytes();
        if result + 8 > buf.len() {
            return Err(IndexError::Scratch(self.shape.bucket_bytes() + 8));
        }
        loop {
            let words = self.read_bucket(conn, buf, at, key).await?;
            let slot_at = self.claim_slot(&words, key)?;
            let local = buf.buf(result, 8);
            conn.run(&[self.claim_cas(slot_at, key, local)?]).await?;
            match Self::claimed(buf.load_u64(result)?, key)? {
                Claimed::Won => {
                    let address = AddressWord::of(addr);
                    conn.run(&[self.publish_write(slot_at, &address)]).await?;
                    return Ok(());
                }
                Claimed::Duplicate => {
                    return Err(IndexError::DuplicateKey { key, addr: None });
                }
                Claimed::Lost => {}
            }
        }
    }

    /// Where an insert of `key` claims its slot, given its bucket as READ: the first
    /// empty slot (offset in the region). Only a claim on the first empty slot of a
    /// bucket that did not hold the key keeps keys unique (see the module docs), so a
    /// batch of inserts claims at most one slot per bucket.
    pub(crate) fn claim_slot(&self, words: &[u64], key: u64) -> Result<u64, IndexError> {
        let Claim::Slot(slot_at) = self.claim(words, key)?;
        Ok(slot_at)
    }

    /// The CAS that claims the slot at `slot_at` for `key` (the old word lands in
    /// `result`; see [`RemoteIndex::claimed`]).
    pub(crate) fn claim_cas<'a>(
        &self,
        slot_at: u64,
        key: u64,
        result: LocalBuf,
    ) -> Result<SendWr<'a>, IndexError> {
        let tag = Self::key_word(key)?;
        Ok(SendWr::cas(0, result, self.key_word_at(slot_at), 0, tag))
    }

    /// What the old key word a claim's CAS returned means.
    pub(crate) fn claimed(old: u64, key: u64) -> Result<Claimed, IndexError> {
        let tag = Self::key_word(key)?;
        Ok(match old {
            0 => Claimed::Won,
            o if o == tag => Claimed::Duplicate,
            _ => Claimed::Lost,
        })
    }

    /// The WRITE that publishes a won slot's address.
    pub(crate) fn publish_write<'a>(&self, slot_at: u64, address: &'a AddressWord) -> SendWr<'a> {
        SendWr::write(
            0,
            fabric::Src::Inline(&address.0),
            self.address_word_at(slot_at),
        )
    }

    /// The CAS that publishes `address` in the slot at `slot_at` unless it has an
    /// address already (the old word lands in `result`). For a claimer that may have
    /// been fenced: a slot whose claimer's block recovery resolved may have been
    /// settled with another block meanwhile, which a later insert of the key may use.
    pub(crate) fn publish_cas<'a>(
        &self,
        slot_at: u64,
        address: AddressWord,
        result: LocalBuf,
    ) -> SendWr<'a> {
        SendWr::cas(
            0,
            result,
            self.address_word_at(slot_at),
            0,
            u64::from_le_bytes(address.0),
        )
    }
}

/// The address word that publishes a block, as the bytes a WRITE of it sends inline
/// (so it lives as long as the WRITE).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct AddressWord([u8; 8]);

impl AddressWord {
    /// The address word of the block at `addr`.
    pub(crate) fn of(addr: u64) -> AddressWord {
        AddressWord(RemoteIndex::address_word(addr).to_le_bytes())
    }
}

/// The outcome of a claim's CAS.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Claimed {
    /// The slot is ours: publish the address.
    Won,
    /// Another insert of the same key took the slot.
    Duplicate,
    /// Another key took the slot: read the bucket again.
    Lost,
}

/// The compute-side cache of key → block address.
#[derive(Default, Debug)]
pub struct IndexCache {
    // foldhash: the cache is hit on every read of a transaction, and SipHash would be
    // a measurable part of it. Keys come from clients, but a flooded map only costs
    // its own client time.
    map: HashMap<u64, u64, foldhash::fast::RandomState>,
}

impl IndexCache {
    pub fn get(&self, key: u64) -> Option<u64> {
        self.map.get(&key).copied()
    }
    pub fn put(&mut self, key: u64, addr: u64) {
        self.map.insert(key, addr);
    }
    pub fn len(&self) -> usize {
        self.map.len()
    }
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::block_on;
    use fabric::sim::{SimConfig, SimNetwork};
    use fabric::{Access, Device, Region};
    use std::sync::Arc;

    struct Fixture {
        net: SimNetwork,
        server_dev: Arc<dyn Device>,
        region: Region,
        index: RemoteIndex,
        /// Server-side queue pairs, kept so that connections stay up.
        keep: Vec<Arc<dyn fabric::QueuePair>>,
    }

    fn fixture(shape: IndexShape) -> Fixture {
        let net = SimNetwork::new(SimConfig::default());
        let server: Arc<dyn Device> = net.add_node();
        let region = server.register(shape.region_bytes(), Access::ALL).unwrap();
        let index = RemoteIndex {
            region: region.remote(),
            base: 0,
            shape,
        };
        Fixture {
            net,
            server_dev: server,
            region,
            index,
            keep: Vec::new(),
        }
    }

    /// A compute node's connection and buffer, with blocking calls for the tests.
    struct Client {
        conn: AsyncConn,
        buf: Region,
    }

    impl Client {
        fn lookup(&self, idx: &RemoteIndex, key: u64) -> Result<Lookup, IndexError> {
            block_on(idx.lookup(&self.conn, &self.buf, 0, key))
        }
        fn insert(&self, idx: &RemoteIndex, key: u64, addr: u64) -> Result<(), IndexError> {
            block_on(idx.insert(&self.conn, &self.buf, 0, key, addr))
        }
    }

    fn client(f: &mut Fixture) -> Client {
        let dev: Arc<dyn Device> = f.net.add_node();
        let ccq = dev.create_cq(64).unwrap();
        let scq = f.server_dev.create_cq(64).unwrap();
        let (sqp, qp) =
            fabric::connect_rc((f.server_dev.as_ref(), &scq), (dev.as_ref(), &ccq)).unwrap();
        f.keep.push(sqp);
        Client {
            conn: AsyncConn::new(qp, ccq),
            buf: dev.register(4096, Access::LOCAL).unwrap(),
        }
    }

    #[test]
    fn insert_lookup_duplicate() {
        let mut f = fixture(IndexShape {
            buckets: 16,
            slots: 4,
        });
        let c = client(&mut f);
        let idx = f.index;
        assert_eq!(c.lookup(&idx, 7).unwrap(), Lookup::Absent);
        c.insert(&idx, 7, 4096).unwrap();
        assert_eq!(c.lookup(&idx, 7).unwrap(), Lookup::Found(4096));
        c.insert(&idx, 8, 0).unwrap();
        assert_eq!(c.lookup(&idx, 8).unwrap(), Lookup::Found(0));
        match c.insert(&idx, 7, 1) {
            Err(IndexError::DuplicateKey { key: 7, addr }) => assert_eq!(addr, Some(4096)),
            other => panic!("expected DuplicateKey, got {other:?}"),
        }
        assert_eq!(c.lookup(&idx, 7).unwrap(), Lookup::Found(4096));
        assert!(matches!(
            c.lookup(&idx, u64::MAX),
            Err(IndexError::ReservedKey)
        ));
        // A second node sees the same index.
        let d = client(&mut f);
        assert_eq!(d.lookup(&idx, 7).unwrap(), Lookup::Found(4096));
        assert!(matches!(
            d.insert(&idx, 8, 5),
            Err(IndexError::DuplicateKey { .. })
        ));
    }

    #[test]
    fn a_probe_settles_a_lookup_only_with_an_empty_slot_or_the_key() {
        let idx = RemoteIndex {
            region: fixture(IndexShape {
                buckets: 1,
                slots: 2,
            })
            .region
            .remote(),
            base: 0,
            shape: IndexShape {
                buckets: 1,
                slots: 32,
            },
        };
        assert_eq!(idx.shape.probe_bytes(), PROBE_SLOTS as u64 * SLOT_BYTES);
        // Slots hold keys 10, 11, … (tags key + 1), addresses 100, 101, …
        let taken = |n: usize| -> Vec<u64> {
            let mut w = vec![0u64; 2 * PROBE_SLOTS as usize];
            for s in 0..n {
                w[2 * s] = 10 + s as u64 + 1;
                w[2 * s + 1] = 100 + s as u64 + 1;
            }
            w
        };
        let part = taken(3);
        assert_eq!(
            idx.find_probed(&part, 11).unwrap(),
            Some(Lookup::Found(101))
        );
        assert_eq!(idx.find_probed(&part, 50).unwrap(), Some(Lookup::Absent));
        let full = taken(PROBE_SLOTS as usize);
        assert_eq!(
            idx.find_probed(&full, 12).unwrap(),
            Some(Lookup::Found(102))
        );
        // Every probed slot taken by another key: the rest of the bucket may hold it.
        assert_eq!(idx.find_probed(&full, 50).unwrap(), None);
        // The whole bucket read: absent is absent.
        let mut whole = full.clone();
        whole.resize(64, 1);
        assert_eq!(idx.find_probed(&whole, 50).unwrap(), Some(Lookup::Absent));
        assert!(matches!(
            idx.find_probed(&part, u64::MAX),
            Err(IndexError::ReservedKey)
        ));
    }

    #[test]
    fn pending_slot_is_reported() {
        let mut f = fixture(IndexShape {
            buckets: 1,
            slots: 2,
        });
        let c = client(&mut f);
        // A claimed key whose address is not written yet, by CPU stores on the server.
        f.region.store_u64(0, 42 + 1).unwrap();
        assert_eq!(c.lookup(&f.index, 42).unwrap(), Lookup::Pending);
    }

    #[test]
    fn full_bucket_is_a_clear_error() {
        let mut f = fixture(IndexShape {
            buckets: 1,
            slots: 3,
        });
        let c = client(&mut f);
        let idx = f.index;
        for k in 0..3 {
            c.insert(&idx, k, k * 100).unwrap();
        }
        match c.insert(&idx, 3, 300) {
            Err(IndexError::BucketFull {
                key: 3,
                bucket: 0,
                slots: 3,
            }) => {}
            other => panic!("expected BucketFull, got {other:?}"),
        }
        for k in 0..3 {
            assert_eq!(c.lookup(&idx, k).unwrap(), Lookup::Found(k * 100));
        }
    }

    #[test]
    fn concurrent_inserts_keep_keys_unique() {
        let mut f = fixture(IndexShape {
            buckets: 4,
            slots: 64,
        });
        let conns: Vec<Client> = (0..4).map(|_| client(&mut f)).collect();
        let idx = f.index;
        let wins: Vec<Vec<u64>> = std::thread::scope(|s| {
            let hs: Vec<_> = conns
                .into_iter()
                .enumerate()
                .map(|(t, c)| {
                    s.spawn(move || {
                        let mut won = Vec::new();
                        for k in 0..100u64 {
                            match c.insert(&idx, k, t as u64) {
                                Ok(()) => won.push(k),
                                Err(IndexError::DuplicateKey { .. }) => {}
                                Err(e) => panic!("{e}"),
                            }
                        }
                        won
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let mut all: Vec<u64> = wins.iter().flatten().copied().collect();
        all.sort_unstable();
        assert_eq!(all, (0..100).collect::<Vec<_>>(), "each key inserted once");
        // Every slot's key appears once in the region.
        let mut keys = Vec::new();
        for w in 0..f.index.shape.region_bytes() / 16 {
            let k = f.region.load_u64(w * 16).unwrap();
            if k != 0 {
                keys.push(k - 1);
            }
        }
        keys.sort_unstable();
        assert_eq!(keys, (0..100).collect::<Vec<_>>());
    }
}
