//! flux-plunger's domain, shared by the controller, the drain sidecar and the
//! pre-delete sweeper. Decisions are pure functions of what was read; the
//! modules that talk to the apiserver only carry them out.
#![forbid(unsafe_code)]

pub mod apply;
pub mod cli;
pub mod client;
pub mod decide;
pub mod drain;
pub mod error;
pub mod events;
pub mod history;
pub mod install;
pub mod lease;
pub mod logs;
pub mod names;
pub mod notices;
pub mod notify;
pub mod ratelimit;
pub mod reconcile;
pub mod release;
pub mod remote;
pub mod scope;
pub mod storage;
pub mod sweep;
pub mod test_hooks;
pub mod timings;
