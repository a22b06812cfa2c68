//! flux-plunger-sweep: the chart's pre-delete hook (SPEC §8) and operator
//! commands to list and release flux-plunger's leftovers.
#![forbid(unsafe_code)]

use std::process::ExitCode;

use clap::Parser;
use flux_plunger_sweep::cli::Args;

// Two worker threads, whatever the node (why: flux-plunger's main.rs).
#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> ExitCode {
    let command = Args::parse().into_command();
    match flux_plunger_sweep::run::run(command).await {
        Ok(code) => code,
        Err(err) => {
            eprintln!("flux-plunger-sweep: {err:#}");
            ExitCode::FAILURE
        }
    }
}
