//! The requests that fetch HelmReleases: one namespace's API, and the
//! listings, page by page, of every release, of the fenced ones, and of those
//! an older flux-plunger fenced without the label.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ListMeta;
use kube::Client;
use kube::api::{DynamicObject, ListParams, ObjectMeta};
use kube::core::Request;
use serde::Deserialize;
use serde::de::DeserializeOwned;

use std::collections::HashSet;

use crate::bounded;
use crate::install::{FenceHolder, Install};
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
const LIST_PAGE_SIZE: u32 = 100;

/// Every HelmRelease in `scope`, read from the apiserver page by page and
/// decoded without its values (memory stays bounded with many releases,
/// whatever their values hold), each turned into a view and
/// kept when `keep` returns something.
pub(crate) async fn list_all<T>(
    client: &Client,
    scope: &Scope,
    keep: impl FnMut(ReleaseView) -> Option<T>,
) -> kube::Result<Vec<T>> {
    list_in_pages(client, scope, LIST_PAGE_SIZE, keep).await
}

/// The HelmReleases in `scope` carrying the fence's label (selected by the
/// apiserver), each turned into a view and kept when `keep` returns
/// something.
async fn list_labelled_fences<T>(
    client: &Client,
    scope: &Scope,
    keep: impl FnMut(ReleaseView) -> Option<T>,
) -> kube::Result<Vec<T>> {
    list_in_pages(client, &scope.narrowed(FENCE_LABEL), LIST_PAGE_SIZE, keep).await
}

/// The fenced releases `install` settles (SPEC §3, §6), selected by the
/// fence's label (finalizers cannot be selected server-side): its own
/// wherever they are in its namespaces, its label selector matching them or
/// not any more (a relabelled release, a narrowed selector); and, in its
/// scope, those fenced before the label named an install. Another install's
/// fence is not listed. A fence an older flux-plunger set without the label
/// is not listed either: the controller labels every fence it keeps as soon
/// as it reconciles the release, and the pre-delete hook lists them too
/// ([`list_every_fence`]).
pub async fn list_fenced(
    client: &Client,
    scope: &Scope,
    install: &Install,
) -> kube::Result<Vec<ReleaseView>> {
    let settled_here = |release: ReleaseView| {
        (release.has_fence()
            && matches!(
                install.fence_holder(&release),
                FenceHolder::ThisInstall | FenceHolder::Legacy
            ))
        .then_some(release)
    };
    let mut fenced = list_labelled_fences(client, scope, settled_here).await?;
    if scope.label_selector.is_some() {
        let listed: HashSet<String> = fenced.iter().map(|r| r.uid.clone()).collect();
        let own = own_fences(scope, install);
        fenced.extend(
            list_in_pages(client, &own, LIST_PAGE_SIZE, |release| {
                (release.has_fence() && !listed.contains(&release.uid)).then_some(release)
            })
            .await?,
        );
    }
    Ok(fenced)
}

/// The releases `install` fenced that its scope's label selector no longer
/// matches (relabelled since, or the selector narrowed), in its namespaces:
/// the controller's watch no longer sees them, and nobody else settles them
/// (SPEC §3). One listing while there are none; a second, of its own fences
/// in its scope, to tell them apart when there are.
pub async fn list_own_fences_outside_selector(
    client: &Client,
    scope: &Scope,
    install: &Install,
) -> kube::Result<Vec<ReleaseView>> {
    let Some(selector) = &scope.label_selector else {
        return Ok(Vec::new());
    };
    let own = own_fences(scope, install);
    let everywhere = list_in_pages(client, &own, LIST_PAGE_SIZE, |release| {
        release.has_fence().then_some(release)
    })
    .await?;
    if everywhere.is_empty() {
        return Ok(everywhere);
    }
    let in_scope = own.narrowed(selector);
    let matched: HashSet<String> = list_in_pages(client, &in_scope, LIST_PAGE_SIZE, |release| {
        Some(release.uid)
    })
    .await?
    .into_iter()
    .collect();
    Ok(everywhere
        .into_iter()
        .filter(|release| !matched.contains(&release.uid))
        .collect())
}

/// The releases carrying `install`'s fence label, in the namespaces of
/// `scope` whatever its label selector.
fn own_fences(scope: &Scope, install: &Install) -> Scope {
    Scope {
        namespaces: scope.namespaces.clone(),
        label_selector: Some(format!("{FENCE_LABEL}={}", install.fence_label_value())),
    }
}

/// `list_all` with pages of `page_size` releases (tests use small pages).
pub async fn list_in_pages<T>(
    client: &Client,
    scope: &Scope,
    page_size: u32,
    mut keep: impl FnMut(ReleaseView) -> Option<T>,
) -> kube::Result<Vec<T>> {
    let mut kept = Vec::new();
    for api in scope.apis::<DynamicObject>(client) {
        let params = scope.list_params(page_size);
        list_bounded(
            client,
            api.resource_url(),
            params,
            Listing::Whole,
            |listed: ListedRelease| {
                kept.extend(keep(ReleaseView::from_object(&listed.0)));
            },
        )
        .await?;
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
    #[derive(Deserialize)]
    struct MetadataOnly {
        #[serde(default)]
        metadata: ObjectMeta,
    }
    let mut found = Vec::new();
    let unlabelled = scope.narrowed(&format!("!{FENCE_LABEL}"));
    for api in unlabelled.apis::<DynamicObject>(client) {
        let params = unlabelled.list_params(LIST_PAGE_SIZE);
        list_bounded(
            client,
            api.resource_url(),
            params,
            Listing::Metadata,
            |item: MetadataOnly| {
                let meta = item.metadata;
                if meta
                    .finalizers
                    .iter()
                    .flatten()
                    .any(|f| f == FENCE_FINALIZER)
                {
                    found.push((
                        meta.namespace.unwrap_or_default(),
                        meta.name.unwrap_or_default(),
                    ));
                }
            },
        )
        .await?;
    }
    Ok(found)
}

/// The most of one page's answer read. A release is at most 1.5 MiB (etcd's
/// limit), but a page of them is what its writers made it: a tenant's
/// hundred releases of a megabyte of values each would be 150 MB, which
/// kube's client holds whole and copies before it is decoded, past the
/// drain's and the sweep's memory limits. A page past the bound is asked
/// for again with half as many releases ([`shorter`]).
const MAX_PAGE_BYTES: usize = 16 * 1024 * 1024;

/// What a listing reads of each release.
#[derive(Clone, Copy)]
enum Listing {
    /// The whole object (decoded without its values, [`ListedRelease`]).
    Whole,
    /// Its metadata alone (a `PartialObjectMetadataList`).
    Metadata,
}

/// One page of a listing: its items, and the token of the next.
#[derive(Deserialize)]
struct Page<K> {
    #[serde(default)]
    metadata: ListMeta,
    items: Option<Vec<K>>,
}

/// Hands `take` every item listed at `url_path` with `params`, page by
/// page, each answer read to at most [`MAX_PAGE_BYTES`].
async fn list_bounded<K: DeserializeOwned>(
    client: &Client,
    url_path: &str,
    mut params: ListParams,
    listing: Listing,
    mut take: impl FnMut(K),
) -> kube::Result<()> {
    let path = Request::new(url_path);
    loop {
        let request = match listing {
            Listing::Whole => path.list(&params),
            Listing::Metadata => path.list_metadata(&params),
        }
        .map_err(kube::Error::BuildRequest)?;
        let page: Page<K> = match bounded::send(client, request, MAX_PAGE_BYTES).await {
            Err(err) if bounded::is_too_large(&err) => match shorter(params.limit) {
                Some(limit) => {
                    params.limit = Some(limit);
                    continue;
                }
                None => return Err(err),
            },
            page => page?,
        };
        page.items.into_iter().flatten().for_each(&mut take);
        match next_page_token(page.metadata.continue_) {
            Some(token) => params = params.continue_token(&token),
            None => return Ok(()),
        }
    }
}

/// The page size to ask for again when a page's answer passed its bound:
/// half, while a page can hold fewer; `None` when it held one release.
fn shorter(limit: Option<u32>) -> Option<u32> {
    limit.filter(|&limit| limit > 1).map(|limit| limit / 2)
}

/// The token that asks for the page after this one, `None` on the last. The
/// last page carries an empty (or no) `continue`: following an empty token
/// would list from the start again, forever.
fn next_page_token(continue_: Option<String>) -> Option<String> {
    continue_.filter(|token| !token.is_empty())
}

/// Every fenced HelmRelease `install` settles: those of [`list_fenced`], and those an older flux-plunger fenced without
/// the label, found in one listing of the metadata of the releases without it
/// and read whole one by one (the plan needs their spec and managedFields).
pub async fn list_every_fence(
    client: &Client,
    scope: &Scope,
    install: &Install,
) -> kube::Result<Vec<ReleaseView>> {
    let mut fenced = list_fenced(client, scope, install).await?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_listing_follows_a_continue_token_and_stops_at_an_empty_or_missing_one() {
        assert_eq!(
            next_page_token(Some("page-2".into())).as_deref(),
            Some("page-2")
        );
        assert_eq!(next_page_token(Some(String::new())), None);
        assert_eq!(next_page_token(None), None);
    }

    #[test]
    fn a_page_past_its_bound_is_asked_for_again_half_as_long_down_to_one_release() {
        assert_eq!(shorter(Some(100)), Some(50));
        assert_eq!(shorter(Some(3)), Some(1));
        assert_eq!(shorter(Some(2)), Some(1));
        assert_eq!(
            shorter(Some(1)),
            None,
            "one release past the bound is an error"
        );
        assert_eq!(shorter(None), None);
    }

    #[test]
    fn a_page_is_read_for_its_items_and_its_continue_token() {
        let page: Page<ListedRelease> = serde_json::from_value(serde_json::json!({
            "kind": "HelmReleaseList",
            "metadata": {"continue": "next", "resourceVersion": "7"},
            "items": [{"metadata": {"name": "web"}, "spec": {"values": {"big": "x"}, "chart": {}}}],
        }))
        .unwrap();
        assert_eq!(page.metadata.continue_.as_deref(), Some("next"));
        let items = page.items.unwrap();
        assert_eq!(items[0].0.metadata.name.as_deref(), Some("web"));
        assert!(items[0].0.data.pointer("/spec/values").is_none());
        let empty: Page<ListedRelease> =
            serde_json::from_value(serde_json::json!({"items": null})).unwrap();
        assert!(empty.items.is_none());
    }

    #[test]
    fn an_install_s_own_fences_are_selected_by_its_label_in_its_namespaces_whatever_its_selector() {
        let scope = Scope {
            namespaces: vec!["a".into(), "b".into()],
            label_selector: Some("team=payments".into()),
        };
        let install = Install::from_lease("flux-system", "flux-plunger");
        assert_eq!(
            own_fences(&scope, &install),
            Scope {
                namespaces: vec!["a".into(), "b".into()],
                label_selector: Some(
                    "flux-plunger.cozystack.io/uninstall-fence=flux-system.flux-plunger".into()
                ),
            }
        );
    }
}
