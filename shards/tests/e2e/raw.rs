//! A raw-socket MQTT client for what real clients will not send: malformed
//! packets, silent connections, DISCONNECT with a chosen reason code. It
//! writes bytes and reads whole packets with timeouts; `wire` builds the
//! few packets the tests need, byte by byte.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

/// What a read saw.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Incoming {
    /// One whole packet: fixed header byte and the bytes after the
    /// remaining length.
    Packet { header: u8, body: Vec<u8> },
    /// The broker closed the connection (EOF or reset).
    Closed,
    /// Nothing complete arrived in time.
    TimedOut,
}

/// A plain TCP connection speaking bytes.
pub(crate) struct RawClient {
    stream: TcpStream,
    buf: Vec<u8>,
}

impl RawClient {
    /// Connects to `addr`.
    pub(crate) fn connect(addr: SocketAddr) -> RawClient {
        let stream = TcpStream::connect(addr).expect("raw connect");
        stream.set_nodelay(true).unwrap();
        RawClient {
            stream,
            buf: Vec::new(),
        }
    }

    /// Connects to `addr`, or the error (nothing listens there).
    pub(crate) fn try_connect(addr: SocketAddr) -> std::io::Result<RawClient> {
        let stream = TcpStream::connect(addr)?;
        stream.set_nodelay(true)?;
        Ok(RawClient { stream, buf: Vec::new() })
    }

    /// Connects to `addr` from the local address `source` (any 127.0.0.x
    /// reaches a loopback listener on Linux), bound before the connect.
    pub(crate) fn connect_from(addr: SocketAddr, source: std::net::IpAddr) -> RawClient {
        use socket2::{Domain, Socket, Type};
        let socket = Socket::new(Domain::for_address(addr), Type::STREAM, None).expect("socket");
        socket
            .bind(&SocketAddr::new(source, 0).into())
            .expect("bind the source address");
        socket.connect(&addr.into()).expect("raw connect");
        let stream = TcpStream::from(socket);
        stream.set_nodelay(true).unwrap();
        RawClient {
            stream,
            buf: Vec::new(),
        }
    }

    /// Writes `bytes`; an error (the broker already closed) is ignored, the
    /// next read reports it.
    pub(crate) fn send(&mut self, bytes: &[u8]) {
        let _ = self.stream.write_all(bytes);
    }

    /// The socket, for a client that reads on its own.
    pub(crate) fn into_stream(self) -> TcpStream {
        self.stream
    }

    /// Writes `bytes`; the error when the write fails (a reset, say).
    pub(crate) fn try_send(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.stream.write_all(bytes)
    }

    /// Reads the next whole packet, waiting at most `timeout`.
    pub(crate) fn read(&mut self, timeout: Duration) -> Incoming {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some((header, body, used)) = split_packet(&self.buf) {
                self.buf.drain(..used);
                return Incoming::Packet { header, body };
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Incoming::TimedOut;
            }
            self.stream.set_read_timeout(Some(left)).unwrap();
            let mut chunk = [0u8; 4096];
            match self.stream.read(&mut chunk) {
                Ok(0) => return Incoming::Closed,
                Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => return Incoming::Closed,
            }
        }
    }

    /// Reads until the broker closes the connection and returns the packets
    /// seen before the close.
    ///
    /// # Panics
    ///
    /// The connection is still open after `timeout`.
    pub(crate) fn packets_until_closed(&mut self, timeout: Duration) -> Vec<(u8, Vec<u8>)> {
        let deadline = Instant::now() + timeout;
        let mut seen = Vec::new();
        loop {
            match self.read(deadline.saturating_duration_since(Instant::now())) {
                Incoming::Packet { header, body } => seen.push((header, body)),
                Incoming::Closed => return seen,
                Incoming::TimedOut => {
                    panic!("still open after {timeout:?}; packets seen: {seen:02x?}")
                }
            }
        }
    }

    /// Sends `connect` and returns the CONNACK's (session present flags,
    /// reason code).
    ///
    /// # Panics
    ///
    /// No CONNACK within 5 s.
    pub(crate) fn handshake(&mut self, connect: &[u8]) -> (u8, u8) {
        self.send(connect);
        match self.read(Duration::from_secs(5)) {
            Incoming::Packet { header: 0x20, body } if body.len() >= 2 => (body[0], body[1]),
            other => panic!("expected CONNACK, got {other:02x?}"),
        }
    }
}

/// Splits one packet off the front of `buf`: (header, body, bytes used).
pub(crate) fn split_packet(buf: &[u8]) -> Option<(u8, Vec<u8>, usize)> {
    let (&header, rest) = buf.split_first()?;
    let (mut len, mut shift, mut used) = (0usize, 0, 1);
    for &b in rest.iter().take(4) {
        used += 1;
        len |= usize::from(b & 0x7f) << shift;
        shift += 7;
        if b & 0x80 == 0 {
            return (buf.len() >= used + len)
                .then(|| (header, buf[used..used + len].to_vec(), used + len));
        }
    }
    None
}

/// Packet builders.
pub(crate) mod wire {
    /// A variable byte integer.
    pub(crate) fn varint(mut n: usize) -> Vec<u8> {
        let mut out = Vec::new();
        loop {
            let mut b = (n % 128) as u8;
            n /= 128;
            if n > 0 {
                b |= 0x80;
            }
            out.push(b);
            if n == 0 {
                return out;
            }
        }
    }

    /// A length-prefixed string or binary.
    pub(crate) fn string(s: &[u8]) -> Vec<u8> {
        let mut out = (s.len() as u16).to_be_bytes().to_vec();
        out.extend_from_slice(s);
        out
    }

    /// A packet from its first byte and body.
    pub(crate) fn packet(header: u8, body: &[u8]) -> Vec<u8> {
        let mut out = vec![header];
        out.extend(varint(body.len()));
        out.extend_from_slice(body);
        out
    }

    /// A will: topic, payload and (MQTT 5) Will Delay Interval.
    #[derive(Clone, Copy)]
    pub(crate) struct Will<'a> {
        pub(crate) topic: &'a str,
        pub(crate) payload: &'a [u8],
        pub(crate) delay_secs: Option<u32>,
        /// MQTT 5 Payload Format Indicator (1: UTF-8).
        pub(crate) payload_format: Option<u8>,
    }

    /// A CONNECT. `level` 3 uses the name `MQIsdp`, others `MQTT`; MQTT 5
    /// (level 5) gets a Session Expiry Interval property when given.
    #[derive(Clone, Copy)]
    pub(crate) struct Connect<'a> {
        pub(crate) level: u8,
        pub(crate) client_id: &'a str,
        pub(crate) clean: bool,
        pub(crate) keep_alive: u16,
        pub(crate) will: Option<Will<'a>>,
        pub(crate) session_expiry: Option<u32>,
    }

    impl<'a> Connect<'a> {
        /// MQTT 3.1.1, clean session, keep alive 60 s.
        pub(crate) fn v311(client_id: &'a str) -> Self {
            Connect {
                level: 4,
                client_id,
                clean: true,
                keep_alive: 60,
                will: None,
                session_expiry: None,
            }
        }

        /// MQTT 5, clean start, keep alive 60 s.
        pub(crate) fn v5(client_id: &'a str) -> Self {
            Connect {
                level: 5,
                ..Connect::v311(client_id)
            }
        }

        /// The encoded packet.
        pub(crate) fn encode(&self) -> Vec<u8> {
            let v5 = self.level == 5;
            let name: &[u8] = if self.level == 3 { b"MQIsdp" } else { b"MQTT" };
            let mut body = string(name);
            body.push(self.level);
            let mut flags = if self.clean { 0x02 } else { 0 };
            if self.will.is_some() {
                flags |= 0x04;
            }
            body.push(flags);
            body.extend_from_slice(&self.keep_alive.to_be_bytes());
            if v5 {
                let mut props = Vec::new();
                if let Some(expiry) = self.session_expiry {
                    props.push(0x11);
                    props.extend_from_slice(&expiry.to_be_bytes());
                }
                body.extend(varint(props.len()));
                body.extend(props);
            }
            body.extend(string(self.client_id.as_bytes()));
            if let Some(will) = self.will {
                if v5 {
                    let mut props = Vec::new();
                    if let Some(delay) = will.delay_secs {
                        props.push(0x18);
                        props.extend_from_slice(&delay.to_be_bytes());
                    }
                    if let Some(format) = will.payload_format {
                        props.extend([0x01, format]);
                    }
                    body.extend(varint(props.len()));
                    body.extend(props);
                }
                body.extend(string(will.topic.as_bytes()));
                body.extend(string(will.payload));
            }
            packet(0x10, &body)
        }
    }

    /// SUBSCRIBE with one filter.
    pub(crate) fn subscribe(packet_id: u16, filter: &str, qos: u8, v5: bool) -> Vec<u8> {
        let mut body = packet_id.to_be_bytes().to_vec();
        if v5 {
            body.push(0);
        }
        body.extend(string(filter.as_bytes()));
        body.push(qos);
        packet(0x82, &body)
    }

    /// PUBLISH at QoS 0.
    pub(crate) fn publish_qos0(topic: &str, payload: &[u8], v5: bool) -> Vec<u8> {
        let mut body = string(topic.as_bytes());
        if v5 {
            body.push(0);
        }
        body.extend_from_slice(payload);
        packet(0x30, &body)
    }

    /// PUBLISH at QoS 1 or 2 with `packet_id` (flags: DUP, RETAIN).
    pub(crate) fn publish(topic: &str, qos: u8, packet_id: u16, (dup, retain): (bool, bool), payload: &[u8], v5: bool) -> Vec<u8> {
        let mut body = string(topic.as_bytes());
        body.extend_from_slice(&packet_id.to_be_bytes());
        if v5 {
            body.push(0);
        }
        body.extend_from_slice(payload);
        packet(0x30 | (u8::from(dup) << 3) | (qos << 1) | u8::from(retain), &body)
    }

    /// PUBREL (MQTT 5: reason 0 and no properties, the short form).
    pub(crate) fn pubrel(packet_id: u16) -> Vec<u8> {
        let [hi, lo] = packet_id.to_be_bytes();
        packet(0x62, &[hi, lo])
    }

    /// MQTT 5 DISCONNECT with `reason`.
    pub(crate) fn disconnect_v5(reason: u8) -> Vec<u8> {
        packet(0xE0, &[reason, 0])
    }

    /// PINGREQ.
    pub(crate) const PINGREQ: [u8; 2] = [0xC0, 0x00];
}
