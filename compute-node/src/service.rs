//! The gRPC service: each transaction RPC becomes a request for the worker its
//! transaction lives on ([`Pool`]); admin RPCs run on tokio's blocking threads, since
//! catalog operations wait on the fabric.

use crate::metrics::Metrics;
use crate::pool::STATS_WAIT;
use crate::pool::{Begun, Op, Reply};
use crate::proto::{self, compute_server::Compute};
use crate::reconnect::Node;
use crate::status::{Fate, status_of};
use futures::stream::BoxStream;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::oneshot;
use tonic::{Request, Response, Status};
use txn::{Database, Table, TableSpec};

/// The package this node serves, announced by Health.
pub const PROTOCOL: &str = "namdb.compute.v1";

pub struct ComputeService {
    /// The database and pool of the moment: replaced when a memory server went away
    /// (a transaction handle of the old pool is then unknown to the new one).
    node: Arc<Node>,
    started: Instant,
    metrics: Arc<Metrics>,
}

impl ComputeService {
    pub fn new(node: Arc<Node>, metrics: Arc<Metrics>) -> ComputeService {
        ComputeService {
            node,
            started: Instant::now(),
            metrics,
        }
    }

    /// Sends `op` (made with its reply channel) for transaction `handle` and waits for
    /// the answer.
    async fn txn<T>(&self, handle: u64, make: impl FnOnce(Reply<T>) -> Op) -> Result<T, Status> {
        let live = self.node.live()?;
        let (reply, rx) = oneshot::channel();
        live.pool.txn(handle, make(reply));
        let result = rx
            .await
            .map_err(|_| Status::unavailable("the worker stopped before answering"))
            .and_then(|r| r);
        if let Err(status) = &result {
            self.node.note(status);
        }
        result
    }

    /// Buffers a Put or an Insert.
    async fn write(
        &self,
        r: proto::WriteRequest,
        insert: bool,
    ) -> Result<Response<proto::WriteResponse>, Status> {
        self.txn(r.txn, |reply| Op::Write {
            table: r.table,
            key: r.key,
            value: Some(r.value),
            insert,
            reply,
        })
        .await?;
        Ok(Response::new(proto::WriteResponse {}))
    }

    /// Runs a catalog operation off the async threads.
    async fn admin<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Database) -> txn::Result<T> + Send + 'static,
    ) -> Result<T, Status> {
        let live = self.node.live()?;
        tokio::task::spawn_blocking(move || f(&live.cluster.db))
            .await
            .map_err(|e| Status::internal(format!("the catalog operation failed: {e}")))?
            .map_err(|e| status_of(&e, Fate::None))
    }
}

/// The caller's deadline (gRPC's `grpc-timeout` header: digits and a unit), if it
/// sent one that parses.
fn deadline(metadata: &tonic::metadata::MetadataMap) -> Option<Duration> {
    let value = metadata.get("grpc-timeout")?.to_str().ok()?;
    let (digits, unit) = value.split_at(value.len().checked_sub(1)?);
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n.saturating_mul(3600)),
        "M" => Duration::from_secs(n.saturating_mul(60)),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

fn table_info(t: &Table) -> proto::TableInfo {
    proto::TableInfo {
        id: t.id,
        name: t.name.clone(),
        value_cap: t.shape.value_cap,
        versions: t.shape.versions,
        capacity: t.capacity(),
        partitions: t.partitions.len() as u32,
    }
}

fn found(value: Option<Vec<u8>>) -> proto::GetResponse {
    proto::GetResponse {
        found: value.is_some(),
        value: value.unwrap_or_default(),
    }
}

#[tonic::async_trait]
impl Compute for ComputeService {
    async fn begin(
        &self,
        req: Request<proto::BeginRequest>,
    ) -> Result<Response<proto::BeginResponse>, Status> {
        self.metrics.rpc("Begin");
        let live = self.node.live()?;
        let begun = live.pool.begin(req.into_inner().after).await;
        if let Err(status) = &begun {
            self.node.note(status);
        }
        let Begun {
            handle,
            read_timestamp,
        } = begun?;
        Ok(Response::new(proto::BeginResponse {
            txn: handle,
            read_timestamp,
            idle_timeout_ms: self.node.idle_timeout().as_millis() as u64,
        }))
    }

    async fn get(
        &self,
        req: Request<proto::GetRequest>,
    ) -> Result<Response<proto::GetResponse>, Status> {
        self.metrics.rpc("Get");
        let r = req.into_inner();
        let value = self
            .txn(r.txn, |reply| Op::Get {
                table: r.table,
                key: r.key,
                reply,
            })
            .await?;
        Ok(Response::new(found(value)))
    }

    async fn batch_get(
        &self,
        req: Request<proto::BatchGetRequest>,
    ) -> Result<Response<proto::BatchGetResponse>, Status> {
        self.metrics.rpc("BatchGet");
        let r = req.into_inner();
        let values = self
            .txn(r.txn, |reply| Op::BatchGet {
                table: r.table,
                keys: r.keys,
                reply,
            })
            .await?;
        Ok(Response::new(proto::BatchGetResponse {
            values: values.into_iter().map(found).collect(),
        }))
    }

    async fn put(
        &self,
        req: Request<proto::WriteRequest>,
    ) -> Result<Response<proto::WriteResponse>, Status> {
        self.metrics.rpc("Put");
        self.write(req.into_inner(), false).await
    }

    async fn insert(
        &self,
        req: Request<proto::WriteRequest>,
    ) -> Result<Response<proto::WriteResponse>, Status> {
        self.metrics.rpc("Insert");
        self.write(req.into_inner(), true).await
    }

    async fn delete(
        &self,
        req: Request<proto::DeleteRequest>,
    ) -> Result<Response<proto::WriteResponse>, Status> {
        self.metrics.rpc("Delete");
        let r = req.into_inner();
        self.txn(r.txn, |reply| Op::Write {
            table: r.table,
            key: r.key,
            value: None,
            insert: false,
            reply,
        })
        .await?;
        Ok(Response::new(proto::WriteResponse {}))
    }

    type ScanStream = BoxStream<'static, Result<proto::ScanResponse, Status>>;

    async fn scan(
        &self,
        req: Request<proto::ScanRequest>,
    ) -> Result<Response<Self::ScanStream>, Status> {
        self.metrics.rpc("Scan");
        let r = req.into_inner();
        let rows = self
            .txn(r.txn, |reply| Op::Scan {
                table: r.table,
                start: r.start_key,
                end: r.end_key,
                limit: (r.limit != 0).then_some(r.limit as usize),
                reply,
            })
            .await?;
        // The worker reads the snapshot in one go (txn's scan); the rows then go out in
        // batches, in key order, without holding the worker, each within any client's
        // message limit.
        let batches: Vec<Result<proto::ScanResponse, Status>> = crate::limits::scan_batches(rows)
            .into_iter()
            .map(Ok)
            .collect();
        Ok(Response::new(Box::pin(futures::stream::iter(batches))))
    }

    async fn commit(
        &self,
        req: Request<proto::TxnRequest>,
    ) -> Result<Response<proto::CommitResponse>, Status> {
        self.metrics.rpc("Commit");
        let handle = req.into_inner().txn;
        let started = Instant::now();
        let cid = self.txn(handle, |reply| Op::Commit { reply }).await;
        self.metrics.commit_latency(started.elapsed());
        let cid = cid?;
        Ok(Response::new(proto::CommitResponse {
            commit_timestamp: cid.unwrap_or(0),
        }))
    }

    async fn abort(
        &self,
        req: Request<proto::TxnRequest>,
    ) -> Result<Response<proto::AbortResponse>, Status> {
        self.metrics.rpc("Abort");
        let handle = req.into_inner().txn;
        self.txn(handle, |reply| Op::Abort { reply }).await?;
        Ok(Response::new(proto::AbortResponse {}))
    }

    async fn create_table(
        &self,
        req: Request<proto::CreateTableRequest>,
    ) -> Result<Response<proto::TableInfo>, Status> {
        self.metrics.rpc("CreateTable");
        let r = req.into_inner();
        // An unset field reads as 0, and a table of empty values cannot be dropped or
        // changed: every later put would fail against a cap fixed for the table's life.
        if r.value_cap == 0 {
            return Err(Status::invalid_argument(
                "value_cap is 0 (unset?): a table's largest value in bytes, fixed for its \
                 life, is at least 1",
            ));
        }
        let mut spec = TableSpec::new(&r.name, r.value_cap, r.capacity);
        if r.versions != 0 {
            spec.versions = r.versions;
        }
        spec.partitions = r.partitions;
        let table = self.admin(move |db| db.create_table(spec)).await?;
        Ok(Response::new(table_info(&table)))
    }

    async fn list_tables(
        &self,
        _req: Request<proto::ListTablesRequest>,
    ) -> Result<Response<proto::ListTablesResponse>, Status> {
        self.metrics.rpc("ListTables");
        let tables = self.admin(|db| db.tables()).await?;
        Ok(Response::new(proto::ListTablesResponse {
            tables: tables.iter().map(|t| table_info(t)).collect(),
        }))
    }

    async fn stats(
        &self,
        _req: Request<proto::StatsRequest>,
    ) -> Result<Response<proto::StatsResponse>, Status> {
        self.metrics.rpc("Stats");
        // While reconnecting there are no workers to ask; the counters then read 0.
        let s = match self.node.live() {
            Ok(live) => self.node.worker_stats(&live).await?,
            Err(_) => Default::default(),
        };
        Ok(Response::new(proto::StatsResponse {
            workers: self.node.workers() as u32,
            memory_servers: self.node.servers() as u32,
            uptime_ms: self.started.elapsed().as_millis() as u64,
            open_transactions: s.open,
            begun: s.begun,
            committed: s.txn.committed,
            aborted: s.txn.aborted + s.aborted_open + s.expired,
            conflicts: s.txn.conflicts,
            duplicate_keys: s.txn.duplicate_keys,
            too_old: s.txn.too_old,
            expired: s.expired,
            reconnects: self.node.reconnects(),
            last_reconnect_ms: self.node.last_reconnect().as_millis() as u64,
        }))
    }

    async fn health(
        &self,
        req: Request<proto::HealthRequest>,
    ) -> Result<Response<proto::HealthResponse>, Status> {
        self.metrics.rpc("Health");
        use proto::health_response::Status as Health;
        // Serving when every worker answers in time (`Node::worker_stats`), which
        // bounds the wait: a worker stuck in a one-sided operation to a stopped memory
        // server would hold the answer (and a client's wait) for up to 30 s.
        // A caller that wants the answer sooner (grpc-timeout) gets it while it waits:
        // half its time for the workers leaves the rest for the way back.
        let within = deadline(req.metadata()).map_or(STATS_WAIT, |d| STATS_WAIT.min(d / 2));
        let answered = match self.node.live() {
            Ok(live) => self.node.worker_stats_within(&live, within).await,
            Err(status) => Err(status),
        };
        let (status, reason) = match answered {
            Ok(_) => (Health::Serving, String::new()),
            Err(status) => (Health::NotServing, status.message().to_string()),
        };
        Ok(Response::new(proto::HealthResponse {
            status: status as i32,
            reason,
            protocol: PROTOCOL.into(),
            version: env!("CARGO_PKG_VERSION").into(),
            backend: self.node.backend().to_string(),
            workers: self.node.workers() as u32,
            memory_servers: self.node.servers() as u32,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_callers_deadline_is_read_from_grpc_timeout() {
        let mut m = tonic::metadata::MetadataMap::new();
        assert_eq!(deadline(&m), None);
        for (value, expected) in [
            ("500m", Some(Duration::from_millis(500))),
            ("3S", Some(Duration::from_secs(3))),
            ("2M", Some(Duration::from_secs(120))),
            ("1H", Some(Duration::from_secs(3600))),
            ("250000u", Some(Duration::from_millis(250))),
            ("7n", Some(Duration::from_nanos(7))),
            ("5x", None),
            ("m", None),
        ] {
            m.insert("grpc-timeout", value.parse().unwrap());
            assert_eq!(deadline(&m), expected, "{value}");
        }
    }
}
