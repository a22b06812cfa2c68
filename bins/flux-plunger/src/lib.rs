//! Library part of flux-plunger: the controller, its flags, metrics and probes.
#![forbid(unsafe_code)]

pub mod cli;
pub mod controller;
pub mod metrics;
pub mod outside;
pub mod process;
pub mod run;
pub mod server;
pub mod watched;
