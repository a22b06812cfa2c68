//! Bad flags and a kubeconfig that does not work: every binary exits
//! non-zero with a message that names what is wrong, and never panics.

use std::process::Command;

use anyhow::Result;
use testkit::control_plane::workspace_binary;

fn run(binary: &str, args: &[&str]) -> Result<(Option<i32>, String)> {
    let path = if binary == "flux-plunger" {
        env!("CARGO_BIN_EXE_flux-plunger").into()
    } else {
        workspace_binary(binary)?
    };
    let output = Command::new(path)
        .args(args)
        .env_remove("POD_NAMESPACE")
        .env_remove("POD_NAME")
        .env_remove("KUBECONFIG")
        .env("HOME", "/nonexistent-home")
        .output()?;
    let stderr = String::from_utf8_lossy(&output.stderr).to_string();
    assert!(
        !stderr.contains("panicked"),
        "{binary} {args:?} panicked: {stderr}"
    );
    Ok((output.status.code(), stderr))
}

#[test]
fn every_bad_flag_value_exits_2_and_names_the_flag() -> Result<()> {
    let cases: &[(&str, &[&str], &str)] = &[
        ("flux-plunger", &["--concurrent=0"], "--concurrent"),
        ("flux-plunger", &["--concurrent=lots"], "--concurrent"),
        (
            "flux-plunger",
            &["--metrics-addr=everywhere"],
            "--metrics-addr",
        ),
        ("flux-plunger", &["--health-addr=:99999"], "--health-addr"),
        ("flux-plunger", &["--log-level=loud"], "--log-level"),
        ("flux-plunger", &["--log-encoding=xml"], "--log-encoding"),
        ("flux-plunger", &["--leader-elect=maybe"], "--leader-elect"),
        (
            "flux-plunger",
            &["--shutdown-grace-period-seconds=39"],
            "--shutdown-grace-period-seconds",
        ),
        (
            "flux-plunger",
            &["--shutdown-grace-period-seconds=90.7"],
            "--shutdown-grace-period-seconds",
        ),
        (
            "flux-plunger",
            &["--max-recoveries-per-minute=-1"],
            "--max-recoveries-per-minute",
        ),
        ("flux-plunger", &["--events-addr=ftp://x"], "--events-addr"),
        ("flux-plunger", &["--no-such-flag"], "--no-such-flag"),
        ("flux-plunger-drain", &["--concurrent=0"], "--concurrent"),
        (
            "flux-plunger-drain",
            &["--shutdown-grace-period-seconds=141"],
            "--shutdown-grace-period-seconds",
        ),
        (
            "flux-plunger-sweep",
            &["hook", "--shutdown-grace-period-seconds=abc"],
            "--shutdown-grace-period-seconds",
        ),
        ("flux-plunger-sweep", &["list", "-o", "yaml"], "--output"),
        (
            "flux-plunger-sweep",
            &["release", "no-slash"],
            "NAMESPACE/NAME",
        ),
        (
            "flux-plunger-sweep",
            &["release", "a/b/c"],
            "NAMESPACE/NAME",
        ),
    ];
    for (binary, args, named) in cases {
        let (code, stderr) = run(binary, args)?;
        assert_eq!(code, Some(2), "{binary} {args:?}: {stderr}");
        assert!(
            stderr.contains(named),
            "{binary} {args:?} does not name {named}: {stderr}"
        );
    }
    Ok(())
}

#[test]
fn the_same_port_for_metrics_and_health_is_refused() -> Result<()> {
    let (code, stderr) = run(
        "flux-plunger",
        &["--metrics-addr=:8080", "--health-addr=:8080"],
    )?;
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("--metrics-addr") && stderr.contains("--health-addr"),
        "{stderr}"
    );
    Ok(())
}

#[test]
fn a_kubeconfig_that_cannot_be_read_is_named() -> Result<()> {
    for (binary, args) in [
        (
            "flux-plunger",
            vec![
                "--kubeconfig=/nonexistent/kubeconfig",
                "--leader-elect=false",
                "--metrics-addr=127.0.0.1:0",
                "--health-addr=127.0.0.1:0",
            ],
        ),
        (
            "flux-plunger-sweep",
            vec!["list", "--kubeconfig=/nonexistent/kubeconfig"],
        ),
    ] {
        let (code, stderr) = run(binary, &args)?;
        assert_eq!(code, Some(1), "{binary}: {stderr}");
        assert!(
            stderr.contains("--kubeconfig /nonexistent/kubeconfig"),
            "{binary}: {stderr}"
        );
    }
    Ok(())
}

#[test]
fn a_kubeconfig_that_is_not_yaml_is_named() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("kubeconfig");
    std::fs::write(&path, "{{{ not a kubeconfig")?;
    let flag = format!("--kubeconfig={}", path.display());
    let (code, stderr) = run("flux-plunger-sweep", &["list", &flag])?;
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains("--kubeconfig"), "{stderr}");
    Ok(())
}

#[test]
fn the_sweep_without_a_namespace_says_which_flag_is_missing() -> Result<()> {
    let (code, stderr) = run("flux-plunger-sweep", &["hook"])?;
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("--namespace (or POD_NAMESPACE)"),
        "{stderr}"
    );
    Ok(())
}

/// A kubeconfig that reads fine but points where no apiserver answers: the
/// controller says so, naming the server and the flag, and exits 1 (to be
/// restarted) instead of running blind; the sweeper's commands fail naming
/// the refused connection.
#[test]
fn a_kubeconfig_whose_apiserver_does_not_answer_is_named() -> Result<()> {
    // A port that was just free: nothing listens there.
    let port = testkit::control_plane::free_port()?;
    let server = format!("https://127.0.0.1:{port}");
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("kubeconfig");
    std::fs::write(
        &path,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: {server}\n    insecure-skip-tls-verify: true\ncontexts:\n- name: c\n  context: {{cluster: c, user: u}}\ncurrent-context: c\nusers:\n- name: u\n  user:\n    token: t\n"
        ),
    )?;
    let flag = format!("--kubeconfig={}", path.display());

    let (code, stderr) = run(
        "flux-plunger",
        &[
            &flag,
            "--leader-elect=false",
            "--metrics-addr=127.0.0.1:0",
            "--health-addr=127.0.0.1:0",
            "--log-encoding=console",
        ],
    )?;
    assert_eq!(code, Some(1), "{stderr}");
    assert!(
        stderr.contains(&format!("the apiserver at {server}/"))
            && stderr.contains(&format!("--kubeconfig {}", path.display()))
            && stderr.contains("did not answer"),
        "{stderr}"
    );

    let (code, stderr) = run("flux-plunger-sweep", &["list", &flag])?;
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains("Connection refused"), "{stderr}");
    Ok(())
}
