//! flux-plunger-drain: the native sidecar that releases flux-plunger's fences
//! when its pod stops (SPEC §6).
#![forbid(unsafe_code)]

use clap::Parser;

/// Drains flux-plunger's uninstall fences on SIGTERM.
///
/// Runs as a native sidecar (an init container with restartPolicy Always) next
/// to the controller. The kubelet sends it SIGTERM only after the controller
/// has exited; then, if this pod was the last leader, it lifts flux-plunger's
/// suspensions and fences within the drain deadline (grace period - 25 s).
#[derive(Parser, Debug)]
#[command(version, about, long_about)]
struct Args {
    /// The pod's termination grace period in seconds (40..140); the drain
    /// deadline derives from it.
    #[arg(long, default_value_t = plunger::timings::DEFAULT_GRACE_PERIOD_SECONDS)]
    shutdown_grace_period_seconds: u64,
}

fn main() -> std::process::ExitCode {
    let _args = Args::parse();
    eprintln!(
        "flux-plunger-drain: the drain is not implemented yet (issue: shutdown); refusing to pretend"
    );
    std::process::ExitCode::FAILURE
}
