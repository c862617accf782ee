//! `namdb bench txn --cluster FILE`: the same closed-loop workloads as the embedded
//! benchmark (`super::txn`), driven through the gRPC API of a `namdb cluster up`
//! cluster's compute nodes, so the figures include the API, the compute node's worker
//! pool and the network stack.
//!
//! `--threads` tokio worker threads run `--threads` × `--coroutines` clients as tasks;
//! each has its own connection (a `compute_node::client::Client`, so its own session:
//! it begins after its own last commit, as the embedded clients do) to one compute node,
//! round robin over the file's nodes. An ABORTED transaction counts as a conflict, or
//! as snapshot-too-old when the status says so, and is not retried. Only `ycsb` and
//! `bank` run here: list-append's value is only meaningful with `--history`, and a
//! history needs the versions reads saw, which the API does not return.

use super::txn::{
    KeyPicker, Report, Tally, TxnArgs, Workload, counter, initial_value, value_cap, warmup,
};
use crate::cluster_cmd::ClusterFile;
use anyhow::{Context, Result, anyhow, bail, ensure};
use compute_node::client::Client;
use memory_server::ClusterToken;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tonic::{Code, Status};

/// The benchmark's table for `workload`; created (and loaded) through the API if
/// missing. Each workload has its own: a bank run on ycsb's table would move money
/// between counters (all zero balances with `--value-size 8`, so its invariant held
/// trivially), and one refused for ycsb's 64-byte values sent the user to a fresh
/// cluster only to run the other workload.
fn table(workload: Workload) -> &'static str {
    match workload {
        Workload::Bank => "bench_bank",
        Workload::Ycsb | Workload::ListAppend => "bench",
    }
}

/// Keys inserted per loading transaction: its writes must fit the worker's transaction
/// buffer (txn's default scratch of 256 KiB), which 32 blocks of a 64 KiB value would
/// not, so fewer for large values.
fn keys_per_load_txn(args: &TxnArgs) -> u64 {
    (128 * 1024 / (value_cap(args) as u64 * 4 + 256)).clamp(1, 32)
}

pub fn run(args: &TxnArgs, file: &Path) -> Result<Report> {
    ensure!(
        args.workload != Workload::ListAppend,
        "--cluster runs ycsb and bank; list-append is only checked with --history, which \
         --cluster cannot record (the API does not return the versions reads saw)"
    );
    ensure!(
        !args.no_wait_visible,
        "--no-wait-visible applies to the embedded cluster only: a compute node's commits \
         always wait until they are visible; run without --cluster"
    );
    ensure!(
        args.history.is_none(),
        "--history cannot be recorded through gRPC (the API does not return the versions \
         reads saw); run without --cluster"
    );
    let largest = txn::Options::default()
        .largest_value_cap(txn::TableSpec::new(table(args.workload), 8, 1).versions);
    ensure!(
        value_cap(args) <= largest,
        "--value-size {} is too large for --cluster: a compute node's transaction holds values \
         of up to {largest} bytes",
        value_cap(args)
    );
    let cluster = ClusterFile::read(file)?;
    ensure!(
        !cluster.compute_nodes.is_empty(),
        "{} lists no compute node",
        file.display()
    );
    let token = cluster.token()?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(args.threads as usize)
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    runtime.block_on(drive(args.clone(), cluster, token))
}

async fn connect(addr: &str, token: &ClusterToken) -> Result<Client> {
    Client::connect(addr, token)
        .await
        .with_context(|| format!("cannot reach the compute node at {addr}"))
}

async fn drive(args: TxnArgs, cluster: ClusterFile, token: ClusterToken) -> Result<Report> {
    let first = connect(&cluster.compute_nodes[0].address, &token).await?;
    prepare(&first, &args).await?;
    let total_before = match args.workload {
        Workload::Bank => Some(bank_total(&first, &args).await?),
        _ => None,
    };

    let clients = (args.threads * args.coroutines) as usize;
    let mut sessions = Vec::with_capacity(clients);
    for i in 0..clients {
        let node = &cluster.compute_nodes[i % cluster.compute_nodes.len()];
        sessions.push(connect(&node.address, &token).await?);
    }
    let args = Arc::new(args);
    let picker = Arc::new(KeyPicker::new(&args)?);
    let duration = Duration::from_secs_f64(args.duration);
    let warmup = warmup(duration);
    // Every client is connected before the clock starts.
    let start = Instant::now();
    let tasks: Vec<_> = sessions
        .into_iter()
        .enumerate()
        .map(|(session, client)| {
            let (args, picker) = (args.clone(), picker.clone());
            tokio::spawn(async move {
                closed_loop(
                    &client,
                    &args,
                    &picker,
                    session as u64,
                    start + warmup,
                    start + duration,
                )
                .await
            })
        })
        .collect();
    let mut total = Tally::new()?;
    for (session, t) in tasks.into_iter().enumerate() {
        let node = &cluster.compute_nodes[session % cluster.compute_nodes.len()];
        let tally = t
            .await
            .context("a client task panicked")?
            .with_context(|| {
                format!(
                    "client {session} of {} at {} (is it running? `namdb cluster status`)",
                    node.name, node.address
                )
            })?;
        total.add(&tally)?;
    }
    let invariant_ok = match total_before {
        Some(before) => Some(bank_total(&first, &args).await? == before),
        None => None,
    };
    Ok(total.report(
        &args,
        format!("grpc:{}", cluster.backend.name()),
        cluster.memory_servers.len() as u32,
        (duration - warmup).as_secs_f64(),
        false,
        invariant_ok,
    ))
}

/// Creates and loads the table, or checks that an existing one fits the arguments.
async fn prepare(client: &Client, args: &TxnArgs) -> Result<()> {
    let table = table(args.workload);
    let tables = client.list_tables().await.context("listing the tables")?;
    if let Some(t) = tables.iter().find(|t| t.name == table) {
        if t.value_cap != value_cap(args) {
            match args.workload {
                Workload::Bank => bail!(
                    "table {table} exists with values of {} bytes, not bank's 8-byte \
                     balances: use a fresh cluster",
                    t.value_cap
                ),
                _ => bail!(
                    "table {table} exists with values of {} bytes, not the {} of \
                     --value-size: use --value-size {} (as it was loaded with) or a fresh \
                     cluster",
                    t.value_cap,
                    value_cap(args),
                    t.value_cap
                ),
            }
        }
        // The last chunk is loaded last but for the loader's 16 in flight, so it is a
        // quick test of a complete load; without it, the load was interrupted or had
        // fewer --keys, and finishing it is what the run needs.
        let txn = client.begin().await?;
        let last = client.get(txn, table, args.keys - 1).await?;
        client.commit(txn).await?;
        if last.is_some() {
            eprintln!("using the existing table {table}");
            return Ok(());
        }
        ensure!(
            t.capacity >= args.keys,
            "table {table} exists with room for {} keys, not the {} of --keys: use a fresh \
             cluster (or at most the --keys it was made for)",
            t.capacity,
            args.keys
        );
        eprintln!(
            "table {table} exists without key {} (an interrupted load, or fewer --keys): \
             loading the missing keys",
            args.keys - 1
        );
        return load(client, args, Resume::SomeKeysLoaded).await;
    }
    // As the embedded benchmark's table: every key, with an eighth to spare.
    client
        .create_table(table, value_cap(args), args.keys + args.keys / 8 + 64)
        .await
        .with_context(|| format!("creating the table {table}"))?;
    load(client, args, Resume::EmptyTable).await
}

/// Whether [`load`] may find keys already there.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Resume {
    EmptyTable,
    /// Each chunk inserts only the keys it does not find: an earlier load with fewer
    /// --keys ended in a partial chunk, so a chunk is not all there or all missing.
    SomeKeysLoaded,
}

/// Inserts every key, 16 transactions in flight.
async fn load(client: &Client, args: &TxnArgs, resume: Resume) -> Result<()> {
    let started = Instant::now();
    let per_txn = keys_per_load_txn(args);
    let chunks = args.keys.div_ceil(per_txn);
    let next = Arc::new(AtomicU64::new(0));
    let value = initial_value(args);
    let table = table(args.workload);
    let loaders: Vec<_> = (0..16)
        .map(|_| {
            let (client, next, value, keys) =
                (client.clone(), next.clone(), value.clone(), args.keys);
            tokio::spawn(async move {
                loop {
                    let chunk = next.fetch_add(1, Ordering::Relaxed);
                    if chunk >= chunks {
                        return Ok::<(), Status>(());
                    }
                    let txn = client.begin().await?;
                    let range: Vec<u64> =
                        (chunk * per_txn..((chunk + 1) * per_txn).min(keys)).collect();
                    let present = match resume {
                        Resume::EmptyTable => vec![None; range.len()],
                        Resume::SomeKeysLoaded => client.batch_get(txn, table, &range).await?,
                    };
                    for (&k, found) in range.iter().zip(present) {
                        if found.is_none() {
                            client.insert(txn, table, k, value.clone()).await?;
                        }
                    }
                    client.commit(txn).await?;
                }
            })
        })
        .collect();
    for l in loaders {
        l.await
            .context("a loader task panicked")?
            .context("loading the keys")?;
    }
    eprintln!(
        "loaded {} keys in {:.2} s",
        args.keys,
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// One client: transactions back to back until `end`, counted from `measure_from`.
async fn closed_loop(
    client: &Client,
    args: &TxnArgs,
    picker: &KeyPicker,
    session: u64,
    measure_from: Instant,
    end: Instant,
) -> Result<Tally> {
    let mut tally = Tally::new()?;
    let mut rng = SmallRng::seed_from_u64(session * 7919 + 17);
    // One clock read per transaction: its end is the next one's start.
    let mut now = Instant::now();
    while now < end {
        let outcome = one_txn(client, args, picker, &mut rng).await;
        let finished = Instant::now();
        let counted = now >= measure_from;
        let began = std::mem::replace(&mut now, finished);
        match outcome {
            Ok(()) if counted => tally.commit(began, finished),
            Ok(()) => {}
            Err(s) if s.code() == Code::Aborted => {
                if counted {
                    // The status message carries txn's error ("snapshot … too old").
                    if s.message().contains("too old") {
                        tally.aborts.snapshot_too_old += 1;
                    } else {
                        tally.aborts.conflict += 1;
                    }
                    tally.aborted += 1;
                }
            }
            Err(s) => {
                return Err(anyhow!(
                    "{} ({:?})",
                    memory_server::status_text(&s),
                    s.code()
                ));
            }
        }
    }
    Ok(tally)
}

/// One transaction of the workload, as `super::txn::one_txn` runs it.
async fn one_txn(
    client: &Client,
    args: &TxnArgs,
    picker: &KeyPicker,
    rng: &mut SmallRng,
) -> Result<(), Status> {
    let table = table(args.workload);
    let txn = client.begin().await?;
    match args.workload {
        Workload::Ycsb => {
            let key = picker.pick(rng);
            let read_only = rng.random_bool(args.read_ratio);
            let value = client
                .get(txn, table, key)
                .await?
                .ok_or_else(|| Status::not_found(format!("key {key} was loaded but is missing")))?;
            if !read_only {
                let n = counter(&value);
                let mut next = value;
                next[..8].copy_from_slice(&(n + 1).to_le_bytes());
                client.put(txn, table, key, next).await?;
            }
        }
        Workload::Bank => {
            let a = picker.pick(rng);
            let mut b = picker.pick(rng);
            if b == a {
                b = (a + 1) % args.keys;
            }
            let values = client.batch_get(txn, table, &[a, b]).await?;
            let (Some(va), Some(vb)) = (&values[0], &values[1]) else {
                return Err(Status::not_found("an account is missing"));
            };
            let (ba, bb) = (counter(va), counter(vb));
            let amount = rng.random_range(1..=10);
            if !rng.random_bool(args.read_ratio) && ba >= amount {
                client
                    .put(txn, table, a, (ba - amount).to_le_bytes().to_vec())
                    .await?;
                client
                    .put(txn, table, b, (bb + amount).to_le_bytes().to_vec())
                    .await?;
            }
        }
        Workload::ListAppend => unreachable!("refused by run"),
    }
    client.commit(txn).await.map(|_| ())
}

/// The sum of all balances, in one snapshot. The invariant compares the sums before
/// and after the run, so an existing table's balances need not be the initial ones.
async fn bank_total(client: &Client, args: &TxnArgs) -> Result<i64> {
    let table = table(args.workload);
    let txn = client.begin().await?;
    let rows = client
        .scan(txn, table)
        .await
        .context("scanning the accounts")?;
    client.commit(txn).await?;
    if rows.iter().any(|(_, v)| v.len() != 8) {
        bail!("table {table} does not hold bank accounts (8-byte balances)");
    }
    Ok(rows.iter().map(|(_, v)| counter(v)).sum())
}
