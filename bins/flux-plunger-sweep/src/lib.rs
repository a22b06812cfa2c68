//! Library part of flux-plunger-sweep: its flags and commands, shared with the tests.
#![forbid(unsafe_code)]

pub mod cli;
pub mod run;
