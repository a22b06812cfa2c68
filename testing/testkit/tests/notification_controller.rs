//! Flux's real notification-controller (built by `make tools`) on the local
//! control plane: an event posted to its event receiver, as a Flux controller
//! or flux-plunger's `--events-addr` posts one, reaches the generic-webhook
//! `Provider` of the `Alert` that matches it, with the metadata Flux keeps
//! (under the involved object's group) and only that.

use anyhow::Result;
use serde_json::{Value, json};
use testkit::notification_controller::{
    FORWARD_TIMEOUT, alert_helmreleases_to, notification_controller,
};
use testkit::webhook_receiver::WebhookReceiver;
use testkit::{TestNamespace, control_plane};

/// A `Recovered` event of HelmRelease `demo` in `namespace`, as Flux's
/// eventv1.Event JSON.
fn recovered_event(namespace: &str) -> Value {
    json!({
        "involvedObject": {
            "apiVersion": plunger::names::HELMRELEASE_API_VERSION,
            "kind": plunger::names::HELMRELEASE_KIND,
            "namespace": namespace,
            "name": "demo",
        },
        "severity": "info",
        "timestamp": "2026-01-01T00:00:00Z",
        "message": "recovered: deleted the stuck storage revision 3",
        "reason": "Recovered",
        "reportingController": "flux-plunger",
        "metadata": {
            // Forwarded as `revision`: a key under the involved object's
            // group (or the event group) reaches the provider without it.
            "helm.toolkit.fluxcd.io/revision": "1.0.0",
            // Dropped: notification-controller forwards no other metadata.
            "flux-plunger.cozystack.io/revision": "3",
        },
    })
}

#[tokio::test]
async fn an_event_of_a_helmrelease_reaches_the_generic_provider_of_the_alert_matching_it()
-> Result<()> {
    let controller = notification_controller();
    let client = control_plane().client().await?;
    let ns = TestNamespace::create(&client, "notify").await?;
    let receiver = WebhookReceiver::start()?;
    alert_helmreleases_to(&ns, &receiver).await?;

    let event = recovered_event(&ns.name);
    controller.wait_until_forwarding(&event, &receiver).await?;
    assert_eq!(controller.post_event(&event)?, 202);

    let forwarded = receiver
        .wait_for("the Recovered event", FORWARD_TIMEOUT, |body| {
            body["reason"] == "Recovered" && body["message"] == event["message"]
        })
        .await?;
    for field in ["kind", "namespace", "name"] {
        assert_eq!(
            forwarded["involvedObject"][field], event["involvedObject"][field],
            "{forwarded:#}"
        );
    }
    assert_eq!(forwarded["severity"], "info", "{forwarded:#}");
    assert_eq!(
        forwarded["reportingController"], "flux-plunger",
        "{forwarded:#}"
    );
    assert_eq!(
        forwarded["metadata"],
        json!({"revision": "1.0.0"}),
        "{forwarded:#}"
    );
    Ok(())
}
