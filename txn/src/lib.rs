//! RSI snapshot-isolation transactions over one-sided verbs, and the embedded client API.
//!
//! See DESIGN.md ("Data layout", "RSI"). Implemented so far:
//!
//! - [`layout`]: the record block layout (header `lock:1 | CID:63` whose locked form
//!   names the holder's commit timestamp, n versions newest first with per-version CIDs
//!   and tombstones) and the seqlock torn-read check [`layout::accept`].
//! - [`index`]: the remote hash index (one READ per lookup, CAS insert, unique keys) and
//!   the compute-side address cache.
//! - [`catalog`]: the catalog in memory-server memory (bootstrap once with CAS, the
//!   oracle's location, space allocation in data regions, tables with partitions
//!   across servers), updated by any compute node with CAS; not yet used by
//!   [`Database`].
//! - [`conn`]: a synchronous connection (one doorbell per batch, last request signaled).
//! - [`Database`] (embedded sim cluster: one memory-server node with the tables' arena
//!   and index regions and the oracle), [`Client`] (a compute handle with its own
//!   oracle slot and session), and [`Transaction`] with `get`, `put`, `insert`,
//!   `commit` (the RSI protocol: lock-and-validate by CAS in one doorbell with
//!   first-committer-wins, install by WRITE + CAS-unlock in one doorbell, unsignaled
//!   mark) and `abort`; typed errors [`TxnError`].
//!
//! Not implemented yet: `delete`, `scan`, `get_many`; the catalog in memory-server
//! memory (tables live in the `Database` value); multi-partition arenas; databases on
//! existing memory servers (sim only); the crash-atomic commit record and recovery of
//! a dead node's locks; garbage collection of old versions and leaked blocks; async
//! (coroutine) execution; `namdb bench txn`.

pub mod catalog;
pub mod conn;
mod error;
pub mod index;
pub mod layout;
pub mod runtime;
mod store;
mod transaction;
mod worker;

pub use catalog::{Placement, ServerRegions, TableSpec};
pub use error::{Result, TxnError};
pub use store::{Database, DeviceFactory, MemoryServerLink, Options, Partition, Table};
pub use transaction::{AsyncTransaction, Suspended, Transaction};
pub use worker::{Client, ClientStats, Worker};
