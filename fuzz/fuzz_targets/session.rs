//! The session state machine fed arbitrary packets: the bytes after the
//! first are decoded as packets of the chosen protocol version and handed to
//! `Session::handle`, interleaved with deliveries, disconnects and resumes.
//! It must never panic, never exceed the client's Receive Maximum, and
//! close the connection after a `Close` output.
#![no_main]

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use fleetmq_core::packet::codec::decode;
use fleetmq_core::packet::{Connect, Properties, ProtocolVersion, QoS};
use fleetmq_core::session::{negotiate, ConnectLimits, Delivery, Message, Output, Session, SessionLimits};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&head, rest)) = data.split_first() else { return };
    let protocol = match head % 3 {
        0 => ProtocolVersion::V3_1,
        1 => ProtocolVersion::V3_1_1,
        _ => ProtocolVersion::V5,
    };
    let receive_maximum = u16::from(head >> 4).max(1);
    let mut properties = Properties::default();
    properties.receive_maximum = Some(receive_maximum);
    properties.topic_alias_maximum = Some(4);
    properties.session_expiry_interval = Some(60);
    let connect = Connect {
        protocol,
        clean_start: false,
        keep_alive: 30,
        client_id: "fuzz".into(),
        will: None,
        username: None,
        password: None,
        properties: properties.into(),
    };
    let Ok(negotiated) = negotiate(&connect, &ConnectLimits::default(), || "x".into()) else { return };
    let limits = SessionLimits { max_queue: 8, receive_maximum: 4, topic_alias_maximum: 4, ..SessionLimits::default() };
    let mut session = Session::new(protocol, &negotiated, std::sync::Arc::new(limits));
    let t0 = Instant::now();
    let mut buf = BytesMut::from(rest);
    let mut out = Vec::new();
    let mut step = 0u64;
    loop {
        step += 1;
        let now = t0 + Duration::from_millis(step * 100);
        let packet = match decode(&mut buf, Some(protocol), 4096) {
            Ok(Some(p)) => p,
            _ => break,
        };
        session.handle(packet, now, &mut out);
        let closed = out.iter().any(|o| matches!(o, Output::Close { .. }));
        // Every few steps, something arrives for the client; sometimes the
        // connection drops and comes back.
        let qos = QoS::from_u8((step % 3) as u8).unwrap();
        let message = Arc::new(Message {
            topic: "t/x".into(),
            payload: Bytes::from_static(b"p"),
            qos,
            retain: false,
            properties: Default::default(),
            received_at: now,
            origin: 1,
            stored: 0,
            from_mesh: false,
            groups: fleetmq_core::session::GroupPick::ALL,
        });
        session.deliver(Delivery { message, qos, retain: false, subscription_ids: vec![], group: None }, now, &mut out);
        if closed || step % 7 == 0 {
            session.go_offline();
            session.take_shared_deliveries();
            session.resume(protocol, &negotiated, now, &mut out);
        }
        assert!(session.inflight() <= usize::from(receive_maximum));
        assert!(session.queued() <= 8);
        out.clear();
    }
});
