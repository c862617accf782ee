//! Sizing the radix join's fan-out to the cache (Balkesen et al., ICDE 2013 §4;
//! Binnig et al. §5.2): a node's share of R is split into partitions small enough
//! that a partition's tuples and its hash table stay in the L2 cache while it is
//! joined, and the fan-out stays small enough that the software-managed buffers of
//! the partitioning pass (one block per partition) fit the cache too.

use std::path::Path;

/// Bytes a build tuple occupies while its partition is joined: the tuple, its `next`
/// link and (load factor ≥ ½) up to two bucket heads.
pub const BUILD_BYTES_PER_TUPLE: u64 = 16 + 4 + 8;

/// The cache size used when sysfs does not tell.
pub const FALLBACK_CACHE_BYTES: usize = 256 << 10;

/// The per-core L2 cache size of CPU 0 from sysfs, or [`FALLBACK_CACHE_BYTES`].
pub fn l2_cache_bytes() -> usize {
    l2_from_sysfs(Path::new("/sys/devices/system/cpu/cpu0/cache")).unwrap_or(FALLBACK_CACHE_BYTES)
}

fn l2_from_sysfs(dir: &Path) -> Option<usize> {
    for entry in std::fs::read_dir(dir).ok()?.flatten() {
        let read = |name: &str| std::fs::read_to_string(entry.path().join(name)).ok();
        let level = read("level").map(|s| s.trim().to_string());
        let kind = read("type").map(|s| s.trim().to_string());
        if level.as_deref() == Some("2") && kind.as_deref() != Some("Instruction") {
            return read("size").and_then(|s| parse_size(&s));
        }
    }
    None
}

/// Parses sysfs cache sizes such as `2048K`, `1M` or `512`.
pub fn parse_size(text: &str) -> Option<usize> {
    let t = text.trim();
    let (digits, unit) = match t.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        Some((i, _)) => t.split_at(i),
        None => (t, ""),
    };
    let n: usize = digits.parse().ok()?;
    let scale = match unit.trim() {
        "" => 1,
        "K" | "k" | "KB" | "KiB" => 1 << 10,
        "M" | "MB" | "MiB" => 1 << 20,
        _ => return None,
    };
    n.checked_mul(scale).filter(|&b| b > 0)
}

/// Partitions per node for a node's `build_tuples` R tuples on `nodes` nodes, with a
/// cache of `cache_bytes` and software-managed buffers of `block_bytes` per partition:
/// the smallest power of two whose partitions fit half the cache, capped so that the
/// buffers of all `nodes × partitions` partitions fit half the cache.
pub fn partitions_per_node(
    build_tuples: u64,
    nodes: usize,
    cache_bytes: usize,
    block_bytes: usize,
) -> usize {
    let budget = (cache_bytes / 2).max(1) as u64;
    let wanted = (build_tuples * BUILD_BYTES_PER_TUPLE)
        .div_ceil(budget)
        .max(1)
        .next_power_of_two();
    let cap = ((budget as usize / block_bytes.max(1)) / nodes.max(1)).max(1);
    let cap = if cap.is_power_of_two() {
        cap
    } else {
        cap.next_power_of_two() / 2
    };
    (wanted as usize).min(cap)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_like_sysfs_prints_them() {
        assert_eq!(parse_size("2048K\n"), Some(2 << 20));
        assert_eq!(parse_size("1M"), Some(1 << 20));
        assert_eq!(parse_size("512"), Some(512));
        assert_eq!(parse_size("x"), None);
        assert_eq!(parse_size("0K"), None);
    }

    #[test]
    fn fanout_grows_with_the_input_and_stops_at_the_buffer_cap() {
        let cache = 1 << 20;
        assert_eq!(partitions_per_node(100, 2, cache, 512), 1);
        let one_m = partitions_per_node(1 << 20, 2, cache, 512);
        // 1 Mi tuples × 28 bytes over 512 KiB: 56 → 64 partitions.
        assert_eq!(one_m, 64);
        assert_eq!(partitions_per_node(4 << 20, 2, cache, 512), 256);
        // 512 KiB of 512-byte blocks is 1024 blocks, 512 per node.
        assert_eq!(partitions_per_node(1 << 40, 2, cache, 512), 512);
        assert_eq!(partitions_per_node(1 << 40, 3, cache, 512), 256);
    }

    #[test]
    fn this_machine_reports_some_cache() {
        assert!(l2_cache_bytes() >= 16 << 10);
    }
}
