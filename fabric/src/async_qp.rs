//! Futures over work requests, driven by polling a completion queue.
//!
//! This is the coroutine style of FORD and Motor: one thread keeps many transactions or
//! operators in flight, each awaiting its own work requests, and whichever future is
//! polled drains the shared completion queue and files every completion under the
//! request it belongs to. Pending futures re-schedule themselves at once (busy
//! polling, as an RDMA worker does), so any executor drives them; a single-threaded
//! one (`futures::executor::block_on` over `join_all`) is the intended use.
//!
//! A batch is posted with one doorbell and only its last request signaled: on RC a
//! signaled completion implies every earlier request completed, and an error on any
//! request completes that request whether signaled or not. A batch longer than the
//! room left in the send queue goes in pieces, each posted once completions free
//! room; so that its own unsignaled requests can never fill the queue with nothing
//! to retire them, a long batch also signals every [`SIGNAL_EVERY`]th request (or
//! more often, on a shallower queue), and only the last one's completion resolves it.

use crate::device::{CompletionQueue, QueuePair};
use crate::error::{FabricError, Result};
use crate::sync::{self, Mutex};
use crate::wr::{Completion, SendWr};
use slab::Slab;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

const SLOT_BITS: u32 = 24;
const GEN_BITS: u32 = 24;
const MAX_BATCH: usize = 1 << 16;
/// In a long batch, every this-many-th request is signaled too (see the module doc).
pub const SIGNAL_EVERY: usize = 256;

fn token(slot: usize, generation: u32) -> u64 {
    slot as u64 | ((generation as u64 & ((1 << GEN_BITS) - 1)) << SLOT_BITS)
}

fn wr_id(token: u64, index: usize) -> u64 {
    token | ((index as u64) << (SLOT_BITS + GEN_BITS))
}

fn split(wr_id: u64) -> (usize, u32, usize) {
    let slot = (wr_id & ((1 << SLOT_BITS) - 1)) as usize;
    let generation = ((wr_id >> SLOT_BITS) & ((1 << GEN_BITS) - 1)) as u32;
    let index = (wr_id >> (SLOT_BITS + GEN_BITS)) as usize;
    (slot, generation, index)
}

struct Slot {
    generation: u32,
    /// The index of the batch's last request: only its completion (or an error on
    /// any) resolves the batch.
    last: usize,
    result: Option<Result<()>>,
    abandoned: bool,
}

struct DriverState {
    slots: Slab<Slot>,
    next_generation: u32,
    scratch: Vec<Completion>,
}

/// Owns a completion queue and files its completions under the futures awaiting them.
/// The completion queue must serve only queue pairs driven through this driver.
pub struct CqDriver {
    cq: Arc<dyn CompletionQueue>,
    state: Mutex<DriverState>,
}

impl CqDriver {
    pub fn new(cq: Arc<dyn CompletionQueue>) -> Arc<CqDriver> {
        Arc::new(CqDriver {
            cq,
            state: Mutex::new(DriverState {
                slots: Slab::new(),
                next_generation: 0,
                scratch: vec![Completion::default(); 64],
            }),
        })
    }

    pub fn cq(&self) -> &Arc<dyn CompletionQueue> {
        &self.cq
    }

    fn open(&self, last: usize) -> u64 {
        let mut st = sync::lock(&self.state);
        let generation = st.next_generation;
        st.next_generation = st.next_generation.wrapping_add(1) & ((1 << GEN_BITS) - 1);
        let slot = st.slots.insert(Slot {
            generation,
            last,
            result: None,
            abandoned: false,
        });
        assert!(slot < 1 << SLOT_BITS, "more than 2^24 operations in flight");
        token(slot, generation)
    }

    /// Polls the completion queue once and files what it finds.
    pub fn poll(&self) -> Result<()> {
        self.file_completions(&mut sync::lock(&self.state))
    }

    /// The result of `token`'s batch if it is in, polling the completion queue once
    /// if it is not yet, under one acquisition of the driver's lock (a future's every
    /// poll comes here).
    fn take_or_poll(&self, token: u64) -> Result<Option<Result<()>>> {
        let mut st = sync::lock(&self.state);
        if let Some(result) = Self::take_locked(&mut st, token) {
            return Ok(Some(result));
        }
        self.file_completions(&mut st)?;
        Ok(Self::take_locked(&mut st, token))
    }

    fn file_completions(&self, st: &mut DriverState) -> Result<()> {
        let n = self.cq.poll(&mut st.scratch)?;
        for wc in &st.scratch[..n] {
            let (slot, generation, index) = split(wc.wr_id);
            let Some(entry) = st.slots.get_mut(slot) else {
                continue;
            };
            if entry.generation != generation
                || entry.result.is_some()
                || (wc.status.is_ok() && index != entry.last && !entry.abandoned)
            {
                // A flush after an earlier error resolved the batch, a stale id, or a
                // long batch's intermediate signal.
                continue;
            }
            if entry.abandoned {
                st.slots.remove(slot);
                continue;
            }
            entry.result = Some(if wc.status.is_ok() {
                Ok(())
            } else {
                Err(FabricError::Completion {
                    status: wc.status,
                    index,
                })
            });
        }
        Ok(())
    }

    fn take_locked(st: &mut DriverState, token: u64) -> Option<Result<()>> {
        let (slot, generation, _) = split(token);
        let entry = st.slots.get_mut(slot)?;
        debug_assert_eq!(entry.generation, generation);
        let result = entry.result.take()?;
        st.slots.remove(slot);
        Some(result)
    }

    /// Forgets `token`'s batch. `completes`: a signaled request of it was posted, so a
    /// completion is still to come and removes the slot when it is filed; otherwise
    /// only an error could come, which finds no slot and is dropped.
    fn abandon(&self, token: u64, completes: bool) {
        let (slot, generation, _) = split(token);
        let mut st = sync::lock(&self.state);
        if let Some(entry) = st.slots.get_mut(slot)
            && entry.generation == generation
        {
            if entry.result.is_some() || !completes {
                st.slots.remove(slot);
            } else {
                entry.abandoned = true;
            }
        }
    }

    /// Operations posted and not yet resolved.
    pub fn in_flight(&self) -> usize {
        sync::lock(&self.state).slots.len()
    }
}

/// A queue pair whose work requests are awaited as futures.
pub struct AsyncQp {
    qp: Arc<dyn QueuePair>,
    driver: Arc<CqDriver>,
    /// A long batch signals every this-many-th request (see the module doc).
    signal_every: usize,
}

impl AsyncQp {
    /// `driver` must own the queue pair's send completion queue.
    pub fn new(qp: Arc<dyn QueuePair>, driver: Arc<CqDriver>) -> AsyncQp {
        let signal_every = SIGNAL_EVERY.min(qp.send_queue_depth().max(1) as usize);
        AsyncQp {
            qp,
            driver,
            signal_every,
        }
    }

    pub fn qp(&self) -> &Arc<dyn QueuePair> {
        &self.qp
    }

    pub fn driver(&self) -> &Arc<CqDriver> {
        &self.driver
    }

    /// Posts `wrs` with one doorbell and resolves when all have completed, or with the
    /// first error (`FabricError::Completion` naming the failed request's index). The
    /// requests' `wr_id` and `signaled` fields are replaced.
    pub fn run<'a, 'w>(&'a self, wrs: &'a [SendWr<'w>]) -> Batch<'a, 'w> {
        Batch {
            qp: self,
            wrs: Wrs::Many(wrs),
            token: None,
            posted: 0,
        }
    }

    /// [`AsyncQp::run`] that sets the requests' `wr_id` and `signaled` fields in
    /// `wrs` itself instead of in a copy: the caller's batch is posted as it is.
    pub fn run_in_place<'a, 'w>(&'a self, wrs: &'a mut [SendWr<'w>]) -> Batch<'a, 'w> {
        Batch {
            qp: self,
            wrs: Wrs::InPlace(wrs),
            token: None,
            posted: 0,
        }
    }

    /// One work request as a future.
    pub fn run_one<'a, 'w>(&'a self, wr: SendWr<'w>) -> Batch<'a, 'w> {
        Batch {
            qp: self,
            wrs: Wrs::One(wr),
            token: None,
            posted: 0,
        }
    }

    /// Posts `wrs[from..]` as part of the batch `token` (a new one if `None`).
    fn post(&self, wrs: &mut Wrs<'_, '_>, token: Option<u64>, from: usize) -> Result<Posted> {
        let len = wrs.len();
        if len == 0 || len > MAX_BATCH {
            return Err(FabricError::InvalidWorkRequest(format!(
                "a batch holds 1 to {MAX_BATCH} work requests, got {len}"
            )));
        }
        let token = token.unwrap_or_else(|| self.driver.open(len - 1));
        let last = len - 1;
        let signaled = |i: usize| i == last || (i + 1).is_multiple_of(self.signal_every);
        let result = crate::doorbell::async_post(|| match wrs {
            Wrs::One(wr) => {
                let mut wr = *wr;
                wr.wr_id = wr_id(token, 0);
                wr.signaled = true;
                self.qp.post_send(std::slice::from_ref(&wr))
            }
            Wrs::InPlace(list) => {
                for (i, wr) in list.iter_mut().enumerate().skip(from) {
                    wr.wr_id = wr_id(token, i);
                    wr.signaled = signaled(i);
                }
                self.qp.post_send(&list[from..])
            }
            Wrs::Many(list) => {
                // Most batches are a few requests: no allocation for them.
                let batch: smallvec::SmallVec<[SendWr<'_>; 8]> = list
                    .iter()
                    .enumerate()
                    .skip(from)
                    .map(|(i, wr)| SendWr {
                        wr_id: wr_id(token, i),
                        signaled: signaled(i),
                        ..*wr
                    })
                    .collect();
                self.qp.post_send(&batch)
            }
        });
        match result {
            Ok(()) => Ok(Posted::All(token)),
            Err(FabricError::Post { index, source })
                if matches!(*source, FabricError::QueueFull { .. }) =>
            {
                Ok(Posted::Part {
                    token,
                    posted: from + index,
                })
            }
            Err(e) => {
                let (posted, e) = match e {
                    FabricError::Post { index, source } => (
                        from + index,
                        FabricError::Post {
                            index: from + index,
                            source,
                        },
                    ),
                    e => (from, e),
                };
                self.driver.abandon(token, self.signals_within(len, posted));
                Err(e)
            }
        }
    }
}

impl AsyncQp {
    /// Whether the first `posted` requests of a batch of `len` include a signaled one.
    fn signals_within(&self, len: usize, posted: usize) -> bool {
        posted == len || posted >= self.signal_every
    }
}

/// How far a post got.
enum Posted {
    /// Every request of the batch is posted.
    All(u64),
    /// The send queue filled up after `posted` of the batch's requests.
    Part { token: u64, posted: usize },
}

enum Wrs<'a, 'w> {
    One(SendWr<'w>),
    Many(&'a [SendWr<'w>]),
    InPlace(&'a mut [SendWr<'w>]),
}

impl Wrs<'_, '_> {
    fn len(&self) -> usize {
        match self {
            Wrs::One(_) => 1,
            Wrs::Many(list) => list.len(),
            Wrs::InPlace(list) => list.len(),
        }
    }
}

/// The future of a posted batch (see [`AsyncQp::run`]).
pub struct Batch<'a, 'w> {
    qp: &'a AsyncQp,
    wrs: Wrs<'a, 'w>,
    token: Option<u64>,
    /// Requests of the batch posted so far.
    posted: usize,
}

impl Future for Batch<'_, '_> {
    type Output = Result<()>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        let this = &mut *self;
        let token = match this.token {
            Some(t) if this.posted == this.wrs.len() => t,
            token => match this.qp.post(&mut this.wrs, token, this.posted) {
                Ok(Posted::All(t)) => {
                    this.token = Some(t);
                    this.posted = this.wrs.len();
                    t
                }
                Ok(Posted::Part { token, posted }) => {
                    // The send queue is full of requests whose completions nobody has
                    // polled yet: poll, then post the rest.
                    this.token = Some(token);
                    this.posted = posted;
                    this.qp.driver.poll()?;
                    cx.waker().wake_by_ref();
                    return Poll::Pending;
                }
                Err(e) => {
                    this.token = None;
                    return Poll::Ready(Err(e));
                }
            },
        };
        // A batch posted this very poll may be complete already: an in-process backend
        // executes it as it is posted.
        match this.qp.driver.take_or_poll(token) {
            Err(e) => Poll::Ready(Err(e)),
            Ok(Some(result)) => {
                this.token = None;
                this.wrs = Wrs::Many(&[]);
                this.posted = 0;
                Poll::Ready(result)
            }
            Ok(None) => {
                cx.waker().wake_by_ref();
                Poll::Pending
            }
        }
    }
}

impl Drop for Batch<'_, '_> {
    fn drop(&mut self) {
        if let Some(token) = self.token {
            let completes = self.qp.signals_within(self.wrs.len(), self.posted);
            self.qp.driver.abandon(token, completes);
        }
    }
}

#[cfg(all(test, not(fabric_loom)))]
mod tests {
    use super::*;

    #[test]
    fn wr_ids_round_trip() {
        let t = token(12345, 777);
        assert_eq!(split(wr_id(t, 65535)), (12345, 777, 65535));
        assert_eq!(split(wr_id(t, 0)), (12345, 777, 0));
    }
}
