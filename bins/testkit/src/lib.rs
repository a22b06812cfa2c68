//! The test world: a real etcd and kube-apiserver on loopback, built from
//! pinned Go modules by `make tools`, with the CRDs installed, an isolated
//! namespace per test and a simulated helm-controller.
//!
//! One control plane per test binary: it starts on first use and stops when
//! the test process exits, however it exits (see [`process`]).
#![forbid(unsafe_code)]

pub mod certs;
pub mod control_plane;
pub mod fixtures;
pub mod helm_controller;
pub mod process;

pub use control_plane::{ControlPlane, control_plane};
pub use fixtures::{Refusal, SeenEvent, TestNamespace, eventually};
pub use helm_controller::{Handled, SimulatedHelmController};
