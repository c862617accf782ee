//! The conformance suite on the shm backend: every device listens on a Unix socket in
//! a fresh temporary directory, and reaches its peers only through sockets and the
//! memory they hand over.
#![cfg(all(target_os = "linux", not(fabric_loom)))]

use fabric::Device;
use fabric::conformance::Backend;
use fabric::shm::ShmDevice;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// One test's backend: its sockets live in a directory removed when the test ends.
struct Shm {
    dir: tempfile::TempDir,
    next: AtomicU64,
}

impl Shm {
    fn new() -> Shm {
        Shm {
            dir: tempfile::tempdir().expect("temp dir"),
            next: AtomicU64::new(0),
        }
    }
}

impl Backend for Shm {
    fn devices(&self, nodes: usize) -> Vec<Arc<dyn Device>> {
        (0..nodes)
            .map(|_| {
                let n = self.next.fetch_add(1, Ordering::Relaxed);
                let path = self.dir.path().join(format!("node{n}.sock"));
                ShmDevice::bind(path, b"conformance token").expect("bind") as Arc<dyn Device>
            })
            .collect()
    }
}

fabric::conformance_tests!(Shm::new());
