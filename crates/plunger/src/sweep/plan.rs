//! What the sweep decides without a request: what letting go of one release
//! takes, how `list` shows a release, and how long a run may take.

use std::time::{Duration, Instant};

use backon::{Backoff, BackoffBuilder, ExponentialBuilder};

use crate::decide::{GuardedPatch, let_go_without_apply};
use crate::release::view::ReleaseView;

/// What releasing one HelmRelease takes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReleasePlan {
    /// Lift `spec.suspend`: only where flux-plunger alone holds it.
    pub lift_suspension: bool,
    /// Indices of the fence in `metadata.finalizers` (it may appear twice).
    pub(crate) fence_indices: Vec<usize>,
    /// The fence's label goes with the fence.
    pub(crate) remove_label: bool,
    /// The release is being deleted, helm-controller has not uninstalled it,
    /// and the fence is all that holds it: letting it go now skips the
    /// uninstall. (Lifting a suspension alone skips nothing: helm-controller
    /// uninstalls only an unsuspended release.)
    pub(super) without_uninstall: bool,
}

impl ReleasePlan {
    /// The sweep never applies, so it lets go as the controller does when an
    /// apply cannot: every copy of the fence, and a suspension only where
    /// flux-plunger alone holds it.
    pub fn of(release: &ReleaseView) -> Self {
        let GuardedPatch {
            lift_suspension,
            fence_indices,
            remove_label,
        } = let_go_without_apply(release, false);
        Self {
            without_uninstall: !fence_indices.is_empty()
                && release.terminating
                && !release.delete_handled_by_helm_controller(),
            lift_suspension,
            fence_indices,
            remove_label,
        }
    }

    /// Nothing to write.
    pub fn is_empty(&self) -> bool {
        !self.lift_suspension && self.fence_indices.is_empty()
    }
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
    pub(crate) fn of(release: &ReleaseView) -> Self {
        if !release.suspend {
            Suspension::None
        } else if release.suspend_owned_by_us_alone() {
            Suspension::Ours
        } else if release.suspend_owned_by_us() {
            Suspension::Shared
        } else if release.carries_processed_annotation() {
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
    /// The install the fence's label names (SPEC §3), if it has one.
    pub fenced_by: Option<String>,
}

/// Whether `list` shows a release: it carries the fence, a suspension
/// involving flux-plunger, or one an older flux-plunger probably left.
pub(super) fn row_of(release: &ReleaseView) -> Option<Row> {
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
        fenced_by: release.fence_label.clone(),
    })
}

/// How long a sweep may take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budget {
    /// Failed steps are retried until here.
    pub(super) retry_until: Instant,
    /// Every request ends by here, answered or not: a request the apiserver
    /// never answers (the client sets no read timeout) fails as timed out, so
    /// the run ends with its report instead of being killed at the Job's
    /// deadline.
    finish_by: Instant,
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

    /// The waits between tries of a failed step: `first`, doubling up to
    /// `longest`, and no more once the next try would start after
    /// `retry_until`.
    pub(crate) fn backoff(&self, first: Duration, longest: Duration) -> impl Backoff {
        let budget = *self;
        ExponentialBuilder::new()
            .with_min_delay(first)
            .with_factor(2.0)
            .with_max_delay(longest)
            .without_max_times()
            .build()
            .take_while(move |wait| budget.allows_try_after(*wait, Instant::now()))
    }

    /// Whether a try `wait` after `now` would still start before the
    /// retries end.
    fn allows_try_after(&self, wait: Duration, now: Instant) -> bool {
        now + wait < self.retry_until
    }

    /// Runs one request, failing it if it is still pending at `finish_by`.
    pub(crate) async fn bounded<T>(
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::names::{FENCE_FINALIZER, LEGACY_FENCE_LABEL_VALUE, PROCESSED_VERSION_ANNOTATION};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{FieldsV1, ManagedFieldsEntry};
    use serde_json::json;

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
    fn the_backoff_doubles_up_to_its_longest_wait_and_ends_with_the_retries() {
        let budget = Budget::from_now(Duration::from_secs(60), Duration::ZERO);
        let waits: Vec<Duration> = budget
            .backoff(Duration::from_millis(500), Duration::from_secs(3))
            .take(5)
            .collect();
        assert_eq!(
            waits,
            [500, 1000, 2000, 3000, 3000].map(Duration::from_millis)
        );
        let ending = Budget::from_now(Duration::from_secs(2), Duration::ZERO);
        assert_eq!(
            ending
                .backoff(Duration::from_secs(1), Duration::from_secs(10))
                .take(3)
                .collect::<Vec<_>>(),
            [Duration::from_secs(1)],
            "a try 3 s from now would start after the retries end"
        );
    }

    #[test]
    fn a_try_must_start_before_the_retries_end() {
        let end = Instant::now() + Duration::from_secs(10);
        let budget = Budget {
            retry_until: end,
            finish_by: end,
        };
        let wait = Duration::from_secs(1);
        assert!(budget.allows_try_after(wait, end - Duration::from_secs(2)));
        assert!(!budget.allows_try_after(wait, end - wait));
        assert!(!budget.allows_try_after(wait, end));
    }

    #[test]
    fn a_plan_removes_every_copy_of_the_fence() {
        // The guarded patch removes them highest index first (`apply`'s tests).
        let r = release(
            &[("flux-plunger", "Apply")],
            &[FENCE_FINALIZER, "finalizers.fluxcd.io", FENCE_FINALIZER],
        );
        assert_eq!(
            ReleasePlan::of(&r),
            ReleasePlan {
                lift_suspension: true,
                fence_indices: vec![0, 2],
                remove_label: false,
                without_uninstall: false,
            }
        );
    }

    #[test]
    fn the_fence_s_label_goes_with_the_fence() {
        let mut r = release(&[], &[FENCE_FINALIZER]);
        r.fence_label = Some(LEGACY_FENCE_LABEL_VALUE.to_owned());
        assert!(ReleasePlan::of(&r).remove_label);
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
