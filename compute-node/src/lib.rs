//! The compute-node process and its gRPC KV/transaction API.
//!
//! Empty until the compute-node issue fills it.
