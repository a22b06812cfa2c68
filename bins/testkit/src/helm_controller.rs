//! A simulated helm-controller: the part of Flux's helm-controller (v1.5,
//! v1.6) that decides whether a deleted HelmRelease is uninstalled, step for
//! step as its `Reconcile` and `reconcileDelete` do it:
//!
//! - a live release gets `finalizers.fluxcd.io` first;
//! - a deleted release is uninstalled only when `spec.suspend` is not true;
//!   the finalizer is dropped either way (this is the orphaning the fence
//!   prevents);
//! - every pass that ends without error records `status.observedGeneration`.
//!
//! "Installing" a release here means a ConfigMap `<release>-resources` in its
//! namespace; the uninstall deletes it, so a test sees an orphan as a
//! ConfigMap left behind by a release that is gone.
//!
//! What it leaves out, on purpose (checked against the real one in
//! `bins/e2e`): the real helm-controller's deletion path uninstalls only what
//! its `status.history` still names, and it clears that history when it meets
//! storage it did not write — which is how a release gets stuck. So the real
//! one deletes a stuck release's HelmChart but cannot uninstall it
//! (`ErrNoLatest`), fence or not. Here the ConfigMap's delete stands for "the
//! deletion path ran": the decision the fence protects, which is the same in
//! both.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Result;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::Client;
use kube::api::{Api, ObjectMeta, Patch, PatchParams, PostParams};
use plunger::names::HELM_CONTROLLER_FINALIZER;
use plunger::release::{ReleaseView, helmreleases};
use serde_json::json;

/// What one pass did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Handled {
    Gone,
    AddedFinalizer,
    SkippedSuspended,
    Reconciled,
    Uninstalled,
    UninstallSkippedBecauseSuspended,
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
}

impl SimulatedHelmController {
    pub fn new(client: Client, namespace: &str) -> Self {
        Self {
            client,
            namespace: namespace.to_owned(),
            journal: Arc::default(),
        }
    }

    /// The ConfigMap that stands for everything the release installed.
    pub fn resources_name(release: &str) -> String {
        format!("{release}-resources")
    }

    /// "Installs" the release: creates its resources ConfigMap.
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
        let handled = if release.terminating {
            let handled = if release.suspend {
                Handled::UninstallSkippedBecauseSuspended
            } else {
                self.uninstall(name).await?;
                Handled::Uninstalled
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
        self.record_observed_generation(name, release.generation)
            .await?;
        Ok(handled)
    }

    /// Runs passes over every release of the namespace until `stop` is set,
    /// as a background controller would.
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
                        if let Some(name) = object.metadata.name {
                            let _ = self.handle(&name).await;
                        }
                    }
                }
                tokio::time::sleep(period).await;
            }
        });
        (handle, stop)
    }

    async fn uninstall(&self, release: &str) -> Result<()> {
        let configmaps: Api<ConfigMap> = Api::namespaced(self.client.clone(), &self.namespace);
        match configmaps
            .delete(&Self::resources_name(release), &Default::default())
            .await
        {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
            Err(e) => Err(e.into()),
        }
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

    async fn record_observed_generation(&self, name: &str, generation: Option<i64>) -> Result<()> {
        let patch = json!({"status": {"observedGeneration": generation}});
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
