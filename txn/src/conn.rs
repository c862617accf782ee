//! A compute node's synchronous connection to one memory server: an RC queue pair, its
//! completion queue (used by nobody else) and a registered scratch region that READs
//! and atomics land in.
//!
//! [`Conn::run`] posts a batch with one doorbell, only the last request signaled, and
//! spins on the completion queue until that completion (or the first error) arrives.
//! RC executes a queue pair's requests in order, so the last completion means the whole
//! batch is done. A `Conn` belongs to one thread at a time.

use fabric::{
    Access, Completion, CompletionQueue, Device, FabricError, QueuePair, Region, RemoteAddr, SendWr,
};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A completion that takes this long means a lost connection, not a slow one.
const PATIENCE: Duration = Duration::from_secs(30);

pub struct Conn {
    qp: Arc<dyn QueuePair>,
    cq: Arc<dyn CompletionQueue>,
    scratch: Region,
    next_id: u64,
}

impl Conn {
    /// `qp` is an RC queue pair connected to the memory server whose send completions
    /// go to `cq`; `scratch_bytes` of local memory are registered for results.
    pub fn new(
        device: &dyn Device,
        qp: Arc<dyn QueuePair>,
        cq: Arc<dyn CompletionQueue>,
        scratch_bytes: u64,
    ) -> Result<Conn, FabricError> {
        let scratch = device.register(scratch_bytes.max(8), Access::LOCAL)?;
        Ok(Conn {
            qp,
            cq,
            scratch,
            next_id: 1,
        })
    }

    /// The local region READ and atomic results land in.
    pub fn scratch(&self) -> &Region {
        &self.scratch
    }

    /// Posts `wrs` with one doorbell, the last one signaled and the others not, and
    /// waits until the last completes. The first error completion is returned as
    /// `FabricError::Completion { index, .. }` (its position in `wrs`); the queue pair
    /// is then recovered so the connection stays usable.
    pub fn run(&mut self, wrs: &mut [SendWr<'_>]) -> Result<(), FabricError> {
        let Some(last) = wrs.len().checked_sub(1) else {
            return Ok(());
        };
        let base = self.next_id;
        self.next_id += wrs.len() as u64;
        for (i, wr) in wrs.iter_mut().enumerate() {
            wr.wr_id = base + i as u64;
            wr.signaled = i == last;
        }
        self.qp.post_send(wrs)?;
        let mut wcs = [Completion::default(); 8];
        let start = Instant::now();
        loop {
            let n = self.cq.poll(&mut wcs)?;
            for wc in &wcs[..n] {
                if wc.status != fabric::WcStatus::Success {
                    let index = wc.wr_id.saturating_sub(base) as usize;
                    self.recover_after_error(base + last as u64)?;
                    return Err(FabricError::Completion {
                        status: wc.status,
                        index,
                    });
                }
                if wc.wr_id == base + last as u64 {
                    return Ok(());
                }
            }
            if n == 0 {
                if start.elapsed() > PATIENCE {
                    return Err(FabricError::Backend(format!(
                        "no completion for {} work requests after {PATIENCE:?}",
                        wrs.len()
                    )));
                }
                std::hint::spin_loop();
            }
        }
    }

    /// READs the word at `at`.
    pub fn read_word(&mut self, at: RemoteAddr) -> Result<u64, FabricError> {
        let local = self.scratch.buf(0, 8);
        self.run(&mut [SendWr::read(0, local, at)])?;
        self.scratch.load_u64(0)
    }

    /// READs `len` bytes from `at`, a scratch-full per doorbell.
    pub fn read_bytes(&mut self, at: RemoteAddr, len: u64) -> Result<Vec<u8>, FabricError> {
        let mut out = Vec::with_capacity(len as usize);
        let step = self.scratch.len();
        let mut done = 0;
        while done < len {
            let n = step.min(len - done);
            let local = self.scratch.buf(0, n as u32);
            let remote = RemoteAddr {
                offset: at.offset + done,
                ..at
            };
            self.run(&mut [SendWr::read(0, local, remote)])?;
            out.extend_from_slice(&self.scratch.to_vec(0, n as usize)?);
            done += n;
        }
        Ok(out)
    }

    /// WRITEs `bytes` at `at`, through the scratch region, a scratch-full per doorbell.
    pub fn write_bytes(&mut self, at: RemoteAddr, bytes: &[u8]) -> Result<(), FabricError> {
        let step = self.scratch.len() as usize;
        for (k, part) in bytes.chunks(step).enumerate() {
            self.scratch.write(0, part)?;
            let local = self.scratch.buf(0, part.len() as u32);
            let remote = RemoteAddr {
                offset: at.offset + (k * step) as u64,
                ..at
            };
            self.run(&mut [SendWr::write(0, local, remote)])?;
        }
        Ok(())
    }

    /// CAS; returns the old value (the swap happened iff it equals `compare`).
    pub fn cas(&mut self, at: RemoteAddr, compare: u64, swap: u64) -> Result<u64, FabricError> {
        let local = self.scratch.buf(0, 8);
        self.run(&mut [SendWr::cas(0, local, at, compare, swap)])?;
        self.scratch.load_u64(0)
    }

    /// FETCH_ADD; returns the old value.
    pub fn fetch_add(&mut self, at: RemoteAddr, add: u64) -> Result<u64, FabricError> {
        let local = self.scratch.buf(0, 8);
        self.run(&mut [SendWr::fetch_add(0, local, at, add)])?;
        self.scratch.load_u64(0)
    }

    /// After an error completion: collect the flushes of the rest of the batch, then
    /// take the queue pair out of the error state.
    fn recover_after_error(&mut self, last_id: u64) -> Result<(), FabricError> {
        let mut wcs = [Completion::default(); 8];
        let start = Instant::now();
        'outer: while start.elapsed() < PATIENCE {
            let n = self.cq.poll(&mut wcs)?;
            for wc in &wcs[..n] {
                if wc.wr_id >= last_id {
                    break 'outer;
                }
            }
            if n == 0 {
                break;
            }
        }
        self.qp.recover()
    }
}

/// A compute node's connection to one memory server for coroutines: batches are
/// futures ([`fabric::AsyncQp`]), so many transactions of one thread share the queue
/// pair, each awaiting its own requests. Results land in buffers the caller owns.
pub struct AsyncConn {
    qp: fabric::AsyncQp,
}

impl AsyncConn {
    /// `qp` is an RC queue pair connected to the memory server whose send completions
    /// go to `cq`, which nothing else polls.
    pub fn new(qp: Arc<dyn QueuePair>, cq: Arc<dyn CompletionQueue>) -> AsyncConn {
        AsyncConn {
            qp: fabric::AsyncQp::new(qp, fabric::CqDriver::new(cq)),
        }
    }

    /// Posts `wrs` with one doorbell and resolves once all completed. After an error
    /// completion the queue pair is taken out of the error state, so the connection
    /// stays usable for the other coroutines (whose batches in flight were flushed and
    /// fail too).
    pub async fn run(&self, wrs: &[SendWr<'_>]) -> Result<(), FabricError> {
        let result = self.qp.run(wrs).await;
        self.recover_after(result)
    }

    /// [`AsyncConn::run`] posting `wrs` themselves ([`fabric::AsyncQp::run_in_place`]):
    /// their `wr_id` and `signaled` fields are overwritten.
    pub async fn run_in_place(&self, wrs: &mut [SendWr<'_>]) -> Result<(), FabricError> {
        let result = self.qp.run_in_place(wrs).await;
        self.recover_after(result)
    }

    fn recover_after(&self, result: Result<(), FabricError>) -> Result<(), FabricError> {
        if result.is_err() && self.qp.qp().state() == fabric::QpState::Error {
            self.qp.qp().recover()?;
        }
        result
    }
}
