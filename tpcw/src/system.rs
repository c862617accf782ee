//! What a system under test provides: transactions over the TPC-W relations
//! ([`Session`]), run by per-thread engines ([`Engine`]) that a [`System`] makes.
//!
//! The interactions ([`crate::interactions`]) are written once against [`Session`], so
//! RSI, the two-phase-commit baseline and PostgreSQL run the same logic on the same
//! rows; only the storage and the commit protocol differ.

use crate::schema::Rel;
use crate::schema::Scale;
use std::future::Future;
use std::pin::Pin;
use thiserror::Error;

/// Why a system aborted a transaction; each is counted apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum AbortReason {
    /// A write-write conflict, a lock held by another transaction, or (PostgreSQL) a
    /// serialization failure or deadlock.
    Conflict,
    /// The snapshot needs a version the system no longer keeps.
    SnapshotTooOld,
    /// An insert found its key taken.
    DuplicateKey,
    /// The commit's outcome was unknown (its worker was fenced: a thread starved of
    /// CPU past its lease), and recovery rolled it back ([`Error::Unknown`]).
    Fenced,
}

#[derive(Debug, Error)]
pub enum Error {
    /// The system aborted the transaction; the client counts it and goes on.
    #[error("aborted ({reason:?}): {message}")]
    Aborted {
        reason: AbortReason,
        message: String,
    },
    /// A row that does not decode, or a row missing that the data must have: the
    /// database is corrupt or the generator and the reader disagree. Fatal.
    #[error("bad data: {0}")]
    Data(String),
    /// Anything else (a dead server, a full table, a network error). Fatal.
    #[error("{0}")]
    System(String),
    /// The client does not know whether its commit took effect: its worker was fenced
    /// (a thread starved of CPU past its lease, under load) and recovery decides the
    /// commit, all or nothing. `commit` names it to the engine that failed it, which
    /// learns the outcome once recovery has decided it ([`Engine::outcome`]; `None`:
    /// the system cannot tell). The runner asks, and records the interaction as
    /// committed or as aborted ([`AbortReason::Fenced`]); a run fails on it only if
    /// the outcome cannot be learnt. The loader finds out by trying again.
    #[error("{message}")]
    Unknown {
        message: String,
        commit: Option<u64>,
    },
}

impl Error {
    pub fn aborted(reason: AbortReason, message: impl Into<String>) -> Error {
        Error::Aborted {
            reason,
            message: message.into(),
        }
    }
}

impl From<crate::codec::CodecError> for Error {
    fn from(e: crate::codec::CodecError) -> Self {
        Error::Data(e.to_string())
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// One transaction's reads and buffered writes. Rows are the bytes of
/// [`crate::schema`]'s `encode`.
#[allow(async_fn_in_trait)]
pub trait Session {
    /// The row at `key` as of the transaction's snapshot (its own writes included).
    async fn get(&mut self, rel: Rel, key: u64) -> Result<Option<Vec<u8>>>;
    /// Several rows of one relation, in the order of `keys`.
    async fn get_many(&mut self, rel: Rel, keys: &[u64]) -> Result<Vec<Option<Vec<u8>>>>;
    /// Writes a row that exists (or may exist).
    async fn put(&mut self, rel: Rel, key: u64, row: Vec<u8>) -> Result<()>;
    /// Writes a new row; a key already present aborts with `DuplicateKey` (at the
    /// latest at commit).
    async fn insert(&mut self, rel: Rel, key: u64, row: Vec<u8>) -> Result<()>;
    async fn delete(&mut self, rel: Rel, key: u64) -> Result<()>;
    /// The version (the writer's commit timestamp) of the row the snapshot sees, for
    /// systems that have one; `None` otherwise. Lets the history checker replay the
    /// system's own order.
    async fn version(&mut self, rel: Rel, key: u64) -> Result<Option<u64>> {
        let _ = (rel, key);
        Ok(None)
    }
    /// The snapshot's read timestamp, for systems that have one.
    fn read_timestamp(&self) -> Option<u64> {
        None
    }
}

/// A commit that succeeded.
#[derive(Clone, Copy, Debug, Default)]
pub struct Committed {
    /// The system's commit timestamp, when it has one (for the history).
    pub cid: Option<u64>,
}

/// The futures of one runner thread's clients.
pub type ClientFuture<'a, T> = Pin<Box<dyn Future<Output = T> + 'a>>;

/// The per-thread part of a system: its clients begin and commit transactions
/// through it. Not `Send`: it lives and dies on its thread.
#[allow(async_fn_in_trait)]
pub trait Engine {
    type Txn<'a>: Session
    where
        Self: 'a;

    /// Begins a transaction whose snapshot includes the client's last commit
    /// (`after`, the value of [`Committed::cid`] it last got, or 0).
    async fn begin(&self, after: u64) -> Result<Self::Txn<'_>>;
    async fn commit<'a>(&'a self, txn: Self::Txn<'a>) -> Result<Committed>;
    fn abort<'a>(&'a self, txn: Self::Txn<'a>);
    /// What became of a commit of this engine that failed with [`Error::Unknown`]
    /// naming `commit`, once the system has decided it: `Some` if it committed, `None`
    /// if it has no effect. Waits for the decision up to `patience`, letting the
    /// engine's other clients run; an error if it is not learnt by then. Systems whose
    /// commits never end unknown keep this default, which cannot tell.
    async fn outcome(
        &self,
        commit: u64,
        patience: std::time::Duration,
    ) -> Result<Option<Committed>> {
        let _ = patience;
        Err(Error::System(format!(
            "this system cannot learn the outcome of commit {commit}"
        )))
    }
    /// Runs the futures `make(0..clients)` on this thread until all finish. Systems
    /// whose calls block run them one after another, so they get one client per
    /// thread ([`System::max_clients_per_thread`]).
    fn run_clients<'a, T>(
        &'a self,
        clients: usize,
        make: impl FnMut(usize) -> ClientFuture<'a, T>,
    ) -> Vec<T>;
}

/// A system under test, set up and loaded, shared by the runner's threads.
pub trait System: Sync {
    type Engine: Engine;
    /// `rsi`, `2pc` or `postgres`.
    fn name(&self) -> &'static str;
    /// `sim`, `shm`, `tcp` (or `tcp` for the baselines' sockets).
    fn backend(&self) -> String;
    /// An engine for runner thread `thread`.
    fn engine(&self, thread: usize) -> Result<Self::Engine>;
    /// Clients one engine can run concurrently (1 when its calls block).
    fn max_clients_per_thread(&self) -> usize;
    /// Creates the tables and loads the generated data of `scale`, reporting rows
    /// loaded so far through `progress(rel, rows_done, rows_total)`.
    fn load(&self, scale: &Scale, progress: &(dyn Fn(Rel, u64, u64) + Sync)) -> Result<()>;
}

/// Runs a future to completion on this thread. For systems whose calls block, their
/// futures finish at the first poll; anything else is polled again until it does.
pub fn block_on<F: Future>(future: F) -> F::Output {
    let mut future = std::pin::pin!(future);
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    loop {
        if let std::task::Poll::Ready(out) = future.as_mut().poll(&mut cx) {
            return out;
        }
        std::thread::yield_now();
    }
}

/// [`Engine::run_clients`] for systems whose calls block: the clients run one after
/// another, each to its end.
pub fn run_clients_in_turn<'a, T>(
    clients: usize,
    mut make: impl FnMut(usize) -> ClientFuture<'a, T>,
) -> Vec<T> {
    (0..clients).map(|i| block_on(make(i))).collect()
}
