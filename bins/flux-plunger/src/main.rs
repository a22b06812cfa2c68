//! flux-plunger: the controller (SPEC §4-§5).
#![forbid(unsafe_code)]

use clap::Parser;
use flux_plunger::cli::Args;

fn main() -> std::process::ExitCode {
    let _args = Args::parse();
    eprintln!("flux-plunger: the controller has not landed yet; refusing to pretend");
    std::process::ExitCode::FAILURE
}
