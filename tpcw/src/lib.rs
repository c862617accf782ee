//! The TPC-W benchmark (TPC-W 1.8) on namdb, and the systems it compares.
//!
//! - [`schema`]: the ten relations, their rows and keys, and the [`schema::Scale`].
//! - [`generate`]: the data generator; every row is a pure function of its id.
//! - [`system`]: what a system under test provides ([`system::Session`],
//!   [`system::Engine`], [`system::System`]).
//! - [`load`]: loading the generated rows through any system's transactions.
//! - [`postgres`]: PostgreSQL at REPEATABLE READ, the baseline run over TCP.
//! - [`twopc`]: the baseline of traditional snapshot isolation with two-phase commit.

pub mod codec;
pub mod generate;
pub mod htap;
pub mod interactions;
pub mod load;
pub mod postgres;
pub mod rsi;
pub mod runner;
pub mod schema;
pub mod script;
pub mod system;
pub mod twopc;
