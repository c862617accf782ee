//! The soft-NIC's responder: executes the requests of authenticated peers against this
//! node's registered memory and queue pairs. It does only what a NIC's responder does:
//! protection checks, the memory operation, and message delivery. Nothing it reads from
//! the wire can make it panic or touch memory outside a registered region.

use super::TcpNode;
use super::qp::{Delivery, QpShared};
use super::wire::{self, Op, Request};
use crate::addr::{Access, QpEndpoint};
use crate::device::QpKind;
use crate::error::WcStatus;
use crate::memory;
use crate::registry::{self, RegEntry};
use crate::serve::{self, Server};
use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// Bytes one read of a connection takes at most.
const READ_CHUNK: usize = 64 * 1024;

pub(super) fn accept_loop(node: Arc<TcpNode>, listener: TcpListener) {
    serve::accept_loop(node, listener.incoming(), "tcp-responder", serve);
}

/// A responder's view of one connection.
struct Connection {
    node: Arc<TcpNode>,
    target: Arc<QpShared>,
    peer: QpEndpoint,
    rnr_deadline: Option<Duration>,
    /// Set after a failed request: like a responder that NAKed, it executes nothing
    /// more on this connection and answers every later request with a flush.
    failed: bool,
    cached: Option<Arc<RegEntry>>,
}

fn serve(node: &Arc<TcpNode>, mut stream: TcpStream) {
    let _ = stream.set_nodelay(true);
    let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
    let attach = match wire::server_handshake(&mut stream, &node.token, node.id.0) {
        Ok(a) => a,
        Err(_) => return,
    };
    let target = node.qp(attach.dst_qpn).filter(|q| q.kind() == QpKind::Rc);
    let Some(target) = target else {
        let _ = stream.write_all(&[wire::ATTACH_NO_SUCH_QP]);
        return;
    };
    if stream.write_all(&[wire::ATTACH_OK]).is_err() {
        return;
    }
    let _ = stream.set_read_timeout(None);
    let rnr_deadline = (attach.rnr_retry < 7)
        .then(|| Duration::from_micros(attach.rnr_timer_us as u64) * (attach.rnr_retry as u32 + 1));
    let mut conn = Connection {
        node: node.clone(),
        target,
        peer: QpEndpoint {
            node: crate::addr::NodeId(attach.src_node),
            qpn: attach.src_qpn,
        },
        rnr_deadline,
        failed: false,
        cached: None,
    };
    // Every whole frame one read brought is executed before the responses go out, in
    // one write: a requester with several doorbells in flight costs a read and a write
    // per batch of them rather than per frame.
    let mut inbuf: Vec<u8> = Vec::new();
    let mut chunk = vec![0u8; READ_CHUNK].into_boxed_slice();
    let mut responses = Vec::new();
    // Whether the requester still reads responses. Once it has gone (its queue pair
    // destroyed, perhaps with a reset because responses were left unread), the requests
    // it had already sent are still executed, as a NIC executes every packet it
    // received: only their responses have nowhere to go.
    let mut answering = true;
    loop {
        let mut consumed = 0;
        let mut refusal = None;
        loop {
            let body = match wire::next_frame(&inbuf[consumed..]) {
                Ok(Some(body)) => body,
                Ok(None) => break,
                Err(e) => {
                    refusal = Some(format!("bad frame: {e}"));
                    break;
                }
            };
            consumed += 4 + body.len();
            let mut requests = Vec::new();
            let decoded = wire::frame_header(body).and_then(|(kind, count, items)| {
                if kind != wire::KIND_REQUESTS {
                    return Err(wire::WireError(format!(
                        "expected a request frame, got kind {kind}"
                    )));
                }
                wire::decode_requests(count, items, &mut requests).map(|()| count)
            });
            let count = match decoded {
                Ok(count) => count,
                Err(e) => {
                    refusal = Some(format!("malformed request frame: {e}"));
                    break;
                }
            };
            // A SEND may wait for a receive the requester posts only once it has seen
            // the completions of what came before: those go out first.
            if requests.iter().any(|r| r.op.waits_for_a_receive()) {
                answer(&mut stream, &mut responses, &mut answering);
            }
            let start = wire::begin_frame(&mut responses, wire::KIND_RESPONSES);
            for request in &requests {
                conn.execute(request, &mut responses);
            }
            wire::finish_frame(&mut responses, start, count);
            if conn.node.is_shut_down() {
                answer(&mut stream, &mut responses, &mut answering);
                return;
            }
        }
        answer(&mut stream, &mut responses, &mut answering);
        if let Some(refusal) = refusal {
            let _ = stream.write_all(&wire::error_frame(&refusal));
            return;
        }
        inbuf.drain(..consumed);
        match stream.read(&mut chunk) {
            Ok(0) => return,
            Ok(n) => inbuf.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(_) => return,
        }
    }
}

/// Sends the responses gathered so far, if the requester still takes them.
fn answer(stream: &mut TcpStream, responses: &mut Vec<u8>, answering: &mut bool) {
    if *answering && !responses.is_empty() && stream.write_all(responses).is_err() {
        *answering = false;
    }
    responses.clear();
}

impl Connection {
    /// Appends the response to `request`: a status byte and, on success, the data of a
    /// READ or the old value of an atomic.
    fn execute(&mut self, request: &Request<'_>, out: &mut Vec<u8>) {
        if self.failed {
            out.push(wire::status_byte(WcStatus::WrFlush));
            return;
        }
        let status_at = out.len();
        out.push(0);
        let status = self.run(request, out);
        if status != WcStatus::Success {
            out.truncate(status_at);
            out.push(wire::status_byte(status));
            self.failed = true;
        }
    }

    fn region(&mut self, rkey: u32) -> Option<Arc<RegEntry>> {
        if let Some(e) = &self.cached
            && e.key == rkey
            && e.live.load(Ordering::Acquire)
        {
            return Some(e.clone());
        }
        let e = registry::lookup(&self.node.regions, rkey)?;
        self.cached = Some(e.clone());
        Some(e)
    }

    /// The region `request` targets, checked as an rkey is: it exists, the range is
    /// inside it, and it grants `need`.
    fn checked(&mut self, request: &Request<'_>, need: Access) -> Result<Arc<RegEntry>, WcStatus> {
        let region = self.region(request.rkey).ok_or(WcStatus::RemoteAccess)?;
        let in_bounds = request
            .offset
            .checked_add(request.len as u64)
            .is_some_and(|end| end <= region.len);
        if !in_bounds || !region.access.contains(need) {
            return Err(WcStatus::RemoteAccess);
        }
        Ok(region)
    }

    fn run(&mut self, request: &Request<'_>, out: &mut Vec<u8>) -> WcStatus {
        // One-sided requests touch memory inside the queue pair's gate, so that once it
        // is destroyed none is still writing; SENDs (and WRITE_WITH_IMM, which waits for
        // a receive) are checked without it.
        let target = self.target.clone();
        let _inside = match request.op {
            Op::Read | Op::Write | Op::Cas | Op::FetchAdd => match target.enter_memory() {
                Some(inside) => Some(inside),
                None => return WcStatus::RetryExceeded,
            },
            _ if !target.is_up() => return WcStatus::RetryExceeded,
            _ => None,
        };
        let result = match request.op {
            Op::Read => self.checked(request, Access::REMOTE_READ).map(|region| {
                let at = out.len();
                out.resize(at + request.len as usize, 0);
                memory::copy_out(region.mem.words(), request.offset, &mut out[at..]);
            }),
            Op::Write => self.checked(request, Access::REMOTE_WRITE).map(|region| {
                memory::copy_in(region.mem.words(), request.offset, request.payload);
            }),
            Op::WriteImm => match self.checked(request, Access::REMOTE_WRITE) {
                Err(e) => Err(e),
                Ok(region) => {
                    let write =
                        || memory::copy_in(region.mem.words(), request.offset, request.payload);
                    self.deliver_when_ready(request, Some(&write))
                }
            },
            Op::Send | Op::SendImm => self.deliver_when_ready(request, None),
            Op::Cas | Op::FetchAdd => {
                self.checked(request, Access::REMOTE_ATOMIC)
                    .and_then(|region| {
                        if !request.offset.is_multiple_of(8) {
                            return Err(WcStatus::RemoteAccess);
                        }
                        let word = &region.mem.words()[(request.offset / 8) as usize];
                        let old = if request.op == Op::Cas {
                            match word.compare_exchange(
                                request.a,
                                request.b,
                                Ordering::AcqRel,
                                Ordering::Acquire,
                            ) {
                                Ok(v) | Err(v) => v,
                            }
                        } else {
                            word.fetch_add(request.a, Ordering::AcqRel)
                        };
                        out.extend_from_slice(&old.to_le_bytes());
                        Ok(())
                    })
            }
        };
        match result {
            Ok(()) => WcStatus::Success,
            Err(status) => status,
        }
    }

    /// Delivers a SEND, or the notification of a WRITE_WITH_IMM, into the next posted
    /// receive of the connected queue pair. Without one it waits, as the requester's
    /// RNR retries would, up to the requester's RNR budget; RC order means nothing
    /// behind it on this connection may run meanwhile.
    fn deliver_when_ready(
        &mut self,
        request: &Request<'_>,
        write: Option<&dyn Fn()>,
    ) -> Result<(), WcStatus> {
        let imm = matches!(request.op, Op::SendImm | Op::WriteImm).then_some(request.imm);
        let start = Instant::now();
        loop {
            let outcome = match write {
                Some(write) => self
                    .target
                    .deliver_write_imm(request.len, imm, self.peer, write),
                None => self.target.deliver(request.payload, imm, self.peer, false),
            };
            match outcome {
                Delivery::Delivered => return Ok(()),
                Delivery::TooSmall => return Err(WcStatus::RemoteInvalidRequest),
                Delivery::ReceiverDown => return Err(WcStatus::RetryExceeded),
                Delivery::NoReceive => {}
            }
            let waited = start.elapsed();
            if self.rnr_deadline.is_some_and(|d| waited >= d) {
                return Err(WcStatus::RnrRetryExceeded);
            }
            if self.node.is_shut_down() {
                return Err(WcStatus::RetryExceeded);
            }
            let slice = self.rnr_deadline.map_or(Duration::from_millis(50), |d| {
                d.saturating_sub(waited).min(Duration::from_millis(50))
            });
            self.target.wait_for_receive(slice);
        }
    }
}

/// Receives UD datagrams for every UD queue pair of the node.
pub(super) fn datagram_loop(node: Arc<TcpNode>) {
    let mut buf = vec![0u8; wire::DATAGRAM_HEADER + crate::wr::UD_MTU as usize + 1];
    while !node.is_shut_down() {
        let Ok((n, _from)) = node.udp.recv_from(&mut buf) else {
            continue;
        };
        let Ok(d) = wire::decode_datagram(&buf[..n]) else {
            continue;
        };
        if d.payload.len() > crate::wr::UD_MTU as usize {
            continue;
        }
        let Some(qp) = node.qp(d.dst_qpn) else {
            continue;
        };
        if qp.kind() != QpKind::Ud || qp.qkey() != d.qkey {
            continue;
        }
        let src = QpEndpoint {
            node: crate::addr::NodeId(d.src_node),
            qpn: d.src_qpn,
        };
        // No receive posted: the datagram is dropped, as UD does.
        let _ = qp.deliver(d.payload, d.imm, src, true);
    }
}
