//! SPEC §5, a release being deleted: the fence held until helm-controller
//! has uninstalled it, the newest live revision handed to its uninstall when
//! its history is empty, a reconcile requested, and the fence let go without
//! an uninstall when nothing can run one.

use std::time::{Duration, Instant};

use super::{Outcome, Reconciler};
use crate::apply::{self, Claim};
use crate::decide::AfterHandOver;
use crate::error::Error;
use crate::history::HistorySnapshot;
use crate::notices::EventSpec;
use crate::release::view::ReleaseView;
use crate::test_hooks::Step;

impl Reconciler {
    /// SPEC §5e: keeps the fence while helm-controller has not uninstalled
    /// the release, labelling it as this install's when it is not yet, and
    /// warning at most once per re-check interval.
    pub(super) async fn hold_fence(
        &self,
        release: &ReleaseView,
        recheck: Duration,
        event: Option<EventSpec>,
        label_fence: bool,
    ) -> Result<(Outcome, ReleaseView), Error> {
        let mut held = release.clone();
        if label_fence {
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

    /// SPEC §5a, §5d: writes the newest live revision to helm-controller's
    /// empty history, so that its uninstall removes what the release
    /// installed; then lifts our suspension or asks for a reconcile.
    pub(super) async fn hand_over(
        &self,
        release: &ReleaseView,
        snapshot: Box<HistorySnapshot>,
        storage_namespace: Option<String>,
        then: AfterHandOver,
        event: EventSpec,
    ) -> Result<(Outcome, ReleaseView), Error> {
        let write = apply::write_history(
            &self.client,
            release,
            &snapshot,
            storage_namespace.as_deref(),
        );
        let object = self
            .write_between((Step::BeforeHistoryWrite, Step::AfterHistoryWrite), write)
            .await
            .map_err(|source| Error::HandOver {
                key: release.key(),
                source,
            })?;
        let handed = self.view(&object);
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

    /// SPEC §5d: asks helm-controller to reconcile the release again, with a value it
    /// has not handled and flux-plunger knows as its own.
    pub(super) async fn request_reconcile(
        &self,
        release: &ReleaseView,
    ) -> Result<ReleaseView, Error> {
        let requested_at = format!(
            "{}{}",
            crate::names::RECONCILE_REQUEST_PREFIX,
            k8s_openapi::jiff::Timestamp::now()
        );
        let write = apply::request_reconcile(&self.client, release, &requested_at);
        let object = self
            .write_between(
                (Step::BeforeReconcileRequest, Step::AfterReconcileRequest),
                write,
            )
            .await
            .map_err(|source| Error::RequestReconcile {
                key: release.key(),
                source,
            })?;
        let written = self.view(&object);
        tracing::info!(release = %release.key(), %requested_at, "asked helm-controller to reconcile the release being deleted");
        Ok(written)
    }

    /// SPEC §5d: nothing can uninstall the release: the fence goes, and the
    /// event names what is left behind.
    pub(super) async fn release_without_uninstall(
        &self,
        release: &ReleaseView,
        event: EventSpec,
    ) -> Result<(Outcome, ReleaseView), Error> {
        self.events.record(release, &event).await;
        let written = self.drop_fence(release).await?;
        tracing::warn!(release = %release.key(), note = %event.note, "dropped the uninstall fence without an uninstall");
        Ok((Outcome::ReleasedWithoutUninstall, written))
    }

    /// How many releases' fence warnings are remembered (each only until its
    /// re-check interval has passed).
    pub fn remembered_fence_warnings(&self) -> usize {
        self.fence_warnings
            .lock()
            .expect("fence warning map poisoned")
            .len()
    }
}
