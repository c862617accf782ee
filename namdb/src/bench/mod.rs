//! `namdb bench …`: benchmarks, one module per subject.

mod fabric;
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
}

pub fn run(cmd: BenchCommand) -> Result<()> {
    match cmd {
        BenchCommand::Fabric(args) => self::fabric::run(&args),
        BenchCommand::Verify(args) => self::verify::run(&args),
        BenchCommand::Timestamp(args) => self::timestamp::run(&args),
        BenchCommand::Txn(args) => self::txn::run(&args),
    }
}
