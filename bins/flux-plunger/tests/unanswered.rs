//! Requests that never answer, in the middle of a recovery: the controller
//! runs through a fault proxy that holds one chosen request of one release
//! forever (a connection whose peer went away without a word). The request
//! times out, the recovery's undo runs and the retry finishes; another
//! release stuck meanwhile is recovered while the first one's request hangs.

use std::time::Duration;

use anyhow::Result;
use serde_json::json;
use testkit::process::LoggedProcess;
use testkit::{Fault, FaultPlan, FaultProxy, Hold, TestNamespace, Verb, control_plane, eventually};
use tokio::process::Command;

/// A release stuck on an `uninstalling` revision 2 over a `superseded` 1.
async fn stuck(ns: &TestNamespace, name: &str) -> Result<()> {
    ns.create_release(name, json!({})).await?;
    ns.create_storage_secret(name, 1, "superseded").await?;
    ns.create_storage_secret(name, 2, "uninstalling").await?;
    ns.mark_stuck(name).await?;
    Ok(())
}

/// The controller, watching `ns` only, through `proxy`.
async fn controller(
    ns: &TestNamespace,
    proxy: &FaultProxy,
    dir: &std::path::Path,
) -> Result<LoggedProcess> {
    let kubeconfig = dir.join("kubeconfig");
    std::fs::write(&kubeconfig, proxy.kubeconfig_yaml(&ns.name))?;
    let mut command = Command::new(env!("CARGO_BIN_EXE_flux-plunger"));
    command
        .arg(format!("--kubeconfig={}", kubeconfig.display()))
        .arg(format!("--watch-namespace={}", ns.name))
        .args([
            "--leader-elect=false",
            "--metrics-addr=127.0.0.1:0",
            "--health-addr=127.0.0.1:0",
            "--log-encoding=console",
        ])
        .env_remove("RUST_LOG");
    let controller = LoggedProcess::spawn(command, "controller")?;
    controller
        .wait_logged("the HelmRelease watch has synced", Duration::from_secs(60))
        .await?;
    Ok(controller)
}

/// Recovers release `held` through a controller whose proxy holds the
/// request `hold` picks forever. Once the proxy holds it, a second release is
/// made stuck and must be recovered while that request still hangs (the
/// controller has logged no timeout yet); then `held` must end recovered.
/// Returns the namespace and the controller's log.
async fn recover_while_one_request_hangs(
    prefix: &str,
    hold: Hold,
) -> Result<(TestNamespace, String)> {
    let ns = TestNamespace::create(&control_plane().client().await?, prefix).await?;
    let proxy = FaultProxy::in_front_of_control_plane(FaultPlan::none(1).holding(hold)).await?;
    let dir = tempfile::tempdir()?;
    let mut controller = controller(&ns, &proxy, dir.path()).await?;

    stuck(&ns, "held").await?;
    eventually(
        Duration::from_secs(60),
        "the proxy holds the request",
        || {
            let held = proxy.report().count(Fault::BlackHole) == 1;
            async move { Ok(held) }
        },
    )
    .await?;
    stuck(&ns, "other").await?;
    eventually(
        Duration::from_secs(30),
        "the other release is recovered",
        || ns.is_recovered("other", 2),
    )
    .await?;
    assert!(
        !controller.logged("no answer from the apiserver"),
        "the other release was recovered while the held request was still pending:\n{}",
        controller.log()
    );
    eventually(
        Duration::from_secs(60),
        "the held release is recovered",
        || ns.is_recovered("held", 2),
    )
    .await?;
    controller.terminate(Duration::from_secs(20)).await?;
    let log = controller.log();
    Ok((ns, log))
}

#[tokio::test]
async fn a_storage_delete_that_never_answers_is_undone_and_retried_while_another_release_is_recovered()
-> Result<()> {
    let hold = Hold::black_hole(Verb::Delete, "/secrets/sh.helm.release.v1.held.v2").times(1);
    // The held delete times out, the undo lifts the suspension and the
    // fence, and the retry deletes the revision.
    let (ns, log) = recover_while_one_request_hangs("unanswered-delete", hold).await?;

    assert!(
        log.contains("no answer from the apiserver within 10s to DELETE"),
        "{log}"
    );
    let secrets = ns.secret_names().await?;
    assert!(
        !secrets.contains(&"sh.helm.release.v1.held.v2".to_owned()),
        "{secrets:?}"
    );
    assert!(
        secrets.contains(&"sh.helm.release.v1.held.v1".to_owned()),
        "{secrets:?}"
    );
    let held = ns.events_for("held").await?;
    assert!(held.iter().any(|e| e.reason == "Recovered"), "{held:?}");
    assert!(
        !held.iter().any(|e| e.reason == "UnsuspendFailed"),
        "the undo's lift was answered: {held:?}"
    );
    Ok(())
}

#[tokio::test]
async fn a_lift_that_never_answers_is_reported_and_retried_while_another_release_is_recovered()
-> Result<()> {
    // The final lift: an apply that gives up the fence (its body lacks the
    // finalizers the acquire sends, and the annotation patch's annotations).
    let hold = Hold::black_hole(Verb::Patch, "/helmreleases/held")
        .body_lacks("finalizers")
        .body_lacks("annotations")
        .times(1);
    // The held lift times out: reported, then undone by a lift that is
    // answered. The revision was deleted before it: the release is recovered.
    let (ns, log) = recover_while_one_request_hangs("unanswered-lift", hold).await?;

    assert!(
        log.contains("no answer from the apiserver within 10s to PATCH"),
        "{log}"
    );
    let held = ns.events_for("held").await?;
    assert!(
        held.iter().any(|e| e.reason == "UnsuspendFailed"
            && e.type_ == "Warning"
            && e.note.contains("no answer from the apiserver")),
        "the lift that timed out is reported: {held:?}"
    );
    Ok(())
}
