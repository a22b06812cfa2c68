//! `helm install` of the chart on the node, the controller pod at work, and
//! `helm uninstall` with its hook Job run by the real Job controller.

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::{ListParams, LogParams};
use plunger::names::FENCE_FINALIZER;
use plunger::release::view::ReleaseView;
use real_node::{CONTROLLER, DRAIN, OnNode, container_status, metrics_with, name_of};
use testkit::node::NODE_NAME;
use testkit::{TestNamespace, eventually};

/// The words of the test's refusal of the controller's writes.
const REFUSED: &str = "test: the controller's writes are refused here";

/// A stuck release as helm-controller leaves it: revision 1 superseded,
/// revision 2 `uninstalling`, `Ready=False` with "has no deployed releases".
pub(crate) async fn stuck_release(ns: &TestNamespace, name: &str) -> Result<()> {
    ns.create_release(name, serde_json::json!({})).await?;
    ns.create_storage_secret(name, 1, "superseded").await?;
    ns.create_storage_secret(name, 2, "uninstalling").await?;
    ns.mark_stuck(name).await?;
    Ok(())
}

/// A live release flux-plunger fenced, in a namespace where an admission
/// policy refuses the controller's ServiceAccount every HelmRelease write: the
/// controller and its drain cannot let go of it, the hook (its own
/// ServiceAccount) can. Returns the refusal, to lift afterwards.
async fn fence_only_the_hook_can_release(
    on: &OnNode,
    ns: &TestNamespace,
    name: &str,
) -> Result<testkit::Refusal> {
    let controller_user = on.controller_user();
    ns.create_release(name, serde_json::json!({})).await?;
    let refusal = ns
        .refuse(
            "no-controller-writes",
            serde_json::json!({"apiGroups": ["helm.toolkit.fluxcd.io"], "apiVersions": ["*"],
            "operations": ["UPDATE"], "resources": ["helmreleases"]}),
            &format!("request.userInfo.username != '{controller_user}'"),
            REFUSED,
        )
        .await?;
    // Refused before the fence is set: the running controller would drop it.
    real_node::wait_until_refused(on, ns, name, REFUSED).await?;
    ns.apply_as_flux_plunger(name, false).await?;
    Ok(refusal)
}

/// What `flux logs --kind HelmRelease --name NAME -n NAMESPACE` prints with
/// the chart's namespace as Flux's (the real CLI, `_out/bin/flux`).
fn flux_logs_of(on: &OnNode, namespace: &str, name: &str) -> Result<String> {
    let output = std::process::Command::new(testkit::control_plane::tool("flux")?)
        .arg(format!("--kubeconfig={}", on.setup.kubeconfig.display()))
        .args(["logs", "--flux-namespace", &on.ns().name, "-n", namespace])
        .args(["--kind", "HelmRelease", "--name", name])
        .output()?;
    ensure!(
        output.status.success(),
        "flux logs failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_chart_installs_recovers_a_stuck_release_and_uninstalls_through_its_hook_job()
-> Result<()> {
    let _turn = testkit::cluster_wide_turn().await;
    let on = OnNode::new("node-life").await?;
    let ns = on.ns();

    // Installed with the image built here: the pod is Ready, which the chart's
    // readiness probe (/readyz) says while the process works (a candidate, or
    // the leader once its HelmRelease watch synced); the Lease says it leads.
    // fluxComponent: the pods `flux logs` reads, as Flux's own.
    on.install(&["shutdownGracePeriodSeconds=40", "fluxComponent=true"])?;
    let pod = on.ready_pod(None).await?;
    let pod_name = name_of(&pod);
    let spec = pod.spec.as_ref().context("pod spec")?;
    ensure!(
        spec.node_name.as_deref() == Some(NODE_NAME),
        "scheduled on {:?}",
        spec.node_name
    );
    for container in [CONTROLLER, DRAIN] {
        let status = container_status(&pod, container).context(container)?;
        ensure!(
            status.state.as_ref().is_some_and(|s| s.running.is_some()),
            "{container} is not running: {status:?}"
        );
        ensure!(
            status.restart_count == 0,
            "{container} restarted: {status:?}"
        );
    }
    on.wait_lease_held_by(&pod_name).await?;

    // /metrics on the pod's own address, as Prometheus scrapes it.
    let pod_ip = pod
        .status
        .as_ref()
        .and_then(|s| s.pod_ip.clone())
        .context("the pod has no IP")?;
    metrics_with(&format!("{pod_ip}:8080"), "flux_plunger_leader 1").await?;

    // The controller in the pod recovers a stuck release.
    let apps = TestNamespace::create(&ns.client, "node-life-apps").await?;
    stuck_release(&apps, "web").await?;
    eventually(
        Duration::from_secs(60),
        "the stuck release recovered",
        || apps.is_recovered("web", 2),
    )
    .await
    .with_context(|| on.node.logs_for_failure())?;
    ensure!(
        apps.secret_names().await? == [plunger::names::storage_secret_name("web", 1)],
        "storage after the recovery: {:?}",
        apps.secret_names().await?
    );
    metrics_with(
        &format!("{pod_ip}:8080"),
        r#"flux_plunger_recoveries_total{result="recovered"} 1"#,
    )
    .await?;
    // The real `flux logs` shows the pod's lines about the release, as it
    // shows helm-controller's: the Deployment is labelled part-of: flux, and
    // each line names the release as Flux's controllers name what they
    // reconcile.
    let shown = flux_logs_of(&on, &apps.name, "web")?;
    ensure!(
        shown.lines().any(
            |l| l.contains(&format!(" info HelmRelease/web.{} - ", apps.name))
                && l.contains("suspended with the uninstall fence")
        ),
        "flux logs shows no recovery of web:\n{shown}"
    );

    // A fence the controller's drain cannot release (its writes are
    // refused): only the hook, under its own ServiceAccount, can let go.
    let held_ns = TestNamespace::create(&ns.client, "node-life-held").await?;
    let held_since = testkit::audit::mark();
    let refusal = fence_only_the_hook_can_release(&on, &held_ns, "held").await?;

    // helm uninstall runs the hook Job on the node and waits for it.
    let uninstalled = on
        .setup
        .helm(&["uninstall", &on.release, "--wait", "--timeout=5m"])?;
    chart_contract::install::succeeded(uninstalled, "helm uninstall")
        .with_context(|| on.node.logs_for_failure())?;

    on.completed_hook_job().await?;
    let hook_pods: Api<Pod> = Api::namespaced(ns.client.clone(), &ns.name);
    let hook_pod = hook_pods
        .list(&ListParams::default().labels(&format!("job-name={}-pre-delete", on.fullname)))
        .await?
        .items
        .into_iter()
        .next()
        .context("the hook Job's pod")?;
    let hook_spec = hook_pod.spec.as_ref().context("hook pod spec")?;
    ensure!(
        hook_spec.service_account_name.as_deref()
            == Some(format!("{}-pre-delete", on.fullname).as_str()),
        "the hook runs as {:?}",
        hook_spec.service_account_name
    );
    ensure!(hook_spec.node_name.as_deref() == Some(NODE_NAME));
    // The report, read through the apiserver from the kubelet.
    let report = hook_pods
        .logs(&name_of(&hook_pod), &LogParams::default())
        .await?;
    ensure!(
        report.contains(&format!("released {}/held", held_ns.name))
            && report.contains("released 1 of 1 fenced HelmReleases, 0 without an uninstall"),
        "the hook's report:\n{report}\nthe held release's writes:\n{}",
        real_node::trail(held_since, &held_ns.name, &["held".to_owned()])?
    );
    // The hook stopped the controller before it touched a fence: it scaled
    // the Deployment to 0 through its scale subresource, then waited until
    // the controller's pod was gone (the kubelet's final delete of it, after
    // the drain), and only then patched the release.
    let requests = testkit::audit::read_since(held_since)?;
    let hook_user =
        testkit::audit::service_account_user(&ns.name, &format!("{}-pre-delete", on.fullname));
    let scaled = requests
        .iter()
        .find(|r| {
            r.user == hook_user
                && r.resource() == "deployments/scale"
                && r.is_write()
                && r.succeeded()
        })
        .map(|r| r.received_at)
        .context("the hook's scale-down of the Deployment")?;
    let pod_gone = requests
        .iter()
        .filter(|r| {
            r.verb == "delete" && r.resource() == "pods" && r.name == pod_name && r.succeeded()
        })
        .map(|r| r.received_at)
        .max()
        .context("the controller pod's delete")?;
    let released = requests
        .iter()
        .filter(|r| r.user == hook_user && r.resource() == "helmreleases" && r.is_write())
        .map(|r| r.received_at)
        .min()
        .context("the hook's patch of the release")?;
    ensure!(
        scaled < pod_gone && pod_gone < released,
        "scaled at {scaled}, the controller pod gone at {pod_gone}, the fence released at {released}"
    );

    // Nothing of flux-plunger is left: no Deployment, no pod, no Lease, no fence.
    let deployments: Api<Deployment> = Api::namespaced(ns.client.clone(), &ns.name);
    ensure!(deployments.get_opt(&on.fullname).await?.is_none());
    ensure!(
        on.pods()
            .list(&ListParams::default().labels(&on.selector()))
            .await?
            .items
            .is_empty(),
        "controller pods are left"
    );
    ensure!(on.lease().await?.is_none(), "the Lease is left");
    let held = ReleaseView::from_object(&held_ns.releases().get("held").await?);
    ensure!(
        !held.finalizers.iter().any(|f| f == FENCE_FINALIZER),
        "the fence is left"
    );
    refusal.lift().await?;
    Ok(())
}
