//! The controller's recovery against a real apiserver and the simulated
//! helm-controller (SPEC §3-§5), one claim per test.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::Result;
use futures::FutureExt;
use kube::Client;
use kube::api::{DeleteParams, DynamicObject, Patch, PatchParams};
use plunger::decide::SkipReason;
use plunger::events::Events;
use plunger::names::{
    FENCE_FINALIZER, FENCE_LABEL, FENCE_LABEL_VALUE, FIELD_MANAGER, HELM_CONTROLLER_FINALIZER,
    HELMRELEASE_API_VERSION, HELMRELEASE_KIND, PROCESSED_VERSION_ANNOTATION,
};
use plunger::reconcile::{Outcome, Reconciler, Step, TestHooks};
use plunger::release::view::ReleaseView;
use plunger::timings::Timings;
use serde_json::{Value, json};
use testkit::audit::AuditedRequest;
use testkit::{
    FaultPlan, FaultProxy, Handled, SimulatedHelmController, TestNamespace, audit, control_plane,
};

struct World {
    ns: TestNamespace,
    /// The admin: the test's own arrangements.
    client: Client,
    /// flux-plunger: the chart's ServiceAccount, under the chart's admission
    /// guard.
    flux_plunger: Client,
    hc: SimulatedHelmController,
}

async fn world(prefix: &str) -> Result<World> {
    let client = control_plane().client().await?;
    let ns = TestNamespace::create(&client, prefix).await?;
    let hc = SimulatedHelmController::new(client.clone(), &ns.name);
    let flux_plunger = testkit::guard::shared()?.controller_client().await?;
    Ok(World {
        ns,
        client,
        flux_plunger,
        hc,
    })
}

impl World {
    fn reconciler(&self) -> Reconciler {
        Reconciler::new(
            self.flux_plunger.clone(),
            Events::new(self.flux_plunger.clone(), "flux-plunger", None),
            Timings::default(),
        )
    }

    /// A reconciler that runs `action` once, the first time it reaches `at`.
    fn reconciler_pausing<F>(&self, at: Step, action: F) -> Reconciler
    where
        F: Fn() -> futures::future::BoxFuture<'static, ()> + Send + Sync + 'static,
    {
        let mut reconciler = self.reconciler();
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

    /// A release as helm-controller keeps it: installed, with its finalizer,
    /// stuck, with storage revisions of the given statuses.
    async fn stuck_release(&self, name: &str, revisions: &[(u64, &str)]) -> Result<DynamicObject> {
        self.ns.create_release(name, json!({})).await?;
        self.hc.install(name).await?;
        assert_eq!(self.hc.handle(name).await?, Handled::AddedFinalizer);
        for (revision, status) in revisions {
            self.ns
                .create_storage_secret(name, *revision, status)
                .await?;
        }
        self.ns.mark_stuck(name).await
    }

    async fn get(&self, name: &str) -> Result<Option<DynamicObject>> {
        Ok(self.ns.releases().get_opt(name).await?)
    }

    async fn view(&self, name: &str) -> Result<ReleaseView> {
        Ok(ReleaseView::from_object(
            &self.ns.releases().get(name).await?,
        ))
    }

    async fn revisions(&self) -> Result<Vec<String>> {
        self.ns.secret_names().await
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
        let body = json!({"apiVersion": HELMRELEASE_API_VERSION, "kind": HELMRELEASE_KIND,
            "metadata": {"name": name}, "spec": {"suspend": value}});
        Ok(self
            .ns
            .releases()
            .patch(
                name,
                &PatchParams::apply(manager).force(),
                &Patch::Apply(body),
            )
            .await?)
    }

    /// Sets `spec.suspend` as an Update by `manager` (kubectl patch, flux, a backup controller).
    async fn update_suspend_as(
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
            .ns
            .releases()
            .patch(
                name,
                &params,
                &Patch::Merge(json!({"spec": {"suspend": value}})),
            )
            .await?)
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
        view.has_fence() && view.fence_labelled,
        "no fence: {:?}",
        view.finalizers
    );
    assert!(!view.suspended_by_us());
}

// 1.
#[tokio::test]
async fn a_stuck_release_loses_exactly_its_newest_revision_and_nothing_else() -> Result<()> {
    let w = world("recover").await?;
    let before = w
        .stuck_release(
            "web",
            &[(1, "superseded"), (2, "superseded"), (5, "uninstalling")],
        )
        .await?;

    let outcome = w.reconciler().reconcile(&w.ns.name, "web").await?;

    assert_eq!(outcome, Outcome::Recovered { revision: 5 });
    assert_eq!(
        w.revisions().await?,
        vec!["sh.helm.release.v1.web.v1", "sh.helm.release.v1.web.v2"]
    );
    let after = w.get("web").await?.unwrap();
    assert_let_go(&after);
    assert_eq!(
        after.metadata.annotations.as_ref().unwrap()[PROCESSED_VERSION_ANNOTATION],
        "5"
    );
    assert_eq!(after.data["spec"].get("suspend"), None);
    assert_eq!(
        spec_without_suspend(&after),
        before.data["spec"],
        "every other field untouched"
    );
    assert_eq!(after.metadata.finalizers, before.metadata.finalizers);
    // The annotation is written under the shared manager, never ours.
    let annotation_owner = after.metadata.managed_fields.iter().flatten().find(|e| {
        e.fields_v1.as_ref().is_some_and(|f| {
            // JSON pointer escapes the annotation key's "/" as "~1".
            f.0.pointer(&format!(
                "/f:metadata/f:annotations/f:{}",
                PROCESSED_VERSION_ANNOTATION.replace('/', "~1")
            ))
            .is_some()
        })
    });
    assert_eq!(
        annotation_owner.and_then(|e| e.manager.as_deref()),
        Some("flux-client-side-apply")
    );
    let events = w.ns.events_for("web").await?;
    assert!(
        events
            .iter()
            .any(|e| e.reason == "Recovered" && e.type_ == "Normal"),
        "{events:?}"
    );
    Ok(())
}

// 1b.
/// Storage is listed as metadata only, and only Secrets of Helm's storage
/// type: a recovery receives no revision's payload but, at most, the one the
/// uninstall hand-over snapshots (this release's history is empty). Through
/// a counting proxy, five revisions of about 200 KB each.
#[tokio::test]
async fn storage_is_listed_as_metadata_of_the_storage_type_only() -> Result<()> {
    const PAYLOAD: usize = 200_000;
    let w = world("metadata").await?;
    w.ns.create_release("web", json!({})).await?;
    w.hc.install("web").await?;
    assert_eq!(w.hc.handle("web").await?, Handled::AddedFinalizer);
    for revision in 1..=5 {
        let status = if revision == 5 {
            "uninstalling"
        } else {
            "superseded"
        };
        let size =
            w.ns.create_large_storage_secret("web", revision, status, PAYLOAD)
                .await?;
        assert!(size > PAYLOAD * 9 / 10, "a payload of {size} bytes");
    }
    w.ns.mark_stuck("web").await?;
    let proxy = FaultProxy::forwarding_as(
        &testkit::guard::shared()?.controller_kubeconfig(),
        FaultPlan::none(0),
    )
    .await?;
    let client = proxy.client()?;
    let reconciler = Reconciler::new(
        client.clone(),
        Events::new(client, "flux-plunger", None),
        Timings::default(),
    );
    let offset = audit::mark();

    let outcome = reconciler.reconcile(&w.ns.name, "web").await?;

    assert_eq!(outcome, Outcome::Recovered { revision: 5 });
    let received = proxy.report().response_bytes;
    // A list of whole Secrets alone would bring all five payloads.
    assert!(
        received < 2 * PAYLOAD as u64,
        "the reconciler received {received} bytes"
    );
    let lists = audited(&w.ns.name, offset, 1, |r| {
        r.verb == "list" && r.resource() == "secrets"
    })
    .await?;
    for list in &lists {
        assert!(
            list.request_uri
                .contains("fieldSelector=type%3Dhelm.sh%2Frelease.v1"),
            "{}",
            list.request_uri
        );
    }
    Ok(())
}

// 2.
#[tokio::test]
async fn a_release_that_is_not_stuck_or_has_no_storage_is_not_written() -> Result<()> {
    let w = world("no-write").await?;
    w.ns.create_release("healthy", json!({})).await?;
    w.ns.create_storage_secret("healthy", 1, "deployed").await?;
    w.ns.set_ready(
        "healthy",
        "True",
        "InstallSucceeded",
        "Helm install succeeded",
    )
    .await?;
    let empty = w.stuck_release("empty", &[]).await?;
    let healthy = w.get("healthy").await?.unwrap();

    let r = w.reconciler();
    assert_eq!(
        r.reconcile(&w.ns.name, "healthy").await?,
        Outcome::NothingToDo
    );
    assert_eq!(
        r.reconcile(&w.ns.name, "empty").await?,
        Outcome::Skipped(SkipReason::NoRevisions)
    );

    for before in [healthy, empty] {
        let after = w
            .get(&before.metadata.name.clone().unwrap())
            .await?
            .unwrap();
        assert_eq!(
            after.metadata.resource_version,
            before.metadata.resource_version
        );
        assert!(
            !after
                .metadata
                .managed_fields
                .iter()
                .flatten()
                .any(|e| e.manager.as_deref() == Some(FIELD_MANAGER))
        );
    }
    assert_eq!(w.revisions().await?, vec!["sh.helm.release.v1.healthy.v1"]);
    Ok(())
}

// 3.
#[tokio::test]
async fn the_processed_guard_skips_only_the_revision_below_the_one_reclaimed() -> Result<()> {
    let w = world("guard").await?;
    let r = w.reconciler();
    for (name, annotation, expect_recovery) in [
        ("below", "5", false),
        ("same", "4", true),
        ("far", "9", true),
        ("garbage", "not-a-number", true),
        ("empty", "", true),
    ] {
        w.stuck_release(name, &[(3, "superseded"), (4, "uninstalling")])
            .await?;
        w.ns.releases()
            .patch(name, &PatchParams::default(), &Patch::Merge(json!({"metadata": {"annotations": {PROCESSED_VERSION_ANNOTATION: annotation}}})))
            .await?;
        let outcome = r.reconcile(&w.ns.name, name).await?;
        if expect_recovery {
            assert_eq!(outcome, Outcome::Recovered { revision: 4 }, "{name}");
        } else {
            assert_eq!(
                outcome,
                Outcome::Skipped(SkipReason::AlreadyProcessed {
                    latest: 4,
                    processed: 5
                }),
                "{name}"
            );
            let after = w.get(name).await?.unwrap();
            assert!(!we_own_anything(&after));
        }
    }
    let left: Vec<String> = w.revisions().await?;
    assert!(
        left.contains(&"sh.helm.release.v1.below.v4".to_owned()),
        "{left:?}"
    );
    assert!(
        !left.contains(&"sh.helm.release.v1.far.v4".to_owned()),
        "{left:?}"
    );
    Ok(())
}

// 4a.
#[tokio::test]
async fn a_refused_annotation_lifts_the_suspension_keeps_the_secret_and_is_retried() -> Result<()> {
    let w = world("fail-annotate").await?;
    w.stuck_release("web", &[(1, "uninstalling")]).await?;
    let refusal = w
        .ns
        .refuse(
            "no-annotation",
            json!({"apiGroups": ["helm.toolkit.fluxcd.io"], "apiVersions": ["*"], "operations": ["UPDATE"], "resources": ["helmreleases"]}),
            "!has(object.metadata.annotations) || !('flux-plunger.cozystack.io/last-processed-version' in object.metadata.annotations)",
            "test: the processed-revision annotation is refused",
        )
        .await?;
    // Wait until the policy is in force (its informer syncs asynchronously).
    let probe = json!({"metadata": {"annotations": {PROCESSED_VERSION_ANNOTATION: "0"}}});
    testkit::eventually(
        Duration::from_secs(30),
        "the admission policy refuses the annotation",
        || {
            let releases = w.ns.releases();
            let probe = probe.clone();
            async move {
                let params = PatchParams {
                    dry_run: true,
                    ..Default::default()
                };
                Ok(releases
                    .patch("web", &params, &Patch::Merge(probe))
                    .await
                    .is_err())
            }
        },
    )
    .await?;

    let err = w
        .reconciler()
        .reconcile(&w.ns.name, "web")
        .await
        .unwrap_err();
    assert_eq!(err.kind(), "annotate", "{err}");
    // Still stuck: the fence stays for the retry (SPEC §4.5, §4.9).
    assert_waiting_fenced(&w.get("web").await?.unwrap());
    assert_eq!(w.revisions().await?, vec!["sh.helm.release.v1.web.v1"]);

    refusal.lift().await?;
    testkit::eventually(
        Duration::from_secs(30),
        "the retry recovers the release",
        || async {
            Ok(matches!(
                w.reconciler().reconcile(&w.ns.name, "web").await,
                Ok(Outcome::Recovered { revision: 1 })
            ))
        },
    )
    .await?;
    assert!(w.revisions().await?.is_empty());
    assert_let_go(&w.get("web").await?.unwrap());
    Ok(())
}

// 4b.
#[tokio::test]
async fn a_refused_secret_delete_lifts_the_suspension_keeps_the_secret_and_is_retried() -> Result<()>
{
    let w = world("fail-delete").await?;
    w.stuck_release("web", &[(1, "uninstalling")]).await?;
    w.ns.create_storage_secret("probe", 1, "failed").await?;
    let refusal = w
        .ns
        .refuse(
            "no-secret-delete",
            json!({"apiGroups": [""], "apiVersions": ["v1"], "operations": ["DELETE"], "resources": ["secrets"]}),
            "false",
            "test: deleting Secrets is refused",
        )
        .await?;
    testkit::eventually(
        Duration::from_secs(30),
        "the admission policy refuses Secret deletes",
        || {
            let secrets = w.ns.secrets();
            async move {
                let params = DeleteParams {
                    dry_run: true,
                    ..Default::default()
                };
                Ok(secrets
                    .delete("sh.helm.release.v1.probe.v1", &params)
                    .await
                    .is_err())
            }
        },
    )
    .await?;

    let err = w
        .reconciler()
        .reconcile(&w.ns.name, "web")
        .await
        .unwrap_err();
    assert_eq!(err.kind(), "delete_storage", "{err}");
    let after = w.get("web").await?.unwrap();
    assert_waiting_fenced(&after);
    assert!(
        w.revisions()
            .await?
            .contains(&"sh.helm.release.v1.web.v1".to_owned())
    );
    // The annotation is written before anything is deleted (step 10).
    assert_eq!(
        after.metadata.annotations.as_ref().unwrap()[PROCESSED_VERSION_ANNOTATION],
        "1"
    );

    refusal.lift().await?;
    testkit::eventually(
        Duration::from_secs(30),
        "the retry recovers the release",
        || async {
            Ok(matches!(
                w.reconciler().reconcile(&w.ns.name, "web").await,
                Ok(Outcome::Recovered { revision: 1 })
            ))
        },
    )
    .await?;
    assert!(
        !w.revisions()
            .await?
            .contains(&"sh.helm.release.v1.web.v1".to_owned())
    );
    Ok(())
}

// 5.
#[tokio::test]
async fn a_suspension_set_by_anyone_else_is_never_lifted() -> Result<()> {
    let w = world("foreign").await?;
    let r = w.reconciler();
    w.stuck_release("patched", &[(1, "uninstalling")]).await?;
    w.update_suspend_as("patched", "kubectl-patch", true)
        .await?;
    w.stuck_release("shared-manager", &[(1, "uninstalling")])
        .await?;
    w.suspend_as("shared-manager", "flux-client-side-apply", true)
        .await?;
    w.stuck_release("applier", &[(1, "uninstalling")]).await?;
    w.suspend_as("applier", "platform-migration", true).await?;
    w.stuck_release("recovered-before", &[(1, "uninstalling")])
        .await?;
    w.ns.releases()
        .patch(
            "recovered-before",
            &PatchParams::default(),
            &Patch::Merge(
                json!({"metadata": {"annotations": {PROCESSED_VERSION_ANNOTATION: "3"}}}),
            ),
        )
        .await?;
    w.update_suspend_as("recovered-before", "flux-client-side-apply", true)
        .await?;

    for name in ["patched", "shared-manager", "applier", "recovered-before"] {
        let before = w.get(name).await?.unwrap();
        assert_eq!(
            r.reconcile(&w.ns.name, name).await?,
            Outcome::LeftAlone,
            "{name}"
        );
        let after = w.get(name).await?.unwrap();
        assert_eq!(after.data["spec"]["suspend"], true, "{name}");
        assert_eq!(
            after.metadata.resource_version, before.metadata.resource_version,
            "{name}"
        );
        let events = w.ns.events_for(name).await?;
        let expected = if name == "recovered-before" {
            "Warning"
        } else {
            "Normal"
        };
        assert!(
            events
                .iter()
                .any(|e| e.reason == "SuspensionNotOwned" && e.type_ == expected),
            "{name}: {events:?}"
        );
    }
    assert_eq!(w.revisions().await?.len(), 4, "no storage touched");
    Ok(())
}

// 6.
#[tokio::test]
async fn our_suspension_left_by_a_crash_is_lifted_and_nothing_is_deleted_in_that_pass() -> Result<()>
{
    let w = world("crash").await?;
    w.stuck_release("web", &[(1, "uninstalling")]).await?;
    w.leave_our_suspension("web").await?;

    let outcome = w.reconciler().reconcile(&w.ns.name, "web").await?;

    // Still stuck: the fence stays for the recovery of the next pass.
    assert_eq!(outcome, Outcome::Lifted { kept_fence: true });
    assert_waiting_fenced(&w.get("web").await?.unwrap());
    assert_eq!(w.revisions().await?, vec!["sh.helm.release.v1.web.v1"]);

    assert_eq!(
        w.reconciler().reconcile(&w.ns.name, "web").await?,
        Outcome::Recovered { revision: 1 }
    );
    assert_let_go(&w.get("web").await?.unwrap());
    Ok(())
}

// 7a.
#[tokio::test]
async fn the_acquire_forces_over_a_backup_controller_owning_suspend_false() -> Result<()> {
    let w = world("force").await?;
    w.stuck_release("web", &[(1, "uninstalling")]).await?;
    w.update_suspend_as("web", "velero", false).await?;

    let outcome = w.reconciler().reconcile(&w.ns.name, "web").await?;

    assert_eq!(outcome, Outcome::Recovered { revision: 1 });
    assert_let_go(&w.get("web").await?.unwrap());
    Ok(())
}

// 7b.
#[tokio::test]
async fn a_foreign_suspension_landing_before_the_acquire_defers_the_recovery() -> Result<()> {
    let w = world("defer").await?;
    for (name, step) in [
        ("unforced", Step::BeforeAcquire),
        ("forced", Step::BeforeForcedAcquire),
    ] {
        w.stuck_release(name, &[(1, "uninstalling")]).await?;
        if step == Step::BeforeForcedAcquire {
            // An owner of `false` makes the unforced acquire conflict.
            w.update_suspend_as(name, "velero", false).await?;
        }
        let releases = w.ns.releases();
        let target = name.to_owned();
        let reconciler = w.reconciler_pausing(step, move || {
            let releases = releases.clone();
            let target = target.clone();
            async move {
                let params = PatchParams {
                    field_manager: Some("operator".into()),
                    ..Default::default()
                };
                releases
                    .patch(
                        &target,
                        &params,
                        &Patch::Merge(json!({"spec": {"suspend": true}})),
                    )
                    .await
                    .unwrap();
            }
            .boxed()
        });

        let outcome = reconciler.reconcile(&w.ns.name, name).await?;

        assert_eq!(outcome, Outcome::Deferred, "{name}");
        let after = w.get(name).await?.unwrap();
        assert_eq!(after.data["spec"]["suspend"], true, "{name}");
        assert!(!we_own_anything(&after), "{name}");
        assert!(!ReleaseView::from_object(&after).has_fence(), "{name}");
        let owners: Vec<_> = after
            .metadata
            .managed_fields
            .iter()
            .flatten()
            .filter(|e| {
                e.fields_v1
                    .as_ref()
                    .is_some_and(|f| f.0.pointer("/f:spec/f:suspend").is_some())
            })
            .map(|e| e.manager.clone().unwrap_or_default())
            .collect();
        assert_eq!(owners, vec!["operator".to_owned()], "{name}");
        assert!(
            w.ns.events_for(name)
                .await?
                .iter()
                .any(|e| e.reason == "RecoveryDeferred"),
            "{name}"
        );
    }
    assert_eq!(w.revisions().await?.len(), 2, "both Secrets kept");
    Ok(())
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
    let mut reconciler = w.reconciler_pausing(Step::Acquired, move || {
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

// 8.
#[tokio::test]
async fn a_delete_during_recovery_reaches_the_uninstall_when_helm_controller_handles_it_first()
-> Result<()> {
    let w = world("race-hc-first").await?;
    delete_during_recovery(&w, "web", true, false).await?;
    assert_eq!(
        w.hc.decisions_for("web"),
        vec![
            Handled::UninstallSkippedBecauseSuspended,
            Handled::Uninstalled
        ],
        "helm-controller met the suspension first, then uninstalled the unsuspended generation"
    );
    assert!(!w.hc.resources_exist("web").await?, "uninstalled");
    assert!(w.get("web").await?.is_none(), "gone");
    assert_eq!(
        w.revisions().await?,
        Vec::<String>::new(),
        "the uninstall purged the storage, the stuck revision included"
    );
    assert_handed_over(&w, "web", 2).await
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

#[tokio::test]
async fn a_delete_during_recovery_reaches_the_uninstall_when_flux_plunger_handles_it_first()
-> Result<()> {
    let w = world("race-fp-first").await?;
    delete_during_recovery(&w, "web", false, false).await?;
    assert_eq!(w.hc.decisions_for("web"), vec![Handled::Uninstalled]);
    assert!(!w.hc.resources_exist("web").await?, "uninstalled");
    assert!(w.get("web").await?.is_none(), "gone");
    assert_handed_over(&w, "web", 2).await
}

#[tokio::test]
async fn without_the_fence_a_delete_during_recovery_orphans_the_release() -> Result<()> {
    let w = world("race-unfenced").await?;
    delete_during_recovery(&w, "web", true, true).await?;
    assert_eq!(
        w.hc.decisions_for("web"),
        vec![Handled::UninstallSkippedBecauseSuspended]
    );
    assert!(w.get("web").await?.is_none(), "gone");
    assert!(
        w.hc.resources_exist("web").await?,
        "orphaned: this is the bug the fence exists for"
    );
    Ok(())
}

// 9.
#[tokio::test]
async fn a_delete_racing_our_unsuspend_is_held_by_the_fence_until_the_uninstall() -> Result<()> {
    let w = world("race-lift").await?;
    w.stuck_release("web", &[(1, "uninstalling")]).await?;
    w.leave_our_suspension("web").await?;
    let releases = w.ns.releases();
    let reconciler = w.reconciler_pausing(Step::BeforeLift, move || {
        let releases = releases.clone();
        async move {
            releases
                .delete("web", &DeleteParams::default())
                .await
                .unwrap();
        }
        .boxed()
    });

    let err = reconciler.reconcile(&w.ns.name, "web").await.unwrap_err();
    assert!(err.is_stale_write(), "{err}");
    assert!(
        !w.ns
            .events_for("web")
            .await?
            .iter()
            .any(|e| e.reason == "UnsuspendFailed"),
        "no warning for a 409"
    );

    // helm-controller meets the suspension: it skips the uninstall and drops
    // its finalizer, but the fence keeps the release.
    assert_eq!(
        w.hc.handle("web").await?,
        Handled::UninstallSkippedBecauseSuspended
    );
    let held = w.view("web").await?;
    assert!(held.terminating && held.has_fence() && held.suspend);

    assert_eq!(
        w.reconciler().reconcile(&w.ns.name, "web").await?,
        Outcome::HandedOver { revision: 1 }
    );
    let lifted = w.view("web").await?;
    assert!(!lifted.suspend && lifted.has_fence());
    assert_eq!(
        lifted.status_latest_history_name.as_deref(),
        Some("web"),
        "helm-controller's uninstall now has the release to uninstall"
    );
    assert!(
        matches!(
            w.reconciler().reconcile(&w.ns.name, "web").await?,
            Outcome::FenceHeld { .. }
        ),
        "the fence stays until helm-controller has observed the unsuspended generation"
    );
    assert_eq!(w.hc.handle("web").await?, Handled::Uninstalled);
    assert_eq!(
        w.reconciler().reconcile(&w.ns.name, "web").await?,
        Outcome::FenceDropped
    );
    assert!(w.get("web").await?.is_none());
    assert!(!w.hc.resources_exist("web").await?);
    Ok(())
}

// The uninstall of a release deleted with an empty history (SPEC §5a, §5d).

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

#[tokio::test]
async fn the_history_is_handed_over_in_one_status_write_locked_on_the_read_and_before_the_lift()
-> Result<()> {
    let w = world("handover-write").await?;
    deleted_under_our_suspension(&w, "web", &[(1, "superseded"), (2, "uninstalling")]).await?;
    let offset = audit::mark();

    assert_eq!(
        w.reconciler().reconcile(&w.ns.name, "web").await?,
        Outcome::HandedOver { revision: 2 }
    );

    let writes = audited(&w.ns.name, offset, 2, |r| {
        r.is_write() && r.resource().starts_with("helmreleases")
    })
    .await?;
    let labels: Vec<(String, Option<&str>)> = writes
        .iter()
        .map(|r| (r.label(), r.field_manager()))
        .collect();
    assert_eq!(
        labels,
        vec![
            (
                "patch (merge) helmreleases/status".to_owned(),
                Some(FIELD_MANAGER)
            ),
            ("patch (apply) helmreleases".to_owned(), Some(FIELD_MANAGER)),
        ],
        "the history first, then the lift; nothing else"
    );
    let body = writes[0].body.clone().unwrap_or_default();
    let stored = testkit::fixtures::stored_release("web", &w.ns.name, 2, "uninstalling");
    let entry = &body["status"]["history"][0];
    assert_eq!(
        (
            &entry["name"],
            &entry["namespace"],
            &entry["version"],
            &entry["status"]
        ),
        (
            &json!("web"),
            &json!(w.ns.name),
            &json!(2),
            &json!("uninstalling")
        ),
        "{body}"
    );
    assert_eq!(entry["chartName"], stored["chart"]["metadata"]["name"]);
    assert_eq!(
        body["status"].get("storageNamespace"),
        None,
        "the status still names it: {body}"
    );
    assert!(
        body["metadata"]["resourceVersion"]
            .as_str()
            .is_some_and(|rv| !rv.is_empty()),
        "{body}"
    );
    assert_eq!(
        body.as_object().unwrap().keys().collect::<Vec<_>>(),
        vec!["metadata", "status"]
    );

    // The status write is an Update of status only: the suspension it lifts
    // was flux-plunger's by its Apply entry, and stays unowned by it.
    let after = w.get("web").await?.unwrap();
    assert!(!ReleaseView::from_object(&after).suspend_owned_by_us());
    assert_eq!(w.hc.handle("web").await?, Handled::Uninstalled);
    assert_fence_dropped_after_the_uninstall(&w, "web").await?;
    Ok(())
}

#[tokio::test]
async fn a_status_helm_controller_wrote_after_our_read_is_never_overwritten_by_the_history()
-> Result<()> {
    let w = world("handover-409").await?;
    deleted_under_our_suspension(&w, "web", &[(1, "uninstalling")]).await?;
    let ns = w.ns.name.clone();
    let client = w.client.clone();
    let reconciler = w.reconciler_pausing(Step::BeforeHistoryWrite, move || {
        let releases = plunger::release::api::helmreleases(client.clone(), &ns);
        async move {
            releases
                .patch_status(
                    "web",
                    &PatchParams::default(),
                    &Patch::Merge(json!({"status": {"lastAttemptedRevision": "1.0.0"}})),
                )
                .await
                .unwrap();
        }
        .boxed()
    });

    let err = reconciler.reconcile(&w.ns.name, "web").await.unwrap_err();
    assert!(err.is_stale_write(), "{err}");
    let kept = w.get("web").await?.unwrap();
    assert_eq!(kept.data["status"]["lastAttemptedRevision"], "1.0.0");
    assert!(kept.data["status"].get("history").is_none());
    assert!(
        ReleaseView::from_object(&kept).suspended_by_us(),
        "not lifted"
    );

    // The retry reads again and hands over on top of what helm-controller wrote.
    assert_eq!(
        w.reconciler().reconcile(&w.ns.name, "web").await?,
        Outcome::HandedOver { revision: 1 }
    );
    let handed = w.get("web").await?.unwrap();
    assert_eq!(handed.data["status"]["lastAttemptedRevision"], "1.0.0");
    assert_eq!(handed.data["status"]["history"][0]["version"], 1);
    Ok(())
}

#[tokio::test]
async fn after_helm_controller_s_pass_over_an_empty_history_the_history_is_restored_and_a_reconcile_requested()
-> Result<()> {
    let w = world("handover-restore").await?;
    w.stuck_release("web", &[(1, "superseded"), (2, "unknown")])
        .await?;
    w.ns.apply_as_flux_plunger("web", false).await?;
    w.delete("web").await?;
    // Unsuspended, with no history: helm-controller uninstalls nothing and
    // lets go (its ErrNoLatest); the fence holds the release.
    assert_eq!(
        w.hc.handle("web").await?,
        Handled::NothingRecordedToUninstall
    );
    assert!(w.hc.resources_exist("web").await?);

    assert_eq!(
        w.reconciler().reconcile(&w.ns.name, "web").await?,
        Outcome::HandedOver { revision: 2 }
    );
    let restored = w.view("web").await?;
    assert_eq!(
        restored.status_storage_namespace.as_deref(),
        Some(w.ns.name.as_str())
    );
    assert!(restored.has_history && restored.reconcile_request_pending());
    assert!(matches!(
        w.reconciler().reconcile(&w.ns.name, "web").await?,
        Outcome::FenceHeld { .. }
    ));

    assert_eq!(w.hc.handle("web").await?, Handled::Uninstalled);
    assert_fence_dropped_after_the_uninstall(&w, "web").await?;
    assert_handed_over(&w, "web", 2).await
}

#[tokio::test]
async fn a_release_helm_controller_let_go_again_without_an_uninstall_is_released_with_a_warning()
-> Result<()> {
    let w = world("handover-cleared").await?;
    w.stuck_release("web", &[(1, "uninstalling")]).await?;
    w.ns.apply_as_flux_plunger("web", false).await?;
    w.delete("web").await?;
    w.hc.handle("web").await?;
    assert_eq!(
        w.reconciler().reconcile(&w.ns.name, "web").await?,
        Outcome::HandedOver { revision: 1 }
    );
    // helm-controller handles the request but clears the history without
    // uninstalling (as it does when it cannot build a client for it).
    let requested = w.view("web").await?;
    let value = requested.annotations["reconcile.fluxcd.io/requestedAt"].clone();
    w.ns.releases()
        .patch_status(
            "web",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"history": null, "storageNamespace": null, "lastHandledReconcileAt": value}})),
        )
        .await?;

    assert_eq!(
        w.reconciler().reconcile(&w.ns.name, "web").await?,
        Outcome::ReleasedWithoutUninstall
    );
    assert!(w.get("web").await?.is_none());
    let events = w.ns.events_for("web").await?;
    assert!(
        events.iter().any(|e| e.reason == "ReleasedWithoutUninstall"
            && e.type_ == "Warning"
            && e.note
                .contains("sh.helm.release.v1.web.v1 (status uninstalling)")),
        "{events:?}"
    );
    Ok(())
}

#[tokio::test]
async fn an_uninstalled_newest_revision_is_reclaimed_so_that_the_uninstall_targets_the_one_below()
-> Result<()> {
    let w = world("handover-uninstalled").await?;
    deleted_under_our_suspension(&w, "web", &[(1, "superseded"), (2, "uninstalled")]).await?;

    assert_eq!(
        w.reconciler().reconcile(&w.ns.name, "web").await?,
        Outcome::ReclaimedUninstalled { revision: 2 }
    );
    assert_eq!(w.revisions().await?, vec!["sh.helm.release.v1.web.v1"]);
    assert_eq!(
        w.reconciler().reconcile(&w.ns.name, "web").await?,
        Outcome::HandedOver { revision: 1 }
    );
    assert_eq!(w.hc.handle("web").await?, Handled::Uninstalled);
    assert_fence_dropped_after_the_uninstall(&w, "web").await?;
    Ok(())
}

#[tokio::test]
async fn a_revision_whose_payload_cannot_be_read_is_lifted_and_then_let_go_with_a_warning()
-> Result<()> {
    use k8s_openapi::ByteString;
    let w = world("handover-bad-payload").await?;
    deleted_under_our_suspension(&w, "web", &[(1, "uninstalling")]).await?;
    let mut secret = w.ns.secrets().get("sh.helm.release.v1.web.v1").await?;
    secret.data = Some([("release".to_owned(), ByteString(b"not base64!".to_vec()))].into());
    w.ns.secrets()
        .replace("sh.helm.release.v1.web.v1", &Default::default(), &secret)
        .await?;

    // Our suspension never stays: it is lifted, the fence kept.
    assert_eq!(
        w.reconciler().reconcile(&w.ns.name, "web").await?,
        Outcome::Lifted { kept_fence: true }
    );
    assert_eq!(
        w.hc.handle("web").await?,
        Handled::NothingRecordedToUninstall
    );
    assert_eq!(
        w.reconciler().reconcile(&w.ns.name, "web").await?,
        Outcome::ReleasedWithoutUninstall
    );
    assert!(w.get("web").await?.is_none());
    let events = w.ns.events_for("web").await?;
    assert!(
        events.iter().any(|e| e.reason == "ReleasedWithoutUninstall"
            && e.note.contains("revision 1")
            && e.note.contains("not base64")),
        "{events:?}"
    );
    assert_eq!(
        w.revisions().await?,
        vec!["sh.helm.release.v1.web.v1"],
        "nothing deleted"
    );
    Ok(())
}

// 10.
#[tokio::test]
async fn a_release_deleted_under_a_foreign_suspension_loses_only_our_fence() -> Result<()> {
    let w = world("terminating-foreign").await?;
    for (name, annotated) in [("migration", false), ("accident", true)] {
        w.stuck_release(name, &[(1, "uninstalling")]).await?;
        w.leave_our_suspension(name).await?;
        // Another manager co-owns, then takes the suspension alone.
        w.suspend_as(name, "platform-migration", true).await?;
        let body = json!({"apiVersion": HELMRELEASE_API_VERSION, "kind": HELMRELEASE_KIND,
            "metadata": {"name": name, "finalizers": [FENCE_FINALIZER]}});
        w.ns.releases()
            .patch(
                name,
                &PatchParams::apply(FIELD_MANAGER),
                &Patch::Apply(body),
            )
            .await?;
        if annotated {
            w.ns.releases()
                .patch(
                    name,
                    &PatchParams::default(),
                    &Patch::Merge(
                        json!({"metadata": {"annotations": {PROCESSED_VERSION_ANNOTATION: "1"}}}),
                    ),
                )
                .await?;
        }
        let view = w.view(name).await?;
        assert!(
            view.suspend && !view.suspend_owned_by_us() && view.has_fence(),
            "{name}: setup"
        );
        w.delete(name).await?;

        assert_eq!(
            w.reconciler().reconcile(&w.ns.name, name).await?,
            Outcome::FenceDropped,
            "{name}"
        );

        let after = w.view(name).await?;
        assert!(after.suspend, "{name}: the suspension is that manager's");
        assert!(!after.has_fence(), "{name}");
        let expected = if annotated { "Warning" } else { "Normal" };
        let events = w.ns.events_for(name).await?;
        assert!(
            events
                .iter()
                .any(|e| e.reason == "TerminatingWhileSuspended" && e.type_ == expected),
            "{name}: {events:?}"
        );
        // helm-controller then skips the uninstall, as that manager meant.
        assert_eq!(
            w.hc.handle(name).await?,
            Handled::UninstallSkippedBecauseSuspended
        );
        assert!(w.get(name).await?.is_none());
        assert!(w.hc.resources_exist(name).await?);
    }
    Ok(())
}

#[tokio::test]
async fn a_fence_an_older_flux_plunger_set_on_a_deleted_release_gets_its_label_and_is_then_listed()
-> Result<()> {
    let w = world("older-fence").await?;
    w.stuck_release("web", &[(1, "uninstalling")]).await?;
    w.ns.apply_as_older_flux_plunger("web", false).await?;
    w.delete("web").await?;
    let listed = || async {
        let fenced =
            plunger::release::api::list_fenced(&w.client, &plunger::scope::Scope::default())
                .await?;
        anyhow::Ok(fenced.iter().any(|r| r.namespace == w.ns.name))
    };
    assert!(
        !listed().await?,
        "no label: the drain's selection misses it"
    );

    // helm-controller has not uninstalled it: the fence stays, labelled.
    assert!(matches!(
        w.reconciler().reconcile(&w.ns.name, "web").await?,
        Outcome::FenceHeld { .. }
    ));
    let view = w.view("web").await?;
    assert!(view.has_fence() && view.fence_labelled, "{view:?}");
    assert!(listed().await?, "the drain's selection finds it now");
    // The next pass has nothing to write.
    let before = view.resource_version;
    w.reconciler().reconcile(&w.ns.name, "web").await?;
    assert_eq!(w.view("web").await?.resource_version, before);
    Ok(())
}

// 11a.
#[tokio::test]
async fn a_recovery_whose_release_vanished_never_recreates_it() -> Result<()> {
    let w = world("vanished").await?;
    w.stuck_release("web", &[(1, "uninstalling")]).await?;
    let releases = w.ns.releases();
    let reconciler = w.reconciler_pausing(Step::Acquired, move || {
        let releases = releases.clone();
        async move {
            // Deleted and every finalizer forced off: the release is gone.
            releases
                .patch(
                    "web",
                    &PatchParams::default(),
                    &Patch::Merge(json!({"metadata": {"finalizers": null}})),
                )
                .await
                .unwrap();
            releases
                .delete("web", &DeleteParams::default())
                .await
                .unwrap();
        }
        .boxed()
    });

    let result = reconciler.reconcile(&w.ns.name, "web").await;
    assert!(result.is_err(), "{result:?}");
    assert!(w.get("web").await?.is_none(), "never re-created");
    assert_eq!(w.revisions().await?, vec!["sh.helm.release.v1.web.v1"]);
    Ok(())
}

// 11b.
#[tokio::test]
async fn a_recovery_whose_release_was_recreated_never_touches_the_new_one() -> Result<()> {
    let w = world("recreated").await?;
    w.stuck_release("web", &[(1, "uninstalling")]).await?;
    let ns = w.ns.name.clone();
    let client = w.client.clone();
    let reconciler = w.reconciler_pausing(Step::Acquired, move || {
        let client = client.clone();
        let ns = ns.clone();
        async move {
            let again = TestNamespace { name: ns, client };
            let releases = again.releases();
            releases
                .patch(
                    "web",
                    &PatchParams::default(),
                    &Patch::Merge(json!({"metadata": {"finalizers": null}})),
                )
                .await
                .unwrap();
            releases
                .delete("web", &DeleteParams::default())
                .await
                .unwrap();
            again.create_release("web", json!({})).await.unwrap();
        }
        .boxed()
    });

    let result = reconciler.reconcile(&w.ns.name, "web").await;
    assert!(result.is_err(), "{result:?}");
    let new = w.get("web").await?.unwrap();
    assert!(
        !new.metadata
            .managed_fields
            .iter()
            .flatten()
            .any(|e| e.manager.as_deref() == Some(FIELD_MANAGER))
    );
    assert!(new.metadata.finalizers.is_none());
    assert!(new.metadata.annotations.is_none());
    assert_eq!(w.revisions().await?, vec!["sh.helm.release.v1.web.v1"]);
    Ok(())
}

// 11c.
#[tokio::test]
async fn every_apply_carries_the_uid_and_resource_version_of_the_read_that_decided_it() -> Result<()>
{
    let w = world("audit").await?;
    w.stuck_release("web", &[(1, "uninstalling")]).await?;
    w.stuck_release("crashed", &[(1, "uninstalling")]).await?;
    w.leave_our_suspension("crashed").await?;
    // Only what the reconciler sends from here on counts (the setup above
    // writes as flux-plunger too).
    let offset = audit::mark();
    let r = w.reconciler();
    assert_eq!(
        r.reconcile(&w.ns.name, "web").await?,
        Outcome::Recovered { revision: 1 }
    );
    assert_eq!(
        r.reconcile(&w.ns.name, "crashed").await?,
        Outcome::Lifted { kept_fence: true }
    );

    // The audit log records every HelmRelease write with its body.
    let mut applies = Vec::new();
    testkit::eventually(
        Duration::from_secs(10),
        "the applies reach the audit log",
        || {
            let read = audited_applies(&w.ns.name, offset);
            if let Ok(read) = &read {
                applies.clone_from(read);
            }
            async move { Ok(read?.len() >= 3) }
        },
    )
    .await?;
    for body in &applies {
        let meta = &body["metadata"];
        assert!(
            meta["uid"].as_str().is_some_and(|u| !u.is_empty()),
            "{body}"
        );
        assert!(
            meta["resourceVersion"]
                .as_str()
                .is_some_and(|v| !v.is_empty()),
            "{body}"
        );
        let keys: Vec<&String> = body.as_object().unwrap().keys().collect();
        assert!(
            keys.iter()
                .all(|k| ["apiVersion", "kind", "metadata", "spec"].contains(&k.as_str())),
            "{body}"
        );
        let meta_keys: Vec<&String> = meta.as_object().unwrap().keys().collect();
        assert!(
            meta_keys.iter().all(|k| [
                "name",
                "namespace",
                "uid",
                "resourceVersion",
                "finalizers",
                "labels"
            ]
            .contains(&k.as_str())),
            "{body}"
        );
        // The fence's label goes exactly with the fence.
        let fence_label = json!({FENCE_LABEL: FENCE_LABEL_VALUE});
        let expected_labels = meta.get("finalizers").map(|_| &fence_label);
        assert_eq!(meta.get("labels"), expected_labels, "{body}");
        if let Some(spec) = body.get("spec") {
            assert_eq!(spec, &json!({"suspend": true}), "{body}");
        }
    }
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

// Operator controls (SPEC §9).

#[tokio::test]
async fn a_dry_run_decides_and_reports_but_writes_nothing() -> Result<()> {
    let w = world("dry-run").await?;
    w.stuck_release("stuck", &[(1, "superseded"), (2, "uninstalling")])
        .await?;
    w.stuck_release("crashed", &[(1, "uninstalling")]).await?;
    w.leave_our_suspension("crashed").await?;
    let before_stuck = w.get("stuck").await?.unwrap();
    let before_crashed = w.get("crashed").await?.unwrap();
    let reconciler = w.reconciler().with_controls(plunger::reconcile::Controls {
        dry_run: true,
        rate_limit: None,
    });

    let stuck = reconciler.reconcile(&w.ns.name, "stuck").await?;
    let crashed = reconciler.reconcile(&w.ns.name, "crashed").await?;

    assert!(
        matches!(&stuck, Outcome::DryRun { would } if would.contains("sh.helm.release.v1.stuck.v2")),
        "{stuck:?}"
    );
    assert!(
        matches!(&crashed, Outcome::DryRun { would } if would.contains("lift")),
        "{crashed:?}"
    );
    for before in [before_stuck, before_crashed] {
        let after = w
            .get(before.metadata.name.as_deref().unwrap())
            .await?
            .unwrap();
        assert_eq!(
            after.metadata.resource_version,
            before.metadata.resource_version
        );
    }
    assert_eq!(w.revisions().await?.len(), 3, "no Secret deleted");
    let events = w.ns.events_for("stuck").await?;
    assert!(
        events
            .iter()
            .any(|e| e.reason == "RecoveryDryRun" && e.note.contains("would suspend")),
        "{events:?}"
    );
    Ok(())
}

#[tokio::test]
async fn the_recovery_rate_limit_defers_recoveries_past_the_limit() -> Result<()> {
    let w = world("rate-limit").await?;
    w.stuck_release("first", &[(1, "uninstalling")]).await?;
    w.stuck_release("second", &[(1, "uninstalling")]).await?;
    let reconciler = w.reconciler().with_controls(plunger::reconcile::Controls {
        dry_run: false,
        rate_limit: plunger::ratelimit::RateLimiter::per_minute(1),
    });

    assert_eq!(
        reconciler.reconcile(&w.ns.name, "first").await?,
        Outcome::Recovered { revision: 1 }
    );
    let second = reconciler.reconcile(&w.ns.name, "second").await?;

    assert!(
        matches!(second, Outcome::RateLimited { retry_after } if retry_after > Duration::from_secs(50)),
        "{second:?}"
    );
    // Its recovery waits; the fence holds it meanwhile (SPEC §4.5).
    assert_waiting_fenced(&w.get("second").await?.unwrap());
    assert_eq!(w.revisions().await?, vec!["sh.helm.release.v1.second.v1"]);
    Ok(())
}

/// Item 2 of the hand-over: a stuck release deleted while its recovery
/// waits. helm-controller's deletion path finds the history it cleared empty
/// and lets go; the fence flux-plunger holds on the waiting release keeps
/// it, the history is handed over and a reconcile requested, and the
/// uninstall happens.
#[tokio::test]
async fn a_stuck_release_deleted_while_its_recovery_waits_is_held_and_uninstalled() -> Result<()> {
    let w = world("waiting-delete").await?;
    w.stuck_release("first", &[(1, "uninstalling")]).await?;
    w.stuck_release("second", &[(1, "superseded"), (2, "uninstalling")])
        .await?;
    let reconciler = w.reconciler().with_controls(plunger::reconcile::Controls {
        dry_run: false,
        rate_limit: plunger::ratelimit::RateLimiter::per_minute(1),
    });
    assert_eq!(
        reconciler.reconcile(&w.ns.name, "first").await?,
        Outcome::Recovered { revision: 1 }
    );
    assert!(matches!(
        reconciler.reconcile(&w.ns.name, "second").await?,
        Outcome::RateLimited { .. }
    ));

    w.delete("second").await?;
    assert_eq!(
        w.hc.handle("second").await?,
        Handled::NothingRecordedToUninstall
    );
    assert!(w.get("second").await?.is_some(), "the fence holds it");

    assert_eq!(
        reconciler.reconcile(&w.ns.name, "second").await?,
        Outcome::HandedOver { revision: 2 }
    );
    assert_eq!(w.hc.handle("second").await?, Handled::Uninstalled);
    assert_eq!(
        reconciler.reconcile(&w.ns.name, "second").await?,
        Outcome::FenceDropped
    );
    assert!(w.get("second").await?.is_none());
    assert!(!w.hc.resources_exist("second").await?);
    assert_handed_over(&w, "second", 2).await
}

/// The fence a stuck release carried while it waited goes when the storage
/// turns out to hold nothing to reclaim, and when the release is no longer
/// stuck; the drain lets go of it whatever the release's state.
#[tokio::test]
async fn the_fence_of_a_waiting_release_goes_once_nothing_is_to_be_recovered() -> Result<()> {
    let w = world("waiting-gone").await?;
    for name in ["deployed", "unstuck", "drained"] {
        w.stuck_release(name, &[(1, "uninstalling")]).await?;
        w.ns.apply_as_flux_plunger(name, false).await?;
        assert_waiting_fenced(&w.get(name).await?.unwrap());
    }
    // Helm wrote a good revision meanwhile: nothing to reclaim.
    w.ns.create_storage_secret("deployed", 2, "deployed")
        .await?;
    assert_eq!(
        w.reconciler().reconcile(&w.ns.name, "deployed").await?,
        Outcome::Skipped(SkipReason::LatestIsDeployed { latest: 2 })
    );
    assert_let_go(&w.get("deployed").await?.unwrap());

    w.ns.set_ready(
        "unstuck",
        "True",
        "UpgradeSucceeded",
        "Helm upgrade succeeded",
    )
    .await?;
    assert_eq!(
        w.reconciler().reconcile(&w.ns.name, "unstuck").await?,
        Outcome::FenceDropped
    );
    assert_let_go(&w.get("unstuck").await?.unwrap());

    assert_eq!(
        w.reconciler()
            .letting_go()
            .settle(&w.ns.name, "drained")
            .await?,
        Outcome::FenceDropped
    );
    assert_let_go(&w.get("drained").await?.unwrap());
    assert_eq!(
        w.revisions().await?,
        vec![
            "sh.helm.release.v1.deployed.v1",
            "sh.helm.release.v1.deployed.v2",
            "sh.helm.release.v1.drained.v1",
            "sh.helm.release.v1.unstuck.v1",
        ]
    );
    Ok(())
}

#[tokio::test]
async fn a_release_opted_out_by_its_annotation_is_never_recovered() -> Result<()> {
    let w = world("opt-out").await?;
    w.stuck_release("web", &[(1, "uninstalling")]).await?;
    w.ns.releases()
        .patch("web", &PatchParams::default(), &Patch::Merge(json!({"metadata": {"annotations": {"flux-plunger.cozystack.io/recover": "disabled"}}})))
        .await?;
    let before = w.get("web").await?.unwrap();

    assert_eq!(
        w.reconciler().reconcile(&w.ns.name, "web").await?,
        Outcome::NothingToDo
    );

    let after = w.get("web").await?.unwrap();
    assert_eq!(
        after.metadata.resource_version,
        before.metadata.resource_version
    );
    assert_eq!(w.revisions().await?, vec!["sh.helm.release.v1.web.v1"]);
    Ok(())
}

// Release identity (SPEC §9): the storage is where helm-controller put it.

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

#[tokio::test]
async fn the_storage_of_a_release_with_a_target_namespace_is_found_under_its_helm_name()
-> Result<()> {
    let w = world("identity-target").await?;
    stuck_elsewhere(
        &w,
        "web",
        json!({"targetNamespace": "prod"}),
        &w.ns,
        "prod-web",
    )
    .await?;

    assert_eq!(
        w.reconciler().reconcile(&w.ns.name, "web").await?,
        Outcome::Recovered { revision: 2 }
    );
    assert_eq!(
        secret_names(&w.ns).await?,
        vec![
            "sh.helm.release.v1.prod-web.v1",
            "sh.helm.release.v1.web.v9"
        ],
        "only the newest revision of prod-web went; the decoy under the HelmRelease's name stays"
    );
    Ok(())
}

#[tokio::test]
async fn the_storage_of_a_release_with_a_release_name_and_storage_namespace_is_found_there()
-> Result<()> {
    let w = world("identity-storage").await?;
    let storage = TestNamespace::create(&w.client, "identity-store").await?;
    stuck_elsewhere(
        &w,
        "web",
        json!({"releaseName": "custom", "storageNamespace": storage.name, "targetNamespace": "prod"}),
        &storage,
        "custom",
    )
    .await?;

    assert_eq!(
        w.reconciler().reconcile(&w.ns.name, "web").await?,
        Outcome::Recovered { revision: 2 }
    );
    assert_eq!(
        secret_names(&storage).await?,
        vec!["sh.helm.release.v1.custom.v1"]
    );
    assert_eq!(
        secret_names(&w.ns).await?,
        vec!["sh.helm.release.v1.web.v9"]
    );
    Ok(())
}

#[tokio::test]
async fn a_release_name_past_53_characters_is_shortened_as_helm_controller_does() -> Result<()> {
    let w = world("identity-long").await?;
    let target = "t".repeat(20);
    let name = "a-release-with-a-rather-long-name-indeed";
    let helm_name = plunger::storage::view::shorten_release_name(&format!("{target}-{name}"));
    assert_eq!(helm_name.len(), 53);
    stuck_elsewhere(
        &w,
        name,
        json!({"targetNamespace": target}),
        &w.ns,
        &helm_name,
    )
    .await?;

    assert_eq!(
        w.reconciler().reconcile(&w.ns.name, name).await?,
        Outcome::Recovered { revision: 2 }
    );
    assert!(
        !secret_names(&w.ns)
            .await?
            .contains(&format!("sh.helm.release.v1.{helm_name}.v2"))
    );
    Ok(())
}

#[tokio::test]
async fn where_status_and_spec_disagree_the_status_says_where_the_release_is() -> Result<()> {
    let w = world("identity-status").await?;
    let actual = TestNamespace::create(&w.client, "identity-actual").await?;
    stuck_elsewhere(
        &w,
        "web",
        json!({"releaseName": "from-spec"}),
        &actual,
        "recorded",
    )
    .await?;
    // helm-controller recorded where it actually installed the release.
    let history = json!([{
        "name": "recorded", "namespace": "prod", "version": 2, "status": "uninstalling",
        "chartName": "demo", "chartVersion": "1.0.0", "configDigest": "sha256:0", "digest": "sha256:0",
        "firstDeployed": "2026-01-01T00:00:00Z", "lastDeployed": "2026-01-01T00:00:00Z",
    }]);
    w.ns.releases()
        .patch_status(
            "web",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"storageNamespace": actual.name, "history": history}})),
        )
        .await?;

    assert_eq!(
        w.reconciler().reconcile(&w.ns.name, "web").await?,
        Outcome::Recovered { revision: 2 }
    );
    assert_eq!(
        secret_names(&actual).await?,
        vec!["sh.helm.release.v1.recorded.v1"]
    );
    Ok(())
}

#[tokio::test]
async fn a_deployed_newest_revision_is_never_deleted() -> Result<()> {
    let w = world("guard-deployed").await?;
    let before = w
        .stuck_release("web", &[(1, "superseded"), (2, "deployed")])
        .await?;

    assert_eq!(
        w.reconciler().reconcile(&w.ns.name, "web").await?,
        Outcome::Skipped(SkipReason::LatestIsDeployed { latest: 2 })
    );
    assert_eq!(w.revisions().await?.len(), 2);
    assert_eq!(
        w.get("web").await?.unwrap().metadata.resource_version,
        before.metadata.resource_version
    );
    Ok(())
}

#[tokio::test]
async fn events_are_posted_to_flux_notification_controller_in_its_format() -> Result<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let w = world("notify").await?;
    w.stuck_release("web", &[(1, "uninstalling")]).await?;
    // A notification-controller on loopback: answers 202 and keeps each body.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let address = format!("http://{}/", listener.local_addr()?);
    let (bodies_tx, mut bodies) = tokio::sync::mpsc::unbounded_channel::<Value>();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            let mut buffer = Vec::new();
            let mut chunk = [0u8; 4096];
            loop {
                let n = socket.read(&mut chunk).await.unwrap_or(0);
                if n == 0 {
                    break;
                }
                buffer.extend_from_slice(&chunk[..n]);
                let text = String::from_utf8_lossy(&buffer).to_string();
                if let Some((head, body)) = text.split_once("\r\n\r\n") {
                    let length: usize = head
                        .lines()
                        .find_map(|l| {
                            l.to_ascii_lowercase()
                                .strip_prefix("content-length:")
                                .map(|v| v.trim().parse().unwrap_or(0))
                        })
                        .unwrap_or(0);
                    if body.len() >= length {
                        assert!(head.starts_with("POST / HTTP/1.1"), "{head}");
                        bodies_tx
                            .send(serde_json::from_str(&body[..length]).unwrap())
                            .unwrap();
                        socket
                            .write_all(b"HTTP/1.1 202 Accepted\r\ncontent-length: 0\r\n\r\n")
                            .await
                            .unwrap();
                        buffer.clear();
                    }
                }
            }
        }
    });
    let events = Events::new(w.flux_plunger.clone(), "flux-plunger", Some("pod-a".into()))
        .forwarding_to(
            plunger::notify::Forwarder::new(&address, Some("pod-a".into()))
                .map_err(anyhow::Error::msg)?,
        );
    let reconciler = Reconciler::new(w.flux_plunger.clone(), events, Timings::default());

    assert_eq!(
        reconciler.reconcile(&w.ns.name, "web").await?,
        Outcome::Recovered { revision: 1 }
    );

    let body = tokio::time::timeout(Duration::from_secs(10), bodies.recv())
        .await?
        .expect("an event");
    assert_eq!(body["reason"], "Recovered");
    assert_eq!(body["severity"], "info");
    assert_eq!(body["reportingController"], "flux-plunger");
    assert_eq!(body["reportingInstance"], "pod-a");
    assert_eq!(body["involvedObject"]["kind"], "HelmRelease");
    assert_eq!(body["involvedObject"]["namespace"], w.ns.name.as_str());
    assert_eq!(body["involvedObject"]["name"], "web");
    assert!(
        body["message"]
            .as_str()
            .unwrap()
            .contains("reclaimed Helm storage revision 1")
    );
    assert!(body["timestamp"].as_str().unwrap().ends_with('Z'));
    Ok(())
}

// Remote clusters (SPEC §9): storage read and written where the release is installed.

/// Release `web` of `w`, installed in a remote cluster of its own
/// (`spec.kubeConfig`), stuck, with storage revisions of `revisions` there
/// and a decoy v2 in the local cluster, where the original looked. Returns
/// the remote cluster (running while it lives) and the namespace there.
async fn stuck_in_a_remote_cluster(
    w: &World,
    revisions: &[(u64, &str)],
) -> Result<(testkit::ControlPlane, TestNamespace)> {
    use k8s_openapi::api::core::v1::{Namespace, Secret};
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
    let kubeconfig: Secret = serde_json::from_value(json!({
        "metadata": {"name": "remote-kubeconfig"},
        "stringData": {"value.yaml": remote.kubeconfig_yaml(&testkit::control_plane::AuthInfo::AdminCertificate)},
    }))?;
    w.ns.secrets()
        .create(&PostParams::default(), &kubeconfig)
        .await?;
    w.ns.create_release(
        "web",
        json!({"kubeConfig": {"secretRef": {"name": "remote-kubeconfig"}}}),
    )
    .await?;
    w.hc.handle("web").await?;
    w.ns.mark_stuck("web").await?;
    Ok((remote, remote_ns))
}

#[tokio::test]
async fn a_release_in_a_remote_cluster_is_recovered_there() -> Result<()> {
    let w = world("remote").await?;
    let (_remote, remote_ns) =
        stuck_in_a_remote_cluster(&w, &[(1, "superseded"), (2, "uninstalling")]).await?;

    assert_eq!(
        w.reconciler().reconcile(&w.ns.name, "web").await?,
        Outcome::Recovered { revision: 2 }
    );

    assert_eq!(
        secret_names(&remote_ns).await?,
        vec!["sh.helm.release.v1.web.v1"]
    );
    assert!(
        secret_names(&w.ns)
            .await?
            .contains(&"sh.helm.release.v1.web.v2".to_owned()),
        "the local decoy stays"
    );
    assert_let_go(&w.get("web").await?.unwrap());
    Ok(())
}

/// A release in a remote cluster deleted during its recovery: the history
/// handed to helm-controller is the newest revision of the storage there
/// (not the local decoy), written to the status here.
#[tokio::test]
async fn a_release_in_a_remote_cluster_deleted_during_its_recovery_is_handed_over_from_the_storage_there()
-> Result<()> {
    let w = world("remote-handover").await?;
    let (_remote, remote_ns) =
        stuck_in_a_remote_cluster(&w, &[(1, "superseded"), (3, "uninstalling")]).await?;
    let releases = w.ns.releases();
    let hc = w.hc.clone();
    let reconciler = w.reconciler_pausing(Step::Acquired, move || {
        let (releases, hc) = (releases.clone(), hc.clone());
        async move {
            releases
                .delete("web", &DeleteParams::default())
                .await
                .unwrap();
            assert_eq!(
                hc.handle("web").await.unwrap(),
                Handled::UninstallSkippedBecauseSuspended
            );
        }
        .boxed()
    });

    // The annotation meets the delete's new resourceVersion: the undo hands
    // the release over and lifts the suspension, keeping the fence.
    assert_eq!(
        reconciler.reconcile(&w.ns.name, "web").await?,
        Outcome::HandedOver { revision: 3 }
    );

    let handed = w.ns.releases().get("web").await?;
    let history = &handed.data["status"]["history"];
    assert_eq!(history.as_array().map(Vec::len), Some(1), "{history}");
    assert_eq!(history[0]["version"], 3, "the remote revision: {history}");
    assert_eq!(history[0]["name"], "web");
    let view = ReleaseView::from_object(&handed);
    assert!(!view.suspend && view.has_fence());
    assert_handed_over(&w, "web", 3).await?;
    assert_eq!(
        secret_names(&remote_ns).await?,
        vec!["sh.helm.release.v1.web.v1", "sh.helm.release.v1.web.v3"],
        "nothing deleted there"
    );
    testkit::strip_fences(&w.ns).await?;
    Ok(())
}

#[tokio::test]
async fn a_remote_cluster_that_cannot_be_used_is_skipped_with_a_warning() -> Result<()> {
    use k8s_openapi::api::core::v1::Secret;
    use kube::api::PostParams;
    let w = world("remote-bad").await?;
    let exec: Secret = serde_json::from_value(json!({
        "metadata": {"name": "exec-kubeconfig"},
        "stringData": {"value": "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: https://eks.example:443\ncontexts:\n- name: c\n  context: {cluster: c, user: u}\ncurrent-context: c\nusers:\n- name: u\n  user:\n    exec:\n      apiVersion: client.authentication.k8s.io/v1\n      command: aws\n"},
    }))?;
    w.ns.secrets().create(&PostParams::default(), &exec).await?;
    for (name, secret) in [("missing", "no-such-secret"), ("exec", "exec-kubeconfig")] {
        w.ns.create_release(name, json!({"kubeConfig": {"secretRef": {"name": secret}}}))
            .await?;
        w.hc.handle(name).await?;
        w.ns.create_storage_secret(name, 1, "uninstalling").await?;
        w.ns.mark_stuck(name).await?;
        let before = w.get(name).await?.unwrap();

        let outcome = w.reconciler().reconcile(&w.ns.name, name).await;

        if name == "missing" {
            // It may yet be created, which wakes nothing: retried.
            let err = outcome.expect_err("a missing Secret is retried");
            assert_eq!(err.kind(), "read_kubeconfig", "{err}");
        } else {
            assert!(
                matches!(
                    &outcome,
                    Ok(Outcome::Skipped(SkipReason::RemoteClusterUnusable { .. }))
                ),
                "{name}: {outcome:?}"
            );
        }
        assert_eq!(
            w.get(name).await?.unwrap().metadata.resource_version,
            before.metadata.resource_version,
            "{name}"
        );
        let events = w.ns.events_for(name).await?;
        let expected = if name == "exec" {
            "exec plugin"
        } else {
            "does not exist"
        };
        assert!(
            events.iter().any(|e| e.reason == "RemoteClusterUnusable"
                && e.type_ == "Warning"
                && e.note.contains(expected)),
            "{name}: {events:?}"
        );
    }
    assert_eq!(
        w.revisions()
            .await?
            .iter()
            .filter(|s| s.starts_with("sh.helm"))
            .count(),
        2
    );
    Ok(())
}

#[tokio::test]
async fn a_revision_made_later_under_the_number_below_is_told_from_the_one_that_was_there()
-> Result<()> {
    let w = world("guard-uid").await?;
    w.stuck_release("web", &[(1, "superseded"), (2, "uninstalling")])
        .await?;
    let r = w.reconciler();
    assert_eq!(
        r.reconcile(&w.ns.name, "web").await?,
        Outcome::Recovered { revision: 2 }
    );
    let v1 = w.ns.secrets().get("sh.helm.release.v1.web.v1").await?;
    let annotations = w.get("web").await?.unwrap().metadata.annotations.unwrap();
    assert_eq!(
        annotations["flux-plunger.cozystack.io/last-processed-below-uid"],
        v1.metadata.uid.clone().unwrap()
    );

    // Still stuck before helm-controller retries: v1 is the revision that was below.
    w.ns.mark_stuck("web").await?;
    assert!(matches!(
        r.reconcile(&w.ns.name, "web").await?,
        Outcome::Skipped(SkipReason::AlreadyProcessed { .. })
    ));

    // The history is replaced: a new v1 under the same number, stuck again.
    w.ns.secrets()
        .delete("sh.helm.release.v1.web.v1", &DeleteParams::default())
        .await?;
    w.ns.create_storage_secret("web", 1, "uninstalling").await?;
    assert_eq!(
        r.reconcile(&w.ns.name, "web").await?,
        Outcome::Recovered { revision: 1 }
    );
    assert!(w.revisions().await?.is_empty());
    Ok(())
}

#[tokio::test]
async fn a_storage_secret_rewritten_after_the_listing_is_never_deleted() -> Result<()> {
    let w = world("secret-preconditions").await?;
    w.stuck_release("web", &[(1, "uninstalling")]).await?;
    let secrets = w.ns.secrets();
    let reconciler = w.reconciler_pausing(Step::Annotated, move || {
        let secrets = secrets.clone();
        async move {
            // Helm rewrites the revision between our listing and our delete.
            secrets
                .patch(
                    "sh.helm.release.v1.web.v1",
                    &PatchParams::default(),
                    &Patch::Merge(json!({"metadata": {"labels": {"status": "deployed"}}})),
                )
                .await
                .unwrap();
        }
        .boxed()
    });

    let err = reconciler.reconcile(&w.ns.name, "web").await.unwrap_err();

    assert_eq!(err.kind(), "delete_storage", "{err}");
    assert!(
        err.is_stale_write(),
        "refused by its resourceVersion precondition: {err}"
    );
    assert_eq!(w.revisions().await?, vec!["sh.helm.release.v1.web.v1"]);
    assert_waiting_fenced(&w.get("web").await?.unwrap());
    // The retry finds a deployed revision: nothing to reclaim, no fence.
    assert_eq!(
        w.reconciler().reconcile(&w.ns.name, "web").await?,
        Outcome::Skipped(SkipReason::LatestIsDeployed { latest: 1 })
    );
    assert_let_go(&w.get("web").await?.unwrap());
    Ok(())
}

/// helm-controller writes status right after each suspension; a recovery that
/// meets it reads again and carries on, once, instead of undoing and retrying.
#[tokio::test]
async fn a_status_write_by_helm_controller_mid_recovery_is_read_through_not_undone() -> Result<()> {
    let w = world("status-race").await?;
    for (name, step) in [
        ("at-annotation", Step::Acquired),
        ("at-lift", Step::BeforeLift),
    ] {
        w.stuck_release(name, &[(1, "superseded"), (2, "uninstalling")])
            .await?;
        let hc = w.hc.clone();
        let target = name.to_owned();
        let reconciler = w.reconciler_pausing(step, move || {
            let hc = hc.clone();
            let target = target.clone();
            async move {
                // helm-controller's suspended pass: observedGeneration written.
                assert_eq!(hc.handle(&target).await.unwrap(), Handled::SkippedSuspended);
            }
            .boxed()
        });
        let offset = audit::mark();

        assert_eq!(
            reconciler.reconcile(&w.ns.name, name).await?,
            Outcome::Recovered { revision: 2 },
            "{name}"
        );

        assert_let_go(&w.get(name).await?.unwrap());
        assert!(
            w.ns.events_for(name)
                .await?
                .iter()
                .any(|e| e.reason == "Recovered"),
            "{name}"
        );
        let suspensions = audited_applies(&w.ns.name, offset)?
            .iter()
            .filter(|b| b["metadata"]["name"] == name && b["spec"]["suspend"] == true)
            .count();
        assert_eq!(
            suspensions, 1,
            "{name}: suspended once, not undone and retried"
        );
    }
    Ok(())
}

// A fence another field manager also lists (a backup restore, a hand edit, a
// re-applied manifest): `metadata.finalizers` is a set, so an apply leaving
// the fence out gives up only flux-plunger's claim on it.

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

/// The guarded patch that removes another manager's copy of the fence, once
/// refused for a reason no re-read cures (here an admission policy), is
/// reported as a Warning `FenceRemovalFailed` and retried; the retry removes
/// the copy once the refusal is gone.
#[tokio::test]
async fn a_copy_of_the_fence_that_cannot_be_removed_is_reported_and_retried() -> Result<()> {
    let w = world("foreign-fence-refused").await?;
    installed(&w, "web").await?;
    add_fence_as(&w, "web", "kubectl-patch").await?;
    w.ns.apply_as_flux_plunger("web", false).await?;
    let refusal = w
        .ns
        .refuse(
            "keep-the-fence",
            json!({"apiGroups": ["helm.toolkit.fluxcd.io"], "apiVersions": ["*"], "operations": ["UPDATE"], "resources": ["helmreleases"]}),
            &format!(
                "!has(oldObject.metadata.finalizers) || !('{FENCE_FINALIZER}' in oldObject.metadata.finalizers) \
                 || (has(object.metadata.finalizers) && '{FENCE_FINALIZER}' in object.metadata.finalizers)"
            ),
            "test: the fence may not be removed",
        )
        .await?;
    testkit::eventually(
        Duration::from_secs(30),
        "the admission policy refuses the fence's removal",
        || {
            let releases = w.ns.releases();
            async move {
                let params = PatchParams {
                    dry_run: true,
                    ..Default::default()
                };
                let drop =
                    Patch::Merge(json!({"metadata": {"finalizers": [HELM_CONTROLLER_FINALIZER]}}));
                Ok(releases.patch("web", &params, &drop).await.is_err())
            }
        },
    )
    .await?;

    let err = w
        .reconciler()
        .reconcile(&w.ns.name, "web")
        .await
        .expect_err("the copy cannot be removed");

    assert!(!err.is_stale_write(), "{err}");
    assert!(w.view("web").await?.has_fence());
    let events = w.ns.events_for("web").await?;
    assert!(
        events.iter().any(|e| e.reason == "FenceRemovalFailed"
            && e.type_ == "Warning"
            && e.note.contains("test: the fence may not be removed")),
        "{events:?}"
    );

    refusal.lift().await?;
    testkit::eventually(
        Duration::from_secs(30),
        "the retry removes the copy",
        || async {
            Ok(matches!(
                w.reconciler().reconcile(&w.ns.name, "web").await,
                Ok(Outcome::FenceDropped | Outcome::NothingToDo)
            ) && !w.view("web").await?.has_fence())
        },
    )
    .await?;
    Ok(())
}

#[tokio::test]
async fn a_fence_another_manager_also_lists_on_a_live_release_is_removed() -> Result<()> {
    let w = world("foreign-fence-live").await?;
    installed(&w, "web").await?;
    add_fence_as(&w, "web", "kubectl-patch").await?;
    w.ns.apply_as_flux_plunger("web", false).await?;
    let offset = audit::mark();

    let outcome = w.reconciler().reconcile(&w.ns.name, "web").await?;

    assert_eq!(outcome, Outcome::FenceDropped);
    assert_eq!(
        w.view("web").await?.finalizers,
        vec![HELM_CONTROLLER_FINALIZER]
    );
    // The copy another manager held went by the guarded JSON patch, pinned
    // to what the apply returned.
    let patches: Vec<_> = audit::read_since(offset)?
        .into_iter()
        .filter(|r| r.resource() == "helmreleases" && r.is_write())
        .filter(|r| r.namespace.as_deref() == Some(w.ns.name.as_str()))
        .map(|r| (r.field_manager().unwrap_or("-").to_owned(), r.succeeded()))
        .collect();
    assert_eq!(
        patches,
        vec![
            ("flux-plunger".to_owned(), true),
            ("flux-plunger-patch".to_owned(), true)
        ]
    );
    Ok(())
}

#[tokio::test]
async fn a_fence_only_another_manager_lists_goes_once_helm_controller_has_uninstalled() -> Result<()>
{
    let w = world("foreign-fence-deleted").await?;
    installed(&w, "web").await?;
    add_fence_as(&w, "web", "kubectl-patch").await?;
    w.delete("web").await?;
    assert_eq!(w.hc.handle("web").await?, Handled::Uninstalled);

    let outcome = w.reconciler().reconcile(&w.ns.name, "web").await?;

    assert_eq!(outcome, Outcome::FenceDropped);
    assert!(w.get("web").await?.is_none(), "the release went");
    Ok(())
}

#[tokio::test]
async fn our_suspension_under_a_fence_another_manager_also_lists_is_lifted_with_the_fence()
-> Result<()> {
    let w = world("foreign-fence-ours").await?;
    installed(&w, "web").await?;
    add_fence_as(&w, "web", "kubectl-patch").await?;
    w.leave_our_suspension("web").await?;

    let outcome = w.reconciler().reconcile(&w.ns.name, "web").await?;

    assert_eq!(outcome, Outcome::Lifted { kept_fence: false });
    let after = w.get("web").await?.unwrap();
    assert_let_go(&after);
    assert_eq!(
        ReleaseView::from_object(&after).finalizers,
        vec![HELM_CONTROLLER_FINALIZER]
    );
    Ok(())
}

#[tokio::test]
async fn a_fence_listed_twice_on_a_deleted_release_lets_the_suspension_go_and_keeps_both_copies()
-> Result<()> {
    let w = world("fence-twice").await?;
    installed(&w, "web").await?;
    w.leave_our_suspension("web").await?;
    add_second_fence_as(&w, "web", "kubectl-patch").await?;
    w.delete("web").await?;
    assert_eq!(
        w.hc.handle("web").await?,
        Handled::UninstallSkippedBecauseSuspended
    );
    // What the apiserver does with it: the apply that keeps the fence and
    // lifts the suspension is refused, another manager owning a copy.
    let view = w.view("web").await?;
    let refused = plunger::apply::apply(&w.client, &view, plunger::apply::Claim::FENCE_ONLY, false)
        .await
        .expect_err("the fence listed twice refuses the apply");
    assert!(
        plunger::error::is_field_manager_conflict(&refused),
        "{refused}"
    );

    let lifted = w.reconciler().reconcile(&w.ns.name, "web").await?;

    assert_eq!(lifted, Outcome::Lifted { kept_fence: true });
    let held = w.view("web").await?;
    assert!(!held.suspend, "the suspension is lifted");
    assert_eq!(
        held.finalizers,
        vec![FENCE_FINALIZER, FENCE_FINALIZER],
        "every copy of the fence stays"
    );
    assert!(
        w.ns.events_for("web")
            .await?
            .iter()
            .all(|e| e.reason != "UnsuspendFailed")
    );
    // helm-controller now uninstalls the unsuspended release; then both
    // copies of the fence go.
    assert_eq!(w.hc.handle("web").await?, Handled::Uninstalled);
    assert_eq!(
        w.reconciler().reconcile(&w.ns.name, "web").await?,
        Outcome::FenceDropped
    );
    assert!(w.get("web").await?.is_none(), "the release went");
    assert!(!w.hc.resources_exist("web").await?, "uninstalled");
    Ok(())
}

#[tokio::test]
async fn a_fence_listed_twice_under_a_shared_suspension_is_reported_not_retried_in_silence()
-> Result<()> {
    let w = world("fence-twice-shared").await?;
    installed(&w, "web").await?;
    w.leave_our_suspension("web").await?;
    w.suspend_as("web", "migration", true).await?;
    add_second_fence_as(&w, "web", "kubectl-patch").await?;
    w.delete("web").await?;

    let err = w
        .reconciler()
        .reconcile(&w.ns.name, "web")
        .await
        .expect_err("neither an apply nor a patch may lift a co-owned suspension");

    assert!(!err.is_stale_write(), "{err}");
    let held = w.view("web").await?;
    assert!(held.suspend, "the co-owner's suspension stays");
    assert_eq!(held.fence_indices().len(), 2);
    assert!(
        w.ns.events_for("web")
            .await?
            .iter()
            .any(|e| e.reason == "UnsuspendFailed" && e.type_ == "Warning"),
        "an operator hears about it"
    );
    testkit::strip_fences(&w.ns).await?;
    Ok(())
}

// Only what the real helm-controller leaves stuck is reclaimed.

#[tokio::test]
async fn an_upgrade_in_flight_after_a_recovery_is_never_reclaimed() -> Result<()> {
    let w = world("in-flight").await?;
    w.stuck_release("web", &[(1, "superseded"), (2, "uninstalling")])
        .await?;
    let r = w.reconciler();
    assert_eq!(
        r.reconcile(&w.ns.name, "web").await?,
        Outcome::Recovered { revision: 2 }
    );
    // helm-controller starts its upgrade: Helm writes the new revision under
    // the number just reclaimed, pending until it is done. A pass that read
    // the release before helm-controller cleared its stuck condition lists
    // the storage now.
    w.ns.create_storage_secret("web", 2, "pending-upgrade")
        .await?;
    let before = w.revisions().await?;

    let outcome = r.reconcile(&w.ns.name, "web").await?;

    assert_eq!(
        outcome,
        Outcome::Skipped(SkipReason::StatusDoesNotExplain {
            latest: 2,
            status: "pending-upgrade".into()
        })
    );
    assert_eq!(w.revisions().await?, before, "the upgrade's revision stays");
    assert_let_go(&w.get("web").await?.unwrap());
    Ok(())
}

#[tokio::test]
async fn a_release_no_longer_stuck_when_read_again_before_the_acquire_is_not_recovered()
-> Result<()> {
    let w = world("unstuck").await?;
    w.stuck_release("web", &[(1, "superseded"), (2, "uninstalling")])
        .await?;
    let ns = w.ns.name.clone();
    let client = w.client.clone();
    let reconciler = w.reconciler_pausing(Step::Planned, move || {
        let (ns, client) = (ns.clone(), client.clone());
        async move {
            // helm-controller's next pass starts and clears the condition.
            TestNamespace { name: ns, client }
                .set_ready(
                    "web",
                    "Unknown",
                    "Progressing",
                    "Reconciliation in progress",
                )
                .await
                .unwrap();
        }
        .boxed()
    });
    let before = w.revisions().await?;

    let outcome = reconciler.reconcile(&w.ns.name, "web").await?;

    assert_eq!(outcome, Outcome::Skipped(SkipReason::NoLongerStuck));
    assert_eq!(w.revisions().await?, before);
    let after = w.get("web").await?.unwrap();
    assert_let_go(&after);
    assert!(
        !ReleaseView::from_object(&after).carries_processed_annotation(),
        "nothing written"
    );
    Ok(())
}

// What a recovery says, and what it leaves to do, when the release changed
// under its final lift.

#[tokio::test]
async fn a_delete_landing_after_the_secret_delete_leaves_the_fence_re_checked_on_a_timer()
-> Result<()> {
    let w = world("late-delete").await?;
    w.stuck_release("web", &[(1, "superseded"), (2, "uninstalling")])
        .await?;
    let releases = w.ns.releases();
    let hc = w.hc.clone();
    let reconciler = w.reconciler_pausing(Step::AfterDeleteStorage, move || {
        let (releases, hc) = (releases.clone(), hc.clone());
        async move {
            releases
                .delete("web", &DeleteParams::default())
                .await
                .unwrap();
            // helm-controller meets the suspended delete, then stays down.
            assert_eq!(
                hc.handle("web").await.unwrap(),
                Handled::UninstallSkippedBecauseSuspended
            );
        }
        .boxed()
    });

    let outcome = reconciler.reconcile(&w.ns.name, "web").await?;

    assert_eq!(
        outcome,
        Outcome::RecoveredThenDeleted {
            revision: 2,
            recheck: Timings::default().fence_recheck_interval
        }
    );
    assert_eq!(outcome.recheck_after(), Some(Duration::from_secs(60)));
    let held = w.view("web").await?;
    assert!(held.terminating && held.has_fence() && !held.suspend);
    let events = w.ns.events_for("web").await?;
    assert!(
        events.iter().any(|e| e.reason == "Recovered"
            && e.note.ends_with(
                "it was deleted meanwhile: the uninstall fence holds it until helm-controller has uninstalled it"
            )),
        "{events:?}"
    );
    testkit::strip_fences(&w.ns).await?;
    Ok(())
}

#[tokio::test]
async fn a_recovery_whose_release_another_manager_still_suspends_says_so() -> Result<()> {
    let w = world("recovered-co-owned").await?;
    w.stuck_release("web", &[(1, "superseded"), (2, "uninstalling")])
        .await?;
    let releases = w.ns.releases();
    let reconciler = w.reconciler_pausing(Step::Acquired, move || {
        let releases = releases.clone();
        async move {
            // A migration applies the same suspension: it co-owns it now.
            let body = json!({"apiVersion": HELMRELEASE_API_VERSION, "kind": HELMRELEASE_KIND,
                "metadata": {"name": "web"}, "spec": {"suspend": true}});
            releases
                .patch("web", &PatchParams::apply("migration"), &Patch::Apply(body))
                .await
                .unwrap();
        }
        .boxed()
    });

    assert_eq!(
        reconciler.reconcile(&w.ns.name, "web").await?,
        Outcome::Recovered { revision: 2 }
    );

    let after = w.view("web").await?;
    assert!(
        after.suspend && !after.suspend_owned_by_us(),
        "the migration's"
    );
    assert!(!after.has_fence());
    let notes: Vec<String> =
        w.ns.events_for("web")
            .await?
            .into_iter()
            .filter(|e| e.reason == "Recovered")
            .map(|e| e.note)
            .collect();
    assert_eq!(notes.len(), 1, "{notes:?}");
    assert!(
        notes[0].ends_with("it stays suspended by another manager, who also suspended it meanwhile: helm-controller upgrades it once that suspension is lifted"),
        "{notes:?}"
    );
    Ok(())
}

// Remote clusters: a kubeconfig Secret that could not be read is retried.

#[tokio::test]
async fn a_kubeconfig_secret_that_cannot_be_read_is_retried_not_called_unusable() -> Result<()> {
    use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
    use kube::api::{Api, PostParams};
    let w = world("remote-unreadable").await?;
    w.ns.create_release(
        "web",
        json!({"kubeConfig": {"secretRef": {"name": "remote-kubeconfig"}}}),
    )
    .await?;
    w.hc.handle("web").await?;
    w.ns.create_storage_secret("web", 1, "uninstalling").await?;
    w.ns.mark_stuck("web").await?;
    // flux-plunger's identity may read releases but, for now, no Secret: the
    // read fails, as it would while the apiserver is unreachable.
    let role: Role = serde_json::from_value(json!({
        "metadata": {"name": "plunger"},
        "rules": [
            {"apiGroups": ["helm.toolkit.fluxcd.io"], "resources": ["helmreleases"], "verbs": ["get", "list", "patch"]},
            {"apiGroups": ["events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch"]},
        ],
    }))?;
    Api::<Role>::namespaced(w.client.clone(), &w.ns.name)
        .create(&PostParams::default(), &role)
        .await?;
    let binding: RoleBinding = serde_json::from_value(json!({
        "metadata": {"name": "plunger"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "plunger"},
        "subjects": [{"kind": "ServiceAccount", "name": "plunger", "namespace": w.ns.name}],
    }))?;
    Api::<RoleBinding>::namespaced(w.client.clone(), &w.ns.name)
        .create(&PostParams::default(), &binding)
        .await?;
    let client = control_plane()
        .service_account_client(&w.client, &w.ns.name, "plunger")
        .await?;
    let reconciler = Reconciler::new(
        client.clone(),
        Events::new(client, "flux-plunger", None),
        Timings::default(),
    );
    let before = w.get("web").await?.unwrap();

    let err = reconciler
        .reconcile(&w.ns.name, "web")
        .await
        .expect_err("an unreadable Secret is an error, retried with backoff");

    assert_eq!(err.kind(), "read_kubeconfig", "{err}");
    assert_eq!(err.api_code(), Some(403), "{err}");
    assert_eq!(
        w.get("web").await?.unwrap().metadata.resource_version,
        before.metadata.resource_version,
        "nothing written"
    );
    assert!(
        w.ns.events_for("web")
            .await?
            .iter()
            .all(|e| e.reason != "RemoteClusterUnusable"),
        "not called unusable"
    );
    Ok(())
}

// One warning per release per interval, and nothing remembered beyond it.

#[tokio::test]
async fn fence_warnings_are_forgotten_once_their_interval_has_passed() -> Result<()> {
    let w = world("fence-warnings").await?;
    let interval = Duration::from_secs(1);
    let reconciler = Reconciler::new(
        w.client.clone(),
        Events::new(w.client.clone(), "flux-plunger", None),
        Timings {
            fence_recheck_interval: interval,
            fence_held_warning_after: Duration::ZERO,
            ..Timings::default()
        },
    );
    for name in ["first", "second"] {
        // Deleted and fenced; helm-controller has not handled the delete.
        installed(&w, name).await?;
        w.ns.apply_as_flux_plunger(name, false).await?;
        w.delete(name).await?;
    }

    assert!(matches!(
        reconciler.reconcile(&w.ns.name, "first").await?,
        Outcome::FenceHeld { .. }
    ));
    assert_eq!(reconciler.remembered_fence_warnings(), 1);
    // The first warning's interval passes.
    tokio::time::sleep(interval + Duration::from_millis(100)).await;
    assert!(matches!(
        reconciler.reconcile(&w.ns.name, "second").await?,
        Outcome::FenceHeld { .. }
    ));

    assert_eq!(
        reconciler.remembered_fence_warnings(),
        1,
        "only the second release's warning is remembered"
    );
    let warned = |name: &'static str| {
        let ns = &w.ns;
        async move {
            Ok::<_, anyhow::Error>(
                ns.events_for(name)
                    .await?
                    .iter()
                    .any(|e| e.reason == "UninstallFenceHeld"),
            )
        }
    };
    assert!(warned("first").await? && warned("second").await?);
    testkit::strip_fences(&w.ns).await?;
    Ok(())
}
