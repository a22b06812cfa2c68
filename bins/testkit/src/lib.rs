//! The test world: a real etcd and kube-apiserver on loopback, built from
//! pinned Go modules by `make tools`, with the CRDs installed, an isolated
//! namespace per test and a simulated helm-controller.
//!
//! One control plane per test binary: it starts on first use and stops when
//! the test process exits, however it exits (see [`process`]).
//!
//! End-to-end tests run Flux's real helm-controller on that control plane
//! ([`real_helm_controller`]), with a loopback artifact server standing in for
//! source-controller.
#![forbid(unsafe_code)]

pub mod certs;
pub mod control_plane;
pub mod fixtures;
pub mod process;

// Flux's real helm-controller, and what it needs: a chart, an artifact server
// and a reader of Helm's release storage.
pub mod artifact_server;
pub mod chart;
pub mod helm_storage;
pub mod real_helm_controller;

pub use control_plane::{ControlPlane, control_plane};
pub use fixtures::TestNamespace;
