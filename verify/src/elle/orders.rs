//! Version orders of list-append keys, and what each read reveals against them.
//!
//! A key's version order is its longest observed list (every compatible read is a
//! prefix of it), keeping only elements of committed transactions: those are the
//! versions other transactions can depend on. A read that ends at element `e` was
//! written by `e`'s appender (wr) and was overwritten by whoever appended the next
//! committed element (rw).

use crate::index::{HistoryIndex, KeyKind, ReadRec, Seen};

/// Where the first element with some defect sits in a key's longest list.
#[derive(Clone, Copy, Default)]
pub struct Defects {
    /// First element appended by a transaction that did not commit.
    pub uncommitted: Option<u32>,
    /// First element no transaction appended.
    pub garbage: Option<u32>,
    /// First element that already appeared earlier in the list.
    pub duplicate: Option<u32>,
}

pub struct ListOrders {
    /// Per key: the committed appends in version order, as write indices.
    pub order: Vec<Vec<u32>>,
    /// Per write: its place in its key's `order`, or `NOT_ORDERED`.
    pub rank: Vec<u32>,
    /// Per key: defects of its longest list.
    pub defects: Vec<Defects>,
}

pub const NOT_ORDERED: u32 = u32::MAX;

impl ListOrders {
    pub fn new(index: &HistoryIndex) -> ListOrders {
        let mut rank = vec![NOT_ORDERED; index.writes.len()];
        let mut seen_at = vec![false; index.writes.len()];
        let mut order = Vec::with_capacity(index.keys.len());
        let mut defects = Vec::with_capacity(index.keys.len());
        for (key, info) in index.keys.iter().enumerate() {
            let mut key_order = Vec::new();
            let mut found = Defects::default();
            if info.kind == KeyKind::List {
                for (at, &element) in info.longest.iter().enumerate() {
                    let at = at as u32;
                    let Some(&w) = index.appends.get(&(key as u32, element)) else {
                        found.garbage.get_or_insert(at);
                        continue;
                    };
                    if std::mem::replace(&mut seen_at[w as usize], true) {
                        found.duplicate.get_or_insert(at);
                        continue;
                    }
                    if index.txns[index.writes[w as usize].txn as usize].committed {
                        rank[w as usize] = key_order.len() as u32;
                        key_order.push(w);
                    } else {
                        found.uncommitted.get_or_insert(at);
                    }
                }
            }
            order.push(key_order);
            defects.push(found);
        }
        ListOrders {
            order,
            rank,
            defects,
        }
    }

    /// The length of a read's snapshot list, if it is a usable prefix of the version
    /// order (detached and register reads are not).
    pub fn prefix_len(read: &ReadRec) -> Option<u32> {
        match read.seen {
            Seen::Absent => Some(0),
            Seen::Prefix(len) => Some(len),
            _ => None,
        }
    }

    /// The write that produced the last element of a read's snapshot.
    pub fn last_write(&self, index: &HistoryIndex, read: &ReadRec) -> Option<u32> {
        let len = Self::prefix_len(read)?;
        let element = *index.keys[read.key as usize]
            .longest
            .get(len.checked_sub(1)? as usize)?;
        index.appends.get(&(read.key, element)).copied()
    }

    /// The committed append that came right after a read's snapshot: the first one if
    /// the read saw nothing. `None` if the snapshot ends the known order, or ends in an
    /// element that is not part of it.
    pub fn next_write(&self, index: &HistoryIndex, read: &ReadRec) -> Option<u32> {
        let order = &self.order[read.key as usize];
        if Self::prefix_len(read)? == 0 {
            return order.first().copied();
        }
        let last = self.last_write(index, read)?;
        let rank = self.rank[last as usize];
        if rank == NOT_ORDERED {
            return None;
        }
        order.get(rank as usize + 1).copied()
    }
}
