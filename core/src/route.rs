//! The node-wide route table (DESIGN.md §3): topic filter → set of shards
//! that have at least one subscriber on it.
//!
//! Every shard keeps its own copy, updated by messages from the other shards
//! when one of them gains its first or loses its last subscriber on a filter
//! ([`crate::trie::SubscriptionTrie::has_filter`]), so routing a PUBLISH reads
//! it without a lock. It is a [`SubscriptionTrie`] keyed by filter alone, so
//! the matching rules are the trie's.

use bytestring::ByteString;

use crate::cluster::peers::{PeerSet, RouteChange};
use crate::topic::{parse_shared, validate_topic_filter, TopicLimits};
use crate::trie::SubscriptionTrie;

/// A set of shard ids `0..64`, as a bit mask (bit `i` is shard `i`).
///
/// One shard runs per core (DESIGN.md §3), so 64 shards is 64 cores.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct ShardSet(u64);

impl ShardSet {
    /// The number of shard ids a set can hold; ids are `0..MAX_SHARDS`.
    pub const MAX_SHARDS: usize = 64;

    /// The empty set.
    pub const fn new() -> Self {
        Self(0)
    }

    /// Add `shard`. Returns true if it was not in the set.
    ///
    /// # Panics
    ///
    /// If `shard >= ShardSet::MAX_SHARDS`.
    pub fn insert(&mut self, shard: usize) -> bool {
        let bit = Self::bit(shard);
        let added = self.0 & bit == 0;
        self.0 |= bit;
        added
    }

    /// Remove `shard`. Returns true if it was in the set.
    ///
    /// # Panics
    ///
    /// If `shard >= ShardSet::MAX_SHARDS`.
    pub fn remove(&mut self, shard: usize) -> bool {
        let bit = Self::bit(shard);
        let removed = self.0 & bit != 0;
        self.0 &= !bit;
        removed
    }

    /// Is `shard` in the set? False for any id `>= MAX_SHARDS`.
    pub fn contains(&self, shard: usize) -> bool {
        shard < Self::MAX_SHARDS && self.0 & (1 << shard) != 0
    }

    /// True when no shard is in the set.
    pub fn is_empty(&self) -> bool {
        self.0 == 0
    }

    /// Number of shards in the set.
    pub fn len(&self) -> usize {
        self.0.count_ones() as usize
    }

    /// The shards in `self`, in `other` or in both (set union).
    #[must_use]
    pub fn union(self, other: Self) -> Self {
        Self(self.0 | other.0)
    }

    /// The shard ids in the set, ascending.
    pub fn iter(&self) -> ShardIter {
        ShardIter(self.0)
    }

    fn bit(shard: usize) -> u64 {
        assert!(
            shard < Self::MAX_SHARDS,
            "shard id {shard} out of range 0..{}",
            Self::MAX_SHARDS
        );
        1 << shard
    }
}

impl IntoIterator for ShardSet {
    type Item = usize;
    type IntoIter = ShardIter;

    fn into_iter(self) -> ShardIter {
        ShardIter(self.0)
    }
}

/// Iterator over the shard ids of a [`ShardSet`], ascending.
#[derive(Debug, Clone)]
pub struct ShardIter(u64);

impl Iterator for ShardIter {
    type Item = usize;

    fn next(&mut self) -> Option<usize> {
        if self.0 == 0 {
            return None;
        }
        let shard = self.0.trailing_zeros() as usize;
        self.0 &= self.0 - 1;
        Some(shard)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let n = self.0.count_ones() as usize;
        (n, Some(n))
    }
}

/// Filter → shards with at least one subscriber on it (DESIGN.md §3).
///
/// Filters are plain, valid filters; a shared subscription is routed by its
/// inner filter ([`crate::topic::parse_shared`]).
#[derive(Default)]
pub struct RouteTable {
    /// One entry per filter, key `()`, value the shards on it (never empty).
    trie: SubscriptionTrie<(), ShardSet>,
}

impl RouteTable {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// Shard `shard` now has subscribers on `filter`. Idempotent.
    ///
    /// # Panics
    ///
    /// If `shard >= ShardSet::MAX_SHARDS`.
    pub fn add(&mut self, filter: &str, shard: usize) {
        match self.trie.get_mut(filter, &()) {
            Some(shards) => {
                shards.insert(shard);
            }
            None => {
                let mut shards = ShardSet::new();
                shards.insert(shard);
                self.trie.insert(filter, (), shards);
            }
        }
    }

    /// Shard `shard` has no subscriber left on `filter`. Idempotent; the
    /// filter's entry is freed when its last shard goes.
    ///
    /// # Panics
    ///
    /// If `shard >= ShardSet::MAX_SHARDS`.
    pub fn remove(&mut self, filter: &str, shard: usize) {
        if let Some(shards) = self.trie.get_mut(filter, &()) {
            shards.remove(shard);
            if shards.is_empty() {
                self.trie.remove(filter, &());
            }
        }
    }

    /// The shards on exactly `filter` (empty if none).
    pub fn shards_on(&self, filter: &str) -> ShardSet {
        self.trie.get(filter, &()).copied().unwrap_or_default()
    }

    /// Union of the shards whose filters match `topic`, a valid topic name,
    /// with the rules of [`crate::topic::matches`] ([MQTT-4.7.2-1] included).
    /// Does not allocate.
    pub fn shards_for(&self, topic: &str) -> ShardSet {
        let mut all = ShardSet::new();
        self.trie
            .for_each_match(topic, |(), shards| all = all.union(*shards));
        all
    }

    /// Number of filters with at least one shard.
    pub fn len(&self) -> usize {
        self.trie.len()
    }

    /// True when no filter has a shard.
    pub fn is_empty(&self) -> bool {
        self.trie.is_empty()
    }
}

/// Filter → peer replicas with a subscriber on it (the mesh, DESIGN.md §3,
/// §11), read from `mqtt-routes`: the remote counterpart of [`RouteTable`].
///
/// A plain filter routes every matching value to each of its peers; a
/// shared subscription (`$share/<group>/<filter>`) is kept under its inner
/// filter and its group, so a value goes to one member replica per group.
#[derive(Default)]
pub struct RemoteRoutes {
    /// Key: 0 for a plain filter, else the group's number in `groups` + 1.
    trie: SubscriptionTrie<u32, PeerSet>,
    /// Group names met, numbered in order; never shrinks (groups are few).
    groups: Vec<ByteString>,
}

impl RemoteRoutes {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// Apply one change of `mqtt-routes`. `filter` as subscribed
    /// (`$share/<group>/<filter>` for a shared one); an invalid one is
    /// ignored (another replica's entry is never trusted to be valid).
    /// Idempotent.
    pub fn apply(&mut self, change: &RouteChange) {
        let limits = TopicLimits { max_levels: usize::MAX, max_bytes: usize::MAX };
        let (group, inner) = match parse_shared(&change.filter) {
            Some((group, inner)) => (Some(group), inner),
            None => (None, change.filter.as_str()),
        };
        // A workspace's filter carries its prefix (U+0000, the workspace,
        // `/`, as the shards keep it): the client's filter after it is
        // what must be valid.
        let client_filter = match inner.strip_prefix('\0') {
            Some(rest) => rest.split_once('/').map_or("", |(_, f)| f),
            None => inner,
        };
        let shared_ok = group.is_none_or(|g| !g.is_empty() && !g.contains(['+', '#']));
        if !shared_ok || validate_topic_filter(client_filter, &limits).is_err() {
            return;
        }
        let key = match group {
            Some(group) => self.group_key(group),
            None => 0,
        };
        if change.present {
            match self.trie.get_mut(inner, &key) {
                Some(peers) => {
                    peers.insert(change.peer);
                }
                None => {
                    let mut peers = PeerSet::new();
                    peers.insert(change.peer);
                    self.trie.insert(inner, key, peers);
                }
            }
        } else if let Some(peers) = self.trie.get_mut(inner, &key) {
            peers.remove(change.peer);
            if peers.is_empty() {
                self.trie.remove(inner, &key);
            }
        }
    }

    /// The peers with a plain filter matching `topic` (a valid topic name,
    /// [MQTT-4.7.2-1] included). Does not allocate.
    pub fn peers_for(&self, topic: &str) -> PeerSet {
        let mut all = PeerSet::new();
        self.trie.for_each_match(topic, |key, peers| {
            if *key == 0 {
                all = all.union(*peers);
            }
        });
        all
    }

    /// Calls `f(group, peers)` for each shared subscription group with a
    /// filter matching `topic` on some peer (a group matched by several
    /// filters comes once per filter).
    pub fn for_each_group(&self, topic: &str, mut f: impl FnMut(&ByteString, PeerSet)) {
        self.trie.for_each_match(topic, |key, peers| {
            if let Some(group) = key.checked_sub(1).and_then(|i| self.groups.get(i as usize)) {
                f(group, *peers);
            }
        });
    }

    /// Calls `f(group, peers)` for each entry with a filter matching
    /// `topic`: `group` `None` for a plain filter, else its shared
    /// subscription group (as [`Self::peers_for`] and
    /// [`Self::for_each_group`] together, in one walk of the trie).
    pub fn for_each_route(&self, topic: &str, mut f: impl FnMut(Option<&ByteString>, PeerSet)) {
        self.trie.for_each_match(topic, |key, peers| match key.checked_sub(1) {
            None => f(None, *peers),
            Some(i) => {
                if let Some(group) = self.groups.get(i as usize) {
                    f(Some(group), *peers);
                }
            }
        });
    }

    /// Number of (filter, group) entries with at least one peer.
    pub fn len(&self) -> usize {
        self.trie.len()
    }

    /// True when no peer wants anything.
    pub fn is_empty(&self) -> bool {
        self.trie.is_empty()
    }

    fn group_key(&mut self, group: &str) -> u32 {
        let at = match self.groups.iter().position(|g| g == group) {
            Some(at) => at,
            None => {
                self.groups.push(ByteString::from(group));
                self.groups.len() - 1
            }
        };
        at as u32 + 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::topic::matches;
    use proptest::prelude::*;
    use std::collections::{HashMap, HashSet};

    fn set(shards: &[usize]) -> ShardSet {
        let mut s = ShardSet::new();
        for &shard in shards {
            s.insert(shard);
        }
        s
    }

    #[test]
    fn a_shard_set_holds_ids_zero_to_sixty_three() {
        let mut s = ShardSet::new();
        assert!(s.insert(0) && s.insert(63) && s.insert(5));
        assert!(!s.insert(5));
        assert_eq!(s.len(), 3);
        assert_eq!(s.iter().collect::<Vec<_>>(), [0, 5, 63]);
        assert!(s.contains(63) && !s.contains(64) && !s.contains(1));
        assert!(s.remove(5) && !s.remove(5));
        assert_eq!(s.union(set(&[1])), set(&[0, 1, 63]));
        assert!(ShardSet::default().is_empty());
    }

    #[test]
    #[should_panic(expected = "out of range")]
    fn a_shard_id_of_sixty_four_panics() {
        ShardSet::new().insert(64);
    }

    #[test]
    fn adding_and_removing_is_idempotent_and_prunes() {
        let mut table = RouteTable::new();
        table.add("a/+", 1);
        table.add("a/+", 1);
        table.add("a/+", 2);
        assert_eq!(table.shards_on("a/+"), set(&[1, 2]));
        assert_eq!(table.len(), 1);
        table.remove("a/+", 1);
        table.remove("a/+", 1);
        assert_eq!(table.shards_on("a/+"), set(&[2]));
        table.remove("a/+", 2);
        table.remove("b", 2);
        assert!(table.is_empty());
        assert!(table.shards_for("a/x").is_empty());
    }

    #[test]
    fn shards_for_is_the_union_over_matching_filters() {
        let mut table = RouteTable::new();
        table.add("sport/#", 0);
        table.add("sport/tennis/+", 3);
        table.add("#", 7);
        table.add("$SYS/#", 9);
        assert_eq!(table.shards_for("sport/tennis/player1"), set(&[0, 3, 7]));
        assert_eq!(table.shards_for("sport"), set(&[0, 7]));
        // [MQTT-4.7.2-1]
        assert_eq!(table.shards_for("$SYS/broker"), set(&[9]));
    }


    #[test]
    fn remote_routes_keep_plain_filters_and_groups_apart() {
        use crate::cluster::peers::PeerId;
        let change = |peer, filter: &str, present| RouteChange { peer: PeerId(peer), filter: filter.into(), present };
        let mut remote = RemoteRoutes::new();
        remote.apply(&change(1, "a/+", true));
        remote.apply(&change(2, "a/#", true));
        remote.apply(&change(3, "$share/g/a/b", true));
        remote.apply(&change(4, "$share/g/a/#", true));
        remote.apply(&change(5, "bad/#/x", true));
        remote.apply(&change(5, "\0ws/bad/#/x", true));
        remote.apply(&change(5, "\0ws", true));
        // A workspace's filters, plain and shared, as the shards keep them.
        remote.apply(&change(6, "\0ws/a/+", true));
        remote.apply(&change(6, "$share/g/\0ws/a/#", true));
        assert_eq!(remote.peers_for("\0ws/a/b").iter().collect::<Vec<_>>(), [PeerId(6)]);
        let mut in_ws = 0;
        remote.for_each_group("\0ws/a/b", |_, _| in_ws += 1);
        assert_eq!(in_ws, 1);
        remote.apply(&change(6, "\0ws/a/+", false));
        remote.apply(&change(6, "$share/g/\0ws/a/#", false));
        assert_eq!(remote.peers_for("a/b").iter().collect::<Vec<_>>(), [PeerId(1), PeerId(2)]);
        let mut groups = Vec::new();
        remote.for_each_group("a/b", |g, peers| groups.push((g.to_string(), peers.iter().collect::<Vec<_>>())));
        groups.sort();
        assert_eq!(groups, [("g".to_string(), vec![PeerId(3)]), ("g".to_string(), vec![PeerId(4)])]);
        remote.apply(&change(1, "a/+", false));
        remote.apply(&change(3, "$share/g/a/b", false));
        assert_eq!(remote.peers_for("a/b").iter().collect::<Vec<_>>(), [PeerId(2)]);
        assert_eq!(remote.len(), 2);
    }

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

    proptest! {
        /// The one walk the mesh's forward path takes gives what the two
        /// walks gave: the plain peers and each group's peers.
        #[test]
        fn for_each_route_is_peers_for_and_for_each_group_in_one(
            ops in prop::collection::vec((filter(), prop::option::of(prop::sample::select(vec!["g", "h"])), 0u16..4, any::<bool>()), 0..40),
            topics in prop::collection::vec(topic(), 1..8),
        ) {
            use crate::cluster::peers::PeerId;
            let mut remote = RemoteRoutes::new();
            for (f, group, peer, present) in &ops {
                let filter = match group {
                    Some(g) => format!("$share/{g}/{f}"),
                    None => f.clone(),
                };
                remote.apply(&RouteChange { peer: PeerId(*peer), filter, present: *present });
            }
            for t in &topics {
                let mut plain = PeerSet::new();
                let mut groups = Vec::new();
                remote.for_each_route(t, |group, peers| match group {
                    None => plain = plain.union(peers),
                    Some(g) => groups.push((g.to_string(), peers.iter().collect::<Vec<_>>())),
                });
                let mut expected = Vec::new();
                remote.for_each_group(t, |g, peers| expected.push((g.to_string(), peers.iter().collect::<Vec<_>>())));
                groups.sort();
                expected.sort();
                prop_assert_eq!(plain, remote.peers_for(t), "topic {:?}", t);
                prop_assert_eq!(groups, expected, "topic {:?}", t);
            }
        }

        #[test]
        fn shards_for_equals_brute_force(
            ops in prop::collection::vec((filter(), 0usize..6, any::<bool>()), 0..60),
            topics in prop::collection::vec(topic(), 1..10),
        ) {
            let mut table = RouteTable::new();
            let mut model: HashMap<String, HashSet<usize>> = HashMap::new();
            for (f, shard, add) in &ops {
                if *add {
                    table.add(f, *shard);
                    model.entry(f.clone()).or_default().insert(*shard);
                } else {
                    table.remove(f, *shard);
                    if let Some(shards) = model.get_mut(f) {
                        shards.remove(shard);
                        if shards.is_empty() {
                            model.remove(f);
                        }
                    }
                }
            }
            prop_assert_eq!(table.len(), model.len());
            for t in &topics {
                let expected = model
                    .iter()
                    .filter(|(f, _)| matches(f, t))
                    .flat_map(|(_, shards)| shards.iter().copied())
                    .fold(ShardSet::new(), |acc, s| acc.union(set(&[s])));
                prop_assert_eq!(table.shards_for(t), expected, "topic {:?}", t);
            }
        }
    }
}
