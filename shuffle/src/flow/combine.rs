//! The aggregates of a combiner flow.
//!
//! Every aggregate is decomposable with a partial state of one word that has the final
//! value's type: a source folds its tuples into partials per key, a target merges the
//! partials of all sources with the same function (COUNT's partials are summed).

use super::schema::{ColumnType, Schema, Value};
use std::collections::HashMap;
use std::fmt;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Agg {
    Sum,
    Count,
    Min,
    Max,
}

/// One aggregate of a combiner flow: `op` over a value column (none for COUNT).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Aggregate {
    pub op: Agg,
    pub column: Option<String>,
}

impl Aggregate {
    pub fn sum(column: &str) -> Aggregate {
        Aggregate {
            op: Agg::Sum,
            column: Some(column.into()),
        }
    }
    pub fn count() -> Aggregate {
        Aggregate {
            op: Agg::Count,
            column: None,
        }
    }
    pub fn min(column: &str) -> Aggregate {
        Aggregate {
            op: Agg::Min,
            column: Some(column.into()),
        }
    }
    pub fn max(column: &str) -> Aggregate {
        Aggregate {
            op: Agg::Max,
            column: Some(column.into()),
        }
    }
}

impl fmt::Display for Aggregate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:?}({})",
            self.op,
            self.column.as_deref().unwrap_or("*")
        )
    }
}

/// An aggregate resolved against a schema.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Resolved {
    op: Agg,
    /// Word offset of the input column (unused for COUNT).
    at: usize,
    /// The type of the partial and final value.
    ty: ColumnType,
}

impl Resolved {
    pub(crate) fn resolve(schema: &Schema, aggs: &[Aggregate]) -> Result<Vec<Resolved>, String> {
        if aggs.is_empty() {
            return Err("a combiner flow needs at least one aggregate".into());
        }
        aggs.iter()
            .map(|a| match (&a.op, &a.column) {
                (Agg::Count, _) => Ok(Resolved {
                    op: Agg::Count,
                    at: 0,
                    ty: ColumnType::U64,
                }),
                (op, None) => Err(format!("{op:?} needs a column")),
                (op, Some(name)) => {
                    let c = schema
                        .column(name)
                        .ok_or_else(|| format!("{a}: no column {name:?}"))?;
                    let ty = schema.columns()[c].ty;
                    if let ColumnType::Bytes(_) = ty {
                        return Err(format!("{a}: cannot aggregate the byte column {name:?}"));
                    }
                    Ok(Resolved {
                        op: *op,
                        at: schema.offset(c),
                        ty,
                    })
                }
            })
            .collect()
    }

    /// The partial of one input tuple.
    #[inline]
    fn init(&self, tuple: &[u64]) -> u64 {
        match self.op {
            Agg::Count => 1,
            _ => tuple[self.at],
        }
    }

    /// Two partials merged.
    #[inline]
    fn merge(&self, a: u64, b: u64) -> u64 {
        match (self.op, self.ty) {
            (Agg::Count, _) => a.wrapping_add(b),
            (Agg::Sum, ColumnType::F64) => (f64::from_bits(a) + f64::from_bits(b)).to_bits(),
            // Wrapping two's complement addition is the same for u64 and i64.
            (Agg::Sum, _) => a.wrapping_add(b),
            (Agg::Min, ColumnType::U64) => a.min(b),
            (Agg::Max, ColumnType::U64) => a.max(b),
            (Agg::Min, ColumnType::I64) => (a as i64).min(b as i64) as u64,
            (Agg::Max, ColumnType::I64) => (a as i64).max(b as i64) as u64,
            (Agg::Min, ColumnType::F64) => f64::from_bits(a).min(f64::from_bits(b)).to_bits(),
            (Agg::Max, ColumnType::F64) => f64::from_bits(a).max(f64::from_bits(b)).to_bits(),
            (_, ColumnType::Bytes(_)) => unreachable!("rejected at declaration"),
        }
    }
}

/// Partials per key: what a combiner source folds into and a target merges into.
pub(crate) struct Table {
    aggs: Vec<Resolved>,
    key_words: usize,
    map: HashMap<Vec<u64>, Vec<u64>>,
}

impl Table {
    pub(crate) fn new(aggs: Vec<Resolved>, key_words: usize) -> Table {
        Table {
            aggs,
            key_words,
            map: HashMap::new(),
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    /// Folds one input tuple with key `key`.
    pub(crate) fn add(&mut self, key: &[u64], tuple: &[u64]) {
        if let Some(p) = self.map.get_mut(key) {
            for (a, w) in self.aggs.iter().zip(p.iter_mut()) {
                *w = a.merge(*w, a.init(tuple));
            }
        } else {
            let p = self.aggs.iter().map(|a| a.init(tuple)).collect();
            self.map.insert(key.to_vec(), p);
        }
    }

    /// Merges one wire tuple: the key's words, then one partial per aggregate.
    pub(crate) fn merge_wire(&mut self, wire: &[u64]) {
        let (key, partial) = wire.split_at(self.key_words);
        if let Some(p) = self.map.get_mut(key) {
            for ((a, w), &x) in self.aggs.iter().zip(p.iter_mut()).zip(partial) {
                *w = a.merge(*w, x);
            }
        } else {
            self.map.insert(key.to_vec(), partial.to_vec());
        }
    }

    /// Empties the table as wire tuples.
    pub(crate) fn drain_wire(&mut self) -> impl Iterator<Item = Vec<u64>> + '_ {
        self.map.drain().map(|(mut k, p)| {
            k.extend(p);
            k
        })
    }

    /// The final result, sorted by key.
    pub(crate) fn into_combined(self) -> Vec<Combined> {
        let aggs = self.aggs;
        let mut out: Vec<Combined> = self
            .map
            .into_iter()
            .map(|(key, p)| Combined {
                key,
                values: aggs
                    .iter()
                    .zip(p)
                    .map(|(a, w)| Value::from_word(a.ty, w).expect("numeric aggregate"))
                    .collect(),
            })
            .collect();
        out.sort_by(|a, b| a.key.cmp(&b.key));
        out
    }
}

/// One group of a combiner flow's result: the key's words and one value per aggregate,
/// in declaration order.
#[derive(Clone, Debug, PartialEq)]
pub struct Combined {
    pub key: Vec<u64>,
    pub values: Vec<Value>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flow::schema::Column;

    #[test]
    fn partials_merge_like_the_whole() {
        let s = Schema::new(
            vec![Column::u64("k"), Column::i64("v"), Column::f64("x")],
            "k",
        )
        .unwrap();
        let aggs = Resolved::resolve(
            &s,
            &[
                Aggregate::sum("v"),
                Aggregate::count(),
                Aggregate::min("v"),
                Aggregate::max("x"),
                Aggregate::sum("x"),
            ],
        )
        .unwrap();
        let rows: Vec<[u64; 3]> = (0..100i64)
            .map(|i| [(i % 3) as u64, (i - 50) as u64, (i as f64 * 0.5).to_bits()])
            .collect();
        let mut whole = Table::new(aggs.clone(), 1);
        for r in &rows {
            whole.add(&r[..1], r);
        }
        let mut merged = Table::new(aggs.clone(), 1);
        for part in rows.chunks(7) {
            let mut t = Table::new(aggs.clone(), 1);
            for r in part {
                t.add(&r[..1], r);
            }
            for w in t.drain_wire() {
                merged.merge_wire(&w);
            }
        }
        let (w, m) = (whole.into_combined(), merged.into_combined());
        assert_eq!(w, m);
        assert_eq!(w[0].key, vec![0]);
        let n0 = (0..100).filter(|i| i % 3 == 0).count() as u64;
        assert_eq!(w[0].values[1], Value::U64(n0));
        assert_eq!(w[0].values[2], Value::I64(-50));
        assert_eq!(w[0].values[3], Value::F64(49.5));
        assert!(Resolved::resolve(&s, &[]).is_err());
        assert!(Resolved::resolve(&s, &[Aggregate::sum("nope")]).is_err());
    }
}
