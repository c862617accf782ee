//! The baseline of the paper's §4.1: traditional snapshot isolation with two-phase
//! commit on a shared-nothing cluster over TCP (Figure 5(a)), as a [`System`] named
//! `2pc`.
//!
//! - Resource managers ([`resource_manager`]) each own the rows whose `(relation,
//!   key)` hashes to them ([`resource_manager_of`]): a few committed versions per row,
//!   and row locks for prepared transactions.
//! - The transaction manager ([`transaction_manager`]) holds the timestamp service
//!   (local to it, as in the paper's measurements) and coordinates the two phases.
//! - Clients ([`client`]) begin at the TM, read straight from the RMs at their read
//!   timestamp, buffer writes and send the write set to the TM to commit.
//!
//! [`TwoPc::start`] brings a cluster up, as child processes of the `namdb` binary
//! (`namdb twopc resource-manager|transaction-manager`) or as threads of this one;
//! `namdb tpcw --system 2pc` runs the benchmark on it.
//! Messages per committing transaction touching `n` RMs: begin (2), reads (2 per RM
//! read from, batched by [`Session::get_many`](crate::system::Session::get_many)),
//! commit request and reply (2), PREPARE and vote (2n), COMMIT and acknowledgement (2n).

pub mod client;
pub mod launch;
pub mod protocol;
pub mod resource_manager;
pub mod server;
pub mod transaction_manager;

#[cfg(test)]
mod tests;

use crate::schema::{Rel, Scale};
use crate::system::{Error, Result, System};
use client::Client;
use launch::ChildProcess;
use resource_manager::ResourceManager;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard};
use transaction_manager::TransactionManager;

/// RMs in the paper's set-up (three storage servers).
pub const DEFAULT_RESOURCE_MANAGERS: usize = 3;
/// Loader threads: the loader's calls block on the network, so more threads than
/// cores keep the servers busy.
const LOADER_THREADS: usize = 4;
/// Generated ids per loader transaction (an order id brings about five rows).
const LOADER_BATCH: u64 = 32;

/// What an RM's store takes per row beyond the row's bytes: the hash table's entry at
/// its load factor (and the old table while it grows), the row's version vector and
/// the allocations behind them. Measured: `--ebs 100 --items 1000` loads 2.18 M rows of
/// 330 MB into RMs of 1.21 GB resident in all.
const STORE_BYTES_PER_ROW: u64 = 400;

/// The memory the RMs take, in all, once `scale`'s population is loaded (a run's
/// inserts come on top; the runner watches those).
pub fn loaded_bytes(scale: &Scale) -> u64 {
    let population = crate::load::population(scale);
    population
        .bytes
        .saturating_add(population.rows.saturating_mul(STORE_BYTES_PER_ROW))
}

/// Where the servers run.
#[derive(Clone, Debug)]
pub enum Launch {
    /// Child processes of `exe`, the `namdb` binary.
    Processes { exe: PathBuf },
    /// Threads of this process, running the same server code (for tests).
    Threads,
}

/// A running 2PC cluster: one TM and its RMs on 127.0.0.1. Dropping it stops them.
pub struct TwoPc {
    transaction_manager: SocketAddr,
    resource_managers: Vec<SocketAddr>,
    servers: Servers,
}

enum Servers {
    Processes {
        transaction_manager: Mutex<ChildProcess>,
        resource_managers: Vec<Mutex<ChildProcess>>,
    },
    Threads {
        // Declared first: dropped (stopped) before the RMs it talks to.
        transaction_manager: Mutex<Option<TransactionManager>>,
        resource_managers: Vec<Mutex<Option<ResourceManager>>>,
    },
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl TwoPc {
    /// Starts `resource_managers` RMs and a TM over them.
    pub fn start(launch: Launch, resource_managers: usize) -> Result<TwoPc> {
        if resource_managers == 0 {
            return Err(Error::System(
                "2pc needs at least one resource manager".into(),
            ));
        }
        let any_port = SocketAddr::from((Ipv4Addr::LOCALHOST, 0));
        match launch {
            Launch::Threads => {
                let rms = (0..resource_managers)
                    .map(|i| {
                        ResourceManager::start(any_port).map_err(|e| {
                            Error::System(format!("cannot start resource manager {i}: {e}"))
                        })
                    })
                    .collect::<Result<Vec<_>>>()?;
                let rm_addrs: Vec<SocketAddr> = rms.iter().map(|rm| rm.local_addr()).collect();
                let tm = TransactionManager::start(any_port, rm_addrs.clone())?;
                Ok(TwoPc {
                    transaction_manager: tm.local_addr(),
                    resource_managers: rm_addrs,
                    servers: Servers::Threads {
                        transaction_manager: Mutex::new(Some(tm)),
                        resource_managers: rms.into_iter().map(|rm| Mutex::new(Some(rm))).collect(),
                    },
                })
            }
            Launch::Processes { exe } => {
                let server_args = |role: &str| {
                    vec![
                        "twopc".to_string(),
                        role.to_string(),
                        "--listen".to_string(),
                        any_port.to_string(),
                        "--exit-on-stdin-close".to_string(),
                    ]
                };
                // All RMs start together; then each is waited for.
                let mut rms = (0..resource_managers)
                    .map(|i| {
                        ChildProcess::spawn(
                            &exe,
                            &server_args("resource-manager"),
                            format!("resource manager {i}"),
                        )
                    })
                    .collect::<Result<Vec<_>>>()?;
                let rm_addrs = rms
                    .iter_mut()
                    .map(ChildProcess::wait_listening)
                    .collect::<Result<Vec<_>>>()?;
                let mut tm_args = server_args("transaction-manager");
                tm_args.push("--resource-managers".into());
                tm_args.push(
                    rm_addrs
                        .iter()
                        .map(|a| a.to_string())
                        .collect::<Vec<_>>()
                        .join(","),
                );
                let mut tm =
                    ChildProcess::spawn(&exe, &tm_args, "transaction manager".to_string())?;
                let tm_addr = tm.wait_listening()?;
                Ok(TwoPc {
                    transaction_manager: tm_addr,
                    resource_managers: rm_addrs,
                    servers: Servers::Processes {
                        transaction_manager: Mutex::new(tm),
                        resource_managers: rms.into_iter().map(Mutex::new).collect(),
                    },
                })
            }
        }
    }

    pub fn transaction_manager(&self) -> SocketAddr {
        self.transaction_manager
    }

    /// The RMs' addresses, in partition order.
    pub fn resource_managers(&self) -> &[SocketAddr] {
        &self.resource_managers
    }

    /// A client connected to the TM and every RM.
    pub fn client(&self) -> Result<Client> {
        Client::connect(self.transaction_manager).map_err(|e| match self.deaths() {
            deaths if deaths.is_empty() => e,
            deaths => Error::System(format!("{e} ({})", deaths.join("; "))),
        })
    }

    /// Fault injection: RM `index` dies at once (SIGKILL, or its server stops with
    /// every connection), as a crashed partition server would.
    pub fn kill_resource_manager(&self, index: usize) -> Result<()> {
        let missing = || Error::System(format!("there is no resource manager {index}"));
        match &self.servers {
            Servers::Processes {
                resource_managers, ..
            } => lock(resource_managers.get(index).ok_or_else(missing)?).kill(),
            Servers::Threads {
                resource_managers, ..
            } => {
                if let Some(rm) = lock(resource_managers.get(index).ok_or_else(missing)?).take() {
                    rm.stop();
                }
            }
        }
        Ok(())
    }

    /// Fault injection: the TM dies at once, like [`TwoPc::kill_resource_manager`].
    pub fn kill_transaction_manager(&self) {
        match &self.servers {
            Servers::Processes {
                transaction_manager,
                ..
            } => lock(transaction_manager).kill(),
            Servers::Threads {
                transaction_manager,
                ..
            } => {
                if let Some(tm) = lock(transaction_manager).take() {
                    tm.stop();
                }
            }
        }
    }

    /// How the server processes that exited ended (none for threads).
    fn deaths(&self) -> Vec<String> {
        match &self.servers {
            Servers::Processes {
                transaction_manager,
                resource_managers,
            } => std::iter::once(transaction_manager)
                .chain(resource_managers)
                .filter_map(|p| lock(p).death())
                .collect(),
            Servers::Threads { .. } => Vec::new(),
        }
    }
}

impl System for TwoPc {
    type Engine = Client;

    fn name(&self) -> &'static str {
        "2pc"
    }

    fn backend(&self) -> String {
        "tcp".into()
    }

    fn engine(&self, _thread: usize) -> Result<Client> {
        self.client()
    }

    fn max_clients_per_thread(&self) -> usize {
        1
    }

    fn load(&self, scale: &Scale, progress: &(dyn Fn(Rel, u64, u64) + Sync)) -> Result<()> {
        crate::load::load_through_transactions(self, scale, LOADER_THREADS, LOADER_BATCH, progress)
    }
}

/// A well-mixed hash of a row's identity (splitmix64's finalizer), the same in every
/// process: it places rows on RMs and, within an RM, in shards.
pub fn key_hash(rel: Rel, key: u64) -> u64 {
    let mut z = key.wrapping_add((rel.index() as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The RM (of `partitions`) that owns `key` of `rel`.
pub fn resource_manager_of(rel: Rel, key: u64, partitions: usize) -> usize {
    (key_hash(rel, key) % partitions as u64) as usize
}
