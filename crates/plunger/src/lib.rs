//! flux-plunger's domain, shared by the controller, the drain sidecar and the
//! pre-delete sweeper. Decisions are pure functions of what was read; the
//! modules that talk to the apiserver only carry them out.
//!
//! The modules come in three groups:
//!
//! - **Decisions**, pure: no request is made. [`decide`] (what to do next,
//!   SPEC §4-§5), [`install`] (which install a fence belongs to), `history`
//!   (the snapshot helm-controller's uninstall needs), [`names`] (the fixed
//!   names of SPEC §1), [`notices`] (every event's words), [`ratelimit`]
//!   (the recovery rate limit), [`scope`] (which releases an install acts
//!   on), [`timings`] (every duration, from one chart value), `untrusted`
//!   (JSON a tenant shapes, decoded by kind and bounded), and the views
//!   [`release::view`], [`storage::view`] and [`sweep::plan`].
//! - **Carrying them out**: the modules that talk to the apiserver.
//!   [`apply`] (every write to a HelmRelease), [`client`] (every request
//!   but a watch has a deadline), [`reconcile`] (a release read, decided on
//!   and written), [`drain`] (every fence let go as the controller stops),
//!   [`sweep`] (the pre-delete hook, `list` and `release`), [`lease`] (the
//!   single writer), [`events`] (Kubernetes Events), [`notify`] (Flux's
//!   notification-controller), `remote` (storage in a remote cluster),
//!   [`release::api`] (fetching and listing releases), [`storage::api`] and
//!   `storage::reach` (Helm's storage, and whether a release may reach it),
//!   `bounded` (requests whose answers a tenant shapes, read to a bound).
//! - **The process**: [`cli`] (the flag groups the binaries share), `logs`
//!   (Flux's JSON log lines), [`error`] (the one error type), [`test_hooks`]
//!   (test-only knobs).
#![forbid(unsafe_code)]

// Decisions: pure functions and values, no request made. `release` and
// `storage` are placed by their views; their `api`s (and `storage::reach`)
// are the requests that fetch what the views read.
pub mod decide;
pub(crate) mod history;
pub mod install;
pub mod names;
pub mod notices;
pub mod ratelimit;
pub mod release;
pub mod scope;
pub mod storage;
pub mod timings;
pub(crate) mod untrusted;

// Carrying them out: the modules that talk to the apiserver.
pub mod apply;
pub(crate) mod bounded;
pub mod client;
pub mod drain;
pub mod events;
pub mod lease;
pub mod notify;
pub mod reconcile;
pub(crate) mod remote;
pub mod sweep;

// The process: flags, logs, the error type, test-only knobs.
pub mod cli;
pub mod error;
pub(crate) mod logs;
pub mod test_hooks;
