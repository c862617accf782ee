//! `namdb bench …`: benchmarks, one module per subject.

pub mod aggregate;
pub mod duckdb;
mod fabric;
pub mod join;
pub mod nodes;
pub mod plot;
pub mod shuffle;
mod timestamp;
mod txn;
mod txn_grpc;
mod verify;

use anyhow::{Context, Result, bail};
use clap::Subcommand;
use serde::Serialize;
use std::fs::{self, File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::str::FromStr;

#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// Latency and throughput of every verb on a fabric backend, next to this
    /// machine's memcpy bandwidth.
    Fabric(self::fabric::FabricArgs),
    /// Time checking a generated history of N transactions with `namdb verify`'s
    /// checkers (median of several runs).
    Verify(self::verify::VerifyBenchArgs),
    /// The bit-vector timestamp oracle: marked commits/s, read timestamps/s, bytes
    /// READ per read timestamp and prefix lag.
    Timestamp(self::timestamp::TimestampArgs),
    /// RSI transactions on an embedded cluster (ycsb, bank or list-append): txn/s,
    /// aborts by reason, latency.
    Txn(self::txn::TxnArgs),
    /// The shuffle microbenchmark (TODS 2019 §7.1): each node repartitions or
    /// broadcasts its fragment of R(a, b) with one of the eight endpoint designs, next
    /// to a TCP sockets and an OpenMPI baseline and memcpy, every run verified.
    Shuffle(self::shuffle::ShuffleArgs),
    /// Distributed joins (VLDB 2016 §5): GHJ, GHJ with a Bloom filter, RDMA GHJ and the
    /// RDMA radix join against the Bloom filter's selectivity, with the paper's cost
    /// model and DuckDB on the same data.
    Join(self::join::JoinArgs),
    /// Distributed GROUP BY against the number of groups: Two Phase, Repartitioning,
    /// the adaptive and sampling variants and RDMA AGG, next to DuckDB, verified.
    Aggregate(self::aggregate::AggregateArgs),
}

pub fn run(cmd: BenchCommand) -> Result<()> {
    match cmd {
        BenchCommand::Fabric(args) => self::fabric::run(&args),
        BenchCommand::Verify(args) => self::verify::run(&args),
        BenchCommand::Timestamp(args) => self::timestamp::run(&args),
        BenchCommand::Txn(args) => self::txn::run(&args),
        BenchCommand::Shuffle(args) => self::shuffle::run(&args),
        BenchCommand::Join(args) => self::join::run(&args),
        BenchCommand::Aggregate(args) => self::aggregate::run(&args),
    }
}

/// What a run made at a path it claimed (an output file, or the outermost directory
/// it had to create): removed if a Ctrl-C ends the run before [`Self::keep`], and by
/// [`Self::discard`] if the run fails, so nothing empty stays where results were
/// expected. Nothing is removed of what existed before the run.
struct Created {
    /// The path this run created, if it created one.
    path: Option<PathBuf>,
    on_interrupt: std::sync::Mutex<Option<crate::interrupt::Registered>>,
}

impl Created {
    fn new(path: Option<PathBuf>) -> Result<Created> {
        let on_interrupt = path
            .as_deref()
            .map(crate::interrupt::remove_on_interrupt)
            .transpose()?;
        Ok(Created {
            path,
            on_interrupt: std::sync::Mutex::new(on_interrupt),
        })
    }

    /// The results are in: keep what was created whatever happens next.
    fn keep(&self) {
        self.on_interrupt
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
    }

    /// Removes what this run created: for a run that failed.
    fn discard(&self) {
        if let Some(path) = &self.path {
            // Best effort: the run's own error is what the user needs to see.
            let _ = if path.is_dir() {
                fs::remove_dir_all(path)
            } else {
                fs::remove_file(path)
            };
        }
    }
}

/// An output file a run claims when it starts and fills when it ends (`--json`, a
/// sweep's `--svg`): opened, created if need be, without truncating, so a bad path
/// fails at once, not after a long run, and a failed run leaves earlier results in
/// place. A file this run created is removed if the run fails ([`Self::discard`]) or a
/// Ctrl-C ends it before the file is kept ([`Self::keep`]): otherwise an empty file
/// stays where results were expected.
pub struct OutputFile {
    path: PathBuf,
    file: File,
    created: Created,
}

impl OutputFile {
    /// Claims `path`; `what` names it in the error ("JSON output file").
    pub fn claim(path: &Path, what: &str) -> Result<OutputFile> {
        let existed = path.exists();
        let file = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .with_context(|| format!("cannot open {what} {}", path.display()))?;
        Ok(OutputFile {
            path: path.to_owned(),
            file,
            created: Created::new((!existed).then(|| path.to_owned()))?,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The file holds results now: keep it whatever happens next.
    pub fn keep(&self) {
        self.created.keep();
    }

    /// Removes the file if this run created it: for a run that failed.
    pub fn discard(&self) {
        self.created.discard();
    }
}

/// A `--json` output file: checked when the run starts, written when it ends.
pub struct JsonOut(OutputFile);

impl JsonOut {
    /// Claims `path` ([`OutputFile::claim`]).
    pub fn open(path: &Path) -> Result<JsonOut> {
        OutputFile::claim(path, "JSON output file").map(JsonOut)
    }

    /// [`Self::open`] for an optional `--json`.
    pub fn open_opt(path: Option<&Path>) -> Result<Option<JsonOut>> {
        path.map(JsonOut::open).transpose()
    }

    pub fn path(&self) -> &Path {
        self.0.path()
    }

    /// Replaces the file's contents with `value`, pretty-printed.
    pub fn write<T: Serialize + ?Sized>(&self, value: &T) -> Result<()> {
        let context = || format!("cannot write JSON output file {}", self.path().display());
        self.0.file.set_len(0).with_context(context)?;
        let mut out = BufWriter::new(&self.0.file);
        serde_json::to_writer_pretty(&mut out, value).with_context(context)?;
        out.write_all(b"\n").with_context(context)?;
        out.flush().with_context(context)?;
        self.0.keep();
        Ok(())
    }

    /// Removes the file if this run created it: for a run that failed.
    pub fn discard(&self) {
        self.0.discard();
    }

    /// `result`, after discarding `out` if it is an error.
    pub fn unless_failed<T>(out: Option<&JsonOut>, result: Result<T>) -> Result<T> {
        if let (Err(_), Some(out)) = (&result, out) {
            out.discard();
        }
        result
    }
}

/// A `--svg` directory: created when the run starts, so a bad path fails at once, not
/// after a long run. What this run created (the directory, and any parents it had to
/// make) is removed again if the run fails ([`Self::unless_failed`]) or a Ctrl-C ends
/// it before the figures are drawn ([`Self::keep`]), as [`OutputFile`] does for a
/// file: otherwise an empty directory stays where figures were expected.
pub struct SvgDir {
    path: PathBuf,
    /// The outermost directory this run created, if it created any.
    created: Created,
}

impl SvgDir {
    pub fn claim(path: &Path) -> Result<SvgDir> {
        let outermost_new = path
            .ancestors()
            .take_while(|a| !a.as_os_str().is_empty() && !a.exists())
            .last()
            .map(Path::to_path_buf);
        fs::create_dir_all(path)
            .with_context(|| format!("cannot create the SVG directory {}", path.display()))?;
        Ok(SvgDir {
            path: path.to_owned(),
            created: Created::new(outermost_new)?,
        })
    }

    /// [`Self::claim`] for an optional `--svg`.
    pub fn claim_opt(path: Option<&Path>) -> Result<Option<SvgDir>> {
        path.map(SvgDir::claim).transpose()
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The figures are in: keep the directory whatever happens next.
    pub fn keep(&self) {
        self.created.keep();
    }

    /// `result`, after removing what this run created if it is an error.
    pub fn unless_failed<T>(dir: Option<&SvgDir>, result: Result<T>) -> Result<T> {
        if let (Err(_), Some(dir)) = (&result, dir) {
            dir.created.discard();
        }
        result
    }
}

/// Refuses, before anything is generated, a run whose data alone would not fit in the
/// memory this host has available (less [`::fabric::HostMemory::reserve`]): it would
/// end in an allocation failure or the kernel's OOM killer, with nothing reported.
/// `need` is the run's estimated peak in bytes for `units` of what the user chose
/// (`unit` names it, e.g. "tuples per node").
pub fn ensure_data_fits(what: &str, need: u64, units: u64, unit: &str) -> Result<()> {
    let Some(host) = ::fabric::HostMemory::now() else {
        return Ok(());
    };
    let usable = host.spare();
    if need <= usable {
        return Ok(());
    }
    let fitting = (units as f64 * usable as f64 / need as f64) as u64;
    bail!(
        "{what} needs about {} MiB of memory, but this host has {} MiB available \
         (and keeps {} MiB free): use at most about {fitting} {unit}",
        need >> 20,
        host.available >> 20,
        host.reserve() >> 20,
    )
}

/// Which of `runs` (each run's time) is the median: the lower median of an even
/// count, so that a reported median is a run that happened and all its figures (phase
/// times, setup, counts) can come from that one run. The mean of the two middle runs
/// was no run: its phase times, each a mean of its own, did not sum to it. `None` for
/// no runs.
pub fn median_run(runs: &[f64]) -> Option<usize> {
    let mut order: Vec<usize> = (0..runs.len()).collect();
    order.sort_by(|&a, &b| runs[a].total_cmp(&runs[b]));
    order.get(runs.len().saturating_sub(1) / 2).copied()
}

/// Refuses a `--flag` list that names an entry twice (`show` names it): a repeat was
/// once dropped silently, so the run was not the one asked for (a user who listed a
/// join twice to run it twice got it once). No bench list means anything by a
/// repeat: each is a set of runs, printed in the order given.
pub fn refuse_repeats<T: PartialEq>(
    flag: &str,
    items: &[T],
    show: impl Fn(&T) -> String,
) -> Result<()> {
    for (i, item) in items.iter().enumerate() {
        if items[..i].contains(item) {
            bail!("--{flag} lists {} twice", show(item));
        }
    }
    Ok(())
}

/// The name a `--flag` value is given by on the command line.
pub fn value_name(v: impl clap::ValueEnum) -> String {
    v.to_possible_value()
        .map_or_else(String::new, |p| p.get_name().to_string())
}

/// Parses a comma-separated `--flag` list of names (`all` for every one of `all`),
/// in the order given; an unknown name is an error, even beside `all`, and so is a
/// name given twice (in any spelling that parses to it), or `all` twice.
pub fn parse_names<T>(flag: &str, names: &[String], all: &[T]) -> Result<Vec<T>>
where
    T: FromStr + PartialEq + Copy,
    T::Err: std::error::Error + Send + Sync + 'static,
{
    let mut out = Vec::new();
    let mut every = false;
    for n in names {
        let n = n.trim();
        if n.eq_ignore_ascii_case("all") {
            if every {
                bail!("--{flag} lists all twice");
            }
            every = true;
            continue;
        }
        // The parsers' errors quote the name whole; a user's 10 000 characters are cut.
        let name: T = n.parse().map_err(|e: T::Err| {
            anyhow::anyhow!("--{flag}: {}", e.to_string().replace(n, &::txn::echo(n)))
        })?;
        if out.contains(&name) {
            bail!("--{flag} lists {} twice", ::txn::echo(n));
        }
        out.push(name);
    }
    if every {
        return Ok(all.to_vec());
    }
    if out.is_empty() {
        bail!("--{flag}: none given: name some, or `all`");
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Clone, Copy, Debug, PartialEq)]
    enum Fruit {
        Apple,
        Pear,
    }

    impl FromStr for Fruit {
        type Err = std::io::Error;
        fn from_str(s: &str) -> std::io::Result<Fruit> {
            match s {
                "apple" => Ok(Fruit::Apple),
                "pear" => Ok(Fruit::Pear),
                _ => Err(std::io::Error::other(format!("unknown fruit {s:?}"))),
            }
        }
    }

    fn names(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn names_parse_in_order_and_unknown_or_repeated_ones_are_errors() {
        let all = [Fruit::Apple, Fruit::Pear];
        let parse = |list: &[&str]| parse_names("fruit", &names(list), &all);
        assert_eq!(
            parse(&["pear", " apple"]).unwrap(),
            [Fruit::Pear, Fruit::Apple]
        );
        let err = format!("{:#}", parse(&["pear", " apple", "pear"]).unwrap_err());
        assert_eq!(err, "--fruit lists pear twice");
        let err = format!("{:#}", parse(&["all", "ALL"]).unwrap_err());
        assert_eq!(err, "--fruit lists all twice");
        assert_eq!(parse(&["all"]).unwrap(), all);
        let err = format!("{:#}", parse(&["all", "plum"]).unwrap_err());
        assert!(err.contains("--fruit") && err.contains("plum"), "{err}");
        assert!(parse(&[]).is_err());
        assert!(parse(&[" "]).is_err());
        let long = "plum".repeat(2_500);
        let err = format!("{:#}", parse(&[&long]).unwrap_err());
        assert!(err.contains(&::txn::echo(&long)), "{err}");
        assert!(err.len() < 200, "the name is quoted whole: {err}");
    }

    #[test]
    fn the_median_run_is_a_run_the_lower_middle_one_of_an_even_count() {
        assert_eq!(median_run(&[]), None);
        assert_eq!(median_run(&[5.0]), Some(0));
        assert_eq!(median_run(&[3.0, 1.0, 2.0]), Some(2));
        // 2.0 and 3.0 in the middle: the lower, not their mean.
        assert_eq!(median_run(&[4.0, 1.0, 3.0, 2.0]), Some(3));
        assert_eq!(median_run(&[2.0, 2.0]), Some(0));
    }

    #[test]
    fn a_failed_run_removes_only_the_json_file_it_created() {
        let dir = tempfile::tempdir().unwrap();
        let fresh = dir.path().join("fresh.json");
        let out = JsonOut::open(&fresh).unwrap();
        let failed: Result<()> = Err(anyhow::anyhow!("the run failed"));
        assert!(JsonOut::unless_failed(Some(&out), failed).is_err());
        assert!(!fresh.exists());

        let earlier = dir.path().join("earlier.json");
        fs::write(&earlier, "[1]\n").unwrap();
        let out = JsonOut::open(&earlier).unwrap();
        assert_eq!(
            fs::read_to_string(&earlier).unwrap(),
            "[1]\n",
            "not truncated at open"
        );
        let failed: Result<()> = Err(anyhow::anyhow!("the run failed"));
        assert!(JsonOut::unless_failed(Some(&out), failed).is_err());
        assert_eq!(fs::read_to_string(&earlier).unwrap(), "[1]\n");

        JsonOut::unless_failed(Some(&out), Ok(())).unwrap();
        out.write(&[2, 3]).unwrap();
        let v: Vec<u32> = serde_json::from_str(&fs::read_to_string(&earlier).unwrap()).unwrap();
        assert_eq!(v, [2, 3]);
    }

    #[test]
    fn data_beyond_the_host_memory_is_refused_with_what_fits() {
        let Some(host) = ::fabric::HostMemory::now() else {
            return;
        };
        ensure_data_fits("a small run", 1 << 20, 1, "tuples").unwrap();
        let need = host.available.saturating_mul(4);
        let err = ensure_data_fits("this run", need, 1_000_000, "tuples per node")
            .unwrap_err()
            .to_string();
        assert!(err.contains("this run needs about"), "{err}");
        let fitting: u64 = err
            .rsplit("at most about ")
            .next()
            .and_then(|s| s.split(' ').next())
            .and_then(|s| s.parse().ok())
            .expect("a count");
        assert!(fitting < 250_000, "{err}");
    }
}
