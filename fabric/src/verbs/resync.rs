//! Resynchronising the two halves of an RC connection after an error, out of band.
//!
//! ibverbs recovers a queue pair by RESET → INIT → RTR → RTS, and the two ends must
//! agree again on packet sequence numbers; a remote access error also breaks the
//! responder's half. So `recover` dials the peer device's resync endpoint (TCP, mutual
//! authentication with the cluster token), says which queue pair it recovers and the
//! PSN it will send next, and learns the PSNs the peer expects and sends. A request is
//! one fixed-size message and one fixed-size answer per connection.

use super::DeviceShared;
use crate::addr::{NodeId, QpEndpoint};
use crate::error::{FabricError, Result};
use crate::handshake::{self, Protocol};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

const PROTOCOL: Protocol = Protocol {
    magic: b"NAMDBVRS",
    version: 1,
    server_role: b"namdb verbs resync responder",
    client_role: b"namdb verbs resync requester",
};

/// How long either side waits on the other before giving up.
const PATIENCE: Duration = Duration::from_secs(10);

const REQUEST_BYTES: usize = 16;
const ANSWER_BYTES: usize = 9;

/// Answer codes.
const OK: u8 = 0;
const REFUSED: u8 = 2;

pub(crate) struct Request {
    pub(crate) target_qpn: u32,
    pub(crate) from: QpEndpoint,
    pub(crate) proposed_psn: u32,
}

impl Request {
    fn encode(&self) -> [u8; REQUEST_BYTES] {
        let mut b = [0u8; REQUEST_BYTES];
        b[0..4].copy_from_slice(&self.target_qpn.to_le_bytes());
        b[4..8].copy_from_slice(&self.from.node.0.to_le_bytes());
        b[8..12].copy_from_slice(&self.from.qpn.to_le_bytes());
        b[12..16].copy_from_slice(&self.proposed_psn.to_le_bytes());
        b
    }

    fn decode(b: &[u8; REQUEST_BYTES]) -> Request {
        let word = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        Request {
            target_qpn: word(0),
            from: QpEndpoint {
                node: NodeId(word(4)),
                qpn: word(8),
            },
            proposed_psn: word(12) & 0x00ff_ffff,
        }
    }
}

fn failed(to: SocketAddr, why: impl std::fmt::Display) -> FabricError {
    FabricError::Backend(format!(
        "verbs: cannot resynchronise with the peer's device at {to}: {why}"
    ))
}

/// Asks the device at `to` to resynchronise; returns (the PSN it expects next, the PSN
/// it sends next).
pub(crate) fn request(to: SocketAddr, token: &[u8], req: Request) -> Result<(u32, u32)> {
    let mut stream = TcpStream::connect_timeout(&to, PATIENCE).map_err(|e| failed(to, e))?;
    let _ = stream.set_read_timeout(Some(PATIENCE));
    let _ = stream.set_write_timeout(Some(PATIENCE));
    handshake::client(&mut stream, token, &PROTOCOL, &req.encode()).map_err(|e| failed(to, e))?;
    let mut answer = [0u8; ANSWER_BYTES];
    stream
        .read_exact(&mut answer)
        .map_err(|e| failed(to, format_args!("no answer ({e})")))?;
    let word = |i: usize| u32::from_le_bytes(answer[i..i + 4].try_into().expect("4 bytes"));
    match answer[0] {
        OK => Ok((word(1), word(5))),
        _ => Err(failed(
            to,
            format_args!(
                "it has no queue pair {} connected to {}, or could not reset it",
                req.target_qpn, req.from
            ),
        )),
    }
}

/// The bound resync endpoint of a device, before and while it serves.
pub(crate) struct Listener {
    listener: Option<TcpListener>,
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
}

impl Listener {
    pub(crate) fn bind(addr: SocketAddr) -> Result<Listener> {
        if addr.ip().is_unspecified() {
            return Err(FabricError::Backend(format!(
                "verbs: the resync endpoint {addr} is a wildcard, which peers cannot dial; \
                 name this host's reachable address"
            )));
        }
        let listener = TcpListener::bind(addr).map_err(|e| {
            FabricError::Backend(format!(
                "verbs: cannot listen for resync requests on {addr}: {e}"
            ))
        })?;
        let addr = listener
            .local_addr()
            .map_err(|e| FabricError::Backend(format!("verbs: resync endpoint: {e}")))?;
        Ok(Listener {
            listener: Some(listener),
            addr,
            stop: Arc::new(AtomicBool::new(false)),
        })
    }

    pub(crate) fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Serves requests for `device`'s queue pairs on a thread of its own until `stop`.
    pub(crate) fn serve(mut self, device: Weak<DeviceShared>) -> Listener {
        let listener = self.listener.take().expect("served once");
        let stop = self.stop.clone();
        let spawned = std::thread::Builder::new()
            .name("namdb-verbs-resync".into())
            .spawn(move || {
                for stream in listener.incoming() {
                    if stop.load(Ordering::Acquire) {
                        return;
                    }
                    let (Ok(stream), Some(device)) = (stream, device.upgrade()) else {
                        continue;
                    };
                    // One short exchange per connection, bounded by PATIENCE.
                    let _ = std::thread::Builder::new()
                        .name("namdb-verbs-resync-conn".into())
                        .spawn(move || answer(&device, stream));
                }
            });
        if spawned.is_err() {
            // Without the thread nobody answers; peers' recover then fails with a clear
            // error rather than this device failing to open.
            self.stop.store(true, Ordering::Release);
        }
        self
    }

    pub(crate) fn stop(&self) {
        if !self.stop.swap(true, Ordering::AcqRel) {
            // Wakes the accept loop, which then sees the flag.
            let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
        }
    }
}

fn answer(device: &DeviceShared, mut stream: TcpStream) {
    let _ = stream.set_read_timeout(Some(PATIENCE));
    let _ = stream.set_write_timeout(Some(PATIENCE));
    let Ok(raw) =
        handshake::server::<REQUEST_BYTES>(&mut stream, &device.token, &PROTOCOL, device.node.0)
    else {
        return;
    };
    let req = Request::decode(&raw);
    let result = device
        .qp(req.target_qpn)
        .ok_or(())
        .and_then(|qp| qp.resync(req.from, req.proposed_psn).map_err(|_| ()));
    let mut out = [0u8; ANSWER_BYTES];
    match result {
        Ok((expected, sq)) => {
            out[0] = OK;
            out[1..5].copy_from_slice(&expected.to_le_bytes());
            out[5..9].copy_from_slice(&sq.to_le_bytes());
        }
        Err(()) => out[0] = REFUSED,
    }
    let _ = stream.write_all(&out);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_round_trip() {
        let req = Request {
            target_qpn: 17,
            from: QpEndpoint {
                node: NodeId(3),
                qpn: 99,
            },
            proposed_psn: 0xabcdef,
        };
        let back = Request::decode(&req.encode());
        assert_eq!(
            (back.target_qpn, back.from, back.proposed_psn),
            (17, req.from, 0xabcdef)
        );
    }

    #[test]
    fn a_wildcard_endpoint_is_refused() {
        let err = Listener::bind("0.0.0.0:0".parse().unwrap()).err().unwrap();
        assert!(err.to_string().contains("wildcard"), "{err}");
    }
}
