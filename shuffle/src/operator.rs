//! The SHUFFLE and RECEIVE operators of §4.3 (Algorithms 1 and 2) over any design.
//!
//! A [`Shuffle`] owns a node's endpoints and its transmission groups. Each thread
//! takes a [`ShuffleWriter`] with one output buffer per group, appends tuples, and
//! finishes; under SE the last thread to finish ends the shared endpoint's stream.
//! Receiving threads drain their endpoint with [`receive_all`]; a thread that does both
//! runs [`send_and_receive`].
//!
//! **A node's own partition, in place.** A thread that both sends and receives consumes
//! the buffers its own node is a destination of as soon as they fill, in the sending
//! buffer itself, and fills that buffer again: no copy through the fabric, and a buffer
//! that stays in the core's cache. [`OwnPartition::Fabric`] sends them through the
//! fabric's loopback instead, as the paper's operator does (and as a node whose
//! senders and receivers are separate threads always does).

use crate::buffer::{Received, SendBuf, State};
use crate::endpoint::{Opened, RecvEndpoint, SendEndpoint};
use crate::error::{Result, ShuffleError};
use crate::idle::{self, Idle};
use std::cell::RefCell;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::task::Poll;

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

/// How a thread that both sends and receives ([`send_and_receive`]) gets the tuples its
/// own node is a destination of.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum OwnPartition {
    /// Consumed in the sending buffer once it fills, which is then filled again.
    #[default]
    InPlace,
    /// Sent through the fabric to the node's own receive endpoint, like every other.
    Fabric,
}

/// One node's side of a shuffle.
pub struct Shuffle {
    opened: Opened,
    groups: Groups,
    /// Per group: the members other than this node (all of them when it is none).
    others: Vec<Vec<usize>>,
    own_partition: OwnPartition,
    /// Buffers consumed in place (see [`OwnPartition::InPlace`]).
    in_place: AtomicU64,
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
        let me = opened.rank;
        let others = groups
            .0
            .iter()
            .map(|g| g.iter().copied().filter(|&r| r != me).collect())
            .collect();
        Ok(Shuffle {
            opened,
            groups,
            others,
            own_partition: OwnPartition::default(),
            in_place: AtomicU64::new(0),
            unfinished,
        })
    }

    /// How threads that both send and receive get their own node's tuples (in place
    /// unless told otherwise).
    pub fn with_own_partition(mut self, own_partition: OwnPartition) -> Shuffle {
        self.own_partition = own_partition;
        self
    }

    pub fn groups(&self) -> &Groups {
        &self.groups
    }

    /// Buffers of this node's own partition consumed in place so far.
    pub fn consumed_in_place(&self) -> u64 {
        self.in_place.load(Ordering::Relaxed)
    }

    /// The writer of thread `tid`.
    pub fn writer(&self, tid: usize) -> ShuffleWriter<'_> {
        self.writer_consuming(tid, None)
    }

    fn writer_consuming<'a>(
        &'a self,
        tid: usize,
        own: Option<&'a LocalConsumer<'a>>,
    ) -> ShuffleWriter<'a> {
        let lane = tid % self.opened.senders.len();
        ShuffleWriter {
            shuffle: self,
            lane,
            endpoint: self.opened.senders[lane].clone(),
            out: (0..self.groups.len()).map(|_| None).collect(),
            own: own.filter(|_| self.own_partition == OwnPartition::InPlace),
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

/// What a thread that also receives does with a received buffer; shared by its
/// receiving and its writer, which consumes its own node's buffers in place.
type LocalConsumer<'a> = RefCell<&'a mut dyn FnMut(&Received)>;

/// Hands `data` to `consumer`. The receiving and the writer of one thread never run it
/// nested; were they to, that is an error, not a panic.
fn consume_one(consumer: &LocalConsumer<'_>, data: &Received) -> Result<()> {
    let mut consume = consumer.try_borrow_mut().map_err(|_| {
        ShuffleError::Invalid("a buffer was consumed while consuming another".into())
    })?;
    (*consume)(data);
    Ok(())
}

/// The unfilled words of a writer's buffer for a group: none while it has no buffer.
fn unfilled(buf: &Option<SendBuf>) -> &[AtomicU64] {
    buf.as_ref().map_or(&[], SendBuf::unfilled)
}

/// One thread's output buffers (Algorithm 1).
pub struct ShuffleWriter<'a> {
    shuffle: &'a Shuffle,
    lane: usize,
    endpoint: Arc<dyn SendEndpoint>,
    out: Vec<Option<SendBuf>>,
    /// Set when this thread also receives and its own node's buffers are consumed here.
    own: Option<&'a LocalConsumer<'a>>,
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
        let emptied = match self.out[group].take() {
            Some(full) => self.transmit(full, group)?,
            None => None,
        };
        let mut buf = match emptied {
            Some(buf) => buf,
            None => self.endpoint.acquire()?,
        };
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
    ///
    /// A writer of two groups (a repartition between two nodes) fills both buffers
    /// with [`crate::scatter::two_groups`], which keeps its write cursors in registers.
    pub fn push_partitioned<const W: usize>(
        &mut self,
        mut tuples: &[[u64; W]],
        group_of: impl Fn(&[u64; W]) -> usize,
    ) -> Result<()> {
        while let [first, second] = &mut self.out[..]
            && !tuples.is_empty()
        {
            let mut rest = [unfilled(first), unfilled(second)];
            let copied = crate::scatter::two_groups(tuples, &group_of, &mut rest);
            let left = rest.map(<[AtomicU64]>::len);
            for (buf, left) in [first, second].into_iter().zip(left) {
                if let Some(buf) = buf {
                    buf.set_unfilled_words(left);
                }
            }
            tuples = &tuples[copied..];
            // The tuple it stopped before: a full buffer (or none yet) to replace, or a
            // group that does not exist.
            if let Some((stopped, after)) = tuples.split_first() {
                self.push(group_of(stopped), stopped)?;
                tuples = after;
            }
        }
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
            self.out[group] = self.transmit(buf, group)?;
        }
        Ok(())
    }

    /// Sends a filled buffer to its group, then gives this thread's idle work a turn: a
    /// thread that also receives ([`send_and_receive`]) takes in what arrived meanwhile
    /// once per buffer, not only when its sending has to wait.
    ///
    /// When this thread consumes its own node's buffers in place and the node is in the
    /// group, it consumes this one first; a buffer for this node alone then comes
    /// back, emptied, to be filled again.
    fn transmit(&mut self, mut buf: SendBuf, group: usize) -> Result<Option<SendBuf>> {
        let mut emptied = None;
        let (members, others) = (
            self.shuffle.groups.members(group),
            &self.shuffle.others[group],
        );
        match self.own {
            Some(consumer) if others.len() < members.len() => {
                consume_one(consumer, &Received::in_place(&buf, self.endpoint.id()))?;
                self.shuffle.in_place.fetch_add(1, Ordering::Relaxed);
                if others.is_empty() {
                    buf.clear();
                    emptied = Some(buf);
                } else {
                    self.endpoint.put_data(buf, others, State::MoreData)?;
                }
            }
            _ => self.endpoint.put_data(buf, members, State::MoreData)?,
        }
        match idle::run_idle_work() {
            Idle::Failed => Err(ShuffleError::Invalid(
                "receiving on the sending thread failed".into(),
            )),
            Idle::Nothing | Idle::Progress => Ok(emptied),
        }
    }

    /// Flushes every buffer; the last thread of the lane ends its stream.
    pub fn finish(mut self) -> Result<()> {
        for g in 0..self.out.len() {
            self.flush(g)?;
        }
        // Empty buffers (acquired and never filled, or consumed in place) go out to
        // nobody, which returns them. Every thread of the lane does so before it counts
        // itself finished: the last one then ends the stream, after which the endpoint
        // takes nothing more, not even a buffer back.
        let spare: Vec<SendBuf> = self.out.iter_mut().filter_map(Option::take).collect();
        for buf in spare {
            self.endpoint.put_data(buf, &[], State::MoreData)?;
        }
        if self.shuffle.unfinished[self.lane].fetch_sub(1, Ordering::AcqRel) == 1 {
            let buf = self.endpoint.acquire()?;
            self.endpoint.put_data(buf, &[], State::Depleted)?;
        }
        Ok(())
    }
}

/// One thread that both sends and receives: runs `send` with thread `tid`'s writer
/// and finishes it, taking in what its receive endpoint got after every buffer it
/// transmits and whenever its sending has to wait, then drains the endpoint to the end
/// of every stream. `consume` sees every received buffer, as with [`receive_all`], and
/// (unless the shuffle was told [`OwnPartition::Fabric`]) every buffer of this node's
/// own partition as it fills, in place.
///
/// A node can so run one thread per core instead of a sender and a receiver for each:
/// no thread waits for a core while another spins on the data it would produce. The
/// waits of the send endpoint keep the peers going, since the buffers and credit this
/// thread waits for come back only once the peers' receivers ran, and a peer's
/// receiver may be the thread of that peer that waits on this node.
pub fn send_and_receive(
    shuffle: &Shuffle,
    tid: usize,
    send: impl FnOnce(&mut ShuffleWriter<'_>) -> Result<()>,
    mut consume: impl FnMut(&Received),
) -> Result<()> {
    let endpoint = shuffle.receiver(tid);
    let consumer: LocalConsumer<'_> = RefCell::new(&mut consume);
    let mut failed = None;
    let mut ended = false;
    let mut take_in = || -> Idle {
        if failed.is_some() {
            return Idle::Failed;
        }
        let mut took = false;
        while !ended {
            let step = match endpoint.try_get_data() {
                Ok(Poll::Ready(Some(data))) => {
                    consume_one(&consumer, &data).and_then(|()| endpoint.release(data))
                }
                Ok(Poll::Ready(None)) => {
                    ended = true;
                    Ok(())
                }
                Ok(Poll::Pending) => break,
                Err(e) => Err(e),
            };
            if let Err(e) = step {
                failed = Some(e);
                return Idle::Failed;
            }
            took = true;
        }
        if took { Idle::Progress } else { Idle::Nothing }
    };
    let sent = idle::with_idle_work(&mut take_in, || {
        let mut writer = shuffle.writer_consuming(tid, Some(&consumer));
        send(&mut writer)?;
        writer.finish()
    });
    // A failure to receive is the cause; the sending call it stopped only reports that.
    if let Some(e) = failed {
        return Err(e);
    }
    sent?;
    if ended {
        return Ok(());
    }
    let mut consume = consumer.try_borrow_mut().map_err(|_| {
        ShuffleError::Invalid("the consumer of a finished writer is still in use".into())
    })?;
    receive_all(&*endpoint, |data| (*consume)(data))
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
