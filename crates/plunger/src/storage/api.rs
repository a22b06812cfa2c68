//! The requests against Helm's release storage: list a release's Secrets,
//! read one revision's payload, delete one revision.
//!
//! Always read from the apiserver (a plain LIST is a consistent read), never a
//! watch cache: a lagging cache would let the processed guard delete the
//! revision below the one just reclaimed. flux-plunger does not watch Secrets.
//!
//! Storage is listed as metadata only (a `PartialObjectMetadataList`): a
//! revision's payload (gzip'd manifests, up to about 1 MiB, for every revision
//! kept) is not needed to find or delete one, and a payload not read is one
//! neither held nor sent over the wire. The one payload read is the snapshot
//! the uninstall hand-over needs.
//!
//! What these requests read is shaped by a tenant: the Secrets by whoever
//! can write the storage namespace, and, for a release in a remote cluster,
//! the whole answer by whatever server its kubeconfig names. So each answer
//! is read to at most [`MAX_ANSWER_BYTES`], listed in pages, and decoded by
//! kind into only what is used (`crate::untrusted`); a refusal keeps its
//! code, reason and the start of its message.

use k8s_openapi::api::core::v1::Secret;
use kube::api::{DeleteParams, GetParams, ListParams, Preconditions};
use kube::core::Request;
use kube::{Client, Resource};
use serde::Deserialize;
use serde::de::IgnoredAny;

use crate::bounded;
use crate::history::HistorySnapshot;
use crate::names::{HELM_STORAGE_NAME_LABEL, HELM_STORAGE_OWNER_LABEL, HELM_STORAGE_SECRET_TYPE};
use crate::storage::view::{ListedSecret, StorageLocation, StorageRevision};
use crate::untrusted::{List, Object, Text};

/// The most of one answer read. An honest answer is at most a page of
/// [`STORAGE_PAGE_SIZE`] Secrets' metadata, or one Secret: an object is at
/// most 1.5 MiB (etcd's limit), so a page is at most 15 MiB.
const MAX_ANSWER_BYTES: usize = 32 * 1024 * 1024;

/// Secrets listed a page. helm-controller keeps 5 revisions by default
/// (`maxHistory`), the helm CLI 10: one page holds a release's storage.
const STORAGE_PAGE_SIZE: u32 = 10;

/// Lists the storage Secrets of `location` from the apiserver, as metadata:
/// only Secrets of Helm's storage type, with the labels of this release. The
/// type must be selected here, for a metadata list does not carry it.
pub async fn list_storage(
    client: &Client,
    location: &StorageLocation,
) -> kube::Result<Vec<ListedSecret>> {
    let secrets = Request::new(Secret::url_path(&(), Some(&location.namespace)));
    let mut params = storage_list_params(location);
    let mut listed = Vec::new();
    loop {
        let request = secrets
            .list_metadata(&params)
            .map_err(kube::Error::BuildRequest)?;
        let Object(page) =
            bounded::send::<Object<StoragePage>>(client, request, MAX_ANSWER_BYTES).await?;
        listed.extend(page.items.map(|List(items)| items).unwrap_or_default());
        match page.metadata.and_then(|Object(meta)| meta.continue_) {
            Some(Text(token)) if !token.is_empty() => params = params.continue_token(&token),
            _ => break,
        }
    }
    Ok(listed)
}

/// One page of a storage listing, at most its page size of Secrets.
#[derive(Deserialize)]
struct StoragePage {
    metadata: Option<Object<PageMeta>>,
    items: Option<List<ListedSecret, { STORAGE_PAGE_SIZE as usize }>>,
}

#[derive(Deserialize)]
struct PageMeta {
    #[serde(rename = "continue")]
    continue_: Option<Text<4096>>,
}

fn storage_list_params(location: &StorageLocation) -> ListParams {
    let labels = format!(
        "{HELM_STORAGE_OWNER_LABEL}=helm,{HELM_STORAGE_NAME_LABEL}={}",
        location.release_name
    );
    ListParams::default()
        .labels(&labels)
        .fields(&format!("type={HELM_STORAGE_SECRET_TYPE}"))
        .limit(STORAGE_PAGE_SIZE)
}

/// One payload is read and decoded at a time in a process: the drain works
/// on many releases at once, and a payload (written by whoever can create a
/// Secret in the storage namespace) costs up to a Secret's megabyte and the
/// values it inflates to, so sixteen at once could pass the pod's memory
/// limit where one cannot.
static PAYLOAD_READS: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(1);

/// The most of a `release` value read: twice what a Secret holds, as the
/// JSON's base64 of Helm's base64.
const MAX_RELEASE_VALUE_BYTES: usize = 2 * 1024 * 1024;

/// A storage Secret read for its payload: its `release` value alone.
#[derive(Deserialize)]
struct PayloadSecret {
    data: Option<Object<PayloadData>>,
}

#[derive(Deserialize)]
struct PayloadData {
    release: Option<Text<MAX_RELEASE_VALUE_BYTES>>,
}

/// Reads one revision's payload and makes helm-controller's history entry of
/// it; the inner error says why the payload is not a readable release.
pub(crate) async fn read_snapshot(
    client: &Client,
    revision: &StorageRevision,
    release_name: &str,
) -> kube::Result<Result<HistorySnapshot, String>> {
    let _one_at_a_time = PAYLOAD_READS
        .acquire()
        .await
        .expect("the payload semaphore is never closed");
    let request = Request::new(Secret::url_path(&(), Some(&revision.namespace)))
        .get(&revision.name, &GetParams::default())
        .map_err(kube::Error::BuildRequest)?;
    let Object(secret) =
        bounded::send::<Object<PayloadSecret>>(client, request, MAX_ANSWER_BYTES).await?;
    let Some(Text(value)) = secret.data.and_then(|Object(data)| data.release) else {
        return Ok(Err("the Secret holds no release".to_owned()));
    };
    let Ok(payload) = base64::Engine::decode(&base64::engine::general_purpose::STANDARD, value)
    else {
        return Ok(Err("the Secret's release value is not base64".to_owned()));
    };
    Ok(HistorySnapshot::from_payload(
        &payload,
        release_name,
        revision.revision,
    ))
}

/// Deletes exactly the revision that was listed: the uid and resourceVersion
/// preconditions refuse a Secret re-created or rewritten since.
pub(crate) async fn delete_revision(
    client: &Client,
    revision: &StorageRevision,
) -> kube::Result<()> {
    let params = DeleteParams {
        preconditions: Some(Preconditions {
            uid: Some(revision.uid.clone()),
            resource_version: Some(revision.resource_version.clone()),
        }),
        ..DeleteParams::default()
    };
    let request = Request::new(Secret::url_path(&(), Some(&revision.namespace)))
        .delete(&revision.name, &params)
        .map_err(kube::Error::BuildRequest)?;
    // What the delete answers (the Secret, or a Status) is not needed.
    bounded::send::<IgnoredAny>(client, request, MAX_ANSWER_BYTES).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn storage_is_listed_by_type_and_labels() {
        // A metadata list does not carry the type: a Secret of another type
        // must not be listed at all.
        let params = storage_list_params(&StorageLocation {
            namespace: "apps".into(),
            release_name: "web".into(),
        });
        assert_eq!(
            params.field_selector.as_deref(),
            Some("type=helm.sh/release.v1")
        );
        assert_eq!(
            params.label_selector.as_deref(),
            Some("owner=helm,name=web")
        );
        assert_eq!(params.limit, Some(STORAGE_PAGE_SIZE));
    }
}
