//! The node tier's helpers: the chart installed on the real node of
//! `testkit::node`, its pods watched to the end, the apiserver's audit log read
//! per pod. The tests are in `tests/on_node/`.
#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use chart_contract::install::{Setup, succeeded};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ContainerStatus, Pod};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::Api;
use kube::api::{ListParams, Patch, PatchParams, WatchEvent, WatchParams};
use testkit::TestNamespace;
use testkit::audit::AuditedRequest;
use testkit::node::{Node, node};

pub mod as_flux;

/// How long a pod may take to start, or to go, on the node: an image is
/// already there, but two busy cores run the whole cluster and the tests.
pub const POD_TIMEOUT: Duration = Duration::from_secs(180);

/// The chart's controller container and its drain sidecar.
pub const CONTROLLER: &str = "flux-plunger";
pub const DRAIN: &str = "flux-plunger-drain";

/// A namespace with the chart installed (or about to be) on the node.
pub struct OnNode {
    pub setup: Setup,
    pub node: &'static Node,
    /// The Helm release: by default named after the namespace.
    pub release: String,
    /// The chart's full name (its objects', its Lease's and its
    /// ServiceAccount's name) for that release.
    pub fullname: String,
}

impl OnNode {
    /// A namespace of its own; the node is started on first use.
    pub async fn new(prefix: &str) -> Result<Self> {
        let node = node();
        let setup = Setup::new(prefix).await?;
        Ok(Self {
            release: setup.release().to_owned(),
            fullname: setup.fullname(),
            setup,
            node,
        })
    }

    pub fn ns(&self) -> &TestNamespace {
        &self.setup.ns
    }

    /// The chart's values that name the image `make image` built, as the
    /// registry holds it (the node pulls it by digest), as `--set` arguments.
    pub fn image_args(&self) -> Result<Vec<String>> {
        Ok(vec![
            "--set".to_owned(),
            format!("image.repository={}", self.node.image.repository),
            "--set".to_owned(),
            format!("image.digest={}", self.node.image.digest),
        ])
    }

    /// `helm install --wait` with the node's image and `sets` (`key=value`).
    pub fn install(&self, sets: &[&str]) -> Result<()> {
        self.helm_with_values("install", sets)
    }

    /// `helm upgrade --reuse-values --wait` with `sets`.
    pub fn upgrade(&self, sets: &[&str]) -> Result<()> {
        self.helm_with_values("upgrade", sets)
    }

    fn helm_with_values(&self, verb: &str, sets: &[&str]) -> Result<()> {
        let chart = chart_contract::chart_dir().display().to_string();
        let mut args: Vec<String> = vec![
            verb.to_owned(),
            self.release.clone(),
            chart,
            "--wait".to_owned(),
            "--timeout=4m".to_owned(),
        ];
        if verb == "upgrade" {
            args.push("--reuse-values".to_owned());
        }
        args.extend(self.image_args()?);
        for set in sets {
            args.push("--set".to_owned());
            args.push((*set).to_owned());
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        succeeded(self.setup.helm(&args)?, &format!("helm {verb}"))
            .with_context(|| self.node.logs_for_failure())
    }

    pub fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.ns().client.clone(), &self.ns().name)
    }

    /// The controller pods' label selector.
    pub fn selector(&self) -> String {
        format!(
            "app.kubernetes.io/instance={},app.kubernetes.io/component=controller",
            self.release
        )
    }

    /// Waits for a controller pod that is Ready and not being deleted, other
    /// than `not`; returns it.
    pub async fn ready_pod(&self, not: Option<&str>) -> Result<Pod> {
        let deadline = Instant::now() + POD_TIMEOUT;
        loop {
            let pods = self
                .pods()
                .list(&ListParams::default().labels(&self.selector()))
                .await?;
            if let Some(pod) = pods.items.into_iter().find(|pod| {
                pod.metadata.deletion_timestamp.is_none()
                    && pod.metadata.name.as_deref() != not
                    && is_ready(pod)
            }) {
                return Ok(pod);
            }
            if Instant::now() > deadline {
                bail!(
                    "no Ready controller pod after {}s\n{}\n{}",
                    POD_TIMEOUT.as_secs(),
                    self.pods_summary().await,
                    self.node.logs_for_failure()
                );
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// Every pod of the namespace, a line each: phase, deletion, and each
    /// container's state (for a failure message).
    pub async fn pods_summary(&self) -> String {
        let Ok(pods) = self.pods().list(&ListParams::default()).await else {
            return "(the pods could not be listed)".to_owned();
        };
        pods.items
            .iter()
            .map(|pod| {
                let status = pod.status.as_ref();
                let containers = status
                    .into_iter()
                    .flat_map(|s| {
                        s.init_container_statuses
                            .iter()
                            .flatten()
                            .chain(s.container_statuses.iter().flatten())
                    })
                    .map(|c| {
                        format!(
                            "{} ready={} restarts={} {:?}",
                            c.name, c.ready, c.restart_count, c.state
                        )
                    })
                    .collect::<Vec<_>>()
                    .join("; ");
                format!(
                    "{} phase={:?} deleting={} [{containers}]",
                    name_of(pod),
                    status.and_then(|s| s.phase.clone()),
                    pod.metadata.deletion_timestamp.is_some()
                )
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// The chart's pre-delete hook Job, which must have completed (it is kept
    /// for a while after success: `ttlSecondsAfterFinished`).
    pub async fn completed_hook_job(&self) -> Result<k8s_openapi::api::batch::v1::Job> {
        let jobs: Api<k8s_openapi::api::batch::v1::Job> =
            Api::namespaced(self.ns().client.clone(), &self.ns().name);
        let hook = jobs
            .get(&format!("{}-pre-delete", self.fullname))
            .await
            .context("the hook Job")?;
        let complete = hook
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|c| {
                c.iter()
                    .any(|c| c.type_ == "Complete" && c.status == "True")
            });
        ensure!(complete, "the hook Job did not complete: {:?}", hook.status);
        Ok(hook)
    }

    /// The leader Lease, if it exists.
    pub async fn lease(&self) -> Result<Option<Lease>> {
        let leases: Api<Lease> = Api::namespaced(self.ns().client.clone(), &self.ns().name);
        Ok(leases.get_opt(&self.fullname).await?)
    }

    /// The leader Lease's holder, if any.
    pub async fn lease_holder(&self) -> Result<Option<String>> {
        Ok(self
            .lease()
            .await?
            .and_then(|lease| lease.spec)
            .and_then(|spec| spec.holder_identity)
            .filter(|holder| !holder.is_empty()))
    }

    /// The ServiceAccount user the chart's controller and drain run as.
    pub fn controller_user(&self) -> String {
        testkit::audit::service_account_user(&self.ns().name, &self.fullname)
    }

    /// `helm uninstall` without the hook, to leave the node to the next test.
    pub fn remove(&self) -> Result<()> {
        let args = [
            "uninstall",
            &self.release,
            "--no-hooks",
            "--wait",
            "--timeout=4m",
        ];
        succeeded(self.setup.helm(&args)?, "helm uninstall --no-hooks")
    }

    /// Waits until the Lease names `pod`.
    pub async fn wait_lease_held_by(&self, pod: &str) -> Result<()> {
        let deadline = Instant::now() + POD_TIMEOUT;
        while self.lease_holder().await?.as_deref() != Some(pod) {
            ensure!(
                Instant::now() < deadline,
                "the Lease does not name {pod} (it names {:?})",
                self.lease_holder().await?
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        Ok(())
    }
}

/// True if the pod's `Ready` condition is `True`.
pub fn is_ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|conditions| {
            conditions
                .iter()
                .any(|c| c.type_ == "Ready" && c.status == "True")
        })
}

/// The pod's name.
pub fn name_of(pod: &Pod) -> String {
    pod.metadata.name.clone().unwrap_or_default()
}

/// The status of container `name` of `pod`, among its containers and its
/// init containers (the native sidecar is one).
pub fn container_status<'a>(pod: &'a Pod, name: &str) -> Option<&'a ContainerStatus> {
    let status = pod.status.as_ref()?;
    status
        .container_statuses
        .iter()
        .flatten()
        .chain(status.init_container_statuses.iter().flatten())
        .find(|c| c.name == name)
}

/// How a container ended: exit code and finish time.
#[derive(Debug, Clone, Copy)]
pub struct Ended {
    pub exit_code: i32,
    pub finished_at: k8s_openapi::jiff::Timestamp,
}

/// How container `name` of `pod` ended, if it has.
pub fn ended(pod: &Pod, name: &str) -> Option<Ended> {
    let terminated = container_status(pod, name)?
        .state
        .as_ref()?
        .terminated
        .as_ref()?;
    Some(Ended {
        exit_code: terminated.exit_code,
        finished_at: terminated.finished_at.as_ref()?.0,
    })
}

/// What the apiserver showed of a pod that went: when its delete was asked
/// for, and its last state.
pub struct Gone {
    /// The pod as the delete left it: its `deletionTimestamp` and
    /// `deletionGracePeriodSeconds` say when and with what grace period (the
    /// kubelet's own final delete, with grace 0, rewrites both).
    pub deleting: Pod,
    /// Its last state: the kubelet writes its containers' ends before the pod goes.
    pub last: Pod,
}

/// Watches pod `name` until it is gone.
pub async fn watch_until_gone(pods: &Api<Pod>, name: &str, timeout: Duration) -> Result<Gone> {
    let mut last = pods.get(name).await?;
    let mut deleting = last
        .metadata
        .deletion_timestamp
        .is_some()
        .then(|| last.clone());
    let version = last.metadata.resource_version.clone().unwrap_or_default();
    let params = WatchParams::default()
        .fields(&format!("metadata.name={name}"))
        .timeout(timeout.as_secs().min(290) as u32);
    let watch = async {
        let mut events = pods.watch(&params, &version).await?.boxed();
        while let Some(event) = events.try_next().await? {
            let (pod, gone) = match event {
                WatchEvent::Added(pod) | WatchEvent::Modified(pod) => (pod, false),
                WatchEvent::Deleted(pod) => (pod, true),
                WatchEvent::Bookmark(_) => continue,
                WatchEvent::Error(e) => bail!("watching pod {name}: {e}"),
            };
            if deleting.is_none() && pod.metadata.deletion_timestamp.is_some() {
                deleting = Some(pod.clone());
            }
            last = pod;
            if gone {
                return Ok::<bool, anyhow::Error>(true);
            }
        }
        Ok(false)
    };
    let gone = tokio::time::timeout(timeout, watch)
        .await
        .unwrap_or(Ok(false))?;
    ensure!(
        gone,
        "pod {name} was not gone within {}s",
        timeout.as_secs()
    );
    Ok(Gone {
        deleting: deleting.context("the pod went without a graceful delete")?,
        last,
    })
}

/// The audit log's requests since `offset` made by pods of `user` (a
/// ServiceAccount), grouped by pod name, each in the apiserver's order.
pub fn requests_by_pod(offset: u64, user: &str) -> Result<BTreeMap<String, Vec<AuditedRequest>>> {
    let mut by_pod: BTreeMap<String, Vec<AuditedRequest>> = BTreeMap::new();
    for request in testkit::audit::read_since(offset)? {
        if request.user != user {
            continue;
        }
        if let Some(pod) = request.pod.clone() {
            by_pod.entry(pod).or_default().push(request);
        }
    }
    Ok(by_pod)
}

/// The audit log's view of two pods of one ServiceAccount: the old one
/// stopping, the new one taking over.
pub struct Writers {
    pub old: Vec<AuditedRequest>,
    pub new: Vec<AuditedRequest>,
}

impl Writers {
    pub fn read(offset: u64, user: &str, old: &str, new: &str) -> Result<Self> {
        let mut by_pod: BTreeMap<String, Vec<AuditedRequest>> = requests_by_pod(offset, user)?;
        Ok(Self {
            old: by_pod.remove(old).unwrap_or_default(),
            new: by_pod.remove(new).unwrap_or_default(),
        })
    }

    /// One writer at a time: the new pod's first write (its Lease acquire)
    /// reached the apiserver after the old pod's last request was answered.
    pub fn check_single_writer(&self) -> Result<()> {
        let last_old = self
            .old
            .iter()
            .map(|r| r.at)
            .max()
            .context("no request by the old pod")?;
        let first_new_write = self
            .new
            .iter()
            .filter(|r| r.is_write())
            .map(|r| r.received_at)
            .min()
            .context("no write by the new pod")?;
        ensure!(
            first_new_write > last_old,
            "the new pod wrote at {first_new_write} while the old one still sent requests (last answered {last_old})"
        );
        Ok(())
    }

    /// From the old pod's last Lease write (its drain's handover, or its last
    /// renewal) to the new pod's first.
    pub fn handover(&self) -> Result<SignedDuration> {
        let lease_writes = |requests: &[AuditedRequest]| -> Vec<Timestamp> {
            requests
                .iter()
                .filter(|r| r.resource() == "leases" && r.is_write() && r.succeeded())
                .map(|r| r.at)
                .collect()
        };
        let old = *lease_writes(&self.old)
            .iter()
            .max()
            .context("the old pod never wrote its Lease")?;
        let new = *lease_writes(&self.new)
            .iter()
            .min()
            .context("the new pod never took the Lease")?;
        Ok(new.duration_since(old))
    }

    /// The old pod's HelmRelease writes: the drain's (the controller runs in
    /// dry-run).
    pub fn old_release_writes(&self) -> Vec<&AuditedRequest> {
        self.old
            .iter()
            .filter(|r| r.resource() == "helmreleases" && r.is_write())
            .collect()
    }
}

/// Creates `count` live releases in `ns`, each carrying flux-plunger's fence
/// and suspension as a recovery takes them: what a drain must release.
///
/// Each is born with helm-controller's finalizer, as every release
/// flux-plunger recovers carries it: a real helm-controller running in the
/// same process (the Flux test's) then never adds it. Its finalizer patch is
/// a merge patch of the whole list as it last read it, so adding it to a
/// release fenced meanwhile would drop the fence behind the drain's back.
pub async fn fenced_releases(ns: &TestNamespace, count: usize) -> Result<Vec<String>> {
    let names: Vec<String> = (0..count).map(|i| format!("fenced-{i}")).collect();
    futures::stream::iter(names.clone())
        .map(|name| async move {
            ns.create_release_with_helm_controller_finalizer(&name)
                .await?;
            ns.apply_as_flux_plunger(&name, true).await?;
            Ok::<(), anyhow::Error>(())
        })
        .buffer_unordered(16)
        .try_collect::<Vec<()>>()
        .await?;
    Ok(names)
}

/// The releases of `ns` that still carry flux-plunger's fence or suspension.
pub async fn still_held(ns: &TestNamespace) -> Result<Vec<String>> {
    let releases = ns.releases().list(&Default::default()).await?;
    Ok(releases
        .items
        .iter()
        .filter(|object| {
            let view = plunger::release::view::ReleaseView::from_object(object);
            view.has_fence() || view.suspend
        })
        .filter_map(|object| object.metadata.name.clone())
        .collect())
}

/// GETs `path` on `address` (`ip:port`) over plain HTTP and returns the body.
pub async fn http_get(address: &str, path: &str) -> Result<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let fetch = async {
        let mut stream = tokio::net::TcpStream::connect(address).await?;
        stream
            .write_all(format!("GET {path} HTTP/1.0\r\nHost: {address}\r\n\r\n").as_bytes())
            .await?;
        let mut response = String::new();
        stream.read_to_string(&mut response).await?;
        Ok::<String, anyhow::Error>(response)
    };
    let response = tokio::time::timeout(Duration::from_secs(10), fetch)
        .await
        .with_context(|| format!("GET http://{address}{path} timed out"))??;
    let (head, body) = response
        .split_once("\r\n\r\n")
        .context("an HTTP response without a body")?;
    ensure!(
        head.starts_with("HTTP/1.1 200") || head.starts_with("HTTP/1.0 200"),
        "GET http://{address}{path}: {head}"
    );
    Ok(body.to_owned())
}

/// Waits until the `/metrics` page at `address` holds `line` (a counter is
/// updated when its pass ends, after the writes a test sees), and returns it.
pub async fn metrics_with(address: &str, line: &str) -> Result<String> {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let metrics = http_get(address, "/metrics").await?;
        if metrics.lines().any(|l| l == line) {
            return Ok(metrics);
        }
        ensure!(
            std::time::Instant::now() < deadline,
            "{address}/metrics never held {line}:\n{metrics}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Waits until the apiserver enforces a refusal (`TestNamespace::refuse`) of
/// the controller's HelmRelease writes in `fences` (a new admission policy
/// takes a moment): a dry-run patch of `release` under the controller's
/// ServiceAccount is refused with the refusal's own `message`.
pub async fn wait_until_refused(
    on: &OnNode,
    fences: &TestNamespace,
    release: &str,
    message: &str,
) -> Result<()> {
    let plane = testkit::control_plane();
    let as_controller = plane
        .service_account_client(&on.ns().client, &on.ns().name, &on.fullname)
        .await?;
    let releases = plunger::release::api::helmreleases(as_controller, &fences.name);
    // A write the guard lets the controller make (the release is live and
    // unsuspended: this changes nothing, under a field manager of
    // flux-plunger's, which the guard requires), so only the refusal can
    // refuse it.
    let probe = serde_json::json!({"spec": {"suspend": false}});
    testkit::eventually(
        Duration::from_secs(30),
        "the refusal to be enforced",
        || {
            let releases = releases.clone();
            let probe = probe.clone();
            async move {
                let answer = releases
                    .patch(
                        release,
                        &PatchParams {
                            dry_run: true,
                            field_manager: Some(plunger::names::FIELD_MANAGER.to_owned()),
                            ..Default::default()
                        },
                        &Patch::Merge(&probe),
                    )
                    .await;
                Ok(answer.is_err_and(|err| err.to_string().contains(message)))
            }
        },
    )
    .await
}

/// Every write to the releases `names` of `namespace` since `offset`, one
/// line each: who wrote what, answered how (what a failure needs to explain
/// a fence left).
pub fn trail(offset: u64, namespace: &str, names: &[String]) -> Result<String> {
    Ok(testkit::audit::read_since(offset)?
        .iter()
        .filter(|r| r.namespace.as_deref() == Some(namespace) && names.contains(&r.name))
        .filter(|r| r.is_write())
        .map(|r| {
            format!(
                "{} {} {} {} by {} (pod {:?}, manager {:?}) -> {}",
                r.at,
                r.verb,
                r.name,
                r.request_uri,
                r.user,
                r.pod,
                r.field_manager(),
                r.code
            )
        })
        .collect::<Vec<_>>()
        .join("\n"))
}
