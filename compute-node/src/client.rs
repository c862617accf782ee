//! A Rust client of the compute node's API: the generated stub with the bearer added
//! to every call, and a session that sees its own writes (each Begin asks for a
//! snapshot that includes the session's last commit).

use crate::auth::{AddBearer, bearer};
use crate::proto::{self, compute_client::ComputeClient};
use futures::StreamExt;
use memory_server::ClusterToken;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};
use tonic::{Status, Streaming};

const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a call may wait for the compute node's answer (a streamed scan's first
/// batch; the stream itself is not bounded).
pub const CALL_TIMEOUT: Duration = Duration::from_secs(60);

/// The generated stub, authenticated.
pub type Rpc = ComputeClient<InterceptedService<Channel, AddBearer>>;

/// A session with a compute node. Cheap to clone; clones share the session's last
/// commit timestamp.
#[derive(Clone)]
pub struct Client {
    rpc: Rpc,
    last_commit: std::sync::Arc<AtomicU64>,
}

/// An open transaction's handle.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Txn {
    pub handle: u64,
    pub read_timestamp: u64,
}

impl Client {
    /// Connects to the compute node at `addr` (`host:port` or an `http://` URI) as a
    /// holder of `token`. Must be called within a tokio runtime.
    pub async fn connect(
        addr: &str,
        token: &ClusterToken,
    ) -> Result<Client, tonic::transport::Error> {
        let uri = if addr.contains("://") {
            addr.to_string()
        } else {
            format!("http://{addr}")
        };
        let channel = Endpoint::from_shared(uri)?
            .connect_timeout(CONNECT_TIMEOUT)
            // A peer that accepts connections and never answers must not hang a call
            // for ever; the node's own work gives up well within this.
            .timeout(CALL_TIMEOUT)
            .tcp_nodelay(true)
            .connect()
            .await?;
        Ok(Client {
            // The node's answers fit this (crate::limits); said here so the two cannot
            // drift apart. Requests are not limited here: one too large gets the
            // node's answer, which says what to do.
            rpc: ComputeClient::with_interceptor(channel, AddBearer(bearer(token)))
                .max_decoding_message_size(crate::limits::MAX_MESSAGE_BYTES),
            last_commit: Default::default(),
        })
    }

    /// The generated stub, for calls this wrapper does not offer.
    pub fn rpc(&self) -> Rpc {
        self.rpc.clone()
    }

    /// Starts a transaction that sees this session's commits.
    pub async fn begin(&self) -> Result<Txn, Status> {
        let after = self.last_commit.load(Ordering::Relaxed);
        let r = self
            .rpc()
            .begin(proto::BeginRequest { after })
            .await?
            .into_inner();
        Ok(Txn {
            handle: r.txn,
            read_timestamp: r.read_timestamp,
        })
    }

    pub async fn get(&self, t: Txn, table: &str, key: u64) -> Result<Option<Vec<u8>>, Status> {
        let r = self
            .rpc()
            .get(proto::GetRequest {
                txn: t.handle,
                table: table.into(),
                key,
            })
            .await?
            .into_inner();
        Ok(r.found.then_some(r.value))
    }

    pub async fn batch_get(
        &self,
        t: Txn,
        table: &str,
        keys: &[u64],
    ) -> Result<Vec<Option<Vec<u8>>>, Status> {
        let r = self
            .rpc()
            .batch_get(proto::BatchGetRequest {
                txn: t.handle,
                table: table.into(),
                keys: keys.to_vec(),
            })
            .await?
            .into_inner();
        Ok(r.values
            .into_iter()
            .map(|v| v.found.then_some(v.value))
            .collect())
    }

    fn write(t: Txn, table: &str, key: u64, value: Vec<u8>) -> proto::WriteRequest {
        proto::WriteRequest {
            txn: t.handle,
            table: table.into(),
            key,
            value,
        }
    }

    pub async fn put(&self, t: Txn, table: &str, key: u64, value: Vec<u8>) -> Result<(), Status> {
        self.rpc().put(Self::write(t, table, key, value)).await?;
        Ok(())
    }

    pub async fn insert(
        &self,
        t: Txn,
        table: &str,
        key: u64,
        value: Vec<u8>,
    ) -> Result<(), Status> {
        self.rpc().insert(Self::write(t, table, key, value)).await?;
        Ok(())
    }

    pub async fn delete(&self, t: Txn, table: &str, key: u64) -> Result<(), Status> {
        self.rpc()
            .delete(proto::DeleteRequest {
                txn: t.handle,
                table: table.into(),
                key,
            })
            .await?;
        Ok(())
    }

    /// The rows of `table` with keys in `range` (`end` exclusive, `None` unbounded), at
    /// most `limit` (0: all), as a stream of batches in key order.
    pub async fn scan_stream(
        &self,
        t: Txn,
        table: &str,
        start: u64,
        end: Option<u64>,
        limit: u64,
    ) -> Result<Streaming<proto::ScanResponse>, Status> {
        Ok(self
            .rpc()
            .scan(proto::ScanRequest {
                txn: t.handle,
                table: table.into(),
                start_key: start,
                end_key: end,
                limit,
            })
            .await?
            .into_inner())
    }

    /// Every row of `table` visible to `t`, in key order.
    pub async fn scan(&self, t: Txn, table: &str) -> Result<Vec<(u64, Vec<u8>)>, Status> {
        let mut stream = self.scan_stream(t, table, 0, None, 0).await?;
        let mut rows = Vec::new();
        while let Some(batch) = stream.next().await {
            rows.extend(batch?.rows.into_iter().map(|r| (r.key, r.value)));
        }
        Ok(rows)
    }

    /// Commits; returns the commit timestamp (`None` for a read-only transaction).
    pub async fn commit(&self, t: Txn) -> Result<Option<u64>, Status> {
        let r = self
            .rpc()
            .commit(proto::TxnRequest { txn: t.handle })
            .await?
            .into_inner();
        let cid = (r.commit_timestamp != 0).then_some(r.commit_timestamp);
        if let Some(cid) = cid {
            self.last_commit.fetch_max(cid, Ordering::Relaxed);
        }
        Ok(cid)
    }

    pub async fn abort(&self, t: Txn) -> Result<(), Status> {
        self.rpc()
            .abort(proto::TxnRequest { txn: t.handle })
            .await?;
        Ok(())
    }

    /// Creates a table of `capacity` records of up to `value_cap` bytes (4 versions,
    /// one partition per memory server).
    pub async fn create_table(
        &self,
        name: &str,
        value_cap: u32,
        capacity: u64,
    ) -> Result<proto::TableInfo, Status> {
        Ok(self
            .rpc()
            .create_table(proto::CreateTableRequest {
                name: name.into(),
                value_cap,
                capacity,
                versions: 0,
                partitions: 0,
            })
            .await?
            .into_inner())
    }

    pub async fn list_tables(&self) -> Result<Vec<proto::TableInfo>, Status> {
        Ok(self
            .rpc()
            .list_tables(proto::ListTablesRequest {})
            .await?
            .into_inner()
            .tables)
    }

    pub async fn stats(&self) -> Result<proto::StatsResponse, Status> {
        Ok(self.rpc().stats(proto::StatsRequest {}).await?.into_inner())
    }

    pub async fn health(&self) -> Result<proto::HealthResponse, Status> {
        Ok(self
            .rpc()
            .health(proto::HealthRequest {})
            .await?
            .into_inner())
    }

    /// As [`Client::health`], telling the node (gRPC's `grpc-timeout`) that the answer
    /// is wanted within `wait`: a node whose workers do not answer then says so in
    /// time, rather than past the caller's patience.
    pub async fn health_within(
        &self,
        wait: std::time::Duration,
    ) -> Result<proto::HealthResponse, Status> {
        let mut request = tonic::Request::new(proto::HealthRequest {});
        request.set_timeout(wait);
        Ok(self.rpc().health(request).await?.into_inner())
    }
}
