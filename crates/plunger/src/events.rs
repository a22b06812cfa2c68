//! Kubernetes Events on HelmReleases. Events are written straight to the
//! apiserver (kube's recorder awaits each write and folds repeats into a
//! series), so the drain can use the same recorder after the controller has
//! stopped. A failed event write is logged and never fails the caller.

use k8s_openapi::api::core::v1::ObjectReference;
use kube::Client;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};

use crate::names::{HELMRELEASE_API_VERSION, HELMRELEASE_KIND};
use crate::notices::EventSpec;
use crate::release::view::ReleaseView;

/// Records events as one reporting component (`flux-plunger`, or the drain).
#[derive(Clone)]
pub struct Events {
    recorder: Recorder,
    forwarder: Option<crate::notify::Forwarder>,
}

impl Events {
    pub fn new(client: Client, controller: &str, instance: Option<String>) -> Self {
        let reporter = Reporter {
            controller: controller.to_owned(),
            instance,
        };
        Self {
            recorder: Recorder::new(client, reporter),
            forwarder: None,
        }
    }

    /// Also forwards every event to Flux's notification-controller.
    pub fn forwarding_to(mut self, forwarder: crate::notify::Forwarder) -> Self {
        self.forwarder = Some(forwarder);
        self
    }

    /// Records `event` on `release`; logs instead of failing.
    pub(crate) async fn record(&self, release: &ReleaseView, event: &EventSpec) {
        let reference = ObjectReference {
            api_version: Some(HELMRELEASE_API_VERSION.to_owned()),
            kind: Some(HELMRELEASE_KIND.to_owned()),
            name: Some(release.name.clone()),
            namespace: Some(release.namespace.clone()),
            uid: Some(release.uid.clone()).filter(|u| !u.is_empty()),
            ..ObjectReference::default()
        };
        let published = Event {
            type_: if event.warning {
                EventType::Warning
            } else {
                EventType::Normal
            },
            reason: event.reason.to_owned(),
            note: Some(truncate(&event.note, 1000)),
            action: event.action.to_owned(),
            secondary: None,
        };
        if event.warning {
            tracing::warn!(release = %release.key(), reason = event.reason, "{}", event.note);
        } else {
            tracing::info!(release = %release.key(), reason = event.reason, "{}", event.note);
        }
        if let Err(err) = self.recorder.publish(&published, &reference).await {
            tracing::warn!(release = %release.key(), reason = event.reason, error = %err, "could not record the event");
        }
        if let Some(forwarder) = &self.forwarder {
            forwarder.forward(release, event);
        }
    }
}

fn truncate(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_owned();
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text[..end].to_owned()
}
