//! Queue pairs: ibverbs RC and UD QPs, their state transitions, posting and the
//! bookkeeping that turns the NIC's completions into the fabric's.

use super::{DeviceShared, IOVA_BASE, PortAddress, backend_error, forget_local_qp, resync};
use crate::addr::{LocalBuf, QpEndpoint, RemoteAddr};
use crate::device::{CompletionQueue, QpConfig, QpKind, QueuePair};
use crate::error::{FabricError, QpState, Result, WcStatus};
use crate::validate::validate;
use crate::wr::{Completion, GRH_BYTES, RecvWr, SendWr, Src, UD_MTU, WcOpcode, WrOp};
use crate::{memory, sync};
use rdma_mummy_sys as sys;
use sideway::ibverbs::queue_pair::{BasicQueuePair, QueuePair as _, QueuePairType};
use std::collections::VecDeque;
use std::net::Ipv6Addr;
use std::ptr::null_mut;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Receive work requests carry this bit in the NIC's `wr_id`, so that an error
/// completion (whose opcode ibverbs leaves undefined) is known to be a receive.
pub(crate) const RECV_TAG: u64 = 1 << 63;

/// Transport timeout exponent: 4.096 µs × 2^14 ≈ 67 ms before a retransmission, and
/// `RETRY_COUNT` of them before a dead peer completes with `RetryExceeded`.
const TIMEOUT: u8 = 14;
/// Not 7: rxe (unlike the IBA, which means that only for RNR) retries forever at 7.
const RETRY_COUNT: u8 = 6;

/// A send request the NIC has not yet retired.
struct PendingSend {
    seq: u64,
    wr_id: u64,
    opcode: WcOpcode,
    len: u32,
    /// The fabric status to report whatever the NIC says, for the request the backend
    /// made fail on purpose (a UD datagram over the MTU, see `post_send`).
    forced: Option<WcStatus>,
    atomic: bool,
    /// An atomic's result buffer, which the NIC writes.
    result: Option<LocalBuf>,
}

#[derive(Default)]
pub(crate) struct SendRing {
    pending: VecDeque<PendingSend>,
    next_seq: u64,
}

struct PendingRecv {
    seq: u64,
    wr_id: u64,
    buf: LocalBuf,
    /// The buffer was registered, writable and in bounds when posted.
    valid: bool,
}

#[derive(Default)]
pub(crate) struct RecvRing {
    pending: VecDeque<PendingRecv>,
    next_seq: u64,
}

/// A queue pair as its device and completion queues see it.
pub(crate) struct QpShared {
    pub(crate) device: Arc<DeviceShared>,
    hw: BasicQueuePair,
    pub(crate) qpn: u32,
    kind: QpKind,
    max_send_wr: u32,
    max_recv_wr: u32,
    max_inline: u32,
    rnr_retry: u8,
    min_rnr_timer: u8,
    qkey: u32,
    send: Mutex<SendRing>,
    recv: Mutex<RecvRing>,
    /// The RC peer, once connected.
    pub(crate) peer: Mutex<Option<QpEndpoint>>,
    /// Serialises state transitions (connect, recover, resync from the peer).
    transitions: Mutex<()>,
    _cqs: (Arc<dyn CompletionQueue>, Arc<dyn CompletionQueue>),
}

// The raw QP is used from many threads: ibverbs' post and modify calls are thread-safe
// per QP, and the rings are behind locks.

/// A queue pair handle; dropping the last one destroys the QP.
pub(crate) struct VerbsQp(Arc<QpShared>);

/// The IB encoding of the RNR NAK timer: the smallest code that waits at least `d`
/// (code 0 is the longest, 655.36 ms).
pub(crate) fn rnr_timer_code(d: Duration) -> u8 {
    const MICROS: [u32; 32] = [
        655_360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1280, 1920, 2560, 3840,
        5120, 7680, 10_240, 15_360, 20_480, 30_720, 40_960, 61_440, 81_920, 122_880, 163_840,
        245_760, 327_680, 491_520,
    ];
    let want = d.as_micros();
    (1..32)
        .find(|&code| u128::from(MICROS[code]) >= want)
        .unwrap_or(0) as u8
}

/// The initial packet sequence number of a queue pair's send queue. Both ends derive
/// it from the queue-pair number, so connecting needs no more than the endpoint.
pub(crate) fn initial_psn(qpn: u32) -> u32 {
    qpn.wrapping_mul(0x9E37_79B1) & 0x00ff_ffff
}

fn random_psn() -> u32 {
    rand::random::<u32>() & 0x00ff_ffff
}

fn mask(bits: &[sys::ibv_qp_attr_mask]) -> i32 {
    bits.iter().fold(0u32, |m, b| m | b.0) as i32
}

fn zeroed_attr() -> sys::ibv_qp_attr {
    // SAFETY: ibv_qp_attr is plain data; all zeroes is a valid value of every field.
    unsafe { std::mem::zeroed() }
}

/// The fabric status for an ibverbs one. `atomic`: the request was a CAS or
/// FETCH_ADD, whose misalignment ibverbs reports as an invalid request and the fabric
/// as a remote access error.
pub(crate) fn wc_status(status: sys::ibv_wc_status::Type, atomic: bool) -> WcStatus {
    use sys::ibv_wc_status::*;
    match status {
        IBV_WC_SUCCESS => WcStatus::Success,
        IBV_WC_LOC_LEN_ERR => WcStatus::LocalLength,
        IBV_WC_LOC_PROT_ERR | IBV_WC_LOC_ACCESS_ERR | IBV_WC_LOC_QP_OP_ERR | IBV_WC_MW_BIND_ERR => {
            WcStatus::LocalProtection
        }
        IBV_WC_WR_FLUSH_ERR => WcStatus::WrFlush,
        IBV_WC_REM_INV_REQ_ERR if atomic => WcStatus::RemoteAccess,
        IBV_WC_REM_INV_REQ_ERR | IBV_WC_REM_OP_ERR | IBV_WC_REM_INV_RD_REQ_ERR => {
            WcStatus::RemoteInvalidRequest
        }
        IBV_WC_REM_ACCESS_ERR => WcStatus::RemoteAccess,
        IBV_WC_RNR_RETRY_EXC_ERR => WcStatus::RnrRetryExceeded,
        // The transport gave up or the NIC failed: to the fabric, the peer is gone.
        _ => WcStatus::RetryExceeded,
    }
}

impl VerbsQp {
    pub(crate) fn create(device: &Arc<DeviceShared>, config: &QpConfig) -> Result<Arc<VerbsQp>> {
        let cq = |c: &Arc<dyn CompletionQueue>| {
            c.as_any()
                .downcast_ref::<super::VerbsCq>()
                .filter(|cq| cq.device_id() == device.id)
                .map(|cq| cq.hw())
                .ok_or(FabricError::ForeignObject("completion queue"))
        };
        let (send_cq, recv_cq) = (cq(&config.send_cq)?, cq(&config.recv_cq)?);
        let hw = device
            .pd
            .create_qp_builder()
            .setup_qp_type(match config.kind {
                QpKind::Rc => QueuePairType::ReliableConnection,
                QpKind::Ud => QueuePairType::UnreliableDatagram,
            })
            .setup_max_send_wr(config.max_send_wr.max(1))
            .setup_max_recv_wr(config.max_recv_wr.max(1))
            .setup_max_send_sge(1)
            .setup_max_recv_sge(1)
            .setup_max_inline_data(config.max_inline)
            .setup_send_cq(send_cq)
            .setup_recv_cq(recv_cq)
            .build()
            .map_err(|e| backend_error("creating a queue pair", super::source_of(&e)))?;
        let qpn = hw.qp_number();
        let shared = Arc::new(QpShared {
            device: device.clone(),
            hw,
            qpn,
            kind: config.kind,
            max_send_wr: config.max_send_wr,
            max_recv_wr: config.max_recv_wr,
            max_inline: config.max_inline,
            rnr_retry: config.rnr_retry.min(7),
            min_rnr_timer: rnr_timer_code(config.rnr_timer),
            qkey: config.qkey,
            send: Mutex::default(),
            recv: Mutex::default(),
            peer: Mutex::new(None),
            transitions: Mutex::new(()),
            _cqs: (config.send_cq.clone(), config.recv_cq.clone()),
        });
        sync::write(&device.qps).insert(qpn, Arc::downgrade(&shared));
        let qp = Arc::new(VerbsQp(shared));
        {
            let s = &qp.0;
            let _t = sync::lock(&s.transitions);
            // Receives may be posted from INIT on; UD goes all the way to RTS at once.
            s.to_init()?;
            if s.kind == QpKind::Ud {
                s.to_rtr(None)?;
                s.to_rts(random_psn())?;
            }
        }
        Ok(qp)
    }

    pub(crate) fn qpn(&self) -> u32 {
        self.0.qpn
    }

    /// Connects an RC queue pair to `peer` at `address` (INIT → RTR → RTS).
    pub(crate) fn connect_at(&self, peer: QpEndpoint, address: PortAddress) -> Result<()> {
        let s = &self.0;
        if s.kind == QpKind::Ud {
            return Err(FabricError::InvalidWorkRequest(
                "UD queue pairs do not connect; address each datagram instead".into(),
            ));
        }
        let _t = sync::lock(&s.transitions);
        if sync::lock(&s.peer).is_some() {
            return Err(FabricError::InvalidState {
                state: QpState::Ready,
                action: "connect (already connected)",
            });
        }
        s.to_rtr(Some((peer, address, initial_psn(peer.qpn))))?;
        s.to_rts(initial_psn(s.qpn))?;
        *sync::lock(&s.peer) = Some(peer);
        Ok(())
    }
}

impl Drop for VerbsQp {
    fn drop(&mut self) {
        sync::write(&self.0.device.qps).remove(&self.0.qpn);
        forget_local_qp(self.0.device.local.gid, self.0.qpn);
    }
}

impl QpShared {
    fn raw(&self) -> *mut sys::ibv_qp {
        // SAFETY: the pointer is valid for as long as `hw` lives, which is as long as
        // self; callers use it only within a method of self.
        unsafe { self.hw.qp().as_ptr() }
    }

    fn modify(
        &self,
        attr: &mut sys::ibv_qp_attr,
        bits: &[sys::ibv_qp_attr_mask],
        what: &str,
    ) -> Result<()> {
        // SAFETY: the QP is alive (owned by self) and attr is initialised; ibverbs
        // reads only the fields `bits` names.
        let ret = unsafe { sys::ibv_modify_qp(self.raw(), attr, mask(bits)) };
        if ret == 0 {
            Ok(())
        } else {
            Err(backend_error(
                &format!("moving queue pair {} to {what}", self.qpn),
                std::io::Error::from_raw_os_error(ret),
            ))
        }
    }

    fn to_reset(&self) -> Result<()> {
        let mut attr = zeroed_attr();
        attr.qp_state = sys::ibv_qp_state::IBV_QPS_RESET;
        self.modify(&mut attr, &[sys::ibv_qp_attr_mask::IBV_QP_STATE], "RESET")
    }

    fn to_init(&self) -> Result<()> {
        use sys::ibv_qp_attr_mask as m;
        let mut attr = zeroed_attr();
        attr.qp_state = sys::ibv_qp_state::IBV_QPS_INIT;
        attr.pkey_index = 0;
        attr.port_num = self.device.port;
        match self.kind {
            QpKind::Rc => {
                attr.qp_access_flags = (sys::ibv_access_flags::IBV_ACCESS_REMOTE_READ.0
                    | sys::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0
                    | sys::ibv_access_flags::IBV_ACCESS_REMOTE_ATOMIC.0)
                    as _;
                self.modify(
                    &mut attr,
                    &[
                        m::IBV_QP_STATE,
                        m::IBV_QP_PKEY_INDEX,
                        m::IBV_QP_PORT,
                        m::IBV_QP_ACCESS_FLAGS,
                    ],
                    "INIT",
                )
            }
            QpKind::Ud => {
                attr.qkey = self.qkey;
                self.modify(
                    &mut attr,
                    &[
                        m::IBV_QP_STATE,
                        m::IBV_QP_PKEY_INDEX,
                        m::IBV_QP_PORT,
                        m::IBV_QP_QKEY,
                    ],
                    "INIT",
                )
            }
        }
    }

    /// Where `peer`'s device is, from the peers added with `add_peer`.
    fn address_of(&self, peer: QpEndpoint) -> Result<PortAddress> {
        self.device
            .peer_address(peer.node)
            .ok_or(FabricError::UnknownPeer(peer))
    }

    /// INIT → RTR; for RC towards `peer` at `address`, which sends `rq_psn` first.
    fn to_rtr(&self, peer: Option<(QpEndpoint, PortAddress, u32)>) -> Result<()> {
        use sys::ibv_qp_attr_mask as m;
        let mut attr = zeroed_attr();
        attr.qp_state = sys::ibv_qp_state::IBV_QPS_RTR;
        let Some((peer, address, rq_psn)) = peer else {
            return self.modify(&mut attr, &[m::IBV_QP_STATE], "RTR");
        };
        attr.path_mtu = self.device.path_mtu as _;
        attr.dest_qp_num = peer.qpn;
        attr.rq_psn = rq_psn;
        attr.max_dest_rd_atomic = self.device.max_rd_atomic;
        attr.min_rnr_timer = self.min_rnr_timer;
        attr.ah_attr = self.device.ah_attr(&address);
        self.modify(
            &mut attr,
            &[
                m::IBV_QP_STATE,
                m::IBV_QP_AV,
                m::IBV_QP_PATH_MTU,
                m::IBV_QP_DEST_QPN,
                m::IBV_QP_RQ_PSN,
                m::IBV_QP_MAX_DEST_RD_ATOMIC,
                m::IBV_QP_MIN_RNR_TIMER,
            ],
            "RTR",
        )
    }

    fn to_rts(&self, sq_psn: u32) -> Result<()> {
        use sys::ibv_qp_attr_mask as m;
        let mut attr = zeroed_attr();
        attr.qp_state = sys::ibv_qp_state::IBV_QPS_RTS;
        attr.sq_psn = sq_psn;
        match self.kind {
            QpKind::Ud => self.modify(&mut attr, &[m::IBV_QP_STATE, m::IBV_QP_SQ_PSN], "RTS"),
            QpKind::Rc => {
                attr.timeout = TIMEOUT;
                attr.retry_cnt = RETRY_COUNT;
                attr.rnr_retry = self.rnr_retry;
                attr.max_rd_atomic = self.device.max_rd_atomic;
                self.modify(
                    &mut attr,
                    &[
                        m::IBV_QP_STATE,
                        m::IBV_QP_SQ_PSN,
                        m::IBV_QP_TIMEOUT,
                        m::IBV_QP_RETRY_CNT,
                        m::IBV_QP_RNR_RETRY,
                        m::IBV_QP_MAX_QP_RD_ATOMIC,
                    ],
                    "RTS",
                )
            }
        }
    }

    /// The NIC's state of the QP, and for RC its next send PSN and expected receive PSN.
    fn query(&self) -> Result<(sys::ibv_qp_state::Type, u32, u32)> {
        use sys::ibv_qp_attr_mask as m;
        let mut attr = zeroed_attr();
        // SAFETY: ibv_qp_init_attr is plain data (pointers and integers); zero is valid.
        let mut init: sys::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        // SAFETY: the QP is alive and both out-structures are ours to fill.
        let ret = unsafe {
            sys::ibv_query_qp(
                self.raw(),
                &mut attr,
                mask(&[m::IBV_QP_STATE, m::IBV_QP_SQ_PSN, m::IBV_QP_RQ_PSN]),
                &mut init,
            )
        };
        if ret != 0 {
            return Err(backend_error(
                &format!("querying queue pair {}", self.qpn),
                std::io::Error::from_raw_os_error(ret),
            ));
        }
        Ok((attr.qp_state, attr.sq_psn, attr.rq_psn))
    }

    /// RESET → INIT → RTR → RTS towards `peer`. Whatever was outstanding is gone.
    fn reconnect(&self, peer: QpEndpoint, rq_psn: u32, sq_psn: u32) -> Result<()> {
        self.to_reset()?;
        sync::lock(&self.send).pending.clear();
        sync::lock(&self.recv).pending.clear();
        self.to_init()?;
        self.to_rtr(Some((peer, self.address_of(peer)?, rq_psn)))?;
        self.to_rts(sq_psn)
    }

    /// A peer recovering its half of our connection (`resync.rs`): it proposes the PSN
    /// it will send next. A broken half is reset to expect it; a working one says what
    /// it expects. Returns (expected receive PSN, next send PSN).
    pub(crate) fn resync(&self, from: QpEndpoint, proposed: u32) -> Result<(u32, u32)> {
        let _t = sync::lock(&self.transitions);
        if *sync::lock(&self.peer) != Some(from) {
            return Err(FabricError::InvalidWorkRequest(format!(
                "queue pair {} is not connected to {from}",
                self.qpn
            )));
        }
        let (state, sq_psn, rq_psn) = self.query()?;
        if state == sys::ibv_qp_state::IBV_QPS_RTS {
            return Ok((rq_psn, sq_psn));
        }
        let sq_psn = random_psn();
        self.reconnect(from, proposed, sq_psn)?;
        Ok((proposed, sq_psn))
    }

    /// Turns a send completion of the NIC into the fabric's, retiring the unsignaled
    /// requests before it. `None`: a completion of requests dropped by a reset.
    pub(crate) fn complete_send(&self, wc: &sys::ibv_wc) -> Option<Completion> {
        let mut ring = sync::lock(&self.send);
        while ring.pending.front().is_some_and(|p| p.seq < wc.wr_id) {
            // Unsignaled, and before this completion on an RC queue pair: done.
            if let Some(retired) = ring.pending.pop_front() {
                self.fix_atomic_result(&retired);
            }
        }
        let done = ring.pending.pop_front().filter(|p| p.seq == wc.wr_id)?;
        let status = done
            .forced
            .unwrap_or_else(|| wc_status(wc.status, done.atomic));
        if status == WcStatus::Success {
            self.fix_atomic_result(&done);
        }
        Some(Completion {
            wr_id: done.wr_id,
            status,
            opcode: done.opcode,
            byte_len: done.len,
            imm: None,
            qpn: self.qpn,
            src: None,
        })
    }

    /// Puts an atomic's result into the region's byte order (little-endian words) if
    /// this NIC writes it in network byte order (`probe.rs`).
    fn fix_atomic_result(&self, done: &PendingSend) {
        let Some(buf) = done.result else { return };
        if !self.device.swap_atomic_results.load(Ordering::Acquire) {
            return;
        }
        let Some(reg) = sync::read(&self.device.lkeys).get(&buf.lkey).cloned() else {
            return;
        };
        if buf.offset.checked_add(8).is_some_and(|end| end <= reg.len) {
            let mut bytes = [0u8; 8];
            memory::copy_out(reg.mem.words(), buf.offset, &mut bytes);
            bytes.reverse();
            memory::copy_in(reg.mem.words(), buf.offset, &bytes);
        }
    }

    /// Turns a receive completion of the NIC into the fabric's.
    pub(crate) fn complete_recv(&self, wc: &sys::ibv_wc) -> Option<Completion> {
        let seq = wc.wr_id & !RECV_TAG;
        let done = {
            let mut ring = sync::lock(&self.recv);
            while ring.pending.front().is_some_and(|p| p.seq < seq) {
                ring.pending.pop_front();
            }
            ring.pending.pop_front().filter(|p| p.seq == seq)?
        };
        let status = match wc_status(wc.status, false) {
            // A local error on a receive whose buffer was registered, writable and in
            // bounds can only be a message that does not fit: rxe reports it as a
            // local QP operation error, the IBA and the fabric as a length error.
            WcStatus::LocalProtection if done.valid => WcStatus::LocalLength,
            status => status,
        };
        let ok = status == WcStatus::Success;
        let imm = (ok && wc.wc_flags & sys::ibv_wc_flags::IBV_WC_WITH_IMM.0 != 0)
            // SAFETY: with IBV_WC_WITH_IMM set, the union holds the immediate data.
            .then(|| u32::from_be(unsafe { wc.imm_data_invalidated_rkey_union.imm_data }));
        let src = match self.kind {
            QpKind::Rc => *sync::lock(&self.peer),
            QpKind::Ud if ok => self.ud_sender(&done.buf, wc.src_qp),
            QpKind::Ud => None,
        };
        Some(Completion {
            wr_id: done.wr_id,
            status,
            opcode: if ok && wc.opcode == sys::ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM {
                WcOpcode::RecvWriteImm
            } else {
                WcOpcode::Recv
            },
            byte_len: if ok { wc.byte_len } else { 0 },
            imm,
            qpn: self.qpn,
            src,
        })
    }

    /// The sender of a UD datagram, from the GRH the NIC placed in front of it: a
    /// RoCE v2 datagram over IPv4 carries an IPv4 header in the GRH's last 20 bytes,
    /// anything else a GRH whose source GID is bytes 8–24.
    fn ud_sender(&self, buf: &LocalBuf, src_qp: u32) -> Option<QpEndpoint> {
        let reg = sync::read(&self.device.lkeys).get(&buf.lkey).cloned()?;
        if buf.offset.checked_add(GRH_BYTES as u64)? > reg.len {
            return None;
        }
        let mut grh = [0u8; GRH_BYTES as usize];
        memory::copy_out(reg.mem.words(), buf.offset, &mut grh);
        let gid = if grh[20] >> 4 == 4 {
            let ip = std::net::Ipv4Addr::new(grh[32], grh[33], grh[34], grh[35]);
            ip.to_ipv6_mapped()
        } else {
            Ipv6Addr::from(<[u8; 16]>::try_from(&grh[8..24]).ok()?)
        };
        let node = self.device.sender_node(gid, src_qp)?;
        Some(QpEndpoint { node, qpn: src_qp })
    }
}

/// Where the NIC finds byte `offset` of the region with `lkey`/`rkey` (see IOVA_BASE).
fn iova(offset: u64) -> u64 {
    IOVA_BASE.wrapping_add(offset)
}

/// A NIC work request that chains into a list for one post call (one doorbell).
trait Chained: Sized {
    fn chain(&mut self, next: *mut Self, sge: *mut sys::ibv_sge);
}

impl Chained for sys::ibv_send_wr {
    fn chain(&mut self, next: *mut Self, sge: *mut sys::ibv_sge) {
        self.next = next;
        self.sg_list = sge;
    }
}

impl Chained for sys::ibv_recv_wr {
    fn chain(&mut self, next: *mut Self, sge: *mut sys::ibv_sge) {
        self.next = next;
        self.sg_list = sge;
    }
}

/// Chains `wrs[i]` to `wrs[i + 1]` with `sges[i]` as its scatter/gather entry, posts
/// the list with `post`, and returns how many requests were posted and the errno of
/// the one the NIC refused (0: none). Neither slice may move until `post` returns,
/// which the borrows ensure.
fn post_chain<W: Chained>(
    wrs: &mut [W],
    sges: &mut [sys::ibv_sge],
    post: impl FnOnce(*mut W, *mut *mut W) -> i32,
) -> (usize, i32) {
    let n = wrs.len().min(sges.len());
    let base = wrs.as_mut_ptr();
    let sge_base = sges.as_mut_ptr();
    for i in 0..n {
        // SAFETY: i < n, so `base + i` and `sge_base + i` are in bounds, and `base + i +
        // 1` is taken only when i + 1 < n; all pointers derive from the same borrows.
        unsafe {
            let next = if i + 1 < n {
                base.add(i + 1)
            } else {
                null_mut()
            };
            (*base.add(i)).chain(next, sge_base.add(i));
        }
    }
    let mut bad: *mut W = null_mut();
    let ret = post(base, &mut bad);
    let posted = if ret == 0 {
        n
    } else if bad.is_null() {
        0
    } else {
        // SAFETY: ibverbs points `bad` at an element of the list it was given.
        (unsafe { bad.offset_from(base) }).clamp(0, n as isize) as usize
    };
    (posted, ret)
}

/// The NIC address of an atomic's target. A misaligned one is a remote access error to
/// the fabric (and to most NICs, at the responder), but rxe refuses it at post time
/// (EINVAL), so it is sent to the aligned address just below every region instead:
/// the responder rejects that with a real remote access error, in order, breaking
/// both halves of the connection as the misaligned atomic would have.
fn atomic_target(offset: u64) -> u64 {
    if offset.is_multiple_of(8) {
        iova(offset)
    } else {
        IOVA_BASE - 8
    }
}

/// Makes `nic` the atomic `opcode` on `remote` (`compare_add` and `swap` in host order,
/// as ibverbs takes them).
fn set_atomic(
    nic: &mut sys::ibv_send_wr,
    opcode: sys::ibv_wr_opcode::Type,
    remote: RemoteAddr,
    compare_add: u64,
    swap: u64,
) {
    nic.opcode = opcode;
    nic.wr.atomic = sys::atomic_t {
        remote_addr: atomic_target(remote.offset),
        compare_add,
        swap,
        rkey: remote.rkey,
    };
}

fn post_error(index: usize, source: FabricError) -> FabricError {
    FabricError::Post {
        index,
        source: Box::new(source),
    }
}

impl QueuePair for VerbsQp {
    fn endpoint(&self) -> QpEndpoint {
        QpEndpoint {
            node: self.0.device.node,
            qpn: self.0.qpn,
        }
    }

    fn kind(&self) -> QpKind {
        self.0.kind
    }

    fn state(&self) -> QpState {
        match self.0.query() {
            Ok((sys::ibv_qp_state::IBV_QPS_RTS, ..)) => QpState::Ready,
            Ok((
                sys::ibv_qp_state::IBV_QPS_RESET
                | sys::ibv_qp_state::IBV_QPS_INIT
                | sys::ibv_qp_state::IBV_QPS_RTR,
                ..,
            )) => QpState::Init,
            _ => QpState::Error,
        }
    }

    fn connect(&self, peer: QpEndpoint) -> Result<()> {
        if self.0.kind == QpKind::Ud {
            return self.connect_at(peer, self.0.device.local);
        }
        let address = self.0.address_of(peer)?;
        self.connect_at(peer, address)
    }

    fn post_send(&self, wrs: &[SendWr<'_>]) -> Result<()> {
        let s = &self.0;
        let peer = *sync::lock(&s.peer);
        if s.kind == QpKind::Rc && peer.is_none() {
            return Err(FabricError::InvalidState {
                state: QpState::Init,
                action: "post_send (not connected)",
            });
        }
        let mut ring = sync::lock(&s.send);
        let mut nic_wrs: Vec<sys::ibv_send_wr> = Vec::with_capacity(wrs.len());
        let mut sges: Vec<sys::ibv_sge> = Vec::with_capacity(wrs.len());
        let mut pending = Vec::with_capacity(wrs.len());
        let mut rejected = None;
        for (index, wr) in wrs.iter().enumerate() {
            match self.build(
                wr,
                ring.pending.len() + pending.len(),
                ring.next_seq + pending.len() as u64,
            ) {
                Ok((nic_wr, sge, p)) => {
                    nic_wrs.push(nic_wr);
                    sges.push(sge);
                    pending.push(p);
                }
                Err(e) => {
                    rejected = Some(post_error(index, e));
                    break;
                }
            }
        }
        if nic_wrs.is_empty() {
            return rejected.map_or(Ok(()), Err);
        }
        let n = nic_wrs.len();
        let (posted, ret) = post_chain(&mut nic_wrs, &mut sges, |list, bad| {
            // SAFETY: the QP is alive; the list is well formed and, with its sges and
            // any inline data (borrowed from `wrs`), outlives the call. Registered
            // buffers are named by key and IOVA: the NIC checks them against their
            // registrations.
            unsafe { sys::ibv_post_send(s.raw(), list, bad) }
        });
        if ret != 0 {
            // Requests before the refused one were posted.
            ring.next_seq += posted as u64;
            ring.pending.extend(pending.drain(..posted));
            let err = std::io::Error::from_raw_os_error(ret);
            let source = match err.kind() {
                // The NIC's send queue is full (ENOMEM).
                std::io::ErrorKind::OutOfMemory => FabricError::QueueFull {
                    queue: "send",
                    depth: s.max_send_wr,
                },
                _ => backend_error("ibv_post_send", err),
            };
            return Err(post_error(posted, source));
        }
        ring.next_seq += n as u64;
        ring.pending.extend(pending);
        rejected.map_or(Ok(()), Err)
    }

    fn send_queue_depth(&self) -> u32 {
        self.0.max_send_wr
    }

    fn post_recv(&self, wrs: &[RecvWr]) -> Result<()> {
        let s = &self.0;
        let mut ring = sync::lock(&s.recv);
        let outstanding = ring.pending.len();
        let mut nic_wrs: Vec<sys::ibv_recv_wr> = Vec::with_capacity(wrs.len());
        let mut sges: Vec<sys::ibv_sge> = Vec::with_capacity(wrs.len());
        let mut full = None;
        for (index, wr) in wrs.iter().enumerate() {
            if outstanding + index >= s.max_recv_wr as usize {
                full = Some(index);
                break;
            }
            sges.push(sys::ibv_sge {
                addr: iova(wr.buf.offset),
                length: wr.buf.len,
                lkey: wr.buf.lkey,
            });
            nic_wrs.push(sys::ibv_recv_wr {
                wr_id: RECV_TAG | (ring.next_seq + index as u64),
                next: null_mut(),
                sg_list: null_mut(),
                num_sge: 1,
            });
        }
        let n = nic_wrs.len();
        let queue_full = |index| {
            post_error(
                index,
                FabricError::QueueFull {
                    queue: "receive",
                    depth: s.max_recv_wr,
                },
            )
        };
        if n == 0 {
            return full.map_or(Ok(()), |i| Err(queue_full(i)));
        }
        let (posted, ret) = post_chain(&mut nic_wrs, &mut sges, |list, bad| {
            // SAFETY: the QP is alive; the list and its sges outlive the call.
            unsafe { sys::ibv_post_recv(s.raw(), list, bad) }
        });
        let first = ring.next_seq;
        let lkeys = sync::read(&s.device.lkeys);
        for (i, wr) in wrs[..posted].iter().enumerate() {
            let valid = lkeys
                .get(&wr.buf.lkey)
                .is_some_and(|r| r.can_receive(wr.buf.offset, wr.buf.len));
            ring.pending.push_back(PendingRecv {
                seq: first + i as u64,
                wr_id: wr.wr_id,
                buf: wr.buf,
                valid,
            });
        }
        drop(lkeys);
        ring.next_seq += posted as u64;
        if ret != 0 {
            return Err(post_error(
                posted,
                backend_error("ibv_post_recv", std::io::Error::from_raw_os_error(ret)),
            ));
        }
        full.map_or(Ok(()), |i| Err(queue_full(i)))
    }

    fn recover(&self) -> Result<()> {
        let s = &self.0;
        let _t = sync::lock(&s.transitions);
        let (state, ..) = s.query()?;
        if state == sys::ibv_qp_state::IBV_QPS_RTS {
            return Ok(());
        }
        if s.kind == QpKind::Ud {
            s.to_reset()?;
            sync::lock(&s.send).pending.clear();
            sync::lock(&s.recv).pending.clear();
            s.to_init()?;
            s.to_rtr(None)?;
            return s.to_rts(random_psn());
        }
        let peer = (*sync::lock(&s.peer)).ok_or(FabricError::InvalidState {
            state: QpState::Init,
            action: "recover (never connected)",
        })?;
        let address = s
            .device
            .peer_address(peer.node)
            .ok_or(FabricError::UnknownPeer(peer))?;
        let proposed = random_psn();
        let (expected, peer_sq_psn) = resync::request(
            address.resync,
            &s.device.token,
            resync::Request {
                target_qpn: peer.qpn,
                from: QpEndpoint {
                    node: s.device.node,
                    qpn: s.qpn,
                },
                proposed_psn: proposed,
            },
        )?;
        s.reconnect(peer, peer_sq_psn, expected)
    }
}

impl VerbsQp {
    /// One NIC work request for `wr`, the `outstanding`-th request in the send queue
    /// and the NIC's request number `seq`; or why the device refuses it at post time.
    fn build<'a>(
        &self,
        wr: &SendWr<'a>,
        outstanding: usize,
        seq: u64,
    ) -> Result<(sys::ibv_send_wr, sys::ibv_sge, PendingSend)> {
        use sys::ibv_wr_opcode::*;
        let s = &self.0;
        let peer_node = sync::lock(&s.peer).map(|p| p.node);
        validate(s.kind, peer_node, s.max_inline, wr)?;
        if outstanding >= s.max_send_wr as usize {
            return Err(FabricError::QueueFull {
                queue: "send",
                depth: s.max_send_wr,
            });
        }
        // SAFETY: ibv_send_wr is plain data (integers, pointers, unions of those); all
        // zeroes is valid, and the fields the opcode uses are set below.
        let mut nic: sys::ibv_send_wr = unsafe { std::mem::zeroed() };
        nic.wr_id = seq;
        nic.num_sge = 1;
        let mut flags = 0;
        if wr.signaled {
            flags |= sys::ibv_send_flags::IBV_SEND_SIGNALED.0;
        }
        let mut forced = None;
        let local = |src: &Src<'a>, flags: &mut u32| match *src {
            Src::Buf(b) => sys::ibv_sge {
                addr: iova(b.offset),
                length: b.len,
                lkey: b.lkey,
            },
            Src::Inline(data) => {
                *flags |= sys::ibv_send_flags::IBV_SEND_INLINE.0;
                sys::ibv_sge {
                    addr: data.as_ptr() as u64,
                    length: data.len() as u32,
                    lkey: 0,
                }
            }
        };
        let buf = |b: &LocalBuf| sys::ibv_sge {
            addr: iova(b.offset),
            length: b.len,
            lkey: b.lkey,
        };
        let mut sge;
        match wr.op {
            WrOp::Read { local: l, remote } => {
                nic.opcode = IBV_WR_RDMA_READ;
                sge = buf(&l);
                nic.wr.rdma = sys::rdma_t {
                    remote_addr: iova(remote.offset),
                    rkey: remote.rkey,
                };
            }
            WrOp::Write {
                local: l,
                remote,
                imm,
            } => {
                sge = local(&l, &mut flags);
                nic.wr.rdma = sys::rdma_t {
                    remote_addr: iova(remote.offset),
                    rkey: remote.rkey,
                };
                nic.opcode = match imm {
                    Some(imm) => {
                        nic.imm_data_invalidated_rkey_union.imm_data = imm.to_be();
                        IBV_WR_RDMA_WRITE_WITH_IMM
                    }
                    None => IBV_WR_RDMA_WRITE,
                };
            }
            WrOp::Send { local: l, imm } => {
                sge = local(&l, &mut flags);
                nic.opcode = match imm {
                    Some(imm) => {
                        nic.imm_data_invalidated_rkey_union.imm_data = imm.to_be();
                        IBV_WR_SEND_WITH_IMM
                    }
                    None => IBV_WR_SEND,
                };
                if let Some(dest) = wr.dest {
                    let ah = s.device.address_handle(dest.endpoint.node)?;
                    nic.wr.ud = sys::ud_t {
                        ah,
                        remote_qpn: dest.endpoint.qpn,
                        remote_qkey: dest.qkey,
                    };
                    if l.len() > UD_MTU as u64 {
                        // The IBA (C10-93.1.1) lets a NIC drop an oversized datagram
                        // without an error, and rxe does; the fabric promises
                        // LocalLength. Posting it with a key no registration has makes
                        // the NIC fail it in order, moving the QP to the error state;
                        // the completion is reported as LocalLength.
                        sge = sys::ibv_sge {
                            addr: 0,
                            length: 1,
                            lkey: 0,
                        };
                        flags &= !sys::ibv_send_flags::IBV_SEND_INLINE.0;
                        forced = Some(WcStatus::LocalLength);
                    }
                }
            }
            WrOp::Cas {
                local: l,
                remote,
                compare,
                swap,
            } => {
                sge = buf(&l);
                set_atomic(&mut nic, IBV_WR_ATOMIC_CMP_AND_SWP, remote, compare, swap);
            }
            WrOp::FetchAdd {
                local: l,
                remote,
                add,
            } => {
                sge = buf(&l);
                set_atomic(&mut nic, IBV_WR_ATOMIC_FETCH_AND_ADD, remote, add, 0);
            }
        }
        nic.send_flags = flags;
        let pending = PendingSend {
            seq,
            wr_id: wr.wr_id,
            opcode: wr.op.opcode(),
            len: wr.op.payload_len() as u32,
            forced,
            atomic: matches!(wr.op, WrOp::Cas { .. } | WrOp::FetchAdd { .. }),
            result: match wr.op {
                WrOp::Cas { local, .. } | WrOp::FetchAdd { local, .. } => Some(local),
                _ => None,
            },
        };
        Ok((nic, sge, pending))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rnr_timer_codes_wait_at_least_as_long() {
        assert_eq!(rnr_timer_code(Duration::from_micros(1)), 1);
        assert_eq!(rnr_timer_code(Duration::from_micros(640)), 12);
        assert_eq!(rnr_timer_code(Duration::from_millis(1)), 14);
        assert_eq!(rnr_timer_code(Duration::from_millis(600)), 0);
    }

    #[test]
    fn initial_psns_fit_24_bits() {
        for qpn in [0, 1, 17, 0xff_ffff] {
            assert!(initial_psn(qpn) <= 0xff_ffff);
        }
    }
}
