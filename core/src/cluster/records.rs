//! The records a replica stores in JetStream, and their keys (DESIGN.md
//! §4). Pure data: encode to bytes, decode from bytes.
//!
//! Every record carries its `format`; a replica reads the formats in
//! [`FORMATS_READ`] and writes [`FORMAT`]. The format floor (the
//! `mqtt-cluster-floor` bucket, key [`FLOOR_KEY`]) is the oldest format a
//! replica must read to join: one that cannot read it refuses to start.
//!
//! Records are JSON (`nats kv get` shows them as they are); keys are made
//! from client identifiers with [`client_key`], which maps any UTF-8
//! string onto the KV key alphabet `[-/_=.a-zA-Z0-9]`.

use std::ops::RangeInclusive;

use serde::{de::DeserializeOwned, Deserialize, Serialize};

/// The newest record format this build writes. Format 2 changed only the
/// retained record's layout (its payload carried raw, see
/// [`crate::cluster::retained`]); the JSON records have the same fields in
/// 1 and 2.
pub const FORMAT: u16 = 2;

/// The record formats this build reads.
pub const FORMATS_READ: RangeInclusive<u16> = 1..=2;

/// The format to write in a cluster whose format floor is `floor`: the
/// floor itself (every member reads it, DESIGN.md §6 "rolling upgrade"),
/// at most [`FORMAT`].
pub fn write_format(floor: u16) -> u16 {
    floor.clamp(*FORMATS_READ.start(), FORMAT)
}

/// The key of the format floor in `mqtt-cluster-floor`.
pub const FLOOR_KEY: &str = "floor";

/// The KV buckets of DESIGN.md §4, each the stream `KV_<bucket>`.
pub mod bucket {
    /// Live replicas; entries expire `member_ttl` after their last write.
    pub const MEMBERS: &str = "mqtt-members";
    /// Which replica and connection owns each client identifier.
    pub const SESSIONS: &str = "mqtt-sessions";
    /// One retained message per topic.
    pub const RETAINED: &str = "mqtt-retained";
    /// Each connection's will, with the identity that declared it.
    pub const WILLS: &str = "mqtt-session-will";
    /// Each persistent session (the persistent-sessions issue).
    pub const SESSION_STATE: &str = "mqtt-session-state";
    /// Each persistent session's read position (the persistent-sessions issue).
    pub const SESSION_CURSOR: &str = "mqtt-session-cursor";
    /// Open inbound QoS 2 flows of persistent sessions.
    pub const SESSION_QOS2: &str = "mqtt-session-qos2";
    /// The format floor.
    pub const FLOOR: &str = "mqtt-cluster-floor";
    /// Which replica wants which topic filters (the mesh issue).
    pub const ROUTES: &str = "mqtt-routes";
    /// The leader lock that elects the sweeper.
    pub const LEADER: &str = "mqtt-leader";

    /// Every bucket a replica creates at start.
    pub const ALL: [&str; 10] = [
        MEMBERS,
        SESSIONS,
        RETAINED,
        WILLS,
        SESSION_STATE,
        SESSION_CURSOR,
        SESSION_QOS2,
        FLOOR,
        ROUTES,
        LEADER,
    ];
}

/// Why a stored record could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RecordError {
    /// The bytes are not a record of the expected kind.
    #[error("malformed record: {0}")]
    Malformed(String),
    /// The record is in a format this build does not read.
    #[error("record format {0} is not read by this build (reads {min}..={max})", min = FORMATS_READ.start(), max = FORMATS_READ.end())]
    UnknownFormat(u16),
}

/// A stored record: serialized with its format, checked on decode.
pub trait Record: Serialize + DeserializeOwned {
    /// The record's format field.
    fn format(&self) -> u16;

    /// The record as stored.
    fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("records serialize")
    }

    /// A record read back.
    ///
    /// # Errors
    /// [`RecordError::Malformed`] for bytes that are not this record,
    /// [`RecordError::UnknownFormat`] for a format outside [`FORMATS_READ`].
    fn decode(bytes: &[u8]) -> Result<Self, RecordError> {
        #[derive(Deserialize)]
        struct Probe {
            format: u16,
        }
        let probe: Probe =
            serde_json::from_slice(bytes).map_err(|e| RecordError::Malformed(e.to_string()))?;
        if !FORMATS_READ.contains(&probe.format) {
            return Err(RecordError::UnknownFormat(probe.format));
        }
        serde_json::from_slice(bytes).map_err(|e| RecordError::Malformed(e.to_string()))
    }
}

/// A replica's entry in `mqtt-members` (key: the replica ID), rewritten
/// every T/10 with a TTL of T.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberRecord {
    /// Record format ([`FORMAT`]).
    pub format: u16,
    /// The replica ID (`cluster.replica_id`).
    pub replica: String,
    /// A random identifier of this process: two processes started with one
    /// replica ID tell each other apart by it.
    pub instance: String,
    /// When this process started, Unix milliseconds.
    pub started_at_ms: u64,
    /// `member_ttl` in milliseconds (the same on every replica).
    pub member_ttl_ms: u64,
    /// The address other replicas dial for the mesh (`mesh_advertise`).
    pub mesh: String,
    /// The mesh protocol versions this replica speaks.
    pub mesh_versions: Vec<u16>,
    /// The oldest and newest record formats this replica reads.
    pub reads: [u16; 2],
    /// How many times this process has come back from a fence: the wills
    /// and ownership entries it wrote at an older epoch were handed over
    /// to the cluster at that fence (DESIGN.md §5).
    #[serde(default)]
    pub epoch: u64,
    /// The process stops (a clean stop): written just before the entry is
    /// deleted, so that the others log it as stopped rather than gone.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub leaving: bool,
    /// The instance of the process that ran this replica ID before and
    /// stopped cleanly (this one read its leaving entry and took over).
    /// The leaving entry can be replaced by this process's first one
    /// before a watcher read it (one value per key): a watcher that finds
    /// here the instance it knew logs it as stopped, not gone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub follows: Option<String>,
}

impl Record for MemberRecord {
    fn format(&self) -> u16 {
        self.format
    }
}

/// The owner of a client identifier in `mqtt-sessions` (key:
/// [`client_key`]): the replica and connection that serves it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OwnerRecord {
    /// Record format ([`FORMAT`]).
    pub format: u16,
    /// The client identifier.
    pub client_id: String,
    /// The owning replica ID.
    pub replica: String,
    /// The owning process ([`MemberRecord::instance`]).
    pub instance: String,
    /// The connection on that process, unique for the process's life.
    pub conn: u64,
    /// When the claim was made, Unix milliseconds.
    pub claimed_at_ms: u64,
    /// The owning process's [`MemberRecord::epoch`] when it claimed.
    #[serde(default)]
    pub epoch: u64,
    /// The claim was made by a CONNECT with Clean Start 1 (MQTT 3.1.1:
    /// Clean Session 1): it ended the client identifier's earlier session,
    /// and with it the wait of that session's delayed will, which is then
    /// sent at once (MQTT 5 §3.1.2.5). Absent (false) in entries written
    /// before this field existed: taken as a resumed session.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub clean_start: bool,
}

impl Record for OwnerRecord {
    fn format(&self) -> u16 {
        self.format
    }
}

/// The format floor in `mqtt-cluster-floor` (key [`FLOOR_KEY`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FloorRecord {
    /// Record format of this record itself (always readable: the floor
    /// record's shape never changes).
    pub format: u16,
    /// The oldest record format a replica must read to join.
    pub floor: u16,
}

impl Record for FloorRecord {
    fn format(&self) -> u16 {
        // The floor record is read whatever its format: its one field is
        // what says whether the rest can be read.
        FORMAT
    }

    fn decode(bytes: &[u8]) -> Result<Self, RecordError> {
        serde_json::from_slice(bytes).map_err(|e| RecordError::Malformed(e.to_string()))
    }
}

/// Whether a replica that reads [`FORMATS_READ`] may join a cluster whose
/// floor is `floor`.
pub fn floor_readable(floor: u16) -> bool {
    FORMATS_READ.contains(&floor)
}

/// The floor the leader raises the cluster to (DESIGN.md §6, rolling
/// upgrade: "raise the format floor when the last old one is gone"): the
/// newest format every live member reads, given each member's
/// [`MemberRecord::reads`] (the leader's own included), when it is above
/// `floor` and every member reads it; `None` otherwise, and for no members.
/// The floor is never lowered: a replica that cannot read it refuses to
/// start.
pub fn raised_floor(floor: u16, members: &[[u16; 2]]) -> Option<u16> {
    let target = members.iter().map(|[_, newest]| *newest).min()?;
    let every_member_reads = members.iter().all(|[oldest, newest]| (*oldest..=*newest).contains(&target));
    (target > floor && every_member_reads).then_some(target)
}

/// The KV key of a client identifier: `c.` and its
/// [`name_token`](crate::cluster::keys::name_token) (base64url of its
/// UTF-8 bytes without padding, `=` for the empty identifier, a hash for
/// one over 768 bytes: see [`crate::cluster::keys`]).
pub fn client_key(client_id: &str) -> String {
    format!("c.{}", crate::cluster::keys::name_token(client_id))
}

/// The key in `mqtt-session-qos2` of `client_id`'s open inbound QoS 2
/// flow with `packet_id` (DESIGN.md §7): its [`client_key`], a dot, the
/// packet identifier in decimal. The token has no dot, so
/// [`qos2_keys_of`] selects one client's flows exactly.
pub fn qos2_key(client_id: &str, packet_id: u16) -> String {
    format!("{}.{packet_id}", client_key(client_id))
}

/// The subject filter of every [`qos2_key`] of `client_id` in
/// `mqtt-session-qos2` (the KV subjects `$KV.mqtt-session-qos2.<key>`).
pub fn qos2_keys_of(client_id: &str) -> String {
    format!("$KV.{}.{}.*", bucket::SESSION_QOS2, client_key(client_id))
}

/// The key in `mqtt-session-will` of a will whose session a CONNECT with
/// Clean Start 1 on another replica ended while the will waited for its
/// Will Delay Interval (`e.` and the client identifier's token as in
/// [`client_key`]): the new connection's own will takes [`client_key`],
/// and the ended one waits here for the sweeper (MQTT 5 §3.1.2.5).
pub fn ended_will_key(client_id: &str) -> String {
    format!("e.{}", crate::cluster::keys::name_token(client_id))
}

/// Whether `key` (of `mqtt-session-will`) was made by [`ended_will_key`].
pub fn is_ended_will_key(key: &str) -> bool {
    key.starts_with("e.")
}

/// The client identifier of a key made by [`client_key`]; `None` for any
/// other key, and for a hashed one (a long identifier): the record under
/// it carries the identifier ([`OwnerRecord::client_id`]), and a reader
/// checks [`is_client_key_of`] before it trusts it.
pub fn client_id_of_key(key: &str) -> Option<String> {
    match crate::cluster::keys::read_token(key.strip_prefix("c.")?)? {
        crate::cluster::keys::Token::Plain(client_id) => Some(client_id),
        crate::cluster::keys::Token::Hashed => None,
    }
}

/// Whether `key` is [`client_key`]`(client_id)`: how a reader of a record
/// found under a key (hashed or not) knows the record's client identifier
/// is the key's.
pub fn is_client_key_of(key: &str, client_id: &str) -> bool {
    key.strip_prefix("c.").is_some_and(|token| token == crate::cluster::keys::name_token(client_id))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn member() -> MemberRecord {
        MemberRecord {
            format: FORMAT,
            replica: "r1".into(),
            instance: "a1b2".into(),
            started_at_ms: 1_764_892_800_000,
            member_ttl_ms: 10_000,
            mesh: "10.0.0.1:7884".into(),
            mesh_versions: vec![1],
            reads: [1, 1],
            epoch: 0,
            leaving: false,
            follows: None,
        }
    }

    #[test]
    fn a_record_reads_back_as_written() {
        let m = member();
        assert_eq!(MemberRecord::decode(&m.encode()).unwrap(), m);
        let successor = MemberRecord { follows: Some("c3d4".into()), ..member() };
        assert_eq!(MemberRecord::decode(&successor.encode()).unwrap(), successor);
        // Written without `follows` (and by replicas older than it): read as none.
        assert!(!String::from_utf8(m.encode()).unwrap().contains("follows"));
    }

    #[test]
    fn a_clients_qos2_keys_are_selected_by_its_filter_and_no_other_clients() {
        let key = qos2_key("dev-1", 65_535);
        assert_eq!(key, format!("{}.65535", client_key("dev-1")));
        let filter = qos2_keys_of("dev-1");
        let matches = |subject: &str| {
            let (f, s): (Vec<_>, Vec<_>) = (filter.split('.').collect(), subject.split('.').collect());
            f.len() == s.len() && f.iter().zip(&s).all(|(f, s)| *f == "*" || f == s)
        };
        assert!(matches(&format!("$KV.{}.{key}", bucket::SESSION_QOS2)));
        for other in ["dev-10", "dev", "", &"x".repeat(2000)] {
            assert!(!matches(&format!("$KV.{}.{}", bucket::SESSION_QOS2, qos2_key(other, 1))), "{other:?}");
        }
        assert_eq!(client_key(&"y".repeat(2000)).matches('.').count(), 1, "a hashed token has no dot either");
    }

    #[test]
    fn a_record_of_an_unknown_format_is_refused_naming_it() {
        let mut m = member();
        m.format = 9;
        let err = MemberRecord::decode(&m.encode()).unwrap_err();
        assert_eq!(err, RecordError::UnknownFormat(9));
        assert!(err.to_string().contains("format 9"));
    }

    #[test]
    fn garbage_is_malformed_not_a_panic() {
        assert!(matches!(OwnerRecord::decode(b"{"), Err(RecordError::Malformed(_))));
        assert!(matches!(OwnerRecord::decode(b"{\"format\":1}"), Err(RecordError::Malformed(_))));
    }

    #[test]
    fn the_floor_is_readable_only_within_the_formats_read() {
        assert!(floor_readable(1));
        assert!(floor_readable(2));
        assert!(!floor_readable(3));
        assert_eq!((write_format(1), write_format(2), write_format(9)), (1, 2, 2));
        let f = FloorRecord { format: 7, floor: 2 };
        assert_eq!(FloorRecord::decode(&f.encode()).unwrap().floor, 2);
    }

    #[test]
    fn the_floor_rises_to_the_newest_format_every_member_reads_once_the_last_old_one_is_gone() {
        // An old member (reads 1 only) holds the floor at 1.
        assert_eq!(raised_floor(1, &[[1, 2], [1, 1], [1, 2]]), None);
        // Gone: every member reads 2.
        assert_eq!(raised_floor(1, &[[1, 2], [1, 2]]), Some(2));
        // Already there, never lowered, nothing to decide without members.
        assert_eq!(raised_floor(2, &[[1, 2], [1, 2]]), None);
        assert_eq!(raised_floor(2, &[[1, 1]]), None);
        assert_eq!(raised_floor(1, &[]), None);
        // A newer build reading 2..=3 beside this one: 2, which both read.
        assert_eq!(raised_floor(1, &[[1, 2], [2, 3]]), Some(2));
    }

    proptest! {
        #[test]
        fn a_raised_floor_is_read_by_every_member_and_above_the_old_one(
            floor in 1u16..4,
            members in proptest::collection::vec((1u16..5, 0u16..3), 0..6),
        ) {
            let members: Vec<[u16; 2]> = members.into_iter().map(|(lo, span)| [lo, lo + span]).collect();
            if let Some(raised) = raised_floor(floor, &members) {
                prop_assert!(raised > floor);
                prop_assert!(members.iter().all(|[lo, hi]| (*lo..=*hi).contains(&raised)));
            }
        }

        #[test]
        fn any_client_id_maps_to_a_valid_key_and_back(id in ".{0,200}", repeat in 1usize..30) {
            // Up to 6,000 characters: long ones past the bound are hashed
            // and read from the record [MQTT-3.1.3-5].
            let id = id.repeat(repeat);
            let key = client_key(&id);
            prop_assert!(key.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_=./".contains(&b)));
            prop_assert!(!key.ends_with('.'));
            prop_assert!(key.len() <= 2 + crate::cluster::keys::MAX_PLAIN_TOKEN);
            prop_assert!(is_client_key_of(&key, &id));
            if id.len() <= 768 {
                prop_assert_eq!(client_id_of_key(&key), Some(id));
            } else {
                prop_assert_eq!(client_id_of_key(&key), None);
                let other = format!("{id}x");
                prop_assert!(!is_client_key_of(&key, &other));
            }
        }

        #[test]
        fn decoding_any_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
            let _ = OwnerRecord::decode(&bytes);
            let _ = MemberRecord::decode(&bytes);
            let _ = FloorRecord::decode(&bytes);
        }
    }

    #[test]
    fn an_ended_will_has_a_key_of_its_own_beside_the_client_key() {
        let (key, ended) = (client_key("dev/1"), ended_will_key("dev/1"));
        assert_ne!(key, ended);
        assert_eq!(key[2..], ended[2..], "the same client identifier");
        assert!(is_ended_will_key(&ended) && !is_ended_will_key(&key));
        assert_eq!(client_id_of_key(&ended), None, "not a client key");
        assert_eq!(ended_will_key(""), "e.=");
    }

    #[test]
    fn a_long_client_identifier_has_short_keys_of_its_own() {
        // MQTT allows a client identifier up to 65,535 bytes; a broker
        // may accept any length [MQTT-3.1.3-5].
        let long = "d".repeat(3_900);
        let (key, ended) = (client_key(&long), ended_will_key(&long));
        assert!(key.starts_with("c.=") && key.len() == 2 + crate::cluster::keys::HASHED_TOKEN_LEN);
        assert_eq!(key[2..], ended[2..]);
        assert!(is_ended_will_key(&ended) && !is_ended_will_key(&key));
        assert_eq!(client_id_of_key(&key), None, "hashed: the identifier is in the record");
        assert!(is_client_key_of(&key, &long) && !is_client_key_of(&key, &"d".repeat(3_901)));
        assert!(!is_client_key_of(&ended, &long), "an ended will's key is no client key");
        assert_ne!(client_key(&"d".repeat(3_901)), key);
        // The empty identifier and short ones keep their keys.
        assert_eq!(client_key(""), "c.=");
        assert_eq!(client_key("dev/1"), "c.ZGV2LzE");
        assert_eq!(client_id_of_key("c.="), Some(String::new()));
    }
}
