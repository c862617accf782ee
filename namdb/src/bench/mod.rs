//! `namdb bench …`: benchmarks, one module per subject.

mod fabric;

use anyhow::Result;
use clap::Subcommand;

#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// Latency and throughput of every verb on a fabric backend, next to this
    /// machine's memcpy bandwidth.
    Fabric(self::fabric::FabricArgs),
}

pub fn run(cmd: BenchCommand) -> Result<()> {
    match cmd {
        BenchCommand::Fabric(args) => self::fabric::run(&args),
    }
}
