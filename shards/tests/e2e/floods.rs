//! Floods of connections that never become clients (silent, stalled in a
//! TLS or WebSocket handshake, or sending a CONNECT a byte a second), and
//! of sign-ins that fail (issue 28; DESIGN.md §9): devices still get in,
//! each within 2 s; every flood socket is closed within
//! `limits.connect_timeout` + 1 s; the broker's descriptors and memory
//! come back to where they were; and a connected subscriber keeps
//! receiving throughout (its latency p99 is printed).

use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rustls::pki_types::ServerName;
use rustls::{ClientConfig, ClientConnection, StreamOwned};

use crate::clients::unique;
use crate::harness::Broker;
use crate::raw::{wire, Incoming, RawClient};
use crate::security::{
    client_config, passwd, refused, set, set_str, start, tls_broker, Ca, Login, TempDir,
};

/// How long a device may take from its TCP connect to CONNACK 0.
const DEVICE_WAIT: Duration = Duration::from_secs(2);

/// Held by each flood test: they load the machine on purpose, so under
/// `cargo test` (threads of one process) they run one at a time, as the
/// `floods` test group has nextest run them (.config/nextest.toml).
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Takes [`ONE_AT_A_TIME`] (a test that failed holding it does not stop
/// the others) and raises this process's open-file limit to its hard
/// limit, for a flood's sockets.
///
/// # Panics
/// The hard limit is below `needed`.
fn flood_test(needed: u64) -> std::sync::MutexGuard<'static, ()> {
    let guard = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    raise_nofile(needed);
    guard
}

fn raise_nofile(needed: u64) {
    // SAFETY: getrlimit/setrlimit on a local struct.
    unsafe {
        let mut lim: libc::rlimit = std::mem::zeroed();
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim), 0);
        assert!(
            lim.rlim_max >= needed,
            "RLIMIT_NOFILE hard limit {} < {needed}",
            lim.rlim_max
        );
        if lim.rlim_cur < lim.rlim_max {
            lim.rlim_cur = lim.rlim_max;
            assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &lim), 0);
        }
    }
}

/// What each flood socket does once connected.
#[derive(Clone)]
enum Attack {
    /// Sends nothing.
    Silent,
    /// Sends these bytes (part of a TLS ClientHello or of a WebSocket
    /// upgrade request), then nothing.
    Hello(Arc<Vec<u8>>),
    /// Sends these bytes (a CONNECT) one a second.
    Trickle(Arc<Vec<u8>>),
}

struct FloodSocket {
    stream: TcpStream,
    opened: Instant,
    sent: usize,
}

/// What a flood saw.
#[derive(Debug)]
struct FloodReport {
    opened: usize,
    /// The longest a socket stayed open before the broker closed it.
    longest: Duration,
    /// Sockets the broker had not closed when the flood gave up waiting.
    still_open: usize,
}

/// Whether the broker closed `stream` (EOF or reset); reads and drops
/// what it sent (a TLS server's first flight).
fn closed(mut stream: &TcpStream) -> bool {
    let mut buf = [0u8; 4096];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e) if e.kind() == ErrorKind::WouldBlock => return false,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(_) => return true,
        }
    }
}

/// An attacker with one machine: opens `n` sockets to `addr` doing
/// `attack`, and every `refill` (if any) opens new ones for those the broker
/// closed, until `stop`; then waits at most `linger` for the broker to
/// close the rest.
fn flood(
    addr: SocketAddr,
    n: usize,
    attack: Attack,
    refill: Option<Duration>,
    stop: Arc<AtomicBool>,
    linger: Duration,
) -> JoinHandle<FloodReport> {
    thread::spawn(move || {
        let mut open: Vec<FloodSocket> = Vec::with_capacity(n);
        let mut report = FloodReport {
            opened: 0,
            longest: Duration::ZERO,
            still_open: 0,
        };
        let mut next_refill = Instant::now();
        let mut next_trickle = Instant::now() + Duration::from_secs(1);
        let mut stopped_at = None;
        loop {
            let now = Instant::now();
            if stop.load(Ordering::Relaxed) {
                let at = *stopped_at.get_or_insert(now);
                if open.is_empty() || now > at + linger {
                    break;
                }
            } else if now >= next_refill {
                next_refill = refill.map_or(now + Duration::from_secs(3600), |every| now + every);
                while open.len() < n {
                    let Ok(mut stream) = TcpStream::connect(addr) else {
                        break;
                    };
                    let opened = Instant::now();
                    let sent = match &attack {
                        Attack::Silent => 0,
                        Attack::Hello(hello) => {
                            let _ = stream.write_all(hello);
                            hello.len()
                        }
                        Attack::Trickle(bytes) => {
                            let _ = stream.write_all(&bytes[..1]);
                            1
                        }
                    };
                    stream.set_nonblocking(true).unwrap();
                    open.push(FloodSocket {
                        stream,
                        opened,
                        sent,
                    });
                    report.opened += 1;
                }
            }
            let mut fds: Vec<libc::pollfd> = open
                .iter()
                .map(|s| libc::pollfd {
                    fd: s.stream.as_raw_fd(),
                    events: libc::POLLIN | libc::POLLRDHUP,
                    revents: 0,
                })
                .collect();
            // SAFETY: `fds` is a valid array of `fds.len()` pollfd.
            unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 20) };
            let now = Instant::now();
            let mut kept = Vec::with_capacity(open.len());
            for (socket, fd) in open.drain(..).zip(&fds) {
                if fd.revents != 0 && closed(&socket.stream) {
                    report.longest = report.longest.max(now - socket.opened);
                } else {
                    kept.push(socket);
                }
            }
            open = kept;
            if let Attack::Trickle(bytes) = &attack {
                if now >= next_trickle {
                    next_trickle += Duration::from_secs(1);
                    for socket in open.iter_mut().filter(|s| s.sent < bytes.len()) {
                        let _ = socket.stream.write(&bytes[socket.sent..socket.sent + 1]);
                        socket.sent += 1;
                    }
                }
            }
        }
        report.still_open = open.len();
        report
    })
}

/// A subscriber receiving a timestamped QoS 0 message every 5 ms from a
/// publisher, both connected before the flood.
struct Heartbeat {
    stop: Arc<AtomicBool>,
    sent: Arc<AtomicU64>,
    publisher: JoinHandle<()>,
    subscriber: JoinHandle<(Vec<Duration>, Duration)>,
}

fn nanos_now() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos()
}

impl Heartbeat {
    fn start(addr: SocketAddr) -> Heartbeat {
        let topic = unique("heartbeat");
        let mut sub = RawClient::connect(addr);
        assert_eq!(
            sub.handshake(&wire::Connect::v311(&unique("hb-sub")).encode()),
            (0, 0)
        );
        sub.send(&wire::subscribe(1, &topic, 0, false));
        assert!(matches!(
            sub.read(Duration::from_secs(5)),
            Incoming::Packet { header: 0x90, .. }
        ));
        let mut publisher = RawClient::connect(addr);
        assert_eq!(
            publisher.handshake(&wire::Connect::v311(&unique("hb-pub")).encode()),
            (0, 0)
        );
        let (stop, sent) = (
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicU64::new(0)),
        );
        let publisher = {
            let (stop, sent) = (stop.clone(), sent.clone());
            thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    publisher.send(&wire::publish_qos0(
                        &topic,
                        &nanos_now().to_be_bytes(),
                        false,
                    ));
                    sent.fetch_add(1, Ordering::Relaxed);
                    thread::sleep(Duration::from_millis(5));
                }
            })
        };
        let subscriber = {
            let (stop, sent) = (stop.clone(), sent.clone());
            thread::spawn(move || {
                let (mut latencies, mut longest_gap) = (Vec::new(), Duration::ZERO);
                let mut last = Instant::now();
                let mut stopped_at = None;
                loop {
                    if stop.load(Ordering::Relaxed) {
                        let at = *stopped_at.get_or_insert(Instant::now());
                        if latencies.len() as u64 >= sent.load(Ordering::Relaxed)
                            || at.elapsed() > Duration::from_secs(2)
                        {
                            break;
                        }
                    }
                    if let Incoming::Packet { header, body } = sub.read(Duration::from_millis(50)) {
                        if header & 0xF0 == 0x30 && body.len() >= 16 {
                            let stamp =
                                u128::from_be_bytes(body[body.len() - 16..].try_into().unwrap());
                            latencies.push(Duration::from_nanos(
                                (nanos_now().saturating_sub(stamp)) as u64,
                            ));
                            if stopped_at.is_none() {
                                longest_gap = longest_gap.max(last.elapsed());
                            }
                            last = Instant::now();
                        }
                    }
                }
                (latencies, longest_gap)
            })
        };
        Heartbeat {
            stop,
            sent,
            publisher,
            subscriber,
        }
    }

    /// Stops; asserts every message came and none was more than
    /// [`DEVICE_WAIT`] after the one before; prints the latency
    /// percentiles. (Under a flood of TLS handshakes, each a key exchange
    /// and a signature on the shard, the subscriber waits behind them: its
    /// p99 is printed, not bounded.)
    fn finish(self, what: &str) {
        self.stop.store(true, Ordering::Relaxed);
        self.publisher.join().unwrap();
        let (mut latencies, gap) = self.subscriber.join().unwrap();
        let sent = self.sent.load(Ordering::Relaxed);
        latencies.sort();
        let at =
            |q: f64| latencies[((latencies.len() as f64 * q) as usize).min(latencies.len() - 1)];
        println!(
            "{what}: subscriber received {} of {sent}; latency p50 {:?}, p99 {:?}, max {:?}; longest gap {gap:?}",
            latencies.len(),
            at(0.5),
            at(0.99),
            at(1.0)
        );
        assert_eq!(
            latencies.len() as u64,
            sent,
            "{what}: the subscriber missed messages"
        );
        assert!(
            gap < DEVICE_WAIT,
            "{what}: the subscriber heard nothing for {gap:?}"
        );
    }
}

/// A device: TCP connect (and a TLS handshake with `tls`), CONNECT,
/// CONNACK; closed before its CONNACK (refused at the limit), it tries
/// again 100 ms later, as devices do, within [`DEVICE_WAIT`] of its first
/// connect. Returns the open connection, how long it took in all and how
/// many connects, or what went wrong.
fn device_connects(
    addr: SocketAddr,
    tls: Option<&Arc<ClientConfig>>,
) -> Result<(Box<dyn ReadWrite>, Duration, u32), String> {
    let begun = Instant::now();
    let id = unique("device");
    let connect = Login::v311(&id).encode();
    let mut tries = 0;
    loop {
        tries += 1;
        let tcp = TcpStream::connect(addr).expect("a device's TCP connect");
        tcp.set_nodelay(true).unwrap();
        tcp.set_read_timeout(Some(
            DEVICE_WAIT
                .saturating_sub(begun.elapsed())
                .max(Duration::from_millis(1)),
        ))
        .unwrap();
        let mut stream: Box<dyn ReadWrite> = match tls {
            None => Box::new(tcp),
            Some(config) => {
                let name = ServerName::try_from("127.0.0.1").unwrap();
                Box::new(StreamOwned::new(
                    ClientConnection::new(config.clone(), name).unwrap(),
                    tcp,
                ))
            }
        };
        let mut connack = [0u8; 4];
        let answered = stream
            .write_all(&connect)
            .and_then(|()| stream.read_exact(&mut connack));
        let took = begun.elapsed();
        match answered {
            Err(e)
                if took + Duration::from_millis(100) < DEVICE_WAIT
                    && !matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) =>
            {
                thread::sleep(Duration::from_millis(100));
            }
            Err(e) => {
                return Err(format!(
                    "device {id}: no CONNACK after {took:?} and {tries} tries: {e}"
                ))
            }
            Ok(()) if connack != [0x20, 2, 0, 0] => {
                return Err(format!("device {id}: {connack:02x?}, CONNACK 0 expected"))
            }
            Ok(()) if took >= DEVICE_WAIT => {
                return Err(format!("device {id}: CONNACK after {took:?}"))
            }
            Ok(()) => return Ok((stream, took, tries)),
        }
    }
}

/// The broker's non-zero `fleetmq_connect_refused_total` series.
fn refusals(broker: &Broker) -> String {
    let (_, body) = broker.admin_get("/metrics");
    body.lines()
        .filter(|l| l.starts_with("fleetmq_connect_refused_total") && !l.ends_with(" 0"))
        .collect::<Vec<_>>()
        .join("\n")
}

trait ReadWrite: Read + Write + Send {}
impl<T: Read + Write + Send> ReadWrite for T {}

/// A flood and the devices that connect into it.
struct Scenario<'a> {
    /// The listener flooded.
    flooded: SocketAddr,
    /// The listener where the devices connect.
    devices: SocketAddr,
    attack: Attack,
    /// The broker's `limits.connect_timeout`.
    connect_timeout: Duration,
    /// How often the attacker reopens what the broker closed (never: it
    /// opens 3,000 once).
    refill: Option<Duration>,
    /// When the first device connects, after the flood began.
    devices_after: Duration,
    /// Devices connect over TLS with this configuration.
    tls: Option<&'a Arc<ClientConfig>>,
    what: &'a str,
}

/// One flood against `broker`, 20 devices connecting one after another
/// into it: checks all of the module's promises and returns the flood's
/// report.
fn devices_get_in_during(broker: &Broker, scenario: Scenario<'_>) -> FloodReport {
    let Scenario {
        flooded,
        devices: device_addr,
        attack,
        connect_timeout,
        refill,
        devices_after,
        tls,
        what,
    } = scenario;
    let heartbeat = Heartbeat::start(broker.mqtt);
    let (fds_before, rss_before) = (broker.fd_count(), broker.rss_kib());
    let stop = Arc::new(AtomicBool::new(false));
    let linger = connect_timeout + Duration::from_secs(3);
    let flooding = flood(flooded, 3_000, attack, refill, stop.clone(), linger);
    thread::sleep(devices_after);
    let mut devices = Vec::new();
    let (mut slowest, mut retried) = (Duration::ZERO, 0);
    for _ in 0..20 {
        let (device, took, tries) = device_connects(device_addr, tls)
            .unwrap_or_else(|e| panic!("{what}: {e}\n{}", refusals(broker)));
        slowest = slowest.max(took);
        retried += usize::from(tries > 1);
        devices.push(device);
        thread::sleep(Duration::from_millis(50));
    }
    let (fds_during, rss_during) = (broker.fd_count(), broker.rss_kib());
    stop.store(true, Ordering::Relaxed);
    let report = flooding.join().unwrap();
    drop(devices);
    heartbeat.finish(what);
    let evicted = refused(broker, "pending_evicted");
    println!(
        "{what}: 20 devices in, slowest {slowest:?}, {retried} after a refusal; flood {report:?}; pending_evicted {evicted}; \
         descriptors {fds_before} -> {fds_during} -> ..., RSS {rss_before} KiB -> {rss_during} KiB -> ..."
    );
    assert!(report.opened >= 3_000, "{what}: {report:?}");
    assert_eq!(
        report.still_open, 0,
        "{what}: the broker left flood sockets open: {report:?}"
    );
    assert!(
        report.longest <= connect_timeout + Duration::from_secs(1),
        "{what}: a flood socket stayed {:?}",
        report.longest
    );
    assert!(evicted > 0.0, "{what}: nothing was evicted");
    // Back where they were: the heartbeat's two connections stay.
    let settle_by = Instant::now() + Duration::from_secs(5);
    let (mut fds, mut rss) = (broker.fd_count(), broker.rss_kib());
    while (fds > fds_before + 4 || rss > rss_before + 8 * 1024) && Instant::now() < settle_by {
        thread::sleep(Duration::from_millis(100));
        (fds, rss) = (broker.fd_count(), broker.rss_kib());
    }
    println!("{what}: after: descriptors {fds} (before {fds_before}), RSS {rss} KiB (before {rss_before} KiB)");
    assert!(
        fds <= fds_before + 4,
        "{what}: descriptors {fds_before} -> {fds}"
    );
    assert!(
        rss <= rss_before + 8 * 1024,
        "{what}: RSS {rss_before} KiB -> {rss} KiB"
    );
    report
}

/// The issue's figures: 3,000 silent TCP connections against the default
/// `max_pending_connections` (2,048) and `connect_timeout` (5 s). The
/// oldest silent ones make room for the newest, so every device gets in.
#[test]
fn devices_connect_while_3000_silent_sockets_flood_the_broker() {
    let _one = flood_test(8_000);
    let broker = Broker::start(&[]);
    let connect_timeout = Duration::from_secs(5);
    let scenario = Scenario {
        flooded: broker.mqtt,
        devices: broker.mqtt,
        attack: Attack::Silent,
        connect_timeout,
        refill: Some(connect_timeout),
        devices_after: Duration::from_millis(300),
        tls: None,
        what: "silent TCP",
    };
    devices_get_in_during(&broker, scenario);
}

/// 3,000 TLS connections that never finish the handshake: each sends the
/// first half of a ClientHello and nothing more (`connect_timeout = 2s`).
/// A handshake without progress for a second gives way to devices, which
/// complete theirs. (Half a ClientHello costs the broker no key exchange:
/// whole ones would make this a test of the CPU a TLS handshake takes,
/// not of the limit.)
#[test]
fn devices_connect_over_tls_while_3000_handshakes_stall() {
    let _one = flood_test(8_000);
    let dir = TempDir::new("flood-tls");
    let ca = Ca::new("flood CA");
    let mut extra = Vec::new();
    set(&mut extra, "limits.connect_timeout", "2s");
    let broker = tls_broker(&dir, &ca.server("broker"), &extra);
    let config = client_config(&ca, None, &[]);
    let mut hello = Vec::new();
    let name = ServerName::try_from("127.0.0.1").unwrap();
    ClientConnection::new(config.clone(), name)
        .unwrap()
        .write_tls(&mut hello)
        .unwrap();
    hello.truncate(hello.len() / 2);
    let attack = Attack::Hello(Arc::new(hello));
    let scenario = Scenario {
        flooded: broker.listener("mqtt-tls"),
        devices: broker.listener("mqtt-tls"),
        attack,
        connect_timeout: Duration::from_secs(2),
        refill: Some(Duration::from_secs(2)),
        devices_after: Duration::from_millis(1_300),
        tls: Some(&config),
        what: "stalled TLS",
    };
    devices_get_in_during(&broker, scenario);
}

/// 3,000 WebSocket connections that never finish the upgrade: each sends
/// the first lines of an upgrade request and nothing more
/// (`connect_timeout = 2s`). A handshake without progress for a second
/// gives way to devices (over TCP: the limit counts every listener).
#[test]
fn devices_connect_while_3000_websocket_upgrades_stall() {
    let _one = flood_test(8_000);
    let mut args = Vec::new();
    set(&mut args, "listeners.ws", r#"["127.0.0.1:0"]"#);
    set(&mut args, "limits.connect_timeout", "2s");
    let broker = start(&args);
    let upgrade = b"GET /mqtt HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n".to_vec();
    let scenario = Scenario {
        flooded: broker.listener("mqtt-ws"),
        devices: broker.mqtt,
        attack: Attack::Hello(Arc::new(upgrade)),
        connect_timeout: Duration::from_secs(2),
        refill: Some(Duration::from_secs(2)),
        devices_after: Duration::from_millis(1_300),
        tls: None,
        what: "stalled WebSocket upgrades",
    };
    devices_get_in_during(&broker, scenario);
}

/// 3,000 connections sending a CONNECT a byte a second
/// (`connect_timeout = 2s`): at that rate it would take them far longer
/// than the timeout, so they give way to devices.
#[test]
fn devices_connect_while_3000_connects_come_a_byte_a_second() {
    let _one = flood_test(8_000);
    let mut args = Vec::new();
    set(&mut args, "limits.connect_timeout", "2s");
    let broker = start(&args);
    let connect = Login::v311("slow-connect").encode();
    let attack = Attack::Trickle(Arc::new(connect));
    let connect_timeout = Duration::from_secs(2);
    let scenario = Scenario {
        flooded: broker.mqtt,
        devices: broker.mqtt,
        attack,
        connect_timeout,
        refill: Some(connect_timeout),
        devices_after: Duration::from_millis(1_300),
        tls: None,
        what: "byte-a-second CONNECTs",
    };
    devices_get_in_during(&broker, scenario);
}

/// A TCP connection to `addr` from the local address `source` (any of
/// 127.0.0.0/8 on loopback).
fn connect_from(addr: SocketAddr, source: IpAddr) -> TcpStream {
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    socket
        .bind(&SocketAddr::new(source, 0).into())
        .expect("bind a loopback source address");
    socket.connect(&addr.into()).expect("connect");
    socket.into()
}

/// 1,000 CONNECTs with wrong passwords for 1,000 made-up user names,
/// written from 127.0.0.2 over about 2 s: each is an argon2 check (no user name
/// backs off, none spends its check budget, and the address is not
/// throttled as addresses are not trusted: the guard's rules, issue 29).
/// Then devices with the right password: new ones from 127.0.0.1, whose
/// checks take turns with the flood's address instead of waiting behind
/// it, and a known device (it signed in before) from 127.0.0.2 itself, a
/// shared NAT, whose check goes first. Each is in within 2 s while the
/// flood's checks are still running.
#[test]
fn a_flood_of_wrong_passwords_does_not_keep_the_right_one_out_for_more_than_2_s() {
    let _one = flood_test(4_000);
    let dir = TempDir::new("wrong-passwords");
    let file = dir.path("passwd");
    passwd(&file, "device", "right", None);
    let mut args = Vec::new();
    set_str(&mut args, "auth.password_file", &file.display().to_string());
    set(&mut args, "auth.allow_anonymous", "false");
    let broker = start(&args);
    let attacker = IpAddr::from([127, 0, 0, 2]);
    let known = "known-device";
    Login::v311(known)
        .user("device", "right")
        .accepted(broker.mqtt);
    // The attacker writes its 1,000 CONNECTs over about 2 s, keeping the
    // broker's queue full while the devices come, and keeps them open.
    let (sent, done) = (
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicBool::new(false)),
    );
    let attack = {
        let (sent, done, addr) = (sent.clone(), done.clone(), broker.mqtt);
        thread::spawn(move || {
            let mut open = Vec::new();
            for i in 0..1_000 {
                let mut s = connect_from(addr, attacker);
                let user = format!("guess-{i}");
                s.write_all(&Login::v311("guess").user(&user, "wrong").encode())
                    .unwrap();
                open.push(s);
                sent.fetch_add(1, Ordering::Relaxed);
                if !done.load(Ordering::Relaxed) {
                    thread::sleep(Duration::from_millis(2));
                }
            }
            open
        })
    };
    for i in 0..6 {
        thread::sleep(Duration::from_millis(200));
        let answered =
            refused(&broker, "bad_credentials") + refused(&broker, "max_connects_authenticating");
        let flooding = sent.load(Ordering::Relaxed);
        assert!(
            answered < flooding as f64,
            "device {i}: the flood is not at work ({answered} of {flooding} answered)"
        );
        let (source, id) = match i % 2 {
            0 => ([127, 0, 0, 1], unique("new-device")),
            _ => ([127, 0, 0, 2], known.to_owned()),
        };
        let begun = Instant::now();
        let mut device = connect_from(broker.mqtt, IpAddr::from(source));
        device.set_read_timeout(Some(DEVICE_WAIT)).unwrap();
        device
            .write_all(&Login::v311(&id).user("device", "right").encode())
            .unwrap();
        let mut connack = [0u8; 4];
        let read = device.read_exact(&mut connack);
        let took = begun.elapsed();
        println!("device {id} from {source:?}: {connack:02x?} after {took:?} ({answered} of {flooding} flood CONNECTs answered)");
        assert!(read.is_ok(), "device {id}: no CONNACK after {took:?}");
        assert_eq!(connack, [0x20, 2, 0, 0], "device {id}");
        assert!(took < DEVICE_WAIT, "device {id}: {took:?}");
    }
    done.store(true, Ordering::Relaxed);
    let flood = attack.join().unwrap();
    let bad = refused(&broker, "bad_credentials");
    let busy = refused(&broker, "max_connects_authenticating");
    println!("flood: {bad} checked and refused (0x04), {busy} refused as busy (0x03) so far");
    assert!(
        busy > 0.0,
        "the flood's own CONNECTs beyond the limit are refused"
    );
    drop(flood);
}

/// A reconnect storm larger than `limits.max_pending_connections` (64),
/// on one shard and on two: 1,000 clients connect and send their CONNECT
/// while the broker is stopped (SIGSTOP), so that when it resumes every
/// CONNECT waits unread in its socket, as in a storm the shards are behind
/// on. None is refused and none is evicted: the accept loop leaves the
/// rest of the storm in the kernel's listen queue until pending
/// connections leave (issue 27). Every client reads CONNACK 0 as the first
/// packet from the broker [MQTT-3.2.0-1]. Not counted: a client whose
/// socket the kernel reset before the broker resumed (on this loopback,
/// about one in 10,000 in such a burst; its accepted half then holds no
/// CONNECT, and it is evicted as a silent connection is).
#[test]
fn a_storm_beyond_max_pending_connections_connects_every_client() {
    const CLIENTS: usize = 1_000;
    const THREADS: usize = 4;
    let _one = flood_test(4 * CLIENTS as u64);
    for shards in ["1", "2"] {
        let mut args = vec!["--shards".to_owned(), shards.to_owned()];
        set(&mut args, "limits.max_pending_connections", "64");
        let broker = start(&args);
        broker.pause();
        // Twice: every CONNECT is sent; every client's state is noted.
        let sent = Arc::new(std::sync::Barrier::new(THREADS + 1));
        let storm: Vec<JoinHandle<Vec<Answer>>> = (0..THREADS)
            .map(|t| {
                let (addr, sent) = (broker.mqtt, sent.clone());
                thread::spawn(move || {
                    let streams: Vec<TcpStream> = (0..CLIENTS / THREADS)
                        .map(|i| {
                            let mut stream = TcpStream::connect(addr).expect("connect");
                            let id = format!("storm-{t}-{i}");
                            stream.write_all(&Login::v311(&id).encode()).expect("CONNECT");
                            stream
                        })
                        .collect();
                    sent.wait();
                    let established: Vec<bool> = streams.iter().map(is_established).collect();
                    sent.wait();
                    streams.into_iter().map(read_connack).zip(established).collect()
                })
            })
            .collect();
        sent.wait();
        sent.wait();
        let started = Instant::now();
        broker.resume();
        let answers: Vec<_> = storm.into_iter().flat_map(|t| t.join().unwrap()).collect();
        let took = started.elapsed();
        let connack_0 = |a: &std::io::Result<[u8; 4]>| matches!(a, Ok([0x20, 0x02, 0x00, 0x00]));
        let connected = answers.iter().filter(|(a, _)| connack_0(a)).count();
        let reset = answers.iter().filter(|(_, established)| !established).count();
        println!(
            "--shards {shards}: {connected} of {CLIENTS} connected in {took:?} after the broker resumed \
             ({reset} reset by the kernel before); refusals: {}",
            refusals(&broker)
        );
        assert!(reset <= 5, "--shards {shards}: {reset} clients reset before the broker resumed");
        let lost: Vec<_> = answers.iter().filter(|(a, established)| *established && !connack_0(a)).collect();
        assert!(
            lost.is_empty(),
            "--shards {shards}: clients not answered CONNACK 0: {lost:?}; refusals: {}",
            refusals(&broker)
        );
        assert!(refused(&broker, "pending_evicted") <= reset as f64, "--shards {shards}");
        assert_eq!(refused(&broker, "max_pending_connections"), 0.0, "--shards {shards}");
    }
}

/// A storm whose sockets are all open before their CONNECTs are written,
/// as from a load generator that connects faster than it writes (issue 27:
/// at 100,000 connections/s on a quiet machine 7,952 of 10,000 were
/// evicted as silent): 600 clients against `max_pending_connections = 64`
/// open their sockets, and 300 ms later send their CONNECTs. Every one
/// reads CONNACK 0 [MQTT-3.2.0-1], none evicted or refused: the kernel
/// keeps a connection that has sent nothing from the broker for a second
/// (TCP_DEFER_ACCEPT), so each comes in with its CONNECT.
#[test]
fn a_storm_whose_connects_come_after_its_sockets_are_open_connects_every_client() {
    const CLIENTS: usize = 600;
    let _one = flood_test(4 * CLIENTS as u64);
    for shards in ["1", "2"] {
        let mut args = vec!["--shards".to_owned(), shards.to_owned()];
        set(&mut args, "limits.max_pending_connections", "64");
        let broker = start(&args);
        let mut streams: Vec<TcpStream> = (0..CLIENTS)
            .map(|_| TcpStream::connect(broker.mqtt).expect("connect"))
            .collect();
        thread::sleep(Duration::from_millis(300));
        for (i, stream) in streams.iter_mut().enumerate() {
            stream.write_all(&Login::v311(&format!("late-{i}")).encode()).expect("CONNECT");
        }
        let answers: Vec<_> = streams.into_iter().map(read_connack).collect();
        let connected = answers.iter().filter(|a| matches!(a, Ok([0x20, 0x02, 0x00, 0x00]))).count();
        println!("--shards {shards}: {connected} of {CLIENTS} connected; refusals: {}", refusals(&broker));
        assert_eq!(connected, CLIENTS, "--shards {shards}: refusals: {}", refusals(&broker));
        assert_eq!(refused(&broker, "pending_evicted"), 0.0, "--shards {shards}");
        assert_eq!(refused(&broker, "max_pending_connections"), 0.0, "--shards {shards}");
    }
}

/// What a storm client read (its CONNACK), and whether its socket was
/// still established when the broker resumed.
type Answer = (std::io::Result<[u8; 4]>, bool);

/// Whether the kernel holds `stream` as established (`TCP_INFO`): not
/// reset under a burst of connections.
fn is_established(stream: &TcpStream) -> bool {
    // SAFETY: getsockopt(TCP_INFO) into a zeroed tcp_info of the size given.
    unsafe {
        let mut info: libc::tcp_info = std::mem::zeroed();
        let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
        let ok = libc::getsockopt(
            stream.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&mut info as *mut libc::tcp_info).cast(),
            &mut len,
        ) == 0;
        ok && info.tcpi_state == 1 // TCP_ESTABLISHED (linux/tcp_states.h)
    }
}

/// Reads the 4-byte CONNACK on `stream` (30 s at most).
fn read_connack(mut stream: TcpStream) -> std::io::Result<[u8; 4]> {
    let mut connack = [0u8; 4];
    stream.set_read_timeout(Some(Duration::from_secs(30)))?;
    stream.read_exact(&mut connack)?;
    Ok(connack)
}

/// A silent flood against a `connect_timeout` shorter than the kernel's
/// longest hold (3 s, two SYN-ACKs): every socket is closed soon after the
/// timeout, not held past it by the kernel first. 4,000 sockets: more
/// than the SYN backlog (`tcp_max_syn_backlog`, 2,048 here), which the
/// held connections fill with `TCP_DEFER_ACCEPT`, and fewer than the
/// accept queue (`somaxconn`, 4,096). With the hold on every listener the
/// last closed after 3.05–3.41 s (3 of 3 runs); without it for timeouts
/// under 3 s, after 1.94–1.97 s.
#[test]
fn a_silent_flood_against_a_one_second_connect_timeout_is_closed_within_it() {
    let _one = flood_test(8_000);
    let mut args = Vec::new();
    set(&mut args, "limits.connect_timeout", "1s");
    let broker = start(&args);
    let stop = Arc::new(AtomicBool::new(false));
    // One pass opens all 3,000; stopping then only waits for their close.
    let flooding = flood(broker.mqtt, 4_000, Attack::Silent, None, stop.clone(), Duration::from_secs(8));
    thread::sleep(Duration::from_millis(500));
    stop.store(true, Ordering::Relaxed);
    let report = flooding.join().unwrap();
    println!("{} silent sockets: the last closed after {:?}, {} still open", report.opened, report.longest, report.still_open);
    assert_eq!(report.still_open, 0, "silent sockets outlived connect_timeout + 8 s");
    assert!(
        report.longest < Duration::from_millis(2_500),
        "a silent socket stayed open {:?} with connect_timeout = 1s",
        report.longest
    );
}
