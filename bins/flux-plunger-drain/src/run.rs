//! The sidecar's life: idle until SIGTERM, then drain if this pod was the
//! last leader, keeping the Lease while it writes, hand the Lease over, and
//! say what is left.

use std::process::ExitCode;
use std::time::Instant;

use futures::future::BoxFuture;
use plunger::drain::{DrainReport, Ending, drain};
use plunger::lease::{Claim, LeaseLock, Renewal};
use plunger::reconcile::Reconciler;
use plunger::timings::Timings;
use tokio::sync::{oneshot, watch};

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
    tracing::info!(identity = %identity, drain_deadline = ?timings.drain_deadline, "idle until SIGTERM");
    wait_for_stop().await?;
    // The deadline counts from SIGTERM, which the kubelet sends us only once
    // the controller container has exited. The work stops a little earlier,
    // so that the handover and the report fit inside it.
    let deadline = Instant::now() + timings.drain_deadline;
    let work_until = deadline - timings.drain_handover_reserve;
    let (claim_tx, claim_rx) = watch::channel(Claim::Until(Instant::now()));
    let writer = args.kube.writer_client(claim_rx.clone()).await?;
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
        Some(Renewal::Renewed) => {
            let _ = claim_tx.send(Claim::Until(sent + timings.lease_renew_deadline));
        }
        Some(Renewal::NotOurs(holder)) => {
            tracing::info!(holder = ?holder, "the Lease moved on: nothing to drain");
            return Ok(ExitCode::SUCCESS);
        }
        None => return Ok(unknown("could not renew the leader Lease")),
    }

    let (done, done_rx) = oneshot::channel();
    let keeper = tokio::spawn(keep_lease(lock, timings, sent, claim_tx, done_rx));
    let events = args.events.events(writer.clone(), &identity);
    let reconciler = Reconciler::new(writer.clone(), events, timings)
        .letting_go()
        .with_test_hooks_from_env();
    let scope = args.scope.scope();
    let report = drain(
        &writer,
        &reconciler,
        &scope,
        claim_rx,
        work_until,
        usize::from(args.concurrent),
    )
    .await;
    let _ = done.send(());
    if let Ok(lock) = keeper.await {
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

async fn wait_for_stop() -> anyhow::Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: draining"),
        _ = int.recv() => tracing::info!("SIGINT: draining"),
    }
    Ok(())
}

/// Renews the Lease every retry period until `done` fires, then returns the
/// lock for the handover (which clears the holder only if it is still us).
/// Each success extends the claim to a renew deadline after the renewal was
/// sent; a failed renewal leaves the claim to lapse, and the next success
/// (the Lease still ours: nobody wrote it since) restores it. The claim is
/// lost for good when the Lease names someone else or nobody, or when it
/// could have expired (no renewal for a whole Lease duration).
async fn keep_lease(
    mut lock: LeaseLock,
    timings: Timings,
    mut last_renewal: Instant,
    claim: watch::Sender<Claim>,
    mut done: oneshot::Receiver<()>,
) -> LeaseLock {
    loop {
        tokio::select! {
            _ = &mut done => return lock,
            () = tokio::time::sleep(timings.lease_retry_period) => {}
        }
        if *claim.borrow() == Claim::Lost {
            continue;
        }
        let sent = Instant::now();
        // The drain's end does not wait for a renewal under way: the
        // handover reads the Lease afresh anyway.
        let renewal = tokio::select! {
            _ = &mut done => None,
            renewal = tokio::time::timeout(timings.lease_retry_period, lock.renew()) => Some(renewal),
        };
        match renewal {
            None => return lock,
            Some(Ok(Ok(Renewal::Renewed))) => {
                last_renewal = sent;
                let _ = claim.send(Claim::Until(sent + timings.lease_renew_deadline));
                continue;
            }
            Some(Ok(Ok(Renewal::NotOurs(holder)))) => {
                tracing::error!(holder = ?holder, "the Lease is no longer ours: stopped writing");
                let _ = claim.send(Claim::Lost);
                continue;
            }
            Some(Ok(Err(err))) => {
                tracing::warn!(error = %err, "could not renew the Lease during the drain")
            }
            Some(Err(_)) => tracing::warn!("renewing the Lease during the drain timed out"),
        }
        if last_renewal.elapsed() >= timings.lease_duration {
            tracing::error!(
                "the Lease was not renewed for its whole duration and could have expired: stopped writing"
            );
            let _ = claim.send(Claim::Lost);
        }
    }
}
