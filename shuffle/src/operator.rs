//! The SHUFFLE and RECEIVE operators of §4.3 (Algorithms 1 and 2) over any design.
//!
//! A [`Shuffle`] owns a node's endpoints and its transmission groups. Each thread
//! takes a [`ShuffleWriter`] with one output buffer per group, appends tuples, and
//! finishes; under SE the last thread to finish ends the shared endpoint's stream.
//! Receiving threads drain their endpoint with [`receive_all`].

use crate::buffer::{Received, SendBuf, State};
use crate::endpoint::{Opened, RecvEndpoint, SendEndpoint};
use crate::error::{Result, ShuffleError};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Transmission groups (§4.1): group `g` is a set of destination ranks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Groups(Vec<Vec<usize>>);

impl Groups {
    /// Repartition: group `r` is node `r` alone.
    pub fn repartition(nodes: usize) -> Groups {
        Groups((0..nodes).map(|r| vec![r]).collect())
    }
    /// Broadcast from `me`: one group of every other node.
    pub fn broadcast(nodes: usize, me: usize) -> Groups {
        Groups(vec![(0..nodes).filter(|&r| r != me).collect()])
    }
    /// Multicast: arbitrary sets of ranks.
    pub fn multicast(sets: Vec<Vec<usize>>) -> Groups {
        Groups(sets)
    }
    pub fn len(&self) -> usize {
        self.0.len()
    }
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
    pub fn members(&self, group: usize) -> &[usize] {
        &self.0[group]
    }
}

/// One node's side of a shuffle.
pub struct Shuffle {
    opened: Opened,
    groups: Groups,
    /// Per lane: threads that have not finished yet.
    unfinished: Vec<AtomicUsize>,
}

impl Shuffle {
    /// `threads` threads will write; they share the lanes of `opened` round-robin.
    pub fn new(opened: Opened, groups: Groups, threads: usize) -> Result<Shuffle> {
        let lanes = opened.senders.len();
        if threads < lanes {
            return Err(ShuffleError::Invalid(format!(
                "{threads} threads for {lanes} endpoints"
            )));
        }
        let unfinished = (0..lanes)
            .map(|l| AtomicUsize::new((l..threads).step_by(lanes).count()))
            .collect();
        Ok(Shuffle {
            opened,
            groups,
            unfinished,
        })
    }

    pub fn groups(&self) -> &Groups {
        &self.groups
    }

    /// The writer of thread `tid`.
    pub fn writer(&self, tid: usize) -> ShuffleWriter<'_> {
        let lane = tid % self.opened.senders.len();
        ShuffleWriter {
            shuffle: self,
            lane,
            endpoint: self.opened.senders[lane].clone(),
            out: (0..self.groups.len()).map(|_| None).collect(),
        }
    }

    /// The receive endpoint of thread `tid`.
    pub fn receiver(&self, tid: usize) -> Arc<dyn RecvEndpoint> {
        self.opened.for_thread(tid).1.clone()
    }

    /// Receiving threads per receive endpoint must all drain it; this many lanes.
    pub fn lanes(&self) -> usize {
        self.opened.senders.len()
    }
}

/// For tuples of `W` words: how many tuples ahead [`fabric::PREFETCH_AHEAD_BYTES`] is,
/// and how many tuples share a cache line (prefetch once per line).
pub fn prefetch_stride<const W: usize>() -> (usize, usize) {
    let bytes = (W * 8).max(1);
    (fabric::PREFETCH_AHEAD_BYTES / bytes, (64 / bytes).max(1))
}

/// One thread's output buffers (Algorithm 1).
pub struct ShuffleWriter<'a> {
    shuffle: &'a Shuffle,
    lane: usize,
    endpoint: Arc<dyn SendEndpoint>,
    out: Vec<Option<SendBuf>>,
}

impl ShuffleWriter<'_> {
    /// Appends `tuple` to group `group`'s buffer, transmitting the buffer when full.
    #[inline]
    pub fn push(&mut self, group: usize, tuple: &[u64]) -> Result<()> {
        if let Some(Some(buf)) = self.out.get_mut(group)
            && buf.push_tuple(tuple)
        {
            return Ok(());
        }
        self.push_slow(group, tuple)
    }

    #[cold]
    fn push_slow(&mut self, group: usize, tuple: &[u64]) -> Result<()> {
        self.check_group(group)?;
        if let Some(full) = self.out[group].take() {
            self.endpoint
                .put_data(full, self.shuffle.groups.members(group), State::MoreData)?;
        }
        let mut buf = self.endpoint.acquire()?;
        if !buf.push_tuple(tuple) {
            return Err(ShuffleError::Invalid(format!(
                "a tuple of {} words does not fit a buffer of {} words",
                tuple.len(),
                buf.capacity_words()
            )));
        }
        self.out[group] = Some(buf);
        Ok(())
    }

    /// Appends every tuple of `tuples` to group `group`, whole tuples per buffer,
    /// transmitting each buffer as it fills: [`ShuffleWriter::push`] for a run of
    /// tuples with one destination, at the cost of a copy loop instead of a call per
    /// tuple.
    pub fn push_all<const W: usize>(
        &mut self,
        group: usize,
        mut tuples: &[[u64; W]],
    ) -> Result<()> {
        while let Some((first, _)) = tuples.split_first() {
            if let Some(Some(buf)) = self.out.get_mut(group) {
                let took = buf.extend_tuples(tuples);
                tuples = &tuples[took..];
                if took > 0 {
                    continue;
                }
            }
            // No buffer yet, or a full one: the slow path sends it and starts another
            // (or finds the group does not exist).
            self.push_slow(group, first)?;
            tuples = &tuples[1..];
        }
        Ok(())
    }

    /// Appends every tuple of `tuples` to the group `group_of` names for it, as
    /// [`ShuffleWriter::push`] would one by one, reading [`fabric::PREFETCH_AHEAD_BYTES`]
    /// ahead in `tuples`: the loop of a partitioning sender, which otherwise waits on
    /// every cache line of its input. A group out of range is an error; the tuples
    /// before it have been appended.
    pub fn push_partitioned<const W: usize>(
        &mut self,
        tuples: &[[u64; W]],
        group_of: impl Fn(&[u64; W]) -> usize,
    ) -> Result<()> {
        let (ahead, per_line) = prefetch_stride::<W>();
        for (i, t) in tuples.iter().enumerate() {
            if i.is_multiple_of(per_line) {
                fabric::prefetch(tuples, i + ahead);
            }
            self.push(group_of(t), t)?;
        }
        Ok(())
    }

    /// A group this writer has no buffer for is the caller's error, never a panic.
    fn check_group(&self, group: usize) -> Result<()> {
        if group < self.out.len() {
            Ok(())
        } else {
            Err(ShuffleError::Invalid(format!(
                "group {group} of a writer with {} groups",
                self.out.len()
            )))
        }
    }

    /// The buffer for `group`, for callers that fill payloads in bulk; transmit it
    /// with [`ShuffleWriter::flush`].
    pub fn buffer(&mut self, group: usize) -> Result<&mut SendBuf> {
        self.check_group(group)?;
        if self.out[group].is_none() {
            self.out[group] = Some(self.endpoint.acquire()?);
        }
        Ok(self.out[group].as_mut().expect("set above"))
    }

    /// Transmits group `group`'s buffer now, if it holds anything.
    pub fn flush(&mut self, group: usize) -> Result<()> {
        self.check_group(group)?;
        if let Some(buf) = self.out[group].take_if(|b| !b.is_empty()) {
            self.endpoint
                .put_data(buf, self.shuffle.groups.members(group), State::MoreData)?;
        }
        Ok(())
    }

    /// Flushes every buffer; the last thread of the lane ends its stream.
    pub fn finish(mut self) -> Result<()> {
        for g in 0..self.out.len() {
            self.flush(g)?;
        }
        let spare: Vec<SendBuf> = self.out.iter_mut().filter_map(Option::take).collect();
        let last = self.shuffle.unfinished[self.lane].fetch_sub(1, Ordering::AcqRel) == 1;
        let mut spare = spare.into_iter();
        if last {
            let buf = match spare.next() {
                Some(b) => b,
                None => self.endpoint.acquire()?,
            };
            self.endpoint.put_data(buf, &[], State::Depleted)?;
        }
        // Buffers acquired and never filled go out empty to nobody, which returns them.
        for buf in spare {
            self.endpoint.put_data(buf, &[], State::MoreData)?;
        }
        Ok(())
    }
}

/// Drains `endpoint` (Algorithm 2): calls `consume` on every received buffer, releases
/// it, and returns at the end of every stream.
pub fn receive_all(endpoint: &dyn RecvEndpoint, mut consume: impl FnMut(&Received)) -> Result<()> {
    while let Some(data) = endpoint.get_data()? {
        consume(&data);
        endpoint.release(data)?;
    }
    Ok(())
}
