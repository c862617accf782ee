//! The remote-verbs service and `RemoteDevice`: the switch that turns the service on,
//! errors that arrive as the very `FabricError` a local device returns, what requests
//! the service refuses, and what a session may hold. The server runs on a sim device
//! in this process; the conformance suite over a server process is namdb's
//! `conformance_process_tcp`.

use fabric::sim::{SimConfig, SimNetwork};
use fabric::{Access, Device, FabricError, QpConfig, QpKind, QpState, SendWr, Src, UdDest};
use memory_server::proto::remote_verbs_client::RemoteVerbsClient;
use memory_server::proto::{self, work_request};
use memory_server::{
    Client, ClientError, ClusterToken, MemoryServer, RegionPlan, RemoteDevice, SESSION_METADATA,
    ServerConfig,
};
use std::sync::Arc;
use tonic::{Code, Request};

const TOKEN: &str = "remote-verbs-test-cluster-token";

fn token() -> ClusterToken {
    ClusterToken::new(TOKEN).unwrap()
}

/// A memory server on a sim device, on a runtime of its own so that the test thread
/// can use blocking clients.
struct Setup {
    runtime: tokio::runtime::Runtime,
    server: Option<MemoryServer>,
    addr: String,
}

impl Setup {
    fn start(tune: impl FnOnce(ServerConfig) -> ServerConfig) -> Setup {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let device: Arc<dyn Device> = SimNetwork::new(SimConfig::default()).add_node();
        let config = tune(ServerConfig::new(
            "127.0.0.1:0".parse().unwrap(),
            RegionPlan::new(64 << 10, 64 << 10).unwrap(),
            token(),
        ));
        let server = runtime
            .block_on(MemoryServer::start(config, device))
            .unwrap();
        let addr = server.local_addr().to_string();
        Setup {
            runtime,
            server: Some(server),
            addr,
        }
    }

    fn allowed() -> Setup {
        Setup::start(|c| ServerConfig {
            allow_remote_verbs: true,
            ..c
        })
    }

    fn server(&self) -> &MemoryServer {
        self.server.as_ref().unwrap()
    }

    fn device(&self) -> Result<Arc<RemoteDevice>, ClientError> {
        let client = memory_server::blocking::Client::connect(&self.addr, &token()).unwrap();
        RemoteDevice::new(client)
    }

    /// A raw remote-verbs stub and a live session id, for requests `RemoteDevice`
    /// would never send.
    fn raw(&self) -> (RemoteVerbsClient<tonic::transport::Channel>, Client) {
        self.runtime.block_on(async {
            let client = Client::connect(&self.addr, &token()).await.unwrap();
            let stub = RemoteVerbsClient::connect(format!("http://{}", self.addr))
                .await
                .unwrap();
            (stub, client)
        })
    }
}

impl Drop for Setup {
    fn drop(&mut self) {
        if let Some(server) = self.server.take() {
            let _ = self.runtime.block_on(server.shutdown());
        }
    }
}

fn in_session<T>(message: T, client: &Client) -> Request<T> {
    let mut req = Request::new(message);
    req.metadata_mut().insert(
        SESSION_METADATA,
        client.session_id().to_string().parse().unwrap(),
    );
    req
}

#[test]
fn remote_verbs_are_refused_unless_the_server_allows_them() {
    let setup = Setup::start(|c| c);
    let err = setup.device().err().expect("refused");
    assert_eq!(err.code(), Some(Code::PermissionDenied), "{err}");
    assert!(err.to_string().contains("--allow-remote-verbs"), "{err}");

    // Without a session the answer is UNAUTHENTICATED, whether or not verbs are on.
    let (mut stub, _client) = setup.raw();
    let status = setup
        .runtime
        .block_on(stub.device_info(proto::DeviceInfoRequest {}))
        .unwrap_err();
    assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");

    let setup = Setup::allowed();
    let device = setup.device().unwrap();
    assert_eq!(device.node(), setup.server().node());
    assert_eq!(device.backend(), "sim");
    assert_eq!(device.address(), format!("sim:{}", setup.server().node().0));
    let stats = setup.server().stats();
    assert_eq!(stats.rpc_count("DeviceInfo"), 1);
}

/// What a device says to a series of requests it refuses, in order.
fn refusals(dev: &dyn Device) -> Vec<FabricError> {
    let mut errors = Vec::new();
    errors.extend(dev.create_cq(0).err());
    let cq = dev.create_cq(16).unwrap();
    errors.extend(
        dev.create_qp(&QpConfig {
            rnr_retry: 9,
            ..QpConfig::rc(&cq)
        })
        .err(),
    );
    errors.extend(dev.add_peer(fabric::NodeId(77), "tcp:nowhere:1").err());
    let region = dev.register(64, Access::ALL).unwrap();

    let rc = dev.create_qp(&QpConfig::rc(&cq)).unwrap();
    assert_eq!(rc.state(), QpState::Init);
    errors.extend(
        rc.post_send(&[SendWr::read(1, region.buf(0, 8), region.remote_addr(0))])
            .err(),
    );

    let ud = dev
        .create_qp(&QpConfig {
            max_send_wr: 2,
            max_inline: 16,
            ..QpConfig::ud(&cq)
        })
        .unwrap();
    assert_eq!(ud.kind(), QpKind::Ud);
    errors.extend(ud.connect(rc.endpoint()).err());
    let dest = UdDest {
        endpoint: ud.endpoint(),
        qkey: QpConfig::DEFAULT_QKEY ^ 1,
    };
    let big = [0u8; 17];
    errors.extend(
        ud.post_send(&[
            SendWr::send(1, Src::Inline(b"x")).to(dest).unsignaled(),
            SendWr::send(2, Src::Inline(&big)).to(dest),
        ])
        .err(),
    );
    errors.extend(
        ud.post_send(&[SendWr::read(3, region.buf(0, 8), region.remote_addr(0)).to(dest)])
            .err(),
    );
    errors.extend(
        ud.post_send(&[
            SendWr::send(4, Src::Inline(b"y")).to(dest).unsignaled(),
            SendWr::send(5, Src::Inline(b"z")).to(dest).unsignaled(),
        ])
        .err(),
    );
    errors
}

#[test]
fn device_errors_arrive_as_the_same_fabric_errors() {
    let local = SimNetwork::new(SimConfig::default()).add_node();
    let expected = refusals(local.as_ref());
    assert!(
        expected.len() >= 7,
        "the scenario exercises refusals: {expected:?}"
    );
    assert!(
        expected.iter().any(|e| matches!(e, FabricError::Post { index: 1, source } if matches!(**source, FabricError::QueueFull { .. }))),
        "{expected:?}"
    );
    assert!(
        expected.iter().any(|e| matches!(
            e,
            FabricError::InvalidState {
                state: QpState::Init,
                ..
            }
        )),
        "{expected:?}"
    );
    let setup = Setup::allowed();
    let remote = setup.device().unwrap();
    assert_eq!(refusals(remote.as_ref()), expected);
}

#[test]
fn regions_live_on_the_server_and_objects_stay_with_their_device() {
    let setup = Setup::allowed();
    let device = setup.device().unwrap();
    let region = device.register(4096, Access::ALL).unwrap();
    assert_eq!((region.len(), region.node()), (4096, setup.server().node()));
    assert!(!region.is_local());
    assert_eq!(region.read(0, &mut [0; 8]), Err(FabricError::NotLocal));

    let err = device
        .register_memory(
            Arc::new(fabric::HeapMemory::new(64).unwrap()),
            64,
            Access::ALL,
        )
        .unwrap_err();
    assert!(
        matches!(&err, FabricError::Backend(m) if m.contains("cannot register this process's memory")),
        "{err}"
    );

    // A completion queue of this process's device, or of another remote device, is
    // not one the server's device can use.
    let local_cq = SimNetwork::new(SimConfig::default())
        .add_node()
        .create_cq(4)
        .unwrap();
    let other = setup.device().unwrap().create_cq(4).unwrap();
    for cq in [&local_cq, &other] {
        let err = device.create_qp(&QpConfig::rc(cq)).err().expect("refused");
        assert!(matches!(err, FabricError::ForeignObject(_)), "{err}");
    }
}

#[test]
fn a_session_holds_bounded_objects_until_it_ends() {
    let setup = Setup::start(|c| ServerConfig {
        allow_remote_verbs: true,
        remote_verbs_bytes: 64 << 10,
        ..c
    });
    let device = setup.device().unwrap();
    let all = device.register(64 << 10, Access::ALL).unwrap();
    let err = device.register(8, Access::ALL).unwrap_err();
    assert!(
        matches!(&err, FabricError::Backend(m) if m.contains("RegisterRegion") && m.contains("65536 bytes")),
        "{err}"
    );
    drop(all);
    let region = device.register(8, Access::ALL).unwrap();

    let cq = device.create_cq(8).unwrap();
    let qp = device.create_qp(&QpConfig::rc(&cq)).unwrap();
    assert_eq!(setup.server().stats().queue_pairs, 1);
    drop(qp);
    assert_eq!(
        setup.server().stats().queue_pairs,
        0,
        "dropping destroys it"
    );
    let _kept = device.create_qp(&QpConfig::rc(&cq)).unwrap();
    assert_eq!(setup.server().stats().queue_pairs, 1);
    assert_eq!(setup.server().stats().sessions, 1);

    // The handles outlive the device; the session ends with the last of them.
    drop(device);
    assert_eq!(setup.server().stats().sessions, 1);
    drop((region, cq, _kept));
    let stats = setup.server().stats();
    assert_eq!((stats.sessions, stats.queue_pairs), (0, 0));
}

#[test]
fn requests_the_service_cannot_read_are_invalid_arguments() {
    let setup = Setup::allowed();
    let (mut stub, client) = setup.raw();
    let rt = &setup.runtime;

    let status = rt
        .block_on(stub.register_region(in_session(
            proto::RegisterRegionRequest {
                len: 64,
                access: 0x100,
            },
            &client,
        )))
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(status.message().contains("access bits 0x100"), "{status:?}");

    let status = rt
        .block_on(stub.poll_cq(in_session(proto::PollCqRequest { cq: 9, max: 4 }, &client)))
        .unwrap_err();
    assert_eq!(status.code(), Code::NotFound);
    assert!(
        status.message().contains("no completion queue 9"),
        "{status:?}"
    );

    let cq = rt
        .block_on(stub.create_cq(in_session(proto::CreateCqRequest { capacity: 4 }, &client)))
        .unwrap()
        .into_inner()
        .cq;
    let qp_request = |kind: i32| {
        in_session(
            proto::CreateQpRequest {
                kind,
                send_cq: cq,
                recv_cq: cq,
                max_send_wr: 4,
                max_recv_wr: 4,
                ..Default::default()
            },
            &client,
        )
    };
    let status = rt.block_on(stub.create_qp(qp_request(0))).unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(status.message().contains("queue pair kind 0"), "{status:?}");

    let qpn = rt
        .block_on(stub.create_qp(qp_request(proto::QpKind::Ud as i32)))
        .unwrap()
        .into_inner()
        .qpn;
    let good = proto::WorkRequest {
        wr_id: 1,
        op: Some(work_request::Op::Send(proto::SendOp {
            local: Some(proto::Source {
                source: Some(proto::source::Source::Inline(vec![])),
            }),
            imm: None,
        })),
        ..Default::default()
    };
    let missing_op = proto::WorkRequest {
        wr_id: 2,
        ..Default::default()
    };
    let status = rt
        .block_on(stub.post_send(in_session(
            proto::PostSendRequest {
                qpn,
                wrs: vec![good, missing_op],
            },
            &client,
        )))
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert_eq!(status.message(), "PostSend: wrs[1]: `op` is missing");
    assert!(status.details().is_empty(), "not a device error");

    // A completion queue goes only after the queue pairs that use it, as in verbs.
    let cq_stub = stub.clone();
    let destroy_cq = || {
        rt.block_on(
            cq_stub
                .clone()
                .destroy_cq(in_session(proto::DestroyCqRequest { cq }, &client)),
        )
    };
    let status = destroy_cq().unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition);
    assert_eq!(
        status.message(),
        format!(
            "completion queue {cq} is in use by queue pair {qpn}; destroy the queue pair first"
        )
    );
    rt.block_on(stub.destroy_qp(in_session(proto::DestroyQpRequest { qpn }, &client)))
        .unwrap();
    destroy_cq().unwrap();
    assert_eq!(destroy_cq().unwrap_err().code(), Code::NotFound);
    drop(client);
}

#[test]
fn calls_inside_a_runtime_fail_instead_of_blocking_it() {
    let setup = Setup::allowed();
    let device = setup.device().unwrap();
    let err = setup
        .runtime
        .block_on(async { device.create_cq(4) })
        .err()
        .expect("refused inside a runtime");
    assert!(
        matches!(&err, FabricError::Backend(m) if m.contains("inside a tokio runtime")),
        "{err}"
    );
    // Dropping handles inside a runtime neither blocks nor panics.
    let cq = device.create_cq(4).unwrap();
    setup.runtime.block_on(async move { drop(cq) });
}
