//! JSON that a namespace's tenant shapes, decoded by kind and bounded.
//!
//! A Helm storage payload, a storage Secret's labels, or the whole answer of
//! a remote cluster's server (its kubeconfig names the server) is written by
//! whoever can write that namespace or run that server. Decoded with serde's
//! derives alone, a string where an object, an array or a number was expected
//! is quoted whole in the error (and Rust's escaping can make each byte six),
//! and an array may hold millions of tiny items that each become a struct.
//! These types read each value by its kind, refuse any other kind by naming
//! it, and bound strings and arrays, so what is decoded, and every error
//! about it, stays small whatever was sent. Pure: nothing here makes a
//! request.

use std::fmt;
use std::marker::PhantomData;

use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};

/// A JSON object, read as `T` (whose own fields should be these types too).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Object<T>(pub(crate) T);

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Object<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct ObjectVisitor<T>(PhantomData<T>);
        impl<'de, T: Deserialize<'de>> Visitor<'de> for ObjectVisitor<T> {
            type Value = Object<T>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an object")
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Object<T>, A::Error> {
                T::deserialize(de::value::MapAccessDeserializer::new(map)).map(Object)
            }
            fn visit_str<E: de::Error>(self, _: &str) -> Result<Object<T>, E> {
                Err(E::custom("a string, not an object"))
            }
        }
        deserializer.deserialize_any(ObjectVisitor(PhantomData))
    }
}

/// A JSON array of at most `MAX` items.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct List<T, const MAX: usize>(pub(crate) Vec<T>);

impl<'de, T: Deserialize<'de>, const MAX: usize> Deserialize<'de> for List<T, MAX> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct ListVisitor<T, const MAX: usize>(PhantomData<T>);
        impl<'de, T: Deserialize<'de>, const MAX: usize> Visitor<'de> for ListVisitor<T, MAX> {
            type Value = List<T, MAX>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                write!(f, "an array of at most {MAX} items")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<List<T, MAX>, A::Error> {
                let mut items = Vec::new();
                while let Some(item) = seq.next_element()? {
                    if items.len() == MAX {
                        return Err(de::Error::custom(format_args!(
                            "an array of more than {MAX} items"
                        )));
                    }
                    items.push(item);
                }
                Ok(List(items))
            }
            fn visit_str<E: de::Error>(self, _: &str) -> Result<List<T, MAX>, E> {
                Err(E::custom("a string, not an array"))
            }
        }
        deserializer.deserialize_any(ListVisitor(PhantomData))
    }
}

/// A JSON string of at most `MAX` bytes; a longer one is refused by its
/// length.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Text<const MAX: usize>(pub(crate) String);

impl<'de, const MAX: usize> Deserialize<'de> for Text<MAX> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct TextVisitor<const MAX: usize>;
        impl<const MAX: usize> Visitor<'_> for TextVisitor<MAX> {
            type Value = Text<MAX>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                write!(f, "a string of at most {MAX} bytes")
            }
            fn visit_str<E: de::Error>(self, text: &str) -> Result<Text<MAX>, E> {
                if text.len() > MAX {
                    return Err(E::custom(format_args!(
                        "a string of {} bytes, more than {MAX}",
                        text.len()
                    )));
                }
                Ok(Text(text.to_owned()))
            }
        }
        deserializer.deserialize_string(TextVisitor::<MAX>)
    }
}

/// A JSON string kept to its first `MAX` bytes (cut at a character, marked
/// with `…`): for text that is only ever shown, like a refusal's message.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Excerpt<const MAX: usize>(pub(crate) String);

impl<'de, const MAX: usize> Deserialize<'de> for Excerpt<MAX> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct ExcerptVisitor<const MAX: usize>;
        impl<const MAX: usize> Visitor<'_> for ExcerptVisitor<MAX> {
            type Value = Excerpt<MAX>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_str<E: de::Error>(self, text: &str) -> Result<Excerpt<MAX>, E> {
                Ok(Excerpt(excerpt(text, MAX)))
            }
        }
        deserializer.deserialize_string(ExcerptVisitor::<MAX>)
    }
}

/// `text` cut to at most `max` bytes at a character boundary, with `…`
/// where it was cut.
pub(crate) fn excerpt(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_owned();
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &text[..end])
}

/// Whether a field is present and not `null`, whatever its value (skipped
/// unread).
pub(crate) fn is_set<'de, D: Deserializer<'de>>(deserializer: D) -> Result<bool, D::Error> {
    Option::<de::IgnoredAny>::deserialize(deserializer).map(|set| set.is_some())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Debug, Deserialize, PartialEq)]
    struct Meta {
        name: Option<Text<8>>,
    }

    const LONG: usize = 1024 * 1024;

    fn long_string() -> String {
        serde_json::to_string(&"\u{7f}".repeat(LONG)).unwrap()
    }

    #[test]
    fn each_kind_is_read_and_any_other_kind_refused_without_quoting_it() {
        let read: Object<Meta> = serde_json::from_str(r#"{"name": "web", "other": [1]}"#).unwrap();
        assert_eq!(read.0.name, Some(Text("web".into())));
        let list: List<Text<8>, 2> = serde_json::from_str(r#"["a", "b"]"#).unwrap();
        assert_eq!(list.0.len(), 2);
        let exact: Text<3> = serde_json::from_str(r#""web""#).unwrap();
        assert_eq!(exact.0, "web", "a string of exactly its bound");
        assert!(serde_json::from_str::<Text<2>>(r#""web""#).is_err());

        let long = long_string();
        let errors = [
            serde_json::from_str::<Object<Meta>>(&long).unwrap_err(),
            serde_json::from_str::<List<Meta, 2>>(&long).unwrap_err(),
            serde_json::from_str::<Text<8>>(&long).unwrap_err(),
            serde_json::from_str::<Object<Meta>>(&format!(r#"{{"name": {long}}}"#)).unwrap_err(),
        ];
        for err in errors {
            let said = err.to_string();
            assert!(said.len() < 200, "{} bytes", said.len());
        }
    }

    #[test]
    fn an_array_past_its_bound_is_refused_at_its_first_extra_item() {
        let many = format!("[{}{{}}]", "{},".repeat(100_000));
        let err = serde_json::from_str::<List<Object<Meta>, 10>>(&many).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("an array of more than 10 items"),
            "{err}"
        );
    }

    #[test]
    fn an_excerpt_is_cut_at_a_character_and_marked() {
        assert_eq!(excerpt("short", 8), "short");
        assert_eq!(excerpt("exact", 5), "exact");
        assert_eq!(excerpt("ééé", 3), "é…", "never inside a character");
        let read: Excerpt<4> = serde_json::from_str(r#""refused!""#).unwrap();
        assert_eq!(read.0, "refu…");
    }

    #[test]
    fn a_field_is_set_when_present_and_not_null() {
        #[derive(Deserialize)]
        struct Deleted {
            #[serde(default, deserialize_with = "is_set")]
            at: bool,
        }
        let at = |json: &str| serde_json::from_str::<Deleted>(json).unwrap().at;
        assert!(at(r#"{"at": "2026-01-01T00:00:00Z"}"#));
        assert!(!at(r#"{"at": null}"#));
        assert!(!at("{}"));
    }
}
