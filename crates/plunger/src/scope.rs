//! Which HelmReleases one install of flux-plunger acts on: its namespaces and
//! its label selector. The controller watches them; the drain and the
//! pre-delete hook release fences only there, so that two installs with
//! separate scopes (one per tenant) never let go of each other's releases.

use kube::api::{ApiResource, ListParams};
use kube::{Api, Client, Resource};

use crate::release::view::helmrelease_resource;

/// Namespaces (none: every namespace) and a label selector.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Scope {
    /// Empty: every namespace.
    pub namespaces: Vec<String>,
    pub label_selector: Option<String>,
}

impl Scope {
    /// One API per watched namespace, or one for every namespace.
    pub fn apis<K>(&self, client: &Client) -> Vec<Api<K>>
    where
        K: Resource<DynamicType = ApiResource, Scope = kube::core::DynamicResourceScope>,
    {
        let resource = helmrelease_resource();
        if self.namespaces.is_empty() {
            return vec![Api::all_with(client.clone(), &resource)];
        }
        self.namespaces
            .iter()
            .map(|ns| Api::namespaced_with(client.clone(), ns, &resource))
            .collect()
    }

    /// A listing of at most `page_size` releases a page, selected by the
    /// label selector.
    pub(crate) fn list_params(&self, page_size: u32) -> ListParams {
        let params = ListParams::default().limit(page_size);
        match &self.label_selector {
            Some(selector) => params.labels(selector),
            None => params,
        }
    }

    /// The same namespaces, with `requirement` (one label selector
    /// requirement, such as `key` or `!key`) added to the selector: both
    /// must hold.
    pub(crate) fn narrowed(&self, requirement: &str) -> Scope {
        let label_selector = match &self.label_selector {
            Some(selector) => format!("{selector},{requirement}"),
            None => requirement.to_owned(),
        };
        Scope {
            namespaces: self.namespaces.clone(),
            label_selector: Some(label_selector),
        }
    }

    /// Whether the apiserver accepts the scope's label selector: one listing
    /// of at most one release. A malformed selector is refused with 400 and
    /// the apiserver's reason, which is what a person fixing the flag needs.
    /// Other failures (the apiserver unreachable, a missing permission) are
    /// left to the watch's own retries.
    pub async fn check_selector(&self, client: &Client) -> Result<(), String> {
        let Some(selector) = &self.label_selector else {
            return Ok(());
        };
        let api = self.apis::<kube::api::DynamicObject>(client).remove(0);
        match api.list_metadata(&self.list_params(1)).await {
            Err(kube::Error::Api(status)) if status.code == 400 => Err(format!(
                "--watch-label-selector {selector:?} is refused by the apiserver: {}",
                status.message
            )),
            _ => Ok(()),
        }
    }
}

/// The scope flags, shared by the controller, the drain and the hook (the
/// chart passes all three the same values).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct ScopeArgs {
    /// Act only on HelmReleases in this namespace; repeat for several. All
    /// namespaces when unset.
    #[arg(long = "watch-namespace", value_name = "NAMESPACE")]
    watch_namespaces: Vec<String>,
    /// Act only on HelmReleases matching this label selector.
    #[arg(long, value_name = "SELECTOR")]
    watch_label_selector: Option<String>,
}

impl ScopeArgs {
    pub fn scope(&self) -> Scope {
        Scope {
            namespaces: self.watch_namespaces.clone(),
            label_selector: self
                .watch_label_selector
                .clone()
                .filter(|s| !s.trim().is_empty()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_selector_selects_everything() {
        let args = ScopeArgs {
            watch_namespaces: vec!["a".into()],
            watch_label_selector: Some(" ".into()),
        };
        assert_eq!(
            args.scope(),
            Scope {
                namespaces: vec!["a".into()],
                label_selector: None
            }
        );
    }

    #[test]
    fn the_listing_carries_the_selector_and_the_page_size() {
        let scope = Scope {
            namespaces: vec![],
            label_selector: Some("tenant=a".into()),
        };
        let params = scope.list_params(7);
        assert_eq!(params.label_selector.as_deref(), Some("tenant=a"));
        assert_eq!(params.limit, Some(7));
        assert_eq!(Scope::default().list_params(7).label_selector, None);
    }

    #[test]
    fn a_narrowed_scope_keeps_its_namespaces_and_adds_the_requirement() {
        let scope = Scope {
            namespaces: vec!["a".into()],
            label_selector: Some("tenant=a".into()),
        };
        let narrowed = scope.narrowed("!fence");
        assert_eq!(narrowed.namespaces, vec!["a".to_owned()]);
        assert_eq!(narrowed.label_selector.as_deref(), Some("tenant=a,!fence"));
        assert_eq!(
            Scope::default().narrowed("fence").label_selector.as_deref(),
            Some("fence")
        );
    }
}
