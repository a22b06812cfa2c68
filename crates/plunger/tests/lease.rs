//! The leader Lease against a real apiserver (SPEC §6): who may take it,
//! when, and what each write leaves in the record. Expiry is judged from when
//! a candidate first saw the record unchanged, never from the clocks in it.

use std::time::Duration;

use anyhow::Result;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use kube::Api;
use plunger::lease::{Attempt, LeaseLock, Renewal};
use testkit::{TestNamespace, control_plane};

const NAME: &str = "flux-plunger";
/// Short, so that expiry is seen within a test; the chart's is G / 3.3.
const DURATION: Duration = Duration::from_secs(2);

async fn namespace(prefix: &str) -> Result<TestNamespace> {
    let client = control_plane().client().await?;
    TestNamespace::create(&client, prefix).await
}

fn candidate(ns: &TestNamespace, identity: &str) -> LeaseLock {
    LeaseLock::new(ns.client.clone(), &ns.name, NAME, identity, DURATION)
}

async fn record(ns: &TestNamespace) -> Result<LeaseSpec> {
    let leases: Api<Lease> = Api::namespaced(ns.client.clone(), &ns.name);
    Ok(leases.get(NAME).await?.spec.unwrap_or_default())
}

#[tokio::test]
async fn a_free_lease_is_created_held_and_renewed_by_its_holder_alone() -> Result<()> {
    let ns = namespace("lease-take").await?;
    let mut first = candidate(&ns, "pod-a");
    let mut second = candidate(&ns, "pod-b");

    assert_eq!(first.try_acquire_or_renew().await?, Attempt::Held);
    let taken = record(&ns).await?;
    assert_eq!(taken.holder_identity.as_deref(), Some("pod-a"));
    assert_eq!(taken.lease_duration_seconds, Some(2));
    assert_eq!(taken.lease_transitions, Some(0));
    assert!(taken.acquire_time.is_some() && taken.renew_time.is_some());

    assert_eq!(
        second.try_acquire_or_renew().await?,
        Attempt::HeldBy("pod-a".to_owned())
    );
    assert_eq!(first.holder().await?.as_deref(), Some("pod-a"));

    // A renewal keeps when it was acquired and how often it changed hands.
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(first.try_acquire_or_renew().await?, Attempt::Held);
    let renewed = record(&ns).await?;
    assert_eq!(renewed.acquire_time, taken.acquire_time);
    assert_eq!(renewed.lease_transitions, Some(0));
    assert_ne!(renewed.renew_time, taken.renew_time);
    Ok(())
}

/// A candidate that first sees a record which is already old by its own
/// timestamps still waits a whole duration from then: another node's clock
/// is never compared with ours. Renewals keep the holder; once the record
/// stops changing for a duration, the candidate takes it over.
#[tokio::test]
async fn a_lease_is_taken_over_only_after_it_stayed_unchanged_for_its_duration() -> Result<()> {
    let ns = namespace("lease-expiry").await?;
    let mut holder = candidate(&ns, "pod-a");
    assert_eq!(holder.try_acquire_or_renew().await?, Attempt::Held);
    let taken = record(&ns).await?;
    // Old by its own times before the candidate ever looks.
    tokio::time::sleep(DURATION + Duration::from_millis(500)).await;

    let mut next = candidate(&ns, "pod-b");
    assert_eq!(
        next.try_acquire_or_renew().await?,
        Attempt::HeldBy("pod-a".to_owned()),
        "first seen now: not expired yet"
    );
    // The holder renews meanwhile: the record changed, the wait starts again.
    tokio::time::sleep(DURATION / 2).await;
    assert_eq!(holder.try_acquire_or_renew().await?, Attempt::Held);
    tokio::time::sleep(DURATION / 2 + Duration::from_millis(300)).await;
    assert_eq!(
        next.try_acquire_or_renew().await?,
        Attempt::HeldBy("pod-a".to_owned()),
        "renewed less than a duration ago"
    );
    // The holder stops renewing (a crash): a duration later it is taken.
    tokio::time::sleep(DURATION + Duration::from_millis(300)).await;
    assert_eq!(next.try_acquire_or_renew().await?, Attempt::Held);
    let moved = record(&ns).await?;
    assert_eq!(moved.holder_identity.as_deref(), Some("pod-b"));
    assert_eq!(moved.lease_transitions, Some(1));
    assert_ne!(moved.acquire_time, taken.acquire_time);
    // The old holder, back, finds it taken.
    assert_eq!(
        holder.try_acquire_or_renew().await?,
        Attempt::HeldBy("pod-b".to_owned())
    );
    Ok(())
}

#[tokio::test]
async fn a_handed_over_lease_is_taken_at_once_and_only_its_holder_can_hand_it_over() -> Result<()> {
    let ns = namespace("lease-handover").await?;
    let mut holder = candidate(&ns, "pod-a");
    let mut next = candidate(&ns, "pod-b");
    assert_eq!(holder.try_acquire_or_renew().await?, Attempt::Held);
    assert_eq!(
        next.try_acquire_or_renew().await?,
        Attempt::HeldBy("pod-a".to_owned())
    );

    assert!(
        !next.release().await?,
        "not the holder: nothing handed over"
    );
    assert_eq!(record(&ns).await?.holder_identity.as_deref(), Some("pod-a"));

    assert!(holder.release().await?);
    let free = record(&ns).await?;
    assert_eq!(free.holder_identity, None);
    assert_eq!(free.lease_duration_seconds, Some(1));
    assert_eq!(holder.holder().await?, None);
    assert_eq!(next.try_acquire_or_renew().await?, Attempt::Held);
    assert_eq!(record(&ns).await?.holder_identity.as_deref(), Some("pod-b"));
    Ok(())
}

/// Two candidates at once on a free Lease: each write is preconditioned on
/// the resourceVersion it read, so however their requests interleave, exactly
/// one holds it (the other meets a 409, or reads the winner's record).
#[tokio::test]
async fn of_two_candidates_writing_the_same_record_only_one_wins() -> Result<()> {
    let ns = namespace("lease-race").await?;
    let mut released = candidate(&ns, "pod-old");
    assert_eq!(released.try_acquire_or_renew().await?, Attempt::Held);
    assert!(released.release().await?);

    let mut a = candidate(&ns, "pod-a");
    let mut b = candidate(&ns, "pod-b");
    let (ra, rb) = tokio::join!(a.try_acquire_or_renew(), b.try_acquire_or_renew());
    let outcomes = [ra?, rb?];
    let winners = outcomes.iter().filter(|o| **o == Attempt::Held).count();
    assert_eq!(winners, 1, "{outcomes:?}");
    let holder = record(&ns).await?.holder_identity.unwrap_or_default();
    assert!(holder == "pod-a" || holder == "pod-b");
    Ok(())
}

#[tokio::test]
async fn a_renewal_keeps_only_a_lease_that_is_still_ours_and_never_takes_one() -> Result<()> {
    let ns = namespace("lease-renew").await?;
    let mut holder = candidate(&ns, "pod-a");
    let mut other = candidate(&ns, "pod-b");

    // No Lease at all, then a Lease someone else holds: nothing is taken.
    assert_eq!(holder.renew().await?, Renewal::NotOurs(None));
    assert_eq!(other.try_acquire_or_renew().await?, Attempt::Held);
    assert_eq!(
        holder.renew().await?,
        Renewal::NotOurs(Some("pod-b".to_owned()))
    );
    assert!(other.release().await?);
    assert_eq!(holder.renew().await?, Renewal::NotOurs(None), "free");
    assert_eq!(record(&ns).await?.holder_identity, None);

    // Ours: renewed.
    assert_eq!(holder.try_acquire_or_renew().await?, Attempt::Held);
    let before = record(&ns).await?;
    assert_eq!(holder.renew().await?, Renewal::Renewed);
    assert_ne!(record(&ns).await?.renew_time, before.renew_time);
    // A takeover in between (the Lease ran out for another candidate): the
    // renewal's precondition fails and it says whose the Lease is now.
    tokio::time::sleep(DURATION + Duration::from_millis(200)).await;
    assert_eq!(
        other.try_acquire_or_renew().await?,
        Attempt::HeldBy("pod-a".to_owned()),
        "first sight of the record starts its clock"
    );
    tokio::time::sleep(DURATION + Duration::from_millis(200)).await;
    assert_eq!(other.try_acquire_or_renew().await?, Attempt::Held);
    assert_eq!(
        holder.renew().await?,
        Renewal::NotOurs(Some("pod-b".to_owned()))
    );
    Ok(())
}

/// The holder's task renews the Lease on its cadence and keeps the leadership
/// current; once another pod holds the Lease it says so once (the leadership is
/// lost, for good), renews no more, and gives the lock back.
#[tokio::test]
async fn a_lease_being_led_keeps_its_leadership_current_until_another_pod_takes_it() -> Result<()> {
    use plunger::lease::{Keeping, Leadership, lead};
    let ns = namespace("lease-held").await?;
    let mut lock = candidate(&ns, "pod-a");
    let sent = std::time::Instant::now();
    assert_eq!(lock.try_acquire_or_renew().await?, Attempt::Held);
    let keeping = Keeping {
        renew_every: Duration::from_millis(200),
        retry_every: Duration::from_millis(200),
        attempt_timeout: Duration::from_secs(2),
        claim_for: Duration::from_secs(1),
        lost_after: DURATION,
    };
    let leading = lead(lock, sent, keeping);
    let mut leadership = leading.leadership();
    let first = record(&ns).await?.renew_time;
    // Renewed while held: the record changes and the leadership moves on.
    leadership.changed().await?;
    assert!(leadership.borrow().is_current());
    assert_ne!(record(&ns).await?.renew_time, first);

    // pod-b takes the Lease over (once pod-a's record would look expired to
    // it; here by hand).
    let leases: Api<Lease> = Api::namespaced(ns.client.clone(), &ns.name);
    let mut taken = leases.get(NAME).await?;
    taken.spec.as_mut().unwrap().holder_identity = Some("pod-b".to_owned());
    leases.replace(NAME, &Default::default(), &taken).await?;
    tokio::time::timeout(Duration::from_secs(10), leading.lost()).await?;
    assert_eq!(*leading.leadership().borrow(), Leadership::Lost);
    let lock = leading.stop().await.expect("the lock back");
    assert_eq!(lock.holder().await?.as_deref(), Some("pod-b"));
    assert!(!lock.release().await?, "not ours to hand over");
    Ok(())
}
