//! A device's view of one peer device: the control connection to it, its key table
//! (mapped read-only), the regions of it this device has mapped, and whether it is
//! still there.
//!
//! Liveness: a mapping outlives the process that made it, so one-sided operations
//! would go on "succeeding" against a dead peer's memory. Two signals say the peer is
//! gone, and a requester checks both with one atomic load each on every request: the
//! peer's key table is marked closed when its device shuts down (at once, in order
//! with everything the owner did before), and a watcher thread blocked on a second
//! connection that the peer never answers sees the end of stream when the peer's
//! process dies (which only the kernel can tell).

use super::control::{self, Request};
use super::keytable::PeerKeys;
use super::ring::{PeerBlock, Producer};
use crate::addr::NodeId;
use crate::memfd::MemfdMemory;
use crate::sync;
use std::collections::HashMap;
use std::io::Read;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

pub(crate) struct PeerLink {
    pub(crate) node: NodeId,
    control: Mutex<UnixStream>,
    watch: UnixStream,
    alive: Arc<AtomicBool>,
    keys: PeerKeys,
    regions: Mutex<HashMap<u32, Arc<MemfdMemory>>>,
}

/// Why an attach failed.
pub(crate) enum AttachError {
    /// The peer has no such queue pair (of that kind).
    Missing,
    /// The peer refuses the sender, or handed over something unusable.
    Refused(String),
    /// The peer could not be asked.
    Unreachable(String),
}

impl PeerLink {
    /// Connects to the device at `path`, which must be `expect`, as node `me`.
    pub(crate) fn open(
        path: &Path,
        token: &[u8],
        me: NodeId,
        expect: NodeId,
    ) -> Result<PeerLink, String> {
        let (mut stream, node) = control::dial(path, token, me.0)?;
        if node != expect.0 {
            return Err(format!(
                "the device at {} is node{node}, not {expect}",
                path.display()
            ));
        }
        let response = control::call(&mut stream, Request::new(control::KEYS, 0))?;
        let fd = match (response.status, response.fds.into_iter().next()) {
            (control::OK, Some(fd)) => fd,
            (status, _) => return Err(format!("the peer refused its key table ({status})")),
        };
        let table = MemfdMemory::from_peer(fd, false).map_err(|e| e.to_string())?;
        let keys = PeerKeys::new(table)?;
        let (mut watch, _) = control::dial(path, token, me.0)?;
        control::send_request(&mut watch, Request::new(control::WATCH, 0))
            .map_err(|e| format!("cannot watch the peer: {e}"))?;
        let configure = |s: &UnixStream| s.set_read_timeout(None);
        configure(&watch).map_err(|e| format!("cannot watch the peer: {e}"))?;
        let mut watcher = watch
            .try_clone()
            .map_err(|e| format!("cannot watch the peer: {e}"))?;
        let alive = Arc::new(AtomicBool::new(true));
        let flag = alive.clone();
        std::thread::Builder::new()
            .name(format!("shm-watch-{node}"))
            .spawn(move || {
                // The peer never writes here: any return is its end (or ours).
                let _ = watcher.read(&mut [0u8; 1]);
                flag.store(false, Ordering::Release);
            })
            .map_err(|e| format!("cannot start a watcher thread: {e}"))?;
        Ok(PeerLink {
            node: expect,
            control: Mutex::new(stream),
            watch,
            alive,
            keys,
            regions: Mutex::new(HashMap::new()),
        })
    }

    /// Whether the peer device is still up.
    pub(crate) fn is_alive(&self) -> bool {
        self.alive.load(Ordering::Acquire) && self.keys.is_open()
    }

    pub(crate) fn keys(&self) -> &PeerKeys {
        &self.keys
    }

    /// The peer's region `key`, mapped (writable if `writable`); `None` if the peer
    /// does not hand it out.
    pub(crate) fn region(&self, key: u32, writable: bool) -> Option<Arc<MemfdMemory>> {
        let mut regions = sync::lock(&self.regions);
        if let Some(m) = regions.get(&key) {
            return Some(m.clone());
        }
        let response = self.call(Request::new(control::REGION, key)).ok()?;
        let fd = match (response.status, response.fds.into_iter().next()) {
            (control::OK, Some(fd)) => fd,
            _ => return None,
        };
        let mem = Arc::new(MemfdMemory::from_peer(fd, writable).ok()?);
        // A mapping keeps the owner's pages alive after it deregistered the region:
        // drop those of regions that are gone.
        regions.retain(|k, _| self.keys.lookup(*k).is_some());
        regions.insert(key, mem.clone());
        Some(mem)
    }

    #[cfg(test)]
    pub(crate) fn mapped_regions(&self) -> Vec<u32> {
        sync::lock(&self.regions).keys().copied().collect()
    }

    /// Drops the mapping of a region the peer no longer exports.
    pub(crate) fn forget_region(&self, key: u32) {
        sync::lock(&self.regions).remove(&key);
    }

    /// Attaches sender queue pair `src_qpn` to the peer's queue pair `dst_qpn`: its
    /// block and a ring of its own into it.
    pub(crate) fn attach(
        &self,
        kind: u8,
        dst_qpn: u32,
        src_qpn: u32,
    ) -> Result<(PeerBlock, Producer), AttachError> {
        let request = Request {
            op: control::ATTACH,
            kind,
            a: dst_qpn,
            b: src_qpn,
        };
        let response = self.call(request).map_err(AttachError::Unreachable)?;
        let status = response.status;
        let mut fds = response.fds.into_iter();
        let (Some(block), Some(ring), control::OK) = (fds.next(), fds.next(), status) else {
            return Err(match status {
                control::NO_SUCH_QP => AttachError::Missing,
                control::REFUSED => {
                    AttachError::Refused(format!("queue pair {dst_qpn} has another peer"))
                }
                other => AttachError::Refused(format!("the peer refused the attach ({other})")),
            });
        };
        let broken = |e: String| AttachError::Refused(format!("queue pair {dst_qpn}: {e}"));
        let block = MemfdMemory::from_peer(block, false).map_err(|e| broken(e.to_string()))?;
        let ring = MemfdMemory::from_peer(ring, true).map_err(|e| broken(e.to_string()))?;
        Ok((
            PeerBlock::new(block).map_err(broken)?,
            Producer::new(ring).map_err(broken)?,
        ))
    }

    fn call(&self, request: Request) -> Result<control::Response, String> {
        control::call(&mut sync::lock(&self.control), request)
    }
}

impl Drop for PeerLink {
    fn drop(&mut self) {
        // Ends the watcher thread and tells the peer this side is gone.
        let _ = self.watch.shutdown(std::net::Shutdown::Both);
    }
}
