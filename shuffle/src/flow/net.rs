//! The flow layer of one node: the shared endpoints, the declared flows, and the
//! threads that demultiplex received messages into them.

use super::combine::Resolved;
use super::source::Source;
use super::target::{Batch, Target};
use super::{FlowConfig, FlowError, FlowKind, FlowResult, FlowSpec, Mode, Place};
use crate::buffer::State;
use crate::endpoint::{Opened, RecvEndpoint, SendEndpoint};
use crate::error::ShuffleError;
use crate::node::Node;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

const MAGIC: u64 = 0xF10E;
pub(crate) const DATA: u8 = 1;
pub(crate) const CLOSE: u8 = 2;
pub(crate) const ACK: u8 = 3;
/// A DATA message for every target of the flow on the receiving node.
pub(crate) const ALL_TARGETS: u32 = u32::MAX;
/// Words of a DATA message before its tuples.
pub(crate) const DATA_HEADER_WORDS: usize = 2;

pub(crate) fn tag(kind: u8, flow: u32) -> u64 {
    MAGIC << 48 | (kind as u64) << 40 | flow as u64
}

fn untag(word: u64) -> Option<(u8, u32)> {
    (word >> 48 == MAGIC).then_some(((word >> 40) as u8, word as u32))
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// What the demultiplexers and the flows of one node share.
pub(crate) struct Net {
    pub(crate) node: Arc<Node>,
    pub(crate) senders: Vec<Arc<dyn SendEndpoint>>,
    /// Payload words of one endpoint buffer.
    pub(crate) payload_words: usize,
    pub(crate) config: FlowConfig,
    flows: RwLock<Vec<Arc<FlowShared>>>,
    failure: Mutex<Option<String>>,
    stop: AtomicBool,
    /// When this node ended its streams.
    shutdown_at: Mutex<Option<Instant>>,
}

impl Net {
    pub(crate) fn sender(&self, thread: usize) -> &Arc<dyn SendEndpoint> {
        &self.senders[thread % self.senders.len()]
    }

    pub(crate) fn failure(&self) -> Option<FlowError> {
        lock(&self.failure).clone().map(FlowError::Failed)
    }

    /// Records the first fatal error and wakes every waiter.
    fn fail(&self, why: String) {
        tracing::error!(rank = self.node.rank(), "flows failed: {why}");
        lock(&self.failure).get_or_insert(why);
        for f in self.flows.read().unwrap_or_else(|e| e.into_inner()).iter() {
            let _guard = lock(&f.state);
            f.changed.notify_all();
        }
    }

    /// Sends `words` as one message to `dests` from the endpoint of `thread`.
    pub(crate) fn send(&self, thread: usize, dests: &[usize], words: &[u64]) -> FlowResult<()> {
        let ep = self.sender(thread);
        let mut buf = ep.acquire()?;
        if !buf.push_tuple(words) {
            return Err(FlowError::Failed(format!(
                "a message of {} words does not fit a buffer of {}",
                words.len(),
                buf.capacity_words()
            )));
        }
        ep.put_data(buf, dests, State::MoreData)?;
        Ok(())
    }

    /// Files one received payload.
    fn dispatch(&self, words: Arc<[u64]>) -> Result<(), String> {
        let Some((kind, id)) = words.first().and_then(|&w| untag(w)) else {
            return Err(format!(
                "a message without a flow tag ({} words)",
                words.len()
            ));
        };
        let flow = self
            .flows
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(id as usize)
            .cloned()
            .ok_or_else(|| format!("a message for undeclared flow {id}"))?;
        flow.dispatch(kind, &words)
            .map_err(|why| format!("flow {:?}: {why}", flow.spec.name))
    }

    fn demux(&self, rx: &dyn RecvEndpoint) {
        loop {
            if self.stop.load(Ordering::Relaxed) {
                return;
            }
            let result = match rx.get_data() {
                Ok(Some(data)) => {
                    // The one copy out of the endpoint buffer.
                    let words: Arc<[u64]> = data
                        .payload()
                        .iter()
                        .map(|w| w.load(std::sync::atomic::Ordering::Relaxed))
                        .collect();
                    match rx.release(data) {
                        Ok(()) if words.is_empty() => Ok(()),
                        Ok(()) => self.dispatch(words),
                        Err(e) => Err(format!("releasing a buffer: {e}")),
                    }
                }
                Ok(None) => return,
                // Idle: flows may be quiet for longer than the endpoint timeout. A
                // stuck flow is reported by the flow's own timeout, a peer that does
                // not shut down by the shutdown's.
                Err(ShuffleError::Timeout { counts: None, .. }) => match *lock(&self.shutdown_at) {
                    Some(at) if at.elapsed() > self.config.timeout => Err(format!(
                        "shutting down: peers did not end their streams within {:?}",
                        self.config.timeout
                    )),
                    _ => Ok(()),
                },
                Err(e) => Err(format!("receiving: {e}")),
            };
            if let Err(why) = result {
                self.fail(why);
                return;
            }
        }
    }
}

/// One node's view of a declared flow.
pub(crate) struct FlowShared {
    pub(crate) id: u32,
    /// This node's rank.
    pub(crate) rank: usize,
    pub(crate) spec: FlowSpec,
    /// Words per tuple on the wire (for a combiner: key words and one per aggregate).
    pub(crate) wire_width: usize,
    pub(crate) aggs: Vec<Resolved>,
    pub(crate) window: u64,
    /// Ranks hosting at least one target, ascending.
    pub(crate) target_nodes: Vec<usize>,
    pub(crate) state: Mutex<FlowState>,
    pub(crate) changed: Condvar,
}

pub(crate) struct FlowState {
    /// By target index; only this node's targets are used.
    pub(crate) queues: Vec<VecDeque<Batch>>,
    /// `[target][source]`: DATA messages filed for this node's targets.
    received: Vec<Vec<u64>>,
    /// `[source]`: the per-target counts of its CLOSE, once that arrived.
    announced: Vec<Option<Vec<u64>>>,
    /// `[source][target]`: messages the target reported consumed (this node's sources).
    pub(crate) acked: Vec<Vec<u64>>,
    sources_taken: Vec<bool>,
    targets_taken: Vec<bool>,
}

impl FlowState {
    /// Whether target `t` has seen all there is.
    pub(crate) fn ended(&self, t: usize) -> bool {
        self.queues[t].is_empty()
            && self
                .announced
                .iter()
                .enumerate()
                .all(|(s, a)| a.as_ref().is_some_and(|a| a[t] == self.received[t][s]))
    }

    /// Sources that have not closed yet, for error messages.
    pub(crate) fn open_sources(&self, spec: &FlowSpec) -> Vec<Place> {
        self.announced
            .iter()
            .enumerate()
            .filter(|(_, a)| a.is_none())
            .map(|(s, _)| spec.sources[s])
            .collect()
    }
}

impl FlowShared {
    pub(crate) fn name(&self) -> &str {
        &self.spec.name
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, FlowState> {
        lock(&self.state)
    }

    /// Files `message` (tag word first) of kind `kind`.
    fn dispatch(&self, kind: u8, message: &Arc<[u64]>) -> Result<(), String> {
        let body = &message[1..];
        let sources = self.spec.sources.len();
        let targets = self.spec.targets.len();
        let (lo, hi) = match body.first() {
            Some(&w) => (w as u32 as usize, (w >> 32) as u32),
            None => return Err(format!("an empty message of kind {kind}")),
        };
        let rank = |t: usize| self.spec.targets[t].0;
        match kind {
            DATA => {
                let source = lo;
                let tuples = &body[1..];
                if source >= sources || !tuples.len().is_multiple_of(self.wire_width) {
                    return Err(format!(
                        "DATA from source {source} with {} words",
                        tuples.len()
                    ));
                }
                let batch = Batch::new(source, self.wire_width, message.clone());
                let me = self.node_rank();
                let mut st = self.lock();
                if hi == ALL_TARGETS {
                    for t in (0..targets).filter(|&t| rank(t) == me) {
                        st.queues[t].push_back(batch.clone());
                        st.received[t][source] += 1;
                    }
                } else {
                    let t = hi as usize;
                    if t >= targets || rank(t) != me {
                        return Err(format!("DATA for target {t}, not on this node"));
                    }
                    st.queues[t].push_back(batch);
                    st.received[t][source] += 1;
                }
                self.changed.notify_all();
            }
            CLOSE => {
                let counts = &body[1..];
                if lo >= sources || counts.len() != targets {
                    return Err(format!(
                        "CLOSE from source {lo} with {} counts",
                        counts.len()
                    ));
                }
                let mut st = self.lock();
                if st.announced[lo].is_some() {
                    return Err(format!("a second CLOSE from source {lo}"));
                }
                st.announced[lo] = Some(counts.to_vec());
                self.changed.notify_all();
            }
            ACK => {
                let (source, target) = (lo, hi as usize);
                if source >= sources || target >= targets || body.len() != 2 {
                    return Err(format!("ACK from target {target} to source {source}"));
                }
                let mut st = self.lock();
                let a = &mut st.acked[source][target];
                *a = (*a).max(body[1]);
                self.changed.notify_all();
            }
            k => return Err(format!("unknown message kind {k}")),
        }
        Ok(())
    }

    fn node_rank(&self) -> usize {
        self.rank
    }
}

/// One node's flow layer: the endpoints it multiplexes and the flows declared on it.
pub struct FlowNet {
    net: Arc<Net>,
    demuxers: Vec<JoinHandle<()>>,
    declaring: Mutex<()>,
}

impl FlowNet {
    /// Takes over `opened` (this node's endpoints) and starts demultiplexing them.
    pub fn new(node: Arc<Node>, opened: Opened, config: FlowConfig) -> FlowResult<FlowNet> {
        if config.window == 0 || config.latency_window == 0 {
            return Err(FlowError::Declaration {
                flow: String::new(),
                why: "credit windows must be at least 1".into(),
            });
        }
        // The payload room of a buffer: acquire one and give it straight back.
        let probe = opened.senders[0].acquire()?;
        let payload_words = probe.capacity_words();
        opened.senders[0].put_data(probe, &[], State::MoreData)?;
        let net = Arc::new(Net {
            node,
            senders: opened.senders,
            payload_words,
            config,
            flows: RwLock::new(Vec::new()),
            failure: Mutex::new(None),
            stop: AtomicBool::new(false),
            shutdown_at: Mutex::new(None),
        });
        let demuxers = opened
            .receivers
            .into_iter()
            .enumerate()
            .map(|(lane, rx)| {
                let net = net.clone();
                std::thread::Builder::new()
                    .name(format!("flow-demux-{}-{lane}", net.node.rank()))
                    .spawn(move || net.demux(&*rx))
                    .expect("spawn a demultiplexer")
            })
            .collect();
        Ok(FlowNet {
            net,
            demuxers,
            declaring: Mutex::new(()),
        })
    }

    /// Payload words of one endpoint buffer: the most a DATA message carries, two
    /// words of flow header included.
    pub fn payload_words(&self) -> usize {
        self.net.payload_words
    }

    pub fn rank(&self) -> usize {
        self.net.node.rank()
    }

    /// Declares a flow. Collective: every node declares the same flows in the same
    /// order, and each declaration returns once all nodes made it (they are checked to
    /// agree).
    pub fn declare(&self, spec: FlowSpec) -> FlowResult<Flow> {
        let _one_at_a_time = lock(&self.declaring);
        let flow = spec.name.clone();
        let bad = |why: String| FlowError::Declaration {
            flow: flow.clone(),
            why,
        };
        let nodes = self.net.node.nodes();
        for (role, places) in [("source", &spec.sources), ("target", &spec.targets)] {
            if places.is_empty() {
                return Err(bad(format!("no {role}s")));
            }
            if places.len() >= u32::MAX as usize {
                return Err(bad(format!("too many {role}s")));
            }
            for (i, p) in places.iter().enumerate() {
                if p.0 >= nodes {
                    return Err(bad(format!("{role} {p:?} on node {} of {nodes}", p.0)));
                }
                if places[..i].contains(p) {
                    return Err(bad(format!("{role} {p:?} declared twice")));
                }
            }
        }
        let (wire_width, aggs) = match &spec.kind {
            FlowKind::Combiner(aggs) => {
                let r = Resolved::resolve(&spec.schema, aggs).map_err(&bad)?;
                let key_words = spec.schema.columns()[spec.schema.key()].ty.words();
                (key_words + r.len(), r)
            }
            _ => (spec.schema.width(), Vec::new()),
        };
        let room = self.net.payload_words;
        if DATA_HEADER_WORDS + wire_width > room {
            return Err(bad(format!(
                "a tuple of {wire_width} words does not fit a buffer of {room} payload words"
            )));
        }
        if 2 + spec.targets.len() > room {
            return Err(bad(format!(
                "{} targets: their counts do not fit a buffer of {room} words",
                spec.targets.len()
            )));
        }
        let window = match spec.mode {
            Mode::Bandwidth => self.net.config.window,
            Mode::Latency => self.net.config.latency_window,
        } as u64;
        let mut target_nodes: Vec<usize> = spec.targets.iter().map(|p| p.0).collect();
        target_nodes.sort_unstable();
        target_nodes.dedup();
        let (s, t) = (spec.sources.len(), spec.targets.len());
        let digest = spec.digest();
        let mut flows = self.net.flows.write().unwrap_or_else(|e| e.into_inner());
        if flows.iter().any(|f| f.spec.name == spec.name) {
            return Err(bad("a flow of this name is already declared".into()));
        }
        let id = flows.len() as u32;
        let shared = Arc::new(FlowShared {
            id,
            rank: self.net.node.rank(),
            wire_width,
            aggs,
            window,
            target_nodes,
            state: Mutex::new(FlowState {
                queues: (0..t).map(|_| VecDeque::new()).collect(),
                received: vec![vec![0; s]; t],
                announced: vec![None; s],
                acked: vec![vec![0; t]; s],
                sources_taken: vec![false; s],
                targets_taken: vec![false; t],
            }),
            changed: Condvar::new(),
            spec,
        });
        // Registered before the exchange: a peer sends only after it, so nothing can
        // arrive for a flow not yet registered here.
        flows.push(shared.clone());
        drop(flows);
        let all = self
            .net
            .node
            .all_gather(&format!("flow {flow}"), &digest)
            .inspect_err(|_| self.undeclare(id))?;
        if let Some((rank, theirs)) = all.into_iter().enumerate().find(|(_, d)| *d != digest) {
            self.undeclare(id);
            return Err(FlowError::Mismatch {
                flow,
                rank,
                ours: digest,
                theirs,
            });
        }
        Ok(Flow {
            net: self.net.clone(),
            shared,
        })
    }

    fn undeclare(&self, id: u32) {
        let mut flows = self.net.flows.write().unwrap_or_else(|e| e.into_inner());
        if flows.len() == id as usize + 1 {
            flows.pop();
        }
    }

    /// Ends this node's endpoint streams and waits until every node did the same.
    /// Call it once this node's sources are closed and its targets consumed.
    pub fn shutdown(mut self) -> FlowResult<()> {
        *lock(&self.net.shutdown_at) = Some(Instant::now());
        let mut first = None;
        for ep in &self.net.senders {
            let r = ep
                .acquire()
                .and_then(|b| ep.put_data(b, &[], State::Depleted));
            if let Err(e) = r {
                first.get_or_insert(FlowError::from(e));
            }
        }
        for h in self.demuxers.drain(..) {
            if h.join().is_err() {
                first.get_or_insert(FlowError::Failed("a demultiplexer panicked".into()));
            }
        }
        match (first, self.net.failure()) {
            (_, Some(f)) => Err(f),
            (Some(e), None) => Err(e),
            (None, None) => Ok(()),
        }
    }
}

impl Drop for FlowNet {
    fn drop(&mut self) {
        // Not shut down: the demultiplexers stop at their next timeout.
        self.net.stop.store(true, Ordering::Relaxed);
    }
}

/// A declared flow on one node: where its sources and targets are taken.
#[derive(Clone)]
pub struct Flow {
    net: Arc<Net>,
    shared: Arc<FlowShared>,
}

impl Flow {
    pub fn name(&self) -> &str {
        &self.shared.spec.name
    }
    /// The flow id that tags its messages.
    pub fn id(&self) -> u32 {
        self.shared.id
    }
    pub fn spec(&self) -> &FlowSpec {
        &self.shared.spec
    }

    fn take(&self, role: &'static str, thread: usize) -> FlowResult<usize> {
        let me = (self.net.node.rank(), thread);
        let places = match role {
            "source" => &self.shared.spec.sources,
            _ => &self.shared.spec.targets,
        };
        let err = |e: fn(String, &'static str, usize, usize) -> FlowError| {
            e(self.name().to_string(), role, me.0, me.1)
        };
        let index = places.iter().position(|&p| p == me).ok_or_else(|| {
            err(|flow, role, node, thread| FlowError::NotDeclared {
                flow,
                role,
                node,
                thread,
            })
        })?;
        let mut st = self.shared.lock();
        let taken = match role {
            "source" => &mut st.sources_taken[index],
            _ => &mut st.targets_taken[index],
        };
        if std::mem::replace(taken, true) {
            return Err(err(|flow, role, node, thread| FlowError::Taken {
                flow,
                role,
                node,
                thread,
            }));
        }
        Ok(index)
    }

    /// The source of thread `thread` of this node. Each is taken once.
    pub fn source(&self, thread: usize) -> FlowResult<Source> {
        let index = self.take("source", thread)?;
        Ok(Source::new(
            self.net.clone(),
            self.shared.clone(),
            index,
            thread,
        ))
    }

    /// The target of thread `thread` of this node. Each is taken once.
    pub fn target(&self, thread: usize) -> FlowResult<Target> {
        let index = self.take("target", thread)?;
        Ok(Target::new(
            self.net.clone(),
            self.shared.clone(),
            index,
            thread,
        ))
    }
}

/// Waits on a flow's condition variable until `ready` gives a value, the flow layer
/// fails, or `timeout` passes without `ready` making progress.
pub(crate) fn wait_for<T>(
    net: &Net,
    flow: &FlowShared,
    what: impl Fn(&FlowState) -> String,
    mut ready: impl FnMut(&mut FlowState) -> Option<T>,
) -> FlowResult<T> {
    let timeout = net.config.timeout;
    let start = Instant::now();
    let mut st = flow.lock();
    loop {
        if let Some(v) = ready(&mut st) {
            return Ok(v);
        }
        if let Some(f) = net.failure() {
            return Err(f);
        }
        let waited = start.elapsed();
        if waited >= timeout {
            return Err(FlowError::Timeout {
                flow: flow.name().to_string(),
                waited,
                what: what(&st),
            });
        }
        let slice = (timeout - waited).min(Duration::from_millis(200));
        st = flow
            .changed
            .wait_timeout(st, slice)
            .unwrap_or_else(|e| e.into_inner())
            .0;
    }
}

impl std::fmt::Debug for Flow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Flow({:?} #{}: {})",
            self.shared.spec.name,
            self.shared.id,
            self.shared.spec.digest()
        )
    }
}
