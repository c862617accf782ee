//! The client library: authenticate to a memory server, read its region directory,
//! connect queue pairs to it, and read its statistics.
//!
//! A [`Client`] holds one session. It renews the session's lease in the background (a
//! task on the caller's tokio runtime) and ends it on [`Client::close`] or drop. The
//! queue pairs it connects belong to the session: the server destroys its side of them
//! when the session ends.

use crate::PROTOCOL;
use crate::auth::ClientHandshake;
use crate::proto::{self, memory_server_client::MemoryServerClient};
use crate::regions::{RegionDirectory, RegionInfo};
use crate::session::{SESSION_METADATA, SessionId};
use crate::stats::Stats;
use crate::token::ClusterToken;
use fabric::{
    Access, CompletionQueue, Device, FabricError, NodeId, QpConfig, QpEndpoint, QpKind, QueuePair,
    RemoteRegion,
};
use std::sync::Arc;
use std::time::Duration;
use thiserror::Error;
use tonic::metadata::{AsciiMetadataValue, MetadataValue};
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Request, Status};

const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How often an HTTP/2 PING checks that the server still answers, and how long its
/// answer may take: a server stopped (SIGSTOP) or wedged keeps its TCP connection
/// open, so without this every call to it, and whoever waits on that call (a commit's
/// persist, a compute node's lease renewal), hung until it went on. Generous, because
/// a call may rightly take long (a Persist waits for its guard words and the backup)
/// and a loaded host answers late; the PING measures the server, not the call.
const KEEP_ALIVE_INTERVAL: Duration = Duration::from_secs(15);
const KEEP_ALIVE_TIMEOUT: Duration = Duration::from_secs(15);

#[derive(Debug, Error)]
pub enum ClientError {
    #[error("invalid memory server address `{addr}`: {source}")]
    Address {
        addr: String,
        #[source]
        source: tonic::transport::Error,
    },
    #[error("cannot reach the memory server at {addr}: {source}")]
    Unreachable {
        addr: String,
        #[source]
        source: tonic::transport::Error,
    },
    #[error(
        "the memory server at {addr} could not prove that it holds the cluster token \
         (the tokens differ, or it is not a namdb memory server); not authenticating to it"
    )]
    ServerNotAuthenticated { addr: String },
    #[error("{method} failed: {} ({:?})", status_text(.status), .status.code())]
    Rpc {
        method: &'static str,
        status: Box<Status>,
    },
    #[error("the memory server sent a malformed reply: {0}")]
    Protocol(String),
    #[error("{what}: {source}")]
    Fabric {
        what: &'static str,
        #[source]
        source: FabricError,
    },
    #[error("a memory server connects RC queue pairs only")]
    NotRc,
    #[error("{0}")]
    Runtime(String),
    #[error("the memory server at {addr} did not answer within {limit:?}")]
    TimedOut { addr: String, limit: Duration },
}

impl ClientError {
    /// The gRPC status code, for errors the server returned.
    pub fn code(&self) -> Option<Code> {
        match self {
            ClientError::Rpc { status, .. } => Some(status.code()),
            _ => None,
        }
    }

    /// Whether the server refused this compute-node incarnation because it was fenced
    /// (a session it ended, or a new one): the node must open the database anew.
    pub fn was_fenced(&self) -> bool {
        match self {
            ClientError::Rpc { status, .. } => {
                matches!(
                    status.code(),
                    Code::Unauthenticated | Code::PermissionDenied
                ) && status.message().contains(" was fenced: ")
            }
            _ => false,
        }
    }

    /// Whether a Persist was refused only until the primary attaches to its backup
    /// again (it does so by itself, every second): the same Persist, made again, may
    /// then be acknowledged.
    pub fn persist_later(&self) -> bool {
        match self {
            ClientError::Rpc { status, .. } => persist_later(status),
            _ => false,
        }
    }
}

/// Whether `status` refused a Persist only for now ([`ClientError::persist_later`]).
pub(crate) fn persist_later(status: &Status) -> bool {
    status.code() == Code::Unavailable
        && status
            .metadata()
            .contains_key(crate::replica::PERSIST_LATER_METADATA)
}

/// A status's message and, after it, what caused it where the message does not say
/// already: a transport failure's message alone is "tcp connect error" or "http2
/// error", its cause "Connection refused" or "keep-alive timed out". A transport
/// error that has a cause is left out: it says only "transport error", between the
/// message and the cause that say what happened.
pub fn status_text(status: &Status) -> String {
    let mut text = status.message().to_string();
    let mut cause = std::error::Error::source(status);
    while let Some(e) = cause {
        let said = e.to_string();
        let label = e.is::<tonic::transport::Error>() && e.source().is_some();
        if !said.is_empty() && !label && !text.contains(&said) {
            text = if text.is_empty() {
                said
            } else {
                format!("{text}: {said}")
            };
        }
        cause = e.source();
    }
    text
}

fn rpc_error(method: &'static str) -> impl FnOnce(Status) -> ClientError {
    move |status| ClientError::Rpc {
        method,
        status: Box::new(status),
    }
}

/// The first half of the handshake: a Hello, checked for the protocol and for the
/// server's proof that it holds `token`. Answers the Hello and this client's proof.
async fn say_hello(
    rpc: &mut MemoryServerClient<Channel>,
    addr: &str,
    token: &ClusterToken,
) -> Result<(proto::HelloResponse, [u8; 32]), ClientError> {
    let handshake = ClientHandshake::new();
    let hello = rpc
        .hello(proto::HelloRequest {
            client_nonce: handshake.client_nonce().to_vec(),
        })
        .await
        .map_err(rpc_error("Hello"))?
        .into_inner();
    if hello.protocol != PROTOCOL {
        return Err(ClientError::Protocol(format!(
            "the server speaks `{}`, this client `{PROTOCOL}`",
            hello.protocol
        )));
    }
    let proof = handshake
        .respond(token, &hello.server_nonce, &hello.server_proof)
        .ok_or_else(|| ClientError::ServerNotAuthenticated {
            addr: addr.to_string(),
        })?;
    Ok((hello, proof))
}

impl ServerInfo {
    fn from_hello(hello: proto::HelloResponse) -> ServerInfo {
        ServerInfo {
            node: NodeId(hello.server_node),
            backend: hello.backend,
            version: hello.version,
            protocol: hello.protocol,
            durable: hello.durable,
            boot: hello.boot,
            role: crate::Role::from_proto(hello.role),
            synced: hello.synced,
            primary_silence: hello.primary_silent_ms.map(Duration::from_millis),
            backup_at: hello.backup_at,
        }
    }
}

/// What the server said about itself in the handshake.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerInfo {
    pub node: NodeId,
    pub backend: String,
    pub version: String,
    pub protocol: String,
    /// Whether Persist works and what it covers survives the loss of the server's
    /// process: it keeps a data directory or replicates to a backup.
    pub durable: bool,
    /// Changes whenever the server's state is not the one last seen: starts on its data
    /// directory (1 on the first), 1 for a replicated primary without one, a promoted
    /// backup's own; 0 when not durable.
    pub boot: u64,
    /// What the server is in replication.
    pub role: crate::Role,
    /// A backup holding its primary's whole state (one that can be promoted).
    pub synced: bool,
    /// A backup with an attached primary: how long ago it last heard from it (a batch
    /// or a session renewal; an idle primary renews every [`crate::PRIMARY_HEARTBEAT`]).
    /// `None` on other servers, and on a backup no primary attached to yet.
    pub primary_silence: Option<Duration>,
    /// A server that replicates to a backup (a primary, or a promoted server given one
    /// by [`Client::attach_backup`]): that backup's address. `None` on other servers.
    pub backup_at: Option<String>,
}

/// A byte range of a region for [`Client::persist`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PersistRange {
    /// The region, as the directory lists it.
    pub rkey: u32,
    pub offset: u64,
    pub len: u64,
    /// The range starts with a guard word (8-byte aligned, `len >= 8`): a record header
    /// whose bit 63 is a lock. The server copies the range only while the word is
    /// unlocked and unchanged across the copy, waiting while it is locked or moving (up
    /// to its guard wait).
    pub guarded: bool,
}

impl PersistRange {
    pub fn new(rkey: u32, offset: u64, len: u64) -> PersistRange {
        PersistRange {
            rkey,
            offset,
            len,
            guarded: false,
        }
    }

    /// A range that starts with a guard word.
    pub fn guarded(rkey: u32, offset: u64, len: u64) -> PersistRange {
        PersistRange {
            guarded: true,
            ..PersistRange::new(rkey, offset, len)
        }
    }
}

impl From<&PersistRange> for proto::PersistRange {
    fn from(r: &PersistRange) -> proto::PersistRange {
        proto::PersistRange {
            rkey: r.rkey,
            offset: r.offset,
            len: r.len,
            guarded: r.guarded,
        }
    }
}

pub(crate) fn persist_request(ranges: &[PersistRange]) -> proto::PersistRequest {
    proto::PersistRequest {
        ranges: ranges.iter().map(Into::into).collect(),
    }
}

/// The server's side of a connected queue pair.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteEndpointInfo {
    pub node: NodeId,
    /// The server device's address, as given to the client device's `add_peer`.
    pub address: String,
    pub qpn: u32,
}

impl RemoteEndpointInfo {
    pub fn endpoint(&self) -> QpEndpoint {
        QpEndpoint {
            node: self.node,
            qpn: self.qpn,
        }
    }
}

/// What a [`Client::fence`] ended at one server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FenceReport {
    pub sessions_ended: u32,
    pub queue_pairs_destroyed: u32,
}

/// An authenticated session with one memory server.
pub struct Client {
    /// As given to [`Client::connect`], for errors.
    addr: String,
    rpc: MemoryServerClient<Channel>,
    /// For the remote-verbs service, which shares the connection and the session.
    channel: Channel,
    session: SessionId,
    header: AsciiMetadataValue,
    server: ServerInfo,
    lease: Duration,
    keepalive: tokio::task::JoinHandle<()>,
    ended: bool,
}

fn endpoint_uri(addr: &str) -> String {
    if addr.contains("://") {
        addr.to_string()
    } else {
        format!("http://{addr}")
    }
}

impl Client {
    /// Connects to the memory server at `addr` (`host:port`, or a `http://` URI), checks
    /// that it holds `token`, and authenticates with it. Must be called within a tokio
    /// runtime, which then also runs the lease renewal.
    pub async fn connect(addr: &str, token: &ClusterToken) -> Result<Client, ClientError> {
        Client::connect_as(addr, token, 0).await
    }

    /// [`Client::connect`] for a session of compute-node `incarnation` (0: none), which
    /// [`Client::fence`] names: give every server the same one, fresh for each opening
    /// of a database. A fenced incarnation is refused.
    pub async fn connect_as(
        addr: &str,
        token: &ClusterToken,
        incarnation: u64,
    ) -> Result<Client, ClientError> {
        let endpoint = Endpoint::from_shared(endpoint_uri(addr))
            .map_err(|source| ClientError::Address {
                addr: addr.to_string(),
                source,
            })?
            .connect_timeout(CONNECT_TIMEOUT)
            .http2_keep_alive_interval(KEEP_ALIVE_INTERVAL)
            .keep_alive_timeout(KEEP_ALIVE_TIMEOUT)
            .keep_alive_while_idle(true)
            .tcp_nodelay(true);
        let channel = endpoint
            .connect()
            .await
            .map_err(|source| ClientError::Unreachable {
                addr: addr.to_string(),
                source,
            })?;
        let mut rpc = MemoryServerClient::new(channel.clone());
        let (hello, proof) = say_hello(&mut rpc, addr, token).await?;
        let auth = rpc
            .authenticate(proto::AuthenticateRequest {
                challenge_id: hello.challenge_id.clone(),
                client_proof: proof.to_vec(),
                incarnation,
            })
            .await
            .map_err(rpc_error("Authenticate"))?
            .into_inner();
        let session = SessionId(
            auth.session_id
                .try_into()
                .map_err(|_| ClientError::Protocol("the session id is not 16 bytes".into()))?,
        );
        if auth.lease_ms == 0 {
            return Err(ClientError::Protocol("a session lease of 0 ms".into()));
        }
        let lease = Duration::from_millis(auth.lease_ms);
        let header: AsciiMetadataValue = MetadataValue::try_from(session.to_string())
            .map_err(|_| ClientError::Protocol("session id is not ASCII".into()))?;
        let keepalive = tokio::spawn(renew(rpc.clone(), header.clone(), lease));
        Ok(Client {
            addr: addr.to_string(),
            rpc,
            channel,
            session,
            header,
            server: ServerInfo::from_hello(hello),
            lease,
            keepalive,
            ended: false,
        })
    }

    pub fn server(&self) -> &ServerInfo {
        &self.server
    }

    /// What the server says about itself now (it may have been promoted since
    /// [`Client::server`] was said), asked with a Hello on this connection: the server
    /// proves it holds the token again, and no session is opened (a question asked
    /// every second would otherwise open one, and log it, every second).
    pub async fn hello_again(&self, token: &ClusterToken) -> Result<ServerInfo, ClientError> {
        let (hello, _) = say_hello(&mut self.rpc.clone(), &self.addr, token).await?;
        Ok(ServerInfo::from_hello(hello))
    }

    pub fn session_id(&self) -> SessionId {
        self.session
    }

    /// How long the session survives without an RPC (renewals are automatic).
    pub fn lease(&self) -> Duration {
        self.lease
    }

    pub(crate) fn channel(&self) -> Channel {
        self.channel.clone()
    }

    /// `message` as a request of this session.
    /// The server's address, as given to [`Client::connect`].
    pub fn addr(&self) -> &str {
        &self.addr
    }

    pub(crate) fn request<T>(&self, message: T) -> Request<T> {
        let mut req = Request::new(message);
        req.metadata_mut()
            .insert(SESSION_METADATA, self.header.clone());
        req
    }

    /// The server's region directory.
    pub async fn list_regions(&self) -> Result<RegionDirectory, ClientError> {
        let reply = self
            .rpc
            .clone()
            .list_regions(self.request(proto::ListRegionsRequest {}))
            .await
            .map_err(rpc_error("ListRegions"))?
            .into_inner();
        let regions = reply
            .regions
            .into_iter()
            .map(|r| {
                let access = Access::from_bits(r.access).ok_or_else(|| {
                    ClientError::Protocol(format!(
                        "region `{}` has unknown access bits {:#x}",
                        r.name, r.access
                    ))
                })?;
                Ok(RegionInfo {
                    name: r.name,
                    remote: RemoteRegion {
                        node: NodeId(r.node),
                        rkey: r.rkey,
                        len: r.len,
                    },
                    access,
                })
            })
            .collect::<Result<Vec<_>, ClientError>>()?;
        Ok(RegionDirectory::new(regions))
    }

    /// Creates an RC queue pair on `device` (sending and receiving on `cq`) and connects
    /// it to a new queue pair on the server.
    pub async fn connect_qp(
        &self,
        device: &dyn Device,
        cq: &Arc<dyn CompletionQueue>,
    ) -> Result<(Arc<dyn QueuePair>, RemoteEndpointInfo), ClientError> {
        self.connect_qp_with_config(device, &QpConfig::rc(cq)).await
    }

    /// As [`Client::connect_qp`], with the local queue pair made from `config` (which
    /// must be RC).
    pub async fn connect_qp_with_config(
        &self,
        device: &dyn Device,
        config: &QpConfig,
    ) -> Result<(Arc<dyn QueuePair>, RemoteEndpointInfo), ClientError> {
        if config.kind != QpKind::Rc {
            return Err(ClientError::NotRc);
        }
        let qp = device
            .create_qp(config)
            .map_err(|source| ClientError::Fabric {
                what: "creating the local queue pair",
                source,
            })?;
        let reply = self
            .rpc
            .clone()
            .connect_queue_pair(self.request(proto::ConnectQueuePairRequest {
                client_node: device.node().0,
                client_address: device.address(),
                client_qpn: qp.endpoint().qpn,
                kind: proto::QpKind::Rc as i32,
            }))
            .await
            .map_err(rpc_error("ConnectQueuePair"))?
            .into_inner();
        let remote = RemoteEndpointInfo {
            node: NodeId(reply.server_node),
            address: reply.server_address,
            qpn: reply.server_qpn,
        };
        let finish = if remote.node != self.server.node {
            Err(ClientError::Protocol(format!(
                "ConnectQueuePair answered from {} but the server is {}",
                remote.node, self.server.node
            )))
        } else {
            device
                .add_peer(remote.node, &remote.address)
                .and_then(|()| qp.connect(remote.endpoint()))
                .map_err(|source| ClientError::Fabric {
                    what: "connecting to the server's queue pair",
                    source,
                })
        };
        if let Err(e) = finish {
            // The server's half would otherwise live until the session ends.
            let _ = self.disconnect_qp(remote.qpn).await;
            return Err(e);
        }
        Ok((qp, remote))
    }

    /// Destroys the server's side of a queue pair this session connected.
    pub async fn disconnect_qp(&self, server_qpn: u32) -> Result<(), ClientError> {
        self.rpc
            .clone()
            .disconnect_queue_pair(self.request(proto::DisconnectQueuePairRequest { server_qpn }))
            .await
            .map_err(rpc_error("DisconnectQueuePair"))?;
        Ok(())
    }

    /// A fresh region of `len` bytes (a multiple of 8) on the server that belongs to
    /// this session: no table or other client uses it, and the server frees it on
    /// [`Client::return_region`] or when the session ends, even if this process is
    /// killed (its lease runs out then).
    pub async fn borrow_region(&self, len: u64) -> Result<RemoteRegion, ClientError> {
        let reply = self
            .rpc
            .clone()
            .borrow_region(self.request(proto::BorrowRegionRequest { len }))
            .await
            .map_err(rpc_error("BorrowRegion"))?
            .into_inner();
        let r = reply.region.ok_or_else(|| {
            ClientError::Protocol("BorrowRegion answered without a region".into())
        })?;
        if r.node != self.server.node.0 || r.len != len {
            return Err(ClientError::Protocol(format!(
                "BorrowRegion answered {} bytes on node {} for {len} bytes on {}",
                r.len, r.node, self.server.node
            )));
        }
        Ok(RemoteRegion {
            node: NodeId(r.node),
            rkey: r.rkey,
            len: r.len,
        })
    }

    /// Frees a region [`Client::borrow_region`] gave this session. Any other region is
    /// refused and kept: one the session registered through remote verbs is
    /// `FAILED_PRECONDITION`, one it does not hold `NOT_FOUND`.
    pub async fn return_region(&self, region: &RemoteRegion) -> Result<(), ClientError> {
        self.rpc
            .clone()
            .return_region(self.request(proto::ReturnRegionRequest { rkey: region.rkey }))
            .await
            .map_err(rpc_error("ReturnRegion"))?;
        Ok(())
    }

    /// Renews the lease now (the background renewal does this on its own).
    /// Memory-side fencing: ends every session of compute-node `incarnation` at this
    /// server, destroying the queue pairs it posts through, and refuses the
    /// incarnation from then on. Idempotent.
    pub async fn fence(&self, incarnation: u64) -> Result<FenceReport, ClientError> {
        let r = self
            .rpc
            .clone()
            .fence(self.request(proto::FenceRequest { incarnation }))
            .await
            .map_err(rpc_error("Fence"))?
            .into_inner();
        Ok(FenceReport {
            sessions_ended: r.sessions_ended,
            queue_pairs_destroyed: r.queue_pairs_destroyed,
        })
    }

    pub async fn keep_alive(&self) -> Result<(), ClientError> {
        self.rpc
            .clone()
            .keep_alive(self.request(proto::KeepAliveRequest {}))
            .await
            .map_err(rpc_error("KeepAlive"))?;
        Ok(())
    }

    pub async fn stats(&self) -> Result<Stats, ClientError> {
        let s = self
            .rpc
            .clone()
            .stats(self.request(proto::StatsRequest {}))
            .await
            .map_err(rpc_error("Stats"))?
            .into_inner();
        Ok(Stats {
            bytes_allocated: s.bytes_allocated,
            bytes_registered: s.bytes_registered,
            regions: s.regions,
            huge_page_regions: s.huge_page_regions,
            sessions: s.sessions,
            queue_pairs: s.queue_pairs,
            uptime: Duration::from_millis(s.uptime_ms),
            rpc_counts: s.rpc_counts.into_iter().collect(),
            auth_failures: s.auth_failures,
            durable: self.server.durable,
            boot: self.server.boot,
            persist_requests: s.persist_requests,
            persist_ranges: s.persist_ranges,
            journaled_bytes: s.journaled_bytes,
            journal_fsyncs: s.journal_fsyncs,
            checkpoints: s.checkpoints,
            last_checkpoint: Duration::from_micros(s.last_checkpoint_us),
            session_region_bytes: s.session_region_bytes,
        })
    }

    /// Makes the current contents of `ranges` durable on a server started with a data
    /// directory: returns (the bytes journaled) once they are on its disk. After a
    /// restart the server holds, for every byte, the value of the last completed
    /// Persist that covered it. A Persist that failed or got no reply may or may not
    /// have taken effect.
    pub async fn persist(&self, ranges: &[PersistRange]) -> Result<u64, ClientError> {
        Ok(self
            .rpc
            .clone()
            .persist(self.request(persist_request(ranges)))
            .await
            .map_err(rpc_error("Persist"))?
            .into_inner()
            .journaled_bytes)
    }

    /// Promotes a backup server: it fences its primary and serves compute nodes from
    /// now on. Returns its new boot. Idempotent. (This client's [`Client::server`]
    /// still shows the Hello from before; connect again for the new one.)
    pub async fn promote(&self) -> Result<u64, ClientError> {
        Ok(self
            .rpc
            .clone()
            .promote(self.request(proto::PromoteRequest {}))
            .await
            .map_err(rpc_error("Promote"))?
            .into_inner()
            .boot)
    }

    /// Gives a promoted server a new backup at `backup_at` (a server started with
    /// `--backup`) while it serves: answers once attached; the backup reports `synced`
    /// in its Hello once it holds the whole state. Idempotent for the backup the server
    /// has.
    pub async fn attach_backup(&self, backup_at: &str) -> Result<(), ClientError> {
        self.rpc
            .clone()
            .attach_backup(self.request(proto::AttachBackupRequest {
                backup_at: backup_at.to_string(),
            }))
            .await
            .map_err(rpc_error("AttachBackup"))?;
        Ok(())
    }

    /// The stub and the session header, for RPCs sent from elsewhere (the
    /// [`crate::Persister`]).
    pub(crate) fn rpc_parts(&self) -> (MemoryServerClient<Channel>, AsciiMetadataValue) {
        (self.rpc.clone(), self.header.clone())
    }

    /// Ends the session: the server destroys its side of every queue pair connected
    /// through it.
    pub async fn close(mut self) -> Result<(), ClientError> {
        self.keepalive.abort();
        self.ended = true;
        self.rpc
            .clone()
            .end_session(self.request(proto::EndSessionRequest {}))
            .await
            .map_err(rpc_error("EndSession"))?;
        Ok(())
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        self.keepalive.abort();
        if self.ended {
            return;
        }
        // Best effort: end the session now if a runtime is at hand to send the RPC;
        // otherwise the lease ends it.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let mut rpc = self.rpc.clone();
            let req = self.request(proto::EndSessionRequest {});
            runtime.spawn(async move {
                let _ = rpc.end_session(req).await;
            });
        }
    }
}

/// Renews a session's lease three times per lease until the server says the session
/// is gone.
async fn renew(mut rpc: MemoryServerClient<Channel>, header: AsciiMetadataValue, lease: Duration) {
    let period = lease / 3;
    loop {
        tokio::time::sleep(period).await;
        let mut req = Request::new(proto::KeepAliveRequest {});
        req.metadata_mut().insert(SESSION_METADATA, header.clone());
        match rpc.keep_alive(req).await {
            Ok(_) => {}
            Err(status) if status.code() == Code::Unauthenticated => {
                tracing::warn!("memory server session lost: {}", status.message());
                return;
            }
            Err(status) => {
                tracing::warn!(
                    "renewing the memory server session failed: {}",
                    status.message()
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A call to a port nothing listens on fails with "tcp connect error"; the reason,
    /// the refused connection, is in the status's cause, and the error says it.
    #[tokio::test]
    async fn a_transport_failure_says_its_cause() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let channel = Channel::from_shared(format!("http://127.0.0.1:{port}"))
            .unwrap()
            .connect_lazy();
        let status = MemoryServerClient::new(channel)
            .hello(proto::HelloRequest::default())
            .await
            .unwrap_err();
        assert!(!status.message().contains("refused"), "{status:?}");
        let text = status_text(&status);
        assert!(text.starts_with(status.message()), "{text}");
        assert!(text.contains("refused"), "{text}");
        assert_eq!(
            text,
            format!(
                "tcp connect error: {}",
                std::io::Error::from_raw_os_error(111)
            ),
        );
        let error = rpc_error("Hello")(status).to_string();
        assert!(error.contains("refused"), "{error}");
        // A status with no cause is its message.
        assert_eq!(status_text(&Status::unavailable("gone")), "gone");
    }
}
