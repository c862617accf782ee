//! Region memory in a memfd mapping (Linux).
//!
//! A memory server backs its regions with memfds rather than heap memory for two
//! reasons: the fd can be handed to another process (the `shm` backend passes it over
//! a Unix socket with SCM_RIGHTS, and the peer maps the same pages), and a memfd can
//! live on huge pages (`MFD_HUGETLB`), which spares the TLB — and an RNIC's translation
//! cache — one entry per 4 KiB. Huge pages are tried first; a host without reserved
//! huge pages falls back to ordinary pages.
//!
//! The mapping is `MAP_SHARED`: another process that maps the fd sees the same memory,
//! so the mapping is only ever touched through atomic words ([`Memory::words`]), as all
//! region memory is. Backing pages are allocated up front (`fallocate`), as registering
//! with an RNIC pins them: running out of memory is an error here, not a `SIGBUS` on
//! the data path later. The kernel still zeroes each page at its first touch, in the
//! process that touches it; [`MemfdMemory::populate`] does all of that at once. The
//! size is then sealed (`F_SEAL_SHRINK | F_SEAL_GROW`): a process the fd is handed to
//! cannot truncate it under the owner's mapping (which would turn the owner's next
//! access into a `SIGBUS`), and [`MemfdMemory::from_peer`] refuses an fd that is not
//! sealed so, for the same reason the other way round.

use crate::memory::Memory;
use crate::sync::AtomicU64;
use rustix::fs::{FallocateFlags, MemfdFlags, Mode, OFlags, SealFlags};
use rustix::mm::{MapFlags, ProtFlags};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;
use thiserror::Error;

/// The huge page size a memfd mapping asks for (`MFD_HUGE_2MB`).
pub const HUGE_PAGE_SIZE: u64 = 2 << 20;

/// The longest name `memfd_create` accepts (excluding the terminating NUL).
const MAX_NAME_LEN: usize = 249;

/// Whether a mapping lives on huge pages.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum HugePages {
    /// Huge pages if the host has enough free, ordinary pages otherwise.
    #[default]
    Try,
    /// Huge pages or an error.
    Require,
    /// Ordinary pages only.
    Never,
}

#[derive(Debug, Error)]
pub enum MemfdError {
    #[error("a memfd mapping needs at least 1 byte")]
    Empty,
    #[error("{len} bytes do not fit in this process's address space")]
    TooLarge { len: u64 },
    #[error("invalid memfd name `{name}`: {reason}")]
    InvalidName { name: String, reason: &'static str },
    #[error("{step} failed for a memfd of {len} bytes on {pages}: {source}")]
    Sys {
        step: &'static str,
        len: u64,
        pages: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "{len} bytes are more than this host can back: it has {available} bytes available, \
         and {reserve} of them stay free for everything else"
    )]
    NoRoom {
        len: u64,
        available: u64,
        reserve: u64,
    },
    #[error("huge pages were required but are unavailable ({0})")]
    HugePagesUnavailable(#[source] Box<MemfdError>),
    #[error("a peer's memfd cannot be mapped: {0}")]
    Peer(String),
}

/// Zeroed memory in a shared memfd mapping, usable as region memory.
pub struct MemfdMemory {
    fd: OwnedFd,
    base: NonNull<AtomicU64>,
    mapped_len: usize,
    len: u64,
    huge_pages: bool,
    fallback_reason: Option<String>,
}

// SAFETY: the mapping is owned by this value and unmapped only in `Drop`; every access
// to it goes through `&[AtomicU64]`, which is safe to share and send between threads.
unsafe impl Send for MemfdMemory {}
// SAFETY: as for `Send`: shared access is atomic-only.
unsafe impl Sync for MemfdMemory {}

impl MemfdMemory {
    /// Backs every page now, as an RNIC pins registered memory. A memfd's `fallocate`
    /// reserves its pages but the kernel zeroes each one at its first touch, so
    /// without this the processes using the memory pay for that as they go. (The
    /// pages are already reserved, so this needs no more memory than `new` took.)
    pub fn populate(&self) -> std::io::Result<()> {
        crate::memory::populate(self.words())
    }

    /// Maps `len` bytes (rounded up to whole pages), on huge pages if the host has them.
    /// `name` shows up in `/proc/<pid>/fd` and `/proc/<pid>/maps`.
    pub fn new(name: &str, len: u64) -> Result<MemfdMemory, MemfdError> {
        MemfdMemory::with_huge_pages(name, len, HugePages::Try)
    }

    pub fn with_huge_pages(
        name: &str,
        len: u64,
        huge: HugePages,
    ) -> Result<MemfdMemory, MemfdError> {
        if len == 0 {
            return Err(MemfdError::Empty);
        }
        if name.len() > MAX_NAME_LEN {
            return Err(MemfdError::InvalidName {
                name: name.into(),
                reason: "longer than 249 bytes",
            });
        }
        if name.contains('\0') {
            return Err(MemfdError::InvalidName {
                name: name.into(),
                reason: "contains a NUL byte",
            });
        }
        match huge {
            HugePages::Never => map(name, len, false),
            HugePages::Require => {
                map(name, len, true).map_err(|e| MemfdError::HugePagesUnavailable(Box::new(e)))
            }
            HugePages::Try => match map(name, len, true) {
                Ok(m) => Ok(m),
                Err(huge_err) => {
                    let mut m = map(name, len, false)?;
                    m.fallback_reason = Some(huge_err.to_string());
                    Ok(m)
                }
            },
        }
    }

    /// The length asked for.
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The length mapped: `len` rounded up to the page size in use.
    pub fn mapped_len(&self) -> u64 {
        self.mapped_len as u64
    }

    /// Whether the mapping is on huge pages.
    pub fn huge_pages(&self) -> bool {
        self.huge_pages
    }

    /// Why huge pages were not used, when they were tried and failed.
    pub fn huge_page_fallback_reason(&self) -> Option<&str> {
        self.fallback_reason.as_deref()
    }

    /// Maps a memfd that another process handed over: all of it, shared, writable only
    /// if `writable` (mapping a read-only fd writable fails). The fd must be sealed
    /// against shrinking, so the owner cannot pull the pages from under this mapping.
    pub fn from_peer(fd: OwnedFd, writable: bool) -> Result<MemfdMemory, MemfdError> {
        let bad = |reason: String| MemfdError::Peer(reason);
        let stat = rustix::fs::fstat(&fd).map_err(|e| bad(format!("fstat: {e}")))?;
        let len = u64::try_from(stat.st_size).map_err(|_| bad("negative size".into()))?;
        if len == 0 || !len.is_multiple_of(8) {
            return Err(bad(format!("size {len} is not a positive multiple of 8")));
        }
        let mapped = usize::try_from(len)
            .ok()
            .filter(|&m| m <= isize::MAX as usize)
            .ok_or(MemfdError::TooLarge { len })?;
        let seals =
            rustix::fs::fcntl_get_seals(&fd).map_err(|e| bad(format!("not a memfd ({e})")))?;
        if !seals.contains(SealFlags::SHRINK) {
            return Err(bad("its size is not sealed against shrinking".into()));
        }
        let prot = if writable {
            ProtFlags::READ | ProtFlags::WRITE
        } else {
            ProtFlags::READ
        };
        // SAFETY: a fresh mapping chosen by the kernel aliases no Rust object; the fd's
        // size is `mapped` and sealed against shrinking, so every page stays backed.
        let ptr = unsafe {
            rustix::mm::mmap(std::ptr::null_mut(), mapped, prot, MapFlags::SHARED, &fd, 0)
        }
        .map_err(|e| bad(format!("mmap: {e}")))?;
        let base = NonNull::new(ptr.cast::<AtomicU64>())
            .ok_or_else(|| bad("the kernel returned a null mapping".into()))?;
        Ok(MemfdMemory {
            fd,
            base,
            mapped_len: mapped,
            len,
            huge_pages: false,
            fallback_reason: None,
        })
    }

    /// A new read-only fd of the same memory, to hand to a process that may only read
    /// it: it can neither map it writable nor change its size or contents.
    pub fn read_only_fd(&self) -> std::io::Result<OwnedFd> {
        reopen_read_only(self.fd.as_fd())
    }
}

/// A new read-only open of the file behind `fd` (through `/proc/self/fd`): what a
/// process that may only read the memory is handed.
pub fn reopen_read_only(fd: BorrowedFd<'_>) -> std::io::Result<OwnedFd> {
    use std::os::fd::AsRawFd;
    let path = format!("/proc/self/fd/{}", fd.as_raw_fd());
    Ok(rustix::fs::open(
        path.as_str(),
        OFlags::RDONLY | OFlags::CLOEXEC,
        Mode::empty(),
    )?)
}

fn page_size(huge: bool) -> u64 {
    if huge {
        HUGE_PAGE_SIZE
    } else {
        rustix::param::page_size() as u64
    }
}

fn map(name: &str, len: u64, huge: bool) -> Result<MemfdMemory, MemfdError> {
    let pages = if huge { "2 MiB pages" } else { "4 KiB pages" };
    let page = page_size(huge);
    let mapped = len
        .checked_next_multiple_of(page)
        .and_then(|m| usize::try_from(m).ok())
        .filter(|&m| m <= isize::MAX as usize)
        .ok_or(MemfdError::TooLarge { len })?;
    let sys = |step: &'static str| {
        move |e: rustix::io::Errno| MemfdError::Sys {
            step,
            len: mapped as u64,
            pages,
            source: e.into(),
        }
    };
    let mut flags = MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING;
    if huge {
        flags |= MemfdFlags::HUGETLB | MemfdFlags::HUGE_2MB;
    }
    // Huge pages come from a reserved pool and `fallocate` fails cleanly when it runs
    // out; ordinary shmem pages do not: `fallocate` takes them until the kernel's OOM
    // killer ends some process, on a shared host not necessarily this one.
    if !huge && let Some(host) = crate::HostMemory::now() {
        let reserve = host.reserve();
        if mapped as u64 > host.available.saturating_sub(reserve) {
            return Err(MemfdError::NoRoom {
                len: mapped as u64,
                available: host.available,
                reserve,
            });
        }
    }
    let fd = rustix::fs::memfd_create(name, flags).map_err(sys("memfd_create"))?;
    rustix::fs::ftruncate(&fd, mapped as u64).map_err(sys("ftruncate"))?;
    rustix::fs::fallocate(&fd, FallocateFlags::empty(), 0, mapped as u64)
        .map_err(sys("fallocate"))?;
    rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)
        .map_err(sys("sealing"))?;
    // SAFETY: a fresh mapping chosen by the kernel (null hint, no MAP_FIXED) aliases no
    // Rust object; `fd` is a valid memfd of at least `mapped` bytes.
    let ptr = unsafe {
        rustix::mm::mmap(
            std::ptr::null_mut(),
            mapped,
            ProtFlags::READ | ProtFlags::WRITE,
            MapFlags::SHARED,
            &fd,
            0,
        )
    }
    .map_err(sys("mmap"))?;
    let base = NonNull::new(ptr.cast::<AtomicU64>()).ok_or(MemfdError::Sys {
        step: "mmap",
        len: mapped as u64,
        pages,
        source: std::io::Error::other("the kernel returned a null mapping"),
    })?;
    Ok(MemfdMemory {
        fd,
        base,
        mapped_len: mapped,
        len,
        huge_pages: huge,
        fallback_reason: None,
    })
}

impl Memory for MemfdMemory {
    fn fd(&self) -> Option<BorrowedFd<'_>> {
        Some(self.fd.as_fd())
    }

    fn words(&self) -> &[AtomicU64] {
        // SAFETY: `base` is a page-aligned (so 8-byte-aligned) mapping of `mapped_len`
        // bytes, a multiple of 8, that lives as long as `self`. Every bit pattern is a
        // valid `AtomicU64`. Other processes that map the same fd touch it only with
        // atomic operations too. A peer's read-only mapping (`from_peer`) is only ever
        // loaded from by this crate: a store would fault, not race.
        unsafe { std::slice::from_raw_parts(self.base.as_ptr(), self.mapped_len / 8) }
    }
}

impl AsFd for MemfdMemory {
    /// The memfd, for handing the mapping to another process.
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl Drop for MemfdMemory {
    fn drop(&mut self) {
        // SAFETY: `base`/`mapped_len` are exactly the mapping made in `map`, and no
        // reference into it outlives `self` (`words` borrows `self`).
        let result = unsafe { rustix::mm::munmap(self.base.as_ptr().cast(), self.mapped_len) };
        // munmap of a mapping we made can only fail on a bug; there is nothing to do
        // about it in Drop but not to panic.
        debug_assert!(result.is_ok(), "munmap failed: {result:?}");
    }
}

impl std::fmt::Debug for MemfdMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemfdMemory")
            .field("len", &self.len)
            .field("mapped_len", &self.mapped_len)
            .field("huge_pages", &self.huge_pages)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::{SimConfig, SimNetwork};
    use crate::sync::Ordering;
    use crate::{Access, Device, SendWr};
    use std::sync::Arc;

    /// Huge pages the host can hand out now (free minus reserved), from sysfs.
    fn available_huge_pages() -> u64 {
        let read = |f: &str| {
            std::fs::read_to_string(format!("/sys/kernel/mm/hugepages/hugepages-2048kB/{f}"))
                .ok()
                .and_then(|s| s.trim().parse::<u64>().ok())
                .unwrap_or(0)
        };
        read("free_hugepages").saturating_sub(read("resv_hugepages"))
    }

    #[test]
    fn more_than_the_host_can_back_is_an_error_not_the_oom_killer() {
        let host = crate::HostMemory::now().expect("/proc/meminfo");
        let len = host.available + (1 << 30);
        match MemfdMemory::with_huge_pages("test-too-big", len, HugePages::Never) {
            Err(MemfdError::NoRoom { len: l, .. }) => assert!(l >= len),
            Err(e) => panic!("another error: {e}"),
            Ok(_) => panic!("{len} bytes mapped and backed"),
        }
    }

    #[test]
    fn mapping_is_zeroed_and_page_rounded() {
        let m = MemfdMemory::with_huge_pages("test-zero", 100, HugePages::Never).unwrap();
        assert_eq!(m.len(), 100);
        assert!(!m.huge_pages());
        assert_eq!(m.mapped_len(), rustix::param::page_size() as u64);
        assert_eq!(m.words().len() as u64 * 8, m.mapped_len());
        assert!(m.words().iter().all(|w| w.load(Ordering::Relaxed) == 0));
    }

    #[test]
    fn words_are_the_file_contents() {
        // What the atomics store is what another process mapping the fd would see:
        // read it back through the fd itself, not through the mapping.
        let m = MemfdMemory::with_huge_pages("test-shared", 4096, HugePages::Never).unwrap();
        m.words()[1].store(0x1122_3344_5566_7788, Ordering::Release);
        let mut buf = [0u8; 16];
        let n = rustix::io::pread(m.as_fd(), &mut buf, 0).unwrap();
        assert_eq!(n, 16);
        assert_eq!(&buf[..8], &[0; 8]);
        assert_eq!(&buf[8..], &0x1122_3344_5566_7788u64.to_le_bytes());
    }

    #[test]
    fn populating_backs_every_page_and_keeps_the_contents() {
        use crate::memory::resident_bytes;
        const BYTES: u64 = 8 << 20;
        let m = MemfdMemory::with_huge_pages("test-populate", BYTES, HugePages::Never).unwrap();
        m.words()[3].store(7, Ordering::Release);
        assert!(
            resident_bytes(m.words()) < BYTES / 4,
            "fallocate alone backs nothing"
        );
        m.populate().unwrap();
        assert_eq!(resident_bytes(m.words()), BYTES);
        assert_eq!(m.words()[3].load(Ordering::Acquire), 7);
    }

    #[test]
    fn a_peer_maps_the_same_memory_and_cannot_shrink_it() {
        let m = MemfdMemory::with_huge_pages("test-peer", 8192, HugePages::Never).unwrap();
        let dup = m.as_fd().try_clone_to_owned().unwrap();
        assert!(
            rustix::fs::ftruncate(&dup, 0).is_err(),
            "sealed against shrinking"
        );
        let peer = MemfdMemory::from_peer(dup, true).unwrap();
        assert_eq!(peer.len(), 8192);
        peer.words()[3].store(7, Ordering::Release);
        assert_eq!(m.words()[3].load(Ordering::Acquire), 7);
        let ro = MemfdMemory::from_peer(m.read_only_fd().unwrap(), false).unwrap();
        assert_eq!(ro.words()[3].load(Ordering::Acquire), 7);
        let ro_fd = m.read_only_fd().unwrap();
        assert!(rustix::fs::ftruncate(&ro_fd, 0).is_err());
        let err = MemfdMemory::from_peer(ro_fd, true).unwrap_err();
        assert!(err.to_string().contains("mmap"), "{err}");
    }

    #[test]
    fn unsealed_or_foreign_fds_are_refused() {
        let unsealed = rustix::fs::memfd_create("unsealed", MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&unsealed, 4096).unwrap();
        let err = MemfdMemory::from_peer(unsealed, true).unwrap_err();
        assert!(err.to_string().contains("sealed"), "{err}");
        let empty = rustix::fs::memfd_create("empty", MemfdFlags::ALLOW_SEALING).unwrap();
        assert!(MemfdMemory::from_peer(empty, true).is_err());
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        assert!(MemfdMemory::from_peer(a.into(), true).is_err());
    }

    #[test]
    fn huge_pages_are_used_exactly_when_the_host_has_them() {
        let available = available_huge_pages();
        let required = MemfdMemory::with_huge_pages("test-huge", 4096, HugePages::Require);
        let tried = MemfdMemory::new("test-try", 4096).unwrap();
        if available >= 2 {
            let m = required.expect("huge pages are free, so the mapping must succeed");
            assert!(m.huge_pages());
            assert_eq!(m.mapped_len(), HUGE_PAGE_SIZE);
            assert!(tried.huge_pages());
        } else if available == 0 {
            let err = required.expect_err("no huge pages are free");
            assert!(matches!(err, MemfdError::HugePagesUnavailable(_)), "{err}");
            assert!(err.to_string().contains("huge pages"), "{err}");
            assert!(!tried.huge_pages());
            assert!(tried.huge_page_fallback_reason().is_some());
            assert_eq!(tried.mapped_len(), rustix::param::page_size() as u64);
        }
        // With exactly one free page the two mappings race for it: nothing to assert.
    }

    #[test]
    fn bad_requests_are_errors() {
        assert!(matches!(
            MemfdMemory::new("empty", 0),
            Err(MemfdError::Empty)
        ));
        assert!(matches!(
            MemfdMemory::new("nul\0name", 8),
            Err(MemfdError::InvalidName { .. })
        ));
        assert!(matches!(
            MemfdMemory::new(&"x".repeat(250), 8),
            Err(MemfdError::InvalidName { .. })
        ));
        assert!(matches!(
            MemfdMemory::with_huge_pages("huge", u64::MAX - 3, HugePages::Never),
            Err(MemfdError::TooLarge { .. })
        ));
    }

    #[test]
    fn registered_memfd_serves_remote_operations() {
        let net = SimNetwork::new(SimConfig::default());
        let (server, client) = (net.add_node(), net.add_node());
        let mem = Arc::new(MemfdMemory::new("test-region", 1024).unwrap());
        let region = server
            .register_memory(mem.clone(), 1024, Access::ALL)
            .unwrap();
        let cq = client.create_cq(16).unwrap();
        let scq = server.create_cq(16).unwrap();
        let (qp, _server_qp) =
            crate::connect_rc((&*client, &cq), (&*server, &scq)).expect("connect");
        let local = client.register(16, Access::LOCAL).unwrap();
        qp.post_send(&[SendWr::write(
            1,
            crate::Src::Inline(&42u64.to_le_bytes()),
            region.remote_addr(64),
        )])
        .unwrap();
        qp.post_send(&[SendWr::read(2, local.buf(0, 8), region.remote_addr(64))])
            .unwrap();
        let mut done = Vec::new();
        let mut out = [crate::Completion::default(); 4];
        while done.len() < 2 {
            let n = cq.poll(&mut out).unwrap();
            done.extend_from_slice(&out[..n]);
        }
        assert!(done.iter().all(|c| c.status.is_ok()), "{done:?}");
        assert_eq!(local.load_u64(0).unwrap(), 42);
        assert_eq!(mem.words()[8].load(Ordering::Acquire), 42);
    }
}
