//! A namespace of its own with the chart installed into the local control
//! plane, for the tests that install it (`tests/chart_install.rs`,
//! `tests/uninstall_hook.rs`).

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

use anyhow::{Context, Result, bail};
use testkit::control_plane::{AuthInfo, tool};
use testkit::{TestNamespace, control_plane};

use crate::{Render, chart_dir, helm};

/// A namespace of its own, and an admin kubeconfig file for helm and kubectl.
pub struct Setup {
    pub ns: TestNamespace,
    _dir: tempfile::TempDir,
    /// An admin kubeconfig file.
    pub kubeconfig: PathBuf,
}

impl Setup {
    pub async fn new(prefix: &str) -> Result<Self> {
        let plane = control_plane();
        let ns = TestNamespace::create(&plane.client().await?, prefix).await?;
        let dir = tempfile::tempdir()?;
        let kubeconfig = dir.path().join("kubeconfig");
        plane.write_kubeconfig(&kubeconfig, &AuthInfo::AdminCertificate)?;
        Ok(Self {
            ns,
            _dir: dir,
            kubeconfig,
        })
    }

    /// The release is named after the namespace, so that the cluster-scoped
    /// objects of tests running side by side do not collide.
    pub fn release(&self) -> &str {
        &self.ns.name
    }

    pub fn fullname(&self) -> String {
        format!("{}-flux-plunger", self.release())
    }

    /// `helm ARGS` in this namespace, as the admin.
    pub fn helm_command(&self, args: &[&str]) -> Result<Command> {
        let mut cmd = helm()?;
        cmd.args(args)
            .arg("--namespace")
            .arg(&self.ns.name)
            .arg("--kubeconfig")
            .arg(&self.kubeconfig);
        Ok(cmd)
    }

    pub fn helm(&self, args: &[&str]) -> Result<Output> {
        Ok(self.helm_command(args)?.output()?)
    }

    pub fn install(&self, extra: &[&str]) -> Result<()> {
        let chart = chart_dir().display().to_string();
        let mut args = vec!["install", self.release(), chart.as_str()];
        args.extend_from_slice(extra);
        succeeded(self.helm(&args)?, "helm install")
    }

    /// Waits until the apiserver enforces the admission guard the chart
    /// installed (its ValidatingAdmissionPolicy is named like the chart's
    /// other objects), probing as the chart's controller ServiceAccount.
    pub async fn wait_for_guard(&self) -> Result<()> {
        let plane = control_plane();
        let controller = plane
            .service_account_client(&self.ns.client, &self.ns.name, &self.fullname())
            .await?;
        testkit::guard::wait_enforced(
            &self.ns.client,
            &controller,
            &self.ns.name,
            &self.fullname(),
        )
        .await
    }

    /// `kubectl ARGS -f -` with `stdin`.
    pub fn kubectl_stdin(&self, args: &[&str], stdin: &str) -> Result<Output> {
        let mut child = Command::new(tool("kubectl")?)
            .arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .arg("--namespace")
            .arg(&self.ns.name)
            .args(args)
            .args(["-f", "-"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()?;
        child
            .stdin
            .take()
            .context("kubectl stdin")?
            .write_all(stdin.as_bytes())?;
        Ok(child.wait_with_output()?)
    }

    pub fn render(&self) -> Render {
        Render::new(self.release(), &self.ns.name)
    }
}

/// An error with the command's stdout and stderr unless it succeeded.
pub fn succeeded(output: Output, what: &str) -> Result<()> {
    if !output.status.success() {
        bail!(
            "{what} failed: {}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(())
}
