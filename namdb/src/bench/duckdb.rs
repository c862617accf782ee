//! The DuckDB peer of the analytics benchmarks: `scripts/duckdb.sh run …` (built in,
//! [`BUILT_IN`]) loads tables from raw column files into DuckDB (from PyPI, in a venv
//! the script makes) and times one SQL query on them (`scripts/duckdb_peer.py`).

use anyhow::{Context, Result, ensure};
use serde::Deserialize;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use tpcw::script::{BuiltIn, Script};

/// A table for DuckDB: named columns of 64-bit signed integers, all of one length.
pub struct Table<'a> {
    pub name: &'a str,
    pub columns: Vec<(&'a str, &'a [i64])>,
}

/// What `duckdb_peer.py` prints.
#[derive(Clone, Debug, Deserialize)]
pub struct Timing {
    /// Copying the tables into DuckDB (not part of the query time).
    pub load_ms: f64,
    /// Each timed run of the query (after one warm-up run).
    pub runs_ms: Vec<f64>,
    /// The lower median of an even count: one of `runs_ms`.
    pub median_ms: f64,
    pub threads: usize,
    pub version: String,
    /// The last run's rows; numbers come as JSON numbers (DuckDB's HUGEINT sums
    /// included, which can exceed i64).
    pub result: Vec<Vec<serde_json::Value>>,
}

impl Timing {
    /// Column `col` of row `row` of the result as an i128, for comparing aggregates.
    pub fn value(&self, row: usize, col: usize) -> Result<i128> {
        let v = self
            .result
            .get(row)
            .and_then(|r| r.get(col))
            .with_context(|| format!("DuckDB's result has no row {row} column {col}"))?;
        match v {
            serde_json::Value::Number(n) => n
                .as_i64()
                .map(i128::from)
                .or_else(|| n.to_string().parse::<i128>().ok())
                .with_context(|| format!("DuckDB returned {n}, not an integer")),
            serde_json::Value::Null => Ok(0),
            other => anyhow::bail!("DuckDB returned {other}, not a number"),
        }
    }
}

/// `scripts/duckdb.sh` and the peer it runs, built in: written into each run's
/// directory, so an installed `namdb` needs no source tree. The script keeps its venv
/// in namdb's cache directory (`$NAMDB_DUCKDB_VENV`, else `duckdb-venv` under
/// `$NAMDB_CACHE_DIR`, `$XDG_CACHE_HOME/namdb` or `~/.cache/namdb`), made once.
pub static BUILT_IN: BuiltIn = BuiltIn {
    name: "duckdb.sh",
    text: include_str!("../../../scripts/duckdb.sh"),
    beside: &[(
        "duckdb_peer.py",
        include_str!("../../../scripts/duckdb_peer.py"),
    )],
};

/// `$NAMDB_DUCKDB_SCRIPT` (run with bash), else [`BUILT_IN`].
pub fn script() -> Script {
    Script::file_or(
        std::env::var_os("NAMDB_DUCKDB_SCRIPT").map(PathBuf::from),
        &BUILT_IN,
    )
}

/// Writes `tables` as column files under `dir`, runs `query` on them in DuckDB with
/// `threads` threads, once to warm up and then `repeat` times, and returns the timing.
pub fn run(
    dir: &Path,
    tables: &[Table<'_>],
    query: &str,
    repeat: usize,
    threads: usize,
) -> Result<Timing> {
    let script = script();
    if let Script::File(path) = &script {
        ensure!(path.exists(), "{} is missing", path.display());
    }
    let (mut cmd, path) = script.command(dir)?;
    cmd.arg("run");
    for table in tables {
        let mut spec = format!("{}=", table.name);
        for (i, (col, values)) in table.columns.iter().enumerate() {
            let path = dir.join(format!("{}.{col}.i64", table.name));
            write_column(&path, values)?;
            if i > 0 {
                spec.push(',');
            }
            spec.push_str(&format!("{col}:{}", path.display()));
        }
        cmd.args(["--table", &spec]);
    }
    cmd.args(["--query", query])
        .args(["--repeat", &repeat.to_string()])
        .args(["--threads", &threads.to_string()]);
    // Interrupted, this process exits at once (crate::interrupt), and a query of
    // minutes must not run on without it. Spawned and waited for on this thread.
    crate::interrupt::kill_with_parent(&mut cmd);
    let out = cmd
        .output()
        .with_context(|| format!("running {}", path.display()))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(
        out.status.success(),
        "the DuckDB peer failed ({}):\n{}",
        out.status,
        stderr.trim()
    );
    let line = stdout
        .lines()
        .find(|l| l.starts_with('{'))
        .with_context(|| format!("the DuckDB peer printed no result:\n{}", stderr.trim()))?;
    serde_json::from_str(line).with_context(|| format!("the DuckDB peer printed {line:?}"))
}

fn write_column(path: &Path, values: &[i64]) -> Result<()> {
    let file =
        std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let mut w = BufWriter::with_capacity(1 << 20, file);
    for v in values {
        w.write_all(&v.to_le_bytes())?;
    }
    w.flush()
        .with_context(|| format!("writing {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Needs Python and PyPI the first time (the venv is made on demand).
    #[test]
    fn duckdb_joins_and_sums_what_it_was_given() {
        let dir = tempfile::tempdir().unwrap();
        let rk: Vec<i64> = (0..1000).collect();
        let rv: Vec<i64> = rk.iter().map(|k| k * 3).collect();
        let sk: Vec<i64> = (500..1500).collect();
        let timing = run(
            dir.path(),
            &[
                Table {
                    name: "r",
                    columns: vec![("k", &rk), ("v", &rv)],
                },
                Table {
                    name: "s",
                    columns: vec![("k", &sk)],
                },
            ],
            "SELECT count(*), sum(r.v) FROM r JOIN s USING (k)",
            2,
            1,
        )
        .unwrap();
        assert_eq!(timing.runs_ms.len(), 2);
        assert_eq!(timing.value(0, 0).unwrap(), 500);
        assert_eq!(
            timing.value(0, 1).unwrap(),
            (500..1000).map(|k| k * 3).sum::<i128>()
        );
    }

    #[test]
    fn a_bad_query_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        let k: Vec<i64> = vec![1, 2];
        let err = run(
            dir.path(),
            &[Table {
                name: "t",
                columns: vec![("k", &k)],
            }],
            "SELECT nope FROM t",
            1,
            1,
        )
        .unwrap_err();
        assert!(format!("{err:#}").contains("DuckDB peer failed"), "{err:#}");
    }
}
