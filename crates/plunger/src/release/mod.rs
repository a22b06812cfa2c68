//! Flux's HelmRelease as flux-plunger sees it: [`view`] reads the fields it
//! decides on from an object already fetched; [`api`] fetches and lists,
//! decoding listings as `listed` releases (without their values).
//! Apart, so that the pure decisions (`decide`) import nothing that talks to
//! the apiserver.

pub mod api;
pub(crate) mod listed;
pub mod view;
