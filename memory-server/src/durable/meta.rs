//! The data directory's metadata file and the atomic-replace helpers every metadata
//! update goes through.
//!
//! The file is a few lines of text (a person debugging a server can read it):
//!
//! ```text
//! namdb memory-server data directory
//! format 1
//! boot 3
//! applied_journal 7
//! applied_seq 1234
//! region catalog 1048576
//! region data.0 67108864
//! ```
//!
//! `applied_journal`/`applied_seq` say which journal (and its last batch) the base
//! files already hold; journals numbered above it are replayed on start.
//!
//! Two optional lines follow `applied_seq` in directories that took part in a
//! failover (written only then, so that every other directory reads as before):
//! `epoch N`, the replication epoch of the data (how many promotions its history
//! went through), and `promoted SECONDS`, present from the promotion of a backup on
//! this directory (Unix time) until, started as a primary, it has handed its whole
//! state to a new backup. See DEVELOPERS.md ("Replication").

use std::fs::File;
use std::io::{self, Write};
use std::path::Path;

const HEADER: &str = "namdb memory-server data directory";
/// Bumped when the directory's layout changes incompatibly.
pub(crate) const FORMAT: u32 = 1;
pub(crate) const META_FILE: &str = "meta";

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Meta {
    pub boot: u64,
    /// The highest journal number whose batches are all in the base files (0: none).
    pub applied_journal: u64,
    /// The sequence number of the last batch in the base files (0: none).
    pub applied_seq: u64,
    /// The replication epoch of the data (0: it never went through a promotion). A
    /// promotion makes it one more than the larger of the backup's and its primary's;
    /// a backup takes its primary's when the primary attaches. A backup refuses a
    /// primary of a lower epoch: that primary's data is older than its own.
    pub epoch: u64,
    /// When a backup on this directory was promoted (Unix seconds), until it has
    /// handed its whole state to a new backup as a primary. While it is set, this
    /// directory holds the only copy of data newer than its old primary's, and a
    /// server refuses to start on it as a backup.
    pub promoted: Option<u64>,
    /// `(name, len)` of every region, in plan order.
    pub regions: Vec<(String, u64)>,
}

impl Meta {
    pub fn encode(&self) -> String {
        let mut s = format!(
            "{HEADER}\nformat {FORMAT}\nboot {}\napplied_journal {}\napplied_seq {}\n",
            self.boot, self.applied_journal, self.applied_seq
        );
        if self.epoch != 0 {
            s.push_str(&format!("epoch {}\n", self.epoch));
        }
        if let Some(at) = self.promoted {
            s.push_str(&format!("promoted {at}\n"));
        }
        for (name, len) in &self.regions {
            s.push_str(&format!("region {name} {len}\n"));
        }
        s
    }

    pub fn parse(text: &str) -> Result<Meta, String> {
        let mut lines = text.lines();
        if lines.next() != Some(HEADER) {
            return Err(format!("it does not start with `{HEADER}`"));
        }
        let mut field = |key: &str| -> Result<u64, String> {
            let line = lines.next().ok_or_else(|| format!("`{key}` is missing"))?;
            line.strip_prefix(key)
                .and_then(|rest| rest.strip_prefix(' '))
                .and_then(|v| v.parse().ok())
                .ok_or_else(|| format!("expected `{key} <number>`, found `{line}`"))
        };
        let format = field("format")?;
        if format != u64::from(FORMAT) {
            return Err(format!(
                "format {format} is not the format {FORMAT} this build reads"
            ));
        }
        let boot = field("boot")?;
        let applied_journal = field("applied_journal")?;
        let applied_seq = field("applied_seq")?;
        let mut regions = Vec::new();
        let (mut epoch, mut promoted) = (0, None);
        for line in lines {
            let mut parts = line.split(' ');
            let number = |v: &str| {
                v.parse::<u64>()
                    .map_err(|_| format!("bad number in `{line}`"))
            };
            match (parts.next(), parts.next(), parts.next(), parts.next()) {
                (Some("epoch"), Some(v), None, None) if regions.is_empty() => epoch = number(v)?,
                (Some("promoted"), Some(v), None, None) if regions.is_empty() => {
                    promoted = Some(number(v)?)
                }
                (Some("region"), Some(name), Some(len), None) if !name.is_empty() => {
                    let len = len
                        .parse()
                        .map_err(|_| format!("bad region length in `{line}`"))?;
                    regions.push((name.to_string(), len));
                }
                _ => return Err(format!("unexpected line `{line}`")),
            }
        }
        if regions.is_empty() {
            return Err("it lists no regions".into());
        }
        Ok(Meta {
            boot,
            applied_journal,
            applied_seq,
            epoch,
            promoted,
            regions,
        })
    }

    pub fn read(dir: &Path) -> Result<Option<Meta>, String> {
        let path = dir.join(META_FILE);
        match std::fs::read_to_string(&path) {
            Ok(text) => Meta::parse(&text)
                .map(Some)
                .map_err(|e| format!("{} is not a valid metadata file: {e}", path.display())),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(format!("cannot read {}: {e}", path.display())),
        }
    }

    pub fn write(&self, dir: &Path) -> io::Result<()> {
        write_atomic(dir, META_FILE, self.encode().as_bytes())
    }
}

/// Why the directory's region plan differs from the server's, or `None` if they are
/// the same. Restoring into a different plan would put bytes at the wrong addresses.
pub(crate) fn plan_difference(
    stored: &[(String, u64)],
    planned: &[(String, u64)],
) -> Option<String> {
    for (i, (s, p)) in stored.iter().zip(planned).enumerate() {
        if s.0 != p.0 {
            return Some(format!(
                "region {i} is `{}` in the data directory but `{}` in the server's plan",
                s.0, p.0
            ));
        }
        if s.1 != p.1 {
            return Some(format!(
                "region `{}` is {} bytes in the data directory but {} bytes in the server's plan",
                s.0, s.1, p.1
            ));
        }
    }
    if stored.len() != planned.len() {
        return Some(format!(
            "the data directory holds {} regions, the server's plan {}",
            stored.len(),
            planned.len()
        ));
    }
    None
}

/// Replaces `dir/name` with `bytes` so that a crash at any moment leaves either the
/// old or the new contents: write a temporary file, fsync it, rename it over the
/// target, fsync the directory (which makes the rename itself durable).
pub(crate) fn write_atomic(dir: &Path, name: &str, bytes: &[u8]) -> io::Result<()> {
    let tmp = dir.join(format!("{name}.tmp"));
    let mut file = File::create(&tmp)?;
    file.write_all(bytes)?;
    file.sync_all()?;
    drop(file);
    std::fs::rename(&tmp, dir.join(name))?;
    sync_dir(dir)
}

/// Makes the directory's entries (created, renamed, removed files) durable.
pub(crate) fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta() -> Meta {
        Meta {
            boot: 3,
            applied_journal: 7,
            applied_seq: 1234,
            epoch: 0,
            promoted: None,
            regions: vec![("catalog".into(), 1 << 20), ("data.0".into(), 4096)],
        }
    }

    #[test]
    fn metadata_round_trips_and_bad_files_are_explained() {
        let m = meta();
        assert_eq!(Meta::parse(&m.encode()).unwrap(), m);
        let text = m.encode();
        assert!(
            Meta::parse("hello\n")
                .unwrap_err()
                .contains("does not start")
        );
        let future = text.replace("format 1", "format 9");
        assert!(Meta::parse(&future).unwrap_err().contains("format 9"));
        let cut = text.replace("region data.0 4096\n", "region data.0\n");
        assert!(Meta::parse(&cut).unwrap_err().contains("region data.0"));
        let no_boot = text.replace("boot 3\n", "");
        assert!(Meta::parse(&no_boot).is_err());
        // A directory that never saw a failover is written as before; one that did
        // round-trips its epoch and promotion.
        assert!(
            !text.contains("epoch") && !text.contains("promoted"),
            "{text}"
        );
        let failed_over = Meta {
            epoch: 2,
            promoted: Some(1_700_000_000),
            ..m
        };
        let text = failed_over.encode();
        assert!(
            text.contains("\nepoch 2\npromoted 1700000000\nregion "),
            "{text}"
        );
        assert_eq!(Meta::parse(&text).unwrap(), failed_over);
        let bad = text.replace("promoted 1700000000", "promoted soon");
        assert!(Meta::parse(&bad).unwrap_err().contains("promoted soon"));
    }

    #[test]
    fn atomic_writes_replace_the_file_and_leave_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(Meta::read(dir.path()).unwrap(), None);
        let mut m = meta();
        m.write(dir.path()).unwrap();
        assert_eq!(Meta::read(dir.path()).unwrap(), Some(m.clone()));
        m.boot = 4;
        m.write(dir.path()).unwrap();
        assert_eq!(Meta::read(dir.path()).unwrap().unwrap().boot, 4);
        let names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(names, [META_FILE]);
        // A crash after writing the temporary file but before the rename leaves the
        // old contents in force, and the next write replaces the stale temporary.
        std::fs::write(dir.path().join("meta.tmp"), "half a fi").unwrap();
        assert_eq!(Meta::read(dir.path()).unwrap().unwrap().boot, 4);
        m.boot = 5;
        m.write(dir.path()).unwrap();
        assert_eq!(Meta::read(dir.path()).unwrap().unwrap().boot, 5);
        assert!(!dir.path().join("meta.tmp").exists());
        std::fs::write(dir.path().join(META_FILE), "garbage").unwrap();
        let err = Meta::read(dir.path()).unwrap_err();
        assert!(err.contains("not a valid metadata file"), "{err}");
    }

    #[test]
    fn plan_differences_are_named() {
        let stored = meta().regions;
        assert_eq!(plan_difference(&stored, &stored), None);
        let mut bigger = stored.clone();
        bigger[1].1 = 8192;
        let d = plan_difference(&stored, &bigger).unwrap();
        assert!(
            d.contains("data.0") && d.contains("4096") && d.contains("8192"),
            "{d}"
        );
        let mut renamed = stored.clone();
        renamed[1].0 = "data.9".into();
        let d = plan_difference(&stored, &renamed).unwrap();
        assert!(d.contains("`data.0`") && d.contains("`data.9`"), "{d}");
        let mut more = stored.clone();
        more.push(("data.1".into(), 4096));
        let d = plan_difference(&stored, &more).unwrap();
        assert!(d.contains("2 regions") && d.contains("plan 3"), "{d}");
    }
}
