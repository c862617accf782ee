//! `--metrics-listen`: a Prometheus text endpoint (plain HTTP, `GET /metrics`) served
//! by a small responder on the process's tokio runtime. Each scrape renders afresh.

use anyhow::{Context, Result};
use futures::future::BoxFuture;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Renders the exposition text at each scrape.
pub type Render = Arc<dyn Fn() -> BoxFuture<'static, String> + Send + Sync>;

/// The largest request head read; a scrape's is a few hundred bytes.
const MAX_REQUEST: usize = 8192;
/// How long a client may take to send its request.
const READ_TIMEOUT: Duration = Duration::from_secs(5);

/// Binds `listen`, prints `metrics listening on ADDR` (before the server's own
/// listening line, which `namdb cluster up` waits for) and serves in the background.
/// Must run in a tokio runtime.
pub async fn serve(listen: SocketAddr, render: Render) -> Result<SocketAddr> {
    let listener = TcpListener::bind(listen)
        .await
        .with_context(|| format!("cannot listen for metrics on {listen}"))?;
    let addr = listener.local_addr()?;
    println!("metrics listening on {addr}");
    tokio::spawn(async move {
        loop {
            match listener.accept().await {
                Ok((stream, _)) => {
                    tokio::spawn(answer(stream, render.clone()));
                }
                Err(e) => {
                    tracing::warn!(error = %e, "metrics endpoint: accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    });
    Ok(addr)
}

/// Reads one request head and answers it; the connection closes after.
async fn answer(mut stream: TcpStream, render: Render) {
    let mut head = Vec::new();
    let read = tokio::time::timeout(READ_TIMEOUT, async {
        let mut buf = [0u8; 1024];
        while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < MAX_REQUEST {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return false,
                Ok(n) => head.extend_from_slice(&buf[..n]),
            }
        }
        true
    })
    .await;
    if !matches!(read, Ok(true)) {
        return;
    }
    let line = String::from_utf8_lossy(&head);
    let mut words = line.split_whitespace();
    let (status, body) = match (words.next(), words.next()) {
        (Some("GET"), Some("/metrics")) => ("200 OK", render().await),
        (Some("GET"), _) => ("404 Not Found", "not found: try /metrics\n".to_string()),
        _ => (
            "405 Method Not Allowed",
            "only GET /metrics is served\n".to_string(),
        ),
    };
    let response = format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = stream.write_all(response.as_bytes()).await;
    let _ = stream.shutdown().await;
}

/// The memory server's exposition: sessions, queue pairs, regions and their bytes,
/// RPCs by method.
pub fn memory_server_text(s: &memory_server::Stats) -> String {
    let mut out = String::new();
    for (name, kind, help, value) in [
        (
            "namdb_memory_sessions",
            "gauge",
            "Open sessions.",
            u64::from(s.sessions),
        ),
        (
            "namdb_memory_queue_pairs",
            "gauge",
            "Queue pairs.",
            u64::from(s.queue_pairs),
        ),
        (
            "namdb_memory_regions",
            "gauge",
            "Data regions.",
            u64::from(s.regions),
        ),
        (
            "namdb_memory_regions_bytes",
            "gauge",
            "Bytes registered with the device.",
            s.bytes_registered,
        ),
        (
            "namdb_memory_allocated_bytes",
            "gauge",
            "Bytes of memory backing the regions.",
            s.bytes_allocated,
        ),
        (
            "namdb_memory_session_region_bytes",
            "gauge",
            "Bytes of the regions sessions hold (borrowed, remote verbs).",
            s.session_region_bytes,
        ),
        (
            "namdb_memory_auth_failures_total",
            "counter",
            "Refused Authenticate calls.",
            s.auth_failures,
        ),
        (
            "namdb_memory_boot",
            "gauge",
            "Starts on the data directory (0: not durable).",
            s.boot,
        ),
        (
            "namdb_memory_persist_requests_total",
            "counter",
            "Persist requests accepted.",
            s.persist_requests,
        ),
        (
            "namdb_memory_journaled_bytes_total",
            "counter",
            "Bytes Persist wrote to the journal.",
            s.journaled_bytes,
        ),
        (
            "namdb_memory_journal_fsyncs_total",
            "counter",
            "Journal fdatasyncs (one per group commit).",
            s.journal_fsyncs,
        ),
        (
            "namdb_memory_checkpoints_total",
            "counter",
            "Checkpoints (journal applied to the base files).",
            s.checkpoints,
        ),
    ] {
        let _ = writeln!(
            out,
            "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}"
        );
    }
    let _ = writeln!(
        out,
        "# HELP namdb_memory_rpcs_total Control-plane calls, by method.\n\
         # TYPE namdb_memory_rpcs_total counter"
    );
    for (method, n) in &s.rpc_counts {
        let _ = writeln!(out, "namdb_memory_rpcs_total{{method=\"{method}\"}} {n}");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn get(addr: SocketAddr, request: &str) -> String {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(request.as_bytes()).await.unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        out
    }

    #[tokio::test]
    async fn serves_get_metrics_and_refuses_the_rest() {
        let render: Render = Arc::new(|| Box::pin(async { "x_total 1\n".to_string() }));
        let addr = serve("127.0.0.1:0".parse().unwrap(), render).await.unwrap();
        let ok = get(addr, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").await;
        assert!(ok.starts_with("HTTP/1.1 200 OK"), "{ok}");
        assert!(ok.ends_with("\r\n\r\nx_total 1\n"), "{ok}");
        let missing = get(addr, "GET / HTTP/1.1\r\n\r\n").await;
        assert!(missing.starts_with("HTTP/1.1 404"), "{missing}");
        let post = get(addr, "POST /metrics HTTP/1.1\r\n\r\n").await;
        assert!(post.starts_with("HTTP/1.1 405"), "{post}");
    }

    #[test]
    fn memory_server_text_has_the_gauges() {
        let stats = memory_server::Stats {
            sessions: 2,
            bytes_registered: 4096,
            ..Default::default()
        };
        let text = memory_server_text(&stats);
        assert!(text.contains("\nnamdb_memory_sessions 2\n"), "{text}");
        assert!(
            text.contains("\nnamdb_memory_regions_bytes 4096\n"),
            "{text}"
        );
    }
}
