//! The sweeper's flags and subcommands.

use clap::{Args as ClapArgs, Parser, Subcommand, ValueEnum};
use plunger::cli::{GraceArgs, KubeArgs, LogArgs};

/// Releases flux-plunger's uninstall fences: the chart's pre-delete hook, and
/// operator commands to list and release leftovers.
#[derive(Parser, Debug)]
#[command(name = "flux-plunger-sweep", version, about, long_about)]
pub struct Args {
    #[command(flatten)]
    pub kube: KubeArgs,
    #[command(flatten)]
    pub log: LogArgs,
    #[command(subcommand)]
    pub command: Option<Command>,
}

// Parsed once at start; the size of the hook's variant (its Timings) is moot.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand, Debug)]
pub enum Command {
    /// The pre-delete hook (the default): stop flux-plunger, wait for its
    /// pods, lift the suspensions it alone holds and remove every fence.
    Hook(HookArgs),
    /// List fenced releases, suspensions flux-plunger holds, and suspensions
    /// an older flux-plunger probably left behind.
    List(ListArgs),
    /// Release one HelmRelease by hand: lift flux-plunger's sole suspension
    /// and remove its fence, refusing what is unsafe.
    Release(ReleaseArgs),
}

/// The hook's flags.
#[derive(ClapArgs, Debug)]
pub struct HookArgs {
    /// Namespace of the flux-plunger Deployment and its Lease.
    #[arg(long, env = "POD_NAMESPACE", value_name = "NAMESPACE")]
    pub namespace: String,
    /// The flux-plunger Deployment to stop.
    #[arg(long, default_value = "flux-plunger", value_name = "NAME")]
    pub deployment: String,
    /// Label selector of the flux-plunger pods to wait for.
    #[arg(
        long,
        default_value = "app.kubernetes.io/name=flux-plunger",
        value_name = "SELECTOR"
    )]
    pub pod_selector: String,
    /// The leader Lease, removed once no flux-plunger pod is left.
    #[arg(long, default_value = "flux-plunger", value_name = "NAME")]
    pub leader_election_lease_name: String,
    #[command(flatten)]
    pub grace: GraceArgs,
}

/// Output format of `list`.
#[derive(ValueEnum, Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Output {
    #[default]
    Table,
    Json,
}

/// `list`'s flags.
#[derive(ClapArgs, Debug)]
pub struct ListArgs {
    /// Output format.
    #[arg(short = 'o', long, value_enum, default_value_t = Output::Table)]
    pub output: Output,
}

/// `release`'s flags.
#[derive(ClapArgs, Debug)]
pub struct ReleaseArgs {
    /// The HelmRelease, as NAMESPACE/NAME.
    #[arg(value_name = "NAMESPACE/NAME")]
    pub release: String,
}
