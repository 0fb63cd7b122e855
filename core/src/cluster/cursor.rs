//! A persistent session's read position in its workspace's session log,
//! as stored in `mqtt-session-cursor` (DESIGN.md §4; issue 24): key
//! [`client_key`](crate::cluster::records::client_key) of the client
//! identifier, one record per session, written in batches (at most every
//! ~100 ms while it changes, and when its connection ends) and deleted
//! when the session ends.
//!
//! The record says: every log value of sequence ≤ [`CursorRecord::position`]
//! was dealt with for this session (it did not match, or it was delivered
//! and, at QoS 1/2, acknowledged or listed in
//! [`CursorRecord::unacked`]); the unacknowledged deliveries, each with
//! its log sequence, packet identifier, QoS and whether its PUBREC came
//! (QoS 2: PUBREL sent, waiting for PUBCOMP). A replica taking the session
//! up resends those (PUBLISH with DUP, or PUBREL) and reads the log from
//! `position + 1`. Values a replica delivered after the record it last
//! wrote come again (at least once, DESIGN.md §6 "a QoS 1 value whose
//! PUBACK from the subscriber was not yet stored may come again").

use serde::{Deserialize, Serialize};

use crate::cluster::records::Record;

/// One unacknowledged delivery of a [`CursorRecord`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Unacked {
    /// Its log sequence.
    pub seq: u64,
    /// The packet identifier it went out with, 1..=65,535.
    pub packet_id: u16,
    /// The QoS it went out with: 1 or 2.
    pub qos: u8,
    /// QoS 2: PUBREC received, PUBREL sent.
    #[serde(default, skip_serializing_if = "is_false")]
    pub released: bool,
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// A session's cursor in `mqtt-session-cursor`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CursorRecord {
    /// Record format ([`crate::cluster::records::FORMAT`]).
    pub format: u16,
    /// The client identifier (checked against the key's owner on read).
    pub client_id: String,
    /// The workspace whose log it reads.
    pub workspace: String,
    /// Every log value of sequence ≤ this was dealt with.
    pub position: u64,
    /// The deliveries not yet acknowledged, in the order they were sent.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unacked: Vec<Unacked>,
}

impl Record for CursorRecord {
    fn format(&self) -> u16 {
        self.format
    }
}

impl CursorRecord {
    /// Whether every field is in its range: packet identifiers 1..=65,535
    /// and distinct, QoS 1 or 2, `released` only at QoS 2, sequences
    /// above 0. A record that is not is not used (the session reads on
    /// from its position, resending nothing).
    pub fn valid(&self) -> bool {
        let mut ids = std::collections::HashSet::new();
        self.unacked.iter().all(|u| {
            u.packet_id != 0 && ids.insert(u.packet_id) && matches!(u.qos, 1 | 2) && (!u.released || u.qos == 2) && u.seq > 0
        })
    }

    /// The log sequence a replica reads from: `position + 1` (saturating).
    pub fn read_from(&self) -> u64 {
        self.position.saturating_add(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::records::FORMAT;
    use proptest::prelude::*;

    #[test]
    fn a_cursor_reads_back_and_checks_its_fields() {
        let mut c = CursorRecord {
            format: FORMAT,
            client_id: "c".into(),
            workspace: "w".into(),
            position: 41,
            unacked: vec![Unacked { seq: 40, packet_id: 7, qos: 2, released: true }],
        };
        assert_eq!(CursorRecord::decode(&c.encode()).unwrap(), c);
        assert!(c.valid());
        assert_eq!(c.read_from(), 42);
        c.unacked.push(Unacked { seq: 41, packet_id: 7, qos: 1, released: false });
        assert!(!c.valid(), "a packet identifier twice");
        c.unacked[1] = Unacked { seq: 41, packet_id: 8, qos: 1, released: true };
        assert!(!c.valid(), "released at QoS 1");
        c.position = u64::MAX;
        assert_eq!(c.read_from(), u64::MAX);
    }

    proptest! {
        /// Any cursor reads back as it was written.
        #[test]
        fn any_cursor_reads_back(
            client_id in ".{0,20}",
            position in any::<u64>(),
            unacked in proptest::collection::vec((any::<u64>(), any::<u16>(), 1u8..=2, any::<bool>()), 0..20),
        ) {
            let c = CursorRecord {
                format: FORMAT,
                client_id,
                workspace: String::new(),
                position,
                unacked: unacked.into_iter().map(|(seq, packet_id, qos, released)| Unacked { seq, packet_id, qos, released }).collect(),
            };
            prop_assert_eq!(CursorRecord::decode(&c.encode()).unwrap(), c);
        }
    }
}
