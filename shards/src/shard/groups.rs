//! Shared subscription groups across shards (MQTT 5 §4.8.2).
//!
//! A group `$share/{group}/{filter}` belongs to `owner_of(shared filter)`.
//! The owner puts one [`Subscriber::Group`] entry for the inner filter in
//! its trie, so the route table sends it every matching message once; it
//! then picks one member ([`SharedGroup::pick`]) and hands the message to
//! the shard that owns that member's session. Members report joins, leaves
//! and presence to the owner as [`GroupOp`]s; a member going offline returns
//! its unacknowledged group deliveries, which the owner gives to another
//! member or keeps until one is back.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use bytestring::ByteString;
use fleetmq_core::session::{Delivery, Message, Subscription};
use fleetmq_core::shared::{Member, SharedGroup};
use fleetmq_core::topic::parse_shared;

use super::inbox::Control;
use super::{owner_of, Shard, ShardMsg, SharedDelivery, Slot, State, Subscriber};
use crate::metrics::DropReason;

/// A change to a group, sent to the group's owner shard.
#[derive(Clone)]
pub(crate) enum GroupOp {
    /// A session subscribed to the shared filter `key` (or changed options).
    Join { key: ByteString, member: Member },
    /// A session unsubscribed, or ended.
    Leave { key: ByteString, client_id: ByteString },
    /// A member's session gained or lost its connection.
    Online { key: ByteString, client_id: ByteString, online: bool },
    /// Messages a member took but did not acknowledge before going away, or
    /// could not take (`refused_by`: that member, now known to be away): to
    /// be given to another member.
    Return { key: ByteString, messages: Vec<Arc<Message>>, refused_by: Option<ByteString> },
}

impl GroupOp {
    fn key(&self) -> &ByteString {
        match self {
            GroupOp::Join { key, .. } | GroupOp::Leave { key, .. } | GroupOp::Online { key, .. } | GroupOp::Return { key, .. } => key,
        }
    }
}

/// A group and the shared filter that names it.
pub(super) struct GroupEntry {
    key: ByteString,
    group: SharedGroup,
}

impl Shard {
    /// Apply `op` here when this shard owns the group, else push it into
    /// the owner's inbox. A join also routes the group's filter to the owner
    /// on every shard at once, so a publish right after the SUBACK reaches
    /// the group (the owner applies its inbox before dispatching).
    pub(super) fn group_op(&self, st: &mut State, op: GroupOp, now: Instant) {
        let owner = owner_of(op.key(), self.shards);
        if owner == self.id {
            self.apply_group_op(st, op, self.id, now);
            return;
        }
        if let GroupOp::Join { key, .. } = &op {
            if let Some((_, filter)) = parse_shared(key) {
                let filter = ByteString::from(filter);
                st.routes.add(&filter, owner);
                self.broadcast(Control::Route { filter, shard: owner, add: true });
            }
        }
        self.global.inboxes[owner].push(Control::Group { from: self.id, op });
    }

    /// Apply a group change as the group's owner; `from` is the shard it
    /// came from.
    pub(super) fn apply_group_op(&self, st: &mut State, op: GroupOp, from: usize, now: Instant) {
        match op {
            GroupOp::Join { key, member } => {
                let gid = match st.group_ids.get(&key) {
                    Some(gid) => *gid,
                    None => {
                        let Some((group, filter)) = parse_shared(&key) else { return };
                        let strategy = self.limits.shared.strategy_for(group);
                        let filter = ByteString::from(filter);
                        let group = SharedGroup::new(filter.clone(), strategy, self.limits.session.max_queue);
                        let gid = st.groups.insert(GroupEntry { key: key.clone(), group }) as u32;
                        note_local_group(st, &key, true);
                        self.broadcast(Control::Shared { key: key.clone(), add: true });
                        st.group_ids.insert(key, gid);
                        if !st.trie.has_filter(&filter) {
                            self.route_change(st, &filter, true);
                        }
                        st.trie.insert(&filter, Subscriber::Group(gid), Subscription { options: Default::default(), identifier: None });
                        gid
                    }
                };
                let online = member.online;
                st.groups[gid as usize].group.join(member);
                if online {
                    self.drain_group(st, gid, now);
                }
            }
            GroupOp::Leave { key, client_id } => {
                let Some(&gid) = st.group_ids.get(&key) else { return };
                if st.groups[gid as usize].group.leave(&client_id) {
                    let mut entry = st.groups.remove(gid as usize);
                    st.group_ids.remove(&key);
                    note_local_group(st, &key, false);
                    self.broadcast(Control::Shared { key: key.clone(), add: false });
                    self.trie_remove(st, &entry.group.filter, Subscriber::Group(gid));
                    // What it kept (returned by the member that left, or
                    // waiting for one) goes to a member elsewhere.
                    let group = parse_shared(&key).map(|(g, _)| ByteString::from(g)).unwrap_or_default();
                    for message in entry.group.take_queue() {
                        self.forward_or_hold(st, &group, &message, now);
                    }
                }
            }
            GroupOp::Online { key, client_id, online } => {
                let Some(&gid) = st.group_ids.get(&key) else { return };
                st.groups[gid as usize].group.set_online(&client_id, online);
                if online {
                    self.drain_group(st, gid, now);
                }
            }
            GroupOp::Return { key, messages, refused_by } => {
                let Some(&gid) = st.group_ids.get(&key) else {
                    // The group left this replica meanwhile: as its queue
                    // did, elsewhere.
                    let group = parse_shared(&key).map(|(g, _)| ByteString::from(g)).unwrap_or_default();
                    for message in messages {
                        self.forward_or_hold(st, &group, &message, now);
                    }
                    return;
                };
                if let Some(client_id) = refused_by {
                    // Never hand these back to the member that just refused
                    // them: it is away, whatever the group last heard.
                    st.groups[gid as usize].group.set_online(&client_id, false);
                }
                for message in messages {
                    self.dispatch_to_group(st, gid, message, from, now);
                }
            }
        }
    }

    /// Messages kept while no member was online go out now, oldest first.
    fn drain_group(&self, st: &mut State, gid: u32, now: Instant) {
        let queued = st.groups[gid as usize].group.take_queue();
        for message in queued {
            self.dispatch_to_group(st, gid, message, self.id, now);
        }
    }

    /// Give a message to one member of group `gid`, or keep it while none is
    /// online (QoS 1/2; QoS 0 is dropped).
    pub(super) fn dispatch_to_group(&self, st: &mut State, gid: u32, message: Arc<Message>, from_shard: usize, now: Instant) {
        let entry = &mut st.groups[gid as usize];
        let picked = entry
            .group
            .pick(message.origin, from_shard, rand::random())
            .map(|m| (m.client_id.clone(), m.shard, m.subscription));
        let key = entry.key.clone();
        match picked {
            Some((client_id, shard, subscription)) if shard == self.id => {
                self.deliver_shared_local(st, key, &client_id, subscription, message, now);
            }
            Some((client_id, shard, subscription)) => {
                let shared = SharedDelivery { key, client_id, subscription, message };
                st.control.push((shard, ShardMsg::DeliverShared(Box::new(shared))));
            }
            None => {
                if !entry.group.enqueue(message) {
                    self.metrics.dropped(DropReason::QueueFull);
                }
                for _ in 0..entry.group.take_dropped() {
                    self.metrics.dropped(DropReason::QueueFull);
                }
            }
        }
    }

    /// Deliver a group's message to member `client_id`, whose session this
    /// shard owns; when that session is gone or offline, return it to the
    /// group.
    pub(super) fn deliver_shared_local(
        &self,
        st: &mut State,
        key: ByteString,
        client_id: &str,
        subscription: Subscription,
        message: Arc<Message>,
        now: Instant,
    ) {
        let slot = st.by_id.get(&st.clients, client_id).filter(|slot| st.clients[*slot as usize].session.is_online());
        match slot {
            Some(slot) => {
                let delivery = Delivery {
                    qos: message.qos.min(subscription.options.qos),
                    retain: subscription.options.retain_as_published && message.retain,
                    subscription_ids: subscription.identifier.into_iter().collect(),
                    group: Some(key),
                    message,
                };
                self.deliver_to(st, slot, delivery, now, false);
            }
            None => {
                let refused_by = Some(ByteString::from(client_id));
                self.group_op(st, GroupOp::Return { key, messages: vec![message], refused_by }, now);
            }
        }
    }

    /// The session on `slot` gained (`online`) or lost its connection: tell
    /// each of its groups, and on loss return its unacknowledged group
    /// deliveries so another member gets them.
    pub(super) fn shared_presence(&self, st: &mut State, slot: Slot, online: bool) {
        let client = &mut st.clients[slot as usize];
        let client_id = client.session.client_id().clone();
        let keys: Vec<ByteString> =
            client.session.subscriptions().keys().filter(|f| parse_shared(f).is_some()).cloned().collect();
        let mut returned: BTreeMap<ByteString, Vec<Arc<Message>>> = BTreeMap::new();
        if !online {
            for delivery in client.session.take_shared_deliveries() {
                let key = delivery.group.expect("shared deliveries name their group");
                returned.entry(key).or_default().push(delivery.message);
            }
        }
        let now = Instant::now();
        for key in keys {
            self.group_op(st, GroupOp::Online { key, client_id: client_id.clone(), online }, now);
        }
        for (key, messages) in returned {
            self.group_op(st, GroupOp::Return { key, messages, refused_by: None }, now);
        }
    }
}

/// This replica in [`State::local_groups`] (a table of the remote kind,
/// whose peer ids mean nothing here).
pub(super) const HERE: fleetmq_core::cluster::peers::PeerId = fleetmq_core::cluster::peers::PeerId(0);

/// Keep `State::local_groups` current: the shared subscription `key`
/// has members here (`add`) or no longer.
pub(super) fn note_local_group(st: &mut State, key: &str, add: bool) {
    let change = fleetmq_core::cluster::peers::RouteChange { peer: HERE, filter: key.to_owned(), present: add };
    st.local_groups.apply(&change);
    if add {
        st.strays.joined = true;
        st.local_group_keys.insert(ByteString::from(key));
    } else {
        st.local_group_keys.remove(key);
    }
}

impl Shard {
    /// Whether group `gid` takes `message` (see [`fleetmq_core::session::GroupPick`]).
    pub(super) fn group_allowed(&self, st: &State, gid: u32, message: &Message) -> bool {
        if message.groups.is_all() {
            return true;
        }
        let Some(entry) = st.groups.get(gid as usize) else { return false };
        parse_shared(&entry.key).is_some_and(|(group, _)| message.groups.allows(group))
    }
}

