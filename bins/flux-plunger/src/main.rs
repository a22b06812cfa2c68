//! flux-plunger: the controller (SPEC §4-§5).
#![forbid(unsafe_code)]

use clap::Parser;

/// Recovers Flux HelmReleases stuck with "has no deployed releases".
#[derive(Parser, Debug)]
#[command(version, about, long_about)]
struct Args {
    /// The pod's termination grace period in seconds (40..140).
    #[arg(long, default_value_t = plunger::timings::DEFAULT_GRACE_PERIOD_SECONDS)]
    shutdown_grace_period_seconds: u64,
}

fn main() -> std::process::ExitCode {
    let _args = Args::parse();
    eprintln!("flux-plunger: the controller is not implemented yet; refusing to pretend");
    std::process::ExitCode::FAILURE
}
