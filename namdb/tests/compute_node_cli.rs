//! `namdb compute-node` as a process: two shm memory-server processes, a compute node
//! on them, and this test as its gRPC client (`compute_node::client::Client`).

mod common;

use common::{ServerProcess, send_signal};
use compute_node::client::{Client, Txn};
use compute_node::proto::health_response::Status as Health;
use memory_server::ClusterToken;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;
use tonic::{Code, Status};

const TOKEN: &str = "namdb compute node test token";
/// The clusters' transaction timeout: short, so that the expiry tests wait little, but
/// not so short that a transaction of the other tests expires between two requests
/// on a loaded machine.
const TIMEOUT: Duration = Duration::from_secs(1);
const TABLE: &str = "kv";
const VALUE_CAP: u32 = 32;

struct Cluster {
    compute: ServerProcess,
    _memory: Vec<ServerProcess>,
    token: ClusterToken,
    _dir: tempfile::TempDir,
}

fn token_file(dir: &tempfile::TempDir) -> PathBuf {
    let path = dir.path().join("token");
    std::fs::write(&path, TOKEN).unwrap();
    path
}

fn cluster(memory_servers: usize) -> Cluster {
    cluster_of(
        memory_servers,
        "16MiB",
        &format!("{}ms", TIMEOUT.as_millis()),
    )
}

fn cluster_of(memory_servers: usize, size: &str, txn_timeout: &str) -> Cluster {
    let dir = tempfile::tempdir().unwrap();
    let token_file = token_file(&dir);
    let memory: Vec<ServerProcess> = (0..memory_servers)
        .map(|_| ServerProcess::start("shm", &token_file, &["--size", size]))
        .collect();
    let addrs: Vec<String> = memory.iter().map(|s| s.control.clone()).collect();
    let compute = ServerProcess::compute_node(
        &addrs,
        &token_file,
        &["--workers", "2", "--txn-timeout", txn_timeout],
    );
    assert!(compute.line.contains("2 workers"), "{}", compute.line);
    Cluster {
        compute,
        _memory: memory,
        token: ClusterToken::new(TOKEN).unwrap(),
        _dir: dir,
    }
}

impl Cluster {
    async fn client(&self) -> Client {
        Client::connect(&self.compute.control, &self.token)
            .await
            .expect("connects to the compute node")
    }
}

fn expect_code<T: std::fmt::Debug>(result: Result<T, Status>, code: Code, says: &str) -> Status {
    let status = result.expect_err("refused");
    assert_eq!(status.code(), code, "{status:?}");
    assert!(
        status.message().contains(says),
        "{:?} does not say {says:?}",
        status.message()
    );
    status
}

/// Runs `put(key, value)` in transactions until one commits (a conflict is retryable).
async fn put_committed(c: &Client, key: u64, value: &[u8]) -> u64 {
    for _ in 0..50 {
        let t = c.begin().await.unwrap();
        let attempt = async {
            c.put(t, TABLE, key, value.to_vec()).await?;
            c.commit(t).await
        };
        match attempt.await {
            Ok(cid) => return cid.expect("a write takes a commit timestamp"),
            Err(s) if s.code() == Code::Aborted => continue,
            Err(s) => panic!("{s:?}"),
        }
    }
    panic!("key {key} stayed unwritable");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transactions_admin_and_bad_requests_through_a_compute_node_process() {
    let c = cluster(2);
    let client = c.client().await;

    let health = client.health().await.unwrap();
    assert_eq!(health.status, Health::Serving as i32);
    assert_eq!(health.protocol, "namdb.compute.v1");
    assert_eq!(
        (
            health.backend.as_str(),
            health.workers,
            health.memory_servers
        ),
        ("shm", 2, 2)
    );

    let info = client.create_table(TABLE, VALUE_CAP, 1024).await.unwrap();
    assert_eq!((info.value_cap, info.partitions), (VALUE_CAP, 2));
    expect_code(
        client.create_table(TABLE, VALUE_CAP, 1024).await,
        Code::AlreadyExists,
        "exists",
    );
    expect_code(
        client.create_table("", VALUE_CAP, 1024).await,
        Code::InvalidArgument,
        "name",
    );
    let tables = client.list_tables().await.unwrap();
    assert_eq!(
        tables.iter().map(|t| t.name.as_str()).collect::<Vec<_>>(),
        [TABLE]
    );

    // Read your writes inside a transaction, then after it.
    let t = client.begin().await.unwrap();
    assert_eq!(client.get(t, TABLE, 1).await.unwrap(), None);
    client.put(t, TABLE, 1, b"one".to_vec()).await.unwrap();
    client.insert(t, TABLE, 2, b"two".to_vec()).await.unwrap();
    assert_eq!(
        client.get(t, TABLE, 1).await.unwrap(),
        Some(b"one".to_vec())
    );
    let cid = client.commit(t).await.unwrap().expect("a commit timestamp");
    let t = client.begin().await.unwrap();
    assert!(t.read_timestamp >= cid);
    assert_eq!(
        client.batch_get(t, TABLE, &[2, 99, 1]).await.unwrap(),
        [Some(b"two".to_vec()), None, Some(b"one".to_vec())]
    );
    assert_eq!(client.commit(t).await.unwrap(), None, "read-only");
    expect_code(
        client.get(t, TABLE, 1).await,
        Code::NotFound,
        "unknown transaction",
    );

    // First committer wins: the second committer is told to retry, and its handle is
    // gone.
    let a = client.begin().await.unwrap();
    let b = client.begin().await.unwrap();
    client.put(a, TABLE, 1, b"a".to_vec()).await.unwrap();
    client.put(b, TABLE, 1, b"b".to_vec()).await.unwrap();
    client.commit(a).await.unwrap();
    expect_code(client.commit(b).await, Code::Aborted, "retryable");
    expect_code(client.get(b, TABLE, 1).await, Code::NotFound, "unknown");
    let t = client.begin().await.unwrap();
    assert_eq!(client.get(t, TABLE, 1).await.unwrap(), Some(b"a".to_vec()));
    // An insert of an existing key is refused and leaves the transaction open.
    expect_code(
        client.insert(t, TABLE, 2, b"again".to_vec()).await,
        Code::AlreadyExists,
        "still open",
    );
    client.abort(t).await.unwrap();
    // A key this transaction inserted itself is told so: before, "key 3 already exists
    // in table kv", as if another transaction had.
    let t = client.begin().await.unwrap();
    client.insert(t, TABLE, 3, b"three".to_vec()).await.unwrap();
    expect_code(
        client.insert(t, TABLE, 3, b"again".to_vec()).await,
        Code::AlreadyExists,
        "key 3 was inserted by this transaction already",
    );
    client.abort(t).await.unwrap();

    // Scan: more rows than one message holds, streamed in key order.
    let t = client.begin().await.unwrap();
    for key in (10..610u64).rev() {
        client
            .put(t, TABLE, key, key.to_le_bytes().to_vec())
            .await
            .unwrap();
    }
    client.commit(t).await.unwrap();
    let t = client.begin().await.unwrap();
    client.delete(t, TABLE, 2).await.unwrap();
    let mut stream = client.scan_stream(t, TABLE, 0, None, 0).await.unwrap();
    let (mut messages, mut keys) = (0, Vec::new());
    while let Some(batch) = stream.message().await.unwrap() {
        messages += 1;
        keys.extend(batch.rows.iter().map(|r| r.key));
    }
    let expected: Vec<u64> = std::iter::once(1).chain(10..610).collect();
    assert_eq!(keys, expected, "own delete applied, key order");
    assert!(messages > 1, "{messages} messages");
    let mut stream = client
        .scan_stream(t, TABLE, 100, Some(200), 5)
        .await
        .unwrap();
    let batch = stream.message().await.unwrap().expect("a batch");
    assert_eq!(
        batch.rows.iter().map(|r| r.key).collect::<Vec<_>>(),
        [100, 101, 102, 103, 104]
    );
    assert_eq!(batch.rows[0].value, 100u64.to_le_bytes());

    // Bad requests get their status and leave the transaction open.
    let s = expect_code(client.get(t, "nosuch", 1).await, Code::NotFound, "nosuch");
    assert!(s.message().contains("still open"), "{s:?}");
    // A name no table can have (at most 64 bytes) is shown cut short.
    let long = "n".repeat(10_000);
    let s = expect_code(
        client.get(t, &long, 1).await,
        Code::NotFound,
        "table names have at most 64 bytes",
    );
    assert!(
        s.message().len() < 300 && s.message().contains("… (10000 bytes)"),
        "{s:?}"
    );
    assert!(s.message().contains("still open"), "{s:?}");
    // Fields left unset: an empty table name, transaction 0.
    expect_code(
        client.get(t, "", 1).await,
        Code::InvalidArgument,
        "name is empty",
    );
    let unset = Txn {
        handle: 0,
        read_timestamp: 0,
    };
    expect_code(
        client.get(unset, TABLE, 1).await,
        Code::NotFound,
        "`txn` set",
    );
    // Tables that cannot be made are refused in terms of what to change.
    let create = |name: &str, value_cap: u32, capacity: u64, versions: u32| {
        let rpc = client.rpc();
        let request = compute_node::proto::CreateTableRequest {
            name: name.into(),
            value_cap,
            capacity,
            versions,
            partitions: 0,
        };
        async move { rpc.clone().create_table(request).await }
    };
    for (name, value_cap, capacity, versions, says) in [
        ("a\nb", 8, 16, 0, "without control characters"),
        (
            "t1",
            u32::MAX,
            16,
            0,
            "values of up to 4294967295 bytes are too large",
        ),
        ("t2", 8, 16, 1_000_000, "too large even for empty values"),
        ("t4", 0, 16, 0, "value_cap is 0 (unset?)"),
        (
            "t3",
            8,
            u64::MAX,
            0,
            "a capacity of 18446744073709551615 records is too large",
        ),
    ] {
        expect_code(
            create(name, value_cap, capacity, versions).await,
            Code::InvalidArgument,
            says,
        );
    }
    for name in [long.as_str(), &"n".repeat(65)] {
        let s = expect_code(
            client.create_table(name, VALUE_CAP, 16).await,
            Code::InvalidArgument,
            "a table name has 1 to 64 bytes",
        );
        assert!(s.message().len() < 300, "{s:?}");
    }
    expect_code(
        client
            .put(t, TABLE, 3, vec![0; VALUE_CAP as usize + 1])
            .await,
        Code::InvalidArgument,
        "exceeds",
    );
    expect_code(
        client.put(t, TABLE, u64::MAX, b"x".to_vec()).await,
        Code::InvalidArgument,
        "reserved",
    );
    expect_code(
        client.batch_get(t, TABLE, &[1, u64::MAX]).await,
        Code::InvalidArgument,
        "reserved",
    );
    client.put(t, TABLE, 3, b"three".to_vec()).await.unwrap();
    client.commit(t).await.unwrap();
    let unknown = Txn {
        handle: 0xdead_0001,
        read_timestamp: 0,
    };
    expect_code(
        client.get(unknown, TABLE, 1).await,
        Code::NotFound,
        "unknown transaction",
    );
    expect_code(client.commit(unknown).await, Code::NotFound, "unknown");
    expect_code(
        client
            .get(
                Txn {
                    handle: 0,
                    ..unknown
                },
                TABLE,
                1,
            )
            .await,
        Code::NotFound,
        "unknown",
    );

    // A Begin after a timestamp no commit can have returned says so at once, rather
    // than blaming another node after a wait.
    let far = client
        .rpc()
        .begin(compute_node::proto::BeginRequest { after: u64::MAX })
        .await;
    let s = expect_code(
        far,
        Code::InvalidArgument,
        "beyond every timestamp the oracle has handed out",
    );
    assert!(!s.message().contains("another compute node"), "{s:?}");

    // An idle transaction expires.
    let t = client.begin().await.unwrap();
    client.put(t, TABLE, 4, b"four".to_vec()).await.unwrap();
    tokio::time::sleep(TIMEOUT * 3).await;
    expect_code(client.commit(t).await, Code::NotFound, "expired");

    let stats = client.stats().await.unwrap();
    assert_eq!((stats.workers, stats.memory_servers), (2, 2));
    assert!(stats.committed >= 5, "{stats:?}");
    assert!(stats.conflicts >= 1, "{stats:?}");
    assert!(stats.expired >= 1, "{stats:?}");
    assert_eq!(stats.open_transactions, 0, "{stats:?}");

    // A wrong token is refused.
    let stranger = Client::connect(
        &c.compute.control,
        &ClusterToken::new("not this cluster's token").unwrap(),
    )
    .await
    .unwrap();
    expect_code(
        stranger.health().await,
        Code::Unauthenticated,
        "wrong credentials",
    );
}

/// gRPC libraries refuse messages over 4 MiB by default: a request that large is told
/// what to do and leaves its transaction open, and the node's answers stay under the
/// limit however large the table's values are.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_and_answers_near_the_grpc_message_limit() {
    // Messages of megabytes take a while in a debug build: the transaction must not
    // expire between them.
    let c = cluster_of(1, "64MiB", "30s");
    let client = c.client().await;
    client.create_table(TABLE, VALUE_CAP, 64).await.unwrap();
    let t = client.begin().await.unwrap();
    client.put(t, TABLE, 1, b"kept".to_vec()).await.unwrap();
    let s = expect_code(
        client.put(t, TABLE, 2, vec![b'x'; 5 << 20]).await,
        Code::InvalidArgument,
        "limit of 4194304 bytes",
    );
    assert!(s.message().contains("value cap"), "{}", s.message());
    assert!(s.message().contains("still open"), "{}", s.message());
    // Keys of 10-byte varints: a request of 5 MB.
    expect_code(
        client
            .batch_get(t, TABLE, &vec![1 << 63; 500_000])
            .await
            .map(|v| v.len()),
        Code::InvalidArgument,
        "limit of 4194304 bytes",
    );
    // A small request whose answer could exceed the limit.
    let most = compute_node::limits::batch_get_keys(VALUE_CAP);
    expect_code(
        client
            .batch_get(t, TABLE, &vec![1; most + 1])
            .await
            .map(|v| v.len()),
        Code::InvalidArgument,
        "ask in several calls",
    );
    assert_eq!(
        client
            .batch_get(t, TABLE, &vec![1; most])
            .await
            .unwrap()
            .len(),
        most
    );
    // The transaction went on through every refusal.
    client.commit(t).await.unwrap();
    let t = client.begin().await.unwrap();
    assert_eq!(
        client.get(t, TABLE, 1).await.unwrap(),
        Some(b"kept".to_vec())
    );
    client.abort(t).await.unwrap();

    // The largest values a table may have: a scan of 6 MiB comes in messages under the
    // limit, and a BatchGet of as many keys as its answer holds works.
    let cap = txn::Options::default().largest_value_cap(1);
    let info = client
        .rpc()
        .create_table(compute_node::proto::CreateTableRequest {
            name: "wide".into(),
            value_cap: cap,
            capacity: 128,
            versions: 1,
            partitions: 0,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.value_cap, cap);
    let rows = (6 << 20) / cap as u64 + 1;
    for key in 0..rows {
        let t = client.begin().await.unwrap();
        client
            .put(t, "wide", key, vec![key as u8; cap as usize])
            .await
            .unwrap();
        client.commit(t).await.unwrap();
    }
    let t = client.begin().await.unwrap();
    let scanned = client.scan(t, "wide").await.unwrap();
    assert_eq!(scanned.len() as u64, rows);
    assert!(
        scanned
            .iter()
            .enumerate()
            .all(|(i, (k, v))| *k == i as u64 && *v == vec![i as u8; cap as usize])
    );
    let most = compute_node::limits::batch_get_keys(cap);
    assert!((most as u64) < rows, "{most} keys");
    let keys: Vec<u64> = (0..most as u64).collect();
    let got = client.batch_get(t, "wide", &keys).await.unwrap();
    assert!(
        got.iter()
            .all(|v| v.as_ref().map(Vec::len) == Some(cap as usize))
    );
    let all: Vec<u64> = (0..rows).collect();
    expect_code(
        client.batch_get(t, "wide", &all).await.map(|v| v.len()),
        Code::InvalidArgument,
        "ask in several calls",
    );
    client.commit(t).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vanished_client_leaves_nothing_locked() {
    let c = cluster(1);
    let client = c.client().await;
    client.create_table(TABLE, VALUE_CAP, 256).await.unwrap();
    put_committed(&client, 5, b"before").await;

    // A client that begins, writes and disappears.
    let gone = c.client().await;
    let t = gone.begin().await.unwrap();
    gone.put(t, TABLE, 5, b"lost".to_vec()).await.unwrap();
    gone.put(t, TABLE, 6, b"lost".to_vec()).await.unwrap();
    drop(gone);
    tokio::time::sleep(TIMEOUT * 3).await;
    expect_code(client.get(t, TABLE, 5).await, Code::NotFound, "expired");
    put_committed(&client, 5, b"after").await;
    put_committed(&client, 6, b"after").await;

    // A client that goes away during Commit: the commit runs to its end on the worker
    // anyway, so whichever way it went, the record is not left locked.
    for round in 0..20u64 {
        let doomed = c.client().await;
        let t = doomed.begin().await.unwrap();
        doomed
            .put(t, TABLE, 7, round.to_le_bytes().to_vec())
            .await
            .unwrap();
        let commit = tokio::spawn(async move { doomed.commit(t).await });
        // Cancelled at a different point each round: before it is sent, in flight,
        // or after it is done.
        tokio::time::sleep(Duration::from_micros(round * 50)).await;
        commit.abort();
        let _ = commit.await;
        put_committed(&client, 7, b"mine").await;
    }
    let t = client.begin().await.unwrap();
    assert_eq!(
        client.get(t, TABLE, 7).await.unwrap(),
        Some(b"mine".to_vec())
    );
    let stats = client.stats().await.unwrap();
    assert!(stats.expired >= 1, "{stats:?}");
}

#[test]
fn sigterm_stops_the_compute_node_cleanly() {
    let mut c = cluster(1);
    send_signal(c.compute.child.id(), "-TERM");
    let exit = c.compute.child.wait().unwrap();
    assert!(exit.success(), "{exit:?}");
    let err = c.compute.stderr();
    assert!(err.contains("compute node stopped"), "{err}");
}

#[test]
fn unreachable_memory_servers_are_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let token_file = token_file(&dir);
    let out = Command::new(env!("CARGO_BIN_EXE_namdb"))
        .args([
            "compute-node",
            "--listen",
            "127.0.0.1:0",
            "--memory-servers",
            "127.0.0.1:1",
        ])
        .arg("--token-file")
        .arg(&token_file)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("127.0.0.1:1"), "{err}");
}

#[test]
fn bad_memory_server_lists_and_worker_counts_are_refused_up_front() {
    let dir = tempfile::tempdir().unwrap();
    let token_file = token_file(&dir);
    for (servers, workers, says) in [
        ("127.0.0.1:1,127.0.0.1:1", "1", "listed twice"),
        ("127.0.0.1:1|127.0.0.1:1", "1", "listed twice"),
        ("127.0.0.1:1|", "1", "empty address"),
        ("127.0.0.1:1", "0", "--workers"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_namdb"))
            .args(["compute-node", "--listen", "127.0.0.1:0"])
            .args(["--memory-servers", servers, "--workers", workers])
            .arg("--token-file")
            .arg(&token_file)
            .output()
            .unwrap();
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(says), "{servers} {workers}: {err}");
        // Refused before connecting: nothing listens at port 1 to connect to.
        assert!(!err.contains("cannot reach"), "{err}");
    }
}

#[test]
fn memory_servers_sharing_a_node_id_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let token_file = token_file(&dir);
    // Two servers started with the same --node, and one server under two names: tcp
    // took the second for the first, silently.
    let a = ServerProcess::start("tcp", &token_file, &["--size", "16MiB", "--node", "7"]);
    let b = ServerProcess::start("tcp", &token_file, &["--size", "16MiB", "--node", "7"]);
    let port = a.control.rsplit_once(':').unwrap().1;
    for servers in [
        format!("{},{}", a.control, b.control),
        format!("{},localhost:{port}", a.control),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_namdb"))
            .args(["compute-node", "--listen", "127.0.0.1:0"])
            .args(["--memory-servers", &servers])
            .arg("--token-file")
            .arg(&token_file)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{servers}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("are both node 7"), "{servers}: {err}");
    }
}

/// A call of a method the node does not have, by a client holding the token, is told
/// what it called and what the node has (tonic's own answer is an UNIMPLEMENTED with
/// no message); a caller without the token learns only that it lacks it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_method_is_told_what_the_node_has() {
    use compute_node::proto::{HealthRequest, HealthResponse};
    use tonic::codegen::http::uri::PathAndQuery;
    let c = cluster(1);
    let channel = tonic::transport::Channel::from_shared(format!("http://{}", c.compute.control))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let bearer = compute_node::auth::bearer(&c.token);
    let call = |path: &'static str, with_token: bool| {
        let mut grpc = tonic::client::Grpc::new(channel.clone());
        let mut request = tonic::Request::new(HealthRequest::default());
        if with_token {
            request
                .metadata_mut()
                .insert("authorization", bearer.clone());
        }
        async move {
            grpc.ready().await.unwrap();
            grpc.unary::<HealthRequest, HealthResponse, _>(
                request,
                PathAndQuery::from_static(path),
                tonic_prost::ProstCodec::default(),
            )
            .await
        }
    };
    call("/namdb.compute.v1.Compute/Health", true)
        .await
        .expect("a served method answers");
    let said = expect_code(
        call("/namdb.compute.v1.Compute/Helth", true).await,
        Code::Unimplemented,
        "/namdb.compute.v1.Compute/Helth",
    );
    assert!(
        said.message().contains("Health")
            && said
                .message()
                .contains("compute-node/proto/namdb/compute/v1/compute.proto"),
        "{}",
        said.message()
    );
    expect_code(
        call("/namdb.compute.v1.Compute/Helth", false).await,
        Code::Unauthenticated,
        "authorization",
    );
    // A memory server's service, asked of the node.
    let said = expect_code(
        call("/namdb.memory_server.v1.MemoryServer/Hello", true).await,
        Code::Unimplemented,
        "no service `namdb.memory_server.v1.MemoryServer`",
    );
    assert!(
        said.message()
            .contains("namdb.compute.v1.Compute (compute-node/proto/"),
        "{}",
        said.message()
    );
}
