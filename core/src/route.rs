//! The node-wide route table (DESIGN.md §3): topic filter → set of shards
//! that have at least one subscriber on it.
//!
//! Every shard keeps its own copy, updated by messages from the other shards
//! when one of them gains its first or loses its last subscriber on a filter
//! ([`crate::trie::SubscriptionTrie::has_filter`]), so routing a PUBLISH reads
//! it without a lock. It is a [`SubscriptionTrie`] keyed by filter alone, so
//! the matching rules are the trie's.

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
