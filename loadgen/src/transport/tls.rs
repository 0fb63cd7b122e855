//! The rustls client configuration of `mqtts://` and `wss://` connections
//! (ring provider, TLS 1.2 and 1.3, as the broker's `shards/src/tls.rs`),
//! and the mapping of TLS failures to [`ClientError::Tls`].

use std::path::Path;
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};

use super::TransportArgs;
use crate::client::ClientError;

/// Where the system CA bundle is looked for when `--ca-file` is absent,
/// after `$SSL_CERT_FILE`: Debian/Ubuntu/Alpine, then Fedora/RHEL.
pub const SYSTEM_CA_BUNDLES: [&str; 2] = [
    "/etc/ssl/certs/ca-certificates.crt",
    "/etc/pki/tls/certs/ca-bundle.crt",
];

/// Builds the client configuration from `--ca-file` (else the system
/// bundle) or `--insecure`, with `--cert`/`--key` for mutual TLS.
///
/// # Errors
/// A message naming the option and file: unreadable, no PEM certificate or
/// key in it, a certificate the root store refuses, a key that does not
/// fit the certificate; or no CA source at all.
pub fn client_config(args: &TransportArgs) -> Result<Arc<ClientConfig>, String> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ClientConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS12, &rustls::version::TLS13])
        .map_err(|e| format!("TLS protocol versions: {e}"))?;
    let builder = if args.insecure {
        builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(AnyCertificate(provider)))
    } else {
        builder.with_root_certificates(roots(args.ca_file.as_deref())?)
    };
    let config = match (&args.cert, &args.key) {
        (Some(cert), Some(key)) => {
            let chain = load_certs("--cert", cert)?;
            let pem = read("--key", key)?;
            let key_der = PrivateKeyDer::from_pem_slice(&pem)
                .map_err(|e| format!("--key {}: no private key in the file: {e}", key.display()))?;
            builder.with_client_auth_cert(chain, key_der).map_err(|e| {
                format!(
                    "--cert {} and --key {} do not make a usable pair: {e}",
                    cert.display(),
                    key.display()
                )
            })?
        }
        _ => builder.with_no_client_auth(),
    };
    Ok(Arc::new(config))
}

/// The trusted roots: `ca_file`, else `$SSL_CERT_FILE`, else the first of
/// [`SYSTEM_CA_BUNDLES`] that exists.
fn roots(ca_file: Option<&Path>) -> Result<RootCertStore, String> {
    let (what, path) = match ca_file {
        Some(p) => ("--ca-file", p.to_path_buf()),
        None => {
            let env = std::env::var_os("SSL_CERT_FILE").map(std::path::PathBuf::from);
            let found = env
                .into_iter()
                .chain(SYSTEM_CA_BUNDLES.map(Into::into))
                .find(|p| p.exists());
            match found {
                Some(p) => ("system CA bundle", p),
                None => {
                    return Err(format!(
                        "mqtts:// and wss:// need --ca-file PEM (or --insecure): no system CA \
                         bundle ($SSL_CERT_FILE, {})",
                        SYSTEM_CA_BUNDLES.join(", ")
                    ))
                }
            }
        }
    };
    let mut roots = RootCertStore::empty();
    for cert in load_certs(what, &path)? {
        roots
            .add(cert)
            .map_err(|e| format!("{what} {}: {e}", path.display()))?;
    }
    Ok(roots)
}

fn read(what: &str, path: &Path) -> Result<Vec<u8>, String> {
    std::fs::read(path).map_err(|e| format!("{what} {}: {e}", path.display()))
}

fn load_certs(what: &str, path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let pem = read(what, path)?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("{what} {}: bad PEM: {e}", path.display()))?;
    if certs.is_empty() {
        return Err(format!(
            "{what} {}: no CERTIFICATE in the file",
            path.display()
        ));
    }
    Ok(certs)
}

/// The name the broker's certificate must carry: the URL's host, a DNS
/// name or an IP address.
///
/// # Errors
/// [`ClientError::Tls`] for a host that is neither.
pub fn server_name(host: &str) -> Result<ServerName<'static>, ClientError> {
    ServerName::try_from(host.to_string())
        .map_err(|e| ClientError::Tls(format!("`{host}` is not a valid TLS server name: {e}")))
}

/// An I/O error of a stream as a [`ClientError`]: a TLS failure (bad
/// certificate, alert from the broker) becomes [`ClientError::Tls`], a
/// timeout [`ClientError::Timeout`], an end of stream without TLS
/// close_notify [`ClientError::Closed`] (as on TCP), anything else
/// [`ClientError::Io`].
pub fn classify_io(e: std::io::Error) -> ClientError {
    match e.kind() {
        std::io::ErrorKind::TimedOut => return ClientError::Timeout("data"),
        std::io::ErrorKind::UnexpectedEof => return ClientError::Closed,
        _ => {}
    }
    match e
        .get_ref()
        .and_then(|inner| inner.downcast_ref::<rustls::Error>())
    {
        Some(tls) => ClientError::Tls(tls.to_string()),
        None => ClientError::Io(e),
    }
}

/// `--insecure`: any certificate for any name is accepted; the handshake
/// signatures are still verified with the provider's algorithms.
#[derive(Debug)]
struct AnyCertificate(Arc<CryptoProvider>);

impl ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_names_take_dns_names_and_ip_addresses() {
        assert!(matches!(
            server_name("broker.example").unwrap(),
            ServerName::DnsName(_)
        ));
        assert!(matches!(
            server_name("::1").unwrap(),
            ServerName::IpAddress(_)
        ));
        assert!(matches!(server_name("bad name!"), Err(ClientError::Tls(_))));
    }

    #[test]
    fn tls_errors_inside_io_errors_are_named_tls() {
        let e = std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            rustls::Error::InvalidCertificate(rustls::CertificateError::UnknownIssuer),
        );
        let c = classify_io(e);
        assert!(matches!(c, ClientError::Tls(_)));
        assert!(c.to_string().starts_with("TLS handshake failed"), "{c}");
    }
}
