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
use std::collections::HashMap;
use std::fmt;
use std::net::SocketAddr;
use std::str::FromStr;
use std::sync::{Arc, Mutex, MutexGuard};
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
    regions: HashMap<u32, Region>,
    region_bytes: u64,
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

/// One authenticated peer.
pub(crate) struct Session {
    pub id: SessionId,
    pub peer: Option<SocketAddr>,
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

    /// Keeps `region` registered for as long as the session; a refused one is
    /// deregistered on return.
    pub fn add_region(&self, region: Region, limits: &ObjectLimits) -> Result<(), SessionError> {
        let mut st = self.lock();
        st.region_fits(region.len(), limits)?;
        st.region_bytes += region.len();
        st.regions.insert(region.lkey(), region);
        Ok(())
    }

    /// Deregisters one of the session's regions; false if it has no such one.
    pub fn remove_region(&self, lkey: u32) -> bool {
        let region = {
            let mut st = self.lock();
            let region = st.regions.remove(&lkey);
            if let Some(r) = &region {
                st.region_bytes -= r.len();
            }
            region
        };
        region.is_some()
    }

    /// Deregisters the session's region whose rkey is `rkey`; false if it has none.
    pub fn remove_region_by_rkey(&self, rkey: u32) -> bool {
        let lkey = self
            .lock()
            .regions
            .values()
            .find(|r| r.rkey() == rkey)
            .map(Region::lkey);
        lkey.is_some_and(|lkey| self.remove_region(lkey))
    }

    pub fn qp_count(&self) -> usize {
        self.lock().qps.len()
    }

    pub fn region_bytes(&self) -> u64 {
        self.lock().region_bytes
    }

    /// Marks the session ended and destroys its objects; returns how many queue pairs.
    fn end(&self) -> usize {
        let (qps, cqs, regions) = {
            let mut st = self.lock();
            st.ended = true;
            st.region_bytes = 0;
            (
                std::mem::take(&mut st.qps),
                std::mem::take(&mut st.cqs),
                std::mem::take(&mut st.regions),
            )
        };
        // Dropped outside the lock, queue pairs first (they may use the rest):
        // destroying an object may take the device's locks.
        let n = qps.len();
        drop(qps);
        drop(cqs);
        drop(regions);
        n
    }
}

/// The live sessions of a server.
pub(crate) struct Sessions {
    map: Mutex<HashMap<SessionId, Arc<Session>>>,
    lease: Duration,
    max_sessions: usize,
}

impl Sessions {
    pub fn new(lease: Duration, max_sessions: usize) -> Sessions {
        Sessions {
            map: Mutex::new(HashMap::new()),
            lease,
            max_sessions,
        }
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<SessionId, Arc<Session>>> {
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn lease(&self) -> Duration {
        self.lease
    }

    pub fn open(
        &self,
        peer: Option<SocketAddr>,
        now: Instant,
    ) -> Result<Arc<Session>, SessionError> {
        let mut map = self.lock();
        if map.len() >= self.max_sessions {
            return Err(SessionError::TooManySessions(self.max_sessions));
        }
        let session = Arc::new(Session {
            id: SessionId::random(),
            peer,
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

    /// Ends a session; returns the number of queue pairs destroyed, or None if there
    /// was no such session.
    pub fn end(&self, id: SessionId) -> Option<usize> {
        let session = self.lock().remove(&id)?;
        Some(session.end())
    }

    /// Ends every session whose lease has run out; returns (sessions, queue pairs).
    pub fn reap(&self, now: Instant) -> (usize, usize) {
        let expired: Vec<Arc<Session>> = {
            let mut map = self.lock();
            let ids: Vec<SessionId> = map
                .iter()
                .filter(|(_, s)| s.lock().expires <= now)
                .map(|(id, _)| *id)
                .collect();
            ids.iter().filter_map(|id| map.remove(id)).collect()
        };
        let mut qps = 0;
        for s in &expired {
            let n = s.end();
            tracing::info!(session = ?s.id, peer = ?s.peer, queue_pairs = n, "session lease expired");
            qps += n;
        }
        (expired.len(), qps)
    }

    /// Ends every session (server shutdown); returns (sessions, queue pairs).
    pub fn end_all(&self) -> (usize, usize) {
        let all: Vec<Arc<Session>> = self.lock().drain().map(|(_, s)| s).collect();
        let qps = all.iter().map(|s| s.end()).sum();
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
        let s = sessions.open(None, t0).unwrap();
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
        let s = sessions.open(None, now).unwrap();
        let q = qp(&*dev);
        let weak = Arc::downgrade(&q);
        s.add_qp(q, [0, 0], 4).unwrap();
        s.add_qp(qp(&*dev), [0, 0], 4).unwrap();
        assert_eq!(sessions.counts(), (1, 2, 0));
        assert!(weak.upgrade().is_some());
        assert_eq!(sessions.end(s.id), Some(2));
        assert!(weak.upgrade().is_none(), "the queue pair was dropped");
        assert_eq!(sessions.end(s.id), None);
        // A handler still holding the ended session cannot attach new queue pairs.
        assert_eq!(s.add_qp(qp(&*dev), [0, 0], 4), Err(SessionError::Ended));
    }

    #[test]
    fn reaping_ends_only_expired_sessions() {
        let net = SimNetwork::new(SimConfig::default());
        let dev = net.add_node();
        let sessions = Sessions::new(Duration::from_secs(10), 8);
        let t0 = Instant::now();
        let old = sessions.open(None, t0).unwrap();
        old.add_qp(qp(&*dev), [0, 0], 4).unwrap();
        let young = sessions.open(None, t0 + Duration::from_secs(5)).unwrap();
        assert_eq!(sessions.reap(t0 + Duration::from_secs(11)), (1, 1));
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
        let s = sessions.open(None, Instant::now()).unwrap();
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
        s.add_region(region, &limits).unwrap();
        assert_eq!(
            s.region_fits(24, &limits),
            Err(SessionError::TooManyBytes { len: 24, max: 64 })
        );
        s.region_fits(16, &limits).unwrap();
        assert!(s.remove_region(lkey) && !s.remove_region(lkey));
        s.region_fits(64, &limits).unwrap();
        for _ in 0..2 {
            s.add_region(dev.register(8, fabric::Access::ALL).unwrap(), &limits)
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
        assert_eq!(s.add_region(kept, &limits), Err(SessionError::Ended));
        assert!(weak.upgrade().is_none(), "a refused region is freed");
    }

    #[test]
    fn limits_are_enforced() {
        let net = SimNetwork::new(SimConfig::default());
        let dev = net.add_node();
        let sessions = Sessions::new(Duration::from_secs(10), 2);
        let now = Instant::now();
        let s = sessions.open(None, now).unwrap();
        sessions.open(None, now).unwrap();
        assert!(matches!(
            sessions.open(None, now),
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
}
