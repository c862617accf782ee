//! Durable memory servers, from the compute side.
//!
//! A durable memory server keeps, across a restart, for every byte of its regions the
//! value it had at the last *persist* that covered it (zero if none did). It cannot
//! see one-sided writes, so compute nodes say what to keep ([`Persistence`]), the way
//! a program flushes persistent memory. The commit protocol persists:
//!
//! 1. the commit record, after it is written and before any install, so an install
//!    anywhere (which any restart keeps, on a server that did not restart) has a
//!    durable record behind it;
//! 2. after the install and before the commit is acknowledged, the installed blocks
//!    (guarded: the server copies a block only while its header is unlocked and
//!    unchanged, so a kept block is never half written or locked), and for inserts the
//!    arena counters and index buckets;
//! 3. the commit's log ring space is reused only after that, so a record stays in its
//!    ring until everything it wrote is durable. A dead holder's ring is reused after
//!    its recovery, which persists every block the ring's records wrote first, and
//!    every ring after a restart repair of server 0, which does the same.
//!
//! After a restart, the restart recovery that `Database::open` runs rolls forward
//! every record whose installs a restarted server may have lost, and starts the
//! oracle above every timestamp the data holds if server 0 (the oracle's and the
//! log's) restarted.

use crate::error::{Result, TxnError};
use crate::runtime::yield_now;
use fabric::RemoteAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A byte range of a memory server's region to make durable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PersistRange {
    pub addr: RemoteAddr,
    pub len: u64,
    /// The range starts with a record header: the server copies it only while the
    /// header reads unlocked and unchanged across the copy (waiting for a lock to go).
    pub guarded: bool,
}

impl PersistRange {
    pub fn plain(addr: RemoteAddr, len: u64) -> PersistRange {
        PersistRange {
            addr,
            len,
            guarded: false,
        }
    }

    pub fn block(addr: RemoteAddr, len: u64) -> PersistRange {
        PersistRange {
            addr,
            len,
            guarded: true,
        }
    }
}

/// Where a persist stands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PersistStatus {
    Pending,
    Done,
    Failed(String),
    /// Refused (why) only for now: a replicated primary whose backup is away
    /// acknowledges nothing until it has attached to it again, and then acknowledges
    /// the same persist made again.
    Later(String),
}

/// A durable memory server's persist service. Calls come from the commit path's
/// coroutines, which must not block: [`Persistence::submit`] starts a persist in the
/// background and [`Persistence::poll`] checks on it.
pub trait Persistence: Send + Sync {
    /// Starts a persist of `ranges` (borrowed: a persist refused for now is submitted
    /// again with the same ranges).
    fn submit(&self, ranges: &[PersistRange]) -> u64;
    /// The status of the persist `ticket`; a finished one may be forgotten after it
    /// was reported once.
    fn poll(&self, ticket: u64) -> PersistStatus;
}

/// Ranges to persist, per memory server.
#[derive(Default, Debug)]
pub(crate) struct PersistPlan {
    per_server: Vec<Vec<PersistRange>>,
}

impl PersistPlan {
    pub(crate) fn add(&mut self, server: usize, range: PersistRange) {
        if self.per_server.len() <= server {
            self.per_server.resize_with(server + 1, Vec::new);
        }
        let ranges = &mut self.per_server[server];
        if !ranges.contains(&range) {
            ranges.push(range);
        }
    }
}

/// How long after a refusal for now ([`PersistStatus::Later`]) a persist is made again.
const RETRY_PAUSE: Duration = Duration::from_millis(50);
/// The least time between two warnings that persists wait for a backup.
const WARN_EVERY: Duration = Duration::from_secs(5);

/// One server's share of a persist under way.
struct Share {
    server: usize,
    ranges: Vec<PersistRange>,
    attempt: Attempt,
}

enum Attempt {
    /// The ticket of the attempt in flight.
    Sent(u64),
    /// Refused for now: made again at this time.
    Again(Instant),
}

/// A persist under way on its servers.
struct Underway {
    shares: Vec<Share>,
    /// When a server first refused it for now, and the last such refusal (server, why).
    refused: Option<(Instant, usize, String)>,
}

/// The persist services of a cluster's memory servers: all durable, or none.
#[derive(Clone, Default)]
pub(crate) struct Durability {
    servers: Option<Vec<Arc<dyn Persistence>>>,
    /// How long a persist refused for now is made again ([`crate::Options::persist_patience`]).
    patience: Duration,
    /// When waiting persists were last warned about.
    warned: Arc<Mutex<Option<Instant>>>,
}

impl Durability {
    /// From each server's service: a cluster mixing durable and volatile servers
    /// would keep half of a commit across a restart, so it is refused.
    pub(crate) fn new(
        services: Vec<Option<Arc<dyn Persistence>>>,
        patience: Duration,
    ) -> Result<Durability> {
        let durable = services.iter().filter(|s| s.is_some()).count();
        if durable == 0 {
            return Ok(Durability::default());
        }
        if durable != services.len() {
            return Err(TxnError::Invalid(format!(
                "{durable} of {} memory servers are durable: start all of them with a data directory, or none",
                services.len()
            )));
        }
        Ok(Durability {
            servers: Some(services.into_iter().flatten().collect()),
            patience,
            warned: Arc::default(),
        })
    }

    pub(crate) fn is_durable(&self) -> bool {
        self.servers.is_some()
    }

    fn start(&self, plan: PersistPlan) -> Underway {
        let shares = match &self.servers {
            None => Vec::new(),
            Some(servers) => plan
                .per_server
                .into_iter()
                .enumerate()
                .filter(|(_, ranges)| !ranges.is_empty())
                .map(|(server, ranges)| Share {
                    server,
                    attempt: Attempt::Sent(servers[server].submit(&ranges)),
                    ranges,
                })
                .collect(),
        };
        Underway {
            shares,
            refused: None,
        }
    }

    /// One look at `underway`: drops the shares done, makes again those refused for
    /// now whose pause is over. Fails on a share failed, or once the patience has
    /// passed since the first refusal (an attempt made again may also wait: a primary
    /// attaching to its backup again answers once the attach ended).
    fn check(&self, underway: &mut Underway) -> Result<()> {
        let Some(servers) = &self.servers else {
            underway.shares.clear();
            return Ok(());
        };
        // The time only once a share was refused: the commit path checks every turn.
        let clock = std::cell::OnceCell::new();
        let now = || *clock.get_or_init(Instant::now);
        let mut failed = None;
        let refused = &mut underway.refused;
        if let Some((since, server, why)) = refused.as_ref()
            && now().duration_since(*since) >= self.patience
        {
            return Err(TxnError::Persist {
                server: *server,
                why: format!(
                    "{why}; not acknowledged within {:?} (the patience) of that refusal",
                    self.patience
                ),
            });
        }
        underway.shares.retain_mut(|share| {
            let ticket = match share.attempt {
                Attempt::Sent(ticket) => ticket,
                Attempt::Again(at) if now() >= at => {
                    share.attempt = Attempt::Sent(servers[share.server].submit(&share.ranges));
                    return true;
                }
                Attempt::Again(_) => return true,
            };
            match servers[share.server].poll(ticket) {
                PersistStatus::Pending => true,
                PersistStatus::Done => false,
                PersistStatus::Failed(why) => {
                    failed.get_or_insert((share.server, why));
                    false
                }
                PersistStatus::Later(why) => {
                    self.warn_waiting(share.server, &why);
                    let since = refused.as_ref().map_or_else(now, |(since, ..)| *since);
                    *refused = Some((since, share.server, why));
                    share.attempt = Attempt::Again(now() + RETRY_PAUSE);
                    true
                }
            }
        });
        match failed {
            Some((server, why)) => Err(TxnError::Persist { server, why }),
            None => Ok(()),
        }
    }

    /// Says, at most once per [`WARN_EVERY`], that commits wait for a backup.
    fn warn_waiting(&self, server: usize, why: &str) {
        let mut warned = self.warned.lock().unwrap_or_else(|e| e.into_inner());
        if warned.is_some_and(|at| at.elapsed() < WARN_EVERY) {
            return;
        }
        *warned = Some(Instant::now());
        tracing::warn!(
            server,
            "commits wait (up to {:?} each) for memory server {server} to acknowledge their \
             Persists again: {why}",
            self.patience
        );
    }

    /// Persists `plan`, yielding to other coroutines while the servers write;
    /// `waiting_turn` runs on every turn that finds it still pending. It keeps the
    /// waiting node's lease (a slow disk, or a backup away, must not cost it: another
    /// node fences a slot whose commit in flight holds the prefix back past the lease
    /// timeout, 250 ms by default, one slow fsync on a busy host) and paces the thread
    /// ([`crate::Worker::end_round`]).
    pub(crate) async fn persist(&self, plan: PersistPlan, waiting_turn: impl Fn()) -> Result<()> {
        let mut underway = self.start(plan);
        loop {
            self.check(&mut underway)?;
            if underway.shares.is_empty() {
                return Ok(());
            }
            waiting_turn();
            yield_now().await;
        }
    }

    /// Persists `plan`, blocking the thread (catalog and restart work).
    pub(crate) fn persist_blocking(&self, plan: PersistPlan) -> Result<()> {
        self.persist_blocking_keeping(plan, &|| {})
    }

    /// [`Durability::persist_blocking`] for a holder of a lease: `keep_alive` renews
    /// it while the servers write.
    pub(crate) fn persist_blocking_keeping(
        &self,
        plan: PersistPlan,
        keep_alive: &dyn Fn(),
    ) -> Result<()> {
        let mut underway = self.start(plan);
        let mut pause = Duration::from_micros(20);
        loop {
            self.check(&mut underway)?;
            if underway.shares.is_empty() {
                return Ok(());
            }
            keep_alive();
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(2));
        }
    }
}
