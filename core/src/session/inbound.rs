//! What a session does with each packet from its client
//! ([`Session::handle`]): PUBLISH in its three QoS flows, the PUBACK,
//! PUBREC, PUBREL and PUBCOMP of its deliveries, SUBSCRIBE, UNSUBSCRIBE,
//! PINGREQ and DISCONNECT, each answered through [`Output`]s.

use super::*;

impl Session {
    /// Handle one packet from the client. Outputs go to `out`, in order.
    pub fn handle(&mut self, packet: Packet, now: Instant, out: &mut Vec<Output>) {
        let v5 = self.protocol.is_v5();
        match packet {
            Packet::Publish(publish) => self.handle_publish(publish, now, out),
            Packet::PubAck(ack) => {
                self.complete(ack.packet_id.get(), InflightState::AwaitPubAck, now, out);
            }
            Packet::PubRec(rec) => {
                let pid = rec.packet_id.get();
                match self.fl().inflight.get_mut(&pid) {
                    Some(entry) if entry.state == InflightState::AwaitPubRec => {
                        if rec.reason.is_error() {
                            // The flow ends at an error PUBREC (MQTT 5 §4.3.3).
                            self.complete(pid, InflightState::AwaitPubRec, now, out);
                        } else {
                            entry.state = InflightState::AwaitPubComp;
                            let stored = entry.delivery.message.stored;
                            let rel = Packet::PubRel(PubResponse::success(rec.packet_id));
                            if self.logged && stored != 0 {
                                let change = SessionChange::Outbound { value: stored, packet_id: pid, released: true };
                                out.push(Output::Log(change));
                                out.push(Output::Acknowledge(rel));
                            } else {
                                out.push(Output::Send(rel));
                            }
                        }
                    }
                    Some(entry) if entry.state == InflightState::AwaitPubComp => {
                        out.push(Output::Send(Packet::PubRel(PubResponse::success(rec.packet_id))));
                    }
                    _ => {
                        let reason = if v5 { ReasonCode::PACKET_IDENTIFIER_NOT_FOUND } else { ReasonCode::SUCCESS };
                        out.push(Output::Send(Packet::PubRel(PubResponse {
                            packet_id: rec.packet_id,
                            reason,
                            properties: Props::default(),
                        })));
                    }
                }
            }
            Packet::PubComp(comp) => {
                self.complete(comp.packet_id.get(), InflightState::AwaitPubComp, now, out);
            }
            Packet::PubRel(rel) => {
                // [MQTT-4.3.3-12]: answer PUBCOMP; the message was forwarded
                // at PUBLISH time, so forget the packet identifier.
                let known = self.fl().inbound_qos2.remove(&rel.packet_id.get());
                if known && self.logged {
                    let change = SessionChange::InboundQos2 { packet_id: rel.packet_id.get(), open: false };
                    out.push(Output::Log(change));
                }
                let reason = if known || !v5 { ReasonCode::SUCCESS } else { ReasonCode::PACKET_IDENTIFIER_NOT_FOUND };
                // After the release is logged: a client that reuses the
                // identifier after PUBCOMP must find it free.
                out.push(Output::Acknowledge(Packet::PubComp(PubResponse {
                    packet_id: rel.packet_id,
                    reason,
                    properties: Props::default(),
                })));
            }
            Packet::Subscribe(subscribe) => self.handle_subscribe(subscribe, out),
            Packet::Unsubscribe(unsubscribe) => self.handle_unsubscribe(unsubscribe, out),
            Packet::PingReq => out.push(Output::Send(Packet::PingResp)),
            Packet::Disconnect(disconnect) => self.handle_disconnect(disconnect, out),
            Packet::Connect(_) => {
                // [MQTT-3.1.0-2]: a second CONNECT is a Protocol Error.
                self.protocol_error(out);
            }
            Packet::Auth(_) => {
                // No Authentication Method was agreed in CONNECT, so AUTH is
                // a Protocol Error (MQTT 5 §4.12).
                self.protocol_error(out);
            }
            Packet::ConnAck(_) | Packet::SubAck(_) | Packet::UnsubAck(_) | Packet::PingResp => {
                // Server-to-client packets sent by a client.
                self.protocol_error(out);
            }
        }
    }

    pub(super) fn protocol_error(&self, out: &mut Vec<Output>) {
        self.close_with(ReasonCode::PROTOCOL_ERROR, out);
    }

    pub(super) fn close_with(&self, reason: ReasonCode, out: &mut Vec<Output>) {
        let reason = self.protocol.is_v5().then_some(reason);
        out.push(Output::Close { reason, publish_will: true });
    }

    pub(super) fn handle_publish(&mut self, mut publish: Publish, now: Instant, out: &mut Vec<Output>) {
        let v5 = self.protocol.is_v5();
        if let Some(alias) = publish.properties.topic_alias {
            // 0 or above our Topic Alias Maximum: 0x94 `[MQTT-3.3.2-8]`,
            // `[MQTT-3.3.2-9]`.
            if alias == 0 || alias > self.limits.topic_alias_maximum {
                self.close_with(ReasonCode::TOPIC_ALIAS_INVALID, out);
                return;
            }
            if publish.topic.is_empty() {
                match self.aliases.as_ref().and_then(|a| a.inbound.get(&alias)) {
                    Some(topic) => publish.topic = topic.clone(),
                    None => {
                        // An alias never set, with no topic: Protocol Error
                        // (MQTT 5 §3.3.4).
                        self.protocol_error(out);
                        return;
                    }
                }
            } else if validate_topic_name(&publish.topic, &self.limits.topic).is_ok() {
                self.aliases.get_or_insert_with(Default::default).inbound.insert(alias, publish.topic.clone());
            }
        } else if v5 && publish.topic.is_empty() {
            // No topic and no alias `[MQTT-3.3.2-1]`: Protocol Error.
            self.protocol_error(out);
            return;
        }
        if validate_topic_name(&publish.topic, &self.limits.topic).is_err() {
            // MQTT 5: DISCONNECT 0x90; 3.1.1: close `[MQTT-3.3.2-2]`.
            self.close_with(ReasonCode::TOPIC_NAME_INVALID, out);
            return;
        }
        if let Some(response_topic) = &publish.properties.response_topic {
            // A Response Topic is a topic name: no wildcards `[MQTT-3.3.2-14]`.
            if validate_topic_name(response_topic, &self.limits.topic).is_err() {
                self.protocol_error(out);
                return;
            }
        }
        if v5 && !publish.properties.subscription_identifiers.is_empty() {
            // A PUBLISH from a client must not carry one `[MQTT-3.3.4-6]`.
            self.protocol_error(out);
            return;
        }
        let format_invalid = publish.properties.payload_format_indicator == Some(1)
            && std::str::from_utf8(&publish.payload).is_err();
        let denied = !client_may_publish(self.access.as_ref().map(|a| &*a.authorizer), &publish.topic);
        // Refused publishes get a reason code on MQTT 5; 3.1.1 has none, so
        // the message is acknowledged and dropped, as Mosquitto does.
        let refused = self.store_refusing && publish.qos != QoS::AtMostOnce;
        let ack_reason = match (v5, denied, format_invalid) {
            (true, true, _) => ReasonCode::NOT_AUTHORIZED,
            (true, false, true) => ReasonCode::PAYLOAD_FORMAT_INVALID,
            (true, false, false) if refused => ReasonCode::QUOTA_EXCEEDED,
            _ => ReasonCode::SUCCESS,
        };
        let forward = !denied && (!v5 || !format_invalid) && !refused;
        if denied {
            self.dropped().not_authorized += 1;
        }
        if !self.namespace.is_empty() {
            publish.topic = ByteString::from(format!("{}{}", self.namespace, publish.topic));
        }
        match publish.qos {
            QoS::AtMostOnce => {
                if forward {
                    out.push(Output::Publish(into_message(publish, now)));
                }
            }
            QoS::AtLeastOnce => {
                let packet_id = publish.packet_id.expect("decoder guarantees a packet id at QoS 1");
                if forward {
                    out.push(Output::Publish(into_message(publish, now)));
                }
                out.push(Output::Acknowledge(Packet::PubAck(PubResponse {
                    packet_id,
                    reason: ack_reason,
                    properties: Props::default(),
                })));
            }
            QoS::ExactlyOnce => {
                let packet_id = publish.packet_id.expect("decoder guarantees a packet id at QoS 2");
                let pid = packet_id.get();
                if !self.fl().inbound_qos2.contains(&pid) {
                    if ack_reason.is_error() || refused {
                        // The flow ends at an error PUBREC: nothing to keep.
                    } else {
                        // `[MQTT-3.3.4-9]`: beyond the Receive Maximum we
                        // announced in CONNACK. MQTT 3.1/3.1.1 has none (a
                        // client is told no limit and may keep every packet
                        // identifier open, so at most 65,535 here): closing
                        // it for a limit it never heard of made a client that
                        // sends its whole backlog at a reconnect (paho-mqtt
                        // does) reconnect and send it again, for ever, each
                        // round's values forwarded again when its session
                        // was clean.
                        if v5 && self.fl().inbound_qos2.len() >= usize::from(self.limits.receive_maximum) {
                            self.close_with(ReasonCode::RECEIVE_MAXIMUM_EXCEEDED, out);
                            return;
                        }
                        self.fl().inbound_qos2.insert(pid);
                        if self.logged {
                            out.push(Output::Log(SessionChange::InboundQos2 { packet_id: pid, open: true }));
                        }
                        if forward {
                            out.push(Output::Publish(into_message(publish, now)));
                        }
                    }
                }
                // A resent PUBLISH with a packet id we hold is not forwarded
                // again `[MQTT-4.3.3-10]`; PUBREC again either way.
                out.push(Output::Acknowledge(Packet::PubRec(PubResponse {
                    packet_id,
                    reason: ack_reason,
                    properties: Props::default(),
                })));
            }
        }
    }

    pub(super) fn handle_subscribe(&mut self, subscribe: Subscribe, out: &mut Vec<Output>) {
        let v5 = self.protocol.is_v5();
        let identifier = subscribe.properties.subscription_identifiers.first().copied();
        let mut reasons = Vec::with_capacity(subscribe.filters.len());
        let mut changes = Vec::with_capacity(subscribe.filters.len());
        for (filter, options) in subscribe.filters {
            let valid = validate_topic_filter(&filter, &self.limits.topic);
            let reason = if let Err(error) = valid {
                if !v5 && violates_3_1_1(&error, &filter) {
                    // A filter the spec forbids is a protocol violation,
                    // which closes a 3.1.1 connection (3.1.1 §4.8); one
                    // over the broker's limits, or a malformed `$share`
                    // (a legal 3.1.1 filter), gets SUBACK 0x80.
                    self.close_with(ReasonCode::TOPIC_FILTER_INVALID, out);
                    return;
                }
                if v5 { ReasonCode::TOPIC_FILTER_INVALID } else { ReasonCode::UNSPECIFIED_ERROR }
            } else if parse_shared(&filter).is_some() && options.no_local {
                // No Local on a shared subscription `[MQTT-3.8.3-4]`.
                self.protocol_error(out);
                return;
            } else if self.access.as_ref().is_some_and(|a| !a.authorizer.may_subscribe(&filter)) {
                if v5 { ReasonCode::NOT_AUTHORIZED } else { ReasonCode::UNSPECIFIED_ERROR }
            } else if !self.subscriptions.contains_key(&internal_filter(&self.namespace, &filter))
                && self.subscriptions.len() >= self.limits.max_subscriptions
            {
                if v5 { ReasonCode::QUOTA_EXCEEDED } else { ReasonCode::UNSPECIFIED_ERROR }
            } else {
                let filter = internal_filter(&self.namespace, &filter);
                let subscription = Subscription { options, identifier };
                let existed = self.subscriptions.insert(filter.clone(), subscription).is_some();
                changes.push(Output::Subscribed { filter, subscription, existed });
                ReasonCode(options.qos as u8)
            };
            reasons.push(reason);
        }
        out.push(Output::Acknowledge(Packet::SubAck(SubAck {
            packet_id: subscribe.packet_id,
            properties: Props::default(),
            reasons,
        })));
        out.extend(changes);
    }

    pub(super) fn handle_unsubscribe(&mut self, unsubscribe: Unsubscribe, out: &mut Vec<Output>) {
        let v5 = self.protocol.is_v5();
        let mut reasons = Vec::with_capacity(if v5 { unsubscribe.filters.len() } else { 0 });
        let mut changes = Vec::with_capacity(unsubscribe.filters.len());
        let forbidden =
            |filter: &ByteString| validate_topic_filter(filter, &self.limits.topic).is_err_and(|error| violates_3_1_1(&error, filter));
        if !v5 && unsubscribe.filters.iter().any(forbidden) {
            // A filter the spec forbids `[MQTT-4.7.1-2]` is a protocol
            // violation, which closes a 3.1.1 connection (3.1.1 §4.8), as
            // in SUBSCRIBE; checked first, so nothing is unsubscribed.
            self.close_with(ReasonCode::TOPIC_FILTER_INVALID, out);
            return;
        }
        for filter in unsubscribe.filters {
            if validate_topic_filter(&filter, &self.limits.topic).is_err() {
                // No subscription can have it: v5 says why (0x8F).
                if v5 {
                    reasons.push(ReasonCode::TOPIC_FILTER_INVALID);
                }
                continue;
            }
            let filter = internal_filter(&self.namespace, &filter);
            let existed = self.subscriptions.remove(&filter).is_some();
            if v5 {
                reasons.push(if existed { ReasonCode::SUCCESS } else { ReasonCode::NO_SUBSCRIPTION_EXISTED });
            }
            if existed {
                changes.push(Output::Unsubscribed { filter });
            }
        }
        // Unsubscribe first, then UNSUBACK `[MQTT-3.10.4-4]`.
        out.extend(changes);
        out.push(Output::Acknowledge(Packet::UnsubAck(UnsubAck {
            packet_id: unsubscribe.packet_id,
            properties: Props::default(),
            reasons,
        })));
    }

    pub(super) fn handle_disconnect(&mut self, disconnect: Disconnect, out: &mut Vec<Output>) {
        if let Some(expiry) = disconnect.properties.session_expiry_interval {
            if self.session_expiry == 0 && expiry != 0 {
                // `[MQTT-3.14.2-2]`: 0 at CONNECT cannot become non-zero.
                self.protocol_error(out);
                return;
            }
            self.session_expiry = expiry;
        }
        // A normal DISCONNECT discards the will `[MQTT-3.14.4-3]`; 0x04 asks
        // for it (MQTT 5 §3.14.2.1).
        let publish_will = disconnect.reason == ReasonCode::DISCONNECT_WITH_WILL;
        out.push(Output::Close { reason: None, publish_will });
    }
}

/// Turn a client's PUBLISH into the message the broker routes: the Topic
/// Alias and Subscription Identifiers are not forwarded (MQTT 5 §3.3.4).
pub(super) fn into_message(publish: Publish, now: Instant) -> Message {
    let mut properties = publish.properties;
    // Only through `DerefMut` when there is something to clear: that
    // would allocate empty properties (see `Props`).
    if properties.topic_alias.is_some() || !properties.subscription_identifiers.is_empty() {
        properties.topic_alias = None;
        properties.subscription_identifiers.clear();
    }
    Message {
        topic: publish.topic,
        payload: publish.payload,
        qos: publish.qos,
        retain: publish.retain,
        properties,
        received_at: now,
        origin: 0,
        stored: 0,
        from_mesh: false,
        groups: GroupPick::ALL,
    }
}
