//! RSI snapshot-isolation transactions over one-sided verbs, and the embedded client API.
//!
//! See DESIGN.md ("Data layout", "RSI"). Implemented so far:
//!
//! - [`layout`]: the record block layout (header `lock:1 | CID:63` whose locked form
//!   names the holder's commit timestamp, n versions newest first with per-version CIDs
//!   and tombstones) and the seqlock torn-read check [`layout::accept`].
//! - [`index`]: the remote hash index (one READ per lookup, CAS insert, unique keys) and
//!   the compute-side address cache.
//! - [`conn`]: a synchronous connection (one doorbell per batch, last request signaled).
//!
//! Not implemented yet: the commit protocol and the `Database` / `Transaction` API, the
//! CAS-updated catalog in memory-server memory, multi-partition arenas, scans, deletes,
//! the commit log and lock recovery for dead nodes.

pub mod conn;
pub mod index;
pub mod layout;
