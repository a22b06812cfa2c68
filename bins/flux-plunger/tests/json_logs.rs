//! `--log-encoding=json`, the chart's default, as the binary writes it: every
//! log line one JSON object in the shape Flux's controllers write, which
//! `flux logs` and the log queries written for Flux read, and a HelmRelease
//! named as Flux names it. The formatter's own cases are its unit tests
//! (plunger::logs); these are its wiring.

use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result};
use serde_json::{Map, Value, json};
use testkit::control_plane::AuthInfo;
use testkit::process::LoggedProcess;
use testkit::{TestNamespace, control_plane};

/// The controller against an apiserver that does not answer: it warns once
/// a second for its 10 s of patience, then fails. Returns its stderr.
fn controller_without_an_apiserver() -> Result<String> {
    let port = testkit::control_plane::free_port()?;
    let dir = tempfile::tempdir()?;
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: https://127.0.0.1:{port}\n    insecure-skip-tls-verify: true\ncontexts:\n- name: c\n  context: {{cluster: c, user: u}}\ncurrent-context: c\nusers:\n- name: u\n  user:\n    token: t\n"
        ),
    )?;
    let output = Command::new(env!("CARGO_BIN_EXE_flux-plunger"))
        .arg(format!("--kubeconfig={}", kubeconfig.display()))
        .args([
            "--leader-elect=false",
            "--metrics-addr=127.0.0.1:0",
            "--health-addr=127.0.0.1:0",
            "--log-encoding=json",
        ])
        .env_remove("RUST_LOG")
        .output()?;
    Ok(String::from_utf8(output.stderr)?)
}

/// The log lines of `log`, each parsed; the one line that is not a log
/// line, the reason for a failure's exit status (for a person reading the
/// container's last words), left out.
fn log_lines(log: &str) -> Result<Vec<Map<String, Value>>> {
    log.lines()
        .filter(|line| !line.starts_with("flux-plunger: "))
        .map(|line| {
            serde_json::from_str(line).with_context(|| format!("not a JSON object: {line}"))
        })
        .collect()
}

/// The first log line whose `msg` is `msg`.
fn line<'a>(lines: &'a [Map<String, Value>], msg: &str) -> Result<&'a Map<String, Value>> {
    lines
        .iter()
        .find(|line| line["msg"] == msg)
        .with_context(|| format!("no line {msg:?} in {lines:#?}"))
}

#[test]
fn every_log_line_is_in_the_shape_flux_writes() -> Result<()> {
    let lines = log_lines(&controller_without_an_apiserver()?)?;
    for line in &lines {
        for key in ["level", "ts", "logger", "msg"] {
            assert!(line[key].is_string(), "{key} in {line:?}");
        }
        assert!(line["ts"].as_str().unwrap().ends_with('Z'), "{line:?}");
    }

    let waiting = line(&lines, "the apiserver does not answer yet; trying again")?;
    assert_eq!(waiting["level"], "warn");
    assert_eq!(waiting["logger"], "plunger::cli");
    assert!(
        waiting["server"]
            .as_str()
            .unwrap()
            .starts_with("https://127.0.0.1:")
    );
    assert!(waiting["error"].is_string(), "{waiting:?}");

    let failed = line(&lines, "flux-plunger failed")?;
    assert_eq!(failed["level"], "error");
    assert!(
        failed["error"].as_str().unwrap().contains("did not answer"),
        "{failed:?}"
    );
    Ok(())
}

/// The line `msg` that the controller, logging JSON and watching `ns`
/// alone, writes first, parsed; the controller stopped once it has.
async fn first_line_logged(ns: &TestNamespace, msg: &str) -> Result<Map<String, Value>> {
    let dir = tempfile::tempdir()?;
    let kubeconfig = dir.path().join("kubeconfig");
    control_plane().write_kubeconfig(&kubeconfig, &AuthInfo::AdminCertificate)?;
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_flux-plunger"));
    command
        .arg(format!("--kubeconfig={}", kubeconfig.display()))
        .arg(format!("--watch-namespace={}", ns.name))
        .args([
            "--leader-elect=false",
            "--metrics-addr=127.0.0.1:0",
            "--health-addr=127.0.0.1:0",
            "--log-encoding=json",
        ])
        .env_remove("RUST_LOG");
    let mut controller = LoggedProcess::spawn(command, "controller")?;
    controller.wait_logged(msg, Duration::from_secs(60)).await?;
    controller.terminate(Duration::from_secs(20)).await?;
    let lines = log_lines(&controller.log())?;
    Ok(line(&lines, msg)?.clone())
}

#[tokio::test]
async fn a_release_is_named_as_flux_names_the_object_it_reconciles() -> Result<()> {
    let ns = TestNamespace::create(&control_plane().client().await?, "json-logs").await?;
    // Stuck on an `uninstalling` revision 2 over a `superseded` 1.
    ns.create_release("web", json!({})).await?;
    ns.create_storage_secret("web", 1, "superseded").await?;
    ns.create_storage_secret("web", 2, "uninstalling").await?;
    ns.mark_stuck("web").await?;
    let line = first_line_logged(&ns, "deleted the newest storage revision").await?;
    assert_eq!(line["level"], "info");
    assert_eq!(line["logger"], "plunger::reconcile::recover");
    assert_eq!(
        line["HelmRelease"],
        json!({"name": "web", "namespace": ns.name})
    );
    assert_eq!(line["namespace"], ns.name.as_str());
    assert_eq!(line["name"], "web");
    assert_eq!(line["secret"], "sh.helm.release.v1.web.v2");
    assert!(!line.contains_key("release"), "{line:?}");
    Ok(())
}

/// SPEC §4.6: a stuck release whose newest revision is `deployed` is left
/// alone, and the line that says so names the storage it read, so that an
/// operator sees where flux-plunger looked.
#[tokio::test]
async fn a_stuck_release_with_nothing_to_reclaim_is_logged_with_the_storage_read() -> Result<()> {
    let ns = TestNamespace::create(&control_plane().client().await?, "json-logs-skip").await?;
    ns.create_release("web", json!({})).await?;
    ns.create_storage_secret("web", 1, "deployed").await?;
    ns.mark_stuck("web").await?;
    let line = first_line_logged(&ns, "stuck, but nothing to reclaim").await?;
    assert_eq!(line["level"], "info");
    assert_eq!(line["name"], "web");
    let reason = line["reason"].as_str().context("no reason")?;
    assert!(reason.contains("LatestIsDeployed"), "{line:?}");
    let storage = line["storage"].as_str().context("no storage field")?;
    assert!(
        storage.contains(&format!("namespace: \"{}\"", ns.name))
            && storage.contains("release_name: \"web\""),
        "{line:?}"
    );
    Ok(())
}
