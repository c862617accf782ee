//! Generated join inputs in the manner of Balkesen et al. as Binnig et al. §5.4 uses
//! them: R has unique keys, and a given fraction of S (the selectivity of a Bloom
//! filter over R, 0.25 to 1.0 in the paper's experiment) references a random R tuple
//! while the rest has keys R does not hold. Every node's fragment follows from the
//! seed and its rank, so a benchmark can rebuild all of them for DuckDB and a check.

use super::Tuple;
use super::hash::hash;
use crate::error::{Result, ShuffleError};

/// What to generate.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct DataSpec {
    pub seed: u64,
    pub nodes: usize,
    /// R tuples per node.
    pub r_tuples: u64,
    /// S tuples per node.
    pub s_tuples: u64,
    /// The fraction of S with a join partner, in 0..=1.
    pub selectivity: f64,
}

impl DataSpec {
    pub fn check(&self) -> Result<()> {
        if !(0.0..=1.0).contains(&self.selectivity) {
            return Err(ShuffleError::Invalid(format!(
                "selectivity {} is not within 0..=1",
                self.selectivity
            )));
        }
        if self.nodes == 0 {
            return Err(ShuffleError::Invalid("no nodes".into()));
        }
        Ok(())
    }

    /// Key of R tuple `index` (over all nodes): a bijection of the index, so R's keys
    /// are unique and S's misses (indexes from `total_r` on) never meet them.
    fn key(&self, index: u64) -> u64 {
        hash(index ^ self.seed.rotate_left(47))
    }

    /// Node `rank`'s fragments of R and S. Payloads are the tuples' global positions
    /// (below 2⁴⁰ for any realistic size), so sums over them stay exact.
    pub fn fragment(&self, rank: usize) -> Result<(Vec<Tuple>, Vec<Tuple>)> {
        self.check()?;
        let total_r = self.r_tuples * self.nodes as u64;
        let r_first = rank as u64 * self.r_tuples;
        let r = (0..self.r_tuples)
            .map(|i| [self.key(r_first + i), r_first + i])
            .collect();
        let threshold = (self.selectivity * (1u64 << 53) as f64) as u64;
        let s_first = rank as u64 * self.s_tuples;
        let s = (0..self.s_tuples)
            .map(|j| {
                let x = hash(self.seed ^ hash(s_first + j + 1));
                let pick = hash(x);
                let index = if (x >> 11) < threshold && total_r > 0 {
                    pick % total_r
                } else {
                    total_r + (pick >> 2)
                };
                [self.key(index), s_first + j]
            })
            .collect();
        Ok((r, s))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn the_selected_fraction_of_s_finds_a_partner() {
        for selectivity in [0.0, 0.25, 0.5, 1.0] {
            let spec = DataSpec {
                seed: 3,
                nodes: 2,
                r_tuples: 2000,
                s_tuples: 4000,
                selectivity,
            };
            let (r0, s0) = spec.fragment(0).unwrap();
            let (r1, _) = spec.fragment(1).unwrap();
            let keys: HashSet<u64> = r0.iter().chain(&r1).map(|t| t[0]).collect();
            assert_eq!(keys.len(), 4000, "R keys are unique");
            let hits = s0.iter().filter(|t| keys.contains(&t[0])).count() as f64 / 4000.0;
            assert!((hits - selectivity).abs() < 0.03, "{selectivity}: {hits}");
        }
        let bad = DataSpec {
            seed: 1,
            nodes: 1,
            r_tuples: 1,
            s_tuples: 1,
            selectivity: 1.5,
        };
        assert!(bad.fragment(0).is_err());
    }
}
