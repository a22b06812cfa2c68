//! The test world's OCI registry: `_out/bin/registry` (go-containerregistry's
//! `pkg/registry` in a main of ours, `hack/tools/registry`), on loopback,
//! serving HTTPS with a certificate from the control plane's CA.
//!
//! Clients trust it as they trust a real registry, by that CA and not by an
//! "insecure" switch: `helm push --ca-file`, `registry push --ca-file` (the
//! images `make image` built), source-controller through the CA as its
//! system roots ([`crate::source_controller`]), the node's containerd through
//! a `hosts.toml` naming it ([`crate::node::containerd`]).
//!
//! One registry per test process, started on first use and stopped with it
//! (see [`crate::process`]); tests keep apart by repository (their namespace's
//! name).

use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::chart::ChartArchive;
use crate::control_plane::{control_plane, helm, tail, tool};
use crate::flux_controller::scratch_dir;
use crate::process::Supervised;

/// How long the registry may take to listen: it is one small Go program.
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// What the registry prints once it listens, followed by its address.
const SERVING: &str = "serving https://";

/// The running registry of this test process.
pub struct OciRegistry {
    /// `127.0.0.1:PORT`: the host of every reference into it.
    pub host: String,
    /// The CA its certificate chains to (the control plane's): what a client
    /// of it trusts.
    pub ca_cert: PathBuf,
    /// Its log: every request, one line each.
    pub log: PathBuf,
    server: Mutex<Supervised>,
}

/// A chart as `helm push` left it in the registry.
#[derive(Clone, Debug)]
pub struct PushedChart {
    /// `oci://HOST/REPOSITORY/NAME`: an `OCIRepository`'s `spec.url`.
    pub url: String,
    /// The tag it was pushed as: the chart's version.
    pub tag: String,
    /// `sha256:…`, the digest of its manifest.
    pub digest: String,
}

/// An image as `registry push` left it in the registry.
#[derive(Clone, Debug)]
pub struct PushedImage {
    /// `HOST/REPOSITORY`: the chart's `image.repository`.
    pub repository: String,
    /// `sha256:…`, the digest of its manifest: the chart's `image.digest`.
    pub digest: String,
}

impl PushedImage {
    /// `HOST/REPOSITORY@sha256:…`: what a pod names and the node pulls.
    pub fn reference(&self) -> String {
        format!("{}@{}", self.repository, self.digest)
    }
}

static REGISTRY: OnceLock<Result<OciRegistry, String>> = OnceLock::new();

/// The registry of this test process, started on first use (with the control
/// plane, whose CA signs its certificate).
pub fn registry() -> &'static OciRegistry {
    crate::started::once(&REGISTRY, "the OCI registry", OciRegistry::start)
}

impl OciRegistry {
    fn start() -> Result<Self> {
        let started = Instant::now();
        let binary = tool("registry")?;
        let pki = control_plane().pki();
        // The supervisor removes this directory (certificate, blobs, log)
        // once the registry stopped.
        let dir = scratch_dir("flux-plunger-registry-")?;
        let (cert, key) = pki.serving_certificate(&["127.0.0.1", "localhost"])?;
        std::fs::write(dir.join("tls.crt"), cert)?;
        std::fs::write(dir.join("tls.key"), key)?;
        let log = dir.join("registry.log");
        let args = vec![
            // Port 0: the registry reports the port the kernel gave it.
            "--address=127.0.0.1:0".to_owned(),
            format!("--tls-cert={}", dir.join("tls.crt").display()),
            format!("--tls-key={}", dir.join("tls.key").display()),
            // On disk rather than in memory: an image is tens of megabytes.
            format!("--blob-dir={}", dir.join("blobs").display()),
        ];
        let mut server = Supervised::spawn("registry", &binary, &args, &log, Some(&dir))?;
        let deadline = started + START_TIMEOUT;
        let host = loop {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            if let Some(host) = text.lines().find_map(|l| l.strip_prefix(SERVING)) {
                break host.trim().to_owned();
            }
            if !server.is_running() || Instant::now() > deadline {
                bail!(
                    "the registry did not start listening; its log:\n{}",
                    tail(&log, 20)
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        eprintln!(
            "testkit: OCI registry at https://{host} in {:.1}s (log {})",
            started.elapsed().as_secs_f64(),
            log.display()
        );
        Ok(Self {
            host,
            ca_cert: pki.ca_cert.clone(),
            log,
            server: Mutex::new(server),
        })
    }

    /// `helm push`es `archive` (a packaged chart named `name`, at `version`)
    /// into repository `repository` (e.g. the test's namespace), as a user
    /// publishes a chart: `oci://HOST/REPOSITORY/NAME:VERSION`.
    pub fn push_chart(
        &self,
        repository: &str,
        name: &str,
        version: &str,
        archive: &ChartArchive,
    ) -> Result<PushedChart> {
        let dir = tempfile::tempdir()?;
        let package = dir.path().join(format!("{name}-{version}.tgz"));
        std::fs::write(&package, &archive.bytes)?;
        let mut push = helm()?;
        push.arg("push")
            .arg(&package)
            .arg(format!("oci://{}/{repository}", self.host))
            .arg("--ca-file")
            .arg(&self.ca_cert);
        let said = self.run(&format!("helm push {name}-{version}"), push)?;
        let digest = said
            .lines()
            .find_map(|l| l.strip_prefix("Digest: "))
            .with_context(|| format!("helm push printed no digest: {said}"))?
            .trim()
            .to_owned();
        Ok(PushedChart {
            url: format!("oci://{}/{repository}/{name}", self.host),
            tag: version.to_owned(),
            digest,
        })
    }

    /// Pushes the image of an OCI archive `make image` built (an image layout
    /// in a tar) into `repository` as `tag`, its manifest as the archive holds
    /// it: the digest returned is the archive's own, so a pull by it gets
    /// exactly what was built.
    pub fn push_image(&self, archive: &Path, repository: &str, tag: &str) -> Result<PushedImage> {
        let mut push = std::process::Command::new(tool("registry")?);
        push.arg("push")
            .arg("--ca-file")
            .arg(&self.ca_cert)
            .arg(archive)
            .arg(format!("{}/{repository}:{tag}", self.host));
        let said = self.run(&format!("registry push {}", archive.display()), push)?;
        let (pushed_repository, digest) = said
            .lines()
            .find_map(|l| l.strip_prefix("pushed "))
            .and_then(|r| r.trim().split_once('@'))
            .with_context(|| format!("registry push printed no reference: {said}"))?;
        Ok(PushedImage {
            repository: pushed_repository.to_owned(),
            digest: digest.to_owned(),
        })
    }

    /// Runs a client of the registry (`what` names it) and returns what it
    /// printed; if it fails, the error carries that and the registry's log.
    fn run(&self, what: &str, mut client: std::process::Command) -> Result<String> {
        let output = client.output().with_context(|| format!("running {what}"))?;
        let said = format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        if !output.status.success() {
            bail!(
                "{what} failed: {said}\nregistry log:\n{}",
                tail(&self.log, 20)
            );
        }
        Ok(said)
    }

    /// True while the registry runs.
    pub fn is_running(&self) -> bool {
        self.server.lock().unwrap().is_running()
    }
}
