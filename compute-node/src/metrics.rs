//! What the compute node counts for its Prometheus endpoint: RPCs by method and a
//! histogram of commit latency, kept by the service; the transaction counters come
//! from the workers ([`WorkerStats`]) when the endpoint is read.

use crate::pool::WorkerStats;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// The API's methods, in the order the counters keep them.
pub const METHODS: [&str; 13] = [
    "Begin",
    "Get",
    "BatchGet",
    "Put",
    "Insert",
    "Delete",
    "Scan",
    "Commit",
    "Abort",
    "CreateTable",
    "ListTables",
    "Stats",
    "Health",
];

/// Upper bounds (seconds) of the commit-latency buckets; `+Inf` comes on top.
const LATENCY_BOUNDS: [f64; 12] = [
    0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 1.0,
];

/// Counters the service updates on every call.
#[derive(Default)]
pub struct Metrics {
    rpcs: [AtomicU64; METHODS.len()],
    /// Per bucket (not cumulative); the last is `+Inf`.
    commit_buckets: [AtomicU64; LATENCY_BOUNDS.len() + 1],
    commit_count: AtomicU64,
    commit_nanos: AtomicU64,
}

impl Metrics {
    /// Counts a call of `method` (one of [`METHODS`]).
    pub fn rpc(&self, method: &str) {
        if let Some(i) = METHODS.iter().position(|m| *m == method) {
            self.rpcs[i].fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Records how long a Commit call took (successful or not).
    pub fn commit_latency(&self, took: Duration) {
        let secs = took.as_secs_f64();
        let bucket = LATENCY_BOUNDS
            .iter()
            .position(|&b| secs <= b)
            .unwrap_or(LATENCY_BOUNDS.len());
        self.commit_buckets[bucket].fetch_add(1, Ordering::Relaxed);
        self.commit_count.fetch_add(1, Ordering::Relaxed);
        self.commit_nanos
            .fetch_add(took.as_nanos() as u64, Ordering::Relaxed);
    }

    /// The Prometheus text exposition (format 0.0.4) of these counters, `stats` and the
    /// reconnections of `reconnects` (count, and how long the last took).
    pub fn render(&self, stats: &WorkerStats, reconnects: (u64, Duration)) -> String {
        let mut out = String::new();
        let counter = |out: &mut String, name: &str, help: &str, value: u64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {value}"
            );
        };
        counter(
            &mut out,
            "namdb_transactions_begun_total",
            "Transactions begun.",
            stats.begun,
        );
        counter(
            &mut out,
            "namdb_commits_total",
            "Transactions committed.",
            stats.txn.committed,
        );
        counter(
            &mut out,
            "namdb_reconnects_total",
            "Reconnections to the memory servers after one went away.",
            reconnects.0,
        );
        let _ = writeln!(
            out,
            "# HELP namdb_last_reconnect_seconds How long the last reconnection took.\n\
             # TYPE namdb_last_reconnect_seconds gauge\nnamdb_last_reconnect_seconds {}",
            reconnects.1.as_secs_f64()
        );
        let _ = writeln!(
            out,
            "# HELP namdb_open_transactions Transactions open now.\n\
             # TYPE namdb_open_transactions gauge\nnamdb_open_transactions {}",
            stats.open
        );
        let _ = writeln!(
            out,
            "# HELP namdb_aborts_total Transactions aborted, by reason.\n\
             # TYPE namdb_aborts_total counter"
        );
        let other = stats
            .txn
            .aborted
            .saturating_sub(stats.txn.conflicts + stats.txn.duplicate_keys + stats.txn.too_old);
        for (reason, n) in [
            ("conflict", stats.txn.conflicts),
            ("duplicate_key", stats.txn.duplicate_keys),
            ("too_old", stats.txn.too_old),
            ("other", other),
            ("client", stats.aborted_open),
            ("expired", stats.expired),
        ] {
            let _ = writeln!(out, "namdb_aborts_total{{reason=\"{reason}\"}} {n}");
        }
        let _ = writeln!(
            out,
            "# HELP namdb_worker_replacements_total Workers replaced after a commit they \
             could not finish (left to recovery).\n\
             # TYPE namdb_worker_replacements_total counter\n\
             namdb_worker_replacements_total {}",
            stats.replaced_workers
        );
        let _ = writeln!(
            out,
            "# HELP namdb_rpcs_total API calls, by method.\n# TYPE namdb_rpcs_total counter"
        );
        for (method, n) in METHODS.iter().zip(&self.rpcs) {
            let _ = writeln!(
                out,
                "namdb_rpcs_total{{method=\"{method}\"}} {}",
                n.load(Ordering::Relaxed)
            );
        }
        let _ = writeln!(
            out,
            "# HELP namdb_commit_latency_seconds Time a Commit call took.\n\
             # TYPE namdb_commit_latency_seconds histogram"
        );
        let mut cumulative = 0;
        for (i, bucket) in self.commit_buckets.iter().enumerate() {
            cumulative += bucket.load(Ordering::Relaxed);
            let le = LATENCY_BOUNDS
                .get(i)
                .map_or("+Inf".to_string(), |b| b.to_string());
            let _ = writeln!(
                out,
                "namdb_commit_latency_seconds_bucket{{le=\"{le}\"}} {cumulative}"
            );
        }
        let nanos = self.commit_nanos.load(Ordering::Relaxed);
        let _ = writeln!(
            out,
            "namdb_commit_latency_seconds_sum {}\nnamdb_commit_latency_seconds_count {}",
            nanos as f64 / 1e9,
            self.commit_count.load(Ordering::Relaxed)
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_and_a_cumulative_histogram() {
        let m = Metrics::default();
        m.rpc("Commit");
        m.rpc("Commit");
        m.rpc("NoSuch");
        m.commit_latency(Duration::from_micros(30));
        m.commit_latency(Duration::from_millis(3));
        m.commit_latency(Duration::from_secs(5));
        let mut stats = WorkerStats::default();
        stats.txn.committed = 3;
        stats.txn.aborted = 2;
        stats.txn.conflicts = 1;
        let text = m.render(&stats, (1, Duration::from_millis(1500)));
        for line in [
            "namdb_commits_total 3",
            "namdb_reconnects_total 1",
            "namdb_last_reconnect_seconds 1.5",
            "namdb_rpcs_total{method=\"Commit\"} 2",
            "namdb_rpcs_total{method=\"Get\"} 0",
            "namdb_aborts_total{reason=\"conflict\"} 1",
            "namdb_aborts_total{reason=\"other\"} 1",
            "namdb_commit_latency_seconds_bucket{le=\"0.00005\"} 1",
            "namdb_commit_latency_seconds_bucket{le=\"0.005\"} 2",
            "namdb_commit_latency_seconds_bucket{le=\"1\"} 2",
            "namdb_commit_latency_seconds_bucket{le=\"+Inf\"} 3",
            "namdb_commit_latency_seconds_count 3",
        ] {
            assert!(text.lines().any(|l| l == line), "no {line:?} in\n{text}");
        }
    }
}
