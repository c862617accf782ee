//! The barrier between a sender marking itself inside an owner's memory and the owner
//! destroying the queue pair it sends through (`ring::Producer::enter_memory`).
//!
//! Each side stores, then loads what the other stores (a Dekker pair), which needs a
//! full barrier between the two on one side or the other. A sender passes there on
//! every `post_send`, an owner only when it destroys a queue pair, so the barrier goes
//! to the owner: the kernel's expedited global `membarrier`, which interrupts every
//! CPU running a thread of a process registered for it and has it execute one. A
//! sender registered so needs only a compiler barrier (on x86 a SeqCst store, the
//! other way, drains the store buffer and made single 64-byte WRITEs half as fast).
//! Where the kernel lacks the expedited command, senders store SeqCst and owners
//! issue nothing more.

use std::sync::OnceLock;

use rustix::thread::{MembarrierCommand, MembarrierQuery, membarrier, membarrier_query};

/// Whether the kernel offers expedited global barriers (the same for every process on
/// the host).
fn expedited() -> bool {
    static EXPEDITED: OnceLock<bool> = OnceLock::new();
    *EXPEDITED.get_or_init(|| {
        membarrier_query().contains(
            MembarrierQuery::GLOBAL_EXPEDITED | MembarrierQuery::REGISTER_GLOBAL_EXPEDITED,
        )
    })
}

/// Whether this process's senders may skip the hardware barrier: registered for
/// owners' expedited barriers. Registers on the first call, which
/// [`super::ShmDevice::bind_as`] makes before any queue pair exists.
pub(crate) fn senders_skip_barrier() -> bool {
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    *REGISTERED.get_or_init(|| {
        expedited() && membarrier(MembarrierCommand::RegisterGlobalExpedited).is_ok()
    })
}

/// The owner's half, between its store of the queue pair's state and its load of the
/// senders' marks: a full barrier on every CPU running a registered sender. Senders
/// of this host that could not register store SeqCst, which the owner's own SeqCst
/// accesses pair with.
pub(crate) fn owner_barrier() {
    if expedited() && membarrier(MembarrierCommand::GlobalExpedited).is_err() {
        // Registered senders rely on one: the slow global barrier waits for every CPU
        // to pass through the scheduler instead.
        let _ = membarrier(MembarrierCommand::Global);
    }
}
