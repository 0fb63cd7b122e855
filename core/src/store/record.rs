//! The records of the local store's log, and their binary form (one
//! record is one frame body, see [`super::frame`]).
//!
//! Every record starts with its kind (one byte) and its log sequence
//! number (`lsn`, u64 LE): the node-wide order in which the shards wrote
//! them, which recovery follows across the shards' logs. Integers are
//! little-endian; strings and byte strings carry a u32 length. Times are
//! wall-clock milliseconds since the Unix epoch, so they mean the same
//! after a restart (notes/cluster-seams.md, trap 2).
//!
//! Format version [`FORMAT_VERSION`]: a reader refuses a segment whose
//! [`Record::Header`] names a version it does not know.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use bytestring::ByteString;

use crate::packet::codec::{decode_publish_properties, encode_publish_properties};
use crate::packet::{Props, QoS, RetainHandling, SubscriptionOptions};
use crate::session::Subscription;

/// The record format this build writes and reads.
pub const FORMAT_VERSION: u16 = 1;

/// A value (an application message) as the store keeps it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredMessage {
    /// Topic name as the broker keeps it (with its workspace prefix).
    pub topic: ByteString,
    /// Payload.
    pub payload: Bytes,
    /// QoS it was published with.
    pub qos: QoS,
    /// RETAIN flag it was published with.
    pub retain: bool,
    /// Properties forwarded to subscribers (see `session::Message`).
    pub properties: Props,
    /// When the broker received it, Unix milliseconds; the Message Expiry
    /// Interval counts from here.
    pub received_ms: u64,
    /// The publisher's `client_key` (No Local), `u64::MAX` for the broker.
    pub origin: u64,
}

impl StoredMessage {
    /// True once its Message Expiry Interval ran out at `now_ms`.
    pub fn expired(&self, now_ms: u64) -> bool {
        self.properties.message_expiry_interval.is_some_and(|secs| {
            self.received_ms.saturating_add(u64::from(secs) * 1000) <= now_ms
        })
    }
}

/// One record of the log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Record {
    /// First record of every segment.
    Header {
        /// Record format version ([`FORMAT_VERSION`]).
        version: u16,
        /// The shard whose log this is.
        shard: u16,
        /// The segment's number in that log.
        segment: u64,
    },
    /// A QoS 1/2 or retained value, logged once however many sessions
    /// want it. A retained value with an empty payload deletes the topic's
    /// retained message `[MQTT-3.3.1-6]`.
    Value(StoredMessage),
    /// A persistent session exists (created or resumed) with these
    /// parameters; it is online from here until [`Record::Offline`].
    Session {
        /// Client identifier.
        client_id: ByteString,
        /// User name of the identity that holds it.
        username: Option<ByteString>,
        /// Workspace of that identity.
        workspace: ByteString,
        /// Session Expiry Interval, seconds (> 0).
        expiry: u32,
        /// Protocol level of its last connection (3, 4 or 5).
        protocol: u8,
    },
    /// The session ended (Clean Start, expiry, Session Expiry Interval 0
    /// at DISCONNECT): forget everything about it.
    SessionEnd {
        /// Client identifier.
        client_id: ByteString,
    },
    /// The session's connection went away at `at_ms`.
    Offline {
        /// Client identifier.
        client_id: ByteString,
        /// Unix milliseconds; the Session Expiry Interval counts from here.
        at_ms: u64,
        /// Session Expiry Interval in force (a DISCONNECT may change it),
        /// seconds.
        expiry: u32,
    },
    /// A subscription added or replaced.
    Subscribe {
        /// Client identifier.
        client_id: ByteString,
        /// Topic filter as the broker keeps it.
        filter: ByteString,
        /// Options and identifier.
        subscription: Subscription,
    },
    /// A subscription removed.
    Unsubscribe {
        /// Client identifier.
        client_id: ByteString,
        /// Topic filter as the broker keeps it.
        filter: ByteString,
    },
    /// The session is done with the value of log sequence `value`: the
    /// client acknowledged it (PUBACK, PUBCOMP), or it was dropped.
    Done {
        /// Client identifier.
        client_id: ByteString,
        /// The value's log sequence number.
        value: u64,
    },
    /// In a snapshot: the session still has to deliver the value of log
    /// sequence `value` at `qos` (written after the value and the session).
    Queued {
        /// Client identifier.
        client_id: ByteString,
        /// The value's log sequence number.
        value: u64,
        /// QoS of the delivery (1 or 2).
        qos: QoS,
    },
    /// An inbound QoS 2 packet identifier was opened (PUBLISH stored,
    /// before PUBREC) or released (PUBREL, before PUBCOMP).
    InboundQos2 {
        /// Client identifier.
        client_id: ByteString,
        /// The packet identifier.
        packet_id: u16,
        /// Opened (true) or released.
        open: bool,
    },
    /// The session sent the value of log sequence `value` with
    /// `packet_id` (`released` false: before the PUBLISH is written), or
    /// got its PUBREC and sends PUBREL (`released` true: before the
    /// PUBREL is written), so a restart resends the PUBLISH with the same
    /// identifier and DUP `[MQTT-4.4.0-1]`, or the PUBREL and never the
    /// PUBLISH again `[MQTT-4.3.3-6]`. [`Record::Done`] ends it.
    Outbound {
        /// Client identifier.
        client_id: ByteString,
        /// The value's log sequence number.
        value: u64,
        /// The packet identifier it was sent with.
        packet_id: u16,
        /// PUBREC received, PUBREL sent.
        released: bool,
    },
    /// A connection with a Will Message is open (logged before its
    /// CONNACK); it replaces the client's earlier will.
    Will {
        /// Client identifier.
        client_id: ByteString,
        /// The Will Message as it will be published (`origin`: the
        /// broker; `received_ms`: when the connection was accepted).
        message: StoredMessage,
        /// Will Delay Interval, seconds.
        delay: u32,
        /// Session Expiry Interval of the connection, seconds: the will is
        /// sent at the latest when the session ends `[MQTT-3.1.3-9]`.
        expiry: u32,
    },
    /// The connection with the client's will ended abnormally; the will is
    /// due at `due_ms` (Unix milliseconds) unless the client is back first.
    WillDue {
        /// Client identifier.
        client_id: ByteString,
        /// Unix milliseconds.
        due_ms: u64,
    },
    /// The client's will is gone: discarded (DISCONNECT 0x00, the client
    /// back within the delay) or published.
    WillEnd {
        /// Client identifier.
        client_id: ByteString,
    },
}

/// Why a record body could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RecordError {
    /// Shorter than its fields.
    #[error("record shorter than its fields")]
    Truncated,
    /// Bytes after the last field.
    #[error("bytes after the record's last field")]
    Trailing,
    /// A kind this build does not know.
    #[error("unknown record kind {0}")]
    UnknownKind(u8),
    /// A field out of its range (QoS 3, a string that is not UTF-8, ...).
    #[error("invalid field: {0}")]
    Invalid(&'static str),
}

mod kind {
    pub(super) const HEADER: u8 = 0;
    pub(super) const VALUE: u8 = 1;
    pub(super) const SESSION: u8 = 2;
    pub(super) const SESSION_END: u8 = 3;
    pub(super) const OFFLINE: u8 = 4;
    pub(super) const SUBSCRIBE: u8 = 5;
    pub(super) const UNSUBSCRIBE: u8 = 6;
    pub(super) const DONE: u8 = 7;
    pub(super) const INBOUND_QOS2: u8 = 8;
    pub(super) const QUEUED: u8 = 9;
    pub(super) const OUTBOUND: u8 = 10;
    pub(super) const WILL: u8 = 11;
    pub(super) const WILL_DUE: u8 = 12;
    pub(super) const WILL_END: u8 = 13;
}

fn put_str(out: &mut BytesMut, s: &[u8]) {
    out.put_u32_le(s.len() as u32);
    out.put_slice(s);
}

fn put_message(out: &mut BytesMut, m: &StoredMessage) {
    put_str(out, m.topic.as_bytes());
    out.put_u8(m.qos as u8 | u8::from(m.retain) << 2);
    out.put_u64_le(m.received_ms);
    out.put_u64_le(m.origin);
    // Properties the broker accepted always encode.
    let _ = encode_publish_properties(&m.properties, out);
    put_str(out, &m.payload);
}

fn options_byte(o: &SubscriptionOptions) -> u8 {
    o.qos as u8 | u8::from(o.no_local) << 2 | u8::from(o.retain_as_published) << 3 | (o.retain_handling as u8) << 4
}

impl Record {
    /// Append the body of this record with log sequence `lsn` to `out`.
    pub fn encode(&self, lsn: u64, out: &mut BytesMut) {
        let start = out.len();
        out.put_u8(0);
        out.put_u64_le(lsn);
        let kind = match self {
            Record::Header { version, shard, segment } => {
                out.put_u16_le(*version);
                out.put_u16_le(*shard);
                out.put_u64_le(*segment);
                kind::HEADER
            }
            Record::Value(m) => {
                put_message(out, m);
                kind::VALUE
            }
            Record::Session { client_id, username, workspace, expiry, protocol } => {
                put_str(out, client_id.as_bytes());
                out.put_u8(u8::from(username.is_some()));
                put_str(out, username.as_ref().map_or(&b""[..], |u| u.as_bytes()));
                put_str(out, workspace.as_bytes());
                out.put_u32_le(*expiry);
                out.put_u8(*protocol);
                kind::SESSION
            }
            Record::SessionEnd { client_id } => {
                put_str(out, client_id.as_bytes());
                kind::SESSION_END
            }
            Record::Offline { client_id, at_ms, expiry } => {
                put_str(out, client_id.as_bytes());
                out.put_u64_le(*at_ms);
                out.put_u32_le(*expiry);
                kind::OFFLINE
            }
            Record::Subscribe { client_id, filter, subscription } => {
                put_str(out, client_id.as_bytes());
                put_str(out, filter.as_bytes());
                out.put_u8(options_byte(&subscription.options));
                out.put_u32_le(subscription.identifier.unwrap_or(0));
                kind::SUBSCRIBE
            }
            Record::Unsubscribe { client_id, filter } => {
                put_str(out, client_id.as_bytes());
                put_str(out, filter.as_bytes());
                kind::UNSUBSCRIBE
            }
            Record::Done { client_id, value } => {
                put_str(out, client_id.as_bytes());
                out.put_u64_le(*value);
                kind::DONE
            }
            Record::Queued { client_id, value, qos } => {
                put_str(out, client_id.as_bytes());
                out.put_u64_le(*value);
                out.put_u8(*qos as u8);
                kind::QUEUED
            }
            Record::InboundQos2 { client_id, packet_id, open } => {
                put_str(out, client_id.as_bytes());
                out.put_u16_le(*packet_id);
                out.put_u8(u8::from(*open));
                kind::INBOUND_QOS2
            }
            Record::Outbound { client_id, value, packet_id, released } => {
                put_str(out, client_id.as_bytes());
                out.put_u64_le(*value);
                out.put_u16_le(*packet_id);
                out.put_u8(u8::from(*released));
                kind::OUTBOUND
            }
            Record::Will { client_id, message, delay, expiry } => {
                put_str(out, client_id.as_bytes());
                out.put_u32_le(*delay);
                out.put_u32_le(*expiry);
                put_message(out, message);
                kind::WILL
            }
            Record::WillDue { client_id, due_ms } => {
                put_str(out, client_id.as_bytes());
                out.put_u64_le(*due_ms);
                kind::WILL_DUE
            }
            Record::WillEnd { client_id } => {
                put_str(out, client_id.as_bytes());
                kind::WILL_END
            }
        };
        out[start] = kind;
    }

    /// Read a record body: its log sequence number and the record. The
    /// strings and payload are slices of `body`.
    ///
    /// # Errors
    /// [`RecordError`] for a body this build did not write.
    pub fn decode(body: Bytes) -> Result<(u64, Record), RecordError> {
        let mut r = Reader(body);
        let kind = r.u8()?;
        let lsn = r.u64()?;
        let record = match kind {
            kind::HEADER => Record::Header { version: r.u16()?, shard: r.u16()?, segment: r.u64()? },
            kind::VALUE => Record::Value(r.message()?),
            kind::SESSION => {
                let client_id = r.string()?;
                let has_user = r.flag()?;
                let user = r.string()?;
                Record::Session {
                    client_id,
                    username: has_user.then_some(user),
                    workspace: r.string()?,
                    expiry: r.u32()?,
                    protocol: r.u8()?,
                }
            }
            kind::SESSION_END => Record::SessionEnd { client_id: r.string()? },
            kind::OFFLINE => Record::Offline { client_id: r.string()?, at_ms: r.u64()?, expiry: r.u32()? },
            kind::SUBSCRIBE => {
                let client_id = r.string()?;
                let filter = r.string()?;
                let options = r.options()?;
                let identifier = Some(r.u32()?).filter(|&i| i != 0);
                Record::Subscribe { client_id, filter, subscription: Subscription { options, identifier } }
            }
            kind::UNSUBSCRIBE => Record::Unsubscribe { client_id: r.string()?, filter: r.string()? },
            kind::DONE => Record::Done { client_id: r.string()?, value: r.u64()? },
            kind::INBOUND_QOS2 => Record::InboundQos2 { client_id: r.string()?, packet_id: r.u16()?, open: r.flag()? },
            kind::QUEUED => Record::Queued {
                client_id: r.string()?,
                value: r.u64()?,
                qos: QoS::from_u8(r.u8()?).ok_or(RecordError::Invalid("QoS 3"))?,
            },
            kind::OUTBOUND => {
                let client_id = r.string()?;
                let value = r.u64()?;
                let packet_id = r.u16()?;
                if packet_id == 0 {
                    return Err(RecordError::Invalid("packet identifier 0"));
                }
                Record::Outbound { client_id, value, packet_id, released: r.flag()? }
            }
            kind::WILL => {
                let client_id = r.string()?;
                let (delay, expiry) = (r.u32()?, r.u32()?);
                Record::Will { client_id, delay, expiry, message: r.message()? }
            }
            kind::WILL_DUE => Record::WillDue { client_id: r.string()?, due_ms: r.u64()? },
            kind::WILL_END => Record::WillEnd { client_id: r.string()? },
            other => return Err(RecordError::UnknownKind(other)),
        };
        if !r.0.is_empty() {
            return Err(RecordError::Trailing);
        }
        Ok((lsn, record))
    }
}

/// A cursor over a record body.
struct Reader(Bytes);

impl Reader {
    fn need(&self, n: usize) -> Result<(), RecordError> {
        if self.0.len() < n {
            Err(RecordError::Truncated)
        } else {
            Ok(())
        }
    }
    fn u8(&mut self) -> Result<u8, RecordError> {
        self.need(1)?;
        Ok(self.0.get_u8())
    }
    fn flag(&mut self) -> Result<bool, RecordError> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err(RecordError::Invalid("flag other than 0 or 1")),
        }
    }
    fn u16(&mut self) -> Result<u16, RecordError> {
        self.need(2)?;
        Ok(self.0.get_u16_le())
    }
    fn u32(&mut self) -> Result<u32, RecordError> {
        self.need(4)?;
        Ok(self.0.get_u32_le())
    }
    fn u64(&mut self) -> Result<u64, RecordError> {
        self.need(8)?;
        Ok(self.0.get_u64_le())
    }
    fn bytes(&mut self) -> Result<Bytes, RecordError> {
        let len = self.u32()? as usize;
        self.need(len)?;
        Ok(self.0.split_to(len))
    }
    fn string(&mut self) -> Result<ByteString, RecordError> {
        ByteString::try_from(self.bytes()?).map_err(|_| RecordError::Invalid("string that is not UTF-8"))
    }
    fn options(&mut self) -> Result<SubscriptionOptions, RecordError> {
        let b = self.u8()?;
        let retain_handling = match b >> 4 {
            0 => RetainHandling::SendAtSubscribe,
            1 => RetainHandling::SendIfNew,
            2 => RetainHandling::DoNotSend,
            _ => return Err(RecordError::Invalid("retain handling")),
        };
        Ok(SubscriptionOptions {
            qos: QoS::from_u8(b & 3).ok_or(RecordError::Invalid("QoS 3"))?,
            no_local: b & 4 != 0,
            retain_as_published: b & 8 != 0,
            retain_handling,
        })
    }
    fn message(&mut self) -> Result<StoredMessage, RecordError> {
        let topic = self.string()?;
        let flags = self.u8()?;
        if flags > 6 {
            return Err(RecordError::Invalid("message flags"));
        }
        let qos = QoS::from_u8(flags & 3).ok_or(RecordError::Invalid("QoS 3"))?;
        let received_ms = self.u64()?;
        let origin = self.u64()?;
        let (properties, rest) =
            decode_publish_properties(std::mem::take(&mut self.0)).map_err(|_| RecordError::Invalid("properties"))?;
        self.0 = rest;
        let payload = self.bytes()?;
        Ok(StoredMessage { topic, payload, qos, retain: flags & 4 != 0, properties, received_ms, origin })
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::packet::Properties;

    fn text() -> impl Strategy<Value = ByteString> {
        "[a-z/#+\u{0}é]{0,12}".prop_map(ByteString::from)
    }

    fn message() -> impl Strategy<Value = StoredMessage> {
        (text(), prop::collection::vec(any::<u8>(), 0..64), 0u8..3, any::<bool>(), any::<u64>(), any::<u64>(), prop::option::of(any::<u32>()))
            .prop_map(|(topic, payload, qos, retain, received_ms, origin, expiry)| {
                let properties = match expiry {
                    Some(secs) => Props::from(Properties { message_expiry_interval: Some(secs), ..Properties::default() }),
                    None => Props::default(),
                };
                StoredMessage { topic, payload: payload.into(), qos: QoS::from_u8(qos).unwrap(), retain, properties, received_ms, origin }
            })
    }

    fn record() -> impl Strategy<Value = Record> {
        let options = (0u8..3, any::<bool>(), any::<bool>(), 0u8..3, prop::option::of(1u32..268_435_455)).prop_map(
            |(qos, no_local, retain_as_published, rh, identifier)| Subscription {
                options: SubscriptionOptions {
                    qos: QoS::from_u8(qos).unwrap(),
                    no_local,
                    retain_as_published,
                    retain_handling: [RetainHandling::SendAtSubscribe, RetainHandling::SendIfNew, RetainHandling::DoNotSend][rh as usize],
                },
                identifier,
            },
        );
        prop_oneof![
            (any::<u16>(), any::<u16>(), any::<u64>()).prop_map(|(version, shard, segment)| Record::Header { version, shard, segment }),
            message().prop_map(Record::Value),
            (text(), prop::option::of(text()), text(), any::<u32>(), 3u8..6).prop_map(|(client_id, username, workspace, expiry, protocol)| {
                Record::Session { client_id, username, workspace, expiry, protocol }
            }),
            text().prop_map(|client_id| Record::SessionEnd { client_id }),
            (text(), any::<u64>(), any::<u32>()).prop_map(|(client_id, at_ms, expiry)| Record::Offline { client_id, at_ms, expiry }),
            (text(), text(), options).prop_map(|(client_id, filter, subscription)| Record::Subscribe { client_id, filter, subscription }),
            (text(), text()).prop_map(|(client_id, filter)| Record::Unsubscribe { client_id, filter }),
            (text(), any::<u64>()).prop_map(|(client_id, value)| Record::Done { client_id, value }),
            (text(), any::<u16>(), any::<bool>()).prop_map(|(client_id, packet_id, open)| Record::InboundQos2 { client_id, packet_id, open }),
            (text(), any::<u64>(), 0u8..3).prop_map(|(client_id, value, qos)| Record::Queued { client_id, value, qos: QoS::from_u8(qos).unwrap() }),
            (text(), any::<u64>(), 1u16.., any::<bool>())
                .prop_map(|(client_id, value, packet_id, released)| Record::Outbound { client_id, value, packet_id, released }),
            (text(), message(), any::<u32>(), any::<u32>())
                .prop_map(|(client_id, message, delay, expiry)| Record::Will { client_id, message, delay, expiry }),
            (text(), any::<u64>()).prop_map(|(client_id, due_ms)| Record::WillDue { client_id, due_ms }),
            text().prop_map(|client_id| Record::WillEnd { client_id }),
        ]
    }

    proptest! {
        #[test]
        fn records_read_back_as_written(record in record(), lsn in any::<u64>()) {
            let mut out = BytesMut::new();
            record.encode(lsn, &mut out);
            prop_assert_eq!(Record::decode(out.freeze()), Ok((lsn, record)));
        }

        #[test]
        fn a_cut_record_is_refused_not_misread(record in record(), cut in any::<prop::sample::Index>()) {
            let mut out = BytesMut::new();
            record.encode(1, &mut out);
            let cut = cut.index(out.len());
            prop_assert!(Record::decode(out.freeze().slice(..cut)).is_err());
        }

        #[test]
        fn any_bytes_give_an_answer(body in prop::collection::vec(any::<u8>(), 0..200)) {
            let _ = Record::decode(Bytes::from(body));
        }
    }

    #[test]
    fn a_message_expires_after_its_interval_in_wall_clock_time() {
        let mut m = StoredMessage {
            topic: "t".into(),
            payload: Bytes::new(),
            qos: QoS::AtLeastOnce,
            retain: true,
            properties: Props::default(),
            received_ms: 10_000,
            origin: 0,
        };
        assert!(!m.expired(u64::MAX));
        m.properties = Props::from(Properties { message_expiry_interval: Some(5), ..Properties::default() });
        assert!(!m.expired(14_999));
        assert!(m.expired(15_000));
    }
}
