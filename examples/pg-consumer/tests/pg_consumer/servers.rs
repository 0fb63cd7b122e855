//! Real servers for the tests: a PostgreSQL cluster (Debian's package,
//! `initdb` into a temporary folder, run as the `postgres` user when the
//! test runs as root, which PostgreSQL refuses) and a nats-server 2.15 with
//! JetStream, each on a free loopback port. Dropping either stops the
//! server and removes its folder, also when the test panics (the server's
//! log is printed then).

use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long a server may take to be ready.
const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// A folder under the system's temporary folder, removed on drop.
pub(crate) struct TempDir(PathBuf);

impl TempDir {
    /// A new empty folder named after `name`, this process and a counter.
    pub(crate) fn new(name: &str) -> TempDir {
        use std::sync::atomic::{AtomicU32, Ordering};
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir =
            std::env::temp_dir().join(format!("fleetmq-pg-{name}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create a temporary folder");
        TempDir(dir)
    }

    /// The path of `name` in the folder.
    pub(crate) fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A free TCP port on 127.0.0.1 (probed by binding port 0).
pub(crate) fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    listener.local_addr().expect("a bound address").port()
}

/// The last `n` lines of a file.
pub(crate) fn tail(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Sends `signal` to a child process.
pub(crate) fn signal(child: &Child, signal: libc::c_int) {
    let pid = libc::pid_t::try_from(child.id()).expect("a pid");
    // SAFETY: kill(2) on the pid of a child this process has not reaped.
    unsafe { libc::kill(pid, signal) };
}

/// Waits for a child to exit, `timeout` at most.
pub(crate) fn wait_exit(child: &mut Child, timeout: Duration) -> Option<std::process::ExitStatus> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return Some(status);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A running PostgreSQL on 127.0.0.1, user `postgres`, trust
/// authentication, database `postgres`.
pub(crate) struct Postgres {
    child: Option<Child>,
    port: u16,
    log: PathBuf,
    fsync: bool,
    dir: TempDir,
}

/// The folder of PostgreSQL's programs: `$FLEETMQ_PG_BIN`, else the newest
/// `/usr/lib/postgresql/<version>/bin` (Debian's package `postgresql`).
///
/// # Panics
///
/// None is found; the message says how to install it.
fn postgres_bin() -> PathBuf {
    if let Some(dir) = std::env::var_os("FLEETMQ_PG_BIN") {
        return PathBuf::from(dir);
    }
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let version = entry.file_name().to_str()?.parse().ok()?;
            let bin = entry.path().join("bin");
            bin.join("initdb").is_file().then_some((version, bin))
        })
        .collect();
    versions.sort();
    versions.pop().map(|(_, bin)| bin).unwrap_or_else(|| {
        panic!(
            "PostgreSQL not found (/usr/lib/postgresql/*/bin/initdb, $FLEETMQ_PG_BIN): \
             run scripts/test.sh, which installs Debian's `postgresql`"
        )
    })
}

/// The uid and gid of `postgres` when this process is root (PostgreSQL
/// refuses to run as root), else `None` (run as ourselves).
fn postgres_user() -> Option<(u32, u32)> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return None;
    }
    let name = CString::new("postgres").expect("no NUL");
    // SAFETY: getpwnam with a NUL-terminated name; the record is read at
    // once, before any other getpw* call of this thread.
    let record = unsafe { libc::getpwnam(name.as_ptr()) };
    assert!(
        !record.is_null(),
        "running as root and there is no `postgres` user: install Debian's postgresql \
         (scripts/test.sh does), which creates it"
    );
    // SAFETY: non-null record from getpwnam.
    Some(unsafe { ((*record).pw_uid, (*record).pw_gid) })
}

/// A command that runs as `postgres` when we are root.
fn as_postgres(program: PathBuf, user: Option<(u32, u32)>, dir: &Path) -> Command {
    let mut command = Command::new(program);
    command
        .current_dir(dir)
        .env("LC_ALL", "C")
        .stdin(Stdio::null());
    if let Some((uid, gid)) = user {
        command.uid(uid).gid(gid);
    }
    command
}

impl Postgres {
    /// Creates a cluster with `initdb` and starts it on a free port (no
    /// fsync: the tests kill the consumer, never PostgreSQL); waits until
    /// it accepts connections.
    ///
    /// # Panics
    ///
    /// PostgreSQL is not installed, initdb fails, or the server is not
    /// ready within 30 s; the message carries its log.
    pub(crate) fn start() -> Postgres {
        Postgres::start_with_fsync(false)
    }

    /// [`Postgres::start`] with `fsync` on or off (on: every commit waits
    /// for the disk, as in production; for measurements).
    pub(crate) fn start_with_fsync(fsync: bool) -> Postgres {
        let bin = postgres_bin();
        let user = postgres_user();
        let dir = TempDir::new("postgres");
        if let Some((uid, gid)) = user {
            std::os::unix::fs::chown(&dir.0, Some(uid), Some(gid)).expect("chown the folder");
        }
        let data = dir.path("data");
        let out = as_postgres(bin.join("initdb"), user, &dir.0)
            .args([
                "-U",
                "postgres",
                "--auth=trust",
                "-E",
                "UTF8",
                "--no-sync",
                "-D",
            ])
            .arg(&data)
            .output()
            .expect("run initdb");
        assert!(
            out.status.success(),
            "initdb failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let mut postgres = Postgres {
            child: None,
            port: 0,
            log: dir.path("postgres.log"),
            fsync,
            dir,
        };
        postgres.spawn(&bin, user, false);
        postgres
    }

    /// Stops the server (fast shutdown: clients are disconnected).
    pub(crate) fn stop_server(&mut self) {
        self.stop();
    }

    /// Starts the stopped server again, same data and port.
    ///
    /// # Panics
    ///
    /// It is not ready within 30 s (the port may have been taken).
    pub(crate) fn start_again(&mut self) {
        assert!(self.child.is_none(), "PostgreSQL is running");
        self.spawn(&postgres_bin(), postgres_user(), true);
    }

    /// Starts the server on a free port, or on the port it had when
    /// `same_port`.
    fn spawn(&mut self, bin: &Path, user: Option<(u32, u32)>, same_port: bool) {
        for _attempt in 0..3 {
            if !same_port {
                self.port = free_port();
            }
            let log = OpenOptions::new()
                .create(true)
                .append(true)
                .open(&self.log)
                .expect("open the log");
            if let Some((uid, gid)) = user {
                let _ = std::os::unix::fs::chown(&self.log, Some(uid), Some(gid));
            }
            let child = as_postgres(bin.join("postgres"), user, &self.dir.0)
                .arg("-D")
                .arg(self.dir.path("data"))
                .args(["-p", &self.port.to_string(), "-k"])
                .arg(&self.dir.0)
                .args(["-c", "listen_addresses=127.0.0.1", "-c"])
                .arg(if self.fsync { "fsync=on" } else { "fsync=off" })
                .stdout(Stdio::from(log.try_clone().expect("clone a file handle")))
                .stderr(Stdio::from(log))
                .spawn()
                .expect("start postgres");
            self.child = Some(child);
            if self.wait_ready(bin) {
                return;
            }
            self.stop();
            if same_port || !tail(&self.log, 20).contains("could not bind") {
                break;
            }
        }
        panic!("PostgreSQL did not start:\n{}", tail(&self.log, 40));
    }

    /// Whether the server accepts connections within 30 s (pg_isready).
    fn wait_ready(&mut self, bin: &Path) -> bool {
        let deadline = Instant::now() + READY_TIMEOUT;
        while Instant::now() < deadline {
            if let Some(Ok(Some(_))) = self.child.as_mut().map(Child::try_wait) {
                return false;
            }
            let ready = Command::new(bin.join("pg_isready"))
                .args([
                    "-q",
                    "-U",
                    "postgres",
                    "-h",
                    "127.0.0.1",
                    "-p",
                    &self.port.to_string(),
                ])
                .status()
                .is_ok_and(|status| status.success());
            if ready {
                return true;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        false
    }

    /// A connection string for it (tokio-postgres / libpq key=value form).
    pub(crate) fn url(&self) -> String {
        format!(
            "host=127.0.0.1 port={} user=postgres dbname=postgres",
            self.port
        )
    }

    /// A new client connection (its task spawned on the current runtime).
    pub(crate) async fn client(&self) -> tokio_postgres::Client {
        let (client, connection) = tokio_postgres::connect(&self.url(), tokio_postgres::NoTls)
            .await
            .expect("connect to the test PostgreSQL");
        tokio::spawn(connection);
        client
    }

    /// Fast shutdown (SIGINT), SIGKILL after 10 s.
    fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            signal(&child, libc::SIGINT);
            if wait_exit(&mut child, Duration::from_secs(10)).is_none() {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "--- PostgreSQL log at the panic ---\n{}",
                tail(&self.log, 30)
            );
        }
        self.stop();
    }
}

/// A running nats-server with JetStream on 127.0.0.1.
pub(crate) struct Nats {
    child: Option<Child>,
    port: u16,
    log: PathBuf,
    _dir: TempDir,
}

/// nats-server 2.15: `$FLEETMQ_NATS_SERVER`, else the workspace's
/// `target/nats-venv/bin/nats-server` (scripts/test.sh installs it), else
/// `nats-server` on PATH (DESIGN.md §14: Debian's 2.9 is too old).
fn nats_server() -> PathBuf {
    if let Some(path) = std::env::var_os("FLEETMQ_NATS_SERVER") {
        return PathBuf::from(path);
    }
    let venv = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/nats-venv/bin/nats-server");
    if venv.is_file() {
        return venv;
    }
    std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
        .map(|dir| dir.join("nats-server"))
        .find(|path| path.is_file())
        .unwrap_or_else(|| {
            panic!("nats-server 2.15 not found: run scripts/test.sh or set FLEETMQ_NATS_SERVER")
        })
}

impl Nats {
    /// Starts one server with JetStream (file storage in its folder) and
    /// waits until it accepts clients.
    ///
    /// # Panics
    ///
    /// nats-server is missing or does not start within 30 s.
    pub(crate) fn start() -> Nats {
        let binary = nats_server();
        let dir = TempDir::new("nats");
        let port = free_port();
        let config = dir.path("nats.conf");
        std::fs::write(
            &config,
            format!(
                "listen: \"127.0.0.1:{port}\"\njetstream {{\n  store_dir: {:?}\n  \
                 max_memory_store: 64MB\n  max_file_store: 1GB\n}}\n",
                dir.path("store").display().to_string()
            ),
        )
        .expect("write the config");
        let log = dir.path("nats.log");
        let file = File::create(&log).expect("create the log");
        let child = Command::new(&binary)
            .arg("-c")
            .arg(&config)
            .stdin(Stdio::null())
            .stdout(Stdio::from(file.try_clone().expect("clone a file handle")))
            .stderr(Stdio::from(file))
            .spawn()
            .unwrap_or_else(|e| panic!("{} starts: {e}", binary.display()));
        let mut nats = Nats {
            child: Some(child),
            port,
            log,
            _dir: dir,
        };
        let deadline = Instant::now() + READY_TIMEOUT;
        while !tail(&nats.log, 50).contains("Server is ready") {
            let exited = nats
                .child
                .as_mut()
                .map(|c| c.try_wait().ok().flatten().is_some());
            assert!(
                Instant::now() < deadline && exited != Some(true),
                "nats-server did not start:\n{}",
                tail(&nats.log, 40)
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        nats
    }

    /// Its client URL.
    pub(crate) fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }
}

impl Drop for Nats {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "--- nats-server log at the panic ---\n{}",
                tail(&self.log, 30)
            );
        }
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
