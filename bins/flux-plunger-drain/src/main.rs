//! flux-plunger-drain: the native sidecar that releases flux-plunger's fences
//! when its pod stops (SPEC §6).
#![forbid(unsafe_code)]

use clap::Parser;
use flux_plunger_drain::cli::Args;

fn main() -> std::process::ExitCode {
    let _args = Args::parse();
    eprintln!(
        "flux-plunger-drain: the drain has not landed yet (see the shutdown issue); refusing to pretend"
    );
    std::process::ExitCode::FAILURE
}
