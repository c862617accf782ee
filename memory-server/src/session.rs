//! Sessions: what an authenticated peer holds, and the device objects that live with
//! it: queue pairs, and (remote verbs) completion queues and regions.
//!
//! A session is a lease. Every RPC the peer makes renews it; a peer that stops making
//! RPCs (it crashed, or lost the network) loses the session when the lease runs out,
//! and the server's objects for it are destroyed then, so a dead compute node does
//! not pin server resources. Objects are destroyed by dropping them: the device tears
//! a queue pair's connection down (the peer's requests then fail with a retry error)
//! and deregisters a region.

use fabric::{CompletionQueue, QueuePair, Region};
use rand::RngCore;
use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::net::SocketAddr;
use std::str::FromStr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

/// The metadata entry that carries the session id.
pub const SESSION_METADATA: &str = "namdb-session";

/// A random 128-bit session id, written as 32 lowercase hex digits.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct SessionId(pub [u8; 16]);

impl SessionId {
    pub(crate) fn random() -> SessionId {
        let mut b = [0u8; 16];
        rand::rng().fill_bytes(&mut b);
        SessionId(b)
    }
}

impl fmt::Display for SessionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hex::encode(self.0))
    }
}

/// Only a prefix: the id is a bearer credential and logs are not secret.
impl fmt::Debug for SessionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SessionId({}…)", &hex::encode(&self.0[..4]))
    }
}

impl FromStr for SessionId {
    type Err = String;
    fn from_str(s: &str) -> Result<SessionId, String> {
        let mut b = [0u8; 16];
        hex::decode_to_slice(s, &mut b).map_err(|_| "a session id is 32 hex digits".to_string())?;
        Ok(SessionId(b))
    }
}

struct SessionState {
    expires: Instant,
    ended: bool,
    /// Each queue pair with the ids of its send and receive completion queues.
    qps: HashMap<u32, (Arc<dyn QueuePair>, [u32; 2])>,
    /// By id, which only this session uses: ids are not the device's.
    cqs: HashMap<u32, Arc<dyn CompletionQueue>>,
    next_cq: u32,
    /// By lkey.
    regions: HashMap<u32, Held>,
    region_bytes: u64,
}

/// A region of a session, and its share of what the server lent if it was borrowed.
struct Held {
    region: Region,
    /// Declared after the region, so it is dropped after it: the ledger never counts
    /// memory as free while it is still registered.
    loan: Option<Loan>,
}

/// Bytes all sessions together hold in borrowed regions (BorrowRegion), against the
/// server's cap. The per-session limit alone let enough sessions take any amount of
/// the host's memory.
pub(crate) struct BorrowLedger {
    /// (bytes, regions) lent now.
    lent: Mutex<(u64, usize)>,
    max: u64,
}

impl BorrowLedger {
    pub fn new(max: u64) -> Arc<BorrowLedger> {
        Arc::new(BorrowLedger {
            lent: Mutex::new((0, 0)),
            max,
        })
    }

    fn lock(&self) -> MutexGuard<'_, (u64, usize)> {
        // Every update is a single statement, so a poisoned lock holds valid state.
        self.lent.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub fn max(&self) -> u64 {
        self.max
    }

    /// (bytes, regions) lent now.
    #[cfg(test)]
    pub fn lent(&self) -> (u64, usize) {
        *self.lock()
    }

    /// Reserves `len` bytes before they are allocated; the reservation ends when the
    /// loan is dropped (the region returned, its session ended, or the allocation
    /// failed).
    pub fn lend(self: &Arc<Self>, len: u64) -> Result<Loan, SessionError> {
        let mut lent = self.lock();
        match lent.0.checked_add(len) {
            Some(total) if total <= self.max => {
                *lent = (total, lent.1 + 1);
                Ok(Loan {
                    ledger: self.clone(),
                    len,
                })
            }
            _ => Err(SessionError::ServerBorrowCap {
                len,
                lent: lent.0,
                regions: lent.1,
                max: self.max,
            }),
        }
    }
}

/// `len` bytes the server lent a session; given back when dropped.
pub(crate) struct Loan {
    ledger: Arc<BorrowLedger>,
    len: u64,
}

impl Drop for Loan {
    fn drop(&mut self) {
        let mut lent = self.ledger.lock();
        *lent = (lent.0 - self.len, lent.1 - 1);
    }
}

/// What a session held when it ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Ended {
    pub queue_pairs: usize,
    /// Regions of any kind (borrowed, registered through remote verbs).
    pub regions: usize,
    pub region_bytes: u64,
    pub borrowed_bytes: u64,
}

impl Ended {
    /// Logs what session `id` of `peer` held as it ended, `how` ("session ended",
    /// "session lease expired"): for an expired one, what its peer (dead, most likely)
    /// kept from others until now, the figure to look at when memory ran short.
    pub fn log(&self, id: SessionId, peer: Option<SocketAddr>, how: &str) {
        tracing::info!(
            session = ?id,
            peer = ?peer,
            queue_pairs = self.queue_pairs,
            regions = self.regions,
            region_bytes = self.region_bytes,
            borrowed_bytes = self.borrowed_bytes,
            "{how}"
        );
    }
}

impl SessionState {
    fn region_fits(&self, len: u64, limits: &ObjectLimits) -> Result<(), SessionError> {
        if self.ended {
            return Err(SessionError::Ended);
        }
        if self.regions.len() >= limits.regions {
            return Err(SessionError::TooManyRegions(limits.regions));
        }
        match self.region_bytes.checked_add(len) {
            Some(total) if total <= limits.region_bytes => Ok(()),
            _ => Err(SessionError::TooManyBytes {
                len,
                max: limits.region_bytes,
            }),
        }
    }
}

/// How much one session may hold beyond its queue pairs.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ObjectLimits {
    pub cqs: usize,
    pub regions: usize,
    pub region_bytes: u64,
}

/// Why [`Session::return_borrowed`] refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ReturnError {
    /// The session holds no region with that rkey.
    NotHeld,
    /// It holds one, registered through remote verbs (its lkey), not borrowed.
    NotBorrowed { lkey: u32 },
}

/// Why [`Session::deregister_registered`] refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DeregisterError {
    /// The session holds no region with that lkey.
    NotHeld,
    /// It holds one, borrowed (BorrowRegion, its rkey), not registered through remote
    /// verbs.
    Borrowed { rkey: u32 },
}

/// One authenticated peer.
pub(crate) struct Session {
    pub id: SessionId,
    pub peer: Option<SocketAddr>,
    /// The compute-node incarnation it belongs to (0: none), which a fence names.
    pub incarnation: u64,
    state: Mutex<SessionState>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(crate) enum SessionError {
    #[error("the session has ended")]
    Ended,
    #[error("the session already has {0} queue pairs, the most one session may hold")]
    TooManyQps(usize),
    #[error("too many sessions ({0}); end unused ones or wait for their leases to run out")]
    TooManySessions(usize),
    #[error(
        "compute-node incarnation {0:#x} was fenced: it stopped renewing its oracle lease \
         and another node recovered its commits; open the database anew"
    )]
    Fenced(u64),
    #[error("the session already has {0} completion queues, the most one session may hold")]
    TooManyCqs(usize),
    #[error("the session already has {0} regions, the most one session may hold")]
    TooManyRegions(usize),
    #[error(
        "{len} more bytes would take the session's regions past {max} bytes, the most one session may register"
    )]
    TooManyBytes { len: u64, max: u64 },
    #[error("completion queue {cq} is in use by queue pair {qpn}; destroy the queue pair first")]
    CqInUse { cq: u32, qpn: u32 },
    #[error(
        "{len} more bytes would take what this memory server lends past {max} bytes, its \
         cap (memory-server --max-borrowed); sessions borrow {lent} bytes in {regions} \
         regions now"
    )]
    ServerBorrowCap {
        len: u64,
        lent: u64,
        regions: usize,
        max: u64,
    },
}

impl Session {
    fn lock(&self) -> MutexGuard<'_, SessionState> {
        // Every update is a single statement, so a poisoned lock holds valid state.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Keeps `qp`, whose completion queues are the session's `cqs` (send, receive),
    /// alive for as long as the session, unless the session has ended.
    pub fn add_qp(
        &self,
        qp: Arc<dyn QueuePair>,
        cqs: [u32; 2],
        max: usize,
    ) -> Result<(), SessionError> {
        let mut st = self.lock();
        if st.ended {
            return Err(SessionError::Ended);
        }
        if st.qps.len() >= max {
            return Err(SessionError::TooManyQps(max));
        }
        st.qps.insert(qp.endpoint().qpn, (qp, cqs));
        Ok(())
    }

    /// Destroys one of the session's queue pairs; false if it has no such one.
    pub fn remove_qp(&self, qpn: u32) -> bool {
        let qp = self.lock().qps.remove(&qpn);
        qp.is_some()
    }

    pub fn qp(&self, qpn: u32) -> Option<Arc<dyn QueuePair>> {
        self.lock().qps.get(&qpn).map(|(qp, _)| qp.clone())
    }

    /// Keeps `cq` for as long as the session and returns the id that names it.
    pub fn add_cq(&self, cq: Arc<dyn CompletionQueue>, max: usize) -> Result<u32, SessionError> {
        let mut st = self.lock();
        if st.ended {
            return Err(SessionError::Ended);
        }
        if st.cqs.len() >= max {
            return Err(SessionError::TooManyCqs(max));
        }
        st.next_cq += 1;
        let id = st.next_cq;
        st.cqs.insert(id, cq);
        Ok(id)
    }

    pub fn cq(&self, id: u32) -> Option<Arc<dyn CompletionQueue>> {
        self.lock().cqs.get(&id).cloned()
    }

    /// Forgets one of the session's completion queues; false if it has no such one.
    /// One a queue pair of the session still uses is refused, as verbs refuses it
    /// (EBUSY): its completions would have nowhere to go.
    pub fn remove_cq(&self, id: u32) -> Result<bool, SessionError> {
        let mut st = self.lock();
        if let Some((&qpn, _)) = st.qps.iter().find(|(_, (_, cqs))| cqs.contains(&id)) {
            return Err(SessionError::CqInUse { cq: id, qpn });
        }
        let cq = st.cqs.remove(&id);
        drop(st);
        Ok(cq.is_some())
    }

    /// Whether a region of `len` bytes would fit: checked before the memory is
    /// allocated, and again by [`Session::add_region`].
    pub fn region_fits(&self, len: u64, limits: &ObjectLimits) -> Result<(), SessionError> {
        self.lock().region_fits(len, limits)
    }

    /// Keeps `region` registered for as long as the session, with `loan` if the server
    /// lent it (BorrowRegion); a refused one is deregistered on return, and its loan
    /// given back.
    pub fn add_region(
        &self,
        region: Region,
        limits: &ObjectLimits,
        loan: Option<Loan>,
    ) -> Result<(), SessionError> {
        let mut st = self.lock();
        st.region_fits(region.len(), limits)?;
        st.region_bytes += region.len();
        st.regions.insert(region.lkey(), Held { region, loan });
        Ok(())
    }

    /// Deregisters the region with lkey `lkey` that the session registered through
    /// remote verbs (RegisterRegion). A borrowed one is refused and stays as it was: it
    /// carries a loan against the server's cap and goes back through ReturnRegion, the
    /// call its borrower pairs with BorrowRegion. Found, checked and removed under one
    /// lock, as in [`Session::return_borrowed`].
    pub fn deregister_registered(&self, lkey: u32) -> Result<(), DeregisterError> {
        self.remove_region(|st| {
            let held = st.regions.get(&lkey).ok_or(DeregisterError::NotHeld)?;
            match held.loan {
                Some(_) => Err(DeregisterError::Borrowed {
                    rkey: held.region.rkey(),
                }),
                None => Ok(lkey),
            }
        })
    }

    /// Gives back the region with rkey `rkey` that the server lent this session
    /// (BorrowRegion): deregisters it and ends its loan. A region the session holds
    /// another way (registered through remote verbs) is refused and stays as it was;
    /// found, checked and removed under one lock, so nothing can change it in between.
    pub fn return_borrowed(&self, rkey: u32) -> Result<(), ReturnError> {
        self.remove_region(|st| {
            let (&lkey, held) = st
                .regions
                .iter()
                .find(|(_, r)| r.region.rkey() == rkey)
                .ok_or(ReturnError::NotHeld)?;
            match held.loan {
                Some(_) => Ok(lkey),
                None => Err(ReturnError::NotBorrowed { lkey }),
            }
        })
    }

    /// Removes the region whose lkey `pick` chooses (or refuses) under the session's
    /// lock, so nothing changes it between the check and the removal, then deregisters
    /// it (ending its loan, if any) outside the lock: destroying an object may take the
    /// device's locks.
    fn remove_region<E>(
        &self,
        pick: impl FnOnce(&SessionState) -> Result<u32, E>,
    ) -> Result<(), E> {
        let held = {
            let mut st = self.lock();
            let lkey = pick(&st)?;
            let held = st.regions.remove(&lkey);
            if let Some(h) = &held {
                st.region_bytes -= h.region.len();
            }
            held
        };
        drop(held);
        Ok(())
    }

    pub fn qp_count(&self) -> usize {
        self.lock().qps.len()
    }

    pub fn region_bytes(&self) -> u64 {
        self.lock().region_bytes
    }

    /// Marks the session ended and destroys its objects; says what it held.
    fn end(&self) -> Ended {
        let (qps, cqs, regions, region_bytes) = {
            let mut st = self.lock();
            st.ended = true;
            (
                std::mem::take(&mut st.qps),
                std::mem::take(&mut st.cqs),
                std::mem::take(&mut st.regions),
                std::mem::take(&mut st.region_bytes),
            )
        };
        let ended = Ended {
            queue_pairs: qps.len(),
            regions: regions.len(),
            region_bytes,
            borrowed_bytes: regions
                .values()
                .filter_map(|r| r.loan.as_ref().map(|l| l.len))
                .sum(),
        };
        // Dropped outside the lock, queue pairs first (they may use the rest):
        // destroying an object may take the device's locks.
        drop(qps);
        drop(cqs);
        drop(regions);
        ended
    }
}

/// The live sessions of a server.
pub(crate) struct Sessions {
    map: Mutex<HashMap<SessionId, Arc<Session>>>,
    lease: Duration,
    max_sessions: usize,
    /// Fenced incarnations with the sessions their fences ended, oldest first, at
    /// most [`FENCED_REMEMBERED`]: refused from then on, and the ended sessions'
    /// holders learn why their session is gone.
    fenced: Mutex<VecDeque<(u64, Vec<SessionId>)>>,
}

/// How many fenced incarnations a server refuses: each open of a database draws a new
/// one, so only a fenced node's own late attempts come back with one.
pub(crate) const FENCED_REMEMBERED: usize = 4096;

impl Sessions {
    pub fn new(lease: Duration, max_sessions: usize) -> Sessions {
        Sessions {
            map: Mutex::new(HashMap::new()),
            lease,
            max_sessions,
            fenced: Mutex::new(VecDeque::new()),
        }
    }

    /// The incarnation of `id`, if a fence ended that session.
    pub fn fenced_session(&self, id: SessionId) -> Option<u64> {
        self.fenced()
            .iter()
            .find(|(_, ended)| ended.contains(&id))
            .map(|(incarnation, _)| *incarnation)
    }

    /// The incarnations this server refuses, oldest first (a primary tells its backup).
    pub fn fenced_incarnations(&self) -> Vec<u64> {
        self.fenced()
            .iter()
            .map(|(incarnation, _)| *incarnation)
            .collect()
    }

    fn fenced(&self) -> MutexGuard<'_, VecDeque<(u64, Vec<SessionId>)>> {
        self.fenced.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Ends every session of `incarnation` and refuses the incarnation's sessions from
    /// then on; says what each ended session held.
    pub fn fence(&self, incarnation: u64) -> Vec<(Arc<Session>, Ended)> {
        // Held across the removal (the same order as `open`), so no session of the
        // incarnation opens in between.
        let mut fenced = self.fenced();
        let sessions: Vec<Arc<Session>> = {
            let mut map = self.lock();
            let ids: Vec<SessionId> = map
                .values()
                .filter(|s| s.incarnation == incarnation)
                .map(|s| s.id)
                .collect();
            ids.iter().filter_map(|id| map.remove(id)).collect()
        };
        let ended = sessions.iter().map(|s| s.id);
        match fenced.iter_mut().find(|(i, _)| *i == incarnation) {
            Some((_, before)) => before.extend(ended),
            None => {
                if fenced.len() == FENCED_REMEMBERED {
                    fenced.pop_front();
                }
                fenced.push_back((incarnation, ended.collect()));
            }
        }
        drop(fenced);
        sessions
            .into_iter()
            .map(|s| {
                let held = s.end();
                (s, held)
            })
            .collect()
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<SessionId, Arc<Session>>> {
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn lease(&self) -> Duration {
        self.lease
    }

    /// A new session of compute-node `incarnation` (0: none), unless it was fenced.
    pub fn open(
        &self,
        peer: Option<SocketAddr>,
        now: Instant,
        incarnation: u64,
    ) -> Result<Arc<Session>, SessionError> {
        // Held across the insert, so a fence cannot run between the check and it.
        let fenced = self.fenced();
        if incarnation != 0 && fenced.iter().any(|(i, _)| *i == incarnation) {
            return Err(SessionError::Fenced(incarnation));
        }
        let mut map = self.lock();
        if map.len() >= self.max_sessions {
            return Err(SessionError::TooManySessions(self.max_sessions));
        }
        let session = Arc::new(Session {
            id: SessionId::random(),
            peer,
            incarnation,
            state: Mutex::new(SessionState {
                expires: now + self.lease,
                ended: false,
                qps: HashMap::new(),
                cqs: HashMap::new(),
                next_cq: 0,
                regions: HashMap::new(),
                region_bytes: 0,
            }),
        });
        map.insert(session.id, session.clone());
        Ok(session)
    }

    /// The live session `id`, its lease renewed. An expired session is ended here even
    /// if the reaper has not come by yet.
    pub fn touch(&self, id: SessionId, now: Instant) -> Option<Arc<Session>> {
        let session = self.lock().get(&id).cloned()?;
        let expired = {
            let mut st = session.lock();
            if st.expires <= now || st.ended {
                true
            } else {
                st.expires = now + self.lease;
                false
            }
        };
        if expired {
            self.end(id);
            return None;
        }
        Some(session)
    }

    /// Whether session `id` is open and its lease not run out. Renews nothing.
    pub fn is_live(&self, id: SessionId, now: Instant) -> bool {
        let Some(session) = self.lock().get(&id).cloned() else {
            return false;
        };
        let st = session.lock();
        !st.ended && st.expires > now
    }

    /// Ends a session; says what it held, or None if there was no such session.
    pub fn end(&self, id: SessionId) -> Option<Ended> {
        let session = self.lock().remove(&id)?;
        Some(session.end())
    }

    /// Ends every session whose lease has run out; says what each held.
    pub fn reap(&self, now: Instant) -> Vec<Ended> {
        let expired: Vec<Arc<Session>> = {
            let mut map = self.lock();
            let ids: Vec<SessionId> = map
                .iter()
                .filter(|(_, s)| s.lock().expires <= now)
                .map(|(id, _)| *id)
                .collect();
            ids.iter().filter_map(|id| map.remove(id)).collect()
        };
        expired
            .iter()
            .map(|s| {
                let held = s.end();
                held.log(s.id, s.peer, "session lease expired");
                held
            })
            .collect()
    }

    /// Ends every session (server shutdown); returns (sessions, queue pairs).
    pub fn end_all(&self) -> (usize, usize) {
        let all: Vec<Arc<Session>> = self.lock().drain().map(|(_, s)| s).collect();
        let qps = all.iter().map(|s| s.end().queue_pairs).sum();
        (all.len(), qps)
    }

    /// (sessions, queue pairs, bytes of session regions) now.
    pub fn counts(&self) -> (usize, usize, u64) {
        let map = self.lock();
        (
            map.len(),
            map.values().map(|s| s.qp_count()).sum(),
            map.values().map(|s| s.region_bytes()).sum(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fabric::sim::{SimConfig, SimNetwork};
    use fabric::{Device, QpConfig};

    fn qp(dev: &dyn Device) -> Arc<dyn QueuePair> {
        let cq = dev.create_cq(4).unwrap();
        dev.create_qp(&fabric::QpConfig::rc(&cq)).unwrap()
    }

    #[test]
    fn session_ids_round_trip_through_hex() {
        let id = SessionId::random();
        let text = id.to_string();
        assert_eq!(text.len(), 32);
        assert_eq!(text.parse::<SessionId>(), Ok(id));
        assert!("xyz".parse::<SessionId>().is_err());
        assert!(text[..30].parse::<SessionId>().is_err());
        assert!(
            !format!("{id:?}").contains(&text),
            "Debug shows only a prefix"
        );
    }

    #[test]
    fn leases_are_renewed_by_use_and_expire_without_it() {
        let sessions = Sessions::new(Duration::from_secs(10), 8);
        let t0 = Instant::now();
        let s = sessions.open(None, t0, 0).unwrap();
        let t1 = t0 + Duration::from_secs(8);
        assert!(sessions.touch(s.id, t1).is_some());
        // Renewed at t1, so still live at t0 + 15 s.
        assert!(sessions.touch(s.id, t0 + Duration::from_secs(15)).is_some());
        assert!(sessions.touch(s.id, t0 + Duration::from_secs(26)).is_none());
        assert_eq!(sessions.counts(), (0, 0, 0));
    }

    #[test]
    fn ending_a_session_destroys_its_queue_pairs() {
        let net = SimNetwork::new(SimConfig::default());
        let dev = net.add_node();
        let sessions = Sessions::new(Duration::from_secs(10), 8);
        let now = Instant::now();
        let s = sessions.open(None, now, 0).unwrap();
        let q = qp(&*dev);
        let weak = Arc::downgrade(&q);
        s.add_qp(q, [0, 0], 4).unwrap();
        s.add_qp(qp(&*dev), [0, 0], 4).unwrap();
        assert_eq!(sessions.counts(), (1, 2, 0));
        assert!(weak.upgrade().is_some());
        assert_eq!(sessions.end(s.id).map(|e| e.queue_pairs), Some(2));
        assert!(weak.upgrade().is_none(), "the queue pair was dropped");
        assert!(sessions.end(s.id).is_none());
        // A handler still holding the ended session cannot attach new queue pairs.
        assert_eq!(s.add_qp(qp(&*dev), [0, 0], 4), Err(SessionError::Ended));
    }

    #[test]
    fn a_fence_ends_every_session_of_its_incarnation_and_refuses_it_afterwards() {
        let net = SimNetwork::new(SimConfig::default());
        let dev = net.add_node();
        let sessions = Sessions::new(Duration::from_secs(10), 8);
        let now = Instant::now();
        let fenced: Vec<_> = (0..2)
            .map(|_| sessions.open(None, now, 7).unwrap())
            .collect();
        let other = sessions.open(None, now, 8).unwrap();
        let anonymous = sessions.open(None, now, 0).unwrap();
        let q = qp(&*dev);
        let fenced_qp = Arc::downgrade(&q);
        fenced[0].add_qp(q, [0, 0], 4).unwrap();
        fenced[1].add_qp(qp(&*dev), [0, 0], 4).unwrap();
        fenced[1].add_qp(qp(&*dev), [0, 0], 4).unwrap();
        other.add_qp(qp(&*dev), [0, 0], 4).unwrap();
        anonymous.add_qp(qp(&*dev), [0, 0], 4).unwrap();
        assert_eq!(sessions.counts(), (4, 5, 0));

        let ended = sessions.fence(7);
        let mut ids: Vec<_> = ended.iter().map(|(s, _)| s.id).collect();
        ids.sort_by_key(|id| id.0);
        let mut want: Vec<_> = fenced.iter().map(|s| s.id).collect();
        want.sort_by_key(|id| id.0);
        assert_eq!(ids, want);
        assert_eq!(ended.iter().map(|(_, e)| e.queue_pairs).sum::<usize>(), 3);
        assert_eq!(sessions.counts(), (2, 2, 0), "the other sessions stay");
        assert!(
            fenced_qp.upgrade().is_none(),
            "the queue pair was destroyed"
        );
        assert_eq!(sessions.fenced_session(fenced[1].id), Some(7));
        assert_eq!(sessions.fenced_session(other.id), None);
        assert_eq!(
            fenced[0].add_qp(qp(&*dev), [0, 0], 4),
            Err(SessionError::Ended)
        );
        assert!(matches!(
            sessions.open(None, now, 7),
            Err(SessionError::Fenced(7))
        ));
        assert!(sessions.open(None, now, 8).is_ok());
        assert!(sessions.open(None, now, 0).is_ok());
        // Again: nothing left to end, still refused.
        assert!(sessions.fence(7).is_empty());
        assert!(sessions.open(None, now, 7).is_err());
    }

    #[test]
    fn reaping_ends_only_expired_sessions() {
        let net = SimNetwork::new(SimConfig::default());
        let dev = net.add_node();
        let sessions = Sessions::new(Duration::from_secs(10), 8);
        let t0 = Instant::now();
        let old = sessions.open(None, t0, 0).unwrap();
        old.add_qp(qp(&*dev), [0, 0], 4).unwrap();
        let young = sessions.open(None, t0 + Duration::from_secs(5), 0).unwrap();
        let reaped = sessions.reap(t0 + Duration::from_secs(11));
        assert_eq!(reaped.len(), 1);
        assert_eq!(reaped[0].queue_pairs, 1);
        assert!(
            sessions
                .touch(young.id, t0 + Duration::from_secs(12))
                .is_some()
        );
        assert!(
            sessions
                .touch(old.id, t0 + Duration::from_secs(12))
                .is_none()
        );
    }

    #[test]
    fn completion_queues_and_regions_are_bounded_and_end_with_the_session() {
        let dev = SimNetwork::new(SimConfig::default()).add_node();
        let sessions = Sessions::new(Duration::from_secs(10), 8);
        let s = sessions.open(None, Instant::now(), 0).unwrap();
        let limits = ObjectLimits {
            cqs: 1,
            regions: 2,
            region_bytes: 64,
        };
        let id = s.add_cq(dev.create_cq(4).unwrap(), limits.cqs).unwrap();
        assert!(s.cq(id).is_some());
        assert_eq!(
            s.add_cq(dev.create_cq(4).unwrap(), limits.cqs).err(),
            Some(SessionError::TooManyCqs(1))
        );
        // A queue pair using it keeps it until the queue pair goes.
        let q = dev.create_qp(&QpConfig::rc(&s.cq(id).unwrap())).unwrap();
        let qpn = q.endpoint().qpn;
        s.add_qp(q, [id, id], 4).unwrap();
        assert_eq!(s.remove_cq(id), Err(SessionError::CqInUse { cq: id, qpn }));
        assert!(s.cq(id).is_some());
        assert!(s.remove_qp(qpn));
        assert_eq!(s.remove_cq(id), Ok(true));
        assert_eq!(s.remove_cq(id), Ok(false));
        assert_ne!(
            s.add_cq(dev.create_cq(4).unwrap(), 1),
            Ok(id),
            "ids are not reused"
        );

        let region = dev.register(48, fabric::Access::ALL).unwrap();
        let (lkey, weak) = (region.lkey(), Arc::downgrade(region.memory()));
        s.add_region(region, &limits, None).unwrap();
        assert_eq!(
            s.region_fits(24, &limits),
            Err(SessionError::TooManyBytes { len: 24, max: 64 })
        );
        s.region_fits(16, &limits).unwrap();
        assert_eq!(s.deregister_registered(lkey), Ok(()));
        assert_eq!(s.deregister_registered(lkey), Err(DeregisterError::NotHeld));
        s.region_fits(64, &limits).unwrap();
        for _ in 0..2 {
            s.add_region(dev.register(8, fabric::Access::ALL).unwrap(), &limits, None)
                .unwrap();
        }
        assert_eq!(
            s.region_fits(8, &limits),
            Err(SessionError::TooManyRegions(2))
        );
        assert!(weak.upgrade().is_none(), "the removed region was freed");

        let kept = dev.register(8, fabric::Access::ALL).unwrap();
        let weak = Arc::downgrade(kept.memory());
        sessions.end(s.id);
        assert_eq!(s.region_fits(0, &limits), Err(SessionError::Ended));
        assert_eq!(s.add_region(kept, &limits, None), Err(SessionError::Ended));
        assert!(weak.upgrade().is_none(), "a refused region is freed");
    }

    #[test]
    fn limits_are_enforced() {
        let net = SimNetwork::new(SimConfig::default());
        let dev = net.add_node();
        let sessions = Sessions::new(Duration::from_secs(10), 2);
        let now = Instant::now();
        let s = sessions.open(None, now, 0).unwrap();
        sessions.open(None, now, 0).unwrap();
        assert!(matches!(
            sessions.open(None, now, 0),
            Err(SessionError::TooManySessions(2))
        ));
        s.add_qp(qp(&*dev), [0, 0], 1).unwrap();
        assert_eq!(
            s.add_qp(qp(&*dev), [0, 0], 1),
            Err(SessionError::TooManyQps(1))
        );
        let qpn = s.lock().qps.keys().copied().next().unwrap();
        assert!(s.remove_qp(qpn));
        assert!(!s.remove_qp(qpn));
        assert_eq!(sessions.end_all(), (2, 0));
    }

    /// The cap is on all sessions together: two sessions each within their own limit
    /// are refused past it, and whatever gives a region back (returning it, the
    /// session's end, an allocation that failed) gives its bytes back to the ledger.
    #[test]
    fn borrowed_bytes_are_capped_across_sessions() {
        let dev = SimNetwork::new(SimConfig::default()).add_node();
        let sessions = Sessions::new(Duration::from_secs(10), 8);
        let ledger = BorrowLedger::new(64);
        let limits = ObjectLimits {
            cqs: 1,
            regions: 8,
            region_bytes: 64,
        };
        let now = Instant::now();
        let (a, b) = (
            sessions.open(None, now, 0).unwrap(),
            sessions.open(None, now, 0).unwrap(),
        );
        let borrow = |s: &Session, len: u64| -> Result<(u32, u32), SessionError> {
            let loan = ledger.lend(len)?;
            let region = dev.register(len, fabric::Access::ALL).unwrap();
            let keys = (region.lkey(), region.rkey());
            s.add_region(region, &limits, Some(loan))?;
            Ok(keys)
        };
        let first = borrow(&a, 32).unwrap();
        borrow(&b, 24).unwrap();
        assert_eq!(ledger.lent(), (56, 2));
        let refused = borrow(&b, 16).unwrap_err();
        assert_eq!(
            refused,
            SessionError::ServerBorrowCap {
                len: 16,
                lent: 56,
                regions: 2,
                max: 64
            }
        );
        let said = refused.to_string();
        assert!(
            said.contains("past 64 bytes") && said.contains("--max-borrowed"),
            "{said}"
        );
        // A loan that never became a region (the allocation failed) is given back.
        drop(ledger.lend(8).unwrap());
        assert_eq!(ledger.lent(), (56, 2));

        // Deregistering is for regions registered through remote verbs: a borrowed one
        // is refused and keeps its loan.
        assert_eq!(
            a.deregister_registered(first.0),
            Err(DeregisterError::Borrowed { rkey: first.1 })
        );
        assert_eq!(ledger.lent(), (56, 2));
        assert_eq!(a.return_borrowed(first.1), Ok(()));
        assert_eq!(ledger.lent(), (24, 1));
        borrow(&a, 40).unwrap();
        // Regions registered through remote verbs are the session's, not lent.
        a.add_region(
            dev.register(16, fabric::Access::ALL).unwrap(),
            &limits,
            None,
        )
        .unwrap();
        assert_eq!(ledger.lent(), (64, 2));
        let held = sessions.end(a.id).unwrap();
        assert_eq!(
            held,
            Ended {
                queue_pairs: 0,
                regions: 2,
                region_bytes: 56,
                borrowed_bytes: 40
            }
        );
        assert_eq!(ledger.lent(), (24, 1));
        // A loan refused by the session (ended) is given back too.
        assert!(borrow(&a, 8).is_err());
        assert_eq!(ledger.lent(), (24, 1));
    }

    /// A reaped session says what it held, so the log line of a dead borrower shows
    /// the space it kept until then.
    #[test]
    fn a_reaped_session_says_what_it_held() {
        let dev = SimNetwork::new(SimConfig::default()).add_node();
        let sessions = Sessions::new(Duration::from_secs(10), 8);
        let ledger = BorrowLedger::new(1 << 20);
        let limits = ObjectLimits {
            cqs: 1,
            regions: 8,
            region_bytes: 1 << 20,
        };
        let t0 = Instant::now();
        let s = sessions.open(None, t0, 0).unwrap();
        let loan = ledger.lend(4096).unwrap();
        s.add_region(
            dev.register(4096, fabric::Access::ALL).unwrap(),
            &limits,
            Some(loan),
        )
        .unwrap();
        s.add_qp(qp(&*dev), [0, 0], 4).unwrap();
        assert_eq!(
            sessions.reap(t0 + Duration::from_secs(11)),
            vec![Ended {
                queue_pairs: 1,
                regions: 1,
                region_bytes: 4096,
                borrowed_bytes: 4096
            }]
        );
        assert_eq!(ledger.lent(), (0, 0));
    }
}
