//! One way to read a release's Helm storage, and what its failures are:
//! the client of the cluster it is in (this one, or the remote one of
//! `spec.kubeConfig`), the revisions listed and parsed, for a release being
//! deleted the snapshot its uninstall needs, and how long reading them has
//! failed. What a failure means for the release `decide` says.

use std::time::Instant;

use kube::Client;

use super::Reconciler;
use crate::decide::{self, StorageFacts, UninstallTarget, Unreadable};
use crate::error::{Error, describe, is_access_refused};
use crate::release::view::ReleaseView;
use crate::remote::RemoteError;
use crate::storage::api::{list_storage, read_snapshot};
use crate::storage::reach;
use crate::storage::view::{ListedSecret, StorageLocation, StorageRevision, parse_revisions};

/// Why a release's storage is not reached.
pub(super) enum Unreached {
    /// No client for its remote cluster.
    Remote(RemoteError),
    /// helm-controller, acting for the release, could not reach it: nor
    /// may flux-plunger.
    OutOfReach(String),
    /// Whether helm-controller could was not answered: it may pass.
    ReviewFailed(Error),
}

/// Storage steps of one release that have failed on every try since.
pub(super) struct StorageFailure {
    /// The release's namespace/name: a pass that finds it gone forgets it.
    pub(super) key: String,
    pub(super) since: Instant,
    pub(super) last: String,
}

/// One read of a release's Helm storage.
pub(super) struct StorageRead {
    /// What `decide` is told.
    pub(super) facts: StorageFacts,
    /// The client the storage was read with, to delete a revision with.
    pub(super) client: Option<Client>,
    /// The refused request behind [`Unreadable::KubeconfigMissing`] or
    /// [`Unreadable::AccessRefused`]: the error a recovery retried with
    /// backoff fails with.
    pub(super) refusal: Option<Error>,
}

impl StorageRead {
    fn unreadable(cause: Unreadable, why: String, refusal: Option<Error>) -> Self {
        Self {
            facts: StorageFacts::Unreadable { why, cause },
            client: None,
            refusal,
        }
    }
}

impl Reconciler {
    /// What a release has in its Helm storage: the revisions, and, for a
    /// release being deleted whose helm-controller history is empty, the
    /// snapshot of the revision its uninstall should target. A storage that
    /// cannot be read for a reason a retry alone does not cure (a remote
    /// cluster missing or unusable, out of reach, access refused) is
    /// reported as such, for `decide` to weigh; a failure that may pass is
    /// an error.
    pub(super) async fn read_storage(&self, release: &ReleaseView) -> Result<StorageRead, Error> {
        let location = StorageLocation::of(release);
        let client = match self.storage_client(release, &location).await {
            Ok(client) => client,
            Err(Unreached::Remote(RemoteError::Unreadable(source))) => {
                return Err(Error::ReadKubeconfig {
                    key: release.key(),
                    source,
                });
            }
            Err(Unreached::Remote(RemoteError::Missing(source))) => {
                let why = describe(&source);
                let refusal = Error::ReadKubeconfig {
                    key: release.key(),
                    source,
                };
                return Ok(StorageRead::unreadable(
                    Unreadable::KubeconfigMissing,
                    why,
                    Some(refusal),
                ));
            }
            Err(Unreached::Remote(RemoteError::Unusable(why))) => {
                return Ok(StorageRead::unreadable(
                    Unreadable::RemoteClusterUnusable,
                    why,
                    None,
                ));
            }
            Err(Unreached::OutOfReach(why)) => {
                return Ok(StorageRead::unreadable(Unreadable::OutOfReach, why, None));
            }
            Err(Unreached::ReviewFailed(err)) => return Err(err),
        };
        let secrets = match list_storage(&client, &location).await {
            Ok(secrets) => secrets,
            Err(source) => {
                let listing = format!("listing namespace {}", location.namespace);
                return unreadable_if_refused(source, listing, |source| Error::ListStorage {
                    key: release.key(),
                    namespace: location.namespace.clone(),
                    source,
                });
            }
        };
        let revisions = revisions_of(release, &location, &secrets);
        let snapshot = match decide::uninstall_target(&revisions) {
            UninstallTarget::Revision(target) if release.terminating && !release.has_history => {
                match read_snapshot(&client, target, &location.release_name).await {
                    Ok(snapshot) => Some(snapshot.map(Box::new)),
                    // Refused like the list: the identity may list and
                    // delete but not get (docs/operating.md names all three).
                    Err(source) => {
                        let reading = format!("reading {}/{}", target.namespace, target.name);
                        return unreadable_if_refused(source, reading, |source| {
                            Error::ReadStorage {
                                namespace: target.namespace.clone(),
                                name: target.name.clone(),
                                source,
                            }
                        });
                    }
                }
            }
            _ => None,
        };
        Ok(StorageRead {
            facts: StorageFacts::Listed {
                revisions,
                snapshot,
            },
            client: Some(client),
            refusal: None,
        })
    }

    /// Notes that the storage read of `release` failed (the first failure
    /// starts the count of [`decide::storage_given_up`]).
    pub(super) fn storage_failed(&self, release: &ReleaseView, err: &Error) {
        let mut failures = self
            .storage_failures
            .lock()
            .expect("storage failure map poisoned");
        let failure = failures
            .entry(release.uid.clone())
            .or_insert_with(|| StorageFailure {
                key: release.key(),
                since: Instant::now(),
                last: String::new(),
            });
        failure.last = err.to_string();
    }

    /// Notes that the storage read of `release` succeeded: a later failure
    /// counts afresh.
    pub(super) fn storage_succeeded(&self, release: &ReleaseView) {
        self.storage_failures
            .lock()
            .expect("storage failure map poisoned")
            .remove(&release.uid);
    }

    /// Forgets the storage failures of a release found gone: nothing else
    /// would, as no read of its storage will succeed again.
    pub(super) fn storage_gone(&self, namespace: &str, name: &str) {
        let key = format!("{namespace}/{name}");
        self.storage_failures
            .lock()
            .expect("storage failure map poisoned")
            .retain(|_, failure| failure.key != key);
    }

    /// How many releases' storage failures are remembered (each only while
    /// its storage fails and the release is there).
    pub fn remembered_storage_failures(&self) -> usize {
        self.storage_failures
            .lock()
            .expect("storage failure map poisoned")
            .len()
    }

    /// A client of the cluster the release is installed in (and its storage
    /// is): this one, or the remote one of `spec.kubeConfig`; why not, when
    /// that cannot be used or read, or when helm-controller, acting for the
    /// release, could not reach the storage there either.
    pub(super) async fn storage_client(
        &self,
        release: &ReleaseView,
        location: &StorageLocation,
    ) -> Result<Client, Unreached> {
        if release.has_kube_config {
            return crate::remote::storage_client(&self.client, release)
                .await
                .map_err(Unreached::Remote);
        }
        let default = self.controls.default_service_account.as_deref();
        if let Some(account) = reach::account_to_review(release, location, default) {
            match reach::refusal(&self.client, &account, &location.namespace).await {
                Ok(None) => {}
                Ok(Some(why)) => return Err(Unreached::OutOfReach(why)),
                Err(source) => {
                    return Err(Unreached::ReviewFailed(Error::ReviewStorageAccess {
                        key: release.key(),
                        namespace: location.namespace.clone(),
                        source,
                    }));
                }
            }
        }
        Ok(self.client.clone())
    }
}

/// A storage request that failed: refused, the storage is unreadable (with
/// the error a recovery retries with); any other failure may pass, and is
/// the error.
fn unreadable_if_refused(
    source: kube::Error,
    request: String,
    error: impl FnOnce(kube::Error) -> Error,
) -> Result<StorageRead, Error> {
    let refused = is_access_refused(&source);
    let why = format!("{request}: {source}");
    let err = error(source);
    if !refused {
        return Err(err);
    }
    Ok(StorageRead::unreadable(
        Unreadable::AccessRefused,
        why,
        Some(err),
    ))
}

/// The storage revisions among the Secrets listed at `location`; a Secret
/// that is not a well-formed revision is logged and left out.
pub(super) fn revisions_of(
    release: &ReleaseView,
    location: &StorageLocation,
    secrets: &[ListedSecret],
) -> Vec<StorageRevision> {
    let (revisions, ignored) = parse_revisions(secrets, location);
    for secret in &ignored {
        tracing::warn!(release = %release.key(), secret = %secret.name, why = %secret.why, "ignoring a Secret that is not a well-formed Helm storage revision");
    }
    revisions
}
