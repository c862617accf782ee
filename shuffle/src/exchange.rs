//! The out-of-band exchange nodes use to wire endpoints: queue-pair numbers, region
//! keys and device addresses, handed around before any verb runs (what rdma_cm or an
//! MPI bootstrap does on a real cluster; rdma_cm cannot route over loopback here).
//!
//! The one operation is a collective all-gather. Every node makes the same sequence
//! of calls; call k on one node meets call k on every other, and the tags must agree,
//! so a mismatch is reported rather than silently pairing the wrong messages.

use crate::error::{Result, ShuffleError};
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// A collective all-gather among the nodes of one shuffle.
pub trait Exchange: Send + Sync {
    /// Every node contributes `mine` under `tag`; returns all contributions, by rank.
    fn all_gather(&self, tag: &str, mine: Vec<u8>) -> Result<Vec<Vec<u8>>>;
    fn rank(&self) -> usize;
    fn nodes(&self) -> usize;
}

/// Nodes that are threads of one process (the sim backend, tests).
pub struct LocalExchange {
    rank: usize,
    shared: Arc<LocalShared>,
    calls: AtomicU64,
}

struct LocalShared {
    nodes: usize,
    timeout: Duration,
    rounds: Mutex<HashMap<u64, Round>>,
    changed: Condvar,
}

struct Round {
    tag: String,
    parts: Vec<Option<Vec<u8>>>,
    collected: usize,
}

impl LocalExchange {
    /// One exchange per node, for `nodes` nodes. A call waits at most `timeout` for
    /// the others.
    pub fn group(nodes: usize, timeout: Duration) -> Vec<LocalExchange> {
        let shared = Arc::new(LocalShared {
            nodes,
            timeout,
            rounds: Mutex::new(HashMap::new()),
            changed: Condvar::new(),
        });
        (0..nodes)
            .map(|rank| LocalExchange {
                rank,
                shared: shared.clone(),
                calls: AtomicU64::new(0),
            })
            .collect()
    }
}

impl Exchange for LocalExchange {
    fn rank(&self) -> usize {
        self.rank
    }
    fn nodes(&self) -> usize {
        self.shared.nodes
    }

    fn all_gather(&self, tag: &str, mine: Vec<u8>) -> Result<Vec<Vec<u8>>> {
        let call = self.calls.fetch_add(1, Ordering::Relaxed);
        let s = &*self.shared;
        let deadline = Instant::now() + s.timeout;
        let mut rounds = s.rounds.lock().unwrap_or_else(|e| e.into_inner());
        let round = rounds.entry(call).or_insert_with(|| Round {
            tag: tag.to_string(),
            parts: vec![None; s.nodes],
            collected: 0,
        });
        if round.tag != tag {
            return Err(ShuffleError::Exchange(format!(
                "call {call}: this node exchanges {tag:?}, another {:?}",
                round.tag
            )));
        }
        round.parts[self.rank] = Some(mine);
        s.changed.notify_all();
        loop {
            let round = rounds
                .get_mut(&call)
                .expect("removed only after collection");
            if round.parts.iter().all(Option::is_some) {
                let all: Vec<Vec<u8>> = round.parts.iter().flatten().cloned().collect();
                round.collected += 1;
                if round.collected == s.nodes {
                    rounds.remove(&call);
                }
                return Ok(all);
            }
            let now = Instant::now();
            if now >= deadline {
                let missing: Vec<usize> =
                    (0..s.nodes).filter(|&r| round.parts[r].is_none()).collect();
                return Err(ShuffleError::Exchange(format!(
                    "{tag}: nodes {missing:?} did not join within {:?}",
                    s.timeout
                )));
            }
            rounds = s
                .changed
                .wait_timeout(rounds, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

/// Nodes that are processes: rank 0 listens on a loopback address, the others connect
/// to it, and every all-gather goes through rank 0.
pub struct TcpExchange {
    rank: usize,
    nodes: usize,
    /// Rank 0: a stream per other rank (index rank − 1). Others: the stream to rank 0.
    streams: Mutex<Vec<TcpStream>>,
}

const MAX_FRAME: u32 = 64 << 20;

fn io_err(what: &str, e: std::io::Error) -> ShuffleError {
    ShuffleError::Exchange(format!("{what}: {e}"))
}

fn write_frame(s: &mut TcpStream, bytes: &[u8]) -> Result<()> {
    let len = u32::try_from(bytes.len())
        .ok()
        .filter(|&l| l <= MAX_FRAME)
        .ok_or_else(|| ShuffleError::Exchange(format!("frame of {} bytes", bytes.len())))?;
    s.write_all(&len.to_le_bytes())
        .and_then(|_| s.write_all(bytes))
        .map_err(|e| io_err("send to peer", e))
}

fn read_frame(s: &mut TcpStream) -> Result<Vec<u8>> {
    let mut len = [0; 4];
    s.read_exact(&mut len)
        .map_err(|e| io_err("receive from peer", e))?;
    let len = u32::from_le_bytes(len);
    if len > MAX_FRAME {
        return Err(ShuffleError::Exchange(format!(
            "peer announced a frame of {len} bytes"
        )));
    }
    let mut buf = vec![0; len as usize];
    s.read_exact(&mut buf)
        .map_err(|e| io_err("receive from peer", e))?;
    Ok(buf)
}

fn encode<T: serde::Serialize>(v: &T) -> Vec<u8> {
    postcard::to_allocvec(v).expect("in-memory encoding")
}

fn decode<'a, T: serde::Deserialize<'a>>(bytes: &'a [u8], what: &str) -> Result<T> {
    postcard::from_bytes(bytes).map_err(|e| ShuffleError::Exchange(format!("bad {what}: {e}")))
}

impl TcpExchange {
    /// Joins the exchange as `rank` of `nodes`. Rank 0 binds `addr` (use
    /// [`TcpExchange::listen`] to bind first and learn the port); the others connect to
    /// it, retrying until `timeout`.
    pub fn join(
        rank: usize,
        nodes: usize,
        addr: SocketAddr,
        timeout: Duration,
    ) -> Result<TcpExchange> {
        if rank == 0 {
            let listener = TcpListener::bind(addr).map_err(|e| io_err("bind", e))?;
            return TcpExchange::accept(listener, nodes, timeout);
        }
        if rank >= nodes {
            return Err(ShuffleError::Invalid(format!(
                "rank {rank} of {nodes} nodes"
            )));
        }
        let deadline = Instant::now() + timeout;
        let mut stream = loop {
            match TcpStream::connect_timeout(&addr, Duration::from_secs(1)) {
                Ok(s) => break s,
                Err(e) if Instant::now() >= deadline => {
                    return Err(io_err(&format!("connect to rank 0 at {addr}"), e));
                }
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        };
        stream.set_nodelay(true).ok();
        stream.set_read_timeout(Some(timeout)).ok();
        write_frame(&mut stream, &encode(&(rank as u32, nodes as u32)))?;
        Ok(TcpExchange {
            rank,
            nodes,
            streams: Mutex::new(vec![stream]),
        })
    }

    /// Rank 0 on an already bound listener: waits for the other `nodes − 1` ranks.
    pub fn accept(listener: TcpListener, nodes: usize, timeout: Duration) -> Result<TcpExchange> {
        let deadline = Instant::now() + timeout;
        listener
            .set_nonblocking(true)
            .map_err(|e| io_err("listen", e))?;
        let mut by_rank: Vec<Option<TcpStream>> = (1..nodes).map(|_| None).collect();
        let mut joined = 0;
        while joined < nodes - 1 {
            match listener.accept() {
                Ok((mut s, _)) => {
                    s.set_nonblocking(false).map_err(|e| io_err("accept", e))?;
                    s.set_nodelay(true).ok();
                    s.set_read_timeout(Some(timeout)).ok();
                    let (rank, n): (u32, u32) = decode(&read_frame(&mut s)?, "hello")?;
                    let slot = (rank as usize)
                        .checked_sub(1)
                        .filter(|&i| n as usize == nodes && i < nodes - 1)
                        .ok_or_else(|| {
                            ShuffleError::Exchange(format!(
                                "a peer joined as rank {rank} of {n}; expected 1..{nodes} of {nodes}"
                            ))
                        })?;
                    if by_rank[slot].replace(s).is_some() {
                        return Err(ShuffleError::Exchange(format!("rank {rank} joined twice")));
                    }
                    joined += 1;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        return Err(ShuffleError::Exchange(format!(
                            "only {joined} of {} peers joined within {timeout:?}",
                            nodes - 1
                        )));
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => return Err(io_err("accept", e)),
            }
        }
        Ok(TcpExchange {
            rank: 0,
            nodes,
            streams: Mutex::new(by_rank.into_iter().flatten().collect()),
        })
    }
}

impl Exchange for TcpExchange {
    fn rank(&self) -> usize {
        self.rank
    }
    fn nodes(&self) -> usize {
        self.nodes
    }

    fn all_gather(&self, tag: &str, mine: Vec<u8>) -> Result<Vec<Vec<u8>>> {
        let mut streams = self.streams.lock().unwrap_or_else(|e| e.into_inner());
        if self.rank != 0 {
            let s = &mut streams[0];
            write_frame(s, &encode(&(tag, &mine)))?;
            let (root_tag, all): (String, Vec<Vec<u8>>) = decode(&read_frame(s)?, "gather")?;
            if root_tag != tag {
                return Err(ShuffleError::Exchange(format!(
                    "this node exchanges {tag:?}, rank 0 {root_tag:?}"
                )));
            }
            return Ok(all);
        }
        let mut all = vec![mine];
        for (i, s) in streams.iter_mut().enumerate() {
            let (their_tag, part): (String, Vec<u8>) = decode(&read_frame(s)?, "contribution")?;
            if their_tag != tag {
                return Err(ShuffleError::Exchange(format!(
                    "rank 0 exchanges {tag:?}, rank {} {their_tag:?}",
                    i + 1
                )));
            }
            all.push(part);
        }
        let reply = encode(&(tag, &all));
        for s in streams.iter_mut() {
            write_frame(s, &reply)?;
        }
        Ok(all)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_all_gather_orders_by_rank_and_catches_mismatched_tags() {
        let group = LocalExchange::group(3, Duration::from_secs(5));
        let out: Vec<_> = std::thread::scope(|s| {
            let hs: Vec<_> = group
                .iter()
                .map(|x| s.spawn(move || x.all_gather("t", vec![x.rank() as u8]).unwrap()))
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for o in out {
            assert_eq!(o, vec![vec![0], vec![1], vec![2]]);
        }
        let pair = LocalExchange::group(2, Duration::from_secs(2));
        let err = std::thread::scope(|s| {
            let a = s.spawn(|| pair[0].all_gather("a", vec![]));
            let b = s.spawn(|| pair[1].all_gather("b", vec![]));
            // Whichever arrives second sees the other's tag; the first times out.
            let (a, b) = (a.join().unwrap(), b.join().unwrap());
            assert!(a.is_err() && b.is_err());
            [a, b]
                .into_iter()
                .map(|r| r.unwrap_err())
                .find(|e| e.to_string().contains(" exchanges "))
                .expect("a mismatch was reported")
        });
        assert!(err.to_string().contains("exchanges"), "{err}");
    }

    #[test]
    fn local_all_gather_times_out_when_a_node_is_missing() {
        let group = LocalExchange::group(2, Duration::from_millis(50));
        let err = group[0].all_gather("x", vec![1]).unwrap_err();
        assert!(err.to_string().contains("[1] did not join"), "{err}");
    }

    #[test]
    fn tcp_all_gather_over_loopback() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let t = Duration::from_secs(10);
        let out: Vec<_> = std::thread::scope(|s| {
            let root = s.spawn(move || {
                let x = TcpExchange::accept(listener, 3, t).unwrap();
                (
                    x.all_gather("a", vec![0]).unwrap(),
                    x.all_gather("b", vec![10]).unwrap(),
                )
            });
            let others: Vec<_> = (1..3)
                .map(|r| {
                    s.spawn(move || {
                        let x = TcpExchange::join(r, 3, addr, t).unwrap();
                        (
                            x.all_gather("a", vec![r as u8]).unwrap(),
                            x.all_gather("b", vec![10 + r as u8]).unwrap(),
                        )
                    })
                })
                .collect();
            let mut v = vec![root.join().unwrap()];
            v.extend(others.into_iter().map(|h| h.join().unwrap()));
            v
        });
        for (a, b) in out {
            assert_eq!(a, vec![vec![0], vec![1], vec![2]]);
            assert_eq!(b, vec![vec![10], vec![11], vec![12]]);
        }
    }

    #[test]
    fn tcp_join_reports_a_missing_root() {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let err = match TcpExchange::join(1, 2, port, Duration::from_millis(100)) {
            Err(e) => e,
            Ok(_) => panic!("joined nobody"),
        };
        assert!(err.to_string().contains("connect to rank 0"), "{err}");
    }
}
