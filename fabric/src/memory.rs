//! Region memory as an array of atomic words, and byte copies over it.
//!
//! Region memory may be touched by another thread (or process, or NIC) at any moment,
//! so it is never accessed through plain references: every access is an atomic word
//! operation. Bytes are the little-endian encoding of the words, so the byte view and
//! the word view of a region agree on every host.
//!
//! Ordering: copies load with Acquire and store with Relaxed except the last word of a
//! copy, which is stored with Release. A WRITE's bytes therefore land in increasing
//! address order as far as any reader can tell, and a reader that sees a WRITE's last
//! word also sees the rest of it.

use crate::sync::{AtomicU64, Ordering};

/// Memory that can back a region: anything that exposes a stable array of atomic words.
pub trait Memory: Send + Sync {
    fn words(&self) -> &[AtomicU64];

    /// A file whose contents from offset 0 are these words, for memory that another
    /// process can map (the `shm` backend hands it to peers). `None`: this process only.
    #[cfg(unix)]
    fn fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        None
    }
}

/// Plain process memory, zero-initialised.
pub struct HeapMemory(Words);

enum Words {
    Boxed(Box<[AtomicU64]>),
    /// A private anonymous mapping on transparent huge pages: large regions cost
    /// memory only as they fill, and filling them faults once per 2 MiB rather than
    /// once per page (a table's index is written at random places, so 4 KiB faults
    /// with their TLB shootdowns would dominate a run).
    #[cfg(not(fabric_loom))]
    Mapped {
        ptr: std::ptr::NonNull<AtomicU64>,
        words: usize,
    },
}

// SAFETY: the mapping is only reached through `&[AtomicU64]`, which is Send and Sync.
#[cfg(not(fabric_loom))]
unsafe impl Send for Words {}
// SAFETY: as above.
#[cfg(not(fabric_loom))]
unsafe impl Sync for Words {}

impl HeapMemory {
    /// Regions from this size on are mapped rather than allocated.
    #[cfg(not(fabric_loom))]
    const MAP_FROM: u64 = 4 << 20;

    /// Zeroed memory of `bytes`, backed as it is touched. An error, not an abort,
    /// when the kernel will not map that much (more than the address space).
    pub fn new(bytes: u64) -> std::io::Result<HeapMemory> {
        let too_big = |e: String| {
            std::io::Error::new(
                std::io::ErrorKind::OutOfMemory,
                format!("cannot map a region of {} MiB: {e}", bytes >> 20),
            )
        };
        let words = usize::try_from(bytes.div_ceil(8)).map_err(|e| too_big(e.to_string()))?;
        #[cfg(not(fabric_loom))]
        if bytes >= Self::MAP_FROM {
            return Self::map(words)
                .map(HeapMemory)
                .map_err(|e| too_big(e.to_string()));
        }
        Ok(HeapMemory(Words::Boxed(
            (0..words).map(|_| AtomicU64::new(0)).collect(),
        )))
    }

    /// Zeroed memory with every page backed before this returns, as registering
    /// memory with an RNIC pins it. Work on the region then never waits for the
    /// kernel to zero a fresh page: a TPC-W run on lazily backed memory spent 8% of
    /// its time there, and its p99 latency was five times higher.
    ///
    /// Fails, before taking any memory, if the host has less available than `bytes`.
    pub fn pinned(bytes: u64) -> std::io::Result<HeapMemory> {
        #[cfg(not(fabric_loom))]
        check_available(bytes)?;
        let memory = Self::new(bytes)?;
        // Boxed words were all written as they were made; a mapping is backed lazily.
        #[cfg(not(fabric_loom))]
        if let Words::Mapped { .. } = memory.0 {
            populate(memory.words())?;
        }
        Ok(memory)
    }

    #[cfg(not(fabric_loom))]
    fn map(words: usize) -> std::io::Result<Words> {
        use rustix::mm::{Advice, MapFlags, ProtFlags, madvise, mmap_anonymous};
        let len = words
            .checked_mul(8)
            .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::OutOfMemory))?;
        // SAFETY: a fresh private anonymous mapping aliases nothing.
        let ptr = unsafe {
            mmap_anonymous(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::PRIVATE | MapFlags::NORESERVE,
            )
        }?;
        // SAFETY: the range is the mapping just made. Huge pages are a hint: without
        // them the mapping still works, with 4 KiB faults.
        let _ = unsafe { madvise(ptr, len, Advice::LinuxHugepage) };
        Ok(Words::Mapped {
            ptr: std::ptr::NonNull::new(ptr.cast()).expect("mmap returns no null mapping"),
            words,
        })
    }
}

/// Whether the host has `bytes` of memory available (`MemAvailable`) to back now: an
/// error that says how much there is if not. Hosts without /proc/meminfo pass.
#[cfg(not(fabric_loom))]
pub(crate) fn check_available(bytes: u64) -> std::io::Result<()> {
    match HostMemory::now() {
        Some(host) if bytes > host.available => Err(std::io::Error::new(
            std::io::ErrorKind::OutOfMemory,
            format!(
                "pinning {} MiB of memory needs more than the {} MiB this host has available",
                bytes >> 20,
                host.available >> 20
            ),
        )),
        _ => Ok(()),
    }
}

/// The host's memory in bytes, as `/proc/meminfo` reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostMemory {
    pub total: u64,
    /// What can be allocated without swapping (`MemAvailable`).
    pub available: u64,
    pub swap_total: u64,
}

impl HostMemory {
    /// This host's, or `None` where `/proc/meminfo` cannot be read or parsed.
    pub fn now() -> Option<HostMemory> {
        Self::parse(&std::fs::read_to_string("/proc/meminfo").ok()?)
    }

    /// What a benchmark should leave free: a sixteenth of the host's memory, at least
    /// 1 GiB (for the checks after a run, and the rest of the host).
    pub fn reserve(&self) -> u64 {
        (self.total / 16).max(1 << 30)
    }

    /// What a benchmark may take: the available memory less [`Self::reserve`].
    pub fn spare(&self) -> u64 {
        self.available.saturating_sub(self.reserve())
    }

    /// `/proc/meminfo`'s text: lines of `Key:   value kB`.
    fn parse(text: &str) -> Option<HostMemory> {
        let field = |key: &str| {
            text.lines().find_map(|line| {
                let rest = line.strip_prefix(key)?.strip_prefix(':')?;
                let kib: u64 = rest.trim().strip_suffix("kB")?.trim().parse().ok()?;
                kib.checked_mul(1024)
            })
        };
        Some(HostMemory {
            total: field("MemTotal")?,
            available: field("MemAvailable")?,
            swap_total: field("SwapTotal").unwrap_or(0),
        })
    }
}

/// Backs every page of `words` (a fresh mapping), on all cores: the kernel zeroes each
/// page as it backs it, at a few GB/s per core. An error if the kernel runs out of
/// memory meanwhile.
#[cfg(not(fabric_loom))]
pub(crate) fn populate(words: &[AtomicU64]) -> std::io::Result<()> {
    use std::sync::atomic::AtomicUsize;
    // Whole huge pages per chunk, so no two threads fault in the same one.
    const CHUNK_WORDS: usize = (64 << 20) / 8;
    let chunks = words.len().div_ceil(CHUNK_WORDS);
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(chunks);
    let next = AtomicUsize::new(0);
    let work = || -> std::io::Result<()> {
        loop {
            let chunk = next.fetch_add(1, Ordering::Relaxed);
            if chunk >= chunks {
                return Ok(());
            }
            let part = &words[chunk * CHUNK_WORDS..((chunk + 1) * CHUNK_WORDS).min(words.len())];
            // SAFETY: the range is part of a live mapping; populating it only backs its
            // pages, and leaves their contents as they are.
            let populated = unsafe {
                rustix::mm::madvise(
                    part.as_ptr().cast_mut().cast(),
                    part.len() * 8,
                    rustix::mm::Advice::LinuxPopulateWrite,
                )
            };
            match populated {
                Ok(()) => {}
                // Kernels before 5.14 lack MADV_POPULATE_WRITE: a write fault per page
                // backs it just the same (adding zero changes nothing, even if another
                // process writes the word meanwhile).
                Err(rustix::io::Errno::INVAL) => {
                    for word in part.iter().step_by(4096 / 8) {
                        word.fetch_add(0, Ordering::Relaxed);
                    }
                }
                Err(e) => {
                    // The others stop at their next chunk.
                    next.store(chunks, Ordering::Relaxed);
                    return Err(std::io::Error::from(e));
                }
            }
        }
    };
    if threads <= 1 {
        return work();
    }
    std::thread::scope(|s| {
        let others: Vec<_> = (1..threads).map(|_| s.spawn(work)).collect();
        let mine = work();
        others
            .into_iter()
            .map(|t| t.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .chain([mine])
            .collect::<std::io::Result<()>>()
    })
}

impl Memory for HeapMemory {
    fn words(&self) -> &[AtomicU64] {
        match &self.0 {
            Words::Boxed(b) => b,
            // SAFETY: the mapping holds `words` zero-initialised words (all-zero bytes
            // are a valid AtomicU64), lives until drop, and is only accessed atomically.
            #[cfg(not(fabric_loom))]
            Words::Mapped { ptr, words } => unsafe {
                std::slice::from_raw_parts(ptr.as_ptr(), *words)
            },
        }
    }
}

#[cfg(not(fabric_loom))]
impl Drop for Words {
    fn drop(&mut self) {
        if let Words::Mapped { ptr, words } = self {
            // SAFETY: the mapping made in `map`, unmapped once; no reference to it
            // outlives `self`.
            let _ = unsafe { rustix::mm::munmap(ptr.as_ptr().cast(), *words * 8) };
        }
    }
}

/// No memory at all: what a region handle holds when the region lives on a device in
/// another process. It has keys to name it in work requests, but CPU access to it
/// fails with [`crate::FabricError::NotLocal`].
pub struct ElsewhereMemory;

impl Memory for ElsewhereMemory {
    fn words(&self) -> &[AtomicU64] {
        &[]
    }
}

/// Copies `dst.len()` bytes starting at byte `offset` out of `words`.
pub(crate) fn copy_out(words: &[AtomicU64], offset: u64, dst: &mut [u8]) {
    let mut pos = offset as usize;
    let mut dst = dst;
    // A partial first word, then whole words (the common case, and a tight loop the
    // compiler keeps branch-free), then a partial last word.
    if !pos.is_multiple_of(8) && !dst.is_empty() {
        let in_word = pos % 8;
        let n = (8 - in_word).min(dst.len());
        let word = words[pos / 8].load(Ordering::Acquire).to_le_bytes();
        let (head, rest) = dst.split_at_mut(n);
        head.copy_from_slice(&word[in_word..in_word + n]);
        dst = rest;
        pos += n;
    }
    let whole = dst.len() / 8;
    let (body, tail) = dst.split_at_mut(whole * 8);
    let cells = &words[pos / 8..pos / 8 + whole];
    for (out, cell) in body.chunks_exact_mut(8).zip(cells) {
        out.copy_from_slice(&cell.load(Ordering::Acquire).to_le_bytes());
    }
    if !tail.is_empty() {
        let word = words[pos / 8 + whole].load(Ordering::Acquire).to_le_bytes();
        tail.copy_from_slice(&word[..tail.len()]);
    }
}

/// Copies `src` into `words` starting at byte `offset`, in increasing address order,
/// the last word with Release. Partial words are merged with CAS so that bytes outside
/// the copy are never overwritten by a racing store.
pub(crate) fn copy_in(words: &[AtomicU64], offset: u64, src: &[u8]) {
    let mut pos = offset as usize;
    let mut src = src;
    if !pos.is_multiple_of(8) && !src.is_empty() {
        let in_word = pos % 8;
        let n = (8 - in_word).min(src.len());
        let order = if n == src.len() {
            Ordering::Release
        } else {
            Ordering::Relaxed
        };
        merge_into(&words[pos / 8], in_word, &src[..n], order);
        src = &src[n..];
        pos += n;
    }
    let whole = src.len() / 8;
    let (body, tail) = src.split_at(whole * 8);
    let cells = &words[pos / 8..pos / 8 + whole];
    if let Some((last_cell, cells)) = cells.split_last() {
        let (body, last_bytes) = body.split_at(body.len() - 8);
        for (bytes, cell) in body.chunks_exact(8).zip(cells) {
            cell.store(word_of(bytes), Ordering::Relaxed);
        }
        let order = if tail.is_empty() {
            Ordering::Release
        } else {
            Ordering::Relaxed
        };
        last_cell.store(word_of(last_bytes), order);
    }
    if !tail.is_empty() {
        merge_into(&words[pos / 8 + whole], 0, tail, Ordering::Release);
    }
}

fn word_of(bytes: &[u8]) -> u64 {
    u64::from_le_bytes(bytes.try_into().expect("8 bytes"))
}

/// Stores `bytes` at byte `in_word` of `cell`, leaving its other bytes as they are
/// even if another thread changes them meanwhile.
fn merge_into(cell: &AtomicU64, in_word: usize, bytes: &[u8], order: Ordering) {
    let mut cur = cell.load(Ordering::Relaxed);
    loop {
        let mut merged = cur.to_le_bytes();
        merged[in_word..in_word + bytes.len()].copy_from_slice(bytes);
        match cell.compare_exchange_weak(cur, u64::from_le_bytes(merged), order, Ordering::Relaxed)
        {
            Ok(_) => break,
            Err(actual) => cur = actual,
        }
    }
}

/// How far ahead of a streaming loop [`prefetch`] should ask for: 2 KiB, 32 cache
/// lines. Measured on this project's 2-core machines, a partition loop over a large
/// array ran at 3.2 GB/s without prefetching and at 6.2–6.9 GB/s from 2 KiB ahead
/// (1 KiB: 5.7; 4 KiB and 8 KiB: no better).
pub const PREFETCH_AHEAD_BYTES: usize = 2048;

/// Asks the CPU to start loading the cache line that holds `slice[index]` into its
/// caches; an index past the end is fine, since a prefetch never faults.
///
/// Why: the cores these benchmarks run on read ahead little on their own. A loop
/// that streams through memory with many instructions per cache line (a partition
/// loop, a word-by-word atomic copy) fills its reorder window before the next
/// line's miss is issued, and so runs at the latency of a few lines in flight.
#[inline(always)]
pub fn prefetch<T>(slice: &[T], index: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        let line = slice.as_ptr().wrapping_add(index).cast::<i8>();
        // SAFETY: SSE, which PREFETCHT0 belongs to, is part of the x86_64 baseline, and
        // a prefetch is only a hint: it reads nothing into the program and never
        // faults, whatever the address.
        unsafe { core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(line) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (slice, index);
}

/// Prefetches the cache lines of bytes `offset..offset + len` of `words` (at most
/// [`PREFETCH_AHEAD_BYTES`] of them: a longer copy reads ahead as it goes).
pub(crate) fn prefetch_bytes(words: &[AtomicU64], offset: u64, len: u64) {
    let end = offset.saturating_add(len.min(PREFETCH_AHEAD_BYTES as u64));
    let mut at = offset & !63;
    while at < end {
        prefetch(words, (at / 8) as usize);
        at += 64;
    }
}

/// Copies `len` bytes between two word arrays (a READ or a WRITE). Word-aligned
/// copies move whole words; others go through a small stack buffer. Public so that a
/// benchmark's reference can make the copy the software backends make.
pub fn copy_between(
    src: &[AtomicU64],
    src_offset: u64,
    dst: &[AtomicU64],
    dst_offset: u64,
    len: u64,
) {
    if len == 0 {
        return;
    }
    if src_offset.is_multiple_of(8) && dst_offset.is_multiple_of(8) && len.is_multiple_of(8) {
        let s = &src[(src_offset / 8) as usize..((src_offset + len) / 8) as usize];
        let d = &dst[(dst_offset / 8) as usize..((dst_offset + len) / 8) as usize];
        let (last_d, body_d) = d.split_last().expect("len > 0");
        let (last_s, body_s) = s.split_last().expect("len > 0");
        const AHEAD: usize = PREFETCH_AHEAD_BYTES / 8;
        // The first window at once, so a short copy (a record) has all of its cache
        // lines in flight together; then one line per 8 words, never past the source.
        for i in (0..s.len().min(AHEAD)).step_by(8).chain([s.len() - 1]) {
            prefetch(s, i);
        }
        // A cache line of words per step, with a fixed-length inner copy.
        const LINE: usize = 8;
        let (lines_d, lines_s) = (body_d.chunks_exact(LINE), body_s.chunks_exact(LINE));
        let (tail_d, tail_s) = (lines_d.remainder(), lines_s.remainder());
        for (l, (d, s)) in lines_d.zip(lines_s).enumerate() {
            if l * LINE + AHEAD < body_s.len() {
                prefetch(body_s, l * LINE + AHEAD);
            }
            for k in 0..LINE {
                d[k].store(s[k].load(Ordering::Acquire), Ordering::Relaxed);
            }
        }
        for (d, s) in tail_d.iter().zip(tail_s) {
            d.store(s.load(Ordering::Acquire), Ordering::Relaxed);
        }
        last_d.store(last_s.load(Ordering::Acquire), Ordering::Release);
        return;
    }
    let mut buf = [0u8; 512];
    let mut done = 0;
    while done < len {
        let n = (len - done).min(buf.len() as u64);
        let chunk = &mut buf[..n as usize];
        copy_out(src, src_offset + done, chunk);
        copy_in(dst, dst_offset + done, chunk);
        done += n;
    }
}

/// How many bytes of `words` are backed by memory now, from /proc/self/pagemap (bit
/// 63 of a page's entry: present).
#[cfg(all(test, target_os = "linux", not(fabric_loom)))]
pub(crate) fn resident_bytes(words: &[AtomicU64]) -> u64 {
    use std::io::{Read, Seek, SeekFrom};
    const PAGE: usize = 4096;
    let start = words.as_ptr() as usize / PAGE;
    let end = (words.as_ptr() as usize + words.len() * 8).div_ceil(PAGE);
    let mut pagemap = std::fs::File::open("/proc/self/pagemap").unwrap();
    pagemap.seek(SeekFrom::Start(start as u64 * 8)).unwrap();
    let mut entries = vec![0u8; (end - start) * 8];
    pagemap.read_exact(&mut entries).unwrap();
    let present = entries
        .chunks_exact(8)
        .filter(|e| u64::from_le_bytes((*e).try_into().unwrap()) >> 63 == 1)
        .count();
    (present * PAGE) as u64
}

#[cfg(all(test, not(fabric_loom)))]
mod tests {
    use super::*;

    fn region(bytes: u64) -> HeapMemory {
        HeapMemory::new(bytes).unwrap()
    }

    #[test]
    fn meminfo_parses_into_bytes() {
        let text = "MemTotal:       24684164 kB\nMemFree:        22045700 kB\n\
                    MemAvailable:   23300600 kB\nSwapCached:            0 kB\n\
                    SwapTotal:             0 kB\n";
        assert_eq!(
            HostMemory::parse(text),
            Some(HostMemory {
                total: 24_684_164 * 1024,
                available: 23_300_600 * 1024,
                swap_total: 0,
            })
        );
        // A kernel without MemAvailable (before 3.14) gives nothing to go by.
        assert_eq!(
            HostMemory::parse("MemTotal: 100 kB\nMemFree: 50 kB\n"),
            None
        );
        assert_eq!(
            HostMemory::parse("MemTotal: lots\nMemAvailable: 5 kB\n"),
            None
        );
        #[cfg(target_os = "linux")]
        {
            let host = HostMemory::now().expect("/proc/meminfo");
            assert!(host.total > 0 && host.available <= host.total, "{host:?}");
        }
    }

    #[test]
    fn a_region_larger_than_the_address_space_is_an_error_not_an_abort() {
        for bytes in [1 << 62, u64::MAX] {
            let err = HeapMemory::new(bytes).err().expect("refused");
            assert_eq!(err.kind(), std::io::ErrorKind::OutOfMemory);
            assert!(err.to_string().contains("cannot map"), "{err}");
        }
    }

    #[test]
    fn unaligned_copy_in_preserves_neighbouring_bytes() {
        let m = region(32);
        copy_in(m.words(), 0, &[0xAA; 32]);
        copy_in(m.words(), 3, &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]);
        let mut out = [0u8; 32];
        copy_out(m.words(), 0, &mut out);
        assert_eq!(&out[..3], &[0xAA; 3]);
        assert_eq!(&out[3..13], &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]);
        assert_eq!(&out[13..], &[0xAA; 19]);
    }

    #[test]
    #[cfg(target_os = "linux")]
    fn pinned_memory_is_backed_when_made_and_lazy_memory_is_not() {
        const BYTES: u64 = 64 << 20;
        let pinned = HeapMemory::pinned(BYTES).unwrap();
        assert_eq!(resident_bytes(pinned.words()), BYTES);
        assert!(
            pinned
                .words()
                .iter()
                .all(|w| w.load(Ordering::Relaxed) == 0)
        );
        let lazy = HeapMemory::new(BYTES).unwrap();
        assert!(resident_bytes(lazy.words()) < BYTES / 4);
    }

    #[test]
    #[cfg(target_os = "linux")]
    fn pinning_more_than_the_host_has_is_a_clear_error() {
        let err = HeapMemory::pinned(1 << 50)
            .err()
            .expect("a petabyte is refused");
        assert_eq!(err.kind(), std::io::ErrorKind::OutOfMemory);
        assert!(err.to_string().contains("available"), "{err}");
    }

    #[test]
    fn copy_in_and_out_handle_every_offset_and_length() {
        let pattern: Vec<u8> = (0..200u32).map(|i| (i * 13 + 5) as u8).collect();
        for offset in 0..17u64 {
            for len in 0..=70usize {
                let m = region(128);
                copy_in(m.words(), 0, &[0xAA; 128]);
                copy_in(m.words(), offset, &pattern[..len]);
                let mut all = vec![0u8; 128];
                copy_out(m.words(), 0, &mut all);
                let end = offset as usize + len;
                assert_eq!(
                    &all[offset as usize..end],
                    &pattern[..len],
                    "{offset}+{len}"
                );
                assert!(
                    all[..offset as usize].iter().all(|&b| b == 0xAA),
                    "{offset}+{len}"
                );
                assert!(all[end..].iter().all(|&b| b == 0xAA), "{offset}+{len}");
                let mut back = vec![0u8; len];
                copy_out(m.words(), offset, &mut back);
                assert_eq!(back, &pattern[..len], "{offset}+{len}");
            }
        }
    }

    #[test]
    fn copy_between_handles_every_alignment() {
        let src = region(1024);
        let pattern: Vec<u8> = (0..1024u32).map(|i| (i * 7 + 1) as u8).collect();
        copy_in(src.words(), 0, &pattern);
        for so in 0..9u64 {
            for d_o in 0..9u64 {
                // Up to a cache line of words, then whole lines and a tail (the aligned
                // copy moves 8 words per step).
                for len in [0u64, 1, 7, 8, 9, 33, 64, 72, 80, 136, 200, 520, 1000] {
                    let dst = region(1024);
                    copy_between(src.words(), so, dst.words(), d_o, len);
                    let mut out = vec![0u8; 1024];
                    copy_out(dst.words(), 0, &mut out);
                    assert_eq!(
                        &out[d_o as usize..(d_o + len) as usize],
                        &pattern[so as usize..(so + len) as usize]
                    );
                    assert!(out[..d_o as usize].iter().all(|&b| b == 0));
                    assert!(out[(d_o + len) as usize..].iter().all(|&b| b == 0));
                }
            }
        }
    }

    #[test]
    fn words_are_little_endian_bytes() {
        let m = region(8);
        copy_in(m.words(), 0, &0x0102_0304_0506_0708u64.to_le_bytes());
        assert_eq!(m.words()[0].load(Ordering::Relaxed), 0x0102_0304_0506_0708);
    }
}
