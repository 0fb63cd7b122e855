//! `proxy --listen A --upstream B`: a TCP fault-injection proxy (std
//! threads, blocking sockets: simple and correct, meant for fault tests
//! rather than peak rate).
//!
//! Per accepted connection: one upstream connection, and per direction a
//! reader thread feeding a writer thread through a queue, so that
//! - `--delay D` holds every chunk D before forwarding it (each direction:
//!   a request/response round trip takes at least 2·D) without limiting
//!   throughput;
//! - `--bandwidth R` paces each direction of each connection to R bytes/s;
//! - `--hold-upstream` keeps what the upstream sends (replies) queued,
//!   not forwarded, until SIGUSR2 releases it (SIGUSR2 toggles the hold);
//! - `--cut-after T` closes each connection T after it was accepted, and
//!   SIGUSR1 closes every open connection at once;
//! - `--control FILE` switches the delay and the hold while the proxy runs:
//!   the file is re-read when it changes (polled every 100 ms), one
//!   setting a line, `delay D` (e.g. `delay 1s`) and `hold on|off`; a
//!   line that does not parse is reported on stderr and ignored.
//!
//! In a program, [`start`] returns a [`Proxy`] whose [`Proxy::set_delay`],
//! [`Proxy::set_hold`] and [`Proxy::cut_all`] do the same at run time. A
//! changed delay applies to bytes already queued too: lowering it releases
//! them at once (in order), raising it holds them longer.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use clap::Args;

use crate::options::parse_duration;

/// SIGUSR1 count: every connection opened before a change is cut.
static CUT_GENERATION: AtomicU64 = AtomicU64::new(0);
/// Replies held (toggled by SIGUSR2), in every proxy of the process.
static HOLD: AtomicBool = AtomicBool::new(false);

/// The run-time switches of one proxy, read by all its connections.
#[derive(Debug, Default)]
struct Controls {
    /// The delay each chunk waits in each direction, nanoseconds.
    delay_nanos: AtomicU64,
    /// Replies held (this proxy only; SIGUSR2 toggles [`HOLD`], which
    /// inverts it for every proxy of the process).
    hold: AtomicBool,
    /// [`Proxy::cut_all`] count: connections opened before a change are cut.
    cuts: AtomicU64,
}

impl Controls {
    fn delay(&self) -> Duration {
        Duration::from_nanos(self.delay_nanos.load(Ordering::SeqCst))
    }

    fn set_delay(&self, delay: Duration) {
        let nanos = u64::try_from(delay.as_nanos()).unwrap_or(u64::MAX);
        self.delay_nanos.store(nanos, Ordering::SeqCst);
    }

    fn holding(&self) -> bool {
        self.hold.load(Ordering::SeqCst) != HOLD.load(Ordering::SeqCst)
    }

    /// Changes with SIGUSR1 and with [`Proxy::cut_all`].
    fn cut_generation(&self) -> u64 {
        self.cuts
            .load(Ordering::SeqCst)
            .wrapping_add(CUT_GENERATION.load(Ordering::SeqCst))
    }
}

extern "C" fn on_sigusr1(_: libc::c_int) {
    CUT_GENERATION.fetch_add(1, Ordering::SeqCst);
}

extern "C" fn on_sigusr2(_: libc::c_int) {
    HOLD.fetch_xor(true, Ordering::SeqCst);
}

/// Options of `fleetmq-loadgen proxy`.
#[derive(Debug, Clone, Args)]
pub struct ProxyArgs {
    /// Address to listen on, e.g. 127.0.0.1:1884 (port 0: any free port;
    /// the bound address is printed).
    #[arg(long, value_parser = parse_addr)]
    pub listen: SocketAddr,
    /// Address to forward to, e.g. 127.0.0.1:1883.
    #[arg(long, value_parser = parse_addr)]
    pub upstream: SocketAddr,
    /// Latency added to every chunk, each direction (e.g. 200ms).
    #[arg(long, value_parser = parse_duration, default_value = "0s")]
    pub delay: Duration,
    /// Throughput cap per direction per connection, e.g. 1MiB/s, 500KB/s.
    #[arg(long, value_parser = parse_bandwidth)]
    pub bandwidth: Option<u64>,
    /// Hold upstream replies (queued, not forwarded) from the start;
    /// SIGUSR2 toggles the hold.
    #[arg(long)]
    pub hold_upstream: bool,
    /// Close each connection this long after it was accepted.
    #[arg(long, value_parser = parse_duration)]
    pub cut_after: Option<Duration>,
    /// A file of run-time settings, re-read when it changes (every 100 ms):
    /// lines `delay D` and `hold on|off`.
    #[arg(long, value_name = "FILE")]
    pub control: Option<PathBuf>,
    /// Stop the proxy after this long (default: run until killed).
    #[arg(long, value_parser = parse_duration)]
    pub duration: Option<Duration>,
    /// Timeout for connecting to the upstream.
    #[arg(long, value_parser = parse_duration, default_value = "5s")]
    pub connect_timeout: Duration,
}

impl ProxyArgs {
    /// A proxy on a free 127.0.0.1 port forwarding to `upstream` with no
    /// fault (the command line's defaults), for programs that start one
    /// with [`start`] and switch faults on through the [`Proxy`].
    pub fn plain(upstream: SocketAddr) -> ProxyArgs {
        ProxyArgs {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            upstream,
            delay: Duration::ZERO,
            bandwidth: None,
            hold_upstream: false,
            cut_after: None,
            control: None,
            duration: None,
            connect_timeout: Duration::from_secs(5),
        }
    }
}

fn parse_addr(s: &str) -> Result<SocketAddr, String> {
    let hostport = s
        .strip_prefix("mqtt://")
        .or_else(|| s.strip_prefix("tcp://"))
        .unwrap_or(s);
    hostport
        .to_socket_addrs()
        .map_err(|e| format!("`{s}`: expected HOST:PORT ({e})"))?
        .next()
        .ok_or_else(|| format!("`{s}` resolves to no address"))
}

/// Parses a byte rate: `1MiB/s`, `500KB/s`, `64k`, `1000` (bytes/s).
pub fn parse_bandwidth(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let t = t
        .strip_suffix("/s")
        .or_else(|| t.strip_suffix("ps"))
        .unwrap_or(t);
    let split = t.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(t.len());
    let (num, unit) = (&t[..split], &t[split..]);
    let v: f64 = num
        .trim()
        .parse()
        .map_err(|_| format!("`{s}` is not a byte rate (e.g. 1MiB/s, 500KB/s)"))?;
    let mult = match unit {
        "" | "B" => 1.0,
        "k" | "K" | "KB" | "kB" => 1e3,
        "KiB" | "Ki" => 1024.0,
        "M" | "MB" => 1e6,
        "MiB" | "Mi" => 1024.0 * 1024.0,
        "G" | "GB" => 1e9,
        "GiB" | "Gi" => 1024.0 * 1024.0 * 1024.0,
        _ => {
            return Err(format!(
                "`{s}`: unknown unit `{unit}` (B, KB, KiB, MB, MiB, GB, GiB)"
            ))
        }
    };
    let r = (v * mult).round();
    if !r.is_finite() || r < 1.0 {
        return Err(format!("`{s}`: the bandwidth must be at least 1 byte/s"));
    }
    Ok(r as u64)
}

/// A running proxy.
pub struct Proxy {
    /// The bound listen address.
    pub addr: SocketAddr,
    stop: Arc<AtomicBool>,
    controls: Arc<Controls>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Proxy {
    /// Sets the delay every chunk waits in each direction (a request and
    /// its reply: at least 2 × `delay`), from now on, for queued bytes too.
    pub fn set_delay(&self, delay: Duration) {
        self.controls.set_delay(delay);
    }

    /// The current delay of each direction.
    pub fn delay(&self) -> Duration {
        self.controls.delay()
    }

    /// Holds (queues, not forwards) what the upstream sends, or releases it.
    pub fn set_hold(&self, hold: bool) {
        self.controls.hold.store(hold, Ordering::SeqCst);
    }

    /// Closes every connection open now (both sides); new ones are served.
    pub fn cut_all(&self) {
        self.controls.cuts.fetch_add(1, Ordering::SeqCst);
    }

    /// Stops accepting and cuts every connection.
    pub fn stop(mut self) {
        self.halt();
    }

    fn halt(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }

    /// Waits until the proxy stops (`--duration`), forever otherwise.
    pub fn wait(mut self) {
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.halt();
    }
}

/// Installs SIGUSR1 (cut all) and SIGUSR2 (toggle hold).
pub fn install_signals() {
    // SAFETY: the handlers only touch atomics (async-signal-safe).
    unsafe {
        libc::signal(
            libc::SIGUSR1,
            on_sigusr1 as extern "C" fn(libc::c_int) as libc::sighandler_t,
        );
        libc::signal(
            libc::SIGUSR2,
            on_sigusr2 as extern "C" fn(libc::c_int) as libc::sighandler_t,
        );
    }
}

/// Binds and starts the proxy on a background thread.
///
/// # Errors
/// When the listen address cannot be bound.
pub fn start(args: ProxyArgs) -> Result<Proxy, String> {
    let listener = TcpListener::bind(args.listen)
        .map_err(|e| format!("cannot listen on {}: {e}", args.listen))?;
    let addr = listener
        .local_addr()
        .map_err(|e| format!("cannot listen on {}: {e}", args.listen))?;
    listener
        .set_nonblocking(true)
        .map_err(|e| format!("cannot listen on {addr}: {e}"))?;
    let controls = Arc::new(Controls::default());
    controls.set_delay(args.delay);
    controls.hold.store(args.hold_upstream, Ordering::SeqCst);
    let stop = Arc::new(AtomicBool::new(false));
    let (stop2, controls2) = (stop.clone(), controls.clone());
    let thread = std::thread::Builder::new()
        .name("proxy-accept".into())
        .spawn(move || accept_loop(listener, &args, &stop2, &controls2))
        .map_err(|e| format!("cannot start a thread: {e}"))?;
    Ok(Proxy {
        addr,
        stop,
        controls,
        thread: Some(thread),
    })
}

fn accept_loop(
    listener: TcpListener,
    args: &ProxyArgs,
    stop: &Arc<AtomicBool>,
    controls: &Arc<Controls>,
) {
    let started = Instant::now();
    let mut conns = Vec::new();
    loop {
        if stop.load(Ordering::SeqCst) || args.duration.is_some_and(|d| started.elapsed() >= d) {
            stop.store(true, Ordering::SeqCst);
            break;
        }
        match listener.accept() {
            Ok((client, peer)) => {
                let (args, stop, controls) = (args.clone(), stop.clone(), controls.clone());
                conns.push(std::thread::spawn(move || {
                    if let Err(e) = serve(client, &args, &stop, &controls) {
                        eprintln!("fleetmq-loadgen proxy: {peer}: {e}");
                    }
                }));
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => {
                eprintln!("fleetmq-loadgen proxy: accept: {e}");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        conns.retain(|c: &std::thread::JoinHandle<()>| !c.is_finished());
    }
    for c in conns {
        let _ = c.join();
    }
}

/// One proxied connection: two directions, and a supervisor that cuts.
fn serve(
    client: TcpStream,
    args: &ProxyArgs,
    stop: &AtomicBool,
    controls: &Arc<Controls>,
) -> std::io::Result<()> {
    client.set_nonblocking(false)?;
    let generation = controls.cut_generation();
    let opened = Instant::now();
    let upstream = match TcpStream::connect_timeout(&args.upstream, args.connect_timeout) {
        Ok(u) => u,
        Err(e) => {
            let _ = client.shutdown(Shutdown::Both);
            return Err(std::io::Error::new(
                e.kind(),
                format!("upstream {}: {e}", args.upstream),
            ));
        }
    };
    let _ = client.set_nodelay(true);
    let _ = upstream.set_nodelay(true);
    let done = Arc::new(AtomicU64::new(0));
    let cut_flag = Arc::new(AtomicBool::new(false));
    let ends = Ends {
        done: done.clone(),
        cut: cut_flag.clone(),
        controls: controls.clone(),
    };
    let up = pipe(
        client.try_clone()?,
        upstream.try_clone()?,
        args,
        false,
        ends.clone(),
    );
    let down = pipe(upstream.try_clone()?, client.try_clone()?, args, true, ends);
    // Supervisor: cut on schedule, on SIGUSR1, or when the proxy stops.
    while done.load(Ordering::SeqCst) < 2 {
        let cut = stop.load(Ordering::SeqCst)
            || controls.cut_generation() != generation
            || args.cut_after.is_some_and(|t| opened.elapsed() >= t);
        if cut {
            cut_flag.store(true, Ordering::SeqCst);
            let _ = client.shutdown(Shutdown::Both);
            let _ = upstream.shutdown(Shutdown::Both);
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    for t in up.into_iter().chain(down) {
        let _ = t.join();
    }
    Ok(())
}

/// What the two directions of one connection share.
#[derive(Clone)]
struct Ends {
    /// Finished directions.
    done: Arc<AtomicU64>,
    /// Set when the supervisor cut the connection.
    cut: Arc<AtomicBool>,
    controls: Arc<Controls>,
}

/// Copies `from` → `to` through a delay queue; returns the two threads.
fn pipe(
    mut from: TcpStream,
    mut to: TcpStream,
    args: &ProxyArgs,
    reply: bool,
    ends: Ends,
) -> Vec<std::thread::JoinHandle<()>> {
    let (tx, rx) = mpsc::channel::<(Instant, Vec<u8>)>();
    let Ends {
        done,
        cut,
        controls,
    } = ends;
    let reader = std::thread::spawn(move || {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match from.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if tx.send((Instant::now(), buf[..n].to_vec())).is_err() {
                        break;
                    }
                }
            }
        }
        // Dropping tx ends the writer once the queue is empty.
    });
    let bandwidth = args.bandwidth;
    let writer = std::thread::spawn(move || {
        let started = Instant::now();
        let mut written = 0u64;
        'outer: for (read_at, chunk) in rx {
            // The delay is read again while waiting: a change applies to
            // queued chunks too.
            loop {
                let due = read_at + controls.delay();
                let now = Instant::now();
                if due <= now {
                    break;
                }
                if cut.load(Ordering::SeqCst) {
                    break 'outer;
                }
                std::thread::sleep((due - now).min(Duration::from_millis(20)));
            }
            while reply && controls.holding() {
                // Held: give up when cut or the other direction ended.
                if cut.load(Ordering::SeqCst) || done.load(Ordering::SeqCst) >= 1 {
                    break 'outer;
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            // Paced writes: at most `bandwidth` bytes per second.
            let step = bandwidth.map_or(chunk.len(), |b| (b as usize / 100).clamp(1, chunk.len()));
            for piece in chunk.chunks(step) {
                if to.write_all(piece).is_err() {
                    break 'outer;
                }
                written += piece.len() as u64;
                if let Some(b) = bandwidth {
                    let due = Duration::from_secs_f64(written as f64 / b as f64);
                    let spent = started.elapsed();
                    if due > spent {
                        std::thread::sleep(due - spent);
                    }
                }
            }
        }
        let _ = to.shutdown(Shutdown::Write);
        done.fetch_add(1, Ordering::SeqCst);
    });
    vec![reader, writer]
}

/// `fleetmq-loadgen proxy`: prints the bound address, runs until killed
/// or `--duration` ends.
///
/// # Errors
/// When the listen address cannot be bound.
pub fn run(args: ProxyArgs) -> Result<(), String> {
    install_signals();
    let upstream = args.upstream;
    let control = args.control.clone();
    let p = start(args)?;
    if let Some(path) = control {
        let controls = p.controls.clone();
        std::thread::Builder::new()
            .name("proxy-control".into())
            .spawn(move || watch_control_file(&path, &controls))
            .map_err(|e| format!("cannot start a thread: {e}"))?;
    }
    println!("fleetmq-loadgen proxy: listening {} -> {upstream}", p.addr);
    let _ = std::io::stdout().flush();
    p.wait();
    Ok(())
}

/// Applies `--control FILE` whenever its modification time or length
/// changes (checked every 100 ms); a missing file changes nothing.
fn watch_control_file(path: &std::path::Path, controls: &Controls) {
    let mut seen: Option<(SystemTime, u64)> = None;
    loop {
        let stamp = std::fs::metadata(path)
            .ok()
            .and_then(|m| Some((m.modified().ok()?, m.len())));
        if stamp.is_some() && stamp != seen {
            seen = stamp;
            match std::fs::read_to_string(path) {
                Ok(text) => apply_control(&text, controls),
                Err(e) => eprintln!("fleetmq-loadgen proxy: {}: {e}", path.display()),
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Applies the lines of a control file: `delay D`, `hold on|off`; blank
/// lines and `#` comments are skipped, others reported on stderr.
fn apply_control(text: &str, controls: &Controls) {
    for line in text.lines().map(str::trim) {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let applied = match line.split_once(char::is_whitespace) {
            Some(("delay", value)) => parse_duration(value.trim()).map(|d| controls.set_delay(d)),
            Some(("hold", value @ ("on" | "off"))) => {
                controls.hold.store(value == "on", Ordering::SeqCst);
                Ok(())
            }
            _ => Err("expected `delay D` or `hold on|off`".to_owned()),
        };
        if let Err(e) = applied {
            eprintln!("fleetmq-loadgen proxy: control line {line:?} ignored: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bandwidths_take_units() {
        assert_eq!(parse_bandwidth("1MiB/s"), Ok(1024 * 1024));
        assert_eq!(parse_bandwidth("500KB/s"), Ok(500_000));
        assert_eq!(parse_bandwidth("64k"), Ok(64_000));
        assert_eq!(parse_bandwidth("1000"), Ok(1000));
        assert!(parse_bandwidth("fast").is_err());
        assert!(parse_bandwidth("0").is_err());
        assert!(parse_bandwidth("1 parsec/s").is_err());
    }

    fn echo_server() -> SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        std::thread::spawn(move || {
            for s in l.incoming() {
                let Ok(mut s) = s else { return };
                std::thread::spawn(move || {
                    let mut buf = [0u8; 4096];
                    while let Ok(n) = s.read(&mut buf) {
                        if n == 0 || s.write_all(&buf[..n]).is_err() {
                            return;
                        }
                    }
                });
            }
        });
        addr
    }

    fn args(upstream: SocketAddr) -> ProxyArgs {
        ProxyArgs {
            connect_timeout: Duration::from_secs(2),
            ..ProxyArgs::plain(upstream)
        }
    }

    #[test]
    fn delay_and_bandwidth_slow_an_echo_and_cut_after_closes() {
        let echo = echo_server();
        let p = start(ProxyArgs {
            delay: Duration::from_millis(100),
            ..args(echo)
        })
        .unwrap();
        let mut s = TcpStream::connect(p.addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let t = Instant::now();
        s.write_all(b"ping").unwrap();
        let mut buf = [0u8; 4];
        s.read_exact(&mut buf).unwrap();
        assert_eq!(&buf, b"ping");
        assert!(
            t.elapsed() >= Duration::from_millis(200),
            "{:?}",
            t.elapsed()
        );
        p.stop();

        // 20 KB at 50 KB/s each way: at least ~0.4 s.
        let p = start(ProxyArgs {
            bandwidth: Some(50_000),
            ..args(echo)
        })
        .unwrap();
        let mut s = TcpStream::connect(p.addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let t = Instant::now();
        let data = vec![7u8; 20_000];
        s.write_all(&data).unwrap();
        let mut back = vec![0u8; 20_000];
        s.read_exact(&mut back).unwrap();
        assert!(
            t.elapsed() >= Duration::from_millis(350),
            "{:?}",
            t.elapsed()
        );
        p.stop();

        let p = start(ProxyArgs {
            cut_after: Some(Duration::from_millis(200)),
            ..args(echo)
        })
        .unwrap();
        let mut s = TcpStream::connect(p.addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let t = Instant::now();
        let mut buf = [0u8; 1];
        assert!(matches!(s.read(&mut buf), Ok(0) | Err(_)), "cut");
        assert!(t.elapsed() >= Duration::from_millis(150));
        assert!(t.elapsed() < Duration::from_secs(3));
        p.stop();
    }

    /// A round trip of 4 bytes through `s`, timed.
    fn round_trip(s: &mut TcpStream) -> Duration {
        let t = Instant::now();
        s.write_all(b"ping").unwrap();
        let mut buf = [0u8; 4];
        s.read_exact(&mut buf).unwrap();
        assert_eq!(&buf, b"ping");
        t.elapsed()
    }

    #[test]
    fn delay_hold_and_cut_switch_while_the_proxy_runs() {
        let p = start(args(echo_server())).unwrap();
        let mut s = TcpStream::connect(p.addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        assert!(round_trip(&mut s) < Duration::from_millis(150));

        p.set_delay(Duration::from_millis(150));
        assert_eq!(p.delay(), Duration::from_millis(150));
        assert!(round_trip(&mut s) >= Duration::from_millis(300));

        // Bytes queued under a long delay go as soon as it is lowered.
        p.set_delay(Duration::from_secs(30));
        let lowered = {
            let p = &p;
            std::thread::scope(|scope| {
                scope.spawn(|| {
                    std::thread::sleep(Duration::from_millis(200));
                    p.set_delay(Duration::ZERO);
                });
                round_trip(&mut s)
            })
        };
        assert!(lowered >= Duration::from_millis(200), "{lowered:?}");
        assert!(lowered < Duration::from_secs(3), "{lowered:?}");

        // Held replies are queued, then released in order.
        p.set_hold(true);
        s.write_all(b"held").unwrap();
        s.set_read_timeout(Some(Duration::from_millis(300)))
            .unwrap();
        let mut buf = [0u8; 4];
        assert!(s.read_exact(&mut buf).is_err(), "held: nothing comes back");
        p.set_hold(false);
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s.read_exact(&mut buf).unwrap();
        assert_eq!(&buf, b"held");

        // cut_all closes what is open; a new connection is served.
        p.cut_all();
        assert!(matches!(s.read(&mut buf), Ok(0) | Err(_)), "cut");
        let mut again = TcpStream::connect(p.addr).unwrap();
        again
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        assert!(round_trip(&mut again) < Duration::from_secs(1));
        p.stop();
    }

    #[test]
    fn control_lines_set_the_delay_and_the_hold() {
        let controls = Controls::default();
        apply_control("# slow\ndelay 2s\n\nhold on\n", &controls);
        assert_eq!(controls.delay(), Duration::from_secs(2));
        assert!(controls.holding());
        apply_control("delay soon\nhold maybe\nhold off\n", &controls);
        assert_eq!(
            controls.delay(),
            Duration::from_secs(2),
            "a bad line changes nothing"
        );
        assert!(!controls.holding());
    }
}
