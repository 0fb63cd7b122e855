//! A persistent subscription made moments before a value is published on
//! another replica (DESIGN.md §6, §7; issue 24): the publishing replica
//! may not know of the session's interest yet (it learns it through the
//! `mqtt-session-state` watch, moments after the SUBACK), so it does not
//! append the value to the session log; the mesh says so (version 4, the
//! logged flag) and the subscriber's replica delivers it live instead of
//! waiting for it in the log. A value the server took ownership of goes
//! to every client with a matching subscription `[MQTT-4.5.0-1]`. Raw
//! clients, real replicas, a real 3-server NATS cluster.

use std::time::{Duration, Instant};

use crate::cluster_mesh::{start, Certs};
use crate::cluster_qos2::{wait_mesh, Peer};
use crate::nats::NatsCluster;
use crate::raw::wire as build;

/// Rounds of the race.
const ROUNDS: usize = 200;

/// Each round a new persistent session subscribes at B to a topic of its
/// own at QoS 1, and at once after its SUBACK a QoS 1 value is published
/// on that topic at A: every one is delivered (200 rounds, none missed).
/// Before the logged flag (the replicas limited to mesh versions 1–3 with
/// `FLEETMQ_MESH_VERSIONS`: a reading session skips every QoS 1/2 value
/// from the mesh) the values A had not logged were never delivered.
#[test]
fn a_value_published_on_another_replica_right_after_a_persistent_subscriptions_suback_is_delivered() {
    let nats = NatsCluster::start(3);
    let certs = Certs::new("ra,rb");
    let (a, b) = (start("ra", &nats, &certs, &[]), start("rb", &nats, &certs, &[]));
    wait_mesh(&a, 1);
    wait_mesh(&b, 1);
    let (mut p, _) = Peer::connect(a.mqtt, &crate::clients::unique("pub"), true);
    let mut missed = Vec::new();
    for i in 0..ROUNDS {
        let topic = format!("race/{i}");
        let (mut s, _) = Peer::connect(b.mqtt, &crate::clients::unique(&format!("k{i}")), true);
        s.subscribe_at(&topic, 1);
        p.publish_at_least_once(&topic, (i % 60_000 + 1) as u16, &format!("v{i}"));
        let deadline = Instant::now() + Duration::from_secs(3);
        while s.handed.is_empty() && Instant::now() < deadline {
            s.read(Duration::from_millis(100), true);
        }
        if s.handed != [format!("v{i}")] {
            missed.push((i, s.handed.clone()));
        }
        // The session ends (Session Expiry Interval 0 at DISCONNECT):
        // no interest left behind.
        s.conn.send(&build::packet(0xE0, &[0, 5, 0x11, 0, 0, 0, 0]));
    }
    if !missed.is_empty() {
        // Whether A had logged the missed ones (it had not: the race).
        let log = crate::nats::block_on(crate::cluster_session_log::logged(&nats, "LOG_mqtt-sessions-_")).unwrap_or_default();
        let logged: Vec<bool> = missed.iter().map(|(i, _)| log.iter().any(|l| l.topic == format!("race/{i}"))).collect();
        panic!("{} of {ROUNDS} rounds missed or got other values: {missed:?}; in the log: {logged:?}", missed.len());
    }
    drop((a, b));
}
