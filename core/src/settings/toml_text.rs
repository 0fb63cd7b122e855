//! Settings written back as TOML, for the messages that refuse them: a
//! key part as the operator has to write it (`"eu.west"`, quoted because
//! of its dot), and a value of any shape as it was given (`{c =
//! "random"}`), so that an error shows what was read rather than serde's
//! idea of it ("unknown variant `c`").

use std::fmt;

use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};

/// One part of a dotted key as TOML writes it: bare when it is one or
/// more of `A-Za-z0-9_-`, else quoted (`eu.west` → `"eu.west"`, `` → `""`),
/// as `--set` and a settings file take it back.
pub fn toml_key(part: &str) -> String {
    let bare = !part.is_empty() && part.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if bare {
        part.to_owned()
    } else {
        toml_string(part)
    }
}

/// `text` as a TOML basic string: in double quotes, with `"`, `\` and
/// control characters escaped.
fn toml_string(text: &str) -> String {
    let mut quoted = String::with_capacity(text.len() + 2);
    quoted.push('"');
    for c in text.chars() {
        match c {
            '"' => quoted.push_str("\\\""),
            '\\' => quoted.push_str("\\\\"),
            '\n' => quoted.push_str("\\n"),
            '\t' => quoted.push_str("\\t"),
            c if c.is_control() => quoted.push_str(&format!("\\u{:04X}", u32::from(c))),
            c => quoted.push(c),
        }
    }
    quoted.push('"');
    quoted
}

/// A settings value of any shape, kept as TOML text with what kind of
/// value it is, for a message that refuses it: `a table {c = "random"}`
/// (its `Display`). Needs a self-describing format (TOML, JSON).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Given {
    /// `"a string"`, `"an integer"`, `"a table"`, ...
    kind: &'static str,
    /// The value as TOML writes it.
    text: String,
    /// The string, when the value is one.
    string: Option<String>,
}

impl Given {
    /// The value when it is a string.
    pub(crate) fn as_str(&self) -> Option<&str> {
        self.string.as_deref()
    }

    fn of(kind: &'static str, text: String) -> Given {
        Given { kind, text, string: None }
    }
}

impl fmt::Display for Given {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.kind, self.text)
    }
}

impl<'de> Deserialize<'de> for Given {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(GivenVisitor)
    }
}

struct GivenVisitor;

impl<'de> Visitor<'de> for GivenVisitor {
    type Value = Given;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any value")
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Given, E> {
        Ok(Given::of("a boolean", v.to_string()))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Given, E> {
        Ok(Given::of("an integer", v.to_string()))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Given, E> {
        Ok(Given::of("an integer", v.to_string()))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Given, E> {
        // `{:?}` keeps the point of a whole float (`1.0`), as TOML does.
        Ok(Given::of("a float", format!("{v:?}")))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Given, E> {
        Ok(Given { kind: "a string", text: toml_string(v), string: Some(v.to_owned()) })
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Given, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element::<Given>()? {
            items.push(item.text);
        }
        Ok(Given::of("an array", format!("[{}]", items.join(", "))))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Given, A::Error> {
        let mut entries = Vec::new();
        while let Some((key, value)) = map.next_entry::<String, Given>()? {
            entries.push(format!("{} = {}", toml_key(&key), value.text));
        }
        Ok(Given::of("a table", format!("{{{}}}", entries.join(", "))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_part_is_quoted_only_when_toml_cannot_take_it_bare() {
        assert_eq!(toml_key("max_clients"), "max_clients");
        assert_eq!(toml_key("billing-1"), "billing-1");
        assert_eq!(toml_key("a.b"), r#""a.b""#);
        assert_eq!(toml_key(""), r#""""#);
        assert_eq!(toml_key("eu west"), r#""eu west""#);
        assert_eq!(toml_key("a\"b\\"), r#""a\"b\\""#);
        assert_eq!(toml_key("é"), r#""é""#);
    }

    #[test]
    fn a_value_of_any_shape_is_shown_as_toml_writes_it() {
        let shown = |text: &str| {
            let table: std::collections::BTreeMap<String, Given> = toml::from_str(&format!("v = {text}")).unwrap();
            table["v"].to_string()
        };
        assert_eq!(shown(r#"{ c = "random" }"#), r#"a table {c = "random"}"#);
        assert_eq!(shown(r#"{ "x.y" = [1, 2.5, true] }"#), r#"a table {"x.y" = [1, 2.5, true]}"#);
        assert_eq!(shown(r#""sticky""#), r#"a string "sticky""#);
        assert_eq!(shown("5"), "an integer 5");
        assert_eq!(shown("1.0"), "a float 1.0");
        assert_eq!(shown("[]"), "an array []");
    }
}
