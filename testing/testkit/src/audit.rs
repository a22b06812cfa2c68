//! The local apiserver's audit log, read back: which requests an identity
//! made and how each was answered. Least-privilege tests use it to show that
//! every permission the chart grants is exercised (and never refused); the
//! request-count tests and `make bench` count a phase's requests from a byte
//! offset taken before it ([`mark`], [`read_since`]).
//!
//! The policy (see the control plane) omits the `RequestReceived` stage and
//! logs HelmRelease writes at `Request` level, so their bodies are here too.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::{Read, Seek, SeekFrom};

use anyhow::{Context, Result};
use k8s_openapi::jiff::Timestamp;
use serde::Deserialize;
use serde_json::Value;

/// One resource request as the apiserver recorded it: its last stage logged
/// (`ResponseComplete`, or `ResponseStarted` for a watch still open).
#[derive(Debug, Clone, PartialEq)]
pub struct AuditedRequest {
    pub audit_id: String,
    pub user: String,
    /// The pod a ServiceAccount token was bound to (a pod's mounted token),
    /// which tells two pods of one ServiceAccount apart.
    pub pod: Option<String>,
    pub verb: String,
    pub permission: Permission,
    pub namespace: Option<String>,
    /// The object's name; empty for a list, a watch or a create.
    pub name: String,
    pub request_uri: String,
    /// When the apiserver received the request.
    pub received_at: Timestamp,
    /// When the apiserver logged its last stage: for anything but a watch,
    /// when the answer was complete.
    pub at: Timestamp,
    /// The response code; 0 if none was logged.
    pub code: u16,
    /// The request body, for the HelmRelease writes the policy logs in full.
    pub body: Option<Value>,
}

impl AuditedRequest {
    /// `resource` or `resource/subresource`.
    pub fn resource(&self) -> &str {
        &self.permission.resource
    }

    /// A create, update, patch or delete.
    pub fn is_write(&self) -> bool {
        matches!(
            self.verb.as_str(),
            "create" | "update" | "patch" | "delete" | "deletecollection"
        )
    }

    /// Answered with a 2xx code.
    pub fn succeeded(&self) -> bool {
        (200..300).contains(&self.code)
    }

    /// The `fieldManager` the request named, if any.
    pub fn field_manager(&self) -> Option<&str> {
        let (_, query) = self.request_uri.split_once('?')?;
        query
            .split('&')
            .find_map(|pair| pair.strip_prefix("fieldManager="))
    }

    /// A short label for counting: the verb (a patch split into server-side
    /// apply and merge patch by its body, where the body was logged) and the
    /// resource, e.g. `patch (apply) helmreleases`.
    pub fn label(&self) -> String {
        let verb = match (&*self.verb, &self.body) {
            ("patch", Some(body)) if body.get("apiVersion").is_some() => "patch (apply)",
            ("patch", Some(_)) => "patch (merge)",
            (verb, _) => verb,
        };
        format!("{verb} {}", self.permission.resource)
    }
}

/// What RBAC checks for a request: API group, resource (with its
/// subresource as `resource/subresource`) and verb.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Permission {
    pub group: String,
    pub resource: String,
    pub verb: String,
}

impl std::fmt::Display for Permission {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let group = if self.group.is_empty() {
            "core"
        } else {
            &self.group
        };
        write!(f, "{} {}/{}", self.verb, group, self.resource)
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Line {
    #[serde(rename = "auditID")]
    audit_id: String,
    verb: String,
    user: User,
    object_ref: Option<ObjectRef>,
    #[serde(rename = "requestURI", default)]
    request_uri: String,
    request_received_timestamp: Timestamp,
    stage_timestamp: Timestamp,
    response_status: Option<ResponseStatus>,
    request_object: Option<Value>,
}

#[derive(Deserialize)]
struct User {
    username: String,
    #[serde(default)]
    extra: HashMap<String, Vec<String>>,
}

/// The user info key under which the apiserver names a bound token's pod.
const POD_NAME_EXTRA: &str = "authentication.kubernetes.io/pod-name";

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ObjectRef {
    resource: Option<String>,
    subresource: Option<String>,
    namespace: Option<String>,
    name: Option<String>,
    api_group: Option<String>,
}

#[derive(Deserialize)]
struct ResponseStatus {
    code: Option<u16>,
}

/// The shared control plane's audit log's current length: where a phase that
/// starts now begins reading ([`read_since`]).
pub fn mark() -> u64 {
    std::fs::metadata(crate::control_plane().audit_log()).map_or(0, |m| m.len())
}

/// Every resource request logged since byte `offset` of the shared control
/// plane's audit log, one per request, in the order they were first logged.
pub fn read_since(offset: u64) -> Result<Vec<AuditedRequest>> {
    read_log_since(&crate::control_plane().audit_log(), offset)
}

/// [`read_since`] for the audit log at `path` (a control plane of a test's
/// own: `ControlPlane::audit_log`).
pub fn read_log_since(path: &std::path::Path, offset: u64) -> Result<Vec<AuditedRequest>> {
    let mut file = std::fs::File::open(path)
        .with_context(|| format!("opening the audit log {}", path.display()))?;
    file.seek(SeekFrom::Start(offset))?;
    let mut text = String::new();
    file.read_to_string(&mut text)
        .with_context(|| format!("reading the audit log {}", path.display()))?;
    Ok(parse(&text))
}

/// Every resource request `user` made so far on the shared control plane.
pub fn requests_by(user: &str) -> Result<Vec<AuditedRequest>> {
    requests_by_since(user, 0)
}

/// The requests `user` made since `offset` ([`mark`]).
pub fn requests_by_since(user: &str, offset: u64) -> Result<Vec<AuditedRequest>> {
    Ok(read_since(offset)?
        .into_iter()
        .filter(|request| request.user == user)
        .collect())
}

pub use crate::control_plane::service_account_user;

/// The permissions of the requests the apiserver allowed (anything but 403).
pub fn allowed(requests: &[AuditedRequest]) -> BTreeSet<Permission> {
    requests
        .iter()
        .filter(|r| r.code != 403)
        .map(|r| r.permission.clone())
        .collect()
}

/// The requests the apiserver refused for lack of permission.
pub fn refused(requests: &[AuditedRequest]) -> Vec<&AuditedRequest> {
    requests.iter().filter(|r| r.code == 403).collect()
}

/// Counts by [`AuditedRequest::label`], e.g. `get helmreleases` → 3.
pub fn count_by_label<'a>(
    requests: impl IntoIterator<Item = &'a AuditedRequest>,
) -> BTreeMap<String, u64> {
    let mut counts = BTreeMap::new();
    for request in requests {
        *counts.entry(request.label()).or_insert(0) += 1;
    }
    counts
}

/// Parses the audit log's JSON lines into one request per audit ID (a watch
/// logs `ResponseStarted`, then `ResponseComplete` when it ends: the later
/// stage wins, the request keeps its first place). Non-resource requests
/// (`/healthz`, `/version`) are left out, and so is a line that is not an
/// audit event (a last line cut by a concurrent write: the next read has it).
fn parse(text: &str) -> Vec<AuditedRequest> {
    let mut place: HashMap<String, usize> = HashMap::new();
    let mut requests: Vec<AuditedRequest> = Vec::new();
    for line in text.lines() {
        let Some(request) = serde_json::from_str::<Line>(line)
            .ok()
            .and_then(AuditedRequest::from_line)
        else {
            continue;
        };
        match place.get(&request.audit_id) {
            Some(&i) => requests[i] = request,
            None => {
                place.insert(request.audit_id.clone(), requests.len());
                requests.push(request);
            }
        }
    }
    requests
}

impl AuditedRequest {
    fn from_line(line: Line) -> Option<Self> {
        let object = line.object_ref?;
        let resource = match object.subresource {
            Some(sub) => format!("{}/{sub}", object.resource?),
            None => object.resource?,
        };
        let pod = line
            .user
            .extra
            .get(POD_NAME_EXTRA)
            .and_then(|names| names.first().cloned());
        Some(Self {
            audit_id: line.audit_id,
            user: line.user.username,
            pod,
            permission: Permission {
                group: object.api_group.unwrap_or_default(),
                resource,
                verb: line.verb.clone(),
            },
            verb: line.verb,
            namespace: object.namespace,
            name: object.name.unwrap_or_default(),
            request_uri: line.request_uri,
            received_at: line.request_received_timestamp,
            at: line.stage_timestamp,
            code: line.response_status.and_then(|s| s.code).unwrap_or(0),
            body: line.request_object,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An audit event; `ResponseComplete` is logged a second after
    /// `ResponseStarted`.
    fn event(id: &str, stage: &str, verb: &str, user: &str, object_ref: &str, code: u16) -> String {
        let second = if stage == "ResponseStarted" { 0 } else { 1 };
        format!(
            r#"{{"auditID":"{id}","stage":"{stage}","verb":"{verb}","user":{{"username":"{user}"}},{object_ref}"requestURI":"/x","requestReceivedTimestamp":"2026-01-01T00:00:00Z","stageTimestamp":"2026-01-01T00:00:0{second}.5Z","responseStatus":{{"code":{code}}}}}"#
        )
    }

    #[test]
    fn resource_requests_are_read_with_their_subresource_and_code_once_per_audit_id() {
        let log = [
            event(
                "a",
                "ResponseComplete",
                "patch",
                "u",
                r#""objectRef":{"resource":"deployments","subresource":"scale","namespace":"ns","name":"d","apiGroup":"apps"},"#,
                200,
            ),
            event(
                "w",
                "ResponseStarted",
                "watch",
                "u",
                r#""objectRef":{"resource":"pods"},"#,
                200,
            ),
            event("h", "ResponseComplete", "get", "u", "", 200),
            event(
                "d",
                "ResponseComplete",
                "delete",
                "v",
                r#""objectRef":{"resource":"secrets","namespace":"ns","name":"s"},"#,
                403,
            ),
            event(
                "w",
                "ResponseComplete",
                "watch",
                "u",
                r#""objectRef":{"resource":"pods"},"#,
                200,
            ),
            r#"{"auditID":"x","stage":"ResponseComp"#.to_owned(),
        ]
        .join("\n");
        let requests = parse(&log);
        let seen: Vec<(String, String, u16)> = requests
            .iter()
            .map(|r| (r.audit_id.clone(), r.permission.to_string(), r.code))
            .collect();
        assert_eq!(
            seen,
            [
                (
                    "a".to_owned(),
                    "patch apps/deployments/scale".to_owned(),
                    200
                ),
                // The watch keeps its first place and takes its last stage.
                ("w".to_owned(), "watch core/pods".to_owned(), 200),
                ("d".to_owned(), "delete core/secrets".to_owned(), 403),
            ]
        );
        assert_eq!(requests[0].name, "d");
        assert_eq!(requests[0].namespace.as_deref(), Some("ns"));
        assert_eq!(requests[1].at.to_string(), "2026-01-01T00:00:01.5Z");
        assert_eq!(refused(&requests).len(), 1);
        assert_eq!(allowed(&requests).len(), 2);
    }

    #[test]
    fn a_patch_is_labelled_apply_or_merge_by_its_logged_body_and_names_its_field_manager() {
        let patch = |body: Option<Value>| AuditedRequest {
            audit_id: "a".to_owned(),
            user: "u".to_owned(),
            pod: None,
            verb: "patch".to_owned(),
            permission: Permission {
                group: "helm.toolkit.fluxcd.io".to_owned(),
                resource: "helmreleases".to_owned(),
                verb: "patch".to_owned(),
            },
            namespace: None,
            name: String::new(),
            request_uri: String::new(),
            received_at: Timestamp::UNIX_EPOCH,
            at: Timestamp::UNIX_EPOCH,
            code: 200,
            body,
        };
        let apply = patch(Some(
            serde_json::json!({"apiVersion": "v2", "kind": "HelmRelease"}),
        ));
        let merge = patch(Some(serde_json::json!({"metadata": {}})));
        let unlogged = patch(None);
        assert_eq!(apply.label(), "patch (apply) helmreleases");
        assert_eq!(merge.label(), "patch (merge) helmreleases");
        assert_eq!(unlogged.label(), "patch helmreleases");
        let with_uri = |uri: &str| AuditedRequest {
            request_uri: uri.to_owned(),
            ..unlogged.clone()
        };
        assert_eq!(
            with_uri(
                "/apis/x/v2/namespaces/n/helmreleases/a?fieldManager=flux-plunger&force=false"
            )
            .field_manager(),
            Some("flux-plunger")
        );
        assert_eq!(
            with_uri("/apis/x?dryRun=All&fieldManager=flux-plunger-sweep").field_manager(),
            Some("flux-plunger-sweep")
        );
        assert_eq!(with_uri("/apis/x?force=true").field_manager(), None);
        assert_eq!(with_uri("/apis/x").field_manager(), None);
        assert_eq!(
            count_by_label([&apply, &merge, &apply]),
            BTreeMap::from([
                ("patch (apply) helmreleases".to_owned(), 2),
                ("patch (merge) helmreleases".to_owned(), 1)
            ])
        );
    }
}
