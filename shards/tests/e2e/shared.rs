//! Shared subscriptions `$share/{group}/{filter}` (MQTT 5 §4.8.2, also for
//! MQTT 3.1.1): each message to exactly one member, the five strategies,
//! persistent members that are all away, a leaving member's unacknowledged
//! messages, no retained messages, No Local refused.
//!
//! Which shard a client lands on is read from the per-shard
//! `fleetmq_clients_connected` gauge, so tests place members on both shards
//! without knowing the broker's hash.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use crate::clients::{unique, WAIT};
use crate::harness::Broker;
use crate::mqtt5::{packet, prop, Client, QUIET};

use packet::{Props, Publish};

/// `fleetmq_clients_connected` per shard.
fn clients_per_shard(broker: &Broker) -> Vec<f64> {
    let (_, body) = broker.admin_get("/metrics");
    let mut per_shard: BTreeMap<usize, f64> = BTreeMap::new();
    for line in body.lines() {
        let Some(rest) = line.strip_prefix("fleetmq_clients_connected{shard=\"") else {
            continue;
        };
        let (shard, rest) = rest.split_once('"').expect("a shard label");
        let value = rest.rsplit(' ').next().and_then(|v| v.parse().ok());
        per_shard.insert(
            shard.parse().expect("a shard number"),
            value.expect("a value"),
        );
    }
    per_shard.into_values().collect()
}

/// Connects clients made by `connect` (given fresh identifiers starting
/// with `prefix`) until one lands on `shard`; returns it and its identifier.
/// Clients that landed elsewhere stay connected in `spare`, so the gauge
/// stays exact.
fn client_on_shard(
    broker: &Broker,
    shard: usize,
    prefix: &str,
    spare: &mut Vec<Client>,
    connect: impl Fn(&str) -> Client,
) -> (Client, String) {
    for _ in 0..64 {
        let id = unique(prefix);
        let before = clients_per_shard(broker);
        let client = connect(&id);
        let after = clients_per_shard(broker);
        let landed = (0..after.len())
            .find(|&s| after[s] > before.get(s).copied().unwrap_or(0.0))
            .expect("a shard's clients_connected went up");
        if landed == shard {
            return (client, id);
        }
        spare.push(client);
    }
    panic!("no client identifier landed on shard {shard} in 64 tries")
}

/// An MQTT 5 clean-start client.
fn v5(broker: &Broker) -> impl Fn(&str) -> Client + '_ {
    |id| Client::v5(broker.mqtt, id, true, Props::new())
}

/// Every PUBLISH each client receives until quiet, acknowledged, as
/// payload strings.
fn payloads(clients: &mut [Client]) -> Vec<Vec<String>> {
    clients
        .iter_mut()
        .map(|c| c.drain(QUIET).iter().map(Publish::text).collect())
        .collect()
}

/// Asserts that the union of `got` is `expected`, each exactly once.
fn assert_exactly_once(got: &[Vec<String>], expected: &[String]) {
    let mut seen = BTreeMap::new();
    for member in got {
        for p in member {
            *seen.entry(p.clone()).or_insert(0) += 1;
        }
    }
    let twice: Vec<_> = seen.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "delivered more than once: {twice:?}");
    let missing: Vec<_> = expected.iter().filter(|p| !seen.contains_key(*p)).collect();
    assert!(missing.is_empty(), "never delivered: {missing:?}");
    assert_eq!(seen.len(), expected.len(), "unexpected payloads in {got:?}");
}

fn counts(got: &[Vec<String>]) -> Vec<usize> {
    got.iter().map(Vec::len).collect()
}

/// Three MQTT 5 members, on both shards, and two publishers: every QoS 0
/// and QoS 1 message goes to exactly one member (MQTT 5 §4.8.2), while a
/// plain subscriber on the same filter gets every one.
#[test]
fn each_message_goes_to_exactly_one_member_across_shards() {
    let broker = Broker::two_shards(&[]);
    let t = unique("share");
    let filter = format!("$share/workers/{t}/#");
    let mut spare = Vec::new();
    let mut members = Vec::new();
    for shard in [0, 1, 0] {
        let (mut m, _) = client_on_shard(&broker, shard, "member", &mut spare, v5(&broker));
        m.subscribe(&filter, 1);
        members.push(m);
    }
    let mut plain = Client::v5(broker.mqtt, &unique("plain"), true, Props::new());
    plain.subscribe(&format!("{t}/#"), 1);
    let mut publishers: Vec<Client> = (0..2).map(|_| v5(&broker)(&unique("pub"))).collect();
    let mut expected = Vec::new();
    for i in 0..60 {
        let qos = (i % 2) as u8;
        let payload = format!("q{qos}-{i}");
        publishers[i % 2].publish(
            &format!("{t}/{i}"),
            qos,
            false,
            Props::new(),
            payload.as_bytes(),
        );
        expected.push(payload);
    }
    let got = payloads(&mut members);
    assert_exactly_once(&got, &expected);
    assert!(counts(&got).iter().all(|&n| n > 0), "{:?}", counts(&got));
    assert_eq!(
        plain.drain(QUIET).len(),
        60,
        "the plain subscriber gets all"
    );
}

/// `round_robin` (the default, here set explicitly) gives members turns:
/// 30 messages to 3 members are 10 each.
#[test]
fn round_robin_gives_members_turns() {
    let broker = Broker::two_shards(&["--set", "shared.strategy=round_robin"]);
    let t = unique("rr");
    let mut members: Vec<Client> = (0..3).map(|_| v5(&broker)(&unique("m"))).collect();
    for m in &mut members {
        m.subscribe(&format!("$share/g/{t}"), 1);
    }
    let mut publisher = v5(&broker)(&unique("pub"));
    let expected: Vec<String> = (0..30).map(|i| i.to_string()).collect();
    for p in &expected {
        publisher.publish(&t, 1, false, Props::new(), p.as_bytes());
    }
    let got = payloads(&mut members);
    assert_exactly_once(&got, &expected);
    assert_eq!(counts(&got), vec![10, 10, 10]);
}

/// `random`: still exactly once; with 60 messages every one of 3 members
/// gets some (all to fewer members has probability ~1e-10).
#[test]
fn random_strategy_delivers_exactly_once_to_all_members() {
    let broker = Broker::two_shards(&["--set", "shared.strategy=random"]);
    let t = unique("random");
    let mut members: Vec<Client> = (0..3).map(|_| v5(&broker)(&unique("m"))).collect();
    for m in &mut members {
        m.subscribe(&format!("$share/g/{t}"), 1);
    }
    let mut publisher = v5(&broker)(&unique("pub"));
    let expected: Vec<String> = (0..60).map(|i| i.to_string()).collect();
    for p in &expected {
        publisher.publish(&t, 1, false, Props::new(), p.as_bytes());
    }
    let got = payloads(&mut members);
    assert_exactly_once(&got, &expected);
    assert!(counts(&got).iter().all(|&n| n > 0), "{:?}", counts(&got));
}

/// `sticky`, set for one group with `--set shared.groups.NAME=sticky`:
/// every message goes to one member until it leaves, then to one other;
/// another group on the same broker keeps the broker-wide round robin.
#[test]
fn sticky_group_keeps_one_member_until_it_leaves() {
    let broker = Broker::two_shards(&["--set", "shared.groups.stick=sticky"]);
    let t = unique("sticky");
    let mut members: Vec<Client> = (0..3).map(|_| v5(&broker)(&unique("m"))).collect();
    let mut others: Vec<Client> = (0..2).map(|_| v5(&broker)(&unique("o"))).collect();
    for m in &mut members {
        m.subscribe(&format!("$share/stick/{t}"), 1);
    }
    for o in &mut others {
        o.subscribe(&format!("$share/turns/{t}"), 1);
    }
    let mut publisher = v5(&broker)(&unique("pub"));
    let first: Vec<String> = (0..20).map(|i| format!("a{i}")).collect();
    for p in &first {
        publisher.publish(&t, 1, false, Props::new(), p.as_bytes());
    }
    let got = payloads(&mut members);
    assert_exactly_once(&got, &first);
    let holder = got.iter().position(|g| g.len() == 20);
    let holder = holder.unwrap_or_else(|| panic!("not one member: {:?}", counts(&got)));
    assert_eq!(
        counts(&payloads(&mut others)),
        vec![10, 10],
        "round robin elsewhere"
    );

    members.remove(holder).disconnect();
    let second: Vec<String> = (0..20).map(|i| format!("b{i}")).collect();
    for p in &second {
        publisher.publish(&t, 1, false, Props::new(), p.as_bytes());
    }
    let got = payloads(&mut members);
    assert_exactly_once(&got, &second);
    assert!(
        got.iter().any(|g| g.len() == 20),
        "not one member after the holder left: {:?}",
        counts(&got)
    );
}

/// `hash_client_id`: all messages of one publisher go to one member (so
/// they keep their order there), whatever the interleaving of publishers.
#[test]
fn hash_client_id_keeps_each_publisher_on_one_member() {
    let broker = Broker::two_shards(&["--set", "shared.strategy=hash_client_id"]);
    let t = unique("hash");
    let mut members: Vec<Client> = (0..3).map(|_| v5(&broker)(&unique("m"))).collect();
    for m in &mut members {
        m.subscribe(&format!("$share/g/{t}"), 1);
    }
    let mut publishers: Vec<Client> = (0..6).map(|_| v5(&broker)(&unique("pub"))).collect();
    let mut expected = Vec::new();
    for round in 0..8 {
        for (p, publisher) in publishers.iter_mut().enumerate() {
            let payload = format!("p{p}-{round}");
            publisher.publish(&t, 1, false, Props::new(), payload.as_bytes());
            expected.push(payload);
        }
    }
    let got = payloads(&mut members);
    assert_exactly_once(&got, &expected);
    for p in 0..6 {
        let prefix = format!("p{p}-");
        let at: Vec<usize> = (0..3)
            .filter(|&m| got[m].iter().any(|x| x.starts_with(&prefix)))
            .collect();
        assert_eq!(at.len(), 1, "publisher {p} reached members {at:?}");
        let order: Vec<&String> = got[at[0]]
            .iter()
            .filter(|x| x.starts_with(&prefix))
            .collect();
        let want: Vec<String> = (0..8).map(|r| format!("{prefix}{r}")).collect();
        assert_eq!(order, want.iter().collect::<Vec<_>>(), "in order");
    }
}

/// `local_first`: a member on the publisher's shard gets the message when
/// there is one. Members and publishers are placed on both shards.
#[test]
fn local_first_prefers_a_member_on_the_publishing_shard() {
    let broker = Broker::two_shards(&["--set", "shared.strategy=local_first"]);
    let t = unique("local");
    let mut spare = Vec::new();
    let mut members = Vec::new();
    let mut publishers = Vec::new();
    for shard in [0, 1] {
        let (mut m, _) = client_on_shard(&broker, shard, "m", &mut spare, v5(&broker));
        m.subscribe(&format!("$share/g/{t}"), 1);
        members.push(m);
        publishers.push(client_on_shard(&broker, shard, "pub", &mut spare, v5(&broker)).0);
    }
    let mut expected = Vec::new();
    for i in 0..10 {
        for (shard, publisher) in publishers.iter_mut().enumerate() {
            let payload = format!("s{shard}-{i}");
            publisher.publish(&t, 1, false, Props::new(), payload.as_bytes());
            expected.push(payload);
        }
    }
    let got = payloads(&mut members);
    assert_exactly_once(&got, &expected);
    for (shard, member) in got.iter().enumerate() {
        assert!(
            member.iter().all(|p| p.starts_with(&format!("s{shard}-"))),
            "member on shard {shard} got {member:?}"
        );
    }
}

/// Members with persistent sessions stay members while away: with every
/// member away, the group's QoS 1 messages are kept (QoS 0 are not) and
/// delivered, in order, to the first member that comes back.
fn persistent_members_all_away_keep_messages(broker: &Broker) {
    let t = unique("away");
    let filter = format!("$share/g/{t}");
    let expiry = Props::new().int(prop::SESSION_EXPIRY, 60);
    let ids: Vec<String> = (0..2).map(|_| unique("worker")).collect();
    for id in &ids {
        let mut m = Client::v5(broker.mqtt, id, true, expiry.clone());
        m.subscribe(&filter, 1);
        m.disconnect();
    }
    // "All away" means the broker has seen them go: a DISCONNECT is
    // handled asynchronously, and a message routed to a member that is
    // still leaving comes back to the group later, out of order.
    broker.wait_for_clients(0, Duration::from_secs(5));
    let mut publisher = v5(broker)(&unique("pub"));
    for i in 0..5 {
        publisher.publish(&t, 1, false, Props::new(), format!("kept{i}").as_bytes());
        publisher.publish(&t, 0, false, Props::new(), format!("lost{i}").as_bytes());
    }
    // Wait until the group has seen all ten (the five QoS 0 ones are
    // dropped, counted): a QoS 0 message still on its way to the group when
    // a member returns would rightly reach it.
    let dropped = || {
        let (_, body) = broker.admin_get("/metrics");
        body.lines()
            .filter(|l| l.starts_with("fleetmq_messages_dropped_total") && l.contains("reason=\"queue_full\""))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>()
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while dropped() < 5.0 {
        assert!(std::time::Instant::now() < deadline, "the group never dropped the QoS 0 messages");
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut back = Client::v5(broker.mqtt, &ids[1], false, expiry);
    assert!(back.connack.session_present);
    let got: Vec<String> = back.drain(QUIET).iter().map(Publish::text).collect();
    assert_eq!(got, ["kept0", "kept1", "kept2", "kept3", "kept4"]);
    publisher.publish(&t, 1, false, Props::new(), b"live");
    assert_eq!(back.expect_publish().text(), "live");
}

/// [`persistent_members_all_away_keep_messages`] with the group and its
/// members on one shard.
#[test]
fn persistent_members_all_away_keep_qos1_messages_on_one_shard() {
    persistent_members_all_away_keep_messages(&Broker::start(&["--shards", "1"]));
}

/// [`persistent_members_all_away_keep_messages`] with two shards.
#[test]
fn persistent_members_all_away_keep_qos1_messages_across_shards() {
    persistent_members_all_away_keep_messages(&Broker::two_shards(&[]));
}

/// A member that received QoS 1 messages, never acknowledged them and
/// closed its connection: another member gets them (MQTT 5 §4.8.2), so the
/// other member ends up with every message.
#[test]
fn unacknowledged_messages_of_a_leaving_member_go_to_another() {
    let broker = Broker::two_shards(&[]);
    let t = unique("leave");
    let filter = format!("$share/g/{t}");
    let mut silent = v5(&broker)(&unique("silent"));
    silent.subscribe(&filter, 1);
    let mut steady = v5(&broker)(&unique("steady"));
    steady.subscribe(&filter, 1);
    let mut publisher = v5(&broker)(&unique("pub"));
    let expected: Vec<String> = (0..10).map(|i| i.to_string()).collect();
    for p in &expected {
        publisher.publish(&t, 1, false, Props::new(), p.as_bytes());
    }
    let mut unacked = Vec::new();
    while let Some(p) = silent.next_publish(QUIET) {
        unacked.push(p.text());
    }
    assert!(
        !unacked.is_empty(),
        "round robin gave the silent member nothing"
    );
    drop(silent);
    let mut got: Vec<String> = Vec::new();
    while let Some(p) = steady.recv(Duration::from_millis(800)) {
        got.push(p.text());
    }
    assert_exactly_once(&[got], &expected);
}

/// A shared subscription gets no retained message when it is made (MQTT 5
/// §4.8.2); a plain one on the same topic does.
#[test]
fn shared_subscribe_gets_no_retained_messages() {
    let broker = Broker::two_shards(&[]);
    let t = unique("ret");
    let mut publisher = v5(&broker)(&unique("pub"));
    publisher.publish(&t, 1, true, Props::new(), b"retained");
    let mut member = v5(&broker)(&unique("member"));
    member.subscribe(&format!("$share/g/{t}"), 1);
    member.expect_no_publish(QUIET);
    let mut plain = v5(&broker)(&unique("plain"));
    plain.subscribe(&t, 1);
    assert_eq!(plain.expect_publish().text(), "retained");
}

/// No Local on a shared subscription is a Protocol Error: DISCONNECT 0x82
/// [MQTT-3.8.3-4].
#[test]
fn no_local_on_a_shared_subscription_gets_disconnect_0x82() {
    let broker = Broker::two_shards(&[]);
    let mut c = v5(&broker)(&unique("nl"));
    c.send(&packet::subscribe(
        1,
        &[("$share/g/nl/t", packet::options(1, true, false, 0))],
        Some(&Props::new()),
    ));
    assert_eq!(c.closed_with(WAIT), Some(0x82));
}

/// MQTT 3.1.1 clients can be members too: each message exactly once,
/// spread over both.
#[test]
fn mqtt311_shared_subscription_delivers_each_message_once() {
    let broker = Broker::two_shards(&[]);
    let t = unique("v311");
    let mut members: Vec<Client> = (0..2)
        .map(|_| Client::v311(broker.mqtt, &unique("m"), true))
        .collect();
    for m in &mut members {
        m.subscribe(&format!("$share/g/{t}"), 1);
    }
    let mut publisher = Client::v311(broker.mqtt, &unique("pub"), true);
    let expected: Vec<String> = (0..20).map(|i| i.to_string()).collect();
    for p in &expected {
        publisher.publish(&t, 1, false, Props::new(), p.as_bytes());
    }
    let got = payloads(&mut members);
    assert_exactly_once(&got, &expected);
    assert!(counts(&got).iter().all(|&n| n > 0), "{:?}", counts(&got));
    let distinct: BTreeSet<&String> = got.iter().flatten().collect();
    assert_eq!(distinct.len(), 20);
}
