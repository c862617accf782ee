//! The OpenMPI baseline: `scripts/mpi.sh run N …` (built in, [`BUILT_IN`]) runs
//! `scripts/mpi-shuffle.c` on N ranks and prints one JSON line per pattern, parsed here
//! into the same fields as the other runs. The `progress` lines its rank 0 appends to
//! a file become progress lines like the other runs' while it runs.

use crate::bench::nodes;
use anyhow::{Context, Result, bail, ensure};
use serde::Deserialize;
use shuffle::progress::{Phase, Progress, Snapshot};
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::time::Duration;
use tpcw::script::{BuiltIn, Script};

/// The OpenMPI transport (BTL) the ranks move the data through: `scripts/mpi.sh run`
/// sets `OMPI_MCA_btl=self,vader`, OpenMPI's shared-memory transport, so the rows are
/// comparable with the designs' on the `shm` backend.
pub const TRANSPORT: &str = "vader";

/// The fabric backend [`TRANSPORT`] corresponds to.
pub const BACKEND: &str = "shm";

/// What `mpi-shuffle` prints per pattern.
#[derive(Clone, Debug, Deserialize)]
pub struct MpiLine {
    pub pattern: String,
    pub nodes: usize,
    pub threads: usize,
    pub message_bytes: u32,
    pub gb_per_sec: f64,
    pub gb_per_sec_min: f64,
    pub memcpy_gb_per_sec: f64,
    pub setup_ms: f64,
    pub seconds: f64,
    pub received_bytes: u64,
    pub verified: bool,
}

/// `scripts/mpi.sh` and the program it builds, built in: written into a directory of
/// each call's, so an installed `namdb` needs no source tree. The script keeps the
/// compiled program in namdb's cache directory (`$MPI_BUILD_DIR`, else `mpi` under
/// `$NAMDB_CACHE_DIR`, `$XDG_CACHE_HOME/namdb` or `~/.cache/namdb`), rebuilt only when
/// the source differs from the one it was built from.
pub static BUILT_IN: BuiltIn = BuiltIn {
    name: "mpi.sh",
    text: include_str!("../../../../scripts/mpi.sh"),
    beside: &[
        (
            "mpi-shuffle.c",
            include_str!("../../../../scripts/mpi-shuffle.c"),
        ),
        (
            "apt-install.sh",
            include_str!("../../../../scripts/apt-install.sh"),
        ),
    ],
};

/// `$NAMDB_MPI_SCRIPT` (run with bash), else [`BUILT_IN`].
pub fn script() -> Script {
    Script::file_or(
        std::env::var_os("NAMDB_MPI_SCRIPT").map(PathBuf::from),
        &BUILT_IN,
    )
}

/// `bash SCRIPT ARG`, with the built-in script written into `dir`.
fn command(dir: &Path, arg: &str) -> Result<(Command, PathBuf)> {
    let script = script();
    if let Script::File(path) = &script {
        ensure!(path.exists(), "{} is missing", path.display());
    }
    let (mut cmd, path) = script.command(dir)?;
    cmd.arg(arg);
    Ok((cmd, path))
}

/// `Ok(())` when OpenMPI can run here, else why not.
pub fn available() -> Result<(), String> {
    let dir = crate::interrupt::TempDir::new("namdb-mpi-").map_err(|e| format!("{e:#}"))?;
    let (mut cmd, path) = command(dir.path(), "check").map_err(|e| format!("{e:#}"))?;
    match cmd.status() {
        Ok(s) if s.success() => Ok(()),
        Ok(_) => Err(
            "OpenMPI is not installed (no mpicc/mpirun on PATH); install it (Debian: \
             apt-get install openmpi-bin libopenmpi-dev, as scripts/mpi.sh install does)"
                .into(),
        ),
        Err(e) => Err(format!("cannot run {}: {e}", path.display())),
    }
}

/// The patterns of `mpi-shuffle`'s progress steps.
const STEPS: [&str; 2] = ["repartition", "broadcast"];

/// Takes in a line of `mpi-shuffle`'s rank 0 (without `progress `, see
/// [`Snapshot::report`]) of one of its [`STEPS`]; false if it is not one.
fn read_progress(into: &Progress, report: &str) -> bool {
    match Snapshot::parse(report) {
        Some(s) if (s.step as usize) < STEPS.len() => {
            into.set(s);
            true
        }
        _ => false,
    }
}

/// The end of `mpi-shuffle`'s progress file read so far: the bytes read, and a line
/// not yet complete.
#[derive(Default)]
struct Tail {
    read: u64,
    partial: String,
}

impl Tail {
    /// Takes the lines appended to `file` since the last call into `progress`. A file
    /// not there yet (the program not started) has none.
    fn follow(&mut self, file: &Path, progress: &Progress) {
        let Ok(mut f) = std::fs::File::open(file) else {
            return;
        };
        let mut new = String::new();
        if f.seek(SeekFrom::Start(self.read)).is_err() || f.read_to_string(&mut new).is_err() {
            return;
        }
        self.read += new.len() as u64;
        self.partial.push_str(&new);
        let Some(end) = self.partial.rfind('\n') else {
            return;
        };
        for line in self.partial[..end].lines() {
            if let Some(report) = line.strip_prefix("progress ") {
                read_progress(progress, report);
            }
        }
        self.partial.drain(..=end);
    }
}

/// A progress line of the MPI run: its pattern once shuffling, the phase and the
/// tuples rank 0 sent.
fn progress_line(at: Duration, progress: &Progress) -> String {
    let s = progress.snapshot();
    let mut line = nodes::progress_prefix(at);
    if s.phase >= Phase::Shuffling {
        line.push_str(&format!("mpi {}: ", STEPS[s.step as usize % STEPS.len()]));
    }
    line.push_str(&nodes::phase_text(&s));
    line
}

/// Runs the MPI microbenchmark on `nodes` ranks, printing a progress line on stderr
/// every `progress_ms` while it runs.
pub fn run(
    nodes: usize,
    tuples: u64,
    pattern: &str,
    message_bytes: u32,
    seed: u64,
    progress_ms: u64,
    pin: bool,
) -> Result<Vec<MpiLine>> {
    let dir = crate::interrupt::TempDir::new("namdb-mpi-")?;
    let (mut cmd, path) = command(dir.path(), "run")?;
    let progress_file = dir.path().join("progress");
    // Rank 0 writes as often as the benchmark prints, at most every 250 ms.
    let write_ms = progress_ms.clamp(1, 250);
    cmd.arg(nodes.to_string())
        .args(["--tuples", &tuples.to_string()])
        .args(["--pattern", pattern])
        .args(["--message-bytes", &message_bytes.to_string()])
        .args(["--seed", &seed.to_string()])
        .arg("--progress-file")
        .arg(&progress_file)
        .args(["--progress-ms", &write_ms.to_string()])
        .env("NAMDB_MPI_BIND", if pin { "core" } else { "none" });
    end_with_this_process(&mut cmd);
    let progress = Progress::default();
    let tail = Mutex::new(Tail::default());
    let line = |at| {
        tail.lock()
            .unwrap_or_else(|e| e.into_inner())
            .follow(&progress_file, &progress);
        progress_line(at, &progress)
    };
    let every = Duration::from_millis(progress_ms.max(1));
    let out = nodes::reporting(every, line, || cmd.output())
        .with_context(|| format!("running {}", path.display()))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<MpiLine> = stdout
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).with_context(|| format!("MPI printed {l:?}")))
        .collect::<Result<_>>()?;
    if let Some(bad) = lines.iter().find(|l| !l.verified) {
        bail!(
            "VERIFICATION FAILED: mpi {}: a rank did not receive exactly what was sent\n{}",
            bad.pattern,
            stderr.trim()
        );
    }
    ensure!(
        out.status.success(),
        "the MPI baseline failed ({}):\n{}",
        out.status,
        stderr.trim()
    );
    ensure!(
        !lines.is_empty(),
        "the MPI baseline printed no result:\n{}",
        stderr.trim()
    );
    Ok(lines)
}

/// Has the child (mpirun: the script execs it) sent SIGTERM, on which mpirun stops its
/// ranks, when this process ends. A benchmark stopped by a signal only it got (`kill
/// PID`, `timeout`) or by SIGKILL runs no code to stop it, and mpirun and its ranks
/// ran on to the end. The signal comes when the spawning thread ends, which waits for
/// the child here.
fn end_with_this_process(cmd: &mut Command) {
    use std::os::unix::process::CommandExt;
    let parent = rustix::process::getpid();
    // SAFETY: the closure runs in the child between fork and exec and only makes
    // async-signal-safe system calls (prctl, getppid); it neither allocates nor locks.
    unsafe {
        cmd.pre_exec(move || {
            rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::TERM))?;
            // A parent that died before the call above sends nothing: do not start.
            if rustix::process::getppid() != Some(parent) {
                return Err(std::io::ErrorKind::Other.into());
            }
            Ok(())
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn the_tail_takes_whole_lines_as_they_are_appended() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("progress");
        let progress = Progress::default();
        let mut tail = Tail::default();
        tail.follow(&file, &progress);
        assert_eq!(progress.phase(), Phase::Preparing, "no file yet");
        let mut f = std::fs::File::create(&file).unwrap();
        write!(f, "progress 0 shuffling 0 100\nprogress 0 shuffling 40 1").unwrap();
        tail.follow(&file, &progress);
        assert_eq!((progress.phase(), progress.done()), (Phase::Shuffling, 0));
        // The rest of the line: 40 of 100, not 40 of 1.
        write!(f, "00\nprogress 1 bogus 1 1\nnot progress\n").unwrap();
        tail.follow(&file, &progress);
        let s = progress.snapshot();
        assert_eq!(
            (s.step, s.phase, s.done, s.total),
            (0, Phase::Shuffling, 40, 100)
        );
        assert_eq!(
            progress_line(Duration::from_millis(2500), &progress),
            "          2.5 s  mpi repartition: shuffling: 40 of 100 tuples (40%)"
        );
        for bad in [
            "2 shuffling 1 1",
            "0 shuffling x 1",
            "0 verifying 1 1 1",
            "",
        ] {
            assert!(!read_progress(&progress, bad), "{bad:?}");
        }
        assert!(read_progress(&progress, "1 verifying 0 0"));
        assert_eq!(
            progress_line(Duration::from_millis(2500), &progress),
            "          2.5 s  mpi broadcast: verifying"
        );
    }
}
