//! Encoding deliveries: a PUBLISH is encoded once per distinct variant
//! (protocol family, QoS, RETAIN flag) per dispatch, then copied into each
//! subscriber's write buffer with its own packet identifier and DUP flag
//! patched in (DESIGN.md §3).

use std::num::NonZeroU16;
use std::time::Instant;

use bytes::{BufMut, Bytes, BytesMut};
use fleetmq_core::packet::codec::encode;
use fleetmq_core::packet::{Packet, PacketId, Properties, ProtocolVersion, Publish, QoS};
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
    let properties = if protocol.is_v5() {
        let mut p: Properties = message.properties.clone();
        // The forwarded Message Expiry Interval is what is left of it
        // (MQTT 5 §3.3.2.3.3, `[MQTT-3.3.2-6]`).
        p.message_expiry_interval = message.expiry_left(now).map(|left| left.max(1));
        p.subscription_identifiers.clone_from(&delivery.subscription_ids);
        p.topic_alias = alias.map(|(a, _)| a);
        p
    } else {
        Properties::default()
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
