//! Wills as stored in `mqtt-session-will` (DESIGN.md §4, §5): each live
//! connection's will, with the identity that declared it and the process
//! that serves it, so that the elected sweeper can send the wills of a
//! stopped, fenced or gone replica's connections once their grace is over.

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::cluster::records::{OwnerRecord, Record, FORMAT};
use crate::cluster::retained::RetainedRecord;
use crate::packet::Will;
use crate::session::Message;

/// A connection's will in `mqtt-session-will` (key: the client
/// identifier's `client_key`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WillRecord {
    /// Record format ([`FORMAT`]).
    pub format: u16,
    /// The client identifier that declared it.
    pub client_id: String,
    /// Its user name, if it signed in with one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub username: Option<String>,
    /// Its workspace.
    pub workspace: String,
    /// The replica that serves the connection.
    pub replica: String,
    /// The process that serves it (`MemberRecord::instance`).
    pub instance: String,
    /// The Will Delay Interval, seconds (MQTT 5 §3.1.3.2.2).
    pub delay_s: u32,
    /// The Will Retain flag.
    pub retain: bool,
    /// The will's Message Expiry Interval, seconds, counted from its
    /// publication.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expiry_s: Option<u32>,
    /// Topic (with its workspace prefix), payload, QoS and properties.
    pub message: RetainedRecord,
    /// The connection's Session Expiry Interval in force, seconds (0: the
    /// session ends with the connection; `u32::MAX`: never). A session
    /// that ends before the Will Delay Interval has passed sends the will
    /// then `[MQTT-3.1.3-9]`.
    #[serde(default)]
    pub session_expiry_s: u32,
    /// When the serving replica sends the will, Unix milliseconds: set
    /// once the connection ended with the will's delay still running
    /// (`None` while the connection is open).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub due_at_ms: Option<u64>,
    /// The serving process's epoch ([`MemberRecord::epoch`]) when the will
    /// was declared: a will of an older epoch than its process's current
    /// one was handed over to the cluster at a fence.
    ///
    /// [`MemberRecord::epoch`]: crate::cluster::records::MemberRecord::epoch
    #[serde(default)]
    pub epoch: u64,
}

/// Whether a will's client connected again since the will was handed
/// over, and how (see [`WillRecord::after_claim`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reconnected {
    /// Not connected again: the will goes once its wait is over.
    No,
    /// Connected again within the wait, its session going on (Clean
    /// Start 0), or a will without a delay whose client is back within
    /// the grace (DESIGN.md §5): not sent `[MQTT-3.1.3-9]`.
    Resumed,
    /// Connected again with Clean Start 1 while the will's delay ran: that
    /// ended the session, and the will goes now (MQTT 5 §3.1.2.5: "until
    /// the Will Delay Interval has passed or the Session ends, whichever
    /// happens first").
    SessionEnded,
}

impl Record for WillRecord {
    fn format(&self) -> u16 {
        self.format
    }
}

impl WillRecord {
    /// The record of `will` (its topic already with the workspace
    /// prefix), declared at `now_ms` (Unix milliseconds) by a connection
    /// whose Session Expiry Interval is `session_expiry_s`, served by
    /// `server` (replica, instance, epoch).
    pub fn of(
        will: &Will,
        client_id: &str,
        username: Option<&str>,
        workspace: &str,
        server: (&str, &str, u64),
        session_expiry_s: u32,
        now_ms: u64,
    ) -> WillRecord {
        let (replica, instance, epoch) = server;
        let message = Message {
            topic: will.topic.clone(),
            payload: will.payload.clone(),
            qos: will.qos,
            retain: will.retain,
            properties: will.properties.clone(),
            received_at: Instant::now(),
            origin: u64::MAX,
            stored: 0,
            from_mesh: false,
            groups: crate::session::GroupPick::ALL,
        };
        let mut message = RetainedRecord::of(&message, now_ms);
        // The Message Expiry Interval of a will counts from its
        // publication, not its declaration.
        message.expires_at_ms = None;
        WillRecord {
            format: FORMAT,
            client_id: client_id.to_owned(),
            username: username.map(str::to_owned),
            workspace: workspace.to_owned(),
            replica: replica.to_owned(),
            instance: instance.to_owned(),
            delay_s: will.properties.will_delay_interval.unwrap_or(0),
            retain: will.retain,
            expiry_s: will.properties.message_expiry_interval,
            message,
            session_expiry_s,
            due_at_ms: None,
            epoch,
        }
    }

    /// How long after `orphaned_at_ms` (Unix milliseconds: when its
    /// replica was declared gone or stopped, or fenced and back at a newer
    /// epoch) the sweeper sends this will, unless its client came back
    /// (DESIGN.md §5): the later of `grace` and what is left of its wait.
    ///
    /// The wait is the Will Delay Interval or, when shorter, the Session
    /// Expiry Interval `[MQTT-3.1.3-9]`: counted from the end of the
    /// connection when the serving replica recorded it ([`Self::due_at_ms`]),
    /// from `orphaned_at_ms` otherwise (the connection was open then).
    pub fn sweep_wait(&self, orphaned_at_ms: u64, grace: Duration) -> Duration {
        let left = match self.due_at_ms {
            Some(due) => Duration::from_millis(due.saturating_sub(orphaned_at_ms)),
            None => Duration::from_secs(u64::from(self.delay_s.min(self.session_expiry_s))),
        };
        left.max(grace)
    }

    /// What the claim `owner` on this will's client identifier (its entry
    /// in `mqtt-sessions`, read when the sweeper is about to send the will
    /// of a handed-over connection) means for the will.
    pub fn after_claim(&self, owner: &OwnerRecord) -> Reconnected {
        // A claim of another process, or of the will's own after it came
        // back from a fence: the client connected again since.
        let again = owner.instance != self.instance || owner.epoch > self.epoch;
        match (again, owner.clean_start && self.delay_s > 0) {
            (false, _) => Reconnected::No,
            (true, true) => Reconnected::SessionEnded,
            (true, false) => Reconnected::Resumed,
        }
    }

    /// The will to publish now; `None` when its bytes are not valid.
    pub fn will(&self) -> Option<Will> {
        let now = Instant::now();
        let message = self.message.message(now, 0)?;
        let mut properties = message.properties.clone();
        properties.message_expiry_interval = self.expiry_s;
        Some(Will {
            topic: message.topic.clone(),
            payload: message.payload.clone(),
            qos: message.qos,
            retain: self.retain,
            properties,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::packet::{Properties, QoS};
    use bytes::Bytes;

    #[test]
    fn a_will_reads_back_as_declared() {
        let properties = Properties { will_delay_interval: Some(5), content_type: Some("t".into()), ..Properties::default() };
        let will = Will {
            topic: "ws/devices/7/status".into(),
            payload: Bytes::from_static(b"offline"),
            qos: QoS::AtLeastOnce,
            retain: true,
            properties: properties.into(),
        };
        let record = WillRecord::of(&will, "7", Some("dev"), "ws", ("r1", "abc", 0), 60, 1_000);
        let back = WillRecord::decode(&record.encode()).unwrap();
        assert_eq!(back.delay_s, 5);
        let again = back.will().unwrap();
        assert_eq!((again.topic.as_ref(), &again.payload[..], again.qos, again.retain), ("ws/devices/7/status", &b"offline"[..], QoS::AtLeastOnce, true));
        assert_eq!(again.properties.content_type.as_deref(), Some("t"));
    }

    fn delayed(delay_s: u32, session_expiry_s: u32) -> WillRecord {
        let properties = Properties { will_delay_interval: Some(delay_s), ..Properties::default() };
        let will = Will {
            topic: "w".into(),
            payload: Bytes::from_static(b"x"),
            qos: QoS::AtMostOnce,
            retain: false,
            properties: properties.into(),
        };
        WillRecord::of(&will, "7", None, "", ("r1", "abc", 0), session_expiry_s, 0)
    }

    #[test]
    fn a_will_of_an_open_connection_waits_the_longer_of_the_grace_and_its_delay() {
        let grace = Duration::from_secs(30);
        assert_eq!(delayed(0, 3600).sweep_wait(1_000, grace), grace);
        assert_eq!(delayed(10, 3600).sweep_wait(1_000, grace), grace);
        assert_eq!(delayed(45, 3600).sweep_wait(1_000, grace), Duration::from_secs(45));
    }

    #[test]
    fn a_session_that_ends_before_the_will_delay_sends_the_will_at_its_end() {
        // [MQTT-3.1.3-9]: the will goes when the delay passes or the
        // session ends, whichever comes first.
        let grace = Duration::from_secs(2);
        assert_eq!(delayed(60, 12).sweep_wait(1_000, grace), Duration::from_secs(12));
        assert_eq!(delayed(60, 0).sweep_wait(1_000, grace), grace);
    }

    #[test]
    fn a_will_whose_delay_was_running_waits_only_what_is_left_of_it() {
        let grace = Duration::from_secs(2);
        let mut record = delayed(20, 3600);
        // The connection ended at 10 s; the will is due at 30 s; the
        // replica was declared gone at 18.5 s.
        record.due_at_ms = Some(30_000);
        assert_eq!(record.sweep_wait(18_500, grace), Duration::from_millis(11_500));
        // Declared gone after it was due: the grace alone.
        assert_eq!(record.sweep_wait(40_000, grace), grace);
        let back = WillRecord::decode(&record.encode()).unwrap();
        assert_eq!(back.due_at_ms, Some(30_000));
    }

    fn owner(instance: &str, epoch: u64, clean_start: bool) -> OwnerRecord {
        OwnerRecord {
            format: FORMAT,
            client_id: "7".into(),
            replica: "r2".into(),
            instance: instance.into(),
            conn: 1,
            claimed_at_ms: 0,
            epoch,
            clean_start,
        }
    }

    #[test]
    fn a_clean_start_elsewhere_ends_the_session_of_a_delayed_will_and_a_resume_withholds_it() {
        let will = delayed(20, 3600);
        assert_eq!(will.after_claim(&owner("abc", 0, true)), Reconnected::No, "its own connection's claim");
        assert_eq!(will.after_claim(&owner("def", 0, false)), Reconnected::Resumed);
        assert_eq!(will.after_claim(&owner("def", 0, true)), Reconnected::SessionEnded);
        // Its own process, back from a fence at a newer epoch.
        assert_eq!(will.after_claim(&owner("abc", 1, true)), Reconnected::SessionEnded);
        // No delay: the grace alone decides, and the client is back.
        assert_eq!(delayed(0, 3600).after_claim(&owner("def", 0, true)), Reconnected::Resumed);
    }

    #[test]
    fn an_owner_entry_without_clean_start_reads_as_a_resumed_session() {
        let mut json: serde_json::Value = serde_json::from_slice(&owner("def", 0, true).encode()).unwrap();
        json.as_object_mut().unwrap().remove("clean_start");
        let back = OwnerRecord::decode(&serde_json::to_vec(&json).unwrap()).unwrap();
        assert!(!back.clean_start);
        assert!(!String::from_utf8(owner("def", 0, false).encode()).unwrap().contains("clean_start"));
    }

    #[test]
    fn a_record_without_the_newer_fields_reads_with_their_defaults() {
        let mut json: serde_json::Value = serde_json::from_slice(&delayed(5, 60).encode()).unwrap();
        let map = json.as_object_mut().unwrap();
        map.remove("session_expiry_s");
        map.remove("epoch");
        let back = WillRecord::decode(&serde_json::to_vec(&json).unwrap()).unwrap();
        assert_eq!((back.session_expiry_s, back.epoch, back.due_at_ms), (0, 0, None));
    }
}
