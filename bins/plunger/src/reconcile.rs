//! Carries out the decisions of `decide` against the apiserver (SPEC §4-§5).
//!
//! Every read that decides a write goes to the apiserver; every write is the
//! one primitive of `apply`, preconditioned on the read that decided it.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use kube::Client;
use kube::api::DynamicObject;

use crate::apply::{self, Claim};
use crate::decide::{
    self, AfterHandOver, Clock, Decision, EventSpec, RecoveryPlan, SkipReason, StorageFacts,
    UninstallTarget, may_delete_storage, may_take_suspension, plan_recovery,
};
use crate::error::{Error, is_api_code};
use crate::events::Events;
use crate::names::reasons;
use crate::release::{ReleaseView, helmreleases};
use crate::storage::{self, StorageLocation, StorageRevision};
use crate::timings::Timings;

/// How one reconcile ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The release no longer exists.
    Gone,
    /// Nothing to write.
    NothingToDo,
    /// Suspended (or suspended and deleted) by another manager: left alone.
    LeftAlone,
    /// Our suspension was given up, the fence with it unless a delete waits.
    Lifted { kept_fence: bool },
    /// Our fence was given up.
    FenceDropped,
    /// A delete waits for helm-controller's uninstall; look again after this.
    FenceHeld { recheck: Duration },
    /// Stuck, but the storage holds nothing we may reclaim.
    Skipped(SkipReason),
    /// The suspension could not be taken (someone else wrote first).
    Deferred,
    /// The release was deleted during the recovery: the Secret was kept.
    AbortedForDelete { revision: u64 },
    /// The revision was reclaimed and the release let go.
    Recovered { revision: u64 },
    /// `--dry-run`: what would have been written, reported, nothing written.
    DryRun { would: String },
    /// `--max-recoveries-per-minute` is used up: try again after this.
    RateLimited { retry_after: Duration },
    /// A release being deleted was handed to helm-controller's uninstall:
    /// this revision written to its history (then our suspension lifted, or
    /// a reconcile requested).
    HandedOver { revision: u64 },
    /// An `uninstalled` newest revision above live ones was deleted, so that
    /// the uninstall targets the live one: decide again at once.
    ReclaimedUninstalled { revision: u64 },
    /// helm-controller was asked to reconcile the release being deleted.
    ReconcileRequested,
    /// The fence was let go though nothing could uninstall the release.
    ReleasedWithoutUninstall,
}

/// The operator's controls of what a reconcile may do.
#[derive(Default)]
pub struct Controls {
    /// Decide and report, write nothing to releases or Secrets.
    pub dry_run: bool,
    /// At most this many recoveries start per minute.
    pub rate_limit: Option<crate::ratelimit::RateLimiter>,
}

/// Points inside a recovery where a test can act (a delete, a foreign
/// write, a crash): one right before and one right after every write of
/// SPEC §4 and §5. `test_hooks` pauses a test build of a binary at them by
/// name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// The release was read fresh; the unforced acquire comes next.
    BeforeAcquire,
    /// The unforced acquire conflicted and the release was read again; the
    /// forced acquire comes next.
    BeforeForcedAcquire,
    /// The suspension and fence are held (right after the acquire, forced or
    /// not); the annotation comes next.
    Acquired,
    /// The annotation is written; the termination re-check comes next.
    Annotated,
    /// A storage Secret's delete comes next: in a recovery, once the
    /// re-check found the release live; on a release being deleted, an
    /// `uninstalled` newest revision above live ones.
    BeforeDeleteStorage,
    /// The storage Secret is deleted (or was already gone).
    AfterDeleteStorage,
    /// A lift of our suspension or fence is about to be sent.
    BeforeLift,
    /// A lift was accepted.
    AfterLift,
    /// The drop of our fence (no suspension of ours left) is about to be sent.
    BeforeDropFence,
    /// The drop of our fence was accepted.
    AfterDropFence,
    /// The history of a release being deleted is about to be written.
    BeforeHistoryWrite,
    /// The history was written; the lift or the reconcile request comes next.
    AfterHistoryWrite,
    /// The reconcile request is about to be written.
    BeforeReconcileRequest,
    /// The reconcile request was written.
    AfterReconcileRequest,
}

impl Step {
    /// Every step, in the order a recovery (then a delete) meets them.
    pub const ALL: [Step; 14] = [
        Step::BeforeAcquire,
        Step::BeforeForcedAcquire,
        Step::Acquired,
        Step::Annotated,
        Step::BeforeDeleteStorage,
        Step::AfterDeleteStorage,
        Step::BeforeLift,
        Step::AfterLift,
        Step::BeforeDropFence,
        Step::AfterDropFence,
        Step::BeforeHistoryWrite,
        Step::AfterHistoryWrite,
        Step::BeforeReconcileRequest,
        Step::AfterReconcileRequest,
    ];

    /// The name `FLUX_PLUNGER_TEST_PAUSE_AT` knows it by.
    pub fn name(self) -> &'static str {
        match self {
            Step::BeforeAcquire => "before-acquire",
            Step::BeforeForcedAcquire => "before-forced-acquire",
            Step::Acquired => "acquired",
            Step::Annotated => "annotated",
            Step::BeforeDeleteStorage => "before-delete-storage",
            Step::AfterDeleteStorage => "after-delete-storage",
            Step::BeforeLift => "before-lift",
            Step::AfterLift => "after-lift",
            Step::BeforeDropFence => "before-drop-fence",
            Step::AfterDropFence => "after-drop-fence",
            Step::BeforeHistoryWrite => "before-history-write",
            Step::AfterHistoryWrite => "after-history-write",
            Step::BeforeReconcileRequest => "before-reconcile-request",
            Step::AfterReconcileRequest => "after-reconcile-request",
        }
    }
}

/// Test-only switches: a pause at each [`Step`], and the fence turned off so
/// that a test can show the orphaning the fence prevents.
#[cfg(feature = "test-hooks")]
#[derive(Default, Clone)]
pub struct TestHooks {
    pub unfenced: bool,
    #[allow(clippy::type_complexity)]
    pub pause: Option<
        std::sync::Arc<dyn Fn(Step) -> futures::future::BoxFuture<'static, ()> + Send + Sync>,
    >,
}

/// How many 409s a step taken under our suspension reads through before it
/// gives up (and the recovery is undone and retried).
const MAX_CONFLICTS_WHILE_HELD: u32 = 5;

/// Everything a reconcile needs.
pub struct Reconciler {
    client: Client,
    events: Events,
    timings: Timings,
    /// When we last warned that a release's delete is held, by uid: one
    /// warning per release per re-check interval, however often it is woken.
    fence_warnings: Mutex<HashMap<String, Instant>>,
    /// The resourceVersions our writes left each release at, by uid, for
    /// [`Self::take_writes`].
    writes: Mutex<HashMap<String, Vec<String>>>,
    controls: Controls,
    #[cfg(feature = "test-hooks")]
    pub hooks: TestHooks,
}

impl Reconciler {
    pub fn new(client: Client, events: Events, timings: Timings) -> Self {
        Self {
            client,
            events,
            timings,
            fence_warnings: Mutex::new(HashMap::new()),
            writes: Mutex::new(HashMap::new()),
            controls: Controls::default(),
            #[cfg(feature = "test-hooks")]
            hooks: TestHooks::default(),
        }
    }

    /// Test builds only: the hooks `test_hooks::hooks_from_env` reads; a
    /// no-op in any other build.
    pub fn with_test_hooks_from_env(self) -> Self {
        #[cfg(feature = "test-hooks")]
        {
            let mut this = self;
            this.hooks = crate::test_hooks::hooks_from_env();
            this
        }
        #[cfg(not(feature = "test-hooks"))]
        self
    }

    /// The same reconciler under the operator's controls.
    pub fn with_controls(mut self, controls: Controls) -> Self {
        self.controls = controls;
        self
    }

    /// One pass over one release (SPEC §4, §5).
    pub async fn reconcile(&self, namespace: &str, name: &str) -> Result<Outcome, Error> {
        let Some(release) = self.read(namespace, name).await? else {
            return Ok(Outcome::Gone);
        };
        match self.decide_now(&release).await? {
            Decision::InspectStorage => self.recover(release).await,
            decision => self.carry_out(&release, decision).await,
        }
    }

    /// Reads the release again and puts right whatever of ours it carries,
    /// without ever starting a recovery: the undo after a failed step, and
    /// the drain's handling of one release.
    pub async fn settle(&self, namespace: &str, name: &str) -> Result<Outcome, Error> {
        let Some(release) = self.read(namespace, name).await? else {
            return Ok(Outcome::Gone);
        };
        let decision = self.decide_now(&release).await?;
        self.carry_out(&release, decision).await
    }

    /// `decide`, reading the Helm storage when the decision depends on it.
    async fn decide_now(&self, release: &ReleaseView) -> Result<Decision, Error> {
        let clock = self.clock(release);
        match decide::decide(release, &clock) {
            Decision::ReadStorage => {
                let facts = self.storage_facts(release).await?;
                Ok(decide::decide_with_storage(release, &facts, &clock))
            }
            decision => Ok(decision),
        }
    }

    /// What a release being deleted has in its Helm storage: the revisions,
    /// and, when helm-controller's history is empty, the snapshot of the
    /// revision its uninstall should target. A storage that cannot be read
    /// for good (a remote cluster that cannot be used, access refused) is
    /// reported as such; a failure that may pass is an error, retried.
    async fn storage_facts(&self, release: &ReleaseView) -> Result<StorageFacts, Error> {
        let client = match self.storage_client(release).await {
            Ok(client) => client,
            Err(why) => return Ok(StorageFacts::Unreadable { why }),
        };
        let location = StorageLocation::of(release);
        let secrets = match storage::list_storage(&client, &location).await {
            Ok(secrets) => secrets,
            Err(err) if is_api_code(&err, 401) || is_api_code(&err, 403) => {
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
        let (revisions, ignored) = storage::parse_revisions(&secrets, &location);
        for secret in &ignored {
            tracing::warn!(release = %release.key(), secret = %secret.name, why = %secret.why, "ignoring a Secret that is not a well-formed Helm storage revision");
        }
        let snapshot = match decide::uninstall_target(&revisions) {
            UninstallTarget::Revision(target) if !release.has_history => Some(
                storage::read_snapshot(&client, target, &location.release_name)
                    .await
                    .map_err(|source| Error::ReadStorage {
                        namespace: target.namespace.clone(),
                        name: target.name.clone(),
                        source,
                    })?
                    .map(Box::new),
            ),
            _ => None,
        };
        Ok(StorageFacts::Listed {
            revisions,
            snapshot,
        })
    }

    /// A client of the cluster the release is installed in (and its storage
    /// is): this one, or the remote one of `spec.kubeConfig`; why not, when
    /// that cannot be used.
    async fn storage_client(&self, release: &ReleaseView) -> Result<Client, String> {
        if release.has_kube_config {
            crate::remote::storage_client(&self.client, release).await
        } else {
            Ok(self.client.clone())
        }
    }

    async fn read(&self, namespace: &str, name: &str) -> Result<Option<ReleaseView>, Error> {
        let object = helmreleases(self.client.clone(), namespace)
            .get_opt(name)
            .await
            .map_err(|source| Error::ReadRelease {
                key: format!("{namespace}/{name}"),
                source,
            })?;
        Ok(object.map(|o| self.view(&o)))
    }

    fn view(&self, object: &DynamicObject) -> ReleaseView {
        let release = ReleaseView::from_object(object);
        if !release.malformed.is_empty() {
            tracing::warn!(release = %release.key(), fields = ?release.malformed, "ignoring malformed fields of the HelmRelease");
        }
        if let crate::release::ProcessedVersion::Unparsable(text) = release.processed_version() {
            // SPEC §4 step 7: the guard does not hold, the recovery carries on.
            tracing::warn!(release = %release.key(), annotation = crate::names::PROCESSED_VERSION_ANNOTATION, value = %text, "ignoring an annotation that is not a revision number");
        }
        release
    }

    fn clock(&self, release: &ReleaseView) -> Clock {
        let since_last_fence_warning = self
            .fence_warnings
            .lock()
            .expect("fence warning map poisoned")
            .get(&release.uid)
            .map(Instant::elapsed);
        Clock {
            terminating_for: release.terminating_for(k8s_openapi::jiff::Timestamp::now()),
            since_last_fence_warning,
            fence_recheck_interval: self.timings.fence_recheck_interval,
            fence_held_warning_after: self.timings.fence_held_warning_after,
        }
    }

    /// Carries out any decision but `InspectStorage`, which only `reconcile`
    /// acts on (a settle never starts a recovery).
    async fn carry_out(&self, release: &ReleaseView, decision: Decision) -> Result<Outcome, Error> {
        if self.controls.dry_run
            && let Some(would) = would_write(&decision)
        {
            if let Decision::DropFence { event: Some(event) } = &decision {
                self.events.record(release, event).await;
            }
            tracing::info!(release = %release.key(), "dry run: would {would}");
            return Ok(Outcome::DryRun { would });
        }
        match decision {
            Decision::Nothing { event: None } | Decision::InspectStorage => {
                Ok(Outcome::NothingToDo)
            }
            Decision::Nothing { event: Some(event) } => {
                self.events.record(release, &event).await;
                Ok(Outcome::LeftAlone)
            }
            Decision::Lift { keep_fence } => {
                self.lift(release, keep_fence).await?;
                Ok(Outcome::Lifted {
                    kept_fence: keep_fence,
                })
            }
            Decision::DropFence { event } => {
                if let Some(event) = event {
                    self.events.record(release, &event).await;
                }
                self.drop_fence(release).await?;
                tracing::info!(release = %release.key(), "dropped the uninstall fence");
                Ok(Outcome::FenceDropped)
            }
            Decision::HoldFence {
                recheck,
                event,
                label_fence,
            } => {
                if label_fence && !self.controls.dry_run {
                    self.write(release, Claim::FENCE_ONLY)
                        .await
                        .map_err(|source| Error::LabelFence {
                            key: release.key(),
                            source,
                        })?;
                    tracing::info!(release = %release.key(), "labelled an uninstall fence an older flux-plunger set");
                }
                if let Some(event) = event {
                    self.events.record(release, &event).await;
                    self.fence_warnings
                        .lock()
                        .expect("fence warning map poisoned")
                        .insert(release.uid.clone(), Instant::now());
                }
                tracing::debug!(release = %release.key(), "holding the uninstall fence until helm-controller has uninstalled");
                Ok(Outcome::FenceHeld { recheck })
            }
            Decision::HandOver {
                snapshot,
                storage_namespace,
                then,
                event,
            } => {
                self.pause_at_step(Step::BeforeHistoryWrite).await;
                let object = apply::write_history(
                    &self.client,
                    release,
                    &snapshot,
                    storage_namespace.as_deref(),
                )
                .await
                .map_err(|source| Error::HandOver {
                    key: release.key(),
                    source,
                })?;
                let handed = self.written(&object);
                self.pause_at_step(Step::AfterHistoryWrite).await;
                tracing::info!(release = %release.key(), revision = snapshot.version, helm_release = %snapshot.full_name(), "handed the newest live revision to helm-controller's uninstall");
                self.events.record(release, &event).await;
                match then {
                    AfterHandOver::Lift { keep_fence } => self.lift(&handed, keep_fence).await?,
                    AfterHandOver::RequestReconcile => self.request_reconcile(&handed).await?,
                }
                Ok(Outcome::HandedOver {
                    revision: snapshot.version,
                })
            }
            Decision::ReclaimUninstalled { revision } => {
                // The storage was just listed through this client; if it
                // cannot be made now, look again later.
                let client = match self.storage_client(release).await {
                    Ok(client) => client,
                    Err(why) => {
                        tracing::warn!(release = %release.key(), %why, "cannot reach the Helm storage again; retrying later");
                        return Ok(Outcome::FenceHeld {
                            recheck: self.timings.fence_recheck_interval,
                        });
                    }
                };
                self.delete_storage_revision(&client, &revision).await?;
                tracing::info!(release = %release.key(), secret = %revision.name, "deleted an uninstalled newest revision, so that the uninstall targets the live one below it");
                Ok(Outcome::ReclaimedUninstalled {
                    revision: revision.revision,
                })
            }
            Decision::RequestReconcile => {
                self.request_reconcile(release).await?;
                Ok(Outcome::ReconcileRequested)
            }
            Decision::LetGo { event } => {
                self.events.record(release, &event).await;
                self.drop_fence(release).await?;
                tracing::warn!(release = %release.key(), note = %event.note, "dropped the uninstall fence without an uninstall");
                Ok(Outcome::ReleasedWithoutUninstall)
            }
            // `decide_now` has read the storage already.
            Decision::ReadStorage => Ok(Outcome::NothingToDo),
        }
    }

    /// Gives up the fence: an apply that claims nothing (another manager's
    /// suspension stays as it is).
    async fn drop_fence(&self, release: &ReleaseView) -> Result<(), Error> {
        self.pause_at_step(Step::BeforeDropFence).await;
        self.write(release, Claim::NOTHING)
            .await
            .map_err(|source| Error::Lift {
                key: release.key(),
                source,
            })?;
        self.pause_at_step(Step::AfterDropFence).await;
        Ok(())
    }

    /// Deletes exactly the revision listed (its uid and resourceVersion).
    async fn delete_storage_revision(
        &self,
        client: &Client,
        revision: &StorageRevision,
    ) -> Result<(), Error> {
        self.pause_at_step(Step::BeforeDeleteStorage).await;
        match storage::delete_revision(client, revision).await {
            Ok(()) => {}
            // Already gone: whoever deleted it did what we meant to.
            Err(err) if is_api_code(&err, 404) => {}
            Err(source) => {
                return Err(Error::DeleteStorage {
                    namespace: revision.namespace.clone(),
                    name: revision.name.clone(),
                    source,
                });
            }
        }
        self.pause_at_step(Step::AfterDeleteStorage).await;
        Ok(())
    }

    /// Asks helm-controller to reconcile the release again, with a value it
    /// has not handled and flux-plunger knows as its own.
    async fn request_reconcile(&self, release: &ReleaseView) -> Result<(), Error> {
        let requested_at = format!(
            "{}{}",
            crate::names::RECONCILE_REQUEST_PREFIX,
            k8s_openapi::jiff::Timestamp::now()
        );
        self.pause_at_step(Step::BeforeReconcileRequest).await;
        let object = apply::request_reconcile(&self.client, release, &requested_at)
            .await
            .map_err(|source| Error::RequestReconcile {
                key: release.key(),
                source,
            })?;
        self.written(&object);
        self.pause_at_step(Step::AfterReconcileRequest).await;
        tracing::info!(release = %release.key(), %requested_at, "asked helm-controller to reconcile the release being deleted");
        Ok(())
    }

    /// Gives up our suspension, and the fence unless `keep_fence`.
    async fn lift(&self, release: &ReleaseView, keep_fence: bool) -> Result<(), Error> {
        let claim = if keep_fence {
            Claim::FENCE_ONLY
        } else {
            Claim::NOTHING
        };
        self.pause_at_step(Step::BeforeLift).await;
        match self.write(release, claim).await {
            Ok(_) => {
                self.pause_at_step(Step::AfterLift).await;
                tracing::info!(release = %release.key(), kept_fence = keep_fence, "lifted flux-plunger's suspension");
                Ok(())
            }
            Err(source) => {
                // A 409 is a race: the retry reads again and decides anew. A
                // write held back because the Lease lapsed was never sent.
                if !is_api_code(&source, 409) && !crate::client::is_not_leader(&source) {
                    let event = EventSpec {
                        warning: true,
                        reason: reasons::UNSUSPEND_FAILED,
                        action: "Unsuspend",
                        note: format!(
                            "flux-plunger holds a suspension of {} it could not lift: {source}; it will retry",
                            release.key()
                        ),
                    };
                    self.events.record(release, &event).await;
                }
                Err(Error::Lift {
                    key: release.key(),
                    source,
                })
            }
        }
    }

    async fn write(&self, release: &ReleaseView, claim: Claim) -> kube::Result<ReleaseView> {
        let object = apply::apply(&self.client, release, claim, false).await?;
        Ok(self.written(&object))
    }

    /// The view of what one of our writes returned, its resourceVersion noted.
    fn written(&self, object: &DynamicObject) -> ReleaseView {
        let view = self.view(object);
        self.writes
            .lock()
            .expect("write map poisoned")
            .entry(view.uid.clone())
            .or_default()
            .push(view.resource_version.clone());
        view
    }

    /// The resourceVersions our writes left release `uid` at since the last
    /// call (and forgets them). After a pass that ended
    /// [`Outcome::Recovered`], these are states the recovery itself wrote,
    /// the last one by its final lift: a pass over any of them finds nothing
    /// to do (the processed guard), so the controller need not run one for
    /// the watch events of its own writes.
    pub fn take_writes(&self, uid: &str) -> Vec<String> {
        self.writes
            .lock()
            .expect("write map poisoned")
            .remove(uid)
            .unwrap_or_default()
    }

    /// SPEC §4 steps 6-13.
    async fn recover(&self, release: ReleaseView) -> Result<Outcome, Error> {
        // The storage is in the cluster the release is installed in.
        let storage_client = match self.storage_client(&release).await {
            Ok(client) => client,
            Err(why) => {
                let event = EventSpec {
                    warning: true,
                    reason: reasons::REMOTE_CLUSTER_UNUSABLE,
                    action: "Recover",
                    note: format!(
                        "{} is stuck in a remote cluster flux-plunger cannot use: {why}",
                        release.key()
                    ),
                };
                self.events.record(&release, &event).await;
                return Ok(Outcome::Skipped(SkipReason::RemoteClusterUnusable { why }));
            }
        };
        let location = StorageLocation::of(&release);
        let secrets = storage::list_storage(&storage_client, &location)
            .await
            .map_err(|source| Error::ListStorage {
                key: release.key(),
                namespace: location.namespace.clone(),
                source,
            })?;
        let (revisions, ignored) = storage::parse_revisions(&secrets, &location);
        for secret in &ignored {
            tracing::warn!(release = %release.key(), secret = %secret.name, why = %secret.why, "ignoring a Secret that is not a well-formed Helm storage revision");
        }
        let target = match plan_recovery(&release, &revisions) {
            RecoveryPlan::Reclaim(target) => target,
            RecoveryPlan::Skip(reason) => {
                tracing::info!(release = %release.key(), ?reason, storage = ?location, "stuck, but nothing to reclaim");
                return Ok(Outcome::Skipped(reason));
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
            let event = EventSpec {
                warning: false,
                reason: reasons::RECOVERY_DRY_RUN,
                action: "Recover",
                note: format!("dry run: flux-plunger would {would}"),
            };
            self.events.record(&release, &event).await;
            return Ok(Outcome::DryRun { would });
        }
        if let Some(limiter) = &self.controls.rate_limit
            && let Err(retry_after) = limiter.try_take()
        {
            tracing::info!(release = %release.key(), ?retry_after, "recovery rate limit reached; waiting");
            return Ok(Outcome::RateLimited { retry_after });
        }

        let Some(held) = self.acquire(&release.namespace, &release.name).await? else {
            let event = EventSpec {
                warning: false,
                reason: reasons::RECOVERY_DEFERRED,
                action: "Suspend",
                note: format!(
                    "{} changed while flux-plunger was about to recover it (suspended, deleted or written meanwhile); recovery waits for its next change",
                    release.key()
                ),
            };
            self.events.record(&release, &event).await;
            return Ok(Outcome::Deferred);
        };
        tracing::info!(release = %release.key(), revision = target.revision, secret = %target.name, "suspended with the uninstall fence to reclaim the newest storage revision");

        let below_uid = decide::revision_below(&revisions, &target).map(|r| r.uid.clone());
        match self
            .reclaim(held, &target, below_uid.as_deref(), &storage_client)
            .await
        {
            Ok(outcome) => Ok(outcome),
            Err(err) => {
                // Step 9: an early exit never leaves our suspension behind.
                if let Err(undo) = self.settle(&release.namespace, &release.name).await {
                    tracing::warn!(release = %release.key(), error = %undo, "could not lift the suspension after a failed recovery step; the retry will");
                }
                Err(err)
            }
        }
    }

    /// SPEC §4.8: takes the suspension and the fence together, from a fresh
    /// read; `None` when it is not ours to take.
    async fn acquire(&self, namespace: &str, name: &str) -> Result<Option<ReleaseView>, Error> {
        let claim = self.acquire_claim();
        let Some(fresh) = self.read(namespace, name).await? else {
            return Ok(None);
        };
        if !may_take_suspension(&fresh) {
            return Ok(None);
        }
        let acquire_error = |source| Error::Acquire {
            key: fresh.key(),
            source,
        };
        self.pause_at_step(Step::BeforeAcquire).await;
        match apply::apply(&self.client, &fresh, claim, false).await {
            Ok(object) => return Ok(Some(self.written(&object))),
            Err(err) if is_api_code(&err, 409) => {}
            Err(err) => return Err(acquire_error(err)),
        }
        let Some(again) = self.read(namespace, name).await? else {
            return Ok(None);
        };
        if !may_take_suspension(&again) {
            return Ok(None);
        }
        self.pause_at_step(Step::BeforeForcedAcquire).await;
        match apply::apply(&self.client, &again, claim, true).await {
            Ok(object) => Ok(Some(self.written(&object))),
            Err(err) if is_api_code(&err, 409) => Ok(None),
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
    ) -> Result<Outcome, Error> {
        self.pause_at_step(Step::Acquired).await;
        let mut current = held;
        let mut conflicts = 0;
        loop {
            let source =
                match apply::annotate(&self.client, &current, target.revision, below_uid).await {
                    Ok(object) => {
                        self.written(&object);
                        break;
                    }
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
        }
        let held = current;
        self.pause_at_step(Step::Annotated).await;

        let recheck = self.read(&held.namespace, &held.name).await?;
        if !may_delete_storage(recheck.as_ref()) {
            tracing::info!(release = %held.key(), "deleted during recovery: keeping the storage revision, lifting the suspension");
            if let Some(release) = recheck {
                let decision = self.decide_now(&release).await?;
                self.carry_out(&release, decision).await?;
            }
            return Ok(Outcome::AbortedForDelete {
                revision: target.revision,
            });
        }
        let release = recheck.expect("may_delete_storage implies a release");

        self.delete_storage_revision(storage_client, target).await?;
        tracing::info!(release = %release.key(), secret = %target.name, "deleted the newest storage revision");
        self.finish(release.clone()).await?;
        let event = EventSpec {
            warning: false,
            reason: reasons::RECOVERED,
            action: "Recover",
            note: format!(
                "reclaimed Helm storage revision {} ({}, status {:?}) of {}: helm-controller can upgrade again",
                target.revision,
                target.name,
                target.status,
                release.key()
            ),
        };
        self.events.record(&release, &event).await;
        Ok(Outcome::Recovered {
            revision: target.revision,
        })
    }

    /// SPEC §4.13: gives up the suspension and the fence together. A 409
    /// (helm-controller's status write) is met by reading again: while the
    /// suspension is still ours on the live release, the lift is sent again;
    /// if a delete came meanwhile, §5 decides (the fence stays).
    async fn finish(&self, mut release: ReleaseView) -> Result<(), Error> {
        let mut conflicts = 0;
        loop {
            match self.lift(&release, false).await {
                Ok(()) => return Ok(()),
                Err(err) if err.is_conflict() && conflicts < MAX_CONFLICTS_WHILE_HELD => {
                    conflicts += 1;
                    let Some(again) = self.read(&release.namespace, &release.name).await? else {
                        return Ok(());
                    };
                    if !decide::still_held(&again, &release.uid) {
                        let decision = self.decide_now(&again).await?;
                        self.carry_out(&again, decision).await?;
                        return Ok(());
                    }
                    release = again;
                }
                Err(err) => return Err(err),
            }
        }
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

    #[cfg(feature = "test-hooks")]
    async fn pause_at_step(&self, step: Step) {
        if let Some(pause) = &self.hooks.pause {
            pause(step).await;
        }
    }

    #[cfg(not(feature = "test-hooks"))]
    async fn pause_at_step(&self, _step: Step) {}
}

/// What a decision would write, for `--dry-run`; `None` for no write.
fn would_write(decision: &Decision) -> Option<String> {
    match decision {
        Decision::Lift { keep_fence: true } => {
            Some("lift flux-plunger's suspension and keep the fence".to_owned())
        }
        Decision::Lift { keep_fence: false } => {
            Some("lift flux-plunger's suspension and the fence".to_owned())
        }
        Decision::DropFence { .. } => Some("remove the uninstall fence".to_owned()),
        Decision::HandOver { snapshot, then, .. } => Some(format!(
            "write revision {} ({}) to status.history for helm-controller's uninstall, then {}",
            snapshot.version,
            snapshot.full_name(),
            match then {
                AfterHandOver::Lift { .. } => "lift flux-plunger's suspension",
                AfterHandOver::RequestReconcile => "ask helm-controller to reconcile",
            }
        )),
        Decision::ReclaimUninstalled { revision } => Some(format!(
            "delete the uninstalled newest revision {}/{}",
            revision.namespace, revision.name
        )),
        Decision::RequestReconcile => Some("ask helm-controller to reconcile".to_owned()),
        Decision::LetGo { .. } => {
            Some("remove the uninstall fence without an uninstall".to_owned())
        }
        Decision::Nothing { .. }
        | Decision::HoldFence { .. }
        | Decision::InspectStorage
        | Decision::ReadStorage => None,
    }
}
