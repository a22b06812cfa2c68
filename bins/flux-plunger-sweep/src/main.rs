//! flux-plunger-sweep: the chart's pre-delete hook (SPEC §8).
#![forbid(unsafe_code)]

use clap::Parser;
use flux_plunger_sweep::cli::Args;

fn main() -> std::process::ExitCode {
    let _args = Args::parse();
    eprintln!(
        "flux-plunger-sweep: the sweep has not landed yet (see the sweeper issue); refusing to pretend"
    );
    std::process::ExitCode::FAILURE
}
