//! An in-process endpoint pair for the flow layer's unit tests: every message is
//! copied into a buffer of the destination node's pool and queued; the receiver may
//! hand them out in random order, like UD, to check the flow layer does not rely on
//! ordering.

use super::{FlowConfig, FlowNet};
use crate::buffer::{Header, Received, SendBuf, State};
use crate::endpoint::{Design, Opened, RecvEndpoint, SendEndpoint};
use crate::error::{Result, ShuffleError};
use crate::exchange::LocalExchange;
use crate::node::Node;
use crate::pool::BufferPool;
use fabric::Device;
use fabric::sim::{SimConfig, SimNetwork};
use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex};
use std::task::Poll;
use std::time::{Duration, Instant};

struct Inbox {
    q: Mutex<(VecDeque<Received>, usize, u64)>,
    cv: Condvar,
}

struct Fabric {
    nodes: usize,
    lanes: usize,
    reorder: bool,
    pools: Vec<Arc<BufferPool>>,
    inboxes: Vec<Inbox>,
}

struct Tx {
    f: Arc<Fabric>,
    node: usize,
    lane: usize,
}

struct Rx {
    f: Arc<Fabric>,
    node: usize,
    lane: usize,
}

impl SendEndpoint for Tx {
    fn id(&self) -> u32 {
        (self.node * self.f.lanes + self.lane) as u32
    }
    fn acquire(&self) -> Result<SendBuf> {
        Ok(SendBuf::new(self.f.pools[self.node].take()?, u32::MAX))
    }
    fn put_data(&self, buf: SendBuf, dests: &[usize], state: State) -> Result<()> {
        let header = Header {
            payload_bytes: buf.payload_bytes(),
            state: State::MoreData,
            flags: 0,
            source: self.id(),
            extra: 0,
        };
        for &d in dests {
            let b = self.f.pools[d].take()?;
            for (i, w) in buf.payload()[..buf.len_words()].iter().enumerate() {
                b.words()[2 + i].store(w.load(Ordering::Relaxed), Ordering::Relaxed);
            }
            b.write_header(&header);
            let inbox = &self.f.inboxes[d * self.f.lanes + self.lane];
            inbox
                .q
                .lock()
                .unwrap()
                .0
                .push_back(Received::new(b, 0, &header, 0));
            inbox.cv.notify_all();
        }
        if state == State::Depleted {
            for n in 0..self.f.nodes {
                let inbox = &self.f.inboxes[n * self.f.lanes + self.lane];
                inbox.q.lock().unwrap().1 += 1;
                inbox.cv.notify_all();
            }
        }
        self.f.pools[self.node].give(buf.into_buffer());
        Ok(())
    }
}

impl Rx {
    /// A queued message (a random one when reordering), or the end once every node ended.
    fn take(&self, q: &mut (VecDeque<Received>, usize, u64)) -> Poll<Option<Received>> {
        if !q.0.is_empty() {
            let i = if self.f.reorder {
                q.2 = crate::testing::mix(q.2);
                (q.2 % q.0.len() as u64) as usize
            } else {
                0
            };
            return Poll::Ready(q.0.remove(i));
        }
        if q.1 == self.f.nodes {
            return Poll::Ready(None);
        }
        Poll::Pending
    }
}

impl RecvEndpoint for Rx {
    fn id(&self) -> u32 {
        (self.node * self.f.lanes + self.lane) as u32
    }
    fn get_data(&self) -> Result<Option<Received>> {
        let inbox = &self.f.inboxes[self.node * self.f.lanes + self.lane];
        let start = Instant::now();
        let timeout = Duration::from_millis(300);
        let mut q = inbox.q.lock().unwrap();
        loop {
            if let Poll::Ready(r) = self.take(&mut q) {
                return Ok(r);
            }
            if start.elapsed() > timeout {
                return Err(ShuffleError::Timeout {
                    what: "mock data".into(),
                    waited: start.elapsed(),
                    counts: None,
                });
            }
            q = inbox.cv.wait_timeout(q, timeout).unwrap().0;
        }
    }
    fn try_get_data(&self) -> Result<Poll<Option<Received>>> {
        let inbox = &self.f.inboxes[self.node * self.f.lanes + self.lane];
        Ok(self.take(&mut inbox.q.lock().unwrap()))
    }
    fn release(&self, data: Received) -> Result<()> {
        self.f.pools[self.node].give(data.into_parts().0);
        Ok(())
    }
}

/// Runs `body` on `nodes` nodes (threads) whose flow nets sit on mock endpoints with
/// `lanes` lanes and buffers of `payload_words` payload words; returns each node's
/// result after shutting the nets down.
pub(crate) fn run<T: Send>(
    nodes: usize,
    lanes: usize,
    payload_words: u32,
    reorder: bool,
    config: FlowConfig,
    body: impl Fn(&FlowNet) -> T + Sync,
) -> Vec<T> {
    let net = SimNetwork::new(SimConfig::default());
    let devices: Vec<Arc<dyn Device>> = (0..nodes)
        .map(|_| net.add_node() as Arc<dyn Device>)
        .collect();
    let bytes = 16 + 8 + 8 * payload_words;
    let fabric = Arc::new(Fabric {
        nodes,
        lanes,
        reorder,
        pools: devices
            .iter()
            .map(|d| Arc::new(BufferPool::new(d.clone(), bytes, 16, 1 << 28)))
            .collect(),
        inboxes: (0..nodes * lanes)
            .map(|i| Inbox {
                q: Mutex::new((VecDeque::new(), 0, i as u64 + 1)),
                cv: Condvar::new(),
            })
            .collect(),
    });
    let exchanges = LocalExchange::group(nodes, Duration::from_secs(30));
    std::thread::scope(|s| {
        let hs: Vec<_> = exchanges
            .into_iter()
            .zip(devices)
            .enumerate()
            .map(|(rank, (x, device))| {
                let (fabric, config, body) = (fabric.clone(), config.clone(), &body);
                s.spawn(move || {
                    let node = Arc::new(Node::join(device, Arc::new(x), 1 << 30).unwrap());
                    let opened = Opened {
                        design: Design::ALL[3],
                        rank,
                        senders: (0..lanes)
                            .map(|lane| {
                                Arc::new(Tx {
                                    f: fabric.clone(),
                                    node: rank,
                                    lane,
                                }) as Arc<dyn SendEndpoint>
                            })
                            .collect(),
                        receivers: (0..lanes)
                            .map(|lane| {
                                Arc::new(Rx {
                                    f: fabric.clone(),
                                    node: rank,
                                    lane,
                                }) as Arc<dyn RecvEndpoint>
                            })
                            .collect(),
                    };
                    let flows = FlowNet::new(node, opened, config).unwrap();
                    let out = body(&flows);
                    flows.shutdown().unwrap();
                    out
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flow::*;
    use std::collections::BTreeMap;

    fn schema() -> Schema {
        Schema::new(vec![Column::u64("k"), Column::u64("v")], "k").unwrap()
    }

    /// Tuples `(k, v)` of source `(rank, thread)`.
    fn tuples(rank: usize, thread: usize, n: u64) -> impl Iterator<Item = [u64; 2]> {
        (0..n).map(move |i| {
            [
                crate::testing::mix(i) % 97,
                (rank * 1000 + thread) as u64 * 1_000_000 + i,
            ]
        })
    }

    #[test]
    fn shuffle_survives_reordering_and_small_windows() {
        let (nodes, threads, n) = (3, 2, 500);
        let config = FlowConfig {
            window: 1,
            ..FlowConfig::default()
        };
        let got = run(nodes, 1, 12, true, config, |net| {
            let flow = net
                .declare(
                    FlowSpec::shuffle("s", schema())
                        .sources(all_threads(nodes, threads))
                        .targets(all_threads(nodes, threads)),
                )
                .unwrap();
            std::thread::scope(|s| {
                for t in 0..threads {
                    let mut src = flow.source(t).unwrap();
                    s.spawn(move || {
                        for tu in tuples(net.rank(), t, n) {
                            src.push(&tu).unwrap();
                        }
                        src.close().unwrap();
                    });
                }
                let hs: Vec<_> = (0..threads)
                    .map(|t| {
                        let mut tgt = flow.target(t).unwrap();
                        s.spawn(move || (tgt.index(), tgt.collect_all().unwrap()))
                    })
                    .collect();
                hs.into_iter()
                    .map(|h| h.join().unwrap())
                    .collect::<Vec<_>>()
            })
        });
        let mut owner = BTreeMap::new();
        let mut received = Vec::new();
        for (ti, tuples) in got.into_iter().flatten() {
            for t in tuples {
                // Every key goes to exactly one target.
                assert_eq!(*owner.entry(t[0]).or_insert(ti), ti);
                received.push(t);
            }
        }
        let mut sent: Vec<Vec<u64>> = (0..nodes)
            .flat_map(|r| (0..threads).flat_map(move |t| tuples(r, t, n)))
            .map(|t| t.to_vec())
            .collect();
        sent.sort();
        received.sort();
        assert_eq!(received.len(), sent.len());
        assert!(received == sent);
    }

    #[test]
    fn combiner_sums_under_reordering_with_tiny_tables() {
        let (nodes, threads, n) = (2, 2, 400);
        let config = FlowConfig {
            combiner_entries: 5,
            ..FlowConfig::default()
        };
        let got = run(nodes, 2, 9, true, config, |net| {
            let flow = net
                .declare(
                    FlowSpec::combiner(
                        "c",
                        schema(),
                        vec![Aggregate::sum("v"), Aggregate::count(), Aggregate::max("v")],
                    )
                    .sources(all_threads(nodes, threads))
                    .targets([(0, 0), (1, 1)]),
                )
                .unwrap();
            std::thread::scope(|s| {
                for t in 0..threads {
                    let mut src = flow.source(t).unwrap();
                    s.spawn(move || {
                        for tu in tuples(net.rank(), t, n) {
                            src.push(&tu).unwrap();
                        }
                        src.close().unwrap();
                    });
                }
                let me = if net.rank() == 0 { 0 } else { 1 };
                flow.target(me).unwrap().combined().unwrap()
            })
        });
        let mut want: BTreeMap<u64, (u64, u64, u64)> = BTreeMap::new();
        for r in 0..nodes {
            for t in 0..threads {
                for [k, v] in tuples(r, t, n) {
                    let e = want.entry(k).or_default();
                    e.0 = e.0.wrapping_add(v);
                    e.1 += 1;
                    e.2 = e.2.max(v);
                }
            }
        }
        let mut have = BTreeMap::new();
        for c in got.into_iter().flatten() {
            let [Value::U64(s), Value::U64(n), Value::U64(m)] = c.values[..] else {
                panic!("{c:?}")
            };
            assert!(have.insert(c.key[0], (s, n, m)).is_none());
        }
        assert_eq!(have, want);
    }
}
