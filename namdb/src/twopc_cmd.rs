//! `namdb twopc` (hidden): the server processes of the two-phase-commit baseline
//! (`tpcw::twopc`), which `TwoPc::start(Launch::Processes { .. })` runs. Each prints
//! `listening on ADDR` once it accepts connections and runs until SIGTERM or SIGINT
//! (or, with `--exit-on-stdin-close`, until its stdin closes: the launcher holds it
//! open, so the server ends with the launcher even if that is killed).

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use std::io::Read;
use std::net::SocketAddr;
use tpcw::twopc::launch::LISTENING_PREFIX;
use tpcw::twopc::resource_manager::ResourceManager;
use tpcw::twopc::transaction_manager::TransactionManager;

#[derive(Subcommand, Debug)]
pub enum TwoPcCommand {
    /// Serve one partition: versioned rows, snapshot reads, prepare/commit/abort.
    ResourceManager(ServeArgs),
    /// Serve begin and commit: the timestamp service and the 2PC coordinator.
    TransactionManager(TransactionManagerArgs),
}

#[derive(Args, Debug)]
pub struct ServeArgs {
    /// Address to listen on, host:port (port 0 picks a free port).
    #[arg(long, value_name = "ADDR")]
    pub listen: SocketAddr,
    /// Also exit when stdin reaches its end.
    #[arg(long)]
    pub exit_on_stdin_close: bool,
}

#[derive(Args, Debug)]
pub struct TransactionManagerArgs {
    #[command(flatten)]
    pub serve: ServeArgs,
    /// The resource managers' addresses, comma-separated, in partition order (every
    /// client learns this order from the transaction manager).
    #[arg(long, value_name = "ADDR,...", value_delimiter = ',', required = true)]
    pub resource_managers: Vec<SocketAddr>,
}

pub fn run(cmd: TwoPcCommand) -> Result<()> {
    match cmd {
        TwoPcCommand::ResourceManager(args) => {
            let server = ResourceManager::start(args.listen)
                .with_context(|| format!("resource manager cannot listen on {}", args.listen))?;
            let why = serve_until_stopped(server.local_addr(), args.exit_on_stdin_close)?;
            tracing::info!("resource manager stopping: {why}");
            server.stop();
        }
        TwoPcCommand::TransactionManager(args) => {
            if args.resource_managers.is_empty() {
                bail!("--resource-managers names no address");
            }
            let server = TransactionManager::start(args.serve.listen, args.resource_managers)?;
            let why = serve_until_stopped(server.local_addr(), args.serve.exit_on_stdin_close)?;
            tracing::info!("transaction manager stopping: {why}");
            server.stop();
        }
    }
    Ok(())
}

/// Prints the listening line, then waits for SIGTERM, SIGINT or (if asked) the end
/// of stdin; returns which.
fn serve_until_stopped(addr: SocketAddr, exit_on_stdin_close: bool) -> Result<&'static str> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the tokio runtime")?;
    // Installed before the line below: a script may send SIGTERM as soon as it reads
    // it, and must get the clean shutdown.
    let signal = {
        let _entered = runtime.enter();
        memory_server::listen_for_signals()?
    };
    let (stdin_closed_tx, stdin_closed) = tokio::sync::oneshot::channel();
    if exit_on_stdin_close {
        std::thread::spawn(move || {
            let mut sink = [0u8; 256];
            let mut stdin = std::io::stdin().lock();
            while let Ok(1..) = stdin.read(&mut sink) {}
            let _ = stdin_closed_tx.send(());
        });
    }
    println!("{LISTENING_PREFIX}{addr}");
    runtime.block_on(async {
        tokio::select! {
            signal = signal => Ok(signal?),
            // An error means the sender is gone without a close: stdin is not watched.
            Ok(()) = stdin_closed => Ok("stdin closed"),
        }
    })
}
