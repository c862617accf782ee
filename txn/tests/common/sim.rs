//! Durable memory servers in process: each server is a sim node whose persist service
//! copies the ranges it is asked for into a shadow image (the contract of the memory
//! server's `--data-dir`: what the last persist covering a byte saw, zero if none). A
//! restart is a new sim node whose regions hold only the shadow: everything not
//! persisted is lost.

use fabric::sim::{SimConfig, SimNetwork};
use fabric::{Access, CompletionQueue, Device, QpConfig, QueuePair, Region};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use txn::catalog::CATALOG_BYTES;
use txn::{
    Database, DeviceFactory, MemoryServerLink, Options, PersistRange, PersistStatus, Persistence,
    ServerRegions,
};

pub const DATA_BYTES: u64 = 16 << 20;

/// What a durable server keeps: per region (catalog, data), the persisted bytes.
#[derive(Default)]
pub struct Disk {
    pub images: Mutex<[Vec<u8>; 2]>,
    pub boots: AtomicU64,
    /// A failing disk: every persist fails.
    pub failing: AtomicBool,
    /// A replicated primary whose backup is away: every persist is refused for now
    /// ([`PersistStatus::Later`]).
    pub refusing: AtomicBool,
    /// A slow disk: a persist is done this many milliseconds after it was submitted.
    pub slow_ms: AtomicU64,
}

/// One start of a durable server: a sim node with its regions.
pub struct Server {
    device: Arc<dyn Device>,
    regions: [Region; 2],
    disk: Arc<Disk>,
    boot: u64,
    qps: Mutex<Vec<Arc<dyn QueuePair>>>,
    pending: Mutex<HashMap<u64, Vec<PersistRange>>>,
    failed: Mutex<Vec<u64>>,
    refused: Mutex<Vec<u64>>,
    next_ticket: AtomicU64,
    /// When each persist of a slow disk may finish.
    due: Mutex<HashMap<u64, std::time::Instant>>,
}

impl Server {
    /// Starts a server on `net` with what `disk` kept.
    pub fn start(net: &SimNetwork, disk: &Arc<Disk>) -> Arc<Server> {
        let device: Arc<dyn Device> = net.add_node();
        let catalog = device.register(CATALOG_BYTES, Access::ALL).unwrap();
        let data = device.register(DATA_BYTES, Access::ALL).unwrap();
        {
            let mut images = disk.images.lock().unwrap();
            for (region, image) in [&catalog, &data].into_iter().zip(images.iter_mut()) {
                image.resize(region.len() as usize, 0);
                region.write(0, image).unwrap();
            }
        }
        let boot = disk.boots.fetch_add(1, Ordering::SeqCst) + 1;
        Arc::new(Server {
            device,
            regions: [catalog, data],
            disk: disk.clone(),
            boot,
            qps: Mutex::new(Vec::new()),
            pending: Mutex::new(HashMap::new()),
            failed: Mutex::new(Vec::new()),
            refused: Mutex::new(Vec::new()),
            next_ticket: AtomicU64::new(1),
            due: Mutex::new(HashMap::new()),
        })
    }

    pub fn server_regions(&self) -> ServerRegions {
        ServerRegions {
            catalog: self.regions[0].remote(),
            data: vec![self.regions[1].remote()],
        }
    }

    /// Copies `ranges` to the disk if every guarded one reads unlocked; else nothing.
    fn try_persist(&self, ranges: &[PersistRange]) -> bool {
        let mut copies = Vec::new();
        for r in ranges {
            let which = self
                .regions
                .iter()
                .position(|g| g.remote().rkey == r.addr.rkey)
                .expect("a range of this server");
            let bytes = self.regions[which]
                .to_vec(r.addr.offset, r.len as usize)
                .unwrap();
            if r.guarded && bytes[7] & 0x80 != 0 {
                return false;
            }
            copies.push((which, r.addr.offset as usize, bytes));
        }
        let mut images = self.disk.images.lock().unwrap();
        for (which, at, bytes) in copies {
            images[which][at..at + bytes.len()].copy_from_slice(&bytes);
        }
        true
    }
}

impl Persistence for Server {
    fn submit(&self, ranges: &[PersistRange]) -> u64 {
        let ticket = self.next_ticket.fetch_add(1, Ordering::SeqCst);
        let slow = Duration::from_millis(self.disk.slow_ms.load(Ordering::SeqCst));
        if !slow.is_zero() {
            let due = std::time::Instant::now() + slow;
            self.due.lock().unwrap().insert(ticket, due);
        }
        if self.disk.failing.load(Ordering::SeqCst) {
            self.failed.lock().unwrap().push(ticket);
        } else if self.disk.refusing.load(Ordering::SeqCst) {
            self.refused.lock().unwrap().push(ticket);
        } else if !self.try_persist(ranges) {
            self.pending.lock().unwrap().insert(ticket, ranges.to_vec());
        }
        ticket
    }

    fn poll(&self, ticket: u64) -> PersistStatus {
        if self.failed.lock().unwrap().contains(&ticket) {
            return PersistStatus::Failed("the disk failed".into());
        }
        if self.refused.lock().unwrap().contains(&ticket) {
            return PersistStatus::Later("the backup is away".into());
        }
        if let Some(due) = self.due.lock().unwrap().get(&ticket)
            && std::time::Instant::now() < *due
        {
            return PersistStatus::Pending;
        }
        let mut pending = self.pending.lock().unwrap();
        match pending.get(&ticket) {
            None => PersistStatus::Done,
            Some(ranges) if self.try_persist(ranges) => {
                pending.remove(&ticket);
                PersistStatus::Done
            }
            Some(_) => PersistStatus::Pending,
        }
    }
}

pub struct Link(pub Arc<Server>);

impl MemoryServerLink for Link {
    fn connect(
        &self,
        local: &Arc<dyn Device>,
        cq: &Arc<dyn CompletionQueue>,
        send_queue: u32,
    ) -> txn::Result<Arc<dyn QueuePair>> {
        let server = &self.0;
        let scq = server.device.create_cq(16)?;
        let (sqp, qp) =
            fabric::connect_rc_with((server.device.as_ref(), &scq), (local.as_ref(), cq), |c| {
                QpConfig {
                    max_send_wr: send_queue,
                    ..c
                }
            })?;
        server.qps.lock().unwrap().push(sqp);
        Ok(qp)
    }

    fn persistence(&self) -> Option<Arc<dyn Persistence>> {
        Some(self.0.clone())
    }

    fn boot(&self) -> u64 {
        self.0.boot
    }
}

pub struct Cluster {
    pub net: SimNetwork,
    pub disks: Vec<Arc<Disk>>,
    pub servers: Vec<Arc<Server>>,
}

impl Cluster {
    pub fn new(n: usize) -> Cluster {
        let net = SimNetwork::new(SimConfig::default());
        let disks: Vec<Arc<Disk>> = (0..n).map(|_| Arc::new(Disk::default())).collect();
        let servers = disks.iter().map(|d| Server::start(&net, d)).collect();
        Cluster {
            net,
            disks,
            servers,
        }
    }

    /// Restarts servers `which`: they come back with only what was persisted.
    pub fn restart(&mut self, which: &[usize]) {
        for &s in which {
            self.servers[s] = Server::start(&self.net, &self.disks[s]);
        }
    }

    pub fn open(&self) -> Database {
        self.open_with(Options::default())
    }

    /// [`Cluster::open`] with `options` for what it does not set itself.
    pub fn open_with(&self, options: Options) -> Database {
        let net = self.net.clone();
        let devices: DeviceFactory = Arc::new(move || Ok(net.add_node() as Arc<dyn Device>));
        let links = self
            .servers
            .iter()
            .map(|s| {
                (
                    Arc::new(Link(s.clone())) as Arc<dyn MemoryServerLink>,
                    s.server_regions(),
                )
            })
            .collect();
        Database::open(
            links,
            devices,
            Options {
                servers: self.servers.len(),
                oracle: super::short_leases(),
                wait_visible: false,
                ..options
            },
        )
        .unwrap()
    }
}

/// A table of accounts (4 versions, 16-byte values, 1024 records, 64 buckets of 8).
pub fn accounts(db: &Database) -> Arc<txn::Table> {
    db.create_table(txn::TableSpec {
        name: "accounts".into(),
        versions: 4,
        value_cap: 16,
        capacity: 1024,
        partitions: 0,
        placement: txn::Placement::RoundRobin,
        index: txn::index::IndexShape {
            buckets: 64,
            slots: 8,
        },
    })
    .unwrap()
}
