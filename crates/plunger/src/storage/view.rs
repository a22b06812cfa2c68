//! Helm's release storage as read from a listing: where a release's Secrets
//! are, and which of them are well-formed revisions. No request is made here.

use std::collections::BTreeMap;
use std::fmt;

use serde::Deserialize;
use serde::de::{Deserializer, IgnoredAny, MapAccess, Visitor};
use sha2::{Digest, Sha256};

use crate::names::{
    HELM_STORAGE_NAME_LABEL, HELM_STORAGE_OWNER_LABEL, HELM_STORAGE_STATUS_LABEL,
    HELM_STORAGE_VERSION_LABEL, storage_secret_name,
};
use crate::release::view::ReleaseView;
use crate::untrusted::{Object, Text, is_set};

/// Where helm-controller keeps a release's storage Secrets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StorageLocation {
    pub namespace: String,
    pub release_name: String,
}

impl StorageLocation {
    /// Where the storage of `release` is: as its status records it when it
    /// does (that is where helm-controller actually put it), else where
    /// helm-controller would put it from the spec.
    pub fn of(release: &ReleaseView) -> Self {
        let namespace = release
            .status_storage_namespace
            .clone()
            .or_else(|| release.spec_storage_namespace.clone())
            .unwrap_or_else(|| release.namespace.clone());
        let release_name = release
            .status_latest_history_name
            .clone()
            .unwrap_or_else(|| shorten_release_name(&default_release_name(release)));
        Self {
            namespace,
            release_name,
        }
    }
}

/// helm-controller's `GetReleaseName`: `spec.releaseName`, else
/// `[targetNamespace-]name`.
pub fn default_release_name(release: &ReleaseView) -> String {
    match (&release.spec_release_name, &release.spec_target_namespace) {
        (Some(name), _) => name.clone(),
        (None, Some(target)) => format!("{target}-{}", release.name),
        (None, None) => release.name.clone(),
    }
}

/// helm-controller's `ShortenName`: a name longer than 53 characters becomes
/// its first 40 characters, a dash, and the first 12 hex digits of its
/// SHA-256.
pub fn shorten_release_name(name: &str) -> String {
    const MAX_LENGTH: usize = 53;
    const SHORT_HASH_LENGTH: usize = 12;
    if name.len() <= MAX_LENGTH {
        return name.to_owned();
    }
    let digest = Sha256::digest(name.as_bytes());
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    // Byte slicing as Go does; release names are DNS labels (ASCII).
    let keep = MAX_LENGTH - (SHORT_HASH_LENGTH + 1);
    let prefix: String = name.chars().take(keep).collect();
    format!("{prefix}-{}", &hex[..SHORT_HASH_LENGTH])
}

/// One well-formed storage revision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct StorageRevision {
    pub(crate) namespace: String,
    pub(crate) name: String,
    pub(crate) revision: u64,
    /// Helm's release status (`deployed`, `failed`, `uninstalling`, …).
    pub(crate) status: String,
    pub(crate) uid: String,
    pub(crate) resource_version: String,
}

/// A Secret that looked like storage but is not a revision we may touch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct IgnoredSecret {
    pub(crate) name: String,
    pub(crate) why: String,
}

/// A storage Secret as its metadata listing is decoded: of its metadata only
/// what a revision is read from. Whoever can write the storage namespace
/// writes these Secrets, and a remote cluster's answer comes from whatever
/// server its kubeconfig names: their other labels, their annotations and
/// managedFields are skipped while parsing (`IgnoredAny` allocates nothing),
/// so a listed Secret costs its name and four labels however large it is.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
pub struct ListedSecret {
    #[serde(default)]
    pub(crate) metadata: Object<ListedSecretMeta>,
}

/// The longest name, uid or resourceVersion a listed Secret may carry (a
/// Kubernetes name is at most 253 characters).
const MAX_LISTED_NAME_BYTES: usize = 253;

/// The longest storage label value read (a label value is at most 63
/// characters).
const MAX_LABEL_VALUE_BYTES: usize = 63;

#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct ListedSecretMeta {
    #[serde(default)]
    pub(crate) name: Text<MAX_LISTED_NAME_BYTES>,
    #[serde(default)]
    pub(crate) uid: Text<MAX_LISTED_NAME_BYTES>,
    #[serde(default)]
    pub(crate) resource_version: Text<MAX_LISTED_NAME_BYTES>,
    /// Being deleted already (`deletionTimestamp` is set).
    #[serde(default, rename = "deletionTimestamp", deserialize_with = "is_set")]
    pub(crate) being_deleted: bool,
    /// The storage labels (owner, name, version, status); no other label
    /// is kept.
    #[serde(default, deserialize_with = "storage_labels")]
    pub(crate) labels: BTreeMap<String, String>,
}

impl ListedSecret {
    pub fn name(&self) -> &str {
        &self.metadata.0.name.0
    }
}

/// The labels a revision is read from, each value bounded; any other label
/// is skipped unread.
fn storage_labels<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<BTreeMap<String, String>, D::Error> {
    struct StorageLabels;
    impl<'de> Visitor<'de> for StorageLabels {
        type Value = BTreeMap<String, String>;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("labels")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            let mut kept = BTreeMap::new();
            while let Some(Text(key)) = map.next_key::<Text<MAX_LISTED_NAME_BYTES>>()? {
                if STORAGE_LABELS.contains(&key.as_str()) {
                    let Text(value) = map.next_value::<Text<MAX_LABEL_VALUE_BYTES>>()?;
                    kept.insert(key, value);
                } else {
                    map.next_value::<IgnoredAny>()?;
                }
            }
            Ok(kept)
        }
        fn visit_unit<E: serde::de::Error>(self) -> Result<Self::Value, E> {
            Ok(BTreeMap::new())
        }
        fn visit_str<E: serde::de::Error>(self, _: &str) -> Result<Self::Value, E> {
            Err(E::custom("a string, not labels"))
        }
    }
    deserializer.deserialize_any(StorageLabels)
}

/// The labels Helm's storage writes on every revision, which decide what
/// a Secret is.
const STORAGE_LABELS: [&str; 4] = [
    HELM_STORAGE_OWNER_LABEL,
    HELM_STORAGE_NAME_LABEL,
    HELM_STORAGE_VERSION_LABEL,
    HELM_STORAGE_STATUS_LABEL,
];

/// Sorts listed Secrets into well-formed revisions of `location` and the rest.
/// Only a Secret whose type, labels and name all agree is a revision: a
/// contradiction means something else wrote it, and we never delete it. The
/// type is not in a metadata list: [`list_storage`](super::api::list_storage) asks the apiserver for
/// Helm's storage type alone, so a Secret of another type never comes here.
pub(crate) fn parse_revisions(
    secrets: &[ListedSecret],
    location: &StorageLocation,
) -> (Vec<StorageRevision>, Vec<IgnoredSecret>) {
    let mut revisions = Vec::new();
    let mut ignored = Vec::new();
    for secret in secrets {
        let name = secret.name().to_owned();
        match parse_revision(secret, location) {
            Ok(revision) => revisions.push(revision),
            Err(why) => ignored.push(IgnoredSecret { name, why }),
        }
    }
    revisions.sort_by_key(|r| r.revision);
    (revisions, ignored)
}

fn parse_revision(
    secret: &ListedSecret,
    location: &StorageLocation,
) -> Result<StorageRevision, String> {
    let meta = &secret.metadata.0;
    if meta.being_deleted {
        // Deleted already, its delete held by a finalizer: deleting it again
        // changes nothing, and reclaiming it again would repeat forever.
        return Err("it is being deleted already (a finalizer holds it)".to_owned());
    }
    let label = |key: &str| meta.labels.get(key).map(String::as_str);
    if label(HELM_STORAGE_OWNER_LABEL) != Some("helm") {
        return Err("label owner is not helm".to_owned());
    }
    if label(HELM_STORAGE_NAME_LABEL) != Some(location.release_name.as_str()) {
        return Err(format!("label name is not {}", location.release_name));
    }
    let version = label(HELM_STORAGE_VERSION_LABEL).ok_or("no version label")?;
    let revision = revision_number(version)
        .ok_or_else(|| format!("version label {version:?} is not a revision number"))?;
    let name = secret.name().to_owned();
    let expected = storage_secret_name(&location.release_name, revision);
    if name != expected {
        return Err(format!(
            "name does not match its labels (expected {expected})"
        ));
    }
    Ok(StorageRevision {
        namespace: location.namespace.clone(),
        name,
        revision,
        status: label(HELM_STORAGE_STATUS_LABEL)
            .unwrap_or_default()
            .to_owned(),
        uid: meta.uid.0.clone(),
        resource_version: meta.resource_version.0.clone(),
    })
}

/// A revision number as Helm writes it: decimal, from 1 to Go's largest
/// int (the CRD's int64 `version`), with no sign or leading zero, which is
/// also the only form the admission guard lets flux-plunger delete.
fn revision_number(label: &str) -> Option<u64> {
    let revision: u64 = label.parse().ok()?;
    let canonical =
        revision > 0 && i64::try_from(revision).is_ok() && revision.to_string() == label;
    canonical.then_some(revision)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn location() -> StorageLocation {
        StorageLocation {
            namespace: "apps".into(),
            release_name: "web".into(),
        }
    }

    /// A listed Secret, decoded from its listing's JSON as the requests do.
    fn secret(name: &str, labels: &[(&str, &str)]) -> ListedSecret {
        let labels: BTreeMap<&str, &str> = labels.iter().copied().collect();
        serde_json::from_value(serde_json::json!({"metadata": {
            "name": name, "uid": format!("uid-{name}"), "resourceVersion": "9", "labels": labels,
        }}))
        .unwrap()
    }

    fn good(n: u64, status: &str) -> ListedSecret {
        let version = n.to_string();
        secret(
            &format!("sh.helm.release.v1.web.v{n}"),
            &[
                ("owner", "helm"),
                ("name", "web"),
                ("version", &version),
                ("status", status),
            ],
        )
    }

    #[test]
    fn well_formed_revisions_are_read_and_sorted() {
        let (revisions, ignored) =
            parse_revisions(&[good(5, "failed"), good(1, "superseded")], &location());
        assert!(ignored.is_empty());
        assert_eq!(
            revisions.iter().map(|r| r.revision).collect::<Vec<_>>(),
            vec![1, 5]
        );
        assert_eq!(revisions[1].status, "failed");
        assert_eq!(revisions[1].uid, "uid-sh.helm.release.v1.web.v5");
    }

    #[test]
    fn secrets_whose_labels_or_name_disagree_are_never_revisions() {
        let odd = [
            secret(
                "sh.helm.release.v1.web.v3",
                &[("owner", "someone"), ("name", "web"), ("version", "3")],
            ),
            secret(
                "sh.helm.release.v1.web.v4",
                &[("owner", "helm"), ("name", "other"), ("version", "4")],
            ),
            secret(
                "sh.helm.release.v1.web.v5",
                &[("owner", "helm"), ("name", "web")],
            ),
            secret(
                "sh.helm.release.v1.web.vx",
                &[("owner", "helm"), ("name", "web"), ("version", "x")],
            ),
            secret(
                "sh.helm.release.v1.web.v0",
                &[("owner", "helm"), ("name", "web"), ("version", "0")],
            ),
            secret(
                "sh.helm.release.v1.web.v-1",
                &[("owner", "helm"), ("name", "web"), ("version", "-1")],
            ),
            secret(
                "sh.helm.release.v1.web.v7",
                &[("owner", "helm"), ("name", "web"), ("version", "8")],
            ),
            secret(
                "my-own-secret",
                &[("owner", "helm"), ("name", "web"), ("version", "9")],
            ),
        ];
        let (revisions, ignored) = parse_revisions(&odd, &location());
        assert!(revisions.is_empty(), "{revisions:?}");
        assert_eq!(ignored.len(), odd.len());
    }

    #[test]
    fn a_version_label_the_admission_guard_would_refuse_is_no_revision() {
        // Whoever can write the storage namespace writes the labels. A
        // revision only in a form Helm never writes (a leading zero or sign,
        // past Helm's int) is refused by the admission guard's delete and by
        // the CRD's int64 history: planned, it would be acquired and undone
        // on every retry, and it would outrank the real newest revision.
        let odd = [
            secret(
                "sh.helm.release.v1.web.v5",
                &[("owner", "helm"), ("name", "web"), ("version", "05")],
            ),
            secret(
                "sh.helm.release.v1.web.v6",
                &[("owner", "helm"), ("name", "web"), ("version", "+6")],
            ),
            secret(
                "sh.helm.release.v1.web.v9223372036854775808",
                &[
                    ("owner", "helm"),
                    ("name", "web"),
                    ("version", "9223372036854775808"),
                ],
            ),
        ];
        let (revisions, ignored) = parse_revisions(&odd, &location());
        assert!(revisions.is_empty(), "{revisions:?}");
        assert_eq!(ignored.len(), odd.len());
        let (largest, _) = parse_revisions(
            &[secret(
                "sh.helm.release.v1.web.v9223372036854775807",
                &[
                    ("owner", "helm"),
                    ("name", "web"),
                    ("version", "9223372036854775807"),
                ],
            )],
            &location(),
        );
        assert_eq!(largest.len(), 1, "Helm's largest revision is one");
    }

    #[test]
    fn of_a_listed_secret_only_the_storage_labels_are_kept() {
        let listed: ListedSecret = serde_json::from_value(serde_json::json!({"metadata": {
            "name": "sh.helm.release.v1.web.v1", "annotations": {"a": "b"},
            "managedFields": [{"manager": "helm"}],
            "labels": {"owner": "helm", "name": "web", "version": "1", "status": "deployed",
                "team": "apps", "junk.example.com/k1": "v"},
        }}))
        .unwrap();
        assert_eq!(
            listed.metadata.0.labels.keys().collect::<Vec<_>>(),
            ["name", "owner", "status", "version"]
        );
        let unlabelled: ListedSecret =
            serde_json::from_value(serde_json::json!({"metadata": {"labels": null}})).unwrap();
        assert!(unlabelled.metadata.0.labels.is_empty());
        for odd in [
            serde_json::json!({"metadata": {"labels": "owner=helm"}}),
            serde_json::json!({"metadata": {"labels": {"version": "1".repeat(64)}}}),
            serde_json::json!({"metadata": {"name": "n".repeat(254)}}),
        ] {
            assert!(serde_json::from_value::<ListedSecret>(odd).is_err());
        }
    }

    #[test]
    fn a_secret_being_deleted_is_never_a_revision_to_reclaim_again() {
        let held: ListedSecret = serde_json::from_value(serde_json::json!({"metadata": {
            "name": "sh.helm.release.v1.web.v3", "uid": "uid-3", "resourceVersion": "9",
            "deletionTimestamp": "2026-01-01T00:00:00Z", "finalizers": ["example.com/keep"],
            "labels": {"owner": "helm", "name": "web", "version": "3", "status": "uninstalling"},
        }}))
        .unwrap();
        let (revisions, ignored) = parse_revisions(&[good(2, "deployed"), held], &location());
        assert_eq!(
            revisions.iter().map(|r| r.revision).collect::<Vec<_>>(),
            vec![2]
        );
        assert_eq!(ignored.len(), 1);
        assert!(ignored[0].why.contains("being deleted"), "{:?}", ignored[0]);
    }

    #[test]
    fn the_release_name_follows_helm_controller() {
        let mut release = ReleaseView {
            name: "web".into(),
            namespace: "apps".into(),
            ..Default::default()
        };
        assert_eq!(StorageLocation::of(&release), location());
        release.spec_target_namespace = Some("prod".into());
        assert_eq!(default_release_name(&release), "prod-web");
        release.spec_release_name = Some("custom".into());
        assert_eq!(default_release_name(&release), "custom");
        release.spec_storage_namespace = Some("store".into());
        assert_eq!(StorageLocation::of(&release).namespace, "store");
        // The status says where the release actually is, and wins.
        release.status_storage_namespace = Some("actual".into());
        release.status_latest_history_name = Some("recorded".into());
        assert_eq!(
            StorageLocation::of(&release),
            StorageLocation {
                namespace: "actual".into(),
                release_name: "recorded".into()
            }
        );
    }

    #[test]
    fn names_longer_than_53_characters_are_shortened_as_helm_controller_does() {
        let exactly_53 = "a".repeat(53);
        assert_eq!(shorten_release_name(&exactly_53), exactly_53);
        // Expected values computed independently: name[:40] + "-" + sha256(name)[:12].
        assert_eq!(
            shorten_release_name(&"a".repeat(60)),
            "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa-11ee391211c6"
        );
        let long = format!("flux-system-{}", "x".repeat(45));
        assert_eq!(
            shorten_release_name(&long),
            "flux-system-xxxxxxxxxxxxxxxxxxxxxxxxxxxx-01a092fb7b16"
        );
        assert_eq!(shorten_release_name(&long).len(), 53);
    }
}
