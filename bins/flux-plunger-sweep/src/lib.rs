//! Library part of flux-plunger-sweep: its flags, shared with the contract tests.
#![forbid(unsafe_code)]

pub mod cli;
