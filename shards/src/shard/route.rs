//! Where a message goes (see [`Shard::route`]): the retained store,
//! this shard's subscribers, and the other shards whose routes match.

use std::sync::Arc;
use std::time::Instant;

use fleetmq_core::session::Message;

use super::{Shard, State};

impl Shard {
    /// Route a message: retained-store update, local subscribers, and the
    /// other shards whose routes match. Returns the shards it went to, one
    /// bit per shard (this one's bit for its own subscribers; none when
    /// the cluster holds a retained value until `mqtt-retained` has it).
    pub(super) fn route(&self, st: &mut State, message: Arc<Message>, now: Instant) -> u64 {
        if message.retain && self.keep_retained(st, &message, now) {
            return 0;
        }
        self.dispatch(st, message, now)
    }

    /// [`Shard::route`] past the retained store: local subscribers and
    /// the other shards whose routes match.
    pub(super) fn dispatch(&self, st: &mut State, message: Arc<Message>, now: Instant) -> u64 {
        if self.shards == 1 {
            // Alone: no route table to consult.
            self.dispatch_local(st, &message, self.id, now);
            return 1;
        }
        self.catch_up(st);
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
}
