//! A HelmRelease as the listings decode it: the whole object but
//! `spec.values`, which no decision reads and which is most of a release.
//!
//! The drain and the pre-delete hook list every fenced release in pages;
//! decoded whole, a page of releases carrying 50 KB of values each is a
//! JSON tree of a hundred MiB or more, past the drain's memory limit. The
//! values are skipped while parsing (serde's `IgnoredAny` allocates
//! nothing), so a page costs its metadata, the rest of its spec and its
//! status.

use std::fmt;

use kube::api::{DynamicObject, ObjectMeta};
use serde::Deserialize;
use serde::de::{Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Value};

/// A listed HelmRelease; `.0` is the object without `spec.values`.
#[derive(Clone, Debug)]
pub(crate) struct ListedRelease(pub(crate) DynamicObject);

impl<'de> Deserialize<'de> for ListedRelease {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        struct Listed {
            #[serde(default)]
            metadata: ObjectMeta,
            #[serde(default, deserialize_with = "spec_without_values")]
            spec: Option<Map<String, Value>>,
            #[serde(default)]
            status: Option<Value>,
        }
        let listed = Listed::deserialize(deserializer)?;
        let mut data = Map::new();
        if let Some(spec) = listed.spec {
            data.insert("spec".into(), Value::Object(spec));
        }
        if let Some(status) = listed.status {
            data.insert("status".into(), status);
        }
        Ok(Self(DynamicObject {
            types: None,
            metadata: listed.metadata,
            data: Value::Object(data),
        }))
    }
}

/// The spec's fields but `values`. A spec that is not an object (the CRD's
/// schema forbids it) reads as none, rather than failing the whole page.
fn spec_without_values<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<Map<String, Value>>, D::Error> {
    struct SpecVisitor;

    impl<'de> Visitor<'de> for SpecVisitor {
        type Value = Option<Map<String, Value>>;

        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("a HelmRelease spec")
        }

        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            let mut spec = Map::new();
            while let Some(key) = map.next_key::<String>()? {
                if key == "values" {
                    map.next_value::<IgnoredAny>()?;
                } else {
                    let value = map.next_value()?;
                    spec.insert(key, value);
                }
            }
            Ok(Some(spec))
        }

        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
            while seq.next_element::<IgnoredAny>()?.is_some() {}
            Ok(None)
        }

        fn visit_unit<E>(self) -> Result<Self::Value, E> {
            Ok(None)
        }

        fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
            Ok(None)
        }

        fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
            Ok(None)
        }

        fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
            Ok(None)
        }

        fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
            Ok(None)
        }

        fn visit_str<E>(self, _: &str) -> Result<Self::Value, E> {
            Ok(None)
        }
    }

    deserializer.deserialize_any(SpecVisitor)
}

/// Implements `kube::Resource` for a newtype around a HelmRelease's
/// `DynamicObject` (`.0`), so that a dynamic `Api` of it decodes pages into
/// the newtype's own, smaller, form.
#[macro_export]
macro_rules! helmrelease_newtype_resource {
    ($newtype:ty) => {
        impl ::kube::core::Resource for $newtype {
            type DynamicType = ::kube::api::ApiResource;
            type Scope = ::kube::core::DynamicResourceScope;

            fn group(dt: &::kube::api::ApiResource) -> ::std::borrow::Cow<'_, str> {
                dt.group.as_str().into()
            }

            fn version(dt: &::kube::api::ApiResource) -> ::std::borrow::Cow<'_, str> {
                dt.version.as_str().into()
            }

            fn kind(dt: &::kube::api::ApiResource) -> ::std::borrow::Cow<'_, str> {
                dt.kind.as_str().into()
            }

            fn api_version(dt: &::kube::api::ApiResource) -> ::std::borrow::Cow<'_, str> {
                dt.api_version.as_str().into()
            }

            fn plural(dt: &::kube::api::ApiResource) -> ::std::borrow::Cow<'_, str> {
                dt.plural.as_str().into()
            }

            fn meta(&self) -> &::kube::api::ObjectMeta {
                &self.0.metadata
            }

            fn meta_mut(&mut self) -> &mut ::kube::api::ObjectMeta {
                &mut self.0.metadata
            }
        }
    };
}

helmrelease_newtype_resource!(ListedRelease);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::release::view::ReleaseView;
    use serde_json::json;

    fn whole() -> Value {
        json!({
            "apiVersion": "helm.toolkit.fluxcd.io/v2", "kind": "HelmRelease",
            "metadata": {
                "name": "web", "namespace": "apps", "uid": "u", "resourceVersion": "3",
                "generation": 4, "deletionTimestamp": "2026-01-02T00:00:00Z",
                "labels": {"flux-plunger.cozystack.io/uninstall-fence": "held"},
                "finalizers": ["finalizers.fluxcd.io", "flux-plunger.cozystack.io/uninstall-fence"],
                "managedFields": [{"manager": "flux-plunger", "operation": "Apply", "fieldsType": "FieldsV1",
                    "fieldsV1": {"f:spec": {"f:suspend": {}}}}],
            },
            "spec": {
                "suspend": true, "releaseName": "r", "targetNamespace": "t", "storageNamespace": "s",
                "kubeConfig": {"secretRef": {"name": "k", "key": "value"}},
                "values": {"big": "x".repeat(50_000), "list": [1, 2, 3]},
            },
            "status": {
                "conditions": [{"type": "Ready", "status": "False", "message": "has no deployed releases"}],
                "history": [{"name": "r"}], "storageNamespace": "s", "observedGeneration": 4,
            },
        })
    }

    #[test]
    fn a_listed_release_is_the_whole_release_but_its_values() {
        let listed: ListedRelease = serde_json::from_value(whole()).unwrap();
        assert!(listed.0.data.pointer("/spec/values").is_none());
        let mut expected: DynamicObject = serde_json::from_value(whole()).unwrap();
        expected.data["spec"]
            .as_object_mut()
            .unwrap()
            .remove("values");
        assert_eq!(listed.0.data, expected.data);
        assert_eq!(
            ReleaseView::from_object(&listed.0),
            ReleaseView::from_object(&serde_json::from_value(whole()).unwrap())
        );
    }

    #[test]
    fn a_spec_of_another_shape_reads_as_none_and_fails_nothing() {
        for spec in [
            json!(null),
            json!("text"),
            json!([1, {"a": 2}]),
            json!(7),
            json!(true),
        ] {
            let mut release = whole();
            release["spec"] = spec.clone();
            let listed: ListedRelease = serde_json::from_value(release).unwrap();
            assert!(listed.0.data.get("spec").is_none(), "{spec}");
        }
    }
}
