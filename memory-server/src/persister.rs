//! Persist without blocking: for a data-path thread (a compute node's worker running
//! many transactions as coroutines) that must not wait for a memory server's fsync.
//!
//! [`Persister::submit`] hands the Persist to a sender task on the client's tokio
//! runtime and returns a [`Ticket`] at once; [`Persister::poll`] is one atomic load.
//! Many Persists may be under way at once: those submitted while earlier ones are on
//! the wire go together in the next RPC, and the server's group commit lets one fsync
//! answer all the RPCs that arrive together.

use crate::MAX_PERSIST_BYTES;
use crate::blocking;
use crate::client::{Client, PersistRange, persist_later, persist_request};
use crate::proto::memory_server_client::MemoryServerClient;
use crate::session::SESSION_METADATA;
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};
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
/// Disarmed when another guard (a copy sent alone) answers for the ticket.
struct FinishOnDrop {
    state: Arc<TicketState>,
    armed: bool,
}

impl FinishOnDrop {
    fn new(state: Arc<TicketState>) -> FinishOnDrop {
        FinishOnDrop { state, armed: true }
    }
}

impl Drop for FinishOnDrop {
    fn drop(&mut self) {
        if self.armed {
            self.state.finish(Err(
                "the memory-server client was closed before the Persist was answered".into(),
            ));
        }
    }
}

/// Sends Persists in the background for one session. `Send + Sync`; every call is
/// non-blocking except [`Persister::wait`].
///
/// One RPC is on the wire at a time. Persists submitted meanwhile wait, and the next
/// RPC carries all of them (their ranges, duplicates sent once): under load each
/// Persist would otherwise be an RPC of its own, and the per-RPC work (HTTP/2
/// framing, the server's handoff to its copying thread, waking the waiters) was
/// where a durable TPC-W run's CPU went. A batch that fails is sent again one Persist
/// per RPC, so each gets its own answer: a bad range, or a guard word that stays
/// locked, fails only the Persist that named it. A batch held up (a guard word locked
/// by a dead node until its recovery, say) holds up neither its other Persists nor
/// the later ones: once it has been out [`BATCH_SPLIT`], each of its Persists is also
/// sent on its own (a Persist copies what the memory holds, so twice is harmless; the
/// first answer counts), and once every batch on the wire has been out [`BATCH_STALL`],
/// the waiting Persists go out in a batch beside them, up to [`MAX_BATCHES_IN_FLIGHT`]
/// (checked on every submit and by each held-up batch's timer: the Persist that would
/// unlock the word, a recovery's, may be the last one submitted).
///
/// It uses the session of the client it was made from, so the client must stay open
/// while Persists are submitted: a closed session fails them (UNAUTHENTICATED).
#[derive(Clone)]
pub struct Persister {
    runtime: tokio::runtime::Handle,
    rpc: MemoryServerClient<Channel>,
    header: AsciiMetadataValue,
    queue: Arc<Mutex<Queue>>,
    next_sender: Arc<AtomicU64>,
    /// Bounds the RPCs of Persists sent again one by one after a failed batch:
    /// thousands at once overrun the channel's request buffer and fail with a
    /// transport error.
    alone: Arc<Semaphore>,
}

/// Batched RPCs one persister has on the wire at most, all but one of them beside
/// batches held up. With more than one on the wire in the normal course, the
/// waiting Persists only split into smaller batches: a durable TPC-W checkout run
/// (shm, 64 clients, two runs each) made 6.5–8.4 k txn/s with one, 6.1–7.2 k with
/// two, 5.5–6.6 k with four and 4.3–6.3 k with eight.
pub const MAX_BATCHES_IN_FLIGHT: usize = 8;

/// How long a batch is out before it counts as held up, and a Persist submitted then
/// goes out in a batch beside it. A batch normally takes about a millisecond (one
/// fsync and a round trip).
pub const BATCH_STALL: Duration = Duration::from_millis(20);

/// How long a batch is out before each of its Persists is also sent on its own. Far
/// longer than [`BATCH_STALL`]: a slow fsync (a checkpoint's writes, say) holds a
/// batch up for tens of milliseconds now and then, and splitting every such batch
/// into an RPC per Persist cost more than it saved (a durable TPC-W checkout run with
/// the split at 20 ms: 3.9–9.3 k txn/s against 7.6–9.3 k without, 3 pairs). A lock
/// held by a dead node lasts a lease (250 ms by default) and its recovery.
pub const BATCH_SPLIT: Duration = Duration::from_millis(250);

/// RPCs of Persists sent one by one (after a failed batch) on the wire at once.
pub const MAX_PERSISTS_IN_FLIGHT: usize = 256;

/// Ranges one batch carries at most (a request is about 20 bytes a range, far inside
/// a gRPC message).
const MAX_BATCH_RANGES: usize = 16 * 1024;

/// Persists waiting for an RPC, and the RPCs under way.
#[derive(Default)]
struct Queue {
    waiting: VecDeque<Waiting>,
    /// Sender tasks running (each sends batches until nothing waits), by id: when the
    /// batch each has on the wire went out.
    senders: HashMap<u64, Instant>,
}

impl Queue {
    /// Whether a Persist just queued needs a sender of its own: none runs, or every
    /// one's batch is held up.
    fn needs_sender(&self) -> bool {
        self.senders.is_empty()
            || (self.senders.len() < MAX_BATCHES_IN_FLIGHT
                && self
                    .senders
                    .values()
                    .all(|out| out.elapsed() >= BATCH_STALL))
    }
}

struct Waiting {
    ranges: Vec<PersistRange>,
    /// Its ticket, finished (failed) if dropped before its answer: the runtime stopped.
    state: FinishOnDrop,
}

impl Waiting {
    fn finish_as(&self, result: Result<(), (String, u8)>) {
        self.state.state.finish_as(result);
    }
}

impl Persister {
    /// A persister on `client`'s session and runtime.
    pub fn new(client: &blocking::Client) -> Persister {
        Persister::with_runtime(client.inner(), client.runtime())
    }

    /// A persister on `client`'s session whose RPCs run on `runtime`, which needs its
    /// time driver (`enable_time` or `enable_all`): a batch held up is noticed by a
    /// timer.
    pub fn with_runtime(client: &Client, runtime: tokio::runtime::Handle) -> Persister {
        let (rpc, header) = client.rpc_parts();
        Persister {
            runtime,
            rpc,
            header,
            queue: Arc::default(),
            next_sender: Arc::default(),
            alone: Arc::new(Semaphore::new(MAX_PERSISTS_IN_FLIGHT)),
        }
    }

    /// Starts a Persist of `ranges` and returns without waiting for it.
    pub fn submit(&self, ranges: Vec<PersistRange>) -> Ticket {
        let state = Arc::new(TicketState::default());
        let waiting = Waiting {
            ranges,
            state: FinishOnDrop::new(state.clone()),
        };
        lock(&self.queue).waiting.push_back(waiting);
        self.start_sender_if_needed();
        Ticket(state)
    }

    /// Starts a sender if a Persist waits and no sender will take it soon: none runs,
    /// or every batch on the wire is held up. Called on every submit, and by a sender
    /// whose batch is held up (Persists queued behind it may be what would unlock it:
    /// a recovery's, say).
    fn start_sender_if_needed(&self) {
        let sender = {
            let mut queue = lock(&self.queue);
            (!queue.waiting.is_empty() && queue.needs_sender()).then(|| {
                let id = self.next_sender.fetch_add(1, Ordering::Relaxed);
                // Counted as out already, so that Persists submitted before its task
                // runs go with it rather than start senders of their own.
                queue.senders.insert(id, Instant::now());
                // Made here, not in the task, so that a task dropped unrun (the
                // runtime is gone) still fails what waits.
                Sender {
                    persister: self.clone(),
                    id,
                    done: false,
                }
            })
        };
        if let Some(sender) = sender {
            self.runtime.spawn(sender.run());
        }
    }

    /// One RPC for `ranges`, in the persister's session.
    async fn send(&self, ranges: &[PersistRange]) -> Result<(), (String, u8)> {
        let mut req = Request::new(persist_request(ranges));
        req.metadata_mut()
            .insert(SESSION_METADATA, self.header.clone());
        self.rpc
            .clone()
            .persist(req)
            .await
            .map(|_| ())
            .map_err(|s| {
                let why = format!("Persist failed: {} ({:?})", s.message(), s.code());
                (why, if persist_later(&s) { LATER } else { FAILED })
            })
    }

    /// Sends a copy of `waiting` in an RPC of its own, which answers the ticket unless
    /// the batch it is in answers it first; the copy's guard now fails the ticket if
    /// the runtime stops.
    fn send_copy_alone(&self, waiting: &mut Waiting) {
        waiting.state.armed = false;
        self.send_alone(Waiting {
            ranges: waiting.ranges.clone(),
            state: FinishOnDrop::new(waiting.state.state.clone()),
        });
    }

    /// Sends one waiting Persist in an RPC of its own.
    fn send_alone(&self, waiting: Waiting) {
        let persister = self.clone();
        self.runtime.spawn(async move {
            // Never closed, so the permit always comes.
            let _permit = persister.alone.acquire().await;
            let result = persister.send(&waiting.ranges).await;
            waiting.finish_as(result);
        });
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

/// A task that sends the waiting Persists in batches until none waits.
struct Sender {
    persister: Persister,
    id: u64,
    /// It counted itself out of the queue's senders (having found nothing waiting).
    done: bool,
}

impl Sender {
    async fn run(mut self) {
        while let Some(mut batch) = self.take_batch() {
            let mut ranges = Vec::new();
            let mut seen = HashSet::new();
            for w in &batch {
                ranges.extend(w.ranges.iter().filter(|r| seen.insert(**r)));
            }
            let rpc = self.persister.send(&ranges);
            tokio::pin!(rpc);
            let mut split = false;
            let sent = Instant::now();
            let result = loop {
                tokio::select! {
                    result = &mut rpc => break result,
                    () = tokio::time::sleep(BATCH_STALL) => {
                        // Held up long, most likely by one Persist's guard word: each
                        // is sent again on its own too (a Persist copies what the
                        // memory holds, so twice is harmless) and takes the first
                        // answer.
                        if !split && batch.len() > 1 && sent.elapsed() >= BATCH_SPLIT {
                            split = true;
                            batch.iter_mut().for_each(|w| self.persister.send_copy_alone(w));
                        }
                        self.persister.start_sender_if_needed();
                    }
                }
            };
            match result {
                Ok(()) => batch.iter().for_each(|w| w.finish_as(Ok(()))),
                // Each Persist's own RPC answers it.
                Err(_) if split => {}
                // The backup is away: every Persist of the batch is refused alike.
                Err((why, LATER)) => batch
                    .iter()
                    .for_each(|w| w.finish_as(Err((why.clone(), LATER)))),
                Err(failed) if batch.len() == 1 => batch[0].finish_as(Err(failed)),
                // Which Persist failed it, and how the others fare, only their own
                // RPCs tell.
                Err(_) => batch.into_iter().for_each(|w| self.persister.send_alone(w)),
            }
        }
    }

    /// The next batch: waiting Persists in submit order, up to the server's bytes per
    /// request; `None` (and this sender counted out) when nothing waits.
    fn take_batch(&mut self) -> Option<Vec<Waiting>> {
        let mut queue = lock(&self.persister.queue);
        if queue.waiting.is_empty() {
            queue.senders.remove(&self.id);
            self.done = true;
            return None;
        }
        queue.senders.insert(self.id, Instant::now());
        let mut batch = Vec::new();
        let (mut bytes, mut ranges) = (0u64, 0usize);
        while let Some(next) = queue.waiting.front() {
            let len: u64 = next.ranges.iter().map(|r| r.len).sum();
            let fits = bytes.saturating_add(len) <= MAX_PERSIST_BYTES
                && ranges + next.ranges.len() <= MAX_BATCH_RANGES;
            if !batch.is_empty() && !fits {
                break;
            }
            bytes = bytes.saturating_add(len);
            ranges += next.ranges.len();
            batch.extend(queue.waiting.pop_front());
        }
        Some(batch)
    }
}

impl Drop for Sender {
    /// A sender dropped before it found the queue empty: its runtime stopped (or the
    /// task was cancelled), so nothing will send what waits; fail it.
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let waiting = {
            let mut queue = lock(&self.persister.queue);
            queue.senders.remove(&self.id);
            if !queue.senders.is_empty() {
                return;
            }
            std::mem::take(&mut queue.waiting)
        };
        drop(waiting);
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
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
        drop(FinishOnDrop::new(unrun.clone()));
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
