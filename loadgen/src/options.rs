//! Command-line options of `fleetmq-loadgen run` and their parsers.
//!
//! Every option is checked before any connection is opened, so a typo fails
//! at once with exit status 2 (clap's usage error).

use std::time::Duration;

use clap::{Args, ValueEnum};
use fleetmq_core::packet::{ProtocolVersion, QoS};
use serde::Serialize;

pub use crate::transport::url::{parse_url, BrokerUrl, Scheme};
use crate::transport::{TransportArgs, TransportOptions};

/// The bytes at the front of every payload: send time (ns, u64 LE) and
/// sequence number (u64 LE).
pub const PAYLOAD_HEADER_BYTES: usize = 16;

/// A scenario of `run`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Scenario {
    /// N publishers on distinct topics `{prefix}/{i}` → M subscribers on `{prefix}/+`.
    FanIn,
    /// Publishers on one topic `{prefix}/all` → N subscribers on that topic.
    FanOut,
    /// Open connections at `--connect-rate` per second up to `--connections`;
    /// CONNACK latency.
    ConnectStorm,
    /// Hold `--connections` idle connections with keep-alive; the broker's
    /// RSS per connection when `--broker-pid` is given.
    Idle,
    /// Publishers on `{prefix}/{i}` → `--subscribers` members of
    /// `$share/{--share-group}/{prefix}/+`; each message to exactly one.
    Shared,
    /// Persistent-session subscribers that disconnect every
    /// `--reconnect-every` for `--offline-for` while publishers run.
    Persistent,
}

/// The offered publish rate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rate {
    /// Open loop: this many messages per second in total, on a fixed
    /// schedule; latency counts from the scheduled send time.
    PerSecond(u64),
    /// Closed loop: as fast as `--window` allows.
    Max,
}

impl Serialize for Rate {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Rate::PerSecond(n) => s.serialize_u64(*n),
            Rate::Max => s.serialize_str("max"),
        }
    }
}

/// Parses `max`, `20000`, `20k` or `1.5M` (messages per second).
pub fn parse_rate(s: &str) -> Result<Rate, String> {
    if s.eq_ignore_ascii_case("max") {
        return Ok(Rate::Max);
    }
    let n = parse_count(s)?;
    if n == 0 {
        return Err("the rate must be at least 1 msg/s (or `max`)".into());
    }
    Ok(Rate::PerSecond(n))
}

/// Parses a count with an optional `k` (10^3) or `M` (10^6) suffix.
pub fn parse_count(s: &str) -> Result<u64, String> {
    let (num, mult) = match s.as_bytes().last() {
        Some(b'k' | b'K') => (&s[..s.len() - 1], 1e3),
        Some(b'm' | b'M') => (&s[..s.len() - 1], 1e6),
        _ => (s, 1.0),
    };
    let v: f64 = num
        .trim()
        .parse()
        .map_err(|_| format!("`{s}` is not a number"))?;
    if !v.is_finite() || v < 0.0 {
        return Err(format!("`{s}` is not a non-negative number"));
    }
    Ok((v * mult).round() as u64)
}

/// Parses a duration such as `10s`, `500ms`, `2m` or a bare number of seconds.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    let (num, unit) = match t.find(|c: char| c.is_ascii_alphabetic()) {
        Some(i) => (&t[..i], &t[i..]),
        None => (t, "s"),
    };
    let v: f64 = num
        .parse()
        .map_err(|_| format!("`{s}` is not a duration (e.g. 10s, 500ms)"))?;
    let secs = match unit {
        "ms" => v / 1e3,
        "s" => v,
        "m" => v * 60.0,
        "h" => v * 3600.0,
        _ => return Err(format!("`{s}`: unknown unit `{unit}` (ms, s, m, h)")),
    };
    if !secs.is_finite() || secs < 0.0 {
        return Err(format!("`{s}` is not a non-negative duration"));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// MQTT protocol version of every client.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
pub enum Protocol {
    /// MQTT 3.1.1.
    #[value(name = "3.1.1")]
    #[serde(rename = "3.1.1")]
    V311,
    /// MQTT 5.0.
    #[value(name = "5")]
    #[serde(rename = "5")]
    V5,
}

impl Protocol {
    /// The codec's version.
    pub fn version(self) -> ProtocolVersion {
        match self {
            Protocol::V311 => ProtocolVersion::V3_1_1,
            Protocol::V5 => ProtocolVersion::V5,
        }
    }
}

/// Parses a QoS: 0, 1 or 2.
pub fn parse_qos(s: &str) -> Result<u8, String> {
    match s {
        "0" | "1" | "2" => Ok(s.as_bytes()[0] - b'0'),
        _ => Err(format!("`{s}`: QoS must be 0, 1 or 2")),
    }
}

/// Parses a payload size (16 B to 256 MiB).
pub fn parse_payload_size(s: &str) -> Result<usize, String> {
    let n = parse_count(s)? as usize;
    if n < PAYLOAD_HEADER_BYTES {
        return Err(format!(
            "payload size {n} is below {PAYLOAD_HEADER_BYTES} bytes (timestamp and sequence)"
        ));
    }
    if n > 256 * 1024 * 1024 {
        return Err(format!("payload size {n} is above 256 MiB"));
    }
    Ok(n)
}

/// A CPU list given with `--cpu`, e.g. `1` or `0,2-3`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CpuList(pub Vec<usize>);

fn parse_cpus(s: &str) -> Result<CpuList, String> {
    let mut cpus = Vec::new();
    for part in s.split(',').filter(|p| !p.is_empty()) {
        let bad = || format!("`{s}`: expected a CPU list such as 1 or 0,2-3");
        if let Some((a, b)) = part.split_once('-') {
            let (a, b): (usize, usize) =
                (a.parse().map_err(|_| bad())?, b.parse().map_err(|_| bad())?);
            if a > b {
                return Err(bad());
            }
            cpus.extend(a..=b);
        } else {
            cpus.push(part.parse().map_err(|_| bad())?);
        }
    }
    Ok(CpuList(cpus))
}

/// Options of `fleetmq-loadgen run`.
#[derive(Debug, Clone, Args, Serialize)]
pub struct RunArgs {
    /// The scenario.
    #[arg(value_enum)]
    pub scenario: Scenario,
    /// Broker URL, SCHEME://HOST:PORT/PATH: scheme mqtt, mqtts, ws or wss;
    /// the port is optional (1883, 8883, 80, 443), the path only for ws and
    /// wss (default --ws-path). Repeatable or comma-separated: clients are
    /// spread over the URLs round-robin (see --pub-url, --sub-url).
    #[arg(long = "url", value_parser = parse_url, value_delimiter = ',', default_value = "mqtt://127.0.0.1:1883")]
    pub urls: Vec<BrokerUrl>,
    /// Flows: the publishers' broker URLs (as --url; repeatable or
    /// comma-separated), publisher i on the (i mod count)-th. Default:
    /// --url. With --sub-url, publishers and subscribers on different
    /// brokers (cross-replica runs).
    #[arg(long = "pub-url", value_parser = parse_url, value_delimiter = ',')]
    pub pub_urls: Vec<BrokerUrl>,
    /// Flows: the subscribers' broker URLs (as --url; repeatable or
    /// comma-separated), subscriber j on the (j mod count)-th. Default:
    /// --url.
    #[arg(long = "sub-url", value_parser = parse_url, value_delimiter = ',')]
    pub sub_urls: Vec<BrokerUrl>,
    /// TLS and WebSocket options.
    #[command(flatten)]
    pub transport: TransportArgs,
    /// MQTT protocol version.
    #[arg(long, value_enum, default_value = "3.1.1")]
    pub protocol: Protocol,
    /// QoS of publishes and subscriptions (0, 1 or 2).
    #[arg(long, value_parser = parse_qos, default_value = "0")]
    pub qos: u8,
    /// Publish with the RETAIN flag set (each publisher's topic keeps its
    /// last value).
    #[arg(long)]
    pub retain: bool,
    /// Payload size in bytes, at least 16 (send timestamp and sequence).
    #[arg(long, value_parser = parse_payload_size, default_value = "64")]
    pub payload_size: usize,
    /// Offered rate in msg/s in total (open loop, fixed schedule), or `max`
    /// (closed loop bounded by --window).
    #[arg(long, value_parser = parse_rate, default_value = "max")]
    #[serde(serialize_with = "serialize_rate")]
    pub rate: Rate,
    /// Closed loop: at most this many messages per subscriber published but
    /// not yet received.
    #[arg(long, default_value_t = 1000)]
    pub window: u64,
    /// Measured time (after the warm-up), e.g. 10s.
    #[arg(long, value_parser = parse_duration, default_value = "10s")]
    #[serde(serialize_with = "serialize_duration")]
    pub duration: Duration,
    /// Warm-up before measuring, e.g. 1s; nothing sent then is counted.
    #[arg(long, value_parser = parse_duration, default_value = "1s")]
    #[serde(serialize_with = "serialize_duration")]
    pub warmup: Duration,
    /// Publishers (fan-in default 10, fan-out default 1).
    #[arg(long)]
    pub publishers: Option<usize>,
    /// Subscribers (fan-in default 1, fan-out default 100).
    #[arg(long)]
    pub subscribers: Option<usize>,
    /// Topic prefix; default `loadgen/PID`.
    #[arg(long)]
    pub topic_prefix: Option<String>,
    /// Client identifiers are `{prefix}-{role}{i}` (e.g. `lg4711-s0` for
    /// subscriber 0); default `lg{PID}`. 1–64 characters, no control
    /// characters. Lets a benchmark choose where a broker that places
    /// clients by identifier serves them (`fleetmq home-shard`).
    #[arg(long)]
    pub client_id_prefix: Option<String>,
    /// connect-storm and idle: connections to open.
    #[arg(long, value_parser = parse_count, default_value = "1000")]
    pub connections: u64,
    /// connect-storm and idle: new connections per second.
    #[arg(long, value_parser = parse_count, default_value = "2000")]
    pub connect_rate: u64,
    /// connect-storm and idle: when above 0, clients connect as fast as
    /// the broker lets them, at most this many at once (TCP connect to
    /// CONNACK; the next starts as one ends): a closed loop, which no
    /// listen backlog of at least this size overflows. `--connect-rate`
    /// is then not used, and CONNACK latency runs from each connection's
    /// own start. 0: the open-loop schedule of `--connect-rate`.
    #[arg(long, value_parser = parse_count, default_value = "0")]
    pub connect_window: u64,
    /// Keep Alive in seconds announced by every client. Idle and
    /// connect-storm clients send PINGREQ every half of it; fan-in/fan-out
    /// clients send none, so a run longer than 1.5 × this value at QoS 0
    /// needs a larger one (or 0).
    #[arg(long, default_value_t = 600)]
    pub keep_alive: u16,
    /// idle: the broker's PID, to report its RSS per connection from
    /// /proc/PID/status.
    #[arg(long)]
    pub broker_pid: Option<u32>,
    /// User name sent in CONNECT.
    #[arg(long)]
    pub username: Option<String>,
    /// Password sent in CONNECT.
    #[arg(long)]
    #[serde(skip)]
    pub password: Option<String>,
    /// Executors (threads), one glommio executor each.
    #[arg(long, default_value_t = 1)]
    pub threads: usize,
    /// Pin executors to these CPUs (e.g. `1` or `2-3`), round-robin;
    /// unpinned when absent.
    #[arg(long, value_parser = parse_cpus)]
    pub cpu: Option<CpuList>,
    /// How long to wait for a TCP connect, the TLS handshake and WebSocket
    /// upgrade, CONNACK or SUBACK (each).
    #[arg(long, value_parser = parse_duration, default_value = "5s")]
    #[serde(serialize_with = "serialize_duration")]
    pub connect_timeout: Duration,
    /// Write the result as JSON to this file.
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
    /// persistent: time connected between disconnects.
    #[arg(long, value_parser = parse_duration, default_value = "2s")]
    #[serde(serialize_with = "serialize_duration")]
    pub reconnect_every: Duration,
    /// persistent: time offline before reconnecting.
    #[arg(long, value_parser = parse_duration, default_value = "1s")]
    #[serde(serialize_with = "serialize_duration")]
    pub offline_for: Duration,
    /// persistent, MQTT 5: Session Expiry Interval in seconds (> 0).
    /// connect-storm and idle with `--keep-session` on MQTT 5: the same.
    #[arg(long, default_value_t = 300)]
    pub session_expiry: u32,
    /// connect-storm and idle: CONNECT with Clean Start 0 (MQTT 3.1.1:
    /// Clean Session 0), a session the broker keeps after the connection
    /// (MQTT 5: for `--session-expiry` seconds). Without it every CONNECT
    /// asks for a clean session.
    #[arg(long)]
    pub keep_session: bool,
    /// shared: the group name in `$share/{group}/...`.
    #[arg(long, default_value = "loadgen")]
    pub share_group: String,
}

/// Options of `fleetmq-loadgen soak`.
#[derive(Debug, Clone, Args, Serialize)]
pub struct SoakArgs {
    /// Broker URL, SCHEME://HOST:PORT/PATH as for `run`. Repeatable or
    /// comma-separated (clients round-robin).
    #[arg(long = "url", value_parser = parse_url, value_delimiter = ',', default_value = "mqtt://127.0.0.1:1883")]
    pub urls: Vec<BrokerUrl>,
    /// The publishers' broker URLs, as for `run`; default --url.
    #[arg(long = "pub-url", value_parser = parse_url, value_delimiter = ',')]
    pub pub_urls: Vec<BrokerUrl>,
    /// The subscribers' broker URLs, as for `run`; default --url.
    #[arg(long = "sub-url", value_parser = parse_url, value_delimiter = ',')]
    pub sub_urls: Vec<BrokerUrl>,
    /// TLS and WebSocket options.
    #[command(flatten)]
    pub transport: TransportArgs,
    /// MQTT protocol version.
    #[arg(long, value_enum, default_value = "3.1.1")]
    pub protocol: Protocol,
    /// QoS of publishes and subscriptions (0, 1 or 2).
    #[arg(long, value_parser = parse_qos, default_value = "1")]
    pub qos: u8,
    /// Payload size in bytes, at least 16.
    #[arg(long, value_parser = parse_payload_size, default_value = "64")]
    pub payload_size: usize,
    /// Offered rate in msg/s in total, or `max` (closed loop, --window).
    #[arg(long, value_parser = parse_rate, default_value = "1000")]
    #[serde(serialize_with = "serialize_rate")]
    pub rate: Rate,
    /// Closed loop: at most this many messages per subscriber published
    /// but not yet received.
    #[arg(long, default_value_t = 1000)]
    pub window: u64,
    /// How long to publish, e.g. 8h.
    #[arg(long, value_parser = parse_duration, default_value = "1h")]
    #[serde(serialize_with = "serialize_duration")]
    pub duration: Duration,
    /// One report line per interval.
    #[arg(long, value_parser = parse_duration, default_value = "10s")]
    #[serde(serialize_with = "serialize_duration")]
    pub report_every: Duration,
    /// Publishers, on `{prefix}/{i}`.
    #[arg(long, default_value_t = 10)]
    pub publishers: usize,
    /// Subscribers, each on `{prefix}/+`.
    #[arg(long, default_value_t = 1)]
    pub subscribers: usize,
    /// Topic prefix; default `loadgen/PID`.
    #[arg(long)]
    pub topic_prefix: Option<String>,
    /// Client identifiers are `{prefix}-{role}{i}` (e.g. `lg4711-s0` for
    /// subscriber 0); default `lg{PID}`. 1–64 characters, no control
    /// characters. Lets a benchmark choose where a broker that places
    /// clients by identifier serves them (`fleetmq home-shard`).
    #[arg(long)]
    pub client_id_prefix: Option<String>,
    /// User name sent in CONNECT.
    #[arg(long)]
    pub username: Option<String>,
    /// Password sent in CONNECT.
    #[arg(long)]
    #[serde(skip)]
    pub password: Option<String>,
    /// How long to wait for a TCP connect, the TLS handshake and WebSocket
    /// upgrade, CONNACK or SUBACK (each).
    #[arg(long, value_parser = parse_duration, default_value = "5s")]
    #[serde(serialize_with = "serialize_duration")]
    pub connect_timeout: Duration,
    /// Keep going through broker restarts (a SIGKILL and a new start on
    /// the same address): every client keeps a session (MQTT 5: Clean
    /// Start 1 on the first CONNECT, then 0, Session Expiry
    /// --session-expiry; 3.1.1: Clean Session 0), reconnects with backoff
    /// (50 ms doubling to 1 s; it gives up after 60 s without a
    /// connection) when its connection drops, and publishers send again
    /// what is unacknowledged: PUBLISH with DUP and its packet identifier,
    /// or PUBREL, in the order first sent. Lost connections count as
    /// `reconnects`, not errors.
    #[arg(long)]
    pub through_restarts: bool,
    /// With --through-restarts, MQTT 5: the Session Expiry Interval in
    /// seconds (at least 1).
    #[arg(long, default_value_t = 300, value_parser = clap::value_parser!(u32).range(1..))]
    pub session_expiry: u32,
    /// Write the result as JSON to this file.
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
}

impl SoakArgs {
    /// What every CONNECT of this run carries, announcing `keep_alive`
    /// seconds, over `transport`.
    pub fn connect_options(
        &self,
        keep_alive: u16,
        transport: &TransportOptions,
    ) -> crate::client::ConnectOptions {
        crate::client::ConnectOptions {
            version: self.protocol.version(),
            keep_alive,
            username: self.username.clone(),
            password: self.password.clone(),
            timeout: self.connect_timeout,
            transport: transport.clone(),
            max_packet_size: crate::client::max_packet_for(self.payload_size),
        }
    }

    /// The checked-flow configuration, after checking the options and
    /// loading the TLS files.
    ///
    /// # Errors
    /// A message naming the bad option or the unusable file.
    pub fn config(&self) -> Result<crate::verify::VerifyConfig, String> {
        if self.publishers == 0 || self.subscribers == 0 {
            return Err("--publishers and --subscribers must be at least 1".into());
        }
        if self.duration.is_zero() || self.report_every.is_zero() {
            return Err("--duration and --report-every must be above 0".into());
        }
        if self.window == 0 {
            return Err("--window must be at least 1".into());
        }
        check_prefix(&self.topic_prefix)?;
        check_client_id_prefix(&self.client_id_prefix)?;
        let urls = Urls::new(&self.urls, &self.pub_urls, &self.sub_urls);
        let transport = self.transport.load(&urls.all())?;
        Ok(crate::verify::VerifyConfig {
            mode: crate::verify::Mode::Soak,
            scenario: "soak".into(),
            options: serde_json::to_value(self).unwrap_or(serde_json::Value::Null),
            urls,
            connect: self.connect_options(0, &transport),
            qos: self.qos,
            payload_size: self.payload_size,
            rate: self.rate,
            window: self.window,
            duration: self.duration,
            publishers: self.publishers,
            subscribers: self.subscribers,
            prefix: self
                .topic_prefix
                .clone()
                .unwrap_or_else(|| format!("loadgen/{}", std::process::id())),
            client_id_prefix: client_id_prefix(&self.client_id_prefix),
            share_group: String::new(),
            reconnect_every: Duration::ZERO,
            offline_for: Duration::ZERO,
            session_expiry: self.session_expiry,
            report_every: Some(self.report_every),
            through_restarts: self.through_restarts,
        })
    }
}

/// Where each client of a flow connects: publisher i to
/// `publishers[i % len]`, subscriber j to `subscribers[j % len]` (from
/// `--pub-url` and `--sub-url`, each `--url` when not given).
#[derive(Debug, Clone)]
pub struct Urls {
    /// The publishers' URLs; never empty.
    pub publishers: Vec<BrokerUrl>,
    /// The subscribers' URLs; never empty.
    pub subscribers: Vec<BrokerUrl>,
}

impl Urls {
    /// `pub_urls` and `sub_urls`, each `urls` when empty. `urls` is never
    /// empty (it has a default), so neither list is.
    pub fn new(urls: &[BrokerUrl], pub_urls: &[BrokerUrl], sub_urls: &[BrokerUrl]) -> Urls {
        let or_default = |l: &[BrokerUrl]| if l.is_empty() { urls.to_vec() } else { l.to_vec() };
        Urls {
            publishers: or_default(pub_urls),
            subscribers: or_default(sub_urls),
        }
    }

    /// Publisher `i`'s broker.
    pub fn publisher(&self, i: usize) -> &BrokerUrl {
        &self.publishers[i % self.publishers.len()]
    }

    /// Subscriber `j`'s broker.
    pub fn subscriber(&self, j: usize) -> &BrokerUrl {
        &self.subscribers[j % self.subscribers.len()]
    }

    /// Every URL a client uses (for the TLS set-up), publishers' first.
    pub fn all(&self) -> Vec<BrokerUrl> {
        self.publishers
            .iter()
            .chain(&self.subscribers)
            .cloned()
            .collect()
    }
}

/// `--client-id-prefix`, or `lg{PID}` when absent.
fn client_id_prefix(prefix: &Option<String>) -> String {
    prefix.clone().unwrap_or_else(|| format!("lg{}", std::process::id()))
}

/// 1–64 characters without control characters: with the suffix a client
/// identifier a broker takes, and one a log shows as it is
/// (`[MQTT-1.5.4-2]`: no control characters in UTF-8 strings).
fn check_client_id_prefix(prefix: &Option<String>) -> Result<(), String> {
    let Some(p) = prefix else { return Ok(()) };
    let chars = p.chars().count();
    let why = if p.is_empty() {
        "is empty".to_owned()
    } else if chars > 64 {
        format!("has {chars} characters")
    } else if let Some(c) = p.chars().find(|c| c.is_control()) {
        format!("holds the control character {c:?}")
    } else {
        return Ok(());
    };
    Err(format!(
        "--client-id-prefix {p:?} {why}: it must be 1 to 64 characters without control characters"
    ))
}

fn check_prefix(prefix: &Option<String>) -> Result<(), String> {
    if let Some(prefix) = prefix {
        if prefix.contains(['+', '#']) || prefix.is_empty() || prefix.starts_with('$') {
            return Err(
                "--topic-prefix must be a non-empty topic name without wildcards or a leading $"
                    .into(),
            );
        }
    }
    Ok(())
}

fn serialize_rate<S: serde::Serializer>(r: &Rate, s: S) -> Result<S::Ok, S::Error> {
    r.serialize(s)
}

fn serialize_duration<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64())
}

impl RunArgs {
    /// What every CONNECT of this run carries, announcing `keep_alive`
    /// seconds, over `transport` (from [`TransportArgs::load`]).
    pub fn connect_options(
        &self,
        keep_alive: u16,
        transport: &TransportOptions,
    ) -> crate::client::ConnectOptions {
        crate::client::ConnectOptions {
            version: self.protocol.version(),
            keep_alive,
            username: self.username.clone(),
            password: self.password.clone(),
            timeout: self.connect_timeout,
            transport: transport.clone(),
            max_packet_size: crate::client::max_packet_for(self.payload_size),
        }
    }

    /// The QoS as the codec's type.
    pub fn qos(&self) -> QoS {
        QoS::from_u8(self.qos).unwrap_or(QoS::AtMostOnce)
    }

    /// Publishers for this scenario.
    pub fn publisher_count(&self) -> usize {
        self.publishers.unwrap_or(match self.scenario {
            Scenario::FanOut => 1,
            _ => 10,
        })
    }

    /// Subscribers for this scenario.
    pub fn subscriber_count(&self) -> usize {
        self.subscribers.unwrap_or(match self.scenario {
            Scenario::FanOut => 100,
            Scenario::Shared => 4,
            _ => 1,
        })
    }

    /// The topic prefix.
    pub fn prefix(&self) -> String {
        self.topic_prefix
            .clone()
            .unwrap_or_else(|| format!("loadgen/{}", std::process::id()))
    }

    /// Checks combinations clap cannot see.
    ///
    /// # Errors
    /// A message naming the bad option.
    pub fn check(&self) -> Result<(), String> {
        if self.threads == 0 {
            return Err("--threads must be at least 1".into());
        }
        if self.window == 0 {
            return Err("--window must be at least 1".into());
        }
        if matches!(
            self.scenario,
            Scenario::FanIn | Scenario::FanOut | Scenario::Shared | Scenario::Persistent
        ) {
            if self.publisher_count() == 0 || self.subscriber_count() == 0 {
                return Err("--publishers and --subscribers must be at least 1".into());
            }
            if self.duration.is_zero() {
                return Err("--duration must be above 0".into());
            }
        }
        if matches!(self.scenario, Scenario::ConnectStorm | Scenario::Idle)
            && (self.connections == 0 || self.connect_rate == 0)
        {
            return Err("--connections and --connect-rate must be at least 1".into());
        }
        if self.scenario == Scenario::Persistent {
            if self.reconnect_every.is_zero() {
                return Err("--reconnect-every must be above 0".into());
            }
            if self.session_expiry == 0 {
                return Err(
                    "--session-expiry must be above 0 (the session must outlive the connection)"
                        .into(),
                );
            }
        }
        if self.scenario == Scenario::Shared
            && (self.share_group.is_empty() || self.share_group.contains(['/', '+', '#']))
        {
            return Err("--share-group must be non-empty, without `/`, `+` or `#`".into());
        }
        if matches!(self.scenario, Scenario::ConnectStorm | Scenario::Idle)
            && !(self.pub_urls.is_empty() && self.sub_urls.is_empty())
        {
            return Err(
                "--pub-url and --sub-url are for the flows (fan-in, fan-out, shared, persistent); \
                 connect-storm and idle spread their connections over --url"
                    .into(),
            );
        }
        check_prefix(&self.topic_prefix)?;
        check_client_id_prefix(&self.client_id_prefix)
    }

    /// Where each publisher and subscriber connects (`--pub-url`,
    /// `--sub-url`, `--url`).
    pub fn client_urls(&self) -> Urls {
        Urls::new(&self.urls, &self.pub_urls, &self.sub_urls)
    }

    /// The client identifiers' prefix (`--client-id-prefix`, default
    /// `lg{PID}`).
    pub fn client_id_prefix(&self) -> String {
        client_id_prefix(&self.client_id_prefix)
    }

    /// The checked-flow configuration of `persistent` and `shared`, over
    /// `transport`.
    pub fn verify_config(&self, transport: &TransportOptions) -> crate::verify::VerifyConfig {
        crate::verify::VerifyConfig {
            mode: if self.scenario == Scenario::Shared {
                crate::verify::Mode::Shared
            } else {
                crate::verify::Mode::Persistent
            },
            scenario: serde_json::to_value(self.scenario)
                .ok()
                .and_then(|v| v.as_str().map(str::to_string))
                .unwrap_or_default(),
            options: serde_json::to_value(self).unwrap_or(serde_json::Value::Null),
            urls: self.client_urls(),
            connect: self.connect_options(0, transport),
            qos: self.qos,
            payload_size: self.payload_size,
            rate: self.rate,
            window: self.window,
            duration: self.duration,
            publishers: self.publisher_count(),
            subscribers: self.subscriber_count(),
            prefix: self.prefix(),
            client_id_prefix: self.client_id_prefix(),
            share_group: self.share_group.clone(),
            reconnect_every: self.reconnect_every,
            offline_for: self.offline_for,
            session_expiry: self.session_expiry,
            report_every: None,
            through_restarts: false,
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    #[test]
    fn rates_accept_max_and_suffixes() {
        assert_eq!(parse_rate("max"), Ok(Rate::Max));
        assert_eq!(parse_rate("20k"), Ok(Rate::PerSecond(20_000)));
        assert_eq!(parse_rate("1.5M"), Ok(Rate::PerSecond(1_500_000)));
        assert!(parse_rate("0").is_err());
        assert!(parse_rate("fast").is_err());
    }

    #[test]
    fn durations_take_units() {
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("2"), Ok(Duration::from_secs(2)));
        assert_eq!(parse_duration("1m"), Ok(Duration::from_secs(60)));
        assert!(parse_duration("1 fortnight").is_err());
    }

    #[test]
    fn payloads_must_hold_the_timestamp_and_sequence() {
        assert!(parse_payload_size("15").is_err());
        assert_eq!(parse_payload_size("16"), Ok(16));
    }

    /// `run`'s options alone, for tests that parse them.
    #[derive(clap::Parser)]
    pub(crate) struct Cli {
        #[command(flatten)]
        pub(crate) run: RunArgs,
    }

    #[test]
    fn every_option_parses_through_clap() {
        use clap::Parser;
        let cli = Cli::try_parse_from([
            "x",
            "fan-out",
            "--cpu",
            "1",
            "--rate",
            "20k",
            "--qos",
            "2",
            "--protocol",
            "5",
            "--url",
            "mqtt://127.0.0.1:1",
            "--url",
            "mqtt://127.0.0.1:2",
            "--duration",
            "3s",
            "--connections",
            "10k",
        ])
        .unwrap();
        assert_eq!(cli.run.cpu, Some(CpuList(vec![1])));
        assert_eq!(cli.run.urls.len(), 2);
        assert_eq!(cli.run.rate, Rate::PerSecond(20_000));
        assert_eq!(cli.run.connections, 10_000);
        assert!(serde_json::to_value(&cli.run).is_ok());
    }

    #[test]
    fn pub_and_sub_urls_default_to_url_and_spread_round_robin() {
        use clap::Parser;
        let run = |extra: &[&str]| {
            let mut argv = vec!["x", "fan-out"];
            argv.extend_from_slice(extra);
            Cli::try_parse_from(argv).map(|c| c.run)
        };
        let texts = |l: &[BrokerUrl]| l.iter().map(|u| u.text.clone()).collect::<Vec<_>>();
        // Neither given: both are --url (its default too).
        let plain = run(&[]).unwrap().client_urls();
        assert_eq!(texts(&plain.publishers), ["mqtt://127.0.0.1:1883"]);
        assert_eq!(texts(&plain.subscribers), ["mqtt://127.0.0.1:1883"]);
        let both = run(&["--url", "mqtt://127.0.0.1:1,mqtt://127.0.0.1:2"]).unwrap();
        let urls = both.client_urls();
        assert_eq!(texts(&urls.publishers), ["mqtt://127.0.0.1:1", "mqtt://127.0.0.1:2"]);
        assert_eq!(texts(&urls.subscribers), texts(&urls.publishers));
        // One given: the other stays --url.
        let a = "mqtt://127.0.0.1:1";
        let b = "mqtt://127.0.0.1:2";
        let c = "mqtt://127.0.0.1:3";
        let subs = run(&["--url", a, "--sub-url", b]).unwrap().client_urls();
        assert_eq!((texts(&subs.publishers), texts(&subs.subscribers)), (vec![a.to_string()], vec![b.to_string()]));
        let pubs = run(&["--url", a, "--pub-url", b]).unwrap().client_urls();
        assert_eq!((texts(&pubs.publishers), texts(&pubs.subscribers)), (vec![b.to_string()], vec![a.to_string()]));
        // Comma-separated and repeated mix; client k takes the (k mod n)-th.
        let spread = run(&["--pub-url", a, "--sub-url", &format!("{a},{b}"), "--sub-url", c])
            .unwrap()
            .client_urls();
        let subscribers: Vec<&str> = (0..6).map(|j| spread.subscriber(j).text.as_str()).collect();
        assert_eq!(subscribers, [a, b, c, a, b, c]);
        assert_eq!(spread.publisher(0).text, a);
        assert_eq!(spread.publisher(7).text, a);
        assert_eq!(spread.all().len(), 4, "publishers' then subscribers' URLs, for the TLS set-up");
        // A bad URL in a list is refused by clap (exit 2), naming it.
        let err = run(&["--sub-url", &format!("{a},http://x")]).err().unwrap().to_string();
        assert!(err.contains("http://x") && err.contains("--sub-url"), "{err}");
        assert!(run(&["--pub-url", ""]).is_err(), "an empty URL");
        // connect-storm and idle have no publishers or subscribers.
        for scenario in ["connect-storm", "idle"] {
            let args = Cli::try_parse_from(["x", scenario, "--sub-url", b]).unwrap().run;
            let err = args.check().unwrap_err();
            assert!(err.contains("--pub-url and --sub-url are for the flows"), "{err}");
        }
        assert_eq!(run(&["--pub-url", a, "--sub-url", b]).unwrap().check(), Ok(()));
        // The JSON of the options names them (compare reads the transports).
        let json = serde_json::to_value(run(&["--pub-url", a, "--sub-url", b]).unwrap()).unwrap();
        assert_eq!(json["pub_urls"], serde_json::json!([a]));
        assert_eq!(json["sub_urls"], serde_json::json!([b]));
    }

    #[test]
    fn soak_takes_pub_and_sub_urls_too() {
        use clap::Parser;
        #[derive(clap::Parser)]
        struct SoakCli {
            #[command(flatten)]
            soak: SoakArgs,
        }
        let soak = SoakCli::try_parse_from([
            "x",
            "--pub-url",
            "mqtt://127.0.0.1:1",
            "--sub-url",
            "mqtt://127.0.0.1:2,mqtt://127.0.0.1:3",
        ])
        .unwrap()
        .soak;
        let cfg = soak.config().unwrap();
        assert_eq!(cfg.urls.publisher(0).text, "mqtt://127.0.0.1:1");
        assert_eq!(cfg.urls.subscriber(1).text, "mqtt://127.0.0.1:3");
    }

    #[test]
    fn cpu_lists_take_ranges() {
        assert_eq!(parse_cpus("1"), Ok(CpuList(vec![1])));
        assert_eq!(parse_cpus("0,2-3"), Ok(CpuList(vec![0, 2, 3])));
        assert!(parse_cpus("3-1").is_err());
    }

    #[test]
    fn client_id_prefixes_default_to_the_pid_and_refuse_control_characters() {
        use clap::Parser;
        let run = |extra: &[&str]| {
            let mut argv = vec!["x", "fan-in"];
            argv.extend_from_slice(extra);
            Cli::try_parse_from(argv).unwrap().run
        };
        let plain = run(&[]);
        assert_eq!(plain.client_id_prefix(), format!("lg{}", std::process::id()));
        assert_eq!(plain.check(), Ok(()));
        let chosen = run(&["--client-id-prefix", "bench-7"]);
        assert_eq!(chosen.client_id_prefix(), "bench-7");
        assert_eq!(chosen.check(), Ok(()));
        let long = "x".repeat(65);
        for (bad, why) in [
            ("", "is empty"),
            ("a\u{0}b", "control character '\\0'"),
            ("tab\there", "control character '\\t'"),
            (long.as_str(), "has 65 characters"),
        ] {
            let err = run(&["--client-id-prefix", bad]).check().unwrap_err();
            assert!(err.contains("--client-id-prefix"), "{bad:?}: {err}");
            assert!(err.contains(why), "{bad:?}: {err}");
        }
        assert_eq!(run(&["--client-id-prefix", &"x".repeat(64)]).check(), Ok(()));
    }
}
