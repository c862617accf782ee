//! The helper scripts of `scripts/` that baselines run (PostgreSQL here, DuckDB and
//! OpenMPI in `namdb bench`), built into the binary with `include_str!`: a binary
//! installed away from the source tree it was built from has no `scripts/` to find.
//! A built-in script is written out, with the files it reads beside it, into a
//! directory of the run's just before it runs, so it goes away with that directory.

use std::path::{Path, PathBuf};
use std::process::Command;

/// A script of `scripts/`, built in, and the files it reads from its own directory.
#[derive(Debug, PartialEq, Eq)]
pub struct BuiltIn {
    /// Its name in `scripts/`, which it is written out under too.
    pub name: &'static str,
    pub text: &'static str,
    /// The files it expects beside it: (name, contents).
    pub beside: &'static [(&'static str, &'static str)],
}

/// The script a baseline runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Script {
    BuiltIn(&'static BuiltIn),
    /// A script file of the user's (e.g. a modified copy), run where it is.
    File(PathBuf),
}

impl Script {
    /// `file` if there is one, else `built_in`.
    pub fn file_or(file: Option<PathBuf>, built_in: &'static BuiltIn) -> Script {
        file.map_or(Script::BuiltIn(built_in), Script::File)
    }

    /// The script's path: a file's own, or, built in, where it is written (with the
    /// files it reads) into `dir`, which is made if it is missing.
    pub fn path_in(&self, dir: &Path) -> std::io::Result<PathBuf> {
        let built_in = match self {
            Script::File(path) => return Ok(path.clone()),
            Script::BuiltIn(built_in) => built_in,
        };
        let write = |name: &str, text: &str| {
            let path = dir.join(name);
            std::fs::create_dir_all(dir)
                .and_then(|()| std::fs::write(&path, text))
                .map_err(|e| {
                    std::io::Error::new(e.kind(), format!("cannot write {}: {e}", path.display()))
                })
                .map(|()| path)
        };
        for (name, text) in built_in.beside {
            write(name, text)?;
        }
        write(built_in.name, built_in.text)
    }

    /// `bash SCRIPT`, the script written into `dir` first if it is built in. Run by
    /// bash rather than executed: a written-out file has no execute permission, and
    /// `dir` may be on a `noexec` filesystem.
    pub fn command(&self, dir: &Path) -> std::io::Result<(Command, PathBuf)> {
        let path = self.path_in(dir)?;
        let mut cmd = Command::new("bash");
        cmd.arg(&path);
        Ok((cmd, path))
    }
}

impl std::fmt::Display for Script {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Script::BuiltIn(built_in) => write!(f, "the built-in scripts/{}", built_in.name),
            Script::File(path) => write!(f, "{}", path.display()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    static ECHO: BuiltIn = BuiltIn {
        name: "echo.sh",
        text: "cat \"$(dirname \"$0\")/words\"\n",
        beside: &[("words", "read beside the script\n")],
    };

    #[test]
    fn a_built_in_script_runs_from_its_directory_with_what_it_reads() {
        let dir = tempfile::tempdir().unwrap();
        let run_dir = dir.path().join("run");
        let script = Script::file_or(None, &ECHO);
        assert_eq!(script.to_string(), "the built-in scripts/echo.sh");
        let (mut cmd, path) = script.command(&run_dir).unwrap();
        assert_eq!(path, run_dir.join("echo.sh"));
        let out = cmd.current_dir(dir.path()).output().unwrap();
        assert!(out.status.success(), "{out:?}");
        assert_eq!(out.stdout, b"read beside the script\n");
    }

    #[test]
    fn a_file_runs_where_it_is_and_an_unwritable_directory_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let own = dir.path().join("own.sh");
        let script = Script::file_or(Some(own.clone()), &ECHO);
        assert_eq!(script.path_in(&dir.path().join("unused")).unwrap(), own);
        assert!(!dir.path().join("unused").exists());
        assert_eq!(script.to_string(), own.display().to_string());

        let not_a_dir = dir.path().join("file");
        std::fs::write(&not_a_dir, "").unwrap();
        let err = Script::BuiltIn(&ECHO).path_in(&not_a_dir).unwrap_err();
        assert!(err.to_string().starts_with("cannot write "), "{err}");
        assert!(err.to_string().contains("words"), "{err}");
    }
}
