//! Work requests and completions.

use crate::addr::{LocalBuf, QpEndpoint, RemoteAddr, UdDest};
use crate::error::WcStatus;

/// The local side of a WRITE or SEND: a registered buffer, or inline data that the
/// device copies at post time (`IBV_SEND_INLINE`), so the caller may reuse it at once
/// and it needs no registration.
#[derive(Clone, Copy, Debug)]
pub enum Src<'a> {
    Buf(LocalBuf),
    Inline(&'a [u8]),
}

impl Src<'_> {
    pub fn len(&self) -> u64 {
        match self {
            Src::Buf(b) => b.len as u64,
            Src::Inline(d) => d.len() as u64,
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl From<LocalBuf> for Src<'_> {
    fn from(b: LocalBuf) -> Self {
        Src::Buf(b)
    }
}

/// The operation of a send-queue work request.
#[derive(Clone, Copy, Debug)]
pub enum WrOp<'a> {
    /// RDMA READ of `local.len` bytes from `remote` into `local`.
    Read { local: LocalBuf, remote: RemoteAddr },
    /// RDMA WRITE; with `imm`, WRITE_WITH_IMM, which also consumes a receive at the peer.
    Write {
        local: Src<'a>,
        remote: RemoteAddr,
        imm: Option<u32>,
    },
    /// SEND; with `imm`, SEND_WITH_IMM.
    Send { local: Src<'a>, imm: Option<u32> },
    /// 8-byte compare-and-swap; the old value lands in `local` (8 bytes).
    Cas {
        local: LocalBuf,
        remote: RemoteAddr,
        compare: u64,
        swap: u64,
    },
    /// 8-byte fetch-and-add (wrapping); the old value lands in `local` (8 bytes).
    FetchAdd {
        local: LocalBuf,
        remote: RemoteAddr,
        add: u64,
    },
}

impl WrOp<'_> {
    /// The completion opcode this operation reports.
    pub fn opcode(&self) -> WcOpcode {
        match self {
            WrOp::Read { .. } => WcOpcode::Read,
            WrOp::Write { .. } => WcOpcode::Write,
            WrOp::Send { .. } => WcOpcode::Send,
            WrOp::Cas { .. } => WcOpcode::CompareSwap,
            WrOp::FetchAdd { .. } => WcOpcode::FetchAdd,
        }
    }

    /// Bytes moved over the wire.
    pub fn payload_len(&self) -> u64 {
        match self {
            WrOp::Read { local, .. } => local.len as u64,
            WrOp::Write { local, .. } | WrOp::Send { local, .. } => local.len(),
            WrOp::Cas { .. } | WrOp::FetchAdd { .. } => 8,
        }
    }

    /// The responder memory a one-sided operation touches: where, and how many bytes.
    pub fn remote_span(&self) -> Option<(RemoteAddr, u64)> {
        match *self {
            WrOp::Read { local, remote } => Some((remote, local.len as u64)),
            WrOp::Write { local, remote, .. } => Some((remote, local.len())),
            WrOp::Cas { remote, .. } | WrOp::FetchAdd { remote, .. } => Some((remote, 8)),
            WrOp::Send { .. } => None,
        }
    }
}

/// A send-queue work request.
#[derive(Clone, Copy, Debug)]
pub struct SendWr<'a> {
    pub wr_id: u64,
    pub op: WrOp<'a>,
    /// Generate a completion on success. Errors always complete.
    pub signaled: bool,
    /// For UD queue pairs: where the datagram goes. RC queue pairs must leave it `None`.
    pub dest: Option<UdDest>,
}

impl<'a> SendWr<'a> {
    pub fn new(wr_id: u64, op: WrOp<'a>) -> SendWr<'a> {
        SendWr {
            wr_id,
            op,
            signaled: true,
            dest: None,
        }
    }
    pub fn read(wr_id: u64, local: LocalBuf, remote: RemoteAddr) -> SendWr<'a> {
        SendWr::new(wr_id, WrOp::Read { local, remote })
    }
    pub fn write(wr_id: u64, local: impl Into<Src<'a>>, remote: RemoteAddr) -> SendWr<'a> {
        let local = local.into();
        SendWr::new(
            wr_id,
            WrOp::Write {
                local,
                remote,
                imm: None,
            },
        )
    }
    pub fn write_imm(
        wr_id: u64,
        local: impl Into<Src<'a>>,
        remote: RemoteAddr,
        imm: u32,
    ) -> SendWr<'a> {
        let local = local.into();
        SendWr::new(
            wr_id,
            WrOp::Write {
                local,
                remote,
                imm: Some(imm),
            },
        )
    }
    pub fn send(wr_id: u64, local: impl Into<Src<'a>>) -> SendWr<'a> {
        let local = local.into();
        SendWr::new(wr_id, WrOp::Send { local, imm: None })
    }
    pub fn send_imm(wr_id: u64, local: impl Into<Src<'a>>, imm: u32) -> SendWr<'a> {
        let local = local.into();
        SendWr::new(
            wr_id,
            WrOp::Send {
                local,
                imm: Some(imm),
            },
        )
    }
    pub fn cas(
        wr_id: u64,
        local: LocalBuf,
        remote: RemoteAddr,
        compare: u64,
        swap: u64,
    ) -> SendWr<'a> {
        SendWr::new(
            wr_id,
            WrOp::Cas {
                local,
                remote,
                compare,
                swap,
            },
        )
    }
    pub fn fetch_add(wr_id: u64, local: LocalBuf, remote: RemoteAddr, add: u64) -> SendWr<'a> {
        SendWr::new(wr_id, WrOp::FetchAdd { local, remote, add })
    }
    /// Suppresses the success completion (selective signaling).
    pub fn unsignaled(mut self) -> Self {
        self.signaled = false;
        self
    }
    pub fn signaled(mut self, signaled: bool) -> Self {
        self.signaled = signaled;
        self
    }
    /// Addresses a UD datagram.
    pub fn to(mut self, dest: UdDest) -> Self {
        self.dest = Some(dest);
        self
    }
}

/// A receive-queue work request. On UD queue pairs the first [`GRH_BYTES`] of the
/// buffer receive the global route header, as on hardware.
#[derive(Clone, Copy, Debug)]
pub struct RecvWr {
    pub wr_id: u64,
    pub buf: LocalBuf,
}

/// Bytes a UD receive buffer reserves in front of the payload for the GRH.
pub const GRH_BYTES: u32 = 40;

/// The largest UD payload.
pub const UD_MTU: u32 = 4096;

/// What completed, as `ibv_wc_opcode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum WcOpcode {
    #[default]
    Send,
    Write,
    Read,
    CompareSwap,
    FetchAdd,
    /// A receive consumed by a SEND or SEND_WITH_IMM.
    Recv,
    /// A receive consumed by a WRITE_WITH_IMM.
    RecvWriteImm,
}

/// A work completion, as `ibv_wc`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Completion {
    pub wr_id: u64,
    pub status: WcStatus,
    pub opcode: WcOpcode,
    /// For receives: bytes received (including the GRH on UD).
    pub byte_len: u32,
    pub imm: Option<u32>,
    /// The local queue pair number.
    pub qpn: u32,
    /// For receives: the sending queue pair.
    pub src: Option<QpEndpoint>,
}
