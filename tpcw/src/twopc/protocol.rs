//! The messages between clients, the transaction manager (TM) and the resource
//! managers (RMs), and their framing on TCP: a 4-byte little-endian length, then the
//! message in postcard. Every connection carries requests one way and one response per
//! request the other way, in order, so a sender may pipeline several requests.

use crate::schema::Rel;
use crate::system::AbortReason;
use serde::{Deserialize, Serialize};
use serde_bytes::ByteBuf;
use std::io::{self, BufReader, Read, Write as _};
use std::net::TcpStream;
use std::time::Duration;
use thiserror::Error;

/// Longest frame accepted (a loader commit of a few hundred 16 KiB rows fits many
/// times over); a longer announced length is refused before anything is allocated.
pub const MAX_FRAME_BYTES: usize = 64 << 20;

/// One buffered write of a transaction, as sent at commit.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum WriteOp {
    /// Write the row whether or not the key exists.
    Put(#[serde(with = "serde_bytes")] Vec<u8>),
    /// Write the row; the key must not exist (else `DuplicateKey`).
    Insert(#[serde(with = "serde_bytes")] Vec<u8>),
    /// Install a tombstone.
    Delete,
    /// A row the transaction inserted and then deleted: the key must not exist (as for
    /// `Insert`), and a tombstone is installed.
    InsertThenDelete,
}

impl WriteOp {
    /// The row this write leaves, as the writing transaction itself sees it.
    pub fn row(&self) -> Option<&Vec<u8>> {
        match self {
            WriteOp::Put(row) | WriteOp::Insert(row) => Some(row),
            WriteOp::Delete | WriteOp::InsertThenDelete => None,
        }
    }

    /// Whether the key must be absent at commit.
    pub fn requires_absent(&self) -> bool {
        matches!(self, WriteOp::Insert(_) | WriteOp::InsertThenDelete)
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Write {
    #[serde(with = "rel_code")]
    pub rel: Rel,
    pub key: u64,
    pub op: WriteOp,
}

/// A refusal that aborts the transaction (the wire form of [`AbortReason`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Refusal {
    Conflict,
    SnapshotTooOld,
    DuplicateKey,
}

impl From<Refusal> for AbortReason {
    fn from(r: Refusal) -> AbortReason {
        match r {
            Refusal::Conflict => AbortReason::Conflict,
            Refusal::SnapshotTooOld => AbortReason::SnapshotTooOld,
            Refusal::DuplicateKey => AbortReason::DuplicateKey,
        }
    }
}

/// What a client (reads) or the TM (the two phases) asks an RM.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum RmRequest {
    /// The rows of `keys` as of read timestamp `rid`, in the order of `keys`.
    Read {
        rid: u64,
        #[serde(with = "rel_code")]
        rel: Rel,
        keys: Vec<u64>,
    },
    /// Phase one: validate `writes` against snapshot `rid` (first committer wins,
    /// inserts need absent keys) and lock their rows for transaction `cid`.
    Prepare {
        cid: u64,
        rid: u64,
        writes: Vec<Write>,
    },
    /// Phase two: install the prepared writes of `cid` as versions `cid`, unlock.
    Commit { cid: u64 },
    /// Phase two: drop the prepared writes of `cid`, unlock (a no-op if unknown).
    Abort { cid: u64 },
}

/// A row as a snapshot sees it, with the CID of the transaction that wrote it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VersionedRow {
    pub cid: u64,
    pub row: ByteBuf,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum RmResponse {
    /// The answer to `Read`: per key, its row, or `None` if absent (or deleted).
    Rows(Vec<Option<VersionedRow>>),
    /// A yes vote to `Prepare`.
    Prepared,
    /// The answer to `Commit` and `Abort`.
    Done,
    /// A no vote to `Prepare`, or a `Read` whose version is gone.
    Refused { reason: Refusal, message: String },
    /// A request the RM cannot serve (malformed, or the protocol was not followed).
    Failed(String),
}

/// What a client asks the TM.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum TmRequest {
    /// The RMs' addresses, in partition order.
    Topology,
    /// A read timestamp that includes commit `after` (0: any).
    Begin { after: u64 },
    /// Commit a transaction that read at `rid` with these writes, by two-phase commit.
    Commit { rid: u64, writes: Vec<Write> },
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum TmResponse {
    Topology {
        resource_managers: Vec<String>,
    },
    Began {
        rid: u64,
    },
    Committed {
        cid: u64,
    },
    /// The transaction aborted (an RM voted no).
    Refused {
        reason: Refusal,
        message: String,
    },
    /// A request the TM cannot serve, or an RM it could not reach.
    Failed(String),
}

/// A relation travels as its index.
mod rel_code {
    use crate::schema::Rel;
    use serde::{Deserialize, Deserializer, Serializer, de::Error};

    pub fn serialize<S: Serializer>(rel: &Rel, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u8(rel.index() as u8)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Rel, D::Error> {
        let code = u8::deserialize(d)?;
        Rel::ALL
            .get(code as usize)
            .copied()
            .ok_or_else(|| D::Error::custom(format!("no relation has code {code}")))
    }
}

#[derive(Debug, Error)]
pub enum FrameError {
    /// The peer closed the connection between frames.
    #[error("connection closed")]
    Closed,
    #[error("frame of {0} bytes announced, at most {MAX_FRAME_BYTES} accepted")]
    TooLarge(usize),
    #[error("malformed frame: {0}")]
    Malformed(String),
    #[error("no answer within {0:?}")]
    TimedOut(Duration),
    #[error("{0}")]
    Io(#[from] io::Error),
}

/// A framed connection (either end): messages go out with [`Conn::send`] and come in
/// with [`Conn::recv`].
pub struct Conn {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
    frame: Vec<u8>,
    read_timeout: Option<Duration>,
}

impl Conn {
    /// Wraps a connected stream; `read_timeout` bounds every wait for a frame.
    pub fn new(stream: TcpStream, read_timeout: Option<Duration>) -> io::Result<Conn> {
        stream.set_nodelay(true)?;
        stream.set_read_timeout(read_timeout)?;
        let writer = stream.try_clone()?;
        Ok(Conn {
            reader: BufReader::with_capacity(64 << 10, stream),
            writer,
            frame: Vec::new(),
            read_timeout,
        })
    }

    /// Dials `addr` (within `connect_timeout`).
    pub fn connect(
        addr: std::net::SocketAddr,
        connect_timeout: Duration,
        read_timeout: Option<Duration>,
    ) -> io::Result<Conn> {
        let stream = TcpStream::connect_timeout(&addr, connect_timeout)?;
        Conn::new(stream, read_timeout)
    }

    /// Sends one message as one frame, in one `write`.
    pub fn send<T: Serialize>(&mut self, message: &T) -> Result<(), FrameError> {
        self.frame.clear();
        self.frame.extend_from_slice(&[0; 4]);
        let mut frame = postcard::to_extend(message, std::mem::take(&mut self.frame))
            .map_err(|e| FrameError::Malformed(format!("cannot encode: {e}")))?;
        let len = frame.len() - 4;
        if len > MAX_FRAME_BYTES {
            self.frame = frame;
            return Err(FrameError::TooLarge(len));
        }
        frame[..4].copy_from_slice(&(len as u32).to_le_bytes());
        let outcome = self.writer.write_all(&frame);
        self.frame = frame;
        outcome.map_err(FrameError::Io)
    }

    /// Receives one message. After any error but `Closed` the stream's position within
    /// its frames is unknown: the connection must be dropped.
    pub fn recv<T: for<'de> Deserialize<'de>>(&mut self) -> Result<T, FrameError> {
        let mut len = [0u8; 4];
        // The first byte alone tells a close between frames from one within a frame.
        loop {
            match self.reader.read(&mut len[..1]) {
                Ok(0) => return Err(FrameError::Closed),
                Ok(_) => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(self.io_error(e)),
            }
        }
        self.reader
            .read_exact(&mut len[1..])
            .map_err(|e| self.io_error(e))?;
        let len = u32::from_le_bytes(len) as usize;
        if len > MAX_FRAME_BYTES {
            return Err(FrameError::TooLarge(len));
        }
        self.frame.resize(len, 0);
        self.reader
            .read_exact(&mut self.frame)
            .map_err(|e| self.io_error(e))?;
        decode(&self.frame)
    }

    /// Closes after an answer the peer must get although it may still be sending:
    /// closing with unread bytes would reset the connection, and a reset can make the
    /// peer's kernel drop the answer before it is read. So the write side is shut, and
    /// the rest of what the peer sends is read and discarded (up to a bound).
    pub fn lingering_close(mut self) {
        const LINGER_BYTES: u64 = 1 << 20;
        const LINGER_TIME: Duration = Duration::from_secs(1);
        let _ = self.writer.shutdown(std::net::Shutdown::Write);
        let _ = self.reader.get_ref().set_read_timeout(Some(LINGER_TIME));
        let _ = io::copy(&mut (&mut self.reader).take(LINGER_BYTES), &mut io::sink());
    }

    fn io_error(&self, e: io::Error) -> FrameError {
        match (e.kind(), self.read_timeout) {
            (io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut, Some(t)) => {
                FrameError::TimedOut(t)
            }
            (io::ErrorKind::UnexpectedEof, _) => {
                FrameError::Io(io::Error::new(e.kind(), "connection closed within a frame"))
            }
            _ => FrameError::Io(e),
        }
    }
}

/// Decodes a whole frame's payload; trailing bytes are malformed too.
pub fn decode<T: for<'de> Deserialize<'de>>(payload: &[u8]) -> Result<T, FrameError> {
    match postcard::take_from_bytes(payload) {
        Ok((message, [])) => Ok(message),
        Ok((_, rest)) => Err(FrameError::Malformed(format!(
            "{} bytes after the message",
            rest.len()
        ))),
        Err(e) => Err(FrameError::Malformed(e.to_string())),
    }
}

/// Serves one connection: each request frame gets `handle`'s response, until the peer
/// closes. A frame that is too long or does not decode gets `failed(why)` and the
/// connection is closed (its framing can no longer be trusted).
pub fn serve_frames<Req, Resp>(
    stream: TcpStream,
    failed: impl Fn(String) -> Resp,
    mut handle: impl FnMut(Req) -> Resp,
) where
    Req: for<'de> Deserialize<'de>,
    Resp: Serialize,
{
    let peer = stream
        .peer_addr()
        .map_or_else(|_| "an unknown peer".to_string(), |a| a.to_string());
    let mut conn = match Conn::new(stream, None) {
        Ok(conn) => conn,
        Err(e) => {
            tracing::warn!("cannot set up the connection from {peer}: {e}");
            return;
        }
    };
    loop {
        match conn.recv::<Req>() {
            Ok(request) => {
                if let Err(e) = conn.send(&handle(request)) {
                    tracing::debug!("connection from {peer} lost while answering: {e}");
                    return;
                }
            }
            Err(FrameError::Closed) => return,
            Err(e @ (FrameError::TooLarge(_) | FrameError::Malformed(_))) => {
                tracing::warn!("closing the connection from {peer}: {e}");
                let _ = conn.send(&failed(format!("{e}; closing the connection")));
                conn.lingering_close();
                return;
            }
            Err(e) => {
                tracing::debug!("connection from {peer} lost: {e}");
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn sample_requests() -> Vec<RmRequest> {
        vec![
            RmRequest::Read {
                rid: 7,
                rel: Rel::ShoppingCartLine,
                keys: vec![1, u64::MAX, 3],
            },
            RmRequest::Prepare {
                cid: 9,
                rid: 7,
                writes: vec![
                    Write {
                        rel: Rel::Item,
                        key: 4,
                        op: WriteOp::Put(vec![1, 2, 3]),
                    },
                    Write {
                        rel: Rel::Orders,
                        key: 5,
                        op: WriteOp::Insert(vec![]),
                    },
                    Write {
                        rel: Rel::Country,
                        key: 6,
                        op: WriteOp::Delete,
                    },
                    Write {
                        rel: Rel::Author,
                        key: 7,
                        op: WriteOp::InsertThenDelete,
                    },
                ],
            },
            RmRequest::Commit { cid: 9 },
            RmRequest::Abort { cid: 10 },
        ]
    }

    #[test]
    fn messages_round_trip() {
        for request in sample_requests() {
            let bytes = postcard::to_stdvec(&request).unwrap();
            assert_eq!(decode::<RmRequest>(&bytes).unwrap(), request);
        }
        let response = TmResponse::Refused {
            reason: Refusal::DuplicateKey,
            message: "taken".into(),
        };
        let bytes = postcard::to_stdvec(&response).unwrap();
        assert_eq!(decode::<TmResponse>(&bytes).unwrap(), response);
    }

    #[test]
    fn unknown_relation_and_trailing_bytes_are_malformed() {
        let mut bytes = postcard::to_stdvec(&RmRequest::Read {
            rid: 1,
            rel: Rel::Item,
            keys: vec![],
        })
        .unwrap();
        // Variant 0, rid 1, then the relation code.
        assert_eq!(bytes[2], Rel::Item.index() as u8);
        bytes[2] = Rel::ALL.len() as u8;
        // (postcard drops a custom error's text.)
        let err = decode::<RmRequest>(&bytes).unwrap_err();
        assert!(matches!(err, FrameError::Malformed(_)), "{err}");
        bytes[2] = 0;
        bytes.push(0);
        let err = decode::<RmRequest>(&bytes).unwrap_err();
        assert!(err.to_string().contains("1 bytes after"), "{err}");
    }

    #[test]
    fn random_and_mutated_bytes_never_panic() {
        let mut rng = rand::rngs::SmallRng::seed_from_u64(7);
        let valid: Vec<Vec<u8>> = sample_requests()
            .iter()
            .map(|r| postcard::to_stdvec(r).unwrap())
            .collect();
        for round in 0..20_000 {
            let mut bytes = if round % 2 == 0 {
                let len = rng.random_range(0..64);
                (0..len).map(|_| rng.random()).collect()
            } else {
                valid[round % valid.len()].clone()
            };
            if !bytes.is_empty() {
                let at = rng.random_range(0..bytes.len());
                bytes[at] = rng.random();
                bytes.truncate(rng.random_range(0..=bytes.len()));
            }
            let _ = decode::<RmRequest>(&bytes);
            let _ = decode::<TmRequest>(&bytes);
            let _ = decode::<RmResponse>(&bytes);
            let _ = decode::<TmResponse>(&bytes);
        }
    }
}
