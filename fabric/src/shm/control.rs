//! The control channel of the shm backend: a Unix socket per device, over which an
//! authenticated peer obtains the memory it will then access without the owner's CPU —
//! the key table, exported regions, and the blocks and rings of queue pairs — as memfds
//! passed with SCM_RIGHTS.
//!
//! A connection starts with the cluster-token handshake (`crate::handshake`), whose
//! first request is the requester's node id. Then it carries fixed-size requests and
//! responses, one at a time:
//!
//! - request (16 bytes): `op: u8 | kind: u8 | 0: u16 | a: u32 | b: u32 | 0: u32`;
//! - response (16 bytes): `status: u8 | fds: u8 | 0: [u8; 14]`, with `fds` file
//!   descriptors attached to its first byte.
//!
//! A [`WATCH`] request is never answered: its connection stays open for the life of the
//! responder's device, so the requester learns of the device's (or process's) death as
//! an end of stream.

use crate::handshake;
use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};
use std::io::{IoSlice, IoSliceMut, Read, Write};
use std::mem::MaybeUninit;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

pub(crate) const PROTOCOL: handshake::Protocol = handshake::Protocol {
    magic: b"NAMDBSHM",
    version: 1,
    server_role: b"namdb-shm owner",
    client_role: b"namdb-shm peer",
};

/// The key table, read-only.
pub(crate) const KEYS: u8 = 1;
/// Region `a` (an rkey): read-only or read-write as its access flags say.
pub(crate) const REGION: u8 = 2;
/// Queue pair `a` for sender queue pair `b` of kind `kind`: its block (read-only) and a
/// fresh ring (read-write) that only this sender writes.
pub(crate) const ATTACH: u8 = 3;
/// Never answered: the end of stream tells the requester the responder is gone.
pub(crate) const WATCH: u8 = 4;

pub(crate) const OK: u8 = 0;
pub(crate) const NO_SUCH_REGION: u8 = 1;
pub(crate) const NO_SUCH_QP: u8 = 2;
pub(crate) const REFUSED: u8 = 3;
pub(crate) const MALFORMED: u8 = 4;
pub(crate) const FAILED: u8 = 5;

pub(crate) const KIND_RC: u8 = 1;
pub(crate) const KIND_UD: u8 = 2;

/// How long either side waits for the other's next message of a handshake or request.
pub(crate) const PATIENCE: Duration = Duration::from_secs(10);

const MESSAGE: usize = 16;
const MAX_FDS: usize = 2;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Request {
    pub(crate) op: u8,
    pub(crate) kind: u8,
    pub(crate) a: u32,
    pub(crate) b: u32,
}

impl Request {
    pub(crate) fn new(op: u8, a: u32) -> Request {
        Request {
            op,
            kind: 0,
            a,
            b: 0,
        }
    }

    fn encode(&self) -> [u8; MESSAGE] {
        let mut m = [0u8; MESSAGE];
        m[0] = self.op;
        m[1] = self.kind;
        m[4..8].copy_from_slice(&self.a.to_le_bytes());
        m[8..12].copy_from_slice(&self.b.to_le_bytes());
        m
    }

    pub(crate) fn decode(m: &[u8; MESSAGE]) -> Request {
        Request {
            op: m[0],
            kind: m[1],
            a: u32::from_le_bytes(m[4..8].try_into().expect("4 bytes")),
            b: u32::from_le_bytes(m[8..12].try_into().expect("4 bytes")),
        }
    }
}

/// A response: a status and the fds that came with it.
pub(crate) struct Response {
    pub(crate) status: u8,
    pub(crate) fds: Vec<OwnedFd>,
}

/// Connects to the device listening at `path` as node `me`; returns the stream and the
/// responder's node id.
pub(crate) fn dial(path: &Path, token: &[u8], me: u32) -> Result<(UnixStream, u32), String> {
    let mut stream = UnixStream::connect(path)
        .map_err(|e| format!("cannot connect to {}: {e}", path.display()))?;
    let configure = |s: &UnixStream| {
        s.set_read_timeout(Some(PATIENCE))?;
        s.set_write_timeout(Some(PATIENCE))
    };
    configure(&stream).map_err(|e| format!("cannot configure the socket: {e}"))?;
    let node = handshake::client(&mut stream, token, &PROTOCOL, &me.to_le_bytes())?;
    Ok((stream, node))
}

/// The responder's side of the handshake: the requester's node id.
pub(crate) fn accept(stream: &mut UnixStream, token: &[u8], me: u32) -> Result<u32, String> {
    handshake::server::<4>(stream, token, &PROTOCOL, me).map(u32::from_le_bytes)
}

/// Sends `request` and waits for its response.
pub(crate) fn call(stream: &mut UnixStream, request: Request) -> Result<Response, String> {
    stream
        .write_all(&request.encode())
        .map_err(|e| format!("cannot send a request: {e}"))?;
    receive(stream).map_err(|e| format!("no response: {e}"))
}

/// Sends a request without waiting for an answer.
pub(crate) fn send_request(stream: &mut UnixStream, request: Request) -> std::io::Result<()> {
    stream.write_all(&request.encode())
}

/// Reads the next request; `Ok(None)` at a clean end of stream.
pub(crate) fn next_request(stream: &mut UnixStream) -> std::io::Result<Option<Request>> {
    let mut m = [0u8; MESSAGE];
    match stream.read_exact(&mut m) {
        Ok(()) => Ok(Some(Request::decode(&m))),
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Ok(None),
        Err(e) => Err(e),
    }
}

/// Answers a request, passing `fds` along.
pub(crate) fn respond(
    stream: &UnixStream,
    status: u8,
    fds: &[BorrowedFd<'_>],
) -> std::io::Result<()> {
    debug_assert!(fds.len() <= MAX_FDS);
    let mut m = [0u8; MESSAGE];
    m[0] = status;
    m[1] = fds.len() as u8;
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err(std::io::Error::other("no room for the file descriptors"));
    }
    let mut sent = 0;
    while sent < MESSAGE {
        let n = if sent == 0 {
            rustix::net::sendmsg(
                stream,
                &[IoSlice::new(&m)],
                &mut control,
                SendFlags::NOSIGNAL,
            )?
        } else {
            rustix::net::send(stream, &m[sent..], SendFlags::NOSIGNAL)?
        };
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        sent += n;
    }
    Ok(())
}

fn receive(stream: &UnixStream) -> std::io::Result<Response> {
    let mut m = [0u8; MESSAGE];
    let mut fds = Vec::new();
    let mut got = 0;
    while got < MESSAGE {
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let n = rustix::net::recvmsg(
            stream,
            &mut [IoSliceMut::new(&mut m[got..])],
            &mut control,
            RecvFlags::CMSG_CLOEXEC,
        )?
        .bytes;
        for message in control.drain() {
            if let RecvAncillaryMessage::ScmRights(received) = message {
                fds.extend(received);
            }
        }
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        got += n;
    }
    if fds.len() != m[1] as usize {
        return Err(std::io::Error::other(format!(
            "the response announces {} descriptors and carries {}",
            m[1],
            fds.len()
        )));
    }
    Ok(Response { status: m[0], fds })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    fn responses_carry_their_descriptors() {
        let (mut a, b) = UnixStream::pair().unwrap();
        let file = crate::memfd::MemfdMemory::new("fd-pass", 4096).unwrap();
        let server = std::thread::spawn(move || {
            let mut b = b;
            let req = next_request(&mut b).unwrap().unwrap();
            assert_eq!(req, Request::new(REGION, 21));
            respond(&b, OK, &[file.as_fd(), file.as_fd()]).unwrap();
            respond(&b, NO_SUCH_QP, &[]).unwrap();
            drop(file);
        });
        let r = call(&mut a, Request::new(REGION, 21)).unwrap();
        assert_eq!((r.status, r.fds.len()), (OK, 2));
        let mapped = crate::memfd::MemfdMemory::from_peer(r.fds.into_iter().next().unwrap(), true);
        assert!(mapped.is_ok());
        let r = receive(&a).unwrap();
        assert_eq!((r.status, r.fds.len()), (NO_SUCH_QP, 0));
        server.join().unwrap();
        assert!(next_request(&mut a).unwrap().is_none());
    }

    #[test]
    fn requests_round_trip() {
        let r = Request {
            op: ATTACH,
            kind: KIND_UD,
            a: 7,
            b: 9,
        };
        assert_eq!(Request::decode(&r.encode()), r);
    }
}
