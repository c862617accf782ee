//! Choosing a fabric backend on the command line, and bringing up the nodes a command
//! runs on. Every backend yields the same thing: devices behind `Arc<dyn Device>`, so
//! the code above never names a backend type.

use anyhow::{Context, Result};
use clap::ValueEnum;
use fabric::Device;
use fabric::shm::ShmDevice;
use fabric::sim::{CostModel, SimConfig, SimNetwork};
use fabric::tcp::TcpDevice;
use std::sync::Arc;

/// A fabric backend. `verbs` joins here.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BackendKind {
    /// In-process simulation (`fabric::sim`).
    Sim,
    /// Soft-NICs over TCP on loopback (`fabric::tcp`), both nodes in this process.
    Tcp,
    /// Shared memory between processes (`fabric::shm`), both nodes in this process,
    /// each on its own Unix socket.
    Shm,
}

impl BackendKind {
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Sim => "sim",
            BackendKind::Tcp => "tcp",
            BackendKind::Shm => "shm",
        }
    }
}

/// Two nodes that can reach each other: one plays the memory server (its regions are
/// the remote targets), the other the client that posts work requests.
pub struct Nodes {
    pub server: Arc<dyn Device>,
    pub client: Arc<dyn Device>,
    /// Where the nodes' sockets live, removed after them.
    _sockets: Option<tempfile::TempDir>,
}

/// Brings up a fresh pair of nodes. Fresh per call, so that state a backend keeps per
/// node (e.g. the cost model's port schedule) does not leak from one use to the next.
pub fn nodes(kind: BackendKind, cost: Option<CostModel>) -> Result<Nodes> {
    match kind {
        BackendKind::Sim => Ok(sim_nodes(cost)),
        BackendKind::Tcp | BackendKind::Shm if cost.is_some() => anyhow::bail!(
            "--cost models the sim fabric; the {} backend has real costs",
            kind.name()
        ),
        BackendKind::Tcp => tcp_nodes(),
        BackendKind::Shm => shm_nodes(),
    }
}

fn sim_nodes(cost: Option<CostModel>) -> Nodes {
    let net = SimNetwork::new(SimConfig {
        cost,
        ..SimConfig::default()
    });
    let server: Arc<dyn Device> = net.add_node();
    let client: Arc<dyn Device> = net.add_node();
    Nodes {
        server,
        client,
        _sockets: None,
    }
}

fn tcp_nodes() -> Result<Nodes> {
    // Both soft-NICs live in this process, so a fresh random token is the cluster's.
    let token: [u8; 32] = rand::random();
    let server: Arc<dyn Device> = TcpDevice::bind("127.0.0.1:0", &token)?;
    let client: Arc<dyn Device> = TcpDevice::bind("127.0.0.1:0", &token)?;
    Ok(Nodes {
        server,
        client,
        _sockets: None,
    })
}

fn shm_nodes() -> Result<Nodes> {
    let dir = tempfile::Builder::new()
        .prefix("namdb-shm-")
        .tempdir()
        .context("creating a directory for the shm sockets")?;
    // Both devices live in this process, so a fresh random token is the cluster's.
    let token: [u8; 32] = rand::random();
    let server: Arc<dyn Device> = ShmDevice::bind(dir.path().join("server.sock"), &token)?;
    let client: Arc<dyn Device> = ShmDevice::bind(dir.path().join("client.sock"), &token)?;
    Ok(Nodes {
        server,
        client,
        _sockets: Some(dir),
    })
}

/// Parses a `--cost` profile name for clap. The error lists the profiles, so a typo
/// tells the user what would have worked.
pub fn parse_cost(name: &str) -> Result<CostModel, String> {
    CostModel::by_name(name).ok_or_else(|| {
        let known: Vec<&str> = CostModel::PROFILES.iter().map(|p| p.name).collect();
        format!(
            "unknown cost model `{name}`; expected one of: {}",
            known.join(", ")
        )
    })
}
