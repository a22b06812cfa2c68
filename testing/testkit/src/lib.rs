//! The test world: a real etcd and kube-apiserver on loopback, built from
//! pinned Go modules by `make tools`, with the CRDs installed, an isolated
//! namespace per test and a simulated helm-controller.
//!
//! One control plane per test binary: it starts on first use and stops when
//! the test process exits, however it exits (see [`process`]).
//!
//! The node tier adds a real node to it ([`node`]): kubelet, containerd,
//! kube-controller-manager and kube-scheduler, inside a sandbox of namespaces
//! of its own.
//!
//! End-to-end tests run Flux's real helm-controller on that control plane
//! ([`real_helm_controller`]), its charts built by the real source-controller
//! ([`source_controller`]) from a real OCI registry ([`registry`]). Flux's
//! real notification-controller ([`notification_controller`]) forwards
//! events to a loopback receiver ([`webhook_receiver`]).
//!
//! Randomized tests put a [`FaultProxy`] between a client and the apiserver
//! (resets, 5xx, 409s, 429s and latency at seeded rates, per verb) and draw
//! their choices from a [`SeededRng`], so that a failing seed replays.
#![forbid(unsafe_code)]

pub mod audit;
pub mod certs;
pub mod control_plane;
pub mod crash;
pub mod fault_proxy;
pub mod fixtures;
pub mod guard;
pub mod helm_controller;
pub mod node;
pub mod peak_memory;
pub mod process;
pub mod seeded;
pub mod started;
pub mod token_trap;
pub mod world;

// Flux's real helm-controller, and what it needs: a chart and a reader of
// Helm's release storage.
pub mod chart;
pub mod helm_storage;
pub mod real_causes;
pub mod real_helm_controller;

// Flux's other real controllers and the OCI registry, started the way
// helm-controller is (flux_controller), and what receives their events.
pub mod flux_controller;
pub mod notification_controller;
pub mod registry;
pub mod source_controller;
pub mod webhook_receiver;

pub use control_plane::{ControlPlane, control_plane};
pub use fault_proxy::{Fault, FaultPlan, FaultProxy, FaultReport, Hold, Rates, Verb};
pub use fixtures::{Refusal, SeenEvent, TestNamespace, eventually, is_recovered, merge};
pub use helm_controller::{Handled, SimulatedHelmController};
pub use seeded::SeededRng;
pub use world::World;

/// Tests that run a cluster-wide flux-plunger process (controller, drain,
/// sweep) take turns: each acts on every namespace of the shared control
/// plane, so two at once would act on each other's releases.
pub async fn cluster_wide_turn() -> tokio::sync::MutexGuard<'static, ()> {
    static TURN: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    TURN.lock().await
}

/// Removes every fence from the releases of `namespace` (cleanup after a test
/// that leaves one on purpose, so the next cluster-wide process does not meet it).
pub async fn strip_fences(ns: &TestNamespace) -> anyhow::Result<()> {
    use kube::api::{Patch, PatchParams};
    for object in ns.releases().list(&Default::default()).await?.items {
        let mut finalizers = object.metadata.finalizers.clone().unwrap_or_default();
        let before = finalizers.len();
        finalizers.retain(|f| f != plunger::names::FENCE_FINALIZER);
        if finalizers.len() != before
            && let Some(name) = object.metadata.name.as_deref()
        {
            ns.releases()
                .patch(
                    name,
                    &PatchParams::default(),
                    &Patch::Merge(serde_json::json!({"metadata": {"finalizers": finalizers}})),
                )
                .await?;
        }
    }
    Ok(())
}
