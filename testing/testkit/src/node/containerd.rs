//! containerd (Debian's 1.6), configured to keep everything under the node's
//! directory: its root and state, its sockets, runc's state. The sandbox's
//! private `/run` takes what 1.6 puts there whatever its configuration says
//! (shim sockets under `/run/containerd/s`).
//!
//! It pulls the project's image from the test world's registry
//! ([`crate::registry`]) as a cluster's containerd pulls from a private one:
//! its CRI registry configuration is a `config_path` directory, in which
//! [`Containerd::trust_registry`] writes the registry's `hosts.toml` naming
//! the CA to trust. Only the pod sandbox image is imported.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::control_plane::tail;
use crate::node::network::run;
use crate::node::system_binary;
use crate::process::Supervised;

/// The CRI namespace of containerd: the kubelet sees only images in it.
const CRI_NAMESPACE: &str = "k8s.io";

/// A running containerd.
pub struct Containerd {
    pub socket: PathBuf,
    /// Its registry configuration (`config_path`): a directory per registry
    /// host, read at each pull, so a registry may be added while it runs.
    pub certs_dir: PathBuf,
    pub log: PathBuf,
    server: Supervised,
}

impl Containerd {
    /// Starts containerd with `pause_image` as every pod's sandbox and the
    /// CNI configuration in `cni_config_dir`; waits for its socket.
    pub fn start(
        dir: &Path,
        pause_image: &str,
        cni_config_dir: &Path,
        deadline: Instant,
    ) -> Result<Self> {
        std::fs::create_dir_all(dir)?;
        let socket = dir.join("containerd.sock");
        let config = dir.join("config.toml");
        std::fs::write(
            &config,
            config_toml(dir, &socket, pause_image, cni_config_dir)?,
        )?;
        let certs_dir = dir.join("certs.d");
        std::fs::create_dir_all(&certs_dir)?;
        let log = dir.join("containerd.log");
        let mut server = Supervised::spawn(
            "containerd",
            &system_binary("containerd")?,
            &[format!("--config={}", config.display())],
            &log,
            None,
        )?;
        while !socket.exists() {
            if !server.is_running() || Instant::now() > deadline {
                bail!("containerd did not start; its log:\n{}", tail(&log, 30));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(Self {
            socket,
            certs_dir,
            log,
            server,
        })
    }

    /// Imports an OCI archive into the kubelet's namespace, under the
    /// reference the archive names.
    pub fn import(&self, archive: &Path) -> Result<()> {
        let ctr = system_binary("ctr")?;
        run(
            &ctr.display().to_string(),
            &[
                "--address",
                &self.socket.display().to_string(),
                "--namespace",
                CRI_NAMESPACE,
                "images",
                "import",
                &archive.display().to_string(),
            ],
        )
        .with_context(|| format!("importing {}", archive.display()))?;
        Ok(())
    }

    /// Lets containerd pull from the registry at `host` (`HOST:PORT`, HTTPS)
    /// trusting the CA in `ca_cert`, and nothing else about it: no
    /// "insecure" switch, no other mirror.
    pub fn trust_registry(&self, host: &str, ca_cert: &Path) -> Result<()> {
        let dir = self.certs_dir.join(host);
        std::fs::create_dir_all(&dir)?;
        std::fs::write(
            dir.join("hosts.toml"),
            format!(
                r#"server = "https://{host}"

[host."https://{host}"]
  capabilities = ["pull", "resolve"]
  ca = "{ca}"
"#,
                ca = ca_cert.display()
            ),
        )?;
        Ok(())
    }

    pub fn is_running(&mut self) -> bool {
        self.server.is_running()
    }

    /// The last lines of containerd's log, for a failure message.
    pub fn log_tail(&self, lines: usize) -> String {
        tail(&self.log, lines)
    }
}

fn config_toml(
    dir: &Path,
    socket: &Path,
    pause_image: &str,
    cni_config_dir: &Path,
) -> Result<String> {
    let runc = system_binary("runc")?;
    let cni_bin_dir = Path::new(CNI_PLUGIN_DIR);
    if !cni_bin_dir.join("bridge").is_file() {
        bail!(
            "{} has no CNI bridge plugin: install the node's Debian packages (`make node-packages`)",
            cni_bin_dir.display()
        );
    }
    let d = dir.display();
    Ok(format!(
        r#"version = 2
root = "{d}/root"
state = "{d}/state"
[grpc]
  address = "{socket}"
[ttrpc]
  address = "{socket}.ttrpc"
[metrics]
  address = ""
[plugins."io.containerd.internal.v1.opt"]
  path = "{d}/opt"
[plugins."io.containerd.grpc.v1.cri"]
  # Built here (testing/pause) and imported: no registry here holds
  # Kubernetes' own.
  sandbox_image = "{pause_image}"
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  enable_selinux = false
  # runc would set every sandbox's oom_score_adj to -998, which needs
  # CAP_SYS_RESOURCE: where root lacks it (a container, some VMs), every
  # sandbox fails with "can't get final child's PID from pipe".
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        BinaryName = "{runc}"
        Root = "{d}/runc"
  [plugins."io.containerd.grpc.v1.cri".registry]
    # A hosts.toml per registry (trust_registry): the project's image is
    # pulled from the test world's registry, trusted through its CA.
    config_path = "{d}/certs.d"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{cni_bin}"
    conf_dir = "{cni_conf}"
"#,
        socket = socket.display(),
        runc = runc.display(),
        cni_bin = cni_bin_dir.display(),
        cni_conf = cni_config_dir.display(),
    ))
}

/// Where Debian's containernetworking-plugins puts the CNI plugins.
const CNI_PLUGIN_DIR: &str = "/usr/lib/cni";
