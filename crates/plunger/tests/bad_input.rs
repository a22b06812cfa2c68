//! Bad input against a real apiserver: annotations that are not revision
//! numbers, Secrets that only look like Helm storage, releases without the
//! status the controller looks for, the longest names. Each case: no panic,
//! no wrong delete, and the outcome SPEC §4 gives it.

use std::collections::BTreeMap;

use anyhow::Result;
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Patch, PatchParams, PostParams};
use plunger::names::{self, PROCESSED_VERSION_ANNOTATION};
use plunger::reconcile::Outcome;
use plunger::storage::api::list_storage;
use plunger::storage::view::{StorageLocation, shorten_release_name};
use serde_json::json;
use testkit::World;

async fn world(prefix: &str) -> Result<World> {
    World::create(prefix).await
}

/// What these cases add to the test world.
trait BadInput {
    /// A release helm-controller installed, with its finalizer; storage
    /// revision 1 `superseded` and 2 `uninstalling` (the one to reclaim)
    /// under the Helm release name `storage_name`.
    async fn release(&self, name: &str, storage_name: &str) -> Result<()>;
    async fn secret_names(&self) -> Result<Vec<String>>;
    async fn reconcile(&self, name: &str) -> Result<Outcome>;
}

impl BadInput for World {
    async fn release(&self, name: &str, storage_name: &str) -> Result<()> {
        self.installed(name).await?;
        self.ns
            .create_storage_secret(storage_name, 1, "superseded")
            .await?;
        self.ns
            .create_storage_secret(storage_name, 2, "uninstalling")
            .await?;
        Ok(())
    }

    async fn secret_names(&self) -> Result<Vec<String>> {
        self.ns.secret_names().await
    }

    async fn reconcile(&self, name: &str) -> Result<Outcome> {
        Ok(self.reconciler().reconcile(&self.ns.name, name).await?)
    }
}

/// SPEC §4 step 7: an annotation that does not parse as a revision is no
/// guard: the recovery carries on, reclaims the newest revision (and only
/// it), and writes a good annotation. One that parses but is not
/// `latest + 1` (huge, here) is no guard either.
#[tokio::test]
async fn an_annotation_that_is_not_a_revision_number_guards_nothing_and_is_rewritten() -> Result<()>
{
    let w = world("bad-annotation").await?;
    let values = [
        "",
        "-1",
        "abc",
        "2.0",
        " 2",
        "0x2",
        "18446744073709551616",
        "99999",
    ];
    for (i, value) in values.iter().enumerate() {
        let name = format!("web-{i}");
        w.release(&name, &name).await?;
        w.ns.releases()
            .patch(
                &name,
                &PatchParams::default(),
                &Patch::Merge(
                    json!({"metadata": {"annotations": {PROCESSED_VERSION_ANNOTATION: value}}}),
                ),
            )
            .await?;
        w.ns.mark_stuck(&name).await?;

        assert_eq!(
            w.reconcile(&name).await?,
            Outcome::Recovered { revision: 2 },
            "annotation {value:?}"
        );
        let view = w.view(&name).await?;
        assert_eq!(
            view.annotations
                .get(PROCESSED_VERSION_ANNOTATION)
                .map(String::as_str),
            Some("2"),
            "annotation {value:?}"
        );
        assert!(!view.suspend && !view.has_fence(), "{value:?}: {view:?}");
    }
    let expected: Vec<String> = {
        let mut kept: Vec<String> = (0..values.len())
            .map(|i| names::storage_secret_name(&format!("web-{i}"), 1))
            .collect();
        kept.sort();
        kept
    };
    assert_eq!(w.secret_names().await?, expected, "only revision 2 went");
    Ok(())
}

/// Secrets that carry the storage labels of the release but are not
/// well-formed revisions (another type, a name and a label that disagree, a
/// missing or non-numeric version, an odd name) are never deleted and never
/// taken for the newest revision, even with higher numbers. The one of
/// another type is not even listed: the listing selects Helm's storage type.
#[tokio::test]
async fn secrets_that_only_look_like_storage_are_never_deleted_nor_taken_for_the_newest()
-> Result<()> {
    let w = world("bad-secrets").await?;
    w.release("web", "web").await?;
    let decoy = |name: &str, type_: &str, version: Option<&str>| {
        let mut labels = BTreeMap::from([
            ("owner".to_owned(), "helm".to_owned()),
            ("name".to_owned(), "web".to_owned()),
            ("status".to_owned(), "uninstalling".to_owned()),
        ]);
        if let Some(version) = version {
            labels.insert("version".to_owned(), version.to_owned());
        }
        Secret {
            metadata: kube::api::ObjectMeta {
                name: Some(name.to_owned()),
                labels: Some(labels),
                ..Default::default()
            },
            type_: Some(type_.to_owned()),
            data: Some(BTreeMap::from([(
                "release".to_owned(),
                ByteString(b"not a release".to_vec()),
            )])),
            ..Default::default()
        }
    };
    let storage = names::HELM_STORAGE_SECRET_TYPE;
    let decoys = [
        decoy("sh.helm.release.v1.web.v9", "Opaque", Some("9")),
        decoy("sh.helm.release.v1.web.v8", storage, Some("7")),
        decoy("sh.helm.release.v1.web.v6", storage, None),
        decoy("sh.helm.release.v1.web.vx", storage, Some("x")),
        decoy("sh.helm.release.v1.web.v05", storage, Some("05")),
        decoy("web-release-v5", storage, Some("5")),
        decoy("sh.helm.release.v1.other.v4", storage, Some("4")),
    ];
    for secret in &decoys {
        w.ns.secrets()
            .create(&PostParams::default(), secret)
            .await?;
    }
    w.ns.mark_stuck("web").await?;
    let before = w.secret_names().await?;

    assert_eq!(
        w.reconcile("web").await?,
        Outcome::Recovered { revision: 2 }
    );
    let after = w.secret_names().await?;
    let gone: Vec<&String> = before.iter().filter(|n| !after.contains(n)).collect();
    assert_eq!(gone, vec!["sh.helm.release.v1.web.v2"]);
    let location = StorageLocation {
        namespace: w.ns.name.clone(),
        release_name: "web".to_owned(),
    };
    let listed: Vec<String> = list_storage(&w.ns.client, &location)
        .await?
        .iter()
        .map(|secret| secret.name().to_owned())
        .collect();
    let expected: Vec<String> = after
        .iter()
        .filter(|n| *n != "sh.helm.release.v1.web.v9")
        .cloned()
        .collect();
    assert_eq!(listed, expected, "all but the Secret of another type");
    Ok(())
}

/// Releases that are not stuck by the only test that counts (`Ready=False`
/// with the message): no status, `Ready` of status `Unknown` with the
/// message, another condition carrying the message. Nothing is written and
/// nothing deleted.
#[tokio::test]
async fn a_release_without_the_stuck_ready_condition_is_left_alone() -> Result<()> {
    let w = world("bad-status").await?;
    let message = "Helm upgrade failed: \"web\" has no deployed releases";
    let cases = [
        ("no-status", None),
        (
            "ready-unknown",
            Some(
                json!([{"type": "Ready", "status": "Unknown", "reason": "Progressing",
                "message": message, "lastTransitionTime": "2026-01-01T00:00:00Z"}]),
            ),
        ),
        (
            "released-false",
            Some(json!([
                {"type": "Released", "status": "False", "reason": "UpgradeFailed",
                 "message": message, "lastTransitionTime": "2026-01-01T00:00:00Z"},
                {"type": "Ready", "status": "True", "reason": "UpgradeSucceeded",
                 "message": "fine", "lastTransitionTime": "2026-01-01T00:00:00Z"},
            ])),
        ),
    ];
    for (name, conditions) in &cases {
        w.release(name, name).await?;
        if let Some(conditions) = conditions {
            w.ns.releases()
                .patch_status(
                    name,
                    &PatchParams::default(),
                    &Patch::Merge(json!({"status": {"conditions": conditions}})),
                )
                .await?;
        }
        let before = w.ns.releases().get(name).await?.metadata.resource_version;
        assert_eq!(w.reconcile(name).await?, Outcome::NothingToDo, "{name}");
        let after = w.ns.releases().get(name).await?.metadata.resource_version;
        assert_eq!(before, after, "{name}: nothing written");
    }
    assert_eq!(w.secret_names().await?.len(), 2 * cases.len());
    Ok(())
}

/// The longest release name the apiserver takes for a label-safe name: 63
/// characters. helm-controller stores it under its shortened Helm release
/// name; a decoy under the full name stays.
#[tokio::test]
async fn a_63_character_release_is_recovered_under_its_shortened_helm_name() -> Result<()> {
    let w = world("long-name").await?;
    let name = format!("web-{}", "a".repeat(59));
    assert_eq!(name.len(), 63);
    let helm_name = shorten_release_name(&name);
    assert!(helm_name.len() <= 53, "{helm_name}");
    w.release(&name, &helm_name).await?;
    w.ns.create_storage_secret(&name, 3, "uninstalling").await?;
    w.ns.mark_stuck(&name).await?;

    assert_eq!(
        w.reconcile(&name).await?,
        Outcome::Recovered { revision: 2 }
    );
    let mut expected = vec![
        names::storage_secret_name(&helm_name, 1),
        names::storage_secret_name(&name, 3),
    ];
    expected.sort();
    assert_eq!(w.secret_names().await?, expected);
    Ok(())
}
