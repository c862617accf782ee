//! The tcp backend's wire format: the connection handshake, request and response
//! frames, and UD datagrams. Every decoder takes untrusted bytes and returns an error,
//! never panics: a peer may send anything.
//!
//! A frame is `u32 body_len | u8 kind | u16 count | items`, little-endian. A request
//! item is a fixed header (op, rkey, offset, len, two operands, imm) followed by the
//! payload of WRITE and SEND. A response item is a status byte, then the data of a
//! successful READ (the request's length) or the old value of a successful atomic.

use crate::error::WcStatus;
use crate::handshake;
use std::io::{Read, Write};

pub(crate) const MAGIC: &[u8; 8] = b"NAMDBTCP";
pub(crate) const VERSION: u16 = 1;
/// The largest frame body either side accepts.
pub(crate) const MAX_FRAME: usize = 64 << 20;

pub(crate) const KIND_REQUESTS: u8 = 1;
pub(crate) const KIND_RESPONSES: u8 = 2;
pub(crate) const KIND_ERROR: u8 = 3;

const ITEM_HEADER: usize = 1 + 4 + 8 + 4 + 8 + 8 + 4;

#[derive(Debug, PartialEq, Eq, Clone)]
pub(crate) struct WireError(pub(crate) String);

impl std::fmt::Display for WireError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

fn malformed<T>(what: impl Into<String>) -> Result<T, WireError> {
    Err(WireError(what.into()))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Op {
    Read = 1,
    Write = 2,
    WriteImm = 3,
    Send = 4,
    SendImm = 5,
    Cas = 6,
    FetchAdd = 7,
}

impl Op {
    fn from_u8(v: u8) -> Option<Op> {
        Some(match v {
            1 => Op::Read,
            2 => Op::Write,
            3 => Op::WriteImm,
            4 => Op::Send,
            5 => Op::SendImm,
            6 => Op::Cas,
            7 => Op::FetchAdd,
            _ => return None,
        })
    }

    /// Whether the responder executes the request only once the target has a receive
    /// posted (RNR).
    pub(crate) fn waits_for_a_receive(self) -> bool {
        matches!(self, Op::WriteImm | Op::Send | Op::SendImm)
    }

    /// Whether the request carries `len` bytes of payload.
    pub(crate) fn carries_payload(self) -> bool {
        matches!(self, Op::Write | Op::WriteImm | Op::Send | Op::SendImm)
    }
}

/// One work request on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Request<'a> {
    pub(crate) op: Op,
    pub(crate) rkey: u32,
    pub(crate) offset: u64,
    pub(crate) len: u32,
    /// CAS compare, FETCH_ADD addend.
    pub(crate) a: u64,
    /// CAS swap.
    pub(crate) b: u64,
    pub(crate) imm: u32,
    pub(crate) payload: &'a [u8],
}

/// Starts a frame in `buf`; returns where it starts, for [`finish_frame`].
pub(crate) fn begin_frame(buf: &mut Vec<u8>, kind: u8) -> usize {
    let start = buf.len();
    buf.extend_from_slice(&[0; 4]);
    buf.push(kind);
    buf.extend_from_slice(&[0; 2]);
    start
}

pub(crate) fn finish_frame(buf: &mut [u8], start: usize, count: u16) {
    let body = (buf.len() - start - 4) as u32;
    buf[start..start + 4].copy_from_slice(&body.to_le_bytes());
    buf[start + 5..start + 7].copy_from_slice(&count.to_le_bytes());
}

/// Appends a request item. The payload must be `len` bytes for ops that carry one.
pub(crate) fn put_request(buf: &mut Vec<u8>, r: &Request<'_>) {
    buf.push(r.op as u8);
    buf.extend_from_slice(&r.rkey.to_le_bytes());
    buf.extend_from_slice(&r.offset.to_le_bytes());
    buf.extend_from_slice(&r.len.to_le_bytes());
    buf.extend_from_slice(&r.a.to_le_bytes());
    buf.extend_from_slice(&r.b.to_le_bytes());
    buf.extend_from_slice(&r.imm.to_le_bytes());
    if r.op.carries_payload() {
        debug_assert_eq!(r.payload.len(), r.len as usize);
        buf.extend_from_slice(r.payload);
    }
}

/// A checked reader over untrusted bytes.
pub(crate) struct Cursor<'a> {
    bytes: &'a [u8],
}

impl<'a> Cursor<'a> {
    pub(crate) fn new(bytes: &'a [u8]) -> Cursor<'a> {
        Cursor { bytes }
    }
    pub(crate) fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], WireError> {
        if self.bytes.len() < n {
            return malformed(format!(
                "truncated {what}: need {n} bytes, {} left",
                self.bytes.len()
            ));
        }
        let (head, rest) = self.bytes.split_at(n);
        self.bytes = rest;
        Ok(head)
    }
    pub(crate) fn u8(&mut self, what: &str) -> Result<u8, WireError> {
        Ok(self.take(1, what)?[0])
    }
    pub(crate) fn u16(&mut self, what: &str) -> Result<u16, WireError> {
        Ok(u16::from_le_bytes(
            self.take(2, what)?.try_into().expect("2 bytes"),
        ))
    }
    pub(crate) fn u32(&mut self, what: &str) -> Result<u32, WireError> {
        Ok(u32::from_le_bytes(
            self.take(4, what)?.try_into().expect("4 bytes"),
        ))
    }
    pub(crate) fn u64(&mut self, what: &str) -> Result<u64, WireError> {
        Ok(u64::from_le_bytes(
            self.take(8, what)?.try_into().expect("8 bytes"),
        ))
    }
    pub(crate) fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }
}

/// Splits a frame body into its kind, count and items.
pub(crate) fn frame_header(body: &[u8]) -> Result<(u8, u16, Cursor<'_>), WireError> {
    let mut c = Cursor::new(body);
    let kind = c.u8("frame kind")?;
    let count = c.u16("item count")?;
    Ok((kind, count, c))
}

/// Decodes the items of a request frame.
pub(crate) fn decode_requests<'a>(
    count: u16,
    mut c: Cursor<'a>,
    out: &mut Vec<Request<'a>>,
) -> Result<(), WireError> {
    out.clear();
    for i in 0..count {
        let header = c.take(ITEM_HEADER, "request header")?;
        let mut h = Cursor::new(header);
        let op_byte = h.u8("op")?;
        let Some(op) = Op::from_u8(op_byte) else {
            return malformed(format!("request {i}: unknown op {op_byte}"));
        };
        let rkey = h.u32("rkey")?;
        let offset = h.u64("offset")?;
        let len = h.u32("len")?;
        let a = h.u64("operand a")?;
        let b = h.u64("operand b")?;
        let imm = h.u32("imm")?;
        let payload = if op.carries_payload() {
            c.take(len as usize, "payload")?
        } else {
            &[]
        };
        if matches!(op, Op::Cas | Op::FetchAdd) && len != 8 {
            return malformed(format!("request {i}: an atomic is 8 bytes, got {len}"));
        }
        out.push(Request {
            op,
            rkey,
            offset,
            len,
            a,
            b,
            imm,
            payload,
        });
    }
    if !c.is_empty() {
        return malformed("trailing bytes after the last request");
    }
    Ok(())
}

/// Reads one frame body into `buf` (blocking). `Ok(false)` on a clean end of stream
/// before a frame starts.
/// The body of the frame at the start of `buf` once all of it is there (the frame takes
/// `4 + body.len()` bytes of `buf`), or `None` while it is cut short; a length outside
/// what a frame may have is an error before anything waits for the rest.
pub(crate) fn next_frame(buf: &[u8]) -> Result<Option<&[u8]>, WireError> {
    let Some(len) = buf.get(..4) else {
        return Ok(None);
    };
    let len = u32::from_le_bytes(len.try_into().expect("4 bytes")) as usize;
    if !(3..=MAX_FRAME).contains(&len) {
        return malformed(format!("frame of {len} bytes (allowed 3..={MAX_FRAME})"));
    }
    Ok(buf.get(4..4 + len))
}

#[cfg(test)]
pub(crate) fn read_frame(stream: &mut impl Read, buf: &mut Vec<u8>) -> std::io::Result<bool> {
    use std::io;
    let mut len = [0u8; 4];
    match stream.read_exact(&mut len) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(false),
        Err(e) => return Err(e),
    }
    let len = u32::from_le_bytes(len) as usize;
    if !(3..=MAX_FRAME).contains(&len) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("frame of {len} bytes (allowed 3..={MAX_FRAME})"),
        ));
    }
    buf.clear();
    buf.resize(len, 0);
    stream.read_exact(buf)?;
    Ok(true)
}

pub(crate) fn error_frame(message: &str) -> Vec<u8> {
    let mut buf = Vec::new();
    let start = begin_frame(&mut buf, KIND_ERROR);
    let msg = &message.as_bytes()[..message.len().min(1024)];
    buf.extend_from_slice(msg);
    finish_frame(&mut buf, start, 0);
    buf
}

pub(crate) fn status_byte(s: WcStatus) -> u8 {
    match s {
        WcStatus::Success => 0,
        WcStatus::LocalLength => 1,
        WcStatus::LocalProtection => 2,
        WcStatus::WrFlush => 3,
        WcStatus::RemoteInvalidRequest => 4,
        WcStatus::RemoteAccess => 5,
        WcStatus::RetryExceeded => 6,
        WcStatus::RnrRetryExceeded => 7,
    }
}

pub(crate) fn status_from(b: u8) -> Option<WcStatus> {
    Some(match b {
        0 => WcStatus::Success,
        1 => WcStatus::LocalLength,
        2 => WcStatus::LocalProtection,
        3 => WcStatus::WrFlush,
        4 => WcStatus::RemoteInvalidRequest,
        5 => WcStatus::RemoteAccess,
        6 => WcStatus::RetryExceeded,
        7 => WcStatus::RnrRetryExceeded,
        _ => return None,
    })
}

// ------------------------------------------------------------------ handshake

const PROTOCOL: handshake::Protocol = handshake::Protocol {
    magic: MAGIC,
    version: VERSION,
    server_role: b"namdb-tcp responder",
    client_role: b"namdb-tcp requester",
};

/// What a requester asks for once authenticated: which queue pair it connects to, who
/// it is, and how long the responder may hold a SEND that finds no receive (RNR).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Attach {
    pub(crate) src_node: u32,
    pub(crate) src_qpn: u32,
    pub(crate) dst_qpn: u32,
    pub(crate) rnr_retry: u8,
    pub(crate) rnr_timer_us: u32,
}

const ATTACH_LEN: usize = 17;

pub(crate) const ATTACH_OK: u8 = 0;
pub(crate) const ATTACH_UNAUTHENTICATED: u8 = handshake::UNAUTHENTICATED;
pub(crate) const ATTACH_NO_SUCH_QP: u8 = 2;

/// The requester's side of the handshake (see [`handshake`]), with the attach request
/// as its first request. Returns the responder's node id.
pub(crate) fn client_handshake(
    stream: &mut (impl Read + Write),
    token: &[u8],
    attach: Attach,
) -> Result<u32, String> {
    let mut msg = Vec::with_capacity(ATTACH_LEN);
    msg.extend_from_slice(&attach.src_node.to_le_bytes());
    msg.extend_from_slice(&attach.src_qpn.to_le_bytes());
    msg.extend_from_slice(&attach.dst_qpn.to_le_bytes());
    msg.push(attach.rnr_retry);
    msg.extend_from_slice(&attach.rnr_timer_us.to_le_bytes());
    let node = handshake::client(stream, token, &PROTOCOL, &msg)?;
    let mut reply = [0u8; 1];
    stream
        .read_exact(&mut reply)
        .map_err(|e| format!("handshake: no reply to attach ({e})"))?;
    match reply[0] {
        ATTACH_OK => Ok(node),
        ATTACH_UNAUTHENTICATED => Err("the peer rejected our token".into()),
        ATTACH_NO_SUCH_QP => Err(format!("the peer has no queue pair {}", attach.dst_qpn)),
        other => Err(format!("the peer refused the connection (code {other})")),
    }
}

/// The responder's side: returns the attach request of an authenticated requester, or
/// why the connection must be closed.
pub(crate) fn server_handshake(
    stream: &mut (impl Read + Write),
    token: &[u8],
    node: u32,
) -> Result<Attach, String> {
    let msg = handshake::server::<ATTACH_LEN>(stream, token, &PROTOCOL, node)?;
    let mut c = Cursor::new(&msg);
    let field = |r: Result<u32, WireError>| r.map_err(|e| e.0);
    Ok(Attach {
        src_node: field(c.u32("src node"))?,
        src_qpn: field(c.u32("src qpn"))?,
        dst_qpn: field(c.u32("dst qpn"))?,
        rnr_retry: c.u8("rnr retry").map_err(|e| e.0)?,
        rnr_timer_us: field(c.u32("rnr timer"))?,
    })
}

// ------------------------------------------------------------------ UD datagrams

/// A UD datagram's header: `u32 dst_qpn | u32 qkey | u32 src_node | u32 src_qpn |
/// u8 has_imm | u32 imm`, then the payload.
pub(crate) const DATAGRAM_HEADER: usize = 21;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Datagram<'a> {
    pub(crate) dst_qpn: u32,
    pub(crate) qkey: u32,
    pub(crate) src_node: u32,
    pub(crate) src_qpn: u32,
    pub(crate) imm: Option<u32>,
    pub(crate) payload: &'a [u8],
}

pub(crate) fn encode_datagram(buf: &mut Vec<u8>, d: &Datagram<'_>) {
    buf.clear();
    buf.extend_from_slice(&d.dst_qpn.to_le_bytes());
    buf.extend_from_slice(&d.qkey.to_le_bytes());
    buf.extend_from_slice(&d.src_node.to_le_bytes());
    buf.extend_from_slice(&d.src_qpn.to_le_bytes());
    buf.push(d.imm.is_some() as u8);
    buf.extend_from_slice(&d.imm.unwrap_or(0).to_le_bytes());
    buf.extend_from_slice(d.payload);
}

pub(crate) fn decode_datagram(bytes: &[u8]) -> Result<Datagram<'_>, WireError> {
    let mut c = Cursor::new(bytes);
    let dst_qpn = c.u32("dst qpn")?;
    let qkey = c.u32("qkey")?;
    let src_node = c.u32("src node")?;
    let src_qpn = c.u32("src qpn")?;
    let has_imm = c.u8("imm flag")?;
    let imm = c.u32("imm")?;
    let payload = c.take(bytes.len() - DATAGRAM_HEADER, "payload")?;
    Ok(Datagram {
        dst_qpn,
        qkey,
        src_node,
        src_qpn,
        imm: match has_imm {
            0 => None,
            1 => Some(imm),
            other => return malformed(format!("imm flag {other}")),
        },
        payload,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample() -> Vec<u8> {
        let mut buf = Vec::new();
        let start = begin_frame(&mut buf, KIND_REQUESTS);
        put_request(
            &mut buf,
            &Request {
                op: Op::Write,
                rkey: 9,
                offset: 16,
                len: 3,
                a: 0,
                b: 0,
                imm: 0,
                payload: b"abc",
            },
        );
        put_request(
            &mut buf,
            &Request {
                op: Op::Cas,
                rkey: 9,
                offset: 8,
                len: 8,
                a: 1,
                b: 2,
                imm: 0,
                payload: &[],
            },
        );
        finish_frame(&mut buf, start, 2);
        buf
    }

    #[test]
    fn requests_round_trip() {
        let buf = sample();
        let mut body = Vec::new();
        assert!(read_frame(&mut &buf[..], &mut body).unwrap());
        let (kind, count, c) = frame_header(&body).unwrap();
        assert_eq!((kind, count), (KIND_REQUESTS, 2));
        let mut out = Vec::new();
        decode_requests(count, c, &mut out).unwrap();
        assert_eq!(out[0].payload, b"abc");
        assert_eq!((out[1].op, out[1].a, out[1].b), (Op::Cas, 1, 2));
    }

    #[test]
    fn a_frame_is_taken_only_once_it_is_whole() {
        let buf = sample();
        for cut in 0..buf.len() {
            assert_eq!(next_frame(&buf[..cut]), Ok(None), "cut at {cut}");
        }
        let mut two = buf.clone();
        two.extend_from_slice(&buf);
        let body = next_frame(&two).unwrap().expect("whole");
        assert_eq!(body, &buf[4..]);
        let mut too_long = (MAX_FRAME as u32 + 1).to_le_bytes().to_vec();
        too_long.push(1);
        assert!(next_frame(&too_long).is_err());
        assert!(next_frame(&2u32.to_le_bytes()).is_err());
    }

    #[test]
    fn oversized_frames_are_refused_before_allocation() {
        let mut bytes = (MAX_FRAME as u32 + 1).to_le_bytes().to_vec();
        bytes.extend_from_slice(&[0; 16]);
        assert!(read_frame(&mut &bytes[..], &mut Vec::new()).is_err());
    }

    #[test]
    fn datagrams_round_trip() {
        let d = Datagram {
            dst_qpn: 3,
            qkey: 4,
            src_node: 5,
            src_qpn: 6,
            imm: Some(7),
            payload: b"xy",
        };
        let mut buf = Vec::new();
        encode_datagram(&mut buf, &d);
        assert_eq!(decode_datagram(&buf).unwrap(), d);
    }

    #[test]
    fn handshake_authenticates_both_ways() {
        use std::os::unix::net::UnixStream;
        let (mut a, mut b) = UnixStream::pair().unwrap();
        let attach = Attach {
            src_node: 1,
            src_qpn: 2,
            dst_qpn: 3,
            rnr_retry: 4,
            rnr_timer_us: 5,
        };
        let server = std::thread::spawn(move || {
            let got = server_handshake(&mut b, b"a cluster token", 77);
            if got.is_ok() {
                use std::io::Write;
                b.write_all(&[ATTACH_OK]).unwrap();
            }
            got
        });
        assert_eq!(client_handshake(&mut a, b"a cluster token", attach), Ok(77));
        assert_eq!(server.join().unwrap(), Ok(attach));
    }

    #[test]
    fn wrong_token_is_refused_by_the_requester() {
        use std::os::unix::net::UnixStream;
        let (mut a, mut b) = UnixStream::pair().unwrap();
        let server = std::thread::spawn(move || server_handshake(&mut b, b"the real token", 1));
        let attach = Attach {
            src_node: 1,
            src_qpn: 2,
            dst_qpn: 3,
            rnr_retry: 0,
            rnr_timer_us: 0,
        };
        let err = client_handshake(&mut a, b"a wrong token!", attach).unwrap_err();
        assert!(err.contains("token"), "{err}");
        drop(a);
        assert!(server.join().unwrap().is_err());
    }

    proptest! {
        /// The decoders take arbitrary bytes without panicking.
        #[test]
        fn decoders_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let mut body = Vec::new();
            let _ = read_frame(&mut &bytes[..], &mut body);
            let _ = next_frame(&bytes);
            if let Ok((_, count, c)) = frame_header(&bytes) {
                let _ = decode_requests(count, c, &mut Vec::new());
            }
            let _ = decode_datagram(&bytes);
        }

        /// Mutating a valid frame yields either a valid decode or an error.
        #[test]
        fn mutated_frames_decode_or_fail(pos in 4usize..60, byte in any::<u8>()) {
            let mut buf = sample();
            let pos = pos.min(buf.len() - 1);
            buf[pos] = byte;
            let body = &buf[4..];
            if let Ok((_, count, c)) = frame_header(body) {
                let _ = decode_requests(count, c, &mut Vec::new());
            }
        }
    }
}
