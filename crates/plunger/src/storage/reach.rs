//! Whether flux-plunger may touch a release's storage: only where
//! helm-controller, acting for that release, could.
//!
//! The storage's namespace comes from what the release's author writes
//! (`spec.storageNamespace`, `status.storageNamespace`), and flux-plunger acts
//! there with its own, cluster-wide identity. Under Flux's multi-tenancy
//! lockdown helm-controller acts for a release as its ServiceAccount
//! (`spec.serviceAccountName`, else its `--default-service-account`, in the
//! release's namespace), so a tenant cannot make it reach another namespace's
//! storage; flux-plunger asks the apiserver whether that ServiceAccount could
//! (a LocalSubjectAccessReview of each verb it uses there) before it lists,
//! reads or deletes anything.
//!
//! No review is made where none is needed: storage in the release's own
//! namespace is its tenant's already, storage in a remote cluster is reached
//! with the tenant's own kubeconfig, and a release helm-controller does not
//! impersonate for is installed with helm-controller's own identity, which
//! reaches every namespace.

use k8s_openapi::api::authorization::v1::{
    LocalSubjectAccessReview, ResourceAttributes, SubjectAccessReviewSpec,
};
use kube::Client;
use kube::api::{Api, ObjectMeta, PostParams};

use crate::release::view::ReleaseView;
use crate::storage::view::StorageLocation;

/// The verbs flux-plunger uses on storage Secrets: it lists a release's
/// revisions, reads the one it hands over, deletes the one it reclaims.
const STORAGE_VERBS: [&str; 3] = ["list", "get", "delete"];

/// The ServiceAccount helm-controller acts as for a release.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ActingAccount {
    pub(crate) namespace: String,
    pub(crate) name: String,
}

impl ActingAccount {
    /// The user name the apiserver gives the ServiceAccount.
    pub(crate) fn user(&self) -> String {
        format!("system:serviceaccount:{}:{}", self.namespace, self.name)
    }

    /// The groups the apiserver gives a ServiceAccount it authenticates or
    /// is asked to impersonate without groups (as helm-controller asks).
    pub(crate) fn groups(&self) -> Vec<String> {
        vec![
            "system:serviceaccounts".to_owned(),
            format!("system:serviceaccounts:{}", self.namespace),
            "system:authenticated".to_owned(),
        ]
    }
}

/// Whose access bounds flux-plunger's in a release's storage, if anyone's:
/// the account helm-controller would impersonate, when the storage is in
/// this cluster and in another namespace than the release's.
pub(crate) fn account_to_review(
    release: &ReleaseView,
    location: &StorageLocation,
    default_service_account: Option<&str>,
) -> Option<ActingAccount> {
    if release.has_kube_config || location.namespace == release.namespace {
        return None;
    }
    let name = release
        .spec_service_account_name
        .as_deref()
        .or(default_service_account)?;
    Some(ActingAccount {
        namespace: release.namespace.clone(),
        name: name.to_owned(),
    })
}

/// The review of one verb on the Secrets of `namespace` by `account`.
fn review_of(account: &ActingAccount, namespace: &str, verb: &str) -> LocalSubjectAccessReview {
    LocalSubjectAccessReview {
        metadata: ObjectMeta {
            namespace: Some(namespace.to_owned()),
            ..ObjectMeta::default()
        },
        spec: SubjectAccessReviewSpec {
            user: Some(account.user()),
            groups: Some(account.groups()),
            resource_attributes: Some(ResourceAttributes {
                namespace: Some(namespace.to_owned()),
                group: Some(String::new()),
                resource: Some("secrets".to_owned()),
                verb: Some(verb.to_owned()),
                ..ResourceAttributes::default()
            }),
            ..SubjectAccessReviewSpec::default()
        },
        status: None,
    }
}

/// Asks the apiserver whether `account` may use every verb of
/// [`STORAGE_VERBS`] on the Secrets of `namespace`; `Some(why)` when not.
pub(crate) async fn refusal(
    client: &Client,
    account: &ActingAccount,
    namespace: &str,
) -> kube::Result<Option<String>> {
    let reviews: Api<LocalSubjectAccessReview> = Api::namespaced(client.clone(), namespace);
    for verb in STORAGE_VERBS {
        let answer = reviews
            .create(&PostParams::default(), &review_of(account, namespace, verb))
            .await?;
        if !answer.status.is_some_and(|s| s.allowed) {
            return Ok(Some(format!(
                "its storage is in namespace {namespace}, and ServiceAccount {}/{}, as which helm-controller acts for it, may not {verb} Secrets there",
                account.namespace, account.name
            )));
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn release(namespace: &str) -> ReleaseView {
        ReleaseView {
            namespace: namespace.into(),
            name: "web".into(),
            ..ReleaseView::default()
        }
    }

    fn storage_in(namespace: &str) -> StorageLocation {
        StorageLocation {
            namespace: namespace.into(),
            release_name: "web".into(),
        }
    }

    #[test]
    fn storage_in_the_releases_own_namespace_needs_no_review() {
        let mut r = release("tenant");
        r.spec_service_account_name = Some("deployer".into());
        assert_eq!(account_to_review(&r, &storage_in("tenant"), None), None);
    }

    #[test]
    fn storage_elsewhere_is_reviewed_for_the_releases_service_account() {
        let mut r = release("tenant");
        r.spec_service_account_name = Some("deployer".into());
        assert_eq!(
            account_to_review(&r, &storage_in("prod"), Some("default-sa")),
            Some(ActingAccount {
                namespace: "tenant".into(),
                name: "deployer".into()
            })
        );
    }

    #[test]
    fn without_a_service_account_the_default_helm_controller_uses_is_reviewed() {
        let r = release("tenant");
        assert_eq!(
            account_to_review(&r, &storage_in("prod"), Some("default-sa")),
            Some(ActingAccount {
                namespace: "tenant".into(),
                name: "default-sa".into()
            })
        );
    }

    #[test]
    fn without_any_service_account_helm_controller_acts_as_itself() {
        assert_eq!(
            account_to_review(&release("tenant"), &storage_in("prod"), None),
            None
        );
    }

    #[test]
    fn a_remote_clusters_storage_is_reached_with_the_tenants_own_kubeconfig() {
        let mut r = release("tenant");
        r.has_kube_config = true;
        assert_eq!(
            account_to_review(&r, &storage_in("prod"), Some("default-sa")),
            None
        );
    }

    #[test]
    fn the_review_asks_as_the_apiserver_would_authenticate_the_account() {
        let account = ActingAccount {
            namespace: "tenant".into(),
            name: "deployer".into(),
        };
        let review = review_of(&account, "prod", "delete");
        // The whole review: a local one lives in the namespace it asks about.
        assert_eq!(
            serde_json::to_value(&review).unwrap(),
            serde_json::json!({
                "apiVersion": "authorization.k8s.io/v1",
                "kind": "LocalSubjectAccessReview",
                "metadata": {"namespace": "prod"},
                "spec": {
                    "user": "system:serviceaccount:tenant:deployer",
                    "groups": [
                        "system:serviceaccounts",
                        "system:serviceaccounts:tenant",
                        "system:authenticated",
                    ],
                    "resourceAttributes": {
                        "namespace": "prod", "group": "", "resource": "secrets", "verb": "delete",
                    },
                },
            })
        );
    }
}
