//! The `namdb` command line: one binary whose subcommands run the system's processes
//! (memory server, cluster, workloads) and its benchmarks.

mod backend;
mod bench;

use anyhow::Result;
use clap::{Parser, Subcommand};
use tracing_subscriber::EnvFilter;

#[derive(Parser, Debug)]
#[command(
    name = "namdb",
    version,
    about = "namdb: a database on network-attached memory"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run a benchmark.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    // Logs go to stderr so that stdout carries only the report a command prints. Quiet
    // by default; `RUST_LOG=namdb=debug` shows what each measurement set up.
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    match cli.command {
        Command::Bench(cmd) => bench::run(cmd),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn bench_fabric_defaults() {
        let cli = Cli::try_parse_from(["namdb", "bench", "fabric"]).expect("parses");
        let Command::Bench(bench::BenchCommand::Fabric(args)) = cli.command else {
            panic!("parsed as another command");
        };
        assert_eq!(args.backend, backend::BackendKind::Sim);
        assert_eq!(args.threads, 2);
        assert_eq!(args.batch, 32);
        assert!(args.cost.is_none());
        assert!(args.ops.is_empty());
    }

    #[test]
    fn bench_fabric_parses_cost_and_ops() {
        let cli = Cli::try_parse_from([
            "namdb",
            "bench",
            "fabric",
            "--cost",
            "EDR4X",
            "--ops",
            "read,fetch-add",
            "--ops",
            "send_recv",
        ])
        .expect("parses");
        let Command::Bench(bench::BenchCommand::Fabric(args)) = cli.command else {
            panic!("parsed as another command");
        };
        assert_eq!(args.cost.map(|c| c.name), Some("edr4x"));
        assert_eq!(args.ops.len(), 3);
    }

    #[test]
    fn unknown_cost_model_is_rejected_with_the_choices() {
        let err = Cli::try_parse_from(["namdb", "bench", "fabric", "--cost", "nosuch"])
            .expect_err("rejected");
        let msg = err.to_string();
        assert!(msg.contains("nosuch") && msg.contains("fdr4x"), "{msg}");
    }
}
