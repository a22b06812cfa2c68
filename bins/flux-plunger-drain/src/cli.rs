//! The drain sidecar's flags.

use clap::Parser;
use plunger::cli::{EventsArgs, GraceArgs, KubeArgs, LeaseArgs, LogArgs, TenancyArgs};
use plunger::scope::ScopeArgs;

/// Drains flux-plunger's uninstall fences when its pod stops.
///
/// Runs as a native sidecar (an init container with restartPolicy Always)
/// beside the controller and idles until SIGTERM, which the kubelet sends only
/// after the controller container has exited. Then, if this pod holds the
/// leader Lease, it lifts flux-plunger's suspensions and fences within the
/// drain deadline (grace period - 25 s), keeping the Lease while it writes
/// and handing it over when done.
#[derive(Parser, Debug)]
#[command(name = "flux-plunger-drain", version, about, long_about)]
pub struct Args {
    #[command(flatten)]
    pub kube: KubeArgs,
    #[command(flatten)]
    pub log: LogArgs,
    #[command(flatten)]
    pub lease: LeaseArgs,
    #[command(flatten)]
    pub grace: GraceArgs,
    #[command(flatten)]
    pub events: EventsArgs,
    /// The controller's scope: only fences there are drained.
    #[command(flatten)]
    pub scope: ScopeArgs,
    /// Whose access bounds ours in a release's storage.
    #[command(flatten)]
    pub tenancy: TenancyArgs,
    /// How many releases are drained at once.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u16).range(1..=256))]
    pub concurrent: u16,
}
