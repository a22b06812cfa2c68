//! What the HelmRelease watch decodes: only what the trimmed cache keeps
//! (`trim` below), read straight from the apiserver's JSON.
//!
//! Decoding a whole HelmRelease into a `DynamicObject` builds a JSON tree of
//! its spec (values), status (history) and every managedFields entry (a
//! nested map per field) only for `trim` to throw it away. With a listing
//! page of hundreds of releases that garbage is tens of MiB, which the
//! allocator keeps long after the page is gone. Here the fields nobody reads
//! are skipped while parsing (serde's `IgnoredAny` allocates nothing), and
//! the result is the very object `trim` would have left.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fmt;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{FieldsV1, ManagedFieldsEntry, Time};
use kube::api::{DynamicObject, ObjectMeta};
use serde::Deserialize;
use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Value};

use plunger::names::{
    FENCE_FINALIZER, FIELD_MANAGER, PROCESSED_VERSION_ANNOTATION, READY_CONDITION,
};
use plunger::release::view::ReleaseView;

/// A HelmRelease as the watch decodes it; [`WatchedRelease::into_object`]
/// gives the trimmed `DynamicObject` the cache holds.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct WatchedRelease {
    #[serde(default)]
    metadata: WatchedMeta,
    #[serde(default, deserialize_with = "pick_spec")]
    spec: Map<String, Value>,
    #[serde(default, deserialize_with = "pick_status")]
    status: Map<String, Value>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
struct WatchedMeta {
    name: Option<String>,
    namespace: Option<String>,
    uid: Option<String>,
    resource_version: Option<String>,
    generation: Option<i64>,
    deletion_timestamp: Option<Time>,
    finalizers: Option<Vec<String>>,
    annotations: Option<BTreeMap<String, String>>,
    #[serde(deserialize_with = "our_managed_fields")]
    managed_fields: Option<Vec<ManagedFieldsEntry>>,
}

impl WatchedRelease {
    /// The trimmed object the cache keeps.
    pub fn into_object(self) -> DynamicObject {
        let mut data = Map::new();
        if !self.spec.is_empty() {
            data.insert("spec".into(), Value::Object(self.spec));
        }
        if !self.status.is_empty() {
            data.insert("status".into(), Value::Object(self.status));
        }
        let mut object = DynamicObject {
            types: None, // trim drops it anyway
            metadata: self.metadata.into(),
            data: Value::Object(data),
        };
        trim(&mut object);
        object
    }
}

impl From<WatchedMeta> for ObjectMeta {
    fn from(meta: WatchedMeta) -> Self {
        ObjectMeta {
            name: meta.name,
            namespace: meta.namespace,
            uid: meta.uid,
            resource_version: meta.resource_version,
            generation: meta.generation,
            deletion_timestamp: meta.deletion_timestamp,
            finalizers: meta.finalizers,
            annotations: meta.annotations.map(|mut a| {
                a.retain(|k, _| k == PROCESSED_VERSION_ANNOTATION);
                a
            }),
            managed_fields: meta.managed_fields,
            ..ObjectMeta::default()
        }
    }
}

/// Decodes a HelmRelease into the trimmed object straight away: the type the
/// watcher decodes must be a `Resource`, so this one converts on decode and
/// only ever holds the trimmed form.
#[derive(Clone, Debug)]
pub struct Trimmed(pub DynamicObject);

impl<'de> Deserialize<'de> for Trimmed {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        Ok(Trimmed(
            WatchedRelease::deserialize(deserializer)?.into_object(),
        ))
    }
}

plunger::helmrelease_newtype_resource!(Trimmed);

/// Keeps the `keys` of a JSON object as values and skips the rest unparsed;
/// anything but an object gives nothing (as `trim` ignores it).
struct PickKeys(&'static [&'static str]);

impl<'de> DeserializeSeed<'de> for PickKeys {
    type Value = Map<String, Value>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for PickKeys {
    type Value = Map<String, Value>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut picked = Map::new();
        while let Some(key) = map.next_key::<Cow<'de, str>>()? {
            if self.0.contains(&key.as_ref()) {
                picked.insert(key.into_owned(), map.next_value::<Value>()?);
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(picked)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(Map::new())
    }

    fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
        Ok(Map::new())
    }
    fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
        Ok(Map::new())
    }
    fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
        Ok(Map::new())
    }
    fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
        Ok(Map::new())
    }
    fn visit_str<E>(self, _: &str) -> Result<Self::Value, E> {
        Ok(Map::new())
    }
    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(Map::new())
    }
    fn visit_none<E>(self) -> Result<Self::Value, E> {
        Ok(Map::new())
    }
}

fn pick_spec<'de, D: Deserializer<'de>>(d: D) -> Result<Map<String, Value>, D::Error> {
    PickKeys(&["suspend"]).deserialize(d)
}

fn pick_status<'de, D: Deserializer<'de>>(d: D) -> Result<Map<String, Value>, D::Error> {
    PickKeys(&["conditions"]).deserialize(d)
}

/// Our own managedFields entries; another manager's `fieldsV1` (the bulk of
/// managedFields) is skipped unparsed when its `manager` comes first, as the
/// apiserver writes it.
fn our_managed_fields<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Option<Vec<ManagedFieldsEntry>>, D::Error> {
    struct Entries;
    impl<'de> Visitor<'de> for Entries {
        type Value = Option<Vec<ManagedFieldsEntry>>;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("a list of managedFields entries")
        }
        fn visit_unit<E>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_none<E>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
            let mut ours = Vec::new();
            while let Some(entry) = seq.next_element::<Entry>()? {
                if let Some(entry) = entry.0 {
                    ours.push(entry);
                }
            }
            Ok(Some(ours))
        }
    }
    d.deserialize_any(Entries)
}

/// One managedFields entry: `Some` only when it is ours.
struct Entry(Option<ManagedFieldsEntry>);

impl<'de> Deserialize<'de> for Entry {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct EntryVisitor;
        impl<'de> Visitor<'de> for EntryVisitor {
            type Value = Entry;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a managedFields entry")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Entry, A::Error> {
                let mut entry = ManagedFieldsEntry::default();
                while let Some(key) = map.next_key::<Cow<'de, str>>()? {
                    let others = entry.manager.as_deref().is_some_and(|m| m != FIELD_MANAGER);
                    match key.as_ref() {
                        _ if others => {
                            map.next_value::<IgnoredAny>()?;
                        }
                        "manager" => entry.manager = map.next_value()?,
                        "operation" => entry.operation = map.next_value()?,
                        "apiVersion" => entry.api_version = map.next_value()?,
                        "time" => entry.time = map.next_value()?,
                        "fieldsType" => entry.fields_type = map.next_value()?,
                        "subresource" => entry.subresource = map.next_value()?,
                        "fieldsV1" => entry.fields_v1 = map.next_value::<Option<FieldsV1>>()?,
                        _ => {
                            map.next_value::<IgnoredAny>()?;
                        }
                    }
                }
                let ours = entry.manager.as_deref() == Some(FIELD_MANAGER);
                Ok(Entry(ours.then_some(entry)))
            }
        }
        d.deserialize_map(EntryVisitor)
    }
}

/// Keeps only what the watch filter and the metrics read: the cache then
/// costs a few hundred bytes a release instead of its whole spec, status and
/// managedFields. Every decision that leads to a write reads the release
/// afresh from the apiserver, so nothing is lost.
///
/// What the filter reads is kept only where it says yes: the `Ready`
/// condition only of a stuck release, `spec.suspend` only when true, of the
/// finalizers only our fence. A healthy release then holds no JSON map at
/// all (each costs a B-tree node of some 600 bytes), which is most of the
/// cache with thousands of releases.
fn trim(object: &mut DynamicObject) {
    object.types = None;
    let meta = &mut object.metadata;
    meta.labels = None;
    meta.owner_references = None;
    if let Some(annotations) = meta.annotations.as_mut() {
        annotations.retain(|k, _| k == PROCESSED_VERSION_ANNOTATION);
    }
    if let Some(entries) = meta.managed_fields.as_mut() {
        entries.retain(|e| e.manager.as_deref() == Some(FIELD_MANAGER));
    }
    if let Some(finalizers) = meta.finalizers.as_mut() {
        finalizers.retain(|f| f == FENCE_FINALIZER);
    }
    let stuck = ReleaseView::from_object(object).is_stuck();
    let mut data = Map::new();
    if object.data.pointer("/spec/suspend") == Some(&Value::Bool(true)) {
        data.insert("spec".into(), serde_json::json!({ "suspend": true }));
    }
    let ready = object
        .data
        .pointer("/status/conditions")
        .and_then(Value::as_array)
        .and_then(|conditions| {
            conditions
                .iter()
                .find(|c| c.get("type").and_then(Value::as_str) == Some(READY_CONDITION))
        });
    if let Some(ready) = ready.filter(|_| stuck) {
        let keep: Map<String, Value> = ["type", "status", "message"]
            .iter()
            .filter_map(|k| ready.get(*k).map(|v| ((*k).to_owned(), v.clone())))
            .collect();
        data.insert("status".into(), serde_json::json!({ "conditions": [keep] }));
    }
    object.data = Value::Object(data);
}

#[cfg(test)]
mod tests {
    use super::*;
    use plunger::decide::is_of_interest;
    use plunger::release::view::ReleaseView;
    use serde_json::json;

    fn full() -> Value {
        json!({
            "apiVersion": "helm.toolkit.fluxcd.io/v2", "kind": "HelmRelease",
            "metadata": {
                "name": "web", "namespace": "apps", "uid": "u", "resourceVersion": "3",
                "generation": 4, "creationTimestamp": "2026-01-01T00:00:00Z",
                "deletionTimestamp": "2026-01-02T00:00:00Z",
                "labels": {"a": "b"},
                "annotations": {PROCESSED_VERSION_ANNOTATION: "4", "other": "x"},
                "finalizers": ["finalizers.fluxcd.io", "flux-plunger.cozystack.io/uninstall-fence"],
                "managedFields": [
                    {"manager": "kustomize-controller", "operation": "Apply", "apiVersion": "helm.toolkit.fluxcd.io/v2", "fieldsType": "FieldsV1", "fieldsV1": {"f:spec": {"f:values": {"f:big": {}}}}},
                    {"manager": "flux-plunger", "operation": "Apply", "apiVersion": "helm.toolkit.fluxcd.io/v2", "time": "2026-01-01T00:00:00Z", "fieldsType": "FieldsV1", "fieldsV1": {"f:spec": {"f:suspend": {}}}},
                    {"fieldsV1": {"f:status": {}}, "manager": "helm-controller", "operation": "Update", "subresource": "status"},
                ],
            },
            "spec": {"suspend": true, "interval": "5m", "values": {"big": "x".repeat(1000)}},
            "status": {"observedGeneration": 4, "conditions": [
                {"type": "Released", "status": "False", "message": "m", "reason": "r", "lastTransitionTime": "2026-01-01T00:00:00Z"},
                {"type": "Ready", "status": "False", "message": "x has no deployed releases", "reason": "r", "lastTransitionTime": "2026-01-01T00:00:00Z"},
            ], "history": [{"name": "web"}]},
        })
    }

    fn trimmed_from_the_whole_object(value: Value) -> DynamicObject {
        let mut object: DynamicObject = serde_json::from_value(value).unwrap();
        trim(&mut object);
        object
    }

    #[test]
    fn decoding_only_what_is_kept_gives_what_trimming_the_whole_object_gives() {
        let Trimmed(decoded) = serde_json::from_value(full()).unwrap();
        let trimmed = trimmed_from_the_whole_object(full());
        assert_eq!(decoded.data, trimmed.data);
        assert_eq!(
            decoded.metadata.managed_fields,
            trimmed.metadata.managed_fields
        );
        assert_eq!(decoded.metadata.annotations, trimmed.metadata.annotations);
        let (new, old) = (
            ReleaseView::from_object(&decoded),
            ReleaseView::from_object(&trimmed),
        );
        assert_eq!(is_of_interest(&new), is_of_interest(&old));
        assert!(new.is_stuck() && new.suspended_by_us() && new.has_fence() && new.terminating);
        assert_eq!(new.uid, old.uid);
        assert_eq!(new.resource_version, old.resource_version);
        assert_eq!(new.generation, old.generation);
        assert_eq!(new.finalizers, old.finalizers);
        assert_eq!(new.has_fence(), old.has_fence());
        assert_eq!(
            new.carries_processed_annotation(),
            old.carries_processed_annotation()
        );
    }

    #[test]
    fn odd_shapes_decode_as_trimming_reads_them() {
        for (spec, status) in [
            (json!(null), json!(null)),
            (json!("text"), json!([1, 2])),
            (json!({"suspend": "yes"}), json!({"conditions": "none"})),
            (json!({}), json!({"conditions": []})),
        ] {
            let mut value = full();
            value["spec"] = spec;
            value["status"] = status;
            value["metadata"]["managedFields"] = json!(null);
            let Trimmed(decoded) = serde_json::from_value(value.clone()).unwrap();
            let trimmed = trimmed_from_the_whole_object(value);
            let (new, old) = (
                ReleaseView::from_object(&decoded),
                ReleaseView::from_object(&trimmed),
            );
            assert_eq!(new.suspend, old.suspend);
            assert_eq!(new.is_stuck(), old.is_stuck());
            assert_eq!(is_of_interest(&new), is_of_interest(&old));
        }
    }

    #[test]
    fn the_trimmed_cache_keeps_exactly_what_the_watch_filter_reads() {
        let full: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "helm.toolkit.fluxcd.io/v2", "kind": "HelmRelease",
            "metadata": {
                "name": "web", "namespace": "apps", "uid": "u", "resourceVersion": "3",
                "labels": {"a": "b"},
                "annotations": {PROCESSED_VERSION_ANNOTATION: "4", "other": "x"},
                "finalizers": ["finalizers.fluxcd.io", "flux-plunger.cozystack.io/uninstall-fence"],
                "managedFields": [
                    {"manager": "flux-plunger", "operation": "Apply", "fieldsType": "FieldsV1", "fieldsV1": {"f:spec": {"f:suspend": {}}}},
                    {"manager": "helm-controller", "operation": "Update", "fieldsType": "FieldsV1", "fieldsV1": {"f:status": {}}},
                ],
            },
            "spec": {"suspend": true, "interval": "5m", "values": {"big": "x".repeat(1000)}},
            "status": {"conditions": [
                {"type": "Released", "status": "False", "message": "m", "reason": "r", "lastTransitionTime": "2026-01-01T00:00:00Z"},
                {"type": "Ready", "status": "False", "message": "x has no deployed releases", "reason": "r", "lastTransitionTime": "2026-01-01T00:00:00Z"},
            ], "history": [{"name": "web"}]},
        }))
        .unwrap();
        let before = ReleaseView::from_object(&full);
        let mut trimmed = full.clone();
        trim(&mut trimmed);
        let after = ReleaseView::from_object(&trimmed);

        assert_eq!(is_of_interest(&before), is_of_interest(&after));
        assert_eq!(before.is_stuck(), after.is_stuck());
        assert_eq!(before.suspended_by_us(), after.suspended_by_us());
        assert_eq!(before.has_fence(), after.has_fence());
        assert_eq!(
            before.carries_processed_annotation(),
            after.carries_processed_annotation()
        );
        assert_eq!(
            trimmed.data,
            json!({"spec": {"suspend": true}, "status": {"conditions": [
                {"type": "Ready", "status": "False", "message": "x has no deployed releases"}]}})
        );
        assert_eq!(trimmed.metadata.labels, None);
        assert_eq!(
            trimmed.metadata.managed_fields.as_ref().map(Vec::len),
            Some(1)
        );
        assert!(
            serde_json::to_vec(&trimmed).unwrap().len() * 3
                < serde_json::to_vec(&full).unwrap().len()
        );
        assert_eq!(
            trimmed.metadata.finalizers,
            Some(vec!["flux-plunger.cozystack.io/uninstall-fence".to_owned()])
        );
    }

    #[test]
    fn a_healthy_release_keeps_no_json_at_all() {
        let mut healthy: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "helm.toolkit.fluxcd.io/v2", "kind": "HelmRelease",
            "metadata": {"name": "web", "namespace": "apps", "finalizers": ["finalizers.fluxcd.io"]},
            "spec": {"suspend": false, "interval": "5m"},
            "status": {"conditions": [
                {"type": "Ready", "status": "True", "message": "Helm upgrade succeeded", "reason": "r", "lastTransitionTime": "2026-01-01T00:00:00Z"},
            ]},
        }))
        .unwrap();
        let before = ReleaseView::from_object(&healthy);
        trim(&mut healthy);
        let after = ReleaseView::from_object(&healthy);
        assert_eq!(healthy.data, json!({}));
        assert_eq!(healthy.metadata.finalizers, Some(vec![]));
        assert_eq!(is_of_interest(&before), is_of_interest(&after));
        assert_eq!(before.suspend, after.suspend);
        assert_eq!(before.has_fence(), after.has_fence());
    }
}
