//! Broker URLs: `mqtt://`, `mqtts://`, `ws://` and `wss://`
//! `HOST[:PORT][/PATH]`, parsed and resolved once when the options are read
//! (re-exported by [`crate::options`]).

use std::net::{SocketAddr, ToSocketAddrs};

use serde::Serialize;

/// How a broker URL is reached: plain TCP, TLS, WebSocket, or WebSocket
/// over TLS.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Scheme {
    /// `mqtt://` (alias `tcp://`): MQTT over TCP, default port 1883.
    Mqtt,
    /// `mqtts://` (aliases `ssl://`, `tls://`): MQTT over TLS, default port
    /// 8883.
    Mqtts,
    /// `ws://`: MQTT over WebSocket (binary messages, subprotocol `mqtt`),
    /// default port 80.
    Ws,
    /// `wss://`: MQTT over WebSocket over TLS, default port 443.
    Wss,
}

impl Scheme {
    /// The port used when the URL names none.
    pub fn default_port(self) -> u16 {
        match self {
            Scheme::Mqtt => 1883,
            Scheme::Mqtts => 8883,
            Scheme::Ws => 80,
            Scheme::Wss => 443,
        }
    }

    /// True for `mqtts://` and `wss://`.
    pub fn is_tls(self) -> bool {
        matches!(self, Scheme::Mqtts | Scheme::Wss)
    }

    /// True for `ws://` and `wss://`.
    pub fn is_websocket(self) -> bool {
        matches!(self, Scheme::Ws | Scheme::Wss)
    }

    fn parse(scheme: &str) -> Option<Scheme> {
        match scheme.to_ascii_lowercase().as_str() {
            "mqtt" | "tcp" => Some(Scheme::Mqtt),
            "mqtts" | "ssl" | "tls" => Some(Scheme::Mqtts),
            "ws" => Some(Scheme::Ws),
            "wss" => Some(Scheme::Wss),
            _ => None,
        }
    }
}

/// Parses a broker URL `SCHEME://HOST[:PORT][/PATH]`: schemes `mqtt://`,
/// `mqtts://`, `ws://` and `wss://` (default ports 1883, 8883, 80, 443);
/// HOST a name, an IPv4 address or a bracketed IPv6 address. Only
/// WebSocket URLs take a path (the HTTP path of the upgrade; without one,
/// `--ws-path` applies). The address is resolved once, here.
///
/// # Errors
/// A message quoting the URL: no or an unknown scheme, user info, a query
/// or fragment, a path on an MQTT URL, a bad port, or a host that does not
/// resolve.
pub fn parse_url(s: &str) -> Result<BrokerUrl, String> {
    const FORM: &str = "expected mqtt://, mqtts://, ws:// or wss://HOST[:PORT]";
    let Some((scheme_text, rest)) = s.split_once("://") else {
        return Err(format!("`{s}`: {FORM}"));
    };
    let scheme = Scheme::parse(scheme_text)
        .ok_or_else(|| format!("`{s}`: unknown scheme `{scheme_text}` ({FORM})"))?;
    if rest.contains(['?', '#']) {
        return Err(format!("`{s}`: a broker URL takes no query or fragment"));
    }
    let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    if authority.contains('@') {
        return Err(format!(
            "`{s}`: credentials go in --username and --password, not in the URL"
        ));
    }
    let path = (!path.is_empty() && path != "/").then(|| path.to_string());
    if path.is_some() && !scheme.is_websocket() {
        return Err(format!("`{s}`: only ws:// and wss:// URLs take a path"));
    }
    let bad_port = || format!("`{s}`: the port must be a number from 1 to 65535");
    let (host, port_text) = if let Some(inner) = authority.strip_prefix('[') {
        let (host, after) = inner
            .split_once(']')
            .ok_or_else(|| format!("`{s}`: unclosed `[` in an IPv6 address"))?;
        match after {
            "" => (host, None),
            _ => (host, Some(after.strip_prefix(':').ok_or_else(bad_port)?)),
        }
    } else {
        match authority.rsplit_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (authority, None),
        }
    };
    if host.is_empty() {
        return Err(format!("`{s}`: no host"));
    }
    let port = match port_text {
        None => scheme.default_port(),
        Some(p) => match p.parse::<u16>() {
            Ok(p) if p > 0 => p,
            _ => return Err(bad_port()),
        },
    };
    let addr = (host, port)
        .to_socket_addrs()
        .map_err(|e| format!("`{s}`: cannot resolve: {e}"))?
        .next()
        .ok_or_else(|| format!("`{s}`: resolves to no address"))?;
    Ok(BrokerUrl {
        text: s.to_string(),
        scheme,
        host: host.to_string(),
        port,
        path,
        addr,
    })
}

/// A broker address given with `--url`.
#[derive(Debug, Clone)]
pub struct BrokerUrl {
    /// As given on the command line.
    pub text: String,
    /// The transport.
    pub scheme: Scheme,
    /// The host as written, without IPv6 brackets: the TLS server name (a
    /// DNS name, or an IP address the certificate must list) and the
    /// WebSocket `Host`.
    pub host: String,
    /// The port, or the scheme's default.
    pub port: u16,
    /// WebSocket URLs: the upgrade's HTTP path when the URL has one (other
    /// than `/`); `None` means `--ws-path`.
    pub path: Option<String>,
    /// Resolved once at start.
    pub addr: SocketAddr,
}

impl BrokerUrl {
    /// The HTTP path of the WebSocket upgrade: the URL's, else `default`
    /// (`--ws-path`).
    pub fn ws_path<'a>(&'a self, default: &'a str) -> &'a str {
        self.path.as_deref().unwrap_or(default)
    }
}

impl Serialize for BrokerUrl {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_scheme_has_its_default_port() {
        for (url, scheme, port) in [
            ("mqtt://127.0.0.1", Scheme::Mqtt, 1883),
            ("tcp://127.0.0.1", Scheme::Mqtt, 1883),
            ("mqtts://127.0.0.1", Scheme::Mqtts, 8883),
            ("ssl://127.0.0.1", Scheme::Mqtts, 8883),
            ("ws://127.0.0.1", Scheme::Ws, 80),
            ("wss://127.0.0.1", Scheme::Wss, 443),
        ] {
            let u = parse_url(url).unwrap();
            assert_eq!(
                (u.scheme, u.port, u.addr.port()),
                (scheme, port, port),
                "{url}"
            );
            assert_eq!(u.host, "127.0.0.1");
            assert_eq!(u.path, None, "{url}");
        }
    }

    #[test]
    fn explicit_ports_override_the_default() {
        let u = parse_url("mqtts://localhost:18883").unwrap();
        assert_eq!(
            (u.scheme, u.host.as_str(), u.port),
            (Scheme::Mqtts, "localhost", 18883)
        );
        assert_eq!(u.addr.port(), 18883);
        assert_eq!(parse_url("WSS://127.0.0.1:9443/").unwrap().port, 9443);
    }

    #[test]
    fn ipv6_hosts_are_bracketed_and_stored_without_brackets() {
        let u = parse_url("mqtt://[::1]:1884").unwrap();
        assert_eq!((u.host.as_str(), u.port), ("::1", 1884));
        assert!(u.addr.is_ipv6());
        assert_eq!(parse_url("wss://[::1]").unwrap().port, 443);
        assert!(parse_url("mqtt://[::1").is_err());
        assert!(parse_url("mqtt://[::1]1884").is_err());
    }

    #[test]
    fn websocket_urls_keep_their_path_and_fall_back_to_ws_path() {
        let u = parse_url("ws://127.0.0.1:8080/custom/mqtt").unwrap();
        assert_eq!(u.path.as_deref(), Some("/custom/mqtt"));
        assert_eq!(u.ws_path("/mqtt"), "/custom/mqtt");
        let u = parse_url("wss://127.0.0.1/").unwrap();
        assert_eq!(u.path, None, "a bare / is no path");
        assert_eq!(u.ws_path("/mqtt"), "/mqtt");
    }

    #[test]
    fn bad_urls_are_refused_with_the_reason() {
        let err = |s: &str| parse_url(s).unwrap_err();
        assert!(err("127.0.0.1:1883").contains("expected mqtt://"));
        assert!(err("http://127.0.0.1").contains("unknown scheme `http`"));
        assert!(err("mqtt://127.0.0.1/topic").contains("only ws:// and wss://"));
        assert!(err("mqtts://127.0.0.1:8883/x").contains("only ws:// and wss://"));
        assert!(err("mqtt://127.0.0.1:port").contains("port"));
        assert!(err("mqtt://127.0.0.1:0").contains("port"));
        assert!(err("mqtt://127.0.0.1:70000").contains("port"));
        assert!(err("mqtt://user:pw@127.0.0.1").contains("--username"));
        assert!(err("ws://127.0.0.1/mqtt?x=1").contains("query"));
        assert!(err("mqtt://:1883").contains("no host"));
    }
}
