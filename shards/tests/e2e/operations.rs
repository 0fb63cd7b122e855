//! Operating the broker: admin HTTP, settings refused at start, SIGTERM.

use std::process::Command;
use std::time::Duration;

use crate::clients::{unique, v5, WAIT};
use crate::harness::{mosquitto_pub, run_with_timeout, Broker};

/// `/health/live` and `/health/ready` answer 200 once the broker printed
/// `fleetmq: ready`; `/metrics` is Prometheus text that counts messages in.
#[test]
fn admin_endpoints_answer_health_and_metrics() {
    let broker = Broker::two_shards(&[]);
    assert_eq!(broker.admin_get("/health/live").0, 200);
    assert_eq!(broker.admin_get("/health/ready").0, 200);
    mosquitto_pub(&broker, &["-t", &unique("m"), "-m", "x"]);
    let (status, body) = broker.admin_get("/metrics");
    assert_eq!(status, 200);
    assert!(body.contains("fleetmq_messages_in_total"), "{body}");
    assert!(body.contains("fleetmq_clients_connected"), "{body}");
    let deadline = std::time::Instant::now() + WAIT;
    while broker.metric_sum("fleetmq_messages_in_total") < 1.0 {
        assert!(
            std::time::Instant::now() < deadline,
            "fleetmq_messages_in_total stays 0 after a publish"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(broker.admin_get("/no/such/path").0, 404);
}

/// Logs going to a pipe (a file, journald, a Kubernetes log) are plain
/// text: no terminal colour codes around levels and fields.
#[test]
fn logs_written_to_a_pipe_carry_no_colour_codes() {
    let broker = Broker::two_shards(&[]);
    let deadline = std::time::Instant::now() + WAIT;
    while !broker.stderr().contains("listening") && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    let log = broker.stderr();
    assert!(log.contains("listening"), "{log}");
    assert!(!log.contains('\x1b'), "escape codes in the log: {log:?}");
}

/// A `RUST_LOG` that does not parse is named in a warning, and the broker
/// logs at `info` rather than silently.
#[test]
fn a_rust_log_that_does_not_parse_is_named_and_info_is_used() {
    let broker = Broker::start_with_env(&["--shards", "1"], &[("RUST_LOG", "broker=banana")]);
    let deadline = std::time::Instant::now() + WAIT;
    while !broker.stderr().contains("listening") && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    let log = broker.stderr();
    assert!(log.contains("RUST_LOG=\"broker=banana\" does not parse"), "{log}");
    assert!(log.contains("INFO") && log.contains("listening"), "{log}");
}

fn serve_refused(args: &[&str]) -> String {
    let out = run_with_timeout(
        Command::new(env!("CARGO_BIN_EXE_fleetmq"))
            .arg("serve")
            .args(["--admin", "127.0.0.1:0", "--set", "store.kind=none"])
            .args(args),
        Duration::from_secs(10),
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        !out.status.success(),
        "fleetmq serve {args:?} started: {stdout}"
    );
    assert!(!stdout.contains("fleetmq: ready"), "{stdout}");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// An out-of-range setting stops the start with a message naming the key
/// and its range (DESIGN.md §9).
#[test]
fn out_of_range_setting_stops_the_start_naming_key_and_range() {
    let stderr = serve_refused(&[
        "--listen",
        "127.0.0.1:0",
        "--set",
        "limits.max_packet_size=10B",
    ]);
    assert!(stderr.contains("limits.max_packet_size"), "{stderr}");
    assert!(
        stderr.contains("..") || stderr.to_lowercase().contains("range"),
        "names the range: {stderr}"
    );
}

/// A second broker on a port the first already listens on refuses to
/// start ("address in use") instead of joining the first one's
/// `SO_REUSEPORT` group and taking part of its connections; the first
/// keeps serving.
#[test]
fn a_second_broker_on_a_port_in_use_refuses_to_start() {
    let first = Broker::start(&["--shards", "2"]);
    let port = first.mqtt.port().to_string();
    let listen = format!("127.0.0.1:{port}");
    let stderr = serve_refused(&["--shards", "2", "--listen", &listen]);
    assert!(stderr.contains(&listen), "names the address: {stderr}");
    assert!(
        stderr.to_lowercase().contains("address already in use")
            || stderr.to_lowercase().contains("addrinuse"),
        "says why: {stderr}"
    );
    assert!(
        std::net::TcpStream::connect(first.mqtt).is_ok(),
        "the first broker still accepts"
    );
}

/// A broker restarted on its port right after SIGTERM starts: the stopped
/// one's listening sockets linger some milliseconds after its exit, which
/// the port check waits out (a fresh-user pass saw 8 of 30 such restarts
/// refused with "address already in use" before it did).
#[test]
fn a_broker_restarted_on_its_port_right_after_sigterm_starts() {
    let mut broker = Broker::start(&["--shards", "2"]);
    let listen = format!("127.0.0.1:{}", broker.mqtt.port());
    for _ in 0..6 {
        let clients: Vec<_> = (0..10)
            .filter_map(|_| std::net::TcpStream::connect(&listen).ok())
            .collect();
        assert!(broker.stop_with_sigterm().success());
        drop(clients);
        // The second listener is the one that must be had again.
        broker = Broker::start(&["--shards", "2", "--listen", &listen]);
    }
}

/// Listening beyond loopback without `auth.allow_anonymous = true` (and
/// with no authentication method yet) refuses to start, saying why.
#[test]
fn listening_on_all_interfaces_without_allow_anonymous_is_refused() {
    let stderr = serve_refused(&["--listen", "0.0.0.0:0"]);
    assert!(stderr.contains("allow_anonymous"), "{stderr}");
}

/// Two listeners on one port, one on the wildcard address beside one it
/// covers, are refused at start naming both keys, as two on one address are.
#[test]
fn a_wildcard_listener_beside_another_on_its_port_is_refused_naming_both() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let (wild, local) = (format!("0.0.0.0:{port}"), format!("127.0.0.1:{port}"));
    let anonymous = "auth.allow_anonymous=true";
    let stderr = serve_refused(&["--listen", &wild, "--listen", &local, "--set", anonymous]);
    assert!(stderr.contains("listeners.tcp[1]") && stderr.contains("listeners.tcp[0]"), "{stderr}");
    assert!(stderr.contains("overlaps") && stderr.contains(&wild), "{stderr}");
    let stderr = serve_refused(&["--listen", &local, "--listen", &local]);
    assert!(stderr.contains("is the address of listeners.tcp[0]"), "{stderr}");
}

/// SIGTERM: an MQTT 5 client gets DISCONNECT 0x8B (Server shutting down)
/// and the process exits 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_sends_disconnect_0x8b_and_exits_0() {
    let mut broker = Broker::two_shards(&[]);
    let mut client = v5::Client::connect(broker.mqtt_port(), &unique("stay")).await;
    let status = tokio::task::block_in_place(|| broker.stop_with_sigterm());
    let err = client.closed_with(WAIT).await;
    assert_eq!(
        err.as_ref().and_then(v5::server_disconnect_reason),
        Some(0x8B),
        "{err:?}"
    );
    assert!(status.success(), "exit status {status:?}");
}

/// Waits until `fleetmq_connections_parked` reaches `n`.
fn wait_parked(broker: &Broker, n: f64) {
    let deadline = std::time::Instant::now() + Duration::from_secs(8);
    while broker.metric_sum("fleetmq_connections_parked") < n {
        assert!(
            std::time::Instant::now() < deadline,
            "fewer than {n} connections parked after 8 s: {}",
            broker.metric_sum("fleetmq_connections_parked")
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The broker turns transparent huge pages off for itself (README,
/// "Memory"): khugepaged would otherwise fill 2 MiB ranges back in around
/// the pages the allocator gave back. `FLEETMQ_THP=1` keeps them.
#[test]
fn the_broker_runs_without_transparent_huge_pages_unless_asked() {
    let broker = Broker::start(&["--shards", "1"]);
    assert_eq!(broker.status_field("THP_enabled"), "0");
    let kept = Broker::start_with_env(&["--shards", "1"], &[("FLEETMQ_THP", "1")]);
    assert_eq!(kept.status_field("THP_enabled"), "1");
    // Any other value stops the start, naming the variable and its values.
    let out = run_with_timeout(
        Command::new(env!("CARGO_BIN_EXE_fleetmq"))
            .args(["serve", "--listen", "127.0.0.1:0", "--admin", "", "--set", "store.kind=none"])
            .env("FLEETMQ_THP", "maybe"),
        Duration::from_secs(10),
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("FLEETMQ_THP must be 1/true/yes"));
}

/// Idle TCP connections park (README: no traffic either way for 1–2 s;
/// `fleetmq_connections_parked` counts them) and wake for whatever comes:
/// a PUBLISH from a parked publisher, the delivery to a parked subscriber,
/// a PINGREQ; and a parked client that stays silent is still closed after
/// 1.5 × Keep Alive `[MQTT-3.1.2-22]`.
#[test]
fn idle_connections_park_and_wake_for_publishes_deliveries_pings_and_keep_alive() {
    use crate::raw::{wire, Incoming, RawClient};
    let broker = Broker::two_shards(&[]);
    let topic = unique("parked");
    let connect = |id: &str, keep_alive: u16| wire::Connect {
        keep_alive,
        ..wire::Connect::v311(id)
    }
    .encode();
    let mut sub = RawClient::connect(broker.mqtt);
    assert_eq!(sub.handshake(&connect(&unique("psub"), 60)), (0, 0));
    sub.send(&wire::subscribe(1, &topic, 1, false));
    match sub.read(WAIT) {
        Incoming::Packet { header: 0x90, .. } => {}
        other => panic!("expected SUBACK, got {other:02x?}"),
    }
    let mut publisher = RawClient::connect(broker.mqtt);
    assert_eq!(publisher.handshake(&connect(&unique("ppub"), 60)), (0, 0));
    let mut quiet = RawClient::connect(broker.mqtt);
    assert_eq!(quiet.handshake(&connect(&unique("pquiet"), 4)), (0, 0));
    let quiet_since = std::time::Instant::now();

    wait_parked(&broker, 3.0);
    publisher.send(&wire::publish_qos0(&topic, b"woken", false));
    match sub.read(WAIT) {
        Incoming::Packet { header, body } if header & 0xF0 == 0x30 => {
            assert!(body.ends_with(b"woken"), "{body:02x?}")
        }
        other => panic!("the parked subscriber got {other:02x?}"),
    }

    wait_parked(&broker, 3.0);
    sub.send(&[0xC0, 0x00]);
    match sub.read(WAIT) {
        Incoming::Packet { header: 0xD0, .. } => {}
        other => panic!("a parked client's PINGREQ got {other:02x?}"),
    }

    let seen = quiet.packets_until_closed(Duration::from_secs(10));
    let after = quiet_since.elapsed();
    assert!(seen.is_empty(), "3.1.1 gets no packet before the close: {seen:02x?}");
    assert!(
        (Duration::from_millis(5900)..=Duration::from_millis(7500)).contains(&after),
        "a parked client with Keep Alive 4 s closed after {after:?}, expected about 6 s"
    );
}

/// A closed stderr (the log collector gone, `fleetmq serve 2>&1 | head`)
/// drops the log lines: the broker starts, serves (a protocol violation,
/// logged by a shard, closes only its own connection `[MQTT-3.1.0-1]`),
/// and SIGTERM stops it with exit 0. Found by a fresh-user pass: the line
/// logged on SIGTERM panicked the signal thread, and only SIGKILL stopped
/// the broker.
#[test]
fn a_closed_stderr_drops_log_lines_and_sigterm_still_stops_the_broker() {
    use std::process::Stdio;

    use crate::harness::{line_channel, wait_timeout};
    use crate::raw::{wire, RawClient};
    let mut child = Command::new(env!("CARGO_BIN_EXE_fleetmq"))
        .args(["serve", "--listen", "127.0.0.1:0", "--admin", "", "--shards", "2"])
        .args(["--set", "store.kind=none"])
        .env("RUST_LOG", "debug")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the fleetmq binary starts");
    // Closed before the first log line.
    drop(child.stderr.take());
    let lines = line_channel(child.stdout.take().expect("stdout is piped"));
    let mut mqtt = None;
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        let Ok(line) = lines.recv_timeout(left) else {
            let _ = child.kill();
            panic!("not ready within 20 s with stderr closed: {:?}", child.wait());
        };
        if let Some(addr) = line.strip_prefix("fleetmq: listening mqtt-tcp ") {
            mqtt = Some(addr.trim().parse().expect("an MQTT address"));
        } else if line == "fleetmq: ready" {
            break;
        }
    }
    let mqtt = mqtt.expect("a listening line");
    // Both shards serve one of these, each logging its connection.
    let mut clients: Vec<RawClient> = (0..4)
        .map(|i| {
            let mut client = RawClient::connect(mqtt);
            let id = unique(&format!("nostderr{i}"));
            assert_eq!(client.handshake(&wire::Connect::v5(&id).encode()), (0, 0));
            client
        })
        .collect();
    // A PUBLISH before CONNECT: closed, and logged.
    let mut rude = RawClient::connect(mqtt);
    rude.send(&wire::publish_qos0("t", b"x", false));
    assert!(rude.packets_until_closed(WAIT).is_empty());
    let mut late = RawClient::connect(mqtt);
    assert_eq!(late.handshake(&wire::Connect::v5(&unique("nostderr-late")).encode()), (0, 0));
    clients.push(late);

    let pid = libc::pid_t::try_from(child.id()).expect("a pid");
    // SAFETY: kill(2) on our own child's pid.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    let status = wait_timeout(&mut child, Duration::from_secs(10));
    if status.is_none() {
        let _ = child.kill();
        let _ = child.wait();
    }
    assert!(
        status.is_some_and(|s| s.success()),
        "SIGTERM with stderr closed: {status:?} (None: still running after 10 s)"
    );
    drop(clients);
}

/// Reads `stream` until the broker closes it (EOF or reset), at most until
/// `deadline`; false if it is still open then.
fn closed_by(stream: &mut std::net::TcpStream, deadline: std::time::Instant) -> bool {
    use std::io::Read;
    let mut buf = [0u8; 512];
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return false;
        }
        stream.set_read_timeout(Some(left)).unwrap();
        match stream.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => return false,
            Err(_) => return true,
        }
    }
}

/// A flood of the admin port with requests that never end (found by a
/// fresh-user pass: 20,000 connections that each sent `GET /x HTTP/1.1\r\n`
/// and nothing more all stayed open, the broker ran out of descriptors and
/// new MQTT clients timed out): at most 64 are served at once, each newer
/// one closing the oldest, and the served ones are closed when their 5 s
/// for a request head is over; `/health/live` answers during the flood
/// (a later pass found it answered 503 `busy`). A new MQTT client connects meanwhile, and after it
/// `/health/live` answers and the broker's descriptors are back.
#[test]
fn an_admin_port_flood_of_unfinished_requests_is_bounded_and_closed_within_the_head_deadline() {
    use std::io::Write;
    use std::time::Instant;
    const FLOOD: usize = 1_000;
    let broker = Broker::start(&[]);
    let fds_before = broker.fd_count();
    let started = Instant::now();
    let mut flood: Vec<std::net::TcpStream> = (0..FLOOD)
        .map(|_| {
            let mut stream = std::net::TcpStream::connect(broker.admin).expect("connect to the admin port");
            // Closed already beyond the bound: then the write may fail.
            let _ = stream.write_all(b"GET /x HTTP/1.1\r\n");
            stream
        })
        .collect();
    // The last ones are served from here.
    let opened = Instant::now();
    println!("flood of {FLOOD} opened in {:?}", opened - started);
    let flooded = broker.fd_count();
    assert!(flooded < fds_before + 100, "the flood holds {} descriptors", flooded - fds_before);

    // A probe during the flood is served: the oldest unfinished request
    // gives way to it.
    assert_eq!(broker.admin_get("/health/live"), (200, "ok".to_string()), "/health/live during the flood");

    let mut mqtt = crate::raw::RawClient::connect(broker.mqtt);
    let connect = crate::raw::wire::Connect::v311("during-the-flood").encode();
    assert_eq!(mqtt.handshake(&connect).1, 0, "CONNACK accepted during the flood");

    // 5 s for a head, and some slack for a loaded machine.
    let deadline = opened + Duration::from_secs(5) + Duration::from_secs(4);
    let open: Vec<usize> = flood
        .iter_mut()
        .enumerate()
        .filter_map(|(i, stream)| (!closed_by(stream, deadline)).then_some(i))
        .collect();
    assert!(open.is_empty(), "{} of {FLOOD} flood connections still open after {:?}", open.len(), started.elapsed());
    drop(flood);
    drop(mqtt);

    assert_eq!(broker.admin_get("/health/live"), (200, "ok".to_string()));
    let back_by = Instant::now() + Duration::from_secs(5);
    while broker.fd_count() > fds_before + 2 {
        assert!(Instant::now() < back_by, "descriptors {} before the flood, {} after", fds_before, broker.fd_count());
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Out of descriptors, the accept loop neither spins nor floods the log
/// (found by a fresh-user pass: `accept failed error=Too many open files`
/// 1,314 times in 15 s): it pauses longer after each error (up to 1 s) and
/// logs at most a line a second with a count. Once descriptors are free
/// again it accepts again.
#[test]
fn out_of_descriptors_accept_errors_are_logged_once_a_second_and_accepting_resumes() {
    use std::time::Instant;
    let broker = Broker::start(&["--shards", "1"]);
    let pid = libc::pid_t::try_from(broker.pid()).unwrap();
    let set_nofile = |soft: u64| {
        let mut old = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: prlimit(2) on our own child with valid pointers.
        assert_eq!(unsafe { libc::prlimit(pid, libc::RLIMIT_NOFILE, std::ptr::null(), &mut old) }, 0);
        let new = libc::rlimit { rlim_cur: soft, rlim_max: old.rlim_max };
        // SAFETY: as above.
        assert_eq!(unsafe { libc::prlimit(pid, libc::RLIMIT_NOFILE, &new, std::ptr::null_mut()) }, 0);
        old.rlim_cur
    };
    let before = broker.stderr().matches("accept failed").count();
    let normal = set_nofile(broker.fd_count() as u64 + 8);
    // Connections that send nothing: each holds a descriptor until its
    // CONNECT is late; the ones beyond the limit wait in the listen queue.
    let held: Vec<std::net::TcpStream> =
        (0..100).map(|_| std::net::TcpStream::connect(broker.mqtt).expect("connect")).collect();
    let out_since = Instant::now();
    std::thread::sleep(Duration::from_secs(3));
    let text = broker.stderr();
    let lines = text.matches("accept failed").count() - before;
    assert!(lines >= 1, "no accept error logged: {text}");
    assert!(lines <= 5, "{lines} accept error lines in {:?}: {text}", out_since.elapsed());

    set_nofile(normal);
    drop(held);
    let mut mqtt = crate::raw::RawClient::connect(broker.mqtt);
    let connect = crate::raw::wire::Connect::v311("after-emfile").encode();
    assert_eq!(mqtt.handshake(&connect).1, 0, "CONNACK once descriptors are free");
}

/// `store.ingest_*` given with a store that is not `"jetstream"` has no
/// effect: the start goes on (a file may serve a single node and a
/// cluster) with a warning naming the key, in `check-config` too; a value
/// out of range is refused as given (`300y`, not in days).
#[test]
fn ingest_settings_without_the_jetstream_store_are_named_in_a_warning_and_a_range_error_shows_the_value_as_given() {
    let check = run_with_timeout(
        Command::new(env!("CARGO_BIN_EXE_fleetmq")).args([
            "check-config",
            "--set",
            "store.kind=local",
            "--set",
            "store.ingest_max_age=1d",
        ]),
        Duration::from_secs(10),
    );
    let stderr = String::from_utf8_lossy(&check.stderr);
    assert!(check.status.success(), "{stderr}");
    assert!(
        stderr.contains("warning: store.ingest_max_age has no effect with store.kind = \"local\" (it applies to \"jetstream\")"),
        "{stderr}"
    );
    let broker = Broker::start(&["--set", "store.kind=none", "--set", "store.ingest_retention=workqueue"]);
    let log = broker.stderr();
    assert!(log.contains("WARN") && log.contains("store.ingest_retention has no effect with store.kind = \"none\""), "{log}");
    let stderr = serve_refused(&["--listen", "127.0.0.1:0", "--set", "store.ingest_max_age=300y"]);
    assert!(stderr.contains("store.ingest_max_age = 300y is out of range 1m..=365d"), "{stderr}");
}
