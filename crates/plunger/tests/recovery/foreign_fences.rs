//! A fence another field manager also lists (a backup restore, a hand edit, a re-applied manifest):
//! `metadata.finalizers` is a set, so an apply leaving the fence out gives up only flux-plunger's
//! claim on it (SPEC §3).

use super::*;

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
    let refused = plunger::apply::apply(
        &w.client,
        &view,
        plunger::apply::Claim::FENCE_ONLY,
        false,
        &plunger::install::Install::legacy(),
    )
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

/// A tenant's own release, stuck, carrying the fence under the tenant's
/// manager (a merge patch, as a client-side create with the finalizer would
/// list it), then deleted: flux-plunger is not driven by a fence it did not
/// set. It reads no storage, writes no history and asks for no reconcile; it
/// only removes the copy, and the release goes.
#[tokio::test]
async fn a_fence_the_tenant_set_drives_no_hand_over_and_is_only_removed() -> Result<()> {
    let w = world("self-fenced").await?;
    w.stuck_release("web", &[(1, "superseded"), (2, "uninstalling")])
        .await?;
    add_fence_as(&w, "web", "tenant").await?;
    w.delete("web").await?;
    assert_eq!(
        w.hc.handle("web").await?,
        Handled::NothingRecordedToUninstall
    );
    let offset = audit::mark();

    assert_eq!(
        w.reconciler().reconcile(&w.ns.name, "web").await?,
        Outcome::FenceDropped
    );

    assert!(w.get("web").await?.is_none(), "the release goes");
    // The removal is the pass's last request: once it is logged, so is
    // everything the pass did before it.
    audited(&w.ns.name, offset, 1, |r| {
        r.is_write() && r.resource() == "helmreleases"
    })
    .await?;
    let acted = audit::read_since(offset)?
        .into_iter()
        .filter(|r| r.namespace.as_deref() == Some(w.ns.name.as_str()))
        .filter(|r| r.resource() == "secrets" || r.resource() == "helmreleases/status")
        .map(|r| r.label())
        .collect::<Vec<_>>();
    assert!(
        acted.is_empty(),
        "no storage read, no history written: {acted:?}"
    );
    assert_eq!(
        w.storage_secret_count().await?,
        2,
        "the storage is untouched"
    );
    Ok(())
}
