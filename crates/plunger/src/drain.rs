//! The drain (SPEC §6): once the controller has stopped, release every fence
//! this flux-plunger holds before the pod is killed.
//!
//! A live release loses our suspension (if ours) and the fence together;
//! another manager's suspension is left alone. A release being deleted goes
//! through SPEC §5 until helm-controller has uninstalled it and the fence can
//! go, or until the deadline. Each release is one
//! `Reconciler::settle_as_listed`, which never starts a recovery and writes
//! from what the listing returned (one request a fence, where nothing changed
//! since); releases are drained in parallel, bounded.
//!
//! The drain works until its deadline, whatever the apiserver does: a failed
//! listing is retried (a read is always safe), a write waits while the
//! leadership has lapsed, and nothing it waits on outlives the deadline.
//! However it ends, its report says what it left.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use futures::{StreamExt, stream};
use kube::Client;
use tokio::sync::watch;

use crate::lease::Leadership;
use crate::reconcile::{Outcome, Reconciler};
use crate::release::api::list_fenced;
use crate::release::view::ReleaseView;
use crate::scope::Scope;

/// How often held releases are looked at again while helm-controller works,
/// and a failed listing is tried again.
const POLL: Duration = Duration::from_millis(500);

/// How a drain ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// No fence of flux-plunger's is left.
    Done,
    /// The deadline came first.
    Deadline,
    /// The Lease is not ours any more (or could have expired): writing
    /// stopped for good.
    LeaseLost,
}

/// A release that still carried something of ours when the drain ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Left {
    pub(crate) key: String,
    /// Our suspension is still on it, not only the fence.
    pub suspended: bool,
    /// It is being deleted (the fence waits for helm-controller's uninstall).
    pub(crate) terminating: bool,
}

impl Left {
    fn of(release: &ReleaseView) -> Self {
        Self {
            key: release.key(),
            suspended: release.suspended_by_us(),
            terminating: release.terminating,
        }
    }
}

impl std::fmt::Display for Left {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} (fence", self.key)?;
        if self.suspended {
            f.write_str(" and suspension")?;
        }
        if self.terminating {
            f.write_str(", being deleted")?;
        }
        f.write_str(")")
    }
}

/// What the drain did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DrainReport {
    pub ending: Ending,
    /// Fenced releases the first successful listing found; `None` when no
    /// listing succeeded (what is left is then unknown).
    pub found: Option<usize>,
    /// Releases whose fence is gone (released, or the release is gone).
    pub released: usize,
    /// What is left, as the last listing and the writes since show it.
    pub left: Vec<Left>,
    /// Listings that failed and were retried.
    pub failed_listings: u32,
    /// The last error the apiserver (or the way to it) gave, if the drain
    /// ended without an answer to its last request.
    pub last_error: Option<String>,
}

impl DrainReport {
    /// Something of ours is, or may be, left.
    pub fn anything_left(&self) -> bool {
        self.found.is_none() || !self.left.is_empty()
    }
}

/// Drains the fences in `scope` until every one is gone, the Lease is lost,
/// or `until` passes; writes only while `leadership` is current (the client's gate
/// enforces it, and the drain waits for a lapsed leadership instead of failing
/// every write).
pub async fn drain(
    client: &Client,
    reconciler: &Reconciler,
    scope: &Scope,
    mut leadership: watch::Receiver<Leadership>,
    until: Instant,
    concurrency: usize,
) -> DrainReport {
    let mut report = DrainReport {
        ending: Ending::Deadline,
        found: None,
        released: 0,
        left: Vec::new(),
        failed_listings: 0,
        last_error: None,
    };
    let mut left: BTreeMap<String, Left> = BTreeMap::new();
    report.ending = loop {
        match wait_for_leadership(&mut leadership, until).await {
            LeadershipState::Current => {}
            LeadershipState::Lost => break Ending::LeaseLost,
            LeadershipState::Lapsed => break Ending::Deadline,
        }
        let fenced = match tokio::time::timeout_at(
            until.into(),
            list_fenced(client, scope, reconciler.install()),
        )
        .await
        {
            Err(_) => break Ending::Deadline,
            Ok(Err(err)) => {
                report.failed_listings += 1;
                tracing::warn!(error = %err, "listing fenced HelmReleases failed; retrying");
                report.last_error = Some(err.to_string());
                if !pause(until).await {
                    break Ending::Deadline;
                }
                continue;
            }
            Ok(Ok(fenced)) => fenced,
        };
        report.last_error = None;
        left = fenced.iter().map(|r| (r.key(), Left::of(r))).collect();
        if report.found.is_none() {
            report.found = Some(fenced.len());
            tracing::info!(fenced = fenced.len(), "draining flux-plunger's fences");
        }
        if fenced.is_empty() {
            break Ending::Done;
        }
        let mut outcomes = stream::iter(fenced)
            .map(|release| async move {
                let outcome = reconciler.settle_as_listed(&release).await;
                (release.key(), outcome)
            })
            .buffer_unordered(concurrency.max(1));
        let cut = loop {
            match tokio::time::timeout_at(until.into(), outcomes.next()).await {
                Err(_) => break true,
                Ok(None) => break false,
                Ok(Some((key, outcome))) => {
                    if let Err(err) = &outcome {
                        report.last_error = Some(err.to_string());
                    }
                    account(&mut left, &key, &outcome);
                }
            }
        };
        if cut || !pause(until).await {
            break Ending::Deadline;
        }
    };
    let found = report.found.unwrap_or_default();
    report.released = found.saturating_sub(left.len());
    report.left = left.into_values().collect();
    report
}

/// Notes one release's outcome in what is left, and logs it.
fn account(
    left: &mut BTreeMap<String, Left>,
    key: &str,
    outcome: &Result<Outcome, crate::error::Error>,
) {
    match outcome {
        Ok(Outcome::FenceDropped | Outcome::Gone) => {
            left.remove(key);
            tracing::info!(release = %key, "fence released");
        }
        Ok(Outcome::ReleasedWithoutUninstall) => {
            // The fence is gone all the same: nothing of ours is left on the
            // release, but what Helm installed stayed behind, which an
            // operator has to hear about.
            left.remove(key);
            tracing::warn!(release = %key, "fence released without an uninstall");
        }
        Ok(Outcome::Lifted { kept_fence: false }) => {
            left.remove(key);
            tracing::info!(release = %key, "suspension and fence released");
        }
        Ok(Outcome::Lifted { kept_fence: true }) => {
            if let Some(release) = left.get_mut(key) {
                release.suspended = false;
            }
            tracing::info!(release = %key, "suspension lifted; the fence waits for helm-controller's uninstall");
        }
        Ok(Outcome::HandedOver { revision }) => {
            // A hand-over ends with no suspension of ours: it lifted it, or
            // the release was not suspended (the reconcile request).
            if let Some(release) = left.get_mut(key) {
                release.suspended = false;
            }
            tracing::info!(release = %key, revision, "history handed to helm-controller's uninstall; the fence waits for it");
        }
        Ok(other) => {
            tracing::debug!(release = %key, outcome = ?other, "waiting for helm-controller")
        }
        Err(err) => {
            tracing::warn!(release = %key, error = %err, "could not release; retrying")
        }
    }
}

/// Sleeps one poll interval; false if `until` comes first.
async fn pause(until: Instant) -> bool {
    if Instant::now() + POLL >= until {
        tokio::time::sleep_until(until.into()).await;
        return false;
    }
    tokio::time::sleep(POLL).await;
    true
}

enum LeadershipState {
    Current,
    Lost,
    /// Not current, and not renewed before the deadline.
    Lapsed,
}

/// Waits until the leadership is current (a renewal succeeded), lost, or `until`.
async fn wait_for_leadership(
    leadership: &mut watch::Receiver<Leadership>,
    until: Instant,
) -> LeadershipState {
    let mut said = false;
    loop {
        let now = *leadership.borrow_and_update();
        match now {
            Leadership::Lost => return LeadershipState::Lost,
            now if now.is_current() => return LeadershipState::Current,
            Leadership::Until(_) if !said => {
                tracing::warn!(
                    "the Lease was not renewed in time: writing paused until a renewal succeeds"
                );
                said = true;
            }
            Leadership::Until(_) => {}
        }
        match tokio::time::timeout_at(until.into(), leadership.changed()).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) => return LeadershipState::Lost,
            Err(_) => return LeadershipState::Lapsed,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_release_left_is_named_with_what_of_ours_it_still_carries() {
        let left = |suspended, terminating| Left {
            key: "apps/web".into(),
            suspended,
            terminating,
        };
        assert_eq!(left(false, false).to_string(), "apps/web (fence)");
        assert_eq!(
            left(true, false).to_string(),
            "apps/web (fence and suspension)"
        );
        assert_eq!(
            left(false, true).to_string(),
            "apps/web (fence, being deleted)"
        );
    }

    #[test]
    fn an_outcome_takes_a_release_off_the_list_only_when_its_fence_is_gone() {
        let mut left: BTreeMap<String, Left> = ["a", "b", "c", "d", "e", "f"]
            .iter()
            .map(|k| {
                let release = Left {
                    key: (*k).into(),
                    suspended: true,
                    terminating: true,
                };
                ((*k).to_owned(), release)
            })
            .collect();
        account(&mut left, "a", &Ok(Outcome::FenceDropped));
        account(&mut left, "b", &Ok(Outcome::Lifted { kept_fence: false }));
        account(&mut left, "c", &Ok(Outcome::Lifted { kept_fence: true }));
        account(
            &mut left,
            "d",
            &Ok(Outcome::FenceHeld {
                recheck: Duration::from_secs(60),
                warned: false,
            }),
        );
        account(&mut left, "e", &Ok(Outcome::ReleasedWithoutUninstall));
        account(&mut left, "f", &Ok(Outcome::HandedOver { revision: 2 }));
        assert_eq!(left.keys().collect::<Vec<_>>(), ["c", "d", "f"]);
        assert!(!left["c"].suspended, "the suspension was lifted");
        assert!(left["d"].suspended);
        assert!(
            !left["f"].suspended,
            "a hand-over leaves no suspension of ours"
        );
    }

    #[tokio::test]
    async fn a_lapsed_leadership_is_waited_for_until_renewed_or_lost_or_the_deadline() {
        let (tx, mut rx) = watch::channel(Leadership::Until(Instant::now()));
        let until = Instant::now() + Duration::from_secs(5);
        let renew = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(100)).await;
            tx.send(Leadership::Until(Instant::now() + Duration::from_secs(10)))
                .unwrap();
            tx
        });
        assert!(matches!(
            wait_for_leadership(&mut rx, until).await,
            LeadershipState::Current
        ));
        let tx = renew.await.unwrap();
        tx.send(Leadership::Lost).unwrap();
        assert!(matches!(
            wait_for_leadership(&mut rx, until).await,
            LeadershipState::Lost
        ));
        tx.send(Leadership::Until(Instant::now())).unwrap();
        let started = Instant::now();
        let soon = started + Duration::from_millis(200);
        assert!(matches!(
            wait_for_leadership(&mut rx, soon).await,
            LeadershipState::Lapsed
        ));
        assert!(started.elapsed() < Duration::from_secs(2));
    }
}
