//! The verbs interface every backend implements: devices, completion queues and
//! queue pairs. Object-safe, so layers above hold `Arc<dyn …>` and stay backend-agnostic.

use crate::addr::{Access, NodeId, QpEndpoint};
use crate::error::{QpState, Result};
use crate::memory::Memory;
use crate::region::Region;
use crate::wr::{Completion, RecvWr, SendWr};
use std::any::Any;
use std::sync::Arc;
use std::time::Duration;

/// A device: one node's NIC with its protection domain.
pub trait Device: Send + Sync {
    fn node(&self) -> NodeId;
    /// The backend's name: `sim`, `shm`, `tcp` or `verbs`.
    fn backend(&self) -> &'static str;
    /// How peers reach this device (`sim:3`, `tcp:127.0.0.1:7000`, …): what an
    /// out-of-band exchange hands to the other side's [`Device::add_peer`], together
    /// with [`Device::node`] and a queue pair's number.
    fn address(&self) -> String;
    /// Tells the device how to reach `node`, as an address handle or path record does
    /// on hardware. Needed before connecting to, or sending datagrams to, that node.
    fn add_peer(&self, node: NodeId, address: &str) -> Result<()>;
    /// Allocates `len` bytes of zeroed memory suited to the backend and registers it.
    fn register(&self, len: u64, access: Access) -> Result<Region>;
    /// Registers existing memory (the first `len` bytes of `mem`).
    fn register_memory(&self, mem: Arc<dyn Memory>, len: u64, access: Access) -> Result<Region>;
    fn create_cq(&self, capacity: u32) -> Result<Arc<dyn CompletionQueue>>;
    fn create_qp(&self, config: &QpConfig) -> Result<Arc<dyn QueuePair>>;
    /// Whether the bytes of one WRITE land in increasing address order, so a reader
    /// that sees a WRITE's last word also sees the rest of it. The sim, shm and tcp
    /// backends store the last word with Release. The IBA promises no order of
    /// placement within a message, only that a message is placed once its completion
    /// is seen and that the messages of a queue pair are placed in posting order; rxe
    /// copies with the CPU's string moves, which an emulated CPU (TCG) tears even
    /// within a word. So the verbs backend says no, and a protocol that publishes with
    /// a word must WRITE that word separately, after the rest.
    fn orders_write_placement(&self) -> bool {
        true
    }
}

/// A completion queue, polled by its owner.
pub trait CompletionQueue: Send + Sync {
    /// Moves up to `out.len()` completions into `out` and returns how many. Completions
    /// of one queue pair come out in the order their work requests were posted.
    fn poll(&self, out: &mut [Completion]) -> Result<usize>;
    fn capacity(&self) -> u32;
    /// For backends to recognise their own completion queues.
    fn as_any(&self) -> &dyn Any;
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QpKind {
    /// Reliable connection: one peer, ordered, all operations.
    Rc,
    /// Unreliable datagram: SEND/SEND_WITH_IMM of at most the MTU to any UD peer;
    /// may reorder and drop.
    Ud,
}

/// A queue pair.
pub trait QueuePair: Send + Sync {
    fn endpoint(&self) -> QpEndpoint;
    fn kind(&self) -> QpKind;
    fn state(&self) -> QpState;
    /// Connects an RC queue pair to its peer (INIT → RTR → RTS). The peer connects back
    /// with this queue pair's endpoint.
    fn connect(&self, peer: QpEndpoint) -> Result<()>;
    /// Posts a batch of send work requests with one doorbell. A work request the device
    /// rejects outright stops the batch with `FabricError::Post { index, .. }`; the ones
    /// before it were posted.
    fn post_send(&self, wrs: &[SendWr<'_>]) -> Result<()>;
    /// Send work requests that may be outstanding ([`QpConfig::max_send_wr`]).
    fn send_queue_depth(&self) -> u32;
    fn post_recv(&self, wrs: &[RecvWr]) -> Result<()>;
    /// Takes a queue pair out of the error state (RESET → INIT → RTR → RTS) with the
    /// same peer. Everything outstanding has been flushed by then.
    fn recover(&self) -> Result<()>;
}

/// How to create a queue pair.
#[derive(Clone)]
pub struct QpConfig {
    pub kind: QpKind,
    pub send_cq: Arc<dyn CompletionQueue>,
    pub recv_cq: Arc<dyn CompletionQueue>,
    /// Send work requests that may be outstanding: posted and not yet retired by a
    /// polled completion (an unsignaled one is retired by the next polled completion).
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_inline: u32,
    /// RNR retries, 0–7; 7 means retry forever, as in ibverbs.
    pub rnr_retry: u8,
    /// Wait between RNR retries.
    pub rnr_timer: Duration,
    /// RC: how long requests on the wire may go without a sign of the responder (a
    /// response, or bytes it took) before the oldest completes with `RetryExceeded`
    /// and the queue pair breaks, as a NIC's transport timer and retries end
    /// (`timeout × retry_cnt`). A SEND or WRITE_WITH_IMM waiting for a receive is the
    /// RNR budget's to end, not this. The tcp backend keeps it; sim and shm requesters
    /// execute their requests themselves, and verbs programs the NIC's own timer
    /// (67 ms × 7 retries).
    pub transport_timeout: Duration,
    /// UD only: the Q_Key incoming datagrams must carry.
    pub qkey: u32,
}

impl QpConfig {
    pub const DEFAULT_QKEY: u32 = 0x1111_1111;
    /// Generous for a soft-NIC whose responder thread shares a few busy cores (a NIC's
    /// is typically 0.5–4 s), and a third of what the transaction layer waits for a
    /// completion before it calls the connection lost.
    pub const DEFAULT_TRANSPORT_TIMEOUT: Duration = Duration::from_secs(10);

    pub fn new(kind: QpKind, cq: &Arc<dyn CompletionQueue>) -> QpConfig {
        QpConfig {
            kind,
            send_cq: cq.clone(),
            recv_cq: cq.clone(),
            max_send_wr: 1024,
            max_recv_wr: 1024,
            max_inline: 256,
            rnr_retry: 3,
            rnr_timer: Duration::from_micros(640),
            transport_timeout: Self::DEFAULT_TRANSPORT_TIMEOUT,
            qkey: Self::DEFAULT_QKEY,
        }
    }
    pub fn rc(cq: &Arc<dyn CompletionQueue>) -> QpConfig {
        QpConfig::new(QpKind::Rc, cq)
    }
    pub fn ud(cq: &Arc<dyn CompletionQueue>) -> QpConfig {
        QpConfig::new(QpKind::Ud, cq)
    }
    pub fn recv_cq(mut self, cq: &Arc<dyn CompletionQueue>) -> QpConfig {
        self.recv_cq = cq.clone();
        self
    }
}
