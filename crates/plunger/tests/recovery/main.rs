//! The controller's recovery against a real apiserver and the simulated
//! helm-controller (SPEC §3-§5), one claim per test.

mod controls;
mod core;
mod foreign_fences;
mod handover;
mod location;
mod races;
mod remote;
mod waiting;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::Result;
use futures::FutureExt;
use kube::api::{DeleteParams, DynamicObject, Patch, PatchParams};
use plunger::decide::SkipReason;
use plunger::events::Events;
use plunger::names::{
    FENCE_FINALIZER, FENCE_LABEL, FIELD_MANAGER, HELM_CONTROLLER_FINALIZER,
    HELMRELEASE_API_VERSION, HELMRELEASE_KIND, LEGACY_FENCE_LABEL_VALUE,
    PROCESSED_VERSION_ANNOTATION,
};
use plunger::reconcile::{Outcome, Reconciler, Step, TestHooks};
use plunger::release::view::ReleaseView;
use plunger::timings::Timings;
use serde_json::{Value, json};
use testkit::audit::AuditedRequest;
use testkit::{FaultPlan, FaultProxy, Handled, TestNamespace, audit, control_plane};

/// testkit's world, with what the recovery suites add to it.
struct World(testkit::World);

impl std::ops::Deref for World {
    type Target = testkit::World;

    fn deref(&self) -> &testkit::World {
        &self.0
    }
}

async fn world(prefix: &str) -> Result<World> {
    Ok(World(testkit::World::create(prefix).await?))
}

impl World {
    /// A reconciler for a cluster whose helm-controller impersonates
    /// `account` for a release that names no ServiceAccount.
    fn reconciler_defaulting_to(&self, account: &str) -> Reconciler {
        self.reconciler()
            .with_controls(plunger::reconcile::Controls {
                default_service_account: Some(account.to_owned()),
                ..plunger::reconcile::Controls::default()
            })
    }

    /// A reconciler that runs `action` once, the first time it reaches `at`.
    fn reconciler_pausing<F>(&self, at: Step, action: F) -> Reconciler
    where
        F: Fn() -> futures::future::BoxFuture<'static, ()> + Send + Sync + 'static,
    {
        pausing(self.reconciler(), at, action)
    }

    /// A reconciler with the admin's rights: the flux-plunger the fence
    /// exists against suspends without the fence, which the chart's admission
    /// guard refuses the chart's ServiceAccount.
    fn unguarded_reconciler(&self) -> Reconciler {
        Reconciler::new(
            self.client.clone(),
            Events::new(self.client.clone(), "flux-plunger", None),
            Timings::default(),
        )
    }

    async fn get(&self, name: &str) -> Result<Option<DynamicObject>> {
        Ok(self.ns.releases().get_opt(name).await?)
    }

    async fn revisions(&self) -> Result<Vec<String>> {
        self.ns.secret_names().await
    }

    /// How many Helm storage Secrets the namespace holds.
    async fn storage_secret_count(&self) -> Result<usize> {
        Ok(self
            .revisions()
            .await?
            .iter()
            .filter(|s| s.starts_with("sh.helm"))
            .count())
    }

    async fn delete(&self, name: &str) -> Result<()> {
        self.ns
            .releases()
            .delete(name, &DeleteParams::default())
            .await?;
        Ok(())
    }

    /// Applies `spec.suspend` as another manager.
    async fn suspend_as(&self, name: &str, manager: &str, value: bool) -> Result<DynamicObject> {
        self.ns.apply_suspend_as(name, manager, value).await
    }

    /// Sets `spec.suspend` as an Update by `manager` (kubectl patch, flux, a backup controller).
    async fn update_suspend_as(
        &self,
        name: &str,
        manager: &str,
        value: bool,
    ) -> Result<DynamicObject> {
        self.ns.update_suspend_as(name, manager, value).await
    }

    /// Puts our suspension and fence on the release, as a run that crashed mid-recovery left them.
    async fn leave_our_suspension(&self, name: &str) -> Result<DynamicObject> {
        let body = json!({"apiVersion": HELMRELEASE_API_VERSION, "kind": HELMRELEASE_KIND,
            "metadata": {"name": name, "finalizers": [FENCE_FINALIZER]}, "spec": {"suspend": true}});
        Ok(self
            .ns
            .releases()
            .patch(
                name,
                &PatchParams::apply(FIELD_MANAGER),
                &Patch::Apply(body),
            )
            .await?)
    }
}

/// Whether any managedFields entry of ours still owns suspend or a finalizer.
fn we_own_anything(object: &DynamicObject) -> bool {
    object.metadata.managed_fields.iter().flatten().any(|e| {
        e.manager.as_deref() == Some(FIELD_MANAGER)
            && e.fields_v1.as_ref().is_some_and(|f| {
                f.0.pointer("/f:spec/f:suspend").is_some()
                    || f.0.pointer("/f:metadata/f:finalizers").is_some()
            })
    })
}

fn spec_without_suspend(object: &DynamicObject) -> Value {
    let mut spec = object.data["spec"].clone();
    spec.as_object_mut().unwrap().remove("suspend");
    spec
}

fn assert_let_go(object: &DynamicObject) {
    let view = ReleaseView::from_object(object);
    assert!(!view.suspend, "still suspended: {:?}", object.data["spec"]);
    assert!(!view.has_fence(), "fence left: {:?}", view.finalizers);
    assert!(
        !we_own_anything(object),
        "{:?}",
        object.metadata.managed_fields
    );
}

/// A stuck release whose recovery is still to come (SPEC §4.5): our
/// suspension lifted (or never taken), our fence on it, nothing else of ours.
fn assert_waiting_fenced(object: &DynamicObject) {
    let view = ReleaseView::from_object(object);
    assert!(!view.suspend, "still suspended: {:?}", object.data["spec"]);
    assert!(
        view.has_fence() && view.fence_labelled(),
        "no fence: {:?}",
        view.finalizers
    );
    assert!(!view.suspended_by_us());
}

/// Deletes `name` while flux-plunger holds its recovery suspension and lets
/// helm-controller handle the delete first when `helm_controller_first`.
async fn delete_during_recovery(
    w: &World,
    name: &str,
    helm_controller_first: bool,
    unfenced: bool,
) -> Result<()> {
    w.stuck_release(name, &[(1, "superseded"), (2, "uninstalling")])
        .await?;
    let releases = w.ns.releases();
    let hc = w.hc.clone();
    let target = name.to_owned();
    let base = if unfenced {
        w.unguarded_reconciler()
    } else {
        w.reconciler()
    };
    let mut reconciler = pausing(base, Step::Acquired, move || {
        let releases = releases.clone();
        let hc = hc.clone();
        let target = target.clone();
        async move {
            releases
                .delete(&target, &DeleteParams::default())
                .await
                .unwrap();
            if helm_controller_first {
                hc.handle(&target).await.unwrap();
            }
        }
        .boxed()
    });
    reconciler.hooks.unfenced = unfenced;

    // The recovery meets the delete: its annotation write conflicts, and the
    // undo hands the newest revision over and lifts our suspension (keeping
    // the fence). Unfenced, the release may be gone already.
    let first = reconciler.reconcile(&w.ns.name, name).await;
    if unfenced {
        assert!(matches!(first, Err(_) | Ok(Outcome::Gone)), "{first:?}");
    } else {
        assert_eq!(first?, Outcome::HandedOver { revision: 2 });
    }
    // Then both controllers carry on until nothing changes.
    for _ in 0..5 {
        w.hc.handle(name).await?;
        w.reconciler().reconcile(&w.ns.name, name).await?;
    }
    Ok(())
}

/// `reconciler`, running `action` once, the first time it reaches `at`.
fn pausing<F>(mut reconciler: Reconciler, at: Step, action: F) -> Reconciler
where
    F: Fn() -> futures::future::BoxFuture<'static, ()> + Send + Sync + 'static,
{
    let done = Arc::new(AtomicBool::new(false));
    reconciler.hooks = TestHooks {
        unfenced: false,
        pause: Some(Arc::new(move |step| {
            if step == at && !done.swap(true, Ordering::SeqCst) {
                action()
            } else {
                async {}.boxed()
            }
        })),
    };
    reconciler
}

/// helm-controller uninstalled `name` (its resources and storage gone): the
/// next pass drops the fence and the release goes.
async fn assert_fence_dropped_after_the_uninstall(w: &World, name: &str) -> Result<()> {
    assert_eq!(
        w.reconciler().reconcile(&w.ns.name, name).await?,
        Outcome::FenceDropped
    );
    assert!(w.get(name).await?.is_none());
    assert!(!w.hc.resources_exist(name).await?);
    assert_eq!(w.revisions().await?, Vec::<String>::new());
    Ok(())
}

/// flux-plunger handed revision `revision` to helm-controller's uninstall,
/// and said so.
async fn assert_handed_over(w: &World, name: &str, revision: u64) -> Result<()> {
    let events = w.ns.events_for(name).await?;
    assert!(
        events.iter().any(|e| e.reason == "UninstallHandedOver"
            && e.type_ == "Normal"
            && e.note.contains(&format!("revision {revision} "))),
        "{events:?}"
    );
    Ok(())
}

/// A stuck release under our suspension and fence, deleted, helm-controller
/// past its suspended pass (its finalizer gone, nothing uninstalled).
async fn deleted_under_our_suspension(
    w: &World,
    name: &str,
    revisions: &[(u64, &str)],
) -> Result<()> {
    w.stuck_release(name, revisions).await?;
    w.leave_our_suspension(name).await?;
    w.delete(name).await?;
    assert_eq!(
        w.hc.handle(name).await?,
        Handled::UninstallSkippedBecauseSuspended
    );
    Ok(())
}

/// The requests in `namespace` since `offset` of the audit log that `wanted`
/// picks, once at least `count` of them have reached it.
async fn audited(
    namespace: &str,
    offset: u64,
    count: usize,
    wanted: impl Fn(&AuditedRequest) -> bool,
) -> Result<Vec<AuditedRequest>> {
    let mut picked = Vec::new();
    testkit::eventually(
        Duration::from_secs(10),
        "the requests reach the audit log",
        || {
            let read = audit::read_since(offset).map(|requests| {
                requests
                    .into_iter()
                    .filter(|r| r.namespace.as_deref() == Some(namespace) && wanted(r))
                    .collect::<Vec<_>>()
            });
            if let Ok(read) = &read {
                picked.clone_from(read);
            }
            async move { Ok(read?.len() >= count) }
        },
    )
    .await?;
    Ok(picked)
}

/// The bodies of the server-side applies by flux-plunger in `namespace`,
/// since `offset` of the audit log.
fn audited_applies(namespace: &str, offset: u64) -> Result<Vec<Value>> {
    Ok(audit::read_since(offset)?
        .into_iter()
        .filter(|r| r.verb == "patch" && r.resource() == "helmreleases")
        .filter(|r| r.namespace.as_deref() == Some(namespace))
        .filter(|r| r.field_manager() == Some(FIELD_MANAGER))
        .filter_map(|r| r.body)
        .filter(|body| body["apiVersion"] == HELMRELEASE_API_VERSION)
        .collect())
}

/// Creates a stuck release with `spec` whose storage Secrets, of release
/// `storage_name`, live in namespace `storage_ns`.
async fn stuck_elsewhere(
    w: &World,
    name: &str,
    spec: Value,
    storage_ns: &TestNamespace,
    storage_name: &str,
) -> Result<()> {
    w.ns.create_release(name, spec).await?;
    w.hc.handle(name).await?;
    storage_ns
        .create_storage_secret(storage_name, 1, "superseded")
        .await?;
    storage_ns
        .create_storage_secret(storage_name, 2, "uninstalling")
        .await?;
    // A decoy under the HelmRelease's own name, where the original looked.
    w.ns.create_storage_secret(name, 9, "uninstalling").await?;
    w.ns.mark_stuck(name).await?;
    Ok(())
}

async fn secret_names(ns: &TestNamespace) -> Result<Vec<String>> {
    ns.secret_names().await
}

/// Release `web` of `w`, installed in a remote cluster of its own
/// (`spec.kubeConfig`), stuck, with storage revisions of `revisions` there
/// and a decoy v2 in the local cluster, where the original looked. Returns
/// the remote cluster (running while it lives) and the namespace there.
async fn stuck_in_a_remote_cluster(
    w: &World,
    revisions: &[(u64, &str)],
) -> Result<(testkit::ControlPlane, TestNamespace)> {
    use k8s_openapi::api::core::v1::Namespace;
    use kube::api::{Api, PostParams};
    let remote = testkit::ControlPlane::start_another()?;
    let remote_client = remote.client().await?;
    let namespaces: Api<Namespace> = Api::all(remote_client.clone());
    namespaces
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": w.ns.name}}))?,
        )
        .await?;
    let remote_ns = TestNamespace {
        name: w.ns.name.clone(),
        client: remote_client,
    };
    for (revision, status) in revisions {
        remote_ns
            .create_storage_secret("web", *revision, status)
            .await?;
    }
    w.ns.create_storage_secret("web", 2, "uninstalling").await?;
    w.ns.create_remote_release(
        "web",
        &remote.kubeconfig_yaml(&testkit::control_plane::AuthInfo::AdminCertificate),
    )
    .await?;
    w.hc.handle("web").await?;
    w.ns.mark_stuck("web").await?;
    Ok((remote, remote_ns))
}

/// Lists the fence on `name` under `manager` by a merge patch, as
/// `kubectl patch --type merge` does: the whole list, the fence appended.
async fn add_fence_as(w: &World, name: &str, manager: &str) -> Result<()> {
    let mut finalizers = w.view(name).await?.finalizers;
    finalizers.push(FENCE_FINALIZER.to_owned());
    let params = PatchParams {
        field_manager: Some(manager.into()),
        ..Default::default()
    };
    w.ns.releases()
        .patch(
            name,
            &params,
            &Patch::Merge(json!({"metadata": {"finalizers": finalizers}})),
        )
        .await?;
    Ok(())
}

/// Lists the fence a second time on `name` under `manager`, by a JSON patch
/// appending it (a set cannot hold it twice through an apply).
async fn add_second_fence_as(w: &World, name: &str, manager: &str) -> Result<()> {
    let params = PatchParams {
        field_manager: Some(manager.into()),
        ..Default::default()
    };
    let patch: json_patch::Patch = serde_json::from_value(json!([
        {"op": "add", "path": "/metadata/finalizers/-", "value": FENCE_FINALIZER},
    ]))?;
    w.ns.releases()
        .patch(name, &params, &Patch::<()>::Json(patch))
        .await?;
    Ok(())
}

/// An installed release with helm-controller's finalizer.
async fn installed(w: &World, name: &str) -> Result<()> {
    w.ns.create_release(name, json!({})).await?;
    w.hc.install(name).await?;
    assert_eq!(w.hc.handle(name).await?, Handled::AddedFinalizer);
    Ok(())
}

/// Every request logged in `namespace` since `offset`, up to now: a marker
/// read made after the caller's last request is waited for, and the audit
/// log (blocking mode) records each request before answering it, so nothing
/// made before the marker is still to come.
async fn logged_until_now(w: &World, namespace: &str, offset: u64) -> Result<Vec<AuditedRequest>> {
    use k8s_openapi::api::core::v1::ConfigMap;
    let marker = format!("audit-marker-{offset}");
    kube::Api::<ConfigMap>::namespaced(w.client.clone(), namespace)
        .get_opt(&marker)
        .await?;
    let logged = audited(namespace, offset, 1, |r| r.name == marker).await?;
    let marker_at = logged[0].received_at;
    Ok(audit::read_since(offset)?
        .into_iter()
        .filter(|r| r.namespace.as_deref() == Some(namespace) && r.received_at < marker_at)
        .collect())
}

/// A ServiceAccount `name` in the release's namespace that may use Secrets
/// in `secrets_namespace` only: the identity helm-controller impersonates
/// for a tenant's release under Flux's multi-tenancy lockdown.
async fn service_account_using_secrets_in(
    w: &World,
    name: &str,
    secrets_namespace: &str,
) -> Result<()> {
    use k8s_openapi::api::core::v1::ServiceAccount;
    use k8s_openapi::api::rbac::v1::{PolicyRule, Role, RoleBinding, RoleRef, Subject};
    use kube::api::{ObjectMeta, PostParams};
    let meta = |namespace: &str| ObjectMeta {
        name: Some(name.to_owned()),
        namespace: Some(namespace.to_owned()),
        ..ObjectMeta::default()
    };
    kube::Api::<ServiceAccount>::namespaced(w.client.clone(), &w.ns.name)
        .create(
            &PostParams::default(),
            &ServiceAccount {
                metadata: meta(&w.ns.name),
                ..ServiceAccount::default()
            },
        )
        .await?;
    kube::Api::<Role>::namespaced(w.client.clone(), secrets_namespace)
        .create(
            &PostParams::default(),
            &Role {
                metadata: meta(secrets_namespace),
                rules: Some(vec![PolicyRule {
                    api_groups: Some(vec![String::new()]),
                    resources: Some(vec!["secrets".to_owned()]),
                    verbs: vec!["*".to_owned()],
                    ..PolicyRule::default()
                }]),
            },
        )
        .await?;
    kube::Api::<RoleBinding>::namespaced(w.client.clone(), secrets_namespace)
        .create(
            &PostParams::default(),
            &RoleBinding {
                metadata: meta(secrets_namespace),
                role_ref: RoleRef {
                    api_group: "rbac.authorization.k8s.io".to_owned(),
                    kind: "Role".to_owned(),
                    name: name.to_owned(),
                },
                subjects: Some(vec![Subject {
                    kind: "ServiceAccount".to_owned(),
                    name: name.to_owned(),
                    namespace: Some(w.ns.name.clone()),
                    ..Subject::default()
                }]),
            },
        )
        .await?;
    Ok(())
}
