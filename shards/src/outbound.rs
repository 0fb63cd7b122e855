//! Encoding deliveries: a PUBLISH is encoded once per distinct variant
//! (protocol family, QoS, RETAIN flag) per dispatch, then copied into each
//! subscriber's write buffer with its own packet identifier and DUP flag
//! patched in (DESIGN.md §3).

use std::num::NonZeroU16;
use std::time::Instant;

use bytes::{BufMut, Bytes, BytesMut};
use fleetmq_core::packet::codec::encode;
use fleetmq_core::packet::{Packet, PacketId, Props, ProtocolVersion, Publish, QoS};
use fleetmq_core::session::Delivery;

/// An encoded PUBLISH and where its packet identifier sits (QoS > 0).
#[derive(Clone)]
pub(crate) struct Frame {
    bytes: Bytes,
    packet_id_at: Option<usize>,
}

impl Frame {
    /// Encoded length in bytes, for the client's Maximum Packet Size check.
    pub(crate) fn len(&self) -> usize {
        self.bytes.len()
    }

    /// Append to `out` with `packet_id` and `dup` patched in.
    pub(crate) fn append_to(&self, packet_id: Option<PacketId>, dup: bool, out: &mut BytesMut) {
        let start = out.len();
        out.put_slice(&self.bytes);
        if dup {
            out[start] |= 0x08;
        }
        if let (Some(at), Some(pid)) = (self.packet_id_at, packet_id) {
            out[start + at..start + at + 2].copy_from_slice(&pid.get().to_be_bytes());
        }
    }
}

/// Frames already encoded for one message during one dispatch, by variant.
/// Subscription Identifiers make a delivery unique, so those are never
/// cached.
#[derive(Default)]
pub(crate) struct FrameCache {
    frames: [Option<Frame>; 12],
}

impl FrameCache {
    /// Forget every frame (before the next message).
    pub(crate) fn clear(&mut self) {
        self.frames = Default::default();
    }
}

/// The frame for `delivery` sent over `protocol`, from `cache` when one is
/// given and holds it. `alias` is the Topic Alias to send, and whether the
/// topic goes with it (MQTT 5 §3.3.2.3.4); a frame with an alias is never
/// cached. The first `strip` bytes of the topic (the subscriber's workspace
/// prefix) are not sent; one message only reaches one workspace, so the
/// cache holds frames of one `strip`.
pub(crate) fn frame_for(
    delivery: &Delivery,
    protocol: ProtocolVersion,
    now: Instant,
    alias: Option<(u16, bool)>,
    strip: usize,
    cache: Option<&mut FrameCache>,
) -> Frame {
    if alias.is_some() {
        return encode_frame(delivery, protocol, now, alias, strip);
    }
    let cacheable = delivery.subscription_ids.is_empty();
    let slot = usize::from(protocol.is_v5()) * 6 + (delivery.qos as usize) * 2 + usize::from(delivery.retain);
    match cache {
        Some(cache) if cacheable => {
            cache.frames[slot].get_or_insert_with(|| encode_frame(delivery, protocol, now, None, strip)).clone()
        }
        _ => encode_frame(delivery, protocol, now, None, strip),
    }
}

fn encode_frame(delivery: &Delivery, protocol: ProtocolVersion, now: Instant, alias: Option<(u16, bool)>, strip: usize) -> Frame {
    let message = &delivery.message;
    let plain = alias.is_none()
        && (!protocol.is_v5() || (delivery.subscription_ids.is_empty() && message.properties.is_empty()));
    if plain {
        return encode_plain(&message.topic[strip..], delivery.qos, delivery.retain, protocol.is_v5(), &message.payload);
    }
    let properties = if protocol.is_v5() {
        let mut p: Props = message.properties.clone();
        // The forwarded Message Expiry Interval is what is left of it
        // (MQTT 5 §3.3.2.3.3, `[MQTT-3.3.2-6]`).
        p.message_expiry_interval = message.expiry_left(now).map(|left| left.max(1));
        p.subscription_identifiers.clone_from(&delivery.subscription_ids);
        p.topic_alias = alias.map(|(a, _)| a);
        p
    } else {
        Props::default()
    };
    let packet_id = (delivery.qos != QoS::AtMostOnce).then_some(NonZeroU16::MIN);
    let topic = match alias {
        Some((_, false)) => bytestring::ByteString::new(),
        _ if strip > 0 => message.topic.slice_ref(&message.topic[strip..]),
        _ => message.topic.clone(),
    };
    let topic_len = topic.len();
    let publish = Publish {
        dup: false,
        qos: delivery.qos,
        retain: delivery.retain,
        topic,
        packet_id,
        properties,
        payload: message.payload.clone(),
    };
    let mut buf = BytesMut::new();
    encode(&Packet::Publish(publish), protocol, &mut buf).expect("a routed message always fits a PUBLISH");
    let packet_id_at = packet_id.map(|_| {
        // Fixed header byte, Remaining Length (1–4 bytes), topic (2 + len).
        let varint_len = buf[1..].iter().position(|b| b & 0x80 == 0).unwrap_or(3) + 1;
        1 + varint_len + 2 + topic_len
    });
    Frame { bytes: buf.freeze(), packet_id_at }
}

/// A PUBLISH with no properties (every 3.1.x one, and MQTT 5 ones whose
/// message carries none), written directly: the common case, without the
/// general encoder's property handling. Packet identifier 1 is a
/// placeholder patched per subscriber.
fn encode_plain(topic: &str, qos: QoS, retain: bool, v5: bool, payload: &[u8]) -> Frame {
    let has_id = qos != QoS::AtMostOnce;
    let remaining = 2 + topic.len() + if has_id { 2 } else { 0 } + usize::from(v5) + payload.len();
    let mut buf = BytesMut::with_capacity(5 + remaining);
    buf.put_u8(0x30 | (qos as u8) << 1 | u8::from(retain));
    let mut n = remaining;
    loop {
        let byte = (n % 128) as u8;
        n /= 128;
        if n == 0 {
            buf.put_u8(byte);
            break;
        }
        buf.put_u8(byte | 0x80);
    }
    let header_len = buf.len();
    buf.put_u16(topic.len() as u16);
    buf.put_slice(topic.as_bytes());
    if has_id {
        buf.put_u16(1);
    }
    if v5 {
        buf.put_u8(0);
    }
    buf.put_slice(payload);
    Frame { bytes: buf.freeze(), packet_id_at: has_id.then_some(header_len + 2 + topic.len()) }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use bytes::Bytes;
    use fleetmq_core::packet::codec::decode;
    use fleetmq_core::packet::Properties;
    use fleetmq_core::session::Message;

    use super::*;

    fn delivery(qos: QoS, retain: bool, properties: Properties, payload: usize) -> Delivery {
        Delivery {
            message: Arc::new(Message {
                topic: "ws/a/b".into(),
                payload: Bytes::from(vec![7u8; payload]),
                qos,
                retain,
                properties: properties.into(),
                received_at: Instant::now(),
                origin: 1,
                stored: 0,
                from_mesh: false,
                groups: fleetmq_core::session::GroupPick::ALL,
            }),
            qos,
            retain,
            subscription_ids: vec![],
            group: None,
        }
    }

    #[test]
    fn plain_and_general_encodings_decode_to_the_same_publish() {
        let now = Instant::now();
        for protocol in [ProtocolVersion::V3_1_1, ProtocolVersion::V5] {
            for qos in [QoS::AtMostOnce, QoS::AtLeastOnce, QoS::ExactlyOnce] {
                for payload in [0, 10, 200, 20_000] {
                    let d = delivery(qos, true, Properties::default(), payload);
                    let frame = frame_for(&d, protocol, now, None, 3, None);
                    let mut out = BytesMut::new();
                    frame.append_to(NonZeroU16::new(0x1234), qos != QoS::AtMostOnce, &mut out);
                    let Some(Packet::Publish(p)) = decode(&mut out, Some(protocol), 1 << 20).unwrap() else { panic!() };
                    assert_eq!(&*p.topic, "a/b", "workspace prefix stripped");
                    assert_eq!((p.qos, p.retain, p.payload.len()), (qos, true, payload));
                    assert_eq!(p.packet_id, (qos != QoS::AtMostOnce).then(|| NonZeroU16::new(0x1234).unwrap()));
                    assert_eq!(p.dup, qos != QoS::AtMostOnce);
                    assert!(out.is_empty());
                }
            }
        }
    }

    #[test]
    fn properties_force_the_general_encoder_and_survive() {
        let props = Properties { content_type: Some("text/plain".into()), ..Properties::default() };
        let d = delivery(QoS::AtLeastOnce, false, props, 5);
        let frame = frame_for(&d, ProtocolVersion::V5, Instant::now(), None, 0, None);
        let mut out = BytesMut::new();
        frame.append_to(NonZeroU16::new(9), false, &mut out);
        let Some(Packet::Publish(p)) = decode(&mut out, Some(ProtocolVersion::V5), 1 << 20).unwrap() else { panic!() };
        assert_eq!(p.properties.content_type.as_deref(), Some("text/plain"));
        assert_eq!(p.packet_id, NonZeroU16::new(9));
    }
}
