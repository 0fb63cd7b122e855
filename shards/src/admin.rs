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

use std::future::IntoFuture;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::Context;
use axum::http::{header, StatusCode};
use axum::routing::get;
use axum::Router;
use tokio::sync::oneshot;

use crate::metrics::{Metrics, CONTENT_TYPE};

/// How long [`AdminHandle::stop`] lets requests in progress finish before
/// dropping their connections.
pub const STOP_GRACE: Duration = Duration::from_secs(2);

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
    let std_listener = std::net::TcpListener::bind(addr)
        .with_context(|| format!("admin: cannot listen on {addr}"))?;
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

async fn serve(listener: tokio::net::TcpListener, app: Router, stop: oneshot::Receiver<()>) {
    let (stopping_tx, stopping_rx) = oneshot::channel::<()>();
    let server = axum::serve(listener, app).with_graceful_shutdown(async move {
        // A dropped sender (handle leaked without stop) also stops the server.
        let _ = stop.await;
        let _ = stopping_tx.send(());
    });
    let grace_over = async move {
        if stopping_rx.await.is_ok() {
            tokio::time::sleep(STOP_GRACE).await;
        } else {
            std::future::pending::<()>().await;
        }
    };
    tokio::select! {
        result = server.into_future() => {
            if let Err(err) = result {
                tracing::error!("admin: server failed: {err}");
            }
        }
        () = grace_over => tracing::warn!("admin: requests still open after {STOP_GRACE:?}, dropped"),
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
