//! Objects arranged for a test: a namespace of its own, HelmReleases in the
//! shapes helm-controller leaves them, and Helm storage Secrets.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU32, Ordering};

use anyhow::Result;
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{Namespace, Secret};
use kube::Client;
use kube::api::{Api, DynamicObject, ObjectMeta, Patch, PatchParams, PostParams};
use plunger::names;
use plunger::release::helmreleases;
use serde_json::{Value, json};

/// A namespace created for one test. Never deleted: no namespace controller
/// runs on the local control plane, and the whole plane goes when the test
/// process ends.
pub struct TestNamespace {
    pub name: String,
    pub client: Client,
}

static NEXT: AtomicU32 = AtomicU32::new(0);

impl TestNamespace {
    pub async fn create(client: &Client, prefix: &str) -> Result<Self> {
        let n = NEXT.fetch_add(1, Ordering::SeqCst);
        let name = format!("{prefix}-{}-{n}", std::process::id());
        let namespaces: Api<Namespace> = Api::all(client.clone());
        let namespace = Namespace {
            metadata: ObjectMeta {
                name: Some(name.clone()),
                ..Default::default()
            },
            ..Default::default()
        };
        namespaces
            .create(&PostParams::default(), &namespace)
            .await?;
        Ok(Self {
            name,
            client: client.clone(),
        })
    }

    /// The HelmReleases of this namespace.
    pub fn releases(&self) -> Api<DynamicObject> {
        helmreleases(self.client.clone(), &self.name)
    }

    /// The Secrets of this namespace.
    pub fn secrets(&self) -> Api<Secret> {
        Api::namespaced(self.client.clone(), &self.name)
    }

    /// Creates a HelmRelease the way a user writes one (client-side, so no
    /// `Apply` entry exists), with `spec.interval` set and `extra_spec` merged.
    pub async fn create_release(&self, name: &str, extra_spec: Value) -> Result<DynamicObject> {
        let mut spec = json!({
            "interval": "5m",
            "chart": {"spec": {"chart": "demo", "sourceRef": {"kind": "HelmRepository", "name": "demo"}}},
        });
        merge(&mut spec, extra_spec);
        let object: DynamicObject = serde_json::from_value(json!({
            "apiVersion": names::HELMRELEASE_API_VERSION,
            "kind": names::HELMRELEASE_KIND,
            "metadata": {"name": name, "namespace": self.name},
            "spec": spec,
        }))?;
        Ok(self
            .releases()
            .create(&PostParams::default(), &object)
            .await?)
    }

    /// Writes the status helm-controller leaves on a release whose upgrade
    /// Helm refused: `Ready=False`, "... has no deployed releases".
    pub async fn mark_stuck(&self, name: &str) -> Result<DynamicObject> {
        self.set_ready(
            name,
            "False",
            "UpgradeFailed",
            &format!("Helm upgrade failed for release {}/{name} with chart demo@1.0.0: \"{name}\" has no deployed releases", self.name),
        )
        .await
    }

    /// Sets the `Ready` condition (status subresource).
    pub async fn set_ready(
        &self,
        name: &str,
        status: &str,
        reason: &str,
        message: &str,
    ) -> Result<DynamicObject> {
        let patch = json!({"status": {"conditions": [{
            "type": "Ready", "status": status, "reason": reason, "message": message,
            "lastTransitionTime": "2026-01-01T00:00:00Z",
        }]}});
        Ok(self
            .releases()
            .patch_status(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await?)
    }

    /// Creates the Helm storage Secret of `release` at `revision`.
    pub async fn create_storage_secret(
        &self,
        release: &str,
        revision: u64,
        status: &str,
    ) -> Result<Secret> {
        let labels = BTreeMap::from([
            (
                names::HELM_STORAGE_OWNER_LABEL.to_owned(),
                "helm".to_owned(),
            ),
            (
                names::HELM_STORAGE_NAME_LABEL.to_owned(),
                release.to_owned(),
            ),
            (
                names::HELM_STORAGE_VERSION_LABEL.to_owned(),
                revision.to_string(),
            ),
            (
                names::HELM_STORAGE_STATUS_LABEL.to_owned(),
                status.to_owned(),
            ),
        ]);
        let secret = Secret {
            metadata: ObjectMeta {
                name: Some(names::storage_secret_name(release, revision)),
                labels: Some(labels),
                ..Default::default()
            },
            type_: Some(names::HELM_STORAGE_SECRET_TYPE.to_owned()),
            data: Some(BTreeMap::from([(
                "release".to_owned(),
                ByteString(b"H4sIAAAAAAAA/wMAAAAAAAAAAAA=".to_vec()),
            )])),
            ..Default::default()
        };
        Ok(self
            .secrets()
            .create(&PostParams::default(), &secret)
            .await?)
    }
}

/// Merges `patch` into `target` as a JSON merge patch would.
pub fn merge(target: &mut Value, patch: Value) {
    match (target, patch) {
        (Value::Object(t), Value::Object(p)) => {
            for (k, v) in p {
                if v.is_null() {
                    t.remove(&k);
                } else {
                    merge(t.entry(k).or_insert(Value::Null), v);
                }
            }
        }
        (t, p) => *t = p,
    }
}
