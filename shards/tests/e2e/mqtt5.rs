//! MQTT 5 features (and the 3.1.1 rules of issue 4) checked byte by byte
//! over a raw socket, so that every property and reason code is exact.
//!
//! [`packet`] builds and parses MQTT 5 packets with properties; [`Client`]
//! is a blocking raw client on top of it, also used by the shared
//! subscription and robustness tests.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::thread;
use std::time::{Duration, Instant};

use crate::clients::{unique, WAIT};
use crate::harness::Broker;
use crate::raw::{wire, Incoming, RawClient};

/// How long a test waits to be sure that nothing (more) arrives.
pub(crate) const QUIET: Duration = Duration::from_millis(300);

/// Property identifiers (MQTT 5 §2.2.2.2, Table 2-4).
pub(crate) mod prop {
    pub(crate) const PAYLOAD_FORMAT: u8 = 0x01;
    pub(crate) const MESSAGE_EXPIRY: u8 = 0x02;
    pub(crate) const CONTENT_TYPE: u8 = 0x03;
    pub(crate) const RESPONSE_TOPIC: u8 = 0x08;
    pub(crate) const CORRELATION_DATA: u8 = 0x09;
    pub(crate) const SUBSCRIPTION_ID: u8 = 0x0B;
    pub(crate) const SESSION_EXPIRY: u8 = 0x11;
    pub(crate) const ASSIGNED_CLIENT_ID: u8 = 0x12;
    pub(crate) const SERVER_KEEP_ALIVE: u8 = 0x13;
    pub(crate) const AUTH_METHOD: u8 = 0x15;
    pub(crate) const RECEIVE_MAXIMUM: u8 = 0x21;
    pub(crate) const TOPIC_ALIAS_MAXIMUM: u8 = 0x22;
    pub(crate) const TOPIC_ALIAS: u8 = 0x23;
    pub(crate) const MAXIMUM_QOS: u8 = 0x24;
    pub(crate) const RETAIN_AVAILABLE: u8 = 0x25;
    pub(crate) const USER_PROPERTY: u8 = 0x26;
    pub(crate) const MAXIMUM_PACKET_SIZE: u8 = 0x27;
    pub(crate) const WILDCARD_AVAILABLE: u8 = 0x28;
    pub(crate) const SUBSCRIPTION_ID_AVAILABLE: u8 = 0x29;
    pub(crate) const SHARED_AVAILABLE: u8 = 0x2A;
}

/// MQTT 5 packets with properties: builders and parsers.
pub(crate) mod packet {
    use super::wire::{packet, string, varint};

    /// A property value.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub(crate) enum Value {
        /// Byte, Two Byte, Four Byte or Variable Byte Integer.
        Int(u32),
        /// UTF-8 string or binary data.
        Bytes(Vec<u8>),
        /// User Property.
        Pair(String, String),
    }

    #[derive(Clone, Copy)]
    enum Kind {
        Byte,
        Two,
        Four,
        Var,
        Bytes,
        Pair,
    }

    fn kind(id: u8) -> Kind {
        match id {
            0x01 | 0x17 | 0x19 | 0x24 | 0x25 | 0x28 | 0x29 | 0x2A => Kind::Byte,
            0x13 | 0x21 | 0x22 | 0x23 => Kind::Two,
            0x02 | 0x11 | 0x18 | 0x27 => Kind::Four,
            0x0B => Kind::Var,
            0x26 => Kind::Pair,
            0x03 | 0x08 | 0x09 | 0x12 | 0x15 | 0x16 | 0x1A | 0x1C | 0x1F => Kind::Bytes,
            other => panic!("unknown property identifier 0x{other:02x}"),
        }
    }

    /// A property list, in wire order.
    #[derive(Debug, Clone, Default, PartialEq, Eq)]
    pub(crate) struct Props(pub(crate) Vec<(u8, Value)>);

    impl Props {
        /// No properties.
        pub(crate) fn new() -> Props {
            Props::default()
        }

        /// Adds an integer property.
        pub(crate) fn int(mut self, id: u8, value: u32) -> Props {
            self.0.push((id, Value::Int(value)));
            self
        }

        /// Adds a string or binary property.
        pub(crate) fn bytes(mut self, id: u8, value: &[u8]) -> Props {
            self.0.push((id, Value::Bytes(value.to_vec())));
            self
        }

        /// Adds a User Property.
        pub(crate) fn user(mut self, key: &str, value: &str) -> Props {
            self.0.push((
                super::prop::USER_PROPERTY,
                Value::Pair(key.into(), value.into()),
            ));
            self
        }

        /// The first integer property `id`.
        pub(crate) fn int_of(&self, id: u8) -> Option<u32> {
            self.0.iter().find_map(|(i, v)| match v {
                Value::Int(n) if *i == id => Some(*n),
                _ => None,
            })
        }

        /// Every integer property `id` (Subscription Identifiers).
        pub(crate) fn ints_of(&self, id: u8) -> Vec<u32> {
            self.0
                .iter()
                .filter_map(|(i, v)| match v {
                    Value::Int(n) if *i == id => Some(*n),
                    _ => None,
                })
                .collect()
        }

        /// The first string or binary property `id`.
        pub(crate) fn bytes_of(&self, id: u8) -> Option<&[u8]> {
            self.0.iter().find_map(|(i, v)| match v {
                Value::Bytes(b) if *i == id => Some(&b[..]),
                _ => None,
            })
        }

        /// True when property `id` is present.
        pub(crate) fn has(&self, id: u8) -> bool {
            self.0.iter().any(|(i, _)| *i == id)
        }

        /// The User Properties, in order.
        pub(crate) fn users(&self) -> Vec<(String, String)> {
            self.0
                .iter()
                .filter_map(|(_, v)| match v {
                    Value::Pair(k, v) => Some((k.clone(), v.clone())),
                    _ => None,
                })
                .collect()
        }

        /// Property Length and properties.
        pub(crate) fn encode(&self) -> Vec<u8> {
            let mut body = Vec::new();
            for (id, value) in &self.0 {
                body.extend(varint(usize::from(*id)));
                match (kind(*id), value) {
                    (Kind::Byte, Value::Int(n)) => body.push(*n as u8),
                    (Kind::Two, Value::Int(n)) => body.extend((*n as u16).to_be_bytes()),
                    (Kind::Four, Value::Int(n)) => body.extend(n.to_be_bytes()),
                    (Kind::Var, Value::Int(n)) => body.extend(varint(*n as usize)),
                    (Kind::Bytes, Value::Bytes(b)) => body.extend(string(b)),
                    (Kind::Pair, Value::Pair(k, v)) => {
                        body.extend(string(k.as_bytes()));
                        body.extend(string(v.as_bytes()));
                    }
                    _ => panic!("property 0x{id:02x} with a value of the wrong kind"),
                }
            }
            let mut out = varint(body.len());
            out.extend(body);
            out
        }

        /// Parses Property Length and properties at the start of `buf`;
        /// returns them and the bytes used.
        pub(crate) fn decode(buf: &[u8]) -> (Props, usize) {
            let (len, mut at) = read_varint(buf);
            let end = at + len;
            let mut props = Props::new();
            while at < end {
                let (id, used) = read_varint(&buf[at..]);
                at += used;
                let id = id as u8;
                let value = match kind(id) {
                    Kind::Byte => {
                        at += 1;
                        Value::Int(u32::from(buf[at - 1]))
                    }
                    Kind::Two => {
                        at += 2;
                        Value::Int(u32::from(u16::from_be_bytes([buf[at - 2], buf[at - 1]])))
                    }
                    Kind::Four => {
                        at += 4;
                        Value::Int(u32::from_be_bytes(buf[at - 4..at].try_into().unwrap()))
                    }
                    Kind::Var => {
                        let (n, used) = read_varint(&buf[at..]);
                        at += used;
                        Value::Int(n as u32)
                    }
                    Kind::Bytes => {
                        let (b, used) = read_string(&buf[at..]);
                        at += used;
                        Value::Bytes(b)
                    }
                    Kind::Pair => {
                        let (k, used) = read_string(&buf[at..]);
                        at += used;
                        let (v, used) = read_string(&buf[at..]);
                        at += used;
                        Value::Pair(String::from_utf8(k).unwrap(), String::from_utf8(v).unwrap())
                    }
                };
                props.0.push((id, value));
            }
            (props, end)
        }
    }

    fn read_varint(buf: &[u8]) -> (usize, usize) {
        let (mut n, mut shift) = (0usize, 0);
        for (i, b) in buf.iter().enumerate().take(4) {
            n |= usize::from(b & 0x7f) << shift;
            shift += 7;
            if b & 0x80 == 0 {
                return (n, i + 1);
            }
        }
        panic!("malformed variable byte integer in {buf:02x?}")
    }

    fn read_string(buf: &[u8]) -> (Vec<u8>, usize) {
        let len = usize::from(u16::from_be_bytes([buf[0], buf[1]]));
        (buf[2..2 + len].to_vec(), 2 + len)
    }

    /// Subscription Options (MQTT 5 §3.8.3.1): QoS, No Local, Retain As
    /// Published, Retain Handling.
    pub(crate) fn options(qos: u8, no_local: bool, rap: bool, retain_handling: u8) -> u8 {
        qos | u8::from(no_local) << 2 | u8::from(rap) << 3 | retain_handling << 4
    }

    /// An MQTT 5 CONNECT without will or credentials.
    pub(crate) fn connect(client_id: &str, clean: bool, keep_alive: u16, props: &Props) -> Vec<u8> {
        let mut body = string(b"MQTT");
        body.push(5);
        body.push(if clean { 0x02 } else { 0 });
        body.extend(keep_alive.to_be_bytes());
        body.extend(props.encode());
        body.extend(string(client_id.as_bytes()));
        packet(0x10, &body)
    }

    /// SUBSCRIBE; `props` is `None` for MQTT 3.1.1. Each filter comes
    /// with its options byte (3.1.1: the QoS).
    pub(crate) fn subscribe(
        packet_id: u16,
        filters: &[(&str, u8)],
        props: Option<&Props>,
    ) -> Vec<u8> {
        let mut body = packet_id.to_be_bytes().to_vec();
        if let Some(props) = props {
            body.extend(props.encode());
        }
        for (filter, options) in filters {
            body.extend(string(filter.as_bytes()));
            body.push(*options);
        }
        packet(0x82, &body)
    }

    /// PUBLISH; `props` is `None` for MQTT 3.1.1.
    pub(crate) fn publish(
        topic: &str,
        qos: u8,
        retain: bool,
        packet_id: u16,
        props: Option<&Props>,
        payload: &[u8],
    ) -> Vec<u8> {
        let mut body = string(topic.as_bytes());
        if qos > 0 {
            body.extend(packet_id.to_be_bytes());
        }
        if let Some(props) = props {
            body.extend(props.encode());
        }
        body.extend_from_slice(payload);
        packet(0x30 | qos << 1 | u8::from(retain), &body)
    }

    /// PUBACK (0x40), PUBREC (0x50), PUBREL (0x62) or PUBCOMP (0x70) with
    /// success.
    pub(crate) fn ack(header: u8, packet_id: u16) -> Vec<u8> {
        packet(header, &packet_id.to_be_bytes())
    }

    /// MQTT 5 DISCONNECT with properties.
    pub(crate) fn disconnect(reason: u8, props: &Props) -> Vec<u8> {
        let mut body = vec![reason];
        body.extend(props.encode());
        packet(0xE0, &body)
    }

    /// A received PUBLISH.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub(crate) struct Publish {
        pub(crate) topic: String,
        pub(crate) qos: u8,
        pub(crate) retain: bool,
        pub(crate) dup: bool,
        /// 0 at QoS 0.
        pub(crate) packet_id: u16,
        pub(crate) props: Props,
        pub(crate) payload: Vec<u8>,
    }

    impl Publish {
        /// Parses a PUBLISH from its fixed header byte and body.
        pub(crate) fn parse(header: u8, body: &[u8], v5: bool) -> Publish {
            let qos = (header >> 1) & 3;
            let (topic, mut at) = read_string(body);
            let mut packet_id = 0;
            if qos > 0 {
                packet_id = u16::from_be_bytes([body[at], body[at + 1]]);
                at += 2;
            }
            let mut props = Props::new();
            if v5 {
                let (p, used) = Props::decode(&body[at..]);
                props = p;
                at += used;
            }
            Publish {
                topic: String::from_utf8(topic).expect("a UTF-8 topic"),
                qos,
                retain: header & 1 == 1,
                dup: header & 8 == 8,
                packet_id,
                props,
                payload: body[at..].to_vec(),
            }
        }

        /// The payload as text.
        pub(crate) fn text(&self) -> String {
            String::from_utf8_lossy(&self.payload).into_owned()
        }
    }

    /// A received CONNACK.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub(crate) struct ConnAck {
        pub(crate) session_present: bool,
        pub(crate) reason: u8,
        pub(crate) props: Props,
    }

    impl ConnAck {
        /// Parses a CONNACK body.
        pub(crate) fn parse(body: &[u8]) -> ConnAck {
            let props = if body.len() > 2 {
                Props::decode(&body[2..]).0
            } else {
                Props::new()
            };
            ConnAck {
                session_present: body[0] & 1 == 1,
                reason: body[1],
                props,
            }
        }
    }
}

use packet::{ConnAck, Props, Publish};

/// A blocking raw MQTT client (3.1.1 or 5) that keeps packets it was not
/// waiting for, answers PUBREL with PUBCOMP by itself, and acknowledges
/// only when told to.
pub(crate) struct Client {
    raw: RawClient,
    v5: bool,
    held: VecDeque<(u8, Vec<u8>)>,
    next_id: u16,
    /// The CONNACK the broker answered with.
    pub(crate) connack: ConnAck,
}

impl Client {
    /// Sends `connect` (an MQTT 5 CONNECT when `v5`) and reads the CONNACK,
    /// whatever its reason code.
    ///
    /// # Panics
    ///
    /// No CONNACK within [`WAIT`].
    pub(crate) fn open(addr: SocketAddr, connect: &[u8], v5: bool) -> Client {
        Client::over(RawClient::connect(addr), connect, v5)
    }

    /// [`Client::open`] from the local address `source`.
    pub(crate) fn open_from(
        addr: SocketAddr,
        source: std::net::IpAddr,
        connect: &[u8],
        v5: bool,
    ) -> Client {
        Client::over(RawClient::connect_from(addr, source), connect, v5)
    }

    /// Sends `connect` over `raw` and reads the CONNACK, whatever its
    /// reason code.
    fn over(mut raw: RawClient, connect: &[u8], v5: bool) -> Client {
        raw.send(connect);
        let connack = match raw.read(WAIT) {
            Incoming::Packet { header: 0x20, body } => ConnAck::parse(&body),
            other => panic!("expected CONNACK, got {other:02x?}"),
        };
        Client {
            raw,
            v5,
            held: VecDeque::new(),
            next_id: 1,
            connack,
        }
    }

    /// An MQTT 5 client, accepted.
    pub(crate) fn v5(addr: SocketAddr, id: &str, clean: bool, props: Props) -> Client {
        let client = Client::open(addr, &packet::connect(id, clean, 60, &props), true);
        assert_eq!(
            client.connack.reason, 0,
            "CONNACK for {id}: {:?}",
            client.connack
        );
        client
    }

    /// An MQTT 3.1.1 client, accepted.
    pub(crate) fn v311(addr: SocketAddr, id: &str, clean: bool) -> Client {
        let connect = wire::Connect {
            clean,
            ..wire::Connect::v311(id)
        };
        let client = Client::open(addr, &connect.encode(), false);
        assert_eq!(client.connack.reason, 0, "CONNACK for {id}");
        client
    }

    /// Writes raw bytes.
    pub(crate) fn send(&mut self, bytes: &[u8]) {
        self.raw.send(bytes);
    }

    fn packet_id(&mut self) -> u16 {
        let id = self.next_id;
        self.next_id = self.next_id.checked_add(1).unwrap_or(1);
        id
    }

    /// Reads one packet, answering PUBREL with PUBCOMP on the way.
    fn read(&mut self, timeout: Duration) -> Incoming {
        match self.raw.read(timeout) {
            Incoming::Packet { header: 0x62, body } => {
                self.raw
                    .send(&packet::ack(0x70, u16::from_be_bytes([body[0], body[1]])));
                Incoming::Packet { header: 0x62, body }
            }
            other => other,
        }
    }

    /// The next packet of type `kind` (high nibble, e.g. 0x90 for SUBACK)
    /// within `timeout`, as (fixed header byte, body); other packets are
    /// kept for later.
    ///
    /// # Panics
    ///
    /// The connection closes first.
    pub(crate) fn wait_for(&mut self, kind: u8, timeout: Duration) -> Option<(u8, Vec<u8>)> {
        if let Some(i) = self.held.iter().position(|(h, _)| h & 0xF0 == kind) {
            return self.held.remove(i);
        }
        let deadline = Instant::now() + timeout;
        loop {
            match self.read(deadline.saturating_duration_since(Instant::now())) {
                Incoming::Packet { header, body } if header & 0xF0 == kind => {
                    return Some((header, body))
                }
                Incoming::Packet {
                    header: 0x62 | 0xD0,
                    ..
                } => {}
                Incoming::Packet { header, body } => self.held.push_back((header, body)),
                Incoming::TimedOut => return None,
                Incoming::Closed => panic!(
                    "connection closed while waiting for packet type 0x{kind:02x}; held {:02x?}",
                    self.held
                ),
            }
        }
    }

    /// Subscribes and returns the SUBACK reason codes.
    ///
    /// # Panics
    ///
    /// No SUBACK within [`WAIT`].
    pub(crate) fn subscribe_with(&mut self, filters: &[(&str, u8)], props: Props) -> Vec<u8> {
        let id = self.packet_id();
        let props = self.v5.then_some(&props);
        self.raw.send(&packet::subscribe(id, filters, props));
        let (_, body) = self
            .wait_for(0x90, WAIT)
            .unwrap_or_else(|| panic!("no SUBACK for {filters:?}"));
        assert_eq!(&body[..2], &id.to_be_bytes(), "SUBACK packet id");
        let at = if self.v5 {
            2 + Props::decode(&body[2..]).1
        } else {
            2
        };
        body[at..].to_vec()
    }

    /// Subscribes to one filter with `options` and asserts it was granted.
    pub(crate) fn subscribe(&mut self, filter: &str, options: u8) {
        let codes = self.subscribe_with(&[(filter, options)], Props::new());
        assert_eq!(codes, vec![options & 3], "SUBACK for {filter}");
    }

    /// Publishes without waiting; returns the packet identifier (0 at QoS 0).
    pub(crate) fn publish_nowait(
        &mut self,
        topic: &str,
        qos: u8,
        retain: bool,
        props: Props,
        payload: &[u8],
    ) -> u16 {
        let id = if qos > 0 { self.packet_id() } else { 0 };
        let props = self.v5.then_some(&props);
        self.raw
            .send(&packet::publish(topic, qos, retain, id, props, payload));
        id
    }

    /// Publishes and completes the QoS flow; returns the PUBACK/PUBREC
    /// reason code (0 at QoS 0).
    ///
    /// # Panics
    ///
    /// No acknowledgement within [`WAIT`].
    pub(crate) fn publish(
        &mut self,
        topic: &str,
        qos: u8,
        retain: bool,
        props: Props,
        payload: &[u8],
    ) -> u8 {
        let id = self.publish_nowait(topic, qos, retain, props, payload);
        let kind = match qos {
            0 => return 0,
            1 => 0x40,
            _ => 0x50,
        };
        let (_, body) = self
            .wait_for(kind, WAIT)
            .unwrap_or_else(|| panic!("no acknowledgement for QoS {qos} PUBLISH to {topic}"));
        assert_eq!(&body[..2], &id.to_be_bytes(), "acknowledged packet id");
        let reason = body.get(2).copied().unwrap_or(0);
        if qos == 2 && reason < 0x80 {
            self.raw.send(&packet::ack(0x62, id));
            self.wait_for(0x70, WAIT).expect("PUBCOMP");
        }
        reason
    }

    /// The next PUBLISH within `timeout`, not acknowledged.
    pub(crate) fn next_publish(&mut self, timeout: Duration) -> Option<Publish> {
        let v5 = self.v5;
        self.wait_for(0x30, timeout)
            .map(|(header, body)| Publish::parse(header, &body, v5))
    }

    /// Acknowledges a received PUBLISH (PUBACK at QoS 1, PUBREC at QoS 2;
    /// the PUBREL that follows is answered by [`Client::read`]).
    pub(crate) fn ack(&mut self, publish: &Publish) {
        match publish.qos {
            1 => self.raw.send(&packet::ack(0x40, publish.packet_id)),
            2 => self.raw.send(&packet::ack(0x50, publish.packet_id)),
            _ => {}
        }
    }

    /// The next PUBLISH within `timeout`, acknowledged.
    pub(crate) fn recv(&mut self, timeout: Duration) -> Option<Publish> {
        let publish = self.next_publish(timeout)?;
        self.ack(&publish);
        Some(publish)
    }

    /// The next PUBLISH, acknowledged.
    ///
    /// # Panics
    ///
    /// None arrives within [`WAIT`].
    pub(crate) fn expect_publish(&mut self) -> Publish {
        self.recv(WAIT)
            .unwrap_or_else(|| panic!("no PUBLISH within {WAIT:?}"))
    }

    /// Asserts that no PUBLISH arrives within `wait`.
    pub(crate) fn expect_no_publish(&mut self, wait: Duration) {
        if let Some(p) = self.next_publish(wait) {
            panic!("unexpected PUBLISH {p:?}");
        }
    }

    /// Every PUBLISH that arrives until none has for `quiet`, acknowledged.
    pub(crate) fn drain(&mut self, quiet: Duration) -> Vec<Publish> {
        let mut all = Vec::new();
        while let Some(p) = self.recv(quiet) {
            all.push(p);
        }
        all
    }

    /// Reads until the broker closes the connection; returns the reason
    /// code of the DISCONNECT it sent first, if any.
    ///
    /// # Panics
    ///
    /// Still open after `timeout`.
    pub(crate) fn closed_with(&mut self, timeout: Duration) -> Option<u8> {
        let mut reason = self
            .held
            .iter()
            .find(|(h, _)| *h == 0xE0)
            .map(|(_, b)| b.first().copied().unwrap_or(0));
        let deadline = Instant::now() + timeout;
        loop {
            match self
                .raw
                .read(deadline.saturating_duration_since(Instant::now()))
            {
                Incoming::Packet { header: 0xE0, body } => {
                    reason.get_or_insert(body.first().copied().unwrap_or(0));
                }
                Incoming::Packet { .. } => {}
                Incoming::Closed => return reason,
                Incoming::TimedOut => panic!("connection still open after {timeout:?}"),
            }
        }
    }

    /// Sends DISCONNECT (reason 0) and waits for the broker to close.
    pub(crate) fn disconnect(mut self) {
        if self.v5 {
            self.raw.send(&wire::disconnect_v5(0));
        } else {
            self.raw.send(&[0xE0, 0]);
        }
        let _ = self.closed_with(WAIT);
    }
}

/// The value of the Prometheus sample `name` with label `label` (e.g.
/// `reason="expired"`), summed over the other labels.
pub(crate) fn metric_with(broker: &Broker, name: &str, label: &str) -> f64 {
    let (status, body) = broker.admin_get("/metrics");
    assert_eq!(status, 200, "/metrics: {body}");
    body.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")) && l.contains(label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// A subscriber on `filter` at QoS 1 and a publisher, both MQTT 5, on a
/// broker with two shards.
fn pair(broker: &Broker, filter: &str) -> (Client, Client) {
    let mut sub = Client::v5(broker.mqtt, &unique("sub"), true, Props::new());
    sub.subscribe(filter, 1);
    let publisher = Client::v5(broker.mqtt, &unique("pub"), true, Props::new());
    (sub, publisher)
}

/// The CONNACK announces what the broker does (MQTT 5 §3.2.2.3): Receive
/// Maximum and Topic Alias Maximum as configured, and no Maximum QoS,
/// Retain Available, Wildcard / Subscription Identifier / Shared
/// Subscription Available set to 0, since all of them are supported
/// [MQTT-3.2.2-9]. With `limits.topic_alias_maximum=0` no Topic Alias
/// Maximum is announced [MQTT-3.2.2-18].
#[test]
fn connack_announces_what_the_broker_supports() {
    let broker = Broker::two_shards(&[]);
    let c = Client::v5(broker.mqtt, &unique("caps"), true, Props::new());
    let p = &c.connack.props;
    assert_eq!(p.int_of(prop::TOPIC_ALIAS_MAXIMUM), Some(64), "{p:?}");
    assert_eq!(p.int_of(prop::RECEIVE_MAXIMUM), Some(1000), "{p:?}");
    for (id, what) in [
        (prop::RETAIN_AVAILABLE, "Retain Available"),
        (prop::WILDCARD_AVAILABLE, "Wildcard Subscription Available"),
        (
            prop::SUBSCRIPTION_ID_AVAILABLE,
            "Subscription Identifier Available",
        ),
        (prop::SHARED_AVAILABLE, "Shared Subscription Available"),
    ] {
        assert_ne!(p.int_of(id), Some(0), "{what} must not be 0: {p:?}");
    }
    assert!(
        p.int_of(prop::MAXIMUM_QOS).is_none_or(|q| q == 2),
        "Maximum QoS below 2 while QoS 2 works: {p:?}"
    );

    let broker = Broker::two_shards(&["--set", "limits.topic_alias_maximum=0"]);
    let c = Client::v5(broker.mqtt, &unique("noalias"), true, Props::new());
    assert!(
        !c.connack.props.has(prop::TOPIC_ALIAS_MAXIMUM),
        "{:?}",
        c.connack.props
    );
}

/// A Topic Alias set with a topic is used by later PUBLISHes with an empty
/// topic [MQTT-3.3.2-12]; subscribers get the full topic and no alias of
/// ours. A new connection starts with no aliases [MQTT-3.3.2-7]: alias 1
/// with an empty topic there is a Protocol Error, DISCONNECT 0x82 (MQTT 5
/// §3.3.2.3.4).
#[test]
fn inbound_topic_alias_stands_for_its_topic_on_that_connection_only() {
    let broker = Broker::two_shards(&[]);
    let topic = unique("alias-in");
    let (mut sub, mut publisher) = pair(&broker, &topic);
    let alias = |n| Props::new().int(prop::TOPIC_ALIAS, n);
    assert_eq!(publisher.publish(&topic, 1, false, alias(64), b"set"), 0);
    assert_eq!(publisher.publish("", 1, false, alias(64), b"used"), 0);
    for payload in ["set", "used"] {
        let got = sub.expect_publish();
        assert_eq!(
            (got.topic.as_str(), got.text().as_str()),
            (topic.as_str(), payload)
        );
        assert!(!got.props.has(prop::TOPIC_ALIAS), "{got:?}");
    }

    let mut fresh = Client::v5(broker.mqtt, &unique("fresh"), true, Props::new());
    fresh.publish_nowait("", 0, false, alias(64), b"unknown");
    assert_eq!(fresh.closed_with(WAIT), Some(0x82));
    sub.expect_no_publish(QUIET);
}

/// Topic Alias 0 [MQTT-3.3.2-8] and one above the Topic Alias Maximum in
/// the CONNACK (`limits.topic_alias_maximum=5`) [MQTT-3.3.2-9] get
/// DISCONNECT 0x94; the maximum itself is accepted [MQTT-3.3.2-12].
#[test]
fn topic_alias_zero_or_above_the_maximum_gets_disconnect_0x94() {
    let broker = Broker::two_shards(&["--set", "limits.topic_alias_maximum=5"]);
    let topic = unique("alias-bad");
    let alias = |n| Props::new().int(prop::TOPIC_ALIAS, n);
    let mut ok = Client::v5(broker.mqtt, &unique("ok"), true, Props::new());
    assert_eq!(ok.connack.props.int_of(prop::TOPIC_ALIAS_MAXIMUM), Some(5));
    assert_eq!(ok.publish(&topic, 1, false, alias(5), b"x"), 0);
    for bad in [0, 6] {
        let mut c = Client::v5(broker.mqtt, &unique("bad"), true, Props::new());
        c.publish_nowait(&topic, 1, false, alias(bad), b"x");
        assert_eq!(c.closed_with(WAIT), Some(0x94), "Topic Alias {bad}");
    }
}

/// A client that announces Topic Alias Maximum 2 gets aliases from the
/// broker, never above 2 [MQTT-3.1.2-26] [MQTT-3.3.2-11], and every PUBLISH
/// resolves to the topic it was published on; a client that announces none
/// gets no alias [MQTT-3.1.2-27].
#[test]
fn outbound_topic_aliases_stay_within_the_client_maximum() {
    let broker = Broker::two_shards(&[]);
    let t = unique("alias-out");
    let props = Props::new().int(prop::TOPIC_ALIAS_MAXIMUM, 2);
    let mut aliased = Client::v5(broker.mqtt, &unique("aliased"), true, props);
    aliased.subscribe(&format!("{t}/#"), 1);
    let mut plain = Client::v5(broker.mqtt, &unique("plain"), true, Props::new());
    plain.subscribe(&format!("{t}/#"), 1);
    let mut publisher = Client::v5(broker.mqtt, &unique("pub"), true, Props::new());
    let sent: Vec<String> = ["a", "a", "b", "c", "a", "b", "c", "c"]
        .iter()
        .map(|s| format!("{t}/{s}"))
        .collect();
    for (i, topic) in sent.iter().enumerate() {
        publisher.publish(topic, 1, false, Props::new(), i.to_string().as_bytes());
    }
    let mut map: HashMap<u32, String> = HashMap::new();
    let mut empty_topics = 0;
    for (i, topic) in sent.iter().enumerate() {
        let got = aliased.expect_publish();
        assert_eq!(got.text(), i.to_string(), "in order");
        let resolved = match got.props.int_of(prop::TOPIC_ALIAS) {
            Some(alias) => {
                assert!((1..=2).contains(&alias), "alias {alias} outside 1..=2");
                if got.topic.is_empty() {
                    empty_topics += 1;
                    map.get(&alias)
                        .cloned()
                        .expect("an alias the broker set before")
                } else {
                    map.insert(alias, got.topic.clone());
                    got.topic.clone()
                }
            }
            None => got.topic.clone(),
        };
        assert_eq!(&resolved, topic);

        let got = plain.expect_publish();
        assert_eq!(&got.topic, topic);
        assert!(!got.props.has(prop::TOPIC_ALIAS), "{got:?}");
    }
    assert!(empty_topics > 0, "the broker never used an alias it set");
}

/// A Subscription Identifier is sent with every matching PUBLISH
/// [MQTT-3.3.4-3], including retained messages sent at subscribe, and is
/// kept in a persistent session: messages queued while away carry it too.
#[test]
fn subscription_identifier_is_sent_and_kept_in_the_session() {
    let broker = Broker::two_shards(&[]);
    let t = unique("subid");
    let id = unique("subid-client");
    let expiry = Props::new().int(prop::SESSION_EXPIRY, 60);
    let mut publisher = Client::v5(broker.mqtt, &unique("pub"), true, Props::new());
    publisher.publish(&format!("{t}/retained"), 1, true, Props::new(), b"r");

    let mut sub = Client::v5(broker.mqtt, &id, true, expiry.clone());
    let with_id = Props::new().int(prop::SUBSCRIPTION_ID, 268_435_455);
    assert_eq!(
        sub.subscribe_with(&[(&format!("{t}/#"), 1)], with_id),
        vec![1]
    );
    sub.subscribe(&format!("{t}/plain"), 1);
    let retained = sub.expect_publish();
    assert_eq!(
        retained.props.ints_of(prop::SUBSCRIPTION_ID),
        vec![268_435_455]
    );

    publisher.publish(&format!("{t}/live"), 1, false, Props::new(), b"l");
    let live = sub.expect_publish();
    assert_eq!(live.props.ints_of(prop::SUBSCRIPTION_ID), vec![268_435_455]);
    sub.disconnect();

    publisher.publish(&format!("{t}/away"), 1, false, Props::new(), b"a");
    let mut back = Client::v5(broker.mqtt, &id, false, expiry);
    assert!(back.connack.session_present);
    let away = back.expect_publish();
    assert_eq!(away.text(), "a");
    assert_eq!(away.props.ints_of(prop::SUBSCRIPTION_ID), vec![268_435_455]);

    publisher.publish(&format!("{t}/plain"), 1, false, Props::new(), b"p");
    let plain = back.expect_publish();
    assert_eq!(
        plain.props.ints_of(prop::SUBSCRIPTION_ID),
        vec![268_435_455],
        "only the identified subscription's identifier: {plain:?}"
    );
}

/// A persistent session away while two messages wait: the one whose
/// Message Expiry Interval (1 s) ran out in the queue is never sent
/// [MQTT-3.3.2-5]; the other still is.
#[test]
fn message_expired_while_queued_is_never_sent() {
    let broker = Broker::two_shards(&[]);
    let topic = unique("expire");
    let id = unique("away");
    let expiry = Props::new().int(prop::SESSION_EXPIRY, 60);
    let mut sub = Client::v5(broker.mqtt, &id, true, expiry.clone());
    sub.subscribe(&topic, 1);
    sub.disconnect();
    let mut publisher = Client::v5(broker.mqtt, &unique("pub"), true, Props::new());
    publisher.publish(
        &topic,
        1,
        false,
        Props::new().int(prop::MESSAGE_EXPIRY, 1),
        b"short",
    );
    publisher.publish(&topic, 1, false, Props::new(), b"forever");
    thread::sleep(Duration::from_millis(2100));
    let mut back = Client::v5(broker.mqtt, &id, false, expiry);
    assert_eq!(back.expect_publish().text(), "forever");
    back.expect_no_publish(QUIET);
    assert!(
        metric_with(
            &broker,
            "fleetmq_messages_dropped_total",
            "reason=\"expired\""
        ) >= 1.0
    );
}

/// The Message Expiry Interval forwarded is the received one minus the
/// time the message waited in the broker [MQTT-3.3.2-6].
#[test]
fn forwarded_message_expiry_is_reduced_by_the_time_waited() {
    let broker = Broker::two_shards(&[]);
    let topic = unique("expire-left");
    let id = unique("away");
    let expiry = Props::new().int(prop::SESSION_EXPIRY, 60);
    let mut sub = Client::v5(broker.mqtt, &id, true, expiry.clone());
    sub.subscribe(&topic, 1);
    let mut publisher = Client::v5(broker.mqtt, &unique("pub"), true, Props::new());
    publisher.publish(
        &topic,
        1,
        false,
        Props::new().int(prop::MESSAGE_EXPIRY, 100),
        b"live",
    );
    let live = sub.expect_publish();
    assert!(
        matches!(live.props.int_of(prop::MESSAGE_EXPIRY), Some(99..=100)),
        "{live:?}"
    );
    sub.disconnect();

    publisher.publish(
        &topic,
        1,
        false,
        Props::new().int(prop::MESSAGE_EXPIRY, 100),
        b"queued",
    );
    thread::sleep(Duration::from_millis(2100));
    let mut back = Client::v5(broker.mqtt, &id, false, expiry);
    let queued = back.expect_publish();
    assert_eq!(queued.text(), "queued");
    let left = queued.props.int_of(prop::MESSAGE_EXPIRY);
    assert!(
        matches!(left, Some(1..=98)),
        "expiry left {left:?} after waiting 2 s"
    );
}

/// Payload Format Indicator [MQTT-3.3.2-4], Content Type [MQTT-3.3.2-20],
/// Response Topic [MQTT-3.3.2-15], Correlation Data [MQTT-3.3.2-16] and
/// User Properties in order [MQTT-3.3.2-17] [MQTT-3.3.2-18] reach the
/// subscriber unaltered, at QoS 0, 1 and 2.
#[test]
fn request_response_properties_pass_through_unaltered() {
    let broker = Broker::two_shards(&[]);
    let topic = unique("req");
    let mut sub = Client::v5(broker.mqtt, &unique("sub"), true, Props::new());
    sub.subscribe(&topic, 2);
    let mut publisher = Client::v5(broker.mqtt, &unique("pub"), true, Props::new());
    let props = Props::new()
        .int(prop::PAYLOAD_FORMAT, 1)
        .bytes(prop::CONTENT_TYPE, b"application/json")
        .bytes(prop::RESPONSE_TOPIC, b"replies/for/me")
        .bytes(prop::CORRELATION_DATA, &[0, 1, 2, 0xFF])
        .user("k", "v1")
        .user("a", "x")
        .user("k", "v2");
    for qos in 0..=2 {
        publisher.publish(&topic, qos, false, props.clone(), b"{\"q\":1}");
        let got = sub.expect_publish();
        assert_eq!(got.qos, qos);
        let p = &got.props;
        assert_eq!(p.int_of(prop::PAYLOAD_FORMAT), Some(1));
        assert_eq!(
            p.bytes_of(prop::CONTENT_TYPE),
            Some(&b"application/json"[..])
        );
        assert_eq!(
            p.bytes_of(prop::RESPONSE_TOPIC),
            Some(&b"replies/for/me"[..])
        );
        assert_eq!(
            p.bytes_of(prop::CORRELATION_DATA),
            Some(&[0, 1, 2, 0xFF][..])
        );
        assert_eq!(p.users(), props.users(), "User Properties in order");
    }
}

/// Payload Format Indicator 1 with a payload that is not UTF-8: PUBACK
/// (QoS 1) and PUBREC (QoS 2) 0x99 Payload format invalid, and the message
/// is not forwarded (MQTT 5 §3.3.2.3.2, §3.4.2.1); valid UTF-8 goes through.
#[test]
fn payload_format_utf8_with_invalid_utf8_gets_0x99() {
    let broker = Broker::two_shards(&[]);
    let topic = unique("pfi");
    let (mut sub, mut publisher) = pair(&broker, &topic);
    let utf8 = Props::new().int(prop::PAYLOAD_FORMAT, 1);
    assert_eq!(
        publisher.publish(&topic, 1, false, utf8.clone(), &[0xC3, 0x28]),
        0x99
    );
    assert_eq!(
        publisher.publish(&topic, 2, false, utf8.clone(), &[0xFF]),
        0x99
    );
    sub.expect_no_publish(QUIET);
    assert_eq!(
        publisher.publish(&topic, 1, false, utf8, "é ok".as_bytes()),
        0
    );
    assert_eq!(sub.expect_publish().text(), "é ok");
}

/// A message larger than a subscriber's Maximum Packet Size is not sent to
/// it [MQTT-3.1.2-24] but dropped as if sent [MQTT-3.1.2-25] and counted
/// (`fleetmq_messages_dropped_total{reason="packet_too_large"}`); the same
/// message reaches a subscriber without that limit, and the next small one
/// reaches both.
#[test]
fn message_too_large_for_a_subscriber_is_dropped_for_it_and_counted() {
    let broker = Broker::two_shards(&[]);
    let topic = unique("big");
    let small = Props::new().int(prop::MAXIMUM_PACKET_SIZE, 200);
    let mut limited = Client::v5(broker.mqtt, &unique("limited"), true, small);
    limited.subscribe(&topic, 1);
    let (mut unlimited, mut publisher) = pair(&broker, &topic);
    publisher.publish(&topic, 1, false, Props::new(), &[b'x'; 500]);
    publisher.publish(&topic, 1, false, Props::new(), b"small");
    assert_eq!(unlimited.expect_publish().payload.len(), 500);
    assert_eq!(unlimited.expect_publish().text(), "small");
    assert_eq!(
        limited.expect_publish().text(),
        "small",
        "the large one is skipped"
    );
    limited.expect_no_publish(QUIET);
    assert!(
        metric_with(
            &broker,
            "fleetmq_messages_dropped_total",
            "reason=\"packet_too_large\""
        ) >= 1.0
    );
}

/// A client with Receive Maximum 2 never has more than 2 unacknowledged
/// QoS 1 PUBLISHes from the broker [MQTT-3.3.4-9]; each PUBACK lets one
/// more out, in order.
#[test]
fn client_receive_maximum_bounds_publishes_in_flight() {
    let broker = Broker::two_shards(&[]);
    let topic = unique("rm");
    let two = Props::new().int(prop::RECEIVE_MAXIMUM, 2);
    let mut sub = Client::v5(broker.mqtt, &unique("slow"), true, two);
    sub.subscribe(&topic, 1);
    let mut publisher = Client::v5(broker.mqtt, &unique("pub"), true, Props::new());
    for i in 0..5 {
        publisher.publish(&topic, 1, false, Props::new(), i.to_string().as_bytes());
    }
    let first: Vec<Publish> = (0..2)
        .map(|_| sub.next_publish(WAIT).expect("in flight"))
        .collect();
    sub.expect_no_publish(QUIET);
    let mut seen: Vec<String> = first.iter().map(Publish::text).collect();
    for p in &first {
        sub.ack(p);
        let next = sub.next_publish(WAIT).expect("one more after a PUBACK");
        seen.push(next.text());
        sub.ack(&next);
    }
    seen.extend(sub.drain(QUIET).iter().map(Publish::text));
    assert_eq!(seen, ["0", "1", "2", "3", "4"]);
}

/// With `limits.receive_maximum=2` the CONNACK announces Receive Maximum 2
/// and a client with 3 QoS 2 PUBLISHes unacknowledged (no PUBREL) gets
/// DISCONNECT 0x93 Receive Maximum exceeded (MQTT 5 §3.3.4).
#[test]
fn client_exceeding_our_receive_maximum_gets_disconnect_0x93() {
    let broker = Broker::two_shards(&["--set", "limits.receive_maximum=2"]);
    let topic = unique("rm-in");
    let mut c = Client::v5(broker.mqtt, &unique("greedy"), true, Props::new());
    assert_eq!(c.connack.props.int_of(prop::RECEIVE_MAXIMUM), Some(2));
    for _ in 0..3 {
        c.publish_nowait(&topic, 2, false, Props::new(), b"x");
    }
    assert_eq!(c.closed_with(WAIT), Some(0x93));
}

/// With `limits.max_keep_alive=1s` a Keep Alive of 60 s gets Server Keep
/// Alive 1 in the CONNACK [MQTT-3.2.2-21], which the broker then applies: a
/// silent client is closed after 1.5 × 1 s with 0x8D [MQTT-3.1.2-22]. A
/// Keep Alive within the maximum gets no Server Keep Alive
/// [MQTT-3.2.2-22].
#[test]
fn server_keep_alive_lowers_a_keep_alive_above_the_maximum() {
    let broker = Broker::two_shards(&["--set", "limits.max_keep_alive=1s"]);
    let within = Client::open(
        broker.mqtt,
        &packet::connect(&unique("ka1"), true, 1, &Props::new()),
        true,
    );
    assert!(!within.connack.props.has(prop::SERVER_KEEP_ALIVE));
    let started = Instant::now();
    let mut c = Client::v5(broker.mqtt, &unique("ka60"), true, Props::new());
    assert_eq!(c.connack.props.int_of(prop::SERVER_KEEP_ALIVE), Some(1));
    assert_eq!(c.closed_with(Duration::from_secs(4)), Some(0x8D));
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(1400),
        "closed after {waited:?}"
    );
}

/// Keep Alive counts Control Packets, not bytes: a client with Keep Alive
/// 1 s that sends a PUBLISH one byte every 250 ms (the packet would take
/// about 10 s) has sent no whole packet for 1.5 s and is closed with 0x8D
/// [MQTT-3.1.2-22] (3.1.1: [MQTT-3.1.2-24]), instead of holding its partial
/// packet open for as long as it keeps dribbling.
#[test]
fn a_client_that_sends_a_packet_a_byte_at_a_time_is_closed_after_keep_alive() {
    let broker = Broker::start(&[]);
    for v5 in [true, false] {
        let id = unique("dribble");
        let mut c = if v5 {
            Client::open(
                broker.mqtt,
                &packet::connect(&id, true, 1, &Props::new()),
                true,
            )
        } else {
            let connect = wire::Connect {
                keep_alive: 1,
                ..wire::Connect::v311(&id)
            };
            Client::open(broker.mqtt, &connect.encode(), false)
        };
        assert_eq!(c.connack.reason, 0);
        let publish = wire::publish_qos0("dribble/topic", &[b'x'; 24], v5);
        let started = Instant::now();
        let mut reason = None;
        let mut closed = false;
        for byte in &publish {
            c.raw.send(std::slice::from_ref(byte));
            match c.raw.read(Duration::from_millis(250)) {
                Incoming::Packet { header: 0xE0, body } => {
                    reason = body.first().copied();
                    closed = matches!(c.raw.read(WAIT), Incoming::Closed);
                    break;
                }
                Incoming::Packet { header, .. } => panic!("unexpected packet {header:02x}"),
                Incoming::Closed => {
                    closed = true;
                    break;
                }
                Incoming::TimedOut => {}
            }
        }
        let waited = started.elapsed();
        assert!(
            closed,
            "v5={v5}: still open after the whole packet, dribbled over {waited:?}"
        );
        assert!(
            waited < Duration::from_secs(4),
            "v5={v5}: closed only after {waited:?}"
        );
        assert_eq!(reason, v5.then_some(0x8D), "v5={v5}: DISCONNECT reason");
    }
}

/// An empty Client Identifier gets an Assigned Client Identifier, a new one
/// each time [MQTT-3.2.2-16] [MQTT-3.1.3-7], and the session then is that
/// identifier's: connecting with it takes the session over (0x8E).
#[test]
fn empty_client_id_gets_an_assigned_client_identifier() {
    let broker = Broker::two_shards(&[]);
    let mut ids = Vec::new();
    let mut clients = Vec::new();
    for _ in 0..4 {
        let c = Client::v5(broker.mqtt, "", true, Props::new());
        let id = c
            .connack
            .props
            .bytes_of(prop::ASSIGNED_CLIENT_ID)
            .map(<[u8]>::to_vec);
        let id = String::from_utf8(id.expect("Assigned Client Identifier")).unwrap();
        assert!(!id.is_empty() && !ids.contains(&id), "{id} in {ids:?}");
        ids.push(id);
        clients.push(c);
    }
    let _again = Client::v5(broker.mqtt, &ids[0], true, Props::new());
    assert_eq!(clients[0].closed_with(WAIT), Some(0x8E));
}

/// A Session Expiry Interval of 0 at CONNECT cannot become non-zero at
/// DISCONNECT: Protocol Error, DISCONNECT 0x82 (MQTT 5 §3.14.2.2.2); the
/// will is then published.
#[test]
fn session_expiry_zero_made_non_zero_at_disconnect_gets_0x82() {
    let broker = Broker::two_shards(&[]);
    let will_topic = unique("will");
    let mut watcher = Client::v5(broker.mqtt, &unique("watch"), true, Props::new());
    watcher.subscribe(&will_topic, 1);
    let id = unique("sei");
    let connect = wire::Connect {
        will: Some(wire::Will {
            topic: &will_topic,
            payload: b"gone",
            delay_secs: None,
            payload_format: None,
        }),
        ..wire::Connect::v5(&id)
    };
    let mut c = Client::open(broker.mqtt, &connect.encode(), true);
    assert_eq!(c.connack.reason, 0);
    c.send(&packet::disconnect(
        0,
        &Props::new().int(prop::SESSION_EXPIRY, 60),
    ));
    assert_eq!(c.closed_with(WAIT), Some(0x82));
    assert_eq!(watcher.expect_publish().text(), "gone");
}

/// Retain Handling 0 sends retained messages at every subscribe
/// [MQTT-3.3.1-9]; 1 only when the subscription is new [MQTT-3.3.1-10]; 2
/// never [MQTT-3.3.1-11].
#[test]
fn retain_handling_0_1_2() {
    let broker = Broker::two_shards(&[]);
    let topic = unique("rh");
    let mut publisher = Client::v5(broker.mqtt, &unique("pub"), true, Props::new());
    publisher.publish(&topic, 1, true, Props::new(), b"kept");
    for (rh, first, again) in [(0, true, true), (1, true, false), (2, false, false)] {
        let mut c = Client::v5(broker.mqtt, &unique("rh"), true, Props::new());
        for (round, expected) in [("first", first), ("again", again)] {
            c.subscribe(&topic, packet::options(1, false, false, rh));
            match (expected, c.recv(QUIET)) {
                (true, Some(p)) => assert!(p.retain && p.text() == "kept", "{p:?}"),
                (false, None) => {}
                (_, got) => panic!("Retain Handling {rh}, {round} subscribe: got {got:?}"),
            }
        }
    }
}

/// Retain As Published: a live retained message keeps RETAIN=1 for a
/// subscription with Retain As Published [MQTT-3.3.1-13] and has RETAIN=0
/// for one without [MQTT-3.3.1-12].
#[test]
fn retain_as_published_keeps_the_retain_flag_on_live_delivery() {
    let broker = Broker::two_shards(&[]);
    let topic = unique("rap");
    let mut rap = Client::v5(broker.mqtt, &unique("rap"), true, Props::new());
    rap.subscribe(&topic, packet::options(1, false, true, 2));
    let mut plain = Client::v5(broker.mqtt, &unique("plain"), true, Props::new());
    plain.subscribe(&topic, packet::options(1, false, false, 2));
    let mut publisher = Client::v5(broker.mqtt, &unique("pub"), true, Props::new());
    publisher.publish(&topic, 1, true, Props::new(), b"r");
    publisher.publish(&topic, 1, false, Props::new(), b"n");
    let got: Vec<(String, bool)> = (0..2)
        .map(|_| rap.expect_publish())
        .map(|p| (p.text(), p.retain))
        .collect();
    assert_eq!(got, [("r".to_owned(), true), ("n".to_owned(), false)]);
    let got: Vec<(String, bool)> = (0..2)
        .map(|_| plain.expect_publish())
        .map(|p| (p.text(), p.retain))
        .collect();
    assert_eq!(got, [("r".to_owned(), false), ("n".to_owned(), false)]);
}

/// No Local: a client's own messages are not sent back to it on that
/// subscription [MQTT-3.8.3-3]; others' are.
#[test]
fn no_local_skips_the_publisher_itself() {
    let broker = Broker::two_shards(&[]);
    let topic = unique("nl");
    let mut me = Client::v5(broker.mqtt, &unique("me"), true, Props::new());
    me.subscribe(&topic, packet::options(1, true, false, 0));
    me.publish(&topic, 1, false, Props::new(), b"mine");
    let mut other = Client::v5(broker.mqtt, &unique("other"), true, Props::new());
    other.publish(&topic, 1, false, Props::new(), b"theirs");
    assert_eq!(me.expect_publish().text(), "theirs");
    me.expect_no_publish(QUIET);
}

/// An Authentication Method in CONNECT that the broker does not support
/// gets CONNACK 0x8C Bad authentication method and a close
/// [MQTT-4.12.0-1].
#[test]
fn unknown_authentication_method_gets_connack_0x8c() {
    let broker = Broker::two_shards(&[]);
    let props = Props::new().bytes(prop::AUTH_METHOD, b"SCRAM-SHA-1");
    let mut c = Client::open(
        broker.mqtt,
        &packet::connect(&unique("auth"), true, 60, &props),
        true,
    );
    assert_eq!(c.connack.reason, 0x8C);
    assert_eq!(c.closed_with(WAIT), None);
}

/// `$SYS/broker/...` topics are published every `server.sys_interval`
/// (1 s here), retained, with numeric figures; a `#` or `+/...`
/// subscription does not match them [MQTT-4.7.2-1].
#[test]
fn sys_topics_are_published_and_not_matched_by_wildcards() {
    let broker = Broker::two_shards(&["--set", "server.sys_interval=1s"]);
    let mut all = Client::v5(broker.mqtt, &unique("all"), true, Props::new());
    all.subscribe("#", 0);
    all.subscribe("+/broker/uptime", 0);
    let mut sys = Client::v5(broker.mqtt, &unique("sys"), true, Props::new());
    sys.subscribe("$SYS/broker/#", 0);
    let wanted = [
        "$SYS/broker/uptime",
        "$SYS/broker/clients/connected",
        "$SYS/broker/messages/received",
        "$SYS/broker/bytes/received",
    ];
    let mut figures = HashMap::new();
    let deadline = Instant::now() + Duration::from_secs(4);
    while !wanted.iter().all(|t| figures.contains_key(*t)) && Instant::now() < deadline {
        if let Some(p) = sys.recv(Duration::from_millis(200)) {
            figures.insert(p.topic.clone(), p.text());
        }
    }
    for topic in wanted {
        let value = figures
            .get(topic)
            .unwrap_or_else(|| panic!("no {topic} in {figures:?}"));
        let number = value.split_whitespace().next().unwrap_or_default();
        assert!(number.parse::<u64>().is_ok(), "{topic} = {value:?}");
    }
    let mut late = Client::v5(broker.mqtt, &unique("late"), true, Props::new());
    late.subscribe("$SYS/broker/uptime", 0);
    assert!(
        late.recv(WAIT).is_some_and(|p| p.retain),
        "retained for a late subscriber"
    );
    if let Some(p) = all.next_publish(QUIET) {
        panic!("# matched {p:?}");
    }
}

/// MQTT 3.1.1: a second CONNECT is a protocol violation that closes the
/// connection [MQTT-3.1.0-2]; a SUBSCRIBE with no topic filter too
/// [MQTT-3.8.3-3] (3.1.1 numbering).
#[test]
fn mqtt311_second_connect_and_empty_subscribe_close_the_connection() {
    let broker = Broker::two_shards(&[]);
    let mut twice = RawClient::connect(broker.mqtt);
    let connect = wire::Connect::v311(&unique("twice")).encode();
    assert_eq!(twice.handshake(&connect), (0, 0));
    twice.send(&connect);
    assert_eq!(twice.packets_until_closed(WAIT), vec![]);

    let mut empty = RawClient::connect(broker.mqtt);
    assert_eq!(
        empty.handshake(&wire::Connect::v311(&unique("empty")).encode()),
        (0, 0)
    );
    empty.send(&wire::packet(0x82, &[0, 1]));
    assert_eq!(empty.packets_until_closed(WAIT), vec![]);
}

/// UNSUBSCRIBE with the packet's own encoding (MQTT 5 §3.10; `props`
/// `None` for 3.1.1).
fn unsubscribe_packet(packet_id: u16, filters: &[&str], props: Option<&Props>) -> Vec<u8> {
    let mut body = packet_id.to_be_bytes().to_vec();
    if let Some(props) = props {
        body.extend(props.encode());
    }
    for filter in filters {
        body.extend(wire::string(filter.as_bytes()));
    }
    wire::packet(0xA2, &body)
}

/// An UNSUBSCRIBE topic filter the spec forbids (`#` not last,
/// `[MQTT-4.7.1-2]`): MQTT 5 answers UNSUBACK 0x8F for it, 0x00 for the
/// filter that was subscribed and 0x11 for one that was not, one reason
/// code per filter in order `[MQTT-3.11.3-1]`, and keeps the connection;
/// the subscription is gone `[MQTT-3.10.4-1]`. MQTT 3.1.1 closes the
/// connection (a protocol violation, 3.1.1 §4.8) and unsubscribes nothing.
#[test]
fn unsubscribe_of_an_invalid_filter_gets_0x8f_in_v5_and_closes_3_1_1() {
    let broker = Broker::start(&[]);
    let (mut sub, mut publisher) = pair(&broker, "u/a");
    sub.send(&unsubscribe_packet(7, &["u/#/b", "u/a", "u/never"], Some(&Props::new())));
    let (_, body) = sub.wait_for(0xB0, WAIT).expect("UNSUBACK");
    assert_eq!(body[..2], [0, 7], "packet identifier");
    let (_, used) = Props::decode(&body[2..]);
    assert_eq!(body[2 + used..], [0x8F, 0x00, 0x11]);
    assert!(publisher.publish("u/a", 1, false, Props::new(), b"x") < 0x80);
    sub.expect_no_publish(Duration::from_millis(300));

    let id = unique("v311");
    let mut old = Client::v311(broker.mqtt, &id, false);
    old.subscribe("u/c", 1);
    old.send(&unsubscribe_packet(8, &["u/c", "u/#/b"], None));
    assert_eq!(old.closed_with(WAIT), None, "closed without a DISCONNECT (3.1.1)");
    let mut again = Client::v311(broker.mqtt, &id, false);
    assert_eq!(publisher.publish("u/c", 1, false, Props::new(), b"kept"), 0);
    assert_eq!(again.expect_publish().text(), "kept", "the subscription was kept");
}
