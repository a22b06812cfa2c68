//! The sidecar's life: idle until SIGTERM, then drain if this pod was the
//! last leader, keeping the Lease while it writes, hand the Lease over, and
//! say what is left.

use std::process::ExitCode;
use std::time::Instant;

use futures::future::BoxFuture;
use plunger::drain::{DrainReport, Ending, drain};
use plunger::lease::{self, Keeping, LeaseLock, Renewal};
use plunger::reconcile::{Controls, Reconciler};

use crate::cli::Args;

/// The exit code when something of flux-plunger's is, or may be, left: the
/// next flux-plunger or the chart's pre-delete hook must release it.
pub const EXIT_LEFT: u8 = 3;

/// How often a read that decides whether to drain is tried again.
const RETRY: std::time::Duration = std::time::Duration::from_millis(500);

/// Waits for SIGTERM (or SIGINT), then drains.
pub async fn run(args: Args) -> anyhow::Result<ExitCode> {
    args.log.init();
    let timings = args.grace.timings;
    let identity = args.lease.identity();
    let namespace = args
        .lease
        .namespace("the drain acts only for the Lease holder")?;
    // Listening before saying so: a SIGTERM that came between the line and
    // the listening would kill the process undrained (the default action).
    let stop = StopSignals::listen()?;
    tracing::info!(identity = %identity, drain_deadline = ?timings.drain_deadline, "idle until SIGTERM");
    stop.wait().await;
    // The deadline counts from SIGTERM, which the kubelet sends us only once
    // the controller container has exited. The work stops a little earlier,
    // so that the handover and the report fit inside it.
    let deadline = Instant::now() + timings.drain_deadline;
    let work_until = deadline - timings.drain_handover_reserve;
    let mut lock = LeaseLock::new(
        args.kube.client().await?,
        &namespace,
        &args.lease.leader_election_lease_name,
        &identity,
        timings.lease_duration,
    );

    // Without knowing who leads, writing could race the leader: read until
    // the apiserver answers (a read is always safe), then renew.
    let holder = until_answered(work_until, "reading the leader Lease", &mut lock, |lock| {
        Box::pin(lock.holder())
    })
    .await;
    match holder {
        Some(Some(holder)) if holder == identity => {}
        Some(holder) => {
            tracing::info!(holder = ?holder, "this pod is not the last leader: nothing to drain");
            return Ok(ExitCode::SUCCESS);
        }
        None => return Ok(unknown("could not read the leader Lease")),
    }
    let sent = Instant::now();
    let renewal = until_answered(work_until, "renewing the leader Lease", &mut lock, |lock| {
        Box::pin(lock.renew())
    })
    .await;
    match renewal {
        Some(Renewal::Renewed) => {}
        Some(Renewal::NotOurs(holder)) => {
            tracing::info!(holder = ?holder, "the Lease moved on: nothing to drain");
            return Ok(ExitCode::SUCCESS);
        }
        None => return Ok(unknown("could not renew the leader Lease")),
    }

    let leading = lease::lead(lock, sent, Keeping::drain(&timings));
    let writer = args.kube.writer_client(leading.leadership()).await?;
    let events = args.events.events(writer.clone(), &identity);
    let reconciler = Reconciler::new(writer.clone(), events, timings)
        .with_controls(Controls {
            default_service_account: args.tenancy.default_service_account.clone(),
            ..Controls::default()
        })
        .with_install(args.lease.install())
        .letting_go()
        .with_test_hooks_from_env();
    let scope = args.scope.scope();
    let report = drain(
        &writer,
        &reconciler,
        &scope,
        leading.leadership(),
        work_until,
        usize::from(args.concurrent),
    )
    .await;
    if let Some(lock) = leading.stop().await {
        hand_over(&lock, deadline).await;
    }
    Ok(log_report(&report))
}

/// Tries `op` on `lock` until it answers or `until` passes (`None`).
async fn until_answered<T>(
    until: Instant,
    what: &str,
    lock: &mut LeaseLock,
    op: impl for<'a> Fn(&'a mut LeaseLock) -> BoxFuture<'a, kube::Result<T>>,
) -> Option<T> {
    loop {
        match tokio::time::timeout_at(until.into(), op(lock)).await {
            Ok(Ok(value)) => return Some(value),
            Ok(Err(err)) => tracing::warn!(error = %err, "{what} failed; retrying"),
            Err(_) => return None,
        }
        if Instant::now() + RETRY >= until {
            return None;
        }
        tokio::time::sleep(RETRY).await;
    }
}

/// The apiserver never answered before the deadline: nothing was drained, and
/// what is left is unknown.
fn unknown(what: &str) -> ExitCode {
    tracing::warn!(
        "{what} before the drain deadline: the apiserver did not answer; nothing was drained and flux-plunger's fences may be left; the next flux-plunger or the chart's pre-delete hook releases them"
    );
    ExitCode::from(EXIT_LEFT)
}

/// Clears the holder if the Lease is still ours, within the deadline.
async fn hand_over(lock: &LeaseLock, deadline: Instant) {
    match tokio::time::timeout_at(deadline.into(), lock.release()).await {
        Ok(Ok(true)) => tracing::info!("handed the Lease over"),
        Ok(Ok(false)) => tracing::info!("the Lease was no longer ours to hand over"),
        Ok(Err(err)) => {
            tracing::warn!(error = %err, "could not hand the Lease over; it expires on its own")
        }
        Err(_) => tracing::warn!(
            "no answer to the handover before the drain deadline; the Lease expires on its own"
        ),
    }
}

/// The report's last lines, and the exit code that goes with them.
fn log_report(report: &DrainReport) -> ExitCode {
    let left: Vec<String> = report.left.iter().map(ToString::to_string).collect();
    let suspensions = report.left.iter().filter(|l| l.suspended).count();
    let why = match report.ending {
        Ending::Done => {
            tracing::info!(
                found = report.found,
                released = report.released,
                failed_listings = report.failed_listings,
                "drain complete: no fence left"
            );
            return ExitCode::SUCCESS;
        }
        Ending::Deadline => "drain deadline reached",
        Ending::LeaseLost => "lost the Lease during the drain: stopped writing",
    };
    match report.found {
        None => tracing::warn!(
            failed_listings = report.failed_listings,
            last_error = report.last_error.as_deref(),
            "{why} before any listing of flux-plunger's fences succeeded: fences may be left; the next flux-plunger or the chart's pre-delete hook releases them"
        ),
        Some(found) => tracing::warn!(
            found,
            released = report.released,
            left = left.len(),
            suspensions,
            failed_listings = report.failed_listings,
            last_error = report.last_error.as_deref(),
            "{why} with fences left: {} fences and {suspensions} suspensions of flux-plunger's are left on {}; the next flux-plunger or the chart's pre-delete hook releases them",
            left.len(),
            if left.is_empty() {
                "nothing".to_owned()
            } else {
                left.join(", ")
            }
        ),
    }
    if report.anything_left() {
        ExitCode::from(EXIT_LEFT)
    } else {
        ExitCode::SUCCESS
    }
}

/// SIGTERM and SIGINT, caught from the moment this is made.
struct StopSignals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

impl StopSignals {
    fn listen() -> std::io::Result<Self> {
        use tokio::signal::unix::{SignalKind, signal};
        Ok(Self {
            term: signal(SignalKind::terminate())?,
            int: signal(SignalKind::interrupt())?,
        })
    }

    async fn wait(mut self) {
        tokio::select! {
            _ = self.term.recv() => tracing::info!("SIGTERM: draining"),
            _ = self.int.recv() => tracing::info!("SIGINT: draining"),
        }
    }
}
