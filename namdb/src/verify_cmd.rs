//! `namdb verify FILE.jsonl`: checks a recorded history and prints the verdict, the
//! anomalies with explained examples, and counts.
//!
//! Exit status: 0 valid, 1 the history violates the model, 2 the history could not be
//! read (the message names the line) or holds no transaction, 3 inconclusive: nothing forbidden was found, but
//! part of the history could not be checked (a cycle search ran out of budget, or
//! register reads without timestamps, which only their values could be checked for).

use anyhow::{Context, Result};
use clap::{Args, ValueEnum};
use std::fs::File;
use std::io::{self, BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;
use verify::index::{HistoryIndex, load_jsonl};
use verify::report::{self, Model, Verdict};

#[derive(Args, Debug)]
pub struct VerifyArgs {
    /// The history: JSON Lines, one transaction per line (`-` reads standard input).
    #[arg(value_name = "FILE.jsonl")]
    pub file: PathBuf,
    /// The consistency model to check against.
    #[arg(long, value_enum, default_value_t = ModelArg::Si)]
    pub model: ModelArg,
    /// Explained examples to print per kind of anomaly.
    #[arg(long, value_name = "N", default_value_t = 3)]
    pub examples: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ModelArg {
    /// Snapshot isolation: write skew (G2) allowed, everything else forbidden.
    Si,
}

impl ModelArg {
    fn model(self) -> Model {
        match self {
            ModelArg::Si => Model::SnapshotIsolation,
        }
    }
}

const EXIT_INVALID: u8 = 1;
const EXIT_UNREADABLE: u8 = 2;
const EXIT_INCONCLUSIVE: u8 = 3;

pub fn run(args: &VerifyArgs) -> ExitCode {
    let started = Instant::now();
    let index = match load(args) {
        Ok(index) => index,
        Err(e) => {
            eprintln!("error: {e:#}");
            return ExitCode::from(EXIT_UNREADABLE);
        }
    };
    let loaded = started.elapsed();
    let report = report::check(&index, args.model.model());
    let mut out = io::stdout().lock();
    // A closed stdout (e.g. `| head`) must not hide the verdict in the exit status.
    let _ = write!(out, "{report}");
    let _ = writeln!(
        out,
        "checked in {:.2} s (reading and indexing {:.2} s)",
        started.elapsed().as_secs_f64(),
        loaded.as_secs_f64()
    );
    match report.verdict() {
        Verdict::Valid => ExitCode::SUCCESS,
        Verdict::Invalid => ExitCode::from(EXIT_INVALID),
        Verdict::Inconclusive => ExitCode::from(EXIT_INCONCLUSIVE),
    }
}

fn load(args: &VerifyArgs) -> Result<HistoryIndex> {
    let input: Box<dyn BufRead> = if args.file.as_os_str() == "-" {
        Box::new(io::stdin().lock())
    } else {
        let file = File::open(&args.file)
            .with_context(|| format!("cannot open {}", args.file.display()))?;
        // Opening a directory succeeds; reading it then failed as "line 1: Is a
        // directory", as if the history were broken.
        anyhow::ensure!(
            !file.metadata().is_ok_and(|m| m.is_dir()),
            "{} is a directory; expected a history file (JSON lines, one transaction a \
             line)",
            args.file.display()
        );
        Box::new(BufReader::with_capacity(1 << 20, file))
    };
    let index = load_jsonl(input, args.examples)
        .with_context(|| format!("{} is not a usable history", args.file.display()))?;
    // An empty history passes every check vacuously: a wrong path or an unflushed
    // recording must not read as "valid".
    anyhow::ensure!(
        index.stats().txns > 0,
        "{} holds no transactions: there is nothing to check",
        args.file.display()
    );
    Ok(index)
}
