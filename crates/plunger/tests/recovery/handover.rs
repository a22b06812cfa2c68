//! A release deleted with an empty history (SPEC §5a, §5d): the hand-over of the newest live
//! revision to helm-controller, and what lets the fence go.

use super::*;

/// The bounds on what reading a payload may cost (SPEC §3, §5a) leave room for the largest one
/// a Secret holds: about 900 KB of Helm's payload, 1.2 MB as the Secret's JSON carries it.
#[tokio::test]
async fn a_payload_as_large_as_a_secret_holds_is_handed_over() -> Result<()> {
    let w = world("handover-large").await?;
    w.stuck_release("web", &[(1, "superseded")]).await?;
    let size =
        w.ns.create_large_storage_secret("web", 2, "uninstalling", 900_000)
            .await?;
    assert!(size > 800_000, "a payload of {size} bytes");
    w.leave_our_suspension("web").await?;
    w.delete("web").await?;
    assert_eq!(
        w.hc.handle("web").await?,
        Handled::UninstallSkippedBecauseSuspended
    );

    assert_eq!(
        w.reconciler().reconcile(&w.ns.name, "web").await?,
        Outcome::HandedOver { revision: 2 }
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
    let offset = audit::mark();
    assert_eq!(
        w.reconciler().reconcile(&w.ns.name, "web").await?,
        Outcome::HandedOver { revision: 1 }
    );
    // The reconcile request is written as flux-plunger, like its every write.
    let request = audited(&w.ns.name, offset, 1, |r| {
        r.is_write()
            && r.body.as_ref().is_some_and(|b| {
                b["metadata"]["annotations"]["reconcile.fluxcd.io/requestedAt"].is_string()
            })
    })
    .await?;
    assert_eq!(request[0].field_manager(), Some(FIELD_MANAGER));
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

/// A newest `uninstalled` revision means nothing is installed (SPEC §5a): Helm wrote it after
/// deleting the objects, and keeps the `superseded` revisions below only as history. Nothing is
/// handed over (a superseded revision handed to helm-controller would run the chart's delete
/// hooks again and delete by name every object of its old manifest), our suspension is lifted,
/// and once helm-controller has let the release go the fence is dropped without a warning, the
/// keep-history records untouched.
#[tokio::test]
async fn a_newest_uninstalled_revision_is_nothing_installed_and_nothing_is_handed_over()
-> Result<()> {
    let w = world("handover-uninstalled").await?;
    deleted_under_our_suspension(&w, "web", &[(1, "superseded"), (2, "uninstalled")]).await?;
    let offset = audit::mark();

    assert_eq!(
        w.reconciler().reconcile(&w.ns.name, "web").await?,
        Outcome::Lifted { kept_fence: true }
    );
    assert_eq!(
        w.hc.handle("web").await?,
        Handled::NothingRecordedToUninstall,
        "helm-controller finds no history to uninstall"
    );
    assert_eq!(
        w.reconciler().reconcile(&w.ns.name, "web").await?,
        Outcome::FenceDropped
    );
    assert!(w.get("web").await?.is_none(), "gone");
    assert_eq!(
        w.revisions().await?,
        vec!["sh.helm.release.v1.web.v1", "sh.helm.release.v1.web.v2"],
        "the history Helm kept stays"
    );
    let controller = testkit::guard::shared()?.controller_user();
    let writes = logged_until_now(&w, &w.ns.name, offset)
        .await?
        .into_iter()
        .filter(|r| r.user == controller && r.is_write())
        .map(|r| r.label())
        .collect::<Vec<_>>();
    assert!(
        !writes
            .iter()
            .any(|l| l.contains("helmreleases/status") || l.contains("secrets")),
        "no hand-over, no storage delete: {writes:?}"
    );
    let events = w.ns.events_for("web").await?;
    assert!(
        events
            .iter()
            .all(|e| e.reason != "ReleasedWithoutUninstall"),
        "{events:?}"
    );
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
        let fenced = plunger::release::api::list_fenced(
            &w.client,
            &plunger::scope::Scope::default(),
            &plunger::install::Install::legacy(),
        )
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
    assert!(view.has_fence() && view.fence_labelled(), "{view:?}");
    assert!(listed().await?, "the drain's selection finds it now");
    // The next pass has nothing to write.
    let before = view.resource_version;
    w.reconciler().reconcile(&w.ns.name, "web").await?;
    assert_eq!(w.view("web").await?.resource_version, before);
    Ok(())
}

/// SPEC §5a: the storage read a release being deleted needs, failing on every try (here the
/// payload of the revision to hand over, which the apiserver keeps answering 500), is retried for
/// as long as a delete is held before the warning, then given up: our suspension is lifted, so
/// that helm-controller's deletion path runs, and the fence is let go with a Warning naming why,
/// instead of the release staying Terminating under our suspension for good.
#[tokio::test]
async fn a_storage_read_failing_on_every_try_is_given_up_and_our_suspension_lifted() -> Result<()> {
    let w = world("handover-failing-read").await?;
    deleted_under_our_suspension(&w, "web", &[(1, "superseded"), (2, "uninstalling")]).await?;
    let proxy = FaultProxy::forwarding_as(
        &testkit::guard::shared()?.controller_kubeconfig(),
        FaultPlan::none(0).holding(testkit::fault_proxy::Hold::failing(
            testkit::fault_proxy::Verb::Get,
            "/secrets/sh.helm.release.v1.web.v2",
            500,
        )),
    )
    .await?;
    let client = proxy.client()?;
    let bound = Duration::from_secs(2);
    let reconciler = Reconciler::new(
        client.clone(),
        Events::new(client, "flux-plunger", None),
        Timings {
            fence_held_warning_after: bound,
            ..Timings::default()
        },
    );

    let first = reconciler.reconcile(&w.ns.name, "web").await.unwrap_err();
    assert_eq!(first.kind(), "read_storage", "{first}");
    let mut tries = 1;
    testkit::eventually(
        Duration::from_secs(30),
        "the failing read is given up",
        || {
            tries += 1;
            let reconciler = &reconciler;
            let name = w.ns.name.clone();
            async move {
                Ok(match reconciler.reconcile(&name, "web").await {
                    Ok(outcome) => {
                        assert_eq!(outcome, Outcome::Lifted { kept_fence: true });
                        true
                    }
                    Err(err) => {
                        assert_eq!(err.kind(), "read_storage", "{err}");
                        false
                    }
                })
            }
        },
    )
    .await?;
    assert!(tries > 1, "retried before it was given up");
    let view = w.view("web").await?;
    assert!(!view.suspend && view.has_fence(), "{view:?}");

    // helm-controller meets the unsuspended release, with nothing handed
    // over, and lets its finalizer go; the fence is let go with a Warning.
    w.hc.handle("web").await?;
    assert_eq!(
        reconciler.reconcile(&w.ns.name, "web").await?,
        Outcome::ReleasedWithoutUninstall
    );
    let events = w.ns.events_for("web").await?;
    assert!(
        events
            .iter()
            .any(|e| e.reason == "ReleasedWithoutUninstall"
                && e.note.contains("failed on every try")),
        "{events:?}"
    );
    assert!(
        proxy.report().total_faults() >= 2,
        "the read failed each try"
    );
    Ok(())
}
