//! `namdb shell`: commands read line by line from stdin against a local cluster. Each
//! command runs in a transaction of its own, unless `begin` opened one, which then
//! holds every command until `commit` or `abort`.

use crate::cluster_cmd::DEFAULT_TABLE;
use crate::kv_cmd::{
    ANSWER_WAIT, KvCommand, NoAnswer, answers_within, autocommit_marking, commit_marking, failed,
    one, session, within,
};
use anyhow::Result;
use clap::Args;
use compute_node::client::{Client, Txn};
use std::io::{BufRead, IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

#[derive(Args, Debug)]
pub struct ShellArgs {
    /// The table.
    #[arg(long, value_name = "T", default_value = DEFAULT_TABLE)]
    pub table: String,
    /// The cluster file, or the cluster's directory holding it; by default
    /// ./cluster.json, else ./namdb-cluster/cluster.json.
    #[arg(long, value_name = "FILE")]
    pub cluster: Option<PathBuf>,
    /// Give up on a line when it has not finished after this long (e.g. 500ms, 30s,
    /// 2m): a command's own transaction, or one call (begin, a command, commit, abort)
    /// of the transaction `begin` opened, which then ends.
    #[arg(long, value_name = "DURATION", default_value = "30s",
          value_parser = crate::compute_node_cmd::parse_duration)]
    pub timeout: Duration,
}

const HELP: &str = "\
get K                  print the value of key K
put K V                set key K to V (the rest of the line)
del K | delete K       delete key K
scan [FROM [TO [N]]]   rows with FROM <= key < TO, at most N
begin                  open a transaction for the commands that follow
commit | abort         end it
help                   this text
quit | exit            leave (an open transaction is aborted)
# ...                  a comment: ignored";

/// A line: a transaction command, or one of the shell's own.
#[derive(Debug, PartialEq, Eq)]
enum Line {
    Kv(KvCommand),
    Begin,
    Commit,
    Abort,
    Help,
    Quit,
    Empty,
}

fn key(word: Option<&str>) -> Result<u64, String> {
    let word = word.ok_or("a key is missing")?;
    crate::kv_cmd::parse_key(word)
}

fn parse(line: &str) -> Result<Line, String> {
    // Only the line's end is cut off, not trailing blanks: they belong to a put's value
    // ("the rest of the line"), which a `trim` shortened without a word.
    let line = line.strip_suffix('\n').unwrap_or(line);
    let line = line.strip_suffix('\r').unwrap_or(line).trim_start();
    let (command, rest) = line.split_once(char::is_whitespace).unwrap_or((line, ""));
    let mut words = rest.split_whitespace();
    if line.starts_with('#') {
        return Ok(Line::Empty);
    }
    let parsed = match command {
        "" => Line::Empty,
        "get" => Line::Kv(KvCommand::Get {
            key: key(words.next())?,
        }),
        "del" | "delete" => Line::Kv(KvCommand::Delete {
            key: key(words.next())?,
        }),
        "put" => {
            let rest = rest.trim_start();
            let (k, value) = rest.split_once(char::is_whitespace).unwrap_or((rest, ""));
            if value.trim().is_empty() {
                return Err("put takes a key and a value".into());
            }
            return Ok(Line::Kv(KvCommand::Put {
                key: key(Some(k))?,
                value: value.trim_start().to_string(),
                hex: false,
            }));
        }
        "scan" => {
            let from = words.next().map_or(Ok(0), crate::kv_cmd::parse_bound)?;
            let to = words.next().map(crate::kv_cmd::parse_bound).transpose()?;
            crate::kv_cmd::scan_range(from, to, "FROM", "TO")?;
            Line::Kv(KvCommand::Scan {
                from,
                to,
                limit: words.next().map_or(Ok(0), |w| {
                    w.parse().map_err(|_| {
                        format!(
                            "`{}` is not a number of rows: N is a whole number (0: all)",
                            txn::echo(w)
                        )
                    })
                })?,
            })
        }
        "begin" => Line::Begin,
        "commit" => Line::Commit,
        "abort" => Line::Abort,
        "help" | "?" => Line::Help,
        "quit" | "exit" => Line::Quit,
        other => {
            return Err(format!(
                "unknown command `{}`; `help` lists them",
                txn::echo(other)
            ));
        }
    };
    match words.next() {
        Some(extra) => Err(format!(
            "`{}` is one word too many for `{command}`",
            txn::echo(extra)
        )),
        None => Ok(parsed),
    }
}

/// Carries out `line`, giving up after `timeout`; `open` is the transaction `begin`
/// opened.
async fn execute(
    client: &Client,
    table: &str,
    open: &mut Option<Txn>,
    line: Line,
    timeout: Duration,
) -> Result<()> {
    let committing = AtomicBool::new(false);
    match (line, *open) {
        (Line::Kv(cmd), None) => {
            within(
                timeout,
                &committing,
                autocommit_marking(client, table, cmd, &committing),
            )
            .await?;
        }
        (Line::Kv(cmd), Some(t)) => {
            if let Err(e) = within(timeout, &committing, one(client, t, table, cmd)).await {
                if e.downcast_ref::<NoAnswer>().is_some() {
                    // Whether the command took effect is unknown, so the transaction
                    // cannot go on. The abort is queued behind the command: it frees
                    // the transaction's keys as soon as the node gets to it, rather
                    // than after the node's --txn-timeout; a node that does not take
                    // it aborts the transaction then.
                    *open = None;
                    let _ = tokio::time::timeout(ANSWER_WAIT.min(timeout), client.abort(t)).await;
                    return Err(e.context("the transaction has ended (given up)"));
                }
                // A failure that keeps the transaction says so (see the .proto), in
                // the status, under any context `one` added.
                if !format!("{e:#}").contains("still open") {
                    *open = None;
                    return Err(e.context("the transaction has ended"));
                }
                return Err(e);
            }
        }
        (Line::Begin, Some(_)) => anyhow::bail!("a transaction is open already"),
        (Line::Begin, None) => {
            let begun = async { client.begin().await.map_err(|s| failed("begin", &s)) };
            *open = Some(within(timeout, &committing, begun).await?);
            println!("begun");
        }
        (Line::Commit | Line::Abort, None) => anyhow::bail!("no transaction is open"),
        (Line::Commit, Some(t)) => {
            *open = None;
            within(timeout, &committing, commit_marking(client, t, &committing)).await?;
            println!("committed");
        }
        (Line::Abort, Some(t)) => {
            *open = None;
            let aborted = async { client.abort(t).await.map_err(|s| failed("abort", &s)) };
            within(timeout, &committing, aborted).await?;
            println!("aborted");
        }
        (Line::Help, _) => println!("{HELP}"),
        (Line::Quit | Line::Empty, _) => {}
    }
    Ok(())
}

/// The exit status of a script (input that is not a terminal) in which a line failed,
/// as `kv`'s for a failed command.
const SCRIPT_FAILED: u8 = 2;

pub fn run(args: ShellArgs) -> Result<ExitCode> {
    // A --timeout shorter than the health check's wait bounds it too, as for `kv`.
    let wait = ANSWER_WAIT.min(args.timeout);
    let (runtime, nodes, mut client) = session(args.cluster, wait)?;
    let stdin = std::io::stdin();
    let interactive = stdin.is_terminal();
    let mut failed_lines: Vec<usize> = Vec::new();
    let mut open = None;
    let mut input = stdin.lock();
    let mut bytes = Vec::new();
    for number in 1.. {
        if interactive {
            print!("{}> ", if open.is_some() { "txn" } else { "namdb" });
            std::io::stdout().flush()?;
        }
        bytes.clear();
        if input.read_until(b'\n', &mut bytes)? == 0 {
            break;
        }
        // One line that is not text is an error of that line, as any other: the rest
        // of the input still runs.
        let Ok(line) = std::str::from_utf8(&bytes) else {
            eprintln!("error: line {number} is not UTF-8 text; skipped");
            failed_lines.push(number);
            continue;
        };
        match parse(line) {
            Ok(Line::Quit) => break,
            Ok(parsed) => {
                let done = execute(&client, &args.table, &mut open, parsed, args.timeout);
                if let Err(e) = runtime.block_on(done) {
                    eprintln!("error: line {number}: {}", crate::one_line(&e));
                    failed_lines.push(number);
                    // A compute node that died or hangs: go on with another.
                    if !runtime.block_on(answers_within(&client, wait)) {
                        match runtime.block_on(nodes.connect(wait)) {
                            Ok((other, which)) => {
                                client = other;
                                if open.take().is_some() {
                                    eprintln!(
                                        "the open transaction was lost with its compute node"
                                    );
                                }
                                eprintln!("now using {which}");
                            }
                            Err(e) => eprintln!("error: {}", crate::one_line(&e)),
                        }
                    }
                }
            }
            Err(msg) => {
                eprintln!("error: line {number}: {msg}");
                failed_lines.push(number);
            }
        }
    }
    if let Some(t) = open {
        // The timer is made inside the runtime, which it needs.
        let aborted =
            runtime.block_on(async { tokio::time::timeout(args.timeout, client.abort(t)).await });
        if aborted.is_err() {
            eprintln!(
                "error: {}; the open transaction is aborted once the compute node has seen \
                 no request for its --txn-timeout",
                NoAnswer(args.timeout)
            );
        } else {
            println!("aborted the open transaction");
        }
    }
    if interactive || failed_lines.is_empty() {
        return Ok(ExitCode::SUCCESS);
    }
    eprintln!("{}", failure_summary(&failed_lines));
    Ok(ExitCode::from(SCRIPT_FAILED))
}

/// What a script's end says when lines of it failed.
fn failure_summary(lines: &[usize]) -> String {
    const LISTED: usize = 10;
    let mut listed: Vec<String> = lines.iter().take(LISTED).map(|n| n.to_string()).collect();
    if lines.len() > LISTED {
        listed.push(format!("and {} more", lines.len() - LISTED));
    }
    let noun = if lines.len() == 1 { "line" } else { "lines" };
    format!(
        "namdb shell: {} {noun} failed ({})",
        lines.len(),
        listed.join(", ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_parse_into_commands() {
        assert_eq!(parse("get 7"), Ok(Line::Kv(KvCommand::Get { key: 7 })));
        assert_eq!(
            parse("  put 3   hello  world"),
            Ok(Line::Kv(KvCommand::Put {
                key: 3,
                value: "hello  world".into(),
                hex: false,
            }))
        );
        assert_eq!(parse("del 2"), Ok(Line::Kv(KvCommand::Delete { key: 2 })));
        assert_eq!(
            parse("scan 1 10 5"),
            Ok(Line::Kv(KvCommand::Scan {
                from: 1,
                to: Some(10),
                limit: 5
            }))
        );
        assert_eq!(
            parse("scan"),
            Ok(Line::Kv(KvCommand::Scan {
                from: 0,
                to: None,
                limit: 0
            }))
        );
        assert_eq!(parse(""), Ok(Line::Empty));
        assert_eq!(parse("begin"), Ok(Line::Begin));
        assert_eq!(parse("quit"), Ok(Line::Quit));
        assert!(parse("get x").unwrap_err().contains("not a key"));
        assert!(
            parse("put 18446744073709551615 v")
                .unwrap_err()
                .contains("is reserved")
        );
        assert_eq!(
            parse("scan 0 18446744073709551615"),
            Ok(Line::Kv(KvCommand::Scan {
                from: 0,
                to: Some(u64::MAX),
                limit: 0
            }))
        );
        assert!(
            parse("scan 0 10 x")
                .unwrap_err()
                .contains("`x` is not a number of rows")
        );
        assert_eq!(
            parse("scan 5 1").unwrap_err(),
            "FROM 5 is above TO 1: the range holds no key (keys from FROM up to, not \
             including, TO)"
        );
        assert!(
            parse("scan 5 5").is_ok(),
            "an empty range, but not a mistaken one"
        );
        assert!(parse("get").unwrap_err().contains("missing"));
        assert!(parse("put 1").unwrap_err().contains("value"));
        assert!(parse("get 1 2").unwrap_err().contains("too many"));
        assert!(parse("frobnicate").unwrap_err().contains("help"));
    }

    #[test]
    fn words_of_any_length_are_shown_bounded() {
        let long = "x".repeat(100_000);
        for line in [format!("get {long}"), long.clone(), format!("get 1 {long}")] {
            let said = parse(&line).unwrap_err();
            assert!(
                said.len() < 300 && said.contains("(100000 bytes)"),
                "{said}"
            );
        }
    }

    #[test]
    fn a_put_keeps_the_rest_of_the_line_whole() {
        let put = |value: &str| {
            Ok(Line::Kv(KvCommand::Put {
                key: 1,
                value: value.into(),
                hex: false,
            }))
        };
        // Only the line's end is not the value's: trailing blanks are.
        assert_eq!(parse("put 1 a  \n"), put("a  "));
        assert_eq!(parse("put 1 a\t\r\n"), put("a\t"));
        assert_eq!(parse("put 1 a b\r\n"), put("a b"));
        assert_eq!(parse("put 1 a"), put("a"));
        assert!(parse("put 1   \n").unwrap_err().contains("value"));
        assert_eq!(parse("get 7 \r\n"), Ok(Line::Kv(KvCommand::Get { key: 7 })));
        assert_eq!(parse("  # put 1 x  \n"), Ok(Line::Empty));
    }

    #[test]
    fn a_failed_script_names_its_failed_lines() {
        assert_eq!(failure_summary(&[4]), "namdb shell: 1 line failed (4)");
        assert_eq!(
            failure_summary(&(1..=12).collect::<Vec<_>>()),
            "namdb shell: 12 lines failed (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, and 2 more)"
        );
    }
}
