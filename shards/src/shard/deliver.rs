//! Delivery to this shard's sessions: the matching subscribers of a
//! value ([`Shard::dispatch_local`]), one session's deliveries
//! ([`Shard::deliver_to`]) and their frames written to its connection, or
//! held behind what waits for the store or a session's cursor
//! ([`Shard::write_deliveries`]).

use super::*;

impl Shard {
    /// Deliver a message to this shard's matching subscribers: one delivery
    /// per session however many of its subscriptions match, at the highest
    /// granted QoS, with every Subscription Identifier (MQTT 5 §3.3.4).
    /// `from_shard` is the shard the message was published on.
    pub(super) fn dispatch_local(
        &self,
        st: &mut State,
        message: &Arc<Message>,
        from_shard: usize,
        now: Instant,
    ) {
        let mut matched = std::mem::take(&mut st.matched);
        st.trie.for_each_match(&message.topic, |subscriber, sub| {
            matched.push((*subscriber, *sub))
        });
        // The trie usually yields them in order already (one pass to check).
        if matched.len() > 1 && !matched.is_sorted_by_key(|(subscriber, _)| *subscriber) {
            matched.sort_unstable_by_key(|(subscriber, _)| *subscriber);
        }
        st.frames.clear();
        let mut i = 0;
        while i < matched.len() {
            let slot = match matched[i].0 {
                Subscriber::Session(slot) => slot,
                Subscriber::Group(gid) => {
                    i += 1;
                    // The mesh gave the group to a member on another
                    // replica, or this one is not the group's pick.
                    if !self.group_allowed(st, gid, message) {
                        continue;
                    }
                    self.dispatch_to_group(st, gid, message.clone(), from_shard, now);
                    continue;
                }
            };
            let client_key = st.clients[slot as usize].key;
            let mut qos = None;
            let mut retain = false;
            let mut ids = Vec::new();
            while i < matched.len() && matched[i].0 == Subscriber::Session(slot) {
                let sub = matched[i].1;
                i += 1;
                // No Local: not to a connection with the publisher's client
                // identifier `[MQTT-3.8.3-3]`.
                if sub.options.no_local && client_key == message.origin {
                    continue;
                }
                qos = qos.max(Some(sub.options.qos));
                retain |= sub.options.retain_as_published && message.retain;
                ids.extend(sub.identifier);
            }
            let Some(qos) = qos else { continue };
            if Self::log_skips(st, slot, message, qos.min(message.qos)) {
                // It reads this value from its session log.
                continue;
            }
            let delivery = Delivery {
                message: message.clone(),
                qos: qos.min(message.qos),
                retain,
                subscription_ids: ids,
                group: None,
            };
            self.deliver_to(st, slot, delivery, now, true);
        }
        matched.clear();
        st.matched = matched;
    }

    pub(super) fn deliver_to(
        &self,
        st: &mut State,
        slot: Slot,
        delivery: Delivery,
        now: Instant,
        cached: bool,
    ) {
        let client = &mut st.clients[slot as usize];
        if delivery.qos == QoS::AtMostOnce {
            if let Some(conn) = &client.conn {
                if conn.pending.get() + self.store.held_len(conn) >= self.limits.max_client_writes_pending
                    || conn.out.borrow().len() >= self.limits.max_client_write_bytes
                {
                    // A subscriber that does not read: drop, never stall
                    // the publisher (DESIGN.md §9, maxClientWritesPending;
                    // `limits.max_client_write_bytes` bounds its memory).
                    self.metrics.dropped(DropReason::QueueFull);
                    return;
                }
            }
        }
        let mut outputs = std::mem::take(&mut st.outputs);
        st.clients[slot as usize]
            .session
            .deliver(delivery, now, &mut outputs);
        self.write_deliveries(st, slot, &mut outputs, now, cached);
        st.outputs = outputs;
    }

    /// Write `Deliver` and `Send` outputs of a session to its connection.
    pub(super) fn write_deliveries(
        &self,
        st: &mut State,
        slot: Slot,
        outputs: &mut Vec<Output>,
        now: Instant,
        cached: bool,
    ) {
        let client = &mut st.clients[slot as usize];
        let mut idx = 0;
        while idx < outputs.len() {
            let output = std::mem::replace(
                &mut outputs[idx],
                Output::Close {
                    reason: None,
                    publish_will: false,
                },
            );
            idx += 1;
            if let Output::Log(change) = output {
                self.store.log_change(client.session.client_id(), change);
                continue;
            }
            let Some(conn) = &client.conn else { continue };
            match output {
                Output::Deliver {
                    delivery,
                    packet_id,
                    dup,
                } => {
                    let protocol = client.session.protocol();
                    let alias = client.session.outbound_topic_alias(&delivery.message.topic);
                    let strip = client.session.namespace().len();
                    let frame = frame_for(
                        &delivery,
                        protocol,
                        now,
                        alias,
                        strip,
                        cached.then_some(&mut st.frames),
                    );
                    if frame.len() > client.session.client_max_packet_size() {
                        // `[MQTT-3.1.2-25]`: drop it for this client, counted.
                        if let Some((_, true)) = alias {
                            client
                                .session
                                .forget_outbound_topic_alias(&delivery.message.topic);
                        }
                        client.session.dropped_too_large(packet_id, now, outputs);
                        self.metrics.dropped(DropReason::PacketTooLarge);
                        continue;
                    }
                    self.metrics.messages_out.inc();
                    let gated = Self::gates_delivery(client, &delivery, packet_id);
                    if let Some(write) = self.holds((&mut client.log, client.key), slot, conn, gated) {
                        // Behind its cursor, or what waits for it.
                        let mut held = BytesMut::new();
                        frame.append_to(packet_id, dup, &mut held);
                        self.store.hold_publish(conn, held.freeze(), write);
                        continue;
                    }
                    let value = delivery.message.stored;
                    if packet_id.is_some() && value != 0 && client.session.is_logged() && self.store.publish_must_wait(conn, delivery.qos, value) {
                        let mut parked = BytesMut::new();
                        frame.append_to(packet_id, dup, &mut parked);
                        self.store.park_publish(conn, value, parked.freeze());
                        continue;
                    }
                    frame.append_to(packet_id, dup, &mut conn.out.borrow_mut());
                    conn.pending.set(conn.pending.get() + 1);
                    conn.wake();
                }
                Output::Send(packet) | Output::Acknowledge(packet) => {
                    self.send_or_hold((&mut client.log, client.key), slot, conn, packet)
                }
                _ => {}
            }
        }
        outputs.clear();
        let drops = client.session.take_drops();
        self.count_drops(drops);
    }

    /// Count what a session dropped (its counters were just taken). The
    /// too-large drops are counted where they happen.
    pub(super) fn count_drops(&self, drops: fleetmq_core::session::DropCounts) {
        for (reason, n) in [
            (DropReason::QueueFull, drops.queue_full),
            (DropReason::Expired, drops.expired),
            (DropReason::NotAuthorized, drops.not_authorized),
        ] {
            for _ in 0..n {
                self.metrics.dropped(reason);
            }
        }
    }
}
