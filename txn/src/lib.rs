//! RSI snapshot-isolation transactions over one-sided verbs, and the client API.
//!
//! See DESIGN.md ("Data layout", "RSI") and DEVELOPERS.md ("txn").
//!
//! - [`layout`]: record blocks (header `lock:1 | CID:63` naming its holder when locked,
//!   the key, n versions newest first with per-version CIDs and tombstones) and the
//!   seqlock torn-read check.
//! - [`index`]: the remote hash index (one READ per lookup, CAS insert, unique keys) and
//!   the compute-side address cache.
//! - [`catalog`]: tables, partitions and the oracle's place in memory-server memory,
//!   set up and changed by any compute node with CAS.
//! - [`Database`] (embedded, or [`Database::open`] on running memory servers),
//!   [`Worker`] (one thread's connections, oracle slot and coroutines), [`Client`] (a
//!   blocking worker with one session), [`AsyncTransaction`] / [`Transaction`].
//!
//! ```
//! let db = txn::Database::embedded(txn::Options::default())?;
//! let accounts = db.create_table(txn::TableSpec::new("accounts", 8, 1_000))?;
//! let mut client = db.client()?;
//! client.run(10, |t| {
//!     t.insert(&accounts, 1, 100i64.to_le_bytes().to_vec())?;
//!     t.insert(&accounts, 2, 0i64.to_le_bytes().to_vec())
//! })?;
//! let mut t = client.begin()?;
//! assert_eq!(t.get(&accounts, 1)?, Some(100i64.to_le_bytes().to_vec()));
//! # Ok::<(), txn::TxnError>(())
//! ```
//!
//! - [`commitlog`]: the crash-atomic commit record; [`recovery`]: resolving a dead
//!   node's locks from it; [`crash`]: crash points at every commit step for the chaos
//!   harness.
//! - [`durable`]: what commits persist on durable memory servers, and the restart
//!   recovery `Database::open` runs after one of them restarted
//!   ([`RestartReport`]).
//!
//! Not implemented yet: garbage collection of old versions and leaked blocks.

pub mod catalog;
pub mod commitlog;
pub mod conn;
pub mod crash;
pub mod durable;
mod error;
pub mod index;
pub mod layout;
pub mod recovery;
mod restart;
pub mod runtime;
pub mod snapshot;
mod store;
mod transaction;
mod worker;

pub use catalog::{Placement, ServerRegions, TableSpec};
pub use durable::{PersistRange, PersistStatus, Persistence};
pub use error::{ECHO_CHARS, Result, TxnError, echo};
pub use recovery::{LockedRecord, RecoveryHold, RecoveryReport, UnpublishedSlot};
pub use restart::RestartReport;
pub use snapshot::{Snapshot, Stripe};
pub use store::{
    DEFAULT_SLOTS, Database, DeviceFactory, MemoryServerLink, Options, Partition, Table,
};
pub use transaction::{AsyncTransaction, Suspended, Transaction};
pub use worker::{Client, ClientStats, FencedOutcome, Worker};
