//! The node tier: the chart on a real node (`testkit::node`), inside
//! `hack/node-sandbox.sh` (`make test-node`). One node for the whole binary;
//! every test installs the chart (a cluster-wide flux-plunger: its drain and
//! hook act on every namespace), so the tests take turns. No helm-controller
//! runs here: the Flux test (`tests/as_flux_helmrelease.rs`) has a sandbox,
//! a control plane and a node of its own, so its helm-controller never
//! reconciles these tests' releases.

mod drain;
mod lifecycle;
mod standby;
