//! The communication endpoint API of §4.2 and the eight designs of §5.
//!
//! A SEND endpoint hands out registered buffers ([`SendEndpoint::acquire`]) and
//! transmits filled ones to a set of destination nodes ([`SendEndpoint::put_data`]); a
//! RECEIVE endpoint returns received buffers ([`RecvEndpoint::get_data`]) and takes
//! them back once consumed ([`RecvEndpoint::release`]). Every function is thread-safe:
//! in the single-endpoint (SE) configurations all of a node's threads share one pair.
//!
//! A design is the endpoint configuration (SE: one pair per node; ME: one per thread,
//! lane `t` of every node talking to lane `t` of every other) times the transport:
//!
//! | transport | verbs | service | queue pairs per endpoint |
//! |---|---|---|---|
//! | SQ/SR | SEND/RECV | UD | 1 |
//! | MQ/SR | SEND/RECV | RC | one per node |
//! | MQ/RD | READ (+ WRITE for the queues) | RC | one per node |
//! | MQ/WR | WRITE (+ notification) | RC | one per node |

use crate::buffer::{Received, SendBuf, State};
use crate::error::{Result, ShuffleError};
use crate::idle::Idle;
use crate::node::Node;
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::task::Poll;
use std::time::{Duration, Instant};

/// The SEND side of an endpoint.
pub trait SendEndpoint: Send + Sync {
    /// This endpoint's id, unique in the shuffle: `rank × lanes + lane`.
    fn id(&self) -> u32;
    /// An empty registered buffer. Blocks while every buffer is in flight (up to the
    /// configured timeout, then errors: a receiver that stopped consuming).
    fn acquire(&self) -> Result<SendBuf>;
    /// Transmits `buf` to the nodes `dests` (ranks) and gives it up. With
    /// [`State::Depleted`] this endpoint sends nothing more, and every receiver it is
    /// connected to learns that its stream from here has ended once all of it arrived.
    /// `dests` may be empty: with [`State::MoreData`] the buffer simply goes back to
    /// the endpoint; with [`State::Depleted`] only the end of stream is sent. A
    /// design may block in a `Depleted` call until what it sent has left (the SEND
    /// designs wait for their completions), so tearing the endpoint down right after
    /// it loses nothing.
    fn put_data(&self, buf: SendBuf, dests: &[usize], state: State) -> Result<()>;
}

/// The RECEIVE side of an endpoint.
pub trait RecvEndpoint: Send + Sync {
    fn id(&self) -> u32;
    /// The next received buffer; `None` once every source endpoint has ended its
    /// stream and all of its data was returned. Blocks while nothing has arrived, up to
    /// the configured timeout, then errors (a dead peer, a lost datagram).
    fn get_data(&self) -> Result<Option<Received>>;
    /// [`RecvEndpoint::get_data`] without waiting: `Pending` when nothing has arrived
    /// yet. It still does the endpoint's housekeeping (polling, credit, posting
    /// receives and reads), so a thread that calls it now and then keeps its peers
    /// going. It never times out: a caller that keeps getting `Pending` decides when
    /// to give up, or calls `get_data`.
    fn try_get_data(&self) -> Result<Poll<Option<Received>>>;
    /// Gives a consumed buffer back (to be received into again).
    fn release(&self, data: Received) -> Result<()>;
}

/// One endpoint per node (SE) or per thread (ME).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Endpoints {
    Single,
    Multi,
}

/// How a WR receiver learns that a buffer arrived (§5.5).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Notify {
    /// Poll the buffer: the sender writes a seal word after the payload (pollbuff).
    Seal,
    /// Poll a message queue the sender writes after the data (pollmq).
    MessageQueue,
    /// WRITE_WITH_IMM, the receiver polls its completion queue (pollcq). The paper's
    /// fastest, and our default.
    #[default]
    CompletionQueue,
}

impl FromStr for Notify {
    type Err = ShuffleError;
    fn from_str(s: &str) -> Result<Notify> {
        match s.to_ascii_lowercase().as_str() {
            "seal" | "pollbuff" | "buffer" => Ok(Notify::Seal),
            "mq" | "pollmq" | "queue" => Ok(Notify::MessageQueue),
            "cq" | "pollcq" | "imm" => Ok(Notify::CompletionQueue),
            _ => Err(ShuffleError::Invalid(format!(
                "unknown notification {s:?}: expected seal, mq or cq"
            ))),
        }
    }
}

impl fmt::Display for Notify {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Notify::Seal => "seal",
            Notify::MessageQueue => "mq",
            Notify::CompletionQueue => "cq",
        })
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Transport {
    /// SEND/RECV over one UD queue pair.
    SqSr,
    /// SEND/RECV over RC, a queue pair per node.
    MqSr,
    /// RC, the receiver READs from the sender's buffers.
    MqRd,
    /// RC, the sender WRITEs into the receiver's buffers.
    MqWr,
}

/// One of the eight designs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Design {
    pub endpoints: Endpoints,
    pub transport: Transport,
}

impl Design {
    pub const ALL: [Design; 8] = [
        Design::new(Endpoints::Single, Transport::SqSr),
        Design::new(Endpoints::Multi, Transport::SqSr),
        Design::new(Endpoints::Single, Transport::MqSr),
        Design::new(Endpoints::Multi, Transport::MqSr),
        Design::new(Endpoints::Single, Transport::MqRd),
        Design::new(Endpoints::Multi, Transport::MqRd),
        Design::new(Endpoints::Single, Transport::MqWr),
        Design::new(Endpoints::Multi, Transport::MqWr),
    ];

    pub const fn new(endpoints: Endpoints, transport: Transport) -> Design {
        Design {
            endpoints,
            transport,
        }
    }

    /// Endpoint pairs per node with `threads` threads.
    pub fn lanes(&self, threads: usize) -> usize {
        match self.endpoints {
            Endpoints::Single => 1,
            Endpoints::Multi => threads.max(1),
        }
    }
}

impl fmt::Display for Design {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let e = match self.endpoints {
            Endpoints::Single => "SE",
            Endpoints::Multi => "ME",
        };
        let t = match self.transport {
            Transport::SqSr => "SQ/SR",
            Transport::MqSr => "MQ/SR",
            Transport::MqRd => "MQ/RD",
            Transport::MqWr => "MQ/WR",
        };
        write!(f, "{e}{t}")
    }
}

impl FromStr for Design {
    type Err = ShuffleError;
    fn from_str(s: &str) -> Result<Design> {
        let norm = s.to_ascii_uppercase().replace(['-', '_'], "/");
        Design::ALL
            .into_iter()
            .find(|d| d.to_string() == norm || d.to_string().replace('/', "") == norm)
            .ok_or_else(|| {
                ShuffleError::Invalid(format!(
                    "unknown design {s:?}: expected one of {}",
                    Design::ALL.map(|d| d.to_string()).join(", ")
                ))
            })
    }
}

/// How endpoints are opened.
#[derive(Clone, Debug)]
pub struct EndpointConfig {
    /// Threads per node that use the endpoints: the number of lanes under ME.
    pub threads: usize,
    /// Buffer (message) size for the RC transports, header included. UD messages are
    /// always the MTU.
    pub message_bytes: u32,
    pub buffering: crate::pool::Buffering,
    /// SEND/RECV receivers write back their absolute credit after this many releases.
    pub credit_every: u32,
    /// WR only.
    pub notify: Notify,
    /// How long a blocked call waits without progress before it reports an error.
    pub timeout: Duration,
}

impl Default for EndpointConfig {
    fn default() -> EndpointConfig {
        EndpointConfig {
            threads: 1,
            message_bytes: 64 << 10,
            buffering: crate::pool::Buffering::default(),
            credit_every: 2,
            notify: Notify::default(),
            timeout: Duration::from_secs(10),
        }
    }
}

/// A node's endpoints for one shuffle: one pair (SE) or one per thread (ME).
pub struct Opened {
    pub design: Design,
    /// The rank of the node these endpoints belong to.
    pub rank: usize,
    pub senders: Vec<Arc<dyn SendEndpoint>>,
    pub receivers: Vec<Arc<dyn RecvEndpoint>>,
}

impl Opened {
    /// The pair thread `tid` uses.
    pub fn for_thread(&self, tid: usize) -> (&Arc<dyn SendEndpoint>, &Arc<dyn RecvEndpoint>) {
        let lane = tid % self.senders.len();
        (&self.senders[lane], &self.receivers[lane])
    }
}

/// Opens the endpoints of `design` on this node. Collective: every node calls it with
/// the same design and configuration, and it returns once all are wired.
pub fn open(node: &Node, design: Design, config: &EndpointConfig) -> Result<Opened> {
    if config.threads == 0 {
        return Err(ShuffleError::Invalid("threads must be at least 1".into()));
    }
    let lanes = design.lanes(config.threads);
    let mut senders = Vec::with_capacity(lanes);
    let mut receivers = Vec::with_capacity(lanes);
    for lane in 0..lanes {
        let lane = Lane {
            lane,
            lanes,
            sharers: if lanes == 1 { config.threads } else { 1 },
        };
        let (s, r) = open_lane(node, design.transport, config, lane)?;
        senders.push(s);
        receivers.push(r);
    }
    Ok(Opened {
        design,
        rank: node.rank(),
        senders,
        receivers,
    })
}

/// Which lane of a design is being opened.
#[derive(Clone, Copy, Debug)]
pub struct Lane {
    pub lane: usize,
    pub lanes: usize,
    /// Threads sharing this lane's endpoints.
    pub sharers: usize,
}

impl Lane {
    /// The id of this lane's endpoint on node `rank`.
    pub fn endpoint_id(&self, rank: usize) -> u32 {
        (rank * self.lanes + self.lane) as u32
    }
}

pub(crate) type Pair = (Arc<dyn SendEndpoint>, Arc<dyn RecvEndpoint>);

fn open_lane(
    node: &Node,
    transport: Transport,
    config: &EndpointConfig,
    lane: Lane,
) -> Result<Pair> {
    match transport {
        Transport::SqSr => crate::ud::open(node, config, lane),
        Transport::MqSr => crate::sr::open(node, config, lane),
        Transport::MqRd => crate::rd::open(node, config, lane),
        Transport::MqWr => crate::wr::open(node, config, lane),
    }
}

/// Checks `put_data`'s destinations against the number of nodes.
pub(crate) fn check_destinations(dests: &[usize], nodes: usize) -> Result<()> {
    match dests.iter().find(|&&d| d >= nodes) {
        Some(&bad) => Err(ShuffleError::Invalid(format!(
            "destination rank {bad} of {nodes} nodes"
        ))),
        None => Ok(()),
    }
}

/// Retries `attempt` until it yields a value, backing off in between, and fails with a
/// timeout naming `what` after `timeout` without one. `attempt` runs without any lock
/// held across the wait.
pub(crate) fn retry_until<T>(
    timeout: Duration,
    what: impl Fn() -> String,
    mut attempt: impl FnMut() -> Result<Option<T>>,
) -> Result<T> {
    let mut backoff = Backoff::new(timeout);
    loop {
        if let Some(v) = attempt()? {
            return Ok(v);
        }
        if !backoff.wait() {
            return Err(ShuffleError::Timeout {
                what: what(),
                waited: backoff.waited(),
                counts: None,
            });
        }
    }
}

/// Blocks on `attempt` (one non-blocking try of GETDATA) until it yields data or the end,
/// backing off in between; after `timeout` without progress it fails with
/// `timed_out`'s error (given how long it waited). An attempt that sets its flag made
/// progress short of data (credit, an end of stream): the timeout counts from there.
pub(crate) fn wait_for_data(
    timeout: Duration,
    mut attempt: impl FnMut(&mut bool) -> Result<Poll<Option<Received>>>,
    timed_out: impl FnOnce(Duration) -> ShuffleError,
) -> Result<Option<Received>> {
    let mut backoff = Backoff::new(timeout);
    loop {
        let mut progressed = false;
        if let Poll::Ready(r) = attempt(&mut progressed)? {
            return Ok(r);
        }
        if progressed {
            backoff.reset();
        } else if !backoff.wait() {
            return Err(timed_out(backoff.waited()));
        }
    }
}

/// A GETDATA that waited `waited` for data, with `ended` of its `sources` ended.
pub(crate) fn no_data(ended: usize, sources: usize, waited: Duration) -> ShuffleError {
    ShuffleError::Timeout {
        what: format!("data ({ended} of {sources} source endpoints ended)"),
        waited,
        counts: None,
    }
}

/// [`RecvEndpoint::try_get_data`] from the attempt [`wait_for_data`] takes: attempts
/// again while they make progress short of data, then says `Pending`.
pub(crate) fn attempt_while_progressing(
    mut attempt: impl FnMut(&mut bool) -> Result<Poll<Option<Received>>>,
) -> Result<Poll<Option<Received>>> {
    loop {
        let mut progressed = false;
        let polled = attempt(&mut progressed)?;
        if polled.is_ready() || !progressed {
            return Ok(polled);
        }
    }
}

/// Failed attempts a waiter spins through before it yields. An attempt (a completion
/// queue poll and the design's rings) takes a few hundred nanoseconds, so this spins
/// for about what a yield costs, the classic bound for spinning before giving the core
/// away. With a core per thread a yield returns at once and costs a system call; with
/// more threads than cores, spinning longer takes the core from the thread that would
/// produce what the spinner waits for: 64 spins made 4 KiB messages on shm 1.4–1.6×
/// slower on a 2-core machine.
const SPINS_BEFORE_YIELD: u32 = 4;

/// Waiting without burning a core the other processes need: spin briefly, then yield,
/// then sleep a little, and give up at the deadline.
pub(crate) struct Backoff {
    spins: u32,
    started: Instant,
    timeout: Duration,
}

impl Backoff {
    pub(crate) fn new(timeout: Duration) -> Backoff {
        Backoff {
            spins: 0,
            started: Instant::now(),
            timeout,
        }
    }

    /// Progress was made: the timeout counts from now.
    pub(crate) fn reset(&mut self) {
        self.spins = 0;
        self.started = Instant::now();
    }

    /// Waits a little; `false` once the timeout has passed without progress. This
    /// thread's idle work ([`crate::idle`]) runs first: when it did something the
    /// caller looks again at once, and when it failed the caller gives up now.
    pub(crate) fn wait(&mut self) -> bool {
        match crate::idle::run_idle_work() {
            Idle::Progress => {
                self.spins = 0;
                return true;
            }
            Idle::Failed => return false,
            Idle::Nothing => {}
        }
        self.spins += 1;
        if self.spins < SPINS_BEFORE_YIELD {
            std::hint::spin_loop();
        } else if self.spins < 256 {
            std::thread::yield_now();
        } else {
            // The longer nothing arrives, the longer the nap (20 µs doubling to 640 µs):
            // a receiver idle through a long local phase must not keep waking up on
            // the core its own node's worker needs.
            let doublings = ((self.spins - 256) / 128).min(5);
            std::thread::sleep(Duration::from_micros(20 << doublings));
        }
        self.spins & 63 != 0 || self.started.elapsed() < self.timeout
    }

    pub(crate) fn waited(&self) -> Duration {
        self.started.elapsed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn designs_parse_and_print_by_their_paper_names() {
        for d in Design::ALL {
            assert_eq!(d.to_string().parse::<Design>().unwrap(), d);
        }
        assert_eq!(
            "memq-wr".parse::<Design>().unwrap(),
            Design::new(Endpoints::Multi, Transport::MqWr)
        );
        assert_eq!("SESQSR".parse::<Design>().unwrap(), Design::ALL[0]);
        let err = "MESQ/RD".parse::<Design>().unwrap_err().to_string();
        assert!(err.contains("SESQ/SR"), "{err}");
        assert_eq!("pollcq".parse::<Notify>().unwrap(), Notify::CompletionQueue);
        assert!("x".parse::<Notify>().is_err());
    }
}
