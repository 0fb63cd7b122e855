//! Broker settings: the configuration file's shape, with defaults, units and
//! ranges (DESIGN.md §9, §15).
//!
//! This module only describes and checks settings; reading the file, the
//! environment and the command line is the server's job
//! (`fleetmq-shards::config`). Every struct is `#[serde(default,
//! deny_unknown_fields)]`: a missing key takes its default, an unknown key is
//! an error. Durations are strings with units (`"10s"`, `"15m"`; a plain
//! integer means seconds) and sizes are strings with units (`"1MiB"`,
//! `"64KiB"`; a plain integer means bytes).
//!
//! Deserializing checks types only; [`Settings::validate`] checks ranges and
//! combinations and must pass before the broker starts.

use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

mod toml_text;
pub(crate) use toml_text::Given;
pub use toml_text::toml_key;

/// All broker settings, one field per section of the configuration file.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Settings {
    /// `[server]`: shards and periodic work.
    pub server: Server,
    /// `[listeners]`: where MQTT clients connect.
    pub listeners: Listeners,
    /// `[tls]`: certificates for the `tls` and `wss` listeners.
    pub tls: Tls,
    /// `[admin]`: the admin HTTP endpoint (health, metrics).
    pub admin: Admin,
    /// `[auth]`: who may connect.
    pub auth: Auth,
    /// `[limits]`: per-replica limits (DESIGN.md §9).
    pub limits: Limits,
    /// `[store]`: where accepted values become durable (DESIGN.md §7).
    pub store: Store,
    /// `[shared]`: shared subscription strategies (DESIGN.md §13).
    pub shared: Shared,
    /// `[cluster]`: absent = a single node (DESIGN.md §10, §15).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cluster: Option<crate::cluster::settings::Cluster>,
}

/// `[server]` settings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Server {
    /// Number of shards (glommio executors, one per core). Default 0: one
    /// per available core. Range 0..=64.
    pub shards: usize,
    /// Period of the `$SYS` topic publications. Default 10 s, range
    /// 1 s..=1 h.
    #[serde(with = "duration")]
    pub sys_interval: Duration,
    /// Move a publisher whose messages all go to the subscribers of one
    /// other shard, at most 1,000 a second, to that shard, so they no
    /// longer cross between shards (see `fleetmq_shards` `placement`).
    /// Default true.
    pub move_publishers: bool,
}

impl Default for Server {
    fn default() -> Self {
        Server {
            shards: 0,
            sys_interval: Duration::from_secs(10),
            move_publishers: true,
        }
    }
}

/// `[listeners]`: `"IP:PORT"` socket addresses per transport (DESIGN.md
/// §11). Port 0 lets the operating system pick a free port.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Listeners {
    /// Plain MQTT over TCP. Default `["127.0.0.1:1883"]`.
    pub tcp: Vec<String>,
    /// MQTT over TLS (usually port 8883). Default none.
    pub tls: Vec<String>,
    /// MQTT over WebSocket, path `/mqtt` (usually port 8083). Default none.
    pub ws: Vec<String>,
    /// MQTT over WebSocket over TLS. Default none.
    pub wss: Vec<String>,
}

impl Default for Listeners {
    fn default() -> Self {
        Listeners {
            tcp: vec!["127.0.0.1:1883".to_owned()],
            tls: Vec::new(),
            ws: Vec::new(),
            wss: Vec::new(),
        }
    }
}

impl Listeners {
    /// Every listener as `(dotted key, address string)`, e.g.
    /// `("listeners.tcp[0]", "127.0.0.1:1883")`.
    pub fn all(&self) -> impl Iterator<Item = (String, &str)> {
        [
            ("tcp", &self.tcp),
            ("tls", &self.tls),
            ("ws", &self.ws),
            ("wss", &self.wss),
        ]
        .into_iter()
        .flat_map(|(kind, list)| {
            list.iter()
                .enumerate()
                .map(move |(i, addr)| (format!("listeners.{kind}[{i}]"), addr.as_str()))
        })
    }
}

/// `[tls]`: certificates for the `tls` and `wss` listeners (DESIGN.md §11,
/// §15). Parsed and printed, not used yet.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Tls {
    /// PEM certificate chain; re-read when it changes. Default empty.
    pub cert: PathBuf,
    /// PEM private key. Default empty.
    pub key: PathBuf,
    /// PEM CA used to verify client certificates; empty (default) = none.
    pub client_ca: PathBuf,
    /// Refuse clients without a valid certificate. Default false.
    pub require_client_cert: bool,
    /// Use the client certificate's subject as the user name. Default false.
    pub use_identity_as_username: bool,
}

/// `[admin]`: the admin HTTP endpoint (DESIGN.md §12).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Admin {
    /// `"IP:PORT"` of the admin HTTP server. Default `"127.0.0.1:8080"`;
    /// `""` disables it.
    pub listen: String,
}

impl Default for Admin {
    fn default() -> Self {
        Admin {
            listen: "127.0.0.1:8080".to_owned(),
        }
    }
}

/// `[auth]`: sign-in (DESIGN.md §9).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Auth {
    /// Accept clients without credentials. Unset (default): allowed only
    /// when every MQTT listener is on loopback, as Mosquitto 2 does; see
    /// [`Settings::anonymous_allowed`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub allow_anonymous: Option<bool>,
    /// Password file (`user:$argon2id$...[:workspace]` lines). Default empty:
    /// none.
    pub password_file: String,
    /// ACL file (DESIGN.md §15). Default empty: none.
    pub acl_file: String,
    /// How long a delivery may rely on an earlier ACL decision; a rule
    /// changed by reload stops delivery within this time. Default 60 s,
    /// range 1 s..=1 h.
    #[serde(with = "duration")]
    pub acl_cache_ttl: Duration,
    /// `[auth.jwt]`: JSON Web Tokens as passwords.
    pub jwt: Jwt,
}

impl Default for Auth {
    fn default() -> Self {
        Auth {
            allow_anonymous: None,
            password_file: String::new(),
            acl_file: String::new(),
            acl_cache_ttl: Duration::from_secs(60),
            jwt: Jwt::default(),
        }
    }
}

impl Auth {
    /// Whether any way to sign in with credentials is configured: a password
    /// file or a JWT key (TLS client certificates are judged from `[tls]`).
    pub fn has_credentials(&self) -> bool {
        !self.password_file.is_empty() || self.jwt.is_configured()
    }
}

/// `[auth.jwt]`: JSON Web Tokens given as the MQTT password (DESIGN.md §9,
/// §15). HS256 keys come from `secret_file`, RS256 and ES256 keys from
/// `jwks_file`; JWT sign-in is off while both are empty.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Jwt {
    /// JWKS file (`{"keys": [...]}`) with RS256/ES256 public keys. Default
    /// empty: none.
    pub jwks_file: String,
    /// File holding the HS256 shared secret (raw bytes; trailing newlines
    /// are ignored). Default empty: none.
    pub secret_file: String,
    /// Required `iss` claim. Default empty: not checked.
    pub issuer: String,
    /// Required `aud` claim. Default empty: not checked.
    pub audience: String,
    /// Claim that must equal the MQTT user name. Default `"sub"`.
    pub username_claim: String,
    /// Claim naming the user's workspace. Default empty: every JWT user is
    /// in workspace `default`.
    pub workspace_claim: String,
}

impl Default for Jwt {
    fn default() -> Self {
        Jwt {
            jwks_file: String::new(),
            secret_file: String::new(),
            issuer: String::new(),
            audience: String::new(),
            username_claim: "sub".to_owned(),
            workspace_claim: String::new(),
        }
    }
}

impl Jwt {
    /// Whether a JWT key source (JWKS or secret file) is set.
    pub fn is_configured(&self) -> bool {
        !self.jwks_file.is_empty() || !self.secret_file.is_empty()
    }
}

/// `[limits]`: per-replica limits (DESIGN.md §9). Out-of-range values stop
/// the start with an error naming the key and its range.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Limits {
    /// Connected clients per replica. Default 1,000,000, range
    /// 1..=10,000,000.
    pub max_clients: u32,
    /// Connections between accept and CONNACK, over all shards. At the
    /// limit the one that has made the least progress (no byte yet, the
    /// oldest first; then stalled handshakes and CONNECTs too slow to
    /// finish within `connect_timeout`) is closed to make room; a new
    /// connection is refused only when every other is progressing.
    /// Default 2048, range 1..=1,000,000.
    pub max_pending_connections: u32,
    /// CONNECTs whose credentials are being checked or waiting to be, over
    /// all shards. Checks take turns by source address (then user name);
    /// at the limit the oldest waiting check of the longest line gives
    /// way. Default 256, range 1..=1,000,000.
    pub max_connects_authenticating: u32,
    /// Connections per credential (user name). Default 1000, range
    /// 1..=10,000,000.
    pub max_connections_per_credential: u32,
    /// Connections per source address. Default 200, range 1..=10,000,000.
    pub max_connections_per_source: u32,
    /// Failed credential checks (password file, JWT) for one user name,
    /// or from one source address when `trust_client_addresses` is on,
    /// within `auth_failure_window`, that start a backoff. While a user
    /// name or address backs off, only sign-ins matching a recent success
    /// (same user name and client identifier, and same address when
    /// addresses are trusted) are checked, each combination with a
    /// backoff of its own; the rest are refused unchecked with 0x87 (3.1.1:
    /// 5). Default 10, range 1..=1,000,000.
    pub auth_failure_threshold: u32,
    /// Window in which failed sign-ins are counted. Default 60 s, range
    /// 1 s..=24 h.
    #[serde(with = "duration")]
    pub auth_failure_window: Duration,
    /// First backoff once the threshold is reached; each further failure
    /// after a backoff doubles it. Default 30 s, range 1 s..=24 h.
    #[serde(with = "duration")]
    pub auth_failure_backoff: Duration,
    /// Longest backoff. Default 15 min, range `auth_failure_backoff`..=24 h.
    #[serde(with = "duration")]
    pub auth_failure_backoff_max: Duration,
    /// Credential checks per second per user name that may fail: each
    /// check takes a share beforehand and a check that succeeds gives it
    /// back, so signing in with the right credentials never waits for it,
    /// while a flood of wrong ones gets at most this many password hashes
    /// (or JWT verifications) per second per user name, in bursts of at
    /// most this many. Beyond it a sign-in is refused unchecked with 0x89
    /// Server busy (3.1.1: 3), so that a flood cannot fill
    /// `max_connects_authenticating`. Default 4, range 1..=1,000,000.
    pub auth_check_rate_per_credential: u32,
    /// Entries the failed sign-in throttle keeps (user names, addresses,
    /// the check budgets of user names, and the failures of recognised
    /// combinations, each table at most this many); beyond it the entries
    /// that changed least recently are dropped. An entry costs 80 bytes
    /// plus the hash table's slack (about 90–190 bytes in all), whatever
    /// the length of the user name. Default 100,000, range
    /// 100..=10,000,000.
    pub auth_throttle_max_entries: u32,
    /// Successful sign-ins remembered (user name, client identifier, and
    /// address when `trust_client_addresses` is on, as one 64-bit keyed
    /// hash and a time: 24 bytes, about 30–60 with the hash table's slack)
    /// so that those devices are still checked while their user name
    /// backs off; beyond it the least recent success is forgotten. 0 turns
    /// the recognition off. Default 1,000,000, range 0..=100,000,000.
    pub auth_known_devices: u32,
    /// Largest CONNECT packet, and so the largest will, in bytes. Default
    /// 64 KiB, range 1 KiB..=16 MiB. A larger CONNECT is refused as soon as
    /// its fixed header shows its size: CONNACK 0x95 Packet too large on
    /// MQTT 5, a close on MQTT 3.1.x (`fleetmq_connect_refused_total`,
    /// reason `max_connect_packet_bytes`).
    #[serde(with = "size")]
    pub max_connect_packet_bytes: usize,
    /// Time from accept to a complete CONNECT. Default 5 s, range
    /// 1 s..=5 min.
    #[serde(with = "duration")]
    pub connect_timeout: Duration,
    /// Longest keep-alive granted; longer requests are lowered (MQTT 5:
    /// Server Keep Alive). Default 15 min, range 1 s..=65535 s (18h 12m 15s).
    #[serde(with = "duration")]
    pub max_keep_alive: Duration,
    /// Subscriptions per client. Default 1000, range 1..=1,000,000.
    pub max_subscriptions_per_client: u32,
    /// Levels in a topic name or filter. Default 32, range 1..=1024.
    pub max_topic_levels: u32,
    /// Bytes in a topic name or filter. Default 1024, range 1..=65535.
    pub max_topic_bytes: u32,
    /// QoS 1/2 publishes a client may have unacknowledged towards the broker
    /// (MQTT 5 Receive Maximum, announced in CONNACK; an MQTT 5 client with
    /// more QoS 2 flows open gets DISCONNECT 0x93). MQTT 3.1/3.1.1 has no
    /// Receive Maximum and is not held to it. Default 1000, range 1..=65535.
    pub receive_maximum: u16,
    /// Packets queued for writing to one client before it counts as slow.
    /// Default 1000, range 1..=1,000,000.
    pub max_client_writes_pending: u32,
    /// Bytes queued for writing to one client beyond which QoS 0 messages
    /// to it are dropped (and counted), so a client that does not read
    /// holds at most about twice this much broker memory. Default 8 MiB,
    /// range 64 KiB..=1 GiB.
    #[serde(with = "size")]
    pub max_client_write_bytes: usize,
    /// Values queued for one subscriber; beyond it the oldest are dropped
    /// and counted. Default 10000, range 1..=10,000,000.
    pub max_subscriber_queue: u32,
    /// Longest session expiry granted. Default 1 h, range 0..=u32::MAX s
    /// (about 136 years).
    #[serde(with = "duration")]
    pub max_session_expiry: Duration,
    /// Sessions kept while their clients are away. Default 100000, range
    /// 0..=100,000,000.
    pub max_offline_sessions: u32,
    /// Largest packet accepted or sent, in bytes (MQTT 5 Maximum Packet
    /// Size). Default 1 MiB, range 64 B..=256 MiB.
    #[serde(with = "size")]
    pub max_packet_size: usize,
    /// Topic Alias Maximum announced to MQTT 5 clients: aliases a client may
    /// set towards the broker (MQTT 5 §3.3.2.3.4). Default 64, range
    /// 0..=65535; 0 disables inbound topic aliases.
    pub topic_alias_maximum: u16,
    /// Whether connection source addresses identify clients (no proxy or
    /// NAT in front): only then is `max_connections_per_source` enforced,
    /// do failed sign-ins back off their source address, and does the
    /// address take part in recognising a device. Default false.
    pub trust_client_addresses: bool,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_clients: 1_000_000,
            max_pending_connections: 2048,
            max_connects_authenticating: 256,
            max_connections_per_credential: 1000,
            max_connections_per_source: 200,
            auth_failure_threshold: 10,
            auth_failure_window: Duration::from_secs(60),
            auth_failure_backoff: Duration::from_secs(30),
            auth_failure_backoff_max: Duration::from_secs(15 * 60),
            auth_check_rate_per_credential: 4,
            auth_throttle_max_entries: 100_000,
            auth_known_devices: 1_000_000,
            max_connect_packet_bytes: 64 * KIB,
            connect_timeout: Duration::from_secs(5),
            max_keep_alive: Duration::from_secs(15 * 60),
            max_subscriptions_per_client: 1000,
            max_topic_levels: 32,
            max_topic_bytes: 1024,
            receive_maximum: 1000,
            max_client_writes_pending: 1000,
            max_client_write_bytes: 8 * MIB,
            max_subscriber_queue: 10_000,
            max_session_expiry: Duration::from_secs(3600),
            max_offline_sessions: 100_000,
            max_packet_size: MIB,
            topic_alias_maximum: 64,
            trust_client_addresses: false,
        }
    }
}

/// `[shared]`: how shared subscription groups (`$share/{group}/{filter}`)
/// choose the member for each message.
///
/// ```toml
/// [shared]
/// strategy = "round_robin"      # random | sticky | hash_client_id | local_first
/// [shared.groups]
/// billing = "hash_client_id"    # per group name, overrides `strategy`
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Shared {
    /// The broker-wide strategy. Default `round_robin`.
    pub strategy: crate::shared::Strategy,
    /// Strategy per group name, overriding `strategy`.
    pub groups: std::collections::BTreeMap<String, crate::shared::Strategy>,
}

impl Shared {
    /// The strategy of group `group`.
    pub fn strategy_for(&self, group: &str) -> crate::shared::Strategy {
        self.groups.get(group).copied().unwrap_or(self.strategy)
    }

    /// Each name of `[shared.groups]` must be a ShareName a client can
    /// subscribe with: at least one character, none of `/`, `+`, `#`
    /// [MQTT-4.8.2-1] [MQTT-4.8.2-2] (a name no group can have would set
    /// nothing, silently).
    ///
    /// # Errors
    /// [`SettingsError::Invalid`] naming `shared.groups` and the name.
    pub fn validate(&self) -> Result<(), SettingsError> {
        match self.groups.keys().find(|name| name.is_empty() || name.contains(['/', '+', '#'])) {
            Some(name) => Err(SettingsError::Invalid {
                key: "shared.groups",
                value: name.clone(),
                allowed: "a share name has at least one character and none of '/', '+', '#' [MQTT-4.8.2-1] [MQTT-4.8.2-2]".into(),
            }),
            None => Ok(()),
        }
    }
}

pub use crate::store::settings::{Fsync, IngestRetention, Store, StoreKind};

/// Whether `a` and `b`, on one port other than 0, take it on a shared
/// address: one is the wildcard of a family that covers the other
/// (`0.0.0.0` every IPv4 address; `::` every address, IPv4 too, as Linux
/// binds it dual-stack by default). Equal addresses are a
/// [`SettingsError::DuplicateAddress`].
fn overlaps(a: SocketAddr, b: SocketAddr) -> bool {
    let covers = |wild: IpAddr, other: IpAddr| match wild {
        IpAddr::V4(w) => w.is_unspecified() && other.is_ipv4(),
        IpAddr::V6(w) => w.is_unspecified(),
    };
    a.port() == b.port()
        && a.port() != 0
        && a.ip() != b.ip()
        && (covers(a.ip(), b.ip()) || covers(b.ip(), a.ip()))
}

/// Why [`Settings::validate`] refused the settings.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum SettingsError {
    /// A value lies outside its allowed range.
    OutOfRange {
        /// Dotted key, e.g. `limits.max_packet_size`.
        key: &'static str,
        /// The value, formatted with its unit.
        value: String,
        /// The allowed range, e.g. `64B..=256MiB`.
        range: String,
    },
    /// A duration counted in whole seconds on the wire (Keep Alive, MQTT
    /// 5 §3.1.2.10) was given with a fraction of a second.
    NotWholeSeconds {
        /// Dotted key, e.g. `limits.max_keep_alive`.
        key: &'static str,
        /// The value, formatted with its unit.
        value: String,
    },
    /// An address is not an `IP:PORT` socket address.
    BadAddress {
        /// Dotted key, e.g. `listeners.tcp[0]`.
        key: String,
        /// The value given.
        value: String,
    },
    /// Two listeners (or a listener and `admin.listen`) on one address
    /// with a port other than 0: the second could not be bound.
    DuplicateAddress {
        /// Dotted key of the first one, e.g. `listeners.tcp[0]`.
        first: String,
        /// Dotted key of the second one.
        key: String,
        /// The address both name.
        value: String,
    },
    /// Two listeners (or a listener and `admin.listen`) on one port other
    /// than 0 where one address is the wildcard (`0.0.0.0`, or `::`, which
    /// also takes IPv4) and the other an address it covers: the wildcard
    /// takes the port on every address, so the two would share one.
    OverlappingAddress {
        /// Dotted key of the first one, e.g. `listeners.tcp[0]`.
        first: String,
        /// Its address.
        first_value: String,
        /// Dotted key of the second one.
        key: String,
        /// Its address.
        value: String,
    },
    /// No MQTT listener is configured at all.
    NoListeners,
    /// A listener beyond loopback while anonymous clients are not allowed
    /// and no authentication method is configured.
    AnonymousBeyondLoopback {
        /// Dotted key of the first non-loopback listener.
        key: String,
        /// Its address.
        value: String,
    },
    /// A store kind these settings cannot use: `"jetstream"` without a
    /// `[cluster]` section.
    StoreUnavailable(StoreKind),
    /// A list that needs at least one entry is empty (`cluster.nats_urls
    /// = []`).
    EmptyList {
        /// Dotted key, e.g. `cluster.nats_urls`.
        key: &'static str,
        /// What the list needs, with an example.
        allowed: String,
    },
    /// A `[cluster]` setting that is not valid for another reason than its
    /// range (a replica ID with characters a NATS subject cannot carry).
    Invalid {
        /// Dotted key, e.g. `cluster.replica_id`.
        key: &'static str,
        /// The value given.
        value: String,
        /// Why not, and what is allowed.
        allowed: String,
    },
}

impl fmt::Display for SettingsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SettingsError::OutOfRange { key, value, range } => {
                write!(f, "{key} = {value} is out of range {range}")
            }
            SettingsError::NotWholeSeconds { key, value } => write!(
                f,
                "{key} = {value} must be whole seconds (MQTT counts Keep Alive in seconds)"
            ),
            SettingsError::BadAddress { key, value } => write!(
                f,
                "{key} = {value:?} is not a socket address IP:PORT (host names are not resolved; e.g. \"127.0.0.1:1883\", \"[::1]:1883\", \"0.0.0.0:1883\")"
            ),
            SettingsError::DuplicateAddress { first, key, value } => write!(
                f,
                "{key} = {value:?} is the address of {first} too: each listener needs an address of its own (port 0 excepted)"
            ),
            SettingsError::OverlappingAddress { first, first_value, key, value } => write!(
                f,
                "{key} = {value:?} overlaps {first} = {first_value:?}: a wildcard address takes its port on every address, so each listener needs a port of its own there"
            ),
            SettingsError::NoListeners => write!(
                f,
                "no MQTT listener: set listeners.tcp (or tls, ws, wss) to at least one IP:PORT"
            ),
            SettingsError::AnonymousBeyondLoopback { key, value } => write!(
                f,
                "{key} = {value:?} listens beyond loopback, and clients without credentials are \
                 only allowed on loopback unless `auth.allow_anonymous = true` is set \
                 (or sign-in is configured: auth.password_file, [auth.jwt], or required \
                 TLS client certificates with use_identity_as_username)"
            ),
            SettingsError::StoreUnavailable(kind) => {
                let name = match kind {
                    StoreKind::None => "none",
                    StoreKind::Local => "local",
                    StoreKind::Jetstream => "jetstream",
                };
                write!(
                    f,
                    "store.kind = \"{name}\" needs a [cluster] section (NATS JetStream is the cluster's store): add [cluster], or use store.kind = \"local\" (durable, the single-node default) or \"none\" (memory only)"
                )
            }
            // Shown as written: an empty list, not an empty string.
            SettingsError::EmptyList { key, allowed } => {
                write!(f, "{key} = [] is not valid: {allowed}")
            }
            SettingsError::Invalid { key, value, allowed } => {
                write!(f, "{key} = {value:?} is not valid: {allowed}")
            }
        }
    }
}

impl std::error::Error for SettingsError {}

const KIB: usize = 1024;
const MIB: usize = 1024 * KIB;
const GIB: usize = 1024 * MIB;

/// Checks that `value` lies in `min..=max`, naming `key` otherwise.
pub(crate) fn check<T: PartialOrd + Copy>(
    key: &'static str,
    value: T,
    min: T,
    max: T,
    show: impl Fn(T) -> String,
) -> Result<(), SettingsError> {
    if value >= min && value <= max {
        Ok(())
    } else {
        Err(SettingsError::OutOfRange {
            key,
            value: show(value),
            range: format!("{}..={}", show(min), show(max)),
        })
    }
}

fn num<T: fmt::Display>(v: T) -> String {
    v.to_string()
}

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

impl Settings {
    /// Checks every range and combination; the broker must not start with
    /// settings that fail this.
    ///
    /// # Errors
    ///
    /// The first problem found, naming the key in dotted form and, for a
    /// range, the range: e.g. `limits.max_packet_size = 10B is out of range
    /// 64B..=256MiB`. Also refused: an invalid `[cluster]` section,
    /// `store.kind = "jetstream"` without `[cluster]`, a listener that is not a socket address, no listener at
    /// all, and a non-loopback listener while anonymous clients are not
    /// allowed and no password file, JWT key or required client certificate
    /// is set.
    pub fn validate(&self) -> Result<(), SettingsError> {
        self.validate_ranges()?;
        self.shared.validate()?;
        if let Some(cluster) = &self.cluster {
            cluster.validate()?;
        }
        if self.store.kind == StoreKind::Jetstream && self.cluster.is_none() {
            return Err(SettingsError::StoreUnavailable(StoreKind::Jetstream));
        }
        if self.listeners.all().next().is_none() {
            return Err(SettingsError::NoListeners);
        }
        let mut bound: Vec<(SocketAddr, String)> = Vec::new();
        let admin = (!self.admin.listen.is_empty())
            .then(|| ("admin.listen".to_owned(), self.admin.listen.as_str()));
        for (key, value) in self.listeners.all().chain(admin) {
            let addr = parse_addr(&key, value)?;
            if let Some((_, first)) = bound.iter().find(|(a, _)| *a == addr && a.port() != 0) {
                return Err(SettingsError::DuplicateAddress {
                    first: first.clone(),
                    key,
                    value: value.to_owned(),
                });
            }
            if let Some((first_addr, first)) = bound.iter().find(|(a, _)| overlaps(*a, addr)) {
                return Err(SettingsError::OverlappingAddress {
                    first: first.clone(),
                    first_value: first_addr.to_string(),
                    key,
                    value: value.to_owned(),
                });
            }
            bound.push((addr, key));
        }
        let certificates = self.tls.use_identity_as_username
            && self.tls.require_client_cert
            && !self.tls.client_ca.as_os_str().is_empty();
        if !self.anonymous_allowed() && !self.auth.has_credentials() && !certificates {
            let beyond = self.listeners.all().find(|(_, v)| !is_loopback(v));
            if let Some((key, value)) = beyond {
                return Err(SettingsError::AnonymousBeyondLoopback {
                    key,
                    value: value.to_owned(),
                });
            }
        }
        self.store.validate()
    }

    fn validate_ranges(&self) -> Result<(), SettingsError> {
        let s = &self.server;
        check("server.shards", s.shards, 0, 64, num)?;
        check(
            "server.sys_interval",
            s.sys_interval,
            secs(1),
            secs(3600),
            format_duration,
        )?;
        let l = &self.limits;
        check("limits.max_clients", l.max_clients, 1, 10_000_000, num)?;
        check(
            "limits.max_pending_connections",
            l.max_pending_connections,
            1,
            1_000_000,
            num,
        )?;
        check(
            "limits.max_connects_authenticating",
            l.max_connects_authenticating,
            1,
            1_000_000,
            num,
        )?;
        check(
            "limits.max_connections_per_credential",
            l.max_connections_per_credential,
            1,
            10_000_000,
            num,
        )?;
        check(
            "limits.max_connections_per_source",
            l.max_connections_per_source,
            1,
            10_000_000,
            num,
        )?;
        self.validate_auth_ranges()?;
        check(
            "limits.max_connect_packet_bytes",
            l.max_connect_packet_bytes,
            KIB,
            16 * MIB,
            format_size,
        )?;
        check(
            "limits.connect_timeout",
            l.connect_timeout,
            secs(1),
            secs(300),
            format_duration,
        )?;
        check(
            "limits.max_keep_alive",
            l.max_keep_alive,
            secs(1),
            secs(65_535),
            format_duration,
        )?;
        if l.max_keep_alive.subsec_nanos() != 0 {
            return Err(SettingsError::NotWholeSeconds {
                key: "limits.max_keep_alive",
                value: format_duration(l.max_keep_alive),
            });
        }
        check(
            "limits.max_subscriptions_per_client",
            l.max_subscriptions_per_client,
            1,
            1_000_000,
            num,
        )?;
        check("limits.max_topic_levels", l.max_topic_levels, 1, 1024, num)?;
        check("limits.max_topic_bytes", l.max_topic_bytes, 1, 65_535, num)?;
        check(
            "limits.receive_maximum",
            l.receive_maximum,
            1,
            u16::MAX,
            num,
        )?;
        check(
            "limits.max_client_writes_pending",
            l.max_client_writes_pending,
            1,
            1_000_000,
            num,
        )?;
        check(
            "limits.max_subscriber_queue",
            l.max_subscriber_queue,
            1,
            10_000_000,
            num,
        )?;
        let max_expiry = secs(u64::from(u32::MAX));
        check(
            "limits.max_session_expiry",
            l.max_session_expiry,
            Duration::ZERO,
            max_expiry,
            format_duration,
        )?;
        check(
            "limits.max_offline_sessions",
            l.max_offline_sessions,
            0,
            100_000_000,
            num,
        )?;
        check(
            "limits.max_packet_size",
            l.max_packet_size,
            64,
            256 * MIB,
            format_size,
        )?;
        check(
            "limits.max_client_write_bytes",
            l.max_client_write_bytes,
            64 * 1024,
            1024 * MIB,
            format_size,
        )?;
        Ok(())
    }

    fn validate_auth_ranges(&self) -> Result<(), SettingsError> {
        let l = &self.limits;
        let day = secs(24 * 3600);
        check(
            "limits.auth_failure_threshold",
            l.auth_failure_threshold,
            1,
            1_000_000,
            num,
        )?;
        check(
            "limits.auth_failure_window",
            l.auth_failure_window,
            secs(1),
            day,
            format_duration,
        )?;
        check(
            "limits.auth_failure_backoff",
            l.auth_failure_backoff,
            secs(1),
            day,
            format_duration,
        )?;
        check(
            "limits.auth_failure_backoff_max",
            l.auth_failure_backoff_max,
            l.auth_failure_backoff,
            day,
            format_duration,
        )?;
        check(
            "limits.auth_check_rate_per_credential",
            l.auth_check_rate_per_credential,
            1,
            1_000_000,
            num,
        )?;
        check(
            "limits.auth_throttle_max_entries",
            l.auth_throttle_max_entries,
            100,
            10_000_000,
            num,
        )?;
        check(
            "limits.auth_known_devices",
            l.auth_known_devices,
            0,
            100_000_000,
            num,
        )?;
        check(
            "auth.acl_cache_ttl",
            self.auth.acl_cache_ttl,
            secs(1),
            secs(3600),
            format_duration,
        )
    }

    /// Whether clients without credentials may connect:
    /// `auth.allow_anonymous` when set, else true exactly when every MQTT
    /// listener is on a loopback address (DESIGN.md §9). A listener that is
    /// not a socket address counts as not loopback.
    pub fn anonymous_allowed(&self) -> bool {
        self.auth
            .allow_anonymous
            .unwrap_or_else(|| self.listeners.all().all(|(_, v)| is_loopback(v)))
    }
}

fn parse_addr(key: &str, value: &str) -> Result<SocketAddr, SettingsError> {
    value.parse().map_err(|_| SettingsError::BadAddress {
        key: key.to_owned(),
        value: value.to_owned(),
    })
}

fn is_loopback(addr: &str) -> bool {
    addr.parse::<SocketAddr>()
        .is_ok_and(|a| a.ip().is_loopback())
}

/// Formats a duration the way [`parse_duration`] reads it back, exactly,
/// in days at most (not humantime's months and years of 30.44 and 365.25
/// days, which made `1000h` read "1month 11days 5h 26m 24s"), e.g.
/// `"15m"`, `"1h 30m"`, `"41d 16h"`, `"1s 500ms"`, `"0s"`; except a
/// whole number of humantime years, written in years as it was given
/// (`"300y"`, not `"109575d"`).
pub fn format_duration(d: Duration) -> String {
    // A whole number of years as humantime reads `y` (365.25 days):
    // `300y` reads back as `300y`, not as 109575d.
    const YEAR: u64 = 31_557_600;
    if d.subsec_nanos() == 0 && d.as_secs() >= YEAR && d.as_secs().is_multiple_of(YEAR) {
        return format!("{}y", d.as_secs() / YEAR);
    }
    const UNITS: [(u64, &str); 4] = [(86_400, "d"), (3_600, "h"), (60, "m"), (1, "s")];
    let mut parts = Vec::new();
    let mut secs = d.as_secs();
    for (size, unit) in UNITS {
        if secs >= size {
            parts.push(format!("{}{unit}", secs / size));
            secs %= size;
        }
    }
    let nanos = d.subsec_nanos();
    for (size, unit) in [(1_000_000, "ms"), (1_000, "us"), (1, "ns")] {
        if !(nanos / size).is_multiple_of(1_000) {
            parts.push(format!("{}{unit}", (nanos / size) % 1_000));
        }
    }
    if parts.is_empty() {
        "0s".to_owned()
    } else {
        parts.join(" ")
    }
}

/// Parses a duration with units (`"10s"`, `"15m"`, `"1h 30m"`, `"250ms"`,
/// humantime syntax) or a plain integer of seconds (`"10"`).
///
/// # Errors
///
/// A message naming the text when it is neither; one ending in
/// [`TOO_LARGE`] when it is a duration too long to hold.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    if let Ok(secs) = text.parse::<u64>() {
        return Ok(Duration::from_secs(secs));
    }
    if !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!("{text:?}{TOO_LARGE}"));
    }
    humantime::parse_duration(text).map_err(|e| match e {
        humantime::DurationError::NumberOverflow => format!("{text:?}{TOO_LARGE}"),
        e => format!("invalid duration {text:?} ({e}); a number with a unit, e.g. \"250ms\", \"10s\", \"15m\""),
    })
}

/// How [`parse_size`] and [`parse_duration`] end the message for a
/// well-formed value too large to hold (`"99999999999999999999B" is too
/// large`), so that the settings loader can report the key's range instead.
pub const TOO_LARGE: &str = " is too large";

/// Formats a byte count in the largest binary unit that divides it exactly:
/// `"1TiB"`, `"1MiB"`, `"64KiB"`, `"1000B"`.
pub fn format_size(bytes: usize) -> String {
    match bytes {
        0 => "0B".to_owned(),
        b if b % (1024 * GIB) == 0 => format!("{}TiB", b / (1024 * GIB)),
        b if b % GIB == 0 => format!("{}GiB", b / GIB),
        b if b % MIB == 0 => format!("{}MiB", b / MIB),
        b if b % KIB == 0 => format!("{}KiB", b / KIB),
        b => format!("{b}B"),
    }
}

/// Parses a size: an integer of bytes optionally followed by a unit, `B`,
/// `KiB`, `MiB`, `GiB`, `TiB` (powers of 1024) or `KB`, `MB`, `GB`, `TB`
/// (powers of 1000); units are case-insensitive and may follow a space (`"1 MiB"`).
///
/// # Errors
///
/// A message naming the text when it is not a size; one ending in
/// [`TOO_LARGE`] when it overflows `usize`.
pub fn parse_size(text: &str) -> Result<usize, String> {
    let text = text.trim();
    let bad = || format!("invalid size {text:?}; use e.g. \"65536\", \"64KiB\", \"1MiB\"");
    let too_large = || format!("{text:?}{TOO_LARGE}");
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (digits, unit) = text.split_at(split);
    if digits.is_empty() {
        return Err(bad());
    }
    let mult: usize = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kib" => KIB,
        "mib" => MIB,
        "gib" => GIB,
        "tib" => 1024 * GIB,
        "kb" => 1000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        _ => return Err(bad()),
    };
    let n: usize = digits.parse().map_err(|_| too_large())?;
    n.checked_mul(mult).ok_or_else(too_large)
}

/// A string or integer in a settings file, as the duration and size
/// deserializers accept. Anything else (a negative number, a float, a
/// table) is refused with what is expected.
enum TextOrInt {
    Int(u64),
    Text(String),
}

impl<'de> Deserialize<'de> for TextOrInt {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        const EXPECTED: &str =
            "a whole number, or a string with units (a duration such as \"30s\", a size such as \"64KiB\")";
        impl serde::de::Visitor<'_> for Visitor {
            type Value = TextOrInt;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str(EXPECTED)
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<TextOrInt, E> {
                Ok(TextOrInt::Int(v))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<TextOrInt, E> {
                u64::try_from(v)
                    .map(TextOrInt::Int)
                    .map_err(|_| E::custom(format!("{v} is negative; expected {EXPECTED}")))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<TextOrInt, E> {
                Ok(TextOrInt::Text(v.to_owned()))
            }
        }
        d.deserialize_any(Visitor)
    }
}

/// Serde helpers for durations: a string with units or integer seconds in,
/// a humantime string out.
pub(crate) mod duration {
    use super::*;

    pub(crate) fn serialize<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format_duration(*d))
    }

    pub(crate) fn deserialize<'de, D: serde::Deserializer<'de>>(
        d: D,
    ) -> Result<Duration, D::Error> {
        match TextOrInt::deserialize(d)? {
            TextOrInt::Int(secs) => Ok(Duration::from_secs(secs)),
            TextOrInt::Text(t) => parse_duration(&t).map_err(serde::de::Error::custom),
        }
    }
}

/// Serde helpers for sizes: a string with units or integer bytes in, a
/// string with the largest exact binary unit out.
pub(crate) mod size {
    use super::*;

    pub(crate) fn serialize<S: serde::Serializer>(b: &usize, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format_size(*b))
    }

    pub(crate) fn deserialize<'de, D: serde::Deserializer<'de>>(d: D) -> Result<usize, D::Error> {
        match TextOrInt::deserialize(d)? {
            TextOrInt::Int(n) => usize::try_from(n).map_err(serde::de::Error::custom),
            TextOrInt::Text(t) => parse_size(&t).map_err(serde::de::Error::custom),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(s: &Settings) -> String {
        s.validate().expect_err("should be refused").to_string()
    }

    #[test]
    fn defaults_validate_and_allow_anonymous_on_loopback() {
        let s = Settings::default();
        s.validate().unwrap();
        assert!(s.anonymous_allowed());
        assert_eq!(s.limits.max_packet_size, 1024 * 1024);
        assert_eq!(s.store.kind, StoreKind::Local);
    }

    #[test]
    fn a_shared_group_name_no_client_can_subscribe_with_is_refused() {
        for name in ["a/b", "a+", "#", ""] {
            let mut s = Settings::default();
            s.shared.groups.insert(name.into(), crate::shared::Strategy::Random);
            let e = err(&s);
            assert!(e.starts_with(&format!("shared.groups = {name:?} is not valid")), "{e}");
        }
        let mut s = Settings::default();
        s.shared.groups.insert("billing-1".into(), crate::shared::Strategy::Random);
        s.validate().unwrap();
    }

    #[test]
    fn durations_parse_with_units_or_as_seconds() {
        assert_eq!(parse_duration("10s"), Ok(Duration::from_secs(10)));
        assert_eq!(parse_duration("15m"), Ok(Duration::from_secs(900)));
        assert_eq!(parse_duration("1h 30m"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("42"), Ok(Duration::from_secs(42)));
        assert!(parse_duration("ten").unwrap_err().contains("\"ten\""));
    }

    #[test]
    fn sizes_parse_with_binary_and_decimal_units() {
        assert_eq!(parse_size("1MiB"), Ok(1 << 20));
        assert_eq!(parse_size("64KiB"), Ok(65536));
        assert_eq!(parse_size("64 kib"), Ok(65536));
        assert_eq!(parse_size("2GiB"), Ok(2 << 30));
        assert_eq!(parse_size("1KB"), Ok(1000));
        assert_eq!(parse_size("3MB"), Ok(3_000_000));
        assert_eq!(parse_size("10B"), Ok(10));
        assert_eq!(parse_size("65536"), Ok(65536));
        assert_eq!(parse_size("2TiB"), Ok(2 << 40));
        assert_eq!(parse_size("1TB"), Ok(1_000_000_000_000));
        assert!(parse_size("1XB").is_err());
        assert!(parse_size("MiB").is_err());
        assert!(parse_size("99999999999999999999GiB").is_err());
    }

    #[test]
    fn sizes_format_in_the_largest_exact_unit_and_round_trip() {
        for (n, text) in [
            (0, "0B"),
            (10, "10B"),
            (65536, "64KiB"),
            (1 << 20, "1MiB"),
            (1000, "1000B"),
        ] {
            assert_eq!(format_size(n), text);
            assert_eq!(parse_size(text), Ok(n));
        }
        let d = Duration::from_secs(65_535);
        assert_eq!(parse_duration(&format_duration(d)), Ok(d));
    }

    #[test]
    fn a_size_out_of_range_names_key_value_and_range_with_units() {
        let mut s = Settings::default();
        s.limits.max_packet_size = 10;
        assert_eq!(
            err(&s),
            "limits.max_packet_size = 10B is out of range 64B..=256MiB"
        );
    }

    #[test]
    fn a_duration_out_of_range_names_key_value_and_range_with_units() {
        let mut s = Settings::default();
        s.limits.connect_timeout = Duration::from_secs(600);
        assert_eq!(
            err(&s),
            "limits.connect_timeout = 10m is out of range 1s..=5m"
        );
        let mut s = Settings::default();
        s.limits.max_keep_alive = Duration::from_secs(65_536);
        assert_eq!(
            err(&s),
            "limits.max_keep_alive = 18h 12m 16s is out of range 1s..=18h 12m 15s"
        );
        let mut s = Settings::default();
        s.limits.max_keep_alive = Duration::from_millis(1500);
        assert_eq!(
            err(&s),
            "limits.max_keep_alive = 1s 500ms must be whole seconds (MQTT counts Keep Alive in seconds)"
        );
    }

    #[test]
    fn a_count_out_of_range_names_key_value_and_range() {
        let mut s = Settings::default();
        s.server.shards = 65;
        assert_eq!(err(&s), "server.shards = 65 is out of range 0..=64");
        let mut s = Settings::default();
        s.limits.receive_maximum = 0;
        assert_eq!(
            err(&s),
            "limits.receive_maximum = 0 is out of range 1..=65535"
        );
    }

    #[test]
    fn a_listener_that_is_not_a_socket_address_is_refused() {
        let mut s = Settings::default();
        s.listeners.ws = vec!["localhost:8083".into()];
        assert!(err(&s).starts_with("listeners.ws[0] = \"localhost:8083\" is not a socket address"));
        let mut s = Settings::default();
        s.admin.listen = "8080".into();
        assert!(err(&s).starts_with("admin.listen = \"8080\""));
        s.admin.listen = String::new();
        s.validate().unwrap();
    }

    #[test]
    fn two_listeners_on_one_address_are_refused_unless_the_port_is_0() {
        let mut s = Settings::default();
        s.listeners.tcp = vec!["127.0.0.1:1884".into(), "127.0.0.1:1884".into()];
        assert_eq!(
            err(&s),
            "listeners.tcp[1] = \"127.0.0.1:1884\" is the address of listeners.tcp[0] too: \
             each listener needs an address of its own (port 0 excepted)"
        );
        s.listeners.tcp = vec!["127.0.0.1:1884".into()];
        s.listeners.ws = vec!["127.0.0.1:8080".into()];
        assert!(err(&s).starts_with("admin.listen = \"127.0.0.1:8080\" is the address of listeners.ws[0]"));
        s.listeners.ws = vec!["127.0.0.1:0".into(), "127.0.0.1:0".into()];
        s.admin.listen = "127.0.0.1:0".into();
        s.validate().unwrap();
        // Another IP on the same port is another address.
        s.listeners.ws = vec!["127.0.0.2:1884".into()];
        s.validate().unwrap();
    }

    #[test]
    fn a_wildcard_listener_beside_an_address_it_covers_on_one_port_is_refused() {
        let mut s = Settings::default();
        s.auth.allow_anonymous = Some(true);
        s.admin.listen = String::new();
        s.listeners.tcp = vec!["0.0.0.0:1884".into()];
        s.listeners.ws = vec!["127.0.0.1:1884".into()];
        assert_eq!(
            err(&s),
            "listeners.ws[0] = \"127.0.0.1:1884\" overlaps listeners.tcp[0] = \"0.0.0.0:1884\": a wildcard \
             address takes its port on every address, so each listener needs a port of its own there"
        );
        // Either order, IPv6 and dual-stack, and admin.listen too.
        s.listeners.tcp = vec!["127.0.0.1:1884".into(), "0.0.0.0:1884".into()];
        s.listeners.ws = vec![];
        assert!(err(&s).starts_with("listeners.tcp[1] = \"0.0.0.0:1884\" overlaps listeners.tcp[0]"));
        s.listeners.tcp = vec!["[::]:1884".into(), "10.0.0.1:1884".into()];
        assert!(err(&s).starts_with("listeners.tcp[1] = \"10.0.0.1:1884\" overlaps listeners.tcp[0] = \"[::]:1884\""));
        s.listeners.tcp = vec!["[::1]:1884".into(), "[::]:1884".into()];
        assert!(err(&s).contains("overlaps listeners.tcp[0]"));
        s.listeners.tcp = vec!["0.0.0.0:1884".into()];
        s.admin.listen = "127.0.0.1:1884".into();
        assert!(err(&s).starts_with("admin.listen = \"127.0.0.1:1884\" overlaps listeners.tcp[0]"));
        // Other ports, port 0, and IPv4's wildcard beside an IPv6 address
        // are not shared.
        s.admin.listen = "127.0.0.1:8080".into();
        s.listeners.tcp = vec!["0.0.0.0:1884".into(), "127.0.0.1:1885".into(), "[::1]:1884".into()];
        s.validate().unwrap();
        s.listeners.tcp = vec!["0.0.0.0:0".into(), "127.0.0.1:0".into()];
        s.validate().unwrap();
    }

    #[test]
    fn port_zero_and_ipv6_loopback_are_accepted() {
        let mut s = Settings::default();
        s.listeners.tcp = vec!["127.0.0.1:0".into(), "[::1]:0".into()];
        s.validate().unwrap();
        assert!(s.anonymous_allowed());
    }

    #[test]
    fn no_listener_at_all_is_refused() {
        let mut s = Settings::default();
        s.listeners.tcp.clear();
        assert!(err(&s).starts_with("no MQTT listener"));
    }

    #[test]
    fn listening_beyond_loopback_needs_allow_anonymous_or_a_password_file() {
        let mut s = Settings::default();
        s.listeners.tcp = vec!["0.0.0.0:1883".into()];
        assert!(!s.anonymous_allowed());
        let msg = err(&s);
        assert!(msg.contains("listeners.tcp[0]"), "{msg}");
        assert!(msg.contains("auth.allow_anonymous = true"), "{msg}");

        s.auth.allow_anonymous = Some(true);
        s.validate().unwrap();
        assert!(s.anonymous_allowed());

        s.auth.allow_anonymous = None;
        s.auth.password_file = "passwd".into();
        s.validate().unwrap();
        assert!(!s.anonymous_allowed());
    }

    #[test]
    fn auth_failure_settings_default_per_design_and_check_their_ranges() {
        let s = Settings::default();
        assert_eq!(s.limits.auth_failure_threshold, 10);
        assert_eq!(s.limits.auth_failure_window, Duration::from_secs(60));
        assert_eq!(s.limits.auth_failure_backoff, Duration::from_secs(30));
        assert_eq!(s.limits.auth_failure_backoff_max, Duration::from_secs(900));
        assert_eq!(s.auth.acl_cache_ttl, Duration::from_secs(60));
        assert_eq!(s.auth.jwt.username_claim, "sub");
        let mut s = Settings::default();
        s.limits.auth_failure_threshold = 0;
        assert_eq!(
            err(&s),
            "limits.auth_failure_threshold = 0 is out of range 1..=1000000"
        );
        let mut s = Settings::default();
        s.limits.auth_failure_backoff_max = Duration::from_secs(10);
        assert_eq!(
            err(&s),
            "limits.auth_failure_backoff_max = 10s is out of range 30s..=1d"
        );
        let mut s = Settings::default();
        s.auth.acl_cache_ttl = Duration::ZERO;
        assert!(err(&s).starts_with("auth.acl_cache_ttl = 0s is out of range"));
        let d = Settings::default().limits;
        assert_eq!(
            (
                d.auth_check_rate_per_credential,
                d.auth_throttle_max_entries,
                d.auth_known_devices
            ),
            (4, 100_000, 1_000_000)
        );
        let mut s = Settings::default();
        s.limits.auth_check_rate_per_credential = 0;
        assert_eq!(
            err(&s),
            "limits.auth_check_rate_per_credential = 0 is out of range 1..=1000000"
        );
        let mut s = Settings::default();
        s.limits.auth_throttle_max_entries = 99;
        assert_eq!(
            err(&s),
            "limits.auth_throttle_max_entries = 99 is out of range 100..=10000000"
        );
        let mut s = Settings::default();
        s.limits.auth_known_devices = 100_000_001;
        assert_eq!(
            err(&s),
            "limits.auth_known_devices = 100000001 is out of range 0..=100000000"
        );
    }

    #[test]
    fn a_jwt_key_counts_as_a_way_to_sign_in_beyond_loopback() {
        let mut s = Settings::default();
        s.listeners.tcp = vec!["0.0.0.0:1883".into()];
        s.auth.jwt.secret_file = "secret".into();
        s.validate().unwrap();
    }

    #[test]
    fn allow_anonymous_false_is_honoured_on_loopback() {
        let mut s = Settings::default();
        s.auth.allow_anonymous = Some(false);
        s.validate().unwrap();
        assert!(!s.anonymous_allowed());
    }

    #[test]
    fn the_jetstream_store_needs_a_cluster_section() {
        let mut s = Settings::default();
        s.store.kind = StoreKind::Jetstream;
        assert_eq!(
            err(&s),
            "store.kind = \"jetstream\" needs a [cluster] section (NATS JetStream is the cluster's store): add [cluster], or use store.kind = \"local\" (durable, the single-node default) or \"none\" (memory only)"
        );
        s.cluster = Some(crate::cluster::settings::Cluster::default());
        s.validate().unwrap();
    }
}

#[cfg(test)]
mod serde_tests {
    use super::*;

    #[test]
    fn durations_are_written_in_days_at_most_and_read_back_exactly() {
        assert_eq!(format_duration(Duration::from_secs(1000 * 3600)), "41d 16h");
        assert_eq!(format_duration(Duration::from_secs(u64::from(u32::MAX))), "49710d 6h 28m 15s");
        assert_eq!(format_duration(Duration::from_millis(1500)), "1s 500ms");
        assert_eq!(format_duration(Duration::ZERO), "0s");
        // Years as given (humantime's: 365.25 days), only when whole.
        let y300 = parse_duration("300y").unwrap();
        assert_eq!(format_duration(y300), "300y");
        assert_eq!(parse_duration(&format_duration(y300)), Ok(y300));
        assert_eq!(format_duration(Duration::from_secs(365 * 86_400)), "365d");
        assert_eq!(format_duration(parse_duration("1y 1s").unwrap()), "365d 6h 1s");
        proptest::proptest!(|(secs in 0u64..=u64::from(u32::MAX) * 4, nanos in 0u32..1_000_000_000)| {
            let d = Duration::new(secs, nanos);
            proptest::prop_assert_eq!(parse_duration(&format_duration(d)), Ok(d));
        });
    }

    #[test]
    fn a_file_with_units_deserializes() {
        let s: Settings = toml::from_str(
            r#"
            [server]
            sys_interval = "30s"
            move_publishers = false
            [limits]
            max_packet_size = "2MiB"
            max_connect_packet_bytes = 4096
            connect_timeout = 7
            max_keep_alive = "1h"
            [auth]
            allow_anonymous = true
            acl_cache_ttl = "30s"
            [auth.jwt]
            secret_file = "jwt.secret"
            audience = "fleet"
            [store]
            kind = "none"
            "#,
        )
        .unwrap();
        assert_eq!(s.server.sys_interval, Duration::from_secs(30));
        assert!(!s.server.move_publishers && Settings::default().server.move_publishers);
        assert_eq!(s.limits.max_packet_size, 2 << 20);
        assert_eq!(s.limits.max_connect_packet_bytes, 4096);
        assert_eq!(s.limits.connect_timeout, Duration::from_secs(7));
        assert_eq!(s.limits.max_keep_alive, Duration::from_secs(3600));
        assert_eq!(s.auth.allow_anonymous, Some(true));
        assert_eq!(s.auth.acl_cache_ttl, Duration::from_secs(30));
        assert_eq!(s.auth.jwt.secret_file, "jwt.secret");
        assert_eq!(s.auth.jwt.audience, "fleet");
        assert_eq!(s.auth.jwt.username_claim, "sub");
        assert_eq!(s.listeners, Listeners::default());
        s.validate().unwrap();
    }

    #[test]
    fn unknown_keys_and_bad_units_are_parse_errors() {
        let e = toml::from_str::<Settings>("[limits]\nmax_packet_sise = 5\n").unwrap_err();
        assert!(e.to_string().contains("max_packet_sise"), "{e}");
        let e = toml::from_str::<Settings>("[limits]\nmax_packet_size = \"1QiB\"\n").unwrap_err();
        assert!(e.to_string().contains("invalid size"), "{e}");
        let e = toml::from_str::<Settings>("[store]\nkind = \"disk\"\n").unwrap_err();
        assert!(e.to_string().contains("disk"), "{e}");
    }

    #[test]
    fn a_cluster_section_takes_its_defaults_and_checks_its_ranges() {
        let s: Settings = toml::from_str(
            "[tls]\ncert = \"server.pem\"\nrequire_client_cert = true\n\
             [cluster]\nreplica_id = \"r1\"\nnats_urls = [\"nats://127.0.0.1:4222\"]\n",
        )
        .unwrap();
        assert_eq!(s.tls.cert, PathBuf::from("server.pem"));
        s.validate().unwrap();
        let cluster = s.cluster.as_ref().unwrap();
        assert_eq!(cluster.member_ttl, Duration::from_secs(10));
        let s: Settings = toml::from_str("[cluster]\nmember_ttl = \"3s\"\n").unwrap();
        assert_eq!(
            s.validate().unwrap_err().to_string(),
            "cluster.member_ttl = 3s is out of range 5s..=2m"
        );
    }

    #[test]
    fn a_shared_strategy_that_is_no_strategy_name_names_the_strategies_and_shows_what_was_given() {
        let refused = |text: &str| toml::from_str::<Settings>(text).unwrap_err().message().to_owned();
        let names = "expected a strategy (one of round_robin, random, sticky, hash_client_id, local_first)";
        // `shared.groups."a.b".c = "random"`: a table where the strategy belongs.
        let e = refused("[shared.groups]\n\"a.b\" = { c = \"random\" }\n");
        assert_eq!(e, format!("{names}, found a table {{ c = \"random\" }}"));
        let e = refused("[shared]\nstrategy = \"fastest\"\n");
        assert_eq!(e, format!("{names}, found a string \"fastest\""));
        let e = refused("[shared.groups]\nbilling = 5\n");
        assert_eq!(e, format!("{names}, found an integer 5"));
    }

    #[test]
    fn every_strategy_reads_and_prints_by_its_name_and_a_group_name_may_hold_a_dot() {
        use crate::shared::Strategy;
        for strategy in Strategy::ALL {
            let text = format!("[shared]\nstrategy = \"{}\"\n[shared.groups]\n\"eu.west\" = \"{}\"\n", strategy.name(), strategy.name());
            let s: Settings = toml::from_str(&text).unwrap();
            assert_eq!((s.shared.strategy, s.shared.strategy_for("eu.west")), (strategy, strategy));
            s.validate().unwrap();
            let printed = toml::to_string(&s.shared).unwrap();
            assert!(printed.contains(&format!("\"eu.west\" = \"{}\"", strategy.name())), "{printed}");
            assert_eq!(toml::from_str::<Shared>(&printed).unwrap(), s.shared);
        }
    }

    #[test]
    fn printed_settings_read_back_the_same() {
        let mut s = Settings::default();
        s.limits.max_session_expiry = Duration::from_secs(u64::from(u32::MAX));
        s.auth.allow_anonymous = Some(false);
        let text = toml::to_string(&s).unwrap();
        assert!(text.contains("max_packet_size = \"1MiB\""), "{text}");
        assert_eq!(toml::from_str::<Settings>(&text).unwrap(), s);
    }
}
