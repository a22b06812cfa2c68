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

use k8s_openapi::api::core::v1::Secret;
use kube::Client;
use kube::api::{Api, DeleteParams, ListParams, Preconditions};

use crate::history::HistorySnapshot;
use crate::names::{HELM_STORAGE_NAME_LABEL, HELM_STORAGE_OWNER_LABEL, HELM_STORAGE_SECRET_TYPE};
use crate::storage::view::{ListedSecret, StorageLocation, StorageRevision};

/// Lists the storage Secrets of `location` from the apiserver, as metadata:
/// only Secrets of Helm's storage type, with the labels of this release. The
/// type must be selected here, for a metadata list does not carry it.
pub async fn list_storage(
    client: &Client,
    location: &StorageLocation,
) -> kube::Result<Vec<ListedSecret>> {
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &location.namespace);
    Ok(secrets
        .list_metadata(&storage_list_params(location))
        .await?
        .items)
}

fn storage_list_params(location: &StorageLocation) -> ListParams {
    let labels = format!(
        "{HELM_STORAGE_OWNER_LABEL}=helm,{HELM_STORAGE_NAME_LABEL}={}",
        location.release_name
    );
    ListParams::default()
        .labels(&labels)
        .fields(&format!("type={HELM_STORAGE_SECRET_TYPE}"))
}

/// One payload is read and decoded at a time in a process: the drain works
/// on many releases at once, and a payload (written by whoever can create a
/// Secret in the storage namespace) costs up to a Secret's megabyte and the
/// values it inflates to, so sixteen at once could pass the pod's memory
/// limit where one cannot.
static PAYLOAD_READS: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(1);

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
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &revision.namespace);
    let secret = secrets.get(&revision.name).await?;
    let Some(payload) = secret.data.as_ref().and_then(|d| d.get("release")) else {
        return Ok(Err("the Secret holds no release".to_owned()));
    };
    Ok(HistorySnapshot::from_payload(
        &payload.0,
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
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &revision.namespace);
    let params = DeleteParams {
        preconditions: Some(Preconditions {
            uid: Some(revision.uid.clone()),
            resource_version: Some(revision.resource_version.clone()),
        }),
        ..DeleteParams::default()
    };
    secrets.delete(&revision.name, &params).await?;
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
    }
}
