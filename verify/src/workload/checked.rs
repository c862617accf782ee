//! A workload run recorded in memory and checked: what the store tests (the reference
//! store's, txn's on the sim and across processes) all do.

use crate::anomaly::Findings;
use crate::history::{HistoryError, JsonlWriter};
use crate::index::{HistoryIndex, load_jsonl};
use crate::recorder::Recorder;
use crate::report::{self, Model, Report};
use crate::store::TxnStore;
use crate::workload::{RunConfig, RunError, RunSummary, Workload, run};

/// A run, its history and the checkers' report.
pub struct Checked {
    pub run: RunSummary,
    pub index: HistoryIndex,
    pub report: Report,
}

#[derive(Debug, thiserror::Error)]
pub enum CheckedRunError {
    #[error(transparent)]
    Run(#[from] RunError),
    #[error("the recorded history does not read back: {0}")]
    History(#[from] HistoryError),
}

/// Runs `workload` against `store`, records the history in memory, reads it back and
/// checks it under `model`.
pub fn run_checked<S: TxnStore>(
    store: &S,
    workload: &dyn Workload,
    config: &RunConfig,
    model: Model,
) -> Result<Checked, CheckedRunError> {
    let recorder = Recorder::new(JsonlWriter::new(Vec::new()));
    let run = run(store, workload, &recorder, config)?;
    let jsonl = recorder.into_sink().into_inner();
    let index = load_jsonl(&jsonl[..], Findings::DEFAULT_EXAMPLES)?;
    let report = report::check(&index, model);
    Ok(Checked { run, index, report })
}
