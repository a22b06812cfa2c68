//! Events forwarded to Flux's notification-controller (`--events-addr`), in
//! the event format Flux's own controllers post, so that Flux Alerts fire on
//! flux-plunger's recoveries and warnings like on any Flux event: the
//! release's revision in the metadata (commit-status providers refuse an
//! event without one), and the retries of Flux's own event recorder.

use std::time::Duration;

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};

use crate::names::{HELMRELEASE_API_VERSION, HELMRELEASE_GROUP, HELMRELEASE_KIND};
use crate::notices::EventSpec;
use crate::release::view::ReleaseView;

/// How long one post may take before it counts as failed (Flux's recorder's
/// HTTP timeout).
const POST_TIMEOUT: Duration = Duration::from_secs(5);
/// How many times a failed post is tried again, and the first wait, which
/// doubles each time: Flux's event recorder (a retryablehttp client with its
/// defaults) does the same, so notification-controller meets flux-plunger's
/// events as it meets Flux's.
const RETRIES: u32 = 4;
const FIRST_RETRY_AFTER: Duration = Duration::from_secs(1);
const LONGEST_RETRY_AFTER: Duration = Duration::from_secs(30);

/// How one post ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Posted {
    /// A 2xx answer.
    Accepted,
    /// No answer: the connection failed or the post timed out.
    Unanswered,
    /// Any other HTTP status.
    Answered(u16),
    /// Never sent: no request could be made of the address and the event
    /// (nothing a retry would change).
    Unsendable,
}

/// How long to wait before trying again after post number `attempt` (from
/// 0) ended `posted`, or `None` when it is over. As Flux's recorder: a
/// connection failure or a 5xx answer (but 501, "not implemented") is tried
/// again; 429 is notification-controller saying it has this event already,
/// and any other answer will not change.
pub(crate) fn retry_after(attempt: u32, posted: Posted) -> Option<Duration> {
    let worth_retrying = match posted {
        Posted::Accepted | Posted::Unsendable => false,
        Posted::Unanswered => true,
        Posted::Answered(status) => status >= 500 && status != 501,
    };
    (worth_retrying && attempt < RETRIES)
        .then(|| (FIRST_RETRY_AFTER * 2u32.pow(attempt)).min(LONGEST_RETRY_AFTER))
}

/// The metadata Flux's providers read, keyed as helm-controller keys its own
/// events (`<group>/revision`, `<group>/token`): the chart version
/// helm-controller last tried and the digest of its values.
fn event_metadata(release: &ReleaseView) -> serde_json::Map<String, Value> {
    [
        ("revision", &release.last_attempted_revision),
        ("token", &release.last_attempted_config_digest),
    ]
    .into_iter()
    .filter_map(|(key, value)| {
        value
            .as_ref()
            .map(|v| (format!("{HELMRELEASE_GROUP}/{key}"), json!(v)))
    })
    .collect()
}

/// The body Flux's notification-controller accepts (`event.Event`).
fn flux_event(
    release: &ReleaseView,
    event: &EventSpec,
    instance: Option<&str>,
    now: &str,
) -> Value {
    let mut body = json!({
        "involvedObject": {
            "apiVersion": HELMRELEASE_API_VERSION,
            "kind": HELMRELEASE_KIND,
            "namespace": release.namespace,
            "name": release.name,
            "uid": release.uid,
            "resourceVersion": release.resource_version,
        },
        "severity": if event.warning { "error" } else { "info" },
        "timestamp": now,
        "message": event.note,
        "reason": event.reason,
        "reportingController": "flux-plunger",
    });
    if let Some(instance) = instance {
        body["reportingInstance"] = json!(instance);
    }
    let metadata = event_metadata(release);
    if !metadata.is_empty() {
        body["metadata"] = Value::Object(metadata);
    }
    body
}

/// Posts events to one notification-controller address (http only, as the
/// in-cluster notification-controller serves it).
#[derive(Clone)]
pub struct Forwarder {
    address: http::Uri,
    client: Client<HttpConnector, Full<Bytes>>,
    instance: Option<String>,
}

impl Forwarder {
    /// `address` such as `http://notification-controller.flux-system.svc.cluster.local./`.
    pub fn new(address: &str, instance: Option<String>) -> Result<Self, String> {
        let uri: http::Uri = address
            .parse()
            .map_err(|e| format!("--events-addr {address:?} is not a URL: {e}"))?;
        if uri.scheme_str() != Some("http") || uri.host().is_none() {
            return Err(format!(
                "--events-addr {address:?} must be an http:// URL with a host"
            ));
        }
        Ok(Self {
            address: uri,
            client: Client::builder(TokioExecutor::new()).build_http(),
            instance,
        })
    }

    /// Posts `event` in the background, tried again as [`retry_after`]
    /// says: a slow or absent notification-controller never holds a
    /// recovery. What still fails is logged and dropped.
    pub(crate) fn forward(&self, release: &ReleaseView, event: &EventSpec) {
        let now = k8s_openapi::jiff::Timestamp::now().to_string();
        let body =
            Bytes::from(flux_event(release, event, self.instance.as_deref(), &now).to_string());
        let forwarder = self.clone();
        tokio::spawn(async move { forwarder.deliver(body).await });
    }

    async fn deliver(&self, body: Bytes) {
        let mut attempt = 0;
        loop {
            let posted = self.post(body.clone()).await;
            let Some(wait) = retry_after(attempt, posted) else {
                if posted != Posted::Accepted {
                    tracing::warn!(address = %self.address, attempts = attempt + 1, outcome = ?posted, "notification-controller did not take the event");
                }
                return;
            };
            tokio::time::sleep(wait).await;
            attempt += 1;
        }
    }

    async fn post(&self, body: Bytes) -> Posted {
        let request = http::Request::post(self.address.clone())
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(Full::new(body));
        let Ok(request) = request else {
            return Posted::Unsendable;
        };
        match tokio::time::timeout(POST_TIMEOUT, self.client.request(request)).await {
            Ok(Ok(response)) => {
                let status = response.status();
                let _ = tokio::time::timeout(POST_TIMEOUT, response.into_body().collect()).await;
                if status.is_success() {
                    Posted::Accepted
                } else {
                    Posted::Answered(status.as_u16())
                }
            }
            Ok(Err(err)) => {
                tracing::debug!(error = %err, address = %self.address, "could not post the event to notification-controller");
                Posted::Unanswered
            }
            Err(_) => Posted::Unanswered,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_warning_is_an_error_event_and_the_release_is_the_involved_object() {
        let release = ReleaseView {
            namespace: "apps".into(),
            name: "web".into(),
            uid: "u-1".into(),
            resource_version: "9".into(),
            ..Default::default()
        };
        let event = EventSpec {
            warning: true,
            reason: "UninstallFenceHeld",
            action: "HoldFence",
            note: "held".into(),
        };
        assert_eq!(
            flux_event(&release, &event, Some("pod-a"), "2026-01-01T00:00:00Z"),
            json!({
                "involvedObject": {"apiVersion": "helm.toolkit.fluxcd.io/v2", "kind": "HelmRelease",
                    "namespace": "apps", "name": "web", "uid": "u-1", "resourceVersion": "9"},
                "severity": "error", "timestamp": "2026-01-01T00:00:00Z", "message": "held",
                "reason": "UninstallFenceHeld", "reportingController": "flux-plunger",
                "reportingInstance": "pod-a",
            })
        );
    }

    #[test]
    fn the_revision_and_the_token_are_the_metadata_helm_controller_sends() {
        let release = ReleaseView {
            namespace: "apps".into(),
            name: "web".into(),
            last_attempted_revision: Some("1.2.3".into()),
            last_attempted_config_digest: Some("sha256:abc".into()),
            ..Default::default()
        };
        let event = EventSpec {
            warning: false,
            reason: "Recovered",
            action: "Recover",
            note: "recovered".into(),
        };
        let body = flux_event(&release, &event, None, "2026-01-01T00:00:00Z");
        assert_eq!(
            body["metadata"],
            json!({"helm.toolkit.fluxcd.io/revision": "1.2.3", "helm.toolkit.fluxcd.io/token": "sha256:abc"})
        );
        let unknown = ReleaseView {
            last_attempted_config_digest: None,
            ..release
        };
        assert_eq!(
            flux_event(&unknown, &event, None, "2026-01-01T00:00:00Z")["metadata"],
            json!({"helm.toolkit.fluxcd.io/revision": "1.2.3"})
        );
    }

    #[test]
    fn failed_posts_are_tried_again_as_fluxs_recorder_does() {
        let secs = |attempt, posted| retry_after(attempt, posted).map(|d| d.as_secs());
        // Unanswered or a server error: four more tries, 1, 2, 4 and 8 s apart.
        for posted in [
            Posted::Unanswered,
            Posted::Answered(500),
            Posted::Answered(503),
        ] {
            let waits: Vec<_> = (0..5).map(|a| secs(a, posted)).collect();
            assert_eq!(
                waits,
                [Some(1), Some(2), Some(4), Some(8), None],
                "{posted:?}"
            );
        }
        // Taken, never sendable, a duplicate (429), refused (4xx) or not
        // implemented: done.
        for posted in [
            Posted::Accepted,
            Posted::Unsendable,
            Posted::Answered(429),
            Posted::Answered(400),
            Posted::Answered(499),
            Posted::Answered(501),
        ] {
            assert_eq!(secs(0, posted), None, "{posted:?}");
        }
    }

    #[test]
    fn only_an_http_url_with_a_host_is_accepted() {
        assert!(
            Forwarder::new(
                "http://notification-controller.flux-system.svc.cluster.local./",
                None
            )
            .is_ok()
        );
        let refused = |address: &str| Forwarder::new(address, None).err().unwrap_or_default();
        assert!(refused("https://x/").contains("http://"));
        assert!(refused("not a url").contains("--events-addr"));
    }
}
