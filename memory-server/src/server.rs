//! The memory server's lifecycle: allocate and register regions, serve the control
//! plane, expire sessions, and stop cleanly.

use crate::auth::Authenticator;
use crate::durable::{Copier, DurabilityConfig, Durable, RestoreReport};
use crate::proto::memory_server_server::MemoryServerServer;
use crate::proto::remote_verbs_server::RemoteVerbsServer;
use crate::regions::{self, AllocError, RegionDirectory, RegionPlan};
use crate::replica::{Backup, MAX_APPLY_BYTES, Replication, Replicator, Role, StreamTo};
use crate::service::{ControlService, ServerState};
use crate::session::{BorrowLedger, ObjectLimits, Sessions};
use crate::stats::{Counters, Stats};
use crate::token::ClusterToken;
use crate::unknown_method::{Catalog, KnownMethods};
use crate::verbs_service::{self, VerbsService};
use fabric::{Device, FabricError, NodeId};
use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};
use thiserror::Error;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tonic::service::Routes;
use tonic::transport::server::TcpIncoming;

/// How long shutdown waits for in-flight RPCs before closing connections anyway.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// How a memory server runs. The fabric device is not part of it: the caller builds the
/// device for its backend and hands it to [`MemoryServer::start`].
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// The control plane's address; port 0 picks a free port ([`MemoryServer::local_addr`]).
    pub listen: SocketAddr,
    pub plan: RegionPlan,
    pub token: ClusterToken,
    /// A session ends this long after its last RPC.
    pub session_lease: Duration,
    pub max_sessions: usize,
    pub max_qps_per_session: usize,
    /// Serve the remote-verbs service: any client holding the token may then drive the
    /// server's device (register memory, create and post on queue pairs). For
    /// conformance testing and diagnostics; off by default.
    pub allow_remote_verbs: bool,
    /// The most bytes of regions one session may hold: borrowed (BorrowRegion) and
    /// registered through remote verbs.
    pub remote_verbs_bytes: u64,
    /// The most bytes all sessions together may hold in borrowed regions (BorrowRegion),
    /// which are allocated on top of the data regions; `None`, the default, is half of
    /// the data regions' size ([`ServerConfig::default_max_borrowed`]).
    pub max_borrowed: Option<u64>,
    /// Keep region contents on disk (Persist, restore on start); `None`, the default,
    /// keeps nothing and refuses Persist.
    pub durability: Option<DurabilityConfig>,
    /// Whether the server is a replicated primary, a backup, or neither (the default).
    pub replication: Replication,
    /// Back every page of the regions before serving, as an RNIC pins registered
    /// memory: otherwise the kernel zeroes each page at its first touch, in whichever
    /// process touches it first. Off by default: it costs the whole size in memory at
    /// once, and the start takes longer (seconds per GiB on some hosts).
    pub pin_memory: bool,
    /// A testing hook (zero, the default, in any real use): a primary that attaches
    /// *again* to a backup it lost waits this long before copying its state there,
    /// acknowledging Persists meanwhile, so the backup stays unsynced (unpromotable)
    /// for that long. `namdb chaos` tests its handling of a failover whose backup does
    /// not sync in time with it.
    pub resync_delay: Duration,
}

impl ServerConfig {
    pub const DEFAULT_SESSION_LEASE: Duration = Duration::from_secs(30);
    pub const DEFAULT_MAX_SESSIONS: usize = 1024;
    pub const DEFAULT_MAX_QPS_PER_SESSION: usize = 1024;
    pub const DEFAULT_REMOTE_VERBS_BYTES: u64 = 1 << 30;

    pub fn new(listen: SocketAddr, plan: RegionPlan, token: ClusterToken) -> ServerConfig {
        ServerConfig {
            listen,
            plan,
            token,
            session_lease: Self::DEFAULT_SESSION_LEASE,
            max_sessions: Self::DEFAULT_MAX_SESSIONS,
            max_qps_per_session: Self::DEFAULT_MAX_QPS_PER_SESSION,
            allow_remote_verbs: false,
            remote_verbs_bytes: Self::DEFAULT_REMOTE_VERBS_BYTES,
            max_borrowed: None,
            durability: None,
            replication: Replication::Standalone,
            pin_memory: false,
            resync_delay: Duration::ZERO,
        }
    }

    /// Half of the data regions' size: borrowing can add at most half again to the
    /// memory the server takes from its host, however many sessions borrow.
    pub fn default_max_borrowed(plan: &RegionPlan) -> u64 {
        plan.data_bytes() / 2
    }
}

#[derive(Debug, Error)]
pub enum ServerError {
    #[error(transparent)]
    Regions(#[from] AllocError),
    #[error("the {backend} device cannot {what}: {source}")]
    Device {
        backend: &'static str,
        what: &'static str,
        #[source]
        source: FabricError,
    },
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("the control plane failed: {0}")]
    Serve(#[from] tonic::transport::Error),
    #[error("the control plane task failed: {0}")]
    Task(String),
    #[error("cannot install signal handlers: {0}")]
    Signal(#[source] std::io::Error),
    #[error("session_lease must be at least 1 ms")]
    Lease,
    #[error("{0}")]
    Durability(String),
    #[error("{0}")]
    Replication(String),
}

/// Refuses to start a backup on a data directory that records a promotion: that
/// directory holds the newest copy of its data, and the state transfer of the primary
/// attaching to it (its old primary, restarted) would overwrite it with older data.
fn refuse_promoted_backup(dir: &std::path::Path) -> Result<(), ServerError> {
    match crate::durable::recorded_promotion(dir).map_err(ServerError::Durability)? {
        None => Ok(()),
        Some(p) => Err(ServerError::Durability(format!(
            "the data directory {} was promoted to primary on {} (replication epoch {}): it \
             holds data newer than its old primary's, which would overwrite it if it started \
             as a backup. Start it without --backup, as the primary, and give it a new \
             backup with --backup-at (its old primary's data directory will do: a backup \
             receives the primary's whole state)",
            dir.display(),
            p.at_utc(),
            p.epoch
        ))),
    }
}

/// A running memory server. Dropping it stops the control plane and destroys its queue
/// pairs; [`MemoryServer::shutdown`] does the same and waits for it.
pub struct MemoryServer {
    state: Arc<ServerState>,
    local_addr: SocketAddr,
    shutdown: Option<oneshot::Sender<()>>,
    serve: Option<JoinHandle<Result<(), tonic::transport::Error>>>,
    reaper: JoinHandle<()>,
}

impl MemoryServer {
    /// Allocates and registers the planned regions on `device`, then serves the control
    /// plane on `config.listen`. Must be called within a tokio runtime.
    pub async fn start(
        config: ServerConfig,
        device: Arc<dyn Device>,
    ) -> Result<MemoryServer, ServerError> {
        if config.session_lease < Duration::from_millis(1) {
            return Err(ServerError::Lease);
        }
        let backend = device.backend();
        if let (Replication::Backup, Some(d)) = (&config.replication, &config.durability) {
            refuse_promoted_backup(&d.dir)?;
        }
        // Allocation reserves every page (fallocate; with `pin_memory` it also backs
        // them) and registration may pin memory: seconds for large servers, so it runs
        // off the async workers.
        // A durable server restores the regions here, before anyone can learn where
        // they are (the control plane is not listening yet).
        let (served, durable) = {
            let (plan, device) = (config.plan.clone(), device.clone());
            let durability = config.durability.clone();
            let pin = config.pin_memory;
            tokio::task::spawn_blocking(move || -> Result<_, ServerError> {
                let started = std::time::Instant::now();
                let served = regions::create(&plan, &*device, pin)?;
                if pin {
                    tracing::info!(
                        "pinned {} MiB of regions in {:.1} s",
                        plan.total_bytes() >> 20,
                        started.elapsed().as_secs_f64()
                    );
                }
                let durable = durability
                    .map(|d| Durable::open(&d, &plan, &served).map(Arc::new))
                    .transpose()
                    .map_err(ServerError::Durability)?;
                Ok((Arc::new(served), durable))
            })
            .await
            .map_err(|e| ServerError::Task(format!("region allocation failed: {e}")))??
        };
        if let Some(report) = durable.as_ref().map(|d| d.report()) {
            tracing::info!(
                dir = %report.dir.display(),
                boot = report.boot,
                base_bytes = report.base_bytes,
                journals = report.journals,
                journal_batches = report.batches,
                journal_entries = report.entries,
                journal_bytes = report.journal_bytes,
                torn_bytes = report.torn_bytes,
                elapsed_ms = report.elapsed.as_millis() as u64,
                "{}",
                if report.boot == 1 { "data directory created" } else { "data directory restored" }
            );
        }
        // A primary hands its backup the whole state before it listens: nobody can
        // write the regions during the transfer.
        let sessions = Arc::new(Sessions::new(config.session_lease, config.max_sessions));
        let replica = match &config.replication {
            Replication::Primary { backup_at } => {
                let boot = durable.as_ref().map_or(1, |d| d.boot());
                let epoch = durable.as_ref().map_or(0, |d| d.epoch());
                // The transfer clears a promotion the directory records: the backup
                // holds this server's whole state from then on.
                let replica = Replicator::start(StreamTo {
                    addr: backup_at.clone(),
                    token: config.token.clone(),
                    regions: served.clone(),
                    sessions: sessions.clone(),
                    boot,
                    epoch,
                    durable: durable.clone(),
                    resync_delay: config.resync_delay,
                })
                .await
                .map_err(ServerError::Replication)?;
                Some(replica)
            }
            _ => None,
        };
        let backup = (config.replication == Replication::Backup).then(|| {
            Backup::new(
                durable
                    .as_ref()
                    .is_none_or(|d| d.report().base_bytes == 0 && d.report().entries == 0),
                durable.as_ref().map_or(0, |d| d.epoch()),
            )
        });
        let guard_wait = config
            .durability
            .as_ref()
            .map_or(DurabilityConfig::DEFAULT_GUARD_WAIT, |d| d.guard_wait);
        let copier = Copier::new(&served, guard_wait);
        let cq = device.create_cq(64).map_err(|source| ServerError::Device {
            backend,
            what: "create a completion queue",
            source,
        })?;
        let listener = tokio::net::TcpListener::bind(config.listen)
            .await
            .map_err(|source| ServerError::Listen {
                addr: config.listen,
                source,
            })?;
        let local_addr = listener
            .local_addr()
            .map_err(|source| ServerError::Listen {
                addr: config.listen,
                source,
            })?;
        let directory = regions::directory(&served, device.node());
        let state = Arc::new(ServerState {
            device,
            cq,
            regions: served,
            directory,
            auth: Authenticator::new(
                config.token.clone(),
                Authenticator::DEFAULT_TTL,
                Authenticator::DEFAULT_MAX_PENDING,
            ),
            sessions: sessions.clone(),
            counters: Counters::default(),
            started: Instant::now(),
            max_qps_per_session: config.max_qps_per_session,
            pin_memory: config.pin_memory,
            allow_remote_verbs: config.allow_remote_verbs,
            verbs_limits: ObjectLimits {
                cqs: verbs_service::MAX_CQS_PER_SESSION,
                regions: verbs_service::MAX_REGIONS_PER_SESSION,
                region_bytes: config.remote_verbs_bytes,
            },
            borrowed: BorrowLedger::new(
                config
                    .max_borrowed
                    .unwrap_or_else(|| ServerConfig::default_max_borrowed(&config.plan)),
            ),
            durable,
            replica: replica.map(OnceLock::from).unwrap_or_default(),
            attaching: tokio::sync::Mutex::new(()),
            backup,
            copier,
            token: config.token,
            resync_delay: config.resync_delay,
        });
        // TCP keepalive lets the kernel notice a vanished peer host without the peer's
        // process doing anything, so even an idle connection does not linger forever.
        let incoming = TcpIncoming::from(listener)
            .with_nodelay(Some(true))
            .with_keepalive(Some(Duration::from_secs(60)));
        let (tx, rx) = oneshot::channel::<()>();
        // A backup receives whole batches of Persists in one ReplicaApply.
        let service = MemoryServerServer::new(ControlService::new(state.clone()))
            .max_decoding_message_size(MAX_APPLY_BYTES);
        // Always served, so that a client asking for it while it is off learns why.
        let verbs = RemoteVerbsServer::new(VerbsService::new(state.clone()));
        let catalog = Arc::new(Catalog::new(
            crate::proto::FILE_DESCRIPTOR_SET,
            "memory-server/proto",
            &[
                crate::proto::memory_server_server::SERVICE_NAME,
                crate::proto::remote_verbs_server::SERVICE_NAME,
            ],
        ));
        let routes = Routes::new(KnownMethods::new(service, catalog.clone()))
            .add_service(KnownMethods::new(verbs, catalog.clone()));
        let serve = tokio::spawn(
            tonic::transport::Server::builder()
                .add_routes(catalog.fallback(routes))
                .serve_with_incoming_shutdown(incoming, async {
                    // A dropped sender (the server was dropped) also means stop.
                    let _ = rx.await;
                }),
        );
        let reaper = tokio::spawn(reap(state.clone()));
        if state.allow_remote_verbs {
            tracing::warn!(
                "remote verbs are on: any client holding the cluster token can drive this server's device (for conformance testing and diagnostics only)"
            );
        }
        let stats = state.stats();
        tracing::info!(
            %local_addr,
            node = %state.device.node(),
            backend = state.device.backend(),
            address = %state.device.address(),
            regions = stats.regions,
            bytes = stats.bytes_registered,
            huge_page_regions = stats.huge_page_regions,
            max_borrowed = state.borrowed.max(),
            "memory server started"
        );
        Ok(MemoryServer {
            state,
            local_addr,
            shutdown: Some(tx),
            serve: Some(serve),
            reaper,
        })
    }

    /// Where the control plane listens.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The server device's node.
    pub fn node(&self) -> NodeId {
        self.state.device.node()
    }

    pub fn directory(&self) -> &RegionDirectory {
        &self.state.directory
    }

    pub fn stats(&self) -> Stats {
        self.state.stats()
    }

    /// What a durable server restored from its data directory at start; `None` when
    /// it keeps none.
    pub fn durability(&self) -> Option<&RestoreReport> {
        self.state.durable.as_ref().map(|d| d.report())
    }

    /// What the server is in replication now.
    pub fn role(&self) -> Role {
        self.state.role()
    }

    /// Hello's boot now (see the protocol's `HelloResponse.boot`).
    pub fn boot(&self) -> u64 {
        self.state.boot()
    }

    /// A function that takes [`MemoryServer::stats`] while the server runs (for a
    /// metrics endpoint, which outlives the borrow `run_until_signal` takes).
    pub fn stats_source(&self) -> impl Fn() -> Stats + Send + Sync + 'static {
        let state = self.state.clone();
        move || state.stats()
    }

    /// A function that takes, while the server runs, its [`MemoryServer::role`] and
    /// the address of the backup it replicates to, if any (a primary's, or a promoted
    /// server's once it took one).
    pub fn pair_source(&self) -> impl Fn() -> (Role, Option<String>) + Send + Sync + 'static {
        let state = self.state.clone();
        move || {
            let backup_at = state.replica.get().map(|r| r.addr().to_string());
            (state.role(), backup_at)
        }
    }

    /// Stops accepting RPCs, lets in-flight ones finish (for at most a few seconds),
    /// ends every session and destroys every queue pair.
    pub async fn shutdown(mut self) -> Result<(), ServerError> {
        self.stop_and_wait().await
    }

    /// Serves until SIGTERM or SIGINT, then shuts down as [`MemoryServer::shutdown`].
    /// Returns early with an error if the control plane fails on its own.
    pub async fn run_until_signal(self) -> Result<(), ServerError> {
        let signal = listen_for_signals()?;
        self.run_until(signal).await
    }

    /// As [`MemoryServer::run_until_signal`], with the wait from
    /// [`listen_for_signals`] made before the server said it is listening.
    pub async fn run_until(
        mut self,
        signal: impl Future<Output = Result<&'static str, ServerError>>,
    ) -> Result<(), ServerError> {
        let Some(serve) = self.serve.as_mut() else {
            return self.stop_and_wait().await;
        };
        let finished = tokio::select! {
            signal = signal => {
                tracing::info!("{} received; shutting down", signal?);
                None
            }
            finished = serve => Some(finished),
        };
        if let Some(finished) = finished {
            self.serve = None;
            self.stop_and_wait().await?;
            return match finished {
                Ok(Ok(())) => Err(ServerError::Task(
                    "the control plane stopped unexpectedly".into(),
                )),
                Ok(Err(e)) => Err(ServerError::Serve(e)),
                Err(e) => Err(ServerError::Task(e.to_string())),
            };
        }
        self.stop_and_wait().await
    }

    async fn stop_and_wait(&mut self) -> Result<(), ServerError> {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        self.reaper.abort();
        let mut result = Ok(());
        if let Some(mut serve) = self.serve.take() {
            match tokio::time::timeout(SHUTDOWN_GRACE, &mut serve).await {
                Ok(Ok(r)) => result = r.map_err(ServerError::Serve),
                Ok(Err(e)) => result = Err(ServerError::Task(e.to_string())),
                Err(_) => {
                    tracing::warn!(
                        "RPCs still in flight after {SHUTDOWN_GRACE:?}; closing their connections"
                    );
                    serve.abort();
                }
            }
        }
        // Bounded: destroying a queue pair waits for a request its peer is executing
        // in this server's memory, and a peer stopped in the middle of one (SIGSTOP)
        // would hold the shutdown for as long as it stays stopped.
        let state = self.state.clone();
        let ending = tokio::task::spawn_blocking(move || state.sessions.end_all());
        let (sessions, qps) = match tokio::time::timeout(SHUTDOWN_GRACE, ending).await {
            Ok(Ok(ended)) => ended,
            Ok(Err(e)) => {
                tracing::warn!("ending the sessions failed: {e}");
                (0, 0)
            }
            Err(_) => {
                tracing::warn!(
                    "a client stopped in the middle of a request still holds its queue pair \
                     after {SHUTDOWN_GRACE:?}; stopping without it"
                );
                (0, 0)
            }
        };
        if let Some(replica) = self.state.replica.get() {
            replica.detach().await;
        }
        if let Some(durable) = self.state.durable.clone() {
            // The last checkpoint leaves the next start little to replay.
            let closed = tokio::task::spawn_blocking(move || durable.close())
                .await
                .map_err(|e| ServerError::Task(e.to_string()))
                .and_then(|r| r.map_err(ServerError::Durability));
            if let Err(e) = closed {
                tracing::warn!("the last checkpoint failed (the journal keeps everything): {e}");
                if result.is_ok() {
                    result = Err(e);
                }
            }
        }
        tracing::info!(
            local_addr = %self.local_addr,
            sessions,
            queue_pairs = qps,
            "memory server stopped"
        );
        result
    }
}

impl Drop for MemoryServer {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        self.reaper.abort();
        self.state.sessions.end_all();
        if let Some(durable) = &self.state.durable {
            durable.abandon();
        }
    }
}

/// Ends sessions whose lease ran out and forgets expired handshakes.
async fn reap(state: Arc<ServerState>) {
    let period =
        (state.sessions.lease() / 4).clamp(Duration::from_millis(5), Duration::from_secs(1));
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let now = Instant::now();
        state.auth.purge(now);
        // Off the runtime's threads: destroying a queue pair waits for a request its
        // peer is executing in this server's memory (shm: on the peer's own CPU, for
        // as long as a stopped peer stays stopped there).
        let reaping = state.clone();
        let _ = tokio::task::spawn_blocking(move || reaping.sessions.reap(now)).await;
    }
}

/// Waits for SIGTERM or SIGINT and names the one that came.
pub async fn wait_for_signal() -> Result<&'static str, ServerError> {
    listen_for_signals()?.await
}

/// Installs the SIGTERM and SIGINT handlers now and returns the wait for the first
/// signal. A server calls it before it announces that it is ready: a future that
/// installed them only when first polled would leave a window after the announcement
/// in which SIGTERM still kills the process outright, skipping the clean shutdown.
pub fn listen_for_signals()
-> Result<impl Future<Output = Result<&'static str, ServerError>>, ServerError> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = signal(SignalKind::terminate()).map_err(ServerError::Signal)?;
        let mut int = signal(SignalKind::interrupt()).map_err(ServerError::Signal)?;
        Ok(async move {
            tokio::select! {
                _ = term.recv() => Ok("SIGTERM"),
                _ = int.recv() => Ok("SIGINT"),
            }
        })
    }
    #[cfg(not(unix))]
    {
        Ok(async {
            tokio::signal::ctrl_c().await.map_err(ServerError::Signal)?;
            Ok("Ctrl-C")
        })
    }
}
