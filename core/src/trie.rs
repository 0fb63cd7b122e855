//! The per-shard subscription trie (DESIGN.md §3): topic filters stored
//! level by level, matched against a topic name without allocating.
//!
//! One shard owns one trie; there are no locks. The same trie, with a
//! different value type, is the node-wide route table ([`crate::route`]).
//!
//! Layout: each node holds its literal children (a short vector while there
//! are few, a hash map beyond that), an optional `+` child, the subscribers
//! whose filter ends exactly at this node and the subscribers whose filter
//! ends at this node with `/#`. Matching a topic with `L` levels visits at
//! most the nodes on paths that agree with the topic, so an exact topic
//! among 10^6 exact filters costs `L` lookups.

use std::collections::HashMap;
use std::hash::Hash;

/// The levels of a topic name or filter, `/` by `/`: what
/// `str::split('/')` yields (an empty level between two adjacent `/`, and
/// one empty level for ""), found with a byte scan. `Copy`, so a walk that
/// tries both a `+` child and a literal child forks it for free, where a
/// `Split<char>` clone copies its searcher (the matcher's hot path).
#[derive(Clone, Copy)]
struct Levels<'a> {
    /// What is left: `None` once the last level was yielded.
    rest: Option<&'a str>,
}

impl<'a> Levels<'a> {
    fn new(name: &'a str) -> Self {
        Self { rest: Some(name) }
    }
}

impl<'a> Iterator for Levels<'a> {
    type Item = &'a str;

    fn next(&mut self) -> Option<&'a str> {
        let rest = self.rest?;
        match rest.bytes().position(|b| b == b'/') {
            Some(at) => {
                // `/` is ASCII, so both sides of it are char boundaries.
                self.rest = Some(&rest[at + 1..]);
                Some(&rest[..at])
            }
            None => {
                self.rest = None;
                Some(rest)
            }
        }
    }
}

/// A node's literal children move from a vector to a hash map beyond this.
const SMALL_CHILDREN: usize = 8;
/// A filter's subscribers move from a vector to a hash map beyond this.
const SMALL_SUBSCRIBERS: usize = 16;

/// Subscriptions keyed by topic filter, level by level (MQTT 5.0 §4.7).
///
/// `K` identifies a subscriber (e.g. a connection or session slot), `V` holds
/// its subscription options. There is at most one value per (filter, key).
///
/// Filters are assumed valid ([`crate::topic::validate_topic_filter`]); levels
/// after a `#` are ignored. A shared subscription (`$share/{group}/{filter}`)
/// is stored under its inner filter ([`crate::topic::parse_shared`]) with the
/// group kept in `K` or `V`: the trie itself treats `$share` as a literal
/// level.
pub struct SubscriptionTrie<K, V> {
    root: Node<K, V>,
    len: usize,
}

impl<K: Copy + Eq + Hash, V> Default for SubscriptionTrie<K, V> {
    fn default() -> Self {
        Self::new()
    }
}

impl<K: Copy + Eq + Hash, V> SubscriptionTrie<K, V> {
    /// An empty trie; allocates nothing until the first insert.
    pub fn new() -> Self {
        Self {
            root: Node::new(),
            len: 0,
        }
    }

    /// Subscribe `key` to `filter` with `value`, replacing any value it had on
    /// that filter. Returns the previous value for (filter, key), if any.
    pub fn insert(&mut self, filter: &str, key: K, value: V) -> Option<V> {
        let mut node = &mut self.root;
        let mut levels = Levels::new(filter);
        let subscribers = loop {
            match levels.next() {
                None => break &mut node.exact,
                Some("#") => break &mut node.hash,
                Some("+") => node = node.plus.get_or_insert_with(|| Box::new(Node::new())),
                Some(level) => node = node.children.get_or_insert(level),
            }
        };
        let previous = subscribers.insert(key, value);
        if previous.is_none() {
            self.len += 1;
        }
        previous
    }

    /// Unsubscribe `key` from `filter`. Returns its value, or `None` if it
    /// was not subscribed. Nodes left empty are freed, so memory returns as
    /// subscriptions go.
    pub fn remove(&mut self, filter: &str, key: &K) -> Option<V> {
        let removed = self.root.remove(Levels::new(filter), key);
        if removed.is_some() {
            self.len -= 1;
        }
        removed
    }

    /// The value of (filter, key), if `key` is subscribed to exactly `filter`.
    pub fn get(&self, filter: &str, key: &K) -> Option<&V> {
        self.subscribers(filter)?.get(key)
    }

    /// The value of (filter, key) for changing in place, if `key` is
    /// subscribed to exactly `filter`.
    pub fn get_mut(&mut self, filter: &str, key: &K) -> Option<&mut V> {
        let mut node = &mut self.root;
        let mut levels = Levels::new(filter);
        let subscribers = loop {
            match levels.next() {
                None => break &mut node.exact,
                Some("#") => break &mut node.hash,
                Some("+") => node = node.plus.as_deref_mut()?,
                Some(level) => node = node.children.get_mut(level)?,
            }
        };
        subscribers.get_mut(key)
    }

    /// Does any subscriber remain on exactly `filter` (not on a filter that
    /// merely matches the same topics)? Used to emit route-table changes.
    pub fn has_filter(&self, filter: &str) -> bool {
        self.subscribers(filter).is_some_and(|s| !s.is_empty())
    }

    /// Call `f(key, value)` for every subscription whose filter matches
    /// `topic`, a valid topic name, with the rules of
    /// [`crate::topic::matches`], including [MQTT-4.7.2-1] (wildcards in the
    /// first level do not match topics starting with `$`).
    ///
    /// A subscriber with several matching filters is visited once per filter;
    /// the caller merges (MQTT 5.0 §4.7.2 leaves it to the server). The order
    /// of visits is unspecified. Does not allocate.
    pub fn for_each_match(&self, topic: &str, mut f: impl FnMut(&K, &V)) {
        let mut levels = Levels::new(topic);
        // `Levels` yields at least one level, even for "".
        let first = levels.next().unwrap_or_default();
        if !crate::topic::is_reserved_topic(topic) {
            self.root.hash.for_each(&mut f);
            if let Some(plus) = &self.root.plus {
                plus.walk(levels, &mut f);
            }
        }
        if let Some(child) = self.root.children.get(first) {
            child.walk(levels, &mut f);
        }
    }

    /// Number of subscriptions, i.e. of (filter, key) pairs.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when there is no subscription.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn subscribers(&self, filter: &str) -> Option<&Subscribers<K, V>> {
        let mut node = &self.root;
        let mut levels = Levels::new(filter);
        loop {
            match levels.next() {
                None => return Some(&node.exact),
                Some("#") => return Some(&node.hash),
                Some("+") => node = node.plus.as_deref()?,
                Some(level) => node = node.children.get(level)?,
            }
        }
    }
}

/// One level of the trie; the path from the root spells a filter prefix.
struct Node<K, V> {
    /// Children for literal levels.
    children: Children<K, V>,
    /// The child for a `+` level.
    plus: Option<Box<Node<K, V>>>,
    /// Subscribers whose filter ends here.
    exact: Subscribers<K, V>,
    /// Subscribers whose filter is this node's prefix followed by `/#`
    /// (or `#` alone, at the root).
    hash: Subscribers<K, V>,
}

impl<K: Copy + Eq + Hash, V> Node<K, V> {
    fn new() -> Self {
        Self {
            children: Children::Small(Vec::new()),
            plus: None,
            exact: Subscribers::Small(Vec::new()),
            hash: Subscribers::Small(Vec::new()),
        }
    }

    fn is_empty(&self) -> bool {
        self.children.is_empty()
            && self.plus.is_none()
            && self.exact.is_empty()
            && self.hash.is_empty()
    }

    /// Visit the subscribers of this node's subtree that match the remaining
    /// `levels` of a topic. Below the first level the `$` rule no longer
    /// applies. Recursion depth is the number of topic levels.
    fn walk<F: FnMut(&K, &V)>(&self, mut levels: Levels<'_>, f: &mut F) {
        match levels.next() {
            // "sport/#" matches "sport" [MQTT-4.7.1-2].
            None => {
                self.exact.for_each(f);
                self.hash.for_each(f);
            }
            Some(level) => {
                self.hash.for_each(f);
                if let Some(plus) = &self.plus {
                    plus.walk(levels, f);
                }
                if let Some(child) = self.children.get(level) {
                    child.walk(levels, f);
                }
            }
        }
    }

    /// Remove (filter, key) below this node and free the nodes it empties.
    fn remove(&mut self, mut levels: Levels<'_>, key: &K) -> Option<V> {
        match levels.next() {
            None => self.exact.remove(key),
            Some("#") => self.hash.remove(key),
            Some("+") => {
                let plus = self.plus.as_deref_mut()?;
                let removed = plus.remove(levels, key)?;
                if plus.is_empty() {
                    self.plus = None;
                }
                Some(removed)
            }
            Some(level) => {
                let child = self.children.get_mut(level)?;
                let removed = child.remove(levels, key)?;
                if child.is_empty() {
                    self.children.remove(level);
                }
                Some(removed)
            }
        }
    }
}

/// Literal children: a short vector scanned in order while small (fewer
/// allocations, better locality), a hash map when large.
///
/// The map is boxed so that the enum, and every node, stays small: most
/// nodes never need a map (see `a_node_stays_small`).
#[allow(clippy::box_collection)]
enum Children<K, V> {
    Small(Vec<(Box<str>, Node<K, V>)>),
    Large(Box<HashMap<Box<str>, Node<K, V>>>),
}

impl<K: Copy + Eq + Hash, V> Children<K, V> {
    fn is_empty(&self) -> bool {
        match self {
            Self::Small(v) => v.is_empty(),
            Self::Large(m) => m.is_empty(),
        }
    }

    fn get(&self, level: &str) -> Option<&Node<K, V>> {
        match self {
            Self::Small(v) => v.iter().find(|(l, _)| &**l == level).map(|(_, n)| n),
            Self::Large(m) => m.get(level),
        }
    }

    fn get_mut(&mut self, level: &str) -> Option<&mut Node<K, V>> {
        match self {
            Self::Small(v) => v.iter_mut().find(|(l, _)| &**l == level).map(|(_, n)| n),
            Self::Large(m) => m.get_mut(level),
        }
    }

    fn get_or_insert(&mut self, level: &str) -> &mut Node<K, V> {
        if let Self::Small(v) = self {
            if v.len() >= SMALL_CHILDREN && !v.iter().any(|(l, _)| &**l == level) {
                let map = v.drain(..).collect();
                *self = Self::Large(Box::new(map));
            }
        }
        match self {
            Self::Small(v) => {
                let index = match v.iter().position(|(l, _)| &**l == level) {
                    Some(index) => index,
                    None => {
                        push_tight(v, (level.into(), Node::new()));
                        v.len() - 1
                    }
                };
                &mut v[index].1
            }
            Self::Large(m) => m.entry(level.into()).or_insert_with(Node::new),
        }
    }

    fn remove(&mut self, level: &str) {
        match self {
            Self::Small(v) => {
                if let Some(index) = v.iter().position(|(l, _)| &**l == level) {
                    v.swap_remove(index);
                    if v.is_empty() {
                        *v = Vec::new();
                    }
                }
            }
            Self::Large(m) => {
                m.remove(level);
                if m.len() <= SMALL_CHILDREN / 2 {
                    *self = Self::Small(m.drain().collect());
                } else if m.capacity() > 4 * m.len() {
                    m.shrink_to(2 * m.len());
                }
            }
        }
    }
}

/// The subscribers of one filter: a vector while few, a hash map when many
/// (one filter may have a million subscribers). The map is boxed, as in
/// [`Children`].
#[allow(clippy::box_collection)]
enum Subscribers<K, V> {
    Small(Vec<(K, V)>),
    Large(Box<HashMap<K, V>>),
}

impl<K: Copy + Eq + Hash, V> Subscribers<K, V> {
    fn is_empty(&self) -> bool {
        match self {
            Self::Small(v) => v.is_empty(),
            Self::Large(m) => m.is_empty(),
        }
    }

    fn get(&self, key: &K) -> Option<&V> {
        match self {
            Self::Small(v) => v.iter().find(|(k, _)| k == key).map(|(_, v)| v),
            Self::Large(m) => m.get(key),
        }
    }

    fn get_mut(&mut self, key: &K) -> Option<&mut V> {
        match self {
            Self::Small(v) => v.iter_mut().find(|(k, _)| k == key).map(|(_, v)| v),
            Self::Large(m) => m.get_mut(key),
        }
    }

    fn insert(&mut self, key: K, value: V) -> Option<V> {
        match self {
            Self::Small(v) => {
                if let Some((_, old)) = v.iter_mut().find(|(k, _)| *k == key) {
                    return Some(std::mem::replace(old, value));
                }
                if v.len() < SMALL_SUBSCRIBERS {
                    push_tight(v, (key, value));
                    return None;
                }
                let mut map: HashMap<K, V> = v.drain(..).collect();
                map.insert(key, value);
                *self = Self::Large(Box::new(map));
                None
            }
            Self::Large(m) => m.insert(key, value),
        }
    }

    fn remove(&mut self, key: &K) -> Option<V> {
        match self {
            Self::Small(v) => {
                let index = v.iter().position(|(k, _)| k == key)?;
                let (_, value) = v.swap_remove(index);
                if v.is_empty() {
                    *v = Vec::new();
                }
                Some(value)
            }
            Self::Large(m) => {
                let value = m.remove(key)?;
                if m.len() <= SMALL_SUBSCRIBERS / 2 {
                    *self = Self::Small(m.drain().collect());
                } else if m.capacity() > 4 * m.len() {
                    m.shrink_to(2 * m.len());
                }
                Some(value)
            }
        }
    }

    fn for_each<F: FnMut(&K, &V)>(&self, f: &mut F) {
        match self {
            Self::Small(v) => v.iter().for_each(|(k, v)| f(k, v)),
            Self::Large(m) => m.iter().for_each(|(k, v)| f(k, v)),
        }
    }
}

/// Push, growing by half rather than doubling from 4: most nodes have one
/// child and most filters one subscriber, so the default growth would waste
/// three slots in each of a million small vectors.
fn push_tight<T>(v: &mut Vec<T>, item: T) {
    if v.len() == v.capacity() {
        v.reserve_exact((v.len() / 2).max(1));
    }
    v.push(item);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::topic::matches;
    use proptest::prelude::*;
    use std::collections::HashMap;

    fn matched(trie: &SubscriptionTrie<u8, String>, topic: &str) -> Vec<(u8, String)> {
        let mut out = Vec::new();
        trie.for_each_match(topic, |k, v| out.push((*k, v.clone())));
        out.sort();
        out
    }

    fn brute_force(model: &HashMap<(String, u8), String>, topic: &str) -> Vec<(u8, String)> {
        let mut out: Vec<_> = model
            .iter()
            .filter(|((filter, _), _)| matches(filter, topic))
            .map(|((_, key), value)| (*key, value.clone()))
            .collect();
        out.sort();
        out
    }

    fn trie_of(filters: &[&str]) -> SubscriptionTrie<u8, String> {
        let mut trie = SubscriptionTrie::new();
        for (i, f) in filters.iter().enumerate() {
            trie.insert(f, i as u8, (*f).to_owned());
        }
        trie
    }

    fn matching_filters(trie: &SubscriptionTrie<u8, String>, topic: &str) -> Vec<String> {
        let mut filters: Vec<String> = matched(trie, topic).into_iter().map(|(_, f)| f).collect();
        filters.sort();
        filters
    }

    #[test]
    fn an_exact_filter_matches_only_its_topic() {
        let trie = trie_of(&["a/b", "a/c"]);
        assert_eq!(matching_filters(&trie, "a/b"), ["a/b"]);
        assert!(matching_filters(&trie, "a").is_empty());
        assert!(matching_filters(&trie, "a/b/c").is_empty());
    }

    #[test]
    fn a_multi_level_wildcard_matches_its_parent_level() {
        // [MQTT-4.7.1-2]
        let trie = trie_of(&["sport/tennis/player1/#", "sport/#"]);
        assert_eq!(
            matching_filters(&trie, "sport/tennis/player1"),
            ["sport/#", "sport/tennis/player1/#"]
        );
        assert_eq!(matching_filters(&trie, "sport"), ["sport/#"]);
        assert_eq!(
            matching_filters(&trie, "sport/tennis/player1/score/wimbledon"),
            ["sport/#", "sport/tennis/player1/#"]
        );
    }

    #[test]
    fn a_single_level_wildcard_matches_one_possibly_empty_level() {
        // [MQTT-4.7.1-3]
        let trie = trie_of(&["+/+", "/+", "+"]);
        assert_eq!(matching_filters(&trie, "/finance"), ["+/+", "/+"]);
        assert_eq!(matching_filters(&trie, "finance"), ["+"]);
    }

    #[test]
    fn first_level_wildcards_do_not_match_dollar_topics() {
        // [MQTT-4.7.2-1]
        let trie = trie_of(&["#", "+/monitor/Clients", "$SYS/monitor/+", "$SYS/#", "+/#"]);
        assert_eq!(
            matching_filters(&trie, "$SYS/monitor/Clients"),
            ["$SYS/#", "$SYS/monitor/+"]
        );
        assert_eq!(
            matching_filters(&trie, "SYS/monitor/Clients"),
            ["#", "+/#", "+/monitor/Clients"]
        );
    }

    #[test]
    fn a_subscriber_on_several_matching_filters_is_visited_once_per_filter() {
        let mut trie = SubscriptionTrie::new();
        trie.insert("a/+", 1u8, "a/+".to_owned());
        trie.insert("a/#", 1u8, "a/#".to_owned());
        assert_eq!(
            matched(&trie, "a/b"),
            [(1, "a/#".to_owned()), (1, "a/+".to_owned())]
        );
    }

    #[test]
    fn inserting_twice_replaces_the_value_and_keeps_the_count() {
        let mut trie = SubscriptionTrie::new();
        assert_eq!(trie.insert("a/#", 7u32, 1u8), None);
        assert_eq!(trie.insert("a/#", 7u32, 2u8), Some(1));
        assert_eq!(trie.len(), 1);
        assert_eq!(trie.get("a/#", &7), Some(&2));
        *trie.get_mut("a/#", &7).unwrap() = 3;
        assert_eq!(trie.get("a/#", &7), Some(&3));
        assert_eq!(trie.get("a/+", &7), None);
    }

    #[test]
    fn removing_the_last_subscriber_prunes_every_node() {
        let mut trie = SubscriptionTrie::new();
        trie.insert("a/+/c/#", 1u32, ());
        trie.insert("a/b", 2u32, ());
        assert!(trie.has_filter("a/+/c/#"));
        assert_eq!(trie.remove("a/+/c/#", &2), None);
        assert_eq!(trie.remove("a/+/c/#", &1), Some(()));
        assert!(!trie.has_filter("a/+/c/#"));
        assert!(trie.has_filter("a/b"));
        assert_eq!(trie.remove("a/b", &2), Some(()));
        assert!(trie.is_empty());
        assert!(trie.root.is_empty());
    }

    #[test]
    fn many_children_and_subscribers_survive_the_switch_to_maps_and_back() {
        let mut trie = SubscriptionTrie::new();
        for i in 0..100u32 {
            trie.insert(&format!("d/{i}"), i, i);
            trie.insert("all", i, i);
        }
        assert_eq!(trie.len(), 200);
        let mut seen = 0;
        trie.for_each_match("all", |_, _| seen += 1);
        assert_eq!(seen, 100);
        for i in 0..100u32 {
            assert_eq!(trie.get(&format!("d/{i}"), &i), Some(&i));
        }
        for i in 0..100u32 {
            assert_eq!(trie.remove(&format!("d/{i}"), &i), Some(i));
            assert_eq!(trie.remove("all", &i), Some(i));
        }
        assert!(trie.is_empty() && trie.root.is_empty());
    }

    #[test]
    fn a_node_stays_small() {
        // Three 24-byte collections and the `+` pointer: a million nodes
        // cost 80 MB before their keys and subscribers.
        assert_eq!(std::mem::size_of::<Node<u32, u8>>(), 80);
    }

    /// Small alphabets so that filters and topics collide, with `$` levels
    /// and empty levels.
    fn topic() -> impl Strategy<Value = String> {
        prop::collection::vec(prop::sample::select(vec!["a", "b", "", "$x"]), 1..5)
            .prop_map(|levels| levels.join("/"))
    }

    fn filter() -> impl Strategy<Value = String> {
        (
            prop::collection::vec(prop::sample::select(vec!["a", "b", "", "$x", "+"]), 0..4),
            any::<bool>(),
        )
            .prop_filter_map("empty filter", |(mut levels, hash)| {
                if hash {
                    levels.push("#");
                }
                let filter = levels.join("/");
                (!filter.is_empty()).then_some(filter)
            })
    }

    #[derive(Debug, Clone)]
    enum Op {
        Insert(String, u8),
        Remove(String, u8),
    }

    fn op(filter: BoxedStrategy<String>, keys: u8) -> impl Strategy<Value = Op> {
        prop_oneof![
            (filter.clone(), 0..keys).prop_map(|(f, k)| Op::Insert(f, k)),
            (filter, 0..keys).prop_map(|(f, k)| Op::Remove(f, k)),
        ]
    }

    /// Levels from a wider alphabet, so that nodes and filters outgrow their
    /// vectors and switch to maps, and back.
    fn wide_topic() -> impl Strategy<Value = String> {
        (0..20u8, 0..3u8).prop_map(|(a, b)| format!("{a}/{b}"))
    }

    fn wide_filter() -> BoxedStrategy<String> {
        prop_oneof![
            (0..20u8, 0..3u8).prop_map(|(a, b)| format!("{a}/{b}")),
            (0..20u8).prop_map(|a| format!("{a}/#")),
            (0..3u8).prop_map(|b| format!("+/{b}")),
        ]
        .boxed()
    }

    /// Apply `ops` to a trie and to a model map; they must agree on every
    /// result, on `has_filter` and on matches; removing all leaves no node.
    fn check_ops(ops: &[Op], topics: &[String]) -> Result<(), TestCaseError> {
        let mut trie = SubscriptionTrie::new();
        let mut model: HashMap<(String, u8), String> = HashMap::new();
        for (n, op) in ops.iter().enumerate() {
            match op {
                Op::Insert(f, k) => {
                    let value = format!("{f}@{n}");
                    prop_assert_eq!(
                        trie.insert(f, *k, value.clone()),
                        model.insert((f.clone(), *k), value)
                    );
                }
                Op::Remove(f, k) => {
                    prop_assert_eq!(trie.remove(f, k), model.remove(&(f.clone(), *k)));
                }
            }
            prop_assert_eq!(trie.len(), model.len());
        }
        for op in ops {
            let (Op::Insert(f, _) | Op::Remove(f, _)) = op;
            let in_model = model.keys().any(|(mf, _)| mf == f);
            prop_assert_eq!(trie.has_filter(f), in_model, "filter {:?}", f);
        }
        for t in topics {
            prop_assert_eq!(matched(&trie, t), brute_force(&model, t), "topic {:?}", t);
        }
        for (f, k) in model.keys().cloned().collect::<Vec<_>>() {
            prop_assert!(trie.remove(&f, &k).is_some());
        }
        prop_assert!(trie.is_empty() && trie.root.is_empty());
        Ok(())
    }

    proptest! {
        #[test]
        fn levels_are_what_split_on_slash_yields(name in "[a-c/é+#$]{0,12}") {
            let levels: Vec<&str> = Levels::new(&name).collect();
            let split: Vec<&str> = name.split('/').collect();
            prop_assert_eq!(levels, split);
        }

        #[test]
        fn the_trie_matches_what_brute_force_matches(
            filters in prop::collection::vec((filter(), 0u8..4), 0..40),
            topics in prop::collection::vec(topic(), 1..20),
        ) {
            let mut trie = SubscriptionTrie::new();
            let mut model = HashMap::new();
            for (f, k) in &filters {
                trie.insert(f, *k, f.clone());
                model.insert((f.clone(), *k), f.clone());
            }
            for t in &topics {
                prop_assert_eq!(matched(&trie, t), brute_force(&model, t), "topic {:?}", t);
            }
        }

        #[test]
        fn after_inserts_and_removes_the_trie_equals_a_map(
            ops in prop::collection::vec(op(filter().boxed(), 4), 0..80),
            topics in prop::collection::vec(topic(), 1..10),
        ) {
            check_ops(&ops, &topics)?;
        }

        #[test]
        fn after_many_inserts_and_removes_on_wide_levels_the_trie_equals_a_map(
            ops in prop::collection::vec(op(wide_filter(), 40), 0..600),
            topics in prop::collection::vec(wide_topic(), 1..10),
        ) {
            check_ops(&ops, &topics)?;
        }
    }
}
