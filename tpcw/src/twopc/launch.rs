//! Server processes: `namdb twopc resource-manager|transaction-manager` children,
//! started and waited for until they print their listening line, killed and reaped
//! when dropped. What a child writes to stderr is kept (the last
//! [`STDERR_KEPT_BYTES`]) to explain its death.

use crate::system::{Error, Result};
use std::io::{BufRead, BufReader, Read};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long a child may take to print its listening line.
pub const STARTUP_TIMEOUT: Duration = Duration::from_secs(20);
pub const STDERR_KEPT_BYTES: usize = 16 << 10;

/// The line a server prints on stdout once it accepts connections.
pub const LISTENING_PREFIX: &str = "listening on ";

/// A child server process.
pub struct ChildProcess {
    what: String,
    exe: PathBuf,
    child: Child,
    // Held open: the child exits when it closes (`--exit-on-stdin-close`), which is
    // what ends it if this process dies without dropping it.
    _stdin: Option<ChildStdin>,
    stderr: Arc<Mutex<String>>,
    stderr_reader: Option<JoinHandle<()>>,
    listening: mpsc::Receiver<String>,
    addr: Option<SocketAddr>,
}

impl ChildProcess {
    /// Starts `exe args…`; [`ChildProcess::wait_listening`] then waits for its line.
    pub fn spawn(exe: &Path, args: &[String], what: String) -> Result<ChildProcess> {
        let mut child = Command::new(exe)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| Error::System(format!("cannot start {what} ({}): {e}", exe.display())))?;
        let stdin = child.stdin.take();
        let (stdout, stderr_pipe) = match (child.stdout.take(), child.stderr.take()) {
            (Some(stdout), Some(stderr)) => (stdout, stderr),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(Error::System(format!("{what}: its pipes were not set up")));
            }
        };
        let stderr = Arc::new(Mutex::new(String::new()));
        let sink = stderr.clone();
        // Drained as it comes, so the child never blocks on a full pipe.
        let stderr_reader = std::thread::spawn(move || {
            let mut pipe = stderr_pipe;
            let mut buf = [0u8; 4096];
            while let Ok(n @ 1..) = pipe.read(&mut buf) {
                let mut kept = sink.lock().unwrap_or_else(|p| p.into_inner());
                kept.push_str(&String::from_utf8_lossy(&buf[..n]));
                if kept.len() > STDERR_KEPT_BYTES {
                    let mut cut = kept.len() - STDERR_KEPT_BYTES;
                    while !kept.is_char_boundary(cut) {
                        cut += 1;
                    }
                    kept.drain(..cut);
                }
            }
        });
        let (line_tx, listening) = mpsc::channel();
        std::thread::spawn(move || {
            let mut stdout = BufReader::new(stdout);
            let mut line = String::new();
            if matches!(stdout.read_line(&mut line), Ok(1..)) {
                let _ = line_tx.send(line);
            }
            drop(line_tx);
            // Anything more is drained, never left to fill the pipe.
            let _ = std::io::copy(&mut stdout, &mut std::io::sink());
        });
        Ok(ChildProcess {
            what,
            exe: exe.to_path_buf(),
            child,
            _stdin: stdin,
            stderr,
            stderr_reader: Some(stderr_reader),
            listening,
            addr: None,
        })
    }

    /// Waits for the listening line and returns its address; a child that exits or
    /// says something else first is an error quoting its stderr.
    pub fn wait_listening(&mut self) -> Result<SocketAddr> {
        if let Some(addr) = self.addr {
            return Ok(addr);
        }
        let line = match self.listening.recv_timeout(STARTUP_TIMEOUT) {
            Ok(line) => line,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                self.kill();
                return Err(self.failure(&format!(
                    "printed no listening line within {STARTUP_TIMEOUT:?}"
                )));
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                return Err(self.failure("closed its stdout without a listening line"));
            }
        };
        let addr = line
            .trim()
            .strip_prefix(LISTENING_PREFIX)
            .and_then(|rest| rest.parse::<SocketAddr>().ok());
        match addr {
            Some(addr) => {
                self.addr = Some(addr);
                Ok(addr)
            }
            None => {
                self.kill();
                Err(self.failure(&format!("printed {:?} instead of its listening line", line)))
            }
        }
    }

    /// An error saying how the child failed, with its exit status and stderr.
    fn failure(&mut self, what_happened: &str) -> Error {
        let status = self.wait_briefly();
        Error::System(format!(
            "{} ({}) {what_happened}; {}; its stderr: {:?}",
            self.what,
            self.exe.display(),
            describe(status),
            self.stderr_text()
        ))
    }

    /// Waits up to a second for the child to exit (a failing child is usually on its
    /// way out), then collects all of its stderr if it did.
    fn wait_briefly(&mut self) -> Option<ExitStatus> {
        let deadline = Instant::now() + Duration::from_secs(1);
        loop {
            match self.child.try_wait() {
                Ok(Some(status)) => {
                    if let Some(reader) = self.stderr_reader.take() {
                        let _ = reader.join();
                    }
                    return Some(status);
                }
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(10));
                }
                _ => return None,
            }
        }
    }

    fn stderr_text(&self) -> String {
        self.stderr
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .trim()
            .to_string()
    }

    /// If the child has exited: what it was, how it ended and what it said.
    pub fn death(&mut self) -> Option<String> {
        let status = self.child.try_wait().ok().flatten()?;
        if let Some(reader) = self.stderr_reader.take() {
            let _ = reader.join();
        }
        Some(format!(
            "{} {}; its stderr: {:?}",
            self.what,
            describe(Some(status)),
            self.stderr_text()
        ))
    }

    /// Kills the child (SIGKILL) and reaps it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for ChildProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

fn describe(status: Option<ExitStatus>) -> String {
    match status {
        Some(status) => format!("it exited with {status}"),
        None => "it is still running".into(),
    }
}
