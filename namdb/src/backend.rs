//! Choosing a fabric backend on the command line, and bringing up the nodes a command
//! runs on. Every backend yields the same thing: devices behind `Arc<dyn Device>`, so
//! the code above never names a backend type.

use anyhow::{Context, Result};
use clap::ValueEnum;
use fabric::shm::ShmDevice;
use fabric::sim::{CostModel, SimConfig, SimNetwork};
use fabric::tcp::TcpDevice;
use fabric::{Device, NodeId};
use std::net::SocketAddr;
use std::sync::Arc;

/// A fabric backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BackendKind {
    /// In-process simulation (`fabric::sim`).
    Sim,
    /// Soft-NICs over TCP on loopback (`fabric::tcp`).
    Tcp,
    /// Shared memory between processes (`fabric::shm`), each node on its own Unix
    /// socket.
    Shm,
    /// An RDMA NIC through rdma-core (`fabric::verbs`), on the first RDMA device; needs
    /// a build with `--features verbs`.
    Verbs,
}

impl BackendKind {
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Sim => "sim",
            BackendKind::Tcp => "tcp",
            BackendKind::Shm => "shm",
            BackendKind::Verbs => "verbs",
        }
    }
}

/// Two nodes that can reach each other: one plays the memory server (its regions are
/// the remote targets), the other the client that posts work requests.
pub struct Nodes {
    pub server: Arc<dyn Device>,
    pub client: Arc<dyn Device>,
    /// Where the nodes' sockets live, removed after them.
    _sockets: Option<SocketDir>,
}

/// shm sockets' directory: removed on Ctrl-C or SIGTERM too, which end the process
/// before any destructor runs (the directory and its sockets stayed behind).
type SocketDir = crate::interrupt::TempDir;

/// Brings up a fresh pair of nodes. Fresh per call, so that state a backend keeps per
/// node (e.g. the cost model's port schedule) does not leak from one use to the next.
pub fn nodes(kind: BackendKind, cost: Option<CostModel>) -> Result<Nodes> {
    match kind {
        BackendKind::Sim => Ok(sim_nodes(cost)),
        BackendKind::Tcp | BackendKind::Shm | BackendKind::Verbs if cost.is_some() => {
            anyhow::bail!(
                "--cost models the sim fabric; the {} backend has real costs",
                kind.name()
            )
        }
        BackendKind::Tcp => tcp_nodes(),
        BackendKind::Shm => shm_nodes(),
        BackendKind::Verbs => {
            // Both devices live in this process, so a fresh random token is the cluster's.
            let token: [u8; 32] = rand::random();
            let loopback = SocketAddr::from(([127, 0, 0, 1], 0));
            let config = VerbsOptions::default();
            Ok(Nodes {
                server: verbs_device(&config, NodeId(rand::random()), loopback, &token)?,
                client: verbs_device(&config, NodeId(rand::random()), loopback, &token)?,
                _sockets: None,
            })
        }
    }
}

/// Which RDMA device and GID a verbs node uses.
#[derive(Clone, Debug, Default)]
// Read only by the verbs backend, which a default build leaves out.
#[cfg_attr(not(feature = "verbs"), allow(dead_code))]
pub struct VerbsOptions {
    /// The RDMA device (`mlx5_0`, `rxe0`, …); the first with an active port if `None`.
    pub rdma_device: Option<String>,
    /// The port's GID table index; an IPv4-mapped RoCE GID if `None`.
    pub gid_index: Option<u8>,
}

/// A verbs device on `node` whose resync endpoint (which peers recovering a queue pair
/// dial) listens on `resync`. Without an RDMA device, the error says so.
#[cfg(feature = "verbs")]
pub fn verbs_device(
    options: &VerbsOptions,
    node: NodeId,
    resync: SocketAddr,
    token: &[u8],
) -> Result<Arc<dyn Device>> {
    let mut config = fabric::verbs::VerbsConfig::new(node);
    config.device = options.rdma_device.clone();
    config.gid_index = options.gid_index;
    config.resync_listen = resync;
    Ok(fabric::verbs::VerbsDevice::open(&config, token)?)
}

/// Without the `verbs` feature: the error says how to get it.
#[cfg(not(feature = "verbs"))]
pub fn verbs_device(
    _options: &VerbsOptions,
    _node: NodeId,
    _resync: SocketAddr,
    _token: &[u8],
) -> Result<Arc<dyn Device>> {
    anyhow::bail!(
        "this namdb was built without the verbs backend; rebuild with \
         `cargo build --release -p namdb --features verbs` (needs cmake, libclang-dev and \
         rdma-core's libibverbs-dev)"
    )
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
    let dir = SocketDir::new("namdb-shm-")?;
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

/// A memory server started separately, as a benchmark's target: a client device of
/// the server's backend in this process, the authenticated control-plane session, and
/// the server's regions.
pub struct ServerTarget {
    pub client: Arc<dyn Device>,
    pub control: memory_server::blocking::Client,
    pub regions: txn::ServerRegions,
    pub address: String,
    _sockets: Option<SocketDir>,
}

/// Connects to the memory server at `addr` (its gRPC control plane) with the token in
/// `token_file`, and brings up a client device of `kind` that the server can reach.
pub fn connect_server(
    kind: BackendKind,
    addr: &str,
    token_file: &std::path::Path,
) -> Result<ServerTarget> {
    let token = memory_server::ClusterToken::from_file(token_file)?;
    let control = memory_server::blocking::Client::connect(addr, &token)
        .with_context(|| format!("cannot reach the memory server at {addr}"))?;
    let served = control.server().backend.clone();
    anyhow::ensure!(
        served == kind.name(),
        "the memory server at {addr} serves the {served} backend, not {}; pass --backend {served}",
        kind.name()
    );
    let directory = control.list_regions()?;
    let catalog = directory
        .catalog()
        .map(|r| r.remote)
        .with_context(|| format!("the memory server at {addr} exports no catalog region"))?;
    let data: Vec<_> = directory.data().map(|r| r.remote).collect();
    anyhow::ensure!(
        !data.is_empty(),
        "the memory server at {addr} exports no data region"
    );
    let (client, sockets): (Arc<dyn Device>, _) = match kind {
        BackendKind::Sim => anyhow::bail!("a memory server never serves the sim backend"),
        BackendKind::Tcp => {
            // The server dials the client's soft-NIC back, so listen on the address this
            // host uses to reach the server, not on loopback or the wildcard.
            let local = compute_node::memory_servers::local_ip_towards(addr)?;
            let device = TcpDevice::bind(&format!("{local}:0"), token.secret())?;
            (device, None)
        }
        BackendKind::Verbs => {
            // The server dials the resync endpoint back when it recovers a queue pair.
            let resync = SocketAddr::new(compute_node::memory_servers::local_ip_towards(addr)?, 0);
            let node = NodeId(rand::random());
            let device = verbs_device(&VerbsOptions::default(), node, resync, token.secret())?;
            (device, None)
        }
        BackendKind::Shm => {
            let dir = SocketDir::new("namdb-bench-")?;
            let device = ShmDevice::bind(dir.path().join("client.sock"), token.secret())?;
            (device, Some(dir))
        }
    };
    Ok(ServerTarget {
        client,
        control,
        regions: txn::ServerRegions { catalog, data },
        address: addr.to_string(),
        _sockets: sockets,
    })
}
