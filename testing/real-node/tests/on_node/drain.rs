//! The drain under the kubelet's real stop: a rollout and a deleted pod, with
//! fences held, and a drain the apiserver refuses, cut by the real SIGKILL.
//! Whoever writes, one pod at a time, read from the apiserver's audit log.

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::DeleteParams;
use plunger::timings::Timings;
use real_node::{
    CONTROLLER, DRAIN, Ended, Gone, OnNode, Writers, ended, fenced_releases, name_of, still_held,
    watch_until_gone,
};
use testkit::TestNamespace;

/// The smallest grace period the chart takes: the tightest timings.
const G: u64 = 40;

/// The words of the test's refusal of the drain's writes.
const REFUSED: &str = "test: the drain's writes are refused";

/// How the old pod stopped, as the kubelet reported it before the pod went.
struct Stopped {
    /// When the pod was deleted (its deletionTimestamp less its grace period).
    deleted_at: Timestamp,
    grace: SignedDuration,
    controller: Ended,
    drain: Ended,
}

impl Stopped {
    fn of(gone: &Gone) -> Result<Self> {
        let deleting = &gone.deleting.metadata;
        let grace = SignedDuration::from_secs(
            deleting
                .deletion_grace_period_seconds
                .context("the pod was not deleted gracefully")?,
        );
        // The apiserver sets deletionTimestamp to the delete's time plus the
        // grace period.
        let deadline = deleting
            .deletion_timestamp
            .as_ref()
            .context("the pod has no deletionTimestamp")?
            .0;
        let last = &gone.last;
        Ok(Self {
            deleted_at: deadline - grace,
            grace,
            controller: ended(last, CONTROLLER).context("the controller's end was not reported")?,
            drain: ended(last, DRAIN).context("the drain sidecar's end was not reported")?,
        })
    }

    /// The controller exited within its stop bound, and the kubelet stopped
    /// the native sidecar only after it (the drain never races the controller).
    fn check_order(&self) -> Result<()> {
        let stop = self.controller.finished_at.duration_since(self.deleted_at);
        // finishedAt is in whole seconds: one more for the rounding.
        let bound = SignedDuration::try_from(plunger::timings::CONTROLLER_STOP_BOUND)?
            + SignedDuration::from_secs(1);
        ensure!(
            stop <= bound,
            "the controller took {stop:#} to stop after the delete (bound {bound:#})"
        );
        ensure!(
            self.controller.exit_code == 0,
            "the controller exited {}",
            self.controller.exit_code
        );
        ensure!(
            self.drain.finished_at >= self.controller.finished_at,
            "the drain sidecar ended ({}) before the controller ({})",
            self.drain.finished_at,
            self.controller.finished_at
        );
        Ok(())
    }
}

/// The chart, installed at G = 40 with its controller in dry-run (it leads
/// and decides but writes nothing, so the fences in `fences` are the drain's
/// alone to release; the drain is scoped like the controller and has no
/// dry-run), with its pod Ready and leading.
async fn installed(prefix: &str) -> Result<(OnNode, Pod)> {
    let on = OnNode::new(prefix).await?;
    on.install(&[
        &format!("shutdownGracePeriodSeconds={G}"),
        "controller.dryRun=true",
    ])?;
    let pod = on.ready_pod(None).await?;
    on.wait_lease_held_by(&name_of(&pod)).await?;
    Ok((on, pod))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollout_drains_the_old_pod_after_its_controller_and_hands_over_to_the_new_one()
-> Result<()> {
    let _turn = testkit::cluster_wide_turn().await;
    let (on, old) = installed("node-rollout").await?;
    let fences = TestNamespace::create(&on.ns().client, "node-rollout-fences").await?;
    let created = testkit::audit::mark();
    let fenced = fenced_releases(&fences, 20).await?;

    let offset = testkit::audit::mark();
    let old_name = name_of(&old);
    let pods = on.pods();
    let watched =
        tokio::spawn(
            async move { watch_until_gone(&pods, &old_name, real_node::POD_TIMEOUT).await },
        );
    // A value change: a new pod template, so a rollout.
    tokio::task::block_in_place(|| on.upgrade(&["podAnnotations.rollout=again"]))?;
    let gone = watched.await??;
    let stopped = Stopped::of(&gone)?;
    stopped.check_order()?;
    ensure!(
        stopped.drain.exit_code == 0,
        "the drain exited {}",
        stopped.drain.exit_code
    );

    let new = on.ready_pod(Some(&name_of(&old))).await?;
    on.wait_lease_held_by(&name_of(&new)).await?;
    let left = still_held(&fences).await?;
    ensure!(
        left.is_empty(),
        "fences left: {left:?}; their writes since they were created:\n{}",
        real_node::trail(created, &fences.name, &left)?
    );

    let writers = Writers::read(
        offset,
        &on.controller_user(),
        &name_of(&old),
        &name_of(&new),
    )?;
    writers.check_single_writer()?;
    let drain_writes = writers.old_release_writes();
    ensure!(
        drain_writes.len() >= fenced.len(),
        "the drain wrote {} times for {} fences",
        drain_writes.len(),
        fenced.len()
    );
    // finishedAt is in whole seconds: compare with the second it names.
    let controller_exit = stopped.controller.finished_at;
    for write in &drain_writes {
        ensure!(
            write.received_at >= controller_exit,
            "a release was written at {} by the old pod, before its controller exited ({controller_exit})",
            write.received_at
        );
    }
    let handover = writers.handover()?;
    let lease_duration = SignedDuration::try_from(Timings::from_grace_period(G)?.lease_duration)?;
    eprintln!(
        "rollout: controller stopped {:#} after the delete, drain of {} fences ended {:#} after it; \
         handover (old pod's last Lease write to the new pod's first) {handover:#}",
        stopped
            .controller
            .finished_at
            .duration_since(stopped.deleted_at),
        fenced.len(),
        stopped
            .drain
            .finished_at
            .duration_since(stopped.controller.finished_at),
    );
    // Far less than the Lease's duration: the drain handed the Lease over
    // instead of letting it run out.
    ensure!(
        handover < lease_duration / 2,
        "the handover took {handover:#}, not within seconds (the Lease runs {lease_duration:#})"
    );
    on.remove()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_pod_drains_200_fences_at_the_smallest_grace_period_before_the_kill() -> Result<()>
{
    let _turn = testkit::cluster_wide_turn().await;
    let (on, old) = installed("node-delete").await?;
    let fences = TestNamespace::create(&on.ns().client, "node-delete-fences").await?;
    let created = testkit::audit::mark();
    let fenced = fenced_releases(&fences, 200).await?;

    let offset = testkit::audit::mark();
    let old_name = name_of(&old);
    on.pods()
        .delete(&old_name, &DeleteParams::default())
        .await?;
    let gone = watch_until_gone(&on.pods(), &old_name, real_node::POD_TIMEOUT).await?;
    let stopped = Stopped::of(&gone)?;
    ensure!(
        stopped.grace == SignedDuration::from_secs(G as i64),
        "deleted with {:#}",
        stopped.grace
    );
    stopped.check_order()?;
    // Exit 0 and before the grace period ran out: the drain ended by itself,
    // with nothing left, not by the kubelet's SIGKILL.
    ensure!(
        stopped.drain.exit_code == 0,
        "the drain exited {}",
        stopped.drain.exit_code
    );
    let drained_in = stopped.drain.finished_at.duration_since(stopped.deleted_at);
    ensure!(
        drained_in < stopped.grace,
        "the drain ended {drained_in:#} after the delete"
    );
    let left = still_held(&fences).await?;
    ensure!(
        left.is_empty(),
        "fences left: {left:?}; their writes since they were created:\n{}",
        real_node::trail(created, &fences.name, &left)?
    );

    let new = on.ready_pod(Some(&old_name)).await?;
    on.wait_lease_held_by(&name_of(&new)).await?;
    let writers = Writers::read(offset, &on.controller_user(), &old_name, &name_of(&new))?;
    writers.check_single_writer()?;
    eprintln!(
        "delete: {} fences drained, the drain ended {drained_in:#} after the delete (SIGKILL at {:#}); handover {:#}",
        fenced.len(),
        stopped.grace,
        writers.handover()?
    );
    on.remove()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_the_apiserver_refuses_is_cut_by_the_kill_and_the_next_pod_waits_out_the_lease()
-> Result<()> {
    let _turn = testkit::cluster_wide_turn().await;
    let (on, old) = installed("node-cut").await?;
    let fences = TestNamespace::create(&on.ns().client, "node-cut-fences").await?;
    let fenced = fenced_releases(&fences, 3).await?;
    let user = on.controller_user();
    let refusal = fences
        .refuse(
            "no-drain",
            serde_json::json!({"apiGroups": ["helm.toolkit.fluxcd.io"], "apiVersions": ["*"],
                "operations": ["UPDATE"], "resources": ["helmreleases"]}),
            &format!("request.userInfo.username != '{user}'"),
            REFUSED,
        )
        .await?;
    real_node::wait_until_refused(&on, &fences, &fenced[0], REFUSED).await?;

    // A grace period shorter than the drain's deadline (G - 25 = 15 s): the
    // kubelet's SIGKILL ends the drain, which keeps retrying refused writes.
    let offset = testkit::audit::mark();
    let old_name = name_of(&old);
    on.pods()
        .delete(
            &old_name,
            &DeleteParams {
                grace_period_seconds: Some(8),
                ..Default::default()
            },
        )
        .await?;
    let gone = watch_until_gone(&on.pods(), &old_name, real_node::POD_TIMEOUT).await?;
    let stopped = Stopped::of(&gone)?;
    ensure!(
        stopped.grace == SignedDuration::from_secs(8),
        "deleted with {:#}",
        stopped.grace
    );
    stopped.check_order()?;
    ensure!(
        stopped.drain.exit_code == 137,
        "the drain was not killed (exit {}): it should still have been retrying",
        stopped.drain.exit_code
    );
    ensure!(
        still_held(&fences).await?.len() == fenced.len(),
        "a refused fence was released"
    );

    // The next pod leads only once the Lease the killed drain kept renewing
    // has run out: one writer at a time even without a handover.
    let new = on.ready_pod(Some(&old_name)).await?;
    on.wait_lease_held_by(&name_of(&new)).await?;
    let writers = Writers::read(offset, &user, &old_name, &name_of(&new))?;
    writers.check_single_writer()?;
    let lease_duration = SignedDuration::try_from(Timings::from_grace_period(G)?.lease_duration)?;
    let waited = writers.handover()?;
    ensure!(
        waited >= lease_duration - SignedDuration::from_secs(1),
        "the new pod took the Lease {waited:#} after the killed pod's last renewal (the Lease runs {lease_duration:#})"
    );
    eprintln!(
        "cut by the kill: the next pod took the Lease {waited:#} after the killed drain's last renewal"
    );

    refusal.lift().await?;
    testkit::strip_fences(&fences).await?;
    on.remove()
}
