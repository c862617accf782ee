//! Fault behaviour of the soft-NIC: what hostile or failing peers can and cannot do.

use super::TcpDevice;
use super::wire::{self, Attach, Op, Request};
use crate::conformance::exec;
use crate::{Access, Device, QueuePair, SendWr, WcStatus};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

const TOKEN: &[u8] = b"fault test token";

struct Server {
    device: Arc<TcpDevice>,
    qp: Arc<dyn QueuePair>,
    region: crate::Region,
    _peer: (Arc<TcpDevice>, Arc<dyn QueuePair>),
}

/// A device with a region full of 0xAB and a connected (ready) RC queue pair for raw
/// clients to attach to.
fn server() -> Server {
    let device = TcpDevice::bind("127.0.0.1:0", TOKEN).unwrap();
    let peer = TcpDevice::bind("127.0.0.1:0", TOKEN).unwrap();
    let (cq, pcq) = (device.create_cq(64).unwrap(), peer.create_cq(64).unwrap());
    let (qp, peer_qp) = crate::connect_rc((device.as_ref(), &cq), (peer.as_ref(), &pcq)).unwrap();
    let region = device.register(4096, Access::ALL).unwrap();
    region.write(0, &[0xAB; 4096]).unwrap();
    Server {
        device,
        qp,
        region,
        _peer: (peer, peer_qp),
    }
}

fn raw_client(s: &Server) -> TcpStream {
    let mut stream = TcpStream::connect(s.device.local_addr()).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let attach = Attach {
        src_node: 9,
        src_qpn: 9,
        dst_qpn: s.qp.endpoint().qpn,
        rnr_retry: 0,
        rnr_timer_us: 0,
    };
    wire::client_handshake(&mut stream, TOKEN, attach).unwrap();
    stream
}

/// A real client through the fabric API, to show the server still works.
fn check_server_alive(s: &Server) {
    let client = TcpDevice::bind("127.0.0.1:0", TOKEN).unwrap();
    let (ccq, scq) = (
        client.create_cq(16).unwrap(),
        s.device.create_cq(16).unwrap(),
    );
    let (_sq, cq_qp) =
        crate::connect_rc((s.device.as_ref(), &scq), (client.as_ref(), &ccq)).unwrap();
    let local = client.register(64, Access::ALL).unwrap();
    let wc = exec(
        &cq_qp,
        &ccq,
        SendWr::read(1, local.buf(0, 64), s.region.remote_addr(0)),
    );
    assert_eq!(wc.status, WcStatus::Success);
    assert_eq!(local.to_vec(0, 64).unwrap(), vec![0xAB; 64]);
}

/// The region still holds what `server` wrote, and the server still serves a client.
fn assert_whole_and_serving(s: &Server, why: &str) {
    assert_eq!(s.region.to_vec(0, 4096).unwrap(), vec![0xAB; 4096], "{why}");
    check_server_alive(s);
}

fn read_to_end(stream: &mut TcpStream) -> Vec<u8> {
    let mut all = Vec::new();
    let _ = stream.read_to_end(&mut all);
    all
}

#[test]
fn malformed_frames_get_an_error_reply_and_a_closed_connection() {
    let s = server();
    for garbage in [
        vec![3, 0, 0, 0, 1, 9, 0],    // a request frame of 9 items with no items
        vec![4, 0, 0, 0, 7, 0, 0, 0], // an unknown frame kind
        vec![
            40, 0, 0, 0, 1, 1, 0, 99, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
            0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
        ], // unknown op
        vec![0xff, 0xff, 0xff, 0x7f], // a 2 GiB frame
    ] {
        let mut c = raw_client(&s);
        c.write_all(&garbage).unwrap();
        let reply = read_to_end(&mut c);
        assert!(reply.len() >= 7, "no error frame for {garbage:?}");
        assert_eq!(reply[4], wire::KIND_ERROR, "{garbage:?}");
    }
    assert_whole_and_serving(&s, "memory untouched");
}

#[test]
fn garbage_instead_of_a_handshake_is_dropped() {
    let s = server();
    let mut c = TcpStream::connect(s.device.local_addr()).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    c.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let reply = read_to_end(&mut c);
    assert!(
        reply.is_empty(),
        "nothing is answered to a stranger: {reply:?}"
    );
    check_server_alive(&s);
}

#[test]
fn a_wrong_token_gets_no_access() {
    let s = server();
    let mut c = TcpStream::connect(s.device.local_addr()).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let attach = Attach {
        src_node: 1,
        src_qpn: 1,
        dst_qpn: s.qp.endpoint().qpn,
        rnr_retry: 0,
        rnr_timer_us: 0,
    };
    let err = wire::client_handshake(&mut c, b"not the token", attach).unwrap_err();
    assert!(err.contains("token"), "{err}");
    let other = TcpDevice::bind("127.0.0.1:0", b"another cluster!").unwrap();
    let (ocq, scq) = (other.create_cq(4).unwrap(), s.device.create_cq(4).unwrap());
    let err = crate::connect_rc((s.device.as_ref(), &scq), (other.as_ref(), &ocq))
        .err()
        .expect("refused");
    assert!(err.to_string().contains("token"), "{err}");
}

#[test]
fn a_client_vanishing_mid_batch_leaves_memory_whole() {
    let s = server();
    let mut c = raw_client(&s);
    // A frame promising 4 KiB of WRITE payload that stops after 100 bytes.
    let mut frame = Vec::new();
    let start = wire::begin_frame(&mut frame, wire::KIND_REQUESTS);
    let payload = vec![0x11; 4000];
    wire::put_request(
        &mut frame,
        &Request {
            op: Op::Write,
            rkey: s.region.rkey(),
            offset: 0,
            len: 4000,
            a: 0,
            b: 0,
            imm: 0,
            payload: &payload,
        },
    );
    wire::finish_frame(&mut frame, start, 1);
    c.write_all(&frame[..100]).unwrap();
    drop(c);
    std::thread::sleep(Duration::from_millis(50));
    assert_whole_and_serving(&s, "a partial frame never executes");
}

#[test]
fn bad_requests_never_touch_memory_outside_their_region() {
    let s = server();
    let neighbour = s.device.register(4096, Access::ALL).unwrap();
    neighbour.write(0, &[0xCD; 4096]).unwrap();
    let mut c = raw_client(&s);
    let mut frame = Vec::new();
    let start = wire::begin_frame(&mut frame, wire::KIND_REQUESTS);
    let payload = vec![0x22; 64];
    // Starts inside the region and runs past its end.
    wire::put_request(
        &mut frame,
        &Request {
            op: Op::Write,
            rkey: s.region.rkey(),
            offset: 4090,
            len: 64,
            a: 0,
            b: 0,
            imm: 0,
            payload: &payload,
        },
    );
    // Then a valid WRITE, which must be flushed, not executed, after the error.
    wire::put_request(
        &mut frame,
        &Request {
            op: Op::Write,
            rkey: s.region.rkey(),
            offset: 0,
            len: 64,
            a: 0,
            b: 0,
            imm: 0,
            payload: &payload,
        },
    );
    wire::finish_frame(&mut frame, start, 2);
    c.write_all(&frame).unwrap();
    let mut body = Vec::new();
    assert!(wire::read_frame(&mut c, &mut body).unwrap());
    let (kind, count, mut items) = wire::frame_header(&body).unwrap();
    assert_eq!((kind, count), (wire::KIND_RESPONSES, 2));
    assert_eq!(
        wire::status_from(items.u8("s").unwrap()),
        Some(WcStatus::RemoteAccess)
    );
    assert_eq!(
        wire::status_from(items.u8("s").unwrap()),
        Some(WcStatus::WrFlush)
    );
    assert_eq!(s.region.to_vec(0, 4096).unwrap(), vec![0xAB; 4096]);
    assert_eq!(neighbour.to_vec(0, 4096).unwrap(), vec![0xCD; 4096]);
}

#[test]
fn clients_see_a_clean_error_when_the_server_dies() {
    let server = TcpDevice::bind("127.0.0.1:0", TOKEN).unwrap();
    let client = TcpDevice::bind("127.0.0.1:0", TOKEN).unwrap();
    crate::conformance::owner_death_fails_cleanly(server, client);
}

#[test]
fn a_wildcard_address_is_refused_because_no_peer_could_dial_it() {
    let err = TcpDevice::bind("0.0.0.0:0", TOKEN).err().expect("refused");
    assert!(err.to_string().contains("wildcard"), "{err}");
}

/// SENDs that reached the responder's host are delivered even when the requester
/// destroys its queue pair right after posting them, with a response it never read
/// still in its socket (so the close is a reset): a NIC executes every request it
/// received, whatever became of the requester since. The responder used to stop at
/// the first response it could not write, losing the requests queued behind it.
#[test]
fn sends_received_before_the_requester_vanished_are_all_delivered() {
    const K: u64 = 16;
    let a = TcpDevice::bind("127.0.0.1:0", TOKEN).unwrap();
    let b = TcpDevice::bind("127.0.0.1:0", TOKEN).unwrap();
    let (acq, bcq) = (a.create_cq(64).unwrap(), b.create_cq(64).unwrap());
    let (aqp, bqp) = crate::connect_rc((a.as_ref(), &acq), (b.as_ref(), &bcq)).unwrap();
    let into = b.register(8 * K, Access::ALL).unwrap();
    for i in 0..K {
        bqp.post_recv(&[crate::RecvWr {
            wr_id: i,
            buf: into.buf(8 * i, 8),
        }])
        .unwrap();
    }
    // One SEND delivered and answered, its response left unread in the requester's
    // socket.
    aqp.post_send(&[SendWr::send(0, crate::Src::Inline(&0u64.to_ne_bytes()))])
        .unwrap();
    let first = crate::conformance::wait(&bcq, 1);
    assert_eq!(first[0].status, WcStatus::Success);
    std::thread::sleep(Duration::from_millis(50));
    // The rest, one frame each, and the queue pair destroyed at once.
    for i in 1..K {
        aqp.post_send(&[SendWr::send(i, crate::Src::Inline(&i.to_ne_bytes()))])
            .unwrap();
    }
    drop(aqp);
    let rest = crate::conformance::wait(&bcq, (K - 1) as usize);
    for (i, wc) in (1..K).zip(&rest) {
        assert_eq!((wc.wr_id, wc.status), (i, WcStatus::Success), "{rest:?}");
    }
    let got = into.to_vec(0, 8 * K as usize).unwrap();
    for i in 0..K {
        let at = 8 * i as usize;
        assert_eq!(got[at..at + 8], i.to_ne_bytes(), "message {i}");
    }
}

/// As above, with requests the requester's kernel had accepted but not yet transmitted
/// when the queue pair was destroyed: the responder stalls (no receive posted) so the
/// requests pile up unsent, and a response waits unread, so closing the socket outright
/// would be a reset, which discards whatever was never transmitted.
#[test]
fn sends_not_yet_transmitted_when_the_requester_vanishes_are_all_delivered() {
    const K: u64 = 16;
    const LEN: u64 = 16 * 1024;
    let a = TcpDevice::bind("127.0.0.1:0", TOKEN).unwrap();
    let b = TcpDevice::bind("127.0.0.1:0", TOKEN).unwrap();
    let (acq, bcq) = (a.create_cq(64).unwrap(), b.create_cq(64).unwrap());
    let forever = |c: crate::QpConfig| crate::QpConfig { rnr_retry: 7, ..c };
    let (aqp, bqp) =
        crate::connect_rc_with((a.as_ref(), &acq), (b.as_ref(), &bcq), forever).unwrap();
    let from = a.register(LEN * K, Access::ALL).unwrap();
    let into = b.register(LEN * K, Access::ALL).unwrap();
    let recv = |i: u64| {
        bqp.post_recv(&[crate::RecvWr {
            wr_id: i,
            buf: into.buf(LEN * i, LEN as u32),
        }])
        .unwrap()
    };
    recv(0);
    for i in 0..K {
        from.write(LEN * i, &[i as u8; LEN as usize]).unwrap();
    }
    std::thread::scope(|s| {
        // Lets the responder go on only once the requester has gone (or, should the
        // requests not fit in the sockets, has been waiting for it a while).
        let (gone, wait) = std::sync::mpsc::channel::<()>();
        s.spawn(move || {
            let _ = wait.recv_timeout(Duration::from_secs(1));
            (1..K).for_each(recv);
        });
        for i in 0..K {
            aqp.post_send(&[SendWr::send(i, from.buf(LEN * i, LEN as u32))])
                .unwrap();
        }
        std::thread::sleep(Duration::from_millis(20));
        drop(aqp);
        drop(gone);
    });
    let all = crate::conformance::wait(&bcq, K as usize);
    for (i, wc) in (0..K).zip(&all) {
        assert_eq!((wc.wr_id, wc.status), (i, WcStatus::Success), "{all:?}");
    }
    let got = into.to_vec(0, (LEN * K) as usize).unwrap();
    for (i, message) in got.chunks(LEN as usize).enumerate() {
        assert!(message.iter().all(|&x| x == i as u8), "message {i}");
    }
}
