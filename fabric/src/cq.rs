//! The software completion queue of the sim, shm and tcp backends.
use crate::device::CompletionQueue;
use crate::error::{FabricError, Result};
use crate::sync::{self, AtomicBool, AtomicU32, Mutex, Ordering, RwLock};
use crate::wr::Completion;
use std::any::Any;
use std::collections::VecDeque;
use std::sync::{Arc, Weak};
use std::time::Instant;

/// A queue pair with work that only makes progress when someone polls: RNR-deferred
/// sends, held-back datagrams, responses still on the wire, messages in a ring.
pub(crate) trait Progress: Send + Sync {
    /// Makes what progress it can; returns whether work is still waiting.
    fn progress(&self) -> bool;

    /// For a [`CqInner::add_poller`]: takes in whatever arrived for the receive side;
    /// returns whether it must still be polled.
    fn poll_arrivals(&self) -> bool {
        false
    }
}

pub(crate) struct CqEntry {
    pub(crate) wc: Completion,
    /// Send work requests this completion retires from its queue pair's send queue:
    /// itself and the unsignaled ones before it.
    pub(crate) retires: u32,
    pub(crate) send_queue: Option<Arc<AtomicU32>>,
    /// Under a cost model or injected delay: when the completion becomes visible.
    pub(crate) visible_at: Option<Instant>,
}

pub(crate) struct CqInner {
    capacity: u32,
    entries: Mutex<VecDeque<CqEntry>>,
    overrun: AtomicBool,
    /// Queue pairs with work that waits on time or on a peer: RNR-deferred sends and
    /// held-back datagrams. Polling gives them a chance to progress, as the NIC's
    /// retry timer would.
    waiting: Mutex<Vec<Weak<dyn Progress>>>,
    has_waiting: AtomicBool,
    /// Queue pairs whose messages arrive in shared memory, looked at on every poll for
    /// as long as they live. Kept apart from `waiting` so that the common poll neither
    /// allocates nor takes a lock for writing.
    pollers: RwLock<Vec<Weak<dyn Progress>>>,
    has_pollers: AtomicBool,
}

impl CqInner {
    pub(crate) fn push(&self, entry: CqEntry) {
        let mut entries = sync::lock(&self.entries);
        if entries.len() >= self.capacity as usize {
            // Hardware raises a CQ error event and the completion is lost.
            self.overrun.store(true, Ordering::Release);
            if let Some(sq) = &entry.send_queue {
                sq.fetch_sub(entry.retires, Ordering::AcqRel);
            }
            return;
        }
        entries.push_back(entry);
    }

    pub(crate) fn push_many(&self, batch: &mut Vec<CqEntry>) {
        if batch.is_empty() {
            return;
        }
        let mut entries = sync::lock(&self.entries);
        for entry in batch.drain(..) {
            if entries.len() >= self.capacity as usize {
                self.overrun.store(true, Ordering::Release);
                if let Some(sq) = &entry.send_queue {
                    sq.fetch_sub(entry.retires, Ordering::AcqRel);
                }
                continue;
            }
            entries.push_back(entry);
        }
    }

    pub(crate) fn add_waiting(&self, qp: Arc<dyn Progress>) {
        let mut waiting = sync::lock(&self.waiting);
        if !waiting
            .iter()
            .any(|w| std::ptr::addr_eq(w.as_ptr(), Arc::as_ptr(&qp)))
        {
            waiting.push(Arc::downgrade(&qp));
        }
        self.has_waiting.store(true, Ordering::Release);
    }

    fn progress_waiting(&self) {
        if !self.has_waiting.load(Ordering::Acquire) {
            return;
        }
        let qps: Vec<Weak<dyn Progress>> = std::mem::take(&mut *sync::lock(&self.waiting));
        self.has_waiting.store(false, Ordering::Release);
        for weak in qps {
            if let Some(qp) = weak.upgrade()
                && qp.progress()
            {
                self.add_waiting(qp);
            }
        }
    }

    /// Registers `qp` to have [`Progress::poll_arrivals`] called on every poll.
    #[cfg_attr(fabric_loom, allow(dead_code))] // used by shm, which loom builds leave out
    pub(crate) fn add_poller(&self, qp: Arc<dyn Progress>) {
        let mut pollers = sync::write(&self.pollers);
        if !pollers
            .iter()
            .any(|w| std::ptr::addr_eq(w.as_ptr(), Arc::as_ptr(&qp)))
        {
            pollers.push(Arc::downgrade(&qp));
        }
        self.has_pollers.store(true, Ordering::Release);
    }

    fn progress_pollers(&self) {
        if !self.has_pollers.load(Ordering::Acquire) {
            return;
        }
        let mut finished = false;
        for weak in sync::read(&self.pollers).iter() {
            finished |= !weak.upgrade().is_some_and(|qp| qp.poll_arrivals());
        }
        if finished {
            let mut pollers = sync::write(&self.pollers);
            pollers.retain(|w| w.strong_count() > 0);
            self.has_pollers
                .store(!pollers.is_empty(), Ordering::Release);
        }
    }

    fn poll(&self, out: &mut [Completion]) -> Result<usize> {
        self.progress_pollers();
        self.progress_waiting();
        if self.overrun.load(Ordering::Acquire) {
            return Err(FabricError::CqOverrun {
                capacity: self.capacity,
            });
        }
        let mut entries = sync::lock(&self.entries);
        let mut now = None;
        let mut n = 0;
        while n < out.len() {
            let Some(front) = entries.front() else { break };
            if let Some(at) = front.visible_at
                && at > *now.get_or_insert_with(Instant::now)
            {
                break;
            }
            let entry = entries.pop_front().expect("front exists");
            if let Some(sq) = &entry.send_queue {
                sq.fetch_sub(entry.retires, Ordering::AcqRel);
            }
            out[n] = entry.wc;
            n += 1;
        }
        Ok(n)
    }
}

/// The handle `create_cq` returns.
pub(crate) struct SoftCq {
    inner: Arc<CqInner>,
}

impl SoftCq {
    pub(crate) fn create(capacity: u32) -> Result<Arc<dyn CompletionQueue>> {
        if capacity == 0 {
            return Err(FabricError::InvalidWorkRequest(
                "a completion queue needs a capacity of at least 1".into(),
            ));
        }
        Ok(Arc::new(SoftCq::new(capacity)))
    }

    pub(crate) fn new(capacity: u32) -> SoftCq {
        SoftCq {
            inner: Arc::new(CqInner {
                capacity,
                entries: Mutex::new(VecDeque::with_capacity(capacity.min(4096) as usize)),
                overrun: AtomicBool::new(false),
                waiting: Mutex::new(Vec::new()),
                has_waiting: AtomicBool::new(false),
                pollers: RwLock::new(Vec::new()),
                has_pollers: AtomicBool::new(false),
            }),
        }
    }

    pub(crate) fn inner_of(cq: &Arc<dyn CompletionQueue>) -> Result<Arc<CqInner>> {
        cq.as_any()
            .downcast_ref::<SoftCq>()
            .map(|c| c.inner.clone())
            .ok_or(FabricError::ForeignObject(
                "completion queue of another backend",
            ))
    }
}

impl CompletionQueue for SoftCq {
    fn poll(&self, out: &mut [Completion]) -> Result<usize> {
        self.inner.poll(out)
    }

    fn capacity(&self) -> u32 {
        self.inner.capacity
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}
