//! The `[cluster]` section (DESIGN.md §10, §15). Absent: a single node.

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::cluster::names::{check_nats_url, check_replica_id, replica_id_from_host};
use crate::settings::{duration, format_duration, format_size, size, SettingsError};

/// `[cluster]` settings. Every key has a default; ranges are checked by
/// [`Cluster::validate`] (called by `Settings::validate`).
///
/// ```toml
/// [cluster]
/// replica_id = "r1"
/// nats_urls = ["nats://10.0.0.5:4222", "nats://10.0.0.6:4222"]
/// member_ttl = "10s"
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Cluster {
    /// This replica's ID, unique in the cluster: 1–64 characters of
    /// `[-_a-zA-Z0-9]`. Default: the host name (with other characters
    /// replaced by `-`).
    pub replica_id: String,
    /// NATS servers to connect to (any of them; the client follows the
    /// cluster's gossip). Default `["nats://127.0.0.1:4222"]`. `tls://`
    /// URLs require TLS.
    pub nats_urls: Vec<String>,
    /// A NATS credentials file (user JWT and NKey seed, `.creds`). Default
    /// none.
    pub nats_credentials: PathBuf,
    /// A file holding an NKey seed (`SU...`) to sign in with. Default none.
    pub nats_nkey_file: PathBuf,
    /// NATS user name (with `nats_password`). Default none.
    pub nats_user: String,
    /// NATS password. Default none.
    pub nats_password: String,
    /// NATS token. Default none.
    pub nats_token: String,
    /// Require TLS to NATS even on `nats://` URLs. Default false.
    pub nats_tls: bool,
    /// PEM CA certificates that NATS servers are verified against, instead
    /// of the system roots. Default none.
    pub nats_tls_ca: PathBuf,
    /// PEM client certificate for TLS to NATS (with `nats_tls_key`).
    /// Default none.
    pub nats_tls_cert: PathBuf,
    /// PEM key of `nats_tls_cert`. Default none.
    pub nats_tls_key: PathBuf,
    /// `memberTTL` = T: membership entries expire T after their last write;
    /// heartbeat T/10, self-fence 7T/6, peers gone T/2 after their entry
    /// (DESIGN.md §5). The same on every replica. Default 10 s, range
    /// 5 s..=2 min.
    #[serde(with = "duration")]
    pub member_ttl: Duration,
    /// How long the wills of a stopped, fenced or gone replica's
    /// connections wait for their clients to come back. Default 30 s,
    /// range 0..=10 min.
    #[serde(with = "duration")]
    pub will_stop_grace: Duration,
    /// CONNECT arrival to CONNACK, at most (DESIGN.md §8); past it CONNACK
    /// 0x88. Default 20 s, range 5 s..=120 s.
    #[serde(with = "duration")]
    pub connect_budget: Duration,
    /// How long a publish waits for the session log or retained bucket
    /// before it is refused. Default 10 s, range 1 s..=60 s.
    #[serde(with = "duration")]
    pub session_log_append_wait: Duration,
    /// Largest size of a workspace's session log. Default 256 MiB, range
    /// 1 MiB..=1 TiB.
    #[serde(with = "size")]
    pub session_log_max_bytes: usize,
    /// Copies of every stream and bucket: 1, 3 or 5. Default 3.
    pub nats_replicas: u8,
    /// Where the mesh listens: an IP address and a port (0: a free
    /// port). Default `0.0.0.0:7884`; two replicas on one host need one
    /// each.
    pub mesh_listen: String,
    /// The address other replicas dial for the mesh: `host:port`, a DNS
    /// name or an IP address (IPv6 in brackets), port 1..=65535. Default
    /// empty: the bound `mesh_listen` address (the host name for
    /// `0.0.0.0`).
    pub mesh_advertise: String,
    /// This replica's mesh certificate (from `fleetmq cert`): PEM, at
    /// most 1 MiB, signed by `mesh_ca` and naming `replica_id` (checked
    /// at the start and by `fleetmq check-config`). Default none (no
    /// mesh; the three go together).
    pub mesh_cert: PathBuf,
    /// Its key (PEM). Default none.
    pub mesh_key: PathBuf,
    /// The deployment's mesh CA (PEM), the only certificate a link
    /// trusts. Default none.
    pub mesh_ca: PathBuf,
    /// Values kept for one peer replica while its mesh link is down or
    /// behind, bytes (payloads and topics plus 64 bytes each), split
    /// evenly over this replica's shards; past it the oldest are dropped
    /// and counted (`fleetmq_mesh_values_lost_total`, DESIGN.md §6).
    /// Default 64 MiB, range 4 KiB..=64 GiB.
    #[serde(with = "size")]
    pub mesh_buffer: usize,
}

impl Default for Cluster {
    fn default() -> Self {
        Cluster {
            replica_id: String::new(),
            nats_urls: vec!["nats://127.0.0.1:4222".to_owned()],
            nats_credentials: PathBuf::new(),
            nats_nkey_file: PathBuf::new(),
            nats_user: String::new(),
            nats_password: String::new(),
            nats_token: String::new(),
            nats_tls: false,
            nats_tls_ca: PathBuf::new(),
            nats_tls_cert: PathBuf::new(),
            nats_tls_key: PathBuf::new(),
            member_ttl: Duration::from_secs(10),
            will_stop_grace: Duration::from_secs(30),
            connect_budget: Duration::from_secs(20),
            session_log_append_wait: Duration::from_secs(10),
            session_log_max_bytes: 256 << 20,
            nats_replicas: 3,
            mesh_listen: "0.0.0.0:7884".to_owned(),
            mesh_advertise: String::new(),
            mesh_cert: PathBuf::new(),
            mesh_key: PathBuf::new(),
            mesh_ca: PathBuf::new(),
            mesh_buffer: 64 << 20,
        }
    }
}

fn out_of_range(key: &'static str, value: String, range: &str) -> SettingsError {
    SettingsError::OutOfRange { key, value, range: range.to_owned() }
}

fn check_duration(key: &'static str, d: Duration, min: Duration, max: Duration) -> Result<(), SettingsError> {
    if d < min || d > max {
        return Err(out_of_range(
            key,
            format_duration(d),
            &format!("{}..={}", format_duration(min), format_duration(max)),
        ));
    }
    Ok(())
}

impl Cluster {
    /// Checks every range.
    ///
    /// # Errors
    /// The first key out of its range (DESIGN.md §10), a replica ID that is
    /// not 1–64 characters of `[-_a-zA-Z0-9]`, or no NATS URL.
    pub fn validate(&self) -> Result<(), SettingsError> {
        let secs = Duration::from_secs;
        check_duration("cluster.member_ttl", self.member_ttl, secs(5), secs(120))?;
        check_duration("cluster.will_stop_grace", self.will_stop_grace, secs(0), secs(600))?;
        check_duration("cluster.connect_budget", self.connect_budget, secs(5), secs(120))?;
        check_duration(
            "cluster.session_log_append_wait",
            self.session_log_append_wait,
            secs(1),
            secs(60),
        )?;
        if !(1 << 20..=1 << 40).contains(&self.session_log_max_bytes) {
            return Err(out_of_range(
                "cluster.session_log_max_bytes",
                format_size(self.session_log_max_bytes),
                "1MiB..=1TiB",
            ));
        }
        if !(4 << 10..=64 << 30).contains(&self.mesh_buffer) {
            return Err(out_of_range("cluster.mesh_buffer", format_size(self.mesh_buffer), "4KiB..=64GiB"));
        }
        if self.mesh_listen.parse::<std::net::SocketAddr>().is_err() {
            return Err(SettingsError::Invalid {
                key: "cluster.mesh_listen",
                value: self.mesh_listen.clone(),
                allowed: "an IP address and a port, e.g. \"0.0.0.0:7884\" or \"[::]:7884\" (port 0: a free port)".into(),
            });
        }
        if !self.mesh_advertise.is_empty() {
            if let Err(why) = super::names::check_mesh_address(&self.mesh_advertise) {
                return Err(SettingsError::Invalid {
                    key: "cluster.mesh_advertise",
                    value: self.mesh_advertise.clone(),
                    allowed: format!(
                        "{why}; the host:port the other replicas dial: a DNS name, an IPv4 address or an IPv6 \
                         address in brackets, and a port from 1 to 65535, e.g. \"fleetmq-0.mesh:7884\""
                    ),
                });
            }
        }
        if ![1, 3, 5].contains(&self.nats_replicas) {
            return Err(out_of_range("cluster.nats_replicas", self.nats_replicas.to_string(), "1, 3 or 5"));
        }
        if !self.replica_id.is_empty() && check_replica_id(&self.replica_id).is_err() {
            return Err(SettingsError::Invalid {
                key: "cluster.replica_id",
                value: self.replica_id.clone(),
                allowed: "a DNS name (ASCII letters, digits and '-' in dot-separated parts of 1 to 63, \
                          not starting or ending with '-'; 253 bytes at most), not an IP address, not \"ca\" \
                          (as `fleetmq cert --names` takes)".into(),
            });
        }
        if self.nats_urls.is_empty() {
            return Err(SettingsError::EmptyList {
                key: "cluster.nats_urls",
                allowed: "at least one NATS URL, e.g. [\"nats://127.0.0.1:4222\"]".into(),
            });
        }
        for url in &self.nats_urls {
            if let Err(why) = check_nats_url(url) {
                return Err(SettingsError::Invalid {
                    key: "cluster.nats_urls",
                    value: url.clone(),
                    allowed: format!(
                        "{why}; URLs with the scheme nats://, tls://, ws:// or wss:// (or host:port) with a port from 1 \
                         to 65535, e.g. \"nats://127.0.0.1:4222\""
                    ),
                });
            }
        }
        // The same server twice would be probed, tried and counted twice
        // (a reconnect rotation, the placement of the connections),
        // however it is spelt.
        let endpoints: Vec<_> = self.nats_urls.iter().map(|url| crate::cluster::names::nats_endpoint(url)).collect();
        for (at, url) in self.nats_urls.iter().enumerate() {
            if endpoints[..at].contains(&endpoints[at]) {
                return Err(SettingsError::Invalid {
                    key: "cluster.nats_urls",
                    value: url.clone(),
                    allowed: "each server once (the same host and port in two URLs)".into(),
                });
            }
        }
        Ok(())
    }

    /// The replica ID: `replica_id`, or else one made from `host_name`
    /// ([`replica_id_from_host`]).
    pub fn replica_id_or(&self, host_name: &str) -> String {
        if !self.replica_id.is_empty() {
            return self.replica_id.clone();
        }
        replica_id_from_host(host_name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_those_of_design_section_10() {
        let c = Cluster::default();
        c.validate().unwrap();
        assert_eq!(c.member_ttl, Duration::from_secs(10));
        assert_eq!(c.will_stop_grace, Duration::from_secs(30));
        assert_eq!(c.connect_budget, Duration::from_secs(20));
        assert_eq!(c.nats_replicas, 3);
        assert_eq!(c.mesh_buffer, 64 << 20);
    }

    #[test]
    fn the_mesh_buffer_has_a_range_named_with_its_key() {
        let c = Cluster { mesh_buffer: 1024, ..Cluster::default() };
        assert_eq!(c.validate().unwrap_err().to_string(), "cluster.mesh_buffer = 1KiB is out of range 4KiB..=64GiB");
        let c: Cluster = toml::from_str("mesh_buffer = \"64KiB\"").unwrap();
        assert_eq!(c.mesh_buffer, 64 << 10);
        c.validate().unwrap();
    }

    #[test]
    fn each_range_names_its_key() {
        let mut c = Cluster { nats_replicas: 2, ..Cluster::default() };
        assert_eq!(c.validate().unwrap_err().to_string(), "cluster.nats_replicas = 2 is out of range 1, 3 or 5");
        c.nats_replicas = 1;
        c.connect_budget = Duration::from_secs(121);
        assert!(c.validate().unwrap_err().to_string().starts_with("cluster.connect_budget = 2m 1s"));
        c.connect_budget = Duration::from_secs(20);
        c.replica_id = "a_b".into();
        assert!(c.validate().unwrap_err().to_string().contains("cluster.replica_id"));
        // The rules of `fleetmq cert --names`: a DNS name is fine.
        c.replica_id = "b.example.net".into();
        c.validate().unwrap();
    }

    #[test]
    fn mesh_addresses_that_cannot_be_bound_or_dialed_are_refused_naming_the_key() {
        for bad in [":::bad", "host", "host:0", "host:99999", "::1:7884", "[::1", "[zz]:1", "a_b:1", ":7884"] {
            let c = Cluster { mesh_advertise: bad.into(), ..Cluster::default() };
            let e = c.validate().unwrap_err().to_string();
            assert!(e.starts_with("cluster.mesh_advertise = ") && e.contains("e.g."), "{bad}: {e}");
        }
        for good in ["fleetmq-0.mesh:7884", "10.0.0.5:7884", "[::1]:7884", "localhost:1"] {
            Cluster { mesh_advertise: good.into(), ..Cluster::default() }.validate().unwrap();
        }
        for bad in ["127.0.0.1:99999", "localhost:7884", "7884", ""] {
            let c = Cluster { mesh_listen: bad.into(), ..Cluster::default() };
            assert!(c.validate().unwrap_err().to_string().starts_with("cluster.mesh_listen = "), "{bad}");
        }
        Cluster { mesh_listen: "[::]:0".into(), ..Cluster::default() }.validate().unwrap();
    }

    #[test]
    fn a_nats_url_async_nats_cannot_dial_is_refused_naming_the_key() {
        let c = Cluster { nats_urls: vec!["nats://a:4222".into(), "http://127.0.0.1:4222".into()], ..Cluster::default() };
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("cluster.nats_urls") && e.contains("http://127.0.0.1:4222") && e.contains("wss://"), "{e}");
        let c = Cluster { nats_urls: vec!["tls://a:4222".into(), "10.0.0.5:4222".into()], ..Cluster::default() };
        c.validate().unwrap();
    }

    #[test]
    fn an_empty_nats_url_list_is_refused_showing_the_list_as_written() {
        let expected = "cluster.nats_urls = [] is not valid: at least one NATS URL, e.g. [\"nats://127.0.0.1:4222\"]";
        let c = Cluster { nats_urls: Vec::new(), ..Cluster::default() };
        assert_eq!(c.validate().unwrap_err().to_string(), expected);
        let c: Cluster = toml::from_str("nats_urls = []").unwrap();
        assert_eq!(c.validate().unwrap_err().to_string(), expected);
    }

    #[test]
    fn a_nats_url_listed_twice_is_refused_naming_the_key() {
        for twice in ["nats://a:4222/", "NATS://a:4222", "a:4222", "tls://A"] {
            let c = Cluster { nats_urls: vec!["nats://a:4222".into(), "nats://b:4222".into(), twice.into()], ..Cluster::default() };
            let e = c.validate().unwrap_err().to_string();
            assert!(e.contains("cluster.nats_urls") && e.contains(twice) && e.contains("each server once"), "{e}");
        }
        let c = Cluster { nats_urls: vec!["nats://a:4222".into(), "nats://a:4223".into()], ..Cluster::default() };
        c.validate().unwrap();
    }

    #[test]
    fn the_replica_id_defaults_to_a_cleaned_host_name() {
        let c = Cluster::default();
        assert_eq!(c.replica_id_or("node-1.example.com"), "node-1-example-com");
        assert_eq!(c.replica_id_or(""), "fleetmq");
        let c = Cluster { replica_id: "r7".into(), ..Cluster::default() };
        assert_eq!(c.replica_id_or("host"), "r7");
    }
}
