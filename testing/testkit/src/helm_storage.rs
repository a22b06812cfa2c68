//! Helm's release storage, read and rewritten the way Helm's Secrets driver
//! stores it: one Secret per revision, `sh.helm.release.v1.<release>.v<N>`,
//! type `helm.sh/release.v1`, labels `owner=helm`, `name`, `version`,
//! `status`, and the release itself in `data.release` as
//! base64(gzip(JSON)) — base64 once more on the wire, as every Secret value.
//!
//! Helm reads a revision's status from two places: its queries select by the
//! `status` label (`Deployed()` asks for `status=deployed`), and the decoded
//! JSON's `info.status` is what `Last()` returns. A rewrite changes both.

use std::collections::BTreeMap;
use std::io::{Read, Write};

use anyhow::{Context, Result};
use base64::Engine;
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, ListParams, PostParams};
use plunger::names;
use serde_json::Value;

/// One revision in Helm's storage, as a test looks at it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredRevision {
    pub revision: u64,
    /// The `status` label.
    pub label_status: String,
    /// `info.status` of the stored release.
    pub status: String,
}

/// Decodes a storage Secret's `release` value into the release JSON.
pub fn decode_release(secret: &Secret) -> Result<Value> {
    let data = secret
        .data
        .as_ref()
        .and_then(|d| d.get("release"))
        .context("storage Secret without data.release")?;
    let gzipped = base64::engine::general_purpose::STANDARD
        .decode(&data.0)
        .context("data.release is not base64")?;
    let mut json = Vec::new();
    flate2::read::GzDecoder::new(&gzipped[..])
        .read_to_end(&mut json)
        .context("data.release is not gzip")?;
    Ok(serde_json::from_slice(&json)?)
}

/// Encodes release JSON as Helm stores it in `data.release`.
pub fn encode_release(release: &Value) -> Result<Vec<u8>> {
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gz.write_all(&serde_json::to_vec(release)?)?;
    Ok(base64::engine::general_purpose::STANDARD
        .encode(gz.finish()?)
        .into_bytes())
}

/// The revisions of `release` in `secrets`, oldest first.
pub async fn revisions(secrets: &Api<Secret>, release: &str) -> Result<Vec<StoredRevision>> {
    let selector = format!(
        "{}=helm,{}={release}",
        names::HELM_STORAGE_OWNER_LABEL,
        names::HELM_STORAGE_NAME_LABEL
    );
    let list = secrets
        .list(&ListParams::default().labels(&selector))
        .await?;
    let mut revisions = Vec::new();
    for secret in &list.items {
        let labels = secret.metadata.labels.clone().unwrap_or_default();
        let decoded = decode_release(secret)?;
        revisions.push(StoredRevision {
            revision: labels
                .get(names::HELM_STORAGE_VERSION_LABEL)
                .context("storage Secret without a version label")?
                .parse()?,
            label_status: labels
                .get(names::HELM_STORAGE_STATUS_LABEL)
                .cloned()
                .unwrap_or_default(),
            status: decoded["info"]["status"]
                .as_str()
                .unwrap_or_default()
                .to_owned(),
        });
    }
    revisions.sort_by_key(|r| r.revision);
    Ok(revisions)
}

/// `(revision, status)` pairs, for compact exact assertions; the label and
/// the stored status must agree or this fails.
pub async fn revision_statuses(secrets: &Api<Secret>, release: &str) -> Result<Vec<(u64, String)>> {
    revisions(secrets, release)
        .await?
        .into_iter()
        .map(|r| {
            anyhow::ensure!(
                r.label_status == r.status,
                "revision {} has status label {:?} but stored status {:?}",
                r.revision,
                r.label_status,
                r.status
            );
            Ok((r.revision, r.status))
        })
        .collect()
}

/// Rewrites revision `revision` of `release` to `status`, in both the stored
/// release and the `status` label, as an interrupted Helm action leaves it.
pub async fn set_revision_status(
    secrets: &Api<Secret>,
    release: &str,
    revision: u64,
    status: &str,
) -> Result<Secret> {
    let name = names::storage_secret_name(release, revision);
    let mut secret = secrets.get(&name).await?;
    let mut decoded = decode_release(&secret)?;
    decoded["info"]["status"] = Value::String(status.to_owned());
    secret
        .data
        .get_or_insert_with(BTreeMap::new)
        .insert("release".to_owned(), ByteString(encode_release(&decoded)?));
    secret
        .metadata
        .labels
        .get_or_insert_with(BTreeMap::new)
        .insert(
            names::HELM_STORAGE_STATUS_LABEL.to_owned(),
            status.to_owned(),
        );
    Ok(secrets
        .replace(&name, &PostParams::default(), &secret)
        .await?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_release_survives_encode_then_decode() {
        let release = json!({"name": "demo", "version": 2, "info": {"status": "deployed"}});
        let secret = Secret {
            data: Some(BTreeMap::from([(
                "release".to_owned(),
                ByteString(encode_release(&release).unwrap()),
            )])),
            ..Default::default()
        };
        assert_eq!(decode_release(&secret).unwrap(), release);
    }

    #[test]
    fn the_stored_value_is_base64_of_gzip() {
        let encoded = encode_release(&json!({})).unwrap();
        let gzipped = base64::engine::general_purpose::STANDARD
            .decode(&encoded)
            .unwrap();
        // gzip magic, which Helm's decoder looks for before inflating.
        assert_eq!(&gzipped[..3], &[0x1f, 0x8b, 0x08]);
    }
}
