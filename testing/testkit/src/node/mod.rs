//! A real node beside the local control plane: containerd with runc and the
//! CNI bridge, the kubelet, kube-controller-manager and kube-scheduler, the
//! project's image and pod sandbox image imported. The chart's pods, its
//! native sidecar and its hook Job run for real on it.
//!
//! A node runs only inside `hack/node-sandbox.sh` ([`sandbox`]): its network
//! lives in a namespace of the sandbox's own ([`network`]), its mounts in a
//! mount namespace, its processes in a PID namespace, so nothing it does
//! reaches the host's network, and nothing it leaves outlives the sandbox.
//!
//! One node per test process, started on first use with the control plane
//! (which then takes the node's flavour: see [`crate::control_plane`]) and
//! stopped with it when the process ends.

pub mod containerd;
pub mod kubelet;
pub mod network;
pub mod sandbox;

use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use k8s_openapi::api::core::v1::{ConfigMap, Node as NodeObject};
use kube::Api;

use crate::control_plane::{AuthInfo, ControlPlane, control_plane, out_dir, tail, tool};
use crate::process::Supervised;
use crate::registry::{PushedImage, registry};
use containerd::Containerd;

/// The node's name.
pub const NODE_NAME: &str = "flux-plunger-node";

/// How long the node may take to be Ready, its controllers included: the
/// kubelet and containerd start beside a busy build on two cores.
pub const START_TIMEOUT: Duration = Duration::from_secs(240);

/// The running node of this test process.
pub struct Node {
    /// The directory holding the node's state and logs (in the sandbox's
    /// TMPDIR, removed with the sandbox).
    pub dir: PathBuf,
    /// The project's image as `make image` built it, pushed to the registry
    /// (the chart's `image.repository` and `image.digest`).
    pub image: PushedImage,
    containerd: Mutex<Containerd>,
    servers: Mutex<Vec<Supervised>>,
}

static NODE: OnceLock<Result<Node, String>> = OnceLock::new();

/// The node of this test process, started on first use.
pub fn node() -> &'static Node {
    let started = NODE.get_or_init(|| {
        std::thread::spawn(Node::start)
            .join()
            .map_err(|_| "the node start thread panicked".to_owned())?
            .map_err(|e| format!("{e:#}"))
    });
    match started {
        Ok(node) => node,
        Err(e) => panic!("the node did not start: {e}"),
    }
}

/// A program of the node's Debian packages (`make node-packages`).
pub fn system_binary(name: &str) -> Result<PathBuf> {
    ["/usr/bin", "/usr/sbin", "/usr/local/bin", "/usr/local/sbin"]
        .iter()
        .map(|dir| Path::new(dir).join(name))
        .find(|path| path.is_file())
        .with_context(|| {
            format!(
                "{name} is not installed: `make node-packages` installs the node's Debian packages"
            )
        })
}

/// An image built by `make image`: its OCI archive and the reference it carries.
fn built_image(name: &str) -> Result<(PathBuf, String)> {
    let dir = out_dir().join("image");
    let archive = dir.join(format!("{name}.oci.tar"));
    let reference = std::fs::read_to_string(dir.join(format!("{name}.ref")))
        .ok()
        .filter(|_| archive.is_file())
        .with_context(|| {
            format!(
                "{} is missing: run `make image` first (it builds the images the node runs)",
                archive.display()
            )
        })?;
    Ok((archive, reference.trim().to_owned()))
}

impl Node {
    fn start() -> Result<Self> {
        let started = Instant::now();
        let deadline = started + START_TIMEOUT;
        let sandbox = sandbox::require()?;
        let (image_archive, built) = built_image("flux-plunger")?;
        let (pause_archive, pause_image) = built_image("pause")?;
        for binary in ["kubelet", "kube-controller-manager", "kube-scheduler"] {
            tool(binary)?;
        }
        // The control plane first: in the sandbox it takes the node's flavour
        // (and puts the node's addresses in place).
        let plane = control_plane();
        let dir = tempfile::Builder::new().prefix("node-").tempdir()?.keep();

        let cni_dir = dir.join("cni");
        network::write_cni_config(&cni_dir, &dir.join("cni-ipam"))?;
        let containerd =
            Containerd::start(&dir.join("containerd"), &pause_image, &cni_dir, deadline)?;
        containerd.import(&pause_archive)?;
        // The project's image the way a cluster gets it: pushed to a
        // registry (in the sandbox's network namespace, on loopback, so
        // containerd reaches it as the tests do), and pulled by the kubelet's
        // containerd by digest, its TLS verified against testkit's CA.
        let registry = registry();
        containerd.trust_registry(&registry.host, &registry.ca_cert)?;
        let tag = built
            .rsplit_once(':')
            .map(|(_, tag)| tag)
            .context("the built image's reference has no tag")?;
        let image = registry.push_image(&image_archive, "flux-plunger", tag)?;
        eprintln!(
            "testkit: pushed {built} to the registry as {}",
            image.reference()
        );

        let cgroup_root = sandbox::create_cgroup_root(&sandbox)?;
        let kubelet_kubeconfig = dir.join("kubelet.kubeconfig");
        write_component_kubeconfig(
            plane,
            &kubelet_kubeconfig,
            &format!("system:node:{NODE_NAME}"),
            Some("system:nodes"),
        )?;
        let kubelet_log = dir.join("kubelet.log");
        let kubelet = kubelet::start(
            &kubelet::KubeletSetup {
                dir: &dir.join("kubelet"),
                node_name: NODE_NAME,
                kubeconfig: &kubelet_kubeconfig,
                client_ca: &plane.pki().ca_cert,
                containerd_socket: &containerd.socket,
                cgroup_root: &cgroup_root,
            },
            &kubelet_log,
        )?;
        let controllers = start_controllers(plane, &dir)?;

        let node = Self {
            dir,
            image,
            containerd: Mutex::new(containerd),
            servers: Mutex::new(Vec::new()),
        };
        node.servers.lock().unwrap().push(kubelet);
        node.servers.lock().unwrap().extend(controllers);
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        runtime
            .block_on(node.wait_ready(plane, deadline))
            .with_context(|| node.logs_for_failure())?;
        eprintln!(
            "testkit: node {NODE_NAME} ready in {:.1}s ({})",
            started.elapsed().as_secs_f64(),
            node.dir.display()
        );
        Ok(node)
    }

    /// Waits for the node to be Ready and for kube-controller-manager to
    /// publish the cluster's CA to namespaces (a pod's ServiceAccount token
    /// volume needs it).
    async fn wait_ready(&self, plane: &ControlPlane, deadline: Instant) -> Result<()> {
        let client = plane.client().await?;
        let nodes: Api<NodeObject> = Api::all(client.clone());
        let config_maps: Api<ConfigMap> = Api::namespaced(client, "default");
        loop {
            let ready = nodes.get_opt(NODE_NAME).await?.is_some_and(|node| {
                node.status
                    .and_then(|s| s.conditions)
                    .unwrap_or_default()
                    .iter()
                    .any(|c| c.type_ == "Ready" && c.status == "True")
            });
            let published = config_maps.get_opt("kube-root-ca.crt").await?.is_some();
            if ready && published {
                return Ok(());
            }
            self.check_running()?;
            if Instant::now() > deadline {
                bail!(
                    "the node was not ready in time (Ready: {ready}, the CA published by \
                     kube-controller-manager: {published})"
                );
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    fn check_running(&self) -> Result<()> {
        if !self.containerd.lock().unwrap().is_running() {
            bail!("containerd exited");
        }
        for server in self.servers.lock().unwrap().iter_mut() {
            if !server.is_running() {
                bail!("{} exited", server.name);
            }
        }
        Ok(())
    }

    /// The tail of every node log, for a failure message.
    pub fn logs_for_failure(&self) -> String {
        ["kubelet", "kube-controller-manager", "kube-scheduler"]
            .iter()
            .map(|name| {
                format!(
                    "--- {name}:\n{}\n",
                    tail(&self.dir.join(format!("{name}.log")), 25)
                )
            })
            .chain(std::iter::once(format!(
                "--- containerd:\n{}\n",
                self.containerd.lock().unwrap().log_tail(25)
            )))
            .chain(self.container_log_tails(30))
            .collect()
    }

    /// The tail of every container log the kubelet still keeps, one section
    /// per pod and container (what the chart's own pods said).
    fn container_log_tails(&self, lines: usize) -> Vec<String> {
        let logs = self.dir.join("kubelet").join("pod-logs");
        let mut files: Vec<PathBuf> = std::fs::read_dir(&logs)
            .into_iter()
            .flatten()
            .flatten()
            .flat_map(|pod| {
                std::fs::read_dir(pod.path())
                    .into_iter()
                    .flatten()
                    .flatten()
            })
            .flat_map(|container| {
                std::fs::read_dir(container.path())
                    .into_iter()
                    .flatten()
                    .flatten()
            })
            .map(|file| file.path())
            .collect();
        files.sort();
        files
            .iter()
            .map(|file| {
                let name = file.strip_prefix(&logs).unwrap_or(file).display();
                format!("--- {name}:\n{}\n", tail(file, lines))
            })
            .collect()
    }

    /// The log of a container of a pod that ran on this node (the kubelet
    /// keeps it after the container exits, until the pod is removed).
    pub fn container_log(&self, namespace: &str, pod: &str, container: &str) -> String {
        let logs = self.dir.join("kubelet").join("pod-logs");
        let prefix = format!("{namespace}_{pod}_");
        let Ok(entries) = std::fs::read_dir(&logs) else {
            return String::new();
        };
        let mut text = String::new();
        for entry in entries.flatten() {
            if !entry.file_name().to_string_lossy().starts_with(&prefix) {
                continue;
            }
            let mut files: Vec<_> = std::fs::read_dir(entry.path().join(container))
                .into_iter()
                .flatten()
                .flatten()
                .map(|f| f.path())
                .collect();
            files.sort();
            for file in files {
                text.push_str(&std::fs::read_to_string(file).unwrap_or_default());
            }
        }
        text
    }
}

/// kube-controller-manager (Deployments, ReplicaSets, Jobs, garbage
/// collection, ServiceAccounts, the CA ConfigMap) and kube-scheduler, each
/// with the identity the default RBAC expects of it.
fn start_controllers(plane: &ControlPlane, dir: &Path) -> Result<Vec<Supervised>> {
    let kcm_kubeconfig = dir.join("kube-controller-manager.kubeconfig");
    write_component_kubeconfig(
        plane,
        &kcm_kubeconfig,
        "system:kube-controller-manager",
        None,
    )?;
    let scheduler_kubeconfig = dir.join("kube-scheduler.kubeconfig");
    write_component_kubeconfig(plane, &scheduler_kubeconfig, "system:kube-scheduler", None)?;
    let pki = plane.pki();
    let controller_manager = Supervised::spawn(
        "kube-controller-manager",
        &tool("kube-controller-manager")?,
        &[
            format!("--kubeconfig={}", kcm_kubeconfig.display()),
            "--bind-address=127.0.0.1".to_owned(),
            "--leader-elect=false".to_owned(),
            format!(
                "--service-account-private-key-file={}",
                pki.service_account_key.display()
            ),
            format!("--root-ca-file={}", pki.ca_cert.display()),
            // Each controller acts under its own ServiceAccount, as in a real cluster.
            "--use-service-account-credentials=true".to_owned(),
            "--allocate-node-cidrs=false".to_owned(),
            "--v=1".to_owned(),
        ],
        &dir.join("kube-controller-manager.log"),
        None,
    )?;
    let scheduler = Supervised::spawn(
        "kube-scheduler",
        &tool("kube-scheduler")?,
        &[
            format!("--kubeconfig={}", scheduler_kubeconfig.display()),
            "--bind-address=127.0.0.1".to_owned(),
            "--leader-elect=false".to_owned(),
            "--v=1".to_owned(),
        ],
        &dir.join("kube-scheduler.log"),
        None,
    )?;
    Ok(vec![controller_manager, scheduler])
}

fn write_component_kubeconfig(
    plane: &ControlPlane,
    path: &Path,
    user: &str,
    group: Option<&str>,
) -> Result<()> {
    let (cert, key) = plane.pki().client_certificate(user, group)?;
    plane.write_kubeconfig(path, &AuthInfo::ClientCertificate { cert, key })
}
