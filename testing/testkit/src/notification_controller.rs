//! Flux's real notification-controller, built by `make tools` from its
//! published Go module, running against the local control plane: its event
//! receiver on a loopback port takes events as Flux's controllers (and
//! flux-plunger's `--events-addr`) post them, and forwards each to the
//! `Provider` of every `Alert` that matches it.
//!
//! One notification-controller per test process, started on first use and
//! stopped with it (see [`crate::process`]). It watches all namespaces.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

use crate::control_plane::free_ports;
use crate::flux_controller::{FluxController, pinned_version, scratch_dir};
use crate::webhook_receiver::WebhookReceiver;

/// Names the notification-controller version to run (e.g. `v1.6.0`); unset,
/// the version pinned as `NOTIFICATION_CONTROLLER_VERSION` in
/// `hack/tools/versions.mk`.
pub const VERSION_ENV: &str = "FLUX_PLUNGER_NOTIFICATION_CONTROLLER_VERSION";

/// The API of the `Alert` and `Provider` the pinned version serves.
pub const API_VERSION: &str = "notification.toolkit.fluxcd.io/v1beta3";

/// How long an event may take to reach a receiver once posted.
pub const FORWARD_TIMEOUT: Duration = Duration::from_secs(60);

/// The running notification-controller of this test process.
pub struct NotificationController {
    /// The version running, e.g. `v1.6.0`.
    pub version: String,
    /// Its event receiver, `http://127.0.0.1:PORT/`: where a Flux controller's
    /// `--events-addr` points.
    pub events_url: String,
    events_port: u16,
    /// The process, its log and readiness.
    pub controller: FluxController,
}

static NOTIFICATION_CONTROLLER: OnceLock<Result<NotificationController, String>> = OnceLock::new();

/// The notification-controller of this test process, started on first use
/// (with the control plane, if that is not up yet).
pub fn notification_controller() -> &'static NotificationController {
    crate::started::once(
        &NOTIFICATION_CONTROLLER,
        "notification-controller",
        NotificationController::start,
    )
}

impl NotificationController {
    fn start() -> Result<Self> {
        let version = pinned_version(VERSION_ENV, "NOTIFICATION_CONTROLLER_VERSION")?;
        let dir = scratch_dir("flux-plunger-nc-")?;
        let [events_port, receiver_port] = free_ports()?;
        let args = vec![
            "--watch-all-namespaces=true".to_owned(),
            format!("--events-addr=127.0.0.1:{events_port}"),
            // The webhook receiver (Receiver objects) is unused here, but
            // listens anyway: on loopback, not on every interface.
            format!("--receiverAddr=127.0.0.1:{receiver_port}"),
        ];
        let controller =
            FluxController::start("notification-controller", &version, &dir, args, &[])?;
        // Its event server starts beside the manager, not under its
        // readiness check: wait until it listens too.
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(("127.0.0.1", events_port)).is_err() {
            if Instant::now() > deadline {
                bail!(
                    "{} does not listen for events; its log:\n{}",
                    controller.name,
                    controller.log_tail(40)
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(Self {
            version,
            events_url: format!("http://127.0.0.1:{events_port}/"),
            events_port,
            controller,
        })
    }

    /// POSTs `event` (Flux's eventv1.Event JSON) to the event receiver, as a
    /// Flux controller does, and returns the HTTP status: 202 once taken
    /// (matched or not), 429 for a duplicate within the rate-limit interval.
    pub fn post_event(&self, event: &Value) -> Result<u16> {
        use std::io::{Read, Write};
        let body = serde_json::to_vec(event)?;
        let mut stream = std::net::TcpStream::connect(("127.0.0.1", self.events_port))
            .context("connecting to notification-controller's event receiver")?;
        stream.set_read_timeout(Some(Duration::from_secs(30)))?;
        write!(
            stream,
            "POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        )?;
        stream.write_all(&body)?;
        let mut response = String::new();
        stream.read_to_string(&mut response)?;
        response
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .with_context(|| format!("no HTTP status in {response:?}"))
    }

    /// Waits until an Alert in the namespace of `like`'s involved object
    /// forwards events like `like` to `receiver`.
    ///
    /// notification-controller matches events against the Alerts and reads
    /// the Providers in its informer cache, and neither reports when it has
    /// seen one (they have no status). So a probe, `like` with a message of
    /// its own, is posted, and posted again (with a new message, since an
    /// identical event would be dropped as a duplicate for five minutes)
    /// each time the controller logs that it discarded one for that
    /// namespace, until one arrives. The event the test cares about then
    /// goes once.
    pub async fn wait_until_forwarding(
        &self,
        like: &Value,
        receiver: &WebhookReceiver,
    ) -> Result<()> {
        let namespace = like["involvedObject"]["namespace"]
            .as_str()
            .context("the event names no involvedObject.namespace")?
            .to_owned();
        let deadline = Instant::now() + FORWARD_TIMEOUT;
        let mut attempt = 0;
        loop {
            attempt += 1;
            let message = format!("testkit: is this forwarded? (probe {attempt})");
            let mut probe = like.clone();
            probe["message"] = json!(message);
            let discards_before = self.discards_in(&namespace);
            let status = self.post_event(&probe)?;
            if status != 202 {
                bail!("notification-controller answered {status} to probe {attempt}");
            }
            loop {
                if receiver
                    .received()
                    .iter()
                    .any(|r| r.body["message"] == message.as_str())
                {
                    eprintln!(
                        "testkit: {namespace}: notification-controller forwards (probe {attempt})"
                    );
                    return Ok(());
                }
                if self.discards_in(&namespace) > discards_before {
                    // Not in the cache yet: give the watch a moment before
                    // the next probe rather than spin.
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    break;
                }
                if Instant::now() > deadline {
                    bail!(
                        "no probe reached {} in {}s; notification-controller log:\n{}",
                        receiver.url,
                        FORWARD_TIMEOUT.as_secs(),
                        self.controller.log_tail(40)
                    );
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }

    /// How many events of `namespace` notification-controller has logged
    /// as matched by no Alert, or not forwarded for want of a Provider.
    fn discards_in(&self, namespace: &str) -> usize {
        let quoted = format!("\"{namespace}\"");
        [
            "discarding event, no alerts found",
            "failed to dispatch notification",
        ]
        .iter()
        .flat_map(|needle| self.controller.log_lines_with(needle))
        .filter(|line| line.contains(&quoted))
        .count()
    }
}

/// Creates in `ns` a generic-webhook `Provider` posting to `receiver` and an
/// `Alert` sending it every HelmRelease event of `ns` (both named
/// `receiver`).
pub async fn alert_helmreleases_to(
    ns: &crate::TestNamespace,
    receiver: &WebhookReceiver,
) -> Result<()> {
    for (kind, object) in [
        (
            "Provider",
            generic_provider(&ns.name, "receiver", &receiver.url),
        ),
        ("Alert", helmrelease_alert(&ns.name, "receiver", "receiver")),
    ] {
        let api: kube::Api<kube::api::DynamicObject> =
            kube::Api::namespaced_with(ns.client.clone(), &ns.name, &resource(kind));
        api.create(&Default::default(), &serde_json::from_value(object)?)
            .await?;
    }
    Ok(())
}

/// A `Provider` of type `generic` posting to `address`.
pub fn generic_provider(namespace: &str, name: &str, address: &str) -> Value {
    json!({
        "apiVersion": API_VERSION,
        "kind": "Provider",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"type": "generic", "address": address},
    })
}

/// An `Alert` sending every event of every HelmRelease in `namespace`, of any
/// severity, to Provider `provider`.
pub fn helmrelease_alert(namespace: &str, name: &str, provider: &str) -> Value {
    json!({
        "apiVersion": API_VERSION,
        "kind": "Alert",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "providerRef": {"name": provider},
            "eventSeverity": "info",
            "eventSources": [{"kind": "HelmRelease", "name": "*"}],
        },
    })
}

/// The API resource of notification-controller's `kind` (`Alert`, `Provider`)
/// at [`API_VERSION`].
pub fn resource(kind: &str) -> kube::api::ApiResource {
    let (group, version) = API_VERSION.split_once('/').expect("group/version");
    kube::api::ApiResource::from_gvk_with_plural(
        &kube::core::GroupVersionKind::gvk(group, version, kind),
        &format!("{}s", kind.to_lowercase()),
    )
}
