//! DFI-style flows (Thostrup's thesis, ch. 7) over the endpoints, several of them
//! multiplexed over one set of connections (Gonçalves et al., DAIS 2016).
//!
//! A node opens its endpoints once ([`crate::open`]) and hands them to a [`FlowNet`].
//! Flows are then declared on it, collectively ([`FlowNet::declare`]): every node
//! declares the same flows in the same order. A flow names its sources and targets as
//! `(node, thread)` pairs and carries a [`Schema`]. Each source thread takes its
//! [`Source`] and pushes tuples, then closes it; each target thread takes its
//! [`Target`] and consumes until the end ([`Target::next_tuple`] or
//! [`Target::next_batch`] return `None`), which it sees once every source closed and
//! all their data arrived. Flow names are unique per [`FlowNet`].
//!
//! - **Shuffle flow**: a tuple goes to one target, by the hash of its key
//!   ([`Routing::Hash`]), a routing function ([`Routing::Function`]) or explicitly
//!   ([`Source::push_to`]).
//! - **Replicate flow**: a tuple goes to every target. A batch is multicast once to the
//!   nodes hosting targets (one `put_data` with several destinations) and fanned out
//!   to the node's targets on arrival.
//! - **Combiner flow**: sources fold `(key, values)` tuples into partial aggregates per
//!   key ([`Aggregate`]: SUM, COUNT, MIN, MAX) in a table flushed when it holds
//!   [`FlowConfig::combiner_entries`] keys and at close; partials are routed by key and
//!   targets merge them ([`Target::combined`]). With one target this is DFI's N:1
//!   combiner; with several, each owns a hash partition of the keys.
//! - [`Mode::Bandwidth`] fills whole endpoint buffers before sending;
//!   [`Mode::Latency`] sends every push at once as its own small message (a combiner
//!   in latency mode does not combine at the source).
//!
//! # Multiplexing and the wire format
//!
//! Every message's payload starts with a tag word: a magic, the message kind and the
//! flow id (the declaration's sequence number, the same on every node). The design's
//! own header is left alone. Kinds:
//!
//! | kind | words after the tag |
//! |---|---|
//! | DATA | source and target (32 bits each; target all-ones: every target on the node), tuples |
//! | CLOSE | source, then per target of the flow the DATA messages sent to it |
//! | ACK | source and target (32 bits each), DATA messages of that source the target consumed |
//!
//! One demultiplexing thread per receive endpoint drains it: it copies each payload
//! out, releases the buffer at once, and files the data into per-flow, per-target
//! queues (or applies the CLOSE / ACK). It never blocks on a flow, so a target of flow
//! A never waits behind unconsumed data of flow B, and endpoint buffers always
//! circulate.
//!
//! The queues are bounded by flow-level credit instead: a source has at most
//! [`FlowConfig::window`] DATA messages outstanding per target, i.e. sent but not yet
//! consumed, and waits for ACKs beyond that. A target acknowledges (absolute counts,
//! so reordering is harmless) every half window it consumes; a message counts as
//! consumed once the target takes it out of its queue (it is a private copy then). A
//! queue therefore never holds more than `sources × window` messages.
//!
//! End of flow is counted, not ordered: CLOSE says how many DATA messages the source
//! sent to each target, and the target ends once every source's CLOSE arrived and
//! that many messages from it did. This holds for designs that reorder (UD) and when
//! several demultiplexing threads file messages concurrently (ME).
//!
//! As in DFI, sources block when a target does not consume, so targets must be
//! consumed by other threads than the ones pushing (or after them, for data within
//! the window). [`FlowNet::shutdown`] ends the endpoints' streams (collective: it
//! returns once every node shut down).

mod combine;
mod net;
mod schema;
mod source;
mod target;

#[cfg(test)]
mod mock;

pub use combine::{Agg, Aggregate, Combined};
pub use net::{Flow, FlowNet};
pub use schema::{Column, ColumnType, Schema, Value, pack_bytes, unpack_bytes};
pub use source::Source;
pub use target::{Batch, Target};

use crate::error::ShuffleError;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;
use thiserror::Error;

/// A source or target: thread `thread` of node (rank) `node`.
pub type Place = (usize, usize);

/// Every thread `0..threads` of every node `0..nodes`, node by node.
pub fn all_threads(nodes: usize, threads: usize) -> Vec<Place> {
    (0..nodes)
        .flat_map(|n| (0..threads).map(move |t| (n, t)))
        .collect()
}

/// What a flow optimizes for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Mode {
    /// Batch tuples per target into whole buffers.
    #[default]
    Bandwidth,
    /// Send every push at once.
    Latency,
}

/// How a shuffle flow picks a tuple's target.
#[derive(Clone)]
pub enum Routing {
    /// By a hash of the key column.
    Hash,
    /// A function of the tuple returning the index of a target in the flow's target
    /// list.
    Function(RouteFn),
}

/// A routing function: a tuple to the index of its target in the flow's target list.
pub type RouteFn = Arc<dyn Fn(&[u64]) -> usize + Send + Sync>;

impl fmt::Debug for Routing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Routing::Hash => f.write_str("hash"),
            Routing::Function(_) => f.write_str("function"),
        }
    }
}

#[derive(Clone, Debug)]
pub enum FlowKind {
    Shuffle(Routing),
    Replicate,
    Combiner(Vec<Aggregate>),
}

/// A flow's declaration.
#[derive(Clone, Debug)]
pub struct FlowSpec {
    pub name: String,
    pub kind: FlowKind,
    pub schema: Schema,
    pub sources: Vec<Place>,
    pub targets: Vec<Place>,
    pub mode: Mode,
}

impl FlowSpec {
    /// A shuffle flow routed by the hash of the key, with no sources or targets yet.
    pub fn shuffle(name: &str, schema: Schema) -> FlowSpec {
        FlowSpec::new(name, FlowKind::Shuffle(Routing::Hash), schema)
    }
    pub fn replicate(name: &str, schema: Schema) -> FlowSpec {
        FlowSpec::new(name, FlowKind::Replicate, schema)
    }
    pub fn combiner(name: &str, schema: Schema, aggs: Vec<Aggregate>) -> FlowSpec {
        FlowSpec::new(name, FlowKind::Combiner(aggs), schema)
    }
    fn new(name: &str, kind: FlowKind, schema: Schema) -> FlowSpec {
        FlowSpec {
            name: name.to_string(),
            kind,
            schema,
            sources: Vec::new(),
            targets: Vec::new(),
            mode: Mode::default(),
        }
    }
    pub fn sources(mut self, sources: impl IntoIterator<Item = Place>) -> FlowSpec {
        self.sources = sources.into_iter().collect();
        self
    }
    pub fn targets(mut self, targets: impl IntoIterator<Item = Place>) -> FlowSpec {
        self.targets = targets.into_iter().collect();
        self
    }
    pub fn mode(mut self, mode: Mode) -> FlowSpec {
        self.mode = mode;
        self
    }
    /// Routes a shuffle flow with `f` (an index into the target list).
    pub fn route(mut self, f: impl Fn(&[u64]) -> usize + Send + Sync + 'static) -> FlowSpec {
        self.kind = FlowKind::Shuffle(Routing::Function(Arc::new(f)));
        self
    }

    /// What every node must agree on.
    pub(crate) fn digest(&self) -> String {
        let kind = match &self.kind {
            FlowKind::Shuffle(r) => format!("shuffle by {r:?}"),
            FlowKind::Replicate => "replicate".into(),
            FlowKind::Combiner(aggs) => format!(
                "combiner of {}",
                aggs.iter()
                    .map(|a| a.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        };
        format!(
            "{kind}, {:?} mode, schema {}, sources {:?}, targets {:?}",
            self.mode, self.schema, self.sources, self.targets
        )
    }
}

/// Flow-level settings, the same on every node.
#[derive(Clone, Debug)]
pub struct FlowConfig {
    /// DATA messages a source may have outstanding (sent, not consumed) per target
    /// in bandwidth mode.
    pub window: usize,
    /// The same in latency mode, where messages hold one push each.
    pub latency_window: usize,
    /// Keys a combiner source holds before it flushes its table.
    pub combiner_entries: usize,
    /// How long a source waits for credit, or a target for data, without progress
    /// before it reports an error.
    pub timeout: Duration,
}

impl Default for FlowConfig {
    fn default() -> FlowConfig {
        FlowConfig {
            window: 4,
            latency_window: 64,
            combiner_entries: 4096,
            timeout: Duration::from_secs(20),
        }
    }
}

/// What can go wrong with a flow.
#[derive(Debug, Error)]
pub enum FlowError {
    #[error(transparent)]
    Shuffle(#[from] ShuffleError),
    #[error("schema: {0}")]
    Schema(String),
    /// A declaration that does not make sense.
    #[error("flow {flow:?}: {why}")]
    Declaration { flow: String, why: String },
    /// Nodes declared a flow differently (or declared flows in different orders).
    #[error("flow {flow:?} declared differently: this node has {ours}, rank {rank} has {theirs}")]
    Mismatch {
        flow: String,
        rank: usize,
        ours: String,
        theirs: String,
    },
    #[error("flow {flow:?}: (node {node}, thread {thread}) is not a {role} of the flow")]
    NotDeclared {
        flow: String,
        role: &'static str,
        node: usize,
        thread: usize,
    },
    #[error("flow {flow:?}: the {role} (node {node}, thread {thread}) was already taken")]
    Taken {
        flow: String,
        role: &'static str,
        node: usize,
        thread: usize,
    },
    #[error("flow {flow:?}: a tuple of {got} words, the schema has {expected}")]
    TupleWidth {
        flow: String,
        expected: usize,
        got: usize,
    },
    #[error("flow {flow:?}: target {target} does not exist, the flow has {targets} targets")]
    UnknownTarget {
        flow: String,
        target: usize,
        targets: usize,
    },
    #[error("flow {flow:?}: source (node {node}, thread {thread}) is closed")]
    Closed {
        flow: String,
        node: usize,
        thread: usize,
    },
    #[error("flow {flow:?}: {what}")]
    WrongKind { flow: String, what: String },
    #[error("flow {flow:?}: no progress for {waited:?} waiting for {what}")]
    Timeout {
        flow: String,
        waited: Duration,
        what: String,
    },
    /// The flow layer of this node failed (an endpoint error, a malformed message);
    /// every flow reports it.
    #[error("flows failed: {0}")]
    Failed(String),
}

pub type FlowResult<T> = std::result::Result<T, FlowError>;
