//! Wiring: logging, the HTTP endpoints, leader election, the controller, and
//! the bounded stop on SIGTERM (SPEC §6).

use std::process::ExitCode;
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use anyhow::{Context as _, bail};
use kube::api::DynamicObject;
use kube::runtime::reflector::Store;
use plunger::lease::{self, Keeping, LeaseLock};
use plunger::ratelimit::RateLimiter;
use plunger::reconcile::{Controls, Reconciler};
use tokio::sync::watch;

use crate::cli::Args;
use crate::controller::{self, Context};
use crate::metrics::Metrics;
use crate::outside;
use crate::server::{self, Readiness};

/// Why the controller stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stop {
    Running,
    /// SIGTERM or SIGINT: stop within the bound, keep the Lease.
    Signal,
    /// The Lease could not be renewed in time: stop writing at once.
    LostLease,
}

/// How long the controller waits for the apiserver's first answer at start.
const APISERVER_PATIENCE: std::time::Duration = std::time::Duration::from_secs(10);

/// Runs the controller until it is told to stop: the endpoints, the Lease
/// (when elected), the watches, then the bounded stop.
pub async fn run(args: Args) -> anyhow::Result<ExitCode> {
    args.log.init();
    let timings = args.grace.timings;
    // Fail loudly (and be restarted) rather than run blind: nothing below can
    // work without the apiserver.
    let client = args.kube.answering_client(APISERVER_PATIENCE).await?;
    let scope = args.scope.scope();
    // A selector the apiserver refuses fails every listing of the watch, and
    // /readyz would stay 503 for good: exit with the apiserver's reason
    // instead, where the pod's status shows it.
    if let Err(why) = scope.check_selector(&client).await {
        bail!(why);
    }
    let identity = args.lease.identity();
    let metrics = Arc::new(Metrics::default());
    let readiness = Readiness::default();
    let stores = serve_endpoints(&args, &identity, &metrics, &readiness).await?;

    let (stop_tx, mut stop_rx) = watch::channel(Stop::Running);
    tokio::spawn(stop_on_signal(stop_tx.clone()));
    let leading = if args.leader_elect {
        let Some(leading) = lead(&args, &client, &identity, &readiness, &metrics, &stop_tx).await?
        else {
            tracing::info!("stopped before becoming the leader");
            return Ok(ExitCode::SUCCESS);
        };
        Some(leading)
    } else {
        tracing::warn!("leader election is off: run exactly one flux-plunger against this cluster");
        None
    };

    let (reconciler, outside) = reconcilers(&args, &client, &identity);
    let ctx = Arc::new(Context::new(reconciler, metrics.clone()));
    let (stores_tx, stores_rx) = tokio::sync::oneshot::channel();
    let (left_selector_tx, left_selector_rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(outside::settle_fences_outside_selector(
        client.clone(),
        outside,
        scope.clone(),
        metrics.clone(),
        timings.fence_recheck_interval,
        left_selector_rx,
        stopped(stop_rx.clone()),
    ));
    let mut controller_task = tokio::spawn(controller::run(
        client,
        ctx,
        scope,
        args.concurrent,
        controller::WatchReports {
            readiness,
            left_selector: left_selector_tx,
            stores: stores_tx,
        },
        stopped(stop_rx.clone()),
    ));
    if let Ok(watched) = stores_rx.await {
        let _ = stores.set(watched);
    }

    match until_stopped_or_ended(&mut stop_rx, &mut controller_task).await? {
        Ended::Stopped(stop) => Ok(stop_controller(stop, controller_task, leading, &timings).await),
        Ended::OnItsOwn(ended) => {
            // Nothing is watched or reconciled any more, yet the Lease and
            // the probes would go on: exit, so that the kubelet restarts the
            // container and the next leader takes over.
            match ended {
                Ok(()) => tracing::error!("the controller stopped on its own"),
                Err(err) => tracing::error!(error = %err, "the controller task failed"),
            }
            Ok(ExitCode::FAILURE)
        }
    }
}

/// Where the watch's caches are published once it runs, for `/metrics`.
type WatchedStores = Arc<OnceLock<Vec<Store<DynamicObject>>>>;

/// Binds and serves `/metrics` and the probes from the start: a standby's
/// `/metrics` says `flux_plunger_leader 0`; the gauges of the watch's cache
/// come once the watch runs, on the leader.
async fn serve_endpoints(
    args: &Args,
    identity: &str,
    metrics: &Arc<Metrics>,
    readiness: &Readiness,
) -> anyhow::Result<WatchedStores> {
    let metrics_listener = server::bind(args.metrics_addr, "--metrics-addr").await?;
    let health_listener = server::bind(args.health_addr, "--health-addr").await?;
    tracing::info!(
        metrics = %metrics_listener.local_addr()?,
        health = %health_listener.local_addr()?,
        identity = %identity,
        grace_period_seconds = args.grace.timings.grace_period.as_secs(),
        "flux-plunger starting"
    );
    tokio::spawn(server::serve_health(health_listener, readiness.clone()));
    let stores: WatchedStores = Arc::default();
    tokio::spawn(server::serve_metrics(metrics_listener, metrics.clone(), {
        let stores = stores.clone();
        move |m| {
            if let Some(stores) = stores.get() {
                controller::refresh_gauges(stores, m);
            }
        }
    }));
    Ok(stores)
}

/// Waits to lead (ready meanwhile, as a candidate works as it should while
/// it waits), then leads: `None` when stopped first. A lost Lease stops the
/// controller at once.
async fn lead(
    args: &Args,
    client: &kube::Client,
    identity: &str,
    readiness: &Readiness,
    metrics: &Metrics,
    stop_tx: &watch::Sender<Stop>,
) -> anyhow::Result<Option<lease::Leading>> {
    let timings = args.grace.timings;
    let namespace = args
        .lease
        .namespace("--leader-elect keeps its Lease there")?;
    let mut lock = LeaseLock::new(
        client.clone(),
        &namespace,
        &args.lease.leader_election_lease_name,
        identity,
        timings.lease_duration,
    );
    readiness.set_ready();
    let stop = stopped(stop_tx.subscribe());
    let Some(renewed_at) = lease::wait_to_lead(&mut lock, timings.lease_retry_period, stop).await
    else {
        return Ok(None);
    };
    readiness.set_syncing();
    metrics.leader.set(1);
    let leading = lease::lead(lock, renewed_at, Keeping::controller(&timings));
    let lost = leading.lost();
    let stop = stop_tx.clone();
    tokio::spawn(async move {
        lost.await;
        let _ = stop.send(Stop::LostLease);
    });
    Ok(Some(leading))
}

/// The reconciler of the watched releases, and the one that settles this
/// install's fences outside its label selector, which lets go and never
/// recovers.
fn reconcilers(args: &Args, client: &kube::Client, identity: &str) -> (Reconciler, Reconciler) {
    let timings = args.grace.timings;
    let events = args.events.events(client.clone(), identity);
    if args.dry_run {
        tracing::warn!(
            "dry run: decisions are logged, recorded as events and counted; nothing is written"
        );
    }
    let install = args.lease.install();
    let controls = |rate_limit| Controls {
        dry_run: args.dry_run,
        rate_limit,
        default_service_account: args.tenancy.default_service_account.clone(),
    };
    let outside = Reconciler::new(client.clone(), events.clone(), timings)
        .with_controls(controls(None))
        .with_install(install.clone())
        .letting_go();
    let reconciler = Reconciler::new(client.clone(), events, timings)
        .with_controls(controls(RateLimiter::per_minute(
            args.max_recoveries_per_minute,
        )))
        .with_install(install)
        .with_test_hooks_from_env();
    (reconciler, outside)
}

/// Resolves once the controller is told to stop.
async fn stopped(mut stop_rx: watch::Receiver<Stop>) {
    let _ = stop_rx.wait_for(|s| *s != Stop::Running).await;
}

/// SPEC §6: a lost Lease stops every write at once; a signal stops the
/// controller within its bound and keeps the Lease for the drain.
async fn stop_controller(
    stop: Stop,
    mut controller_task: tokio::task::JoinHandle<()>,
    leading: Option<lease::Leading>,
    timings: &plunger::timings::Timings,
) -> ExitCode {
    if stop == Stop::LostLease {
        controller_task.abort();
        tracing::error!("lost the leader Lease: stopped at once; the pod restarts as a candidate");
        return ExitCode::FAILURE;
    }
    // The Lease stays as it is, for the drain.
    if let Some(leading) = leading {
        leading.stop().await;
    }
    let started = Instant::now();
    match tokio::time::timeout(timings.controller_stop_bound, &mut controller_task).await {
        Ok(_) => {
            tracing::info!(took = ?started.elapsed(), "stopped; the Lease is kept for the drain")
        }
        Err(_) => {
            // Dropping an in-flight recovery is safe: what it holds is
            // settled by the drain, or by the next leader.
            controller_task.abort();
            tracing::warn!(bound = ?timings.controller_stop_bound, "in-flight reconciles abandoned at the stop bound; the Lease is kept for the drain");
        }
    }
    ExitCode::SUCCESS
}

/// What ended the wait of [`until_stopped_or_ended`].
enum Ended {
    /// A signal or the lost Lease.
    Stopped(Stop),
    /// The controller task ended though nothing told it to.
    OnItsOwn(Result<(), tokio::task::JoinError>),
}

/// Waits for a stop or for the controller task's end, whichever is first. A
/// stop ends the controller task too, so after a signal both are ready at
/// once: the stop is looked at first, or a clean stop would be taken for a
/// controller that died.
async fn until_stopped_or_ended(
    stop_rx: &mut watch::Receiver<Stop>,
    controller_task: &mut tokio::task::JoinHandle<()>,
) -> anyhow::Result<Ended> {
    Ok(tokio::select! {
        biased;
        stop = stop_rx.wait_for(|s| *s != Stop::Running) => {
            Ended::Stopped(*stop.context("the stop channel closed")?)
        }
        ended = controller_task => Ended::OnItsOwn(ended),
    })
}

async fn stop_on_signal(stop: watch::Sender<Stop>) {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        tracing::error!("cannot listen for SIGTERM/SIGINT");
        return;
    };
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: stopping"),
        _ = int.recv() => tracing::info!("SIGINT: stopping"),
    }
    let _ = stop.send(Stop::Signal);
}

/// Refuses flag combinations clap cannot see.
pub fn validate(args: &Args) -> anyhow::Result<()> {
    if args.metrics_addr == args.health_addr && args.metrics_addr.port() != 0 {
        bail!(
            "--metrics-addr and --health-addr are both {}: give them different ports",
            args.metrics_addr
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// After a signal the controller task ends because of it: every time,
    /// the wait says "stopped", never "ended on its own".
    #[tokio::test]
    async fn a_stop_is_seen_first_when_the_controller_ended_because_of_it() {
        for _ in 0..200 {
            let (stop_tx, mut stop_rx) = watch::channel(Stop::Running);
            let mut told = stop_tx.subscribe();
            let mut task = tokio::spawn(async move {
                let _ = told.wait_for(|s| *s != Stop::Running).await;
            });
            stop_tx.send(Stop::Signal).unwrap();
            while !task.is_finished() {
                tokio::task::yield_now().await;
            }
            let ended = until_stopped_or_ended(&mut stop_rx, &mut task)
                .await
                .unwrap();
            assert!(matches!(ended, Ended::Stopped(Stop::Signal)));
        }
    }

    #[tokio::test]
    async fn a_controller_that_ends_unasked_is_told_apart() {
        let (_stop_tx, mut stop_rx) = watch::channel(Stop::Running);
        let mut task = tokio::spawn(async {});
        let ended = until_stopped_or_ended(&mut stop_rx, &mut task)
            .await
            .unwrap();
        assert!(matches!(ended, Ended::OnItsOwn(Ok(()))));
    }
}
