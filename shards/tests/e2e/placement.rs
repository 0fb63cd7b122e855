//! Publishers moving to their subscribers' shard (`shard::placement`):
//! messages keep their order across the move, and take-over, session
//! resume, clean start and wills work on a moved session as on any other.
//! Each test picks client identifiers by their home shard
//! (`fleetmq_shards::home_shard`), so the publisher and the subscriber
//! start on different shards of a two-shard broker.

use std::time::{Duration, Instant};

use fleetmq_shards::home_shard;
use rumqttc::v5::mqttbytes::v5::LastWill;

use crate::clients::{unique, v4, v5, WAIT};
use crate::harness::Broker;

/// Messages a test publishes to have its publisher moved: more than the 64
/// the broker judges, at most 500 a second (the broker moves publishers of
/// at most 1,000 a second).
const SLOW_MESSAGES: usize = 150;
const SLOW_GAP: Duration = Duration::from_millis(2);

/// A fresh client identifier whose home is `shard` of two.
fn id_on(shard: usize, prefix: &str) -> String {
    loop {
        let id = unique(prefix);
        if home_shard(&id, 2) == shard {
            return id;
        }
    }
}

/// Waits until `fleetmq_publishers_moved_total` sums to `n`.
fn wait_for_moves(broker: &Broker, n: f64) {
    let deadline = Instant::now() + WAIT;
    loop {
        let moved = broker.metric_sum("fleetmq_publishers_moved_total");
        if moved == n {
            return;
        }
        assert!(Instant::now() < deadline, "fleetmq_publishers_moved_total is {moved}, expected {n}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A two-shard broker, its MQTT port, a fresh topic (with `suffix`, a
/// filter) and a subscriber to it on shard 1.
async fn subscribed_on_shard_1(prefix: &str, suffix: &str) -> (Broker, u16, String, v5::Client) {
    let broker = Broker::two_shards(&[]);
    let port = broker.mqtt_port();
    let topic = format!("{}{suffix}", unique(prefix));
    let mut subscriber = v5::Client::connect(port, &id_on(1, "sub")).await;
    subscriber.subscribe(&topic, v5::QoS::AtLeastOnce).await;
    (broker, port, topic, subscriber)
}

/// Clients connected on `shard`.
fn connected_on(broker: &Broker, shard: usize) -> f64 {
    broker.metric_sum(&format!("fleetmq_clients_connected{{shard=\"{shard}\"}}"))
}

/// Publish `from..to` (as decimal payloads) at QoS 1, [`SLOW_GAP`] apart,
/// then wait for every PUBACK.
async fn publish_slowly(publisher: &mut v5::Client, topic: &str, from: usize, to: usize) {
    for i in from..to {
        publisher
            .client
            .publish(topic, v5::QoS::AtLeastOnce, false, i.to_string())
            .await
            .unwrap();
        tokio::time::sleep(SLOW_GAP).await;
    }
    for _ in from..to {
        publisher
            .wait_for("PUBACK", |p| matches!(p, v5::Packet::PubAck(_)))
            .await;
    }
}

/// Receive `from..to` in order.
async fn receive_in_order(subscriber: &mut v5::Client, from: usize, to: usize) {
    for i in from..to {
        let got = subscriber.next_publish().await;
        assert_eq!(String::from_utf8_lossy(&got.payload), i.to_string(), "message {i} in order");
    }
}

/// Publish `from..to` slowly from `publisher` (see [`publish_slowly`]),
/// receive them in order at `subscriber`, and wait until the broker has
/// made `moves` moves in all.
async fn publish_until_moved(
    broker: &Broker,
    publisher: &mut v5::Client,
    subscriber: &mut v5::Client,
    topic: &str,
    (from, to): (usize, usize),
    moves: f64,
) {
    publish_slowly(publisher, topic, from, to).await;
    receive_in_order(subscriber, from, to).await;
    tokio::task::block_in_place(|| wait_for_moves(broker, moves));
}

/// A subscriber on shard 1 and a 3.1.1 publisher on shard 0 that sends it
/// 300 messages, 2 ms apart: the publisher moves to shard 1 once, and every
/// message arrives once and in order, also those published around the move
/// [MQTT-4.6.0-6].
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_publisher_moves_to_its_subscribers_shard_and_its_messages_keep_their_order() {
    let (broker, port, topic, mut subscriber) = subscribed_on_shard_1("placement/order", "").await;
    let publisher = v4::Client::connect(port, &id_on(0, "pub")).await;
    assert_eq!((connected_on(&broker, 0), connected_on(&broker, 1)), (1.0, 1.0));
    for i in 0..2 * SLOW_MESSAGES {
        publisher
            .client
            .publish(&topic, v4::QoS::AtLeastOnce, false, i.to_string())
            .await
            .unwrap();
        tokio::time::sleep(SLOW_GAP).await;
    }
    receive_in_order(&mut subscriber, 0, 2 * SLOW_MESSAGES).await;
    subscriber.expect_no_publish(Duration::from_millis(200)).await;
    tokio::task::block_in_place(|| wait_for_moves(&broker, 1.0));
    assert_eq!((connected_on(&broker, 0), connected_on(&broker, 1)), (0.0, 2.0));
    // And it still works after the move.
    publisher
        .client
        .publish(&topic, v4::QoS::AtLeastOnce, false, "after")
        .await
        .unwrap();
    assert_eq!(&subscriber.next_publish().await.payload[..], b"after");
}

/// A second connection with a moved publisher's client identifier reaches
/// the session on its new shard and takes it over: the old connection gets
/// DISCONNECT 0x8E [MQTT-3.1.4-3], and the new one's messages arrive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn taking_over_a_moved_publisher_closes_the_old_connection_with_0x8e() {
    let (broker, port, topic, mut subscriber) = subscribed_on_shard_1("placement/takeover", "").await;
    let id = id_on(0, "pub");
    let mut old = v5::Client::connect(port, &id).await;
    publish_until_moved(&broker, &mut old, &mut subscriber, &topic, (0, SLOW_MESSAGES), 1.0).await;

    let new = v5::Client::connect(port, &id).await;
    let err = old.closed_with(WAIT).await.expect("the old connection is closed");
    assert_eq!(v5::server_disconnect_reason(&err), Some(0x8E), "{err:?}");
    new.client
        .publish(&topic, v5::QoS::AtLeastOnce, false, "new")
        .await
        .unwrap();
    assert_eq!(&subscriber.next_publish().await.payload[..], b"new");
    tokio::task::block_in_place(|| broker.wait_for_clients(2, WAIT));
    assert_eq!(connected_on(&broker, 1), 2.0, "the new connection joins the session's shard");

    // And again: the session (a clean one, ended by each take-over) is
    // still found where it moved, so the second connection is closed too
    // and one connection holds the client identifier (found by a
    // fresh-user pass: the third got a session of its own on the home
    // shard, and both stayed open).
    let mut new = new;
    let third = v5::Client::connect(port, &id).await;
    let err = new.closed_with(WAIT).await.expect("the second connection is closed");
    assert_eq!(v5::server_disconnect_reason(&err), Some(0x8E), "{err:?}");
    tokio::task::block_in_place(|| broker.wait_for_clients(2, WAIT));
    assert_eq!(connected_on(&broker, 1), 2.0, "{}", broker.admin_get("/metrics").1);
    third.client.publish(&topic, v5::QoS::AtLeastOnce, false, "third").await.unwrap();
    assert_eq!(&subscriber.next_publish().await.payload[..], b"third");
}

/// A moved publisher with a Session Expiry Interval disconnects; its
/// reconnect with Clean Start 0 finds the session, Session Present 1
/// [MQTT-3.2.2-3]; a later Clean Start 1 starts a new one, Session Present
/// 0 [MQTT-3.2.2-2]. Its messages arrive after each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_moved_session_resumes_with_session_present_and_clean_start_discards_it() {
    let (broker, port, topic, mut subscriber) = subscribed_on_shard_1("placement/resume", "").await;
    let id = id_on(0, "pub");
    let options = |clean_start: bool| {
        let mut o = v5::options(port, &id, clean_start);
        o.set_session_expiry_interval(Some(300));
        o
    };
    let (mut publisher, _) = v5::Client::connect_with(options(true)).await;
    publish_until_moved(&broker, &mut publisher, &mut subscriber, &topic, (0, SLOW_MESSAGES), 1.0).await;
    publisher.disconnect().await;
    tokio::task::block_in_place(|| broker.wait_for_clients(1, WAIT));

    let (publisher, connack) = v5::Client::connect_with(options(false)).await;
    assert!(matches!(connack, v5::Packet::ConnAck(ref c) if c.session_present), "{connack:?}");
    publisher.client.publish(&topic, v5::QoS::AtLeastOnce, false, "resumed").await.unwrap();
    assert_eq!(&subscriber.next_publish().await.payload[..], b"resumed");
    publisher.disconnect().await;

    let (publisher, connack) = v5::Client::connect_with(options(true)).await;
    assert!(matches!(connack, v5::Packet::ConnAck(ref c) if !c.session_present), "{connack:?}");
    publisher.client.publish(&topic, v5::QoS::AtLeastOnce, false, "clean").await.unwrap();
    assert_eq!(&subscriber.next_publish().await.payload[..], b"clean");
}

/// After a moved session ended (Session Expiry Interval 0, DISCONNECT),
/// its client identifier connects again as new, Session Present 0
/// [MQTT-3.2.2-2], and, slow again, moves again; nothing is lost or
/// repeated on the way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_identifier_whose_moved_session_ended_starts_afresh_and_can_move_again() {
    let (broker, port, topic, mut subscriber) = subscribed_on_shard_1("placement/again", "").await;
    let id = id_on(0, "pub");
    for round in 0..2 {
        let (mut publisher, connack) = v5::Client::connect_with(v5::options(port, &id, false)).await;
        assert!(matches!(connack, v5::Packet::ConnAck(ref c) if !c.session_present), "round {round}: {connack:?}");
        let from = round * SLOW_MESSAGES;
        let span = (from, from + SLOW_MESSAGES);
        publish_until_moved(&broker, &mut publisher, &mut subscriber, &topic, span, (round + 1) as f64).await;
        publisher.disconnect().await;
        tokio::task::block_in_place(|| broker.wait_for_clients(1, WAIT));
    }
    subscriber.expect_no_publish(Duration::from_millis(200)).await;
}

/// A moved publisher killed without DISCONNECT: its will is published
/// [MQTT-3.1.2-8].
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_moved_publishers_will_is_published_when_it_is_killed() {
    let (broker, port, topic, mut subscriber) = subscribed_on_shard_1("placement/will", "/#").await;
    let topic = topic.trim_end_matches("/#").to_owned();
    let will_topic = format!("{topic}/will");
    let mut options = v5::options(port, &id_on(0, "pub"), true);
    options.set_last_will(LastWill::new(&will_topic, "gone", v5::QoS::AtLeastOnce, false, None));
    let (mut publisher, _) = v5::Client::connect_with(options).await;
    let data = format!("{topic}/data");
    publish_until_moved(&broker, &mut publisher, &mut subscriber, &data, (0, SLOW_MESSAGES), 1.0).await;
    publisher.kill().await;
    let will = subscriber.next_publish().await;
    assert_eq!((&will.topic[..], &will.payload[..]), (will_topic.as_bytes(), &b"gone"[..]));
}

/// A publisher whose messages also reach a subscriber of its own shard
/// stays; so does every publisher with `server.move_publishers = false`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publishers_reaching_their_own_shard_or_with_moving_off_stay() {
    for (args, both_shards) in [(&[][..], true), (&["--set", "server.move_publishers=false"][..], false)] {
        let broker = Broker::two_shards(args);
        let port = broker.mqtt_port();
        let topic = unique("placement/stay");
        let mut far = v5::Client::connect(port, &id_on(1, "far")).await;
        far.subscribe(&topic, v5::QoS::AtLeastOnce).await;
        let mut near = match both_shards {
            true => {
                let mut near = v5::Client::connect(port, &id_on(0, "near")).await;
                near.subscribe(&topic, v5::QoS::AtLeastOnce).await;
                Some(near)
            }
            false => None,
        };
        let mut publisher = v5::Client::connect(port, &id_on(0, "pub")).await;
        publish_slowly(&mut publisher, &topic, 0, SLOW_MESSAGES).await;
        receive_in_order(&mut far, 0, SLOW_MESSAGES).await;
        if let Some(near) = near.as_mut() {
            receive_in_order(near, 0, SLOW_MESSAGES).await;
        }
        assert_eq!(broker.metric_sum("fleetmq_publishers_moved_total"), 0.0, "{args:?}");
        assert_eq!(connected_on(&broker, 0), if both_shards { 2.0 } else { 1.0 }, "{args:?}");
    }
}

/// One client identifier's connection in [`random_take_overs_resumes_and_moves_keep_one_connection_per_client_identifier`].
struct Held {
    client: Option<v5::Client>,
    /// The broker holds a session for it (connected, or left with an expiry).
    session: bool,
    expiry: u32,
}

/// Random connects (Clean Start 0 or 1, Session Expiry Interval 0 or 300),
/// slow publishing that moves publishers, DISCONNECTs and kills over three
/// client identifiers of shard 0, with their subscriber on shard 1: after
/// every step each client identifier has one connection at most, the old
/// one closed with DISCONNECT 0x8E [MQTT-3.1.4-3];
/// `fleetmq_clients_connected` counts exactly the open ones; Session
/// Present is 1 exactly when a session was left [MQTT-3.2.2-2]
/// [MQTT-3.2.2-3]; and every message published arrives. The seed is
/// printed; `PLACEMENT_SEED` replays one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_take_overs_resumes_and_moves_keep_one_connection_per_client_identifier() {
    use rand::{Rng, SeedableRng};
    let seed = std::env::var("PLACEMENT_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random::<u64>);
    eprintln!("PLACEMENT_SEED={seed}");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let (broker, port, topic, mut subscriber) = subscribed_on_shard_1("placement/random", "").await;
    let ids: Vec<String> = (0..3).map(|_| id_on(0, "rnd")).collect();
    let mut held: Vec<Held> = ids.iter().map(|_| Held { client: None, session: false, expiry: 0 }).collect();
    let mut next = 0usize;
    for step in 0..60 {
        let i = rng.gen_range(0..ids.len());
        let h = &mut held[i];
        match rng.gen_range(0..4) {
            0 | 1 => {
                let (clean_start, expiry) = (rng.gen_bool(0.5), if rng.gen_bool(0.5) { 300 } else { 0 });
                let mut options = v5::options(port, &ids[i], clean_start);
                options.set_session_expiry_interval(Some(expiry));
                // A take-over closes the old connection first, which ends
                // a session without expiry; then Clean Start applies
                // [MQTT-3.1.4-3] [MQTT-3.1.4-4].
                if h.client.is_some() {
                    h.session = h.expiry > 0;
                }
                let (client, connack) = v5::Client::connect_with(options).await;
                let present = matches!(connack, v5::Packet::ConnAck(ref c) if c.session_present);
                assert_eq!(present, !clean_start && h.session, "seed {seed} step {step}: Session Present");
                if let Some(mut old) = h.client.take() {
                    let err = old.closed_with(WAIT).await.unwrap_or_else(|| panic!("seed {seed} step {step}: old connection still open"));
                    assert_eq!(v5::server_disconnect_reason(&err), Some(0x8E), "seed {seed} step {step}: {err:?}");
                }
                *h = Held { client: Some(client), session: true, expiry };
            }
            2 => {
                if let Some(client) = h.client.as_mut() {
                    let n = 70;
                    publish_slowly(client, &topic, next, next + n).await;
                    receive_in_order(&mut subscriber, next, next + n).await;
                    next += n;
                }
            }
            _ => {
                if let Some(client) = h.client.take() {
                    if rng.gen_bool(0.5) {
                        client.disconnect().await;
                    } else {
                        client.kill().await;
                    }
                    h.session = h.expiry > 0;
                }
            }
        }
        let open = 1 + held.iter().filter(|h| h.client.is_some()).count();
        tokio::task::block_in_place(|| broker.wait_for_clients(open, WAIT));
    }
    subscriber.expect_no_publish(Duration::from_millis(100)).await;
    eprintln!("moves: {}", broker.metric_sum("fleetmq_publishers_moved_total"));
}

/// `fleetmq home-shard --shards 2` names, for each client identifier, the
/// shard a two-shard broker serves it on (the `shard` label of
/// `fleetmq_clients_connected`), and refuses a shard count out of 1..=64.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn home_shard_names_the_shard_a_client_is_served_on() {
    let broker = Broker::two_shards(&[]);
    let port = broker.mqtt_port();
    let ids: Vec<String> = [0, 1, 1, 0].into_iter().map(|s| id_on(s, "home")).collect();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_fleetmq"))
        .args(["home-shard", "--shards", "2"])
        .args(&ids)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let named: Vec<usize> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| l.parse().unwrap())
        .collect();
    assert_eq!(named, [0, 1, 1, 0]);
    let mut clients = Vec::new();
    for (id, &shard) in ids.iter().zip(&named) {
        let before = connected_on(&broker, shard);
        clients.push(v5::Client::connect(port, id).await);
        assert_eq!(connected_on(&broker, shard), before + 1.0, "{id} on shard {shard}");
    }
    let home_shard = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_fleetmq"))
            .arg("home-shard")
            .args(args)
            .output()
            .unwrap()
    };
    for bad in ["65", "x", "-1"] {
        let out = home_shard(&["--shards", bad, "x"]);
        assert_eq!(out.status.code(), Some(2), "--shards {bad}");
        assert!(String::from_utf8_lossy(&out.stderr).contains("--shards"), "--shards {bad}");
    }
    // 0, the broker's default, is one shard per CPU this process may use.
    // SAFETY: a zeroed cpu_set_t is valid; sched_getaffinity fills it.
    let cpus = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        assert_eq!(libc::sched_getaffinity(0, std::mem::size_of_val(&set), &mut set), 0);
        libc::CPU_COUNT(&set) as usize
    };
    let out = home_shard(&["--shards", "0", &ids[0], &ids[1]]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let expected: String = ids[..2]
        .iter()
        .map(|id| format!("{}\n", fleetmq_shards::home_shard(id, cpus)))
        .collect();
    assert_eq!(String::from_utf8_lossy(&out.stdout), expected);
    // An empty identifier is one the broker assigns [MQTT-3.1.3-6]: no
    // shard can be named for it; one longer than an MQTT string cannot
    // connect. Either refuses the whole listing.
    let too_long = "d".repeat(65_536);
    for (bad, says) in [("", "empty client identifier"), (too_long.as_str(), "65,535")] {
        let out = home_shard(&["--shards", "2", &ids[0], bad]);
        assert_eq!(out.status.code(), Some(2), "{says}");
        assert!(out.stdout.is_empty(), "{says}");
        assert!(String::from_utf8_lossy(&out.stderr).contains(says), "{says}");
    }
    let out = home_shard(&["--shards", "2", &"d".repeat(65_535)]);
    assert!(out.status.success(), "a 65,535-byte identifier has a shard");
}
