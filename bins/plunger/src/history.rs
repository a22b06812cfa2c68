//! What helm-controller's uninstall needs to find in `status.history`: one
//! snapshot of the newest Helm storage revision, read from the revision's
//! own payload.
//!
//! helm-controller clears its history when it meets storage it did not write
//! (the stuck state). Its deletion path then has no latest release to
//! uninstall (`ErrNoLatest`) and lets the release go with everything it
//! installed. It runs `helm uninstall <history[0].name>` and checks that Helm
//! uninstalled `namespace` and `version` of that entry; the CRD requires ten
//! fields, which are filled truthfully from the stored release.
//!
//! Pure: the payload is decoded here, the Secret is read by `storage`.

use std::io::Read;

use base64::Engine;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

/// A Helm release decompresses to far less than this; more is not a release
/// (a gzip bomb would otherwise be read whole).
const MAX_RELEASE_JSON_BYTES: u64 = 64 * 1024 * 1024;

/// gzip's magic bytes, which Helm's decoder looks for before inflating.
const GZIP_MAGIC: [u8; 3] = [0x1f, 0x8b, 0x08];

/// One entry of helm-controller's `status.history`, as flux-plunger writes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HistorySnapshot {
    /// The Helm release name: what helm-controller passes to the uninstall.
    pub name: String,
    /// The namespace the release is installed in.
    pub namespace: String,
    pub version: u64,
    pub status: String,
    pub chart_name: String,
    pub chart_version: String,
    pub app_version: Option<String>,
    /// `sha256:` of the stored values, as JSON.
    pub config_digest: String,
    /// `sha256:` of the stored release, as JSON.
    pub digest: String,
    /// RFC 3339, whole seconds, UTC.
    pub first_deployed: String,
    pub last_deployed: String,
    pub deleted: Option<String>,
}

impl HistorySnapshot {
    /// The snapshot of the release stored in a Secret's `release` value
    /// (`base64(gzip(JSON))`, or `base64(JSON)` as older Helm stored it),
    /// which must be revision `version` of release `name`.
    pub fn from_payload(payload: &[u8], name: &str, version: u64) -> Result<Self, String> {
        let json = decode_payload(payload)?;
        let release: Value = serde_json::from_slice(&json)
            .map_err(|e| format!("the stored release is not JSON: {e}"))?;
        Self::from_release(&release, &json, name, version)
    }

    fn from_release(release: &Value, raw: &[u8], name: &str, version: u64) -> Result<Self, String> {
        let text = |pointer: &str| {
            release
                .pointer(pointer)
                .and_then(Value::as_str)
                .filter(|s| !s.is_empty())
                .map(str::to_owned)
        };
        let required = |pointer: &str| {
            text(pointer).ok_or_else(|| format!("the stored release has no {pointer}"))
        };
        let stored_name = required("/name")?;
        let stored_version = release
            .get("version")
            .and_then(Value::as_u64)
            .ok_or("the stored release has no /version")?;
        if stored_name != name || stored_version != version {
            return Err(format!(
                "the stored release is {stored_name} v{stored_version}, not {name} v{version} as its Secret says"
            ));
        }
        let time = |pointer: &str| -> Result<Option<String>, String> {
            text(pointer).map(|t| whole_seconds_utc(&t)).transpose()
        };
        Ok(Self {
            name: stored_name,
            namespace: required("/namespace")?,
            version: stored_version,
            status: required("/info/status")?,
            chart_name: required("/chart/metadata/name")?,
            chart_version: required("/chart/metadata/version")?,
            app_version: text("/chart/metadata/appVersion"),
            config_digest: sha256_digest(
                &serde_json::to_vec(release.get("config").unwrap_or(&Value::Null))
                    .expect("a JSON value serializes"),
            ),
            digest: sha256_digest(raw),
            first_deployed: time("/info/first_deployed")?
                .ok_or("the stored release has no /info/first_deployed")?,
            last_deployed: time("/info/last_deployed")?
                .ok_or("the stored release has no /info/last_deployed")?,
            // Helm 3 writes "" for a release never deleted; a zero time is none.
            deleted: time("/info/deleted")?.filter(|t| !t.starts_with("0001-")),
        })
    }

    /// The entry as `status.history` holds it.
    pub fn to_json(&self) -> Value {
        let mut entry = json!({
            "name": self.name,
            "namespace": self.namespace,
            "version": self.version,
            "status": self.status,
            "chartName": self.chart_name,
            "chartVersion": self.chart_version,
            "configDigest": self.config_digest,
            "digest": self.digest,
            "firstDeployed": self.first_deployed,
            "lastDeployed": self.last_deployed,
        });
        if let Some(app_version) = &self.app_version {
            entry["appVersion"] = json!(app_version);
        }
        if let Some(deleted) = &self.deleted {
            entry["deleted"] = json!(deleted);
        }
        entry
    }

    /// A snapshot with made-up digests and times, for tests.
    #[cfg(test)]
    pub(crate) fn example(name: &str, version: u64, status: &str) -> Self {
        Self {
            name: name.into(),
            namespace: "apps".into(),
            version,
            status: status.into(),
            chart_name: "demo".into(),
            chart_version: "1.0.0".into(),
            app_version: None,
            config_digest: "sha256:c".into(),
            digest: "sha256:d".into(),
            first_deployed: "2026-01-01T00:00:00Z".into(),
            last_deployed: "2026-01-02T00:00:00Z".into(),
            deleted: None,
        }
    }

    /// `namespace/name.vN`, as helm-controller names a release in its events.
    pub fn full_name(&self) -> String {
        format!("{}/{}.v{}", self.namespace, self.name, self.version)
    }
}

/// The release JSON inside a storage Secret's `release` value.
pub fn decode_payload(payload: &[u8]) -> Result<Vec<u8>, String> {
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(payload)
        .map_err(|e| format!("the stored release is not base64: {e}"))?;
    if !decoded.starts_with(&GZIP_MAGIC) {
        return Ok(decoded);
    }
    let mut json = Vec::new();
    flate2::read::GzDecoder::new(&decoded[..])
        .take(MAX_RELEASE_JSON_BYTES + 1)
        .read_to_end(&mut json)
        .map_err(|e| format!("the stored release is not gzip: {e}"))?;
    if json.len() as u64 > MAX_RELEASE_JSON_BYTES {
        return Err(format!(
            "the stored release inflates past {MAX_RELEASE_JSON_BYTES} bytes"
        ));
    }
    Ok(json)
}

fn sha256_digest(bytes: &[u8]) -> String {
    let hex: String = Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    format!("sha256:{hex}")
}

/// Helm writes nanoseconds and the writer's offset; the CRD field is a
/// `metav1.Time`, whole seconds in UTC.
fn whole_seconds_utc(text: &str) -> Result<String, String> {
    let at: k8s_openapi::jiff::Timestamp = text
        .parse()
        .map_err(|e| format!("the stored time {text:?} is not RFC 3339: {e}"))?;
    Ok(at.strftime("%Y-%m-%dT%H:%M:%SZ").to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn stored() -> Value {
        json!({
            "name": "demo", "namespace": "apps", "version": 2,
            "info": {
                "first_deployed": "2026-01-02T03:04:05.123456789+02:00",
                "last_deployed": "2026-01-03T00:00:00Z",
                "deleted": "", "status": "uninstalling",
            },
            "chart": {"metadata": {"name": "demo", "version": "1.0.0", "appVersion": "1.2"}},
            "config": {"greeting": "v2"},
            "manifest": "---\nkind: ConfigMap\n",
        })
    }

    fn payload(release: &Value) -> Vec<u8> {
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        gz.write_all(&serde_json::to_vec(release).unwrap()).unwrap();
        base64::engine::general_purpose::STANDARD
            .encode(gz.finish().unwrap())
            .into_bytes()
    }

    #[test]
    fn a_stored_release_becomes_the_history_entry_helm_controller_uninstalls_from() {
        let snapshot = HistorySnapshot::from_payload(&payload(&stored()), "demo", 2).unwrap();
        let raw = serde_json::to_vec(&stored()).unwrap();
        assert_eq!(
            snapshot.to_json(),
            json!({
                "name": "demo", "namespace": "apps", "version": 2, "status": "uninstalling",
                "chartName": "demo", "chartVersion": "1.0.0", "appVersion": "1.2",
                "configDigest": sha256_digest(br#"{"greeting":"v2"}"#),
                "digest": sha256_digest(&raw),
                "firstDeployed": "2026-01-02T01:04:05Z",
                "lastDeployed": "2026-01-03T00:00:00Z",
            })
        );
        assert_eq!(snapshot.full_name(), "apps/demo.v2");
    }

    #[test]
    fn a_release_stored_before_helm_compressed_is_read_too() {
        let plain = base64::engine::general_purpose::STANDARD
            .encode(serde_json::to_vec(&stored()).unwrap())
            .into_bytes();
        assert_eq!(
            HistorySnapshot::from_payload(&plain, "demo", 2),
            HistorySnapshot::from_payload(&payload(&stored()), "demo", 2)
        );
    }

    #[test]
    fn a_deletion_time_is_kept_and_a_zero_one_dropped() {
        let mut release = stored();
        release["info"]["deleted"] = json!("2026-01-04T00:00:00Z");
        let deleted = HistorySnapshot::from_payload(&payload(&release), "demo", 2).unwrap();
        assert_eq!(deleted.to_json()["deleted"], "2026-01-04T00:00:00Z");
        release["info"]["deleted"] = json!("0001-01-01T00:00:00Z");
        let never = HistorySnapshot::from_payload(&payload(&release), "demo", 2).unwrap();
        assert_eq!(never.deleted, None);
    }

    #[test]
    fn a_payload_that_is_not_the_revision_its_secret_names_is_refused() {
        let err = HistorySnapshot::from_payload(&payload(&stored()), "demo", 3).unwrap_err();
        assert!(err.contains("demo v2, not demo v3"), "{err}");
        let err = HistorySnapshot::from_payload(&payload(&stored()), "other", 2).unwrap_err();
        assert!(err.contains("not other v2"), "{err}");
    }

    #[test]
    fn every_field_the_crd_requires_must_be_stored() {
        for pointer in [
            "/namespace",
            "/info/status",
            "/chart/metadata/name",
            "/chart/metadata/version",
            "/info/first_deployed",
            "/info/last_deployed",
        ] {
            let mut release = stored();
            let (parent, key) = pointer.rsplit_once('/').unwrap();
            let parent = if parent.is_empty() {
                &mut release
            } else {
                release.pointer_mut(parent).unwrap()
            };
            parent.as_object_mut().unwrap().remove(key);
            let err = HistorySnapshot::from_payload(&payload(&release), "demo", 2).unwrap_err();
            assert!(err.contains(pointer), "{pointer}: {err}");
        }
    }

    #[test]
    fn bad_payloads_are_refused_with_a_reason() {
        let not_base64 = HistorySnapshot::from_payload(b"%%%", "demo", 2).unwrap_err();
        assert!(not_base64.contains("not base64"), "{not_base64}");
        let broken_gzip = base64::engine::general_purpose::STANDARD
            .encode([0x1f, 0x8b, 0x08, 0, 1, 2])
            .into_bytes();
        let err = HistorySnapshot::from_payload(&broken_gzip, "demo", 2).unwrap_err();
        assert!(err.contains("not gzip"), "{err}");
        let not_json = base64::engine::general_purpose::STANDARD
            .encode(b"hello")
            .into_bytes();
        let err = HistorySnapshot::from_payload(&not_json, "demo", 2).unwrap_err();
        assert!(err.contains("not JSON"), "{err}");
        let mut release = stored();
        release["info"]["last_deployed"] = json!("yesterday");
        let err = HistorySnapshot::from_payload(&payload(&release), "demo", 2).unwrap_err();
        assert!(err.contains("not RFC 3339"), "{err}");
    }

    #[test]
    fn a_payload_inflating_past_the_bound_is_refused() {
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        let zeros = vec![0u8; 1024 * 1024];
        for _ in 0..=MAX_RELEASE_JSON_BYTES / zeros.len() as u64 {
            gz.write_all(&zeros).unwrap();
        }
        let bomb = base64::engine::general_purpose::STANDARD
            .encode(gz.finish().unwrap())
            .into_bytes();
        let err = decode_payload(&bomb).unwrap_err();
        assert!(err.contains("inflates past"), "{err}");
    }
}
