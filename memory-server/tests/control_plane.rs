//! A memory server on a sim device, driven over real gRPC on 127.0.0.1 by clients whose
//! devices are other nodes of the same sim network; the data path is real fabric
//! operations against the regions the directory lists.

use fabric::sim::{SimConfig, SimNetwork};
use fabric::{
    Access, Completion, CompletionQueue, Device, QpConfig, QpEndpoint, QueuePair, SendWr, Src,
    WcStatus,
};
use hmac::{Hmac, Mac};
use memory_server::proto::memory_server_client::MemoryServerClient;
use memory_server::proto::remote_verbs_client::RemoteVerbsClient;
use memory_server::proto::{self, QpKind};
use memory_server::{
    CATALOG_BYTES, CATALOG_REGION, Client, ClientError, ClusterToken, MemoryServer, RegionPlan,
    SESSION_METADATA, ServerConfig,
};
use sha2::Sha256;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tonic::transport::Channel;
use tonic::{Code, Request};

const TOKEN: &str = "integration-test-cluster-token";
const DATA_BYTES: u64 = 64 << 10;
const REGION_BYTES: u64 = 32 << 10;

fn token() -> ClusterToken {
    ClusterToken::new(TOKEN).unwrap()
}

struct Setup {
    server: MemoryServer,
    net: SimNetwork,
    addr: String,
}

impl Setup {
    async fn start() -> Setup {
        Setup::start_with(|c| c).await
    }

    async fn start_with(tune: impl FnOnce(ServerConfig) -> ServerConfig) -> Setup {
        let net = SimNetwork::new(SimConfig::default());
        let device: Arc<dyn Device> = net.add_node();
        let plan = RegionPlan::new(DATA_BYTES, REGION_BYTES).unwrap();
        let config = tune(ServerConfig::new(
            "127.0.0.1:0".parse().unwrap(),
            plan,
            token(),
        ));
        let server = MemoryServer::start(config, device).await.unwrap();
        let addr = server.local_addr().to_string();
        Setup { server, net, addr }
    }

    /// A compute node: a fresh device on the server's network with a completion queue.
    fn node(&self) -> (Arc<dyn Device>, Arc<dyn CompletionQueue>) {
        let dev: Arc<dyn Device> = self.net.add_node();
        let cq = dev.create_cq(64).unwrap();
        (dev, cq)
    }
}

/// Posts one work request and waits for its completion.
fn run(qp: &dyn QueuePair, cq: &dyn CompletionQueue, wr: SendWr<'_>) -> Completion {
    qp.post_send(&[wr]).expect("posted");
    let mut out = [Completion::default(); 1];
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        if cq.poll(&mut out).unwrap() == 1 {
            return out[0];
        }
        assert!(Instant::now() < deadline, "no completion within 5 s");
        std::hint::spin_loop();
    }
}

fn ok(c: Completion) {
    assert_eq!(c.status, WcStatus::Success, "{c:?}");
}

/// The proofs exactly as control.proto documents them: this is the check that the
/// documentation and the server agree.
fn documented_proof(token: &str, who: &str, client_nonce: &[u8], server_nonce: &[u8]) -> Vec<u8> {
    let mut mac = Hmac::<Sha256>::new_from_slice(token.as_bytes()).unwrap();
    mac.update(format!("namdb.memory_server.v1 {who} proof").as_bytes());
    mac.update(&[0]);
    mac.update(client_nonce);
    mac.update(server_nonce);
    mac.finalize().into_bytes().to_vec()
}

async fn raw(addr: &str) -> MemoryServerClient<Channel> {
    MemoryServerClient::connect(format!("http://{addr}"))
        .await
        .unwrap()
}

/// Runs the handshake by hand with `token`; returns the Authenticate outcome and what
/// was sent, for replays.
async fn raw_handshake(
    rpc: &mut MemoryServerClient<Channel>,
    token: &str,
) -> (
    Result<proto::AuthenticateResponse, tonic::Status>,
    proto::AuthenticateRequest,
) {
    let client_nonce = [0x5a; 32];
    let hello = rpc
        .hello(proto::HelloRequest {
            client_nonce: client_nonce.to_vec(),
        })
        .await
        .unwrap()
        .into_inner();
    let req = proto::AuthenticateRequest {
        challenge_id: hello.challenge_id,
        client_proof: documented_proof(token, "client", &client_nonce, &hello.server_nonce),
        incarnation: 0,
    };
    let result = rpc.authenticate(req.clone()).await.map(|r| r.into_inner());
    (result, req)
}

fn with_session<T>(message: T, session: &str) -> Request<T> {
    let mut req = Request::new(message);
    req.metadata_mut()
        .insert(SESSION_METADATA, session.parse().unwrap());
    req
}

#[tokio::test]
async fn authenticated_client_reads_writes_and_cas_through_listed_regions() {
    let setup = Setup::start().await;
    let (dev, cq) = setup.node();
    let client = Client::connect(&setup.addr, &token()).await.unwrap();
    assert_eq!(client.server().node, setup.server.node());
    assert_eq!(client.server().backend, "sim");
    assert_eq!(client.server().protocol, memory_server::PROTOCOL);

    let dir = client.list_regions().await.unwrap();
    assert_eq!(&dir, setup.server.directory());
    let names: Vec<&str> = dir.regions().iter().map(|r| r.name.as_str()).collect();
    assert_eq!(names, ["catalog", "data.0", "data.1"]);
    assert_eq!(dir.catalog().unwrap().remote.len, CATALOG_BYTES);
    for r in dir.regions() {
        assert_eq!(r.access, Access::ALL);
        assert_eq!(r.remote.node, setup.server.node());
    }
    let data1 = dir.get("data.1").unwrap().remote;
    let data0 = dir.get("data.0").unwrap().remote;
    assert_eq!(data1.len, REGION_BYTES);

    let (qp, remote) = client.connect_qp(&*dev, &cq).await.unwrap();
    assert_eq!(remote.node, setup.server.node());
    assert_eq!(remote.address, format!("sim:{}", setup.server.node().0));
    assert_eq!(qp.endpoint().node, dev.node());

    let local = dev.register(64, Access::LOCAL).unwrap();
    let pattern: Vec<u8> = (0..48u8).map(|i| i.wrapping_mul(37) ^ 0xa5).collect();
    ok(run(
        &*qp,
        &*cq,
        SendWr::write(1, Src::Inline(&pattern), data1.at(128)),
    ));
    ok(run(
        &*qp,
        &*cq,
        SendWr::read(2, local.buf(0, 48), data1.at(128)),
    ));
    assert_eq!(local.to_vec(0, 48).unwrap(), pattern);

    // CAS: succeeds on the expected value, fails (returning the current one) otherwise.
    ok(run(
        &*qp,
        &*cq,
        SendWr::cas(3, local.buf(0, 8), data0.at(8), 0, 7),
    ));
    assert_eq!(local.load_u64(0).unwrap(), 0);
    ok(run(
        &*qp,
        &*cq,
        SendWr::cas(4, local.buf(0, 8), data0.at(8), 0, 9),
    ));
    assert_eq!(local.load_u64(0).unwrap(), 7);
    ok(run(
        &*qp,
        &*cq,
        SendWr::fetch_add(5, local.buf(0, 8), data0.at(8), 5),
    ));
    assert_eq!(local.load_u64(0).unwrap(), 7);
    ok(run(
        &*qp,
        &*cq,
        SendWr::read(6, local.buf(8, 8), data0.at(8)),
    ));
    assert_eq!(local.load_u64(8).unwrap(), 12);

    // The catalog is ordinary remote memory too.
    let catalog = dir.get(CATALOG_REGION).unwrap().remote;
    ok(run(
        &*qp,
        &*cq,
        SendWr::write(7, Src::Inline(&[1; 8]), catalog.at(CATALOG_BYTES - 8)),
    ));

    // The listed length is the registered length: one byte past it is a remote error.
    let past = run(
        &*qp,
        &*cq,
        SendWr::read(8, local.buf(0, 8), data1.at(REGION_BYTES - 7)),
    );
    assert_eq!(past.status, WcStatus::RemoteAccess);

    // Uptime is reported in whole milliseconds: a fast run is still in its first one.
    tokio::time::sleep(Duration::from_millis(5)).await;
    let stats = client.stats().await.unwrap();
    assert_eq!(stats.sessions, 1);
    assert_eq!(stats.queue_pairs, 1);
    assert_eq!(stats.regions, 3);
    assert_eq!(stats.bytes_registered, CATALOG_BYTES + DATA_BYTES);
    assert!(stats.bytes_allocated >= stats.bytes_registered);
    assert_eq!(stats.rpc_count("Hello"), 1);
    assert_eq!(stats.rpc_count("Authenticate"), 1);
    assert_eq!(stats.rpc_count("ListRegions"), 1);
    assert_eq!(stats.rpc_count("ConnectQueuePair"), 1);
    assert_eq!(stats.rpc_count("Stats"), 1);
    assert_eq!(stats.auth_failures, 0);
    assert!(
        stats.uptime >= Duration::from_millis(5),
        "{:?}",
        stats.uptime
    );
    client.close().await.unwrap();
}

#[tokio::test]
async fn two_compute_nodes_share_the_memory() {
    let setup = Setup::start().await;
    let counter = setup.server.directory().get("data.0").unwrap().remote.at(0);
    let mut nodes = Vec::new();
    for _ in 0..2 {
        let (dev, cq) = setup.node();
        let client = Client::connect(&setup.addr, &token()).await.unwrap();
        let (qp, _) = client.connect_qp(&*dev, &cq).await.unwrap();
        let local = dev.register(8, Access::LOCAL).unwrap();
        nodes.push((client, qp, cq, local));
    }
    for round in 0..50 {
        for (_, qp, cq, local) in &nodes {
            ok(run(
                &**qp,
                &**cq,
                SendWr::fetch_add(round, local.buf(0, 8), counter, 1),
            ));
        }
    }
    let (client, qp, cq, local) = &nodes[0];
    ok(run(
        &**qp,
        &**cq,
        SendWr::read(99, local.buf(0, 8), counter),
    ));
    assert_eq!(local.load_u64(0).unwrap(), 100);
    let stats = client.stats().await.unwrap();
    assert_eq!((stats.sessions, stats.queue_pairs), (2, 2));
}

#[tokio::test]
async fn wrong_token_gets_no_session() {
    let setup = Setup::start().await;

    // The library refuses a server whose proof does not match its token, before it
    // proves anything itself.
    let wrong = ClusterToken::new("not-the-cluster-token-at-all").unwrap();
    let err = Client::connect(&setup.addr, &wrong)
        .await
        .err()
        .expect("refused");
    assert!(
        matches!(err, ClientError::ServerNotAuthenticated { .. }),
        "{err}"
    );

    // A client that sends a proof anyway is refused by the server.
    let mut rpc = raw(&setup.addr).await;
    let (result, _) = raw_handshake(&mut rpc, "not-the-cluster-token-at-all").await;
    let status = result.expect_err("wrong token refused");
    assert_eq!(status.code(), Code::Unauthenticated);
    assert!(status.message().contains("token"), "{}", status.message());

    // No proof at all is refused too.
    let hello = rpc
        .hello(proto::HelloRequest {
            client_nonce: vec![1; 32],
        })
        .await
        .unwrap()
        .into_inner();
    let status = rpc
        .authenticate(proto::AuthenticateRequest {
            challenge_id: hello.challenge_id,
            client_proof: vec![],
            incarnation: 0,
        })
        .await
        .expect_err("missing proof refused");
    assert_eq!(status.code(), Code::Unauthenticated);

    // The documented formula with the right token works, once.
    let (result, sent) = raw_handshake(&mut rpc, TOKEN).await;
    let session = result.expect("right token accepted");
    assert_eq!(session.session_id.len(), 16);
    let replay = rpc.authenticate(sent).await.expect_err("replay refused");
    assert_eq!(replay.code(), Code::Unauthenticated);

    let client = Client::connect(&setup.addr, &token()).await.unwrap();
    let stats = client.stats().await.unwrap();
    assert_eq!(stats.auth_failures, 3);
    // The raw session and this one; the refused attempts opened none.
    assert_eq!(stats.sessions, 2);
}

#[tokio::test]
async fn rpcs_without_a_live_session_are_unauthenticated() {
    let setup = Setup::start().await;
    let (dev, cq) = setup.node();
    let mut rpc = raw(&setup.addr).await;

    let status = rpc
        .list_regions(proto::ListRegionsRequest {})
        .await
        .expect_err("no session");
    assert_eq!(status.code(), Code::Unauthenticated);
    assert!(
        status.message().contains(SESSION_METADATA),
        "{}",
        status.message()
    );

    let malformed = rpc
        .stats(with_session(proto::StatsRequest {}, "not-hex"))
        .await
        .expect_err("malformed session");
    assert_eq!(malformed.code(), Code::Unauthenticated);

    let unknown = "0123456789abcdef0123456789abcdef";
    let qp = dev.create_qp(&QpConfig::rc(&cq)).unwrap();
    let status = rpc
        .connect_queue_pair(with_session(
            proto::ConnectQueuePairRequest {
                client_node: dev.node().0,
                client_address: dev.address(),
                client_qpn: qp.endpoint().qpn,
                kind: QpKind::Rc as i32,
            },
            unknown,
        ))
        .await
        .expect_err("unknown session");
    assert_eq!(status.code(), Code::Unauthenticated);

    let client = Client::connect(&setup.addr, &token()).await.unwrap();
    let stats = client.stats().await.unwrap();
    assert_eq!(stats.queue_pairs, 0, "no queue pair was made for them");
    assert_eq!(stats.rpc_count("ConnectQueuePair"), 1);
}

#[tokio::test]
async fn bad_connect_requests_are_invalid_arguments() {
    let setup = Setup::start().await;
    let (dev, cq) = setup.node();
    let client = Client::connect(&setup.addr, &token()).await.unwrap();

    let ud = client
        .connect_qp_with_config(&*dev, &QpConfig::ud(&cq))
        .await
        .err()
        .expect("UD refused");
    assert!(matches!(ud, ClientError::NotRc), "{ud}");

    let mut rpc = raw(&setup.addr).await;
    let (session, _) = raw_handshake(&mut rpc, TOKEN).await;
    let session = hex(&session.unwrap().session_id);
    let qp = dev.create_qp(&QpConfig::rc(&cq)).unwrap();
    let good = proto::ConnectQueuePairRequest {
        client_node: dev.node().0,
        client_address: dev.address(),
        client_qpn: qp.endpoint().qpn,
        kind: QpKind::Rc as i32,
    };
    let cases = [
        (
            "UD",
            proto::ConnectQueuePairRequest {
                kind: QpKind::Ud as i32,
                ..good.clone()
            },
        ),
        (
            "kind",
            proto::ConnectQueuePairRequest {
                kind: 0,
                ..good.clone()
            },
        ),
        (
            "own node",
            proto::ConnectQueuePairRequest {
                client_node: setup.server.node().0,
                client_address: format!("sim:{}", setup.server.node().0),
                ..good.clone()
            },
        ),
        (
            "address",
            proto::ConnectQueuePairRequest {
                client_address: "sim:999".into(),
                ..good.clone()
            },
        ),
        (
            "qpn",
            proto::ConnectQueuePairRequest {
                client_qpn: 4242,
                ..good.clone()
            },
        ),
    ];
    for (what, req) in cases {
        let status = rpc
            .connect_queue_pair(with_session(req, &session))
            .await
            .expect_err(what);
        assert_eq!(status.code(), Code::InvalidArgument, "{what}: {status:?}");
    }
    let stats = client.stats().await.unwrap();
    assert_eq!(stats.queue_pairs, 0);
    // The good request still works after all that.
    rpc.connect_queue_pair(with_session(good, &session))
        .await
        .unwrap();
    assert_eq!(client.stats().await.unwrap().queue_pairs, 1);
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[tokio::test]
async fn disconnect_and_session_end_destroy_the_servers_queue_pairs() {
    let setup = Setup::start().await;
    let (dev, cq) = setup.node();
    let local = dev.register(8, Access::LOCAL).unwrap();
    let target = setup.server.directory().get("data.0").unwrap().remote.at(0);
    let client = Client::connect(&setup.addr, &token()).await.unwrap();
    let (qp1, remote1) = client.connect_qp(&*dev, &cq).await.unwrap();
    let (qp2, _) = client.connect_qp(&*dev, &cq).await.unwrap();
    assert_eq!(client.stats().await.unwrap().queue_pairs, 2);

    client.disconnect_qp(remote1.qpn).await.unwrap();
    assert_eq!(client.stats().await.unwrap().queue_pairs, 1);
    let gone = run(&*qp1, &*cq, SendWr::read(1, local.buf(0, 8), target));
    assert_eq!(gone.status, WcStatus::RetryExceeded);
    ok(run(&*qp2, &*cq, SendWr::read(2, local.buf(0, 8), target)));
    let again = client.disconnect_qp(remote1.qpn).await.unwrap_err();
    assert_eq!(again.code(), Some(Code::NotFound));

    client.close().await.unwrap();
    let gone = run(&*qp2, &*cq, SendWr::read(3, local.buf(0, 8), target));
    assert_eq!(gone.status, WcStatus::RetryExceeded);
    let other = Client::connect(&setup.addr, &token()).await.unwrap();
    let stats = other.stats().await.unwrap();
    assert_eq!((stats.sessions, stats.queue_pairs), (1, 0));
    assert_eq!(stats.rpc_count("EndSession"), 1);
}

#[tokio::test]
async fn a_fence_cuts_off_an_incarnations_queue_pairs_and_refuses_its_sessions() {
    let setup = Setup::start().await;
    let (dev, cq) = setup.node();
    let local = dev.register(8, Access::LOCAL).unwrap();
    let target = setup.server.directory().get("data.0").unwrap().remote.at(0);
    let paused = Client::connect_as(&setup.addr, &token(), 0x5eed)
        .await
        .unwrap();
    let paused_too = Client::connect_as(&setup.addr, &token(), 0x5eed)
        .await
        .unwrap();
    let (qp, _) = paused.connect_qp(&*dev, &cq).await.unwrap();
    let (qp_too, _) = paused_too.connect_qp(&*dev, &cq).await.unwrap();
    let recoverer = Client::connect_as(&setup.addr, &token(), 0xbeef)
        .await
        .unwrap();
    let (their_qp, _) = recoverer.connect_qp(&*dev, &cq).await.unwrap();
    ok(run(
        &*qp,
        &*cq,
        SendWr::write(1, Src::Inline(&1u64.to_le_bytes()), target),
    ));

    let zero = recoverer.fence(0).await.unwrap_err();
    assert_eq!(zero.code(), Some(Code::InvalidArgument), "{zero}");
    let report = recoverer.fence(0x5eed).await.unwrap();
    assert_eq!(
        (report.sessions_ended, report.queue_pairs_destroyed),
        (2, 2)
    );
    // What the fenced incarnation posts from now on never reaches the memory.
    for (i, qp) in [&qp, &qp_too].into_iter().enumerate() {
        let late = run(
            &**qp,
            &*cq,
            SendWr::write(2 + i as u64, Src::Inline(&9u64.to_le_bytes()), target),
        );
        assert_eq!(late.status, WcStatus::RetryExceeded);
    }
    ok(run(
        &*their_qp,
        &*cq,
        SendWr::read(4, local.buf(0, 8), target),
    ));
    assert_eq!(local.load_u64(0).unwrap(), 1, "the late writes landed");
    let gone = paused.keep_alive().await.unwrap_err();
    assert_eq!(gone.code(), Some(Code::Unauthenticated), "{gone}");
    assert!(gone.to_string().contains("was fenced"), "{gone}");
    assert!(gone.was_fenced(), "{gone}");
    let refused = match Client::connect_as(&setup.addr, &token(), 0x5eed).await {
        Err(e) => e,
        Ok(_) => panic!("a fenced incarnation got a session"),
    };
    assert_eq!(refused.code(), Some(Code::PermissionDenied), "{refused}");
    assert!(refused.was_fenced(), "{refused}");
    // Idempotent, and other incarnations (and none) still connect.
    let again = recoverer.fence(0x5eed).await.unwrap();
    assert_eq!(again.sessions_ended, 0);
    Client::connect_as(&setup.addr, &token(), 0x5eee)
        .await
        .unwrap();
    let stats = Client::connect(&setup.addr, &token())
        .await
        .unwrap()
        .stats()
        .await
        .unwrap();
    assert_eq!(stats.rpc_count("Fence"), 3);
}

#[tokio::test]
async fn leases_expire_without_renewal_and_the_client_renews() {
    let lease = Duration::from_millis(400);
    let setup = Setup::start_with(|mut c| {
        c.session_lease = lease;
        c
    })
    .await;
    let (dev, cq) = setup.node();
    let local = dev.register(8, Access::LOCAL).unwrap();
    let target = setup.server.directory().get("data.0").unwrap().remote.at(0);

    // A session that never renews, with a connected queue pair.
    let mut rpc = raw(&setup.addr).await;
    let (auth, _) = raw_handshake(&mut rpc, TOKEN).await;
    let auth = auth.unwrap();
    assert_eq!(auth.lease_ms, 400);
    let session = hex(&auth.session_id);
    let qp = dev.create_qp(&QpConfig::rc(&cq)).unwrap();
    let reply = rpc
        .connect_queue_pair(with_session(
            proto::ConnectQueuePairRequest {
                client_node: dev.node().0,
                client_address: dev.address(),
                client_qpn: qp.endpoint().qpn,
                kind: QpKind::Rc as i32,
            },
            &session,
        ))
        .await
        .unwrap()
        .into_inner();
    qp.connect(QpEndpoint {
        node: fabric::NodeId(reply.server_node),
        qpn: reply.server_qpn,
    })
    .unwrap();
    ok(run(&*qp, &*cq, SendWr::read(1, local.buf(0, 8), target)));

    // The library client renews on its own, so it outlives several leases.
    let client = Client::connect(&setup.addr, &token()).await.unwrap();
    tokio::time::sleep(lease * 3).await;
    let stats = client.stats().await.expect("the renewed session is alive");
    assert_eq!((stats.sessions, stats.queue_pairs), (1, 0));
    assert!(stats.rpc_count("KeepAlive") >= 3, "{stats:?}");

    let status = rpc
        .list_regions(with_session(proto::ListRegionsRequest {}, &session))
        .await
        .expect_err("expired");
    assert_eq!(status.code(), Code::Unauthenticated);
    let gone = run(&*qp, &*cq, SendWr::read(2, local.buf(0, 8), target));
    assert_eq!(gone.status, WcStatus::RetryExceeded);
}

#[tokio::test]
async fn shutdown_ends_sessions_and_stops_serving() {
    let setup = Setup::start().await;
    let (dev, cq) = setup.node();
    let local = dev.register(8, Access::LOCAL).unwrap();
    let target = setup.server.directory().get("data.1").unwrap().remote.at(0);
    let client = Client::connect(&setup.addr, &token()).await.unwrap();
    let (qp, _) = client.connect_qp(&*dev, &cq).await.unwrap();
    ok(run(&*qp, &*cq, SendWr::read(1, local.buf(0, 8), target)));

    let Setup { server, addr, .. } = setup;
    tokio::time::timeout(Duration::from_secs(10), server.shutdown())
        .await
        .expect("shutdown is prompt")
        .expect("clean shutdown");

    let gone = run(&*qp, &*cq, SendWr::read(2, local.buf(0, 8), target));
    assert_eq!(gone.status, WcStatus::RetryExceeded);
    assert!(client.stats().await.is_err(), "the control plane is down");
    let err = Client::connect(&addr, &token())
        .await
        .err()
        .expect("no server");
    assert!(matches!(err, ClientError::Unreachable { .. }), "{err}");
}

#[test]
fn blocking_client_does_the_same_without_async() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let setup = runtime.block_on(Setup::start());
    let (dev, cq) = setup.node();
    let client = memory_server::blocking::Client::connect(&setup.addr, &token()).unwrap();
    let dir = client.list_regions().unwrap();
    let target = dir.get("data.1").unwrap().remote.at(64);
    let (qp, remote) = client.connect_qp(&*dev, &cq).unwrap();
    assert_eq!(remote.node, client.server().node);
    let local = dev.register(8, Access::LOCAL).unwrap();
    ok(run(
        &*qp,
        &*cq,
        SendWr::write(1, Src::Inline(&77u64.to_le_bytes()), target),
    ));
    ok(run(&*qp, &*cq, SendWr::read(2, local.buf(0, 8), target)));
    assert_eq!(local.load_u64(0).unwrap(), 77);
    let stats = client.stats().unwrap();
    assert_eq!((stats.sessions, stats.queue_pairs), (1, 1));
    client.close().unwrap();
    assert_eq!(setup.server.stats().sessions, 0);

    // Inside a runtime it refuses rather than blocking the runtime's thread.
    let err = runtime
        .block_on(async { memory_server::blocking::Client::connect(&setup.addr, &token()) })
        .err()
        .expect("refused inside a runtime");
    assert!(matches!(err, ClientError::Runtime(_)), "{err}");
    runtime.block_on(setup.server.shutdown()).unwrap();
}

/// A server that accepts the connection and never answers (stopped with SIGSTOP, or
/// wedged) ends a bounded blocking connect with a clear error, where a plain one waits
/// for the HTTP/2 keep-alive (the chaos harness asks backups this way).
#[test]
fn a_bounded_blocking_connect_gives_up_on_a_server_that_never_answers() {
    // The kernel completes the TCP handshakes into the backlog; nothing reads them.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = silent.local_addr().unwrap().to_string();
    let err = memory_server::blocking::Client::connect_within(
        &addr,
        &token(),
        Duration::from_millis(500),
    )
    .err()
    .expect("nothing answers there");
    assert!(matches!(err, ClientError::TimedOut { .. }), "{err}");
    assert!(
        err.to_string().contains(&format!(
            "the memory server at {addr} did not answer within"
        )),
        "{err}"
    );
    drop(silent);
}

#[tokio::test]
async fn unreachable_and_malformed_addresses_are_clear_errors() {
    // Bind and drop a listener to get a port nothing listens on.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let err = Client::connect(&format!("127.0.0.1:{port}"), &token())
        .await
        .err()
        .expect("nothing listens there");
    assert!(matches!(err, ClientError::Unreachable { .. }), "{err}");
    let err = Client::connect("not a uri", &token())
        .await
        .err()
        .expect("malformed");
    assert!(matches!(err, ClientError::Address { .. }), "{err}");
}

/// A borrowed region is the session's: usable over the data path, listed nowhere,
/// freed by ReturnRegion or by the end of the session, and refused past the session's
/// byte limit before anything is allocated.
#[tokio::test]
async fn borrowed_regions_belong_to_the_session() {
    let setup = Setup::start_with(|mut c| {
        c.remote_verbs_bytes = 1 << 20;
        c
    })
    .await;
    let (dev, cq) = setup.node();
    let local = dev.register(8, Access::LOCAL).unwrap();
    let client = Client::connect(&setup.addr, &token()).await.unwrap();
    let (qp, _) = client.connect_qp(&*dev, &cq).await.unwrap();
    let region = client.borrow_region(4096).await.unwrap();
    assert_eq!(region.len, 4096);
    let listed = client.list_regions().await.unwrap();
    assert!(
        listed
            .regions()
            .iter()
            .all(|r| r.remote.rkey != region.rkey)
    );
    assert_eq!(client.stats().await.unwrap().session_region_bytes, 4096);
    local.store_u64(0, 0x5eed).unwrap();
    ok(run(
        &*qp,
        &*cq,
        SendWr::write(1, local.buf(0, 8), region.at(8)),
    ));
    local.store_u64(0, 0).unwrap();
    ok(run(
        &*qp,
        &*cq,
        SendWr::read(2, local.buf(0, 8), region.at(8)),
    ));
    assert_eq!(local.load_u64(0).unwrap(), 0x5eed);

    for len in [0, 12, 2 << 20] {
        let e = client.borrow_region(len).await.unwrap_err();
        let want = if len == 2 << 20 {
            Code::ResourceExhausted
        } else {
            Code::InvalidArgument
        };
        assert_eq!(e.code(), Some(want), "{len}: {e}");
    }

    client.return_region(&region).await.unwrap();
    assert_eq!(client.stats().await.unwrap().session_region_bytes, 0);
    let gone = run(&*qp, &*cq, SendWr::read(3, local.buf(0, 8), region.at(8)));
    assert_eq!(gone.status, WcStatus::RemoteAccess);
    let again = client.return_region(&region).await.unwrap_err();
    assert_eq!(again.code(), Some(Code::NotFound));

    // Not returned: the session's end frees it.
    client.borrow_region(8192).await.unwrap();
    client.close().await.unwrap();
    let other = Client::connect(&setup.addr, &token()).await.unwrap();
    let stats = other.stats().await.unwrap();
    assert_eq!((stats.sessions, stats.session_region_bytes), (1, 0));
}

/// `message` as a call of `client`'s session, for the remote-verbs stub.
fn in_session<T>(message: T, client: &Client) -> Request<T> {
    let mut req = Request::new(message);
    req.metadata_mut().insert(
        SESSION_METADATA,
        client.session_id().to_string().parse().unwrap(),
    );
    req
}

/// A session holding a region of each kind, for the tests of what gives each back:
/// 4096 bytes registered through remote verbs and 8192 borrowed (the whole cap), with
/// a queue pair to use them over.
struct RegionKinds {
    _setup: Setup,
    cq: Arc<dyn CompletionQueue>,
    qp: Arc<dyn QueuePair>,
    local: fabric::Region,
    client: Client,
    verbs: RemoteVerbsClient<Channel>,
    registered: proto::RegisterRegionResponse,
    borrowed: fabric::RemoteRegion,
}

impl RegionKinds {
    async fn start() -> RegionKinds {
        let setup = Setup::start_with(|mut c| {
            c.allow_remote_verbs = true;
            c.max_borrowed = Some(8192);
            c
        })
        .await;
        let (dev, cq) = setup.node();
        let local = dev.register(8, Access::LOCAL).unwrap();
        let client = Client::connect(&setup.addr, &token()).await.unwrap();
        let (qp, _) = client.connect_qp(&*dev, &cq).await.unwrap();
        let mut verbs = RemoteVerbsClient::connect(format!("http://{}", setup.addr))
            .await
            .unwrap();
        let registered = verbs
            .register_region(in_session(
                proto::RegisterRegionRequest {
                    len: 4096,
                    access: Access::ALL.bits(),
                },
                &client,
            ))
            .await
            .unwrap()
            .into_inner();
        let borrowed = client.borrow_region(8192).await.unwrap();
        assert_eq!(
            client.stats().await.unwrap().session_region_bytes,
            4096 + 8192
        );
        RegionKinds {
            _setup: setup,
            cq,
            qp,
            local,
            client,
            verbs,
            registered,
            borrowed,
        }
    }

    /// Writes `value` at `at` over the data path and reads it back.
    fn round_trip(&self, at: fabric::RemoteAddr, value: u64) -> u64 {
        let (qp, cq, local) = (&*self.qp, &*self.cq, &self.local);
        local.store_u64(0, value).unwrap();
        ok(run(qp, cq, SendWr::write(1, local.buf(0, 8), at)));
        local.store_u64(0, 0).unwrap();
        ok(run(qp, cq, SendWr::read(2, local.buf(0, 8), at)));
        local.load_u64(0).unwrap()
    }
}

/// ReturnRegion gives back only what BorrowRegion lent. A region the session holds
/// another way (registered through remote verbs) is refused with FAILED_PRECONDITION
/// naming its rkey and why, and stays: still registered, still usable over the data
/// path, still counted, and the borrow cap's accounting is untouched. It used to be
/// removed like a borrowed one.
#[tokio::test]
async fn return_region_gives_back_only_borrowed_regions() {
    let mut kinds = RegionKinds::start().await;
    let (client, registered, borrowed) = (&kinds.client, &kinds.registered, &kinds.borrowed);
    let registered_region = fabric::RemoteRegion {
        node: client.server().node,
        rkey: registered.rkey,
        len: registered.len,
    };

    let e = client.return_region(&registered_region).await.unwrap_err();
    assert_eq!(e.code(), Some(Code::FailedPrecondition), "{e}");
    let said = e.to_string();
    assert!(
        said.contains(&format!("rkey {:#x}", registered.rkey))
            && said.contains("not borrowed")
            && said.contains("remote verbs"),
        "{said}"
    );
    // Nothing lost: counted, and usable over the data path.
    assert_eq!(
        client.stats().await.unwrap().session_region_bytes,
        4096 + 8192
    );
    assert_eq!(kinds.round_trip(registered_region.at(16), 0xfeed), 0xfeed);
    // The refusal gave back nothing of the borrow cap: it is still all lent.
    let full = client.borrow_region(8).await.unwrap_err();
    assert_eq!(full.code(), Some(Code::ResourceExhausted), "{full}");

    // A borrowed region still goes back, with its share of the cap.
    client.return_region(borrowed).await.unwrap();
    assert_eq!(client.stats().await.unwrap().session_region_bytes, 4096);
    let gone = run(
        &*kinds.qp,
        &*kinds.cq,
        SendWr::read(3, kinds.local.buf(0, 8), borrowed.at(8)),
    );
    assert_eq!(gone.status, WcStatus::RemoteAccess);
    client.borrow_region(8192).await.unwrap();
    // The registered region is still the session's to deregister.
    let lkey = registered.lkey;
    let request = in_session(proto::DeregisterRegionRequest { lkey }, &kinds.client);
    kinds.verbs.deregister_region(request).await.unwrap();
    assert_eq!(
        kinds.client.stats().await.unwrap().session_region_bytes,
        8192
    );
}

/// DeregisterRegion frees only regions the session registered through remote verbs. A
/// borrowed one (its lkey) is refused with FAILED_PRECONDITION naming its keys and
/// ReturnRegion, and stays: usable over the data path, counted, its loan still held
/// against the cap, and it still goes back through ReturnRegion. It used to be removed
/// like a registered one.
#[tokio::test]
async fn deregister_region_frees_only_registered_regions() {
    let mut kinds = RegionKinds::start().await;
    let (registered_lkey, registered_rkey) = (kinds.registered.lkey, kinds.registered.rkey);
    // BorrowRegion tells only the rkey; the sim device uses one key as both, so the
    // borrowed region's lkey is its rkey.
    assert_eq!(registered_lkey, registered_rkey, "the sim device's keys");
    let borrowed = kinds.borrowed;
    let borrowed_lkey = borrowed.rkey;
    let deregister =
        |lkey, client: &Client| in_session(proto::DeregisterRegionRequest { lkey }, client);

    let e = kinds
        .verbs
        .deregister_region(deregister(borrowed_lkey, &kinds.client))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
    let said = e.message();
    assert!(
        said.contains(&format!("lkey {borrowed_lkey:#x}"))
            && said.contains(&format!("rkey {:#x}", borrowed.rkey))
            && said.contains("borrowed")
            && said.contains("ReturnRegion"),
        "{said}"
    );
    // Nothing lost: counted, usable over the data path, and its loan still held.
    let client = &kinds.client;
    assert_eq!(
        client.stats().await.unwrap().session_region_bytes,
        4096 + 8192
    );
    assert_eq!(kinds.round_trip(borrowed.at(24), 0xbeef), 0xbeef);
    let full = client.borrow_region(8).await.unwrap_err();
    assert_eq!(full.code(), Some(Code::ResourceExhausted), "{full}");

    // A lkey the session does not hold is still NOT_FOUND, and a registered region
    // still deregisters.
    let missing = kinds
        .verbs
        .deregister_region(deregister(registered_lkey ^ 0x00ff_ff00, &kinds.client))
        .await
        .unwrap_err();
    assert_eq!(missing.code(), Code::NotFound, "{missing}");
    kinds
        .verbs
        .deregister_region(deregister(registered_lkey, &kinds.client))
        .await
        .unwrap();
    let client = &kinds.client;
    assert_eq!(client.stats().await.unwrap().session_region_bytes, 8192);

    // The borrowed region goes back the way it came, with its share of the cap.
    client.return_region(&borrowed).await.unwrap();
    assert_eq!(client.stats().await.unwrap().session_region_bytes, 0);
    client.borrow_region(8192).await.unwrap();
}

/// Borrowing is capped across sessions (by default at half the data regions' size), so
/// sessions each within their own limit cannot together take the host's memory; the
/// refusal names the cap and what is borrowed, and whatever ends a loan gives its
/// bytes back.
#[tokio::test]
async fn borrowing_is_capped_across_sessions() {
    let setup = Setup::start().await;
    let cap = DATA_BYTES / 2;
    let a = Client::connect(&setup.addr, &token()).await.unwrap();
    let b = Client::connect(&setup.addr, &token()).await.unwrap();
    let held = a.borrow_region(24 << 10).await.unwrap();
    let e = b.borrow_region(16 << 10).await.unwrap_err();
    assert_eq!(e.code(), Some(Code::ResourceExhausted), "{e}");
    let said = e.to_string();
    assert!(
        said.contains(&format!("past {cap} bytes"))
            && said.contains("--max-borrowed")
            && said.contains("borrow 24576 bytes in 1 regions"),
        "{said}"
    );
    let small = b.borrow_region(8 << 10).await.unwrap();
    b.return_region(&small).await.unwrap();
    a.return_region(&held).await.unwrap();
    b.borrow_region(16 << 10).await.unwrap();
    a.borrow_region(16 << 10).await.unwrap();
    // Its session's end gives b's share back.
    b.close().await.unwrap();
    a.borrow_region(16 << 10).await.unwrap();
    assert_eq!(a.stats().await.unwrap().session_region_bytes, cap);
}

/// A call of a method the server does not have (a misspelt name, another package, a
/// hand-written client) is told what it called and what the server has, not tonic's
/// bare UNIMPLEMENTED; the real methods still answer.
#[tokio::test]
async fn an_unknown_method_is_told_what_the_server_has() {
    let setup = Setup::start().await;
    let channel = Channel::from_shared(format!("http://{}", setup.addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let call = |path: &'static str| {
        let mut grpc = tonic::client::Grpc::new(channel.clone());
        async move {
            grpc.ready().await.unwrap();
            grpc.unary::<proto::HelloRequest, proto::HelloResponse, _>(
                Request::new(proto::HelloRequest {
                    client_nonce: vec![7; 32],
                }),
                tonic::codegen::http::uri::PathAndQuery::from_static(path),
                tonic_prost::ProstCodec::default(),
            )
            .await
        }
    };
    call("/namdb.memory_server.v1.MemoryServer/Hello")
        .await
        .expect("a served method answers");
    let e = call("/namdb.memory_server.v1.MemoryServer/Helo")
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unimplemented);
    let said = e.message();
    assert!(
        said.contains("/namdb.memory_server.v1.MemoryServer/Helo")
            && said.contains("Hello, Authenticate, ListRegions")
            && said.contains("memory-server/proto/namdb/memory_server/v1/control.proto"),
        "{said}"
    );
    // A service this server does not have at all (a compute node's).
    let e = call("/namdb.compute.v1.Compute/Get").await.unwrap_err();
    assert_eq!(e.code(), Code::Unimplemented);
    let said = e.message();
    assert!(
        said.contains("no service `namdb.compute.v1.Compute`")
            && said.contains("namdb.memory_server.v1.MemoryServer (")
            && said.contains("namdb.memory_server.v1.RemoteVerbs (")
            && said.contains("remote_verbs.proto"),
        "{said}"
    );
}
