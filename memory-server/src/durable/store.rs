//! The base files: one sparse file per region, as long as the region, holding every
//! byte as of the last checkpoint. They only ever receive journal entries (never a copy
//! of live region memory, which could catch a record half-way through a change).

use fabric::Region;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// Restores read base files in pieces of this size.
const LOAD_CHUNK: usize = 1 << 20;

pub(crate) fn file_name(region: &str) -> String {
    format!("region-{region}.base")
}

pub(crate) struct Store {
    dir: PathBuf,
    names: Vec<String>,
    files: Vec<File>,
    lens: Vec<u64>,
    /// Files written since their last fsync.
    dirty: Vec<bool>,
}

impl Store {
    /// Creates (or empties) a zero, sparse base file for every region and makes them
    /// durable. Only for a directory without metadata, whose files hold nothing.
    pub fn create(dir: &Path, regions: &[(String, u64)]) -> io::Result<Store> {
        let mut store = Store::empty(dir);
        for (name, len) in regions {
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .open(dir.join(file_name(name)))?;
            file.set_len(*len)?;
            file.sync_all()?;
            store.push(name, file, *len);
        }
        crate::durable::meta::sync_dir(dir)?;
        Ok(store)
    }

    /// Opens the base files of `regions`, each of which must exist with the region's
    /// length.
    pub fn open(dir: &Path, regions: &[(String, u64)]) -> Result<Store, String> {
        let mut store = Store::empty(dir);
        for (name, len) in regions {
            let path = dir.join(file_name(name));
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .open(&path)
                .map_err(|e| format!("cannot open the base file {}: {e}", path.display()))?;
            let actual = file
                .metadata()
                .map_err(|e| format!("cannot stat {}: {e}", path.display()))?
                .len();
            if actual != *len {
                return Err(format!(
                    "the base file {} is {actual} bytes, but region `{name}` is {len}",
                    path.display()
                ));
            }
            store.push(name, file, *len);
        }
        Ok(store)
    }

    fn empty(dir: &Path) -> Store {
        Store {
            dir: dir.to_path_buf(),
            names: Vec::new(),
            files: Vec::new(),
            lens: Vec::new(),
            dirty: Vec::new(),
        }
    }

    fn push(&mut self, name: &str, file: File, len: u64) {
        self.names.push(name.to_string());
        self.files.push(file);
        self.lens.push(len);
        self.dirty.push(false);
    }

    /// Copies base file `index` into `region` (through its atomic word access); returns
    /// the bytes copied. Holes of the sparse file and all-zero pieces are skipped (the
    /// region starts zeroed), so a restore costs what was ever written, not the
    /// region's size.
    pub fn load(&self, index: usize, region: &Region) -> Result<u64, String> {
        let file = &self.files[index];
        let len = self.lens[index];
        let mut buf = vec![0u8; LOAD_CHUNK];
        let mut restored = 0;
        for (start, end) in data_extents(file, len) {
            let mut at = start;
            while at < end {
                let n = (end - at).min(LOAD_CHUNK as u64) as usize;
                file.read_exact_at(&mut buf[..n], at).map_err(|e| {
                    format!(
                        "cannot read the base file of region `{}`: {e}",
                        self.names[index]
                    )
                })?;
                if buf[..n].iter().any(|&b| b != 0) {
                    region
                        .write(at, &buf[..n])
                        .map_err(|e| format!("restoring region `{}`: {e}", self.names[index]))?;
                    restored += n as u64;
                }
                at += n as u64;
            }
        }
        Ok(restored)
    }

    /// Writes one journal entry into its base file (not yet durable: see
    /// [`Store::sync`]).
    pub fn apply(&mut self, region: u32, offset: u64, bytes: &[u8]) -> Result<(), String> {
        let i = region as usize;
        let len = *self.lens.get(i).ok_or_else(|| {
            format!(
                "a journal entry names region {region}, but there are {}",
                self.lens.len()
            )
        })?;
        if offset
            .checked_add(bytes.len() as u64)
            .is_none_or(|end| end > len)
        {
            return Err(format!(
                "a journal entry writes {} bytes at {offset} of region `{}`, which has {len}",
                bytes.len(),
                self.names[i]
            ));
        }
        self.files[i].write_all_at(bytes, offset).map_err(|e| {
            format!(
                "cannot write the base file {}: {e}",
                self.dir.join(file_name(&self.names[i])).display()
            )
        })?;
        self.dirty[i] = true;
        Ok(())
    }

    /// Makes every write since the last sync durable.
    pub fn sync(&mut self) -> Result<(), String> {
        for (i, file) in self.files.iter().enumerate() {
            if self.dirty[i] {
                file.sync_data().map_err(|e| {
                    format!(
                        "cannot fsync the base file of region `{}`: {e}",
                        self.names[i]
                    )
                })?;
                self.dirty[i] = false;
            }
        }
        Ok(())
    }
}

/// The `[start, end)` ranges of `file` (of `len` bytes) that may hold data, found with
/// `SEEK_DATA`/`SEEK_HOLE`; the whole file where the file system cannot say.
fn data_extents(file: &File, len: u64) -> Vec<(u64, u64)> {
    use rustix::fs::{SeekFrom, seek};
    let mut extents = Vec::new();
    let mut at = 0;
    while at < len {
        let start = match seek(file, SeekFrom::Data(at)) {
            Ok(start) => start,
            // No data after `at`.
            Err(rustix::io::Errno::NXIO) => break,
            Err(_) => return vec![(0, len)],
        };
        let end = match seek(file, SeekFrom::Hole(start)) {
            Ok(end) => end.min(len),
            Err(_) => return vec![(0, len)],
        };
        if end <= start {
            return vec![(0, len)];
        }
        extents.push((start, end));
        at = end;
    }
    extents
}

#[cfg(test)]
mod tests {
    use super::*;
    use fabric::sim::{SimConfig, SimNetwork};
    use fabric::{Access, Device};

    #[test]
    fn entries_land_in_sparse_files_that_load_into_regions() {
        let dir = tempfile::tempdir().unwrap();
        let plan = vec![
            ("catalog".to_string(), 4096),
            ("data.0".to_string(), 3 << 20),
        ];
        let mut store = Store::create(dir.path(), &plan).unwrap();
        store.apply(1, (2 << 20) + 5, b"hello").unwrap();
        store.apply(0, 0, &7u64.to_le_bytes()).unwrap();
        assert!(
            store
                .apply(1, 3 << 20, b"x")
                .unwrap_err()
                .contains("region `data.0`")
        );
        assert!(store.apply(2, 0, b"x").unwrap_err().contains("region 2"));
        store.sync().unwrap();

        let store = Store::open(dir.path(), &plan).unwrap();
        let dev = SimNetwork::new(SimConfig::default()).add_node();
        let region = dev.register(3 << 20, Access::ALL).unwrap();
        // Only what holds data is copied: at most the piece (or, without SEEK_DATA,
        // the 1 MiB chunk) around the one write.
        let copied = store.load(1, &region).unwrap();
        assert!((5..=1 << 20).contains(&copied), "{copied}");
        let extents = data_extents(&store.files[1], 3 << 20);
        assert!(
            extents
                .iter()
                .any(|&(s, e)| s <= (2 << 20) + 5 && e >= (2 << 20) + 10),
            "{extents:?}"
        );
        assert_eq!(region.to_vec((2 << 20) + 5, 5).unwrap(), b"hello");
        assert_eq!(region.load_u64(0).unwrap(), 0);

        let mut other = plan.clone();
        other[1].1 = 4 << 20;
        let err = Store::open(dir.path(), &other).err().unwrap();
        assert!(
            err.contains("is 3145728 bytes") && err.contains("data.0"),
            "{err}"
        );
    }
}
