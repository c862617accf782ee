//! `namdb memory-server`: a memory-server process. Validates its arguments, brings up
//! the fabric device for `--backend`, and runs `memory_server::MemoryServer` on it until
//! SIGTERM or SIGINT.

use crate::backend::VerbsOptions;
use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use fabric::shm::ShmDevice;
use fabric::tcp::TcpDevice;
use fabric::{Device, NodeId};
use memory_server::{
    ClusterToken, DurabilityConfig, MemoryServer, RegionPlan, Replication, ServerConfig,
    parse_bytes,
};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

#[derive(Args, Debug)]
pub struct MemoryServerArgs {
    /// Address of the gRPC control plane, host:port (port 0 picks a free port).
    #[arg(long, value_name = "ADDR", value_parser = crate::compute_node_cmd::parse_listen_addr)]
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
    /// Address of the data path (the tcp soft-NIC; for verbs, the TCP endpoint peers
    /// dial to resynchronise a queue pair after an error), host:port, which peers dial:
    /// by default the control plane's host with a free port. With `--listen 0.0.0.0:…`
    /// name this host's reachable address here (e.g. 10.0.0.5:0).
    #[arg(long, value_name = "ADDR", value_parser = crate::compute_node_cmd::parse_listen_addr)]
    pub data_listen: Option<SocketAddr>,
    /// shm only: the Unix socket peers reach the data path at; by default
    /// `namdb-memory-server-<pid>.sock` in the temporary directory.
    #[arg(long, value_name = "PATH")]
    pub socket: Option<PathBuf>,
    /// verbs only: the RDMA device (e.g. mlx5_0, rxe0); the first with an active port
    /// by default.
    #[arg(long, value_name = "NAME")]
    pub rdma_device: Option<String>,
    /// verbs only: the port's GID table index to use (`ibv_devinfo -v` lists them); by
    /// default the first IPv4-mapped RoCE GID, else the first non-empty one.
    #[arg(long, value_name = "N")]
    pub gid_index: Option<u8>,
    /// This server's fabric node id, unique in the cluster; random by default.
    #[arg(long, value_name = "N")]
    pub node: Option<u32>,
    /// Serve the remote-verbs service, which lets any client holding the token drive
    /// this server's fabric device (register memory, create queue pairs, post work
    /// requests). For conformance testing and diagnostics only.
    #[arg(long)]
    pub allow_remote_verbs: bool,
    /// Back every page of the regions before serving, as an RNIC pins registered
    /// memory, rather than at each page's first touch (which then costs whichever
    /// process touches it). Slower start, steadier latency.
    #[arg(long)]
    pub pin_memory: bool,
    /// Seconds a client's session outlives its last RPC (clients renew it at a third of
    /// this): how long a client that died (killed, or its host lost) keeps its queue
    /// pairs and borrowed regions before the server frees them.
    #[arg(long, value_name = "SECS", default_value = "30", value_parser = parse_secs)]
    pub session_lease: Duration,
    /// The most bytes all clients together may borrow (`namdb bench fabric --connect`
    /// writes in a borrowed region), allocated on top of --size; half of --size by
    /// default.
    #[arg(long, value_name = "BYTES", value_parser = parse_bytes)]
    pub max_borrowed: Option<u64>,
    /// Serve Prometheus metrics (plain HTTP, GET /metrics) on host:port; port 0 picks a
    /// free port, printed as `metrics listening on ADDR`.
    #[arg(long, value_name = "ADDR", value_parser = crate::compute_node_cmd::parse_listen_addr)]
    pub metrics_listen: Option<SocketAddr>,
    /// Keep the regions durable in DIR (created if missing): clients' Persist requests
    /// are journaled there, and a restart restores what they persisted. DIR must have
    /// been made with the same --size and --region-size.
    #[arg(long, value_name = "DIR")]
    pub data_dir: Option<PathBuf>,
    /// With --data-dir: seconds between checkpoints (the journal applied to the base
    /// files), e.g. 10 or 0.5.
    #[arg(long, value_name = "SECS", default_value = "10", value_parser = parse_secs, requires = "data_dir")]
    pub checkpoint_interval: Duration,
    /// Serve as a backup: apply the replication stream of the primary that attaches
    /// (started with --backup-at this server's --listen address), refuse compute nodes
    /// until promoted (a compute node promotes it when the primary is unreachable).
    /// Same --size and --region-size as the primary. A --data-dir that was promoted
    /// is refused: restart it as the primary, without --backup.
    #[arg(long, conflicts_with = "backup_at")]
    pub backup: bool,
    /// Replicate to the backup at ADDR (its control-plane host:port): attach and copy
    /// the regions to it before serving, then acknowledge a Persist only once the
    /// backup has it too. Persist then works without --data-dir (it means "on the
    /// backup").
    #[arg(long, value_name = "ADDR")]
    pub backup_at: Option<String>,
    /// Serve as the backup of the promoted server at ADDR (a backup that was promoted
    /// in place of its primary, and so has none): once listening, ask it to attach to
    /// this server (`AttachBackup`) and copy its whole state here while it serves.
    /// Implies --backup. This is how a primary whose backup took over comes back: as
    /// that server's backup, at its old address, so that the compute nodes' `P|B` pair
    /// still names both. Exits with the promoted server's refusal if it takes no backup.
    #[arg(long, value_name = "ADDR", conflicts_with_all = ["backup_at", "resync_delay_ms"])]
    pub backup_of: Option<String>,
    /// With --backup-at, --backup-of or --backup: once the other server of the pair
    /// says it was promoted in this one's place (a compute node promoted it while this
    /// server was stopped, hung or cut off, which fenced this one for good), start
    /// again as that server's backup (as with --backup-of it), in this same process, at
    /// the same addresses and on the same --data-dir, so that the pair holds two copies
    /// again without an operator. Without it such a server stays up failing every
    /// Persist until it is stopped. A --backup knows the other server once, promoted,
    /// it replicates to it.
    #[arg(long)]
    pub rejoin_when_fenced: bool,
    /// Stop (as on SIGTERM) once the process that started this one exits: for servers
    /// a benchmark or the chaos harness runs for itself, which must not outlive it
    /// when it is killed before it can stop them.
    /// PID is the starting process's own: one that died before this server came up
    /// shows as a parent that is not PID.
    #[arg(long, hide = true, value_name = "PID")]
    pub exit_with_parent: Option<u32>,
    /// Testing hook (hidden; see DEVELOPERS.md, "Chaos harness"): with --backup-at,
    /// wait MS before copying the state to a backup attached again after it was lost,
    /// so that it stays unsynced (unpromotable) that long.
    #[arg(long, hide = true, value_name = "MS", requires = "backup_at")]
    pub resync_delay_ms: Option<u64>,
}

/// The default shm socket of a memory server is this, its pid and `.sock`, in the
/// temporary directory: named by pid, so that leftovers of a killed one can be told.
pub const SOCKET_PREFIX: &str = "namdb-memory-server-";

/// Parses a positive number of seconds (fractions allowed).
fn parse_secs(s: &str) -> Result<Duration, String> {
    match s.trim().parse::<f64>() {
        Ok(secs) if secs > 0.0 && secs.is_finite() && secs < 1e9 => {
            Ok(Duration::from_secs_f64(secs))
        }
        _ => Err(format!("`{s}` is not a positive number of seconds")),
    }
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
    /// An RDMA NIC (InfiniBand, RoCE, Soft-RoCE) through rdma-core; `--data-listen`
    /// sets the TCP address peers reach it at to resynchronise queue pairs after errors.
    Verbs,
}

/// Refuses a flag the chosen backend would ignore: a server that silently runs
/// without the address or device it was told to use is found out only when peers
/// cannot reach it.
fn check_backend_flags(args: &MemoryServerArgs) -> Result<()> {
    use ServerBackend::*;
    let backend = format!("{:?}", args.backend).to_lowercase();
    let flags: [(&str, bool, &[ServerBackend]); 4] = [
        ("--data-listen", args.data_listen.is_some(), &[Tcp, Verbs]),
        ("--socket", args.socket.is_some(), &[Shm]),
        ("--rdma-device", args.rdma_device.is_some(), &[Verbs]),
        ("--gid-index", args.gid_index.is_some(), &[Verbs]),
    ];
    for (flag, given, takes) in flags {
        if given && !takes.contains(&args.backend) {
            let which: Vec<String> = takes
                .iter()
                .map(|b| format!("{b:?}").to_lowercase())
                .collect();
            bail!(
                "{flag} is for the {} backend{}, and this server runs --backend {backend}",
                which.join(" and "),
                if which.len() > 1 { "s" } else { "" },
            );
        }
    }
    Ok(())
}

/// The device for `backend`, or why there is none. A new backend is one arm here.
fn device(args: &MemoryServerArgs, token: &ClusterToken) -> Result<Arc<dyn Device>> {
    check_backend_flags(args)?;
    let node = NodeId(args.node.unwrap_or_else(rand::random));
    match args.backend {
        ServerBackend::Sim => bail!(
            "the sim backend runs in-process only, so no compute node in another process \
             could reach this server's memory; use --backend tcp or shm"
        ),
        ServerBackend::Tcp => {
            let data = args
                .data_listen
                .unwrap_or_else(|| SocketAddr::new(args.listen.ip(), 0));
            let device =
                TcpDevice::bind_as(&data.to_string(), token.secret(), node).with_context(|| {
                    format!(
                        "cannot start the tcp data path on {data}; --data-listen sets it to an \
                         address compute nodes can reach"
                    )
                })?;
            Ok(device)
        }
        ServerBackend::Shm => {
            let path = args.socket.clone().unwrap_or_else(|| {
                fabric::shm::sweep_leftovers(&std::env::temp_dir(), SOCKET_PREFIX);
                std::env::temp_dir().join(format!("{SOCKET_PREFIX}{}.sock", std::process::id()))
            });
            let device = ShmDevice::bind_as(&path, token.secret(), node)
                .with_context(|| format!("cannot start the shm data path on {}", path.display()))?;
            Ok(device)
        }
        ServerBackend::Verbs => {
            let resync = args
                .data_listen
                .unwrap_or_else(|| SocketAddr::new(args.listen.ip(), 0));
            let options = VerbsOptions {
                rdma_device: args.rdma_device.clone(),
                gid_index: args.gid_index,
            };
            crate::backend::verbs_device(&options, node, resync, token.secret())
                .context("cannot start the verbs data path")
        }
    }
}

/// Asks the promoted server at `promoted` to take `server` (listening, a backup) as its
/// backup.
async fn attach_to(server: &MemoryServer, promoted: &str, token: &ClusterToken) -> Result<()> {
    let own = server.local_addr();
    if own.ip().is_unspecified() {
        bail!(
            "--backup-of needs --listen on an address the server at {promoted} can reach \
             this one at, not {own}"
        );
    }
    let client = memory_server::Client::connect(promoted, token)
        .await
        .with_context(|| format!("cannot reach the promoted server at {promoted}"))?;
    client
        .attach_backup(&own.to_string())
        .await
        .with_context(|| format!("the server at {promoted} did not take this one as its backup"))?;
    Ok(())
}

/// A memory server's arguments turned into those of the backup of the promoted server
/// at `promoted` (`--backup-of`): its own replication flags go (in either of clap's
/// forms, `--flag value` and `--flag=value`), and it rejoins when fenced in turn.
pub(crate) fn as_backup_of(args: &[String], promoted: &str) -> Vec<String> {
    const VALUED: [&str; 3] = ["--backup-at", "--backup-of", "--resync-delay-ms"];
    let mut out = Vec::with_capacity(args.len() + 3);
    let mut rest = args.iter();
    while let Some(a) = rest.next() {
        let flag = a.split_once('=').map_or(a.as_str(), |(flag, _)| flag);
        match flag {
            "--backup" | "--rejoin-when-fenced" => {}
            f if VALUED.contains(&f) => {
                if !a.contains('=') {
                    rest.next();
                }
            }
            _ => out.push(a.clone()),
        }
    }
    out.extend([
        "--backup-of".to_string(),
        promoted.to_string(),
        "--rejoin-when-fenced".to_string(),
    ]);
    out
}

/// `args` with the value of `flag` (either form) replaced by `value`.
fn with_value(args: &[String], flag: &str, value: &str) -> Vec<String> {
    let joined = format!("{flag}=");
    let mut out = Vec::with_capacity(args.len());
    let mut rest = args.iter();
    while let Some(a) = rest.next() {
        if a == flag {
            out.extend([a.clone(), value.to_string()]);
            rest.next();
        } else if a.starts_with(&joined) {
            out.push(format!("{joined}{value}"));
        } else {
            out.push(a.clone());
        }
    }
    out
}

/// How often a server started with --rejoin-when-fenced asks the other of its pair
/// whether it was promoted.
const PROMOTION_CHECK_EVERY: Duration = Duration::from_secs(1);
/// How long one such question may take (a stopped partner answers nothing).
const PROMOTION_CHECK_LIMIT: Duration = Duration::from_secs(3);

/// Resolves, with the other server's address, once this server (`pair`: its role
/// and the backup it replicates to) serves as a primary or promoted server replicating
/// to a backup that says it was promoted and has no backup of its own: the backup was
/// promoted over this server, which is fenced. Nothing else is taken for that. A
/// server replicating to nobody has nobody who could have been promoted over it (a
/// promoted server without a backup, whose old primary, fenced, still says it is
/// promoted with this one as its backup, is the newer of the two). And a partner that
/// names a backup is either the stale one or has another.
async fn promoted_over(
    token: &ClusterToken,
    pair: impl Fn() -> (memory_server::Role, Option<String>),
) -> String {
    use memory_server::{Client, Role};
    // One session at the partner, asked again with a Hello each time; a new one only
    // once it fails (the partner restarted) or the partner is another.
    let mut asking: Option<Client> = None;
    loop {
        tokio::time::sleep(PROMOTION_CHECK_EVERY).await;
        let (Role::Primary | Role::Promoted, Some(partner)) = pair() else {
            continue;
        };
        let ask = async {
            let client = match asking.take() {
                Some(c) if c.addr() == partner => c,
                _ => Client::connect(&partner, token).await?,
            };
            let info = client.hello_again(token).await?;
            asking = Some(client);
            Ok::<_, memory_server::ClientError>(info)
        };
        let Ok(Ok(info)) = tokio::time::timeout(PROMOTION_CHECK_LIMIT, ask).await else {
            continue;
        };
        if info.role == Role::Promoted && info.backup_at.is_none() {
            return partner;
        }
    }
}

/// Replaces this process with `namdb memory-server` as the backup of `promoted`: the
/// same arguments (`args`, this process's own) turned by [`as_backup_of`], with the
/// control plane (`listen`) and metrics (`metrics`) at the addresses this one had, so
/// a port 0 stays the port the pair's compute nodes know. Returns only on failure.
fn exec_as_backup_of(
    args: &[String],
    promoted: &str,
    listen: SocketAddr,
    metrics: Option<SocketAddr>,
) -> anyhow::Error {
    use std::os::unix::process::CommandExt;
    let mut argv = with_value(
        &as_backup_of(args, promoted),
        "--listen",
        &listen.to_string(),
    );
    if let Some(metrics) = metrics {
        argv = with_value(&argv, "--metrics-listen", &metrics.to_string());
    }
    let exe = match std::env::current_exe() {
        Ok(exe) => exe,
        Err(e) => return anyhow::anyhow!("cannot find the namdb executable: {e}"),
    };
    let e = std::process::Command::new(exe).args(&argv).exec();
    anyhow::anyhow!("cannot start again as the backup of {promoted}: {e}")
}

/// Whether this process's parent is still the process `pid`.
fn parent_is(pid: u32) -> bool {
    rustix::process::getppid().is_some_and(|p| p.as_raw_nonzero().get() as u32 == pid)
}

pub fn run(args: MemoryServerArgs) -> Result<()> {
    if let Some(parent) = args.exit_with_parent
        && !parent_is(parent)
    {
        bail!("the process that started this memory server (pid {parent}) has exited");
    }
    let replicated = args.backup_at.is_some() || args.backup_of.is_some() || args.backup;
    if args.rejoin_when_fenced && !replicated {
        bail!(
            "--rejoin-when-fenced is for a server of a replicated pair: --backup-at ADDR, \
             --backup-of ADDR or --backup"
        );
    }
    let plan = RegionPlan::new(args.size, args.region_size)?;
    let token = ClusterToken::from_file(&args.token_file)?;
    let device = device(&args, &token)?;
    let mut config = ServerConfig::new(args.listen, plan, token.clone());
    config.allow_remote_verbs = args.allow_remote_verbs;
    config.pin_memory = args.pin_memory;
    config.session_lease = args.session_lease;
    config.max_borrowed = args.max_borrowed;
    config.resync_delay = Duration::from_millis(args.resync_delay_ms.unwrap_or(0));
    config.durability = args.data_dir.as_ref().map(|dir| DurabilityConfig {
        checkpoint_interval: args.checkpoint_interval,
        ..DurabilityConfig::new(dir)
    });
    config.replication = match (&args.backup_at, args.backup || args.backup_of.is_some()) {
        (Some(addr), _) => Replication::Primary {
            backup_at: addr.clone(),
        },
        (None, true) => Replication::Backup,
        (None, false) => Replication::Standalone,
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("namdb-memory-server")
        .enable_all()
        .build()
        .context("cannot start the tokio runtime")?;
    let data_path = device.address();
    let rejoin = runtime.block_on(async {
        let server = MemoryServer::start(config, device).await?;
        let mut metrics = None;
        if let Some(listen) = args.metrics_listen {
            let stats = Arc::new(server.stats_source());
            let render: crate::metrics::Render = Arc::new(move || {
                let text = crate::metrics::memory_server_text(&stats());
                Box::pin(async move { text })
            });
            metrics = Some(crate::metrics::serve(listen, render).await?);
        }
        let stats = server.stats();
        // Installed before the line below: a script may send SIGTERM as soon as it
        // reads it, and must get the clean shutdown.
        let signal = memory_server::listen_for_signals()?;
        let durable = match server.durability() {
            Some(r) if r.boot == 1 => format!(", data dir {} new (boot 1)", r.dir.display()),
            Some(r) => format!(
                ", data dir {} restored (boot {}, {} bytes from base files, {} journal entries)",
                r.dir.display(),
                r.boot,
                r.base_bytes,
                r.entries
            ),
            None => String::new(),
        };
        if let Some(promoted) = &args.backup_of
            && let Err(e) = attach_to(&server, promoted, &token).await
        {
            if let Err(stop) = server.shutdown().await {
                tracing::warn!("stopping after the failed attach: {stop}");
            }
            return Err(e);
        }
        let durable = match (&args.backup_at, args.backup, &args.backup_of) {
            (Some(addr), _, _) => format!("{durable}, primary of backup {addr}"),
            (None, _, Some(addr)) => format!(
                "{durable}, backup of the promoted server at {addr}, which copies its state here"
            ),
            (None, true, None) => format!("{durable}, backup"),
            (None, false, None) => durable,
        };
        // The one line a script waits for (and, with port 0, learns the port from).
        println!(
            "memory server listening on {} (node {}, {} regions, {} bytes, data path {}{durable})",
            server.local_addr(),
            server.node().0,
            stats.regions,
            stats.bytes_registered,
            data_path
        );
        let own = server.local_addr();
        let orphaned = async move {
            let Some(parent) = args.exit_with_parent else {
                return std::future::pending().await;
            };
            // Reparented (to init or a subreaper) once the parent is gone.
            while parent_is(parent) {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Ok("the exit of the process that started it")
        };
        let fenced = std::cell::OnceCell::new();
        let pair = server.pair_source();
        let promoted = async {
            if !args.rejoin_when_fenced {
                return std::future::pending().await;
            }
            let over = promoted_over(&token, pair).await;
            let _ = fenced.set(over);
            Ok("the promotion of the other server of its pair")
        };
        server
            .run_until(async {
                tokio::select! {
                    s = signal => s,
                    s = orphaned => s,
                    s = promoted => s,
                }
            })
            .await?;
        anyhow::Ok(fenced.into_inner().map(|promoted| (promoted, own, metrics)))
    })?;
    drop(runtime);
    if let Some((promoted, listen, metrics)) = rejoin {
        // Said before the process is replaced: its log is this one's.
        eprintln!(
            "the server at {promoted} was promoted in this one's place, which fenced this \
             one: starting again at {listen} as its backup (--backup-of {promoted})"
        );
        // Every argument after the program's name, the subcommand included, wherever
        // global options put it.
        let Ok(args) = std::env::args_os()
            .skip(1)
            .map(|a| a.into_string())
            .collect::<Result<Vec<String>, _>>()
        else {
            bail!("cannot start again as the backup of {promoted}: an argument is not UTF-8");
        };
        return Err(exec_as_backup_of(&args, &promoted, listen, metrics));
    }
    Ok(())
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

    fn strings(args: &[&str]) -> Vec<String> {
        args.iter().map(|a| a.to_string()).collect()
    }

    /// A primary's arguments, in both of clap's forms, become a backup's of the
    /// promoted server: replication flags go, the rest stays in order, and the result
    /// is a command line clap takes (a stale `--backup-at` next to `--backup-of` would
    /// be refused as conflicting, and the restart would fail).
    #[test]
    fn a_primarys_arguments_become_those_of_the_promoted_servers_backup() {
        let primary = strings(&[
            "memory-server",
            "--listen",
            "127.0.0.1:0",
            "--backup-at=127.0.0.1:7701",
            "--resync-delay-ms",
            "5",
            "--rejoin-when-fenced",
            "--data-dir",
            "/d",
        ]);
        let backup = as_backup_of(&primary, "127.0.0.1:7701");
        assert_eq!(
            backup,
            strings(&[
                "memory-server",
                "--listen",
                "127.0.0.1:0",
                "--data-dir",
                "/d",
                "--backup-of",
                "127.0.0.1:7701",
                "--rejoin-when-fenced",
            ])
        );
        let rebound = with_value(&backup, "--listen", "127.0.0.1:7700");
        assert_eq!(rebound[1..3], strings(&["--listen", "127.0.0.1:7700"]));
        assert_eq!(
            with_value(
                &strings(&["--metrics-listen=127.0.0.1:0"]),
                "--metrics-listen",
                "127.0.0.1:9"
            ),
            strings(&["--metrics-listen=127.0.0.1:9"])
        );
        // clap's first item is the program's name, which the subcommand stands in for.
        let args = Cli::try_parse_from(rebound.iter().map(String::as_str).chain([
            "--backend",
            "tcp",
            "--size",
            "1M",
            "--token-file",
            "/t",
        ]));
        let args = args.unwrap().args;
        assert_eq!(args.backup_of.as_deref(), Some("127.0.0.1:7701"));
        assert!(args.rejoin_when_fenced && args.backup_at.is_none() && !args.backup);
        assert_eq!(args.data_dir, Some(PathBuf::from("/d")));
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
    fn data_dir_and_checkpoint_interval_parse() {
        let args = parse(&["--size", "1M"]).unwrap();
        assert_eq!(args.data_dir, None);
        let args = parse(&["--size", "1M", "--data-dir", "/var/lib/namdb/ms0"]).unwrap();
        assert_eq!(args.data_dir, Some(PathBuf::from("/var/lib/namdb/ms0")));
        assert_eq!(args.checkpoint_interval, Duration::from_secs(10));
        let args = parse(&[
            "--size",
            "1M",
            "--data-dir",
            "d",
            "--checkpoint-interval",
            "0.25",
        ])
        .unwrap();
        assert_eq!(args.checkpoint_interval, Duration::from_millis(250));
        let err = parse(&[
            "--size",
            "1M",
            "--data-dir",
            "d",
            "--checkpoint-interval",
            "0",
        ])
        .unwrap_err()
        .to_string();
        assert!(err.contains("positive number of seconds"), "{err}");
        // An interval without a directory is a mistake worth naming.
        let err = parse(&["--size", "1M", "--checkpoint-interval", "5"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("--data-dir"), "{err}");
    }

    #[test]
    fn replication_flags_parse_and_exclude_each_other() {
        let args = parse(&["--size", "1M"]).unwrap();
        assert!(!args.backup && args.backup_at.is_none());
        assert!(parse(&["--size", "1M", "--backup"]).unwrap().backup);
        let args = parse(&["--size", "1M", "--backup-at", "10.0.0.2:7701"]).unwrap();
        assert_eq!(args.backup_at.as_deref(), Some("10.0.0.2:7701"));
        let err = parse(&["--size", "1M", "--backup", "--backup-at", "h:1"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("--backup"), "{err}");
        let args = parse(&["--size", "1M", "--backup-of", "127.0.0.1:7701"]).unwrap();
        assert_eq!(args.backup_of.as_deref(), Some("127.0.0.1:7701"));
        let err = parse(&["--size", "1M", "--backup-of", "h:1", "--backup-at", "h:2"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("--backup-at"), "{err}");
    }

    #[test]
    fn remote_verbs_are_off_unless_asked_for() {
        assert!(!parse(&["--size", "1M"]).unwrap().allow_remote_verbs);
        let args = parse(&["--size", "1M", "--allow-remote-verbs"]).unwrap();
        assert!(args.allow_remote_verbs);
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
    fn backends_that_cannot_serve_a_process_say_so() {
        let token = ClusterToken::new("0123456789abcdef0123456789abcdef").unwrap();
        {
            let (backend, says) = (ServerBackend::Sim, "in-process only");
            let mut args = parse(&["--size", "1M"]).unwrap();
            args.backend = backend;
            let err = device(&args, &token).err().expect("no device").to_string();
            assert!(err.contains(says), "{backend:?}: {err}");
        }
    }

    #[test]
    fn verbs_says_what_is_missing() {
        let token = ClusterToken::new("0123456789abcdef0123456789abcdef").unwrap();
        let mut args = parse(&["--size", "1M"]).unwrap();
        args.backend = ServerBackend::Verbs;
        match device(&args, &token) {
            // A host with an RDMA device.
            Ok(device) => assert_eq!(device.backend(), "verbs"),
            Err(e) => {
                let said = format!("{e:#}");
                let missing = if cfg!(feature = "verbs") {
                    "no RDMA device found"
                } else {
                    "--features verbs"
                };
                assert!(said.contains(missing), "{said}");
            }
        }
    }

    #[test]
    fn shm_serves_on_the_chosen_socket() {
        let token = ClusterToken::new("0123456789abcdef0123456789abcdef").unwrap();
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("ms.sock");
        let mut args = parse(&["--size", "1M", "--node", "7"]).unwrap();
        args.backend = ServerBackend::Shm;
        args.socket = Some(socket.clone());
        let device = device(&args, &token).unwrap();
        assert_eq!(device.node(), NodeId(7));
        assert_eq!(device.address(), format!("shm:{}", socket.display()));
    }

    #[test]
    fn tcp_serves_on_the_data_address_with_the_chosen_node() {
        let token = ClusterToken::new("0123456789abcdef0123456789abcdef").unwrap();
        let mut args = parse(&["--size", "1M", "--node", "42"]).unwrap();
        args.listen = "127.0.0.1:0".parse().unwrap();
        let device = device(&args, &token).unwrap();
        assert_eq!(device.node(), NodeId(42));
        assert!(
            device.address().starts_with("tcp:127.0.0.1:"),
            "{}",
            device.address()
        );
    }
}
