//! The bit-vector timestamp oracle of namdb: its region layout in memory-server memory
//! ([`layout`]) and the client-side protocol ([`SlotHandle`]).
//!
//! V bits (60 000 by default) in a memory-server region order all commits. Slot k of S
//! owns timestamps k, k + S, k + 2S, …; its holder hands them out with no
//! communication and decides each (commit or abort) with one FETCH_ADD on its bit. The
//! read timestamp is the end of the run of decided timestamps, read from the last
//! known prefix onward. Positions wrap: timestamp t uses bit `t mod V`, and a slot
//! uses t only once `t − V` is inside the prefix. Idle slots skip their timestamps;
//! slots whose lease expires are fenced by others and skipped for; slots are claimed
//! and released as nodes join and leave. `DEVELOPERS.md` ("timestamp oracle") records
//! the design decisions.
//!
//! ```no_run
//! # use std::sync::Arc;
//! # use fabric::{Device, QpConfig, sim::{SimConfig, SimNetwork}};
//! # use timestamp::{Layout, OracleConfig, Outcome, SlotHandle, SystemClock};
//! let net = SimNetwork::new(SimConfig::default());
//! let (server, client) = (net.add_node(), net.add_node());
//! let layout = Layout::new(timestamp::DEFAULT_BITS, 4)?;
//! let region = server.register(layout.region_bytes(), fabric::Access::ALL)?;
//! layout.format(&region)?;
//! let (scq, ccq) = (server.create_cq(64)?, client.create_cq(64)?);
//! let (_sqp, qp) = fabric::connect_rc((server.as_ref(), &scq), (client.as_ref(), &ccq))?;
//! let slot = SlotHandle::register(client.as_ref(), qp, ccq, region.remote(),
//!                                 OracleConfig::default(), SystemClock::shared())?;
//! let cid = slot.next_commit_ts()?;
//! slot.mark(cid, Outcome::Committed)?;
//! assert!(slot.read_timestamp()? >= cid);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod cells;
mod clock;
mod error;
pub mod gate;
pub mod layout;
mod link;
mod slot;

pub use clock::{Clock, ManualClock, SystemClock};
pub use error::{OracleError, Result};
pub use gate::{LeaseGates, LeaseGuard, RemoteFence};
pub use layout::{DEFAULT_BITS, Layout, Lease, SlotState};
pub use link::{MIN_CQ_CAPACITY, MIN_SEND_QUEUE};
pub use slot::{OracleConfig, Outcome, SlotHandle, SlotStats, TickReport};

/// One step of a wait for a completion. Under loom it yields to the model's scheduler,
/// which must run the other threads for the wait to end.
pub(crate) fn spin() {
    #[cfg(timestamp_loom)]
    loom::thread::yield_now();
    #[cfg(not(timestamp_loom))]
    std::hint::spin_loop();
}

#[doc(hidden)]
pub mod testkit;
