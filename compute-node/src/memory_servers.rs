//! A [`txn::Database`] on memory-server processes.
//!
//! Each server is reached through its gRPC control plane (an authenticated session
//! whose lease the client renews in the background): the region directory gives the
//! `catalog` and `data.N` regions, and `ConnectQueuePair` makes every queue pair a
//! worker needs ([`RemoteServer`] is txn's [`MemoryServerLink`]). The compute side's
//! devices are of the backend the servers serve: shm devices on sockets in a private
//! directory, or tcp soft-NICs on the address this host reaches the servers from.

use fabric::shm::ShmDevice;
use fabric::tcp::TcpDevice;
use fabric::{CompletionQueue, Device, FabricError, QpConfig, QueuePair};
use memory_server::blocking::Client;
use memory_server::{ClientError, ClusterToken, Persister, Ticket};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use thiserror::Error;
use txn::{
    Database, DeviceFactory, MemoryServerLink, Options, PersistStatus, Persistence, ServerRegions,
    TxnError,
};

#[derive(Debug, Error)]
pub enum ConnectError {
    #[error("no memory servers given")]
    NoServers,
    /// `source` names the address already.
    #[error("{source}")]
    Control { addr: String, source: ClientError },
    #[error("the memory server at {addr} exports no {what} region")]
    MissingRegion { addr: String, what: &'static str },
    #[error(
        "the memory servers serve different backends ({first} at {first_addr}, {other} at {other_addr}); a cluster uses one"
    )]
    MixedBackends {
        first: String,
        first_addr: String,
        other: String,
        other_addr: String,
    },
    #[error(
        "the memory server at {addr} serves the {backend} backend, for which this compute node has no devices{hint}"
    )]
    UnsupportedBackend {
        addr: String,
        backend: String,
        hint: &'static str,
    },
    #[error(
        "the memory servers at {first_addr} and {other_addr} are both node {node}: the same \
         server listed twice (under two names), or two servers started with the same --node"
    )]
    SharedNodeId {
        node: u32,
        first_addr: String,
        other_addr: String,
    },
    #[error(
        "neither memory server of the pair {first}|{second} serves: {first} answers as a \
         backup, and {second} does not serve as its primary; promote the one that holds the \
         data"
    )]
    NoneServes { first: String, second: String },
    #[error("cannot resolve {addr}: {why}")]
    Resolve { addr: String, why: String },
    #[error("io: {0}")]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Txn(#[from] TxnError),
}

/// One memory server's control-plane session: it makes queue pairs connected to the
/// server.
pub struct RemoteServer {
    addr: String,
    control: Client,
    /// The database's incarnation, which this session carries.
    incarnation: u64,
    /// For a durable server: its persist service, on this session.
    persistence: Option<Arc<ServerPersistence>>,
}

/// txn's persist service on a durable memory server's [`Persister`]: txn's tickets
/// are numbers, the persister's are handles, kept here until reported.
struct ServerPersistence {
    /// The server's address, for the log.
    addr: String,
    persister: Persister,
    /// Each pending ticket and when it was submitted.
    tickets: Mutex<HashMap<u64, PendingPersist>>,
    next: AtomicU64,
    /// When a slow Persist was last logged.
    warned: Mutex<Option<Instant>>,
    /// Why Persists still pending are no longer waited for
    /// ([`RemoteServer::give_up_persists`]).
    given_up: Mutex<Option<String>>,
}

impl Persistence for ServerPersistence {
    fn submit(&self, ranges: &[txn::PersistRange]) -> u64 {
        let ranges = ranges
            .iter()
            .map(|r| memory_server::PersistRange {
                rkey: r.addr.rkey,
                offset: r.addr.offset,
                len: r.len,
                guarded: r.guarded,
            })
            .collect();
        let ticket = self.persister.submit(ranges);
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        lock(&self.tickets).insert(
            id,
            PendingPersist {
                ticket,
                submitted: Instant::now(),
                polls: 0,
            },
        );
        id
    }

    fn poll(&self, ticket: u64) -> PersistStatus {
        let mut tickets = lock(&self.tickets);
        let Some(pending) = tickets.get_mut(&ticket) else {
            return PersistStatus::Failed(format!("no persist {ticket} is pending"));
        };
        let status = match self.persister.poll(&pending.ticket) {
            memory_server::PersistStatus::Pending => match lock(&self.given_up).clone() {
                None => {
                    // Waiting coroutines poll every turn: a clock read each time was
                    // 8% of a durable TPC-W run's CPU, taken from the memory servers.
                    pending.polls = pending.polls.wrapping_add(1);
                    if pending.polls.is_multiple_of(SLOW_PERSIST_CHECK_EVERY) {
                        self.warn_if_slow(pending.submitted.elapsed());
                    }
                    return PersistStatus::Pending;
                }
                Some(why) => PersistStatus::Failed(why),
            },
            memory_server::PersistStatus::Done => PersistStatus::Done,
            memory_server::PersistStatus::Failed(why) => PersistStatus::Failed(why),
            memory_server::PersistStatus::Later(why) => PersistStatus::Later(why),
        };
        tickets.remove(&ticket);
        status
    }
}

/// A Persist submitted and not answered yet.
struct PendingPersist {
    ticket: Ticket,
    submitted: Instant,
    polls: u32,
}

/// Polls of a pending Persist between two looks at how long it has waited.
const SLOW_PERSIST_CHECK_EVERY: u32 = 256;

impl ServerPersistence {
    /// Logs a Persist pending for `waited`, at most once per [`SLOW_PERSIST`].
    fn warn_if_slow(&self, waited: Duration) {
        if waited < SLOW_PERSIST {
            return;
        }
        let mut warned = lock(&self.warned);
        if warned.is_some_and(|at| at.elapsed() < SLOW_PERSIST) {
            return;
        }
        *warned = Some(Instant::now());
        tracing::warn!(
            server = self.addr,
            "a Persist on the memory server has waited {} s for its answer (a replicated \
             primary answers once its backup has applied it too)",
            waited.as_secs()
        );
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl RemoteServer {
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// Renews the control session now: fails once the server is gone or restarted (it
    /// forgot the session).
    pub fn keep_alive(&self) -> Result<(), ClientError> {
        self.control.keep_alive()
    }

    /// Fails every Persist on this server still pending, now and later, with `why`: the
    /// connection is retired, and a Persist to a stopped primary would otherwise hold
    /// its commit (and the client's request) until the HTTP/2 keep-alive gives up. A
    /// Persist answers nothing about the commit's outcome by failing: that commit is
    /// left to recovery, as any commit whose Persist failed.
    pub fn give_up_persists(&self, why: &str) {
        if let Some(p) = &self.persistence {
            *lock(&p.given_up) = Some(why.to_string());
        }
    }

    /// [`RemoteServer::keep_alive`], given up after `limit`.
    pub fn keep_alive_within(&self, limit: Duration) -> Result<(), ClientError> {
        self.control.keep_alive_within(limit)
    }

    /// The server's statistics (regions, huge pages, sessions, RPC counts).
    pub fn stats(&self) -> Result<memory_server::Stats, ClientError> {
        self.control.stats()
    }
}

impl MemoryServerLink for RemoteServer {
    fn connect(
        &self,
        local: &Arc<dyn Device>,
        cq: &Arc<dyn CompletionQueue>,
        send_queue: u32,
    ) -> txn::Result<Arc<dyn QueuePair>> {
        let config = QpConfig {
            max_send_wr: send_queue,
            ..QpConfig::rc(cq)
        };
        match self.control.connect_qp_with_config(local.as_ref(), &config) {
            Ok((qp, _)) => Ok(qp),
            Err(e) => Err(TxnError::Fabric(FabricError::Backend(format!(
                "connecting a queue pair to the memory server at {}: {e}",
                self.addr
            )))),
        }
    }

    fn persistence(&self) -> Option<Arc<dyn Persistence>> {
        self.persistence.clone().map(|p| p as Arc<dyn Persistence>)
    }

    fn boot(&self) -> u64 {
        self.control.server().boot
    }

    fn incarnation(&self) -> u64 {
        self.incarnation
    }

    fn fence(&self, incarnation: u64) -> txn::Result<()> {
        match self.control.fence(incarnation, FENCE_ANSWER_LIMIT) {
            Ok(report) => {
                tracing::info!(
                    server = %self.addr,
                    sessions = report.sessions_ended,
                    queue_pairs = report.queue_pairs_destroyed,
                    "fenced compute node {incarnation:#x}"
                );
                Ok(())
            }
            Err(e) => Err(TxnError::Fabric(FabricError::Backend(format!(
                "fencing compute node {incarnation:#x} at the memory server at {}: {e}",
                self.addr
            )))),
        }
    }
}

/// How long a fence waits for a memory server's answer before the fencer tries again
/// on a later tick (a stopped server answers nothing).
const FENCE_ANSWER_LIMIT: Duration = Duration::from_secs(5);

/// A fresh incarnation for one opening of the database: 48 random bits, never 0.
fn new_incarnation() -> u64 {
    loop {
        let incarnation = rand::random::<u64>() & txn::commitlog::Holder::INCARNATION_MASK;
        if incarnation != 0 {
            return incarnation;
        }
    }
}

/// A database on memory-server processes, with what keeps it reachable.
pub struct RemoteCluster {
    pub db: Database,
    pub servers: Vec<Arc<RemoteServer>>,
    /// The fabric backend the servers serve.
    pub backend: String,
    /// Why a backup was promoted by this connection, one line per server failed over.
    pub promotions: Vec<String>,
    /// Where this process's shm sockets live.
    _sockets: tempfile::TempDir,
}

impl RemoteCluster {
    /// The directory of this process's shm sockets, removed when the cluster is
    /// dropped: a caller that handles SIGINT (which skips destructors) removes it too.
    pub fn sockets_dir(&self) -> &std::path::Path {
        self._sockets.path()
    }
}

/// How long a compute node waits for a backup's Hello (connection, Hello and
/// authentication) when it asks whether the backup was promoted, or promotes it. A
/// backup stopped (SIGSTOP) or wedged keeps its TCP connection and answers nothing:
/// without a bound the ask waited for the HTTP/2 keep-alive (half a minute), saying
/// nothing. Two trivial RPCs; the chaos harness asks backups within 5 s on a loaded
/// host, this allows twice that.
pub const BACKUP_ANSWER_LIMIT: Duration = Duration::from_secs(10);

/// How long a compute node waits for a replicated primary's answer (its Hello when
/// connecting, a session renewal when checking) before it asks the primary's backup
/// whether the primary is alive. A stopped primary (SIGSTOP, a host cut off) keeps its
/// connections and answers nothing: without this bound a node waited for the HTTP/2
/// keep-alive to give up (half a minute) before it even began to fail over.
pub const PRIMARY_ANSWER_LIMIT: Duration = Duration::from_secs(5);

/// The bound on a replicated primary's Hello when its backup has not heard from it for
/// [`PRIMARY_SILENCE`] already: most likely it is gone, and a node that found it
/// silent exited and is connecting again.
pub const SILENT_PRIMARY_ANSWER_LIMIT: Duration = Duration::from_secs(1);

/// How long a backup must not have heard from its primary, which renews its session
/// there every [`memory_server::PRIMARY_HEARTBEAT`] while it has nothing to send,
/// before a compute node that cannot reach that primary either promotes the backup.
/// The backup, not the compute node, judges: a primary that is only slow to answer
/// this node, or cut off from this node alone, still reaches its backup, and
/// promoting the backup of a live primary would fence it for nothing.
pub const PRIMARY_SILENCE: Duration = Duration::from_secs(3);

/// What a backup says of its primary.
#[derive(Clone, Copy, Debug)]
pub enum BackupView {
    /// It was promoted: its primary is fenced.
    Promoted,
    /// It heard from its primary this long ago, less than [`PRIMARY_SILENCE`].
    PrimaryAlive(Duration),
    /// It has not heard from its primary for this long (`None`: no primary attached
    /// to it since it started).
    PrimarySilent(Option<Duration>),
    /// It is no backup (a primary, or a server that was never replicated): it cannot
    /// judge the server asked about.
    NotABackup(memory_server::Role),
}

impl BackupView {
    pub fn of(server: &memory_server::ServerInfo) -> BackupView {
        use memory_server::Role;
        match (server.role, server.primary_silence) {
            (Role::Promoted, _) => BackupView::Promoted,
            (Role::Backup, Some(silence)) if silence < PRIMARY_SILENCE => {
                BackupView::PrimaryAlive(silence)
            }
            (Role::Backup, silence) => BackupView::PrimarySilent(silence),
            (role, _) => BackupView::NotABackup(role),
        }
    }
}

/// Asks the backup at `backup` what it knows of its primary (within
/// [`BACKUP_ANSWER_LIMIT`]): what a node that got no answer from that primary within
/// [`PRIMARY_ANSWER_LIMIT`] goes by.
pub fn ask_backup(backup: &str, token: &ClusterToken) -> Result<BackupView, ClientError> {
    Client::connect_within(backup, token, BACKUP_ANSWER_LIMIT).map(|b| BackupView::of(b.server()))
}

/// The backup of the server `serving` (the address in use) of `spec`
/// (`PRIMARY|BACKUP`): the other of the pair. That is the listed primary when the
/// listed backup serves, which is its backup once it was given that as one
/// (`AttachBackup`, what `namdb cluster restart` does), and otherwise a fenced or dead
/// server that says it is no backup ([`BackupView::NotABackup`]) or does not answer.
pub fn backup_of<'s>(spec: &'s str, serving: &str) -> Option<&'s str> {
    let (primary, backup) = spec.split_once('|')?;
    let (primary, backup) = (primary.trim(), backup.trim());
    Some(if backup == serving { primary } else { backup })
}

/// "was promoted", "heard from it 0.2 s ago", "has not heard from it for 4.2 s".
impl std::fmt::Display for BackupView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BackupView::Promoted => write!(f, "was promoted"),
            BackupView::PrimaryAlive(d) => write!(f, "heard from it {:.1} s ago", d.as_secs_f64()),
            BackupView::PrimarySilent(Some(d)) => {
                write!(f, "has not heard from it for {:.1} s", d.as_secs_f64())
            }
            BackupView::PrimarySilent(None) => write!(
                f,
                "has not heard from it since it started (no primary attached to it)"
            ),
            BackupView::NotABackup(role) => write!(f, "is no backup (it is {role:?})"),
        }
    }
}

/// A Persist pending this long is logged (again every as long, per server): a
/// replicated primary answers only once its backup has applied the Persist too (or
/// after its own bound on the backup, 30 s), and a start-up waiting on that said
/// nothing.
const SLOW_PERSIST: Duration = Duration::from_secs(5);

/// A session with one logical memory server given as `PRIMARY` or `PRIMARY|BACKUP`
/// (control-plane addresses): the primary if it answers, else the backup, promoted
/// (which fences the primary: it can acknowledge no Persist any more). A primary that
/// answers is not used when its backup says it was promoted already (by another
/// compute node): that primary is fenced.
///
/// A backup that does not answer within [`BACKUP_ANSWER_LIMIT`] while its primary
/// does is not waited for: the primary is used, with a warning. That is safe whatever
/// the backup is: a primary acknowledges a Persist only once its backup has applied it
/// too, and a promoted backup refuses its stream, so a compute node on a primary
/// whose backup is away (or was promoted) can acknowledge no write; opening the
/// database persists (txn's boots), so it opens only once the backup answers the
/// primary, within the primary's own bound on its backup, and otherwise fails with
/// the primary's error naming the backup.
fn connect_server(
    spec: &str,
    token: &ClusterToken,
    incarnation: u64,
) -> Result<(String, Client, Option<String>), ConnectError> {
    let (primary, backup) = match spec.split_once('|') {
        Some((p, b)) => (p.trim(), Some(b.trim())),
        None => (spec.trim(), None),
    };
    fn control(addr: &str) -> impl FnOnce(ClientError) -> ConnectError + '_ {
        move |source| ConnectError::Control {
            addr: addr.to_string(),
            source,
        }
    }
    let Some(backup) = backup else {
        return Ok((
            primary.to_string(),
            Client::connect_as(primary, token, incarnation, None).map_err(control(primary))?,
            None,
        ));
    };
    connect_pair(primary, backup, token, incarnation, true)
}

/// [`connect_server`] for a pair, `primary` listed first. The pair's roles swap once
/// the backup, promoted, is given the old primary as its backup (`AttachBackup`): the
/// backup says so in its Hello (promoted, with a backup), or the listed primary does
/// (a backup); then the pair is taken the other way round (`may_swap`: once).
fn connect_pair(
    primary: &str,
    backup: &str,
    token: &ClusterToken,
    incarnation: u64,
    may_swap: bool,
) -> Result<(String, Client, Option<String>), ConnectError> {
    fn control(addr: &str) -> impl FnOnce(ClientError) -> ConnectError + '_ {
        move |source| ConnectError::Control {
            addr: addr.to_string(),
            source,
        }
    }
    // The backup is asked first (as this incarnation: the session is kept if it was
    // promoted): a promoted backup is used at once, and a primary its backup has not
    // heard from is given a short bound, since it is most likely gone (the node that
    // found it silent exited and this is its successor).
    let asked = if may_swap {
        match ask_backup_or_find_swapped(primary, backup, token, incarnation) {
            Some(asked) => asked,
            None => return connect_pair(backup, primary, token, incarnation, false),
        }
    } else {
        Client::connect_as(backup, token, incarnation, Some(BACKUP_ANSWER_LIMIT))
    };
    let limit = match asked.as_ref().map(|b| BackupView::of(b.server())) {
        Ok(BackupView::Promoted)
            if may_swap && asked.as_ref().is_ok_and(|b| b.server().backup_at.is_some()) =>
        {
            drop(asked);
            return connect_pair(backup, primary, token, incarnation, false);
        }
        Ok(BackupView::Promoted) => {
            tracing::warn!(
                primary,
                backup,
                "the backup was promoted already; using it instead of the fenced primary"
            );
            return Ok((backup.to_string(), asked.expect("answered"), None));
        }
        Ok(BackupView::PrimarySilent(_)) => SILENT_PRIMARY_ANSWER_LIMIT,
        Ok(BackupView::PrimaryAlive(_) | BackupView::NotABackup(_)) | Err(_) => {
            PRIMARY_ANSWER_LIMIT
        }
    };
    let mut reached = Client::connect_as(primary, token, incarnation, Some(limit));
    if let Err(e @ ClientError::TimedOut { .. }) = &reached {
        // Stopped, cut off, or only slow: the backup, which the primary renews its
        // session at while idle, tells which.
        let b = Client::connect_as(backup, token, incarnation, Some(BACKUP_ANSWER_LIMIT))
            .map_err(control(backup))?;
        let view = BackupView::of(b.server());
        match view {
            BackupView::Promoted => {
                tracing::warn!(
                    primary,
                    backup,
                    "the primary does not answer and its backup was promoted already; using it"
                );
                return Ok((backup.to_string(), b, None));
            }
            BackupView::PrimaryAlive(_) | BackupView::NotABackup(_) => {
                tracing::warn!(
                    primary,
                    backup,
                    "the primary did not answer within {limit:?}, but its backup {view}: \
                     waiting for the primary, not promoting the backup of a live primary"
                );
                reached = Client::connect_as(primary, token, incarnation, None);
            }
            BackupView::PrimarySilent(_) => {
                let why = format!("{e}, and its backup at {backup} {view}");
                return promote(primary, backup, b, token, incarnation, why);
            }
        }
    }
    match reached {
        Ok(client) if client.server().role == memory_server::Role::Backup => {
            if may_swap {
                // The listed primary is its old backup's backup now.
                drop((client, asked));
                return connect_pair(backup, primary, token, incarnation, false);
            }
            Err(ConnectError::NoneServes {
                first: primary.to_string(),
                second: backup.to_string(),
            })
        }
        Ok(client) => {
            if let Err(e) = &asked {
                tracing::warn!(
                    primary,
                    backup,
                    "cannot ask the backup memory server whether it was promoted ({e}); going \
                     on with the primary, which acknowledges no write until its backup \
                     answers it (so opening the database waits for that, or fails with the \
                     primary's error naming the backup)"
                );
            }
            Ok((primary.to_string(), client, None))
        }
        Err(e) => {
            // The session asked first, if the backup answered then.
            let b = match asked {
                Ok(b) => b,
                Err(_) => Client::connect_within(backup, token, BACKUP_ANSWER_LIMIT)
                    .map_err(control(backup))?,
            };
            promote(primary, backup, b, token, incarnation, format!("{e}"))
        }
    }
}

/// Asks the listed `backup` (a session as `incarnation`, as [`connect_pair`] does)
/// while, alongside, saying Hello to the listed `primary`: `None` if the primary
/// answers first that it is a backup (the pair is the other way round), without waiting
/// for the listed backup. That one is then the promoted server, maybe stopped (a hung
/// host): asking it first cost every node connecting the whole [`BACKUP_ANSWER_LIMIT`]
/// (16.7 s to commits again after such a failover in a chaos run, against 6.5 s the
/// first way round).
fn ask_backup_or_find_swapped(
    primary: &str,
    backup: &str,
    token: &ClusterToken,
    incarnation: u64,
) -> Option<Result<Client, ClientError>> {
    enum Answer {
        PrimaryIsBackup(bool),
        Backup(Box<Result<Client, ClientError>>),
    }
    let (tx, rx) = std::sync::mpsc::channel();
    let (to_primary, token_p) = (tx.clone(), token.clone());
    let primary = primary.to_string();
    // Neither thread is waited for once the answer is known: each ends within its
    // bound, and its answer is dropped.
    std::thread::spawn(move || {
        let is_backup = Client::connect_within(&primary, &token_p, PRIMARY_ANSWER_LIMIT)
            .is_ok_and(|c| c.server().role == memory_server::Role::Backup);
        let _ = to_primary.send(Answer::PrimaryIsBackup(is_backup));
    });
    let (backup, token_b) = (backup.to_string(), token.clone());
    std::thread::spawn(move || {
        let asked = Client::connect_as(&backup, &token_b, incarnation, Some(BACKUP_ANSWER_LIMIT));
        let _ = tx.send(Answer::Backup(Box::new(asked)));
    });
    loop {
        match rx.recv() {
            Ok(Answer::PrimaryIsBackup(true)) => return None,
            Ok(Answer::PrimaryIsBackup(false)) => {}
            Ok(Answer::Backup(asked)) => return Some(*asked),
            // Both threads answer before they end; a panicked one leaves the other.
            Err(_) => {
                return Some(Err(ClientError::Protocol(
                    "asking the memory servers failed".into(),
                )));
            }
        }
    }
}

/// Promotes `backup` (reached as `b`) because its primary cannot be reached (`why`),
/// and answers a session on it as `incarnation`, with `why` as the promotion's reason.
fn promote(
    primary: &str,
    backup: &str,
    b: Client,
    token: &ClusterToken,
    incarnation: u64,
    why: String,
) -> Result<(String, Client, Option<String>), ConnectError> {
    let control = |source| ConnectError::Control {
        addr: backup.to_string(),
        source,
    };
    tracing::warn!(
        primary,
        backup,
        "the primary memory server cannot be reached ({why}); promoting its backup"
    );
    b.promote().map_err(control)?;
    drop(b);
    // A new session, for the Hello that reports the promoted server (its boot).
    let b = Client::connect_as(backup, token, incarnation, Some(BACKUP_ANSWER_LIMIT))
        .map_err(control)?;
    let reason = format!("promoted the backup at {backup} of {primary}: {why}");
    Ok((backup.to_string(), b, Some(reason)))
}

/// Opens the database on the memory servers at `addrs` (their control-plane
/// addresses, each `PRIMARY` or `PRIMARY|BACKUP`), server 0 first: every compute node
/// must list them in the same order. A server whose primary cannot be reached is
/// served by its backup, which this promotes; txn's restart recovery then repairs
/// what the failover lost (the backup reports a new boot).
pub fn connect(
    addrs: &[String],
    token: &ClusterToken,
    options: Options,
) -> Result<RemoteCluster, ConnectError> {
    // Server 0's primary: where the tcp backend's local address is chosen towards.
    let first = &addrs
        .first()
        .ok_or(ConnectError::NoServers)?
        .split('|')
        .next()
        .unwrap_or_default()
        .trim()
        .to_string();
    let mut servers = Vec::with_capacity(addrs.len());
    let mut backend: Option<String> = None;
    // A fabric peer is named by its node id: two servers sharing one would have one's
    // queue pairs taken for the other's.
    let mut nodes: Vec<(u32, String)> = Vec::with_capacity(addrs.len());
    let incarnation = new_incarnation();
    let mut promotions = Vec::new();
    for spec in addrs {
        let (addr, control, promoted) = connect_server(spec, token, incarnation)?;
        promotions.extend(promoted);
        let addr = &addr;
        let node = control.server().node.0;
        if let Some((_, first_addr)) = nodes.iter().find(|(n, _)| *n == node) {
            return Err(ConnectError::SharedNodeId {
                node,
                first_addr: first_addr.clone(),
                other_addr: addr.clone(),
            });
        }
        nodes.push((node, addr.clone()));
        let served = control.server().backend.clone();
        match &backend {
            None => backend = Some(served),
            Some(b) if *b != served => {
                return Err(ConnectError::MixedBackends {
                    first: b.clone(),
                    first_addr: first.clone(),
                    other: served,
                    other_addr: addr.clone(),
                });
            }
            Some(_) => {}
        }
        let directory = control
            .list_regions()
            .map_err(|source| ConnectError::Control {
                addr: addr.clone(),
                source,
            })?;
        let catalog = directory
            .catalog()
            .ok_or_else(|| ConnectError::MissingRegion {
                addr: addr.clone(),
                what: "catalog",
            })?
            .remote;
        let data: Vec<_> = directory.data().map(|r| r.remote).collect();
        if data.is_empty() {
            return Err(ConnectError::MissingRegion {
                addr: addr.clone(),
                what: "data",
            });
        }
        servers.push((
            Arc::new(RemoteServer {
                addr: addr.clone(),
                persistence: control.server().durable.then(|| {
                    Arc::new(ServerPersistence {
                        addr: addr.clone(),
                        persister: Persister::new(&control),
                        tickets: Mutex::new(HashMap::new()),
                        next: AtomicU64::new(1),
                        warned: Mutex::new(None),
                        given_up: Mutex::new(None),
                    })
                }),
                control,
                incarnation,
            }),
            ServerRegions { catalog, data },
        ));
    }
    let backend = backend.expect("at least one server");
    // Named by pid, so that a later node can tell a killed one's leftovers.
    let prefix = "namdb-compute-";
    fabric::shm::sweep_leftovers(&std::env::temp_dir(), prefix);
    let sockets = tempfile::Builder::new()
        .prefix(&format!("{prefix}{}-", std::process::id()))
        .tempdir()?;
    let devices = device_factory(&backend, first, token, &sockets, options.devices.clone())?;
    let links = servers
        .iter()
        .map(|(s, r)| (s.clone() as Arc<dyn MemoryServerLink>, r.clone()))
        .collect();
    let db = Database::open(links, devices, options)?;
    Ok(RemoteCluster {
        db,
        servers: servers.into_iter().map(|(s, _)| s).collect(),
        backend,
        promotions,
        _sockets: sockets,
    })
}

/// shm devices on fresh sockets in `dir` (which must outlive them), authenticated
/// with `secret`.
pub fn shm_devices(dir: std::path::PathBuf, secret: Vec<u8>) -> DeviceFactory {
    let next = AtomicU64::new(0);
    Arc::new(move || {
        let n = next.fetch_add(1, Ordering::Relaxed);
        let device: Arc<dyn Device> = ShmDevice::bind(dir.join(format!("node{n}.sock")), &secret)?;
        Ok(device)
    })
}

/// Devices of `backend` that the memory servers can reach. shm and tcp devices are
/// made here; verbs devices come from the caller (`Options::devices`), since the verbs
/// backend is a cargo feature of the binary, not of this crate.
fn device_factory(
    backend: &str,
    server_addr: &str,
    token: &ClusterToken,
    sockets: &tempfile::TempDir,
    given: Option<DeviceFactory>,
) -> Result<DeviceFactory, ConnectError> {
    let secret = token.secret().to_vec();
    match backend {
        "shm" => Ok(shm_devices(sockets.path().to_path_buf(), secret)),
        "tcp" => {
            let ip = local_ip_towards(server_addr)?;
            Ok(Arc::new(move || {
                let device: Arc<dyn Device> = TcpDevice::bind(&format!("{ip}:0"), &secret)?;
                Ok(device)
            }))
        }
        "verbs" => given.ok_or_else(|| ConnectError::UnsupportedBackend {
            addr: server_addr.to_string(),
            backend: backend.to_string(),
            hint: " (pass a verbs device factory in txn::Options::devices)",
        }),
        other => Err(ConnectError::UnsupportedBackend {
            addr: server_addr.to_string(),
            backend: other.to_string(),
            hint: "",
        }),
    }
}

/// The address this host uses to reach `addr`: a tcp soft-NIC must listen there, since
/// the server dials it back (not on loopback unless the server is on loopback, and
/// never on the wildcard, which cannot be advertised).
pub fn local_ip_towards(addr: &str) -> Result<std::net::IpAddr, ConnectError> {
    let resolve = |why: String| ConnectError::Resolve {
        addr: addr.to_string(),
        why,
    };
    let server_ip = match addr.parse::<std::net::SocketAddr>() {
        Ok(a) => a.ip(),
        Err(_) => std::net::ToSocketAddrs::to_socket_addrs(addr)
            .map_err(|e| resolve(e.to_string()))?
            .next()
            .ok_or_else(|| resolve("no address".into()))?
            .ip(),
    };
    let probe = std::net::UdpSocket::bind((std::net::Ipv4Addr::UNSPECIFIED, 0))?;
    probe.connect((server_ip, 9))?;
    Ok(probe.local_addr()?.ip())
}
