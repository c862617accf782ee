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
//!   is not yet written is an insert in progress ([`Lookup::Pending`]).
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
//! inserted (no removal), so cached entries never go stale.

use crate::conn::Conn;
use fabric::{FabricError, RemoteRegion, SendWr};
use std::collections::HashMap;
use thiserror::Error;

const SLOT_BYTES: u64 = 16;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct IndexShape {
    pub buckets: u64,
    pub slots: u32,
}

impl IndexShape {
    pub fn bucket_bytes(&self) -> u64 {
        self.slots as u64 * SLOT_BYTES
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
fn mix(mut z: u64) -> u64 {
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

/// The index in `region` (on the node `conn` is connected to), seen from one compute
/// node. Uses the first `bucket_bytes` bytes of the connection's scratch region.
#[derive(Clone, Copy, Debug)]
pub struct RemoteIndex {
    pub region: RemoteRegion,
    pub shape: IndexShape,
    /// Where in the scratch region the bucket lands.
    pub scratch_offset: u64,
}

impl RemoteIndex {
    fn read_bucket(&self, conn: &mut Conn, bucket: u64) -> Result<Vec<u64>, IndexError> {
        let bytes = self.shape.bucket_bytes();
        if self.scratch_offset + bytes > conn.scratch().len() {
            return Err(IndexError::Scratch(bytes));
        }
        let local = conn.scratch().buf(self.scratch_offset, bytes as u32);
        let remote = self.region.at(bucket * bytes);
        conn.run(&mut [SendWr::read(0, local, remote)])?;
        let mut words = vec![0u64; (bytes / 8) as usize];
        conn.scratch().read_words(self.scratch_offset, &mut words)?;
        Ok(words)
    }

    fn check_key(key: u64) -> Result<u64, IndexError> {
        key.checked_add(1).ok_or(IndexError::ReservedKey)
    }

    /// One READ of the key's bucket.
    pub fn lookup(&self, conn: &mut Conn, key: u64) -> Result<Lookup, IndexError> {
        let tag = Self::check_key(key)?;
        let words = self.read_bucket(conn, self.shape.bucket_of(key))?;
        for slot in words.chunks_exact(2) {
            if slot[0] == tag {
                return Ok(match slot[1] {
                    0 => Lookup::Pending,
                    a => Lookup::Found(a - 1),
                });
            }
        }
        Ok(Lookup::Absent)
    }

    /// Inserts `key → addr`; exactly one of concurrent inserts of a key succeeds.
    pub fn insert(&self, conn: &mut Conn, key: u64, addr: u64) -> Result<(), IndexError> {
        let tag = Self::check_key(key)?;
        let bucket = self.shape.bucket_of(key);
        let base = bucket * self.shape.bucket_bytes();
        let result = self.scratch_offset;
        loop {
            let words = self.read_bucket(conn, bucket)?;
            let mut empty = None;
            for (i, slot) in words.chunks_exact(2).enumerate() {
                if slot[0] == tag {
                    return Err(IndexError::DuplicateKey {
                        key,
                        addr: slot[1].checked_sub(1),
                    });
                }
                if slot[0] == 0 {
                    empty = Some(i as u64);
                    break;
                }
            }
            let Some(i) = empty else {
                return Err(IndexError::BucketFull {
                    key,
                    bucket,
                    slots: self.shape.slots,
                });
            };
            let slot_at = base + i * SLOT_BYTES;
            let local = conn.scratch().buf(result, 8);
            conn.run(&mut [SendWr::cas(0, local, self.region.at(slot_at), 0, tag)])?;
            let old = conn.scratch().load_u64(result)?;
            if old == 0 {
                let value = (addr + 1).to_le_bytes();
                conn.run(&mut [SendWr::write(
                    0,
                    fabric::Src::Inline(&value),
                    self.region.at(slot_at + 8),
                )])?;
                return Ok(());
            }
            if old == tag {
                return Err(IndexError::DuplicateKey { key, addr: None });
            }
        }
    }
}

/// The compute-side cache of key → block address.
#[derive(Default, Debug)]
pub struct IndexCache {
    map: HashMap<u64, u64>,
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
            shape,
            scratch_offset: 0,
        };
        Fixture {
            net,
            server_dev: server,
            region,
            index,
            keep: Vec::new(),
        }
    }

    fn client(f: &mut Fixture) -> Conn {
        let dev: Arc<dyn Device> = f.net.add_node();
        let ccq = dev.create_cq(64).unwrap();
        let scq = f.server_dev.create_cq(64).unwrap();
        let (sqp, qp) =
            fabric::connect_rc((f.server_dev.as_ref(), &scq), (dev.as_ref(), &ccq)).unwrap();
        f.keep.push(sqp);
        Conn::new(dev.as_ref(), qp, ccq, 4096).unwrap()
    }

    #[test]
    fn insert_lookup_duplicate() {
        let mut f = fixture(IndexShape {
            buckets: 16,
            slots: 4,
        });
        let mut c = client(&mut f);
        let idx = f.index;
        assert_eq!(idx.lookup(&mut c, 7).unwrap(), Lookup::Absent);
        idx.insert(&mut c, 7, 4096).unwrap();
        assert_eq!(idx.lookup(&mut c, 7).unwrap(), Lookup::Found(4096));
        idx.insert(&mut c, 8, 0).unwrap();
        assert_eq!(idx.lookup(&mut c, 8).unwrap(), Lookup::Found(0));
        match idx.insert(&mut c, 7, 1) {
            Err(IndexError::DuplicateKey { key: 7, addr }) => assert_eq!(addr, Some(4096)),
            other => panic!("expected DuplicateKey, got {other:?}"),
        }
        assert_eq!(idx.lookup(&mut c, 7).unwrap(), Lookup::Found(4096));
        assert!(matches!(
            idx.lookup(&mut c, u64::MAX),
            Err(IndexError::ReservedKey)
        ));
        // A second node sees the same index.
        let mut d = client(&mut f);
        assert_eq!(idx.lookup(&mut d, 7).unwrap(), Lookup::Found(4096));
        assert!(matches!(
            idx.insert(&mut d, 8, 5),
            Err(IndexError::DuplicateKey { .. })
        ));
    }

    #[test]
    fn pending_slot_is_reported() {
        let mut f = fixture(IndexShape {
            buckets: 1,
            slots: 2,
        });
        let mut c = client(&mut f);
        // A claimed key whose address is not written yet, by CPU stores on the server.
        f.region.store_u64(0, 42 + 1).unwrap();
        assert_eq!(f.index.lookup(&mut c, 42).unwrap(), Lookup::Pending);
    }

    #[test]
    fn full_bucket_is_a_clear_error() {
        let mut f = fixture(IndexShape {
            buckets: 1,
            slots: 3,
        });
        let mut c = client(&mut f);
        let idx = f.index;
        for k in 0..3 {
            idx.insert(&mut c, k, k * 100).unwrap();
        }
        match idx.insert(&mut c, 3, 300) {
            Err(IndexError::BucketFull {
                key: 3,
                bucket: 0,
                slots: 3,
            }) => {}
            other => panic!("expected BucketFull, got {other:?}"),
        }
        for k in 0..3 {
            assert_eq!(idx.lookup(&mut c, k).unwrap(), Lookup::Found(k * 100));
        }
    }

    #[test]
    fn concurrent_inserts_keep_keys_unique() {
        let mut f = fixture(IndexShape {
            buckets: 4,
            slots: 64,
        });
        let conns: Vec<Conn> = (0..4).map(|_| client(&mut f)).collect();
        let idx = f.index;
        let wins: Vec<Vec<u64>> = std::thread::scope(|s| {
            let hs: Vec<_> = conns
                .into_iter()
                .enumerate()
                .map(|(t, mut c)| {
                    s.spawn(move || {
                        let mut won = Vec::new();
                        for k in 0..100u64 {
                            match idx.insert(&mut c, k, t as u64) {
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
