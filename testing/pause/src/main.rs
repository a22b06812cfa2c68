//! The pod sandbox's process on the node tier's node (containerd's
//! `sandbox_image`): it holds the pod's namespaces while the pod lives, and
//! does nothing else. There is no registry to pull Kubernetes' own pause
//! image from, so `make image` builds this one, static, FROM scratch.
//!
//! No signal handling: containerd stops a sandbox with SIGKILL, and the pod's
//! containers have PID namespaces of their own, so nothing is ever reaped here.
#![forbid(unsafe_code)]

fn main() {
    loop {
        std::thread::park();
    }
}
