//! A Python grpcio client against a `namdb cluster up` cluster
//! (compute-node/python/namdb_client_test.py): the API works from another language with
//! nothing but compute.proto and the token file.
//!
//! The test sets up its own Python: a venv under the target directory with grpcio and
//! grpcio-tools from PyPI, made once and reused. Without `python3 -m venv` or pip it
//! fails and says what is missing, rather than skipping: a skipped test would pass CI
//! without ever having run (.ci/run installs python3-venv).

mod common;

use common::Cluster;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The workspace root (namdb's manifest directory is one below it).
fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

fn run(cmd: &mut Command) -> Output {
    let shown = format!("{cmd:?}");
    let o = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {shown}: {e}"));
    assert!(
        o.status.success(),
        "{shown} failed ({}):\n{}{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    o
}

/// The venv's python, with grpcio and grpcio-tools installed.
fn python_env() -> PathBuf {
    let venv = Path::new(env!("CARGO_TARGET_TMPDIR")).join("pyenv");
    let python = venv.join("bin/python");
    let ready = |python: &Path| {
        Command::new(python)
            .args(["-c", "import grpc, grpc_tools.protoc"])
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if ready(&python) {
        return python;
    }
    let made = Command::new("python3")
        .args(["-m", "venv"])
        .arg(&venv)
        .output();
    match made {
        Ok(o) if o.status.success() => {}
        Ok(o) => panic!(
            "`python3 -m venv {}` failed: {}\n\
             this test needs Python 3 with venv and pip (Debian: apt-get install python3-venv)",
            venv.display(),
            String::from_utf8_lossy(&o.stderr)
        ),
        Err(e) => panic!(
            "cannot run python3 ({e}): this test needs Python 3 with venv and pip \
             (Debian: apt-get install python3-venv)"
        ),
    }
    run(Command::new(&python).args([
        "-m",
        "pip",
        "install",
        "--quiet",
        "--disable-pip-version-check",
        "grpcio",
        "grpcio-tools",
    ]));
    assert!(
        ready(&python),
        "grpcio and grpcio-tools were installed into {} but do not import",
        venv.display()
    );
    python
}

#[test]
fn a_python_grpcio_client_runs_transactions_on_a_compute_node() {
    let python = python_env();
    let proto_root = workspace().join("compute-node/proto");
    let stubs = tempfile::tempdir().unwrap();
    run(Command::new(&python)
        .args(["-m", "grpc_tools.protoc", "-I"])
        .arg(&proto_root)
        .arg(format!("--python_out={}", stubs.path().display()))
        .arg(format!("--grpc_python_out={}", stubs.path().display()))
        .arg(proto_root.join("namdb/compute/v1/compute.proto")));

    // The default shape: two memory servers, one compute node.
    let c = Cluster::up(&["--backend", "shm", "--table-capacity", "4096"]);
    let json = c.json();
    let address = json["compute_nodes"][0]["address"].as_str().unwrap();
    let token_file = json["token_file"].as_str().unwrap();
    let o = run(Command::new(&python)
        .arg(workspace().join("compute-node/python/namdb_client_test.py"))
        .arg("--stubs")
        .arg(stubs.path())
        .args(["--address", address, "--token-file", token_file])
        .args(["--table", "kv"]));
    let said = String::from_utf8_lossy(&o.stdout);
    assert!(said.contains("all checks passed"), "{said}");
}
