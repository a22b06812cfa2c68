//! Every write flux-plunger makes to a HelmRelease, whichever binary sends
//! it: the one write primitive (SPEC §3); the annotation patch; the guarded
//! JSON patch, with which the controller and the drain let go of what an
//! apply cannot give up, and which is the sweeper's only write (it never
//! applies); and the two writes that hand a release being deleted to
//! helm-controller's uninstall (SPEC §5a, §5d): its history, and a reconcile
//! request.
//!
//! Every apply carries the `resourceVersion` and `uid` of the read that
//! decided on it: a write landing in between makes it fail with 409 instead
//! of being absorbed, and an apply for a release that has gone (and may have
//! been re-created) can neither create nor touch another one. The body holds
//! only identity, preconditions, and the two things we claim (the suspension;
//! the fence with its label), so it cannot send defaults (a typed body would)
//! or take any other field.

use kube::Client;
use kube::api::{DynamicObject, Patch, PatchParams};
use serde_json::{Value, json};

use crate::history::HistorySnapshot;
use crate::install::Install;
use crate::names::{
    FENCE_FINALIZER, FENCE_LABEL, FIELD_MANAGER, HELMRELEASE_API_VERSION, HELMRELEASE_KIND,
    PROCESSED_BELOW_UID_ANNOTATION, PROCESSED_VERSION_ANNOTATION,
    RECONCILE_REQUESTED_AT_ANNOTATION, SHARED_FIELD_MANAGER,
};
use crate::release::api::helmreleases;
use crate::release::view::ReleaseView;

/// What one apply claims. A field left out is given up: `spec.suspend` falls
/// back to unset when we were its only owner and stays when someone else
/// co-owns it; the same for the fence and the label that goes with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Claim {
    pub(crate) suspend: bool,
    pub(crate) fence: bool,
}

impl Claim {
    /// Suspension and fence, taken together (SPEC §4.8).
    pub const SUSPEND_AND_FENCE: Claim = Claim {
        suspend: true,
        fence: true,
    };
    /// The fence alone: a delete must wait for the uninstall (SPEC §5a).
    pub const FENCE_ONLY: Claim = Claim {
        suspend: false,
        fence: true,
    };
    /// Nothing: give up whatever we hold.
    pub const NOTHING: Claim = Claim {
        suspend: false,
        fence: false,
    };
}

/// The body of `install`'s apply for `release` as read.
pub fn apply_body(release: &ReleaseView, claim: Claim, install: &Install) -> Value {
    let mut body = json!({
        "apiVersion": HELMRELEASE_API_VERSION,
        "kind": HELMRELEASE_KIND,
        "metadata": {
            "name": release.name,
            "namespace": release.namespace,
            "resourceVersion": release.resource_version,
            "uid": release.uid,
        },
    });
    if claim.fence {
        body["metadata"]["finalizers"] = json!([FENCE_FINALIZER]);
        body["metadata"]["labels"] = json!({ FENCE_LABEL: install.fence_label_value() });
    }
    if claim.suspend {
        body["spec"] = json!({ "suspend": true });
    }
    body
}

/// Applies `install`'s `claim` to the release as read, as manager
/// `flux-plunger`. `force` only for the acquire's second try (SPEC §4.8).
pub async fn apply(
    client: &Client,
    release: &ReleaseView,
    claim: Claim,
    force: bool,
    install: &Install,
) -> kube::Result<DynamicObject> {
    let mut params = PatchParams::apply(FIELD_MANAGER);
    if force {
        params = params.force();
    }
    helmreleases(client.clone(), &release.namespace)
        .patch(
            &release.name,
            &params,
            &Patch::Apply(apply_body(release, claim, install)),
        )
        .await
}

/// The guarded JSON patch: `test` ops pin the `resourceVersion` and `uid`
/// read, then `spec.suspend` is removed behind a `test` that it is still
/// `true` (with `lift_suspension`), and the fence at each of
/// `fence_indices` behind a `test` that the index still holds it, highest
/// first so that the lower ones stay valid, and the fence's label with them
/// (`remove_label`: the label goes with the fence). A JSON patch removes a value
/// whoever owns it, where an apply only gives up its own claim; it is the way
/// to let go of what another manager also holds, and the sweep's only write
/// (an apply would take over the fields of a release last written by a
/// client-side `kubectl apply`).
pub fn guarded_patch(
    release: &ReleaseView,
    lift_suspension: bool,
    fence_indices: &[usize],
    remove_label: bool,
) -> Value {
    let mut ops = vec![
        json!({"op": "test", "path": "/metadata/resourceVersion", "value": release.resource_version}),
        json!({"op": "test", "path": "/metadata/uid", "value": release.uid}),
    ];
    if lift_suspension {
        ops.push(json!({"op": "test", "path": "/spec/suspend", "value": true}));
        ops.push(json!({"op": "remove", "path": "/spec/suspend"}));
    }
    let mut indices = fence_indices.to_vec();
    indices.sort_unstable();
    for index in indices.iter().rev() {
        let path = format!("/metadata/finalizers/{index}");
        ops.push(json!({"op": "test", "path": path, "value": FENCE_FINALIZER}));
        ops.push(json!({"op": "remove", "path": path}));
    }
    if remove_label {
        // A JSON pointer spells the label's `/` as `~1`.
        let path = format!("/metadata/labels/{}", FENCE_LABEL.replace('/', "~1"));
        ops.push(json!({"op": "remove", "path": path}));
    }
    Value::Array(ops)
}

/// Sends [`guarded_patch`] for `release` as read, as `field_manager`. A
/// failed `test` (the release changed since the read) is refused with 422
/// and changes nothing (`error::is_failed_guard`).
pub async fn patch_guarded(
    client: &Client,
    release: &ReleaseView,
    lift_suspension: bool,
    fence_indices: &[usize],
    remove_label: bool,
    field_manager: &str,
) -> kube::Result<DynamicObject> {
    let patch: json_patch::Patch = serde_json::from_value(guarded_patch(
        release,
        lift_suspension,
        fence_indices,
        remove_label,
    ))
    .map_err(kube::Error::SerdeError)?;
    let params = PatchParams {
        field_manager: Some(field_manager.to_owned()),
        ..PatchParams::default()
    };
    helmreleases(client.clone(), &release.namespace)
        .patch(&release.name, &params, &Patch::<()>::Json(patch))
        .await
}

/// The merge patch that records the reclaimed revision (and the uid of the
/// revision below it, "" for none), locked on the resourceVersion read.
fn annotation_patch(release: &ReleaseView, revision: u64, below_uid: Option<&str>) -> Value {
    json!({
        "metadata": {
            "resourceVersion": release.resource_version,
            "annotations": {
                PROCESSED_VERSION_ANNOTATION: revision.to_string(),
                PROCESSED_BELOW_UID_ANNOTATION: below_uid.unwrap_or_default(),
            },
        },
    })
}

/// Writes the processed-revision annotation under the shared manager
/// `flux-client-side-apply`, so that it never makes anything look like ours.
pub async fn annotate(
    client: &Client,
    release: &ReleaseView,
    revision: u64,
    below_uid: Option<&str>,
) -> kube::Result<DynamicObject> {
    let params = PatchParams {
        field_manager: Some(SHARED_FIELD_MANAGER.to_owned()),
        ..PatchParams::default()
    };
    helmreleases(client.clone(), &release.namespace)
        .patch(
            &release.name,
            &params,
            &Patch::Merge(annotation_patch(release, revision, below_uid)),
        )
        .await
}

/// The status patch that hands helm-controller the history its uninstall
/// needs: one snapshot, and the storage namespace when the status lost it.
/// Locked on the resourceVersion read, so that a status helm-controller
/// wrote meanwhile is never overwritten.
fn history_patch(
    release: &ReleaseView,
    snapshot: &HistorySnapshot,
    storage_namespace: Option<&str>,
) -> Value {
    let mut status = json!({ "history": [snapshot.to_json()] });
    if let Some(namespace) = storage_namespace {
        status["storageNamespace"] = json!(namespace);
    }
    json!({
        "metadata": {"resourceVersion": release.resource_version},
        "status": status,
    })
}

/// Writes [`history_patch`] through the status subresource, as manager
/// `flux-plunger` (an `Update` of status fields only: it never makes a
/// suspension ours, SPEC §2).
pub(crate) async fn write_history(
    client: &Client,
    release: &ReleaseView,
    snapshot: &HistorySnapshot,
    storage_namespace: Option<&str>,
) -> kube::Result<DynamicObject> {
    let params = PatchParams {
        field_manager: Some(FIELD_MANAGER.to_owned()),
        ..PatchParams::default()
    };
    helmreleases(client.clone(), &release.namespace)
        .patch_status(
            &release.name,
            &params,
            &Patch::Merge(history_patch(release, snapshot, storage_namespace)),
        )
        .await
}

/// The merge patch that asks helm-controller to reconcile (the annotation
/// `flux reconcile` writes), locked on the resourceVersion read.
fn reconcile_request_patch(release: &ReleaseView, requested_at: &str) -> Value {
    json!({
        "metadata": {
            "resourceVersion": release.resource_version,
            "annotations": { RECONCILE_REQUESTED_AT_ANNOTATION: requested_at },
        },
    })
}

/// Writes `reconcile_request_patch` as manager `flux-plunger`.
pub async fn request_reconcile(
    client: &Client,
    release: &ReleaseView,
    requested_at: &str,
) -> kube::Result<DynamicObject> {
    let params = PatchParams {
        field_manager: Some(FIELD_MANAGER.to_owned()),
        ..PatchParams::default()
    };
    helmreleases(client.clone(), &release.namespace)
        .patch(
            &release.name,
            &params,
            &Patch::Merge(reconcile_request_patch(release, requested_at)),
        )
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn release() -> ReleaseView {
        ReleaseView {
            namespace: "apps".into(),
            name: "web".into(),
            uid: "u-1".into(),
            resource_version: "42".into(),
            ..Default::default()
        }
    }

    #[test]
    fn the_acquire_body_holds_only_identity_preconditions_suspend_and_fence() {
        let install = Install::from_lease("flux-system", "flux-plunger");
        let body = apply_body(&release(), Claim::SUSPEND_AND_FENCE, &install);
        assert_eq!(
            body,
            json!({
                "apiVersion": "helm.toolkit.fluxcd.io/v2",
                "kind": "HelmRelease",
                "metadata": {
                    "name": "web", "namespace": "apps",
                    "resourceVersion": "42", "uid": "u-1",
                    "finalizers": ["flux-plunger.cozystack.io/uninstall-fence"],
                    "labels": {"flux-plunger.cozystack.io/uninstall-fence": "flux-system.flux-plunger"},
                },
                "spec": {"suspend": true},
            })
        );
    }

    #[test]
    fn keeping_only_the_fence_leaves_spec_out_entirely() {
        let body = apply_body(&release(), Claim::FENCE_ONLY, &Install::legacy());
        assert!(body.get("spec").is_none());
        assert_eq!(body["metadata"]["finalizers"], json!([FENCE_FINALIZER]));
        assert_eq!(body["metadata"]["labels"], json!({FENCE_LABEL: "held"}));
    }

    #[test]
    fn giving_everything_up_sends_identity_and_preconditions_alone() {
        let body = apply_body(&release(), Claim::NOTHING, &Install::legacy());
        assert!(body.get("spec").is_none());
        assert!(body["metadata"].get("finalizers").is_none());
        assert!(body["metadata"].get("labels").is_none());
        assert_eq!(body["metadata"]["uid"], "u-1");
        assert_eq!(body["metadata"]["resourceVersion"], "42");
    }

    #[test]
    fn the_guarded_patch_pins_the_read_and_removes_every_fence_from_the_highest_index() {
        assert_eq!(
            guarded_patch(&release(), true, &[2, 0], true),
            json!([
                {"op": "test", "path": "/metadata/resourceVersion", "value": "42"},
                {"op": "test", "path": "/metadata/uid", "value": "u-1"},
                {"op": "test", "path": "/spec/suspend", "value": true},
                {"op": "remove", "path": "/spec/suspend"},
                {"op": "test", "path": "/metadata/finalizers/2", "value": FENCE_FINALIZER},
                {"op": "remove", "path": "/metadata/finalizers/2"},
                {"op": "test", "path": "/metadata/finalizers/0", "value": FENCE_FINALIZER},
                {"op": "remove", "path": "/metadata/finalizers/0"},
                {"op": "remove", "path": "/metadata/labels/flux-plunger.cozystack.io~1uninstall-fence"},
            ])
        );
        assert_eq!(
            guarded_patch(&release(), false, &[], false),
            json!([
                {"op": "test", "path": "/metadata/resourceVersion", "value": "42"},
                {"op": "test", "path": "/metadata/uid", "value": "u-1"},
            ])
        );
    }

    #[test]
    fn the_annotation_patch_is_locked_on_the_resource_version_read() {
        assert_eq!(
            annotation_patch(&release(), 5, Some("uid-4")),
            json!({"metadata": {"resourceVersion": "42",
                "annotations": {"flux-plunger.cozystack.io/last-processed-version": "5",
                    "flux-plunger.cozystack.io/last-processed-below-uid": "uid-4"}}})
        );
        assert_eq!(
            annotation_patch(&release(), 1, None)["metadata"]["annotations"]["flux-plunger.cozystack.io/last-processed-below-uid"],
            ""
        );
    }

    fn snapshot() -> HistorySnapshot {
        HistorySnapshot::example("web", 2, "uninstalling")
    }

    #[test]
    fn the_history_write_is_locked_and_holds_one_snapshot_and_nothing_else() {
        assert_eq!(
            history_patch(&release(), &snapshot(), None),
            json!({"metadata": {"resourceVersion": "42"},
                "status": {"history": [snapshot().to_json()]}})
        );
        assert_eq!(
            history_patch(&release(), &snapshot(), Some("store"))["status"]["storageNamespace"],
            "store"
        );
    }

    #[test]
    fn the_reconcile_request_is_locked_on_the_resource_version_read() {
        assert_eq!(
            reconcile_request_patch(&release(), "flux-plunger-uninstall-t"),
            json!({"metadata": {"resourceVersion": "42",
                "annotations": {"reconcile.fluxcd.io/requestedAt": "flux-plunger-uninstall-t"}}})
        );
    }
}
