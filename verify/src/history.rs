//! The history model and its public JSON Lines format: one transaction per line.
//!
//! ```text
//! {"id": 7, "session": 2, "status": "committed", "rid": 120, "cid": 131,
//!  "begin_ns": 1700000000000, "end_ns": 1700000000900,
//!  "ops": [{"f": "r", "key": "x", "value": [1, 2], "version": 118},
//!          {"f": "append", "key": "x", "value": 3},
//!          {"f": "w", "key": "y", "value": 5}]}
//! ```
//!
//! The format is strict (unknown fields are errors) because a misspelt optional field
//! would otherwise silently switch a check off. `rid`, `cid`, `begin_ns`, `end_ns`,
//! `error` and a read's `version` are optional; without timestamps only the black-box
//! checker and the value check of register reads have anything to work with.
//!
//! The first line may instead be a [`Header`], saying what the system that recorded the
//! history promised; without one, it promised everything the checkers check:
//!
//! ```text
//! {"header": {"real_time": false, "why": "recorded by namdb bench txn --no-wait-visible: …"}}
//! ```

use serde::de::{self, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::ser::{SerializeMap, SerializeSeq, Serializer};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::io::{self, BufRead, Write};

/// What became of a transaction.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    Committed,
    Aborted,
    /// The client never learnt the outcome (e.g. the commit timed out): its writes may or
    /// may not have taken effect.
    Unknown,
}

/// What a history's recorder promised, from its first line (`{"header": {…}}`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Header {
    /// Whether a transaction sees every commit that returned before it began. False
    /// when commits were acknowledged before they were visible: the real-time check
    /// is then skipped (and says so), every other check still runs.
    pub real_time: bool,
    /// Why, in words `namdb verify` repeats.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub why: Option<String>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct HeaderLine {
    header: Header,
}

/// Whether `line` is meant as a header: an object whose first key is `header`.
fn looks_like_header(line: &[u8]) -> bool {
    let trimmed = line.trim_ascii_start();
    trimmed
        .strip_prefix(b"{")
        .is_some_and(|rest| rest.trim_ascii_start().starts_with(b"\"header\""))
}

/// One transaction of a history.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
// `remote = "Self"` makes the derives inherent functions, so that the trait impls below
// can accept only a JSON object (see `object_only!`).
#[serde(deny_unknown_fields, remote = "Self")]
pub struct Txn {
    /// Unique within the history.
    pub id: u64,
    /// The client session that ran it; a session runs one transaction at a time.
    pub session: u64,
    pub status: Status,
    /// Read timestamp: the snapshot the transaction read from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rid: Option<u64>,
    /// Commit timestamp. Read-only transactions may commit without one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cid: Option<u64>,
    /// Wall clock, in nanoseconds, before the transaction began.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub begin_ns: Option<u64>,
    /// Wall clock, in nanoseconds, after its commit or abort returned.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub end_ns: Option<u64>,
    /// Why it aborted (or why its outcome is unknown), e.g. `conflict`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    #[serde(default)]
    pub ops: Vec<Op>,
}

impl Serialize for Txn {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        // The derived, inherent `Txn::serialize` (`remote = "Self"`).
        Txn::serialize(self, serializer)
    }
}

/// Implements `Deserialize` for a struct whose derive is `#[serde(remote = "Self")]`,
/// accepting only a JSON object. A derived struct visitor also accepts an array of the
/// fields in order (`[1, 2, "committed"]` would be transaction 1 of session 2); the
/// format is objects only, and an array is far more likely a mistake than a shorthand.
macro_rules! object_only {
    ($ty:ident, $what:literal) => {
        impl<'de> Deserialize<'de> for $ty {
            fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
                struct ObjectVisitor;
                impl<'de> Visitor<'de> for ObjectVisitor {
                    type Value = $ty;
                    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                        f.write_str($what)
                    }
                    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<$ty, A::Error> {
                        $ty::deserialize(de::value::MapAccessDeserializer::new(map))
                    }
                }
                deserializer.deserialize_map(ObjectVisitor)
            }
        }
    };
}

object_only!(Txn, "a JSON object (one transaction)");

impl Txn {
    /// A transaction with no timestamps and no operations yet.
    pub fn new(id: u64, session: u64, status: Status) -> Txn {
        Txn {
            id,
            session,
            status,
            rid: None,
            cid: None,
            begin_ns: None,
            end_ns: None,
            error: None,
            ops: Vec::new(),
        }
    }
}

/// One operation, in the order the transaction issued it.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(try_from = "RawOp")]
pub enum Op {
    /// `{"f": "r"}`. `version` is the CID of the version the store returned, when the
    /// store exposes it.
    Read {
        key: String,
        value: ReadValue,
        version: Option<u64>,
    },
    /// `{"f": "append"}`: add one element to the end of a list-append key. Elements must
    /// be unique per key, since the black-box checker identifies writes by them.
    Append { key: String, element: i64 },
    /// `{"f": "w"}`: overwrite a register.
    Write { key: String, value: i64 },
}

/// What a read returned: a register's value, a list-append key's whole list, or
/// nothing (`null`: a register never written; for a list key the same as `[]`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReadValue {
    Absent,
    Register(i64),
    List(Vec<i64>),
}

impl Serialize for Op {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let (f, key, version) = match self {
            Op::Read { key, version, .. } => ("r", key, *version),
            Op::Append { key, .. } => ("append", key, None),
            Op::Write { key, .. } => ("w", key, None),
        };
        let mut map = serializer.serialize_map(Some(if version.is_some() { 4 } else { 3 }))?;
        map.serialize_entry("f", f)?;
        map.serialize_entry("key", key)?;
        match self {
            Op::Read { value, .. } => map.serialize_entry("value", value)?,
            Op::Append { element, .. } => map.serialize_entry("value", element)?,
            Op::Write { value, .. } => map.serialize_entry("value", value)?,
        }
        if let Some(version) = version {
            map.serialize_entry("version", &version)?;
        }
        map.end()
    }
}

impl Serialize for ReadValue {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            ReadValue::Absent => serializer.serialize_none(),
            ReadValue::Register(value) => serializer.serialize_i64(*value),
            ReadValue::List(elements) => {
                let mut seq = serializer.serialize_seq(Some(elements.len()))?;
                for element in elements {
                    seq.serialize_element(element)?;
                }
                seq.end()
            }
        }
    }
}

// Hand-written rather than `#[serde(untagged)]`: untagged enums buffer every value and
// report "data did not match any variant", where this names what was expected.
impl<'de> Deserialize<'de> for ReadValue {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct ValueVisitor;
        impl<'de> Visitor<'de> for ValueVisitor {
            type Value = ReadValue;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an integer, a list of integers or null")
            }
            fn visit_unit<E: de::Error>(self) -> Result<ReadValue, E> {
                Ok(ReadValue::Absent)
            }
            fn visit_none<E: de::Error>(self) -> Result<ReadValue, E> {
                Ok(ReadValue::Absent)
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<ReadValue, E> {
                Ok(ReadValue::Register(v))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<ReadValue, E> {
                i64::try_from(v)
                    .map(ReadValue::Register)
                    .map_err(|_| E::custom(format!("integer {v} does not fit in 64 signed bits")))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<ReadValue, A::Error> {
                let mut elements = Vec::with_capacity(seq.size_hint().unwrap_or(0));
                while let Some(element) = seq.next_element::<i64>()? {
                    elements.push(element);
                }
                Ok(ReadValue::List(elements))
            }
        }
        deserializer.deserialize_any(ValueVisitor)
    }
}

/// The wire shape of an operation, validated into an [`Op`].
#[derive(Deserialize)]
#[serde(deny_unknown_fields, remote = "Self")]
struct RawOp {
    f: OpFunction,
    key: String,
    value: ReadValue,
    #[serde(default)]
    version: Option<u64>,
}

object_only!(RawOp, "a JSON object (one operation)");

#[derive(Deserialize)]
enum OpFunction {
    #[serde(rename = "r")]
    Read,
    #[serde(rename = "append")]
    Append,
    #[serde(rename = "w")]
    Write,
}

impl TryFrom<RawOp> for Op {
    type Error = String;

    fn try_from(raw: RawOp) -> Result<Op, String> {
        let RawOp {
            f,
            key,
            value,
            version,
        } = raw;
        let name = match f {
            OpFunction::Read => {
                return Ok(Op::Read {
                    key,
                    value,
                    version,
                });
            }
            OpFunction::Append => "append",
            OpFunction::Write => "w",
        };
        if version.is_some() {
            return Err(format!(
                "a `{name}` of key {key:?} has a version; only reads do"
            ));
        }
        let ReadValue::Register(v) = value else {
            return Err(format!(
                "the value of a `{name}` of key {key:?} must be one integer"
            ));
        };
        Ok(match f {
            OpFunction::Append => Op::Append { key, element: v },
            _ => Op::Write { key, value: v },
        })
    }
}

/// Why a history could not be read.
#[derive(Debug, thiserror::Error)]
pub enum HistoryError {
    // The cause is in the message and deliberately not a `#[source]` (nor a field named
    // `source`, which thiserror treats as one): error chains print sources after the
    // message, which would show it twice, and plain `Display` users need it shown.
    #[error("line {line}: cannot read the history: {cause}")]
    Io { line: u64, cause: io::Error },
    #[error("line {line}, column {column}: {message}")]
    Parse {
        line: u64,
        column: usize,
        message: String,
    },
    /// Well-formed JSON that no history can contain (e.g. a repeated transaction id).
    #[error("line {line}: {message}")]
    Invalid { line: u64, message: String },
}

/// Reads a JSON Lines history one transaction at a time, so a history never has to fit
/// in memory as text. Blank lines are skipped.
pub struct HistoryReader<R> {
    input: R,
    buf: Vec<u8>,
    line: u64,
    /// A line other than a blank one was read: a header may no longer come.
    started: bool,
    header: Option<Header>,
}

impl<R: BufRead> HistoryReader<R> {
    pub fn new(input: R) -> Self {
        HistoryReader {
            input,
            buf: Vec::new(),
            line: 0,
            started: false,
            header: None,
        }
    }

    /// The history's header, once the reader is past its first line.
    pub fn header(&self) -> Option<&Header> {
        self.header.as_ref()
    }

    /// The line the last transaction returned was read from.
    pub fn line(&self) -> u64 {
        self.line
    }
}

impl<R: BufRead> Iterator for HistoryReader<R> {
    type Item = Result<Txn, HistoryError>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            self.buf.clear();
            self.line += 1;
            match self.input.read_until(b'\n', &mut self.buf) {
                Ok(0) => return None,
                Ok(_) => {}
                Err(cause) => {
                    return Some(Err(HistoryError::Io {
                        line: self.line,
                        cause,
                    }));
                }
            }
            if self.buf.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            let first = !std::mem::replace(&mut self.started, true);
            if looks_like_header(&self.buf) {
                if !first {
                    return Some(Err(HistoryError::Invalid {
                        line: self.line,
                        message: "a header ({\"header\": …}) may only be the first line".into(),
                    }));
                }
                match serde_json::from_slice::<HeaderLine>(&self.buf) {
                    Ok(h) => {
                        self.header = Some(h.header);
                        continue;
                    }
                    Err(e) => return Some(Err(parse_error(self.line, &e))),
                }
            }
            return Some(serde_json::from_slice(&self.buf).map_err(|e| parse_error(self.line, &e)));
        }
    }
}

/// serde_json numbers lines within the slice it was given (always line 1 here); the
/// reader knows the real line, so the message keeps only serde's column.
fn parse_error(line: u64, err: &serde_json::Error) -> HistoryError {
    let text = err.to_string();
    let position = format!(" at line {} column {}", err.line(), err.column());
    let message = text.strip_suffix(&position).unwrap_or(&text).to_string();
    // A type error found by peeking at the first character (a line that is an array,
    // not an object) comes before anything was consumed, at column 0; columns count
    // from 1.
    HistoryError::Parse {
        line,
        column: err.column().max(1),
        message,
    }
}

/// Writes a history as JSON Lines, one transaction per line as it is handed over.
pub struct JsonlWriter<W: Write> {
    out: W,
}

impl<W: Write> JsonlWriter<W> {
    pub fn new(out: W) -> Self {
        JsonlWriter { out }
    }

    /// Writes the header; before any transaction, since only the first line may be one.
    pub fn write_header(&mut self, header: &Header) -> io::Result<()> {
        serde_json::to_writer(
            &mut self.out,
            &HeaderLine {
                header: header.clone(),
            },
        )?;
        self.out.write_all(b"\n")
    }

    pub fn write(&mut self, txn: &Txn) -> io::Result<()> {
        serde_json::to_writer(&mut self.out, txn)?;
        self.out.write_all(b"\n")
    }

    pub fn into_inner(self) -> W {
        self.out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn parse_all(text: &str) -> Result<Vec<Txn>, HistoryError> {
        HistoryReader::new(text.as_bytes()).collect()
    }

    #[test]
    fn a_header_is_read_from_the_first_line_only() {
        let mut w = JsonlWriter::new(Vec::new());
        let header = Header {
            real_time: false,
            why: Some("no wait".into()),
        };
        w.write_header(&header).unwrap();
        w.write(&Txn::new(1, 1, Status::Committed)).unwrap();
        let text = String::from_utf8(w.into_inner()).unwrap();
        let input = format!("\n{text}");
        let mut reader = HistoryReader::new(input.as_bytes());
        let txns: Vec<Txn> = reader.by_ref().map(|t| t.unwrap()).collect();
        assert_eq!(txns, [Txn::new(1, 1, Status::Committed)]);
        assert_eq!(reader.header(), Some(&header));
        // Not after a transaction.
        let late = format!(
            "{}\n{}",
            r#"{"id": 1, "session": 1, "status": "committed"}"#, text
        );
        let e = parse_all(&late).unwrap_err();
        assert!(e.to_string().contains("line 2: a header"), "{e}");
        // As strict as a transaction.
        let e = parse_all(r#"{"header": {"real_time": false, "realtime": true}}"#).unwrap_err();
        assert!(e.to_string().contains("unknown field `realtime`"), "{e}");
        let e = parse_all(r#"{"header": {"why": "x"}}"#).unwrap_err();
        assert!(e.to_string().contains("missing field `real_time`"), "{e}");
        // A history without one has none.
        let mut plain =
            HistoryReader::new(&b"{\"id\": 1, \"session\": 1, \"status\": \"aborted\"}"[..]);
        assert!(plain.next().unwrap().is_ok());
        assert_eq!(plain.header(), None);
    }

    #[test]
    fn the_documented_example_parses() {
        let line = r#"{"id": 7, "session": 2, "status": "committed", "rid": 120, "cid": 131, "begin_ns": 5, "end_ns": 9, "ops": [ {"f": "r", "key": "x", "value": [1, 2], "version": 118}, {"f": "append", "key": "x", "value": 3}, {"f": "w", "key": "y", "value": 5} ]}"#;
        let txns = parse_all(line).expect("parses");
        let mut expected = Txn::new(7, 2, Status::Committed);
        expected.rid = Some(120);
        expected.cid = Some(131);
        expected.begin_ns = Some(5);
        expected.end_ns = Some(9);
        expected.ops = vec![
            Op::Read {
                key: "x".into(),
                value: ReadValue::List(vec![1, 2]),
                version: Some(118),
            },
            Op::Append {
                key: "x".into(),
                element: 3,
            },
            Op::Write {
                key: "y".into(),
                value: 5,
            },
        ];
        assert_eq!(txns, vec![expected]);
    }

    #[test]
    fn optional_fields_may_be_missing_and_reads_may_be_null() {
        let text = "\n{\"id\":1,\"session\":0,\"status\":\"unknown\",\"ops\":[{\"f\":\"r\",\"key\":\"k\",\"value\":null}]}\n\n";
        let txns = parse_all(text).expect("parses");
        assert_eq!(txns.len(), 1);
        assert_eq!(txns[0].rid, None);
        assert_eq!(
            txns[0].ops[0],
            Op::Read {
                key: "k".into(),
                value: ReadValue::Absent,
                version: None
            }
        );
    }

    #[test]
    fn writer_output_reads_back_identically() {
        let mut txn = Txn::new(3, 1, Status::Aborted);
        txn.rid = Some(10);
        txn.error = Some("conflict".into());
        txn.ops = vec![
            Op::Read {
                key: "a".into(),
                value: ReadValue::Register(-4),
                version: None,
            },
            Op::Read {
                key: "b".into(),
                value: ReadValue::Absent,
                version: Some(0),
            },
            Op::Append {
                key: "c".into(),
                element: 9,
            },
        ];
        let mut writer = JsonlWriter::new(Vec::new());
        writer.write(&txn).expect("written");
        writer
            .write(&Txn::new(4, 1, Status::Committed))
            .expect("written");
        let text = String::from_utf8(writer.into_inner()).expect("UTF-8");
        assert_eq!(text.lines().count(), 2);
        let back = parse_all(&text).expect("parses");
        assert_eq!(back[0], txn);
        assert_eq!(back[1], Txn::new(4, 1, Status::Committed));
    }

    #[test]
    fn errors_name_the_line_and_what_is_wrong() {
        let good = r#"{"id":1,"session":0,"status":"committed","ops":[]}"#;
        let cases = [
            (
                r#"{"id":2,"session":0,"status":"done","ops":[]}"#,
                "unknown variant `done`",
            ),
            (
                r#"{"id":2,"session":0,"status":"aborted","ops":[{"f":"x","key":"k","value":1}]}"#,
                "unknown variant `x`",
            ),
            (
                r#"{"id":2,"session":0,"status":"aborted","ops":[{"f":"append","key":"k","value":[1]}]}"#,
                "must be one integer",
            ),
            (
                r#"{"id":2,"session":0,"status":"aborted","ops":[{"f":"w","key":"k","value":1,"version":3}]}"#,
                "only reads do",
            ),
            (
                r#"{"id":2,"session":0,"status":"aborted","ops":[{"f":"r","key":"k"}]}"#,
                "missing field `value`",
            ),
            (
                r#"{"id":2,"session":0,"status":"aborted","ops":[{"f":"r","key":"k","value":1.5}]}"#,
                "an integer, a list of integers or null",
            ),
            (
                r#"{"id":2,"session":0,"status":"aborted","versoin":3}"#,
                "unknown field `versoin`",
            ),
            (r#"{"id":2,"session":0,"#, "EOF"),
            ("[1, 2]", "expected a JSON object (one transaction)"),
            // A derived struct visitor would take these as fields in order.
            (
                r#"[1,2,"committed"]"#,
                "invalid type: sequence, expected a JSON object (one transaction)",
            ),
            (
                r#"{"id":2,"session":0,"status":"aborted","ops":[["w","k",1]]}"#,
                "invalid type: sequence, expected a JSON object (one operation)",
            ),
            ("7", "expected a JSON object (one transaction)"),
        ];
        for (bad, expected) in cases {
            let text = format!("{good}\n\n{bad}\n{good}\n");
            let mut reader = HistoryReader::new(text.as_bytes());
            assert!(reader.next().expect("first line").is_ok());
            let err = reader.next().expect("third line").expect_err(bad);
            let message = err.to_string();
            assert!(message.starts_with("line 3, column "), "{message}");
            assert!(message.contains(expected), "{bad}: {message}");
            assert!(!message.contains("line 1 column"), "{message}");
        }
    }

    /// Fails every read, as reading a directory does.
    struct Unreadable;

    impl io::Read for Unreadable {
        fn read(&mut self, _: &mut [u8]) -> io::Result<usize> {
            Err(io::Error::from_raw_os_error(21))
        }
    }

    #[test]
    fn a_read_error_names_its_cause_once() {
        let err = HistoryReader::new(io::BufReader::new(Unreadable))
            .next()
            .expect("one item")
            .expect_err("unreadable");
        let cause = io::Error::from_raw_os_error(21).to_string();
        let message = err.to_string();
        assert_eq!(message, format!("line 1: cannot read the history: {cause}"));
        // Error chains (anyhow's `{:#}`) append each source: none, or the cause repeats.
        assert!(std::error::Error::source(&err).is_none());
    }

    #[test]
    fn invalid_utf8_is_an_error_not_a_panic() {
        let bytes = b"{\"id\":1,\"session\":0,\"status\":\"committed\",\"ops\":[{\"f\":\"r\",\"key\":\"\xff\",\"value\":null}]}\n";
        let err = HistoryReader::new(&bytes[..])
            .next()
            .expect("one line")
            .expect_err("invalid UTF-8");
        assert!(err.to_string().starts_with("line 1"), "{err}");
    }

    fn arb_op() -> impl Strategy<Value = Op> {
        let key = "[a-z]{1,3}";
        prop_oneof![
            (key, any::<i64>()).prop_map(|(key, element)| Op::Append { key, element }),
            (key, any::<i64>()).prop_map(|(key, value)| Op::Write { key, value }),
            (
                key,
                prop_oneof![
                    Just(ReadValue::Absent),
                    any::<i64>().prop_map(ReadValue::Register),
                    prop::collection::vec(any::<i64>(), 0..5).prop_map(ReadValue::List),
                ],
                any::<Option<u64>>()
            )
                .prop_map(|(key, value, version)| Op::Read {
                    key,
                    value,
                    version
                }),
        ]
    }

    fn arb_txn() -> impl Strategy<Value = Txn> {
        (
            any::<u64>(),
            any::<u64>(),
            prop_oneof![
                Just(Status::Committed),
                Just(Status::Aborted),
                Just(Status::Unknown)
            ],
            any::<[Option<u64>; 4]>(),
            any::<Option<String>>(),
            prop::collection::vec(arb_op(), 0..6),
        )
            .prop_map(
                |(id, session, status, [rid, cid, begin_ns, end_ns], error, ops)| Txn {
                    id,
                    session,
                    status,
                    rid,
                    cid,
                    begin_ns,
                    end_ns,
                    error,
                    ops,
                },
            )
    }

    proptest! {
        #[test]
        fn random_bytes_give_errors_not_panics(bytes in prop::collection::vec(any::<u8>(), 0..200)) {
            for item in HistoryReader::new(&bytes[..]) {
                if let Err(e) = item {
                    prop_assert!(e.to_string().starts_with("line "));
                }
            }
        }

        #[test]
        fn damaged_valid_lines_give_errors_not_panics(txn in arb_txn(), cut in any::<prop::sample::Index>(), byte in any::<u8>()) {
            let mut line = serde_json::to_vec(&txn).expect("serializes");
            let at = cut.index(line.len());
            line[at] = byte;
            for item in HistoryReader::new(&line[..]) {
                if let Err(e) = item {
                    prop_assert!(e.to_string().starts_with("line "));
                }
            }
        }

        #[test]
        fn any_history_round_trips(txns in prop::collection::vec(arb_txn(), 0..4)) {
            let mut writer = JsonlWriter::new(Vec::new());
            for txn in &txns {
                writer.write(txn).expect("written");
            }
            let bytes = writer.into_inner();
            let back: Vec<Txn> = HistoryReader::new(&bytes[..]).collect::<Result<_, _>>().expect("parses");
            prop_assert_eq!(back, txns);
        }
    }
}
