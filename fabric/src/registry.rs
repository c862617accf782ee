//! The regions a device has registered, by key: what its NIC consults to check an
//! lkey or rkey. Shared by the software backends.

use crate::addr::{Access, NodeId};
use crate::error::{FabricError, Result};
use crate::memory::Memory;
use crate::region::Region;
use crate::sync::{self, AtomicBool, Ordering, RwLock};
use std::sync::{Arc, Weak};

/// A registered region as the device sees it.
pub(crate) struct RegEntry {
    pub(crate) mem: Arc<dyn Memory>,
    pub(crate) len: u64,
    pub(crate) access: Access,
    pub(crate) key: u32,
    pub(crate) live: AtomicBool,
}

/// Registered regions by key. A key is `(slot + 1) << 8 | generation`, so a key of a
/// deregistered region never names a later one in the same slot (for 256 reuses).
#[derive(Default)]
pub(crate) struct RegionTable {
    slots: Vec<(u8, Option<Arc<RegEntry>>)>,
    free: Vec<usize>,
}

impl RegionTable {
    pub(crate) fn insert(&mut self, make: impl FnOnce(u32) -> Arc<RegEntry>) -> Arc<RegEntry> {
        let slot = self.free.pop().unwrap_or_else(|| {
            self.slots.push((0, None));
            self.slots.len() - 1
        });
        let generation = self.slots[slot].0.wrapping_add(1);
        let key = ((slot as u32 + 1) << 8) | generation as u32;
        let entry = make(key);
        self.slots[slot] = (generation, Some(entry.clone()));
        entry
    }

    pub(crate) fn get(&self, key: u32) -> Option<&Arc<RegEntry>> {
        let slot = ((key >> 8) as usize).checked_sub(1)?;
        match self.slots.get(slot)? {
            (g, Some(e)) if *g as u32 == key & 0xff => Some(e),
            _ => None,
        }
    }

    pub(crate) fn remove(&mut self, key: u32) {
        if self.get(key).is_some() {
            let slot = (key >> 8) as usize - 1;
            self.slots[slot].1 = None;
            self.free.push(slot);
        }
    }
}

/// A device's region table behind its lock.
pub(crate) type Registry = RwLock<RegionTable>;

/// Registers `mem` in `registry` and returns the entry (its key is both lkey and rkey).
pub(crate) fn register(
    registry: &Registry,
    mem: Arc<dyn Memory>,
    len: u64,
    access: Access,
) -> Arc<RegEntry> {
    sync::write(registry).insert(|key| {
        Arc::new(RegEntry {
            mem: mem.clone(),
            len,
            access,
            key,
            live: AtomicBool::new(true),
        })
    })
}

pub(crate) fn lookup(registry: &Registry, key: u32) -> Option<Arc<RegEntry>> {
    sync::read(registry).get(key).cloned()
}

/// Registers the first `len` bytes of `mem` with `owner`'s registry, as
/// `Device::register_memory` does; the registration lasts as long as the returned guard.
pub(crate) fn register_with<O: AsRef<Registry> + Send + Sync>(
    owner: &Arc<O>,
    mem: Arc<dyn Memory>,
    len: u64,
    access: Access,
) -> Result<Registration<O>> {
    let available = mem.words().len() as u64 * 8;
    if len > available {
        return Err(FabricError::OutOfBounds {
            offset: 0,
            len,
            region_len: available,
        });
    }
    let entry = register(AsRef::<Registry>::as_ref(&**owner), mem, len, access);
    Ok(Registration {
        owner: Arc::downgrade(owner),
        entry,
    })
}

/// Registers `mem` with `owner` and returns its handle on `node`, whose drop undoes
/// the registration: `Device::register_memory` for a backend with nothing to add.
pub(crate) fn register_region<O: AsRef<Registry> + Send + Sync + 'static>(
    owner: &Arc<O>,
    node: NodeId,
    mem: Arc<dyn Memory>,
    len: u64,
    access: Access,
) -> Result<Region> {
    let registration = register_with(owner, mem, len, access)?;
    let entry = registration.entry.clone();
    Ok(region(&entry, node, Box::new(registration)))
}

/// The handle of registered `entry` on `node`; `guard` (which undoes the registration
/// when dropped) lives as long as it.
pub(crate) fn region(entry: &RegEntry, node: NodeId, guard: Box<dyn Send + Sync>) -> Region {
    Region::from_parts(
        entry.mem.clone(),
        entry.len,
        (entry.key, entry.key),
        entry.access,
        node,
        guard,
    )
}

/// Undoes a registration when its `Region` is dropped.
pub(crate) struct Registration<O: AsRef<Registry> + Send + Sync> {
    pub(crate) owner: Weak<O>,
    pub(crate) entry: Arc<RegEntry>,
}

impl<O: AsRef<Registry> + Send + Sync> Drop for Registration<O> {
    fn drop(&mut self) {
        self.entry.live.store(false, Ordering::Release);
        if let Some(owner) = self.owner.upgrade() {
            sync::write(AsRef::<Registry>::as_ref(&*owner)).remove(self.entry.key);
        }
    }
}
