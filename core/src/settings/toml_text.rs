//! Settings written back as TOML, for the messages that refuse them: a
//! key part as the operator has to write it (`"eu.west"`, quoted because
//! of its dot), and a value of any shape as it was given (`{ c =
//! "random" }`, written by the `toml` crate), so that an error shows what was read rather than serde's
//! idea of it ("unknown variant `c`").

use std::fmt;

use serde::Deserialize;

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

/// A settings value of any shape, as it was given, for a message that
/// refuses it: `a table { c = "random" }` (its `Display`: the kind of
/// value, then the value as TOML writes it, by the `toml` crate). Needs a
/// self-describing format (TOML, JSON).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(transparent)]
pub(crate) struct Given(toml::Value);

impl Given {
    /// The value when it is a string.
    pub(crate) fn as_str(&self) -> Option<&str> {
        self.0.as_str()
    }
}

impl fmt::Display for Given {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match &self.0 {
            toml::Value::String(_) => "a string",
            toml::Value::Integer(_) => "an integer",
            toml::Value::Float(_) => "a float",
            toml::Value::Boolean(_) => "a boolean",
            toml::Value::Datetime(_) => "a date-time",
            toml::Value::Array(_) => "an array",
            toml::Value::Table(_) => "a table",
        };
        write!(f, "{kind} {}", self.0)
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
        assert_eq!(shown(r#"{ c = "random" }"#), r#"a table { c = "random" }"#);
        assert_eq!(shown(r#"{ "x.y" = [1, 2.5, true] }"#), r#"a table { "x.y" = [1, 2.5, true] }"#);
        assert_eq!(shown(r#""sticky""#), r#"a string "sticky""#);
        assert_eq!(shown("5"), "an integer 5");
        assert_eq!(shown("1.0"), "a float 1.0");
        assert_eq!(shown("[]"), "an array []");
    }
}
