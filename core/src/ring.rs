//! [`Ring`]: entries under keys handed out in increasing order, each
//! taken out once, mostly oldest first (appends waiting for their
//! answer: the bridge's pipeline and the shard's batched answers).

use std::collections::VecDeque;

/// Entries by key, for keys pushed in increasing order; removing one
/// leaves a hole until every older one is gone. Get,
/// push and remove are O(1), with no hashing; memory is the span from the
/// oldest key still present to the newest.
#[derive(Debug)]
pub struct Ring<T> {
    first: u64,
    slots: VecDeque<Option<T>>,
}

impl<T> Default for Ring<T> {
    fn default() -> Self {
        Ring { first: 0, slots: VecDeque::new() }
    }
}

impl<T> Ring<T> {
    /// Add `value` under `key`, which must be greater than every key
    /// pushed before (a key skipped is a hole, as one removed).
    ///
    /// # Panics
    /// When `key` is not greater (in debug builds; in release builds the
    /// entry is not kept).
    pub fn push(&mut self, key: u64, value: T) {
        if self.slots.is_empty() {
            self.first = key;
        }
        let next = self.first + self.slots.len() as u64;
        debug_assert!(key >= next, "key {key} pushed after {next}");
        if key < next {
            return;
        }
        for _ in next..key {
            self.slots.push_back(None);
        }
        self.slots.push_back(Some(value));
    }

    /// The entry under `key`, if present.
    pub fn get_mut(&mut self, key: u64) -> Option<&mut T> {
        let at = key.checked_sub(self.first)?;
        self.slots.get_mut(usize::try_from(at).ok()?)?.as_mut()
    }

    /// Whether an entry is under `key`.
    pub fn contains(&self, key: u64) -> bool {
        key.checked_sub(self.first).and_then(|at| self.slots.get(usize::try_from(at).ok()?)).is_some_and(Option::is_some)
    }

    /// Take the entry under `key` out.
    pub fn remove(&mut self, key: u64) -> Option<T> {
        let at = usize::try_from(key.checked_sub(self.first)?).ok()?;
        let value = self.slots.get_mut(at)?.take();
        while self.slots.front().is_some_and(Option::is_none) {
            self.slots.pop_front();
            self.first += 1;
        }
        value
    }

    /// Whether no entry is left.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// The entries with their keys, oldest first.
    pub fn iter_mut(&mut self) -> impl Iterator<Item = (u64, &mut T)> {
        let first = self.first;
        self.slots.iter_mut().enumerate().filter_map(move |(at, v)| Some((first + at as u64, v.as_mut()?)))
    }

    /// The keys present, oldest first.
    pub fn keys(&self) -> impl Iterator<Item = u64> + '_ {
        let first = self.first;
        self.slots.iter().enumerate().filter(|(_, v)| v.is_some()).map(move |(at, _)| first + at as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Against a map: whatever order the keys are taken out in, the
        /// ring holds what the map holds, and empties when it does.
        #[test]
        fn holds_what_a_map_holds(start in 0u64..1_000_000, ops in proptest::collection::vec((any::<bool>(), 0u64..40), 1..200)) {
            let mut ring = Ring::default();
            let mut map = std::collections::BTreeMap::new();
            let mut next = start;
            for (push, pick) in ops {
                if push || map.is_empty() {
                    // Now and then a key skipped.
                    next += u64::from(pick % 7 == 0);
                    ring.push(next, next * 2);
                    map.insert(next, next * 2);
                    next += 1;
                } else {
                    let key = start + pick % (next - start);
                    prop_assert_eq!(ring.remove(key), map.remove(&key));
                }
                prop_assert_eq!(ring.keys().collect::<Vec<_>>(), map.keys().copied().collect::<Vec<_>>());
                prop_assert_eq!(ring.is_empty(), map.is_empty());
                for key in start..next + 1 {
                    prop_assert_eq!(ring.contains(key), map.contains_key(&key));
                    prop_assert_eq!(ring.get_mut(key).copied(), map.get(&key).copied());
                }
            }
        }
    }
}
