//! Library part of flux-plunger: the controller, its flags, metrics and probes.
#![forbid(unsafe_code)]

pub mod cli;
