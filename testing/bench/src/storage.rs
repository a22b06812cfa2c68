//! One recovery of a release whose Helm storage is large: `REVISIONS`
//! revisions of about `PAYLOAD_BYTES` each, as Helm keeps for a chart with big
//! manifests. The controller goes through a fault proxy that injects nothing
//! and counts its requests and the bytes of the answers, from its start to
//! the recovery (its start-up list, watch and Lease included: the same few
//! KiB whatever the storage holds).

use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use kube::Client;
use testkit::{FaultPlan, FaultProxy, TestNamespace};

use crate::controller::Controller;
use crate::objects::{create_releases, mark_stuck, release_name};

/// Revisions the release keeps (the Helm CLI's default `--history-max`).
pub const REVISIONS: u64 = 10;
/// About the size of each revision's payload, as stored in its Secret.
pub const PAYLOAD_BYTES: usize = 200_000;

pub struct StorageFigures {
    pub requests: u64,
    pub bytes: u64,
    /// The mean size of a revision's stored payload, as created.
    pub payload_bytes: usize,
}

/// Creates the stuck release, runs the release controller through a
/// counting proxy until it has recovered it, and returns what it counted.
pub async fn bench_storage(admin: &Client) -> Result<StorageFigures> {
    let ns = TestNamespace::create(admin, "bench-storage").await?;
    let name = release_name(0);
    create_releases(&ns, 0..1).await?;
    let mut stored = 0;
    for revision in 1..=REVISIONS {
        let status = if revision == REVISIONS {
            "uninstalling"
        } else {
            "superseded"
        };
        stored += ns
            .create_large_storage_secret(&name, revision, status, PAYLOAD_BYTES)
            .await?;
    }

    let proxy = FaultProxy::in_front_of_control_plane(FaultPlan::none(0)).await?;
    let dir = tempfile::tempdir()?;
    let kubeconfig = dir.path().join("through-proxy.kubeconfig");
    std::fs::write(&kubeconfig, proxy.kubeconfig_yaml(&ns.name))?;
    let mut controller = Controller::spawn_with(dir, &kubeconfig, &ns.name, 1, "bench-storage")?;
    controller.wait_ready(Duration::from_secs(120)).await?;
    mark_stuck(&ns, &name).await?;
    let deadline = Instant::now() + Duration::from_secs(120);
    while !ns.is_recovered(&name, REVISIONS).await? {
        if Instant::now() > deadline {
            bail!("{name} was not recovered within 120 s");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    controller.stop().await?;
    let counted = proxy.report();
    Ok(StorageFigures {
        requests: counted.total_requests(),
        bytes: counted.response_bytes,
        payload_bytes: stored / REVISIONS as usize,
    })
}
