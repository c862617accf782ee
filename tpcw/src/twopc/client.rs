//! The client: begins at the TM, reads straight from the RM that owns each key at the
//! transaction's read timestamp, buffers its writes (and reads them back), and hands
//! the write set to the TM at commit. Read-only transactions end without a message.
//!
//! Calls block; the `async` methods never wait for anything but their own socket, so
//! [`Client::run_clients`] runs its clients one after another.

use super::protocol::{Conn, FrameError, RmRequest, RmResponse, TmRequest, TmResponse, Write};
use super::protocol::{Refusal, VersionedRow, WriteOp};
use super::resource_manager_of;
use crate::schema::Rel;
use crate::system::{AbortReason, ClientFuture, Committed, Engine, Error, Result, Session};
use foldhash::HashMap;
use std::cell::RefCell;
use std::net::SocketAddr;
use std::time::Duration;

const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Longer than the TM's own waits (an RM's answer, earlier commits becoming visible),
/// so that the TM reports those itself.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(120);

/// One connection to one server, dialled again after it failed.
struct Link {
    what: String,
    addr: SocketAddr,
    conn: RefCell<Option<Conn>>,
}

impl Link {
    fn connect(what: String, addr: SocketAddr) -> Result<Link> {
        let link = Link {
            what,
            addr,
            conn: RefCell::new(None),
        };
        let conn = link.dial()?;
        *link.conn.borrow_mut() = Some(conn);
        Ok(link)
    }

    fn dial(&self) -> Result<Conn> {
        Conn::connect(self.addr, CONNECT_TIMEOUT, Some(ANSWER_TIMEOUT))
            .map_err(|e| self.error(format!("cannot connect: {e}")))
    }

    fn error(&self, what: impl std::fmt::Display) -> Error {
        Error::System(format!("{} at {}: {what}", self.what, self.addr))
    }

    /// Drops the connection (its answers will not be read); the next use dials again.
    fn reset(&self) {
        *self.conn.borrow_mut() = None;
    }

    fn send<T: serde::Serialize>(&self, message: &T) -> Result<()> {
        let mut slot = self.conn.borrow_mut();
        let mut conn = match slot.take() {
            Some(conn) => conn,
            None => self.dial()?,
        };
        // Left unset on failure: the stream's framing is unknown after it.
        conn.send(message).map_err(|e| self.error(e))?;
        *slot = Some(conn);
        Ok(())
    }

    fn recv<T: for<'de> serde::Deserialize<'de>>(&self) -> Result<T> {
        let mut slot = self.conn.borrow_mut();
        let Some(mut conn) = slot.take() else {
            return Err(self.error("connection lost"));
        };
        let answer = conn.recv().map_err(|e| match e {
            FrameError::Closed => self.error("connection closed (is it running?)"),
            e => self.error(e),
        })?;
        *slot = Some(conn);
        Ok(answer)
    }

    fn call<Req: serde::Serialize, Resp: for<'de> serde::Deserialize<'de>>(
        &self,
        request: &Req,
    ) -> Result<Resp> {
        self.send(request)?;
        self.recv()
    }
}

/// A connection to the TM and to every RM: the [`Engine`] of one runner thread.
pub struct Client {
    tm: Link,
    rms: Vec<Link>,
}

impl Client {
    /// Connects to the TM at `tm`, learns the RMs from it and connects to each.
    pub fn connect(tm: SocketAddr) -> Result<Client> {
        let tm = Link::connect("transaction manager".into(), tm)?;
        let resource_managers = match tm.call(&TmRequest::Topology)? {
            TmResponse::Topology { resource_managers } => resource_managers,
            other => return Err(tm.error(format!("answered Topology with {other:?}"))),
        };
        if resource_managers.is_empty() {
            return Err(tm.error("names no resource managers"));
        }
        let rms = resource_managers
            .iter()
            .enumerate()
            .map(|(i, addr)| {
                let addr = addr.parse().map_err(|e| {
                    tm.error(format!("names resource manager {i} at {addr:?}: {e}"))
                })?;
                Link::connect(format!("resource manager {i}"), addr)
            })
            .collect::<Result<_>>()?;
        Ok(Client { tm, rms })
    }

    /// The RMs' addresses, in partition order.
    pub fn resource_managers(&self) -> Vec<SocketAddr> {
        self.rms.iter().map(|rm| rm.addr).collect()
    }

    /// Reads `keys[rm]` from each RM `rm` at `rid`: every request goes out before any
    /// answer is read. Returns the rows (with their versions) in the order of
    /// `keys[rm]`.
    fn read(
        &self,
        rid: u64,
        rel: Rel,
        keys: &[Vec<u64>],
    ) -> Result<Vec<Vec<Option<VersionedRow>>>> {
        let asked: Vec<usize> = (0..keys.len()).filter(|&rm| !keys[rm].is_empty()).collect();
        for (sent, &rm) in asked.iter().enumerate() {
            let request = RmRequest::Read {
                rid,
                rel,
                keys: keys[rm].clone(),
            };
            if let Err(e) = self.rms[rm].send(&request) {
                // Their answers will not be read: those connections must go.
                for &earlier in &asked[..sent] {
                    self.rms[earlier].reset();
                }
                return Err(e);
            }
        }
        let mut rows = vec![Vec::new(); keys.len()];
        // Every answer is read even after a failure, so that each connection stays
        // in step; the first failure is reported.
        let mut first_error = None;
        for &rm in &asked {
            let wanted = keys[rm].len();
            let outcome = match self.rms[rm].recv() {
                Ok(RmResponse::Rows(found)) if found.len() == wanted => {
                    rows[rm] = found;
                    continue;
                }
                Ok(RmResponse::Refused { reason, message }) => refused(reason, message),
                Ok(RmResponse::Rows(found)) => {
                    self.rms[rm].error(format!("answered {} rows for {wanted} keys", found.len()))
                }
                Ok(RmResponse::Failed(message)) => self.rms[rm].error(message),
                Ok(other) => self.rms[rm].error(format!("answered Read with {other:?}")),
                Err(e) => e,
            };
            first_error.get_or_insert(outcome);
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(rows),
        }
    }
}

fn refused(reason: Refusal, message: String) -> Error {
    Error::aborted(AbortReason::from(reason), message)
}

/// A transaction: its read timestamp, its buffered writes, and the versions of what
/// it read (for [`Session::version`]).
pub struct Txn<'a> {
    client: &'a Client,
    rid: u64,
    writes: HashMap<(Rel, u64), WriteOp>,
    /// Per row read from an RM: the CID of the version the snapshot saw (`None`:
    /// absent).
    seen: HashMap<(Rel, u64), Option<u64>>,
}

impl Txn<'_> {
    /// Sets the transaction aside without its borrow of the client, for callers that
    /// cannot hold that borrow between calls; [`Client::resume`] takes it up again.
    pub fn suspend(self) -> Suspended {
        Suspended {
            rid: self.rid,
            writes: self.writes,
            seen: self.seen,
        }
    }
}

/// A transaction set aside by [`Txn::suspend`]: its snapshot and buffered writes.
pub struct Suspended {
    rid: u64,
    writes: HashMap<(Rel, u64), WriteOp>,
    seen: HashMap<(Rel, u64), Option<u64>>,
}

impl Client {
    /// Takes up a suspended transaction on this client (any client of the cluster).
    pub fn resume(&self, suspended: Suspended) -> Txn<'_> {
        Txn {
            client: self,
            rid: suspended.rid,
            writes: suspended.writes,
            seen: suspended.seen,
        }
    }
}

impl Session for Txn<'_> {
    async fn get(&mut self, rel: Rel, key: u64) -> Result<Option<Vec<u8>>> {
        Ok(self.get_many(rel, &[key]).await?.pop().flatten())
    }

    async fn get_many(&mut self, rel: Rel, keys: &[u64]) -> Result<Vec<Option<Vec<u8>>>> {
        let partitions = self.client.rms.len();
        let mut found = vec![None; keys.len()];
        // Per RM: the keys to ask for and where their rows go.
        let mut asked: Vec<Vec<u64>> = vec![Vec::new(); partitions];
        let mut positions: Vec<Vec<usize>> = vec![Vec::new(); partitions];
        for (at, &key) in keys.iter().enumerate() {
            if let Some(own) = self.writes.get(&(rel, key)) {
                found[at] = own.row().cloned();
                continue;
            }
            let rm = resource_manager_of(rel, key, partitions);
            asked[rm].push(key);
            positions[rm].push(at);
        }
        if positions.iter().any(|p| !p.is_empty()) {
            let rows = self.client.read(self.rid, rel, &asked)?;
            for ((rows, positions), keys) in rows.into_iter().zip(&positions).zip(&asked) {
                for ((row, &at), &key) in rows.into_iter().zip(positions).zip(keys) {
                    self.seen.insert((rel, key), row.as_ref().map(|r| r.cid));
                    found[at] = row.map(|r| r.row.into_vec());
                }
            }
        }
        Ok(found)
    }

    /// The CID of the snapshot's version of the row (not of this transaction's own
    /// write), `None` if absent: remembered from the transaction's reads, else read.
    async fn version(&mut self, rel: Rel, key: u64) -> Result<Option<u64>> {
        if let Some(&version) = self.seen.get(&(rel, key)) {
            return Ok(version);
        }
        let partitions = self.client.rms.len();
        let mut asked = vec![Vec::new(); partitions];
        asked[resource_manager_of(rel, key, partitions)].push(key);
        let version = self
            .client
            .read(self.rid, rel, &asked)?
            .into_iter()
            .flatten()
            .next()
            .flatten()
            .map(|r| r.cid);
        self.seen.insert((rel, key), version);
        Ok(version)
    }

    fn read_timestamp(&self) -> Option<u64> {
        Some(self.rid)
    }

    async fn put(&mut self, rel: Rel, key: u64, row: Vec<u8>) -> Result<()> {
        let op = match self.writes.get(&(rel, key)) {
            // An insert stays one: its key must still be absent at commit.
            Some(WriteOp::Insert(_) | WriteOp::InsertThenDelete) => WriteOp::Insert(row),
            _ => WriteOp::Put(row),
        };
        self.writes.insert((rel, key), op);
        Ok(())
    }

    async fn insert(&mut self, rel: Rel, key: u64, row: Vec<u8>) -> Result<()> {
        let op = match self.writes.get(&(rel, key)) {
            Some(WriteOp::Put(_) | WriteOp::Insert(_)) => {
                return Err(Error::aborted(
                    AbortReason::DuplicateKey,
                    format!(
                        "{} key {key} was already written by this transaction",
                        rel.name()
                    ),
                ));
            }
            // Deleted by this transaction: whatever was there is gone at commit.
            Some(WriteOp::Delete) => WriteOp::Put(row),
            Some(WriteOp::InsertThenDelete) | None => WriteOp::Insert(row),
        };
        self.writes.insert((rel, key), op);
        Ok(())
    }

    async fn delete(&mut self, rel: Rel, key: u64) -> Result<()> {
        let op = match self.writes.get(&(rel, key)) {
            // Deleting its own insert must not delete a row someone else inserted:
            // the key must still be absent, as the insert required.
            Some(WriteOp::Insert(_) | WriteOp::InsertThenDelete) => WriteOp::InsertThenDelete,
            _ => WriteOp::Delete,
        };
        self.writes.insert((rel, key), op);
        Ok(())
    }
}

impl Engine for Client {
    type Txn<'a> = Txn<'a>;

    async fn begin(&self, after: u64) -> Result<Txn<'_>> {
        match self.tm.call(&TmRequest::Begin { after })? {
            TmResponse::Began { rid } => Ok(Txn {
                client: self,
                rid,
                writes: HashMap::default(),
                seen: HashMap::default(),
            }),
            TmResponse::Failed(message) => Err(self.tm.error(message)),
            other => Err(self.tm.error(format!("answered Begin with {other:?}"))),
        }
    }

    async fn commit<'a>(&'a self, txn: Txn<'a>) -> Result<Committed> {
        if txn.writes.is_empty() {
            // Its reads were one snapshot; there is nothing to validate or install.
            return Ok(Committed { cid: None });
        }
        let writes = txn
            .writes
            .into_iter()
            .map(|((rel, key), op)| Write { rel, key, op })
            .collect();
        let request = TmRequest::Commit {
            rid: txn.rid,
            writes,
        };
        match self.tm.call(&request)? {
            TmResponse::Committed { cid } => Ok(Committed { cid: Some(cid) }),
            TmResponse::Refused { reason, message } => Err(refused(reason, message)),
            TmResponse::Failed(message) => Err(self.tm.error(message)),
            other => Err(self.tm.error(format!("answered Commit with {other:?}"))),
        }
    }

    fn abort<'a>(&'a self, txn: Txn<'a>) {
        // Nothing is locked or written before commit.
        drop(txn);
    }

    fn run_clients<'a, T>(
        &'a self,
        clients: usize,
        make: impl FnMut(usize) -> ClientFuture<'a, T>,
    ) -> Vec<T> {
        crate::system::run_clients_in_turn(clients, make)
    }
}

pub use crate::system::block_on;
