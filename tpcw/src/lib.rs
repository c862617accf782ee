//! The TPC-W benchmark.
//!
//! Empty until the tpcw issue fills it.
