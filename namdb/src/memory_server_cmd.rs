//! `namdb memory-server`: a memory-server process. Validates its arguments, brings up
//! the fabric device for `--backend`, and runs `memory_server::MemoryServer` on it until
//! SIGTERM or SIGINT.

use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use fabric::Device;
use memory_server::{ClusterToken, MemoryServer, RegionPlan, ServerConfig, parse_bytes};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

#[derive(Args, Debug)]
pub struct MemoryServerArgs {
    /// Address of the gRPC control plane, host:port (port 0 picks a free port).
    #[arg(long, value_name = "ADDR")]
    pub listen: SocketAddr,
    /// Fabric backend of the data path.
    #[arg(long, value_enum)]
    pub backend: ServerBackend,
    /// Bytes of data regions to export (e.g. 4096, 64MiB, 4GiB); a 1 MiB catalog region
    /// comes on top.
    #[arg(long, value_name = "BYTES", value_parser = parse_bytes)]
    pub size: u64,
    /// Largest data region; `--size` is split into regions of at most this many bytes.
    #[arg(long, value_name = "BYTES", value_parser = parse_bytes, default_value = "1GiB")]
    pub region_size: u64,
    /// File holding the cluster token (`namdb token generate FILE` makes one).
    #[arg(long, value_name = "FILE")]
    pub token_file: PathBuf,
}

/// Backends a memory-server process could serve on. Each must reach other processes:
/// the compute nodes that use the memory are elsewhere.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ServerBackend {
    /// In-process simulation: no other process can reach it.
    Sim,
    /// Soft-NIC over TCP, for hosts without RDMA NICs.
    Tcp,
    /// Shared memory, for processes on one host.
    Shm,
}

/// The device for `backend`, or why there is none. A new backend is one arm here.
fn device(backend: ServerBackend) -> Result<Arc<dyn Device>> {
    match backend {
        ServerBackend::Sim => bail!(
            "the sim backend runs in-process only, so no compute node in another process \
             could reach this server's memory; a memory-server process needs a cross-process \
             backend (tcp or shm), and neither is available yet"
        ),
        ServerBackend::Tcp => bail!(
            "the tcp backend is not available yet (fabric::tcp is being built); \
             no cross-process backend exists in this build"
        ),
        ServerBackend::Shm => bail!(
            "the shm backend is not available yet; no cross-process backend exists in this build"
        ),
    }
}

pub fn run(args: MemoryServerArgs) -> Result<()> {
    let plan = RegionPlan::new(args.size, args.region_size)?;
    let token = ClusterToken::from_file(&args.token_file)?;
    let device = device(args.backend)?;
    let config = ServerConfig::new(args.listen, plan, token);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("namdb-memory-server")
        .enable_all()
        .build()
        .context("cannot start the tokio runtime")?;
    runtime.block_on(async {
        let server = MemoryServer::start(config, device).await?;
        let stats = server.stats();
        // The one line a script waits for (and, with port 0, learns the port from).
        println!(
            "memory server listening on {} (node {}, {} regions, {} bytes)",
            server.local_addr(),
            server.node().0,
            stats.regions,
            stats.bytes_registered
        );
        server.run_until_signal().await?;
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser, Debug)]
    struct Cli {
        #[command(flatten)]
        args: MemoryServerArgs,
    }

    fn parse(extra: &[&str]) -> Result<MemoryServerArgs, clap::Error> {
        let mut argv = vec![
            "memory-server",
            "--listen",
            "127.0.0.1:7700",
            "--backend",
            "tcp",
            "--token-file",
            "/etc/namdb/token",
        ];
        argv.extend_from_slice(extra);
        Cli::try_parse_from(argv).map(|c| c.args)
    }

    #[test]
    fn sizes_take_units_and_region_size_defaults_to_a_gib() {
        let args = parse(&["--size", "3GiB"]).unwrap();
        assert_eq!(args.size, 3 << 30);
        assert_eq!(args.region_size, 1 << 30);
        assert_eq!(args.backend, ServerBackend::Tcp);
        let args = parse(&["--size", "4096", "--region-size", "1k"]).unwrap();
        assert_eq!((args.size, args.region_size), (4096, 1024));
    }

    #[test]
    fn bad_sizes_and_addresses_are_rejected_by_the_parser() {
        let err = parse(&["--size", "12X"]).unwrap_err().to_string();
        assert!(err.contains("12X") && err.contains("unknown unit"), "{err}");
        let err = Cli::try_parse_from([
            "memory-server",
            "--listen",
            "nowhere",
            "--backend",
            "tcp",
            "--size",
            "1M",
            "--token-file",
            "t",
        ])
        .unwrap_err()
        .to_string();
        assert!(err.contains("nowhere"), "{err}");
    }

    #[test]
    fn no_backend_can_serve_a_process_yet() {
        for (backend, says) in [
            (ServerBackend::Sim, "in-process only"),
            (ServerBackend::Tcp, "not available yet"),
            (ServerBackend::Shm, "not available yet"),
        ] {
            let err = device(backend).err().expect("no device").to_string();
            assert!(err.contains(says), "{backend:?}: {err}");
        }
    }
}
