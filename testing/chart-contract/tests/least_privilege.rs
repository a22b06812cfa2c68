//! Least privilege, for real: with the chart installed, the controller and the
//! drain sidecar do their whole job under the chart's own ServiceAccount,
//! nothing but the chart's rendered RBAC (a token of that ServiceAccount on
//! the RBAC-enabled local apiserver) and the chart's admission guard.

use std::time::Duration;

use anyhow::Result;
use chart_contract::check_uses_exactly_what_is_granted;
use chart_contract::install::Setup;
use k8s_openapi::api::core::v1::Secret;
use kube::Api;
use kube::api::{Patch, PatchParams, PostParams};
use plunger::names::FIELD_MANAGER;
use plunger::notices::reasons;
use plunger::release::view::ReleaseView;
use serde_json::json;
use testkit::audit;
use testkit::control_plane::workspace_binary;
use testkit::process::LoggedProcess;
use testkit::{Handled, SimulatedHelmController, TestNamespace, control_plane, eventually};
use tokio::process::Command;

const POD: &str = "flux-plunger-6d5f7-abcde";

#[tokio::test]
async fn the_controller_and_the_drain_need_nothing_beyond_the_charts_rbac() -> Result<()> {
    need_nothing_beyond_the_charts_rbac(false).await
}

/// Scoped to its namespace (`controller.watchNamespaces`), the chart grants
/// nothing cluster-wide on HelmReleases, Secrets or Events: the controller
/// and the drain still do their whole job, and ask the apiserver for nothing
/// outside their namespaces (a request there would be refused).
#[tokio::test]
async fn scoped_to_a_namespace_the_controller_and_the_drain_need_only_its_roles() -> Result<()> {
    need_nothing_beyond_the_charts_rbac(true).await
}

async fn need_nothing_beyond_the_charts_rbac(scoped: bool) -> Result<()> {
    let _turn = testkit::cluster_wide_turn().await;
    let prefix = if scoped {
        "least-privilege-scoped"
    } else {
        "least-privilege"
    };
    let setup = Setup::new(prefix).await?;
    let apps = TestNamespace::create(&setup.ns.client, &format!("{prefix}-apps")).await?;
    // Where one release keeps its storage, out of its ServiceAccount's reach.
    let store = TestNamespace::create(&setup.ns.client, &format!("{prefix}-store")).await?;
    let scope = format!("controller.watchNamespaces={{{}}}", apps.name);
    let storage_scope = format!("controller.storageNamespaces={{{}}}", store.name);
    if scoped {
        setup.install(&["--set", &scope, "--set", &storage_scope])?;
        let controller = control_plane()
            .service_account_client(&setup.ns.client, &setup.ns.name, &setup.fullname())
            .await?;
        // The guard's probe, in the watched namespace: RBAC refuses it in
        // the release namespace first.
        testkit::guard::wait_enforced(&setup.ns.client, &controller, &apps.name, &setup.fullname())
            .await?;
    } else {
        setup.install(&[])?;
        setup.wait_for_guard().await?;
    }
    // Only the binaries' requests count, not the guard's probe.
    let offset = audit::mark();
    let plane = control_plane();
    let admin = plane.client().await?;
    // The ServiceAccount the chart created, and only what the chart grants it.
    let dir = tempfile::tempdir()?;
    let kubeconfig = dir.path().join("chart-sa.kubeconfig");
    plane
        .write_service_account_kubeconfig(&admin, &setup.ns.name, &setup.fullname(), &kubeconfig)
        .await?;

    let hc = SimulatedHelmController::new(admin.clone(), &apps.name);
    apps.create_release("web", json!({})).await?;
    assert_eq!(hc.handle("web").await?, Handled::AddedFinalizer);
    apps.create_storage_secret("web", 1, "superseded").await?;
    apps.create_storage_secret("web", 2, "uninstalling").await?;
    apps.mark_stuck("web").await?;

    // The controller as the chart runs it: leader election in the release
    // namespace, the chart's Lease name.
    let mut common = vec![
        format!("--kubeconfig={}", kubeconfig.display()),
        format!("--leader-election-lease-name={}", setup.fullname()),
        "--log-encoding=console".to_owned(),
    ];
    if scoped {
        common.push(format!("--watch-namespace={}", apps.name));
    }
    let mut command = Command::new(workspace_binary("flux-plunger")?);
    command
        .args(&common)
        .args([
            "--leader-elect=true",
            "--metrics-addr=127.0.0.1:0",
            "--health-addr=127.0.0.1:0",
        ])
        .env("POD_NAME", POD)
        .env("POD_NAMESPACE", &setup.ns.name)
        .env_remove("RUST_LOG");
    let mut controller = LoggedProcess::spawn(command, "controller")?;
    eventually(
        Duration::from_secs(60),
        "the stuck release is recovered",
        || apps.is_recovered("web", 2),
    )
    .await?;
    assert!(
        apps.secrets()
            .get_opt("sh.helm.release.v1.web.v2")
            .await?
            .is_none()
    );
    // The event is written after the lift that the recovery is seen by.
    eventually(
        Duration::from_secs(30),
        "the Recovered event is written too",
        || async {
            let events = apps.events_for("web").await?;
            Ok(events.iter().any(|e| e.reason == "Recovered"))
        },
    )
    .await?;
    assert!(!controller.logged("Forbidden"), "{}", controller.log());

    // A release in a remote cluster: the kubeconfig Secret is read (`get
    // secrets`). This one names an exec plugin flux-plunger refuses to run,
    // so it is reported; reported again on the next change, the event becomes
    // a series (`patch events`).
    let exec_kubeconfig: Secret = serde_json::from_value(json!({
        "metadata": {"name": "remote-kubeconfig"},
        "stringData": {"value": "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: https://remote.example:443\ncontexts:\n- name: c\n  context: {cluster: c, user: u}\ncurrent-context: c\nusers:\n- name: u\n  user:\n    exec:\n      apiVersion: client.authentication.k8s.io/v1\n      command: aws\n"},
    }))?;
    apps.secrets()
        .create(&PostParams::default(), &exec_kubeconfig)
        .await?;
    apps.create_release(
        "remote",
        json!({"kubeConfig": {"secretRef": {"name": "remote-kubeconfig"}}}),
    )
    .await?;
    apps.mark_stuck("remote").await?;
    let reported = |count: usize| {
        let apps = &apps;
        async move {
            let events = apps.events_for("remote").await?;
            Ok(events
                .iter()
                .filter(|e| e.reason == reasons::REMOTE_CLUSTER_UNUSABLE)
                .count()
                >= 1
                && series_count(apps, "remote").await? >= count)
        }
    };
    eventually(
        Duration::from_secs(30),
        "the unusable remote cluster is reported",
        || reported(1),
    )
    .await?;
    apps.set_ready(
        "remote",
        "False",
        "UpgradeFailed",
        "Helm upgrade failed: \"remote\" has no deployed releases (again)",
    )
    .await?;
    eventually(
        Duration::from_secs(30),
        "the report repeated as an event series",
        || reported(2),
    )
    .await?;

    // A release whose storage is in another namespace, and whose own
    // ServiceAccount may not use Secrets there: the controller asks (`create
    // localsubjectaccessreviews` there) and touches nothing.
    apps.create_release(
        "elsewhere",
        json!({"storageNamespace": store.name, "serviceAccountName": "nobody"}),
    )
    .await?;
    store
        .create_storage_secret("elsewhere", 1, "uninstalling")
        .await?;
    apps.mark_stuck("elsewhere").await?;
    eventually(
        Duration::from_secs(30),
        "the storage out of the release's reach is reported",
        || async {
            let events = apps.events_for("elsewhere").await?;
            Ok(events
                .iter()
                .any(|e| e.reason == reasons::STORAGE_OUT_OF_REACH))
        },
    )
    .await?;
    assert_eq!(store.secret_names().await?.len(), 1);

    // A fence left by a stop mid-recovery, drained by the sidecar under the same identity.
    apps.create_release("mid", json!({})).await?;
    let body = testkit::fixtures::fence_body("mid", true);
    apps.releases()
        .patch(
            "mid",
            &PatchParams::apply(FIELD_MANAGER),
            &Patch::Apply(body),
        )
        .await?;
    assert!(
        controller
            .terminate(Duration::from_secs(15))
            .await?
            .success()
    );
    // A stuck release deleted under a suspension of flux-plunger's, which
    // helm-controller met suspended: the drain hands its history to
    // helm-controller's uninstall (`patch helmreleases/status`) before it
    // lifts the suspension, then lets the uninstalled release go.
    apps.create_release("deleted", json!({})).await?;
    hc.install("deleted").await?;
    assert_eq!(hc.handle("deleted").await?, Handled::AddedFinalizer);
    apps.create_storage_secret("deleted", 1, "uninstalling")
        .await?;
    apps.mark_stuck("deleted").await?;
    apps.apply_as_flux_plunger("deleted", true).await?;
    apps.releases()
        .delete("deleted", &Default::default())
        .await?;
    assert_eq!(
        hc.handle("deleted").await?,
        Handled::UninstallSkippedBecauseSuspended
    );
    let (hc_loop, stop_hc) = hc.clone().spawn(Duration::from_millis(200));
    let mut command = Command::new(workspace_binary("flux-plunger-drain")?);
    command
        .args(&common)
        .env("POD_NAME", POD)
        .env("POD_NAMESPACE", &setup.ns.name)
        .env_remove("RUST_LOG");
    let mut drain = LoggedProcess::spawn(command, "drain")?;
    drain
        .wait_logged("idle until SIGTERM", Duration::from_secs(20))
        .await?;
    assert!(drain.terminate(Duration::from_secs(90)).await?.success());
    assert!(
        drain.logged("drain complete: no fence left"),
        "{}",
        drain.log()
    );
    assert!(drain.logged("handed the Lease over"), "{}", drain.log());
    stop_hc.store(true, std::sync::atomic::Ordering::SeqCst);
    hc_loop.await?;
    let mid = ReleaseView::from_object(&apps.releases().get("mid").await?);
    assert!(!mid.suspend && !mid.has_fence());
    assert!(apps.releases().get_opt("deleted").await?.is_none());
    assert!(!hc.resources_exist("deleted").await?, "uninstalled");
    assert!(!drain.logged("Forbidden"), "{}", drain.log());

    // Every permission the chart grants was used, none was refused: each
    // rule is needed (dropping one refuses a request above), none is unused.
    check_uses_exactly_what_is_granted(
        &audit::service_account_user(&setup.ns.name, &setup.fullname()),
        &if scoped {
            setup.render().set(&scope)
        } else {
            setup.render()
        }
        .manifests()?,
        false,
        offset,
    )?;
    Ok(())
}

/// How many times the newest event series on `name` has been seen (1 for a
/// lone event).
async fn series_count(ns: &TestNamespace, name: &str) -> Result<usize> {
    let events: Api<k8s_openapi::api::events::v1::Event> =
        Api::namespaced(ns.client.clone(), &ns.name);
    Ok(events
        .list(&Default::default())
        .await?
        .items
        .iter()
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name))
        .map(|e| e.series.as_ref().map_or(1, |s| s.count as usize))
        .max()
        .unwrap_or(0))
}
