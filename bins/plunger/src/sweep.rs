//! The pre-delete sweep (SPEC §8) and the operator's `list` / `release`.
//!
//! When the chart is removed nothing of flux-plunger may be left holding a
//! release. The sweep stops flux-plunger, waits for its pods, then releases
//! every fence with guarded JSON patches: `test` ops pin the resourceVersion
//! and uid that were read, and each fence is removed at its index only after a
//! `test` that the index still holds it. Never a server-side apply: on a
//! release last written by a client-side `kubectl apply`, an apply moves that
//! apply's fields to the applying manager and strips every field it leaves out.

use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};

use crate::apply::{guarded_patch, patch_guarded};
use crate::error::is_permanent_refusal;
use crate::names::{PROCESSED_VERSION_ANNOTATION, SWEEP_FIELD_MANAGER};
use crate::release::api::{helmreleases, list_every_fence};
use crate::release::view::ReleaseView;
use crate::scope::Scope;
use crate::test_hooks::{SweepStep, pause_at};

/// What releasing one HelmRelease takes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReleasePlan {
    /// Lift `spec.suspend`: only where flux-plunger alone holds it.
    pub lift_suspension: bool,
    /// Indices of the fence in `metadata.finalizers` (it may appear twice).
    pub fence_indices: Vec<usize>,
    /// The fence's label goes with the fence.
    pub remove_label: bool,
    /// The release is being deleted, helm-controller has not uninstalled it,
    /// and the fence is all that holds it: letting it go now skips the
    /// uninstall. (Lifting a suspension alone skips nothing: helm-controller
    /// uninstalls only an unsuspended release.)
    pub without_uninstall: bool,
}

impl ReleasePlan {
    pub fn of(release: &ReleaseView) -> Self {
        let fence_indices = release.fence_indices();
        Self {
            lift_suspension: release.suspend && release.suspend_owned_by_us_alone(),
            without_uninstall: !fence_indices.is_empty()
                && release.terminating
                && !release.delete_handled_by_helm_controller(),
            remove_label: release.fence_labelled && !fence_indices.is_empty(),
            fence_indices,
        }
    }

    /// Nothing to write.
    pub fn is_empty(&self) -> bool {
        !self.lift_suspension && self.fence_indices.is_empty()
    }

    /// The guarded JSON patch carrying the plan out as one request.
    pub fn json_patch(&self, release: &ReleaseView) -> Value {
        guarded_patch(
            release,
            self.lift_suspension,
            &self.fence_indices,
            self.remove_label,
        )
    }
}

/// Applies the plan for `release` as read; 422 (a failed `test`) or 409 mean
/// the release changed since the read.
pub async fn release_one(
    client: &Client,
    release: &ReleaseView,
    plan: &ReleasePlan,
) -> kube::Result<()> {
    patch_guarded(
        client,
        release,
        plan.lift_suspension,
        &plan.fence_indices,
        plan.remove_label,
        SWEEP_FIELD_MANAGER,
    )
    .await?;
    Ok(())
}

/// How a suspension looks to an operator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Suspension {
    None,
    /// flux-plunger alone holds it.
    Ours,
    /// flux-plunger holds it together with another manager.
    Shared,
    /// Another manager's.
    Foreign,
    /// Another manager's, on a release flux-plunger recovered before: most
    /// likely left by an older flux-plunger mid-recovery.
    LeftBehind,
}

impl Suspension {
    pub fn of(release: &ReleaseView) -> Self {
        if !release.suspend {
            Suspension::None
        } else if release.suspend_owned_by_us_alone() {
            Suspension::Ours
        } else if release.suspend_owned_by_us() {
            Suspension::Shared
        } else if release
            .annotations
            .contains_key(PROCESSED_VERSION_ANNOTATION)
        {
            Suspension::LeftBehind
        } else {
            Suspension::Foreign
        }
    }
}

/// One row of `list`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Row {
    pub namespace: String,
    pub name: String,
    pub fences: usize,
    pub suspension: Suspension,
    pub terminating: bool,
    pub uninstall_reached: bool,
}

/// Whether `list` shows a release: it carries the fence, a suspension
/// involving flux-plunger, or one an older flux-plunger probably left.
pub fn row_of(release: &ReleaseView) -> Option<Row> {
    let suspension = Suspension::of(release);
    let fences = release.fence_indices().len();
    let shown = fences > 0
        || matches!(
            suspension,
            Suspension::Ours | Suspension::Shared | Suspension::LeftBehind
        );
    shown.then(|| Row {
        namespace: release.namespace.clone(),
        name: release.name.clone(),
        fences,
        suspension,
        terminating: release.terminating,
        uninstall_reached: release.delete_handled_by_helm_controller(),
    })
}

/// Every HelmRelease `list` shows.
pub async fn list_rows(client: &Client) -> kube::Result<Vec<Row>> {
    let mut rows =
        crate::release::api::list_all(client, &Scope::default(), |release| row_of(&release))
            .await?;
    rows.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
    Ok(rows)
}

/// Configuration of the pre-delete hook.
#[derive(Debug, Clone)]
pub struct HookConfig {
    pub namespace: String,
    pub deployment: String,
    pub pod_selector: String,
    pub lease: String,
    /// The releases whose fences this install's hook releases: the
    /// controller's scope.
    pub scope: Scope,
    /// Retries of every step end here (the hook's retry window).
    pub retry_window: Duration,
    /// How long to wait for the pods after scaling down.
    pub pod_wait: Duration,
    /// How long past the window a last attempt may still run: no request
    /// outlives the window plus this margin.
    pub finish_margin: Duration,
}

impl HookConfig {
    /// The budget of a run starting now.
    pub fn budget(&self) -> Budget {
        Budget::from_now(self.retry_window, self.finish_margin)
    }
}

/// How long a sweep may take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budget {
    /// Failed steps are retried until here.
    pub retry_until: Instant,
    /// Every request ends by here, answered or not: a request the apiserver
    /// never answers (the client sets no read timeout) fails as timed out, so
    /// the run ends with its report instead of being killed at the Job's
    /// deadline.
    pub finish_by: Instant,
}

impl Budget {
    /// Retries for `retry_window` from now, and `finish_margin` more for the
    /// requests under way.
    pub fn from_now(retry_window: Duration, finish_margin: Duration) -> Self {
        let retry_until = Instant::now() + retry_window;
        Self {
            retry_until,
            finish_by: retry_until + finish_margin,
        }
    }

    /// Runs one request, failing it if it is still pending at `finish_by`.
    pub async fn bounded<T>(
        &self,
        request: impl std::future::Future<Output = kube::Result<T>>,
    ) -> kube::Result<T> {
        match tokio::time::timeout_at(self.finish_by.into(), request).await {
            Ok(result) => result,
            Err(_) => Err(kube::Error::Service(Box::new(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "no answer from the apiserver before the sweep's time ran out",
            )))),
        }
    }
}

pub use crate::error::describe;

/// How the hook ended.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HookReport {
    pub lines: Vec<String>,
    pub fenced: usize,
    pub released: usize,
    pub without_uninstall: usize,
    pub success: bool,
}

impl HookReport {
    fn say(&mut self, line: String) {
        tracing::info!("{line}");
        self.lines.push(line);
    }
}

/// Retries `op` with backoff until it succeeds or the budget's retries end;
/// one attempt is always made.
async fn retry<T, F, Fut>(budget: Budget, what: &str, mut op: F) -> kube::Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = kube::Result<T>>,
{
    let mut delay = Duration::from_millis(500);
    loop {
        match budget.bounded(op()).await {
            Ok(value) => return Ok(value),
            Err(err) => {
                if Instant::now() + delay >= budget.retry_until {
                    return Err(err);
                }
                tracing::warn!(error = %describe(&err), retry_in = ?delay, "{what} failed; retrying");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(10));
            }
        }
    }
}

/// SPEC §8: the pre-delete hook.
pub async fn run_hook(client: &Client, config: &HookConfig) -> HookReport {
    let budget = config.budget();
    let mut report = HookReport::default();
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &config.namespace);
    let target = format!("{}/{}", config.namespace, config.deployment);

    // 1. Stop flux-plunger.
    let deployment = match retry(budget, "reading the Deployment", || {
        deployments.get_opt(&config.deployment)
    })
    .await
    {
        Ok(found) => found,
        Err(err) => {
            report.say(format!(
                "could not read Deployment {target}: {}; no fence was touched",
                describe(&err)
            ));
            return report;
        }
    };
    if deployment.is_none() {
        report.say(format!("no Deployment {target}: nothing to stop"));
    } else {
        let scale = Patch::Merge(json!({"spec": {"replicas": 0}}));
        let params = PatchParams {
            field_manager: Some(SWEEP_FIELD_MANAGER.to_owned()),
            ..PatchParams::default()
        };
        pause_at(SweepStep::BeforeScaleDown.name()).await;
        match retry(budget, "scaling the Deployment to 0", || {
            deployments.patch_scale(&config.deployment, &params, &scale)
        })
        .await
        {
            Ok(_) => {
                pause_at(SweepStep::ScaledDown.name()).await;
                report.say(format!("scaled Deployment {target} to 0"))
            }
            Err(err) => {
                report.say(format!(
                    "could not scale Deployment {target} to 0: {}; no fence was touched",
                    describe(&err)
                ));
                return report;
            }
        }
    }

    // 2. Wait for its pods, at most the pod wait and never past the window.
    // Until a listing succeeds nothing is known: a pod may run.
    let pods: Api<Pod> = Api::namespaced(client.clone(), &config.namespace);
    let wait_end = (Instant::now() + config.pod_wait).min(budget.retry_until);
    let selector = ListParams::default().labels(&config.pod_selector);
    let mut remaining: Result<Vec<String>, kube::Error>;
    loop {
        remaining = budget
            .bounded(pods.list(&selector))
            .await
            .map(|list| list.items.iter().map(|p| p.name_any()).collect());
        if let Err(err) = &remaining {
            tracing::warn!(error = %describe(err), "listing flux-plunger pods failed; retrying");
        }
        if matches!(&remaining, Ok(names) if names.is_empty()) || Instant::now() >= wait_end {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let pod_may_run = match remaining {
        Ok(names) => {
            for pod in &names {
                report.say(format!(
                    "pod {}/{pod} is still there after the wait (stuck Terminating on a NotReady node?): going on; it may still set fences",
                    config.namespace
                ));
            }
            !names.is_empty()
        }
        Err(err) => {
            report.say(format!(
                "could not list the flux-plunger pods ({}): {}; going on as if one may still run",
                config.pod_selector,
                describe(&err)
            ));
            true
        }
    };

    // 3. Release every fence.
    let fenced = match retry(budget, "listing fenced HelmReleases", || {
        list_every_fence(client, &config.scope)
    })
    .await
    {
        Ok(fenced) => fenced,
        Err(err) => {
            report.say(format!(
                "could not list HelmReleases: {}; no fence was touched",
                describe(&err)
            ));
            return report;
        }
    };
    report.fenced = fenced.len();
    for release in fenced {
        let key = release.key();
        match release_with_retry(client, release, budget, Uninstall::MaySkip, Refusals::Retry).await
        {
            Ok(Released {
                without_uninstall: false,
            }) => {
                report.released += 1;
                report.say(format!("released {key}"));
            }
            Ok(Released {
                without_uninstall: true,
            }) => {
                report.released += 1;
                report.without_uninstall += 1;
                report.say(format!(
                    "released {key} WITHOUT an uninstall: it was being deleted and helm-controller had not uninstalled it; its resources may be left"
                ));
            }
            Err(err) => report.say(format!("NOT released {key}: {err}")),
        }
    }

    // 4. The summary.
    report.say(format!(
        "released {} of {} fenced HelmReleases, {} without an uninstall",
        report.released, report.fenced, report.without_uninstall
    ));

    // 5. A pod that may still run may have set fences meanwhile.
    let mut fences_after = false;
    if pod_may_run {
        match budget
            .bounded(list_every_fence(client, &config.scope))
            .await
        {
            Ok(again) if again.is_empty() => {}
            Ok(again) => {
                fences_after = true;
                let names: Vec<String> = again.iter().map(ReleaseView::key).collect();
                report.say(format!(
                    "fences found after the sweep while a flux-plunger pod may still run: {}",
                    names.join(", ")
                ));
            }
            Err(err) => {
                fences_after = true;
                report.say(format!(
                    "could not list again while a flux-plunger pod may still run: {}",
                    describe(&err)
                ));
            }
        }
    } else {
        // Beyond the original: no flux-plunger is left, so its Lease goes too.
        let leases: Api<Lease> = Api::namespaced(client.clone(), &config.namespace);
        pause_at(SweepStep::BeforeLeaseDelete.name()).await;
        match budget
            .bounded(leases.delete(&config.lease, &DeleteParams::default()))
            .await
        {
            Ok(_) => {
                pause_at(SweepStep::LeaseDeleted.name()).await;
                report.say(format!(
                    "removed the leader Lease {}/{}",
                    config.namespace, config.lease
                ))
            }
            Err(kube::Error::Api(s)) if s.code == 404 => {}
            Err(err) => {
                tracing::warn!(error = %describe(&err), "could not remove the leader Lease; it is inert")
            }
        }
    }

    // 6. Success only if every fence was released.
    report.success = report.released == report.fenced && !fences_after;
    report
}

/// Whether a release may be let go of before helm-controller uninstalled it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Uninstall {
    /// The hook: the chart is going, a fence left behind would be stranded.
    MaySkip,
    /// `release` without `--without-uninstall`: refuse, on every read.
    MustNotSkip,
}

/// What a refusal that reading again cannot cure (a 403, an admission
/// policy's denial) ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusals {
    /// The hook: retried through the window. Its RBAC is created right
    /// before it runs and may not be in force yet, and a failed hook fails
    /// the uninstall anyway.
    Retry,
    /// `release`: an operator at a terminal hears about it at once.
    End,
}

/// A release let go of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Released {
    /// It was being deleted and helm-controller had not uninstalled it.
    pub without_uninstall: bool,
}

/// Why a release was not let go of.
#[derive(Debug, thiserror::Error)]
pub enum NotReleased {
    #[error("{}", describe(.0))]
    Failed(kube::Error),
    /// [`Uninstall::MustNotSkip`], and the release is being deleted without
    /// helm-controller having uninstalled it.
    #[error(
        "it is being deleted and helm-controller has not uninstalled it: releasing it now skips the Helm uninstall"
    )]
    WouldSkipUninstall,
}

/// Releases one HelmRelease, reading it again after a failure (a 409 or a
/// failed `test` means it changed since the read), until the budget's
/// retries end.
pub async fn release_with_retry(
    client: &Client,
    mut release: ReleaseView,
    budget: Budget,
    uninstall: Uninstall,
    refusals: Refusals,
) -> Result<Released, NotReleased> {
    let api = helmreleases(client.clone(), &release.namespace);
    let mut delay = Duration::from_millis(250);
    loop {
        let plan = ReleasePlan::of(&release);
        if plan.is_empty() {
            return Ok(Released {
                without_uninstall: false,
            });
        }
        if plan.without_uninstall && uninstall == Uninstall::MustNotSkip {
            return Err(NotReleased::WouldSkipUninstall);
        }
        if plan.without_uninstall {
            // Said before the write: a run killed right after it (the Job's
            // deadline, an eviction) must still have named the release whose
            // uninstall it skipped; its report is never printed then.
            tracing::warn!(release = %release.key(), "letting go of a release being deleted that helm-controller has not uninstalled: its Helm uninstall is skipped");
        }
        pause_at(SweepStep::BeforeReleasePatch.name()).await;
        let err = match budget.bounded(release_one(client, &release, &plan)).await {
            Ok(()) => {
                pause_at(SweepStep::ReleasePatched.name()).await;
                return Ok(Released {
                    without_uninstall: plan.without_uninstall,
                });
            }
            Err(err) => err,
        };
        let permanent = refusals == Refusals::End && is_permanent_refusal(&err);
        if permanent || Instant::now() + delay >= budget.retry_until {
            return Err(NotReleased::Failed(err));
        }
        tracing::warn!(release = %release.key(), error = %describe(&err), "releasing failed; reading again");
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(Duration::from_secs(5));
        match budget.bounded(api.get_opt(&release.name)).await {
            Ok(Some(object)) => release = ReleaseView::from_object(&object),
            Ok(None) => {
                return Ok(Released {
                    without_uninstall: false,
                });
            }
            Err(read) => {
                tracing::warn!(release = %release.key(), error = %describe(&read), "reading again failed")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::names::FENCE_FINALIZER;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{FieldsV1, ManagedFieldsEntry};

    fn entry(manager: &str, operation: &str) -> ManagedFieldsEntry {
        ManagedFieldsEntry {
            manager: Some(manager.into()),
            operation: Some(operation.into()),
            fields_v1: Some(FieldsV1(json!({"f:spec": {"f:suspend": {}}}))),
            ..Default::default()
        }
    }

    fn release(suspend_owners: &[(&str, &str)], finalizers: &[&str]) -> ReleaseView {
        ReleaseView {
            namespace: "apps".into(),
            name: "web".into(),
            uid: "u".into(),
            resource_version: "7".into(),
            suspend: !suspend_owners.is_empty(),
            managed_fields: suspend_owners.iter().map(|(m, o)| entry(m, o)).collect(),
            finalizers: finalizers.iter().map(|f| (*f).to_owned()).collect(),
            generation: Some(2),
            observed_generation: Some(2),
            ..Default::default()
        }
    }

    #[test]
    fn only_a_suspension_flux_plunger_alone_holds_is_lifted() {
        assert!(
            ReleasePlan::of(&release(&[("flux-plunger", "Apply")], &[FENCE_FINALIZER]))
                .lift_suspension
        );
        assert!(
            !ReleasePlan::of(&release(
                &[("flux-plunger", "Apply"), ("migration", "Apply")],
                &[FENCE_FINALIZER]
            ))
            .lift_suspension
        );
        assert!(
            !ReleasePlan::of(&release(&[("flux-plunger", "Update")], &[FENCE_FINALIZER]))
                .lift_suspension
        );
        assert!(
            !ReleasePlan::of(&release(&[("velero", "Update")], &[FENCE_FINALIZER])).lift_suspension
        );
    }

    #[test]
    fn a_plan_is_empty_only_when_there_is_neither_a_suspension_to_lift_nor_a_fence() {
        assert!(ReleasePlan::of(&release(&[], &["finalizers.fluxcd.io"])).is_empty());
        assert!(ReleasePlan::of(&release(&[("velero", "Update")], &[])).is_empty());
        assert!(!ReleasePlan::of(&release(&[], &[FENCE_FINALIZER])).is_empty());
        assert!(!ReleasePlan::of(&release(&[("flux-plunger", "Apply")], &[])).is_empty());
    }

    #[test]
    fn the_budget_retries_for_the_window_and_finishes_a_margin_later() {
        let before = Instant::now();
        let budget = Budget::from_now(Duration::from_secs(10), Duration::from_secs(5));
        let after = Instant::now();
        assert!(budget.retry_until >= before + Duration::from_secs(10));
        assert!(budget.retry_until <= after + Duration::from_secs(10));
        assert_eq!(
            budget.finish_by - budget.retry_until,
            Duration::from_secs(5)
        );
    }

    #[test]
    fn the_patch_pins_the_read_and_removes_every_fence_from_the_highest_index() {
        let r = release(
            &[("flux-plunger", "Apply")],
            &[FENCE_FINALIZER, "finalizers.fluxcd.io", FENCE_FINALIZER],
        );
        let plan = ReleasePlan::of(&r);
        assert_eq!(plan.fence_indices, vec![0, 2]);
        assert_eq!(
            plan.json_patch(&r),
            json!([
                {"op": "test", "path": "/metadata/resourceVersion", "value": "7"},
                {"op": "test", "path": "/metadata/uid", "value": "u"},
                {"op": "test", "path": "/spec/suspend", "value": true},
                {"op": "remove", "path": "/spec/suspend"},
                {"op": "test", "path": "/metadata/finalizers/2", "value": FENCE_FINALIZER},
                {"op": "remove", "path": "/metadata/finalizers/2"},
                {"op": "test", "path": "/metadata/finalizers/0", "value": FENCE_FINALIZER},
                {"op": "remove", "path": "/metadata/finalizers/0"},
            ])
        );
    }

    #[test]
    fn the_fence_s_label_goes_with_the_fence() {
        let mut r = release(&[], &[FENCE_FINALIZER]);
        r.fence_labelled = true;
        let plan = ReleasePlan::of(&r);
        assert!(plan.remove_label);
        assert_eq!(
            plan.json_patch(&r).as_array().unwrap().last(),
            Some(
                &json!({"op": "remove", "path": "/metadata/labels/flux-plunger.cozystack.io~1uninstall-fence"})
            )
        );
        r.finalizers.clear();
        assert!(
            !ReleasePlan::of(&r).remove_label,
            "no fence to release: nothing is written"
        );
    }

    #[test]
    fn letting_go_of_a_deleted_release_before_its_uninstall_is_flagged() {
        let mut r = release(&[], &[FENCE_FINALIZER, "finalizers.fluxcd.io"]);
        r.terminating = true;
        assert!(ReleasePlan::of(&r).without_uninstall);
        r.finalizers = vec![FENCE_FINALIZER.into()];
        assert!(
            !ReleasePlan::of(&r).without_uninstall,
            "helm-controller has finished"
        );
        r.observed_generation = Some(1);
        assert!(
            ReleasePlan::of(&r).without_uninstall,
            "not yet observed the last generation"
        );
        r.terminating = false;
        assert!(
            !ReleasePlan::of(&r).without_uninstall,
            "a live release loses nothing"
        );
    }

    #[test]
    fn lifting_only_a_suspension_of_a_deleted_release_skips_no_uninstall() {
        let mut r = release(&[("flux-plunger", "Apply")], &["finalizers.fluxcd.io"]);
        r.terminating = true;
        assert_eq!(
            ReleasePlan::of(&r),
            ReleasePlan {
                lift_suspension: true,
                fence_indices: vec![],
                remove_label: false,
                without_uninstall: false,
            },
            "unsuspended, helm-controller can now run the uninstall"
        );
        assert!(!ReleasePlan::of(&r).is_empty());
    }

    #[test]
    fn list_shows_fences_our_suspensions_and_suspensions_left_behind() {
        assert_eq!(row_of(&release(&[], &[])), None);
        assert_eq!(row_of(&release(&[("velero", "Update")], &[])), None);
        assert_eq!(
            row_of(&release(&[], &[FENCE_FINALIZER]))
                .unwrap()
                .suspension,
            Suspension::None
        );
        assert_eq!(
            row_of(&release(&[("flux-plunger", "Apply")], &[]))
                .unwrap()
                .suspension,
            Suspension::Ours
        );
        assert_eq!(
            row_of(&release(&[("flux-plunger", "Apply"), ("m", "Apply")], &[]))
                .unwrap()
                .suspension,
            Suspension::Shared
        );
        let mut left = release(&[("flux-client-side-apply", "Update")], &[]);
        left.annotations
            .insert(PROCESSED_VERSION_ANNOTATION.into(), "3".into());
        assert_eq!(row_of(&left).unwrap().suspension, Suspension::LeftBehind);
    }
}
