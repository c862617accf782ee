//! The compute node's lifecycle: serve the API on a worker pool until told to stop,
//! then stop taking calls, let the running ones finish, and abort what is open.

use crate::auth::Authenticate;
use crate::limits::{ExplainCodec, MAX_MESSAGE_BYTES};
use crate::metrics::Metrics;
use crate::proto::compute_server::ComputeServer;
use crate::reconnect::Node;
use crate::service::ComputeService;
use memory_server::ClusterToken;
use memory_server::unknown_method::{Catalog, KnownMethods};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use thiserror::Error;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tonic::service::Routes;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::server::TcpIncoming;

/// How long shutdown waits for in-flight RPCs before closing connections anyway.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

#[derive(Debug, Error)]
pub enum ServeError {
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("the API server failed: {0}")]
    Serve(#[from] tonic::transport::Error),
    #[error("the API server stopped unexpectedly{0}")]
    Stopped(String),
    #[error(transparent)]
    Signal(#[from] memory_server::ServerError),
}

/// A running API server.
pub struct Server {
    local_addr: SocketAddr,
    shutdown: Option<oneshot::Sender<()>>,
    serve: JoinHandle<Result<(), tonic::transport::Error>>,
    metrics: Arc<Metrics>,
}

impl Server {
    /// Serves the API on `listen`, running transactions on `node`'s database and pool
    /// of the moment; callers must hold `token`. Must run in a tokio runtime.
    pub async fn start(
        listen: SocketAddr,
        token: ClusterToken,
        node: Arc<Node>,
    ) -> Result<Server, ServeError> {
        let listener = tokio::net::TcpListener::bind(listen)
            .await
            .map_err(|source| ServeError::Listen {
                addr: listen,
                source,
            })?;
        let local_addr = listener.local_addr().map_err(|source| ServeError::Listen {
            addr: listen,
            source,
        })?;
        // Keepalive lets the kernel notice a vanished client host; its transactions
        // then expire on the idle timeout.
        let incoming = TcpIncoming::from(listener)
            .with_nodelay(Some(true))
            .with_keepalive(Some(Duration::from_secs(60)));
        let metrics = Arc::new(Metrics::default());
        let catalog = Arc::new(Catalog::new(
            crate::proto::FILE_DESCRIPTOR_SET,
            "compute-node/proto",
            &[crate::proto::compute_server::SERVICE_NAME],
        ));
        // Inside the authentication: only a caller holding the token learns more than
        // that it lacks it.
        let service = InterceptedService::new(
            KnownMethods::new(
                ExplainCodec(
                    ComputeServer::new(ComputeService::new(node, metrics.clone()))
                        .max_decoding_message_size(MAX_MESSAGE_BYTES)
                        .max_encoding_message_size(MAX_MESSAGE_BYTES),
                ),
                catalog.clone(),
            ),
            Authenticate::new(token),
        );
        let (tx, rx) = oneshot::channel::<()>();
        let serve = tokio::spawn(
            tonic::transport::Server::builder()
                .add_routes(catalog.fallback(Routes::new(service)))
                .serve_with_incoming_shutdown(incoming, async {
                    // A dropped sender (the server was dropped) also means stop.
                    let _ = rx.await;
                }),
        );
        tracing::info!(%local_addr, "compute node API started");
        Ok(Server {
            local_addr,
            shutdown: Some(tx),
            serve,
            metrics,
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The counters the service keeps, for a metrics endpoint.
    pub fn metrics(&self) -> Arc<Metrics> {
        self.metrics.clone()
    }

    /// Stops serving: refuses new connections, and gives in-flight calls
    /// [`SHUTDOWN_GRACE`] to finish.
    pub async fn shutdown(mut self) -> Result<(), ServeError> {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        match tokio::time::timeout(SHUTDOWN_GRACE, &mut self.serve).await {
            Ok(Ok(result)) => Ok(result?),
            Ok(Err(e)) => Err(ServeError::Stopped(format!(": {e}"))),
            Err(_) => {
                tracing::warn!("in-flight calls did not finish in {SHUTDOWN_GRACE:?}; closing");
                self.serve.abort();
                Ok(())
            }
        }
    }

    /// Serves until SIGTERM or SIGINT (Ctrl-C), then shuts down.
    pub async fn run_until_signal(self) -> Result<(), ServeError> {
        let signal = memory_server::listen_for_signals()?;
        self.run_until(signal).await
    }

    /// Serves until `signal` (from [`memory_server::listen_for_signals`], made before
    /// the node says it is listening) completes, then shuts down.
    pub async fn run_until(
        mut self,
        signal: impl Future<Output = Result<&'static str, memory_server::ServerError>>,
    ) -> Result<(), ServeError> {
        tokio::select! {
            signal = signal => {
                tracing::info!("{} received; shutting down", signal?);
                self.shutdown().await
            }
            finished = &mut self.serve => match finished {
                Ok(Ok(())) => Err(ServeError::Stopped(String::new())),
                Ok(Err(e)) => Err(ServeError::Serve(e)),
                Err(e) => Err(ServeError::Stopped(format!(": {e}"))),
            },
        }
    }
}
