//! The real causes that leave a release stuck, shared by the e2e suite
//! (`stuck_by_real_causes.rs`), the node tier and `make demo`: a chart whose install
//! fails after its first object was created, so helm-controller's install
//! remediation uninstalls it, and an admission policy that refuses that
//! uninstall partway. Nothing here rewrites Helm's storage: helm-controller
//! and Helm write every revision themselves.

use crate::TestNamespace;
use crate::chart::ChartArchive;
use crate::real_helm_controller::{
    create_release, demo_release, publish_chart, selected_version, wait_for,
};
use anyhow::Result;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use serde_json::{Value, json};

/// A data key the apiserver refuses (a key allows only `[-._a-zA-Z0-9]`).
const REFUSED_KEY: &str = "refused key";
/// The finalizer the chart puts on its kept ConfigMap with `holdDelete`
/// (spelled out in [`KEPT_YAML`]).
pub const HOLD_FINALIZER: &str = "e2e.flux-plunger.cozystack.io/hold";

/// The chart's ConfigMap every install of `release` creates first (named as
/// the demo chart names its one).
pub fn kept_configmap(release: &str) -> String {
    format!("{release}-demo")
}

/// The chart's ConfigMap whose data key comes from the value `extraKey`.
pub fn extra_configmap(release: &str) -> String {
    format!("{release}-extra")
}

const CHART_YAML: &str = "apiVersion: v2
name: demo
description: Two ConfigMaps, one with a data key from a value.
type: application
version: 1.0.0
";

const VALUES_YAML: &str = "greeting: hello
extraKey: setting
holdDelete: false
";

const KEPT_YAML: &str = "apiVersion: v1
kind: ConfigMap
metadata:
  name: {{ .Release.Name }}-demo
  namespace: {{ .Release.Namespace }}
  {{- if .Values.holdDelete }}
  finalizers:
    - e2e.flux-plunger.cozystack.io/hold
  {{- end }}
data:
  greeting: {{ .Values.greeting | quote }}
";

const EXTRA_YAML: &str = "apiVersion: v1
kind: ConfigMap
metadata:
  name: {{ .Release.Name }}-extra
  namespace: {{ .Release.Namespace }}
data:
  {{ .Values.extraKey | quote }}: \"on\"
";

/// The chart, `demo` 1.0.0 as the demo chart, packaged by the pinned Helm CLI
/// (`helm package`): the demo chart's ConfigMap (with the finalizer
/// [`HOLD_FINALIZER`] when `holdDelete`), and a second one whose only data
/// key is the value `extraKey`. Both are ConfigMaps, so Helm creates them in
/// one batch: the first is created whatever happens to the second.
pub fn failing_chart() -> Result<ChartArchive> {
    let dir = tempfile::tempdir()?;
    let source = dir.path().join("demo");
    std::fs::create_dir_all(source.join("templates"))?;
    for (path, text) in [
        ("Chart.yaml", CHART_YAML),
        ("values.yaml", VALUES_YAML),
        ("templates/kept.yaml", KEPT_YAML),
        ("templates/extra.yaml", EXTRA_YAML),
    ] {
        std::fs::write(source.join(path), text)?;
    }
    let output = crate::control_plane::helm()?
        .arg("package")
        .arg(&source)
        .arg("--destination")
        .arg(dir.path())
        .output()?;
    anyhow::ensure!(
        output.status.success(),
        "helm package failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(ChartArchive::from_bytes(std::fs::read(
        dir.path().join("demo-1.0.0.tgz"),
    )?))
}

/// Creates HelmRelease `name` in `ns`: the demo release's spec with install
/// remediation (one retry, by uninstalling), the chart's value `extraKey` the
/// apiserver refuses, and `spec` merged in. Its chart is [`failing_chart`],
/// published in `ns` first ([`publish_chart`]: the registry, an OCI
/// HelmRepository, the real source-controller); returns once
/// source-controller has made the release's HelmChart ready.
pub async fn create_failing_release(ns: &TestNamespace, name: &str, spec: Value) -> Result<()> {
    publish_chart(ns, "demo", "1.0.0", failing_chart()?).await?;
    let mut release = demo_release(
        &ns.name,
        name,
        json!({ "greeting": "hello", "extraKey": REFUSED_KEY }),
    );
    crate::merge(
        &mut release["spec"],
        json!({ "install": { "remediation": { "retries": 1 } } }),
    );
    crate::merge(&mut release["spec"], spec);
    create_release(ns, release).await?;
    Ok(())
}

/// As [`create_failing_release`], its chart named as the README's install
/// names one (the node tier's Flux test): `helm push`ed to the registry and
/// named by `chartRef` through an `OCIRepository`, rather than by
/// `spec.chart` through a HelmRepository.
pub async fn create_failing_release_from_registry(
    ns: &TestNamespace,
    name: &str,
    spec: Value,
) -> Result<()> {
    let pushed =
        crate::registry::registry().push_chart(&ns.name, "demo", "1.0.0", &failing_chart()?)?;
    let sources: Api<DynamicObject> = Api::namespaced_with(
        ns.client.clone(),
        &ns.name,
        &crate::source_controller::ocirepository_resource(),
    );
    sources
        .create(
            &PostParams::default(),
            &serde_json::from_value(crate::source_controller::chart_source(
                &ns.name, name, &pushed,
            ))?,
        )
        .await?;
    let mut release = demo_release(
        &ns.name,
        name,
        json!({ "greeting": "hello", "extraKey": REFUSED_KEY }),
    );
    if let Some(spec) = release["spec"].as_object_mut() {
        spec.remove("chart");
    }
    crate::merge(
        &mut release["spec"],
        json!({
            "chartRef": {"kind": "OCIRepository", "name": name},
            "install": { "remediation": { "retries": 1 } },
        }),
    );
    crate::merge(&mut release["spec"], spec);
    let object: DynamicObject = serde_json::from_value(release)?;
    ns.releases()
        .create(&PostParams::default(), &object)
        .await?;
    Ok(())
}

/// The user fixes the value the apiserver refused (and drops the finalizer
/// value): a new generation, which resets helm-controller's failure counts.
/// Returns that generation.
pub async fn fix_the_values(ns: &TestNamespace, name: &str) -> Result<i64> {
    let patched = ns
        .releases()
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(
                json!({"spec": { "values": { "extraKey": "setting", "holdDelete": false } }}),
            ),
        )
        .await?;
    patched
        .metadata
        .generation
        .ok_or_else(|| anyhow::anyhow!("HelmRelease {name} has no generation"))
}

/// Refuses the DELETE of `release`'s kept ConfigMap in `ns` (and of a probe
/// ConfigMap, whose refused dry-run delete shows the apiserver enforces the
/// policy) until the returned refusal is lifted.
pub async fn refuse_deleting_the_kept_configmap(
    ns: &TestNamespace,
    release: &str,
) -> Result<crate::Refusal> {
    const PROBE: &str = "delete-refusal-probe";
    let refusal = ns
        .refuse(
            "keep-configmap",
            json!({"apiGroups": [""], "apiVersions": ["v1"], "operations": ["DELETE"], "resources": ["configmaps"]}),
            &format!(
                "!(oldObject.metadata.name in ['{}', '{PROBE}'])",
                kept_configmap(release)
            ),
            "test: the chart's ConfigMap is not to be deleted",
        )
        .await?;
    let configmaps: Api<ConfigMap> = Api::namespaced(ns.client.clone(), &ns.name);
    let probe: ConfigMap = serde_json::from_value(json!({"metadata": {"name": PROBE}}))?;
    configmaps.create(&PostParams::default(), &probe).await?;
    let dry_run = DeleteParams {
        dry_run: true,
        ..DeleteParams::default()
    };
    wait_for("the delete refusal in force", || async {
        Ok(configmaps
            .delete(PROBE, &dry_run)
            .await
            .is_err()
            .then_some(()))
    })
    .await?;
    Ok(refusal)
}

/// True when the selected helm-controller is v1.4 (Helm 3); v1.5 and later
/// run Helm 4, which words some errors differently.
fn helm_3() -> bool {
    selected_version().is_ok_and(|v| v.starts_with("v1.4."))
}

/// Helm's install refusing a name whose newest revision is `uninstalled`
/// (`Install.availableName`): Helm 3 says "cannot re-use", Helm 4 "cannot
/// reuse", and wraps it.
pub fn name_in_use() -> &'static str {
    if helm_3() {
        "cannot re-use a name that is still in use"
    } else {
        "release name check failed: cannot reuse a name that is still in use"
    }
}
