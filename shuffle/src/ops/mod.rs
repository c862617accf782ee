//! Analytical operators over the shuffle (DESIGN.md "Shuffle (OLAP)", Binnig et al.
//! VLDB 2016 §5, Shatdal's thesis ch. 4–5).
//!
//! - [`scan`]: snapshot scans of txn tables straight from memory servers.
//! - [`join`]: distributed joins (GHJ, GHJ with a Bloom-filter reduction, RDMA GHJ,
//!   RDMA radix join) and the paper's cost model.
//! - [`aggregate`]: distributed aggregation (RDMA AGG; Two Phase, Repartitioning and
//!   the adaptive and sampling-based variants).

pub mod aggregate;
pub mod join;
pub mod scan;
