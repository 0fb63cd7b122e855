//! ACL rules (DESIGN.md §9, §15).
//!
//! One rule a line:
//!
//! ```text
//! # <allow|deny> <user NAME | workspace NAME | any> <publish|subscribe|all> <topic filter>
//! allow any all devices/%c/#
//! allow user ops subscribe devices/#
//! deny any all secret/#
//! ```
//!
//! A line whose first non-blank character is `#` is a comment (a `#` later
//! on a line is part of the filter). The filter is the rest of the line,
//! trimmed, and may contain `%u` (the user name) and `%c` (the client ID).
//! Rules are tried in order and the first that matches decides; when none
//! matches the action is denied.
//!
//! Topics here are the ones the client sees; workspace isolation happens
//! elsewhere (the rule's `workspace NAME` only selects whose rule it is).

use std::path::Path;

use anyhow::Context;
use fleetmq_core::topic::{self, TopicLimits};

/// What a client wants to do with a topic.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    /// Publish to a topic name (also checked on every delivery: a delivery
    /// is allowed when the receiver may *subscribe* to the topic name).
    Publish,
    /// Subscribe with a topic filter.
    Subscribe,
}

/// Why an ACL file's text was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("line {line}: {message}")]
pub struct AclError {
    /// 1-based line number.
    pub line: usize,
    /// What is wrong with it.
    pub message: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Who {
    User(String),
    Workspace(String),
    Any,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Rule {
    allow: bool,
    who: Who,
    publish: bool,
    subscribe: bool,
    filter: String,
    substitutes: bool,
}

/// A parsed ACL: rules in file order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Acl {
    rules: Vec<Rule>,
}

/// Parses the text of an ACL file.
///
/// # Errors
///
/// The first bad line, with its number: an unknown verb, subject or action,
/// a missing name or filter, or a filter that is not a valid MQTT topic
/// filter (after treating `%u` and `%c` as ordinary characters).
pub fn parse(text: &str) -> Result<Acl, AclError> {
    let mut rules = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = raw.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let rule = parse_rule(line).map_err(|message| AclError {
            line: i + 1,
            message,
        })?;
        rules.push(rule);
    }
    Ok(Acl { rules })
}

/// Reads and parses the ACL file at `path`.
///
/// # Errors
///
/// The file cannot be read or [`parse`] refuses it; the message names the
/// file.
pub fn load(path: &Path) -> anyhow::Result<Acl> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("ACL file {}", path.display()))?;
    parse(&text).with_context(|| format!("ACL file {}", path.display()))
}

/// Splits off the first whitespace-separated word.
fn word(s: &str) -> (&str, &str) {
    let s = s.trim_start();
    match s.find(char::is_whitespace) {
        Some(i) => (&s[..i], s[i..].trim_start()),
        None => (s, ""),
    }
}

fn parse_rule(line: &str) -> Result<Rule, String> {
    let (verb, rest) = word(line);
    let allow = match verb {
        "allow" => true,
        "deny" => false,
        other => return Err(format!("expected `allow` or `deny`, found {other:?}")),
    };
    let (subject, mut rest) = word(rest);
    let who = match subject {
        "any" => Who::Any,
        "user" | "workspace" => {
            let (name, after) = word(rest);
            if name.is_empty() {
                return Err(format!("`{subject}` needs a name"));
            }
            rest = after;
            if subject == "user" {
                Who::User(name.to_owned())
            } else {
                Who::Workspace(name.to_owned())
            }
        }
        "" => return Err("expected `user NAME`, `workspace NAME` or `any`".to_owned()),
        other => {
            return Err(format!(
                "expected `user NAME`, `workspace NAME` or `any`, found {other:?}"
            ))
        }
    };
    let (action, filter) = word(rest);
    let (publish, subscribe) = match action {
        "publish" => (true, false),
        "subscribe" => (false, true),
        "all" => (true, true),
        "" => return Err("expected `publish`, `subscribe` or `all`".to_owned()),
        other => {
            return Err(format!(
                "expected `publish`, `subscribe` or `all`, found {other:?}"
            ))
        }
    };
    if filter.is_empty() {
        return Err("expected a topic filter".to_owned());
    }
    let limits = TopicLimits {
        max_levels: usize::MAX,
        max_bytes: usize::MAX,
    };
    topic::validate_topic_filter(filter, &limits)
        .map_err(|e| format!("topic filter {filter:?}: {e}"))?;
    if topic::parse_shared(filter).is_some() {
        return Err(format!(
            "topic filter {filter:?}: write the filter without `$share/GROUP/`"
        ));
    }
    Ok(Rule {
        allow,
        who,
        publish,
        subscribe,
        filter: filter.to_owned(),
        substitutes: filter.contains("%u") || filter.contains("%c"),
    })
}

impl Acl {
    /// Whether a client may perform `action` on `topic`: the first rule
    /// whose subject and action match and whose filter (after `%u` / `%c`
    /// substitution) applies decides; no matching rule denies.
    ///
    /// For [`Action::Publish`], `topic` is a topic name and the rule's
    /// filter must match it. For [`Action::Subscribe`], `topic` is the
    /// requested filter (a `$share/GROUP/` prefix is ignored) and the rule's
    /// filter must [`covers`] it: every topic the requested filter can match
    /// must be matched by the rule's. To check a delivery, ask for
    /// `Subscribe` with the topic name.
    ///
    /// A rule containing `%u` never applies to a client without a user
    /// name, and a rule whose substituted value contains `+`, `#`, `/` or
    /// NUL never applies (it would widen the filter).
    pub fn check(
        &self,
        username: Option<&str>,
        workspace: &str,
        client_id: &str,
        action: Action,
        topic: &str,
    ) -> bool {
        let topic = match action {
            Action::Subscribe => topic::parse_shared(topic).map_or(topic, |(_, inner)| inner),
            Action::Publish => topic,
        };
        for rule in &self.rules {
            let subject = match &rule.who {
                Who::Any => true,
                Who::User(name) => username == Some(name.as_str()),
                Who::Workspace(name) => workspace == name,
            };
            let action_matches = match action {
                Action::Publish => rule.publish,
                Action::Subscribe => rule.subscribe,
            };
            if !subject || !action_matches {
                continue;
            }
            let substituted;
            let filter = if rule.substitutes {
                match substitute(&rule.filter, username, client_id) {
                    Some(f) => {
                        substituted = f;
                        substituted.as_str()
                    }
                    None => continue,
                }
            } else {
                rule.filter.as_str()
            };
            let applies = match action {
                Action::Publish => topic::matches(filter, topic),
                Action::Subscribe => covers(filter, topic),
            };
            if applies {
                return rule.allow;
            }
        }
        false
    }

    /// Number of rules.
    pub fn len(&self) -> usize {
        self.rules.len()
    }

    /// Whether there is no rule (everything is denied).
    pub fn is_empty(&self) -> bool {
        self.rules.is_empty()
    }
}

/// `filter` with `%u` and `%c` replaced, or `None` when a needed value is
/// missing or unsafe (contains `+`, `#`, `/` or NUL, or is empty).
fn substitute(filter: &str, username: Option<&str>, client_id: &str) -> Option<String> {
    let safe = |v: &str| !v.is_empty() && !v.contains(['+', '#', '/', '\0']);
    let mut out = String::with_capacity(filter.len() + 16);
    let mut rest = filter;
    while let Some(i) = rest.find('%') {
        out.push_str(&rest[..i]);
        let after = &rest[i + 1..];
        if let Some(tail) = after.strip_prefix('u') {
            let user = username.filter(|u| safe(u))?;
            out.push_str(user);
            rest = tail;
        } else if let Some(tail) = after.strip_prefix('c') {
            if !safe(client_id) {
                return None;
            }
            out.push_str(client_id);
            rest = tail;
        } else {
            out.push('%');
            rest = after;
        }
    }
    out.push_str(rest);
    Some(out)
}

/// Whether topic filter `outer` matches every topic name that filter
/// `inner` can match (so allowing `outer` allows subscribing to `inner`).
///
/// `a/#` covers `a`, `a/+` and `a/b/#`; `a/+/c` covers `a/b/c` but not
/// `a/#`; `#` and `+` do not cover topics starting with `$` (as in
/// [`topic::matches`]). Both arguments must be valid filters without a
/// `$share/` prefix.
pub fn covers(outer: &str, inner: &str) -> bool {
    let mut outer_levels = outer.split('/');
    let mut inner_levels = inner.split('/');
    let mut first = true;
    loop {
        let o = outer_levels.next();
        let i = inner_levels.next();
        // A wildcard at the first level never matches `$` topics, which only
        // a literal first level starting with `$` can produce.
        let dollar = first && i.is_some_and(|l| l.starts_with('$'));
        let first_level = first;
        first = false;
        match (o, i) {
            (Some("#"), _) => return !dollar,
            (None, None) => return true,
            (Some(_), None) | (None, Some(_)) => return false,
            // Inner `#` at level 0 matches one or more levels, which `+/#`
            // matches too; deeper, it also matches its parent, which only
            // an outer `#` (handled above) does.
            (Some(o), Some("#")) => {
                return first_level && o == "+" && outer_levels.eq(["#"]);
            }
            (Some("+"), Some(_)) if dollar => return false,
            (Some("+"), Some(_)) => {}
            (Some(_), Some("+")) => return false,
            (Some(o), Some(i)) if o == i => {}
            _ => return false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const RULES: &str = "\
# devices talk on their own topics
allow any all devices/%c/#
allow user ops subscribe devices/#
allow workspace acme publish acme/%u/out
deny any all secret/#
allow any subscribe public/#
";

    fn acl() -> Acl {
        parse(RULES).unwrap()
    }

    #[test]
    fn each_client_may_use_its_own_device_topics_only() {
        let a = acl();
        let pub_ = Action::Publish;
        assert!(a.check(None, "default", "c1", pub_, "devices/c1/temp"));
        assert!(a.check(None, "default", "c1", pub_, "devices/c1"));
        assert!(!a.check(None, "default", "c1", pub_, "devices/c2/temp"));
        assert!(a.check(None, "default", "c1", Action::Subscribe, "devices/c1/+/x"));
        assert!(!a.check(None, "default", "c1", Action::Subscribe, "devices/#"));
        assert!(!a.check(None, "default", "c1", Action::Subscribe, "devices/+/temp"));
    }

    #[test]
    fn a_user_rule_applies_to_that_user_only() {
        let a = acl();
        let sub = Action::Subscribe;
        assert!(a.check(Some("ops"), "default", "x", sub, "devices/#"));
        assert!(!a.check(Some("dev"), "default", "x", sub, "devices/#"));
        assert!(!a.check(Some("ops"), "default", "x", Action::Publish, "devices/c9/t"));
    }

    #[test]
    fn a_workspace_rule_applies_to_that_workspace_and_needs_a_user_for_percent_u() {
        let a = acl();
        let pub_ = Action::Publish;
        assert!(a.check(Some("bob"), "acme", "c", pub_, "acme/bob/out"));
        assert!(!a.check(Some("bob"), "other", "c", pub_, "acme/bob/out"));
        assert!(!a.check(Some("bob"), "acme", "c", pub_, "acme/eve/out"));
        assert!(!a.check(None, "acme", "c", pub_, "acme//out"));
        assert!(!a.check(None, "acme", "c", pub_, "acme/%u/out"));
    }

    #[test]
    fn the_first_matching_rule_wins_and_no_match_denies() {
        let a = parse("deny any all a/secret\nallow any all a/#\n").unwrap();
        assert!(!a.check(None, "w", "c", Action::Publish, "a/secret"));
        assert!(a.check(None, "w", "c", Action::Publish, "a/public"));
        assert!(!a.check(None, "w", "c", Action::Publish, "b"));
        // Subscribing to a/# would reach a/secret, but the deny rule does not
        // cover a/#, so the allow rule decides: deliveries are checked too.
        assert!(a.check(None, "w", "c", Action::Subscribe, "a/#"));
        assert!(!a.check(None, "w", "c", Action::Subscribe, "a/secret"));
        assert!(!parse("")
            .unwrap()
            .check(None, "w", "c", Action::Publish, "a"));
    }

    #[test]
    fn substituted_values_with_wildcards_or_slashes_never_widen_a_rule() {
        let a = parse("allow any all devices/%c/#\nallow any all users/%u\n").unwrap();
        for evil in ["#", "+", "a/b", "x\0", ""] {
            assert!(
                !a.check(None, "w", evil, Action::Subscribe, "devices/#"),
                "{evil:?}"
            );
            assert!(
                !a.check(None, "w", evil, Action::Publish, "devices/a/b"),
                "{evil:?}"
            );
            assert!(
                !a.check(Some(evil), "w", "c", Action::Publish, "users/a/b"),
                "{evil:?}"
            );
        }
        assert!(a.check(Some("al"), "w", "c", Action::Publish, "users/al"));
    }

    #[test]
    fn a_shared_subscription_is_checked_by_its_filter() {
        let a = acl();
        let sub = Action::Subscribe;
        assert!(a.check(None, "w", "c", sub, "$share/g/public/x"));
        assert!(!a.check(None, "w", "c", sub, "$share/g/secret/x"));
    }

    #[test]
    fn grammar_errors_name_the_line() {
        let cases = [
            ("permit any all a", 1, "expected `allow` or `deny`"),
            ("# c\nallow someone all a", 2, "expected `user NAME`"),
            ("allow user", 1, "`user` needs a name"),
            ("allow any read a", 1, "expected `publish`"),
            ("\n\nallow any all", 3, "expected a topic filter"),
            ("allow any all a/#/b", 1, "misplaced wildcard"),
            ("allow any all a+", 1, "misplaced wildcard"),
            ("allow any all $share/g/a", 1, "$share"),
        ];
        for (text, line, needle) in cases {
            let err = parse(text).unwrap_err();
            assert_eq!(err.line, line, "{text:?}");
            assert!(err.to_string().contains(needle), "{text:?}: {err}");
        }
        let ok = parse("  # indented comment\nallow   any\tsubscribe  with space/#  \n").unwrap();
        assert_eq!(ok.len(), 1);
        assert!(ok.check(None, "w", "c", Action::Subscribe, "with space/x"));
    }

    #[test]
    fn covers_follows_the_examples() {
        assert!(covers("devices/c1/#", "devices/c1/+/x"));
        assert!(!covers("devices/c1/#", "devices/#"));
        assert!(covers("a/#", "a"));
        assert!(covers("a/#", "a/#"));
        assert!(covers("#", "a/+/#"));
        assert!(covers("+/+", "a/b"));
        assert!(!covers("+/+", "a/#"));
        assert!(!covers("a/b", "a/+"));
        assert!(!covers("#", "$SYS/x"));
        assert!(covers("$SYS/#", "$SYS/x"));
        assert!(covers("#", "+/x"));
        assert!(!covers("a/+", "a"));
        assert!(covers("/#", "/a"));
        assert!(covers("+/#", "#"));
        assert!(!covers("a/+/#", "a/#"));
    }

    /// Every filter over a small alphabet, checked against the definition
    /// "every topic matched by inner is matched by outer" on every topic of
    /// up to four levels (the level `z` stands for any other level).
    #[test]
    fn covers_agrees_with_matching_on_every_small_case() {
        let topic_levels = ["a", "b", "$s", "", "z"];
        let mut topics = Vec::new();
        let mut frontier = vec![String::new()];
        for depth in 1..=4 {
            let mut next = Vec::new();
            for prefix in &frontier {
                for l in topic_levels {
                    if depth > 1 && l.starts_with('$') {
                        continue;
                    }
                    let t = if depth == 1 {
                        l.to_owned()
                    } else {
                        format!("{prefix}/{l}")
                    };
                    next.push(t);
                }
            }
            topics.extend(next.iter().filter(|t| !t.is_empty()).cloned());
            frontier = next;
        }
        let filter_levels = ["a", "b", "$s", "+", "#"];
        let mut filters = Vec::new();
        let mut frontier = vec![String::new()];
        for depth in 1..=3 {
            let mut next = Vec::new();
            for prefix in &frontier {
                if prefix.ends_with('#') {
                    continue;
                }
                for l in filter_levels {
                    if depth > 1 && l.starts_with('$') {
                        continue;
                    }
                    let f = if depth == 1 {
                        l.to_owned()
                    } else {
                        format!("{prefix}/{l}")
                    };
                    next.push(f);
                }
            }
            filters.extend(next.iter().cloned());
            frontier = next;
        }
        for outer in &filters {
            for inner in &filters {
                let expected = topics
                    .iter()
                    .all(|t| !topic::matches(inner, t) || topic::matches(outer, t));
                assert_eq!(covers(outer, inner), expected, "covers({outer}, {inner})");
            }
        }
    }
}
