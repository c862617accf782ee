//! What aggregation messages carry.
//!
//! Every message holds records of one kind, announced by its first payload word:
//! RAW records are input tuples `(key, value)` (two words), PARTIAL records are
//! partial states `(key, count, min, max, sum low, sum high)` (six words). A sender
//! may switch kinds mid-stream (Adaptive Two Phase ships its partials, then raw
//! tuples); the owner merges both kinds into the same table (Shatdal §4.3.2).

use super::table::{GroupTable, State, hash, owner};
use crate::error::{Result, ShuffleError};
use crate::operator::ShuffleWriter;
use std::sync::atomic::{AtomicU64, Ordering};

const RAW: u64 = 0x6167_6752_4157_0001;
const PARTIAL: u64 = 0x6167_6750_4152_0002;
const RAW_WORDS: usize = 2;
const PARTIAL_WORDS: usize = 6;

/// What a sender shipped.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Sent {
    pub raw: u64,
    pub partials: u64,
}

/// A worker's outgoing records, one open message per owner node, in its writer's
/// buffers (the caller finishes the writer).
pub(crate) struct Outbox<'w, 'a> {
    writer: &'w mut ShuffleWriter<'a>,
    /// The kind of the open message per node (0: none open).
    kinds: Vec<u64>,
    nodes: usize,
    pub(crate) sent: Sent,
}

impl<'w, 'a> Outbox<'w, 'a> {
    pub(crate) fn new(writer: &'w mut ShuffleWriter<'a>, nodes: usize) -> Outbox<'w, 'a> {
        Outbox {
            writer,
            kinds: vec![0; nodes],
            nodes,
            sent: Sent::default(),
        }
    }

    /// Ships one input tuple (hash `h`) to its owner.
    #[inline]
    pub(crate) fn raw(&mut self, key: u64, h: u64, value: i64) -> Result<()> {
        self.sent.raw += 1;
        self.push(owner(h, self.nodes), RAW, &[key, value as u64])
    }

    /// Ships one partial state to its group's owner.
    #[inline]
    pub(crate) fn partial(&mut self, key: u64, s: &State) -> Result<()> {
        self.sent.partials += 1;
        let sum = s.sum as u128;
        self.push(
            owner(hash(key), self.nodes),
            PARTIAL,
            &[
                key,
                s.count,
                s.min as u64,
                s.max as u64,
                sum as u64,
                (sum >> 64) as u64,
            ],
        )
    }

    /// Ships every group of `table` as a partial, and empties it.
    pub(crate) fn partials_of(&mut self, table: &mut GroupTable) -> Result<()> {
        for (k, s) in table.iter() {
            self.partial(k, &s)?;
        }
        table.clear();
        Ok(())
    }

    #[inline]
    fn push(&mut self, node: usize, kind: u64, record: &[u64]) -> Result<()> {
        if self.kinds[node] == kind {
            let buf = self.writer.buffer(node)?;
            if buf.remaining_words() >= record.len() {
                for &w in record {
                    buf.push(w);
                }
                return Ok(());
            }
        }
        self.push_new(node, kind, record)
    }

    /// Sends the open message to `node` (if any) and opens one of `kind`.
    #[cold]
    fn push_new(&mut self, node: usize, kind: u64, record: &[u64]) -> Result<()> {
        self.writer.flush(node)?;
        let buf = self.writer.buffer(node)?;
        if buf.capacity_words() < 1 + record.len() {
            return Err(ShuffleError::Invalid(format!(
                "an aggregation record of {} words does not fit a message of {} words",
                record.len() + 1,
                buf.capacity_words()
            )));
        }
        buf.push(kind);
        for &w in record {
            buf.push(w);
        }
        self.kinds[node] = kind;
        Ok(())
    }
}

/// Merges one received message into `table`; returns the records it held.
pub(crate) fn absorb(table: &mut GroupTable, payload: &[AtomicU64]) -> Result<u64> {
    let word = |i: usize| payload[i].load(Ordering::Relaxed);
    let Some(first) = payload.first() else {
        return Ok(0);
    };
    let (width, raw) = match first.load(Ordering::Relaxed) {
        RAW => (RAW_WORDS, true),
        PARTIAL => (PARTIAL_WORDS, false),
        other => {
            return Err(malformed(format!(
                "an aggregation message of unknown kind {other:#x}"
            )));
        }
    };
    let records = payload.len() - 1;
    if !records.is_multiple_of(width) {
        return Err(malformed(format!(
            "{records} words of {}-word records",
            width
        )));
    }
    let mut at = 1;
    while at < payload.len() {
        let key = word(at);
        if raw {
            table.add(key, hash(key), word(at + 1) as i64);
        } else {
            let count = word(at + 1);
            if count == 0 {
                return Err(malformed("a partial state of no tuples".into()));
            }
            let state = State {
                count,
                min: word(at + 2) as i64,
                max: word(at + 3) as i64,
                sum: (u128::from(word(at + 4)) | u128::from(word(at + 5)) << 64) as i128,
            };
            table.merge(key, hash(key), &state);
        }
        at += width;
    }
    Ok((records / width) as u64)
}

fn malformed(why: String) -> ShuffleError {
    ShuffleError::Malformed {
        from: "an aggregation peer".into(),
        why,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(w: &[u64]) -> Vec<AtomicU64> {
        w.iter().map(|&x| AtomicU64::new(x)).collect()
    }

    #[test]
    fn both_kinds_merge_into_one_table() {
        let mut t = GroupTable::with_capacity(4);
        assert_eq!(
            absorb(&mut t, &words(&[RAW, 7, -3i64 as u64, 8, 10])).unwrap(),
            2
        );
        let sum = (-(1i128 << 70)) as u128;
        absorb(
            &mut t,
            &words(&[
                PARTIAL,
                7,
                2,
                -9i64 as u64,
                4,
                sum as u64,
                (sum >> 64) as u64,
            ]),
        )
        .unwrap();
        let s = t.get(7).unwrap();
        assert_eq!((s.count, s.min, s.max), (3, -9, 4));
        assert_eq!(s.sum, -3 - (1i128 << 70));
        assert_eq!(t.get(8).unwrap().sum, 10);
    }

    #[test]
    fn malformed_messages_are_errors() {
        let mut t = GroupTable::with_capacity(4);
        assert!(absorb(&mut t, &words(&[42, 1, 2])).is_err());
        assert!(absorb(&mut t, &words(&[RAW, 1, 2, 3])).is_err());
        assert!(absorb(&mut t, &words(&[PARTIAL, 1, 0, 0, 0, 0, 0])).is_err());
        assert_eq!(absorb(&mut t, &words(&[])).unwrap(), 0);
    }
}
