//! The transaction manager (TM): the timestamp service (local to the TM, as in the
//! paper's measured baseline) and the coordinator of two-phase commit.
//!
//! Per commit (Figure 5(a)): take a CID, send PREPARE to every involved RM before
//! reading any vote, then COMMIT (or ABORT) to those that voted yes, wait for their
//! acknowledgements, mark the CID complete, wait until every CID up to it is complete
//! (so that a transaction that begins after the reply sees the commit), and reply.
//! Each client connection has its own thread and its own connections to the RMs.

use super::protocol::{Conn, RmRequest, RmResponse, TmRequest, TmResponse, Write};
use super::resource_manager_of;
use super::server::Server;
use crate::system::{Error, Result};
use std::collections::BTreeSet;
use std::net::{SocketAddr, TcpListener};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How long the TM waits for an RM's answer before declaring it unreachable.
pub const RM_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a commit or a begin waits for earlier CIDs to complete.
pub const VISIBILITY_TIMEOUT: Duration = Duration::from_secs(30);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Commit timestamps and the read timestamp: the highest CID up to which every CID
/// handed out is complete (committed and installed on every RM, or aborted).
pub struct Timestamps {
    clock: Mutex<Clock>,
    advanced: Condvar,
}

struct Clock {
    last_taken: u64,
    visible: u64,
    /// Complete CIDs above `visible`.
    finished: BTreeSet<u64>,
}

/// A CID handed out; dropping it marks the CID complete, so no path (error or panic)
/// leaves a hole that would stop the read timestamp for good.
pub struct CidTicket<'a> {
    timestamps: &'a Timestamps,
    cid: u64,
}

impl CidTicket<'_> {
    pub fn cid(&self) -> u64 {
        self.cid
    }
}

impl Drop for CidTicket<'_> {
    fn drop(&mut self) {
        self.timestamps.finish(self.cid);
    }
}

impl Default for Timestamps {
    fn default() -> Self {
        Timestamps::new()
    }
}

impl Timestamps {
    pub fn new() -> Timestamps {
        Timestamps {
            clock: Mutex::new(Clock {
                last_taken: 0,
                visible: 0,
                finished: BTreeSet::new(),
            }),
            advanced: Condvar::new(),
        }
    }

    fn clock(&self) -> MutexGuard<'_, Clock> {
        // Every critical section leaves the clock consistent before it could panic.
        self.clock.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn take(&self) -> CidTicket<'_> {
        let mut clock = self.clock();
        clock.last_taken += 1;
        CidTicket {
            timestamps: self,
            cid: clock.last_taken,
        }
    }

    fn finish(&self, cid: u64) {
        let mut clock = self.clock();
        if cid != clock.visible + 1 {
            clock.finished.insert(cid);
            return;
        }
        clock.visible = cid;
        while clock.finished.first() == Some(&(clock.visible + 1)) {
            clock.finished.pop_first();
            clock.visible += 1;
        }
        drop(clock);
        self.advanced.notify_all();
    }

    /// The read timestamp now.
    pub fn visible(&self) -> u64 {
        self.clock().visible
    }

    /// Waits until every CID up to `cid` is complete, for at most `timeout`.
    pub fn wait_visible(&self, cid: u64, timeout: Duration) -> Result<u64, String> {
        let deadline = Instant::now() + timeout;
        let mut clock = self.clock();
        if cid > clock.last_taken {
            return Err(format!(
                "CID {cid} was never handed out (the last is {})",
                clock.last_taken
            ));
        }
        while clock.visible < cid {
            let now = Instant::now();
            if now >= deadline {
                return Err(format!(
                    "CID {cid} is not visible after {timeout:?}: CID {} is still in progress",
                    clock.visible + 1
                ));
            }
            clock = self
                .advanced
                .wait_timeout(clock, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        Ok(clock.visible)
    }
}

struct Shared {
    resource_managers: Vec<SocketAddr>,
    timestamps: Timestamps,
}

/// A transaction-manager server.
pub struct TransactionManager {
    server: Server,
    shared: Arc<Shared>,
}

impl TransactionManager {
    /// Listens on `addr` (port 0: any) and coordinates commits over
    /// `resource_managers`, whose order is the partition order. Each RM is dialled
    /// once first, so that a wrong address fails here.
    pub fn start(addr: SocketAddr, resource_managers: Vec<SocketAddr>) -> Result<Self> {
        if resource_managers.is_empty() {
            return Err(Error::System(
                "a transaction manager needs at least one resource manager".into(),
            ));
        }
        for (i, &rm) in resource_managers.iter().enumerate() {
            Conn::connect(rm, CONNECT_TIMEOUT, None).map_err(|e| {
                Error::System(format!("cannot reach resource manager {i} at {rm}: {e}"))
            })?;
        }
        let listener = TcpListener::bind(addr).map_err(|e| {
            Error::System(format!("transaction manager cannot listen on {addr}: {e}"))
        })?;
        let shared = Arc::new(Shared {
            resource_managers,
            timestamps: Timestamps::new(),
        });
        let served = shared.clone();
        let server = Server::start(listener, "twopc-tm", move |stream| {
            let mut coordinator = Coordinator::new(&served);
            super::protocol::serve_frames(stream, TmResponse::Failed, |request| {
                coordinator.handle(request)
            })
        })
        .map_err(|e| Error::System(format!("transaction manager cannot start: {e}")))?;
        Ok(TransactionManager { server, shared })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.server.local_addr()
    }

    /// The read timestamp a transaction beginning now gets.
    pub fn read_timestamp(&self) -> u64 {
        self.shared.timestamps.visible()
    }

    /// Closes the listener and every client connection.
    pub fn stop(self) {
        self.server.stop();
    }
}

/// One client connection's side of the TM, with its own RM connections.
struct Coordinator<'a> {
    shared: &'a Shared,
    rms: Vec<Option<Conn>>,
}

impl<'a> Coordinator<'a> {
    fn new(shared: &'a Shared) -> Self {
        Coordinator {
            shared,
            rms: shared.resource_managers.iter().map(|_| None).collect(),
        }
    }

    fn handle(&mut self, request: TmRequest) -> TmResponse {
        let timestamps = &self.shared.timestamps;
        match request {
            TmRequest::Topology => TmResponse::Topology {
                resource_managers: self
                    .shared
                    .resource_managers
                    .iter()
                    .map(|a| a.to_string())
                    .collect(),
            },
            TmRequest::Begin { after } => {
                match timestamps.wait_visible(after, VISIBILITY_TIMEOUT) {
                    Ok(rid) => TmResponse::Began { rid },
                    Err(e) => TmResponse::Failed(format!("cannot begin after CID {after}: {e}")),
                }
            }
            TmRequest::Commit { rid, writes } => self.commit(rid, writes),
        }
    }

    fn commit(&mut self, rid: u64, mut writes: Vec<Write>) -> TmResponse {
        let timestamps = &self.shared.timestamps;
        if writes.is_empty() {
            return TmResponse::Failed(
                "a commit without writes: read-only transactions need no commit".into(),
            );
        }
        let visible = timestamps.visible();
        if rid > visible {
            return TmResponse::Failed(format!(
                "read timestamp {rid} was never handed out (the highest is {visible})"
            ));
        }
        writes.sort_unstable_by_key(|w| (w.rel, w.key));
        if let Some(pair) = writes
            .windows(2)
            .find(|p| (p[0].rel, p[0].key) == (p[1].rel, p[1].key))
        {
            return TmResponse::Failed(format!(
                "the write set names {} key {} twice",
                pair[0].rel.name(),
                pair[0].key
            ));
        }
        let mut per_rm: Vec<Vec<Write>> = self.rms.iter().map(|_| Vec::new()).collect();
        for write in writes {
            per_rm[resource_manager_of(write.rel, write.key, self.rms.len())].push(write);
        }

        let ticket = timestamps.take();
        let cid = ticket.cid();
        // Phase one: every PREPARE goes out before any vote is read.
        let mut failure: Option<String> = None;
        let mut asked = Vec::new();
        for (rm, writes) in per_rm.into_iter().enumerate() {
            if writes.is_empty() {
                continue;
            }
            match self.send(rm, &RmRequest::Prepare { cid, rid, writes }) {
                Ok(()) => asked.push(rm),
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            }
        }
        let mut prepared = Vec::new();
        let mut refusal = None;
        for &rm in &asked {
            match self.recv(rm) {
                Ok(RmResponse::Prepared) => prepared.push(rm),
                Ok(RmResponse::Refused { reason, message }) => {
                    refusal.get_or_insert((reason, message));
                }
                Ok(other) => {
                    failure.get_or_insert(self.unexpected(rm, "PREPARE", other));
                }
                Err(e) => {
                    failure.get_or_insert(e);
                }
            }
        }
        let commit = refusal.is_none() && failure.is_none();
        // Phase two, to those that hold locks.
        let decision = if commit {
            RmRequest::Commit { cid }
        } else {
            RmRequest::Abort { cid }
        };
        let mut told = Vec::new();
        for &rm in &prepared {
            match self.send(rm, &decision) {
                Ok(()) => told.push(rm),
                Err(e) => {
                    failure.get_or_insert(e);
                }
            }
        }
        for &rm in &told {
            match self.recv(rm) {
                Ok(RmResponse::Done) => {}
                Ok(other) => {
                    failure.get_or_insert(self.unexpected(rm, "the decision", other));
                }
                Err(e) => {
                    failure.get_or_insert(e);
                }
            }
        }
        drop(ticket);

        match (failure, refusal) {
            (Some(failure), _) if commit => TmResponse::Failed(format!(
                "{failure}; transaction {cid} committed on the other resource managers"
            )),
            (Some(failure), _) => TmResponse::Failed(failure),
            (None, Some((reason, message))) => TmResponse::Refused { reason, message },
            (None, None) => match timestamps.wait_visible(cid, VISIBILITY_TIMEOUT) {
                Ok(_) => TmResponse::Committed { cid },
                Err(e) => TmResponse::Failed(format!("committed, but {e}")),
            },
        }
    }

    fn label(&self, rm: usize) -> String {
        format!(
            "resource manager {rm} at {}",
            self.shared.resource_managers[rm]
        )
    }

    fn unexpected(&self, rm: usize, what: &str, response: RmResponse) -> String {
        match response {
            RmResponse::Failed(message) => format!("{}: {message}", self.label(rm)),
            other => format!("{} answered {what} with {other:?}", self.label(rm)),
        }
    }

    /// Sends `request` to RM `rm`, dialling it first if its connection is gone. After
    /// a failure the connection's framing is unknown, so it is dropped.
    fn send(&mut self, rm: usize, request: &RmRequest) -> Result<(), String> {
        let mut conn = match self.rms[rm].take() {
            Some(conn) => conn,
            None => Conn::connect(
                self.shared.resource_managers[rm],
                CONNECT_TIMEOUT,
                Some(RM_TIMEOUT),
            )
            .map_err(|e| format!("{}: cannot connect: {e}", self.label(rm)))?,
        };
        conn.send(request)
            .map_err(|e| format!("{}: {e}", self.label(rm)))?;
        self.rms[rm] = Some(conn);
        Ok(())
    }

    fn recv(&mut self, rm: usize) -> Result<RmResponse, String> {
        let Some(mut conn) = self.rms[rm].take() else {
            return Err(format!("{}: connection lost", self.label(rm)));
        };
        let response = conn
            .recv()
            .map_err(|e| format!("{}: {e}", self.label(rm)))?;
        self.rms[rm] = Some(conn);
        Ok(response)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_read_timestamp_is_the_complete_prefix() {
        let ts = Timestamps::new();
        let one = ts.take();
        let two = ts.take();
        let three = ts.take();
        assert_eq!((one.cid(), two.cid(), three.cid()), (1, 2, 3));
        drop(two);
        assert_eq!(ts.visible(), 0);
        drop(three);
        assert_eq!(ts.visible(), 0);
        drop(one);
        assert_eq!(ts.visible(), 3);
        assert_eq!(ts.take().cid(), 4);
        assert_eq!(ts.visible(), 4);
    }

    #[test]
    fn waiting_ends_when_the_prefix_arrives_or_times_out() {
        let ts = Timestamps::new();
        let one = ts.take();
        let two = ts.take();
        drop(two);
        let err = ts.wait_visible(2, Duration::from_millis(20)).unwrap_err();
        assert!(err.contains("CID 1 is still in progress"), "{err}");
        assert!(
            ts.wait_visible(3, Duration::ZERO)
                .unwrap_err()
                .contains("never")
        );
        std::thread::scope(|s| {
            let waiter = s.spawn(|| ts.wait_visible(2, Duration::from_secs(10)));
            std::thread::sleep(Duration::from_millis(20));
            drop(one);
            assert_eq!(waiter.join().unwrap(), Ok(2));
        });
    }
}
