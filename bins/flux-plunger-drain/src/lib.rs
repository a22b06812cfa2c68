//! Library part of flux-plunger-drain: its flags and its run, shared with the tests.
#![forbid(unsafe_code)]

pub mod cli;
pub mod run;
