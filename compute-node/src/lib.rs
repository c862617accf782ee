//! The compute node: what runs transactions against memory servers, and serves them.
//!
//! - [`memory_servers`]: opens a [`txn::Database`] on running memory-server processes
//!   (their control plane makes the queue pairs; the catalog in their memory says the
//!   rest).
//! - [`pool`]: worker threads, each with a [`txn::Worker`] running requests as
//!   coroutines and keeping its open transactions between requests (expiring idle
//!   ones).
//! - [`service`] and [`server`]: the gRPC API ([`proto`], `namdb.compute.v1`), with
//!   [`auth`] on every call and [`status`] mapping transaction errors to status codes.
//! - [`reconnect`]: the database and pool the API serves from, replaced when a memory
//!   server restarts or fails over.
//! - [`limits`]: the size of the API's messages.
//! - [`client`]: a Rust client of the API.
//!
//! See DEVELOPERS.md ("compute node") for the decisions behind them.

pub mod auth;
pub mod client;
pub mod limits;
pub mod memory_servers;
pub mod metrics;
pub mod pool;
pub mod reconnect;
pub mod server;
pub mod service;
pub mod status;

/// The generated gRPC types and stubs of `proto/namdb/compute/v1/compute.proto`.
pub mod proto {
    tonic::include_proto!("namdb.compute.v1");

    /// The serialized `FileDescriptorSet` of the API.
    pub const FILE_DESCRIPTOR_SET: &[u8] =
        include_bytes!(concat!(env!("OUT_DIR"), "/descriptors.bin"));
}

pub use memory_servers::{ConnectError, RemoteCluster, RemoteServer, connect};
pub use pool::Pool;
pub use reconnect::Node;
pub use server::{ServeError, Server};
