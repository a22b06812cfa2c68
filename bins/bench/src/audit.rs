//! The apiserver's audit log (one JSON event per line, see testkit's audit
//! policy): who sent which request, when. The bench reads the part written
//! during a phase, from a byte offset taken before it.

use std::collections::{BTreeMap, HashMap};
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

use anyhow::Result;
use k8s_openapi::jiff::Timestamp;
use serde_json::Value;

/// One request, as the apiserver logged it.
#[derive(Debug, Clone)]
pub struct Request {
    pub audit_id: String,
    pub username: String,
    pub verb: String,
    /// `resource` or `resource/subresource`.
    pub resource: String,
    pub namespace: String,
    pub name: String,
    pub request_uri: String,
    /// When the apiserver had answered (ResponseComplete, else ResponseStarted).
    pub at: Timestamp,
    pub code: Option<i64>,
    /// The body, for the HelmRelease writes the policy logs at Request level.
    pub body: Option<Value>,
}

impl Request {
    /// A short label: the verb (and kind of patch) and the resource.
    pub fn label(&self) -> String {
        format!("{} {}", self.verb_detail(), self.resource)
    }

    /// `patch` split into server-side apply and merge patch by its body.
    pub fn verb_detail(&self) -> String {
        if self.verb != "patch" {
            return self.verb.clone();
        }
        match &self.body {
            Some(body) if body.get("apiVersion").is_some() => "patch (apply)".to_owned(),
            Some(_) => "patch (merge)".to_owned(),
            None => "patch".to_owned(),
        }
    }
}

/// The audit log's current length: where the next phase starts reading.
pub fn mark(path: &Path) -> u64 {
    std::fs::metadata(path).map(|m| m.len()).unwrap_or(0)
}

/// The requests logged since `offset`, one per audit ID (a watch logs a
/// ResponseStarted and a ResponseComplete), in log order.
pub fn read_since(path: &Path, offset: u64) -> Result<Vec<Request>> {
    let mut file = std::fs::File::open(path)?;
    file.seek(SeekFrom::Start(offset))?;
    let mut text = String::new();
    file.read_to_string(&mut text)?;
    let mut seen: HashMap<String, usize> = HashMap::new();
    let mut requests: Vec<Request> = Vec::new();
    for line in text.lines() {
        let Ok(event) = serde_json::from_str::<Value>(line) else {
            continue; // a line cut by a concurrent write: the next read has it
        };
        let s = |p: &str| {
            event
                .pointer(p)
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned()
        };
        let Ok(at) = s("/stageTimestamp").parse::<Timestamp>() else {
            continue;
        };
        let subresource = s("/objectRef/subresource");
        let resource = if subresource.is_empty() {
            s("/objectRef/resource")
        } else {
            format!("{}/{subresource}", s("/objectRef/resource"))
        };
        let request = Request {
            audit_id: s("/auditID"),
            username: s("/user/username"),
            verb: s("/verb"),
            resource,
            namespace: s("/objectRef/namespace"),
            name: s("/objectRef/name"),
            request_uri: s("/requestURI"),
            at,
            code: event
                .pointer("/responseStatus/code")
                .and_then(Value::as_i64),
            body: event.get("requestObject").cloned(),
        };
        match seen.get(&request.audit_id) {
            // The later stage wins: it says when the answer was complete.
            Some(&i) => requests[i] = request,
            None => {
                seen.insert(request.audit_id.clone(), requests.len());
                requests.push(request);
            }
        }
    }
    Ok(requests)
}

/// Counts by label, e.g. `get helmreleases` → 3.
pub fn count_by_label<'a>(
    requests: impl IntoIterator<Item = &'a Request>,
) -> BTreeMap<String, u64> {
    let mut counts = BTreeMap::new();
    for r in requests {
        *counts.entry(r.label()).or_insert(0) += 1;
    }
    counts
}
