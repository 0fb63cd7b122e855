//! A shard's accept loops, one per listening socket (DESIGN.md §3; issue
//! 27, "Connect rate").
//!
//! Each loop takes connections off its socket with one `accept4` each
//! (the socket is non-blocking; the peer's address comes with it) and
//! waits on the ring only when it finds none ([`TcpListener::readable`]).
//! `TCP_NODELAY` is set once on the listening socket, which Linux copies
//! to every connection it accepts (`server::bind_reuseport`). glommio's
//! `shared_accept` cost five more system calls per connection: three
//! `fcntl` around each `accept`, then `getpeername` and `setsockopt`
//! (perf/RESULTS.md, 2026-12-05, "issue 27: the CONNECT path").
//!
//! A loop yields to the shard's other tasks after [`ACCEPT_BATCH`]
//! connections, so that those it let in read their CONNECTs while the
//! kernel's queue still holds more.
//!
//! The limits that hold before anything is read are applied here, as each
//! connection is accepted (DESIGN.md §9): `max_connections_per_source`,
//! then `max_pending_connections` (`crate::pending`). When the shard is
//! behind its pending connections (every one that could give way has its
//! bytes waiting unread), the loop holds the connection it has just
//! accepted and accepts no more until one leaves: a reconnect storm waits
//! in the kernel's listen queue instead of being refused or evicted
//! (issue 27).
//!
//! With more than one shard, a plain TCP connection whose whole CONNECT is
//! there at once and names a client identifier another shard owns goes
//! to that shard before anything is built for it here (`crate::arrival`).

use std::net::{IpAddr, Ipv4Addr};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, IntoRawFd, OwnedFd};
use std::rc::Rc;
use std::time::{Duration, Instant};

use futures_lite::future::{or, yield_now};
use glommio::net::{TcpListener, TcpStream};
use glommio::timer::sleep;
use socket2::SockRef;
use tracing::warn;

use crate::arrival::{first_read, Fresh};
use crate::arrival::FirstRead;
use crate::connection::{accepted, refused, Admitted, ConnSettings};
use crate::limits::ShardGate;
use crate::metrics::RefuseReason;
use crate::pending::{Admission, PendingGuard};
use crate::shard::Shard;
use crate::transport::ListenerKind;

/// Connections a loop accepts before it lets the shard's other tasks run.
const ACCEPT_BATCH: usize = 64;

/// How long a loop waits after an accept error (out of descriptors, mostly);
/// each further error in a row doubles it, up to [`ERROR_PAUSE_MAX`], and a
/// connection accepted brings it back. While the process is out of
/// descriptors the kernel's listen queue stays readable, so without the
/// pause the loop would spin.
const ERROR_PAUSE: Duration = Duration::from_millis(10);

/// The longest pause after accept errors in a row.
const ERROR_PAUSE_MAX: Duration = Duration::from_secs(1);

/// Accept errors are logged at most once per this, with how many there
/// were since the last line (a fresh-user pass saw 1,314 lines of
/// `accept failed error=Too many open files` in 15 s).
const ERROR_LOG_EVERY: Duration = Duration::from_secs(1);

/// How long a loop holding a connection at `max_pending_connections`
/// waits before it asks again, if no pending connection of its shard left
/// meanwhile: room made on another shard is seen within this time.
const ROOM_RECHECK: Duration = Duration::from_millis(10);

/// One accept loop per listening socket of this shard, until the shard's
/// stop signal; `doors`: the shard's pending connections and credential
/// checks, for every listener of the shard.
pub(crate) fn spawn_acceptors(
    shard: &Rc<Shard>,
    settings: &Rc<ConnSettings>,
    doors: &Rc<ShardGate>,
    fds: Vec<(OwnedFd, ListenerKind)>,
) {
    for (fd, kind) in fds {
        if let Err(e) = SockRef::from(&fd).set_nonblocking(true) {
            warn!(target: "broker", error = %e, "listener not made non-blocking");
        }
        // SAFETY: the fd is a listening socket we own; the listener owns it now.
        let listener = unsafe { TcpListener::from_raw_fd(fd.into_raw_fd()) };
        let (shard, settings, doors) = (shard.clone(), settings.clone(), doors.clone());
        glommio::spawn_local(accept_loop(shard, settings, doors, listener, kind)).detach();
    }
}

/// What the loop does next.
enum Next {
    Accepted(socket2::Socket, IpAddr),
    /// Nothing to accept now, or an error: waited, look again.
    Wait,
    Stop,
}

async fn accept_loop(
    shard: Rc<Shard>,
    settings: Rc<ConnSettings>,
    doors: Rc<ShardGate>,
    listener: TcpListener,
    kind: ListenerKind,
) {
    let mut batch = 0;
    let mut errors = AcceptErrors::default();
    while !shard.stopping.get() {
        match accept_one(&shard, &listener, &mut errors).await {
            Next::Accepted(socket, peer) => {
                if let Some(count) = errors.accepted() {
                    warn!(target: "broker", count, "accept failed (not logged before); accepting again");
                }
                // Refused ones count too: a loop refusing a flood yields.
                if let Some((source_slot, pending)) = admit(&shard, &settings, &doors, &socket, peer).await {
                    let fresh = Fresh { socket, peer, source_slot, pending };
                    let stays = if shard.shards > 1 && kind == ListenerKind::Tcp {
                        first_read(&shard, &settings, fresh)
                    } else {
                        Some((fresh, FirstRead::Bytes(Default::default())))
                    };
                    if let Some((fresh, first)) = stays {
                        serve_here(&shard, &settings, &doors, fresh, first, kind);
                    }
                }
                batch += 1;
                if batch == ACCEPT_BATCH {
                    batch = 0;
                    yield_now().await;
                }
            }
            Next::Wait => batch = 0,
            Next::Stop => break,
        }
    }
}

/// Serve the connection in `fresh` on this shard, in a task of its own,
/// with what was read of it (`first`).
fn serve_here(
    shard: &Rc<Shard>,
    settings: &Rc<ConnSettings>,
    doors: &Rc<ShardGate>,
    fresh: Fresh,
    first: FirstRead,
    kind: ListenerKind,
) {
    let Fresh { socket, peer, source_slot, pending } = fresh;
    // The stream's state is aside: it lives while the connection is awake
    // (crate::alloc).
    // SAFETY: `socket` is a connected socket we own; the stream owns it now.
    let stream = crate::alloc::aside(|| unsafe { TcpStream::from_raw_fd(socket.into_raw_fd()) });
    let admitted = Admitted { stream, peer, kind, source_slot, pending, first };
    // Connection tasks are made aside (crate::alloc): they end when their
    // connection parks.
    crate::alloc::spawn_aside(accepted(shard.clone(), settings.clone(), doors.clone(), admitted));
}

/// The limits that hold before anything is read, for a connection just
/// accepted: its slots (source, pending), or `None` when it is refused
/// (closed, counted) or the shard stops. Waits while the shard is behind
/// (see the module docs).
async fn admit(
    shard: &Shard,
    settings: &ConnSettings,
    doors: &ShardGate,
    socket: &socket2::Socket,
    peer: IpAddr,
) -> Option<(Option<crate::limits::Slot>, PendingGuard)> {
    let Ok(source_slot) = settings.gate.source(peer) else {
        refused(shard, settings, RefuseReason::MaxConnectionsPerSource);
        return None;
    };
    loop {
        let fd = Some(socket.as_raw_fd());
        match doors.pending.admit(&settings.gate, Instant::now(), fd) {
            Admission::In(pending) => return Some((source_slot, pending)),
            Admission::Refused => {
                refused(shard, settings, RefuseReason::MaxPendingConnections);
                return None;
            }
            Admission::Behind => {
                or(doors.pending.room(), sleep(ROOM_RECHECK)).await;
                if shard.stopping.get() {
                    return None;
                }
            }
        }
    }
}

/// Accept one connection, or wait: for a connection to arrive, or after
/// an error.
async fn accept_one(shard: &Shard, listener: &TcpListener, errors: &mut AcceptErrors) -> Next {
    let stopped = async {
        shard.stop_signal.wait().await;
        Next::Stop
    };
    // SAFETY: the listener's fd stays open while `listener` lives.
    let fd = unsafe { BorrowedFd::borrow_raw(listener.as_raw_fd()) };
    match SockRef::from(&fd).accept() {
        Ok((socket, addr)) => {
            let peer = addr
                .as_socket()
                .map_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED), |a| a.ip());
            Next::Accepted(socket, peer)
        }
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
            // The pending wait's poll is not aside: it lives until the
            // next connection arrives, and would hold a page of the aside
            // heap resident when the connections it let in have parked
            // (perf/RESULTS.md, 2026-12-02, session 17).
            or(stopped, async {
                if let Err(e) = listener.readable().await {
                    warn!(target: "broker", error = %e, "waiting to accept failed");
                    sleep(ERROR_PAUSE).await;
                }
                Next::Wait
            })
            .await
        }
        // A connection reset before it was accepted, or a signal.
        Err(e) if matches!(e.raw_os_error(), Some(libc::ECONNABORTED | libc::EINTR)) => Next::Wait,
        Err(e) => {
            let (pause, log) = errors.failed(Instant::now());
            if let Some(count) = log {
                warn!(target: "broker", error = %e, count, pause_ms = pause.as_millis(), "accept failed");
            }
            or(stopped, async {
                sleep(pause).await;
                Next::Wait
            })
            .await
        }
    }
}

/// An accept loop's errors in a row (the MQTT listeners' and the admin
/// port's): the pause before the next accept and the errors not logged yet (see [`ERROR_PAUSE`], [`ERROR_LOG_EVERY`]).
#[derive(Debug, Default)]
pub(crate) struct AcceptErrors {
    /// The pause after the last error; zero when the last accept worked.
    pause: Duration,
    /// When the last line was logged.
    logged: Option<Instant>,
    /// Errors since that line.
    unlogged: u64,
}

impl AcceptErrors {
    /// An accept failed at `now`: how long to pause, and the count to log
    /// with it (this error included) when a line is due.
    pub(crate) fn failed(&mut self, now: Instant) -> (Duration, Option<u64>) {
        self.pause = (self.pause * 2).clamp(ERROR_PAUSE, ERROR_PAUSE_MAX);
        self.unlogged += 1;
        let due = self.logged.is_none_or(|at| now.duration_since(at) >= ERROR_LOG_EVERY);
        if !due {
            return (self.pause, None);
        }
        self.logged = Some(now);
        (self.pause, Some(std::mem::take(&mut self.unlogged)))
    }

    /// A connection was accepted: the pause starts over; returns the count
    /// of errors not logged yet, if any, to log now.
    pub(crate) fn accepted(&mut self) -> Option<u64> {
        self.pause = Duration::ZERO;
        (self.unlogged > 0).then(|| std::mem::take(&mut self.unlogged))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accept_errors_in_a_row_are_logged_once_a_second_and_pause_longer_each_time() {
        let mut errors = AcceptErrors::default();
        let t0 = Instant::now();
        assert_eq!(errors.failed(t0), (ERROR_PAUSE, Some(1)), "the first at once");
        let (mut slept, mut now, mut failures, mut lines) = (ERROR_PAUSE, t0, 1, vec![1]);
        // Five seconds of EMFILE: the loop sleeps what it is told between.
        while now < t0 + Duration::from_secs(5) {
            now += slept;
            failures += 1;
            let (pause, log) = errors.failed(now);
            assert!(pause >= slept && pause <= ERROR_PAUSE_MAX, "{pause:?} after {slept:?}");
            slept = pause;
            lines.extend(log);
        }
        assert_eq!(slept, ERROR_PAUSE_MAX, "the pause grows to its bound");
        assert!(lines.len() <= 6, "at most one line a second: {lines:?}");
        let left = errors.accepted();
        assert_eq!(lines.iter().sum::<u64>() + left.unwrap_or(0), failures, "every error counted once");
        assert_eq!(errors.failed(now + ERROR_LOG_EVERY), (ERROR_PAUSE, Some(1)), "the pause starts over");
        assert_eq!(errors.accepted(), None, "nothing left unlogged");
    }
}
