//! The kubelet, as a real node runs it, with what this kind of host needs:
//! cgroup v1 allowed, the cgroupfs driver (containerd 1.6 cannot tell the
//! kubelet its driver), a cgroup root of the sandbox's own, swap tolerated,
//! and no iptables chains.

use std::path::{Path, PathBuf};

use anyhow::Result;

use crate::control_plane::tool;
use crate::node::network::NODE_IP;
use crate::process::Supervised;

/// What the kubelet is started with.
pub struct KubeletSetup<'a> {
    pub dir: &'a Path,
    pub node_name: &'a str,
    pub kubeconfig: &'a Path,
    pub client_ca: &'a Path,
    pub containerd_socket: &'a Path,
    pub cgroup_root: &'a str,
}

/// Starts the kubelet; its log is `log`.
pub fn start(setup: &KubeletSetup<'_>, log: &Path) -> Result<Supervised> {
    std::fs::create_dir_all(setup.dir)?;
    let config = setup.dir.join("kubelet-config.yaml");
    std::fs::write(&config, config_yaml(setup))?;
    let root_dir: PathBuf = setup.dir.join("root");
    Supervised::spawn(
        "kubelet",
        &tool("kubelet")?,
        &[
            format!("--config={}", config.display()),
            format!("--kubeconfig={}", setup.kubeconfig.display()),
            format!("--hostname-override={}", setup.node_name),
            format!("--node-ip={NODE_IP}"),
            format!("--root-dir={}", root_dir.display()),
            "--v=1".to_owned(),
        ],
        log,
        None,
    )
}

fn config_yaml(setup: &KubeletSetup<'_>) -> String {
    let socket = setup.containerd_socket.display();
    format!(
        r#"apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
# Kubernetes 1.35 on refuses cgroup v1 unless told; many CI hosts still have it.
failCgroupV1: false
cgroupDriver: cgroupfs
# Pods' cgroups under a root of the sandbox's own, never among the host's.
cgroupRoot: {cgroup_root}
cgroupsPerQOS: true
failSwapOn: false
# Otherwise the kubelet writes firewall rules (a KUBE-FIREWALL chain dropping
# 127/8 traffic from outside): a node here writes none.
makeIPTablesUtilChains: false
containerRuntimeEndpoint: unix://{socket}
imageServiceEndpoint: unix://{socket}
podLogsDir: {logs}
address: {NODE_IP}
port: 10250
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 10248
# The apiserver reaches the kubelet (logs, exec) with a client certificate of
# the control plane's CA, and the kubelet asks the apiserver what it may do.
authentication:
  anonymous: {{enabled: false}}
  webhook: {{enabled: true}}
  x509: {{clientCAFile: {client_ca}}}
authorization:
  mode: Webhook
# A CI disk may be nearly full: only a nearly exhausted one evicts.
evictionHard: {{memory.available: "100Mi", nodefs.available: "1%", imagefs.available: "1%"}}
imageGCHighThresholdPercent: 99
imageGCLowThresholdPercent: 98
resolvConf: /etc/resolv.conf
serializeImagePulls: false
"#,
        cgroup_root = setup.cgroup_root,
        logs = setup.dir.join("pod-logs").display(),
        client_ca = setup.client_ca.display(),
    )
}
