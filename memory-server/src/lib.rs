//! The namdb memory server: allocates and registers regions on a fabric device,
//! publishes them in a region directory, authenticates peers with the cluster token,
//! connects their queue pairs, and reports statistics. See DEVELOPERS.md ("memory
//! server") for the protocol and the decisions behind it.
//!
//! The server is dumb on purpose: after [`Client::connect_qp`], compute nodes use the
//! fabric (one-sided READ, WRITE, CAS, FETCH_ADD) against the listed regions, and the
//! server's control plane sees none of it.
//!
//! - [`MemoryServer::start`] takes a [`ServerConfig`] and the device to serve on, as
//!   `Arc<dyn fabric::Device>`: which backend it is, is the caller's choice.
//! - [`Client`] (async, tokio) and [`blocking::Client`] talk to it.
//! - [`RemoteDevice`] drives the server's own device over the remote-verbs service,
//!   which a server offers only when [`ServerConfig::allow_remote_verbs`] is set: for
//!   the conformance suite and diagnostics.
//! - With [`ServerConfig::durability`] set, a server keeps its regions on disk: clients
//!   make byte ranges durable with [`Client::persist`] (or, without blocking, a
//!   [`Persister`]), and a restarted server restores them.
//! - With [`ServerConfig::replication`], a primary replicates every Persist to a
//!   backup server before acknowledging it, and a backup takes over once promoted
//!   ([`Client::promote`]).
//! - [`proto`] is the gRPC protocol, `namdb.memory_server.v1`.

mod auth;
pub mod blocking;
mod client;
mod durable;
mod persister;
pub mod regions;
mod remote_device;
mod replica;
mod server;
mod service;
mod session;
mod stats;
pub mod token;
pub mod unknown_method;
mod verbs_error;
mod verbs_service;
mod verbs_wire;

/// The generated gRPC types and stubs of `proto/namdb/memory_server/v1/control.proto`
/// and `remote_verbs.proto`.
pub mod proto {
    tonic::include_proto!("namdb.memory_server.v1");

    /// The serialized `FileDescriptorSet` of both files.
    pub const FILE_DESCRIPTOR_SET: &[u8] =
        include_bytes!(concat!(env!("OUT_DIR"), "/descriptors.bin"));
}

pub use client::{
    Client, ClientError, FenceReport, PersistRange, RemoteEndpointInfo, ServerInfo, status_text,
};
pub use durable::{
    DurabilityConfig, MAX_PERSIST_BYTES, PersistError, Promotion, RestoreReport, lock_data_dir,
    recorded_promotion,
};
pub use persister::{
    BATCH_SPLIT, BATCH_STALL, MAX_BATCHES_IN_FLIGHT, MAX_PERSISTS_IN_FLIGHT, PersistStatus,
    Persister, Ticket,
};
pub use regions::{
    CATALOG_BYTES, CATALOG_REGION, DEFAULT_REGION_SIZE, PlanError, RegionDirectory, RegionInfo,
    RegionPlan, parse_bytes,
};
pub use remote_device::RemoteDevice;
pub use replica::{PRIMARY_HEARTBEAT, Replication, Role};
pub use server::{MemoryServer, ServerConfig, ServerError, listen_for_signals, wait_for_signal};
pub use session::{SESSION_METADATA, SessionId};
pub use stats::Stats;
pub use token::{ClusterToken, TokenError, generate_token_file};

/// The protocol name and version a server announces in Hello.
pub const PROTOCOL: &str = "namdb.memory_server.v1";

/// This build's version, announced in Hello.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
