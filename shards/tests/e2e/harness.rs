//! The broker under test: the real `fleetmq` binary started on free ports,
//! its admin HTTP endpoints, and helpers to run mosquitto_pub/mosquitto_sub.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, ChildStdout, Command, ExitStatus, Output, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

/// How long the broker may take to print `fleetmq: ready` (a replica
/// whose first NATS URL picked is a frozen server waits for its 5 s
/// connect timeout, per connection, on a machine loaded by the suite).
const READY_TIMEOUT: Duration = Duration::from_secs(40);

/// A running `fleetmq serve`, killed (SIGKILL) when dropped.
pub(crate) struct Broker {
    child: Child,
    /// The MQTT over TCP listener.
    pub(crate) mqtt: SocketAddr,
    /// The admin HTTP listener.
    pub(crate) admin: SocketAddr,
    /// Every `fleetmq: listening <kind> <addr>` line: (kind, address), e.g.
    /// `("mqtt-tls", 127.0.0.1:40123)`.
    pub(crate) listeners: Vec<(String, SocketAddr)>,
    /// This broker's own `store.dir` (the local store is the default), a
    /// fresh directory under the system temp dir removed when dropped;
    /// a test that passes its own `store.dir` overrides it.
    store_dir: std::path::PathBuf,
    stderr: Arc<Mutex<String>>,
    /// The stdout lines after the one `start` waited for (in a mutex:
    /// tests share a `&Broker` between threads).
    stdout: Mutex<Receiver<String>>,
}

impl Broker {
    /// Starts `fleetmq serve --listen 127.0.0.1:0 --admin 127.0.0.1:0
    /// <args>` and waits for `fleetmq: ready`.
    ///
    /// # Panics
    ///
    /// The binary does not start, exits, or is not ready within 20 s; the
    /// panic message carries its stderr.
    pub(crate) fn start(args: &[&str]) -> Broker {
        Broker::start_with_env(args, &[])
    }

    /// [`Broker::start`] with `env` (name, value) pairs added to the
    /// broker's environment.
    pub(crate) fn start_with_env(args: &[&str], env: &[(&str, &str)]) -> Broker {
        Broker::start_until(args, env, "fleetmq: ready")
    }

    /// [`Broker::start_with_env`], returning once the broker printed a
    /// line that starts with `until` (e.g. `fleetmq: not ready`) after its
    /// MQTT and admin addresses.
    pub(crate) fn start_until(args: &[&str], env: &[(&str, &str)], until: &str) -> Broker {
        let store_dir = fresh_store_dir();
        let mut child = Command::new(env!("CARGO_BIN_EXE_fleetmq"))
            .args(["serve", "--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0"])
            .arg("--set")
            .arg(format!("store.dir={}", store_dir.display()))
            .args(args)
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()),
            )
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("the fleetmq binary starts");
        let stderr = Arc::new(Mutex::new(String::new()));
        let mut pipe = child.stderr.take().expect("stderr is piped");
        let sink = stderr.clone();
        thread::spawn(move || {
            let mut chunk = [0u8; 4096];
            while let Ok(n) = pipe.read(&mut chunk) {
                if n == 0 {
                    break;
                }
                sink.lock()
                    .unwrap()
                    .push_str(&String::from_utf8_lossy(&chunk[..n]));
            }
        });
        let lines = line_channel(child.stdout.take().expect("stdout is piped"));
        let (mut mqtt, mut admin) = (None, None);
        let mut listeners = Vec::new();
        let deadline = Instant::now() + READY_TIMEOUT;
        let broker_failed = |why: &str, child: &mut Child| -> ! {
            let _ = child.kill();
            let _ = child.wait();
            let _ = std::fs::remove_dir_all(&store_dir);
            thread::sleep(Duration::from_millis(50));
            panic!(
                "fleetmq {args:?}: {why}\n--- stderr ---\n{}",
                stderr.lock().unwrap()
            );
        };
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match lines.recv_timeout(left) {
                Ok(line) => {
                    if let Some((kind, addr)) = line
                        .strip_prefix("fleetmq: listening ")
                        .and_then(|rest| rest.trim().split_once(' '))
                    {
                        if let Ok(addr) = addr.parse::<SocketAddr>() {
                            listeners.push((kind.to_owned(), addr));
                        }
                    }
                    if let Some(addr) = line.strip_prefix("fleetmq: listening mqtt-tcp ") {
                        mqtt.get_or_insert(addr.trim().parse().expect("an MQTT address"));
                    } else if let Some(addr) = line.strip_prefix("fleetmq: listening admin ") {
                        admin = Some(addr.trim().parse().expect("an admin address"));
                    } else if line.trim().starts_with(until) {
                        break;
                    }
                }
                Err(RecvTimeoutError::Timeout) => {
                    broker_failed(&format!("no {until:?} within 20 s"), &mut child)
                }
                Err(RecvTimeoutError::Disconnected) => {
                    broker_failed("exited before ready", &mut child)
                }
            }
        }
        let (Some(mqtt), Some(admin)) = (mqtt, admin) else {
            broker_failed("did not print its MQTT and admin addresses", &mut child)
        };
        Broker {
            child,
            mqtt,
            admin,
            listeners,
            stderr,
            stdout: Mutex::new(lines),
            store_dir,
        }
    }

    /// The next line the broker prints on stdout, waiting at most
    /// `timeout`.
    pub(crate) fn next_stdout_line(&self, timeout: Duration) -> Option<String> {
        self.stdout.lock().unwrap().recv_timeout(timeout).ok()
    }

    /// `start` with `--shards 2` before `args`: every test that needs the
    /// cross-shard paths uses it.
    pub(crate) fn two_shards(args: &[&str]) -> Broker {
        let mut all = vec!["--shards", "2"];
        all.extend_from_slice(args);
        Broker::start(&all)
    }

    /// The address of the first `kind` listener (`mqtt-tls`, `mqtt-ws`,
    /// `mqtt-wss`, ...).
    ///
    /// # Panics
    ///
    /// The broker printed no such listener.
    pub(crate) fn listener(&self, kind: &str) -> SocketAddr {
        self.listeners
            .iter()
            .find(|(k, _)| k == kind)
            .map(|(_, addr)| *addr)
            .unwrap_or_else(|| panic!("no {kind} listener in {:?}", self.listeners))
    }

    /// Sends `signal` (e.g. `libc::SIGHUP`) to the broker process.
    pub(crate) fn signal(&self, signal: libc::c_int) {
        let pid = libc::pid_t::try_from(self.child.id()).expect("a pid");
        // SAFETY: kill(2) on our own child's pid.
        assert_eq!(unsafe { libc::kill(pid, signal) }, 0, "kill({signal})");
    }

    /// The broker's resident memory (VmRSS), KiB.
    pub(crate) fn rss_kib(&self) -> u64 {
        let value = self.status_field("VmRSS");
        value.split_whitespace().next().and_then(|v| v.parse().ok()).expect("VmRSS value")
    }

    /// How many descriptors the broker has open (/proc/PID/fd).
    pub(crate) fn fd_count(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.child.id()))
            .expect("/proc fd")
            .count()
    }

    /// A `Name:` line of /proc/PID/status, e.g. `status_field("THP_enabled")`.
    pub(crate) fn status_field(&self, name: &str) -> String {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).expect("/proc status");
        let prefix = format!("{name}:");
        let line = status.lines().find(|l| l.starts_with(&prefix)).unwrap_or_else(|| panic!("no {name} line"));
        line[prefix.len()..].trim().to_string()
    }

    /// The MQTT port.
    pub(crate) fn mqtt_port(&self) -> u16 {
        self.mqtt.port()
    }

    /// What the broker wrote to stderr so far.
    pub(crate) fn stderr(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }

    /// `GET path` on the admin listener: (status, body).
    ///
    /// # Panics
    ///
    /// The admin listener does not answer an HTTP/1.1 response within 5 s.
    pub(crate) fn admin_get(&self, path: &str) -> (u16, String) {
        http_get(self.admin, path).unwrap_or_else(|e| panic!("GET {path} on the admin port: {e}"))
    }

    /// The sum over all label sets of the Prometheus sample `name`.
    pub(crate) fn metric_sum(&self, name: &str) -> f64 {
        let (status, body) = self.admin_get("/metrics");
        assert_eq!(status, 200, "/metrics: {body}");
        body.lines()
            .filter(|l| !l.starts_with('#'))
            .filter(|l| {
                l.strip_prefix(name)
                    .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    /// Waits until `fleetmq_clients_connected` sums to `n`.
    ///
    /// # Panics
    ///
    /// It does not within `timeout`.
    pub(crate) fn wait_for_clients(&self, n: usize, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            let now = self.metric_sum("fleetmq_clients_connected");
            if now as usize == n {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "fleetmq_clients_connected is {now}, expected {n} within {timeout:?}"
            );
            thread::sleep(Duration::from_millis(20));
        }
    }

    /// The broker's process ID.
    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends SIGKILL and reaps the process: the broker ends with no
    /// goodbye (no DISCONNECT, no will hand-over, no store flush).
    pub(crate) fn kill(&mut self) -> ExitStatus {
        let _ = self.child.kill();
        self.child.wait().expect("wait for fleetmq")
    }

    /// Freezes the broker (SIGSTOP): its sockets stay open, it answers
    /// nothing and its timers do not run, until [`Broker::resume`].
    /// Returns once every thread of it is stopped (at most 2 s): the
    /// signal is delivered asynchronously, and a connection made just
    /// after it could otherwise still be accepted and read.
    pub(crate) fn pause(&self) {
        self.signal(libc::SIGSTOP);
        let deadline = Instant::now() + Duration::from_secs(2);
        while !self.all_threads_stopped() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Whether every thread of the broker is in state `T` (stopped).
    fn all_threads_stopped(&self) -> bool {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{}/task", self.child.id())) else { return false };
        tasks.flatten().all(|task| {
            std::fs::read_to_string(task.path().join("stat"))
                .ok()
                .and_then(|stat| stat.rsplit_once(") ").map(|(_, rest)| rest.starts_with('T')))
                .unwrap_or(false)
        })
    }

    /// Thaws the broker (SIGCONT) after [`Broker::pause`].
    pub(crate) fn resume(&self) {
        self.signal(libc::SIGCONT);
    }

    /// Waits at most `timeout` for the broker to exit on its own (e.g.
    /// after a refusal); `None` if it still runs.
    pub(crate) fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        wait_timeout(&mut self.child, timeout)
    }

    /// Sends SIGTERM and waits (at most 10 s) for the process to exit.
    ///
    /// # Panics
    ///
    /// The process does not exit within 10 s.
    pub(crate) fn stop_with_sigterm(&mut self) -> ExitStatus {
        let pid = libc::pid_t::try_from(self.child.id()).expect("a pid");
        // SAFETY: kill(2) on our own child's pid.
        assert_eq!(
            unsafe { libc::kill(pid, libc::SIGTERM) },
            0,
            "kill(SIGTERM)"
        );
        wait_timeout(&mut self.child, Duration::from_secs(10)).unwrap_or_else(|| {
            panic!(
                "fleetmq did not exit within 10 s of SIGTERM\n{}",
                self.stderr()
            )
        })
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.store_dir);
        if thread::panicking() {
            eprintln!("--- fleetmq stderr ---\n{}", self.stderr());
        }
    }
}

/// A new, unused directory for one broker's store (not created: the
/// broker creates it).
fn fresh_store_dir() -> std::path::PathBuf {
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("fleetmq-e2e-store-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// `GET path` over HTTP/1.1 on `addr` (`Connection: close`, 5 s read
/// timeout): (status, body).
///
/// # Errors
///
/// The connection fails or times out, or the answer is not an HTTP
/// response (`InvalidData`).
pub(crate) fn http_get(addr: SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes())?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    let status = response
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("not an HTTP response: {response:?}"),
            )
        })?;
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    let chunked = head.lines().any(|line| {
        line.split_once(':').is_some_and(|(name, value)| {
            name.trim().eq_ignore_ascii_case("transfer-encoding")
                && value.trim().eq_ignore_ascii_case("chunked")
        })
    });
    let body = if chunked {
        dechunk(body)
    } else {
        body.to_owned()
    };
    Ok((status, body))
}

/// The payload of a `Transfer-Encoding: chunked` body (what parses of it).
fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let size = size.split(';').next().unwrap_or("").trim();
        let Ok(size) = usize::from_str_radix(size, 16) else {
            break;
        };
        if size == 0 || rest.len() < size {
            break;
        }
        out.push_str(&rest[..size]);
        body = rest[size..].trim_start_matches("\r\n");
    }
    out
}

/// Waits for `child` at most `timeout`; `None` if it is still running.
pub(crate) fn wait_timeout(child: &mut Child, timeout: Duration) -> Option<ExitStatus> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            return Some(status);
        }
        if Instant::now() >= deadline {
            return None;
        }
        thread::sleep(Duration::from_millis(10));
    }
}

/// Runs `cmd` to completion, killing it after `timeout`.
///
/// # Panics
///
/// The command cannot start or does not finish within `timeout`.
pub(crate) fn run_with_timeout(cmd: &mut Command, timeout: Duration) -> Output {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{cmd:?} starts (is mosquitto-clients installed?): {e}"));
    let (mut out, mut err) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
    let out = thread::spawn(move || {
        let mut v = Vec::new();
        let _ = out.read_to_end(&mut v);
        v
    });
    let err = thread::spawn(move || {
        let mut v = Vec::new();
        let _ = err.read_to_end(&mut v);
        v
    });
    let status = match wait_timeout(&mut child, timeout) {
        Some(status) => status,
        None => {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{cmd:?} did not finish within {timeout:?}");
        }
    };
    Output {
        status,
        stdout: out.join().unwrap(),
        stderr: err.join().unwrap(),
    }
}

/// `mosquitto_pub -h 127.0.0.1 -p PORT <args>`; panics unless it exits 0
/// within 5 s.
pub(crate) fn mosquitto_pub(broker: &Broker, args: &[&str]) {
    let port = broker.mqtt_port().to_string();
    let out = run_with_timeout(
        Command::new("mosquitto_pub")
            .args(["-h", "127.0.0.1", "-p", &port])
            .args(args),
        Duration::from_secs(5),
    );
    assert!(
        out.status.success(),
        "mosquitto_pub {args:?}: {:?}\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A `mosquitto_sub` process, started with `-d` (and line-buffered by
/// `stdbuf`) so that its SUBACK can be awaited, and an output format that prefixes each message with `MSG`.
/// Killed when dropped.
pub(crate) struct MosquittoSub {
    child: Child,
    lines: Receiver<String>,
}

/// The `-F` format of [`MosquittoSub`]: `MSG <qos> <retain> <topic> <payload>`.
pub(crate) const SUB_FORMAT: &str = "MSG %q %r %t %p";

impl MosquittoSub {
    /// Starts `mosquitto_sub -d -h 127.0.0.1 -p PORT -F '<SUB_FORMAT>' <args>`
    /// and waits (5 s) for its SUBACK.
    pub(crate) fn start(broker: &Broker, args: &[&str]) -> MosquittoSub {
        let port = broker.mqtt_port().to_string();
        // stdbuf: mosquitto_sub block-buffers its debug lines on a pipe.
        let mut child = Command::new("stdbuf")
            .args([
                "-oL",
                "mosquitto_sub",
                "-d",
                "-h",
                "127.0.0.1",
                "-p",
                &port,
                "-F",
                SUB_FORMAT,
            ])
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("mosquitto_sub starts (is mosquitto-clients installed?)");
        let lines = line_channel(child.stdout.take().unwrap());
        let sub = MosquittoSub { child, lines };
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            match sub
                .lines
                .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            {
                Ok(line) if line.contains("received SUBACK") => return sub,
                Ok(_) => {}
                Err(e) => panic!("mosquitto_sub {args:?}: no SUBACK within 5 s ({e})"),
            }
        }
    }

    /// The next message line (`MSG ...` without the prefix), or `None`
    /// after `timeout`.
    pub(crate) fn next_message(&mut self, timeout: Duration) -> Option<String> {
        let deadline = Instant::now() + timeout;
        loop {
            match self
                .lines
                .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            {
                Ok(line) => {
                    if let Some(msg) = line.strip_prefix("MSG ") {
                        return Some(msg.to_owned());
                    }
                }
                Err(_) => return None,
            }
        }
    }

    /// Sends SIGKILL: the client drops its TCP connection without DISCONNECT.
    pub(crate) fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for MosquittoSub {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The lines of `stdout`, read on a thread of their own.
pub(crate) fn line_channel(stdout: ChildStdout) -> Receiver<String> {
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}
