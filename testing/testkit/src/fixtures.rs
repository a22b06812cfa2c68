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
use plunger::release::api::helmreleases;
use plunger::release::view::ReleaseView;
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

    /// The names of the Secrets of this namespace, sorted.
    pub async fn secret_names(&self) -> Result<Vec<String>> {
        let mut names: Vec<String> = self
            .secrets()
            .list(&Default::default())
            .await?
            .items
            .into_iter()
            .filter_map(|s| s.metadata.name)
            .collect();
        names.sort();
        Ok(names)
    }

    /// Creates a HelmRelease the way a user writes one (client-side, so no
    /// `Apply` entry exists), with `spec.interval` set and `extra_spec` merged.
    pub async fn create_release(&self, name: &str, extra_spec: Value) -> Result<DynamicObject> {
        self.create_release_object(name, extra_spec, &[]).await
    }

    /// A release installed in another cluster: the kubeconfig document
    /// `kubeconfig_yaml` in Secret `remote-kubeconfig` (key `value.yaml`),
    /// which its `spec.kubeConfig` names.
    pub async fn create_remote_release(
        &self,
        name: &str,
        kubeconfig_yaml: &str,
    ) -> Result<DynamicObject> {
        let kubeconfig: Secret = serde_json::from_value(json!({
            "metadata": {"name": "remote-kubeconfig"},
            "stringData": {"value.yaml": kubeconfig_yaml},
        }))?;
        self.secrets()
            .create(&PostParams::default(), &kubeconfig)
            .await?;
        self.create_release(
            name,
            json!({"kubeConfig": {"secretRef": {"name": "remote-kubeconfig"}}}),
        )
        .await
    }

    async fn create_release_object(
        &self,
        name: &str,
        extra_spec: Value,
        finalizers: &[&str],
    ) -> Result<DynamicObject> {
        let mut spec = json!({
            "interval": "5m",
            "chart": {"spec": {"chart": "demo", "sourceRef": {"kind": "HelmRepository", "name": "demo"}}},
        });
        merge(&mut spec, extra_spec);
        let mut metadata = json!({"name": name, "namespace": self.name});
        if !finalizers.is_empty() {
            metadata["finalizers"] = json!(finalizers);
        }
        let object: DynamicObject = serde_json::from_value(json!({
            "apiVersion": names::HELMRELEASE_API_VERSION,
            "kind": names::HELMRELEASE_KIND,
            "metadata": metadata,
            "spec": spec,
        }))?;
        Ok(self
            .releases()
            .create(&PostParams::default(), &object)
            .await?)
    }

    /// [`Self::create_release`], already carrying helm-controller's finalizer
    /// (as a release helm-controller has reconciled once does).
    pub async fn create_release_with_helm_controller_finalizer(
        &self,
        name: &str,
    ) -> Result<DynamicObject> {
        self.create_release_object(name, json!({}), &[names::HELM_CONTROLLER_FINALIZER])
            .await
    }

    /// Sets `spec.suspend` by a forced server-side apply of `manager` (an
    /// operator's or a migration's apply): an `Apply` entry owning the field.
    pub async fn apply_suspend_as(
        &self,
        name: &str,
        manager: &str,
        value: bool,
    ) -> Result<DynamicObject> {
        let body = json!({"apiVersion": names::HELMRELEASE_API_VERSION, "kind": names::HELMRELEASE_KIND,
            "metadata": {"name": name}, "spec": {"suspend": value}});
        Ok(self
            .releases()
            .patch(
                name,
                &PatchParams::apply(manager).force(),
                &Patch::Apply(body),
            )
            .await?)
    }

    /// Sets `spec.suspend` by a merge patch of `manager` (`kubectl patch`,
    /// `flux suspend`, a backup controller): an `Update` entry owning it.
    pub async fn update_suspend_as(
        &self,
        name: &str,
        manager: &str,
        value: bool,
    ) -> Result<DynamicObject> {
        let params = PatchParams {
            field_manager: Some(manager.into()),
            ..Default::default()
        };
        Ok(self
            .releases()
            .patch(
                name,
                &params,
                &Patch::Merge(json!({"spec": {"suspend": value}})),
            )
            .await?)
    }

    /// flux-plunger's own write as a recovery takes it: the fence with its
    /// label and, with `suspend`, the suspension (a server-side apply by
    /// manager `flux-plunger`), as a process stopped mid-recovery leaves them.
    pub async fn apply_as_flux_plunger(&self, name: &str, suspend: bool) -> Result<DynamicObject> {
        self.apply_fence(name, fence_body(name, suspend)).await
    }

    /// The same write by the install whose fence label value is
    /// `label_value` (`plunger::install::Install`).
    pub async fn apply_as_install(
        &self,
        name: &str,
        suspend: bool,
        label_value: &str,
    ) -> Result<DynamicObject> {
        let mut body = fence_body(name, suspend);
        body["metadata"]["labels"] = json!({ names::FENCE_LABEL: label_value });
        self.apply_fence(name, body).await
    }

    /// The same write by an older flux-plunger, which set the fence without
    /// its label.
    pub async fn apply_as_older_flux_plunger(
        &self,
        name: &str,
        suspend: bool,
    ) -> Result<DynamicObject> {
        let mut body = fence_body(name, suspend);
        body["metadata"]
            .as_object_mut()
            .expect("an object")
            .remove("labels");
        self.apply_fence(name, body).await
    }

    async fn apply_fence(&self, name: &str, body: Value) -> Result<DynamicObject> {
        Ok(self
            .releases()
            .patch(
                name,
                &PatchParams::apply(names::FIELD_MANAGER),
                &Patch::Apply(body),
            )
            .await?)
    }

    /// Writes the status helm-controller leaves on a release whose upgrade
    /// Helm refused: `Ready=False`, "... has no deployed releases", and its
    /// history cleared (it no longer recognised the stored release).
    pub async fn mark_stuck(&self, name: &str) -> Result<DynamicObject> {
        self.mark_stuck_saying(name, "has no deployed releases")
            .await
    }

    /// [`Self::mark_stuck`], helm-controller's message ending in `words`
    /// (one of `plunger::names::STUCK_MESSAGES`, or any other).
    pub async fn mark_stuck_saying(&self, name: &str, words: &str) -> Result<DynamicObject> {
        let message = if words == "has no deployed releases" {
            format!(
                "Helm upgrade failed for release {}/{name} with chart demo@1.0.0: \"{name}\" {words}",
                self.name
            )
        } else if words.starts_with("unable to determine") {
            format!("Could not determine release state: {words}")
        } else {
            format!(
                "Helm install failed for release {}/{name} with chart demo@1.0.0: {words}",
                self.name
            )
        };
        self.set_ready(name, "False", "UpgradeFailed", &message)
            .await?;
        Ok(self
            .releases()
            .patch_status(
                name,
                &PatchParams::default(),
                &Patch::Merge(json!({"status": {"history": null}})),
            )
            .await?)
    }

    /// True once release `name` is recovered to `revision`: the processed
    /// annotation names it, and no suspension or fence is left on it.
    pub async fn is_recovered(&self, name: &str, revision: u64) -> Result<bool> {
        Ok(is_recovered(&self.releases().get(name).await?, revision))
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
        let payload = crate::helm_storage::encode_release(&stored_release(
            release, &self.name, revision, status,
        ))?;
        let secret = storage_secret(release, revision, status, payload);
        Ok(self
            .secrets()
            .create(&PostParams::default(), &secret)
            .await?)
    }

    /// [`TestNamespace::create_storage_secret`] with a payload of about
    /// `bytes` (as stored in the Secret), as a chart with big manifests
    /// leaves; returns the payload's exact size.
    pub async fn create_large_storage_secret(
        &self,
        release: &str,
        revision: u64,
        status: &str,
        bytes: usize,
    ) -> Result<usize> {
        let mut content = stored_release(release, &self.name, revision, status);
        // Hex holds 4 bits a character, which gzip gets back: gzip'd and
        // base64'd, it comes to about 0.77 of its length.
        content["manifest"] = Value::String(noise(revision, bytes * 13 / 10));
        let payload = crate::helm_storage::encode_release(&content)?;
        let size = payload.len();
        self.secrets()
            .create(
                &PostParams::default(),
                &storage_secret(release, revision, status, payload),
            )
            .await?;
        Ok(size)
    }
}

/// `len` pseudo-random hex digits from `seed` (xorshift64): a manifest that
/// does not compress away.
fn noise(seed: u64, len: usize) -> String {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut hex = String::with_capacity(len + 16);
    while hex.len() < len {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        hex.push_str(&format!("{state:016x}"));
    }
    hex.truncate(len);
    hex
}

/// The Helm storage Secret of `release` at `revision`, holding `payload`
/// (an encoded release, as `helm_storage::encode_release` makes it).
pub fn storage_secret(release: &str, revision: u64, status: &str, payload: Vec<u8>) -> Secret {
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
    Secret {
        metadata: ObjectMeta {
            name: Some(names::storage_secret_name(release, revision)),
            labels: Some(labels),
            ..Default::default()
        },
        type_: Some(names::HELM_STORAGE_SECRET_TYPE.to_owned()),
        data: Some(BTreeMap::from([(
            "release".to_owned(),
            ByteString(payload),
        )])),
        ..Default::default()
    }
}

/// The release Helm stores for revision `revision` of `release` of the demo
/// chart, installed in `namespace`, in `status`.
pub fn stored_release(release: &str, namespace: &str, revision: u64, status: &str) -> Value {
    json!({
        "name": release, "namespace": namespace, "version": revision,
        "info": {
            "first_deployed": "2026-01-01T00:00:00Z",
            "last_deployed": "2026-01-01T00:00:00Z",
            "status": status, "description": "written by a test",
        },
        "chart": {"metadata": {"name": "demo", "version": "1.0.0", "apiVersion": "v2"}},
        "config": {},
        "manifest": format!("---\napiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {release}-resources\n"),
    })
}

/// `object` is recovered to `revision`: the processed annotation names it,
/// and no suspension or fence is left on it.
pub fn is_recovered(object: &DynamicObject, revision: u64) -> bool {
    let view = ReleaseView::from_object(object);
    view.annotations
        .get(names::PROCESSED_VERSION_ANNOTATION)
        .is_some_and(|v| *v == revision.to_string())
        && !view.suspend
        && !view.has_fence()
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

/// An event as a test checks it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeenEvent {
    pub type_: String,
    pub reason: String,
    pub note: String,
}

impl TestNamespace {
    /// The events recorded on `name` (events.k8s.io/v1).
    pub async fn events_for(&self, name: &str) -> Result<Vec<SeenEvent>> {
        let events: Api<k8s_openapi::api::events::v1::Event> =
            Api::namespaced(self.client.clone(), &self.name);
        Ok(events
            .list(&Default::default())
            .await?
            .items
            .into_iter()
            .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name))
            .map(|e| SeenEvent {
                type_: e.type_.unwrap_or_default(),
                reason: e.reason.unwrap_or_default(),
                note: e.note.unwrap_or_default(),
            })
            .collect())
    }

    /// Refuses, in this namespace only, every request matching `rule` with
    /// `message`, by a ValidatingAdmissionPolicy: a real refusal by the real
    /// apiserver, for tests of failure handling. The apiserver takes a moment
    /// to enforce a new policy: callers probe (a dry-run write) until it does.
    pub async fn refuse(
        &self,
        policy: &str,
        rule: Value,
        expression: &str,
        message: &str,
    ) -> Result<Refusal> {
        let name = format!("{}-{policy}", self.name);
        let policies: Api<DynamicObject> = Api::all_with(
            self.client.clone(),
            &vap_resource("ValidatingAdmissionPolicy", "validatingadmissionpolicies"),
        );
        let bindings: Api<DynamicObject> = Api::all_with(
            self.client.clone(),
            &vap_resource(
                "ValidatingAdmissionPolicyBinding",
                "validatingadmissionpolicybindings",
            ),
        );
        let policy_object: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicy",
            "metadata": {"name": name},
            "spec": {
                "failurePolicy": "Fail",
                "matchConstraints": {
                    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": self.name}},
                    "resourceRules": [rule],
                },
                "validations": [{"expression": expression, "message": message}],
            },
        }))?;
        policies
            .create(&PostParams::default(), &policy_object)
            .await?;
        let binding: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicyBinding",
            "metadata": {"name": name},
            "spec": {"policyName": name, "validationActions": ["Deny"]},
        }))?;
        bindings.create(&PostParams::default(), &binding).await?;
        Ok(Refusal {
            name,
            policies,
            bindings,
        })
    }
}

/// A refusal set up by [`TestNamespace::refuse`]; `lift` ends it.
pub struct Refusal {
    name: String,
    policies: Api<DynamicObject>,
    bindings: Api<DynamicObject>,
}

impl Refusal {
    /// Ends the refusal.
    pub async fn lift(self) -> Result<()> {
        self.bindings
            .delete(&self.name, &Default::default())
            .await?;
        self.policies
            .delete(&self.name, &Default::default())
            .await?;
        Ok(())
    }
}

/// An `admissionregistration.k8s.io/v1` resource: `ValidatingAdmissionPolicy`
/// (`validatingadmissionpolicies`) or its binding.
pub fn vap_resource(kind: &str, plural: &str) -> kube::api::ApiResource {
    kube::api::ApiResource {
        group: "admissionregistration.k8s.io".into(),
        version: "v1".into(),
        api_version: "admissionregistration.k8s.io/v1".into(),
        kind: kind.into(),
        plural: plural.into(),
    }
}

/// Polls `check` every 100 ms until it is true or `timeout` passes.
pub async fn eventually<F, Fut>(
    timeout: std::time::Duration,
    what: &str,
    mut check: F,
) -> Result<()>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<bool>>,
{
    let deadline = std::time::Instant::now() + timeout;
    loop {
        if check().await? {
            return Ok(());
        }
        if std::time::Instant::now() > deadline {
            anyhow::bail!("timed out waiting for: {what}");
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

/// The body of flux-plunger's apply that takes the fence (with its label)
/// and, with `suspend`, the suspension, without preconditions: for a test or
/// the bench that sets up what a stopped flux-plunger leaves.
pub fn fence_body(name: &str, suspend: bool) -> Value {
    let mut body = json!({"apiVersion": names::HELMRELEASE_API_VERSION, "kind": names::HELMRELEASE_KIND,
        "metadata": {"name": name, "finalizers": [names::FENCE_FINALIZER],
            "labels": {names::FENCE_LABEL: names::LEGACY_FENCE_LABEL_VALUE}}});
    if suspend {
        body["spec"] = json!({"suspend": true});
    }
    body
}
