//! Which install of flux-plunger a fence belongs to (SPEC §1, §3). The value
//! of the fence's label names the install that set it, so that an install
//! finds its own fences wherever its label selector no longer reaches them (a
//! relabelled release, a narrowed `--watch-label-selector`) and settles them,
//! and so that two installs side by side leave each other's fences alone:
//! both write as the same field manager, so ownership in `managedFields`
//! cannot tell them apart.

use sha2::{Digest, Sha256};

use crate::names::LEGACY_FENCE_LABEL_VALUE;
use crate::release::view::ReleaseView;

/// A label value is at most 63 characters (Kubernetes' limit).
const LABEL_VALUE_MAX: usize = 63;
/// Of a name too long for a label value: the characters kept, before a dash
/// and [`DIGEST_HEX`] hex characters of its SHA-256.
const KEPT_PREFIX: usize = 50;
const DIGEST_HEX: usize = 12;

/// One install: named by its leader Lease, which is unique to it (its
/// namespace and name), and which all three binaries are given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Install {
    fence_label_value: String,
}

/// Whose a release's fence is, by its label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FenceHolder {
    /// No fence's label: no fence, or one set by the original flux-plunger.
    Unlabelled,
    /// `held`, the value every install wrote before the label named one: the
    /// fence of whichever install's scope holds the release.
    Legacy,
    /// This install's.
    ThisInstall,
    /// Another install's: it is that install's to settle, never this one's.
    AnotherInstall,
}

impl Install {
    /// The install whose leader Lease is `lease_namespace/lease_name`: the
    /// label value `<namespace>.<name>`, or, past 63 characters, its first 50
    /// (without a trailing `.` or `-`), a dash and 12 hex characters of its
    /// SHA-256. Both are valid label values, as Lease names are DNS
    /// subdomains and namespaces DNS labels.
    pub fn from_lease(lease_namespace: &str, lease_name: &str) -> Self {
        let full = format!("{lease_namespace}.{lease_name}");
        if full.len() <= LABEL_VALUE_MAX {
            return Self {
                fence_label_value: full,
            };
        }
        let digest = Sha256::digest(full.as_bytes());
        let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
        let kept = full[..KEPT_PREFIX].trim_end_matches(['.', '-']);
        Self {
            fence_label_value: format!("{kept}-{}", &hex[..DIGEST_HEX]),
        }
    }

    /// An install that writes the label every install wrote before it named
    /// one: for tests and tools that stand for no particular install.
    pub fn legacy() -> Self {
        Self {
            fence_label_value: LEGACY_FENCE_LABEL_VALUE.to_owned(),
        }
    }

    /// The value this install writes on the fence's label.
    pub fn fence_label_value(&self) -> &str {
        &self.fence_label_value
    }

    /// Whose the fence of `release` is, by its label.
    pub(crate) fn fence_holder(&self, release: &ReleaseView) -> FenceHolder {
        match release.fence_label.as_deref() {
            None => FenceHolder::Unlabelled,
            Some(value) if value == self.fence_label_value => FenceHolder::ThisInstall,
            Some(LEGACY_FENCE_LABEL_VALUE) => FenceHolder::Legacy,
            Some(_) => FenceHolder::AnotherInstall,
        }
    }
}

impl Default for Install {
    fn default() -> Self {
        Self::legacy()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labelled(value: Option<&str>) -> ReleaseView {
        ReleaseView {
            fence_label: value.map(str::to_owned),
            ..ReleaseView::default()
        }
    }

    #[test]
    fn an_install_is_named_by_its_lease() {
        let install = Install::from_lease("flux-system", "flux-plunger");
        assert_eq!(install.fence_label_value(), "flux-system.flux-plunger");
    }

    #[test]
    fn a_long_lease_name_is_cut_to_a_valid_label_value_that_still_tells_installs_apart() {
        let namespace = "tenant-with-a-rather-long-namespace-name";
        let a = Install::from_lease(namespace, "flux-plunger-for-the-first-team");
        let b = Install::from_lease(namespace, "flux-plunger-for-the-second-team");
        for install in [&a, &b] {
            let value = install.fence_label_value();
            assert!(value.len() <= LABEL_VALUE_MAX, "{value}");
            assert!(value.starts_with("tenant-with-a-rather-long-namespace-name.flux-plu"));
            assert!(
                value
                    .chars()
                    .last()
                    .is_some_and(|c| c.is_ascii_alphanumeric())
            );
        }
        assert_ne!(a, b);
    }

    #[test]
    fn a_cut_never_leaves_a_dot_or_dash_before_the_digest() {
        // 49 characters, then a dash at the 50th.
        let namespace = "a".repeat(40);
        let install = Install::from_lease(&namespace, "bbbbbbbb-cccccccccccccccccccccc");
        let value = install.fence_label_value();
        assert!(!value.contains("--") && !value.contains(".-"), "{value}");
        assert_eq!(value.len(), 49 + 1 + DIGEST_HEX);
    }

    #[test]
    fn the_label_says_whose_the_fence_is() {
        let install = Install::from_lease("flux-system", "flux-plunger");
        assert_eq!(
            install.fence_holder(&labelled(None)),
            FenceHolder::Unlabelled
        );
        assert_eq!(
            install.fence_holder(&labelled(Some("held"))),
            FenceHolder::Legacy
        );
        assert_eq!(
            install.fence_holder(&labelled(Some("flux-system.flux-plunger"))),
            FenceHolder::ThisInstall
        );
        assert_eq!(
            install.fence_holder(&labelled(Some("tenant-b.flux-plunger"))),
            FenceHolder::AnotherInstall
        );
        // The legacy install writes `held`: it is its own.
        assert_eq!(
            Install::legacy().fence_holder(&labelled(Some("held"))),
            FenceHolder::ThisInstall
        );
    }
}
