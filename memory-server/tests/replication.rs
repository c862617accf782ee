//! Replicated memory servers in-process: a primary (`Replication::Primary`) streams
//! every Persist to its backup; the backup refuses compute nodes until promoted, then
//! holds exactly what was persisted, and its promotion fences the primary.

mod common;

use common::Node;
use fabric::Device;
use fabric::sim::{SimConfig, SimNetwork};
use memory_server::{
    Client, ClientError, ClusterToken, MemoryServer, PersistRange, PersistStatus, Persister,
    RegionPlan, Replication, Role, ServerConfig, ServerError,
};
use std::sync::Arc;
use std::time::Duration;
use tonic::Code;

const REGION_BYTES: u64 = 32 << 10;

fn token() -> ClusterToken {
    ClusterToken::new("replication-test-cluster-token").unwrap()
}

async fn start(
    data_bytes: u64,
    replication: Replication,
) -> Result<(MemoryServer, SimNetwork), ServerError> {
    start_at("127.0.0.1:0".parse().unwrap(), data_bytes, replication).await
}

async fn start_at(
    listen: std::net::SocketAddr,
    data_bytes: u64,
    replication: Replication,
) -> Result<(MemoryServer, SimNetwork), ServerError> {
    let net = SimNetwork::new(SimConfig::default());
    let device: Arc<dyn Device> = net.add_node();
    let plan = RegionPlan::new(data_bytes, REGION_BYTES).unwrap();
    let mut config = ServerConfig::new(listen, plan, token());
    config.replication = replication;
    let server = MemoryServer::start(config, device).await?;
    Ok((server, net))
}

/// A backup and its primary (64 KiB of data each, no data directories).
async fn pair() -> (MemoryServer, SimNetwork, MemoryServer, SimNetwork) {
    let (backup, bnet) = start(64 << 10, Replication::Backup).await.unwrap();
    let (primary, pnet) = start(
        64 << 10,
        Replication::Primary {
            backup_at: backup.local_addr().to_string(),
        },
    )
    .await
    .unwrap();
    (primary, pnet, backup, bnet)
}

fn code_and_message(e: &ClientError) -> (Option<Code>, String) {
    (e.code(), e.to_string())
}

/// The code and message of a Persist of `range` that must fail.
async fn refused(node: &Node, range: PersistRange) -> (Option<Code>, String) {
    code_and_message(&node.client.persist(&[range]).await.err().unwrap())
}

/// Whether a Persist of `range`, which must fail, was refused only until the primary
/// attaches to its backup again.
async fn refused_for_now(node: &Node, range: PersistRange) -> bool {
    node.client
        .persist(&[range])
        .await
        .err()
        .unwrap()
        .persist_later()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_backup_holds_what_was_persisted_and_promotion_fences_the_primary() {
    let (primary, pnet, backup, bnet) = pair().await;
    assert_eq!((primary.role(), primary.boot()), (Role::Primary, 1));
    assert_eq!(backup.role(), Role::Backup);

    let node = Node::connect(&primary, &pnet, &token()).await;
    let info = node.client.server().clone();
    assert!(
        info.durable,
        "a replicated primary's Persist survives its loss"
    );
    assert_eq!((info.boot, info.role), (1, Role::Primary));
    let (rkey, at) = node.data(1).await;
    node.write(at, 64, b"persisted, twice");
    node.client
        .persist(&[PersistRange::new(rkey, 64, 16)])
        .await
        .unwrap();
    node.write(at, 64, b"PERSISTED");
    node.client
        .persist(&[PersistRange::new(rkey, 64, 4)])
        .await
        .unwrap();
    // Written but never persisted: must not reach the backup.
    node.write(at, 256, b"unpersisted");
    // Many at once: group commit on the stream, order kept per range.
    let persister = Persister::with_runtime(&node.client, tokio::runtime::Handle::current());
    let tickets: Vec<_> = (0..64u64)
        .map(|i| {
            node.write(at, 1024 + 8 * i, &i.to_le_bytes());
            persister.submit(vec![PersistRange::new(rkey, 1024 + 8 * i, 8)])
        })
        .collect();
    for t in &tickets {
        loop {
            match persister.poll(t) {
                PersistStatus::Pending => tokio::time::sleep(Duration::from_millis(1)).await,
                PersistStatus::Done => break,
                PersistStatus::Failed(why) | PersistStatus::Later(why) => panic!("{why}"),
            }
        }
    }

    // Before promotion the backup serves no compute node.
    let client = Client::connect(&backup.local_addr().to_string(), &token())
        .await
        .unwrap();
    assert_eq!(client.server().role, Role::Backup);
    let dev: Arc<dyn Device> = bnet.add_node();
    let cq = dev.create_cq(4).unwrap();
    let (code, msg) = code_and_message(&client.connect_qp(&*dev, &cq).await.err().unwrap());
    assert_eq!(code, Some(Code::FailedPrecondition), "{msg}");
    assert!(msg.contains("backup; promote it first"), "{msg}");
    let (code, msg) = code_and_message(
        &client
            .persist(&[PersistRange::new(rkey, 0, 8)])
            .await
            .err()
            .unwrap(),
    );
    assert_eq!(code, Some(Code::FailedPrecondition), "{msg}");
    assert!(msg.contains("promote it first"), "{msg}");

    // Promotion: boot above the primary's, idempotent.
    assert_eq!(client.promote().await.unwrap(), 2);
    assert_eq!(client.promote().await.unwrap(), 2);
    assert_eq!((backup.role(), backup.boot()), (Role::Promoted, 2));
    // A client connected before sees the promotion by a Hello again, which opens no
    // session (a fenced primary asks its backup so every second).
    let sessions = client.stats().await.unwrap().sessions;
    let now = client.hello_again(&token()).await.unwrap();
    assert_eq!((now.role, now.boot), (Role::Promoted, 2));
    assert_eq!(
        client.server().role,
        Role::Backup,
        "what connect said stays"
    );
    assert_eq!(client.stats().await.unwrap().sessions, sessions);
    let stranger = ClusterToken::new("another-cluster-token-of-its-own").unwrap();
    assert!(
        client.hello_again(&stranger).await.is_err(),
        "a server without our token"
    );
    let promoted = Node::connect(&backup, &bnet, &token()).await;
    assert_eq!(promoted.client.server().role, Role::Promoted);
    assert!(promoted.client.server().durable);
    let (_, bat) = promoted.data(1).await;
    assert_eq!(promoted.read(bat, 64, 16), b"PERSisted, twice");
    assert_eq!(promoted.read(bat, 256, 11), [0; 11]);
    for i in 0..64u64 {
        assert_eq!(promoted.read(bat, 1024 + 8 * i, 8), i.to_le_bytes());
    }

    // The old primary can acknowledge nothing any more.
    node.write(at, 64, b"late");
    let (code, msg) = refused(&node, PersistRange::new(rkey, 64, 4)).await;
    assert_eq!(code, Some(Code::Unavailable), "{msg}");
    assert!(
        msg.contains(&format!("backup at {}", backup.local_addr())) && msg.contains("promoted"),
        "{msg}"
    );
    assert_eq!(promoted.read(bat, 64, 4), b"PERS");
    // For good: it never attaches again, however long it waits (retrying every second).
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let (code, msg) = refused(&node, PersistRange::new(rkey, 64, 4)).await;
    assert_eq!(code, Some(Code::Unavailable), "{msg}");
    assert!(msg.contains("acknowledges no Persist any more"), "{msg}");
    assert!(
        !refused_for_now(&node, PersistRange::new(rkey, 64, 4)).await,
        "a fenced primary's refusal is for good"
    );
    // Nor can another primary attach.
    let err = start(
        64 << 10,
        Replication::Primary {
            backup_at: backup.local_addr().to_string(),
        },
    )
    .await
    .err()
    .unwrap()
    .to_string();
    assert!(err.contains("promoted"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_refuses_a_backup_of_another_plan() {
    let (backup, _bnet) = start(64 << 10, Replication::Backup).await.unwrap();
    let err = start(
        96 << 10,
        Replication::Primary {
            backup_at: backup.local_addr().to_string(),
        },
    )
    .await
    .err()
    .unwrap()
    .to_string();
    assert!(
        err.contains("region plans differ") && err.contains("--size"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_backup_fails_persists_with_a_clear_error() {
    let (primary, pnet, backup, _bnet) = pair().await;
    let addr = backup.local_addr();
    let node = Node::connect(&primary, &pnet, &token()).await;
    let (rkey, _) = node.data(0).await;
    node.client
        .persist(&[PersistRange::new(rkey, 0, 8)])
        .await
        .unwrap();
    backup.shutdown().await.unwrap();
    let (code, msg) = refused(&node, PersistRange::new(rkey, 0, 8)).await;
    assert_eq!(code, Some(Code::Unavailable), "{msg}");
    assert!(msg.contains(&format!("backup at {addr}")), "{msg}");
    // And it stays failed: the backup may or may not hold the failed batch. Until the
    // primary has attached to a backup again, which a compute node may wait for.
    let (code, _) = refused(&node, PersistRange::new(rkey, 8, 8)).await;
    assert_eq!(code, Some(Code::Unavailable));
    assert!(refused_for_now(&node, PersistRange::new(rkey, 8, 8)).await);
    // A primary whose backup cannot be reached does not start at all.
    let err = start(
        64 << 10,
        Replication::Primary {
            backup_at: addr.to_string(),
        },
    )
    .await
    .err()
    .unwrap()
    .to_string();
    assert!(err.contains(&format!("backup at {addr}")), "{err}");
}

/// Persists `range` until one is acknowledged, for at most 30 s.
async fn persist_until_acknowledged(node: &Node, range: PersistRange) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        match node.client.persist(&[range]).await {
            Ok(_) => return,
            Err(e) if tokio::time::Instant::now() < deadline => {
                let (code, _) = code_and_message(&e);
                assert_eq!(code, Some(Code::Unavailable), "{e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("no Persist acknowledged within 30 s: {e}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backup_started_again_is_attached_again_and_persists_resume() {
    let (primary, pnet, backup, _bnet) = pair().await;
    let addr = backup.local_addr();
    let node = Node::connect(&primary, &pnet, &token()).await;
    let (rkey, at) = node.data(0).await;
    node.write(at, 0, b"before");
    node.client
        .persist(&[PersistRange::new(rkey, 0, 6)])
        .await
        .unwrap();
    backup.shutdown().await.unwrap();
    node.write(at, 100, b"while down");
    let (code, msg) = refused(&node, PersistRange::new(rkey, 100, 10)).await;
    assert_eq!(code, Some(Code::Unavailable), "{msg}");
    assert!(msg.contains("attaches to it again by itself"), "{msg}");
    // What a compute node's persister sees: the same Persist may succeed later.
    let persister = Persister::with_runtime(&node.client, tokio::runtime::Handle::current());
    let ticket = persister.submit(vec![PersistRange::new(rkey, 100, 10)]);
    let why = loop {
        match persister.poll(&ticket) {
            PersistStatus::Pending => tokio::time::sleep(Duration::from_millis(1)).await,
            PersistStatus::Later(why) => break why,
            other => panic!("not refused for now: {other:?}"),
        }
    };
    assert!(why.contains("attaches to it again by itself"), "{why}");

    // A new backup process at the same address: empty, and not promotable until the
    // primary has copied its state there.
    let (again, anet) = start_at(addr, 64 << 10, Replication::Backup).await.unwrap();
    persist_until_acknowledged(&node, PersistRange::new(rkey, 100, 10)).await;
    node.write(at, 200, b"after");
    node.client
        .persist(&[PersistRange::new(rkey, 200, 5)])
        .await
        .unwrap();
    drop(node);
    primary.shutdown().await.unwrap();

    let client = Client::connect(&addr.to_string(), &token()).await.unwrap();
    client.promote().await.unwrap();
    let promoted = Node::connect(&again, &anet, &token()).await;
    let (_, bat) = promoted.data(0).await;
    assert_eq!(promoted.read(bat, 0, 6), b"before", "the state transfer");
    assert_eq!(promoted.read(bat, 100, 10), b"while down");
    assert_eq!(promoted.read(bat, 200, 5), b"after", "the stream after it");
}

/// Waits (up to 30 s) until the backup at `addr` reports that it holds its primary's
/// whole state.
async fn until_synced(addr: &str) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let hello = Client::connect(addr, &token()).await.unwrap();
        if hello.server().synced {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the backup at {addr} was not synced within 30 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_promoted_server_takes_a_new_backup_while_it_serves_and_it_can_be_promoted_in_turn() {
    // The first backup copies its state to a new backup only after a while, so that
    // Persists land during the transfer.
    let net = SimNetwork::new(SimConfig::default());
    let device: Arc<dyn Device> = net.add_node();
    let mut config = ServerConfig::new(
        "127.0.0.1:0".parse().unwrap(),
        RegionPlan::new(64 << 10, REGION_BYTES).unwrap(),
        token(),
    );
    config.replication = Replication::Backup;
    config.resync_delay = Duration::from_millis(500);
    let first_backup = MemoryServer::start(config, device).await.unwrap();
    let b_addr = first_backup.local_addr().to_string();
    let (primary, pnet) = start(
        64 << 10,
        Replication::Primary {
            backup_at: b_addr.clone(),
        },
    )
    .await
    .unwrap();
    let (new_backup, _cnet) = start(64 << 10, Replication::Backup).await.unwrap();
    let c_addr = new_backup.local_addr().to_string();

    let refusal = |e: ClientError| code_and_message(&e);
    // Only a promoted server takes a backup while it runs.
    let to_primary = Client::connect(&primary.local_addr().to_string(), &token())
        .await
        .unwrap();
    assert_eq!(
        to_primary.server().backup_at.as_deref(),
        Some(b_addr.as_str())
    );
    let (code, msg) = refusal(to_primary.attach_backup(&c_addr).await.err().unwrap());
    assert_eq!(code, Some(Code::FailedPrecondition), "{msg}");
    assert!(
        msg.contains(&format!("replicates to the backup at {b_addr} already")),
        "{msg}"
    );
    let to_b = Client::connect(&b_addr, &token()).await.unwrap();
    let (code, msg) = refusal(to_b.attach_backup(&c_addr).await.err().unwrap());
    assert_eq!(code, Some(Code::FailedPrecondition), "{msg}");
    assert!(msg.contains("is a backup"), "{msg}");

    let node = Node::connect(&primary, &pnet, &token()).await;
    let (rkey, at) = node.data(0).await;
    node.write(at, 0, b"on the primary");
    node.client
        .persist(&[PersistRange::new(rkey, 0, 14)])
        .await
        .unwrap();
    drop(node);
    drop(to_primary);
    primary.shutdown().await.unwrap();
    to_b.promote().await.unwrap();

    // Promoted, with no backup: Persists are acknowledged with one copy.
    let b = Node::connect(&first_backup, &net, &token()).await;
    assert_eq!(b.client.server().backup_at, None);
    let (rkey, bat) = b.data(0).await;
    b.write(bat, 100, b"promoted, alone");
    b.client
        .persist(&[PersistRange::new(rkey, 100, 15)])
        .await
        .unwrap();
    // A backup that cannot be reached is refused, and the server goes on as it was.
    let nobody = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let nobody_addr = nobody.local_addr().unwrap().to_string();
    drop(nobody);
    let (code, msg) = refusal(b.client.attach_backup(&nobody_addr).await.err().unwrap());
    assert_eq!(code, Some(Code::Unavailable), "{msg}");
    assert!(msg.contains(&nobody_addr), "{msg}");
    let (code, _) = refusal(b.client.attach_backup(" ").await.err().unwrap());
    assert_eq!(code, Some(Code::InvalidArgument));
    b.client
        .persist(&[PersistRange::new(rkey, 100, 15)])
        .await
        .unwrap();
    // A node fenced at the promoted server before the attach is refused by the new
    // backup once that is promoted too.
    const FENCED: u64 = 0xfe11ced;
    b.client.fence(FENCED).await.unwrap();

    b.client.attach_backup(&c_addr).await.unwrap();
    // Acknowledged during the state transfer (the backup is not promotable meanwhile).
    assert!(
        !Client::connect(&c_addr, &token())
            .await
            .unwrap()
            .server()
            .synced
    );
    b.write(bat, 200, b"during the transfer");
    b.client
        .persist(&[PersistRange::new(rkey, 200, 19)])
        .await
        .unwrap();
    until_synced(&c_addr).await;
    let again = Client::connect(&b_addr, &token()).await.unwrap();
    assert_eq!(
        (again.server().role, again.server().backup_at.as_deref()),
        (Role::Promoted, Some(c_addr.as_str())),
        "a promoted server given a backup is still the promoted one"
    );
    b.write(bat, 300, b"after it");
    b.client
        .persist(&[PersistRange::new(rkey, 300, 8)])
        .await
        .unwrap();
    b.write(bat, 400, b"never persisted");
    // Idempotent for its backup; no second one.
    b.client.attach_backup(&c_addr).await.unwrap();
    let (code, msg) = refusal(b.client.attach_backup(&nobody_addr).await.err().unwrap());
    assert_eq!(code, Some(Code::FailedPrecondition), "{msg}");
    assert!(
        msg.contains(&format!("replicates to the backup at {c_addr} already")),
        "{msg}"
    );
    let b_boot = again.server().boot;
    drop((b, again, to_b));
    first_backup.shutdown().await.unwrap();

    // The new backup is promoted in turn and holds every acknowledged Persist.
    let to_c = Client::connect(&c_addr, &token()).await.unwrap();
    assert!(
        to_c.promote().await.unwrap() > b_boot,
        "a boot no client saw"
    );
    let c = Node::connect(&new_backup, &_cnet, &token()).await;
    let (_, cat) = c.data(0).await;
    assert_eq!(c.read(cat, 0, 14), b"on the primary");
    assert_eq!(c.read(cat, 100, 15), b"promoted, alone");
    assert_eq!(c.read(cat, 200, 19), b"during the transfer");
    assert_eq!(c.read(cat, 300, 8), b"after it");
    assert_eq!(
        c.read(cat, 400, 15),
        [0; 15],
        "only what was persisted after the transfer"
    );
    assert!(refuses(&c_addr, FENCED).await, "the fence was handed on");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backup_is_not_promoted_before_it_holds_its_primarys_state() {
    let (backup, _bnet) = start(64 << 10, Replication::Backup).await.unwrap();
    let client = Client::connect(&backup.local_addr().to_string(), &token())
        .await
        .unwrap();
    let (code, msg) = code_and_message(&client.promote().await.err().unwrap());
    assert_eq!(code, Some(Code::FailedPrecondition), "{msg}");
    assert!(
        msg.contains("has not received its primary's state since it started"),
        "{msg}"
    );
    assert_eq!(client.server().role, Role::Backup);
    assert!(!client.server().synced, "Hello says it cannot be promoted");
    // Once a primary attached and copied its state, it can be.
    let (_primary, _pnet) = start(
        64 << 10,
        Replication::Primary {
            backup_at: backup.local_addr().to_string(),
        },
    )
    .await
    .unwrap();
    let again = Client::connect(&backup.local_addr().to_string(), &token())
        .await
        .unwrap();
    assert!(again.server().synced);
    assert_eq!(client.promote().await.unwrap(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standalone_server_is_no_backup() {
    let (standalone, _net) = start(64 << 10, Replication::Standalone).await.unwrap();
    let client = Client::connect(&standalone.local_addr().to_string(), &token())
        .await
        .unwrap();
    assert_eq!(
        (client.server().role, client.server().durable),
        (Role::Standalone, false)
    );
    let (code, msg) = code_and_message(&client.promote().await.err().unwrap());
    assert_eq!(code, Some(Code::FailedPrecondition), "{msg}");
    assert!(msg.contains("not a backup"), "{msg}");
}

async fn start_durable(
    dir: &std::path::Path,
    replication: Replication,
) -> Result<(MemoryServer, SimNetwork), ServerError> {
    start_durable_with_lease(dir, replication, Duration::from_secs(30)).await
}

async fn start_durable_with_lease(
    dir: &std::path::Path,
    replication: Replication,
    session_lease: Duration,
) -> Result<(MemoryServer, SimNetwork), ServerError> {
    let net = SimNetwork::new(SimConfig::default());
    let device: Arc<dyn Device> = net.add_node();
    let plan = RegionPlan::new(64 << 10, REGION_BYTES).unwrap();
    let mut config = ServerConfig::new("127.0.0.1:0".parse().unwrap(), plan, token());
    config.replication = replication;
    config.durability = Some(memory_server::DurabilityConfig::new(dir));
    config.session_lease = session_lease;
    let server = MemoryServer::start(config, device).await?;
    Ok((server, net))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_live_primary_is_refused_and_a_new_one_takes_over_once_the_old_stopped() {
    let dirs = tempfile::tempdir().unwrap();
    // A short session lease: the second primary waits that long for the first's
    // session to lapse (as a crashed primary's would) before it gives up.
    let (backup, bnet) = start_durable_with_lease(
        &dirs.path().join("b"),
        Replication::Backup,
        Duration::from_secs(2),
    )
    .await
    .unwrap();
    let at_backup = || Replication::Primary {
        backup_at: backup.local_addr().to_string(),
    };
    let (old, onet) = start_durable(&dirs.path().join("p1"), at_backup())
        .await
        .unwrap();
    let node = Node::connect(&old, &onet, &token()).await;
    let (rkey, at) = node.data(0).await;
    node.write(at, 100, b"old primary");
    node.client
        .persist(&[PersistRange::new(rkey, 100, 11)])
        .await
        .unwrap();

    // A second primary given the same backup while the first lives is refused at its
    // start. (Before, it took the backup over: its state transfer overwrote what the
    // first had persisted there, and the first was fenced.)
    let err = start_durable(&dirs.path().join("second"), at_backup())
        .await
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("two primaries cannot share one backup")
            && err.contains("127.0.0.1:")
            && err.contains("waited 2s and it is still live"),
        "{err}"
    );
    // The first goes on as before: its Persists still reach the backup.
    node.write(at, 120, b"still");
    node.client
        .persist(&[PersistRange::new(rkey, 120, 5)])
        .await
        .unwrap();

    // Stopped, the first ends its session at the backup: the next primary is judged at
    // once, not after the session lease. A primary without a data directory (empty
    // memory) must not overwrite the state the backup holds.
    drop(node);
    old.shutdown().await.unwrap();
    let err = start(64 << 10, at_backup())
        .await
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("holds state from an earlier primary"), "{err}");

    // A durable primary (here a fresh directory, restored as all zero) attaches: the
    // transfer sends every piece, zeros included.
    let (new, nnet) = start_durable(&dirs.path().join("p2"), at_backup())
        .await
        .unwrap();
    let fresh = Node::connect(&new, &nnet, &token()).await;
    let (rkey2, at2) = fresh.data(0).await;
    fresh.write(at2, 0, b"new");
    fresh
        .client
        .persist(&[PersistRange::new(rkey2, 0, 3)])
        .await
        .unwrap();

    let client = Client::connect(&backup.local_addr().to_string(), &token())
        .await
        .unwrap();
    // Own boot 1, the primary's 1: promoted to 2, and recorded in the data directory.
    assert_eq!(client.promote().await.unwrap(), 2);
    let promoted = Node::connect(&backup, &bnet, &token()).await;
    let (brkey, bat) = promoted.data(0).await;
    assert_eq!(promoted.read(bat, 0, 3), b"new");
    assert_eq!(promoted.read(bat, 100, 11), [0; 11]);
    // A promoted durable server persists to its own journal.
    promoted.write(bat, 200, b"after");
    promoted
        .client
        .persist(&[PersistRange::new(brkey, 200, 5)])
        .await
        .unwrap();
    drop((promoted, client));
    backup.shutdown().await.unwrap();
    // Restarted (as a standalone durable server) on its directory: the replicated
    // state, the promotion's boot and its own Persist are all there.
    let (again, anet) = start_durable(&dirs.path().join("b"), Replication::Standalone)
        .await
        .unwrap();
    assert_eq!(again.boot(), 3);
    let reader = Node::connect(&again, &anet, &token()).await;
    let (_, rat) = reader.data(0).await;
    assert_eq!(reader.read(rat, 0, 3), b"new");
    assert_eq!(reader.read(rat, 200, 5), b"after");
}

fn copy_dir(from: &std::path::Path, to: &std::path::Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

/// The failover a `cluster down` + `cluster up` used to undo: a promoted backup's
/// directory started as a backup again took its stale old primary's state transfer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_promoted_directory_never_takes_its_old_primarys_state() {
    let dirs = tempfile::tempdir().unwrap();
    let (a_dir, b_dir) = (dirs.path().join("a"), dirs.path().join("b"));
    let (b, bnet) = start_durable(&b_dir, Replication::Backup).await.unwrap();
    let (a, anet) = start_durable(
        &a_dir,
        Replication::Primary {
            backup_at: b.local_addr().to_string(),
        },
    )
    .await
    .unwrap();
    let node = Node::connect(&a, &anet, &token()).await;
    let (rkey, at) = node.data(0).await;
    node.write(at, 0, b"before");
    node.client
        .persist(&[PersistRange::new(rkey, 0, 6)])
        .await
        .unwrap();

    // The primary fails over to its backup, which acknowledges a newer value.
    let bclient = Client::connect(&b.local_addr().to_string(), &token())
        .await
        .unwrap();
    bclient.promote().await.unwrap();
    let promoted = Node::connect(&b, &bnet, &token()).await;
    let (brkey, bat) = promoted.data(0).await;
    promoted.write(bat, 0, b"after!");
    promoted
        .client
        .persist(&[PersistRange::new(brkey, 0, 6)])
        .await
        .unwrap();
    // The fenced old primary journals what it can no longer acknowledge.
    node.write(at, 4096, b"unacknowledged");
    let err = node
        .client
        .persist(&[PersistRange::new(rkey, 4096, 14)])
        .await
        .err()
        .unwrap();
    assert_eq!(err.code(), Some(Code::Unavailable), "{err}");
    drop((node, promoted, bclient));
    a.shutdown().await.unwrap();
    b.shutdown().await.unwrap();
    // The old primary's directory as it is now: epoch 0, "before" persisted.
    let stale_dir = dirs.path().join("stale");
    copy_dir(&a_dir, &stale_dir);

    // The promoted directory refuses to be a backup again (this is what lost the data:
    // the old primary's attach would have overwritten "after!" with "before").
    let err = start_durable(&b_dir, Replication::Backup)
        .await
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains(&format!(
            "the data directory {} was promoted to primary on ",
            b_dir.display()
        )) && err.contains("Start it without --backup, as the primary")
            && err.contains("--backup-at"),
        "{err}"
    );

    // Roles swapped: the old primary's directory as the backup takes the promoted
    // server's whole state, zero pieces included (its unacknowledged write goes).
    let (a2, a2net) = start_durable(&a_dir, Replication::Backup).await.unwrap();
    let (b2, b2net) = start_durable(
        &b_dir,
        Replication::Primary {
            backup_at: a2.local_addr().to_string(),
        },
    )
    .await
    .unwrap();
    assert_eq!(b2.role(), Role::Primary);
    let writer = Node::connect(&b2, &b2net, &token()).await;
    let (wrkey, wat) = writer.data(0).await;
    assert_eq!(writer.read(wat, 0, 6), b"after!");
    writer.write(wat, 8, b"again");
    writer
        .client
        .persist(&[PersistRange::new(wrkey, 8, 5)])
        .await
        .unwrap();
    let a2client = Client::connect(&a2.local_addr().to_string(), &token())
        .await
        .unwrap();
    a2client.promote().await.unwrap();
    let reader = Node::connect(&a2, &a2net, &token()).await;
    let (_, rat) = reader.data(0).await;
    assert_eq!(reader.read(rat, 0, 6), b"after!");
    assert_eq!(reader.read(rat, 8, 5), b"again");
    assert_eq!(reader.read(rat, 4096, 14), [0; 14]);
    drop((writer, reader, a2client));
    b2.shutdown().await.unwrap();
    a2.shutdown().await.unwrap();

    // Its backup held its whole state, so the primary's directory no longer records
    // the promotion and may be a backup again; but its data is of a later epoch than
    // the stale copy of the old primary's, which it refuses.
    let (b3, b3net) = start_durable(&b_dir, Replication::Backup).await.unwrap();
    let err = start_durable(
        &stale_dir,
        Replication::Primary {
            backup_at: b3.local_addr().to_string(),
        },
    )
    .await
    .err()
    .unwrap()
    .to_string();
    assert!(
        err.contains("refused to attach")
            && err.contains("replication epoch 1, newer than the attaching primary's (epoch 0)"),
        "{err}"
    );
    // No primary copied its state to this process, so it is not promoted (its primary
    // may have acknowledged more since); its directory starts as a server instead.
    let b3client = Client::connect(&b3.local_addr().to_string(), &token())
        .await
        .unwrap();
    let (code, msg) = code_and_message(&b3client.promote().await.err().unwrap());
    assert_eq!(code, Some(Code::FailedPrecondition), "{msg}");
    drop((b3client, b3net));
    b3.shutdown().await.unwrap();
    let (b4, b4net) = start_durable(&b_dir, Replication::Standalone)
        .await
        .unwrap();
    let reader = Node::connect(&b4, &b4net, &token()).await;
    let (_, rat) = reader.data(0).await;
    assert_eq!(reader.read(rat, 0, 6), b"after!");
    assert_eq!(reader.read(rat, 8, 5), b"again");
}

/// Whether `incarnation` is refused a session at `addr` (`PermissionDenied`), or gets
/// one.
async fn refuses(addr: &str, incarnation: u64) -> bool {
    match Client::connect_as(addr, &token(), incarnation).await {
        Ok(_) => false,
        Err(e) if e.code() == Some(Code::PermissionDenied) => true,
        Err(e) => panic!("neither a session nor a refusal: {e}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fence_at_the_primary_holds_at_its_backup_started_again_and_promoted() {
    const PAUSED: u64 = 0x5eed;
    const WHILE_DOWN: u64 = 0x5eee;
    let (primary, pnet, backup, _bnet) = pair().await;
    let (at_primary, at_backup) = (
        primary.local_addr().to_string(),
        backup.local_addr().to_string(),
    );
    let _paused = Client::connect_as(&at_primary, &token(), PAUSED)
        .await
        .unwrap();
    let fencer = Client::connect_as(&at_primary, &token(), 0xbeef)
        .await
        .unwrap();
    assert_eq!(fencer.fence(PAUSED).await.unwrap().sessions_ended, 1);
    assert!(refuses(&at_primary, PAUSED).await);
    assert!(
        refuses(&at_backup, PAUSED).await,
        "the fence reached the backup before it was answered"
    );

    // With the backup down the fence stands here and the fencer hears that it must
    // ask again.
    let node = Node::connect(&primary, &pnet, &token()).await;
    let (rkey, at) = node.data(0).await;
    backup.shutdown().await.unwrap();
    let (code, msg) = code_and_message(&fencer.fence(WHILE_DOWN).await.unwrap_err());
    assert_eq!(code, Some(Code::Unavailable), "{msg}");
    assert!(msg.contains("has not recorded the fence"), "{msg}");
    assert!(refuses(&at_primary, WHILE_DOWN).await);

    // A new backup process knows no fence until the primary attaches to it again,
    // which hands on both.
    let (again, _anet) = start_at(at_backup.parse().unwrap(), 64 << 10, Replication::Backup)
        .await
        .unwrap();
    node.write(at, 0, b"after");
    persist_until_acknowledged(&node, PersistRange::new(rkey, 0, 5)).await;
    drop(node);
    primary.shutdown().await.unwrap();
    Client::connect(&at_backup, &token())
        .await
        .unwrap()
        .promote()
        .await
        .unwrap();
    assert!(
        refuses(&at_backup, PAUSED).await,
        "fenced before the restart"
    );
    assert!(
        refuses(&at_backup, WHILE_DOWN).await,
        "fenced while it was down"
    );
    assert!(!refuses(&at_backup, PAUSED + 2).await);
    drop(again);
}
