//! What one recovery asks of the apiserver, read from the apiserver's audit
//! log: the requests of SPEC §4's steps, the Recovered event, and nothing
//! more (in particular no second pass woken by the recovery's own writes).
//! A count, never a timing.

use std::time::Duration;

use anyhow::Result;
use serde_json::json;
use testkit::audit;
use testkit::process::LoggedProcess;
use testkit::{TestNamespace, control_plane, eventually};
use tokio::process::Command;

/// `(verb, resource)` of every request `user` sent since `offset` of the
/// audit log, in the order the apiserver logged them.
fn requests_since(offset: u64, user: &str) -> Result<Vec<(String, String)>> {
    Ok(audit::read_since(offset)?
        .into_iter()
        .filter(|r| r.user == user)
        .map(|r| (r.verb, r.permission.resource))
        .collect())
}

#[tokio::test]
async fn a_recovery_sends_the_requests_of_its_steps_and_its_event_and_nothing_more() -> Result<()> {
    let plane = control_plane();
    let admin = plane.client().await?;
    let ns = TestNamespace::create(&admin, "requests").await?;
    // The chart's ServiceAccount under its admission guard: the audit log
    // tells its requests apart, and the guard refuses none of them.
    let guarded = testkit::guard::shared()?;
    let dir = tempfile::tempdir()?;
    let kubeconfig = dir.path().join("kubeconfig");
    guarded.write_controller_kubeconfig(&kubeconfig)?;
    let username = guarded.controller_user();

    ns.create_release("web", json!({})).await?;
    ns.create_storage_secret("web", 1, "superseded").await?;
    ns.create_storage_secret("web", 2, "uninstalling").await?;

    let mut command = Command::new(env!("CARGO_BIN_EXE_flux-plunger"));
    command
        .arg(format!("--kubeconfig={}", kubeconfig.display()))
        .arg(format!("--watch-namespace={}", ns.name))
        .args([
            "--leader-elect=false",
            "--metrics-addr=127.0.0.1:0",
            "--health-addr=127.0.0.1:0",
            "--log-encoding=console",
            "--log-level=debug",
        ])
        .env_remove("RUST_LOG");
    let mut controller = LoggedProcess::spawn(command, "controller")?;
    controller
        .wait_logged("the HelmRelease watch has synced", Duration::from_secs(60))
        .await?;

    let offset = audit::mark();
    ns.mark_stuck("web").await?;
    eventually(Duration::from_secs(60), "the release is recovered", || {
        ns.is_recovered("web", 2)
    })
    .await?;
    // The watch event of the final lift, the last of the recovery's writes,
    // has come and its pass is over: it was skipped.
    let lifted = ns
        .releases()
        .get("web")
        .await?
        .metadata
        .resource_version
        .unwrap_or_default();
    controller
        .wait_logged(
            &format!("resource_version={lifted}"),
            Duration::from_secs(30),
        )
        .await?;
    controller.terminate(Duration::from_secs(20)).await?;

    let sent: Vec<(String, String)> = requests_since(offset, &username)?
        .into_iter()
        .filter(|(verb, _)| verb != "watch")
        .collect();
    let expected: Vec<(String, String)> = [
        ("get", "helmreleases"),   // §4.1 read the release
        ("list", "secrets"),       // §4.6 list its storage
        ("patch", "helmreleases"), // §4.8 apply {suspend, fence}, locked on §4.1's read
        ("patch", "helmreleases"), // §4.10 the processed annotation; its answer is §4.11's re-check
        ("delete", "secrets"),     // §4.12 the newest revision
        ("patch", "helmreleases"), // §4.13 lift suspension and fence
        ("create", "events"),      // the Recovered event (SPEC §1)
    ]
    .iter()
    .map(|(v, r)| ((*v).to_owned(), (*r).to_owned()))
    .collect();
    assert_eq!(sent, expected);
    Ok(())
}
