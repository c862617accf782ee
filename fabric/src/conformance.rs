//! The conformance suite: what every backend must do, written once against the
//! [`Device`] traits and run as is on each backend.
//!
//! A backend's test file implements [`Backend`] and invokes
//! [`conformance_tests!`](crate::conformance_tests), which expands to one `#[test]` per
//! case below. Cases check results through the fabric itself (READs) and never touch
//! the first device's memory with the CPU, so they hold when that device is in another
//! process (a memory server driven over remote verbs).

use crate::{
    Access, AsyncQp, Completion, CompletionQueue, CqDriver, Device, FabricError, GRH_BYTES,
    QpConfig, QpKind, QpState, QueuePair, RecvWr, Region, SendWr, UD_MTU, UdDest, WcOpcode,
    WcStatus,
};
use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// A backend under test.
pub trait Backend: Sync {
    /// A fresh network of `nodes` devices. The first plays the server: its memory may
    /// be in another process, so the suite reaches it only through the fabric.
    fn devices(&self, nodes: usize) -> Vec<Arc<dyn Device>>;
    /// Whether UD datagrams may be dropped in this configuration.
    fn ud_may_drop(&self) -> bool {
        false
    }
    /// Whether the backend injects torn READs, so a tear must be observed.
    fn injects_tears(&self) -> bool {
        false
    }
}

/// How long any single wait may take before the suite calls it a hang.
const PATIENCE: Duration = Duration::from_secs(30);

/// Polls until `n` completions arrived (or panics after [`PATIENCE`]).
pub fn wait(cq: &Arc<dyn CompletionQueue>, n: usize) -> Vec<Completion> {
    let deadline = Instant::now() + PATIENCE;
    let mut out = Vec::with_capacity(n);
    let mut buf = [Completion::default(); 16];
    while out.len() < n {
        let want = (n - out.len()).min(buf.len());
        let got = cq.poll(&mut buf[..want]).expect("poll");
        out.extend_from_slice(&buf[..got]);
        assert!(
            Instant::now() < deadline,
            "waited {PATIENCE:?} for {n} completions, got {out:?}"
        );
        if got == 0 {
            std::thread::yield_now();
        }
    }
    out
}

/// Polls for `period` and returns whatever arrived.
pub fn drain(cq: &Arc<dyn CompletionQueue>, period: Duration) -> Vec<Completion> {
    let until = Instant::now() + period;
    let mut out = Vec::new();
    let mut buf = [Completion::default(); 16];
    while Instant::now() < until {
        let got = cq.poll(&mut buf).expect("poll");
        out.extend_from_slice(&buf[..got]);
        if got == 0 {
            std::thread::yield_now();
        }
    }
    out
}

/// Posts one signaled work request and returns its completion.
pub fn exec(qp: &Arc<dyn QueuePair>, cq: &Arc<dyn CompletionQueue>, wr: SendWr<'_>) -> Completion {
    qp.post_send(&[wr.signaled(true)]).expect("post_send");
    wait(cq, 1)[0]
}

/// A client node connected over RC to a server node that exports one region.
pub struct Fixture {
    pub server: Arc<dyn Device>,
    pub client: Arc<dyn Device>,
    pub server_cq: Arc<dyn CompletionQueue>,
    pub client_cq: Arc<dyn CompletionQueue>,
    pub server_qp: Arc<dyn QueuePair>,
    pub client_qp: Arc<dyn QueuePair>,
    /// On the server: every access granted.
    pub remote: Region,
    /// On the client: scratch space.
    pub local: Region,
}

pub const REGION_BYTES: u64 = 1 << 20;

impl Fixture {
    pub fn new(backend: &dyn Backend) -> Fixture {
        Fixture::with(backend, |c| c)
    }

    pub fn with(backend: &dyn Backend, tune: impl Fn(QpConfig) -> QpConfig) -> Fixture {
        let mut devices = backend.devices(2);
        let client = devices.pop().expect("two devices");
        let server = devices.pop().expect("two devices");
        let server_cq = server.create_cq(4096).expect("cq");
        let client_cq = client.create_cq(4096).expect("cq");
        let (server_qp, client_qp) = crate::connect_rc_with(
            (server.as_ref(), &server_cq),
            (client.as_ref(), &client_cq),
            tune,
        )
        .expect("connect");
        let remote = server
            .register(REGION_BYTES, Access::ALL)
            .expect("register");
        let local = client
            .register(REGION_BYTES, Access::ALL)
            .expect("register");
        Fixture {
            server,
            client,
            server_cq,
            client_cq,
            server_qp,
            client_qp,
            remote,
            local,
        }
    }

    pub fn run(&self, wr: SendWr<'_>) -> Completion {
        exec(&self.client_qp, &self.client_cq, wr)
    }

    /// Writes `data` to the remote region at `offset` with a WRITE.
    pub fn put(&self, offset: u64, data: &[u8]) {
        let scratch = REGION_BYTES - data.len() as u64;
        self.local.write(scratch, data).expect("local write");
        let wc = self.run(SendWr::write(
            1,
            self.local.buf(scratch, data.len() as u32),
            self.remote.remote_addr(offset),
        ));
        assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
    }

    /// Reads `len` remote bytes at `offset` with a READ.
    pub fn get(&self, offset: u64, len: usize) -> Vec<u8> {
        self.get_from(&self.remote, offset, len)
    }

    /// Reads `len` bytes of any server region (registered with `REMOTE_READ`) with a
    /// READ, so checks hold when the server's memory is in another process.
    pub fn get_from(&self, region: &Region, offset: u64, len: usize) -> Vec<u8> {
        let scratch = REGION_BYTES / 2;
        let wc = self.run(SendWr::read(
            2,
            self.local.buf(scratch, len as u32),
            region.remote_addr(offset),
        ));
        assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
        self.local.to_vec(scratch, len).expect("local read")
    }

    pub fn get_u64(&self, offset: u64) -> u64 {
        u64::from_le_bytes(self.get(offset, 8).try_into().expect("8 bytes"))
    }

    /// Asserts the client queue pair failed: it is in the error state and a new
    /// request is flushed.
    pub fn assert_broken(&self) {
        assert_eq!(self.client_qp.state(), QpState::Error);
        let wc = self.run(SendWr::read(
            77,
            self.local.buf(0, 8),
            self.remote.remote_addr(0),
        ));
        assert_eq!(wc.status, WcStatus::WrFlush, "{wc:?}");
        assert_eq!(wc.wr_id, 77);
    }
}

/// What a client sees when the device it talks to goes away, for backends' fault tests
/// (a dropped device stands for a dead one): `server` must be the only handle to its
/// device, and is dropped after one good READ. The next request fails with
/// `RetryExceeded`, the ones after it are flushed, and `recover` has nobody to
/// reconnect to.
pub fn owner_death_fails_cleanly(server: Arc<dyn Device>, client: Arc<dyn Device>) {
    let (ccq, scq) = (
        client.create_cq(64).expect("cq"),
        server.create_cq(64).expect("cq"),
    );
    let (server_qp, qp) =
        crate::connect_rc((server.as_ref(), &scq), (client.as_ref(), &ccq)).expect("connect");
    let region = server.register(64, Access::ALL).expect("register");
    let remote = region.remote_addr(0);
    let local = client.register(64, Access::ALL).expect("register");
    let wc = exec(&qp, &ccq, SendWr::read(1, local.buf(0, 8), remote));
    assert_eq!(wc.status, WcStatus::Success);
    drop((server_qp, region, server));
    let wrs: Vec<SendWr> = (0..4)
        .map(|i| SendWr::read(i, local.buf(0, 8), remote))
        .collect();
    qp.post_send(&wrs).expect("post_send");
    let got = wait(&ccq, 4);
    assert_eq!(got[0].status, WcStatus::RetryExceeded, "{got:?}");
    assert!(
        got[1..].iter().all(|c| c.status == WcStatus::WrFlush),
        "{got:?}"
    );
    assert_eq!(qp.state(), QpState::Error);
    assert!(qp.recover().is_err(), "nobody to reconnect to");
}

/// Sets a flag when dropped, so a background loop stops even when the test body
/// panics (otherwise the scope would wait for it forever).
struct StopOnDrop<'a>(&'a AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

// ---------------------------------------------------------------- one-sided ops

pub fn write_then_read_round_trips(b: &dyn Backend) {
    let f = Fixture::new(b);
    for (len, offset) in [
        (1usize, 0u64),
        (8, 8),
        (13, 3),
        (64, 64),
        (4096, 4101),
        (65536, 131072),
    ] {
        let data = pattern(len, len as u8);
        f.put(offset, &data);
        assert_eq!(f.get(offset, len), data, "len {len} at {offset}");
    }
}

pub fn inline_write_needs_no_registration(b: &dyn Backend) {
    let f = Fixture::new(b);
    let data = pattern(100, 9);
    let wc = f.run(SendWr::write(
        5,
        crate::Src::Inline(&data),
        f.remote.remote_addr(1000),
    ));
    assert_eq!(
        (wc.status, wc.opcode, wc.wr_id),
        (WcStatus::Success, WcOpcode::Write, 5)
    );
    assert_eq!(f.get(1000, 100), data);
}

pub fn read_reports_its_opcode_and_length(b: &dyn Backend) {
    let f = Fixture::new(b);
    let wc = f.run(SendWr::read(
        9,
        f.local.buf(0, 256),
        f.remote.remote_addr(0),
    ));
    assert_eq!(wc.status, WcStatus::Success);
    assert_eq!(wc.opcode, WcOpcode::Read);
    assert_eq!(wc.wr_id, 9);
    assert_eq!(wc.byte_len, 256);
    assert_eq!(wc.qpn, f.client_qp.endpoint().qpn);
}

pub fn cas_swaps_only_on_match(b: &dyn Backend) {
    let f = Fixture::new(b);
    let word = f.remote.remote_addr(64);
    f.put(64, &5u64.to_le_bytes());
    let wc = f.run(SendWr::cas(1, f.local.buf(0, 8), word, 5, 9));
    assert_eq!(
        (wc.status, wc.opcode),
        (WcStatus::Success, WcOpcode::CompareSwap)
    );
    assert_eq!(f.local.load_u64(0).unwrap(), 5, "CAS returns the old value");
    assert_eq!(f.get_u64(64), 9, "CAS swapped");
    let wc = f.run(SendWr::cas(2, f.local.buf(8, 8), word, 5, 11));
    assert_eq!(wc.status, WcStatus::Success);
    assert_eq!(
        f.local.load_u64(8).unwrap(),
        9,
        "a failed CAS returns the current value"
    );
    assert_eq!(f.get_u64(64), 9, "a failed CAS leaves the word");
}

pub fn fetch_add_returns_old_and_wraps(b: &dyn Backend) {
    let f = Fixture::new(b);
    let word = f.remote.remote_addr(128);
    f.put(128, &(u64::MAX - 1).to_le_bytes());
    let wc = f.run(SendWr::fetch_add(1, f.local.buf(0, 8), word, 3));
    assert_eq!(
        (wc.status, wc.opcode),
        (WcStatus::Success, WcOpcode::FetchAdd)
    );
    assert_eq!(f.local.load_u64(0).unwrap(), u64::MAX - 1);
    assert_eq!(f.get_u64(128), 1, "FETCH_ADD wraps");
}

pub fn atomic_results_are_words_in_region_byte_order(b: &dyn Backend) {
    let f = Fixture::new(b);
    let value = 0x0102_0304_0506_0708u64;
    f.put(0, &value.to_le_bytes());
    f.run(SendWr::fetch_add(
        1,
        f.local.buf(16, 8),
        f.remote.remote_addr(0),
        0,
    ));
    assert_eq!(f.local.to_vec(16, 8).unwrap(), value.to_le_bytes());
    assert_eq!(f.local.load_u64(16).unwrap(), value);
}

// ---------------------------------------------------------------- two-sided ops

pub fn send_lands_in_posted_receive(b: &dyn Backend) {
    let f = Fixture::new(b);
    let inbox = f
        .server
        .register(8192, Access::LOCAL_WRITE | Access::REMOTE_READ)
        .unwrap();
    f.server_qp
        .post_recv(&[
            RecvWr {
                wr_id: 100,
                buf: inbox.buf(0, 4096),
            },
            RecvWr {
                wr_id: 101,
                buf: inbox.buf(4096, 4096),
            },
        ])
        .unwrap();
    let data = pattern(3000, 1);
    f.local.write(0, &data).unwrap();
    let wc = f.run(SendWr::send(1, f.local.buf(0, 3000)));
    assert_eq!((wc.status, wc.opcode), (WcStatus::Success, WcOpcode::Send));
    let wc = f.run(SendWr::send_imm(2, crate::Src::Inline(b"hello"), 0xfeed));
    assert_eq!(wc.status, WcStatus::Success);
    let got = wait(&f.server_cq, 2);
    assert_eq!(got[0].wr_id, 100);
    assert_eq!(
        (got[0].status, got[0].opcode),
        (WcStatus::Success, WcOpcode::Recv)
    );
    assert_eq!(got[0].byte_len, 3000);
    assert_eq!(got[0].imm, None);
    assert_eq!(got[0].src, Some(f.client_qp.endpoint()));
    assert_eq!(f.get_from(&inbox, 0, 3000), data);
    assert_eq!(
        (got[1].wr_id, got[1].byte_len, got[1].imm),
        (101, 5, Some(0xfeed))
    );
    assert_eq!(f.get_from(&inbox, 4096, 5), b"hello");
}

pub fn write_with_imm_consumes_a_receive(b: &dyn Backend) {
    let f = Fixture::new(b);
    let inbox = f.server.register(64, Access::LOCAL_WRITE).unwrap();
    f.server_qp
        .post_recv(&[RecvWr {
            wr_id: 7,
            buf: inbox.buf(0, 64),
        }])
        .unwrap();
    let data = pattern(512, 4);
    f.local.write(0, &data).unwrap();
    let wc = f.run(SendWr::write_imm(
        1,
        f.local.buf(0, 512),
        f.remote.remote_addr(2048),
        42,
    ));
    assert_eq!((wc.status, wc.opcode), (WcStatus::Success, WcOpcode::Write));
    let got = wait(&f.server_cq, 1)[0];
    assert_eq!(
        (got.wr_id, got.status, got.opcode),
        (7, WcStatus::Success, WcOpcode::RecvWriteImm)
    );
    assert_eq!((got.imm, got.byte_len), (Some(42), 512));
    assert_eq!(f.get(2048, 512), data);
}

pub fn sends_arrive_in_order_on_rc(b: &dyn Backend) {
    let f = Fixture::new(b);
    let inbox = f
        .server
        .register(64 * 8, Access::LOCAL_WRITE | Access::REMOTE_READ)
        .unwrap();
    let recvs: Vec<RecvWr> = (0..64)
        .map(|i| RecvWr {
            wr_id: i,
            buf: inbox.buf(i * 8, 8),
        })
        .collect();
    f.server_qp.post_recv(&recvs).unwrap();
    let bodies: Vec<[u8; 8]> = (0..64u64).map(|i| i.to_le_bytes()).collect();
    let wrs: Vec<SendWr> = bodies
        .iter()
        .enumerate()
        .map(|(i, body)| SendWr::send(i as u64, crate::Src::Inline(body)).signaled(i == 63))
        .collect();
    f.client_qp.post_send(&wrs).unwrap();
    wait(&f.client_cq, 1);
    let got = wait(&f.server_cq, 64);
    let landed = f.get_from(&inbox, 0, 64 * 8);
    for (i, wc) in got.iter().enumerate() {
        assert_eq!(wc.wr_id, i as u64);
        let v = u64::from_le_bytes(landed[i * 8..][..8].try_into().unwrap());
        assert_eq!(v, i as u64, "message {i} landed in receive {i}");
    }
}

pub fn receive_buffer_too_small_fails_both_sides(b: &dyn Backend) {
    let f = Fixture::new(b);
    let inbox = f.server.register(64, Access::LOCAL_WRITE).unwrap();
    f.server_qp
        .post_recv(&[RecvWr {
            wr_id: 3,
            buf: inbox.buf(0, 50),
        }])
        .unwrap();
    let wc = f.run(SendWr::send(1, f.local.buf(0, 100)));
    assert_eq!(wc.status, WcStatus::RemoteInvalidRequest);
    let got = wait(&f.server_cq, 1)[0];
    assert_eq!((got.wr_id, got.status), (3, WcStatus::LocalLength));
    f.assert_broken();
}

// ---------------------------------------------------------------- ordering

pub fn signaled_completion_implies_earlier_requests(b: &dyn Backend) {
    let f = Fixture::new(b);
    for round in 0..20u64 {
        let values: Vec<[u8; 8]> = (0..32u64)
            .map(|i| (round * 100 + i).to_le_bytes())
            .collect();
        let mut wrs: Vec<SendWr> = values
            .iter()
            .enumerate()
            .map(|(i, v)| {
                SendWr::write(
                    i as u64,
                    crate::Src::Inline(v),
                    f.remote.remote_addr(i as u64 * 8),
                )
                .unsignaled()
            })
            .collect();
        wrs.push(SendWr::fetch_add(
            99,
            f.local.buf(4096, 8),
            f.remote.remote_addr(8192),
            1,
        ));
        f.client_qp.post_send(&wrs).unwrap();
        let wc = wait(&f.client_cq, 1);
        assert_eq!(wc.len(), 1, "only the signaled request completes");
        assert_eq!((wc[0].wr_id, wc[0].status), (99, WcStatus::Success));
        let got = f.get(0, 32 * 8);
        for i in 0..32u64 {
            let v = u64::from_le_bytes(got[i as usize * 8..][..8].try_into().unwrap());
            assert_eq!(
                v,
                round * 100 + i,
                "unsignaled WRITE {i} done before the signaled one"
            );
        }
    }
}

pub fn rc_executes_in_posting_order(b: &dyn Backend) {
    let f = Fixture::new(b);
    // WRITE, READ, WRITE, READ of the same word in one doorbell: each READ sees the
    // WRITE before it.
    let (one, two) = (1u64.to_le_bytes(), 2u64.to_le_bytes());
    let addr = f.remote.remote_addr(512);
    let wrs = [
        SendWr::write(0, crate::Src::Inline(&one), addr).unsignaled(),
        SendWr::read(1, f.local.buf(0, 8), addr).unsignaled(),
        SendWr::write(2, crate::Src::Inline(&two), addr).unsignaled(),
        SendWr::read(3, f.local.buf(8, 8), addr),
    ];
    f.client_qp.post_send(&wrs).unwrap();
    assert_eq!(wait(&f.client_cq, 1)[0].wr_id, 3);
    assert_eq!(f.local.load_u64(0).unwrap(), 1);
    assert_eq!(f.local.load_u64(8).unwrap(), 2);
}

/// A WRITE's last word visible implies the rest is: a reader that first READs the last
/// word and then the block never sees an older word than that last one. Only where the
/// device promises it ([`crate::Device::orders_write_placement`]): on rxe under TCG a
/// reader finds words half-written, a byte of the new value beside a byte of the old.
pub fn write_last_word_implies_rest(b: &dyn Backend) {
    let f = Fixture::new(b);
    if !f.server.orders_write_placement() {
        eprintln!("skipped: this device does not promise placement in address order");
        return;
    }
    const WORDS: usize = 64;
    let stop = AtomicBool::new(false);
    let reader_cq = f.client.create_cq(64).unwrap();
    let reader_qp = {
        let scq = f.server.create_cq(64).unwrap();
        let (s, c) =
            crate::connect_rc((f.server.as_ref(), &scq), (f.client.as_ref(), &reader_cq)).unwrap();
        (s, c, scq)
    };
    let scratch = f
        .client
        .register(WORDS as u64 * 8 * 2, Access::ALL)
        .unwrap();
    std::thread::scope(|s| {
        s.spawn(|| {
            let mut k = 1u64;
            while !stop.load(Ordering::Relaxed) {
                let block: Vec<u8> = (0..WORDS).flat_map(|_| k.to_le_bytes()).collect();
                f.local.write(0, &block).unwrap();
                let wc = f.run(SendWr::write(
                    k,
                    f.local.buf(0, (WORDS * 8) as u32),
                    f.remote.remote_addr(0),
                ));
                assert_eq!(wc.status, WcStatus::Success);
                k += 1;
            }
        });
        let _stop = StopOnDrop(&stop);
        let deadline = Instant::now() + Duration::from_millis(500);
        let mut checks = 0;
        while Instant::now() < deadline || checks < 200 {
            let last = exec(
                &reader_qp.1,
                &reader_cq,
                SendWr::read(
                    1,
                    scratch.buf(0, 8),
                    f.remote.remote_addr((WORDS as u64 - 1) * 8),
                ),
            );
            assert_eq!((last.wr_id, last.status), (1, WcStatus::Success));
            let seen_last = scratch.load_u64(0).unwrap();
            let all = exec(
                &reader_qp.1,
                &reader_cq,
                SendWr::read(
                    2,
                    scratch.buf(8, (WORDS * 8) as u32),
                    f.remote.remote_addr(0),
                ),
            );
            assert_eq!((all.wr_id, all.status), (2, WcStatus::Success));
            let words: Vec<u64> = (0..WORDS as u64)
                .map(|w| scratch.load_u64(8 + w * 8).unwrap())
                .collect();
            if let Some(w) = words.iter().position(|&v| v < seen_last) {
                panic!(
                    "check {checks}: word {w} is {}, older than the last word {seen_last} \
                     read before it; the block: {words:?}",
                    words[w]
                );
            }
            checks += 1;
        }
    });
}

/// Under tear injection, a multi-word READ racing a WRITE is seen torn (so the guard
/// above it is exercised), and every word is one that was written.
pub fn reads_tear_only_at_word_boundaries(b: &dyn Backend) {
    if !b.injects_tears() {
        return;
    }
    let f = Fixture::new(b);
    const WORDS: usize = 32;
    let stop = AtomicBool::new(false);
    let latest = AtomicU64::new(0);
    let reader_cq = f.client.create_cq(64).unwrap();
    let scq = f.server.create_cq(64).unwrap();
    let (_s, reader) =
        crate::connect_rc((f.server.as_ref(), &scq), (f.client.as_ref(), &reader_cq)).unwrap();
    let scratch = f.client.register(WORDS as u64 * 8, Access::ALL).unwrap();
    std::thread::scope(|s| {
        s.spawn(|| {
            let mut k = 1u64;
            while !stop.load(Ordering::Relaxed) {
                latest.store(k, Ordering::Relaxed);
                let block: Vec<u8> = (0..WORDS).flat_map(|_| k.to_le_bytes()).collect();
                f.local.write(0, &block).unwrap();
                let wc = f.run(SendWr::write(
                    k,
                    f.local.buf(0, (WORDS * 8) as u32),
                    f.remote.remote_addr(0),
                ));
                assert_eq!(wc.status, WcStatus::Success);
                k += 1;
            }
        });
        let _stop = StopOnDrop(&stop);
        let deadline = Instant::now() + PATIENCE;
        let mut torn = 0;
        while torn < 3 {
            assert!(
                Instant::now() < deadline,
                "no torn READ observed under tear injection"
            );
            let wc = exec(
                &reader,
                &reader_cq,
                SendWr::read(
                    1,
                    scratch.buf(0, (WORDS * 8) as u32),
                    f.remote.remote_addr(0),
                ),
            );
            assert_eq!(wc.status, WcStatus::Success);
            let words: Vec<u64> = (0..WORDS as u64)
                .map(|w| scratch.load_u64(w * 8).unwrap())
                .collect();
            let bound = latest.load(Ordering::Relaxed) + 1;
            assert!(
                words.iter().all(|&v| v <= bound),
                "a word was never written: {words:?}"
            );
            if words.iter().any(|&v| v != words[0]) {
                torn += 1;
            }
        }
    });
}

// ---------------------------------------------------------------- atomicity

pub fn fetch_add_from_many_threads_sums_exactly(b: &dyn Backend) {
    let f = Fixture::new(b);
    const THREADS: u64 = 4;
    const ADDS: u64 = 2000;
    let word = f.remote.remote_addr(256);
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let f = &f;
            s.spawn(move || {
                let cq = f.client.create_cq(256).unwrap();
                let scq = f.server.create_cq(16).unwrap();
                let (_s, qp) =
                    crate::connect_rc((f.server.as_ref(), &scq), (f.client.as_ref(), &cq)).unwrap();
                let result = f.client.register(8 * 32, Access::LOCAL).unwrap();
                let mut done = 0;
                while done < ADDS {
                    let n = (ADDS - done).min(32);
                    let wrs: Vec<SendWr> = (0..n)
                        .map(|i| {
                            SendWr::fetch_add(i, result.buf(i * 8, 8), word, t + 1)
                                .signaled(i == n - 1)
                        })
                        .collect();
                    qp.post_send(&wrs).unwrap();
                    let wc = wait(&cq, 1)[0];
                    assert_eq!(wc.status, WcStatus::Success);
                    done += n;
                }
            });
        }
    });
    let expected: u64 = (1..=THREADS).map(|t| t * ADDS).sum();
    assert_eq!(f.get_u64(256), expected);
}

pub fn cas_contention_has_exactly_one_winner(b: &dyn Backend) {
    let f = Fixture::new(b);
    const THREADS: u64 = 4;
    const WORDS: u64 = 300;
    let wins: Vec<AtomicU64> = (0..WORDS).map(|_| AtomicU64::new(0)).collect();
    std::thread::scope(|s| {
        for t in 1..=THREADS {
            let (f, wins) = (&f, &wins);
            s.spawn(move || {
                let cq = f.client.create_cq(16).unwrap();
                let scq = f.server.create_cq(16).unwrap();
                let (_s, qp) =
                    crate::connect_rc((f.server.as_ref(), &scq), (f.client.as_ref(), &cq)).unwrap();
                let result = f.client.register(8, Access::LOCAL).unwrap();
                for w in 0..WORDS {
                    let wc = exec(
                        &qp,
                        &cq,
                        SendWr::cas(
                            w,
                            result.buf(0, 8),
                            f.remote.remote_addr(4096 + w * 8),
                            0,
                            t,
                        ),
                    );
                    assert_eq!(wc.status, WcStatus::Success);
                    if result.load_u64(0).unwrap() == 0 {
                        wins[w as usize].fetch_add(1, Ordering::Relaxed);
                    }
                }
            });
        }
    });
    let owners = f.get(4096, (WORDS * 8) as usize);
    for w in 0..WORDS as usize {
        assert_eq!(
            wins[w].load(Ordering::Relaxed),
            1,
            "word {w} must have exactly one winner"
        );
        let owner = u64::from_le_bytes(owners[w * 8..][..8].try_into().unwrap());
        assert!((1..=THREADS).contains(&owner));
    }
}

// ---------------------------------------------------------------- error paths

fn expect_remote_access(f: &Fixture, wr: SendWr<'_>) {
    let wc = f.run(wr);
    assert_eq!(wc.status, WcStatus::RemoteAccess, "{wc:?}");
    f.assert_broken();
}

pub fn bad_rkey_is_a_remote_access_error(b: &dyn Backend) {
    let f = Fixture::new(b);
    let mut addr = f.remote.remote_addr(0);
    addr.rkey ^= 0x5a5a_0000;
    expect_remote_access(&f, SendWr::read(1, f.local.buf(0, 8), addr));
}

pub fn out_of_bounds_is_a_remote_access_error(b: &dyn Backend) {
    let f = Fixture::new(b);
    expect_remote_access(
        &f,
        SendWr::write(
            1,
            f.local.buf(0, 16),
            f.remote.remote_addr(REGION_BYTES - 8),
        ),
    );
    let f = Fixture::new(b);
    expect_remote_access(
        &f,
        SendWr::read(1, f.local.buf(0, 8), f.remote.remote_addr(u64::MAX - 4)),
    );
}

pub fn missing_access_flags_are_remote_access_errors(b: &dyn Backend) {
    type MakeWr = fn(&Fixture, &Region) -> SendWr<'static>;
    let cases: [(Access, MakeWr); 3] = [
        (Access::REMOTE_READ | Access::REMOTE_ATOMIC, |f, r| {
            SendWr::write(1, f.local.buf(0, 8), r.remote_addr(0))
        }),
        (Access::REMOTE_WRITE | Access::REMOTE_ATOMIC, |f, r| {
            SendWr::read(1, f.local.buf(0, 8), r.remote_addr(0))
        }),
        (Access::REMOTE_READ | Access::REMOTE_WRITE, |f, r| {
            SendWr::cas(1, f.local.buf(0, 8), r.remote_addr(0), 0, 1)
        }),
    ];
    for (access, make) in cases {
        let f = Fixture::new(b);
        let limited = f.server.register(64, access).unwrap();
        expect_remote_access(&f, make(&f, &limited));
    }
}

pub fn misaligned_atomics_are_remote_access_errors(b: &dyn Backend) {
    let f = Fixture::new(b);
    expect_remote_access(
        &f,
        SendWr::cas(1, f.local.buf(0, 8), f.remote.remote_addr(4), 0, 1),
    );
    let f = Fixture::new(b);
    expect_remote_access(
        &f,
        SendWr::fetch_add(1, f.local.buf(0, 8), f.remote.remote_addr(12), 1),
    );
}

pub fn deregistered_region_is_unreachable(b: &dyn Backend) {
    let f = Fixture::new(b);
    let gone = f.server.register(64, Access::ALL).unwrap();
    let addr = gone.remote_addr(0);
    let wc = f.run(SendWr::read(1, f.local.buf(0, 8), addr));
    assert_eq!(wc.status, WcStatus::Success);
    drop(gone);
    expect_remote_access(&f, SendWr::read(2, f.local.buf(0, 8), addr));
}

pub fn local_protection_errors(b: &dyn Backend) {
    let f = Fixture::new(b);
    let read_only = f.client.register(64, Access::REMOTE_READ).unwrap();
    let wc = f.run(SendWr::read(
        1,
        read_only.buf(0, 8),
        f.remote.remote_addr(0),
    ));
    assert_eq!(
        wc.status,
        WcStatus::LocalProtection,
        "READ into memory without LOCAL_WRITE"
    );
    f.assert_broken();
    let f = Fixture::new(b);
    let wc = f.run(SendWr::write(
        1,
        f.local.buf(REGION_BYTES - 4, 8),
        f.remote.remote_addr(0),
    ));
    assert_eq!(
        wc.status,
        WcStatus::LocalProtection,
        "local buffer out of bounds"
    );
    f.assert_broken();
}

/// An error completes even an unsignaled request, and every request after it in the
/// same doorbell is flushed, in order; `recover` makes the queue pair usable again.
pub fn error_flushes_the_rest_and_recover_restores(b: &dyn Backend) {
    let f = Fixture::new(b);
    f.put(0, &7u64.to_le_bytes());
    let mut bad = f.remote.remote_addr(0);
    bad.rkey ^= 0x0101_0000;
    let wrs = [
        SendWr::write(10, crate::Src::Inline(&[1; 8]), f.remote.remote_addr(64)).unsignaled(),
        SendWr::read(11, f.local.buf(0, 8), bad).unsignaled(),
        SendWr::write(12, crate::Src::Inline(&[2; 8]), f.remote.remote_addr(0)).unsignaled(),
        SendWr::read(13, f.local.buf(0, 8), f.remote.remote_addr(0)),
    ];
    f.client_qp.post_send(&wrs).unwrap();
    let got = wait(&f.client_cq, 3);
    assert_eq!(
        got.iter().map(|c| (c.wr_id, c.status)).collect::<Vec<_>>(),
        vec![
            (11, WcStatus::RemoteAccess),
            (12, WcStatus::WrFlush),
            (13, WcStatus::WrFlush)
        ]
    );
    assert_eq!(f.client_qp.state(), QpState::Error);
    assert!(drain(&f.client_cq, Duration::from_millis(20)).is_empty());
    f.client_qp.recover().unwrap();
    assert_eq!(f.client_qp.state(), QpState::Ready);
    assert_eq!(f.get_u64(0), 7, "the flushed WRITE never landed");
    assert_eq!(f.get(64, 8), vec![1; 8], "the WRITE before the error did");
}

pub fn posting_rejects_malformed_requests(b: &dyn Backend) {
    let f = Fixture::with(b, |c| QpConfig {
        max_inline: 64,
        ..c
    });
    let big = [0u8; 65];
    let err = f.client_qp.post_send(&[
        SendWr::write(1, crate::Src::Inline(&[0; 8]), f.remote.remote_addr(0)),
        SendWr::write(2, crate::Src::Inline(&big), f.remote.remote_addr(0)),
    ]);
    assert!(
        matches!(err, Err(FabricError::Post { index: 1, .. })),
        "{err:?}"
    );
    assert_eq!(
        wait(&f.client_cq, 1)[0].wr_id,
        1,
        "requests before the rejected one were posted"
    );
    let err = f.client_qp.post_send(&[SendWr::cas(
        1,
        f.local.buf(0, 16),
        f.remote.remote_addr(0),
        0,
        1,
    )]);
    assert!(
        matches!(err, Err(FabricError::Post { index: 0, .. })),
        "{err:?}"
    );
    let err = f
        .client_qp
        .post_send(&[SendWr::send(1, f.local.buf(0, 8)).to(UdDest {
            endpoint: f.server_qp.endpoint(),
            qkey: 1,
        })]);
    assert!(
        matches!(err, Err(FabricError::Post { index: 0, .. })),
        "{err:?}"
    );
    assert_eq!(
        f.client_qp.state(),
        QpState::Ready,
        "rejected requests do not break the queue pair"
    );
    let cq = f.client.create_cq(4).unwrap();
    let lonely = f.client.create_qp(&QpConfig::rc(&cq)).unwrap();
    let err = lonely.post_send(&[SendWr::read(1, f.local.buf(0, 8), f.remote.remote_addr(0))]);
    assert!(
        matches!(
            err,
            Err(FabricError::InvalidState {
                state: QpState::Init,
                ..
            })
        ),
        "{err:?}"
    );
}

/// Unsignaled requests hold send-queue slots until a later completion is polled.
pub fn send_queue_depth_is_enforced(b: &dyn Backend) {
    let f = Fixture::with(b, |c| QpConfig {
        max_send_wr: 16,
        ..c
    });
    let wrs: Vec<SendWr> = (0..16)
        .map(|i| {
            SendWr::write(i, crate::Src::Inline(&[1; 8]), f.remote.remote_addr(0)).unsignaled()
        })
        .collect();
    f.client_qp.post_send(&wrs).unwrap();
    let err =
        f.client_qp
            .post_send(&[SendWr::read(99, f.local.buf(0, 8), f.remote.remote_addr(0))]);
    assert!(
        matches!(&err, Err(FabricError::Post { index: 0, source }) if matches!(**source, FabricError::QueueFull { .. })),
        "{err:?}"
    );
    assert_eq!(f.client_qp.state(), QpState::Ready);
    // Nothing is signaled, so nothing retires: the queue stays full.
    assert!(drain(&f.client_cq, Duration::from_millis(10)).is_empty());
    assert!(
        f.client_qp
            .post_send(&[SendWr::read(99, f.local.buf(0, 8), f.remote.remote_addr(0))])
            .is_err()
    );
    // A fresh pair where the 16th request is signaled: polling it frees all 16.
    let f = Fixture::with(b, |c| QpConfig {
        max_send_wr: 16,
        ..c
    });
    let wrs: Vec<SendWr> = (0..16)
        .map(|i| {
            SendWr::write(i, crate::Src::Inline(&[1; 8]), f.remote.remote_addr(0)).signaled(i == 15)
        })
        .collect();
    f.client_qp.post_send(&wrs).unwrap();
    wait(&f.client_cq, 1);
    let more: Vec<SendWr> = (0..16)
        .map(|i| SendWr::read(i, f.local.buf(0, 8), f.remote.remote_addr(0)).signaled(i == 15))
        .collect();
    f.client_qp.post_send(&more).unwrap();
    wait(&f.client_cq, 1);
}

pub fn completion_queue_polls_n_at_a_time(b: &dyn Backend) {
    let f = Fixture::new(b);
    let wrs: Vec<SendWr> = (0..10)
        .map(|i| SendWr::read(i, f.local.buf(i * 8, 8), f.remote.remote_addr(0)))
        .collect();
    f.client_qp.post_send(&wrs).unwrap();
    let mut seen = Vec::new();
    let deadline = Instant::now() + PATIENCE;
    let mut out = [Completion::default(); 3];
    while seen.len() < 10 {
        assert!(Instant::now() < deadline);
        let n = f.client_cq.poll(&mut out).unwrap();
        assert!(n <= 3);
        seen.extend(out[..n].iter().map(|c| c.wr_id));
    }
    assert_eq!(
        seen,
        (0..10).collect::<Vec<_>>(),
        "completions of one QP come in posting order"
    );
    assert_eq!(f.client_cq.poll(&mut out).unwrap(), 0);
}

pub fn dead_peer_fails_with_retry_exceeded(b: &dyn Backend) {
    let Fixture {
        server_qp,
        client_qp,
        client_cq,
        local,
        remote,
        ..
    } = Fixture::new(b);
    drop(server_qp);
    let wc = exec(
        &client_qp,
        &client_cq,
        SendWr::read(1, local.buf(0, 8), remote.remote_addr(0)),
    );
    assert_eq!(wc.status, WcStatus::RetryExceeded);
    assert_eq!(client_qp.state(), QpState::Error);
}

// ---------------------------------------------------------------- RNR

pub fn send_without_receive_exhausts_rnr_retries(b: &dyn Backend) {
    let f = Fixture::with(b, |c| QpConfig {
        rnr_retry: 2,
        rnr_timer: Duration::from_millis(1),
        ..c
    });
    let wc = f.run(SendWr::send(1, crate::Src::Inline(b"anyone?")));
    assert_eq!(wc.status, WcStatus::RnrRetryExceeded);
    f.assert_broken();
}

/// A SEND waiting on RNR completes once the receiver posts a receive, and RC order
/// holds: a WRITE posted after it does not land before it.
pub fn rnr_send_completes_when_a_receive_arrives(b: &dyn Backend) {
    let f = Fixture::with(b, |c| QpConfig {
        rnr_retry: 7,
        rnr_timer: Duration::from_micros(100),
        ..c
    });
    f.put(0, &0u64.to_le_bytes());
    let five = 5u64.to_le_bytes();
    let wrs = [
        SendWr::send(1, crate::Src::Inline(b"late")),
        SendWr::write(2, crate::Src::Inline(&five), f.remote.remote_addr(0)),
    ];
    f.client_qp.post_send(&wrs).unwrap();
    assert!(
        drain(&f.client_cq, Duration::from_millis(20)).is_empty(),
        "the SEND waits for a receive"
    );
    // Peek at the word through another queue pair: the WRITE must still wait.
    let peek_cq = f.client.create_cq(4).unwrap();
    let scq = f.server.create_cq(4).unwrap();
    let (_s, peek) =
        crate::connect_rc((f.server.as_ref(), &scq), (f.client.as_ref(), &peek_cq)).unwrap();
    let wc = exec(
        &peek,
        &peek_cq,
        SendWr::read(1, f.local.buf(64, 8), f.remote.remote_addr(0)),
    );
    assert_eq!(wc.status, WcStatus::Success);
    assert_eq!(
        f.local.load_u64(64).unwrap(),
        0,
        "a WRITE behind an RNR-waiting SEND must not land"
    );
    let inbox = f
        .server
        .register(64, Access::LOCAL_WRITE | Access::REMOTE_READ)
        .unwrap();
    f.server_qp
        .post_recv(&[RecvWr {
            wr_id: 9,
            buf: inbox.buf(0, 64),
        }])
        .unwrap();
    let got = wait(&f.client_cq, 2);
    assert_eq!(
        got.iter().map(|c| (c.wr_id, c.status)).collect::<Vec<_>>(),
        vec![(1, WcStatus::Success), (2, WcStatus::Success)]
    );
    assert_eq!(wait(&f.server_cq, 1)[0].byte_len, 4);
    assert_eq!(f.get_from(&inbox, 0, 4), b"late");
    assert_eq!(f.get_u64(0), 5);
}

// ---------------------------------------------------------------- UD

struct UdPair {
    a: Arc<dyn Device>,
    b: Arc<dyn Device>,
    a_cq: Arc<dyn CompletionQueue>,
    b_cq: Arc<dyn CompletionQueue>,
    a_qp: Arc<dyn QueuePair>,
    b_qp: Arc<dyn QueuePair>,
}

fn ud_pair(backend: &dyn Backend) -> UdPair {
    let mut d = backend.devices(2);
    let b = d.pop().unwrap();
    let a = d.pop().unwrap();
    let a_cq = a.create_cq(4096).unwrap();
    let b_cq = b.create_cq(4096).unwrap();
    a.add_peer(b.node(), &b.address()).unwrap();
    b.add_peer(a.node(), &a.address()).unwrap();
    let a_qp = a.create_qp(&QpConfig::ud(&a_cq)).unwrap();
    let b_qp = b.create_qp(&QpConfig::ud(&b_cq)).unwrap();
    assert_eq!(a_qp.kind(), QpKind::Ud);
    UdPair {
        a,
        b,
        a_cq,
        b_cq,
        a_qp,
        b_qp,
    }
}

/// Datagrams arrive with the GRH in front, the sender's endpoint, and their payload;
/// the receiver must not rely on order (and, where the backend may drop, on arrival).
pub fn ud_datagrams_arrive_with_grh_in_any_order(b: &dyn Backend) {
    let p = ud_pair(b);
    const N: u64 = 200;
    let slot = 4096 + GRH_BYTES as u64;
    let inbox = p.b.register(slot * N, Access::LOCAL_WRITE).unwrap();
    let recvs: Vec<RecvWr> = (0..N)
        .map(|i| RecvWr {
            wr_id: i,
            buf: inbox.buf(i * slot, slot as u32),
        })
        .collect();
    p.b_qp.post_recv(&recvs).unwrap();
    let dest = UdDest {
        endpoint: p.b_qp.endpoint(),
        qkey: QpConfig::DEFAULT_QKEY,
    };
    // The payloads are staged on the receiving device and fetched into the sender's
    // buffer with a READ: the sender may be a device in another process, whose memory
    // the suite never touches with the CPU.
    let staged = p.b.register(N * 16, Access::REMOTE_READ).unwrap();
    for i in 0..N {
        let len = 8 + (i % 9);
        staged
            .write(i * 16, &pattern(len as usize, i as u8))
            .unwrap();
    }
    let out = p.a.register(N * 16, Access::LOCAL).unwrap();
    let (fetch_cq, peer_cq) = (p.a.create_cq(4).unwrap(), p.b.create_cq(4).unwrap());
    let (fetch, _peer) =
        crate::connect_rc((p.a.as_ref(), &fetch_cq), (p.b.as_ref(), &peer_cq)).unwrap();
    let wc = exec(
        &fetch,
        &fetch_cq,
        SendWr::read(0, out.buf(0, (N * 16) as u32), staged.remote_addr(0)),
    );
    assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
    for i in 0..N {
        let len = 8 + (i % 9);
        let wr = SendWr::send_imm(i, out.buf(i * 16, len as u32), i as u32)
            .to(dest)
            .signaled(i % 16 == 15 || i == N - 1);
        p.a_qp.post_send(&[wr]).unwrap();
        if i % 16 == 15 || i == N - 1 {
            assert_eq!(wait(&p.a_cq, 1)[0].status, WcStatus::Success);
        }
    }
    let got = if b.ud_may_drop() {
        drain(&p.b_cq, Duration::from_millis(200))
    } else {
        wait(&p.b_cq, N as usize)
    };
    let mut seen = HashSet::new();
    for (k, wc) in got.iter().enumerate() {
        assert_eq!(wc.status, WcStatus::Success);
        assert_eq!(wc.wr_id, k as u64, "receives are consumed in posting order");
        assert_eq!(wc.src, Some(p.a_qp.endpoint()));
        let i = wc.imm.expect("imm") as u64;
        let len = 8 + (i % 9);
        assert_eq!(wc.byte_len as u64, GRH_BYTES as u64 + len);
        assert_eq!(
            inbox
                .to_vec(wc.wr_id * slot + GRH_BYTES as u64, len as usize)
                .unwrap(),
            pattern(len as usize, i as u8)
        );
        assert!(seen.insert(i), "datagram {i} delivered twice");
    }
    if !b.ud_may_drop() {
        assert_eq!(seen.len() as u64, N);
    }
}

pub fn ud_enforces_the_mtu(b: &dyn Backend) {
    let p = ud_pair(b);
    let inbox = p.b.register(2 * 8192, Access::LOCAL_WRITE).unwrap();
    p.b_qp
        .post_recv(&[
            RecvWr {
                wr_id: 1,
                buf: inbox.buf(0, 8192),
            },
            RecvWr {
                wr_id: 2,
                buf: inbox.buf(8192, 8192),
            },
        ])
        .unwrap();
    let out = p.a.register(8192, Access::LOCAL).unwrap();
    let dest = UdDest {
        endpoint: p.b_qp.endpoint(),
        qkey: QpConfig::DEFAULT_QKEY,
    };
    let wc = exec(
        &p.a_qp,
        &p.a_cq,
        SendWr::send(1, out.buf(0, UD_MTU)).to(dest),
    );
    assert_eq!(wc.status, WcStatus::Success, "exactly the MTU is fine");
    if !b.ud_may_drop() {
        assert_eq!(wait(&p.b_cq, 1)[0].byte_len, UD_MTU + GRH_BYTES);
    }
    let wc = exec(
        &p.a_qp,
        &p.a_cq,
        SendWr::send(2, out.buf(0, UD_MTU + 1)).to(dest),
    );
    assert_eq!(wc.status, WcStatus::LocalLength, "one byte over the MTU");
    assert_eq!(p.a_qp.state(), QpState::Error);
}

pub fn ud_drops_datagrams_with_a_wrong_qkey(b: &dyn Backend) {
    let p = ud_pair(b);
    let inbox = p.b.register(8192, Access::LOCAL_WRITE).unwrap();
    p.b_qp
        .post_recv(&[RecvWr {
            wr_id: 1,
            buf: inbox.buf(0, 8192),
        }])
        .unwrap();
    let dest = UdDest {
        endpoint: p.b_qp.endpoint(),
        qkey: QpConfig::DEFAULT_QKEY ^ 1,
    };
    let wc = exec(
        &p.a_qp,
        &p.a_cq,
        SendWr::send(1, crate::Src::Inline(b"x")).to(dest),
    );
    assert_eq!(
        wc.status,
        WcStatus::Success,
        "UD senders learn nothing of delivery"
    );
    assert!(drain(&p.b_cq, Duration::from_millis(30)).is_empty());
}

pub fn ud_has_no_one_sided_operations(b: &dyn Backend) {
    let p = ud_pair(b);
    let r = p.b.register(64, Access::ALL).unwrap();
    let l = p.a.register(64, Access::ALL).unwrap();
    let dest = UdDest {
        endpoint: p.b_qp.endpoint(),
        qkey: QpConfig::DEFAULT_QKEY,
    };
    let err = p
        .a_qp
        .post_send(&[SendWr::read(1, l.buf(0, 8), r.remote_addr(0)).to(dest)]);
    assert!(
        matches!(err, Err(FabricError::Post { index: 0, .. })),
        "{err:?}"
    );
    assert!(
        p.a_qp.connect(p.b_qp.endpoint()).is_err(),
        "UD queue pairs do not connect"
    );
}

// ---------------------------------------------------------------- async layer

/// Many coroutines on one thread, each incrementing a shared word with a CAS loop: the
/// futures interleave on one completion queue and no increment is lost.
pub fn async_coroutines_share_one_completion_queue(b: &dyn Backend) {
    let f = Fixture::new(b);
    let driver = CqDriver::new(f.client_cq.clone());
    let qp = AsyncQp::new(f.client_qp.clone(), driver.clone());
    const COROUTINES: u64 = 32;
    const INCREMENTS: u64 = 20;
    let word = f.remote.remote_addr(0);
    let tasks = (0..COROUTINES).map(|c| {
        let (qp, f) = (&qp, &f);
        async move {
            let result = f.local.buf(64 + c * 8, 8);
            let mut expected = 0;
            let mut attempts = 0;
            for _ in 0..INCREMENTS {
                loop {
                    attempts += 1;
                    assert!(
                        attempts < 100_000,
                        "CAS loop of coroutine {c} does not converge"
                    );
                    qp.run_one(SendWr::cas(0, result, word, expected, expected + 1))
                        .await
                        .unwrap();
                    let old = f.local.load_u64(64 + c * 8).unwrap();
                    if old == expected {
                        expected += 1;
                        break;
                    }
                    expected = old;
                }
            }
        }
    });
    futures_lite_block_on(join_all(tasks.collect()));
    assert_eq!(f.get_u64(0), COROUTINES * INCREMENTS);
    assert_eq!(driver.in_flight(), 0);
}

pub fn async_batch_reports_the_failing_request(b: &dyn Backend) {
    let f = Fixture::new(b);
    let qp = AsyncQp::new(f.client_qp.clone(), CqDriver::new(f.client_cq.clone()));
    let ok = [
        SendWr::write(0, crate::Src::Inline(&[3; 8]), f.remote.remote_addr(0)),
        SendWr::read(0, f.local.buf(0, 8), f.remote.remote_addr(0)),
    ];
    futures_lite_block_on(qp.run(&ok)).unwrap();
    assert_eq!(f.local.to_vec(0, 8).unwrap(), vec![3; 8]);
    // In place: the caller's requests are what is posted, numbered and with only the
    // last one signaled.
    let mut in_place = [
        SendWr::write(0, crate::Src::Inline(&[5; 8]), f.remote.remote_addr(8)),
        SendWr::read(0, f.local.buf(8, 8), f.remote.remote_addr(8)),
    ];
    futures_lite_block_on(qp.run_in_place(&mut in_place)).unwrap();
    assert_eq!(f.local.to_vec(8, 8).unwrap(), vec![5; 8]);
    assert_ne!(in_place[0].wr_id, in_place[1].wr_id);
    assert!(!in_place[0].signaled && in_place[1].signaled);
    let mut bad = [
        SendWr::read(0, f.local.buf(0, 8), f.remote.remote_addr(0)),
        SendWr::read(0, f.local.buf(0, 8), f.remote.remote_addr(REGION_BYTES)),
        SendWr::read(0, f.local.buf(0, 8), f.remote.remote_addr(0)),
    ];
    let err = futures_lite_block_on(qp.run_in_place(&mut bad)).unwrap_err();
    assert_eq!(
        err,
        FabricError::Completion {
            status: WcStatus::RemoteAccess,
            index: 1
        }
    );
    let err = futures_lite_block_on(qp.run(&ok[..1])).unwrap_err();
    assert_eq!(
        err,
        FabricError::Completion {
            status: WcStatus::WrFlush,
            index: 0
        }
    );
}

/// A batch longer than the send queue is posted in pieces as completions free room,
/// alone or beside another coroutine's, and an error deep in it names its index in the
/// whole batch.
pub fn async_batch_longer_than_the_send_queue_completes(b: &dyn Backend) {
    const DEPTH: u32 = 16;
    let f = Fixture::with(b, |c| QpConfig {
        max_send_wr: DEPTH,
        ..c
    });
    let driver = CqDriver::new(f.client_cq.clone());
    let qp = AsyncQp::new(f.client_qp.clone(), driver.clone());
    let word = |i: u64| (i * 3 + 1).to_le_bytes();
    let words: Vec<[u8; 8]> = (0..100).map(word).collect();
    let writes: Vec<SendWr> = words
        .iter()
        .enumerate()
        .map(|(i, w)| SendWr::write(0, crate::Src::Inline(w), f.remote.remote_addr(8 * i as u64)))
        .collect();
    futures_lite_block_on(qp.run(&writes)).unwrap();
    let mut reads: Vec<SendWr> = (0..100u64)
        .map(|i| SendWr::read(0, f.local.buf(8 * i, 8), f.remote.remote_addr(8 * i)))
        .collect();
    futures_lite_block_on(qp.run_in_place(&mut reads)).unwrap();
    for i in 0..100 {
        assert_eq!(f.local.to_vec(8 * i, 8).unwrap(), word(i), "word {i}");
    }
    // Two coroutines whose batches together need five times the queue.
    let tasks = (0..2u64).map(|c| {
        let (qp, f) = (&qp, &f);
        async move {
            let base = 4096 + c * 1024;
            let reads: Vec<SendWr> = (0..40u64)
                .map(|i| SendWr::read(0, f.local.buf(base + 8 * i, 8), f.remote.remote_addr(8 * i)))
                .collect();
            qp.run(&reads).await.unwrap();
            for i in 0..40 {
                assert_eq!(f.local.to_vec(base + 8 * i, 8).unwrap(), word(i));
            }
        }
    });
    futures_lite_block_on(join_all(tasks.collect()));
    assert_eq!(driver.in_flight(), 0);
    let mut bad: Vec<SendWr> = (0..50u64)
        .map(|i| SendWr::read(0, f.local.buf(8 * i, 8), f.remote.remote_addr(8 * i)))
        .collect();
    bad[37] = SendWr::read(0, f.local.buf(0, 8), f.remote.remote_addr(REGION_BYTES));
    let err = futures_lite_block_on(qp.run(&bad)).unwrap_err();
    assert_eq!(
        err,
        FabricError::Completion {
            status: WcStatus::RemoteAccess,
            index: 37
        }
    );
    // A batch given up while it waits for room leaves nothing behind in the driver.
    let f = Fixture::with(b, |c| QpConfig {
        max_send_wr: DEPTH,
        ..c
    });
    let driver = CqDriver::new(f.client_cq.clone());
    let qp = AsyncQp::new(f.client_qp.clone(), driver.clone());
    let fill: Vec<SendWr> = (0..DEPTH as u64 - 4)
        .map(|i| SendWr::read(i, f.local.buf(0, 8), f.remote.remote_addr(0)).unsignaled())
        .collect();
    f.client_qp.post_send(&fill).unwrap();
    // Eight: four fit, unsignaled, and four wait; then one, for which no room is left.
    // Nothing retires the queue, so neither batch can finish.
    for len in [8, 1] {
        let waiting: Vec<SendWr> = (0..len)
            .map(|_| SendWr::read(0, f.local.buf(0, 8), f.remote.remote_addr(0)))
            .collect();
        let mut batch = std::pin::pin!(qp.run(&waiting[..]));
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        assert!(batch.as_mut().poll(&mut cx).is_pending(), "batch of {len}");
        assert_eq!(driver.in_flight(), 1);
    }
    assert_eq!(driver.in_flight(), 0);
}

/// A minimal executor for the suite, so fabric needs no runtime dependency: polls the
/// future until ready (the async layer's futures re-wake themselves).
fn futures_lite_block_on<F: std::future::Future>(fut: F) -> F::Output {
    use std::task::{Context, Poll, Waker};
    let mut fut = std::pin::pin!(fut);
    let mut cx = Context::from_waker(Waker::noop());
    loop {
        if let Poll::Ready(v) = fut.as_mut().poll(&mut cx) {
            return v;
        }
    }
}

/// Polls every future in turn until all are ready.
async fn join_all<F: std::future::Future<Output = ()>>(futs: Vec<F>) {
    let mut futs: Vec<Option<std::pin::Pin<Box<F>>>> =
        futs.into_iter().map(|f| Some(Box::pin(f))).collect();
    std::future::poll_fn(move |cx| {
        let mut pending = false;
        for slot in futs.iter_mut() {
            if let Some(f) = slot {
                if f.as_mut().poll(cx).is_ready() {
                    *slot = None;
                } else {
                    pending = true;
                }
            }
        }
        if pending {
            std::task::Poll::Pending
        } else {
            std::task::Poll::Ready(())
        }
    })
    .await
}

/// Expands to one `#[test]` per conformance case, each on a backend made by `$make`.
#[macro_export]
macro_rules! conformance_tests {
    ($make:expr) => {
        $crate::conformance_tests!(@cases $make;
            write_then_read_round_trips,
            inline_write_needs_no_registration,
            read_reports_its_opcode_and_length,
            cas_swaps_only_on_match,
            fetch_add_returns_old_and_wraps,
            atomic_results_are_words_in_region_byte_order,
            send_lands_in_posted_receive,
            write_with_imm_consumes_a_receive,
            sends_arrive_in_order_on_rc,
            receive_buffer_too_small_fails_both_sides,
            signaled_completion_implies_earlier_requests,
            rc_executes_in_posting_order,
            write_last_word_implies_rest,
            reads_tear_only_at_word_boundaries,
            fetch_add_from_many_threads_sums_exactly,
            cas_contention_has_exactly_one_winner,
            bad_rkey_is_a_remote_access_error,
            out_of_bounds_is_a_remote_access_error,
            missing_access_flags_are_remote_access_errors,
            misaligned_atomics_are_remote_access_errors,
            deregistered_region_is_unreachable,
            local_protection_errors,
            error_flushes_the_rest_and_recover_restores,
            posting_rejects_malformed_requests,
            send_queue_depth_is_enforced,
            completion_queue_polls_n_at_a_time,
            dead_peer_fails_with_retry_exceeded,
            send_without_receive_exhausts_rnr_retries,
            rnr_send_completes_when_a_receive_arrives,
            ud_datagrams_arrive_with_grh_in_any_order,
            ud_enforces_the_mtu,
            ud_drops_datagrams_with_a_wrong_qkey,
            ud_has_no_one_sided_operations,
            async_coroutines_share_one_completion_queue,
            async_batch_reports_the_failing_request,
            async_batch_longer_than_the_send_queue_completes,
        );
    };
    (@cases $make:expr; $($case:ident),* $(,)?) => {
        $(
            #[test]
            fn $case() {
                let backend = $make;
                $crate::conformance::$case(&backend);
            }
        )*
    };
}
