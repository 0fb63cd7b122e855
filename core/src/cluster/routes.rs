//! `mqtt-routes` (DESIGN.md §4, issue 25): which replica wants which topic
//! filters, for the mesh. Pure parts: the keys and the record, the
//! aggregation of a replica's shards into one entry per filter
//! ([`LocalRoutes`]), and the table the watch keeps of the other
//! replicas' entries ([`RouteTable`]), which says what to apply.
//!
//! A key is `<replica>.<filter in base64url without padding>` (`=` for the
//! empty filter, which MQTT never subscribes; `=` and a hash for a filter
//! over 768 bytes, [`crate::cluster::keys`]): the filter as the shards
//! keep it (with its workspace prefix, any UTF-8, U+0000 included), and
//! for a shared subscription the whole `$share/<group>/<filter>`. Base64
//! has no `.`, so the replica is what comes before the last `.` (a replica
//! ID may hold dots, `check_replica_id`), and the entries of one replica
//! are the subjects `$KV.mqtt-routes.<replica>.*`: exactly one token after
//! the replica, so those of replica `a` never include those of `a.b`.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use serde::{Deserialize, Serialize};

use crate::cluster::peers::{PeerId, RouteChange};
use crate::cluster::records::{bucket, Record};
use crate::route::ShardSet;

/// The key of `replica`'s entry for `filter` in `mqtt-routes`: the
/// replica, a dot, the filter's
/// [`name_token`](crate::cluster::keys::name_token) (a hash for a filter
/// over 768 bytes: see [`crate::cluster::keys`]).
pub fn route_key(replica: &str, filter: &str) -> String {
    format!("{replica}.{}", crate::cluster::keys::name_token(filter))
}

/// The replica and the filter of a key made by [`route_key`], the filter
/// `None` when the key holds its hash (a long filter: the record carries
/// it, [`RouteRecord::filter`], and a reader checks that the record makes
/// the key, [`is_route_key_of`]); `None` for any other key (no `.`, an
/// empty replica, bad base64, not UTF-8).
pub fn parse_route_key(key: &str) -> Option<(&str, Option<String>)> {
    let (replica, token) = key.rsplit_once('.')?;
    if replica.is_empty() {
        return None;
    }
    match crate::cluster::keys::read_token(token)? {
        crate::cluster::keys::Token::Plain(filter) => Some((replica, Some(filter))),
        crate::cluster::keys::Token::Hashed => Some((replica, None)),
    }
}

/// Whether `key` is [`route_key`]`(replica, filter)`.
pub fn is_route_key_of(key: &str, replica: &str, filter: &str) -> bool {
    key.rsplit_once('.').is_some_and(|(r, token)| r == replica && token == crate::cluster::keys::name_token(filter))
}

/// The subjects of every entry of `replica` in `mqtt-routes` (for a purge
/// by subject: its leftovers at start, its own at a clean stop).
pub fn replica_routes_subject(replica: &str) -> String {
    format!("$KV.{}.{replica}.*", bucket::ROUTES)
}

/// A replica's entry in `mqtt-routes` (key [`route_key`]): one of its
/// clients (at least) subscribes to `filter`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RouteRecord {
    /// Record format ([`crate::cluster::records::FORMAT`]).
    pub format: u16,
    /// The replica ID.
    pub replica: String,
    /// The process that wrote it ([`crate::cluster::records::MemberRecord::instance`]):
    /// entries of an earlier process of the replica are not applied.
    pub instance: String,
    /// The filter as subscribed, with its workspace prefix
    /// (`$share/<group>/<filter>` for a shared subscription).
    pub filter: String,
}

impl Record for RouteRecord {
    fn format(&self) -> u16 {
        self.format
    }
}

/// The filters this replica's shards want, each with the shards that want
/// it: the replica writes one entry per filter, when its first shard
/// wants it, and deletes it when its last one no longer does.
#[derive(Debug, Default)]
pub struct LocalRoutes {
    filters: HashMap<String, ShardSet>,
}

impl LocalRoutes {
    /// No filter wanted.
    pub fn new() -> Self {
        Self::default()
    }

    /// `shard` wants `filter`: true when no shard wanted it before (the
    /// entry must be written). Idempotent.
    ///
    /// # Panics
    /// If `shard >= ShardSet::MAX_SHARDS`.
    pub fn add(&mut self, filter: &str, shard: usize) -> bool {
        match self.filters.get_mut(filter) {
            Some(shards) => {
                shards.insert(shard);
                false
            }
            None => {
                let mut shards = ShardSet::new();
                shards.insert(shard);
                self.filters.insert(filter.to_owned(), shards);
                true
            }
        }
    }

    /// `shard` no longer wants `filter`: true when it was the last shard
    /// that did (the entry must be deleted). Idempotent; false for a
    /// filter or shard not wanted.
    pub fn remove(&mut self, filter: &str, shard: usize) -> bool {
        let Some(shards) = self.filters.get_mut(filter) else { return false };
        if shard >= ShardSet::MAX_SHARDS || !shards.remove(shard) || !shards.is_empty() {
            return false;
        }
        self.filters.remove(filter);
        true
    }

    /// Whether some shard wants `filter`.
    pub fn contains(&self, filter: &str) -> bool {
        self.filters.contains_key(filter)
    }

    /// Distinct filters wanted.
    pub fn len(&self) -> usize {
        self.filters.len()
    }

    /// True when no filter is wanted.
    pub fn is_empty(&self) -> bool {
        self.filters.is_empty()
    }
}

/// One entry of another replica as the watch read it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteEntry {
    /// Its revision in `mqtt-routes`.
    pub revision: u64,
    /// The replica.
    pub replica: String,
    /// The process that wrote it.
    pub instance: String,
    /// The filter.
    pub filter: String,
}

/// Delete markers announced ahead of the watch kept at most (the watch
/// passing them drops them; a watch stalled for long drops the oldest).
pub const DELETED_MAX: usize = 65_536;

/// The other replicas' entries of `mqtt-routes` (as the watch brings
/// them, and as their replicas announce them over the mesh) and the live
/// members (as `mqtt-members` says): an entry is applied (sent to the
/// shards as a [`RouteChange`]) while its replica is live and it was
/// written by the replica's live process; the others are kept aside until
/// that process appears, or until a delete removes them. Each method
/// returns the changes to send, in order.
///
/// Two sources, one order: the bucket's revisions. Each key keeps the
/// revision of the last write known of it, a put (the entry) or a delete
/// (a marker), and a write no newer than that is ignored, whichever
/// source brings it: a late watch event does not take back a newer
/// announce, nor an announce that took the slow way a newer watch event.
/// The watch brings every write in revision order, so a marker is kept
/// only until the watch passed its revision, and an announce the watch
/// passed already is old news (ignored): what the table holds once the
/// watch caught up is what the bucket says.
#[derive(Debug, Default)]
pub struct RouteTable {
    /// Key → entry.
    entries: HashMap<String, RemoteEntry>,
    /// Replica → keys of its entries.
    by_replica: HashMap<String, BTreeMap<String, ()>>,
    /// Live replica → (its process, its peer id).
    live: HashMap<String, (String, PeerId)>,
    /// Entries applied now.
    applied: usize,
    /// Deletes announced ahead of the watch: key → revision, and the
    /// same by revision (dropped once the watch passed them; at most
    /// [`DELETED_MAX`], the oldest dropped first).
    deleted: HashMap<String, u64>,
    deleted_at: BTreeSet<(u64, String)>,
    /// The highest revision the watch brought.
    watched: u64,
}

impl RouteTable {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    fn peer_of(&self, entry: &RemoteEntry) -> Option<PeerId> {
        self.live.get(&entry.replica).filter(|(instance, _)| *instance == entry.instance).map(|(_, peer)| *peer)
    }

    /// The revision of the last write known of `key` (a put or a delete
    /// announced ahead of the watch), if any.
    pub fn revision_of(&self, key: &str) -> Option<u64> {
        self.entries.get(key).map(|e| e.revision).or_else(|| self.deleted.get(key).copied())
    }

    /// The watch brought a write at `revision`: markers it passed go.
    fn watched(&mut self, revision: u64) {
        self.watched = self.watched.max(revision);
        while self.deleted_at.first().is_some_and(|(r, _)| *r <= self.watched) {
            if let Some((_, key)) = self.deleted_at.pop_first() {
                self.deleted.remove(&key);
            }
        }
    }

    /// The watch read `entry` under `key` (a put).
    pub fn put(&mut self, key: &str, entry: RemoteEntry) -> Vec<RouteChange> {
        self.watched(entry.revision);
        self.merge_put(key, entry)
    }

    /// The watch read a delete (or purge) of `key` at `revision`.
    pub fn delete(&mut self, key: &str, revision: u64) -> Vec<RouteChange> {
        self.watched(revision);
        self.merge_delete(key, revision)
    }

    /// `entry`'s replica announced over the mesh that it wants
    /// (`present`) or no longer wants its filter, as its write at
    /// `entry.revision` under `key` says. Ignored when the watch passed
    /// that revision already, or a newer write of the key is known.
    pub fn announced(&mut self, key: &str, entry: RemoteEntry, present: bool) -> Vec<RouteChange> {
        if entry.revision <= self.watched {
            return Vec::new();
        }
        if present {
            return self.merge_put(key, entry);
        }
        let revision = entry.revision;
        let out = self.merge_delete(key, revision);
        if self.revision_of(key).is_none_or(|known| known < revision) {
            if let Some(old) = self.deleted.insert(key.to_owned(), revision) {
                self.deleted_at.remove(&(old, key.to_owned()));
            }
            self.deleted_at.insert((revision, key.to_owned()));
            while self.deleted_at.len() > DELETED_MAX {
                if let Some((_, key)) = self.deleted_at.pop_first() {
                    self.deleted.remove(&key);
                }
            }
        }
        out
    }

    fn merge_put(&mut self, key: &str, entry: RemoteEntry) -> Vec<RouteChange> {
        if self.revision_of(key).is_some_and(|known| known >= entry.revision) {
            return Vec::new();
        }
        if let Some(old) = self.deleted.remove(key) {
            self.deleted_at.remove(&(old, key.to_owned()));
        }
        let mut out = Vec::new();
        let before = self.entries.get(key).and_then(|e| self.peer_of(e).map(|p| (p, e.filter.clone())));
        let after = self.peer_of(&entry);
        if let Some((peer, filter)) = &before {
            if after != Some(*peer) || *filter != entry.filter {
                out.push(RouteChange { peer: *peer, filter: filter.clone(), present: false });
                self.applied -= 1;
            }
        }
        if let Some(peer) = after {
            if before.as_ref().is_none_or(|(p, f)| *p != peer || *f != entry.filter) {
                out.push(RouteChange { peer, filter: entry.filter.clone(), present: true });
                self.applied += 1;
            }
        }
        if let Some(old) = self.entries.get(key) {
            if old.replica != entry.replica {
                let old_replica = old.replica.clone();
                self.forget_key(&old_replica, key);
            }
        }
        self.by_replica.entry(entry.replica.clone()).or_default().insert(key.to_owned(), ());
        self.entries.insert(key.to_owned(), entry);
        out
    }

    fn merge_delete(&mut self, key: &str, revision: u64) -> Vec<RouteChange> {
        if self.entries.get(key).is_some_and(|e| e.revision > revision) {
            return Vec::new();
        }
        let Some(entry) = self.entries.remove(key) else { return Vec::new() };
        self.forget_key(&entry.replica, key);
        match self.peer_of(&entry) {
            Some(peer) => {
                self.applied -= 1;
                vec![RouteChange { peer, filter: entry.filter, present: false }]
            }
            None => Vec::new(),
        }
    }

    /// Forget `key` if the entry known is still at `revision` (the
    /// sweeper found the bucket holds something else: a purge by subject
    /// left no marker to watch). Changes only for an applied entry.
    pub fn forget(&mut self, key: &str, revision: u64) -> Vec<RouteChange> {
        if self.entries.get(key).is_some_and(|e| e.revision == revision) {
            return self.merge_delete(key, revision);
        }
        Vec::new()
    }

    fn forget_key(&mut self, replica: &str, key: &str) {
        if let Some(keys) = self.by_replica.get_mut(replica) {
            keys.remove(key);
            if keys.is_empty() {
                self.by_replica.remove(replica);
            }
        }
    }

    /// `replica` is live, run by process `instance`, numbered `peer`:
    /// its entries written by that process are applied, any other's are
    /// not (an earlier process's leftovers).
    pub fn member_live(&mut self, replica: &str, instance: &str, peer: PeerId) -> Vec<RouteChange> {
        if self.live.get(replica).is_some_and(|(i, p)| i == instance && *p == peer) {
            return Vec::new();
        }
        let mut out = self.member_out(replica);
        self.live.insert(replica.to_owned(), (instance.to_owned(), peer));
        for key in self.by_replica.get(replica).into_iter().flat_map(|k| k.keys()) {
            let entry = &self.entries[key];
            if entry.instance == instance {
                out.push(RouteChange { peer, filter: entry.filter.clone(), present: true });
                self.applied += 1;
            }
        }
        out
    }

    /// `replica` is no longer live (taken for gone, stopped): none of its
    /// entries is applied (they stay aside).
    pub fn member_out(&mut self, replica: &str) -> Vec<RouteChange> {
        let Some((instance, peer)) = self.live.remove(replica) else { return Vec::new() };
        let mut out = Vec::new();
        for key in self.by_replica.get(replica).into_iter().flat_map(|k| k.keys()) {
            let entry = &self.entries[key];
            if entry.instance == instance {
                out.push(RouteChange { peer, filter: entry.filter.clone(), present: false });
                self.applied -= 1;
            }
        }
        out
    }

    /// The entries not written by a live process (key, revision, entry's
    /// process): the sweeper's to delete once their process is gone.
    pub fn not_live(&self) -> Vec<(String, u64, String)> {
        self.entries
            .iter()
            .filter(|(_, e)| self.peer_of(e).is_none())
            .map(|(key, e)| (key.clone(), e.revision, e.instance.clone()))
            .collect()
    }

    /// Entries applied now (`fleetmq_routes_remote`).
    pub fn applied(&self) -> usize {
        self.applied
    }

    /// Entries known, applied or not.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when no entry is known.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_route_key_names_its_replica_and_filter() {
        let key = route_key("b.example.net", "ws1/\u{0}/+/#");
        assert!(key.starts_with("b.example.net."));
        assert_eq!(parse_route_key(&key), Some(("b.example.net", Some("ws1/\u{0}/+/#".to_owned()))));
        assert_eq!(parse_route_key(&route_key("r1", "")), Some(("r1", Some(String::new()))));
        assert_eq!(parse_route_key("nodot"), None);
        assert_eq!(parse_route_key(".abc"), None);
        assert_eq!(parse_route_key("r1.!!"), None);
        assert_eq!(replica_routes_subject("r1"), "$KV.mqtt-routes.r1.*");
    }

    #[test]
    fn a_long_filter_has_a_hashed_key_still_one_token_after_its_replica() {
        let filter = format!("ws1/{}/#", "f".repeat(4_000));
        let key = route_key("b.example.net", &filter);
        assert_eq!(key.len(), "b.example.net.".len() + crate::cluster::keys::HASHED_TOKEN_LEN);
        assert_eq!(parse_route_key(&key), Some(("b.example.net", None)), "the filter is in the record");
        assert!(is_route_key_of(&key, "b.example.net", &filter));
        assert!(!is_route_key_of(&key, "b.example.net", &format!("{filter}x")));
        assert!(!is_route_key_of(&key, "example.net", &filter));
        // One token after the replica: `b.example.net.*` covers it.
        assert_eq!(key.matches('.').count(), 3);
    }

    #[test]
    fn a_route_record_reads_back_as_written() {
        let r = RouteRecord { format: 2, replica: "r1".into(), instance: "i1".into(), filter: "$share/g/a/#".into() };
        assert_eq!(RouteRecord::decode(&r.encode()).unwrap(), r);
        assert!(RouteRecord::decode(b"{\"format\":9}").is_err());
    }

    #[test]
    fn a_filter_is_written_for_its_first_shard_and_deleted_after_its_last() {
        let mut local = LocalRoutes::new();
        assert!(local.add("a/+", 0), "first shard: write");
        assert!(!local.add("a/+", 1), "second shard: already written");
        assert!(!local.add("a/+", 1), "idempotent");
        assert!(!local.remove("a/+", 0), "one shard left");
        assert!(!local.remove("a/+", 0), "idempotent");
        assert!(local.contains("a/+"));
        assert!(local.remove("a/+", 1), "the last shard: delete");
        assert!(!local.remove("a/+", 1) && !local.remove("never", 3) && !local.remove("x", 99));
        assert!(local.is_empty());
    }

    fn entry(replica: &str, instance: &str, filter: &str, revision: u64) -> RemoteEntry {
        RemoteEntry { revision, replica: replica.into(), instance: instance.into(), filter: filter.into() }
    }

    fn change(peer: u16, filter: &str, present: bool) -> RouteChange {
        RouteChange { peer: PeerId(peer), filter: filter.into(), present }
    }

    #[test]
    fn entries_of_a_replica_apply_only_while_its_process_is_live() {
        let mut table = RouteTable::new();
        let key = route_key("b", "x");
        // Before its member record: kept aside.
        assert!(table.put(&key, entry("b", "i1", "x", 1)).is_empty());
        assert_eq!(table.member_live("b", "i1", PeerId(0)), [change(0, "x", true)]);
        assert_eq!(table.applied(), 1);
        // Rewritten by the same process: nothing new.
        assert!(table.put(&key, entry("b", "i1", "x", 2)).is_empty());
        // Gone: removed, but kept for the sweeper.
        assert_eq!(table.member_out("b"), [change(0, "x", false)]);
        assert_eq!(table.not_live(), [(key.clone(), 2, "i1".to_owned())]);
        // Restarted as i2: i1's leftover is not applied.
        assert!(table.member_live("b", "i2", PeerId(0)).is_empty());
        assert_eq!(table.put(&key, entry("b", "i2", "x", 3)), [change(0, "x", true)]);
        assert!(table.forget(&key, 2).is_empty(), "another revision stays");
        assert_eq!(table.delete(&key, 4), [change(0, "x", false)]);
        assert!(table.delete(&key, 5).is_empty());
        assert!(table.is_empty() && table.applied() == 0);
    }

    /// Writes of the bucket, each (key, put or delete, announced over
    /// the mesh too) at revisions 1, 2, ...; the order the announces
    /// arrive in (any); how the watch (in revision order) and the
    /// announces interleave (any).
    type Arrivals = (Vec<(u8, bool, bool)>, Vec<usize>, Vec<bool>);

    fn writes_and_arrivals() -> impl Strategy<Value = Arrivals> {
        proptest::collection::vec((0u8..4, any::<bool>(), any::<bool>()), 1..40).prop_flat_map(|writes| {
            let announced: Vec<usize> = writes.iter().enumerate().filter(|(_, w)| w.2).map(|(i, _)| i).collect();
            let n = writes.len() + announced.len();
            (Just(writes), Just(announced).prop_shuffle(), proptest::collection::vec(any::<bool>(), n))
        })
    }

    #[test]
    fn an_announce_ahead_of_the_watch_holds_until_the_watch_brings_newer() {
        let mut table = RouteTable::new();
        table.member_live("b", "i1", PeerId(3));
        let key = route_key("b", "x");
        // Announced at 10: applied at once.
        assert_eq!(table.announced(&key, entry("b", "i1", "x", 10), true), [change(3, "x", true)]);
        // The watch is behind: an older delete and put do nothing.
        assert!(table.delete(&key, 8).is_empty());
        assert!(table.put(&key, entry("b", "i1", "x", 9)).is_empty());
        // The delete at 12 announced before the watch brings 10: the
        // watch's put at 10 does not bring it back.
        assert_eq!(table.announced(&key, entry("b", "i1", "x", 12), false), [change(3, "x", false)]);
        assert!(table.put(&key, entry("b", "i1", "x", 10)).is_empty());
        assert_eq!(table.revision_of(&key), Some(12));
        // A late announce of the put at 10 neither.
        assert!(table.announced(&key, entry("b", "i1", "x", 10), true).is_empty());
        // The watch passes 12: the marker goes, and an announce the
        // watch passed is old news.
        assert!(table.delete(&key, 12).is_empty());
        assert_eq!(table.revision_of(&key), None);
        assert!(table.announced(&key, entry("b", "i1", "x", 11), true).is_empty());
        assert_eq!(table.applied(), 0);
    }

    proptest! {
        #[test]
        fn the_watch_and_the_announces_in_any_order_never_take_a_route_backwards(
            (writes, announces, interleave) in writes_and_arrivals(),
        ) {
            let mut table = RouteTable::new();
            prop_assert!(table.member_live("r", "i", PeerId(0)).is_empty());
            let (mut watch, mut mesh) = (writes.iter().enumerate().peekable(), announces.iter().peekable());
            // The model: per key, the newest write seen so far by either
            // source (revision, present).
            let mut newest: HashMap<u8, (u64, bool)> = HashMap::new();
            let mut applied: std::collections::HashSet<String> = std::collections::HashSet::new();
            for from_watch in interleave {
                let (at, from_watch) = match (from_watch, watch.peek().is_some(), mesh.peek().is_some()) {
                    (true, true, _) | (false, true, false) => (watch.next().map(|(i, _)| i), true),
                    (_, _, true) => (mesh.next().copied(), false),
                    _ => (None, true),
                };
                let Some(at) = at else { break };
                let (k, present, _) = writes[at];
                let revision = at as u64 + 1;
                let filter = format!("f{k}");
                let key = route_key("r", &filter);
                let e = entry("r", "i", &filter, revision);
                let changes = match (from_watch, present) {
                    (true, true) => table.put(&key, e),
                    (true, false) => table.delete(&key, revision),
                    (false, present) => table.announced(&key, e, present),
                };
                for c in changes {
                    prop_assert_eq!(c.peer, PeerId(0));
                    if c.present {
                        prop_assert!(applied.insert(c.filter), "applied twice");
                    } else {
                        prop_assert!(applied.remove(&c.filter), "removed unapplied");
                    }
                }
                let known = newest.entry(k).or_insert((0, false));
                if revision > known.0 {
                    *known = (revision, present);
                }
                let wanted: std::collections::HashSet<String> =
                    newest.iter().filter(|(_, (_, p))| *p).map(|(k, _)| format!("f{k}")).collect();
                prop_assert_eq!(&applied, &wanted, "after revision {} from the {}", revision, if from_watch { "watch" } else { "mesh" });
                prop_assert_eq!(table.applied(), wanted.len());
            }
            // The watch caught up: no marker is left.
            prop_assert!(table.deleted.is_empty() && table.deleted_at.is_empty());
        }

        #[test]
        fn any_filter_maps_to_a_valid_key_and_back(filter in "\\PC{0,100}", repeat in 1usize..50, replica in "[a-z][a-z0-9.-]{0,20}[a-z0-9]") {
            let filter = filter.repeat(repeat);
            let key = route_key(&replica, &filter);
            prop_assert!(key.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_=.".contains(&b)));
            prop_assert!(!key.ends_with('.'));
            prop_assert!(key.len() <= replica.len() + 1 + crate::cluster::keys::MAX_PLAIN_TOKEN);
            prop_assert!(is_route_key_of(&key, &replica, &filter));
            let readable = (filter.len() <= 768).then(|| filter.clone());
            prop_assert_eq!(parse_route_key(&key), Some((replica.as_str(), readable)));
        }

        #[test]
        fn the_applied_count_follows_any_sequence_of_events(ops in proptest::collection::vec((0u8..5, 0u8..3, 0u8..2, 0u8..3), 0..60)) {
            let mut table = RouteTable::new();
            let mut present: std::collections::HashSet<(u16, String)> = std::collections::HashSet::new();
            for (revision, (op, replica, instance, filter)) in (1u64..).zip(ops) {
                let replica_name = format!("r{replica}");
                let instance_name = format!("i{instance}");
                let filter_name = format!("f{filter}");
                let key = route_key(&replica_name, &filter_name);
                let changes = match op {
                    0 | 1 => table.put(&key, entry(&replica_name, &instance_name, &filter_name, revision)),
                    2 => table.delete(&key, revision),
                    3 => table.member_live(&replica_name, &instance_name, PeerId(u16::from(replica))),
                    _ => table.member_out(&replica_name),
                };
                for c in changes {
                    if c.present {
                        prop_assert!(present.insert((c.peer.0, c.filter)), "applied twice");
                    } else {
                        prop_assert!(present.remove(&(c.peer.0, c.filter)), "removed unapplied");
                    }
                }
                prop_assert_eq!(present.len(), table.applied());
            }
        }
    }
}
