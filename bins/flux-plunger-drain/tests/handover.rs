//! Two flux-plunger pods (controller + drain sidecar each) on one Lease: the
//! second never writes while the first leads or drains, and leads within
//! seconds once the first drain has handed the Lease over (SPEC §6). Who
//! wrote what, and when, is read from the apiserver's audit log: each pod
//! runs under a ServiceAccount of its own, the chart's installed as a release
//! of its own in the namespace, held by that release's admission guard.

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use kube::api::{DeleteParams, Patch, PatchParams};
use plunger::names::FIELD_MANAGER;
use serde_json::json;
use testkit::audit::{self, AuditedRequest};
use testkit::control_plane::workspace_binary;
use testkit::guard::Guarded;
use testkit::process::LoggedProcess;
use testkit::{Handled, SimulatedHelmController, TestNamespace, control_plane, eventually};
use tokio::process::Command;

fn spawn(
    program: &std::path::Path,
    args: &[String],
    pod: &str,
    ns: &str,
    tag: &str,
) -> Result<LoggedProcess> {
    let mut command = Command::new(program);
    command
        .args(args)
        .env("POD_NAME", pod)
        .env("POD_NAMESPACE", ns)
        .env_remove("RUST_LOG");
    LoggedProcess::spawn(command, tag)
}

struct Pod {
    controller: LoggedProcess,
    drain: LoggedProcess,
}

async fn start_pod(
    ns: &TestNamespace,
    pod: &str,
    guarded: &Guarded,
    dir: &std::path::Path,
) -> Result<Pod> {
    let kubeconfig = dir.join(format!("{pod}.kubeconfig"));
    guarded.write_controller_kubeconfig(&kubeconfig)?;
    let common = vec![
        format!("--kubeconfig={}", kubeconfig.display()),
        "--log-encoding=console".to_owned(),
        "--shutdown-grace-period-seconds=90".to_owned(),
    ];
    let mut controller_args = common.clone();
    controller_args.extend([
        "--metrics-addr=127.0.0.1:0".to_owned(),
        "--health-addr=127.0.0.1:0".to_owned(),
    ]);
    let controller = spawn(
        &workspace_binary("flux-plunger")?,
        &controller_args,
        pod,
        &ns.name,
        &format!("{pod}/controller"),
    )?;
    let drain = spawn(
        &workspace_binary("flux-plunger-drain")?,
        &common,
        pod,
        &ns.name,
        &format!("{pod}/drain"),
    )?;
    drain
        .wait_logged("idle until SIGTERM", Duration::from_secs(20))
        .await?;
    Ok(Pod { controller, drain })
}

/// The successful writes of a pod's ServiceAccount (HelmReleases, Secrets,
/// its Lease, events) since `offset`, in the order the apiserver logged them.
fn writes_by(guarded: &Guarded, offset: u64) -> Result<Vec<AuditedRequest>> {
    Ok(
        audit::requests_by_since(&guarded.controller_user(), offset)?
            .into_iter()
            .filter(|r| r.is_write() && r.succeeded())
            .collect(),
    )
}

async fn stuck(ns: &TestNamespace, hc: &SimulatedHelmController, name: &str) -> Result<()> {
    ns.create_release(name, json!({})).await?;
    hc.install(name).await?;
    assert_eq!(hc.handle(name).await?, Handled::AddedFinalizer);
    ns.create_storage_secret(name, 1, "uninstalling").await?;
    ns.mark_stuck(name).await?;
    Ok(())
}

#[tokio::test]
async fn the_next_pod_writes_only_after_the_first_pods_drain_and_leads_seconds_later() -> Result<()>
{
    let client = control_plane().client().await?;
    let ns = TestNamespace::create(&client, "handover").await?;
    let hc = SimulatedHelmController::new(client.clone(), &ns.name);
    // Both releases' guards allow the same Lease, the binaries' default.
    let pod_a = Guarded::install(&client, &ns.name, &format!("{}-a", ns.name)).await?;
    let pod_b = Guarded::install(&client, &ns.name, &format!("{}-b", ns.name)).await?;
    // The pods' writes, not the probes that saw their guards in force.
    let offset = audit::mark();
    let dir = tempfile::tempdir()?;

    let mut a = start_pod(&ns, "pod-a", &pod_a, dir.path()).await?;
    eventually(Duration::from_secs(20), "pod-a leads", || {
        let led = a.controller.logged("became the leader");
        async move { Ok(led) }
    })
    .await?;
    let mut b = start_pod(&ns, "pod-b", &pod_b, dir.path()).await?;
    eventually(Duration::from_secs(20), "pod-b waits for the Lease", || {
        let waiting = b.controller.logged("waiting for the leader Lease");
        async move { Ok(waiting) }
    })
    .await?;

    stuck(&ns, &hc, "early").await?;
    eventually(
        Duration::from_secs(30),
        "pod-a recovers the first release",
        || ns.is_recovered("early", 1),
    )
    .await?;

    // A release being deleted under pod-a's suspension keeps its drain busy
    // until helm-controller answers, a few seconds in.
    ns.create_release("deleting", json!({})).await?;
    hc.install("deleting").await?;
    hc.handle("deleting").await?;
    let body = testkit::fixtures::fence_body("deleting", true);
    ns.releases()
        .patch(
            "deleting",
            &PatchParams::apply(FIELD_MANAGER),
            &Patch::Apply(body),
        )
        .await?;
    ns.releases()
        .delete("deleting", &DeleteParams::default())
        .await?;

    // The kubelet's order: the controller first, then the sidecar.
    assert!(
        a.controller
            .terminate(Duration::from_secs(120))
            .await?
            .success()
    );
    let drain_started = Instant::now();
    a.drain.sigterm()?;
    // Stuck while pod-a drains: pod-b must leave it alone until the handover.
    stuck(&ns, &hc, "late").await?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (helm_controller, stop) = hc.clone().spawn(Duration::from_millis(300));
    let drained = a.drain.wait(Duration::from_secs(70)).await?;
    let drain_ended = Instant::now();
    assert!(drained.success());
    assert!(
        a.drain.logged("drain complete: no fence left"),
        "{}",
        a.drain.log()
    );
    assert!(a.drain.logged("handed the Lease over"));
    assert!(
        drain_ended - drain_started >= Duration::from_secs(3),
        "the drain waited for helm-controller"
    );

    eventually(
        Duration::from_secs(30),
        "pod-b recovers the late release",
        || ns.is_recovered("late", 1),
    )
    .await?;
    let b_led_after = drain_ended.elapsed();
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    helm_controller.await?;

    let a_writes = writes_by(&pod_a, offset)?;
    let b_writes = writes_by(&pod_b, offset)?;
    let handover = a_writes
        .iter()
        .filter(|r| r.verb == "update" && r.resource() == "leases")
        .map(|r| r.received_at)
        .max()
        .context("pod-a never updated the Lease")?;
    let first_b_write = b_writes
        .iter()
        .filter(|r| ["helmreleases", "secrets"].contains(&r.resource()))
        .map(|r| r.received_at)
        .min()
        .context("pod-b never wrote")?;
    let last_a_write = a_writes
        .iter()
        .filter(|r| ["helmreleases", "secrets"].contains(&r.resource()))
        .map(|r| r.received_at)
        .max()
        .context("pod-a never wrote")?;
    assert!(
        last_a_write < handover,
        "pod-a wrote after its handover: {last_a_write} >= {handover}"
    );
    assert!(
        handover < first_b_write,
        "pod-b wrote before the handover: {first_b_write} <= {handover}"
    );
    eprintln!(
        "handover: pod-a's drain took {:?}; pod-b recovered the late release {:?} after the drain ended",
        drain_ended - drain_started,
        b_led_after
    );
    assert!(b.controller.logged("became the leader"));

    assert!(
        b.controller
            .terminate(Duration::from_secs(120))
            .await?
            .success()
    );
    assert!(b.drain.terminate(Duration::from_secs(120)).await?.success());
    Ok(())
}
