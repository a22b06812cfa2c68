//! The leader Lease that keeps a single writer (SPEC §6).
//!
//! A rollout, an eviction or a node drain starts the next flux-plunger pod
//! while the old one is still stopping and draining, so the Lease, not the
//! Deployment strategy, keeps one writer. The controller never gives the Lease
//! up when it stops: its drain sidecar renews it, drains, and only then hands
//! it over, so the next pod leads seconds after the drain ends instead of
//! waiting for the Lease to run out (which only a crash costs).
//!
//! Expiry is judged client-go's way, from when this process last saw the
//! record change, never by comparing another node's clock with ours.

use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kube::api::{Api, ObjectMeta, PostParams};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::timings::Timings;

/// What one attempt found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Attempt {
    /// We hold the Lease (taken or renewed just now).
    Held,
    /// Another holder's Lease is still valid.
    HeldBy(String),
}

/// What a renewal found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Renewal {
    /// Renewed: the Lease is ours, and nobody wrote it since we last did.
    Renewed,
    /// The Lease names someone else, or nobody (`None`): it is not ours.
    NotOurs(Option<String>),
}

/// Leadership as a writer sees it right before each write (a value watched,
/// never a flag polled in a loop): valid until a moment on this process's clock, or
/// lost for good.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Leadership {
    /// Ours until this instant: the last successful renewal was *sent* a
    /// renew deadline before it, and no candidate can take the Lease until a
    /// whole Lease duration after it has seen that renewal.
    Until(Instant),
    /// Taken over, handed over, or possibly expired: never write again.
    Lost,
}

impl Leadership {
    /// A write may be sent now.
    pub fn is_current(&self) -> bool {
        matches!(self, Leadership::Until(until) if Instant::now() < *until)
    }
}

/// One candidate for one Lease.
pub struct LeaseLock {
    api: Api<Lease>,
    name: String,
    identity: String,
    duration: Duration,
    /// The last record seen (resourceVersion) and when we first saw it.
    observed: Option<(String, Instant)>,
    /// The Lease as our last successful write left it, while we hold it.
    written: Option<Lease>,
}

impl LeaseLock {
    pub fn new(
        client: Client,
        namespace: &str,
        name: &str,
        identity: &str,
        duration: Duration,
    ) -> Self {
        Self {
            api: Api::namespaced(client, namespace),
            name: name.to_owned(),
            identity: identity.to_owned(),
            duration,
            observed: None,
            written: None,
        }
    }

    pub(crate) fn identity(&self) -> &str {
        &self.identity
    }

    /// Takes the Lease if it is free, expired or already ours, renewing it in
    /// the last case. Every update is preconditioned on the resourceVersion
    /// read, so two candidates can never both succeed.
    pub async fn try_acquire_or_renew(&mut self) -> kube::Result<Attempt> {
        let now = Instant::now();
        if self.renew_own_write(now).await? {
            return Ok(Attempt::Held);
        }
        let Some(current) = self.api.get_opt(&self.name).await? else {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(self.name.clone()),
                    ..ObjectMeta::default()
                },
                spec: Some(self.spec(None, 0)),
            };
            return match self.api.create(&PostParams::default(), &lease).await {
                Ok(created) => Ok(self.held(created, now)),
                Err(kube::Error::Api(s)) if s.code == 409 => Ok(Attempt::HeldBy(String::new())),
                Err(e) => Err(e),
            };
        };
        self.observe(&current, now);
        let spec = current.spec.clone().unwrap_or_default();
        let holder = spec.holder_identity.clone().unwrap_or_default();
        let ours = holder == self.identity;
        if !ours && !holder.is_empty() && !self.expired(&spec) {
            return Ok(Attempt::HeldBy(holder));
        }
        let transitions = spec.lease_transitions.unwrap_or(0) + i32::from(!ours);
        let acquired = if ours {
            spec.acquire_time.clone()
        } else {
            None
        };
        let mut updated = current.clone();
        updated.spec = Some(self.spec(acquired, transitions));
        match self
            .api
            .replace(&self.name, &PostParams::default(), &updated)
            .await
        {
            Ok(written) => Ok(self.held(written, now)),
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(Attempt::HeldBy(holder)),
            Err(e) => Err(e),
        }
    }

    /// Renews the Lease only if it is still ours: unlike
    /// [`Self::try_acquire_or_renew`], never takes a Lease that is free or
    /// expired. Preconditioned like every update, so it cannot succeed after
    /// a takeover: a success proves nobody led in between.
    pub async fn renew(&mut self) -> kube::Result<Renewal> {
        let now = Instant::now();
        if self.renew_own_write(now).await? {
            return Ok(Renewal::Renewed);
        }
        let Some(mut current) = self.api.get_opt(&self.name).await? else {
            return Ok(Renewal::NotOurs(None));
        };
        self.observe(&current, now);
        let spec = current.spec.get_or_insert_with(LeaseSpec::default);
        let holder = spec.holder_identity.clone().filter(|h| !h.is_empty());
        if holder.as_deref() != Some(self.identity.as_str()) {
            return Ok(Renewal::NotOurs(holder));
        }
        let renewed = self.spec(
            spec.acquire_time.clone(),
            spec.lease_transitions.unwrap_or(0),
        );
        *spec = renewed;
        match self
            .api
            .replace(&self.name, &PostParams::default(), &current)
            .await
        {
            Ok(written) => {
                self.held(written, now);
                Ok(Renewal::Renewed)
            }
            // Written since the read (409): by whom, the next try reads.
            Err(e) => Err(e),
        }
    }

    /// client-go's fast path: a holder renews with one update, preconditioned
    /// on the resourceVersion of its own last write. False when there is no
    /// such write or it was written over since (a takeover, a hand-over: 409)
    /// or deleted (404): then a read decides. An unanswered update is an
    /// error: it may or may not have landed, and the next try reads.
    async fn renew_own_write(&mut self, now: Instant) -> kube::Result<bool> {
        let Some(mut ours) = self.written.take() else {
            return Ok(false);
        };
        let spec = ours.spec.clone().unwrap_or_default();
        ours.spec = Some(self.spec(spec.acquire_time, spec.lease_transitions.unwrap_or(0)));
        match self
            .api
            .replace(&self.name, &PostParams::default(), &ours)
            .await
        {
            Ok(written) => {
                self.held(written, now);
                Ok(true)
            }
            Err(kube::Error::Api(s)) if s.code == 409 || s.code == 404 => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Who holds the Lease now, if anyone (an empty holder counts as none).
    pub async fn holder(&self) -> kube::Result<Option<String>> {
        Ok(self
            .api
            .get_opt(&self.name)
            .await?
            .and_then(|l| l.spec)
            .and_then(|s| s.holder_identity)
            .filter(|h| !h.is_empty()))
    }

    /// Hands the Lease over: clears the holder if it is still us, so the next
    /// candidate takes it at its next try. Not done when the controller stops
    /// (the drain must act first), only when the drain is done.
    pub async fn release(&self) -> kube::Result<bool> {
        let Some(mut current) = self.api.get_opt(&self.name).await? else {
            return Ok(false);
        };
        let spec = current.spec.get_or_insert_with(LeaseSpec::default);
        if spec.holder_identity.as_deref() != Some(self.identity.as_str()) {
            return Ok(false);
        }
        spec.holder_identity = None;
        spec.renew_time = Some(MicroTime(Timestamp::now()));
        // A one-second duration tells readers that rely on times, too, that it is free.
        spec.lease_duration_seconds = Some(1);
        match self
            .api
            .replace(&self.name, &PostParams::default(), &current)
            .await
        {
            Ok(_) => Ok(true),
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
            Err(e) => Err(e),
        }
    }

    fn spec(&self, acquire_time: Option<MicroTime>, transitions: i32) -> LeaseSpec {
        let now = MicroTime(Timestamp::now());
        LeaseSpec {
            holder_identity: Some(self.identity.clone()),
            lease_duration_seconds: Some(
                i32::try_from(self.duration.as_secs()).unwrap_or(i32::MAX),
            ),
            acquire_time: Some(acquire_time.unwrap_or_else(|| now.clone())),
            renew_time: Some(now),
            lease_transitions: Some(transitions),
            ..LeaseSpec::default()
        }
    }

    /// Our write of the Lease succeeded: it is ours, as `written` left it.
    fn held(&mut self, written: Lease, now: Instant) -> Attempt {
        self.observe(&written, now);
        self.written = Some(written);
        Attempt::Held
    }

    fn observe(&mut self, lease: &Lease, now: Instant) {
        let version = lease.metadata.resource_version.clone().unwrap_or_default();
        match &self.observed {
            Some((seen, _)) if *seen == version => {}
            _ => self.observed = Some((version, now)),
        }
    }

    /// Expired: the record has not changed for its own duration, measured on
    /// our clock since we first saw it.
    fn expired(&self, spec: &LeaseSpec) -> bool {
        let duration = spec
            .lease_duration_seconds
            .and_then(|s| u64::try_from(s).ok())
            .map(Duration::from_secs)
            .unwrap_or(self.duration);
        self.observed
            .as_ref()
            .is_some_and(|(_, since)| since.elapsed() >= duration)
    }
}

/// How a holder keeps its Lease: how often it renews, how long each renewal
/// lets its writes go out, and when it is lost for good.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Keeping {
    /// Between renewals while they succeed.
    pub renew_every: Duration,
    /// Between tries after a renewal failed.
    pub retry_every: Duration,
    /// Each try's own bound: a renewal that does not answer is a failed one.
    pub attempt_timeout: Duration,
    /// How long after a successful renewal was *sent* writes may go out.
    pub claim_for: Duration,
    /// Lost for good once no renewal has succeeded for this long.
    pub lost_after: Duration,
}

impl Keeping {
    /// The controller's: quiet while renewals succeed (the renew interval),
    /// every retry period after a failure, and lost at the renew deadline
    /// (the controller then stops at once and exits).
    pub fn controller(timings: &Timings) -> Self {
        Self {
            renew_every: timings.lease_renew_interval,
            retry_every: timings.lease_retry_period,
            attempt_timeout: timings.lease_retry_period.max(Duration::from_secs(1)),
            claim_for: timings.lease_renew_deadline,
            lost_after: timings.lease_renew_deadline,
        }
    }

    /// The drain's: every retry period; after failed renewals its writes wait
    /// for the next success, and it is lost for good only when the Lease
    /// could have expired (no renewal for a whole Lease duration).
    pub fn drain(timings: &Timings) -> Self {
        Self {
            renew_every: timings.lease_retry_period,
            retry_every: timings.lease_retry_period,
            attempt_timeout: timings.lease_retry_period,
            claim_for: timings.lease_renew_deadline,
            lost_after: timings.lease_duration,
        }
    }
}

/// Waits until this process leads: tries to take the Lease every
/// `retry_period`, saying once per holder who leads meanwhile. Returns when
/// the successful try was *sent* (what [`lead`] counts the leadership
/// from), or `None` once `stopped` resolves first.
pub async fn wait_to_lead(
    lock: &mut LeaseLock,
    retry_period: Duration,
    stopped: impl Future<Output = ()>,
) -> Option<Instant> {
    let mut stopped = std::pin::pin!(stopped);
    let mut last_holder = None;
    loop {
        let sent = Instant::now();
        match lock.try_acquire_or_renew().await {
            Ok(Attempt::Held) => {
                tracing::info!(identity = lock.identity(), "became the leader");
                return Some(sent);
            }
            Ok(Attempt::HeldBy(holder)) => {
                if last_holder.as_ref() != Some(&holder) {
                    tracing::info!(holder = %holder, "waiting for the leader Lease");
                    last_holder = Some(holder);
                }
            }
            Err(err) => {
                tracing::warn!(error = %err, "could not read or take the leader Lease; retrying")
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(retry_period) => {}
            _ = &mut stopped => return None,
        }
    }
}

/// A Lease this process holds, renewed by a task of its own. Writers look
/// at its [`Leadership`] right before each write; [`Leading::lost`] resolves once it
/// is lost for good (taken over, handed over by someone else, or possibly
/// expired).
pub struct Leading {
    leadership: watch::Receiver<Leadership>,
    stop: CancellationToken,
    task: JoinHandle<LeaseLock>,
}

/// Keeps `lock` (whose Lease a renewal *sent* at `renewed_at` took or
/// renewed) the way `keeping` says, until [`Leading::stop`].
pub fn lead(lock: LeaseLock, renewed_at: Instant, keeping: Keeping) -> Leading {
    let (leadership_tx, leadership) =
        watch::channel(Leadership::Until(renewed_at + keeping.claim_for));
    let stop = CancellationToken::new();
    let task = tokio::spawn(keep(lock, keeping, renewed_at, leadership_tx, stop.clone()));
    Leading {
        leadership,
        stop,
        task,
    }
}

impl Leading {
    /// The leadership, for a client that holds writes back while it is not current.
    pub fn leadership(&self) -> watch::Receiver<Leadership> {
        self.leadership.clone()
    }

    /// Resolves once the Lease is lost for good; never, if it is stopped
    /// first.
    pub fn lost(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut leadership = self.leadership.clone();
        async move {
            if leadership
                .wait_for(|c| *c == Leadership::Lost)
                .await
                .is_err()
            {
                std::future::pending::<()>().await;
            }
        }
    }

    /// Stops renewing (a renewal under way is dropped: whoever looks at the
    /// Lease next reads it afresh) and gives the lock back, to hand the
    /// Lease over or to leave it as it is.
    pub async fn stop(self) -> Option<LeaseLock> {
        self.stop.cancel();
        self.task.await.ok()
    }
}

async fn keep(
    mut lock: LeaseLock,
    keeping: Keeping,
    mut last_renewal: Instant,
    leadership: watch::Sender<Leadership>,
    stop: CancellationToken,
) -> LeaseLock {
    let mut next_in = keeping.renew_every;
    loop {
        tokio::select! {
            () = stop.cancelled() => return lock,
            () = tokio::time::sleep(next_in) => {}
        }
        let sent = Instant::now();
        let renewal = tokio::select! {
            () = stop.cancelled() => return lock,
            renewal = tokio::time::timeout(keeping.attempt_timeout, lock.renew()) => renewal,
        };
        match renewal {
            Ok(Ok(Renewal::Renewed)) => {
                last_renewal = sent;
                let _ = leadership.send(Leadership::Until(sent + keeping.claim_for));
                next_in = keeping.renew_every;
                continue;
            }
            Ok(Ok(Renewal::NotOurs(holder))) => {
                tracing::error!(holder = ?holder, "the Lease is no longer ours: stopped writing");
                let _ = leadership.send(Leadership::Lost);
                return lock;
            }
            Ok(Err(err)) => tracing::warn!(error = %err, "could not renew the Lease"),
            Err(_) => tracing::warn!("renewing the Lease timed out"),
        }
        if last_renewal.elapsed() >= keeping.lost_after {
            tracing::error!(
                lost_after = ?keeping.lost_after,
                "no renewal of the Lease succeeded in time, and it may have passed to another pod: stopped writing"
            );
            let _ = leadership.send(Leadership::Lost);
            return lock;
        }
        next_in = keeping.retry_every;
    }
}
