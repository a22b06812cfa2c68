//! The kube-apiserver behaviours flux-plunger's design leans on, pinned
//! against a real apiserver. If one of these ever changes, the design must
//! change with it, so each test asserts the exact outcome.

use anyhow::Result;
use kube::api::{DeleteParams, DynamicObject, ListParams, Patch, PatchParams};
use plunger::names::{
    FENCE_FINALIZER, FENCE_LABEL, FENCE_LABEL_VALUE, FIELD_MANAGER, HELMRELEASE_API_VERSION,
    HELMRELEASE_KIND,
};
use plunger::release::ReleaseView;
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
        body["metadata"]["labels"] = json!({ FENCE_LABEL: FENCE_LABEL_VALUE });
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
    let params = PatchParams {
        field_manager: Some("kubectl-patch".into()),
        ..Default::default()
    };
    let theirs = ns
        .releases()
        .patch(
            "demo",
            &params,
            &Patch::Merge(json!({"spec": {"suspend": false}})),
        )
        .await?;
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
    let after = ns.releases().get("demo").await?;
    assert_eq!(
        after.metadata.resource_version,
        created.metadata.resource_version
    );
    assert_eq!(after.data["spec"]["interval"], "5m");
    Ok(())
}

#[tokio::test]
async fn a_finalizer_keeps_a_deleted_release_whose_spec_writes_still_bump_the_generation()
-> Result<()> {
    let ns = namespace("facts-finalizer").await?;
    let created = ns.create_release("demo", json!({"suspend": true})).await?;
    let fenced = ns
        .releases()
        .patch(
            "demo",
            &PatchParams::apply(FIELD_MANAGER),
            &Patch::Apply(apply_body(&created, None, true)),
        )
        .await?;
    ns.releases()
        .delete("demo", &DeleteParams::default())
        .await?;
    let deleted = ns.releases().get("demo").await?;
    assert!(deleted.metadata.deletion_timestamp.is_some());
    assert_eq!(
        deleted.metadata.generation,
        fenced.metadata.generation.map(|g| g + 1),
        "setting deletionTimestamp bumps the generation of a custom resource"
    );

    let unsuspended = ns
        .releases()
        .patch(
            "demo",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"suspend": false}})),
        )
        .await?;
    assert_eq!(
        unsuspended.metadata.generation,
        deleted.metadata.generation.map(|g| g + 1)
    );

    // Giving up the fence (leaving it out of our apply) removes the last
    // finalizer, and the release goes.
    let mut body = apply_body(&unsuspended, None, false);
    body["metadata"]
        .as_object_mut()
        .unwrap()
        .remove("finalizers");
    let result = ns
        .releases()
        .patch(
            "demo",
            &PatchParams::apply(FIELD_MANAGER),
            &Patch::Apply(body),
        )
        .await;
    assert!(result.is_ok(), "{result:?}");
    assert!(ns.releases().get_opt("demo").await?.is_none());
    Ok(())
}

#[tokio::test]
async fn leaving_suspend_out_of_a_later_apply_unsets_it_when_we_were_the_only_owner() -> Result<()>
{
    let ns = namespace("facts-giveup-sole").await?;
    let created = ns.create_release("demo", json!({})).await?;
    let ours = ns
        .releases()
        .patch(
            "demo",
            &PatchParams::apply(FIELD_MANAGER),
            &Patch::Apply(apply_body(&created, Some(true), true)),
        )
        .await?;
    let lifted = ns
        .releases()
        .patch(
            "demo",
            &PatchParams::apply(FIELD_MANAGER),
            &Patch::Apply(apply_body(&ours, None, false)),
        )
        .await?;
    assert!(
        lifted.data["spec"].get("suspend").is_none(),
        "{:?}",
        lifted.data["spec"]
    );
    assert!(
        lifted
            .metadata
            .finalizers
            .clone()
            .unwrap_or_default()
            .is_empty()
    );
    assert!(managers_owning_suspend(&lifted).is_empty());
    assert_eq!(
        lifted.data["spec"]["interval"], "5m",
        "other fields untouched"
    );
    Ok(())
}

#[tokio::test]
async fn leaving_suspend_out_of_a_later_apply_keeps_it_when_someone_else_co_owns_it() -> Result<()>
{
    let ns = namespace("facts-giveup-shared").await?;
    let created = ns.create_release("demo", json!({})).await?;
    ns.releases()
        .patch(
            "demo",
            &PatchParams::apply(FIELD_MANAGER),
            &Patch::Apply(apply_body(&created, Some(true), true)),
        )
        .await?;
    let body = json!({"apiVersion": HELMRELEASE_API_VERSION, "kind": HELMRELEASE_KIND,
        "metadata": {"name": "demo", "finalizers": [FENCE_FINALIZER]}, "spec": {"suspend": true}});
    let shared = ns
        .releases()
        .patch(
            "demo",
            &PatchParams::apply("migration"),
            &Patch::Apply(body),
        )
        .await?;
    let lifted = ns
        .releases()
        .patch(
            "demo",
            &PatchParams::apply(FIELD_MANAGER),
            &Patch::Apply(apply_body(&shared, None, false)),
        )
        .await?;
    assert_eq!(lifted.data["spec"]["suspend"], true);
    assert_eq!(
        lifted.metadata.finalizers,
        Some(vec![FENCE_FINALIZER.to_owned()])
    );
    assert_eq!(
        managers_owning_suspend(&lifted),
        owners(&[("migration", "Apply")])
    );
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
