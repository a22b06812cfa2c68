//! A leader that stops answering without stopping, as a dead node leaves its
//! pods: every process of its pod frozen (the cgroup freezer), so it neither
//! renews the Lease nor releases anything. The standby leads once the Lease
//! has expired, recovers a release made stuck meanwhile, and the old leader,
//! thawed, writes nothing after the standby began: one writer at a time, read
//! from the apiserver's audit log.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::core::v1::Pod;
use kube::api::ListParams;
use real_node::{OnNode, name_of, requests_by_pod};
use testkit::{TestNamespace, eventually};

/// Where the kubelet (cgroupfs driver) puts a pod's cgroup in the freezer
/// hierarchy: a directory `pod<uid>` somewhere under the sandbox's cgroup
/// root.
fn freezer_cgroup_of(pod: &Pod) -> Result<PathBuf> {
    let uid = pod.metadata.uid.as_deref().context("the pod has no uid")?;
    let wanted = format!("pod{uid}");
    fn find(dir: &Path, wanted: &str, depth: usize) -> Option<PathBuf> {
        for entry in std::fs::read_dir(dir).ok()?.flatten() {
            let path = entry.path();
            if !path.is_dir() {
                continue;
            }
            if entry.file_name() == wanted {
                return Some(path);
            }
            if depth > 0
                && let Some(found) = find(&path, wanted, depth - 1)
            {
                return Some(found);
            }
        }
        None
    }
    find(Path::new("/sys/fs/cgroup/freezer"), &wanted, 6)
        .with_context(|| format!("no freezer cgroup {wanted} under /sys/fs/cgroup/freezer"))
}

/// Writes `state` (`FROZEN`, `THAWED`) to the cgroup's freezer and waits
/// until the kernel reports it.
async fn set_freezer(cgroup: &Path, state: &str) -> Result<()> {
    let file = cgroup.join("freezer.state");
    std::fs::write(&file, state).with_context(|| format!("writing {}", file.display()))?;
    eventually(
        Duration::from_secs(30),
        &format!("{} {state}", cgroup.display()),
        || {
            let now = std::fs::read_to_string(&file).unwrap_or_default();
            async move { Ok(now.trim() == state) }
        },
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_leader_is_followed_by_the_standby_and_never_writes_again() -> Result<()> {
    let _turn = testkit::cluster_wide_turn().await;
    let on = OnNode::new("node-frozen").await?;
    on.install(&["replicas=2"])?;
    // helm's wait ends at the Deployment's minimum availability, one pod.
    let listed = ListParams::default().labels(&on.selector());
    eventually(real_node::POD_TIMEOUT, "two ready pods", || async {
        let pods = on.pods().list(&listed).await?.items;
        Ok(pods.len() == 2 && pods.iter().all(real_node::is_ready))
    })
    .await
    .with_context(|| on.node.logs_for_failure())?;
    let pods = on.pods().list(&listed).await?.items;
    let leader = {
        let deadline = Instant::now() + real_node::POD_TIMEOUT;
        loop {
            if let Some(holder) = on.lease_holder().await? {
                break holder;
            }
            ensure!(Instant::now() < deadline, "nobody leads");
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    };
    let (frozen, standby): (Vec<Pod>, Vec<Pod>) =
        pods.into_iter().partition(|p| name_of(p) == leader);
    let frozen = frozen
        .first()
        .context("the leader is not one of the pods")?;
    let standby = name_of(standby.first().context("no standby")?);
    let cgroup = freezer_cgroup_of(frozen)?;

    let offset = testkit::audit::mark();
    set_freezer(&cgroup, "FROZEN").await?;
    let frozen_at = Instant::now();
    let outcome = async {
        // A release gets stuck while nobody leads.
        let apps = TestNamespace::create(&on.ns().client, "node-frozen-apps").await?;
        crate::lifecycle::stuck_release(&apps, "web").await?;
        on.wait_lease_held_by(&standby).await?;
        let took = frozen_at.elapsed();
        let timings = plunger::timings::Timings::from_grace_period(
            plunger::timings::DEFAULT_GRACE_PERIOD_SECONDS,
        )?;
        // The Lease expires, then the standby's next try takes it.
        ensure!(
            took <= timings.lease_duration + timings.lease_retry_period * 2,
            "the standby led {took:?} after the freeze (the Lease lasts {:?})",
            timings.lease_duration
        );
        eventually(
            Duration::from_secs(60),
            "the standby recovers the stuck release",
            || apps.is_recovered("web", 2),
        )
        .await?;
        Ok::<(), anyhow::Error>(())
    }
    .await;
    // Thawed, whatever happened: the old leader wakes to a Lease that names
    // the standby.
    set_freezer(&cgroup, "THAWED").await?;
    outcome.with_context(|| on.node.logs_for_failure())?;

    // Give the thawed process the time it needs to notice, then read the
    // audit log: the old pod's successful writes all came before the
    // standby's first.
    eventually(
        Duration::from_secs(60),
        "the thawed leader's controller to restart as a candidate",
        || async {
            let pod = on.pods().get(&leader).await?;
            Ok(real_node::container_status(&pod, real_node::CONTROLLER)
                .is_some_and(|s| s.restart_count > 0))
        },
    )
    .await?;
    let by_pod = requests_by_pod(offset, &on.controller_user())?;
    let first_new_write = by_pod
        .get(&standby)
        .into_iter()
        .flatten()
        .filter(|r| r.is_write())
        .map(|r| r.received_at)
        .min()
        .context("the standby wrote nothing")?;
    let after: Vec<(String, u16)> = by_pod
        .get(&leader)
        .into_iter()
        .flatten()
        .filter(|r| r.received_at >= first_new_write)
        .map(|r| (r.label(), r.code))
        .collect();
    eprintln!("the thawed leader's requests after the standby's first write: {after:?}");
    let late: Vec<String> = by_pod
        .get(&leader)
        .into_iter()
        .flatten()
        .filter(|r| r.is_write() && r.succeeded() && r.received_at >= first_new_write)
        .map(|r| r.label())
        .collect();
    ensure!(
        late.is_empty(),
        "the thawed leader wrote after the standby took over: {late:?}"
    );
    on.remove()?;
    Ok(())
}
