//! Reconnecting to the memory servers.
//!
//! Once a memory server restarts or fails over, every queue pair to it is dead, and so
//! is the [`txn::Database`] (and the [`Pool`] on it) opened before: only a new
//! [`connect`] works, whose first opener repairs what the restart lost. A [`Node`]
//! holds the database and pool the API serves from, and a monitor thread replaces
//! both when a memory server went away:
//!
//! - every [`CHECK_EVERY`] it renews the control session of each memory server (a
//!   killed or restarted server forgets the session: the renewal fails);
//! - after a burst of transport failures of transactions (UNAVAILABLE or UNKNOWN from
//!   the workers) it also says Hello anew, and reconnects if a server's `boot` changed
//!   or a replicated server's backup was promoted (by another compute node) while this
//!   one still uses the fenced primary, whose session stays alive.
//!
//! Reconnecting retires the old pool (its in-flight requests fail with their own
//! errors; it is dropped on a thread of its own once the last of them let go, since a
//! worker may wait on a dead fabric) and calls [`connect`] until it succeeds, with
//! backoff. Meanwhile calls get UNAVAILABLE ("reconnecting to the memory servers: …").

use crate::memory_servers::{
    BackupView, ConnectError, PRIMARY_ANSWER_LIMIT, RemoteCluster, ask_backup, backup_of, connect,
};
use crate::pool::{Pool, STATS_WAIT, WorkerStats};
use memory_server::ClusterToken;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use tonic::Status;
use txn::MemoryServerLink;

/// How often the monitor renews each memory server's control session.
pub const CHECK_EVERY: Duration = Duration::from_millis(100);
/// How long after a reconnect began the old connection's Persists still pending are
/// given up ([`crate::memory_servers::RemoteServer::give_up_persists`]).
const GIVE_UP_PERSISTS_AFTER: Duration = Duration::from_secs(5);
/// Transport failures within one check period that make the monitor look deeper.
const BURST: u64 = 4;
/// The first and the longest wait between two failed connection attempts.
const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(2);

/// What a (re)connection needs.
#[derive(Clone)]
pub struct Config {
    /// The memory servers, as [`connect`] takes them.
    pub addrs: Vec<String>,
    pub token: ClusterToken,
    pub options: txn::Options,
    pub workers: usize,
    /// Start fewer workers (at least one) if the oracle has no free slot for all.
    pub fewer_workers_ok: bool,
    pub idle_timeout: Duration,
}

/// One connection to the memory servers: the database and the workers on it.
pub struct Live {
    // Declared first so that it drops first: the workers end before the sessions their
    // queue pairs were made on.
    pub pool: Arc<Pool>,
    pub cluster: RemoteCluster,
    /// Each server's `boot` when connected.
    boots: Vec<u64>,
}

impl Live {
    fn open(config: &Config) -> Result<Live, ReconnectError> {
        let cluster = connect(&config.addrs, &config.token, config.options.clone())?;
        let start = if config.fewer_workers_ok {
            Pool::start_up_to
        } else {
            Pool::start
        };
        let pool = Arc::new(start(&cluster.db, config.workers, config.idle_timeout)?);
        let boots = cluster.servers.iter().map(|s| s.boot()).collect();
        Ok(Live {
            pool,
            cluster,
            boots,
        })
    }

    /// Why this connection is dead, if it is (see the module's comment); `deep` also
    /// says Hello on new sessions.
    fn check(&self, config: &Config, deep: bool, asking: &Asking) -> Result<(), String> {
        for (i, (server, spec)) in self.cluster.servers.iter().zip(&config.addrs).enumerate() {
            let _asked = asking.start(i, server.addr());
            let gone =
                |e: &dyn std::fmt::Display| format!("memory server {i} at {}: {e}", server.addr());
            // A primary with a backup, still served by that primary.
            let Some(backup) = backup_of(spec, server.addr()) else {
                server.keep_alive().map_err(|e| gone(&e))?;
                continue;
            };
            match server.keep_alive_within(PRIMARY_ANSWER_LIMIT) {
                Ok(()) => {}
                Err(e @ memory_server::ClientError::TimedOut { .. }) => {
                    // Stopped or cut off, or only slow: its backup tells which.
                    match ask_backup(backup, &config.token) {
                        Ok(view @ BackupView::PrimaryAlive(_)) => tracing::warn!(
                            primary = server.addr(),
                            backup,
                            "the primary did not renew this node's session within \
                             {PRIMARY_ANSWER_LIMIT:?}, but its backup {view}: it is slow, or \
                             cut off from this node only; still using it"
                        ),
                        Ok(view @ (BackupView::Promoted | BackupView::PrimarySilent(_))) => {
                            return Err(format!("{}, and its backup at {backup} {view}", gone(&e)));
                        }
                        answer @ (Ok(BackupView::NotABackup(_)) | Err(_)) => {
                            // Nobody to judge: wait for the primary as long as its
                            // connection's keep-alive does.
                            let why = match answer {
                                Ok(view) => format!("the other of its pair {view}"),
                                Err(b) => {
                                    format!("its backup cannot say whether it is alive ({b})")
                                }
                            };
                            tracing::warn!(
                                primary = server.addr(),
                                backup,
                                "the primary did not renew this node's session within \
                                 {PRIMARY_ANSWER_LIMIT:?}, and {why}; waiting for the primary"
                            );
                            server.keep_alive().map_err(|e| gone(&e))?;
                        }
                    }
                }
                Err(e) => return Err(gone(&e)),
            }
        }
        if !deep {
            return Ok(());
        }
        for (i, (server, spec)) in self.cluster.servers.iter().zip(&config.addrs).enumerate() {
            let _asked = asking.start(i, server.addr());
            let hello = memory_server::blocking::Client::connect(server.addr(), &config.token)
                .map_err(|e| format!("memory server {i} at {}: {e}", server.addr()))?;
            if hello.server().boot != self.boots[i] {
                return Err(format!(
                    "memory server {i} at {} restarted (boot {} → {})",
                    server.addr(),
                    self.boots[i],
                    hello.server().boot
                ));
            }
            // A server without a backup (promoted, none attached yet) has nobody who
            // could be promoted over it; the other of its pair is then the fenced old
            // primary, maybe stopped, which would cost every deep check the whole bound.
            let has_backup = hello.server().backup_at.is_some();
            drop(hello);
            // Bounded: a stopped backup would hold every deep check (and so the noticing
            // of a dead primary) until the HTTP/2 keep-alive.
            if has_backup
                && let Some(backup) = backup_of(spec, server.addr())
                && let Ok(BackupView::Promoted) = ask_backup(backup, &config.token)
            {
                return Err(format!(
                    "memory server {i}: its backup at {backup} was promoted; the primary is fenced"
                ));
            }
        }
        Ok(())
    }
}

/// The memory server the monitor is asking (renewing its session, or saying Hello) and
/// since when: a check that has not returned for long names the server that does not
/// answer, which the health check reports while the workers, stuck in one-sided
/// operations to it, cannot say so themselves.
#[derive(Default)]
struct Asking(std::sync::Mutex<Option<(usize, String, Instant)>>);

/// Clears [`Asking`] when the question is answered (or failed).
struct Asked<'a>(&'a Asking);

impl Drop for Asked<'_> {
    fn drop(&mut self) {
        *self.0.0.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }
}

impl Asking {
    fn start(&self, server: usize, addr: &str) -> Asked<'_> {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) =
            Some((server, addr.to_string(), Instant::now()));
        Asked(self)
    }

    /// The server asked for longer than `longer_than`, if one is, in words.
    fn unanswered(&self, longer_than: Duration) -> Option<String> {
        let asking = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let (server, addr, since) = asking.as_ref()?;
        let waited = since.elapsed();
        (waited > longer_than).then(|| {
            format!(
                "memory server {server} at {addr} has not answered this node for {:.1}s",
                waited.as_secs_f64()
            )
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ReconnectError {
    #[error(transparent)]
    Connect(#[from] ConnectError),
    #[error("cannot start the worker pool: {0}")]
    Pool(#[from] txn::TxnError),
}

enum State {
    Ready(Arc<Live>),
    Reconnecting { why: String },
    Stopped,
}

/// The compute node's connection to the memory servers, replaced when it dies.
pub struct Node {
    config: Config,
    state: RwLock<State>,
    backend: String,
    servers: usize,
    workers: usize,
    idle_timeout: Duration,
    /// Transport failures of requests since the monitor last looked.
    failures: AtomicU64,
    reconnects: AtomicU64,
    last_reconnect_ms: AtomicU64,
    stop: AtomicBool,
    monitor: std::sync::Mutex<Option<JoinHandle<()>>>,
    /// What the monitor is waiting for.
    asking: Asking,
}

impl Node {
    /// Connects (once: a node that cannot start says so) and starts the monitor.
    pub fn start(mut config: Config) -> Result<Arc<Node>, ReconnectError> {
        let live = Live::open(&config)?;
        // A reconnect must find this cluster again: servers restarted without their
        // data must not get a new, empty one set up in its place, silently.
        config.options.cluster = Some(live.cluster.db.cluster_id());
        let node = Arc::new(Node {
            backend: live.cluster.backend.clone(),
            servers: live.cluster.db.servers(),
            workers: live.pool.workers(),
            idle_timeout: live.pool.idle_timeout(),
            config,
            state: RwLock::new(State::Ready(Arc::new(live))),
            failures: AtomicU64::new(0),
            reconnects: AtomicU64::new(0),
            last_reconnect_ms: AtomicU64::new(0),
            stop: AtomicBool::new(false),
            monitor: std::sync::Mutex::new(None),
            asking: Asking::default(),
        });
        let weak = Arc::downgrade(&node);
        let monitor = std::thread::Builder::new()
            .name("namdb-reconnect".into())
            .spawn(move || monitor(weak))
            .map_err(|e| {
                ReconnectError::Pool(txn::TxnError::Invalid(format!(
                    "cannot start the reconnect monitor: {e}"
                )))
            })?;
        *node.monitor.lock().unwrap_or_else(|e| e.into_inner()) = Some(monitor);
        Ok(node)
    }

    /// The connection to run a request on, or UNAVAILABLE while there is none.
    pub fn live(&self) -> Result<Arc<Live>, Status> {
        match &*self.state.read().unwrap_or_else(|e| e.into_inner()) {
            State::Ready(live) => Ok(live.clone()),
            State::Reconnecting { why } => Err(Status::unavailable(format!(
                "reconnecting to the memory servers: {why}"
            ))),
            State::Stopped => Err(Status::unavailable("the compute node is stopping")),
        }
    }

    /// Notes a failed request: a burst of transport failures makes the monitor check
    /// the servers more closely.
    pub fn note(&self, status: &Status) {
        if matches!(
            status.code(),
            tonic::Code::Unavailable | tonic::Code::Unknown
        ) {
            self.failures.fetch_add(1, Ordering::Relaxed);
        }
    }

    pub fn backend(&self) -> &str {
        &self.backend
    }

    pub fn servers(&self) -> usize {
        self.servers
    }

    pub fn workers(&self) -> usize {
        self.workers
    }

    pub fn idle_timeout(&self) -> Duration {
        self.idle_timeout
    }

    /// The memory server the monitor has been waiting on for longer than
    /// `longer_than` (a session renewal takes a round trip), in words, if one.
    pub fn unanswered_server(&self, longer_than: Duration) -> Option<String> {
        self.asking.unanswered(longer_than)
    }

    /// Every worker's counters of `live`, if each answers within
    /// [`crate::pool::STATS_WAIT`]; else UNAVAILABLE saying which did not and, if the
    /// monitor has been waiting on a memory server as long, which one. Not waited for
    /// longer: a worker stuck in a one-sided operation to a stopped memory server would
    /// hold the caller (Health, Stats, a metrics scrape) until txn's patience ran out.
    pub async fn worker_stats(&self, live: &Live) -> Result<WorkerStats, Status> {
        self.worker_stats_within(live, STATS_WAIT).await
    }

    /// As [`Node::worker_stats`], waiting `within` for the workers.
    pub async fn worker_stats_within(
        &self,
        live: &Live,
        within: Duration,
    ) -> Result<WorkerStats, Status> {
        live.pool.stats_within(within).await.map_err(|silent| {
            // The monitor's question to each server is one round trip: one unanswered
            // for as long as the workers' is the likely culprit.
            let which = self
                .unanswered_server(within)
                .map(|s| format!("; {s}"))
                .unwrap_or_default();
            Status::unavailable(format!("{silent}{which}"))
        })
    }

    /// Reconnections since the start.
    pub fn reconnects(&self) -> u64 {
        self.reconnects.load(Ordering::Relaxed)
    }

    /// How long the last reconnection took, from detection to the new pool (0: none).
    pub fn last_reconnect(&self) -> Duration {
        Duration::from_millis(self.last_reconnect_ms.load(Ordering::Relaxed))
    }

    /// Stops the monitor and the workers (running requests finish, open transactions
    /// are aborted). Must not run inside a tokio runtime: the sessions close blocking.
    pub fn stop(&self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(m) = self
            .monitor
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            let _ = m.join();
        }
        let old = std::mem::replace(
            &mut *self.state.write().unwrap_or_else(|e| e.into_inner()),
            State::Stopped,
        );
        if let State::Ready(live) = old {
            drop(live);
        }
    }

    fn set(&self, state: State) -> State {
        std::mem::replace(
            &mut *self.state.write().unwrap_or_else(|e| e.into_inner()),
            state,
        )
    }

    /// Replaces a dead connection: takes it out of service, then connects until it
    /// works (or the node stops).
    fn reconnect(&self, why: String) {
        let started = Instant::now();
        tracing::warn!("a memory server went away ({why}); reconnecting");
        // The old connection's servers: their Persists still pending are given up once
        // the new connection works (or by `retire`, if that takes long).
        let mut old_servers = Vec::new();
        if let State::Ready(old) = self.set(State::Reconnecting { why: why.clone() }) {
            old_servers = old.cluster.servers.clone();
            retire(old, why.clone());
        }
        let mut backoff = BACKOFF_MIN;
        for attempt in 1.. {
            if self.stop.load(Ordering::Relaxed) {
                return;
            }
            match Live::open(&self.config) {
                Ok(live) => {
                    let took = started.elapsed();
                    self.last_reconnect_ms
                        .store(took.as_millis() as u64, Ordering::Relaxed);
                    self.reconnects.fetch_add(1, Ordering::Relaxed);
                    self.failures.store(0, Ordering::Relaxed);
                    self.set(State::Ready(Arc::new(live)));
                    tracing::info!(attempt, ?took, "reconnected to the memory servers");
                    give_up_persists(&old_servers, &why);
                    return;
                }
                Err(e) => {
                    tracing::warn!(attempt, "reconnecting to the memory servers failed: {e}");
                    self.set(State::Reconnecting {
                        why: format!("{why}; attempt {attempt} failed: {e}"),
                    });
                    std::thread::sleep(backoff);
                    backoff = (backoff * 2).min(BACKOFF_MAX);
                }
            }
        }
    }
}

/// The monitor thread: checks the connection and replaces it when dead; ends when the
/// node stops or is gone.
fn monitor(node: std::sync::Weak<Node>) {
    loop {
        std::thread::sleep(CHECK_EVERY);
        let Some(node) = node.upgrade() else { return };
        if node.stop.load(Ordering::Relaxed) {
            return;
        }
        let live = match &*node.state.read().unwrap_or_else(|e| e.into_inner()) {
            State::Ready(live) => live.clone(),
            _ => continue,
        };
        let deep = node.failures.swap(0, Ordering::Relaxed) >= BURST;
        let verdict = live.check(&node.config, deep, &node.asking);
        drop(live);
        if let Err(why) = verdict {
            node.reconnect(why);
        }
    }
}

/// Fails the Persists still pending on `servers`, of a connection retired because
/// `why`: their commits are left to recovery, their requests end.
fn give_up_persists(servers: &[Arc<crate::memory_servers::RemoteServer>], why: &str) {
    let why = format!(
        "the compute node reconnected to the memory servers ({why}) and gave up on this \
         Persist of the old connection, still unanswered; recovery decides its commit"
    );
    for server in servers {
        server.give_up_persists(&why);
    }
}

/// Drops a dead connection once the requests still holding it are done, on a thread of
/// its own: its workers may take a while to fail what runs on them.
fn retire(old: Arc<Live>, why: String) {
    let spawned = std::thread::Builder::new()
        .name("namdb-retire".into())
        .spawn(move || {
            let mut old = old;
            let started = Instant::now();
            let mut given_up = false;
            loop {
                if !given_up && started.elapsed() >= GIVE_UP_PERSISTS_AFTER {
                    // A healthy server answered its Persists long ago: what is still
                    // pending waits on the server that went away.
                    given_up = true;
                    give_up_persists(&old.cluster.servers, &why);
                }
                match Arc::try_unwrap(old) {
                    Ok(live) => {
                        drop(live);
                        tracing::debug!(took = ?started.elapsed(), "the old connection is closed");
                        return;
                    }
                    Err(still) => {
                        old = still;
                        std::thread::sleep(Duration::from_millis(20));
                    }
                }
            }
        });
    if let Err(e) = spawned {
        tracing::warn!("cannot start a thread to close the old connection ({e}); leaking it");
    }
}
