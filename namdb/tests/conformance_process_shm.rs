//! The conformance suite with the memory server as a separate process on the shm
//! backend: the suite's server device is the process's own, driven over remote verbs,
//! and its client is an shm device in this process, mapping the server's memfds.

mod common;

use fabric::Device;
use fabric::conformance::Backend;
use fabric::shm::ShmDevice;
use memory_server::ClusterToken;
use std::sync::{Arc, Mutex};

/// Keeps the client sockets' directories until the run ends: a device's socket must
/// outlive the device.
struct ProcessShm {
    dirs: Mutex<Vec<tempfile::TempDir>>,
}

/// An shm device of this process and the directory of its socket, which must outlive
/// it.
fn shm_device(token: &ClusterToken) -> (Arc<dyn Device>, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("a socket directory");
    let device = ShmDevice::bind(dir.path().join("client.sock"), token.secret()).expect("bind")
        as Arc<dyn Device>;
    (device, dir)
}

impl Backend for ProcessShm {
    fn devices(&self, nodes: usize) -> Vec<Arc<dyn Device>> {
        common::process_devices("shm", nodes, |token| {
            let (device, dir) = shm_device(token);
            self.dirs.lock().expect("not poisoned").push(dir);
            device
        })
    }
}

fabric::conformance_tests!(ProcessShm {
    dirs: Mutex::new(Vec::new())
});

#[test]
fn a_fenced_incarnations_queue_pairs_reach_nothing() {
    let dirs = Mutex::new(Vec::new());
    common::fence_cuts_off_an_incarnation("shm", |token| {
        let (device, dir) = shm_device(token);
        dirs.lock().expect("not poisoned").push(dir);
        device
    });
}
