//! Record block layout in memory-server memory (DESIGN.md, "Data layout").
//!
//! A block has a fixed size per table ([`BlockShape`]), is 8-byte aligned, and is a
//! sequence of little-endian 64-bit words:
//!
//! ```text
//! word 0            header   lock:1 | CID:63
//! word 1            the record's key (written at insert, never changed: scans need it)
//! then n versions, newest first, each of 2 + ceil(value_cap / 8) words:
//!   meta word       present:1 | tombstone:1 | CID:62
//!   length word     bytes of the value (≤ value_cap)
//!   value words     the value, zero-padded to a whole word
//! ```
//!
//! - The header's CID is the commit timestamp of the newest version. A **locked** header
//!   is `LOCK | cid` where `cid` is the commit timestamp of the transaction holding the
//!   lock: a timestamp belongs to exactly one oracle slot, so the holder is identified
//!   (a dead node's locks can be found by its slot). See [`Header`].
//! - A version's meta word says whether the slot holds a version at all (`present`),
//!   whether it is a delete (`tombstone`), and the CID that wrote it.
//! - A freshly inserted record carries, behind its first version, a tombstone at CID 0
//!   (when the block has room for two versions): "absent since the beginning", so a
//!   reader whose snapshot predates the insert gets `None`, not `SnapshotTooOld`.
//!
//! [`accept`] is the reader's torn-read guard (a seqlock): the block and, in the same
//! doorbell after it, the header word are READ; the block is accepted only if its header
//! equals the second header and is unlocked.

use thiserror::Error;

/// The lock bit of a header word.
pub const LOCK: u64 = 1 << 63;
/// The largest CID a header can hold (63 bits) and a version can hold (62 bits).
pub const MAX_CID: u64 = (1 << 62) - 1;

const PRESENT: u64 = 1 << 63;
const TOMB: u64 = 1 << 62;
const VERSION_CID: u64 = (1 << 62) - 1;
/// Header and key words before the versions.
const PREAMBLE_WORDS: u64 = 2;
/// Byte offset of the versions in a block: where an install WRITEs.
pub const VERSIONS_OFFSET: u64 = 8 * PREAMBLE_WORDS;

/// A header word: `lock:1 | CID:63`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Header {
    /// Locked by the transaction whose commit timestamp is `cid`; unlocked, `cid` is the
    /// newest version's CID.
    pub locked: bool,
    pub cid: u64,
}

impl Header {
    pub fn unlocked(cid: u64) -> Header {
        Header { locked: false, cid }
    }
    /// The header a committing transaction with timestamp `holder` swaps in.
    pub fn locked_by(holder: u64) -> Header {
        Header {
            locked: true,
            cid: holder,
        }
    }
    pub fn encode(self) -> u64 {
        debug_assert!(self.cid <= MAX_CID);
        (if self.locked { LOCK } else { 0 }) | (self.cid & !LOCK)
    }
    pub fn decode(word: u64) -> Header {
        Header {
            locked: word & LOCK != 0,
            cid: word & !LOCK,
        }
    }
}

/// One version of a record.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Version {
    pub cid: u64,
    /// `None` is a tombstone (a delete).
    pub value: Option<Vec<u8>>,
}

/// The fixed shape of a table's blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BlockShape {
    /// Versions kept per record (≥ 1).
    pub versions: u32,
    /// The largest value in bytes.
    pub value_cap: u32,
}

impl BlockShape {
    pub fn new(versions: u32, value_cap: u32) -> Result<BlockShape, LayoutError> {
        if versions == 0 {
            return Err(LayoutError::Shape(
                "a block needs at least one version".into(),
            ));
        }
        let shape = BlockShape {
            versions,
            value_cap,
        };
        if shape.block_bytes() > u32::MAX as u64 {
            return Err(LayoutError::Shape(format!(
                "block of {} bytes is too large",
                shape.block_bytes()
            )));
        }
        Ok(shape)
    }
    fn value_words(&self) -> u64 {
        (self.value_cap as u64).div_ceil(8)
    }
    /// Words per version: meta, length, value.
    pub fn version_words(&self) -> u64 {
        2 + self.value_words()
    }
    /// Bytes per block, a multiple of 8.
    pub fn block_bytes(&self) -> u64 {
        8 * (PREAMBLE_WORDS + self.versions as u64 * self.version_words())
    }
    /// Byte offset of version `i` (0 = newest) inside the block.
    pub fn version_offset(&self, i: u32) -> u64 {
        8 * (PREAMBLE_WORDS + i as u64 * self.version_words())
    }
}

/// A decoded block: header and the versions present, newest first.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Block {
    pub header: Header,
    pub key: u64,
    pub versions: Vec<Version>,
}

/// What a reader may get from a block for a snapshot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Visible<'a> {
    /// The newest version with CID ≤ RID.
    Version(&'a Version),
    /// The block never held a version this old: the record did not exist.
    Absent,
    /// No version kept is old enough, and older ones were dropped.
    TooOld,
}

impl Block {
    /// A new record's block: `value` at `cid`, then (if the shape keeps two versions) a
    /// tombstone at CID 0, with `header`.
    pub fn inserted(
        header: Header,
        key: u64,
        cid: u64,
        value: Vec<u8>,
        shape: BlockShape,
    ) -> Block {
        let mut versions = vec![Version {
            cid,
            value: Some(value),
        }];
        if shape.versions >= 2 {
            versions.push(Version {
                cid: 0,
                value: None,
            });
        }
        Block {
            header,
            key,
            versions,
        }
    }

    /// The version a snapshot at `rid` sees: the newest with CID ≤ RID.
    pub fn visible(&self, rid: u64, shape: BlockShape) -> Visible<'_> {
        match self.versions.iter().find(|v| v.cid <= rid) {
            Some(v) => Visible::Version(v),
            // Nothing was ever dropped from a block that is not full: the record did
            // not exist at rid.
            None if self.versions.len() < shape.versions as usize => Visible::Absent,
            None => Visible::TooOld,
        }
    }

    /// This block with `new` at the head and the older versions shifted (the oldest
    /// dropped when the block is full).
    pub fn with_new_version(&self, new: Version, shape: BlockShape) -> Vec<Version> {
        let mut v = Vec::with_capacity(shape.versions as usize);
        v.push(new);
        v.extend(
            self.versions
                .iter()
                .take(shape.versions as usize - 1)
                .cloned(),
        );
        v
    }
}

#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum LayoutError {
    #[error("invalid block shape: {0}")]
    Shape(String),
    #[error("block buffer is {got} bytes, the shape needs {want}")]
    Size { got: usize, want: u64 },
    #[error("version {index} is malformed: {why}")]
    Malformed { index: u32, why: String },
    #[error(
        "value of {len} bytes exceeds the table's value cap of {cap} bytes, fixed when the table was created"
    )]
    ValueTooLarge { len: usize, cap: u32 },
    #[error("{count} versions do not fit a block of {cap}")]
    TooManyVersions { count: usize, cap: u32 },
    #[error("CID {0} does not fit a version's 62 bits")]
    CidTooLarge(u64),
    /// The seqlock check failed: the header inside the block differs from the one read
    /// after it, so a writer installed in between.
    #[error("torn read: header {inner:#x} in the block, {after:#x} after it")]
    Torn { inner: u64, after: u64 },
    /// The block is locked by the transaction with this commit timestamp.
    #[error("record locked by transaction {holder}")]
    Locked { holder: u64 },
}

fn word(bytes: &[u8], i: u64) -> u64 {
    let o = (i * 8) as usize;
    u64::from_le_bytes(bytes[o..o + 8].try_into().expect("8 bytes"))
}

/// The header word of a block's bytes, as READ.
pub fn header_word(bytes: &[u8]) -> u64 {
    word(bytes, 0)
}

/// The key word of a block's bytes, as READ: written at insert and never changed, so
/// it holds even in a torn or locked block.
pub fn key_word(bytes: &[u8]) -> u64 {
    word(bytes, 1)
}

fn put_word(bytes: &mut [u8], i: u64, w: u64) {
    let o = (i * 8) as usize;
    bytes[o..o + 8].copy_from_slice(&w.to_le_bytes());
}

/// Encodes the versions part of a block (everything after the header word): what an
/// install WRITEs while the header stays locked.
pub fn encode_versions(versions: &[Version], shape: BlockShape) -> Result<Vec<u8>, LayoutError> {
    if versions.len() > shape.versions as usize {
        return Err(LayoutError::TooManyVersions {
            count: versions.len(),
            cap: shape.versions,
        });
    }
    let mut out = vec![0u8; (shape.block_bytes() - VERSIONS_OFFSET) as usize];
    for (i, v) in versions.iter().enumerate() {
        put_version(&mut out, i as u64, v.cid, v.value.as_deref(), shape)?;
    }
    Ok(out)
}

/// Writes version `i` (`None` a tombstone) into a zeroed versions area.
fn put_version(
    out: &mut [u8],
    i: u64,
    cid: u64,
    value: Option<&[u8]>,
    shape: BlockShape,
) -> Result<(), LayoutError> {
    if cid > VERSION_CID {
        return Err(LayoutError::CidTooLarge(cid));
    }
    let base = i * shape.version_words();
    let mut meta = PRESENT | cid;
    match value {
        None => meta |= TOMB,
        Some(value) => {
            if value.len() > shape.value_cap as usize {
                return Err(LayoutError::ValueTooLarge {
                    len: value.len(),
                    cap: shape.value_cap,
                });
            }
            put_word(out, base + 1, value.len() as u64);
            let o = ((base + 2) * 8) as usize;
            out[o..o + value.len()].copy_from_slice(value);
        }
    }
    put_word(out, base, meta);
    Ok(())
}

/// The bytes of [`encode`]`(&Block::inserted(header, key, cid, value, shape))`, into
/// `out` (cleared first) and without the block's allocations: what a commit WRITEs
/// for each new record.
pub fn encode_inserted_into(
    header: Header,
    key: u64,
    cid: u64,
    value: &[u8],
    shape: BlockShape,
    out: &mut Vec<u8>,
) -> Result<(), LayoutError> {
    if header.cid > MAX_CID {
        return Err(LayoutError::CidTooLarge(header.cid));
    }
    out.clear();
    out.resize(shape.block_bytes() as usize, 0);
    put_word(out, 0, header.encode());
    put_word(out, 1, key);
    let versions = &mut out[VERSIONS_OFFSET as usize..];
    put_version(versions, 0, cid, Some(value), shape)?;
    if shape.versions >= 2 {
        put_version(versions, 1, 0, None, shape)?;
    }
    Ok(())
}

/// Encodes a whole block.
pub fn encode(block: &Block, shape: BlockShape) -> Result<Vec<u8>, LayoutError> {
    if block.header.cid > MAX_CID {
        return Err(LayoutError::CidTooLarge(block.header.cid));
    }
    let mut out = Vec::with_capacity(shape.block_bytes() as usize);
    out.extend_from_slice(&block.header.encode().to_le_bytes());
    out.extend_from_slice(&block.key.to_le_bytes());
    out.extend_from_slice(&encode_versions(&block.versions, shape)?);
    Ok(out)
}

/// Decodes a block. Versions must be present as a prefix (no present version after an
/// absent one), with CIDs strictly decreasing and lengths within the shape.
pub fn decode(bytes: &[u8], shape: BlockShape) -> Result<Block, LayoutError> {
    validate(bytes, shape)?;
    let vw = shape.version_words();
    let mut versions: Vec<Version> = Vec::new();
    for i in 0..shape.versions {
        let base = PREAMBLE_WORDS + i as u64 * vw;
        let meta = word(bytes, base);
        if meta & PRESENT == 0 {
            break;
        }
        let value = (meta & TOMB == 0).then(|| {
            let len = word(bytes, base + 1) as usize;
            let o = ((base + 2) * 8) as usize;
            bytes[o..o + len].to_vec()
        });
        versions.push(Version {
            cid: meta & VERSION_CID,
            value,
        });
    }
    Ok(Block {
        header: Header::decode(header_word(bytes)),
        key: key_word(bytes),
        versions,
    })
}

/// A version as it lies in a READ block, without copying its value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VisibleRaw<'a> {
    /// The newest version with CID ≤ RID: its CID and value (`None`: a tombstone).
    Version {
        cid: u64,
        value: Option<&'a [u8]>,
    },
    Absent,
    TooOld,
}

/// Checks what [`decode`] checks, without building anything: versions present as a
/// prefix, CIDs strictly decreasing, lengths within the shape. A block that passes can
/// be read with [`visible_raw`] and rewritten with [`write_installed`].
pub fn validate(bytes: &[u8], shape: BlockShape) -> Result<(), LayoutError> {
    if bytes.len() as u64 != shape.block_bytes() {
        return Err(LayoutError::Size {
            got: bytes.len(),
            want: shape.block_bytes(),
        });
    }
    let vw = shape.version_words();
    let mut ended = false;
    let mut previous: Option<u64> = None;
    for i in 0..shape.versions {
        let base = PREAMBLE_WORDS + i as u64 * vw;
        let meta = word(bytes, base);
        let bad = |why: &str| LayoutError::Malformed {
            index: i,
            why: why.into(),
        };
        if meta & PRESENT == 0 {
            if meta != 0 {
                return Err(bad("absent version with a non-zero meta word"));
            }
            ended = true;
            continue;
        }
        if ended {
            return Err(bad("present version after an absent one"));
        }
        let cid = meta & VERSION_CID;
        if previous.is_some_and(|p| p <= cid) {
            return Err(bad("CIDs do not decrease"));
        }
        previous = Some(cid);
        if meta & TOMB == 0 && word(bytes, base + 1) > shape.value_cap as u64 {
            return Err(bad("length exceeds the value capacity"));
        }
    }
    Ok(())
}

/// The version a snapshot at `rid` sees in a block that passed [`validate`].
pub fn visible_raw(bytes: &[u8], rid: u64, shape: BlockShape) -> VisibleRaw<'_> {
    let vw = shape.version_words();
    for i in 0..shape.versions {
        let base = PREAMBLE_WORDS + i as u64 * vw;
        let meta = word(bytes, base);
        if meta & PRESENT == 0 {
            // Nothing was ever dropped from a block that is not full.
            return VisibleRaw::Absent;
        }
        let cid = meta & VERSION_CID;
        if cid <= rid {
            let value = if meta & TOMB != 0 {
                None
            } else {
                let len = word(bytes, base + 1) as usize;
                let o = ((base + 2) * 8) as usize;
                Some(&bytes[o..o + len])
            };
            return VisibleRaw::Version { cid, value };
        }
    }
    VisibleRaw::TooOld
}

/// The versions part of a block after installing `value` at `cid` over `bytes` (a
/// block that passed [`validate`]): the new version first, the older ones shifted
/// (the oldest dropped when the block is full), written into `out`
/// (`block_bytes - VERSIONS_OFFSET` bytes).
pub fn write_installed(
    bytes: &[u8],
    cid: u64,
    value: Option<&[u8]>,
    shape: BlockShape,
    out: &mut [u8],
) -> Result<(), LayoutError> {
    let version_bytes = (shape.version_words() * 8) as usize;
    let versions_len = (shape.block_bytes() - VERSIONS_OFFSET) as usize;
    if out.len() != versions_len || bytes.len() != shape.block_bytes() as usize {
        return Err(LayoutError::Size {
            got: out.len(),
            want: versions_len as u64,
        });
    }
    out[..version_bytes].fill(0);
    put_version(out, 0, cid, value, shape)?;
    let old = VERSIONS_OFFSET as usize;
    out[version_bytes..].copy_from_slice(&bytes[old..old + versions_len - version_bytes]);
    Ok(())
}

/// [`accept`] without decoding: the block's header if the block is whole, unlocked
/// and valid.
pub fn accept_raw(
    block: &[u8],
    header_after: u64,
    shape: BlockShape,
) -> Result<Header, LayoutError> {
    if block.len() < 8 {
        return Err(LayoutError::Size {
            got: block.len(),
            want: shape.block_bytes(),
        });
    }
    let inner = word(block, 0);
    if inner != header_after {
        return Err(LayoutError::Torn {
            inner,
            after: header_after,
        });
    }
    let h = Header::decode(inner);
    if h.locked {
        return Err(LayoutError::Locked { holder: h.cid });
    }
    validate(block, shape)?;
    Ok(h)
}

/// The seqlock check: `block` was READ, then `header_after` (the header word) in the
/// same doorbell. Accepts only equal, unlocked headers.
pub fn accept(block: &[u8], header_after: u64, shape: BlockShape) -> Result<Block, LayoutError> {
    accept_raw(block, header_after, shape)?;
    decode(block, shape)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn shape() -> BlockShape {
        BlockShape::new(3, 20).unwrap()
    }

    #[test]
    fn sizes_are_word_multiples() {
        let s = shape();
        assert_eq!(s.version_words(), 2 + 3);
        assert_eq!(s.block_bytes(), 8 * (2 + 3 * 5));
        assert_eq!(s.version_offset(1), 8 * 7);
        assert!(BlockShape::new(0, 8).is_err());
        let s = BlockShape::new(1, 0).unwrap();
        assert_eq!(s.block_bytes(), 32);
    }

    #[test]
    fn header_round_trip_and_lock_bit() {
        assert_eq!(Header::locked_by(7).encode(), LOCK | 7);
        assert_eq!(Header::decode(LOCK | 7), Header::locked_by(7));
        assert_eq!(Header::decode(9), Header::unlocked(9));
    }

    #[test]
    fn visibility_and_too_old() {
        let s = shape();
        let b = Block {
            header: Header::unlocked(30),
            key: 7,
            versions: vec![
                Version {
                    cid: 30,
                    value: Some(b"c".to_vec()),
                },
                Version {
                    cid: 20,
                    value: None,
                },
                Version {
                    cid: 10,
                    value: Some(b"a".to_vec()),
                },
            ],
        };
        assert_eq!(b.visible(35, s), Visible::Version(&b.versions[0]));
        assert_eq!(b.visible(29, s), Visible::Version(&b.versions[1]));
        assert_eq!(b.visible(10, s), Visible::Version(&b.versions[2]));
        assert_eq!(b.visible(9, s), Visible::TooOld);
        let shifted = b.with_new_version(
            Version {
                cid: 40,
                value: Some(b"d".to_vec()),
            },
            s,
        );
        assert_eq!(shifted.len(), 3);
        assert_eq!(shifted[0].cid, 40);
        assert_eq!(shifted[2].cid, 20);
        let ins = Block::inserted(Header::unlocked(5), 42, 5, b"x".to_vec(), s);
        assert!(matches!(ins.visible(4, s), Visible::Version(v) if v.value.is_none()));
        let one = Block {
            header: Header::unlocked(5),
            key: 7,
            versions: vec![ins.versions[0].clone()],
        };
        assert_eq!(one.visible(4, s), Visible::Absent);
    }

    #[test]
    fn encode_rejects_oversize() {
        let s = shape();
        let big = Block::inserted(Header::unlocked(1), 42, 1, vec![0; 21], s);
        assert!(matches!(
            encode(&big, s),
            Err(LayoutError::ValueTooLarge { .. })
        ));
        let mut out = Vec::new();
        assert!(matches!(
            encode_inserted_into(Header::unlocked(1), 42, 1, &[0; 21], s, &mut out),
            Err(LayoutError::ValueTooLarge { .. })
        ));
        let many = Block {
            header: Header::unlocked(1),
            key: 7,
            versions: (0..4)
                .rev()
                .map(|c| Version {
                    cid: c,
                    value: None,
                })
                .collect(),
        };
        assert!(matches!(
            encode(&many, s),
            Err(LayoutError::TooManyVersions { .. })
        ));
    }

    #[test]
    fn decode_rejects_malformed() {
        let s = shape();
        let mut bytes =
            encode(&Block::inserted(Header::unlocked(5), 42, 5, vec![1], s), s).unwrap();
        // Make version 1 absent while version 2 is present.
        let v2 = s.version_offset(2) as usize;
        bytes[v2..v2 + 8].copy_from_slice(&(PRESENT | 1).to_le_bytes());
        let v1 = s.version_offset(1) as usize;
        bytes[v1..v1 + 8].copy_from_slice(&0u64.to_le_bytes());
        assert!(matches!(
            decode(&bytes, s),
            Err(LayoutError::Malformed { index: 2, .. })
        ));
        assert!(matches!(
            decode(&bytes[..8], s),
            Err(LayoutError::Size { .. })
        ));
    }

    fn arb_block(s: BlockShape) -> impl Strategy<Value = Block> {
        (
            any::<bool>(),
            0..=MAX_CID,
            prop::collection::btree_set(0..=MAX_CID, 0..=s.versions as usize),
            prop::collection::vec(
                prop::option::of(prop::collection::vec(any::<u8>(), 0..=s.value_cap as usize)),
                s.versions as usize,
            ),
        )
            .prop_map(|(locked, hcid, cids, values)| Block {
                header: Header { locked, cid: hcid },
                key: hcid ^ 0x5555,
                versions: cids
                    .into_iter()
                    .rev()
                    .zip(values)
                    .map(|(cid, value)| Version { cid, value })
                    .collect(),
            })
    }

    proptest! {
        #[test]
        fn decode_inverts_encode(b in arb_block(shape())) {
            let s = shape();
            let bytes = encode(&b, s).unwrap();
            prop_assert_eq!(bytes.len() as u64, s.block_bytes());
            prop_assert_eq!(decode(&bytes, s).unwrap(), b);
        }

        #[test]
        fn accept_only_equal_unlocked_headers(b in arb_block(shape()), other in any::<u64>()) {
            let s = shape();
            let bytes = encode(&b, s).unwrap();
            let h = b.header.encode();
            match accept(&bytes, h, s) {
                Ok(got) => {
                    prop_assert!(!b.header.locked);
                    prop_assert_eq!(got, b.clone());
                }
                Err(LayoutError::Locked { holder }) => {
                    prop_assert!(b.header.locked);
                    prop_assert_eq!(holder, b.header.cid);
                }
                Err(e) => prop_assert!(false, "unexpected {e}"),
            }
            if other != h {
                let torn = matches!(accept(&bytes, other, s), Err(LayoutError::Torn { .. }));
                prop_assert!(torn);
            }
        }
    }

    proptest! {
        #[test]
        fn raw_helpers_agree_with_decode(b in arb_block(shape()), rid in 0..=MAX_CID, cid in 0..=MAX_CID, v in prop::option::of(prop::collection::vec(any::<u8>(), 0..=20usize))) {
            let s = shape();
            let bytes = encode(&b, s).unwrap();
            prop_assert!(validate(&bytes, s).is_ok());
            let want = match b.visible(rid, s) {
                Visible::Version(v) => VisibleRaw::Version { cid: v.cid, value: v.value.as_deref() },
                Visible::Absent => VisibleRaw::Absent,
                Visible::TooOld => VisibleRaw::TooOld,
            };
            prop_assert_eq!(visible_raw(&bytes, rid, s), want);
            let mut out = vec![0u8; (s.block_bytes() - VERSIONS_OFFSET) as usize];
            let new = Version { cid, value: v.clone() };
            write_installed(&bytes, cid, v.as_deref(), s, &mut out).unwrap();
            prop_assert_eq!(out, encode_versions(&b.with_new_version(new, s), s).unwrap());
        }

        #[test]
        fn encode_inserted_into_matches_encode(
            versions in 1u32..4,
            locked in any::<bool>(),
            cid in 0..=MAX_CID,
            key in any::<u64>(),
            value in prop::collection::vec(any::<u8>(), 0..=20usize),
            stale in prop::collection::vec(any::<u8>(), 0..400usize),
        ) {
            let s = BlockShape::new(versions, 20).unwrap();
            let header = Header { locked, cid };
            let want = encode(&Block::inserted(header, key, cid, value.clone(), s), s).unwrap();
            // A reused buffer: whatever it held before is gone.
            let mut out = stale;
            encode_inserted_into(header, key, cid, &value, s, &mut out).unwrap();
            prop_assert_eq!(out, want);
        }

        #[test]
        fn validate_agrees_with_decode(bytes in prop::collection::vec(any::<u8>(), 0..200usize)) {
            let s = shape();
            let mut bytes = bytes;
            bytes.resize(s.block_bytes() as usize, 0);
            prop_assert_eq!(validate(&bytes, s).is_ok(), decode(&bytes, s).is_ok());
        }
    }
}
