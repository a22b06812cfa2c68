//! Helm's release storage: [`view`] finds where a release's Secrets are and
//! which of them are revisions, from what was listed; [`api`] lists them,
//! reads one payload and deletes one revision; `reach` asks whether the
//! release's own identity could reach them. Apart, so that the pure
//! decisions (`decide`) import nothing that talks to the apiserver.

pub mod api;
pub(crate) mod reach;
pub mod view;
