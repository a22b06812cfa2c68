//! The controller's flags.

use std::net::SocketAddr;

use clap::{ArgAction, Parser};
use plunger::cli::{
    EventsArgs, GraceArgs, KubeArgs, LeaseArgs, LogArgs, TenancyArgs, parse_listen_addr,
};
use plunger::scope::ScopeArgs;

/// Recovers Flux HelmReleases stuck with "has no deployed releases".
///
/// flux-plunger briefly suspends a stuck HelmRelease, deletes its newest Helm
/// storage Secret, records the revision it reclaimed and lifts the
/// suspension. While it holds the suspension it also holds an uninstall fence
/// (the finalizer flux-plunger.cozystack.io/uninstall-fence), so that a delete
/// landing meanwhile still reaches helm-controller's Helm uninstall.
#[derive(Parser, Debug)]
#[command(name = "flux-plunger", version, about, long_about)]
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
    /// How many HelmReleases are reconciled at once.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u16).range(1..=256))]
    pub concurrent: u16,
    /// Where /metrics is served (Prometheus text format).
    #[arg(long, default_value = ":8080", value_parser = parse_listen_addr, value_name = "ADDR")]
    pub metrics_addr: SocketAddr,
    /// Where /healthz and /readyz are served.
    #[arg(long, default_value = ":9440", value_parser = parse_listen_addr, value_name = "ADDR")]
    pub health_addr: SocketAddr,
    /// Act only while holding the leader Lease, so that one flux-plunger
    /// writes at a time. Turn off only when a single process is guaranteed.
    #[arg(
        long,
        alias = "enable-leader-election",
        action = ArgAction::Set,
        default_value_t = true,
        num_args = 0..=1,
        default_missing_value = "true",
        value_name = "BOOL"
    )]
    pub leader_elect: bool,
    /// Decide and report (log, event, metric) what would be done, and write
    /// nothing to any HelmRelease or Secret.
    #[arg(long)]
    pub dry_run: bool,
    /// Which HelmReleases are watched.
    #[command(flatten)]
    pub scope: ScopeArgs,
    /// Whose access bounds ours in a release's storage.
    #[command(flatten)]
    pub tenancy: TenancyArgs,
    /// Start at most this many recoveries per minute (a burst up to it, then
    /// evenly spread); 0 means no limit.
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub max_recoveries_per_minute: u32,
}
