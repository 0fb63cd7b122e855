//! The names a replica is given (DESIGN.md §15): its replica ID and the
//! NATS URLs it dials. One set of rules serves `fleetmq check-config`, the
//! start and `fleetmq cert --names`, so a replica ID that starts is one a
//! mesh certificate can be made for, and the other way round.

use std::net::IpAddr;

/// The file stem `fleetmq cert` keeps for the mesh CA: no replica may be
/// named so.
pub const CA_STEM: &str = "ca";

/// Why a name cannot be a replica ID (or a DNS name in a certificate).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NameError {
    /// The name is empty.
    #[error("is empty")]
    Empty,
    /// Longer than a DNS name may be (253 bytes).
    #[error("is {0} bytes long; a DNS name has at most 253")]
    TooLong(usize),
    /// A dot-separated part is empty or longer than 63 bytes.
    #[error("has a label of {0} bytes; each dot-separated part has 1 to 63")]
    Label(usize),
    /// A character outside ASCII letters, digits, `-` and `.`.
    #[error("contains {0:?}; only ASCII letters, digits, '-' and '.' are allowed")]
    Char(char),
    /// A part starts or ends with `-`.
    #[error("has a part starting or ending with '-'")]
    Hyphen,
    /// An IP address, not a name.
    #[error("is an IP address; name replicas with DNS names")]
    IpAddress,
    /// `ca`, the mesh CA's file stem.
    #[error("is taken: ca.pem and ca.key are the CA's files")]
    Reserved,
}

/// Checks a DNS name: labels of 1 to 63 ASCII letters, digits and `-`,
/// not starting or ending with `-`, joined by `.`; 253 bytes at most.
///
/// # Errors
/// The first rule `name` breaks.
pub fn check_dns_name(name: &str) -> Result<(), NameError> {
    if name.is_empty() {
        return Err(NameError::Empty);
    }
    if name.len() > 253 {
        return Err(NameError::TooLong(name.len()));
    }
    for label in name.split('.') {
        if label.is_empty() || label.len() > 63 {
            return Err(NameError::Label(label.len()));
        }
        if let Some(c) = label
            .chars()
            .find(|c| !c.is_ascii_alphanumeric() && *c != '-')
        {
            return Err(NameError::Char(c));
        }
        if label.starts_with('-') || label.ends_with('-') {
            return Err(NameError::Hyphen);
        }
    }
    Ok(())
}

/// Checks a replica ID (`cluster.replica_id`, a `fleetmq cert --names`
/// entry): a DNS name ([`check_dns_name`]: the mesh certificate names the
/// replica), not an IP address, and not [`CA_STEM`]. Such a name is also a
/// valid KV key and NATS subject tokens.
///
/// # Errors
/// The first rule `id` breaks.
pub fn check_replica_id(id: &str) -> Result<(), NameError> {
    if id.parse::<IpAddr>().is_ok() {
        return Err(NameError::IpAddress);
    }
    check_dns_name(id)?;
    if id.eq_ignore_ascii_case(CA_STEM) {
        return Err(NameError::Reserved);
    }
    Ok(())
}

/// The replica ID made from a host name when `cluster.replica_id` is
/// empty: every character outside ASCII letters, digits and `-` becomes
/// `-`, leading and trailing `-` go, at most 63 bytes; `fleetmq` when
/// nothing (or `ca`) is left. Always passes [`check_replica_id`].
pub fn replica_id_from_host(host_name: &str) -> String {
    let id: String = host_name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '-'
            }
        })
        .take(63)
        .collect();
    let id = id.trim_matches('-');
    if check_replica_id(id).is_ok() {
        id.to_owned()
    } else {
        "fleetmq".to_owned()
    }
}

/// Checks a mesh address other replicas dial (`cluster.mesh_advertise`):
/// `host:port`, the host a DNS name ([`check_dns_name`]), an IPv4
/// address or an IPv6 address in brackets, the port 1 to 65535.
///
/// # Errors
/// Why not, in words.
pub fn check_mesh_address(addr: &str) -> Result<(), String> {
    let Some((host, port)) = addr.rsplit_once(':') else {
        return Err("no port".to_owned());
    };
    match port.parse::<u16>() {
        Ok(0) | Err(_) => return Err(format!("port {port:?} is not a number from 1 to 65535")),
        Ok(_) => {}
    }
    if let Some(v6) = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        return v6.parse::<std::net::Ipv6Addr>().map(drop).map_err(|_| format!("[{v6}] is not an IPv6 address"));
    }
    if host.contains(':') {
        return Err(format!("host {host:?}: an IPv6 address goes in brackets, e.g. [::1]:7884"));
    }
    if host.parse::<std::net::Ipv4Addr>().is_ok() {
        return Ok(());
    }
    check_dns_name(host).map_err(|e| format!("host {host:?} {e}"))
}

/// The longest workspace name, in bytes (UTF-8). A workspace name becomes
/// a NATS subject token and the stream name
/// `LOG_mqtt-sessions-<workspace token>` (DESIGN.md §4), in which every
/// byte outside ASCII letters, digits, `-` and `_` is written as `%XX`
/// ([`crate::cluster::ingest::workspace_token`]): at 64 bytes the stream
/// name has at most 18 + 3 × 64 = 210 bytes, within nats-server's 255
/// (`JSMaxNameLen`) and a file name's 255 (the stream's directory).
pub const WORKSPACE_MAX_BYTES: usize = 64;

const _: () = assert!(
    crate::cluster::session_log::STREAM_PREFIX.len() + 3 * WORKSPACE_MAX_BYTES <= 255,
    "a workspace's session log stream name must stay within nats-server's 255 bytes"
);

/// Why a name cannot be a workspace's.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WorkspaceError {
    /// The name is empty.
    #[error("is empty")]
    Empty,
    /// Longer than [`WORKSPACE_MAX_BYTES`].
    #[error("is {0} bytes long; a workspace name has at most 64 bytes")]
    TooLong(usize),
    /// A character a workspace name may not contain.
    #[error("contains {0:?}; a workspace name has no whitespace, control characters, '.', '*', '>', '/', '\\', '+' or '#'")]
    Char(char),
}

/// Checks a workspace name (a password file's third field, a JWT's
/// workspace claim): 1 to [`WORKSPACE_MAX_BYTES`] bytes of UTF-8 with no
/// whitespace, no control characters and none of `.` `*` `>` (NATS
/// subject and stream name syntax), `/` `\` (path separators: stream
/// names are directory names; `/` is also the MQTT topic level separator
/// the workspace prefix ends with) or `+` `#` (MQTT wildcards).
///
/// # Errors
/// The first rule `name` breaks.
pub fn check_workspace(name: &str) -> Result<(), WorkspaceError> {
    if name.is_empty() {
        return Err(WorkspaceError::Empty);
    }
    if name.len() > WORKSPACE_MAX_BYTES {
        return Err(WorkspaceError::TooLong(name.len()));
    }
    match name.chars().find(|c| c.is_whitespace() || c.is_control() || ".*>/\\+#".contains(*c)) {
        Some(c) => Err(WorkspaceError::Char(c)),
        None => Ok(()),
    }
}

/// The URL schemes async-nats dials: plain, TLS, WebSocket and secure
/// WebSocket.
pub const NATS_SCHEMES: [&str; 4] = ["nats", "tls", "ws", "wss"];

/// Checks a NATS URL: `scheme://host[:port]` with a scheme of
/// [`NATS_SCHEMES`], or a bare `host[:port]` (dialled as `nats://`),
/// parsed as async-nats parses it at the start (`ServerAddr::from_str`:
/// the WHATWG URL rules of the `url` crate), so a URL `fleetmq
/// check-config` passes is one the start takes (a port above 65535, say,
/// is refused by both). Port 0 parses but cannot be dialled: refused.
///
/// # Errors
/// Why not, in words.
pub fn check_nats_url(url: &str) -> Result<(), String> {
    let (scheme, rest) = match url.split_once("://") {
        Some((scheme, rest)) => {
            if !NATS_SCHEMES.iter().any(|s| s.eq_ignore_ascii_case(scheme)) {
                return Err(format!(
                    "scheme {scheme:?} is not one of nats, tls, ws, wss"
                ));
            }
            (scheme, rest)
        }
        None => ("nats", url),
    };
    let host = rest.rsplit('@').next().unwrap_or_default();
    if host.is_empty() || host.starts_with(':') || host.starts_with('/') {
        return Err("no host".to_owned());
    }
    if url.chars().any(char::is_whitespace) {
        return Err("contains white space".to_owned());
    }
    match url::Url::parse(&format!("{scheme}://{rest}")) {
        Ok(parsed) if parsed.port() == Some(0) => Err("port 0 cannot be dialled".to_owned()),
        Ok(parsed) if parsed.host_str().is_some_and(|h| !h.is_empty()) => Ok(()),
        Ok(_) => Err("no host".to_owned()),
        Err(e) => Err(e.to_string()),
    }
}

/// The endpoint a NATS URL of `cluster.nats_urls` dials: its host (lower
/// case) and port (4222 by default, 80 for `ws://`, 443 for `wss://`), so
/// that two spellings of one server compare equal (`NATS://h:4222`,
/// `h:4222`, `nats://user@h`). `None` for a URL [`check_nats_url`]
/// refuses.
pub fn nats_endpoint(url: &str) -> Option<(String, u16)> {
    check_nats_url(url).ok()?;
    let (scheme, rest) = url.split_once("://").unwrap_or(("nats", url));
    let scheme = scheme.to_ascii_lowercase();
    let parsed = url::Url::parse(&format!("{scheme}://{rest}")).ok()?;
    let port = parsed.port().unwrap_or(match scheme.as_str() {
        "ws" => 80,
        "wss" => 443,
        _ => 4222,
    });
    Some((parsed.host_str()?.to_ascii_lowercase(), port))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn spellings_of_one_nats_server_have_one_endpoint() {
        let one = nats_endpoint("nats://10.0.0.5:4222");
        for same in ["NATS://10.0.0.5:4222", "10.0.0.5:4222", "nats://10.0.0.5", "nats://u:p@10.0.0.5:4222/", "tls://10.0.0.5:4222"] {
            assert_eq!(nats_endpoint(same), one, "{same}");
        }
        assert_eq!(nats_endpoint("nats://Host.Example:4222"), Some(("host.example".to_owned(), 4222)));
        assert_eq!(nats_endpoint("ws://h"), Some(("h".to_owned(), 80)));
        assert_eq!(nats_endpoint("wss://h"), Some(("h".to_owned(), 443)));
        assert_ne!(nats_endpoint("nats://10.0.0.5:4223"), one);
        assert_eq!(nats_endpoint("http://h:1"), None);
    }

    #[test]
    fn workspace_names_are_1_to_64_bytes_without_subject_path_or_wildcard_characters() {
        for ok in ["acme", "default", "w1", "Plant_7-north", "bäckerei", "a:b", "$x", &"x".repeat(64)] {
            assert_eq!(check_workspace(ok), Ok(()), "{ok}");
        }
        assert_eq!(check_workspace(""), Err(WorkspaceError::Empty));
        assert_eq!(check_workspace(&"x".repeat(65)), Err(WorkspaceError::TooLong(65)));
        // 22 two-byte characters: 44 bytes, fine; 33: 66 bytes, too long.
        assert_eq!(check_workspace(&"ä".repeat(22)), Ok(()));
        assert_eq!(check_workspace(&"ä".repeat(33)), Err(WorkspaceError::TooLong(66)));
        for (bad, c) in [
            ("a.b", '.'),
            ("a*", '*'),
            ("a>", '>'),
            ("a/b", '/'),
            ("a\\b", '\\'),
            ("a+", '+'),
            ("#", '#'),
            ("a b", ' '),
            ("a\tb", '\t'),
            ("a\u{0}b", '\u{0}'),
            ("a\u{7f}", '\u{7f}'),
            ("a\u{a0}b", '\u{a0}'),
        ] {
            assert_eq!(check_workspace(bad), Err(WorkspaceError::Char(c)), "{bad:?}");
        }
        assert!(WorkspaceError::Char('/').to_string().contains("no whitespace"));
    }

    proptest! {
        #[test]
        fn every_workspace_name_that_passes_makes_a_stream_name_nats_takes(name in "\\PC{0,80}") {
            if check_workspace(&name).is_ok() {
                let stream = crate::cluster::session_log::stream(&name);
                prop_assert!(stream.len() <= 255, "{stream}");
                prop_assert!(!stream.contains(['.', '*', '>', '/', '\\']) && !stream.chars().any(char::is_whitespace), "{stream}");
                let subject = crate::cluster::session_log::subject(&name);
                prop_assert_eq!(subject.split('.').count(), 2, "one token: {}", subject);
            }
        }
    }

    #[test]
    fn replica_ids_are_dns_names_that_are_not_addresses_or_ca() {
        for ok in ["r1", "fleetmq-0", "b.example.net", "C3", &"x".repeat(63)] {
            assert_eq!(check_replica_id(ok), Ok(()), "{ok}");
        }
        assert_eq!(check_replica_id(""), Err(NameError::Empty));
        assert_eq!(check_replica_id("a_b"), Err(NameError::Char('_')));
        assert_eq!(check_replica_id("a b"), Err(NameError::Char(' ')));
        assert_eq!(check_replica_id("a/b"), Err(NameError::Char('/')));
        assert_eq!(check_replica_id("a..b"), Err(NameError::Label(0)));
        assert_eq!(check_replica_id("-a"), Err(NameError::Hyphen));
        assert_eq!(check_replica_id(&"x".repeat(64)), Err(NameError::Label(64)));
        assert_eq!(check_replica_id("10.0.0.1"), Err(NameError::IpAddress));
        assert_eq!(check_replica_id("::1"), Err(NameError::IpAddress));
        assert_eq!(check_replica_id("CA"), Err(NameError::Reserved));
    }

    #[test]
    fn a_host_name_becomes_a_valid_replica_id() {
        assert_eq!(
            replica_id_from_host("node-1.example.com"),
            "node-1-example-com"
        );
        assert_eq!(replica_id_from_host("_pod_7_"), "pod-7");
        assert_eq!(replica_id_from_host(""), "fleetmq");
        assert_eq!(replica_id_from_host("ca"), "fleetmq");
    }

    #[test]
    fn nats_urls_use_a_scheme_async_nats_dials() {
        for ok in [
            "nats://127.0.0.1:4222",
            "tls://nats.example:4222",
            "ws://h:8080",
            "WSS://h",
            "10.0.0.5:4222",
            "nats://u:p@h:1",
        ] {
            assert_eq!(check_nats_url(ok), Ok(()), "{ok}");
        }
        assert!(check_nats_url("http://127.0.0.1:4222")
            .unwrap_err()
            .contains("\"http\""));
        assert!(check_nats_url("https://h").is_err());
        assert!(check_nats_url("nats://").unwrap_err().contains("no host"));
        assert!(check_nats_url("").is_err());
        assert!(check_nats_url("nats://h :4222").is_err());
        // What async-nats refuses at the start (its `ServerAddr` parse).
        assert_eq!(
            check_nats_url("nats://127.0.0.1:99999"),
            Err("invalid port number".to_owned())
        );
        assert!(check_nats_url("127.0.0.1:65536").is_err());
        assert!(check_nats_url("nats://h:4222x").is_err());
        assert!(check_nats_url("nats://[::1:4222").is_err());
        assert_eq!(check_nats_url("nats://[::1]:4222"), Ok(()));
        // Parses, but nothing listens on port 0: the start would retry it forever.
        assert_eq!(check_nats_url("nats://h:0"), Err("port 0 cannot be dialled".to_owned()));
        assert!(check_nats_url("h:0").is_err());
    }

    proptest! {
        #[test]
        fn any_host_name_gives_a_replica_id_that_passes(host in ".{0,300}") {
            prop_assert_eq!(check_replica_id(&replica_id_from_host(&host)), Ok(()));
        }

        #[test]
        fn checking_any_string_answers_without_panicking(s in ".{0,300}") {
            let _ = check_replica_id(&s);
            let _ = check_nats_url(&s);
        }
    }
}
