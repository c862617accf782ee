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
    raw_client_with_rnr(s, 0, 0)
}

/// A raw client whose SENDs wait up to `rnr_timer_us × (rnr_retry + 1)` for a receive.
fn raw_client_with_rnr(s: &Server, rnr_retry: u8, rnr_timer_us: u32) -> TcpStream {
    let mut stream = TcpStream::connect(s.device.local_addr()).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let attach = Attach {
        src_node: 9,
        src_qpn: 9,
        dst_qpn: s.qp.endpoint().qpn,
        rnr_retry,
        rnr_timer_us,
    };
    wire::client_handshake(&mut stream, TOKEN, attach).unwrap();
    stream
}

/// A client device connected over RC to `s`'s device, with a registered 4 KiB buffer.
struct Client {
    _device: Arc<TcpDevice>,
    _server_qp: Arc<dyn QueuePair>,
    qp: Arc<dyn QueuePair>,
    cq: Arc<dyn crate::CompletionQueue>,
    local: crate::Region,
}

fn client_of(s: &Server) -> Client {
    let device = TcpDevice::bind("127.0.0.1:0", TOKEN).unwrap();
    let (cq, scq) = (
        device.create_cq(64).unwrap(),
        s.device.create_cq(64).unwrap(),
    );
    let (server_qp, qp) =
        crate::connect_rc((s.device.as_ref(), &scq), (device.as_ref(), &cq)).unwrap();
    let local = device.register(4096, Access::ALL).unwrap();
    Client {
        _device: device,
        _server_qp: server_qp,
        qp,
        cq,
        local,
    }
}

/// A real client through the fabric API, to show the server still works.
fn check_server_alive(s: &Server) {
    let c = client_of(s);
    let wc = exec(
        &c.qp,
        &c.cq,
        SendWr::read(1, c.local.buf(0, 64), s.region.remote_addr(0)),
    );
    assert_eq!(wc.status, WcStatus::Success);
    assert_eq!(c.local.to_vec(0, 64).unwrap(), vec![0xAB; 64]);
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

/// `wrs`' futures, each polled until ready (at most 10 s); how many polls that took.
fn poll_until_ready(futures: &mut [std::pin::Pin<Box<crate::Batch<'_, '_>>>]) -> usize {
    use std::future::Future;
    use std::task::{Context, Poll, Waker};
    let mut cx = Context::from_waker(Waker::noop());
    let mut done = vec![false; futures.len()];
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let mut polls = 0;
    while done.iter().any(|d| !d) {
        assert!(
            std::time::Instant::now() < deadline,
            "batches still pending"
        );
        for (f, d) in futures.iter_mut().zip(done.iter_mut()) {
            if !*d && let Poll::Ready(r) = f.as_mut().poll(&mut cx) {
                r.unwrap();
                *d = true;
            }
        }
        polls += 1;
    }
    polls
}

/// A client of `s` and an `AsyncQp` over its queue pair.
fn async_client(s: &Server) -> (Client, crate::AsyncQp) {
    let c = client_of(s);
    let qp = crate::AsyncQp::new(c.qp.clone(), crate::CqDriver::new(c.cq.clone()));
    (c, qp)
}

#[test]
fn held_batches_cross_only_at_the_ring_and_then_complete() {
    use std::future::Future;
    use std::task::{Context, Waker};
    let s = server();
    let (client, qp) = async_client(&s);
    let local = &client.local;
    local.write(0, &[7; 192]).unwrap();
    let wrs: Vec<SendWr<'_>> = (0..3u64)
        .map(|i| SendWr::write(i, local.buf(i * 64, 64), s.region.remote_addr(i * 64)))
        .collect();
    let doorbells = crate::hold_doorbells();
    let mut futures: Vec<_> = wrs.iter().map(|wr| Box::pin(qp.run_one(*wr))).collect();
    let mut cx = Context::from_waker(Waker::noop());
    for _ in 0..3 {
        for f in &mut futures {
            assert!(f.as_mut().poll(&mut cx).is_pending(), "nothing was sent");
        }
        std::thread::sleep(Duration::from_millis(30));
    }
    assert_eq!(
        s.region.to_vec(0, 192).unwrap(),
        vec![0xAB; 192],
        "a held WRITE reached the responder before the ring"
    );
    doorbells.ring();
    poll_until_ready(&mut futures);
    assert_eq!(s.region.to_vec(0, 192).unwrap(), vec![7; 192]);
    assert_eq!(s.region.to_vec(192, 64).unwrap(), vec![0xAB; 64]);
}

#[test]
fn a_held_doorbell_rings_by_itself_for_a_thread_that_waits_without_ringing() {
    let s = server();
    let (client, qp) = async_client(&s);
    let local = &client.local;
    let _doorbells = crate::hold_doorbells();
    let read = SendWr::read(1, local.buf(0, 64), s.region.remote_addr(0));
    let mut futures = vec![Box::pin(qp.run_one(read))];
    let polls = poll_until_ready(&mut futures);
    assert_eq!(local.to_vec(0, 64).unwrap(), vec![0xAB; 64]);
    assert!(
        polls > 64,
        "the READ completed after {polls} polls: its doorbell was not held"
    );
}

/// One request frame of `requests`.
fn request_frame(requests: &[Request<'_>]) -> Vec<u8> {
    let mut frame = Vec::new();
    let start = wire::begin_frame(&mut frame, wire::KIND_REQUESTS);
    for r in requests {
        wire::put_request(&mut frame, r);
    }
    wire::finish_frame(&mut frame, start, requests.len() as u16);
    frame
}

fn read_request(s: &Server, offset: u64) -> Request<'static> {
    Request {
        op: Op::Read,
        rkey: s.region.rkey(),
        offset,
        len: 8,
        a: 0,
        b: 0,
        imm: 0,
        payload: &[],
    }
}

/// The statuses of one response frame read from `c`.
fn response_statuses(c: &mut TcpStream) -> Vec<WcStatus> {
    let mut body = Vec::new();
    assert!(wire::read_frame(c, &mut body).unwrap());
    let (kind, count, mut items) = wire::frame_header(&body).unwrap();
    assert_eq!(kind, wire::KIND_RESPONSES);
    (0..count)
        .map(|_| {
            let status = wire::status_from(items.u8("status").unwrap()).unwrap();
            if status == WcStatus::Success {
                items.take(8, "READ data").unwrap();
            }
            status
        })
        .collect()
}

#[test]
fn frames_that_arrive_together_are_each_answered_in_order() {
    let s = server();
    let mut c = raw_client(&s);
    let mut bytes = Vec::new();
    for n in 1..=3 {
        let reads: Vec<_> = (0..n).map(|i| read_request(&s, 8 * i)).collect();
        bytes.extend_from_slice(&request_frame(&reads));
    }
    // Cut short: the fourth frame's last byte comes later, and it is executed then.
    let fourth = request_frame(&[read_request(&s, 0)]);
    bytes.extend_from_slice(&fourth[..fourth.len() - 1]);
    c.write_all(&bytes).unwrap();
    for n in 1..=3 {
        assert_eq!(response_statuses(&mut c), vec![WcStatus::Success; n]);
    }
    c.write_all(&fourth[fourth.len() - 1..]).unwrap();
    assert_eq!(response_statuses(&mut c), vec![WcStatus::Success]);
}

#[test]
fn a_send_waiting_for_a_receive_does_not_hold_back_the_answers_before_it() {
    let s = server();
    // SENDs wait 3 s for a receive; none is ever posted.
    let mut c = raw_client_with_rnr(&s, 2, 1_000_000);
    let send = Request {
        op: Op::Send,
        rkey: 0,
        offset: 0,
        len: 4,
        a: 0,
        b: 0,
        imm: 0,
        payload: b"ping",
    };
    let mut bytes = request_frame(&[read_request(&s, 0)]);
    bytes.extend_from_slice(&request_frame(&[send]));
    c.write_all(&bytes).unwrap();
    c.set_read_timeout(Some(Duration::from_millis(1500)))
        .unwrap();
    assert_eq!(
        response_statuses(&mut c),
        vec![WcStatus::Success],
        "the READ's answer waited for the SEND behind it"
    );
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    assert_eq!(response_statuses(&mut c), vec![WcStatus::RnrRetryExceeded]);
}

/// A peer that completes the handshake as node `id` and then neither answers nor, with
/// `reads` false, takes a byte: a stopped or wedged host. It keeps the connection open
/// until `release` is dropped.
fn silent_peer(
    id: u32,
    reads: bool,
) -> (
    std::net::SocketAddr,
    std::sync::mpsc::Sender<()>,
    std::thread::JoinHandle<()>,
) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let (release, released) = std::sync::mpsc::channel::<()>();
    let peer = std::thread::spawn(move || {
        let (mut stream, _) = listener.accept().unwrap();
        wire::server_handshake(&mut stream, TOKEN, id).unwrap();
        stream.write_all(&[wire::ATTACH_OK]).unwrap();
        if reads {
            stream
                .set_read_timeout(Some(Duration::from_millis(20)))
                .unwrap();
            let mut sink = [0u8; 4096];
            while released.try_recv() == Err(std::sync::mpsc::TryRecvError::Empty) {
                if let Ok(0) = stream.read(&mut sink) {
                    break;
                }
            }
        } else {
            let _ = released.recv();
        }
    });
    (addr, release, peer)
}

/// A requester's queue pair connected to the silent peer at `addr` (node `id`), with
/// a transport timeout of `timeout`.
fn requester_of_silent_peer(
    addr: std::net::SocketAddr,
    id: u32,
    timeout: Duration,
) -> (
    Arc<TcpDevice>,
    Arc<dyn QueuePair>,
    Arc<dyn crate::CompletionQueue>,
) {
    let device = TcpDevice::bind("127.0.0.1:0", TOKEN).unwrap();
    device
        .add_peer(crate::NodeId(id), &format!("tcp:{addr}"))
        .unwrap();
    let cq = device.create_cq(64).unwrap();
    let config = crate::QpConfig {
        transport_timeout: timeout,
        ..crate::QpConfig::rc(&cq)
    };
    let qp = device.create_qp(&config).unwrap();
    qp.connect(crate::QpEndpoint {
        node: crate::NodeId(id),
        qpn: 1,
    })
    .unwrap();
    (device, qp, cq)
}

/// A READ to a host that stopped answering completed never: the requester polled for
/// ever (the transaction layer gave up only after 30 s). Now the transport timer ends
/// it as a NIC's retries would: the oldest request fails with `RetryExceeded` after
/// the timeout, the one behind it is flushed, and the queue pair is broken.
#[test]
fn a_peer_that_never_answers_fails_the_oldest_request_after_the_transport_timeout() {
    const ID: u32 = 0x51_1e47;
    let timeout = Duration::from_millis(300);
    let (addr, release, peer) = silent_peer(ID, true);
    let (device, qp, cq) = requester_of_silent_peer(addr, ID, timeout);
    let local = device.register(4096, Access::ALL).unwrap();
    let remote = crate::RemoteAddr {
        node: crate::NodeId(ID),
        rkey: 7,
        offset: 0,
    };
    let started = std::time::Instant::now();
    qp.post_send(&[
        SendWr::read(1, local.buf(0, 64), remote),
        SendWr::write(2, local.buf(64, 64), remote),
    ])
    .unwrap();
    let got = crate::conformance::wait(&cq, 2);
    let waited = started.elapsed();
    assert_eq!(
        got.iter().map(|c| (c.wr_id, c.status)).collect::<Vec<_>>(),
        [(1, WcStatus::RetryExceeded), (2, WcStatus::WrFlush)]
    );
    assert!(
        waited >= timeout,
        "failed after {waited:?}, before the timeout"
    );
    assert!(waited < Duration::from_secs(10), "took {waited:?}");
    assert_eq!(qp.state(), crate::QpState::Error);
    drop(release);
    peer.join().unwrap();
}

/// A host that stopped reading its socket: a post of more than the sockets hold used
/// to spin in the write for ever, holding the queue pair. Now the post returns once
/// the timer runs out, and its requests fail.
#[test]
fn a_peer_that_takes_nothing_cannot_hang_a_post() {
    const ID: u32 = 0x51_1e48;
    const LEN: u32 = 2 << 20;
    let timeout = Duration::from_millis(300);
    let (addr, release, peer) = silent_peer(ID, false);
    let (device, qp, cq) = requester_of_silent_peer(addr, ID, timeout);
    let local = device.register(LEN as u64, Access::ALL).unwrap();
    let remote = crate::RemoteAddr {
        node: crate::NodeId(ID),
        rkey: 7,
        offset: 0,
    };
    // 64 MiB: far more than loopback's socket buffers take.
    let wrs: Vec<SendWr<'_>> = (0..32)
        .map(|i| SendWr::write(i, local.buf(0, LEN), remote))
        .collect();
    let started = std::time::Instant::now();
    qp.post_send(&wrs).unwrap();
    let got = crate::conformance::wait(&cq, 1);
    assert_eq!(got[0].status, WcStatus::RetryExceeded, "{got:?}");
    assert!(started.elapsed() < Duration::from_secs(10));
    assert_eq!(qp.state(), crate::QpState::Error);
    drop(release);
    peer.join().unwrap();
}

/// A SEND waiting at the responder for a receive (RNR, retried for ever) leaves the
/// connection silent for longer than the transport timeout: that is no dead peer, and
/// the SEND completes once the receive is posted.
#[test]
fn a_send_waiting_for_a_receive_outlives_the_transport_timeout() {
    let a = TcpDevice::bind("127.0.0.1:0", TOKEN).unwrap();
    let b = TcpDevice::bind("127.0.0.1:0", TOKEN).unwrap();
    let (acq, bcq) = (a.create_cq(64).unwrap(), b.create_cq(64).unwrap());
    let patient = |c: crate::QpConfig| crate::QpConfig {
        rnr_retry: 7,
        transport_timeout: Duration::from_millis(100),
        ..c
    };
    let (aqp, bqp) =
        crate::connect_rc_with((a.as_ref(), &acq), (b.as_ref(), &bcq), patient).unwrap();
    let from = a.register(64, Access::ALL).unwrap();
    let into = b.register(64, Access::ALL).unwrap();
    from.write(0, &[7; 64]).unwrap();
    aqp.post_send(&[SendWr::send(1, from.buf(0, 64))]).unwrap();
    // Polled all along, as a waiting requester does.
    let deadline = std::time::Instant::now() + Duration::from_millis(600);
    let mut wc = [crate::Completion::default(); 1];
    while std::time::Instant::now() < deadline {
        assert_eq!(acq.poll(&mut wc).unwrap(), 0, "{wc:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
    bqp.post_recv(&[crate::RecvWr {
        wr_id: 9,
        buf: into.buf(0, 64),
    }])
    .unwrap();
    let sent = crate::conformance::wait(&acq, 1);
    assert_eq!(sent[0].status, WcStatus::Success, "{sent:?}");
    assert_eq!(
        crate::conformance::wait(&bcq, 1)[0].status,
        WcStatus::Success
    );
    assert_eq!(into.to_vec(0, 64).unwrap(), vec![7; 64]);
}

#[test]
fn a_zero_transport_timeout_is_refused() {
    let device = TcpDevice::bind("127.0.0.1:0", TOKEN).unwrap();
    let cq = device.create_cq(4).unwrap();
    let config = crate::QpConfig {
        transport_timeout: Duration::ZERO,
        ..crate::QpConfig::rc(&cq)
    };
    let err = device
        .create_qp(&config)
        .err()
        .expect("refused")
        .to_string();
    assert!(err.contains("transport timeout"), "{err}");
}

/// Destroying a queue pair waits for the one-sided request its responder is executing,
/// and refuses every later one: a memory server's fence of a compute node (ending its
/// sessions) then leaves nothing of it still writing.
#[test]
fn destroying_a_queue_pair_waits_for_the_request_touching_memory_and_refuses_later_ones() {
    let s = server();
    let target = s
        .device
        .node
        .qp(s.qp.endpoint().qpn)
        .expect("the queue pair");
    let inside = target
        .enter_memory()
        .expect("a ready queue pair lets a request in");
    let Server { qp, .. } = s;
    let destroyed = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let destroyer = {
        let destroyed = destroyed.clone();
        std::thread::spawn(move || {
            drop(qp);
            destroyed.store(true, std::sync::atomic::Ordering::SeqCst);
        })
    };
    std::thread::sleep(Duration::from_millis(100));
    assert!(
        !destroyed.load(std::sync::atomic::Ordering::SeqCst),
        "destroyed while a request was touching memory"
    );
    drop(inside);
    destroyer.join().unwrap();
    assert!(destroyed.load(std::sync::atomic::Ordering::SeqCst));
    assert!(target.enter_memory().is_none(), "a later request got in");
}
