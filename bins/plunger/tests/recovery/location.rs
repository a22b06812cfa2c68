//! Where the storage is (SPEC §4.6, §9): listed as metadata, under the Helm release name helm-
//! controller computes, in the namespace it uses.

use super::*;

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
