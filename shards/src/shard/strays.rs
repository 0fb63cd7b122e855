//! Shared subscription values with nowhere to go yet (cluster mode).
//!
//! When the last member of a group on this replica leaves, what the group
//! kept goes to a member on another replica ([`Shard::forward_group_away`]).
//! A persistent session moving to another replica leaves here before this
//! replica hears (through `mqtt-routes`) that the new one has the member
//! again: a value with no member anywhere *yet* is held, at most
//! [`STRAY_WAIT`], and goes on as soon as a route of the group arrives
//! ([`Shard::apply_routes`]) or a member joins here again (the shard's
//! next tick); past the wait it is dropped and counted (`no_member`). QoS 0
//! is never held (MQTT 5 §4.8.2 lets the server drop it when no member
//! can take it).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytestring::ByteString;
use fleetmq_core::session::Message;

use super::{Shard, State};
use crate::metrics::DropReason;

/// How long a group value waits for a member to appear: the new
/// replica writes its route within [`super::ROUTE_WAIT`] of the take-up,
/// and the watch brings it here within moments; twice that leaves room.
pub(crate) const STRAY_WAIT: Duration = Duration::from_secs(4);

/// A group's value waiting for a member, until `until`.
pub(super) struct Stray {
    group: ByteString,
    message: Arc<Message>,
    until: Instant,
}

/// The values held, oldest first (so also by `until`).
#[derive(Default)]
pub(super) struct Strays {
    held: VecDeque<Stray>,
    /// A group got a member on this replica since the last look.
    pub(super) joined: bool,
}

impl Shard {
    /// Send `message` for `group` (which has no member here) to a member
    /// on another replica, or hold it until one appears (see the module).
    pub(super) fn forward_or_hold(&self, st: &mut State, group: &ByteString, message: &Arc<Message>, now: Instant) {
        if self.forward_group_away(st, group, message) {
            return;
        }
        if message.qos == fleetmq_core::packet::QoS::AtMostOnce || !self.links.active() {
            self.metrics.dropped(DropReason::NoMember);
            return;
        }
        // Bounded as one group's queue: past it the oldest go.
        let held = &mut st.strays.held;
        if held.len() >= self.limits.session.max_queue.max(1) {
            held.pop_front();
            self.metrics.dropped(DropReason::NoMember);
        }
        held.push_back(Stray { group: group.clone(), message: message.clone(), until: now + STRAY_WAIT });
    }

    /// The shard's tick: after a group got a member here, give the held
    /// values another try; else only drop those whose wait ran out.
    pub(super) fn tick_strays(&self, st: &mut State, now: Instant) {
        if std::mem::take(&mut st.strays.joined) {
            self.retry_strays(st, now);
        }
        while st.strays.held.front().is_some_and(|stray| stray.until <= now) {
            st.strays.held.pop_front();
            self.metrics.dropped(DropReason::NoMember);
        }
    }

    /// Give each held value to a member here or on another replica, if one
    /// appeared; drop those whose wait ran out. Cheap with none held.
    pub(super) fn retry_strays(&self, st: &mut State, now: Instant) {
        if st.strays.held.is_empty() {
            return;
        }
        // This replica's shared subscriptions of the groups held, once.
        let mut here: HashMap<ByteString, Vec<(ByteString, ByteString)>> = HashMap::new();
        for stray in &st.strays.held {
            here.entry(stray.group.clone()).or_default();
        }
        for key in &st.local_group_keys {
            if let Some((group, filter)) = fleetmq_core::topic::parse_shared(key) {
                if let Some(keys) = here.get_mut(group) {
                    keys.push((key.clone(), ByteString::from(filter)));
                }
            }
        }
        for stray in std::mem::take(&mut st.strays.held) {
            let topic = &stray.message.topic;
            let keys: Vec<ByteString> = here
                .get(&stray.group)
                .into_iter()
                .flatten()
                .filter(|(_, filter)| fleetmq_core::topic::matches(filter, topic))
                .map(|(key, _)| key.clone())
                .collect();
            let given = !keys.is_empty();
            self.give_to_groups(st, keys, &stray.message, now);
            if given || self.forward_group_away(st, &stray.group, &stray.message) {
                continue;
            }
            if stray.until <= now {
                self.metrics.dropped(DropReason::NoMember);
            } else {
                st.strays.held.push_back(stray);
            }
        }
    }
}
