//! SPEC §4, in the order it runs: plan (the storage listed, the revision to
//! reclaim chosen), acquire (the suspension and the fence, locked on the
//! read that planned), reclaim (the revision recorded, its Secret deleted),
//! finish (both given up); then a recovery that must wait, fenced meanwhile.

use kube::Client;

use super::storage::{self, Unreached};
use super::{Outcome, Pass, Reconciler};
use crate::apply::{self, Claim};
use crate::decide::{
    self, MayAcquire, RecoveryPlan, SkipReason, may_take_suspension, plan_recovery,
};
use crate::error::{Error, describe, is_api_code};
use crate::notices::{self, AfterRecovery};
use crate::release::view::ReleaseView;
use crate::remote::RemoteError;
use crate::storage::api::{delete_revision, list_storage};
use crate::storage::view::{StorageLocation, StorageRevision};
use crate::test_hooks::Step;

/// How many 409s a step taken under our suspension reads through before it
/// gives up (and the recovery is undone and retried).
const MAX_CONFLICTS_WHILE_HELD: u32 = 5;

impl Reconciler {
    /// SPEC §4 steps 6-13.
    pub(super) async fn recover(&self, release: ReleaseView) -> Result<Pass, Error> {
        // The storage is in the cluster the release is installed in.
        let location = StorageLocation::of(&release);
        let storage_client = match self.storage_client(&release, &location).await {
            Ok(client) => client,
            Err(Unreached::Remote(RemoteError::Unreadable(source))) => {
                return Err(Error::ReadKubeconfig {
                    key: release.key(),
                    source,
                });
            }
            Err(Unreached::Remote(RemoteError::Missing(source))) => {
                let event = notices::remote_kubeconfig_missing(&release, &describe(&source));
                self.events.record(&release, &event).await;
                return Err(Error::ReadKubeconfig {
                    key: release.key(),
                    source,
                });
            }
            Err(Unreached::Remote(RemoteError::Unusable(why))) => {
                let event = notices::remote_cluster_unusable(&release, &why);
                self.events.record(&release, &event).await;
                self.give_up_waiting(&release).await?;
                return Ok(Outcome::Skipped(SkipReason::RemoteClusterUnusable { why }).into());
            }
            Err(Unreached::OutOfReach(why)) => {
                let event = notices::storage_out_of_reach(&release, &why);
                self.events.record(&release, &event).await;
                self.give_up_waiting(&release).await?;
                return Ok(Outcome::Skipped(SkipReason::StorageOutOfReach { why }).into());
            }
            Err(Unreached::ReviewFailed(err)) => return Err(err),
        };
        let secrets = list_storage(&storage_client, &location)
            .await
            .map_err(|source| Error::ListStorage {
                key: release.key(),
                namespace: location.namespace.clone(),
                source,
            })?;
        let revisions = storage::revisions_of(&release, &location, &secrets);
        let target = match plan_recovery(&release, &revisions) {
            RecoveryPlan::Reclaim(target) => target,
            RecoveryPlan::Skip(reason) => {
                tracing::info!(release = %release.key(), ?reason, storage = ?location, "stuck, but nothing to reclaim");
                self.give_up_waiting(&release).await?;
                return Ok(Outcome::Skipped(reason).into());
            }
        };

        if self.controls.dry_run {
            let would = format!(
                "suspend {} with the uninstall fence, annotate revision {}, delete Helm storage Secret {}/{} (status {:?}), then lift the suspension and the fence",
                release.key(),
                target.revision,
                target.namespace,
                target.name,
                target.status
            );
            let event = notices::recovery_dry_run(&would);
            self.events.record(&release, &event).await;
            return Ok(Outcome::DryRun { would }.into());
        }
        if let Some(limiter) = &self.controls.rate_limit
            && let Err(retry_after) = limiter.try_take(&release.uid)
        {
            tracing::info!(release = %release.key(), ?retry_after, "recovery rate limit reached; waiting");
            let fenced = self.fence_while_waiting(&release).await?;
            return Ok(Pass {
                outcome: Outcome::RateLimited { retry_after },
                handled: fenced.into_iter().collect(),
            });
        }
        self.pause_at_step(Step::Planned).await;

        let held = match self.acquire(&release).await? {
            Acquisition::Acquired(acquired) => *acquired,
            Acquisition::NoLongerStuck => {
                tracing::info!(release = %release.key(), "no longer stuck when read again before the recovery; nothing reclaimed");
                return Ok(Outcome::Skipped(SkipReason::NoLongerStuck).into());
            }
            Acquisition::NotOurs => {
                let event = notices::recovery_deferred(&release);
                self.events.record(&release, &event).await;
                return Ok(Outcome::Deferred.into());
            }
        };
        tracing::info!(release = %release.key(), revision = target.revision, secret = %target.name, "suspended with the uninstall fence to reclaim the newest storage revision");

        let below_uid = decide::revision_below(&revisions, &target).map(|r| r.uid.clone());
        match self
            .reclaim(held, &target, below_uid.as_deref(), &storage_client)
            .await
        {
            Ok(pass) => Ok(pass),
            Err(err) => {
                // Step 9: an early exit never leaves our suspension behind.
                match self.settle(&release.namespace, &release.name).await {
                    // A delete refused the step, and the undo handed the
                    // release to helm-controller's uninstall: that is what
                    // this pass did (helm-controller's answer wakes the next).
                    Ok(handed @ Outcome::HandedOver { .. }) => Ok(handed.into()),
                    Ok(_) => Err(err),
                    Err(undo) => {
                        tracing::warn!(release = %release.key(), error = %undo, "could not lift the suspension after a failed recovery step; the retry will");
                        Err(err)
                    }
                }
            }
        }
    }

    /// SPEC §4.8: takes the suspension and the fence together, locked on the
    /// read that planned the recovery: a release unchanged since is still
    /// live, unsuspended and stuck, and one changed since refuses the apply
    /// (409) and is read again before anything is forced.
    async fn acquire(&self, planned: &ReleaseView) -> Result<Acquisition, Error> {
        let claim = self.acquire_claim();
        if let Some(refused) = refusal(planned) {
            return Ok(refused);
        }
        let acquire_error = |source| Error::Acquire {
            key: planned.key(),
            source,
        };
        self.pause_at_step(Step::BeforeAcquire).await;
        match self.apply(planned, claim, false).await {
            Ok(object) => return Ok(Acquisition::Acquired(Box::new(self.view(&object)))),
            Err(err) if is_api_code(&err, 409) => {}
            Err(err) => return Err(acquire_error(err)),
        }
        let Some(again) = self.read(&planned.namespace, &planned.name).await? else {
            return Ok(Acquisition::NotOurs);
        };
        if let Some(refused) = refusal(&again) {
            return Ok(refused);
        }
        self.pause_at_step(Step::BeforeForcedAcquire).await;
        match self.apply(&again, claim, true).await {
            Ok(object) => Ok(Acquisition::Acquired(Box::new(self.view(&object)))),
            // What the release is now decides, not the 409: somebody's
            // suspension or a delete defers (their end wakes the watch); a
            // release still live, unsuspended and stuck is a raced write,
            // retried after its backoff, since a change that left nothing of
            // interest, or a conflict nothing wrote, may wake nothing.
            Err(err) if is_api_code(&err, 409) => {
                match self.read(&planned.namespace, &planned.name).await? {
                    None => Ok(Acquisition::NotOurs),
                    Some(now) => refusal(&now).ok_or_else(|| acquire_error(err)),
                }
            }
            Err(err) => Err(acquire_error(err)),
        }
    }

    /// SPEC §4 steps 10-13, holding the suspension.
    async fn reclaim(
        &self,
        held: ReleaseView,
        target: &StorageRevision,
        below_uid: Option<&str>,
        storage_client: &Client,
    ) -> Result<Pass, Error> {
        self.pause_at_step(Step::Acquired).await;
        let acquired_at = held.resource_version.clone();
        let mut current = held;
        let mut conflicts = 0;
        let annotated = loop {
            let source =
                match apply::annotate(&self.client, &current, target.revision, below_uid).await {
                    Ok(object) => break self.view(&object),
                    Err(source) => source,
                };
            // helm-controller writes status right after each suspension, so the
            // annotation's lock often meets a newer resourceVersion. While the
            // release is the same, live, and still under our suspension and
            // fence, read it again and carry on instead of undoing everything.
            if is_api_code(&source, 409) && conflicts < MAX_CONFLICTS_WHILE_HELD {
                conflicts += 1;
                if let Some(again) = self.read(&current.namespace, &current.name).await?
                    && decide::still_held(&again, &current.uid)
                {
                    current = again;
                    continue;
                }
            }
            return Err(Error::Annotate {
                key: current.key(),
                source,
            });
        };
        self.pause_at_step(Step::Annotated).await;

        // §4.11: the annotation was locked on a live read, so a delete that
        // landed before it refused it (and the undo above keeps the
        // fence); its answer is the release right before the Secret delete.
        let release = annotated;
        self.delete_storage_revision(storage_client, target).await?;
        tracing::info!(release = %release.key(), secret = %target.name, "deleted the newest storage revision");
        let last_seen = self.finish(release.clone()).await?;
        let after = decide::after_recovery(last_seen.as_ref());
        self.events
            .record(&release, &notices::recovered(&release, target, after))
            .await;
        let outcome = match after {
            AfterRecovery::BeingDeleted { fenced: true } => Outcome::RecoveredThenDeleted {
                revision: target.revision,
                recheck: self.timings.fence_recheck_interval,
            },
            _ => Outcome::Recovered {
                revision: target.revision,
            },
        };
        let handled = [
            Some(acquired_at),
            Some(release.resource_version),
            last_seen.map(|r| r.resource_version),
        ];
        Ok(Pass {
            outcome,
            handled: handled.into_iter().flatten().collect(),
        })
    }

    /// Deletes exactly the revision listed (its uid and resourceVersion).
    async fn delete_storage_revision(
        &self,
        client: &Client,
        revision: &StorageRevision,
    ) -> Result<(), Error> {
        let write = async {
            match delete_revision(client, revision).await {
                // Already gone: whoever deleted it did what we meant to.
                Err(err) if is_api_code(&err, 404) => Ok(()),
                deleted => deleted,
            }
        };
        self.write_between((Step::BeforeDeleteStorage, Step::AfterDeleteStorage), write)
            .await
            .map_err(|source| Error::DeleteStorage {
                namespace: revision.namespace.clone(),
                name: revision.name.clone(),
                source,
            })
    }

    /// SPEC §4.13: gives up the suspension and the fence together. A 409
    /// (helm-controller's status write) is met by reading again: while the
    /// suspension is still ours on the live release, the lift is sent again;
    /// if a delete came meanwhile, §5 decides (the fence stays).
    /// Returns the release as the last write left it (or as last read, when
    /// there was nothing left to write), `None` once it is gone.
    async fn finish(&self, mut release: ReleaseView) -> Result<Option<ReleaseView>, Error> {
        let mut conflicts = 0;
        loop {
            match self.lift(&release, false).await {
                Ok(written) => return Ok(Some(written)),
                Err(err) if err.is_stale_write() && conflicts < MAX_CONFLICTS_WHILE_HELD => {
                    conflicts += 1;
                    let Some(again) = self.read(&release.namespace, &release.name).await? else {
                        return Ok(None);
                    };
                    if !decide::still_held(&again, &release.uid) {
                        let decision = self.decide_now(&again).await?;
                        let (_, last_seen) = self.act(&again, decision).await?;
                        return Ok(Some(last_seen));
                    }
                    release = again;
                }
                Err(err) => return Err(err),
            }
        }
    }

    /// SPEC §4.5: a stuck release whose recovery must wait carries the fence
    /// meanwhile, so that a delete landing before the recovery is held for
    /// the uninstall hand-over of §5d (helm-controller's own deletion path
    /// finds the history it cleared empty and would let the release go).
    /// The resourceVersion its fence write left, when it wrote one.
    async fn fence_while_waiting(&self, release: &ReleaseView) -> Result<Option<String>, Error> {
        if release.has_fence() || self.controls.dry_run {
            return Ok(None);
        }
        let written = self
            .apply(release, Claim::FENCE_ONLY, false)
            .await
            .map_err(|source| Error::FenceWhileWaiting {
                key: release.key(),
                source,
            })?;
        tracing::info!(release = %release.key(), "fenced the stuck release while its recovery waits");
        Ok(written.metadata.resource_version)
    }

    /// SPEC §4.5: a stuck release with nothing to reclaim has no recovery to
    /// wait for: the fence it carried while it waited goes.
    async fn give_up_waiting(&self, release: &ReleaseView) -> Result<(), Error> {
        if release.has_fence() && !self.controls.dry_run {
            self.drop_fence(release).await?;
            tracing::info!(release = %release.key(), "dropped the fence of a stuck release with nothing to reclaim");
        }
        Ok(())
    }

    fn acquire_claim(&self) -> Claim {
        #[cfg(feature = "test-hooks")]
        if self.hooks.unfenced {
            return Claim {
                suspend: true,
                fence: false,
            };
        }
        Claim::SUSPEND_AND_FENCE
    }
}

/// What the acquire came to.
enum Acquisition {
    /// Our suspension and fence are on the release, as this view shows.
    Acquired(Box<ReleaseView>),
    /// Deleted or suspended meanwhile.
    NotOurs,
    /// No longer stuck when read again.
    NoLongerStuck,
}

/// Why the suspension may not be taken from the release as read, if it may
/// not (SPEC §4.8).
fn refusal(release: &ReleaseView) -> Option<Acquisition> {
    match may_take_suspension(release) {
        MayAcquire::Take => None,
        MayAcquire::NotOurs => Some(Acquisition::NotOurs),
        MayAcquire::NoLongerStuck => Some(Acquisition::NoLongerStuck),
    }
}
