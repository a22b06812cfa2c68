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

/// A tenant's release pointed at another namespace's storage (docs/security.md): helm-controller,
/// acting for it as its ServiceAccount, could not reach that storage, and nor does flux-plunger:
/// the victim's revisions are neither listed, read nor deleted, and the tenant is told why.
#[tokio::test]
async fn a_release_pointed_at_storage_its_service_account_cannot_reach_gets_nothing_there()
-> Result<()> {
    let w = world("reach-tenant").await?;
    let victim = TestNamespace::create(&w.client, "reach-victim").await?;
    service_account_using_secrets_in(&w, "deployer", &w.ns.name).await?;
    stuck_elsewhere(
        &w,
        "web",
        json!({"serviceAccountName": "deployer", "storageNamespace": victim.name, "releaseName": "victim"}),
        &victim,
        "victim",
    )
    .await?;
    let offset = audit::mark();

    let outcome = w.reconciler().reconcile(&w.ns.name, "web").await?;

    assert!(
        matches!(&outcome, Outcome::Skipped(SkipReason::StorageOutOfReach { why }) if why.contains("deployer")),
        "{outcome:?}"
    );
    assert_eq!(
        secret_names(&victim).await?,
        vec![
            "sh.helm.release.v1.victim.v1",
            "sh.helm.release.v1.victim.v2"
        ]
    );
    let controller = testkit::guard::shared()?.controller_user();
    let ours = logged_until_now(&w, &victim.name, offset)
        .await?
        .into_iter()
        .filter(|r| r.user == controller)
        .map(|r| r.label())
        .collect::<Vec<_>>();
    assert_eq!(
        ours,
        vec!["create localsubjectaccessreviews"],
        "flux-plunger only asked"
    );
    let events = w.ns.events_for("web").await?;
    assert!(
        events
            .iter()
            .any(|e| e.reason == "StorageOutOfReach" && e.type_ == "Warning"),
        "the tenant is told: {events:?}"
    );
    Ok(())
}

/// The same release, once its ServiceAccount may use the Secrets there, is recovered as
/// helm-controller would act for it: the review bounds flux-plunger's reach, it is not a refusal
/// of every other namespace.
#[tokio::test]
async fn a_release_whose_service_account_reaches_its_storage_elsewhere_is_recovered() -> Result<()>
{
    let w = world("reach-allowed").await?;
    let storage = TestNamespace::create(&w.client, "reach-store").await?;
    service_account_using_secrets_in(&w, "deployer", &storage.name).await?;
    stuck_elsewhere(
        &w,
        "web",
        json!({"storageNamespace": storage.name, "releaseName": "custom"}),
        &storage,
        "custom",
    )
    .await?;
    let reconciler = w.reconciler_defaulting_to("deployer");

    assert_eq!(
        reconciler.reconcile(&w.ns.name, "web").await?,
        Outcome::Recovered { revision: 2 }
    );
    assert_eq!(
        secret_names(&storage).await?,
        vec!["sh.helm.release.v1.custom.v1"]
    );
    Ok(())
}

/// The same rule for a release being deleted: the hand-over reads no payload of another
/// namespace's storage for a release whose ServiceAccount could not, and names why.
#[tokio::test]
async fn a_deleted_release_pointed_at_storage_out_of_its_reach_reads_no_payload_there() -> Result<()>
{
    let w = world("reach-deleted").await?;
    let victim = TestNamespace::create(&w.client, "reach-victim-del").await?;
    stuck_elsewhere(
        &w,
        "web",
        json!({"storageNamespace": victim.name, "releaseName": "victim"}),
        &victim,
        "victim",
    )
    .await?;
    w.leave_our_suspension("web").await?;
    w.delete("web").await?;
    assert_eq!(
        w.hc.handle("web").await?,
        Handled::UninstallSkippedBecauseSuspended
    );
    let reconciler = w.reconciler_defaulting_to("nobody");
    let offset = audit::mark();

    let outcome = reconciler.reconcile(&w.ns.name, "web").await?;

    assert_eq!(
        outcome,
        Outcome::Lifted { kept_fence: true },
        "nothing can be handed over: our suspension goes, the fence holds until the warning"
    );
    let controller = testkit::guard::shared()?.controller_user();
    let ours = logged_until_now(&w, &victim.name, offset)
        .await?
        .into_iter()
        .filter(|r| r.user == controller)
        .map(|r| r.label())
        .collect::<Vec<_>>();
    assert_eq!(ours, vec!["create localsubjectaccessreviews"]);
    assert_eq!(secret_names(&victim).await?.len(), 2);
    Ok(())
}
