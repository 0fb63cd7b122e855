//! Shared subscription groups `$share/{group}/{filter}` (MQTT 5 §4.8.2, also
//! offered to 3.1.1 clients): each message goes to exactly one member.
//!
//! A [`SharedGroup`] is owned by one shard (`owner_of` the shared filter);
//! members live wherever their sessions do and are named by client
//! identifier. Members with persistent sessions stay members while away:
//! with no member online, QoS 1/2 messages wait in the group's queue
//! (bounded, oldest dropped and counted) until one returns. Randomness is
//! an input, so tests are deterministic.

use std::collections::VecDeque;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use bytestring::ByteString;
use serde::{Deserialize, Serialize};

use crate::packet::QoS;
use crate::session::{Message, Subscription};

/// How a group chooses the member for a message. In settings, one of the
/// names of [`Strategy::ALL`] (`shared.strategy`, `shared.groups.NAME`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Strategy {
    /// Online members in turn (the default).
    #[default]
    RoundRobin,
    /// A uniformly random online member.
    Random,
    /// The same member as long as it stays online.
    Sticky,
    /// The member chosen by a hash of the publisher's client identifier, so
    /// one publisher's messages keep their order at one member.
    HashClientId,
    /// A member on the publishing shard when there is one, else round robin.
    LocalFirst,
}

impl Strategy {
    /// Every strategy, the default first.
    pub const ALL: [Strategy; 5] =
        [Strategy::RoundRobin, Strategy::Random, Strategy::Sticky, Strategy::HashClientId, Strategy::LocalFirst];

    /// The name in settings, e.g. `"round_robin"`.
    pub const fn name(self) -> &'static str {
        match self {
            Strategy::RoundRobin => "round_robin",
            Strategy::Random => "random",
            Strategy::Sticky => "sticky",
            Strategy::HashClientId => "hash_client_id",
            Strategy::LocalFirst => "local_first",
        }
    }
}

impl Serialize for Strategy {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

/// The name of one of [`Strategy::ALL`]; anything else is refused naming
/// the names and showing what was given, whatever its shape: `expected a
/// strategy (one of round_robin, ...), found a table { c = "random" }`
/// (what `shared.groups."a.b".c = "random"` gives; serde's derive said
/// "unknown variant `c`", taking the table for an enum).
impl<'de> Deserialize<'de> for Strategy {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let given = crate::settings::Given::deserialize(d)?;
        Strategy::ALL.into_iter().find(|s| given.as_str() == Some(s.name())).ok_or_else(|| {
            let names: Vec<&str> = Strategy::ALL.iter().map(|s| s.name()).collect();
            serde::de::Error::custom(format!("expected a strategy (one of {}), found {given}", names.join(", ")))
        })
    }
}

/// One member of a group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    /// The member's client identifier.
    pub client_id: ByteString,
    /// The shard that owns the member's session.
    pub shard: usize,
    /// The member's subscription options and identifier.
    pub subscription: Subscription,
    /// True while the member has a connection.
    pub online: bool,
}

/// A shared subscription group.
#[derive(Debug)]
pub struct SharedGroup {
    /// The filter inside `$share/{group}/`.
    pub filter: ByteString,
    strategy: Strategy,
    members: Vec<Member>,
    next: usize,
    sticky: Option<ByteString>,
    queue: VecDeque<Arc<Message>>,
    max_queue: usize,
    dropped: u64,
}

impl SharedGroup {
    /// An empty group on `filter` choosing members by `strategy`, queueing
    /// at most `max_queue` messages while no member is online.
    pub fn new(filter: ByteString, strategy: Strategy, max_queue: usize) -> SharedGroup {
        SharedGroup { filter, strategy, members: Vec::new(), next: 0, sticky: None, queue: VecDeque::new(), max_queue, dropped: 0 }
    }

    /// Add a member, or update its options, shard and presence.
    pub fn join(&mut self, member: Member) {
        match self.members.iter_mut().find(|m| m.client_id == member.client_id) {
            Some(existing) => *existing = member,
            None => self.members.push(member),
        }
    }

    /// Remove a member. Returns true when the group is now empty.
    pub fn leave(&mut self, client_id: &str) -> bool {
        self.members.retain(|m| m.client_id != client_id);
        if self.sticky.as_deref() == Some(client_id) {
            self.sticky = None;
        }
        self.members.is_empty()
    }

    /// A member connected or went away.
    pub fn set_online(&mut self, client_id: &str, online: bool) {
        if let Some(m) = self.members.iter_mut().find(|m| m.client_id == client_id) {
            m.online = online;
        }
        if !online && self.sticky.as_deref() == Some(client_id) {
            self.sticky = None;
        }
    }

    /// The members, in join order.
    pub fn members(&self) -> &[Member] {
        &self.members
    }

    /// Messages waiting for a member to come online.
    pub fn queued(&self) -> usize {
        self.queue.len()
    }

    /// Take the count of messages dropped from the full queue.
    pub fn take_dropped(&mut self) -> u64 {
        std::mem::take(&mut self.dropped)
    }

    /// Choose the online member for a message published by the client whose
    /// key is `publisher` on shard `from_shard`. `random` is a random number
    /// from the caller. `None` when no member is online.
    pub fn pick(&mut self, publisher: u64, from_shard: usize, random: u64) -> Option<&Member> {
        let online: Vec<usize> = (0..self.members.len()).filter(|&i| self.members[i].online).collect();
        if online.is_empty() {
            return None;
        }
        let index = match self.strategy {
            Strategy::RoundRobin => self.round_robin(&online),
            Strategy::Random => online[(random % online.len() as u64) as usize],
            Strategy::Sticky => {
                let current = self
                    .sticky
                    .as_ref()
                    .and_then(|id| online.iter().copied().find(|&i| self.members[i].client_id == *id));
                match current {
                    Some(i) => i,
                    None => {
                        let i = self.round_robin(&online);
                        self.sticky = Some(self.members[i].client_id.clone());
                        i
                    }
                }
            }
            Strategy::HashClientId => {
                let mut h = std::collections::hash_map::DefaultHasher::new();
                publisher.hash(&mut h);
                online[(h.finish() % online.len() as u64) as usize]
            }
            Strategy::LocalFirst => {
                let local: Vec<usize> = online.iter().copied().filter(|&i| self.members[i].shard == from_shard).collect();
                if local.is_empty() {
                    self.round_robin(&online)
                } else {
                    self.round_robin(&local)
                }
            }
        };
        Some(&self.members[index])
    }

    fn round_robin(&mut self, candidates: &[usize]) -> usize {
        let i = candidates[self.next % candidates.len()];
        self.next = self.next.wrapping_add(1);
        i
    }

    /// Keep a message while no member is online. QoS 0 messages are not
    /// kept (returns false); beyond `max_queue` the oldest is dropped and
    /// counted.
    pub fn enqueue(&mut self, message: Arc<Message>) -> bool {
        if message.qos == QoS::AtMostOnce {
            return false;
        }
        if self.queue.len() >= self.max_queue {
            self.queue.pop_front();
            self.dropped += 1;
        }
        self.queue.push_back(message);
        true
    }

    /// Take the queued messages, oldest first (when a member is back).
    pub fn take_queue(&mut self) -> VecDeque<Arc<Message>> {
        std::mem::take(&mut self.queue)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use bytes::Bytes;

    use super::*;
    use crate::packet::{Properties, SubscriptionOptions};

    fn member(id: &str, shard: usize, online: bool) -> Member {
        Member {
            client_id: id.into(),
            shard,
            subscription: Subscription { options: SubscriptionOptions::default(), identifier: None },
            online,
        }
    }

    fn message(qos: QoS) -> Arc<Message> {
        Arc::new(Message {
            topic: "t".into(),
            payload: Bytes::from_static(b"p"),
            qos,
            retain: false,
            properties: Properties::default().into(),
            received_at: Instant::now(),
            origin: 1,
            stored: 0,
            from_mesh: false,
            groups: crate::session::GroupPick::ALL,
        })
    }

    fn picks(g: &mut SharedGroup, n: usize, publisher: u64, from: usize) -> Vec<String> {
        (0..n).map(|i| g.pick(publisher, from, i as u64 * 7).map(|m| m.client_id.to_string()).unwrap_or_default()).collect()
    }

    #[test]
    fn round_robin_takes_online_members_in_turn() {
        let mut g = SharedGroup::new("a".into(), Strategy::RoundRobin, 10);
        g.join(member("x", 0, true));
        g.join(member("y", 1, true));
        g.join(member("z", 0, false));
        assert_eq!(picks(&mut g, 4, 1, 0), vec!["x", "y", "x", "y"]);
    }

    #[test]
    fn sticky_keeps_one_member_until_it_goes_away() {
        let mut g = SharedGroup::new("a".into(), Strategy::Sticky, 10);
        g.join(member("x", 0, true));
        g.join(member("y", 0, true));
        let first = picks(&mut g, 3, 1, 0);
        assert!(first.iter().all(|m| m == &first[0]));
        g.set_online(&first[0], false);
        let after = picks(&mut g, 2, 1, 0);
        assert!(after.iter().all(|m| m != &first[0] && m == &after[0]));
    }

    #[test]
    fn hash_client_id_sends_one_publisher_to_one_member() {
        let mut g = SharedGroup::new("a".into(), Strategy::HashClientId, 10);
        for id in ["m1", "m2", "m3"] {
            g.join(member(id, 0, true));
        }
        for publisher in 0..20u64 {
            let p = picks(&mut g, 5, publisher, 0);
            assert!(p.iter().all(|m| m == &p[0]));
        }
    }

    #[test]
    fn local_first_prefers_a_member_on_the_publishing_shard() {
        let mut g = SharedGroup::new("a".into(), Strategy::LocalFirst, 10);
        g.join(member("far", 0, true));
        g.join(member("near", 1, true));
        assert_eq!(picks(&mut g, 3, 1, 1), vec!["near", "near", "near"]);
        assert_eq!(picks(&mut g, 1, 1, 2).len(), 1);
    }

    #[test]
    fn random_picks_only_online_members() {
        let mut g = SharedGroup::new("a".into(), Strategy::Random, 10);
        g.join(member("x", 0, false));
        g.join(member("y", 0, true));
        assert!(picks(&mut g, 10, 1, 0).iter().all(|m| m == "y"));
    }

    #[test]
    fn with_no_member_online_qos1_waits_bounded_and_qos0_is_not_kept() {
        let mut g = SharedGroup::new("a".into(), Strategy::RoundRobin, 2);
        g.join(member("x", 0, false));
        assert!(g.pick(1, 0, 0).is_none());
        assert!(!g.enqueue(message(QoS::AtMostOnce)));
        for _ in 0..3 {
            assert!(g.enqueue(message(QoS::AtLeastOnce)));
        }
        assert_eq!((g.queued(), g.take_dropped()), (2, 1));
        g.set_online("x", true);
        assert_eq!(g.take_queue().len(), 2);
    }

    #[test]
    fn leaving_empties_the_group() {
        let mut g = SharedGroup::new("a".into(), Strategy::RoundRobin, 2);
        g.join(member("x", 0, true));
        g.join(member("x", 1, true));
        assert_eq!(g.members().len(), 1, "joining again updates the member");
        assert!(g.leave("x"));
    }
}
