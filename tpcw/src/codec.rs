//! The byte encoding of rows: little-endian fixed-width numbers and length-prefixed
//! strings, in column order. Every system stores the same bytes (RSI and 2PC as
//! values; PostgreSQL converts them to and from columns), so an interaction's logic is
//! written once.

use thiserror::Error;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum CodecError {
    #[error("{what}: row ends after {at} bytes, a field needs more")]
    Truncated { what: &'static str, at: usize },
    #[error("{what}: field at byte {at} is not UTF-8")]
    NotUtf8 { what: &'static str, at: usize },
    #[error("{what}: {extra} bytes after the last field")]
    Trailing { what: &'static str, extra: usize },
}

pub struct Enc {
    pub bytes: Vec<u8>,
}

impl Enc {
    pub fn with_capacity(n: usize) -> Enc {
        Enc {
            bytes: Vec::with_capacity(n),
        }
    }
    pub fn u8(&mut self, v: u8) -> &mut Self {
        self.bytes.push(v);
        self
    }
    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.bytes.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn i32(&mut self, v: i32) -> &mut Self {
        self.bytes.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.bytes.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn i64(&mut self, v: i64) -> &mut Self {
        self.bytes.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn f64(&mut self, v: f64) -> &mut Self {
        self.bytes.extend_from_slice(&v.to_le_bytes());
        self
    }
    /// Strings longer than 65535 bytes are cut (no TPC-W column comes close).
    pub fn str(&mut self, s: &str) -> &mut Self {
        let mut end = s.len().min(u16::MAX as usize);
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        self.bytes.extend_from_slice(&(end as u16).to_le_bytes());
        self.bytes.extend_from_slice(&s.as_bytes()[..end]);
        self
    }
    pub fn finish(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.bytes)
    }
}

pub struct Dec<'a> {
    what: &'static str,
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Dec<'a> {
    pub fn new(what: &'static str, bytes: &'a [u8]) -> Dec<'a> {
        Dec { what, bytes, at: 0 }
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8], CodecError> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.bytes.len());
        match end {
            Some(end) => {
                let s = &self.bytes[self.at..end];
                self.at = end;
                Ok(s)
            }
            None => Err(CodecError::Truncated {
                what: self.what,
                at: self.bytes.len(),
            }),
        }
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N], CodecError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }
    pub fn u8(&mut self) -> Result<u8, CodecError> {
        Ok(self.take(1)?[0])
    }
    pub fn u32(&mut self) -> Result<u32, CodecError> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    pub fn i32(&mut self) -> Result<i32, CodecError> {
        Ok(i32::from_le_bytes(self.array()?))
    }
    pub fn u64(&mut self) -> Result<u64, CodecError> {
        Ok(u64::from_le_bytes(self.array()?))
    }
    pub fn i64(&mut self) -> Result<i64, CodecError> {
        Ok(i64::from_le_bytes(self.array()?))
    }
    pub fn f64(&mut self) -> Result<f64, CodecError> {
        Ok(f64::from_le_bytes(self.array()?))
    }
    pub fn str(&mut self) -> Result<String, CodecError> {
        let len = u16::from_le_bytes(self.array()?) as usize;
        let at = self.at;
        let bytes = self.take(len)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| CodecError::NotUtf8 {
            what: self.what,
            at,
        })
    }
    /// Fails unless every byte was consumed.
    pub fn end(&self) -> Result<(), CodecError> {
        match self.bytes.len() - self.at {
            0 => Ok(()),
            extra => Err(CodecError::Trailing {
                what: self.what,
                extra,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_errors() {
        let bytes = Enc::with_capacity(0)
            .u8(7)
            .u32(1 << 20)
            .i32(-5)
            .u64(u64::MAX)
            .i64(-9)
            .f64(1.5)
            .str("héllo")
            .finish();
        let mut d = Dec::new("t", &bytes);
        assert_eq!(d.u8().unwrap(), 7);
        assert_eq!(d.u32().unwrap(), 1 << 20);
        assert_eq!(d.i32().unwrap(), -5);
        assert_eq!(d.u64().unwrap(), u64::MAX);
        assert_eq!(d.i64().unwrap(), -9);
        assert_eq!(d.f64().unwrap(), 1.5);
        assert_eq!(d.str().unwrap(), "héllo");
        d.end().unwrap();
        // Every prefix is a clean error, never a panic.
        for cut in 0..bytes.len() {
            let mut d = Dec::new("t", &bytes[..cut]);
            let r = (|| {
                d.u8()?;
                d.u32()?;
                d.i32()?;
                d.u64()?;
                d.i64()?;
                d.f64()?;
                d.str()
            })();
            assert!(matches!(r, Err(CodecError::Truncated { .. })), "cut {cut}");
        }
        let mut d = Dec::new("t", &[1, 0, 0xff]);
        assert!(matches!(d.str(), Err(CodecError::NotUtf8 { .. })));
        let d = Dec::new("t", &[1]);
        assert_eq!(
            d.end(),
            Err(CodecError::Trailing {
                what: "t",
                extra: 1
            })
        );
    }

    #[test]
    fn long_strings_are_cut_on_a_char_boundary() {
        let s = "é".repeat(40_000);
        let bytes = Enc::with_capacity(0).str(&s).finish();
        let back = Dec::new("t", &bytes).str().unwrap();
        assert!(back.len() <= u16::MAX as usize && s.starts_with(&back));
    }
}
