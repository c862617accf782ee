//! The sending side of a flow: one thread's entry point.

use super::combine::Table;
use super::net::{ALL_TARGETS, CLOSE, DATA, DATA_HEADER_WORDS, FlowShared, Net, tag, wait_for};
use super::{FlowError, FlowKind, FlowResult, Mode, Routing};
use std::sync::Arc;

/// A source of a flow, owned by one thread. Push tuples, then [`Source::close`].
///
/// A source that is dropped without being closed never ends the flow: its targets
/// wait for it and eventually time out, naming it.
pub struct Source {
    net: Arc<Net>,
    flow: Arc<FlowShared>,
    index: usize,
    thread: usize,
    /// Per target (one slot for a replicate flow): a DATA message being filled, its
    /// two header words first.
    staging: Vec<Vec<u64>>,
    /// DATA messages sent, per target.
    sent: Vec<u64>,
    /// Tuple words one message holds.
    batch_words: usize,
    table: Option<Table>,
    closed: bool,
}

/// The key hash that routes shuffle and combiner flows.
#[inline]
pub(crate) fn hash_key(key: &[u64]) -> u64 {
    let mut h = 0x243f_6a88_85a3_08d3u64;
    for &w in key {
        h = crate::testing::mix(h ^ w);
    }
    h
}

impl Source {
    pub(crate) fn new(net: Arc<Net>, flow: Arc<FlowShared>, index: usize, thread: usize) -> Source {
        let targets = flow.spec.targets.len();
        let slots = match flow.spec.kind {
            FlowKind::Replicate => 1,
            _ => targets,
        };
        let staging = (0..slots)
            .map(|slot| {
                let target = match flow.spec.kind {
                    FlowKind::Replicate => ALL_TARGETS,
                    _ => slot as u32,
                };
                let mut m = Vec::with_capacity(net.payload_words.min(1 << 13));
                m.push(tag(DATA, flow.id));
                m.push(index as u64 | (target as u64) << 32);
                m
            })
            .collect();
        let width = flow.wire_width;
        let batch_words = (net.payload_words - DATA_HEADER_WORDS) / width * width;
        let table = match &flow.spec.kind {
            FlowKind::Combiner(_) => Some(Table::new(
                flow.aggs.clone(),
                flow.spec.schema.columns()[flow.spec.schema.key()]
                    .ty
                    .words(),
            )),
            _ => None,
        };
        Source {
            staging,
            sent: vec![0; targets],
            batch_words,
            table,
            closed: false,
            net,
            flow,
            index,
            thread,
        }
    }

    /// This source's index in the flow's source list.
    pub fn index(&self) -> usize {
        self.index
    }

    fn check(&self, tuple: &[u64]) -> FlowResult<()> {
        if self.closed {
            return Err(FlowError::Closed {
                flow: self.flow.name().to_string(),
                node: self.flow.rank,
                thread: self.thread,
            });
        }
        let expected = self.flow.spec.schema.width();
        if tuple.len() != expected {
            return Err(FlowError::TupleWidth {
                flow: self.flow.name().to_string(),
                expected,
                got: tuple.len(),
            });
        }
        Ok(())
    }

    fn unknown(&self, target: usize) -> FlowError {
        FlowError::UnknownTarget {
            flow: self.flow.name().to_string(),
            target,
            targets: self.flow.spec.targets.len(),
        }
    }

    /// Pushes one tuple of the flow's schema. May block while a target it goes to has
    /// a full window of unconsumed messages from this source.
    pub fn push(&mut self, tuple: &[u64]) -> FlowResult<()> {
        self.check(tuple)?;
        let targets = self.flow.spec.targets.len() as u64;
        match &self.flow.spec.kind {
            FlowKind::Shuffle(Routing::Hash) => {
                let t = hash_key(self.flow.spec.schema.key_of(tuple)) % targets;
                self.stage(t as usize, tuple)
            }
            FlowKind::Shuffle(Routing::Function(f)) => {
                let t = f(tuple);
                if t as u64 >= targets {
                    return Err(self.unknown(t));
                }
                self.stage(t, tuple)
            }
            FlowKind::Replicate => self.stage(0, tuple),
            FlowKind::Combiner(_) => {
                let table = self.table.as_mut().expect("a combiner source has a table");
                table.add(self.flow.spec.schema.key_of(tuple), tuple);
                if self.flow.spec.mode == Mode::Latency
                    || table.len() >= self.net.config.combiner_entries
                {
                    self.flush_table()?;
                }
                Ok(())
            }
        }
    }

    /// Pushes one tuple to target `target` (an index into the flow's target list),
    /// whatever the routing. Shuffle flows only.
    pub fn push_to(&mut self, target: usize, tuple: &[u64]) -> FlowResult<()> {
        self.check(tuple)?;
        if !matches!(self.flow.spec.kind, FlowKind::Shuffle(_)) {
            return Err(FlowError::WrongKind {
                flow: self.flow.name().to_string(),
                what: "push_to needs a shuffle flow".into(),
            });
        }
        if target >= self.flow.spec.targets.len() {
            return Err(self.unknown(target));
        }
        self.stage(target, tuple)
    }

    fn stage(&mut self, slot: usize, wire: &[u64]) -> FlowResult<()> {
        let m = &mut self.staging[slot];
        m.extend_from_slice(wire);
        if self.flow.spec.mode == Mode::Latency
            || m.len() - DATA_HEADER_WORDS + wire.len() > self.batch_words
        {
            self.send(slot)?;
        }
        Ok(())
    }

    /// Sends the combiner table's partials on their way.
    fn flush_table(&mut self) -> FlowResult<()> {
        let table = self.table.as_mut().expect("a combiner source has a table");
        let wires: Vec<Vec<u64>> = table.drain_wire().collect();
        let targets = self.flow.spec.targets.len() as u64;
        let key_words = self.flow.wire_width - self.flow.aggs.len();
        for w in wires {
            let t = hash_key(&w[..key_words]) % targets;
            self.stage(t as usize, &w)?;
        }
        Ok(())
    }

    /// Sends slot `slot`'s message, once every target it goes to has credit.
    fn send(&mut self, slot: usize) -> FlowResult<()> {
        if self.staging[slot].len() == DATA_HEADER_WORDS {
            return Ok(());
        }
        let spec = &self.flow.spec;
        let all: Vec<usize>;
        let (targets, dests): (&[usize], Vec<usize>) = match spec.kind {
            FlowKind::Replicate => {
                all = (0..spec.targets.len()).collect();
                (&all, self.flow.target_nodes.clone())
            }
            _ => (std::slice::from_ref(&slot), vec![spec.targets[slot].0]),
        };
        let window = self.flow.window;
        let (sent, index) = (&self.sent, self.index);
        wait_for(
            &self.net,
            &self.flow,
            |st| {
                let full: Vec<_> = targets
                    .iter()
                    .filter(|&&t| sent[t] - st.acked[index][t] >= window)
                    .map(|&t| spec.targets[t])
                    .collect();
                format!("credit: targets {full:?} consume nothing")
            },
            |st| {
                targets
                    .iter()
                    .all(|&t| sent[t] - st.acked[index][t] < window)
                    .then_some(())
            },
        )?;
        self.net.send(self.thread, &dests, &self.staging[slot])?;
        for &t in targets {
            self.sent[t] += 1;
        }
        self.staging[slot].truncate(DATA_HEADER_WORDS);
        Ok(())
    }

    /// Sends what is buffered, then tells every target how much this source sent. A
    /// target ends once all its sources closed. Pushing afterwards is an error.
    pub fn close(&mut self) -> FlowResult<()> {
        self.check_open()?;
        self.closed = true;
        if self.table.is_some() {
            self.flush_table()?;
        }
        for slot in 0..self.staging.len() {
            self.send(slot)?;
        }
        let mut m = Vec::with_capacity(2 + self.sent.len());
        m.push(tag(CLOSE, self.flow.id));
        m.push(self.index as u64);
        m.extend_from_slice(&self.sent);
        self.net.send(self.thread, &self.flow.target_nodes, &m)
    }

    fn check_open(&self) -> FlowResult<()> {
        if self.closed {
            return Err(FlowError::Closed {
                flow: self.flow.name().to_string(),
                node: self.flow.rank,
                thread: self.thread,
            });
        }
        Ok(())
    }

    pub fn is_closed(&self) -> bool {
        self.closed
    }
}

impl std::fmt::Debug for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Source({:?} #{} of node {} thread {}{})",
            self.flow.spec.name,
            self.index,
            self.flow.rank,
            self.thread,
            if self.closed { ", closed" } else { "" }
        )
    }
}
