//! Where a node's operator is and how far it got, for the progress lines a long
//! benchmark prints while it runs (`namdb bench shuffle`, `join`, `aggregate`).
//!
//! The operators ([`crate::ops::join`], [`crate::ops::aggregate`]) update a
//! [`Progress`] their configuration hands them; a caller reads it from another thread.
//! Counting is relaxed atomics, once per [`CHUNK`] tuples (or per received buffer), so
//! a measured loop pays nothing it would notice.

use std::sync::atomic::{AtomicU8, AtomicU32, AtomicU64, Ordering};

/// Tuples an operator processes between two updates of its count.
pub const CHUNK: usize = 1 << 14;

/// A phase of a node's work. The order is the order a run goes through them, so the
/// node furthest behind is the one with the least phase (within the same step).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(u8)]
pub enum Phase {
    /// Measuring the constants of a cost model.
    Calibrating,
    /// Generating (and permuting) the input, checksums, references.
    Preparing,
    /// Sampling the input to choose an algorithm.
    Sampling,
    /// Opening the endpoints (connecting the sockets).
    Opening,
    /// Building a Bloom filter over R (tuples inserted of R).
    Filtering,
    /// Moving the data (tuples sent, of all this node holds).
    Shuffling,
    /// Aggregating the input (tuples scanned).
    Aggregating,
    /// Merging what arrived into the result, once this node sent all it had.
    Merging,
    /// Building the hash table over the R that arrived (tuples inserted).
    Building,
    /// Probing it with the S that arrived (tuples probed).
    Probing,
    /// Joining cache-sized partitions (S tuples probed).
    Joining,
    /// Checking what arrived.
    Verifying,
    Done,
}

impl Phase {
    pub const ALL: [Phase; 13] = [
        Phase::Calibrating,
        Phase::Preparing,
        Phase::Sampling,
        Phase::Opening,
        Phase::Filtering,
        Phase::Shuffling,
        Phase::Aggregating,
        Phase::Merging,
        Phase::Building,
        Phase::Probing,
        Phase::Joining,
        Phase::Verifying,
        Phase::Done,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Phase::Calibrating => "calibrating the cost model",
            Phase::Preparing => "preparing the fragments",
            Phase::Sampling => "sampling",
            Phase::Opening => "opening the endpoints",
            Phase::Filtering => "building the Bloom filter",
            Phase::Shuffling => "shuffling",
            Phase::Aggregating => "aggregating",
            Phase::Merging => "merging",
            Phase::Building => "building",
            Phase::Probing => "probing",
            Phase::Joining => "joining partitions",
            Phase::Verifying => "verifying",
            Phase::Done => "done",
        }
    }

    /// One word for the phase, for [`Snapshot::report`].
    pub fn key(self) -> &'static str {
        match self {
            Phase::Calibrating => "calibrating",
            Phase::Preparing => "preparing",
            Phase::Sampling => "sampling",
            Phase::Opening => "opening",
            Phase::Filtering => "filtering",
            Phase::Shuffling => "shuffling",
            Phase::Aggregating => "aggregating",
            Phase::Merging => "merging",
            Phase::Building => "building",
            Phase::Probing => "probing",
            Phase::Joining => "joining",
            Phase::Verifying => "verifying",
            Phase::Done => "done",
        }
    }

    pub fn from_key(key: &str) -> Option<Phase> {
        Phase::ALL.into_iter().find(|p| p.key() == key)
    }

    pub fn from_index(i: u8) -> Option<Phase> {
        Phase::ALL.get(usize::from(i)).copied()
    }
}

/// A node's progress: the step of its job it is at (a benchmark's run; the caller's to
/// set, operators leave it alone), its phase, and how much of the phase's work is done
/// out of how much (0 of 0 when the phase does not count). It starts at step 0,
/// preparing.
#[derive(Debug)]
pub struct Progress {
    step: AtomicU32,
    phase: AtomicU8,
    done: AtomicU64,
    total: AtomicU64,
}

/// What a [`Progress`] held when read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Snapshot {
    pub step: u32,
    pub phase: Phase,
    pub done: u64,
    pub total: u64,
}

impl Snapshot {
    /// `STEP PHASE DONE TOTAL`, the phase by its [`Phase::key`]: how another process
    /// hears of it (a node process of a benchmark; the MPI baseline's program writes
    /// the same).
    pub fn report(&self) -> String {
        format!(
            "{} {} {} {}",
            self.step,
            self.phase.key(),
            self.done,
            self.total
        )
    }

    /// Reads a [`Snapshot::report`]; `None` if it is not one.
    pub fn parse(report: &str) -> Option<Snapshot> {
        let mut words = report.split_whitespace();
        let (Some(step), Some(phase), Some(done), Some(total), None) = (
            words.next(),
            words.next(),
            words.next(),
            words.next(),
            words.next(),
        ) else {
            return None;
        };
        Some(Snapshot {
            step: step.parse().ok()?,
            phase: Phase::from_key(phase)?,
            done: done.parse().ok()?,
            total: total.parse().ok()?,
        })
    }

    /// The order of "further behind": earlier step, then earlier phase, then the
    /// smaller fraction done.
    pub fn behind(&self, other: &Snapshot) -> std::cmp::Ordering {
        let fraction = |s: &Snapshot| s.done as f64 / s.total.max(1) as f64;
        (self.step, self.phase)
            .cmp(&(other.step, other.phase))
            .then(fraction(self).total_cmp(&fraction(other)))
    }
}

impl Default for Progress {
    fn default() -> Progress {
        Progress {
            step: AtomicU32::new(0),
            phase: AtomicU8::new(Phase::Preparing as u8),
            done: AtomicU64::new(0),
            total: AtomicU64::new(0),
        }
    }
}

impl Progress {
    pub fn snapshot(&self) -> Snapshot {
        Snapshot {
            step: self.step.load(Ordering::Relaxed),
            phase: Phase::from_index(self.phase.load(Ordering::Relaxed)).unwrap_or(Phase::Done),
            done: self.done.load(Ordering::Relaxed),
            total: self.total.load(Ordering::Relaxed),
        }
    }

    pub fn phase(&self) -> Phase {
        self.snapshot().phase
    }

    pub fn done(&self) -> u64 {
        self.done.load(Ordering::Relaxed)
    }

    /// Moves to `phase`, keeping the count (a count that spans phases).
    pub fn enter(&self, phase: Phase) {
        self.phase.store(phase as u8, Ordering::Relaxed);
    }

    /// Moves to `phase`, whose work is `total` units, none done yet.
    pub fn start(&self, phase: Phase, total: u64) {
        self.done.store(0, Ordering::Relaxed);
        self.total.store(total, Ordering::Relaxed);
        self.enter(phase);
    }

    /// Moves to step `step` of the caller's job.
    pub fn set_step(&self, step: u32) {
        self.step.store(step, Ordering::Relaxed);
    }

    pub fn add(&self, n: u64) {
        self.done.fetch_add(n, Ordering::Relaxed);
    }

    /// Takes over what another process read from its own (see [`Snapshot`]).
    pub fn set(&self, s: Snapshot) {
        self.step.store(s.step, Ordering::Relaxed);
        self.done.store(s.done, Ordering::Relaxed);
        self.total.store(s.total, Ordering::Relaxed);
        self.enter(s.phase);
    }
}

/// Adds `items.len()` to `progress` after every [`CHUNK`] of `items` that `each` went
/// through, stopping at the first error.
pub fn counted<T, E>(
    progress: &Progress,
    items: &[T],
    mut each: impl FnMut(&T) -> Result<(), E>,
) -> Result<(), E> {
    for chunk in items.chunks(CHUNK) {
        for t in chunk {
            each(t)?;
        }
        progress.add(chunk.len() as u64);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phases_index_in_order_and_back() {
        for (i, p) in Phase::ALL.iter().enumerate() {
            assert_eq!(*p as usize, i);
            assert_eq!(Phase::from_index(i as u8), Some(*p));
        }
        assert_eq!(Phase::from_index(Phase::ALL.len() as u8), None);
    }

    #[test]
    fn a_report_reads_back_as_it_was() {
        for phase in Phase::ALL {
            assert_eq!(Phase::from_key(phase.key()), Some(phase));
            let s = Snapshot {
                step: 3,
                phase,
                done: 12345,
                total: 99,
            };
            assert_eq!(Snapshot::parse(&s.report()), Some(s));
        }
        let bad = [
            "",
            "2",
            "1 probing x 4",
            "1 nothing 1 1",
            "1 probing 1 1 1",
            "-1 probing 1 1",
            "5000000000 probing 1 1",
        ];
        for bad in bad {
            assert_eq!(Snapshot::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn the_node_behind_is_the_one_at_the_earlier_step_phase_and_fraction() {
        let at = |step, phase, done, total| Snapshot {
            step,
            phase,
            done,
            total,
        };
        let a = at(1, Phase::Probing, 10, 10);
        let b = at(2, Phase::Opening, 0, 0);
        assert!(a.behind(&b).is_lt());
        let c = at(1, Phase::Building, 10, 10);
        assert!(c.behind(&a).is_lt());
        let d = at(1, Phase::Probing, 3, 10);
        assert!(d.behind(&a).is_lt());
    }

    #[test]
    fn counting_adds_each_chunk_once_it_is_through() {
        let p = Progress::default();
        p.start(Phase::Shuffling, 3 * CHUNK as u64);
        let items = vec![0u8; CHUNK + 5];
        counted::<_, ()>(&p, &items, |_| Ok(())).unwrap();
        assert_eq!(p.done(), CHUNK as u64 + 5);
        let mut seen = 0;
        let err = counted(&p, &items, |_| {
            seen += 1;
            if seen > CHUNK + 1 {
                Err("stop")
            } else {
                Ok(())
            }
        });
        assert_eq!(err, Err("stop"));
        assert_eq!(
            p.done(),
            2 * CHUNK as u64 + 5,
            "only the chunk that went through"
        );
    }
}
