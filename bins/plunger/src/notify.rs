//! Events forwarded to Flux's notification-controller (`--events-addr`), in
//! the event format Flux's own controllers post, so that Flux Alerts fire on
//! flux-plunger's recoveries and warnings like on any Flux event.

use std::time::Duration;

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};

use crate::names::{HELMRELEASE_API_VERSION, HELMRELEASE_KIND};
use crate::notices::EventSpec;
use crate::release::view::ReleaseView;

/// How long one post may take before it is given up (logged, not retried).
const POST_TIMEOUT: Duration = Duration::from_secs(5);

/// The body Flux's notification-controller accepts (`event.Event`).
pub fn flux_event(
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

    /// Posts `event`; a failure is logged and dropped.
    pub async fn forward(&self, release: &ReleaseView, event: &EventSpec) {
        let now = k8s_openapi::jiff::Timestamp::now().to_string();
        let body = flux_event(release, event, self.instance.as_deref(), &now);
        let request = http::Request::post(self.address.clone())
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(body.to_string())));
        let Ok(request) = request else {
            return;
        };
        match tokio::time::timeout(POST_TIMEOUT, self.client.request(request)).await {
            Ok(Ok(response)) if response.status().is_success() => {
                let _ = response.into_body().collect().await;
            }
            Ok(Ok(response)) => {
                tracing::warn!(status = %response.status(), address = %self.address, "notification-controller refused the event");
            }
            Ok(Err(err)) => {
                tracing::warn!(error = %err, address = %self.address, "could not post the event to notification-controller")
            }
            Err(_) => {
                tracing::warn!(address = %self.address, "posting the event to notification-controller timed out")
            }
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
