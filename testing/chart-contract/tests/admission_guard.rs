//! The chart's admission guard against the real apiserver: what it refuses
//! flux-plunger's ServiceAccounts, and that it refuses none of the writes
//! flux-plunger makes.
//!
//! The first test installs the chart with helm and writes with the token of
//! the chart's own ServiceAccount, under the chart's own RBAC. The second
//! goes through every rule the guard states, each way, with the chart's
//! guard rendered for ServiceAccounts granted `cluster-admin`, so that RBAC
//! never refuses first; its writes are dry runs (admitted, never stored), so
//! every case starts from the same objects.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Result, ensure};
use chart_contract::install::Setup;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use k8s_openapi::api::rbac::v1::ClusterRoleBinding;
use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use plunger::apply::{self, Claim};
use plunger::names::{
    FENCE_FINALIZER, FIELD_MANAGER, HELM_CONTROLLER_FINALIZER, HELMRELEASE_API_VERSION,
    HELMRELEASE_KIND, OWN_ANNOTATIONS, PATCH_FIELD_MANAGER, STUCK_MESSAGES,
};
use plunger::release::api::helmreleases;
use plunger::release::view::ReleaseView;
use serde_json::{Value, json};
use testkit::guard::{Guarded, is_refused_by};
use testkit::{Handled, SimulatedHelmController, TestNamespace, control_plane};

/// What the guard answered each write, against what it should have.
struct Verdicts {
    policy: String,
    wrong: Vec<String>,
}

impl Verdicts {
    fn new(policy: &str) -> Self {
        Self {
            policy: policy.to_owned(),
            wrong: Vec::new(),
        }
    }

    fn allowed<T>(&mut self, what: &str, result: kube::Result<T>) {
        if let Err(err) = result {
            self.wrong
                .push(format!("{what}: should be allowed, got {err}"));
        }
    }

    /// Refused by the guard, with a message containing `because`.
    fn refused<T>(&mut self, what: &str, result: kube::Result<T>, because: &str) {
        match result {
            Err(kube::Error::Api(status))
                if is_refused_by(&status, &self.policy) && status.message.contains(because) => {}
            Ok(_) => self
                .wrong
                .push(format!("{what}: should be refused, was allowed")),
            Err(err) => self.wrong.push(format!(
                "{what}: should be refused by {} (\"{because}\"), got {err}",
                self.policy
            )),
        }
    }

    fn check(self) -> Result<()> {
        ensure!(
            self.wrong.is_empty(),
            "the admission guard answered wrongly:\n  {}",
            self.wrong.join("\n  ")
        );
        Ok(())
    }
}

const SECRETS_ONLY: &str = "deletes only Helm storage revisions";
const METADATA_ONLY: &str = "changes no metadata of a HelmRelease but its finalizer";
const SPEC_ONLY: &str = "nothing in a HelmRelease's spec but spec.suspend";
const STATUS_ONLY: &str = "writes a HelmRelease's status only through the status subresource";
const WRITES_ONLY: &str = "only deletes Helm storage Secrets, patches HelmReleases";
const EVENTS_ONLY: &str = "writes only Events about a HelmRelease";
const LEASE_ONLY: &str = "writes no Lease but its leader Lease";
const SCALE_ONLY: &str = "scales no Deployment but its own";
const OWN_MANAGERS: &str = "writes HelmReleases only as its field managers";
const MANAGED_FIELDS: &str = "changes no managedFields but as the apiserver moves them";
const SUSPEND_AS_ACQUIRED: &str = "suspends a HelmRelease only by its own apply, with its fence";
const LIFT_OURS: &str = "lifts only a suspension an Apply entry of its own manager";
const FENCE_ON_STUCK: &str = "puts its fence only on a HelmRelease that is live and stuck";

/// A release as helm-controller keeps it: its finalizer, some values.
async fn release_with_values(apps: &TestNamespace, name: &str) -> Result<()> {
    apps.create_release(name, json!({"values": {"replicas": 1}}))
        .await?;
    let hc = SimulatedHelmController::new(apps.client.clone(), &apps.name);
    ensure!(hc.handle(name).await? == Handled::AddedFinalizer);
    Ok(())
}

/// The JSON patch that removes `finalizer` at `index`, guarded by a test.
fn remove_finalizer_at(index: usize, finalizer: &str) -> Value {
    let path = format!("/metadata/finalizers/{index}");
    json!([{"op": "test", "path": path, "value": finalizer}, {"op": "remove", "path": path}])
}

/// A Secret named and labelled like Helm storage, of `type_`.
fn storage_like(name: &str, type_: &str, labels: &[(&str, &str)]) -> Result<Secret> {
    let labels: BTreeMap<&str, &str> = labels.iter().copied().collect();
    Ok(serde_json::from_value(json!({
        "metadata": {"name": name, "labels": labels},
        "type": type_,
    }))?)
}

#[tokio::test]
async fn with_its_own_token_the_chart_s_service_account_is_refused_what_flux_plunger_never_does()
-> Result<()> {
    let setup = Setup::new("guard-chart").await?;
    setup.install(&[])?;
    setup.wait_for_guard().await?;
    let admin = setup.ns.client.clone();
    let apps = TestNamespace::create(&admin, "guard-chart-apps").await?;
    release_with_values(&apps, "web").await?;
    apps.secrets()
        .create(
            &PostParams::default(),
            &serde_json::from_value(
                json!({"metadata": {"name": "credentials"}, "stringData": {"password": "hunter2"}}),
            )?,
        )
        .await?;
    apps.create_storage_secret("web", 1, "uninstalling").await?;
    apps.mark_stuck("web").await?;
    let own = control_plane()
        .service_account_client(&admin, &setup.ns.name, &setup.fullname())
        .await?;
    let releases = helmreleases(own.clone(), &apps.name);
    let secrets: Api<Secret> = Api::namespaced(own.clone(), &apps.name);
    let mut verdicts = Verdicts::new(&setup.fullname());

    verdicts.refused(
        "delete an ordinary Secret",
        secrets
            .delete("credentials", &DeleteParams::default())
            .await,
        SECRETS_ONLY,
    );
    verdicts.refused(
        "patch spec.values",
        releases
            .patch(
                "web",
                &as_patch_manager(),
                &Patch::Merge(json!({"spec": {"values": {"replicas": 2}}})),
            )
            .await,
        SPEC_ONLY,
    );
    verdicts.refused(
        "remove helm-controller's finalizer",
        releases
            .patch(
                "web",
                &as_patch_manager(),
                &Patch::<()>::Json(serde_json::from_value(remove_finalizer_at(
                    0,
                    HELM_CONTROLLER_FINALIZER,
                ))?),
            )
            .await,
        METADATA_ONLY,
    );

    // A recovery's writes, by flux-plunger's own write functions: the
    // suspension and the fence, the annotation, the storage revision's
    // delete, the lift.
    let read = |releases: Api<DynamicObject>| async move {
        anyhow::Ok(ReleaseView::from_object(&releases.get("web").await?))
    };
    verdicts.allowed(
        "apply the suspension and the fence",
        apply::apply(
            &own,
            &read(releases.clone()).await?,
            Claim::SUSPEND_AND_FENCE,
            false,
            &plunger::install::Install::legacy(),
        )
        .await,
    );
    verdicts.allowed(
        "write the processed-revision annotation",
        apply::annotate(&own, &read(releases.clone()).await?, 1, None).await,
    );
    verdicts.allowed(
        "delete the storage revision",
        secrets
            .delete("sh.helm.release.v1.web.v1", &DeleteParams::default())
            .await,
    );
    verdicts.allowed(
        "lift the suspension and the fence",
        apply::apply(
            &own,
            &read(releases.clone()).await?,
            Claim::NOTHING,
            false,
            &plunger::install::Install::legacy(),
        )
        .await,
    );
    verdicts.check()?;

    // What was refused did not happen; what was allowed did.
    assert!(apps.secrets().get_opt("credentials").await?.is_some());
    let web = apps.releases().get("web").await?;
    assert_eq!(web.data["spec"]["values"], json!({"replicas": 1}));
    assert_eq!(
        web.metadata.finalizers,
        Some(vec![HELM_CONTROLLER_FINALIZER.to_owned()])
    );
    assert!(testkit::is_recovered(&web, 1), "{web:?}");
    assert_eq!(apps.secret_names().await?, vec!["credentials"]);
    Ok(())
}

/// Refused by RBAC (403, and not by an admission policy).
fn refused_by_rbac<T>(result: &kube::Result<T>) -> bool {
    matches!(result, Err(kube::Error::Api(status))
        if status.code == 403 && !status.message.contains("ValidatingAdmissionPolicy"))
}

const RELEASES_IN_SCOPE: &str = "patches HelmReleases only in the namespaces it watches";
const STORAGE_IN_SCOPE: &str = "deletes Helm storage only in the namespaces it watches";
const EVENTS_IN_SCOPE: &str = "writes Events only in the namespaces it watches";

/// A multi-tenant cluster: the chart installed for tenant A
/// (`controller.watchNamespaces`) binds its token nothing in tenant B's
/// namespace, and its guard refuses it there even once RBAC allows it
/// everything (another binding, a stolen token with more power); in A, a
/// recovery's writes still go through.
#[tokio::test]
async fn scoped_to_one_namespace_the_chart_s_token_is_refused_another_s_releases_and_storage()
-> Result<()> {
    let setup = Setup::new("guard-scoped").await?;
    let admin = setup.ns.client.clone();
    let tenant_a = TestNamespace::create(&admin, "guard-scoped-a").await?;
    let tenant_b = TestNamespace::create(&admin, "guard-scoped-b").await?;
    setup.install(&[
        "--set",
        &format!("controller.watchNamespaces={{{}}}", tenant_a.name),
    ])?;
    let own = control_plane()
        .service_account_client(&admin, &setup.ns.name, &setup.fullname())
        .await?;
    // Probed in A: in the release namespace, not watched, RBAC refuses first.
    testkit::guard::wait_enforced(&admin, &own, &tenant_a.name, &setup.fullname()).await?;
    for tenant in [&tenant_a, &tenant_b] {
        release_with_values(tenant, "web").await?;
        tenant
            .create_storage_secret("web", 1, "uninstalling")
            .await?;
        tenant.mark_stuck("web").await?;
    }
    let storage = "sh.helm.release.v1.web.v1";
    let view_of = |tenant: &TestNamespace| {
        let releases = tenant.releases();
        async move { anyhow::Ok(ReleaseView::from_object(&releases.get("web").await?)) }
    };
    let b_secrets: Api<Secret> = Api::namespaced(own.clone(), &tenant_b.name);
    let b_releases = helmreleases(own.clone(), &tenant_b.name);
    let suspend = Patch::Merge(json!({"spec": {"suspend": true}}));

    // With the chart's RBAC alone: nothing at all in B.
    let mut wrong = Vec::new();
    let mut expect_rbac = |what: &str, refused: bool| {
        if !refused {
            wrong.push(format!("{what} in tenant B: should be refused by RBAC"));
        }
    };
    expect_rbac(
        "delete the storage revision",
        refused_by_rbac(&b_secrets.delete(storage, &DeleteParams::default()).await),
    );
    expect_rbac(
        "apply the suspension and the fence",
        refused_by_rbac(
            &apply::apply(
                &own,
                &view_of(&tenant_b).await?,
                Claim::SUSPEND_AND_FENCE,
                false,
                &plunger::install::Install::legacy(),
            )
            .await,
        ),
    );
    expect_rbac(
        "patch spec.suspend",
        refused_by_rbac(
            &b_releases
                .patch("web", &PatchParams::default(), &suspend)
                .await,
        ),
    );
    expect_rbac(
        "list Secrets",
        refused_by_rbac(&b_secrets.list_metadata(&Default::default()).await),
    );
    expect_rbac(
        "list HelmReleases",
        refused_by_rbac(&b_releases.list(&Default::default()).await),
    );
    ensure!(wrong.is_empty(), "{}", wrong.join("\n"));

    // In A, a recovery's writes, by flux-plunger's own write functions.
    let mut verdicts = Verdicts::new(&setup.fullname());
    let a_secrets: Api<Secret> = Api::namespaced(own.clone(), &tenant_a.name);
    verdicts.allowed(
        "apply the suspension and the fence in tenant A",
        apply::apply(
            &own,
            &view_of(&tenant_a).await?,
            Claim::SUSPEND_AND_FENCE,
            false,
            &plunger::install::Install::legacy(),
        )
        .await,
    );
    verdicts.allowed(
        "delete the storage revision in tenant A",
        a_secrets.delete(storage, &DeleteParams::default()).await,
    );
    verdicts.allowed(
        "lift the suspension and the fence in tenant A",
        apply::apply(
            &own,
            &view_of(&tenant_a).await?,
            Claim::NOTHING,
            false,
            &plunger::install::Install::legacy(),
        )
        .await,
    );
    verdicts.check()?;

    // RBAC that grants the same token everything: the guard still refuses
    // it B, and still lets it act in A.
    let binding = control_plane()
        .grant_cluster_admin(&admin, &setup.ns.name, &[&setup.fullname()])
        .await?;
    let granted = testkit::eventually(
        Duration::from_secs(30),
        "cluster-admin reaches the chart's ServiceAccount",
        || async { Ok(b_secrets.list_metadata(&Default::default()).await.is_ok()) },
    )
    .await;
    let mut verdicts = Verdicts::new(&setup.fullname());
    verdicts.refused(
        "delete the storage revision in tenant B",
        b_secrets.delete(storage, &dry_delete()).await,
        STORAGE_IN_SCOPE,
    );
    verdicts.refused(
        "apply the suspension and the fence in tenant B",
        dry_acquire(&b_releases, &view_of(&tenant_b).await?).await,
        RELEASES_IN_SCOPE,
    );
    // A hand-over the content rules admit (one entry, the release's own, on
    // a release being deleted): only the scope refuses it.
    tenant_b.create_release("handed", json!({})).await?;
    let hold = Patch::Merge(json!({"metadata": {"finalizers": ["example.com/hold"]}}));
    tenant_b
        .releases()
        .patch("handed", &PatchParams::default(), &hold)
        .await?;
    tenant_b
        .releases()
        .delete("handed", &DeleteParams::default())
        .await?;
    let mut handed = snapshot();
    handed["name"] = json!("handed");
    handed["namespace"] = json!(tenant_b.name);
    verdicts.refused(
        "hand over a history in tenant B",
        b_releases
            .patch_status(
                "handed",
                &dry_patch(),
                &Patch::Merge(json!({"status": {"history": [handed]}})),
            )
            .await,
        RELEASES_IN_SCOPE,
    );
    let_go_of(&tenant_b, "handed").await?;
    let event: k8s_openapi::api::events::v1::Event = serde_json::from_value(json!({
        "metadata": {"name": "probe.web"},
        "eventTime": "2026-01-01T00:00:00.000000Z",
        "reportingController": "flux-plunger", "reportingInstance": "pod-a",
        "action": "Recovering", "reason": "Recovered", "type": "Normal",
        "regarding": {"apiVersion": HELMRELEASE_API_VERSION, "kind": HELMRELEASE_KIND,
            "name": "web", "namespace": tenant_b.name},
    }))?;
    verdicts.refused(
        "an Event about a HelmRelease in tenant B",
        Api::<k8s_openapi::api::events::v1::Event>::namespaced(own.clone(), &tenant_b.name)
            .create(&dry_post(), &event)
            .await,
        EVENTS_IN_SCOPE,
    );
    verdicts.allowed(
        "apply the suspension and the fence in tenant A again",
        dry_acquire(
            &helmreleases(own.clone(), &tenant_a.name),
            &view_of(&tenant_a).await?,
        )
        .await,
    );
    Api::<ClusterRoleBinding>::all(admin.clone())
        .delete(&binding, &DeleteParams::default())
        .await?;
    granted?;
    verdicts.check()?;

    // Nothing changed in B; A was recovered.
    assert_eq!(tenant_b.secret_names().await?, vec![storage]);
    let b = view_of(&tenant_b).await?;
    assert!(!b.suspend && !b.has_fence(), "{b:?}");
    assert!(tenant_a.secrets().get_opt(storage).await?.is_none());
    Ok(())
}

#[tokio::test]
async fn the_guard_allows_flux_plunger_s_own_writes_and_refuses_every_other() -> Result<()> {
    let admin = control_plane().client().await?;
    let ns = TestNamespace::create(&admin, "guard-rules").await?;
    let guarded = ns.guarded().await?;
    let apps = TestNamespace::create(&admin, "guard-rules-apps").await?;
    let mut verdicts = Verdicts::new(&guarded.policy);
    let controller = guarded.controller_client().await?;
    let hook = guarded.hook_client().await?;

    storage_secrets(&apps, &controller, &mut verdicts).await?;
    release_writes(&apps, &controller, &mut verdicts).await?;
    acquires_by_message(&apps, &controller, &mut verdicts).await?;
    events(&apps, &controller, &mut verdicts).await?;
    leases_and_scale(&ns, &guarded, &apps, &controller, &hook, &mut verdicts).await?;
    verdicts.refused(
        "create a ConfigMap",
        Api::<ConfigMap>::namespaced(controller.clone(), &apps.name)
            .create(
                &dry_post(),
                &serde_json::from_value(json!({"metadata": {"name": "x"}}))?,
            )
            .await,
        WRITES_ONLY,
    );

    // Only flux-plunger's identities are held: another ServiceAccount of the
    // same namespace, as privileged, is not.
    let other = control_plane()
        .service_account_client(&admin, &ns.name, "someone-else")
        .await?;
    control_plane()
        .grant_cluster_admin(&admin, &ns.name, &["someone-else"])
        .await?;
    verdicts.allowed(
        "another ServiceAccount deletes an ordinary Secret",
        Api::<Secret>::namespaced(other, &apps.name)
            .delete("credentials", &dry_delete())
            .await,
    );
    verdicts.check()
}

/// The acquire is admitted on a release stuck in any words flux-plunger
/// recognizes (SPEC §4.6: what Helm storage stops, in every spelling
/// helm-controller writes), and refused on one `Ready=False` for anything
/// else.
async fn acquires_by_message(
    apps: &TestNamespace,
    controller: &Client,
    verdicts: &mut Verdicts,
) -> Result<()> {
    let releases = helmreleases(controller.clone(), &apps.name);
    for (index, words) in STUCK_MESSAGES.iter().enumerate() {
        let name = format!("stuck-{index}");
        release_with_values(apps, &name).await?;
        apps.mark_stuck_saying(&name, words).await?;
        let read = ReleaseView::from_object(&apps.releases().get(&name).await?);
        verdicts.allowed(
            &format!("acquire a release stuck with {words:?}"),
            dry_acquire(&releases, &read).await,
        );
    }
    release_with_values(apps, "timed-out").await?;
    apps.mark_stuck_saying("timed-out", "timed out waiting for the condition")
        .await?;
    let read = ReleaseView::from_object(&apps.releases().get("timed-out").await?);
    verdicts.refused(
        "acquire a release Ready=False for a timeout",
        dry_acquire(&releases, &read).await,
        SUSPEND_AS_ACQUIRED,
    );
    Ok(())
}

fn dry_post() -> PostParams {
    PostParams {
        dry_run: true,
        ..PostParams::default()
    }
}

/// flux-plunger's acquire (its apply of the suspension and the fence, SPEC
/// §4.8) of `release` as read, as a dry run.
async fn dry_acquire(
    releases: &Api<DynamicObject>,
    release: &ReleaseView,
) -> kube::Result<DynamicObject> {
    dry_apply(releases, release, Claim::SUSPEND_AND_FENCE, false).await
}

/// A dry-run JSON patch of `ops` to release `name`, under flux-plunger's
/// guarded-patch field manager.
async fn dry_json_patch(
    releases: &Api<DynamicObject>,
    name: &str,
    ops: Value,
) -> Result<kube::Result<DynamicObject>> {
    let patch = Patch::<()>::Json(serde_json::from_value(ops)?);
    Ok(releases.patch(name, &dry_patch(), &patch).await)
}

/// flux-plunger's apply of `claim` to `release` as read, as a dry run.
async fn dry_apply(
    releases: &Api<DynamicObject>,
    release: &ReleaseView,
    claim: Claim,
    force: bool,
) -> kube::Result<DynamicObject> {
    let mut params = PatchParams::apply(FIELD_MANAGER);
    params.dry_run = true;
    params.force = force;
    releases
        .patch(
            &release.name,
            &params,
            &Patch::Apply(apply::apply_body(
                release,
                claim,
                &plunger::install::Install::legacy(),
            )),
        )
        .await
}

/// A dry-run patch as flux-plunger's guarded patch sends it, under its
/// field manager.
fn dry_patch() -> PatchParams {
    PatchParams {
        dry_run: true,
        ..as_patch_manager()
    }
}

/// A patch under flux-plunger's guarded-patch field manager.
fn as_patch_manager() -> PatchParams {
    PatchParams {
        field_manager: Some(PATCH_FIELD_MANAGER.to_owned()),
        ..PatchParams::default()
    }
}

/// A dry-run patch under flux-plunger's own field manager (its status and
/// reconcile-request patches).
fn dry_patch_as_flux_plunger() -> PatchParams {
    PatchParams {
        dry_run: true,
        field_manager: Some(FIELD_MANAGER.to_owned()),
        ..PatchParams::default()
    }
}

fn dry_delete() -> DeleteParams {
    DeleteParams {
        dry_run: true,
        ..DeleteParams::default()
    }
}

/// Only a Helm storage revision whose type, labels and name agree may be
/// deleted, and no Secret written.
async fn storage_secrets(
    apps: &TestNamespace,
    controller: &Client,
    verdicts: &mut Verdicts,
) -> Result<()> {
    apps.create_storage_secret("web", 1, "uninstalling").await?;
    let helm = [
        ("owner", "helm"),
        ("name", "web"),
        ("status", "uninstalled"),
    ];
    let look_alikes = [
        (
            "of another type",
            storage_like(
                "sh.helm.release.v1.web.v2",
                "Opaque",
                &[helm[0], helm[1], ("version", "2")],
            )?,
        ),
        (
            "without owner=helm",
            storage_like(
                "sh.helm.release.v1.web.v3",
                "helm.sh/release.v1",
                &[helm[1], ("version", "3")],
            )?,
        ),
        (
            "named for another version than its label",
            storage_like(
                "sh.helm.release.v1.web.v4",
                "helm.sh/release.v1",
                &[helm[0], helm[1], ("version", "5")],
            )?,
        ),
        (
            "named for another release than its label",
            storage_like(
                "sh.helm.release.v1.api.v6",
                "helm.sh/release.v1",
                &[helm[0], helm[1], ("version", "6")],
            )?,
        ),
        (
            "with a version that is no revision number",
            storage_like(
                "sh.helm.release.v1.web.v07",
                "helm.sh/release.v1",
                &[helm[0], helm[1], ("version", "07")],
            )?,
        ),
        (
            "of a deployed revision",
            storage_like(
                "sh.helm.release.v1.web.v10",
                "helm.sh/release.v1",
                &[helm[0], helm[1], ("version", "10"), ("status", "deployed")],
            )?,
        ),
        (
            "of a superseded revision",
            storage_like(
                "sh.helm.release.v1.web.v11",
                "helm.sh/release.v1",
                &[
                    helm[0],
                    helm[1],
                    ("version", "11"),
                    ("status", "superseded"),
                ],
            )?,
        ),
        (
            "of a failed revision (helm-controller upgrades it)",
            storage_like(
                "sh.helm.release.v1.web.v13",
                "helm.sh/release.v1",
                &[helm[0], helm[1], ("version", "13"), ("status", "failed")],
            )?,
        ),
        (
            "of a pending-upgrade revision (an upgrade in flight)",
            storage_like(
                "sh.helm.release.v1.web.v14",
                "helm.sh/release.v1",
                &[
                    helm[0],
                    helm[1],
                    ("version", "14"),
                    ("status", "pending-upgrade"),
                ],
            )?,
        ),
        (
            "without a status",
            storage_like(
                "sh.helm.release.v1.web.v12",
                "helm.sh/release.v1",
                &[helm[0], helm[1], ("version", "12")],
            )?,
        ),
        (
            "that is an ordinary Secret",
            serde_json::from_value(json!({"metadata": {"name": "credentials"}}))?,
        ),
    ];
    for (_, secret) in &look_alikes {
        apps.secrets()
            .create(&PostParams::default(), secret)
            .await?;
    }
    let secrets: Api<Secret> = Api::namespaced(controller.clone(), &apps.name);
    verdicts.allowed(
        "delete a Helm storage revision",
        secrets
            .delete("sh.helm.release.v1.web.v1", &dry_delete())
            .await,
    );
    for (what, secret) in &look_alikes {
        verdicts.refused(
            &format!("delete a Secret {what}"),
            secrets.delete(&secret.name_any(), &dry_delete()).await,
            SECRETS_ONLY,
        );
    }
    verdicts.refused(
        "relabel a Helm storage revision",
        secrets
            .patch(
                "sh.helm.release.v1.web.v1",
                &dry_patch(),
                &Patch::Merge(json!({"metadata": {"labels": {"status": "deployed"}}})),
            )
            .await,
        WRITES_ONLY,
    );
    verdicts.refused(
        "create a Secret",
        secrets
            .create(
                &dry_post(),
                &storage_like("sh.helm.release.v1.web.v9", "helm.sh/release.v1", &helm)?,
            )
            .await,
        WRITES_ONLY,
    );
    Ok(())
}

/// One entry of helm-controller's `status.history`, every field its CRD
/// requires.
fn snapshot() -> Value {
    json!({
        "name": "web", "namespace": "default", "version": 2, "status": "uninstalling",
        "chartName": "demo", "chartVersion": "1.0.0",
        "configDigest": "sha256:0000000000000000000000000000000000000000000000000000000000000000",
        "digest": "sha256:1111111111111111111111111111111111111111111111111111111111111111",
        "firstDeployed": "2026-01-01T00:00:00Z", "lastDeployed": "2026-01-01T00:00:00Z",
    })
}

/// `spec.suspend`, flux-plunger's finalizer and annotations, and an empty
/// history restored through the status subresource: nothing else.
async fn release_writes(
    apps: &TestNamespace,
    controller: &Client,
    verdicts: &mut Verdicts,
) -> Result<()> {
    // "web": fenced by flux-plunger, helm-controller's finalizer first, its
    // history empty (the stuck state). "tracked": a history helm-controller
    // keeps.
    release_with_values(apps, "web").await?;
    apps.mark_stuck("web").await?;
    apps.apply_as_flux_plunger("web", false).await?;
    // "fenced": installed (a history helm-controller's uninstall can act
    // on), deleted and uninstalled by helm-controller, which dropped its
    // finalizer; the fence is the last one, and giving it up (the apiserver
    // leaves `finalizers: null`) lets the release go.
    let hc = SimulatedHelmController::new(apps.client.clone(), &apps.name);
    apps.create_release("fenced", json!({})).await?;
    hc.install("fenced").await?;
    ensure!(hc.handle("fenced").await? == Handled::AddedFinalizer);
    apps.apply_as_flux_plunger("fenced", false).await?;
    apps.releases()
        .delete("fenced", &DeleteParams::default())
        .await?;
    ensure!(hc.handle("fenced").await? == Handled::Uninstalled);
    release_with_values(apps, "tracked").await?;
    apps.releases()
        .patch_status(
            "tracked",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"history": [snapshot()]}})),
        )
        .await?;
    let releases = helmreleases(controller.clone(), &apps.name);
    let merge = |patch: Value| {
        let releases = releases.clone();
        async move {
            releases
                .patch("web", &dry_patch(), &Patch::Merge(patch))
                .await
        }
    };
    let json_patch = |ops: Value| {
        let releases = releases.clone();
        async move {
            let patch = Patch::<()>::Json(serde_json::from_value(ops)?);
            anyhow::Ok(releases.patch("web", &dry_patch(), &patch).await)
        }
    };
    let apply = |body: Value, force: bool| {
        let releases = releases.clone();
        async move {
            let mut params = PatchParams::apply(FIELD_MANAGER);
            params.dry_run = true;
            params.force = force;
            releases.patch("web", &params, &Patch::Apply(body)).await
        }
    };
    let identity = json!({"apiVersion": HELMRELEASE_API_VERSION, "kind": HELMRELEASE_KIND, "metadata": {"name": "web"}});

    let mut suspend_and_fence = identity.clone();
    suspend_and_fence["metadata"]["finalizers"] = json!([FENCE_FINALIZER]);
    suspend_and_fence["spec"] = json!({"suspend": true});
    verdicts.allowed(
        "apply spec.suspend and the fence",
        apply(suspend_and_fence, true).await,
    );
    verdicts.allowed(
        "apply without the fence",
        apply(identity.clone(), false).await,
    );
    // Not a dry run: the one write that lets a release go.
    let mut fenced = identity.clone();
    fenced["metadata"]["name"] = json!("fenced");
    verdicts.allowed(
        "apply without the last finalizer of a deleted release, the fence",
        releases
            .patch(
                "fenced",
                &PatchParams::apply(FIELD_MANAGER),
                &Patch::Apply(fenced),
            )
            .await,
    );
    verdicts.refused(
        "merge-patch spec.suspend on a stuck, fenced release (no apply of flux-plunger's owns it)",
        merge(json!({"spec": {"suspend": true}})).await,
        SUSPEND_AS_ACQUIRED,
    );
    let mut suspend_alone = identity.clone();
    suspend_alone["spec"] = json!({"suspend": true});
    verdicts.refused(
        "apply spec.suspend without the fence on a stuck release",
        apply(suspend_alone, false).await,
        SUSPEND_AS_ACQUIRED,
    );
    let own: serde_json::Map<String, Value> = OWN_ANNOTATIONS
        .iter()
        .map(|a| ((*a).to_owned(), Value::from("7")))
        .collect();
    verdicts.allowed(
        "merge-patch flux-plunger's annotations",
        merge(json!({"metadata": {"annotations": own}})).await,
    );
    verdicts.allowed(
        "remove the fence by its index",
        json_patch(remove_finalizer_at(1, FENCE_FINALIZER)).await?,
    );
    // What the controller and the drain send where an apply cannot let go
    // (a copy of the fence another manager lists): pinned to the read, every
    // copy of the fence and its label removed.
    let web = ReleaseView::from_object(&releases.get("web").await?);
    ensure!(web.fence_labelled() && !web.fence_indices().is_empty());
    verdicts.allowed(
        "the guarded patch removing the fence and its label",
        json_patch(apply::guarded_patch(
            &web,
            false,
            &web.fence_indices(),
            true,
        ))
        .await?,
    );
    hand_overs(apps, &hc, &releases, verdicts).await?;
    ownership_and_suspension(apps, &releases, verdicts).await?;

    verdicts.refused(
        "merge-patch spec.values",
        merge(json!({"spec": {"values": {"replicas": 2}}})).await,
        SPEC_ONLY,
    );
    let mut interval = identity.clone();
    interval["spec"] = json!({"interval": "1m"});
    verdicts.refused(
        "apply spec.interval",
        apply(interval, true).await,
        SPEC_ONLY,
    );
    verdicts.refused(
        "remove helm-controller's finalizer",
        json_patch(remove_finalizer_at(0, HELM_CONTROLLER_FINALIZER)).await?,
        METADATA_ONLY,
    );
    verdicts.refused(
        "add another finalizer",
        json_patch(
            json!([{"op": "add", "path": "/metadata/finalizers/-", "value": "example.com/hold"}]),
        )
        .await?,
        METADATA_ONLY,
    );
    verdicts.refused(
        "merge-patch another annotation",
        merge(json!({"metadata": {"annotations": {"example.com/note": "x"}}})).await,
        METADATA_ONLY,
    );
    verdicts.refused(
        "merge-patch a label",
        merge(json!({"metadata": {"labels": {"team": "payments"}}})).await,
        METADATA_ONLY,
    );
    verdicts.refused(
        "rewrite a history helm-controller keeps",
        releases
            .patch_status(
                "tracked",
                &dry_patch_as_flux_plunger(),
                &Patch::Merge(json!({"status": {"history": [snapshot(), snapshot()]}})),
            )
            .await,
        STATUS_ONLY,
    );
    verdicts.refused(
        "write a condition",
        releases
            .patch_status(
                "web",
                &dry_patch_as_flux_plunger(),
                &Patch::Merge(json!({"status": {"conditions": [{
                    "type": "Ready", "status": "True", "reason": "Forged", "message": "",
                    "lastTransitionTime": "2026-01-01T00:00:00Z"}]}})),
            )
            .await,
        STATUS_ONLY,
    );
    verdicts.refused(
        "delete a HelmRelease",
        releases.delete("web", &dry_delete()).await,
        WRITES_ONLY,
    );
    let mut created: DynamicObject = apps.releases().get("web").await?;
    created.metadata = kube::api::ObjectMeta {
        name: Some("copy".to_owned()),
        ..Default::default()
    };
    verdicts.refused(
        "create a HelmRelease",
        releases.create(&dry_post(), &created).await,
        WRITES_ONLY,
    );
    Ok(())
}

/// The history flux-plunger hands to helm-controller's uninstall, and every
/// other history: each one helm-controller would act on (a live release's
/// changed target is uninstalled; a deleted one's entry is what its
/// uninstall targets), so only the hand-over is admitted: one entry naming
/// the release's own Helm release, in its own target namespace, with its own
/// storage namespace, on a release being deleted.
async fn hand_overs(
    apps: &TestNamespace,
    hc: &SimulatedHelmController,
    releases: &kube::Api<DynamicObject>,
    verdicts: &mut Verdicts,
) -> Result<()> {
    // "handed": stuck (its history empty) under flux-plunger's fence, then
    // deleted; helm-controller's finalizer and the fence keep it.
    apps.create_release("handed", json!({})).await?;
    hc.install("handed").await?;
    ensure!(hc.handle("handed").await? == Handled::AddedFinalizer);
    apps.apply_as_flux_plunger("handed", false).await?;
    apps.mark_stuck("handed").await?;
    apps.releases()
        .delete("handed", &DeleteParams::default())
        .await?;
    let entry = |name: &str, namespace: &str| {
        let mut entry = snapshot();
        entry["name"] = json!(name);
        entry["namespace"] = json!(namespace);
        entry
    };
    let own = entry("handed", &apps.name);
    let write = |release: &'static str, status: Value| {
        let releases = releases.clone();
        async move {
            releases
                .patch_status(
                    release,
                    &dry_patch_as_flux_plunger(),
                    &Patch::Merge(json!({ "status": status })),
                )
                .await
        }
    };

    verdicts.allowed(
        "hand over the release's own newest revision, with its storage namespace",
        write(
            "handed",
            json!({"history": [own.clone()], "storageNamespace": apps.name}),
        )
        .await,
    );
    verdicts.allowed(
        "hand over the release's own newest revision",
        write("handed", json!({"history": [own.clone()]})).await,
    );
    let refused = [
        (
            "hand over another release of the namespace",
            json!({"history": [entry("victim", &apps.name)]}),
        ),
        (
            "hand over the release's name in another namespace",
            json!({"history": [entry("handed", "prod")]}),
        ),
        (
            "hand over the release with another storage namespace",
            json!({"history": [own.clone()], "storageNamespace": "prod"}),
        ),
        (
            "hand over two entries",
            json!({"history": [own.clone(), own.clone()]}),
        ),
    ];
    for (what, status) in refused {
        verdicts.refused(what, write("handed", status).await, STATUS_ONLY);
    }
    verdicts.refused(
        "write the release's own history on a live release",
        write(
            "web",
            json!({"history": [entry("web", &apps.name)], "storageNamespace": apps.name}),
        )
        .await,
        STATUS_ONLY,
    );
    verdicts.refused(
        "write another release's history on a live release",
        write("web", json!({"history": [entry("victim", "prod")]})).await,
        STATUS_ONLY,
    );
    let_go_of(apps, "handed").await?;
    Ok(())
}

/// The writes that would make a suspension look flux-plunger's (SPEC §2: an
/// `Apply` entry of manager `flux-plunger` owning `spec.suspend`), hide
/// another manager's fields from the apiserver, or suspend and fence a
/// release flux-plunger is not recovering: a client may send managedFields
/// in a patch and the apiserver starts from them, so the guard admits only
/// what the apiserver itself moves on flux-plunger's writes.
async fn ownership_and_suspension(
    apps: &TestNamespace,
    releases: &Api<DynamicObject>,
    verdicts: &mut Verdicts,
) -> Result<()> {
    // "held": stuck, and suspended by an operator (`kubectl patch`), which
    // flux-plunger must never lift.
    release_with_values(apps, "held").await?;
    apps.mark_stuck("held").await?;
    apps.releases()
        .patch(
            "held",
            &PatchParams {
                field_manager: Some("kubectl-patch".to_owned()),
                ..PatchParams::default()
            },
            &Patch::Merge(json!({"spec": {"suspend": true}})),
        )
        .await?;
    let entries = serde_json::to_value(
        apps.releases()
            .get("held")
            .await?
            .metadata
            .managed_fields
            .unwrap_or_default(),
    )?;
    let entries = entries.as_array().cloned().unwrap_or_default();
    ensure!(
        entries.iter().any(|e| e["manager"] == "kubectl-patch"),
        "the operator's suspension has no managedFields entry: {entries:?}"
    );
    let with_entries = |entries: Vec<Value>, params: PatchParams| {
        let releases = releases.clone();
        async move {
            releases
                .patch(
                    "held",
                    &params,
                    &Patch::Merge(json!({"metadata": {"managedFields": entries}})),
                )
                .await
        }
    };
    let forged_apply = json!({
        "manager": FIELD_MANAGER, "operation": "Apply", "apiVersion": HELMRELEASE_API_VERSION,
        "time": "2026-01-01T00:00:00Z", "fieldsType": "FieldsV1",
        "fieldsV1": {"f:spec": {"f:suspend": {}}},
    });
    let mut forged = entries.clone();
    forged.push(forged_apply.clone());
    verdicts.refused(
        "forge an Apply entry of flux-plunger owning an operator's spec.suspend",
        with_entries(forged.clone(), dry_patch_as_flux_plunger()).await,
        MANAGED_FIELDS,
    );
    verdicts.refused(
        "forge an Apply entry of flux-plunger owning spec.suspend, written as another of its managers",
        with_entries(forged, dry_patch()).await,
        MANAGED_FIELDS,
    );
    // The operator's entry, changed by `change`.
    let operator_changed = |change: fn(&mut Value)| {
        let mut changed = entries.clone();
        changed
            .iter_mut()
            .filter(|e| e["manager"] == "kubectl-patch")
            .for_each(change);
        changed
    };
    let enlarged = operator_changed(|e| e["fieldsV1"]["f:spec"]["f:values"] = json!({}));
    verdicts.refused(
        "enlarge another manager's entry",
        with_entries(enlarged, dry_patch()).await,
        MANAGED_FIELDS,
    );
    // (A change of times alone the apiserver undoes itself: it keeps the
    // stored times on a write that changes nothing else.)
    let rewritten = operator_changed(|e| e["operation"] = json!("Apply"));
    verdicts.refused(
        "rewrite another manager's update as an apply",
        with_entries(rewritten, dry_patch()).await,
        MANAGED_FIELDS,
    );
    let mut added = entries.clone();
    added.push(json!({
        "manager": "kustomize-controller", "operation": "Apply", "apiVersion": HELMRELEASE_API_VERSION,
        "time": "2026-01-01T00:00:00Z", "fieldsType": "FieldsV1",
        "fieldsV1": {"f:metadata": {"f:labels": {"f:team": {}}}},
    }));
    verdicts.refused(
        "add another manager's entry",
        with_entries(added, dry_patch()).await,
        MANAGED_FIELDS,
    );
    let stripped: Vec<Value> = entries
        .iter()
        .filter(|e| e["manager"] != "kubectl-patch")
        .cloned()
        .collect();
    verdicts.refused(
        "strip another manager's entry whose suspension did not change",
        with_entries(stripped, dry_patch()).await,
        MANAGED_FIELDS,
    );
    verdicts.refused(
        "reset managedFields",
        with_entries(vec![json!({})], dry_patch()).await,
        MANAGED_FIELDS,
    );
    verdicts.refused(
        "lift an operator's suspension",
        dry_json_patch(
            releases,
            "held",
            json!([
                {"op": "test", "path": "/spec/suspend", "value": true},
                {"op": "remove", "path": "/spec/suspend"},
            ]),
        )
        .await?,
        LIFT_OURS,
    );
    let held = ReleaseView::from_object(&releases.get("held").await?);
    verdicts.refused(
        "apply the suspension and the fence, forced, over an operator's suspension",
        dry_apply(releases, &held, Claim::SUSPEND_AND_FENCE, true).await,
        MANAGED_FIELDS,
    );
    verdicts.refused(
        "merge-patch flux-plunger's annotation under another field manager",
        releases
            .patch(
                "held",
                &PatchParams {
                    dry_run: true,
                    field_manager: Some("kubectl-edit".to_owned()),
                    ..PatchParams::default()
                },
                &Patch::Merge(json!({"metadata": {"annotations": {OWN_ANNOTATIONS[0]: "7"}}})),
            )
            .await,
        OWN_MANAGERS,
    );

    // "idle": live and healthy (not stuck): flux-plunger neither suspends
    // nor fences it.
    release_with_values(apps, "idle").await?;
    let idle = ReleaseView::from_object(&releases.get("idle").await?);
    verdicts.refused(
        "apply the suspension and the fence on a release that is not stuck",
        dry_acquire(releases, &idle).await,
        SUSPEND_AS_ACQUIRED,
    );
    verdicts.refused(
        "apply the fence on a release that is not stuck",
        dry_apply(releases, &idle, Claim::FENCE_ONLY, false).await,
        FENCE_ON_STUCK,
    );
    verdicts.refused(
        "add the fence by a patch to a release that is not stuck",
        dry_json_patch(
            releases,
            "idle",
            json!([{"op": "add", "path": "/metadata/finalizers/-", "value": FENCE_FINALIZER}]),
        )
        .await?,
        FENCE_ON_STUCK,
    );
    // "waiting": stuck, its recovery deferred: flux-plunger fences it alone
    // (SPEC §4.5).
    release_with_values(apps, "waiting").await?;
    apps.mark_stuck("waiting").await?;
    let waiting = ReleaseView::from_object(&releases.get("waiting").await?);
    verdicts.allowed(
        "apply the fence alone on a stuck release whose recovery waits",
        dry_apply(releases, &waiting, Claim::FENCE_ONLY, false).await,
    );
    verdicts.allowed(
        "apply the suspension and the fence on a stuck release",
        dry_acquire(releases, &waiting).await,
    );
    Ok(())
}

/// Removes every finalizer of a release a test held in its delete, so that
/// it goes and its namespace with it.
async fn let_go_of(ns: &TestNamespace, name: &str) -> Result<()> {
    ns.releases()
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"finalizers": null}})),
        )
        .await?;
    Ok(())
}

/// Events about a HelmRelease, in its namespace; no other.
async fn events(apps: &TestNamespace, controller: &Client, verdicts: &mut Verdicts) -> Result<()> {
    let event = |namespace: &str,
                 regarding: Value|
     -> Result<k8s_openapi::api::events::v1::Event> {
        Ok(serde_json::from_value(json!({
            "metadata": {"name": format!("probe.{}", regarding["name"].as_str().unwrap_or_default()), "namespace": namespace},
            "eventTime": "2026-01-01T00:00:00.000000Z",
            "reportingController": "flux-plunger", "reportingInstance": "pod-a",
            "action": "Recovering", "reason": "Recovered", "type": "Normal",
            "regarding": regarding,
        }))?)
    };
    let on_release = json!({"apiVersion": HELMRELEASE_API_VERSION, "kind": HELMRELEASE_KIND,
        "name": "web", "namespace": apps.name});
    let events: Api<k8s_openapi::api::events::v1::Event> =
        Api::namespaced(controller.clone(), &apps.name);
    verdicts.allowed(
        "an Event about a HelmRelease",
        events
            .create(&dry_post(), &event(&apps.name, on_release.clone())?)
            .await,
    );
    verdicts.refused(
        "an Event about a ConfigMap",
        events
            .create(
                &dry_post(),
                &event(&apps.name, json!({"apiVersion": "v1", "kind": "ConfigMap", "name": "web", "namespace": apps.name}))?,
            )
            .await,
        EVENTS_ONLY,
    );
    let elsewhere = TestNamespace::create(&apps.client, "guard-rules-elsewhere").await?;
    verdicts.refused(
        "an Event about a HelmRelease of another namespace",
        Api::<k8s_openapi::api::events::v1::Event>::namespaced(controller.clone(), &elsewhere.name)
            .create(&dry_post(), &event(&elsewhere.name, on_release)?)
            .await,
        EVENTS_ONLY,
    );
    let core_event: k8s_openapi::api::core::v1::Event = serde_json::from_value(json!({
        "metadata": {"name": "probe.core"},
        "involvedObject": {"apiVersion": HELMRELEASE_API_VERSION, "kind": HELMRELEASE_KIND, "name": "web", "namespace": apps.name},
        "reason": "Recovered", "type": "Normal",
    }))?;
    verdicts.refused(
        "a core/v1 Event",
        Api::<k8s_openapi::api::core::v1::Event>::namespaced(controller.clone(), &apps.name)
            .create(&dry_post(), &core_event)
            .await,
        WRITES_ONLY,
    );
    Ok(())
}

/// The leader Lease of the release namespace, and the hook's scale-down of
/// the chart's own Deployment: no other Lease, Deployment or replica count.
async fn leases_and_scale(
    ns: &TestNamespace,
    guarded: &Guarded,
    apps: &TestNamespace,
    controller: &Client,
    hook: &Client,
    verdicts: &mut Verdicts,
) -> Result<()> {
    let lease = |name: &str| -> Result<Lease> {
        Ok(serde_json::from_value(json!({"metadata": {"name": name},
            "spec": {"holderIdentity": "pod-a", "leaseDurationSeconds": 27}}))?)
    };
    let leases: Api<Lease> = Api::namespaced(controller.clone(), &ns.name);
    verdicts.allowed(
        "create the leader Lease",
        leases.create(&dry_post(), &lease(&guarded.lease)?).await,
    );
    Api::<Lease>::namespaced(ns.client.clone(), &ns.name)
        .create(&PostParams::default(), &lease(&guarded.lease)?)
        .await?;
    verdicts.allowed(
        "renew the leader Lease",
        leases
            .patch(
                &guarded.lease,
                &dry_patch(),
                &Patch::Merge(json!({"spec": {"holderIdentity": "pod-b"}})),
            )
            .await,
    );
    verdicts.allowed(
        "the hook removes the leader Lease",
        Api::<Lease>::namespaced(hook.clone(), &ns.name)
            .delete(&guarded.lease, &dry_delete())
            .await,
    );
    verdicts.refused(
        "create another Lease of the release namespace",
        leases
            .create(&dry_post(), &lease("kube-controller-manager")?)
            .await,
        LEASE_ONLY,
    );
    verdicts.refused(
        "create the leader Lease's name in another namespace",
        Api::<Lease>::namespaced(controller.clone(), &apps.name)
            .create(&dry_post(), &lease(&guarded.lease)?)
            .await,
        LEASE_ONLY,
    );

    let deployment = |name: &str| -> Result<Deployment> {
        let labels = json!({"app.kubernetes.io/name": name});
        Ok(serde_json::from_value(json!({
            "metadata": {"name": name},
            "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                "template": {"metadata": {"labels": labels},
                    "spec": {"containers": [{"name": "c", "image": "flux-plunger"}]}}},
        }))?)
    };
    let deployments: Api<Deployment> = Api::namespaced(ns.client.clone(), &ns.name);
    for name in [guarded.deployment.as_str(), "web"] {
        deployments
            .create(&PostParams::default(), &deployment(name)?)
            .await?;
    }
    let scale = |replicas: i32| Patch::Merge(json!({"spec": {"replicas": replicas}}));
    let as_hook: Api<Deployment> = Api::namespaced(hook.clone(), &ns.name);
    verdicts.allowed(
        "the hook scales its Deployment to 0",
        as_hook
            .patch_scale(&guarded.deployment, &dry_patch(), &scale(0))
            .await,
    );
    verdicts.refused(
        "the hook scales its Deployment to 2",
        as_hook
            .patch_scale(&guarded.deployment, &dry_patch(), &scale(2))
            .await,
        SCALE_ONLY,
    );
    verdicts.refused(
        "the hook scales another Deployment to 0",
        as_hook.patch_scale("web", &dry_patch(), &scale(0)).await,
        SCALE_ONLY,
    );
    verdicts.refused(
        "patch its own Deployment",
        as_hook
            .patch(
                &guarded.deployment,
                &dry_patch(),
                &Patch::Merge(json!({"spec": {"replicas": 0}})),
            )
            .await,
        WRITES_ONLY,
    );
    Ok(())
}

const STAMP_LABEL: &str = "example.com/stamped";
const STAMP_ANNOTATION: &str = "example.com/seen-version";

/// A mutating admission policy (as a Kyverno mutate rule would) stamping a
/// label and an annotation that changes on every HelmRelease update in
/// `apps`' namespace: the guard sees the object after it.
async fn stamp_every_update(admin: &Client, apps: &TestNamespace) -> Result<()> {
    let name = format!("stamp-{}", apps.name);
    let policy: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingAdmissionPolicy",
        "metadata": {"name": name},
        "spec": {
            "failurePolicy": "Fail",
            "reinvocationPolicy": "Never",
            "matchConstraints": {"resourceRules": [{
                "apiGroups": ["helm.toolkit.fluxcd.io"], "apiVersions": ["*"],
                "operations": ["UPDATE"], "resources": ["helmreleases"],
            }]},
            "mutations": [{"patchType": "ApplyConfiguration", "applyConfiguration": {"expression": format!(
                "Object{{metadata: Object.metadata{{labels: {{\"{STAMP_LABEL}\": \"yes\"}}, \
                 annotations: {{\"{STAMP_ANNOTATION}\": object.metadata.resourceVersion}}}}}}"
            )}}],
        },
    }))?;
    let binding: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingAdmissionPolicyBinding",
        "metadata": {"name": name},
        "spec": {"policyName": name, "matchResources": {"namespaceSelector": {
            "matchLabels": {"kubernetes.io/metadata.name": apps.name}}}},
    }))?;
    for (object, plural) in [
        (policy, "mutatingadmissionpolicies"),
        (binding, "mutatingadmissionpolicybindings"),
    ] {
        let kind = object
            .types
            .as_ref()
            .map(|t| t.kind.clone())
            .unwrap_or_default();
        Api::<DynamicObject>::all_with(
            admin.clone(),
            &testkit::fixtures::vap_resource(&kind, plural),
        )
        .create(&PostParams::default(), &object)
        .await?;
    }
    // In force once an update the admin sends (a dry run) comes back stamped.
    testkit::eventually(
        Duration::from_secs(60),
        "the mutating policy stamps HelmRelease updates",
        || async {
            let stamped = apps
                .releases()
                .patch(
                    "web",
                    &PatchParams {
                        dry_run: true,
                        ..PatchParams::default()
                    },
                    &Patch::Merge(json!({"metadata": {"annotations": {"example.com/probe": "1"}}})),
                )
                .await?;
            Ok(stamped.labels().contains_key(STAMP_LABEL))
        },
    )
    .await
}

/// A mutator that stamps labels and annotations on every update is no
/// reason to refuse flux-plunger's own writes: the whole recovery, the
/// fence held while a recovery waits and its removal by the guarded patch
/// are admitted, stamped; a client's own change of labels or annotations
/// that are not flux-plunger's is still refused.
#[tokio::test]
async fn under_a_mutator_stamping_every_update_flux_plunger_s_writes_are_admitted_and_a_client_s_changes_refused()
-> Result<()> {
    let admin = control_plane().client().await?;
    let ns = TestNamespace::create(&admin, "guard-mutated").await?;
    let guarded = ns.guarded().await?;
    let apps = TestNamespace::create(&admin, "guard-mutated-apps").await?;
    release_with_values(&apps, "web").await?;
    apps.releases()
        .patch(
            "web",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"team": "payments"}}})),
        )
        .await?;
    apps.mark_stuck("web").await?;
    apps.create_storage_secret("web", 1, "uninstalling").await?;
    stamp_every_update(&admin, &apps).await?;
    let controller = guarded.controller_client().await?;
    let releases = helmreleases(controller.clone(), &apps.name);
    let read = || async { anyhow::Ok(ReleaseView::from_object(&releases.get("web").await?)) };
    let mut verdicts = Verdicts::new(&guarded.policy);

    verdicts.allowed(
        "apply the suspension and the fence",
        apply::apply(
            &controller,
            &read().await?,
            Claim::SUSPEND_AND_FENCE,
            false,
            &plunger::install::Install::legacy(),
        )
        .await,
    );
    verdicts.allowed(
        "write the processed-revision annotation",
        apply::annotate(&controller, &read().await?, 1, None).await,
    );
    verdicts.allowed(
        "delete the storage revision",
        Api::<Secret>::namespaced(controller.clone(), &apps.name)
            .delete("sh.helm.release.v1.web.v1", &DeleteParams::default())
            .await,
    );
    verdicts.allowed(
        "lift the suspension and the fence",
        apply::apply(
            &controller,
            &read().await?,
            Claim::NOTHING,
            false,
            &plunger::install::Install::legacy(),
        )
        .await,
    );
    verdicts.allowed(
        "apply the fence while the recovery waits",
        apply::apply(
            &controller,
            &read().await?,
            Claim::FENCE_ONLY,
            false,
            &plunger::install::Install::legacy(),
        )
        .await,
    );
    let fenced = read().await?;
    verdicts.allowed(
        "remove the fence and its label by the guarded patch",
        apply::patch_guarded(
            &controller,
            &fenced,
            false,
            &fenced.fence_indices(),
            true,
            PATCH_FIELD_MANAGER,
        )
        .await,
    );

    let clients_changes = [
        (
            "merge-patch a label, stamped as well",
            json!({"labels": {"team": "checkout"}}),
        ),
        (
            "remove a label, stamped as well",
            json!({"labels": {"team": null}}),
        ),
        (
            "merge-patch an annotation, stamped as well",
            json!({"annotations": {"example.com/note": "x"}}),
        ),
    ];
    for (what, metadata) in clients_changes {
        let patch = Patch::Merge(json!({ "metadata": metadata }));
        verdicts.refused(
            what,
            releases.patch("web", &dry_patch(), &patch).await,
            METADATA_ONLY,
        );
    }
    verdicts.check()?;

    // The writes were stamped, and went through: recovered, then fenced and
    // let go.
    let web = apps.releases().get("web").await?;
    assert_eq!(
        web.labels().get(STAMP_LABEL).map(String::as_str),
        Some("yes")
    );
    assert!(web.annotations().contains_key(STAMP_ANNOTATION), "{web:?}");
    assert_eq!(
        web.labels().get("team").map(String::as_str),
        Some("payments")
    );
    assert!(testkit::is_recovered(&web, 1), "{web:?}");
    Ok(())
}
