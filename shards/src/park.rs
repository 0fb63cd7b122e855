//! Parked connections (DESIGN.md §3: an idle connection should cost about
//! 1 KiB).
//!
//! A connection served by a task holds that task's state and, while it
//! waits to read, glommio's io_uring poll for its socket: about 1 KiB
//! together. A plain TCP connection with no traffic either way for a
//! while (see [`crate::shard::Shard::expire`]) is *parked* instead: its
//! task ends, its socket waits in this shard's epoll set, and only a
//! [`Parked`] entry (socket, session slot, limit slots) stays. A thread per
//! shard blocks in `epoll_wait` and writes the tokens of sockets that
//! became readable to a local socket the shard reads; anything the shard
//! queues for a parked connection (a delivery, a close request) unparks it
//! too. An unparked connection gets a new task and carries on where it
//! stopped.
//!
//! Cost: a parked connection that wakes takes one `epoll_wait` wake-up on
//! the thread, a write and a read of 4 bytes on the local socket and an
//! `epoll_ctl` before its first packet is read. Busy connections are never
//! parked.

use std::cell::RefCell;
use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd, OwnedFd, RawFd};
use std::rc::Rc;

use futures_lite::AsyncReadExt;
use glommio::net::UnixStream;
use slab::Slab;
use tracing::warn;

use crate::connection::Admission;
use crate::shard::{ConnShared, Slot};
use crate::signal::Signal;

/// The token the epoll thread reserves for its stop request.
const STOP_TOKEN: u64 = u64::MAX;

/// A connection waiting in the epoll set: all that is left of it besides
/// its session and [`ConnShared`].
pub(crate) struct Parked {
    /// The client's TCP socket.
    pub(crate) fd: OwnedFd,
    pub(crate) conn: Rc<ConnShared>,
    pub(crate) slot: Slot,
    pub(crate) admission: Admission,
}

/// A shard's parked connections and its epoll set.
pub(crate) struct Parker {
    epoll: OwnedFd,
    /// Written to stop the epoll thread.
    stop: OwnedFd,
    parked: RefCell<Slab<Parked>>,
    /// Tokens of connections the shard itself woke (something to write).
    woken: RefCell<Vec<u32>>,
    signal: Signal,
    /// The local socket the epoll thread writes tokens to.
    events: RefCell<Option<UnixStream>>,
    /// The first bytes of a token the last read split.
    partial: std::cell::Cell<Partial>,
}

/// Append the whole little-endian `u32` tokens at the front of `bytes` to
/// `out`; return the bytes of a last, incomplete one.
fn split_tokens(bytes: &[u8], out: &mut Vec<u32>) -> Partial {
    let whole = bytes.len() - bytes.len() % 4;
    out.extend(bytes[..whole].chunks_exact(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])));
    Partial::from(&bytes[whole..])
}

/// Up to 3 bytes of a token split across two reads of the local socket.
#[derive(Clone, Copy, Default)]
struct Partial {
    bytes: [u8; 3],
    len: u8,
}

impl Partial {
    fn from(bytes: &[u8]) -> Partial {
        let mut partial = Partial { bytes: [0; 3], len: bytes.len() as u8 };
        partial.bytes[..bytes.len()].copy_from_slice(bytes);
        partial
    }

    fn len(&self) -> usize {
        usize::from(self.len)
    }
}

impl std::ops::Deref for Partial {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.bytes[..self.len()]
    }
}

thread_local! {
    /// This shard thread's parker, once the shard has started one.
    static PARKER: RefCell<Option<Rc<Parker>>> = const { RefCell::new(None) };
}

impl Parker {
    /// Create the epoll set and its thread for shard `id`, and make the
    /// parker this thread's.
    ///
    /// # Errors
    /// The system refused an epoll set, an eventfd, a socket pair or a
    /// thread.
    pub(crate) fn start(id: usize) -> std::io::Result<Rc<Parker>> {
        // SAFETY: plain syscalls; each returned descriptor is checked and
        // then owned by exactly one OwnedFd.
        let epoll = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if epoll < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let epoll = unsafe { OwnedFd::from_raw_fd(epoll) };
        let stop = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if stop < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let stop = unsafe { OwnedFd::from_raw_fd(stop) };
        epoll_ctl(
            epoll.as_raw_fd(),
            libc::EPOLL_CTL_ADD,
            stop.as_raw_fd(),
            libc::EPOLLIN as u32,
            STOP_TOKEN,
        )?;
        let (near, far) = std::os::unix::net::UnixStream::pair()?;
        let thread_epoll = epoll.try_clone()?;
        std::thread::Builder::new()
            .name(format!("fleetmq-park-{id}"))
            .spawn(move || wait_loop(thread_epoll, far))?;
        // SAFETY: into_raw_fd hands over a descriptor only we own.
        let near = unsafe { UnixStream::from_raw_fd(near.into_raw_fd()) };
        let parker = Rc::new(Parker {
            epoll,
            stop,
            parked: RefCell::new(Slab::new()),
            woken: RefCell::new(Vec::new()),
            signal: Signal::default(),
            events: RefCell::new(Some(near)),
            partial: std::cell::Cell::new(Partial::default()),
        });
        PARKER.with(|p| *p.borrow_mut() = Some(parker.clone()));
        Ok(parker)
    }

    /// Park `parked`: its socket joins the epoll set (one-shot, readable or
    /// closed). Gives `parked` back if the system refuses.
    pub(crate) fn park(&self, parked: Parked) -> Result<(), Parked> {
        let fd = parked.fd.as_raw_fd();
        let conn = parked.conn.clone();
        // The slab grows with the parked connections: its old blocks go
        // back to the system (see crate::alloc).
        let token = crate::alloc::giving_back(|| self.parked.borrow_mut().insert(parked));
        conn.parked.set(Some(token as u32));
        let events = (libc::EPOLLIN | libc::EPOLLRDHUP | libc::EPOLLONESHOT) as u32;
        if let Err(e) = epoll_ctl(
            self.epoll.as_raw_fd(),
            libc::EPOLL_CTL_ADD,
            fd,
            events,
            token as u64,
        ) {
            warn!(target: "broker", error = %e, "cannot park a connection");
            conn.parked.set(None);
            return Err(self.parked.borrow_mut().remove(token));
        }
        Ok(())
    }

    /// Wait for parked connections to wake and return them, out of the
    /// epoll set. Empty once the shard stops the parker.
    pub(crate) async fn next_woken(&self) -> Vec<Parked> {
        let mut tokens = [0u8; 4 * 256];
        loop {
            let woken: Vec<u32> = std::mem::take(&mut *self.woken.borrow_mut());
            let mut all = woken;
            if all.is_empty() {
                let mut events = self.events.borrow_mut().take();
                let Some(stream) = events.as_mut() else {
                    return Vec::new();
                };
                // Bytes of a token split by the stream wait at the front.
                let kept = self.partial.take();
                tokens[..kept.len()].copy_from_slice(&kept);
                let read = futures_lite::future::or(
                    async { Some(stream.read(&mut tokens[kept.len()..]).await) },
                    async {
                        self.signal.wait().await;
                        None
                    },
                )
                .await;
                match read {
                    Some(Ok(n)) if n > 0 => {
                        // A stream may split a token: keep its first bytes
                        // for the next read.
                        self.partial.set(split_tokens(&tokens[..kept.len() + n], &mut all));
                    }
                    Some(_) => return Vec::new(),
                    None => self.partial.set(kept),
                }
                *self.events.borrow_mut() = events;
                all.extend(std::mem::take(&mut *self.woken.borrow_mut()));
            }
            let mut out = Vec::new();
            let mut parked = self.parked.borrow_mut();
            for token in all {
                // A token may be stale (woken twice, or its slot reused):
                // waking a connection that has nothing to do is harmless.
                let Some(entry) = parked.try_remove(token as usize) else {
                    continue;
                };
                let _ = epoll_ctl(
                    self.epoll.as_raw_fd(),
                    libc::EPOLL_CTL_DEL,
                    entry.fd.as_raw_fd(),
                    0,
                    0,
                );
                entry.conn.parked.set(None);
                out.push(entry);
            }
            if !out.is_empty() {
                return out;
            }
        }
    }

    /// Stop the epoll thread and wake every parked connection (shutdown).
    pub(crate) fn stop(&self) -> Vec<Parked> {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a valid u64 to our eventfd.
        unsafe { libc::write(self.stop.as_raw_fd(), (&one as *const u64).cast(), 8) };
        let mut parked = self.parked.borrow_mut();
        let all: Vec<Parked> = parked.drain().collect();
        for entry in &all {
            entry.conn.parked.set(None);
        }
        self.events.borrow_mut().take();
        self.signal.notify();
        all
    }
}

/// Park a connection with this thread's shard's parker; gives it back
/// when the shard has none or the system refuses.
pub(crate) fn park(parked: Parked) -> Result<(), Parked> {
    PARKER.with(|p| match &*p.borrow() {
        Some(parker) => parker.park(parked),
        None => Err(parked),
    })
}

/// Wake the parked connection `token` of this thread's shard: the shard
/// has something for it.
pub(crate) fn wake(token: u32) {
    PARKER.with(|p| {
        if let Some(parker) = &*p.borrow() {
            parker.woken.borrow_mut().push(token);
            parker.signal.notify();
        }
    });
}

fn epoll_ctl(
    epoll: RawFd,
    op: libc::c_int,
    fd: RawFd,
    events: u32,
    token: u64,
) -> std::io::Result<()> {
    let mut event = libc::epoll_event { events, u64: token };
    // SAFETY: `event` outlives the call; the kernel checks the descriptors.
    if unsafe { libc::epoll_ctl(epoll, op, fd, &mut event) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// The epoll thread: report readable sockets' tokens to the shard until
/// the shard stops it or goes away.
fn wait_loop(epoll: OwnedFd, mut to_shard: std::os::unix::net::UnixStream) {
    let mut events = vec![libc::epoll_event { events: 0, u64: 0 }; 256];
    let mut tokens = Vec::with_capacity(4 * events.len());
    loop {
        // SAFETY: `events` has room for `len` entries.
        let n = unsafe {
            libc::epoll_wait(
                epoll.as_raw_fd(),
                events.as_mut_ptr(),
                events.len() as libc::c_int,
                -1,
            )
        };
        if n < 0 {
            if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return;
        }
        tokens.clear();
        for event in &events[..n as usize] {
            let token = event.u64;
            if token == STOP_TOKEN {
                return;
            }
            tokens.extend_from_slice(&(token as u32).to_le_bytes());
        }
        if to_shard.write_all(&tokens).is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// However the stream splits the bytes, every token comes out once,
        /// in order.
        #[test]
        fn tokens_survive_any_split(tokens in proptest::collection::vec(any::<u32>(), 0..200), cuts in proptest::collection::vec(1usize..40, 1..50)) {
            let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
            let mut out = Vec::new();
            let mut kept = Partial::default();
            let mut at = 0;
            let mut cut = cuts.iter().cycle();
            while at < bytes.len() {
                let end = (at + cut.next().copied().unwrap_or(1)).min(bytes.len());
                let mut buf = kept.to_vec();
                buf.extend_from_slice(&bytes[at..end]);
                kept = split_tokens(&buf, &mut out);
                at = end;
            }
            prop_assert_eq!(kept.len(), 0);
            prop_assert_eq!(out, tokens);
        }
    }
}
