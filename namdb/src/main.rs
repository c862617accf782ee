//! The `namdb` command line: one binary whose subcommands run the system's processes
//! (memory server, cluster, workloads) and its benchmarks.

/// Writes a progress line of a command that started processes to stderr. One that
/// cannot be written because its reader went away (`2>&1 | head`) stops the command
/// as an interrupt does (`cluster_cmd::check_interrupted`) instead of panicking out of
/// it, which left the processes it started running on their own (and chaos's run
/// directory behind).
macro_rules! say {
    ($($arg:tt)*) => {
        $crate::cluster_cmd::say_line(format_args!($($arg)*))
    };
}

mod backend;
mod bench;
mod chaos_cmd;
mod cluster_cmd;
mod compute_node_cmd;
mod interrupt;
mod kv_cmd;
mod memory_server_cmd;
mod metrics;
mod shell_cmd;
mod token_cmd;
mod tpcw_cmd;
mod twopc_cmd;
mod verify_cmd;

use anyhow::Result;
use clap::{Parser, Subcommand};
use std::process::ExitCode;
use tracing_subscriber::EnvFilter;

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

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
    /// The chaos harness: kill, crash, pause and stall compute nodes while the bank and
    /// list-append workloads run, then check snapshot isolation, the bank invariant,
    /// that nothing acknowledged was lost and that no lock (or key claimed in the index
    /// without its address) remains; exits non-zero on any violation.
    Chaos(chaos_cmd::ChaosArgs),
    /// One compute node of `namdb chaos`, which starts them itself.
    #[command(hide = true)]
    ChaosNode(chaos_cmd::ChaosNodeArgs),
    /// Run a local cluster: memory servers and compute nodes on this host.
    #[command(subcommand)]
    Cluster(cluster_cmd::ClusterCommand),
    /// Run a compute node: transactions on the memory servers, served over gRPC.
    ComputeNode(compute_node_cmd::ComputeNodeArgs),
    /// One transaction on a table of a local cluster: get, put, delete or scan.
    Kv(kv_cmd::KvArgs),
    /// Run a memory server: export registered memory to compute nodes.
    MemoryServer(memory_server_cmd::MemoryServerArgs),
    /// Read get/put/del/scan/begin/commit/abort lines from stdin against a local cluster.
    Shell(shell_cmd::ShellArgs),
    /// The TPC-W benchmark: the paper's checkout or a TPC-W mix on RSI and the
    /// baselines, with every run checked.
    Tpcw(tpcw_cmd::TpcwArgs),
    /// Manage the cluster token.
    #[command(subcommand)]
    Token(token_cmd::TokenCommand),
    /// The servers of the two-phase-commit baseline of the TPC-W harness, which starts
    /// them itself.
    #[command(subcommand, hide = true)]
    Twopc(twopc_cmd::TwoPcCommand),
    /// One node process of `namdb bench shuffle`, which starts them itself.
    #[command(hide = true)]
    ShuffleNode(bench::shuffle::procs::NodeArgs),
    /// One node process of `namdb bench join`, which starts them itself.
    #[command(hide = true)]
    JoinNode(bench::nodes::NodeArgs),
    /// One node process of `namdb bench aggregate`, which starts them itself.
    #[command(hide = true)]
    AggregateNode(bench::nodes::NodeArgs),
    /// Check a recorded history (JSON Lines) for snapshot-isolation anomalies.
    ///
    /// Exit status: 0 valid; 1 the history violates the model; 2 the history cannot be
    /// read (the message names the line); 3 inconclusive: nothing forbidden was found,
    /// but part of the history could not be checked (a cycle search ran out of budget,
    /// or register reads lack the timestamps, rid and cid, that place them in a
    /// snapshot: their values alone are checked).
    Verify(verify_cmd::VerifyArgs),
}

fn main() -> ExitCode {
    quiet_on_closed_output();
    match run() {
        Ok(code) => code,
        Err(e) => {
            eprintln!("{}", error_report(&e));
            if let Some(stop) = e.downcast_ref::<cluster_cmd::Interrupted>() {
                return ExitCode::from((128 + stop.signal) as u8);
            }
            let backtrace = e.backtrace();
            if backtrace.status() == std::backtrace::BacktraceStatus::Captured {
                eprintln!("\nStack backtrace:\n{backtrace}");
            }
            ExitCode::FAILURE
        }
    }
}

/// `println!` panics when stdout cannot be written: a reader that went away (`| head`)
/// or a full disk. A command's output going nowhere is not a bug in it: end the
/// process as a Unix tool does (quietly, with SIGPIPE's status, for a closed pipe;
/// with a one-line error otherwise) instead of printing a panic.
fn quiet_on_closed_output() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let message = info
            .payload()
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| info.payload().downcast_ref::<&str>().copied())
            .unwrap_or("");
        if let Some(why) = message
            .strip_prefix("failed printing to stdout: ")
            .or_else(|| message.strip_prefix("failed printing to stderr: "))
        {
            if why.contains("Broken pipe") {
                std::process::exit(141);
            }
            // stderr may be what failed; nothing better is left to try.
            let _ = std::io::Write::write_fmt(
                &mut std::io::stderr(),
                format_args!("Error: cannot write the output: {why}\n"),
            );
            std::process::exit(1);
        }
        default(info);
    }));
}

/// `e` and its causes, as anyhow prints them, but without the causes a message
/// already quotes: many errors say "…: {source}" and name that source as their cause
/// too, which would print every cause twice.
fn error_report(e: &anyhow::Error) -> String {
    let mut out = format!("Error: {e}");
    let causes = new_causes(e);
    match causes.as_slice() {
        [] => {}
        [one] => out.push_str(&format!("\n\nCaused by:\n    {one}")),
        many => {
            out.push_str("\n\nCaused by:");
            for (i, c) in many.iter().enumerate() {
                out.push_str(&format!("\n    {i}: {c}"));
            }
        }
    }
    out
}

/// The causes of `e` after its own message, leaving out each that the one before it
/// says already: a connect error's chain says "tcp connect error" twice, as tonic's
/// wrapper shows the error it wraps and gives it as its source too.
fn new_causes(e: &anyhow::Error) -> Vec<String> {
    let mut causes = Vec::new();
    let mut previous = e.to_string();
    for cause in e.chain().skip(1) {
        let text = cause.to_string();
        if !previous.contains(&text) {
            causes.push(text.clone());
        }
        previous = text;
    }
    causes
}

/// `e` and its causes on one line, as `{e:#}` shows them but without the repeats
/// [`new_causes`] leaves out.
fn one_line(e: &anyhow::Error) -> String {
    std::iter::once(e.to_string())
        .chain(new_causes(e))
        .collect::<Vec<_>>()
        .join(": ")
}

/// A value parser of numbers no smaller than `min`, for flags without an upper bound:
/// clap's own range parser says a 0 "is not in 1..18446744073709551615".
fn at_least<T>(min: T) -> impl Fn(&str) -> Result<T, String> + Clone + Send + Sync + 'static
where
    T: std::str::FromStr + PartialOrd + std::fmt::Display + Copy + Send + Sync + 'static,
    T::Err: std::fmt::Display,
{
    move |s: &str| {
        let n: T = s.parse().map_err(|e| format!("{e}"))?;
        if n < min {
            return Err(format!("must be at least {min}"));
        }
        Ok(n)
    }
}

/// Prints clap's error for a command line it rejected (or the help or version asked
/// for) and returns the exit status clap gives it. Every argument the message quotes is
/// shown as [`txn::echo`] shows client input: clap quotes a rejected value whole, and
/// so does many a value parser's error beneath it (`namdb kv get` with a 10 000-character
/// key printed all of it back).
fn clap_error(e: &clap::Error) -> ExitCode {
    let code = ExitCode::from(u8::try_from(e.exit_code()).unwrap_or(2));
    if !e.use_stderr() {
        // --help and --version: nothing of the user's is quoted.
        let _ = e.print();
        return code;
    }
    use std::io::IsTerminal;
    let rendered = e.render();
    let message = if std::io::stderr().is_terminal() {
        rendered.ansi().to_string()
    } else {
        rendered.to_string()
    };
    let args: Vec<String> = std::env::args_os()
        .skip(1)
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    eprint!("{}", bound_echoed_args(&message, &args));
    code
}

/// `message` with every argument of `args` it quotes that [`txn::echo`] would cut or
/// escape replaced by what `echo` shows: the argument as given, the value of a
/// `--flag=VALUE`, and their `{:?}` forms (the parsers' errors quote so).
fn bound_echoed_args(message: &str, args: &[String]) -> String {
    let mut quoted: Vec<(String, String)> = Vec::new();
    for arg in args {
        let mut forms = vec![arg.as_str()];
        if arg.starts_with('-')
            && let Some((_, value)) = arg.split_once('=')
        {
            forms.push(value);
        }
        for form in forms {
            let shown = txn::echo(form);
            if shown == form {
                continue;
            }
            let debug = format!("{form:?}");
            let inner = &debug[1..debug.len() - 1];
            if inner != form {
                quoted.push((inner.to_string(), shown.clone()));
            }
            quoted.push((form.to_string(), shown));
        }
    }
    // Longest first, so that a value is not cut inside the argument holding it.
    quoted.sort_by_key(|(raw, _)| std::cmp::Reverse(raw.len()));
    let mut out = message.to_string();
    for (raw, shown) in quoted {
        out = out.replace(&raw, &shown);
    }
    out
}

fn run() -> Result<ExitCode> {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => return Ok(clap_error(&e)),
    };
    // Logs go to stderr so that stdout carries only the report a command prints. Quiet
    // by default; `RUST_LOG=namdb=debug` shows what each measurement set up. A server
    // logs its lifecycle (start, sessions, stop) by default.
    let default_filter = match cli.command {
        Command::MemoryServer(_) | Command::ComputeNode(_) | Command::Twopc(_) => "info",
        _ => "warn",
    };
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter));
    // Colours only on a terminal: `cluster up` sends servers' logs to files, and prints
    // their tails in its errors.
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    match cli.command {
        Command::Bench(cmd) => bench::run(cmd).map(|()| ExitCode::SUCCESS),
        Command::Chaos(args) => chaos_cmd::run(&args),
        Command::ChaosNode(args) => chaos_cmd::node_main(&args).map(|()| ExitCode::SUCCESS),
        Command::MemoryServer(args) => memory_server_cmd::run(args).map(|()| ExitCode::SUCCESS),
        Command::Cluster(cmd) => cluster_cmd::run(cmd).map(|()| ExitCode::SUCCESS),
        Command::Kv(args) => kv_cmd::run(args),
        Command::ComputeNode(args) => compute_node_cmd::run(args).map(|()| ExitCode::SUCCESS),
        Command::Shell(args) => shell_cmd::run(args),
        Command::Tpcw(args) => tpcw_cmd::run(&args).map(|()| ExitCode::SUCCESS),
        Command::Token(cmd) => token_cmd::run(cmd).map(|()| ExitCode::SUCCESS),
        Command::Twopc(cmd) => twopc_cmd::run(cmd).map(|()| ExitCode::SUCCESS),
        Command::ShuffleNode(args) => {
            bench::nodes::exit_with_parent(&args)?;
            bench::shuffle::procs::node_main(&args).map(|()| ExitCode::SUCCESS)
        }
        Command::JoinNode(args) => {
            bench::nodes::exit_with_parent(&args)?;
            bench::join::node_main(&args).map(|()| ExitCode::SUCCESS)
        }
        Command::AggregateNode(args) => {
            bench::nodes::exit_with_parent(&args)?;
            bench::aggregate::node_main(&args).map(|()| ExitCode::SUCCESS)
        }
        Command::Verify(args) => Ok(verify_cmd::run(&args)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Flags with a lower bound only: before, "0 is not in 1..18446744073709551615".
    #[test]
    fn a_number_below_a_flags_least_says_the_least() {
        for args in [
            &["namdb", "bench", "verify", "--txns", "0"][..],
            &["namdb", "kv", "create-table", "t", "--capacity", "0"],
            &["namdb", "kv", "create-table", "t", "--value-cap", "0"],
            &["namdb", "bench", "aggregate", "--local-groups", "0"],
            &["namdb", "bench", "aggregate", "--crossover", "0"],
        ] {
            let e = Cli::try_parse_from(args)
                .expect_err("below the least")
                .to_string();
            assert!(
                e.contains("invalid value '0'") && e.contains(": must be at least 1"),
                "{args:?}: {e}"
            );
        }
        let e = Cli::try_parse_from(["namdb", "bench", "verify", "--txns", "many"])
            .expect_err("not a number")
            .to_string();
        assert!(e.contains("invalid digit found in string"), "{e}");
    }

    #[test]
    fn an_error_report_names_each_cause_once() {
        let io = std::io::Error::other("Is a directory");
        let e = anyhow::Error::new(io).context("cannot read token file t: Is a directory");
        assert_eq!(
            error_report(&e),
            "Error: cannot read token file t: Is a directory"
        );
        let e = anyhow::anyhow!("Connection refused")
            .context("tcp connect error")
            .context("tcp connect error")
            .context("transport error")
            .context("cannot reach it: transport error")
            .context("starting");
        assert_eq!(
            error_report(&e),
            "Error: starting\n\nCaused by:\n    0: cannot reach it: transport error\n    \
             1: tcp connect error\n    2: Connection refused"
        );
    }
    use clap::CommandFactory;

    #[test]
    fn a_rejected_value_is_quoted_as_client_input_is() {
        let long = "7".repeat(63) + &"x".repeat(9_937);
        let args = ["kv".to_string(), "get".to_string(), long.clone()];
        let e = Cli::try_parse_from(std::iter::once("namdb".to_string()).chain(args.clone()))
            .expect_err("not a key");
        let whole = e.render().to_string();
        assert!(whole.contains(&long), "clap quotes it whole: {whole}");
        let bounded = bound_echoed_args(&whole, &args);
        assert!(!bounded.contains(&long[..65]), "{bounded}");
        assert!(bounded.contains(&txn::echo(&long)), "{bounded}");
        assert!(bounded.contains("… (10000 bytes)"), "{bounded}");
        assert!(bounded.len() < 400, "{bounded}");
        // The value of --flag=VALUE, and a value a parser's error quotes as `{:?}`.
        let with_tab = format!("{}\t", "z".repeat(70));
        let message = format!("error: invalid value '{with_tab}': unknown {with_tab:?}");
        let bounded = bound_echoed_args(&message, &[format!("--notify={with_tab}")]);
        let shown = txn::echo(&with_tab);
        assert_eq!(
            bounded,
            format!("error: invalid value '{shown}': unknown \"{shown}\"")
        );
        // Short arguments and the rest of the message stay as they were.
        let message = "error: unexpected argument '--nodse' found";
        assert_eq!(bound_echoed_args(message, &["--nodse".into()]), message);
    }

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
