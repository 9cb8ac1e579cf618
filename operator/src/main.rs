//! `conveyor-operator`: reconciles TaskType and WorkerPool resources.
//!
//! Built so far: `crdgen`, which writes the CRDs to `crds/`. The reconcilers are not built
//! yet (docs/ARCHITECTURE.md, "Status"); `run` says so and exits rather than pretend.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};

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
    /// Run the reconcilers (not built yet).
    Run,
}

fn main() -> ExitCode {
    match run(Args::parse()) {
        Ok(code) => code,
        Err(err) => {
            eprintln!("conveyor-operator: {err:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: Args) -> anyhow::Result<ExitCode> {
    match args.command {
        Command::Crdgen { out: None } => {
            for (_, yaml) in conveyor_core::crd::crd_documents() {
                print!("---\n{yaml}");
            }
        }
        Command::Crdgen { out: Some(dir) } => {
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
            for (file, yaml) in conveyor_core::crd::crd_documents() {
                let path = dir.join(file);
                std::fs::write(&path, yaml)
                    .with_context(|| format!("writing {}", path.display()))?;
                println!("wrote {}", path.display());
            }
        }
        Command::Run => {
            eprintln!(
                "conveyor-operator: the TaskType/WorkerPool reconcilers are not built yet; \
                 run conveyor-gateway and conveyor-worker with --task-types meanwhile"
            );
            return Ok(ExitCode::from(2));
        }
    }
    Ok(ExitCode::SUCCESS)
}
