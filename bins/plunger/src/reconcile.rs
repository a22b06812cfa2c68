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
    self, AfterHandOver, Clock, Decision, MayAcquire, RecoveryPlan, SkipReason, StorageFacts,
    UninstallTarget, may_take_suspension, plan_recovery,
};
use crate::error::{
    Error, describe, is_api_code, is_failed_guard, is_field_manager_conflict, is_stale_write,
};
use crate::events::Events;
use crate::install::Install;
use crate::names::PATCH_FIELD_MANAGER;
use crate::notices::{self, AfterRecovery};
use crate::release::api::helmreleases;
use crate::release::view::{ProcessedVersion, ReleaseView};
use crate::remote::RemoteError;
use crate::storage::api::{delete_revision, list_storage, read_snapshot};
use crate::storage::reach;
use crate::storage::view::{StorageLocation, StorageRevision, parse_revisions};
pub use crate::test_hooks::Step;
#[cfg(feature = "test-hooks")]
pub use crate::test_hooks::TestHooks;
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
    /// `warned`: this pass raised `UninstallFenceHeld` (SPEC §5e), which the
    /// controller counts for alerting.
    FenceHeld { recheck: Duration, warned: bool },
    /// Stuck, but the storage holds nothing we may reclaim.
    Skipped(SkipReason),
    /// The suspension could not be taken (someone else wrote first).
    Deferred,
    /// The revision was reclaimed and the release let go.
    Recovered { revision: u64 },
    /// The revision was reclaimed, and a delete came before the final lift:
    /// the suspension is lifted and the fence holds the release until
    /// helm-controller has uninstalled it; look again after `recheck`.
    RecoveredThenDeleted { revision: u64, recheck: Duration },
    /// `--dry-run`: what would have been written, reported, nothing written.
    DryRun { would: String },
    /// `--max-recoveries-per-minute` is used up: try again after this.
    RateLimited { retry_after: Duration },
    /// A release being deleted was handed to helm-controller's uninstall:
    /// this revision written to its history (then our suspension lifted, or
    /// a reconcile requested).
    HandedOver { revision: u64 },
    /// helm-controller was asked to reconcile the release being deleted.
    ReconcileRequested,
    /// The fence was let go though nothing could uninstall the release.
    ReleasedWithoutUninstall,
}

impl Outcome {
    /// When the release must be looked at again whether or not anything
    /// writes it: a held fence (SPEC §5e), a recovery waiting for the rate
    /// limit, and at once after a storage revision of a release being
    /// deleted was reclaimed (deleting a Secret wakes no watch). `None`: its
    /// next change wakes it.
    pub fn recheck_after(&self) -> Option<Duration> {
        match self {
            Outcome::FenceHeld { recheck, .. } | Outcome::RecoveredThenDeleted { recheck, .. } => {
                Some(*recheck)
            }
            Outcome::RateLimited { retry_after } => Some(*retry_after),
            _ => None,
        }
    }
}

/// What one pass did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pass {
    pub outcome: Outcome,
    /// After a recovery: the resourceVersions of the states of the release
    /// it wrote or acted on (its acquire, its annotation, its final lift).
    /// A watch event of one of them wakes a pass that would find nothing to
    /// do (the processed guard), which the controller may skip. After a
    /// recovery turned away by the rate limit: the state its fence write
    /// left, whose wake would only be turned away again. Empty after any
    /// other outcome.
    pub handled: Vec<String>,
}

impl From<Outcome> for Pass {
    fn from(outcome: Outcome) -> Self {
        Self {
            outcome,
            handled: Vec::new(),
        }
    }
}

/// The operator's controls of what a reconcile may do.
#[derive(Default)]
pub struct Controls {
    /// Decide and report, write nothing to releases or Secrets.
    pub dry_run: bool,
    /// At most this many recoveries start per minute.
    pub rate_limit: Option<crate::ratelimit::RateLimiter>,
    /// The ServiceAccount helm-controller acts as for a release that names
    /// none (its `--default-service-account`): it bounds where that
    /// release's storage may be reached (`storage::reach`).
    pub default_service_account: Option<String>,
}

/// Why a release's storage is not reached.
enum Unreached {
    /// No client for its remote cluster.
    Remote(RemoteError),
    /// helm-controller, acting for the release, could not reach it: nor
    /// may flux-plunger.
    OutOfReach(String),
    /// Whether helm-controller could was not answered: it may pass.
    ReviewFailed(Error),
}

/// How many 409s a step taken under our suspension reads through before it
/// gives up (and the recovery is undone and retried).
const MAX_CONFLICTS_WHILE_HELD: u32 = 5;

/// Storage steps of one release that have failed on every try since.
struct StorageFailure {
    since: Instant,
    last: String,
}

/// Everything a reconcile needs.
pub struct Reconciler {
    client: Client,
    events: Events,
    timings: Timings,
    /// When we last warned that a release's delete is held, by uid: one
    /// warning per release per re-check interval, however often it is woken.
    fence_warnings: Mutex<HashMap<String, Instant>>,
    /// Since when, and with what last error, the storage read of a release
    /// being deleted has failed on every try, by uid ([`decide::storage_given_up`]).
    storage_failures: Mutex<HashMap<String, StorageFailure>>,
    controls: Controls,
    /// The install whose fences these are (SPEC §3): what its fence's label
    /// says, and which labelled fences it leaves to another install.
    install: Install,
    /// Whose passes these are: see [`Reconciler::letting_go`].
    holds_waiting_releases: bool,
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
            storage_failures: Mutex::new(HashMap::new()),
            controls: Controls::default(),
            install: Install::default(),
            holds_waiting_releases: true,
            #[cfg(feature = "test-hooks")]
            hooks: TestHooks::default(),
        }
    }

    /// The drain's reconciler: its pod is going away, so it lets go of
    /// every live release, a stuck one waiting for its recovery too (the
    /// next leader fences it again); the controller's holds that fence
    /// (SPEC §4.5).
    pub fn letting_go(mut self) -> Self {
        self.holds_waiting_releases = false;
        self
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

    /// The same reconciler, writing and settling `install`'s fences.
    pub fn with_install(mut self, install: Install) -> Self {
        self.install = install;
        self
    }

    /// `apply::apply` as this reconciler's client, for its install.
    async fn apply(
        &self,
        release: &ReleaseView,
        claim: Claim,
        force: bool,
    ) -> kube::Result<DynamicObject> {
        apply::apply(&self.client, release, claim, force, &self.install).await
    }

    /// The install whose fences this reconciler writes and settles.
    pub fn install(&self) -> &Install {
        &self.install
    }

    /// The same reconciler under the operator's controls.
    pub fn with_controls(mut self, controls: Controls) -> Self {
        self.controls = controls;
        self
    }

    /// One pass over one release (SPEC §4, §5).
    pub async fn reconcile(&self, namespace: &str, name: &str) -> Result<Outcome, Error> {
        Ok(self.pass(namespace, name).await?.outcome)
    }

    /// [`Self::reconcile`], with the states of the release the pass handled.
    pub async fn pass(&self, namespace: &str, name: &str) -> Result<Pass, Error> {
        let Some(release) = self.read(namespace, name).await? else {
            return Ok(Outcome::Gone.into());
        };
        match self.decide_now(&release).await? {
            Decision::InspectStorage => self.recover(release).await,
            decision => Ok(self.carry_out(&release, decision).await?.into()),
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

    /// [`Self::settle`] from the release as a listing just returned it, which
    /// saves the read: every write is preconditioned on the listed
    /// resourceVersion (or guarded by a `test` of what it read), so a release
    /// changed since is refused, read again and settled from that read.
    pub async fn settle_as_listed(&self, release: &ReleaseView) -> Result<Outcome, Error> {
        let decision = self.decide_now(release).await?;
        match self.carry_out(release, decision).await {
            Err(err) if err.is_stale_write() || crate::error::is_failed_guard(err.source()) => {
                self.settle(&release.namespace, &release.name).await
            }
            outcome => outcome,
        }
    }

    /// `decide`, reading the Helm storage when the decision depends on it.
    async fn decide_now(&self, release: &ReleaseView) -> Result<Decision, Error> {
        let clock = self.clock(release);
        match decide::decide(release, &clock) {
            Decision::ReadStorage => {
                if decide::storage_given_up(&clock) {
                    let facts = StorageFacts::Unreadable {
                        why: self.storage_failure_reason(release),
                    };
                    return Ok(decide::decide_with_storage(release, &facts, &clock));
                }
                let facts = self
                    .storage_facts(release)
                    .await
                    .inspect_err(|err| self.storage_failed(release, err))?;
                self.storage_succeeded(release);
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
        let (revisions, ignored) = parse_revisions(&secrets, &location);
        for secret in &ignored {
            tracing::warn!(release = %release.key(), secret = %secret.name, why = %secret.why, "ignoring a Secret that is not a well-formed Helm storage revision");
        }
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
    fn storage_failed(&self, release: &ReleaseView, err: &Error) {
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
    fn storage_succeeded(&self, release: &ReleaseView) {
        self.storage_failures
            .lock()
            .expect("storage failure map poisoned")
            .remove(&release.uid);
    }

    /// Why the storage read of `release` was given up.
    fn storage_failure_reason(&self, release: &ReleaseView) -> String {
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
    async fn storage_client(
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
        if let ProcessedVersion::Unparsable(text) = release.processed_version() {
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
        let storage_failing_for = self
            .storage_failures
            .lock()
            .expect("storage failure map poisoned")
            .get(&release.uid)
            .map(|failure| failure.since.elapsed());
        Clock {
            terminating_for: release.terminating_for(k8s_openapi::jiff::Timestamp::now()),
            since_last_fence_warning,
            fence_recheck_interval: self.timings.fence_recheck_interval,
            fence_held_warning_after: self.timings.fence_held_warning_after,
            storage_failing_for,
            holds_waiting_releases: self.holds_waiting_releases,
            fence_holder: self.install.fence_holder(release),
        }
    }

    /// Carries out any decision but `InspectStorage`, which only `reconcile`
    /// acts on (a settle never starts a recovery).
    async fn carry_out(&self, release: &ReleaseView, decision: Decision) -> Result<Outcome, Error> {
        Ok(self.act(release, decision).await?.0)
    }

    /// [`Self::carry_out`], also returning the release as its write left it
    /// (as read, when nothing was written).
    async fn act(
        &self,
        release: &ReleaseView,
        decision: Decision,
    ) -> Result<(Outcome, ReleaseView), Error> {
        if self.controls.dry_run
            && let Some(would) = would_write(&decision)
        {
            if let Decision::DropFence { event: Some(event) } = &decision {
                self.events.record(release, event).await;
            }
            tracing::info!(release = %release.key(), "dry run: would {would}");
            return Ok((Outcome::DryRun { would }, release.clone()));
        }
        match decision {
            Decision::Nothing { event: None } | Decision::InspectStorage => {
                Ok((Outcome::NothingToDo, release.clone()))
            }
            Decision::Nothing { event: Some(event) } => {
                self.events.record(release, &event).await;
                Ok((Outcome::LeftAlone, release.clone()))
            }
            Decision::Lift { keep_fence } => {
                let written = self.lift(release, keep_fence).await?;
                Ok((
                    Outcome::Lifted {
                        kept_fence: keep_fence,
                    },
                    written,
                ))
            }
            Decision::DropFence { event } => {
                if let Some(event) = event {
                    self.events.record(release, &event).await;
                }
                let written = self.drop_fence(release).await?;
                tracing::info!(release = %release.key(), "dropped the uninstall fence");
                Ok((Outcome::FenceDropped, written))
            }
            Decision::HoldFence {
                recheck,
                event,
                label_fence,
            } => {
                let mut held = release.clone();
                if label_fence && !self.controls.dry_run {
                    let object = self
                        .apply(release, Claim::FENCE_ONLY, false)
                        .await
                        .map_err(|source| Error::LabelFence {
                            key: release.key(),
                            source,
                        })?;
                    held = self.view(&object);
                    tracing::info!(release = %release.key(), "labelled the uninstall fence as this install's");
                }
                let warned = event.is_some();
                if let Some(event) = event {
                    self.events.record(release, &event).await;
                    let mut warnings = self
                        .fence_warnings
                        .lock()
                        .expect("fence warning map poisoned");
                    // A warning older than the interval no longer holds the
                    // next one back: forget it, or the map would keep every
                    // release ever held, deleted long since.
                    let interval = self.timings.fence_recheck_interval;
                    warnings.retain(|_, at| at.elapsed() < interval);
                    warnings.insert(release.uid.clone(), Instant::now());
                }
                tracing::debug!(release = %release.key(), "holding the uninstall fence until helm-controller has uninstalled");
                Ok((Outcome::FenceHeld { recheck, warned }, held))
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
                let handed = self.view(&object);
                self.pause_at_step(Step::AfterHistoryWrite).await;
                tracing::info!(release = %release.key(), revision = snapshot.version, helm_release = %snapshot.full_name(), "handed the newest live revision to helm-controller's uninstall");
                self.events.record(release, &event).await;
                let written = match then {
                    AfterHandOver::Lift { keep_fence } => self.lift(&handed, keep_fence).await?,
                    AfterHandOver::RequestReconcile => self.request_reconcile(&handed).await?,
                };
                Ok((
                    Outcome::HandedOver {
                        revision: snapshot.version,
                    },
                    written,
                ))
            }
            Decision::RequestReconcile => {
                let written = self.request_reconcile(release).await?;
                Ok((Outcome::ReconcileRequested, written))
            }
            Decision::LetGo { event } => {
                self.events.record(release, &event).await;
                let written = self.drop_fence(release).await?;
                tracing::warn!(release = %release.key(), note = %event.note, "dropped the uninstall fence without an uninstall");
                Ok((Outcome::ReleasedWithoutUninstall, written))
            }
            // `decide_now` has read the storage already.
            Decision::ReadStorage => Ok((Outcome::NothingToDo, release.clone())),
        }
    }

    /// Gives up the fence: an apply that claims nothing (another manager's
    /// suspension stays as it is), then any copy of the fence another
    /// manager also lists (see [`Self::let_go`]). Returns the release as the
    /// last write left it.
    async fn drop_fence(&self, release: &ReleaseView) -> Result<ReleaseView, Error> {
        self.pause_at_step(Step::BeforeDropFence).await;
        let written = match self.let_go(release, false).await {
            Ok(written) => written,
            Err(failed) => {
                let source = failed.into_source();
                if !is_retried_quietly(&source) {
                    self.warn_fence_left(release, &source).await;
                }
                return Err(Error::Lift {
                    key: release.key(),
                    source,
                });
            }
        };
        self.pause_at_step(Step::AfterDropFence).await;
        Ok(written)
    }

    /// Deletes exactly the revision listed (its uid and resourceVersion).
    async fn delete_storage_revision(
        &self,
        client: &Client,
        revision: &StorageRevision,
    ) -> Result<(), Error> {
        self.pause_at_step(Step::BeforeDeleteStorage).await;
        match delete_revision(client, revision).await {
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
    async fn request_reconcile(&self, release: &ReleaseView) -> Result<ReleaseView, Error> {
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
        let written = self.view(&object);
        self.pause_at_step(Step::AfterReconcileRequest).await;
        tracing::info!(release = %release.key(), %requested_at, "asked helm-controller to reconcile the release being deleted");
        Ok(written)
    }

    /// Gives up our suspension, and the fence unless `keep_fence`.
    async fn lift(&self, release: &ReleaseView, keep_fence: bool) -> Result<ReleaseView, Error> {
        self.pause_at_step(Step::BeforeLift).await;
        match self.let_go(release, keep_fence).await {
            Ok(written) => {
                self.pause_at_step(Step::AfterLift).await;
                tracing::info!(release = %release.key(), kept_fence = keep_fence, "lifted flux-plunger's suspension");
                Ok(written)
            }
            Err(failed) => {
                let fence_left = matches!(failed, LetGoFailed::FenceLeft(_));
                let source = failed.into_source();
                // A race is retried after reading again, and a write held
                // back because the Lease lapsed was never sent; anything else
                // an operator must hear about.
                if fence_left && !is_retried_quietly(&source) {
                    self.warn_fence_left(release, &source).await;
                } else if !is_retried_quietly(&source) {
                    let event = notices::unsuspend_failed(release, &describe(&source));
                    self.events.record(release, &event).await;
                }
                Err(Error::Lift {
                    key: release.key(),
                    source,
                })
            }
        }
    }

    /// Gives up our suspension and, unless `keep_fence`, the fence, by one
    /// apply that leaves them out; then makes sure they are gone from the
    /// release and not only our claim on them. An apply gives up only its
    /// own claim: a copy of the fence another manager also lists stays, and
    /// is removed by a guarded patch. Where the apply itself is refused by a
    /// field-manager conflict (the fence listed twice, a copy another
    /// manager owns, refuses every apply naming it), the guarded patch lets
    /// go instead, still pinned to the read.
    async fn let_go(
        &self,
        release: &ReleaseView,
        keep_fence: bool,
    ) -> Result<ReleaseView, LetGoFailed> {
        let claim = if keep_fence {
            Claim::FENCE_ONLY
        } else {
            Claim::NOTHING
        };
        let written = match self.apply(release, claim, false).await {
            Ok(object) => self.view(&object),
            Err(err) if is_field_manager_conflict(&err) => {
                let let_go = decide::let_go_without_apply(release, keep_fence);
                if let_go.is_empty() {
                    return Err(LetGoFailed::Holding(err));
                }
                tracing::info!(release = %release.key(), error = %crate::error::describe(&err), "another field manager's copy of the fence refuses the apply; letting go by a guarded patch");
                return self
                    .patch(release, &let_go)
                    .await
                    .map_err(LetGoFailed::Holding);
            }
            Err(err) => return Err(LetGoFailed::Holding(err)),
        };
        if keep_fence {
            return Ok(written);
        }
        let left = decide::fence_left_after_give_up(&written);
        if left.is_empty() {
            return Ok(written);
        }
        tracing::info!(release = %written.key(), copies = left.fence_indices.len(), "another field manager also lists the uninstall fence; removing it by a guarded patch");
        self.patch(&written, &left)
            .await
            .map_err(LetGoFailed::FenceLeft)
    }

    /// Sends the guarded patch for `release` as read.
    async fn patch(
        &self,
        release: &ReleaseView,
        let_go: &decide::LetGo,
    ) -> kube::Result<ReleaseView> {
        self.pause_at_step(Step::BeforeGuardedPatch).await;
        let object = apply::patch_guarded(
            &self.client,
            release,
            let_go.lift_suspension,
            &let_go.fence_indices,
            let_go.remove_label,
            PATCH_FIELD_MANAGER,
        )
        .await?;
        self.pause_at_step(Step::AfterGuardedPatch).await;
        Ok(self.view(&object))
    }

    /// Warns that a fence could not be removed: its release cannot go (or,
    /// live, is held by nothing flux-plunger does) until it is.
    async fn warn_fence_left(&self, release: &ReleaseView, source: &kube::Error) {
        let event = notices::fence_removal_failed(release, &describe(source));
        self.events.record(release, &event).await;
    }

    /// How many releases' fence warnings are remembered (each only until its
    /// re-check interval has passed).
    pub fn remembered_fence_warnings(&self) -> usize {
        self.fence_warnings
            .lock()
            .expect("fence warning map poisoned")
            .len()
    }

    /// SPEC §4 steps 6-13.
    async fn recover(&self, release: ReleaseView) -> Result<Pass, Error> {
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
        let (revisions, ignored) = parse_revisions(&secrets, &location);
        for secret in &ignored {
            tracing::warn!(release = %release.key(), secret = %secret.name, why = %secret.why, "ignoring a Secret that is not a well-formed Helm storage revision");
        }
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
            let fenced = self.hold_while_waiting(&release).await?;
            return Ok(Pass {
                outcome: Outcome::RateLimited { retry_after },
                handled: fenced.into_iter().collect(),
            });
        }
        self.pause_at_step(Step::Planned).await;

        let held = match self.acquire(&release).await? {
            Acquisition::Held(held) => *held,
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

    /// SPEC §4.5: a stuck release whose recovery must wait carries the fence
    /// meanwhile, so that a delete landing before the recovery is held for
    /// the uninstall hand-over of §5d (helm-controller's own deletion path
    /// finds the history it cleared empty and would let the release go).
    /// The resourceVersion its fence write left, when it wrote one.
    async fn hold_while_waiting(&self, release: &ReleaseView) -> Result<Option<String>, Error> {
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
            Ok(object) => return Ok(Acquisition::Held(Box::new(self.view(&object)))),
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
            Ok(object) => Ok(Acquisition::Held(Box::new(self.view(&object)))),
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

/// What the acquire came to.
enum Acquisition {
    /// Our suspension and fence are on the release, as this view shows.
    Held(Box<ReleaseView>),
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

/// Why letting go of a release failed.
enum LetGoFailed {
    /// Nothing more was given up than before: the apply (or the patch in
    /// its place) was refused.
    Holding(kube::Error),
    /// Our claim is given up, but a copy of the fence another manager also
    /// lists could not be removed.
    FenceLeft(kube::Error),
}

impl LetGoFailed {
    fn into_source(self) -> kube::Error {
        match self {
            LetGoFailed::Holding(err) | LetGoFailed::FenceLeft(err) => err,
        }
    }
}

/// A failure retried without a Warning: a write that lost a race with
/// another writer (reading again cures it), or one the client held back
/// because our Lease claim had lapsed (it was never sent).
fn is_retried_quietly(err: &kube::Error) -> bool {
    is_stale_write(err) || is_failed_guard(err) || crate::client::is_not_leader(err)
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
