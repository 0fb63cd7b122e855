//! `fleetmq-loadgen retained`: many retained messages, and a subscriber
//! that wants them all (issue 23: "80,000 retained topics and a `#`
//! subscriber: the SUBSCRIBE is answered within 2 s on any replica").
//!
//! `--store N` publishes N retained messages on `{prefix}/<i/1000>/<i>`
//! (i from 0) at QoS 1, `--window` unacknowledged at a time, and waits
//! for every PUBACK. `--subscribe FILTER` then (or alone, on another
//! broker) connects a clean session, subscribes to FILTER at `--qos` and
//! reads until `--expect` distinct retained `{prefix}/...` topics came
//! (each payload checked byte for byte against what `--store` writes),
//! or `--timeout`. It reports the time from the SUBSCRIBE to its SUBACK,
//! to the first retained message and to the last one, and whether any
//! retained message came before the SUBACK.
//!
//! Plain TCP (`mqtt://`) and blocking sockets: one connection at a time,
//! nothing to share. MQTT 3.1.1, or MQTT 5 with `--receive-maximum`.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::options::{parse_duration, parse_url, BrokerUrl};

/// `fleetmq-loadgen retained` options.
#[derive(Debug, clap::Args)]
pub struct RetainedArgs {
    /// Broker URL (`mqtt://HOST:PORT` only).
    #[arg(long, value_parser = parse_url, default_value = "mqtt://127.0.0.1:1883")]
    pub url: BrokerUrl,
    /// Store this many retained messages first (QoS 1, every PUBACK
    /// awaited); 0: none.
    #[arg(long, default_value_t = 0)]
    pub store: usize,
    /// Payload bytes of each stored message: the index in decimal,
    /// left-padded with `0` (its last digits when longer).
    #[arg(long, default_value_t = 32)]
    pub payload_size: usize,
    /// QoS 1 publishes of `--store` unacknowledged at most (1..=65535).
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u16).range(1..))]
    pub window: u16,
    /// First topic level of the stored topics.
    #[arg(long, default_value = "p")]
    pub prefix: String,
    /// Subscribe to this filter and wait for the retained messages.
    #[arg(long)]
    pub subscribe: Option<String>,
    /// The subscription's QoS (0, 1 or 2; QoS 1 and 2 messages are
    /// acknowledged as they arrive).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=2))]
    pub qos: u8,
    /// Distinct retained `{prefix}/...` topics to wait for (default
    /// `--store`).
    #[arg(long)]
    pub expect: Option<usize>,
    /// Give up waiting after this long.
    #[arg(long, value_parser = parse_duration, default_value = "60s")]
    pub timeout: Duration,
    /// Speak MQTT 5 and announce this Receive Maximum (else MQTT 3.1.1).
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..))]
    pub receive_maximum: Option<u16>,
    /// Write the result as one JSON object to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// What `retained` measured; times in milliseconds.
#[derive(Debug, Default, serde::Serialize)]
pub struct RetainedReport {
    /// Messages stored.
    pub stored: usize,
    /// How long storing them took.
    pub store_ms: f64,
    /// SUBSCRIBE written → SUBACK read.
    pub suback_ms: Option<f64>,
    /// SUBSCRIBE written → first expected retained message read.
    pub first_ms: Option<f64>,
    /// SUBSCRIBE written → last expected retained message read.
    pub last_ms: Option<f64>,
    /// Distinct expected topics received.
    pub distinct: usize,
    /// Distinct topics expected.
    pub expected: usize,
    /// Retained PUBLISHes received on an expected topic more than once.
    pub repeated: usize,
    /// Expected topics whose payload differed from what `--store` writes.
    pub mismatched: usize,
    /// Retained PUBLISHes read before the SUBACK.
    pub before_suback: usize,
    /// PUBLISHes per QoS received.
    pub qos_seen: [usize; 3],
}

/// The payload `--store` writes for index `i`.
pub fn payload(i: usize, size: usize) -> Vec<u8> {
    let digits = format!("{i:0size$}");
    digits.as_bytes()[digits.len() - size..].to_vec()
}

/// The topic of index `i`.
pub fn topic(prefix: &str, i: usize) -> String {
    format!("{prefix}/{}/{i}", i / 1000)
}

/// Run `retained`.
///
/// # Errors
/// The broker cannot be reached, refused the CONNECT or a SUBSCRIBE,
/// closed the connection, or an answer did not come within `--timeout`.
pub fn run(args: &RetainedArgs) -> Result<RetainedReport, String> {
    let mut report = RetainedReport::default();
    if args.store > 0 {
        let started = Instant::now();
        store(args)?;
        report.stored = args.store;
        report.store_ms = ms(started.elapsed());
    }
    if let Some(filter) = &args.subscribe {
        subscribe(args, filter, &mut report)?;
    }
    Ok(report)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// An MQTT connection on a blocking socket (clean session, keep alive
/// 60 s; also used by `suback`).
pub(crate) struct Conn {
    stream: TcpStream,
    buf: Vec<u8>,
    at: usize,
    pub(crate) v5: bool,
}

impl Conn {
    fn open(args: &RetainedArgs, client_id: &str) -> Result<Conn, String> {
        Conn::connect(&args.url, client_id, args.receive_maximum, args.timeout)
    }

    /// Connect to `url` as `client_id` (MQTT 5 with this Receive Maximum,
    /// else 3.1.1) and wait for the CONNACK within `timeout`.
    pub(crate) fn connect(
        url: &BrokerUrl,
        client_id: &str,
        receive_maximum: Option<u16>,
        timeout: Duration,
    ) -> Result<Conn, String> {
        let stream =
            TcpStream::connect(url.addr).map_err(|e| format!("connect {}: {e}", url.text))?;
        stream.set_nodelay(true).map_err(|e| e.to_string())?;
        stream
            .set_read_timeout(Some(Duration::from_millis(200)))
            .map_err(|e| e.to_string())?;
        let mut conn = Conn {
            stream,
            buf: Vec::new(),
            at: 0,
            v5: receive_maximum.is_some(),
        };
        let mut body = string(b"MQTT");
        body.extend([if conn.v5 { 5 } else { 4 }, 0x02, 0, 60]);
        if let Some(max) = receive_maximum {
            body.extend([3, 0x21]);
            body.extend(max.to_be_bytes());
        }
        body.extend(string(client_id.as_bytes()));
        conn.write(&packet(0x10, &body))?;
        let deadline = Instant::now() + timeout;
        loop {
            match conn.next(deadline)? {
                (0x20, body) if body.get(1) == Some(&0) => return Ok(conn),
                (0x20, body) => return Err(format!("CONNACK refused: {body:02x?}")),
                _ => {}
            }
        }
    }

    /// Write `bytes`.
    pub(crate) fn write(&mut self, bytes: &[u8]) -> Result<(), String> {
        self.stream
            .write_all(bytes)
            .map_err(|e| format!("write: {e}"))
    }

    /// The next whole packet (header byte, body), reading until `deadline`.
    pub(crate) fn next(&mut self, deadline: Instant) -> Result<(u8, Vec<u8>), String> {
        loop {
            if let Some((header, body, used)) = split(&self.buf[self.at..]) {
                let body = body.to_vec();
                self.at += used;
                return Ok((header, body));
            }
            if Instant::now() >= deadline {
                return Err("no answer in time".to_owned());
            }
            self.buf.drain(..self.at);
            self.at = 0;
            let len = self.buf.len();
            self.buf.resize(len + (64 << 10), 0);
            match self.stream.read(&mut self.buf[len..]) {
                Ok(0) => return Err("connection closed by the broker".to_owned()),
                Ok(n) => self.buf.truncate(len + n),
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    self.buf.truncate(len)
                }
                Err(e) => return Err(format!("read: {e}")),
            }
        }
    }
}

/// Store `args.store` retained messages at QoS 1.
fn store(args: &RetainedArgs) -> Result<(), String> {
    let mut conn = Conn::open(args, &format!("retainer-{}", std::process::id()))?;
    let (mut sent, mut acked) = (0usize, 0usize);
    let window = usize::from(args.window);
    let mut batch = Vec::new();
    while acked < args.store {
        batch.clear();
        while sent < args.store && sent - acked < window {
            let id = (sent % 65_535 + 1) as u16;
            let mut body = string(topic(&args.prefix, sent).as_bytes());
            body.extend(id.to_be_bytes());
            if conn.v5 {
                body.push(0);
            }
            body.extend(payload(sent, args.payload_size));
            batch.extend(packet(0x33, &body));
            sent += 1;
        }
        if !batch.is_empty() {
            conn.write(&batch)?;
        }
        let deadline = Instant::now() + args.timeout;
        match conn.next(deadline)? {
            (0x40, body) if body.get(2).is_none_or(|&code| code < 0x80) => acked += 1,
            (0x40, body) => return Err(format!("PUBACK refused: {body:02x?}")),
            _ => {}
        }
    }
    Ok(())
}

/// Subscribe to `filter` and read the retained messages.
fn subscribe(args: &RetainedArgs, filter: &str, report: &mut RetainedReport) -> Result<(), String> {
    let expected = args.expect.unwrap_or(args.store);
    report.expected = expected;
    let mut conn = Conn::open(args, &format!("retained-sub-{}", std::process::id()))?;
    let mut seen = vec![false; expected];
    let mut body = vec![0, 1];
    if conn.v5 {
        body.push(0);
    }
    body.extend(string(filter.as_bytes()));
    body.push(args.qos);
    let started = Instant::now();
    conn.write(&packet(0x82, &body))?;
    let deadline = started + args.timeout;
    let mut acks = Vec::new();
    while report.distinct < expected || report.suback_ms.is_none() {
        let (header, body) = match conn.next(deadline) {
            Ok(p) => p,
            Err(e) if report.suback_ms.is_some() => {
                eprintln!(
                    "fleetmq-loadgen: retained: {e}: {} of {expected} received",
                    report.distinct
                );
                break;
            }
            Err(e) => return Err(e),
        };
        match header >> 4 {
            9 => {
                if body.last().is_some_and(|&code| code >= 0x80) {
                    return Err(format!("SUBACK refused: {body:02x?}"));
                }
                report.suback_ms = Some(ms(started.elapsed()));
            }
            3 => {
                let qos = usize::from((header >> 1) & 3);
                report.qos_seen[qos.min(2)] += 1;
                let Some(len) = body
                    .get(..2)
                    .map(|b| usize::from(u16::from_be_bytes([b[0], b[1]])))
                else {
                    return Err("PUBLISH too short".to_owned());
                };
                let topic = &body[2..2 + len];
                let mut at = 2 + len;
                if qos > 0 {
                    let ack = packet(if qos == 1 { 0x40 } else { 0x50 }, &body[at..at + 2]);
                    acks.extend(ack);
                    at += 2;
                }
                if conn.v5 {
                    let (props, used) = varint(&body[at..]).ok_or("bad properties length")?;
                    at += used + props;
                }
                if header & 1 == 1 {
                    account(args, report, &mut seen, topic, &body[at..], started);
                }
            }
            // PUBREL: PUBCOMP.
            6 => acks.extend(packet(0x70, &body[..2])),
            _ => {}
        }
        // Acknowledge what this read brought, once it is handled.
        if conn.at == conn.buf.len() && !acks.is_empty() {
            conn.write(&acks)?;
            acks.clear();
        }
    }
    Ok(())
}

/// Count one retained message on `topic` with `payload`.
fn account(
    args: &RetainedArgs,
    report: &mut RetainedReport,
    seen: &mut [bool],
    topic: &[u8],
    payload: &[u8],
    started: Instant,
) {
    let topic = String::from_utf8_lossy(topic);
    let index = topic
        .strip_prefix(args.prefix.as_str())
        .and_then(|rest| rest.rsplit('/').next())
        .and_then(|i| i.parse::<usize>().ok())
        .filter(|&i| i < seen.len() && *topic == self::topic(&args.prefix, i));
    let Some(i) = index else { return };
    if report.suback_ms.is_none() {
        report.before_suback += 1;
    }
    if seen[i] {
        report.repeated += 1;
        return;
    }
    seen[i] = true;
    if payload != self::payload(i, args.payload_size).as_slice() {
        report.mismatched += 1;
    }
    report.distinct += 1;
    let now = ms(started.elapsed());
    report.first_ms.get_or_insert(now);
    report.last_ms = Some(now);
}

/// A length-prefixed MQTT string.
pub(crate) fn string(s: &[u8]) -> Vec<u8> {
    let mut out = (s.len() as u16).to_be_bytes().to_vec();
    out.extend_from_slice(s);
    out
}

/// A packet: `header`, the Remaining Length, `body`.
pub(crate) fn packet(header: u8, body: &[u8]) -> Vec<u8> {
    let mut out = vec![header];
    let mut len = body.len();
    loop {
        let byte = (len % 128) as u8;
        len /= 128;
        out.push(if len > 0 { byte | 0x80 } else { byte });
        if len == 0 {
            break;
        }
    }
    out.extend_from_slice(body);
    out
}

/// A Variable Byte Integer at the start of `bytes`: (value, bytes used).
fn varint(bytes: &[u8]) -> Option<(usize, usize)> {
    let mut value = 0usize;
    for (i, &b) in bytes.iter().take(4).enumerate() {
        value |= usize::from(b & 0x7f) << (7 * i);
        if b & 0x80 == 0 {
            return Some((value, i + 1));
        }
    }
    None
}

/// The first whole packet of `buf`: (header, body, bytes used).
fn split(buf: &[u8]) -> Option<(u8, &[u8], usize)> {
    let (len, used) = varint(buf.get(1..)?)?;
    let end = 1 + used + len;
    (buf.len() >= end).then(|| (buf[0], &buf[1 + used..end], end))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payloads_are_the_index_padded_or_its_last_digits() {
        assert_eq!(payload(42, 5), b"00042");
        assert_eq!(payload(123_456, 3), b"456");
        assert_eq!(payload(7, 32).len(), 32);
    }

    #[test]
    fn packets_split_after_their_remaining_length() {
        let p = packet(0x30, &[7; 200]);
        assert_eq!(split(&p), Some((0x30, &[7u8; 200][..], 203)));
        assert_eq!(split(&p[..100]), None);
    }
}
