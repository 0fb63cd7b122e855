//! TLS for the `tls` and `wss` listeners (DESIGN.md §11, `[tls]` in §15).
//!
//! [`TlsConfig`] builds a `rustls::ServerConfig` (ring provider, TLS 1.2
//! and 1.3) from the certificate chain and key PEM files, with an optional
//! client CA for mutual TLS. The files are re-read when they change: at most
//! once per second, [`TlsConfig::current`] compares their modification time,
//! length and inode with what it last loaded, and the next handshake uses
//! the new certificate. A change that does not load (a half-written file, a
//! key that does not match) keeps the previous configuration and is logged.
//! Replace certificate files by rename (as certbot and Kubernetes do) so that
//! a handshake never sees a half-written file.
//!
//! [`peer_identity`] names a client by its certificate, for
//! `tls.use_identity_as_username`.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use anyhow::{bail, Context};
use fleetmq_core::settings::Tls as TlsSettings;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig, ServerConnection};

/// How often [`TlsConfig::current`] looks at the files at most.
pub const CHECK_INTERVAL: Duration = Duration::from_secs(1);

/// The longest certificate, key or CA file read (PEM): a chain or a CA
/// bundle is kilobytes; a path to something else (`/dev/zero`) must not
/// take the memory.
pub const PEM_MAX_BYTES: u64 = 16 << 20;

/// What identifies one version of a file without reading it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stamp {
    modified: Option<SystemTime>,
    len: u64,
    inode: u64,
}

fn stamp(path: &Path) -> Option<Stamp> {
    let meta = std::fs::metadata(path).ok()?;
    #[cfg(unix)]
    let inode = std::os::unix::fs::MetadataExt::ino(&meta);
    #[cfg(not(unix))]
    let inode = 0;
    Some(Stamp {
        modified: meta.modified().ok(),
        len: meta.len(),
        inode,
    })
}

#[derive(Debug, Clone)]
struct Files {
    cert: PathBuf,
    key: PathBuf,
    client_ca: Option<PathBuf>,
    require_client_cert: bool,
}

impl Files {
    fn stamps(&self) -> Vec<Option<Stamp>> {
        let mut paths = vec![&self.cert, &self.key];
        paths.extend(&self.client_ca);
        paths.into_iter().map(|p| stamp(p)).collect()
    }
}

#[derive(Debug)]
struct State {
    config: Arc<ServerConfig>,
    stamps: Vec<Option<Stamp>>,
    last_check: Instant,
}

/// The TLS server configuration, reloaded when its files change. `Send +
/// Sync`: one is shared by every shard.
#[derive(Debug)]
pub struct TlsConfig {
    files: Files,
    interval: Duration,
    state: Mutex<State>,
}

impl TlsConfig {
    /// Loads `tls.cert`, `tls.key` and, when set, `tls.client_ca`. With a
    /// client CA, clients presenting a certificate must present one it
    /// signed; with `require_client_cert` too, clients without one are
    /// refused in the handshake.
    ///
    /// # Errors
    ///
    /// `tls.cert` or `tls.key` unset, `require_client_cert` without
    /// `client_ca`, a file that cannot be read or holds no PEM item of the
    /// right kind, or a key that does not match the certificate; the
    /// message names the file.
    pub fn new(settings: &TlsSettings) -> anyhow::Result<TlsConfig> {
        if settings.cert.as_os_str().is_empty() || settings.key.as_os_str().is_empty() {
            bail!("tls.cert and tls.key must both be set for TLS and WSS listeners");
        }
        let client_ca =
            (!settings.client_ca.as_os_str().is_empty()).then(|| settings.client_ca.clone());
        if settings.require_client_cert && client_ca.is_none() {
            bail!("tls.require_client_cert = true needs tls.client_ca");
        }
        let files = Files {
            cert: settings.cert.clone(),
            key: settings.key.clone(),
            client_ca,
            require_client_cert: settings.require_client_cert,
        };
        let stamps = files.stamps();
        let config = build(&files)?;
        Ok(TlsConfig {
            files,
            interval: CHECK_INTERVAL,
            state: Mutex::new(State {
                config,
                stamps,
                last_check: Instant::now(),
            }),
        })
    }

    /// The configuration for the next handshake. At most once per
    /// [`CHECK_INTERVAL`] this looks at the files and, when one changed,
    /// loads them again; on failure the previous configuration stays (and
    /// the failure is logged, once per change).
    pub fn current(&self) -> Arc<ServerConfig> {
        let mut state = self.lock();
        if state.last_check.elapsed() >= self.interval {
            state.last_check = Instant::now();
            let stamps = self.files.stamps();
            if stamps != state.stamps {
                state.stamps = stamps;
                match build(&self.files) {
                    Ok(config) => {
                        tracing::info!("tls: reloaded {}", self.files.cert.display());
                        state.config = config;
                    }
                    Err(err) => tracing::error!(
                        "tls: changed files do not load, keeping the previous certificate: {err:#}"
                    ),
                }
            }
        }
        state.config.clone()
    }

    /// Loads the files now, whether or not they changed (e.g. on SIGHUP).
    ///
    /// # Errors
    ///
    /// As [`TlsConfig::new`]; the previous configuration then stays.
    pub fn reload(&self) -> anyhow::Result<()> {
        let stamps = self.files.stamps();
        let config = build(&self.files)?;
        let mut state = self.lock();
        state.config = config;
        state.stamps = stamps;
        state.last_check = Instant::now();
        Ok(())
    }

    /// An acceptor for the next handshake, over any `futures-io` stream
    /// (glommio's `TcpStream`): `acceptor().accept(stream).await`.
    pub fn acceptor(&self) -> futures_rustls::TlsAcceptor {
        futures_rustls::TlsAcceptor::from(self.current())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The ring provider: builds without cmake or nasm.
pub(crate) fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

pub(crate) fn read(what: &str, path: &Path) -> anyhow::Result<Vec<u8>> {
    use std::io::Read;
    let file = std::fs::File::open(path).with_context(|| format!("{what} {}", path.display()))?;
    let mut pem = Vec::new();
    // One byte more than allowed tells a file that is too long (or
    // endless, as /dev/zero) without reading it all.
    file.take(PEM_MAX_BYTES + 1)
        .read_to_end(&mut pem)
        .with_context(|| format!("{what} {}", path.display()))?;
    if pem.len() as u64 > PEM_MAX_BYTES {
        bail!("{what} {}: longer than {} MiB; not a certificate or key file", path.display(), PEM_MAX_BYTES >> 20);
    }
    Ok(pem)
}

pub(crate) fn load_certs(what: &str, path: &Path) -> anyhow::Result<Vec<CertificateDer<'static>>> {
    let pem = read(what, path)?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("{what} {}: bad PEM", path.display()))?;
    if certs.is_empty() {
        bail!("{what} {}: no CERTIFICATE in the file", path.display());
    }
    Ok(certs)
}

fn build(files: &Files) -> anyhow::Result<Arc<ServerConfig>> {
    let chain = load_certs("tls.cert", &files.cert)?;
    let key_pem = read("tls.key", &files.key)?;
    let key = PrivateKeyDer::from_pem_slice(&key_pem).with_context(|| {
        format!(
            "tls.key {}: no private key in the file",
            files.key.display()
        )
    })?;
    let provider = provider();
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS12, &rustls::version::TLS13])
        .context("TLS protocol versions")?;
    let builder = match &files.client_ca {
        None => builder.with_no_client_auth(),
        Some(path) => {
            let mut roots = RootCertStore::empty();
            for cert in load_certs("tls.client_ca", path)? {
                roots
                    .add(cert)
                    .with_context(|| format!("tls.client_ca {}", path.display()))?;
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider);
            let verifier = if files.require_client_cert {
                verifier
            } else {
                verifier.allow_unauthenticated()
            };
            let verifier = verifier
                .build()
                .with_context(|| format!("tls.client_ca {}", path.display()))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let config = builder.with_single_cert(chain, key).with_context(|| {
        format!(
            "tls.cert {} and tls.key {} do not make a usable pair",
            files.cert.display(),
            files.key.display()
        )
    })?;
    Ok(Arc::new(config))
}

/// The identity in the client's certificate: the subject's common name,
/// else the first DNS name or e-mail address among its subject alternative
/// names. `None` when the client sent no certificate or none of these.
pub fn peer_identity(conn: &ServerConnection) -> Option<String> {
    certificate_identity(conn.peer_certificates()?.first()?)
}

/// [`peer_identity`] of one DER certificate.
pub fn certificate_identity(der: &[u8]) -> Option<String> {
    use x509_parser::extensions::GeneralName;
    let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
    let cn = cert
        .subject()
        .iter_common_name()
        .find_map(|cn| cn.as_str().ok())
        .filter(|cn| !cn.is_empty());
    if let Some(cn) = cn {
        return Some(cn.to_owned());
    }
    let san = cert.subject_alternative_name().ok()??;
    san.value.general_names.iter().find_map(|name| match name {
        GeneralName::DNSName(n) | GeneralName::RFC822Name(n) if !n.is_empty() => {
            Some((*n).to_owned())
        }
        _ => None,
    })
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};

    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair, SanType};
    use rustls::{ClientConfig, ClientConnection};

    use super::*;

    /// A file of [`PEM_MAX_BYTES`] is read, one byte more is refused
    /// naming the limit; the README states the same limit for the mesh
    /// files (which it said was 1 MiB while 16 MiB were read).
    #[test]
    fn files_up_to_the_pem_limit_are_read_and_the_readme_states_that_limit() {
        let dir = std::env::temp_dir().join(format!("fleetmq-pem-limit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("big.pem");
        let mut bytes = vec![b'A'; PEM_MAX_BYTES as usize];
        std::fs::write(&path, &bytes).unwrap();
        assert_eq!(read("cluster.mesh_ca", &path).unwrap().len() as u64, PEM_MAX_BYTES);
        bytes.push(b'A');
        std::fs::write(&path, &bytes).unwrap();
        let err = read("cluster.mesh_ca", &path).unwrap_err().to_string();
        assert!(err.contains("longer than 16 MiB"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
        let readme = include_str!("../../README.md");
        let stated = format!("readable PEM (at most {} MiB each)", PEM_MAX_BYTES >> 20);
        assert!(readme.contains(&stated), "README does not say {stated:?}");
    }

    struct Ca {
        cert: rcgen::Certificate,
        key: KeyPair,
    }

    fn ca(name: &str) -> Ca {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.distinguished_name.push(DnType::CommonName, name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let key = KeyPair::generate().unwrap();
        let cert = params.self_signed(&key).unwrap();
        Ca { cert, key }
    }

    /// A certificate signed by `ca`: (PEM chain, PEM key).
    fn issue(ca: &Ca, cn: Option<&str>, sans: &[&str]) -> (String, String) {
        let mut params =
            CertificateParams::new(sans.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap();
        params.distinguished_name = rcgen::DistinguishedName::new();
        if let Some(cn) = cn {
            params.distinguished_name.push(DnType::CommonName, cn);
        }
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &ca.cert, &ca.key).unwrap();
        (cert.pem(), key.serialize_pem())
    }

    struct Dir(PathBuf);

    impl Dir {
        fn new(name: &str) -> Dir {
            let dir =
                std::env::temp_dir().join(format!("fleetmq-tls-{name}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            Dir(dir)
        }

        /// Writes by rename, as certificate tools do.
        fn put(&self, name: &str, text: &str) -> PathBuf {
            let path = self.0.join(name);
            let tmp = self.0.join(format!(".{name}.tmp"));
            std::fs::write(&tmp, text).unwrap();
            std::fs::rename(&tmp, &path).unwrap();
            path
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn server_settings(dir: &Dir, ca: &Ca, cn: &str) -> TlsSettings {
        let (cert, key) = issue(ca, Some(cn), &["localhost"]);
        TlsSettings {
            cert: dir.put("server.pem", &cert),
            key: dir.put("server.key", &key),
            ..TlsSettings::default()
        }
    }

    fn client_config(ca: &Ca, client: Option<(String, String)>) -> Arc<ClientConfig> {
        let mut roots = RootCertStore::empty();
        roots.add(ca.cert.der().clone()).unwrap();
        let builder = ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots);
        let config = match client {
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

    /// Runs a handshake in memory and exchanges one message; returns the
    /// server side and the server certificate the client saw.
    fn handshake(
        server: Arc<ServerConfig>,
        client: Arc<ClientConfig>,
    ) -> Result<(ServerConnection, Vec<u8>), rustls::Error> {
        let mut s = ServerConnection::new(server)?;
        let mut c = ClientConnection::new(client, "localhost".try_into().unwrap())?;
        c.writer().write_all(b"ping").unwrap();
        for _ in 0..20 {
            let mut buf = Vec::new();
            c.write_tls(&mut buf).unwrap();
            s.read_tls(&mut buf.as_slice()).unwrap();
            let server_result = s.process_new_packets();
            let mut buf = Vec::new();
            s.write_tls(&mut buf).unwrap();
            c.read_tls(&mut buf.as_slice()).unwrap();
            server_result?;
            c.process_new_packets()?;
            if !s.is_handshaking() && !c.is_handshaking() {
                let mut got = [0u8; 4];
                if s.reader().read_exact(&mut got).is_ok() {
                    assert_eq!(&got, b"ping");
                    let seen = c.peer_certificates().unwrap()[0].to_vec();
                    return Ok((s, seen));
                }
            }
        }
        panic!("handshake did not finish");
    }

    fn der_of(pem: &str) -> Vec<u8> {
        CertificateDer::pem_slice_iter(pem.as_bytes())
            .next()
            .unwrap()
            .unwrap()
            .to_vec()
    }

    #[test]
    fn a_server_certificate_serves_tls_1_2_and_1_3() {
        let dir = Dir::new("serve");
        let ca = ca("test CA");
        let tls = TlsConfig::new(&server_settings(&dir, &ca, "broker")).unwrap();
        for version in [&rustls::version::TLS12, &rustls::version::TLS13] {
            let client = ClientConfig::builder_with_provider(provider())
                .with_protocol_versions(&[version])
                .unwrap()
                .with_root_certificates({
                    let mut roots = RootCertStore::empty();
                    roots.add(ca.cert.der().clone()).unwrap();
                    roots
                })
                .with_no_client_auth();
            let (server, _) = handshake(tls.current(), Arc::new(client)).unwrap();
            assert_eq!(server.protocol_version(), Some(version.version));
            assert_eq!(peer_identity(&server), None, "no client certificate");
        }
    }

    #[test]
    fn mutual_tls_accepts_signed_clients_and_names_them() {
        let dir = Dir::new("mtls");
        let ca = ca("test CA");
        let clients = ca_named(&dir, "clients CA");
        let mut settings = server_settings(&dir, &ca, "broker");
        settings.client_ca = clients.1;
        settings.require_client_cert = true;
        let tls = TlsConfig::new(&settings).unwrap();

        let signed = issue(&clients.0, Some("device-42"), &[]);
        let (server, _) = handshake(tls.current(), client_config(&ca, Some(signed))).unwrap();
        assert_eq!(peer_identity(&server).as_deref(), Some("device-42"));

        let other_ca = ca_named(&dir, "other CA").0;
        let stranger = issue(&other_ca, Some("intruder"), &[]);
        assert!(handshake(tls.current(), client_config(&ca, Some(stranger))).is_err());
        assert!(
            handshake(tls.current(), client_config(&ca, None)).is_err(),
            "certificate required"
        );

        settings.require_client_cert = false;
        let optional = TlsConfig::new(&settings).unwrap();
        let (server, _) = handshake(optional.current(), client_config(&ca, None)).unwrap();
        assert_eq!(peer_identity(&server), None);
    }

    /// A CA whose certificate is written to `NAME.pem` in `dir`.
    fn ca_named(dir: &Dir, name: &str) -> (Ca, PathBuf) {
        let ca = ca(name);
        let path = dir.put(&format!("{}.pem", name.replace(' ', "-")), &ca.cert.pem());
        (ca, path)
    }

    #[test]
    fn the_identity_is_the_common_name_else_the_first_dns_or_email_san() {
        let ca = ca("test CA");
        let both = issue(&ca, Some("cn-name"), &["dns.example"]).0;
        assert_eq!(
            certificate_identity(&der_of(&both)).as_deref(),
            Some("cn-name")
        );
        let san_only = issue(&ca, None, &["dns.example", "other.example"]).0;
        assert_eq!(
            certificate_identity(&der_of(&san_only)).as_deref(),
            Some("dns.example")
        );

        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.distinguished_name = rcgen::DistinguishedName::new();
        params.subject_alt_names = vec![SanType::Rfc822Name("dev@example.com".try_into().unwrap())];
        let key = KeyPair::generate().unwrap();
        let email = params.signed_by(&key, &ca.cert, &ca.key).unwrap();
        assert_eq!(
            certificate_identity(email.der()).as_deref(),
            Some("dev@example.com")
        );
        assert_eq!(certificate_identity(b"not DER"), None);
    }

    #[test]
    fn a_changed_certificate_is_used_by_the_next_handshake() {
        let dir = Dir::new("reload");
        let ca = ca("test CA");
        let settings = server_settings(&dir, &ca, "first");
        let mut tls = TlsConfig::new(&settings).unwrap();
        tls.interval = Duration::ZERO;
        let first = std::fs::read_to_string(&settings.cert).unwrap();
        let (_, seen) = handshake(tls.current(), client_config(&ca, None)).unwrap();
        assert_eq!(seen, der_of(&first));

        let (cert, key) = issue(&ca, Some("second"), &["localhost"]);
        dir.put("server.key", &key);
        dir.put("server.pem", &cert);
        let (_, seen) = handshake(tls.current(), client_config(&ca, None)).unwrap();
        assert_eq!(seen, der_of(&cert));

        // A broken file keeps the working configuration.
        let before = tls.current();
        dir.put(
            "server.pem",
            "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n",
        );
        let after = tls.current();
        assert!(Arc::ptr_eq(&before, &after));
        assert!(tls.reload().is_err());
        let (_, seen) = handshake(tls.current(), client_config(&ca, None)).unwrap();
        assert_eq!(seen, der_of(&cert));
    }

    #[test]
    fn files_are_looked_at_no_more_than_once_per_interval() {
        let dir = Dir::new("interval");
        let ca = ca("test CA");
        let settings = server_settings(&dir, &ca, "first");
        let mut tls = TlsConfig::new(&settings).unwrap();
        tls.interval = Duration::from_secs(3600);
        let before = tls.current();
        let (cert, key) = issue(&ca, Some("second"), &["localhost"]);
        dir.put("server.key", &key);
        dir.put("server.pem", &cert);
        assert!(Arc::ptr_eq(&before, &tls.current()));
        tls.reload().unwrap();
        let (_, seen) = handshake(tls.current(), client_config(&ca, None)).unwrap();
        assert_eq!(seen, der_of(&cert));
    }

    #[test]
    fn bad_settings_and_files_are_named() {
        let dir = Dir::new("bad");
        let err = TlsConfig::new(&TlsSettings::default())
            .unwrap_err()
            .to_string();
        assert!(err.contains("tls.cert and tls.key"), "{err}");
        let ca = ca("test CA");
        let mut settings = server_settings(&dir, &ca, "x");
        settings.require_client_cert = true;
        let err = TlsConfig::new(&settings).unwrap_err().to_string();
        assert!(err.contains("tls.client_ca"), "{err}");
        settings.require_client_cert = false;
        settings.key = dir.put("empty.key", "");
        let err = format!("{:#}", TlsConfig::new(&settings).unwrap_err());
        assert!(err.contains("empty.key"), "{err}");
        let other_key = KeyPair::generate().unwrap().serialize_pem();
        settings.key = dir.put("other.key", &other_key);
        let err = format!("{:#}", TlsConfig::new(&settings).unwrap_err());
        assert!(err.contains("usable pair"), "{err}");
        settings.cert = dir.0.join("missing.pem");
        let err = format!("{:#}", TlsConfig::new(&settings).unwrap_err());
        assert!(err.contains("missing.pem"), "{err}");
    }

    #[test]
    fn the_acceptor_completes_a_handshake_over_an_async_stream() {
        let dir = Dir::new("acceptor");
        let ca = ca("test CA");
        let tls = TlsConfig::new(&server_settings(&dir, &ca, "broker")).unwrap();
        let acceptor = tls.acceptor();
        let connector = futures_rustls::TlsConnector::from(client_config(&ca, None));
        glommio::LocalExecutorBuilder::default()
            .spawn(move || async move {
                use futures_lite::{AsyncReadExt, AsyncWriteExt};
                let listener = glommio::net::TcpListener::bind("127.0.0.1:0").unwrap();
                let addr = listener.local_addr().unwrap();
                let server = glommio::spawn_local(async move {
                    let stream = listener.accept().await.unwrap();
                    let mut tls = acceptor.accept(stream).await.unwrap();
                    let mut buf = [0u8; 5];
                    tls.read_exact(&mut buf).await.unwrap();
                    tls.write_all(b"world").await.unwrap();
                    tls.flush().await.unwrap();
                    buf
                });
                let stream = glommio::net::TcpStream::connect(addr).await.unwrap();
                let name = "localhost".try_into().unwrap();
                let mut tls = connector.connect(name, stream).await.unwrap();
                tls.write_all(b"hello").await.unwrap();
                tls.flush().await.unwrap();
                let mut buf = [0u8; 5];
                tls.read_exact(&mut buf).await.unwrap();
                assert_eq!(&buf, b"world");
                assert_eq!(&server.await, b"hello");
            })
            .unwrap()
            .join()
            .unwrap();
    }
}
