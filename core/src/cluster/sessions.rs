//! Persistent sessions as stored in `mqtt-session-state` (DESIGN.md §4,
//! §6; issue 24): what a replica needs to take a session up when its
//! client connects there after it was served elsewhere (a crash, a rolling
//! restart, a load balancer's choice): identity, workspace, protocol,
//! Session Expiry Interval and subscriptions.
//!
//! One record per client identifier (key: [`client_key`]), rewritten whole
//! on every change (a replica coalesces changes: one write in flight per
//! session) and deleted when the session ends. Written before the SUBACK or
//! UNSUBACK that depends on it; the values a session is owed while away are
//! the session log's business (not in this record).
//!
//! [`client_key`]: crate::cluster::records::client_key

use std::collections::HashMap;

use bytestring::ByteString;
use serde::{Deserialize, Serialize};

use crate::cluster::records::{Record, FORMAT};
use crate::packet::{QoS, RetainHandling, SubscriptionOptions};
use crate::session::Subscription;

/// The largest Subscription Identifier, MQTT 5 §3.8.2.1.2.
const MAX_SUBSCRIPTION_ID: u32 = 268_435_455;

/// A persistent session in `mqtt-session-state`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionRecord {
    /// Record format ([`FORMAT`]).
    pub format: u16,
    /// The client identifier.
    pub client_id: String,
    /// User name of the identity that holds it, if it signed in with one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub username: Option<String>,
    /// Workspace of that identity.
    pub workspace: String,
    /// Protocol level of its last connection: 3, 4 (3.1.1) or 5.
    pub protocol: u8,
    /// Session Expiry Interval in force, seconds (> 0; `u32::MAX`: never).
    pub expiry_s: u32,
    /// The replica that wrote the record (serves or served the session).
    pub replica: String,
    /// The process of that replica that wrote it
    /// ([`MemberRecord::instance`](crate::cluster::records::MemberRecord::instance)):
    /// the session is held while that process is a live member, and the
    /// sweeper ends it once it expired after that process is gone
    /// (DESIGN.md §4). `None` in records written before this field
    /// existed: the replica ID stands for it then.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance: Option<String>,
    /// When its connection ended, Unix milliseconds; `None` while a
    /// connection is attached. The Session Expiry Interval counts from here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub offline_since_ms: Option<u64>,
    /// Its subscriptions (shared subscriptions are not kept, as with the
    /// local store).
    #[serde(default)]
    pub subscriptions: Vec<StoredSubscription>,
}

/// One subscription of a [`SessionRecord`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredSubscription {
    /// The topic filter as the broker keeps it (with its workspace prefix).
    pub filter: String,
    /// Maximum QoS, 0..=2.
    pub qos: u8,
    /// No Local (MQTT 5).
    #[serde(default, skip_serializing_if = "is_false")]
    pub no_local: bool,
    /// Retain As Published (MQTT 5).
    #[serde(default, skip_serializing_if = "is_false")]
    pub retain_as_published: bool,
    /// Retain Handling (MQTT 5), 0..=2.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub retain_handling: u8,
    /// Subscription Identifier (MQTT 5), 1..=268,435,455.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub identifier: Option<u32>,
}

fn is_false(b: &bool) -> bool {
    !*b
}

fn is_zero(n: &u8) -> bool {
    *n == 0
}

impl Record for SessionRecord {
    fn format(&self) -> u16 {
        self.format
    }
}

impl StoredSubscription {
    /// The record of `subscription` to `filter`.
    pub fn new(filter: &str, subscription: &Subscription) -> StoredSubscription {
        let o = subscription.options;
        StoredSubscription {
            filter: filter.to_owned(),
            qos: o.qos as u8,
            no_local: o.no_local,
            retain_as_published: o.retain_as_published,
            retain_handling: o.retain_handling as u8,
            identifier: subscription.identifier,
        }
    }

    /// The subscription back, or `None` when a field is out of its range
    /// (a record this build did not write).
    pub fn subscription(&self) -> Option<Subscription> {
        let qos = match self.qos {
            0 => QoS::AtMostOnce,
            1 => QoS::AtLeastOnce,
            2 => QoS::ExactlyOnce,
            _ => return None,
        };
        let retain_handling = match self.retain_handling {
            0 => RetainHandling::SendAtSubscribe,
            1 => RetainHandling::SendIfNew,
            2 => RetainHandling::DoNotSend,
            _ => return None,
        };
        if self.identifier.is_some_and(|id| id == 0 || id > MAX_SUBSCRIPTION_ID) {
            return None;
        }
        if self.filter.is_empty() {
            return None;
        }
        Some(Subscription {
            options: SubscriptionOptions {
                qos,
                no_local: self.no_local,
                retain_as_published: self.retain_as_published,
                retain_handling,
            },
            identifier: self.identifier,
        })
    }
}

impl SessionRecord {
    /// The record of a session; `subscriptions` as the session keeps them
    /// (shared ones too: a take-up joins their groups again), in filter
    /// order so that equal sessions give equal bytes.
    #[allow(clippy::too_many_arguments)]
    pub fn new<'a>(
        client_id: &str,
        username: Option<&str>,
        workspace: &str,
        protocol: u8,
        expiry_s: u32,
        replica: &str,
        offline_since_ms: Option<u64>,
        subscriptions: impl IntoIterator<Item = (&'a str, &'a Subscription)>,
    ) -> SessionRecord {
        let mut subscriptions: Vec<_> = subscriptions.into_iter().map(|(f, s)| StoredSubscription::new(f, s)).collect();
        subscriptions.sort_by(|a, b| a.filter.cmp(&b.filter));
        SessionRecord {
            format: FORMAT,
            client_id: client_id.to_owned(),
            username: username.map(str::to_owned),
            workspace: workspace.to_owned(),
            protocol,
            expiry_s,
            replica: replica.to_owned(),
            instance: None,
            offline_since_ms,
            subscriptions,
        }
    }

    /// Whether the session ran out of its Session Expiry Interval by
    /// `now_ms` (Unix milliseconds): offline for longer than it. A session
    /// with a connection attached, or with `u32::MAX` (MQTT 5 §3.1.2.11.2:
    /// never expires), never has.
    pub fn expired(&self, now_ms: u64) -> bool {
        self.offline_since_ms.and_then(|since| self.expires_at_ms(since)).is_some_and(|at| now_ms >= at)
    }

    /// When the session expires (Unix milliseconds) if its connection
    /// ended at `ended_ms`: its Session Expiry Interval later; `None` for
    /// `u32::MAX` (never, MQTT 5 §3.1.2.11.2). The sweeper passes
    /// [`offline_since_ms`](Self::offline_since_ms) when the record has
    /// it, else when the process holding the session was taken for gone.
    pub fn expires_at_ms(&self, ended_ms: u64) -> Option<u64> {
        (self.expiry_s != u32::MAX).then(|| ended_ms.saturating_add(u64::from(self.expiry_s) * 1000))
    }

    /// The subscriptions to restore, by filter, shared ones included (MQTT
    /// 5 §4.1: the session state holds the client's subscriptions); `None`
    /// when one is out of range (the whole record is then not taken up).
    pub fn restored_subscriptions(&self) -> Option<HashMap<ByteString, Subscription>> {
        self.subscriptions.iter().map(|s| Some((ByteString::from(s.filter.as_str()), s.subscription()?))).collect()
    }

    /// Whether `protocol` is a level this build speaks (3, 4, 5).
    pub fn protocol_known(&self) -> bool {
        matches!(self.protocol, 3..=5)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sub(qos: QoS, id: Option<u32>) -> Subscription {
        Subscription {
            options: SubscriptionOptions {
                qos,
                no_local: true,
                retain_as_published: false,
                retain_handling: RetainHandling::SendIfNew,
            },
            identifier: id,
        }
    }

    #[test]
    fn a_record_keeps_every_subscription_the_shared_ones_too() {
        let a = sub(QoS::AtLeastOnce, Some(7));
        let b = sub(QoS::ExactlyOnce, None);
        let subs = [("w/b/#", &b), ("$share/g/x", &a), ("w/a", &a)];
        let r = SessionRecord::new("c1", Some("u"), "w", 5, 300, "r1", None, subs);
        let back = SessionRecord::decode(&r.encode()).unwrap();
        assert_eq!(back, r);
        let restored = back.restored_subscriptions().unwrap();
        assert_eq!(restored.len(), 3);
        assert_eq!(restored[&ByteString::from("$share/g/x")], a);
        assert_eq!(restored[&ByteString::from("w/a")], a);
        assert_eq!(restored[&ByteString::from("w/b/#")], b);
        assert_eq!(r.subscriptions[0].filter, "$share/g/x", "in filter order");
    }

    #[test]
    fn a_session_expires_its_interval_after_its_connection_ended() {
        let mut r = SessionRecord::new("c", None, "", 4, 10, "r", Some(1_000), []);
        assert!(!r.expired(10_999));
        assert!(r.expired(11_000));
        r.offline_since_ms = None;
        assert!(!r.expired(u64::MAX), "attached: never");
        r.offline_since_ms = Some(0);
        r.expiry_s = u32::MAX;
        assert!(!r.expired(u64::MAX), "MQTT 5 §3.1.2.11.2: 0xFFFFFFFF never expires");
        assert_eq!(r.expires_at_ms(5), None);
        r.expiry_s = 3;
        assert_eq!(r.expires_at_ms(5), Some(3_005));
        assert_eq!(r.expires_at_ms(u64::MAX), Some(u64::MAX), "saturates");
    }

    #[test]
    fn a_record_without_the_writing_process_reads_as_none_and_one_with_it_keeps_it() {
        let old = r#"{"format":2,"client_id":"c","workspace":"","protocol":5,"expiry_s":5,"replica":"r"}"#;
        assert_eq!(SessionRecord::decode(old.as_bytes()).unwrap().instance, None);
        let mut r = SessionRecord::new("c", None, "", 5, 5, "r", None, []);
        assert!(!String::from_utf8(r.encode()).unwrap().contains("instance"), "absent when unknown");
        r.instance = Some("i-1".into());
        assert_eq!(SessionRecord::decode(&r.encode()).unwrap().instance.as_deref(), Some("i-1"));
    }

    #[test]
    fn fields_out_of_range_are_not_taken_up() {
        let json = |s: &str| {
            format!(
                r#"{{"format":2,"client_id":"c","workspace":"","protocol":5,"expiry_s":5,"replica":"r","subscriptions":[{s}]}}"#
            )
        };
        for bad in [
            r#"{"filter":"a","qos":3}"#,
            r#"{"filter":"a","qos":1,"retain_handling":3}"#,
            r#"{"filter":"a","qos":1,"identifier":0}"#,
            r#"{"filter":"a","qos":1,"identifier":268435456}"#,
            r#"{"filter":"","qos":1}"#,
        ] {
            let r = SessionRecord::decode(json(bad).as_bytes()).unwrap();
            assert!(r.restored_subscriptions().is_none(), "{bad}");
        }
        let ok = SessionRecord::decode(json(r#"{"filter":"a","qos":1,"identifier":268435455}"#).as_bytes()).unwrap();
        assert!(ok.restored_subscriptions().is_some());
        assert!(SessionRecord::decode(b"{\"format\":99}").is_err());
        assert!(SessionRecord::decode(b"not json").is_err());
    }

    proptest! {
        #[test]
        fn any_record_reads_back_as_written(
            client_id in "\\PC{0,40}",
            username in proptest::option::of("\\PC{0,20}"),
            expiry in 1u32..,
            offline in proptest::option::of(any::<u64>()),
            instance in proptest::option::of("[a-z0-9]{1,12}"),
            subs in proptest::collection::btree_map("[a-z/#+]{1,20}", (0u8..3, any::<bool>(), any::<bool>(), 0u8..3, proptest::option::of(1u32..=MAX_SUBSCRIPTION_ID)), 0..20),
        ) {
            let subs: Vec<(String, Subscription)> = subs.into_iter().map(|(f, (q, nl, rap, rh, id))| {
                let s = StoredSubscription { filter: f.clone(), qos: q, no_local: nl, retain_as_published: rap, retain_handling: rh, identifier: id };
                (f, s.subscription().unwrap())
            }).collect();
            let mut r = SessionRecord::new(&client_id, username.as_deref(), "ws", 5, expiry, "r", offline, subs.iter().map(|(f, s)| (f.as_str(), s)));
            r.instance = instance;
            let back = SessionRecord::decode(&r.encode()).unwrap();
            prop_assert_eq!(&back, &r);
            let restored = back.restored_subscriptions().unwrap();
            prop_assert_eq!(restored.len(), subs.len());
            for (f, s) in &subs {
                prop_assert_eq!(&restored[&ByteString::from(f.as_str())], s);
            }
        }

        #[test]
        fn any_bytes_decode_or_fail_without_panicking(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            if let Ok(r) = SessionRecord::decode(&bytes) {
                let _ = r.restored_subscriptions();
                let _ = r.expired(u64::MAX);
            }
        }
    }
}
