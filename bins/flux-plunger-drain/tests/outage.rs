//! The drain sidecar when its apiserver is paused (SIGSTOP: connections stay
//! open, nothing answers) or down (killed: connections refused) at chosen
//! moments (SPEC §6, §9). Each test pauses or kills the apiserver of a
//! control plane of its own, so the tests run side by side and no other test
//! meets the outage.

use std::path::Path;
use std::process::ExitStatus;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use k8s_openapi::api::coordination::v1::Lease;
use kube::Client;
use kube::api::{Api, DeleteParams};
use plunger::lease::{Attempt, LeaseLock};
use serde_json::json;
use testkit::Handled;
use testkit::audit::{self, AuditedRequest};
use testkit::control_plane::{AuthInfo, ControlPlane, workspace_binary};
use testkit::process::LoggedProcess;
use tokio::process::Command;

const POD: &str = "pod-a";
/// `flux-plunger-drain`'s exit code when something is, or may be, left.
const EXIT_LEFT: i32 = 3;

/// A control plane of the test's own, with testkit's world on it.
struct World {
    plane: ControlPlane,
    base: testkit::World,
    dir: tempfile::TempDir,
}

impl std::ops::Deref for World {
    type Target = testkit::World;

    fn deref(&self) -> &testkit::World {
        &self.base
    }
}

impl World {
    async fn start(prefix: &str) -> Result<Self> {
        let plane = ControlPlane::start_another()?;
        let base = testkit::World::on(&plane, prefix).await?;
        Ok(Self {
            plane,
            base,
            dir: tempfile::tempdir()?,
        })
    }

    fn client(&self) -> &Client {
        &self.ns.client
    }

    /// A live release, installed, carrying our fence (and our suspension).
    async fn live(&self, name: &str, suspended: bool) -> Result<()> {
        self.installed(name).await?;
        self.ns.apply_as_flux_plunger(name, suspended).await?;
        Ok(())
    }

    /// A release being deleted, held by our fence (and our suspension):
    /// helm-controller has not uninstalled it.
    async fn deleted(&self, name: &str, suspended: bool) -> Result<()> {
        self.live(name, suspended).await?;
        self.ns
            .releases()
            .delete(name, &DeleteParams::default())
            .await?;
        Ok(())
    }

    /// Makes `identity` the holder of the namespace's Lease.
    async fn lead(&self, identity: &str) -> Result<()> {
        let mut lock = LeaseLock::new(
            self.client().clone(),
            &self.ns.name,
            "flux-plunger",
            identity,
            Duration::from_secs(27),
        );
        anyhow::ensure!(lock.try_acquire_or_renew().await? == Attempt::Held);
        Ok(())
    }

    async fn holder(&self) -> Result<Option<String>> {
        let leases: Api<Lease> = Api::namespaced(self.client().clone(), &self.ns.name);
        Ok(leases
            .get("flux-plunger")
            .await?
            .spec
            .and_then(|s| s.holder_identity))
    }

    /// The drain sidecar of pod `POD` with grace period `grace`, idling.
    async fn drain(&self, grace: u64, kubeconfig: &Path) -> Result<LoggedProcess> {
        let mut command = Command::new(env!("CARGO_BIN_EXE_flux-plunger-drain"));
        command
            .arg(format!("--kubeconfig={}", kubeconfig.display()))
            .arg(format!("--shutdown-grace-period-seconds={grace}"))
            .arg("--log-encoding=console")
            .env("POD_NAME", POD)
            .env("POD_NAMESPACE", &self.ns.name)
            .env_remove("RUST_LOG");
        let drain = LoggedProcess::spawn(command, "drain")?;
        drain
            .wait_logged("idle until SIGTERM", Duration::from_secs(20))
            .await?;
        Ok(drain)
    }

    fn admin_kubeconfig(&self) -> Result<std::path::PathBuf> {
        let path = self.dir.path().join("admin.kubeconfig");
        self.plane
            .write_kubeconfig(&path, &AuthInfo::AdminCertificate)?;
        Ok(path)
    }
}

/// Waits until the drain's first pass shows on the releases: each of `gone`
/// has lost our fence and suspension, each of `kept` only our suspension.
async fn first_pass_done(world: &World, gone: &[&str], kept: &[&str]) -> Result<()> {
    testkit::eventually(
        Duration::from_secs(15),
        "the drain's first pass",
        || async {
            for name in gone {
                let release = world.find(name).await?.context("a live release stays")?;
                if release.has_fence() || release.suspend {
                    return Ok(false);
                }
            }
            for name in kept {
                let release = world.find(name).await?.context("held by the fence")?;
                if release.suspend {
                    return Ok(false);
                }
            }
            Ok(true)
        },
    )
    .await
}

/// Waits for the exit; returns the status and how long after `since` it came.
async fn exited(drain: &mut LoggedProcess, since: Instant) -> Result<(ExitStatus, Duration)> {
    let status = drain.wait(Duration::from_secs(120)).await?;
    Ok((status, since.elapsed()))
}

#[tokio::test]
async fn a_drain_whose_apiserver_pauses_from_its_second_pass_ends_at_its_deadline_names_what_it_left_and_the_next_pod_leads_only_after_its_last_write()
-> Result<()> {
    let world = World::start("outage-paused").await?;
    let ns = &world.ns.name;
    world.live("live-suspended", true).await?;
    world.live("live-fence", false).await?;
    world.deleted("deleting-suspended", true).await?;
    world.deleted("deleting", false).await?;
    // Each pod as a ServiceAccount of its own: the audit log tells their
    // requests apart.
    let binding = world
        .plane
        .grant_cluster_admin(world.client(), ns, &[POD, "pod-b"])
        .await?;
    let kubeconfig = |pod: &str| world.dir.path().join(format!("{pod}.kubeconfig"));
    for pod in [POD, "pod-b"] {
        world
            .plane
            .write_service_account_kubeconfig(world.client(), ns, pod, &kubeconfig(pod))
            .await?;
    }
    world.lead(POD).await?;
    let mut next = {
        let mut command = Command::new(workspace_binary("flux-plunger")?);
        command
            .arg(format!("--kubeconfig={}", kubeconfig("pod-b").display()))
            .args([
                "--log-encoding=console",
                "--metrics-addr=127.0.0.1:0",
                "--health-addr=127.0.0.1:0",
            ])
            .env("POD_NAME", "pod-b")
            .env("POD_NAMESPACE", ns)
            .env_remove("RUST_LOG");
        LoggedProcess::spawn(command, "pod-b/controller")?
    };
    next.wait_logged("waiting for the leader Lease", Duration::from_secs(30))
        .await?;

    // G = 40 s: the drain deadline is 15 s.
    let mut drain = world.drain(40, &kubeconfig(POD)).await?;
    let sigterm = Instant::now();
    drain.sigterm()?;
    // The first pass: both live releases let go, the deleted one's
    // suspension lifted (its fence waits for helm-controller).
    first_pass_done(
        &world,
        &["live-suspended", "live-fence"],
        &["deleting-suspended"],
    )
    .await?;
    world.plane.pause_apiserver()?;
    let paused = Instant::now();
    let waited = exited(&mut drain, sigterm).await;
    world.plane.resume_apiserver()?;
    let (status, took) = waited?;
    let log = drain.log();

    assert!(
        took <= Duration::from_secs(16),
        "the drain ended {took:?} after SIGTERM, past its 15 s deadline (+1 s); paused {:?} after SIGTERM:\n{log}",
        paused - sigterm
    );
    assert_eq!(status.code(), Some(EXIT_LEFT), "{log}");
    let last = log.lines().last().unwrap_or_default();
    assert!(
        last.contains("drain deadline reached with fences left")
            && last.contains("2 fences and 0 suspensions")
            && last.contains(&format!("{ns}/deleting (fence, being deleted)"))
            && last.contains(&format!("{ns}/deleting-suspended (fence, being deleted)")),
        "the last line names what is left: {last}"
    );

    next.wait_logged("became the leader", Duration::from_secs(90))
        .await?;
    let requests = audit::read_log_since(&world.plane.audit_log(), 0)?;
    let by = |pod: &str| audit::service_account_user(ns, pod);
    let last_write_of_a = requests
        .iter()
        .filter(|r| r.user == by(POD) && r.is_write())
        .map(|r| r.received_at)
        .max()
        .context("pod-a never wrote")?;
    let takeover = requests
        .iter()
        .filter(|r: &&AuditedRequest| {
            r.user == by("pod-b") && r.is_write() && r.succeeded() && r.resource() == "leases"
        })
        .map(|r| r.received_at)
        .min()
        .context("pod-b never took the Lease")?;
    assert!(
        last_write_of_a < takeover,
        "pod-b led at {takeover}, before pod-a's last write at {last_write_of_a}"
    );

    next.terminate(Duration::from_secs(30)).await?;
    Api::<k8s_openapi::api::rbac::v1::ClusterRoleBinding>::all(world.client().clone())
        .delete(&binding, &DeleteParams::default())
        .await?;
    Ok(())
}

#[tokio::test]
async fn a_drain_that_starts_while_the_apiserver_is_down_releases_every_live_fence_once_it_is_back_and_names_the_rest()
-> Result<()> {
    let world = World::start("outage-down-at-start").await?;
    let ns = &world.ns.name;
    for name in ["live-a", "live-b"] {
        world.live(name, true).await?;
    }
    world.live("live-c", false).await?;
    world.deleted("deleting-a", true).await?;
    for name in ["deleting-b", "deleting-c"] {
        world.deleted(name, false).await?;
    }
    world.lead(POD).await?;
    // G = 50 s: the drain deadline is 25 s.
    let mut drain = world.drain(50, &world.admin_kubeconfig()?).await?;

    world.plane.stop_apiserver()?;
    let sigterm = Instant::now();
    drain.sigterm()?;
    // The outage itself, not a wait for something to happen.
    tokio::time::sleep(Duration::from_secs(10)).await;
    world.plane.start_apiserver_again().await?;
    let back = sigterm.elapsed();
    let (status, took) = exited(&mut drain, sigterm).await?;
    let log = drain.log();

    assert!(
        took <= Duration::from_secs(26),
        "ended {took:?} after SIGTERM (apiserver back after {back:?}):\n{log}"
    );
    assert_eq!(status.code(), Some(EXIT_LEFT), "{log}");
    for name in ["live-a", "live-b", "live-c"] {
        let release = world.find(name).await?.context("a live release stays")?;
        assert!(
            !release.has_fence() && !release.suspend,
            "{name} released: {release:?}"
        );
    }
    for name in ["deleting-a", "deleting-b", "deleting-c"] {
        let release = world.find(name).await?.context("held by the fence")?;
        assert!(
            release.has_fence() && !release.suspend,
            "{name}: {release:?}"
        );
    }
    let last = log.lines().last().unwrap_or_default();
    assert!(
        last.contains("3 fences and 0 suspensions")
            && ["deleting-a", "deleting-b", "deleting-c"]
                .iter()
                .all(|name| last.contains(&format!("{ns}/{name} (fence, being deleted)"))),
        "the last line names every fence left: {last}"
    );
    assert!(log.contains("handed the Lease over"), "{log}");
    assert_eq!(world.holder().await?, None);
    Ok(())
}

#[tokio::test]
async fn a_drain_whose_apiserver_is_gone_17_seconds_resumes_when_it_is_back_and_hands_the_lease_over()
-> Result<()> {
    let world = World::start("outage-mid-drain").await?;
    world.live("live", true).await?;
    world.deleted("deleting", true).await?;
    world.lead(POD).await?;
    // G = 60 s: the drain deadline is 35 s.
    let mut drain = world.drain(60, &world.admin_kubeconfig()?).await?;
    let sigterm = Instant::now();
    drain.sigterm()?;
    first_pass_done(&world, &["live"], &["deleting"]).await?;

    // Down, not paused: every request and renewal is refused at once, as
    // when the drain met it in a pod. Gone about 17 s with its restart.
    world.plane.stop_apiserver()?;
    let down = Instant::now();
    // The outage itself, not a wait for something to happen.
    tokio::time::sleep(Duration::from_secs(13)).await;
    world.plane.start_apiserver_again().await?;
    let outage = down.elapsed();
    // helm-controller, back too, uninstalls the deleted release: the drain,
    // still holding the Lease, can drop the fence.
    let (helm_controller, stop) = world.hc.clone().spawn(Duration::from_millis(300));
    let (status, took) = exited(&mut drain, sigterm).await?;
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    helm_controller.await?;
    let log = drain.log();

    assert!(
        world.find("deleting").await?.is_none(),
        "the drain went on after the outage of {outage:?}: the release is gone\n{log}"
    );
    assert!(!world.hc.resources_exist("deleting").await?, "uninstalled");
    assert_eq!(world.holder().await?, None, "handed over\n{log}");
    assert!(status.success(), "{status:?}\n{log}");
    assert!(took <= Duration::from_secs(36), "{took:?}\n{log}");
    assert!(
        log.contains("writing paused until a renewal succeeds"),
        "{log}"
    );
    assert!(!log.contains("stopped writing"), "{log}");
    assert!(log.contains("handed the Lease over"), "{log}");
    assert!(
        log.lines()
            .last()
            .unwrap_or_default()
            .contains("drain complete: no fence left"),
        "{log}"
    );
    Ok(())
}

#[tokio::test]
async fn a_drain_whose_lease_another_pod_takes_stops_writing_for_good_names_what_it_left_and_keeps_off_the_lease()
-> Result<()> {
    let world = World::start("outage-lease-taken").await?;
    let ns = &world.ns.name;
    world.live("live", true).await?;
    world.deleted("deleting", true).await?;
    // The drain as a ServiceAccount of its own: the audit log tells its
    // requests apart.
    let binding = world
        .plane
        .grant_cluster_admin(world.client(), ns, &[POD])
        .await?;
    let kubeconfig = world.dir.path().join("pod-a.kubeconfig");
    world
        .plane
        .write_service_account_kubeconfig(world.client(), ns, POD, &kubeconfig)
        .await?;
    world.lead(POD).await?;
    // G = 60 s: the drain deadline is 35 s, and "deleting" keeps it busy
    // (helm-controller is not running to uninstall it).
    let mut drain = world.drain(60, &kubeconfig).await?;
    let sigterm = Instant::now();
    drain.sigterm()?;
    first_pass_done(&world, &["live"], &["deleting"]).await?;

    // Another pod takes the Lease (as one that judged it expired would).
    let leases: Api<Lease> = Api::namespaced(world.client().clone(), ns);
    let taken = leases
        .patch(
            "flux-plunger",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(json!({"spec": {
                "holderIdentity": "pod-b",
                "renewTime": k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime(k8s_openapi::jiff::Timestamp::now()),
            }})),
        )
        .await?;
    let taken_rv = taken.metadata.resource_version;
    drain
        .wait_logged(
            "the Lease is no longer ours: stopped writing",
            Duration::from_secs(20),
        )
        .await?;
    // helm-controller uninstalls the deleted release now: a drain still
    // writing would drop its fence.
    assert_eq!(world.hc.handle("deleting").await?, Handled::Uninstalled);
    let (status, took) = exited(&mut drain, sigterm).await?;
    let log = drain.log();

    assert_eq!(status.code(), Some(EXIT_LEFT), "{log}");
    assert!(took <= Duration::from_secs(36), "{took:?}\n{log}");
    let last = log.lines().last().unwrap_or_default();
    assert!(
        last.contains("lost the Lease during the drain: stopped writing")
            && last.contains("1 fences and 0 suspensions")
            && last.contains(&format!("{ns}/deleting (fence, being deleted)")),
        "the last line names what is left: {last}"
    );
    assert!(
        log.contains("the Lease was no longer ours to hand over"),
        "{log}"
    );
    let held = world
        .find("deleting")
        .await?
        .context("the fence holds it")?;
    assert!(held.has_fence(), "{held:?}");
    let lease = leases.get("flux-plunger").await?;
    assert_eq!(
        (
            lease.metadata.resource_version,
            lease.spec.and_then(|s| s.holder_identity)
        ),
        (taken_rv, Some("pod-b".to_owned())),
        "the drain never wrote the Lease again"
    );
    // One writer: nothing the drain sent after the takeover was accepted.
    let requests = audit::read_log_since(&world.plane.audit_log(), 0)?;
    let drain_user = audit::service_account_user(ns, POD);
    let takeover = requests
        .iter()
        .filter(|r| {
            r.user != drain_user && r.resource() == "leases" && r.verb == "patch" && r.succeeded()
        })
        .map(|r| r.received_at)
        .max()
        .context("the takeover is in the audit log")?;
    let accepted_after: Vec<String> = requests
        .iter()
        .filter(|r| {
            r.user == drain_user && r.is_write() && r.succeeded() && r.received_at > takeover
        })
        .map(|r| format!("{} {}", r.label(), r.name))
        .collect();
    assert!(accepted_after.is_empty(), "{accepted_after:?}");

    Api::<k8s_openapi::api::rbac::v1::ClusterRoleBinding>::all(world.client().clone())
        .delete(&binding, &DeleteParams::default())
        .await?;
    Ok(())
}
