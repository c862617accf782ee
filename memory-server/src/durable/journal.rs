//! The redo journal: its on-disk format, the reader that replays it, and the writer
//! thread that group-commits Persist requests into it.
//!
//! A journal file is `journal-<n>` (n zero-padded, so names sort as numbers):
//!
//! ```text
//! header:  "NAMDBJNL" | version u32 | n u64 | crc32(previous 20 bytes) u32
//! batch*:  len u32 | crc32(body) u32 | body[len]
//! body:    seq u64 | count u32 | entry[count]
//! entry:   region u32 | offset u64 | len u32 | bytes[len]
//! ```
//!
//! All integers little-endian. A batch is one group commit: every request the writer
//! drained, written with one `write` and made durable with one `fdatasync`. The crc
//! covers the whole batch rather than each entry because the batch is the unit that
//! can tear: pages of the batch being written when the machine dies may reach the disk
//! in any order, so an intact entry after a torn one proves nothing, while a whole
//! batch either checks out or was never acknowledged. Sequence numbers run on across
//! files, so a lost or reordered file is an error rather than silently skipped state.
//!
//! Only the newest journal can end in a torn batch (every earlier batch was synced
//! before a later one was written), and only if the bad batch reaches the end of the
//! file (or all that follows it is zeros, as after a crash that extended the file but
//! lost its pages). Anything else is corruption and refuses the start.

use crate::durable::meta::sync_dir;
use std::fs::{File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use tokio::sync::oneshot;

const MAGIC: &[u8; 8] = b"NAMDBJNL";
const VERSION: u32 = 1;
pub(crate) const FILE_HEADER_LEN: u64 = 24;
const BATCH_HEADER_LEN: u64 = 8;
/// seq u64 | count u32.
const BODY_HEADER_LEN: usize = 12;
/// region u32 | offset u64 | len u32.
pub(crate) const ENTRY_HEADER_LEN: usize = 16;
/// The writer stops draining requests into a batch once it holds this many bytes; a
/// single request (at most 64 MiB) always fits.
const BATCH_TARGET: usize = 64 << 20;
/// Larger claimed batches are garbage: one batch is at most `BATCH_TARGET` plus one
/// request.
const MAX_BATCH_BODY: u64 = 2 * BATCH_TARGET as u64 + (1 << 20);

/// The file name of journal `n`.
pub(crate) fn file_name(n: u64) -> String {
    format!("journal-{n:020}")
}

/// The number of a journal file name, or `None` for any other file.
pub(crate) fn parse_file_name(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("journal-")?;
    if digits.len() == 20 && digits.bytes().all(|b| b.is_ascii_digit()) {
        digits.parse().ok()
    } else {
        None
    }
}

/// The journal numbers in `dir`, ascending.
pub(crate) fn list(dir: &Path) -> io::Result<Vec<u64>> {
    let mut numbers = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        if let Some(n) = entry?.file_name().to_str().and_then(parse_file_name) {
            numbers.push(n);
        }
    }
    numbers.sort_unstable();
    Ok(numbers)
}

pub(crate) fn path(dir: &Path, n: u64) -> PathBuf {
    dir.join(file_name(n))
}

fn header(n: u64) -> [u8; FILE_HEADER_LEN as usize] {
    let mut h = [0u8; FILE_HEADER_LEN as usize];
    h[..8].copy_from_slice(MAGIC);
    h[8..12].copy_from_slice(&VERSION.to_le_bytes());
    h[12..20].copy_from_slice(&n.to_le_bytes());
    let crc = crc32fast::hash(&h[..20]);
    h[20..].copy_from_slice(&crc.to_le_bytes());
    h
}

/// Creates journal `n` with its header, durable (file and directory entry) before it
/// is returned: a batch acknowledged in it must not vanish with the file.
pub(crate) fn create(dir: &Path, n: u64) -> io::Result<File> {
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path(dir, n))?;
    file.write_all(&header(n))?;
    file.sync_all()?;
    sync_dir(dir)?;
    Ok(file)
}

/// Appends an entry header for `len` bytes at `offset` of region `region` to `out`;
/// the caller appends the bytes.
pub(crate) fn push_entry_header(out: &mut Vec<u8>, region: u32, offset: u64, len: u32) {
    out.extend_from_slice(&region.to_le_bytes());
    out.extend_from_slice(&offset.to_le_bytes());
    out.extend_from_slice(&len.to_le_bytes());
}

/// Appends one batch (header and body) holding `parts`, each a run of entries made
/// with [`push_entry_header`], to `out`.
pub(crate) fn encode_batch(out: &mut Vec<u8>, seq: u64, count: u32, parts: &[&[u8]]) {
    let body_len = BODY_HEADER_LEN + parts.iter().map(|p| p.len()).sum::<usize>();
    let mut body_head = [0u8; BODY_HEADER_LEN];
    body_head[..8].copy_from_slice(&seq.to_le_bytes());
    body_head[8..].copy_from_slice(&count.to_le_bytes());
    let mut crc = crc32fast::Hasher::new();
    crc.update(&body_head);
    for p in parts {
        crc.update(p);
    }
    out.reserve(BATCH_HEADER_LEN as usize + body_len);
    out.extend_from_slice(&(body_len as u32).to_le_bytes());
    out.extend_from_slice(&crc.finalize().to_le_bytes());
    out.extend_from_slice(&body_head);
    for p in parts {
        out.extend_from_slice(p);
    }
}

/// One entry of a replayed batch.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Entry<'a> {
    pub region: u32,
    pub offset: u64,
    pub bytes: &'a [u8],
}

/// Whether a bad batch at the end of the file may be cut off.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Tail {
    /// Every batch must check out (journals before the newest; closed journals).
    Strict,
    /// The newest journal at start: a torn last batch was never acknowledged.
    CutTorn,
}

/// What a scan found.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Scanned {
    pub batches: u64,
    pub entries: u64,
    /// Bytes of entry data.
    pub bytes: u64,
    pub last_seq: Option<u64>,
    /// Where the good part ends (the file's length when nothing was cut).
    pub valid_len: u64,
    /// Bytes after `valid_len` that were a torn tail.
    pub torn_bytes: u64,
    /// Why they were cut.
    pub torn_reason: Option<String>,
    /// The header itself was torn: the file was being created when the server died.
    pub header_torn: bool,
}

/// Reads journal `n` at `path` batch by batch, checking every batch and that sequence
/// numbers run on from `next_seq`, and hands each entry to `visit` in order.
pub(crate) fn scan(
    path: &Path,
    n: u64,
    tail: Tail,
    next_seq: u64,
    mut visit: impl FnMut(Entry<'_>) -> Result<(), String>,
) -> Result<Scanned, String> {
    let shown = path.display();
    let mut file = File::open(path).map_err(|e| format!("cannot open {shown}: {e}"))?;
    let file_len = file
        .metadata()
        .map_err(|e| format!("cannot stat {shown}: {e}"))?
        .len();
    let mut reader = io::BufReader::with_capacity(1 << 20, &mut file);
    let mut out = Scanned::default();
    let read_err = |e: io::Error| format!("cannot read {shown}: {e}");

    let mut head = [0u8; FILE_HEADER_LEN as usize];
    let got = read_up_to(&mut reader, &mut head).map_err(read_err)?;
    if got < head.len() || head != header(n) {
        // Created but not yet written when the server died: a short header, or zeros
        // where the file was extended but its pages never reached the disk.
        let zeros =
            head[..got].iter().all(|&b| b == 0) && all_zeros(&mut reader).map_err(read_err)?;
        if tail == Tail::CutTorn && (file_len < FILE_HEADER_LEN || zeros) {
            out.header_torn = true;
            out.torn_bytes = file_len;
            out.torn_reason = Some("the journal's header is incomplete".into());
            return Ok(out);
        }
        return Err(format!(
            "{shown} does not start with the header of journal {n}: it is not a namdb journal, \
             or it is corrupt"
        ));
    }

    let mut pos = FILE_HEADER_LEN;
    let mut expect = next_seq;
    let mut body = Vec::new();
    while pos < file_len {
        let bad = |why: String,
                   claimed_end: u64,
                   reader: &mut dyn Read|
         -> Result<Scanned, String> {
            let rest_zero = claimed_end < file_len && all_zeros(reader).map_err(read_err)?;
            if tail == Tail::CutTorn && (claimed_end >= file_len || rest_zero) {
                return Ok(Scanned {
                    valid_len: pos,
                    torn_bytes: file_len - pos,
                    torn_reason: Some(why),
                    ..Scanned::default()
                });
            }
            Err(format!(
                "journal {shown} is corrupt at byte {pos}: {why}; {} more bytes follow, so it is \
                 not an interrupted last write",
                file_len.saturating_sub(claimed_end)
            ))
        };
        let mut bh = [0u8; BATCH_HEADER_LEN as usize];
        if read_up_to(&mut reader, &mut bh).map_err(read_err)? < bh.len() {
            let cut = bad("a partial batch header".into(), file_len, &mut reader)?;
            return Ok(merge(out, cut));
        }
        let len = u64::from(u32::from_le_bytes(bh[..4].try_into().unwrap()));
        let crc = u32::from_le_bytes(bh[4..].try_into().unwrap());
        let end = pos + BATCH_HEADER_LEN + len;
        if len < BODY_HEADER_LEN as u64 || len > MAX_BATCH_BODY || end > file_len {
            let cut = bad(
                format!("a batch claiming {len} bytes"),
                end.min(file_len),
                &mut reader,
            )?;
            return Ok(merge(out, cut));
        }
        body.resize(len as usize, 0);
        reader.read_exact(&mut body).map_err(read_err)?;
        if crc32fast::hash(&body) != crc {
            let cut = bad(
                "a batch whose checksum does not match".into(),
                end,
                &mut reader,
            )?;
            return Ok(merge(out, cut));
        }
        // From here on the batch is exactly what the writer wrote: anything wrong with
        // it is corruption (or a bug), never a torn write.
        let seq = u64::from_le_bytes(body[..8].try_into().unwrap());
        let count = u32::from_le_bytes(body[8..12].try_into().unwrap());
        if seq != expect {
            return Err(format!(
                "journal {shown} at byte {pos} holds batch {seq} where batch {expect} was \
                 expected: a journal is missing or out of order"
            ));
        }
        let mut at = BODY_HEADER_LEN;
        for i in 0..count {
            let entry = parse_entry(&body, &mut at)
                .ok_or_else(|| format!("journal {shown}: entry {i} of batch {seq} is malformed"))?;
            out.entries += 1;
            out.bytes += entry.bytes.len() as u64;
            visit(entry)?;
        }
        if at != body.len() {
            return Err(format!(
                "journal {shown}: batch {seq} has bytes after its {count} entries"
            ));
        }
        out.batches += 1;
        out.last_seq = Some(seq);
        expect = seq + 1;
        pos = end;
    }
    out.valid_len = pos;
    Ok(out)
}

fn merge(good: Scanned, cut: Scanned) -> Scanned {
    Scanned {
        valid_len: cut.valid_len,
        torn_bytes: cut.torn_bytes,
        torn_reason: cut.torn_reason,
        ..good
    }
}

fn parse_entry<'a>(body: &'a [u8], at: &mut usize) -> Option<Entry<'a>> {
    let head = body.get(*at..*at + ENTRY_HEADER_LEN)?;
    let region = u32::from_le_bytes(head[..4].try_into().ok()?);
    let offset = u64::from_le_bytes(head[4..12].try_into().ok()?);
    let len = u32::from_le_bytes(head[12..16].try_into().ok()?) as usize;
    let start = *at + ENTRY_HEADER_LEN;
    let bytes = body.get(start..start.checked_add(len)?)?;
    *at = start + len;
    Some(Entry {
        region,
        offset,
        bytes,
    })
}

/// Reads until `buf` is full or the input ends; returns how much was read.
fn read_up_to(r: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        match r.read(&mut buf[got..]) {
            Ok(0) => break,
            Ok(k) => got += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(got)
}

fn all_zeros(r: &mut dyn Read) -> io::Result<bool> {
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let k = match r.read(&mut buf) {
            Ok(0) => return Ok(true),
            Ok(k) => k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if buf[..k].iter().any(|&b| b != 0) {
            return Ok(false);
        }
    }
}

/// Cuts a torn tail off journal `n` for good, so that later readers (the checkpoint
/// that applies it) see only whole batches; a journal whose header tore is removed.
pub(crate) fn cut(dir: &Path, n: u64, scanned: &Scanned) -> io::Result<()> {
    let p = path(dir, n);
    if scanned.header_torn {
        std::fs::remove_file(&p)?;
    } else {
        let file = OpenOptions::new().write(true).open(&p)?;
        file.set_len(scanned.valid_len)?;
        file.sync_all()?;
    }
    sync_dir(dir)
}

/// Counters the writer and the checkpointer keep for Stats.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub requests: AtomicU64,
    pub ranges: AtomicU64,
    pub bytes: AtomicU64,
    pub fsyncs: AtomicU64,
    pub checkpoints: AtomicU64,
    pub last_checkpoint_us: AtomicU64,
}

/// A request's entries, copied from region memory, waiting for the disk.
pub(crate) struct Pending {
    /// Entries made with [`push_entry_header`].
    pub entries: Vec<u8>,
    pub count: u32,
    /// Bytes of range data (entry headers excluded), the reply.
    pub bytes: u64,
    pub reply: oneshot::Sender<Result<u64, String>>,
}

/// What rotating the journal did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Rotated {
    /// The journal closed, or `None` when the current one was empty and was kept.
    pub closed: Option<u64>,
    /// The journal now being written.
    pub active: u64,
}

pub(crate) enum Msg {
    Persist(Pending),
    /// Close the current journal (after everything sent before this) and open the next.
    Rotate(mpsc::Sender<Result<Rotated, String>>),
}

/// The journal thread's state: the open journal and where the sequence stands.
pub(crate) struct Writer {
    dir: PathBuf,
    file: File,
    number: u64,
    next_seq: u64,
    /// Batches in the current file; an empty journal is not worth rotating.
    batches_in_file: u64,
    counters: Arc<Counters>,
    /// Bytes of the current file known to be on disk: its header and every batch
    /// acknowledged in it. A failed batch is cut back to here.
    durable_len: u64,
    /// Set when a failed batch could not be cut off the file: its tail can no longer
    /// be trusted, so nothing more is acknowledged until a restart replays the journal
    /// (which cuts the failed batch as a torn tail).
    failed: Option<String>,
}

impl Writer {
    /// The writer of `file`, journal `number` just made by [`create`], whose first
    /// batch gets sequence number `next_seq`.
    pub fn new(
        dir: &Path,
        file: File,
        number: u64,
        next_seq: u64,
        counters: Arc<Counters>,
    ) -> Writer {
        Writer {
            dir: dir.to_path_buf(),
            file,
            number,
            next_seq,
            batches_in_file: 0,
            counters,
            durable_len: FILE_HEADER_LEN,
            failed: None,
        }
    }

    /// Serves `rx` until every sender is gone.
    pub fn run(mut self, rx: mpsc::Receiver<Msg>) {
        let mut buf = Vec::new();
        let mut carried: Option<Msg> = None;
        loop {
            let first = match carried.take() {
                Some(m) => m,
                None => match rx.recv() {
                    Ok(m) => m,
                    Err(_) => return,
                },
            };
            let mut batch = Vec::new();
            let mut size = 0;
            let mut next = Some(first);
            // Group commit: take everything already waiting, up to a batch's worth.
            while let Some(msg) = next.take() {
                match msg {
                    Msg::Persist(p) => {
                        size += p.entries.len();
                        batch.push(p);
                    }
                    Msg::Rotate(reply) => {
                        self.commit(&mut buf, batch);
                        let _ = reply.send(self.rotate());
                        batch = Vec::new();
                        size = 0;
                    }
                }
                if size < BATCH_TARGET {
                    next = rx.try_recv().ok();
                }
            }
            if size >= BATCH_TARGET {
                // The batch is full; what comes next starts the following one.
                carried = rx.try_recv().ok();
            }
            self.commit(&mut buf, batch);
        }
    }

    fn commit(&mut self, buf: &mut Vec<u8>, batch: Vec<Pending>) {
        if batch.is_empty() {
            return;
        }
        if let Some(why) = &self.failed {
            let why = format!("the journal failed earlier ({why}); restart the memory server");
            for p in batch {
                let _ = p.reply.send(Err(why.clone()));
            }
            return;
        }
        buf.clear();
        let count: u32 = batch.iter().map(|p| p.count).sum();
        let parts: Vec<&[u8]> = batch.iter().map(|p| p.entries.as_slice()).collect();
        encode_batch(buf, self.next_seq, count, &parts);
        let result = self
            .file
            .write_all(buf)
            .and_then(|()| self.file.sync_data());
        self.counters.fsyncs.fetch_add(1, Ordering::Relaxed);
        match result {
            Ok(()) => {
                self.next_seq += 1;
                self.batches_in_file += 1;
                self.durable_len += buf.len() as u64;
                for p in batch {
                    self.counters.bytes.fetch_add(p.bytes, Ordering::Relaxed);
                    let _ = p.reply.send(Ok(p.bytes));
                }
            }
            Err(e) => {
                let why = format!(
                    "writing journal {} failed: {e}",
                    path(&self.dir, self.number).display()
                );
                // A full disk is the usual cause, and space can come back: with the
                // failed batch cut off, the file again ends at its last acknowledged
                // batch, so the next batch may go after it (a restart would find no
                // torn batch in the middle). The batch's sequence number is reused:
                // it is not in the file.
                let why = match self.cut_back() {
                    Ok(()) => {
                        tracing::error!(
                            "{why}; the failed batch was cut off the journal, and the next Persist tries again"
                        );
                        format!(
                            "{why} (nothing of this Persist was acknowledged; the next one tries again)"
                        )
                    }
                    Err(cut) => {
                        let why = format!("{why}, and cutting the failed batch off failed: {cut}");
                        tracing::error!("{why}; no further Persist is acknowledged until restart");
                        self.failed = Some(why.clone());
                        why
                    }
                };
                for p in batch {
                    let _ = p.reply.send(Err(why.clone()));
                }
            }
        }
        // Keep the buffer from pinning a batch's worth of memory while idle.
        if buf.capacity() > 4 << 20 {
            *buf = Vec::new();
        }
    }

    /// Truncates the current file to its acknowledged batches, durably, and puts the
    /// write position at its end.
    fn cut_back(&mut self) -> io::Result<()> {
        self.file.set_len(self.durable_len)?;
        self.file.seek(SeekFrom::Start(self.durable_len))?;
        self.file.sync_all()
    }

    fn rotate(&mut self) -> Result<Rotated, String> {
        if let Some(why) = &self.failed {
            return Err(format!("the journal failed earlier ({why})"));
        }
        if self.batches_in_file == 0 {
            return Ok(Rotated {
                closed: None,
                active: self.number,
            });
        }
        let next = self.number + 1;
        let file = create(&self.dir, next).map_err(|e| {
            format!(
                "cannot create journal {}: {e}",
                path(&self.dir, next).display()
            )
        })?;
        let closed = std::mem::replace(&mut self.number, next);
        self.file = file;
        self.batches_in_file = 0;
        self.durable_len = FILE_HEADER_LEN;
        Ok(Rotated {
            closed: Some(closed),
            active: next,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(region: u32, offset: u64, bytes: &[u8]) -> Vec<u8> {
        let mut v = Vec::new();
        push_entry_header(&mut v, region, offset, bytes.len() as u32);
        v.extend_from_slice(bytes);
        v
    }

    /// Journal 1 in `dir` with `batches` batches of two entries each, from seq 1.
    fn write_journal(dir: &Path, batches: u64) -> Vec<u64> {
        let mut file = create(dir, 1).unwrap();
        let mut ends = Vec::new();
        let mut pos = FILE_HEADER_LEN;
        for seq in 1..=batches {
            let a = entry(0, seq * 8, &seq.to_le_bytes());
            let b = entry(2, 4096, &[seq as u8; 100]);
            let mut buf = Vec::new();
            encode_batch(&mut buf, seq, 2, &[&a, &b]);
            file.write_all(&buf).unwrap();
            pos += buf.len() as u64;
            ends.push(pos);
        }
        ends
    }

    type Seen = Vec<(u32, u64, Vec<u8>)>;

    fn collect(dir: &Path, tail: Tail) -> Result<(Scanned, Seen), String> {
        let mut seen = Vec::new();
        let scanned = scan(&path(dir, 1), 1, tail, 1, |e| {
            seen.push((e.region, e.offset, e.bytes.to_vec()));
            Ok(())
        })?;
        Ok((scanned, seen))
    }

    #[test]
    fn batches_round_trip_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let ends = write_journal(dir.path(), 3);
        let (scanned, seen) = collect(dir.path(), Tail::Strict).unwrap();
        assert_eq!(scanned.batches, 3);
        assert_eq!(scanned.entries, 6);
        assert_eq!(scanned.bytes, 3 * 108);
        assert_eq!(scanned.last_seq, Some(3));
        assert_eq!(scanned.valid_len, *ends.last().unwrap());
        assert_eq!(scanned.torn_bytes, 0);
        assert_eq!(seen[0], (0, 8, 1u64.to_le_bytes().to_vec()));
        assert_eq!(seen[1], (2, 4096, vec![1; 100]));
        assert_eq!(seen[4], (0, 24, 3u64.to_le_bytes().to_vec()));
        assert_eq!(parse_file_name(&file_name(42)), Some(42));
        assert_eq!(parse_file_name("journal-42"), None);
        assert_eq!(list(dir.path()).unwrap(), [1]);
    }

    #[test]
    fn a_torn_last_batch_is_cut_and_stays_cut() {
        let dir = tempfile::tempdir().unwrap();
        let ends = write_journal(dir.path(), 3);
        let p = path(dir.path(), 1);
        // The process died half-way through writing batch 3.
        let half = ends[1] + (ends[2] - ends[1]) / 2;
        OpenOptions::new()
            .write(true)
            .open(&p)
            .unwrap()
            .set_len(half)
            .unwrap();
        let (scanned, seen) = collect(dir.path(), Tail::CutTorn).unwrap();
        assert_eq!((scanned.batches, scanned.last_seq), (2, Some(2)));
        assert_eq!(seen.len(), 4);
        assert_eq!(scanned.valid_len, ends[1]);
        assert_eq!(scanned.torn_bytes, half - ends[1]);
        // Strictly read, the same file is an error.
        assert!(
            collect(dir.path(), Tail::Strict)
                .unwrap_err()
                .contains("corrupt")
        );
        cut(dir.path(), 1, &scanned).unwrap();
        let (again, _) = collect(dir.path(), Tail::Strict).unwrap();
        assert_eq!((again.batches, again.valid_len), (2, ends[1]));

        // A whole-length last batch with a bad byte (its pages reached the disk out of
        // order) is torn too, as is a tail of zeros after it.
        let mut bytes = std::fs::read(&p).unwrap();
        let n = bytes.len();
        bytes[n - 3] ^= 0xff;
        bytes.extend_from_slice(&[0; 5000]);
        std::fs::write(&p, &bytes).unwrap();
        let (scanned, _) = collect(dir.path(), Tail::CutTorn).unwrap();
        assert_eq!((scanned.batches, scanned.valid_len), (1, ends[0]));
        assert!(scanned.torn_reason.unwrap().contains("checksum"));

        // A header that never made it: the file was being created.
        std::fs::write(&p, &header(1)[..10]).unwrap();
        let (scanned, _) = collect(dir.path(), Tail::CutTorn).unwrap();
        assert!(scanned.header_torn);
        cut(dir.path(), 1, &scanned).unwrap();
        assert!(!p.exists());
    }

    #[test]
    fn corruption_before_the_last_batch_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let ends = write_journal(dir.path(), 3);
        let p = path(dir.path(), 1);
        let mut bytes = std::fs::read(&p).unwrap();
        // A byte inside batch 2's data: batch 3, synced after it, follows.
        bytes[(ends[0] + 40) as usize] ^= 0x01;
        std::fs::write(&p, &bytes).unwrap();
        let err = collect(dir.path(), Tail::CutTorn).unwrap_err();
        assert!(
            err.contains("corrupt") && err.contains(&format!("byte {}", ends[0])),
            "{err}"
        );
        assert!(err.contains("not an interrupted last write"), "{err}");

        // A wrong header is not a journal at all.
        let mut bytes = std::fs::read(&p).unwrap();
        bytes[0] = b'X';
        std::fs::write(&p, &bytes).unwrap();
        let err = collect(dir.path(), Tail::CutTorn).unwrap_err();
        assert!(err.contains("header of journal 1"), "{err}");
    }

    #[test]
    fn a_gap_in_the_sequence_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        write_journal(dir.path(), 2);
        let err = scan(&path(dir.path(), 1), 1, Tail::CutTorn, 5, |_| Ok(())).unwrap_err();
        assert!(err.contains("batch 1 where batch 5 was expected"), "{err}");
    }

    #[test]
    fn the_writer_group_commits_and_rotates_after_what_came_before() {
        let dir = tempfile::tempdir().unwrap();
        let counters = Arc::new(Counters::default());
        let writer = Writer::new(
            dir.path(),
            create(dir.path(), 1).unwrap(),
            1,
            1,
            counters.clone(),
        );
        let (tx, rx) = mpsc::channel();
        let mut replies = Vec::new();
        // Queued before the thread starts, so one batch takes them all.
        for i in 0..10u64 {
            let (reply, wait) = oneshot::channel();
            tx.send(Msg::Persist(Pending {
                entries: entry(1, i * 8, &i.to_le_bytes()),
                count: 1,
                bytes: 8,
                reply,
            }))
            .unwrap();
            replies.push(wait);
        }
        let (rot_tx, rot_rx) = mpsc::channel();
        tx.send(Msg::Rotate(rot_tx)).unwrap();
        let thread = std::thread::spawn(move || writer.run(rx));
        for r in replies {
            assert_eq!(r.blocking_recv().unwrap(), Ok(8));
        }
        assert_eq!(
            rot_rx.recv().unwrap(),
            Ok(Rotated {
                closed: Some(1),
                active: 2
            })
        );
        assert_eq!(counters.fsyncs.load(Ordering::Relaxed), 1);
        assert_eq!(counters.bytes.load(Ordering::Relaxed), 80);
        // Rotating an empty journal keeps it.
        let (rot_tx, rot_rx) = mpsc::channel();
        tx.send(Msg::Rotate(rot_tx)).unwrap();
        assert_eq!(rot_rx.recv().unwrap().unwrap().closed, None);
        drop(tx);
        thread.join().unwrap();
        let s = scan(&path(dir.path(), 1), 1, Tail::Strict, 1, |_| Ok(())).unwrap();
        assert_eq!((s.batches, s.entries), (1, 10));
        assert_eq!(list(dir.path()).unwrap(), [1, 2]);
    }

    #[test]
    fn a_failed_write_is_reported_and_nothing_more_is_acknowledged() {
        let dir = tempfile::tempdir().unwrap();
        drop(create(dir.path(), 1).unwrap());
        // Read-only: every write fails, as on a full or failing disk.
        let file = File::open(path(dir.path(), 1)).unwrap();
        let writer = Writer::new(dir.path(), file, 1, 1, Arc::new(Counters::default()));
        let (tx, rx) = mpsc::channel();
        let thread = std::thread::spawn(move || writer.run(rx));
        let send = |tx: &mpsc::Sender<Msg>| {
            let (reply, wait) = oneshot::channel();
            tx.send(Msg::Persist(Pending {
                entries: entry(0, 0, b"x"),
                count: 1,
                bytes: 1,
                reply,
            }))
            .unwrap();
            wait.blocking_recv().unwrap().unwrap_err()
        };
        let first = send(&tx);
        assert!(
            first.contains("writing journal") && first.contains("journal-"),
            "{first}"
        );
        let later = send(&tx);
        assert!(
            later.contains("failed earlier") && later.contains("restart"),
            "{later}"
        );
        let (rot_tx, rot_rx) = mpsc::channel();
        tx.send(Msg::Rotate(rot_tx)).unwrap();
        assert!(
            rot_rx
                .recv()
                .unwrap()
                .unwrap_err()
                .contains("failed earlier")
        );
        drop(tx);
        thread.join().unwrap();
    }
}
