//! The `verbs` backend: rdma-core through `sideway` (InfiniBand, RoCE, Soft-RoCE).
//!
//! A thin mapping of the fabric traits onto ibverbs objects: one device context and
//! protection domain per [`VerbsDevice`], memory registrations with `ibv_reg_mr` over the
//! region's own words, RC and UD queue pairs, and completion queues polled with
//! `ibv_poll_cq`. What ibverbs leaves to the application is done here:
//!
//! - **Connection information** travels out of band: [`Device::address`] encodes the
//!   port's GID, LID, port number and MTU plus this device's *resync endpoint* (a TCP
//!   address). Initial packet sequence numbers derive from the queue-pair numbers, so
//!   `connect(peer endpoint)` needs nothing else.
//! - **Recovery.** An RC error moves both ends to the error state (the responder too,
//!   for remote access errors), and their packet sequence numbers must agree again.
//!   `recover` asks the peer's device over its resync endpoint (authenticated with the
//!   cluster token, `resync.rs`) to reset its half if it is broken and to say which
//!   sequence numbers it expects, then resets and reconnects its own half.
//! - **Work-request identity.** The NIC sees internal sequence numbers as `wr_id`; each
//!   queue pair keeps its outstanding requests in order, so a completion retires the
//!   unsignaled requests before it (the fabric's send-queue depth) and error completions,
//!   whose opcode ibverbs leaves undefined, still report the right one.

mod cq;
mod probe;
mod qp;
mod resync;

use crate::addr::{Access, NodeId};
use crate::device::{CompletionQueue, Device, QpConfig, QpKind, QueuePair};
use crate::error::{FabricError, Result};
use crate::memfd::MemfdMemory;
use crate::memory::Memory;
use crate::region::Region;
use crate::sync;
use cq::VerbsCq;
use qp::{QpShared, VerbsQp};
use rdma_mummy_sys as sys;
use sideway::ibverbs::AccessFlags;
use sideway::ibverbs::device::{DeviceInfo, DeviceList};
use sideway::ibverbs::device_context::{DeviceContext, Mtu, PortState};
use sideway::ibverbs::protection_domain::ProtectionDomain;
use std::collections::HashMap;
use std::fmt;
use std::net::{Ipv6Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};

/// How to open a verbs device.
#[derive(Clone, Debug)]
pub struct VerbsConfig {
    /// The RDMA device (`mlx5_0`, `rxe0`, …); `None`: the first with an active port.
    pub device: Option<String>,
    /// The physical port, from 1.
    pub port: u8,
    /// The GID table entry to send from; `None`: the first IPv4-mapped RoCE GID, else
    /// the first non-zero one (index 0 on InfiniBand).
    pub gid_index: Option<u8>,
    /// Where this device accepts resync requests from peers recovering a queue pair
    /// (port 0 picks a free port). It must be reachable from the peers.
    pub resync_listen: SocketAddr,
    pub node: NodeId,
}

impl VerbsConfig {
    /// The first usable device, port 1, GID chosen automatically, resync endpoint on a
    /// free loopback port.
    pub fn new(node: NodeId) -> VerbsConfig {
        VerbsConfig {
            device: None,
            port: 1,
            gid_index: None,
            resync_listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            node,
        }
    }
}

/// What a peer needs to reach a port: parsed from and printed as [`Device::address`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PortAddress {
    pub(crate) gid: Ipv6Addr,
    pub(crate) lid: u16,
    pub(crate) port: u8,
    pub(crate) resync: SocketAddr,
}

impl fmt::Display for PortAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "verbs:gid={},lid={},port={},resync={}",
            self.gid, self.lid, self.port, self.resync
        )
    }
}

impl PortAddress {
    pub(crate) fn parse(address: &str) -> Result<PortAddress> {
        let bad = |why: &str| {
            FabricError::Backend(format!(
                "bad verbs address {address:?}: {why} (expected \
                 verbs:gid=GID,lid=LID,port=PORT,resync=HOST:PORT)"
            ))
        };
        let fields = address
            .strip_prefix("verbs:")
            .ok_or_else(|| bad("no verbs: prefix"))?;
        let (mut gid, mut lid, mut port, mut resync) = (None, None, None, None);
        for field in fields.split(',') {
            let (key, value) = field
                .split_once('=')
                .ok_or_else(|| bad("a field without ="))?;
            match key {
                "gid" => gid = Some(value.parse().map_err(|_| bad("unreadable gid"))?),
                "lid" => lid = Some(value.parse().map_err(|_| bad("unreadable lid"))?),
                "port" => port = Some(value.parse().map_err(|_| bad("unreadable port"))?),
                "resync" => resync = Some(value.parse().map_err(|_| bad("unreadable resync"))?),
                _ => return Err(bad(&format!("unknown field {key}"))),
            }
        }
        Ok(PortAddress {
            gid: gid.ok_or_else(|| bad("no gid"))?,
            lid: lid.ok_or_else(|| bad("no lid"))?,
            port: port.ok_or_else(|| bad("no port"))?,
            resync: resync.ok_or_else(|| bad("no resync"))?,
        })
    }
}

/// A verbs error as the fabric reports it.
pub(crate) fn backend_error(what: &str, err: impl fmt::Display) -> FabricError {
    FabricError::Backend(format!("verbs: {what}: {err}"))
}

/// Node ids of the queue pairs this process created, by port GID and queue-pair
/// number: how a UD receive names its sender when several nodes share one port (as
/// all devices of a process on one NIC do). Senders in other processes are found
/// through the peers added to the receiving device.
type LocalQpNodes = Mutex<HashMap<(Ipv6Addr, u32), NodeId>>;

fn local_qp_nodes() -> &'static LocalQpNodes {
    static NODES: std::sync::OnceLock<LocalQpNodes> = std::sync::OnceLock::new();
    NODES.get_or_init(Default::default)
}

/// A live registration as the local side sees it.
#[derive(Clone)]
pub(crate) struct RegisteredMemory {
    pub(crate) mem: Arc<dyn Memory>,
    pub(crate) len: u64,
    pub(crate) access: Access,
}

impl RegisteredMemory {
    /// Whether the NIC may place `len` bytes at `offset` of it.
    pub(crate) fn can_receive(&self, offset: u64, len: u32) -> bool {
        self.access.contains(Access::LOCAL_WRITE)
            && offset
                .checked_add(len as u64)
                .is_some_and(|end| end <= self.len)
    }
}

/// The part of a device its queue pairs, completion queues and regions share.
pub(crate) struct DeviceShared {
    pub(crate) node: NodeId,
    pub(crate) ctx: Arc<DeviceContext>,
    pub(crate) pd: Arc<ProtectionDomain>,
    pub(crate) port: u8,
    pub(crate) gid_index: u8,
    pub(crate) local: PortAddress,
    /// The port's active MTU, and whether UD can carry the fabric's 4096-byte datagrams.
    pub(crate) path_mtu: Mtu,
    pub(crate) ud_mtu_ok: bool,
    pub(crate) max_rd_atomic: u8,
    pub(crate) token: Vec<u8>,
    pub(crate) peers: RwLock<HashMap<NodeId, Peer>>,
    /// Memory of live registrations by local key, for reading what the NIC placed in
    /// a receive buffer (a UD datagram's GRH names its sender).
    pub(crate) lkeys: RwLock<HashMap<u32, RegisteredMemory>>,
    /// Queue pairs by number, for completion dispatch and resync requests.
    pub(crate) qps: RwLock<HashMap<u32, Weak<QpShared>>>,
    pub(crate) shut_down: AtomicBool,
    /// The NIC writes atomics' old values in network byte order (`probe.rs`), so the
    /// backend swaps them into the region's.
    pub(crate) swap_atomic_results: AtomicBool,
    /// Distinguishes this device's completion queues from another device's.
    pub(crate) id: u64,
}

/// A peer added with `add_peer`, with its UD address handle once one was needed.
pub(crate) struct Peer {
    pub(crate) address: PortAddress,
    pub(crate) ah: Option<AddressHandle>,
}

/// An `ibv_ah`, destroyed when dropped.
pub(crate) struct AddressHandle(pub(crate) std::ptr::NonNull<sys::ibv_ah>);

// SAFETY: an address handle is an immutable NIC object; ibverbs allows posting with it
// from any thread, and it is destroyed once, on drop.
unsafe impl Send for AddressHandle {}
// SAFETY: as above: shared use is read-only.
unsafe impl Sync for AddressHandle {}

impl Drop for AddressHandle {
    fn drop(&mut self) {
        // SAFETY: the handle came from ibv_create_ah and is destroyed only here; the
        // device's peers table owns it, and no work request using it outlives the
        // device (queue pairs hold the device).
        unsafe {
            sys::ibv_destroy_ah(self.0.as_ptr());
        }
    }
}

impl DeviceShared {
    pub(crate) fn peer_address(&self, node: NodeId) -> Option<PortAddress> {
        sync::read(&self.peers).get(&node).map(|p| p.address)
    }

    /// The address handle for UD datagrams to `node`, created on first use.
    pub(crate) fn address_handle(&self, node: NodeId) -> Result<*mut sys::ibv_ah> {
        if let Some(Peer { ah: Some(ah), .. }) = sync::read(&self.peers).get(&node) {
            return Ok(ah.0.as_ptr());
        }
        let mut peers = sync::write(&self.peers);
        let peer = peers.get_mut(&node).ok_or_else(|| {
            FabricError::InvalidWorkRequest(format!("{node} is not a known peer (add_peer first)"))
        })?;
        if let Some(ah) = &peer.ah {
            return Ok(ah.0.as_ptr());
        }
        let mut attr = self.ah_attr(&peer.address);
        // SAFETY: the protection domain is alive (held by self) and attr is a fully
        // initialised ibv_ah_attr on our stack.
        let ah = unsafe { sys::ibv_create_ah(self.pd.pd().as_ptr(), &mut attr) };
        let ah = std::ptr::NonNull::new(ah).ok_or_else(|| {
            backend_error(
                &format!("creating an address handle for {node}"),
                std::io::Error::last_os_error(),
            )
        })?;
        peer.ah = Some(AddressHandle(ah));
        Ok(ah.as_ptr())
    }

    /// The address vector that reaches `peer` from this port.
    pub(crate) fn ah_attr(&self, peer: &PortAddress) -> sys::ibv_ah_attr {
        // SAFETY: ibv_ah_attr is plain data (integers and a GID union); all zeroes is a
        // valid value for every field.
        let mut attr: sys::ibv_ah_attr = unsafe { std::mem::zeroed() };
        attr.dlid = peer.lid;
        attr.port_num = self.port;
        // RoCE always routes by GID; InfiniBand within a subnet by LID (a zero GID
        // prefix is never the case on IB, so the GRH is harmless there too).
        attr.is_global = 1;
        attr.grh.dgid = sys::ibv_gid {
            raw: peer.gid.octets(),
        };
        attr.grh.sgid_index = self.gid_index;
        attr.grh.hop_limit = 64;
        attr
    }

    /// Who sent a UD datagram from `gid`/`qpn`: a queue pair of this process, or else
    /// the only peer on that GID.
    pub(crate) fn sender_node(&self, gid: Ipv6Addr, qpn: u32) -> Option<NodeId> {
        if let Some(node) = sync::lock(local_qp_nodes()).get(&(gid, qpn)) {
            return Some(*node);
        }
        let peers = sync::read(&self.peers);
        let mut on_gid = peers.iter().filter(|(_, p)| p.address.gid == gid);
        match (on_gid.next(), on_gid.next()) {
            (Some((node, _)), None) => Some(*node),
            _ => None,
        }
    }

    pub(crate) fn qp(&self, qpn: u32) -> Option<Arc<QpShared>> {
        sync::read(&self.qps).get(&qpn).and_then(Weak::upgrade)
    }
}

/// A device on an RDMA NIC.
pub struct VerbsDevice {
    shared: Arc<DeviceShared>,
    resync: resync::Listener,
    atomic_results: AtomicResultOrder,
}

/// How a NIC writes an atomic's old value into the local buffer, as the device found
/// at open by a FETCH_ADD to itself (`probe.rs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AtomicResultOrder {
    /// As a host-order word: the fabric's byte order on little-endian hosts.
    Host,
    /// In network byte order; the backend swaps each result after completion.
    Network,
    /// The loopback probe could not run (e.g. the NIC does not loop back to itself);
    /// results are taken as they come.
    Unchecked,
}

fn no_device(why: impl fmt::Display) -> FabricError {
    FabricError::Backend(format!(
        "no RDMA device found: {why}. On RDMA hardware load its driver (e.g. mlx5_ib); \
         without it, Soft-RoCE: `modprobe rdma_rxe && rdma link add rxe0 type rxe netdev \
         IFACE` (needs a kernel with RDMA support and rdma-core's ibverbs-providers)"
    ))
}

impl VerbsDevice {
    /// Opens the device `config` names (or the first usable one), its protection domain
    /// and its resync endpoint. Without any RDMA device this is a `Backend` error that
    /// starts with `no RDMA device found`.
    pub fn open(config: &VerbsConfig, token: &[u8]) -> Result<Arc<VerbsDevice>> {
        let list = DeviceList::new().map_err(|e| {
            no_device(format_args!(
                "libibverbs cannot list devices ({}): the kernel has no RDMA support, or rdma-core is not installed", source_of(&e)
            ))
        })?;
        if list.is_empty() {
            return Err(no_device("libibverbs lists none"));
        }
        let mut tried = Vec::new();
        let mut chosen = None;
        for device in list.iter() {
            let name = device.name();
            if config.device.as_ref().is_some_and(|want| *want != name) {
                continue;
            }
            let ctx = device
                .open()
                .map_err(|e| backend_error(&format!("opening {name}"), e))?;
            let port = ctx
                .query_port(config.port)
                .map_err(|e| backend_error(&format!("querying {name} port {}", config.port), e))?;
            if port.port_state() == PortState::Active {
                chosen = Some((name, ctx, port));
                break;
            }
            tried.push(format!("{name} (port {} not active)", config.port));
        }
        let Some((name, ctx, port_attr)) = chosen else {
            return Err(match &config.device {
                Some(want) if tried.is_empty() => no_device(format_args!(
                    "there is no device named {want} (libibverbs lists {})",
                    list.iter().map(|d| d.name()).collect::<Vec<_>>().join(", ")
                )),
                _ => no_device(format_args!(
                    "none with an active port: {}",
                    tried.join(", ")
                )),
            });
        };
        let gid_index = match config.gid_index {
            Some(i) => i,
            None => choose_gid(&ctx, config.port, port_attr.gid_tbl_len())?,
        };
        let gid: Ipv6Addr = ctx
            .query_gid(config.port, gid_index as u32)
            .map_err(|e| backend_error(&format!("reading GID {gid_index} of {name}"), e))?
            .into();
        if gid.is_unspecified() {
            return Err(FabricError::Backend(format!(
                "verbs: GID index {gid_index} of {name} port {} is empty; choose another \
                 (`ibv_devinfo -v` lists the table)",
                config.port
            )));
        }
        let device_attr = ctx
            .query_device()
            .map_err(|e| backend_error(&format!("querying {name}"), e))?;
        let pd = ctx
            .alloc_pd()
            .map_err(|e| backend_error(&format!("allocating a protection domain on {name}"), e))?;
        let active = port_attr.active_mtu();
        let path_mtu = active;
        let ud_mtu_ok = matches!(active, Mtu::Mtu4096);
        let listener = resync::Listener::bind(config.resync_listen)?;
        static DEVICE_IDS: AtomicU64 = AtomicU64::new(1);
        let shared = Arc::new(DeviceShared {
            node: config.node,
            ctx,
            pd,
            port: config.port,
            gid_index,
            local: PortAddress {
                gid,
                lid: port_attr.lid(),
                port: config.port,
                resync: listener.local_addr(),
            },
            path_mtu,
            ud_mtu_ok,
            max_rd_atomic: device_attr.max_qp_rd_atom().clamp(1, 16) as u8,
            token: token.to_vec(),
            peers: RwLock::new(HashMap::new()),
            lkeys: RwLock::new(HashMap::new()),
            qps: RwLock::new(HashMap::new()),
            shut_down: AtomicBool::new(false),
            swap_atomic_results: AtomicBool::new(false),
            id: DEVICE_IDS.fetch_add(1, Ordering::Relaxed),
        });
        let atomic_results = probe::atomic_result_order(&shared)?;
        shared.swap_atomic_results.store(
            atomic_results == AtomicResultOrder::Network,
            Ordering::Release,
        );
        let resync = listener.serve(Arc::downgrade(&shared));
        Ok(Arc::new(VerbsDevice {
            shared,
            resync,
            atomic_results,
        }))
    }

    /// What the byte-order probe found at open.
    pub fn atomic_result_order(&self) -> AtomicResultOrder {
        self.atomic_results
    }

    /// The GID table index this device sends from.
    pub fn gid_index(&self) -> u8 {
        self.shared.gid_index
    }

    /// The RDMA device's name, e.g. `rxe0`.
    pub fn device_name(&self) -> String {
        self.shared.ctx.name()
    }
}

/// The default GID: the first IPv4-mapped one (RoCE over IPv4, which routes like the
/// host's IP), else the first non-zero one.
fn choose_gid(ctx: &DeviceContext, port: u8, table_len: i32) -> Result<u8> {
    let gids: Vec<(u8, Ipv6Addr)> = (0..table_len.clamp(0, 256) as u32)
        .filter_map(|i| Some((i as u8, ctx.query_gid(port, i).ok()?.into())))
        .filter(|(_, g): &(u8, Ipv6Addr)| !g.is_unspecified())
        .collect();
    gids.iter()
        .find(|(_, g)| g.to_ipv4_mapped().is_some())
        .or_else(|| gids.first())
        .map(|(i, _)| *i)
        .ok_or_else(|| {
            FabricError::Backend(format!(
                "verbs: port {port} has no usable GID (is its network interface up?)"
            ))
        })
}

impl Drop for VerbsDevice {
    fn drop(&mut self) {
        self.shared.shut_down.store(true, Ordering::Release);
        self.resync.stop();
    }
}

/// The I/O virtual address every region is registered at (`ibv_reg_mr_iova`): work
/// requests address byte `offset` of a region as `IOVA_BASE + offset`, so a
/// region-relative address needs no table of base addresses on either side. Far from
/// zero, so that an offset near `u64::MAX` wraps to below the base, which the NIC
/// rejects like any other out-of-bounds access.
pub(crate) const IOVA_BASE: u64 = 1 << 44;

/// The smallest page of every Linux architecture the backend runs on.
const PAGE_BYTES: usize = 4096;

/// A memory registration: deregisters (and forgets the lkey) when the region drops.
struct Registration {
    mr: std::ptr::NonNull<sys::ibv_mr>,
    lkey: u32,
    device: Arc<DeviceShared>,
    // Kept until after deregistration: the NIC may touch the memory until then.
    _mem: Arc<dyn Memory>,
}

// SAFETY: the registration is only deregistered, once, on drop; ibverbs allows that from
// any thread.
unsafe impl Send for Registration {}
// SAFETY: no method reads through the pointer.
unsafe impl Sync for Registration {}

impl Drop for Registration {
    fn drop(&mut self) {
        sync::write(&self.device.lkeys).remove(&self.lkey);
        // SAFETY: the MR came from ibv_reg_mr_iova on this device's protection domain,
        // which `device` keeps alive, and is deregistered only here.
        unsafe {
            sys::ibv_dereg_mr(self.mr.as_ptr());
        }
    }
}

fn access_flags(access: Access) -> AccessFlags {
    let mut flags = AccessFlags::none();
    // ibverbs refuses REMOTE_WRITE or REMOTE_ATOMIC without LOCAL_WRITE (EINVAL), as the
    // NIC writes such memory on a peer's behalf; hardware requires it, so it is added.
    if access.intersects(Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_ATOMIC) {
        flags |= AccessFlags::LocalWrite;
    }
    if access.contains(Access::REMOTE_READ) {
        flags |= AccessFlags::RemoteRead;
    }
    if access.contains(Access::REMOTE_WRITE) {
        flags |= AccessFlags::RemoteWrite;
    }
    if access.contains(Access::REMOTE_ATOMIC) {
        flags |= AccessFlags::RemoteAtomic;
    }
    flags
}

impl Device for VerbsDevice {
    fn node(&self) -> NodeId {
        self.shared.node
    }

    fn backend(&self) -> &'static str {
        "verbs"
    }

    fn orders_write_placement(&self) -> bool {
        false
    }

    fn address(&self) -> String {
        self.shared.local.to_string()
    }

    fn add_peer(&self, node: NodeId, address: &str) -> Result<()> {
        let address = PortAddress::parse(address)?;
        let mut peers = sync::write(&self.shared.peers);
        match peers.get(&node) {
            Some(p) if p.address == address => {}
            _ => {
                peers.insert(node, Peer { address, ah: None });
            }
        }
        Ok(())
    }

    fn register(&self, len: u64, access: Access) -> Result<Region> {
        allocate(&self.shared, len, access)
    }

    fn register_memory(&self, mem: Arc<dyn Memory>, len: u64, access: Access) -> Result<Region> {
        register(&self.shared, mem, len, access)
    }
    fn create_cq(&self, capacity: u32) -> Result<Arc<dyn CompletionQueue>> {
        Ok(Arc::new(VerbsCq::new(&self.shared, capacity)?))
    }

    fn create_qp(&self, config: &QpConfig) -> Result<Arc<dyn QueuePair>> {
        if config.kind == QpKind::Ud && !self.shared.ud_mtu_ok {
            return Err(FabricError::Backend(format!(
                "verbs: UD needs a 4096-byte path MTU, and port {} of {} has {:?} \
                 (raise the interface MTU, e.g. jumbo frames for RoCE)",
                self.shared.port,
                self.shared.ctx.name(),
                self.shared.path_mtu
            )));
        }
        let qp = VerbsQp::create(&self.shared, config)?;
        sync::lock(local_qp_nodes()).insert((self.shared.local.gid, qp.qpn()), self.shared.node);
        Ok(qp)
    }
}

/// Allocates `len` bytes of page-aligned memory (see `register`) and registers them;
/// at least a word, as the NIC cannot register zero bytes.
pub(crate) fn allocate(shared: &Arc<DeviceShared>, len: u64, access: Access) -> Result<Region> {
    let mem = MemfdMemory::new("namdb-verbs-region", len.max(8))
        .map_err(|e| backend_error(&format!("allocating {len} bytes"), e))?;
    register(shared, Arc::new(mem), len, access)
}

/// Registers the first `len` bytes of `mem` at `IOVA_BASE`.
fn register(
    shared: &Arc<DeviceShared>,
    mem: Arc<dyn Memory>,
    len: u64,
    access: Access,
) -> Result<Region> {
    let words = mem.words();
    let available = words.len() as u64 * 8;
    if len > available {
        return Err(FabricError::OutOfBounds {
            offset: 0,
            len,
            region_len: available,
        });
    }
    let addr = words.as_ptr() as usize;
    // The NIC maps whole pages, and the kernel requires an I/O virtual address with
    // the same offset in its page as the memory's: with every region at IOVA_BASE,
    // that means page-aligned memory (memfd mappings are).
    if !addr.is_multiple_of(PAGE_BYTES) {
        return Err(FabricError::Backend(format!(
            "verbs: memory at {addr:#x} is not page-aligned; the verbs backend \
             registers page-aligned memory only (e.g. fabric::MemfdMemory)"
        )));
    }
    // Zero-length registrations are refused by some NICs: register at least a word
    // of the memory (the region's own bounds still say `len`).
    let reg_len = len.max(8).min(available) as usize;
    // SAFETY: [addr, addr + reg_len) lies within `mem`'s words, which stay allocated
    // while the registration lives (the Registration keeps `mem` and deregisters
    // before releasing it). The NIC writes them only as work requests say; the CPU
    // touches them only through atomic word operations, as it does memory that
    // another process writes.
    let mr = unsafe {
        sys::ibv_reg_mr_iova(
            shared.pd.pd().as_ptr(),
            addr as *mut std::ffi::c_void,
            reg_len,
            IOVA_BASE,
            access_flags(access).bits(),
        )
    };
    let mr = std::ptr::NonNull::new(mr).ok_or_else(|| {
        backend_error(
            &format!("registering {len} bytes"),
            std::io::Error::last_os_error(),
        )
    })?;
    // SAFETY: a registered MR is valid until deregistered; its keys never change.
    let (lkey, rkey) = unsafe { (mr.as_ref().lkey, mr.as_ref().rkey) };
    let local = RegisteredMemory {
        mem: mem.clone(),
        len,
        access,
    };
    sync::write(&shared.lkeys).insert(lkey, local);
    let registration = Registration {
        mr,
        lkey,
        device: shared.clone(),
        _mem: mem.clone(),
    };
    Ok(Region::from_parts(
        mem,
        len,
        (lkey, rkey),
        access,
        shared.node,
        Box::new(registration),
    ))
}

/// The innermost cause of an error, which sideway's wrappers tend to hide behind a
/// generic message.
pub(crate) fn source_of(err: &(dyn std::error::Error + 'static)) -> String {
    let mut msg = err.to_string();
    let mut cur = err.source();
    while let Some(e) = cur {
        msg = format!("{msg}: {e}");
        cur = e.source();
    }
    msg
}

/// Forgets a queue pair of this process (when it is destroyed).
pub(crate) fn forget_local_qp(gid: Ipv6Addr, qpn: u32) {
    sync::lock(local_qp_nodes()).remove(&(gid, qpn));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_round_trip_and_bad_ones_are_explained() {
        let a = PortAddress {
            gid: "::ffff:127.0.0.1".parse().unwrap(),
            lid: 0,
            port: 1,
            resync: "127.0.0.1:4000".parse().unwrap(),
        };
        assert_eq!(PortAddress::parse(&a.to_string()).unwrap(), a);
        for bad in [
            "tcp:127.0.0.1:1",
            "verbs:gid=::1,lid=0,port=1",
            "verbs:gid=nope,lid=0,port=1,resync=127.0.0.1:1",
            "verbs:gid=::1,lid=0,port=1,resync=127.0.0.1:1,color=blue",
        ] {
            let err = PortAddress::parse(bad).unwrap_err().to_string();
            assert!(err.contains("bad verbs address"), "{err}");
        }
    }

    #[test]
    fn remote_write_and_atomic_imply_local_write() {
        assert!(access_flags(Access::REMOTE_ATOMIC).contains(AccessFlags::LocalWrite));
        assert!(access_flags(Access::REMOTE_WRITE).contains(AccessFlags::LocalWrite));
        assert!(!access_flags(Access::REMOTE_READ).contains(AccessFlags::LocalWrite));
    }
}
