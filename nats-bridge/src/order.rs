//! The order of the appends to one stream that run as tasks of their own
//! (`ingest::append`: a session log's, and the ingest stream's for values
//! a persistent session wants), across a failure of the stream or the
//! connection (DESIGN.md §7; `[MQTT-4.6.0-5]`: a session taken up later
//! reads its log in stream order).
//!
//! While JetStream takes them, each append is published at once, in the
//! order they were made (one connection keeps it). When one fails (no
//! leader, no acknowledgement within `appender::ANSWER_WAIT`, the
//! connection moved), the others made before it failed too or will, and
//! each would be sent again after its own pause: whichever came back
//! first would be stored first, out of order (as the ingest pipeline's
//! were before it kept them in order, `appender.rs`). So after a failure
//! ([`Mode::Careful`]) only the stream's oldest append is sent, again
//! and again, until one is stored; then ([`Mode::Ordered`]) every append
//! waiting is sent in the order they were made, each once the one before
//! it was handed to the connection (not stored: the connection keeps the
//! order), until none waits; then all at once again ([`Mode::Free`]).
//! The cost falls on failures only: a look at the mode per attempt.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

/// One [`Gate`] per stream name.
#[derive(Default)]
pub(crate) struct Orders {
    streams: Mutex<HashMap<String, Arc<Gate>>>,
}

impl Orders {
    /// A new append to `stream`: its place, which it holds until dropped.
    pub(crate) fn take(&self, stream: &str) -> Place {
        let gate = {
            let mut streams = self.streams.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            match streams.get(stream) {
                Some(gate) => gate.clone(),
                None => streams.entry(stream.to_owned()).or_default().clone(),
            }
        };
        let ticket = gate.lock().tickets.take();
        Place { gate, ticket, stored: AtomicBool::new(false) }
    }
}

/// The appends of one stream that are not done, and the ones waiting for
/// their turn.
#[derive(Default)]
pub(crate) struct Gate {
    inner: Mutex<Waiting>,
}

#[derive(Default)]
struct Waiting {
    tickets: Tickets,
    /// Ticket → what wakes it, while it waits for its turn.
    wakers: HashMap<u64, Arc<Notify>>,
}

impl Gate {
    fn lock(&self) -> std::sync::MutexGuard<'_, Waiting> {
        self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Apply `change` and wake the appends whose turn it is now.
    fn change(&self, change: impl FnOnce(&mut Tickets)) {
        let mut waiting = self.lock();
        change(&mut waiting.tickets);
        let Waiting { tickets, wakers } = &mut *waiting;
        wakers.retain(|ticket, waker| {
            let go = tickets.may_send(*ticket);
            if go {
                waker.notify_one();
            }
            !go
        });
    }
}

/// How a stream's appends are sent now (see the module documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum Mode {
    /// Each at once.
    #[default]
    Free,
    /// After a failure: the oldest alone, until one is stored.
    Careful,
    /// After a store that ended [`Mode::Careful`]: one after another in
    /// order, each once those before it were handed to the connection
    /// (tickets below `cursor` were).
    Ordered {
        /// The tickets below it were sent in this mode.
        cursor: u64,
    },
}

/// Which appends of a stream are not done, and how they are sent. Pure:
/// the rules of the module documentation.
#[derive(Debug, Default)]
pub(crate) struct Tickets {
    next: u64,
    open: BTreeSet<u64>,
    mode: Mode,
}

impl Tickets {
    /// A new append's ticket.
    pub(crate) fn take(&mut self) -> u64 {
        let ticket = self.next;
        self.next += 1;
        self.open.insert(ticket);
        ticket
    }

    /// Whether `ticket` may send an attempt now.
    pub(crate) fn may_send(&self, ticket: u64) -> bool {
        match self.mode {
            Mode::Free => true,
            Mode::Careful => self.open.first() == Some(&ticket),
            Mode::Ordered { cursor } => self.open.range(cursor..).next() == Some(&ticket),
        }
    }

    /// `ticket` handed its attempt to the connection.
    pub(crate) fn sent(&mut self, ticket: u64) {
        if let Mode::Ordered { cursor } = &mut self.mode {
            *cursor = (*cursor).max(ticket + 1);
            if self.open.range(*cursor..).next().is_none() {
                self.mode = Mode::Free;
            }
        }
    }

    /// An attempt failed for the stream or the connection.
    pub(crate) fn failed(&mut self) {
        self.mode = Mode::Careful;
    }

    /// `ticket` is done: `stored`, or refused or given up.
    pub(crate) fn done(&mut self, ticket: u64, stored: bool) {
        self.open.remove(&ticket);
        if stored && self.mode == Mode::Careful {
            self.mode = Mode::Ordered { cursor: 0 };
        }
        if let Mode::Ordered { cursor } = self.mode {
            if self.open.range(cursor..).next().is_none() {
                self.mode = Mode::Free;
            }
        }
    }
}

/// An append's place in its stream's order, given up when dropped.
pub(crate) struct Place {
    gate: Arc<Gate>,
    ticket: u64,
    /// Stored ([`Place::stored`]) rather than refused or given up.
    stored: AtomicBool,
}

impl Place {
    /// Wait until this append may send an attempt ([`Tickets::may_send`]).
    pub(crate) async fn turn(&self) {
        loop {
            let waker = {
                let mut waiting = self.gate.lock();
                if waiting.tickets.may_send(self.ticket) {
                    return;
                }
                // A permit is kept when woken before it waits.
                waiting.wakers.entry(self.ticket).or_default().clone()
            };
            waker.notified().await;
        }
    }

    /// This append's attempt was handed to the connection.
    pub(crate) fn sent(&self) {
        let ticket = self.ticket;
        self.gate.change(|t| t.sent(ticket));
    }

    /// This append's attempt failed for the stream or the connection.
    pub(crate) fn failed(&self) {
        self.gate.change(Tickets::failed);
    }

    /// Stored: when dropped, the next ones may go (in order after a
    /// failure).
    pub(crate) fn stored(&self) {
        self.stored.store(true, Ordering::Relaxed);
    }
}

impl Drop for Place {
    /// Done: stored, or refused or given up (or dropped at a stop).
    fn drop(&mut self) {
        let (ticket, stored) = (self.ticket, self.stored.load(Ordering::Relaxed));
        self.gate.lock().wakers.remove(&ticket);
        self.gate.change(|t| t.done(ticket, stored));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn after_a_failure_the_oldest_goes_alone_until_stored_then_all_in_order() {
        let mut t = Tickets::default();
        let (a, b, c) = (t.take(), t.take(), t.take());
        assert!(t.may_send(a) && t.may_send(b) && t.may_send(c));
        t.failed();
        let d = t.take();
        assert!(t.may_send(a));
        assert!(!t.may_send(b) && !t.may_send(c) && !t.may_send(d), "{t:?}");
        // The oldest given up (refused at its deadline): the next alone.
        t.done(a, false);
        assert_eq!(t.mode, Mode::Careful);
        assert!(t.may_send(b) && !t.may_send(c) && !t.may_send(d));
        // Stored: the others in order, each once the one before was sent.
        t.done(b, true);
        assert!(t.may_send(c) && !t.may_send(d), "{t:?}");
        t.sent(c);
        assert!(t.may_send(d) && !t.may_send(c), "{t:?}");
        let e = t.take();
        assert!(!t.may_send(e));
        t.sent(d);
        assert!(t.may_send(e));
        t.sent(e);
        // None waits: all at once again.
        assert_eq!(t.mode, Mode::Free);
        let (f, g) = (t.take(), t.take());
        assert!(t.may_send(f) && t.may_send(g), "{t:?}");
    }

    #[test]
    fn a_failure_while_in_order_makes_the_stream_careful_again() {
        let mut t = Tickets::default();
        let (a, b, c) = (t.take(), t.take(), t.take());
        t.failed();
        t.done(a, true);
        t.sent(b);
        // b's attempt failed too: c waits again, b alone.
        t.failed();
        assert!(t.may_send(b) && !t.may_send(c));
        t.done(b, true);
        assert!(t.may_send(c));
        t.done(c, true);
        assert_eq!(t.mode, Mode::Free);
    }

    #[tokio::test]
    async fn a_waiting_append_is_woken_when_its_turn_comes() {
        let orders = Orders::default();
        let first = orders.take("s");
        let second = orders.take("s");
        first.failed();
        first.turn().await;
        let waiting = tokio::spawn(async move {
            second.turn().await;
            second
        });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished());
        first.stored();
        drop(first);
        let second = tokio::time::timeout(std::time::Duration::from_secs(1), waiting).await.expect("woken").unwrap();
        // Another stream is not held while this one is careful.
        second.failed();
        let other = orders.take("t");
        tokio::time::timeout(std::time::Duration::from_millis(100), other.turn()).await.expect("another stream goes");
        drop(second);
        // No waker left behind.
        assert!(orders.streams.lock().unwrap()["s"].lock().wakers.is_empty());
    }
}
