//! flux-plunger-drain: the native sidecar that releases flux-plunger's fences
//! when its pod stops (SPEC §6).
#![forbid(unsafe_code)]

use std::process::ExitCode;

use clap::Parser;
use flux_plunger_drain::cli::Args;

// Two worker threads, whatever the node (why: flux-plunger's main.rs).
#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> ExitCode {
    let args = Args::parse();
    match flux_plunger_drain::run::run(args).await {
        Ok(code) => code,
        Err(err) => {
            eprintln!("flux-plunger-drain: {err:#}");
            ExitCode::FAILURE
        }
    }
}
