//! A memory server's device, used from another process: [`RemoteDevice`] implements
//! `fabric::Device` by forwarding every call to the server's remote-verbs service, so
//! code written against the fabric traits (the conformance suite above all) drives the
//! server's own device. Each call is one blocking RPC: for testing and diagnostics,
//! not for a data path.
//!
//! Regions live on the server; their handles carry the keys and no memory
//! (`ElsewhereMemory`), so CPU access to them is `FabricError::NotLocal`. Everything
//! the device creates belongs to the client's session, and each handle destroys its
//! object on the server when dropped.

use crate::blocking;
use crate::client::ClientError;
use crate::proto::{self, remote_verbs_client::RemoteVerbsClient};
use crate::{verbs_error, verbs_wire};
use fabric::{
    Access, Completion, CompletionQueue, Device, ElsewhereMemory, FabricError, Memory, NodeId,
    QpConfig, QpEndpoint, QpKind, QpState, QueuePair, RecvWr, Region, SendWr,
};
use std::any::Any;
use std::future::Future;
use std::sync::Arc;
use tonic::transport::Channel;
use tonic::{Request, Response, Status};

/// The connection every handle of one remote device shares. Fields drop in order: the
/// session ends (destroying whatever handles leaked) before the attachment goes.
struct Link {
    verbs: RemoteVerbsClient<Channel>,
    client: blocking::Client,
    _attachment: Option<Box<dyn Send + Sync>>,
}

impl Link {
    /// One RPC, its failure as the fabric error the device returned (or, for a
    /// failure of the service itself, a backend error that says what happened).
    fn call<Req, Resp, Fut>(
        &self,
        method: &'static str,
        message: Req,
        rpc: impl FnOnce(RemoteVerbsClient<Channel>, Request<Req>) -> Fut,
    ) -> fabric::Result<Resp>
    where
        Fut: Future<Output = Result<Response<Resp>, Status>>,
    {
        let future = rpc(self.verbs.clone(), self.client.inner().request(message));
        match self.client.block_on(future) {
            Ok(Ok(reply)) => Ok(reply.into_inner()),
            Ok(Err(status)) => Err(verbs_error::from_status(method, &status)),
            Err(e) => Err(FabricError::Backend(format!("{method}: {e}"))),
        }
    }
}

fn malformed(method: &str, e: String) -> FabricError {
    FabricError::Backend(format!(
        "{method}: the memory server sent a malformed reply: {e}"
    ))
}

/// A memory server's fabric device, driven over its remote-verbs service.
pub struct RemoteDevice {
    link: Arc<Link>,
    node: NodeId,
    backend: &'static str,
    address: String,
}

impl RemoteDevice {
    /// The device of the server `client` is connected to. Fails with the server's
    /// PERMISSION_DENIED when it was not started with remote verbs allowed.
    pub fn new(client: blocking::Client) -> Result<Arc<RemoteDevice>, ClientError> {
        RemoteDevice::build(client, None)
    }

    /// As [`RemoteDevice::new`], keeping `attachment` until the device and every
    /// object made from it are gone and the session has ended: for what the server's
    /// life depends on, such as the server process a test started.
    pub fn with_attachment(
        client: blocking::Client,
        attachment: Box<dyn Send + Sync>,
    ) -> Result<Arc<RemoteDevice>, ClientError> {
        RemoteDevice::build(client, Some(attachment))
    }

    fn build(
        client: blocking::Client,
        attachment: Option<Box<dyn Send + Sync>>,
    ) -> Result<Arc<RemoteDevice>, ClientError> {
        let mut verbs = RemoteVerbsClient::new(client.inner().channel());
        let info = client
            .block_on(verbs.device_info(client.inner().request(proto::DeviceInfoRequest {})))?
            .map_err(|status| ClientError::Rpc {
                method: "DeviceInfo",
                status: Box::new(status),
            })?
            .into_inner();
        Ok(Arc::new(RemoteDevice {
            node: NodeId(info.node),
            backend: verbs_error::intern(&info.backend),
            address: info.address,
            link: Arc::new(Link {
                verbs,
                client,
                _attachment: attachment,
            }),
        }))
    }

    fn cq_id(&self, cq: &Arc<dyn CompletionQueue>) -> fabric::Result<u32> {
        match cq.as_any().downcast_ref::<RemoteCq>() {
            Some(remote) if Arc::ptr_eq(&remote.link, &self.link) => Ok(remote.id),
            _ => Err(FabricError::ForeignObject(
                "completion queue of another device (a remote device's queue pairs use its own completion queues)",
            )),
        }
    }
}

impl Device for RemoteDevice {
    fn node(&self) -> NodeId {
        self.node
    }

    fn backend(&self) -> &'static str {
        self.backend
    }

    /// As the proxied backend places WRITEs: only verbs does not promise the order.
    fn orders_write_placement(&self) -> bool {
        self.backend != "verbs"
    }

    fn address(&self) -> String {
        self.address.clone()
    }

    fn add_peer(&self, node: NodeId, address: &str) -> fabric::Result<()> {
        let message = proto::AddPeerRequest {
            node: node.0,
            address: address.to_string(),
        };
        self.link.call(
            "AddPeer",
            message,
            |mut c, r| async move { c.add_peer(r).await },
        )?;
        Ok(())
    }

    fn register(&self, len: u64, access: Access) -> fabric::Result<Region> {
        let message = proto::RegisterRegionRequest {
            len,
            access: access.bits(),
        };
        let reply = self
            .link
            .call("RegisterRegion", message, |mut c, r| async move {
                c.register_region(r).await
            })?;
        let registration = RemoteRegistration {
            link: self.link.clone(),
            lkey: reply.lkey,
        };
        Ok(Region::from_parts(
            Arc::new(ElsewhereMemory),
            reply.len,
            (reply.lkey, reply.rkey),
            access,
            self.node,
            Box::new(registration),
        ))
    }

    fn register_memory(
        &self,
        _mem: Arc<dyn Memory>,
        _len: u64,
        _access: Access,
    ) -> fabric::Result<Region> {
        Err(FabricError::Backend(
            "a remote device cannot register this process's memory: it lives on the memory \
             server; use register, which allocates memory there"
                .into(),
        ))
    }

    fn create_cq(&self, capacity: u32) -> fabric::Result<Arc<dyn CompletionQueue>> {
        let reply = self.link.call(
            "CreateCq",
            proto::CreateCqRequest { capacity },
            |mut c, r| async move { c.create_cq(r).await },
        )?;
        Ok(Arc::new(RemoteCq {
            link: self.link.clone(),
            id: reply.cq,
            capacity,
        }))
    }

    fn create_qp(&self, config: &QpConfig) -> fabric::Result<Arc<dyn QueuePair>> {
        let kind = match config.kind {
            QpKind::Rc => proto::QpKind::Rc,
            QpKind::Ud => proto::QpKind::Ud,
        };
        let message = proto::CreateQpRequest {
            kind: kind as i32,
            send_cq: self.cq_id(&config.send_cq)?,
            recv_cq: self.cq_id(&config.recv_cq)?,
            max_send_wr: config.max_send_wr,
            max_recv_wr: config.max_recv_wr,
            max_inline: config.max_inline,
            rnr_retry: config.rnr_retry.into(),
            rnr_timer_ns: config.rnr_timer.as_nanos().try_into().unwrap_or(u64::MAX),
            qkey: config.qkey,
        };
        let reply = self.link.call("CreateQp", message, |mut c, r| async move {
            c.create_qp(r).await
        })?;
        Ok(Arc::new(RemoteQp {
            link: self.link.clone(),
            endpoint: QpEndpoint {
                node: self.node,
                qpn: reply.qpn,
            },
            kind: config.kind,
            send_queue_depth: config.max_send_wr,
            _cqs: [config.send_cq.clone(), config.recv_cq.clone()],
        }))
    }
}

/// Deregisters a remote region when its handle drops.
struct RemoteRegistration {
    link: Arc<Link>,
    lkey: u32,
}

impl Drop for RemoteRegistration {
    fn drop(&mut self) {
        // A failure leaves the region to the session's end, which frees it anyway.
        let _ = self.link.call(
            "DeregisterRegion",
            proto::DeregisterRegionRequest { lkey: self.lkey },
            |mut c, r| async move { c.deregister_region(r).await },
        );
    }
}

/// A completion queue on the memory server's device.
struct RemoteCq {
    link: Arc<Link>,
    id: u32,
    capacity: u32,
}

impl CompletionQueue for RemoteCq {
    fn poll(&self, out: &mut [Completion]) -> fabric::Result<usize> {
        if out.is_empty() {
            return Ok(0);
        }
        let message = proto::PollCqRequest {
            cq: self.id,
            max: out.len().try_into().unwrap_or(u32::MAX),
        };
        let reply = self.link.call(
            "PollCq",
            message,
            |mut c, r| async move { c.poll_cq(r).await },
        )?;
        if reply.completions.len() > out.len() {
            return Err(malformed(
                "PollCq",
                format!(
                    "{} completions for {} slots",
                    reply.completions.len(),
                    out.len()
                ),
            ));
        }
        for (slot, wc) in out.iter_mut().zip(&reply.completions) {
            *slot = verbs_wire::completion_from(wc).map_err(|e| malformed("PollCq", e))?;
        }
        Ok(reply.completions.len())
    }

    fn capacity(&self) -> u32 {
        self.capacity
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl Drop for RemoteCq {
    fn drop(&mut self) {
        // As for regions: the session's end frees what a failed call leaves.
        let _ = self.link.call(
            "DestroyCq",
            proto::DestroyCqRequest { cq: self.id },
            |mut c, r| async move { c.destroy_cq(r).await },
        );
    }
}

/// A queue pair on the memory server's device.
struct RemoteQp {
    link: Arc<Link>,
    endpoint: QpEndpoint,
    kind: QpKind,
    send_queue_depth: u32,
    /// Its completion queues, destroyed only after it: the server refuses to destroy
    /// one a queue pair still uses (fields drop after `Drop::drop` ran).
    _cqs: [Arc<dyn CompletionQueue>; 2],
}

impl QueuePair for RemoteQp {
    fn endpoint(&self) -> QpEndpoint {
        self.endpoint
    }

    fn kind(&self) -> QpKind {
        self.kind
    }

    fn state(&self) -> QpState {
        let reply = self.link.call(
            "QueryQp",
            proto::QueryQpRequest {
                qpn: self.endpoint.qpn,
            },
            |mut c, r| async move { c.query_qp(r).await },
        );
        // The trait has no error here; a queue pair whose server cannot be asked
        // cannot be posted to either, which is what the error state says.
        reply
            .ok()
            .and_then(|r| verbs_wire::qp_state_from(r.state).ok())
            .unwrap_or(QpState::Error)
    }

    fn connect(&self, peer: QpEndpoint) -> fabric::Result<()> {
        let message = proto::ConnectQpRequest {
            qpn: self.endpoint.qpn,
            peer: Some(verbs_wire::endpoint(peer)),
        };
        self.link
            .call("ConnectQp", message, |mut c, r| async move {
                c.connect_qp(r).await
            })?;
        Ok(())
    }

    fn post_send(&self, wrs: &[SendWr<'_>]) -> fabric::Result<()> {
        let message = proto::PostSendRequest {
            qpn: self.endpoint.qpn,
            wrs: wrs.iter().map(verbs_wire::send_wr).collect(),
        };
        self.link.call("PostSend", message, |mut c, r| async move {
            c.post_send(r).await
        })?;
        Ok(())
    }

    fn send_queue_depth(&self) -> u32 {
        self.send_queue_depth
    }

    fn post_recv(&self, wrs: &[RecvWr]) -> fabric::Result<()> {
        let message = proto::PostRecvRequest {
            qpn: self.endpoint.qpn,
            wrs: wrs.iter().map(verbs_wire::recv_wr).collect(),
        };
        self.link.call("PostRecv", message, |mut c, r| async move {
            c.post_recv(r).await
        })?;
        Ok(())
    }

    fn recover(&self) -> fabric::Result<()> {
        let message = proto::RecoverQpRequest {
            qpn: self.endpoint.qpn,
        };
        self.link
            .call("RecoverQp", message, |mut c, r| async move {
                c.recover_qp(r).await
            })?;
        Ok(())
    }
}

impl Drop for RemoteQp {
    fn drop(&mut self) {
        // Destroying the server's queue pair is what tells its peer it is gone; if the
        // call fails, the session's end does it.
        let _ = self.link.call(
            "DestroyQp",
            proto::DestroyQpRequest {
                qpn: self.endpoint.qpn,
            },
            |mut c, r| async move { c.destroy_qp(r).await },
        );
    }
}
