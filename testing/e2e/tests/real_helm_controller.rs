//! Flux's real helm-controller (built from its Go module by `make tools`)
//! against the local control plane: install, the stuck state flux-plunger
//! exists to recover, the manual fix it automates, and helm-controller's
//! delete handling — the orphaning the uninstall fence prevents.
//!
//! Which version runs: `$FLUX_PLUNGER_HELM_CONTROLLER_VERSION`, else the pin
//! in `hack/tools/versions.mk`; `make e2e` runs this file once per version of
//! `HELM_CONTROLLER_E2E_VERSIONS`. Every assertion below holds on each of them.
//!
//! The facts these tests pin (and that flux-plunger's simulated helm-controller
//! reproduces), for a release of the demo chart (one ConfigMap):
//! - the apiserver bumps `metadata.generation` on every spec change and on the
//!   delete of a release held by a finalizer; helm-controller never writes it;
//! - helm-controller writes `status.observedGeneration = metadata.generation`
//!   after every pass that ends without an error — a suspended pass included —
//!   and leaves it behind after a failed one (the stuck state);
//! - on delete, a suspended release loses `finalizers.fluxcd.io` without a Helm
//!   uninstall; with another finalizer holding it, the same pass then records
//!   `observedGeneration = generation`, so "finalizer gone and generation
//!   observed" does not by itself mean the uninstall ran;
//! - a terminating release that is unsuspended is uninstalled on the next pass,
//!   though `finalizers.fluxcd.io` is already gone.

use anyhow::Result;
use e2e::{
    Observed, apply_as_flux_plunger, delete, install, is_stuck, make_stuck, observe,
    remove_finalizer, set_greeting, set_suspend, wait_gone, wait_until,
};
use k8s_openapi::api::core::v1::Secret;
use kube::api::DeleteParams;
use plunger::names::{FENCE_FINALIZER, HELM_CONTROLLER_FINALIZER, storage_secret_name};
use std::collections::BTreeMap;
use testkit::helm_storage::{revision_statuses, set_revision_status};
use testkit::real_helm_controller::{demo_configmap, helm_controller, helmchart_exists, wait_for};
use testkit::source_controller::source_controller;
use testkit::{TestNamespace, control_plane};

const RELEASE: &str = "demo";

async fn namespace(prefix: &str) -> Result<TestNamespace> {
    helm_controller();
    source_controller();
    let client = control_plane().client().await?;
    TestNamespace::create(&client, prefix).await
}

/// The `data` of the demo ConfigMap, or `None` if it does not exist.
async fn configmap_data(ns: &TestNamespace) -> Result<Option<BTreeMap<String, String>>> {
    Ok(demo_configmap(ns, RELEASE)
        .await?
        .map(|c| c.data.unwrap_or_default()))
}

fn greeting(value: &str) -> Option<BTreeMap<String, String>> {
    Some(BTreeMap::from([("greeting".to_owned(), value.to_owned())]))
}

async fn storage(ns: &TestNamespace) -> Result<Vec<(u64, String)>> {
    revision_statuses(&ns.secrets(), RELEASE).await
}

fn revisions(pairs: &[(u64, &str)]) -> Vec<(u64, String)> {
    pairs.iter().map(|(r, s)| (*r, (*s).to_owned())).collect()
}

/// Revisions 1..=n, every one `superseded` but the newest, which is
/// `deployed`: the history of a release upgraded in place, however often.
fn is_upgraded_history(stored: &[(u64, String)]) -> bool {
    let numbered_from_one = stored.iter().zip(1..).all(|((n, _), i)| *n == i);
    let (newest, older) = match stored.split_last() {
        Some(split) => split,
        None => return false,
    };
    numbered_from_one
        && newest.1 == "deployed"
        && older.iter().all(|(_, status)| status == "superseded")
}

fn finalizers(names: &[&str]) -> Vec<String> {
    names.iter().map(|f| (*f).to_owned()).collect()
}

fn condition(status: &str, reason: &str, message: String) -> Option<(String, String, String)> {
    Some((status.to_owned(), reason.to_owned(), message))
}

fn install_succeeded(ns: &TestNamespace) -> Option<(String, String, String)> {
    condition(
        "True",
        "InstallSucceeded",
        format!(
            "Helm install succeeded for release {}/{RELEASE}.v1 with chart demo@1.0.0",
            ns.name
        ),
    )
}

fn stuck_condition(ns: &TestNamespace) -> Option<(String, String, String)> {
    condition(
        "False",
        "UpgradeFailed",
        format!(
            "Helm upgrade failed for release {}/{RELEASE} with chart demo@1.0.0: \"{RELEASE}\" has no deployed releases",
            ns.name
        ),
    )
}

#[tokio::test]
async fn a_helmrelease_is_installed_by_the_real_helm_controller_and_becomes_ready() -> Result<()> {
    let ns = namespace("e2e-install").await?;
    let installed = install(&ns, RELEASE, "hello").await?;
    assert_eq!(
        installed,
        Observed {
            generation: 1,
            observed_generation: Some(1),
            finalizers: finalizers(&[HELM_CONTROLLER_FINALIZER]),
            deleting: false,
            suspend: false,
            ready: install_succeeded(&ns),
            storage_namespace: Some(ns.name.clone()),
            history_len: 1,
        }
    );
    assert_eq!(configmap_data(&ns).await?, greeting("hello"));
    assert_eq!(storage(&ns).await?, revisions(&[(1, "deployed")]));
    assert!(helmchart_exists(&ns, RELEASE).await?);
    Ok(())
}

#[tokio::test]
async fn an_upgrade_over_a_newest_revision_left_uninstalling_is_stuck_with_has_no_deployed_releases()
-> Result<()> {
    let ns = namespace("e2e-stuck").await?;
    let stuck = make_stuck(&ns, RELEASE).await?;
    assert_eq!(
        stuck,
        Observed {
            generation: 3,
            // The failed pass records no observedGeneration.
            observed_generation: Some(2),
            finalizers: finalizers(&[HELM_CONTROLLER_FINALIZER]),
            deleting: false,
            suspend: false,
            ready: stuck_condition(&ns),
            storage_namespace: Some(ns.name.clone()),
            // "Unmanaged" cleared the history.
            history_len: 0,
        }
    );
    // Helm refused before writing anything: no revision 3, the objects of
    // revision 2 untouched.
    assert_eq!(
        storage(&ns).await?,
        revisions(&[(1, "superseded"), (2, "uninstalling")])
    );
    assert_eq!(configmap_data(&ns).await?, greeting("v2"));

    // It stays stuck: helm-controller retries, and each retry fails the same.
    let failed_passes = |ns: &TestNamespace| {
        helm_controller()
            .log_lines_with(&format!("\"namespace\": \"{}\"", ns.name))
            .iter()
            .filter(|l| l.contains("Reconciler error") && l.contains("has no deployed releases"))
            .count()
    };
    wait_for("a second failed upgrade", || async {
        Ok((failed_passes(&ns) >= 2).then_some(()))
    })
    .await?;
    assert_eq!(observe(&ns, RELEASE).await?, Some(stuck));
    assert_eq!(
        storage(&ns).await?,
        revisions(&[(1, "superseded"), (2, "uninstalling")])
    );
    Ok(())
}

#[tokio::test]
async fn suspending_deleting_the_newest_storage_secret_and_resuming_recovers_a_stuck_release()
-> Result<()> {
    let ns = namespace("e2e-fix").await?;
    make_stuck(&ns, RELEASE).await?;

    set_suspend(&ns, RELEASE, true).await?;
    let suspended = wait_until(
        &ns,
        RELEASE,
        "the suspension observed",
        Observed::is_observed,
    )
    .await?;
    // A suspended pass records observedGeneration and leaves conditions alone.
    assert_eq!(
        (suspended.generation, suspended.ready),
        (4, stuck_condition(&ns))
    );

    ns.secrets()
        .delete(&storage_secret_name(RELEASE, 2), &DeleteParams::default())
        .await?;
    set_suspend(&ns, RELEASE, false).await?;
    let recovered =
        wait_until(&ns, RELEASE, "recovered and Ready=True", Observed::is_ready).await?;
    assert_eq!(
        recovered,
        Observed {
            generation: 5,
            observed_generation: Some(5),
            finalizers: finalizers(&[HELM_CONTROLLER_FINALIZER]),
            deleting: false,
            suspend: false,
            ready: condition(
                "True",
                "UpgradeSucceeded",
                format!(
                    "Helm upgrade succeeded for release {}/{RELEASE}.v2 with chart demo@1.0.0",
                    ns.name
                )
            ),
            storage_namespace: Some(ns.name.clone()),
            history_len: 1,
        }
    );
    // Helm upgraded from the `superseded` revision 1 and wrote revision 2 anew.
    assert_eq!(
        storage(&ns).await?,
        revisions(&[(1, "superseded"), (2, "deployed")])
    );
    assert_eq!(configmap_data(&ns).await?, greeting("v3"));
    Ok(())
}

#[tokio::test]
async fn the_newest_revision_statuses_that_leave_an_upgrade_stuck_are_uninstalling_unknown_and_uninstalled()
-> Result<()> {
    #[derive(Debug, PartialEq, Eq)]
    enum Outcome {
        Stuck,
        Upgraded,
    }
    let cases = [
        ("uninstalling", Outcome::Stuck),
        ("unknown", Outcome::Stuck),
        ("uninstalled", Outcome::Stuck),
        ("failed", Outcome::Upgraded),
        ("superseded", Outcome::Upgraded),
        ("pending-install", Outcome::Upgraded),
        ("pending-upgrade", Outcome::Upgraded),
        ("pending-rollback", Outcome::Upgraded),
    ];
    let runs = cases.iter().map(|(status, _)| async move {
        let ns = namespace("e2e-status").await?;
        install(&ns, RELEASE, "hello").await?;
        set_greeting(&ns, RELEASE, "v2").await?;
        wait_until(&ns, RELEASE, "upgraded", Observed::is_ready).await?;
        set_revision_status(&ns.secrets(), RELEASE, 2, status).await?;
        set_greeting(&ns, RELEASE, "v3").await?;
        let settled = wait_until(&ns, RELEASE, "upgraded or stuck", |o| {
            o.is_ready() || is_stuck(o)
        })
        .await?;
        let outcome = if is_stuck(&settled) {
            Outcome::Stuck
        } else {
            Outcome::Upgraded
        };
        let log = helm_controller()
            .log_lines_with(&format!("\"namespace\": \"{}\"", ns.name))
            .join("\n");
        anyhow::Ok((
            outcome,
            storage(&ns).await?,
            configmap_data(&ns).await?,
            log,
        ))
    });
    let results = futures::future::try_join_all(runs).await?;
    for ((status, expected), (outcome, stored, data, log)) in cases.iter().zip(results) {
        let context = format!("newest revision {status}; helm-controller's log of it:\n{log}");
        assert_eq!(&outcome, expected, "{context}");
        match outcome {
            Outcome::Stuck => {
                assert_eq!(
                    stored,
                    revisions(&[(1, "superseded"), (2, status)]),
                    "{context}"
                );
                assert_eq!(data, greeting("v2"), "{context}");
            }
            // A `pending-*` revision is first marked `failed` (helm-controller's
            // unlock); then Helm upgrades from the `failed` or `superseded`
            // newest revision, which ends `superseded`. helm-controller may
            // upgrade twice: a reconcile of its own (a requeue left over from
            // waiting for the chart at install) can land between the status
            // change and the new values, and upgrades the release with the
            // old values first — CI saw revisions 1–4 once.
            Outcome::Upgraded => {
                assert!(
                    stored.len() >= 3 && is_upgraded_history(&stored),
                    "{stored:?}: {context}"
                );
                assert_eq!(data, greeting("v3"), "{context}");
            }
        }
    }
    Ok(())
}

#[tokio::test]
async fn deleting_a_live_helmrelease_uninstalls_it() -> Result<()> {
    let ns = namespace("e2e-del-live").await?;
    install(&ns, RELEASE, "hello").await?;
    delete(&ns, RELEASE).await?;
    wait_gone(&ns, RELEASE).await?;
    assert_eq!(configmap_data(&ns).await?, None);
    assert_eq!(storage(&ns).await?, revisions(&[]));
    assert!(!helmchart_exists(&ns, RELEASE).await?);
    Ok(())
}

/// The bug flux-plunger's fence exists for: helm-controller's
/// `reconcileDelete` runs the uninstall only `if !obj.Spec.Suspend`, and drops
/// `finalizers.fluxcd.io` either way.
#[tokio::test]
async fn deleting_a_suspended_helmrelease_drops_the_finalizer_without_uninstalling() -> Result<()> {
    let ns = namespace("e2e-del-suspended").await?;
    install(&ns, RELEASE, "hello").await?;
    set_suspend(&ns, RELEASE, true).await?;
    let suspended = wait_until(
        &ns,
        RELEASE,
        "the suspension observed",
        Observed::is_observed,
    )
    .await?;
    assert_eq!(suspended.generation, 2);

    let deleting = delete(&ns, RELEASE)
        .await?
        .expect("held by helm-controller's finalizer");
    // The delete of a release held by a finalizer bumps its generation.
    assert_eq!(
        (deleting.generation, deleting.deleting, deleting.finalizers),
        (3, true, finalizers(&[HELM_CONTROLLER_FINALIZER]))
    );
    wait_gone(&ns, RELEASE).await?;

    // Orphaned: the ConfigMap, Helm's storage and the HelmChart all remain.
    assert_eq!(configmap_data(&ns).await?, greeting("hello"));
    assert_eq!(storage(&ns).await?, revisions(&[(1, "deployed")]));
    assert!(helmchart_exists(&ns, RELEASE).await?);
    Ok(())
}

/// The fence at work, step by step as flux-plunger goes (SPEC §4 step 8,
/// §5 a and d): suspend with the fence, the delete lands, lift the suspension
/// keeping the fence, wait for the uninstall, drop the fence.
#[tokio::test]
async fn a_fenced_helmrelease_deleted_while_suspended_is_uninstalled_once_the_suspension_is_lifted()
-> Result<()> {
    let ns = namespace("e2e-del-fenced").await?;
    install(&ns, RELEASE, "hello").await?;
    let acquired = apply_as_flux_plunger(&ns, RELEASE, Some(true), true).await?;
    assert_eq!(
        (acquired.generation, acquired.suspend, acquired.finalizers),
        (
            2,
            true,
            finalizers(&[HELM_CONTROLLER_FINALIZER, FENCE_FINALIZER])
        )
    );
    wait_until(
        &ns,
        RELEASE,
        "the suspension observed",
        Observed::is_observed,
    )
    .await?;

    let deleting = delete(&ns, RELEASE).await?.expect("held by two finalizers");
    assert_eq!((deleting.generation, deleting.deleting), (3, true));

    // helm-controller handles the suspended delete: its finalizer goes, the
    // uninstall does not run, and the pass records observedGeneration.
    let skipped = wait_until(&ns, RELEASE, "helm-controller's suspended delete", |o| {
        !o.has_helm_controller_finalizer() && o.is_observed()
    })
    .await?;
    assert_eq!(
        skipped,
        Observed {
            generation: 3,
            observed_generation: Some(3),
            finalizers: finalizers(&[FENCE_FINALIZER]),
            deleting: true,
            suspend: true,
            ready: install_succeeded(&ns),
            storage_namespace: Some(ns.name.clone()),
            history_len: 1,
        }
    );
    assert_eq!(configmap_data(&ns).await?, greeting("hello"));
    assert_eq!(storage(&ns).await?, revisions(&[(1, "deployed")]));

    // flux-plunger lifts its suspension and keeps the fence: the apply that
    // leaves `spec.suspend` out unsets it (flux-plunger was its only owner).
    let lifted = apply_as_flux_plunger(&ns, RELEASE, None, true).await?;
    assert_eq!(
        (
            lifted.generation,
            lifted.suspend,
            lifted.observed_generation
        ),
        (4, false, Some(3))
    );
    let uninstalled = wait_until(&ns, RELEASE, "the unsuspended generation observed", |o| {
        o.is_observed()
    })
    .await?;
    assert_eq!(uninstalled, uninstalled_under_the_fence(&ns, 4));
    nothing_left_but_the_fenced_object_then_gone(&ns).await
}

#[tokio::test]
async fn a_fenced_helmrelease_deleted_while_live_is_uninstalled_at_once() -> Result<()> {
    let ns = namespace("e2e-del-fenced-live").await?;
    install(&ns, RELEASE, "hello").await?;
    // Finalizers are metadata: adding the fence does not bump the generation.
    let fenced = apply_as_flux_plunger(&ns, RELEASE, None, true).await?;
    assert_eq!(fenced.generation, 1);

    let deleting = delete(&ns, RELEASE).await?.expect("held by two finalizers");
    assert_eq!((deleting.generation, deleting.deleting), (2, true));
    let uninstalled = wait_until(&ns, RELEASE, "helm-controller's delete", |o| {
        !o.has_helm_controller_finalizer() && o.is_observed()
    })
    .await?;
    assert_eq!(uninstalled, uninstalled_under_the_fence(&ns, 2));
    nothing_left_but_the_fenced_object_then_gone(&ns).await
}

/// The release of `ns` as helm-controller leaves it once it has uninstalled
/// generation `generation`: held by the fence alone, its history empty.
fn uninstalled_under_the_fence(ns: &TestNamespace, generation: i64) -> Observed {
    Observed {
        generation,
        observed_generation: Some(generation),
        finalizers: finalizers(&[FENCE_FINALIZER]),
        deleting: true,
        suspend: false,
        ready: condition(
            "False",
            "UninstallSucceeded",
            format!(
                "Helm uninstall succeeded for release {}/{RELEASE}.v1 with chart demo@1.0.0",
                ns.name
            ),
        ),
        storage_namespace: None,
        history_len: 0,
    }
}

/// The uninstall removed what the release installed, its storage and its
/// HelmChart; with the fence removed, the release goes.
async fn nothing_left_but_the_fenced_object_then_gone(ns: &TestNamespace) -> Result<()> {
    assert_eq!(configmap_data(ns).await?, None);
    assert_eq!(storage(ns).await?, revisions(&[]));
    assert!(!helmchart_exists(ns, RELEASE).await?);
    remove_finalizer(ns, RELEASE, FENCE_FINALIZER).await?;
    wait_gone(ns, RELEASE).await
}

#[tokio::test]
async fn storage_secrets_carry_the_labels_and_type_flux_plunger_lists_by() -> Result<()> {
    let ns = namespace("e2e-storage").await?;
    install(&ns, RELEASE, "hello").await?;
    let secret: Secret = ns.secrets().get(&storage_secret_name(RELEASE, 1)).await?;
    assert_eq!(secret.type_.as_deref(), Some("helm.sh/release.v1"));
    let labels = secret.metadata.labels.unwrap_or_default();
    let expected = BTreeMap::from([
        ("modifiedAt".to_owned(), labels["modifiedAt"].clone()),
        ("name".to_owned(), RELEASE.to_owned()),
        ("owner".to_owned(), "helm".to_owned()),
        ("status".to_owned(), "deployed".to_owned()),
        ("version".to_owned(), "1".to_owned()),
    ]);
    assert_eq!(labels, expected);
    Ok(())
}

/// Beyond the original (SPEC §9): flux-plunger computes where a release's Helm
/// storage is from the spec alone, exactly as helm-controller names it — a
/// `targetNamespace` prefix, shortened past 53 characters.
#[tokio::test]
async fn flux_plunger_computes_the_helm_release_name_the_real_helm_controller_uses() -> Result<()> {
    use plunger::release::view::ReleaseView;
    use plunger::storage::view::{StorageLocation, default_release_name, shorten_release_name};
    let ns = namespace("e2e-identity").await?;
    let target = namespace("e2e-identity-target").await?;
    let name = "a-release-whose-name-is-long-enough";
    let mut release = testkit::real_helm_controller::demo_release(
        &ns.name,
        name,
        serde_json::json!({"greeting": "hi"}),
    );
    release["spec"]["targetNamespace"] = serde_json::json!(target.name);
    testkit::real_helm_controller::publish_demo_chart(&ns).await?;
    testkit::real_helm_controller::create_release(&ns, release).await?;
    let ready = e2e::wait_until(
        &ns,
        name,
        "installed and Ready=True",
        e2e::Observed::is_ready,
    )
    .await?;
    assert!(ready.is_ready());

    let view = ReleaseView::from_object(&ns.releases().get(name).await?);
    let computed = shorten_release_name(&default_release_name(&view));
    assert!(
        default_release_name(&view).len() > 53,
        "the name is long enough to be shortened"
    );
    assert_eq!(
        view.status_latest_history_name.as_deref(),
        Some(computed.as_str()),
        "helm-controller's name"
    );
    assert_eq!(
        view.status_storage_namespace.as_deref(),
        Some(ns.name.as_str())
    );
    // And the storage is where flux-plunger looks for it, from the spec alone.
    let mut spec_only = view.clone();
    spec_only.status_latest_history_name = None;
    spec_only.status_storage_namespace = None;
    let location = StorageLocation::of(&spec_only);
    assert_eq!(
        location,
        StorageLocation {
            namespace: ns.name.clone(),
            release_name: computed.clone()
        }
    );
    let stored = testkit::helm_storage::revision_statuses(&ns.secrets(), &computed).await?;
    assert_eq!(stored, vec![(1, "deployed".to_owned())]);
    Ok(())
}
