//! `fleetmq cert` (DESIGN.md §11, §15): the real binary writes the mesh CA
//! and the replica certificates, and two rustls endpoints built from those
//! files complete a TLS 1.3 handshake with mutual authentication; a
//! certificate from another CA, or for another name, is refused.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Output};
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, ClientConnection, RootCertStore, ServerConfig, ServerConnection};
use rustls::{ProtocolVersion, StreamOwned};

use crate::harness::run_with_timeout;
use crate::security::TempDir;

/// Runs `fleetmq cert <args>` to completion (10 s at most).
fn cert(args: &[&str]) -> Output {
    run_with_timeout(
        Command::new(env!("CARGO_BIN_EXE_fleetmq"))
            .arg("cert")
            .args(args),
        Duration::from_secs(10),
    )
}

/// Runs `fleetmq cert <args>` and panics unless it exits 0.
fn cert_ok(args: &[&str]) -> String {
    let out = cert(args);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        out.status.success(),
        "fleetmq cert {args:?}: {:?}\n{stderr}",
        out.status
    );
    stderr
}

/// One end of a mesh link: its certificate chain and key, and the CA it
/// trusts, all read from files `fleetmq cert` wrote.
struct Identity {
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
    trusts: Arc<RootCertStore>,
}

impl Identity {
    /// `DIR/<name>.pem`, `DIR/<name>.key`, trusting `CA_DIR/ca.pem`.
    fn load(dir: &Path, name: &str, ca_dir: &Path) -> Identity {
        let chain = CertificateDer::pem_file_iter(dir.join(format!("{name}.pem")))
            .expect("a PEM certificate file")
            .collect::<Result<Vec<_>, _>>()
            .expect("PEM certificates");
        let key = PrivateKeyDer::from_pem_file(dir.join(format!("{name}.key"))).expect("a PEM key");
        let mut roots = RootCertStore::empty();
        for ca in CertificateDer::pem_file_iter(ca_dir.join("ca.pem")).expect("ca.pem") {
            roots
                .add(ca.expect("a PEM CA"))
                .expect("the CA is a valid trust anchor");
        }
        Identity {
            chain,
            key,
            trusts: Arc::new(roots),
        }
    }
}

/// What a handshake ended with on both sides.
struct Handshake {
    /// The server's outcome: the protocol version and the client's
    /// certificate chain, or the error.
    server: Result<(ProtocolVersion, Vec<CertificateDer<'static>>), String>,
    /// The client's outcome: the protocol version, or the error.
    client: Result<ProtocolVersion, String>,
}

/// A TLS 1.3-only handshake over loopback TCP between `server` (requiring
/// a client certificate from its CA) and `client` (verifying the server
/// as `server_name`), followed by one exchange of bytes each way.
fn handshake(server: Identity, client: Identity, server_name: &str) -> Handshake {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let verifier = WebPkiClientVerifier::builder_with_provider(server.trusts, provider.clone())
        .build()
        .expect("a client verifier");
    let server_config = ServerConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .with_client_cert_verifier(verifier)
        .with_single_cert(server.chain, server.key)
        .expect("the server certificate and key match");
    let client_config = ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .with_root_certificates(client.trusts)
        .with_client_auth_cert(client.chain, client.key)
        .expect("the client certificate and key match");
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let accepting = thread::spawn(move || {
        let (sock, _) = listener.accept().unwrap();
        sock.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let conn = ServerConnection::new(Arc::new(server_config)).unwrap();
        let mut tls = StreamOwned::new(conn, sock);
        let mut ping = [0u8; 4];
        tls.read_exact(&mut ping).map_err(|e| e.to_string())?;
        assert_eq!(&ping, b"ping");
        tls.write_all(b"pong").map_err(|e| e.to_string())?;
        tls.flush().map_err(|e| e.to_string())?;
        let peer = tls.conn.peer_certificates().unwrap_or_default().to_vec();
        Ok((tls.conn.protocol_version().unwrap(), peer))
    });
    let name = ServerName::try_from(server_name.to_owned()).expect("a DNS name");
    let conn = ClientConnection::new(Arc::new(client_config), name).unwrap();
    let sock = TcpStream::connect(addr).unwrap();
    sock.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut tls = StreamOwned::new(conn, sock);
    let client = (|| {
        tls.write_all(b"ping")?;
        let mut pong = [0u8; 4];
        tls.read_exact(&mut pong)?;
        assert_eq!(&pong, b"pong");
        Ok::<_, std::io::Error>(tls.conn.protocol_version().unwrap())
    })()
    .map_err(|e| e.to_string());
    drop(tls);
    Handshake {
        server: accepting.join().expect("the server thread"),
        client,
    }
}

/// Asserts that `server` (as `server_name`) and `client`, both of `dir`,
/// complete a mutual TLS 1.3 handshake and exchange bytes.
fn assert_links(dir: &Path, server: &str, client: &str, server_name: &str) {
    let shook = handshake(
        Identity::load(dir, server, dir),
        Identity::load(dir, client, dir),
        server_name,
    );
    let (version, _) = shook
        .server
        .unwrap_or_else(|e| panic!("{server} refused {client}: {e}"));
    assert_eq!(version, ProtocolVersion::TLSv1_3);
    let version = shook
        .client
        .unwrap_or_else(|e| panic!("{client} refused {server} as {server_name}: {e}"));
    assert_eq!(version, ProtocolVersion::TLSv1_3);
}

fn mode(path: &Path) -> u32 {
    std::fs::metadata(path).unwrap().permissions().mode() & 0o777
}

#[test]
fn cert_writes_a_ca_and_replica_certificates_that_complete_mutual_tls_1_3() {
    let tmp = TempDir::new("cert-mtls");
    let mesh = tmp.path("mesh");
    let said = cert_ok(&["--out", mesh.to_str().unwrap()]);
    assert!(said.contains("ca.key"), "{said}");
    // Three replicas by default (DESIGN.md §15): r1..r3.
    for stem in ["ca", "r1", "r2", "r3"] {
        assert_eq!(mode(&mesh.join(format!("{stem}.key"))), 0o600, "{stem}.key");
        assert_eq!(mode(&mesh.join(format!("{stem}.pem"))), 0o644, "{stem}.pem");
    }
    assert!(!mesh.join("r4.pem").exists());

    let shook = handshake(
        Identity::load(&mesh, "r1", &mesh),
        Identity::load(&mesh, "r2", &mesh),
        "r1",
    );
    let (version, peer) = shook.server.expect("r1 accepts r2");
    assert_eq!(version, ProtocolVersion::TLSv1_3);
    assert_eq!(
        shook.client.expect("r2 accepts r1"),
        ProtocolVersion::TLSv1_3
    );
    let r2 = CertificateDer::from_pem_file(mesh.join("r2.pem")).unwrap();
    assert_eq!(peer.first(), Some(&r2), "the server saw r2's certificate");

    // The same certificate serves as client and as server: r2 accepts r3.
    assert_links(&mesh, "r2", "r3", "r2");
}

#[test]
fn a_certificate_from_another_ca_or_for_another_name_is_refused() {
    let tmp = TempDir::new("cert-other-ca");
    let (mesh, other) = (tmp.path("mesh"), tmp.path("other"));
    cert_ok(&["--out", mesh.to_str().unwrap(), "--replicas", "2"]);
    cert_ok(&["--out", other.to_str().unwrap(), "--replicas", "2"]);

    // A client with a certificate of another CA (same name r2): the server
    // refuses it.
    let shook = handshake(
        Identity::load(&mesh, "r1", &mesh),
        Identity::load(&other, "r2", &mesh),
        "r1",
    );
    let refused = shook.server.expect_err("r1 refuses a client of another CA");
    assert!(refused.contains("UnknownIssuer"), "{refused}");

    // A server with a certificate of another CA: the client refuses it.
    let shook = handshake(
        Identity::load(&other, "r1", &mesh),
        Identity::load(&mesh, "r2", &mesh),
        "r1",
    );
    let refused = shook.client.expect_err("r2 refuses a server of another CA");
    assert!(refused.contains("UnknownIssuer"), "{refused}");
    assert!(shook.server.is_err());

    // The right CA, but the client expected r2 and reached r1.
    let shook = handshake(
        Identity::load(&mesh, "r1", &mesh),
        Identity::load(&mesh, "r2", &mesh),
        "r2",
    );
    let refused = shook
        .client
        .expect_err("a certificate for r1 is not one for r2");
    assert!(refused.contains("not valid for name \"r2\""), "{refused}");
}

#[test]
fn cert_keeps_existing_files_unless_forced() {
    let tmp = TempDir::new("cert-force");
    let mesh = tmp.path("mesh");
    let dir = mesh.to_str().unwrap();
    cert_ok(&["--out", dir, "--replicas", "1"]);
    let ca_before = std::fs::read(mesh.join("ca.pem")).unwrap();

    // A second run would replace ca.pem, ca.key, r1.*: refused, nothing
    // written (r2 is not created either).
    let out = cert(&["--out", dir, "--replicas", "2"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("refusing to overwrite"), "{stderr}");
    assert!(stderr.contains(&format!("{dir}/ca.pem")), "{stderr}");
    assert!(stderr.contains("--force"), "{stderr}");
    assert_eq!(std::fs::read(mesh.join("ca.pem")).unwrap(), ca_before);
    assert!(!mesh.join("r2.pem").exists());

    // --force replaces them, and a key made world-readable meanwhile is
    // 0600 again.
    std::fs::set_permissions(mesh.join("r1.key"), std::fs::Permissions::from_mode(0o644)).unwrap();
    cert_ok(&["--out", dir, "--replicas", "2", "--force"]);
    assert_ne!(std::fs::read(mesh.join("ca.pem")).unwrap(), ca_before);
    assert_eq!(mode(&mesh.join("r1.key")), 0o600);
    assert_eq!(mode(&mesh.join("r2.key")), 0o600);
    assert_links(&mesh, "r2", "r1", "r2");
}

#[test]
fn cert_takes_replica_names_and_extra_names_and_refuses_bad_ones() {
    use x509_parser::prelude::{FromDer, GeneralName, X509Certificate};
    let tmp = TempDir::new("cert-names");
    let mesh = tmp.path("mesh");
    let dir = mesh.to_str().unwrap();
    cert_ok(&[
        "--out",
        dir,
        "--names",
        "alpha,beta.example",
        "--san",
        "10.0.0.7,mesh.example",
    ]);
    let beta = CertificateDer::from_pem_file(mesh.join("beta.example.pem")).unwrap();
    let (_, parsed) = X509Certificate::from_der(&beta).unwrap();
    let sans = &parsed
        .subject_alternative_name()
        .unwrap()
        .unwrap()
        .value
        .general_names;
    assert!(
        sans.contains(&GeneralName::DNSName("beta.example")),
        "{sans:?}"
    );
    assert!(
        sans.contains(&GeneralName::DNSName("mesh.example")),
        "{sans:?}"
    );
    assert!(
        sans.contains(&GeneralName::IPAddress(&[10, 0, 0, 7])),
        "{sans:?}"
    );
    // An extra name verifies too: alpha reached as mesh.example.
    assert_links(&mesh, "alpha", "beta.example", "mesh.example");

    let refusals: [(&[&str], &str); 5] = [
        (&["--names", "a,ca"], "ca.pem and ca.key are the CA's files"),
        (&["--names", "a,A"], "given twice"),
        (&["--names", "a/b"], "'/'"),
        (
            &["--replicas", "3", "--names", "a,b"],
            "--replicas 3 but --names gives 2",
        ),
        (&["--san", "not a name"], "--san entry"),
    ];
    let fresh = tmp.path("refused");
    for (args, says) in refusals {
        let mut all = vec!["--out", fresh.to_str().unwrap()];
        all.extend_from_slice(args);
        let out = cert(&all);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
        assert!(!fresh.exists(), "{args:?}: nothing is written");
    }
    // Out of range counts are clap's usage errors (exit 2).
    for count in ["0", "1001"] {
        let out = cert(&["--out", fresh.to_str().unwrap(), "--replicas", count]);
        assert_eq!(out.status.code(), Some(2), "--replicas {count}");
    }
}
