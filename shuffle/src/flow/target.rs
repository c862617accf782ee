//! The receiving side of a flow: one thread's exit point.

use super::combine::{Combined, Table};
use super::net::{ACK, DATA_HEADER_WORDS, FlowShared, Net, tag, wait_for};
use super::{FlowError, FlowKind, FlowResult};
use std::sync::Arc;

/// The tuples of one DATA message, copied out of the endpoint buffer.
#[derive(Clone, Debug)]
pub struct Batch {
    source: usize,
    width: usize,
    /// The whole message, flow header included (shared by the targets of a node for
    /// a replicate flow).
    message: Arc<[u64]>,
}

impl Batch {
    pub(crate) fn new(source: usize, width: usize, message: Arc<[u64]>) -> Batch {
        Batch {
            source,
            width,
            message,
        }
    }
    /// The index of the source that sent it, in the flow's source list.
    pub fn source(&self) -> usize {
        self.source
    }
    /// Tuples in the batch.
    pub fn len(&self) -> usize {
        self.words().len() / self.width
    }
    pub fn is_empty(&self) -> bool {
        self.words().is_empty()
    }
    /// The tuples' words.
    pub fn words(&self) -> &[u64] {
        &self.message[DATA_HEADER_WORDS..]
    }
    pub fn tuples(&self) -> std::slice::ChunksExact<'_, u64> {
        self.words().chunks_exact(self.width)
    }
}

/// A target of a flow, owned by one thread: consume until the end.
pub struct Target {
    net: Arc<Net>,
    flow: Arc<FlowShared>,
    index: usize,
    thread: usize,
    /// DATA messages taken from the queue, per source.
    consumed: Vec<u64>,
    /// What the sources were last told.
    reported: Vec<u64>,
    current: Option<Batch>,
    at: usize,
}

impl Target {
    pub(crate) fn new(net: Arc<Net>, flow: Arc<FlowShared>, index: usize, thread: usize) -> Target {
        let sources = flow.spec.sources.len();
        Target {
            net,
            flow,
            index,
            thread,
            consumed: vec![0; sources],
            reported: vec![0; sources],
            current: None,
            at: 0,
        }
    }

    /// This target's index in the flow's target list.
    pub fn index(&self) -> usize {
        self.index
    }

    /// The next batch of tuples; `None` once every source closed and all it sent here
    /// was consumed. Blocks until one of the two. On a combiner flow the tuples are
    /// partial aggregates: the key's words, then one word per aggregate.
    pub fn next_batch(&mut self) -> FlowResult<Option<Batch>> {
        let t = self.index;
        let spec = &self.flow.spec;
        let batch = wait_for(
            &self.net,
            &self.flow,
            |st| {
                format!(
                    "data for target {:?}; sources still open: {:?}",
                    spec.targets[t],
                    st.open_sources(spec)
                )
            },
            |st| {
                if let Some(b) = st.queues[t].pop_front() {
                    Some(Some(b))
                } else if st.ended(t) {
                    Some(None)
                } else {
                    None
                }
            },
        )?;
        if let Some(b) = &batch {
            self.consumed[b.source] += 1;
            self.acknowledge(b.source)?;
        }
        Ok(batch)
    }

    /// Tells source `s` how much was consumed, every half window.
    fn acknowledge(&mut self, s: usize) -> FlowResult<()> {
        let every = (self.flow.window / 2).max(1);
        if self.consumed[s] - self.reported[s] < every {
            return Ok(());
        }
        let m = [
            tag(ACK, self.flow.id),
            s as u64 | (self.index as u64) << 32,
            self.consumed[s],
        ];
        self.net
            .send(self.thread, &[self.flow.spec.sources[s].0], &m)?;
        self.reported[s] = self.consumed[s];
        Ok(())
    }

    /// The next tuple; `None` at the end of the flow.
    pub fn next_tuple(&mut self) -> FlowResult<Option<&[u64]>> {
        loop {
            if let Some(b) = &self.current
                && self.at < b.words().len()
            {
                break;
            }
            self.at = 0;
            self.current = self.next_batch()?;
            if self.current.is_none() {
                return Ok(None);
            }
        }
        let b = self.current.as_ref().expect("checked above");
        let tuple = &b.words()[self.at..self.at + b.width];
        self.at += b.width;
        Ok(Some(tuple))
    }

    /// Every remaining tuple, until the end of the flow.
    pub fn collect_all(&mut self) -> FlowResult<Vec<Vec<u64>>> {
        let mut out = Vec::new();
        while let Some(t) = self.next_tuple()? {
            out.push(t.to_vec());
        }
        Ok(out)
    }

    /// Consumes a combiner flow to its end and returns the merged aggregates of this
    /// target's keys, sorted by key.
    pub fn combined(mut self) -> FlowResult<Vec<Combined>> {
        if !matches!(self.flow.spec.kind, FlowKind::Combiner(_)) {
            return Err(FlowError::WrongKind {
                flow: self.flow.name().to_string(),
                what: "combined() needs a combiner flow".into(),
            });
        }
        let key_words = self.flow.wire_width - self.flow.aggs.len();
        let mut table = Table::new(self.flow.aggs.clone(), key_words);
        if let Some(b) = self.current.take() {
            for w in b.words()[self.at..].chunks_exact(b.width) {
                table.merge_wire(w);
            }
        }
        while let Some(b) = self.next_batch()? {
            for w in b.tuples() {
                table.merge_wire(w);
            }
        }
        Ok(table.into_combined())
    }
}

impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Target({:?} #{} of node {} thread {})",
            self.flow.spec.name, self.index, self.flow.rank, self.thread
        )
    }
}
