//! The registered buffer pool and the two buffering policies of §6 of the paper.
//!
//! A node registers its transmission buffers from one [`BufferPool`] per buffer size,
//! in chunks, so that registration (expensive on an RNIC) is paid once and buffers move
//! between endpoints without re-registering. How many buffers an endpoint keeps in
//! circulation is its [`Buffering`] policy:
//!
//! - [`Buffering::Fixed`]: a fixed number per peer, set from the bandwidth-delay product
//!   ([`Buffering::bandwidth_delay`]), the query-oblivious baseline of §6.1.
//! - [`Buffering::Adaptive`]: §6.2. Keep a few buffers in Wait; when a caller finds none
//!   ready, fetch one from the pool instead of waiting; when more became ready at once
//!   than the caller takes, retire the surplus to the pool. [`Circulation`] implements it.

use crate::buffer::Buffer;
use crate::error::{Result, ShuffleError};
use fabric::{Access, Device, Region};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How many buffers an endpoint keeps in circulation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Buffering {
    /// Exactly `per_peer` buffers per remote endpoint, registered at open.
    Fixed { per_peer: usize },
    /// Start with `initial` per peer; grow on starvation up to `max_per_peer`, shrink
    /// so that about `keep_waiting` buffers stay in Wait.
    Adaptive {
        initial: usize,
        max_per_peer: usize,
        keep_waiting: usize,
    },
}

impl Default for Buffering {
    fn default() -> Buffering {
        Buffering::Adaptive {
            initial: 2,
            max_per_peer: 16,
            keep_waiting: 1,
        }
    }
}

impl Buffering {
    /// The §6.1 baseline: enough buffers of `buffer_bytes` per peer to keep
    /// `bandwidth` bytes/s in flight over a round trip of `latency`, and at least two.
    pub fn bandwidth_delay(bandwidth: f64, latency: Duration, buffer_bytes: u32) -> Buffering {
        let bdp = bandwidth * latency.as_secs_f64();
        let per_peer = (bdp / buffer_bytes as f64).ceil().max(2.0) as usize;
        Buffering::Fixed { per_peer }
    }

    /// Buffers per peer at open.
    pub fn initial(&self) -> usize {
        match *self {
            Buffering::Fixed { per_peer } => per_peer,
            Buffering::Adaptive { initial, .. } => initial,
        }
    }

    /// The most buffers per peer this policy lets circulate.
    pub fn max_per_peer(&self) -> usize {
        match *self {
            Buffering::Fixed { per_peer } => per_peer,
            Buffering::Adaptive { max_per_peer, .. } => max_per_peer,
        }
    }

    pub fn is_adaptive(&self) -> bool {
        matches!(self, Buffering::Adaptive { .. })
    }
}

/// Registered buffers of one size, registered in chunks and reused.
pub struct BufferPool {
    device: Arc<dyn Device>,
    buffer_bytes: u32,
    chunk_buffers: usize,
    limit_bytes: u64,
    free: Mutex<Vec<Buffer>>,
    pinned: AtomicU64,
    taken: AtomicU64,
}

impl BufferPool {
    /// A pool of `buffer_bytes` buffers (rounded up to whole words), registered
    /// `chunk_buffers` at a time, pinning at most `limit_bytes`.
    pub fn new(
        device: Arc<dyn Device>,
        buffer_bytes: u32,
        chunk_buffers: usize,
        limit_bytes: u64,
    ) -> BufferPool {
        BufferPool {
            device,
            buffer_bytes: buffer_bytes.next_multiple_of(8),
            chunk_buffers: chunk_buffers.max(1),
            limit_bytes,
            free: Mutex::new(Vec::new()),
            pinned: AtomicU64::new(0),
            taken: AtomicU64::new(0),
        }
    }

    pub fn buffer_bytes(&self) -> u32 {
        self.buffer_bytes
    }

    /// Bytes registered so far.
    pub fn pinned_bytes(&self) -> u64 {
        self.pinned.load(Ordering::Relaxed)
    }

    /// Buffers currently out of the pool.
    pub fn in_use(&self) -> u64 {
        self.taken.load(Ordering::Relaxed)
    }

    /// A buffer, registering a new chunk if none is free.
    pub fn take(&self) -> Result<Buffer> {
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        if free.is_empty() {
            let pinned = self.pinned_bytes();
            let mut n = self.chunk_buffers;
            let room = self.limit_bytes.saturating_sub(pinned) / self.buffer_bytes as u64;
            n = n.min(room as usize);
            if n == 0 {
                return Err(ShuffleError::PoolExhausted {
                    pinned,
                    limit: self.limit_bytes,
                });
            }
            let bytes = n as u64 * self.buffer_bytes as u64;
            let region: Arc<Region> = Arc::new(self.device.register(
                bytes,
                Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_WRITE,
            )?);
            self.pinned.fetch_add(bytes, Ordering::Relaxed);
            free.extend((0..n).rev().map(|i| {
                Buffer::new(
                    region.clone(),
                    i as u64 * self.buffer_bytes as u64,
                    self.buffer_bytes,
                )
            }));
        }
        self.taken.fetch_add(1, Ordering::Relaxed);
        Ok(free.pop().expect("refilled above"))
    }

    /// `n` buffers.
    pub fn take_many(&self, n: usize) -> Result<Vec<Buffer>> {
        (0..n).map(|_| self.take()).collect()
    }

    /// Returns a buffer for reuse.
    pub fn give(&self, buf: Buffer) {
        debug_assert_eq!(buf.len(), self.buffer_bytes);
        self.taken.fetch_sub(1, Ordering::Relaxed);
        self.free
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(buf);
    }
}

/// The buffers one endpoint (or one peer's share of it) keeps in circulation, with the
/// policy deciding when to grow and shrink. Buffers are in Wait here; the endpoint
/// moves them to Populate/Transmit (sender) or Transmit/Consume (receiver) and hands
/// them back with [`Circulation::ready`].
pub struct Circulation {
    policy: Buffering,
    pool: Arc<BufferPool>,
    wait: Vec<Buffer>,
    /// Buffers owned by this circulation, wherever they are.
    owned: usize,
    limit: usize,
}

impl Circulation {
    /// A circulation for `peers` peers, filled with the policy's initial buffers.
    pub fn new(pool: Arc<BufferPool>, policy: Buffering, peers: usize) -> Result<Circulation> {
        let initial = policy.initial() * peers.max(1);
        let wait = pool.take_many(initial)?;
        Ok(Circulation {
            policy,
            limit: policy.max_per_peer() * peers.max(1),
            owned: wait.len(),
            wait,
            pool,
        })
    }

    pub fn policy(&self) -> Buffering {
        self.policy
    }

    /// Buffers owned: in Wait plus those out in Populate/Transmit/Consume.
    pub fn owned(&self) -> usize {
        self.owned
    }

    pub fn waiting(&self) -> usize {
        self.wait.len()
    }

    /// Buffers that came back to Wait (completions polled, data consumed). Under the
    /// adaptive policy, a batch larger than what stays waiting retires the surplus.
    pub fn ready(&mut self, bufs: impl IntoIterator<Item = Buffer>) {
        let before = self.wait.len();
        self.wait.extend(bufs);
        if let Buffering::Adaptive {
            keep_waiting,
            initial,
            ..
        } = self.policy
        {
            let arrived = self.wait.len() - before;
            if arrived > 1 {
                let floor = initial.max(1);
                while self.wait.len() > keep_waiting.max(1) && self.owned > floor {
                    let b = self.wait.pop().expect("non-empty");
                    self.pool.give(b);
                    self.owned -= 1;
                }
            }
        }
    }

    /// A buffer leaving Wait. `None` means the caller must wait for one to come back:
    /// the fixed policy never grows, and the adaptive one stops at its maximum. Under
    /// the adaptive policy an empty Wait fetches from the pool (starvation).
    pub fn take(&mut self) -> Result<Option<Buffer>> {
        if let Some(b) = self.wait.pop() {
            return Ok(Some(b));
        }
        if self.policy.is_adaptive() && self.owned < self.limit {
            match self.pool.take() {
                Ok(b) => {
                    self.owned += 1;
                    return Ok(Some(b));
                }
                Err(ShuffleError::PoolExhausted { .. }) if self.owned > 0 => return Ok(None),
                Err(e) => return Err(e),
            }
        }
        Ok(None)
    }

    /// Gives a buffer that will not come back (the endpoint is closing) to the pool.
    pub fn retire(&mut self, buf: Buffer) {
        self.owned -= 1;
        self.pool.give(buf);
    }
}

impl Drop for Circulation {
    fn drop(&mut self) {
        for b in self.wait.drain(..) {
            self.pool.give(b);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fabric::sim::{SimConfig, SimNetwork};

    fn pool(limit: u64) -> Arc<BufferPool> {
        let net = SimNetwork::new(SimConfig::default());
        Arc::new(BufferPool::new(net.add_node(), 4096, 4, limit))
    }

    #[test]
    fn pool_registers_in_chunks_reuses_and_stops_at_its_limit() {
        let p = pool(3 * 4096);
        let a = p.take().unwrap();
        assert_eq!(p.pinned_bytes(), 3 * 4096, "one chunk, capped by the limit");
        let b = p.take().unwrap();
        let c = p.take().unwrap();
        assert!(!a.same(&b) && !b.same(&c));
        assert!(matches!(p.take(), Err(ShuffleError::PoolExhausted { .. })));
        p.give(b);
        let again = p.take().unwrap();
        assert!(again.same(&c) || again.offset() == 4096);
        assert_eq!(p.in_use(), 3);
        assert_eq!(p.pinned_bytes(), 3 * 4096);
    }

    #[test]
    fn fixed_circulation_never_grows() {
        let p = pool(1 << 20);
        let mut c = Circulation::new(p.clone(), Buffering::Fixed { per_peer: 2 }, 1).unwrap();
        let a = c.take().unwrap().unwrap();
        let b = c.take().unwrap().unwrap();
        assert!(c.take().unwrap().is_none());
        c.ready([a, b]);
        assert_eq!(c.waiting(), 2, "fixed keeps every buffer");
        assert_eq!(c.owned(), 2);
    }

    #[test]
    fn adaptive_circulation_grows_on_starvation_and_retires_surplus() {
        let p = pool(1 << 20);
        let policy = Buffering::Adaptive {
            initial: 1,
            max_per_peer: 4,
            keep_waiting: 1,
        };
        let mut c = Circulation::new(p.clone(), policy, 1).unwrap();
        let out: Vec<_> = (0..4).map(|_| c.take().unwrap().unwrap()).collect();
        assert_eq!(c.owned(), 4, "grew from the pool while starved");
        assert!(c.take().unwrap().is_none(), "but not past the maximum");
        assert_eq!(p.in_use(), 4);
        c.ready(out);
        assert_eq!(c.waiting(), 1, "a burst of returns retires all but one");
        assert_eq!(c.owned(), 1);
        assert_eq!(p.in_use(), 1);
    }

    #[test]
    fn bandwidth_delay_sizes_the_fixed_policy() {
        let b = Buffering::bandwidth_delay(10e9, Duration::from_micros(100), 65_536);
        assert_eq!(b, Buffering::Fixed { per_peer: 16 });
        let small = Buffering::bandwidth_delay(1e6, Duration::from_micros(1), 65_536);
        assert_eq!(small, Buffering::Fixed { per_peer: 2 });
    }
}
