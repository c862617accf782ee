//! The dependency graph and the searches over it: Tarjan's strongly connected
//! components, breadth-first shortest paths and a topological order, each restricted to
//! some edge kinds and some nodes, and each reusing its buffers across calls so a
//! search inside one small component costs only that component.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};

/// What a dependency edge says about its two transactions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum EdgeKind {
    /// Write-write: the target overwrote (appended after) the source's write.
    Ww,
    /// Write-read: the target read the source's write.
    Wr,
    /// Read-write anti-dependency: the source read a state the target then overwrote.
    Rw,
}

impl EdgeKind {
    pub fn name(self) -> &'static str {
        match self {
            EdgeKind::Ww => "ww",
            EdgeKind::Wr => "wr",
            EdgeKind::Rw => "rw",
        }
    }
}

/// A set of edge kinds a search may follow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Kinds(u8);

impl Kinds {
    pub const WW: Kinds = Kinds(1);
    pub const WW_WR: Kinds = Kinds(1 | 2);
    pub const ALL: Kinds = Kinds(1 | 2 | 4);

    fn contains(self, kind: EdgeKind) -> bool {
        self.0 & (1 << kind as u8) != 0
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Edge {
    pub to: u32,
    /// The key whose operations imply the edge.
    pub key: u32,
    pub kind: EdgeKind,
}

/// Adjacency in compressed sparse rows: node `n`'s edges are
/// `edges[offsets[n]..offsets[n + 1]]`. One edge per (from, to, kind).
pub struct Graph {
    offsets: Vec<u32>,
    edges: Vec<Edge>,
}

/// A path or cycle: the global indices of its edges, in order.
pub type Path = Vec<u32>;

impl Graph {
    pub fn new(nodes: usize, mut edges: Vec<(u32, Edge)>) -> Graph {
        edges.sort_unstable_by_key(|(from, e)| (*from, e.to, e.kind));
        edges.dedup_by_key(|(from, e)| (*from, e.to, e.kind));
        let mut offsets = vec![0u32; nodes + 1];
        for (from, _) in &edges {
            offsets[*from as usize + 1] += 1;
        }
        for n in 0..nodes {
            offsets[n + 1] += offsets[n];
        }
        Graph {
            offsets,
            edges: edges.into_iter().map(|(_, e)| e).collect(),
        }
    }

    pub fn nodes(&self) -> usize {
        self.offsets.len() - 1
    }

    pub fn edge_count(&self) -> usize {
        self.edges.len()
    }

    /// Node `n`'s outgoing edges with their global indices.
    pub fn out(&self, n: u32) -> impl Iterator<Item = (u32, &Edge)> {
        let (start, end) = (self.offsets[n as usize], self.offsets[n as usize + 1]);
        (start..end).map(move |i| (i, &self.edges[i as usize]))
    }

    pub fn edge(&self, i: u32) -> &Edge {
        &self.edges[i as usize]
    }

    /// The node edge `i` leaves.
    pub fn source(&self, i: u32) -> u32 {
        (self.offsets.partition_point(|&start| start <= i) - 1) as u32
    }
}

const UNVISITED: u32 = u32::MAX;

/// Tarjan's algorithm, iterative so that a million-node chain cannot overflow the stack.
pub struct Sccs {
    index: Vec<u32>,
    low: Vec<u32>,
    on_stack: Vec<bool>,
    stack: Vec<u32>,
    calls: Vec<(u32, u32)>,
    touched: Vec<u32>,
}

impl Sccs {
    pub fn new(nodes: usize) -> Sccs {
        Sccs {
            index: vec![UNVISITED; nodes],
            low: vec![0; nodes],
            on_stack: vec![false; nodes],
            stack: Vec::new(),
            calls: Vec::new(),
            touched: Vec::new(),
        }
    }

    /// The components with two or more nodes among those reachable from `roots` over
    /// edges of `kinds` between nodes `in_scope` accepts. (No edge joins a node to
    /// itself, so single nodes are never cycles.)
    pub fn find(
        &mut self,
        graph: &Graph,
        roots: impl IntoIterator<Item = u32>,
        kinds: Kinds,
        in_scope: impl Fn(u32) -> bool,
    ) -> Vec<Vec<u32>> {
        let mut found = Vec::new();
        let mut next_index = 0u32;
        for root in roots {
            if self.index[root as usize] != UNVISITED {
                continue;
            }
            self.enter(root, graph.offsets[root as usize], &mut next_index);
            while let Some(&(v, cursor)) = self.calls.last() {
                let end = graph.offsets[v as usize + 1];
                let mut cursor = cursor;
                let mut descended = false;
                while cursor < end {
                    let edge = graph.edges[cursor as usize];
                    cursor += 1;
                    if !kinds.contains(edge.kind) || !in_scope(edge.to) {
                        continue;
                    }
                    let w = edge.to as usize;
                    if self.index[w] == UNVISITED {
                        self.calls.last_mut().expect("v is on the call stack").1 = cursor;
                        self.enter(edge.to, graph.offsets[w], &mut next_index);
                        descended = true;
                        break;
                    } else if self.on_stack[w] {
                        self.low[v as usize] = self.low[v as usize].min(self.index[w]);
                    }
                }
                if descended {
                    continue;
                }
                self.calls.pop();
                if let Some(&(parent, _)) = self.calls.last() {
                    self.low[parent as usize] = self.low[parent as usize].min(self.low[v as usize]);
                }
                if self.low[v as usize] == self.index[v as usize] {
                    let mut component = Vec::new();
                    loop {
                        let w = self.stack.pop().expect("v is on the stack");
                        self.on_stack[w as usize] = false;
                        component.push(w);
                        if w == v {
                            break;
                        }
                    }
                    if component.len() > 1 {
                        found.push(component);
                    }
                }
            }
        }
        for &n in &self.touched {
            self.index[n as usize] = UNVISITED;
        }
        self.touched.clear();
        found
    }

    /// Pushes `v` as visited, its edges to be scanned from `first_edge`.
    fn enter(&mut self, v: u32, first_edge: u32, next_index: &mut u32) {
        self.index[v as usize] = *next_index;
        self.low[v as usize] = *next_index;
        *next_index += 1;
        self.on_stack[v as usize] = true;
        self.stack.push(v);
        self.calls.push((v, first_edge));
        self.touched.push(v);
    }
}

/// Breadth-first search for shortest paths.
pub struct Bfs<'g> {
    graph: &'g Graph,
    /// The edge by which a node was first reached in the current search.
    via: Vec<u32>,
    stamp: Vec<u32>,
    current: u32,
    queue: VecDeque<(u32, u32)>,
}

/// Whether a search ran out of its work budget.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Exhausted;

impl<'g> Bfs<'g> {
    pub fn new(graph: &'g Graph) -> Bfs<'g> {
        let nodes = graph.nodes();
        Bfs {
            graph,
            via: vec![0; nodes],
            stamp: vec![0; nodes],
            current: 0,
            queue: VecDeque::new(),
        }
    }

    /// The shortest path from `from` to `to` (which may be `from` itself, for a cycle)
    /// of at most `max_edges` edges of `kinds` through nodes `in_scope` accepts.
    /// Each edge examined costs one unit of `budget`.
    pub fn shortest_path(
        &mut self,
        from: u32,
        to: u32,
        kinds: Kinds,
        max_edges: usize,
        budget: &mut u64,
        in_scope: impl Fn(u32) -> bool,
    ) -> Result<Option<Path>, Exhausted> {
        self.current = self.current.wrapping_add(1);
        if self.current == 0 {
            self.stamp.fill(0);
            self.current = 1;
        }
        let graph = self.graph;
        self.queue.clear();
        self.queue.push_back((from, 0));
        self.stamp[from as usize] = self.current;
        while let Some((node, depth)) = self.queue.pop_front() {
            if depth as usize >= max_edges {
                break;
            }
            for (i, edge) in graph.out(node) {
                if *budget == 0 {
                    return Err(Exhausted);
                }
                *budget -= 1;
                if !kinds.contains(edge.kind) {
                    continue;
                }
                if edge.to == to {
                    let mut path = vec![i];
                    let mut at = node;
                    while at != from {
                        let back = self.via[at as usize];
                        path.push(back);
                        at = graph.source(back);
                    }
                    path.reverse();
                    return Ok(Some(path));
                }
                let next = edge.to as usize;
                if self.stamp[next] == self.current || !in_scope(edge.to) {
                    continue;
                }
                self.stamp[next] = self.current;
                self.via[next] = i;
                self.queue.push_back((edge.to, depth + 1));
            }
        }
        Ok(None)
    }
}

/// A topological order of `nodes` over edges of `kinds` between them, preferring lower
/// node numbers (history order, close to commit order) so that the edges against it
/// are few and short. `None` if those edges form a cycle.
pub fn topological_positions(
    graph: &Graph,
    nodes: &[u32],
    kinds: Kinds,
    position: &mut [u32],
    in_scope: impl Fn(u32) -> bool,
) -> Option<()> {
    for &n in nodes {
        position[n as usize] = 0;
    }
    // `position` doubles as the in-degree count until a node is placed.
    for &n in nodes {
        for (_, edge) in graph.out(n) {
            if kinds.contains(edge.kind) && in_scope(edge.to) {
                position[edge.to as usize] += 1;
            }
        }
    }
    let mut ready: BinaryHeap<Reverse<u32>> = nodes
        .iter()
        .copied()
        .filter(|&n| position[n as usize] == 0)
        .map(Reverse)
        .collect();
    let mut placed = Vec::with_capacity(nodes.len());
    while let Some(Reverse(n)) = ready.pop() {
        placed.push(n);
        for (_, edge) in graph.out(n) {
            if kinds.contains(edge.kind) && in_scope(edge.to) {
                let degree = &mut position[edge.to as usize];
                *degree -= 1;
                if *degree == 0 {
                    ready.push(Reverse(edge.to));
                }
            }
        }
    }
    if placed.len() < nodes.len() {
        return None;
    }
    for (at, n) in placed.into_iter().enumerate() {
        position[n as usize] = at as u32;
    }
    Some(())
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// A graph from (from, to, kind) triples, all on key 0.
    pub(in crate::elle) fn graph(nodes: usize, edges: &[(u32, u32, EdgeKind)]) -> Graph {
        Graph::new(
            nodes,
            edges
                .iter()
                .map(|&(from, to, kind)| (from, Edge { to, key: 0, kind }))
                .collect(),
        )
    }

    use EdgeKind::*;

    #[test]
    fn duplicate_edges_collapse_and_sources_are_found() {
        let g = graph(3, &[(0, 1, Ww), (0, 1, Ww), (0, 1, Rw), (2, 0, Wr)]);
        assert_eq!(g.edge_count(), 3);
        assert_eq!(g.out(0).count(), 2);
        assert_eq!(g.out(1).count(), 0);
        assert_eq!(g.source(2), 2);
        assert_eq!(g.source(1), 0);
    }

    #[test]
    fn tarjan_finds_each_cycle_and_only_cycles() {
        // 0→1→2→0 is a cycle; 3→4 and 4→3 one more; 5 hangs off 2.
        let g = graph(
            6,
            &[
                (0, 1, Ww),
                (1, 2, Wr),
                (2, 0, Rw),
                (3, 4, Ww),
                (4, 3, Ww),
                (2, 5, Ww),
            ],
        );
        let mut sccs = Sccs::new(6);
        let mut found = sccs.find(&g, 0..6, Kinds::ALL, |_| true);
        for c in &mut found {
            c.sort();
        }
        found.sort();
        assert_eq!(found, vec![vec![0, 1, 2], vec![3, 4]]);
        // Without rw edges the first cycle is gone; the buffers are reusable.
        let found = sccs.find(&g, 0..6, Kinds::WW_WR, |_| true);
        assert_eq!(found, vec![vec![4, 3]]);
        let found = sccs.find(&g, 0..6, Kinds::ALL, |n| n != 1);
        assert_eq!(found.len(), 1);
    }

    #[test]
    fn tarjan_survives_a_long_chain() {
        let n = 200_000u32;
        let mut edges: Vec<(u32, u32, EdgeKind)> = (0..n - 1).map(|i| (i, i + 1, Ww)).collect();
        edges.push((n - 1, 0, Rw));
        let g = graph(n as usize, &edges);
        let found = Sccs::new(n as usize).find(&g, 0..n, Kinds::ALL, |_| true);
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].len(), n as usize);
    }

    #[test]
    fn bfs_finds_the_shortest_cycle_and_respects_limits() {
        // Long way 0→1→2→3→0, short way 0→4→0 via rw.
        let g = graph(
            5,
            &[
                (0, 1, Ww),
                (1, 2, Ww),
                (2, 3, Ww),
                (3, 0, Ww),
                (0, 4, Wr),
                (4, 0, Rw),
            ],
        );
        let mut bfs = Bfs::new(&g);
        let mut budget = 1000;
        let path = bfs
            .shortest_path(0, 0, Kinds::ALL, 10, &mut budget, |_| true)
            .expect("in budget")
            .expect("a cycle");
        assert_eq!(
            path.iter().map(|&e| g.source(e)).collect::<Vec<_>>(),
            vec![0, 4]
        );
        let path = bfs
            .shortest_path(0, 0, Kinds::WW, 10, &mut budget, |_| true)
            .expect("in budget")
            .expect("a cycle");
        assert_eq!(path.len(), 4);
        let too_short = bfs.shortest_path(0, 0, Kinds::WW, 3, &mut budget, |_| true);
        assert_eq!(too_short, Ok(None));
        let fenced = bfs.shortest_path(0, 0, Kinds::WW, 10, &mut budget, |n| n != 2);
        assert_eq!(fenced, Ok(None));
        let mut tiny = 2;
        assert_eq!(
            bfs.shortest_path(0, 0, Kinds::WW, 10, &mut tiny, |_| true),
            Err(Exhausted)
        );
    }

    #[test]
    fn topological_order_prefers_low_numbers_and_detects_cycles() {
        let g = graph(4, &[(3, 0, Ww), (1, 2, Wr), (2, 1, Rw)]);
        let mut position = vec![0; 4];
        topological_positions(&g, &[0, 1, 2, 3], Kinds::WW_WR, &mut position, |_| true)
            .expect("acyclic without rw");
        assert_eq!(position, vec![3, 0, 1, 2]);
        assert!(
            topological_positions(&g, &[0, 1, 2, 3], Kinds::ALL, &mut position, |_| true).is_none()
        );
    }
}
