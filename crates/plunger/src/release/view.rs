//! A typed, lenient view of the HelmRelease fields flux-plunger decides on,
//! and the API resource a dynamic client names. No request is made here.
//!
//! The view is built from a `DynamicObject` field by field: a malformed field
//! (a status written by a buggy tool, an unknown condition shape) becomes
//! "absent" and is reported in `ReleaseView::malformed`, instead of failing
//! the whole object. An absent field can only make us do less: the release is
//! then not stuck, or not ours.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ManagedFieldsEntry;
use kube::api::DynamicObject;
use serde_json::Value;

use crate::names::{
    FENCE_FINALIZER, FENCE_LABEL, FIELD_MANAGER, HELM_CONTROLLER_FINALIZER,
    PROCESSED_VERSION_ANNOTATION, READY_CONDITION, RECONCILE_REQUEST_PREFIX,
    RECONCILE_REQUESTED_AT_ANNOTATION, RELEASED_CONDITION, STUCK_MESSAGES,
    UNINSTALL_SUCCEEDED_REASON,
};

/// The processed-revision annotation as read from a release (SPEC §4.7).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ProcessedVersion {
    Absent,
    Revision(u64),
    /// Present but not a decimal revision; recovery carries on (SPEC §4.7).
    Unparsable(String),
}

/// What we know about a HelmRelease, as read from the apiserver.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ReleaseView {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub resource_version: String,
    pub generation: Option<i64>,
    pub terminating: bool,
    /// When the delete was requested (`metadata.deletionTimestamp`).
    pub(crate) deleted_at: Option<k8s_openapi::jiff::Timestamp>,
    pub finalizers: Vec<String>,
    /// The value of the fence's label ([`FENCE_LABEL`]): which install set
    /// the fence (`crate::install`).
    pub fence_label: Option<String>,
    pub annotations: BTreeMap<String, String>,
    pub(crate) managed_fields: Vec<ManagedFieldsEntry>,
    /// `spec.suspend`; absent counts as `false`, as helm-controller reads it.
    pub suspend: bool,
    pub(crate) spec_release_name: Option<String>,
    pub(crate) spec_target_namespace: Option<String>,
    pub(crate) spec_storage_namespace: Option<String>,
    /// `spec.serviceAccountName`: whom helm-controller impersonates for the
    /// release under Flux's multi-tenancy lockdown.
    pub(crate) spec_service_account_name: Option<String>,
    pub(crate) has_kube_config: bool,
    /// `spec.kubeConfig.secretRef`: the Secret (and key) holding the
    /// kubeconfig of the cluster the release is installed in.
    pub(crate) kube_config_secret: Option<KubeConfigSecretRef>,
    pub(crate) ready: Option<ReadyCondition>,
    pub observed_generation: Option<i64>,
    pub status_storage_namespace: Option<String>,
    pub status_latest_history_name: Option<String>,
    /// `status.history` holds at least one entry: helm-controller knows
    /// which Helm release to uninstall.
    pub has_history: bool,
    /// The `Released` condition, which says how helm-controller's last Helm
    /// action ended.
    pub(crate) released: Option<ReleasedCondition>,
    /// `status.lastHandledReconcileAt`: the reconcile request helm-controller
    /// last handled.
    pub(crate) last_handled_reconcile_at: Option<String>,
    /// `status.lastAttemptedRevision`: the chart version helm-controller
    /// last tried to release, which Flux's events carry as the revision.
    pub(crate) last_attempted_revision: Option<String>,
    /// `status.lastAttemptedConfigDigest`: the digest of the values of that
    /// try, which Flux's events carry as the token.
    pub(crate) last_attempted_config_digest: Option<String>,
    /// Fields that were present but could not be read, for a log line.
    pub(crate) malformed: Vec<&'static str>,
}

/// Where a release's remote kubeconfig is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct KubeConfigSecretRef {
    pub(crate) name: String,
    pub(crate) key: Option<String>,
}

/// The `Ready` condition, as far as the stuck check needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ReadyCondition {
    pub(crate) status: String,
    pub(crate) message: String,
}

/// The `Released` condition, as far as the uninstall check needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ReleasedCondition {
    pub(crate) reason: String,
    /// The generation of the pass that set it (helm-controller sets it on
    /// every condition it writes).
    pub(crate) observed_generation: Option<i64>,
}

impl ReleaseView {
    /// Builds the view of a HelmRelease read from the apiserver.
    pub fn from_object(obj: &DynamicObject) -> Self {
        let meta = &obj.metadata;
        let mut malformed = Vec::new();
        let spec = obj.data.get("spec");
        let status = obj.data.get("status");
        let suspend = lenient(
            spec.and_then(|s| s.get("suspend")),
            "spec.suspend",
            &mut malformed,
            Value::as_bool,
        )
        .unwrap_or(false);
        let (ready, released) = lenient(
            status.and_then(|s| s.get("conditions")),
            "status.conditions",
            &mut malformed,
            Value::as_array,
        )
        .map_or((None, None), |conditions| {
            (ready_condition(conditions), released_condition(conditions))
        });
        let observed_generation = lenient(
            status.and_then(|s| s.get("observedGeneration")),
            "status.observedGeneration",
            &mut malformed,
            Value::as_i64,
        );
        // Present but unreadable: helm-controller could not read it either,
        // so it counts as no history.
        let history = lenient(
            status.and_then(|s| s.get("history")),
            "status.history",
            &mut malformed,
            Value::as_array,
        );

        Self {
            namespace: meta.namespace.clone().unwrap_or_default(),
            name: meta.name.clone().unwrap_or_default(),
            uid: meta.uid.clone().unwrap_or_default(),
            resource_version: meta.resource_version.clone().unwrap_or_default(),
            generation: meta.generation,
            terminating: meta.deletion_timestamp.is_some(),
            deleted_at: meta.deletion_timestamp.as_ref().map(|t| t.0),
            finalizers: meta.finalizers.clone().unwrap_or_default(),
            fence_label: meta
                .labels
                .as_ref()
                .and_then(|labels| labels.get(FENCE_LABEL))
                .cloned(),
            annotations: meta.annotations.clone().unwrap_or_default(),
            managed_fields: meta.managed_fields.clone().unwrap_or_default(),
            suspend,
            spec_release_name: non_empty_str(spec, "releaseName"),
            spec_target_namespace: non_empty_str(spec, "targetNamespace"),
            spec_storage_namespace: non_empty_str(spec, "storageNamespace"),
            spec_service_account_name: non_empty_str(spec, "serviceAccountName"),
            has_kube_config: spec
                .and_then(|s| s.get("kubeConfig"))
                .is_some_and(|k| !k.is_null()),
            kube_config_secret: kube_config_secret_ref(spec),
            ready,
            observed_generation,
            status_storage_namespace: non_empty_str(status, "storageNamespace"),
            status_latest_history_name: history
                .and_then(|history| history.first())
                .and_then(|latest| non_empty_str(Some(latest), "name")),
            has_history: history.is_some_and(|history| !history.is_empty()),
            released,
            last_handled_reconcile_at: non_empty_str(status, "lastHandledReconcileAt"),
            last_attempted_revision: non_empty_str(status, "lastAttemptedRevision"),
            last_attempted_config_digest: non_empty_str(status, "lastAttemptedConfigDigest"),
            malformed,
        }
    }

    /// How long the release has been terminating, at `now`.
    pub(crate) fn terminating_for(
        &self,
        now: k8s_openapi::jiff::Timestamp,
    ) -> Option<std::time::Duration> {
        self.deleted_at.map(|at| {
            let elapsed = now.duration_since(at);
            std::time::Duration::try_from(elapsed).unwrap_or_default()
        })
    }

    /// The namespace helm-controller installs the release in:
    /// `spec.targetNamespace`, else the release's own.
    pub(crate) fn target_namespace(&self) -> &str {
        self.spec_target_namespace
            .as_deref()
            .unwrap_or(&self.namespace)
    }

    /// `namespace/name`, for logs and reports.
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }

    /// SPEC §1: `Ready=False` with a message containing one of
    /// [`STUCK_MESSAGES`]. Whether anything is reclaimed the storage decides
    /// (`decide::plan_recovery`).
    pub fn is_stuck(&self) -> bool {
        self.ready.as_ref().is_some_and(|c| {
            c.status == "False" && STUCK_MESSAGES.iter().any(|m| c.message.contains(m))
        })
    }

    /// helm-controller is in the middle of a pass: `Ready` is `Unknown`
    /// while its action runs.
    pub(crate) fn helm_controller_mid_pass(&self) -> bool {
        self.ready.as_ref().is_some_and(|c| c.status == "Unknown")
    }

    /// SPEC §2: the suspension is ours only if an `Apply` entry of our manager
    /// owns `f:spec.f:suspend`. Shared ownership still counts.
    pub fn suspend_owned_by_us(&self) -> bool {
        self.managed_fields
            .iter()
            .any(|entry| entry_owns_suspend(entry, FIELD_MANAGER))
    }

    /// A suspension is in force and it is ours.
    pub fn suspended_by_us(&self) -> bool {
        self.suspend && self.suspend_owned_by_us()
    }

    /// SPEC §8: we hold the suspension alone, no other manager co-owns it.
    pub fn suspend_owned_by_us_alone(&self) -> bool {
        self.suspend_owned_by_us()
            && !self
                .managed_fields
                .iter()
                .any(|entry| !is_apply_of(entry, FIELD_MANAGER) && owns_suspend(entry))
    }

    /// The fence's label is on the release, whatever install it names.
    pub fn fence_labelled(&self) -> bool {
        self.fence_label.is_some()
    }

    pub fn has_fence(&self) -> bool {
        self.finalizers.iter().any(|f| f == FENCE_FINALIZER)
    }

    /// The fence is flux-plunger's own: an `Apply` entry of our manager owns
    /// it, or our suspension is in force (SPEC §3: the two are applied
    /// together, and a fence another manager listed a second time takes the
    /// ownership of both copies with it). A copy anybody else put there (a
    /// client-side create carrying the finalizer is enough) drives nothing
    /// of SPEC §5: it is only removed.
    pub(crate) fn fence_owned_by_us(&self) -> bool {
        self.has_fence()
            && (self.suspended_by_us()
                || self
                    .managed_fields
                    .iter()
                    .any(|entry| is_apply_of(entry, FIELD_MANAGER) && owns_fence(entry)))
    }

    /// Positions of our fence in `metadata.finalizers` (it may appear twice).
    pub fn fence_indices(&self) -> Vec<usize> {
        self.finalizers
            .iter()
            .enumerate()
            .filter(|(_, f)| *f == FENCE_FINALIZER)
            .map(|(i, _)| i)
            .collect()
    }

    pub fn has_helm_controller_finalizer(&self) -> bool {
        self.finalizers
            .iter()
            .any(|f| f == HELM_CONTROLLER_FINALIZER)
    }

    /// SPEC §5d: helm-controller has finished with the delete: its finalizer
    /// is gone and it has observed the current generation. Its pass over a
    /// release whose history it had cleared gets here without uninstalling
    /// anything: see [`Self::reported_uninstall_succeeded`].
    pub(crate) fn delete_handled_by_helm_controller(&self) -> bool {
        !self.has_helm_controller_finalizer()
            && self.generation.is_some()
            && self.observed_generation == self.generation
    }

    /// helm-controller ran the Helm uninstall for the current generation
    /// (`Released` is `UninstallSucceeded`, set by a pass at this
    /// generation: the delete itself bumps the generation, so an older
    /// uninstall's condition never counts).
    pub(crate) fn reported_uninstall_succeeded(&self) -> bool {
        self.released.as_ref().is_some_and(|c| {
            c.reason == UNINSTALL_SUCCEEDED_REASON
                && c.observed_generation.is_some()
                && c.observed_generation == self.generation
        })
    }

    /// A reconcile request (`reconcile.fluxcd.io/requestedAt`) that
    /// helm-controller has not handled yet.
    pub fn reconcile_request_pending(&self) -> bool {
        self.annotations
            .get(RECONCILE_REQUESTED_AT_ANNOTATION)
            .is_some_and(|requested| Some(requested) != self.last_handled_reconcile_at.as_ref())
    }

    /// helm-controller has handled the reconcile request flux-plunger made
    /// after handing it a history to uninstall from.
    pub(crate) fn our_reconcile_request_handled(&self) -> bool {
        self.annotations
            .get(RECONCILE_REQUESTED_AT_ANNOTATION)
            .is_some_and(|requested| {
                requested.starts_with(RECONCILE_REQUEST_PREFIX)
                    && Some(requested) == self.last_handled_reconcile_at.as_ref()
            })
    }

    /// The release is opted out of recoveries by its annotation.
    pub(crate) fn recovery_disabled(&self) -> bool {
        self.annotations
            .get(crate::names::RECOVER_ANNOTATION)
            .is_some_and(|v| v == crate::names::RECOVER_DISABLED)
    }

    pub fn carries_processed_annotation(&self) -> bool {
        self.annotations.contains_key(PROCESSED_VERSION_ANNOTATION)
    }

    /// The uid recorded for the revision below the one we reclaimed; `None`
    /// when an older flux-plunger wrote the annotation.
    pub(crate) fn processed_below_uid(&self) -> Option<&str> {
        self.annotations
            .get(crate::names::PROCESSED_BELOW_UID_ANNOTATION)
            .map(String::as_str)
    }

    pub(crate) fn processed_version(&self) -> ProcessedVersion {
        match self.annotations.get(PROCESSED_VERSION_ANNOTATION) {
            None => ProcessedVersion::Absent,
            Some(text) => match text.parse::<u64>() {
                Ok(n) => ProcessedVersion::Revision(n),
                Err(_) => ProcessedVersion::Unparsable(text.clone()),
            },
        }
    }
}

fn entry_owns_suspend(entry: &ManagedFieldsEntry, manager: &str) -> bool {
    is_apply_of(entry, manager) && owns_suspend(entry)
}

/// An entry of `manager`'s server-side applies: only those make a field
/// theirs (SPEC §2).
fn is_apply_of(entry: &ManagedFieldsEntry, manager: &str) -> bool {
    entry.manager.as_deref() == Some(manager) && entry.operation.as_deref() == Some("Apply")
}

fn owns_suspend(entry: &ManagedFieldsEntry) -> bool {
    entry
        .fields_v1
        .as_ref()
        .and_then(|f| f.0.get("f:spec"))
        .and_then(|spec| spec.get("f:suspend"))
        .is_some()
}

fn owns_fence(entry: &ManagedFieldsEntry) -> bool {
    let key = format!("v:{}", serde_json::json!(FENCE_FINALIZER));
    entry
        .fields_v1
        .as_ref()
        .and_then(|f| f.0.get("f:metadata"))
        .and_then(|metadata| metadata.get("f:finalizers"))
        .and_then(|finalizers| finalizers.get(&key))
        .is_some()
}

fn ready_condition(conditions: &[Value]) -> Option<ReadyCondition> {
    conditions
        .iter()
        .find(|c| c.get("type").and_then(Value::as_str) == Some(READY_CONDITION))
        .map(|c| ReadyCondition {
            status: c
                .get("status")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned(),
            message: c
                .get("message")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned(),
        })
}

fn released_condition(conditions: &[Value]) -> Option<ReleasedCondition> {
    conditions
        .iter()
        .find(|c| c.get("type").and_then(Value::as_str) == Some(RELEASED_CONDITION))
        .map(|c| ReleasedCondition {
            reason: c
                .get("reason")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned(),
            observed_generation: c.get("observedGeneration").and_then(Value::as_i64),
        })
}

/// A field read leniently: absent or `null` is `None`; so is a value `read`
/// does not accept, which is recorded in `malformed` as `field`.
fn lenient<'a, T>(
    value: Option<&'a Value>,
    field: &'static str,
    malformed: &mut Vec<&'static str>,
    read: impl FnOnce(&'a Value) -> Option<T>,
) -> Option<T> {
    let accepted = read(value.filter(|v| !v.is_null())?);
    if accepted.is_none() {
        malformed.push(field);
    }
    accepted
}

/// `spec.kubeConfig.secretRef`, when it names a Secret.
fn kube_config_secret_ref(spec: Option<&Value>) -> Option<KubeConfigSecretRef> {
    let secret_ref = spec?.pointer("/kubeConfig/secretRef");
    Some(KubeConfigSecretRef {
        name: non_empty_str(secret_ref, "name")?,
        key: non_empty_str(secret_ref, "key"),
    })
}

fn non_empty_str(parent: Option<&Value>, key: &str) -> Option<String> {
    parent
        .and_then(|p| p.get(key))
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
}

/// The API resource of Flux's HelmRelease, for dynamic clients.
pub fn helmrelease_resource() -> kube::api::ApiResource {
    kube::api::ApiResource {
        group: crate::names::HELMRELEASE_GROUP.to_owned(),
        version: crate::names::HELMRELEASE_VERSION.to_owned(),
        api_version: crate::names::HELMRELEASE_API_VERSION.to_owned(),
        kind: crate::names::HELMRELEASE_KIND.to_owned(),
        plural: crate::names::HELMRELEASE_PLURAL.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn object(value: Value) -> DynamicObject {
        serde_json::from_value(value).unwrap()
    }

    #[test]
    fn a_release_with_no_status_is_not_stuck() {
        let view = ReleaseView::from_object(&object(json!({
            "metadata": {"name": "web", "namespace": "apps"},
            "spec": {"interval": "5m"},
        })));
        assert!(!view.is_stuck());
        assert!(!view.suspend);
        assert!(view.malformed.is_empty());
        assert_eq!(view.key(), "apps/web");
    }

    #[test]
    fn malformed_fields_read_as_absent_and_are_reported() {
        let view = ReleaseView::from_object(&object(json!({
            "metadata": {"name": "web", "namespace": "apps"},
            "spec": {"suspend": "yes"},
            "status": {"conditions": {"type": "Ready"}, "observedGeneration": "three", "history": 5},
        })));
        assert!(!view.suspend);
        assert_eq!(view.ready, None);
        assert_eq!(view.observed_generation, None);
        assert_eq!(view.status_latest_history_name, None);
        assert_eq!(
            view.malformed,
            vec![
                "spec.suspend",
                "status.conditions",
                "status.observedGeneration",
                "status.history"
            ]
        );
    }

    #[test]
    fn conditions_of_unknown_shape_are_skipped_and_the_ready_one_is_found() {
        let view = ReleaseView::from_object(&object(json!({
            "metadata": {"name": "web", "namespace": "apps"},
            "status": {"conditions": [
                "not an object",
                {"type": 7},
                {"type": "Ready", "status": "False", "message": "x has no deployed releases"},
            ]},
        })));
        assert!(view.is_stuck());
    }

    #[test]
    fn the_identity_fields_and_history_are_read() {
        let view = ReleaseView::from_object(&object(json!({
            "metadata": {"name": "web", "namespace": "apps", "deletionTimestamp": "2026-01-01T00:00:00Z",
                "finalizers": ["finalizers.fluxcd.io", FENCE_FINALIZER, FENCE_FINALIZER]},
            "spec": {"releaseName": "rel", "targetNamespace": "t", "storageNamespace": "s", "kubeConfig": {"secretRef": {"name": "k"}}},
            "status": {"storageNamespace": "s2", "history": [{"name": "hist"}, {"name": "older"}]},
        })));
        assert_eq!(view.spec_release_name.as_deref(), Some("rel"));
        assert_eq!(view.spec_target_namespace.as_deref(), Some("t"));
        assert_eq!(view.spec_storage_namespace.as_deref(), Some("s"));
        assert_eq!(view.status_storage_namespace.as_deref(), Some("s2"));
        assert_eq!(view.status_latest_history_name.as_deref(), Some("hist"));
        assert!(view.has_kube_config && view.terminating);
        assert_eq!(view.fence_indices(), vec![1, 2]);
        let later = "2026-01-01T00:10:00Z".parse().unwrap();
        assert_eq!(
            view.terminating_for(later),
            Some(std::time::Duration::from_secs(600))
        );
    }

    #[test]
    fn a_history_counts_only_when_it_lists_a_revision() {
        let has_history = |history: Value| {
            ReleaseView::from_object(&object(json!({
                "metadata": {"name": "web", "namespace": "apps"},
                "status": {"history": history},
            })))
            .has_history
        };
        assert!(!has_history(json!([])));
        assert!(!has_history(Value::Null));
        assert!(has_history(json!([{"name": "web"}])));
        assert!(has_history(json!([{"name": ""}])));
    }

    #[test]
    fn the_fence_is_ours_only_when_our_apply_entry_owns_it_or_our_suspension_is_on() {
        let fenced_with = |fields: Value, suspend: bool| {
            ReleaseView::from_object(&object(json!({
                "metadata": {"name": "web", "namespace": "apps",
                    "finalizers": [FENCE_FINALIZER],
                    "managedFields": [{"manager": FIELD_MANAGER, "operation": "Apply",
                        "apiVersion": "helm.toolkit.fluxcd.io/v2", "fieldsType": "FieldsV1",
                        "fieldsV1": fields}]},
                "spec": {"suspend": suspend},
            })))
            .fence_owned_by_us()
        };
        let fence_key = format!("v:{}", json!(FENCE_FINALIZER));
        let owning_the_fence = json!({"f:metadata": {"f:finalizers": {fence_key: {}}}});
        let owning_another =
            json!({"f:metadata": {"f:finalizers": {"v:\"example.com/other\"": {}}}});
        let owning_a_label = json!({"f:metadata": {"f:labels": {"f:team": {}}}});
        assert!(fenced_with(owning_the_fence, false));
        assert!(!fenced_with(owning_another, false));
        assert!(!fenced_with(owning_a_label.clone(), false));
        let suspended_by_us = json!({"f:spec": {"f:suspend": {}}});
        assert!(fenced_with(suspended_by_us, true));
        assert!(!fenced_with(owning_a_label, true));
    }

    #[test]
    fn the_released_condition_is_found_among_the_others_and_counts_at_its_generation() {
        let uninstalled = |reason: &str, observed: i64| {
            ReleaseView::from_object(&object(json!({
                "metadata": {"name": "web", "namespace": "apps", "generation": 3},
                "status": {"conditions": [
                    {"type": "Ready", "status": "False", "reason": "UninstallSucceeded", "observedGeneration": 3},
                    {"type": RELEASED_CONDITION, "status": "False", "reason": reason, "observedGeneration": observed},
                ]},
            })))
            .reported_uninstall_succeeded()
        };
        assert!(uninstalled(UNINSTALL_SUCCEEDED_REASON, 3));
        assert!(!uninstalled(UNINSTALL_SUCCEEDED_REASON, 2));
        assert!(!uninstalled("UninstallFailed", 3));
    }

    #[test]
    fn the_remote_kubeconfig_reference_ignores_empty_names_and_keys() {
        let view = |secret_ref: Value| {
            ReleaseView::from_object(&object(json!({
                "metadata": {"name": "web", "namespace": "apps"},
                "spec": {"kubeConfig": {"secretRef": secret_ref}},
            })))
            .kube_config_secret
        };
        assert_eq!(
            view(json!({"name": "kc", "key": "custom"})),
            Some(KubeConfigSecretRef {
                name: "kc".into(),
                key: Some("custom".into())
            })
        );
        assert_eq!(
            view(json!({"name": "kc", "key": ""})),
            Some(KubeConfigSecretRef {
                name: "kc".into(),
                key: None
            })
        );
        assert_eq!(view(json!({"name": "", "key": "custom"})), None);
        assert_eq!(view(json!({"key": "custom"})), None);
    }

    #[test]
    fn the_processed_annotation_is_parsed_as_a_decimal_revision() {
        let mut view = ReleaseView::default();
        assert_eq!(view.processed_version(), ProcessedVersion::Absent);
        view.annotations
            .insert(PROCESSED_VERSION_ANNOTATION.into(), "12".into());
        assert_eq!(view.processed_version(), ProcessedVersion::Revision(12));
        view.annotations
            .insert(PROCESSED_VERSION_ANNOTATION.into(), " 12".into());
        assert_eq!(
            view.processed_version(),
            ProcessedVersion::Unparsable(" 12".into())
        );
    }
}
