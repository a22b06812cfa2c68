//! flux-plunger's controller binary and Flux's real helm-controller on one
//! control plane: the product end to end. Each test runs its own flux-plunger
//! watching only its namespace (`--watch-namespace`), so the stuck releases of
//! the other e2e tests stay stuck; the last test runs none, and plays a stolen
//! token of flux-plunger's against the chart's admission guard instead.

use std::collections::BTreeMap;

use anyhow::{Context, Result};
use e2e::{
    FluxPlunger, Observed, Placement, apply_as_flux_plunger, delete, flux_plunger_events, install,
    make_stuck, make_stuck_as, set_suspend, wait_gone, wait_until,
};
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use plunger::apply::request_reconcile;
use plunger::names::{
    FENCE_FINALIZER, FIELD_MANAGER, HELM_CONTROLLER_FINALIZER, PROCESSED_VERSION_ANNOTATION,
};
use plunger::notices::reasons;
use plunger::release::api::helmreleases;
use plunger::release::view::ReleaseView;
use serde_json::json;
use testkit::fixtures::vap_resource;
use testkit::guard::{Guarded, is_refused_by};
use testkit::helm_storage::revision_statuses;
use testkit::real_helm_controller::{
    create_release, demo_configmap, demo_release, helm_controller, helmchart_exists,
    publish_demo_chart, wait_for,
};
use testkit::source_controller::source_controller;
use testkit::{TestNamespace, control_plane};

const RELEASE: &str = "demo";

async fn namespace(prefix: &str) -> Result<TestNamespace> {
    helm_controller();
    source_controller();
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

/// Waits for flux-plunger's events on the release to be exactly `expected`
/// (events are written in the background, maybe after the state they report).
async fn assert_flux_plunger_events(ns: &TestNamespace, expected: &[(&str, &str)]) -> Result<()> {
    let expected: Vec<(String, String)> = expected
        .iter()
        .map(|(t, r)| ((*t).to_owned(), (*r).to_owned()))
        .collect();
    let seen = wait_for("flux-plunger's events", || async {
        let seen = flux_plunger_events(ns, RELEASE).await?;
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
    let events = flux_plunger_events(&ns, RELEASE).await?;
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

/// Who handles the delete that lands while flux-plunger holds its suspension.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FirstToHandle {
    /// helm-controller sees the suspended, deleted release first (it skips
    /// the uninstall and drops its finalizer), then flux-plunger resumes.
    HelmController,
    /// flux-plunger resumes and lets go of its suspension before
    /// helm-controller can finish with the delete (its finalizer removal is
    /// refused by an admission policy until then).
    FluxPlunger,
    /// Another manager lifts flux-plunger's suspension before the delete (a
    /// merge patch of `suspend: false`, as a backup restore or `flux resume`
    /// writes it): helm-controller handles the delete unsuspended over the
    /// history it cleared, uninstalls nothing (`ErrNoLatest`) and drops its
    /// finalizer; then flux-plunger resumes.
    HelmControllerAfterAnotherManagerLifted,
}

/// What a delete during a paused recovery left behind.
#[derive(Debug)]
struct RaceOutcome {
    /// When helm-controller handled the suspended delete first: whether the
    /// release was still there (held) afterwards. `None` when flux-plunger
    /// went first (helm-controller's finalizer removal was refused).
    held_after_suspended_delete: Option<bool>,
    /// helm-controller deleted the release's HelmChart: its deletion path ran
    /// on the unsuspended release (it skips both the uninstall and the
    /// HelmChart while suspended).
    helmchart_deleted: bool,
    storage: Vec<(u64, String)>,
    configmap_left: bool,
    /// `(type, reason)` of flux-plunger's events on the release.
    events: Vec<(String, String)>,
}

/// How the release of a race is placed and left stuck.
#[derive(Debug, Clone, Copy)]
struct Stuck {
    /// The status the newest revision is left in.
    status: &'static str,
    /// Installed in a target namespace under a release name of its own,
    /// stored in a third namespace; else beside the HelmRelease.
    elsewhere: bool,
}

const UNINSTALLING: Stuck = Stuck {
    status: "uninstalling",
    elsewhere: false,
};

/// A real flux-plunger (a test build) recovering a release the real
/// helm-controller left stuck as `stuck` says, paused right after it took
/// its suspension (and, unless `unfenced`, its fence): the delete lands in
/// that window, handled first by `first`. Then everything settles and the
/// release is gone.
async fn delete_during_a_paused_recovery(
    prefix: &str,
    stuck: Stuck,
    first: FirstToHandle,
    unfenced: bool,
) -> Result<RaceOutcome> {
    let race = PausedRecovery::start(prefix, stuck.elsewhere, unfenced).await?;
    make_stuck_as(&race.ns, RELEASE, &race.placement, stuck.status)
        .await
        .with_context(|| race.flux_plunger.log_text())?;
    race.delete_and_settle(first).await
}

/// A test build of flux-plunger that pauses right after it took its
/// suspension (and, unless unfenced, its fence) over the release `RELEASE`
/// of `ns`, once something has left that release stuck.
struct PausedRecovery {
    ns: TestNamespace,
    placement: Placement,
    unfenced: bool,
    /// The directory of the pause files: gone with the race.
    _gate: tempfile::TempDir,
    /// flux-plunger writes it once paused.
    reached: std::path::PathBuf,
    /// flux-plunger goes on once it exists.
    resume: std::path::PathBuf,
    flux_plunger: FluxPlunger,
}

impl PausedRecovery {
    /// A namespace of its own (and, when `elsewhere`, a target and a storage
    /// namespace), and flux-plunger watching it.
    async fn start(prefix: &str, elsewhere: bool, unfenced: bool) -> Result<Self> {
        let ns = namespace(prefix).await?;
        let placement = if elsewhere {
            Placement {
                helm_name: "custom".to_owned(),
                target: namespace(&format!("{prefix}-target")).await?,
                storage: namespace(&format!("{prefix}-storage")).await?,
            }
        } else {
            Placement::beside(&ns, RELEASE)
        };
        let gate = tempfile::tempdir()?;
        let pause = gate.path().join("pause");
        let (reached, resume) = (
            pause.with_extension("reached"),
            pause.with_extension("release"),
        );
        // flux-plunger runs before the release gets stuck, as in a cluster: it
        // acts on the first stuck status. (Over a newest `uninstalled` revision
        // helm-controller shows that status only until its next retry, which
        // tries an install instead and leaves another message.)
        let mut env = vec![
            (
                "FLUX_PLUNGER_TEST_PAUSE_AT",
                std::path::Path::new("acquired"),
            ),
            ("FLUX_PLUNGER_TEST_PAUSE_FILE", pause.as_path()),
        ];
        if unfenced {
            env.push(("FLUX_PLUNGER_TEST_UNFENCED", std::path::Path::new("1")));
        }
        let flux_plunger = FluxPlunger::start_with_env(&ns, &env).await?;
        Ok(Self {
            ns,
            placement,
            unfenced,
            _gate: gate,
            reached,
            resume,
            flux_plunger,
        })
    }

    /// Once the release is stuck: waits for flux-plunger's pause, deletes
    /// the release, lets `first` handle the delete first, lets flux-plunger
    /// go on, and waits until the release is gone.
    async fn delete_and_settle(&self, first: FirstToHandle) -> Result<RaceOutcome> {
        let Self {
            ns,
            placement,
            unfenced,
            reached,
            resume,
            flux_plunger,
            ..
        } = self;
        let log = || flux_plunger.log_text();
        // helm-controller's finalizer removal refused while the refusal is in
        // force: how flux-plunger gets to handle the delete first, for certain.
        let refusal = match first {
            FirstToHandle::FluxPlunger => Some(
                ns.refuse(
                    "keep-helm-controller-finalizer",
                    json!({"apiGroups": ["helm.toolkit.fluxcd.io"], "apiVersions": ["*"], "operations": ["UPDATE"], "resources": ["helmreleases"]}),
                    &format!(
                        "!has(oldObject.metadata.finalizers) || !('{f}' in oldObject.metadata.finalizers) \
                         || (has(object.metadata.finalizers) && '{f}' in object.metadata.finalizers)",
                        f = HELM_CONTROLLER_FINALIZER
                    ),
                    "test: helm-controller's finalizer stays until flux-plunger has resumed",
                )
                .await?,
            ),
            FirstToHandle::HelmController | FirstToHandle::HelmControllerAfterAnotherManagerLifted => {
                None
            }
        };
        if refusal.is_some() {
            wait_for("the refusal in force", || async {
                let params = kube::api::PatchParams {
                    dry_run: true,
                    ..Default::default()
                };
                let drop_finalizers =
                    kube::api::Patch::Merge(json!({"metadata": {"finalizers": []}}));
                let refused = ns
                    .releases()
                    .patch(RELEASE, &params, &drop_finalizers)
                    .await
                    .is_err();
                Ok(refused.then_some(()))
            })
            .await?;
        }
        wait_for(
            "flux-plunger paused after taking its suspension",
            || async { Ok(reached.exists().then_some(())) },
        )
        .await
        .with_context(log)?;
        let held = wait_until(
            ns,
            RELEASE,
            "the suspension observed",
            Observed::is_observed,
        )
        .await?;
        assert!(held.suspend);
        assert_eq!(
            held.finalizers.contains(&FENCE_FINALIZER.to_owned()),
            !*unfenced
        );
        if first == FirstToHandle::HelmControllerAfterAnotherManagerLifted {
            set_suspend(ns, RELEASE, false).await?;
            // helm-controller's pass over the live, unsuspended release is over
            // (it meets the stuck storage again), so what the delete meets is
            // known.
            e2e::wait_stuck_at_this_generation(ns, RELEASE).await?;
        }
        delete(ns, RELEASE).await?;

        let held_after_suspended_delete = match first {
            FirstToHandle::HelmController
            | FirstToHandle::HelmControllerAfterAnotherManagerLifted => {
                wait_for("helm-controller's suspended delete", || async {
                    Ok(match e2e::observe(ns, RELEASE).await? {
                        None => Some(Some(false)),
                        Some(o) => (!o.has_helm_controller_finalizer()).then_some(Some(true)),
                    })
                })
                .await?
            }
            FirstToHandle::FluxPlunger => {
                wait_for("helm-controller refused its finalizer removal", || async {
                    let refused = helm_controller()
                        .log_lines_with("helm-controller's finalizer stays")
                        .iter()
                        .any(|l| l.contains(&ns.name));
                    Ok(refused.then_some(()))
                })
                .await?;
                None
            }
        };
        std::fs::write(resume, b"")?;
        if let Some(refusal) = refusal {
            wait_until(ns, RELEASE, "flux-plunger lifted its suspension", |o| {
                !o.suspend
            })
            .await
            .with_context(log)?;
            refusal.lift().await?;
        }
        wait_gone(ns, RELEASE).await.with_context(log)?;
        Ok(RaceOutcome {
            held_after_suspended_delete,
            helmchart_deleted: !helmchart_exists(ns, RELEASE).await?,
            storage: placement.storage_statuses().await?,
            configmap_left: placement.configmap_data().await?.is_some(),
            events: flux_plunger_events(ns, RELEASE).await?,
        })
    }
}

/// SPEC §5 against the real helm-controller, in both orders: the fence holds
/// the deleted release until helm-controller has handled it unsuspended.
/// helm-controller had cleared `status.history` when it met the stuck storage
/// ("release not managed by controller"), so flux-plunger hands it the newest
/// revision before it lifts its suspension (SPEC §5a): helm-controller's
/// deletion path then runs the Helm uninstall. The release's objects, its
/// storage and its HelmChart are gone, and so is the release. The same when
/// another manager lifted flux-plunger's suspension before the delete: the
/// fence holds the release past helm-controller's empty pass, and
/// flux-plunger hands the history over and asks for another (SPEC §5d).
#[tokio::test]
async fn a_delete_while_the_paused_process_holds_its_suspension_is_held_until_helm_controller_handles_it_unsuspended()
-> Result<()> {
    let races = [
        ("e2e-race-hc-first", FirstToHandle::HelmController),
        ("e2e-race-fp-first", FirstToHandle::FluxPlunger),
        (
            "e2e-race-lifted",
            FirstToHandle::HelmControllerAfterAnotherManagerLifted,
        ),
    ]
    .map(|(prefix, first)| async move {
        let outcome = delete_during_a_paused_recovery(prefix, UNINSTALLING, first, false).await?;
        anyhow::Ok((first, outcome))
    });
    for (first, outcome) in futures::future::try_join_all(races).await? {
        assert_uninstalled(&format!("{first:?}"), &outcome);
    }
    Ok(())
}

/// The release a race left was uninstalled for real, and flux-plunger said
/// it handed the uninstall over.
fn assert_uninstalled(case: &str, outcome: &RaceOutcome) {
    assert_ne!(
        outcome.held_after_suspended_delete,
        Some(false),
        "{case}: {outcome:?}"
    );
    assert!(outcome.helmchart_deleted, "{case}: {outcome:?}");
    assert_eq!(outcome.storage, revisions(&[]), "{case}: {outcome:?}");
    assert!(!outcome.configmap_left, "{case}: {outcome:?}");
    assert!(
        outcome.events.contains(&(
            "Normal".to_owned(),
            reasons::UNINSTALL_HANDED_OVER.to_owned()
        )),
        "{case}: {outcome:?}"
    );
    assert!(
        outcome.events.iter().all(|(t, _)| t == "Normal"),
        "{case}: {outcome:?}"
    );
}

/// The same in every state the real helm-controller leaves stuck, and for a
/// release installed in a target namespace under a release name of its own,
/// with its storage in a third namespace. Not a newest `uninstalled` revision
/// rewritten here: Helm writes that status once it has deleted the objects,
/// so nothing is installed and nothing is handed over (SPEC §5a); the
/// keep-history test below makes that state as Helm does.
#[tokio::test]
async fn a_delete_during_a_paused_recovery_is_uninstalled_from_every_stuck_state_and_storage_place()
-> Result<()> {
    let states = [
        (
            "unknown",
            Stuck {
                status: "unknown",
                elsewhere: false,
            },
        ),
        (
            "elsewhere",
            Stuck {
                status: "uninstalling",
                elsewhere: true,
            },
        ),
    ];
    let cases = states.into_iter().flat_map(|(name, stuck)| {
        [
            (
                format!("e2e-race-{name}-hc"),
                stuck,
                FirstToHandle::HelmController,
            ),
            (
                format!("e2e-race-{name}-fp"),
                stuck,
                FirstToHandle::FluxPlunger,
            ),
        ]
    });
    let races = cases.map(|(prefix, stuck, first)| async move {
        let outcome = delete_during_a_paused_recovery(&prefix, stuck, first, false).await?;
        anyhow::Ok((stuck, first, outcome))
    });
    for (stuck, first, outcome) in futures::future::try_join_all(races).await? {
        assert_uninstalled(&format!("{stuck:?} {first:?}"), &outcome);
    }
    Ok(())
}

/// The HelmRelease that takes the first release's name once it is
/// uninstalled: in a namespace of its own, storing its Helm release there,
/// it installs Helm release `RELEASE` into the first release's namespace, so
/// the demo chart's ConfigMap it creates has the name the first release's
/// had.
const SECOND: &str = "second";

/// Issue 25 item 4 on the real helm-controller. The release's owners uninstall
/// with `keepHistory` (`spec.uninstall.keepHistory: true`); an operator runs
/// the same uninstall with the Helm CLI (`helm uninstall --keep-history`)
/// after an install and an upgrade: Helm deletes the demo chart's ConfigMap,
/// writes revision 2 `uninstalled` and keeps revision 1 `superseded` (Helm's
/// `Uninstall.Run`). A second release then creates a ConfigMap of the same
/// name. The next values change gets the first release stuck: its
/// `status.history` still holds revision 2 as deployed, whose digest no
/// longer matches storage, so helm-controller calls it "Unmanaged", clears
/// the history and upgrades, which Helm refuses with "has no deployed
/// releases". flux-plunger takes its suspension and fence, and the delete
/// lands while it holds them, in both orders. (helm-controller's own
/// keep-history uninstall, an uninstall remediation, records the uninstalled
/// revision in `status.history`; its next pass installs, which Helm refuses
/// without `spec.install.replace`, "cannot reuse a name that is still in
/// use": never the stuck message flux-plunger acts on.)
///
/// Nothing is installed (SPEC §5a): nothing is handed over, helm-controller's
/// deletion path runs over the empty history and uninstalls nothing, and the
/// fence goes. A superseded revision handed over would be a second Helm
/// uninstall: the demo chart has no hooks, so that shows as the objects of
/// revision 1's manifest deleted by name, the second release's ConfigMap
/// among them, and revision 1 purged or marked `uninstalled`. Here the
/// second release's ConfigMap is the one it created, and the storage is as
/// Helm kept it.
#[tokio::test]
async fn a_release_deleted_after_a_keep_history_uninstall_is_not_uninstalled_again_and_a_same_named_object_of_another_release_stays()
-> Result<()> {
    let races = [
        ("e2e-kept-hc", FirstToHandle::HelmController),
        ("e2e-kept-fp", FirstToHandle::FluxPlunger),
    ]
    .map(|(prefix, first)| async move {
        let race = PausedRecovery::start(prefix, false, false).await?;
        let second_ns = namespace(&format!("{prefix}-second")).await?;
        let taken = stuck_after_a_keep_history_uninstall(&race.ns, &second_ns)
            .await
            .with_context(|| race.flux_plunger.log_text())?;
        let outcome = race.delete_and_settle(first).await?;
        let left = demo_configmap(&race.ns, RELEASE).await?;
        let second_storage = revision_statuses(&second_ns.secrets(), RELEASE).await?;
        // The second release is still installed and Ready. Waited for, not
        // read once: helm-controller may be in a pass over it (seen once on
        // v1.4.0); its ConfigMap and storage are checked as they are.
        wait_until(
            &second_ns,
            SECOND,
            "the second release still Ready",
            Observed::is_ready,
        )
        .await?;
        anyhow::Ok((first, taken, left, second_storage, outcome))
    });
    for (first, taken, left, second_storage, outcome) in
        futures::future::try_join_all(races).await?
    {
        let case = format!("{first:?}: {outcome:?}");
        match first {
            FirstToHandle::FluxPlunger => {
                assert_eq!(outcome.held_after_suspended_delete, None, "{case}");
            }
            _ => assert_eq!(
                outcome.held_after_suspended_delete,
                Some(true),
                "the fence held the release past helm-controller's suspended delete: {case}"
            ),
        }
        // helm-controller's deletion path ran on the unsuspended release (it
        // deletes the HelmChart there): the pass a hand-over would have
        // made an uninstall.
        assert!(outcome.helmchart_deleted, "{case}");
        assert_eq!(
            outcome.storage,
            revisions(&[(1, "superseded"), (2, "uninstalled")]),
            "the history as Helm kept it: {case}"
        );
        let left =
            left.with_context(|| format!("the second release's ConfigMap is gone: {case}"))?;
        assert_eq!(
            (&left.metadata.uid, &left.data),
            (&taken.metadata.uid, &greeting("second")),
            "{case}"
        );
        assert_eq!(second_storage, revisions(&[(1, "deployed")]), "{case}");
        assert!(
            !outcome.events.contains(&(
                "Normal".to_owned(),
                reasons::UNINSTALL_HANDED_OVER.to_owned()
            )),
            "{case}"
        );
        assert!(outcome.events.iter().all(|(t, _)| t == "Normal"), "{case}");
    }
    Ok(())
}

/// The state the keep-history test above deletes, by its real causes, in `ns`
/// and `second_ns`: returns the ConfigMap the second release created.
async fn stuck_after_a_keep_history_uninstall(
    ns: &TestNamespace,
    second_ns: &TestNamespace,
) -> Result<k8s_openapi::api::core::v1::ConfigMap> {
    let mut first = demo_release(&ns.name, RELEASE, json!({ "greeting": "hello" }));
    first["spec"]["uninstall"]["keepHistory"] = json!(true);
    publish_demo_chart(ns).await?;
    create_release(ns, first).await?;
    wait_until(ns, RELEASE, "installed and Ready=True", Observed::is_ready).await?;
    e2e::set_greeting(ns, RELEASE, "v2").await?;
    wait_until(ns, RELEASE, "upgraded and Ready=True", Observed::is_ready).await?;
    assert_eq!(
        storage(ns).await?,
        revisions(&[(1, "superseded"), (2, "deployed")])
    );

    e2e::helm_cli(ns, &["uninstall", RELEASE, "--keep-history"])?;
    assert_eq!(
        storage(ns).await?,
        revisions(&[(1, "superseded"), (2, "uninstalled")])
    );
    assert_eq!(configmap_data(ns).await?, None);

    let mut second = demo_release(&second_ns.name, SECOND, json!({ "greeting": "second" }));
    testkit::merge(
        &mut second["spec"],
        json!({ "releaseName": RELEASE, "targetNamespace": ns.name }),
    );
    publish_demo_chart(second_ns).await?;
    create_release(second_ns, second).await?;
    wait_until(
        second_ns,
        SECOND,
        "installed and Ready=True",
        Observed::is_ready,
    )
    .await?;
    let taken = demo_configmap(ns, RELEASE)
        .await?
        .context("the second release's ConfigMap")?;
    assert_eq!(taken.data, greeting("second"));

    e2e::set_greeting(ns, RELEASE, "v3").await?;
    wait_until(
        ns,
        RELEASE,
        "stuck with has no deployed releases",
        e2e::is_stuck,
    )
    .await?;
    Ok(taken)
}

/// The bug the fence exists for, seen by the suite: the same race with the
/// fence switched off (test builds only). helm-controller handles the
/// suspended delete, skips its deletion path and drops its finalizer; nothing
/// holds the release, so it goes at once and its HelmChart is orphaned.
#[tokio::test]
async fn without_the_fence_the_same_delete_skips_helm_controller_s_deletion_path() -> Result<()> {
    let outcome = delete_during_a_paused_recovery(
        "e2e-race-unfenced",
        UNINSTALLING,
        FirstToHandle::HelmController,
        true,
    )
    .await?;
    assert_eq!(
        outcome.held_after_suspended_delete,
        Some(false),
        "{outcome:?}"
    );
    assert!(!outcome.helmchart_deleted, "orphaned: {outcome:?}");
    assert!(outcome.configmap_left, "{outcome:?}");
    assert_eq!(
        outcome.storage,
        revisions(&[(1, "superseded"), (2, "uninstalling")]),
        "the storage stays too: {outcome:?}"
    );
    Ok(())
}

/// A stuck release that flux-plunger has seen but whose recovery waits (here
/// for `--max-recoveries-per-minute`) carries the fence alone (SPEC §4.5).
/// Deleted then, helm-controller's deletion path runs unsuspended over the
/// history it cleared and uninstalls nothing (`ErrNoLatest`); the fence holds
/// the release, flux-plunger hands the history over and asks helm-controller
/// to reconcile again (`reconcile.fluxcd.io/requestedAt`, SPEC §5d), and the
/// uninstall happens. Another release waiting the same way, suspended by
/// someone else and then deleted, keeps its objects: that manager's decision.
#[tokio::test]
async fn a_stuck_release_deleted_while_its_recovery_waits_is_uninstalled_unless_another_manager_suspended_it()
-> Result<()> {
    let ns = namespace("e2e-waiting").await?;
    let names = ["alpha", "beta", "gamma"];
    futures::future::try_join_all(names.map(|name| make_stuck(&ns, name))).await?;
    // One recovery a minute: one release is recovered, the others wait.
    let flux_plunger =
        FluxPlunger::start_with(&ns, &[], &["--max-recoveries-per-minute=1"]).await?;
    let log = || flux_plunger.log_text();
    let waiting: Vec<&str> = wait_for("one release recovered, two fenced and waiting", || async {
        let mut waiting = Vec::new();
        let mut recovered = 0;
        for name in names {
            let Some(o) = e2e::observe(&ns, name).await? else {
                anyhow::bail!("{name} is gone");
            };
            if o.finalizers.contains(&FENCE_FINALIZER.to_owned()) && !o.suspend {
                waiting.push(name);
            } else if o.is_ready() {
                recovered += 1;
            }
        }
        Ok((recovered == 1 && waiting.len() == 2).then_some(waiting))
    })
    .await
    .with_context(log)?;
    let (deleted, suspended) = (waiting[0], waiting[1]);

    set_suspend(&ns, suspended, true).await?;
    delete(&ns, suspended).await?;
    delete(&ns, deleted).await?;
    wait_gone(&ns, deleted).await.with_context(log)?;
    wait_gone(&ns, suspended).await.with_context(log)?;

    assert_eq!(
        demo_configmap(&ns, deleted).await?,
        None,
        "{deleted} uninstalled; flux-plunger's log:\n{}",
        log()
    );
    assert_eq!(
        revision_statuses(&ns.secrets(), deleted).await?,
        revisions(&[])
    );
    assert!(!helmchart_exists(&ns, deleted).await?);
    let handed_over = ns.events_for(deleted).await?;
    assert!(
        handed_over
            .iter()
            .any(|e| e.reason == reasons::UNINSTALL_HANDED_OVER && e.type_ == "Normal"),
        "{handed_over:?}"
    );

    assert!(
        demo_configmap(&ns, suspended).await?.is_some(),
        "{suspended} keeps its objects"
    );
    assert_eq!(
        revision_statuses(&ns.secrets(), suspended).await?,
        revisions(&[(1, "superseded"), (2, "uninstalling")])
    );
    assert!(helmchart_exists(&ns, suspended).await?);
    Ok(())
}

/// The release a forged history names: installed and Ready in a namespace of
/// its own, beside its storage.
const VICTIM: &str = "victim";

/// What the guard's status rule is for (issue 24): a status history is an
/// uninstall order to helm-controller. On a live release with a
/// `status.storageNamespace` and a latest entry, `action.ReleaseTargetChanged`
/// (v1.4.0, v1.6.1 and v1.6.4 alike) compares the spec's storage namespace
/// with the status's, the spec's target namespace and (shortened) release
/// name with the entry's; when one differs, `reconcileRelease` runs
/// `reconcileUninstall` before anything else of the release: a Helm uninstall
/// of the release the entry names, from the storage namespace the status
/// names, with the stuck release's client (here helm-controller's own
/// identity). Then it clears the history and requeues.
///
/// The attacker holds only the chart's controller token. With it, it reads
/// the entry helm-controller keeps for the victim (the token reads every
/// HelmRelease), writes it as flux-plunger's hand-over writes a history, with
/// the victim's storage namespace, on a release helm-controller left stuck
/// (live, its history empty), and asks for a reconcile. The request is
/// written with the same token because the guard admits it (it is
/// flux-plunger's own §5d request, allowed on any release): the history is
/// the only write between the token and the uninstall.
///
/// With the chart's guard on, the history is refused and a finished pass of
/// helm-controller over the stuck release leaves the victim installed. With
/// the guard's binding deleted (what `admissionGuard.enabled=false` leaves),
/// the same writes make helm-controller uninstall the victim: its ConfigMap
/// (the demo chart names its namespace) and its storage go.
#[tokio::test]
async fn a_history_forged_with_flux_plunger_s_token_on_a_stuck_release_is_refused_by_the_guard_and_without_it_uninstalls_the_release_it_names()
-> Result<()> {
    let ns = namespace("e2e-guard-stuck").await?;
    let victim_ns = namespace("e2e-guard-victim").await?;
    let victim = Placement::beside(&victim_ns, VICTIM);
    // The chart's guard of an install of its own: the guard-off half deletes
    // its binding, which leaves the install every other test shares alone.
    let (guard, _, _) = futures::try_join!(
        ns.guarded(),
        make_stuck(&ns, RELEASE),
        install(&victim_ns, VICTIM, "precious"),
    )?;
    let controller = guard.controller_client().await?;
    // The entry helm-controller itself keeps for the victim, read with the
    // same token (it may read every HelmRelease): every field the uninstall
    // and the target comparison read is the victim's own.
    let entry = helmreleases(controller.clone(), &victim_ns.name)
        .get(VICTIM)
        .await?
        .data["status"]["history"][0]
        .clone();
    assert_eq!(
        (&entry["name"], &entry["namespace"], &entry["version"]),
        (&json!(VICTIM), &json!(victim_ns.name), &json!(1)),
        "helm-controller's entry of the victim: {entry}"
    );

    // The guard on: the history is refused, by the status rule.
    match forge_history(&controller, &ns, &entry, &victim_ns.name).await {
        Err(kube::Error::Api(status))
            if is_refused_by(&status, &guard.policy)
                && status.message.contains("status.history") => {}
        other => panic!("the forged history was not refused by the guard's status rule: {other:?}"),
    }
    let handled = request_reconcile_and_wait(&controller, &ns, "stolen-token-guard-on").await?;
    let handled = Observed::of(&handled);
    assert!(e2e::is_stuck(&handled), "{handled:?}");
    assert_eq!(
        (handled.history_len, handled.storage_namespace),
        (0, Some(ns.name.clone()))
    );
    assert_eq!(victim.configmap_data().await?, greeting("precious"));
    assert_eq!(
        victim.storage_statuses().await?,
        revisions(&[(1, "deployed")])
    );
    assert!(
        e2e::observe(&victim_ns, VICTIM)
            .await?
            .is_some_and(|o| o.is_ready()),
        "the victim stays installed and Ready"
    );
    let target_changed = "release target configuration changed";
    let log_of_stuck = || {
        helm_controller()
            .log_lines_with(&format!("\"namespace\": \"{}\"", ns.name))
            .join("\n")
    };
    assert!(
        !log_of_stuck().contains(target_changed),
        "{}",
        log_of_stuck()
    );

    // The guard off: the same writes, admitted, are an uninstall of the victim.
    turn_off(&guard, &ns).await?;
    let written = forge_history(&controller, &ns, &entry, &victim_ns.name).await?;
    let status = &written.data["status"];
    assert_eq!(
        (
            &status["history"][0]["name"],
            &status["history"][0]["namespace"],
            &status["storageNamespace"]
        ),
        (
            &json!(VICTIM),
            &json!(victim_ns.name),
            &json!(victim_ns.name)
        )
    );
    request_reconcile_and_wait(&controller, &ns, "stolen-token-guard-off").await?;
    let log = log_of_stuck();
    assert_eq!(victim.configmap_data().await?, None, "uninstalled:\n{log}");
    assert_eq!(victim.storage_statuses().await?, revisions(&[]), "{log}");
    // The uninstall was helm-controller's changed target, not anything else.
    assert!(
        log.contains(&format!("{target_changed} (storage namespace)")),
        "{log}"
    );
    Ok(())
}

/// `entry` and `storage_namespace` written on the stuck release as `controller`,
/// as flux-plunger's hand-over writes a history (`plunger::apply::write_history`:
/// through the status subresource, as manager `flux-plunger`, a merge patch
/// locked on the resourceVersion read). helm-controller writes a stuck
/// release's status on every retry: read again on a 409.
async fn forge_history(
    controller: &kube::Client,
    ns: &TestNamespace,
    entry: &serde_json::Value,
    storage_namespace: &str,
) -> kube::Result<DynamicObject> {
    let releases = helmreleases(controller.clone(), &ns.name);
    let params = PatchParams {
        field_manager: Some(FIELD_MANAGER.to_owned()),
        ..PatchParams::default()
    };
    loop {
        let read = releases.get(RELEASE).await?;
        let patch = json!({
            "metadata": {"resourceVersion": read.metadata.resource_version},
            "status": {"history": [entry], "storageNamespace": storage_namespace},
        });
        match releases
            .patch_status(RELEASE, &params, &Patch::Merge(patch))
            .await
        {
            Err(kube::Error::Api(status)) if status.code == 409 => continue,
            written => return written,
        }
    }
}

/// flux-plunger's reconcile request (`plunger::apply::request_reconcile`,
/// read again on a 409) with `requested_at`, as `controller`; then waits
/// until helm-controller has finished a pass that saw it (it records
/// `status.lastHandledReconcileAt` as the pass ends, failed or not).
async fn request_reconcile_and_wait(
    controller: &kube::Client,
    ns: &TestNamespace,
    requested_at: &str,
) -> Result<DynamicObject> {
    let releases = helmreleases(controller.clone(), &ns.name);
    loop {
        let view = ReleaseView::from_object(&releases.get(RELEASE).await?);
        match request_reconcile(controller, &view, requested_at).await {
            Err(kube::Error::Api(status)) if status.code == 409 => continue,
            requested => requested?,
        };
        break;
    }
    // helm-controller records the request in the patch that opens its pass
    // (`Ready=Unknown`, "Fulfilling prerequisites"): the pass is over once
    // `Ready` is decided again.
    wait_for(
        &format!("helm-controller to handle reconcile request {requested_at}"),
        || async {
            let release = ns.releases().get(RELEASE).await?;
            let handled = release.data["status"]["lastHandledReconcileAt"] == requested_at
                && Observed::of(&release)
                    .ready_status()
                    .is_some_and(|status| status != "Unknown");
            Ok(handled.then_some(release))
        },
    )
    .await
}

/// Turns the guard of `guard`'s install off, as `admissionGuard.enabled=false`
/// leaves a cluster: deletes its binding (a policy is enforced only through a
/// binding) and waits until the apiserver admits what the guard refuses, the
/// controller's (dry-run) delete of an ordinary Secret.
async fn turn_off(guard: &Guarded, ns: &TestNamespace) -> Result<()> {
    const PROBE: &str = "guard-off-probe";
    let bindings: Api<DynamicObject> = Api::all_with(
        ns.client.clone(),
        &vap_resource(
            "ValidatingAdmissionPolicyBinding",
            "validatingadmissionpolicybindings",
        ),
    );
    bindings
        .delete(&guard.policy, &DeleteParams::default())
        .await?;
    let probe = Secret {
        metadata: kube::api::ObjectMeta {
            name: Some(PROBE.to_owned()),
            ..Default::default()
        },
        ..Default::default()
    };
    ns.secrets().create(&PostParams::default(), &probe).await?;
    let as_controller: Api<Secret> = Api::namespaced(guard.controller_client().await?, &ns.name);
    let dry_run = DeleteParams {
        dry_run: true,
        ..DeleteParams::default()
    };
    wait_for("the guard no longer enforced", || async {
        match as_controller.delete(PROBE, &dry_run).await {
            Ok(_) => Ok(Some(())),
            Err(kube::Error::Api(status)) if is_refused_by(&status, &guard.policy) => Ok(None),
            Err(e) => Err(e.into()),
        }
    })
    .await
}
