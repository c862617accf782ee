//! The remote-verbs service: the server's own device, operated for an authenticated
//! session (see `remote_verbs.proto`). Off unless the server was started with it;
//! every object it creates belongs to the calling session.

use crate::proto::{self, remote_verbs_server::RemoteVerbs};
use crate::service::ServerState;
use crate::session::{DeregisterError, Session, SessionError};
use crate::stats::Rpc;
use crate::{verbs_error, verbs_wire};
use fabric::{
    Access, Completion, CompletionQueue, NodeId, QpConfig, QpKind, QueuePair, RecvWr, SendWr,
};
use std::sync::Arc;
use std::time::Duration;
use tonic::{Request, Response, Status};

pub(crate) const MAX_CQS_PER_SESSION: usize = 1024;
pub(crate) const MAX_REGIONS_PER_SESSION: usize = 1024;
/// Completions one PollCq returns at most, which bounds the reply's size.
const MAX_POLL: usize = 4096;

const DISABLED: &str = "remote verbs are disabled on this memory server; they let a client \
    drive the server's device and are meant for conformance testing and diagnostics: start \
    the server with --allow-remote-verbs (ServerConfig::allow_remote_verbs) to use them";

pub(crate) struct VerbsService {
    state: Arc<ServerState>,
}

type Reply<T> = Result<Response<T>, Status>;

fn session_status(e: SessionError) -> Status {
    match e {
        SessionError::Ended => Status::unauthenticated(e.to_string()),
        SessionError::CqInUse { .. } => Status::failed_precondition(e.to_string()),
        _ => Status::resource_exhausted(e.to_string()),
    }
}

/// Runs `call` off the async workers: a backend may block in a device call (dialling
/// a peer, waiting for room in a socket).
async fn blocking<T: Send + 'static>(
    call: impl FnOnce() -> Result<T, Status> + Send + 'static,
) -> Result<T, Status> {
    tokio::task::spawn_blocking(call)
        .await
        .map_err(|e| Status::internal(format!("the device call failed: {e}")))?
}

/// A device call, off the async workers, its error mapped to the status that carries it.
async fn device_call<T: Send + 'static>(
    call: impl FnOnce() -> fabric::Result<T> + Send + 'static,
) -> Result<T, Status> {
    blocking(move || call().map_err(|e| verbs_error::to_status(&e))).await
}

fn malformed(what: &str) -> impl FnOnce(String) -> Status + '_ {
    move |e| Status::invalid_argument(format!("{what}: {e}"))
}

impl VerbsService {
    pub fn new(state: Arc<ServerState>) -> VerbsService {
        VerbsService { state }
    }

    /// Counts the call and returns the caller's session, if remote verbs are on.
    fn open<T>(&self, rpc: Rpc, req: &Request<T>) -> Result<Arc<Session>, Status> {
        self.state.counters.rpc(rpc);
        let session = self.state.session(req)?;
        if !self.state.allow_remote_verbs {
            return Err(Status::permission_denied(DISABLED));
        }
        Ok(session)
    }
}

/// NOT_FOUND unless the session had the object it was asked to drop.
fn removed(found: bool, missing: impl FnOnce() -> String) -> Result<(), Status> {
    if found {
        Ok(())
    } else {
        Err(Status::not_found(missing()))
    }
}

fn qp_of(session: &Session, qpn: u32) -> Result<Arc<dyn QueuePair>, Status> {
    session
        .qp(qpn)
        .ok_or_else(|| Status::not_found(format!("this session has no queue pair {qpn}")))
}

fn cq_of(session: &Session, id: u32) -> Result<Arc<dyn CompletionQueue>, Status> {
    session
        .cq(id)
        .ok_or_else(|| Status::not_found(format!("this session has no completion queue {id}")))
}

#[tonic::async_trait]
impl RemoteVerbs for VerbsService {
    async fn device_info(
        &self,
        req: Request<proto::DeviceInfoRequest>,
    ) -> Reply<proto::DeviceInfoResponse> {
        self.open(Rpc::DeviceInfo, &req)?;
        let device = &self.state.device;
        Ok(Response::new(proto::DeviceInfoResponse {
            node: device.node().0,
            backend: device.backend().to_string(),
            address: device.address(),
        }))
    }

    async fn add_peer(&self, req: Request<proto::AddPeerRequest>) -> Reply<proto::AddPeerResponse> {
        self.open(Rpc::AddPeer, &req)?;
        let body = req.into_inner();
        let device = self.state.device.clone();
        device_call(move || device.add_peer(NodeId(body.node), &body.address)).await?;
        Ok(Response::new(proto::AddPeerResponse {}))
    }

    async fn register_region(
        &self,
        req: Request<proto::RegisterRegionRequest>,
    ) -> Reply<proto::RegisterRegionResponse> {
        let session = self.open(Rpc::RegisterRegion, &req)?;
        let body = req.into_inner();
        let access = Access::from_bits(body.access).ok_or_else(|| {
            Status::invalid_argument(format!(
                "unknown access bits {:#x} (1 LOCAL_WRITE, 2 REMOTE_READ, 4 REMOTE_WRITE, 8 REMOTE_ATOMIC)",
                body.access
            ))
        })?;
        let limits = self.state.verbs_limits;
        // Checked before the memory is allocated, so an oversized request costs nothing.
        session
            .region_fits(body.len, &limits)
            .map_err(session_status)?;
        let device = self.state.device.clone();
        let region = device_call(move || device.register(body.len, access)).await?;
        let reply = proto::RegisterRegionResponse {
            lkey: region.lkey(),
            rkey: region.rkey(),
            len: region.len(),
        };
        session
            .add_region(region, &limits, None)
            .map_err(session_status)?;
        Ok(Response::new(reply))
    }

    async fn deregister_region(
        &self,
        req: Request<proto::DeregisterRegionRequest>,
    ) -> Reply<proto::DeregisterRegionResponse> {
        let session = self.open(Rpc::DeregisterRegion, &req)?;
        let lkey = req.get_ref().lkey;
        match session.deregister_registered(lkey) {
            Ok(()) => Ok(Response::new(proto::DeregisterRegionResponse {})),
            Err(DeregisterError::NotHeld) => Err(Status::not_found(format!(
                "this session registered no region with lkey {lkey:#x}"
            ))),
            Err(DeregisterError::Borrowed { rkey }) => Err(Status::failed_precondition(format!(
                "the region with lkey {lkey:#x} (rkey {rkey:#x}) was borrowed (BorrowRegion), \
                 not registered through remote verbs: give it back with ReturnRegion \
                 (rkey {rkey:#x}), which also returns its share of the server's borrow cap; \
                 it is kept as it was"
            ))),
        }
    }

    async fn create_cq(
        &self,
        req: Request<proto::CreateCqRequest>,
    ) -> Reply<proto::CreateCqResponse> {
        let session = self.open(Rpc::CreateCq, &req)?;
        let capacity = req.get_ref().capacity;
        let device = self.state.device.clone();
        let cq = device_call(move || device.create_cq(capacity)).await?;
        let id = session
            .add_cq(cq, self.state.verbs_limits.cqs)
            .map_err(session_status)?;
        Ok(Response::new(proto::CreateCqResponse { cq: id }))
    }

    async fn destroy_cq(
        &self,
        req: Request<proto::DestroyCqRequest>,
    ) -> Reply<proto::DestroyCqResponse> {
        let session = self.open(Rpc::DestroyCq, &req)?;
        let id = req.get_ref().cq;
        let found = session.remove_cq(id).map_err(session_status)?;
        removed(found, || {
            format!("this session has no completion queue {id}")
        })?;
        Ok(Response::new(proto::DestroyCqResponse {}))
    }

    async fn poll_cq(&self, req: Request<proto::PollCqRequest>) -> Reply<proto::PollCqResponse> {
        let session = self.open(Rpc::PollCq, &req)?;
        let cq = cq_of(&session, req.get_ref().cq)?;
        let max = (req.get_ref().max as usize).min(MAX_POLL);
        let completions = device_call(move || {
            let mut out = vec![Completion::default(); max];
            let n = cq.poll(&mut out)?;
            Ok(out[..n].iter().map(verbs_wire::completion).collect())
        })
        .await?;
        Ok(Response::new(proto::PollCqResponse { completions }))
    }

    async fn create_qp(
        &self,
        req: Request<proto::CreateQpRequest>,
    ) -> Reply<proto::CreateQpResponse> {
        let session = self.open(Rpc::CreateQp, &req)?;
        let body = req.into_inner();
        let kind = match proto::QpKind::try_from(body.kind) {
            Ok(proto::QpKind::Rc) => QpKind::Rc,
            Ok(proto::QpKind::Ud) => QpKind::Ud,
            _ => {
                return Err(Status::invalid_argument(format!(
                    "unknown queue pair kind {}; expected QP_KIND_RC or QP_KIND_UD",
                    body.kind
                )));
            }
        };
        let rnr_retry = u8::try_from(body.rnr_retry).map_err(|_| {
            Status::invalid_argument(format!("rnr_retry {} is not 0..=7", body.rnr_retry))
        })?;
        let config = QpConfig {
            kind,
            send_cq: cq_of(&session, body.send_cq)?,
            recv_cq: cq_of(&session, body.recv_cq)?,
            max_send_wr: body.max_send_wr,
            max_recv_wr: body.max_recv_wr,
            max_inline: body.max_inline,
            rnr_retry,
            rnr_timer: Duration::from_nanos(body.rnr_timer_ns),
            // Not part of the request: this server's device keeps its default.
            transport_timeout: QpConfig::DEFAULT_TRANSPORT_TIMEOUT,
            qkey: body.qkey,
        };
        let device = self.state.device.clone();
        let qp = device_call(move || device.create_qp(&config)).await?;
        let qpn = qp.endpoint().qpn;
        session
            .add_qp(
                qp,
                [body.send_cq, body.recv_cq],
                self.state.max_qps_per_session,
            )
            .map_err(session_status)?;
        Ok(Response::new(proto::CreateQpResponse { qpn }))
    }

    async fn connect_qp(
        &self,
        req: Request<proto::ConnectQpRequest>,
    ) -> Reply<proto::ConnectQpResponse> {
        let session = self.open(Rpc::ConnectQp, &req)?;
        let qp = qp_of(&session, req.get_ref().qpn)?;
        let peer = req
            .get_ref()
            .peer
            .as_ref()
            .map(verbs_wire::endpoint_from)
            .ok_or_else(|| Status::invalid_argument("`peer` is missing"))?;
        device_call(move || qp.connect(peer)).await?;
        Ok(Response::new(proto::ConnectQpResponse {}))
    }

    async fn post_send(
        &self,
        req: Request<proto::PostSendRequest>,
    ) -> Reply<proto::PostSendResponse> {
        let session = self.open(Rpc::PostSend, &req)?;
        let qp = qp_of(&session, req.get_ref().qpn)?;
        let body = req.into_inner();
        blocking(move || {
            // Every request is read before any is posted: one the service cannot read
            // rejects the whole batch (a device rejection posts the ones before it).
            let wrs: Vec<SendWr<'_>> = body
                .wrs
                .iter()
                .enumerate()
                .map(|(i, wr)| verbs_wire::send_wr_from(wr).map_err(|e| format!("wrs[{i}]: {e}")))
                .collect::<Result<_, _>>()
                .map_err(malformed("PostSend"))?;
            qp.post_send(&wrs).map_err(|e| verbs_error::to_status(&e))
        })
        .await?;
        Ok(Response::new(proto::PostSendResponse {}))
    }

    async fn post_recv(
        &self,
        req: Request<proto::PostRecvRequest>,
    ) -> Reply<proto::PostRecvResponse> {
        let session = self.open(Rpc::PostRecv, &req)?;
        let qp = qp_of(&session, req.get_ref().qpn)?;
        let wrs: Vec<RecvWr> = req
            .get_ref()
            .wrs
            .iter()
            .enumerate()
            .map(|(i, wr)| verbs_wire::recv_wr_from(wr).map_err(|e| format!("wrs[{i}]: {e}")))
            .collect::<Result<_, _>>()
            .map_err(malformed("PostRecv"))?;
        device_call(move || qp.post_recv(&wrs)).await?;
        Ok(Response::new(proto::PostRecvResponse {}))
    }

    async fn query_qp(&self, req: Request<proto::QueryQpRequest>) -> Reply<proto::QueryQpResponse> {
        let session = self.open(Rpc::QueryQp, &req)?;
        let qp = qp_of(&session, req.get_ref().qpn)?;
        Ok(Response::new(proto::QueryQpResponse {
            state: verbs_wire::qp_state(qp.state()) as i32,
        }))
    }

    async fn recover_qp(
        &self,
        req: Request<proto::RecoverQpRequest>,
    ) -> Reply<proto::RecoverQpResponse> {
        let session = self.open(Rpc::RecoverQp, &req)?;
        let qp = qp_of(&session, req.get_ref().qpn)?;
        device_call(move || qp.recover()).await?;
        Ok(Response::new(proto::RecoverQpResponse {}))
    }

    async fn destroy_qp(
        &self,
        req: Request<proto::DestroyQpRequest>,
    ) -> Reply<proto::DestroyQpResponse> {
        let session = self.open(Rpc::DestroyQp, &req)?;
        let qpn = req.get_ref().qpn;
        removed(session.remove_qp(qpn), || {
            format!("this session has no queue pair {qpn}")
        })?;
        Ok(Response::new(proto::DestroyQpResponse {}))
    }
}
