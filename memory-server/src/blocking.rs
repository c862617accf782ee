//! A synchronous [`Client`](crate::Client), for code on the fabric's synchronous side.
//!
//! It owns a small tokio runtime with one worker thread. One worker rather than a
//! current-thread runtime because the HTTP/2 connection and the lease renewal must make
//! progress while the caller is busy on the data path and makes no control calls: a
//! current-thread runtime only runs inside a call.

use crate::client::{self, ClientError, FenceReport, PersistRange, RemoteEndpointInfo, ServerInfo};
use crate::regions::RegionDirectory;
use crate::session::SessionId;
use crate::stats::Stats;
use crate::token::ClusterToken;
use fabric::{CompletionQueue, Device, QpConfig, QueuePair, RemoteRegion};
use std::sync::Arc;
use std::time::Duration;

/// A blocking session with one memory server. Not for use inside a tokio runtime
/// (use [`crate::Client`] there): its calls would block the runtime's thread.
pub struct Client {
    // None only while `close` or `drop` takes it apart.
    open: Option<Open>,
}

struct Open {
    inner: client::Client,
    runtime: tokio::runtime::Runtime,
}

impl Client {
    pub fn connect(addr: &str, token: &ClusterToken) -> Result<Client, ClientError> {
        Client::connect_bounded(addr, token, 0, None)
    }

    /// [`Client::connect`] for a session of compute-node `incarnation`, given up after
    /// `limit` if one is given (see [`crate::Client::connect_as`] and
    /// [`Client::connect_within`]).
    pub fn connect_as(
        addr: &str,
        token: &ClusterToken,
        incarnation: u64,
        limit: Option<Duration>,
    ) -> Result<Client, ClientError> {
        Client::connect_bounded(addr, token, incarnation, limit)
    }

    /// [`Client::connect`], given up after `limit` (connection, Hello and
    /// authentication together): a server stopped (SIGSTOP) or wedged keeps its TCP
    /// connection open and answers nothing, and only the HTTP/2 keep-alive would end
    /// the wait, after half a minute, or never if its handler hangs.
    pub fn connect_within(
        addr: &str,
        token: &ClusterToken,
        limit: Duration,
    ) -> Result<Client, ClientError> {
        Client::connect_bounded(addr, token, 0, Some(limit))
    }

    fn connect_bounded(
        addr: &str,
        token: &ClusterToken,
        incarnation: u64,
        limit: Option<Duration>,
    ) -> Result<Client, ClientError> {
        if tokio::runtime::Handle::try_current().is_ok() {
            return Err(ClientError::Runtime(
                "the blocking memory-server client cannot run inside a tokio runtime; use memory_server::Client"
                    .into(),
            ));
        }
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("namdb-memsrv-client")
            .enable_all()
            .build()
            .map_err(|e| ClientError::Runtime(format!("cannot start a tokio runtime: {e}")))?;
        let inner = runtime.block_on(async {
            match limit {
                None => client::Client::connect_as(addr, token, incarnation).await,
                Some(limit) => tokio::time::timeout(
                    limit,
                    client::Client::connect_as(addr, token, incarnation),
                )
                .await
                .map_err(|_| ClientError::TimedOut {
                    addr: addr.to_string(),
                    limit,
                })?,
            }
        });
        let inner = match inner {
            Ok(inner) => inner,
            Err(e) => {
                // Dropping a runtime whose task still waits on a stopped server would
                // block: leave it to finish in the background.
                runtime.shutdown_background();
                return Err(e);
            }
        };
        Ok(Client {
            open: Some(Open { inner, runtime }),
        })
    }

    fn open(&self) -> &Open {
        // Only `close` and `drop` take it, and both consume the client.
        self.open.as_ref().expect("the client is open until closed")
    }

    pub(crate) fn inner(&self) -> &client::Client {
        &self.open().inner
    }

    /// Runs `future` (an RPC of this client's) to completion on the client's runtime;
    /// refuses inside another runtime, whose thread it would block.
    pub(crate) fn block_on<F: std::future::Future>(
        &self,
        future: F,
    ) -> Result<F::Output, ClientError> {
        if tokio::runtime::Handle::try_current().is_ok() {
            return Err(ClientError::Runtime(
                "a blocking memory-server call cannot run inside a tokio runtime".into(),
            ));
        }
        Ok(self.open().runtime.block_on(future))
    }

    pub fn server(&self) -> &ServerInfo {
        self.open().inner.server()
    }

    pub fn session_id(&self) -> SessionId {
        self.open().inner.session_id()
    }

    pub fn lease(&self) -> Duration {
        self.open().inner.lease()
    }

    pub fn list_regions(&self) -> Result<RegionDirectory, ClientError> {
        let open = self.open();
        open.runtime.block_on(open.inner.list_regions())
    }

    pub fn connect_qp(
        &self,
        device: &dyn Device,
        cq: &Arc<dyn CompletionQueue>,
    ) -> Result<(Arc<dyn QueuePair>, RemoteEndpointInfo), ClientError> {
        let open = self.open();
        open.runtime.block_on(open.inner.connect_qp(device, cq))
    }

    pub fn connect_qp_with_config(
        &self,
        device: &dyn Device,
        config: &QpConfig,
    ) -> Result<(Arc<dyn QueuePair>, RemoteEndpointInfo), ClientError> {
        let open = self.open();
        open.runtime
            .block_on(open.inner.connect_qp_with_config(device, config))
    }

    pub fn disconnect_qp(&self, server_qpn: u32) -> Result<(), ClientError> {
        let open = self.open();
        open.runtime.block_on(open.inner.disconnect_qp(server_qpn))
    }

    /// See [`crate::Client::borrow_region`].
    pub fn borrow_region(&self, len: u64) -> Result<RemoteRegion, ClientError> {
        let open = self.open();
        open.runtime.block_on(open.inner.borrow_region(len))
    }

    /// See [`crate::Client::return_region`].
    pub fn return_region(&self, region: &RemoteRegion) -> Result<(), ClientError> {
        let open = self.open();
        open.runtime.block_on(open.inner.return_region(region))
    }

    /// See [`crate::Client::fence`]; given up after `limit` (a stopped server answers
    /// nothing).
    pub fn fence(&self, incarnation: u64, limit: Duration) -> Result<FenceReport, ClientError> {
        let addr = self.inner().addr().to_string();
        self.block_on(async {
            tokio::time::timeout(limit, self.inner().fence(incarnation))
                .await
                .map_err(|_| ClientError::TimedOut { addr, limit })?
        })?
    }

    pub fn keep_alive(&self) -> Result<(), ClientError> {
        let open = self.open();
        open.runtime.block_on(open.inner.keep_alive())
    }

    /// [`Client::keep_alive`], given up after `limit` ([`ClientError::TimedOut`]): a
    /// stopped server keeps its connection and answers nothing.
    pub fn keep_alive_within(&self, limit: Duration) -> Result<(), ClientError> {
        let addr = self.inner().addr().to_string();
        self.block_on(async {
            tokio::time::timeout(limit, self.inner().keep_alive())
                .await
                .map_err(|_| ClientError::TimedOut { addr, limit })?
        })?
    }

    pub fn stats(&self) -> Result<Stats, ClientError> {
        let open = self.open();
        open.runtime.block_on(open.inner.stats())
    }

    /// See [`crate::Client::persist`].
    pub fn persist(&self, ranges: &[PersistRange]) -> Result<u64, ClientError> {
        self.block_on(self.inner().persist(ranges))?
    }

    /// See [`crate::Client::promote`].
    pub fn promote(&self) -> Result<u64, ClientError> {
        self.block_on(self.inner().promote())?
    }

    /// See [`crate::Client::attach_backup`].
    pub fn attach_backup(&self, backup_at: &str) -> Result<(), ClientError> {
        self.block_on(self.inner().attach_backup(backup_at))?
    }

    /// The client's runtime, for work that must run on it without blocking the caller
    /// (the [`crate::Persister`]).
    pub(crate) fn runtime(&self) -> tokio::runtime::Handle {
        self.open().runtime.handle().clone()
    }

    /// Ends the session (see [`crate::Client::close`]).
    pub fn close(mut self) -> Result<(), ClientError> {
        match self.open.take() {
            Some(Open { inner, runtime }) => {
                let result = runtime.block_on(inner.close());
                runtime.shutdown_background();
                result
            }
            None => Ok(()),
        }
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        if let Some(Open { inner, runtime }) = self.open.take() {
            // Inside another runtime nothing may block: the lease then ends the session.
            if tokio::runtime::Handle::try_current().is_err() {
                let _ = runtime.block_on(inner.close());
            } else {
                drop(inner);
            }
            // Unlike dropping it, this never blocks (and never panics in async code).
            runtime.shutdown_background();
        }
    }
}
