//! Persist without blocking: for a data-path thread (a compute node's worker running
//! many transactions as coroutines) that must not wait for a memory server's fsync.
//!
//! [`Persister::submit`] starts the RPC on the client's tokio runtime and returns a
//! [`Ticket`] at once; [`Persister::poll`] is one atomic load. Many Persists may be in
//! flight at once: HTTP/2 multiplexes them on the client's one connection, and the
//! server's group commit lets one fsync answer all that arrive together.

use crate::blocking;
use crate::client::{Client, PersistRange, persist_later, persist_request};
use crate::proto::memory_server_client::MemoryServerClient;
use crate::session::SESSION_METADATA;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use tokio::sync::Semaphore;
use tonic::Request;
use tonic::metadata::AsciiMetadataValue;
use tonic::transport::Channel;

/// Where a submitted Persist stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PersistStatus {
    /// Not answered yet.
    Pending,
    /// On the server's disk.
    Done,
    /// Refused or failed (why); it may or may not have taken effect.
    Failed(String),
    /// Refused (why) only until the replicated primary has attached to its backup
    /// again, which it does by itself: the same Persist, submitted again, may be
    /// acknowledged then ([`crate::ClientError::persist_later`]).
    Later(String),
}

const PENDING: u8 = 0;
const DONE: u8 = 1;
const FAILED: u8 = 2;
const LATER: u8 = 3;

/// One submitted Persist. Cloning it gives another handle on the same request.
#[derive(Clone, Debug)]
pub struct Ticket(Arc<TicketState>);

#[derive(Debug, Default)]
struct TicketState {
    state: AtomicU8,
    /// Written once, before `state` turns FAILED or LATER.
    error: OnceLock<String>,
    /// For [`Persister::wait`] only; `poll` never takes it.
    lock: Mutex<()>,
    finished: Condvar,
}

impl TicketState {
    fn finish(&self, result: Result<(), String>) {
        self.finish_as(result.map_err(|why| (why, FAILED)));
    }

    /// Finishes done, or with the error and its state (FAILED or LATER).
    fn finish_as(&self, result: Result<(), (String, u8)>) {
        if self.state.load(Ordering::Acquire) != PENDING {
            return;
        }
        let state = match result {
            Ok(()) => DONE,
            Err((why, state)) => {
                let _ = self.error.set(why);
                state
            }
        };
        if self
            .state
            .compare_exchange(PENDING, state, Ordering::Release, Ordering::Relaxed)
            .is_ok()
        {
            // Taking the lock orders the store before a waiter's check-then-sleep.
            drop(self.lock.lock().unwrap_or_else(|p| p.into_inner()));
            self.finished.notify_all();
        }
    }

    fn status(&self) -> PersistStatus {
        match self.state.load(Ordering::Acquire) {
            PENDING => PersistStatus::Pending,
            DONE => PersistStatus::Done,
            LATER => PersistStatus::Later(self.error.get().cloned().unwrap_or_default()),
            _ => PersistStatus::Failed(self.error.get().cloned().unwrap_or_default()),
        }
    }
}

/// Fails the ticket if the RPC's task ends without an answer (the runtime stopped).
struct FinishOnDrop(Arc<TicketState>);

impl Drop for FinishOnDrop {
    fn drop(&mut self) {
        self.0.finish(Err(
            "the memory-server client was closed before the Persist was answered".into(),
        ));
    }
}

/// Sends Persists in the background for one session. `Send + Sync`; every call is
/// non-blocking except [`Persister::wait`].
///
/// It uses the session of the client it was made from, so the client must stay open
/// while Persists are submitted: a closed session fails them (UNAUTHENTICATED).
#[derive(Clone)]
pub struct Persister {
    runtime: tokio::runtime::Handle,
    rpc: MemoryServerClient<Channel>,
    header: AsciiMetadataValue,
    /// Bounds the RPCs on the wire: thousands submitted at once otherwise overrun the
    /// channel's request buffer and fail with a transport error. Submitted requests
    /// beyond it wait (in submit order) on the runtime, not in `submit`.
    in_flight: Arc<Semaphore>,
}

/// RPCs one persister has on the wire at once; more than enough for group commit,
/// which only needs requests to arrive while an fsync runs.
pub const MAX_PERSISTS_IN_FLIGHT: usize = 256;

impl Persister {
    /// A persister on `client`'s session and runtime.
    pub fn new(client: &blocking::Client) -> Persister {
        Persister::with_runtime(client.inner(), client.runtime())
    }

    /// A persister on `client`'s session whose RPCs run on `runtime`.
    pub fn with_runtime(client: &Client, runtime: tokio::runtime::Handle) -> Persister {
        let (rpc, header) = client.rpc_parts();
        Persister {
            runtime,
            rpc,
            header,
            in_flight: Arc::new(Semaphore::new(MAX_PERSISTS_IN_FLIGHT)),
        }
    }

    /// Starts a Persist of `ranges` and returns without waiting for it.
    pub fn submit(&self, ranges: Vec<PersistRange>) -> Ticket {
        let state = Arc::new(TicketState::default());
        let finish = FinishOnDrop(state.clone());
        let mut rpc = self.rpc.clone();
        let mut req = Request::new(persist_request(&ranges));
        req.metadata_mut()
            .insert(SESSION_METADATA, self.header.clone());
        let in_flight = self.in_flight.clone();
        // If the runtime is gone the task is dropped unrun, and `finish` fails it.
        self.runtime.spawn(async move {
            // Never closed, so the permit always comes.
            let _permit = in_flight.acquire_owned().await;
            let result = rpc.persist(req).await.map(|_| ()).map_err(|s| {
                let why = format!("Persist failed: {} ({:?})", s.message(), s.code());
                (why, if persist_later(&s) { LATER } else { FAILED })
            });
            finish.0.finish_as(result);
        });
        Ticket(state)
    }

    /// Where `ticket` stands; never blocks.
    pub fn poll(&self, ticket: &Ticket) -> PersistStatus {
        ticket.0.status()
    }

    /// Blocks until `ticket` is answered. Refused inside a tokio runtime, whose thread
    /// (perhaps the one that would answer) it would block.
    pub fn wait(&self, ticket: &Ticket) -> Result<(), String> {
        if tokio::runtime::Handle::try_current().is_ok() {
            return Err(
                "Persister::wait cannot block inside a tokio runtime; poll the ticket instead"
                    .into(),
            );
        }
        let t = &ticket.0;
        let mut guard = t.lock.lock().unwrap_or_else(|p| p.into_inner());
        while t.state.load(Ordering::Acquire) == PENDING {
            guard = t.finished.wait(guard).unwrap_or_else(|p| p.into_inner());
        }
        drop(guard);
        match t.status() {
            PersistStatus::Failed(why) | PersistStatus::Later(why) => Err(why),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tickets_finish_once_and_wake_waiters() {
        let t = Arc::new(TicketState::default());
        assert_eq!(t.status(), PersistStatus::Pending);
        let waiter = {
            let t = t.clone();
            std::thread::spawn(move || {
                let mut g = t.lock.lock().unwrap();
                while t.state.load(Ordering::Acquire) == PENDING {
                    g = t.finished.wait(g).unwrap();
                }
            })
        };
        t.finish(Ok(()));
        waiter.join().unwrap();
        assert_eq!(t.status(), PersistStatus::Done);
        // A later outcome (the task's drop guard) does not overwrite the first.
        t.finish(Err("late".into()));
        assert_eq!(t.status(), PersistStatus::Done);

        let f = TicketState::default();
        f.finish(Err("refused".into()));
        assert_eq!(f.status(), PersistStatus::Failed("refused".into()));

        // A task dropped unrun (its runtime stopped) fails its ticket.
        let unrun = Arc::new(TicketState::default());
        drop(FinishOnDrop(unrun.clone()));
        match unrun.status() {
            PersistStatus::Failed(why) => assert!(why.contains("closed"), "{why}"),
            other => panic!("{other:?}"),
        }
    }

    fn assert_send_sync<T: Send + Sync>() {}

    #[test]
    fn persisters_and_tickets_cross_threads() {
        assert_send_sync::<Persister>();
        assert_send_sync::<Ticket>();
    }
}
