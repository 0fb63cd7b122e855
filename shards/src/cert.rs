//! `fleetmq cert --out DIR [--replicas N] [--names a,b,c] [--san ...]
//! [--days D] [--force]`: the mesh CA and one certificate per replica
//! (DESIGN.md §11 and §15).
//!
//! Writes `DIR/ca.pem` and `DIR/ca.key` (the mesh CA, path length 0), and
//! per replica `DIR/<name>.pem` and `DIR/<name>.key`, the names being
//! `r1`..`rN` or those given with `--names`. Each replica certificate is
//! signed by the CA, carries the extended key usages serverAuth and
//! clientAuth (one certificate both accepts and dials mesh links with TLS
//! 1.3 mutual authentication), and the subject alternative names: the
//! replica name (a DNS name) and every `--san` entry (DNS names or IP
//! addresses). Keys are ECDSA P-256 in PKCS#8 PEM, written with mode 0600;
//! certificates with mode 0644. Nothing is written when any of the files
//! exists, unless `--force`; nothing is written either when a name is
//! refused.
//!
//! With `--ca-cert FILE --ca-key FILE` (a CA made by an earlier `fleetmq
//! cert`), no CA is made: the replica certificates are signed by that
//! one, so a replica joins a deployment without new certificates for the
//! others; only `<name>.pem` and `<name>.key` are written, valid until
//! `--days` from now or the CA's own end, whichever is first.

use std::fs::{OpenOptions, Permissions};
use std::io::Write;
use std::net::IpAddr;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use fleetmq_core::cluster::names::{check_dns_name, check_replica_id, NameError, CA_STEM};
use rand::RngCore;
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose, SanType, SerialNumber,
};
use time::{Duration, OffsetDateTime};

/// The replica count when neither `--replicas` nor `--names` is given.
pub const DEFAULT_REPLICAS: u16 = 3;
/// The most replicas one `fleetmq cert` makes certificates for.
pub const MAX_REPLICAS: u16 = 1000;
/// Validity of the CA and the replica certificates when `--days` is not
/// given: 3650 days (about ten years).
pub const DEFAULT_DAYS: u32 = 3650;

/// Arguments of `fleetmq cert` (DESIGN.md §15).
#[derive(Debug, Clone, clap::Args)]
pub struct CertArgs {
    /// The folder to write into; created when missing.
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    /// How many replicas, named r1..rN (1 to 1000; default 3). With
    /// --names, it must equal the number of names.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..=i64::from(MAX_REPLICAS)))]
    pub replicas: Option<u16>,
    /// The replica IDs (`cluster.replica_id`), comma-separated: DNS names
    /// of letters, digits, `-` and `.`; each becomes its certificate's
    /// subject alternative name and its file name (NAME.pem, NAME.key).
    #[arg(long, value_name = "A,B,C", value_delimiter = ',')]
    pub names: Vec<String>,
    /// Extra subject alternative names for every replica certificate,
    /// comma-separated: DNS names or IP addresses (e.g.
    /// `mesh.example.net,10.0.0.7`).
    #[arg(long, value_name = "NAME|IP,...", value_delimiter = ',')]
    pub san: Vec<String>,
    /// Validity of the CA and the certificates, days from now (1 to
    /// 36500; default 3650).
    #[arg(long, value_name = "D", default_value_t = DEFAULT_DAYS,
          value_parser = clap::value_parser!(u32).range(1..=36_500))]
    pub days: u32,
    /// Replace files that exist (otherwise nothing is written and the
    /// existing files are named).
    #[arg(long)]
    pub force: bool,
    /// Sign with this existing mesh CA certificate (PEM, from an earlier
    /// `fleetmq cert`) instead of making a new CA: adds replicas to a
    /// deployment. Goes with --ca-key.
    #[arg(long, value_name = "FILE", requires = "ca_key")]
    pub ca_cert: Option<PathBuf>,
    /// The existing CA's key (PEM). Goes with --ca-cert.
    #[arg(long, value_name = "FILE", requires = "ca_cert")]
    pub ca_key: Option<PathBuf>,
}

/// One certificate and its private key, both PEM.
#[derive(Debug, Clone)]
pub struct Issued {
    /// The file stem: `ca` or the replica name.
    pub name: String,
    /// The certificate, PEM (`-----BEGIN CERTIFICATE-----`).
    pub cert_pem: String,
    /// The private key, PKCS#8 PEM (`-----BEGIN PRIVATE KEY-----`).
    pub key_pem: String,
}

/// What `fleetmq cert` writes: the CA first, then one entry per replica.
#[derive(Debug, Clone)]
pub struct MeshCerts {
    /// The mesh CA.
    pub ca: Issued,
    /// One per replica, in the order the names were given.
    pub replicas: Vec<Issued>,
    /// The end of the validity of every certificate.
    pub not_after: OffsetDateTime,
}

/// Carries out `fleetmq cert` and returns the lines to print on success,
/// one per certificate written.
///
/// # Errors
///
/// A refused replica name or `--san` entry, `--replicas` and `--names`
/// disagreeing, files that exist (without `--force`), or a folder or file
/// that cannot be created or written (named in the message).
pub fn run_cert(args: &CertArgs) -> anyhow::Result<Vec<String>> {
    let names = replica_names(args.replicas, &args.names)?;
    let extra = extra_sans(&args.san)?;
    let existing_ca = match (&args.ca_cert, &args.ca_key) {
        (Some(cert), Some(key)) => Some(load_ca(cert, key)?),
        _ => None,
    };
    let mut files = planned_files(&args.out, &names);
    if existing_ca.is_some() {
        // The CA's files are not written.
        files.drain(..2);
    }
    if !args.force {
        let existing: Vec<String> = files
            .iter()
            .filter(|path| path.symlink_metadata().is_ok())
            .map(|path| path.display().to_string())
            .collect();
        if !existing.is_empty() {
            bail!(
                "refusing to overwrite {} (nothing written; --force replaces them)",
                existing.join(", ")
            );
        }
    }
    let now = OffsetDateTime::now_utc();
    let certs = match &existing_ca {
        Some(ca) => sign_with(ca, &names, &extra, args.days, now)?,
        None => generate(&names, &extra, args.days, now)?,
    };
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating the folder {}", args.out.display()))?;
    let ca = existing_ca.is_none().then_some(&certs.ca);
    for issued in ca.into_iter().chain(&certs.replicas) {
        let (cert, key) = file_pair(&args.out, &issued.name);
        write_file(&cert, &issued.cert_pem, 0o644, args.force)?;
        write_file(&key, &issued.key_pem, 0o600, args.force)?;
    }
    let until = certs.not_after.date();
    let dir = args.out.display();
    let mut lines = match &args.ca_cert {
        None => vec![format!(
            "wrote {dir}/ca.pem and {dir}/ca.key: the mesh CA, valid until {until} (keep ca.key off the replicas)"
        )],
        Some(ca) => vec![format!("signed by the mesh CA {} (not written again)", ca.display())],
    };
    lines.extend(names.iter().map(|n| {
        format!("wrote {dir}/{n}.pem and {dir}/{n}.key: replica {n}, valid until {until}")
    }));
    Ok(lines)
}

/// The replica names: `--names` as given, or `r1`..`rN`.
///
/// # Errors
///
/// A name refused by [`check_replica_name`], a name given twice (ignoring
/// case), or `replicas` different from the number of names.
pub fn replica_names(replicas: Option<u16>, names: &[String]) -> anyhow::Result<Vec<String>> {
    if names.is_empty() {
        let n = replicas.unwrap_or(DEFAULT_REPLICAS);
        return Ok((1..=n).map(|i| format!("r{i}")).collect());
    }
    if let Some(n) = replicas {
        if usize::from(n) != names.len() {
            bail!(
                "--replicas {n} but --names gives {} names (give one of them, or make them agree)",
                names.len()
            );
        }
    }
    if names.len() > usize::from(MAX_REPLICAS) {
        bail!(
            "--names gives {} names; at most {MAX_REPLICAS}",
            names.len()
        );
    }
    let mut seen = std::collections::HashSet::new();
    for name in names {
        check_replica_name(name)?;
        if !seen.insert(name.to_ascii_lowercase()) {
            bail!("replica name {name:?} is given twice (names are compared ignoring case)");
        }
    }
    Ok(names.to_vec())
}

/// Checks that `name` can be a replica ID here, by the rules of
/// `cluster.replica_id` ([`check_replica_id`]): a DNS name (labels of 1 to
/// 63 ASCII letters, digits and `-`, not starting or ending with `-`,
/// joined by `.`; 253 bytes at most), not an IP address, and not `ca`
/// (that file is the CA's).
///
/// # Errors
///
/// The rule broken, naming the name.
pub fn check_replica_name(name: &str) -> anyhow::Result<()> {
    // One rule for `cluster.replica_id` and `--names`.
    match check_replica_id(name) {
        Ok(()) => Ok(()),
        Err(NameError::IpAddress) => bail!(
            "replica name {name:?} is an IP address; name replicas with DNS names and add addresses with --san"
        ),
        Err(e) => bail!("replica name {name:?} {e}"),
    }
}

/// The `--san` entries: IP addresses, or DNS names as
/// [`check_replica_name`] takes them (a leading `*.` allowed).
fn extra_sans(entries: &[String]) -> anyhow::Result<Vec<SanType>> {
    let mut sans = Vec::with_capacity(entries.len());
    for entry in entries {
        let entry = entry.trim();
        if let Ok(ip) = entry.parse::<IpAddr>() {
            sans.push(SanType::IpAddress(ip));
            continue;
        }
        let bare = entry.strip_prefix("*.").unwrap_or(entry);
        if let Err(e) = check_dns_name(bare) {
            bail!("--san entry {entry:?} {e}");
        }
        sans.push(SanType::DnsName(entry.try_into().with_context(|| {
            format!("--san entry {entry:?} is not an ASCII DNS name")
        })?));
    }
    Ok(sans)
}

/// The files `fleetmq cert` writes into `dir`.
fn planned_files(dir: &Path, names: &[String]) -> Vec<PathBuf> {
    std::iter::once(CA_STEM)
        .chain(names.iter().map(String::as_str))
        .flat_map(|stem| {
            let (cert, key) = file_pair(dir, stem);
            [cert, key]
        })
        .collect()
}

/// `DIR/<stem>.pem` and `DIR/<stem>.key`.
fn file_pair(dir: &Path, stem: &str) -> (PathBuf, PathBuf) {
    (
        dir.join(format!("{stem}.pem")),
        dir.join(format!("{stem}.key")),
    )
}

/// Makes the CA and one certificate per name, valid from a day before
/// `now` (clock skew between replicas) to `days` days after it; the extra
/// subject alternative names go into every replica certificate.
///
/// # Errors
///
/// rcgen refuses a parameter (a name that is not an ASCII string) or key
/// generation fails.
pub fn generate(
    names: &[String],
    extra: &[SanType],
    days: u32,
    now: OffsetDateTime,
) -> anyhow::Result<MeshCerts> {
    let not_before = now - Duration::days(1);
    let not_after = now + Duration::days(i64::from(days));
    let ca_key = KeyPair::generate().context("generating the CA key")?;
    // A name of its own per CA: a peer with a certificate of another
    // deployment's CA is then refused as unknown, not checked against this
    // CA's key.
    let mut tag = [0u8; 4];
    rand::thread_rng().fill_bytes(&mut tag);
    let tag: String = tag.iter().map(|b| format!("{b:02x}")).collect();
    let ca_params = ca_params(subject(&format!("fleetmq mesh CA {tag}")), not_before, not_after);
    let ca_cert = ca_params
        .self_signed(&ca_key)
        .context("signing the CA certificate")?;
    let replicas = sign_replicas(names, extra, not_before, not_after, &ca_cert, &ca_key)?;
    Ok(MeshCerts {
        ca: Issued {
            name: CA_STEM.to_owned(),
            cert_pem: ca_cert.pem(),
            key_pem: ca_key.serialize_pem(),
        },
        replicas,
        not_after,
    })
}

/// The parameters of a mesh CA named `dn`.
fn ca_params(dn: DistinguishedName, not_before: OffsetDateTime, not_after: OffsetDateTime) -> CertificateParams {
    let mut params = CertificateParams::default();
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    params.not_before = not_before;
    params.not_after = not_after;
    params.serial_number = Some(random_serial());
    params
}

/// One certificate per name, signed by `ca_cert` / `ca_key`.
fn sign_replicas(
    names: &[String],
    extra: &[SanType],
    not_before: OffsetDateTime,
    not_after: OffsetDateTime,
    ca_cert: &rcgen::Certificate,
    ca_key: &KeyPair,
) -> anyhow::Result<Vec<Issued>> {
    let mut replicas = Vec::with_capacity(names.len());
    for name in names {
        let key = KeyPair::generate().with_context(|| format!("generating the key of {name}"))?;
        let mut params = CertificateParams::default();
        params.distinguished_name = subject(name);
        params.subject_alt_names =
            vec![SanType::DnsName(name.as_str().try_into().with_context(
                || format!("replica name {name:?} is not an ASCII DNS name"),
            )?)];
        params.subject_alt_names.extend_from_slice(extra);
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        params.use_authority_key_identifier_extension = true;
        params.not_before = not_before;
        params.not_after = not_after;
        params.serial_number = Some(random_serial());
        let cert = params
            .signed_by(&key, ca_cert, ca_key)
            .with_context(|| format!("signing the certificate of {name}"))?;
        replicas.push(Issued {
            name: name.clone(),
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        });
    }
    Ok(replicas)
}

/// An existing mesh CA (`--ca-cert`, `--ca-key`): its certificate as it
/// was written, its key, and an rcgen issuer with its name and key.
pub struct ExistingCa {
    pem: String,
    der: rustls::pki_types::CertificateDer<'static>,
    key: KeyPair,
    issuer: rcgen::Certificate,
    not_after: OffsetDateTime,
}

/// Reads the CA of `--ca-cert` / `--ca-key`.
///
/// # Errors
/// A file that cannot be read (at most 1 MiB), is not PEM, is not a CA
/// certificate, or a key that is not the certificate's; each names its
/// option and file.
pub fn load_ca(cert: &Path, key: &Path) -> anyhow::Result<ExistingCa> {
    let der = crate::tls::load_certs("--ca-cert", cert)?.swap_remove(0);
    let key_pem = String::from_utf8(crate::tls::read("--ca-key", key)?)
        .with_context(|| format!("--ca-key {}: not a PEM file", key.display()))?;
    let key_pair = KeyPair::from_pem(&key_pem)
        .with_context(|| format!("--ca-key {}: no private key rcgen reads (PKCS#8 PEM)", key.display()))?;
    let (_, parsed) = x509_parser::parse_x509_certificate(&der)
        .map_err(|e| anyhow::anyhow!("--ca-cert {}: not an X.509 certificate: {e}", cert.display()))?;
    if !parsed.is_ca() {
        bail!("--ca-cert {}: not a CA certificate (give the ca.pem of `fleetmq cert`)", cert.display());
    }
    if parsed.public_key().raw != key_pair.public_key_der().as_slice() {
        bail!("--ca-key {} is not the key of --ca-cert {}", key.display(), cert.display());
    }
    let mut dn = DistinguishedName::new();
    for attr in parsed.subject().iter_attributes() {
        let value = attr.as_str().with_context(|| format!("--ca-cert {}: a subject that is not text", cert.display()))?;
        let oid: Vec<u64> = attr.attr_type().iter().map(|arcs| arcs.collect()).unwrap_or_default();
        dn.push(DnType::from_oid(&oid), value);
    }
    let not_after = OffsetDateTime::from_unix_timestamp(parsed.validity().not_after.timestamp())
        .with_context(|| format!("--ca-cert {}: its end of validity", cert.display()))?;
    let now = OffsetDateTime::now_utc();
    let issuer = ca_params(dn, now - Duration::days(1), not_after)
        .self_signed(&key_pair)
        .context("the CA as an issuer")?;
    let pem = String::from_utf8_lossy(&crate::tls::read("--ca-cert", cert)?).into_owned();
    Ok(ExistingCa { pem, der, key: key_pair, issuer, not_after })
}

/// One certificate per name signed by `ca`, valid from a day before `now`
/// to `days` days after it or the CA's end, whichever is first; each one
/// checked against the CA as a peer checks it.
///
/// # Errors
/// As [`generate`]; a certificate the CA does not verify (a CA not made
/// by `fleetmq cert` whose name rcgen writes otherwise).
pub fn sign_with(
    ca: &ExistingCa,
    names: &[String],
    extra: &[SanType],
    days: u32,
    now: OffsetDateTime,
) -> anyhow::Result<MeshCerts> {
    let not_after = (now + Duration::days(i64::from(days))).min(ca.not_after);
    let replicas = sign_replicas(names, extra, now - Duration::days(1), not_after, &ca.issuer, &ca.key)?;
    for issued in &replicas {
        verify_signed(&ca.der, issued)?;
    }
    Ok(MeshCerts {
        ca: Issued { name: CA_STEM.to_owned(), cert_pem: ca.pem.clone(), key_pem: String::new() },
        replicas,
        not_after,
    })
}

/// Checks that `issued` verifies against the CA `ca_der` for its name.
fn verify_signed(ca_der: &rustls::pki_types::CertificateDer<'static>, issued: &Issued) -> anyhow::Result<()> {
    use rustls::client::danger::ServerCertVerifier as _;
    use rustls::pki_types::pem::PemObject as _;
    use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca_der.clone()).context("--ca-cert as a trust root")?;
    let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(roots.into(), crate::tls::provider())
        .build()
        .context("--ca-cert as a trust root")?;
    let der = CertificateDer::from_pem_slice(issued.cert_pem.as_bytes()).context("the new certificate")?;
    let name = ServerName::try_from(issued.name.clone()).context("the replica name")?;
    verifier
        .verify_server_cert(&der, &[], &name, &[], UnixTime::now())
        .map_err(|e| anyhow::anyhow!("the certificate of {} does not verify against --ca-cert ({e}); nothing written", issued.name))?;
    Ok(())
}

/// Subject `CN=<common_name>, O=fleetmq`.
fn subject(common_name: &str) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    dn.push(DnType::OrganizationName, "fleetmq");
    dn.push(DnType::CommonName, common_name);
    dn
}

/// 16 random bytes, the first below 0x80 so the DER integer is positive.
fn random_serial() -> SerialNumber {
    let mut bytes = [0u8; 16];
    rand::thread_rng().fill_bytes(&mut bytes);
    bytes[0] &= 0x7f;
    bytes[0] |= 0x01;
    SerialNumber::from_slice(&bytes)
}

/// Writes `text` to `path` with permission bits `mode`: a new file, or with
/// `replace` an existing one truncated, its mode set before the first byte
/// is written (a replaced key is never readable by others).
fn write_file(path: &Path, text: &str, mode: u32, replace: bool) -> anyhow::Result<()> {
    let mut options = OpenOptions::new();
    options.write(true).mode(mode);
    if replace {
        options.create(true).truncate(true);
    } else {
        options.create_new(true);
    }
    let mut file = options
        .open(path)
        .with_context(|| format!("creating {}", path.display()))?;
    file.set_permissions(Permissions::from_mode(mode))
        .with_context(|| format!("setting the mode of {}", path.display()))?;
    file.write_all(text.as_bytes())
        .and_then(|()| file.sync_all())
        .with_context(|| format!("writing {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::CertificateDer;
    use x509_parser::prelude::{FromDer, GeneralName, X509Certificate};

    fn names(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn replicas_default_to_r1_to_r3_and_follow_the_count() {
        assert_eq!(
            replica_names(None, &[]).unwrap(),
            names(&["r1", "r2", "r3"])
        );
        assert_eq!(replica_names(Some(1), &[]).unwrap(), names(&["r1"]));
        assert_eq!(replica_names(Some(5), &[]).unwrap().last().unwrap(), "r5");
    }

    #[test]
    fn names_are_dns_names_unique_and_not_ca() {
        let ok = names(&["broker-a", "b.example.net", "C3"]);
        assert_eq!(replica_names(None, &ok).unwrap(), ok);
        assert_eq!(replica_names(Some(3), &ok).unwrap(), ok);
        let refused =
            |list: &[&str]| format!("{:#}", replica_names(None, &names(list)).unwrap_err());
        assert!(refused(&["a", "A"]).contains("twice"));
        assert!(refused(&["ca"]).contains("CA's files"));
        assert!(refused(&["a/b"]).contains("'/'"));
        assert!(refused(&["../x"]).contains("replica name"));
        assert!(refused(&[""]).contains("empty"));
        assert!(refused(&["-a"]).contains("'-'"));
        assert!(refused(&["10.0.0.1"]).contains("IP address"));
        assert!(refused(&[&"x".repeat(64)]).contains("1 to 63"));
        let counted = replica_names(Some(2), &ok).unwrap_err().to_string();
        assert!(counted.contains("--replicas 2"), "{counted}");
    }

    #[test]
    fn extra_sans_take_ips_dns_names_and_wildcards_only() {
        let sans = extra_sans(&names(&["10.0.0.7", "::1", "mesh.example.net", "*.svc"])).unwrap();
        assert_eq!(sans.len(), 4);
        assert!(matches!(sans[0], SanType::IpAddress(_)));
        assert!(matches!(sans[2], SanType::DnsName(_)));
        assert!(extra_sans(&names(&["bad name"])).is_err());
        assert!(extra_sans(&names(&[""])).is_err());
    }

    #[test]
    fn replica_certificates_are_ca_signed_for_both_ends_and_named() {
        let now = OffsetDateTime::now_utc();
        let extra = extra_sans(&names(&["10.1.2.3", "mesh.local"])).unwrap();
        let certs = generate(&names(&["r1", "r2"]), &extra, 30, now).unwrap();
        let ca_der = CertificateDer::from_pem_slice(certs.ca.cert_pem.as_bytes()).unwrap();
        let (_, ca) = X509Certificate::from_der(&ca_der).unwrap();
        assert!(ca.is_ca());
        assert_eq!(
            ca.basic_constraints()
                .unwrap()
                .unwrap()
                .value
                .path_len_constraint,
            Some(0)
        );
        assert_eq!(certs.replicas.len(), 2);
        for issued in &certs.replicas {
            let der = CertificateDer::from_pem_slice(issued.cert_pem.as_bytes()).unwrap();
            let (_, cert) = X509Certificate::from_der(&der).unwrap();
            assert!(!cert.is_ca());
            assert_eq!(cert.issuer(), ca.subject());
            let eku = cert.extended_key_usage().unwrap().unwrap().value;
            assert!(eku.server_auth && eku.client_auth);
            let sans = &cert
                .subject_alternative_name()
                .unwrap()
                .unwrap()
                .value
                .general_names;
            assert!(sans.contains(&GeneralName::DNSName(&issued.name)));
            assert!(sans.contains(&GeneralName::DNSName("mesh.local")));
            assert!(sans.contains(&GeneralName::IPAddress(&[10, 1, 2, 3])));
            let days = cert.validity().not_after.timestamp() - now.unix_timestamp();
            assert!((29 * 86_400..=30 * 86_400).contains(&days), "{days}");
            assert!(issued.key_pem.starts_with("-----BEGIN PRIVATE KEY-----"));
        }
    }

    fn args(out: &Path, names: &[&str], ca: bool) -> CertArgs {
        CertArgs {
            out: out.to_owned(),
            replicas: None,
            names: self::names(names),
            san: Vec::new(),
            days: 30,
            force: false,
            ca_cert: ca.then(|| out.join("ca.pem")),
            ca_key: ca.then(|| out.join("ca.key")),
        }
    }

    #[test]
    fn a_replica_added_later_is_signed_by_the_existing_ca_which_stays_as_it_was() {
        let dir = std::env::temp_dir().join(format!("fleetmq-cert-add-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        run_cert(&args(&dir, &["r1", "r2"], false)).unwrap();
        let ca_before = std::fs::read(dir.join("ca.pem")).unwrap();
        // Without the CA: refused, ca.pem exists (the fresh-user pass).
        assert!(run_cert(&args(&dir, &["r3"], false)).is_err());
        let lines = run_cert(&args(&dir, &["r3"], true)).unwrap();
        assert!(lines[0].contains("signed by the mesh CA"), "{lines:?}");
        assert_eq!(std::fs::read(dir.join("ca.pem")).unwrap(), ca_before);
        let ca = CertificateDer::from_pem_slice(&ca_before).unwrap();
        let r3 = Issued { name: "r3".into(), cert_pem: std::fs::read_to_string(dir.join("r3.pem")).unwrap(), key_pem: String::new() };
        verify_signed(&ca, &r3).unwrap();
        // Another deployment's key does not go with this CA.
        let other = dir.join("other");
        run_cert(&args(&other, &["x"], false)).unwrap();
        let mut wrong = args(&dir, &["r4"], true);
        wrong.ca_key = Some(other.join("ca.key"));
        let e = run_cert(&wrong).unwrap_err().to_string();
        assert!(e.contains("is not the key of --ca-cert"), "{e}");
        assert!(!dir.join("r4.pem").exists());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
