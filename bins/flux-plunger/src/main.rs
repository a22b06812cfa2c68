//! flux-plunger: the controller (SPEC §4-§5).
#![forbid(unsafe_code)]

use std::process::ExitCode;

use clap::Parser;
use flux_plunger::cli::Args;

#[tokio::main]
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
