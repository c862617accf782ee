//! Explaining a dependency cycle edge by edge, from the operations that imply each edge,
//! e.g. "T3 -wr(x)-> T7: T7 read x=[1, 2, 3] whose last element 3 was appended by T3".

use super::graph::{EdgeKind, Graph, Path};
use super::orders::{ListOrders, NOT_ORDERED};
use crate::anomaly::{AnomalyKind, Explained, show_list};
use crate::index::HistoryIndex;

pub fn explain_cycle(
    index: &HistoryIndex,
    orders: &ListOrders,
    graph: &Graph,
    kind: AnomalyKind,
    cycle: &Path,
) -> Explained {
    let mut chain = String::new();
    let mut details = Vec::with_capacity(cycle.len());
    let mut txns = Vec::with_capacity(cycle.len());
    for &e in cycle {
        let from = graph.source(e);
        let edge = graph.edge(e);
        let arrow = format!("-{}({})->", edge.kind.name(), index.key_name(edge.key));
        if chain.is_empty() {
            chain = index.label(from);
        }
        chain = format!("{chain} {arrow} {}", index.label(edge.to));
        details.push(format!(
            "{} {arrow} {}: {}",
            index.label(from),
            index.label(edge.to),
            why(index, orders, from, edge.to, edge.key, edge.kind)
        ));
        txns.push(index.txns[from as usize].id);
    }
    let verdict = if kind.allowed_under_si() {
        "allowed under snapshot isolation"
    } else {
        "forbidden under snapshot isolation"
    };
    Explained {
        summary: format!("{} transactions: {chain} ({verdict})", cycle.len()),
        details,
        txns,
    }
}

/// The operations that put an edge of `kind` on `key` from `from` to `to`.
fn why(
    index: &HistoryIndex,
    orders: &ListOrders,
    from: u32,
    to: u32,
    key: u32,
    kind: EdgeKind,
) -> String {
    let name = index.key_name(key);
    let (a, b) = (index.label(from), index.label(to));
    let found = match kind {
        EdgeKind::Ww => index
            .txn_writes(from)
            .iter()
            .enumerate()
            .find_map(|(i, write)| {
                let w = index.txns[from as usize].writes.0 + i as u32;
                let rank = orders.rank[w as usize];
                if write.key != key || rank == NOT_ORDERED {
                    return None;
                }
                let next = *orders.order[key as usize].get(rank as usize + 1)?;
                let next = &index.writes[next as usize];
                (next.txn == to).then(|| {
                    format!(
                        "{b} appended {} right after {a}'s {} in {name}'s version order",
                        next.value, write.value
                    )
                })
            }),
        EdgeKind::Wr => index.txn_reads(to).iter().find_map(|read| {
            let w = orders.last_write(index, read).filter(|_| read.key == key)?;
            let write = &index.writes[w as usize];
            (write.txn == from).then(|| {
                format!(
                    "{b} read {name}={} whose last element {} was appended by {a}",
                    show_list(index.snapshot_list(read).unwrap_or(&[])),
                    write.value
                )
            })
        }),
        EdgeKind::Rw => index.txn_reads(from).iter().find_map(|read| {
            let w = orders.next_write(index, read).filter(|_| read.key == key)?;
            let write = &index.writes[w as usize];
            if write.txn != to {
                return None;
            }
            let seen = index.snapshot_list(read).unwrap_or(&[]);
            Some(match seen.last() {
                Some(last) => format!(
                    "{a} read {name}={} and {b} appended {}, the element right after {last}",
                    show_list(seen),
                    write.value
                ),
                None => format!(
                    "{a} read {name}=[] and {b} appended {}, the first element of {name}",
                    write.value
                ),
            })
        }),
    };
    found.unwrap_or_else(|| format!("{a} {} {b} on {name}", kind.name()))
}
