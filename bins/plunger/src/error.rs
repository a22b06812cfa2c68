//! The library's one error type. Each variant names the step that failed, so
//! that a log line or a metric label says where.

/// A failed step of a reconcile, drain or sweep.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("reading HelmRelease {key}: {source}")]
    ReadRelease { key: String, source: kube::Error },
    #[error("listing the Helm storage of {key} in namespace {namespace}: {source}")]
    ListStorage {
        key: String,
        namespace: String,
        source: kube::Error,
    },
    #[error("taking the suspension and fence of {key}: {source}")]
    Acquire { key: String, source: kube::Error },
    #[error("writing the processed-revision annotation on {key}: {source}")]
    Annotate { key: String, source: kube::Error },
    #[error("deleting Helm storage Secret {namespace}/{name}: {source}")]
    DeleteStorage {
        namespace: String,
        name: String,
        source: kube::Error,
    },
    #[error("lifting flux-plunger's suspension or fence on {key}: {source}")]
    Lift { key: String, source: kube::Error },
    #[error("labelling flux-plunger's uninstall fence on {key}: {source}")]
    LabelFence { key: String, source: kube::Error },
    #[error("reading Helm storage Secret {namespace}/{name}: {source}")]
    ReadStorage {
        namespace: String,
        name: String,
        source: kube::Error,
    },
    #[error("handing the history of {key} to helm-controller's uninstall: {source}")]
    HandOver { key: String, source: kube::Error },
    #[error("asking helm-controller to reconcile {key}: {source}")]
    RequestReconcile { key: String, source: kube::Error },
}

impl Error {
    /// A short label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Error::ReadRelease { .. } => "read_release",
            Error::ListStorage { .. } => "list_storage",
            Error::Acquire { .. } => "acquire",
            Error::Annotate { .. } => "annotate",
            Error::DeleteStorage { .. } => "delete_storage",
            Error::Lift { .. } => "lift",
            Error::LabelFence { .. } => "label_fence",
            Error::ReadStorage { .. } => "read_storage",
            Error::HandOver { .. } => "hand_over",
            Error::RequestReconcile { .. } => "request_reconcile",
        }
    }

    /// The apiserver's answer, when there was one.
    pub fn api_code(&self) -> Option<u16> {
        let source = match self {
            Error::ReadRelease { source, .. }
            | Error::ListStorage { source, .. }
            | Error::Acquire { source, .. }
            | Error::Annotate { source, .. }
            | Error::DeleteStorage { source, .. }
            | Error::Lift { source, .. }
            | Error::LabelFence { source, .. }
            | Error::ReadStorage { source, .. }
            | Error::HandOver { source, .. }
            | Error::RequestReconcile { source, .. } => source,
        };
        match source {
            kube::Error::Api(status) => Some(status.code),
            _ => None,
        }
    }

    /// A write lost a race with another writer (409): retried, not reported.
    pub fn is_conflict(&self) -> bool {
        self.api_code() == Some(409)
    }
}

/// True when the apiserver answered `code`.
pub fn is_api_code(err: &kube::Error, code: u16) -> bool {
    matches!(err, kube::Error::Api(status) if status.code == code)
}
