//! Topic names and topic filters: validation, shared-subscription parsing and
//! the reference matcher (MQTT 5.0 §4.7–§4.8.2, MQTT 3.1.1 §4.7).
//!
//! A **topic name** is what a PUBLISH carries: no wildcards. A **topic
//! filter** is what a SUBSCRIBE or UNSUBSCRIBE carries: it may hold the
//! single-level wildcard `+` and, as its last level, the multi-level
//! wildcard `#`. Levels are separated by `/` and may be empty.
//!
//! [`matches`] is the simple reference implementation of the matching rules;
//! the subscription and route tries ([`crate::trie`], [`crate::route`]) walk
//! many filters at once and are checked against it by property tests.

use thiserror::Error;

/// The prefix of a shared subscription filter, `$share/{group}/{filter}`
/// (MQTT 5.0 §4.8.2).
const SHARE_PREFIX: &str = "$share/";

/// Limits applied on top of the specification (DESIGN.md §9:
/// `maxTopicLevels` / `maxTopicBytes`).
///
/// The defaults are 32 levels and 1024 bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TopicLimits {
    /// Most levels (`/`-separated parts) a topic name or filter may have;
    /// default 32. For a shared filter, counted on its inner filter.
    pub max_levels: usize,
    /// Most bytes of UTF-8 a topic name or filter may have, the whole string
    /// (including any `$share/{group}/` prefix); default 1024.
    pub max_bytes: usize,
}

impl Default for TopicLimits {
    /// 32 levels, 1024 bytes (DESIGN.md §9).
    fn default() -> Self {
        Self {
            max_levels: 32,
            max_bytes: 1024,
        }
    }
}

/// Why a topic name or topic filter was refused. Every variant is the
/// client's fault: the caller answers with reason code 0x90 (Topic Name
/// invalid) for a PUBLISH, 0x8F (Topic Filter invalid) for a SUBSCRIBE, or
/// closes the connection for MQTT 3.1.1.
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum TopicError {
    /// The name or filter is the empty string [MQTT-4.7.3-1].
    #[error("topic is empty")]
    Empty,
    /// The string is longer than [`TopicLimits::max_bytes`].
    #[error("topic is {len} bytes long, the limit is {max}")]
    TooLong {
        /// Length of the string in bytes.
        len: usize,
        /// The limit in bytes.
        max: usize,
    },
    /// The string has more levels than [`TopicLimits::max_levels`].
    #[error("topic has {levels} levels, the limit is {max}")]
    TooManyLevels {
        /// Number of `/`-separated levels.
        levels: usize,
        /// The limit.
        max: usize,
    },
    /// A topic name (PUBLISH) contains `+` or `#` [MQTT-3.3.2-2].
    #[error("topic name contains a wildcard")]
    WildcardInName,
    /// A filter has `#` somewhere other than alone in its last level
    /// [MQTT-4.7.1-2] (`a/b#`, `a/#/b`) or `+` not alone in its level
    /// [MQTT-4.7.1-3] (`a+/b`).
    #[error("topic filter has a misplaced wildcard")]
    MisplacedWildcard,
    /// The string contains U+0000 [MQTT-4.7.3-2].
    #[error("topic contains the null character")]
    NullCharacter,
    /// A `$share/{group}/{filter}` filter is malformed (MQTT 5.0 §4.8.2): the
    /// group is empty or contains `+` or `#` [MQTT-4.8.2-2], or the filter
    /// after the group is missing or empty [MQTT-4.8.2-1].
    #[error("shared subscription filter is malformed")]
    InvalidShare,
}

/// Validate a Topic Name, as carried by a PUBLISH.
///
/// # Errors
///
/// - [`TopicError::Empty`] for `""` [MQTT-4.7.3-1];
/// - [`TopicError::TooLong`] beyond `limits.max_bytes`;
/// - [`TopicError::NullCharacter`] if it contains U+0000 [MQTT-4.7.3-2];
/// - [`TopicError::WildcardInName`] if it contains `+` or `#` [MQTT-3.3.2-2];
/// - [`TopicError::TooManyLevels`] beyond `limits.max_levels`.
pub fn validate_topic_name(name: &str, limits: &TopicLimits) -> Result<(), TopicError> {
    check_common(name, limits)?;
    let mut levels = 1;
    for b in name.bytes() {
        match b {
            b'+' | b'#' => return Err(TopicError::WildcardInName),
            b'/' => levels += 1,
            _ => {}
        }
    }
    check_levels(levels, limits)
}

/// Validate a Topic Filter, as carried by a SUBSCRIBE or UNSUBSCRIBE.
///
/// A shared filter `$share/{group}/{filter}` is validated as its inner
/// filter plus the group rules (MQTT 5.0 §4.8.2); whether the protocol
/// version allows shared subscriptions at all is the caller's decision.
///
/// # Errors
///
/// - [`TopicError::Empty`] for `""` [MQTT-4.7.3-1];
/// - [`TopicError::TooLong`] beyond `limits.max_bytes` (whole string);
/// - [`TopicError::NullCharacter`] if it contains U+0000 [MQTT-4.7.3-2];
/// - [`TopicError::InvalidShare`] for a bad `$share/` prefix;
/// - [`TopicError::MisplacedWildcard`] if `#` is not alone in the last level
///   [MQTT-4.7.1-2] or `+` is not alone in its level [MQTT-4.7.1-3];
/// - [`TopicError::TooManyLevels`] beyond `limits.max_levels` (inner filter).
pub fn validate_topic_filter(filter: &str, limits: &TopicLimits) -> Result<(), TopicError> {
    check_common(filter, limits)?;
    let inner = match parse_shared(filter) {
        Some((group, inner)) => {
            if group.is_empty() || group.contains(['+', '#']) || inner.is_empty() {
                return Err(TopicError::InvalidShare);
            }
            inner
        }
        None => filter,
    };
    check_levels(filter_levels(inner)?, limits)
}

/// The levels of the plain filter `filter`.
///
/// # Errors
/// [`TopicError::MisplacedWildcard`] if `#` is not alone in the last
/// level [MQTT-4.7.1-2] or `+` is not alone in its level [MQTT-4.7.1-3].
fn filter_levels(filter: &str) -> Result<usize, TopicError> {
    let mut levels = 0;
    let mut parts = filter.split('/').peekable();
    while let Some(level) = parts.next() {
        levels += 1;
        let misplaced_hash = level.contains('#') && (level != "#" || parts.peek().is_some());
        let misplaced_plus = level.contains('+') && level != "+";
        if misplaced_hash || misplaced_plus {
            return Err(TopicError::MisplacedWildcard);
        }
    }
    Ok(levels)
}

/// Whether `error`, found by [`validate_topic_filter`] in `filter`, makes
/// the filter a protocol violation for an MQTT 3.1.1 client, which closes
/// its connection (3.1.1 §4.8), rather than one refused with SUBACK 0x80:
/// not a filter over the broker's limits, nor a `$share/...` one that is
/// malformed as a shared subscription but a legal 3.1.1 filter (3.1.1 has
/// no shared subscriptions: `$share//t` and `$share/g` are filters like
/// any other there, which this broker does not serve).
pub fn violates_3_1_1(error: &TopicError, filter: &str) -> bool {
    match error {
        TopicError::TooLong { .. } | TopicError::TooManyLevels { .. } => false,
        TopicError::InvalidShare => filter_levels(filter).is_err(),
        _ => true,
    }
}

/// Split a shared subscription filter `$share/{group}/{filter}` (MQTT 5.0
/// §4.8.2) into `Some((group, filter))`; `None` when `filter` does not start
/// with `$share/`.
///
/// No validation is done: `$share/g` gives `Some(("g", ""))` and `$share//a`
/// gives `Some(("", "a"))`; [`validate_topic_filter`] refuses both.
pub fn parse_shared(filter: &str) -> Option<(&str, &str)> {
    let rest = filter.strip_prefix(SHARE_PREFIX)?;
    Some(rest.split_once('/').unwrap_or((rest, "")))
}

/// True for topics a first-level wildcard must not match: those starting
/// with `$` `[MQTT-4.7.2-1]` and the broker's internal ones starting with
/// U+0000 (workspace prefixes, which no client can send).
pub fn is_reserved_topic(topic: &str) -> bool {
    topic.starts_with(['$', '\0'])
}

/// Does the topic filter `filter` match the topic name `topic`?
///
/// Both are assumed valid (see [`validate_topic_filter`],
/// [`validate_topic_name`]); `filter` is a plain filter: for a shared
/// subscription pass the inner filter from [`parse_shared`]. The rules
/// (MQTT 5.0 §4.7):
///
/// - a filter whose first level is `+` or `#` does not match a topic
///   starting with `$` [MQTT-4.7.2-1], so `#` alone matches every topic not
///   starting with `$`;
/// - `#` matches the parent level and any number of levels below:
///   `sport/#` matches `sport` [MQTT-4.7.1-2];
/// - `+` matches exactly one level, which may be empty: `+/+` matches
///   `/finance`.
///
/// Topics starting with U+0000 (the broker's internal workspace prefixes,
/// which no client can send) are treated like `$` topics: a first-level
/// wildcard of the default workspace never reaches into a named one.
///
/// This is the reference implementation; the tries answer the same
/// question for many filters at once.
pub fn matches(filter: &str, topic: &str) -> bool {
    if is_reserved_topic(topic) && filter.starts_with(['+', '#']) {
        return false;
    }
    let mut filter_levels = filter.split('/');
    let mut topic_levels = topic.split('/');
    loop {
        match (filter_levels.next(), topic_levels.next()) {
            (Some("#"), _) => return true,
            (None, None) => return true,
            (Some("+"), Some(_)) => {}
            (Some(f), Some(t)) if f == t => {}
            _ => return false,
        }
    }
}

/// The checks shared by names and filters: empty, length, U+0000.
fn check_common(s: &str, limits: &TopicLimits) -> Result<(), TopicError> {
    if s.is_empty() {
        return Err(TopicError::Empty);
    }
    if s.len() > limits.max_bytes {
        return Err(TopicError::TooLong {
            len: s.len(),
            max: limits.max_bytes,
        });
    }
    if s.contains('\0') {
        return Err(TopicError::NullCharacter);
    }
    Ok(())
}

fn check_levels(levels: usize, limits: &TopicLimits) -> Result<(), TopicError> {
    if levels > limits.max_levels {
        return Err(TopicError::TooManyLevels {
            levels,
            max: limits.max_levels,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn name(s: &str) -> Result<(), TopicError> {
        validate_topic_name(s, &TopicLimits::default())
    }

    fn filter(s: &str) -> Result<(), TopicError> {
        validate_topic_filter(s, &TopicLimits::default())
    }

    /// (filter, topic, expected) — the examples of MQTT 5.0 §4.7.1–§4.7.2.
    const MATCH_TABLE: &[(&str, &str, bool)] = &[
        // [MQTT-4.7.1-2] multi-level wildcard
        ("sport/tennis/player1/#", "sport/tennis/player1", true),
        (
            "sport/tennis/player1/#",
            "sport/tennis/player1/ranking",
            true,
        ),
        (
            "sport/tennis/player1/#",
            "sport/tennis/player1/score/wimbledon",
            true,
        ),
        ("sport/tennis/player1/#", "sport/tennis/player2", false),
        ("sport/#", "sport", true),
        ("sport/#", "sports", false),
        ("#", "sport/tennis", true),
        ("#", "/", true),
        // [MQTT-4.7.1-3] single-level wildcard
        ("sport/tennis/+", "sport/tennis/player1", true),
        ("sport/tennis/+", "sport/tennis/player2", true),
        ("sport/tennis/+", "sport/tennis/player1/ranking", false),
        ("sport/+", "sport", false),
        ("sport/+", "sport/", true),
        ("+/+", "/finance", true),
        ("/+", "/finance", true),
        ("+", "/finance", false),
        ("+", "finance", true),
        ("+/tennis/#", "sport/tennis/player1", true),
        // [MQTT-4.7.2-1] topics starting with '$'
        ("#", "$SYS", false),
        ("#", "$SYS/broker/clients", false),
        ("$SYS/#", "$SYS/broker/clients", true),
        ("$SYS/#", "$SYS", true),
        ("+/monitor/Clients", "$SYS/monitor/Clients", false),
        ("$SYS/monitor/+", "$SYS/monitor/Clients", true),
        ("+", "$SYS", false),
        // exact filters, case and empty levels
        ("a/b", "a/b", true),
        ("a/b", "A/b", false),
        ("a/b", "a/b/", false),
        ("a//b", "a//b", true),
        ("a/+/b", "a//b", true),
        ("/", "/", true),
        ("+/#", "a", true),
        ("a/$x", "a/$x", true),
        ("a/+", "a/$x", true),
    ];

    #[test]
    fn first_level_wildcards_never_match_internal_workspace_topics() {
        // Named workspaces live under a U+0000 prefix; the default
        // workspace's `#` and `+` must not reach them (DESIGN.md §9).
        assert!(!matches("#", "\0alpha/fleet/t"));
        assert!(!matches("+/fleet/t", "\0alpha/fleet/t"));
        assert!(matches("\0alpha/#", "\0alpha/fleet/t"));
        let mut trie = crate::trie::SubscriptionTrie::new();
        trie.insert("#", 1u32, ());
        trie.insert("\0alpha/#", 2u32, ());
        let mut seen = vec![];
        trie.for_each_match("\0alpha/fleet/t", |k, _| seen.push(*k));
        assert_eq!(seen, vec![2]);
    }

    #[test]
    fn the_spec_matching_examples_hold() {
        for &(f, t, expected) in MATCH_TABLE {
            assert_eq!(matches(f, t), expected, "filter {f:?} topic {t:?}");
            assert_eq!(filter(f), Ok(()), "filter {f:?} is valid");
            assert_eq!(name(t), Ok(()), "topic {t:?} is valid");
        }
    }

    #[test]
    fn an_empty_name_or_filter_is_refused() {
        // [MQTT-4.7.3-1]
        assert_eq!(name(""), Err(TopicError::Empty));
        assert_eq!(filter(""), Err(TopicError::Empty));
    }

    #[test]
    fn a_name_with_a_wildcard_is_refused() {
        // [MQTT-3.3.2-2]
        assert_eq!(name("a/+"), Err(TopicError::WildcardInName));
        assert_eq!(name("a/#"), Err(TopicError::WildcardInName));
        assert_eq!(name("a/b#c"), Err(TopicError::WildcardInName));
    }

    #[test]
    fn a_null_character_is_refused_in_names_and_filters() {
        // [MQTT-4.7.3-2]
        assert_eq!(name("a/\0"), Err(TopicError::NullCharacter));
        assert_eq!(filter("a/\0/#"), Err(TopicError::NullCharacter));
    }

    #[test]
    fn misplaced_wildcards_are_refused() {
        // [MQTT-4.7.1-2], [MQTT-4.7.1-3]
        for f in [
            "a/b#", "a/#/b", "#/a", "##", "a+/b", "a/+b", "++", "a/b+", "+#",
        ] {
            assert_eq!(filter(f), Err(TopicError::MisplacedWildcard), "{f:?}");
        }
        for f in ["#", "+", "+/+/#", "a/+/c/#", "/#", "+/"] {
            assert_eq!(filter(f), Ok(()), "{f:?}");
        }
    }

    #[test]
    fn the_byte_limit_counts_the_whole_string() {
        let limits = TopicLimits {
            max_levels: 32,
            max_bytes: 4,
        };
        assert_eq!(validate_topic_name("abcd", &limits), Ok(()));
        assert_eq!(
            validate_topic_name("abcde", &limits),
            Err(TopicError::TooLong { len: 5, max: 4 })
        );
        assert_eq!(
            validate_topic_filter("ab/#/", &limits),
            Err(TopicError::TooLong { len: 5, max: 4 })
        );
    }

    #[test]
    fn the_level_limit_counts_empty_levels() {
        let limits = TopicLimits {
            max_levels: 3,
            max_bytes: 1024,
        };
        assert_eq!(validate_topic_name("a//b", &limits), Ok(()));
        assert_eq!(
            validate_topic_name("a///", &limits),
            Err(TopicError::TooManyLevels { levels: 4, max: 3 })
        );
        assert_eq!(
            validate_topic_filter("+/+/+/#", &limits),
            Err(TopicError::TooManyLevels { levels: 4, max: 3 })
        );
        // The level limit applies to the inner filter of a shared one.
        assert_eq!(validate_topic_filter("$share/g/a/b/c", &limits), Ok(()));
    }

    #[test]
    fn the_default_limits_are_32_levels_and_1024_bytes() {
        let limits = TopicLimits::default();
        assert_eq!((limits.max_levels, limits.max_bytes), (32, 1024));
        assert_eq!(name(&["a"; 32].join("/")), Ok(()));
        assert!(matches!(
            name(&["a"; 33].join("/")),
            Err(TopicError::TooManyLevels {
                levels: 33,
                max: 32
            })
        ));
        assert!(matches!(
            name(&"a".repeat(1025)),
            Err(TopicError::TooLong {
                len: 1025,
                max: 1024
            })
        ));
    }

    #[test]
    fn shared_filters_are_split_into_group_and_filter() {
        // MQTT 5.0 §4.8.2
        assert_eq!(parse_shared("$share/g/a/+"), Some(("g", "a/+")));
        assert_eq!(parse_shared("$share/g/#"), Some(("g", "#")));
        assert_eq!(parse_shared("$share/g"), Some(("g", "")));
        assert_eq!(parse_shared("$share//a"), Some(("", "a")));
        assert_eq!(parse_shared("$share"), None);
        assert_eq!(parse_shared("$SHARE/g/a"), None);
        assert_eq!(parse_shared("a/$share/g/a"), None);
    }

    #[test]
    fn a_shared_filter_is_valid_when_group_and_inner_filter_are() {
        assert_eq!(filter("$share/workers/devices/+/telemetry"), Ok(()));
        assert_eq!(filter("$share/g/#"), Ok(()));
        // [MQTT-4.8.2-1] a filter must follow the group
        assert_eq!(filter("$share/g"), Err(TopicError::InvalidShare));
        assert_eq!(filter("$share/g/"), Err(TopicError::InvalidShare));
        // [MQTT-4.8.2-2] the group is non-empty, without wildcards
        assert_eq!(filter("$share//a"), Err(TopicError::InvalidShare));
        assert_eq!(filter("$share/+/a"), Err(TopicError::InvalidShare));
        assert_eq!(filter("$share/g#/a"), Err(TopicError::InvalidShare));
        assert_eq!(filter("$share/"), Err(TopicError::InvalidShare));
        // The inner filter follows the filter rules.
        assert_eq!(filter("$share/g/a/#/b"), Err(TopicError::MisplacedWildcard));
    }

    proptest! {
        #[test]
        fn a_valid_name_matches_itself_and_hash(topic in "[ab$/]{1,8}") {
            prop_assume!(name(&topic).is_ok());
            prop_assert!(matches(&topic, &topic));
            prop_assert_eq!(matches("#", &topic), !topic.starts_with('$'));
        }

        #[test]
        fn replacing_a_level_with_plus_still_matches(topic in "[ab/]{1,8}", index in 0usize..8) {
            let mut levels: Vec<&str> = topic.split('/').collect();
            let i = index % levels.len();
            levels[i] = "+";
            prop_assert!(matches(&levels.join("/"), &topic));
        }
    }
}
