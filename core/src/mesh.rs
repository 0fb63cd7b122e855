//! The mesh's frames (DESIGN.md §3, §11): what two replicas say to each
//! other over a mesh link, as bytes. No I/O: the caller reads into a
//! buffer and asks [`decode`] for the next frame, and appends the frames
//! it sends with [`encode`] and [`encode_values`].
//!
//! A frame is `[len: u32][version: u8][kind: u8][body]`, big-endian, `len`
//! counting the bytes after itself (so at least 2). Every frame carries
//! the protocol version it is written in: the Hello and its answer in
//! [`FIRST_VERSION`] (every build reads them), the frames after them in
//! the version the two agreed. This build speaks [`VERSIONS`].
//!
//! Versions (the layout of the frames of version 1 is the same in all):
//! - **1**: as below.
//! - **2** (session 39): version 1 plus a keepalive. The acceptor
//!   answers every [`Frame::Values`], an empty one too, with a
//!   [`Frame::Ack`]; the dialer sends an empty `Values` (numbered after
//!   the last value it sent) when it wrote nothing for a second; either
//!   end closes a link on which it read nothing for a few seconds (a
//!   stopped or frozen peer). A version-1 peer links as before, without
//!   the keepalive.
//! - **3** (session 40): version 2 plus route announces. Once its write
//!   of `mqtt-routes` landed, the dialer announces a filter its replica
//!   now wants (or no longer wants) with the entry's revision
//!   ([`Frame::Route`]); the acceptor applies it on every one of its
//!   shards, merged with what its watch of the bucket says (by revision,
//!   so neither source takes a route backwards), and answers
//!   [`Frame::RouteAck`]. The SUBACK waits for those answers, so a value
//!   published on the acceptor once the client holds its SUBACK reaches
//!   it: the subscription exists, and a value the server takes
//!   ownership of goes to every client with a matching subscription
//!   [MQTT-4.5.0-1], whichever replica took it. A version-1 or 2 peer
//!   links as before, learning routes from the watch alone.
//! - **4** (session 41): version 3 plus each value's *logged* flag: the
//!   sender says whether the value went to its workspace's session log
//!   ([`Value::logged`]). A persistent session reading its log on the
//!   receiving replica skips the live copy of a QoS 1/2 value only when
//!   it did (it reads it from the log); one that did not (the sender did
//!   not know of the session's interest yet: it learns it through the
//!   `mqtt-session-state` watch, moments after the SUBACK) is delivered
//!   live, so a value published just after a persistent subscription's
//!   SUBACK is not missed. From a version-1 to 3 peer every value counts
//!   as logged (the rule before: a reading session skipped every QoS 1/2
//!   value from the mesh).
//! - **5** (session 44): version 4 plus each value's *groups only* flag
//!   ([`Value::groups_only`]): the value is for the shared subscription
//!   groups it names and not for the receiver's plain subscriptions (a
//!   group's value sent on to a member elsewhere after its member here
//!   left). Before, a peer with a plain subscription matching such a
//!   value could not be sent it (its plain subscribers would get it
//!   again), so its members did not get the group's values; a version-1
//!   to 4 peer is still not sent them.
//!
//! A link, from the dialing replica (the sender of values) to the
//! accepting one:
//! 1. the dialer sends [`Frame::Hello`] (the versions it speaks, its
//!    replica ID, its process instance, the link's number);
//! 2. the acceptor answers [`Frame::HelloAck`]: the version chosen (the
//!    highest both speak) and the highest sequence number it delivered on
//!    this link so far (0: none), or a refusal with its reason;
//! 3. the dialer sends [`Frame::Values`] batches, each numbered from its
//!    first value's sequence number, starting after the one the acceptor
//!    said it has; the acceptor answers [`Frame::Ack`] with the highest
//!    sequence number it delivered.
//!
//! Bounds: a frame longer than the `max_frame` the caller gives (the
//! largest allowed packet plus [`FRAME_OVERHEAD`]) is refused before it
//! is read ([`FrameError::TooLarge`]); every count inside a frame is
//! checked against the bytes that are really there.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use bytestring::ByteString;

use crate::packet::codec::{decode_publish_properties, encode_publish_properties};
use crate::packet::{Props, QoS};

/// The version of the Hello and its answer (every build reads them).
pub const FIRST_VERSION: u16 = 1;

/// The first version with the keepalive (see the module documentation).
pub const KEEPALIVE_VERSION: u16 = 2;

/// The first version with route announces (see the module
/// documentation).
pub const ANNOUNCE_VERSION: u16 = 3;

/// The first version with the logged flag on values (see the module
/// documentation).
pub const LOGGED_VERSION: u16 = 4;

/// The first version with the groups-only flag on values (see the
/// module documentation).
pub const GROUPS_ONLY_VERSION: u16 = 5;

/// Every mesh protocol version this build speaks, lowest first (a
/// process may offer fewer: the shards' `mesh::spoken`).
pub const VERSIONS: &[u16] = &[1, 2, 3, 4, 5];

/// Bytes a frame may hold beyond the largest allowed packet: the frame
/// and value headers, and the batch around the values.
pub const FRAME_OVERHEAD: usize = 64 << 10;

/// The frame header: length (4), version (1), kind (1).
pub const HEADER_BYTES: usize = 6;

/// The most shared subscription groups one value names.
pub const MAX_GROUPS: usize = 255;

/// The largest frame for a replica whose largest allowed packet is
/// `max_packet_size` bytes.
pub fn max_frame(max_packet_size: usize) -> usize {
    max_packet_size.saturating_add(FRAME_OVERHEAD)
}

/// The highest version in both `ours` and `theirs`, if any.
pub fn choose_version(ours: &[u16], theirs: &[u16]) -> Option<u16> {
    ours.iter().filter(|v| theirs.contains(v)).max().copied()
}

/// Why an acceptor refused a link ([`Frame::HelloAck`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Refusal {
    /// No protocol version in common.
    NoCommonVersion,
    /// The client certificate does not name the replica the Hello claims.
    NameMismatch,
    /// The Hello names the accepting replica itself.
    Myself,
}

impl Refusal {
    fn code(self) -> u8 {
        match self {
            Refusal::NoCommonVersion => 1,
            Refusal::NameMismatch => 2,
            Refusal::Myself => 3,
        }
    }

    fn from_code(code: u8) -> Option<Refusal> {
        match code {
            1 => Some(Refusal::NoCommonVersion),
            2 => Some(Refusal::NameMismatch),
            3 => Some(Refusal::Myself),
            _ => None,
        }
    }

    /// A short label, e.g. for `fleetmq_mesh_refused_total{reason}`.
    pub fn as_str(self) -> &'static str {
        match self {
            Refusal::NoCommonVersion => "version",
            Refusal::NameMismatch => "name",
            Refusal::Myself => "myself",
        }
    }
}

/// One value on the mesh: a PUBLISH accepted by the sending replica, as
/// the receiving replica's subscribers get it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Value {
    /// The topic name (with its workspace prefix, as the broker keeps it).
    pub topic: ByteString,
    /// The payload.
    pub payload: Bytes,
    /// The QoS it was published with.
    pub qos: QoS,
    /// The RETAIN flag it was published with.
    pub retain: bool,
    /// The properties that travel with a message (see
    /// `session::Message::properties`); its Message Expiry Interval is
    /// the number of seconds left when it was sent.
    pub properties: Props,
    /// The publisher's origin hash (`session::Message::origin`).
    pub origin: u64,
    /// The shared subscription groups the sender picked the receiving
    /// replica for (at most [`MAX_GROUPS`]); empty: for no group.
    pub groups: Vec<ByteString>,
    /// The sender appended it to its workspace's session log (QoS 1/2, a
    /// persistent session wanted it). Sent from version
    /// [`LOGGED_VERSION`]; read as `true` from frames of earlier versions.
    pub logged: bool,
    /// For the `groups` only, not for the receiver's plain subscriptions
    /// (with `groups` only). Sent from version [`GROUPS_ONLY_VERSION`];
    /// read as `false` from frames of earlier versions.
    pub groups_only: bool,
}

/// One frame, decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    /// The dialer's first frame.
    Hello {
        /// The protocol versions it speaks.
        versions: Vec<u16>,
        /// Its replica ID (its certificate must name it).
        replica: String,
        /// Its process instance (a new one after each restart).
        instance: String,
        /// The link's number among the dialer's links to this replica
        /// (its shard).
        link: u32,
    },
    /// The acceptor's answer to a Hello.
    HelloAck(Result<Accepted, Refusal>),
    /// A batch of values numbered `first`, `first + 1`, ...
    Values {
        /// The first value's sequence number (from 1).
        first: u64,
        /// The values, in order.
        values: Vec<Value>,
    },
    /// The highest sequence number the receiver delivered.
    Ack {
        /// That sequence number.
        delivered: u64,
    },
    /// Version 3, dialer to acceptor: the dialer's replica wants `filter`
    /// (`present`) or no longer does, as its entry in `mqtt-routes` says
    /// at `revision`. The replica is the link's (its Hello, checked
    /// against its certificate).
    Route {
        /// Numbers the announce on the link: the answer names it.
        id: u64,
        /// The revision of the write (put or delete) in `mqtt-routes`.
        revision: u64,
        /// Wanted (a put) or not (a delete).
        present: bool,
        /// The process that wrote it (the member record's instance).
        instance: String,
        /// The filter as the entry holds it (workspace prefix,
        /// `$share/<group>/<filter>` for a shared subscription).
        filter: String,
    },
    /// Version 3, acceptor to dialer: the announce `id` is applied on
    /// every shard of the acceptor (or older than what they have).
    RouteAck {
        /// The announce's number.
        id: u64,
    },
}

/// What an acceptor that took a link answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Accepted {
    /// The version both speak from now on.
    pub version: u16,
    /// The highest sequence number delivered on this link (0: none): the
    /// dialer sends from the one after.
    pub delivered: u64,
}

/// Why bytes are not a frame.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FrameError {
    /// The length field says more than the largest frame allowed.
    #[error("mesh frame of {len} bytes is over the limit of {max}")]
    TooLarge {
        /// The length the frame claims.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// A frame in a protocol version this build does not speak.
    #[error("mesh frame in protocol version {0}, which this build does not speak")]
    Version(u8),
    /// The bytes do not make a frame (a bad kind, a count past the end,
    /// a string that is not UTF-8, ...).
    #[error("malformed mesh frame: {0}")]
    Malformed(&'static str),
}

const HELLO: u8 = 1;
const HELLO_ACK: u8 = 2;
const VALUES: u8 = 3;
const ACK: u8 = 4;
const ROUTE: u8 = 5;
const ROUTE_ACK: u8 = 6;

const FLAG_RETAIN: u8 = 4;
const FLAG_EXPIRY: u8 = 8;
const FLAG_GROUPS: u8 = 16;
/// From [`LOGGED_VERSION`]: [`Value::logged`].
const FLAG_LOGGED: u8 = 32;
/// From [`GROUPS_ONLY_VERSION`]: [`Value::groups_only`].
const FLAG_GROUPS_ONLY: u8 = 64;

/// Take the next frame from the front of `buf`: `Ok(None)` when `buf`
/// does not hold a whole frame yet (read more and call again).
///
/// # Errors
/// [`FrameError`]: the link is broken and must be closed (what follows
/// cannot be framed). The frame's bytes are consumed either way once its
/// length was read; a too large frame consumes nothing.
pub fn decode(buf: &mut BytesMut, max_frame: usize) -> Result<Option<Frame>, FrameError> {
    if buf.len() < 4 {
        return Ok(None);
    }
    let len = u32::from_be_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
    if len > max_frame {
        return Err(FrameError::TooLarge { len, max: max_frame });
    }
    if len < 2 {
        return Err(FrameError::Malformed("frame shorter than its header"));
    }
    if buf.len() < 4 + len {
        buf.reserve(4 + len - buf.len());
        return Ok(None);
    }
    buf.advance(4);
    let body = buf.split_to(len).freeze();
    decode_body(body).map(Some)
}

fn decode_body(mut body: Bytes) -> Result<Frame, FrameError> {
    let version = body.get_u8();
    if !VERSIONS.contains(&u16::from(version)) {
        return Err(FrameError::Version(version));
    }
    let kind = body.get_u8();
    let mut r = Reader(body);
    let frame = match kind {
        HELLO => {
            let n = r.u8()?;
            let versions = (0..n).map(|_| r.u16()).collect::<Result<Vec<_>, _>>()?;
            Frame::Hello { versions, replica: r.string()?.to_string(), instance: r.string()?.to_string(), link: r.u32()? }
        }
        HELLO_ACK => match r.u8()? {
            0 => Frame::HelloAck(Ok(Accepted { version: r.u16()?, delivered: r.u64()? })),
            1 => Frame::HelloAck(Err(Refusal::from_code(r.u8()?).ok_or(FrameError::Malformed("refusal reason"))?)),
            _ => return Err(FrameError::Malformed("hello answer")),
        },
        VALUES => {
            let first = r.u64()?;
            let n = r.u32()? as usize;
            // Each value takes at least 15 bytes: no allocation past what
            // the frame can hold.
            let mut values = Vec::with_capacity(n.min(r.0.len() / 15));
            for _ in 0..n {
                values.push(r.value(u16::from(version))?);
            }
            if first == 0 || first.checked_add(n as u64).is_none() {
                return Err(FrameError::Malformed("sequence numbers"));
            }
            Frame::Values { first, values }
        }
        ACK => Frame::Ack { delivered: r.u64()? },
        ROUTE | ROUTE_ACK if u16::from(version) < ANNOUNCE_VERSION => {
            return Err(FrameError::Malformed("route announce before version 3"))
        }
        ROUTE => {
            let (id, revision) = (r.u64()?, r.u64()?);
            let present = match r.u8()? {
                0 => false,
                1 => true,
                _ => return Err(FrameError::Malformed("route announce flag")),
            };
            Frame::Route { id, revision, present, instance: r.string()?.to_string(), filter: r.string()?.to_string() }
        }
        ROUTE_ACK => Frame::RouteAck { id: r.u64()? },
        _ => return Err(FrameError::Malformed("frame kind")),
    };
    if !r.0.is_empty() {
        return Err(FrameError::Malformed("bytes after the frame"));
    }
    Ok(frame)
}

/// Append `frame`, written in protocol `version`, to `out`. A
/// [`Frame::Values`] is written as [`encode_values`] does. A filter or
/// instance longer than 65,535 bytes is cut (a filter is at most a
/// packet's topic filter, 65,535 bytes, plus its workspace prefix: the
/// caller does not announce such a one).
pub fn encode(frame: &Frame, version: u16, out: &mut BytesMut) {
    let start = begin(out, version, frame_kind(frame));
    match frame {
        Frame::Hello { versions, replica, instance, link } => {
            let n = versions.len().min(255);
            out.put_u8(n as u8);
            versions[..n].iter().for_each(|v| out.put_u16(*v));
            put_str(out, replica);
            put_str(out, instance);
            out.put_u32(*link);
        }
        Frame::HelloAck(Ok(accepted)) => {
            out.put_u8(0);
            out.put_u16(accepted.version);
            out.put_u64(accepted.delivered);
        }
        Frame::HelloAck(Err(refusal)) => {
            out.put_u8(1);
            out.put_u8(refusal.code());
        }
        Frame::Values { first, values } => {
            out.put_u64(*first);
            out.put_u32(values.len() as u32);
            for v in values {
                put_value(out, &ValueRef::from(v), version);
            }
        }
        Frame::Ack { delivered } => out.put_u64(*delivered),
        Frame::Route { id, revision, present, instance, filter } => {
            out.put_u64(*id);
            out.put_u64(*revision);
            out.put_u8(u8::from(*present));
            put_str(out, instance);
            put_str(out, filter);
        }
        Frame::RouteAck { id } => out.put_u64(*id),
    }
    finish(out, start);
}

/// A value to send, borrowed from wherever the sender keeps it.
#[derive(Debug, Clone, Copy)]
pub struct ValueRef<'a> {
    /// See [`Value::topic`].
    pub topic: &'a str,
    /// See [`Value::payload`].
    pub payload: &'a [u8],
    /// See [`Value::qos`].
    pub qos: QoS,
    /// See [`Value::retain`].
    pub retain: bool,
    /// See [`Value::properties`] (its Message Expiry Interval is not
    /// read: `expiry_left` is sent instead).
    pub properties: &'a Props,
    /// Seconds of the Message Expiry Interval left; `None`: no expiry.
    pub expiry_left: Option<u32>,
    /// See [`Value::origin`].
    pub origin: u64,
    /// See [`Value::groups`].
    pub groups: &'a [ByteString],
    /// See [`Value::logged`].
    pub logged: bool,
    /// See [`Value::groups_only`].
    pub groups_only: bool,
}

impl<'a> From<&'a Value> for ValueRef<'a> {
    fn from(v: &'a Value) -> Self {
        ValueRef {
            topic: &v.topic,
            payload: &v.payload,
            qos: v.qos,
            retain: v.retain,
            properties: &v.properties,
            expiry_left: v.properties.message_expiry_interval,
            origin: v.origin,
            groups: &v.groups,
            logged: v.logged,
            groups_only: v.groups_only,
        }
    }
}

impl ValueRef<'_> {
    /// An upper bound of the bytes [`encode_values`] writes for it (the
    /// properties counted as their packet encoding's size bound).
    pub fn encoded_len_bound(&self) -> usize {
        let groups: usize = self.groups.iter().map(|g| 2 + g.len()).sum();
        let props = if self.properties.is_empty() { 1 } else { props_len(self.properties) };
        1 + 2 + self.topic.len() + 8 + 4 + 2 + groups + props + 4 + self.payload.len()
    }
}

fn props_len(p: &Props) -> usize {
    let mut scratch = BytesMut::new();
    let _ = encode_publish_properties(p, &mut scratch);
    scratch.len()
}

/// Append one [`Frame::Values`] frame, written in protocol `version`,
/// numbered from `first` holding `values` (none: the keepalive of
/// version 2).
pub fn encode_values<'a>(
    first: u64,
    version: u16,
    values: impl ExactSizeIterator<Item = ValueRef<'a>>,
    out: &mut BytesMut,
) {
    let start = begin(out, version, VALUES);
    out.put_u64(first);
    out.put_u32(values.len() as u32);
    for v in values {
        put_value(out, &v, version);
    }
    finish(out, start);
}

fn frame_kind(frame: &Frame) -> u8 {
    match frame {
        Frame::Hello { .. } => HELLO,
        Frame::HelloAck(_) => HELLO_ACK,
        Frame::Values { .. } => VALUES,
        Frame::Ack { .. } => ACK,
        Frame::Route { .. } => ROUTE,
        Frame::RouteAck { .. } => ROUTE_ACK,
    }
}

fn begin(out: &mut BytesMut, version: u16, kind: u8) -> usize {
    let start = out.len();
    out.put_u32(0);
    out.put_u8(version as u8);
    out.put_u8(kind);
    start
}

fn finish(out: &mut BytesMut, start: usize) {
    let len = (out.len() - start - 4) as u32;
    out[start..start + 4].copy_from_slice(&len.to_be_bytes());
}

fn put_str(out: &mut BytesMut, s: &str) {
    let n = s.len().min(usize::from(u16::MAX));
    // Cut on a character boundary (strings here are short in practice).
    let n = (0..=n).rev().find(|&i| s.is_char_boundary(i)).unwrap_or(0);
    out.put_u16(n as u16);
    out.put_slice(&s.as_bytes()[..n]);
}

fn put_value(out: &mut BytesMut, v: &ValueRef<'_>, version: u16) {
    let groups = &v.groups[..v.groups.len().min(MAX_GROUPS)];
    let mut flags = v.qos as u8;
    if v.retain {
        flags |= FLAG_RETAIN;
    }
    if v.expiry_left.is_some() {
        flags |= FLAG_EXPIRY;
    }
    if !groups.is_empty() {
        flags |= FLAG_GROUPS;
    }
    if v.logged && version >= LOGGED_VERSION {
        flags |= FLAG_LOGGED;
    }
    if v.groups_only && !groups.is_empty() && version >= GROUPS_ONLY_VERSION {
        flags |= FLAG_GROUPS_ONLY;
    }
    out.put_u8(flags);
    put_str(out, v.topic);
    out.put_u64(v.origin);
    if let Some(left) = v.expiry_left {
        out.put_u32(left);
    }
    if !groups.is_empty() {
        out.put_u8(groups.len() as u8);
        groups.iter().for_each(|g| put_str(out, g));
    }
    if encode_publish_properties(v.properties, out).is_err() {
        // Properties a PUBLISH carried always fit; none rather than a
        // broken frame.
        out.put_u8(0);
    }
    out.put_u32(v.payload.len() as u32);
    out.put_slice(v.payload);
}

struct Reader(Bytes);

impl Reader {
    fn need(&self, n: usize) -> Result<(), FrameError> {
        if self.0.len() < n {
            return Err(FrameError::Malformed("field past the end of the frame"));
        }
        Ok(())
    }
    fn u8(&mut self) -> Result<u8, FrameError> {
        self.need(1)?;
        Ok(self.0.get_u8())
    }
    fn u16(&mut self) -> Result<u16, FrameError> {
        self.need(2)?;
        Ok(self.0.get_u16())
    }
    fn u32(&mut self) -> Result<u32, FrameError> {
        self.need(4)?;
        Ok(self.0.get_u32())
    }
    fn u64(&mut self) -> Result<u64, FrameError> {
        self.need(8)?;
        Ok(self.0.get_u64())
    }
    fn string(&mut self) -> Result<ByteString, FrameError> {
        let n = usize::from(self.u16()?);
        self.need(n)?;
        ByteString::try_from(self.0.split_to(n)).map_err(|_| FrameError::Malformed("string that is not UTF-8"))
    }
    /// A value of a frame written in `version`.
    fn value(&mut self, version: u16) -> Result<Value, FrameError> {
        let flags = self.u8()?;
        let mut known = if version >= LOGGED_VERSION { FLAG_LOGGED } else { 0 };
        if version >= GROUPS_ONLY_VERSION {
            known |= FLAG_GROUPS_ONLY;
        }
        if flags & !(3 | FLAG_RETAIN | FLAG_EXPIRY | FLAG_GROUPS | known) != 0 {
            return Err(FrameError::Malformed("value flags"));
        }
        if flags & FLAG_GROUPS_ONLY != 0 && flags & FLAG_GROUPS == 0 {
            return Err(FrameError::Malformed("a value for its groups only without groups"));
        }
        let logged = version < LOGGED_VERSION || flags & FLAG_LOGGED != 0;
        let groups_only = flags & FLAG_GROUPS_ONLY != 0;
        let qos = QoS::from_u8(flags & 3).ok_or(FrameError::Malformed("QoS 3"))?;
        let topic = self.string()?;
        let origin = self.u64()?;
        let expiry = if flags & FLAG_EXPIRY != 0 { Some(self.u32()?) } else { None };
        let mut groups = Vec::new();
        if flags & FLAG_GROUPS != 0 {
            let n = self.u8()?;
            for _ in 0..n {
                groups.push(self.string()?);
            }
        }
        let (mut properties, rest) = decode_publish_properties(std::mem::take(&mut self.0))
            .map_err(|_| FrameError::Malformed("properties"))?;
        self.0 = rest;
        // Never kept on a message: sent by mistake, dropped here.
        if properties.topic_alias.is_some() || !properties.subscription_identifiers.is_empty() {
            properties.topic_alias = None;
            properties.subscription_identifiers.clear();
        }
        if properties.message_expiry_interval != expiry {
            properties.message_expiry_interval = expiry;
        }
        let n = self.u32()? as usize;
        self.need(n)?;
        let payload = self.0.split_to(n);
        Ok(Value { topic, payload, qos, retain: flags & FLAG_RETAIN != 0, properties, origin, groups, logged, groups_only })
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::packet::Properties;

    fn text() -> impl Strategy<Value = ByteString> {
        "[a-z/+#é]{0,12}".prop_map(ByteString::from)
    }

    fn value() -> impl Strategy<Value = Value> {
        (
            text(),
            prop::collection::vec(any::<u8>(), 0..64),
            0u8..3,
            any::<bool>(),
            prop::option::of(any::<u32>()),
            any::<u64>(),
            prop::collection::vec(text(), 0..3),
            (prop::option::of(text()), any::<bool>(), any::<bool>()),
        )
            .prop_map(|(topic, payload, qos, retain, expiry, origin, groups, (content_type, logged, only))| Value {
                topic,
                payload: payload.into(),
                qos: QoS::from_u8(qos).unwrap(),
                retain,
                properties: Props::from(Properties {
                    message_expiry_interval: expiry,
                    content_type: content_type.map(|c| c.to_string().into()),
                    ..Properties::default()
                }),
                origin,
                groups_only: only && !groups.is_empty(),
                groups,
                logged,
            })
    }

    fn frame() -> impl Strategy<Value = Frame> {
        prop_oneof![
            (prop::collection::vec(any::<u16>(), 0..4), "[a-z0-9-]{0,20}", "[0-9a-f]{0,16}", any::<u32>())
                .prop_map(|(versions, replica, instance, link)| Frame::Hello { versions, replica, instance, link }),
            (any::<u16>(), any::<u64>())
                .prop_map(|(version, delivered)| Frame::HelloAck(Ok(Accepted { version, delivered }))),
            prop::sample::select(vec![Refusal::NoCommonVersion, Refusal::NameMismatch, Refusal::Myself])
                .prop_map(|r| Frame::HelloAck(Err(r))),
            (1u64..u64::MAX / 2, prop::collection::vec(value(), 0..5))
                .prop_map(|(first, values)| Frame::Values { first, values }),
            any::<u64>().prop_map(|delivered| Frame::Ack { delivered }),
            (any::<u64>(), any::<u64>(), any::<bool>(), "[0-9a-f]{0,16}", "\\PC{0,40}").prop_map(
                |(id, revision, present, instance, filter)| Frame::Route { id, revision, present, instance, filter }
            ),
            any::<u64>().prop_map(|id| Frame::RouteAck { id }),
        ]
    }

    proptest! {
        #[test]
        fn frames_read_back_as_written(frames in prop::collection::vec(frame(), 1..4)) {
            let mut buf = BytesMut::new();
            frames.iter().for_each(|f| encode(f, GROUPS_ONLY_VERSION, &mut buf));
            for f in &frames {
                let got = decode(&mut buf, 1 << 20).unwrap();
                prop_assert_eq!(got.as_ref(), Some(f));
            }
            prop_assert!(buf.is_empty());
        }

        #[test]
        fn a_frame_cut_anywhere_asks_for_more_bytes(f in frame(), cut in any::<prop::sample::Index>()) {
            let mut whole = BytesMut::new();
            encode(&f, 1, &mut whole);
            let mut part = BytesMut::from(&whole[..cut.index(whole.len())]);
            prop_assert_eq!(decode(&mut part, 1 << 20), Ok(None));
        }

        #[test]
        fn any_bytes_give_an_answer_without_panicking(bytes in prop::collection::vec(any::<u8>(), 0..300)) {
            let mut buf = BytesMut::from(&bytes[..]);
            while let Ok(Some(_)) = decode(&mut buf, 1 << 10) {}
        }

        #[test]
        fn a_frame_body_with_any_bytes_gives_an_answer(kind in 1u8..6, body in prop::collection::vec(any::<u8>(), 0..300)) {
            let mut buf = BytesMut::new();
            buf.put_u32(body.len() as u32 + 2);
            buf.put_u8(1);
            buf.put_u8(kind);
            buf.put_slice(&body);
            let _ = decode(&mut buf, 1 << 10);
        }
    }

    #[test]
    fn a_frame_over_the_limit_is_refused_before_it_is_read() {
        let mut buf = BytesMut::new();
        buf.put_u32(2_000_000);
        assert_eq!(decode(&mut buf, max_frame(1 << 20)), Err(FrameError::TooLarge { len: 2_000_000, max: (1 << 20) + FRAME_OVERHEAD }));
        let mut buf = BytesMut::from(&[0, 0, 0, 2, 9, 3][..]);
        assert_eq!(decode(&mut buf, 100), Err(FrameError::Version(9)));
    }

    #[test]
    fn the_groups_only_flag_travels_from_version_5_and_earlier_versions_read_it_as_unset() {
        let groups = [ByteString::from("g")];
        let v = ValueRef {
            topic: "a/b",
            payload: b"x",
            qos: QoS::AtLeastOnce,
            retain: false,
            properties: &Props::default(),
            expiry_left: None,
            origin: 1,
            groups: &groups,
            logged: true,
            groups_only: true,
        };
        for (version, read) in [(GROUPS_ONLY_VERSION, true), (LOGGED_VERSION, false)] {
            let mut buf = BytesMut::new();
            encode_values(1, version, [v].into_iter(), &mut buf);
            let Some(Frame::Values { values, .. }) = decode(&mut buf, 1 << 10).unwrap() else { panic!() };
            assert_eq!(values[0].groups_only, read, "version {version}");
        }
        // Without groups it is not written, and a frame saying so is malformed.
        let mut buf = BytesMut::new();
        encode_values(1, GROUPS_ONLY_VERSION, [ValueRef { groups: &[], ..v }].into_iter(), &mut buf);
        let Some(Frame::Values { values, .. }) = decode(&mut buf, 1 << 10).unwrap() else { panic!() };
        assert!(!values[0].groups_only);
        let mut buf = BytesMut::new();
        encode_values(1, GROUPS_ONLY_VERSION, [ValueRef { groups: &[], ..v }].into_iter(), &mut buf);
        let flags_at = HEADER_BYTES + 8 + 4;
        buf[flags_at] |= FLAG_GROUPS_ONLY;
        assert_eq!(decode(&mut buf, 1 << 10), Err(FrameError::Malformed("a value for its groups only without groups")));
    }

    #[test]
    fn the_expiry_sent_is_the_time_left_not_the_interval() {
        let properties = Props::from(Properties { message_expiry_interval: Some(60), ..Properties::default() });
        let v = ValueRef {
            topic: "a/b",
            payload: b"x",
            qos: QoS::AtLeastOnce,
            retain: true,
            properties: &properties,
            expiry_left: Some(7),
            origin: 5,
            groups: &[],
            logged: false,
            groups_only: false,
        };
        let mut buf = BytesMut::new();
        encode_values(3, 2, [v].into_iter(), &mut buf);
        assert!(v.encoded_len_bound() + HEADER_BYTES + 12 >= buf.len());
        let Some(Frame::Values { first: 3, values }) = decode(&mut buf, 1 << 10).unwrap() else { panic!() };
        assert_eq!(values[0].properties.message_expiry_interval, Some(7));
        assert!(values[0].retain && values[0].qos == QoS::AtLeastOnce && values[0].origin == 5);
    }

    #[test]
    fn a_frame_in_a_version_this_build_speaks_is_read_and_another_refused() {
        for version in VERSIONS {
            let mut buf = BytesMut::new();
            encode(&Frame::Ack { delivered: 7 }, *version, &mut buf);
            assert_eq!(buf[4], *version as u8);
            assert_eq!(decode(&mut buf, 100), Ok(Some(Frame::Ack { delivered: 7 })));
        }
        let mut buf = BytesMut::new();
        encode(&Frame::Ack { delivered: 7 }, 6, &mut buf);
        assert_eq!(decode(&mut buf, 100), Err(FrameError::Version(6)));
        // A route announce is a version-3 frame: in an earlier version it
        // is malformed (a peer that agreed version 2 never sends one).
        let route = Frame::Route { id: 1, revision: 9, present: true, instance: "i".into(), filter: "a/#".into() };
        let mut buf = BytesMut::new();
        encode(&route, KEEPALIVE_VERSION, &mut buf);
        assert!(matches!(decode(&mut buf, 100), Err(FrameError::Malformed(_))));
        let mut buf = BytesMut::new();
        encode(&route, ANNOUNCE_VERSION, &mut buf);
        assert_eq!(decode(&mut buf, 100), Ok(Some(route)));
        // The keepalive: an empty Values frame.
        let mut buf = BytesMut::new();
        encode_values(5, KEEPALIVE_VERSION, std::iter::empty(), &mut buf);
        assert_eq!(decode(&mut buf, 100), Ok(Some(Frame::Values { first: 5, values: vec![] })));
    }

    #[test]
    fn the_logged_flag_travels_from_version_4_and_earlier_versions_read_as_logged() {
        let properties = Props::default();
        let v = |logged| ValueRef {
            topic: "a",
            payload: b"x",
            qos: QoS::AtLeastOnce,
            retain: false,
            properties: &properties,
            expiry_left: None,
            origin: 1,
            groups: &[],
            logged,
            groups_only: false,
        };
        for (version, logged, read) in [(LOGGED_VERSION, false, false), (LOGGED_VERSION, true, true), (ANNOUNCE_VERSION, false, true)] {
            let mut buf = BytesMut::new();
            encode_values(1, version, [v(logged)].into_iter(), &mut buf);
            let Some(Frame::Values { values, .. }) = decode(&mut buf, 1 << 10).unwrap() else { panic!() };
            assert_eq!(values[0].logged, read, "version {version}, sent {logged}");
        }
        // The flag in a version-3 frame is not a flag of that version.
        let mut buf = BytesMut::new();
        encode_values(1, LOGGED_VERSION, [v(true)].into_iter(), &mut buf);
        buf[4] = ANNOUNCE_VERSION as u8;
        assert_eq!(decode(&mut buf, 1 << 10), Err(FrameError::Malformed("value flags")));
    }

    #[test]
    fn the_version_is_the_highest_both_speak() {
        assert_eq!(choose_version(VERSIONS, &[1]), Some(1), "a version-1 peer links without the keepalive");
        assert_eq!(choose_version(VERSIONS, &[1, 2]), Some(2), "a version-2 peer links without announces");
        assert_eq!(choose_version(VERSIONS, &[1, 2, 3]), Some(3), "a version-3 peer links without the logged flag");
        assert_eq!(choose_version(VERSIONS, &[1, 2, 3, 4]), Some(4), "a version-4 peer links without the groups-only flag");
        assert_eq!(choose_version(VERSIONS, &[1, 2, 3, 4, 5]), Some(5));
        assert_eq!(choose_version(&[1, 2], &[2, 3]), Some(2));
        assert_eq!(choose_version(&[1], &[2]), None);
    }
}
