//! `namdb kv`: one transaction on a table of a local cluster, through a compute node
//! named by the cluster file.

use crate::cluster_cmd::{CLUSTER_FILE, ClusterFile, DEFAULT_DIR, DEFAULT_TABLE};
use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use compute_node::client::{Client, Txn};
use compute_node::proto::HealthResponse;
use compute_node::proto::health_response::Status as Health;
use futures::StreamExt;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;
use tonic::Status;

#[derive(Args, Debug)]
pub struct KvArgs {
    #[command(subcommand)]
    pub command: KvCommand,
    /// The table.
    #[arg(long, value_name = "T", default_value = DEFAULT_TABLE, global = true)]
    pub table: String,
    /// The cluster file, or the cluster's directory holding it; by default
    /// ./cluster.json, else ./namdb-cluster/cluster.json.
    #[arg(long, value_name = "FILE", global = true)]
    pub cluster: Option<PathBuf>,
    /// Give up when the transaction has not finished after this long (e.g. 500ms,
    /// 30s, 2m).
    #[arg(long, value_name = "DURATION", global = true, default_value = "30s",
          value_parser = crate::compute_node_cmd::parse_duration)]
    pub timeout: std::time::Duration,
}

#[derive(Subcommand, Debug, PartialEq, Eq)]
pub enum KvCommand {
    /// Print the value of KEY; exit status 1 if there is none.
    Get {
        #[arg(value_parser = parse_key, allow_negative_numbers = true)]
        key: u64,
    },
    /// Set KEY to VALUE (its UTF-8 bytes, or with --hex the bytes it spells).
    Put {
        #[arg(value_parser = parse_key, allow_negative_numbers = true)]
        key: u64,
        #[arg(allow_negative_numbers = true)]
        value: String,
        /// VALUE is hex (`00ff…`, with or without `0x`), for values that are not text.
        #[arg(long)]
        hex: bool,
    },
    /// Delete KEY.
    Delete {
        #[arg(value_parser = parse_key, allow_negative_numbers = true)]
        key: u64,
    },
    /// Print the rows (`KEY<TAB>VALUE`) in key order.
    Scan {
        /// First key (inclusive).
        #[arg(long, value_name = "K", default_value_t = 0, value_parser = parse_bound)]
        from: u64,
        /// Last key (exclusive); no bound by default.
        #[arg(long, value_name = "K", value_parser = parse_bound)]
        to: Option<u64>,
        /// At most this many rows; 0 (the default) prints them all.
        #[arg(long, value_name = "N", default_value_t = 0)]
        limit: u64,
    },
    /// List the cluster's tables: name, capacity (the records it is made for, not how
    /// many it holds), largest value, partitions.
    Tables,
    /// Create table NAME (outside any transaction); use it with `--table NAME`.
    CreateTable {
        name: String,
        /// Records it is made for (distinct keys, deleted ones included until reused).
        #[arg(long, value_name = "N", default_value_t = 16384,
              value_parser = crate::at_least(1u64))]
        capacity: u64,
        /// Largest value, in bytes; fixed for the table's life.
        #[arg(long, value_name = "BYTES", default_value_t = 256,
              value_parser = crate::at_least(1u32))]
        value_cap: u32,
    },
}

/// A record's key as a user types it. Tables are keyed by 64-bit unsigned integers,
/// which the parser's own "invalid digit found in string" does not tell someone who
/// typed a word. u64::MAX is reserved by the tables: refused here, as the usage says,
/// rather than by the compute node once a transaction has begun.
pub fn parse_key(word: &str) -> Result<u64, String> {
    match parse_bound(word)? {
        u64::MAX => Err(format!(
            "`{word}` is reserved (u64::MAX): keys are whole numbers from 0 to {}",
            u64::MAX - 1
        )),
        key => Ok(key),
    }
}

/// A scan's bound: a key, or u64::MAX, which as an exclusive end takes every key.
pub fn parse_bound(word: &str) -> Result<u64, String> {
    word.parse().map_err(|_| {
        format!(
            "`{}` is not a key: keys are whole numbers from 0 to {}",
            txn::echo(word),
            u64::MAX - 1
        )
    })
}

impl KvCommand {
    /// Whether this command works on the catalog rather than in a transaction.
    fn is_catalog(&self) -> bool {
        matches!(self, KvCommand::Tables | KvCommand::CreateTable { .. })
    }
}

/// Runs a catalog command ([`KvCommand::is_catalog`]).
async fn catalog(client: &Client, command: KvCommand) -> Result<ExitCode> {
    match command {
        KvCommand::Tables => {
            let tables = client
                .list_tables()
                .await
                .map_err(|s| failed("list tables", &s))?;
            // "capacity", not "records": a column of records read as how many the
            // table holds, 16384 in a table holding two.
            println!("table\tcapacity\tvalue cap\tpartitions");
            for t in tables {
                println!(
                    "{}\t{}\t{}\t{}",
                    t.name, t.capacity, t.value_cap, t.partitions
                );
            }
        }
        KvCommand::CreateTable {
            name,
            capacity,
            value_cap,
        } => {
            let t = client
                .create_table(&name, value_cap, capacity)
                .await
                .map_err(|s| failed("create table", &s))?;
            println!(
                "created table {} for {} records of up to {} bytes, in {} partitions",
                t.name, t.capacity, t.value_cap, t.partitions
            );
        }
        other => bail!("`{other:?}` runs in a transaction, not on the catalog"),
    }
    Ok(ExitCode::SUCCESS)
}

/// A small runtime for a command's few RPCs.
pub fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the tokio runtime")
}

/// The cluster file: `--cluster`, else ./cluster.json, else ./namdb-cluster/cluster.json.
fn cluster_file(given: Option<PathBuf>) -> Result<PathBuf> {
    if let Some(path) = given {
        return Ok(path);
    }
    let here = PathBuf::from(CLUSTER_FILE);
    let default = PathBuf::from(DEFAULT_DIR).join(CLUSTER_FILE);
    match [here, default.clone()].into_iter().find(|p| p.exists()) {
        Some(path) => Ok(path),
        None => bail!(
            "no cluster file: neither ./{CLUSTER_FILE} nor ./{} exists; start one with \
             `namdb cluster up` or name it with --cluster",
            default.display()
        ),
    }
}

/// Refuses a scan whose first key (`from_name`) is above its exclusive end (`to_name`):
/// it holds no key, and printing nothing hid the swapped bounds.
pub fn scan_range(
    from: u64,
    to: Option<u64>,
    from_name: &str,
    to_name: &str,
) -> Result<(), String> {
    match to {
        Some(to) if from > to => Err(format!(
            "{from_name} {from} is above {to_name} {to}: the range holds no key (keys from \
             {from_name} up to, not including, {to_name})"
        )),
        _ => Ok(()),
    }
}

/// A value as text when it is printable UTF-8, else as hex (`0x…`): a newline or a
/// tab printed raw would break the one-row-a-line `KEY<TAB>VALUE` output. Text that
/// itself starts with `0x` is shown as hex too, so that output starting with `0x` is
/// always hex: the text `0xff` shows as `0x30786666`, the byte 0xff as `0xff`.
pub fn show(value: &[u8]) -> String {
    match std::str::from_utf8(value) {
        Ok(s) if !s.chars().any(char::is_control) && !s.starts_with("0x") => s.to_string(),
        _ => format!("0x{}", hex::encode(value)),
    }
}

/// Whether the compute node of `client` answers a health check in time (serving or
/// not: it is there).
pub async fn answers(client: &Client) -> bool {
    answers_within(client, ANSWER_WAIT).await
}

/// As [`answers`], giving the node `wait` to answer.
pub async fn answers_within(client: &Client, wait: Duration) -> bool {
    health_check(client, wait).await.is_ok()
}

/// The compute node's health check, waiting `wait` for it: its answer, or why there was
/// none (no answer in time, or an answer refusing us, e.g. a cluster file naming
/// another cluster's token).
async fn health_check(client: &Client, wait: Duration) -> Result<HealthResponse> {
    match tokio::time::timeout(wait, client.health_within(wait)).await {
        Ok(Ok(health)) => Ok(health),
        Ok(Err(s)) => Err(failed("its health check", &s)),
        Err(_) => bail!("it did not answer a health check within {wait:?}"),
    }
}

/// How long a compute node has to answer a health check before the next one is tried:
/// a node that is stopped (SIGSTOP) or wedged still accepts connections. A node whose
/// workers are stuck answers NOT_SERVING within `compute_node::pool::STATS_WAIT` instead.
pub const ANSWER_WAIT: Duration = Duration::from_secs(3);

/// A cluster's compute nodes, to connect to one that answers.
pub struct Nodes {
    file: ClusterFile,
    token: memory_server::ClusterToken,
}

impl Nodes {
    /// The compute nodes of the cluster file (`given`, else found as [`cluster_file`]
    /// says).
    pub fn of(given: Option<PathBuf>) -> Result<Nodes> {
        let path = cluster_file(given)?;
        let file = ClusterFile::read(&path)?;
        let token = file.token()?;
        if file.compute_nodes.is_empty() {
            bail!("{} names no compute node", path.display());
        }
        Ok(Nodes { file, token })
    }

    /// A client of the first compute node that serves (one that died, hangs or cannot
    /// serve leaves the others serving), and the node's name and address; each has
    /// `wait` to answer its health check. When none serves, a node that answered but
    /// is not serving is the one reported, with its reason: "cannot reach" it was
    /// wrong, and the reason (say, a memory server that does not answer) is what to
    /// look at.
    pub async fn connect(&self, wait: Duration) -> Result<(Client, String)> {
        let mut unreachable = None;
        let mut not_serving = None;
        for node in &self.file.compute_nodes {
            let answered = async {
                let client = Client::connect(&node.address, &self.token).await?;
                let health = health_check(&client, wait).await?;
                Ok::<_, anyhow::Error>((client, health))
            };
            match answered.await {
                Ok((client, health)) if health.status() == Health::Serving => {
                    return Ok((client, format!("{} at {}", node.name, node.address)));
                }
                Ok((_, health)) => not_serving = Some((node, health.reason)),
                Err(e) => unreachable = Some((node, e)),
            }
        }
        let others = if self.file.compute_nodes.len() > 1 {
            ", nor any other compute node of the cluster"
        } else {
            ""
        };
        if let Some((node, reason)) = not_serving {
            let reason = if reason.is_empty() {
                "it gave no reason".to_string()
            } else {
                reason
            };
            bail!(
                "{} at {} is up but not serving{others}: {reason} (`namdb cluster status` \
                 shows which processes run)",
                node.name,
                node.address
            );
        }
        let (node, e) = unreachable.expect("a compute node was tried");
        Err(e).with_context(|| {
            format!(
                "cannot reach {} at {}{others} (is the cluster up? `namdb cluster status`)",
                node.name, node.address,
            )
        })
    }
}

/// A runtime, the cluster's compute nodes, and a client of one that answers.
/// Each node has `wait` to answer its health check.
pub fn session(
    given: Option<PathBuf>,
    wait: Duration,
) -> Result<(tokio::runtime::Runtime, Nodes, Client)> {
    let nodes = Nodes::of(given)?;
    let runtime = runtime()?;
    let (client, _) = runtime.block_on(nodes.connect(wait))?;
    Ok((runtime, nodes, client))
}

/// `kv`'s exit status when the command failed, as opposed to 1 for a get of a key that
/// has none, so that a script tells "absent" from "could not tell" (grep's convention).
const FAILED: u8 = 2;

pub fn run(args: KvArgs) -> Result<ExitCode> {
    match run_command(args) {
        Ok(code) => Ok(code),
        Err(e) => {
            eprintln!("{}", crate::error_report(&e));
            let unknown = e.downcast_ref::<OutcomeUnknown>().is_some();
            Ok(ExitCode::from(if unknown { UNKNOWN } else { FAILED }))
        }
    }
}

fn run_command(args: KvArgs) -> Result<ExitCode> {
    if let KvCommand::Scan { from, to, .. } = args.command {
        scan_range(from, to, "--from", "--to").map_err(|e| anyhow::anyhow!(e))?;
    }
    // A --timeout shorter than the health check's wait bounds it too.
    let (runtime, _, client) = session(args.cluster, ANSWER_WAIT.min(args.timeout))?;
    let committing = std::sync::atomic::AtomicBool::new(false);
    runtime.block_on(within(
        args.timeout,
        &committing,
        autocommit_marking(&client, &args.table, args.command, &committing),
    ))
}

/// `call`'s result, or after `timeout` without one a [`NoAnswer`] error, or, when
/// `committing` says the commit was sent (it may finish after we gave up),
/// [`OutcomeUnknown`]. The compute node aborts a transaction given up on once it has
/// been idle for its --txn-timeout.
pub async fn within<T>(
    timeout: Duration,
    committing: &std::sync::atomic::AtomicBool,
    call: impl std::future::Future<Output = Result<T>>,
) -> Result<T> {
    match tokio::time::timeout(timeout, call).await {
        Ok(result) => result,
        Err(_) => {
            let why = NoAnswer(timeout);
            if committing.load(std::sync::atomic::Ordering::Relaxed) {
                return Err(anyhow::Error::new(OutcomeUnknown(why.to_string())));
            }
            Err(anyhow::Error::new(why))
        }
    }
}

/// No answer from the compute node within `--timeout` (this long).
#[derive(Debug)]
pub struct NoAnswer(pub Duration);

impl std::fmt::Display for NoAnswer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "no answer from the compute node within {:?}: it or a memory server may be \
             stopped or overloaded (`namdb cluster status` shows which processes run)",
            self.0
        )
    }
}

impl std::error::Error for NoAnswer {}

/// Runs `command` in a transaction of its own: committed if it succeeds, else aborted;
/// sets `committing` once the commit is sent.
pub async fn autocommit_marking(
    client: &Client,
    table: &str,
    command: KvCommand,
    committing: &std::sync::atomic::AtomicBool,
) -> Result<ExitCode> {
    if command.is_catalog() {
        return catalog(client, command).await;
    }
    let t = client.begin().await.map_err(|s| failed("begin", &s))?;
    match one(client, t, table, command).await {
        Ok(code) => {
            commit_marking(client, t, committing).await?;
            Ok(code)
        }
        Err(e) => {
            // Gone already if the request aborted it.
            let _ = client.abort(t).await;
            // The status says whether the transaction survived the failure, for
            // clients that go on with it; this one was aborted either way.
            Err(anyhow::anyhow!(
                "{}",
                format!("{e:#}").replace("; the transaction is still open", "; aborted")
            ))
        }
    }
}

/// A failed call's error: the status's message and what caused it, which for a
/// connection that failed is where the reason is ("tcp connect error" alone does not say
/// "Connection refused").
pub fn failed(what: &str, s: &Status) -> anyhow::Error {
    anyhow::anyhow!(
        "{what} failed: {} ({:?})",
        memory_server::status_text(s),
        s.code()
    )
}

/// A failed put's error, as [`failed`], saying where a too small value cap comes from.
fn put_failed(table: &str, s: &Status) -> anyhow::Error {
    let e = failed("put", s);
    if s.code() == tonic::Code::InvalidArgument && s.message().contains("value cap") {
        let made_by = if table == DEFAULT_TABLE {
            "`namdb cluster up --value-cap BYTES` sets the `kv` table's (256 unless given)"
        } else {
            "`namdb kv create-table NAME --value-cap BYTES` makes a table with a larger one"
        };
        e.context(format!(
            "table `{}` takes no larger values: a table's value cap is fixed when it is \
             made, and {made_by}",
            txn::echo(table)
        ))
    } else {
        e
    }
}

/// A commit whose outcome nobody can tell: it may have taken effect, so it must never
/// be retried as if it had been aborted (the compute node answers UNKNOWN, or no answer
/// came after it was sent).
#[derive(Debug)]
pub struct OutcomeUnknown(pub String);

impl std::fmt::Display for OutcomeUnknown {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the commit's outcome is unknown: {}; it may have taken effect, so read the \
             key before writing it again",
            self.0
        )
    }
}

impl std::error::Error for OutcomeUnknown {}

/// A failed commit's error: not sent when it failed connecting (nothing can have taken
/// effect), [`OutcomeUnknown`] for UNKNOWN, else as [`failed`].
pub fn commit_failed(s: &Status) -> anyhow::Error {
    if never_sent(s) {
        anyhow::anyhow!(
            "the commit was not sent, so nothing took effect: {}",
            memory_server::status_text(s)
        )
    } else if s.code() == tonic::Code::Unknown {
        anyhow::Error::new(OutcomeUnknown(memory_server::status_text(s)))
    } else {
        failed("commit", s)
    }
}

/// Whether the call failed opening a connection to the compute node: the request was
/// never written, unlike a failure of a connection it may have gone out on.
fn never_sent(s: &Status) -> bool {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(s);
    while let Some(e) = cause {
        if e.downcast_ref::<tonic::ConnectError>().is_some() {
            return true;
        }
        cause = e.source();
    }
    false
}

/// Commits `t`, failing as [`commit_failed`] says, and setting `committing` just
/// before the commit is sent: a timeout before that (the health check on a stopped
/// node) left the outcome known.
pub async fn commit_marking(
    client: &Client,
    t: Txn,
    committing: &std::sync::atomic::AtomicBool,
) -> Result<()> {
    // Between calls nothing reads a connection on this current-thread runtime (the
    // shell waits for its next line), so one the compute node closed by dying is not
    // known to be closed: the commit would be written into it and fail as any broken
    // connection does, not telling whether it was sent. The health check meets that
    // failure instead, and the commit goes out on a new connection, whose refusal says
    // for certain that it was not sent. Its own failure is the commit's to report.
    let _ = answers(client).await;
    committing.store(true, std::sync::atomic::Ordering::Relaxed);
    client.commit(t).await.map_err(|s| commit_failed(&s))?;
    Ok(())
}

/// `kv`'s exit status when a commit's outcome is unknown.
const UNKNOWN: u8 = 3;

/// Runs `command` in `t`; `Ok(1)` for a get of a key that has none.
pub async fn one(client: &Client, t: Txn, table: &str, command: KvCommand) -> Result<ExitCode> {
    match command {
        KvCommand::Get { key } => match client.get(t, table, key).await {
            Ok(Some(value)) => println!("{}", show(&value)),
            Ok(None) => {
                eprintln!("not found: key {key} in table {}", txn::echo(table));
                return Ok(ExitCode::from(1));
            }
            Err(s) => return Err(failed("get", &s)),
        },
        KvCommand::Put { key, value, hex } => {
            let bytes = if hex {
                let digits = value.strip_prefix("0x").unwrap_or(&value);
                hex::decode(digits).with_context(|| {
                    format!(
                        "--hex: `{}` is not hex (two digits a byte, e.g. 00ff10)",
                        txn::echo(&value)
                    )
                })?
            } else {
                value.into_bytes()
            };
            client
                .put(t, table, key, bytes)
                .await
                .map_err(|s| put_failed(table, &s))?
        }
        KvCommand::Delete { key } => client
            .delete(t, table, key)
            .await
            .map_err(|s| failed("delete", &s))?,
        KvCommand::Scan { from, to, limit } => {
            let mut stream = client
                .scan_stream(t, table, from, to, limit)
                .await
                .map_err(|s| failed("scan", &s))?;
            while let Some(batch) = stream.next().await {
                for row in batch.map_err(|s| failed("scan", &s))?.rows {
                    println!("{}\t{}", row.key, show(&row.value));
                }
            }
        }
        KvCommand::Tables | KvCommand::CreateTable { .. } => {
            bail!("listing or creating tables does not run inside a transaction: run it on its own")
        }
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_that_is_not_a_number_is_told_what_a_key_is() {
        use clap::Parser;
        for args in [
            &["namdb", "kv", "get", "apple"][..],
            &["namdb", "kv", "put", "-1", "x"],
            &["namdb", "kv", "delete", "99999999999999999999"],
            &["namdb", "kv", "scan", "--from", "a"],
            &["namdb", "kv", "scan", "--to", "1.5"],
        ] {
            let e = crate::Cli::try_parse_from(args).expect_err("not a key");
            let said = e.render().to_string();
            assert!(
                said.contains(
                    "is not a key: keys are whole numbers from 0 to 18446744073709551614"
                ),
                "{args:?}: {said}"
            );
        }
        // u64::MAX is no key, but it is a scan's bound.
        for args in [
            &["namdb", "kv", "get", "18446744073709551615"][..],
            &["namdb", "kv", "put", "18446744073709551615", "v"],
            &["namdb", "kv", "delete", "18446744073709551615"],
        ] {
            let e = crate::Cli::try_parse_from(args).expect_err("reserved");
            let said = e.render().to_string();
            assert!(
                said.contains(
                    "`18446744073709551615` is reserved (u64::MAX): keys are whole numbers \
                     from 0 to 18446744073709551614"
                ),
                "{args:?}: {said}"
            );
        }
        assert_eq!(parse_key("18446744073709551614"), Ok(u64::MAX - 1));
        assert_eq!(parse_bound("18446744073709551615"), Ok(u64::MAX));
        let scan =
            crate::Cli::try_parse_from(["namdb", "kv", "scan", "--to", "18446744073709551615"]);
        assert!(
            scan.is_ok(),
            "{:?}",
            scan.err().map(|e| e.render().to_string())
        );
        // A value that looks like a negative number is a value, not a flag.
        let put = crate::Cli::try_parse_from(["namdb", "kv", "put", "7", "-1"]);
        assert!(
            put.is_ok(),
            "{:?}",
            put.err().map(|e| e.render().to_string())
        );
        assert_eq!(parse_key("0"), Ok(0));
    }

    #[test]
    fn a_value_over_the_cap_says_where_the_cap_comes_from() {
        let too_large =
            txn::TxnError::Layout(txn::layout::LayoutError::ValueTooLarge { len: 300, cap: 256 });
        let s = Status::invalid_argument(too_large.to_string());
        let report = crate::error_report(&put_failed("kv", &s));
        assert!(
            report.contains("300 bytes") && report.contains("--value-cap"),
            "{report}"
        );
        let other = crate::error_report(&put_failed("kv", &Status::invalid_argument("no table")));
        assert!(!other.contains("--value-cap"), "{other}");
        let made = crate::error_report(&put_failed("other", &s));
        assert!(made.contains("kv create-table NAME --value-cap"), "{made}");
        // A table name is shown bounded, however long it is.
        let long = crate::error_report(&put_failed(&"t".repeat(10_000), &s));
        assert!(
            long.len() < 1_000 && long.contains("(10000 bytes)"),
            "{long}"
        );
    }

    #[test]
    fn an_unknown_commit_is_told_apart_from_a_failed_one() {
        let unknown = commit_failed(&Status::unknown(
            "commit 7 is committed, but the mark failed",
        ));
        let told = unknown.downcast_ref::<OutcomeUnknown>().expect("unknown");
        assert!(
            told.to_string().starts_with(
                "the commit's outcome is unknown: commit 7 is committed, but the mark failed; \
                 it may have taken effect"
            ),
            "{told}"
        );
        let aborted = commit_failed(&Status::aborted("conflict on table kv key 7"));
        assert!(aborted.downcast_ref::<OutcomeUnknown>().is_none());
        assert_eq!(
            aborted.to_string(),
            "commit failed: conflict on table kv key 7 (Aborted)"
        );
    }

    #[test]
    fn values_show_as_text_or_hex() {
        assert_eq!(show(b"hello"), "hello");
        assert_eq!(show(&[0xff, 0x00, 0x10]), "0xff0010");
        assert_eq!(show(b""), "");
        assert_eq!(show("naïve café".as_bytes()), "naïve café");
        assert_eq!(show(b"two\nlines"), "0x74776f0a6c696e6573");
        assert_eq!(show(b"a\tb"), "0x610962");
        assert_eq!(show(b"\x01"), "0x01");
    }

    #[test]
    fn text_that_looks_like_hex_is_not_shown_as_the_bytes_it_spells() {
        assert_eq!(show(&[0xff]), "0xff");
        assert_eq!(show(b"0xff"), "0x30786666");
        assert_ne!(show(b"0xff"), show(&[0xff]));
        assert_eq!(show(b"0x"), "0x3078");
        // Only the prefix the output uses is ambiguous.
        assert_eq!(show(b"0XFF"), "0XFF");
        assert_eq!(show(b"ff"), "ff");
        assert_eq!(show(b"x0xff"), "x0xff");
    }

    #[test]
    fn a_named_cluster_file_wins() {
        let path = PathBuf::from("/somewhere/cluster.json");
        assert_eq!(cluster_file(Some(path.clone())).unwrap(), path);
    }
}
