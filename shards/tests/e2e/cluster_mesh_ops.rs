//! The mesh as an operator meets it (issue 25, session 39): a dialer by
//! hand (real TLS 1.3, a real certificate of the test's CA) claiming
//! another replica, or speaking no common version, is refused, counted
//! and logged; a frozen peer's link goes down within seconds and its
//! values wait in the buffer; a flood of silent connections is capped;
//! `check-config` checks the mesh settings; a replica added later gets a
//! certificate from the deployment's existing CA and links.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use fleetmq_core::mesh::{decode, encode, Frame, Refusal, FIRST_VERSION, VERSIONS};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

use crate::cluster::cluster_args;
use crate::cluster_mesh::{mesh_args, numbers, payloads, publisher, start, status, until_routed, wait_links, Certs};
use crate::harness::{run_with_timeout, MosquittoSub};
use crate::nats::NatsCluster;
use crate::raw::wire as build;

/// The mesh address `broker` listens on.
fn mesh_addr(broker: &crate::harness::Broker) -> String {
    status(broker)["cluster"]["mesh"]["listen"].as_str().expect("a mesh address").to_owned()
}

/// Dials `addr` as a replica would, with the certificate and key of
/// `as_cert` from `certs` (trusting its CA, expecting the server to be
/// `server`), sends a Hello claiming `replica` with `versions`, and
/// returns the answer (`None`: the connection closed without one).
fn hello_by_hand(addr: &str, certs: &Certs, as_cert: &str, server: &str, replica: &str, versions: &[u16]) -> Option<Frame> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(CertificateDer::from_pem_file(certs.path("ca.pem")).expect("ca.pem")).expect("a CA");
    let chain = CertificateDer::pem_file_iter(certs.path(&format!("{as_cert}.pem")))
        .expect("the certificate")
        .collect::<Result<Vec<_>, _>>()
        .expect("PEM");
    let key = PrivateKeyDer::from_pem_file(certs.path(&format!("{as_cert}.key"))).expect("the key");
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_protocol_versions(&[&rustls::version::TLS13])
        .expect("TLS 1.3")
        .with_root_certificates(roots)
        .with_client_auth_cert(chain, key)
        .expect("a client certificate");
    let name = ServerName::try_from(server.to_owned()).expect("a server name");
    let conn = rustls::ClientConnection::new(Arc::new(config), name).expect("a TLS client");
    let tcp = TcpStream::connect(addr).expect("the mesh port answers");
    tcp.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut tls = rustls::StreamOwned::new(conn, tcp);
    let hello = Frame::Hello { versions: versions.to_vec(), replica: replica.to_owned(), instance: "by-hand".into(), link: 0 };
    let mut out = BytesMut::new();
    encode(&hello, FIRST_VERSION, &mut out);
    tls.write_all(&out).expect("the Hello is written");
    tls.flush().expect("flushed");
    let mut buf = BytesMut::new();
    loop {
        if let Some(frame) = decode(&mut buf, 1 << 20).expect("a frame") {
            return Some(frame);
        }
        let mut chunk = [0u8; 4096];
        match tls.read(&mut chunk) {
            Ok(0) | Err(_) => return None,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

fn refused(broker: &crate::harness::Broker, reason: &str) -> f64 {
    broker.metric_sum(&format!("fleetmq_mesh_refused_total{{reason=\"{reason}\"}}"))
}

/// A valid certificate of replica nb presented by a process whose Hello
/// claims nc: refused with the name mismatch, and counted as a
/// certificate refusal (it was `name` before).
#[test]
fn a_certificate_of_one_replica_presented_by_another_is_refused_and_counted_as_certificate() {
    let nats = NatsCluster::start(3);
    let certs = Certs::new("na,nb,nc");
    let a = start("na", &nats, &certs, &[]);
    let addr = mesh_addr(&a);
    let answer = hello_by_hand(&addr, &certs, "nb", "na", "nc", VERSIONS);
    assert_eq!(answer, Some(Frame::HelloAck(Err(Refusal::NameMismatch))));
    assert_eq!(refused(&a, "certificate"), 1.0);
    assert_eq!(refused(&a, "name"), 0.0);
    assert_eq!(status(&a)["cluster"]["mesh"]["links_in"], 0);
    // The same certificate with its own name links.
    assert!(matches!(hello_by_hand(&addr, &certs, "nb", "na", "nb", VERSIONS), Some(Frame::HelloAck(Ok(_)))));
}

/// A Hello with only a version this build does not speak: no link, the
/// refusal says why, counted each time and logged once (per peer, source
/// and reason, once a minute).
#[test]
fn a_hello_with_no_version_in_common_gets_no_link_and_one_log_line() {
    let nats = NatsCluster::start(3);
    let certs = Certs::new("va,vb");
    let a = start("va", &nats, &certs, &[]);
    let addr = mesh_addr(&a);
    for _ in 0..3 {
        let answer = hello_by_hand(&addr, &certs, "vb", "va", "vb", &[999]);
        assert_eq!(answer, Some(Frame::HelloAck(Err(Refusal::NoCommonVersion))));
    }
    assert_eq!(refused(&a, "version"), 3.0);
    let log = a.stderr();
    let lines: Vec<&str> = log.lines().filter(|l| l.contains("mesh: refused a link")).collect();
    assert_eq!(lines.len(), 1, "{log}");
    assert!(lines[0].contains("vb") && lines[0].contains("999"), "{}", lines[0]);
    // A version-1 dialer (a build before the keepalive) still links.
    assert!(matches!(
        hello_by_hand(&addr, &certs, "vb", "va", "vb", &[1]),
        Some(Frame::HelloAck(Ok(fleetmq_core::mesh::Accepted { version: 1, .. })))
    ));
}

/// A replica frozen by SIGSTOP: its link is down within seconds (the
/// keepalive; before, it showed `up` until membership dropped it), the
/// values for it wait in the buffer, and it gets them all when thawed.
#[test]
fn a_frozen_replica_s_link_goes_down_within_seconds_and_its_values_wait() {
    let nats = NatsCluster::start(3);
    let certs = Certs::new("fa,fb");
    // Membership would take 30 s to drop it: the link must see it first.
    let slow = ["--set", "cluster.member_ttl=30s"];
    let a = start("fa", &nats, &certs, &slow);
    let b = start("fb", &nats, &certs, &slow);
    wait_links(&a, 1, Duration::from_secs(15));
    let mut on_b = MosquittoSub::start(&b, &["-t", "fz/#"]);
    let mut publisher = publisher(&a, "pub-fz");
    until_routed(&mut publisher, "fz/x", &mut [&mut on_b]);
    b.pause();
    let frozen = Instant::now();
    wait_links(&a, 0, Duration::from_secs(8));
    let took = frozen.elapsed();
    let s = status(&a);
    assert_eq!(s["cluster"]["mesh"]["peers"][0]["state"], "down", "{s}");
    for i in 0..100 {
        publisher.send(&build::publish_qos0("fz/x", i.to_string().as_bytes(), true));
    }
    thread::sleep(Duration::from_millis(500));
    let kept = status(&a)["cluster"]["mesh"]["peers"][0]["buffer_bytes"].as_i64().unwrap_or(0);
    b.resume();
    assert!(kept > 0, "the values wait in the buffer: {}", status(&a));
    assert!(a.stderr().contains("mesh: link down: no answer for"), "{}", a.stderr());
    wait_links(&a, 1, Duration::from_secs(20));
    assert_eq!(payloads(&mut on_b, Duration::from_secs(5)), numbers(100));
    println!("frozen peer's link down after {took:?}");
}

/// Past 64 TLS handshakes in progress on a listener shard, a connection
/// is closed at once and counted `busy`; once they go, a replica links.
#[test]
fn past_64_handshakes_in_progress_a_connection_is_closed_at_once_and_counted_busy() {
    let nats = NatsCluster::start(3);
    let certs = Certs::new("ha,hb");
    let a = start("ha", &nats, &certs, &[]);
    let addr = mesh_addr(&a);
    let silent: Vec<TcpStream> = (0..64).map(|_| TcpStream::connect(&addr).expect("connect")).collect();
    thread::sleep(Duration::from_millis(500));
    let mut extra: Vec<TcpStream> = (0..8).map(|_| TcpStream::connect(&addr).expect("connect")).collect();
    for s in &mut extra {
        s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
        let mut byte = [0u8; 1];
        match s.read(&mut byte) {
            Ok(0) => {}
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
            other => panic!("a connection past the cap is closed at once: {other:?}"),
        }
    }
    assert_eq!(refused(&a, "busy"), 8.0);
    drop(silent);
    let b = start("hb", &nats, &certs, &[]);
    wait_links(&a, 1, Duration::from_secs(15));
    wait_links(&b, 1, Duration::from_secs(15));
}

/// `fleetmq check-config` with `args`: (success, stderr).
fn check_config(args: &[String]) -> (bool, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_fleetmq"));
    cmd.arg("check-config").args(args);
    let out = run_with_timeout(&mut cmd, Duration::from_secs(20));
    (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// `check-config` checks what the start checks of the mesh: the files
/// (readable, the certificate signed by the CA and naming the replica)
/// and the addresses (`mesh_advertise=:::bad` was accepted).
#[test]
fn check_config_refuses_bad_mesh_settings_naming_the_key() {
    let certs = Certs::new("ca1,ca2");
    let other = Certs::new("ca1");
    let with = |id: &str, certs: &Certs, ca: Option<&Certs>, extra: &[&str]| {
        let mut args = cluster_args(id, &["nats://127.0.0.1:4222".to_owned()]);
        args.extend(mesh_args(id, certs, ca, extra));
        check_config(&args)
    };
    let (ok, stderr) = with("ca1", &certs, None, &[]);
    assert!(ok, "{stderr}");
    let cases: [(&str, (bool, String), &[&str]); 5] = [
        ("advertise", with("ca1", &certs, None, &["--set", "cluster.mesh_advertise=:::bad"]), &["cluster.mesh_advertise", ":::bad"]),
        ("listen", with("ca1", &certs, None, &["--set", "cluster.mesh_listen=localhost:7884"]), &["cluster.mesh_listen"]),
        ("another CA", with("ca1", &other, Some(&certs), &[]), &["cluster.mesh_cert", "cluster.mesh_ca"]),
        ("another name", with("ca2", &certs, None, &["--set", &format!("cluster.mesh_cert={}", certs.path("ca1.pem"))]), &["cluster.mesh_cert", "ca2"]),
        ("missing", with("ca1", &certs, None, &["--set", "cluster.mesh_key=/nonexistent/k.pem"]), &["cluster.mesh_key", "/nonexistent/k.pem"]),
    ];
    for (what, (ok, stderr), named) in cases {
        assert!(!ok, "{what}: accepted");
        for n in named {
            assert!(stderr.contains(n), "{what}: {n} not in {stderr}");
        }
    }
}

/// A replica added to a deployment later: `fleetmq cert --ca-cert
/// --ca-key` signs its certificate with the existing CA (before, the only
/// way was a new CA and new certificates for every replica), and it
/// links with a replica whose certificate came with the CA.
#[test]
fn a_replica_added_with_a_certificate_from_the_existing_ca_links() {
    let nats = NatsCluster::start(3);
    let certs = Certs::new("ja,jb");
    let out = Command::new(env!("CARGO_BIN_EXE_fleetmq"))
        .args(["cert", "--out", &certs.path(""), "--names", "jc", "--ca-cert", &certs.path("ca.pem"), "--ca-key", &certs.path("ca.key")])
        .output()
        .expect("fleetmq cert runs");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let a = start("ja", &nats, &certs, &[]);
    let c = start("jc", &nats, &certs, &[]);
    wait_links(&a, 1, Duration::from_secs(15));
    wait_links(&c, 1, Duration::from_secs(15));
    assert_eq!(a.metric_sum("fleetmq_mesh_refused_total"), 0.0);
}
