//! The kube-apiserver behaviours flux-plunger's design leans on, pinned
//! against a real apiserver. If one of these ever changes, the design must
//! change with it, so each test asserts the exact outcome.

use anyhow::Result;
use kube::api::{DeleteParams, DynamicObject, ListParams, Patch, PatchParams};
use plunger::names::{
    FENCE_FINALIZER, FENCE_LABEL, FIELD_MANAGER, HELMRELEASE_API_VERSION, HELMRELEASE_KIND,
    LEGACY_FENCE_LABEL_VALUE,
};
use plunger::release::view::ReleaseView;
use serde_json::{Value, json};
use testkit::{TestNamespace, control_plane};

async fn namespace(prefix: &str) -> Result<TestNamespace> {
    let client = control_plane().client().await?;
    TestNamespace::create(&client, prefix).await
}

/// The body of flux-plunger's one write: identity, preconditions, and the
/// fields it claims — nothing else.
fn apply_body(obj: &DynamicObject, suspend: Option<bool>, fence: bool) -> Value {
    let mut body = json!({
        "apiVersion": HELMRELEASE_API_VERSION,
        "kind": HELMRELEASE_KIND,
        "metadata": {
            "name": obj.metadata.name,
            "namespace": obj.metadata.namespace,
            "resourceVersion": obj.metadata.resource_version,
            "uid": obj.metadata.uid,
        },
    });
    if fence {
        body["metadata"]["finalizers"] = json!([FENCE_FINALIZER]);
        body["metadata"]["labels"] = json!({ FENCE_LABEL: LEGACY_FENCE_LABEL_VALUE });
    }
    if let Some(suspend) = suspend {
        body["spec"] = json!({ "suspend": suspend });
    }
    body
}

fn managers_owning_suspend(obj: &DynamicObject) -> Vec<(String, String)> {
    let mut owners: Vec<(String, String)> = obj
        .metadata
        .managed_fields
        .iter()
        .flatten()
        .filter(|e| {
            e.fields_v1
                .as_ref()
                .and_then(|f| f.0.get("f:spec"))
                .and_then(|s| s.get("f:suspend"))
                .is_some()
        })
        .map(|e| {
            (
                e.manager.clone().unwrap_or_default(),
                e.operation.clone().unwrap_or_default(),
            )
        })
        .collect();
    owners.sort();
    owners
}

fn owners(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(m, o)| ((*m).to_owned(), (*o).to_owned()))
        .collect()
}

fn api_error_code(err: &kube::Error) -> Option<u16> {
    match err {
        kube::Error::Api(status) => Some(status.code),
        _ => None,
    }
}

#[tokio::test]
async fn an_apply_of_suspend_by_flux_plunger_is_an_apply_entry_owning_spec_suspend() -> Result<()> {
    let ns = namespace("facts-apply").await?;
    let created = ns.create_release("demo", json!({})).await?;
    let applied = ns
        .releases()
        .patch(
            "demo",
            &PatchParams::apply(FIELD_MANAGER),
            &Patch::Apply(apply_body(&created, Some(true), true)),
        )
        .await?;
    assert_eq!(
        managers_owning_suspend(&applied),
        owners(&[(FIELD_MANAGER, "Apply")])
    );
    let view = ReleaseView::from_object(&applied);
    assert!(view.suspend && view.suspended_by_us() && view.suspend_owned_by_us_alone());
    assert!(view.has_fence());
    Ok(())
}

#[tokio::test]
async fn a_different_value_written_by_another_applier_moves_ownership_away() -> Result<()> {
    let ns = namespace("facts-move-apply").await?;
    let created = ns.create_release("demo", json!({})).await?;
    let ours = ns
        .releases()
        .patch(
            "demo",
            &PatchParams::apply(FIELD_MANAGER),
            &Patch::Apply(apply_body(&created, Some(true), false)),
        )
        .await?;
    let body = json!({"apiVersion": HELMRELEASE_API_VERSION, "kind": HELMRELEASE_KIND,
        "metadata": {"name": "demo"}, "spec": {"suspend": false}});
    let theirs = ns
        .releases()
        .patch(
            "demo",
            &PatchParams::apply("operator").force(),
            &Patch::Apply(body),
        )
        .await?;
    assert_ne!(
        ours.metadata.resource_version,
        theirs.metadata.resource_version
    );
    assert_eq!(
        managers_owning_suspend(&theirs),
        owners(&[("operator", "Apply")])
    );
    assert!(!ReleaseView::from_object(&theirs).suspend_owned_by_us());
    Ok(())
}

#[tokio::test]
async fn a_different_value_written_by_an_update_moves_ownership_away() -> Result<()> {
    let ns = namespace("facts-move-update").await?;
    let created = ns.create_release("demo", json!({})).await?;
    ns.releases()
        .patch(
            "demo",
            &PatchParams::apply(FIELD_MANAGER),
            &Patch::Apply(apply_body(&created, Some(true), false)),
        )
        .await?;
    // `kubectl patch` / `flux resume` style: an Update by another manager.
    let theirs = ns.update_suspend_as("demo", "kubectl-patch", false).await?;
    assert_eq!(
        managers_owning_suspend(&theirs),
        owners(&[("kubectl-patch", "Update")])
    );
    Ok(())
}

#[tokio::test]
async fn the_same_value_written_by_another_applier_shares_ownership() -> Result<()> {
    let ns = namespace("facts-share").await?;
    let created = ns.create_release("demo", json!({})).await?;
    ns.releases()
        .patch(
            "demo",
            &PatchParams::apply(FIELD_MANAGER),
            &Patch::Apply(apply_body(&created, Some(true), false)),
        )
        .await?;
    let body = json!({"apiVersion": HELMRELEASE_API_VERSION, "kind": HELMRELEASE_KIND,
        "metadata": {"name": "demo"}, "spec": {"suspend": true}});
    let shared = ns
        .releases()
        .patch(
            "demo",
            &PatchParams::apply("migration"),
            &Patch::Apply(body),
        )
        .await?;
    assert_eq!(
        managers_owning_suspend(&shared),
        owners(&[(FIELD_MANAGER, "Apply"), ("migration", "Apply")])
    );
    let view = ReleaseView::from_object(&shared);
    assert!(
        view.suspended_by_us(),
        "shared ownership still counts as ours"
    );
    assert!(!view.suspend_owned_by_us_alone());
    Ok(())
}

#[tokio::test]
async fn an_apply_with_a_stale_resource_version_is_refused_with_409_and_changes_nothing()
-> Result<()> {
    let ns = namespace("facts-rv").await?;
    let created = ns.create_release("demo", json!({})).await?;
    // Someone writes between our read and our apply.
    let moved = ns
        .releases()
        .patch(
            "demo",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"x": "y"}}})),
        )
        .await?;
    let err = ns
        .releases()
        .patch(
            "demo",
            &PatchParams::apply(FIELD_MANAGER),
            &Patch::Apply(apply_body(&created, Some(true), true)),
        )
        .await
        .unwrap_err();
    assert_eq!(api_error_code(&err), Some(409), "{err}");
    let after = ns.releases().get("demo").await?;
    assert_eq!(
        after.metadata.resource_version,
        moved.metadata.resource_version
    );
    assert!(managers_owning_suspend(&after).is_empty());
    assert!(after.metadata.finalizers.is_none());
    Ok(())
}

#[tokio::test]
async fn an_apply_with_the_uid_of_a_deleted_release_creates_nothing() -> Result<()> {
    let ns = namespace("facts-uid-gone").await?;
    let created = ns.create_release("demo", json!({})).await?;
    ns.releases()
        .delete("demo", &DeleteParams::default())
        .await?;
    let mut body = apply_body(&created, Some(true), true);
    // Without a resourceVersion the uid is the only precondition left.
    body["metadata"]
        .as_object_mut()
        .unwrap()
        .remove("resourceVersion");
    let err = ns
        .releases()
        .patch(
            "demo",
            &PatchParams::apply(FIELD_MANAGER),
            &Patch::Apply(body),
        )
        .await
        .unwrap_err();
    // With nothing to patch, the uid acts as a precondition of the create:
    // 409 Conflict ("uid mismatch: ... no existing object was found").
    assert_eq!(api_error_code(&err), Some(409), "{err}");
    assert!(err.to_string().contains("uid mismatch"), "{err}");
    assert!(
        ns.releases().get_opt("demo").await?.is_none(),
        "nothing was created"
    );
    Ok(())
}

#[tokio::test]
async fn an_apply_with_the_uid_of_a_deleted_release_never_touches_a_recreated_one() -> Result<()> {
    let ns = namespace("facts-uid-new").await?;
    let old = ns.create_release("demo", json!({})).await?;
    ns.releases()
        .delete("demo", &DeleteParams::default())
        .await?;
    let new = ns.create_release("demo", json!({})).await?;
    assert_ne!(old.metadata.uid, new.metadata.uid);

    let mut body = apply_body(&old, Some(true), true);
    body["metadata"]
        .as_object_mut()
        .unwrap()
        .remove("resourceVersion");
    let err = ns
        .releases()
        .patch(
            "demo",
            &PatchParams::apply(FIELD_MANAGER),
            &Patch::Apply(body.clone()),
        )
        .await
        .unwrap_err();
    // The apiserver treats the body's uid as a change of an immutable field:
    // 422 Invalid ("metadata.uid: field is immutable"), not 409.
    assert_eq!(api_error_code(&err), Some(422), "{err}");
    let after = ns.releases().get("demo").await?;
    assert_eq!(
        after.metadata.resource_version,
        new.metadata.resource_version
    );

    // The uid is what protects it: the same body without it does land.
    body["metadata"].as_object_mut().unwrap().remove("uid");
    let landed = ns
        .releases()
        .patch(
            "demo",
            &PatchParams::apply(FIELD_MANAGER),
            &Patch::Apply(body),
        )
        .await?;
    assert!(ReleaseView::from_object(&landed).suspended_by_us());
    Ok(())
}

#[tokio::test]
async fn a_json_patch_whose_test_op_fails_is_refused_and_changes_nothing() -> Result<()> {
    let ns = namespace("facts-jsonpatch").await?;
    let created = ns.create_release("demo", json!({})).await?;
    let patch: json_patch::Patch = serde_json::from_value(json!([
        {"op": "test", "path": "/metadata/resourceVersion", "value": "1"},
        {"op": "replace", "path": "/spec/interval", "value": "1m"},
    ]))?;
    let err = ns
        .releases()
        .patch("demo", &PatchParams::default(), &Patch::<()>::Json(patch))
        .await
        .unwrap_err();
    assert_eq!(api_error_code(&err), Some(422), "{err}");
    assert!(plunger::error::is_failed_guard(&err), "{err}");
    // A `test` at an index the list no longer has is refused the same way.
    let patch: json_patch::Patch = serde_json::from_value(json!([
        {"op": "test", "path": "/metadata/finalizers/3", "value": FENCE_FINALIZER},
        {"op": "remove", "path": "/metadata/finalizers/3"},
    ]))?;
    let err = ns
        .releases()
        .patch("demo", &PatchParams::default(), &Patch::<()>::Json(patch))
        .await
        .unwrap_err();
    assert!(plunger::error::is_failed_guard(&err), "{err}");
    let after = ns.releases().get("demo").await?;
    assert_eq!(
        after.metadata.resource_version,
        created.metadata.resource_version
    );
    assert_eq!(after.data["spec"]["interval"], "5m");
    Ok(())
}

#[tokio::test]
async fn an_apply_leaving_out_a_fence_another_manager_also_lists_gives_up_only_its_claim()
-> Result<()> {
    let ns = namespace("facts-shared-fence").await?;
    ns.create_release("demo", json!({})).await?;
    let params = PatchParams {
        field_manager: Some("kubectl-patch".into()),
        ..Default::default()
    };
    ns.releases()
        .patch(
            "demo",
            &params,
            &Patch::Merge(json!({"metadata": {"finalizers": [FENCE_FINALIZER]}})),
        )
        .await?;
    let ours = ns.apply_as_flux_plunger("demo", false).await?;

    let given_up = ns
        .releases()
        .patch(
            "demo",
            &PatchParams::apply(FIELD_MANAGER),
            &Patch::Apply(apply_body(&ours, None, false)),
        )
        .await?;

    assert_eq!(
        given_up.metadata.finalizers.as_deref(),
        Some(&[FENCE_FINALIZER.to_owned()][..]),
        "the other manager's claim keeps it"
    );
    Ok(())
}

#[tokio::test]
async fn with_the_fence_listed_twice_an_apply_naming_it_is_a_field_manager_conflict() -> Result<()>
{
    let ns = namespace("facts-twice").await?;
    ns.create_release("demo", json!({})).await?;
    ns.apply_as_flux_plunger("demo", true).await?;
    let params = PatchParams {
        field_manager: Some("kubectl-patch".into()),
        ..Default::default()
    };
    let patch: json_patch::Patch = serde_json::from_value(json!([
        {"op": "add", "path": "/metadata/finalizers/-", "value": FENCE_FINALIZER},
    ]))?;
    let twice = ns
        .releases()
        .patch("demo", &params, &Patch::<()>::Json(patch))
        .await?;
    // The duplicated entry is now the appending manager's alone.
    assert!(
        !fence_owners(&twice).contains(&FIELD_MANAGER.to_owned()),
        "{:?}",
        fence_owners(&twice)
    );

    // Naming the fence (to keep it while the suspension goes, or with it):
    // refused, with a cause that names the manager, whatever is re-read.
    for suspend in [None, Some(true)] {
        let err = ns
            .releases()
            .patch(
                "demo",
                &PatchParams::apply(FIELD_MANAGER),
                &Patch::Apply(apply_body(&twice, suspend, true)),
            )
            .await
            .unwrap_err();
        assert_eq!(api_error_code(&err), Some(409), "{err}");
        assert!(
            plunger::error::is_field_manager_conflict(&err),
            "suspend {suspend:?}: {err}"
        );
        assert!(!plunger::error::is_stale_write(&err));
    }
    // A stale resourceVersion is the other 409: no field-manager cause (on an
    // apply that leaves the fence out; one naming it reports the conflict).
    let mut stale = apply_body(&twice, None, false);
    stale["metadata"]["resourceVersion"] = json!("1");
    let err = ns
        .releases()
        .patch(
            "demo",
            &PatchParams::apply(FIELD_MANAGER),
            &Patch::Apply(stale),
        )
        .await
        .unwrap_err();
    assert!(plunger::error::is_stale_write(&err), "{err}");
    // Leaving the fence out goes through, and leaves both copies.
    let given_up = ns
        .releases()
        .patch(
            "demo",
            &PatchParams::apply(FIELD_MANAGER),
            &Patch::Apply(apply_body(&twice, None, false)),
        )
        .await?;
    let view = ReleaseView::from_object(&given_up);
    assert!(!view.suspend, "the suspension was ours alone: it went");
    assert_eq!(view.fence_indices(), vec![0, 1]);
    Ok(())
}

#[tokio::test]
async fn the_fence_label_selects_a_release_server_side_while_the_fence_is_held_and_goes_with_it()
-> Result<()> {
    let ns = namespace("facts-fence-label").await?;
    let created = ns.create_release("demo", json!({})).await?;
    ns.create_release("other", json!({})).await?;
    let selected = || async {
        let params = ListParams::default().labels(FENCE_LABEL);
        let names: Vec<String> = ns
            .releases()
            .list(&params)
            .await?
            .items
            .into_iter()
            .filter_map(|o| o.metadata.name)
            .collect();
        anyhow::Ok(names)
    };
    let fenced = ns
        .releases()
        .patch(
            "demo",
            &PatchParams::apply(FIELD_MANAGER),
            &Patch::Apply(apply_body(&created, Some(true), true)),
        )
        .await?;
    assert_eq!(selected().await?, ["demo"]);
    let lifted = ns
        .releases()
        .patch(
            "demo",
            &PatchParams::apply(FIELD_MANAGER),
            &Patch::Apply(apply_body(&fenced, None, false)),
        )
        .await?;
    assert!(
        !lifted
            .metadata
            .labels
            .unwrap_or_default()
            .contains_key(FENCE_LABEL),
        "given up with the fence"
    );
    assert!(selected().await?.is_empty());
    Ok(())
}

/// The managers whose managedFields entries list the fence.
fn fence_owners(obj: &DynamicObject) -> Vec<String> {
    let key = format!("v:\"{FENCE_FINALIZER}\"");
    obj.metadata
        .managed_fields
        .iter()
        .flatten()
        .filter(|e| {
            e.fields_v1
                .as_ref()
                .and_then(|f| f.0.get("f:metadata"))
                .and_then(|m| m.get("f:finalizers"))
                .is_some_and(|f| f.get(&key).is_some())
        })
        .filter_map(|e| e.manager.clone())
        .collect()
}
