//! CONNECT in cluster mode under load (issue 23): a signed-in CONNECT
//! waiting for its client identifier claim in `mqtt-sessions` no longer
//! holds one of `limits.max_pending_connections`' slots, so a storm of
//! CONNECTs that JetStream answers slowly is not refused (or evicted) by
//! the limit meant for connections that have not sent their CONNECT.
//!
//! One NATS server with the fault proxy in front: the replica's every
//! round trip takes at least 1 s, so the claims of a burst are all in
//! flight at once.
//!
//! And where a replica's claims go: its state connection is at the NATS
//! server that leads `KV_mqtt-sessions`.

use std::thread;
use std::time::Duration;

use crate::cluster::replica;
use crate::nats::{NatsCluster, NatsProxy};
use crate::raw::{wire as build, Incoming, RawClient};

/// More CONNECTs in flight together than `max_pending_connections` (4)
/// are all accepted: each gives its pending slot back once it is signed
/// in, before its claim's round trip [MQTT-3.2.2-1: CONNACK 0x00].
#[test]
fn connects_waiting_for_their_claim_do_not_fill_the_pending_limit() {
    let nats = NatsCluster::start(1);
    let proxy = NatsProxy::start(nats.client_addr(0));
    let broker = replica(
        "rc",
        &[proxy.url()],
        &[
            "--set",
            "cluster.nats_replicas=1",
            "--set",
            "limits.max_pending_connections=4",
        ],
    );
    proxy.set_round_trip(Duration::from_secs(1));
    // One CONNECT every 50 ms: each is read and signed in long before the
    // next comes, and all 12 claims are in flight together.
    let clients: Vec<_> = (0..12)
        .map(|i| {
            let addr = broker.mqtt;
            thread::sleep(Duration::from_millis(50));
            thread::spawn(move || {
                let mut c = RawClient::connect(addr);
                c.send(&build::Connect::v311(&format!("burst-{i}")).encode());
                c.read(Duration::from_secs(5))
            })
        })
        .collect();
    let answers: Vec<_> = clients.into_iter().map(|c| c.join().expect("client thread")).collect();
    let (_, metrics) = broker.admin_get("/metrics");
    let refusals: Vec<_> = metrics
        .lines()
        .filter(|l| l.starts_with("fleetmq_connect_refused_total{") && !l.ends_with(" 0"))
        .collect();
    for (i, answer) in answers.iter().enumerate() {
        // CONNACK: session present 0, return code 0.
        let accepted = matches!(answer, Incoming::Packet { header: 0x20, body } if body[..] == [0, 0]);
        assert!(accepted, "client {i}: {answer:02x?}; refusals: {refusals:?}");
    }
    let refused: Vec<_> = metrics
        .lines()
        .filter(|l| l.starts_with("fleetmq_connect_refused_total{"))
        .filter(|l| {
            l.contains("reason=\"max_pending_connections\"")
                || l.contains("reason=\"pending_evicted\"")
        })
        .filter(|l| !l.ends_with(" 0"))
        .collect();
    assert!(
        refused.is_empty(),
        "refused by the pending limit: {refused:?}"
    );
}

/// Each replica's state connection (every claim of a CONNECT, and the
/// ownership watch that brings each write back) is at the NATS server
/// that leads `KV_mqtt-sessions`, whichever of the three URLs it reached
/// first: no claim, acknowledgement or watch delivery is relayed between
/// NATS servers. Three replicas: by chance all three would be there one
/// time in 27.
#[test]
fn each_replicas_state_connection_is_at_the_ownership_buckets_leader() {
    let nats = NatsCluster::start(3);
    let ids = ["sl1", "sl2", "sl3"];
    let _brokers: Vec<_> = ids.iter().map(|id| replica(id, &nats.urls(), &[])).collect();
    let leader = nats.stream_leader("KV_mqtt-sessions").expect("KV_mqtt-sessions has a leader");
    for id in ids {
        let name = format!("fleetmq-{id}-state");
        let at: Vec<usize> =
            (0..nats.len()).filter(|&i| nats.connection_names(i).contains(&name)).collect();
        assert_eq!(at, vec![leader], "{name}: on servers {at:?}, the leader is n{leader}");
    }
}
