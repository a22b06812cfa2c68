//! The controller binary as a process against the local control plane.

use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::Api;
use plunger::names::PROCESSED_VERSION_ANNOTATION;
use plunger::release::view::ReleaseView;
use serde_json::json;
use testkit::control_plane::free_ports;
use testkit::guard::{self, Guarded};
use testkit::{Handled, SimulatedHelmController, TestNamespace, control_plane, eventually};
use tokio::process::{Child, Command};

struct Running {
    child: Child,
    metrics: u16,
    health: u16,
    _dir: tempfile::TempDir,
}

/// Starts the controller as the chart's ServiceAccount `guarded.controller`,
/// under the chart's admission guard.
async fn start(guarded: &Guarded, extra: &[&str], env: &[(&str, &str)]) -> Result<Running> {
    let dir = tempfile::tempdir()?;
    let kubeconfig = dir.path().join("kubeconfig");
    guarded.write_controller_kubeconfig(&kubeconfig)?;
    let [metrics, health] = free_ports()?;
    let mut command = Command::new(env!("CARGO_BIN_EXE_flux-plunger"));
    command
        .arg(format!("--kubeconfig={}", kubeconfig.display()))
        .arg(format!("--metrics-addr=127.0.0.1:{metrics}"))
        .arg(format!("--health-addr=127.0.0.1:{health}"))
        .arg("--log-encoding=console")
        .arg("--log-level=debug")
        .args(extra)
        .env_remove("POD_NAME")
        .env_remove("POD_NAMESPACE")
        .envs(env.iter().copied())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .kill_on_drop(true);
    let child = command.spawn()?;
    Ok(Running {
        child,
        metrics,
        health,
        _dir: dir,
    })
}

/// Waits until `/metrics` holds `line`, and returns the whole page.
async fn metrics_with(port: u16, line: &str) -> Result<String> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (status, metrics) = http_get(port, "/metrics").await?;
        anyhow::ensure!(status == 200, "/metrics answered {status}");
        if metrics.lines().any(|l| l == line) {
            return Ok(metrics);
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "/metrics never held {line}:\n{metrics}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn http_get(port: u16, path: &str) -> Result<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    stream
        .write_all(
            format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
                .as_bytes(),
        )
        .await?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await?;
    let status = response
        .split_whitespace()
        .nth(1)
        .context("no status line")?
        .parse()?;
    let body = response
        .split("\r\n\r\n")
        .nth(1)
        .unwrap_or_default()
        .to_owned();
    Ok((status, body))
}

async fn wait_ready(running: &Running) -> Result<()> {
    eventually(Duration::from_secs(30), "/readyz answers 200", || async {
        Ok(matches!(
            http_get(running.health, "/readyz").await,
            Ok((200, _))
        ))
    })
    .await
}

#[tokio::test]
async fn the_controller_recovers_a_stuck_release_and_counts_it() -> Result<()> {
    let _turn = testkit::cluster_wide_turn().await;
    let client = control_plane().client().await?;
    let ns = TestNamespace::create(&client, "binary").await?;
    let hc = SimulatedHelmController::new(client.clone(), &ns.name);
    // Scoped: the recovery count below must not include stuck releases that
    // other tests of this binary leave behind.
    let running = start(
        guard::shared()?,
        &[
            "--leader-elect=false",
            "--concurrent=2",
            &format!("--watch-namespace={}", ns.name),
        ],
        &[],
    )
    .await?;
    wait_ready(&running).await?;
    assert_eq!(http_get(running.health, "/healthz").await?.0, 200);

    ns.create_release("web", json!({})).await?;
    assert_eq!(hc.handle("web").await?, Handled::AddedFinalizer);
    ns.create_storage_secret("web", 1, "superseded").await?;
    ns.create_storage_secret("web", 2, "uninstalling").await?;
    ns.mark_stuck("web").await?;

    eventually(Duration::from_secs(30), "the release is recovered", || {
        ns.is_recovered("web", 2)
    })
    .await?;
    assert_eq!(ns.secret_names().await?, vec!["sh.helm.release.v1.web.v1"]);

    // The recovery is counted once its pass ends, after the lift it is seen by.
    let metrics = metrics_with(
        running.metrics,
        "flux_plunger_recoveries_total{result=\"recovered\"} 1",
    )
    .await?;
    assert!(metrics.contains("flux_plunger_fences_held 0"), "{metrics}");
    // The process metrics every Prometheus-instrumented controller has.
    for name in [
        "process_cpu_seconds_total ",
        "process_resident_memory_bytes ",
        "process_open_fds ",
        "process_start_time_seconds ",
    ] {
        assert!(
            metrics.lines().any(|l| l.starts_with(name)),
            "{name}in {metrics}"
        );
    }
    assert!(
        metrics.contains("flux_plunger_reconcile_duration_seconds_count"),
        "{metrics}"
    );
    Ok(())
}

#[tokio::test]
async fn on_sigterm_the_leader_stops_within_ten_seconds_and_keeps_its_lease() -> Result<()> {
    let _turn = testkit::cluster_wide_turn().await;
    let client = control_plane().client().await?;
    let ns = TestNamespace::create(&client, "sigterm").await?;
    // Its Lease is in this namespace: the chart installed here allows it.
    let guarded = ns.guarded().await?;
    let mut running = start(
        &guarded,
        &[
            "--leader-elect=true",
            "--leader-election-lease-name=flux-plunger",
        ],
        &[
            ("POD_NAME", "flux-plunger-abc"),
            ("POD_NAMESPACE", &ns.name),
        ],
    )
    .await?;
    wait_ready(&running).await?;
    let leases: Api<Lease> = Api::namespaced(client.clone(), &ns.name);
    let holder = |lease: Lease| lease.spec.and_then(|s| s.holder_identity);
    assert_eq!(
        holder(leases.get("flux-plunger").await?).as_deref(),
        Some("flux-plunger-abc")
    );
    metrics_with(running.metrics, "flux_plunger_leader 1").await?;

    let pid = running.child.id().context("no pid")?;
    let started = Instant::now();
    std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()?;
    let status = tokio::time::timeout(Duration::from_secs(15), running.child.wait()).await??;
    assert!(status.success(), "{status:?}");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(
        holder(leases.get("flux-plunger").await?).as_deref(),
        Some("flux-plunger-abc"),
        "the Lease is kept for the drain"
    );
    Ok(())
}

#[tokio::test]
async fn leader_election_without_a_namespace_is_refused_with_the_flag_named() -> Result<()> {
    let _turn = testkit::cluster_wide_turn().await;
    let mut running = start(guard::shared()?, &["--leader-elect=true"], &[]).await?;
    let status = tokio::time::timeout(Duration::from_secs(15), running.child.wait()).await??;
    assert_eq!(status.code(), Some(1));
    Ok(())
}

#[tokio::test]
async fn a_scoped_controller_recovers_only_the_namespaces_and_labels_it_watches() -> Result<()> {
    let _turn = testkit::cluster_wide_turn().await;
    let client = control_plane().client().await?;
    let watched = TestNamespace::create(&client, "scope-in").await?;
    let other = TestNamespace::create(&client, "scope-out").await?;
    let offset = testkit::audit::mark();
    let running = start(
        guard::shared()?,
        &[
            "--leader-elect=false",
            &format!("--watch-namespace={}", watched.name),
            "--watch-label-selector=team=payments",
        ],
        &[],
    )
    .await?;
    wait_ready(&running).await?;

    // The releases out of scope get stuck first, the one in scope last.
    for (ns, name, labelled) in [
        (&watched, "unlabelled", false),
        (&other, "labelled", true),
        (&watched, "labelled", true),
    ] {
        let hc = SimulatedHelmController::new(client.clone(), &ns.name);
        ns.create_release(name, json!({})).await?;
        if labelled {
            ns.releases()
                .patch(
                    name,
                    &kube::api::PatchParams::default(),
                    &kube::api::Patch::Merge(json!({"metadata": {"labels": {"team": "payments"}}})),
                )
                .await?;
        }
        hc.handle(name).await?;
        ns.create_storage_secret(name, 1, "uninstalling").await?;
        ns.mark_stuck(name).await?;
    }

    eventually(
        Duration::from_secs(30),
        "the watched, labelled release is recovered",
        || async {
            let view = ReleaseView::from_object(&watched.releases().get("labelled").await?);
            Ok(view.annotations.contains_key(PROCESSED_VERSION_ANNOTATION))
        },
    )
    .await?;
    // The others never reach it: it asks the apiserver only for the
    // releases in its scope (namespace and selector, server-side), and never
    // read or wrote one of them, though they were stuck before the one it
    // recovered.
    let controller = guard::shared()?.controller_user();
    let requests: Vec<_> = testkit::audit::read_since(offset)?
        .into_iter()
        .filter(|r| r.user == controller && r.resource() == "helmreleases")
        .collect();
    assert!(
        requests.iter().any(|r| r.verb == "watch"),
        "the watch is in the log: {requests:?}"
    );
    for r in &requests {
        assert_eq!(
            r.namespace.as_deref(),
            Some(watched.name.as_str()),
            "{}",
            r.request_uri
        );
        assert_ne!(r.name, "unlabelled", "{}", r.request_uri);
        // A listing selects the scope's releases, or this install's own
        // fences (which it settles wherever its selector no longer reaches).
        if r.name.is_empty() {
            assert!(
                r.request_uri.contains("labelSelector=team%3Dpayments")
                    || r.request_uri.contains(
                        "labelSelector=flux-plunger.cozystack.io%2Funinstall-fence%3Dheld"
                    ),
                "{}",
                r.request_uri
            );
        }
    }
    for (ns, name) in [(&watched, "unlabelled"), (&other, "labelled")] {
        let view = ReleaseView::from_object(&ns.releases().get(name).await?);
        assert!(
            !view.annotations.contains_key(PROCESSED_VERSION_ANNOTATION),
            "{}/{name}",
            ns.name
        );
        assert_eq!(
            ns.secrets()
                .list(&Default::default())
                .await?
                .items
                .iter()
                .filter(|s| s.metadata.name.as_deref()
                    == Some(&format!("sh.helm.release.v1.{name}.v1")))
                .count(),
            1
        );
    }
    Ok(())
}

/// Labels `name` with `labels` (a merge: `null` removes one).
async fn label(ns: &TestNamespace, name: &str, labels: serde_json::Value) -> Result<()> {
    ns.releases()
        .patch(
            name,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(json!({"metadata": {"labels": labels}})),
        )
        .await?;
    Ok(())
}

#[tokio::test]
async fn a_fence_on_a_release_relabelled_out_of_the_selector_is_dropped_by_the_install_that_set_it()
-> Result<()> {
    let _turn = testkit::cluster_wide_turn().await;
    let client = control_plane().client().await?;
    let ns = TestNamespace::create(&client, "scope-relabel").await?;
    let hc = SimulatedHelmController::new(client.clone(), &ns.name);
    // Another install side by side (same namespace, another selector) fenced
    // this one while it was in its scope; it has since been labelled into
    // this install's: the fence stays that install's to settle.
    ns.create_release("theirs", json!({})).await?;
    label(&ns, "theirs", json!({"team": "payments"})).await?;
    hc.handle("theirs").await?;
    ns.create_storage_secret("theirs", 1, "uninstalling")
        .await?;
    ns.mark_stuck("theirs").await?;
    ns.apply_as_install("theirs", false, "tenant-b.flux-plunger")
        .await?;
    let offset = testkit::audit::mark();
    // One recovery a minute: the first stuck release is recovered, the
    // second waits for its turn under this install's fence.
    let running = start(
        guard::shared()?,
        &[
            "--leader-elect=false",
            &format!("--watch-namespace={}", ns.name),
            "--watch-label-selector=team=payments",
            "--max-recoveries-per-minute=1",
        ],
        &[("POD_NAMESPACE", ns.name.as_str())],
    )
    .await?;
    wait_ready(&running).await?;
    let own = plunger::install::Install::from_lease(&ns.name, "flux-plunger");
    for name in ["first", "waiting"] {
        ns.create_release(name, json!({})).await?;
        label(&ns, name, json!({"team": "payments"})).await?;
        hc.handle(name).await?;
        ns.create_storage_secret(name, 1, "uninstalling").await?;
        ns.mark_stuck(name).await?;
        if name == "first" {
            eventually(
                Duration::from_secs(30),
                "the first is recovered",
                || async {
                    let view = ReleaseView::from_object(&ns.releases().get(name).await?);
                    Ok(view.annotations.contains_key(PROCESSED_VERSION_ANNOTATION))
                },
            )
            .await?;
        }
    }
    eventually(
        Duration::from_secs(30),
        "the second waits for its turn under this install's fence",
        || async {
            let view = ReleaseView::from_object(&ns.releases().get("waiting").await?);
            Ok(view.has_fence()
                && !view.suspend
                && view.fence_label.as_deref() == Some(own.fence_label_value()))
        },
    )
    .await?;

    // GitOps moves the waiting release to another team: the watch no longer
    // sees it, and the install that fenced it drops the fence.
    label(&ns, "waiting", json!({"team": "billing"})).await?;
    eventually(
        Duration::from_secs(20),
        "the fence of the relabelled release is dropped",
        || async {
            let view = ReleaseView::from_object(&ns.releases().get("waiting").await?);
            Ok(!view.has_fence() && !view.fence_labelled())
        },
    )
    .await?;
    let waiting = ReleaseView::from_object(&ns.releases().get("waiting").await?);
    assert!(
        !waiting.suspend
            && !waiting
                .annotations
                .contains_key(PROCESSED_VERSION_ANNOTATION),
        "outside the selector it is let go, never recovered: {waiting:?}"
    );

    // The other install's fence was read and left as it was: the controller
    // wrote nothing to that release, though it is stuck in its scope.
    let controller = guard::shared()?.controller_user();
    let theirs_requests: Vec<_> = testkit::audit::read_since(offset)?
        .into_iter()
        .filter(|r| r.user == controller && r.resource() == "helmreleases" && r.name == "theirs")
        .collect();
    assert!(
        theirs_requests.iter().any(|r| r.verb == "get"),
        "the controller looked at it: {theirs_requests:?}"
    );
    assert!(
        theirs_requests.iter().all(|r| r.verb == "get"),
        "and only looked: {theirs_requests:?}"
    );
    let theirs = ReleaseView::from_object(&ns.releases().get("theirs").await?);
    assert!(
        theirs.has_fence() && theirs.fence_label.as_deref() == Some("tenant-b.flux-plunger"),
        "{theirs:?}"
    );
    assert_eq!(
        ns.secrets()
            .list(&Default::default())
            .await?
            .items
            .iter()
            .filter(|s| s.metadata.name.as_deref() == Some("sh.helm.release.v1.theirs.v1"))
            .count(),
        1
    );
    testkit::strip_fences(&ns).await?;
    Ok(())
}

#[tokio::test]
async fn a_delete_while_the_process_holds_its_suspension_still_reaches_the_uninstall() -> Result<()>
{
    let _turn = testkit::cluster_wide_turn().await;
    let client = control_plane().client().await?;
    let ns = TestNamespace::create(&client, "binary-race").await?;
    let hc = SimulatedHelmController::new(client.clone(), &ns.name);
    let gate = tempfile::tempdir()?;
    let file = gate.path().join("pause").display().to_string();
    // Scoped to this test's namespace: the pause is taken once per process,
    // at the first recovery that reaches it, and stuck releases other tests
    // leave behind must not be the one that takes it.
    let running = start(
        guard::shared()?,
        &[
            "--leader-elect=false",
            &format!("--watch-namespace={}", ns.name),
        ],
        &[
            ("FLUX_PLUNGER_TEST_PAUSE_AT", "acquired"),
            ("FLUX_PLUNGER_TEST_PAUSE_FILE", &file),
        ],
    )
    .await?;
    wait_ready(&running).await?;
    ns.create_release("web", json!({})).await?;
    hc.install("web").await?;
    assert_eq!(hc.handle("web").await?, Handled::AddedFinalizer);
    ns.create_storage_secret("web", 1, "uninstalling").await?;
    ns.mark_stuck("web").await?;

    // The process holds its suspension and fence, paused: the delete lands.
    eventually(
        Duration::from_secs(30),
        "the recovery pauses after the acquire",
        || {
            let reached = std::path::Path::new(&format!("{file}.reached")).exists();
            async move { Ok(reached) }
        },
    )
    .await?;
    let held = ReleaseView::from_object(&ns.releases().get("web").await?);
    assert!(held.suspended_by_us() && held.has_fence(), "{held:?}");
    ns.releases().delete("web", &Default::default()).await?;
    // helm-controller handles the delete first: it skips the uninstall.
    assert_eq!(
        hc.handle("web").await?,
        Handled::UninstallSkippedBecauseSuspended
    );
    assert!(
        ns.releases().get_opt("web").await?.is_some(),
        "the fence holds the release"
    );

    std::fs::write(format!("{file}.release"), b"")?;
    let (helm_controller, stop) = hc.clone().spawn(Duration::from_millis(200));
    eventually(Duration::from_secs(30), "the release is gone", || async {
        Ok(ns.releases().get_opt("web").await?.is_none())
    })
    .await?;
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    helm_controller.await?;
    assert!(
        !hc.resources_exist("web").await?,
        "uninstalled, not orphaned"
    );
    assert_eq!(hc.decisions_for("web").last(), Some(&Handled::Uninstalled));
    let (_, metrics) = http_get(running.metrics, "/metrics").await?;
    assert!(
        metrics.contains("flux_plunger_uninstall_handovers_total{result=\"handed_over\"} 1"),
        "{metrics}"
    );
    Ok(())
}

#[tokio::test]
async fn a_label_selector_the_apiserver_refuses_stops_the_controller_at_start_with_its_reason()
-> Result<()> {
    let client = control_plane().client().await?;
    let ns = TestNamespace::create(&client, "bad-selector").await?;
    let dir = tempfile::tempdir()?;
    let kubeconfig = dir.path().join("kubeconfig");
    ns.guarded()
        .await?
        .write_controller_kubeconfig(&kubeconfig)?;
    let output = Command::new(env!("CARGO_BIN_EXE_flux-plunger"))
        .arg(format!("--kubeconfig={}", kubeconfig.display()))
        .args([
            "--leader-elect=false",
            "--metrics-addr=127.0.0.1:0",
            "--health-addr=127.0.0.1:0",
            "--watch-label-selector=team in (a",
        ])
        .env_remove("POD_NAME")
        .env_remove("POD_NAMESPACE")
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(Duration::from_secs(30), output)
        .await
        .context("the controller kept running with a selector every listing refuses")??;
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    let last = stderr.lines().last().unwrap_or_default();
    assert!(
        last.starts_with(
            "flux-plunger: --watch-label-selector \"team in (a\" is refused by the apiserver: "
        ) && last.contains("unable to parse requirement"),
        "{stderr}"
    );
    Ok(())
}

#[tokio::test]
async fn a_controller_whose_work_ends_unexpectedly_exits_non_zero() -> Result<()> {
    let client = control_plane().client().await?;
    let ns = TestNamespace::create(&client, "controller-ends").await?;
    let hc = SimulatedHelmController::new(client.clone(), &ns.name);
    let guarded = ns.guarded().await?;
    let mut running = start(
        &guarded,
        &[
            "--leader-elect=false",
            &format!("--watch-namespace={}", ns.name),
        ],
        &[("FLUX_PLUNGER_TEST_PANIC_AT", "planned")],
    )
    .await?;
    wait_ready(&running).await?;
    ns.create_release("web", json!({})).await?;
    hc.handle("web").await?;
    ns.create_storage_secret("web", 1, "uninstalling").await?;
    ns.mark_stuck("web").await?;

    let status = tokio::time::timeout(Duration::from_secs(30), running.child.wait())
        .await
        .context(
            "the controller kept running (and its Lease, and /healthz) with nothing reconciling",
        )??;

    assert!(!status.success(), "{status:?}");
    Ok(())
}

/// A standby works as it should while it waits for the Lease: it is ready (a Deployment of two
/// replicas becomes available, as Flux's own controllers do) and serves `/metrics` with
/// `flux_plunger_leader 0`. When the leader dies without a word (SIGKILL: no drain, the Lease
/// left to expire), the standby leads within the Lease's duration and recovers a release made
/// stuck meanwhile; the dead leader's Lease never had two holders.
#[tokio::test]
async fn a_standby_is_ready_serves_metrics_and_leads_once_the_leader_is_gone() -> Result<()> {
    let _turn = testkit::cluster_wide_turn().await;
    let client = control_plane().client().await?;
    let ns = TestNamespace::create(&client, "standby").await?;
    let guarded = ns.guarded().await?;
    let scope = format!("--watch-namespace={}", ns.name);
    let flags = [
        "--leader-elect=true",
        "--leader-election-lease-name=flux-plunger",
        scope.as_str(),
    ];
    let mut leader = start(
        &guarded,
        &flags,
        &[("POD_NAME", "flux-plunger-a"), ("POD_NAMESPACE", &ns.name)],
    )
    .await?;
    wait_ready(&leader).await?;
    metrics_with(leader.metrics, "flux_plunger_leader 1").await?;
    let standby = start(
        &guarded,
        &flags,
        &[("POD_NAME", "flux-plunger-b"), ("POD_NAMESPACE", &ns.name)],
    )
    .await?;
    wait_ready(&standby).await?;
    metrics_with(standby.metrics, "flux_plunger_leader 0").await?;
    let leases: Api<Lease> = Api::namespaced(client.clone(), &ns.name);
    let holder = |lease: Lease| lease.spec.and_then(|s| s.holder_identity);
    assert_eq!(
        holder(leases.get("flux-plunger").await?).as_deref(),
        Some("flux-plunger-a"),
        "the standby waits"
    );

    leader.child.kill().await?;
    let hc = SimulatedHelmController::new(client.clone(), &ns.name);
    ns.create_release("web", json!({})).await?;
    assert_eq!(hc.handle("web").await?, Handled::AddedFinalizer);
    ns.create_storage_secret("web", 1, "superseded").await?;
    ns.create_storage_secret("web", 2, "uninstalling").await?;
    ns.mark_stuck("web").await?;
    let lease_duration = plunger::timings::Timings::default().lease_duration;
    eventually(
        lease_duration * 2 + Duration::from_secs(30),
        "the standby leads and recovers the release",
        || ns.is_recovered("web", 2),
    )
    .await?;
    assert_eq!(
        holder(leases.get("flux-plunger").await?).as_deref(),
        Some("flux-plunger-b")
    );
    metrics_with(standby.metrics, "flux_plunger_leader 1").await?;
    wait_ready(&standby).await?;
    Ok(())
}
