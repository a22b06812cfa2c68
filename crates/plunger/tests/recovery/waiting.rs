//! A stuck release whose recovery waits keeps the fence (SPEC §4.5), so that a delete meanwhile
//! reaches the uninstall too.

use super::*;

/// Item 2 of the hand-over: a stuck release deleted while its recovery
/// waits. helm-controller's deletion path finds the history it cleared empty
/// and lets go; the fence flux-plunger holds on the waiting release keeps
/// it, the history is handed over and a reconcile requested, and the
/// uninstall happens.
#[tokio::test]
async fn a_stuck_release_deleted_while_its_recovery_waits_is_held_and_uninstalled() -> Result<()> {
    let w = world("waiting-delete").await?;
    w.stuck_release("first", &[(1, "uninstalling")]).await?;
    w.stuck_release("second", &[(1, "superseded"), (2, "uninstalling")])
        .await?;
    let reconciler = w.reconciler().with_controls(plunger::reconcile::Controls {
        dry_run: false,
        rate_limit: plunger::ratelimit::RateLimiter::per_minute(1),
        ..plunger::reconcile::Controls::default()
    });
    assert_eq!(
        reconciler.reconcile(&w.ns.name, "first").await?,
        Outcome::Recovered { revision: 1 }
    );
    assert!(matches!(
        reconciler.reconcile(&w.ns.name, "second").await?,
        Outcome::RateLimited { .. }
    ));

    w.delete("second").await?;
    assert_eq!(
        w.hc.handle("second").await?,
        Handled::NothingRecordedToUninstall
    );
    assert!(w.get("second").await?.is_some(), "the fence holds it");

    assert_eq!(
        reconciler.reconcile(&w.ns.name, "second").await?,
        Outcome::HandedOver { revision: 2 }
    );
    assert_eq!(w.hc.handle("second").await?, Handled::Uninstalled);
    assert_eq!(
        reconciler.reconcile(&w.ns.name, "second").await?,
        Outcome::FenceDropped
    );
    assert!(w.get("second").await?.is_none());
    assert!(!w.hc.resources_exist("second").await?);
    assert_handed_over(&w, "second", 2).await
}

/// The fence a stuck release carried while it waited goes when the storage
/// turns out to hold nothing to reclaim, and when the release is no longer
/// stuck; the drain lets go of it whatever the release's state.
#[tokio::test]
async fn the_fence_of_a_waiting_release_goes_once_nothing_is_to_be_recovered() -> Result<()> {
    let w = world("waiting-gone").await?;
    for name in ["deployed", "unstuck", "drained"] {
        w.stuck_release(name, &[(1, "uninstalling")]).await?;
        w.ns.apply_as_flux_plunger(name, false).await?;
        assert_waiting_fenced(&w.get(name).await?.unwrap());
    }
    // Helm wrote a good revision meanwhile: nothing to reclaim.
    w.ns.create_storage_secret("deployed", 2, "deployed")
        .await?;
    assert_eq!(
        w.reconciler().reconcile(&w.ns.name, "deployed").await?,
        Outcome::Skipped(SkipReason::LatestIsDeployed { latest: 2 })
    );
    assert_let_go(&w.get("deployed").await?.unwrap());

    w.ns.set_ready(
        "unstuck",
        "True",
        "UpgradeSucceeded",
        "Helm upgrade succeeded",
    )
    .await?;
    assert_eq!(
        w.reconciler().reconcile(&w.ns.name, "unstuck").await?,
        Outcome::FenceDropped
    );
    assert_let_go(&w.get("unstuck").await?.unwrap());

    assert_eq!(
        w.reconciler()
            .letting_go()
            .settle(&w.ns.name, "drained")
            .await?,
        Outcome::FenceDropped
    );
    assert_let_go(&w.get("drained").await?.unwrap());
    assert_eq!(
        w.revisions().await?,
        vec![
            "sh.helm.release.v1.deployed.v1",
            "sh.helm.release.v1.deployed.v2",
            "sh.helm.release.v1.drained.v1",
            "sh.helm.release.v1.unstuck.v1",
        ]
    );
    Ok(())
}

/// Releases that wait under the rate limit are queued (SPEC §4): each is told a turn of its own,
/// one interval after the one before, so that they wake one at a time (each wake costs a read and
/// a storage listing) instead of all at once; woken early, a release keeps its turn. (That the
/// recovery is the waiting release's at its turn, whoever else asks, `ratelimit`'s unit tests
/// show on a clock of their own.)
#[tokio::test]
async fn waiting_releases_are_given_turns_of_their_own() -> Result<()> {
    let w = world("waiting-turns").await?;
    let names = ["first", "a", "b", "c"];
    for name in names {
        w.stuck_release(name, &[(1, "superseded"), (2, "uninstalling")])
            .await?;
    }
    let reconciler = w.reconciler().with_controls(plunger::reconcile::Controls {
        rate_limit: plunger::ratelimit::RateLimiter::per_minute(1),
        ..plunger::reconcile::Controls::default()
    });
    assert_eq!(
        reconciler.reconcile(&w.ns.name, "first").await?,
        Outcome::Recovered { revision: 2 }
    );
    let mut turns = Vec::new();
    for name in &names[1..] {
        match reconciler.reconcile(&w.ns.name, name).await? {
            Outcome::RateLimited { retry_after } => turns.push(retry_after),
            other => anyhow::bail!("{name}: {other:?}"),
        }
    }
    let interval = Duration::from_secs(60);
    let slack = Duration::from_secs(5);
    assert!(
        turns[0] <= interval && turns[0] + slack >= interval,
        "{turns:?}"
    );
    for pair in turns.windows(2) {
        let apart = pair[1].saturating_sub(pair[0]);
        assert!(
            apart + slack >= interval && apart <= interval,
            "turns {turns:?} are an interval apart"
        );
    }
    match reconciler.reconcile(&w.ns.name, "c").await? {
        Outcome::RateLimited { retry_after } => assert!(
            retry_after <= turns[2] && retry_after + slack >= turns[2],
            "c keeps its turn: {retry_after:?} of {turns:?}"
        ),
        other => anyhow::bail!("c: {other:?}"),
    }
    Ok(())
}
