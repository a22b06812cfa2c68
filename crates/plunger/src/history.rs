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

use std::fmt;
use std::io::{BufReader, Read};

use base64::Engine;
use serde::Deserialize;
use serde::de::{self, Unexpected, Visitor};
use serde_json::value::RawValue;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use crate::untrusted::{Object, Text};

/// The most of a `release` value read at all: a Secret holds at most 1 MiB,
/// so a longer value is no revision Helm wrote.
const MAX_PAYLOAD_BYTES: usize = 1024 * 1024;

/// The most a stored release may inflate to. A Secret holds 1 MiB of base64
/// (768 KiB of gzip); Helm's release JSON (manifests, base64'd chart files)
/// compresses about five- to tenfold, so 16 MiB is what a 1 MiB Secret can
/// honestly hold, with room. More is a gzip bomb, refused before it is read.
const MAX_RELEASE_JSON_BYTES: u64 = 16 * 1024 * 1024;

/// gzip's magic bytes, which Helm's decoder looks for before inflating.
const GZIP_MAGIC: [u8; 3] = [0x1f, 0x8b, 0x08];

/// The longest string of a stored release the snapshot takes. Helm's
/// release names are at most 53 characters and namespaces 63; chart names,
/// versions, statuses and times are short. A longer string is no release
/// Helm wrote, and would carry its length into error text and into
/// `status.history`.
const MAX_STORED_STRING_BYTES: usize = 1024;

/// The fields of a stored Helm release the snapshot is made of. Every
/// other field (the manifest, the chart's files and templates, hooks) is
/// skipped as the JSON streams past, never built into a tree: a payload
/// written by whoever can create a Secret in the storage namespace cannot
/// make flux-plunger hold more than its few strings and its values. Each
/// field is read by its kind alone (`crate::untrusted`, and
/// `StoredVersion`): serde's own error for a value of another kind quotes a
/// string whole.
#[derive(Deserialize)]
struct StoredRelease {
    name: Option<StoredString>,
    namespace: Option<StoredString>,
    version: Option<StoredVersion>,
    info: Option<Object<StoredInfo>>,
    chart: Option<Object<StoredChart>>,
    /// The values, as Helm serialized them: Helm writes the release with
    /// Go's `json.Marshal`, which is how helm-controller digests values, so
    /// the digest is taken of these very bytes.
    config: Option<Box<RawValue>>,
}

#[derive(Default, Deserialize)]
struct StoredInfo {
    status: Option<StoredString>,
    first_deployed: Option<StoredString>,
    last_deployed: Option<StoredString>,
    deleted: Option<StoredString>,
}

#[derive(Deserialize)]
struct StoredChart {
    metadata: Option<Object<StoredChartMetadata>>,
}

#[derive(Deserialize)]
struct StoredChartMetadata {
    name: Option<StoredString>,
    version: Option<StoredString>,
    #[serde(rename = "appVersion")]
    app_version: Option<StoredString>,
}

/// A string of the stored release.
type StoredString = Text<MAX_STORED_STRING_BYTES>;

/// The stored release's revision number.
struct StoredVersion(u64);

impl<'de> Deserialize<'de> for StoredVersion {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Revision;
        impl Visitor<'_> for Revision {
            type Value = StoredVersion;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a revision number")
            }
            fn visit_u64<E: de::Error>(self, number: u64) -> Result<StoredVersion, E> {
                Ok(StoredVersion(number))
            }
            fn visit_i64<E: de::Error>(self, number: i64) -> Result<StoredVersion, E> {
                u64::try_from(number)
                    .map(StoredVersion)
                    .map_err(|_| E::invalid_value(Unexpected::Signed(number), &self))
            }
            fn visit_str<E: de::Error>(self, _: &str) -> Result<StoredVersion, E> {
                Err(E::custom("a string, not a revision number"))
            }
        }
        deserializer.deserialize_any(Revision)
    }
}

/// One entry of helm-controller's `status.history`, as flux-plunger writes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct HistorySnapshot {
    /// The Helm release name: what helm-controller passes to the uninstall.
    pub(crate) name: String,
    /// The namespace the release is installed in.
    pub(crate) namespace: String,
    pub(crate) version: u64,
    pub(crate) status: String,
    chart_name: String,
    chart_version: String,
    app_version: Option<String>,
    /// `sha256:` of the stored values, as JSON.
    config_digest: String,
    /// `sha256:` of the stored release, as JSON.
    pub(crate) digest: String,
    /// RFC 3339, whole seconds, UTC.
    first_deployed: String,
    last_deployed: String,
    pub(crate) deleted: Option<String>,
}

impl HistorySnapshot {
    /// The snapshot of the release stored in a Secret's `release` value
    /// (`base64(gzip(JSON))`, or `base64(JSON)` as older Helm stored it),
    /// which must be revision `version` of release `name`. The JSON is
    /// decoded as it inflates, bounded, and hashed on the way.
    pub(crate) fn from_payload(payload: &[u8], name: &str, version: u64) -> Result<Self, String> {
        let (release, digest) = decode_stored_release(payload)?;
        Self::from_release(release, digest, name, version)
    }

    fn from_release(
        release: StoredRelease,
        digest: String,
        name: &str,
        version: u64,
    ) -> Result<Self, String> {
        let non_empty =
            |text: Option<StoredString>| text.map(|text| text.0).filter(|s| !s.is_empty());
        let required = |text: Option<StoredString>, pointer: &str| {
            non_empty(text).ok_or_else(|| format!("the stored release has no {pointer}"))
        };
        let stored_name = required(release.name, "/name")?;
        let StoredVersion(stored_version) = release
            .version
            .ok_or("the stored release has no /version")?;
        if stored_name != name || stored_version != version {
            return Err(format!(
                "the stored release is {stored_name} v{stored_version}, not {name} v{version} as its Secret says"
            ));
        }
        let time = |text: Option<StoredString>| -> Result<Option<String>, String> {
            non_empty(text).map(|t| whole_seconds_utc(&t)).transpose()
        };
        let info = release.info.map(|info| info.0).unwrap_or_default();
        let metadata = release
            .chart
            .and_then(|chart| chart.0.metadata)
            .map(|metadata| metadata.0);
        let (chart_name, chart_version, app_version) = match metadata {
            Some(m) => (m.name, m.version, m.app_version),
            None => (None, None, None),
        };
        let config = release
            .config
            .as_deref()
            .map_or("null", RawValue::get)
            .as_bytes()
            .to_vec();
        Ok(Self {
            name: stored_name,
            namespace: required(release.namespace, "/namespace")?,
            version: stored_version,
            status: required(info.status, "/info/status")?,
            chart_name: required(chart_name, "/chart/metadata/name")?,
            chart_version: required(chart_version, "/chart/metadata/version")?,
            app_version: non_empty(app_version),
            config_digest: sha256_digest(&config),
            digest,
            first_deployed: time(info.first_deployed)?
                .ok_or("the stored release has no /info/first_deployed")?,
            last_deployed: time(info.last_deployed)?
                .ok_or("the stored release has no /info/last_deployed")?,
            // Helm 3 writes "" for a release never deleted; a zero time is none.
            deleted: time(info.deleted)?.filter(|t| !t.starts_with("0001-")),
        })
    }

    /// The entry as `status.history` holds it.
    pub(crate) fn to_json(&self) -> Value {
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
    pub(crate) fn full_name(&self) -> String {
        format!("{}/{}.v{}", self.namespace, self.name, self.version)
    }
}

/// The stored release inside a storage Secret's `release` value, and the
/// `sha256:` digest of its JSON, decoded in one bounded pass.
fn decode_stored_release(payload: &[u8]) -> Result<(StoredRelease, String), String> {
    if payload.len() > MAX_PAYLOAD_BYTES * 4 / 3 + 4 {
        return Err(format!(
            "the stored release is {} bytes of base64, more than a Secret holds",
            payload.len()
        ));
    }
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(payload)
        .map_err(|e| format!("the stored release is not base64: {e}"))?;
    let compressed = decoded.starts_with(&GZIP_MAGIC);
    let source: Box<dyn Read + '_> = if compressed {
        Box::new(flate2::read::GzDecoder::new(&decoded[..]))
    } else {
        Box::new(&decoded[..])
    };
    let mut json = BoundedDigest::new(source);
    let read = {
        let mut reader = BufReader::new(&mut json);
        let mut de = serde_json::Deserializer::from_reader(&mut reader);
        Object::<StoredRelease>::deserialize(&mut de)
            .and_then(|release| de.end().map(|()| release.0))
    };
    if json.over_bound {
        return Err(format!(
            "the stored release inflates past {MAX_RELEASE_JSON_BYTES} bytes"
        ));
    }
    if let Some(err) = json.read_error.take() {
        return Err(format!("the stored release is not gzip: {err}"));
    }
    let release = read.map_err(|e| format!("the stored release is not JSON: {e}"))?;
    Ok((release, json.digest()))
}

/// A reader that hashes what passes through it and fails once more than
/// [`MAX_RELEASE_JSON_BYTES`] have; it remembers why it failed, since the
/// JSON decoder reports any read failure as its own.
struct BoundedDigest<R> {
    inner: R,
    hasher: Sha256,
    read: u64,
    over_bound: bool,
    read_error: Option<std::io::Error>,
}

impl<R: Read> BoundedDigest<R> {
    fn new(inner: R) -> Self {
        Self {
            inner,
            hasher: Sha256::new(),
            read: 0,
            over_bound: false,
            read_error: None,
        }
    }

    fn digest(self) -> String {
        hex_digest(&self.hasher.finalize())
    }
}

impl<R: Read> Read for BoundedDigest<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = match self.inner.read(buf) {
            Ok(n) => n,
            Err(err) => {
                let kind = err.kind();
                self.read_error = Some(err);
                return Err(std::io::Error::new(kind, "unreadable"));
            }
        };
        self.read += n as u64;
        if self.read > MAX_RELEASE_JSON_BYTES {
            self.over_bound = true;
            return Err(std::io::Error::other("past the bound"));
        }
        self.hasher.update(&buf[..n]);
        Ok(n)
    }
}

fn sha256_digest(bytes: &[u8]) -> String {
    hex_digest(&Sha256::digest(bytes))
}

fn hex_digest(digest: &[u8]) -> String {
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
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
    fn a_version_that_is_no_revision_number_is_refused() {
        for version in [json!(-2), json!("2"), json!(2.5), json!([2])] {
            let mut release = stored();
            release["version"] = version.clone();
            let err = HistorySnapshot::from_payload(&payload(&release), "demo", 2).unwrap_err();
            assert!(
                err.starts_with("the stored release is not JSON"),
                "{version}: {err}"
            );
        }
    }

    #[test]
    fn no_string_of_a_payload_reaches_its_error_past_a_bound() {
        // Whoever can write the storage namespace writes the payload, and the
        // error goes to events, logs and notifications: a long string where
        // the snapshot takes a short one, a number or an object is refused
        // by its length or its kind, never copied (Rust's escaping of a DEL
        // would make each byte six).
        let long = Value::String("\u{7f}".repeat(4 * 1024 * 1024));
        let mut cases = vec![("the whole release", long.clone())];
        for pointer in [
            "/name",
            "/namespace",
            "/version",
            "/info",
            "/info/status",
            "/info/first_deployed",
            "/chart",
            "/chart/metadata",
            "/chart/metadata/version",
        ] {
            let mut release = stored();
            *release.pointer_mut(pointer).unwrap() = long.clone();
            cases.push((pointer, release));
        }
        for (what, release) in cases {
            let err = HistorySnapshot::from_payload(&payload(&release), "demo", 2).unwrap_err();
            assert!(
                err.len() < 1024,
                "{what}: an error of {} bytes: {}",
                err.len(),
                err.chars().take(200).collect::<String>()
            );
        }
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

    /// A gzip of `{"manifest": [0,0,0,…]}`: valid JSON for as far as it is
    /// read, so only the bound stops it.
    fn bomb(field: &str, elements: u64) -> Vec<u8> {
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gz.write_all(format!("{{\"{field}\":[0").as_bytes())
            .unwrap();
        let chunk = ",0".repeat(512 * 1024);
        for _ in 0..elements / (512 * 1024) {
            gz.write_all(chunk.as_bytes()).unwrap();
        }
        gz.write_all(b"]}").unwrap();
        base64::engine::general_purpose::STANDARD
            .encode(gz.finish().unwrap())
            .into_bytes()
    }

    #[test]
    fn a_payload_inflating_past_the_bound_is_refused_before_it_is_read_whole() {
        for field in ["manifest", "config"] {
            let payload = bomb(field, MAX_RELEASE_JSON_BYTES / 2 + 1024 * 1024);
            assert!(payload.len() < MAX_PAYLOAD_BYTES, "a Secret could hold it");
            let err = HistorySnapshot::from_payload(&payload, "demo", 2).unwrap_err();
            assert!(err.contains("inflates past"), "{field}: {err}");
        }
    }

    #[test]
    fn a_large_field_the_snapshot_does_not_need_is_skipped_and_still_digested() {
        let mut release = stored();
        release["manifest"] = json!(vec![0; 2 * 1024 * 1024]);
        let raw = serde_json::to_vec(&release).unwrap();
        let snapshot = HistorySnapshot::from_payload(&payload(&release), "demo", 2).unwrap();
        assert_eq!(snapshot.digest, sha256_digest(&raw));
        assert_eq!(snapshot.chart_name, "demo");
    }

    #[test]
    fn a_value_longer_than_a_secret_holds_is_not_decoded() {
        let long = vec![b'A'; MAX_PAYLOAD_BYTES * 2];
        let err = HistorySnapshot::from_payload(&long, "demo", 2).unwrap_err();
        assert!(err.contains("more than a Secret holds"), "{err}");
    }

    #[test]
    fn trailing_bytes_after_the_release_are_refused() {
        let mut raw = serde_json::to_vec(&stored()).unwrap();
        raw.extend_from_slice(b" {}");
        let plain = base64::engine::general_purpose::STANDARD
            .encode(raw)
            .into_bytes();
        let err = HistorySnapshot::from_payload(&plain, "demo", 2).unwrap_err();
        assert!(err.contains("not JSON"), "{err}");
    }
}
