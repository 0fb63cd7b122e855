//! MQTT codec micro-benchmarks (hot path of every message).
//!
//! - `decode_publish/{64,4096}` and `encode_publish/{64,4096}`: one MQTT 5
//!   QoS 1 PUBLISH on `sensors/site42/dev1234/temp` with that many payload
//!   bytes (decode slices the payload, never copies it).
//! - `decode_connect_v5_properties` / `encode_connect_v5_properties`: an
//!   MQTT 5 CONNECT with a will, user name, password and the usual
//!   properties (session expiry, receive maximum, topic alias maximum, user
//!   properties).

use std::hint::black_box;
use std::num::NonZeroU16;

use bytes::{Bytes, BytesMut};
use criterion::{BenchmarkId, Criterion, Throughput};
use fleetmq_core::packet::codec::{decode, encode};
use fleetmq_core::packet::{Connect, Packet, Properties, ProtocolVersion, Publish, QoS, Will};

fn publish(payload: usize) -> Packet {
    let mut properties = Properties::default();
    properties.message_expiry_interval = Some(60);
    Packet::Publish(Publish {
        dup: false,
        qos: QoS::AtLeastOnce,
        retain: false,
        topic: "sensors/site42/dev1234/temp".into(),
        packet_id: NonZeroU16::new(7),
        properties: properties.into(),
        payload: Bytes::from(vec![0x5a; payload]),
    })
}

fn connect() -> Packet {
    let mut properties = Properties::default();
    properties.session_expiry_interval = Some(3600);
    properties.receive_maximum = Some(100);
    properties.topic_alias_maximum = Some(16);
    properties.user_properties = vec![("fleet".into(), "north".into()), ("fw".into(), "1.4.2".into())];
    let mut will_properties = Properties::default();
    will_properties.will_delay_interval = Some(30);
    Packet::Connect(Box::new(Connect {
        protocol: ProtocolVersion::V5,
        clean_start: false,
        keep_alive: 60,
        client_id: "device-000123456".into(),
        will: Some(Will {
            topic: "devices/device-000123456/status".into(),
            payload: Bytes::from_static(b"offline"),
            qos: QoS::AtLeastOnce,
            retain: true,
            properties: will_properties.into(),
        }),
        username: Some("device-000123456".into()),
        password: Some(Bytes::from_static(b"correct horse battery staple")),
        properties: properties.into(),
    }))
}

fn encoded(packet: &Packet) -> Bytes {
    let mut buf = BytesMut::new();
    encode(packet, ProtocolVersion::V5, &mut buf).expect("encodes");
    buf.freeze()
}

fn bench_publish(c: &mut Criterion) {
    for size in [64usize, 4096] {
        let packet = publish(size);
        let wire = encoded(&packet);
        let mut group = c.benchmark_group("publish");
        group.throughput(Throughput::Elements(1));
        group.bench_with_input(BenchmarkId::new("decode", size), &wire, |b, wire| {
            b.iter(|| {
                let mut buf = BytesMut::from(&wire[..]);
                black_box(decode(&mut buf, Some(ProtocolVersion::V5), 1 << 20).expect("valid"))
            })
        });
        group.bench_with_input(BenchmarkId::new("encode", size), &packet, |b, packet| {
            let mut buf = BytesMut::with_capacity(8192);
            b.iter(|| {
                buf.clear();
                encode(black_box(packet), ProtocolVersion::V5, &mut buf).expect("encodes");
                black_box(buf.len())
            })
        });
        group.finish();
    }
}

fn bench_connect(c: &mut Criterion) {
    let packet = connect();
    let wire = encoded(&packet);
    c.bench_function("decode_connect_v5_properties", |b| {
        b.iter(|| {
            let mut buf = BytesMut::from(&wire[..]);
            black_box(decode(&mut buf, None, 1 << 20).expect("valid"))
        })
    });
    c.bench_function("encode_connect_v5_properties", |b| {
        let mut buf = BytesMut::with_capacity(1024);
        b.iter(|| {
            buf.clear();
            encode(black_box(&packet), ProtocolVersion::V5, &mut buf).expect("encodes");
            black_box(buf.len())
        })
    });
}

fn main() {
    let mut c = Criterion::default().configure_from_args();
    bench_publish(&mut c);
    bench_connect(&mut c);
    c.final_summary();
}
