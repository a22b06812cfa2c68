//! The drain sidecar as a process against the local control plane (SPEC §6).

use std::time::{Duration, Instant};

use anyhow::Result;
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use plunger::install::Install;
use plunger::lease::{Attempt, LeaseLock};
use plunger::names::{FENCE_FINALIZER, HELM_CONTROLLER_FINALIZER};
use plunger::release::view::ReleaseView;
use serde_json::json;
use testkit::process::LoggedProcess;
use testkit::{Handled, SimulatedHelmController, TestNamespace, control_plane};
use tokio::process::Command;

const POD: &str = "flux-plunger-7d9f-abcde";

struct Sidecar {
    process: LoggedProcess,
    _dir: tempfile::TempDir,
}

/// How a drain ended: its exit status, its log, and how long it took from
/// SIGTERM to the exit.
type Drained = (std::process::ExitStatus, String, Duration);

/// One drain as a pod's stop runs it: the sidecar started (see [`start`]),
/// then sent SIGTERM once it idles.
async fn drain(ns: &TestNamespace, grace: &str) -> Result<Drained> {
    start(ns, grace, &[]).await?.terminate().await
}

/// [`drain`] scoped by its flags to `ns` and the releases labelled
/// `tenant=a` (see [`label_tenant_a`]).
async fn scoped_drain(ns: &TestNamespace) -> Result<Drained> {
    let scope = [
        format!("--watch-namespace={}", ns.name),
        "--watch-label-selector=tenant=a".to_owned(),
    ];
    start(ns, "90", &scope).await?.terminate().await
}

/// Starts the sidecar as the chart installed in `ns` runs it (its
/// ServiceAccount, its admission guard, its Lease), with `extra` flags, and
/// waits until it idles, signal handlers installed.
async fn start(ns: &TestNamespace, grace: &str, extra: &[String]) -> Result<Sidecar> {
    let dir = tempfile::tempdir()?;
    let kubeconfig = dir.path().join("kubeconfig");
    ns.guarded()
        .await?
        .write_controller_kubeconfig(&kubeconfig)?;
    let mut command = Command::new(env!("CARGO_BIN_EXE_flux-plunger-drain"));
    command
        .arg(format!("--kubeconfig={}", kubeconfig.display()))
        .arg(format!("--shutdown-grace-period-seconds={grace}"))
        .arg("--log-encoding=console")
        .args(extra)
        .env("POD_NAME", POD)
        .env("POD_NAMESPACE", &ns.name)
        .env_remove("RUST_LOG");
    let process = LoggedProcess::spawn(command, "drain")?;
    process
        .wait_logged("idle until SIGTERM", Duration::from_secs(20))
        .await?;
    Ok(Sidecar { process, _dir: dir })
}

impl Sidecar {
    /// Sends SIGTERM and waits for the exit.
    async fn terminate(mut self) -> Result<Drained> {
        let started = Instant::now();
        let status = self.process.terminate(Duration::from_secs(150)).await?;
        let took = started.elapsed();
        Ok((status, self.process.log(), took))
    }
}

async fn setup(prefix: &str) -> Result<(TestNamespace, SimulatedHelmController)> {
    // Callers hold `testkit::cluster_wide_turn()`: a drain acts on every namespace.
    let client = control_plane().client().await?;
    let ns = TestNamespace::create(&client, prefix).await?;
    let hc = SimulatedHelmController::new(client, &ns.name);
    Ok((ns, hc))
}

/// Makes `identity` the holder of the namespace's Lease.
async fn lead(ns: &TestNamespace, identity: &str) -> Result<()> {
    let mut lock = LeaseLock::new(
        ns.client.clone(),
        &ns.name,
        "flux-plunger",
        identity,
        Duration::from_secs(27),
    );
    assert_eq!(lock.try_acquire_or_renew().await?, Attempt::Held);
    Ok(())
}

async fn lease_holder(ns: &TestNamespace) -> Result<Option<String>> {
    let leases: Api<Lease> = Api::namespaced(ns.client.clone(), &ns.name);
    Ok(leases
        .get("flux-plunger")
        .await?
        .spec
        .and_then(|s| s.holder_identity))
}

/// An installed release with helm-controller's finalizer.
async fn installed(ns: &TestNamespace, hc: &SimulatedHelmController, name: &str) -> Result<()> {
    ns.create_release(name, json!({})).await?;
    hc.install(name).await?;
    assert_eq!(hc.handle(name).await?, Handled::AddedFinalizer);
    Ok(())
}

/// [`installed`], then held by flux-plunger's fence and, with `suspend`, its
/// suspension, as a process stopped mid-recovery leaves it.
async fn fenced(
    ns: &TestNamespace,
    hc: &SimulatedHelmController,
    name: &str,
    suspend: bool,
) -> Result<()> {
    installed(ns, hc, name).await?;
    ns.apply_as_flux_plunger(name, suspend).await?;
    Ok(())
}

/// Labels `name` `tenant=a`, the selector [`scoped_drain`] watches.
async fn label_tenant_a(ns: &TestNamespace, name: &str) -> Result<()> {
    ns.releases()
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"tenant": "a"}}})),
        )
        .await?;
    Ok(())
}

/// [`fenced`] with the suspension, then deleted: `Terminating`, its
/// uninstall waiting for the fence to go.
async fn deleted_while_fenced(
    ns: &TestNamespace,
    hc: &SimulatedHelmController,
    name: &str,
) -> Result<()> {
    fenced(ns, hc, name, true).await?;
    ns.releases().delete(name, &DeleteParams::default()).await?;
    Ok(())
}

async fn view(ns: &TestNamespace, name: &str) -> Result<Option<ReleaseView>> {
    Ok(ns
        .releases()
        .get_opt(name)
        .await?
        .map(|o| ReleaseView::from_object(&o)))
}

#[tokio::test]
async fn a_drain_releases_live_fences_and_leaves_foreign_suspensions_alone() -> Result<()> {
    let _turn = testkit::cluster_wide_turn().await;
    let (ns, hc) = setup("drain-live").await?;
    fenced(&ns, &hc, "mid-recovery", true).await?;
    fenced(&ns, &hc, "bare-fence", false).await?;
    installed(&ns, &hc, "foreign").await?;
    ns.update_suspend_as("foreign", "kubectl-patch", true)
        .await?;
    ns.apply_as_flux_plunger("foreign", false).await?;
    lead(&ns, POD).await?;

    let (status, log, took) = drain(&ns, "90").await?;

    assert!(status.success(), "{status:?}");
    assert!(
        took < Duration::from_secs(10),
        "released promptly: {took:?}"
    );
    assert!(log.contains("drain complete: no fence left"), "{log}");
    let mid = view(&ns, "mid-recovery").await?.unwrap();
    assert!(!mid.suspend && !mid.has_fence());
    assert!(
        mid.has_helm_controller_finalizer(),
        "helm-controller's finalizer is kept"
    );
    assert!(!view(&ns, "bare-fence").await?.unwrap().has_fence());
    let foreign = view(&ns, "foreign").await?.unwrap();
    assert!(
        foreign.suspend,
        "another manager's suspension is left alone"
    );
    assert!(!foreign.has_fence());
    assert_eq!(lease_holder(&ns).await?, None, "the Lease was handed over");
    Ok(())
}

/// A fence nobody touched since the drain listed it costs one request: the
/// write, preconditioned on the listed resourceVersion (no read before it).
#[tokio::test]
async fn a_drain_writes_each_unchanged_fence_once_from_its_listing() -> Result<()> {
    let _turn = testkit::cluster_wide_turn().await;
    let (ns, hc) = setup("drain-once").await?;
    let names: Vec<String> = (0..5).map(|i| format!("held-{i}")).collect();
    for name in &names {
        fenced(&ns, &hc, name, true).await?;
    }
    lead(&ns, POD).await?;

    let offset = testkit::audit::mark();
    let (status, log, _) = drain(&ns, "90").await?;
    assert!(status.success(), "{status:?}\n{log}");
    for name in &names {
        let release = view(&ns, name).await?.unwrap();
        assert!(!release.suspend && !release.has_fence(), "{name} is held");
    }

    // The drain runs as the chart's ServiceAccount of this namespace; the
    // test and its helm-controller write as the admin.
    let ours = format!("system:serviceaccount:{}:", ns.name);
    let on_releases: Vec<(String, String)> = testkit::audit::read_since(offset)?
        .into_iter()
        .filter(|r| r.user.starts_with(&ours) && r.resource() == "helmreleases")
        .filter(|r| r.namespace.as_deref() == Some(ns.name.as_str()))
        .map(|r| (r.verb, r.name))
        .collect();
    for name in &names {
        let verbs: Vec<&str> = on_releases
            .iter()
            .filter(|(_, n)| n == name)
            .map(|(verb, _)| verb.as_str())
            .collect();
        assert_eq!(verbs, ["patch"], "the drain's requests on {name}");
    }
    Ok(())
}

#[tokio::test]
async fn a_drain_carries_a_deleted_release_through_the_uninstall() -> Result<()> {
    let _turn = testkit::cluster_wide_turn().await;
    let (ns, hc) = setup("drain-delete").await?;
    deleted_while_fenced(&ns, &hc, "web").await?;
    lead(&ns, POD).await?;
    let (helm_controller, stop) = hc.clone().spawn(Duration::from_millis(300));

    let (status, log, _) = drain(&ns, "90").await?;
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    helm_controller.await?;

    assert!(status.success(), "{status:?}");
    assert!(log.contains("drain complete: no fence left"), "{log}");
    assert!(view(&ns, "web").await?.is_none(), "the release is gone");
    assert!(
        !hc.resources_exist("web").await?,
        "uninstalled, not orphaned"
    );
    assert_eq!(hc.decisions_for("web").last(), Some(&Handled::Uninstalled));
    Ok(())
}

#[tokio::test]
async fn when_helm_controller_never_answers_the_fence_outlives_the_deadline() -> Result<()> {
    let _turn = testkit::cluster_wide_turn().await;
    let (ns, hc) = setup("drain-deadline").await?;
    deleted_while_fenced(&ns, &hc, "web").await?;
    lead(&ns, POD).await?;

    // G = 40 s: the drain deadline is 15 s.
    let (status, log, took) = drain(&ns, "40").await?;

    assert_eq!(
        status.code(),
        Some(3),
        "a drain that leaves fences says so in its exit code: {status:?}"
    );
    // It works until 2 s before its deadline (kept for the handover), and
    // never past the deadline.
    assert!(
        took >= Duration::from_secs(13) && took <= Duration::from_secs(16),
        "{took:?}"
    );
    assert!(
        log.contains("drain deadline reached with fences left"),
        "{log}"
    );
    assert!(
        log.contains(&format!("{}/web", ns.name)),
        "the release is named: {log}"
    );
    let web = view(&ns, "web").await?.unwrap();
    assert!(!web.suspend, "our suspension was lifted");
    assert!(
        web.has_fence(),
        "the fence stays: helm-controller has not uninstalled"
    );
    assert!(
        web.finalizers
            .iter()
            .any(|f| f == HELM_CONTROLLER_FINALIZER)
    );
    assert!(hc.resources_exist("web").await?);
    Ok(())
}

#[tokio::test]
async fn a_pod_that_never_led_does_not_drain() -> Result<()> {
    let _turn = testkit::cluster_wide_turn().await;
    let (ns, hc) = setup("drain-follower").await?;
    fenced(&ns, &hc, "web", true).await?;
    lead(&ns, "another-pod").await?;
    let before = ns.releases().get("web").await?;

    let (status, log, _) = drain(&ns, "90").await?;

    assert!(status.success());
    assert!(log.contains("not the last leader"), "{log}");
    let after = ns.releases().get("web").await?;
    assert_eq!(
        after.metadata.resource_version,
        before.metadata.resource_version
    );
    assert_eq!(lease_holder(&ns).await?.as_deref(), Some("another-pod"));
    Ok(())
}

#[tokio::test]
async fn a_lease_that_ran_out_while_nobody_took_it_is_still_drained() -> Result<()> {
    let _turn = testkit::cluster_wide_turn().await;
    let (ns, hc) = setup("drain-overrun").await?;
    fenced(&ns, &hc, "web", true).await?;
    lead(&ns, POD).await?;
    // The controller overran its stop: its last renewal is long past.
    let leases: Api<Lease> = Api::namespaced(ns.client.clone(), &ns.name);
    leases
        .patch(
            "flux-plunger",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"renewTime": "2020-01-01T00:00:00.000000Z"}})),
        )
        .await?;

    let (status, log, _) = drain(&ns, "90").await?;

    assert!(status.success());
    assert!(log.contains("drain complete"), "{log}");
    let web = view(&ns, "web").await?.unwrap();
    assert!(!web.suspend && !web.has_fence());
    Ok(())
}

#[tokio::test]
async fn a_grace_period_out_of_range_or_fractional_is_refused_with_the_flag_named() -> Result<()> {
    for bad in ["39", "141", "90.7", "abc"] {
        let output = std::process::Command::new(env!("CARGO_BIN_EXE_flux-plunger-drain"))
            .arg(format!("--shutdown-grace-period-seconds={bad}"))
            .output()?;
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{bad}: {stderr}");
        assert!(
            stderr.contains("--shutdown-grace-period-seconds"),
            "{bad}: {stderr}"
        );
        assert!(
            stderr.contains("40") && stderr.contains("140"),
            "{bad}: {stderr}"
        );
    }
    Ok(())
}

#[tokio::test]
async fn a_fence_another_manager_also_lists_is_released_and_the_log_says_so_truthfully()
-> Result<()> {
    let _turn = testkit::cluster_wide_turn().await;
    let (ns, hc) = setup("drain-foreign-fence").await?;
    installed(&ns, &hc, "web").await?;
    // A hand edit lists the fence under its own manager (a merge patch of the
    // whole list), and flux-plunger's recovery holds it too.
    let params = PatchParams {
        field_manager: Some("kubectl-patch".into()),
        ..Default::default()
    };
    ns.releases()
        .patch(
            "web",
            &params,
            &Patch::Merge(
                json!({"metadata": {"finalizers": [HELM_CONTROLLER_FINALIZER, FENCE_FINALIZER]}}),
            ),
        )
        .await?;
    ns.apply_as_flux_plunger("web", true).await?;
    lead(&ns, POD).await?;

    // G = 40 s: a fence that never goes ends the drain at 15 s.
    let (status, log, _) = drain(&ns, "40").await?;

    assert!(status.success(), "{status:?}");
    assert!(log.contains("drain complete: no fence left"), "{log}");
    let web = view(&ns, "web").await?.unwrap();
    assert!(!web.suspend, "the suspension was lifted");
    assert_eq!(web.finalizers, vec![HELM_CONTROLLER_FINALIZER]);
    Ok(())
}

#[tokio::test]
async fn a_scoped_drain_releases_only_the_fences_in_its_namespaces_and_selector() -> Result<()> {
    let _turn = testkit::cluster_wide_turn().await;
    let (ours, hc) = setup("drain-scope").await?;
    let theirs = TestNamespace::create(&ours.client, "drain-other-tenant").await?;
    let their_hc = SimulatedHelmController::new(ours.client.clone(), &theirs.name);
    for name in ["in-scope", "unlabelled"] {
        fenced(&ours, &hc, name, true).await?;
    }
    label_tenant_a(&ours, "in-scope").await?;
    fenced(&theirs, &their_hc, "held", true).await?;
    label_tenant_a(&theirs, "held").await?;
    lead(&ours, POD).await?;

    let (status, log, _) = scoped_drain(&ours).await?;
    let left_alone = [
        view(&ours, "unlabelled").await?.unwrap(),
        view(&theirs, "held").await?.unwrap(),
    ];
    testkit::strip_fences(&ours).await?;
    testkit::strip_fences(&theirs).await?;

    assert!(status.success(), "{status:?}");
    assert!(log.contains("drain complete: no fence left"), "{log}");
    let in_scope = view(&ours, "in-scope").await?.unwrap();
    assert!(!in_scope.suspend && !in_scope.has_fence());
    for release in left_alone {
        assert!(
            release.suspended_by_us() && release.has_fence(),
            "{} is another install's to release",
            release.key()
        );
    }
    Ok(())
}

#[tokio::test]
async fn a_drain_releases_its_own_fences_outside_its_selector_and_never_another_installs()
-> Result<()> {
    let _turn = testkit::cluster_wide_turn().await;
    let (ns, hc) = setup("drain-own").await?;
    let own = Install::from_lease(&ns.name, "flux-plunger");
    // Fenced by this install, then relabelled: its selector no longer
    // matches the release.
    installed(&ns, &hc, "relabelled").await?;
    ns.apply_as_install("relabelled", true, own.fence_label_value())
        .await?;
    // In its scope, fenced by another install side by side.
    installed(&ns, &hc, "theirs").await?;
    ns.apply_as_install("theirs", true, "tenant-b.flux-plunger")
        .await?;
    label_tenant_a(&ns, "theirs").await?;
    lead(&ns, POD).await?;

    let (status, log, _) = scoped_drain(&ns).await?;
    let theirs = view(&ns, "theirs").await?.unwrap();
    testkit::strip_fences(&ns).await?;

    assert!(status.success(), "{status:?}");
    assert!(log.contains("drain complete: no fence left"), "{log}");
    let relabelled = view(&ns, "relabelled").await?.unwrap();
    assert!(
        !relabelled.suspend && !relabelled.has_fence() && !relabelled.fence_labelled(),
        "{relabelled:?}"
    );
    assert!(
        theirs.suspended_by_us()
            && theirs.has_fence()
            && theirs.fence_label.as_deref() == Some("tenant-b.flux-plunger"),
        "another install's fence is that install's to release: {theirs:?}"
    );
    Ok(())
}

#[tokio::test]
async fn console_logs_written_to_a_pipe_carry_no_colour_codes() -> Result<()> {
    // Nobody leads in this namespace: the drain reads the Lease and ends.
    let (ns, _) = setup("drain-console").await?;

    let (status, log, _) = drain(&ns, "90").await?;

    assert!(status.success(), "{status:?}");
    assert!(log.contains("not the last leader"), "{log}");
    assert!(!log.contains('\u{1b}'), "escape codes in a pipe: {log:?}");
    Ok(())
}
