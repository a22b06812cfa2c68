//! The sandbox a node runs in (`hack/node-sandbox.sh`): its own network,
//! mount and PID namespaces, set up and removed by that script. The script
//! names the sandbox in `FLUX_PLUNGER_NODE_SANDBOX`; the node names its
//! cgroup root after it, so that the script can remove the cgroups afterwards
//! (cgroupfs is the host's) and the leftovers check can find them.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};

/// Set by `hack/node-sandbox.sh` to the sandbox's name.
pub const SANDBOX_ENV: &str = "FLUX_PLUNGER_NODE_SANDBOX";

/// The cgroup v1 hierarchies (and the v2 one of a hybrid host).
const CGROUP_MOUNT: &str = "/sys/fs/cgroup";

/// The sandbox this process runs in, if any.
pub fn name() -> Option<String> {
    std::env::var(SANDBOX_ENV).ok().filter(|n| !n.is_empty())
}

/// The sandbox's name, or an error that says how to get one.
pub fn require() -> Result<String> {
    name().with_context(|| {
        format!(
            "{SANDBOX_ENV} is not set: a node runs only inside hack/node-sandbox.sh \
             (its own network, mount and PID namespaces), as `make test-node` and `make demo` run it"
        )
    })
}

/// Creates the kubelet's cgroup root `/<sandbox>` in every hierarchy (the
/// kubelet expects it in each), with cpuset's CPUs and memory nodes copied
/// from the root (an empty cpuset takes no task). Returns the root's name,
/// as the kubelet's `cgroupRoot`.
pub fn create_cgroup_root(sandbox: &str) -> Result<String> {
    for hierarchy in hierarchies()? {
        let dir = hierarchy.join(sandbox);
        std::fs::create_dir_all(&dir)
            .with_context(|| format!("creating the cgroup {}", dir.display()))?;
        if hierarchy.ends_with("cpuset") {
            for file in ["cpuset.cpus", "cpuset.mems"] {
                let value = std::fs::read_to_string(hierarchy.join(file))?;
                std::fs::write(dir.join(file), value.trim())
                    .with_context(|| format!("writing {}", dir.join(file).display()))?;
            }
        }
    }
    Ok(format!("/{sandbox}"))
}

fn hierarchies() -> Result<Vec<PathBuf>> {
    let mut found = Vec::new();
    for entry in
        std::fs::read_dir(CGROUP_MOUNT).with_context(|| format!("reading {CGROUP_MOUNT}"))?
    {
        let path = entry?.path();
        // Co-mounted controllers appear as symlinks (cpu -> cpu,cpuacct).
        if path.is_dir() && !path.is_symlink() {
            found.push(path);
        }
    }
    if found.is_empty() {
        bail!("no cgroup hierarchy under {CGROUP_MOUNT}");
    }
    Ok(found)
}
