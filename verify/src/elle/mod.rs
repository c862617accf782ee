//! The black-box checker, in the style of Elle (Kingsbury and Alvaro, VLDB 2020): it
//! trusts nothing but values.
//!
//! On list-append keys the appended lists reveal each key's version order
//! ([`orders`]). From it come the dependencies between committed transactions:
//!
//! - ww: consecutive appends in a key's version order, writer to next writer;
//! - wr: the writer of the last element a read returned, to the reader;
//! - rw: the reader, to the writer of the element right after what it read.
//!
//! Reads alone show G1a (a committed read of an aborted append), G1b (a read ending
//! in an element its writer followed with another append to the key), duplicated
//! elements and garbage. Cycles of the dependency graph ([`cycles`]) show G0, G1c,
//! G-single and G2; snapshot isolation forbids all of these but G2 (write skew).
//!
//! Transactions of unknown outcome count as committed once a read observed their
//! writes (decided while indexing). Registers reveal no version order, so they are
//! left to the white-box checker (or, without timestamps, to [`crate::registers`]).

mod cycles;
mod explain;
mod graph;
mod orders;

use crate::anomaly::{AnomalyKind, Explained, Findings, show_list};
use crate::index::{HistoryIndex, KeyKind};
use cycles::{CycleFinder, Outcome};
use graph::{Edge, EdgeKind, Graph};
use orders::ListOrders;

/// What the black-box checker covered.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ElleSummary {
    pub list_keys: u64,
    pub edges: u64,
    /// Strongly connected components (of two or more transactions).
    pub components: u64,
    pub largest_component: u64,
    /// Components whose search ran out of budget, with their sizes.
    pub incomplete: Vec<u64>,
}

pub fn check(index: &HistoryIndex, findings: &mut Findings) -> ElleSummary {
    let orders = ListOrders::new(index);
    let mut edges = write_write_edges(index, &orders);
    read_edges_and_anomalies(index, &orders, &mut edges, findings);
    let graph = Graph::new(index.txns.len(), edges);

    let mut summary = ElleSummary {
        list_keys: index
            .keys
            .iter()
            .filter(|k| k.kind == KeyKind::List)
            .count() as u64,
        edges: graph.edge_count() as u64,
        ..ElleSummary::default()
    };
    let mut finder = CycleFinder::new(&graph);
    let components = finder.components();
    summary.components = components.len() as u64;
    for (c, nodes) in components.iter().enumerate() {
        summary.largest_component = summary.largest_component.max(nodes.len() as u64);
        match finder.worst_cycle(c as u32, nodes) {
            Outcome::Cycle(kind, cycle) => findings.add(kind, || {
                explain::explain_cycle(index, &orders, &graph, kind, &cycle)
            }),
            Outcome::Incomplete => summary.incomplete.push(nodes.len() as u64),
        }
    }
    summary
}

fn write_write_edges(index: &HistoryIndex, orders: &ListOrders) -> Vec<(u32, Edge)> {
    let mut edges = Vec::new();
    for (key, order) in orders.order.iter().enumerate() {
        for pair in order.windows(2) {
            let (a, b) = (
                index.writes[pair[0] as usize].txn,
                index.writes[pair[1] as usize].txn,
            );
            if a != b {
                let key = key as u32;
                edges.push((
                    a,
                    Edge {
                        to: b,
                        key,
                        kind: EdgeKind::Ww,
                    },
                ));
            }
        }
    }
    edges
}

/// The wr and rw edges of every committed read, and the anomalies a read shows alone.
fn read_edges_and_anomalies(
    index: &HistoryIndex,
    orders: &ListOrders,
    edges: &mut Vec<(u32, Edge)>,
    findings: &mut Findings,
) {
    for read in &index.reads {
        let reader = read.txn;
        if !index.txns[reader as usize].committed
            || index.keys[read.key as usize].kind != KeyKind::List
        {
            continue;
        }
        let Some(len) = ListOrders::prefix_len(read) else {
            continue;
        };
        let key = read.key;
        let defects = orders.defects[key as usize];
        let longest = &index.keys[key as usize].longest;
        let seen = &longest[..len as usize];
        let name = index.key_name(key);
        let explain_element = |at: u32, what: &str| {
            let element = longest[at as usize];
            Explained::new(
                format!(
                    "{} read {name}={} but {element} {what}",
                    index.label(reader),
                    show_list(seen)
                ),
                vec![index.txns[reader as usize].id],
            )
        };
        if let Some(at) = defects.uncommitted.filter(|&at| at < len) {
            findings.add(AnomalyKind::G1a, || {
                let element = longest[at as usize];
                let writer = index.appender(key, element).map_or(reader, |w| w.txn);
                explain_element(
                    at,
                    &format!("was appended by {}, which aborted", index.label(writer)),
                )
            });
        }
        if let Some(at) = defects.garbage.filter(|&at| at < len) {
            findings.add(AnomalyKind::GarbageRead, || {
                explain_element(at, "was never appended by any transaction")
            });
        }
        if let Some(at) = defects.duplicate.filter(|&at| at < len) {
            findings.add(AnomalyKind::DuplicateElements, || {
                explain_element(at, "appears twice")
            });
        }
        if let Some(w) = orders.last_write(index, read) {
            let write = &index.writes[w as usize];
            let writer = write.txn;
            if writer != reader && index.txns[writer as usize].committed {
                edges.push((
                    writer,
                    Edge {
                        to: reader,
                        key,
                        kind: EdgeKind::Wr,
                    },
                ));
                if !write.last_in_txn {
                    findings.add(AnomalyKind::G1b, || {
                        let later = index
                            .txn_writes(writer)
                            .iter()
                            .skip_while(|x| !(x.key == key && x.value == write.value))
                            .find(|x| x.key == key && x.value != write.value)
                            .map_or(String::new(), |x| format!(" {}", x.value));
                        Explained::new(
                            format!(
                                "{} read {name}={}, ending at {}, an intermediate state of {}, \
                                 which then appended{later} to {name}",
                                index.label(reader),
                                show_list(seen),
                                write.value,
                                index.label(writer)
                            ),
                            vec![
                                index.txns[reader as usize].id,
                                index.txns[writer as usize].id,
                            ],
                        )
                    });
                }
            }
        }
        if let Some(w) = orders.next_write(index, read) {
            let writer = index.writes[w as usize].txn;
            if writer != reader {
                edges.push((
                    reader,
                    Edge {
                        to: writer,
                        key,
                        kind: EdgeKind::Rw,
                    },
                ));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::history::{Status, Txn};
    use crate::index::tests::{append, r, rl, txn};
    use Status::*;

    fn run(txns: Vec<Txn>) -> (Findings, ElleSummary) {
        let index = HistoryIndex::from_txns(txns).expect("indexes");
        let mut findings = Findings::default();
        let summary = check(&index, &mut findings);
        (findings, summary)
    }

    fn kinds(findings: &Findings) -> Vec<(AnomalyKind, u64)> {
        findings.iter().map(|(k, f)| (k, f.count)).collect()
    }

    fn example(findings: &Findings, kind: AnomalyKind) -> crate::anomaly::Anomaly {
        findings
            .iter()
            .find(|(k, _)| *k == kind)
            .expect("kind found")
            .1
            .examples[0]
            .clone()
    }

    #[test]
    fn a_serial_history_is_clean() {
        let (findings, summary) = run(vec![
            txn(1, Committed, vec![rl("x", &[]), append("x", 1)]),
            txn(
                2,
                Committed,
                vec![rl("x", &[1]), append("x", 2), append("y", 1)],
            ),
            txn(3, Aborted, vec![append("x", 9)]),
            txn(4, Committed, vec![rl("x", &[1, 2]), rl("y", &[1])]),
        ]);
        assert!(findings.is_empty(), "{:?}", kinds(&findings));
        assert_eq!(summary.components, 0);
        // T1 -ww,wr-> T2 -wr-> T4 (one edge per kind and pair, whatever the key).
        assert_eq!(summary.edges, 3, "{summary:?}");
    }

    #[test]
    fn g0_write_cycle() {
        // T1 and T2 append to x and y in opposite orders.
        let (findings, _) = run(vec![
            txn(1, Committed, vec![append("x", 1), append("y", 2)]),
            txn(2, Committed, vec![append("x", 2), append("y", 1)]),
            txn(3, Committed, vec![rl("x", &[1, 2]), rl("y", &[1, 2])]),
        ]);
        assert_eq!(kinds(&findings), vec![(AnomalyKind::G0, 1)]);
        let g0 = example(&findings, AnomalyKind::G0);
        assert!(
            g0.summary.contains("forbidden under snapshot isolation"),
            "{}",
            g0.summary
        );
        assert!(
            g0.details.contains(
                &"T1 -ww(x)-> T2: T2 appended 2 right after T1's 1 in x's version order".into()
            ),
            "{:?}",
            g0.details
        );
    }

    #[test]
    fn g1a_aborted_read() {
        let (findings, _) = run(vec![
            txn(1, Aborted, vec![append("x", 1)]),
            txn(2, Committed, vec![rl("x", &[1])]),
        ]);
        assert_eq!(kinds(&findings), vec![(AnomalyKind::G1a, 1)]);
        assert_eq!(
            example(&findings, AnomalyKind::G1a).summary,
            "T2 read x=[1] but 1 was appended by T1, which aborted"
        );
    }

    #[test]
    fn g1b_intermediate_read() {
        let (findings, _) = run(vec![
            txn(1, Committed, vec![append("x", 1), append("x", 2)]),
            txn(2, Committed, vec![rl("x", &[1])]),
            txn(3, Committed, vec![rl("x", &[1, 2])]),
        ]);
        // Reading T1's intermediate state also puts T2 both after T1 (wr) and before it
        // (rw): a cycle with one anti-dependency.
        assert_eq!(
            kinds(&findings),
            vec![(AnomalyKind::G1b, 1), (AnomalyKind::GSingle, 1)]
        );
        assert_eq!(
            example(&findings, AnomalyKind::G1b).summary,
            "T2 read x=[1], ending at 1, an intermediate state of T1, which then appended 2 to x"
        );
    }

    #[test]
    fn g1c_circular_information_flow() {
        // T1 reads T2's append to y, T2 reads T1's append to x.
        let (findings, _) = run(vec![
            txn(1, Committed, vec![append("x", 1), rl("y", &[1])]),
            txn(2, Committed, vec![append("y", 1), rl("x", &[1])]),
        ]);
        assert_eq!(kinds(&findings), vec![(AnomalyKind::G1c, 1)]);
        let g1c = example(&findings, AnomalyKind::G1c);
        assert!(
            g1c.details.contains(
                &"T1 -wr(x)-> T2: T2 read x=[1] whose last element 1 was appended by T1".into()
            ),
            "{:?}",
            g1c.details
        );
    }

    #[test]
    fn g_single_lost_update() {
        // Both read x=[1] and appended: T3's read shows T1's 2 came first.
        let (findings, _) = run(vec![
            txn(1, Committed, vec![rl("x", &[]), append("x", 1)]),
            txn(2, Committed, vec![rl("x", &[1]), append("x", 2)]),
            txn(3, Committed, vec![rl("x", &[1]), append("x", 3)]),
            txn(4, Committed, vec![rl("x", &[1, 2, 3])]),
        ]);
        assert_eq!(kinds(&findings), vec![(AnomalyKind::GSingle, 1)]);
        let g = example(&findings, AnomalyKind::GSingle);
        assert_eq!(
            g.summary,
            "2 transactions: T3 -rw(x)-> T2 -ww(x)-> T3 (forbidden under snapshot isolation)"
        );
        assert_eq!(
            g.details[0],
            "T3 -rw(x)-> T2: T3 read x=[1] and T2 appended 2, the element right after 1"
        );
    }

    #[test]
    fn g2_write_skew_is_reported_as_allowed() {
        let (findings, _) = run(vec![
            txn(1, Committed, vec![rl("x", &[]), append("y", 1)]),
            txn(2, Committed, vec![rl("y", &[]), append("x", 1)]),
            txn(3, Committed, vec![rl("x", &[1]), rl("y", &[1])]),
        ]);
        assert_eq!(kinds(&findings), vec![(AnomalyKind::G2, 1)]);
        assert!(!findings.violates_si());
        let g2 = example(&findings, AnomalyKind::G2);
        assert!(
            g2.summary.ends_with("(allowed under snapshot isolation)"),
            "{}",
            g2.summary
        );
        assert!(
            g2.details
                .iter()
                .any(|d| d.ends_with("T1 read x=[] and T2 appended 1, the first element of x")),
            "{:?}",
            g2.details
        );
    }

    #[test]
    fn garbage_and_duplicates_are_caught() {
        let (findings, _) = run(vec![
            txn(1, Committed, vec![append("x", 1)]),
            txn(2, Committed, vec![rl("x", &[1, 1])]),
            txn(3, Committed, vec![rl("y", &[5])]),
        ]);
        assert_eq!(
            kinds(&findings),
            vec![
                (AnomalyKind::DuplicateElements, 1),
                (AnomalyKind::GarbageRead, 1)
            ]
        );
    }

    #[test]
    fn observed_unknown_transactions_take_part() {
        // T1's outcome is unknown, but T2 saw its append: T1 committed, and the cycle
        // through it is real.
        let (findings, _) = run(vec![
            txn(1, Unknown, vec![append("x", 1), rl("y", &[1])]),
            txn(2, Committed, vec![append("y", 1), rl("x", &[1])]),
            txn(3, Unknown, vec![append("z", 1)]),
            txn(4, Committed, vec![rl("z", &[])]),
        ]);
        assert_eq!(kinds(&findings), vec![(AnomalyKind::G1c, 1)]);
    }

    #[test]
    fn registers_are_left_alone() {
        let (findings, summary) = run(vec![txn(
            1,
            Committed,
            vec![r("k", crate::history::ReadValue::Register(3))],
        )]);
        assert!(findings.is_empty());
        assert_eq!(summary.list_keys, 0);
    }
}
