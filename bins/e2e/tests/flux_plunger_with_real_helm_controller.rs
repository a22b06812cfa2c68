//! flux-plunger's controller binary and Flux's real helm-controller on one
//! control plane: the product end to end. Each test runs its own flux-plunger
//! watching only its namespace (`--watch-namespace`), so the stuck releases of
//! the other e2e tests stay stuck.

use std::collections::BTreeMap;

use anyhow::{Context, Result};
use e2e::{
    FluxPlunger, Observed, apply_as_flux_plunger, delete, install, make_stuck, set_suspend,
    wait_gone, wait_until,
};
use plunger::names::{
    FENCE_FINALIZER, HELM_CONTROLLER_FINALIZER, PROCESSED_VERSION_ANNOTATION, reasons,
};
use testkit::helm_storage::revision_statuses;
use testkit::real_helm_controller::{demo_configmap, helm_controller, helmchart_exists, wait_for};
use testkit::{TestNamespace, control_plane};

const RELEASE: &str = "demo";

async fn namespace(prefix: &str) -> Result<TestNamespace> {
    helm_controller();
    let client = control_plane().client().await?;
    TestNamespace::create(&client, prefix).await
}

async fn storage(ns: &TestNamespace) -> Result<Vec<(u64, String)>> {
    revision_statuses(&ns.secrets(), RELEASE).await
}

fn revisions(pairs: &[(u64, &str)]) -> Vec<(u64, String)> {
    pairs.iter().map(|(r, s)| (*r, (*s).to_owned())).collect()
}

async fn configmap_data(ns: &TestNamespace) -> Result<Option<BTreeMap<String, String>>> {
    Ok(demo_configmap(ns, RELEASE)
        .await?
        .map(|c| c.data.unwrap_or_default()))
}

fn greeting(value: &str) -> Option<BTreeMap<String, String>> {
    Some(BTreeMap::from([("greeting".to_owned(), value.to_owned())]))
}

/// `(type, reason)` of the events flux-plunger recorded on the release.
async fn flux_plunger_events(ns: &TestNamespace) -> Result<Vec<(String, String)>> {
    let ours = [
        reasons::SUSPENSION_NOT_OWNED,
        reasons::RECOVERY_DEFERRED,
        reasons::UNSUSPEND_FAILED,
        reasons::TERMINATING_WHILE_SUSPENDED,
        reasons::UNINSTALL_FENCE_HELD,
        reasons::RECOVERED,
    ];
    let mut seen: Vec<(String, String)> = ns
        .events_for(RELEASE)
        .await?
        .into_iter()
        .filter(|e| ours.contains(&e.reason.as_str()))
        .map(|e| (e.type_, e.reason))
        .collect();
    seen.sort();
    seen.dedup();
    Ok(seen)
}

/// Waits for flux-plunger's events on the release to be exactly `expected`
/// (events are written in the background, maybe after the state they report).
async fn assert_flux_plunger_events(ns: &TestNamespace, expected: &[(&str, &str)]) -> Result<()> {
    let expected: Vec<(String, String)> = expected
        .iter()
        .map(|(t, r)| ((*t).to_owned(), (*r).to_owned()))
        .collect();
    let seen = wait_for("flux-plunger's events", || async {
        let seen = flux_plunger_events(ns).await?;
        Ok((seen.len() >= expected.len()).then_some(seen))
    })
    .await?;
    assert_eq!(seen, expected);
    Ok(())
}

#[tokio::test]
async fn flux_plunger_recovers_a_release_the_real_helm_controller_left_stuck() -> Result<()> {
    let ns = namespace("e2e-fp-recover").await?;
    let stuck = make_stuck(&ns, RELEASE).await?;
    assert_eq!((stuck.generation, stuck.observed_generation), (3, Some(2)));

    let flux_plunger = FluxPlunger::start(&ns).await?;
    let recovered = wait_until(&ns, RELEASE, "recovered and Ready=True", Observed::is_ready)
        .await
        .with_context(|| format!("flux-plunger's log:\n{}", flux_plunger.log_text()))?;
    // helm-controller upgraded from the superseded revision 1 once flux-plunger
    // lifted its suspension. The generation is not pinned: flux-plunger's
    // writes are locked on the resourceVersion it last saw, and helm-controller
    // writes status right after each suspension (its suspended pass), so the
    // annotation may meet a 409, be undone and retried: one suspension
    // (generation 5) or more (7, ...).
    assert_eq!(
        recovered,
        Observed {
            generation: recovered.generation,
            observed_generation: Some(recovered.generation),
            finalizers: vec![HELM_CONTROLLER_FINALIZER.to_owned()],
            deleting: false,
            suspend: false,
            ready: Some((
                "True".to_owned(),
                "UpgradeSucceeded".to_owned(),
                format!(
                    "Helm upgrade succeeded for release {}/{RELEASE}.v2 with chart demo@1.0.0",
                    ns.name
                )
            )),
            storage_namespace: Some(ns.name.clone()),
            history_len: 1,
        }
    );
    // Every spec write of flux-plunger's is a suspension or its lift, in
    // pairs: at least one suspension, and each one lifted.
    let spec_writes = recovered.generation - stuck.generation;
    assert!(
        spec_writes >= 2 && spec_writes % 2 == 0,
        "flux-plunger made {spec_writes} spec writes"
    );
    let release = ns.releases().get(RELEASE).await?;
    assert_eq!(
        release
            .metadata
            .annotations
            .unwrap_or_default()
            .get(PROCESSED_VERSION_ANNOTATION)
            .map(String::as_str),
        Some("2")
    );
    assert_eq!(
        storage(&ns).await?,
        revisions(&[(1, "superseded"), (2, "deployed")])
    );
    assert_eq!(configmap_data(&ns).await?, greeting("v3"));
    // Racing helm-controller's status writes shows in the events too: a
    // recovery finished by the undo records no `Recovered`, an acquisition
    // that met two 409s a `RecoveryDeferred`. Never a warning.
    let events = flux_plunger_events(&ns).await?;
    assert!(
        events.iter().all(|(t, r)| t == "Normal"
            && [reasons::RECOVERED, reasons::RECOVERY_DEFERRED].contains(&r.as_str())),
        "{events:?}"
    );
    Ok(())
}

/// A delete landed while flux-plunger held its suspension (here: set up as a
/// flux-plunger that stopped mid-recovery leaves it). helm-controller skipped
/// the uninstall and dropped its finalizer; the fence kept the release. The
/// next flux-plunger lifts its suspension and keeps the fence (SPEC §5a),
/// helm-controller uninstalls, flux-plunger drops the fence (§5d).
#[tokio::test]
async fn flux_plunger_lets_the_real_helm_controller_uninstall_a_release_deleted_during_its_suspension()
-> Result<()> {
    let ns = namespace("e2e-fp-fence").await?;
    install(&ns, RELEASE, "hello").await?;
    apply_as_flux_plunger(&ns, RELEASE, Some(true), true).await?;
    wait_until(
        &ns,
        RELEASE,
        "the suspension observed",
        Observed::is_observed,
    )
    .await?;
    delete(&ns, RELEASE).await?;
    let skipped = wait_until(&ns, RELEASE, "helm-controller's suspended delete", |o| {
        !o.has_helm_controller_finalizer() && o.is_observed()
    })
    .await?;
    assert_eq!(
        (skipped.finalizers, skipped.suspend),
        (vec![FENCE_FINALIZER.to_owned()], true)
    );
    assert_eq!(configmap_data(&ns).await?, greeting("hello"));

    let flux_plunger = FluxPlunger::start(&ns).await?;
    wait_gone(&ns, RELEASE)
        .await
        .with_context(|| format!("flux-plunger's log:\n{}", flux_plunger.log_text()))?;
    assert_eq!(configmap_data(&ns).await?, None);
    assert_eq!(storage(&ns).await?, revisions(&[]));
    assert!(!helmchart_exists(&ns, RELEASE).await?);
    assert_flux_plunger_events(&ns, &[]).await?;
    Ok(())
}

/// Someone else suspended the release and deleted it (a migration keeping the
/// release's objects): that is their decision. flux-plunger drops a fence it
/// finds (SPEC §5b) with a Normal `TerminatingWhileSuspended`, and the objects
/// stay.
#[tokio::test]
async fn flux_plunger_lets_go_of_a_release_someone_else_suspended_and_deleted() -> Result<()> {
    let ns = namespace("e2e-fp-foreign").await?;
    install(&ns, RELEASE, "hello").await?;
    apply_as_flux_plunger(&ns, RELEASE, None, true).await?;
    set_suspend(&ns, RELEASE, true).await?;
    wait_until(
        &ns,
        RELEASE,
        "the suspension observed",
        Observed::is_observed,
    )
    .await?;
    delete(&ns, RELEASE).await?;
    wait_until(&ns, RELEASE, "helm-controller's suspended delete", |o| {
        !o.has_helm_controller_finalizer() && o.is_observed()
    })
    .await?;

    let flux_plunger = FluxPlunger::start(&ns).await?;
    wait_gone(&ns, RELEASE)
        .await
        .with_context(|| format!("flux-plunger's log:\n{}", flux_plunger.log_text()))?;
    assert_eq!(configmap_data(&ns).await?, greeting("hello"));
    assert_eq!(storage(&ns).await?, revisions(&[(1, "deployed")]));
    assert!(helmchart_exists(&ns, RELEASE).await?);
    assert_flux_plunger_events(&ns, &[("Normal", reasons::TERMINATING_WHILE_SUSPENDED)]).await?;
    Ok(())
}
