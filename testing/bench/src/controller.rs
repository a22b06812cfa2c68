//! The release `flux-plunger` as a process: its own identity (so the audit
//! log tells its requests from the bench's), its readiness, its memory.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use kube::Client;
use testkit::control_plane::free_ports;
use testkit::{TestNamespace, control_plane};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::process::{Child, Command};

use crate::release_binary;

/// The ServiceAccount the controller runs as in the bench.
pub struct Identity {
    pub namespace: String,
    pub service_account: String,
}

impl Identity {
    /// A ServiceAccount bound to cluster-admin: the bench counts requests,
    /// RBAC is the least-privilege tests' business.
    pub async fn create(admin: &Client) -> Result<Self> {
        let ns = TestNamespace::create(admin, "bench-identity").await?;
        let service_account = "flux-plunger".to_owned();
        control_plane()
            .grant_cluster_admin(admin, &ns.name, &[&service_account])
            .await?;
        Ok(Self {
            namespace: ns.name,
            service_account,
        })
    }

    /// The username the apiserver logs for it.
    pub fn username(&self) -> String {
        testkit::audit::service_account_user(&self.namespace, &self.service_account)
    }

    pub async fn kubeconfig(&self, admin: &Client, dir: &Path) -> Result<PathBuf> {
        let path = dir.join("flux-plunger.kubeconfig");
        control_plane()
            .write_service_account_kubeconfig(admin, &self.namespace, &self.service_account, &path)
            .await?;
        Ok(path)
    }
}

/// What a bench controller watches, and where its Lease is.
#[derive(Debug, Clone, Copy)]
pub enum Watch<'a> {
    /// One namespace (`--watch-namespace`), its Lease there.
    Namespace(&'a str),
    /// Every namespace, the releases matching `selector`
    /// (`--watch-label-selector`), its Lease in `lease_namespace`.
    Selected {
        selector: &'a str,
        lease_namespace: &'a str,
    },
}

impl Watch<'_> {
    fn flags(&self) -> Vec<String> {
        match self {
            Watch::Namespace(namespace) => vec![format!("--watch-namespace={namespace}")],
            Watch::Selected { selector, .. } => vec![format!("--watch-label-selector={selector}")],
        }
    }

    fn lease_namespace(&self) -> &str {
        match self {
            Watch::Namespace(namespace) => namespace,
            Watch::Selected {
                lease_namespace, ..
            } => lease_namespace,
        }
    }
}

/// A running release `flux-plunger`, watching one namespace.
pub struct Controller {
    child: Child,
    pub pid: u32,
    health_port: u16,
    pub spawned: Instant,
    /// Holds its kubeconfig and its log until it is dropped.
    dir: tempfile::TempDir,
}

impl Controller {
    /// Starts it with leader election on (as the chart runs it), its Lease
    /// named `lease` in `namespace`.
    pub async fn spawn(
        admin: &Client,
        identity: &Identity,
        namespace: &str,
        concurrent: u16,
        lease: &str,
    ) -> Result<Self> {
        let dir = tempfile::tempdir()?;
        let kubeconfig = identity.kubeconfig(admin, dir.path()).await?;
        Self::spawn_with(dir, &kubeconfig, namespace, concurrent, lease)
    }

    /// [`Controller::spawn`] with the kubeconfig at `kubeconfig` (e.g. one
    /// through a counting proxy); `dir` is kept for its log until the end.
    pub fn spawn_with(
        dir: tempfile::TempDir,
        kubeconfig: &Path,
        namespace: &str,
        concurrent: u16,
        lease: &str,
    ) -> Result<Self> {
        Self::spawn_watching(
            &release_binary("flux-plunger")?,
            dir,
            kubeconfig,
            Watch::Namespace(namespace),
            concurrent,
            lease,
        )
    }

    /// [`Controller::spawn`] allowing at most `per_minute` recoveries a
    /// minute (`--max-recoveries-per-minute`).
    pub async fn spawn_rate_limited(
        admin: &Client,
        identity: &Identity,
        namespace: &str,
        concurrent: u16,
        lease: &str,
        per_minute: u32,
    ) -> Result<Self> {
        let dir = tempfile::tempdir()?;
        let kubeconfig = identity.kubeconfig(admin, dir.path()).await?;
        Self::launch(
            &release_binary("flux-plunger")?,
            dir,
            &kubeconfig,
            Watch::Namespace(namespace),
            concurrent,
            lease,
            &[format!("--max-recoveries-per-minute={per_minute}")],
        )
    }

    /// `binary` (a `flux-plunger` of this or another build) watching what
    /// `watch` says.
    pub fn spawn_watching(
        binary: &Path,
        dir: tempfile::TempDir,
        kubeconfig: &Path,
        watch: Watch<'_>,
        concurrent: u16,
        lease: &str,
    ) -> Result<Self> {
        Self::launch(binary, dir, kubeconfig, watch, concurrent, lease, &[])
    }

    /// [`Controller::spawn_watching`] with `extra` flags after the others.
    fn launch(
        binary: &Path,
        dir: tempfile::TempDir,
        kubeconfig: &Path,
        watch: Watch<'_>,
        concurrent: u16,
        lease: &str,
        extra: &[String],
    ) -> Result<Self> {
        // Two free_port calls can return the same port.
        let [health_port, metrics_port] = free_ports()?;
        let log = std::fs::File::create(dir.path().join("flux-plunger.log"))?;
        let spawned = Instant::now();
        let child = Command::new(binary)
            .arg(format!("--kubeconfig={}", kubeconfig.display()))
            .args(watch.flags())
            .arg(format!("--concurrent={concurrent}"))
            .arg(format!("--leader-election-lease-name={lease}"))
            .arg(format!("--health-addr=127.0.0.1:{health_port}"))
            .arg(format!("--metrics-addr=127.0.0.1:{metrics_port}"))
            .arg("--log-encoding=json")
            .args(extra)
            .env("POD_NAME", lease)
            .env("POD_NAMESPACE", watch.lease_namespace())
            .env_remove("RUST_LOG")
            .stdout(Stdio::null())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()?;
        let pid = child.id().context("no pid")?;
        Ok(Self {
            child,
            pid,
            health_port,
            spawned,
            dir,
        })
    }

    /// Waits for `/readyz` to answer 200 (the watch has synced); returns the
    /// time from the spawn.
    pub async fn wait_ready(&mut self, timeout: Duration) -> Result<Duration> {
        loop {
            if http_status(self.health_port, "/readyz").await.ok() == Some(200) {
                return Ok(self.spawned.elapsed());
            }
            if let Some(status) = self.child.try_wait()? {
                bail!("flux-plunger exited before it was ready: {status}");
            }
            if self.spawned.elapsed() > timeout {
                bail!("flux-plunger was not ready within {timeout:?}");
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Fails, with the end of its log, once the process has exited: a part
    /// that leaves it running for minutes checks it as it waits.
    pub fn ensure_running(&mut self) -> Result<()> {
        let Some(status) = self.child.try_wait()? else {
            return Ok(());
        };
        let log =
            std::fs::read_to_string(self.dir.path().join("flux-plunger.log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        let tail = lines[lines.len().saturating_sub(20)..].join("\n");
        bail!("flux-plunger exited: {status}; the end of its log:\n{tail}")
    }

    /// Peak and current resident memory (VmHWM, VmRSS), in KiB.
    pub fn memory(&self) -> Result<Memory> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid))?;
        let field = |key: &str| -> Result<u64> {
            status
                .lines()
                .find_map(|l| l.strip_prefix(key))
                .and_then(|rest| rest.split_whitespace().next())
                .and_then(|n| n.parse().ok())
                .with_context(|| format!("no {key} in /proc/{}/status", self.pid))
        };
        Ok(Memory {
            peak_kib: field("VmHWM:")?,
            rss_kib: field("VmRSS:")?,
        })
    }

    /// SIGTERM, and waits for the exit.
    pub async fn stop(mut self) -> Result<()> {
        std::process::Command::new("kill")
            .args(["-TERM", &self.pid.to_string()])
            .status()?;
        match tokio::time::timeout(Duration::from_secs(20), self.child.wait()).await {
            Ok(status) => {
                status?;
            }
            Err(_) => self.child.kill().await?,
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Copy)]
pub struct Memory {
    pub peak_kib: u64,
    pub rss_kib: u64,
}

/// The status code of a plain HTTP/1.0 GET on loopback.
async fn http_status(port: u16, path: &str) -> Result<u16> {
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    stream
        .write_all(format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").as_bytes())
        .await?;
    let mut response = Vec::new();
    stream.read_to_end(&mut response).await?;
    let text = String::from_utf8_lossy(&response);
    text.split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .context("no HTTP status line")
}
