//! Runs a workload's transactions on a store's sessions, recording every operation.
//!
//! Two schedules: `Threads` gives each session an OS thread, as a real client would;
//! `Interleaved` steps all sessions from one thread in a seeded random order, one
//! action at a time, so many transactions overlap and a run is reproducible.

use super::{Action, TxnProgram, Workload};
use crate::history::ReadValue;
use crate::recorder::{HistorySink, Recorder, TxnRecord};
use crate::store::{StoreError, TxnStore};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::io;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Schedule {
    Threads,
    Interleaved,
}

#[derive(Clone, Debug)]
pub struct RunConfig {
    pub sessions: usize,
    /// Transactions across all sessions, not counting the workload's setup.
    pub txns: u64,
    pub seed: u64,
    pub schedule: Schedule,
}

/// Outcomes of the transactions run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RunSummary {
    pub committed: u64,
    pub aborted: u64,
    pub unknown: u64,
}

impl RunSummary {
    fn add(&mut self, other: RunSummary) {
        self.committed += other.committed;
        self.aborted += other.aborted;
        self.unknown += other.unknown;
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("cannot record the history: {0}")]
    Record(#[from] io::Error),
    #[error("the workload's setup transaction did not commit: {0}")]
    Setup(String),
    #[error("a run needs at least one session")]
    NoSessions,
    #[error("a session thread panicked")]
    SessionPanicked,
}

/// Runs `config.txns` transactions of `workload` against `store`, recording them.
pub fn run<S: TxnStore, H: HistorySink>(
    store: &S,
    workload: &dyn Workload,
    recorder: &Recorder<H>,
    config: &RunConfig,
) -> Result<RunSummary, RunError> {
    if config.sessions == 0 {
        return Err(RunError::NoSessions);
    }
    let sessions = config.sessions as u64;
    let mut runners: Vec<SessionRunner<S>> = (0..sessions)
        .map(|s| SessionRunner {
            id: s,
            session: store.open_session(),
            rng: StdRng::seed_from_u64(config.seed ^ (s + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15)),
            remaining: config.txns / sessions + u64::from(s < config.txns % sessions),
            active: None,
            summary: RunSummary::default(),
        })
        .collect();

    if let Some(setup) = workload.setup() {
        let first = &mut runners[0];
        first.start(store, recorder, setup)?;
        while first.active.is_some() {
            first.step(store, workload, recorder)?;
        }
        if first.summary.committed != 1 {
            let outcome = if first.summary.unknown > 0 {
                "its outcome is unknown"
            } else {
                "it aborted"
            };
            return Err(RunError::Setup(outcome.into()));
        }
        first.summary = RunSummary::default();
    }

    let mut total = RunSummary::default();
    match config.schedule {
        Schedule::Threads => {
            let results: Vec<Result<RunSummary, RunError>> = std::thread::scope(|scope| {
                let handles: Vec<_> = runners
                    .into_iter()
                    .map(|mut runner| {
                        scope.spawn(move || {
                            while runner.step(store, workload, recorder)? {}
                            Ok(runner.summary)
                        })
                    })
                    .collect();
                handles
                    .into_iter()
                    .map(|h| h.join().unwrap_or(Err(RunError::SessionPanicked)))
                    .collect()
            });
            for result in results {
                total.add(result?);
            }
        }
        Schedule::Interleaved => {
            let mut rng = StdRng::seed_from_u64(config.seed);
            while !runners.is_empty() {
                let at = rng.random_range(0..runners.len());
                if !runners[at].step(store, workload, recorder)? {
                    total.add(runners.swap_remove(at).summary);
                }
            }
        }
    }
    Ok(total)
}

/// One session and the transaction it has open.
struct SessionRunner<S: TxnStore> {
    id: u64,
    session: S::Session,
    rng: StdRng,
    remaining: u64,
    active: Option<Active<S>>,
    summary: RunSummary,
}

struct Active<S: TxnStore> {
    txn: S::Txn,
    program: Box<dyn TxnProgram>,
    record: TxnRecord,
    last_read: Option<ReadValue>,
}

impl<S: TxnStore> SessionRunner<S> {
    /// Performs the next action: begins a transaction or advances the open one.
    /// Returns false once the session has nothing left to do.
    fn step<H: HistorySink>(
        &mut self,
        store: &S,
        workload: &dyn Workload,
        recorder: &Recorder<H>,
    ) -> Result<bool, RunError> {
        let Some(mut active) = self.active.take() else {
            if self.remaining == 0 {
                return Ok(false);
            }
            self.remaining -= 1;
            let program = workload.next_txn(&mut self.rng);
            self.start(store, recorder, program)?;
            return Ok(true);
        };
        let action = active.program.next(active.last_read.as_ref());
        active.last_read = None;
        let done = match action {
            Action::Read(key) => match store.read(&mut active.txn, &key) {
                Ok(result) => {
                    active
                        .record
                        .read(&key, result.value.clone(), result.version);
                    active.last_read = Some(result.value);
                    Ok(())
                }
                Err(e) => Err(e),
            },
            Action::Write(key, value) => store
                .write(&mut active.txn, &key, value)
                .map(|()| active.record.write(&key, value)),
            Action::Append(key, element) => store
                .append(&mut active.txn, &key, element)
                .map(|()| active.record.append(&key, element)),
            Action::Commit => {
                let Active { txn, record, .. } = active;
                match store.commit(&mut self.session, txn) {
                    Ok(cid) => {
                        self.summary.committed += 1;
                        recorder.committed(record, cid)?;
                    }
                    Err(e @ StoreError::Indeterminate(_)) => {
                        self.summary.unknown += 1;
                        recorder.unknown(record, e.kind(), None)?;
                    }
                    Err(e) => {
                        self.summary.aborted += 1;
                        recorder.aborted(record, e.kind())?;
                    }
                }
                return Ok(true);
            }
            Action::Abort => {
                store.abort(&mut self.session, active.txn);
                self.summary.aborted += 1;
                recorder.aborted(active.record, "client_abort")?;
                return Ok(true);
            }
        };
        match done {
            Ok(()) => self.active = Some(active),
            Err(e) => {
                store.abort(&mut self.session, active.txn);
                self.summary.aborted += 1;
                recorder.aborted(active.record, e.kind())?;
            }
        }
        Ok(true)
    }

    fn start<H: HistorySink>(
        &mut self,
        store: &S,
        recorder: &Recorder<H>,
        program: Box<dyn TxnProgram>,
    ) -> Result<(), RunError> {
        let mut record = recorder.begin(self.id);
        match store.begin(&mut self.session) {
            Ok(txn) => {
                record.set_read_timestamp(store.read_timestamp(&txn));
                self.active = Some(Active {
                    txn,
                    program,
                    record,
                    last_read: None,
                });
            }
            Err(e) => {
                self.summary.aborted += 1;
                recorder.aborted(record, e.kind())?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::history::{Status, Txn};
    use crate::mem_store::MemStore;
    use crate::workload::{ListAppend, Script};

    /// Sets up with a transaction that gives up.
    struct FailingSetup;

    impl Workload for FailingSetup {
        fn setup(&self) -> Option<Box<dyn TxnProgram>> {
            Some(Box::new(Script::new([
                Action::Write("k".into(), 1),
                Action::Abort,
            ])))
        }

        fn next_txn(&self, _: &mut StdRng) -> Box<dyn TxnProgram> {
            Box::new(Script::new([Action::Commit]))
        }
    }

    fn config(sessions: usize, schedule: Schedule) -> RunConfig {
        RunConfig {
            sessions,
            txns: 50,
            seed: 9,
            schedule,
        }
    }

    #[test]
    fn a_failed_setup_and_no_sessions_are_errors() {
        let recorder = Recorder::new(Vec::<Txn>::new());
        let err = run(
            &MemStore::new(),
            &FailingSetup,
            &recorder,
            &config(2, Schedule::Threads),
        )
        .expect_err("setup aborts");
        assert_eq!(
            err.to_string(),
            "the workload's setup transaction did not commit: it aborted"
        );
        let err = run(
            &MemStore::new(),
            &FailingSetup,
            &recorder,
            &config(0, Schedule::Threads),
        )
        .expect_err("no sessions");
        assert!(matches!(err, RunError::NoSessions));
    }

    #[test]
    fn every_transaction_is_recorded_once_with_its_session() {
        for schedule in [Schedule::Threads, Schedule::Interleaved] {
            let recorder = Recorder::new(Vec::<Txn>::new());
            let summary = run(
                &MemStore::new(),
                &ListAppend::default(),
                &recorder,
                &config(3, schedule),
            )
            .expect("runs");
            let txns = recorder.into_sink();
            assert_eq!(txns.len(), 50);
            assert_eq!(summary.committed + summary.aborted + summary.unknown, 50);
            let committed = txns
                .iter()
                .filter(|t| t.status == Status::Committed)
                .count();
            assert_eq!(committed as u64, summary.committed);
            let mut ids: Vec<u64> = txns.iter().map(|t| t.id).collect();
            ids.sort_unstable();
            ids.dedup();
            assert_eq!(ids.len(), 50);
            for session in 0..3 {
                // 50 split over 3 sessions: 17, 17, 16.
                let count = txns.iter().filter(|t| t.session == session).count();
                assert_eq!(count, if session < 2 { 17 } else { 16 }, "{schedule:?}");
            }
            assert!(
                txns.iter()
                    .all(|t| t.rid.is_some() && t.begin_ns <= t.end_ns)
            );
        }
    }
}
