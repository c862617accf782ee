//! Durable memory servers in-process: region memory changed one-sidedly over a sim
//! device, made durable with Persist, and read back through the fabric from a new
//! server started on the same data directory.

mod common;

use common::Node;
use fabric::conformance::exec;
use fabric::sim::{SimConfig, SimNetwork};
use fabric::{Access, Device, SendWr, Src, WcStatus};
use memory_server::proto::memory_server_client::MemoryServerClient;
use memory_server::{
    BATCH_STALL, Client, ClusterToken, DurabilityConfig, MemoryServer, PersistRange, PersistStatus,
    Persister, RegionPlan, SESSION_METADATA, ServerConfig, ServerError,
};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tonic::Code;

const DATA_BYTES: u64 = 64 << 10;
const REGION_BYTES: u64 = 32 << 10;
const LOCK: u64 = 1 << 63;

fn token() -> ClusterToken {
    ClusterToken::new("durable-test-cluster-token").unwrap()
}

/// A server on a fresh sim network (fresh, zeroed memory) with `dir` as its data
/// directory (`None`: not durable).
async fn start(
    dir: Option<&Path>,
    tune: impl FnOnce(&mut DurabilityConfig),
) -> Result<(MemoryServer, SimNetwork), ServerError> {
    start_plan(dir, DATA_BYTES, tune).await
}

async fn start_plan(
    dir: Option<&Path>,
    data_bytes: u64,
    tune: impl FnOnce(&mut DurabilityConfig),
) -> Result<(MemoryServer, SimNetwork), ServerError> {
    let net = SimNetwork::new(SimConfig::default());
    let device: Arc<dyn Device> = net.add_node();
    let plan = RegionPlan::new(data_bytes, REGION_BYTES).unwrap();
    let mut config = ServerConfig::new("127.0.0.1:0".parse().unwrap(), plan, token());
    config.durability = dir.map(|dir| {
        let mut d = DurabilityConfig::new(dir);
        tune(&mut d);
        d
    });
    let server = MemoryServer::start(config, device).await?;
    Ok((server, net))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn persisted_bytes_survive_a_restart_and_unpersisted_ones_do_not() {
    let dir = tempfile::tempdir().unwrap();
    let (server, net) = start(Some(dir.path()), |_| {}).await.unwrap();
    assert_eq!(server.durability().unwrap().boot, 1);
    let node = Node::connect(&server, &net, &token()).await;
    assert!(node.client.server().durable);
    assert_eq!(node.client.server().boot, 1);
    let (rkey0, d0) = node.data(0).await;
    let (rkey1, d1) = node.data(1).await;

    node.write(d0, 64, b"persisted in data.0");
    node.write(d1, 4000, b"and in data.1");
    node.write(d1, 8000, b"written, never persisted");
    let journaled = node
        .client
        .persist(&[
            PersistRange::new(rkey0, 64, 19),
            PersistRange::new(rkey1, 4000, 13),
        ])
        .await
        .unwrap();
    assert_eq!(journaled, 32);
    // Changed after its Persist: the persisted value is what comes back.
    node.write(d0, 64, b"PERSISTED");
    // An empty request journals nothing.
    assert_eq!(node.client.persist(&[]).await.unwrap(), 0);
    let stats = node.client.stats().await.unwrap();
    assert!(stats.durable);
    assert_eq!(stats.boot, 1);
    assert_eq!((stats.persist_requests, stats.persist_ranges), (2, 2));
    assert_eq!((stats.journaled_bytes, stats.journal_fsyncs), (32, 1));
    assert_eq!(stats.rpc_count("Persist"), 2);
    drop(node);
    server.shutdown().await.unwrap();

    let (server, net) = start(Some(dir.path()), |_| {}).await.unwrap();
    let report = server.durability().unwrap().clone();
    assert_eq!(report.boot, 2);
    assert!(report.base_bytes > 0, "{report:?}");
    let node = Node::connect(&server, &net, &token()).await;
    assert_eq!(node.client.server().boot, 2);
    let (_, d0) = node.data(0).await;
    let (_, d1) = node.data(1).await;
    assert_eq!(node.read(d0, 64, 19), b"persisted in data.0");
    assert_eq!(node.read(d1, 4000, 13), b"and in data.1");
    assert_eq!(node.read(d1, 8000, 25), vec![0; 25]);
    drop(node);
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn background_checkpoints_keep_what_was_persisted_before_and_after() {
    let dir = tempfile::tempdir().unwrap();
    let tune = |d: &mut DurabilityConfig| d.checkpoint_interval = Duration::from_millis(20);
    let (server, net) = start(Some(dir.path()), tune).await.unwrap();
    let node = Node::connect(&server, &net, &token()).await;
    let (rkey, d0) = node.data(0).await;
    node.write(d0, 0, b"before the checkpoint");
    node.client
        .persist(&[PersistRange::new(rkey, 0, 21)])
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while server.stats().checkpoints == 0 {
        assert!(Instant::now() < deadline, "no checkpoint within 5 s");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    node.write(d0, 7, b"AFTER");
    node.client
        .persist(&[PersistRange::new(rkey, 7, 5)])
        .await
        .unwrap();
    // Later checkpoints too, so that the restore reads the base files.
    let seen = server.stats().checkpoints;
    while server.stats().checkpoints == seen {
        assert!(Instant::now() < deadline, "no second checkpoint within 5 s");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    drop(node);
    server.shutdown().await.unwrap();

    let (server, net) = start(Some(dir.path()), tune).await.unwrap();
    let report = server.durability().unwrap();
    assert_eq!(report.boot, 2);
    assert_eq!(report.batches, 0, "everything was checkpointed: {report:?}");
    let node = Node::connect(&server, &net, &token()).await;
    let (_, d0) = node.data(0).await;
    assert_eq!(node.read(d0, 0, 21), b"before AFTERheckpoint");
    drop(node);
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guarded_ranges_wait_for_the_lock_and_persist_what_the_holder_installed() {
    let dir = tempfile::tempdir().unwrap();
    let tune = |d: &mut DurabilityConfig| d.guard_wait = Duration::from_millis(300);
    let (server, net) = start(Some(dir.path()), tune).await.unwrap();
    let node = Node::connect(&server, &net, &token()).await;
    let (rkey, d0) = node.data(0).await;
    // A record at 256: header word (lock:1 | CID:63), then its body.
    node.cas(d0, 256, 0, 5);
    node.write(d0, 264, b"version 5");
    // Locked for an install of version 6.
    assert_eq!(node.cas(d0, 256, 5, LOCK | 6), 5);
    node.write(d0, 264, b"half-inst");
    let addr = server.local_addr().to_string();
    let persist = tokio::spawn(async move {
        let other = Client::connect(&addr, &token()).await.unwrap();
        other.persist(&[PersistRange::guarded(rkey, 256, 17)]).await
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        !persist.is_finished(),
        "a locked guard must hold the Persist back"
    );
    node.write(d0, 264, b"version 6");
    assert_eq!(node.cas(d0, 256, LOCK | 6, 6), LOCK | 6);
    assert_eq!(persist.await.unwrap().unwrap(), 17);

    // Never unlocked: the request gives up after the guard wait, naming the word.
    node.cas(d0, 256, 6, LOCK | 7);
    let started = Instant::now();
    let err = node
        .client
        .persist(&[PersistRange::guarded(rkey, 256, 17)])
        .await
        .unwrap_err();
    assert!(started.elapsed() >= Duration::from_millis(300));
    assert_eq!(err.code(), Some(Code::Aborted), "{err}");
    let said = err.to_string();
    assert!(
        said.contains("locked") && said.contains("offset 256"),
        "{said}"
    );
    drop(node);
    server.shutdown().await.unwrap();

    let (server, net) = start(Some(dir.path()), tune).await.unwrap();
    let node = Node::connect(&server, &net, &token()).await;
    let (_, d0) = node.data(0).await;
    assert_eq!(node.read(d0, 256, 8), 6u64.to_le_bytes());
    assert_eq!(node.read(d0, 264, 9), b"version 6");
    drop(node);
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_are_refused_with_clear_codes() {
    let dir = tempfile::tempdir().unwrap();
    let (server, net) = start(Some(dir.path()), |_| {}).await.unwrap();
    let node = Node::connect(&server, &net, &token()).await;
    let (rkey, _) = node.data(0).await;
    let (last, _) = node.data(1).await;
    let cases: Vec<(PersistRange, Code, &str)> = vec![
        (
            PersistRange::new(rkey ^ 0xdead, 0, 8),
            Code::InvalidArgument,
            "no region has rkey",
        ),
        (
            PersistRange::new(rkey, REGION_BYTES - 4, 8),
            Code::OutOfRange,
            "do not fit",
        ),
        (
            PersistRange::new(last, u64::MAX - 2, 8),
            Code::OutOfRange,
            "do not fit",
        ),
        (
            PersistRange::guarded(rkey, 4, 16),
            Code::InvalidArgument,
            "8-byte aligned",
        ),
        (
            PersistRange::guarded(rkey, 8, 4),
            Code::InvalidArgument,
            "at least 8 bytes",
        ),
    ];
    for (range, code, says) in cases {
        let err = node.client.persist(&[range]).await.unwrap_err();
        assert_eq!(err.code(), Some(code), "{range:?}: {err}");
        assert!(err.to_string().contains(says), "{range:?}: {err}");
    }
    let too_much: Vec<PersistRange> = (0..2049)
        .map(|_| PersistRange::new(rkey, 0, REGION_BYTES))
        .collect();
    let err = node.client.persist(&too_much).await.unwrap_err();
    assert_eq!(err.code(), Some(Code::InvalidArgument), "{err}");
    assert!(err.to_string().contains("split"), "{err}");
    assert_eq!(node.client.stats().await.unwrap().journaled_bytes, 0);

    // Without a session: unauthenticated, like every other RPC.
    let mut raw = MemoryServerClient::connect(format!("http://{}", server.local_addr()))
        .await
        .unwrap();
    let status = raw
        .persist(memory_server::proto::PersistRequest { ranges: vec![] })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unauthenticated);
    let mut req = tonic::Request::new(memory_server::proto::PersistRequest { ranges: vec![] });
    req.metadata_mut()
        .insert(SESSION_METADATA, "0".repeat(32).parse().unwrap());
    assert_eq!(
        raw.persist(req).await.unwrap_err().code(),
        Code::Unauthenticated
    );
    drop(node);
    server.shutdown().await.unwrap();

    // A server without a data directory says how to get one.
    let (server, net) = start(None, |_| {}).await.unwrap();
    let node = Node::connect(&server, &net, &token()).await;
    assert!(!node.client.server().durable);
    assert_eq!(node.client.server().boot, 0);
    let (rkey, _) = node.data(0).await;
    let err = node
        .client
        .persist(&[PersistRange::new(rkey, 0, 8)])
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(Code::FailedPrecondition), "{err}");
    assert!(err.to_string().contains("--data-dir"), "{err}");
    drop(node);
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_directory_made_for_other_regions_refuses_to_start() {
    let dir = tempfile::tempdir().unwrap();
    let (server, _net) = start(Some(dir.path()), |_| {}).await.unwrap();
    // Two servers on one directory would corrupt it.
    let err = start(Some(dir.path()), |_| {})
        .await
        .err()
        .expect("refused");
    assert!(
        err.to_string().contains("in use by another memory server"),
        "{err}"
    );
    server.shutdown().await.unwrap();
    let err = start_plan(Some(dir.path()), 2 * DATA_BYTES, |_| {})
        .await
        .err()
        .expect("refused");
    let said = err.to_string();
    assert!(
        said.contains("made for other regions")
            && said.contains("the data directory holds 3 regions"),
        "{said}"
    );
    // The directory is untouched by the refusal: the right plan still starts (boot 2).
    let (server, _net) = start(Some(dir.path()), |_| {}).await.unwrap();
    assert_eq!(server.durability().unwrap().boot, 2);
    server.shutdown().await.unwrap();
}

/// Polls `ticket` until it is answered (at most 10 s).
async fn answer(persister: &Persister, ticket: &memory_server::Ticket) -> PersistStatus {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match persister.poll(ticket) {
            PersistStatus::Pending if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(1)).await
            }
            status => return status,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_persister_batches_what_waits_yet_answers_each_persist_on_its_own() {
    let dir = tempfile::tempdir().unwrap();
    let tune = |d: &mut DurabilityConfig| d.guard_wait = Duration::from_secs(5);
    let (server, net) = start(Some(dir.path()), tune).await.unwrap();
    let node = Node::connect(&server, &net, &token()).await;
    let (rkey, d0) = node.data(0).await;
    let persister = Persister::with_runtime(&node.client, tokio::runtime::Handle::current());

    // 2 000 Persists submitted at once go in a few requests, every range in one.
    const WORDS: u64 = 2_000;
    for i in 0..WORDS {
        node.write(d0, 1024 + i * 8, &(i + 1).to_le_bytes());
    }
    let before = node.client.stats().await.unwrap();
    let tickets: Vec<_> = (0..WORDS)
        .map(|i| persister.submit(vec![PersistRange::new(rkey, 1024 + i * 8, 8)]))
        .collect();
    for t in &tickets {
        assert_eq!(answer(&persister, t).await, PersistStatus::Done);
    }
    let after = node.client.stats().await.unwrap();
    let requests = after.persist_requests - before.persist_requests;
    assert!(
        (1..=WORDS / 20).contains(&requests),
        "{WORDS} Persists took {requests} requests"
    );
    assert_eq!(after.persist_ranges - before.persist_ranges, WORDS);
    assert_eq!(after.journaled_bytes - before.journaled_bytes, WORDS * 8);

    // A bad range in a batch fails only its own Persist.
    let burst: Vec<_> = (0..100u64)
        .map(|i| {
            let offset = if i == 50 { u64::MAX - 4 } else { i * 8 };
            persister.submit(vec![PersistRange::new(rkey, offset, 8)])
        })
        .collect();
    for (i, t) in burst.iter().enumerate() {
        match answer(&persister, t).await {
            PersistStatus::Done => assert_ne!(i, 50),
            PersistStatus::Failed(why) => {
                assert_eq!(i, 50, "{why}");
                assert!(why.contains("OutOfRange"), "{why}");
            }
            other => panic!("Persist {i}: {other:?}"),
        }
    }

    // A batch held up by a locked guard word does not hold up the Persists after it:
    // one queued behind it before it counted as held up (with nothing submitted after
    // it, as when the Persist of a recovery that would unlock the word is the last),
    // and one submitted later.
    node.cas(d0, 256, 0, LOCK | 6);
    node.write(d0, 264, b"version 6");
    let held = persister.submit(vec![PersistRange::guarded(rkey, 256, 17)]);
    tokio::time::sleep(Duration::from_millis(5)).await;
    node.write(d0, 600, b"queued");
    let queued = persister.submit(vec![PersistRange::new(rkey, 600, 6)]);
    assert_eq!(answer(&persister, &queued).await, PersistStatus::Done);
    assert_eq!(
        persister.poll(&held),
        PersistStatus::Pending,
        "the guard is still locked"
    );
    tokio::time::sleep(BATCH_STALL + Duration::from_millis(30)).await;
    node.write(d0, 512, b"later");
    let later = persister.submit(vec![PersistRange::new(rkey, 512, 5)]);
    assert_eq!(answer(&persister, &later).await, PersistStatus::Done);
    assert_eq!(persister.poll(&held), PersistStatus::Pending);
    // Nor does a held-up Persist hold up the others of its batch: two submitted
    // together while a batch is on the wire go out together, and the one that does
    // not wait for the guard is answered on its own.
    tokio::time::sleep(Duration::from_millis(5)).await;
    node.write(d0, 700, b"companion");
    let held_too = persister.submit(vec![PersistRange::guarded(rkey, 256, 17)]);
    let companion = persister.submit(vec![PersistRange::new(rkey, 700, 9)]);
    assert_eq!(answer(&persister, &companion).await, PersistStatus::Done);
    assert_eq!(persister.poll(&held), PersistStatus::Pending);
    assert_eq!(persister.poll(&held_too), PersistStatus::Pending);
    assert_eq!(node.cas(d0, 256, LOCK | 6, 6), LOCK | 6);
    assert_eq!(answer(&persister, &held).await, PersistStatus::Done);
    assert_eq!(answer(&persister, &held_too).await, PersistStatus::Done);
    drop(node);
    server.shutdown().await.unwrap();

    // Everything acknowledged, batched or not, is there after a restart.
    let (server, net) = start(Some(dir.path()), tune).await.unwrap();
    let node = Node::connect(&server, &net, &token()).await;
    let (_, d0) = node.data(0).await;
    for i in 0..WORDS {
        assert_eq!(
            node.read(d0, 1024 + i * 8, 8),
            (i + 1).to_le_bytes(),
            "word {i}"
        );
    }
    assert_eq!(node.read(d0, 256, 8), 6u64.to_le_bytes());
    assert_eq!(node.read(d0, 264, 9), b"version 6");
    assert_eq!(node.read(d0, 512, 5), b"later");
    assert_eq!(node.read(d0, 600, 6), b"queued");
    assert_eq!(node.read(d0, 700, 9), b"companion");
    drop(node);
    server.shutdown().await.unwrap();
}

#[test]
fn a_persister_submits_from_a_plain_thread_and_polls_without_blocking() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (server, net) = runtime.block_on(start(Some(dir.path()), |_| {})).unwrap();
    let addr = server.local_addr().to_string();
    let dev: Arc<dyn Device> = net.add_node();
    let cq = dev.create_cq(64).unwrap();
    let client = memory_server::blocking::Client::connect(&addr, &token()).unwrap();
    assert!(client.server().durable);
    let data = client.list_regions().unwrap().get("data.0").unwrap().remote;
    let (qp, _) = client.connect_qp(&*dev, &cq).unwrap();
    let persister = Persister::new(&client);
    let tickets: Vec<_> = (0..32u64)
        .map(|i| {
            let wc = exec(
                &qp,
                &cq,
                SendWr::write(i, Src::Inline(&(i + 1).to_le_bytes()), data.at(i * 8)),
            );
            assert_eq!(wc.status, WcStatus::Success);
            persister.submit(vec![PersistRange::new(data.rkey, i * 8, 8)])
        })
        .collect();
    let bad = persister.submit(vec![PersistRange::new(data.rkey, data.len, 8)]);
    let deadline = Instant::now() + Duration::from_secs(10);
    for t in &tickets {
        while persister.poll(t) == PersistStatus::Pending {
            assert!(
                Instant::now() < deadline,
                "a Persist still pending after 10 s"
            );
            std::thread::yield_now();
        }
        assert_eq!(persister.poll(t), PersistStatus::Done);
        assert_eq!(persister.wait(t), Ok(()));
    }
    let why = persister.wait(&bad).unwrap_err();
    assert!(
        why.contains("do not fit") && why.contains("OutOfRange"),
        "{why}"
    );
    assert!(matches!(persister.poll(&bad), PersistStatus::Failed(_)));
    // A burst far beyond what is on the wire at once waits its turn instead of
    // failing, goes in batches, and group commit answers several with one fsync.
    let before = client.stats().unwrap();
    let burst: Vec<_> = (0..10_000u64)
        .map(|i| persister.submit(vec![PersistRange::new(data.rkey, 1024 + (i % 64) * 8, 8)]))
        .collect();
    for t in &burst {
        persister.wait(t).unwrap();
    }
    let after = client.stats().unwrap();
    let requests = after.persist_requests - before.persist_requests;
    assert!(
        (1..1_000).contains(&requests),
        "10 000 Persists took {requests} requests"
    );
    assert!(
        after.journal_fsyncs - before.journal_fsyncs <= requests,
        "{after:?}"
    );
    // A batch names each of the 64 words once.
    assert!(
        after.persist_ranges - before.persist_ranges <= 64 * requests,
        "{after:?}"
    );
    // Inside a runtime, waiting is refused rather than blocking it.
    let refused = runtime.block_on(async { persister.wait(&tickets[0]) });
    assert!(refused.unwrap_err().contains("poll"));
    client.close().unwrap();
    runtime.block_on(server.shutdown()).unwrap();

    let (server, net) = runtime.block_on(start(Some(dir.path()), |_| {})).unwrap();
    let dev: Arc<dyn Device> = net.add_node();
    let cq = dev.create_cq(64).unwrap();
    let client =
        memory_server::blocking::Client::connect(&server.local_addr().to_string(), &token())
            .unwrap();
    let (qp, _) = client.connect_qp(&*dev, &cq).unwrap();
    let data = client.list_regions().unwrap().get("data.0").unwrap().remote;
    let local = dev.register(256, Access::ALL).unwrap();
    let wc = exec(&qp, &cq, SendWr::read(1, local.buf(0, 256), data.at(0)));
    assert_eq!(wc.status, WcStatus::Success);
    for i in 0..32u64 {
        assert_eq!(local.load_u64(i * 8).unwrap(), i + 1);
    }
    // Submitting after the client closed fails the ticket instead of hanging.
    let persister = Persister::new(&client);
    client.close().unwrap();
    let late = persister.submit(vec![PersistRange::new(data.rkey, 0, 8)]);
    assert!(persister.wait(&late).is_err());
    runtime.block_on(server.shutdown()).unwrap();
}
