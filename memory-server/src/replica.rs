//! Replication: every memory server may have a backup, a second server with the same
//! region plan that holds what the primary's Persists covered. See DEVELOPERS.md
//! ("Replication").
//!
//! The primary side ([`Replicator`]) attaches to the backup before the primary serves
//! anyone, sends its whole region state, then ships the entries of every Persist, in
//! the order the copies were made, as numbered batches on one stream; a Persist is
//! acknowledged only once the backup has applied (and, if it keeps a data directory,
//! journaled) its batch. The backup side ([`Backup`]) applies the stream into its region
//! memory and refuses compute nodes until it is promoted; promotion fences the primary
//! (whose stream is refused from then on, so it cannot acknowledge anything more).

use crate::client::Client;
use crate::durable::{Durable, PersistError, journal};
use crate::proto::{self, memory_server_client::MemoryServerClient};
use crate::regions::ServedRegion;
use crate::session::{SESSION_METADATA, SessionId, Sessions};
use crate::token::ClusterToken;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tonic::metadata::AsciiMetadataValue;
use tonic::transport::Channel;
use tonic::{Request, Status};

/// How a server takes part in replication ([`crate::ServerConfig::replication`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Replication {
    /// Not replicated.
    #[default]
    Standalone,
    /// A primary: attaches to the backup at this control-plane address (`host:port`)
    /// at start, and acknowledges a Persist only once the backup has it.
    Primary { backup_at: String },
    /// A backup: applies a primary's stream and serves compute nodes once promoted.
    Backup,
}

/// What a server is in replication, as Hello reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Standalone,
    Primary,
    Backup,
    Promoted,
}

impl Role {
    pub(crate) fn to_proto(self) -> proto::Role {
        match self {
            Role::Standalone => proto::Role::Standalone,
            Role::Primary => proto::Role::Primary,
            Role::Backup => proto::Role::Backup,
            Role::Promoted => proto::Role::Promoted,
        }
    }

    pub(crate) fn from_proto(v: i32) -> Role {
        match proto::Role::try_from(v) {
            Ok(proto::Role::Primary) => Role::Primary,
            Ok(proto::Role::Backup) => Role::Backup,
            Ok(proto::Role::Promoted) => Role::Promoted,
            _ => Role::Standalone,
        }
    }
}

/// Entry bytes gathered into one ReplicaApply while the previous one is on the wire:
/// group commit for the stream. A single Persist larger than this goes whole, so that
/// a backup never holds half of one.
const SHIP_TARGET: usize = 4 << 20;
/// Region bytes per entry of the state transfer.
const TRANSFER_PIECE: u64 = 1 << 20;
/// How long the primary waits for the backup to apply one batch before it gives up on
/// it (and on every later Persist).
const APPLY_TIMEOUT: Duration = Duration::from_secs(30);
/// The most bytes one ReplicaApply may carry: a batch of small Persists plus one whole
/// Persist of up to 64 MiB with its entry headers.
pub(crate) const MAX_APPLY_BYTES: usize = 128 << 20;

struct Shipment {
    entries: Vec<u8>,
    count: u32,
    reply: oneshot::Sender<Result<(), Refusal>>,
}

/// Why a Persist was not acknowledged by the stream.
#[derive(Clone, Debug)]
pub(crate) struct Refusal {
    pub why: String,
    /// Only until this primary has attached to its backup again (which copies its
    /// whole state there): the same Persist, made again then, is acknowledged. Not so
    /// for a fenced primary, which never attaches again.
    pub for_now: bool,
}

/// A primary's stream to its backup.
pub(crate) struct Replicator {
    /// The backup's control-plane address.
    addr: String,
    tx: mpsc::UnboundedSender<Shipment>,
    /// Orders the copies of a primary without a data directory (a durable primary
    /// orders them under its journal's lock).
    pub order: Mutex<()>,
    task: JoinHandle<()>,
    attached: AttachedSession,
}

/// The backup session of the stream attached last, which [`Replicator::detach`] ends.
type AttachedSession = Arc<Mutex<Option<(MemoryServerClient<Channel>, AsciiMetadataValue)>>>;

impl Drop for Replicator {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn unavailable(addr: &str, what: impl std::fmt::Display) -> String {
    format!("backup at {addr} {what}")
}

/// Why the stream stopped.
#[derive(Debug, Clone)]
enum Failure {
    /// The backup refused this primary (it was promoted, another primary attached
    /// since, or it holds newer data): for good, since this primary is no longer the
    /// one whose state the backup should hold.
    Fenced(String),
    /// The backup did not answer, failed, or lost this primary's session (it
    /// restarted): a new attach may succeed.
    Lost(String),
    /// The backup serves another primary whose session is live; it lapses within the
    /// backup's session lease (given) if that primary has died, and then a new attach
    /// may succeed.
    Busy(String, Duration),
}

/// The metadata entry of a backup's refusal of a second live primary: its session
/// lease in milliseconds, how long a dead primary's session may outlive it.
pub(crate) const SESSION_LEASE_METADATA: &str = "namdb-session-lease-ms";

/// The metadata entry of a Persist refused only until the primary has attached to its
/// backup again ([`Refusal::for_now`]): the same Persist, made again, may succeed.
pub(crate) const PERSIST_LATER_METADATA: &str = "namdb-persist-later";

impl Failure {
    fn from_status(addr: &str, what: &str, s: &Status) -> Failure {
        let why = unavailable(
            addr,
            format_args!("{what}: {} ({:?})", crate::client::status_text(s), s.code()),
        );
        let lease = s
            .metadata()
            .get(SESSION_LEASE_METADATA)
            .and_then(|v| v.to_str().ok()?.parse().ok())
            .map(Duration::from_millis);
        match (s.code(), lease) {
            (tonic::Code::FailedPrecondition, _) => Failure::Fenced(why),
            (tonic::Code::Aborted, Some(lease)) => Failure::Busy(why, lease),
            _ => Failure::Lost(why),
        }
    }

    fn why(&self) -> &str {
        match self {
            Failure::Fenced(why) | Failure::Lost(why) | Failure::Busy(why, _) => why,
        }
    }

    /// What a Persist refused because of it gets.
    fn refusal(&self) -> Refusal {
        Refusal {
            why: self.persist_error(),
            for_now: !matches!(self, Failure::Fenced(_)),
        }
    }

    /// What a Persist refused because of it says.
    fn persist_error(&self) -> String {
        match self {
            Failure::Fenced(why) => format!(
                "{why}; this primary acknowledges no Persist any more (its backup serves, or \
                 holds newer data)"
            ),
            Failure::Lost(why) | Failure::Busy(why, _) => format!(
                "{why}; no Persist is acknowledged until the backup answers again (this \
                 primary attaches to it again by itself, every {RETRY_EVERY:?})"
            ),
        }
    }
}

/// How often a primary whose backup stopped answering tries to attach again.
const RETRY_EVERY: Duration = Duration::from_secs(1);
/// How long one such attempt may take to reach the backup (connect, authenticate).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long the backup reached may take to answer the attach: it reads its whole
/// memory first, for the pieces that hold data, which takes seconds per GiB in a debug
/// build on a loaded machine. One 5 s bound for both cut off every attempt of a chaos
/// run under load (its backup answered after 7 s), and each new attempt started the
/// backup's reading over: the primary never attached again.
const ATTACH_TIMEOUT: Duration = Duration::from_secs(120);
/// How long a primary shutting down waits for its backup to end the stream's session.
const DETACH_TIMEOUT: Duration = Duration::from_secs(2);
/// How long the backup may take to record a fence.
const FENCE_TIMEOUT: Duration = Duration::from_secs(5);
/// Persist entry bytes acknowledged and held for the backup while a new attach's
/// transfer runs; beyond it the attempt is given up (and made again later).
const MAX_BACKLOG: usize = 256 << 20;
/// How often an idle primary renews its session at its backup, so that the backup can
/// tell a primary that stopped (a stopped process, a cut-off host: its connections
/// stay open and answer nothing) from one with nothing to send
/// ([`crate::ServerInfo::primary_silence`]).
pub const PRIMARY_HEARTBEAT: Duration = Duration::from_millis(250);
/// How long one such renewal may take before the stream goes on without its answer.
const HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(1);

/// Where the backup is and what this primary tells it at attach.
struct Link {
    addr: String,
    token: ClusterToken,
    regions: Arc<Vec<ServedRegion>>,
    boot: u64,
    epoch: u64,
    /// This process's `primary_id`: random, the same for each of its attaches.
    id: Vec<u8>,
    attached: AttachedSession,
    /// This server's sessions, whose fenced incarnations every attach hands on.
    sessions: Arc<Sessions>,
    /// Waited before the state transfer of an attach again
    /// ([`crate::ServerConfig::resync_delay`], a testing hook).
    resync_delay: Duration,
    /// The data directory, whose recorded promotion is cleared once a backup holds
    /// this server's whole state.
    durable: Option<Arc<Durable>>,
}

/// An attached stream.
struct Stream {
    rpc: MemoryServerClient<Channel>,
    header: AsciiMetadataValue,
    /// The last batch's number.
    seq: u64,
    /// Holds the session (its renewals) for the stream's lifetime.
    _client: Client,
}

impl Stream {
    /// Sends one batch and waits until the backup applied (and journaled) it.
    async fn apply(
        &mut self,
        addr: &str,
        entries: Vec<u8>,
        count: u32,
        synced: bool,
    ) -> Result<(), Failure> {
        self.seq += 1;
        let req = with_session(
            proto::ReplicaApplyRequest {
                seq: self.seq,
                count,
                entries,
                synced,
            },
            &self.header,
        );
        match tokio::time::timeout(APPLY_TIMEOUT, self.rpc.replica_apply(req)).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(s)) => Err(Failure::from_status(
                addr,
                "failed the replication stream",
                &s,
            )),
            Err(_) => Err(Failure::Lost(unavailable(
                addr,
                format_args!("did not apply a batch within {APPLY_TIMEOUT:?}"),
            ))),
        }
    }

    /// Renews the stream's session at the backup: a sign of life while nothing is
    /// sent. A failure is left for the next batch to find.
    async fn heartbeat(&mut self) {
        let req = with_session(proto::KeepAliveRequest {}, &self.header);
        match tokio::time::timeout(HEARTBEAT_TIMEOUT, self.rpc.keep_alive(req)).await {
            Ok(Ok(_)) => {}
            Ok(Err(s)) => tracing::debug!("renewing the stream's session failed: {}", s.message()),
            Err(_) => tracing::debug!("the backup did not renew the stream's session in time"),
        }
    }
}

impl Link {
    /// Attaches this primary's stream: from then on the backup cannot be promoted until
    /// a batch says it holds the whole state. Answers which pieces of the backup's
    /// memory hold data.
    /// `bounded`: an attach again, which gives up on a backup that does not answer
    /// ([`CONNECT_TIMEOUT`], [`ATTACH_TIMEOUT`]) so that the next attempt can be made.
    async fn attach(&self, bounded: bool) -> Result<(Stream, BackupPieces), Failure> {
        let addr = &self.addr;
        let within = |limit: Duration| if bounded { limit } else { Duration::MAX };
        let timed_out = |what: &str, limit: Duration| {
            Failure::Lost(unavailable(
                addr,
                format_args!("did not {what} within {limit:?}"),
            ))
        };
        let client =
            tokio::time::timeout(within(CONNECT_TIMEOUT), Client::connect(addr, &self.token))
                .await
                .map_err(|_| timed_out("answer its connection", CONNECT_TIMEOUT))?
                .map_err(|e| {
                    Failure::Lost(unavailable(addr, format_args!("cannot be reached: {e}")))
                })?;
        let (mut rpc, header) = client.rpc_parts();
        let attach = proto::ReplicaAttachRequest {
            regions: self
                .regions
                .iter()
                .map(|r| proto::Region {
                    name: r.info.name.clone(),
                    len: r.info.remote.len,
                    ..Default::default()
                })
                .collect(),
            primary_boot: self.boot,
            primary_epoch: self.epoch,
            piece_bytes: TRANSFER_PIECE,
            primary_id: self.id.clone(),
        };
        let answer = tokio::time::timeout(
            within(ATTACH_TIMEOUT),
            rpc.replica_attach(with_session(attach, &header)),
        )
        .await
        .map_err(|_| timed_out("attach", ATTACH_TIMEOUT))?
        .map_err(|s| Failure::from_status(addr, "refused to attach", &s))?
        .into_inner();
        // A backup started again knows no fence: it hears of each before it can be
        // promoted with this attach's state.
        for incarnation in self.sessions.fenced_incarnations() {
            fence_at(&mut rpc, &header, incarnation)
                .await
                .map_err(|why| Failure::Lost(unavailable(addr, format_args!("{why}"))))?;
        }
        *self.attached.lock().unwrap_or_else(|p| p.into_inner()) =
            Some((rpc.clone(), header.clone()));
        let pieces = piece_count(&self.regions, TRANSFER_PIECE);
        let has_data = if answer.clean {
            BackupPieces::AllZero
        } else if answer.pieces_with_data.len() as u64 == pieces.div_ceil(8) {
            BackupPieces::Known(answer.pieces_with_data)
        } else {
            BackupPieces::Unknown
        };
        Ok((
            Stream {
                rpc,
                header,
                seq: 0,
                _client: client,
            },
            has_data,
        ))
    }

    /// Copies every region to the backup (region memory as it is now, which the
    /// Persists queued meanwhile then bring up to date; a piece zero on both sides is
    /// skipped), as batches of the stream. Answers the bytes sent.
    async fn transfer(&self, stream: &mut Stream, backup: &BackupPieces) -> Result<u64, Failure> {
        let addr = &self.addr;
        let mut buf = Vec::new();
        let mut count = 0;
        let mut sent = 0u64;
        let mut pieces = PieceReader::new(&self.regions, TRANSFER_PIECE);
        while let Some(piece) = pieces.next_piece().map_err(Failure::Lost)? {
            if !(backup.is_zero(piece.index) && piece.zero) {
                journal::push_entry_header(
                    &mut buf,
                    piece.region,
                    piece.offset,
                    piece.bytes.len() as u32,
                );
                buf.extend_from_slice(piece.bytes);
                count += 1;
                sent += piece.bytes.len() as u64;
            }
            if buf.len() >= SHIP_TARGET {
                stream
                    .apply(addr, std::mem::take(&mut buf), count, false)
                    .await?;
                count = 0;
            }
        }
        if count > 0 {
            stream.apply(addr, buf, count, false).await?;
        }
        Ok(sent)
    }

    /// Attaches again to a backup that stopped answering and copies the whole state to
    /// it.
    async fn reattach(
        &self,
        rx: &mut mpsc::UnboundedReceiver<Shipment>,
    ) -> Result<Stream, Failure> {
        let (stream, backup) = self.attach(true).await?;
        tracing::warn!(
            backup = self.addr.as_str(),
            "backup attached again: copying the whole state to it; until it holds that, \
             Persists are acknowledged with this primary as their only copy"
        );
        self.catch_up(stream, &backup, rx).await
    }

    /// Copies the whole state to a backup just attached (`stream`) while this server
    /// serves. Persists queued meanwhile are acknowledged at once, since the attach made
    /// the backup unpromotable until it is synced (so nothing acknowledged can be lost
    /// by a promotion), and sent after the transfer.
    async fn catch_up(
        &self,
        mut stream: Stream,
        backup: &BackupPieces,
        rx: &mut mpsc::UnboundedReceiver<Shipment>,
    ) -> Result<Stream, Failure> {
        let mut backlog = Backlog::default();
        let transfer = async {
            tokio::time::sleep(self.resync_delay).await;
            self.transfer(&mut stream, backup).await
        };
        let sent = acking(rx, &mut backlog, transfer).await?;
        while let Some((entries, count)) = backlog.take_batch() {
            acking(
                rx,
                &mut backlog,
                stream.apply(&self.addr, entries, count, false),
            )
            .await?;
        }
        // Persists queued from here on wait for the backup again.
        stream.apply(&self.addr, Vec::new(), 0, true).await?;
        tracing::info!(
            backup = self.addr.as_str(),
            bytes = sent,
            "backup holds this primary's whole state again (or, attached to a promoted \
             server, for the first time): Persists are acknowledged once it has them"
        );
        self.forget_promotion().await;
        Ok(stream)
    }

    /// Clears a promotion the data directory records, now that the backup holds this
    /// server's whole state and every Persist from here on reaches it before it is
    /// acknowledged: the directory no longer holds the only copy of newer data. A
    /// failure leaves the line, which only makes a later `cluster up` swap back.
    async fn forget_promotion(&self) {
        let Some(d) = self.durable.clone().filter(|d| d.promotion().is_some()) else {
            return;
        };
        match tokio::task::spawn_blocking(move || d.clear_promotion()).await {
            Ok(Ok(())) => tracing::info!(
                backup = self.addr.as_str(),
                "this promoted server's backup holds its whole state: the promotion is no \
                 longer recorded"
            ),
            Ok(Err(e)) => tracing::warn!(
                "cannot record that the backup holds this promoted server's state \
                 (the data directory still records the promotion): {e}"
            ),
            Err(e) => tracing::warn!("recording that the backup is synced failed: {e}"),
        }
    }
}

/// Reads the regions piece by piece, in plan order.
struct PieceReader<'a> {
    regions: &'a [ServedRegion],
    piece_bytes: u64,
    region: usize,
    offset: u64,
    index: u64,
    buf: Vec<u8>,
    zeros: Vec<u8>,
}

/// One piece: where it is, its number over all regions, its bytes.
struct Piece<'b> {
    region: u32,
    offset: u64,
    index: u64,
    bytes: &'b [u8],
    zero: bool,
}

impl<'a> PieceReader<'a> {
    fn new(regions: &'a [ServedRegion], piece_bytes: u64) -> PieceReader<'a> {
        PieceReader {
            regions,
            piece_bytes,
            region: 0,
            offset: 0,
            index: 0,
            buf: vec![0u8; piece_bytes as usize],
            zeros: vec![0u8; piece_bytes as usize],
        }
    }

    /// The next piece, `None` after the last region's last.
    fn next_piece(&mut self) -> Result<Option<Piece<'_>>, String> {
        while let Some(r) = self.regions.get(self.region) {
            let len = r.info.remote.len;
            if self.offset >= len {
                self.region += 1;
                self.offset = 0;
                continue;
            }
            let n = self.piece_bytes.min(len - self.offset) as usize;
            let offset = self.offset;
            r.region
                .read(offset, &mut self.buf[..n])
                .map_err(|e| format!("reading region `{}`: {e}", r.info.name))?;
            self.offset += n as u64;
            self.index += 1;
            return Ok(Some(Piece {
                region: self.region as u32,
                offset,
                index: self.index - 1,
                // A slice comparison is a memcmp, fast in debug builds too.
                zero: self.buf[..n] == self.zeros[..n],
                bytes: &self.buf[..n],
            }));
        }
        Ok(None)
    }
}

/// Pieces of `piece_bytes` over all of `regions` (each region's last may be short).
fn piece_count(regions: &[ServedRegion], piece_bytes: u64) -> u64 {
    regions
        .iter()
        .map(|r| r.info.remote.len.div_ceil(piece_bytes))
        .sum()
}

/// Which transfer pieces of the backup's memory hold data, as its attach answered.
enum BackupPieces {
    /// None (it is clean).
    AllZero,
    /// Bit i set: piece i (counted over the regions in plan order) holds data.
    Known(Vec<u8>),
    /// It did not say: every piece may.
    Unknown,
}

impl BackupPieces {
    fn is_zero(&self, piece: u64) -> bool {
        match self {
            BackupPieces::AllZero => true,
            BackupPieces::Known(bits) => bits[(piece / 8) as usize] & (1 << (piece % 8)) == 0,
            BackupPieces::Unknown => false,
        }
    }
}

/// The pieces of `piece_bytes` of `regions` that hold a nonzero byte, as the attach
/// answer's bitmap. Reads all region memory: call with the backup's lock held, so no
/// batch changes it meanwhile.
fn pieces_with_data(regions: &[ServedRegion], piece_bytes: u64) -> Result<Vec<u8>, Status> {
    let mut bits = vec![0u8; piece_count(regions, piece_bytes).div_ceil(8) as usize];
    let mut pieces = PieceReader::new(regions, piece_bytes);
    while let Some(piece) = pieces.next_piece().map_err(Status::internal)? {
        if !piece.zero {
            bits[(piece.index / 8) as usize] |= 1 << (piece.index % 8);
        }
    }
    Ok(bits)
}

/// Persists acknowledged during a new attach's transfer, for the backup after it.
#[derive(Default)]
struct Backlog {
    /// Each Persist's entries and their count, in the copies' order.
    queued: std::collections::VecDeque<(Vec<u8>, u32)>,
    bytes: usize,
}

impl Backlog {
    /// The oldest Persists, up to [`SHIP_TARGET`] bytes (at least one), joined as one
    /// batch of the stream: a batch stays within the backup's decoding limit however
    /// much queued up.
    fn take_batch(&mut self) -> Option<(Vec<u8>, u32)> {
        let mut batch: Vec<(Vec<u8>, u32)> = Vec::new();
        let mut size = 0;
        while let Some((entries, _)) = self.queued.front()
            && (batch.is_empty() || size + entries.len() <= SHIP_TARGET)
        {
            let (entries, count) = self.queued.pop_front().expect("just seen");
            size += entries.len();
            self.bytes -= entries.len();
            batch.push((entries, count));
        }
        (!batch.is_empty()).then(|| join(batch.iter().map(|(e, c)| (e.as_slice(), *c))))
    }
}

/// Persists' entries joined into one batch, with their total count.
fn join<'e>(parts: impl Iterator<Item = (&'e [u8], u32)> + Clone) -> (Vec<u8>, u32) {
    let mut entries = Vec::with_capacity(parts.clone().map(|(e, _)| e.len()).sum());
    let mut count = 0;
    for (e, c) in parts {
        entries.extend_from_slice(e);
        count += c;
    }
    (entries, count)
}

/// Runs `work` while acknowledging every Persist queued meanwhile and keeping its
/// entries in `backlog`.
async fn acking<T>(
    rx: &mut mpsc::UnboundedReceiver<Shipment>,
    backlog: &mut Backlog,
    work: impl std::future::Future<Output = Result<T, Failure>>,
) -> Result<T, Failure> {
    tokio::pin!(work);
    loop {
        tokio::select! {
            biased;
            done = &mut work => return done,
            got = rx.recv() => {
                let Some(s) = got else {
                    return Err(Failure::Lost("the server is stopping".into()));
                };
                if backlog.bytes + s.entries.len() > MAX_BACKLOG {
                    let _ = s.reply.send(Err(Refusal {
                        why: "the backup's state transfer fell too far behind this \
                              primary's Persists; it starts again"
                            .into(),
                        for_now: true,
                    }));
                    return Err(Failure::Lost(format!(
                        "more than {} MiB of Persists queued during the state transfer",
                        MAX_BACKLOG >> 20
                    )));
                }
                backlog.bytes += s.entries.len();
                backlog.queued.push_back((s.entries, s.count));
                let _ = s.reply.send(Ok(()));
            }
        }
    }
}

/// The first attach of a primary starting. A backup that serves another primary whose
/// session is live is asked again every [`RETRY_EVERY`] until that session could have
/// lapsed: a primary started again after a crash (`kill -9`, which ends no session)
/// attaches once its predecessor's session lapsed, and a second live primary fails
/// with the backup's refusal.
async fn attach_when_free(link: &Link) -> Result<(Stream, BackupPieces), String> {
    let mut deadline = None;
    loop {
        match link.attach(false).await {
            Err(Failure::Busy(why, lease)) => {
                let now = tokio::time::Instant::now();
                // The lease counts from the other primary's last renewal, before now.
                let until = *deadline.get_or_insert_with(|| {
                    tracing::warn!(
                        backup = link.addr.as_str(),
                        "the backup serves another primary whose session is live; waiting up \
                         to {lease:?} for that session to lapse, as a primary that died \
                         leaves it: {why}"
                    );
                    now + lease + RETRY_EVERY
                });
                if now >= until {
                    return Err(format!(
                        "{why}; waited {lease:?} and it is still live: that primary is running"
                    ));
                }
                tokio::time::sleep(RETRY_EVERY.min(until - now)).await;
            }
            attached => return attached.map_err(|f| f.why().to_string()),
        }
    }
}

/// What a server's stream to its backup is made of.
pub(crate) struct StreamTo {
    /// The backup's control-plane address.
    pub addr: String,
    pub token: ClusterToken,
    pub regions: Arc<Vec<ServedRegion>>,
    /// This server's sessions, whose fenced incarnations every attach hands on.
    pub sessions: Arc<Sessions>,
    /// The boot and replication epoch this server attaches with.
    pub boot: u64,
    pub epoch: u64,
    /// The data directory, if any: its recorded promotion is cleared once synced.
    pub durable: Option<Arc<Durable>>,
    /// [`crate::ServerConfig::resync_delay`].
    pub resync_delay: Duration,
}

impl StreamTo {
    fn into_link(self) -> Link {
        Link {
            addr: self.addr,
            token: self.token,
            regions: self.regions,
            boot: self.boot,
            epoch: self.epoch,
            id: rand::random::<[u8; 16]>().to_vec(),
            attached: AttachedSession::default(),
            sessions: self.sessions,
            resync_delay: self.resync_delay,
            durable: self.durable,
        }
    }
}

impl Replicator {
    /// Attaches to the backup and copies every region to it; returns once the backup
    /// holds what the regions hold. Call before anyone can write the regions.
    pub async fn start(to: StreamTo) -> Result<Replicator, String> {
        let restored = to.durable.is_some();
        let link = to.into_link();
        let addr = link.addr.as_str();
        let (mut stream, backup) = attach_when_free(&link).await?;
        if !matches!(backup, BackupPieces::AllZero) && !restored {
            return Err(format!(
                "the backup at {addr} holds state from an earlier primary, and this primary has \
                 no data directory (its memory is empty): attaching would overwrite the only \
                 copy. Promote the backup instead (a compute node does when this primary is \
                 down), or give this primary a fresh backup"
            ));
        }
        // A restored durable primary sends what it restored; a clean backup needs no
        // zeros (nothing but this transfer and the stream ever writes its memory).
        let sent = link
            .transfer(&mut stream, &backup)
            .await
            .map_err(|f| f.why().to_string())?;
        stream
            .apply(addr, Vec::new(), 0, true)
            .await
            .map_err(|f| f.why().to_string())?;
        tracing::info!(
            backup = addr,
            bytes = sent,
            "backup attached: state transferred"
        );
        link.forget_promotion().await;
        let (tx, rx) = mpsc::unbounded_channel();
        Ok(Replicator::running(link, tx, |link| {
            ship(link, Ok(stream), rx)
        }))
    }

    /// Attaches a server that serves already (a promoted backup) to a new backup, and
    /// returns once attached: from then on the backup cannot be promoted until it holds
    /// this server's whole state, which a task copies there while Persists go on
    /// (acknowledged meanwhile with this server as their only copy, as they were before
    /// the attach), then the stream runs as a primary's. Fails, with the server left as
    /// it was, if the backup cannot be attached within the bounds of an attach again.
    pub async fn attach_running(to: StreamTo) -> Result<Replicator, String> {
        let link = to.into_link();
        let (stream, backup) = link.attach(true).await.map_err(|f| f.why().to_string())?;
        tracing::warn!(
            backup = link.addr.as_str(),
            "backup attached: copying this server's whole state to it; until it holds \
             that, Persists are acknowledged with this server as their only copy"
        );
        let (tx, mut rx) = mpsc::unbounded_channel();
        Ok(Replicator::running(link, tx, |link| async move {
            let first = link.catch_up(stream, &backup, &mut rx).await;
            if let Err(f) = &first {
                tracing::error!("copying the state to the new backup failed: {}", f.why());
            }
            ship(link, first, rx).await;
        }))
    }

    /// The replicator whose stream task `run(link)` is, fed by `tx`.
    fn running<F>(
        link: Link,
        tx: mpsc::UnboundedSender<Shipment>,
        run: impl FnOnce(Link) -> F,
    ) -> Replicator
    where
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        let (addr, attached) = (link.addr.clone(), link.attached.clone());
        Replicator {
            addr,
            tx,
            order: Mutex::new(()),
            task: tokio::spawn(run(link)),
            attached,
        }
    }

    /// The backup's control-plane address.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// Stops the stream and ends its session at the backup (bounded, best effort), so
    /// that a primary started again at once is not refused as a second live primary
    /// until the session lapsed. For a server shutting down.
    pub async fn detach(&self) {
        self.task.abort();
        let attached = self
            .attached
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some((mut rpc, header)) = attached {
            let end = rpc.end_session(with_session(proto::EndSessionRequest {}, &header));
            let _ = tokio::time::timeout(DETACH_TIMEOUT, end).await;
        }
    }

    /// Has the attached backup refuse compute-node `incarnation` from now on (it ends
    /// none of its sessions: a backup serves no compute node before it is promoted).
    pub async fn fence(&self, incarnation: u64) -> Result<(), String> {
        let attached = self
            .attached
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let Some((mut rpc, header)) = attached else {
            return Err("no backup is attached".into());
        };
        fence_at(&mut rpc, &header, incarnation).await
    }

    /// Queues one Persist's entries for the backup; the receiver answers once the
    /// backup has them. Called in the copies' order (under the ordering lock).
    pub fn ship(
        &self,
        entries: Vec<u8>,
        count: u32,
    ) -> Result<oneshot::Receiver<Result<(), Refusal>>, PersistError> {
        let (reply, wait) = oneshot::channel();
        self.tx
            .send(Shipment {
                entries,
                count,
                reply,
            })
            .map_err(|_| PersistError::Closed)?;
        Ok(wait)
    }
}

/// Fences `incarnation` at the backup through the stream's session.
async fn fence_at(
    rpc: &mut MemoryServerClient<Channel>,
    header: &AsciiMetadataValue,
    incarnation: u64,
) -> Result<(), String> {
    let request = with_session(proto::FenceRequest { incarnation }, header);
    match tokio::time::timeout(FENCE_TIMEOUT, rpc.fence(request)).await {
        Err(_) => Err(format!(
            "the backup did not record a fence within {FENCE_TIMEOUT:?}"
        )),
        Ok(Err(status)) => Err(format!("the backup refused a fence: {}", status.message())),
        Ok(Ok(_)) => Ok(()),
    }
}

fn with_session<T>(message: T, header: &AsciiMetadataValue) -> Request<T> {
    let mut req = Request::new(message);
    req.metadata_mut().insert(SESSION_METADATA, header.clone());
    req
}

/// The next shipment and every one queued behind it, up to [`SHIP_TARGET`] bytes:
/// `None` once the primary stops.
async fn next_batch(rx: &mut mpsc::UnboundedReceiver<Shipment>) -> Option<Vec<Shipment>> {
    let first = rx.recv().await?;
    let mut size = first.entries.len();
    let mut batch = vec![first];
    while size < SHIP_TARGET {
        match rx.try_recv() {
            Ok(s) => {
                size += s.entries.len();
                batch.push(s);
            }
            Err(_) => break,
        }
    }
    Some(batch)
}

fn answer(batch: Vec<Shipment>, result: &Result<(), Refusal>) {
    for s in batch {
        let _ = s.reply.send(result.clone());
    }
}

/// The stream: one ReplicaApply at a time, in queue order, each carrying every
/// Persist queued meanwhile. After a failure nothing is acknowledged (the backup may
/// or may not hold the failed batch, and may be promoted with what it holds) until a
/// new attach, tried every [`RETRY_EVERY`], has made the backup unpromotable; then
/// the whole state is copied again. A fenced primary never attaches again.
async fn ship(
    link: Link,
    mut stream: Result<Stream, Failure>,
    mut rx: mpsc::UnboundedReceiver<Shipment>,
) {
    // The next attach attempt (kept across the Persists answered meanwhile).
    let mut next_try = tokio::time::Instant::now() + RETRY_EVERY;
    loop {
        match &mut stream {
            Ok(s) => {
                // `next_batch` is cancel-safe: it awaits only the first shipment.
                let got = tokio::select! {
                    got = next_batch(&mut rx) => got,
                    () = tokio::time::sleep(PRIMARY_HEARTBEAT) => {
                        s.heartbeat().await;
                        continue;
                    }
                };
                let Some(batch) = got else {
                    break;
                };
                let (entries, count) = join(batch.iter().map(|s| (s.entries.as_slice(), s.count)));
                match s.apply(&link.addr, entries, count, false).await {
                    Ok(()) => answer(batch, &Ok(())),
                    Err(failure) => {
                        let refusal = failure.refusal();
                        tracing::error!("{}", refusal.why);
                        answer(batch, &Err(refusal));
                        stream = Err(failure);
                        next_try = tokio::time::Instant::now() + RETRY_EVERY;
                    }
                }
            }
            Err(failure @ Failure::Fenced(_)) => {
                let Some(batch) = next_batch(&mut rx).await else {
                    break;
                };
                answer(batch, &Err(failure.refusal()));
            }
            Err(lost @ (Failure::Lost(_) | Failure::Busy(..))) => {
                let (refusal, last) = (lost.refusal(), lost.why().to_string());
                let queued = tokio::select! {
                    got = next_batch(&mut rx) => Some(got),
                    () = tokio::time::sleep_until(next_try) => None,
                };
                match queued {
                    Some(None) => break,
                    Some(Some(batch)) => answer(batch, &Err(refusal)),
                    None => match link.reattach(&mut rx).await {
                        Ok(s) => stream = Ok(s),
                        Err(failure) => {
                            if failure.why() != last {
                                tracing::warn!(
                                    backup = link.addr.as_str(),
                                    "attaching to the backup again failed: {}",
                                    failure.why()
                                );
                            }
                            stream = Err(failure);
                            next_try = tokio::time::Instant::now() + RETRY_EVERY;
                        }
                    },
                }
            }
        }
    }
}

/// A backup's side of the stream.
pub(crate) struct Backup {
    inner: Mutex<BackupInner>,
}

struct BackupInner {
    /// The boot it reports since it was promoted.
    promoted: Option<u64>,
    /// The session of the attached primary. The newest attach wins, so a restarted
    /// primary takes over from its dead predecessor, but only once that one's session
    /// ended or lapsed, or from the same primary process (`primary_id`).
    stream: Option<SessionId>,
    /// The attached primary process's id (`ReplicaAttachRequest::primary_id`) and
    /// where its attach came from.
    primary_id: Vec<u8>,
    primary_peer: Option<SocketAddr>,
    next_seq: u64,
    primary_boot: u64,
    /// The replication epoch of the data it holds (its data directory's, or 0), or of
    /// the primary it accepted since, or its promotion's.
    epoch: u64,
    /// Region memory is all zero.
    clean: bool,
    /// The attached primary's whole state is here (its stream said so): promotion
    /// loses nothing it acknowledged. False from start and from every attach until
    /// then, since a primary may have acknowledged Persists without this backup while
    /// it was down or before the transfer finished.
    synced: bool,
    /// When the attached primary was last heard from: its attach, a batch, a renewal
    /// of its session.
    last_heard: Option<Instant>,
}

const NOT_PROMOTED: &str = "this memory server is a backup; promote it first";

impl Backup {
    pub fn new(clean: bool, epoch: u64) -> Backup {
        Backup {
            inner: Mutex::new(BackupInner {
                promoted: None,
                stream: None,
                primary_id: Vec::new(),
                primary_peer: None,
                next_seq: 1,
                primary_boot: 0,
                epoch,
                clean,
                synced: false,
                last_heard: None,
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BackupInner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Its boot once promoted, `None` while still a backup.
    pub fn promoted(&self) -> Option<u64> {
        self.lock().promoted
    }

    /// The replication epoch of the data it holds (its promotion's, once promoted).
    pub fn epoch(&self) -> u64 {
        self.lock().epoch
    }

    /// Whether it holds its attached primary's whole state (Promote is accepted).
    pub fn synced(&self) -> bool {
        let inner = self.lock();
        inner.synced && inner.promoted.is_none()
    }

    /// How long ago the attached primary was last heard from; `None` once promoted or
    /// while no primary is attached.
    pub fn primary_silence(&self) -> Option<Duration> {
        let inner = self.lock();
        match inner.promoted {
            Some(_) => None,
            None => inner.last_heard.map(|at| at.elapsed()),
        }
    }

    /// Notes a sign of life of `session` (a renewal): the attached primary's counts.
    /// Called on the async runtime, so it never waits for the lock: whoever holds it
    /// is applying a batch (which notes the attached primary itself when it ends) or
    /// answering briefly, and a renewal missed is one of four a second.
    pub fn heard_from(&self, session: SessionId) {
        let Ok(mut inner) = self.inner.try_lock() else {
            return;
        };
        if inner.stream == Some(session) {
            inner.last_heard = Some(Instant::now());
        }
    }

    /// Refuses compute nodes' queue pairs and Persists until promoted.
    pub fn check_serving(&self) -> Result<(), Status> {
        match self.promoted() {
            Some(_) => Ok(()),
            None => Err(Status::failed_precondition(NOT_PROMOTED)),
        }
    }

    /// Accepts a primary's stream (the newest attach wins, unless another primary's
    /// session is live: `live` says whether a session is, `lease` how long one lives
    /// on unrenewed) and answers whether region memory is all zero and, if not, which
    /// pieces hold data. Blocks on disk IO (a durable backup records the primary's
    /// epoch) and reads region memory.
    pub fn attach(
        &self,
        (session, peer): (SessionId, Option<SocketAddr>),
        ours: &[ServedRegion],
        req: &proto::ReplicaAttachRequest,
        durable: Option<&Durable>,
        (live, lease): (impl Fn(SessionId) -> bool, Duration),
    ) -> Result<proto::ReplicaAttachResponse, Status> {
        #[cfg(test)]
        std::thread::sleep(Duration::from_millis(
            tests::ATTACH_DELAY_MS.load(std::sync::atomic::Ordering::Relaxed),
        ));
        let theirs: Vec<(&str, u64)> = req
            .regions
            .iter()
            .map(|r| (r.name.as_str(), r.len))
            .collect();
        let mine: Vec<(&str, u64)> = ours
            .iter()
            .map(|r| (r.info.name.as_str(), r.info.remote.len))
            .collect();
        if theirs != mine {
            let first = theirs
                .iter()
                .zip(&mine)
                .find(|(a, b)| a != b)
                .map(|(a, b)| {
                    format!(
                        "the primary's `{}` ({} bytes) against this backup's `{}` ({} bytes)",
                        a.0, a.1, b.0, b.1
                    )
                })
                .unwrap_or_else(|| {
                    format!(
                        "the primary has {} regions, this backup {}",
                        theirs.len(),
                        mine.len()
                    )
                });
            return Err(Status::failed_precondition(format!(
                "region plans differ ({first}): start the backup with the primary's --size and --region-size"
            )));
        }
        let mut inner = self.lock();
        if inner.promoted.is_some() {
            return Err(Status::failed_precondition(
                "this backup has been promoted: it takes no primary's stream any more",
            ));
        }
        // Two live primaries would take turns overwriting this backup's memory with their
        // state, and a promotion would then serve whichever came last: the other's
        // acknowledged Persists lost.
        let same_primary = !req.primary_id.is_empty() && req.primary_id == inner.primary_id;
        if inner
            .stream
            .is_some_and(|current| current != session && !same_primary && live(current))
        {
            let at = inner
                .primary_peer
                .map_or_else(|| "an unknown address".to_string(), |a| a.to_string());
            let mut refusal = Status::aborted(format!(
                "this backup serves another primary (attached from {at}), whose session is \
                 live: two primaries cannot share one backup. Give each primary a backup of \
                 its own. If that primary has stopped, its session lapses within this \
                 backup's session lease ({} s) and an attach after that is accepted",
                lease.as_secs_f64().ceil()
            ));
            if let Ok(ms) = lease.as_millis().to_string().parse() {
                refusal.metadata_mut().insert(SESSION_LEASE_METADATA, ms);
            }
            return Err(refusal);
        }
        // The primary's state transfer overwrites all of this backup's memory: from a
        // primary of an older epoch (one that failed over to a backup since, like a
        // restarted old primary), that would replace acknowledged data with older data.
        if req.primary_epoch < inner.epoch {
            return Err(Status::failed_precondition(format!(
                "this backup holds data of replication epoch {}, newer than the attaching \
                 primary's (epoch {}): that primary's data predates a failover this backup's \
                 data went through, and its state transfer would overwrite newer data with \
                 older. Start this backup's data directory as the primary (without --backup) \
                 and give it the other server as its backup (--backup-at)",
                inner.epoch, req.primary_epoch
            )));
        }
        // Recorded before the stream changes anything, so that a restarted backup
        // still knows which data it took.
        if req.primary_epoch != inner.epoch {
            if let Some(d) = durable {
                d.record_epoch(req.primary_epoch).map_err(|e| {
                    Status::internal(format!("cannot record the primary's epoch: {e}"))
                })?;
            }
            inner.epoch = req.primary_epoch;
        }
        // A piece size that would make a huge bitmap (or none) gets no bitmap.
        let pieces_with_data = if inner.clean || !(4096..=1 << 30).contains(&req.piece_bytes) {
            Vec::new()
        } else {
            pieces_with_data(ours, req.piece_bytes)?
        };
        inner.stream = Some(session);
        inner.primary_id = req.primary_id.clone();
        inner.primary_peer = peer;
        inner.synced = false;
        inner.next_seq = 1;
        inner.primary_boot = req.primary_boot;
        inner.last_heard = Some(Instant::now());
        Ok(proto::ReplicaAttachResponse {
            clean: inner.clean,
            pieces_with_data,
        })
    }

    /// Applies one batch into region memory and queues it for the journal (if any);
    /// the receiver answers once it is on disk. Blocks on the region copy.
    pub fn apply(
        &self,
        session: SessionId,
        req: proto::ReplicaApplyRequest,
        regions: &[ServedRegion],
        durable: Option<&Durable>,
    ) -> Result<Option<oneshot::Receiver<Result<u64, String>>>, Status> {
        // Held across the apply, so that a promotion sees each batch whole or not at
        // all, and batches apply in sequence.
        let mut inner = self.lock();
        if inner.promoted.is_some() {
            return Err(Status::failed_precondition(
                "this backup has been promoted: the primary is fenced",
            ));
        }
        if inner.stream != Some(session) {
            return Err(Status::failed_precondition(
                "another primary attached to this backup since; this stream is superseded",
            ));
        }
        if req.seq != inner.next_seq {
            return Err(Status::failed_precondition(format!(
                "replication batch {} out of order (expected {})",
                req.seq, inner.next_seq
            )));
        }
        // Validated whole before anything is written.
        let mut pieces = Vec::with_capacity(req.count as usize);
        let mut rest = &req.entries[..];
        let mut bytes = 0u64;
        while !rest.is_empty() {
            let bad = |why: &str| {
                Status::invalid_argument(format!("replication batch {}: {why}", req.seq))
            };
            if rest.len() < journal::ENTRY_HEADER_LEN {
                return Err(bad("a short entry header"));
            }
            let region = u32::from_le_bytes(rest[..4].try_into().expect("4 bytes")) as usize;
            let offset = u64::from_le_bytes(rest[4..12].try_into().expect("8 bytes"));
            let len = u32::from_le_bytes(rest[12..16].try_into().expect("4 bytes")) as usize;
            rest = &rest[journal::ENTRY_HEADER_LEN..];
            if rest.len() < len {
                return Err(bad("an entry longer than the batch"));
            }
            let r = regions
                .get(region)
                .ok_or_else(|| bad("an entry names no region"))?;
            if offset
                .checked_add(len as u64)
                .is_none_or(|end| end > r.info.remote.len)
            {
                return Err(bad("an entry past its region's end"));
            }
            pieces.push((r, offset, &rest[..len]));
            bytes += len as u64;
            rest = &rest[len..];
        }
        if pieces.len() != req.count as usize {
            return Err(Status::invalid_argument(format!(
                "replication batch {} holds {} entries, not {}",
                req.seq,
                pieces.len(),
                req.count
            )));
        }
        for (r, offset, data) in pieces {
            r.region
                .write(offset, data)
                .map_err(|e| Status::internal(format!("writing region `{}`: {e}", r.info.name)))?;
        }
        let wait = durable
            .filter(|_| req.count > 0)
            .map(|d| d.journal_entries(req.entries, req.count, bytes))
            .transpose()
            .map_err(|e| Status::unavailable(e.to_string()))?;
        inner.next_seq += 1;
        inner.last_heard = Some(Instant::now());
        inner.clean &= req.count == 0;
        inner.synced |= req.synced;
        Ok(wait)
    }

    /// Promotes the backup (idempotent): the boot becomes one more than the larger of
    /// its own and its last primary's, so that it differs from every boot a client saw
    /// from either, and the epoch likewise; with a data directory, the promotion is
    /// recorded there (atomically, fsynced) before this returns, so that the directory
    /// refuses to start as a backup again. Blocks on disk IO.
    pub fn promote(&self, durable: Option<&Durable>) -> Result<u64, Status> {
        let mut inner = self.lock();
        if let Some(boot) = inner.promoted {
            return Ok(boot);
        }
        if !inner.synced {
            return Err(Status::failed_precondition(if inner.stream.is_some() {
                "this backup does not hold its primary's whole state yet (the primary's \
                 state transfer has not finished): promoting it would lose what the \
                 primary acknowledged. Promote it once the primary's log says \
                 \"backup attached\", or restart the primary"
            } else {
                "this backup has not received its primary's state since it started: \
                 promoting it would lose what the primary acknowledged meanwhile. Restart \
                 the primary (it attaches to this backup and copies its state), or, if the \
                 primary is gone for good and this backup has a data directory, start that \
                 directory as the primary (without --backup), knowing it holds only what \
                 was persisted before this backup stopped"
            }));
        }
        let own = durable.map_or(0, |d| d.boot());
        let boot = own.max(inner.primary_boot) + 1;
        let epoch = inner.epoch + 1;
        if let Some(d) = durable {
            d.record_promotion(boot, epoch)
                .map_err(|e| Status::internal(format!("cannot record the promotion: {e}")))?;
        }
        inner.promoted = Some(boot);
        inner.epoch = epoch;
        inner.stream = None;
        if durable.is_none() {
            tracing::warn!(
                boot,
                epoch,
                "promoted without a data directory: Persist is acknowledged from now on \
                 with this process's memory as the only copy"
            );
        } else {
            tracing::info!(
                boot,
                epoch,
                "promoted: serving compute nodes; recorded in the data directory, which \
                 must restart as a primary (without --backup) until a backup of its own \
                 holds its whole state"
            );
        }
        Ok(boot)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Client, ClusterToken, MemoryServer, PersistRange, RegionPlan, ServerConfig};
    use std::sync::atomic::AtomicU64;

    /// How long a backup of this process takes before it answers an attach: a
    /// backup reading a large memory on a loaded machine.
    pub(super) static ATTACH_DELAY_MS: AtomicU64 = AtomicU64::new(0);

    /// A server and its network (kept for as long as the server runs).
    async fn server(
        listen: std::net::SocketAddr,
        replication: Replication,
    ) -> (MemoryServer, fabric::sim::SimNetwork) {
        let net = fabric::sim::SimNetwork::new(fabric::sim::SimConfig::default());
        let device: Arc<dyn fabric::Device> = net.add_node();
        let plan = RegionPlan::new(64 << 10, 32 << 10).unwrap();
        let token = ClusterToken::new("replica-unit-test-token").unwrap();
        let mut config = ServerConfig::new(listen, plan, token);
        config.replication = replication;
        (MemoryServer::start(config, device).await.unwrap(), net)
    }

    /// A restarted backup that takes longer to answer the attach than the primary once
    /// allowed for connecting and attaching together (5 s) is attached again, and
    /// Persists resume: each cut-off attempt used to start the backup's work over.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_backup_slow_to_answer_its_attach_is_attached_again() {
        let any = "127.0.0.1:0".parse().unwrap();
        let (backup, _bnet) = server(any, Replication::Backup).await;
        let addr = backup.local_addr();
        let (primary, _pnet) = server(
            any,
            Replication::Primary {
                backup_at: addr.to_string(),
            },
        )
        .await;
        let token = ClusterToken::new("replica-unit-test-token").unwrap();
        let client = Client::connect(&primary.local_addr().to_string(), &token)
            .await
            .unwrap();
        let rkey = client
            .list_regions()
            .await
            .unwrap()
            .get("data.0")
            .unwrap()
            .remote
            .rkey;
        let range = PersistRange::new(rkey, 0, 8);
        client.persist(&[range]).await.unwrap();
        backup.shutdown().await.unwrap();
        assert!(
            client.persist(&[range]).await.is_err(),
            "the backup is down"
        );

        ATTACH_DELAY_MS.store(6000, std::sync::atomic::Ordering::Relaxed);
        let (again, _anet) = server(addr, Replication::Backup).await;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        loop {
            match client.persist(&[range]).await {
                Ok(_) => break,
                Err(e) => assert!(
                    tokio::time::Instant::now() < deadline,
                    "no Persist acknowledged within 60 s: {e}"
                ),
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        ATTACH_DELAY_MS.store(0, std::sync::atomic::Ordering::Relaxed);
        drop(client);
        primary.shutdown().await.unwrap();
        again.shutdown().await.unwrap();
    }

    /// What queued up during a transfer goes out in order, in batches the backup's
    /// decoding limit takes (a 256 MiB backlog sent as one batch would be refused).
    #[test]
    fn a_backlog_goes_out_in_order_in_stream_sized_batches() {
        let mut backlog = Backlog::default();
        let persist = |tag: u8, len: usize| (vec![tag; len], 1u32);
        let sizes = [SHIP_TARGET / 2, SHIP_TARGET / 2, 1, 3 * SHIP_TARGET, 10];
        for (i, &len) in sizes.iter().enumerate() {
            let (entries, count) = persist(i as u8, len);
            backlog.bytes += entries.len();
            backlog.queued.push_back((entries, count));
        }
        let mut batches = Vec::new();
        while let Some(batch) = backlog.take_batch() {
            batches.push(batch);
        }
        assert_eq!(backlog.bytes, 0);
        let shapes: Vec<(usize, u32)> = batches.iter().map(|(e, c)| (e.len(), *c)).collect();
        assert_eq!(
            shapes,
            [(SHIP_TARGET, 2), (1, 1), (3 * SHIP_TARGET, 1), (10, 1)],
            "a Persist larger than a batch goes alone, and whole"
        );
        let tags: Vec<u8> = batches
            .iter()
            .flat_map(|(e, _)| e.iter().copied())
            .collect();
        assert!(tags.is_sorted(), "in the copies' order");
        assert!(batches.iter().all(|(e, _)| e.len() <= MAX_APPLY_BYTES));
    }
}
