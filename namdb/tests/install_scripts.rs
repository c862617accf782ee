//! The scripts that install what the baselines need (`scripts/apt-install.sh`, used by
//! `scripts/mpi.sh install` and `scripts/postgres.sh install`), against a stand-in
//! `apt-get`: tests run together on a machine without OpenMPI or PostgreSQL each
//! installed it, and every apt-get but the first failed on dpkg's lock.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// A stand-in for apt-get: fails at once, as apt-get does on dpkg's lock, while
/// another runs; logs its arguments; takes a second; and "installs" OpenMPI by
/// putting `mpicc` and `mpirun` on PATH.
const APT_GET: &str = r#"#!/usr/bin/env bash
mkdir "$STATE/running" 2>/dev/null || {
    echo "E: Could not get lock /var/lib/dpkg/lock-frontend" >&2
    exit 100
}
echo "$*" >> "$STATE/calls"
sleep 1
if [[ " $* " == *" install "* ]]; then
    for tool in mpicc mpirun; do
        printf '#!/usr/bin/env bash\n' > "$BIN/$tool"
        chmod +x "$BIN/$tool"
    done
fi
rmdir "$STATE/running"
"#;

/// The tools the scripts and the stand-in use, and nothing else of the host's PATH
/// (which may hold the real OpenMPI).
const TOOLS: [&str; 8] = [
    "bash", "dirname", "id", "flock", "mkdir", "sleep", "rmdir", "chmod",
];

fn host_tool(name: &str) -> PathBuf {
    std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .unwrap_or_default()
        .into_iter()
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
        .unwrap_or_else(|| panic!("{name} is not on PATH"))
}

#[test]
fn installs_started_together_run_apt_get_one_at_a_time_and_once() {
    if rustix::process::geteuid().as_raw() != 0 {
        eprintln!("not root: the scripts refuse to install, so there is nothing to order");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let (bin, state) = (tmp.path().join("bin"), tmp.path().join("state"));
    std::fs::create_dir(&bin).unwrap();
    std::fs::create_dir(&state).unwrap();
    for tool in TOOLS {
        std::os::unix::fs::symlink(host_tool(tool), bin.join(tool)).unwrap();
    }
    let apt_get = bin.join("apt-get");
    std::fs::write(&apt_get, APT_GET).unwrap();
    std::fs::set_permissions(&apt_get, std::fs::Permissions::from_mode(0o755)).unwrap();

    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/mpi.sh");
    let installs: Vec<_> = (0..3)
        .map(|_| {
            Command::new(bin.join("bash"))
                .arg(&script)
                .arg("install")
                .env_clear()
                .env("PATH", &bin)
                .env("BIN", &bin)
                .env("STATE", &state)
                .env("NAMDB_INSTALL_LOCK", tmp.path().join("install.lock"))
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let mut waited = 0;
    for install in installs {
        let out = install.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{stderr}");
        waited += usize::from(stderr.contains("waiting for another install"));
    }
    let calls = std::fs::read_to_string(state.join("calls")).unwrap();
    let calls: Vec<&str> = calls.lines().collect();
    assert_eq!(calls.len(), 2, "apt-get ran {calls:?}");
    assert!(calls[0].contains("update"), "{calls:?}");
    assert!(
        calls[1].contains("install") && calls[1].contains("openmpi-bin"),
        "{calls:?}"
    );
    // The three start within milliseconds and an install takes two seconds.
    assert!(waited >= 1, "no install waited for another");
}
