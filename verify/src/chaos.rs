//! The chaos harness's library half: the fault plan, the sessions a chaos node runs
//! and the events it writes, the checks over what every node recorded, and the report.
//! `namdb chaos` runs the processes (memory servers, compute nodes) and carries the plan
//! out; everything here is independent of processes and testable on its own.
//!
//! - [`plan`]: a seeded list of timed kills, armed crash points and pauses.
//! - [`session`]: sessions that run until stopped and write every transaction before
//!   (`pending`) and after (`done`) its commit, so a transaction cut short by a kill is
//!   `unknown` in the history rather than missing; the shared list-append workload.
//! - [`events`]: the node event files and their merge into one history.
//! - [`checks`]: snapshot isolation (Elle, black-box), the bank invariant, acknowledged
//!   appends surviving atomically, no lock left.
//! - [`report`]: recovery times, the throughput timeline and its dips, the verdicts.

pub mod checks;
pub mod events;
pub mod plan;
pub mod report;
pub mod session;
