//! flux-plunger: the controller (SPEC §4-§5).
#![forbid(unsafe_code)]

use std::process::ExitCode;

use clap::Parser;
use flux_plunger::cli::Args;

// Two worker threads, whatever the node: the work is waiting on the
// apiserver, and tokio's default (one worker per visible CPU, and the node's
// CPUs are visible when the pod sets no CPU limit) would start dozens of
// threads on a large node, each with its own malloc arena, for nothing.
#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> ExitCode {
    let args = Args::parse();
    if let Err(err) = flux_plunger::run::validate(&args) {
        eprintln!("flux-plunger: {err:#}");
        return ExitCode::from(2);
    }
    match flux_plunger::run::run(args).await {
        Ok(code) => code,
        Err(err) => {
            tracing::error!(error = format!("{err:#}"), "flux-plunger failed");
            eprintln!("flux-plunger: {err:#}");
            ExitCode::FAILURE
        }
    }
}
