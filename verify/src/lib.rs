//! History recording and snapshot-isolation checkers.
//!
//! A history is a list of transactions with their reads, writes and outcomes, stored as
//! JSON Lines ([`history`]). [`recorder`] writes one while a workload ([`workload`])
//! runs against any store implementing [`store::TxnStore`] ([`mem_store`] is the
//! in-memory reference, [`txn_store`] adapts namdb's transactions). Checking starts by indexing the history ([`index`]); then a
//! white-box checker ([`whitebox`]) replays the system's own timestamps and an
//! Elle-style black-box checker ([`elle`]) infers dependencies from values alone;
//! without timestamps, register reads are checked by value ([`registers`]).
//! [`report`] runs them and gives the verdict. [`chaos`] is the fault-injection
//! harness's plan, checks and report.

pub mod anomaly;
pub mod chaos;
pub mod elle;
pub mod history;
pub mod index;
pub mod mem_store;
pub mod recorder;
pub mod registers;
pub mod report;
pub mod store;
pub mod txn_store;
pub mod whitebox;
pub mod workload;
