//! The `shm` backend: processes on one host.
//!
//! Regions are memfd mappings. A peer that authenticated with the cluster token over
//! the device's Unix socket receives them as file descriptors (SCM_RIGHTS) and maps
//! them, so one-sided operations (READ, WRITE, CAS, FETCH_ADD) run on the requester's
//! CPU against the shared mapping: zero CPU on the owner's side, as with an RNIC. The
//! owner publishes its exported regions in a key table that peers map read-only, so
//! every request checks its rkey, bounds, access flags and the region's liveness in
//! shared memory before touching anything, and deregistration takes effect at once.
//!
//! Two-sided operations go through shared-memory rings: each queue pair publishes its
//! state and posted receives in a block its peers map read-only, and every sender gets
//! a ring of its own into it. A sender sees at post time whether a receive is posted
//! and large enough, exactly as the sim's sender does; the receiver moves messages from
//! its rings into its posted receives whenever its completion queue is polled.
//! Queue-pair semantics are the engine's (`crate::engine`), shared with the sim.
//!
//! Nothing relies on both devices being in one process: all a peer learns goes
//! through the socket, and all it touches is memory it was handed.

mod barrier;
mod control;
mod keytable;
mod link;
mod qp;
mod ring;
mod server;

use crate::addr::{Access, NodeId};
use crate::cq::SoftCq;
use crate::device::{CompletionQueue, Device, QpConfig, QueuePair};
use crate::engine::{NewQp, QpHandle};
use crate::error::{FabricError, Result};
use crate::memfd::{HUGE_PAGE_SIZE, HugePages, MemfdMemory};
use crate::memory::Memory;
use crate::region::Region;
use crate::registry::{self, Registration, Registry};
use crate::serve::{Connections, Server};
use crate::sync;
use keytable::KeyTable;
use link::PeerLink;
use qp::{ShmPort, ShmQp};
use std::collections::HashMap;
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};

const REMOTE: Access = Access::REMOTE_READ
    .union(Access::REMOTE_WRITE)
    .union(Access::REMOTE_ATOMIC);

pub(crate) struct ShmNode {
    id: NodeId,
    path: PathBuf,
    token: Vec<u8>,
    regions: Registry,
    keys: KeyTable,
    qps: RwLock<HashMap<u32, Weak<ShmQp>>>,
    next_qpn: AtomicU32,
    peers: RwLock<HashMap<NodeId, PathBuf>>,
    links: Mutex<HashMap<NodeId, Arc<PeerLink>>>,
    shutdown: AtomicBool,
    /// Connections the control server is serving, so that shutting down closes them.
    connections: Connections<UnixStream>,
}

impl AsRef<Registry> for ShmNode {
    fn as_ref(&self) -> &Registry {
        &self.regions
    }
}

impl Server<UnixStream> for ShmNode {
    fn connections(&self) -> &Connections<UnixStream> {
        &self.connections
    }

    fn is_shut_down(&self) -> bool {
        self.shutdown.load(Ordering::Acquire)
    }
}

impl ShmNode {
    fn qp(&self, qpn: u32) -> Option<Arc<ShmQp>> {
        sync::read(&self.qps).get(&qpn)?.upgrade()
    }

    fn forget_qp(&self, qpn: u32) {
        sync::write(&self.qps).remove(&qpn);
    }

    fn knows(&self, node: NodeId) -> bool {
        node == self.id || sync::read(&self.peers).contains_key(&node)
    }

    /// The link to `node`, opened on first use and again after the peer went away (a
    /// device restarted at the same path).
    fn link(&self, node: NodeId) -> Result<Arc<PeerLink>> {
        let mut links = sync::lock(&self.links);
        if let Some(link) = links.get(&node)
            && link.is_alive()
        {
            return Ok(link.clone());
        }
        let path = if node == self.id {
            self.path.clone()
        } else {
            sync::read(&self.peers).get(&node).cloned().ok_or_else(|| {
                FabricError::Backend(format!("{node} is not a known peer (add_peer first)"))
            })?
        };
        let link = PeerLink::open(&path, &self.token, self.id, node)
            .map(Arc::new)
            .map_err(|e| FabricError::Backend(format!("cannot reach {node}: {e}")))?;
        links.insert(node, link.clone());
        Ok(link)
    }
}

/// An shm device: one node, serving its memory to peers on the same host. Dropping it
/// shuts the node down: peers' requests fail from then on, as when the process dies.
pub struct ShmDevice {
    node: Arc<ShmNode>,
}

impl ShmDevice {
    /// Listens on the Unix socket `path` with a random node id. Peers must present the
    /// same cluster `token`.
    pub fn bind(path: impl AsRef<Path>, token: &[u8]) -> Result<Arc<ShmDevice>> {
        ShmDevice::bind_as(path, token, NodeId(rand::random()))
    }

    /// As [`ShmDevice::bind`], with a chosen node id (unique in the cluster).
    pub fn bind_as(path: impl AsRef<Path>, token: &[u8], id: NodeId) -> Result<Arc<ShmDevice>> {
        let path = path.as_ref().to_path_buf();
        if token.is_empty() {
            return Err(FabricError::Backend("the cluster token is empty".into()));
        }
        // Before any queue pair: how this process's senders pair with owners.
        barrier::senders_skip_barrier();
        let listener = listen(&path)?;
        let keys = KeyTable::create().map_err(FabricError::Backend)?;
        let node = Arc::new(ShmNode {
            id,
            path: path.clone(),
            token: token.to_vec(),
            regions: Registry::default(),
            keys,
            qps: RwLock::new(HashMap::new()),
            next_qpn: AtomicU32::new(1),
            peers: RwLock::new(HashMap::new()),
            links: Mutex::new(HashMap::new()),
            shutdown: AtomicBool::new(false),
            connections: Connections::new(),
        });
        let server = node.clone();
        std::thread::Builder::new()
            .name(format!("shm-nic-{id}"))
            .spawn(move || server::accept_loop(server, listener))
            .map_err(|e| {
                let _ = std::fs::remove_file(&path);
                FabricError::Backend(format!("cannot start the control server: {e}"))
            })?;
        Ok(Arc::new(ShmDevice { node }))
    }

    /// The socket path peers reach this device at.
    pub fn path(&self) -> &Path {
        &self.node.path
    }
}

/// Whether `path` is a socket nobody listens on: a leftover of a process that died.
fn is_dead_socket(path: &Path) -> bool {
    std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_socket())
        && matches!(UnixStream::connect(path), Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused)
}

/// Whether process `pid` exists and is not a zombie: a killed process whose parent
/// has exited stays a zombie for good under an init that reaps nothing (some
/// containers' first process), and it runs no more than a reaped one.
fn runs(pid: u32) -> bool {
    start_time_if_running(pid).is_some()
}

/// When process `pid` started (clock ticks after boot), if it exists and is not a
/// zombie.
fn start_time_if_running(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // "pid (comm) state …": comm may hold spaces and parentheses.
    let (_, rest) = stat.rsplit_once(')')?;
    let mut fields = rest.split_whitespace();
    let state = fields.next()?;
    if matches!(state.chars().next(), Some('Z' | 'X')) {
        return None;
    }
    // starttime is field 22 of the file, the 20th after the state.
    fields.nth(18)?.parse().ok()
}

/// The process at the other end of a control connection, named by its pid and start
/// time so that a recycled pid is not taken for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PeerProcess {
    pid: u32,
    started: u64,
}

impl PeerProcess {
    pub(crate) fn of(stream: &UnixStream) -> Option<PeerProcess> {
        let pid = rustix::net::sockopt::socket_peercred(stream).ok()?.pid;
        let pid = pid.as_raw_nonzero().get() as u32;
        Some(PeerProcess {
            pid,
            started: start_time_if_running(pid)?,
        })
    }

    /// Whether it still runs (stopped counts: it may go on).
    pub(crate) fn runs(&self) -> bool {
        start_time_if_running(self.pid) == Some(self.started)
    }
}

/// Removes what processes that are gone left in `dir`: entries named `PREFIX<pid>…`
/// for a pid no process has, when they are sockets nobody listens on, or directories
/// of such sockets (removed once empty). A process killed outright cannot remove its
/// sockets; the next one that names its own the same way does. Nothing but dead
/// sockets and the directories they emptied is ever removed.
pub fn sweep_leftovers(dir: &Path, prefix: &str) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(prefix)) else {
            continue;
        };
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        let Ok(pid) = rest[..digits].parse::<u32>() else {
            continue;
        };
        if runs(pid) {
            continue;
        }
        let path = entry.path();
        if is_dead_socket(&path) {
            let _ = std::fs::remove_file(&path);
        } else if entry.file_type().is_ok_and(|t| t.is_dir()) {
            for inner in std::fs::read_dir(&path).into_iter().flatten().flatten() {
                if is_dead_socket(&inner.path()) {
                    let _ = std::fs::remove_file(inner.path());
                }
            }
            // Fails, keeping it, unless it is empty now.
            let _ = std::fs::remove_dir(&path);
        }
    }
}

/// Binds `path`, replacing a socket file that nobody listens on any more (left behind
/// by a process that died).
fn listen(path: &Path) -> Result<UnixListener> {
    let fail = |e: std::io::Error| {
        FabricError::Backend(format!("cannot listen on {}: {e}", path.display()))
    };
    match UnixListener::bind(path) {
        Ok(l) => Ok(l),
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => {
            // A regular file refuses connections too: only a socket nobody listens on
            // is a leftover of an earlier run, and removing anything else loses data.
            let socket = std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_socket());
            if !socket {
                return Err(FabricError::Backend(format!(
                    "cannot listen on {}: something other than a socket is there",
                    path.display()
                )));
            }
            if is_dead_socket(path) {
                std::fs::remove_file(path).map_err(fail)?;
                UnixListener::bind(path).map_err(fail)
            } else {
                Err(fail(e))
            }
        }
        Err(e) => Err(fail(e)),
    }
}

impl Drop for ShmDevice {
    fn drop(&mut self) {
        let node = &self.node;
        node.shutdown.store(true, Ordering::Release);
        // Peers see this on their next request, before anything else happens here.
        node.keys.close();
        // Wakes the accept loop, which sees the flag and exits.
        let _ = UnixStream::connect(&node.path);
        node.connections.close_all();
        sync::lock(&node.links).clear();
        let _ = std::fs::remove_file(&node.path);
    }
}

/// Parses `shm:PATH`.
fn parse_address(address: &str) -> Result<PathBuf> {
    match address.strip_prefix("shm:") {
        Some(path) if !path.is_empty() => Ok(PathBuf::from(path)),
        _ => Err(FabricError::Backend(format!(
            "`{address}` is not an shm address (expected shm:/path/to.sock)"
        ))),
    }
}

/// Withdraws an exported region from the key table before the registry forgets it,
/// so peers stop using it before its key can be reused.
struct Export {
    node: Weak<ShmNode>,
    key: u32,
    _registration: Registration<ShmNode>,
}

impl Drop for Export {
    fn drop(&mut self) {
        if let Some(node) = self.node.upgrade() {
            node.keys.withdraw(self.key);
        }
    }
}

impl Device for ShmDevice {
    fn node(&self) -> NodeId {
        self.node.id
    }

    fn backend(&self) -> &'static str {
        "shm"
    }

    fn address(&self) -> String {
        format!("shm:{}", self.node.path.display())
    }

    fn add_peer(&self, node: NodeId, address: &str) -> Result<()> {
        let path = parse_address(address)?;
        sync::write(&self.node.peers).insert(node, path);
        Ok(())
    }

    /// Memfd memory, on huge pages when the region is at least one huge page and the
    /// host has them.
    fn register(&self, len: u64, access: Access) -> Result<Region> {
        let huge = if len >= HUGE_PAGE_SIZE {
            HugePages::Try
        } else {
            HugePages::Never
        };
        let mem = MemfdMemory::with_huge_pages("namdb-shm-region", len.max(1), huge)
            .map_err(|e| FabricError::Backend(format!("cannot allocate a region: {e}")))?;
        self.register_memory(Arc::new(mem), len, access)
    }

    /// Memory registered with a remote access flag is exported: it must be shareable
    /// with other processes (`Memory::fd`, e.g. [`MemfdMemory`]).
    fn register_memory(&self, mem: Arc<dyn Memory>, len: u64, access: Access) -> Result<Region> {
        let exported = access.intersects(REMOTE);
        if exported && mem.fd().is_none() {
            return Err(FabricError::Backend(
                "the shm backend exports only memory other processes can map (a memfd, \
                 e.g. fabric::MemfdMemory); this memory is private to the process"
                    .into(),
            ));
        }
        let registration = registry::register_with(&self.node, mem, len, access)?;
        let entry = registration.entry.clone();
        let guard: Box<dyn Send + Sync> = if exported {
            if !self.node.keys.publish(entry.key, access, len) {
                return Err(FabricError::Backend(format!(
                    "the key table is full ({} exported regions)",
                    keytable::SLOTS
                )));
            }
            Box::new(Export {
                node: Arc::downgrade(&self.node),
                key: entry.key,
                _registration: registration,
            })
        } else {
            Box::new(registration)
        };
        Ok(registry::region(&entry, self.node.id, guard))
    }

    fn create_cq(&self, capacity: u32) -> Result<Arc<dyn CompletionQueue>> {
        SoftCq::create(capacity)
    }

    fn create_qp(&self, config: &QpConfig) -> Result<Arc<dyn QueuePair>> {
        let new = NewQp::prepare(config, self.node.id, &self.node.next_qpn)?;
        let qpn = new.endpoint.qpn;
        let port = ShmPort::new(self.node.clone(), &new.caps).map_err(FabricError::Backend)?;
        let qp = qp::create(port, new);
        sync::write(&self.node.qps).insert(qpn, Arc::downgrade(&qp));
        Ok(Arc::new(QpHandle(qp)))
    }
}

#[cfg(test)]
mod tests;
