//! The local apiserver's audit log, read back: which requests an identity
//! made and how each was answered. Least-privilege tests use it to show that
//! every permission the chart grants is exercised (and never refused).

use std::collections::BTreeSet;

use anyhow::{Context, Result};
use serde::Deserialize;

/// One request as the apiserver recorded it (stage `ResponseComplete`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuditedRequest {
    pub user: String,
    pub verb: String,
    pub permission: Permission,
    pub namespace: Option<String>,
    pub code: u16,
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
    stage: String,
    verb: String,
    user: User,
    object_ref: Option<ObjectRef>,
    response_status: Option<ResponseStatus>,
}

#[derive(Deserialize)]
struct User {
    username: String,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ObjectRef {
    resource: Option<String>,
    subresource: Option<String>,
    namespace: Option<String>,
    api_group: Option<String>,
}

#[derive(Deserialize)]
struct ResponseStatus {
    code: Option<u16>,
}

/// Every resource request `user` made so far on the shared control plane.
pub fn requests_by(user: &str) -> Result<Vec<AuditedRequest>> {
    let path = crate::control_plane().audit_log();
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("reading the audit log {}", path.display()))?;
    Ok(parse(&text)
        .into_iter()
        .filter(|request| request.user == user)
        .collect())
}

/// The ServiceAccount's username as the apiserver authenticates its tokens.
pub fn service_account_user(namespace: &str, name: &str) -> String {
    format!("system:serviceaccount:{namespace}:{name}")
}

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

/// Parses the audit log's JSON lines, keeping completed resource requests; a
/// line that is not an audit event (a partial last line) is skipped.
fn parse(text: &str) -> Vec<AuditedRequest> {
    text.lines()
        .filter_map(|line| serde_json::from_str::<Line>(line).ok())
        .filter(|line| line.stage == "ResponseComplete")
        .filter_map(|line| {
            let object = line.object_ref?;
            let resource = match object.subresource {
                Some(sub) => format!("{}/{sub}", object.resource?),
                None => object.resource?,
            };
            Some(AuditedRequest {
                user: line.user.username,
                permission: Permission {
                    group: object.api_group.unwrap_or_default(),
                    resource,
                    verb: line.verb.clone(),
                },
                verb: line.verb,
                namespace: object.namespace,
                code: line.response_status.and_then(|s| s.code).unwrap_or(0),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn completed_resource_requests_are_read_with_their_subresource_and_code() {
        let log = concat!(
            r#"{"stage":"ResponseComplete","verb":"patch","user":{"username":"u"},"objectRef":{"resource":"deployments","subresource":"scale","namespace":"ns","apiGroup":"apps"},"responseStatus":{"code":200}}"#,
            "\n",
            r#"{"stage":"ResponseStarted","verb":"watch","user":{"username":"u"},"objectRef":{"resource":"pods"},"responseStatus":{"code":200}}"#,
            "\n",
            r#"{"stage":"ResponseComplete","verb":"get","user":{"username":"u"},"requestURI":"/healthz"}"#,
            "\n",
            r#"{"stage":"ResponseComplete","verb":"delete","user":{"username":"v"},"objectRef":{"resource":"secrets","namespace":"ns"},"responseStatus":{"code":403}}"#,
            "\n",
            r#"{"stage":"ResponseComp"#,
        );
        let requests = parse(log);
        assert_eq!(requests.len(), 2);
        assert_eq!(
            requests[0].permission.to_string(),
            "patch apps/deployments/scale"
        );
        assert_eq!(requests[1].permission.to_string(), "delete core/secrets");
        assert_eq!(refused(&requests).len(), 1);
        assert_eq!(allowed(&requests).len(), 1);
    }
}
