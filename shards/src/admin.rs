//! The admin HTTP server (DESIGN.md §12): health and Prometheus metrics.
//!
//! It runs on its own named thread, `fleetmq-admin`, with a tokio
//! current-thread runtime and axum, away from the shards: a slow scrape never
//! delays MQTT traffic.
//!
//! | route | answer |
//! | --- | --- |
//! | `GET /health/live` | 200 `ok` while the process serves HTTP |
//! | `GET /health/ready` | 200 `ready` once the broker serves MQTT, else 503 `starting`, or 503 with the reason while the local store refuses publishes |
//! | `GET /metrics` | 200, [`Metrics::render`] as OpenMetrics text |
//!
//! What a flood of the admin port can take is bounded, so that it cannot
//! take descriptors or memory from MQTT (found by a fresh-user pass: 20,000
//! connections that each sent `GET /x HTTP/1.1\r\n` and nothing more all
//! stayed open, the process ran out of descriptors, new MQTT clients timed
//! out): at most [`MAX_CONNECTIONS`] connections are served at once (one
//! more closes the oldest open one and takes its place, so a flood of
//! unfinished requests does not keep a health probe out),
//! each has [`HEAD_TIMEOUT`] to send a request head (also between requests
//! of a kept-alive connection), and a head is at most [`MAX_HEAD_BYTES`].

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::collections::VecDeque;
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::Context;
use axum::http::{header, StatusCode};
use axum::routing::get;
use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::sync::{oneshot, watch, Notify, Semaphore};

use crate::metrics::{Metrics, CONTENT_TYPE};

/// How long [`AdminHandle::stop`] lets requests in progress finish before
/// dropping their connections.
pub const STOP_GRACE: Duration = Duration::from_secs(2);

/// Admin connections served at once. A connection accepted beyond it
/// closes the oldest one open and is served (a flood of unfinished
/// requests cannot keep a health probe out); if no slot is free within
/// [`EVICT_WAIT`] after that, it is answered `503` (when its socket takes
/// the bytes at once) and closed.
pub const MAX_CONNECTIONS: usize = 64;

/// How long a connection beyond [`MAX_CONNECTIONS`] waits for the slot
/// of the connection it closed.
pub const EVICT_WAIT: Duration = Duration::from_millis(100);

/// How long a connection has to send a whole request head, from when it
/// is accepted or its last response was written; then it is closed.
pub const HEAD_TIMEOUT: Duration = Duration::from_secs(5);

/// The most bytes of a request read before it is answered (hyper's read
/// buffer; a longer head is refused with 431).
pub const MAX_HEAD_BYTES: usize = 16 * 1024;

/// The answer to a connection beyond [`MAX_CONNECTIONS`].
const BUSY: &[u8] =
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 5\r\nconnection: close\r\n\r\nbusy\n";

/// The running admin server. Dropping it stops the server too.
#[derive(Debug)]
pub struct AdminHandle {
    /// The address it listens on (the real port when 0 was asked for).
    pub local_addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

/// Binds `addr` and serves the admin routes on the `fleetmq-admin` thread.
/// `/health/ready` answers 200 while `ready` is true, 503 otherwise.
///
/// Binding happens before this returns, so an address in use is reported
/// here, before the broker starts.
///
/// # Errors
///
/// The address cannot be bound, the runtime cannot be built, or the thread
/// cannot be spawned.
pub fn spawn(
    addr: SocketAddr,
    metrics: Arc<Metrics>,
    ready: Arc<AtomicBool>,
) -> anyhow::Result<AdminHandle> {
    let std_listener = bind(addr).with_context(|| format!("admin: cannot listen on {addr}"))?;
    std_listener.set_nonblocking(true)?;
    let local_addr = std_listener.local_addr()?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("admin: building the tokio runtime")?;
    let listener = {
        let _in_runtime = runtime.enter();
        tokio::net::TcpListener::from_std(std_listener)?
    };
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let app = router(metrics, ready);
    let thread = std::thread::Builder::new()
        .name("fleetmq-admin".into())
        .spawn(move || {
            runtime.block_on(serve(listener, app, stop_rx));
        })
        .context("admin: spawning the thread")?;
    tracing::info!("admin: listening on http://{local_addr}");
    Ok(AdminHandle {
        local_addr,
        stop: Some(stop_tx),
        thread: Some(thread),
    })
}

impl AdminHandle {
    /// Stops accepting, lets requests in progress finish (at most
    /// [`STOP_GRACE`]) and joins the thread.
    pub fn stop(mut self) {
        self.stop_and_join();
    }

    fn stop_and_join(&mut self) {
        if let Some(stop) = self.stop.take() {
            // An error means the server already ended; joining tells why.
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            if thread.join().is_err() {
                tracing::error!("admin: the admin thread panicked");
            }
        }
    }
}

impl Drop for AdminHandle {
    fn drop(&mut self) {
        self.stop_and_join();
    }
}

fn router(metrics: Arc<Metrics>, ready: Arc<AtomicBool>) -> Router {
    Router::new()
        .route("/health/live", get(|| async { "ok" }))
        .route(
            "/health/ready",
            get({
                let metrics = metrics.clone();
                move || async move {
                    if !ready.load(Ordering::Acquire) {
                        return (StatusCode::SERVICE_UNAVAILABLE, "starting".to_owned());
                    }
                    // The store's problem, or the cluster's (fenced, another
                    // process with this replica ID: DESIGN.md §12), in the body.
                    match metrics.store_problem().or_else(|| metrics.not_ready()) {
                        Some(reason) => (StatusCode::SERVICE_UNAVAILABLE, reason),
                        None => (StatusCode::OK, "ready".to_owned()),
                    }
                }
            }),
        )
        .route(
            "/api/v1/status",
            get({
                let metrics = metrics.clone();
                move || async move { ([(header::CONTENT_TYPE, "application/json")], metrics.status_json()) }
            }),
        )
        .route(
            "/metrics",
            get(move || async move { ([(header::CONTENT_TYPE, CONTENT_TYPE)], metrics.render()) }),
        )
}

/// A listening socket on `addr` whose accept queue is as long as the
/// kernel allows (`net.core.somaxconn`): under a flood the accept loop
/// closes a connection for each one it takes, and a probe whose SYN
/// found the queue full (std's 128) would wait a second for its retry.
fn bind(addr: SocketAddr) -> std::io::Result<std::net::TcpListener> {
    use socket2::{Domain, Protocol, Socket, Type};
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    socket.set_reuse_address(true)?;
    socket.bind(&addr.into())?;
    socket.listen(libc::c_int::MAX)?;
    Ok(socket.into())
}

/// Accepts until `stop` (or its sender is dropped), serving each
/// connection in a task of its own within the bounds in the module docs;
/// then lets requests in progress finish, at most [`STOP_GRACE`].
async fn serve(listener: tokio::net::TcpListener, app: Router, mut stop: oneshot::Receiver<()>) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    // The connections served, oldest first (gone ones are skipped).
    let mut open: VecDeque<Weak<Notify>> = VecDeque::new();
    let (closing_tx, closing_rx) = watch::channel(false);
    // Paced and logged as the MQTT listeners' accept errors are.
    let mut errors = crate::acceptor::AcceptErrors::default();
    loop {
        let stream = tokio::select! {
            _ = &mut stop => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    if let Some(count) = errors.accepted() {
                        tracing::warn!(count, "admin: accept failed (not logged before); accepting again");
                    }
                    stream
                }
                Err(err) => {
                    // Out of descriptors, mostly: pause instead of spinning.
                    let (pause, log) = errors.failed(std::time::Instant::now());
                    if let Some(count) = log {
                        tracing::warn!(error = %err, count, pause_ms = pause.as_millis(), "admin: accept failed");
                    }
                    tokio::time::sleep(pause).await;
                    continue;
                }
            },
        };
        let slot = match slots.clone().try_acquire_owned() {
            Ok(slot) => slot,
            Err(_) => {
                // Full: the oldest connection still open gives way, so a
                // flood of unfinished requests cannot keep probes out.
                while let Some(oldest) = open.pop_front() {
                    if let Some(evict) = oldest.upgrade() {
                        evict.notify_one();
                        break;
                    }
                }
                match tokio::time::timeout(EVICT_WAIT, slots.clone().acquire_owned()).await {
                    Ok(Ok(slot)) => slot,
                    _ => {
                        // Whatever the socket does not take at once is not waited for.
                        let _ = stream.try_write(BUSY);
                        continue;
                    }
                }
            }
        };
        let evict = Arc::new(Notify::new());
        if open.len() >= 2 * MAX_CONNECTIONS {
            open.retain(|c| c.strong_count() > 0);
        }
        open.push_back(Arc::downgrade(&evict));
        let app = app.clone();
        let mut closing = closing_rx.clone();
        tokio::spawn(async move {
            let _slot = slot;
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(HEAD_TIMEOUT)
                .max_buf_size(MAX_HEAD_BYTES);
            let conn = builder.serve_connection(TokioIo::new(stream), TowerToHyperService::new(app));
            tokio::pin!(conn);
            tokio::select! {
                _ = conn.as_mut() => return,
                () = evict.notified() => return,
                _ = closing.wait_for(|closing| *closing) => conn.as_mut().graceful_shutdown(),
            }
            let _ = conn.await;
        });
    }
    drop(listener);
    let _ = closing_tx.send(true);
    // Every connection holds a slot until it ends.
    let all = u32::try_from(MAX_CONNECTIONS).unwrap_or(u32::MAX);
    if tokio::time::timeout(STOP_GRACE, slots.acquire_many(all)).await.is_err() {
        tracing::warn!("admin: requests still open after {STOP_GRACE:?}, dropped");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    /// One HTTP/1.1 request over a plain socket; returns the whole response.
    fn get(addr: SocketAddr, path: &str) -> String {
        let mut stream = std::net::TcpStream::connect(addr).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        write!(
            stream,
            "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
        )
        .unwrap();
        let mut response = String::new();
        stream.read_to_string(&mut response).unwrap();
        response
    }

    #[test]
    fn admin_serves_liveness_readiness_and_metrics_then_stops() {
        let metrics = Metrics::new(1);
        metrics.shard(0).clients_connected.inc();
        let ready = Arc::new(AtomicBool::new(false));
        let admin = spawn("127.0.0.1:0".parse().unwrap(), metrics, ready.clone()).unwrap();
        let addr = admin.local_addr;
        assert_ne!(addr.port(), 0);

        let live = get(addr, "/health/live");
        assert!(live.starts_with("HTTP/1.1 200"), "{live}");
        assert!(live.ends_with("ok"), "{live}");

        let starting = get(addr, "/health/ready");
        assert!(starting.starts_with("HTTP/1.1 503"), "{starting}");
        assert!(starting.ends_with("starting"), "{starting}");
        ready.store(true, Ordering::Release);
        let ready_now = get(addr, "/health/ready");
        assert!(ready_now.starts_with("HTTP/1.1 200"), "{ready_now}");
        assert!(ready_now.ends_with("ready"), "{ready_now}");

        let text = get(addr, "/metrics");
        assert!(text.starts_with("HTTP/1.1 200"), "{text}");
        assert!(
            text.to_ascii_lowercase()
                .contains("content-type: application/openmetrics-text"),
            "{text}"
        );
        assert!(
            text.contains("fleetmq_clients_connected{shard=\"0\"} 1"),
            "{text}"
        );

        let missing = get(addr, "/nope");
        assert!(missing.starts_with("HTTP/1.1 404"), "{missing}");

        let started = std::time::Instant::now();
        admin.stop();
        assert!(
            started.elapsed() < Duration::from_millis(500),
            "stop with no open request took {:?}",
            started.elapsed()
        );
        assert!(std::net::TcpStream::connect(addr).is_err());
    }

    #[test]
    fn an_address_in_use_is_an_error_before_anything_starts() {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = taken.local_addr().unwrap();
        let err = spawn(addr, Metrics::new(1), Arc::new(AtomicBool::new(true))).unwrap_err();
        assert!(format!("{err:#}").contains("cannot listen on"), "{err:#}");
    }
}
