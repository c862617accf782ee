//! What a chaos node writes as it runs, one JSON object per line, and how the harness
//! turns the files of every node incarnation into one history.
//!
//! A transaction is written twice: `pending` just before its commit is asked for (its
//! operations, status `unknown`), and `done` once the outcome is known. Each line is
//! one `write` of a whole line, so a SIGKILL loses nothing already acknowledged; a line
//! cut short by the kill can only be the file's last, and is ignored. A transaction
//! with no `done` line stays `unknown`: its effects may or may not be in the database,
//! which is how the checkers treat it (see `HistoryIndex`: an unknown transaction
//! whose write some read observed counts as committed).

use crate::history::{Status, Txn};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::fs::File;
use std::io::{self, BufRead, BufReader, Write};
use std::path::Path;
use std::sync::{Mutex, PoisonError};

/// One line of a node's event file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum NodeEvent {
    /// Connected, sessions open: faults aimed at the node now hit running work.
    Ready { node: usize, incarnation: u64 },
    /// About to commit: the transaction's operations, status `unknown`.
    Pending { txn: Txn },
    /// The outcome.
    Done { txn: Txn },
    /// A recovery this process ran.
    Recovery { recovery: Recovery },
    /// Opening the database, this process repaired what memory-server restarts lost.
    Repair { repair: Repair },
}

/// A repair of memory-server restarts (`txn::RestartReport`) by the process that
/// opened the database first after them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Repair {
    /// The servers whose restart it repaired.
    pub restarted: Vec<usize>,
    pub log_records: u64,
    /// Blocks written again from a log record (the server had lost the install).
    pub reinstalled: u64,
    pub locks_rolled_forward: u64,
    pub locks_rolled_back: u64,
    /// Index slots a restarted server kept claimed without an address, whose
    /// claimer's block it lost, given a tombstone block (`claims_settled`). Absent
    /// from event files of before it was recorded.
    #[serde(default)]
    pub claims_settled: u64,
    pub blocks_scanned: u64,
    /// Where the new oracle started, if server 0 restarted.
    pub oracle_from: Option<u64>,
    pub took_us: u64,
    /// Unix time, in nanoseconds, when it finished.
    pub finished_ns: u64,
}

/// A recovery of a dead node's oracle slot: its locks resolved from the commit log.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Recovery {
    pub slot: u32,
    pub holder_tag: u16,
    pub rolled_forward: u64,
    pub rolled_back: u64,
    pub blocks_scanned: u64,
    pub took_us: u64,
    /// Unix time, in nanoseconds, when it finished.
    pub finished_ns: u64,
}

/// Appends events to a file, each line with one write so a kill cannot split it
/// between two lines.
pub struct EventWriter {
    file: Mutex<File>,
}

impl EventWriter {
    pub fn create(path: &Path) -> io::Result<EventWriter> {
        Ok(EventWriter {
            file: Mutex::new(File::create(path)?),
        })
    }

    pub fn write(&self, event: &NodeEvent) -> io::Result<()> {
        let mut line = serde_json::to_vec(event)?;
        line.push(b'\n');
        // A File is unbuffered: once write_all returns, the line is the kernel's and
        // survives this process being killed.
        self.file
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .write_all(&line)
    }
}

/// Why an event file could not be read.
#[derive(Debug, thiserror::Error)]
#[error("{file}, line {line}: {message}")]
pub struct EventError {
    pub file: String,
    pub line: u64,
    pub message: String,
}

/// Reads an event file. Only an unterminated last line may be damaged (the process was
/// killed while writing it); it is dropped. Anything else malformed is an error.
pub fn read_events(path: &Path) -> Result<Vec<NodeEvent>, EventError> {
    let error = |line: u64, message: String| EventError {
        file: path.display().to_string(),
        line,
        message,
    };
    let file = File::open(path).map_err(|e| error(0, e.to_string()))?;
    let mut input = BufReader::new(file);
    let mut events = Vec::new();
    let mut buf = Vec::new();
    let mut line = 0;
    loop {
        buf.clear();
        line += 1;
        match input.read_until(b'\n', &mut buf) {
            Ok(0) => return Ok(events),
            Ok(_) => {}
            Err(e) => return Err(error(line, e.to_string())),
        }
        let complete = buf.last() == Some(&b'\n');
        match serde_json::from_slice::<NodeEvent>(&buf) {
            Ok(event) => events.push(event),
            Err(_) if !complete => return Ok(events),
            Err(e) => return Err(error(line, e.to_string())),
        }
    }
}

/// The history of a run from its nodes' events: each transaction once, with its `done`
/// line if there is one, else its `pending` line (status `unknown`, error
/// `in-flight`), in begin order.
pub fn merge(events: impl IntoIterator<Item = NodeEvent>) -> Result<Vec<Txn>, String> {
    let mut txns: HashMap<u64, (Txn, bool)> = HashMap::new();
    for event in events {
        match event {
            NodeEvent::Pending { mut txn } => {
                txn.status = Status::Unknown;
                txn.error = Some("in-flight".into());
                if let Some((_, done)) = txns.get(&txn.id) {
                    let when = if *done { "after" } else { "twice, the second" };
                    return Err(format!(
                        "transaction {} is pending {when} its outcome",
                        txn.id
                    ));
                }
                txns.insert(txn.id, (txn, false));
            }
            NodeEvent::Done { txn } => {
                if let Some((_, true)) = txns.get(&txn.id) {
                    return Err(format!("transaction {} has two outcomes", txn.id));
                }
                txns.insert(txn.id, (txn, true));
            }
            NodeEvent::Ready { .. } | NodeEvent::Recovery { .. } | NodeEvent::Repair { .. } => {}
        }
    }
    let mut txns: Vec<Txn> = txns.into_values().map(|(txn, _)| txn).collect();
    txns.sort_by_key(|t| (t.begin_ns, t.id));
    Ok(txns)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::history::Op;

    fn txn(id: u64, status: Status) -> Txn {
        let mut t = Txn::new(id, 1, status);
        t.begin_ns = Some(id);
        t.ops = vec![Op::Append {
            key: "l1".into(),
            element: id as i64,
        }];
        t
    }

    #[test]
    fn a_pending_transaction_without_an_outcome_is_unknown() {
        let txns = merge([
            NodeEvent::Pending {
                txn: txn(2, Status::Unknown),
            },
            NodeEvent::Pending {
                txn: txn(1, Status::Unknown),
            },
            NodeEvent::Done {
                txn: txn(1, Status::Committed),
            },
            NodeEvent::Done {
                txn: txn(3, Status::Aborted),
            },
        ])
        .expect("merges");
        let got: Vec<(u64, Status)> = txns.iter().map(|t| (t.id, t.status)).collect();
        assert_eq!(
            got,
            [
                (1, Status::Committed),
                (2, Status::Unknown),
                (3, Status::Aborted)
            ]
        );
        assert_eq!(txns[1].error.as_deref(), Some("in-flight"));
    }

    #[test]
    fn two_outcomes_or_a_late_pending_are_errors() {
        let done = || NodeEvent::Done {
            txn: txn(1, Status::Committed),
        };
        let pending = || NodeEvent::Pending {
            txn: txn(1, Status::Unknown),
        };
        assert!(
            merge([done(), done()])
                .unwrap_err()
                .contains("two outcomes")
        );
        assert!(merge([done(), pending()]).unwrap_err().contains("after"));
        assert!(merge([pending(), pending()]).unwrap_err().contains("twice"));
    }

    #[test]
    fn a_torn_last_line_is_dropped_and_a_torn_middle_line_is_an_error() {
        let dir = tempfile::tempdir().expect("a directory");
        let path = dir.path().join("events.jsonl");
        let writer = EventWriter::create(&path).expect("created");
        writer
            .write(&NodeEvent::Ready {
                node: 0,
                incarnation: 1,
            })
            .expect("written");
        writer
            .write(&NodeEvent::Done {
                txn: txn(1, Status::Committed),
            })
            .expect("written");
        drop(writer);
        let mut bytes = std::fs::read(&path).expect("read");
        let whole = bytes.clone();
        bytes.extend_from_slice(br#"{"event":"done","txn":{"id":"#);
        std::fs::write(&path, &bytes).expect("written");
        assert_eq!(read_events(&path).expect("reads").len(), 2);

        let mut middle = br#"{"event":"ready"#.to_vec();
        middle.push(b'\n');
        middle.extend_from_slice(&whole);
        std::fs::write(&path, &middle).expect("written");
        let err = read_events(&path).unwrap_err().to_string();
        assert!(err.contains("line 1"), "{err}");
    }
}
