//! An inbound QoS 2 packet identifier whose PUBREC was refused (reason
//! 0x80 or above) is free again (MQTT 5 §4.3.3: "The Packet Identifier
//! becomes available for reuse once the sender has received the PUBCOMP
//! packet or a PUBREC with a Reason Code of 0x80 or greater"): a PUBLISH
//! that reuses it is a new message, stored, acknowledged once durable and
//! forwarded once, also after a restart. MQTT 3.1.1 closes the connection
//! instead; the resend after the reconnect is stored and delivered once.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::clients::{unique, v4, v5};
use crate::raw::{wire, Incoming, RawClient};
use crate::store::{kill, local, nix_free_bytes, ready_again, SmallDisk, SLOW_DISK};

/// PUBREC, PUBCOMP, PUBACK first bytes.
const PUBREC: u8 = 0x50;
const PUBCOMP: u8 = 0x70;
const PUBACK: u8 = 0x40;

/// The broker's settings: subscribers keep every value of the test.
const ARGS: [&str; 2] = ["--set", "limits.max_subscriber_queue=1000000"];

/// A raw connection to `port` (blocking reads: called in `block_in_place`).
fn raw(port: u16) -> RawClient {
    RawClient::connect(SocketAddr::from(([127, 0, 0, 1], port)))
}

/// The next packet with first byte `header` for `packet_id`: its reason
/// code (0 when the short form leaves it out); `None` when the broker
/// closed the connection first.
fn answer(client: &mut RawClient, header: u8, packet_id: u16) -> Option<u8> {
    let deadline = Instant::now() + SLOW_DISK;
    loop {
        match tokio::task::block_in_place(|| {
            client.read(deadline.saturating_duration_since(Instant::now()))
        }) {
            Incoming::Packet { header: h, body }
                if h == header && body[..2] == packet_id.to_be_bytes() =>
            {
                return Some(body.get(2).copied().unwrap_or(0));
            }
            Incoming::Packet { .. } => {}
            Incoming::Closed => return None,
            Incoming::TimedOut => {
                panic!("no packet {header:#x} for {packet_id} within {SLOW_DISK:?}")
            }
        }
    }
}

/// Complete an accepted QoS 2 flow: PUBREL, then PUBCOMP 0.
fn release(client: &mut RawClient, packet_id: u16) {
    client.send(&wire::pubrel(packet_id));
    assert_eq!(answer(client, PUBCOMP, packet_id), Some(0));
}

/// Fill the disk under `mount` to about 256 KiB free; returns the filler.
fn fill(mount: &std::path::Path) -> std::path::PathBuf {
    let filler = mount.join("filler");
    let free = nix_free_bytes(mount);
    let status = Command::new("fallocate")
        .args(["-l", &(free.saturating_sub(256 << 10)).to_string()])
        .arg(&filler)
        .status()
        .unwrap();
    assert!(status.success());
    filler
}

/// QoS 2 publishes of 8 KiB, one at a time, identifiers 1, 2, ..., each
/// completed, until one is refused: its identifier, after the store
/// accepted it and then failed to write it (the first refusal is the
/// write's: until then the store took everything). MQTT 5: PUBREC 0x97;
/// 3.1.1: the connection is closed (`None` reason).
fn publish_until_refused(client: &mut RawClient, topic: &str, v5: bool) -> u16 {
    let pad = vec![b'x'; 8 << 10];
    for packet_id in 1..400u16 {
        let mut payload = format!("{packet_id} ").into_bytes();
        payload.extend_from_slice(&pad);
        client.send(&wire::publish(
            topic,
            2,
            packet_id,
            (false, false),
            &payload,
            v5,
        ));
        match answer(client, PUBREC, packet_id) {
            Some(0) => release(client, packet_id),
            Some(reason) => {
                assert_eq!(reason, 0x97, "Quota exceeded");
                return packet_id;
            }
            None => {
                assert!(!v5, "an MQTT 5 connection gets PUBREC 0x97");
                return packet_id;
            }
        }
    }
    panic!("the disk never filled up");
}

/// The payloads `client` receives within 1 s of quiet.
async fn payloads(client: &mut v5::Client) -> Vec<Vec<u8>> {
    let mut got = Vec::new();
    while let Some(p) = client.try_next_publish(Duration::from_secs(1)).await {
        got.push(p.payload.to_vec());
    }
    got
}

/// Local store, disk full: the QoS 2 PUBLISH whose write failed is refused
/// with PUBREC 0x97 after the session opened its identifier (and logged
/// that). Once space returns and the broker is killed and restarted, the
/// resumed session does not hold the identifier open: a new message with
/// it gets PUBREC 0x00 once durable (it survives a second SIGKILL) and a
/// subscriber gets it exactly once (MQTT 5 §4.3.3, DESIGN.md §7).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_qos2_identifier_refused_for_a_full_disk_is_free_after_a_restart_and_its_reuse_is_stored_once(
) {
    let Some(disk) = SmallDisk::mount_or_skip() else {
        return;
    };
    let (dir, args) = (disk.mount.0.join("data"), ARGS);
    let broker = local(&dir, &args);
    let (topic, id) = (unique("refq2/t"), unique("refq2pub"));
    let connect = wire::Connect {
        clean: true,
        session_expiry: Some(600),
        ..wire::Connect::v5(&id)
    };
    let mut publisher = raw(broker.mqtt_port());
    assert_eq!(
        tokio::task::block_in_place(|| publisher.handshake(&connect.encode())),
        (0, 0)
    );
    let filler = fill(&disk.mount.0);
    let refused = publish_until_refused(&mut publisher, &topic, true);
    std::fs::remove_file(&filler).unwrap();
    ready_again(&broker).await;
    // A QoS 1 publish on the same connection: the release of the refused
    // identifier is logged before it, and its PUBACK waits until durable.
    publisher.send(&wire::publish(
        "refq2/marker",
        1,
        1,
        (false, false),
        b"m",
        true,
    ));
    assert_eq!(answer(&mut publisher, PUBACK, 1), Some(0));
    kill(broker);

    let broker = local(&dir, &args);
    let mut sub = v5::Client::connect(broker.mqtt_port(), &unique("refq2sub")).await;
    sub.subscribe(&topic, v5::QoS::ExactlyOnce).await;
    let mut publisher = raw(broker.mqtt_port());
    let resume = wire::Connect {
        clean: false,
        ..connect
    };
    assert_eq!(
        tokio::task::block_in_place(|| publisher.handshake(&resume.encode())),
        (1, 0),
        "session present"
    );
    publisher.send(&wire::publish(
        &topic,
        2,
        refused,
        (false, true),
        b"reused",
        true,
    ));
    assert_eq!(
        answer(&mut publisher, PUBREC, refused),
        Some(0),
        "a new message, accepted"
    );
    release(&mut publisher, refused);
    let got = payloads(&mut sub).await;
    assert_eq!(
        got.iter().filter(|p| p.as_slice() == b"reused").count(),
        1,
        "forwarded exactly once: {} values",
        got.len()
    );
    kill(broker);

    // PUBREC 0x00 came only once it was durable.
    let broker = local(&dir, &args);
    let mut late = v5::Client::connect(broker.mqtt_port(), &unique("refq2late")).await;
    late.subscribe(&topic, v5::QoS::ExactlyOnce).await;
    assert_eq!(
        payloads(&mut late).await,
        vec![b"reused".to_vec()],
        "the retained reuse survived SIGKILL"
    );
    kill(broker);
}

/// MQTT 3.1.1 has no refusing PUBREC: the connection is closed when the
/// write fails. The client reconnects with Clean Session 0 and sends the
/// same PUBLISH again (DUP): PUBREC comes once it is durable, and a
/// persistent subscriber that was away finds it in its session exactly
/// once after a SIGKILL and restart `[MQTT-4.3.3-2]`, `[MQTT-4.4.0-1]`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_3_1_1_qos2_publish_closed_for_a_full_disk_and_resent_after_reconnect_is_stored_and_delivered_once(
) {
    let Some(disk) = SmallDisk::mount_or_skip() else {
        return;
    };
    let (dir, args) = (disk.mount.0.join("data"), ARGS);
    let broker = local(&dir, &args);
    let port = broker.mqtt_port();
    let (topic, id, sub_id) = (unique("refq2o/t"), unique("refq2o"), unique("refq2osub"));
    let (mut sub, _) = v4::Client::connect_with(v4::options(port, &sub_id, false)).await;
    sub.subscribe(&topic, v4::QoS::ExactlyOnce).await;
    sub.disconnect().await;
    let connect = wire::Connect {
        clean: false,
        ..wire::Connect::v311(&id)
    };
    let mut publisher = raw(port);
    assert_eq!(
        tokio::task::block_in_place(|| publisher.handshake(&connect.encode())).1,
        0
    );
    let filler = fill(&disk.mount.0);
    let closed = publish_until_refused(&mut publisher, &topic, false);
    std::fs::remove_file(&filler).unwrap();
    ready_again(&broker).await;
    let mut payload = format!("{closed} ").into_bytes();
    payload.extend_from_slice(&vec![b'x'; 8 << 10]);
    let mut publisher = raw(port);
    assert_eq!(
        tokio::task::block_in_place(|| publisher.handshake(&connect.encode())),
        (1, 0),
        "session present"
    );
    publisher.send(&wire::publish(
        &topic,
        2,
        closed,
        (true, false),
        &payload,
        false,
    ));
    assert_eq!(answer(&mut publisher, PUBREC, closed), Some(0));
    release(&mut publisher, closed);
    kill(broker);

    let broker = local(&dir, &args);
    let (mut sub, _) =
        v4::Client::connect_with(v4::options(broker.mqtt_port(), &sub_id, false)).await;
    let (mut seen, mut values) = (0, BTreeSet::new());
    while let Some(p) = sub.try_next_publish(Duration::from_secs(2)).await {
        seen += usize::from(p.payload.as_ref() == payload.as_slice());
        values.insert(p.payload.split(|b| *b == b' ').next().map(<[u8]>::to_vec));
    }
    assert_eq!(
        seen,
        1,
        "stored and delivered exactly once ({} values)",
        values.len()
    );
    kill(broker);
}
