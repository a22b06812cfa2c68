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

/// `(verb, resource)` of every request `user` sent in `namespace` since
/// `offset` of the audit log, in the order the apiserver logged them (the
/// tests of this file run side by side, as the same user).
fn requests_since(offset: u64, user: &str, namespace: &str) -> Result<Vec<(String, String)>> {
    Ok(audit::read_since(offset)?
        .into_iter()
        .filter(|r| r.user == user && r.namespace.as_deref() == Some(namespace))
        .map(|r| (r.verb, r.permission.resource))
        .collect())
}

/// The controller of the chart's ServiceAccount, under its admission guard
/// (the audit log tells its requests apart, and the guard refuses none of
/// them), watching `ns` with `extra` flags, once its watch has synced; and
/// that user's name.
async fn start_watching(
    ns: &TestNamespace,
    extra: &[&str],
) -> Result<(LoggedProcess, String, tempfile::TempDir)> {
    let guarded = testkit::guard::shared()?;
    let dir = tempfile::tempdir()?;
    let kubeconfig = dir.path().join("kubeconfig");
    guarded.write_controller_kubeconfig(&kubeconfig)?;
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
        .args(extra)
        .env_remove("RUST_LOG");
    let controller = LoggedProcess::spawn(command, "controller")?;
    controller
        .wait_logged("the HelmRelease watch has synced", Duration::from_secs(60))
        .await?;
    Ok((controller, guarded.controller_user(), dir))
}

#[tokio::test]
async fn a_recovery_sends_the_requests_of_its_steps_and_its_event_and_nothing_more() -> Result<()> {
    let plane = control_plane();
    let admin = plane.client().await?;
    let ns = TestNamespace::create(&admin, "requests").await?;
    ns.create_release("web", json!({})).await?;
    ns.create_storage_secret("web", 1, "superseded").await?;
    ns.create_storage_secret("web", 2, "uninstalling").await?;
    let (mut controller, username, _dir) = start_watching(&ns, &[]).await?;

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

    let sent: Vec<(String, String)> = requests_since(offset, &username, &ns.name)?
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

#[tokio::test]
async fn a_release_turned_away_by_the_rate_limit_costs_one_read_and_one_listing_until_its_turn()
-> Result<()> {
    let plane = control_plane();
    let admin = plane.client().await?;
    let ns = TestNamespace::create(&admin, "requests-waiting").await?;
    for name in ["first", "later"] {
        ns.create_release(name, json!({})).await?;
        ns.create_storage_secret(name, 1, "superseded").await?;
        ns.create_storage_secret(name, 2, "uninstalling").await?;
    }
    let (mut controller, username, _dir) =
        start_watching(&ns, &["--max-recoveries-per-minute=1"]).await?;
    // The minute's one recovery goes to the first.
    ns.mark_stuck("first").await?;
    eventually(Duration::from_secs(60), "the first is recovered", || {
        ns.is_recovered("first", 2)
    })
    .await?;
    // Its Recovered event, sent after the lift, is in before the count starts.
    eventually(Duration::from_secs(30), "the Recovered event", || async {
        let events: kube::Api<k8s_openapi::api::core::v1::Event> =
            kube::Api::namespaced(admin.clone(), &ns.name);
        Ok(events
            .list(&Default::default())
            .await?
            .items
            .iter()
            .any(|e| e.reason.as_deref() == Some("Recovered")))
    })
    .await?;

    let offset = audit::mark();
    ns.mark_stuck("later").await?;
    eventually(
        Duration::from_secs(30),
        "the later one waits under the fence",
        || async {
            let view = plunger::release::view::ReleaseView::from_object(
                &ns.releases().get("later").await?,
            );
            Ok(view.has_fence() && !view.suspend)
        },
    )
    .await?;
    // The watch event of its own fence write has come and its pass is over:
    // skipped, the release left to its turn.
    let fenced = ns
        .releases()
        .get("later")
        .await?
        .metadata
        .resource_version
        .unwrap_or_default();
    controller
        .wait_logged(
            &format!("resource_version={fenced}"),
            Duration::from_secs(30),
        )
        .await?;
    // At its turn (a minute after the first recovery) the recovery is its.
    eventually(
        Duration::from_secs(120),
        "the later one is recovered at its turn",
        || ns.is_recovered("later", 2),
    )
    .await?;
    controller.terminate(Duration::from_secs(20)).await?;

    let sent: Vec<(String, String)> = requests_since(offset, &username, &ns.name)?
        .into_iter()
        .filter(|(verb, _)| verb != "watch")
        .collect();
    let expected: Vec<(String, String)> = [
        ("get", "helmreleases"),   // §4.1 read the release
        ("list", "secrets"),       // §4.6 list its storage
        ("patch", "helmreleases"), // §4.5 the fence while it waits, locked on the read
        // Nothing until its turn; then the recovery (as in the test above).
        ("get", "helmreleases"),
        ("list", "secrets"),
        ("patch", "helmreleases"),
        ("patch", "helmreleases"),
        ("delete", "secrets"),
        ("patch", "helmreleases"),
        ("create", "events"),
    ]
    .iter()
    .map(|(v, r)| ((*v).to_owned(), (*r).to_owned()))
    .collect();
    assert_eq!(sent, expected);
    Ok(())
}
