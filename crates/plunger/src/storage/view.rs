//! Helm's release storage as read from a listing: where a release's Secrets
//! are, and which of them are well-formed revisions. No request is made here.

use k8s_openapi::api::core::v1::Secret;
use kube::ResourceExt;
use kube::api::PartialObjectMeta;
use sha2::{Digest, Sha256};

use crate::names::{
    HELM_STORAGE_NAME_LABEL, HELM_STORAGE_OWNER_LABEL, HELM_STORAGE_STATUS_LABEL,
    HELM_STORAGE_VERSION_LABEL, storage_secret_name,
};
use crate::release::view::ReleaseView;

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

/// A storage Secret as listed: its metadata, no payload.
pub(crate) type ListedSecret = PartialObjectMeta<Secret>;

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
        let name = secret.name_any();
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
    if secret.metadata.deletion_timestamp.is_some() {
        // Deleted already, its delete held by a finalizer: deleting it again
        // changes nothing, and reclaiming it again would repeat forever.
        return Err("it is being deleted already (a finalizer holds it)".to_owned());
    }
    let labels = secret.labels();
    let label = |key: &str| labels.get(key).map(String::as_str);
    if label(HELM_STORAGE_OWNER_LABEL) != Some("helm") {
        return Err("label owner is not helm".to_owned());
    }
    if label(HELM_STORAGE_NAME_LABEL) != Some(location.release_name.as_str()) {
        return Err(format!("label name is not {}", location.release_name));
    }
    let version = label(HELM_STORAGE_VERSION_LABEL).ok_or("no version label")?;
    let revision = revision_number(version)
        .ok_or_else(|| format!("version label {version:?} is not a revision number"))?;
    let name = secret.name_any();
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
        uid: secret.uid().unwrap_or_default(),
        resource_version: secret.resource_version().unwrap_or_default(),
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

    use kube::api::ObjectMeta;

    fn location() -> StorageLocation {
        StorageLocation {
            namespace: "apps".into(),
            release_name: "web".into(),
        }
    }

    fn secret(name: &str, labels: &[(&str, &str)]) -> ListedSecret {
        ListedSecret {
            metadata: ObjectMeta {
                name: Some(name.into()),
                uid: Some(format!("uid-{name}")),
                resource_version: Some("9".into()),
                labels: Some(
                    labels
                        .iter()
                        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                        .collect::<BTreeMap<_, _>>(),
                ),
                ..Default::default()
            },
            ..Default::default()
        }
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
    fn a_secret_being_deleted_is_never_a_revision_to_reclaim_again() {
        let mut held = good(3, "uninstalling");
        held.metadata.deletion_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
            ));
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
