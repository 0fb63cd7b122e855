//! The ingest stream's appends of values no persistent session wants (the
//! common case of `store.kind = "jetstream"`, DESIGN.md §7): one
//! pipeline on the bridge thread for all of them, instead of a task,
//! timers and a reply mailbox each (`ingest.rs` handles the others: a
//! session log or a QoS 2 flow too).
//!
//! Each append is published with a reply subject of its own under one
//! inbox of this process (`<inbox>.<key>`), whose acknowledgements one
//! subscription brings back; what it waits for is in one ring (`fleetmq_core::ring`) and one
//! deadline heap, and one task sends ([`run_sender`]) while another
//! reads the answers and the clock ([`run_answers`]). Semantics as
//! `ingest::append`: one `Nats-Msg-Id` across the attempts of an append
//! (see `ingest.rs`); an error answer, or the ingest connection
//! (`Shared::ingest_client`, made at the stream's leader) moved away
//! from a silent server, sends it again after [`RETRY_PAUSE`] while its
//! wait lasts; no acknowledgement by the deadline refuses it
//! ([`IngestError::Unavailable`]); the stream full refuses it at once
//! ([`IngestError::Full`]). At most [`WINDOW`] are sent and unanswered
//! at a time (as async-nats' acknowledgement window).
//!
//! The answers go back to the shards together: those that came in one
//! wake-up of the answer task make one [`Event::Appended`] per shard
//! (one mailbox push and one wake of the shard for all of them), for
//! appends sent with [`AppendReply::Shard`]; the others each through
//! their one-shot channel.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use async_nats::Subject;
use fleetmq_core::ring::Ring;
use futures_util::{FutureExt as _, StreamExt as _};
use tokio::sync::Notify;
use tokio::time::Instant;
use tracing::warn;

use crate::bridge::Shared;
use crate::budget::Ticket;
use crate::request::{AppendOutcome, AppendReply, Appended, Event, IngestError, StreamMessage};

/// A rejected append is sent again after this pause (as `ingest.rs`).
const RETRY_PAUSE: Duration = Duration::from_millis(100);

/// An attempt unanswered this long is sent again (the stream's leader
/// died with it, or the server it went through: a lost publish has no
/// answer; the same ID again is stored once).
pub(crate) const ANSWER_WAIT: Duration = Duration::from_secs(2);

/// How often the answer task looks whether the ingest connection
/// reconnected, at least.
const LOOK_EVERY: Duration = Duration::from_millis(100);

/// Appends sent and not answered at most.
pub(crate) const WINDOW: usize = 4096;

/// One append until it is answered.
struct Pending {
    subject: Subject,
    /// `Nats-Msg-Id`.
    id: String,
    /// The other headers; the header map is made at each send (async-nats
    /// takes it), not kept and cloned.
    properties: fleetmq_core::cluster::ingest::Headers,
    payload: bytes::Bytes,
    deadline: Instant,
    started: std::time::Instant,
    /// Attempts sent so far.
    attempts: u32,
    /// Sent and not answered yet.
    in_flight: bool,
    /// Why the last attempt failed.
    why: String,
    reply: AppendReply,
    _ticket: Option<Ticket>,
}

#[derive(Default)]
struct Inner {
    /// The appends waiting, by key (keys are given in order).
    pending: Ring<Pending>,
    /// (deadline, key) of every pending append, in order: every append
    /// waits as long (`cluster.session_log_append_wait`), so deadlines
    /// come in the order of the keys.
    deadlines: VecDeque<(Instant, u64)>,
    /// Keys not sent yet, in order.
    to_send: VecDeque<u64>,
    /// Keys to send again, by key, each not before its instant (see
    /// [`Inner::next_key`]).
    retry: std::collections::BTreeMap<u64, Instant>,
    /// An attempt failed for the stream or the connection (not for its
    /// own content) and none has been stored since: see
    /// [`Inner::next_key`].
    careful: bool,
    /// (sent at, key, attempt) of each attempt sent, in order: looked at
    /// after [`ANSWER_WAIT`].
    sent: VecDeque<(Instant, u64, u32)>,
    /// Sent and not answered.
    in_flight: usize,
    next: u64,
    /// The ingest connection's connects and forced moves last seen (see
    /// [`Appender::note_reconnect`]).
    connects: u64,
    moves: u64,
    /// The answers for [`AppendReply::Shard`] not sent yet, by shard:
    /// sent together, one event per shard, by [`Appender::send_answers`].
    answers: Vec<Vec<(u64, AppendOutcome)>>,
}

impl Inner {
    /// Send `key` again, not before `at`; `failing`: its attempt failed
    /// for the stream or the connection (see [`Inner::next_key`]).
    fn retry(&mut self, key: u64, at: Instant, failing: bool) {
        self.retry.insert(key, at);
        self.careful |= failing;
    }

    /// The key to send next, so that the stream keeps the order the
    /// appends came in (one publisher's values on one topic, for one)
    /// across failures. Normally the oldest append to send again whose
    /// pause is over, else the oldest not sent yet. Once an attempt
    /// failed for the stream or the connection (no leader, JetStream
    /// unavailable, no answer, the connection lost: the appends after it
    /// meet the same), appends newer than what failed would land before
    /// it is sent again: so, careful, the oldest one alone, once nothing
    /// is in flight and its pause is over, until one is stored; then all
    /// of them again, in order. An append refused for its own content
    /// only is sent again after its pause without holding the others
    /// (it may fail until its wait ends). (Appends already sent when an
    /// older one fails may still land before it: order is kept across
    /// a lost server or connection, where every append sent is lost
    /// alike, and across a leader election but for the appends in flight
    /// at its very end.)
    fn next_key(&mut self, now: Instant) -> Option<u64> {
        if self.careful {
            if self.in_flight > 0 {
                return None;
            }
            return match self.retry.first_key_value() {
                Some((&key, &at)) if at <= now => self.retry.remove(&key).map(|_| key),
                Some(_) => None,
                None => self.to_send.pop_front(),
            };
        }
        let due = self.retry.iter().find(|(_, at)| **at <= now).map(|(key, _)| *key);
        match due {
            Some(key) => {
                self.retry.remove(&key);
                Some(key)
            }
            None => self.to_send.pop_front(),
        }
    }
}

/// The pipeline's handle on the bridge thread's loop.
pub(crate) struct Appender {
    inner: Rc<RefCell<Inner>>,
    shared: Arc<Shared>,
    /// Wakes the sender: something to send, or room in the window.
    send: Rc<Notify>,
    /// Wakes the answer task: a new deadline to keep.
    clock: Rc<Notify>,
}

impl Appender {
    /// Start the pipeline's two tasks on the current `LocalSet`.
    pub(crate) fn start(shared: Arc<Shared>) -> Appender {
        let connects = shared.ingest_client.statistics().connects.load(Ordering::Relaxed);
        let moves = *shared.ingest_moved.borrow();
        let inner = Inner { answers: vec![Vec::new(); shared.mailboxes.len()], connects, moves, ..Inner::default() };
        let appender = Appender { inner: Rc::new(RefCell::new(inner)), shared, send: Rc::default(), clock: Rc::default() };
        let inbox = appender.shared.ingest_client.new_inbox();
        tokio::task::spawn_local(run_sender(appender.clone_handle(), inbox.clone()));
        tokio::task::spawn_local(run_answers(appender.clone_handle(), inbox));
        appender
    }

    fn clone_handle(&self) -> Appender {
        Appender { inner: self.inner.clone(), shared: self.shared.clone(), send: self.send.clone(), clock: self.clock.clone() }
    }

    /// Append `message` to the ingest stream within `wait`, answering
    /// `reply`; counted in flight until answered.
    pub(crate) fn push(&self, message: StreamMessage, wait: Duration, reply: AppendReply, ticket: Option<Ticket>) {
        let id = crate::ingest::message_id(&self.shared);
        if let Err(e) = crate::ingest::too_large(&self.shared, &message, &id) {
            crate::ingest::refused(&self.shared, &e);
            self.shared.answer_append(reply, Err(e));
            return;
        }
        self.shared.status.stats.started();
        let StreamMessage { subject, headers: properties, payload } = message;
        // One reading of the clock per append.
        let started = std::time::Instant::now();
        let deadline = Instant::from_std(started) + wait;
        let mut inner = self.inner.borrow_mut();
        let key = inner.next;
        inner.next += 1;
        let pending = Pending {
            subject: crate::ingest::nats_subject(subject),
            id,
            properties,
            payload,
            deadline,
            started,
            attempts: 0,
            in_flight: false,
            why: String::new(),
            reply,
            _ticket: ticket,
        };
        inner.pending.push(key, pending);
        let earliest = inner.deadlines.is_empty();
        inner.deadlines.push_back((deadline, key));
        inner.to_send.push_back(key);
        drop(inner);
        self.send.notify_one();
        if earliest {
            self.clock.notify_one();
        }
    }

    /// Answer `key` (if still pending) with `outcome`.
    fn finish(&self, inner: &mut Inner, key: u64, outcome: AppendOutcome) {
        let Some(pending) = inner.pending.remove(key) else { return };
        if pending.in_flight {
            inner.in_flight -= 1;
        }
        let stats = &self.shared.status.stats;
        stats.record(crate::OpKind::Ingest, pending.started.elapsed());
        match &outcome {
            Ok(_) => {
                stats.ingest_appended.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => crate::ingest::refused(&self.shared, e),
        }
        match pending.reply {
            AppendReply::Oneshot(reply) => {
                let _ = reply.send(outcome);
            }
            AppendReply::Shard { shard, token } => match inner.answers.get_mut(shard) {
                Some(answers) => answers.push((token, outcome)),
                None => self.shared.answer_append(AppendReply::Shard { shard, token }, outcome),
            },
        }
        stats.finished();
    }

    /// Send the answers gathered for the shards, one event per shard.
    fn send_answers(&self) {
        let mut inner = self.inner.borrow_mut();
        for (shard, answers) in inner.answers.iter_mut().enumerate() {
            if !answers.is_empty() {
                self.shared.send_event(shard, Event::Appended(std::mem::take(answers)));
            }
        }
    }

    /// The answer `message` to the attempt of `key`.
    fn answered(&self, inner: &mut Inner, key: u64, message: &async_nats::Message) {
        let Some(pending) = inner.pending.get_mut(key) else { return };
        let fate = crate::ingest::fate_of(message);
        match fate {
            crate::ingest::Fate::Stored(sequence, duplicate) => {
                // A duplicate of this process's own earlier attempt is no
                // sign of an earlier store by another replica.
                let duplicate = duplicate && pending.attempts == 1;
                let appended = Appended { ingest: Some(sequence), session_log: None, duplicate };
                inner.careful = false;
                self.finish(inner, key, Ok(appended));
            }
            crate::ingest::Fate::Full(e) => self.finish(inner, key, Err(IngestError::Full(e))),
            crate::ingest::Fate::Retry(e) => {
                if pending.in_flight {
                    pending.in_flight = false;
                    inner.in_flight -= 1;
                    let failing = crate::ingest::transient(&e);
                    pending.why = e;
                    inner.retry(key, Instant::now() + RETRY_PAUSE, failing);
                    self.send.notify_one();
                }
            }
        }
    }
}

/// `<inbox>.<key>`.
fn reply_subject(inbox: &str, key: u64) -> String {
    use std::fmt::Write as _;
    let mut reply = String::with_capacity(inbox.len() + 21);
    reply.push_str(inbox);
    let _ = write!(reply, ".{key}");
    reply
}

/// Send what is to send, within the window.
async fn run_sender(appender: Appender, inbox: String) {
    let shared = appender.shared.clone();
    loop {
        appender.note_reconnect();
        // Nothing goes while the connection is down: it would be written
        // to the next one before what was lost with this one is sent
        // again (see `note_reconnect`).
        let up = shared.ingest_client.connection_state() == async_nats::connection::State::Connected;
        let next = {
            let mut inner = appender.inner.borrow_mut();
            if inner.in_flight >= WINDOW || !up {
                None
            } else {
                let mut found = None;
                let now = Instant::now();
                while let Some(key) = inner.next_key(now) {
                    let inner = &mut *inner;
                    let Some(pending) = inner.pending.get_mut(key) else { continue };
                    // Past its deadline: refused by the answer task.
                    if pending.in_flight || pending.deadline <= now {
                        continue;
                    }
                    pending.in_flight = true;
                    pending.attempts += 1;
                    let attempt = pending.attempts;
                    inner.in_flight += 1;
                    inner.sent.push_back((now, key, attempt));
                    found = Some((key, pending.subject.clone(), crate::ingest::header_map(&pending.id, &pending.properties), pending.payload.clone()));
                    break;
                }
                found
            }
        };
        let Some((key, subject, headers, payload)) = next else {
            if shared.stopping.load(Ordering::Acquire) && appender.inner.borrow().pending.is_empty() {
                return;
            }
            appender.send.notified().await;
            continue;
        };
        let reply = Subject::from(reply_subject(&inbox, key));
        if let Err(e) = shared.ingest_client.publish_with_reply_and_headers(subject, reply, headers, payload).await {
            let mut inner = appender.inner.borrow_mut();
            let inner = &mut *inner;
            if let Some(pending) = inner.pending.get_mut(key) {
                if pending.in_flight {
                    pending.in_flight = false;
                    inner.in_flight -= 1;
                }
                pending.why = e.to_string();
                inner.retry(key, Instant::now() + RETRY_PAUSE, true);
            }
        }
    }
}

/// Read the answers; refuse what ran out of time; send again after
/// the pause what was rejected, and what waits for a server the ingest
/// connection left as silent.
async fn run_answers(appender: Appender, inbox: String) {
    let shared = appender.shared.clone();
    let mut answers = loop {
        match shared.ingest_client.subscribe(format!("{inbox}.*")).await {
            Ok(answers) => break answers,
            Err(e) => {
                warn!(target: "cluster", error = %e, "cluster: the ingest acknowledgements' subscription failed; trying again");
                tokio::time::sleep(RETRY_PAUSE).await;
            }
        }
    };
    let mut moved = shared.ingest_moved.subscribe();
    let key_of = |subject: &str| subject.rsplit('.').next().and_then(|k| k.parse::<u64>().ok());
    loop {
        let wake_at = {
            let inner = appender.inner.borrow();
            let deadline = inner.deadlines.front().map(|(at, _)| *at);
            // At least every LOOK_EVERY, for a reconnect and for what
            // waits to be sent again (the sender looks then).
            deadline.into_iter().chain([Instant::now() + LOOK_EVERY]).min().expect("one at least")
        };
        tokio::select! {
            answer = answers.next() => {
                let Some(answer) = answer else { return };
                let mut inner = appender.inner.borrow_mut();
                for answer in std::iter::once(answer).chain(std::iter::from_fn(|| answers.next().now_or_never().flatten())) {
                    if let Some(key) = key_of(answer.subject.as_str()) {
                        appender.answered(&mut inner, key, &answer);
                    }
                }
                drop(inner);
                appender.send.notify_one();
            }
            // Being moved (see `note_reconnect`).
            Ok(()) = moved.changed() => {}
            () = appender.clock.notified() => {}
            () = tokio::time::sleep_until(wake_at) => {}
        }
        appender.note_reconnect();
        appender.keep_time(Instant::now(), shared.stopping.load(Ordering::Acquire));
        appender.send_answers();
        appender.send.notify_one();
    }
}

impl Appender {
    /// When the ingest connection is being moved (away from a silent
    /// server, `liveness.rs`, or to the stream's leader, `leader.rs`:
    /// each counts the move before it asks for the reconnect), or
    /// connected again (its server died), since last seen: what was
    /// sent on the connection that ends will not be answered, so it is
    /// sent again at once (the same ID again is stored once). The sender
    /// looks before each append it sends, so what was lost goes again
    /// before anything newer, on the next connection: the stream keeps
    /// the order.
    fn note_reconnect(&self) {
        let connects = self.shared.ingest_client.statistics().connects.load(Ordering::Relaxed);
        let moves = *self.shared.ingest_moved.borrow();
        let (seen_connects, seen_moves) = {
            let mut inner = self.inner.borrow_mut();
            (std::mem::replace(&mut inner.connects, connects), std::mem::replace(&mut inner.moves, moves))
        };
        if seen_moves != moves {
            self.send_again("the ingest connection moved to another server");
        } else if seen_connects != connects {
            self.send_again("the ingest connection reconnected");
        }
    }

    /// Send again, at once, every append sent and not answered, `why`.
    fn send_again(&self, why: &str) {
        let mut inner = self.inner.borrow_mut();
        let inner = &mut *inner;
        let now = Instant::now();
        for (key, pending) in inner.pending.iter_mut().filter(|(_, p)| p.in_flight) {
            pending.in_flight = false;
            why.clone_into(&mut pending.why);
            inner.retry.insert(key, now);
        }
        inner.careful = true;
        inner.in_flight = 0;
    }

    /// Refuse what ran out of time (and, when the broker stops, what
    /// waits to be sent again); queue again what was not answered within
    /// [`ANSWER_WAIT`].
    fn keep_time(&self, now: Instant, stopping: bool) {
        let mut inner = self.inner.borrow_mut();
        let inner = &mut *inner;
        while let Some(&(at, key)) = inner.deadlines.front() {
            if at > now {
                break;
            }
            inner.deadlines.pop_front();
            if let Some(pending) = inner.pending.get_mut(key) {
                let why = if pending.why.is_empty() { "no acknowledgement from JetStream in time".to_owned() } else { pending.why.clone() };
                self.finish(inner, key, Err(IngestError::Unavailable(why)));
            }
        }
        while inner.sent.front().is_some_and(|(at, _, _)| *at + ANSWER_WAIT <= now) {
            let (_, key, attempt) = inner.sent.pop_front().expect("checked");
            if let Some(pending) = inner.pending.get_mut(key).filter(|p| p.in_flight && p.attempts == attempt) {
                pending.in_flight = false;
                pending.why = format!("no acknowledgement from JetStream within {ANSWER_WAIT:?}");
                inner.in_flight -= 1;
                inner.retry(key, now, true);
            }
        }
        if stopping {
            for key in std::mem::take(&mut inner.retry).into_keys() {
                self.finish(inner, key, Err(IngestError::Unavailable("the broker is stopping".to_owned())));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_is_sent_again_goes_in_key_order_and_after_a_failure_one_goes_alone_until_one_is_stored() {
        let now = Instant::now();
        let later = now + RETRY_PAUSE;
        let mut inner = Inner { to_send: VecDeque::from([5, 6]), ..Inner::default() };
        // 1 refused for its own content: the others go on meanwhile.
        inner.retry(1, later, false);
        assert_eq!(inner.next_key(now), Some(5));
        assert_eq!(inner.next_key(later), Some(1), "due: before the newer ones");
        // 3 and 2 lost with the connection while 6 waits.
        inner.retry(3, now, true);
        inner.retry(2, now, true);
        inner.in_flight = 1;
        assert_eq!(inner.next_key(now), None, "careful: nothing while an attempt is in flight");
        inner.in_flight = 0;
        assert_eq!(inner.next_key(now), Some(2), "the oldest alone");
        inner.in_flight = 1;
        assert_eq!(inner.next_key(now), None);
        // 2 stored: the rest in order.
        inner.in_flight = 0;
        inner.careful = false;
        assert_eq!(inner.next_key(now), Some(3));
        assert_eq!(inner.next_key(now), Some(6));
        assert_eq!(inner.next_key(now), None);
        // A failed attempt paused: nothing newer goes before it.
        inner.to_send.push_back(7);
        inner.retry(4, later, true);
        assert_eq!(inner.next_key(now), None);
        assert_eq!(inner.next_key(later), Some(4));
    }
}
