//! Writers racing a recovery: the acquire against foreign suspensions, a delete landing at each
//! step, a release vanished or re-created, every write locked on the read that decided it.

use super::*;

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

#[tokio::test]
async fn a_forced_acquire_refused_while_the_release_stays_stuck_is_retried_not_deferred()
-> Result<()> {
    let w = world("force-raced").await?;
    w.stuck_release("web", &[(1, "uninstalling")]).await?;
    // An owner of `false` makes the unforced acquire conflict.
    w.update_suspend_as("web", "velero", false).await?;
    let releases = w.ns.releases();
    // A write that changes nothing of interest (no suspension, no delete,
    // still stuck) refuses the forced apply's lock.
    let reconciler = w.reconciler_pausing(Step::BeforeForcedAcquire, move || {
        let releases = releases.clone();
        async move {
            releases
                .patch(
                    "web",
                    &PatchParams::default(),
                    &Patch::Merge(
                        json!({"metadata": {"annotations": {"backup.example/last": "now"}}}),
                    ),
                )
                .await
                .unwrap();
        }
        .boxed()
    });

    let error = reconciler
        .reconcile(&w.ns.name, "web")
        .await
        .expect_err("a raced write is an error, retried after its backoff");
    assert!(error.is_stale_write(), "{error}");
    let after = w.get("web").await?.unwrap();
    assert!(!we_own_anything(&after), "nothing taken");
    assert!(
        !w.ns
            .events_for("web")
            .await?
            .iter()
            .any(|e| e.reason == "RecoveryDeferred"),
        "nobody else suspended it: nothing was deferred"
    );

    let outcome = w.reconciler().reconcile(&w.ns.name, "web").await?;
    assert_eq!(outcome, Outcome::Recovered { revision: 1 });
    assert_let_go(&w.get("web").await?.unwrap());
    Ok(())
}

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
        let fence_label = json!({FENCE_LABEL: LEGACY_FENCE_LABEL_VALUE});
        let expected_labels = meta.get("finalizers").map(|_| &fence_label);
        assert_eq!(meta.get("labels"), expected_labels, "{body}");
        if let Some(spec) = body.get("spec") {
            assert_eq!(spec, &json!({"suspend": true}), "{body}");
        }
    }
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
