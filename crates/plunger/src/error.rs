//! The library's one error type. Each variant names the step that failed, so
//! that a log line or a metric label says where.

/// A failed step of a reconcile, drain or sweep.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("reading HelmRelease {key}: {source}")]
    ReadRelease { key: String, source: kube::Error },
    #[error("reading the remote-cluster kubeconfig Secret of {key}: {source}")]
    ReadKubeconfig { key: String, source: kube::Error },
    #[error(
        "asking whether helm-controller could reach the Helm storage of {key} in namespace {namespace}: {source}"
    )]
    ReviewStorageAccess {
        key: String,
        namespace: String,
        source: kube::Error,
    },
    #[error("listing the Helm storage of {key} in namespace {namespace}: {source}")]
    ListStorage {
        key: String,
        namespace: String,
        source: kube::Error,
    },
    #[error("taking the suspension and fence of {key}: {source}")]
    Acquire { key: String, source: kube::Error },
    #[error("fencing {key} while its recovery waits: {source}")]
    FenceWhileWaiting { key: String, source: kube::Error },
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
            Error::ReadKubeconfig { .. } => "read_kubeconfig",
            Error::ReviewStorageAccess { .. } => "review_storage_access",
            Error::ListStorage { .. } => "list_storage",
            Error::Acquire { .. } => "acquire",
            Error::FenceWhileWaiting { .. } => "fence_while_waiting",
            Error::Annotate { .. } => "annotate",
            Error::DeleteStorage { .. } => "delete_storage",
            Error::Lift { .. } => "lift",
            Error::LabelFence { .. } => "label_fence",
            Error::ReadStorage { .. } => "read_storage",
            Error::HandOver { .. } => "hand_over",
            Error::RequestReconcile { .. } => "request_reconcile",
        }
    }

    /// The failed request's error.
    pub(crate) fn source(&self) -> &kube::Error {
        match self {
            Error::ReadRelease { source, .. }
            | Error::ReadKubeconfig { source, .. }
            | Error::ReviewStorageAccess { source, .. }
            | Error::ListStorage { source, .. }
            | Error::Acquire { source, .. }
            | Error::FenceWhileWaiting { source, .. }
            | Error::Annotate { source, .. }
            | Error::DeleteStorage { source, .. }
            | Error::Lift { source, .. }
            | Error::LabelFence { source, .. }
            | Error::ReadStorage { source, .. }
            | Error::HandOver { source, .. }
            | Error::RequestReconcile { source, .. } => source,
        }
    }

    /// The apiserver's answer, when there was one.
    pub fn api_code(&self) -> Option<u16> {
        match self.source() {
            kube::Error::Api(status) => Some(status.code),
            _ => None,
        }
    }

    /// A write lost a race with another writer: retried after reading
    /// again, not reported.
    pub fn is_stale_write(&self) -> bool {
        is_stale_write(self.source())
    }
}

/// An error as a log line or a report shows it: for a refusal, the
/// apiserver's message with its code and reason, without the whole status
/// kube's `Display` appends in its `Debug` form; for a failure to reach the
/// apiserver, each cause in turn, down to the one that names what happened
/// ("Connection refused"), which kube's own message leaves out.
pub fn describe(err: &kube::Error) -> String {
    match err {
        kube::Error::Api(status) => {
            format!("{} ({} {})", status.message, status.code, status.reason)
        }
        other => {
            let mut text = other.to_string();
            let mut cause = std::error::Error::source(other);
            while let Some(next) = cause {
                let said = next.to_string();
                if !text.contains(&said) {
                    text.push_str(": ");
                    text.push_str(&said);
                }
                cause = next.source();
            }
            text
        }
    }
}

/// True when the apiserver answered `code`.
pub(crate) fn is_api_code(err: &kube::Error, code: u16) -> bool {
    matches!(err, kube::Error::Api(status) if status.code == code)
}

/// A 409 that reading again cannot cure: a server-side apply whose fields
/// another manager holds in a way the apply may not override (the apiserver
/// names each field in a `FieldManagerConflict` cause). Seen when the fence is
/// listed twice: the manager that added the second copy then owns the
/// duplicated entry alone, and every apply naming the fence is refused until
/// a copy goes. The apiserver reports it before a stale `resourceVersion`.
/// The apiserver refused the caller's identity (401) or its rights (403).
pub(crate) fn is_access_refused(err: &kube::Error) -> bool {
    is_api_code(err, 401) || is_api_code(err, 403)
}

pub fn is_field_manager_conflict(err: &kube::Error) -> bool {
    matches!(err, kube::Error::Api(status) if status.code == 409
    && status.details.as_ref().is_some_and(|details| {
        details.causes.iter().any(|cause| cause.reason == "FieldManagerConflict")
    }))
}

/// A write that lost a race: 409 because the `resourceVersion` (or `uid`) it
/// was preconditioned on is no longer the object's. Reading again cures it.
pub fn is_stale_write(err: &kube::Error) -> bool {
    is_api_code(err, 409) && !is_field_manager_conflict(err)
}

/// A guarded JSON patch refused because it does not apply to the object as
/// it is now: a `test` op failed, or an index is gone. The release changed
/// since the read; reading again cures it. The apiserver answers 422 with
/// its generic "rejected ... due to an error in our request" and no causes
/// (the patch library's reason is not passed on); an admission refusal or a
/// validation error is a 422 too, but says why.
pub fn is_failed_guard(err: &kube::Error) -> bool {
    matches!(err, kube::Error::Api(status) if status.code == 422
        && status.message == PATCH_DOES_NOT_APPLY
        && status.details.as_ref().is_none_or(|details| details.causes.is_empty()))
}

/// The apiserver's whole message for a JSON patch that does not apply.
const PATCH_DOES_NOT_APPLY: &str = "the server rejected our request due to an error in our request";

/// A refusal that no retry cures by itself: the request is not allowed (401,
/// 403), malformed (400, 405) or denied by admission (a 422 that is not a
/// failed `test`). A race (409, a failed `test`), a missing object (404),
/// throttling (429) and the server's own trouble (5xx) are not.
pub(crate) fn is_permanent_refusal(err: &kube::Error) -> bool {
    match err {
        kube::Error::Api(status) => match status.code {
            400 | 401 | 403 | 405 => true,
            422 => !is_failed_guard(err),
            _ => false,
        },
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::core::response::{Status, StatusCause, StatusDetails};

    fn refused(code: u16, message: &str, causes: &[&str]) -> kube::Error {
        kube::Error::Api(Box::new(Status {
            code,
            message: message.to_owned(),
            details: Some(StatusDetails {
                name: "web".into(),
                group: String::new(),
                kind: String::new(),
                uid: String::new(),
                causes: causes
                    .iter()
                    .map(|reason| StatusCause {
                        reason: (*reason).to_owned(),
                        message: String::new(),
                        field: String::new(),
                    })
                    .collect(),
                retry_after_seconds: 0,
            }),
            ..Default::default()
        }))
    }

    #[test]
    fn a_failure_to_connect_is_described_down_to_its_cause() {
        #[derive(Debug, thiserror::Error)]
        #[error("client error (Connect)")]
        struct Connect(#[source] std::io::Error);
        let refused =
            std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "Connection refused");
        let err = kube::Error::Service(Box::new(Connect(refused)));
        assert_eq!(
            describe(&err),
            "ServiceError: client error (Connect): Connection refused"
        );
    }

    #[test]
    fn a_field_manager_conflict_is_not_a_stale_write() {
        let conflict = refused(
            409,
            "Apply failed with 1 conflict",
            &["FieldManagerConflict"],
        );
        assert!(is_field_manager_conflict(&conflict));
        assert!(!is_stale_write(&conflict));
        let stale = refused(409, "the object has been modified", &[]);
        assert!(is_stale_write(&stale));
        assert!(!is_field_manager_conflict(&stale));
        assert!(!is_stale_write(&refused(422, "invalid", &[])));
    }

    #[test]
    fn refusals_no_retry_cures_are_told_from_races_and_trouble() {
        for code in [400, 401, 403, 405] {
            assert!(is_permanent_refusal(&refused(code, "no", &[])), "{code}");
        }
        assert!(is_permanent_refusal(&refused(422, "denied request", &[])));
        for code in [404, 409, 429, 500, 503] {
            assert!(!is_permanent_refusal(&refused(code, "no", &[])), "{code}");
        }
        assert!(!is_permanent_refusal(&refused(
            422,
            PATCH_DOES_NOT_APPLY,
            &[]
        )));
    }

    #[test]
    fn only_a_failed_test_op_is_a_failed_guard() {
        assert!(is_failed_guard(&refused(422, PATCH_DOES_NOT_APPLY, &[])));
        assert!(!is_failed_guard(&refused(
            422,
            "helmreleases.helm.toolkit.fluxcd.io \"web\" is forbidden: ValidatingAdmissionPolicy 'no-patch' denied request",
            &[]
        )));
        assert!(!is_failed_guard(&refused(
            422,
            PATCH_DOES_NOT_APPLY,
            &["FieldValueInvalid"]
        )));
        assert!(!is_failed_guard(&refused(409, PATCH_DOES_NOT_APPLY, &[])));
    }
}
