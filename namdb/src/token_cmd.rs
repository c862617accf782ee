//! `namdb token`: the cluster token every memory server and compute node shares.

use anyhow::Result;
use clap::Subcommand;
use std::path::PathBuf;

#[derive(Subcommand, Debug)]
pub enum TokenCommand {
    /// Write a new random cluster token (32 bytes as hex) to FILE, mode 0600. An
    /// existing file is never overwritten.
    Generate {
        /// Where to write the token.
        file: PathBuf,
    },
}

pub fn run(cmd: TokenCommand) -> Result<()> {
    match cmd {
        TokenCommand::Generate { file } => {
            memory_server::generate_token_file(&file)?;
            println!("wrote a new cluster token to {}", file.display());
            Ok(())
        }
    }
}
