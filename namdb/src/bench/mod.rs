//! `namdb bench …`: benchmarks, one module per subject.

pub mod aggregate;
pub mod duckdb;
mod fabric;
pub mod join;
pub mod nodes;
pub mod plot;
pub mod shuffle;
mod timestamp;
mod txn;
mod txn_grpc;
mod verify;

use anyhow::Result;
use clap::Subcommand;

#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// Latency and throughput of every verb on a fabric backend, next to this
    /// machine's memcpy bandwidth.
    Fabric(self::fabric::FabricArgs),
    /// Time checking a generated history of N transactions with `namdb verify`'s
    /// checkers (median of several runs).
    Verify(self::verify::VerifyBenchArgs),
    /// The bit-vector timestamp oracle: marked commits/s, read timestamps/s, bytes
    /// READ per read timestamp and prefix lag.
    Timestamp(self::timestamp::TimestampArgs),
    /// RSI transactions on an embedded cluster (ycsb, bank or list-append): txn/s,
    /// aborts by reason, latency.
    Txn(self::txn::TxnArgs),
    /// The shuffle microbenchmark (TODS 2019 §7.1): each node repartitions or
    /// broadcasts its fragment of R(a, b) with one of the eight endpoint designs, next
    /// to a TCP sockets and an OpenMPI baseline and memcpy, every run verified.
    Shuffle(self::shuffle::ShuffleArgs),
    /// Distributed joins (VLDB 2016 §5): GHJ, GHJ with a Bloom filter, RDMA GHJ and the
    /// RDMA radix join against the Bloom filter's selectivity, with the paper's cost
    /// model and DuckDB on the same data.
    Join(self::join::JoinArgs),
    /// Distributed GROUP BY against the number of groups: Two Phase, Repartitioning,
    /// the adaptive and sampling variants and RDMA AGG, next to DuckDB, verified.
    Aggregate(self::aggregate::AggregateArgs),
}

pub fn run(cmd: BenchCommand) -> Result<()> {
    match cmd {
        BenchCommand::Fabric(args) => self::fabric::run(&args),
        BenchCommand::Verify(args) => self::verify::run(&args),
        BenchCommand::Timestamp(args) => self::timestamp::run(&args),
        BenchCommand::Txn(args) => self::txn::run(&args),
        BenchCommand::Shuffle(args) => self::shuffle::run(&args),
        BenchCommand::Join(args) => self::join::run(&args),
        BenchCommand::Aggregate(args) => self::aggregate::run(&args),
    }
}
