//! The connections of one shard between accept and a complete CONNECT,
//! and which of them gives way when a new connection would exceed
//! `limits.max_pending_connections` (DESIGN.md §9; issue 28).
//!
//! The limit bounds what a flood of connections can hold (descriptors,
//! task state, handshake buffers). Refusing the newcomer when it is
//! reached let an attacker with a few thousand silent sockets, reopened
//! every `connect_timeout`, keep every device out. Instead the connection
//! that has made the least progress makes room: first those that have
//! sent no byte, oldest first; then, among those that have stalled (see
//! [`Progress::stalled`]), the furthest from a complete CONNECT. The
//! newcomer is refused only when every pending connection is progressing
//! (or has its CONNECT already). Each connection that gives way is closed
//! without an answer (it sent no complete CONNECT) and counted as
//! `fleetmq_connect_refused_total{reason="pending_evicted"}`.
//!
//! # A shard behind its connections
//!
//! In a reconnect storm the shard accepts connections faster than their
//! tasks read them: a connection that looks silent may have its CONNECT
//! waiting unread in its socket. So a connection is taken for silent only
//! after its socket is asked (`FIONREAD`, at eviction time only); one whose
//! bytes wait unread is never evicted until its task has read them (the
//! delay is the shard's, not the client's). When the limit is reached and
//! no connection can give way while some wait unread, the newcomer is not
//! refused: the accept loop holds it and accepts no more, leaving the rest
//! of the storm in the kernel's listen queue, until a pending connection
//! leaves ([`Admission::Behind`], `crate::acceptor`; issue 27). The count
//! of connections waiting unread is process-wide ([`Gate`]): a storm lands
//! on every shard, and a shard that has caught up while another is behind
//! holds its newcomer too, instead of refusing it. A shard sees only its
//! own connections, and those of a shard behind are marked unread only
//! when that shard looks for a victim: so a shard that holds less than
//! half its share of the limit (limit / shards / 2) holds its newcomer
//! too, the rest of the limit being held elsewhere. A silent flood still
//! gives way at once (its sockets have nothing waiting), and a flood of
//! progressing connections, which the kernel spreads evenly over the
//! shards, is still refused.
//!
//! # A storm whose CONNECTs come late
//!
//! A load generator (or a busy gateway) may open thousands of sockets
//! before it writes their CONNECTs. Those look silent when the limit is
//! reached, and evicting them turned most of a storm away (7,700 of
//! 10,000 at 100,000 connections/s, perf/RESULTS.md). So the kernel keeps
//! a connection that has sent nothing out of the accept queue for
//! [`DEFER_ACCEPT`](crate::deferred::DEFER_ACCEPT) (`TCP_DEFER_ACCEPT`): a connection comes in with its
//! first bytes, or silent but already a second old. When the kernel
//! cannot hold a connection (more are waiting to be answered than the
//! listen backlog: it answers with SYN cookies, which skip the option) it
//! comes in at once; such a silent connection gives way only once it is
//! [`YOUNG`] no more, and until then the newcomer is held as when the
//! shard is behind. A silent connection's `connect_timeout` counts from
//! when it was opened, a second before it was accepted when the kernel
//! held it ([`PendingGuard::connect_deadline`]), so a silent flood's
//! sockets are closed when they were before.
//!
//! # Across shards
//!
//! The limit is per process; each shard keeps its own set (its listener's
//! connections, on its own thread). The count stays the one process-wide
//! atomic of [`Gate::pending`]: a connection is admitted at once while the
//! count is under the limit, whichever shard holds the others, so a
//! legitimate reconnect storm that lands unevenly is not refused early.
//! Only when the count is at the limit does the accepting shard choose a
//! victim, and only among its own connections: it hands the victim's slot
//! to the newcomer, so the count never passes the limit, and no shard
//! reads or locks another's set. The kernel spreads connections over the
//! shards' `SO_REUSEPORT` sockets by a hash of their addresses, so a flood
//! fills every shard's set in proportion and each shard finds its own
//! victims. A per-shard share of the limit (limit / shards each) was the
//! alternative: equally lock-free, but it refuses on one shard while the
//! process has room, and rounds a small limit down to nothing on some
//! shards. The cost of this choice: a newcomer on a shard whose own
//! pending connections are all progressing is refused even if another
//! shard holds a silent one; with the kernel's spread that takes a flood
//! of progressing connections, which the limit is there to refuse.

use std::cell::{Cell, RefCell};
use std::cmp::Reverse;
use std::collections::VecDeque;
use std::future::poll_fn;
use std::os::fd::RawFd;
use std::rc::{Rc, Weak};
use std::sync::Arc;
use std::task::{Poll, Waker};
use std::time::{Duration, Instant};

use fleetmq_core::packet::codec::packet_size;

use crate::deferred::{held_by_kernel, kernel_wait, KERNEL_WAIT_MAX};
use crate::limits::{Gate, Slot};
use crate::signal::Signal;

/// How long a pending connection may go without reaching its next step
/// (its first byte, the end of a handshake, its next CONNECT byte) before
/// it counts as stalled: a TLS or WebSocket handshake and a CONNECT are
/// each one flight from the client, a round trip at most.
pub(crate) const STALL: Duration = Duration::from_secs(1);

/// A silent connection accepted less than this long ago, which the kernel
/// did not hold for [`DEFER_ACCEPT`](crate::deferred::DEFER_ACCEPT), is not evicted (see
/// [`PendingSet::victim`]).
pub(crate) const YOUNG: Duration = STALL;

/// How long into reading its CONNECT a connection is not judged by the
/// pace of its bytes: a CONNECT comes in one flight, and a pace needs
/// more than one reading.
pub(crate) const GRACE: Duration = Duration::from_millis(200);

/// The smallest CONNECT, in bytes (MQTT 3.1.1 with an empty client
/// identifier: fixed header 2, protocol name 6, level, flags, keep alive
/// 2, client identifier length 2): what a CONNECT whose fixed header has
/// not come yet is judged against.
const MIN_CONNECT_BYTES: usize = 14;

/// How far a pending connection has come.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Stage {
    /// Nothing received yet.
    Silent,
    /// Bytes of a TLS or WebSocket handshake received; not complete.
    Handshake,
    /// Reading the CONNECT (the transport is open).
    Connect,
    /// The CONNECT is complete: signing in, or being answered. Never
    /// evicted.
    Complete,
}

/// A pending connection's progress, as its task last saw it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Progress {
    pub(crate) stage: Stage,
    /// When the stage began.
    pub(crate) since: Instant,
    /// When the last byte came.
    pub(crate) last: Instant,
    /// In [`Stage::Connect`]: bytes of the CONNECT received.
    pub(crate) read: usize,
    /// In [`Stage::Connect`]: the CONNECT's whole size, once its fixed
    /// header is in.
    pub(crate) size: Option<usize>,
}

/// Where a connection stands in the eviction order: the lowest gives way
/// first (no byte, then a handshake, then a CONNECT; the most bytes
/// missing; the oldest).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Rank {
    stage: Stage,
    missing: Reverse<usize>,
    since: Instant,
}

impl Progress {
    fn new(at: Instant) -> Progress {
        Progress {
            stage: Stage::Silent,
            since: at,
            last: at,
            read: 0,
            size: None,
        }
    }

    /// Whether the connection, accepted at `accepted`, is not on its way
    /// to a CONNECT within `connect_timeout` at `now`: it sent nothing
    /// yet; or it has been in its handshake for [`STALL`] (a handshake's
    /// pace cannot be seen from here); or it has read no byte of its
    /// CONNECT, or none new, for [`STALL`]; or, past [`GRACE`], its CONNECT
    /// comes so slowly that at the pace of its bytes so far the rest (at
    /// least [`MIN_CONNECT_BYTES`] in all, until the fixed header says)
    /// would arrive after the timeout: a CONNECT sent a byte a second.
    pub(crate) fn stalled(
        &self,
        accepted: Instant,
        now: Instant,
        connect_timeout: Duration,
    ) -> bool {
        let in_stage = now.saturating_duration_since(self.since);
        let quiet = now.saturating_duration_since(self.last);
        match self.stage {
            Stage::Silent => true,
            Stage::Complete => false,
            Stage::Handshake => in_stage >= STALL,
            Stage::Connect if in_stage < GRACE => false,
            Stage::Connect if self.read == 0 || quiet >= STALL => quiet >= STALL,
            Stage::Connect => {
                let size = self.size.unwrap_or(MIN_CONNECT_BYTES).max(self.read);
                let rate = self.read as f64 / in_stage.as_secs_f64();
                let finish = self.since + Duration::from_secs_f64(size as f64 / rate);
                finish > accepted + connect_timeout
            }
        }
    }

    fn rank(&self, accepted: Instant) -> Rank {
        let missing = match (self.stage, self.size) {
            (Stage::Connect, Some(size)) => size.saturating_sub(self.read),
            _ => usize::MAX,
        };
        let since = if self.stage == Stage::Silent {
            accepted
        } else {
            self.since
        };
        Rank {
            stage: self.stage,
            missing: Reverse(missing),
            since,
        }
    }
}

/// One pending connection, shared by its task and its shard's set.
struct Pending {
    accepted: Instant,
    progress: Cell<Progress>,
    /// Its place in [`PendingSet::entries`]; `usize::MAX` once out.
    index: Cell<usize>,
    /// Its process-wide pending slot; taken by the connection it makes
    /// room for when evicted.
    slot: Cell<Option<Slot>>,
    /// Fires when the connection is evicted.
    evicted: Signal,
    /// Bytes were found waiting in its socket at an eviction, and its task
    /// has not read since: never evicted while so.
    unread: Cell<bool>,
    /// Its socket, to see whether bytes wait unread before it is taken
    /// for silent (see [`PendingSet::victim`]); `None` in unit tests.
    fd: Option<RawFd>,
}

impl Pending {
    fn in_set(&self) -> bool {
        self.index.get() != usize::MAX
    }
}

/// What [`PendingSet::admit`] decided for a newcomer.
pub(crate) enum Admission {
    /// Admitted, with a free slot or that of a connection that gave way.
    In(PendingGuard),
    /// At the limit, no connection can give way, and some wait unread, on
    /// this shard or another: a shard is behind. Hold the newcomer, accept
    /// no more, and ask again when [`PendingSet::room`] resolves (or after
    /// a short time, for room made on another shard).
    Behind,
    /// At the limit and every pending connection is progressing: refuse
    /// the newcomer (`max_pending_connections`).
    Refused,
}

/// Why no pending connection can give way.
enum NoVictim {
    /// Some connection's bytes wait unread, on this shard or another.
    Behind,
    /// Every one is progressing.
    Progressing,
}

/// A shard's pending connections (see the module docs). Bounded by
/// `max_pending_connections`: one entry per connection holding a pending
/// slot, and a queue of the silent ones kept within twice that.
pub(crate) struct PendingSet {
    connect_timeout: Duration,
    /// The process's shards, each with its set.
    shards: usize,
    entries: RefCell<Vec<Rc<Pending>>>,
    /// Connections in accept order, to find the oldest silent one without
    /// a scan; entries that spoke, ended or were evicted are skipped (and
    /// dropped when the queue outgrows the set).
    silent: RefCell<VecDeque<Weak<Pending>>>,
    /// Counts connections that left the set (not evicted), for
    /// [`PendingSet::room`].
    left: Cell<u64>,
    /// Tasks waiting in [`PendingSet::room`] (the shard's accept loops,
    /// one per listener at most).
    waiting_for_room: RefCell<Vec<Waker>>,
}

impl PendingSet {
    /// An empty set for connections with `connect_timeout` to send their
    /// CONNECT, on one of `shards` shards.
    pub(crate) fn new(connect_timeout: Duration, shards: usize) -> PendingSet {
        PendingSet {
            connect_timeout,
            shards: shards.max(1),
            entries: RefCell::new(Vec::new()),
            silent: RefCell::new(VecDeque::new()),
            left: Cell::new(0),
            waiting_for_room: RefCell::new(Vec::new()),
        }
    }

    /// Admit a connection accepted `now`, whose socket is `fd`: with a
    /// free pending slot, or with the slot of the pending connection of
    /// this shard that gave way (it is evicted: its task sees
    /// [`PendingGuard::evicted`]). At the limit with none to give way,
    /// [`Admission::Behind`] or [`Admission::Refused`] (see the module
    /// docs).
    pub(crate) fn admit(
        self: &Rc<Self>,
        gate: &Arc<Gate>,
        now: Instant,
        fd: Option<RawFd>,
    ) -> Admission {
        let slot = match gate.pending() {
            Some(slot) => slot,
            None => match self.evict(now, gate) {
                Ok(slot) => slot,
                Err(NoVictim::Behind) => return Admission::Behind,
                Err(NoVictim::Progressing) => return Admission::Refused,
            },
        };
        let entry = Rc::new(Pending {
            accepted: now,
            progress: Cell::new(Progress::new(now)),
            index: Cell::new(usize::MAX),
            slot: Cell::new(Some(slot)),
            evicted: Signal::default(),
            unread: Cell::new(false),
            fd,
        });
        let mut entries = self.entries.borrow_mut();
        entry.index.set(entries.len());
        entries.push(entry.clone());
        let mut silent = self.silent.borrow_mut();
        silent.push_back(Rc::downgrade(&entry));
        if silent.len() > 2 * entries.len() + 64 {
            silent.retain(|w| w.upgrade().is_some_and(|p| is_silent(&p)));
        }
        Admission::In(PendingGuard {
            set: self.clone(),
            gate: gate.clone(),
            entry,
        })
    }

    /// Take in a connection another shard admitted, read the whole
    /// CONNECT of and handed here (`crate::arrival`), with the pending
    /// `slot` it held there: its CONNECT is complete, so it is never
    /// evicted, and it holds the slot until it is signed in as those
    /// accepted here do. `now`: when it arrived.
    pub(crate) fn adopt(self: &Rc<Self>, gate: &Arc<Gate>, slot: Option<Slot>, now: Instant) -> PendingGuard {
        let mut progress = Progress::new(now);
        progress.stage = Stage::Complete;
        let entry = Rc::new(Pending {
            accepted: now,
            progress: Cell::new(progress),
            index: Cell::new(usize::MAX),
            slot: Cell::new(slot),
            evicted: Signal::default(),
            unread: Cell::new(false),
            fd: None,
        });
        let mut entries = self.entries.borrow_mut();
        entry.index.set(entries.len());
        entries.push(entry.clone());
        PendingGuard {
            set: self.clone(),
            gate: gate.clone(),
            entry,
        }
    }

    /// Resolves once a pending connection of this shard has left the set
    /// since the call (its CONNECT complete, or its task ended): room for
    /// a newcomer held at [`Admission::Behind`]. Room made on another
    /// shard is not seen here; the caller also waits a short time.
    ///
    /// # Cancel safety
    /// Cancel safe.
    pub(crate) async fn room(&self) {
        let from = self.left.get();
        poll_fn(|cx| {
            if self.left.get() != from {
                return Poll::Ready(());
            }
            let mut waiting = self.waiting_for_room.borrow_mut();
            if !waiting.iter().any(|w| w.will_wake(cx.waker())) {
                waiting.push(cx.waker().clone());
            }
            Poll::Pending
        })
        .await
    }

    /// A connection left: wake the tasks waiting for room.
    fn made_room(&self) {
        self.left.set(self.left.get().wrapping_add(1));
        if !self.waiting_for_room.borrow().is_empty() {
            let waiting = std::mem::take(&mut *self.waiting_for_room.borrow_mut());
            waiting.into_iter().for_each(Waker::wake);
        }
    }

    /// Pending connections on this shard.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.entries.borrow().len()
    }

    /// Evict the connection that gives way at `now` (see the module docs)
    /// and return its slot.
    fn evict(&self, now: Instant, gate: &Gate) -> Result<Slot, NoVictim> {
        let victim = self.victim(now, gate)?;
        self.remove(&victim);
        victim.evicted.notify();
        victim.slot.take().ok_or(NoVictim::Progressing)
    }

    /// The oldest silent connection, else the lowest ranked of those
    /// stalled; `None` when every one is progressing.
    ///
    /// A connection whose task has not read yet looks silent although its
    /// bytes may be waiting in the socket: in a reconnect storm, with the
    /// shard behind, those are the oldest, the next to be served. So a
    /// silent one is first asked (`FIONREAD`, one system call) and, with
    /// bytes waiting, marked `unread` instead of evicted: it is not judged
    /// until its task has read (see the module docs).
    ///
    /// A silent connection accepted less than [`YOUNG`] ago gives way only
    /// if the kernel held it first ([`held_by_kernel`]): the others are a
    /// storm's sockets whose CONNECTs are on their way, which the kernel
    /// could not hold (its queue of connections not yet answered was full,
    /// so it answered with SYN cookies, which skip `TCP_DEFER_ACCEPT`).
    /// While one is young the newcomer waits ([`NoVictim::Behind`]).
    ///
    /// With none to give way: [`NoVictim::Behind`] while a pending
    /// connection of any shard waits unread (`gate`'s count: room comes
    /// as those shards catch up), or while this shard holds less than half
    /// its share of the limit (see the module docs); else
    /// [`NoVictim::Progressing`].
    fn victim(&self, now: Instant, gate: &Gate) -> Result<Rc<Pending>, NoVictim> {
        let mut silent = self.silent.borrow_mut();
        let mut young = false;
        while let Some(weak) = silent.pop_front() {
            let Some(p) = weak.upgrade().filter(|p| is_silent(p)) else { continue };
            if p.fd.map_or(0, bytes_waiting) > 0 {
                p.unread.set(true);
                gate.unread_changed(true);
                continue;
            }
            if now.saturating_duration_since(p.accepted) < YOUNG && !p.fd.is_some_and(held_by_kernel) {
                // Those behind it came after it: young too, or held by
                // the kernel, and then found at the next look.
                silent.push_front(weak);
                young = true;
                break;
            }
            return Ok(p);
        }
        drop(silent);
        let entries = self.entries.borrow();
        let stalled = entries
            .iter()
            .filter(|p| {
                !p.unread.get()
                    && p.progress.get().stage != Stage::Silent
                    && p.progress
                        .get()
                        .stalled(p.accepted, now, self.connect_timeout)
            })
            .min_by_key(|p| p.progress.get().rank(p.accepted));
        match stalled {
            Some(p) => Ok(p.clone()),
            None if young || gate.unread_pending() > 0 => Err(NoVictim::Behind),
            None if entries.len() < gate.max_pending() / (2 * self.shards) => Err(NoVictim::Behind),
            None => Err(NoVictim::Progressing),
        }
    }

    fn remove(&self, entry: &Pending) {
        let index = entry.index.replace(usize::MAX);
        if index == usize::MAX {
            return;
        }
        let mut entries = self.entries.borrow_mut();
        entries.swap_remove(index);
        if let Some(moved) = entries.get(index) {
            moved.index.set(index);
        }
    }
}

/// Bytes the kernel holds unread for the socket `fd` (0 when it cannot
/// tell).
fn bytes_waiting(fd: RawFd) -> usize {
    let mut n: libc::c_int = 0;
    // SAFETY: FIONREAD writes one c_int; `fd` is the pending connection's
    // open socket (its task holds the stream while it is in the set).
    let ok = unsafe { libc::ioctl(fd, libc::FIONREAD, &mut n) } == 0;
    if ok {
        usize::try_from(n).unwrap_or(0)
    } else {
        0
    }
}

fn is_silent(p: &Pending) -> bool {
    p.in_set() && p.progress.get().stage == Stage::Silent && !p.unread.get()
}

/// A connection's place in its shard's [`PendingSet`]: its task reports
/// its progress here. Dropping it takes the connection out and gives its
/// pending slot back (unless it was evicted and the slot passed on).
pub(crate) struct PendingGuard {
    set: Rc<PendingSet>,
    /// Counts the connections waiting unread, process-wide.
    gate: Arc<Gate>,
    entry: Rc<Pending>,
}

impl PendingGuard {
    /// Its TLS or WebSocket handshake has begun (a first byte came).
    pub(crate) fn handshaking(&self, now: Instant) {
        self.advance(Stage::Handshake, now);
    }

    /// What arrived of its CONNECT so far is `buf` (empty right after a
    /// handshake).
    pub(crate) fn connect_read(&self, buf: &[u8], now: Instant) {
        self.advance(Stage::Connect, now);
        let mut progress = self.entry.progress.get();
        if buf.len() > progress.read {
            progress.last = now;
        }
        progress.read = buf.len();
        progress.size = packet_size(buf);
        self.entry.progress.set(progress);
    }

    /// Its CONNECT is complete: it is no longer evicted.
    pub(crate) fn complete(&self, now: Instant) {
        self.advance(Stage::Complete, now);
    }

    fn advance(&self, stage: Stage, now: Instant) {
        // Its task reads: judged by its progress from here on.
        self.read_at_last();
        let mut progress = self.entry.progress.get();
        if progress.stage < stage {
            progress.stage = stage;
            progress.since = now;
            progress.last = now;
            self.entry.progress.set(progress);
        }
    }

    /// The connection leaves this shard's set for another shard's
    /// (`crate::arrival`, [`PendingSet::adopt`]): its process-wide pending
    /// slot, which goes with it (`None` if it was evicted).
    pub(crate) fn hand_over(self) -> Option<Slot> {
        // Drop takes it out of the set and makes room; the slot is taken first.
        self.entry.slot.take()
    }

    /// Resolves when the connection's time for a complete CONNECT is up:
    /// `connect_timeout` after it was opened, which for one the kernel held
    /// ([`kernel_wait`]) was that long before it was accepted. The kernel
    /// is asked once, [`KERNEL_WAIT_MAX`] before the timeout (at accept
    /// when the timeout is shorter), so a connection that sends its CONNECT
    /// in time costs no system call.
    ///
    /// # Cancel safety
    /// Cancel safe.
    pub(crate) async fn connect_deadline(&self, connect_timeout: Duration) {
        let first = connect_timeout.saturating_sub(KERNEL_WAIT_MAX);
        glommio::timer::sleep(first).await;
        let waited = self.entry.fd.map_or(Duration::ZERO, kernel_wait);
        let rest = (connect_timeout - first).saturating_sub(waited);
        if !rest.is_zero() {
            glommio::timer::sleep(rest).await;
        }
    }

    /// Whether the connection was evicted to make room for another.
    pub(crate) fn was_evicted(&self) -> bool {
        !self.entry.in_set()
    }

    /// Resolves when the connection was evicted to make room for another.
    ///
    /// # Cancel safety
    /// Cancel safe.
    pub(crate) async fn evicted(&self) {
        self.entry.evicted.wait().await;
    }
}

impl PendingGuard {
    /// Its task has read what waited unread, if anything did.
    fn read_at_last(&self) {
        if self.entry.unread.replace(false) {
            self.gate.unread_changed(false);
        }
    }
}

impl Drop for PendingGuard {
    fn drop(&mut self) {
        self.read_at_last();
        if self.entry.in_set() {
            self.set.remove(&self.entry);
            self.set.made_room();
        }
        // Drops the slot, if it is still this connection's.
        drop(self.entry.slot.take());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::deferred::{set_defer_accept, DEFER_ACCEPT};
    use std::future::Future;

    impl Admission {
        fn guard(self) -> Option<PendingGuard> {
            match self {
                Admission::In(guard) => Some(guard),
                Admission::Behind | Admission::Refused => None,
            }
        }
    }

    const TIMEOUT: Duration = Duration::from_secs(5);

    fn set() -> Rc<PendingSet> {
        Rc::new(PendingSet::new(TIMEOUT, 1))
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn evicted_now(guard: &PendingGuard) -> bool {
        !guard.entry.in_set() && guard.entry.slot.take().is_none()
    }

    #[test]
    fn the_oldest_silent_connection_makes_room_and_its_slot_passes_on() {
        let gate = Gate::new(3, 1, None, 1);
        let set = set();
        let t0 = Instant::now();
        let a = set.admit(&gate, t0, None).guard().unwrap();
        let b = set.admit(&gate, t0 + ms(1), None).guard().unwrap();
        let c = set.admit(&gate, t0 + ms(2), None).guard().unwrap();
        b.connect_read(&[0x10], t0 + ms(3));
        let later = t0 + YOUNG + ms(2);
        let d = set.admit(&gate, later, None).guard()
            .expect("a silent one gives way");
        assert!(evicted_now(&a), "the oldest silent one");
        let e = set.admit(&gate, later, None).guard().expect("c is silent too");
        assert!(evicted_now(&c));
        assert_eq!(set.len(), 3);
        drop((b, d, e));
        assert_eq!(set.len(), 0);
        let _three: Vec<_> = (0..3).map(|_| set.admit(&gate, t0, None).guard().unwrap()).collect();
    }

    #[test]
    fn a_young_silent_connection_holds_the_newcomer_until_it_is_old() {
        let gate = Gate::new(2, 1, None, 1);
        let set = set();
        let t0 = Instant::now();
        let a = set.admit(&gate, t0, None).guard().unwrap();
        let b = set.admit(&gate, t0 + ms(500), None).guard().unwrap();
        // A storm's sockets whose CONNECTs are on their way: neither goes.
        assert!(matches!(set.admit(&gate, t0 + ms(900), None), Admission::Behind));
        assert!(a.entry.in_set() && b.entry.in_set());
        let c = set.admit(&gate, t0 + YOUNG, None).guard().expect("a is old now");
        assert!(evicted_now(&a) && b.entry.in_set());
        assert!(matches!(set.admit(&gate, t0 + YOUNG, None), Admission::Behind), "b is young");
        drop(c);
    }

    #[test]
    fn a_silent_connection_the_kernel_held_gives_way_at_once() {
        use std::os::fd::AsRawFd;
        // What `server::bind_reuseport` sets on every MQTT listener.
        let listener = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        set_defer_accept(&listener).unwrap();
        listener.bind(&"127.0.0.1:0".parse::<std::net::SocketAddr>().unwrap().into()).unwrap();
        listener.listen(8).unwrap();
        let addr = listener.local_addr().unwrap().as_socket().unwrap();
        let opened = Instant::now();
        let _client = std::net::TcpStream::connect(addr).unwrap();
        let (served, _) = listener.accept().unwrap();
        let waited = opened.elapsed();
        assert!(waited >= DEFER_ACCEPT, "the kernel handed a silent connection over after {waited:?}");
        assert!(held_by_kernel(served.as_raw_fd()));
        let held = kernel_wait(served.as_raw_fd());
        assert!(held >= DEFER_ACCEPT && held <= waited, "held {held:?}, waited {waited:?}");
        let (_peer, fresh) = std::os::unix::net::UnixStream::pair().unwrap();
        assert!(!held_by_kernel(fresh.as_raw_fd()), "not a TCP socket: cannot tell");

        let gate = Gate::new(1, 1, None, 1);
        let set = set();
        let t0 = Instant::now();
        let held = set.admit(&gate, t0, Some(served.as_raw_fd())).guard().unwrap();
        let _new = set.admit(&gate, t0 + ms(1), None).guard()
            .expect("accepted a moment ago, but silent for a second already");
        assert!(!held.entry.in_set());
    }

    #[test]
    fn a_connection_whose_bytes_wait_unread_is_not_taken_for_silent() {
        use std::io::Write;
        use std::os::fd::AsRawFd;
        let gate = Gate::new(2, 1, None, 1);
        let set = set();
        let t0 = Instant::now();
        let (mut client, served) = std::os::unix::net::UnixStream::pair().unwrap();
        let (_quiet, unread) = std::os::unix::net::UnixStream::pair().unwrap();
        client.write_all(&[0x10, 12]).unwrap();
        let waiting = set.admit(&gate, t0, Some(served.as_raw_fd())).guard().unwrap();
        let silent = set.admit(&gate, t0 + ms(1), Some(unread.as_raw_fd())).guard().unwrap();
        let later = t0 + YOUNG + ms(1);
        let new = set.admit(&gate, later, None).guard().expect("the silent one gives way");
        new.complete(later);
        assert!(waiting.entry.in_set(), "its CONNECT waits to be read: the older, kept");
        assert!(!silent.entry.in_set());
        assert!(waiting.entry.unread.get());
        // Long after: still not taken for stalled while its bytes wait.
        assert!(matches!(
            set.admit(&gate, t0 + Duration::from_secs(3), None),
            Admission::Behind
        ));
        assert!(waiting.entry.in_set());
        waiting.connect_read(&[0x10, 12], t0 + Duration::from_secs(3));
        assert!(!waiting.entry.unread.get(), "judged again once its task reads");
    }

    #[test]
    fn when_every_pending_connection_waits_unread_the_newcomer_is_held_until_one_leaves() {
        use std::io::Write;
        use std::os::fd::AsRawFd;
        let gate = Gate::new(2, 1, None, 1);
        let set = set();
        let t0 = Instant::now();
        let pairs: Vec<_> = (0..2)
            .map(|_| std::os::unix::net::UnixStream::pair().unwrap())
            .collect();
        let guards: Vec<_> = pairs
            .iter()
            .map(|(client, served)| {
                let mut client = client;
                client.write_all(&[0x10, 12]).unwrap();
                set.admit(&gate, t0, Some(served.as_raw_fd())).guard().unwrap()
            })
            .collect();
        assert!(matches!(set.admit(&gate, t0 + ms(1), None), Admission::Behind));
        assert!(guards.iter().all(|g| g.entry.in_set()), "none evicted");
        let mut room = Box::pin(set.room());
        let waker = std::task::Waker::noop();
        let mut cx = std::task::Context::from_waker(waker);
        assert!(room.as_mut().poll(&mut cx).is_pending());
        guards[0].complete(t0 + ms(2));
        assert!(matches!(set.admit(&gate, t0 + ms(2), None), Admission::Behind));
        drop(guards);
        assert!(room.as_mut().poll(&mut cx).is_ready(), "a connection left");
        assert!(set.admit(&gate, t0 + ms(3), None).guard().is_some());
    }

    #[test]
    fn progressing_connections_are_kept_and_the_newcomer_refused() {
        let gate = Gate::new(2, 1, None, 1);
        let set = set();
        let t0 = Instant::now();
        let a = set.admit(&gate, t0, None).guard().unwrap();
        let b = set.admit(&gate, t0, None).guard().unwrap();
        a.connect_read(&[0x10, 30, 0, 4], t0 + ms(10));
        b.complete(t0 + ms(10));
        assert!(
            matches!(set.admit(&gate, t0 + ms(20), None), Admission::Refused),
            "a is within STALL of its first byte"
        );
        // a sends its CONNECT at a byte a second: 4 of 32 bytes after 3 s.
        a.connect_read(&[0x10, 30, 0, 4, b'M'], t0 + ms(3010));
        let c = set.admit(&gate, t0 + ms(3020), None).guard()
            .expect("a CONNECT a byte a second gives way");
        assert!(!a.entry.in_set());
        drop(c);
        assert!(b.entry.in_set(), "a complete CONNECT never gives way");
    }

    #[test]
    fn among_stalled_connections_the_furthest_from_a_connect_gives_way_first() {
        let gate = Gate::new(3, 1, None, 1);
        let set = set();
        let t0 = Instant::now();
        let tls = set.admit(&gate, t0, None).guard().unwrap();
        let near = set.admit(&gate, t0, None).guard().unwrap();
        let far = set.admit(&gate, t0, None).guard().unwrap();
        tls.handshaking(t0 + ms(5));
        near.connect_read(&[0x10, 10, 1, 2, 3, 4, 5, 6, 7, 8], t0 + ms(1));
        far.connect_read(&[0x10, 100, 1], t0 + ms(1));
        let later = t0 + ms(1500);
        let n1 = set.admit(&gate, later, None).guard()
            .expect("the stalled handshake first");
        assert!(!tls.entry.in_set());
        n1.complete(later);
        let _n2 = set.admit(&gate, later, None).guard()
            .expect("then the CONNECT missing the most");
        assert!(!far.entry.in_set() && near.entry.in_set());
    }

    #[test]
    fn a_fast_large_connect_is_progressing_and_a_slow_one_is_not() {
        let t0 = Instant::now();
        let mut p = Progress::new(t0);
        p.stage = Stage::Connect;
        p.since = t0;
        p.size = Some(60_000);
        // 40 KB in 2 s: the rest within the 5 s timeout.
        p.read = 40_000;
        p.last = t0 + ms(2000);
        assert!(!p.stalled(t0, t0 + ms(2000), TIMEOUT));
        // 4 KB in 2 s: 30 s for all of it.
        p.read = 4_000;
        assert!(p.stalled(t0, t0 + ms(2000), TIMEOUT));
        // Nothing for a second.
        p.read = 40_000;
        assert!(p.stalled(t0, t0 + ms(3000), TIMEOUT));
    }

    #[test]
    fn one_byte_is_judged_after_the_grace_and_no_byte_after_a_second() {
        let t0 = Instant::now();
        let mut p = Progress::new(t0);
        p.stage = Stage::Connect;
        p.read = 1;
        assert!(!p.stalled(t0, t0 + ms(100), TIMEOUT), "within the grace");
        // 1 byte in 0.4 s: 5.6 s for the smallest CONNECT.
        assert!(p.stalled(t0, t0 + ms(400), TIMEOUT));
        // A TLS 1.2 client sends its CONNECT a round trip after the
        // handshake ends here: no byte yet is not judged by pace.
        p.read = 0;
        assert!(!p.stalled(t0, t0 + ms(600), TIMEOUT));
        assert!(p.stalled(t0, t0 + ms(1000), TIMEOUT));
    }

    #[test]
    fn the_queue_of_silent_connections_stays_within_twice_the_set() {
        let gate = Gate::new(4, 1, None, 1);
        let set = set();
        let t0 = Instant::now();
        let mut kept = Vec::new();
        for i in 0..10_000u64 {
            // A second apart: every silent one is old (not YOUNG).
            let now = t0 + Duration::from_secs(i);
            let guard = set.admit(&gate, now, None).guard()
                .expect("a silent one gives way");
            if i % 3 != 0 {
                // Most connections send their CONNECT at once and go.
                guard.complete(now);
                continue;
            }
            kept.push(guard);
            kept.retain(|g| g.entry.in_set());
            assert!(set.silent.borrow().len() <= 2 * set.len() + 65);
        }
        assert_eq!(set.len(), 4);
    }

    #[test]
    fn a_connection_handed_to_another_shard_takes_its_pending_slot_along() {
        let gate = Gate::new(1, 1, None, 1);
        let (here, there) = (set(), set());
        let t0 = Instant::now();
        let guard = here.admit(&gate, t0, None).guard().unwrap();
        let slot = guard.hand_over();
        assert!(slot.is_some());
        assert_eq!(here.len(), 0, "it left the accepting shard's set");
        let adopted = there.adopt(&gate, slot, t0 + ms(1));
        assert_eq!(there.len(), 1);
        assert!(gate.pending().is_none(), "the slot is still held, by the owner now");
        // Complete: never evicted, so a newcomer at the limit is refused
        // or held, never given its slot.
        assert!(matches!(there.admit(&gate, t0 + ms(5_000), None), Admission::Refused | Admission::Behind));
        assert!(adopted.entry.in_set());
        drop(adopted);
        assert_eq!(there.len(), 0);
        assert!(gate.pending().is_some(), "the slot came back when the owner let it go");
    }
}
