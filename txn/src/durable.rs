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
use std::sync::Arc;

/// Fruitless checks of a pending persist after which its thread sleeps.
const IDLE_TURNS_BEFORE_SLEEP: u32 = 4;
const IDLE_SLEEP: std::time::Duration = std::time::Duration::from_micros(50);

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
}

/// A durable memory server's persist service. Calls come from the commit path's
/// coroutines, which must not block: [`Persistence::submit`] starts a persist in the
/// background and [`Persistence::poll`] checks on it.
pub trait Persistence: Send + Sync {
    fn submit(&self, ranges: Vec<PersistRange>) -> u64;
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

/// The persist services of a cluster's memory servers: all durable, or none.
#[derive(Clone, Default)]
pub(crate) struct Durability {
    servers: Option<Vec<Arc<dyn Persistence>>>,
}

impl Durability {
    /// From each server's service: a cluster mixing durable and volatile servers
    /// would keep half of a commit across a restart, so it is refused.
    pub(crate) fn new(services: Vec<Option<Arc<dyn Persistence>>>) -> Result<Durability> {
        let durable = services.iter().filter(|s| s.is_some()).count();
        if durable == 0 {
            return Ok(Durability { servers: None });
        }
        if durable != services.len() {
            return Err(TxnError::Invalid(format!(
                "{durable} of {} memory servers are durable: start all of them with a data directory, or none",
                services.len()
            )));
        }
        Ok(Durability {
            servers: Some(services.into_iter().flatten().collect()),
        })
    }

    pub(crate) fn is_durable(&self) -> bool {
        self.servers.is_some()
    }

    fn start(&self, plan: PersistPlan) -> Vec<(usize, u64)> {
        let Some(servers) = &self.servers else {
            return Vec::new();
        };
        plan.per_server
            .into_iter()
            .enumerate()
            .filter(|(_, ranges)| !ranges.is_empty())
            .map(|(s, ranges)| (s, servers[s].submit(ranges)))
            .collect()
    }

    fn check(&self, tickets: &mut Vec<(usize, u64)>) -> Result<()> {
        let Some(servers) = &self.servers else {
            tickets.clear();
            return Ok(());
        };
        let mut failed = None;
        tickets.retain(|&(s, t)| match servers[s].poll(t) {
            PersistStatus::Pending => true,
            PersistStatus::Done => false,
            PersistStatus::Failed(why) => {
                failed.get_or_insert((s, why));
                false
            }
        });
        match failed {
            Some((server, why)) => Err(TxnError::Persist { server, why }),
            None => Ok(()),
        }
    }

    /// Persists `plan`, yielding to other coroutines while the servers write.
    pub(crate) async fn persist(&self, plan: PersistPlan, keep_alive: impl Fn()) -> Result<()> {
        let mut tickets = self.start(plan);
        let mut idle = 0u32;
        loop {
            self.check(&mut tickets)?;
            if tickets.is_empty() {
                return Ok(());
            }
            // A slow disk must not cost the waiting node its lease: another node
            // fences a slot whose commit in flight holds the prefix back past the
            // lease timeout (250 ms by default, one slow fsync on a busy host).
            keep_alive();
            // A persist waits for a disk: spinning would take the CPU from the
            // server's journal thread on a small host, so every few turns the thread
            // sleeps (its other coroutines are most likely waiting for disks too).
            idle += 1;
            if idle.is_multiple_of(IDLE_TURNS_BEFORE_SLEEP) {
                std::thread::sleep(IDLE_SLEEP);
            }
            yield_now().await;
        }
    }

    /// Persists `plan`, blocking the thread (catalog and recovery work).
    pub(crate) fn persist_blocking(&self, plan: PersistPlan) -> Result<()> {
        let mut tickets = self.start(plan);
        let mut pause = std::time::Duration::from_micros(20);
        loop {
            self.check(&mut tickets)?;
            if tickets.is_empty() {
                return Ok(());
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(std::time::Duration::from_millis(2));
        }
    }
}
