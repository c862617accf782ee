//! The fault plan: a seeded list of timed actions against compute nodes.
//!
//! Faults come in episodes, one at a time across the whole cluster, so that at most one
//! node is ever down and every death can be matched to the recoveries that follow it
//! (a recovery starts only once the dead node's lease has run out, and the next episode
//! begins after that). An episode always ends with its node running again and unarmed.
//!
//! - **kill**: `Kill` (SIGKILL at a random moment of the node's work), then `Restart`
//!   after 2–3 lease timeouts, so that another node has fenced the slot and recovered
//!   its locks by then.
//! - **crash**: `Kill`, then `Crash`: the node is started again with one commit-step
//!   crash point armed, so it dies in the middle of that step of some commit; after
//!   `window` (counted once the node is ready; the executor may wait longer while the
//!   node has had few chances to reach its point) `Restart` starts it unarmed, killing
//!   it first if the point never fired.
//! - **pause**: `Pause` (SIGSTOP, then SIGCONT `for` later), always shorter than half the
//!   lease timeout, so that a pause stays a pause.
//! - **stall** (two or more nodes): `Stall`, a pause of 4–5 lease timeouts. Another
//!   node finds the stopped node's lease lapsed and fences it: at the memory servers
//!   first (they end its sessions and destroy its queue pairs, so nothing it posts once
//!   resumed lands), then its oracle slot, then it recovers its commits. Resumed, the
//!   node finds its sessions fenced and exits; the harness starts it again. A stalled
//!   node may also run on when no other node needed its timestamps or locks in time
//!   (a note: fencing is the others' doing, not the stall's).
//!
//! - **server restart**: `KillMemoryServer` (SIGKILL of a durable memory server at a
//!   random moment), then `RestartMemoryServer` on the same data directory and port
//!   1–2 lease timeouts later. Every compute node loses its connections to that server;
//!   the harness starts each again once the server is back, and the first to reopen the
//!   database repairs what the restart lost. A run of [`SERVER_RESTARTS_FROM`] or more
//!   restarts server 0 (the oracle's) at least once, and with two or more servers
//!   another one too.
//! - **server failover** (replicated servers, [`PlanConfig::failover`]): instead of a
//!   restart, `FailoverMemoryServer` SIGKILLs the primary of a server and leaves it
//!   dead; the nodes lose it and, started again, connect to its backup (promoting it).
//!   Unless failed-over primaries rejoin ([`PlanConfig::rejoin`]), nothing
//!   re-replicates a promoted backup, so a server fails over at most once and has no
//!   server episode after that: its one copy must stay up. With rejoins,
//!   `RejoinAsBackup` starts the dead primary again at its address as the promoted
//!   server's backup (`--backup-of`) once the nodes came back, and the pair, the other
//!   way round, may fail over again: server 0 does, a second time.
//! - **backup restart** (replicated servers): `KillBackup` SIGKILLs a server's backup,
//!   which stops that server's Persists (so commits on it fail), and `RestartBackup`
//!   starts it again 1–2 lease timeouts later; its primary attaches to it again and
//!   copies its whole state while commits go on. A run of [`SERVER_RESTARTS_FROM`] or
//!   more does this to server 0 before its failover, so that the failover finds a
//!   backup that was re-synced under load.

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// Runs at least this long always restart memory servers (unless turned off).
pub const SERVER_RESTARTS_FROM: Duration = Duration::from_secs(20);

/// One thing the harness does to a compute node or a memory server.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "action", rename_all = "snake_case")]
pub enum Action {
    /// SIGKILL the node's process.
    Kill { node: usize },
    /// Start the (dead) node with crash point `point` armed at `probability`: each
    /// commit that reaches the point aborts the process there with that probability.
    /// The plan's next action on the node waits until it died or has been ready for
    /// `window_ms` (or longer, while it has had few chances to reach the point).
    Crash {
        node: usize,
        point: String,
        probability: f64,
        window_ms: u64,
    },
    /// Start the node unarmed (killing it first if an armed point never fired).
    Restart { node: usize },
    /// SIGSTOP the node, then SIGCONT it `for_ms` later.
    Pause { node: usize, for_ms: u64 },
    /// SIGSTOP the node past its lease, then SIGCONT it `for_ms` later: it must be
    /// fenced meanwhile, and exits once resumed, to be started again.
    Stall { node: usize, for_ms: u64 },
    /// SIGKILL memory server `server`.
    KillMemoryServer { server: usize },
    /// Start the (dead) memory server `server` again on its data directory.
    RestartMemoryServer { server: usize },
    /// SIGKILL the primary of replicated memory server `server` for good: its backup
    /// serves from then on.
    FailoverMemoryServer { server: usize },
    /// SIGKILL the backup of replicated memory server `server`.
    KillBackup { server: usize },
    /// Start the (dead) backup of memory server `server` again, at its address.
    RestartBackup { server: usize },
    /// Start the failed-over primary of memory server `server` again at its address,
    /// as the backup of the promoted server (`--backup-of`): the server is replicated
    /// again, the other way round.
    RejoinAsBackup { server: usize },
}

impl Action {
    /// The compute node acted on, or for a memory-server action the server's number.
    pub fn node(&self) -> usize {
        match *self {
            Action::Kill { node }
            | Action::Crash { node, .. }
            | Action::Restart { node }
            | Action::Pause { node, .. }
            | Action::Stall { node, .. } => node,
            Action::KillMemoryServer { server }
            | Action::RestartMemoryServer { server }
            | Action::FailoverMemoryServer { server }
            | Action::KillBackup { server }
            | Action::RestartBackup { server }
            | Action::RejoinAsBackup { server } => server,
        }
    }

    /// Whether it acts on a memory server rather than a compute node.
    pub fn on_server(&self) -> bool {
        matches!(
            self,
            Action::KillMemoryServer { .. }
                | Action::RestartMemoryServer { .. }
                | Action::FailoverMemoryServer { .. }
                | Action::KillBackup { .. }
                | Action::RestartBackup { .. }
                | Action::RejoinAsBackup { .. }
        )
    }

    /// The name the report counts the action under.
    pub fn name(&self) -> &'static str {
        match self {
            Action::Kill { .. } => "kill",
            Action::Crash { .. } => "crash",
            Action::Restart { .. } => "restart",
            Action::Pause { .. } => "pause",
            Action::Stall { .. } => "stall",
            Action::KillMemoryServer { .. } => "server_kill",
            Action::RestartMemoryServer { .. } => "server_restart",
            Action::FailoverMemoryServer { .. } => "server_failover",
            Action::KillBackup { .. } => "backup_kill",
            Action::RestartBackup { .. } => "backup_restart",
            Action::RejoinAsBackup { .. } => "primary_rejoin",
        }
    }
}

/// The crash points only commits that create records pass.
pub const INSERT_POINTS: [&str; 2] = ["after-insert-blocks", "after-index"];

/// An action and when it is due, counted from the moment every node is ready. The
/// executor may run it later (never earlier): a `Crash` holds its node's next action
/// back until the point fired or its window passed (and its node had its chances at the
/// point), and actions on a node wait until it is ready.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Planned {
    pub at_ms: u64,
    #[serde(flatten)]
    pub action: Action,
}

/// What a plan is made for.
#[derive(Clone, Debug)]
pub struct PlanConfig {
    pub duration: Duration,
    pub nodes: usize,
    /// Memory servers (for server restarts).
    pub servers: usize,
    /// Whether the plan restarts memory servers.
    pub server_restarts: bool,
    /// Whether every memory server has a backup: server episodes are then failovers
    /// (at most one per server, unless `rejoin`) instead of restarts.
    pub failover: bool,
    /// With `failover`: each failed-over primary rejoins as its promoted backup's
    /// backup, and server 0 fails over twice.
    pub rejoin: bool,
    pub lease_timeout: Duration,
    /// The crash points to cover (`txn::crash::POINTS` without `all`).
    pub points: Vec<String>,
    pub seed: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FaultPlan {
    pub seed: u64,
    pub actions: Vec<Planned>,
    /// Crash points no episode arms: the run is too short to hold them all.
    pub uncovered_points: Vec<String>,
    /// The shortest duration whose plan arms every point (and has a kill and a pause).
    pub full_coverage_ms: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Kill,
    Pause,
    Stall,
    Crash,
    /// A restart of this memory server, or its failover.
    Server(usize),
    /// A kill and restart of this replicated memory server's backup.
    Backup(usize),
}

/// Episode timing, all derived from the lease timeout.
struct Timing {
    lease: Duration,
    /// Failovers are followed by the old primary's rejoin.
    rejoin: bool,
}

impl Timing {
    /// Before the first fault: every node has committed for a while.
    fn warmup(&self) -> Duration {
        (self.lease * 4).max(Duration::from_secs(1))
    }

    /// Kill to restart: long enough that another node fences the dead slot (one lease)
    /// and recovers it before the node comes back.
    fn restart_delay(&self, rng: &mut StdRng) -> Duration {
        self.lease.mul_f64(rng.random_range(2.0..3.0))
    }

    fn longest_restart_delay(&self) -> Duration {
        self.lease * 3
    }

    /// Server kill to restart: the nodes see their connections fail meanwhile.
    fn server_down(&self, rng: &mut StdRng) -> Duration {
        self.lease.mul_f64(rng.random_range(1.0..2.0))
    }

    /// After a server restart, before the settle: every node reconnects (a new
    /// process opening the database, the first repairing the restart) and the slots
    /// the old processes left are fenced (a lease) and recovered.
    fn server_rejoin(&self) -> Duration {
        self.lease * 2 + Duration::from_millis(1500)
    }

    /// After a backup restart: the primary attaches again (it retries every second),
    /// copies its state, and the nodes' broken workers are replaced and their commits
    /// recovered before commits flow again.
    fn backup_rejoin(&self) -> Duration {
        self.server_rejoin() + Duration::from_secs(2)
    }

    /// How long an armed node gets, once ready, to reach its crash point.
    fn crash_window(&self) -> Duration {
        (self.lease * 4).max(Duration::from_secs(1))
    }

    /// Quiet time after an episode, so the next death comes after the last recovery.
    fn settle(&self, rng: &mut StdRng) -> Duration {
        self.lease.mul_f64(rng.random_range(1.0..2.0))
    }

    fn longest_settle(&self) -> Duration {
        self.lease * 2
    }

    /// Shorter than half the lease: see the module doc.
    fn pause(&self, rng: &mut StdRng) -> Duration {
        self.lease
            .mul_f64(rng.random_range(0.1..0.45))
            .max(Duration::from_millis(1))
    }

    /// Past the lease, with room for the fencer: it fences once it needs the stalled
    /// holder's timestamps and the heartbeat then stood still for a lease of its own
    /// clock. 2.5–3.5 leases left a stall unfenced in 3 of 6 runs of the CI seed on a
    /// loaded machine.
    fn stall(&self, rng: &mut StdRng) -> Duration {
        self.lease.mul_f64(rng.random_range(4.0..5.0))
    }

    /// After a stall: the node finds itself fenced and exits, and its new process
    /// opens the database.
    fn stall_rejoin(&self) -> Duration {
        self.lease * 2 + Duration::from_millis(1500)
    }

    /// Time left at the end with no fault, so the last recovery happens in the run.
    fn tail(&self) -> Duration {
        self.lease * 2
    }

    /// The longest an episode of `kind` can take (its nominal time, settle included).
    fn longest(&self, kind: Kind) -> Duration {
        let episode = match kind {
            Kind::Kill => self.longest_restart_delay(),
            Kind::Pause => self.lease / 2,
            Kind::Stall => self.lease * 5 + self.stall_rejoin(),
            Kind::Crash => self.longest_restart_delay() * 2 + self.crash_window(),
            Kind::Server(_) if self.rejoin => self.server_rejoin() * 2 + self.backup_rejoin(),
            Kind::Server(_) => self.lease * 2 + self.server_rejoin(),
            Kind::Backup(_) => self.lease * 2 + self.backup_rejoin(),
        };
        episode + self.longest_settle()
    }
}

impl FaultPlan {
    /// The plan for `config`; the same seed gives the same plan.
    pub fn generate(config: &PlanConfig) -> Result<FaultPlan, String> {
        if config.nodes == 0 {
            return Err("a fault plan needs at least one compute node".into());
        }
        if config.lease_timeout < Duration::from_millis(10) {
            return Err(format!(
                "a lease timeout of {:?} is too short: pauses must stay under half of it",
                config.lease_timeout
            ));
        }
        let timing = Timing {
            lease: config.lease_timeout,
            rejoin: config.failover && config.rejoin,
        };
        let mut rng = StdRng::seed_from_u64(config.seed);
        let mut points = config.points.clone();
        points.shuffle(&mut rng);

        // Every point once, a kill and a pause, in random order; then random episodes
        // while time remains. A guaranteed episode that does not fit is dropped, so a
        // short run still gets what fits.
        let mut must: Vec<Kind> = vec![Kind::Crash; points.len()];
        must.push(Kind::Kill);
        must.push(Kind::Pause);
        // A stall is fenced by another node.
        let stalls = config.nodes >= 2;
        if stalls {
            must.push(Kind::Stall);
        }
        let restarts_servers = config.server_restarts && config.servers > 0;
        if restarts_servers && config.duration >= SERVER_RESTARTS_FROM {
            must.push(Kind::Server(0));
            if config.servers > 1 {
                must.push(Kind::Server(rng.random_range(1..config.servers)));
            }
            if config.failover {
                must.push(Kind::Backup(0));
            }
            if timing.rejoin {
                must.push(Kind::Server(0));
            }
        }
        must.shuffle(&mut rng);
        // Server 0's backup restart comes before its failover, which leaves no backup.
        let backup = must.iter().position(|&k| k == Kind::Backup(0));
        let failover = must.iter().position(|&k| k == Kind::Server(0));
        if let (Some(b), Some(f)) = (backup, failover)
            && b > f
        {
            must.swap(b, f);
        }
        // Guaranteed server restarts keep their time: other episodes that would eat
        // into it are dropped instead.
        let mut reserved: Duration = must
            .iter()
            .filter(|k| matches!(k, Kind::Server(_) | Kind::Backup(_)))
            .map(|&k| timing.longest(k))
            .sum();
        let full_coverage = timing.warmup()
            + must.iter().map(|&k| timing.longest(k)).sum::<Duration>()
            + timing.tail();

        let end = config.duration.saturating_sub(timing.tail());
        let mut t = timing.warmup();
        let mut actions = Vec::new();
        let mut next_point = 0;
        let mut uncovered = Vec::new();
        let mut must = must.into_iter();
        let mut failed_over = vec![false; config.servers];
        loop {
            let kind = match must.next() {
                Some(kind) => kind,
                None => match rng.random_range(0..10) {
                    0..=2 => Kind::Kill,
                    3..=5 => Kind::Crash,
                    6 if restarts_servers => {
                        let server = rng.random_range(0..config.servers);
                        // A failed-over server has one copy left: no episode kills it.
                        if failed_over[server] {
                            Kind::Kill
                        } else if config.failover && rng.random_bool(0.5) {
                            Kind::Backup(server)
                        } else {
                            Kind::Server(server)
                        }
                    }
                    6 => Kind::Kill,
                    9 if stalls => Kind::Stall,
                    _ => Kind::Pause,
                },
            };
            let kept = match kind {
                Kind::Server(_) | Kind::Backup(_) => Duration::ZERO,
                _ => reserved,
            };
            if t + timing.longest(kind) + kept > end {
                if let Kind::Server(_) | Kind::Backup(_) = kind {
                    reserved = reserved.saturating_sub(timing.longest(kind));
                }
                if kind == Kind::Crash && next_point < points.len() {
                    uncovered.push(points[next_point].clone());
                    next_point += 1;
                    continue;
                }
                // Nothing longer fits either once the guaranteed episodes are spent.
                if must.len() == 0 {
                    break;
                }
                continue;
            }
            let node = rng.random_range(0..config.nodes);
            let at = |t: Duration| t.as_millis() as u64;
            match kind {
                Kind::Backup(server) => {
                    reserved = reserved.saturating_sub(timing.longest(kind));
                    if failed_over[server] {
                        continue;
                    }
                    actions.push(Planned {
                        at_ms: at(t),
                        action: Action::KillBackup { server },
                    });
                    t += timing.server_down(&mut rng);
                    actions.push(Planned {
                        at_ms: at(t),
                        action: Action::RestartBackup { server },
                    });
                    t += timing.backup_rejoin();
                }
                Kind::Server(server) => {
                    // Random restarts come once the guaranteed ones are placed, when
                    // nothing is reserved any more.
                    reserved = reserved.saturating_sub(timing.longest(kind));
                    if timing.rejoin {
                        actions.push(Planned {
                            at_ms: at(t),
                            action: Action::FailoverMemoryServer { server },
                        });
                        // The nodes come back on the promoted backup first: it takes a
                        // backup only once promoted.
                        t += timing.server_rejoin() * 2;
                        actions.push(Planned {
                            at_ms: at(t),
                            action: Action::RejoinAsBackup { server },
                        });
                        t += timing.backup_rejoin();
                        t += timing.settle(&mut rng);
                        continue;
                    }
                    if config.failover {
                        failed_over[server] = true;
                        actions.push(Planned {
                            at_ms: at(t),
                            action: Action::FailoverMemoryServer { server },
                        });
                        // No down time: the backup is there as soon as nodes reconnect.
                        t += timing.server_rejoin();
                        t += timing.settle(&mut rng);
                        continue;
                    }
                    actions.push(Planned {
                        at_ms: at(t),
                        action: Action::KillMemoryServer { server },
                    });
                    t += timing.server_down(&mut rng);
                    actions.push(Planned {
                        at_ms: at(t),
                        action: Action::RestartMemoryServer { server },
                    });
                    t += timing.server_rejoin();
                }
                Kind::Kill => {
                    actions.push(Planned {
                        at_ms: at(t),
                        action: Action::Kill { node },
                    });
                    t += timing.restart_delay(&mut rng);
                    actions.push(Planned {
                        at_ms: at(t),
                        action: Action::Restart { node },
                    });
                }
                Kind::Pause => {
                    let pause = timing.pause(&mut rng);
                    actions.push(Planned {
                        at_ms: at(t),
                        action: Action::Pause {
                            node,
                            for_ms: pause.as_millis().max(1) as u64,
                        },
                    });
                    t += pause;
                }
                Kind::Stall => {
                    let stall = timing.stall(&mut rng);
                    actions.push(Planned {
                        at_ms: at(t),
                        action: Action::Stall {
                            node,
                            for_ms: stall.as_millis() as u64,
                        },
                    });
                    t += stall + timing.stall_rejoin();
                }
                Kind::Crash => {
                    let point = if next_point < points.len() {
                        next_point += 1;
                        points[next_point - 1].clone()
                    } else if points.is_empty() {
                        continue;
                    } else {
                        points[rng.random_range(0..points.len())].clone()
                    };
                    actions.push(Planned {
                        at_ms: at(t),
                        action: Action::Kill { node },
                    });
                    t += timing.restart_delay(&mut rng);
                    let window = timing.crash_window();
                    // Likely enough to fire within the window on any commit that
                    // reaches the point, unlikely enough that which commit is random.
                    let drawn = (rng.random_range(0.25..0.75f64) * 100.0).round() / 100.0;
                    // Only commits that insert reach the insert steps, a few a second
                    // in the CI-sized run: at the drawn odds, 1 run in ~20 saw none
                    // fire within the window. The first such commit is random enough.
                    let probability = if INSERT_POINTS.contains(&point.as_str()) {
                        1.0
                    } else {
                        drawn
                    };
                    actions.push(Planned {
                        at_ms: at(t),
                        action: Action::Crash {
                            node,
                            point,
                            probability,
                            window_ms: window.as_millis() as u64,
                        },
                    });
                    t += window + timing.restart_delay(&mut rng);
                    actions.push(Planned {
                        at_ms: at(t),
                        action: Action::Restart { node },
                    });
                }
            }
            t += timing.settle(&mut rng);
        }
        uncovered.extend(points[next_point..].iter().cloned());
        Ok(FaultPlan {
            seed: config.seed,
            actions,
            uncovered_points: uncovered,
            full_coverage_ms: full_coverage.as_millis() as u64,
        })
    }

    /// How many actions of each kind the plan holds.
    pub fn count(&self, name: &str) -> usize {
        self.actions
            .iter()
            .filter(|p| p.action.name() == name)
            .count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(seconds: u64, seed: u64) -> PlanConfig {
        PlanConfig {
            duration: Duration::from_secs(seconds),
            nodes: 3,
            servers: 2,
            server_restarts: true,
            failover: false,
            rejoin: false,
            lease_timeout: Duration::from_millis(250),
            points: ["p1", "p2", "p3", "p4", "p5", "p6"]
                .map(String::from)
                .into(),
            seed,
        }
    }

    /// Replays a plan: which nodes and servers are down, armed or paused over time.
    fn replay(plan: &FaultPlan, config: &PlanConfig) {
        let mut down = vec![false; config.nodes];
        let mut server_down = vec![false; config.servers];
        let mut backup_down = vec![false; config.servers];
        let mut failed_over = vec![false; config.servers];
        let mut last_at = 0;
        for p in &plan.actions {
            assert!(p.at_ms >= last_at, "in time order: {plan:?}");
            last_at = p.at_ms;
            assert!(p.at_ms <= config.duration.as_millis() as u64);
            let node = p.action.node();
            if p.action.on_server() {
                assert!(node < config.servers);
            } else {
                assert!(node < config.nodes);
                assert!(server_down.iter().all(|d| !d), "one episode at a time");
                assert!(backup_down.iter().all(|d| !d), "one episode at a time");
            }
            if p.action.on_server() && !matches!(p.action, Action::RejoinAsBackup { .. }) {
                assert!(!failed_over[node], "nothing acts on a failed-over server");
            }
            match &p.action {
                Action::FailoverMemoryServer { .. } => {
                    assert!(config.failover, "failovers only with backups");
                    assert!(down.iter().all(|d| !d), "one episode at a time");
                    assert!(server_down.iter().all(|d| !d), "one episode at a time");
                    assert!(backup_down.iter().all(|d| !d), "one episode at a time");
                    failed_over[node] = true;
                }
                Action::KillBackup { .. } => {
                    assert!(config.failover, "only replicated servers have backups");
                    assert!(down.iter().all(|d| !d), "one episode at a time");
                    assert!(server_down.iter().all(|d| !d), "one episode at a time");
                    assert!(backup_down.iter().all(|d| !d), "one episode at a time");
                    backup_down[node] = true;
                }
                Action::RestartBackup { .. } => {
                    assert!(backup_down[node]);
                    backup_down[node] = false;
                }
                Action::RejoinAsBackup { .. } => {
                    assert!(config.rejoin, "rejoins only when asked for");
                    assert!(failed_over[node], "only a failed-over primary rejoins");
                    failed_over[node] = false;
                }
                Action::KillMemoryServer { .. } => {
                    assert!(!config.failover, "replicated servers fail over instead");
                    assert!(down.iter().all(|d| !d), "one episode at a time");
                    assert!(server_down.iter().all(|d| !d), "one episode at a time");
                    server_down[node] = true;
                }
                Action::RestartMemoryServer { .. } => {
                    assert!(server_down[node]);
                    server_down[node] = false;
                }
                Action::Kill { .. } => {
                    assert!(down.iter().all(|d| !d), "one episode at a time");
                    down[node] = true;
                }
                Action::Crash { probability, .. } => {
                    assert!(down[node], "a crash starts a dead node");
                    assert!((0.0..=1.0).contains(probability));
                }
                Action::Restart { .. } => {
                    assert!(down[node]);
                    down[node] = false;
                }
                Action::Pause { for_ms, .. } => {
                    assert!(down.iter().all(|d| !d));
                    assert!(*for_ms < 125, "shorter than half the lease: {for_ms}");
                }
                Action::Stall { for_ms, .. } => {
                    assert!(down.iter().all(|d| !d), "one episode at a time");
                    assert!(config.nodes >= 2, "another node fences a stall");
                    assert!((1000..=1250).contains(for_ms), "4 to 5 leases: {for_ms}");
                }
            }
        }
        assert!(down.iter().all(|d| !d), "every node runs at the end");
        assert!(
            server_down.iter().all(|d| !d) && backup_down.iter().all(|d| !d),
            "every server runs at the end"
        );
    }

    fn server_restarts(plan: &FaultPlan) -> Vec<usize> {
        plan.actions
            .iter()
            .filter_map(|p| match p.action {
                Action::RestartMemoryServer { server } => Some(server),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn a_run_of_20_s_restarts_server_0_and_another_one_at_a_time() {
        for seed in 0..50 {
            for servers in [1, 2, 3] {
                let config = PlanConfig {
                    servers,
                    ..config(20, seed)
                };
                let plan = FaultPlan::generate(&config).expect("a plan");
                replay(&plan, &config);
                let restarted = server_restarts(&plan);
                assert_eq!(plan.count("server_kill"), restarted.len());
                assert!(restarted.contains(&0), "{plan:?}");
                if servers > 1 {
                    assert!(restarted.iter().any(|&s| s > 0), "{plan:?}");
                }
            }
            // Longer runs add random ones, still one episode at a time.
            let config = config(120, seed);
            let plan = FaultPlan::generate(&config).expect("a plan");
            replay(&plan, &config);
            assert!(plan.uncovered_points.is_empty(), "{plan:?}");
        }
    }

    fn failovers(plan: &FaultPlan) -> Vec<usize> {
        plan.actions
            .iter()
            .filter_map(|p| match p.action {
                Action::FailoverMemoryServer { server } => Some(server),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn failed_over_primaries_rejoin_and_server_0_fails_over_twice() {
        for seed in 0..50 {
            for (seconds, servers) in [(40, 1), (60, 2), (300, 3)] {
                let config = PlanConfig {
                    servers,
                    failover: true,
                    rejoin: true,
                    ..config(seconds, seed)
                };
                let plan = FaultPlan::generate(&config).expect("a plan");
                // Also: every failover is followed by the rejoin of that server before
                // anything else acts on it.
                replay(&plan, &config);
                let failed = failovers(&plan);
                assert!(
                    failed.iter().filter(|&&s| s == 0).count() >= 2,
                    "server 0 fails over twice: {plan:?}"
                );
                assert_eq!(plan.count("primary_rejoin"), failed.len(), "{plan:?}");
                for (i, p) in plan.actions.iter().enumerate() {
                    if let Action::FailoverMemoryServer { server } = p.action {
                        assert_eq!(
                            plan.actions[i + 1].action,
                            Action::RejoinAsBackup { server },
                            "{plan:?}"
                        );
                    }
                }
            }
        }
        // Without rejoins, nothing rejoins.
        let plan = FaultPlan::generate(&PlanConfig {
            failover: true,
            ..config(120, 1)
        })
        .unwrap();
        assert_eq!(plan.count("primary_rejoin"), 0);
    }

    #[test]
    fn replicated_servers_fail_over_once_each_with_server_0_first_guaranteed() {
        for seed in 0..50 {
            for (seconds, servers) in [(20, 1), (20, 2), (20, 3), (120, 2), (300, 3)] {
                let config = PlanConfig {
                    servers,
                    failover: true,
                    ..config(seconds, seed)
                };
                let plan = FaultPlan::generate(&config).expect("a plan");
                // Also: one episode at a time, nothing after a server's failover.
                replay(&plan, &config);
                assert!(server_restarts(&plan).is_empty(), "{plan:?}");
                assert_eq!(plan.count("server_kill"), 0, "{plan:?}");
                let mut failed = failovers(&plan);
                assert!(failed.contains(&0), "{plan:?}");
                // Server 0's backup is killed and restarted before its failover.
                let at = |name: &str| {
                    plan.actions
                        .iter()
                        .position(|p| p.action.name() == name && p.action.node() == 0)
                };
                let restarted = at("backup_restart").expect("server 0's backup restarted");
                assert!(restarted < at("server_failover").unwrap(), "{plan:?}");
                assert_eq!(plan.count("backup_kill"), plan.count("backup_restart"));
                if servers > 1 {
                    assert!(failed.iter().any(|&s| s > 0), "{plan:?}");
                }
                let all = failed.len();
                failed.sort_unstable();
                failed.dedup();
                assert_eq!(
                    failed.len(),
                    all,
                    "at most one failover per server: {plan:?}"
                );
                if seconds >= 120 {
                    // Long runs still get compute-node faults after the failovers.
                    let last = plan
                        .actions
                        .iter()
                        .rposition(|p| p.action.name() == "server_failover")
                        .unwrap();
                    assert!(last + 1 < plan.actions.len(), "{plan:?}");
                }
            }
        }
    }

    #[test]
    fn server_restarts_can_be_turned_off_and_short_runs_need_none() {
        for seed in 0..20 {
            let off = FaultPlan::generate(&PlanConfig {
                server_restarts: false,
                ..config(60, seed)
            })
            .unwrap();
            assert!(server_restarts(&off).is_empty(), "{off:?}");
            assert_eq!(off.count("server_kill"), 0);
            let short = config(12, seed);
            let plan = FaultPlan::generate(&short).unwrap();
            replay(&plan, &short);
        }
    }

    #[test]
    fn a_long_enough_run_arms_every_point_and_kills_and_pauses() {
        for seed in 0..50 {
            let config = config(40, seed);
            let plan = FaultPlan::generate(&config).expect("a plan");
            replay(&plan, &config);
            assert!(plan.uncovered_points.is_empty(), "{plan:?}");
            let mut armed: Vec<&str> = plan
                .actions
                .iter()
                .filter_map(|p| match &p.action {
                    Action::Crash { point, .. } => Some(point.as_str()),
                    _ => None,
                })
                .collect();
            armed.sort_unstable();
            armed.dedup();
            assert_eq!(armed, ["p1", "p2", "p3", "p4", "p5", "p6"]);
            assert!(plan.count("pause") >= 1 && plan.count("kill") > plan.count("crash"));
            assert!(plan.count("stall") >= 1, "{plan:?}");
            assert!(plan.full_coverage_ms <= 40_000, "{}", plan.full_coverage_ms);
            // A lone node has nobody to fence it: no stalls.
            let alone = PlanConfig { nodes: 1, ..config };
            let plan = FaultPlan::generate(&alone).expect("a plan");
            replay(&plan, &alone);
            assert_eq!(plan.count("stall"), 0, "{plan:?}");
        }
    }

    #[test]
    fn the_same_seed_gives_the_same_plan_and_another_seed_another() {
        let a = FaultPlan::generate(&config(30, 7)).unwrap();
        assert_eq!(a, FaultPlan::generate(&config(30, 7)).unwrap());
        assert_ne!(a, FaultPlan::generate(&config(30, 8)).unwrap());
    }

    #[test]
    fn a_short_run_says_which_points_it_leaves_out() {
        let config = config(6, 1);
        let plan = FaultPlan::generate(&config).expect("a plan");
        replay(&plan, &config);
        assert!(!plan.uncovered_points.is_empty());
        let armed = plan.count("crash");
        assert_eq!(armed + plan.uncovered_points.len(), 6, "{plan:?}");
        assert!(plan.full_coverage_ms > 6_000);
        let tiny = FaultPlan::generate(&PlanConfig {
            duration: Duration::from_millis(500),
            ..config
        })
        .expect("a plan");
        assert!(tiny.actions.is_empty());
        assert_eq!(tiny.uncovered_points.len(), 6);
    }

    #[test]
    fn bad_configurations_are_errors() {
        let err = FaultPlan::generate(&PlanConfig {
            nodes: 0,
            ..config(10, 0)
        })
        .unwrap_err();
        assert!(err.contains("at least one compute node"), "{err}");
        let err = FaultPlan::generate(&PlanConfig {
            lease_timeout: Duration::from_millis(2),
            ..config(10, 0)
        })
        .unwrap_err();
        assert!(err.contains("too short"), "{err}");
    }
}
