//! Crash at every step of the pre-delete hook: the sweeper is SIGKILLed
//! right before and right after each of its writes (the Deployment's
//! scale-down, a release's guarded JSON patch, the Lease's removal); a rerun
//! of the hook, as helm-controller's retry of the uninstall runs it, must
//! finish the job and report exactly what it did, and once helm-controller
//! has answered nothing is left fenced, suspended by us or Terminating.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Context, Result};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{Api, DeleteParams, PostParams};
use plunger::lease::{Attempt, LeaseLock};
use plunger::release::view::ReleaseView;
use plunger::test_hooks::SweepStep;
use serde_json::json;
use testkit::crash::{PauseGate, Settled, kill9, release_words};
use testkit::guard::Guarded;
use testkit::process::LoggedProcess;
use testkit::{SimulatedHelmController, TestNamespace, control_plane};
use tokio::process::Command;

/// The Lease the chart's guard allows the hook to remove.
const LEASE: &str = testkit::guard::LEASE;

/// The releases, in the order the hook meets them: one suspended by us with
/// the fence, one with a bare fence, one deleted and uninstalled (the fence
/// is all that holds it), one deleted that helm-controller has not answered.
const SUSPENDED: &str = "r1-suspended";
const BARE: &str = "r2-bare-fence";
const UNINSTALLED: &str = "r3-uninstalled";
const PENDING: &str = "r4-uninstall-pending";
const RELEASES: [&str; 4] = [SUSPENDED, BARE, UNINSTALLED, PENDING];

struct Case {
    /// The fail point as `FLUX_PLUNGER_TEST_PAUSE_AT` lists it.
    point: &'static str,
    /// The Deployment's replicas, the Lease, the first release and the last
    /// while the hook waits at the point.
    at_kill: &'static str,
}

macro_rules! crash_cases {
    ($($test:ident: at $point:literal, state $state:literal;)*) => {
        const CASES: &[Case] = &[$(Case { point: $point, at_kill: $state }),*];
        $(
            #[tokio::test]
            async fn $test() -> Result<()> {
                let case = CASES.iter().find(|c| c.point == $point).expect("listed");
                crash_at(case)
                    .await
                    .with_context(|| format!("sweep killed at {}", case.point))
            }
        )*
    };
}

crash_cases! {
    before_scale_down: at "before-scale-down",
        state "replicas 1, lease; r1-suspended: live suspended fenced; r4-uninstall-pending: terminating fenced";
    scaled_down: at "scaled-down",
        state "replicas 0, lease; r1-suspended: live suspended fenced; r4-uninstall-pending: terminating fenced";
    before_first_release_patch: at "before-release-patch",
        state "replicas 0, lease; r1-suspended: live suspended fenced; r4-uninstall-pending: terminating fenced";
    first_release_patched: at "release-patched",
        state "replicas 0, lease; r1-suspended: live; r4-uninstall-pending: terminating fenced";
    before_the_patch_that_skips_an_uninstall: at "before-release-patch@4",
        state "replicas 0, lease; r1-suspended: live; r4-uninstall-pending: terminating fenced";
    the_patch_that_skips_an_uninstall_patched: at "release-patched@4",
        state "replicas 0, lease; r1-suspended: live; r4-uninstall-pending: terminating";
    before_lease_delete: at "before-lease-delete",
        state "replicas 0, lease; r1-suspended: live; r4-uninstall-pending: terminating";
    lease_deleted: at "lease-deleted",
        state "replicas 0, no lease; r1-suspended: live; r4-uninstall-pending: terminating";
}

#[test]
fn every_write_of_the_sweep_is_crashed_at_before_and_after() {
    for step in SweepStep::ALL {
        assert!(
            CASES.iter().any(|c| c.point == step.name()),
            "no crash case at {}",
            step.name()
        );
    }
}

async fn crash_at(case: &Case) -> Result<()> {
    // The hook lists every namespace: one at a time.
    let _turn = testkit::cluster_wide_turn().await;
    let client = control_plane().client().await?;
    let ns = TestNamespace::create(&client, "sweep-crash").await?;
    // The chart installed in this namespace: the hook's ServiceAccount under
    // the chart's admission guard, which allows it this Deployment and Lease.
    let guarded = ns.guarded().await?;
    let hc = SimulatedHelmController::new(client.clone(), &ns.name);
    arrange(&ns, &guarded, &hc).await?;

    let gate = PauseGate::new()?;
    let point = case.point;
    let (mut first, _dir) = start_hook(&ns, &guarded, &gate.env(&[point]))?;
    gate.wait_reached(point, &mut first.child).await?;
    let state = observe(&ns, &guarded).await?;
    kill9(&mut first.child).await?;
    assert_eq!(
        state, case.at_kill,
        "the state at {point} is not what the point claims"
    );

    // The killed run's log is all that is left of it: a release it let go
    // of without the uninstall must be named there, even when it was killed
    // right after the write.
    if !ReleaseView::from_object(&ns.releases().get(PENDING).await?).has_fence() {
        let log = first.log();
        assert!(
            log.lines()
                .any(|l| l.contains(&format!("{}/{PENDING}", ns.name)) && l.contains("uninstall")),
            "the killed run let {PENDING} go without its uninstall and did not say so:\n{log}"
        );
    }

    // What the rerun must report: every release still fenced, the pending
    // one let go of without its uninstall, and the Lease it removes.
    let mut fenced = Vec::new();
    for name in RELEASES {
        if let Some(object) = ns.releases().get_opt(name).await?
            && ReleaseView::from_object(&object).has_fence()
        {
            fenced.push(name);
        }
    }
    let mut expected = vec![format!(
        "scaled Deployment {}/{} to 0",
        ns.name, guarded.deployment
    )];
    for name in &fenced {
        expected.push(if *name == PENDING {
            format!("released {}/{name} WITHOUT an uninstall: it was being deleted and helm-controller had not uninstalled it; its resources may be left", ns.name)
        } else {
            format!("released {}/{name}", ns.name)
        });
    }
    let without = usize::from(fenced.contains(&PENDING));
    expected.push(format!(
        "released {n} of {n} fenced HelmReleases, {without} without an uninstall",
        n = fenced.len()
    ));
    let leases: Api<Lease> = Api::namespaced(client.clone(), &ns.name);
    if leases.get_opt(LEASE).await?.is_some() {
        expected.push(format!("removed the leader Lease {}/{LEASE}", ns.name));
    }
    expected.push("every fence was released".to_owned());

    let (status, stdout, stderr) = rerun_hook(&ns, &guarded).await?;
    assert!(
        status.success(),
        "the rerun failed: {status}\n{stdout}\n{stderr}"
    );
    assert_eq!(stdout.lines().collect::<Vec<_>>(), expected, "{stderr}");
    assert_eq!(replicas(&ns, &guarded).await?, 0);
    assert!(
        leases.get_opt(LEASE).await?.is_none(),
        "the Lease is removed"
    );

    // helm-controller answers the pending delete: the fence no longer holds
    // it, so it is uninstalled and goes.
    let (helm_controller, stop) = hc.clone().spawn(Duration::from_millis(200));
    let outcome = Settled {
        live: vec![SUSPENDED.into(), BARE.into()],
        deleted: vec![UNINSTALLED.into(), PENDING.into()],
        ..Default::default()
    }
    .wait(&ns, &hc, None)
    .await;
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    helm_controller.await?;
    outcome
}

/// The Deployment (replicas 1, no pod: nothing runs pods here), the Lease,
/// and the four releases.
async fn arrange(
    ns: &TestNamespace,
    guarded: &Guarded,
    hc: &SimulatedHelmController,
) -> Result<()> {
    let labels = BTreeMap::from([(
        "app.kubernetes.io/name".to_owned(),
        "flux-plunger".to_owned(),
    )]);
    let deployment: Deployment = serde_json::from_value(json!({
        "metadata": {"name": guarded.deployment},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {"containers": [{"name": "controller", "image": "flux-plunger"}]},
            },
        },
    }))?;
    Api::<Deployment>::namespaced(ns.client.clone(), &ns.name)
        .create(&PostParams::default(), &deployment)
        .await?;
    let mut lock = LeaseLock::new(
        ns.client.clone(),
        &ns.name,
        LEASE,
        "flux-plunger-7d9f-abcde",
        Duration::from_secs(27),
    );
    anyhow::ensure!(lock.try_acquire_or_renew().await? == Attempt::Held);

    for name in RELEASES {
        ns.create_release(name, json!({})).await?;
        hc.install(name).await?;
        hc.handle(name).await?;
        ns.apply_as_flux_plunger(name, name == SUSPENDED).await?;
    }
    for name in [UNINSTALLED, PENDING] {
        ns.releases().delete(name, &DeleteParams::default()).await?;
    }
    // helm-controller has answered one delete (not suspended: uninstalled,
    // its finalizer dropped); the fence is all that holds that release.
    hc.handle(UNINSTALLED).await?;
    Ok(())
}

/// The Deployment's replicas, the Lease, and the first and last releases, in words.
async fn observe(ns: &TestNamespace, guarded: &Guarded) -> Result<String> {
    let lease = Api::<Lease>::namespaced(ns.client.clone(), &ns.name)
        .get_opt(LEASE)
        .await?;
    let mut parts = vec![format!(
        "replicas {}, {}",
        replicas(ns, guarded).await?,
        if lease.is_some() { "lease" } else { "no lease" }
    )];
    for name in [SUSPENDED, PENDING] {
        let view = ReleaseView::from_object(&ns.releases().get(name).await?);
        let words = release_words(Some(&view));
        parts.push(format!("{name}: {}", words.join(" ")));
    }
    Ok(parts.join("; "))
}

async fn replicas(ns: &TestNamespace, guarded: &Guarded) -> Result<i32> {
    let deployment = Api::<Deployment>::namespaced(ns.client.clone(), &ns.name)
        .get(&guarded.deployment)
        .await?;
    Ok(deployment.spec.and_then(|s| s.replicas).unwrap_or(1))
}

/// The hook as the chart's Job runs it, under its ServiceAccount (`guarded`),
/// whose kubeconfig it writes into `dir`.
fn hook_command(ns: &TestNamespace, guarded: &Guarded, dir: &std::path::Path) -> Result<Command> {
    let kubeconfig = dir.join("kubeconfig");
    guarded.write_hook_kubeconfig(&kubeconfig)?;
    let mut command = Command::new(env!("CARGO_BIN_EXE_flux-plunger-sweep"));
    command
        .arg("hook")
        .arg(format!("--kubeconfig={}", kubeconfig.display()))
        .arg(format!("--namespace={}", ns.name))
        .arg(format!("--deployment={}", guarded.deployment))
        .arg(format!("--leader-election-lease-name={LEASE}"))
        .arg("--log-encoding=console")
        .env_remove("RUST_LOG");
    Ok(command)
}

/// The hook run that is killed; its log is shown if the test fails.
fn start_hook(
    ns: &TestNamespace,
    guarded: &Guarded,
    env: &[(&str, String)],
) -> Result<(LoggedProcess, tempfile::TempDir)> {
    let dir = tempfile::tempdir()?;
    let mut command = hook_command(ns, guarded, dir.path())?;
    command.envs(env.iter().map(|(k, v)| (*k, v.as_str())));
    Ok((LoggedProcess::spawn(command, "sweep")?, dir))
}

/// The rerun: its exit status, report (stdout) and log (stderr).
async fn rerun_hook(
    ns: &TestNamespace,
    guarded: &Guarded,
) -> Result<(std::process::ExitStatus, String, String)> {
    let dir = tempfile::tempdir()?;
    let output = tokio::time::timeout(
        Duration::from_secs(240),
        hook_command(ns, guarded, dir.path())?.output(),
    )
    .await
    .context("the rerun did not end")??;
    Ok((
        output.status,
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    ))
}
