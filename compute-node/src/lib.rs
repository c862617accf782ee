//! The compute node: what runs transactions against memory servers.
//!
//! - [`memory_servers`]: opens a [`txn::Database`] on running memory-server processes
//!   (their control plane makes the queue pairs; the catalog in their memory says the
//!   rest).
//!
//! The compute-node process and its gRPC KV/transaction API come with the
//! compute-node issue.

pub mod memory_servers;

pub use memory_servers::{ConnectError, RemoteCluster, RemoteServer, connect};
