//! What the two SEND/RECV designs share: the absolute-credit bookkeeping of §5.2, the
//! end-of-stream accounting of §5.2/§5.3, and small helpers.
//!
//! Credit is *absolute*: a receiver counts the receives it has posted (or, for UD,
//! attributed) to each source and sends that count; a sender may transmit to `dest`
//! while `credit[dest] > sent[dest]`. A lost or reordered credit update is therefore
//! harmless: the next one supersedes it, and a sender keeps the largest it has seen.

use crate::buffer::{HEADER_BYTES, Header, Received};
use crate::endpoint::Lane;
use crate::error::{Result, ShuffleError};
use crate::pool::Buffering;
use fabric::{Completion, CompletionQueue, WcStatus};
use std::collections::VecDeque;
use std::sync::Arc;
use std::task::Poll;

/// Completions taken per poll.
pub(crate) const POLL_BATCH: usize = 32;

/// `wr_id` of work requests whose completions carry nothing to track (inline control
/// messages, credit writes): only their status is checked.
pub(crate) const CONTROL_WR: u64 = u64::MAX;

/// A work completion with an error status: the peer died, or the queue pair was flushed.
pub(crate) fn check(wc: &Completion, what: &'static str) -> Result<()> {
    if wc.status == WcStatus::Success {
        Ok(())
    } else {
        Err(ShuffleError::Completion {
            what,
            status: wc.status,
        })
    }
}

/// Polls `cq` once into `out`.
pub(crate) fn poll(cq: &Arc<dyn CompletionQueue>, out: &mut [Completion]) -> Result<usize> {
    Ok(cq.poll(out)?)
}

/// The rank of the node whose lane-`lane.lane` endpoint has id `id`, if it is one.
pub(crate) fn rank_of(id: u32, lane: Lane, nodes: usize) -> Option<usize> {
    let id = id as usize;
    (id % lane.lanes == lane.lane && id / lane.lanes < nodes).then_some(id / lane.lanes)
}

/// A header as the bytes a NIC copies: native-endian words, as [`Buffer::read_header`]
/// reads them back.
pub(crate) fn header_bytes(h: &Header) -> [u8; HEADER_BYTES as usize] {
    let [a, b] = h.encode();
    let mut out = [0u8; HEADER_BYTES as usize];
    out[..8].copy_from_slice(&a.to_ne_bytes());
    out[8..].copy_from_slice(&b.to_ne_bytes());
    out
}

/// The sender's view of its credit: the largest absolute credit seen per destination
/// and what it has spent.
pub(crate) struct SendCredit {
    pub(crate) sent: Vec<u64>,
    pub(crate) credit: Vec<u64>,
}

impl SendCredit {
    pub(crate) fn new(nodes: usize, initial: u64) -> SendCredit {
        SendCredit {
            sent: vec![0; nodes],
            credit: vec![initial; nodes],
        }
    }
    /// Takes in an absolute credit for `dest` (stale ones change nothing).
    pub(crate) fn update(&mut self, dest: usize, absolute: u64) {
        self.credit[dest] = self.credit[dest].max(absolute);
    }
    /// Spends one credit for `dest` if there is one.
    pub(crate) fn try_spend(&mut self, dest: usize) -> bool {
        if self.credit[dest] > self.sent[dest] {
            self.sent[dest] += 1;
            true
        } else {
            false
        }
    }
}

/// What a SEND/RECV receiver's GETDATA answers before it polls: a buffer received
/// already, or the end once every source finished; `None`: poll.
pub(crate) fn ready_or_ended(
    ready: &mut VecDeque<Received>,
    book: &RecvBook,
) -> Option<Poll<Option<Received>>> {
    match ready.pop_front() {
        Some(r) => Some(Poll::Ready(Some(r))),
        None => book.all_finished().then_some(Poll::Ready(None)),
    }
}

/// The receiver's bookkeeping per source node: receives posted (attributed) to it,
/// messages that arrived from it, its end of stream, and the adaptive policy's
/// decisions (§6.2) about how many buffers it gets.
pub(crate) struct RecvBook {
    policy: Buffering,
    credit_every: u32,
    /// Receives posted for (attributed to) each source, ever: the absolute credit.
    pub(crate) posted: Vec<u64>,
    /// Credit last sent to each source.
    pub(crate) credited: Vec<u64>,
    /// Messages (data and control) that arrived from each source.
    pub(crate) arrived: Vec<u64>,
    /// Data messages that arrived from each source.
    pub(crate) data: Vec<u64>,
    /// Data messages the source announced in its end of stream.
    pub(crate) expected: Vec<Option<u64>>,
    /// Sources whose stream has ended and fully arrived.
    pub(crate) finished: Vec<bool>,
    pub(crate) finished_count: usize,
    /// Buffers in circulation for each source (posted or being consumed).
    pub(crate) owned: Vec<usize>,
    /// Buffers of each source to retire on release rather than repost (§6.2).
    pub(crate) surplus: Vec<usize>,
    /// Releases per source since the last credit update.
    since_credit: Vec<u32>,
    /// Arrivals per source in the current poll batch.
    batch: Vec<usize>,
}

impl RecvBook {
    pub(crate) fn new(nodes: usize, policy: Buffering, credit_every: u32) -> RecvBook {
        let initial = policy.initial().max(1);
        RecvBook {
            policy,
            credit_every: credit_every.max(1),
            posted: vec![0; nodes],
            credited: vec![initial as u64; nodes],
            arrived: vec![0; nodes],
            data: vec![0; nodes],
            expected: vec![None; nodes],
            finished: vec![false; nodes],
            finished_count: 0,
            owned: vec![0; nodes],
            surplus: vec![0; nodes],
            since_credit: vec![0; nodes],
            batch: vec![0; nodes],
        }
    }

    pub(crate) fn nodes(&self) -> usize {
        self.posted.len()
    }

    pub(crate) fn all_finished(&self) -> bool {
        self.finished_count == self.nodes()
    }

    /// Receives posted for `source` that no message has consumed yet.
    pub(crate) fn outstanding(&self, source: usize) -> u64 {
        self.posted[source].saturating_sub(self.arrived[source])
    }

    /// A message arrived from `source`.
    pub(crate) fn arrival(&mut self, source: usize, is_data: bool) {
        self.arrived[source] += 1;
        if is_data {
            self.data[source] += 1;
            self.batch[source] += 1;
        }
    }

    /// The end of stream of `source`, announcing `count` data messages. Repeats (UD
    /// sends it more than once) change nothing; a different count is an error.
    pub(crate) fn end(&mut self, source: usize, count: u64) -> Result<()> {
        match self.expected[source] {
            Some(c) if c != count => Err(ShuffleError::Malformed {
                from: format!("rank {source}"),
                why: format!("end of stream announced {c} and then {count} messages"),
            }),
            _ => {
                self.expected[source] = Some(count);
                Ok(())
            }
        }
    }

    /// Whether everything `source` sends has arrived: its end of stream and every data
    /// message it announced. True as soon as the last of them is taken in, where
    /// [`RecvBook::finished`] waits for [`RecvBook::settle`] at the end of the batch.
    pub(crate) fn complete(&self, source: usize) -> bool {
        self.finished[source] || self.expected[source] == Some(self.data[source])
    }

    /// Marks sources whose every announced message arrived as finished.
    pub(crate) fn settle(&mut self) {
        for s in 0..self.nodes() {
            if !self.finished[s] && self.expected[s] == Some(self.data[s]) {
                self.finished[s] = true;
                self.finished_count += 1;
            }
        }
    }

    /// After a batch of arrivals: the adaptive policy marks all but `keep_waiting` of a
    /// burst for retirement once consumed (§6.2). Returns the sources that are starved
    /// (no receive left posted) and may get one more buffer.
    pub(crate) fn end_batch(&mut self) -> Vec<usize> {
        let mut starved = Vec::new();
        for s in 0..self.nodes() {
            let n = std::mem::take(&mut self.batch[s]);
            if let Buffering::Adaptive {
                keep_waiting,
                max_per_peer,
                ..
            } = self.policy
            {
                if n > keep_waiting.max(1) {
                    self.surplus[s] += n - keep_waiting.max(1);
                }
                if n > 0
                    && !self.finished[s]
                    && self.outstanding(s) == 0
                    && self.owned[s] < max_per_peer.max(1)
                {
                    self.surplus[s] = self.surplus[s].saturating_sub(1);
                    starved.push(s);
                }
            }
        }
        starved
    }

    /// A consumed buffer of `source` came back: whether to retire it (to the pool)
    /// instead of posting it again.
    pub(crate) fn retire_on_release(&mut self, source: usize) -> bool {
        if self.finished[source] {
            return true;
        }
        let floor = self.policy.initial().max(1);
        if self.surplus[source] > 0 && self.owned[source] > floor {
            self.surplus[source] -= 1;
            return true;
        }
        false
    }

    /// A receive was posted for `source`; returns whether its credit is due.
    pub(crate) fn posted_one(&mut self, source: usize, released: bool) -> bool {
        self.posted[source] += 1;
        if released {
            self.since_credit[source] += 1;
        }
        self.since_credit[source] >= self.credit_every
    }

    /// The credit to send to `source` now, if it changed; records it as sent.
    pub(crate) fn take_credit(&mut self, source: usize) -> Option<u64> {
        self.since_credit[source] = 0;
        (self.posted[source] > self.credited[source]).then(|| {
            self.credited[source] = self.posted[source];
            self.posted[source]
        })
    }

    /// The timeout error of a receiver that stopped making progress: with the counts of
    /// the source furthest from its announced total, if one announced it.
    pub(crate) fn timeout(&self, endpoint: u32, waited: std::time::Duration) -> ShuffleError {
        let short = (0..self.nodes())
            .filter(|&s| !self.finished[s])
            .filter_map(|s| self.expected[s].map(|e| (e, self.data[s])))
            .max_by_key(|&(e, r)| e.saturating_sub(r));
        let silent: Vec<usize> = (0..self.nodes())
            .filter(|&s| !self.finished[s] && self.expected[s].is_none())
            .collect();
        ShuffleError::Timeout {
            what: format!(
                "receive endpoint {endpoint}: the end of stream of ranks {silent:?}, or missing messages"
            ),
            waited,
            counts: short,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_source_finishes_only_once_its_announced_count_arrived() {
        let mut book = RecvBook::new(2, Buffering::Fixed { per_peer: 2 }, 2);
        // The end of stream overtakes two data messages (UD reordering).
        book.arrival(1, true);
        book.arrival(1, false);
        book.end(1, 3).unwrap();
        book.settle();
        assert!(!book.finished[1]);
        book.arrival(1, true);
        book.arrival(1, true);
        book.settle();
        assert!(book.finished[1] && !book.all_finished());
        assert!(book.end(1, 3).is_ok(), "a repeated end changes nothing");
        assert!(book.end(1, 4).is_err(), "a contradicting one is an error");
        match book.timeout(0, std::time::Duration::ZERO) {
            ShuffleError::Timeout { counts: None, .. } => {}
            e => panic!("{e:?}"),
        }
        book.end(0, 5).unwrap();
        book.arrival(0, true);
        match book.timeout(0, std::time::Duration::ZERO) {
            ShuffleError::Timeout {
                counts: Some((5, 1)),
                ..
            } => {}
            e => panic!("{e:?}"),
        }
    }

    #[test]
    fn credit_is_absolute_and_stale_updates_change_nothing() {
        let mut c = SendCredit::new(1, 2);
        assert!(c.try_spend(0) && c.try_spend(0) && !c.try_spend(0));
        c.update(0, 4);
        c.update(0, 3); // a late, older update
        assert!(c.try_spend(0) && c.try_spend(0) && !c.try_spend(0));
        let mut book = RecvBook::new(1, Buffering::Fixed { per_peer: 2 }, 2);
        book.posted_one(0, false);
        book.posted_one(0, false);
        assert_eq!(book.take_credit(0), None, "the initial credit is known");
        assert!(!book.posted_one(0, true));
        assert!(book.posted_one(0, true), "due every second release");
        assert_eq!(book.take_credit(0), Some(4));
        assert_eq!(book.take_credit(0), None);
    }
}
