//! SPEC §4, in the order it runs, from the plan `decide` made of the
//! storage listed: acquire (the suspension and the fence, locked on the read
//! that planned), reclaim (the revision recorded, its Secret deleted),
//! finish (both given up); then a recovery that waits for its turn, fenced
//! meanwhile, and a stuck release with nothing to reclaim.

use kube::Client;

use super::storage::StorageRead;
use super::{Outcome, Pass, Reconciler};
use crate::apply::{self, Claim};
use crate::decide::{self, MayAcquire, Recovery, SkipReason, may_take_suspension};
use crate::error::{Error, is_api_code};
use crate::notices::{self, AfterRecovery, EventSpec};
use crate::release::view::ReleaseView;
use crate::storage::api::delete_revision;
use crate::storage::view::{StorageLocation, StorageRevision};
use crate::test_hooks::Step;

/// How many 409s a step taken under our suspension reads through before it
/// gives up (and the recovery is undone and retried).
const MAX_CONFLICTS_WHILE_ACQUIRED: u32 = 5;

impl Reconciler {
    /// SPEC §4 steps 8-13, as `decide` planned them from `storage`: start
    /// the recovery, wait for its turn, or fail the pass for a retry.
    pub(super) async fn recover(
        &self,
        release: ReleaseView,
        recovery: Recovery,
        storage: Option<StorageRead>,
    ) -> Result<Pass, Error> {
        match recovery {
            Recovery::Start { target, below_uid } => {
                // Decided only from a listed storage, read with this client.
                let Some(client) = storage.and_then(|read| read.client) else {
                    return Ok(Outcome::NothingToDo.into());
                };
                self.start(release, &target, below_uid.as_deref(), &client)
                    .await
            }
            Recovery::WaitForTurn { retry_after, fence } => {
                tracing::info!(release = %release.key(), ?retry_after, "recovery rate limit reached; waiting");
                let fenced = if fence {
                    self.fence_while_waiting(&release).await?
                } else {
                    None
                };
                Ok(Pass {
                    outcome: Outcome::RateLimited { retry_after },
                    handled: fenced.into_iter().collect(),
                })
            }
            Recovery::Retry { event } => {
                if let Some(event) = event {
                    self.events.record(&release, &event).await;
                }
                match storage.and_then(|read| read.refusal) {
                    Some(refusal) => Err(refusal),
                    None => Ok(Outcome::NothingToDo.into()),
                }
            }
        }
    }

    /// SPEC §4 steps 8-13: acquire, reclaim `target`, finish.
    async fn start(
        &self,
        release: ReleaseView,
        target: &StorageRevision,
        below_uid: Option<&str>,
        storage_client: &Client,
    ) -> Result<Pass, Error> {
        self.pause_at_step(Step::Planned).await;

        let acquired = match self.acquire(&release).await? {
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

        match self
            .reclaim(acquired, target, below_uid, storage_client)
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

    /// SPEC §4 steps 10-13, under the suspension and fence acquired.
    async fn reclaim(
        &self,
        acquired: ReleaseView,
        target: &StorageRevision,
        below_uid: Option<&str>,
        storage_client: &Client,
    ) -> Result<Pass, Error> {
        self.pause_at_step(Step::Acquired).await;
        let acquired_at = acquired.resource_version.clone();
        let mut current = acquired;
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
            if is_api_code(&source, 409) && conflicts < MAX_CONFLICTS_WHILE_ACQUIRED {
                conflicts += 1;
                if let Some(again) = self.read(&current.namespace, &current.name).await?
                    && decide::still_acquired(&again, &current.uid)
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
                Err(err) if err.is_stale_write() && conflicts < MAX_CONFLICTS_WHILE_ACQUIRED => {
                    conflicts += 1;
                    let Some(again) = self.read(&release.namespace, &release.name).await? else {
                        return Ok(None);
                    };
                    if !decide::still_acquired(&again, &release.uid) {
                        let decided = self.decide_now(&again, false).await?;
                        let (_, last_seen) = self.act(&again, decided.decision).await?;
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
    /// wait for: the fence it carried while it waited goes when `drop_fence`.
    pub(super) async fn skip(
        &self,
        release: &ReleaseView,
        reason: SkipReason,
        event: Option<EventSpec>,
        drop_fence: bool,
    ) -> Result<(Outcome, ReleaseView), Error> {
        if let Some(event) = event {
            self.events.record(release, &event).await;
        }
        if reason.found_in_the_storage() {
            let storage = StorageLocation::of(release);
            tracing::info!(release = %release.key(), ?reason, ?storage, "stuck, but nothing to reclaim");
        }
        let mut left = release.clone();
        if drop_fence {
            left = self.drop_fence(release).await?;
            tracing::info!(release = %release.key(), "dropped the fence of a stuck release with nothing to reclaim");
        }
        Ok((Outcome::Skipped(reason), left))
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
