//! Distributed aggregation over the shuffle.
