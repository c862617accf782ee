//! The OpenMPI baseline: `scripts/mpi.sh run N …` (built in, [`BUILT_IN`]) runs
//! `scripts/mpi-shuffle.c` on N ranks and prints one JSON line per pattern, parsed here
//! into the same fields as the other runs.

use anyhow::{Context, Result, bail, ensure};
use serde::Deserialize;
use std::path::{Path, PathBuf};
use std::process::Command;
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
    beside: &[(
        "mpi-shuffle.c",
        include_str!("../../../../scripts/mpi-shuffle.c"),
    )],
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

/// Runs the MPI microbenchmark on `nodes` ranks.
pub fn run(
    nodes: usize,
    tuples: u64,
    pattern: &str,
    message_bytes: u32,
    seed: u64,
) -> Result<Vec<MpiLine>> {
    let dir = crate::interrupt::TempDir::new("namdb-mpi-")?;
    let (mut cmd, path) = command(dir.path(), "run")?;
    cmd.arg(nodes.to_string())
        .args(["--tuples", &tuples.to_string()])
        .args(["--pattern", pattern])
        .args(["--message-bytes", &message_bytes.to_string()])
        .args(["--seed", &seed.to_string()]);
    end_with_this_process(&mut cmd);
    let out = cmd
        .output()
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
