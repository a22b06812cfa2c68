//! flux-plunger-sweep: the chart's pre-delete hook (SPEC §8).
#![forbid(unsafe_code)]

use clap::Parser;

/// Releases every flux-plunger fence when the chart is removed.
///
/// Runs as the chart's pre-delete hook Job: stops the flux-plunger Deployment,
/// waits for its pods, then lifts the suspensions flux-plunger alone holds and
/// removes every uninstall fence.
#[derive(Parser, Debug)]
#[command(version, about, long_about)]
struct Args {
    /// The pod's termination grace period in seconds (40..140); the pod wait
    /// derives from it.
    #[arg(long, default_value_t = plunger::timings::DEFAULT_GRACE_PERIOD_SECONDS)]
    shutdown_grace_period_seconds: u64,
}

fn main() -> std::process::ExitCode {
    let _args = Args::parse();
    eprintln!(
        "flux-plunger-sweep: the sweep is not implemented yet (issue: sweeper); refusing to pretend"
    );
    std::process::ExitCode::FAILURE
}
