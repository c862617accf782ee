//! `namdb bench verify`: how long checking a history takes.
//!
//! Generates a valid history by running the list-append workload on the in-memory
//! snapshot-isolation reference store (`verify::mem_store`), sessions interleaved one
//! action at a time so transactions overlap, writes it as JSON Lines, then times
//! `--runs` complete checks of the file exactly as `namdb verify` does them: read and
//! index, white-box, black-box. Reports each run and the median.
//!
//! Without `--history` the file is unlinked from the start (`tempfile::tempfile`): it
//! holds hundreds of megabytes, and an interrupted or killed run must not leave them
//! in the temporary directory.

use anyhow::{Context, Result, bail, ensure};
use clap::Args;
use std::fs::{File, OpenOptions};
use std::io::{BufReader, BufWriter, Seek, Write};
use std::path::PathBuf;
use std::time::{Duration, Instant};
use verify::anomaly::Findings;
use verify::history::JsonlWriter;
use verify::index::load_jsonl;
use verify::mem_store::MemStore;
use verify::recorder::Recorder;
use verify::report::{self, Model, Verdict};
use verify::workload::{self, ListAppend, RunConfig, Schedule};

#[derive(Args, Debug, Clone)]
pub struct VerifyBenchArgs {
    /// Transactions in the generated history.
    #[arg(long, value_name = "N", default_value_t = 1_000_000,
          value_parser = crate::at_least(1u64))]
    pub txns: u64,
    /// Concurrent sessions of the generating workload.
    #[arg(long, value_name = "N", default_value_t = 8,
          value_parser = clap::value_parser!(u64).range(1..=1024))]
    pub sessions: u64,
    /// Timed checks of the history; the median is reported.
    #[arg(long, value_name = "N", default_value_t = 3,
          value_parser = clap::value_parser!(u32).range(1..=100))]
    pub runs: u32,
    /// Seed of the generating workload.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Keep the generated history at FILE (by default an unlinked temporary file).
    #[arg(long, value_name = "FILE")]
    pub history: Option<PathBuf>,
}

struct Timing {
    load: Duration,
    whitebox: Duration,
    blackbox: Duration,
    total: Duration,
}

/// Bytes of JSON Lines per generated transaction, with room to spare: 1 M transactions
/// over 8 sessions wrote 287 MB (more sessions abort more and write less).
const HISTORY_BYTES_PER_TXN: u64 = 320;
/// Peak memory per transaction, with room to spare: checking 1 M peaked at 393 MB
/// resident (the index).
const MEMORY_BYTES_PER_TXN: u64 = 450;

/// Refuses, before anything is written, a history that would not fit on the disk it
/// goes to (`--history`'s directory, else the temporary directory) or whose check
/// would not fit in memory, naming the most transactions that fit.
fn ensure_history_fits(args: &VerifyBenchArgs) -> Result<()> {
    let dir = match &args.history {
        Some(path) => match path.parent() {
            Some(parent) if !parent.as_os_str().is_empty() => parent.to_path_buf(),
            _ => PathBuf::from("."),
        },
        None => std::env::temp_dir(),
    };
    // A directory that cannot be examined is left to the file's creation to report.
    if let Ok(fs) = rustix::fs::statvfs(&dir) {
        let avail = fs.f_bavail.saturating_mul(fs.f_frsize);
        let total = fs.f_blocks.saturating_mul(fs.f_frsize);
        disk_fits(args.txns, avail, total, &dir.display().to_string())?;
    }
    crate::bench::ensure_data_fits(
        &format!("checking a history of {} transactions", args.txns),
        args.txns.saturating_mul(MEMORY_BYTES_PER_TXN),
        args.txns,
        "transactions (--txns)",
    )
}

/// Whether a history of `txns` transactions fits in the `avail` bytes free of a file
/// system of `total` bytes (in `place`), keeping a twentieth of it (at most 1 GiB)
/// free for everything else.
fn disk_fits(txns: u64, avail: u64, total: u64, place: &str) -> Result<()> {
    let need = txns.saturating_mul(HISTORY_BYTES_PER_TXN);
    let keep = (total / 20).min(1 << 30);
    let usable = avail.saturating_sub(keep);
    if need <= usable {
        return Ok(());
    }
    bail!(
        "a history of {txns} transactions needs about {} MiB on disk, but {place} has {} MiB \
         free (and {} MiB of it is kept free): use at most about --txns {}",
        need >> 20,
        avail >> 20,
        keep >> 20,
        usable / HISTORY_BYTES_PER_TXN
    )
}

pub fn run(args: &VerifyBenchArgs) -> Result<()> {
    ensure_history_fits(args)?;
    let (file, name) = match &args.history {
        Some(path) => (
            OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .open(path)
                .with_context(|| format!("cannot create {}", path.display()))?,
            path.display().to_string(),
        ),
        None => (
            tempfile::tempfile().context("cannot create a temporary file for the history")?,
            "an unlinked temporary file".to_string(),
        ),
    };
    let bytes = generate(args, &file, &name)?;
    measure(args, &file, &name, bytes)
}

/// Writes the history to `file`; returns its size in bytes.
fn generate(args: &VerifyBenchArgs, file: &File, name: &str) -> Result<u64> {
    eprintln!(
        "generating {} transactions over {} sessions into {name}…",
        args.txns, args.sessions,
    );
    let started = Instant::now();
    let recorder = Recorder::new(JsonlWriter::new(BufWriter::with_capacity(1 << 20, file)));
    let config = RunConfig {
        sessions: args.sessions as usize,
        txns: args.txns,
        seed: args.seed,
        schedule: Schedule::Interleaved,
    };
    let outcome = workload::run(&MemStore::new(), &ListAppend::default(), &recorder, &config)?;
    recorder
        .into_sink()
        .into_inner()
        .flush()
        .with_context(|| format!("cannot write {name}"))?;
    let bytes = file
        .metadata()
        .with_context(|| format!("cannot read the size of {name}"))?
        .len();
    eprintln!(
        "generated in {:.1} s: {} committed, {} aborted; {:.0} MB",
        started.elapsed().as_secs_f64(),
        outcome.committed,
        outcome.aborted,
        bytes as f64 / 1e6
    );
    Ok(bytes)
}

fn measure(args: &VerifyBenchArgs, mut file: &File, name: &str, bytes: u64) -> Result<()> {
    let mut timings = Vec::with_capacity(args.runs as usize);
    for run in 1..=args.runs {
        let started = Instant::now();
        file.rewind()
            .with_context(|| format!("cannot read back {name}"))?;
        let index = load_jsonl(
            BufReader::with_capacity(1 << 20, file),
            Findings::DEFAULT_EXAMPLES,
        )
        .with_context(|| format!("cannot read back {name}"))?;
        let load = started.elapsed();
        let report = report::check(&index, Model::SnapshotIsolation);
        let total = started.elapsed();
        if report.verdict() != Verdict::Valid {
            bail!("the reference store's history did not check as valid:\n{report}");
        }
        ensure!(
            report.whitebox.is_ok(),
            "the white-box checker did not run: {:?}",
            report.whitebox
        );
        let timing = Timing {
            load,
            whitebox: report.whitebox_time,
            blackbox: report.blackbox_time,
            total,
        };
        println!(
            "run {run}: {:.2} s (read and index {:.2} s, white-box {:.2} s, black-box {:.2} s); \
             {} dependency edges, {} cyclic components (all G2)",
            timing.total.as_secs_f64(),
            timing.load.as_secs_f64(),
            timing.whitebox.as_secs_f64(),
            timing.blackbox.as_secs_f64(),
            report.blackbox.edges,
            report.blackbox.components
        );
        timings.push(timing);
    }
    timings.sort_by_key(|t| t.total);
    let median = &timings[timings.len() / 2];
    println!(
        "verify: {} transactions ({:.0} MB of JSON Lines) checked in {:.2} s median of {} \
         ({:.0} transactions/s)",
        args.txns,
        bytes as f64 / 1e6,
        median.total.as_secs_f64(),
        args.runs,
        args.txns as f64 / median.total.as_secs_f64()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_history_larger_than_the_free_disk_is_refused_naming_what_fits() {
        const GIB: u64 = 1 << 30;
        // 1 M transactions on a 100 GiB disk with 10 GiB free.
        assert!(disk_fits(1_000_000, 10 * GIB, 100 * GIB, "/tmp").is_ok());
        let e = disk_fits(u64::MAX, 10 * GIB, 100 * GIB, "/tmp")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("needs about 17592186044415 MiB on disk, but /tmp has 10240 MiB free"),
            "{e}"
        );
        // 9 GiB usable, a GiB kept free.
        assert!(
            e.ends_with(&format!("use at most about --txns {}", 9 * GIB / 320)),
            "{e}"
        );
        let fits = 9 * GIB / HISTORY_BYTES_PER_TXN;
        assert!(disk_fits(fits, 10 * GIB, 100 * GIB, "/tmp").is_ok());
        assert!(disk_fits(fits + 1, 10 * GIB, 100 * GIB, "/tmp").is_err());
        // A small file system keeps a twentieth free.
        assert!(disk_fits(1000, 5 << 20, 100 << 20, "/small").is_err());
        assert!(disk_fits(1000, 6 << 20, 100 << 20, "/small").is_ok());
    }
}
