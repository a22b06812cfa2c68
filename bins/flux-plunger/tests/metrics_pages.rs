//! The `/metrics` pages the chart's alerts and dashboard are tested on
//! (`chart-tests/prometheus/`): captured from the controller as a process
//! against the local control plane, a leader and a standby on one Lease, in
//! the states the alerts are about (a recovery, one deferred, a failing
//! reconcile, a fence the leader dies holding and its successor inherits).
//!
//! The pages are kept in `chart-tests/prometheus/pages/`, and the promtool
//! tests' input series are written from the names and label sets on them
//! (`testing/chart-contract/tests/alerts.rs` checks that they are). This test
//! captures them afresh on every run and fails when a kept page no longer
//! matches what the binary exports: a series of the kept page missing from
//! the fresh one, or a family of the fresh one missing from the kept one.
//! `FLUX_PLUNGER_UPDATE_METRICS_PAGES=1` writes the fresh pages instead.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use kube::api::{Patch, PatchParams};
use serde_json::json;
use testkit::crash::{PauseGate, kill9};
use testkit::guard::Guarded;
use testkit::{Handled, SimulatedHelmController, TestNamespace, control_plane, eventually};
use tokio::process::{Child, Command};

/// The grace period the two pods run with: the shortest, so that the
/// successor's Lease wait is short.
const GRACE: u64 = 40;

struct Pod {
    child: Child,
    metrics: u16,
    _dir: tempfile::TempDir,
}

async fn start(guarded: &Guarded, ns: &str, pod: &str, env: &[(&str, String)]) -> Result<Pod> {
    let dir = tempfile::tempdir()?;
    let kubeconfig = dir.path().join("kubeconfig");
    guarded.write_controller_kubeconfig(&kubeconfig)?;
    let [metrics, health] = testkit::control_plane::free_ports()?;
    let child = Command::new(env!("CARGO_BIN_EXE_flux-plunger"))
        .arg(format!("--kubeconfig={}", kubeconfig.display()))
        .arg(format!("--metrics-addr=127.0.0.1:{metrics}"))
        .arg(format!("--health-addr=127.0.0.1:{health}"))
        .arg(format!("--shutdown-grace-period-seconds={GRACE}"))
        .arg("--leader-elect=true")
        .arg("--leader-election-lease-name=flux-plunger")
        .arg(format!("--watch-namespace={ns}"))
        .arg("--log-encoding=console")
        .env("POD_NAME", pod)
        .env("POD_NAMESPACE", ns)
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()?;
    Ok(Pod {
        child,
        metrics,
        _dir: dir,
    })
}

async fn page(port: u16) -> Result<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    stream
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .await?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await?;
    let (head, body) = response.split_once("\r\n\r\n").context("no body")?;
    anyhow::ensure!(head.starts_with("HTTP/1.1 200"), "{head}");
    Ok(body.to_owned())
}

/// Waits until the page holds every one of `lines`, and returns it. A line
/// ending in `}` is a series, whatever its value.
async fn page_with(pod: &mut Pod, lines: &[&str], within: Duration) -> Result<String> {
    let deadline = Instant::now() + within;
    loop {
        if let Some(status) = pod.child.try_wait()? {
            bail!("the controller exited ({status})");
        }
        if let Ok(text) = page(pod.metrics).await
            && lines.iter().all(|line| {
                text.lines().any(|l| {
                    l == *line || (line.ends_with('}') && l.starts_with(&format!("{line} ")))
                })
            })
        {
            return Ok(text);
        }
        if Instant::now() > deadline {
            let last = page(pod.metrics).await.unwrap_or_default();
            bail!("/metrics never held {lines:?}:\n{last}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The series of a page by name and label names (label values and sample
/// values vary from run to run; a histogram's `le` is kept), and its
/// families (`# TYPE` lines).
fn shape(page: &str) -> (BTreeSet<String>, BTreeSet<String>) {
    let series = page
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| l.rsplit_once(' ').map(|(series, _)| series))
        .map(|series| match series.split_once('{') {
            Some((name, labels)) if !labels.starts_with("le=") => {
                let names: Vec<&str> = labels
                    .trim_end_matches('}')
                    .split(',')
                    .filter_map(|pair| pair.split_once('=').map(|(k, _)| k))
                    .collect();
                format!("{name}{{{}}}", names.join(","))
            }
            _ => series.to_owned(),
        })
        .collect();
    let families = page
        .lines()
        .filter(|l| l.starts_with("# TYPE "))
        .map(str::to_owned)
        .collect();
    (series, families)
}

fn pages_dir() -> PathBuf {
    testkit::control_plane::workspace_root()
        .join("chart-tests")
        .join("prometheus")
        .join("pages")
}

/// Writes the fresh page when asked to; otherwise holds the kept one to it.
fn keep_or_compare(name: &str, fresh: &str) -> Result<()> {
    let path = pages_dir().join(name);
    if std::env::var_os("FLUX_PLUNGER_UPDATE_METRICS_PAGES").is_some() {
        std::fs::create_dir_all(pages_dir())?;
        std::fs::write(&path, fresh)?;
        return Ok(());
    }
    let kept = std::fs::read_to_string(&path).with_context(|| {
        format!(
            "{} (FLUX_PLUNGER_UPDATE_METRICS_PAGES=1 writes it)",
            path.display()
        )
    })?;
    let (kept_series, kept_families) = shape(&kept);
    let (fresh_series, fresh_families) = shape(fresh);
    let missing: Vec<_> = kept_series.difference(&fresh_series).collect();
    let new: Vec<_> = fresh_families
        .symmetric_difference(&kept_families)
        .collect();
    if !missing.is_empty() || !new.is_empty() {
        bail!(
            "{} is no longer what the controller exports: series no longer exported {missing:?}, \
             families on one page only {new:?}. Run this test with \
             FLUX_PLUNGER_UPDATE_METRICS_PAGES=1, then check chart-tests/prometheus/ and the chart's \
             alerts and dashboard against the new page.\nFresh page:\n{fresh}",
            path.display()
        );
    }
    Ok(())
}

#[tokio::test]
async fn the_pages_the_alerts_are_tested_on_are_what_the_controller_exports() -> Result<()> {
    let _turn = testkit::cluster_wide_turn().await;
    let client = control_plane().client().await?;
    let ns = TestNamespace::create(&client, "pages").await?;
    let guarded = ns.guarded().await?;
    let hc = SimulatedHelmController::new(client.clone(), &ns.name);
    let stuck = |name: &'static str| {
        let ns = &ns;
        let hc = &hc;
        async move {
            ns.create_release(name, json!({})).await?;
            assert_eq!(hc.handle(name).await?, Handled::AddedFinalizer);
            ns.create_storage_secret(name, 1, "superseded").await?;
            ns.create_storage_secret(name, 2, "uninstalling").await?;
            ns.mark_stuck(name).await
        }
    };

    // The leader pauses before its first acquire (where another manager's
    // suspension defers the recovery) and after its second (where it dies
    // holding the fence).
    let gate = PauseGate::new()?;
    let mut leader = start(
        &guarded,
        &ns.name,
        "flux-plunger-a",
        &gate.env(&["before-acquire", "acquired@2"]),
    )
    .await?;
    page_with(
        &mut leader,
        &["flux_plunger_leader 1"],
        Duration::from_secs(30),
    )
    .await?;
    let mut standby = start(&guarded, &ns.name, "flux-plunger-b", &[]).await?;
    let standby_page = page_with(
        &mut standby,
        &["flux_plunger_leader 0"],
        Duration::from_secs(30),
    )
    .await?;

    // Deferred: an operator's `flux suspend` lands between the plan and the acquire.
    stuck("busy").await?;
    gate.wait_reached("before-acquire", &mut leader.child)
        .await?;
    ns.releases()
        .patch(
            "busy",
            &PatchParams {
                field_manager: Some("operator".into()),
                ..Default::default()
            },
            &Patch::Merge(json!({"spec": {"suspend": true}})),
        )
        .await?;
    gate.release()?;
    // Recovered.
    stuck("web").await?;
    eventually(Duration::from_secs(30), "web is recovered", || {
        ns.is_recovered("web", 2)
    })
    .await?;
    // A reconcile that fails: the kubeconfig Secret of a remote release is missing.
    ns.create_release(
        "remote",
        json!({"kubeConfig": {"secretRef": {"name": "remote-kubeconfig"}}}),
    )
    .await?;
    assert_eq!(hc.handle("remote").await?, Handled::AddedFinalizer);
    ns.mark_stuck("remote").await?;
    // The fence the leader dies holding.
    stuck("held").await?;
    gate.wait_reached("acquired@2", &mut leader.child).await?;
    let leader_page = page_with(
        &mut leader,
        &[
            "flux_plunger_leader 1",
            "flux_plunger_recoveries_total{result=\"deferred\"} 1",
            "flux_plunger_recoveries_total{result=\"recovered\"} 1",
            "flux_plunger_fences_held 1",
            "flux_plunger_fences_inherited_total 0",
            // `remote` fails apart from `held`'s pause: waited for, not assumed.
            "flux_plunger_reconcile_errors_total{kind=\"read_kubeconfig\"}",
        ],
        Duration::from_secs(30),
    )
    .await?;
    kill9(&mut leader.child).await?;

    // The successor finds the fence the dead leader left, and settles it.
    let lease_duration = plunger::timings::Timings::from_grace_period(GRACE)?.lease_duration;
    let successor_page = page_with(
        &mut standby,
        &[
            "flux_plunger_leader 1",
            "flux_plunger_fences_inherited_total 1",
            "flux_plunger_recoveries_total{result=\"recovered\"} 1",
            "flux_plunger_reconcile_errors_total{kind=\"read_kubeconfig\"}",
        ],
        lease_duration * 2 + Duration::from_secs(30),
    )
    .await?;
    anyhow::ensure!(ns.is_recovered("held", 2).await?, "held is recovered");

    keep_or_compare("standby.txt", &standby_page)?;
    keep_or_compare("leader.txt", &leader_page)?;
    keep_or_compare("successor.txt", &successor_page)?;
    Ok(())
}
