//! One way to read a release's Helm storage, and what its failures mean:
//! the client of the cluster it is in (this one, or the remote one of
//! `spec.kubeConfig`), the revisions listed and parsed, and for a release
//! being deleted the facts `decide` needs, with how long reading them has
//! failed.

use std::time::Instant;

use kube::Client;

use super::Reconciler;
use crate::decide::{self, StorageFacts, UninstallTarget};
use crate::error::Error;
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
    pub(super) since: Instant,
    pub(super) last: String,
}

impl Reconciler {
    /// What a release being deleted has in its Helm storage: the revisions,
    /// and, when helm-controller's history is empty, the snapshot of the
    /// revision its uninstall should target. A storage that cannot be read
    /// for good (a remote cluster that cannot be used, access refused) is
    /// reported as such; a failure that may pass is an error, retried.
    pub(super) async fn storage_facts(&self, release: &ReleaseView) -> Result<StorageFacts, Error> {
        let location = StorageLocation::of(release);
        let client = match self.storage_client(release, &location).await {
            Ok(client) => client,
            // The kubeconfig Secret could not be read: it may pass.
            Err(Unreached::Remote(RemoteError::Unreadable(source))) => {
                return Err(Error::ReadKubeconfig {
                    key: release.key(),
                    source,
                });
            }
            // Missing: helm-controller's own deletion path skips the
            // uninstall then, so nothing reads this storage for it either.
            Err(Unreached::Remote(RemoteError::Missing(err))) => {
                return Ok(StorageFacts::Unreadable {
                    why: crate::error::describe(&err),
                });
            }
            Err(Unreached::Remote(RemoteError::Unusable(why)) | Unreached::OutOfReach(why)) => {
                return Ok(StorageFacts::Unreadable { why });
            }
            Err(Unreached::ReviewFailed(err)) => return Err(err),
        };
        let secrets = match list_storage(&client, &location).await {
            Ok(secrets) => secrets,
            Err(err) if crate::error::is_access_refused(&err) => {
                return Ok(StorageFacts::Unreadable {
                    why: format!("listing namespace {}: {err}", location.namespace),
                });
            }
            Err(source) => {
                return Err(Error::ListStorage {
                    key: release.key(),
                    namespace: location.namespace.clone(),
                    source,
                });
            }
        };
        let revisions = revisions_of(release, &location, &secrets);
        let snapshot = match decide::uninstall_target(&revisions) {
            UninstallTarget::Revision(target) if !release.has_history => {
                match read_snapshot(&client, target, &location.release_name).await {
                    Ok(snapshot) => Some(snapshot.map(Box::new)),
                    // Refused like the list: the identity may list and
                    // delete but not get (docs/operating.md names all three).
                    Err(err) if crate::error::is_access_refused(&err) => {
                        return Ok(StorageFacts::Unreadable {
                            why: format!("reading {}/{}: {err}", target.namespace, target.name),
                        });
                    }
                    Err(source) => {
                        return Err(Error::ReadStorage {
                            namespace: target.namespace.clone(),
                            name: target.name.clone(),
                            source,
                        });
                    }
                }
            }
            _ => None,
        };
        Ok(StorageFacts::Listed {
            revisions,
            snapshot,
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

    /// Why the storage read of `release` was given up.
    pub(super) fn storage_failure_reason(&self, release: &ReleaseView) -> String {
        let failures = self
            .storage_failures
            .lock()
            .expect("storage failure map poisoned");
        let last = failures
            .get(&release.uid)
            .map_or("", |failure| failure.last.as_str());
        format!(
            "reading its storage failed on every try for {}s: {last}",
            self.timings.fence_held_warning_after.as_secs()
        )
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
