//! The OpenMPI baseline: `scripts/mpi.sh run N …` runs `scripts/mpi-shuffle.c` on N
//! ranks and prints one JSON line per pattern, parsed here into the same fields as the
//! other runs.

use anyhow::{Context, Result, bail, ensure};
use serde::Deserialize;
use std::path::PathBuf;
use std::process::Command;

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

/// `scripts/mpi.sh` of the source tree this binary was built from, or
/// `$NAMDB_MPI_SCRIPT`.
pub fn script() -> PathBuf {
    std::env::var_os("NAMDB_MPI_SCRIPT").map_or_else(
        || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/mpi.sh"),
        PathBuf::from,
    )
}

/// `Ok(())` when OpenMPI can run here, else why not.
pub fn available() -> Result<(), String> {
    let script = script();
    if !script.exists() {
        return Err(format!("{} is missing", script.display()));
    }
    match Command::new(&script).arg("check").status() {
        Ok(s) if s.success() => Ok(()),
        Ok(_) => Err(format!(
            "OpenMPI is not installed (no mpicc/mpirun on PATH); install it with `{} install`",
            script.display()
        )),
        Err(e) => Err(format!("cannot run {}: {e}", script.display())),
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
    let script = script();
    let mut cmd = Command::new(&script);
    cmd.arg("run")
        .arg(nodes.to_string())
        .args(["--tuples", &tuples.to_string()])
        .args(["--pattern", pattern])
        .args(["--message-bytes", &message_bytes.to_string()])
        .args(["--seed", &seed.to_string()]);
    end_with_this_process(&mut cmd);
    let out = cmd
        .output()
        .with_context(|| format!("running {}", script.display()))?;
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
