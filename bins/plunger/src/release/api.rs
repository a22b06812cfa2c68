//! The requests that fetch HelmReleases: one namespace's API, and the
//! listings, page by page, of every release, of the fenced ones, and of those
//! an older flux-plunger fenced without the label.

use kube::Client;
use kube::api::DynamicObject;

use crate::names::{FENCE_FINALIZER, FENCE_LABEL};
use crate::release::listed::ListedRelease;
use crate::release::view::{ReleaseView, helmrelease_resource};
use crate::scope::Scope;

/// HelmReleases of one namespace.
pub fn helmreleases(client: Client, namespace: &str) -> kube::Api<DynamicObject> {
    kube::Api::namespaced_with(client, namespace, &helmrelease_resource())
}

/// How many HelmReleases one listing request asks for. kube's client holds a
/// page whole, and copies it, before it is decoded: with 50 KB of values a
/// release, pages of 500 (25 MB of JSON) took the drain and the sweep to
/// 129 MiB over 1,000 fenced releases, past their 128Mi limits
/// (docs/performance.md). Pages of 100, as the controller's watch lists.
pub const LIST_PAGE_SIZE: u32 = 100;

/// Every HelmRelease in `scope`, read from the apiserver page by page and
/// decoded without its values (memory stays bounded with many releases,
/// whatever their values hold), each turned into a view and
/// kept when `keep` returns something.
pub async fn list_all<T>(
    client: &Client,
    scope: &Scope,
    keep: impl FnMut(ReleaseView) -> Option<T>,
) -> kube::Result<Vec<T>> {
    list_in_pages(client, scope, LIST_PAGE_SIZE, keep).await
}

/// The HelmReleases in `scope` carrying the fence's label (selected by the
/// apiserver), each turned into a view and kept when `keep` returns
/// something.
pub async fn list_labelled_fences<T>(
    client: &Client,
    scope: &Scope,
    keep: impl FnMut(ReleaseView) -> Option<T>,
) -> kube::Result<Vec<T>> {
    list_in_pages(client, &scope.narrowed(FENCE_LABEL), LIST_PAGE_SIZE, keep).await
}

/// The fenced releases in `scope`, selected by the fence's label (finalizers
/// cannot be selected server-side). A fence an older flux-plunger set without
/// the label is not listed here: the controller labels every fence it keeps
/// as soon as it reconciles the release, and the pre-delete hook lists them
/// too ([`list_every_fence`]).
pub async fn list_fenced(client: &Client, scope: &Scope) -> kube::Result<Vec<ReleaseView>> {
    list_labelled_fences(client, scope, |release| {
        release.has_fence().then_some(release)
    })
    .await
}

/// [`list_all`] with pages of `page_size` releases (tests use small pages).
pub async fn list_in_pages<T>(
    client: &Client,
    scope: &Scope,
    page_size: u32,
    mut keep: impl FnMut(ReleaseView) -> Option<T>,
) -> kube::Result<Vec<T>> {
    let mut kept = Vec::new();
    for api in scope.apis::<ListedRelease>(client) {
        let mut params = scope.list_params(page_size);
        loop {
            let page = api.list(&params).await?;
            kept.extend(
                page.items
                    .iter()
                    .map(|listed| ReleaseView::from_object(&listed.0))
                    .filter_map(&mut keep),
            );
            // The last page carries an empty (or no) `continue`: following an
            // empty token would list from the start again, forever.
            match page.metadata.continue_ {
                Some(token) if !token.is_empty() => params = params.continue_token(&token),
                _ => break,
            }
        }
    }
    Ok(kept)
}

/// `namespace/name` of the HelmReleases in `scope` that carry the fence
/// without its label (fenced by an older flux-plunger), found by reading only
/// the metadata of the releases without the label, page by page.
pub async fn list_unlabelled_fences(
    client: &Client,
    scope: &Scope,
) -> kube::Result<Vec<(String, String)>> {
    let mut found = Vec::new();
    let unlabelled = scope.narrowed(&format!("!{FENCE_LABEL}"));
    for api in unlabelled.apis::<DynamicObject>(client) {
        let mut params = unlabelled.list_params(LIST_PAGE_SIZE);
        loop {
            let page = api.list_metadata(&params).await?;
            found.extend(page.items.into_iter().filter_map(|item| {
                let meta = item.metadata;
                meta.finalizers
                    .as_ref()?
                    .iter()
                    .any(|f| f == FENCE_FINALIZER)
                    .then(|| {
                        (
                            meta.namespace.unwrap_or_default(),
                            meta.name.unwrap_or_default(),
                        )
                    })
            }));
            match page.metadata.continue_ {
                Some(token) if !token.is_empty() => params = params.continue_token(&token),
                _ => break,
            }
        }
    }
    Ok(found)
}

/// Every fenced HelmRelease in `scope`: those with the fence's label,
/// selected by the apiserver, and those an older flux-plunger fenced without
/// the label, found in one listing of the metadata of the releases without it
/// and read whole one by one (the plan needs their spec and managedFields).
pub async fn list_every_fence(client: &Client, scope: &Scope) -> kube::Result<Vec<ReleaseView>> {
    let mut fenced = list_fenced(client, scope).await?;
    for (namespace, name) in list_unlabelled_fences(client, scope).await? {
        if let Some(object) = helmreleases(client.clone(), &namespace)
            .get_opt(&name)
            .await?
        {
            let release = ReleaseView::from_object(&object);
            if release.has_fence() {
                fenced.push(release);
            }
        }
    }
    Ok(fenced)
}
