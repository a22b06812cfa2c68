//! The recovery itself (SPEC §4): exactly the newest revision reclaimed, the processed guard, a
//! step that fails undone, and only the statuses helm-controller leaves stuck.

use super::*;

/// Waits until a new admission policy is in force (the apiserver syncs it
/// asynchronously): until `write`, a dry-run of what it refuses, is refused.
async fn until_refused<F, Fut, T>(what: &str, write: F) -> Result<()>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = kube::Result<T>>,
{
    testkit::eventually(Duration::from_secs(30), what, || {
        let write = write();
        async move { Ok(write.await.is_err()) }
    })
    .await
}

/// One pass over `name` that a refusal makes fail: its error names the step.
async fn refused_pass(w: &World, name: &str) -> plunger::error::Error {
    w.reconciler()
        .reconcile(&w.ns.name, name)
        .await
        .expect_err("the refused step fails the pass")
}

/// Passes over `name` until one recovers `revision`: a lifted refusal, like a
/// new one, takes a moment to reach the apiserver's admission.
async fn recovered_on_retry(w: &World, name: &str, revision: u64) -> Result<()> {
    testkit::eventually(
        Duration::from_secs(30),
        "the retry recovers the release",
        || async {
            Ok(matches!(
                w.reconciler().reconcile(&w.ns.name, name).await,
                Ok(Outcome::Recovered { revision: r }) if r == revision
            ))
        },
    )
    .await
}

/// `name` stuck with v1 superseded and v2 uninstalling, and v2 reclaimed by
/// one pass of the reconciler returned: what comes after a recovery starts here.
async fn recovered_once(w: &World, name: &str) -> Result<Reconciler> {
    w.stuck_release(name, &[(1, "superseded"), (2, "uninstalling")])
        .await?;
    let r = w.reconciler();
    assert_eq!(
        r.reconcile(&w.ns.name, name).await?,
        Outcome::Recovered { revision: 2 }
    );
    Ok(r)
}

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
    let releases = w.ns.releases();
    let dry_run = PatchParams::default().dry_run();
    let probe =
        Patch::Merge(json!({"metadata": {"annotations": {PROCESSED_VERSION_ANNOTATION: "0"}}}));
    until_refused("the admission policy refuses the annotation", || {
        releases.patch("web", &dry_run, &probe)
    })
    .await?;

    let err = refused_pass(&w, "web").await;
    assert_eq!(err.kind(), "annotate", "{err}");
    // Still stuck: the fence stays for the retry (SPEC §4.5, §4.9).
    assert_waiting_fenced(&w.get("web").await?.unwrap());
    assert_eq!(w.revisions().await?, vec!["sh.helm.release.v1.web.v1"]);

    refusal.lift().await?;
    recovered_on_retry(&w, "web", 1).await?;
    assert!(w.revisions().await?.is_empty());
    assert_let_go(&w.get("web").await?.unwrap());
    Ok(())
}

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
    let secrets = w.ns.secrets();
    let dry_run = DeleteParams::default().dry_run();
    until_refused("the admission policy refuses Secret deletes", || {
        secrets.delete("sh.helm.release.v1.probe.v1", &dry_run)
    })
    .await?;

    let err = refused_pass(&w, "web").await;
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
    recovered_on_retry(&w, "web", 1).await?;
    assert!(
        !w.revisions()
            .await?
            .contains(&"sh.helm.release.v1.web.v1".to_owned())
    );
    Ok(())
}

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
async fn a_revision_made_later_under_the_number_below_is_told_from_the_one_that_was_there()
-> Result<()> {
    let w = world("guard-uid").await?;
    let r = recovered_once(&w, "web").await?;
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

// Only what the real helm-controller leaves stuck is reclaimed.

#[tokio::test]
async fn an_upgrade_in_flight_after_a_recovery_is_never_reclaimed() -> Result<()> {
    let w = world("in-flight").await?;
    let r = recovered_once(&w, "web").await?;
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

/// The newest revision's delete is held by a finalizer (an admission
/// controller, a backup tool, or the tenant who wrote it): it stays listed,
/// `Terminating`. flux-plunger never deletes it again, not even once, and a
/// second pass does not either: no reclaim repeats for ever.
#[tokio::test]
async fn a_storage_secret_whose_delete_is_held_is_not_deleted_again() -> Result<()> {
    const HOLD: &str = "example.com/hold";
    let w = world("held-storage").await?;
    w.stuck_release("web", &[(1, "deployed"), (2, "uninstalling")])
        .await?;
    let held = "sh.helm.release.v1.web.v2";
    let secrets = w.ns.secrets();
    secrets
        .patch(
            held,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"finalizers": [HOLD]}})),
        )
        .await?;
    secrets.delete(held, &DeleteParams::default()).await?;
    let offset = audit::mark();

    for _ in 0..2 {
        let outcome = w.reconciler().reconcile(&w.ns.name, "web").await?;
        assert!(
            matches!(outcome, Outcome::Skipped(_)),
            "nothing left to reclaim: {outcome:?}"
        );
    }

    // Each pass lists the storage, then decides: once both listings are
    // logged, so is anything either pass sent to the storage.
    audited(&w.ns.name, offset, 2, |r| {
        r.verb == "list" && r.resource() == "secrets"
    })
    .await?;
    let deletes = audit::read_since(offset)?
        .into_iter()
        .filter(|r| r.namespace.as_deref() == Some(w.ns.name.as_str()))
        .filter(|r| r.verb == "delete" && r.resource() == "secrets")
        .map(|r| r.label())
        .collect::<Vec<_>>();
    assert!(
        deletes.is_empty(),
        "no delete of a Secret being deleted: {deletes:?}"
    );
    let listed = secrets.get(held).await?;
    assert!(listed.metadata.deletion_timestamp.is_some());
    assert_eq!(
        w.revisions().await?,
        vec!["sh.helm.release.v1.web.v1", held],
        "the revision below is kept"
    );
    secrets
        .patch(
            held,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"finalizers": null}})),
        )
        .await?;
    Ok(())
}
