//! `namdb compute-node`: a compute-node process. Connects to the memory servers,
//! starts the worker pool, and serves the gRPC transaction API until SIGTERM or SIGINT.

use crate::backend::VerbsOptions;
use anyhow::{Context, Result};
use clap::Args;
use compute_node::reconnect::Config;
use compute_node::{Node, Server};
use memory_server::ClusterToken;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

#[derive(Args, Debug)]
pub struct ComputeNodeArgs {
    /// Control-plane addresses of the memory servers (host:port,…), in the cluster's
    /// order: every compute node must list them the same way. A replicated server is
    /// `PRIMARY|BACKUP`: if its primary cannot be reached, its backup is promoted and
    /// used.
    #[arg(long, value_name = "ADDR,…", value_delimiter = ',', required = true)]
    pub memory_servers: Vec<String>,
    /// Address of the gRPC API, host:port (port 0 picks a free port).
    #[arg(long, value_name = "ADDR", value_parser = parse_listen_addr)]
    pub listen: SocketAddr,
    /// File holding the cluster token (`namdb token generate FILE` makes one).
    #[arg(long, value_name = "FILE")]
    pub token_file: PathBuf,
    /// Worker threads running transactions; by default one per core, or fewer if the
    /// cluster's oracle has no free slot for them (each worker holds one of its 16
    /// slots, shared by every compute node).
    #[arg(long, value_name = "N",
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new()
              .range(1..=compute_node::pool::MAX_WORKERS as u64))]
    pub workers: Option<usize>,
    /// A transaction with no request for this long is aborted (e.g. 300ms, 30s, 2m).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration, default_value = "30s")]
    pub txn_timeout: Duration,
    /// verbs memory servers only: the RDMA device (e.g. mlx5_0, rxe0); the first with
    /// an active port by default.
    #[arg(long, value_name = "NAME")]
    pub rdma_device: Option<String>,
    /// verbs memory servers only: the port's GID table index; by default the first
    /// IPv4-mapped RoCE GID.
    #[arg(long, value_name = "N")]
    pub gid_index: Option<u8>,
    /// Serve Prometheus metrics (plain HTTP, GET /metrics) on host:port; port 0 picks a
    /// free port, printed as `metrics listening on ADDR`.
    #[arg(long, value_name = "ADDR", value_parser = parse_listen_addr)]
    pub metrics_listen: Option<SocketAddr>,
}

/// Options whose device factory makes verbs devices, used only if the memory servers
/// serve verbs (shm and tcp devices `compute_node::connect` makes itself). Without the
/// `verbs` feature or an RDMA device, the first device fails with a message saying
/// which.
fn options(args: &ComputeNodeArgs, token: &ClusterToken) -> Result<txn::Options> {
    // Server 0's primary (a replicated server is `PRIMARY|BACKUP`).
    let first = args.memory_servers[0].split('|').next().unwrap_or_default();
    // A queue pair's resync endpoint must be reachable from the servers.
    let ip = compute_node::memory_servers::local_ip_towards(first)?;
    let verbs = VerbsOptions {
        rdma_device: args.rdma_device.clone(),
        gid_index: args.gid_index,
    };
    let secret = token.secret().to_vec();
    Ok(txn::Options {
        devices: Some(Arc::new(move || {
            crate::backend::verbs_device(
                &verbs,
                fabric::NodeId(rand::random()),
                SocketAddr::new(ip, 0),
                &secret,
            )
            .map_err(|e| txn::TxnError::Fabric(fabric::FabricError::Backend(format!("{e:#}"))))
        })),
        ..txn::Options::default()
    })
}

/// An address to listen on: `IP:PORT`, or `HOST:PORT` with a name the resolver knows
/// (`localhost:7000`), taking its first IPv4 address if it has one.
pub(crate) fn parse_listen_addr(input: &str) -> Result<std::net::SocketAddr, String> {
    use std::net::ToSocketAddrs;
    if let Ok(addr) = input.parse() {
        return Ok(addr);
    }
    let addrs: Vec<_> = input
        .to_socket_addrs()
        .map_err(|e| format!("`{input}` is not a host:port address ({e})"))?
        .collect();
    addrs
        .iter()
        .find(|a| a.is_ipv4())
        .or(addrs.first())
        .copied()
        .ok_or_else(|| format!("`{input}` names no address"))
}

/// A duration: a whole number with a unit of ms, s or m (a bare number is seconds).
pub(crate) fn parse_duration(input: &str) -> Result<Duration, String> {
    let s = input.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let value: u64 = s[..split]
        .parse()
        .map_err(|_| format!("`{input}` is not a duration: expected e.g. 300ms, 30s or 2m"))?;
    let duration = match &s[split..] {
        "ms" => Duration::from_millis(value),
        "" | "s" => Duration::from_secs(value),
        "m" => Duration::from_secs(value.saturating_mul(60)),
        unit => return Err(format!("`{input}`: unknown unit `{unit}`; use ms, s or m")),
    };
    if duration.is_zero() {
        return Err("the timeout must be positive".into());
    }
    Ok(duration)
}

/// Refuses a memory-server list with an empty address (`A|`, `A,,B`) or an address
/// given twice: the cluster would count one server as two.
fn check_memory_servers(specs: &[String]) -> Result<()> {
    let mut seen = std::collections::HashSet::new();
    for spec in specs {
        for addr in spec.split('|') {
            let addr = addr.trim();
            anyhow::ensure!(
                !addr.is_empty(),
                "--memory-servers: `{spec}` has an empty address (expected HOST:PORT or \
                 PRIMARY|BACKUP)"
            );
            anyhow::ensure!(
                seen.insert(addr.to_string()),
                "--memory-servers: {addr} is listed twice; each memory server once"
            );
        }
    }
    Ok(())
}

pub fn run(args: ComputeNodeArgs) -> Result<()> {
    check_memory_servers(&args.memory_servers)?;
    let token = ClusterToken::from_file(&args.token_file)?;
    let workers = args
        .workers
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    // Connecting and starting workers use the memory servers' blocking client, so both
    // happen before the tokio runtime exists (and reconnections on the node's monitor
    // thread, outside it).
    let node = Node::start(Config {
        addrs: args.memory_servers.clone(),
        token: token.clone(),
        options: options(&args, &token)?,
        workers,
        fewer_workers_ok: args.workers.is_none(),
        idle_timeout: args.txn_timeout,
    })
    .context("cannot open the database on the memory servers")?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("namdb-compute-node")
        .enable_all()
        .build()
        .context("cannot start the tokio runtime")?;
    let served = runtime.block_on(async {
        let server = Server::start(args.listen, token, node.clone()).await?;
        if let Some(listen) = args.metrics_listen {
            let (metrics, node) = (server.metrics(), node.clone());
            let render: crate::metrics::Render = Arc::new(move || {
                let (metrics, node) = (metrics.clone(), node.clone());
                Box::pin(async move {
                    let reconnects = (node.reconnects(), node.last_reconnect());
                    let stats = match node.live() {
                        Ok(live) => node.worker_stats(&live).await,
                        Err(e) => Err(e),
                    };
                    match stats {
                        Ok(stats) => metrics.render(&stats, reconnects),
                        Err(e) => format!("# the workers did not answer: {}\n", e.message()),
                    }
                })
            });
            crate::metrics::serve(listen, render).await?;
        }
        // Installed before the line below: a script may send SIGTERM as soon as it
        // reads it, and must get the clean shutdown.
        let signal = memory_server::listen_for_signals()?;
        // The one line a script waits for (and, with port 0, learns the port from).
        println!(
            "compute node listening on {} ({} worker{}, {} memory servers, backend {})",
            server.local_addr(),
            node.workers(),
            if node.workers() == 1 { "" } else { "s" },
            node.servers(),
            node.backend()
        );
        server.run_until(signal).await?;
        anyhow::Ok(())
    });
    // The service is gone with the runtime; then the monitor stops and so do the workers
    // (running requests finish, open transactions are aborted) before the memory
    // servers' sessions close.
    drop(runtime);
    node.stop();
    served?;
    tracing::info!("compute node stopped");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listen_addresses_take_host_names() {
        assert_eq!(
            parse_listen_addr("localhost:0").unwrap(),
            "127.0.0.1:0".parse().unwrap()
        );
        assert_eq!(
            parse_listen_addr("127.0.0.2:7").unwrap(),
            "127.0.0.2:7".parse().unwrap()
        );
        assert!(parse_listen_addr("localhost").is_err());
    }

    #[test]
    fn durations_take_units() {
        assert_eq!(parse_duration("300ms"), Ok(Duration::from_millis(300)));
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("7"), Ok(Duration::from_secs(7)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert!(parse_duration("5h").unwrap_err().contains("unknown unit"));
        assert!(parse_duration("ms").is_err());
        assert!(parse_duration("0s").is_err());
    }
}
