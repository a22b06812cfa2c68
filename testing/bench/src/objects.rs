//! HelmReleases that look like the ones a Flux cluster holds: written the way
//! kustomize-controller and helm-controller write them (a server-side apply
//! of the spec, helm-controller's finalizer and its status through the status
//! subresource), so each carries labels, annotations, several managedFields
//! entries, conditions and a release history.

use anyhow::Result;
use futures::{StreamExt, stream};
use kube::api::{Patch, PatchParams};
use plunger::names::{FIELD_MANAGER, HELMRELEASE_API_VERSION, HELMRELEASE_KIND};
use serde_json::{Value, json};
use testkit::TestNamespace;

/// How many writes run at once while the bench sets objects up.
pub const SETUP_CONCURRENCY: usize = 32;

/// Release names: fixed width, so that one is never the prefix of another.
pub fn release_name(i: usize) -> String {
    format!("r{i:05}")
}

fn digest(seed: &str) -> String {
    // Not a real digest, only its shape: 64 hex digits that differ by release.
    let mut hex = String::with_capacity(64);
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    while hex.len() < 64 {
        for b in seed.bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
        }
        hex.push_str(&format!("{h:016x}"));
    }
    format!("sha256:{hex}")
}

/// What kustomize-controller applies (server-side, its own field manager).
pub fn applied(namespace: &str, name: &str, i: usize) -> Value {
    json!({
        "apiVersion": HELMRELEASE_API_VERSION,
        "kind": HELMRELEASE_KIND,
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {
                "app.kubernetes.io/name": name,
                "app.kubernetes.io/instance": name,
                "app.kubernetes.io/part-of": "platform",
                "app.kubernetes.io/managed-by": "flux",
                "kustomize.toolkit.fluxcd.io/name": "apps",
                "kustomize.toolkit.fluxcd.io/namespace": "flux-system",
                "tenant": format!("tenant-{}", i % 17),
            },
            "annotations": {
                "kustomize.toolkit.fluxcd.io/ssa": "Merge",
                "meta.example.com/owner-team": format!("team-{}", i % 11),
                "meta.example.com/description": "A service of the platform, installed from the platform Helm repository by Flux.",
            },
        },
        "spec": {
            "interval": "10m",
            "timeout": "5m",
            "releaseName": name,
            "chart": {"spec": {
                "chart": "podinfo",
                "version": ">=6.0.0 <7.0.0",
                "interval": "1h",
                "reconcileStrategy": "ChartVersion",
                "sourceRef": {"kind": "HelmRepository", "name": "platform", "namespace": "flux-system"},
            }},
            "install": {"createNamespace": false, "remediation": {"retries": 3}},
            "upgrade": {"cleanupOnFail": true, "remediation": {"retries": 3, "remediateLastFailure": true}},
            "driftDetection": {"mode": "enabled"},
            "values": {
                "replicaCount": 2,
                "image": {"repository": "ghcr.io/stefanprodan/podinfo", "tag": "6.7.1", "pullPolicy": "IfNotPresent"},
                "resources": {"limits": {"cpu": "500m", "memory": "256Mi"}, "requests": {"cpu": "50m", "memory": "64Mi"}},
                "ingress": {"enabled": true, "className": "nginx", "hosts": [{"host": format!("{name}.apps.example.com"), "paths": [{"path": "/", "pathType": "Prefix"}]}]},
                "podAnnotations": {"prometheus.io/scrape": "true", "prometheus.io/port": "9898"},
                "env": [{"name": "LOG_LEVEL", "value": "info"}, {"name": "TENANT", "value": format!("tenant-{}", i % 17)}],
                "nodeSelector": {"kubernetes.io/os": "linux"},
            },
        },
    })
}

fn snapshot(namespace: &str, name: &str, version: u64, status: &str) -> Value {
    json!({
        "apiVersion": "helm.toolkit.fluxcd.io/v2",
        "name": name,
        "namespace": namespace,
        "version": version,
        "status": status,
        "chartName": "podinfo",
        "chartVersion": format!("6.7.{version}"),
        "appVersion": format!("6.7.{version}"),
        "configDigest": digest(&format!("{namespace}/{name}/config/{version}")),
        "digest": digest(&format!("{namespace}/{name}/{version}")),
        "firstDeployed": "2026-01-01T00:00:00Z",
        "lastDeployed": format!("2026-01-0{version}T00:00:00Z"),
        "action": if version == 1 { "install" } else { "upgrade" },
    })
}

fn condition(type_: &str, status: &str, reason: &str, message: &str) -> Value {
    json!({"type": type_, "status": status, "reason": reason, "message": message,
        "observedGeneration": 1, "lastTransitionTime": "2026-01-03T00:00:00Z"})
}

/// helm-controller's status for a release that upgraded to revision 3.
pub fn healthy_status(namespace: &str, name: &str) -> Value {
    let message = format!(
        "Helm upgrade succeeded for release {namespace}/{name}.v3 with chart podinfo@6.7.3"
    );
    json!({"status": {
        "observedGeneration": 1,
        "lastAttemptedGeneration": 1,
        "lastAttemptedRevision": "6.7.3",
        "lastAttemptedConfigDigest": digest(&format!("{namespace}/{name}/config/3")),
        "lastAttemptedReleaseAction": "upgrade",
        "lastHandledReconcileAt": "2026-01-03T00:00:00Z",
        "helmChart": format!("flux-system/{namespace}-{name}"),
        "storageNamespace": namespace,
        "conditions": [
            condition("Ready", "True", "UpgradeSucceeded", &message),
            condition("Released", "True", "UpgradeSucceeded", &message),
        ],
        "history": [
            snapshot(namespace, name, 3, "deployed"),
            snapshot(namespace, name, 2, "superseded"),
            snapshot(namespace, name, 1, "superseded"),
        ],
    }})
}

/// The status helm-controller writes when Helm refuses the upgrade with
/// "has no deployed releases" (history and the rest kept).
pub fn stuck_status(namespace: &str, name: &str) -> Value {
    let message = format!(
        "Helm upgrade failed for release {namespace}/{name} with chart podinfo@6.7.4: \"{name}\" has no deployed releases"
    );
    let mut status = healthy_status(namespace, name);
    status["status"]["conditions"] = json!([
        condition("Ready", "False", "UpgradeFailed", &message),
        condition("Released", "False", "UpgradeFailed", &message),
    ]);
    status["status"]["lastAttemptedRevision"] = json!("6.7.4");
    status
}

/// Creates realistic releases `range` (by number) in `ns`: three writes
/// each, by three managers, `SETUP_CONCURRENCY` at a time.
pub async fn create_releases(ns: &TestNamespace, range: std::ops::Range<usize>) -> Result<()> {
    create_labelled_releases(ns, range, None).await
}

/// [`create_releases`], each also carrying `label` (`key`, `value`).
pub async fn create_labelled_releases(
    ns: &TestNamespace,
    range: std::ops::Range<usize>,
    label: Option<(&str, &str)>,
) -> Result<()> {
    create(ns, range, label, None).await
}

/// [`create_releases`], each with `values` (an object) added to its
/// `spec.values`, as kustomize-controller applies them.
pub async fn create_releases_with_values(
    ns: &TestNamespace,
    range: std::ops::Range<usize>,
    values: &Value,
) -> Result<()> {
    create(ns, range, None, Some(values)).await
}

async fn create(
    ns: &TestNamespace,
    range: std::ops::Range<usize>,
    label: Option<(&str, &str)>,
    values: Option<&Value>,
) -> Result<()> {
    each(range, |i| async move {
        let name = release_name(i);
        let api = ns.releases();
        let mut body = applied(&ns.name, &name, i);
        if let Some((key, value)) = label {
            body["metadata"]["labels"][key] = json!(value);
        }
        if let Some(Value::Object(values)) = values {
            for (key, value) in values {
                body["spec"]["values"][key] = value.clone();
            }
        }
        api.patch(
            &name,
            &PatchParams::apply("kustomize-controller").force(),
            &Patch::Apply(body),
        )
        .await?;
        let helm_controller = PatchParams {
            field_manager: Some("helm-controller".to_owned()),
            ..PatchParams::default()
        };
        api.patch(
            &name,
            &helm_controller,
            &Patch::Merge(json!({"metadata": {"finalizers": ["finalizers.fluxcd.io"]}})),
        )
        .await?;
        api.patch_status(
            &name,
            &helm_controller,
            &Patch::Merge(healthy_status(&ns.name, &name)),
        )
        .await?;
        anyhow::Ok(())
    })
    .await
}

/// Sets flux-plunger's suspension and fence on releases `range` of `ns`, as
/// a flux-plunger stopped in the middle of their recoveries leaves them.
pub async fn fence_releases(ns: &TestNamespace, range: std::ops::Range<usize>) -> Result<()> {
    each(range, |i| async move {
        let name = release_name(i);
        ns.releases()
            .patch(
                &name,
                &PatchParams::apply(FIELD_MANAGER),
                &Patch::Apply(testkit::fixtures::fence_body(&name, true)),
            )
            .await?;
        anyhow::Ok(())
    })
    .await
}

/// Gives each release of `range` what flux-plunger reclaims once it is
/// stuck: storage revision 1 `superseded` below revision 2 `uninstalling`.
pub async fn create_reclaimable_storage(
    ns: &TestNamespace,
    range: std::ops::Range<usize>,
) -> Result<()> {
    each(range, |i| async move {
        let name = release_name(i);
        ns.create_storage_secret(&name, 1, "superseded").await?;
        ns.create_storage_secret(&name, 2, "uninstalling").await?;
        anyhow::Ok(())
    })
    .await
}

/// Writes the stuck status of releases `range`, `SETUP_CONCURRENCY` at a
/// time: many releases stuck at once.
pub async fn mark_all_stuck(ns: &TestNamespace, range: std::ops::Range<usize>) -> Result<()> {
    each(
        range,
        |i| async move { mark_stuck(ns, &release_name(i)).await },
    )
    .await
}

/// Gives up flux-plunger's fence on releases `range` (an apply of nothing as
/// its field manager), as its drain would: a part that leaves releases fenced
/// would change what the drains of the parts after it find.
pub async fn unfence_releases(ns: &TestNamespace, range: std::ops::Range<usize>) -> Result<()> {
    each(range, |i| async move {
        let name = release_name(i);
        let nothing = json!({
            "apiVersion": HELMRELEASE_API_VERSION,
            "kind": HELMRELEASE_KIND,
            "metadata": {"name": name, "namespace": ns.name},
        });
        ns.releases()
            .patch(
                &name,
                &PatchParams::apply(FIELD_MANAGER),
                &Patch::Apply(nothing),
            )
            .await?;
        anyhow::Ok(())
    })
    .await
}

/// Runs `write` for each release number of `range`, `SETUP_CONCURRENCY` at
/// a time.
async fn each<F, Fut>(range: std::ops::Range<usize>, write: F) -> Result<()>
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = Result<()>>,
{
    stream::iter(range)
        .map(write)
        .buffer_unordered(SETUP_CONCURRENCY)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect()
}

/// Writes the stuck status of `name` as helm-controller would.
pub async fn mark_stuck(ns: &TestNamespace, name: &str) -> Result<()> {
    let helm_controller = PatchParams {
        field_manager: Some("helm-controller".to_owned()),
        ..PatchParams::default()
    };
    ns.releases()
        .patch_status(
            name,
            &helm_controller,
            &Patch::Merge(stuck_status(&ns.name, name)),
        )
        .await?;
    Ok(())
}
