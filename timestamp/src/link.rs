//! A slot handle's connection to the oracle: one RC queue pair and its completion
//! queue, used by nobody else, and a small registered scratch area.
//!
//! Requests that return data (READs, CAS, renewals) each take one of [`BUFFERS`]
//! scratch buffers, are signaled, and are awaited by polling the completion queue,
//! either spinning (`run`) or as a future (`read_async`), so several coroutines on
//! one thread can have reads in flight on one handle. Marks (FETCH_ADD) are posted
//! unsignaled into a shared sink word, except every [`SIGNAL_EVERY`]-th, whose
//! completion retires the ones before it from the send queue (selective signaling).
//!
//! The link is single-threaded (`Cell`s, no locks): a handle belongs to one thread.

use crate::error::{OracleError, Result};
use fabric::{
    Access, Completion, CompletionQueue, Device, FabricError, QueuePair, Region, RemoteRegion,
    SendWr,
};
use std::cell::{Cell, RefCell};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

/// Scratch buffers for requests that return data; also the most such requests one
/// handle has in flight.
pub(crate) const BUFFERS: usize = 8;
/// Bytes per scratch buffer: the largest READ the steady state issues.
pub(crate) const BUFFER_BYTES: u32 = 256;
/// One mark in this many is signaled. With the drain after each signaled post, the
/// send queue holds at most about twice this many marks plus the buffers' requests.
pub(crate) const SIGNAL_EVERY: u32 = 32;
/// What the queue pair's `max_send_wr` must allow.
pub const MIN_SEND_QUEUE: u32 = 2 * SIGNAL_EVERY + BUFFERS as u32 + 8;
/// What the completion queue's capacity must allow.
pub const MIN_CQ_CAPACITY: u32 = BUFFERS as u32 + 8;

const SINK: u64 = BUFFERS as u64 * BUFFER_BYTES as u64;
const SCRATCH_BYTES: u64 = SINK + 8;
const KIND_BUFFER: u64 = 1 << 60;
const KIND_MARK: u64 = 2 << 60;
const KIND_MASK: u64 = 0xf << 60;
/// A completion that takes this long is a dead connection, not a slow one: hardware
/// reports a lost peer long before (transport retries), so this only guards against
/// a backend that loses a completion.
const PATIENCE: Duration = Duration::from_secs(30);

/// A request that returns data.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Op {
    /// READ `words` words (at most [`BUFFER_BYTES`] / 8).
    Read { remote: u64, words: u32 },
    /// CAS; returns the old value.
    Cas {
        remote: u64,
        compare: u64,
        swap: u64,
    },
    /// FETCH_ADD; returns the old value.
    FetchAdd { remote: u64, add: u64 },
}

impl Op {
    fn words(&self) -> usize {
        match self {
            Op::Read { words, .. } => *words as usize,
            Op::Cas { .. } | Op::FetchAdd { .. } => 1,
        }
    }
}

pub(crate) struct Link {
    qp: Arc<dyn QueuePair>,
    cq: Arc<dyn CompletionQueue>,
    scratch: Region,
    remote: RemoteRegion,
    /// Where the oracle starts in `remote`: offsets of requests are relative to it.
    base: u64,
    /// Buffers taken by a request.
    busy: Cell<u32>,
    /// Buffers whose request completed and whose data is not yet collected.
    done: Cell<u32>,
    /// Buffers whose future was dropped before its completion arrived: the NIC may
    /// still write them, so they are freed only when it has.
    abandoned: Cell<u32>,
    /// The first failed completion: the queue pair is in the error state from then on.
    failure: RefCell<Option<FabricError>>,
    /// Marks posted since the last signaled one.
    unsignaled: Cell<u32>,
    wcs: RefCell<[Completion; 16]>,
}

impl Link {
    /// `qp` must be an RC queue pair connected to the oracle's node whose send
    /// completions go to `cq`, both used by this link alone, with a send queue of at
    /// least [`MIN_SEND_QUEUE`] and a completion queue of at least
    /// [`MIN_CQ_CAPACITY`]. The oracle starts `base` bytes into `remote`.
    pub(crate) fn new(
        device: &dyn Device,
        qp: Arc<dyn QueuePair>,
        cq: Arc<dyn CompletionQueue>,
        remote: RemoteRegion,
        base: u64,
    ) -> Result<Link> {
        if cq.capacity() < MIN_CQ_CAPACITY {
            return Err(OracleError::InvalidConfig(format!(
                "the completion queue holds {} entries; the oracle client needs {MIN_CQ_CAPACITY}",
                cq.capacity()
            )));
        }
        let scratch = device.register(SCRATCH_BYTES, Access::LOCAL)?;
        Ok(Link {
            qp,
            cq,
            scratch,
            remote,
            base,
            busy: Cell::new(0),
            done: Cell::new(0),
            abandoned: Cell::new(0),
            failure: RefCell::new(None),
            unsignaled: Cell::new(0),
            wcs: RefCell::new([Completion::default(); 16]),
        })
    }

    pub(crate) fn remote(&self) -> RemoteRegion {
        self.remote
    }

    /// The remote address of the oracle's byte `offset`.
    fn at(&self, offset: u64) -> fabric::RemoteAddr {
        self.remote.at(self.base + offset)
    }

    fn check(&self) -> Result<()> {
        match &*self.failure.borrow() {
            Some(e) => Err(e.clone().into()),
            None => Ok(()),
        }
    }

    /// Scratch buffers that no request holds: how many requests [`Link::run`] can take
    /// now (fewer than [`BUFFERS`] while coroutines have reads in flight).
    pub(crate) fn idle_buffers(&self) -> usize {
        BUFFERS - self.busy.get().count_ones() as usize
    }

    fn take_buffer(&self) -> Option<usize> {
        let free = !self.busy.get() & ((1u32 << BUFFERS) - 1);
        if free == 0 {
            return None;
        }
        let i = free.trailing_zeros() as usize;
        self.busy.set(self.busy.get() | 1 << i);
        Some(i)
    }

    fn free_buffer(&self, i: usize) {
        self.busy.set(self.busy.get() & !(1 << i));
        self.done.set(self.done.get() & !(1 << i));
    }

    fn buffer_offset(i: usize) -> u64 {
        i as u64 * BUFFER_BYTES as u64
    }

    fn wr(&self, op: Op, buffer: usize) -> SendWr<'static> {
        let off = Self::buffer_offset(buffer);
        let id = KIND_BUFFER | buffer as u64;
        match op {
            Op::Read { remote, words } => {
                SendWr::read(id, self.scratch.buf(off, words * 8), self.at(remote))
            }
            Op::Cas {
                remote,
                compare,
                swap,
            } => SendWr::cas(id, self.scratch.buf(off, 8), self.at(remote), compare, swap),
            Op::FetchAdd { remote, add } => {
                SendWr::fetch_add(id, self.scratch.buf(off, 8), self.at(remote), add)
            }
        }
    }

    /// Posts with one doorbell; a full send queue is drained and retried, since
    /// selective signaling leaves retired-but-unpolled requests in it.
    fn post(&self, wrs: &[SendWr<'_>]) -> Result<()> {
        let mut rest = wrs;
        // The clock is read only once the queue is full: posting is the hot path.
        let mut since: Option<Instant> = None;
        loop {
            match self.qp.post_send(rest) {
                Ok(()) => return Ok(()),
                Err(FabricError::Post { index, source })
                    if matches!(*source, FabricError::QueueFull { .. }) =>
                {
                    rest = &rest[index..];
                    self.drain()?;
                    if since.get_or_insert_with(Instant::now).elapsed() > PATIENCE {
                        return Err(FabricError::Post { index, source }.into());
                    }
                    crate::spin();
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Polls the completion queue once and files what it finds.
    pub(crate) fn drain(&self) -> Result<()> {
        self.check()?;
        let mut wcs = self.wcs.borrow_mut();
        loop {
            let n = self.cq.poll(&mut wcs[..])?;
            for wc in &wcs[..n] {
                if !wc.status.is_ok() {
                    let e = FabricError::Completion {
                        status: wc.status,
                        index: 0,
                    };
                    *self.failure.borrow_mut() = Some(e.clone());
                    return Err(e.into());
                }
                if wc.wr_id & KIND_MASK == KIND_BUFFER {
                    let i = (wc.wr_id & !KIND_MASK) as usize;
                    if self.abandoned.get() & 1 << i != 0 {
                        self.abandoned.set(self.abandoned.get() & !(1 << i));
                        self.free_buffer(i);
                    } else {
                        self.done.set(self.done.get() | 1 << i);
                    }
                }
            }
            if n < wcs.len() {
                return Ok(());
            }
        }
    }

    /// Runs `ops` in one doorbell and waits for all of them; `out` receives each op's
    /// result words in order (READ: the words read; CAS: the old value).
    pub(crate) fn run(&self, ops: &[Op], out: &mut [u64]) -> Result<()> {
        self.check()?;
        let need: usize = ops.iter().map(Op::words).sum();
        if ops.len() > BUFFERS || out.len() < need {
            return Err(OracleError::InvalidConfig(format!(
                "internal: {} requests / {} result words exceed the scratch area",
                ops.len(),
                out.len()
            )));
        }
        let mut taken = [0usize; BUFFERS];
        for (k, slot) in taken.iter_mut().enumerate().take(ops.len()) {
            match self.take_buffer() {
                Some(i) => *slot = i,
                None => {
                    for &i in &taken[..k] {
                        self.free_buffer(i);
                    }
                    return Err(OracleError::InvalidConfig(
                        "all scratch buffers are in use by pending reads".into(),
                    ));
                }
            }
        }
        let mut wrs = [SendWr::read(0, self.scratch.buf(0, 8), self.remote.at(0)); BUFFERS];
        for (k, op) in ops.iter().enumerate() {
            wrs[k] = self.wr(*op, taken[k]);
        }
        let mask = taken[..ops.len()].iter().fold(0u32, |m, &i| m | 1 << i);
        let result = self.post(&wrs[..ops.len()]).and_then(|()| self.wait(mask));
        if result.is_ok() {
            let mut at = 0;
            for (k, op) in ops.iter().enumerate() {
                let n = op.words();
                self.copy_out(taken[k], &mut out[at..at + n])?;
                at += n;
            }
        }
        for &i in &taken[..ops.len()] {
            self.free_buffer(i);
        }
        result
    }

    fn wait(&self, mask: u32) -> Result<()> {
        let mut polls = 0u32;
        let mut since: Option<Instant> = None;
        loop {
            self.drain()?;
            if self.done.get() & mask == mask {
                return Ok(());
            }
            polls += 1;
            if polls & 1023 == 0 {
                let start = *since.get_or_insert_with(Instant::now);
                if start.elapsed() > PATIENCE {
                    return Err(OracleError::Fabric(FabricError::Backend(format!(
                        "no completion from the oracle's node for {PATIENCE:?}"
                    ))));
                }
            }
            crate::spin();
        }
    }

    fn copy_out(&self, buffer: usize, out: &mut [u64]) -> Result<()> {
        self.scratch
            .read_words(Self::buffer_offset(buffer), out)
            .map_err(Into::into)
    }

    pub(crate) fn read(&self, remote: u64, out: &mut [u64]) -> Result<()> {
        let words = out.len() as u32;
        self.run(&[Op::Read { remote, words }], out)
    }

    pub(crate) fn cas(&self, remote: u64, compare: u64, swap: u64) -> Result<u64> {
        let mut old = [0u64];
        self.run(
            &[Op::Cas {
                remote,
                compare,
                swap,
            }],
            &mut old,
        )?;
        Ok(old[0])
    }

    /// Posts FETCH_ADDs whose results nobody needs (marks and skips), one doorbell,
    /// unsignaled except when the signaling period is due.
    pub(crate) fn post_adds(&self, adds: &[(u64, u64)]) -> Result<()> {
        self.check()?;
        let mut signaled_any = false;
        for chunk in adds.chunks(SIGNAL_EVERY as usize) {
            let mut wrs =
                [SendWr::read(0, self.scratch.buf(0, 8), self.remote.at(0)); SIGNAL_EVERY as usize];
            for (k, &(remote, add)) in chunk.iter().enumerate() {
                let run = self.unsignaled.get() + 1;
                let signal = run >= SIGNAL_EVERY;
                self.unsignaled.set(if signal { 0 } else { run });
                signaled_any |= signal;
                wrs[k] =
                    SendWr::fetch_add(KIND_MARK, self.scratch.buf(SINK, 8), self.at(remote), add)
                        .signaled(signal);
            }
            self.post(&wrs[..chunk.len()])?;
        }
        if signaled_any {
            // Keeps the send queue short: the signaled completion retires the marks
            // before it only once polled.
            self.drain()?;
        }
        Ok(())
    }

    /// READ as a future: for coroutines sharing this link on one thread.
    pub(crate) fn read_async(&self, remote: u64, words: u32) -> ReadFuture<'_> {
        ReadFuture {
            link: self,
            remote,
            words,
            buffer: None,
        }
    }
}

/// A READ in flight on a [`Link`]; resolves to the words read.
pub(crate) struct ReadFuture<'a> {
    link: &'a Link,
    remote: u64,
    words: u32,
    buffer: Option<usize>,
}

impl Future for ReadFuture<'_> {
    type Output = Result<Vec<u64>>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let link = self.link;
        if let Err(e) = link.check() {
            return Poll::Ready(Err(e));
        }
        let buffer = match self.buffer {
            Some(b) => b,
            None => {
                let Some(b) = link.take_buffer() else {
                    // Every buffer is in flight: their completions free them.
                    if let Err(e) = link.drain() {
                        return Poll::Ready(Err(e));
                    }
                    cx.waker().wake_by_ref();
                    return Poll::Pending;
                };
                let op = Op::Read {
                    remote: self.remote,
                    words: self.words,
                };
                if let Err(e) = link.post(&[link.wr(op, b)]) {
                    link.free_buffer(b);
                    return Poll::Ready(Err(e));
                }
                self.buffer = Some(b);
                b
            }
        };
        if let Err(e) = link.drain() {
            return Poll::Ready(Err(e));
        }
        if link.done.get() & 1 << buffer == 0 {
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        let mut out = vec![0u64; self.words as usize];
        let copied = link.copy_out(buffer, &mut out);
        link.free_buffer(buffer);
        self.buffer = None;
        Poll::Ready(copied.map(|()| out))
    }
}

impl Drop for ReadFuture<'_> {
    fn drop(&mut self) {
        if let Some(b) = self.buffer {
            if self.link.done.get() & 1 << b != 0 {
                self.link.free_buffer(b);
            } else {
                self.link.abandoned.set(self.link.abandoned.get() | 1 << b);
            }
        }
    }
}
