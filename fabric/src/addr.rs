//! Names of things on the fabric: nodes, queue pairs, regions and addresses in them.

use bitflags::bitflags;
use std::fmt;

/// A node on the fabric: one device (an RNIC, or a backend's stand-in for one).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct NodeId(pub u32);

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "node{}", self.0)
    }
}

/// What a peer needs to reach a queue pair: its node and queue-pair number. This is
/// the information exchanged out of band before an RC connection is made.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct QpEndpoint {
    pub node: NodeId,
    pub qpn: u32,
}

impl fmt::Display for QpEndpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/qp{}", self.node, self.qpn)
    }
}

/// The destination of a UD send: the address-handle target plus the Q_Key the
/// receiving QP checks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct UdDest {
    pub endpoint: QpEndpoint,
    pub qkey: u32,
}

bitflags! {
    /// Access rights of a registered region, as `ibv_access_flags`. Local reads are
    /// always allowed (ibverbs has no flag for them); every other access needs its flag.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
    pub struct Access: u32 {
        /// The local NIC may write the region: the target of a READ, the result buffer
        /// of an atomic, a receive buffer.
        const LOCAL_WRITE = 1;
        const REMOTE_READ = 1 << 1;
        const REMOTE_WRITE = 1 << 2;
        const REMOTE_ATOMIC = 1 << 3;
    }
}

impl Access {
    /// Everything: what a memory server grants on the regions it exports.
    pub const ALL: Access = Access::all();
    /// What a compute node needs on a scratch buffer that is only a local source or target.
    pub const LOCAL: Access = Access::LOCAL_WRITE;
}

/// A location in a remote region: `(node, rkey, offset)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RemoteAddr {
    pub node: NodeId,
    pub rkey: u32,
    pub offset: u64,
}

impl RemoteAddr {
    /// The address `bytes` further on in the same region.
    pub fn offset_by(self, bytes: u64) -> RemoteAddr {
        RemoteAddr {
            offset: self.offset + bytes,
            ..self
        }
    }
}

impl fmt::Display for RemoteAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:rkey{:#x}+{}", self.node, self.rkey, self.offset)
    }
}

/// A remote region as a peer sees it: what a region directory publishes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RemoteRegion {
    pub node: NodeId,
    pub rkey: u32,
    pub len: u64,
}

impl RemoteRegion {
    pub fn at(&self, offset: u64) -> RemoteAddr {
        RemoteAddr {
            node: self.node,
            rkey: self.rkey,
            offset,
        }
    }
}

/// A slice of a local registered region: the scatter/gather element of a work request.
/// Offsets are relative to the region start, so a backend maps them to its own addresses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LocalBuf {
    pub lkey: u32,
    pub offset: u64,
    pub len: u32,
}
