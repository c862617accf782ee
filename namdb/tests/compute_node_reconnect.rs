//! A `namdb compute-node` process reconnects by itself when a memory server goes away:
//! durable shm memory-server processes, one of them killed with SIGKILL (failing over
//! to its backup, or restarted on its data directory and address), while this test
//! talks to the node through its gRPC API only. Every acknowledged write must be
//! there after the node reconnected, new writes must work, and the node's stats count
//! one reconnection.

mod common;

use common::ServerProcess;
use compute_node::client::Client;
use memory_server::ClusterToken;
use std::path::Path;
use std::time::{Duration, Instant};
use tonic::{Code, Status};

const TOKEN: &str = "namdb compute node reconnect test token";
const TABLE: &str = "kv";
const KEYS: u64 = 40;
/// How long the node may take to serve again after the kill.
const RECOVERY: Duration = Duration::from_secs(20);
/// The deadline of one attempt: a request on a dead connection must not hang.
const ATTEMPT: Duration = Duration::from_secs(3);

fn durable(token_file: &Path, data_dir: &Path, extra: &[&str]) -> ServerProcess {
    let mut args = vec![
        "--size",
        "32MiB",
        "--data-dir",
        data_dir.to_str().unwrap(),
        "--checkpoint-interval",
        "0.2",
    ];
    args.extend_from_slice(extra);
    ServerProcess::start("shm", token_file, &args)
}

fn token_file(dir: &Path) -> std::path::PathBuf {
    let path = dir.join("token");
    std::fs::write(&path, TOKEN).unwrap();
    path
}

/// Puts `key = value` in a transaction of its own and commits it.
async fn put(c: &Client, key: u64, value: u64) -> Result<(), Status> {
    let t = c.begin().await?;
    c.put(t, TABLE, key, value.to_le_bytes().to_vec()).await?;
    c.commit(t).await?;
    Ok(())
}

/// Every key of `0..keys` as one snapshot sees it.
async fn read_all(c: &Client, keys: u64) -> Result<Vec<Option<u64>>, Status> {
    let t = c.begin().await?;
    let mut out = Vec::new();
    for k in 0..keys {
        let v = c.get(t, TABLE, k).await?;
        out.push(v.map(|v| u64::from_le_bytes(v[..8].try_into().unwrap())));
    }
    c.commit(t).await?;
    Ok(out)
}

/// Writes keys `0..KEYS` (value `round * 1000 + key`), through the node.
async fn write_round(c: &Client, round: u64) {
    for k in 0..KEYS {
        put(c, k, round * 1000 + k)
            .await
            .unwrap_or_else(|s| panic!("put {k}: {s:?}"));
    }
}

/// Retries a write and a read through `c` until both work; returns how long it took.
/// Every failure meanwhile must be a clean status (the node says it is reconnecting,
/// or the old connection's transport error), never a hang past [`ATTEMPT`].
async fn until_served(c: &Client, since: Instant) -> Duration {
    let mut seen = Vec::new();
    loop {
        let attempt = async {
            put(c, KEYS + 1, 7).await?;
            read_all(c, 1).await
        };
        match tokio::time::timeout(ATTEMPT, attempt).await {
            Ok(Ok(_)) => {
                eprintln!("failures while the node reconnected: {seen:?}");
                return since.elapsed();
            }
            Ok(Err(s)) => {
                assert!(
                    matches!(
                        s.code(),
                        Code::Unavailable | Code::Unknown | Code::NotFound | Code::Aborted
                    ),
                    "{s:?}"
                );
                if seen.len() < 5 {
                    seen.push(s.message().to_string());
                }
            }
            Err(_) => panic!("a request hung past {ATTEMPT:?} (so far: {seen:?})"),
        }
        assert!(
            since.elapsed() < RECOVERY,
            "the node did not serve again within {RECOVERY:?}; it said {seen:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Puts keys through the node, kills a memory server with `kill`, waits until the node
/// serves again, and checks the data and the reconnect counter.
async fn survive(compute: &mut ServerProcess, kill: impl FnOnce()) {
    let token = ClusterToken::new(TOKEN).unwrap();
    let c = Client::connect(&compute.control, &token).await.unwrap();
    c.create_table(TABLE, 16, 1024).await.unwrap();
    write_round(&c, 1).await;
    write_round(&c, 2).await;
    let before = c.stats().await.unwrap();
    assert_eq!(before.reconnects, 0, "{before:?}");

    let killed = Instant::now();
    kill();
    let took = until_served(&c, killed).await;
    eprintln!("the compute node served again {took:?} after the kill");

    let want: Vec<Option<u64>> = (0..KEYS).map(|k| Some(2000 + k)).collect();
    assert_eq!(
        read_all(&c, KEYS).await.unwrap(),
        want,
        "acknowledged writes"
    );
    write_round(&c, 3).await;
    let want: Vec<Option<u64>> = (0..KEYS).map(|k| Some(3000 + k)).collect();
    assert_eq!(read_all(&c, KEYS).await.unwrap(), want, "new writes");
    let stats = c.stats().await.unwrap();
    assert_eq!(stats.reconnects, 1, "{stats:?}\n{}", compute.stderr());
    assert!(stats.last_reconnect_ms > 0, "{stats:?}");
    assert!(
        stats.last_reconnect_ms < took.as_millis() as u64 + 1000,
        "{stats:?} vs {took:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compute_node_fails_over_to_a_backup_by_itself() {
    let dir = tempfile::tempdir().unwrap();
    let token_file = token_file(dir.path());
    let s0 = durable(&token_file, &dir.path().join("ms0"), &[]);
    // The backup first: the primary attaches to it when it starts.
    let backup = durable(&token_file, &dir.path().join("ms1-b"), &["--backup"]);
    let mut primary = durable(
        &token_file,
        &dir.path().join("ms1-p"),
        &["--backup-at", &backup.control],
    );
    let addrs = vec![
        s0.control.clone(),
        format!("{}|{}", primary.control, backup.control),
    ];
    let mut compute = ServerProcess::compute_node(&addrs, &token_file, &["--workers", "2"]);
    survive(&mut compute, || primary.kill_9()).await;
    let log = compute.stderr();
    assert!(log.contains("reconnecting"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compute_node_reconnects_to_a_restarted_server_by_itself() {
    let dir = tempfile::tempdir().unwrap();
    let token_file = token_file(dir.path());
    let s0 = durable(&token_file, &dir.path().join("ms0"), &[]);
    let mut s1 = durable(&token_file, &dir.path().join("ms1"), &[]);
    let addrs = vec![s0.control.clone(), s1.control.clone()];
    let mut compute = ServerProcess::compute_node(&addrs, &token_file, &["--workers", "2"]);
    let s1_dir = dir.path().join("ms1");
    let s1_addr = s1.control.clone();
    let mut restarted = None;
    survive(&mut compute, || {
        s1.kill_9();
        // The same address: the node knows no other.
        restarted = Some(ServerProcess::start_at(
            &s1_addr,
            "shm",
            &token_file,
            &[
                "--size",
                "32MiB",
                "--data-dir",
                s1_dir.to_str().unwrap(),
                "--checkpoint-interval",
                "0.2",
            ],
        ));
    })
    .await;
    assert!(restarted.is_some());
}

/// A compute node stopped (SIGSTOP) for longer than its oracle lease while another
/// node commits: the other fences its slots at the memory server (memory-side fencing:
/// the stopped node's sessions are ended, so nothing it had under way lands late) and
/// recovers what it held. Resumed, the stopped node learns it "was fenced", reconnects
/// as a new incarnation by itself and serves again, with every acknowledged write of
/// either node in place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compute_node_stopped_past_its_lease_is_fenced_and_reconnects_by_itself() {
    let dir = tempfile::tempdir().unwrap();
    let token_file = token_file(dir.path());
    let server = ServerProcess::start("shm", &token_file, &["--size", "32MiB"]);
    let addrs = vec![server.control.clone()];
    let mut stopped = ServerProcess::compute_node(&addrs, &token_file, &["--workers", "2"]);
    let mut other = ServerProcess::compute_node(&addrs, &token_file, &["--workers", "2"]);
    let token = ClusterToken::new(TOKEN).unwrap();
    let a = Client::connect(&stopped.control, &token).await.unwrap();
    let b = Client::connect(&other.control, &token).await.unwrap();
    a.create_table(TABLE, 16, 1024).await.unwrap();
    write_round(&a, 1).await;
    assert_eq!(a.stats().await.unwrap().reconnects, 0);

    let pid = stopped.child.id();
    common::stop_and_wait(pid);
    // Commits through the other node need the stopped node's timestamps decided: its
    // slots are fenced once their leases (250 ms) lapse.
    let since = Instant::now();
    while since.elapsed() < Duration::from_secs(2) {
        write_round(&b, 2).await;
    }
    common::send_signal(pid, "-CONT");

    let took = until_served(&a, Instant::now()).await;
    eprintln!("the stopped node served again {took:?} after it was resumed");
    let want: Vec<Option<u64>> = (0..KEYS).map(|k| Some(2000 + k)).collect();
    assert_eq!(
        read_all(&a, KEYS).await.unwrap(),
        want,
        "through the resumed node"
    );
    write_round(&a, 3).await;
    let want: Vec<Option<u64>> = (0..KEYS).map(|k| Some(3000 + k)).collect();
    assert_eq!(
        read_all(&b, KEYS).await.unwrap(),
        want,
        "through the other node"
    );
    let stats = a.stats().await.unwrap();
    assert_eq!(stats.reconnects, 1, "{stats:?}\n{}", stopped.stderr());
    let log = stopped.stderr();
    assert!(log.contains("was fenced"), "{log}");
    let log = other.stderr();
    assert!(log.contains("fenced compute node"), "{log}");
}

/// A primary stopped with SIGSTOP (as a hung or cut-off host: its connections stay
/// open and answer nothing). The node's monitor waits `PRIMARY_ANSWER_LIMIT` for its
/// session renewal, asks the backup, which has not heard from the primary, reconnects,
/// and the connection promotes the backup: every acknowledged write is there and new
/// ones work. A request in flight meanwhile waits (its commit's Persist waits on the
/// primary) and fails once the node has given up on the old connection's Persists.
/// Before, the node waited for the HTTP/2 keep-alive twice (up to a minute) before
/// the failover began, and a request in flight waited as long as its Persist.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compute_node_fails_over_from_a_stopped_primary_by_itself() {
    let dir = tempfile::tempdir().unwrap();
    let token_file = token_file(dir.path());
    let backup = durable(&token_file, &dir.path().join("ms0-b"), &["--backup"]);
    let primary = durable(
        &token_file,
        &dir.path().join("ms0-p"),
        &["--backup-at", &backup.control],
    );
    let addrs = vec![format!("{}|{}", primary.control, backup.control)];
    let mut compute = ServerProcess::compute_node(&addrs, &token_file, &["--workers", "2"]);
    let token = ClusterToken::new(TOKEN).unwrap();
    let c = Client::connect(&compute.control, &token).await.unwrap();
    c.create_table(TABLE, 16, 1024).await.unwrap();
    write_round(&c, 1).await;

    let _stopped = common::Stopped::stop(primary.child.id());
    let stopped = Instant::now();
    // Bounded per attempt: a request must end once the node gave up on the primary
    // (its answer limit, the backup's answer, the promotion, and 5 s later the old
    // connection's Persists), about 10 s, never wait for the keep-alive (30 s).
    let attempt = Duration::from_secs(20);
    let mut seen = Vec::new();
    loop {
        match tokio::time::timeout(attempt, put(&c, KEYS + 1, 7)).await {
            Ok(Ok(())) => break,
            Ok(Err(s)) => seen.push(s.message().to_string()),
            Err(_) => panic!("a put hung past {attempt:?} (so far: {seen:?})"),
        }
        assert!(
            stopped.elapsed() < Duration::from_secs(120),
            "the node did not serve again; it said {seen:?}\n{}",
            compute.stderr()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!(
        "the compute node served again {:?} after the primary stopped",
        stopped.elapsed()
    );
    let log = compute.stderr();
    assert!(
        log.contains("did not answer within") && log.contains("has not heard from it for"),
        "{log}"
    );
    let want: Vec<Option<u64>> = (0..KEYS).map(|k| Some(1000 + k)).collect();
    assert_eq!(
        read_all(&c, KEYS).await.unwrap(),
        want,
        "acknowledged writes"
    );
    write_round(&c, 2).await;
    let stats = c.stats().await.unwrap();
    assert_eq!(stats.reconnects, 1, "{stats:?}\n{log}");
}
