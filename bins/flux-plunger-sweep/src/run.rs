//! The sweeper's commands.

use std::io::Write;
use std::process::ExitCode;
use std::time::Duration;

use plunger::error::describe;
use plunger::install::Install;
use plunger::release::api::helmreleases;
use plunger::release::view::ReleaseView;
use plunger::sweep::hook::{HookConfig, run_hook};
use plunger::sweep::plan::{Budget, ReleasePlan, Row, Suspension};
use plunger::sweep::{NotReleased, Refusals, Uninstall, list_rows, release_with_retry};

use crate::cli::{Command, HookArgs, ListArgs, Output, ReleaseArgs};

/// How long `release` retries a release that keeps changing or a refused write.
const RELEASE_RETRY_WINDOW: Duration = Duration::from_secs(30);
/// How long its last request may then take.
const RELEASE_FINISH_MARGIN: Duration = Duration::from_secs(10);

pub async fn run(command: Command) -> anyhow::Result<ExitCode> {
    match command {
        Command::Hook(args) => hook(args).await,
        Command::List(args) => list(args).await,
        Command::Release(args) => release(args).await,
    }
}

async fn hook(args: HookArgs) -> anyhow::Result<ExitCode> {
    args.log.init();
    let Some(namespace) = args.namespace.filter(|n| !n.is_empty()) else {
        eprintln!(
            "flux-plunger-sweep: --namespace (or POD_NAMESPACE) is required: where the flux-plunger Deployment and its Lease are"
        );
        return Ok(ExitCode::from(2));
    };
    let timings = plunger::test_hooks::hook_timings(args.grace.timings);
    let client = args.kube.client().await?;
    let config = HookConfig {
        install: Install::from_lease(&namespace, &args.leader_election_lease_name),
        namespace,
        deployment: args.deployment,
        pod_selector: args.pod_selector,
        lease: args.leader_election_lease_name,
        scope: args.scope.scope(),
        retry_window: timings.hook_retry_window,
        pod_wait: timings.hook_pod_wait,
        finish_margin: timings.hook_finish_margin,
    };
    let report = run_hook(&client, &config).await;
    let mut out = std::io::stdout().lock();
    for line in &report.lines {
        writeln!(out, "{line}")?;
    }
    if report.success {
        writeln!(out, "every fence was released")?;
        Ok(ExitCode::SUCCESS)
    } else {
        writeln!(
            out,
            "failing the hook so that helm-controller retries the uninstall (hook included) instead of stranding a fence"
        )?;
        Ok(ExitCode::FAILURE)
    }
}

fn suspension_text(s: Suspension) -> &'static str {
    match s {
        Suspension::None => "-",
        Suspension::Ours => "flux-plunger",
        Suspension::Shared => "flux-plunger+other",
        Suspension::Foreign => "other",
        Suspension::LeftBehind => "left-behind?",
    }
}

async fn list(args: ListArgs) -> anyhow::Result<ExitCode> {
    args.log.init();
    let client = args.kube.client().await?;
    let rows = match list_rows(&client, &args.scope.scope()).await {
        Ok(rows) => rows,
        Err(err) => {
            eprintln!("could not list HelmReleases: {}", describe(&err));
            return Ok(ExitCode::FAILURE);
        }
    };
    let mut out = std::io::stdout().lock();
    match args.output {
        Output::Json => writeln!(out, "{}", serde_json::to_string_pretty(&rows)?)?,
        Output::Table => {
            writeln!(
                out,
                "{:<50} {:>6} {:<20} {:<12} {:<11} FENCED-BY",
                "RELEASE", "FENCES", "SUSPENDED-BY", "TERMINATING", "UNINSTALLED"
            )?;
            for Row {
                namespace,
                name,
                fences,
                suspension,
                terminating,
                uninstall_reached,
                fenced_by,
            } in &rows
            {
                writeln!(
                    out,
                    "{:<50} {:>6} {:<20} {:<12} {:<11} {}",
                    format!("{namespace}/{name}"),
                    fences,
                    suspension_text(*suspension),
                    if *terminating { "yes" } else { "no" },
                    if !terminating {
                        "-"
                    } else if *uninstall_reached {
                        "yes"
                    } else {
                        "no"
                    },
                    fenced_by.as_deref().unwrap_or("-"),
                )?;
            }
            if rows.iter().any(|r| r.suspension == Suspension::LeftBehind) {
                writeln!(
                    out,
                    "\nleft-behind?: suspended by another manager on a release flux-plunger recovered before, most likely by an older flux-plunger stopped mid-recovery. Confirm nothing else holds it, then `flux resume helmrelease NAME -n NAMESPACE`."
                )?;
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

async fn release(args: ReleaseArgs) -> anyhow::Result<ExitCode> {
    args.log.init();
    let client = args.kube.client().await?;
    let (namespace, name) = &args.release;
    let key = format!("{namespace}/{name}");
    let object = match helmreleases(client.clone(), namespace).get_opt(name).await {
        Ok(Some(object)) => object,
        Ok(None) => {
            eprintln!("HelmRelease {key} not found");
            return Ok(ExitCode::FAILURE);
        }
        Err(err) => {
            eprintln!("could not read {key}: {}", describe(&err));
            return Ok(ExitCode::FAILURE);
        }
    };
    let release = ReleaseView::from_object(&object);
    let plan = ReleasePlan::of(&release);
    if plan.is_empty() {
        println!(
            "{key} carries no flux-plunger fence and no suspension flux-plunger alone holds: nothing to do"
        );
        return Ok(ExitCode::SUCCESS);
    }
    if release.suspend && !plan.lift_suspension {
        println!(
            "{key}: its suspension is held by another manager (alone or with flux-plunger) and is left as it is"
        );
    }
    let uninstall = if args.without_uninstall {
        Uninstall::MaySkip
    } else {
        Uninstall::MustNotSkip
    };
    let budget = Budget::from_now(RELEASE_RETRY_WINDOW, RELEASE_FINISH_MARGIN);
    match release_with_retry(&client, release, budget, uninstall, Refusals::End).await {
        Ok(released) if released.without_uninstall => {
            println!("released {key} WITHOUT an uninstall, as asked");
            Ok(ExitCode::SUCCESS)
        }
        Ok(_) => {
            println!("released {key}");
            Ok(ExitCode::SUCCESS)
        }
        Err(NotReleased::WouldSkipUninstall) => {
            eprintln!(
                "refusing: {key} is being deleted and helm-controller has not uninstalled it; releasing the fence now lets it go without the Helm uninstall. Wait for helm-controller, or pass --without-uninstall once you have confirmed the uninstall has run or is not wanted."
            );
            Ok(ExitCode::FAILURE)
        }
        Err(NotReleased::Failed(err)) => {
            eprintln!("NOT released {key}: {}", describe(&err));
            Ok(ExitCode::FAILURE)
        }
    }
}
