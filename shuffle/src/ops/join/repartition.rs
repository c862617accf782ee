//! The network pass every join shares: R and S are hash-partitioned over the shuffle
//! into `nodes × parts` global partitions (partition `g` lives on node `g / parts` as
//! its local partition `g mod parts`), optionally S is filtered first by the combined
//! Bloom filter of every node's R.
//!
//! Sending threads stage tuples in software-managed buffers, one block of [`BLOCK`]
//! tuples per global partition (Balkesen et al.'s write-combining buffers: the hot
//! loop writes a small cache-resident array, never the message), and copy a full
//! block into the destination node's message at once. A message is a sequence of
//! blocks, each behind a header word: the relation (2 bits), the local partition (30
//! bits) and the tuple count (32 bits). A filter block carries words of a node's Bloom
//! filter instead, its header's partition field holding the word offset. Receiving
//! threads append each block to their own array for that relation and partition.
//!
//! With a Bloom filter (§5.1.2), every node first builds a filter over its R with all
//! its sending threads, each thread then ORs its slice of it into the node's combined
//! filter and broadcasts the slice; receivers OR arriving slices in. R is shuffled
//! meanwhile; S only once all `nodes × words` filter words are in.

use super::Tuple;
use super::bloom::BloomFilter;
use super::hash::{hash, partition};
use crate::endpoint::{Backoff, Design, EndpointConfig, open};
use crate::error::{Result, ShuffleError};
use crate::node::Node;
use crate::operator::{Groups, Shuffle, ShuffleWriter, send_and_receive};
use crate::progress::{Phase, Progress, counted};
use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Tuples per software-managed buffer.
pub const BLOCK: usize = 32;

const REL_R: u64 = 1;
const REL_S: u64 = 2;
const REL_FILTER: u64 = 3;
const MAX_PART: usize = (1 << 30) - 1;

#[inline]
fn header(rel: u64, part: usize, count: usize) -> u64 {
    rel << 62 | (part as u64) << 32 | count as u64
}

/// How the pass runs.
#[derive(Clone, Debug)]
pub struct Plan {
    pub design: Design,
    pub threads: usize,
    pub message_bytes: u32,
    pub timeout: Duration,
    /// Local partitions per node (1 for the grace hash joins).
    pub parts: usize,
    /// Filter S by a Bloom filter over R of this many words (same on every node).
    pub bloom_words: Option<usize>,
    /// Each of the `threads` threads both sends and receives ([`send_and_receive`]),
    /// instead of `threads` senders and `threads` receivers.
    pub interleave: bool,
}

/// What one receiving thread collected: `parts[p]` is R's local partition `p`,
/// `parts[plan.parts + p]` S's.
pub struct Collected {
    pub parts: Vec<Vec<Tuple>>,
}

impl Collected {
    fn new(parts: usize) -> Collected {
        Collected {
            parts: (0..2 * parts).map(|_| Vec::new()).collect(),
        }
    }
}

/// The outcome of the pass on one node.
pub struct Repartitioned {
    pub collected: Vec<Collected>,
    /// Tuples this node sent (to itself included).
    pub r_sent: u64,
    pub s_sent: u64,
    /// Payload bytes this node sent, headers and filter included.
    pub bytes_sent: u64,
    /// The combined filter, when there was one.
    pub filter: Option<BloomFilter>,
    /// Opening the endpoints.
    pub setup: Duration,
    /// Building the local filter (included in `seconds`).
    pub bloom: Duration,
    /// From the barrier after setup until every tuple arrived here.
    pub seconds: Duration,
}

/// Per-thread counters of the senders.
#[derive(Default)]
struct Sent {
    r: u64,
    s: u64,
    words: u64,
}

/// State the sending and receiving threads of a node share.
struct Shared<'a> {
    plan: &'a Plan,
    progress: &'a Progress,
    nodes: usize,
    local: Option<BloomFilter>,
    combined: Option<BloomFilter>,
    /// Sending threads still inserting into `local`.
    filtering: AtomicUsize,
    /// Sending threads done inserting into `local`.
    inserted: AtomicUsize,
    /// Tuples of R and S this node's senders go through (its progress while shuffling).
    to_send: u64,
    /// Filter words merged into `combined`, local and received.
    merged: AtomicU64,
    failed: AtomicBool,
}

impl Shared<'_> {
    /// Waits until `counter` reaches `target`, a failure elsewhere, or the timeout.
    fn wait(&self, what: &str, counter: impl Fn() -> u64, target: u64) -> Result<()> {
        let mut backoff = Backoff::new(self.plan.timeout);
        while counter() < target {
            if self.failed.load(Ordering::Relaxed) {
                return Err(ShuffleError::Invalid(format!(
                    "{what}: another thread of this node failed"
                )));
            }
            if !backoff.wait() {
                return Err(ShuffleError::Timeout {
                    what: format!("{what} ({} of {target})", counter()),
                    waited: backoff.waited(),
                    counts: None,
                });
            }
        }
        Ok(())
    }
}

/// Runs the pass on this node: `r` and `s` are its fragments. Collective. Reports its
/// phases to `progress`: opening, building the Bloom filter (if any), then shuffling,
/// counting the tuples of `r` and `s` the senders went through.
pub fn run(
    node: &Node,
    r: &[Tuple],
    s: &[Tuple],
    plan: &Plan,
    progress: &Progress,
) -> Result<Repartitioned> {
    let nodes = node.nodes();
    if plan.threads == 0 {
        return Err(ShuffleError::Invalid(
            "a join needs at least one thread".into(),
        ));
    }
    if plan.parts == 0 || plan.parts > MAX_PART {
        return Err(ShuffleError::Invalid(format!(
            "{} partitions per node: expected 1..={MAX_PART}",
            plan.parts
        )));
    }
    progress.start(Phase::Opening, 0);
    let started = Instant::now();
    let config = EndpointConfig {
        threads: plan.threads,
        message_bytes: plan.message_bytes,
        timeout: plan.timeout,
        ..EndpointConfig::default()
    };
    let opened = open(node, plan.design, &config)?;
    let mut sets: Vec<Vec<usize>> = (0..nodes).map(|d| vec![d]).collect();
    if plan.bloom_words.is_some() && nodes > 1 {
        sets.push((0..nodes).filter(|&d| d != node.rank()).collect());
    }
    let shuffle = Shuffle::new(opened, Groups::multicast(sets), plan.threads)?;
    let setup = started.elapsed();
    node.all_gather("join: endpoints open", &())?;
    let started = Instant::now();
    // The senders count what they go through: with a filter, R as they insert it into
    // the filter, then R and S as they shuffle them.
    let to_send = (r.len() + s.len()) as u64;
    match plan.bloom_words {
        Some(_) => progress.start(Phase::Filtering, r.len() as u64),
        None => progress.start(Phase::Shuffling, to_send),
    }

    let shared = Shared {
        plan,
        progress,
        nodes,
        local: plan.bloom_words.map(BloomFilter::with_words),
        combined: plan.bloom_words.map(BloomFilter::with_words),
        filtering: AtomicUsize::new(plan.threads),
        inserted: AtomicUsize::new(0),
        to_send,
        merged: AtomicU64::new(0),
        failed: AtomicBool::new(false),
    };
    let lanes = shuffle.lanes();
    let bloom_done = std::sync::Mutex::new(Duration::ZERO);
    let (sent, collected) = std::thread::scope(|sc| {
        if plan.interleave {
            let threads: Vec<_> = (0..plan.threads)
                .map(|tid| {
                    let (shared, shuffle, bloom_done) = (&shared, &shuffle, &bloom_done);
                    let r = chunk(r, tid, plan.threads);
                    let s = chunk(s, tid, plan.threads);
                    sc.spawn(move || {
                        let out = send_and_file(shared, shuffle, tid, (r, s), started, bloom_done);
                        if out.0.is_err() || out.1.is_err() {
                            shared.failed.store(true, Ordering::Relaxed);
                        }
                        out
                    })
                })
                .collect();
            return threads
                .into_iter()
                .map(|h| h.join().expect("join thread panicked"))
                .unzip();
        }
        let senders: Vec<_> = (0..plan.threads)
            .map(|tid| {
                let (shared, shuffle, bloom_done) = (&shared, &shuffle, &bloom_done);
                let r = chunk(r, tid, plan.threads);
                let s = chunk(s, tid, plan.threads);
                sc.spawn(move || {
                    let mut w = shuffle.writer(tid);
                    let out = send(shared, &mut w, tid, r, s, started, bloom_done)
                        .and_then(|sent| w.finish().map(|()| sent));
                    if out.is_err() {
                        shared.failed.store(true, Ordering::Relaxed);
                    }
                    out
                })
            })
            .collect();
        let receivers: Vec<_> = (0..plan.threads.max(lanes))
            .map(|tid| {
                let (shared, endpoint) = (&shared, shuffle.receiver(tid));
                sc.spawn(move || {
                    let out = receive(shared, &*endpoint);
                    if out.is_err() {
                        shared.failed.store(true, Ordering::Relaxed);
                    }
                    out
                })
            })
            .collect();
        let sent: Vec<Result<Sent>> = senders
            .into_iter()
            .map(|h| h.join().expect("join sender panicked"))
            .collect();
        let collected: Vec<Result<Collected>> = receivers
            .into_iter()
            .map(|h| h.join().expect("join receiver panicked"))
            .collect();
        (sent, collected)
    });
    let seconds = started.elapsed();
    // The first error is the cause; later ones are mostly "another thread failed".
    let mut totals = Sent::default();
    let mut first_err = None;
    for s in sent {
        match s {
            Ok(s) => {
                totals.r += s.r;
                totals.s += s.s;
                totals.words += s.words;
            }
            Err(e) => {
                first_err.get_or_insert(e);
            }
        }
    }
    let mut all = Vec::with_capacity(collected.len());
    for c in collected {
        match c {
            Ok(c) => all.push(c),
            Err(e) => {
                first_err.get_or_insert(e);
            }
        }
    }
    if let Some(e) = first_err {
        return Err(e);
    }
    Ok(Repartitioned {
        collected: all,
        r_sent: totals.r,
        s_sent: totals.s,
        bytes_sent: totals.words * 8,
        filter: shared.combined,
        setup,
        bloom: bloom_done.into_inner().unwrap_or_else(|e| e.into_inner()),
        seconds,
    })
}

/// Thread `tid`'s share of `all` among `threads`.
fn chunk<T>(all: &[T], tid: usize, threads: usize) -> &[T] {
    let per = all.len().div_ceil(threads);
    let start = (tid * per).min(all.len());
    &all[start..(start + per).min(all.len())]
}

/// The software-managed buffers of one sending thread.
struct Stager {
    fanout: usize,
    parts: usize,
    blocks: Vec<Tuple>,
    fill: Vec<u32>,
    words: u64,
}

impl Stager {
    fn new(nodes: usize, parts: usize) -> Stager {
        let fanout = nodes * parts;
        Stager {
            fanout,
            parts,
            blocks: vec![[0; 2]; fanout * BLOCK],
            fill: vec![0; fanout],
            words: 0,
        }
    }

    #[inline]
    fn push(&mut self, w: &mut ShuffleWriter<'_>, rel: u64, h: u64, t: &Tuple) -> Result<()> {
        let g = partition(h, self.fanout);
        let f = self.fill[g] as usize;
        self.blocks[g * BLOCK + f] = *t;
        if f + 1 == BLOCK {
            self.fill[g] = 0;
            self.emit(w, rel, g, BLOCK)
        } else {
            self.fill[g] = (f + 1) as u32;
            Ok(())
        }
    }

    #[cold]
    fn emit(&mut self, w: &mut ShuffleWriter<'_>, rel: u64, g: usize, n: usize) -> Result<()> {
        let (node, part) = (g / self.parts, g % self.parts);
        let block = &self.blocks[g * BLOCK..g * BLOCK + n];
        let words = 1 + 2 * n;
        let buf = room(w, node, words)?;
        let at = buf.len_words();
        let p = &buf.payload()[at..at + words];
        p[0].store(header(rel, part, n), Ordering::Relaxed);
        for (cells, t) in p[1..].chunks_exact(2).zip(block) {
            cells[0].store(t[0], Ordering::Relaxed);
            cells[1].store(t[1], Ordering::Relaxed);
        }
        buf.set_len_words(at + words);
        self.words += words as u64;
        Ok(())
    }

    /// Sends every partly filled block.
    fn drain(&mut self, w: &mut ShuffleWriter<'_>, rel: u64) -> Result<()> {
        for g in 0..self.fanout {
            let n = std::mem::take(&mut self.fill[g]) as usize;
            if n > 0 {
                self.emit(w, rel, g, n)?;
            }
        }
        Ok(())
    }
}

/// Group `group`'s message with room for `words` more words, sending the current one
/// first if it is too full.
fn room<'w>(
    w: &'w mut ShuffleWriter<'_>,
    group: usize,
    words: usize,
) -> Result<&'w mut crate::buffer::SendBuf> {
    if w.buffer(group)?.remaining_words() < words {
        w.flush(group)?;
        let capacity = w.buffer(group)?.capacity_words();
        if capacity < words {
            return Err(ShuffleError::Invalid(format!(
                "a message of {capacity} words cannot hold a block of {words}"
            )));
        }
    }
    w.buffer(group)
}

/// One thread that sends its share of `r` and `s` and files what arrives meanwhile
/// and after: what it sent, and what it collected.
fn send_and_file(
    shared: &Shared<'_>,
    shuffle: &Shuffle,
    tid: usize,
    (r, s): (&[Tuple], &[Tuple]),
    started: Instant,
    bloom_done: &std::sync::Mutex<Duration>,
) -> (Result<Sent>, Result<Collected>) {
    let mut collected = Collected::new(shared.plan.parts);
    let mut bad = None;
    let mut sent = None;
    let run = send_and_receive(
        shuffle,
        tid,
        |w| {
            let out = send(shared, w, tid, r, s, started, bloom_done);
            out.map(|s| sent = Some(s))
        },
        |data| {
            if bad.is_none()
                && let Err(e) = file(shared, data, &mut collected)
            {
                // The filter waits of the sending notice it, as a split receiver's
                // failure.
                shared.failed.store(true, Ordering::Relaxed);
                bad = Some(e);
            }
        },
    );
    // A malformed message is the cause; the run only stopped because of it.
    match (bad, run) {
        (Some(e), _) => (Ok(Sent::default()), Err(e)),
        (None, Err(e)) => (Err(e), Ok(collected)),
        (None, Ok(())) => (Ok(sent.unwrap_or_default()), Ok(collected)),
    }
}

fn send(
    shared: &Shared<'_>,
    w: &mut ShuffleWriter<'_>,
    tid: usize,
    r: &[Tuple],
    s: &[Tuple],
    started: Instant,
    bloom_done: &std::sync::Mutex<Duration>,
) -> Result<Sent> {
    let plan = shared.plan;
    let mut stager = Stager::new(shared.nodes, plan.parts);
    let mut sent = Sent::default();
    if let (Some(local), Some(combined)) = (&shared.local, &shared.combined) {
        let Ok(()) = counted::<_, Infallible>(shared.progress, r, |t| {
            local.insert_hash(hash(t[0]));
            Ok(())
        });
        // The last thread to finish its part moves the node on to shuffling before it
        // counts itself inserted, so before any thread passes the wait below and
        // counts what it shuffles.
        if shared.filtering.fetch_sub(1, Ordering::AcqRel) == 1 {
            shared.progress.start(Phase::Shuffling, shared.to_send);
        }
        shared.inserted.fetch_add(1, Ordering::AcqRel);
        shared.wait(
            "the other threads building the Bloom filter",
            || shared.inserted.load(Ordering::Acquire) as u64,
            plan.threads as u64,
        )?;
        if tid == 0 {
            *bloom_done.lock().unwrap_or_else(|e| e.into_inner()) = started.elapsed();
        }
        let slice = chunk(local.words(), tid, plan.threads);
        let offset = tid * local.len_words().div_ceil(plan.threads);
        let values = slice.iter().map(|v| v.load(Ordering::Relaxed));
        combined.merge_at(offset.min(local.len_words()), values);
        shared
            .merged
            .fetch_add(slice.len() as u64, Ordering::AcqRel);
        if shared.nodes > 1 {
            sent.words += broadcast_filter(w, shared.nodes, offset, slice)?;
        }
    }
    counted(shared.progress, r, |t| stager.push(w, REL_R, hash(t[0]), t))?;
    stager.drain(w, REL_R)?;
    sent.r = r.len() as u64;
    if let Some(combined) = &shared.combined {
        let want = (shared.nodes * combined.len_words()) as u64;
        shared.wait(
            "the Bloom filters of every node",
            || shared.merged.load(Ordering::Acquire),
            want,
        )?;
        counted(shared.progress, s, |t| {
            let h = hash(t[0]);
            if combined.contains_hash(h) {
                stager.push(w, REL_S, h, t)?;
                sent.s += 1;
            }
            Ok::<_, ShuffleError>(())
        })?;
    } else {
        counted(shared.progress, s, |t| stager.push(w, REL_S, hash(t[0]), t))?;
        sent.s = s.len() as u64;
    }
    stager.drain(w, REL_S)?;
    sent.words += stager.words;
    Ok(sent)
}

/// Sends `slice` (words `offset..` of this node's filter) to every other node; the
/// broadcast group is the one after the nodes'. Returns the words sent.
fn broadcast_filter(
    w: &mut ShuffleWriter<'_>,
    nodes: usize,
    offset: usize,
    slice: &[std::sync::atomic::AtomicU64],
) -> Result<u64> {
    let group = nodes;
    let capacity = w.buffer(group)?.capacity_words();
    if capacity < 2 {
        return Err(ShuffleError::Invalid(
            "messages too small for the filter".into(),
        ));
    }
    let mut words = 0;
    let mut at = 0;
    while at < slice.len() {
        let n = (capacity - 1).min(slice.len() - at);
        let start = offset + at;
        if start > MAX_PART {
            return Err(ShuffleError::Invalid(format!(
                "a Bloom filter of more than {MAX_PART} words"
            )));
        }
        let buf = room(w, group, 1 + n)?;
        let len = buf.len_words();
        let p = &buf.payload()[len..len + 1 + n];
        p[0].store(header(REL_FILTER, start, n), Ordering::Relaxed);
        for (cell, v) in p[1..].iter().zip(&slice[at..at + n]) {
            cell.store(v.load(Ordering::Relaxed), Ordering::Relaxed);
        }
        buf.set_len_words(len + 1 + n);
        w.flush(group)?;
        words += 1 + n as u64;
        at += n;
    }
    Ok(words)
}

fn malformed(source: u32, why: String) -> ShuffleError {
    ShuffleError::Malformed {
        from: format!("endpoint {source}"),
        why,
    }
}

fn receive(shared: &Shared<'_>, endpoint: &dyn crate::endpoint::RecvEndpoint) -> Result<Collected> {
    let mut collected = Collected::new(shared.plan.parts);
    while let Some(data) = endpoint.get_data()? {
        let parsed = file(shared, &data, &mut collected);
        endpoint.release(data)?;
        parsed?;
    }
    Ok(collected)
}

/// Files the blocks of one message.
fn file(shared: &Shared<'_>, data: &crate::buffer::Received, into: &mut Collected) -> Result<()> {
    let parts = shared.plan.parts;
    let words = data.payload();
    let mut at = 0;
    while at < words.len() {
        let h = words[at].load(Ordering::Relaxed);
        let (rel, part, n) = (h >> 62, (h >> 32) as usize & MAX_PART, h as u32 as usize);
        at += 1;
        match rel {
            REL_R | REL_S => {
                let end = at + 2 * n;
                if part >= parts || end > words.len() {
                    return Err(malformed(
                        data.source,
                        format!("block of {n} tuples for partition {part} at word {at}"),
                    ));
                }
                let slot = if rel == REL_R { part } else { parts + part };
                into.parts[slot].extend(
                    words[at..end]
                        .chunks_exact(2)
                        .map(|c| [c[0].load(Ordering::Relaxed), c[1].load(Ordering::Relaxed)]),
                );
                at = end;
            }
            REL_FILTER => {
                let end = at + n;
                let merged = end <= words.len()
                    && shared.combined.as_ref().is_some_and(|f| {
                        f.merge_at(
                            part,
                            words[at..end].iter().map(|w| w.load(Ordering::Relaxed)),
                        )
                    });
                if !merged {
                    return Err(malformed(
                        data.source,
                        format!("filter block of {n} words at offset {part}"),
                    ));
                }
                shared.merged.fetch_add(n as u64, Ordering::AcqRel);
                at = end;
            }
            _ => return Err(malformed(data.source, format!("block header {h:#x}"))),
        }
    }
    Ok(())
}
