//! Completion queues: `ibv_poll_cq`, each NIC completion handed to its queue pair for
//! translation into the fabric's.

use super::qp::RECV_TAG;
use super::{DeviceShared, backend_error};
use crate::device::CompletionQueue;
use crate::error::{FabricError, Result};
use crate::sync;
use crate::wr::Completion;
use rdma_mummy_sys as sys;
use sideway::ibverbs::completion::{BasicCompletionQueue, CompletionQueue as _};
use std::any::Any;
use std::sync::{Arc, Mutex};

pub(crate) struct VerbsCq {
    device: Arc<DeviceShared>,
    hw: Arc<BasicCompletionQueue>,
    capacity: u32,
    /// The NIC's completions of one poll; the lock also serialises pollers, so that
    /// completions of one queue pair are translated in order.
    scratch: Mutex<Vec<sys::ibv_wc>>,
}

impl VerbsCq {
    pub(crate) fn new(device: &Arc<DeviceShared>, capacity: u32) -> Result<VerbsCq> {
        let hw = device
            .ctx
            .create_cq_builder()
            .setup_cqe(capacity.max(1))
            .build()
            .map_err(|e| backend_error("creating a completion queue", super::source_of(&e)))?;
        Ok(VerbsCq {
            device: device.clone(),
            hw,
            capacity,
            scratch: Mutex::new(Vec::new()),
        })
    }

    pub(crate) fn device_id(&self) -> u64 {
        self.device.id
    }

    pub(crate) fn hw(&self) -> Arc<BasicCompletionQueue> {
        self.hw.clone()
    }
}

impl CompletionQueue for VerbsCq {
    fn poll(&self, out: &mut [Completion]) -> Result<usize> {
        let mut wcs = sync::lock(&self.scratch);
        let want = out.len().min(256);
        // SAFETY: ibv_wc is plain data; zeroes are valid and the NIC overwrites them.
        wcs.resize(want, unsafe { std::mem::zeroed() });
        // SAFETY: the CQ is alive (self holds it) and `wcs` has room for `want` entries.
        let got = unsafe { sys::ibv_poll_cq(self.hw.cq().as_ptr(), want as i32, wcs.as_mut_ptr()) };
        if got < 0 {
            return Err(FabricError::Backend(format!(
                "verbs: ibv_poll_cq failed ({got}): the completion queue is broken \
                 (overrun of its {} entries?)",
                self.capacity
            )));
        }
        let mut n = 0;
        for wc in &wcs[..got as usize] {
            // Completions of a destroyed queue pair have nobody to go to.
            let Some(qp) = self.device.qp(wc.qp_num) else {
                continue;
            };
            let completion = if wc.wr_id & RECV_TAG != 0 {
                qp.complete_recv(wc)
            } else {
                qp.complete_send(wc)
            };
            if let Some(c) = completion {
                out[n] = c;
                n += 1;
            }
        }
        Ok(n)
    }

    fn capacity(&self) -> u32 {
        self.capacity
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}
