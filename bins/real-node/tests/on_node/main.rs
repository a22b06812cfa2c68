//! The node tier: the chart on a real node (`testkit::node`), inside
//! `hack/node-sandbox.sh` (`make test-node`). One node for the whole binary;
//! every test installs the chart (a cluster-wide flux-plunger: its drain and
//! hook act on every namespace), so the tests take turns.

mod drain;
mod flux;
