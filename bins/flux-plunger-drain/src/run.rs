//! The sidecar's life: idle until SIGTERM, then drain if this pod was the
//! last leader, keeping the Lease while it writes, and hand the Lease over.

use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use plunger::drain::{DrainReport, drain};
use plunger::lease::{Attempt, LeaseLock};
use plunger::reconcile::Reconciler;
use plunger::timings::Timings;

use crate::cli::Args;

/// Waits for SIGTERM (or SIGINT), then drains.
pub async fn run(args: Args) -> anyhow::Result<ExitCode> {
    args.log.init();
    let timings = args.grace.shutdown_grace_period_seconds;
    let identity = args.lease.identity();
    let namespace = args
        .lease
        .namespace("the drain acts only for the Lease holder")?;
    tracing::info!(identity = %identity, drain_deadline = ?timings.drain_deadline, "idle until SIGTERM");
    wait_for_stop().await?;
    // The deadline counts from SIGTERM, which the kubelet sends us only once
    // the controller container has exited.
    let deadline = Instant::now() + timings.drain_deadline;
    let client = args.kube.client().await?;
    let mut lock = LeaseLock::new(
        client.clone(),
        &namespace,
        &args.lease.leader_election_lease_name,
        &identity,
        timings.lease_duration,
    );

    match lock.holder().await {
        Ok(Some(holder)) if holder == identity => {}
        Ok(holder) => {
            tracing::info!(holder = ?holder, "this pod is not the last leader: nothing to drain");
            return Ok(ExitCode::SUCCESS);
        }
        Err(err) => {
            // Without knowing who leads, writing could race the leader.
            tracing::error!(error = %err, "cannot read the leader Lease: not draining");
            return Ok(ExitCode::SUCCESS);
        }
    }
    match lock.try_acquire_or_renew().await {
        Ok(Attempt::Held) => {}
        Ok(Attempt::HeldBy(holder)) => {
            tracing::info!(holder = %holder, "the Lease moved on: nothing to drain");
            return Ok(ExitCode::SUCCESS);
        }
        Err(err) => {
            tracing::error!(error = %err, "cannot renew the leader Lease: not draining");
            return Ok(ExitCode::SUCCESS);
        }
    }

    let lost = Arc::new(AtomicBool::new(false));
    let (done, done_rx) = tokio::sync::oneshot::channel();
    let renewer = tokio::spawn(keep_lease(lock, timings, lost.clone(), done_rx));
    let events = args.events.events(client.clone(), &identity);
    let reconciler = Reconciler::new(client.clone(), events, timings).with_test_hooks_from_env();
    let report = tokio::select! {
        report = drain(&client, &reconciler, deadline, usize::from(args.concurrent)) => Some(report),
        () = wait_lost(lost.clone()) => None,
    };
    let _ = done.send(());
    let lock = renewer.await.ok().flatten();
    match report {
        Some(report) => log_report(&report),
        None => tracing::error!("lost the Lease during the drain: stopped writing"),
    }
    if let Some(lock) = lock {
        match lock.release().await {
            Ok(true) => tracing::info!("handed the Lease over"),
            Ok(false) => tracing::info!("the Lease was no longer ours to hand over"),
            Err(err) => {
                tracing::warn!(error = %err, "could not hand the Lease over; it expires on its own")
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn log_report(report: &DrainReport) {
    if report.left.is_empty() && report.final_listing_succeeded {
        tracing::info!(
            found = report.found,
            released = report.released,
            failed_listings = report.failed_listings,
            "drain complete: no fence left"
        );
    } else if report.final_listing_succeeded {
        tracing::warn!(
            found = report.found,
            released = report.released,
            left = report.left.len(),
            releases = ?report.left,
            "drain deadline reached with fences left: helm-controller has not finished these uninstalls; the next flux-plunger or the chart's pre-delete hook releases them"
        );
    } else {
        tracing::warn!(
            found = report.found,
            failed_listings = report.failed_listings,
            "drain ended without a final listing: fences may be left"
        );
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

async fn wait_lost(lost: Arc<AtomicBool>) {
    while !lost.load(Ordering::SeqCst) {
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

/// Renews the Lease every retry period until `done` fires, then returns the
/// lock for the handover; sets `lost` and returns `None` if the Lease was
/// taken over or could not be renewed within the renew deadline.
async fn keep_lease(
    mut lock: LeaseLock,
    timings: Timings,
    lost: Arc<AtomicBool>,
    mut done: tokio::sync::oneshot::Receiver<()>,
) -> Option<LeaseLock> {
    let mut last_renewal = Instant::now();
    loop {
        tokio::select! {
            _ = &mut done => return Some(lock),
            () = tokio::time::sleep(timings.lease_retry_period) => {}
        }
        match lock.try_acquire_or_renew().await {
            Ok(Attempt::Held) => last_renewal = Instant::now(),
            Ok(Attempt::HeldBy(holder)) => {
                tracing::error!(holder = %holder, "the Lease was taken over during the drain");
                lost.store(true, Ordering::SeqCst);
                return None;
            }
            Err(err) => tracing::warn!(error = %err, "could not renew the Lease during the drain"),
        }
        if last_renewal.elapsed() >= timings.lease_renew_deadline {
            lost.store(true, Ordering::SeqCst);
            return None;
        }
    }
}
