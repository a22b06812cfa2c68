//! A simulated helm-controller: the part of Flux's helm-controller (v1.4 to
//! v1.6) that decides whether a deleted HelmRelease is uninstalled, step for
//! step as its `Reconcile`, `reconcileDelete` and `reconcileReleaseDeletion`
//! do it (checked against the real one in `testing/e2e`):
//!
//! - a live release gets `finalizers.fluxcd.io` first;
//! - a deleted release is uninstalled only when `spec.suspend` is not true,
//!   `status.storageNamespace` is set, and `status.history` names the Helm
//!   release (its uninstall runs `helm uninstall <history[0].name>`); an
//!   empty history is `ErrNoLatest`, tolerated: nothing is uninstalled. An
//!   unsuspended pass with a storage namespace clears it and the history
//!   either way, by a merge patch from what it read (so a history written
//!   meanwhile survives); an uninstall sets `Released` to
//!   `UninstallSucceeded`. The
//!   finalizer is dropped in every case (the orphaning the fence prevents);
//! - every pass that ends without error records `status.observedGeneration`
//!   and the reconcile request it handled (`status.lastHandledReconcileAt`).
//!
//! "Installing" a release here means a ConfigMap `<release>-resources` in its
//! namespace; the uninstall deletes it and purges the release's Helm storage,
//! so a test sees an orphan as a ConfigMap left behind by a release that is
//! gone. A stuck release has no history (fixtures never write one), as the
//! real helm-controller leaves it.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Result;
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use kube::api::{Api, ListParams, ObjectMeta, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use plunger::names::{
    HELM_CONTROLLER_FINALIZER, RECONCILE_REQUESTED_AT_ANNOTATION, RELEASED_CONDITION,
    UNINSTALL_SUCCEEDED_REASON,
};
use plunger::release::api::helmreleases;
use plunger::release::view::ReleaseView;
use serde_json::{Value, json};

/// What one pass did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Handled {
    Gone,
    AddedFinalizer,
    SkippedSuspended,
    Reconciled,
    Uninstalled,
    UninstallSkippedBecauseSuspended,
    /// Unsuspended, but nothing recorded to uninstall (no history or no
    /// storage namespace): the pass lets the release go with its resources.
    NothingRecordedToUninstall,
    /// A write lost a race (409): the real controller requeues.
    Conflict,
}

/// The simulated helm-controller of one namespace.
#[derive(Clone)]
pub struct SimulatedHelmController {
    client: Client,
    namespace: String,
    /// Every uninstall decision, in order, as (release, handled).
    pub journal: Arc<Mutex<Vec<(String, Handled)>>>,
    /// The storage Secrets an uninstall set out to purge (listed before it
    /// deleted them), so that a test tells Helm's purge from a delete of
    /// flux-plunger's.
    pub purged: Arc<Mutex<BTreeSet<String>>>,
}

impl SimulatedHelmController {
    pub fn new(client: Client, namespace: &str) -> Self {
        Self {
            client,
            namespace: namespace.to_owned(),
            journal: Arc::default(),
            purged: Arc::default(),
        }
    }

    /// The ConfigMap that stands for everything the release installed.
    pub fn resources_name(release: &str) -> String {
        format!("{release}-resources")
    }

    /// "Installs" the release: creates its resources ConfigMap and records
    /// it in the release's status (its history and storage namespace), as
    /// a successful install does.
    pub async fn install(&self, release: &str) -> Result<()> {
        let configmaps: Api<ConfigMap> = Api::namespaced(self.client.clone(), &self.namespace);
        let cm = ConfigMap {
            metadata: ObjectMeta {
                name: Some(Self::resources_name(release)),
                ..Default::default()
            },
            data: Some(BTreeMap::from([("release".to_owned(), release.to_owned())])),
            ..Default::default()
        };
        configmaps.create(&PostParams::default(), &cm).await?;
        let status = json!({"status": {
            "storageNamespace": self.namespace,
            "history": [{
                "name": release, "namespace": self.namespace, "version": 1, "status": "deployed",
                "chartName": "demo", "chartVersion": "1.0.0",
                "configDigest": "sha256:0", "digest": "sha256:0",
                "firstDeployed": "2026-01-01T00:00:00Z", "lastDeployed": "2026-01-01T00:00:00Z",
            }],
        }});
        helmreleases(self.client.clone(), &self.namespace)
            .patch_status(release, &PatchParams::default(), &Patch::Merge(&status))
            .await?;
        Ok(())
    }

    /// Whether the release's resources still exist.
    pub async fn resources_exist(&self, release: &str) -> Result<bool> {
        let configmaps: Api<ConfigMap> = Api::namespaced(self.client.clone(), &self.namespace);
        Ok(configmaps
            .get_opt(&Self::resources_name(release))
            .await?
            .is_some())
    }

    /// The uninstall decisions taken for `release`.
    pub fn decisions_for(&self, release: &str) -> Vec<Handled> {
        self.journal
            .lock()
            .unwrap()
            .iter()
            .filter(|(r, _)| r == release)
            .map(|(_, h)| h.clone())
            .collect()
    }

    /// One reconcile of one release.
    pub async fn handle(&self, name: &str) -> Result<Handled> {
        let releases = helmreleases(self.client.clone(), &self.namespace);
        let Some(object) = releases.get_opt(name).await? else {
            return Ok(Handled::Gone);
        };
        let release = ReleaseView::from_object(&object);
        let mut status = json!({});
        let handled = if release.terminating {
            let handled = if release.suspend {
                Handled::UninstallSkippedBecauseSuspended
            } else {
                let handled = if release.status_storage_namespace.is_none() {
                    Handled::NothingRecordedToUninstall
                } else if let Some(helm_release) = &release.status_latest_history_name {
                    self.uninstall(name, &release, helm_release).await?;
                    status["conditions"] = json!([{
                        "type": RELEASED_CONDITION, "status": "False",
                        "reason": UNINSTALL_SUCCEEDED_REASON,
                        "message": format!("Helm uninstall succeeded for release {}/{helm_release}", self.namespace),
                        "observedGeneration": release.generation,
                        "lastTransitionTime": "2026-01-01T00:00:00Z",
                    }]);
                    Handled::Uninstalled
                } else {
                    Handled::NothingRecordedToUninstall
                };
                clear_recorded_release(&release, &mut status);
                handled
            };
            self.journal
                .lock()
                .unwrap()
                .push((name.to_owned(), handled.clone()));
            if let Some(index) = release
                .finalizers
                .iter()
                .position(|f| f == HELM_CONTROLLER_FINALIZER)
                && !self.remove_finalizer(&release, index).await?
            {
                return Ok(Handled::Conflict);
            }
            handled
        } else if !release.has_helm_controller_finalizer() {
            let patch: json_patch::Patch = serde_json::from_value(json!([
                {"op": "test", "path": "/metadata/resourceVersion", "value": release.resource_version},
                {"op": "add", "path": if release.finalizers.is_empty() { "/metadata/finalizers" } else { "/metadata/finalizers/-" },
                 "value": if release.finalizers.is_empty() { json!([HELM_CONTROLLER_FINALIZER]) } else { json!(HELM_CONTROLLER_FINALIZER) }},
            ]))?;
            return match releases
                .patch(name, &PatchParams::default(), &Patch::<()>::Json(patch))
                .await
            {
                Ok(_) => Ok(Handled::AddedFinalizer),
                Err(kube::Error::Api(s)) if s.code == 409 || s.code == 422 => Ok(Handled::Conflict),
                Err(e) => Err(e.into()),
            };
        } else if release.suspend {
            Handled::SkippedSuspended
        } else {
            Handled::Reconciled
        };
        status["observedGeneration"] = json!(release.generation);
        if let Some(requested) = release.annotations.get(RECONCILE_REQUESTED_AT_ANNOTATION) {
            status["lastHandledReconcileAt"] = json!(requested);
        }
        self.record_pass(name, status).await?;
        Ok(handled)
    }

    /// Runs passes over the releases of the namespace until `stop` is set,
    /// each when the real controller's watch would trigger one: a live
    /// release without its finalizer, a generation not observed yet, or a
    /// reconcile request not handled yet. A status write alone triggers
    /// nothing, as helm-controller filters its events by generation and
    /// request.
    pub fn spawn(
        self,
        period: Duration,
    ) -> (
        tokio::task::JoinHandle<()>,
        Arc<std::sync::atomic::AtomicBool>,
    ) {
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = stop.clone();
        let handle = tokio::spawn(async move {
            while !flag.load(std::sync::atomic::Ordering::SeqCst) {
                let releases = helmreleases(self.client.clone(), &self.namespace);
                if let Ok(list) = releases.list(&Default::default()).await {
                    for object in list.items {
                        if pass_due(&ReleaseView::from_object(&object)) {
                            let _ = self.handle(&object.name_any()).await;
                        }
                    }
                }
                tokio::time::sleep(period).await;
            }
        });
        (handle, stop)
    }

    /// The Helm uninstall of `helm_release`: its resources, then its storage.
    async fn uninstall(&self, name: &str, release: &ReleaseView, helm_release: &str) -> Result<()> {
        let configmaps: Api<ConfigMap> = Api::namespaced(self.client.clone(), &self.namespace);
        match configmaps
            .delete(&Self::resources_name(name), &Default::default())
            .await
        {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 404 => {}
            Err(e) => return Err(e.into()),
        }
        let storage_namespace = release
            .status_storage_namespace
            .as_deref()
            .unwrap_or(&self.namespace);
        let secrets: Api<Secret> = Api::namespaced(self.client.clone(), storage_namespace);
        let selector = format!("owner=helm,name={helm_release}");
        let listed = secrets
            .list(&ListParams::default().labels(&selector))
            .await?
            .items;
        self.purged
            .lock()
            .unwrap()
            .extend(listed.iter().map(|secret| secret.name_any()));
        for secret in listed {
            match secrets
                .delete(&secret.name_any(), &Default::default())
                .await
            {
                Ok(_) => {}
                Err(kube::Error::Api(s)) if s.code == 404 => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    /// Drops `finalizers.fluxcd.io` at `index`, guarded so no other
    /// finalizer is touched; false when the list changed meanwhile.
    async fn remove_finalizer(&self, release: &ReleaseView, index: usize) -> Result<bool> {
        let path = format!("/metadata/finalizers/{index}");
        let patch: json_patch::Patch = serde_json::from_value(json!([
            {"op": "test", "path": path, "value": HELM_CONTROLLER_FINALIZER},
            {"op": "remove", "path": path},
        ]))?;
        match helmreleases(self.client.clone(), &self.namespace)
            .patch(
                &release.name,
                &PatchParams::default(),
                &Patch::<()>::Json(patch),
            )
            .await
        {
            Ok(_) => Ok(true),
            Err(kube::Error::Api(s)) if s.code == 422 || s.code == 409 => Ok(false),
            Err(kube::Error::Api(s)) if s.code == 404 => Ok(true),
            Err(e) => Err(e.into()),
        }
    }

    /// Writes what the pass records in the status, in one patch.
    async fn record_pass(&self, name: &str, status: Value) -> Result<()> {
        let patch = json!({ "status": status });
        match helmreleases(self.client.clone(), &self.namespace)
            .patch_status(name, &PatchParams::default(), &Patch::Merge(patch))
            .await
        {
            Ok(_) => Ok(()),
            // The release went with its last finalizer: nothing to record.
            Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
            Err(e) => Err(e.into()),
        }
    }
}

/// What an unsuspended delete pass removes from the status. Without a
/// storage namespace helm-controller's deletion returns before it truncates
/// the status; otherwise it clears the history and the storage namespace.
/// Its patch helper sends a merge patch computed from the object the pass
/// read, so only what that object had set is removed: a history another
/// writer added meanwhile survives.
fn clear_recorded_release(release: &ReleaseView, status: &mut Value) {
    if release.status_storage_namespace.is_none() {
        return;
    }
    if release.has_history {
        status["history"] = Value::Null;
    }
    status["storageNamespace"] = Value::Null;
}

/// Whether helm-controller's watch would trigger a pass over `release`.
pub fn pass_due(release: &ReleaseView) -> bool {
    (!release.terminating && !release.has_helm_controller_finalizer())
        || release.observed_generation != release.generation
        || release.reconcile_request_pending()
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::api::{ApiResource, DynamicObject};

    fn view(status: Value) -> ReleaseView {
        let resource = ApiResource {
            group: "helm.toolkit.fluxcd.io".into(),
            version: "v2".into(),
            api_version: "helm.toolkit.fluxcd.io/v2".into(),
            kind: "HelmRelease".into(),
            plural: "helmreleases".into(),
        };
        let mut object = DynamicObject::new("web", &resource).within("apps");
        object.data = json!({ "status": status });
        ReleaseView::from_object(&object)
    }

    fn cleared(status: Value) -> Value {
        let mut patch = json!({});
        clear_recorded_release(&view(status), &mut patch);
        patch
    }

    #[test]
    fn a_pass_that_read_no_history_leaves_the_history_alone() {
        // flux-plunger may hand a history over while the pass runs.
        assert_eq!(
            cleared(json!({"storageNamespace": "apps"})),
            json!({"storageNamespace": null})
        );
        assert_eq!(cleared(json!({})), json!({}));
    }

    #[test]
    fn a_pass_that_read_a_history_and_a_storage_namespace_clears_both() {
        assert_eq!(
            cleared(json!({"storageNamespace": "apps", "history": [{"name": "web"}]})),
            json!({"history": null, "storageNamespace": null})
        );
    }

    #[test]
    fn without_a_storage_namespace_the_status_is_not_truncated() {
        assert_eq!(cleared(json!({"history": [{"name": "web"}]})), json!({}));
    }
}
