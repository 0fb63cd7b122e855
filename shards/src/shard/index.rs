//! A shard's sessions by client identifier.

use slab::Slab;

use super::{Client, Slot};

/// The slots of a shard's sessions by client identifier. The table holds
/// only slots: it hashes the identifier with a per-process random key and
/// compares it with the session's own copy, so it keeps no second
/// reference to it (4 bytes a client instead of 40, DESIGN.md §3: an idle
/// connection should cost little).
#[derive(Default)]
pub(super) struct ClientIndex {
    pub(super) table: hashbrown::HashTable<Slot>,
    hasher: std::hash::RandomState,
}

impl ClientIndex {
    /// The slot of the session `client_id`, if `clients` holds one.
    pub(super) fn get(&self, clients: &Slab<Client>, client_id: &str) -> Option<Slot> {
        let hash = hash_id(&self.hasher, client_id);
        self.table
            .find(hash, |&slot| clients[slot as usize].session.client_id() == client_id)
            .copied()
    }

    /// Index `slot`, whose session is in `clients` and whose client
    /// identifier is not indexed yet.
    pub(super) fn insert(&mut self, clients: &Slab<Client>, slot: Slot) {
        let hash_of = |slot: Slot| hash_id(&self.hasher, clients[slot as usize].session.client_id());
        self.table.insert_unique(hash_of(slot), slot, |&slot| hash_of(slot));
    }

    /// Forget `slot`, indexed under `client_id` (the session may already
    /// be out of the slab).
    pub(super) fn remove(&mut self, client_id: &str, slot: Slot) {
        let hash = hash_id(&self.hasher, client_id);
        if let Ok(entry) = self.table.find_entry(hash, |&s| s == slot) {
            entry.remove();
        }
    }
}

/// The [`ClientIndex`] hash of `client_id`.
fn hash_id(hasher: &std::hash::RandomState, client_id: &str) -> u64 {
    use std::hash::BuildHasher;
    hasher.hash_one(client_id)
}
