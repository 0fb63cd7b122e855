//! Where a message goes (see [`Shard::route`]): the retained store,
//! this shard's subscribers, and the other shards whose routes match.

use std::sync::Arc;
use std::time::Instant;

use bytestring::ByteString;
use fleetmq_core::cluster::peers::{PeerId, PeerSet};
use fleetmq_core::session::{GroupPick, Message};

use super::groups::GroupOp;
use super::held::Delivery;
use super::{Shard, State};

/// Where the cluster stores a value a client published (see
/// [`Shard::route_from`]).
#[derive(Default)]
pub(super) struct Appends {
    /// The value as the ingest stream records it (`store.kind =
    /// "jetstream"`, QoS 1/2).
    pub(super) ingest: Option<crate::cluster::IngestRecord>,
    /// The publisher's workspace, for a QoS 1/2 value in cluster mode,
    /// whose session log takes it when a persistent session wants it.
    pub(super) workspace: Option<Arc<str>>,
    /// The inbound QoS 2 flow of a persistent publisher, recorded once
    /// the value is stored (`mqtt-session-qos2`).
    pub(super) qos2: Option<Box<fleetmq_nats_bridge::Qos2Flow>>,
}

impl Shard {
    /// Route a message: retained-store update, local subscribers, and the
    /// other shards whose routes match. Returns the shards it went to, one
    /// bit per shard (this one's bit for its own subscribers; none when
    /// it is held: a retained value the cluster delivers once
    /// `mqtt-retained` has it, and what its publisher sent after it, see
    /// [`super::held`]).
    pub(super) fn route(&self, st: &mut State, message: Arc<Message>, now: Instant) -> u64 {
        self.route_from(st, message, None, Appends::default(), now)
    }

    /// [`Shard::route`] for a message a client published on a connection
    /// speaking MQTT 5 (`v5`: `Some(true)`) or 3.1.x (`Some(false)`): what
    /// a refusal of a value held before it does to it depends on that
    /// (see [`super::held`]). `appends`: where the cluster stores it
    /// ([`Appends`]); appended there, its acknowledgement and delivery
    /// wait for JetStream ([`crate::cluster::append_ingest`]).
    pub(super) fn route_from(
        &self,
        st: &mut State,
        message: Arc<Message>,
        v5: Option<bool>,
        appends: Appends,
        now: Instant,
    ) -> u64 {
        let Appends { ingest, workspace, qos2 } = appends;
        let mut delivery = if message.retain { self.keep_retained(st, &message, now) } else { Delivery::Now };
        let workspace = workspace.filter(|_| crate::cluster::wants_log(&message.topic));
        let mut message = message;
        if workspace.is_some() && self.reads_logs() {
            // Persistent sessions read it from their log, not live.
            Arc::make_mut(&mut message).stored = super::session_log::LOGGED;
        }
        if ingest.is_some() || workspace.is_some() || qos2.is_some() {
            let held = match delivery {
                Delivery::Never => None,
                Delivery::After(write) => Some(Some(write)),
                Delivery::Now => Some(None),
            };
            // A value the retained store refused is refused: not appended.
            if let Some(held) = held {
                let next = || st.held.next_write();
                let appended =
                    crate::cluster::append_ingest(&message, ingest, workspace.as_deref(), qos2, &self.store, held, next);
                if let Some(write) = appended {
                    delivery = Delivery::After(write);
                }
            }
        }
        super::held::route_after(self, st, message, delivery, v5, now)
    }

    /// [`Shard::route`] past the retained store: local subscribers and
    /// the other shards whose routes match.
    pub(super) fn dispatch(&self, st: &mut State, message: Arc<Message>, now: Instant) -> u64 {
        if self.shards > 1 {
            self.catch_up(st);
        }
        // Before the one-shard return (trap 6 of notes/cluster-seams.md).
        let message = self.forward_to_peers(st, message);
        if self.shards == 1 {
            // Alone: no route table to consult.
            self.dispatch_local(st, &message, self.id, now);
            return 1;
        }
        let shards = st.routes.shards_for(&message.topic);
        let mut reach = 0;
        for shard in shards.iter() {
            reach |= 1 << shard;
            if shard == self.id {
                self.dispatch_local(st, &message, self.id, now);
            } else {
                st.outbox_bytes += message.payload.len();
                st.outbox[shard].push(message.clone());
            }
        }
        reach
    }

    /// The mesh (DESIGN.md §3): a value published here goes once to each
    /// other replica with a plain subscription matching it, and each
    /// shared subscription group with members on other replicas gets it
    /// at one member replica (`shared.strategy`: `local_first` keeps it
    /// here when this replica has a member). One that came from the mesh
    /// never goes on (trap 7), nor do `$SYS` values (each replica
    /// publishes its own). Returns the message to deliver here: one whose
    /// [`GroupPick`] leaves out the groups served elsewhere.
    fn forward_to_peers(&self, st: &mut State, message: Arc<Message>) -> Arc<Message> {
        if message.from_mesh || !self.links.active() || st.remote_routes.is_empty() || message.topic.starts_with("$SYS/") {
            return message;
        }
        // One walk of the remote routes: plain peers, and the groups with
        // members elsewhere (none, most often: then nothing more to walk).
        let mut plain = PeerSet::new();
        let mut remote_groups: Vec<(ByteString, PeerSet)> = Vec::new();
        st.remote_routes.for_each_route(&message.topic, |group, peers| match group {
            None => plain = plain.union(peers),
            Some(group) => remote_groups.push((group.clone(), peers)),
        });
        if remote_groups.is_empty() {
            for peer in plain.iter() {
                self.links.forward(peer, &message, None, true);
            }
            return message;
        }
        // Groups: (share name, the peer picked) for those served elsewhere.
        let mut here = Vec::new();
        st.local_groups.for_each_group(&message.topic, |group, _| here.push(group.clone()));
        let mut picked: Vec<(ByteString, PeerId)> = Vec::new();
        let mut elsewhere = Vec::new();
        for (group, peers) in &remote_groups {
            let (group, peers) = (group, *peers);
            if picked.iter().any(|(g, _)| g == group) || elsewhere.contains(group) {
                continue;
            }
            let local = here.contains(group);
            let strategy = self.limits.shared.strategy_for(group);
            if let Some(peer) = self.links.pick(group, strategy, local, peers, message.origin) {
                picked.push((group.clone(), peer));
                if local {
                    elsewhere.push(group.clone());
                }
            }
        }
        let mut targets = plain;
        picked.iter().for_each(|(_, p)| {
            targets.insert(*p);
        });
        for peer in targets.iter() {
            let groups: Vec<ByteString> = picked.iter().filter(|(_, p)| *p == peer).map(|(g, _)| g.clone()).collect();
            self.links.forward(peer, &message, (!groups.is_empty()).then(|| groups.into()), plain.contains(peer));
        }
        if elsewhere.is_empty() {
            return message;
        }
        let mut kept = Message::clone(&message);
        kept.groups = GroupPick::except(elsewhere);
        Arc::new(kept)
    }

    /// The values this shard sent to the peer `from` for shared groups,
    /// each with the groups it was picked there for, now that the link to
    /// it is down (`gone`: the peer left the live list): each group gets
    /// the value again at another member [MQTT 5 §4.8.2: when the chosen
    /// member's session ends before it acknowledges, the Server SHOULD
    /// send it to another member], as [`Shard::forward_to_peers`] would
    /// pick one without `from`: a replica whose link from this shard is
    /// up, or this one when it has members.
    ///
    /// A link that is merely down (a cut) may heal and send its buffer:
    /// its group values still go now when such a member exists, so they
    /// do not wait for the heal (~seconds) or die with a killed peer
    /// (whose links close at once, while it is taken for gone ~15 s
    /// later). The peer may have delivered some already (sent, the
    /// acknowledgement lost with the link): those come twice, at least
    /// once as §4.8.2 implies for QoS 1. While no member is reachable a
    /// group stays with `from` (its buffer keeps the value for the heal);
    /// once `from` is gone, a member whose link is down takes it into its
    /// own buffer. A replica with a plain subscription matching the value
    /// is picked only over a link of mesh version 5 or later, which sends
    /// it for the group only (an older one would hand it to its plain
    /// subscribers again).
    ///
    /// Returns, per value, the groups left to `from`, and how many group
    /// deliveries went elsewhere and how many found no member at all
    /// (only when `gone`: lost, the caller counts them).
    pub(crate) fn redispatch_groups(
        &self,
        from: PeerId,
        values: &[(Arc<Message>, Arc<[ByteString]>)],
        gone: bool,
    ) -> (Vec<Vec<ByteString>>, u64, u64) {
        let now = Instant::now();
        let mut st = self.state.borrow_mut();
        let (mut sent, mut lost) = (0, 0);
        let mut left_all = Vec::with_capacity(values.len());
        for (message, groups) in values {
            let mut left = Vec::new();
            for group in groups.iter() {
                let members = self.remote_group_members(&st, group, &message.topic, Some(from));
                let keys: Vec<ByteString> = local_group_keys(&st, group, &message.topic).cloned().collect();
                let local = !keys.is_empty();
                if !local && !gone && !self.links.any_up(members) {
                    left.push(group.clone());
                    continue;
                }
                if self.forward_to_member(group, message, members, local) {
                    sent += 1;
                } else if local {
                    self.give_to_groups(&mut st, keys, message, now);
                    sent += 1;
                } else {
                    lost += 1;
                }
            }
            left_all.push(left);
        }
        (left_all, sent, lost)
    }

    /// Send `message` for the shared subscription group `group`, which has
    /// no member on this replica any more (its last one left: a clean
    /// session's connection ended, or the session moved to another
    /// replica; or a peer picked this replica for it just before it heard
    /// of that), to a member of the same group on another replica instead
    /// [MQTT 5 §4.8.2: another member SHOULD get it], picked as
    /// [`Shard::forward_to_peers`] would (a replica with a plain
    /// subscription matching it only over a link of mesh version 5 or
    /// later: see [`Shard::redispatch_groups`]). Returns whether it went;
    /// the caller counts it dropped otherwise.
    pub(super) fn forward_group_away(&self, st: &State, group: &ByteString, message: &Arc<Message>) -> bool {
        self.forward_to_member(group, message, self.remote_group_members(st, group, &message.topic, None), false)
    }

    /// Forward `message` to the member replica of `group` that
    /// `shared.strategy` picks among `members` (and this replica too when
    /// `local`), for that group only; false when none was picked, or this
    /// replica was.
    fn forward_to_member(&self, group: &ByteString, message: &Arc<Message>, members: PeerSet, local: bool) -> bool {
        let strategy = self.limits.shared.strategy_for(group);
        let Some(peer) = self.links.pick(group, strategy, local, members, message.origin) else { return false };
        self.links.forward(peer, message, Some(Arc::from([group.clone()])), false);
        true
    }

    /// Values another replica sent over the mesh: to this replica's
    /// subscribers, on every shard, like a publish, but not to the
    /// retained store (the publishing replica stored a retained one in
    /// `mqtt-retained`, whose watch brings it here) and not to other
    /// replicas.
    pub(crate) fn deliver_from_mesh(&self, values: Vec<fleetmq_core::mesh::Value>) {
        if values.is_empty() {
            return;
        }
        let now = Instant::now();
        let mut st = self.state.borrow_mut();
        if self.shards > 1 {
            // The groups other shards own, as they stand now.
            self.catch_up(&mut st);
        }
        for v in values {
            // A group the sender picked this replica for that has no member
            // here (as this shard knows: it left moments ago, or joins
            // moments from now) goes on elsewhere, and only there: handed
            // to the shards too, it could reach a member joining here
            // as well, twice.
            let (here, away): (Vec<ByteString>, Vec<ByteString>) =
                v.groups.iter().cloned().partition(|group| local_group_keys(&st, group, &v.topic).next().is_some());
            let message = Message {
                topic: v.topic,
                payload: v.payload,
                qos: v.qos,
                retain: v.retain,
                properties: v.properties,
                received_at: now,
                origin: v.origin,
                // A reading session skips it when the sender logged it.
                stored: if v.logged { super::session_log::LOGGED } else { 0 },
                from_mesh: true,
                groups: if away.is_empty() { GroupPick::only(v.groups) } else { GroupPick::only(here.clone()) },
            };
            let message = Arc::new(message);
            for group in &away {
                self.forward_or_hold(&mut st, group, &message, now);
            }
            if !v.groups_only {
                self.dispatch(&mut st, message, now);
                continue;
            }
            // For the groups only (mesh version 5): not for the plain
            // subscriptions here, which had their copy.
            for group in &here {
                let keys: Vec<ByteString> = local_group_keys(&st, group, &message.topic).cloned().collect();
                self.give_to_groups(&mut st, keys, &message, now);
            }
        }
    }

    /// Give `message` to the shared subscriptions `keys` of this replica
    /// (each through its owner shard, which sends it on elsewhere if the
    /// group left meanwhile).
    pub(super) fn give_to_groups(&self, st: &mut State, keys: impl IntoIterator<Item = ByteString>, message: &Arc<Message>, now: Instant) {
        for key in keys {
            self.group_op(st, GroupOp::Return { key, messages: vec![message.clone()], refused_by: None }, now);
        }
    }
}

impl Shard {
    /// The peers with members of the shared group `group` whose filter
    /// matches `topic`, `from` excepted, to send it to for the group only:
    /// one with a plain subscription matching it too only over a link
    /// that can say "for the group only" (see
    /// [`crate::mesh::ShardLinks::groups_only`]).
    fn remote_group_members(&self, st: &State, group: &ByteString, topic: &str, from: Option<PeerId>) -> PeerSet {
        let plain = st.remote_routes.peers_for(topic);
        let mut members = PeerSet::new();
        st.remote_routes.for_each_group(topic, |g, peers| {
            if g == group {
                members = members.union(peers);
            }
        });
        if let Some(from) = from {
            members.remove(from);
        }
        let able = self.links.groups_only(plain);
        plain.iter().filter(|p| !able.contains(*p)).for_each(|p| {
            members.remove(p);
        });
        members
    }
}

/// The shared subscriptions (`$share/<group>/<filter>`) of `group` with
/// members on this replica whose filter matches `topic`.
fn local_group_keys<'a>(st: &'a State, group: &'a str, topic: &'a str) -> impl Iterator<Item = &'a ByteString> {
    st.local_group_keys
        .iter()
        .filter(move |key| fleetmq_core::topic::parse_shared(key).is_some_and(|(g, filter)| g == group && fleetmq_core::topic::matches(filter, topic)))
}
