//! The report of a chaos run: what was done to the nodes, how fast the cluster
//! recovered, how throughput dipped, and each check's verdict.

use super::checks::CheckResult;
use super::events::{Recovery, Repair};
use super::plan::FaultPlan;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;

/// How a run was set up.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChaosConfig {
    pub duration_s: f64,
    pub nodes: usize,
    pub sessions_per_node: usize,
    pub servers: usize,
    pub backend: String,
    pub seed: u64,
    pub workloads: Vec<String>,
    pub lease_ms: u64,
}

/// An action as the harness ran it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Executed {
    /// When it ran, from the moment every node was first ready.
    pub at_ms: u64,
    /// When the plan had it due.
    pub planned_ms: u64,
    pub action: String,
    pub node: usize,
    /// What happened, e.g. `killed incarnation 4`, `crash point fired`.
    pub outcome: String,
}

/// Actions that took effect.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ActionCounts {
    /// SIGKILLs delivered to a live node (including armed nodes whose point never
    /// fired).
    pub kills: u64,
    /// Nodes started with a crash point armed.
    pub crashes_armed: u64,
    /// Armed nodes that died at their point.
    pub crashes_fired: u64,
    pub restarts: u64,
    pub pauses: u64,
    /// Pauses past the lease (stalls).
    #[serde(default)]
    pub stalls: u64,
    /// Stalled nodes that found themselves fenced once resumed, exited and were
    /// started again.
    #[serde(default)]
    pub stalls_fenced: u64,
    /// Nodes that found themselves fenced (after a stall or not), exited and were
    /// started again.
    #[serde(default)]
    pub fenced: u64,
    /// SIGKILLs of memory servers.
    #[serde(default)]
    pub server_kills: u64,
    /// Memory servers started again on their data directory.
    #[serde(default)]
    pub server_restarts: u64,
    /// Primaries of replicated memory servers SIGKILLed for good (their backups took
    /// over).
    #[serde(default)]
    pub server_failovers: u64,
    /// Failovers carried out by stopping the primary (SIGSTOP) rather than killing it
    /// (`namdb chaos --stop-failed-primaries`).
    #[serde(default)]
    pub stopped_primaries: u64,
    /// Of those, the ones whose backup the nodes promoted while the primary was
    /// stopped.
    #[serde(default)]
    pub stopped_primaries_failed_over: u64,
    /// SIGKILLs of backups of replicated memory servers.
    #[serde(default)]
    pub backup_kills: u64,
    /// Backups started again (their primary attached to them again).
    #[serde(default)]
    pub backup_restarts: u64,
    /// Failed-over primaries started again as their promoted backup's backup
    /// (`namdb chaos --rejoin-failed-primaries`).
    #[serde(default)]
    pub primary_rejoins: u64,
    /// Of those, the ones the old primary made by itself: stopped, resumed once its
    /// backup was promoted, and rejoined in the same process (`namdb memory-server
    /// --rejoin-when-fenced`, given with `--stop-failed-primaries
    /// --rejoin-failed-primaries`).
    #[serde(default)]
    pub primaries_rejoined_by_themselves: u64,
    /// Compute nodes that lost a memory server and were started again once it was
    /// back.
    #[serde(default)]
    pub reconnects: u64,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PointCounts {
    pub armed: u64,
    pub fired: u64,
}

/// A node incarnation that died: killed, or at its crash point; or a memory server
/// killed (cause `server-kill`, `node` the server's number, `incarnation` its boot).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Death {
    pub node: usize,
    pub incarnation: u64,
    /// `kill`, `crash:POINT`, `fenced` (a node stopped past its lease; `at_ms` is
    /// when it was stopped) or `server-kill`.
    pub cause: String,
    pub at_ms: f64,
    /// Recoveries that started after this death and before the next.
    pub recoveries: u64,
    /// From the death to the end of the last of those recoveries.
    pub recovered_after_ms: Option<f64>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RecoverySummary {
    pub count: u64,
    pub rolled_forward: u64,
    pub rolled_back: u64,
    pub blocks_scanned: u64,
    pub took_median_ms: Option<f64>,
    pub took_max_ms: Option<f64>,
    /// Over deaths that were recovered: death to the end of recovery.
    pub death_to_recovered_median_ms: Option<f64>,
    pub death_to_recovered_max_ms: Option<f64>,
    /// Recoveries that started before any death of the run.
    pub unattributed: u64,
}

/// Committed transactions per bucket, and the dip after each death.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Throughput {
    pub bucket_ms: u64,
    /// Transactions committed in each bucket, from the moment every node was ready.
    pub committed: Vec<u64>,
    /// 0 when most buckets have no commit: then there is no baseline, and the dips'
    /// `ratio` and `stalled_ms` (and the figures over them) are empty.
    pub median_per_bucket: f64,
    pub dips: Vec<Dip>,
    /// The lowest `ratio` of all dips.
    pub worst_dip_ratio: Option<f64>,
    /// The median and the longest `stalled_ms` of all dips.
    pub stall_median_ms: Option<f64>,
    pub stall_max_ms: Option<f64>,
}

/// The emptiest bucket in the second after a death, against the run's median bucket.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Dip {
    pub at_ms: f64,
    pub cause: String,
    pub min_bucket: u64,
    /// `min_bucket` over the median; none when the median is 0 (no baseline).
    pub ratio: Option<f64>,
    /// Time, in the two seconds after the death, in buckets under a tenth of the
    /// median: how long the cluster as a whole nearly stopped; none when the median is
    /// 0.
    pub stalled_ms: Option<u64>,
}

/// A memory server killed and started again (or, `failover`, its primary killed and its
/// backup promoted), and what it took the cluster.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ServerRestart {
    pub server: usize,
    /// The primary was killed for good: the nodes reconnected to the backup, which the
    /// first of them promoted (`restarted_at_ms` stays empty).
    #[serde(default)]
    pub failover: bool,
    pub killed_at_ms: f64,
    /// When it was started again (and listening).
    pub restarted_at_ms: Option<f64>,
    /// The repairs that followed (normally one, by the first node to reopen).
    pub repairs: Vec<Repair>,
    /// From the kill to the end of the first bucket, from the one the restart (for a
    /// failover: the first repair) falls in on, with at least half the median commits:
    /// by when commits flow again.
    pub commits_resumed_after_ms: Option<f64>,
}

/// Sums over the server restarts.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ServerRestartSummary {
    /// Restarts and failovers.
    pub count: u64,
    #[serde(default)]
    pub failovers: u64,
    pub repairs: u64,
    pub reinstalled: u64,
    pub locks_rolled_forward: u64,
    pub locks_rolled_back: u64,
    /// Index claims the repairs settled (see [`Repair::claims_settled`]).
    #[serde(default)]
    pub claims_settled: u64,
    pub repair_took_max_ms: Option<f64>,
    pub commits_resumed_median_ms: Option<f64>,
    pub commits_resumed_max_ms: Option<f64>,
    /// Restarts no repair followed.
    pub unrepaired: u64,
}

/// Attaches each repair to the last restart, of a server it repaired, killed before it
/// finished, and measures when commits flowed again after each (from `throughput`).
/// The count starts at the restart, or for a failover at its first repair.
pub fn attribute_repairs(
    restarts: &mut [ServerRestart],
    repairs: &[Repair],
    start_ns: u64,
    throughput: &Throughput,
) -> ServerRestartSummary {
    let ms = |ns: u64| (ns as f64 - start_ns as f64) / 1e6;
    for r in repairs {
        let finished = ms(r.finished_ns);
        let owner = restarts
            .iter_mut()
            .filter(|s| s.killed_at_ms <= finished && r.restarted.contains(&s.server))
            .max_by(|a, b| a.killed_at_ms.total_cmp(&b.killed_at_ms));
        if let Some(s) = owner {
            s.repairs.push(r.clone());
        }
    }
    let bucket = throughput.bucket_ms.max(1) as f64;
    let healthy = throughput.median_per_bucket / 2.0;
    let mut resumed = Vec::new();
    for s in restarts.iter_mut() {
        // A failover has no restart: commits cannot flow before the reconnecting node
        // repaired (the kill's own bucket still holds commits from before it).
        let repaired = s.repairs.first().map(|r| ms(r.finished_ns));
        let from = s
            .restarted_at_ms
            .or(repaired)
            .unwrap_or(s.killed_at_ms + bucket);
        let first = (from / bucket).floor().max(0.0) as usize;
        s.commits_resumed_after_ms = throughput
            .committed
            .iter()
            .enumerate()
            .skip(first)
            .find(|&(_, &c)| c > 0 && c as f64 >= healthy)
            .map(|(b, _)| (b + 1) as f64 * bucket - s.killed_at_ms);
        resumed.extend(s.commits_resumed_after_ms);
    }
    let all: Vec<&Repair> = restarts.iter().flat_map(|s| &s.repairs).collect();
    ServerRestartSummary {
        count: restarts.len() as u64,
        failovers: restarts.iter().filter(|s| s.failover).count() as u64,
        repairs: all.len() as u64,
        reinstalled: all.iter().map(|r| r.reinstalled).sum(),
        locks_rolled_forward: all.iter().map(|r| r.locks_rolled_forward).sum(),
        locks_rolled_back: all.iter().map(|r| r.locks_rolled_back).sum(),
        claims_settled: all.iter().map(|r| r.claims_settled).sum(),
        repair_took_max_ms: all
            .iter()
            .map(|r| r.took_us as f64 / 1000.0)
            .max_by(f64::total_cmp),
        commits_resumed_max_ms: resumed.iter().copied().max_by(f64::total_cmp),
        commits_resumed_median_ms: median(&mut resumed),
        unrepaired: restarts.iter().filter(|s| s.repairs.is_empty()).count() as u64,
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HistorySummary {
    pub txns: u64,
    pub committed: u64,
    pub aborted: u64,
    pub unknown: u64,
    pub unknown_observed: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChaosReport {
    pub config: ChaosConfig,
    pub plan: FaultPlan,
    pub executed: Vec<Executed>,
    pub actions: ActionCounts,
    pub crash_points: BTreeMap<String, PointCounts>,
    pub deaths: Vec<Death>,
    pub recoveries: RecoverySummary,
    #[serde(default)]
    pub server_restarts: Vec<ServerRestart>,
    #[serde(default)]
    pub server_restart_summary: ServerRestartSummary,
    pub throughput: Throughput,
    /// How long the faults and workload really ran, from the moment every node was
    /// ready (`config.duration_s` asked; a slow start of a node, waited for, makes it
    /// longer).
    #[serde(default)]
    pub elapsed_s: Option<f64>,
    pub history: HistorySummary,
    pub checks: Vec<CheckResult>,
    /// Everything that makes the run fail: failed checks and harness problems (a node
    /// that died unasked, or would not start or stop).
    pub violations: Vec<String>,
    /// What is worth knowing but fails nothing (e.g. points a short run left out).
    pub notes: Vec<String>,
    pub passed: bool,
}

/// Committed transactions per `bucket_ms` from `start_ns` to `end_ns`, given each
/// one's commit time.
pub fn timeline(
    commits_ns: impl IntoIterator<Item = u64>,
    start_ns: u64,
    end_ns: u64,
    bucket_ms: u64,
) -> Vec<u64> {
    let bucket_ns = bucket_ms.max(1) * 1_000_000;
    let buckets = end_ns.saturating_sub(start_ns).div_ceil(bucket_ns) as usize;
    let mut counts = vec![0; buckets];
    for at in commits_ns {
        if at < start_ns {
            continue;
        }
        if let Some(c) = counts.get_mut(((at - start_ns) / bucket_ns) as usize) {
            *c += 1;
        }
    }
    counts
}

pub fn median(values: &mut [f64]) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    values.sort_by(f64::total_cmp);
    let mid = values.len() / 2;
    Some(if values.len().is_multiple_of(2) {
        (values[mid - 1] + values[mid]) / 2.0
    } else {
        values[mid]
    })
}

impl Throughput {
    /// The timeline and the dip after each death.
    pub fn new(committed: Vec<u64>, bucket_ms: u64, deaths: &[Death]) -> Throughput {
        let mut all: Vec<f64> = committed.iter().map(|&c| c as f64).collect();
        let median_per_bucket = median(&mut all).unwrap_or(0.0);
        let dips: Vec<Dip> = deaths
            .iter()
            .filter_map(|d| {
                let first = (d.at_ms / bucket_ms as f64) as usize;
                let last = first + (1000 / bucket_ms.max(1)) as usize;
                let window = committed.get(first..last.min(committed.len()))?;
                let min_bucket = *window.iter().min()?;
                let stall_end = (first + (2000 / bucket_ms.max(1)) as usize).min(committed.len());
                let stalled = committed[first..stall_end]
                    .iter()
                    .filter(|&&c| (c as f64) < median_per_bucket / 10.0)
                    .count() as u64;
                // A median of 0 is no baseline: nothing is a dip or a stall against it.
                let baseline = median_per_bucket > 0.0;
                Some(Dip {
                    at_ms: d.at_ms,
                    cause: d.cause.clone(),
                    min_bucket,
                    ratio: baseline.then(|| min_bucket as f64 / median_per_bucket),
                    stalled_ms: baseline.then_some(stalled * bucket_ms),
                })
            })
            .collect();
        let worst_dip_ratio = dips.iter().filter_map(|d| d.ratio).min_by(f64::total_cmp);
        let mut stalls: Vec<f64> = dips
            .iter()
            .filter_map(|d| d.stalled_ms)
            .map(|s| s as f64)
            .collect();
        let stall_max_ms = stalls.iter().copied().max_by(f64::total_cmp);
        Throughput {
            bucket_ms,
            committed,
            median_per_bucket,
            dips,
            worst_dip_ratio,
            stall_median_ms: median(&mut stalls),
            stall_max_ms,
        }
    }
}

/// Matches recoveries to deaths and sums them up. Faults come one episode at a time, so
/// a recovery belongs to the last death before it started; `start_ns` is the run's
/// time zero (deaths are in ms from it).
pub fn attribute(deaths: &mut [Death], recoveries: &[Recovery], start_ns: u64) -> RecoverySummary {
    let mut summary = RecoverySummary {
        count: recoveries.len() as u64,
        ..RecoverySummary::default()
    };
    let ms = |ns: u64| (ns as f64 - start_ns as f64) / 1e6;
    let mut took: Vec<f64> = Vec::new();
    for r in recoveries {
        summary.rolled_forward += r.rolled_forward;
        summary.rolled_back += r.rolled_back;
        summary.blocks_scanned += r.blocks_scanned;
        took.push(r.took_us as f64 / 1000.0);
        let finished = ms(r.finished_ns);
        let started = finished - r.took_us as f64 / 1000.0;
        let owner = deaths
            .iter_mut()
            .filter(|d| d.at_ms <= started)
            .max_by(|a, b| a.at_ms.total_cmp(&b.at_ms));
        match owner {
            Some(d) => {
                d.recoveries += 1;
                let after = finished - d.at_ms;
                d.recovered_after_ms = Some(d.recovered_after_ms.map_or(after, |a| a.max(after)));
            }
            None => summary.unattributed += 1,
        }
    }
    summary.took_max_ms = took.iter().copied().max_by(f64::total_cmp);
    summary.took_median_ms = median(&mut took);
    let mut after: Vec<f64> = deaths.iter().filter_map(|d| d.recovered_after_ms).collect();
    summary.death_to_recovered_max_ms = after.iter().copied().max_by(f64::total_cmp);
    summary.death_to_recovered_median_ms = median(&mut after);
    summary
}

fn ms(v: Option<f64>) -> String {
    v.map_or("-".into(), |v| format!("{v:.1} ms"))
}

/// Writes `text` after `prefix`, and each of its further lines (a node's log tail in a
/// problem) two spaces further in than the first, so it reads as part of the report.
fn indented(f: &mut fmt::Formatter, prefix: &str, text: &str) -> fmt::Result {
    let mut lines = text.lines();
    writeln!(f, "{prefix}{}", lines.next().unwrap_or_default())?;
    let indent = " ".repeat(prefix.chars().count() + 2);
    for line in lines {
        writeln!(f, "{indent}{line}")?;
    }
    Ok(())
}

impl fmt::Display for ChaosReport {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        let c = &self.config;
        // What ran, and what was asked when that differs (a node slow to start).
        let length = match self.elapsed_s {
            Some(s) if (s - c.duration_s).abs() >= 0.05 => {
                format!("ran {s:.1} s (asked for {} s)", c.duration_s)
            }
            Some(s) => format!("ran {s:.1} s"),
            None => format!("{} s asked", c.duration_s),
        };
        writeln!(
            f,
            "chaos: {} compute nodes × {} sessions, {} {} memory servers, {length}, lease {} ms, \
             seed {}, workloads {}",
            c.nodes,
            c.sessions_per_node,
            c.servers,
            c.backend,
            c.lease_ms,
            c.seed,
            c.workloads.join(",")
        )?;
        let a = &self.actions;
        writeln!(
            f,
            "faults: {} kills, {} crashes armed ({} fired), {} pauses, {} stalls ({} fenced), {} \
             nodes fenced, {} restarts; {} memory-server kills, {} memory-server restarts, {} \
             failovers ({} node reconnects); {} backup kills, {} backup restarts",
            a.kills,
            a.crashes_armed,
            a.crashes_fired,
            a.pauses,
            a.stalls,
            a.stalls_fenced,
            a.fenced,
            a.restarts,
            a.server_kills,
            a.server_restarts,
            a.server_failovers,
            a.reconnects,
            a.backup_kills,
            a.backup_restarts
        )?;
        if a.stopped_primaries > 0 {
            writeln!(
                f,
                "  {} failovers stopped the primary instead of killing it; its backup was \
                 promoted while it was stopped in {}",
                a.stopped_primaries, a.stopped_primaries_failed_over
            )?;
        }
        if a.primary_rejoins > 0 {
            writeln!(
                f,
                "  {} failed-over primaries rejoined as their promoted backup's backup{}",
                a.primary_rejoins,
                match a.primaries_rejoined_by_themselves {
                    0 => String::new(),
                    n => format!(" ({n} by themselves, resumed after their fence)"),
                }
            )?;
        }
        for (point, n) in &self.crash_points {
            writeln!(
                f,
                "  crash point {point:<20} armed {:>3}  fired {:>3}",
                n.armed, n.fired
            )?;
        }
        let r = &self.recoveries;
        writeln!(
            f,
            "recoveries: {} ({} rolled forward, {} rolled back, {} blocks scanned); took median \
             {}, max {}",
            r.count,
            r.rolled_forward,
            r.rolled_back,
            r.blocks_scanned,
            ms(r.took_median_ms),
            ms(r.took_max_ms)
        )?;
        writeln!(
            f,
            "  death to end of recovery: median {}, max {} over {} deaths",
            ms(r.death_to_recovered_median_ms),
            ms(r.death_to_recovered_max_ms),
            self.deaths.len()
        )?;
        let s = &self.server_restart_summary;
        writeln!(
            f,
            "memory-server restarts: {}, failovers: {} ({} repairs: {} blocks reinstalled, {} \
             locks rolled forward, {} rolled back, {} index claims settled; longest took {}); \
             kill to commits flowing again: median {}, max {}",
            s.count - s.failovers,
            s.failovers,
            s.repairs,
            s.reinstalled,
            s.locks_rolled_forward,
            s.locks_rolled_back,
            s.claims_settled,
            ms(s.repair_took_max_ms),
            ms(s.commits_resumed_median_ms),
            ms(s.commits_resumed_max_ms)
        )?;
        for r in &self.server_restarts {
            let repair = r.repairs.first().map_or("no repair".into(), |p| {
                format!(
                    "repair of {:?}: {} log records, {} reinstalled, {} locks rolled forward, {} \
                     back, {} index claims settled, oracle from {}, took {:.1} ms",
                    p.restarted,
                    p.log_records,
                    p.reinstalled,
                    p.locks_rolled_forward,
                    p.locks_rolled_back,
                    p.claims_settled,
                    p.oracle_from.map_or("-".into(), |c| c.to_string()),
                    p.took_us as f64 / 1000.0
                )
            });
            if r.failover {
                writeln!(
                    f,
                    "  server {} failed over at {:.1} s (primary lost, backup promoted); \
                     commits again after {}; {repair}",
                    r.server,
                    r.killed_at_ms / 1000.0,
                    ms(r.commits_resumed_after_ms)
                )?;
                continue;
            }
            writeln!(
                f,
                "  server {} killed at {:.1} s, back after {}; commits again after {}; {repair}",
                r.server,
                r.killed_at_ms / 1000.0,
                ms(r.restarted_at_ms.map(|b| b - r.killed_at_ms)),
                ms(r.commits_resumed_after_ms)
            )?;
        }
        let t = &self.throughput;
        let total: u64 = t.committed.iter().sum();
        if t.median_per_bucket > 0.0 {
            writeln!(
                f,
                "throughput: {total} commits, median {:.0} per {} ms ({:.0}/s); worst dip in the \
                 second after a death: {}",
                t.median_per_bucket,
                t.bucket_ms,
                t.median_per_bucket * 1000.0 / t.bucket_ms.max(1) as f64,
                t.worst_dip_ratio
                    .map_or("-".into(), |r| format!("{:.0}% of the median", r * 100.0))
            )?;
            writeln!(
                f,
                "  after a death, under a tenth of the median for: median {}, max {}",
                ms(t.stall_median_ms),
                ms(t.stall_max_ms)
            )?;
        } else {
            let empty = t.committed.iter().filter(|&&c| c == 0).count();
            writeln!(
                f,
                "throughput: {total} commits; {empty} of {} buckets of {} ms had none, so the \
                 median is 0 and there is no baseline to measure dips after deaths against",
                t.committed.len(),
                t.bucket_ms
            )?;
        }
        let h = &self.history;
        writeln!(
            f,
            "history: {} transactions: {} committed, {} aborted, {} unknown ({} observed to \
             commit)",
            h.txns, h.committed, h.aborted, h.unknown, h.unknown_observed
        )?;
        writeln!(f, "checks:")?;
        for check in &self.checks {
            let verdict = if check.passed { "PASS" } else { "FAIL" };
            writeln!(f, "  {verdict}  {:<20} {}", check.name, check.summary)?;
            for line in &check.details {
                indented(f, "        ", line)?;
            }
        }
        for note in &self.notes {
            indented(f, "note: ", note)?;
        }
        if self.passed {
            writeln!(f, "verdict: PASSED")
        } else {
            writeln!(
                f,
                "verdict: FAILED, {} violation(s):",
                self.violations.len()
            )?;
            for v in &self.violations {
                indented(f, "  - ", v)?;
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn death(at_ms: f64) -> Death {
        Death {
            node: 0,
            incarnation: 1,
            cause: "kill".into(),
            at_ms,
            recoveries: 0,
            recovered_after_ms: None,
        }
    }

    fn recovery(slot: u32, finished_ms: u64, took_ms: u64) -> Recovery {
        Recovery {
            slot,
            holder_tag: 1,
            rolled_forward: 1,
            rolled_back: 2,
            blocks_scanned: 3,
            took_us: took_ms * 1000,
            finished_ns: 1_000_000_000 + finished_ms * 1_000_000,
        }
    }

    #[test]
    fn recoveries_belong_to_the_last_death_before_they_started() {
        let mut deaths = vec![death(1000.0), death(5000.0)];
        let recoveries = [
            recovery(1, 1300, 10),
            recovery(2, 1320, 20),
            recovery(3, 5290, 5),
            // Started before either death.
            recovery(4, 500, 5),
        ];
        let summary = attribute(&mut deaths, &recoveries, 1_000_000_000);
        assert_eq!(summary.count, 4);
        assert_eq!(summary.unattributed, 1);
        assert_eq!((summary.rolled_forward, summary.rolled_back), (4, 8));
        assert_eq!(deaths[0].recoveries, 2);
        assert_eq!(deaths[0].recovered_after_ms, Some(320.0));
        assert_eq!(deaths[1].recovered_after_ms, Some(290.0));
        assert_eq!(summary.death_to_recovered_max_ms, Some(320.0));
        assert_eq!(summary.death_to_recovered_median_ms, Some(305.0));
        assert_eq!(summary.took_max_ms, Some(20.0));
        assert_eq!(summary.took_median_ms, Some(7.5));
    }

    #[test]
    fn the_dip_is_the_emptiest_bucket_of_the_second_after_a_death() {
        let start = 5_000_000_000;
        // 10 commits in each 100 ms bucket, none from 1.2 s to 1.4 s.
        let commits = (0..30u64)
            .flat_map(|b| (0..10).map(move |i| start + b * 100_000_000 + i))
            .filter(|&ns| !(1_200_000_000..1_400_000_000).contains(&(ns - start)));
        let counts = timeline(commits, start, start + 3_000_000_000, 100);
        assert_eq!(counts.len(), 30);
        assert_eq!(counts[12], 0);
        let t = Throughput::new(counts, 100, &[death(1100.0), death(2500.0)]);
        assert_eq!(t.median_per_bucket, 10.0);
        assert_eq!(t.dips[0].min_bucket, 0);
        assert_eq!(t.dips[0].ratio, Some(0.0));
        assert_eq!(t.dips[1].min_bucket, 10);
        assert_eq!(t.worst_dip_ratio, Some(0.0));
        assert_eq!(
            (t.dips[0].stalled_ms, t.dips[1].stalled_ms),
            (Some(200), Some(0))
        );
        assert_eq!(
            (t.stall_median_ms, t.stall_max_ms),
            (Some(100.0), Some(200.0))
        );
    }

    #[test]
    fn without_commits_in_most_buckets_there_is_no_baseline_for_dips() {
        // Commits in 4 buckets of 10: the median bucket has none.
        let mut committed = vec![0u64; 10];
        committed[..4].fill(7);
        let t = Throughput::new(committed, 100, &[death(200.0)]);
        assert_eq!(t.median_per_bucket, 0.0);
        assert_eq!(t.dips.len(), 1);
        assert_eq!(t.dips[0].min_bucket, 0);
        assert_eq!((t.dips[0].ratio, t.dips[0].stalled_ms), (None, None));
        assert_eq!(t.worst_dip_ratio, None);
        assert_eq!((t.stall_median_ms, t.stall_max_ms), (None, None));
        let json = serde_json::to_value(&t).unwrap();
        assert!(json["dips"][0]["ratio"].is_null(), "{json}");
        assert!(json["dips"][0]["stalled_ms"].is_null(), "{json}");
        assert!(json["worst_dip_ratio"].is_null(), "{json}");
        let text = report(t).to_string();
        assert!(
            text.contains(
                "throughput: 28 commits; 6 of 10 buckets of 100 ms had none, so the median is 0 \
                 and there is no baseline"
            ),
            "{text}"
        );
        assert!(!text.contains("% of the median"), "{text}");
        assert!(!text.contains("under a tenth"), "{text}");
    }

    fn report(throughput: Throughput) -> ChaosReport {
        ChaosReport {
            config: ChaosConfig {
                duration_s: 2.0,
                nodes: 1,
                sessions_per_node: 2,
                servers: 1,
                backend: "shm".into(),
                seed: 1,
                workloads: vec!["bank".into()],
                lease_ms: 250,
            },
            plan: FaultPlan {
                seed: 1,
                actions: Vec::new(),
                uncovered_points: Vec::new(),
                full_coverage_ms: 0,
            },
            executed: Vec::new(),
            actions: ActionCounts::default(),
            crash_points: BTreeMap::new(),
            deaths: vec![death(200.0)],
            recoveries: RecoverySummary::default(),
            server_restarts: Vec::new(),
            server_restart_summary: ServerRestartSummary::default(),
            throughput,
            elapsed_s: Some(2.0),
            history: HistorySummary::default(),
            checks: Vec::new(),
            violations: Vec::new(),
            notes: Vec::new(),
            passed: true,
        }
    }

    #[test]
    fn the_report_gives_the_measured_length_and_indents_log_tails() {
        let mut r = report(Throughput::new(vec![10; 20], 100, &[]));
        assert!(r.to_string().contains(" ran 2.0 s, lease"), "{r}");
        // A node slow to start: the run is longer than asked.
        r.elapsed_s = Some(3.46);
        assert!(
            r.to_string().contains(" ran 3.5 s (asked for 2 s), lease"),
            "{r}"
        );
        r.checks.push(CheckResult::from_problems(
            "harness",
            "not every node started".into(),
            vec!["compute node 0 exited unexpectedly; its log n0.log ends:\nfirst\nlast".into()],
        ));
        r.violations
            .push("harness: 1 problem(s)\nsecond line".into());
        r.passed = false;
        let text = r.to_string();
        assert!(
            text.contains(
                "\n        compute node 0 exited unexpectedly; its log n0.log ends:\n          \
                 first\n          last\n"
            ),
            "{text}"
        );
        assert!(
            text.contains("\n  - harness: 1 problem(s)\n      second line\n"),
            "{text}"
        );
        // Every line of the report but the first is indented or starts with a heading.
        assert!(
            text.lines()
                .all(|l| !l.starts_with("first") && !l.starts_with("last")),
            "{text}"
        );
    }

    fn repair(restarted: Vec<usize>, finished_ms: u64) -> Repair {
        Repair {
            restarted,
            log_records: 10,
            reinstalled: 2,
            locks_rolled_forward: 1,
            locks_rolled_back: 1,
            claims_settled: 3,
            blocks_scanned: 100,
            oracle_from: None,
            took_us: 3000,
            finished_ns: 1_000_000_000 + finished_ms * 1_000_000,
        }
    }

    #[test]
    fn repairs_belong_to_the_restart_they_repaired_and_commits_resume_after_it() {
        let restart = |server, killed_at_ms: f64| ServerRestart {
            server,
            failover: false,
            killed_at_ms,
            restarted_at_ms: Some(killed_at_ms + 300.0),
            repairs: Vec::new(),
            commits_resumed_after_ms: None,
        };
        // Server 1's is a failover: no restart, commits counted from the kill.
        let mut restarts = vec![
            restart(0, 1000.0),
            ServerRestart {
                failover: true,
                restarted_at_ms: None,
                ..restart(1, 2000.0)
            },
        ];
        // 10 commits per 100 ms bucket but none from 1.0 s to 1.6 s, and a trickle
        // (under half the median) from 2.0 s to 2.5 s.
        let mut committed = vec![10u64; 30];
        committed[10..16].fill(0);
        committed[20..25].fill(2);
        let throughput = Throughput::new(committed, 100, &[]);
        let summary = attribute_repairs(
            &mut restarts,
            &[
                repair(vec![0], 1400),
                repair(vec![1], 2350),
                repair(vec![1], 900),
            ],
            1_000_000_000,
            &throughput,
        );
        assert_eq!(restarts[0].repairs.len(), 1);
        assert_eq!(restarts[1].repairs.len(), 1);
        assert_eq!(restarts[0].commits_resumed_after_ms, Some(700.0));
        assert_eq!(restarts[1].commits_resumed_after_ms, Some(600.0));
        assert_eq!((summary.count, summary.failovers), (2, 1));
        assert_eq!((summary.repairs, summary.unrepaired), (2, 0));
        assert_eq!(summary.reinstalled, 4);
        assert_eq!(summary.claims_settled, 6);
        // Event files written before the count was recorded still read.
        let mut old = serde_json::to_value(repair(vec![0], 1)).unwrap();
        old.as_object_mut().unwrap().remove("claims_settled");
        let read: Repair = serde_json::from_value(old).unwrap();
        assert_eq!(read.claims_settled, 0);
        // The text report gives them with the other counts.
        let mut r = report(throughput);
        r.server_restarts = restarts;
        r.server_restart_summary = summary.clone();
        let text = r.to_string();
        assert!(
            text.contains(" 2 rolled back, 6 index claims settled;"),
            "{text}"
        );
        assert!(
            text.contains(" 1 back, 3 index claims settled, oracle from"),
            "{text}"
        );
        assert_eq!(summary.repair_took_max_ms, Some(3.0));
        assert_eq!(summary.commits_resumed_max_ms, Some(700.0));
    }
}
