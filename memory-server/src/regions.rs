//! The region scheme, the region directory, and the memory behind regions.
//!
//! A memory server exports:
//!
//! - `catalog`: [`CATALOG_BYTES`], zeroed, at a name every compute node knows. txn keeps
//!   its catalog (table definitions, partitions, index locations) there and updates it
//!   with CAS; the memory server never interprets it.
//! - `data.0`, `data.1`, …: `--size` bytes in regions of `--region-size` bytes (the last
//!   one holds the remainder). Bounded regions keep each registration (and, on an RNIC,
//!   each pinned translation table) a manageable size, and let memory be added later as
//!   further regions without re-registering what exists.
//!
//! Every region is registered with [`Access::ALL`]: the server is dumb, and access
//! control is the cluster token. Names in [`WELL_KNOWN_REGIONS`] are reserved.

use fabric::{Access, Device, Memory, NodeId, Region, RemoteRegion};
use std::sync::Arc;
use thiserror::Error;

/// The well-known catalog region.
pub const CATALOG_REGION: &str = "catalog";
/// Size of the catalog region: room for thousands of table definitions.
pub const CATALOG_BYTES: u64 = 1 << 20;
/// Data regions are named `data.<n>`, numbered from 0 in address order of the plan.
pub const DATA_REGION_PREFIX: &str = "data.";
/// Names with a fixed meaning, created by every memory server.
pub const WELL_KNOWN_REGIONS: &[&str] = &[CATALOG_REGION];
/// `--region-size` when not given.
pub const DEFAULT_REGION_SIZE: u64 = 1 << 30;
/// More regions than this is a configuration mistake (a tiny `--region-size`).
pub const MAX_REGIONS: usize = 4096;

#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum PlanError {
    #[error("--size must be at least 8 bytes")]
    ZeroSize,
    #[error("--region-size must be at least 8 bytes")]
    ZeroRegionSize,
    #[error("{what} must be a multiple of 8 bytes (region memory is 8-byte words), got {value}")]
    NotWords { what: &'static str, value: u64 },
    #[error(
        "--size {size} in regions of {region_size} bytes makes {count} regions; at most {MAX_REGIONS} are allowed (raise --region-size)"
    )]
    TooManyRegions {
        size: u64,
        region_size: u64,
        count: u64,
    },
}

/// The regions a server will create: names and lengths, catalog first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionPlan {
    regions: Vec<(String, u64)>,
}

impl RegionPlan {
    pub fn new(size: u64, region_size: u64) -> Result<RegionPlan, PlanError> {
        if size == 0 {
            return Err(PlanError::ZeroSize);
        }
        if region_size == 0 {
            return Err(PlanError::ZeroRegionSize);
        }
        if !size.is_multiple_of(8) {
            return Err(PlanError::NotWords {
                what: "--size",
                value: size,
            });
        }
        if !region_size.is_multiple_of(8) {
            return Err(PlanError::NotWords {
                what: "--region-size",
                value: region_size,
            });
        }
        let count = size.div_ceil(region_size);
        if count > MAX_REGIONS as u64 {
            return Err(PlanError::TooManyRegions {
                size,
                region_size,
                count,
            });
        }
        let mut regions = vec![(CATALOG_REGION.to_string(), CATALOG_BYTES)];
        let mut left = size;
        for n in 0..count {
            let len = left.min(region_size);
            regions.push((format!("{DATA_REGION_PREFIX}{n}"), len));
            left -= len;
        }
        Ok(RegionPlan { regions })
    }

    /// `(name, len)` of every region, catalog first, then data regions in order.
    pub fn regions(&self) -> &[(String, u64)] {
        &self.regions
    }

    /// Bytes of all regions together.
    pub fn total_bytes(&self) -> u64 {
        self.regions.iter().map(|(_, len)| len).sum()
    }

    /// Bytes of the data regions (`--size`): the catalog is not counted.
    pub fn data_bytes(&self) -> u64 {
        self.regions
            .iter()
            .filter(|(name, _)| name.starts_with(DATA_REGION_PREFIX))
            .map(|(_, len)| len)
            .sum()
    }
}

/// A region as the directory publishes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionInfo {
    pub name: String,
    pub remote: RemoteRegion,
    pub access: Access,
}

/// A memory server's region directory.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RegionDirectory {
    regions: Vec<RegionInfo>,
}

impl RegionDirectory {
    pub fn new(regions: Vec<RegionInfo>) -> RegionDirectory {
        RegionDirectory { regions }
    }

    pub fn regions(&self) -> &[RegionInfo] {
        &self.regions
    }

    pub fn get(&self, name: &str) -> Option<&RegionInfo> {
        self.regions.iter().find(|r| r.name == name)
    }

    pub fn catalog(&self) -> Option<&RegionInfo> {
        self.get(CATALOG_REGION)
    }

    /// The data regions, in order.
    pub fn data(&self) -> impl Iterator<Item = &RegionInfo> {
        self.regions
            .iter()
            .filter(|r| r.name.starts_with(DATA_REGION_PREFIX))
    }

    pub fn len(&self) -> usize {
        self.regions.len()
    }

    pub fn is_empty(&self) -> bool {
        self.regions.is_empty()
    }
}

/// Parses a byte count: a number with an optional binary unit (`K`/`KiB`, `M`/`MiB`,
/// `G`/`GiB`, `T`/`TiB`, all powers of 1024; `B` or none for bytes). Case-insensitive.
pub fn parse_bytes(input: &str) -> Result<u64, String> {
    let s = input.trim();
    let digits = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (number, unit) = s.split_at(digits);
    if number.is_empty() {
        return Err(format!(
            "`{input}` is not a byte count: expected a number such as 4096, 64MiB or 2G"
        ));
    }
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kib" => 10,
        "m" | "mib" => 20,
        "g" | "gib" => 30,
        "t" | "tib" => 40,
        other => {
            return Err(format!(
                "`{input}`: unknown unit `{other}`; use B, KiB, MiB, GiB or TiB (powers of 1024)"
            ));
        }
    };
    let value: u64 = number
        .parse()
        .map_err(|_| format!("`{input}` does not fit in 64 bits"))?;
    value
        .checked_mul(1u64 << shift)
        .ok_or_else(|| format!("`{input}` does not fit in 64 bits"))
}

/// Memory allocated for one region.
pub(crate) struct Allocation {
    pub memory: Arc<dyn Memory>,
    pub mapped_len: u64,
    pub huge_pages: bool,
    /// Why huge pages were not used, when they were tried.
    pub fallback_reason: Option<String>,
}

/// Allocates the memory of one region: a memfd mapping (huge pages when the host has
/// them) where memfds exist, heap memory elsewhere. `pin`: back every page now
/// ([`ServerConfig::pin_memory`](crate::ServerConfig::pin_memory)).
pub(crate) fn allocate(name: &str, len: u64, pin: bool) -> Result<Allocation, String> {
    #[cfg(all(target_os = "linux", not(fabric_loom)))]
    {
        let mem =
            fabric::MemfdMemory::new(&format!("namdb-{name}"), len).map_err(|e| e.to_string())?;
        if pin {
            mem.populate().map_err(|e| format!("pinning it: {e}"))?;
        }
        Ok(Allocation {
            mapped_len: mem.mapped_len(),
            huge_pages: mem.huge_pages(),
            fallback_reason: mem.huge_page_fallback_reason().map(str::to_string),
            memory: Arc::new(mem),
        })
    }
    #[cfg(not(all(target_os = "linux", not(fabric_loom))))]
    {
        let _ = name;
        let memory = if pin {
            fabric::HeapMemory::pinned(len).map_err(|e| format!("pinning it: {e}"))?
        } else {
            fabric::HeapMemory::new(len).map_err(|e| e.to_string())?
        };
        Ok(Allocation {
            memory: Arc::new(memory),
            mapped_len: len,
            huge_pages: false,
            fallback_reason: None,
        })
    }
}

/// A region the server created and registered.
pub(crate) struct ServedRegion {
    pub info: RegionInfo,
    pub mapped_len: u64,
    pub huge_pages: bool,
    /// Keeps the registration alive (dropping it deregisters the region); durable
    /// servers also read and restore the region's memory through it.
    pub region: Region,
}

#[derive(Debug, Error)]
pub enum AllocError {
    #[error("cannot allocate region `{name}` ({len} bytes): {reason}")]
    Allocate {
        name: String,
        len: u64,
        reason: String,
    },
    #[error("cannot register region `{name}` ({len} bytes) with the {backend} device: {source}")]
    Register {
        name: String,
        len: u64,
        backend: &'static str,
        #[source]
        source: fabric::FabricError,
    },
}

/// Allocates and registers every region of a plan; `pin`: with every page backed.
pub(crate) fn create(
    plan: &RegionPlan,
    device: &dyn Device,
    pin: bool,
) -> Result<Vec<ServedRegion>, AllocError> {
    let mut served = Vec::with_capacity(plan.regions().len());
    let mut fallback_logged = false;
    for (name, len) in plan.regions() {
        let (name, len) = (name.clone(), *len);
        let alloc = allocate(&name, len, pin).map_err(|reason| AllocError::Allocate {
            name: name.clone(),
            len,
            reason,
        })?;
        if let (Some(reason), false) = (&alloc.fallback_reason, fallback_logged) {
            tracing::info!("huge pages unavailable, regions use ordinary pages: {reason}");
            fallback_logged = true;
        }
        let region = device
            .register_memory(alloc.memory, len, Access::ALL)
            .map_err(|source| AllocError::Register {
                name: name.clone(),
                len,
                backend: device.backend(),
                source,
            })?;
        served.push(ServedRegion {
            info: RegionInfo {
                name,
                remote: region.remote(),
                access: region.access(),
            },
            mapped_len: alloc.mapped_len,
            huge_pages: alloc.huge_pages,
            region,
        });
    }
    Ok(served)
}

/// The directory of a set of served regions, all on `node`.
pub(crate) fn directory(regions: &[ServedRegion], node: NodeId) -> RegionDirectory {
    debug_assert!(regions.iter().all(|r| r.info.remote.node == node));
    RegionDirectory::new(regions.iter().map(|r| r.info.clone()).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use fabric::sim::{SimConfig, SimNetwork};

    #[test]
    fn size_splits_into_bounded_data_regions_after_the_catalog() {
        let plan = RegionPlan::new(10 << 20, 4 << 20).unwrap();
        let expected: Vec<(String, u64)> = vec![
            ("catalog".into(), CATALOG_BYTES),
            ("data.0".into(), 4 << 20),
            ("data.1".into(), 4 << 20),
            ("data.2".into(), 2 << 20),
        ];
        assert_eq!(plan.regions(), &expected[..]);
        assert_eq!(plan.total_bytes(), CATALOG_BYTES + (10 << 20));
        assert_eq!(plan.data_bytes(), 10 << 20);
    }

    #[test]
    fn a_size_below_the_region_size_is_one_region() {
        let plan = RegionPlan::new(4096, DEFAULT_REGION_SIZE).unwrap();
        assert_eq!(plan.regions().len(), 2);
        assert_eq!(plan.regions()[1], ("data.0".to_string(), 4096));
    }

    #[test]
    fn bad_plans_are_explained() {
        assert_eq!(RegionPlan::new(0, 8), Err(PlanError::ZeroSize));
        assert_eq!(RegionPlan::new(8, 0), Err(PlanError::ZeroRegionSize));
        assert!(matches!(
            RegionPlan::new(12, 8),
            Err(PlanError::NotWords { what: "--size", .. })
        ));
        assert!(matches!(
            RegionPlan::new(16, 12),
            Err(PlanError::NotWords {
                what: "--region-size",
                ..
            })
        ));
        let err = RegionPlan::new(1 << 30, 8).unwrap_err();
        assert!(matches!(err, PlanError::TooManyRegions { .. }));
        assert!(err.to_string().contains("raise --region-size"), "{err}");
        // The largest size still allowed is exactly MAX_REGIONS regions.
        assert_eq!(
            RegionPlan::new(MAX_REGIONS as u64 * 8, 8)
                .unwrap()
                .regions()
                .len(),
            MAX_REGIONS + 1
        );
    }

    #[test]
    fn byte_counts_parse_with_binary_units() {
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert_eq!(parse_bytes("64MiB"), Ok(64 << 20));
        assert_eq!(parse_bytes("64m"), Ok(64 << 20));
        assert_eq!(parse_bytes("2G"), Ok(2 << 30));
        assert_eq!(parse_bytes(" 1 TiB "), Ok(1 << 40));
        assert_eq!(parse_bytes("8B"), Ok(8));
        assert_eq!(parse_bytes("3k"), Ok(3072));
        for bad in ["", "MiB", "-1", "1.5G", "12X", "1GB"] {
            let err = parse_bytes(bad).unwrap_err();
            assert!(err.contains(bad.trim()), "{bad}: {err}");
        }
        assert!(parse_bytes("99999999999999999999").is_err());
        assert!(parse_bytes("17179869184G").is_err());
    }

    #[test]
    fn created_regions_are_registered_zeroed_and_listed() {
        let net = SimNetwork::new(SimConfig::default());
        let dev = net.add_node();
        let plan = RegionPlan::new(3 * 4096, 2 * 4096).unwrap();
        let served = create(&plan, &*dev, false).unwrap();
        let dir = directory(&served, dev.node());
        assert_eq!(dir.len(), 3);
        let names: Vec<&str> = dir.regions().iter().map(|r| r.name.as_str()).collect();
        assert_eq!(names, ["catalog", "data.0", "data.1"]);
        assert_eq!(dir.catalog().unwrap().remote.len, CATALOG_BYTES);
        let data: Vec<u64> = dir.data().map(|r| r.remote.len).collect();
        assert_eq!(data, [8192, 4096]);
        let rkeys: std::collections::HashSet<u32> =
            dir.regions().iter().map(|r| r.remote.rkey).collect();
        assert_eq!(rkeys.len(), 3, "every region has its own rkey");
        for (r, s) in dir.regions().iter().zip(&served) {
            assert_eq!(r.access, Access::ALL);
            assert_eq!(r.remote.node, dev.node());
            assert!(s.mapped_len >= r.remote.len);
            assert_eq!(s.region.to_vec(0, 64).unwrap(), vec![0; 64]);
        }
        assert!(dir.get("data.2").is_none());
    }
}
