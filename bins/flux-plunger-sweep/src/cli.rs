//! The sweeper's flags and subcommands.

use clap::{Args as ClapArgs, Parser, Subcommand, ValueEnum};
use plunger::cli::{GraceArgs, KubeArgs, LogArgs};
use plunger::scope::ScopeArgs;

/// Releases flux-plunger's uninstall fences: the chart's pre-delete hook (the
/// default command), and operator commands to list and release leftovers.
#[derive(Parser, Debug)]
#[command(
    name = "flux-plunger-sweep",
    version,
    about,
    long_about,
    // `flux-plunger-sweep --namespace=...` is `flux-plunger-sweep hook --namespace=...`.
    args_conflicts_with_subcommands = true,
    subcommand_negates_reqs = true
)]
pub struct Args {
    #[command(subcommand)]
    pub command: Option<Command>,
    #[command(flatten)]
    pub hook: HookArgs,
}

impl Args {
    /// The command to run: the hook when none is named.
    pub fn into_command(self) -> Command {
        self.command.unwrap_or(Command::Hook(self.hook))
    }
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
    /// Release one HelmRelease by hand: remove flux-plunger's fence and lift
    /// a suspension flux-plunger alone holds, refusing what is unsafe.
    Release(ReleaseArgs),
}

/// The hook's flags.
#[derive(ClapArgs, Debug)]
pub struct HookArgs {
    #[command(flatten)]
    pub kube: KubeArgs,
    #[command(flatten)]
    pub log: LogArgs,
    /// Namespace of the flux-plunger Deployment and its Lease (required; the
    /// chart passes it through the downward API).
    // Optional to clap: a required flag of the default command would be
    // required of `list` and `release` too. `run` refuses its absence.
    #[arg(long, env = "POD_NAMESPACE", value_name = "NAMESPACE")]
    pub namespace: Option<String>,
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
    /// The controller's scope: only fences there are released.
    #[command(flatten)]
    pub scope: ScopeArgs,
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
    #[command(flatten)]
    pub kube: KubeArgs,
    #[command(flatten)]
    pub log: LogArgs,
    /// Output format.
    #[arg(short = 'o', long, value_enum, default_value_t = Output::Table)]
    pub output: Output,
    /// List only this scope (the install's `--watch-namespace` and
    /// `--watch-label-selector`): a scoped install's ServiceAccount may list
    /// HelmReleases there only.
    #[command(flatten)]
    pub scope: ScopeArgs,
}

/// `release`'s flags.
#[derive(ClapArgs, Debug)]
pub struct ReleaseArgs {
    #[command(flatten)]
    pub kube: KubeArgs,
    #[command(flatten)]
    pub log: LogArgs,
    /// The HelmRelease, as NAMESPACE/NAME.
    #[arg(value_name = "NAMESPACE/NAME", value_parser = parse_key)]
    pub release: (String, String),
    /// Also let go of a release that is being deleted before helm-controller
    /// has uninstalled it. Its Helm uninstall is then skipped: use only once
    /// you have confirmed it has run or is not wanted.
    #[arg(long)]
    pub without_uninstall: bool,
}

fn parse_key(text: &str) -> Result<(String, String), String> {
    match text.split_once('/') {
        Some((ns, name)) if !ns.is_empty() && !name.is_empty() && !name.contains('/') => {
            Ok((ns.to_owned(), name.to_owned()))
        }
        _ => Err(format!("{text:?} is not NAMESPACE/NAME")),
    }
}
