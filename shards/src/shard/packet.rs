//! One packet from a client: [`Shard::handle_packet`] hands it to its
//! session and carries out what the session returns (acknowledgements,
//! values to route, subscription changes, the close), in order.

use super::*;

impl Shard {
    /// Handle one packet from the client on `slot`. When the packet ends
    /// the connection, the decision is in `conn.close`. Returns the shards
    /// a PUBLISH went to, one bit per shard (see [`Shard::route`]; 0 for
    /// other packets).
    pub(crate) fn handle_packet(
        &self,
        slot: Slot,
        conn: &ConnShared,
        packet: Packet,
        now: Instant,
    ) -> u64 {
        let mut st = self.state.borrow_mut();
        let st = &mut *st;
        let attached = st
            .clients
            .get(slot as usize)
            .and_then(|c| c.conn.as_ref())
            .is_some_and(|c| c.key == conn.key);
        if !attached {
            // Taken over while this packet was on its way: drop it.
            conn.request_close(None, false);
            return 0;
        }
        self.forget_refused_qos2(st);
        let is_publish = matches!(packet, Packet::Publish(_));
        let since = self.store.begin_packet();
        let mut outputs = std::mem::take(&mut st.outputs);
        // A flow another replica recorded (taken up): the first PUBLISH
        // its client sends again is a new one to the session, appended
        // again under the recorded message ID (see `take_reopened`).
        let reopened = take_reopened(&mut st.clients[slot as usize], &packet);
        if let Some((packet_id, _)) = &reopened {
            st.clients[slot as usize].session.forget_inbound_qos2(*packet_id, &mut outputs);
        }
        let session = &mut st.clients[slot as usize].session;
        // A persistent session's inbound QoS 2 flow in the cluster
        // (`mqtt-session-qos2`): opened with its value, released by its
        // PUBREL before the PUBCOMP.
        let (flow, released) = match &packet {
            Packet::Publish(p) if p.qos == QoS::ExactlyOnce => (p.packet_id, None),
            Packet::PubRel(rel) => (None, Some(rel.packet_id)),
            _ => (None, None),
        };
        let flow_of = |id: std::num::NonZeroU16| {
            crate::cluster::qos2_flow(self.store.clustered(), session.session_expiry(), session.client_id(), id.get())
        };
        let (mut flow, released) = (flow.and_then(flow_of), released.and_then(flow_of));
        if let (Some((_, id)), Some(flow)) = (reopened, flow.as_mut()) {
            flow.message_id = Some(id.into());
        }
        if let Some(released) = released {
            // Before the PUBCOMP the session returns: it waits for this.
            crate::cluster::release_qos2(released, &self.store, st.clients[slot as usize].key);
        }
        let session = &mut st.clients[slot as usize].session;
        session.set_store_refusing(self.store.refusing());
        session.handle(packet, now, &mut outputs);
        if is_publish {
            self.metrics.messages_in.inc();
            let drops = st.clients[slot as usize].session.take_drops();
            self.count_drops(drops);
        }
        let mut deliveries = Vec::new();
        let mut acks = Vec::new();
        let durable = self.store.defers();
        let mut reach = 0;
        let mut route_waits = Vec::new();
        let mut subscriptions_changed = false;
        for output in outputs.drain(..) {
            match output {
                Output::Send(packet) => {
                    let client = &mut st.clients[slot as usize];
                    match &client.conn {
                        // A PUBREL may wait for its cursor (session logs).
                        Some(attached) => self.send_or_hold((&mut client.log, client.key), slot, attached, packet),
                        None => conn.send(&packet),
                    }
                }
                // Without a store, at once, in order with the other outputs.
                Output::Acknowledge(packet) if !durable => conn.send(&packet),
                Output::Acknowledge(packet) => acks.push(packet),
                Output::Log(change) => {
                    self.store.log_change(st.clients[slot as usize].session.client_id(), change)
                }
                Output::Publish(mut message) => {
                    message.origin = st.clients[slot as usize].key;
                    let logged = self.store.log_value(&mut message, now);
                    let v5 = Some(conn.protocol.is_v5());
                    let client = &st.clients[slot as usize];
                    let ingest = self.store.ingests().then(|| ingest_value(client, &message)).flatten();
                    let workspace = (self.store.clustered() && message.qos != QoS::AtMostOnce).then(|| client.owner.1.clone());
                    let flow = flow.take().filter(|_| message.qos == QoS::ExactlyOnce);
                    let appends = route::Appends { ingest, workspace, qos2: flow };
                    reach |= if logged { self.route_from(st, Arc::new(message), v5, appends, now) } else { 0 };
                }
                Output::Subscribed {
                    filter,
                    subscription,
                    existed,
                } => {
                    if self.store.clustered() {
                        self.want_route(st, &filter, !existed, &mut route_waits);
                    }
                    // In the session's record too, shared ones included.
                    subscriptions_changed = true;
                    if parse_shared(&filter).is_some() {
                        let client_id = st.clients[slot as usize].session.client_id().clone();
                        let member = fleetmq_core::shared::Member {
                            client_id,
                            shard: self.id,
                            subscription,
                            online: true,
                        };
                        self.group_op(
                            st,
                            GroupOp::Join {
                                key: filter,
                                member,
                            },
                            now,
                        );
                    } else {
                        self.log_subscription(st, slot, &filter, Some(subscription));
                        self.subscribe(st, slot, filter, subscription, existed);
                    }
                }
                Output::Unsubscribed { filter } => {
                    subscriptions_changed = true;
                    self.log_subscription(st, slot, &filter, None);
                    let client_id = st.clients[slot as usize].session.client_id().clone();
                    self.unsubscribe(st, &filter, slot, &client_id);
                }
                Output::Close {
                    reason,
                    publish_will,
                } => {
                    // Its DISCONNECT follows the acknowledgements that
                    // wait for the store (DESIGN.md §7, `crate::connection`).
                    conn.request_close(reason, publish_will);
                    break;
                }
                // An acknowledgement freed room for queued messages.
                deliver @ Output::Deliver { .. } => deliveries.push(deliver),
            }
        }
        outputs.clear();
        st.outputs = outputs;
        if subscriptions_changed {
            // Its SUBACK or UNSUBACK waits for the record too, and for
            // the start of its session log's tail when it is new.
            self.save_session(st, slot, Some(&mut route_waits));
            self.log_start_wait(st, slot, &mut route_waits);
        }
        Self::log_touched(st, slot);
        if !route_waits.is_empty() {
            // The SUBACK waits for the routes (cluster mode).
            self.subscribed_after_routes(st, slot, route_waits);
        }
        if !acks.is_empty() {
            // After every output of the packet: the store covers them all.
            if let Some((client, conn)) = st.clients.get(slot as usize).and_then(|c| Some((c.key, c.conn.clone()?))) {
                self.store.acknowledge(&conn, &mut acks, since, Some(Answering { slot, client }));
            }
        }
        if !deliveries.is_empty() {
            self.write_deliveries(st, slot, &mut deliveries, now, false);
        }
        reach
    }

    pub(super) fn subscribe(
        &self,
        st: &mut State,
        slot: Slot,
        filter: ByteString,
        subscription: Subscription,
        existed: bool,
    ) {
        if !st.trie.has_filter(&filter) {
            self.route_change(st, &filter, true);
        }
        st.trie
            .insert(&filter, Subscriber::Session(slot), subscription);
        let send_retained = match subscription.options.retain_handling {
            RetainHandling::SendAtSubscribe => true,
            RetainHandling::SendIfNew => !existed,
            RetainHandling::DoNotSend => false,
        };
        if send_retained {
            self.start_feed(st, slot, filter, subscription);
        }
    }
}

/// The packet identifier and recorded message ID of the flow another
/// replica opened (taken up, `Client::reopened`) that `packet`, a QoS 2
/// PUBLISH sent again, belongs to. That replica recorded the flow before
/// it stored the value and may have died before the store landed: the
/// value is appended again under the same ID, which JetStream drops when
/// the first append landed (and then it is not handed on again either).
/// Once per flow: later copies are duplicates as usual `[MQTT-4.3.3-10]`.
/// A PUBREL ends it too (its PUBREC came, so the value was stored).
fn take_reopened(client: &mut Client, packet: &Packet) -> Option<(u16, Box<str>)> {
    let reopened = client.reopened.as_mut()?;
    let (packet_id, republished) = match packet {
        Packet::Publish(p) if p.qos == QoS::ExactlyOnce => (p.packet_id?.get(), true),
        Packet::PubRel(rel) => (rel.packet_id.get(), false),
        _ => return None,
    };
    let id = reopened.remove(&packet_id);
    if reopened.is_empty() {
        client.reopened = None;
    }
    id.filter(|_| republished).map(|id| (packet_id, id))
}
