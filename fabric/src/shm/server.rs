//! The control server: the device's "NIC" endpoint on its Unix socket. It hands out
//! memory to authenticated peers and otherwise stays off the data path; a peer that
//! sends garbage or vanishes mid-request loses its connection and nothing else.

use super::ShmNode;
use super::control::{self, Request};
use super::qp;
use crate::addr::{NodeId, QpEndpoint};
use crate::device::QpKind;
use crate::memfd::reopen_read_only;
use crate::serve::{self, Server};
use std::os::fd::AsFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::Arc;
use std::sync::atomic::Ordering;

pub(super) fn accept_loop(node: Arc<ShmNode>, listener: UnixListener) {
    serve::accept_loop(node, listener.incoming(), "shm-control", serve);
}

fn serve(node: &Arc<ShmNode>, mut stream: UnixStream) {
    let Ok(peer) = control::accept(&mut stream, &node.token, node.id.0) else {
        return;
    };
    // Authenticated: an idle control connection is normal from here on.
    if stream.set_read_timeout(None).is_err() {
        return;
    }
    let peer = NodeId(peer);
    while let Ok(Some(request)) = control::next_request(&mut stream) {
        if node.is_shut_down() {
            return;
        }
        let answered = match request.op {
            control::KEYS => match node.keys.memory().read_only_fd() {
                Ok(fd) => control::respond(&stream, control::OK, &[fd.as_fd()]),
                Err(_) => control::respond(&stream, control::FAILED, &[]),
            },
            control::REGION => region(node, &stream, request.a),
            control::ATTACH => attach(node, &stream, peer, request),
            // Never answered: the peer waits for our end.
            control::WATCH => Ok(()),
            _ => {
                let _ = control::respond(&stream, control::MALFORMED, &[]);
                return;
            }
        };
        if answered.is_err() {
            return;
        }
    }
}

/// Hands out exported region `key`: read-write if peers may write or use atomics on
/// it, read-only otherwise.
fn region(node: &ShmNode, stream: &UnixStream, key: u32) -> std::io::Result<()> {
    let entry = crate::registry::lookup(&node.regions, key)
        .filter(|e| e.live.load(Ordering::Acquire) && e.access.intersects(super::REMOTE));
    let Some(entry) = entry else {
        return control::respond(stream, control::NO_SUCH_REGION, &[]);
    };
    let Some(fd) = entry.mem.fd() else {
        return control::respond(stream, control::FAILED, &[]);
    };
    let writable = entry
        .access
        .intersects(crate::Access::REMOTE_WRITE | crate::Access::REMOTE_ATOMIC);
    if writable {
        return control::respond(stream, control::OK, &[fd]);
    }
    match reopen_read_only(fd) {
        Ok(ro) => control::respond(stream, control::OK, &[ro.as_fd()]),
        Err(_) => control::respond(stream, control::FAILED, &[]),
    }
}

/// Gives sender queue pair `request.b` of `peer` a ring into queue pair `request.a`.
fn attach(
    node: &ShmNode,
    stream: &UnixStream,
    peer: NodeId,
    request: Request,
) -> std::io::Result<()> {
    let kind = match request.kind {
        control::KIND_RC => QpKind::Rc,
        control::KIND_UD => QpKind::Ud,
        _ => return control::respond(stream, control::MALFORMED, &[]),
    };
    let Some(target) = node.qp(request.a).filter(|q| q.kind == kind) else {
        return control::respond(stream, control::NO_SUCH_QP, &[]);
    };
    let from = QpEndpoint {
        node: peer,
        qpn: request.b,
    };
    match qp::attach(&target, from, super::PeerProcess::of(stream)) {
        Ok((block, ring)) => control::respond(stream, control::OK, &[block.as_fd(), ring.as_fd()]),
        Err(status) => control::respond(stream, status, &[]),
    }
}
