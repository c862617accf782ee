//! Helpers shared by the tests that run `namdb` processes.
#![allow(dead_code)]

use std::path::Path;
use std::process::Command;

/// A memory server process, killed when dropped so a failing test leaves none behind.
pub struct ServerProcess {
    pub child: std::process::Child,
    pub control: String,
    pub stdout: std::io::BufReader<std::process::ChildStdout>,
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn start_server(backend: &str, token_file: &Path) -> ServerProcess {
    use std::io::BufRead;
    use std::process::Stdio;
    let mut child = Command::new(env!("CARGO_BIN_EXE_namdb"))
        .args([
            "memory-server",
            "--listen",
            "127.0.0.1:0",
            "--backend",
            backend,
            "--size",
            "4MiB",
            "--token-file",
            token_file.to_str().unwrap(),
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("namdb starts");
    let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    stdout.read_line(&mut line).unwrap();
    let control = line
        .split_whitespace()
        .nth(4)
        .unwrap_or_else(|| panic!("no listening line: {line:?}"))
        .to_string();
    assert!(line.contains(&format!("data path {backend}:")), "{line}");
    ServerProcess {
        child,
        control,
        stdout,
    }
}
