//! Closing a connection so that the client reads the broker's last packet
//! (DESIGN.md §7, "Closing").
//!
//! Closing a socket whose receive buffer still holds unread bytes makes
//! the kernel answer with a TCP reset, and so does every byte that arrives
//! after the close. A client that is still writing (acknowledgements, the
//! rest of a refused CONNECT) then fails on its next write, or loses what
//! the broker sent last (a DISCONNECT with its reason code, a refusing
//! CONNACK) before it reads it. So after its last packet the broker ends
//! its sending side (TLS close_notify, a WebSocket Close frame, then a TCP
//! FIN) and reads and drops what the client still sends, within a
//! [`Linger`]'s bounds and never past the shard's stop deadline, before it
//! closes.
//!
//! The reads go through one scratch buffer per shard thread, borrowed only
//! inside each poll, so a lingering connection holds no read buffer: a
//! flood of closing connections costs their descriptors for at most the
//! linger time and nothing more.

use std::cell::{Cell, RefCell};
use std::io;
use std::os::fd::AsRawFd;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use futures_lite::future::or;
use futures_lite::{AsyncRead, AsyncWriteExt};
use glommio::timer::sleep;

use crate::transport::Transport;

/// How long and how much a closing connection reads and drops before the
/// close: whichever bound comes first ends it, as does the end of the
/// client's stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Linger {
    /// At most this many bytes are read and dropped.
    pub(crate) bytes: usize,
    /// At most this long is spent in all.
    pub(crate) time: Duration,
    /// Reading stops after this long without data.
    pub(crate) idle: Duration,
}

/// Bytes read at most after a DISCONNECT: 64 KiB.
pub(crate) const LINGER_BYTES: usize = 64 << 10;

/// Time spent at most after a DISCONNECT: 1 s.
pub(crate) const LINGER_TIME: Duration = Duration::from_secs(1);

/// A refused CONNECT's rest is read up to this many bytes: 4 MiB.
const REFUSED_MAX_BYTES: usize = 4 << 20;

/// Reading the rest of a refused CONNECT stops after this long without
/// data: a client that announced more than it sends does not hold the
/// connection (and its `max_pending_connections` slot) any longer.
pub(crate) const REFUSED_IDLE: Duration = Duration::from_millis(200);

impl Linger {
    /// No reading: the client ended its stream first (EOF, a WebSocket
    /// Close frame, a failed write), so nothing more comes from it.
    pub(crate) const NONE: Linger = Linger {
        bytes: 0,
        time: Duration::ZERO,
        idle: Duration::ZERO,
    };

    /// After the broker's DISCONNECT (or when it drops a connection on its
    /// own): [`LINGER_BYTES`] or [`LINGER_TIME`], whichever comes first.
    pub(crate) const AFTER_DISCONNECT: Linger = Linger {
        bytes: LINGER_BYTES,
        time: LINGER_TIME,
        idle: LINGER_TIME,
    };

    /// After refusing a CONNECT (or a WebSocket upgrade) of which the
    /// client may still send `expected` bytes: those bytes, at least
    /// [`LINGER_BYTES`] and at most 4 MiB, for at most 2 s and until
    /// [`REFUSED_IDLE`] passes without data.
    pub(crate) fn refused(expected: usize) -> Linger {
        Linger {
            bytes: expected.clamp(LINGER_BYTES, REFUSED_MAX_BYTES),
            time: 2 * LINGER_TIME,
            idle: REFUSED_IDLE,
        }
    }
}

thread_local! {
    /// What lingering connections read is dropped here (see the module docs).
    static SCRATCH: RefCell<Box<[u8]>> = RefCell::new(vec![0; 16 << 10].into_boxed_slice());
    /// When this shard stops waiting for its connections to close (set
    /// when it starts stopping): no linger goes past it.
    static STOP_BY: Cell<Option<Instant>> = const { Cell::new(None) };
}

/// From now on no connection of this thread's shard lingers past `at`.
pub(crate) fn stop_by(at: Instant) {
    STOP_BY.set(Some(at));
}

/// `time` from now, or the shard's stop deadline if that comes first.
fn deadline(time: Duration) -> Instant {
    let at = Instant::now() + time;
    STOP_BY.get().map_or(at, |stop| stop.min(at))
}

/// End the broker's side of `transport` after its last packet, already
/// written: TLS close_notify, a WebSocket Close frame (the answer to the
/// client's, when it sent one first), a TCP FIN; then read and drop what
/// the client still sends, within `linger`. The caller drops the
/// transport after this, which closes the socket.
pub(crate) async fn close(transport: &mut Transport, linger: Linger) {
    let until = deadline(linger.time.max(CLOSE_WRITE));
    // Bounded: a client that reads nothing must not hold the close.
    or(
        async {
            let _ = transport.close().await;
        },
        sleep(until.saturating_duration_since(Instant::now())),
    )
    .await;
    if linger.bytes == 0 {
        return;
    }
    match transport {
        Transport::Tcp(s) => end_then_discard(s, linger).await,
        // glommio closes a socket stream by ending its sending side.
        Transport::Unix(s) => discard(s, linger).await,
        Transport::Tls(s) => end_then_discard(s.get_mut().0, linger).await,
        Transport::Ws(s) => end_then_discard(s.get_mut(), linger).await,
        Transport::Wss(s) => end_then_discard(s.get_mut().get_mut().0, linger).await,
    }
}

/// Time given to writing a transport's closing bytes (close_notify, a
/// Close frame) when the linger itself gives none.
const CLOSE_WRITE: Duration = Duration::from_millis(100);

/// Send a FIN on the raw socket under any TLS or WebSocket layer (their
/// own closing bytes went out before), then [`discard`] from it: what the
/// client sends now is not decrypted or unframed, only counted.
async fn end_then_discard<S: AsyncRead + AsRawFd + Unpin>(socket: &mut S, linger: Linger) {
    // SAFETY: shutdown(2) on a descriptor `socket` owns and keeps open.
    unsafe { libc::shutdown(socket.as_raw_fd(), libc::SHUT_WR) };
    discard(socket, linger).await;
}

/// Read and drop from `stream` until it ends or fails, `linger.bytes` were
/// read, `linger.time` (or the shard's stop deadline) passed, or
/// `linger.idle` passed without data.
pub(crate) async fn discard<S: AsyncRead + Unpin>(stream: &mut S, linger: Linger) {
    let until = deadline(linger.time);
    let mut read = 0;
    while read < linger.bytes {
        let wait = until
            .saturating_duration_since(Instant::now())
            .min(linger.idle);
        if wait.is_zero() {
            break;
        }
        let got = or(
            async { Some(std::future::poll_fn(|cx| poll_discard(cx, stream)).await) },
            async {
                sleep(wait).await;
                None
            },
        )
        .await;
        match got {
            Some(Ok(n)) if n > 0 => read += n,
            _ => break, // the end of the stream, an error, or idle
        }
    }
}

/// One read into the thread's scratch buffer.
fn poll_discard<S: AsyncRead + Unpin>(
    cx: &mut Context<'_>,
    stream: &mut S,
) -> Poll<io::Result<usize>> {
    SCRATCH.with(|scratch| Pin::new(stream).poll_read(cx, &mut scratch.borrow_mut()[..]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refused_linger_reads_what_was_announced_within_bounds() {
        assert_eq!(Linger::refused(0).bytes, LINGER_BYTES);
        assert_eq!(Linger::refused(1 << 20).bytes, 1 << 20);
        assert_eq!(Linger::refused(usize::MAX).bytes, REFUSED_MAX_BYTES);
        assert_eq!(Linger::refused(10).idle, REFUSED_IDLE);
    }

    #[test]
    fn no_linger_goes_past_the_stop_deadline() {
        let before = deadline(Duration::from_secs(5));
        assert!(before >= Instant::now() + Duration::from_secs(4));
        let stop = Instant::now() + Duration::from_millis(10);
        stop_by(stop);
        assert_eq!(deadline(Duration::from_secs(5)), stop);
    }
}
