//! Library part of flux-plunger-drain: its flags, shared with the contract tests.
#![forbid(unsafe_code)]

pub mod cli;
