//! The kube-apiserver behaviours flux-plunger's design leans on, pinned
//! against a real apiserver. If one of these ever changes, the design must
//! change with it, so each test asserts the exact outcome.

use anyhow::Result;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ManagedFieldsEntry;
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

/// flux-plunger's one write as it sends it: [`apply_body`] of what it last
/// read, applied under its field manager.
async fn apply_over(
    ns: &TestNamespace,
    read: &DynamicObject,
    suspend: Option<bool>,
    fence: bool,
) -> kube::Result<DynamicObject> {
    apply_as_field_manager(ns, apply_body(read, suspend, fence)).await
}

/// A server-side apply of `body` (which names its release) under
/// flux-plunger's field manager; a `kube::Result`, so that a refusal's code
/// can be asserted.
async fn apply_as_field_manager(ns: &TestNamespace, body: Value) -> kube::Result<DynamicObject> {
    let name = body["metadata"]["name"]
        .as_str()
        .expect("the body names its release")
        .to_owned();
    ns.releases()
        .patch(
            &name,
            &PatchParams::apply(FIELD_MANAGER),
            &Patch::Apply(body),
        )
        .await
}

/// Release `demo`, suspended by flux-plunger's apply alone (no fence): the
/// state whose ownership the facts below move or share.
async fn suspended_by_flux_plunger(ns: &TestNamespace) -> Result<DynamicObject> {
    let created = ns.create_release("demo", json!({})).await?;
    Ok(apply_over(ns, &created, Some(true), false).await?)
}

/// Release `demo` as read before it was deleted: its uid names an object
/// that no longer exists.
async fn read_then_deleted(ns: &TestNamespace) -> Result<DynamicObject> {
    let read = ns.create_release("demo", json!({})).await?;
    ns.releases()
        .delete("demo", &DeleteParams::default())
        .await?;
    Ok(read)
}

/// `body` without the precondition `field` of its metadata, to pin what the
/// ones left guard on their own.
fn without_precondition(mut body: Value, field: &str) -> Value {
    body["metadata"]
        .as_object_mut()
        .expect("the body has metadata")
        .remove(field);
    body
}

/// The managedFields entries of `obj` that own the field at `pointer`, a
/// JSON pointer into `fieldsV1` such as `/f:spec/f:suspend`.
fn entries_owning<'a>(
    obj: &'a DynamicObject,
    pointer: &'a str,
) -> impl Iterator<Item = &'a ManagedFieldsEntry> {
    obj.metadata.managed_fields.iter().flatten().filter(|e| {
        e.fields_v1
            .as_ref()
            .is_some_and(|f| f.0.pointer(pointer).is_some())
    })
}

fn managers_owning_suspend(obj: &DynamicObject) -> Vec<(String, String)> {
    let mut owners: Vec<(String, String)> = entries_owning(obj, "/f:spec/f:suspend")
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
    let applied = apply_over(&ns, &created, Some(true), true).await?;
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
    let ours = suspended_by_flux_plunger(&ns).await?;
    let theirs = ns.apply_suspend_as("demo", "operator", false).await?;
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
    suspended_by_flux_plunger(&ns).await?;
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
    suspended_by_flux_plunger(&ns).await?;
    let body = json!({"apiVersion": HELMRELEASE_API_VERSION, "kind": HELMRELEASE_KIND,
        "metadata": {"name": "demo"}, "spec": {"suspend": true}});
    // Not forced: writing the value already there is no conflict to force.
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
    let err = apply_over(&ns, &created, Some(true), true)
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
    let deleted = read_then_deleted(&ns).await?;
    // Without a resourceVersion the uid is the only precondition left.
    let body = without_precondition(apply_body(&deleted, Some(true), true), "resourceVersion");
    let err = apply_as_field_manager(&ns, body).await.unwrap_err();
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
    let old = read_then_deleted(&ns).await?;
    let new = ns.create_release("demo", json!({})).await?;
    assert_ne!(old.metadata.uid, new.metadata.uid);

    let body = without_precondition(apply_body(&old, Some(true), true), "resourceVersion");
    let err = apply_as_field_manager(&ns, body.clone()).await.unwrap_err();
    // The apiserver treats the body's uid as a change of an immutable field:
    // 422 Invalid ("metadata.uid: field is immutable"), not 409.
    assert_eq!(api_error_code(&err), Some(422), "{err}");
    let after = ns.releases().get("demo").await?;
    assert_eq!(
        after.metadata.resource_version,
        new.metadata.resource_version
    );

    // The uid is what protects it: the same body without it does land.
    let landed = apply_as_field_manager(&ns, without_precondition(body, "uid")).await?;
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

    let given_up = apply_over(&ns, &ours, None, false).await?;

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
        let err = apply_over(&ns, &twice, suspend, true).await.unwrap_err();
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
    let err = apply_as_field_manager(&ns, stale).await.unwrap_err();
    assert!(plunger::error::is_stale_write(&err), "{err}");
    // Leaving the fence out goes through, and leaves both copies.
    let given_up = apply_over(&ns, &twice, None, false).await?;
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
    let fenced = apply_over(&ns, &created, Some(true), true).await?;
    assert_eq!(selected().await?, ["demo"]);
    let lifted = apply_over(&ns, &fenced, None, false).await?;
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
    // A JSON pointer escapes the finalizer's "/" as "~1".
    let pointer = format!(
        "/f:metadata/f:finalizers/v:\"{}\"",
        FENCE_FINALIZER.replace('/', "~1")
    );
    entries_owning(obj, &pointer)
        .filter_map(|e| e.manager.clone())
        .collect()
}
