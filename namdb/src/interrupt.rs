//! Temporary paths that must not outlive a command stopped by Ctrl-C or `kill`.
//!
//! Without a handler, SIGINT and SIGTERM end the process at once and no destructor
//! runs, so a `tempfile::TempDir` stays behind. [`remove_on_interrupt`] registers a
//! path; the first such signal removes every registered path and ends the process with
//! the shell's status for it (130 for SIGINT, 143 for SIGTERM). Where only a handle is
//! needed, an unlinked file (`tempfile::tempfile()`) is better still: nothing to remove
//! even after SIGKILL.

use anyhow::{Context, Result};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

/// The registered paths, by registration number.
fn registered() -> &'static Mutex<HashMap<u64, PathBuf>> {
    static PATHS: OnceLock<Mutex<HashMap<u64, PathBuf>>> = OnceLock::new();
    PATHS.get_or_init(Default::default)
}

/// Starts the thread that waits for SIGINT and SIGTERM, once per process.
fn install() -> Result<()> {
    static INSTALLED: OnceLock<Result<(), String>> = OnceLock::new();
    INSTALLED
        .get_or_init(|| {
            use signal_hook::consts::{SIGINT, SIGTERM};
            let mut signals = signal_hook::iterator::Signals::new([SIGINT, SIGTERM])
                .map_err(|e| format!("cannot handle SIGINT and SIGTERM: {e}"))?;
            std::thread::Builder::new()
                .name("interrupt".into())
                .spawn(move || {
                    if let Some(signal) = signals.forever().next() {
                        // Held to the exit, so no path is unregistered (and its owner's
                        // own removal raced) while these go.
                        let paths = registered().lock().unwrap_or_else(|e| e.into_inner());
                        for path in paths.values() {
                            remove(path);
                        }
                        eprintln!("interrupted");
                        std::process::exit(128 + signal);
                    }
                })
                .map(drop)
                .map_err(|e| format!("cannot start the signal-handling thread: {e}"))
        })
        .clone()
        .map_err(anyhow::Error::msg)
}

fn remove(path: &Path) {
    let _ = if path.is_dir() {
        std::fs::remove_dir_all(path)
    } else {
        std::fs::remove_file(path)
    };
}

/// Keeps `path` registered until dropped; its owner removes it on a normal exit.
pub struct Registered(u64);

impl Drop for Registered {
    fn drop(&mut self) {
        registered()
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.0);
    }
}

/// Removes `path` (a file, or a directory with everything in it) if SIGINT or SIGTERM
/// ends the process before the returned guard is dropped.
pub fn remove_on_interrupt(path: &Path) -> Result<Registered> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    install().context("cannot clean up temporary files on Ctrl-C")?;
    let id = NEXT.fetch_add(1, Ordering::Relaxed);
    registered()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(id, path.to_path_buf());
    Ok(Registered(id))
}

/// Has the child that `command` starts killed (SIGKILL) when this process ends,
/// however it ends: through the handler above on Ctrl-C or `kill -INT` of this process
/// alone, or by `kill -9`. Without it the child runs on to its own end (a DuckDB query
/// of minutes), holding its memory and cores. The kernel sends the signal when the
/// *thread* that spawned the child ends, so spawn from a thread that waits for it.
pub fn kill_with_parent(command: &mut std::process::Command) {
    use std::os::unix::process::CommandExt;
    let parent = rustix::process::getpid();
    // SAFETY: the hook runs in the forked child before exec, where only
    // async-signal-safe calls are allowed: prctl and getppid are plain system calls, and
    // an Errno becomes an io::Error without allocating.
    unsafe {
        command.pre_exec(move || {
            rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL))?;
            // A parent that ended before the prctl sends nothing: give up rather than
            // run orphaned.
            if rustix::process::getppid() != Some(parent) {
                return Err(rustix::io::Errno::SRCH.into());
            }
            Ok(())
        });
    }
}

/// A fresh temporary directory, named `PREFIX…`, removed when dropped and, unlike a
/// bare `tempfile::TempDir`, also when SIGINT or SIGTERM ends the process.
pub struct TempDir {
    // Dropped in this order: removed first, so a signal in between finds nothing left.
    dir: tempfile::TempDir,
    _registered: Registered,
}

impl TempDir {
    pub fn new(prefix: &str) -> Result<TempDir> {
        let dir = tempfile::Builder::new()
            .prefix(prefix)
            .tempdir()
            .with_context(|| format!("cannot create a temporary directory {prefix}…"))?;
        let registered = remove_on_interrupt(dir.path())?;
        Ok(TempDir {
            dir,
            _registered: registered,
        })
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }
}
