//! Carries out the decisions of `decide` against the apiserver (SPEC §4-§5).
//!
//! Every read that decides a write goes to the apiserver; every write is the
//! one primitive of `apply`, preconditioned on the read that decided it.
//! This module reads a release, asks `decide` and hands the decision to the
//! step that carries it out: `recover` (SPEC §4, a stuck release), `deleted`
//! (SPEC §5, a release being deleted), `let_go` (the lift and the fence's
//! drop both use), with the storage read in `storage`.

mod deleted;
mod let_go;
mod recover;
mod storage;

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use kube::Client;
use kube::api::DynamicObject;

use crate::apply::{self, Claim};
use crate::decide::{self, Answer, Context, Decision, Known, Need, SkipReason, StorageFailing};
use crate::error::Error;
use crate::events::Events;
use crate::install::Install;
use crate::release::api::helmreleases;
use crate::release::view::{ProcessedVersion, ReleaseView};
pub use crate::test_hooks::Step;
#[cfg(feature = "test-hooks")]
pub use crate::test_hooks::TestHooks;
use crate::timings::Timings;
use storage::{StorageFailure, StorageRead};

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

/// The counter an outcome is counted in, with its `result` label (the
/// controller's metrics: `flux_plunger_recoveries_total`,
/// `flux_plunger_uninstall_handovers_total`,
/// `flux_plunger_uninstall_fence_held_warnings_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Counted {
    Recovery(&'static str),
    UninstallHandover(&'static str),
    FenceHeldWarning,
}

impl Outcome {
    /// Where this outcome is counted; `None`: in no counter.
    pub fn counted(&self) -> Option<Counted> {
        Some(match self {
            Outcome::FenceHeld { warned: true, .. } => Counted::FenceHeldWarning,
            Outcome::HandedOver { .. } => Counted::UninstallHandover("handed_over"),
            Outcome::ReconcileRequested => Counted::UninstallHandover("reconcile_requested"),
            Outcome::ReleasedWithoutUninstall => {
                Counted::UninstallHandover("released_without_uninstall")
            }
            Outcome::Recovered { .. } | Outcome::RecoveredThenDeleted { .. } => {
                Counted::Recovery("recovered")
            }
            Outcome::Deferred => Counted::Recovery("deferred"),
            Outcome::Skipped(_) => Counted::Recovery("skipped"),
            Outcome::DryRun { .. } => Counted::Recovery("dry_run"),
            Outcome::RateLimited { .. } => Counted::Recovery("rate_limited"),
            Outcome::Gone
            | Outcome::NothingToDo
            | Outcome::LeftAlone
            | Outcome::Lifted { .. }
            | Outcome::FenceDropped
            | Outcome::FenceHeld { warned: false, .. } => return None,
        })
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
        let decided = self.decide_now(&release, true).await?;
        match decided.decision {
            Decision::Recover(recovery) => self.recover(release, recovery, decided.storage).await,
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
        let decided = self.decide_now(&release, false).await?;
        self.carry_out(&release, decided.decision).await
    }

    /// [`Self::settle`] from the release as a listing just returned it, which
    /// saves the read: every write is preconditioned on the listed
    /// resourceVersion (or guarded by a `test` of what it read), so a release
    /// changed since is refused, read again and settled from that read.
    pub async fn settle_as_listed(&self, release: &ReleaseView) -> Result<Outcome, Error> {
        let decided = self.decide_now(release, false).await?;
        match self.carry_out(release, decided.decision).await {
            Err(err) if err.is_stale_write() || crate::error::is_failed_guard(err.source()) => {
                self.settle(&release.namespace, &release.name).await
            }
            outcome => outcome,
        }
    }

    /// `decide`, giving it what it asks for: the Helm storage, read; a
    /// turn of the rate limit, taken. Each is asked for once at most, as
    /// `decide` asks only for what it does not know yet.
    async fn decide_now(&self, release: &ReleaseView, may_recover: bool) -> Result<Decided, Error> {
        let context = self.context(release, may_recover);
        let mut known = Known::default();
        let mut storage = None;
        loop {
            match decide::decide(release, &known, &context) {
                Answer::Decided(decision) => return Ok(Decided { decision, storage }),
                Answer::Needs(Need::Storage) => {
                    let read = self.read_storage(release).await.inspect_err(|err| {
                        // Only a delete's decision gives up on a storage
                        // that keeps failing (`decide::storage_given_up`).
                        if release.terminating {
                            self.storage_failed(release, err);
                        }
                    })?;
                    self.storage_succeeded(release);
                    known.storage = Some(read.facts.clone());
                    storage = Some(read);
                }
                Answer::Needs(Need::RecoveryTurn) => {
                    let turn = self
                        .controls
                        .rate_limit
                        .as_ref()
                        .map_or(Ok(()), |limiter| limiter.try_take(&release.uid));
                    known.recovery_turn = Some(turn);
                }
            }
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
        if object.is_none() {
            self.storage_gone(namespace, name);
        }
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

    fn context(&self, release: &ReleaseView, may_recover: bool) -> Context {
        let since_last_fence_warning = self
            .fence_warnings
            .lock()
            .expect("fence warning map poisoned")
            .get(&release.uid)
            .map(Instant::elapsed);
        let storage_failure = self
            .storage_failures
            .lock()
            .expect("storage failure map poisoned")
            .get(&release.uid)
            .map(|failure| StorageFailing {
                failing_for: failure.since.elapsed(),
                last_error: failure.last.clone(),
            });
        Context {
            terminating_for: release.terminating_for(k8s_openapi::jiff::Timestamp::now()),
            since_last_fence_warning,
            fence_recheck_interval: self.timings.fence_recheck_interval,
            fence_held_warning_after: self.timings.fence_held_warning_after,
            storage_failure,
            holds_waiting_releases: self.holds_waiting_releases,
            fence_holder: self.install.fence_holder(release),
            may_recover,
            dry_run: self.controls.dry_run,
            rate_limited: self.controls.rate_limit.is_some(),
        }
    }

    /// Carries out any decision but `Recover`, which only `pass` acts on (a
    /// settle never starts a recovery).
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
        match decision {
            Decision::Nothing { event: None } => Ok((Outcome::NothingToDo, release.clone())),
            Decision::Nothing { event: Some(event) } => {
                self.events.record(release, &event).await;
                Ok((Outcome::LeftAlone, release.clone()))
            }
            Decision::Lift { keep_fence } => {
                let written = self.lift(release, keep_fence).await?;
                let outcome = Outcome::Lifted {
                    kept_fence: keep_fence,
                };
                Ok((outcome, written))
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
            } => self.hold_fence(release, recheck, event, label_fence).await,
            Decision::HandOver {
                snapshot,
                storage_namespace,
                then,
                event,
            } => {
                self.hand_over(release, snapshot, storage_namespace, then, event)
                    .await
            }
            Decision::RequestReconcile => {
                let written = self.request_reconcile(release).await?;
                Ok((Outcome::ReconcileRequested, written))
            }
            Decision::ReleaseWithoutUninstall { event } => {
                self.release_without_uninstall(release, event).await
            }
            Decision::Skip {
                reason,
                event,
                drop_fence,
            } => self.skip(release, reason, event, drop_fence).await,
            Decision::DryRun { would, event } => {
                if let Some(event) = event {
                    self.events.record(release, &event).await;
                }
                tracing::info!(release = %release.key(), "dry run: would {would}");
                Ok((Outcome::DryRun { would }, release.clone()))
            }
            // Decided only for a pass that may recover, which carries it out
            // itself (`Reconciler::pass`).
            Decision::Recover(_) => Ok((Outcome::NothingToDo, release.clone())),
        }
    }

    /// Sends one write between its two pause points, where the crash tests
    /// stop a process (test builds only): `before` right before it is sent,
    /// `after` once it succeeded.
    async fn write_between<T, E>(
        &self,
        (before, after): (Step, Step),
        write: impl Future<Output = Result<T, E>>,
    ) -> Result<T, E> {
        self.pause_at_step(before).await;
        let written = write.await?;
        self.pause_at_step(after).await;
        Ok(written)
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

/// A decision, with the storage read that decided it (when one did).
struct Decided {
    decision: Decision,
    storage: Option<StorageRead>,
}
