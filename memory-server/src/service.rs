//! The gRPC control service: maps RPCs onto the authenticator, the session table and
//! the device. Nothing here runs per data-path operation.

use crate::PROTOCOL;
use crate::auth::{AuthError, Authenticator};
use crate::durable::{Copier, Durable, PersistError, journal};
use crate::proto::{self, memory_server_server::MemoryServer as ControlRpc};
use crate::regions::{RegionDirectory, ServedRegion};
use crate::replica::{Backup, Replicator, Role, StreamTo};
use crate::session::{
    BorrowLedger, ObjectLimits, ReturnError, SESSION_METADATA, Session, SessionError, SessionId,
    Sessions,
};
use crate::stats::{Counters, Rpc, Stats};
use crate::token::ClusterToken;
use fabric::{CompletionQueue, Device, FabricError, NodeId, QpConfig, QpEndpoint, QueuePair};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};
use tonic::{Request, Response, Status};

/// Everything the control plane and the remote-verbs service serve from.
pub(crate) struct ServerState {
    pub device: Arc<dyn Device>,
    /// The completion queue of every server-side queue pair. The server never posts, so
    /// it only ever sees completions if a peer SENDs to a receive it will never post.
    pub cq: Arc<dyn CompletionQueue>,
    pub regions: Arc<Vec<ServedRegion>>,
    pub directory: RegionDirectory,
    pub auth: Authenticator,
    /// Shared with the replicator, which tells the backup the fenced incarnations.
    pub sessions: Arc<Sessions>,
    pub counters: Counters,
    pub started: Instant,
    pub max_qps_per_session: usize,
    /// Whether borrowed regions get every page backed at once, as the data regions.
    pub pin_memory: bool,
    /// Whether the remote-verbs service drives the device for clients.
    pub allow_remote_verbs: bool,
    /// What a session may create through remote verbs (and borrow).
    pub verbs_limits: ObjectLimits,
    /// What all sessions together have borrowed, against the server's cap.
    pub borrowed: Arc<BorrowLedger>,
    /// The data directory, for servers that keep one.
    pub durable: Option<Arc<Durable>>,
    /// A replicated primary's stream to its backup (set at start), or a promoted
    /// server's (set by AttachBackup).
    pub replica: OnceLock<Replicator>,
    /// Held by an AttachBackup under way: one at a time.
    pub attaching: tokio::sync::Mutex<()>,
    /// A backup's side of the stream (and whether it was promoted).
    pub backup: Option<Backup>,
    /// Persist's validation and copy for a replicated primary without a data directory.
    pub copier: Copier,
    /// For the stream of a backup attached while the server runs.
    pub token: ClusterToken,
    pub resync_delay: Duration,
}

impl ServerState {
    pub fn role(&self) -> Role {
        // A promoted server given a backup is still promoted: compute nodes prefer it
        // to the fenced primary it replaced.
        match (self.replica.get(), &self.backup) {
            (_, Some(b)) if b.promoted().is_some() => Role::Promoted,
            (Some(_), _) => Role::Primary,
            (None, Some(_)) => Role::Backup,
            (None, None) => Role::Standalone,
        }
    }

    /// Whether Persist works and what it covers survives the loss of this process (a
    /// promoted backup without a data directory is the exception: it is the last copy).
    pub fn durable(&self) -> bool {
        self.durable.is_some() || self.replica.get().is_some() || self.role() == Role::Promoted
    }

    /// Hello's boot: see `HelloResponse.boot` in the protocol.
    pub fn boot(&self) -> u64 {
        if let Some(boot) = self.backup.as_ref().and_then(|b| b.promoted()) {
            return boot;
        }
        match (&self.durable, self.replica.get()) {
            (Some(d), _) => d.boot(),
            (None, Some(_)) => 1,
            (None, None) => 0,
        }
    }

    pub fn stats(&self) -> Stats {
        let (sessions, queue_pairs, session_region_bytes) = self.sessions.counts();
        let durable = self.durable.as_ref().map(|d| (d.boot(), d.counters()));
        let count = |f: fn(&journal::Counters) -> &AtomicU64| {
            durable.map_or(0, |(_, c)| f(c).load(Ordering::Relaxed))
        };
        Stats {
            bytes_allocated: self.regions.iter().map(|r| r.mapped_len).sum(),
            bytes_registered: self.regions.iter().map(|r| r.info.remote.len).sum(),
            regions: self.regions.len() as u32,
            huge_page_regions: self.regions.iter().filter(|r| r.huge_pages).count() as u32,
            sessions: sessions as u32,
            queue_pairs: queue_pairs as u32,
            uptime: self.started.elapsed(),
            rpc_counts: self.counters.rpc_counts(),
            auth_failures: self.counters.auth_failures(),
            durable: self.durable(),
            boot: self.boot(),
            persist_requests: count(|c| &c.requests),
            persist_ranges: count(|c| &c.ranges),
            journaled_bytes: count(|c| &c.bytes),
            journal_fsyncs: count(|c| &c.fsyncs),
            checkpoints: count(|c| &c.checkpoints),
            last_checkpoint: Duration::from_micros(count(|c| &c.last_checkpoint_us)),
            session_region_bytes,
        }
    }

    /// The caller's live session (its lease renewed), or UNAUTHENTICATED.
    pub fn session<T>(&self, req: &Request<T>) -> Result<Arc<Session>, Status> {
        let value = req.metadata().get(SESSION_METADATA).ok_or_else(|| {
            Status::unauthenticated(format!(
                "no session: authenticate with Hello and Authenticate, then send the session id in the `{SESSION_METADATA}` metadata entry"
            ))
        })?;
        let id: SessionId = value
            .to_str()
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| {
                Status::unauthenticated(format!(
                    "malformed `{SESSION_METADATA}`: expected 32 hex digits"
                ))
            })?;
        self.sessions.touch(id, Instant::now()).ok_or_else(|| {
            match self.sessions.fenced_session(id) {
                Some(incarnation) => {
                    Status::unauthenticated(SessionError::Fenced(incarnation).to_string())
                }
                None => Status::unauthenticated("unknown or expired session; authenticate again"),
            }
        })
    }
}

pub(crate) struct ControlService {
    state: Arc<ServerState>,
}

impl ControlService {
    pub fn new(state: Arc<ServerState>) -> ControlService {
        ControlService { state }
    }
}

fn session_status(e: SessionError) -> Status {
    match e {
        SessionError::Ended => Status::unauthenticated(e.to_string()),
        _ => Status::resource_exhausted(e.to_string()),
    }
}

fn fabric_status(what: &str, e: &FabricError) -> Status {
    match e {
        FabricError::UnknownPeer(_) | FabricError::InvalidWorkRequest(_) => {
            Status::invalid_argument(format!("{what}: {e}"))
        }
        _ => Status::failed_precondition(format!("{what}: {e}")),
    }
}

#[tonic::async_trait]
impl ControlRpc for ControlService {
    async fn hello(
        &self,
        req: Request<proto::HelloRequest>,
    ) -> Result<Response<proto::HelloResponse>, Status> {
        self.state.counters.rpc(Rpc::Hello);
        let challenge = self
            .state
            .auth
            .hello(&req.get_ref().client_nonce, Instant::now())
            .map_err(|e| match e {
                AuthError::Busy => Status::resource_exhausted(e.to_string()),
                _ => Status::invalid_argument(e.to_string()),
            })?;
        Ok(Response::new(proto::HelloResponse {
            challenge_id: challenge.id.to_vec(),
            server_nonce: challenge.server_nonce.to_vec(),
            server_proof: challenge.server_proof.to_vec(),
            server_node: self.state.device.node().0,
            backend: self.state.device.backend().to_string(),
            version: crate::VERSION.to_string(),
            protocol: PROTOCOL.to_string(),
            durable: self.state.durable(),
            boot: self.state.boot(),
            role: self.state.role().to_proto() as i32,
            synced: self.state.backup.as_ref().is_some_and(Backup::synced),
            primary_silent_ms: self
                .state
                .backup
                .as_ref()
                .and_then(Backup::primary_silence)
                .map(|d| d.as_millis().try_into().unwrap_or(u64::MAX)),
            backup_at: self.state.replica.get().map(|r| r.addr().to_string()),
        }))
    }

    async fn authenticate(
        &self,
        req: Request<proto::AuthenticateRequest>,
    ) -> Result<Response<proto::AuthenticateResponse>, Status> {
        self.state.counters.rpc(Rpc::Authenticate);
        let peer = req.remote_addr();
        let now = Instant::now();
        let body = req.get_ref();
        if let Err(e) = self
            .state
            .auth
            .authenticate(&body.challenge_id, &body.client_proof, now)
        {
            self.state.counters.auth_failure();
            tracing::warn!(?peer, "authentication refused: {e}");
            return Err(Status::unauthenticated(e.to_string()));
        }
        let incarnation = body.incarnation;
        let session = self
            .state
            .sessions
            .open(peer, now, incarnation)
            .map_err(|e| match e {
                SessionError::TooManySessions(_) => Status::resource_exhausted(e.to_string()),
                SessionError::Fenced(_) => Status::permission_denied(e.to_string()),
                _ => Status::internal(e.to_string()),
            })?;
        tracing::info!(?peer, session = ?session.id, incarnation = %format_args!("{incarnation:#x}"), "session opened");
        Ok(Response::new(proto::AuthenticateResponse {
            session_id: session.id.0.to_vec(),
            lease_ms: self.state.sessions.lease().as_millis() as u64,
        }))
    }

    async fn list_regions(
        &self,
        req: Request<proto::ListRegionsRequest>,
    ) -> Result<Response<proto::ListRegionsResponse>, Status> {
        self.state.counters.rpc(Rpc::ListRegions);
        self.state.session(&req)?;
        let regions = self
            .state
            .directory
            .regions()
            .iter()
            .map(|r| proto::Region {
                name: r.name.clone(),
                node: r.remote.node.0,
                rkey: r.remote.rkey,
                len: r.remote.len,
                access: r.access.bits(),
            })
            .collect();
        Ok(Response::new(proto::ListRegionsResponse { regions }))
    }

    async fn connect_queue_pair(
        &self,
        req: Request<proto::ConnectQueuePairRequest>,
    ) -> Result<Response<proto::ConnectQueuePairResponse>, Status> {
        self.state.counters.rpc(Rpc::Connect);
        let session = self.state.session(&req)?;
        if let Some(b) = &self.state.backup {
            b.check_serving()?;
        }
        let body = req.into_inner();
        match proto::QpKind::try_from(body.kind) {
            Ok(proto::QpKind::Rc) => {}
            Ok(proto::QpKind::Ud) => {
                return Err(Status::invalid_argument(
                    "UD queue pairs need no connection; a memory server connects RC queue pairs only",
                ));
            }
            _ => {
                return Err(Status::invalid_argument(format!(
                    "unknown queue pair kind {}; expected QP_KIND_RC",
                    body.kind
                )));
            }
        }
        let server_node = self.state.device.node();
        let client_node = NodeId(body.client_node);
        if client_node == server_node {
            return Err(Status::invalid_argument(format!(
                "client_node {client_node} is the memory server's own node"
            )));
        }
        let client = QpEndpoint {
            node: client_node,
            qpn: body.client_qpn,
        };
        // Device calls are synchronous and a backend may block in them (a tcp backend
        // dialling the peer), so they run off the async workers.
        let state = self.state.clone();
        let address = body.client_address;
        let qp = tokio::task::spawn_blocking(move || -> Result<Arc<dyn QueuePair>, Status> {
            let dev = &state.device;
            dev.add_peer(client_node, &address).map_err(|e| {
                Status::invalid_argument(format!("client address `{address}`: {e}"))
            })?;
            let qp = dev
                .create_qp(&QpConfig::rc(&state.cq))
                .map_err(|e| Status::resource_exhausted(format!("creating a queue pair: {e}")))?;
            qp.connect(client)
                .map_err(|e| fabric_status(&format!("connecting to {client}"), &e))?;
            Ok(qp)
        })
        .await
        .map_err(|e| Status::internal(format!("connect task failed: {e}")))??;
        let server_qpn = qp.endpoint().qpn;
        // The server's own completion queue, which no session id names.
        session
            .add_qp(qp, [0, 0], self.state.max_qps_per_session)
            .map_err(|e| match e {
                SessionError::Ended => Status::unauthenticated(e.to_string()),
                _ => Status::resource_exhausted(e.to_string()),
            })?;
        tracing::debug!(session = ?session.id, %client, server_qpn, "queue pair connected");
        Ok(Response::new(proto::ConnectQueuePairResponse {
            server_node: server_node.0,
            server_address: self.state.device.address(),
            server_qpn,
        }))
    }

    async fn disconnect_queue_pair(
        &self,
        req: Request<proto::DisconnectQueuePairRequest>,
    ) -> Result<Response<proto::DisconnectQueuePairResponse>, Status> {
        self.state.counters.rpc(Rpc::Disconnect);
        let session = self.state.session(&req)?;
        let qpn = req.get_ref().server_qpn;
        if !session.remove_qp(qpn) {
            return Err(Status::not_found(format!(
                "this session has no queue pair {qpn}"
            )));
        }
        tracing::debug!(session = ?session.id, qpn, "queue pair destroyed");
        Ok(Response::new(proto::DisconnectQueuePairResponse {}))
    }

    async fn keep_alive(
        &self,
        req: Request<proto::KeepAliveRequest>,
    ) -> Result<Response<proto::KeepAliveResponse>, Status> {
        self.state.counters.rpc(Rpc::KeepAlive);
        let session = self.state.session(&req)?;
        if let Some(backup) = &self.state.backup {
            backup.heard_from(session.id);
        }
        Ok(Response::new(proto::KeepAliveResponse {
            lease_ms: self.state.sessions.lease().as_millis() as u64,
        }))
    }

    async fn end_session(
        &self,
        req: Request<proto::EndSessionRequest>,
    ) -> Result<Response<proto::EndSessionResponse>, Status> {
        self.state.counters.rpc(Rpc::EndSession);
        let session = self.state.session(&req)?;
        let state = self.state.clone();
        let id = session.id;
        let ended = tokio::task::spawn_blocking(move || state.sessions.end(id))
            .await
            .map_err(|e| Status::internal(format!("ending the session: {e}")))?;
        if let Some(held) = ended {
            held.log(session.id, session.peer, "session ended");
        }
        Ok(Response::new(proto::EndSessionResponse {}))
    }

    async fn fence(
        &self,
        req: Request<proto::FenceRequest>,
    ) -> Result<Response<proto::FenceResponse>, Status> {
        self.state.counters.rpc(Rpc::Fence);
        let by = self.state.session(&req)?;
        let incarnation = req.get_ref().incarnation;
        if incarnation == 0 {
            return Err(Status::invalid_argument(
                "incarnation 0 names no compute node: sessions opened without one cannot be fenced",
            ));
        }
        // Off the runtime's threads, as the reaper (a destroyed queue pair waits for
        // the request its peer is executing in this server's memory).
        let state = self.state.clone();
        let ended = tokio::task::spawn_blocking(move || state.sessions.fence(incarnation))
            .await
            .map_err(|e| Status::internal(format!("fencing: {e}")))?;
        let queue_pairs: usize = ended.iter().map(|(_, held)| held.queue_pairs).sum();
        for (session, held) in &ended {
            held.log(session.id, session.peer, "session fenced");
        }
        tracing::warn!(
            incarnation = %format_args!("{incarnation:#x}"),
            by = ?by.id,
            sessions = ended.len(),
            queue_pairs,
            "compute-node incarnation fenced: its queue pairs are destroyed and its sessions refused"
        );
        // A backup promoted later must refuse the incarnation too, or the fenced node
        // would reach the same memory through it. The fence stands here either way;
        // the fencer asks again until the backup has it.
        if let Some(replica) = self.state.replica.get() {
            replica.fence(incarnation).await.map_err(|why| {
                Status::unavailable(format!(
                    "incarnation {incarnation:#x} is fenced at this primary, but its backup \
                     has not recorded the fence ({why}), so a promoted backup could admit it: \
                     fence it again"
                ))
            })?;
        }
        Ok(Response::new(proto::FenceResponse {
            sessions_ended: ended.len() as u32,
            queue_pairs_destroyed: queue_pairs as u32,
        }))
    }

    async fn stats(
        &self,
        req: Request<proto::StatsRequest>,
    ) -> Result<Response<proto::StatsResponse>, Status> {
        self.state.counters.rpc(Rpc::Stats);
        self.state.session(&req)?;
        let s = self.state.stats();
        Ok(Response::new(proto::StatsResponse {
            bytes_allocated: s.bytes_allocated,
            bytes_registered: s.bytes_registered,
            regions: s.regions,
            huge_page_regions: s.huge_page_regions,
            sessions: s.sessions,
            queue_pairs: s.queue_pairs,
            uptime_ms: s.uptime.as_millis() as u64,
            rpc_counts: s.rpc_counts.into_iter().collect(),
            auth_failures: s.auth_failures,
            persist_requests: s.persist_requests,
            persist_ranges: s.persist_ranges,
            journaled_bytes: s.journaled_bytes,
            journal_fsyncs: s.journal_fsyncs,
            checkpoints: s.checkpoints,
            last_checkpoint_us: s.last_checkpoint.as_micros() as u64,
            session_region_bytes: s.session_region_bytes,
        }))
    }

    async fn borrow_region(
        &self,
        req: Request<proto::BorrowRegionRequest>,
    ) -> Result<Response<proto::BorrowRegionResponse>, Status> {
        self.state.counters.rpc(Rpc::BorrowRegion);
        let session = self.state.session(&req)?;
        if let Some(b) = &self.state.backup {
            b.check_serving()?;
        }
        let len = req.get_ref().len;
        if len == 0 || !len.is_multiple_of(8) {
            return Err(Status::invalid_argument(format!(
                "a borrowed region is a positive multiple of 8 bytes, not {len}"
            )));
        }
        let limits = self.state.verbs_limits;
        // Checked before the memory is allocated, so an oversized request costs nothing.
        session.region_fits(len, &limits).map_err(session_status)?;
        let loan = self.state.borrowed.lend(len).map_err(session_status)?;
        let (device, pin) = (self.state.device.clone(), self.state.pin_memory);
        let region = tokio::task::spawn_blocking(move || {
            let alloc = crate::regions::allocate("borrowed", len, pin)
                .map_err(|e| Status::resource_exhausted(format!("allocating {len} bytes: {e}")))?;
            device
                .register_memory(alloc.memory, len, fabric::Access::ALL)
                .map_err(|e| fabric_status(&format!("registering {len} bytes"), &e))
        })
        .await
        .map_err(|e| Status::internal(format!("the allocation failed: {e}")))??;
        let remote = region.remote();
        session
            .add_region(region, &limits, Some(loan))
            .map_err(session_status)?;
        tracing::info!(session = ?session.id, len, rkey = remote.rkey, "region borrowed");
        Ok(Response::new(proto::BorrowRegionResponse {
            region: Some(proto::Region {
                name: "borrowed".into(),
                node: remote.node.0,
                rkey: remote.rkey,
                len: remote.len,
                access: fabric::Access::ALL.bits(),
            }),
        }))
    }

    async fn return_region(
        &self,
        req: Request<proto::ReturnRegionRequest>,
    ) -> Result<Response<proto::ReturnRegionResponse>, Status> {
        self.state.counters.rpc(Rpc::ReturnRegion);
        let session = self.state.session(&req)?;
        let rkey = req.get_ref().rkey;
        match session.return_borrowed(rkey) {
            Ok(()) => {}
            Err(ReturnError::NotHeld) => {
                return Err(Status::not_found(format!(
                    "this session holds no region with rkey {rkey:#x}"
                )));
            }
            Err(ReturnError::NotBorrowed { lkey }) => {
                return Err(Status::failed_precondition(format!(
                    "the region with rkey {rkey:#x} was not borrowed: this session registered \
                     it through remote verbs (RegisterRegion, lkey {lkey:#x}), and ReturnRegion \
                     gives back only regions BorrowRegion lent; it is kept as it was \
                     (DeregisterRegion frees it)"
                )));
            }
        }
        tracing::info!(session = ?session.id, rkey, "region returned");
        Ok(Response::new(proto::ReturnRegionResponse {}))
    }

    async fn persist(
        &self,
        req: Request<proto::PersistRequest>,
    ) -> Result<Response<proto::PersistResponse>, Status> {
        self.state.counters.rpc(Rpc::Persist);
        self.state.session(&req)?;
        if let Some(b) = &self.state.backup {
            b.check_serving()?;
        }
        let ranges = req.into_inner().ranges;
        if self.state.durable.is_none() && self.state.replica.get().is_none() {
            if self.state.role() == Role::Promoted {
                // A promoted backup without a data directory: its memory is the only
                // copy, and Persist has nothing more to make it survive.
                return Ok(Response::new(proto::PersistResponse { journaled_bytes: 0 }));
            }
            return Err(Status::failed_precondition(
                "this memory server is not durable: Persist needs a data directory or a \
                 backup; start the server with --data-dir DIR or --backup-at ADDR",
            ));
        }
        let total: u64 = ranges.iter().map(|r| r.len).sum();
        let state = self.state.clone();
        // The copy may wait for guard words (up to the guard wait) and copies up to
        // 64 MiB: not on an async worker.
        let queued = tokio::task::spawn_blocking(move || match &state.durable {
            Some(durable) => durable.persist(&state.regions, &ranges, state.replica.get()),
            None => {
                let replica = state.replica.get().expect("checked above");
                state.copier.copy(
                    &state.regions,
                    &ranges,
                    &replica.order,
                    None,
                    |_, entries, count, _| Ok((None, Some(replica.ship(entries, count)?))),
                )
            }
        })
        .await
        .map_err(|e| Status::internal(format!("the persist task failed: {e}")))?
        .map_err(|e| persist_status(&e))?;
        let Some((journal, shipped)) = queued else {
            return Ok(Response::new(proto::PersistResponse { journaled_bytes: 0 }));
        };
        // Both copies before the acknowledgement: never one alone.
        if let Some(shipped) = shipped {
            shipped
                .await
                .map_err(|_| Status::unavailable("the replication stream stopped"))?
                .map_err(refused_persist)?;
        }
        let journaled_bytes = match journal {
            None => total,
            Some(reply) => reply
                .await
                .map_err(|_| {
                    Status::unavailable("the journal stopped before the write was durable")
                })?
                .map_err(Status::internal)?,
        };
        Ok(Response::new(proto::PersistResponse { journaled_bytes }))
    }

    async fn replica_attach(
        &self,
        req: Request<proto::ReplicaAttachRequest>,
    ) -> Result<Response<proto::ReplicaAttachResponse>, Status> {
        let session = self.state.session(&req)?;
        self.backup()?;
        let (boot, epoch) = (req.get_ref().primary_boot, req.get_ref().primary_epoch);
        let (state, id, peer) = (self.state.clone(), session.id, session.peer);
        // A durable backup records the primary's epoch: disk IO, not on an async worker.
        let answer = tokio::task::spawn_blocking(move || {
            let backup = state.backup.as_ref().expect("checked above");
            backup.attach(
                (id, peer),
                &state.regions,
                req.get_ref(),
                state.durable.as_deref(),
                (
                    |other| state.sessions.is_live(other, Instant::now()),
                    state.sessions.lease(),
                ),
            )
        })
        .await
        .map_err(|e| Status::internal(format!("the attach task failed: {e}")))??;
        tracing::info!(peer = ?session.peer, primary_boot = boot, primary_epoch = epoch, "primary attached");
        Ok(Response::new(answer))
    }

    async fn replica_apply(
        &self,
        req: Request<proto::ReplicaApplyRequest>,
    ) -> Result<Response<proto::ReplicaApplyResponse>, Status> {
        let session = self.state.session(&req)?;
        self.backup()?;
        let state = self.state.clone();
        let body = req.into_inner();
        // Writes up to a batch's worth of region memory: not on an async worker.
        let journaled = tokio::task::spawn_blocking(move || {
            let backup = state.backup.as_ref().expect("checked above");
            backup.apply(session.id, body, &state.regions, state.durable.as_deref())
        })
        .await
        .map_err(|e| Status::internal(format!("the apply task failed: {e}")))??;
        if let Some(reply) = journaled {
            reply
                .await
                .map_err(|_| Status::unavailable("the backup's journal stopped"))?
                .map_err(Status::internal)?;
        }
        Ok(Response::new(proto::ReplicaApplyResponse {}))
    }

    async fn promote(
        &self,
        req: Request<proto::PromoteRequest>,
    ) -> Result<Response<proto::PromoteResponse>, Status> {
        self.state.session(&req)?;
        self.backup()?;
        let state = self.state.clone();
        // Records the boot on disk (a durable backup).
        let boot = tokio::task::spawn_blocking(move || {
            let backup = state.backup.as_ref().expect("checked above");
            backup.promote(state.durable.as_deref())
        })
        .await
        .map_err(|e| Status::internal(format!("the promote task failed: {e}")))??;
        Ok(Response::new(proto::PromoteResponse { boot }))
    }

    async fn attach_backup(
        &self,
        req: Request<proto::AttachBackupRequest>,
    ) -> Result<Response<proto::AttachBackupResponse>, Status> {
        self.state.session(&req)?;
        let backup_at = req.into_inner().backup_at.trim().to_string();
        if backup_at.is_empty() {
            return Err(Status::invalid_argument(
                "AttachBackup needs the backup's address (backup_at, host:port)",
            ));
        }
        let Some(epoch) = self
            .state
            .backup
            .as_ref()
            .filter(|b| b.promoted().is_some())
            .map(Backup::epoch)
        else {
            return Err(Status::failed_precondition(match self.state.role() {
                Role::Primary => format!(
                    "this memory server replicates to the backup at {} already",
                    self.state.replica.get().map_or("?", |r| r.addr())
                ),
                Role::Backup => "this memory server is a backup; only a promoted server \
                                 takes a new backup while it runs"
                    .to_string(),
                _ => "this memory server is not replicated: only a promoted server takes a \
                      new backup while it runs; start a server with --backup-at ADDR to give \
                      it one"
                    .to_string(),
            }));
        };
        let Ok(_one) = self.state.attaching.try_lock() else {
            return Err(Status::aborted(
                "another AttachBackup is under way on this server; ask again once it answered",
            ));
        };
        match self.state.replica.get() {
            Some(replica) if replica.addr() != backup_at => {
                return Err(Status::failed_precondition(format!(
                    "this memory server replicates to the backup at {} already (a server \
                     attaches again only to the backup it has)",
                    replica.addr()
                )));
            }
            Some(_) => {}
            None => {
                let state = &self.state;
                let replica = Replicator::attach_running(StreamTo {
                    addr: backup_at.clone(),
                    token: state.token.clone(),
                    regions: state.regions.clone(),
                    sessions: state.sessions.clone(),
                    boot: state.boot(),
                    epoch,
                    durable: state.durable.clone(),
                    resync_delay: state.resync_delay,
                })
                .await
                .map_err(Status::unavailable)?;
                tracing::info!(
                    backup = backup_at.as_str(),
                    "new backup attached to this promoted server"
                );
                if self.state.replica.set(replica).is_err() {
                    return Err(Status::internal("a backup was attached meanwhile"));
                }
            }
        }
        // A Fence between the attach (which handed the backup every fence recorded by
        // then) and the replicator's install was recorded here alone: hand them all on
        // again, so that the backup, if promoted later, refuses every fenced node.
        let replica = self.state.replica.get().expect("set above");
        for incarnation in self.state.sessions.fenced_incarnations() {
            replica.fence(incarnation).await.map_err(|why| {
                Status::unavailable(format!(
                    "the backup at {backup_at} was attached, but did not record the fence of \
                     incarnation {incarnation:#x} ({why}); ask again"
                ))
            })?;
        }
        Ok(Response::new(proto::AttachBackupResponse {}))
    }
}

impl ControlService {
    fn backup(&self) -> Result<&Backup, Status> {
        self.state.backup.as_ref().ok_or_else(|| {
            Status::failed_precondition(
                "this memory server is not a backup (start it with --backup to replicate to it)",
            )
        })
    }
}

/// A Persist the replication stream refused: UNAVAILABLE, marked when a later one
/// may be acknowledged ([`crate::replica::PERSIST_LATER_METADATA`]).
fn refused_persist(refusal: crate::replica::Refusal) -> Status {
    let mut status = Status::unavailable(refusal.why);
    if refusal.for_now {
        status.metadata_mut().insert(
            crate::replica::PERSIST_LATER_METADATA,
            tonic::metadata::AsciiMetadataValue::from_static("1"),
        );
    }
    status
}

fn persist_status(e: &PersistError) -> Status {
    let message = e.to_string();
    match e {
        PersistError::UnknownRkey { .. }
        | PersistError::BadGuard { .. }
        | PersistError::TooLarge => Status::invalid_argument(message),
        PersistError::OutOfRange { .. } => Status::out_of_range(message),
        PersistError::GuardBusy { .. } => Status::aborted(message),
        PersistError::Closed => Status::unavailable(message),
        PersistError::Disk(_) => Status::internal(message),
    }
}
