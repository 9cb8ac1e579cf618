//! `conveyor-operator`: reconciles TaskType and WorkerPool resources (`run`, wired in
//! `conveyor_operator::app`), and writes the CRDs generated from the Rust types (`crdgen`).

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use conveyor_operator::app::{self, RunArgs};

#[derive(Debug, Parser)]
#[command(name = "conveyor-operator", version)]
struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Write the CustomResourceDefinitions (generated from the Rust types) to a folder.
    Crdgen {
        /// Folder to write tasktypes.yaml and workerpools.yaml into; stdout when absent.
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Run the reconcilers.
    Run(Box<RunArgs>),
}

#[tokio::main]
async fn main() -> ExitCode {
    let result = match Args::parse().command {
        Command::Crdgen { out } => crdgen(out),
        Command::Run(args) => app::run(*args).await,
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("conveyor-operator: {err:#}");
            ExitCode::FAILURE
        }
    }
}

fn crdgen(out: Option<PathBuf>) -> anyhow::Result<()> {
    let Some(dir) = out else {
        for (_, yaml) in conveyor_core::crd::crd_documents() {
            print!("---\n{yaml}");
        }
        return Ok(());
    };
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    for (file, yaml) in conveyor_core::crd::crd_documents() {
        let path = dir.join(file);
        std::fs::write(&path, yaml).with_context(|| format!("writing {}", path.display()))?;
        println!("wrote {}", path.display());
    }
    Ok(())
}
