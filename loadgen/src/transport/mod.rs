//! What a client connection runs over: TCP (`mqtt://`), TLS (`mqtts://`),
//! WebSocket (`ws://`) or WebSocket over TLS (`wss://`), for both client
//! flavours.
//!
//! - [`url`]: the broker URLs and their schemes.
//! - [`TransportArgs`]: the command-line options (`--ca-file`,
//!   `--insecure`, `--cert`/`--key`, `--ws-path`), loaded once per run into
//!   [`TransportOptions`] (the rustls client configuration and the default
//!   WebSocket path) before any connection opens, so a bad file is a usage
//!   error (exit 2).
//! - [`async_stream`]: the glommio stream of the fan-in/fan-out and
//!   connection scenarios. `mqtt://` stays a bare `glommio::net::TcpStream`
//!   in an enum: no allocation and no extra copy per message.
//! - [`sync_stream`]: the std stream of the checked flows (`persistent`,
//!   `shared`, `soak`).
//!
//! WebSocket follows MQTT 5 §6 / MQTT 3.1.1 §6: subprotocol `mqtt`, MQTT
//! packets carried in binary messages (a packet may span messages and a
//! message may hold several) [MQTT-6.0.0-1, MQTT-6.0.0-2]. TLS is rustls
//! with the ring provider (TLS 1.2 and 1.3), as in the broker.

pub mod async_stream;
pub mod sync_stream;
pub mod tls;
pub mod url;

use std::path::PathBuf;
use std::sync::Arc;

use clap::Args;
use serde::Serialize;

use self::url::BrokerUrl;
use crate::client::ClientError;

/// The WebSocket subprotocol every upgrade asks for [MQTT-6.0.0-3].
pub const WS_SUBPROTOCOL: &str = "mqtt";

/// TLS and WebSocket options of `run` and `soak`.
#[derive(Debug, Clone, Args, Serialize)]
pub struct TransportArgs {
    /// mqtts:// and wss://: trust the CA certificate(s) in this PEM file
    /// instead of the system bundle ($SSL_CERT_FILE, else
    /// /etc/ssl/certs/ca-certificates.crt or /etc/pki/tls/certs/ca-bundle.crt).
    #[arg(long, value_name = "PEM", conflicts_with = "insecure")]
    pub ca_file: Option<PathBuf>,
    /// mqtts:// and wss://: accept any broker certificate (self-signed test
    /// brokers). The handshake is still encrypted and its signatures
    /// checked; only who signed the certificate, and for which name, is not.
    #[arg(long)]
    pub insecure: bool,
    /// mqtts:// and wss://: client certificate chain (PEM) for mutual TLS;
    /// needs --key.
    #[arg(long, value_name = "PEM", requires = "key")]
    pub cert: Option<PathBuf>,
    /// The private key (PEM: PKCS#8, PKCS#1 or SEC1) of --cert.
    #[arg(long, value_name = "PEM", requires = "cert")]
    pub key: Option<PathBuf>,
    /// ws:// and wss://: HTTP path of the upgrade when the URL has none.
    #[arg(long, value_name = "PATH", default_value = "/mqtt")]
    pub ws_path: String,
}

/// [`TransportArgs`] loaded: what opening a connection needs besides the
/// URL. Cheap to clone (the TLS configuration is shared).
#[derive(Debug, Clone)]
pub struct TransportOptions {
    /// The rustls client configuration; `None` when no URL uses TLS and no
    /// TLS file was given.
    pub tls: Option<Arc<rustls::ClientConfig>>,
    /// The upgrade's HTTP path for WebSocket URLs without one, starting
    /// with `/`.
    pub ws_path: String,
}

impl Default for TransportOptions {
    /// Plain TCP only: no TLS configuration, WebSocket path `/mqtt`.
    fn default() -> TransportOptions {
        TransportOptions {
            tls: None,
            ws_path: "/mqtt".into(),
        }
    }
}

impl TransportArgs {
    /// Checks the options and loads the TLS files when some URL in `urls`
    /// uses TLS or a file option is given.
    ///
    /// # Errors
    /// A message naming the option: `--ws-path` not starting with `/`, a
    /// file that cannot be read or holds no certificate or key, a key not
    /// matching `--cert`, or a TLS URL with neither `--ca-file`,
    /// `--insecure` nor a system CA bundle.
    pub fn load(&self, urls: &[BrokerUrl]) -> Result<TransportOptions, String> {
        if !self.ws_path.starts_with('/') || self.ws_path.contains(['?', '#', ' ']) {
            return Err(format!(
                "--ws-path `{}`: expected an HTTP path such as /mqtt",
                self.ws_path
            ));
        }
        let wants_tls =
            urls.iter().any(|u| u.scheme.is_tls()) || self.ca_file.is_some() || self.cert.is_some();
        let tls = if wants_tls {
            Some(tls::client_config(self)?)
        } else {
            None
        };
        Ok(TransportOptions {
            tls,
            ws_path: self.ws_path.clone(),
        })
    }
}

/// The request of a WebSocket upgrade to `url`: `GET` on its path (or
/// `default_path`), `Host` from the URL, asking for subprotocol `mqtt`.
///
/// # Errors
/// [`ClientError::WebSocket`] when the URL does not make a valid request.
pub fn ws_request(
    url: &BrokerUrl,
    default_path: &str,
) -> Result<async_tungstenite::tungstenite::handshake::client::Request, ClientError> {
    use async_tungstenite::tungstenite::client::IntoClientRequest;
    use async_tungstenite::tungstenite::http::HeaderValue;
    let scheme = if url.scheme.is_tls() { "wss" } else { "ws" };
    let host = if url.host.contains(':') {
        format!("[{}]", url.host)
    } else {
        url.host.clone()
    };
    let uri = format!(
        "{scheme}://{host}:{}{}",
        url.port,
        url.ws_path(default_path)
    );
    let mut request = uri
        .as_str()
        .into_client_request()
        .map_err(|e| ClientError::WebSocket(format!("bad upgrade request {uri}: {e}")))?;
    request.headers_mut().insert(
        "sec-websocket-protocol",
        HeaderValue::from_static(WS_SUBPROTOCOL),
    );
    Ok(request)
}

/// The WebSocket limits of every client: messages and frames up to
/// [`crate::client::MAX_PACKET_BYTES`] (the largest packet accepted).
pub fn ws_config() -> async_tungstenite::tungstenite::protocol::WebSocketConfig {
    async_tungstenite::tungstenite::protocol::WebSocketConfig::default()
        .max_message_size(Some(crate::client::MAX_PACKET_BYTES))
        .max_frame_size(Some(crate::client::MAX_PACKET_BYTES))
}

/// A failed upgrade as a [`ClientError::WebSocket`], naming the HTTP
/// status when the broker answered with one.
pub fn ws_error(e: async_tungstenite::tungstenite::Error) -> ClientError {
    use async_tungstenite::tungstenite::Error;
    match e {
        Error::Http(response) => {
            ClientError::WebSocket(format!("upgrade refused with HTTP {}", response.status()))
        }
        Error::Io(e) => tls::classify_io(e),
        other => ClientError::WebSocket(other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::url::parse_url;
    use super::*;

    fn args() -> TransportArgs {
        TransportArgs {
            ca_file: None,
            insecure: false,
            cert: None,
            key: None,
            ws_path: "/mqtt".into(),
        }
    }

    #[test]
    fn plain_urls_need_no_tls_configuration() {
        let urls = [parse_url("mqtt://127.0.0.1:1").unwrap()];
        let t = args().load(&urls).unwrap();
        assert!(t.tls.is_none());
        assert_eq!(t.ws_path, "/mqtt");
    }

    #[test]
    fn insecure_tls_urls_load_without_a_ca_file() {
        let urls = [parse_url("mqtts://127.0.0.1:1").unwrap()];
        let t = TransportArgs {
            insecure: true,
            ..args()
        };
        assert!(t.load(&urls).unwrap().tls.is_some());
    }

    #[test]
    fn a_missing_ca_file_is_named() {
        let urls = [parse_url("wss://127.0.0.1:1").unwrap()];
        let t = TransportArgs {
            ca_file: Some("/nonexistent/ca.pem".into()),
            ..args()
        };
        let e = t.load(&urls).unwrap_err();
        assert!(e.contains("--ca-file /nonexistent/ca.pem"), "{e}");
    }

    #[test]
    fn ws_paths_must_be_http_paths() {
        let t = TransportArgs {
            ws_path: "mqtt".into(),
            ..args()
        };
        assert!(t.load(&[]).unwrap_err().contains("--ws-path"));
    }

    #[test]
    fn upgrade_requests_ask_for_the_mqtt_subprotocol_on_the_url_path() {
        let url = parse_url("ws://127.0.0.1:8080/custom").unwrap();
        let r = ws_request(&url, "/mqtt").unwrap();
        assert_eq!(r.uri().path(), "/custom");
        assert_eq!(r.headers()["sec-websocket-protocol"], "mqtt");
        let url = parse_url("wss://[::1]").unwrap();
        let r = ws_request(&url, "/mqtt").unwrap();
        assert_eq!(r.uri().to_string(), "wss://[::1]:443/mqtt");
    }
}
