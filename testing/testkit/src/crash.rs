//! Crash at every step: hold a test build of a binary at a fail point,
//! SIGKILL it there, and check the invariants once a restarted binary (or a
//! second run) has settled things.
//!
//! The fail points and their environment are described in
//! `plunger::test_hooks`. A SIGKILL while the process waits at a point is a
//! crash right before (or right after) that write: no destructor runs,
//! nothing is undone, nothing buffered is flushed.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use plunger::release::view::ReleaseView;

use crate::{Handled, SimulatedHelmController, TestNamespace};

/// How long a process may take to reach a fail point, and how long things
/// may take to settle after a crash: generous bounds for a loaded CI
/// machine, never asserted as timings.
pub const REACH_WITHIN: Duration = Duration::from_secs(60);
pub const SETTLE_WITHIN: Duration = Duration::from_secs(90);

/// The files through which a test holds a process at fail points.
pub struct PauseGate {
    _dir: tempfile::TempDir,
    file: String,
}

impl PauseGate {
    pub fn new() -> Result<Self> {
        let dir = tempfile::tempdir()?;
        let file = dir.path().join("pause").display().to_string();
        Ok(Self { _dir: dir, file })
    }

    /// The environment that pauses a process at each of `points`, in order.
    pub fn env(&self, points: &[&str]) -> Vec<(&'static str, String)> {
        vec![
            ("FLUX_PLUNGER_TEST_PAUSE_AT", points.join(",")),
            ("FLUX_PLUNGER_TEST_PAUSE_FILE", self.file.clone()),
        ]
    }

    /// Waits until `child` waits at `point`; fails if it exits first.
    pub async fn wait_reached(&self, point: &str, child: &mut tokio::process::Child) -> Result<()> {
        let reached = format!("{}.reached", self.file);
        let deadline = Instant::now() + REACH_WITHIN;
        loop {
            if std::fs::read_to_string(&reached).is_ok_and(|p| p == point) {
                return Ok(());
            }
            if let Some(status) = child.try_wait()? {
                bail!("the process exited ({status}) before it reached {point}");
            }
            if Instant::now() > deadline {
                bail!("the process did not reach {point} in {REACH_WITHIN:?}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Lets the process go on from the point it waits at.
    pub fn release(&self) -> Result<()> {
        std::fs::write(format!("{}.release", self.file), b"")?;
        Ok(())
    }
}

/// A release as the crash suites describe it: `gone`, or `live`/`terminating`
/// then `suspended` (by flux-plunger alone or with others) and `fenced`.
pub fn release_words(release: Option<&ReleaseView>) -> Vec<&'static str> {
    let Some(view) = release else {
        return vec!["gone"];
    };
    let mut words = vec![if view.terminating {
        "terminating"
    } else {
        "live"
    }];
    if view.suspended_by_us() {
        words.push("suspended");
    }
    if view.has_fence() {
        words.push("fenced");
    }
    words
}

/// SIGKILL, and waits until the process is gone: from here on it writes nothing.
pub async fn kill9(child: &mut tokio::process::Child) -> Result<()> {
    // tokio's kill is SIGKILL on Unix.
    child.kill().await.context("SIGKILL")?;
    Ok(())
}

/// What a namespace must look like once things have settled after a crash.
/// A release listed in neither `live` nor `deleted` must be gone (say, one
/// deleted under another manager's suspension, whose uninstall that manager
/// meant to skip).
#[derive(Debug, Default)]
pub struct Settled {
    /// Releases that must still exist, with no suspension and no fence of
    /// flux-plunger's.
    pub live: Vec<String>,
    /// Releases deleted without a foreign suspension: they must be gone (not
    /// left Terminating) and helm-controller must have uninstalled them.
    pub deleted: Vec<String>,
    /// Storage Secrets that must still exist.
    pub kept_secrets: Vec<String>,
    /// Storage Secrets (the stuck, reclaimable revisions) that must be gone.
    pub reclaimed_secrets: Vec<String>,
}

impl Settled {
    /// Every invariant that does not hold yet, one line each.
    pub async fn violations(
        &self,
        ns: &TestNamespace,
        hc: &SimulatedHelmController,
    ) -> Result<Vec<String>> {
        let mut found = Vec::new();
        for object in ns.releases().list(&Default::default()).await?.items {
            let release = ReleaseView::from_object(&object);
            let name = &release.name;
            if release.terminating {
                found.push(format!(
                    "{name} is left Terminating (finalizers {:?}, suspend {})",
                    release.finalizers, release.suspend
                ));
            }
            if !self.live.contains(name) && !release.terminating {
                found.push(format!("{name} exists but was not expected to"));
            }
            if release.suspend_owned_by_us() {
                found.push(format!("{name} is left with flux-plunger's suspension"));
            }
            if release.has_fence() {
                found.push(format!("{name} is left with flux-plunger's fence"));
            }
        }
        for name in &self.live {
            if ns.releases().get_opt(name).await?.is_none() {
                found.push(format!("{name} is gone but should be live"));
            }
        }
        for name in &self.deleted {
            if hc.resources_exist(name).await? {
                found.push(format!(
                    "{name} was deleted but its resources are left: orphaned (helm-controller's decisions: {:?})",
                    hc.decisions_for(name)
                ));
            } else if !hc.decisions_for(name).contains(&Handled::Uninstalled) {
                found.push(format!(
                    "{name}: helm-controller never uninstalled it ({:?})",
                    hc.decisions_for(name)
                ));
            }
        }
        for secret in &self.kept_secrets {
            if ns.secrets().get_opt(secret).await?.is_none() {
                found.push(format!(
                    "storage Secret {secret} was deleted but must be kept"
                ));
            }
        }
        for secret in &self.reclaimed_secrets {
            if ns.secrets().get_opt(secret).await?.is_some() {
                found.push(format!("storage Secret {secret} is not reclaimed yet"));
            }
        }
        Ok(found)
    }

    /// Waits until every invariant holds; fails naming those that do not,
    /// or as soon as `settler` (the restarted binary, if it is to run on)
    /// has exited.
    pub async fn wait(
        &self,
        ns: &TestNamespace,
        hc: &SimulatedHelmController,
        mut settler: Option<&mut tokio::process::Child>,
    ) -> Result<()> {
        let deadline = Instant::now() + SETTLE_WITHIN;
        loop {
            let violations = self.violations(ns, hc).await?;
            if violations.is_empty() {
                return Ok(());
            }
            if let Some(child) = settler.as_mut()
                && let Some(status) = child.try_wait()?
            {
                bail!(
                    "the restarted process exited ({status}) before things settled:\n  {}",
                    violations.join("\n  ")
                );
            }
            if Instant::now() > deadline {
                bail!(
                    "not settled after {SETTLE_WITHIN:?}:\n  {}",
                    violations.join("\n  ")
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

pub use crate::control_plane::free_ports;
