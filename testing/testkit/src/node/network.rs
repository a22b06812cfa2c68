//! The node's network, all of it inside the sandbox's network namespace
//! (`hack/node-sandbox.sh`): nothing here is ever done to the host's.
//!
//! - The node's address sits on the namespace's loopback device (the kubelet
//!   refuses a loopback address as its node IP, not an address on `lo`).
//! - So does the `kubernetes` Service's address: no kube-proxy runs, and the
//!   apiserver listens on every address of the namespace at the Service's
//!   port, so a pod that dials the Service reaches the apiserver itself.
//! - Pods sit on a bridge with `host-local` addresses; the bridge is their
//!   gateway, so they reach both addresses above. No masquerade, no port
//!   mapping: no firewall rule is written anywhere.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use serde_json::json;

/// The node's InternalIP (on the sandbox's `lo`).
pub const NODE_IP: &str = "10.254.0.1";
/// The `kubernetes` Service's ClusterIP: the first address of the control
/// plane's `--service-cluster-ip-range`.
pub const KUBERNETES_SERVICE_IP: &str = "10.96.0.1";
/// The `kubernetes` Service's port, where the apiserver listens on a node.
pub const KUBERNETES_SERVICE_PORT: u16 = 443;
/// The pods' subnet, on the bridge [`POD_BRIDGE`].
pub const POD_SUBNET: &str = "10.244.0.0/24";
/// The bridge the pods' interfaces are attached to.
pub const POD_BRIDGE: &str = "fp-pods0";

/// Puts the node's and the Service's addresses on the sandbox's loopback
/// device, after checking that this really is a network namespace of the
/// sandbox's own (only the devices the node makes are there).
pub fn prepare() -> Result<()> {
    let foreign = foreign_devices(&run("ip", &["-o", "link", "show"])?);
    if !foreign.is_empty() {
        bail!(
            "the network devices {foreign:?} are here: this is not a network namespace of the node \
             sandbox's own, and the node never changes the host's network (run the node tier \
             through hack/node-sandbox.sh, as `make test-node` does)"
        );
    }
    run("ip", &["link", "set", "lo", "up"])?;
    for address in [NODE_IP, KUBERNETES_SERVICE_IP] {
        run(
            "ip",
            &["addr", "replace", &format!("{address}/32"), "dev", "lo"],
        )?;
    }
    Ok(())
}

/// The devices in `ip -o link show` output that a node's own namespace
/// would not have: anything but loopback, the pod bridge and pods' veths.
fn foreign_devices(links: &str) -> Vec<String> {
    links
        .lines()
        .filter_map(|line| line.split(':').nth(1))
        .map(|name| name.trim().split('@').next().unwrap_or_default().to_owned())
        .filter(|name| name != "lo" && name != POD_BRIDGE && !name.starts_with("veth"))
        .collect()
}

/// The CNI network configuration (written into `dir`) containerd gives its
/// pods: a bridge, host-local addresses, the bridge as gateway.
pub fn write_cni_config(dir: &Path, ipam_dir: &Path) -> Result<PathBuf> {
    std::fs::create_dir_all(dir)?;
    let config = json!({
        "cniVersion": "1.0.0",
        "name": "flux-plunger-node",
        "plugins": [{
            "type": "bridge",
            "bridge": POD_BRIDGE,
            // The bridge gets the subnet's first address and is every pod's
            // default route: the node's addresses are local to this namespace.
            "isDefaultGateway": true,
            "ipMasq": false,
            "hairpinMode": false,
            "ipam": {
                "type": "host-local",
                "ranges": [[{"subnet": POD_SUBNET}]],
                "dataDir": ipam_dir,
            },
        }],
    });
    let path = dir.join("10-flux-plunger-node.conflist");
    std::fs::write(&path, serde_json::to_vec_pretty(&config)?)?;
    Ok(path)
}

/// Runs a command to completion; its stdout, or an error with its stderr.
pub(crate) fn run(program: &str, args: &[&str]) -> Result<String> {
    let output = Command::new(program)
        .args(args)
        .output()
        .with_context(|| format!("running {program}"))?;
    if !output.status.success() {
        bail!(
            "{program} {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_loopback_the_pod_bridge_and_veths_belong_to_a_node_namespace() {
        let sandbox = "1: lo: <LOOPBACK,UP,LOWER_UP> mtu 65536 qdisc noqueue state UNKNOWN\n\
            3: fp-pods0: <BROADCAST,MULTICAST,UP,LOWER_UP> mtu 1500 qdisc noqueue state UP\n\
            4: veth1a2b3c4d@if2: <BROADCAST,MULTICAST,UP,LOWER_UP> mtu 1500 qdisc noqueue master fp-pods0\n";
        assert!(foreign_devices(sandbox).is_empty());
        let host = "1: lo: <LOOPBACK,UP,LOWER_UP> mtu 65536 qdisc noqueue state UNKNOWN\n\
            2: eth0: <BROADCAST,MULTICAST,UP,LOWER_UP> mtu 1500 qdisc fq_codel state UP\n";
        assert_eq!(foreign_devices(host), ["eth0"]);
    }
}
