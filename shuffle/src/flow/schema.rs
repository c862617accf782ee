//! Tuple schemas: fixed-width columns of 8-byte words, one of them the key.
//!
//! As in DFI, the schema is given once at flow declaration and never interpreted per
//! tuple: a tuple is a `&[u64]` of exactly [`Schema::width`] words and a column is an
//! offset into it.

use super::FlowError;
use std::fmt;

/// The type of a column. Numbers take one word; `Bytes(n)` takes `n` bytes rounded up
/// to whole words (see [`pack_bytes`] and [`unpack_bytes`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ColumnType {
    U64,
    I64,
    F64,
    Bytes(usize),
}

impl ColumnType {
    /// Words the column takes in a tuple.
    pub fn words(self) -> usize {
        match self {
            ColumnType::U64 | ColumnType::I64 | ColumnType::F64 => 1,
            ColumnType::Bytes(n) => n.div_ceil(8),
        }
    }
}

impl fmt::Display for ColumnType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ColumnType::U64 => f.write_str("u64"),
            ColumnType::I64 => f.write_str("i64"),
            ColumnType::F64 => f.write_str("f64"),
            ColumnType::Bytes(n) => write!(f, "bytes({n})"),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Column {
    pub name: String,
    pub ty: ColumnType,
}

impl Column {
    pub fn new(name: &str, ty: ColumnType) -> Column {
        Column {
            name: name.to_string(),
            ty,
        }
    }
    pub fn u64(name: &str) -> Column {
        Column::new(name, ColumnType::U64)
    }
    pub fn i64(name: &str) -> Column {
        Column::new(name, ColumnType::I64)
    }
    pub fn f64(name: &str) -> Column {
        Column::new(name, ColumnType::F64)
    }
    pub fn bytes(name: &str, len: usize) -> Column {
        Column::new(name, ColumnType::Bytes(len))
    }
}

/// Columns, their word offsets, and the key column.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Schema {
    columns: Vec<Column>,
    offsets: Vec<usize>,
    width: usize,
    key: usize,
}

impl Schema {
    /// A schema of `columns` keyed on the column named `key`.
    pub fn new(columns: Vec<Column>, key: &str) -> Result<Schema, FlowError> {
        let bad = |what: String| FlowError::Schema(what);
        if columns.is_empty() {
            return Err(bad("a schema needs at least one column".into()));
        }
        let mut offsets = Vec::with_capacity(columns.len());
        let mut width = 0;
        for (i, c) in columns.iter().enumerate() {
            if c.ty.words() == 0 {
                return Err(bad(format!("column {:?} has no bytes", c.name)));
            }
            if columns[..i].iter().any(|o| o.name == c.name) {
                return Err(bad(format!("column {:?} appears twice", c.name)));
            }
            offsets.push(width);
            width += c.ty.words();
        }
        let key = columns
            .iter()
            .position(|c| c.name == key)
            .ok_or_else(|| bad(format!("no key column {key:?}")))?;
        Ok(Schema {
            columns,
            offsets,
            width,
            key,
        })
    }

    /// Words per tuple.
    pub fn width(&self) -> usize {
        self.width
    }
    pub fn columns(&self) -> &[Column] {
        &self.columns
    }
    /// The index of the column named `name`.
    pub fn column(&self, name: &str) -> Option<usize> {
        self.columns.iter().position(|c| c.name == name)
    }
    /// The word offset of column `index` in a tuple.
    pub fn offset(&self, index: usize) -> usize {
        self.offsets[index]
    }
    /// The key column's index.
    pub fn key(&self) -> usize {
        self.key
    }
    /// The key column's words of `tuple`.
    #[inline]
    pub fn key_of<'t>(&self, tuple: &'t [u64]) -> &'t [u64] {
        let at = self.offsets[self.key];
        &tuple[at..at + self.columns[self.key].ty.words()]
    }
    /// Column `index` of `tuple`.
    #[inline]
    pub fn get<'t>(&self, tuple: &'t [u64], index: usize) -> &'t [u64] {
        let at = self.offsets[index];
        &tuple[at..at + self.columns[index].ty.words()]
    }
}

impl fmt::Display for Schema {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("(")?;
        for (i, c) in self.columns.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            let key = if i == self.key { " key" } else { "" };
            write!(f, "{} {}{key}", c.name, c.ty)?;
        }
        f.write_str(")")
    }
}

/// A typed value of one word.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Value {
    U64(u64),
    I64(i64),
    F64(f64),
}

impl Value {
    /// The value as it travels in a tuple.
    pub fn word(self) -> u64 {
        match self {
            Value::U64(v) => v,
            Value::I64(v) => v as u64,
            Value::F64(v) => v.to_bits(),
        }
    }
    /// Reads a word as a value of type `ty` (`None` for byte columns).
    pub fn from_word(ty: ColumnType, w: u64) -> Option<Value> {
        match ty {
            ColumnType::U64 => Some(Value::U64(w)),
            ColumnType::I64 => Some(Value::I64(w as i64)),
            ColumnType::F64 => Some(Value::F64(f64::from_bits(w))),
            ColumnType::Bytes(_) => None,
        }
    }
}

/// `bytes` as `words` words (zero-padded, little-endian); `None` if they do not fit.
pub fn pack_bytes(bytes: &[u8], words: usize) -> Option<Vec<u64>> {
    if bytes.len() > words * 8 {
        return None;
    }
    let mut out = vec![0u64; words];
    for (i, chunk) in bytes.chunks(8).enumerate() {
        let mut b = [0u8; 8];
        b[..chunk.len()].copy_from_slice(chunk);
        out[i] = u64::from_le_bytes(b);
    }
    Some(out)
}

/// The bytes of packed words (including any zero padding).
pub fn unpack_bytes(words: &[u64]) -> Vec<u8> {
    words.iter().flat_map(|w| w.to_le_bytes()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offsets_widths_and_keys() {
        let s = Schema::new(
            vec![
                Column::u64("id"),
                Column::bytes("name", 13),
                Column::f64("price"),
            ],
            "name",
        )
        .unwrap();
        assert_eq!(s.width(), 4);
        assert_eq!(s.offset(2), 3);
        let name = pack_bytes(b"hello, world!", 2).unwrap();
        let t = [7, name[0], name[1], 2.5f64.to_bits()];
        assert_eq!(s.key_of(&t), &name[..]);
        assert_eq!(&unpack_bytes(s.key_of(&t))[..13], b"hello, world!");
        assert!(pack_bytes(&[0; 17], 2).is_none());
        assert!(Schema::new(vec![Column::u64("a")], "b").is_err());
        assert!(Schema::new(vec![Column::u64("a"), Column::u64("a")], "a").is_err());
        assert!(Schema::new(vec![Column::bytes("a", 0)], "a").is_err());
        assert_eq!(s.to_string(), "(id u64, name bytes(13) key, price f64)");
    }
}
