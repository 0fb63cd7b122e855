//! The mesh's TLS (DESIGN.md §11): TLS 1.3 only, mutual, with
//! `cluster.mesh_ca` as the only trust root and this replica's
//! `mesh_cert`/`mesh_key` (from `fleetmq cert`, shards/src/cert.rs) on
//! both ends. The dialer checks that the server's certificate names the
//! peer's replica ID (rustls' server name check on the DNS SAN); the
//! acceptor checks that the client's certificate names the replica its
//! Hello claims ([`names_replica`]).

use std::sync::Arc;

use anyhow::{bail, Context};
use fleetmq_core::cluster::settings::Cluster;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};

use super::RefusedFor;
use crate::tls::{load_certs, provider, read};

/// The mesh's client (dialing) and server (accepting) configurations.
pub(crate) struct MeshTls {
    pub(crate) client: Arc<ClientConfig>,
    pub(crate) server: Arc<ServerConfig>,
}

impl MeshTls {
    /// Load `mesh_cert`, `mesh_key` and `mesh_ca` of `cluster`; `None`
    /// when none of the three is set (no mesh).
    ///
    /// # Errors
    /// Only some of the three set; a file that cannot be read or holds no
    /// certificate or key; a certificate that does not name `replica`, or
    /// that `mesh_ca` did not sign (or expired); a key that does not go
    /// with the certificate. Each error names its key.
    pub(crate) fn load(cluster: &Cluster, replica: &str) -> anyhow::Result<Option<MeshTls>> {
        let set = [&cluster.mesh_cert, &cluster.mesh_key, &cluster.mesh_ca].map(|p| !p.as_os_str().is_empty());
        if set == [false; 3] {
            return Ok(None);
        }
        if set != [true; 3] {
            bail!("cluster.mesh_cert, cluster.mesh_key and cluster.mesh_ca go together (from `fleetmq cert`)");
        }
        let mut roots = RootCertStore::empty();
        for cert in load_certs("cluster.mesh_ca", &cluster.mesh_ca)? {
            roots.add(cert).with_context(|| format!("cluster.mesh_ca {}", cluster.mesh_ca.display()))?;
        }
        let roots = Arc::new(roots);
        let chain = load_certs("cluster.mesh_cert", &cluster.mesh_cert)?;
        if !names_replica(&chain[0], replica) {
            bail!(
                "cluster.mesh_cert {} does not name replica {replica} (made by `fleetmq cert --names {replica}`?)",
                cluster.mesh_cert.display()
            );
        }
        signed_by_ca(cluster, &roots, &chain, replica)?;
        let key_pem = read("cluster.mesh_key", &cluster.mesh_key)?;
        let key = PrivateKeyDer::from_pem_slice(&key_pem)
            .with_context(|| format!("cluster.mesh_key {}: no private key in the file", cluster.mesh_key.display()))?;
        let provider = provider();
        let verifier = WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone())
            .build()
            .with_context(|| format!("cluster.mesh_ca {}", cluster.mesh_ca.display()))?;
        let pair = || format!("cluster.mesh_cert and cluster.mesh_key ({}) do not make a pair", cluster.mesh_key.display());
        let server = ServerConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .context("TLS 1.3")?
            .with_client_cert_verifier(verifier)
            .with_single_cert(chain.clone(), key.clone_key())
            .with_context(pair)?;
        let client = ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .context("TLS 1.3")?
            .with_root_certificates(roots)
            .with_client_auth_cert(chain, key)
            .with_context(pair)?;
        Ok(Some(MeshTls { client: Arc::new(client), server: Arc::new(server) }))
    }
}

/// Checks that `mesh_ca` signed `chain` (a replica's certificate), that
/// it is valid now and names `replica`: as the peers will check it, so a
/// certificate from another deployment is refused at the start (and by
/// `fleetmq check-config`), not at every dial.
fn signed_by_ca(cluster: &Cluster, roots: &Arc<RootCertStore>, chain: &[CertificateDer<'static>], replica: &str) -> anyhow::Result<()> {
    use rustls::client::danger::ServerCertVerifier as _;
    let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(roots.clone(), provider())
        .build()
        .with_context(|| format!("cluster.mesh_ca {}", cluster.mesh_ca.display()))?;
    let name = ServerName::try_from(replica.to_owned())
        .with_context(|| format!("cluster.replica_id {replica}: not a certificate name"))?;
    verifier.verify_server_cert(&chain[0], &chain[1..], &name, &[], UnixTime::now()).map_err(|e| {
        anyhow::anyhow!(
            "cluster.mesh_cert {} is not a certificate of cluster.mesh_ca {} for replica {replica} ({e}; both from one `fleetmq cert`?)",
            cluster.mesh_cert.display(),
            cluster.mesh_ca.display()
        )
    })?;
    Ok(())
}

/// Why a mesh TLS handshake that failed with `e` is refused: a
/// certificate problem on either end (ours refused by the peer, as its
/// alert says, or the peer's refused here), else the protocol (not TLS,
/// a broken message). `None`: not a refusal (the connection went away).
pub(crate) fn refused_for(e: &std::io::Error) -> Option<RefusedFor> {
    use rustls::{AlertDescription as A, Error as E};
    if e.kind() != std::io::ErrorKind::InvalidData {
        return None;
    }
    let certificate = match e.get_ref().and_then(|inner| inner.downcast_ref::<E>()) {
        Some(E::InvalidCertificate(_) | E::NoCertificatesPresented | E::InvalidCertRevocationList(_)) => true,
        Some(E::AlertReceived(alert)) => matches!(
            alert,
            A::BadCertificate
                | A::UnsupportedCertificate
                | A::CertificateRevoked
                | A::CertificateExpired
                | A::CertificateUnknown
                | A::UnknownCA
                | A::CertificateRequired
                | A::BadCertificateStatusResponse
                | A::AccessDenied
        ),
        _ => false,
    };
    Some(if certificate { RefusedFor::Certificate } else { RefusedFor::Protocol })
}

/// Whether the DER certificate `der` carries `replica` as a DNS subject
/// alternative name (as `fleetmq cert` writes them; case-insensitive).
pub(crate) fn names_replica(der: &[u8], replica: &str) -> bool {
    use x509_parser::extensions::GeneralName;
    let Ok((_, cert)) = x509_parser::parse_x509_certificate(der) else { return false };
    let Ok(Some(san)) = cert.subject_alternative_name() else { return false };
    san.value
        .general_names
        .iter()
        .any(|name| matches!(name, GeneralName::DNSName(n) if n.eq_ignore_ascii_case(replica)))
}

#[cfg(test)]
mod tests {
    use std::io::{Error, ErrorKind};

    use rustls::{AlertDescription, CertificateError, InvalidMessage};

    use super::{refused_for, RefusedFor};

    fn tls(e: rustls::Error) -> Error {
        // As futures-rustls reports a failed handshake.
        Error::new(ErrorKind::InvalidData, e)
    }

    #[test]
    fn every_certificate_failure_or_alert_is_a_certificate_refusal() {
        for alert in [
            AlertDescription::UnknownCA,
            AlertDescription::BadCertificate,
            AlertDescription::CertificateRequired,
            AlertDescription::CertificateExpired,
            AlertDescription::CertificateUnknown,
        ] {
            // "received fatal alert: UnknownCA": was counted as protocol.
            assert_eq!(refused_for(&tls(rustls::Error::AlertReceived(alert))), Some(RefusedFor::Certificate), "{alert:?}");
        }
        for e in [
            rustls::Error::InvalidCertificate(CertificateError::UnknownIssuer),
            rustls::Error::InvalidCertificate(CertificateError::NotValidForName),
            rustls::Error::NoCertificatesPresented,
        ] {
            assert_eq!(refused_for(&tls(e.clone())), Some(RefusedFor::Certificate), "{e}");
        }
    }

    #[test]
    fn not_tls_is_a_protocol_refusal_and_a_dropped_connection_none() {
        let plaintext = rustls::Error::InvalidMessage(InvalidMessage::InvalidContentType);
        assert_eq!(refused_for(&tls(plaintext)), Some(RefusedFor::Protocol));
        assert_eq!(refused_for(&tls(rustls::Error::AlertReceived(AlertDescription::HandshakeFailure))), Some(RefusedFor::Protocol));
        assert_eq!(refused_for(&Error::from(ErrorKind::UnexpectedEof)), None);
    }
}
