//! Finding and classifying dependency cycles.
//!
//! Every cycle lies inside one strongly connected component, so the whole graph is cut
//! into components first (Tarjan), and each component is searched on its own for its
//! most severe kind of cycle, shortest first:
//!
//! 1. G0: components of the ww edges alone; the shortest cycle in one (BFS).
//! 2. G1c: the same over ww and wr edges. Since step 1 found nothing, such a cycle has a
//!    wr edge.
//! 3. G-single: ww and wr edges are now acyclic, so they have a topological order. An
//!    rw edge a→b closes a cycle with no other rw edge exactly when b reaches a over ww
//!    and wr edges, which needs b before a in that order, and the path stays between
//!    the two positions. So only "backward" rw edges are tried, each with a search
//!    fenced to its window: cheap even in a large component of a valid history.
//! 4. G2: every remaining cycle has two or more rw edges; the shortest through a few
//!    backward rw edges is reported, as allowed under snapshot isolation.
//!
//! Each component's search has a work budget; a component that exhausts it before its
//! question is settled is reported as not fully searched rather than silently passed.

use super::graph::{Bfs, EdgeKind, Exhausted, Graph, Kinds, Path, Sccs, topological_positions};
use crate::anomaly::AnomalyKind;

/// Edges examined per component before giving up, plus this much per node.
const BASE_BUDGET: u64 = 20_000_000;
const BUDGET_PER_NODE: u64 = 200;
/// Start nodes tried when looking for the shortest cycle inside a sub-component.
const START_ATTEMPTS: usize = 8;
/// Backward rw edges tried for a G2 example.
const G2_ATTEMPTS: usize = 8;

/// What searching one component gave.
pub enum Outcome {
    Cycle(AnomalyKind, Path),
    /// The budget ran out before the component's worst cycle was settled.
    Incomplete,
}

pub struct CycleFinder<'g> {
    graph: &'g Graph,
    sccs: Sccs,
    bfs: Bfs<'g>,
    /// Which top-level component each node belongs to (`u32::MAX`: none).
    component: Vec<u32>,
    /// Per node: a sub-component stamp, then a topological position.
    scratch: Vec<u32>,
    stamp: u32,
}

impl<'g> CycleFinder<'g> {
    pub fn new(graph: &'g Graph) -> CycleFinder<'g> {
        let n = graph.nodes();
        CycleFinder {
            graph,
            sccs: Sccs::new(n),
            bfs: Bfs::new(graph),
            component: vec![u32::MAX; n],
            scratch: vec![0; n],
            stamp: 0,
        }
    }

    /// The graph's strongly connected components of two or more nodes.
    pub fn components(&mut self) -> Vec<Vec<u32>> {
        let components =
            self.sccs
                .find(self.graph, 0..self.graph.nodes() as u32, Kinds::ALL, |_| {
                    true
                });
        for (c, nodes) in components.iter().enumerate() {
            for &n in nodes {
                self.component[n as usize] = c as u32;
            }
        }
        components
    }

    /// The most severe cycle of component `c` (its `nodes`), shortest of its kind.
    pub fn worst_cycle(&mut self, c: u32, nodes: &[u32]) -> Outcome {
        let mut budget = BASE_BUDGET + BUDGET_PER_NODE * nodes.len() as u64;
        match self.search(c, nodes, &mut budget) {
            Ok(Some(path)) => Outcome::Cycle(classify(self.graph, &path), path),
            Ok(None) | Err(Exhausted) => Outcome::Incomplete,
        }
    }

    fn search(
        &mut self,
        c: u32,
        nodes: &[u32],
        budget: &mut u64,
    ) -> Result<Option<Path>, Exhausted> {
        for kinds in [Kinds::WW, Kinds::WW_WR] {
            if let Some(cycle) = self.shortest_in_subcomponents(c, nodes, kinds, budget)? {
                return Ok(Some(cycle));
            }
        }
        let graph = self.graph;
        let component = &self.component;
        let in_c = |n: u32| component[n as usize] == c;
        let position = &mut self.scratch;
        if topological_positions(graph, nodes, Kinds::WW_WR, position, in_c).is_none() {
            // Steps 1 and 2 would have found the cycle; only a spent budget gets here.
            return Err(Exhausted);
        }
        let mut backward: Vec<(u32, u32, u32, u32)> = Vec::new(); // (window, edge, a, b)
        for &a in nodes {
            for (i, edge) in graph.out(a) {
                if edge.kind == EdgeKind::Rw && in_c(edge.to) {
                    let (pa, pb) = (position[a as usize], position[edge.to as usize]);
                    if pb < pa {
                        backward.push((pa - pb, i, a, edge.to));
                    }
                }
            }
        }
        backward.sort_unstable();
        let position = &*position;
        let g_single =
            shortest_closing(&mut self.bfs, &backward, Kinds::WW_WR, budget, |n, a, b| {
                in_c(n)
                    && (position[b as usize]..=position[a as usize]).contains(&position[n as usize])
            })?;
        if g_single.is_some() {
            return Ok(g_single);
        }
        let tried = &backward[..backward.len().min(G2_ATTEMPTS)];
        shortest_closing(&mut self.bfs, tried, Kinds::ALL, budget, |n, _, _| in_c(n))
    }

    /// The shortest cycle over `kinds` edges within component `c`, trying a few start
    /// nodes of each sub-component those edges form.
    fn shortest_in_subcomponents(
        &mut self,
        c: u32,
        nodes: &[u32],
        kinds: Kinds,
        budget: &mut u64,
    ) -> Result<Option<Path>, Exhausted> {
        let component = &self.component;
        let subs = self
            .sccs
            .find(self.graph, nodes.iter().copied(), kinds, |n| {
                component[n as usize] == c
            });
        let mut best: Option<Path> = None;
        for sub in subs {
            self.stamp = self.stamp.wrapping_add(1);
            let stamp = self.stamp;
            for &n in &sub {
                self.scratch[n as usize] = stamp;
            }
            let scratch = &self.scratch;
            for &start in sub.iter().take(START_ATTEMPTS) {
                let limit = best.as_ref().map_or(usize::MAX, |p| p.len() - 1);
                let path = self
                    .bfs
                    .shortest_path(start, start, kinds, limit, budget, |n| {
                        // `scratch` also holds other components' positions: check both.
                        component[n as usize] == c && scratch[n as usize] == stamp
                    });
                match path {
                    Ok(Some(path)) => best = Some(path),
                    Ok(None) => {}
                    Err(Exhausted) if best.is_some() => return Ok(best),
                    Err(Exhausted) => return Err(Exhausted),
                }
            }
        }
        Ok(best)
    }
}

/// The shortest cycle made of one of the `backward` edges a→b (entries `(window, edge,
/// a, b)`) and a path from b back to a over `kinds` through nodes `in_scope(n, a, b)`
/// accepts. A spent budget still returns the best cycle found, if any.
fn shortest_closing(
    bfs: &mut Bfs,
    backward: &[(u32, u32, u32, u32)],
    kinds: Kinds,
    budget: &mut u64,
    in_scope: impl Fn(u32, u32, u32) -> bool,
) -> Result<Option<Path>, Exhausted> {
    let mut best: Option<Path> = None;
    for &(_, edge, a, b) in backward {
        // A path of at most best - 2 edges closes a strictly shorter cycle.
        let limit = best.as_ref().map_or(usize::MAX, |p| p.len() - 2);
        if limit == 0 {
            break;
        }
        match bfs.shortest_path(b, a, kinds, limit, budget, |n| in_scope(n, a, b)) {
            Ok(Some(path)) => best = Some(std::iter::once(edge).chain(path).collect()),
            Ok(None) => {}
            Err(Exhausted) if best.is_some() => break,
            Err(Exhausted) => return Err(Exhausted),
        }
    }
    Ok(best)
}

/// The anomaly a cycle shows, by its kinds of edges.
pub fn classify(graph: &Graph, cycle: &Path) -> AnomalyKind {
    let count = |kind: EdgeKind| {
        cycle
            .iter()
            .filter(|&&e| graph.edge(e).kind == kind)
            .count()
    };
    match count(EdgeKind::Rw) {
        0 if count(EdgeKind::Wr) == 0 => AnomalyKind::G0,
        0 => AnomalyKind::G1c,
        1 => AnomalyKind::GSingle,
        _ => AnomalyKind::G2,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::elle::graph::tests::graph;
    use EdgeKind::*;

    /// Each component's worst cycle, as (kind, nodes in cycle order).
    fn worst(g: &Graph) -> Vec<(AnomalyKind, Vec<u32>)> {
        let mut finder = CycleFinder::new(g);
        let components = finder.components();
        let mut found: Vec<_> = components
            .iter()
            .enumerate()
            .map(|(c, nodes)| match finder.worst_cycle(c as u32, nodes) {
                Outcome::Cycle(kind, path) => {
                    let mut nodes: Vec<u32> = path.iter().map(|&e| g.source(e)).collect();
                    // Cycles compare by their lowest node first.
                    let lowest = (0..nodes.len()).min_by_key(|&i| nodes[i]).unwrap_or(0);
                    nodes.rotate_left(lowest);
                    (kind, nodes)
                }
                Outcome::Incomplete => panic!("budget exhausted on a tiny graph"),
            })
            .collect();
        found.sort();
        found
    }

    #[test]
    fn the_most_severe_cycle_of_a_component_wins() {
        // One component holding a G2 (0→1→0 by rw, rw) and a G0 (1→2→1 by ww).
        let g = graph(3, &[(0, 1, Rw), (1, 0, Rw), (1, 2, Ww), (2, 1, Ww)]);
        assert_eq!(worst(&g), vec![(AnomalyKind::G0, vec![1, 2])]);
    }

    #[test]
    fn g1c_needs_a_wr_edge_and_no_rw() {
        let g = graph(3, &[(0, 1, Ww), (1, 2, Wr), (2, 0, Ww), (2, 1, Rw)]);
        assert_eq!(worst(&g), vec![(AnomalyKind::G1c, vec![0, 1, 2])]);
    }

    #[test]
    fn g_single_is_found_even_when_a_g2_cycle_is_shorter() {
        // 0→1→0 has two rw edges; 0→1→2→3→0 has one.
        let g = graph(
            4,
            &[(0, 1, Rw), (1, 0, Rw), (1, 2, Wr), (2, 3, Ww), (3, 0, Wr)],
        );
        assert_eq!(worst(&g), vec![(AnomalyKind::GSingle, vec![0, 1, 2, 3])]);
    }

    #[test]
    fn write_skew_alone_is_g2_and_separate_components_report_separately() {
        let g = graph(
            5,
            &[(0, 1, Rw), (1, 0, Rw), (2, 3, Ww), (3, 4, Wr), (4, 2, Rw)],
        );
        assert_eq!(
            worst(&g),
            vec![
                (AnomalyKind::GSingle, vec![2, 3, 4]),
                (AnomalyKind::G2, vec![0, 1])
            ]
        );
    }

    #[test]
    fn acyclic_graphs_have_no_components() {
        let g = graph(4, &[(0, 1, Ww), (1, 2, Wr), (0, 2, Rw), (2, 3, Rw)]);
        assert!(worst(&g).is_empty());
    }
}
