//! The other replicas as the mesh sees them (DESIGN.md §3, §11): a small
//! process-local number for each replica ID ([`PeerId`]), sets of them
//! ([`PeerSet`]), what membership says of each ([`Peer`]) and the route
//! changes read from `mqtt-routes` ([`RouteChange`]).
//!
//! The bridge gives each replica ID it meets a [`PeerId`] the first time it
//! sees it and never reuses it in the life of the process, so a shard can
//! keep peer ids in its remote route table and its mesh links without
//! translating strings on the publish path.

use crate::route::ShardSet;

/// A peer replica's process-local number, `0..PeerSet::MAX_PEERS`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PeerId(pub u16);

impl PeerId {
    /// The id as an index (`0..PeerSet::MAX_PEERS`).
    pub fn index(self) -> usize {
        usize::from(self.0)
    }
}

/// A set of [`PeerId`]s, a bit mask like [`ShardSet`] (kept a type of its
/// own so replicas are never mistaken for shards).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct PeerSet(ShardSet);

impl PeerSet {
    /// The most peers one process numbers (replica IDs met over its
    /// life, itself excluded); the bridge logs and ignores any further one.
    pub const MAX_PEERS: usize = ShardSet::MAX_SHARDS;

    /// The empty set.
    pub const fn new() -> Self {
        Self(ShardSet::new())
    }

    /// Add `peer`; true if it was not in the set.
    ///
    /// # Panics
    /// If `peer.index() >= MAX_PEERS`.
    pub fn insert(&mut self, peer: PeerId) -> bool {
        self.0.insert(peer.index())
    }

    /// Remove `peer`; true if it was in the set.
    ///
    /// # Panics
    /// If `peer.index() >= MAX_PEERS`.
    pub fn remove(&mut self, peer: PeerId) -> bool {
        self.0.remove(peer.index())
    }

    /// Is `peer` in the set?
    pub fn contains(&self, peer: PeerId) -> bool {
        self.0.contains(peer.index())
    }

    /// True when the set is empty.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The number of peers in the set.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// The peers in either set.
    #[must_use]
    pub fn union(self, other: Self) -> Self {
        Self(self.0.union(other.0))
    }

    /// The peers, ascending.
    pub fn iter(&self) -> impl Iterator<Item = PeerId> {
        self.0.iter().map(|i| PeerId(i as u16))
    }
}

/// A live peer replica as its `mqtt-members` entry describes it
/// ([`crate::cluster::records::MemberRecord`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Peer {
    /// Its process-local number.
    pub id: PeerId,
    /// Its replica ID (`cluster.replica_id`), also the DNS name its mesh
    /// certificate carries.
    pub replica: String,
    /// The process running it (a new one after each restart).
    pub instance: String,
    /// The address to dial for the mesh (`cluster.mesh_advertise`),
    /// `host:port`.
    pub mesh: String,
    /// The mesh protocol versions it speaks.
    pub mesh_versions: Vec<u16>,
}

/// One change of `mqtt-routes` made by another replica: `peer` now wants
/// (`present`) or no longer wants `filter`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteChange {
    /// The replica whose entry changed.
    pub peer: PeerId,
    /// The topic filter as subscribed, `$share/<group>/<filter>` for a
    /// shared subscription.
    pub filter: String,
    /// Wanted (the entry was written) or not (deleted, or its replica gone).
    pub present: bool,
}

/// The [`PeerId`] of each replica ID met, given the first time it is met
/// and kept for the life of the process (a replica that restarts, moves
/// or leaves and comes back keeps its number; a number is never reused).
#[derive(Debug, Default)]
pub struct PeerNumbers {
    ids: std::collections::HashMap<String, PeerId>,
}

impl PeerNumbers {
    /// No replica met yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// `replica`'s number, given now if it has none; `None` once
    /// [`PeerSet::MAX_PEERS`] replicas have numbers (the caller logs and
    /// ignores that replica).
    pub fn number(&mut self, replica: &str) -> Option<PeerId> {
        if let Some(id) = self.ids.get(replica) {
            return Some(*id);
        }
        if self.ids.len() >= PeerSet::MAX_PEERS {
            return None;
        }
        let id = PeerId(self.ids.len() as u16);
        self.ids.insert(replica.to_owned(), id);
        Some(id)
    }

    /// `replica`'s number if it has one.
    pub fn get(&self, replica: &str) -> Option<PeerId> {
        self.ids.get(replica).copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_replica_keeps_its_number_and_numbers_run_out_after_max_peers() {
        let mut numbers = PeerNumbers::new();
        assert_eq!(numbers.number("b"), Some(PeerId(0)));
        assert_eq!(numbers.number("c"), Some(PeerId(1)));
        assert_eq!(numbers.number("b"), Some(PeerId(0)), "stable");
        assert_eq!(numbers.get("c"), Some(PeerId(1)));
        assert_eq!(numbers.get("d"), None);
        for i in 2..PeerSet::MAX_PEERS {
            assert_eq!(numbers.number(&format!("r{i}")), Some(PeerId(i as u16)));
        }
        assert_eq!(numbers.number("one-too-many"), None);
        assert_eq!(numbers.number("b"), Some(PeerId(0)), "the known keep theirs");
    }

    #[test]
    fn a_peer_set_holds_ids_and_unions() {
        let mut a = PeerSet::new();
        assert!(a.insert(PeerId(3)) && !a.insert(PeerId(3)));
        let mut b = PeerSet::new();
        b.insert(PeerId(0));
        let both = a.union(b);
        assert_eq!(both.iter().collect::<Vec<_>>(), [PeerId(0), PeerId(3)]);
        assert_eq!(both.len(), 2);
        assert!(a.remove(PeerId(3)) && a.is_empty() && !a.contains(PeerId(3)));
    }
}
