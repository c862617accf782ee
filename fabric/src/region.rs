//! Registered regions: memory plus the keys and access rights a device gave it.

use crate::addr::{Access, LocalBuf, NodeId, RemoteAddr, RemoteRegion};
use crate::error::FabricError;
use crate::memory::{self, Memory};
use crate::sync::Ordering;
use std::fmt;
use std::sync::Arc;

/// A registered memory region. The local CPU reads and writes it through the methods
/// here; the device reads and writes it through work requests naming its keys.
/// Dropping the region deregisters it: later work requests naming its keys fail with a
/// protection error, as after `ibv_dereg_mr`.
pub struct Region {
    mem: Arc<dyn Memory>,
    len: u64,
    lkey: u32,
    rkey: u32,
    access: Access,
    node: NodeId,
    _registration: Box<dyn Send + Sync>,
}

impl fmt::Debug for Region {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Region")
            .field("node", &self.node)
            .field("len", &self.len)
            .field("lkey", &self.lkey)
            .field("rkey", &self.rkey)
            .field("access", &self.access)
            .finish()
    }
}

impl Region {
    /// Builds the handle a backend returns from registration. `registration` is kept
    /// until the region is dropped; its own `Drop` undoes the registration.
    pub fn from_parts(
        mem: Arc<dyn Memory>,
        len: u64,
        keys: (u32, u32),
        access: Access,
        node: NodeId,
        registration: Box<dyn Send + Sync>,
    ) -> Region {
        Region {
            mem,
            len,
            lkey: keys.0,
            rkey: keys.1,
            access,
            node,
            _registration: registration,
        }
    }

    pub fn len(&self) -> u64 {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn lkey(&self) -> u32 {
        self.lkey
    }
    pub fn rkey(&self) -> u32 {
        self.rkey
    }
    pub fn access(&self) -> Access {
        self.access
    }
    pub fn node(&self) -> NodeId {
        self.node
    }
    pub fn memory(&self) -> &Arc<dyn Memory> {
        &self.mem
    }

    /// The region as a peer addresses it.
    pub fn remote(&self) -> RemoteRegion {
        RemoteRegion {
            node: self.node,
            rkey: self.rkey,
            len: self.len,
        }
    }

    pub fn remote_addr(&self, offset: u64) -> RemoteAddr {
        self.remote().at(offset)
    }

    /// A local scatter/gather element over `[offset, offset + len)`. Bounds are checked
    /// by the device when a work request uses it, as with a real lkey.
    pub fn buf(&self, offset: u64, len: u32) -> LocalBuf {
        LocalBuf {
            lkey: self.lkey,
            offset,
            len,
        }
    }

    /// Whether the region's memory is in this process (CPU access works).
    pub fn is_local(&self) -> bool {
        self.mem.words().len() as u64 * 8 >= self.len
    }

    fn check(&self, offset: u64, len: u64) -> Result<(), FabricError> {
        if !self.is_local() {
            return Err(FabricError::NotLocal);
        }
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(FabricError::OutOfBounds {
                offset,
                len,
                region_len: self.len,
            }),
        }
    }

    /// Copies bytes out of the region.
    pub fn read(&self, offset: u64, dst: &mut [u8]) -> Result<(), FabricError> {
        self.check(offset, dst.len() as u64)?;
        memory::copy_out(self.mem.words(), offset, dst);
        Ok(())
    }

    /// Copies bytes into the region, in increasing address order.
    pub fn write(&self, offset: u64, src: &[u8]) -> Result<(), FabricError> {
        self.check(offset, src.len() as u64)?;
        memory::copy_in(self.mem.words(), offset, src);
        Ok(())
    }

    /// Reads the bytes `[offset, offset + len)` into a new vector.
    pub fn to_vec(&self, offset: u64, len: usize) -> Result<Vec<u8>, FabricError> {
        let mut v = vec![0; len];
        self.read(offset, &mut v)?;
        Ok(v)
    }

    fn word(&self, offset: u64) -> Result<&crate::sync::AtomicU64, FabricError> {
        if !offset.is_multiple_of(8) {
            return Err(FabricError::Misaligned { offset });
        }
        self.check(offset, 8)?;
        Ok(&self.mem.words()[(offset / 8) as usize])
    }

    /// Loads the aligned 8-byte word at `offset` (Acquire), e.g. an atomic's result.
    pub fn load_u64(&self, offset: u64) -> Result<u64, FabricError> {
        Ok(self.word(offset)?.load(Ordering::Acquire))
    }

    /// Loads `out.len()` aligned words starting at `offset` (Acquire): the results of a
    /// multi-word READ, with one bounds check.
    pub fn read_words(&self, offset: u64, out: &mut [u64]) -> Result<(), FabricError> {
        if !offset.is_multiple_of(8) {
            return Err(FabricError::Misaligned { offset });
        }
        self.check(offset, out.len() as u64 * 8)?;
        let first = (offset / 8) as usize;
        let words = &self.mem.words()[first..first + out.len()];
        for (o, w) in out.iter_mut().zip(words) {
            *o = w.load(Ordering::Acquire);
        }
        Ok(())
    }

    /// Stores the aligned 8-byte word at `offset` (Release). Only for words that no
    /// remote atomic targets: CPU stores are not atomic against NIC atomics.
    pub fn store_u64(&self, offset: u64, value: u64) -> Result<(), FabricError> {
        self.word(offset)?.store(value, Ordering::Release);
        Ok(())
    }
}

#[cfg(all(test, not(fabric_loom)))]
mod tests {
    use crate::sim::{SimConfig, SimNetwork};
    use crate::{Access, Device, FabricError};

    #[test]
    fn regions_elsewhere_refuse_cpu_access() {
        use crate::memory::ElsewhereMemory;
        use std::sync::Arc;
        let r = crate::Region::from_parts(
            Arc::new(ElsewhereMemory),
            4096,
            (1, 1),
            Access::ALL,
            crate::NodeId(3),
            Box::new(()),
        );
        assert!(!r.is_local());
        assert_eq!(r.read(0, &mut [0; 8]), Err(FabricError::NotLocal));
        assert_eq!(r.write(0, &[0; 8]), Err(FabricError::NotLocal));
        assert_eq!(r.load_u64(0), Err(FabricError::NotLocal));
        assert_eq!(r.remote_addr(8).rkey, 1);
    }

    #[test]
    fn cpu_access_is_bounds_and_alignment_checked() {
        let dev = SimNetwork::new(SimConfig::default()).add_node();
        let r = dev.register(20, Access::ALL).unwrap();
        assert_eq!(r.len(), 20);
        r.write(12, &[1; 8]).unwrap();
        assert!(matches!(
            r.write(13, &[1; 8]),
            Err(FabricError::OutOfBounds { .. })
        ));
        assert!(matches!(
            r.read(u64::MAX, &mut [0; 2]),
            Err(FabricError::OutOfBounds { .. })
        ));
        assert!(matches!(
            r.load_u64(4),
            Err(FabricError::Misaligned { offset: 4 })
        ));
        assert!(matches!(
            r.load_u64(16),
            Err(FabricError::OutOfBounds { .. })
        ));
        r.store_u64(8, 99).unwrap();
        let mut two = [0u64; 2];
        r.read_words(0, &mut two).unwrap();
        assert_eq!(two[1], 99);
        assert!(matches!(
            r.read_words(8, &mut two),
            Err(FabricError::OutOfBounds { .. })
        ));
        assert!(matches!(
            r.read_words(4, &mut two[..1]),
            Err(FabricError::Misaligned { .. })
        ));
        assert_eq!(r.load_u64(8).unwrap(), 99);
        assert_eq!(r.to_vec(12, 4).unwrap(), 99u64.to_le_bytes()[4..8].to_vec());
    }
}
