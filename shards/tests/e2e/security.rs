//! Sign-in, access control and the encrypted and WebSocket transports
//! (DESIGN.md §9, §11, §15; issue 5), end to end against the real binary:
//! TLS with certificates made here by rcgen (server, mutual, reload, the
//! certificate's name as user name), WebSocket and WSS with tungstenite's
//! blocking client, the password file written by `fleetmq passwd`, JWTs
//! signed here, the ACL file with `%u`/`%c` and its reload, and workspaces.
//!
//! The first part is the kit the tests (and `limits.rs`) share: temporary
//! files, a certificate authority, CONNECT with credentials, and a blocking
//! MQTT client over any transport.

use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{mpsc, Arc};
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

// tungstenite's blocking client, as re-exported by async-tungstenite (the
// version the broker itself uses).
use async_tungstenite::tungstenite::{self, client::IntoClientRequest, Message, WebSocket};
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{ClientConfig, ClientConnection, RootCertStore, StreamOwned};

use crate::clients::{unique, WAIT};
use crate::harness::{run_with_timeout, wait_timeout, Broker};
use crate::mqtt5::packet::{self, ConnAck, Props, Publish};
use crate::mqtt5::{metric_with, Client, QUIET};
use crate::raw::{split_packet, wire, Incoming};

// ---------------------------------------------------------------------------
// The kit.
// ---------------------------------------------------------------------------

/// A temporary folder, removed when dropped.
pub(crate) struct TempDir(PathBuf);

impl TempDir {
    /// A new empty folder named after `name` and this process.
    pub(crate) fn new(name: &str) -> TempDir {
        let dir = std::env::temp_dir().join(unique(&format!("fleetmq-e2e-{name}")));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create a temporary folder");
        TempDir(dir)
    }

    /// The folder itself.
    pub(crate) fn root(&self) -> &Path {
        &self.0
    }

    /// The path of `name` in the folder.
    pub(crate) fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }

    /// Writes `text` to `name` by rename, as certificate and configuration
    /// tools do (no reader sees half a file); returns the path.
    pub(crate) fn put(&self, name: &str, text: impl AsRef<[u8]>) -> String {
        let path = self.path(name);
        let tmp = self.path(&format!(".{name}.tmp"));
        std::fs::write(&tmp, text).expect("write a temporary file");
        std::fs::rename(&tmp, &path).expect("rename a temporary file");
        path.display().to_string()
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `--set KEY="VALUE"` as two arguments, the value quoted as a TOML string
/// (paths are not TOML literals otherwise).
pub(crate) fn set_str(args: &mut Vec<String>, key: &str, value: &str) {
    args.push("--set".into());
    args.push(format!("{key}={value:?}"));
}

/// `--set KEY=VALUE` as two arguments, the value as given (`true`, `3`,
/// `1s`, `["127.0.0.1:0"]`).
pub(crate) fn set(args: &mut Vec<String>, key: &str, value: &str) {
    args.push("--set".into());
    args.push(format!("{key}={value}"));
}

/// Starts the broker with owned arguments.
pub(crate) fn start(args: &[String]) -> Broker {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    Broker::start(&args)
}

/// `fleetmq passwd FILE USER --password-stdin [--workspace W]`, the real
/// binary; returns what it printed on standard error.
///
/// # Panics
///
/// It does not exit 0 within 20 s.
pub(crate) fn passwd(file: &Path, user: &str, password: &str, workspace: Option<&str>) -> String {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_fleetmq"));
    cmd.arg("passwd")
        .arg(file)
        .arg(user)
        .arg("--password-stdin");
    if let Some(w) = workspace {
        cmd.args(["--workspace", w]);
    }
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("fleetmq passwd starts");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(format!("{password}\n").as_bytes())
        .unwrap();
    let status = wait_timeout(&mut child, Duration::from_secs(20)).expect("fleetmq passwd ends");
    let mut err = String::new();
    let _ = child.stderr.take().unwrap().read_to_string(&mut err);
    assert!(status.success(), "fleetmq passwd {user}: {status:?}\n{err}");
    err
}

/// `fleetmq passwd FILE USER --delete`.
pub(crate) fn passwd_delete(file: &Path, user: &str) {
    let out = run_with_timeout(
        Command::new(env!("CARGO_BIN_EXE_fleetmq"))
            .arg("passwd")
            .arg(file)
            .arg(user)
            .arg("--delete"),
        Duration::from_secs(20),
    );
    assert!(
        out.status.success(),
        "fleetmq passwd --delete {user}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A CONNECT with the fields sign-in needs: user name, password, will.
#[derive(Clone, Copy)]
pub(crate) struct Login<'a> {
    pub(crate) v5: bool,
    pub(crate) client_id: &'a str,
    pub(crate) username: Option<&'a str>,
    pub(crate) password: Option<&'a [u8]>,
    /// Topic, payload and Will Retain; the will is sent at QoS 1.
    pub(crate) will: Option<(&'a str, &'a [u8], bool)>,
}

impl<'a> Login<'a> {
    /// MQTT 5, clean start, no credentials.
    pub(crate) fn v5(client_id: &'a str) -> Self {
        Login {
            v5: true,
            client_id,
            username: None,
            password: None,
            will: None,
        }
    }

    /// MQTT 3.1.1, clean session, no credentials.
    pub(crate) fn v311(client_id: &'a str) -> Self {
        Login {
            v5: false,
            ..Login::v5(client_id)
        }
    }

    /// With user name and password.
    pub(crate) fn user(self, username: &'a str, password: &'a str) -> Self {
        Login {
            username: Some(username),
            password: Some(password.as_bytes()),
            ..self
        }
    }

    /// The encoded CONNECT (MQTT 5 §3.1, MQTT 3.1.1 §3.1), keep alive 60 s.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut body = wire::string(b"MQTT");
        body.push(if self.v5 { 5 } else { 4 });
        let mut flags = 0x02;
        if self.username.is_some() {
            flags |= 0x80;
        }
        if self.password.is_some() {
            flags |= 0x40;
        }
        if let Some((_, _, retain)) = self.will {
            flags |= 0x04 | 0x08 | if retain { 0x20 } else { 0 };
        }
        body.push(flags);
        body.extend(60u16.to_be_bytes());
        if self.v5 {
            body.push(0);
        }
        body.extend(wire::string(self.client_id.as_bytes()));
        if let Some((topic, payload, _)) = self.will {
            if self.v5 {
                body.push(0);
            }
            body.extend(wire::string(topic.as_bytes()));
            body.extend(wire::string(payload));
        }
        if let Some(user) = self.username {
            body.extend(wire::string(user.as_bytes()));
        }
        if let Some(password) = self.password {
            body.extend(wire::string(password));
        }
        wire::packet(0x10, &body)
    }

    /// Connects over TCP and reads the CONNACK, whatever its reason code.
    pub(crate) fn open(&self, addr: SocketAddr) -> Client {
        Client::open(addr, &self.encode(), self.v5)
    }

    /// The CONNACK reason code (3.1.1: return code) the broker answers.
    pub(crate) fn reason(&self, addr: SocketAddr) -> u8 {
        self.open(addr).connack.reason
    }

    /// Connects over TCP from the local address `source` and reads the
    /// CONNACK, whatever its reason code.
    pub(crate) fn open_from(&self, addr: SocketAddr, source: std::net::IpAddr) -> Client {
        Client::open_from(addr, source, &self.encode(), self.v5)
    }

    /// The CONNACK reason code for this CONNECT sent from `source`.
    pub(crate) fn reason_from(&self, addr: SocketAddr, source: std::net::IpAddr) -> u8 {
        self.open_from(addr, source).connack.reason
    }

    /// Connects over TCP and asserts the CONNACK accepts.
    pub(crate) fn accepted(&self, addr: SocketAddr) -> Client {
        let client = self.open(addr);
        assert_eq!(
            client.connack.reason, 0,
            "CONNACK for {:?}: {:?}",
            self.client_id, client.connack
        );
        client
    }
}

/// A certificate authority made for one test.
pub(crate) struct Ca {
    cert: rcgen::Certificate,
    key: KeyPair,
}

impl Ca {
    /// A self-signed CA named `name`.
    pub(crate) fn new(name: &str) -> Ca {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.distinguished_name.push(DnType::CommonName, name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let key = KeyPair::generate().unwrap();
        let cert = params.self_signed(&key).unwrap();
        Ca { cert, key }
    }

    /// The CA certificate, PEM.
    pub(crate) fn pem(&self) -> String {
        self.cert.pem()
    }

    /// A certificate for subject CN `cn` and `sans` (IP addresses become IP
    /// SANs), signed by this CA: (certificate PEM, key PEM).
    pub(crate) fn issue(&self, cn: &str, sans: &[&str]) -> (String, String) {
        let sans: Vec<String> = sans.iter().map(|s| s.to_string()).collect();
        let mut params = CertificateParams::new(sans).unwrap();
        params.distinguished_name = rcgen::DistinguishedName::new();
        params.distinguished_name.push(DnType::CommonName, cn);
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.cert, &self.key).unwrap();
        (cert.pem(), key.serialize_pem())
    }

    /// A server certificate for `127.0.0.1` and `localhost`.
    pub(crate) fn server(&self, cn: &str) -> (String, String) {
        self.issue(cn, &["127.0.0.1", "localhost"])
    }
}

/// The DER of the first certificate in `pem`.
fn der_of(pem: &str) -> Vec<u8> {
    CertificateDer::pem_slice_iter(pem.as_bytes())
        .next()
        .unwrap()
        .unwrap()
        .to_vec()
}

/// A rustls client configuration trusting `ca` only, offering
/// `client_cert` (certificate PEM, key PEM) when given, with `versions`
/// (empty: TLS 1.2 and 1.3).
pub(crate) fn client_config(
    ca: &Ca,
    client_cert: Option<&(String, String)>,
    versions: &[&'static rustls::SupportedProtocolVersion],
) -> Arc<ClientConfig> {
    let mut roots = RootCertStore::empty();
    roots.add(ca.cert.der().clone()).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ClientConfig::builder_with_provider(provider);
    let builder = if versions.is_empty() {
        builder.with_safe_default_protocol_versions()
    } else {
        builder.with_protocol_versions(versions)
    }
    .unwrap()
    .with_root_certificates(roots);
    let config = match client_cert {
        None => builder.with_no_client_auth(),
        Some((cert, key)) => {
            let chain = CertificateDer::pem_slice_iter(cert.as_bytes())
                .collect::<Result<Vec<_>, _>>()
                .unwrap();
            let key = PrivateKeyDer::from_pem_slice(key.as_bytes()).unwrap();
            builder.with_client_auth_cert(chain, key).unwrap()
        }
    };
    Arc::new(config)
}

/// A TLS client stream over TCP.
pub(crate) type Tls = StreamOwned<ClientConnection, TcpStream>;

/// Opens TCP to `addr` and starts TLS for server name `127.0.0.1` with
/// `config`; the handshake runs on first use. Reads time out after 5 s
/// unless changed.
pub(crate) fn tls_stream(addr: SocketAddr, config: Arc<ClientConfig>) -> Tls {
    let tcp = TcpStream::connect(addr).expect("TCP connect");
    tcp.set_nodelay(true).unwrap();
    tcp.set_read_timeout(Some(WAIT)).unwrap();
    let name = ServerName::try_from("127.0.0.1").unwrap();
    StreamOwned::new(ClientConnection::new(config, name).unwrap(), tcp)
}

/// Completes the TLS handshake; the error when it fails.
pub(crate) fn handshake(stream: &mut Tls) -> Result<(), String> {
    while stream.conn.is_handshaking() {
        stream
            .conn
            .complete_io(&mut stream.sock)
            .map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// A byte stream the tests read with timeouts: TCP or TLS.
pub(crate) trait Socket: Read + Write {
    /// The TCP stream underneath, for timeouts.
    fn tcp(&self) -> &TcpStream;
}

impl Socket for TcpStream {
    fn tcp(&self) -> &TcpStream {
        self
    }
}

impl Socket for Tls {
    fn tcp(&self) -> &TcpStream {
        &self.sock
    }
}

/// What one read of a [`Wire`] saw.
pub(crate) enum Chunk {
    Data(Vec<u8>),
    Closed,
    TimedOut,
}

/// How MQTT bytes travel: directly on a [`Socket`], or in WebSocket
/// binary messages.
pub(crate) trait Wire {
    /// Writes `bytes` (as one WebSocket message); errors show on the next
    /// read.
    fn send(&mut self, bytes: &[u8]) {
        let _ = self.try_send(bytes);
    }
    /// Writes `bytes` (as one WebSocket message) and flushes; the error
    /// when a write fails (the broker reset the connection, say).
    fn try_send(&mut self, bytes: &[u8]) -> std::io::Result<()>;
    /// The next bytes, waiting at most `timeout`.
    fn receive(&mut self, timeout: Duration) -> Chunk;
}

/// MQTT bytes directly on a socket.
pub(crate) struct Direct<S>(pub(crate) S);

impl<S: Socket> Wire for Direct<S> {
    fn try_send(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.0.write_all(bytes)?;
        self.0.flush()
    }

    fn receive(&mut self, timeout: Duration) -> Chunk {
        let _ = self
            .0
            .tcp()
            .set_read_timeout(Some(timeout.max(Duration::from_millis(1))));
        let mut buf = [0u8; 16 * 1024];
        match self.0.read(&mut buf) {
            Ok(0) => Chunk::Closed,
            Ok(n) => Chunk::Data(buf[..n].to_vec()),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                Chunk::TimedOut
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => Chunk::TimedOut,
            Err(_) => Chunk::Closed,
        }
    }
}

/// MQTT bytes in WebSocket binary messages [MQTT-6.0.0-1].
pub(crate) struct Ws<S>(pub(crate) WebSocket<S>);

impl<S: Socket> Wire for Ws<S> {
    fn try_send(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.0
            .send(Message::binary(bytes.to_vec()))
            .map_err(|e| match e {
                tungstenite::Error::Io(e) => e,
                other => std::io::Error::other(other),
            })
    }

    fn receive(&mut self, timeout: Duration) -> Chunk {
        let _ = self
            .0
            .get_ref()
            .tcp()
            .set_read_timeout(Some(timeout.max(Duration::from_millis(1))));
        let deadline = Instant::now() + timeout;
        loop {
            match self.0.read() {
                Ok(Message::Binary(data)) => return Chunk::Data(data.to_vec()),
                Ok(Message::Close(_)) => return Chunk::Closed,
                Ok(Message::Text(text)) => panic!("a text WebSocket message: {text:?}"),
                Ok(_) if Instant::now() < deadline => {}
                Ok(_) => return Chunk::TimedOut,
                Err(tungstenite::Error::Io(e))
                    if matches!(
                        e.kind(),
                        ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted
                    ) =>
                {
                    return Chunk::TimedOut
                }
                Err(_) => return Chunk::Closed,
            }
        }
    }
}

/// The WebSocket upgrade request for `addr` and `path`, offering
/// `subprotocol` when given.
fn ws_request(
    scheme: &str,
    addr: SocketAddr,
    path: &str,
    subprotocol: Option<&str>,
) -> tungstenite::handshake::client::Request {
    let mut request = format!("{scheme}://{addr}{path}")
        .into_client_request()
        .unwrap();
    if let Some(p) = subprotocol {
        request
            .headers_mut()
            .insert("Sec-WebSocket-Protocol", p.parse().unwrap());
    }
    request
}

/// The WebSocket client handshake on `stream`: the socket, or the HTTP
/// status of a refusal.
fn ws_upgrade<S: Socket>(
    stream: S,
    request: tungstenite::handshake::client::Request,
) -> Result<WebSocket<S>, u16> {
    match tungstenite::client(request, stream) {
        Ok((ws, response)) => {
            assert_eq!(
                response
                    .headers()
                    .get("sec-websocket-protocol")
                    .and_then(|v| v.to_str().ok()),
                Some("mqtt"),
                "the broker echoes the mqtt subprotocol [MQTT-6.0.0-3]"
            );
            Ok(ws)
        }
        Err(tungstenite::HandshakeError::Failure(tungstenite::Error::Http(response))) => {
            Err(response.status().as_u16())
        }
        Err(e) => panic!("WebSocket handshake: {e}"),
    }
}

/// A WebSocket connection to the `mqtt-ws` listener, path `/mqtt`,
/// subprotocol `mqtt`.
pub(crate) fn ws_connect(broker: &Broker) -> Ws<TcpStream> {
    let addr = broker.listener("mqtt-ws");
    let tcp = TcpStream::connect(addr).unwrap();
    tcp.set_nodelay(true).unwrap();
    tcp.set_read_timeout(Some(WAIT)).unwrap();
    Ws(ws_upgrade(tcp, ws_request("ws", addr, "/mqtt", Some("mqtt"))).expect("upgrade"))
}

/// A blocking MQTT client over any [`Wire`]: just what the transport tests
/// need.
pub(crate) struct Mqtt<W> {
    pub(crate) wire: W,
    v5: bool,
    buf: Vec<u8>,
    next_id: u16,
}


impl<W: Wire> Mqtt<W> {
    /// A client on `wire` speaking MQTT 5 when `v5`, else 3.1.1.
    pub(crate) fn new(wire: W, v5: bool) -> Self {
        Mqtt {
            wire,
            v5,
            buf: Vec::new(),
            next_id: 1,
        }
    }

    /// Writes `bytes`.
    pub(crate) fn send(&mut self, bytes: &[u8]) {
        self.wire.send(bytes);
    }

    /// The next whole packet within `timeout`.
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
            match self.wire.receive(left) {
                Chunk::Data(data) => self.buf.extend(data),
                Chunk::Closed => return Incoming::Closed,
                Chunk::TimedOut => {}
            }
        }
    }

    /// Sends `connect` and returns the CONNACK, or `None` when the broker
    /// closes (or the transport fails) without one.
    pub(crate) fn connect(&mut self, connect: &[u8]) -> Option<ConnAck> {
        self.send(connect);
        match self.read(WAIT) {
            Incoming::Packet { header: 0x20, body } => Some(ConnAck::parse(&body)),
            Incoming::Closed => None,
            other => panic!("expected CONNACK or a close, got {other:02x?}"),
        }
    }

    /// Connects as `client_id` without credentials and asserts success.
    pub(crate) fn connect_ok(&mut self, client_id: &str) {
        let login = if self.v5 {
            Login::v5(client_id)
        } else {
            Login::v311(client_id)
        };
        let connack = self.connect(&login.encode()).expect("a CONNACK");
        assert_eq!(connack.reason, 0, "{connack:?}");
    }

    /// The SUBSCRIBE packet for `filter` at `qos`, with a new packet id.
    pub(crate) fn subscribe_packet(&mut self, filter: &str, qos: u8) -> (u16, Vec<u8>) {
        let id = self.next_id;
        self.next_id += 1;
        let props = Props::new();
        let packet = packet::subscribe(id, &[(filter, qos)], self.v5.then_some(&props));
        (id, packet)
    }

    /// Waits for the SUBACK of packet `id` and returns its reason codes.
    pub(crate) fn suback(&mut self, id: u16) -> Vec<u8> {
        loop {
            match self.read(WAIT) {
                Incoming::Packet { header: 0x90, body } => {
                    assert_eq!(&body[..2], &id.to_be_bytes(), "SUBACK packet id");
                    let at = if self.v5 {
                        2 + Props::decode(&body[2..]).1
                    } else {
                        2
                    };
                    return body[at..].to_vec();
                }
                Incoming::Packet { .. } => {}
                other => panic!("expected SUBACK, got {other:02x?}"),
            }
        }
    }

    /// Subscribes to `filter` at `qos` and asserts it was granted.
    pub(crate) fn subscribe(&mut self, filter: &str, qos: u8) {
        let (id, packet) = self.subscribe_packet(filter, qos);
        self.send(&packet);
        assert_eq!(self.suback(id), vec![qos], "SUBACK for {filter}");
    }

    /// Publishes at QoS 0.
    pub(crate) fn publish(&mut self, topic: &str, payload: &[u8]) {
        let props = Props::new();
        let packet = packet::publish(topic, 0, false, 0, self.v5.then_some(&props), payload);
        self.send(&packet);
    }

    /// The next PUBLISH within `timeout` (other packets are skipped; QoS 1
    /// is acknowledged).
    pub(crate) fn next_publish(&mut self, timeout: Duration) -> Option<Publish> {
        let deadline = Instant::now() + timeout;
        loop {
            match self.read(deadline.saturating_duration_since(Instant::now())) {
                Incoming::Packet { header, body } if header & 0xF0 == 0x30 => {
                    let publish = Publish::parse(header, &body, self.v5);
                    if publish.qos == 1 {
                        self.send(&packet::ack(0x40, publish.packet_id));
                    }
                    return Some(publish);
                }
                Incoming::Packet { .. } => {}
                Incoming::TimedOut => return None,
                Incoming::Closed => panic!("closed while waiting for a PUBLISH"),
            }
        }
    }

    /// The next PUBLISH, which must come within [`WAIT`].
    pub(crate) fn expect_publish(&mut self) -> Publish {
        self.next_publish(WAIT)
            .unwrap_or_else(|| panic!("no PUBLISH within {WAIT:?}"))
    }
}

/// A v5 TCP subscriber on `filter` (QoS 1), for watching what a transport
/// delivers.
fn tcp_subscriber(broker: &Broker, filter: &str) -> Client {
    let mut c = Client::v5(broker.mqtt, &unique("tcp-sub"), true, Props::new());
    c.subscribe(filter, 1);
    c
}

/// Seconds since the Unix epoch.
pub(crate) fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// `fleetmq_connect_refused_total{reason="REASON"}`.
pub(crate) fn refused(broker: &Broker, reason: &str) -> f64 {
    metric_with(
        broker,
        "fleetmq_connect_refused_total",
        &format!("reason=\"{reason}\""),
    )
}

/// Asserts that `fleetmq_connect_refused_total{reason="REASON"}` is
/// `expected`, waiting up to 2 s: the broker counts a refusal right after
/// writing its CONNACK or closing, so the client may see it first.
pub(crate) fn assert_refused(broker: &Broker, reason: &str, expected: f64) {
    let deadline = Instant::now() + Duration::from_secs(2);
    let mut now = refused(broker, reason);
    while now != expected && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(20));
        now = refused(broker, reason);
    }
    assert_eq!(
        now, expected,
        "fleetmq_connect_refused_total{{reason=\"{reason}\"}}"
    );
}

// ---------------------------------------------------------------------------
// TLS (DESIGN.md §11).
// ---------------------------------------------------------------------------

/// A broker with a `tls` listener serving `cert` and the extra settings
/// `extra`; the temporary folder holds server.pem and server.key.
pub(crate) fn tls_broker(dir: &TempDir, cert: &(String, String), extra: &[String]) -> Broker {
    let mut args = Vec::new();
    set(&mut args, "listeners.tls", r#"["127.0.0.1:0"]"#);
    set_str(&mut args, "tls.cert", &dir.put("server.pem", &cert.0));
    set_str(&mut args, "tls.key", &dir.put("server.key", &cert.1));
    args.extend_from_slice(extra);
    start(&args)
}

/// A line-buffered `mosquitto_sub -d` over TLS whose output lines arrive on
/// the channel; killed when the handle drops.
struct TlsSub {
    child: std::process::Child,
    lines: mpsc::Receiver<String>,
}

impl TlsSub {
    fn start(port: u16, cafile: &str, topic: &str) -> TlsSub {
        let port = port.to_string();
        let mut child = Command::new("stdbuf")
            .args(["-oL", "mosquitto_sub", "-d", "-h", "127.0.0.1", "-p", &port])
            .args([
                "--cafile",
                cafile,
                "-t",
                topic,
                "-q",
                "1",
                "-F",
                "MSG %t %p",
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("mosquitto_sub starts");
        let (tx, lines) = mpsc::channel();
        let out = child.stdout.take().unwrap();
        thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        TlsSub { child, lines }
    }

    /// The first line containing `needle` within [`WAIT`].
    fn line_with(&self, needle: &str) -> Option<String> {
        let deadline = Instant::now() + WAIT;
        loop {
            match self
                .lines
                .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            {
                Ok(line) if line.contains(needle) => return Some(line),
                Ok(_) => {}
                Err(_) => return None,
            }
        }
    }
}

impl Drop for TlsSub {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// mosquitto_sub and mosquitto_pub with `--cafile` (OpenSSL checking the
/// broker's certificate and its IP SAN) through the tls listener.
#[test]
fn mosquitto_clients_trusting_the_ca_publish_and_subscribe_through_the_tls_listener() {
    let dir = TempDir::new("tls-mosquitto");
    let ca = Ca::new("e2e CA");
    let broker = tls_broker(&dir, &ca.server("broker"), &[]);
    let cafile = dir.put("ca.pem", ca.pem());
    let port = broker.listener("mqtt-tls").port();
    let topic = unique("tls/mosquitto");
    let sub = TlsSub::start(port, &cafile, &topic);
    assert!(
        sub.line_with("received SUBACK").is_some(),
        "mosquitto_sub subscribed over TLS"
    );
    let out = run_with_timeout(
        Command::new("mosquitto_pub")
            .args([
                "-h",
                "127.0.0.1",
                "-p",
                &port.to_string(),
                "--cafile",
                &cafile,
            ])
            .args(["-t", &topic, "-q", "1", "-m", "over-tls"]),
        WAIT,
    );
    assert!(
        out.status.success(),
        "mosquitto_pub over TLS: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        sub.line_with("MSG ").as_deref(),
        Some(format!("MSG {topic} over-tls").as_str())
    );
    // A client that trusts another CA does not get through.
    let stranger = Ca::new("other CA");
    let strange_ca = dir.put("other.pem", stranger.pem());
    let out = run_with_timeout(
        Command::new("mosquitto_pub")
            .args([
                "-h",
                "127.0.0.1",
                "-p",
                &port.to_string(),
                "--cafile",
                &strange_ca,
            ])
            .args(["-t", &topic, "-m", "x"]),
        WAIT,
    );
    assert!(
        !out.status.success(),
        "an untrusted server certificate fails"
    );
}

/// TLS 1.2 and 1.3 both complete with a rustls client, and the MQTT session
/// on top delivers to and from TCP clients.
#[test]
fn tls_1_2_and_1_3_clients_connect_and_exchange_messages_with_tcp_clients() {
    let dir = TempDir::new("tls-versions");
    let ca = Ca::new("e2e CA");
    let broker = tls_broker(&dir, &ca.server("broker"), &["--shards".into(), "2".into()]);
    let addr = broker.listener("mqtt-tls");
    for version in [&rustls::version::TLS12, &rustls::version::TLS13] {
        let mut stream = tls_stream(addr, client_config(&ca, None, &[version]));
        handshake(&mut stream).expect("handshake");
        assert_eq!(
            stream.conn.protocol_version(),
            Some(version.version),
            "negotiated version"
        );
        let mut tls = Mqtt::new(Direct(stream), true);
        tls.connect_ok(&unique("tls"));
        let topic = unique("tls/in");
        tls.subscribe(&topic, 0);
        let mut tcp = tcp_subscriber(&broker, &format!("{topic}/out"));
        let mut publisher = Client::v5(broker.mqtt, &unique("tcp-pub"), true, Props::new());
        publisher.publish(&topic, 1, false, Props::new(), b"to-tls");
        let got = tls.expect_publish();
        assert_eq!(
            (got.topic.as_str(), got.text().as_str()),
            (topic.as_str(), "to-tls")
        );
        tls.publish(&format!("{topic}/out"), b"from-tls");
        assert_eq!(tcp.expect_publish().text(), "from-tls", "{version:?}");
    }
}

/// Mutual TLS: with `tls.client_ca` and `require_client_cert`, a client
/// certificate signed by the client CA is accepted; none, or one signed by
/// another CA, ends in the handshake (no CONNACK), counted as
/// `handshake_failed`.
#[test]
fn mutual_tls_accepts_a_client_certificate_from_the_client_ca_and_refuses_the_rest() {
    let dir = TempDir::new("mtls");
    let ca = Ca::new("server CA");
    let clients = Ca::new("clients CA");
    let mut extra = Vec::new();
    set_str(
        &mut extra,
        "tls.client_ca",
        &dir.put("clients.pem", clients.pem()),
    );
    set(&mut extra, "tls.require_client_cert", "true");
    let broker = tls_broker(&dir, &ca.server("broker"), &extra);
    let addr = broker.listener("mqtt-tls");

    let device = clients.issue("device-1", &[]);
    let mut ok = Mqtt::new(
        Direct(tls_stream(addr, client_config(&ca, Some(&device), &[]))),
        true,
    );
    ok.connect_ok("device-1");
    let topic = unique("mtls");
    ok.subscribe(&topic, 0);
    ok.publish(&topic, b"hello");
    assert_eq!(ok.expect_publish().text(), "hello");

    let intruder = Ca::new("intruder CA").issue("device-1", &[]);
    for (what, cert) in [("no certificate", None), ("another CA's", Some(&intruder))] {
        let mut refused_client = Mqtt::new(
            Direct(tls_stream(addr, client_config(&ca, cert, &[]))),
            true,
        );
        assert_eq!(
            refused_client.connect(&Login::v5(&unique("mtls-no")).encode()),
            None,
            "{what}: no CONNACK"
        );
    }
    assert_refused(&broker, "handshake_failed", 2.0);
}

/// Certificate reload (DESIGN.md §11: "certificate reloaded on change
/// without restart"): new files written by rename are presented by the
/// next handshake; established connections stay up.
#[test]
fn a_certificate_replaced_on_disk_is_presented_by_the_next_handshake() {
    let dir = TempDir::new("tls-reload");
    let (old_ca, new_ca) = (Ca::new("old CA"), Ca::new("new CA"));
    let broker = tls_broker(&dir, &old_ca.server("old"), &[]);
    let addr = broker.listener("mqtt-tls");
    let mut before = Mqtt::new(
        Direct(tls_stream(addr, client_config(&old_ca, None, &[]))),
        true,
    );
    before.connect_ok(&unique("before"));
    let topic = unique("reload");
    before.subscribe(&topic, 0);

    let (cert, key) = new_ca.server("new");
    dir.put("server.key", &key);
    dir.put("server.pem", &cert);
    let changed = Instant::now();
    let seen = loop {
        let mut stream = tls_stream(addr, client_config(&new_ca, None, &[]));
        if handshake(&mut stream).is_ok() {
            break stream.conn.peer_certificates().unwrap()[0].to_vec();
        }
        assert!(
            changed.elapsed() < Duration::from_secs(5),
            "the new certificate is not served 5 s after the change"
        );
        thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(seen, der_of(&cert), "the new certificate is presented");
    let mut after = Mqtt::new(
        Direct(tls_stream(addr, client_config(&new_ca, None, &[]))),
        true,
    );
    after.connect_ok(&unique("after"));
    after.publish(&topic, b"across the reload");
    assert_eq!(
        before.expect_publish().text(),
        "across the reload",
        "the connection made before the reload still works"
    );
    let mut stale = tls_stream(addr, client_config(&old_ca, None, &[]));
    assert!(
        handshake(&mut stale).is_err(),
        "the old certificate is gone"
    );
}

/// `tls.use_identity_as_username`: the client certificate's CN is the user
/// name, and the ACL's `user NAME` rules apply to it; anonymous TCP clients
/// are refused (0x87).
#[test]
fn a_client_certificate_cn_becomes_the_user_name_that_the_acl_checks() {
    let dir = TempDir::new("tls-identity");
    let ca = Ca::new("server CA");
    let clients = Ca::new("clients CA");
    let acl = "allow user device-1 all devices/device-1/#\n";
    let mut extra = Vec::new();
    set_str(
        &mut extra,
        "tls.client_ca",
        &dir.put("clients.pem", clients.pem()),
    );
    set(&mut extra, "tls.require_client_cert", "true");
    set(&mut extra, "tls.use_identity_as_username", "true");
    set(&mut extra, "auth.allow_anonymous", "false");
    set_str(&mut extra, "auth.acl_file", &dir.put("acl", acl));
    let broker = tls_broker(&dir, &ca.server("broker"), &extra);
    let addr = broker.listener("mqtt-tls");

    let device = |cn: &str| {
        let cert = clients.issue(cn, &[]);
        let mut c = Mqtt::new(
            Direct(tls_stream(addr, client_config(&ca, Some(&cert), &[]))),
            true,
        );
        c.connect_ok(&unique(cn));
        c
    };
    let mut one = device("device-1");
    let (id, sub) = one.subscribe_packet("devices/device-1/#", 1);
    one.send(&sub);
    assert_eq!(one.suback(id), vec![1], "its own topics");
    let (id, sub) = one.subscribe_packet("devices/device-2/#", 1);
    one.send(&sub);
    assert_eq!(one.suback(id), vec![0x87], "another device's topics");
    one.publish("devices/device-1/up", b"mine");
    assert_eq!(one.expect_publish().topic, "devices/device-1/up");

    let mut two = device("device-2");
    let (id, sub) = two.subscribe_packet("devices/device-1/#", 1);
    two.send(&sub);
    assert_eq!(two.suback(id), vec![0x87], "the rule names device-1 only");

    assert_eq!(Login::v5(&unique("anon")).reason(broker.mqtt), 0x87);
}

// ---------------------------------------------------------------------------
// WebSocket and WSS (DESIGN.md §11; MQTT 5 §6).
// ---------------------------------------------------------------------------

fn ws_broker(extra: &[String]) -> Broker {
    let mut args = Vec::new();
    set(&mut args, "listeners.ws", r#"["127.0.0.1:0"]"#);
    args.extend_from_slice(extra);
    start(&args)
}

/// A WebSocket client (path `/mqtt`, subprotocol `mqtt`) connects,
/// subscribes, receives what a TCP client publishes and publishes to it.
#[test]
fn a_websocket_client_subscribes_and_exchanges_messages_with_tcp_clients() {
    let broker = ws_broker(&["--shards".into(), "2".into()]);
    for v5 in [true, false] {
        let mut ws = Mqtt::new(ws_connect(&broker), v5);
        ws.connect_ok(&unique("ws"));
        let topic = unique("ws/in");
        ws.subscribe(&topic, 1);
        let mut tcp = tcp_subscriber(&broker, &format!("{topic}/out"));
        let mut publisher = Client::v5(broker.mqtt, &unique("tcp-pub"), true, Props::new());
        publisher.publish(&topic, 1, false, Props::new(), b"to-ws");
        let got = ws.expect_publish();
        assert_eq!(
            (got.topic.as_str(), got.text().as_str(), got.qos),
            (topic.as_str(), "to-ws", 1)
        );
        ws.publish(&format!("{topic}/out"), b"from-ws");
        assert_eq!(tcp.expect_publish().text(), "from-ws");
    }
}

/// An idle WebSocket connection does not keep tungstenite's default
/// 128 KiB read buffer resident (`ws::WS_READ_BUFFER_BYTES`): 100
/// connections, signed in and idle, grow the broker by well under 32 KiB
/// each (about 140 KiB each with the default; perf/RESULTS.md,
/// 2026-12-02, session 17).
#[test]
fn idle_websocket_connections_do_not_each_keep_a_128_kib_read_buffer() {
    let broker = ws_broker(&["--shards".into(), "1".into()]);
    // One connection first: what the first one alone makes (the shard's
    // first WebSocket handshake) is not a cost per connection.
    let mut first = Mqtt::new(ws_connect(&broker), false);
    first.connect_ok(&unique("ws-idle"));
    let before = broker.rss_kib();
    let mut idle = Vec::new();
    for _ in 0..100 {
        let mut ws = Mqtt::new(ws_connect(&broker), false);
        ws.connect_ok(&unique("ws-idle"));
        idle.push(ws);
    }
    let grown = broker.rss_kib().saturating_sub(before);
    assert!(grown < 100 * 32, "100 idle WebSocket connections grew the broker by {grown} KiB");
}

/// [MQTT-6.0.0-2]: the receiver must not assume packets are aligned on
/// WebSocket frame boundaries: a CONNECT and a SUBSCRIBE split across
/// frames (one split inside the Remaining Length), and a SUBSCRIBE plus a
/// PUBLISH in one frame, are all understood.
#[test]
fn mqtt_packets_split_across_websocket_frames_or_sharing_one_frame_are_understood() {
    let broker = ws_broker(&[]);
    let mut ws = Mqtt::new(ws_connect(&broker), true);
    check_frame_alignment(&broker, &mut ws);
}

/// The frame-alignment checks of
/// [`mqtt_packets_split_across_websocket_frames_or_sharing_one_frame_are_understood`],
/// on any WebSocket.
fn check_frame_alignment<S: Socket>(broker: &Broker, ws: &mut Mqtt<Ws<S>>) {
    let id = unique("ws-split");
    let connect = Login::v5(&id).encode();
    ws.send(&connect[..1]);
    ws.send(&connect[1..7]);
    ws.send(&connect[7..]);
    let connack = match ws.read(WAIT) {
        Incoming::Packet { header: 0x20, body } => ConnAck::parse(&body),
        other => panic!("expected CONNACK, got {other:02x?}"),
    };
    assert_eq!(connack.reason, 0);

    // A SUBSCRIBE with a long filter, so that its Remaining Length takes
    // two bytes, split between them.
    let long = format!("{}/{}", unique("ws-split"), "x".repeat(200));
    let (sid, subscribe) = ws.subscribe_packet(&long, 0);
    assert!(subscribe[1] & 0x80 != 0, "a two-byte Remaining Length");
    ws.send(&subscribe[..2]);
    ws.send(&subscribe[2..]);
    assert_eq!(ws.suback(sid), vec![0]);

    // Two packets in one frame: SUBSCRIBE and a PUBLISH to that filter.
    let topic = unique("ws-two");
    let (sid, mut both) = ws.subscribe_packet(&topic, 0);
    both.extend(packet::publish(
        &topic,
        0,
        false,
        0,
        Some(&Props::new()),
        b"same-frame",
    ));
    ws.send(&both);
    assert_eq!(ws.suback(sid), vec![0]);
    assert_eq!(ws.expect_publish().text(), "same-frame");

    // And a PUBLISH cut in three, delivered to a TCP subscriber.
    let mut tcp = tcp_subscriber(broker, &long);
    let publish = packet::publish(&long, 0, false, 0, Some(&Props::new()), b"in-pieces");
    let third = publish.len() / 3;
    ws.send(&publish[..third]);
    ws.send(&publish[third..2 * third]);
    ws.send(&publish[2 * third..]);
    assert_eq!(tcp.expect_publish().text(), "in-pieces");
    assert_eq!(ws.expect_publish().text(), "in-pieces", "and to itself");
}

/// Only `/mqtt` is served (HTTP 404 elsewhere) and the client must offer
/// the `mqtt` subprotocol (HTTP 400 otherwise) [MQTT-6.0.0-3]; the
/// listener still serves proper clients afterwards.
#[test]
fn websocket_upgrades_on_another_path_get_404_and_without_the_mqtt_subprotocol_get_400() {
    let broker = ws_broker(&[]);
    let addr = broker.listener("mqtt-ws");
    let attempt = |path: &str, protocol: Option<&str>| {
        let tcp = TcpStream::connect(addr).unwrap();
        tcp.set_read_timeout(Some(WAIT)).unwrap();
        ws_upgrade(tcp, ws_request("ws", addr, path, protocol)).map(|_| ())
    };
    assert_eq!(attempt("/", Some("mqtt")), Err(404));
    assert_eq!(attempt("/mqtt/extra", Some("mqtt")), Err(404));
    assert_eq!(attempt("/mqtt", None), Err(400));
    assert_eq!(attempt("/mqtt", Some("chat")), Err(400));
    let mut ws = Mqtt::new(ws_connect(&broker), true);
    ws.connect_ok(&unique("ws-after"));
}

/// A plain HTTP request on the WebSocket listener (a health check, a
/// browser) gets an HTTP answer, not a silent close: RFC 6455 §4.2.1 has a
/// server that refuses a handshake return an HTTP error code. 426 names
/// the upgrade it needs; the listener serves proper clients afterwards.
#[test]
fn a_plain_http_request_on_the_websocket_listener_gets_426_upgrade_required() {
    let broker = ws_broker(&[]);
    let addr = broker.listener("mqtt-ws");
    let answer = |request: &str| {
        let mut tcp = TcpStream::connect(addr).unwrap();
        tcp.set_read_timeout(Some(WAIT)).unwrap();
        tcp.write_all(request.as_bytes()).unwrap();
        let mut answer = String::new();
        tcp.read_to_string(&mut answer).expect("the broker answers, then closes");
        answer
    };
    let plain = answer("GET /mqtt HTTP/1.1\r\nHost: broker\r\n\r\n");
    assert!(plain.starts_with("HTTP/1.1 426 "), "{plain}");
    assert!(plain.to_ascii_lowercase().contains("upgrade: websocket"), "{plain}");
    let elsewhere = answer("GET /healthz HTTP/1.1\r\nHost: broker\r\n\r\n");
    assert!(elsewhere.starts_with("HTTP/1.1 404 "), "{elsewhere}");
    let mut ws = Mqtt::new(ws_connect(&broker), true);
    ws.connect_ok(&unique("ws-after-http"));
}

/// WSS: WebSocket over TLS with the same certificate; the same exchange and
/// frame alignment as over plain WebSocket.
#[test]
fn wss_serves_mqtt_over_websocket_over_tls() {
    let dir = TempDir::new("wss");
    let ca = Ca::new("e2e CA");
    let cert = ca.server("broker");
    let mut args = Vec::new();
    set(&mut args, "listeners.wss", r#"["127.0.0.1:0"]"#);
    set_str(&mut args, "tls.cert", &dir.put("server.pem", &cert.0));
    set_str(&mut args, "tls.key", &dir.put("server.key", &cert.1));
    let broker = start(&args);
    let addr = broker.listener("mqtt-wss");
    let wss = || {
        let mut tls = tls_stream(addr, client_config(&ca, None, &[]));
        handshake(&mut tls).expect("TLS handshake");
        let peer = tls.conn.peer_certificates().unwrap()[0].to_vec();
        assert_eq!(peer, der_of(&cert.0), "the configured certificate");
        Ws(ws_upgrade(tls, ws_request("wss", addr, "/mqtt", Some("mqtt"))).expect("upgrade"))
    };
    let mut client = Mqtt::new(wss(), true);
    client.connect_ok(&unique("wss"));
    let topic = unique("wss/in");
    client.subscribe(&topic, 1);
    let mut publisher = Client::v5(broker.mqtt, &unique("tcp-pub"), true, Props::new());
    publisher.publish(&topic, 1, false, Props::new(), b"to-wss");
    assert_eq!(client.expect_publish().text(), "to-wss");

    let mut split = Mqtt::new(wss(), true);
    check_frame_alignment(&broker, &mut split);

    let mut tls = tls_stream(addr, client_config(&ca, None, &[]));
    handshake(&mut tls).unwrap();
    assert_eq!(
        ws_upgrade(tls, ws_request("wss", addr, "/other", Some("mqtt"))).map(|_| ()),
        Err(404)
    );
}

// ---------------------------------------------------------------------------
// The password file (DESIGN.md §9, §15).
// ---------------------------------------------------------------------------

/// Broker arguments for a password file, anonymous clients refused, and a
/// throttle that these tests do not reach.
fn password_args(file: &str) -> Vec<String> {
    let mut args = Vec::new();
    set_str(&mut args, "auth.password_file", file);
    set(&mut args, "auth.allow_anonymous", "false");
    set(&mut args, "limits.auth_failure_threshold", "1000");
    args
}

/// Users made by `fleetmq passwd` sign in with their password; a wrong
/// password or unknown user gets 0x86 (3.1.1: 4), no credentials 0x87
/// (3.1.1: 5); each refusal is counted.
#[test]
fn a_password_file_made_by_fleetmq_passwd_admits_the_right_password_only() {
    let dir = TempDir::new("passwd");
    let file = dir.path("passwd");
    passwd(&file, "alice", "wonder land", None);
    passwd(&file, "bob", "builder", None);
    passwd(&file, "bob", "b0b-new", None);
    let text = std::fs::read_to_string(&file).unwrap();
    assert!(text.contains("alice:$argon2id$"), "argon2id hashes: {text}");
    assert!(!text.contains("wonder"), "no clear text: {text}");
    let broker = start(&password_args(&file.display().to_string()));
    let addr = broker.mqtt;

    Login::v5(&unique("a"))
        .user("alice", "wonder land")
        .accepted(addr);
    Login::v311(&unique("a"))
        .user("alice", "wonder land")
        .accepted(addr);
    Login::v5(&unique("b"))
        .user("bob", "b0b-new")
        .accepted(addr);
    assert_eq!(
        Login::v5(&unique("b")).user("bob", "builder").reason(addr),
        0x86,
        "the old password"
    );
    assert_eq!(
        Login::v5(&unique("a")).user("alice", "wrong").reason(addr),
        0x86
    );
    assert_eq!(
        Login::v311(&unique("a"))
            .user("alice", "wrong")
            .reason(addr),
        4
    );
    assert_eq!(
        Login::v5(&unique("m")).user("mallory", "x").reason(addr),
        0x86,
        "unknown user"
    );
    assert_eq!(Login::v5(&unique("n")).reason(addr), 0x87, "no credentials");
    assert_eq!(Login::v311(&unique("n")).reason(addr), 5, "no credentials");
    assert_refused(&broker, "bad_credentials", 4.0);
    assert_refused(&broker, "not_authorized", 2.0);
}

/// Changing a password without `--workspace` keeps the user's workspace,
/// and `fleetmq passwd` says which it is.
#[test]
fn a_new_password_without_workspace_keeps_the_user_in_their_workspace() {
    let dir = TempDir::new("passwd-workspace");
    let file = dir.path("passwd");
    let said = passwd(&file, "bob", "builder", Some("acme"));
    assert!(
        said.contains("added user \"bob\" (workspace \"acme\")"),
        "{said}"
    );
    let said = passwd(&file, "bob", "b0b-new", None);
    assert!(said.contains("(workspace \"acme\", kept)"), "{said}");
    let text = std::fs::read_to_string(&file).unwrap();
    assert!(
        text.lines()
            .any(|l| l.starts_with("bob:") && l.ends_with(":acme")),
        "{text}"
    );
    let said = passwd(&file, "bob", "b0b-newer", Some("beta"));
    assert!(
        said.contains("(workspace \"beta\", moved from workspace \"acme\")"),
        "{said}"
    );
}

/// The password file is re-read when it changes (polled every 2 s) and on
/// SIGHUP: a user added later signs in within 3 s; a user deleted is
/// refused right after SIGHUP.
#[test]
fn users_added_or_deleted_by_fleetmq_passwd_take_effect_without_a_restart() {
    let dir = TempDir::new("passwd-reload");
    let file = dir.path("passwd");
    passwd(&file, "alice", "pw-a", None);
    let broker = start(&password_args(&file.display().to_string()));
    let addr = broker.mqtt;
    assert_eq!(
        Login::v5(&unique("c")).user("carol", "pw-c").reason(addr),
        0x86
    );

    passwd(&file, "carol", "pw-c", None);
    let added = Instant::now();
    loop {
        let reason = Login::v5(&unique("c")).user("carol", "pw-c").reason(addr);
        if reason == 0 {
            break;
        }
        assert!(
            added.elapsed() < Duration::from_secs(3),
            "carol still refused ({reason:#x}) 3 s after being added"
        );
        thread::sleep(Duration::from_millis(200));
    }

    passwd_delete(&file, "carol");
    broker.signal(libc::SIGHUP);
    let deleted = Instant::now();
    loop {
        let reason = Login::v5(&unique("c")).user("carol", "pw-c").reason(addr);
        if reason == 0x86 {
            break;
        }
        assert!(
            deleted.elapsed() < Duration::from_secs(1),
            "carol still admitted 1 s after SIGHUP"
        );
        thread::sleep(Duration::from_millis(50));
    }
    Login::v5(&unique("a")).user("alice", "pw-a").accepted(addr);
}

// ---------------------------------------------------------------------------
// JWT (DESIGN.md §9, `[auth.jwt]`).
// ---------------------------------------------------------------------------

pub(crate) const JWT_SECRET: &[u8] = b"e2e-shared-secret";

/// An HS256 token signed with `secret` carrying `claims`.
pub(crate) fn jwt(secret: &[u8], claims: serde_json::Value) -> String {
    jsonwebtoken::encode(
        &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
        &claims,
        &jsonwebtoken::EncodingKey::from_secret(secret),
    )
    .unwrap()
}

/// A broker taking HS256 JWTs from `dir`'s secret file, issuer
/// `fleetmq-e2e` and audience `mqtt` required.
fn jwt_broker(dir: &TempDir) -> Broker {
    let mut args = Vec::new();
    let mut secret = JWT_SECRET.to_vec();
    secret.push(b'\n');
    set_str(
        &mut args,
        "auth.jwt.secret_file",
        &dir.put("secret", secret),
    );
    set(&mut args, "auth.jwt.issuer", "fleetmq-e2e");
    set(&mut args, "auth.jwt.audience", "mqtt");
    set(&mut args, "auth.allow_anonymous", "false");
    set(&mut args, "limits.auth_failure_threshold", "1000");
    set(&mut args, "limits.auth_check_rate_per_credential", "1000");
    start(&args)
}

/// Valid claims for `sub` expiring `exp`.
fn claims(sub: &str, exp: u64) -> serde_json::Value {
    serde_json::json!({ "sub": sub, "exp": exp, "iss": "fleetmq-e2e", "aud": "mqtt" })
}

/// A JWT as password: valid tokens sign in (the user name must equal `sub`,
/// or is taken from it when absent); expired, wrongly signed, wrong
/// audience or issuer, and mismatched user names get 0x86 (3.1.1: 4).
#[test]
fn a_jwt_password_signs_in_when_valid_and_is_refused_when_any_check_fails() {
    let dir = TempDir::new("jwt");
    let broker = jwt_broker(&dir);
    let addr = broker.mqtt;
    let later = unix_now() + 600;
    let good = jwt(JWT_SECRET, claims("dev-7", later));
    Login::v5(&unique("j")).user("dev-7", &good).accepted(addr);
    Login::v311(&unique("j"))
        .user("dev-7", &good)
        .accepted(addr);
    let id = unique("j");
    let no_name = Login {
        password: Some(good.as_bytes()),
        ..Login::v5(&id)
    };
    no_name.accepted(addr);

    let mut wrong_aud = claims("dev-7", later);
    wrong_aud["aud"] = "other".into();
    let mut wrong_iss = claims("dev-7", later);
    wrong_iss["iss"] = "someone-else".into();
    let cases = [
        (
            "expired",
            jwt(JWT_SECRET, claims("dev-7", unix_now() - 30)),
            "dev-7",
        ),
        (
            "wrong key",
            jwt(b"not-the-secret", claims("dev-7", later)),
            "dev-7",
        ),
        ("wrong audience", jwt(JWT_SECRET, wrong_aud), "dev-7"),
        ("wrong issuer", jwt(JWT_SECRET, wrong_iss), "dev-7"),
        ("user name mismatch", good.clone(), "dev-8"),
    ];
    for (what, token, user) in &cases {
        assert_eq!(
            Login::v5(&unique("j")).user(user, token).reason(addr),
            0x86,
            "{what}"
        );
    }
    assert_eq!(
        Login::v311(&unique("j"))
            .user("dev-7", &cases[0].1)
            .reason(addr),
        4,
        "expired, 3.1.1"
    );
    assert_refused(&broker, "bad_credentials", 6.0);
}

/// A connection signed in with a JWT is closed when the token expires: MQTT
/// 5 gets DISCONNECT 0xA0 (Maximum connect time) first.
#[test]
fn a_jwt_connection_is_closed_at_exp_with_disconnect_0xa0() {
    let dir = TempDir::new("jwt-exp");
    let broker = jwt_broker(&dir);
    let exp = unix_now() + 2;
    let token = jwt(JWT_SECRET, claims("short-lived", exp));
    let mut client = Login::v5(&unique("exp"))
        .user("short-lived", &token)
        .accepted(broker.mqtt);
    let topic = unique("exp");
    client.subscribe(&topic, 1);
    client.publish(&topic, 1, false, Props::new(), b"alive");
    assert_eq!(client.expect_publish().text(), "alive", "open before exp");
    let reason = client.closed_with(Duration::from_secs(5));
    let closed_at = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    assert_eq!(reason, Some(0xA0), "DISCONNECT Maximum connect time");
    assert!(
        closed_at >= exp as f64 - 0.05 && closed_at < exp as f64 + 1.5,
        "closed at {closed_at:.2}, exp {exp}"
    );
}

// ---------------------------------------------------------------------------
// The ACL file (DESIGN.md §9, §15).
// ---------------------------------------------------------------------------

const ACL: &str = "\
# fleetmq e2e ACL: first match wins, no match denies
allow user admin all #
deny any all devices/+/secret
allow any all devices/%c/#
allow user ops subscribe devices/#
allow any all users/%u/#
allow any all public/#
";

/// A broker with [`ACL`] (`acl_cache_ttl` 1 s); anonymous clients allowed
/// and user names taken as given, so no passwords are needed.
fn acl_broker(dir: &TempDir) -> (Broker, String) {
    let file = dir.put("acl", ACL);
    let mut args = vec!["--shards".to_owned(), "2".to_owned()];
    set_str(&mut args, "auth.acl_file", &file);
    set(&mut args, "auth.acl_cache_ttl", "1s");
    (start(&args), file)
}

/// An MQTT 5 client `client_id` signed in as `user` (unverified).
fn as_user(addr: SocketAddr, client_id: &str, user: &str) -> Client {
    let login = Login {
        username: Some(user),
        ..Login::v5(client_id)
    };
    login.accepted(addr)
}

/// The ACL covers wills as it covers PUBLISH (a will is a publish the broker
/// makes for the client): a Will Topic the client may not publish to gets
/// MQTT 5 CONNACK 0x87, 3.1.1 return code 5 [MQTT-3.2.2-6]; one it may is
/// accepted and its will published when the client vanishes.
#[test]
fn acl_refuses_a_will_topic_the_client_may_not_publish_to() {
    let dir = TempDir::new("acl-will");
    let (broker, _) = acl_broker(&dir);
    let mut ops = as_user(broker.mqtt, &unique("ops"), "ops");
    ops.subscribe("devices/#", 1);
    let will = |topic| Some(wire::Will { topic, payload: b"gone", delay_secs: None, payload_format: None });
    for (connect, refused) in [(wire::Connect::v5("wdev1"), 0x87), (wire::Connect::v311("wdev2"), 5)] {
        let denied = wire::Connect { will: will("devices/other/status"), ..connect };
        let mut client = crate::raw::RawClient::connect(broker.mqtt);
        assert_eq!(client.handshake(&denied.encode()).1, refused, "level {}", denied.level);
    }
    let own = String::from("devices/wdev3/status");
    let allowed = wire::Connect { will: will(&own), ..wire::Connect::v5("wdev3") };
    let mut client = crate::raw::RawClient::connect(broker.mqtt);
    assert_eq!(client.handshake(&allowed.encode()).1, 0x00);
    drop(client);
    let topics: Vec<_> = ops.drain(QUIET).into_iter().map(|p| p.topic).collect();
    assert_eq!(topics, [own]);
}

/// Publishing: allowed topics get PUBACK 0x00, denied ones PUBACK 0x87
/// (PUBREC 0x87 at QoS 2) and are not forwarded; a denied QoS 0 message is
/// dropped and counted in `fleetmq_messages_dropped_total{reason=
/// "not_authorized"}`; `%c` and `%u` name the client's own topics.
#[test]
fn acl_refuses_publishes_with_0x87_and_drops_denied_qos0_messages_counted() {
    let dir = TempDir::new("acl-pub");
    let (broker, _) = acl_broker(&dir);
    let addr = broker.mqtt;
    let mut ops = as_user(addr, &unique("ops"), "ops");
    ops.subscribe("devices/#", 1);
    let mut admin = as_user(addr, &unique("admin"), "admin");
    admin.subscribe("users/#", 1);

    let mut dev = as_user(addr, "dev1", "alice");
    let publish = |c: &mut Client, topic: &str, qos: u8| {
        c.publish(topic, qos, false, Props::new(), topic.as_bytes())
    };
    assert_eq!(publish(&mut dev, "devices/dev1/temp", 1), 0x00, "%c");
    assert_eq!(
        publish(&mut dev, "devices/dev2/temp", 1),
        0x87,
        "another client's"
    );
    assert_eq!(
        publish(&mut dev, "devices/dev1/secret", 1),
        0x87,
        "deny before allow"
    );
    assert_eq!(publish(&mut dev, "users/alice/out", 1), 0x00, "%u");
    assert_eq!(
        publish(&mut dev, "users/bob/out", 1),
        0x87,
        "another user's"
    );
    assert_eq!(
        publish(&mut dev, "devices/dev2/qos2", 2),
        0x87,
        "PUBREC 0x87"
    );

    let topics = |c: &mut Client| {
        c.drain(QUIET)
            .into_iter()
            .map(|p| p.topic)
            .collect::<Vec<_>>()
    };
    assert_eq!(topics(&mut ops), ["devices/dev1/temp"]);
    assert_eq!(topics(&mut admin), ["users/alice/out"]);

    let dropped = || {
        metric_with(
            &broker,
            "fleetmq_messages_dropped_total",
            "reason=\"not_authorized\"",
        )
    };
    let before = dropped();
    publish(&mut dev, "devices/dev2/qos0", 0);
    // A QoS 1 publish after it: when its PUBACK is back, the QoS 0 one
    // was handled.
    assert_eq!(publish(&mut dev, "devices/dev1/sync", 1), 0);
    assert_eq!(
        topics(&mut ops),
        ["devices/dev1/sync"],
        "the QoS 0 one was dropped"
    );
    let after = dropped();

    // MQTT 3.1.1 has no reason code: acknowledged, not forwarded.
    let mut old = Login {
        username: Some("alice"),
        ..Login::v311("dev3")
    }
    .accepted(addr);
    assert_eq!(publish(&mut old, "devices/dev9/x", 1), 0);
    assert!(
        topics(&mut ops).is_empty(),
        "3.1.1 denied publish not forwarded"
    );

    assert!(
        after >= before + 1.0,
        "a denied QoS 0 publish is counted as dropped (not_authorized): {before} -> {after}"
    );
}

/// Subscribing: each filter of a SUBSCRIBE is judged on its own; a filter
/// the rules do not cover gets 0x87 (3.1.1: 0x80) while the others are
/// granted.
#[test]
fn acl_refuses_subscriptions_filter_by_filter_with_suback_0x87() {
    let dir = TempDir::new("acl-sub");
    let (broker, _) = acl_broker(&dir);
    let addr = broker.mqtt;
    let mut dev = as_user(addr, "dev1", "alice");
    let codes = dev.subscribe_with(
        &[
            ("devices/dev1/#", 1),
            ("devices/dev2/#", 1),
            ("devices/#", 1),
            ("devices/dev1/secret", 1),
            ("users/alice/#", 1),
            ("users/+/inbox", 1),
            ("public/news", 1),
        ],
        Props::new(),
    );
    assert_eq!(codes, [1, 0x87, 0x87, 0x87, 1, 0x87, 1]);

    let mut ops = as_user(addr, &unique("ops"), "ops");
    assert_eq!(ops.subscribe_with(&[("devices/#", 0)], Props::new()), [0]);

    let mut old = Login {
        username: Some("alice"),
        ..Login::v311("dev2")
    }
    .accepted(addr);
    assert_eq!(
        old.subscribe_with(
            &[("devices/dev2/#", 1), ("devices/dev1/#", 1)],
            Props::new()
        ),
        [1, 0x80]
    );
}

/// Delivery is checked too: a subscription allowed as a whole does not
/// carry topics the subscriber may not read (`devices/+/secret`); `%c`
/// delivers a device its own commands.
#[test]
fn acl_is_checked_on_every_delivery() {
    let dir = TempDir::new("acl-deliver");
    let (broker, _) = acl_broker(&dir);
    let addr = broker.mqtt;
    let mut ops = as_user(addr, &unique("ops"), "ops");
    ops.subscribe("devices/#", 1);
    let mut dev = as_user(addr, "dev1", "alice");
    dev.subscribe("devices/dev1/#", 1);
    let mut admin = as_user(addr, &unique("admin"), "admin");
    for topic in [
        "devices/dev1/secret",
        "devices/dev1/cmd",
        "devices/dev2/cmd",
    ] {
        assert_eq!(admin.publish(topic, 1, false, Props::new(), b"x"), 0);
    }
    let topics = |c: &mut Client| {
        c.drain(QUIET)
            .into_iter()
            .map(|p| p.topic)
            .collect::<Vec<_>>()
    };
    let mut seen = topics(&mut ops);
    seen.sort();
    assert_eq!(seen, ["devices/dev1/cmd", "devices/dev2/cmd"]);
    assert_eq!(topics(&mut dev), ["devices/dev1/cmd"]);
}

/// A rule removed from the ACL file stops delivery to an existing
/// subscription within `auth.acl_cache_ttl` (1 s here) of the reload
/// (SIGHUP): no message published 1.5 s or more after the signal reaches
/// the subscriber. Each payload carries when it was published, so a
/// delivery that this busy machine delays is judged by when its message
/// was sent.
#[test]
fn a_rule_removed_by_reload_stops_delivery_within_the_acl_cache_ttl() {
    let dir = TempDir::new("acl-reload");
    let file = dir.put("acl", ACL);
    let mut args = vec!["--shards".to_owned(), "2".to_owned()];
    set_str(&mut args, "auth.acl_file", &file);
    set(&mut args, "auth.acl_cache_ttl", "1s");
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    // Debug lines (a publisher moving between shards, say) are in the
    // stderr printed when this test fails.
    let broker = Broker::start_with_env(&args, &[("RUST_LOG", "info,broker=debug")]);
    let addr = broker.mqtt;
    let mut watcher = as_user(addr, &unique("watcher"), "watcher");
    watcher.subscribe("public/#", 1);
    let mut admin = as_user(addr, &unique("admin"), "admin");
    admin.publish("public/a", 1, false, Props::new(), b"before");
    assert_eq!(watcher.expect_publish().text(), "before");

    dir.put("acl", ACL.replace("allow any all public/#\n", ""));
    broker.signal(libc::SIGHUP);
    let reloaded = Instant::now();
    let mut delivered = Vec::new();
    while reloaded.elapsed() < Duration::from_secs(3) {
        let sent = reloaded.elapsed().as_millis().to_string();
        assert_eq!(admin.publish("public/a", 1, false, Props::new(), sent.as_bytes()), 0);
        if let Some(p) = watcher.recv(Duration::from_millis(100)) {
            delivered.push((p.text(), reloaded.elapsed()));
        }
    }
    delivered.extend(watcher.drain(QUIET).into_iter().map(|p| (p.text(), reloaded.elapsed())));
    for (sent, at) in &delivered {
        let sent: u64 = sent.parse().expect("a payload of this test");
        assert!(
            sent < 1500,
            "a message published {sent} ms after the reload was delivered (at {at:?}); \
             acl_cache_ttl is 1 s; all deliveries (sent ms, at): {delivered:?}"
        );
    }
}

/// An ACL file that does not parse is refused on SIGHUP: the previous rules
/// stay in force, and one warning names the file and its bad line.
#[test]
fn a_broken_acl_file_on_reload_keeps_the_previous_rules_and_is_logged_once() {
    let dir = TempDir::new("acl-broken");
    let (broker, file) = acl_broker(&dir);
    dir.put("acl", "allow anybody all #\n");
    broker.signal(libc::SIGHUP);
    let deadline = Instant::now() + WAIT;
    while !broker.stderr().contains("reload failed") && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(20));
    }
    // A second reload (the file's change seen by the poll) must not have
    // happened yet to count once: the file is not touched again.
    thread::sleep(Duration::from_millis(300));
    let log = broker.stderr();
    assert_eq!(log.matches("reload failed").count(), 1, "{log}");
    assert!(log.contains(&file) && log.contains("line 1"), "{log}");
    let mut client = as_user(broker.mqtt, "dev7", "dev7");
    assert_eq!(client.publish("public/x", 1, false, Props::new(), b"x"), 0);
    assert_eq!(
        client.publish("devices/dev7/secret", 1, false, Props::new(), b"x"),
        0x87,
        "the previous rules' deny"
    );
}

// ---------------------------------------------------------------------------
// Workspaces (DESIGN.md §9).
// ---------------------------------------------------------------------------

/// A broker (2 shards) whose password file, written by `fleetmq passwd`,
/// holds a1, a2 (workspace alpha), b1 (beta) and d1 (default); every
/// password is `pw`.
fn workspace_broker(dir: &TempDir) -> Broker {
    let file = dir.path("passwd");
    for (user, workspace) in [
        ("a1", Some("alpha")),
        ("a2", Some("alpha")),
        ("b1", Some("beta")),
        ("d1", None),
    ] {
        passwd(&file, user, "pw", workspace);
    }
    let mut args = password_args(&file.display().to_string());
    args.extend(["--shards".to_owned(), "2".to_owned()]);
    start(&args)
}

fn member(broker: &Broker, user: &str) -> Client {
    Login::v5(&unique(user))
        .user(user, "pw")
        .accepted(broker.mqtt)
}

fn topics_of(c: &mut Client) -> Vec<(String, String)> {
    c.drain(QUIET)
        .into_iter()
        .map(|p| (p.topic.clone(), p.text()))
        .collect()
}

/// Workspaces isolate topics: the same topic names work independently in
/// each, and nobody receives another workspace's messages, not even the
/// default workspace through `#`.
#[test]
fn workspaces_share_topic_names_but_never_messages_even_through_hash() {
    let dir = TempDir::new("ws-live");
    let broker = workspace_broker(&dir);
    let mut a1 = member(&broker, "a1");
    let mut a2 = member(&broker, "a2");
    let mut b1 = member(&broker, "b1");
    let mut d1 = member(&broker, "d1");
    a2.subscribe("#", 1);
    b1.subscribe("#", 1);
    d1.subscribe("#", 1);
    let mut plus = member(&broker, "d1");
    plus.subscribe("+/+", 1);

    assert_eq!(a1.publish("fleet/t", 1, false, Props::new(), b"alpha"), 0);
    assert_eq!(b1.publish("fleet/t", 1, false, Props::new(), b"beta"), 0);
    assert_eq!(d1.publish("fleet/t", 1, false, Props::new(), b"default"), 0);

    let t = |s: &str| ("fleet/t".to_owned(), s.to_owned());
    assert_eq!(topics_of(&mut a2), [t("alpha")], "alpha sees alpha only");
    assert_eq!(topics_of(&mut b1), [t("beta")], "beta sees beta only");
    assert_eq!(
        topics_of(&mut d1),
        [t("default")],
        "default sees default only"
    );
    assert_eq!(topics_of(&mut plus), [t("default")], "+/+ in default");
}

/// Retained messages and wills stay in their workspace: a retained message
/// set in alpha is not replayed to beta or default subscribers, each
/// workspace keeps its own retained message on the same topic, and a will
/// reaches its own workspace only.
#[test]
fn retained_messages_and_wills_stay_in_their_workspace() {
    let dir = TempDir::new("ws-retained");
    let broker = workspace_broker(&dir);
    let mut a1 = member(&broker, "a1");
    let mut b1 = member(&broker, "b1");
    assert_eq!(
        a1.publish("fleet/state", 1, true, Props::new(), b"alpha-state"),
        0
    );
    assert_eq!(
        b1.publish("fleet/state", 1, true, Props::new(), b"beta-state"),
        0
    );

    let mut a2 = member(&broker, "a2");
    a2.subscribe("fleet/#", 1);
    assert_eq!(
        topics_of(&mut a2),
        [("fleet/state".to_owned(), "alpha-state".to_owned())]
    );
    let mut b_watch = member(&broker, "b1");
    b_watch.subscribe("#", 1);
    assert_eq!(
        topics_of(&mut b_watch),
        [("fleet/state".to_owned(), "beta-state".to_owned())]
    );
    let mut d1 = member(&broker, "d1");
    d1.subscribe("#", 1);
    let default_retained = topics_of(&mut d1);

    let will_id = unique("a1-will");
    let doomed = Login {
        will: Some(("fleet/will", b"a1-gone", false)),
        ..Login::v5(&will_id).user("a1", "pw")
    }
    .accepted(broker.mqtt);
    drop(doomed); // closed without DISCONNECT: the will is published
    assert_eq!(
        topics_of(&mut a2),
        [("fleet/will".to_owned(), "a1-gone".to_owned())]
    );
    let beta = topics_of(&mut b_watch);
    assert!(beta.is_empty(), "no will from alpha in beta: {beta:?}");
    assert!(
        default_retained.is_empty(),
        "nothing retained in default: {default_retained:?}"
    );
    let default = topics_of(&mut d1);
    assert!(
        default.is_empty(),
        "no will from alpha in default: {default:?}"
    );
}

/// Client identifiers are unique across workspaces: one held by another
/// identity is refused with CONNACK 0x85 (3.1.1: 2), counted as
/// `client_id_in_use`; its holder is undisturbed and may take it over
/// itself.
#[test]
fn a_client_id_held_by_another_identity_is_refused_with_0x85() {
    let dir = TempDir::new("ws-ids");
    let broker = workspace_broker(&dir);
    let addr = broker.mqtt;
    let id = unique("shared-id");
    let mut holder = Login::v5(&id).user("a1", "pw").accepted(addr);
    assert_eq!(
        Login::v5(&id).user("b1", "pw").reason(addr),
        0x85,
        "another workspace"
    );
    assert_eq!(Login::v311(&id).user("b1", "pw").reason(addr), 2, "3.1.1");
    assert_eq!(
        Login::v5(&id).user("a2", "pw").reason(addr),
        0x85,
        "another user, same workspace"
    );
    assert_refused(&broker, "client_id_in_use", 3.0);
    let topic = unique("held");
    holder.subscribe(&topic, 1);
    holder.publish(&topic, 1, false, Props::new(), b"still here");
    assert_eq!(holder.expect_publish().text(), "still here");
    Login::v5(&id).user("a1", "pw").accepted(addr);
    assert_eq!(
        holder.closed_with(WAIT),
        Some(0x8E),
        "taken over by its own identity"
    );
}
