//! Many clients at once: 1,000 raw MQTT 3.1.1 connections through 2 shards.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::clients::{unique, v4, WAIT};
use crate::harness::Broker;
use crate::raw::wire;

const CLIENTS: usize = 1000;

/// Lets this process hold `CLIENTS` sockets and more (the usual soft limit
/// is 1024 descriptors).
fn raise_fd_limit() {
    // SAFETY: getrlimit/setrlimit on a local struct.
    unsafe {
        let mut lim: libc::rlimit = std::mem::zeroed();
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0
            && lim.rlim_cur < 4 * CLIENTS as libc::rlim_t
        {
            lim.rlim_cur = lim.rlim_max.min(8 * CLIENTS as libc::rlim_t);
            let _ = libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
    }
}

async fn connect_one(broker: std::net::SocketAddr, id: String) -> TcpStream {
    let mut stream = TcpStream::connect(broker).await.expect("connect");
    stream
        .write_all(&wire::Connect::v311(&id).encode())
        .await
        .unwrap();
    let mut connack = [0u8; 4];
    tokio::time::timeout(WAIT, stream.read_exact(&mut connack))
        .await
        .unwrap_or_else(|_| panic!("{id}: no CONNACK within {WAIT:?}"))
        .unwrap_or_else(|e| panic!("{id}: {e}"));
    assert_eq!(connack, [0x20, 2, 0, 0], "{id}: CONNACK accepted");
    stream
}

/// 1,000 clients connect at once and all get CONNACK 0; both shards hold
/// some; `fleetmq_clients_connected` sums to 1,000; a publish still
/// reaches a subscriber.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_clients_connect_at_once_through_two_shards() {
    raise_fd_limit();
    let broker = Broker::two_shards(&[]);
    let addr = broker.mqtt;
    let tasks: Vec<_> = (0..CLIENTS)
        .map(|i| tokio::spawn(connect_one(addr, format!("{}-{i}", unique("many")))))
        .collect();
    let mut streams = Vec::with_capacity(CLIENTS);
    for task in tasks {
        streams.push(task.await.unwrap());
    }
    tokio::task::block_in_place(|| broker.wait_for_clients(CLIENTS, Duration::from_secs(10)));
    let (_, metrics) = tokio::task::block_in_place(|| broker.admin_get("/metrics"));
    for shard in ["0", "1"] {
        let line = format!("fleetmq_clients_connected{{shard=\"{shard}\"}} ");
        let held: f64 = metrics
            .lines()
            .find_map(|l| l.strip_prefix(&line)?.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {line} in /metrics"));
        assert!(held > 0.0, "shard {shard} holds no client");
    }

    let topic = unique("many/t");
    let mut sub = v4::Client::connect(broker.mqtt_port(), &unique("sub")).await;
    sub.subscribe(&topic, v4::QoS::AtLeastOnce).await;
    let publisher = v4::Client::connect(broker.mqtt_port(), &unique("pub")).await;
    publisher
        .client
        .publish(&topic, v4::QoS::AtLeastOnce, false, "to the fleet")
        .await
        .unwrap();
    assert_eq!(&sub.next_publish().await.payload[..], b"to the fleet");
    drop(streams);
}
