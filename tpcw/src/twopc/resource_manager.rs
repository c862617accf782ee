//! A resource manager (RM): one shared-nothing partition. It keeps a few committed
//! versions of each of its rows, serves snapshot reads to clients, and takes part in
//! the TM's two-phase commit (validate and lock, then install or release).
//!
//! **Reads never wait for locks.** A row is locked only between PREPARE and
//! COMMIT/ABORT of a transaction whose CID the TM has not yet marked complete, and
//! the TM hands out read timestamps only up to the complete prefix of CIDs. So every
//! reader's RID is below the CID of any lock it meets: the version it needs is already
//! installed and the pending one would be invisible to it anyway. Prepares never wait
//! either: a locked row votes no (`Conflict`), so there are no deadlocks to detect.

use super::key_hash;
use super::protocol::{Refusal, RmRequest, RmResponse, VersionedRow, Write, WriteOp, serve_frames};
use super::server::Server;
use crate::schema::Rel;
use foldhash::HashMap;
use serde_bytes::ByteBuf;
use std::io;
use std::net::{SocketAddr, TcpListener};
use std::sync::{Arc, Mutex, MutexGuard};

/// Committed versions kept per row; a snapshot older than the oldest kept version of a
/// row that had older ones is `SnapshotTooOld`.
pub const VERSIONS_KEPT: usize = 4;

/// Row shards, each behind its own mutex, so that connection threads rarely contend.
const SHARDS: usize = 64;

struct Version {
    cid: u64,
    /// `None`: deleted.
    row: Option<Vec<u8>>,
}

#[derive(Default)]
struct Row {
    /// Oldest first, CIDs increasing (a write-write conflict aborts every writer that
    /// could install out of order, see `prepare`).
    versions: Vec<Version>,
    /// Older versions were dropped.
    pruned: bool,
    /// The CID of the prepared transaction that locked the row.
    locked_by: Option<u64>,
}

impl Row {
    fn newest(&self) -> Option<&Version> {
        self.versions.last()
    }
}

type Shard = HashMap<(Rel, u64), Row>;

/// The partition's rows and its prepared transactions.
pub struct Store {
    shards: Box<[Mutex<Shard>]>,
    /// Writes of each prepared transaction, by CID, until COMMIT or ABORT.
    prepared: Mutex<HashMap<u64, Vec<Write>>>,
}

/// A `Read` or `Prepare` that aborts the transaction.
type Refused = (Refusal, String);

impl Default for Store {
    fn default() -> Self {
        Store::new()
    }
}

impl Store {
    pub fn new() -> Store {
        Store {
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            prepared: Mutex::default(),
        }
    }

    fn shard(&self, rel: Rel, key: u64) -> MutexGuard<'_, Shard> {
        // The partition chose the RM with the hash's low bits; the high ones spread
        // its keys over the shards.
        let shard = (key_hash(rel, key) >> 40) as usize % SHARDS;
        lock(&self.shards[shard])
    }

    pub fn handle(&self, request: RmRequest) -> RmResponse {
        match request {
            RmRequest::Read { rid, rel, keys } => match self.read(rid, rel, &keys) {
                Ok(rows) => RmResponse::Rows(rows),
                Err((reason, message)) => RmResponse::Refused { reason, message },
            },
            RmRequest::Prepare { cid, rid, writes } => match self.prepare(cid, rid, writes) {
                Ok(()) => RmResponse::Prepared,
                Err(Prepare::Refused((reason, message))) => RmResponse::Refused { reason, message },
                Err(Prepare::Failed(message)) => RmResponse::Failed(message),
            },
            RmRequest::Commit { cid } => match self.commit(cid) {
                Ok(()) => RmResponse::Done,
                Err(message) => RmResponse::Failed(message),
            },
            RmRequest::Abort { cid } => {
                self.abort(cid);
                RmResponse::Done
            }
        }
    }

    /// The rows of `keys` as of `rid`.
    pub fn read(
        &self,
        rid: u64,
        rel: Rel,
        keys: &[u64],
    ) -> Result<Vec<Option<VersionedRow>>, Refused> {
        keys.iter()
            .map(|&key| {
                let shard = self.shard(rel, key);
                let Some(row) = shard.get(&(rel, key)) else {
                    return Ok(None);
                };
                match row.versions.iter().rev().find(|v| v.cid <= rid) {
                    Some(version) => Ok(version.row.as_ref().map(|row| VersionedRow {
                        cid: version.cid,
                        row: ByteBuf::from(row.clone()),
                    })),
                    None if row.pruned => Err((
                        Refusal::SnapshotTooOld,
                        format!(
                            "{} key {key}: snapshot {rid} is older than the {VERSIONS_KEPT} \
                             versions kept (oldest {})",
                            rel.name(),
                            row.versions.first().map_or(0, |v| v.cid)
                        ),
                    )),
                    // The row did not exist yet at `rid`.
                    None => Ok(None),
                }
            })
            .collect()
    }

    /// Validates `writes` against snapshot `rid` and locks their rows for `cid`; all or
    /// nothing.
    pub fn prepare(&self, cid: u64, rid: u64, writes: Vec<Write>) -> Result<(), Prepare> {
        if rid >= cid {
            return Err(Prepare::Failed(format!(
                "prepare of CID {cid} with read timestamp {rid}: a commit must follow its \
                 snapshot"
            )));
        }
        // Reserved first and filled in after validation, so that prepares of other
        // transactions validate in parallel.
        {
            let mut prepared = lock(&self.prepared);
            if prepared.contains_key(&cid) {
                return Err(Prepare::Failed(format!("CID {cid} is already prepared")));
            }
            prepared.insert(cid, Vec::new());
        }
        for (done, write) in writes.iter().enumerate() {
            if let Err(refused) = self.validate_and_lock(cid, rid, write) {
                self.unlock(cid, &writes[..done]);
                lock(&self.prepared).remove(&cid);
                return Err(Prepare::Refused(refused));
            }
        }
        lock(&self.prepared).insert(cid, writes);
        Ok(())
    }

    fn validate_and_lock(&self, cid: u64, rid: u64, write: &Write) -> Result<(), Refused> {
        let (rel, key) = (write.rel, write.key);
        let mut shard = self.shard(rel, key);
        let row = shard.entry((rel, key)).or_default();
        if let Some(holder) = row.locked_by {
            return Err((
                Refusal::Conflict,
                format!(
                    "{} key {key} is locked by the prepared transaction with CID {holder}",
                    rel.name()
                ),
            ));
        }
        let newest = row.newest();
        if write.op.requires_absent()
            && let Some(Version {
                cid: at,
                row: Some(_),
            }) = newest
        {
            return Err((
                Refusal::DuplicateKey,
                format!("{} key {key} exists (version {at})", rel.name()),
            ));
        }
        // First committer wins. Because of it, versions install in CID order: a
        // writer with a lower CID than an installed version began before that
        // version's CID was taken, so its RID is below it and it aborts here.
        if let Some(newest) = newest
            && newest.cid > rid
        {
            return Err((
                Refusal::Conflict,
                format!(
                    "{} key {key} was committed at {} after snapshot {rid}",
                    rel.name(),
                    newest.cid
                ),
            ));
        }
        row.locked_by = Some(cid);
        Ok(())
    }

    /// Releases the locks `cid` took on `writes`, forgetting rows made only to be
    /// locked.
    fn unlock(&self, cid: u64, writes: &[Write]) {
        for write in writes {
            let mut shard = self.shard(write.rel, write.key);
            let id = (write.rel, write.key);
            if let Some(row) = shard.get_mut(&id)
                && row.locked_by == Some(cid)
            {
                row.locked_by = None;
                if row.versions.is_empty() {
                    shard.remove(&id);
                }
            }
        }
    }

    /// Installs the prepared writes of `cid` as versions `cid` and unlocks them.
    pub fn commit(&self, cid: u64) -> Result<(), String> {
        let writes = lock(&self.prepared)
            .remove(&cid)
            .ok_or_else(|| format!("commit of CID {cid}, which is not prepared here"))?;
        for write in writes {
            let mut shard = self.shard(write.rel, write.key);
            let row = shard.entry((write.rel, write.key)).or_default();
            let row_bytes = match write.op {
                WriteOp::Put(bytes) | WriteOp::Insert(bytes) => Some(bytes),
                WriteOp::Delete | WriteOp::InsertThenDelete => None,
            };
            row.versions.push(Version {
                cid,
                row: row_bytes,
            });
            if row.versions.len() > VERSIONS_KEPT {
                row.versions.remove(0);
                row.pruned = true;
            }
            row.locked_by = None;
        }
        Ok(())
    }

    /// Drops the prepared writes of `cid`, if any, and unlocks them.
    pub fn abort(&self, cid: u64) {
        let writes = lock(&self.prepared).remove(&cid);
        if let Some(writes) = writes {
            self.unlock(cid, &writes);
        }
    }

    /// Transactions prepared and not yet decided.
    pub fn prepared_count(&self) -> usize {
        lock(&self.prepared).len()
    }
}

/// Why a prepare voted no.
#[derive(Debug)]
pub enum Prepare {
    /// The transaction must abort.
    Refused(Refused),
    /// The request breaks the protocol.
    Failed(String),
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every critical section leaves its map consistent before anything can panic
    // (allocation failure aborts), so a poisoned lock holds sound data.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A resource-manager server.
pub struct ResourceManager {
    server: Server,
    store: Arc<Store>,
}

impl ResourceManager {
    /// Listens on `addr` (port 0: any) and serves an empty partition.
    pub fn start(addr: SocketAddr) -> io::Result<ResourceManager> {
        let listener = TcpListener::bind(addr)?;
        let store = Arc::new(Store::new());
        let served = store.clone();
        let server = Server::start(listener, "twopc-rm", move |stream| {
            serve_frames(stream, RmResponse::Failed, |request| served.handle(request))
        })?;
        Ok(ResourceManager { server, store })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.server.local_addr()
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    /// Closes the listener and every connection.
    pub fn stop(self) {
        self.server.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn put(rel: Rel, key: u64, row: &[u8]) -> Write {
        Write {
            rel,
            key,
            op: WriteOp::Put(row.to_vec()),
        }
    }

    fn rows(store: &Store, rid: u64, keys: &[u64]) -> Vec<Option<Vec<u8>>> {
        store
            .read(rid, Rel::Item, keys)
            .unwrap()
            .into_iter()
            .map(|r| r.map(|v| v.row.into_vec()))
            .collect()
    }

    fn refusal(outcome: Result<(), Prepare>) -> Refusal {
        match outcome {
            Err(Prepare::Refused((reason, _))) => reason,
            other => panic!("expected a refusal, got {other:?}"),
        }
    }

    #[test]
    fn versions_are_read_as_of_the_snapshot() {
        let store = Store::new();
        store.prepare(5, 0, vec![put(Rel::Item, 1, b"a")]).unwrap();
        store.commit(5).unwrap();
        store.prepare(8, 5, vec![put(Rel::Item, 1, b"b")]).unwrap();
        store.commit(8).unwrap();
        assert_eq!(rows(&store, 4, &[1]), vec![None]);
        assert_eq!(rows(&store, 5, &[1, 2]), vec![Some(b"a".to_vec()), None]);
        assert_eq!(rows(&store, 7, &[1]), vec![Some(b"a".to_vec())]);
        assert_eq!(rows(&store, 8, &[1]), vec![Some(b"b".to_vec())]);
        let versions: Vec<Option<u64>> = store
            .read(7, Rel::Item, &[1, 2])
            .unwrap()
            .into_iter()
            .map(|r| r.map(|v| v.cid))
            .collect();
        assert_eq!(versions, vec![Some(5), None]);
        // The same relation's other keys and other relations' same key are apart.
        assert_eq!(store.read(8, Rel::Author, &[1]).unwrap(), vec![None]);
    }

    #[test]
    fn a_locked_row_votes_no_and_a_failed_prepare_locks_nothing() {
        let store = Store::new();
        store.prepare(3, 1, vec![put(Rel::Item, 1, b"x")]).unwrap();
        let outcome = store.prepare(4, 1, vec![put(Rel::Item, 2, b"y"), put(Rel::Item, 1, b"y")]);
        assert_eq!(refusal(outcome), Refusal::Conflict);
        // Key 2 was locked by the failed prepare and released again.
        store.prepare(6, 1, vec![put(Rel::Item, 2, b"z")]).unwrap();
        assert_eq!(store.prepared_count(), 2);
        store.abort(3);
        store.abort(6);
        assert_eq!(store.prepared_count(), 0);
        assert_eq!(rows(&store, 10, &[1, 2]), vec![None, None]);
        // Aborted rows are forgotten, not left as empty rows.
        assert!(store.shards.iter().all(|s| lock(s).is_empty()));
    }

    #[test]
    fn first_committer_wins_and_inserts_need_absent_keys() {
        let store = Store::new();
        store.prepare(2, 1, vec![put(Rel::Item, 1, b"a")]).unwrap();
        store.commit(2).unwrap();
        // Snapshot 1 does not include CID 2.
        assert_eq!(
            refusal(store.prepare(3, 1, vec![put(Rel::Item, 1, b"b")])),
            Refusal::Conflict
        );
        let insert = |cid, rid| {
            store.prepare(
                cid,
                rid,
                vec![Write {
                    rel: Rel::Item,
                    key: 1,
                    op: WriteOp::Insert(b"c".to_vec()),
                }],
            )
        };
        assert_eq!(refusal(insert(4, 2)), Refusal::DuplicateKey);
        store
            .prepare(
                5,
                2,
                vec![Write {
                    rel: Rel::Item,
                    key: 1,
                    op: WriteOp::Delete,
                }],
            )
            .unwrap();
        store.commit(5).unwrap();
        assert_eq!(rows(&store, 5, &[1]), vec![None]);
        insert(6, 5).unwrap();
        store.commit(6).unwrap();
        assert_eq!(rows(&store, 6, &[1]), vec![Some(b"c".to_vec())]);
    }

    #[test]
    fn old_snapshots_of_pruned_rows_are_refused() {
        let store = Store::new();
        for cid in 1..=(VERSIONS_KEPT as u64 + 1) {
            store
                .prepare(cid, cid - 1, vec![put(Rel::Item, 1, &[cid as u8])])
                .unwrap();
            store.commit(cid).unwrap();
        }
        assert_eq!(rows(&store, 2, &[1]), vec![Some(vec![2])]);
        let (reason, message) = store.read(1, Rel::Item, &[1]).unwrap_err();
        assert_eq!(reason, Refusal::SnapshotTooOld);
        assert!(message.contains("snapshot 1"), "{message}");
    }

    #[test]
    fn protocol_violations_fail_without_effect() {
        let store = Store::new();
        assert!(store.commit(9).unwrap_err().contains("not prepared"));
        assert!(matches!(
            store.prepare(3, 3, vec![put(Rel::Item, 1, b"a")]),
            Err(Prepare::Failed(_))
        ));
        store.prepare(4, 3, vec![put(Rel::Item, 1, b"a")]).unwrap();
        assert!(matches!(
            store.prepare(4, 3, vec![put(Rel::Item, 2, b"a")]),
            Err(Prepare::Failed(_))
        ));
        store.abort(77);
        assert_eq!(store.prepared_count(), 1);
    }
}
