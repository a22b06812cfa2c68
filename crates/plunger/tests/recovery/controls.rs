//! The operator's controls (SPEC §9): dry run, rate limit, opt-out, events forwarded to Flux, and
//! the warnings remembered no longer than their interval.

use super::*;

#[tokio::test]
async fn a_dry_run_decides_and_reports_but_writes_nothing() -> Result<()> {
    let w = world("dry-run").await?;
    w.stuck_release("stuck", &[(1, "superseded"), (2, "uninstalling")])
        .await?;
    w.stuck_release("crashed", &[(1, "uninstalling")]).await?;
    w.leave_our_suspension("crashed").await?;
    let before_stuck = w.get("stuck").await?.unwrap();
    let before_crashed = w.get("crashed").await?.unwrap();
    let reconciler = w.reconciler().with_controls(plunger::reconcile::Controls {
        dry_run: true,
        rate_limit: None,
        ..plunger::reconcile::Controls::default()
    });

    let stuck = reconciler.reconcile(&w.ns.name, "stuck").await?;
    let crashed = reconciler.reconcile(&w.ns.name, "crashed").await?;

    assert!(
        matches!(&stuck, Outcome::DryRun { would } if would.contains("sh.helm.release.v1.stuck.v2")),
        "{stuck:?}"
    );
    assert!(
        matches!(&crashed, Outcome::DryRun { would } if would.contains("lift")),
        "{crashed:?}"
    );
    for before in [before_stuck, before_crashed] {
        let after = w
            .get(before.metadata.name.as_deref().unwrap())
            .await?
            .unwrap();
        assert_eq!(
            after.metadata.resource_version,
            before.metadata.resource_version
        );
    }
    assert_eq!(w.revisions().await?.len(), 3, "no Secret deleted");
    let events = w.ns.events_for("stuck").await?;
    assert!(
        events
            .iter()
            .any(|e| e.reason == "RecoveryDryRun" && e.note.contains("would suspend")),
        "{events:?}"
    );
    Ok(())
}

#[tokio::test]
async fn the_recovery_rate_limit_defers_recoveries_past_the_limit() -> Result<()> {
    let w = world("rate-limit").await?;
    w.stuck_release("first", &[(1, "uninstalling")]).await?;
    w.stuck_release("second", &[(1, "uninstalling")]).await?;
    let reconciler = w.reconciler().with_controls(plunger::reconcile::Controls {
        dry_run: false,
        rate_limit: plunger::ratelimit::RateLimiter::per_minute(1),
        ..plunger::reconcile::Controls::default()
    });

    assert_eq!(
        reconciler.reconcile(&w.ns.name, "first").await?,
        Outcome::Recovered { revision: 1 }
    );
    let second = reconciler.reconcile(&w.ns.name, "second").await?;

    assert!(
        matches!(second, Outcome::RateLimited { retry_after } if retry_after > Duration::from_secs(50)),
        "{second:?}"
    );
    // Its recovery waits; the fence holds it meanwhile (SPEC §4.5).
    assert_waiting_fenced(&w.get("second").await?.unwrap());
    assert_eq!(w.revisions().await?, vec!["sh.helm.release.v1.second.v1"]);
    Ok(())
}

#[tokio::test]
async fn a_release_opted_out_by_its_annotation_is_never_recovered() -> Result<()> {
    let w = world("opt-out").await?;
    w.stuck_release("web", &[(1, "uninstalling")]).await?;
    w.ns.releases()
        .patch("web", &PatchParams::default(), &Patch::Merge(json!({"metadata": {"annotations": {"flux-plunger.cozystack.io/recover": "disabled"}}})))
        .await?;
    let before = w.get("web").await?.unwrap();

    assert_eq!(
        w.reconciler().reconcile(&w.ns.name, "web").await?,
        Outcome::NothingToDo
    );

    let after = w.get("web").await?.unwrap();
    assert_eq!(
        after.metadata.resource_version,
        before.metadata.resource_version
    );
    assert_eq!(w.revisions().await?, vec!["sh.helm.release.v1.web.v1"]);
    Ok(())
}

#[tokio::test]
async fn events_are_posted_to_flux_notification_controller_in_its_format() -> Result<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let w = world("notify").await?;
    w.stuck_release("web", &[(1, "uninstalling")]).await?;
    plunger::release::api::helmreleases(w.client.clone(), &w.ns.name)
        .patch_status(
            "web",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {
                "lastAttemptedRevision": "1.0.0",
                "lastAttemptedConfigDigest": "sha256:0123",
            }})),
        )
        .await?;
    // A notification-controller on loopback: keeps each body, and answers
    // the first post 503 (as one restarting does), the others 202.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let address = format!("http://{}/", listener.local_addr()?);
    let (bodies_tx, mut bodies) = tokio::sync::mpsc::unbounded_channel::<Value>();
    tokio::spawn(async move {
        let mut posts = 0;
        while let Ok((mut socket, _)) = listener.accept().await {
            let mut buffer = Vec::new();
            let mut chunk = [0u8; 4096];
            loop {
                let n = socket.read(&mut chunk).await.unwrap_or(0);
                if n == 0 {
                    break;
                }
                buffer.extend_from_slice(&chunk[..n]);
                let text = String::from_utf8_lossy(&buffer).to_string();
                if let Some((head, body)) = text.split_once("\r\n\r\n") {
                    let length: usize = head
                        .lines()
                        .find_map(|l| {
                            l.to_ascii_lowercase()
                                .strip_prefix("content-length:")
                                .map(|v| v.trim().parse().unwrap_or(0))
                        })
                        .unwrap_or(0);
                    if body.len() >= length {
                        assert!(head.starts_with("POST / HTTP/1.1"), "{head}");
                        bodies_tx
                            .send(serde_json::from_str(&body[..length]).unwrap())
                            .unwrap();
                        posts += 1;
                        let answer: &[u8] = if posts == 1 {
                            b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n"
                        } else {
                            b"HTTP/1.1 202 Accepted\r\ncontent-length: 0\r\n\r\n"
                        };
                        socket.write_all(answer).await.unwrap();
                        buffer.clear();
                    }
                }
            }
        }
    });
    let events = Events::new(w.flux_plunger.clone(), "flux-plunger", Some("pod-a".into()))
        .forwarding_to(
            plunger::notify::Forwarder::new(&address, Some("pod-a".into()))
                .map_err(anyhow::Error::msg)?,
        );
    let reconciler = Reconciler::new(w.flux_plunger.clone(), events, Timings::default());

    assert_eq!(
        reconciler.reconcile(&w.ns.name, "web").await?,
        Outcome::Recovered { revision: 1 }
    );

    let refused = tokio::time::timeout(Duration::from_secs(10), bodies.recv())
        .await?
        .expect("an event");
    // Tried again after Flux's recorder's first wait (1 s).
    let body = tokio::time::timeout(Duration::from_secs(10), bodies.recv())
        .await?
        .expect("the event again");
    assert_eq!(refused, body);
    assert_eq!(
        body["metadata"],
        json!({
            "helm.toolkit.fluxcd.io/revision": "1.0.0",
            "helm.toolkit.fluxcd.io/token": "sha256:0123",
        })
    );
    assert_eq!(body["reason"], "Recovered");
    assert_eq!(body["severity"], "info");
    assert_eq!(body["reportingController"], "flux-plunger");
    assert_eq!(body["reportingInstance"], "pod-a");
    assert_eq!(body["involvedObject"]["kind"], "HelmRelease");
    assert_eq!(body["involvedObject"]["namespace"], w.ns.name.as_str());
    assert_eq!(body["involvedObject"]["name"], "web");
    assert!(
        body["message"]
            .as_str()
            .unwrap()
            .contains("reclaimed Helm storage revision 1")
    );
    assert!(body["timestamp"].as_str().unwrap().ends_with('Z'));
    Ok(())
}

// One warning per release per interval, and nothing remembered beyond it.

#[tokio::test]
async fn fence_warnings_are_forgotten_once_their_interval_has_passed() -> Result<()> {
    let w = world("fence-warnings").await?;
    let interval = Duration::from_secs(1);
    let reconciler = Reconciler::new(
        w.client.clone(),
        Events::new(w.client.clone(), "flux-plunger", None),
        Timings {
            fence_recheck_interval: interval,
            fence_held_warning_after: Duration::ZERO,
            ..Timings::default()
        },
    );
    for name in ["first", "second"] {
        // Deleted and fenced; helm-controller has not handled the delete.
        installed(&w, name).await?;
        w.ns.apply_as_flux_plunger(name, false).await?;
        w.delete(name).await?;
    }

    assert!(matches!(
        reconciler.reconcile(&w.ns.name, "first").await?,
        Outcome::FenceHeld { .. }
    ));
    assert_eq!(reconciler.remembered_fence_warnings(), 1);
    // The first warning's interval passes.
    tokio::time::sleep(interval + Duration::from_millis(100)).await;
    assert!(matches!(
        reconciler.reconcile(&w.ns.name, "second").await?,
        Outcome::FenceHeld { .. }
    ));

    assert_eq!(
        reconciler.remembered_fence_warnings(),
        1,
        "only the second release's warning is remembered"
    );
    let warned = |name: &'static str| {
        let ns = &w.ns;
        async move {
            Ok::<_, anyhow::Error>(
                ns.events_for(name)
                    .await?
                    .iter()
                    .any(|e| e.reason == "UninstallFenceHeld"),
            )
        }
    };
    assert!(warned("first").await? && warned("second").await?);
    testkit::strip_fences(&w.ns).await?;
    Ok(())
}
