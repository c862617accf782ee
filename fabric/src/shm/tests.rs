//! Fault behaviour of the shm backend: what hostile, vanishing or dead peers can and
//! cannot do.

use super::ShmDevice;
use super::control::{self, Request};
use crate::conformance::{drain, exec, wait};
use crate::memfd::MemfdMemory;
use crate::memory::Memory;
use crate::{
    Access, Device, HeapMemory, NodeId, QpConfig, QpEndpoint, QpState, RecvWr, Region, SendWr, Src,
    WcStatus,
};
use std::io::{Read, Write};
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

const TOKEN: &[u8] = b"fault test token";

fn device(dir: &Path, name: &str) -> Arc<ShmDevice> {
    ShmDevice::bind(dir.join(name), TOKEN).unwrap()
}

struct Server {
    dir: tempfile::TempDir,
    device: Arc<ShmDevice>,
    region: Region,
}

/// A device with a region full of 0xAB.
fn server() -> Server {
    let dir = tempfile::tempdir().unwrap();
    let device = device(dir.path(), "server.sock");
    let region = device.register(4096, Access::ALL).unwrap();
    region.write(0, &[0xAB; 4096]).unwrap();
    Server {
        dir,
        device,
        region,
    }
}

/// A fresh client through the fabric API reads the region as the server has it.
fn check_server_alive(s: &Server) {
    let client = device(
        s.dir.path(),
        &format!("client-{}.sock", rand::random::<u32>()),
    );
    let (ccq, scq) = (
        client.create_cq(16).unwrap(),
        s.device.create_cq(16).unwrap(),
    );
    let (_sq, qp) = crate::connect_rc((s.device.as_ref(), &scq), (client.as_ref(), &ccq)).unwrap();
    let local = client.register(4096, Access::ALL).unwrap();
    let wc = exec(
        &qp,
        &ccq,
        SendWr::read(1, local.buf(0, 4096), s.region.remote_addr(0)),
    );
    assert_eq!(wc.status, WcStatus::Success);
    assert!(local.to_vec(0, 4096).unwrap() == s.region.to_vec(0, 4096).unwrap());
}

/// The server's region holds 0xAB everywhere but `[from, to)`.
fn assert_intact_outside(s: &Server, from: u64, to: u64) {
    let bytes = s.region.to_vec(0, 4096).unwrap();
    let stray = (0..4096u64).find(|&i| (i < from || i >= to) && bytes[i as usize] != 0xAB);
    assert_eq!(stray, None, "a byte outside [{from}, {to}) changed");
}

/// An authenticated raw connection to the server's control socket.
fn raw_client(s: &Server) -> UnixStream {
    control::dial(s.device.path(), TOKEN, 9).unwrap().0
}

fn read_to_end(stream: &mut UnixStream) -> Vec<u8> {
    let mut all = Vec::new();
    let _ = stream.read_to_end(&mut all);
    all
}

#[test]
fn a_wrong_token_gets_no_access() {
    let s = server();
    let err = control::dial(s.device.path(), b"not the token", 1).unwrap_err();
    assert!(err.contains("token"), "{err}");
    let other = ShmDevice::bind(s.dir.path().join("other.sock"), b"another cluster!").unwrap();
    let (ocq, scq) = (other.create_cq(4).unwrap(), s.device.create_cq(4).unwrap());
    let err = crate::connect_rc((s.device.as_ref(), &scq), (other.as_ref(), &ocq))
        .err()
        .expect("refused");
    assert!(err.to_string().contains("token"), "{err}");
    check_server_alive(&s);
}

#[test]
fn garbage_instead_of_a_handshake_is_dropped() {
    let s = server();
    let mut c = UnixStream::connect(s.device.path()).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    c.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    assert!(
        read_to_end(&mut c).is_empty(),
        "nothing is answered to a stranger"
    );
    check_server_alive(&s);
}

#[test]
fn a_peer_vanishing_mid_request_leaves_the_device_serving() {
    let s = server();
    // Half a hello, then gone.
    let mut c = UnixStream::connect(s.device.path()).unwrap();
    c.write_all(b"NAMDB").unwrap();
    drop(c);
    // Authenticated, half a request, then gone.
    let mut c = raw_client(&s);
    c.write_all(&[control::REGION, 0, 0, 0, 1, 2, 3, 4])
        .unwrap();
    drop(c);
    // An unknown request is refused and the connection closed.
    let mut c = raw_client(&s);
    c.write_all(&[99; 16]).unwrap();
    let reply = read_to_end(&mut c);
    assert_eq!(reply.first(), Some(&control::MALFORMED));
    check_server_alive(&s);
}

#[test]
fn a_client_dying_mid_batch_leaves_the_server_whole() {
    let s = server();
    let client = device(s.dir.path(), "dying.sock");
    let (ccq, scq) = (
        client.create_cq(256).unwrap(),
        s.device.create_cq(256).unwrap(),
    );
    let (server_qp, qp) =
        crate::connect_rc((s.device.as_ref(), &scq), (client.as_ref(), &ccq)).unwrap();
    let inbox = s.device.register(64 * 16, Access::LOCAL_WRITE).unwrap();
    let recvs: Vec<RecvWr> = (0..16)
        .map(|i| RecvWr {
            wr_id: i,
            buf: inbox.buf(i * 64, 64),
        })
        .collect();
    server_qp.post_recv(&recvs).unwrap();
    let batch: Vec<SendWr> = (0..8u64)
        .flat_map(|i| {
            [
                SendWr::send(i, Src::Inline(b"hello")).unsignaled(),
                SendWr::write(
                    i,
                    Src::Inline(&[0x11; 8]),
                    s.region.remote_addr(1024 + i * 8),
                )
                .unsignaled(),
            ]
        })
        .collect();
    qp.post_send(&batch).unwrap();
    drop((qp, ccq, client));
    // The messages that arrived are received; the rest of the queue is untouched.
    let got = wait(&scq, 8);
    assert!(got.iter().all(|c| c.status == WcStatus::Success), "{got:?}");
    assert_eq!(s.region.to_vec(1024, 64).unwrap(), vec![0x11; 64]);
    assert_intact_outside(&s, 1024, 1088);
    check_server_alive(&s);
}

/// A raw sender attached to a fresh (unconnected) RC queue pair of the server, which
/// has one receive posted in memory only the server may write.
struct RawSender {
    qp: Arc<dyn crate::QueuePair>,
    cq: Arc<dyn crate::CompletionQueue>,
    _inbox: Region,
    control: UnixStream,
    request: Request,
    ring: MemfdMemory,
}

fn raw_sender(s: &Server) -> RawSender {
    let cq = s.device.create_cq(16).unwrap();
    let qp = s.device.create_qp(&QpConfig::rc(&cq)).unwrap();
    let inbox = s.device.register(64, Access::LOCAL_WRITE).unwrap();
    qp.post_recv(&[RecvWr {
        wr_id: 5,
        buf: inbox.buf(0, 64),
    }])
    .unwrap();
    let mut control = raw_client(s);
    let request = Request {
        op: control::ATTACH,
        kind: control::KIND_RC,
        a: qp.endpoint().qpn,
        b: 1,
    };
    let response = control::call(&mut control, request).unwrap();
    assert_eq!(response.status, control::OK);
    let ring = response.fds.into_iter().nth(1).unwrap();
    RawSender {
        qp,
        cq,
        _inbox: inbox,
        control,
        request,
        ring: MemfdMemory::from_peer(ring, true).unwrap(),
    }
}

/// The raw sender's queue pair broke: its receive was flushed.
fn assert_receiver_broke(r: &RawSender) {
    let got = wait(&r.cq, 1);
    assert_eq!((got[0].wr_id, got[0].status), (5, WcStatus::WrFlush));
    assert_eq!(r.qp.state(), QpState::Error);
}

#[test]
fn a_corrupt_ring_breaks_only_its_own_connection() {
    let s = server();
    let mut r = raw_sender(&s);
    // A tail far ahead of anything written: the receiver must refuse to follow it.
    r.ring.words()[0].store(u64::MAX / 2, crate::Ordering::Release);
    assert_receiver_broke(&r);
    assert_intact_outside(&s, 0, 0);
    // A second sender may not attach to a connected queue pair's ring.
    let second = Request { b: 2, ..r.request };
    let response = control::call(&mut r.control, second).unwrap();
    assert_eq!(response.status, control::REFUSED);
    check_server_alive(&s);
}

#[test]
fn sends_into_writable_regions_are_placed_directly_and_keep_rc_order() {
    let s = server();
    let client = device(s.dir.path(), "client.sock");
    let (ccq, scq) = (
        client.create_cq(64).unwrap(),
        s.device.create_cq(64).unwrap(),
    );
    let (server_qp, qp) =
        crate::connect_rc((s.device.as_ref(), &scq), (client.as_ref(), &ccq)).unwrap();
    // Alternating receives: placed (peers may write the region anyway) and copied
    // through the ring (a region only this process writes).
    let placed = s.device.register(8 * 64, Access::ALL).unwrap();
    let private = s.device.register(8 * 64, Access::LOCAL_WRITE).unwrap();
    let recvs: Vec<RecvWr> = (0..16u64)
        .map(|i| {
            let region = if i % 2 == 0 { &placed } else { &private };
            RecvWr {
                wr_id: i,
                buf: region.buf(i / 2 * 64, 64),
            }
        })
        .collect();
    server_qp.post_recv(&recvs).unwrap();
    let bodies: Vec<Vec<u8>> = (0..16u8).map(|i| vec![i + 1; 10 + i as usize]).collect();
    let wrs: Vec<SendWr> = bodies
        .iter()
        .enumerate()
        .map(|(i, b)| SendWr::send_imm(i as u64, Src::Inline(b), i as u32).signaled(i == 15))
        .collect();
    qp.post_send(&wrs).unwrap();
    assert_eq!(wait(&ccq, 1)[0].status, WcStatus::Success);
    let got = wait(&scq, 16);
    for (i, wc) in got.iter().enumerate() {
        assert_eq!((wc.wr_id, wc.status), (i as u64, WcStatus::Success));
        assert_eq!((wc.imm, wc.byte_len), (Some(i as u32), 10 + i as u32));
        let region = if i % 2 == 0 { &placed } else { &private };
        let body = region.to_vec(i as u64 / 2 * 64, 10 + i).unwrap();
        assert_eq!(body, bodies[i], "message {i}");
    }
    // Too large for a placed receive: refused at the sender, before any byte lands.
    server_qp
        .post_recv(&[RecvWr {
            wr_id: 99,
            buf: placed.buf(0, 8),
        }])
        .unwrap();
    let wc = exec(&qp, &ccq, SendWr::send(1, Src::Inline(&[0xEE; 9])));
    assert_eq!(wc.status, WcStatus::RemoteInvalidRequest);
    assert_eq!(wait(&scq, 1)[0].status, WcStatus::LocalLength);
    assert_eq!(placed.to_vec(0, 8).unwrap(), bodies[0][..8]);
}

#[test]
fn a_message_placed_where_it_was_not_offered_breaks_the_connection() {
    let s = server();
    let r = raw_sender(&s);
    let mut ring = super::ring::Producer::new(
        MemfdMemory::from_peer(r.ring.as_fd().try_clone_to_owned().unwrap(), true).unwrap(),
    )
    .unwrap();
    let placed = crate::engine::Payload::Placed(8);
    ring.push(super::ring::KIND_PLACED, None, 0, &placed)
        .unwrap();
    assert_receiver_broke(&r);
    check_server_alive(&s);
}

#[test]
fn datagrams_to_a_destroyed_queue_pair_vanish() {
    let s = server();
    let client = device(s.dir.path(), "client.sock");
    client
        .add_peer(s.device.node(), &s.device.address())
        .unwrap();
    let (ccq, scq) = (
        client.create_cq(16).unwrap(),
        s.device.create_cq(16).unwrap(),
    );
    let sender = client.create_qp(&QpConfig::ud(&ccq)).unwrap();
    let receiver = s.device.create_qp(&QpConfig::ud(&scq)).unwrap();
    let inbox = s.device.register(4096, Access::LOCAL_WRITE).unwrap();
    receiver
        .post_recv(&[RecvWr {
            wr_id: 1,
            buf: inbox.buf(0, 4096),
        }])
        .unwrap();
    let dest = crate::UdDest {
        endpoint: receiver.endpoint(),
        qkey: QpConfig::DEFAULT_QKEY,
    };
    let wc = exec(&sender, &ccq, SendWr::send(1, Src::Inline(b"one")).to(dest));
    assert_eq!(wc.status, WcStatus::Success);
    assert_eq!(wait(&scq, 1)[0].byte_len, crate::GRH_BYTES + 3);
    drop(receiver);
    for i in 2..5 {
        let wc = exec(
            &sender,
            &ccq,
            SendWr::send(i, Src::Inline(b"gone")).to(dest),
        );
        assert_eq!(wc.status, WcStatus::Success, "UD senders learn nothing");
    }
    assert!(drain(&scq, Duration::from_millis(10)).is_empty());
}

#[test]
fn read_only_regions_are_handed_out_read_only() {
    let s = server();
    let ro = s.device.register(4096, Access::REMOTE_READ).unwrap();
    let mut c = raw_client(&s);
    let response = control::call(&mut c, Request::new(control::REGION, ro.rkey())).unwrap();
    assert_eq!(response.status, control::OK);
    let fd = response.fds.into_iter().next().unwrap();
    assert!(rustix::fs::ftruncate(&fd, 0).is_err());
    let err = MemfdMemory::from_peer(fd, true).unwrap_err();
    assert!(err.to_string().contains("mmap"), "{err}");
    let local = s.device.register(64, Access::LOCAL).unwrap();
    let response = control::call(&mut c, Request::new(control::REGION, local.rkey())).unwrap();
    assert_eq!(
        (response.status, response.fds.len()),
        (control::NO_SUCH_REGION, 0),
        "local memory is not exported"
    );
}

#[test]
fn private_memory_cannot_be_exported() {
    let s = server();
    let heap = Arc::new(HeapMemory::new(64).unwrap());
    let err = s
        .device
        .register_memory(heap.clone(), 64, Access::REMOTE_READ)
        .unwrap_err();
    assert!(err.to_string().contains("memfd"), "{err}");
    let local = s.device.register_memory(heap, 64, Access::LOCAL).unwrap();
    assert_eq!(local.len(), 64);
    let shared = Arc::new(MemfdMemory::new("exported", 4096).unwrap());
    assert!(s.device.register_memory(shared, 4096, Access::ALL).is_ok());
}

#[test]
fn a_stale_rkey_is_a_remote_access_error_even_after_its_slot_is_reused() {
    let s = server();
    let client = device(s.dir.path(), "client.sock");
    let (ccq, scq) = (
        client.create_cq(16).unwrap(),
        s.device.create_cq(16).unwrap(),
    );
    let (_s1, qp) = crate::connect_rc((s.device.as_ref(), &scq), (client.as_ref(), &ccq)).unwrap();
    let local = client.register(64, Access::ALL).unwrap();
    let old = s.device.register(64, Access::ALL).unwrap();
    let stale = old.remote_addr(0);
    let wc = exec(&qp, &ccq, SendWr::read(1, local.buf(0, 8), stale));
    assert_eq!(
        wc.status,
        WcStatus::Success,
        "the region is mapped and cached"
    );
    drop(old);
    let new = s.device.register(64, Access::ALL).unwrap();
    assert_eq!(new.rkey() >> 8, stale.rkey >> 8, "the slot is reused");
    assert_ne!(new.rkey(), stale.rkey);
    let wc = exec(&qp, &ccq, SendWr::write(2, Src::Inline(&[1; 8]), stale));
    assert_eq!(wc.status, WcStatus::RemoteAccess);
    assert_eq!(new.to_vec(0, 8).unwrap(), vec![0; 8], "nothing landed");
    let (_s2, qp) = crate::connect_rc((s.device.as_ref(), &scq), (client.as_ref(), &ccq)).unwrap();
    let wc = exec(
        &qp,
        &ccq,
        SendWr::read(3, local.buf(0, 8), new.remote_addr(0)),
    );
    assert_eq!(wc.status, WcStatus::Success);
}

#[test]
fn peers_let_go_of_deregistered_regions() {
    let s = server();
    let client = device(s.dir.path(), "client.sock");
    let (ccq, scq) = (
        client.create_cq(16).unwrap(),
        s.device.create_cq(16).unwrap(),
    );
    let (_s, qp) = crate::connect_rc((s.device.as_ref(), &scq), (client.as_ref(), &ccq)).unwrap();
    let local = client.register(64, Access::ALL).unwrap();
    let read = |region: &Region| {
        let wc = exec(
            &qp,
            &ccq,
            SendWr::read(1, local.buf(0, 8), region.remote_addr(0)),
        );
        assert_eq!(wc.status, WcStatus::Success);
    };
    let gone = s.device.register(1 << 20, Access::ALL).unwrap();
    read(&gone);
    let link = client.node.link(s.device.node()).unwrap();
    assert_eq!(link.mapped_regions(), vec![gone.rkey()]);
    drop(gone);
    // Not touched again: the next region the peer maps sweeps it out.
    let other = s.device.register(64, Access::ALL).unwrap();
    read(&other);
    assert_eq!(link.mapped_regions(), vec![other.rkey()]);
}

#[test]
fn clients_see_a_clean_error_when_the_server_dies() {
    let dir = tempfile::tempdir().unwrap();
    let server = device(dir.path(), "server.sock");
    let client = device(dir.path(), "client.sock");
    crate::conformance::owner_death_fails_cleanly(server, client);
}

// ------------------------------------------------------------- across processes
//
// The test binary re-runs itself as the other process (an ignored test that does
// nothing unless `CHILD_ENV` names the directory to work in). The two sides exchange
// what an out-of-band exchange would (node, address, queue pair, rkey) through files.

const CHILD_ENV: &str = "NAMDB_SHM_TEST_CHILD_DIR";

/// What one side tells the other: `node qpn rkey address`.
struct Card {
    node: NodeId,
    qpn: u32,
    rkey: u32,
    address: String,
}

impl Card {
    fn endpoint(&self) -> QpEndpoint {
        QpEndpoint {
            node: self.node,
            qpn: self.qpn,
        }
    }

    /// Writes the card so that a reader never sees half of it.
    fn publish(&self, path: &Path) {
        let text = format!(
            "{} {} {} {}\n",
            self.node.0, self.qpn, self.rkey, self.address
        );
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(&tmp, path).unwrap();
    }

    /// Waits for the card at `path`; gives up if `child` (when given) exits first.
    fn wait(path: &Path, mut child: Option<&mut std::process::Child>) -> Card {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(text) = std::fs::read_to_string(path)
                && let [node, qpn, rkey, address] = text.split_whitespace().collect::<Vec<_>>()[..]
            {
                return Card {
                    node: NodeId(node.parse().unwrap()),
                    qpn: qpn.parse().unwrap(),
                    rkey: rkey.parse().unwrap(),
                    address: address.to_string(),
                };
            }
            if let Some(child) = child.as_deref_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                panic!("the other process exited early: {status}");
            }
            assert!(Instant::now() < deadline, "no {}", path.display());
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// Kills the child on every way out of the test, so a failure leaves no process behind.
struct Child(std::process::Child);

impl Child {
    /// Runs ignored test `name` of this binary in a new process working in `dir`.
    fn spawn(name: &str, dir: &Path) -> Child {
        let child = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", name, "--ignored", "--quiet"])
            .env(CHILD_ENV, dir)
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap();
        Child(child)
    }

    fn kill(&mut self) {
        self.0.kill().unwrap();
        self.0.wait().unwrap();
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A connected RC queue pair in a child process: publishes `me` (with the queue pair's
/// number) as `mine`, connects to the other side's card, and returns once the other
/// side says it is connected too (`ready`).
fn child_connect(
    dir: &Path,
    dev: &ShmDevice,
    mut me: Card,
    mine: &str,
) -> (Arc<dyn crate::QueuePair>, Arc<dyn crate::CompletionQueue>) {
    let cq = dev.create_cq(256).unwrap();
    let qp = dev.create_qp(&QpConfig::rc(&cq)).unwrap();
    me.qpn = qp.endpoint().qpn;
    me.publish(&dir.join(mine));
    let theirs = Card::wait(
        &dir.join(if mine == "owner" { "client" } else { "owner" }),
        None,
    );
    dev.add_peer(theirs.node, &theirs.address).unwrap();
    qp.connect(theirs.endpoint()).unwrap();
    (qp, cq)
}

fn wait_for(path: &Path, mut child: Option<&mut Child>) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !path.exists() {
        if let Some(child) = child.as_deref_mut()
            && let Ok(Some(status)) = child.0.try_wait()
        {
            panic!("the other process exited early: {status}");
        }
        assert!(Instant::now() < deadline, "no {}", path.display());
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The memory owner of [`the_owner_process_dying_fails_its_peers_cleanly`].
#[test]
#[ignore = "run by a cross-process test as its child"]
fn owner_process() {
    let Some(dir) = std::env::var_os(CHILD_ENV).map(PathBuf::from) else {
        return;
    };
    let dev = ShmDevice::bind(dir.join("owner.sock"), TOKEN).unwrap();
    let region = dev.register(4096, Access::ALL).unwrap();
    region.write(0, &[0x5A; 4096]).unwrap();
    let me = Card {
        node: dev.node(),
        qpn: 0,
        rkey: region.rkey(),
        address: dev.address(),
    };
    let _connected = child_connect(&dir, &dev, me, "owner");
    std::fs::write(dir.join("ready"), "").unwrap();
    // Serves, with no CPU of its own, until killed.
    loop {
        std::thread::sleep(Duration::from_secs(1));
    }
}

/// The client of [`a_client_process_dying_mid_stream_leaves_the_owner_whole`]: sends
/// and writes into the owner as fast as it can until killed.
#[test]
#[ignore = "run by a cross-process test as its child"]
fn client_process() {
    let Some(dir) = std::env::var_os(CHILD_ENV).map(PathBuf::from) else {
        return;
    };
    let dev = ShmDevice::bind(dir.join("client.sock"), TOKEN).unwrap();
    let me = Card {
        node: dev.node(),
        qpn: 0,
        rkey: 0,
        address: dev.address(),
    };
    let (qp, cq) = child_connect(&dir, &dev, me, "client");
    wait_for(&dir.join("ready"), None);
    let owner = Card::wait(&dir.join("owner"), None);
    let payload = [0x11u8; 100];
    let mut wcs = [crate::Completion::default(); 16];
    for round in 0u64.. {
        let at = crate::RemoteAddr {
            node: owner.node,
            rkey: owner.rkey,
            offset: (round % 3) * 1024,
        };
        // Messages for the owner's receives first, then WRITEs, batch after batch.
        let wr = if round < 64 {
            SendWr::send(round, Src::Inline(&payload))
        } else {
            SendWr::write(round, Src::Inline(&payload[..64]), at)
        };
        qp.post_send(&[wr.signaled(round % 32 == 31)]).unwrap();
        if round % 32 == 31 {
            while cq.poll(&mut wcs).unwrap() == 0 {}
            assert!(wcs[0].status.is_ok(), "{:?}", wcs[0]);
        }
        if round == 1000 {
            std::fs::write(dir.join("busy"), "").unwrap();
        }
    }
}

#[test]
fn the_owner_process_dying_fails_its_peers_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = Child::spawn("shm::tests::owner_process", dir.path());
    let client = device(dir.path(), "client.sock");
    let me = Card {
        node: client.node(),
        qpn: 0,
        rkey: 0,
        address: client.address(),
    };
    let owner = Card::wait(&dir.path().join("owner"), Some(&mut child.0));
    client.add_peer(owner.node, &owner.address).unwrap();
    let cq = client.create_cq(64).unwrap();
    let qp = client.create_qp(&QpConfig::rc(&cq)).unwrap();
    qp.connect(owner.endpoint()).unwrap();
    Card {
        qpn: qp.endpoint().qpn,
        ..me
    }
    .publish(&dir.path().join("client"));
    wait_for(&dir.path().join("ready"), Some(&mut child));
    let local = client.register(4096, Access::ALL).unwrap();
    let remote = crate::RemoteAddr {
        node: owner.node,
        rkey: owner.rkey,
        offset: 0,
    };
    let wc = exec(&qp, &cq, SendWr::read(1, local.buf(0, 4096), remote));
    assert_eq!(wc.status, WcStatus::Success);
    assert_eq!(local.to_vec(0, 4096).unwrap(), vec![0x5A; 4096]);
    let wc = exec(&qp, &cq, SendWr::fetch_add(2, local.buf(0, 8), remote, 1));
    assert_eq!(wc.status, WcStatus::Success, "one-sided, with no owner CPU");

    child.kill();
    // The kernel tells the watcher thread; until it has, requests may still succeed
    // against the dead owner's memory (as a NIC may answer before its host is noticed).
    let deadline = Instant::now() + Duration::from_secs(10);
    let failed = loop {
        let wc = exec(&qp, &cq, SendWr::read(3, local.buf(0, 8), remote));
        if wc.status != WcStatus::Success {
            break wc;
        }
        assert!(
            Instant::now() < deadline,
            "the owner's death went unnoticed"
        );
        std::thread::sleep(Duration::from_millis(1));
    };
    assert_eq!(failed.status, WcStatus::RetryExceeded);
    assert_eq!(qp.state(), QpState::Error);
    let wc = exec(&qp, &cq, SendWr::read(4, local.buf(0, 8), remote));
    assert_eq!(wc.status, WcStatus::WrFlush);
    assert!(drain(&cq, Duration::from_millis(10)).is_empty());
}

#[test]
fn a_client_process_dying_mid_stream_leaves_the_owner_whole() {
    let s = server();
    let dir = s.dir.path();
    let mut child = Child::spawn("shm::tests::client_process", dir);
    let cq = s.device.create_cq(4096).unwrap();
    let qp = s.device.create_qp(&QpConfig::rc(&cq)).unwrap();
    let inbox = s.device.register(100 * 64, Access::LOCAL_WRITE).unwrap();
    let recvs: Vec<RecvWr> = (0..64)
        .map(|i| RecvWr {
            wr_id: i,
            buf: inbox.buf(i * 100, 100),
        })
        .collect();
    qp.post_recv(&recvs).unwrap();
    Card {
        node: s.device.node(),
        qpn: qp.endpoint().qpn,
        rkey: s.region.rkey(),
        address: s.device.address(),
    }
    .publish(&dir.join("owner"));
    let client = Card::wait(&dir.join("client"), Some(&mut child.0));
    s.device.add_peer(client.node, &client.address).unwrap();
    qp.connect(client.endpoint()).unwrap();
    std::fs::write(dir.join("ready"), "").unwrap();
    wait_for(&dir.join("busy"), Some(&mut child));
    // Killed in the middle of writing and sending, with no warning.
    child.kill();
    let got = drain(&cq, Duration::from_millis(50));
    assert!(!got.is_empty(), "messages arrived before the client died");
    assert!(
        got.iter()
            .all(|c| c.status == WcStatus::Success && c.byte_len == 100)
    );
    assert_eq!(s.region.to_vec(0, 64).unwrap(), vec![0x11; 64]);
    assert_intact_outside(&s, 0, 3 * 1024);
    check_server_alive(&s);
    // The owner's own requests to the dead client now fail cleanly.
    let deadline = Instant::now() + Duration::from_secs(10);
    let failed = loop {
        let wc = exec(&qp, &cq, SendWr::send(1, Src::Inline(b"anyone?")));
        if wc.status != WcStatus::Success {
            break wc;
        }
        assert!(
            Instant::now() < deadline,
            "the client's death went unnoticed"
        );
    };
    assert_eq!(failed.status, WcStatus::RetryExceeded);
}

#[test]
fn binding_replaces_a_leftover_socket_but_never_a_file() {
    let dir = tempfile::tempdir().unwrap();
    // A socket nobody listens on any more: an earlier run's, taken over.
    let leftover = dir.path().join("leftover.sock");
    drop(std::os::unix::net::UnixListener::bind(&leftover).unwrap());
    assert!(leftover.exists());
    let device = ShmDevice::bind(&leftover, TOKEN).unwrap();
    drop(device);
    // Anything else at the path is someone's data: an error, and the file stays.
    let precious = dir.path().join("precious.txt");
    std::fs::write(&precious, "keep me").unwrap();
    let err = ShmDevice::bind(&precious, TOKEN).err().expect("refused");
    assert!(err.to_string().contains("other than a socket"), "{err}");
    assert_eq!(std::fs::read_to_string(&precious).unwrap(), "keep me");
}

#[test]
fn leftovers_of_processes_that_are_gone_are_swept_and_nothing_else() {
    let dir = tempfile::tempdir().unwrap();
    let at = |name: &str| dir.path().join(name);
    let dead_socket = |path: &Path| {
        drop(std::os::unix::net::UnixListener::bind(path).unwrap());
    };
    // Above Linux's largest pid_max: no process has it.
    let gone = 4_194_305u32;
    let me = std::process::id();
    dead_socket(&at(&format!("x-{gone}.sock")));
    dead_socket(&at(&format!("x-{me}.sock")));
    std::fs::write(at(&format!("x-{gone}.txt")), "keep me").unwrap();
    std::fs::create_dir(at(&format!("x-{gone}-abc"))).unwrap();
    dead_socket(&at(&format!("x-{gone}-abc/node0.sock")));
    std::fs::create_dir(at(&format!("x-{gone}-def"))).unwrap();
    std::fs::write(at(&format!("x-{gone}-def/data")), "keep me").unwrap();
    let listening = std::os::unix::net::UnixListener::bind(at(&format!("x-{gone}-live.sock")));
    dead_socket(&at(&format!("y-{gone}.sock")));
    super::sweep_leftovers(dir.path(), "x-");
    let mut left: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    left.sort();
    let mut kept = vec![
        format!("x-{me}.sock"),
        format!("x-{gone}-def"),
        format!("x-{gone}-live.sock"),
        format!("x-{gone}.txt"),
        format!("y-{gone}.sock"),
    ];
    kept.sort();
    assert_eq!(left, kept);
    drop(listening);
}

#[test]
fn leftovers_of_zombies_are_swept() {
    let dir = tempfile::tempdir().unwrap();
    // Exited and not waited for: a zombie, whose /proc entry stays until it is reaped.
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let pid = child.id();
    let stat = format!("/proc/{pid}/stat");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !std::fs::read_to_string(&stat).is_ok_and(|s| s.contains(") Z")) {
        assert!(
            std::time::Instant::now() < deadline,
            "{pid} never became a zombie"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let leftover = dir.path().join(format!("x-{pid}.sock"));
    drop(std::os::unix::net::UnixListener::bind(&leftover).unwrap());
    super::sweep_leftovers(dir.path(), "x-");
    assert!(!leftover.exists());
    child.wait().unwrap();
}

/// Destroying a queue pair waits for the one-sided request its sender is executing on
/// its own CPU, and nothing the sender writes lands afterwards: what a memory server's
/// fence of a paused compute node (ending its sessions) relies on. The sender stalls
/// inside the owner's memory, checked and not yet written, as a descheduled one would.
#[test]
fn a_destroyed_queue_pair_waits_for_the_write_inside_and_refuses_the_next() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::mpsc;
    let dir = tempfile::tempdir().unwrap();
    let owner = device(dir.path(), "owner.sock");
    let sender = device(dir.path(), "sender.sock");
    let target = owner.register(4096, Access::ALL).unwrap();
    let (ocq, scq) = (owner.create_cq(16).unwrap(), sender.create_cq(16).unwrap());
    let (owner_qp, qp) =
        crate::connect_rc((owner.as_ref(), &ocq), (sender.as_ref(), &scq)).unwrap();
    let at = target.remote_addr(0);
    let (inside_tx, inside) = mpsc::channel();
    let (resume, resume_rx) = mpsc::channel::<()>();
    let destroyed = Arc::new(AtomicBool::new(false));
    std::thread::scope(|scope| {
        let writer = scope.spawn(|| {
            super::qp::STALL_IN_MEMORY.with(|stall| {
                *stall.borrow_mut() = Some(Box::new(move || {
                    inside_tx.send(()).unwrap();
                    // Bounded, so that a failed check below fails the test, not hangs it.
                    let _ = resume_rx.recv_timeout(Duration::from_secs(10));
                }))
            });
            let first = exec(&qp, &scq, SendWr::write(1, Src::Inline(&[7; 8]), at));
            super::qp::STALL_IN_MEMORY.with(|stall| stall.borrow_mut().take());
            let second = exec(&qp, &scq, SendWr::write(2, Src::Inline(&[9; 8]), at));
            (first.status, second.status)
        });
        inside.recv().unwrap();
        let destroyer = {
            let destroyed = destroyed.clone();
            scope.spawn(move || {
                drop(owner_qp);
                destroyed.store(true, Ordering::SeqCst);
            })
        };
        std::thread::sleep(Duration::from_millis(200));
        assert!(
            !destroyed.load(Ordering::SeqCst),
            "destroyed while the sender's write was inside the memory"
        );
        assert_eq!(target.to_vec(0, 8).unwrap(), [0; 8]);
        resume.send(()).unwrap();
        destroyer.join().unwrap();
        assert_eq!(
            writer.join().unwrap(),
            (WcStatus::Success, WcStatus::RetryExceeded)
        );
        assert_eq!(
            target.to_vec(0, 8).unwrap(),
            [7; 8],
            "the write inside landed before the destruction returned, the next never"
        );
    });
}
