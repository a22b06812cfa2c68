//! flux-plunger's events as a Flux user receives them: posted to the real
//! notification-controller (`--events-addr`, as the chart's `eventsAddr`
//! sets it), matched by an `Alert` for HelmReleases and forwarded to its
//! generic-webhook `Provider`, with the revision commit-status providers
//! need. The release is made stuck by its real cause against the real
//! helm-controller, and the real flux-plunger recovers it.

use anyhow::Result;
use e2e::{FluxPlunger, wait_stuck_saying};
use serde_json::{Value, json};
use testkit::notification_controller::{
    FORWARD_TIMEOUT, alert_helmreleases_to, notification_controller,
};
use testkit::real_causes;
use testkit::real_helm_controller::helm_controller;
use testkit::source_controller::source_controller;
use testkit::webhook_receiver::WebhookReceiver;
use testkit::{TestNamespace, control_plane};

const RELEASE: &str = "demo";

/// An event of HelmRelease [`RELEASE`] in `namespace` shaped as
/// flux-plunger posts one: what the probe that shows the Alert in force is
/// made from.
fn like_flux_plungers(namespace: &str) -> Value {
    json!({
        "involvedObject": {
            "apiVersion": plunger::names::HELMRELEASE_API_VERSION,
            "kind": plunger::names::HELMRELEASE_KIND,
            "namespace": namespace,
            "name": RELEASE,
        },
        "severity": "info",
        "timestamp": "2026-01-01T00:00:00Z",
        "message": "probe",
        "reason": "Probe",
        "reportingController": "flux-plunger",
    })
}

#[tokio::test]
async fn a_recovery_reaches_the_provider_of_an_alert_with_the_revision() -> Result<()> {
    helm_controller();
    source_controller();
    let notifications = notification_controller();
    let client = control_plane().client().await?;
    let ns = TestNamespace::create(&client, "nc-events").await?;
    let receiver = WebhookReceiver::start()?;
    alert_helmreleases_to(&ns, &receiver).await?;
    notifications
        .wait_until_forwarding(&like_flux_plungers(&ns.name), &receiver)
        .await?;

    // Stuck by its real cause: an install remediation that kept the history,
    // then Helm refusing the name as still in use, the value fixed or not.
    real_causes::create_failing_release(&ns, RELEASE, json!({"uninstall": {"keepHistory": true}}))
        .await?;
    let refused = real_causes::name_in_use();
    wait_stuck_saying(&ns, RELEASE, refused, false).await?;
    real_causes::fix_the_values(&ns, RELEASE).await?;
    wait_stuck_saying(&ns, RELEASE, refused, true).await?;

    let events_addr = format!("--events-addr={}", notifications.events_url);
    let flux_plunger = FluxPlunger::start_with(&ns, &[], &[&events_addr]).await?;
    let forwarded = receiver
        .wait_for("flux-plunger's Recovered event", FORWARD_TIMEOUT, |body| {
            body["reason"] == "Recovered" && body["reportingController"] == "flux-plunger"
        })
        .await
        .map_err(|e| {
            e.context(format!(
                "flux-plunger's log:\n{}\nnotification-controller's log:\n{}",
                flux_plunger.log_text(),
                notifications.controller.log_tail(40)
            ))
        })?;
    assert_eq!(forwarded["involvedObject"]["kind"], "HelmRelease");
    assert_eq!(forwarded["involvedObject"]["namespace"], ns.name.as_str());
    assert_eq!(forwarded["involvedObject"]["name"], RELEASE);
    assert_eq!(forwarded["severity"], "info", "{forwarded:#}");
    // notification-controller forwards the keys under the release's group
    // without that prefix: the chart version helm-controller last tried. The
    // digest of its values (the token) it keeps to itself: it tells apart
    // events it would otherwise drop as duplicates.
    assert_eq!(
        forwarded["metadata"],
        json!({"revision": "1.0.0"}),
        "{forwarded:#}"
    );
    Ok(())
}
