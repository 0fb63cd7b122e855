//! The ingest stream's appends of values no persistent session wants (the
//! common case of `store.kind = "jetstream"`, DESIGN.md §7): one
//! pipeline on the bridge thread for all of them, instead of a task,
//! timers and a reply mailbox each (`ingest.rs` handles the others: a
//! session log or a QoS 2 flow too).
//!
//! Each append is published with a reply subject of its own under one
//! inbox of this process (`<inbox>.<key>`), whose acknowledgements one
//! subscription brings back; what it waits for is in one map and one
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
const ANSWER_WAIT: Duration = Duration::from_secs(2);

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
    properties: Vec<(String, String)>,
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

/// The appends waiting, by key: keys are given in order, so a ring
/// starting at the oldest key still waiting.
#[derive(Default)]
struct Ring {
    first: u64,
    slots: VecDeque<Option<Pending>>,
}

impl Ring {
    fn push(&mut self, key: u64, pending: Pending) {
        if self.slots.is_empty() {
            self.first = key;
        }
        debug_assert_eq!(self.first + self.slots.len() as u64, key);
        self.slots.push_back(Some(pending));
    }

    fn get_mut(&mut self, key: u64) -> Option<&mut Pending> {
        let at = key.checked_sub(self.first)?;
        self.slots.get_mut(usize::try_from(at).ok()?)?.as_mut()
    }

    fn contains(&self, key: u64) -> bool {
        key.checked_sub(self.first).and_then(|at| self.slots.get(usize::try_from(at).ok()?)).is_some_and(Option::is_some)
    }

    fn remove(&mut self, key: u64) -> Option<Pending> {
        let at = usize::try_from(key.checked_sub(self.first)?).ok()?;
        let pending = self.slots.get_mut(at)?.take();
        while self.slots.front().is_some_and(Option::is_none) {
            self.slots.pop_front();
            self.first += 1;
        }
        pending
    }

    fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    fn iter_mut(&mut self) -> impl Iterator<Item = (u64, &mut Pending)> {
        let first = self.first;
        self.slots.iter_mut().enumerate().filter_map(move |(at, p)| Some((first + at as u64, p.as_mut()?)))
    }
}

#[derive(Default)]
struct Inner {
    pending: Ring,
    /// (deadline, key) of every pending append, in order: every append
    /// waits as long (`cluster.session_log_append_wait`), so deadlines
    /// come in the order of the keys.
    deadlines: VecDeque<(Instant, u64)>,
    /// Keys to send now, in order.
    to_send: VecDeque<u64>,
    /// Keys to send again once their pause is over, in order.
    again: VecDeque<(Instant, u64)>,
    /// (sent at, key, attempt) of each attempt sent, in order: looked at
    /// after [`ANSWER_WAIT`].
    sent: VecDeque<(Instant, u64, u32)>,
    /// Sent and not answered.
    in_flight: usize,
    next: u64,
    /// The answers for [`AppendReply::Shard`] not sent yet, by shard:
    /// sent together, one event per shard, by [`Appender::send_answers`].
    answers: Vec<Vec<(u64, AppendOutcome)>>,
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
        let inner = Inner { answers: vec![Vec::new(); shared.mailboxes.len()], ..Inner::default() };
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
        let deadline = Instant::now() + wait;
        let mut inner = self.inner.borrow_mut();
        let key = inner.next;
        inner.next += 1;
        let pending = Pending {
            subject: Subject::from(subject),
            id,
            properties,
            payload,
            deadline,
            started: std::time::Instant::now(),
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
                self.finish(inner, key, Ok(appended));
            }
            crate::ingest::Fate::Full(e) => self.finish(inner, key, Err(IngestError::Full(e))),
            crate::ingest::Fate::Retry(e) => {
                if pending.in_flight {
                    pending.in_flight = false;
                    inner.in_flight -= 1;
                    pending.why = e;
                    inner.again.push_back((Instant::now() + RETRY_PAUSE, key));
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
        let next = {
            let mut inner = appender.inner.borrow_mut();
            if inner.in_flight >= WINDOW {
                None
            } else {
                let mut found = None;
                while let Some(key) = inner.to_send.pop_front() {
                    let inner = &mut *inner;
                    let Some(pending) = inner.pending.get_mut(key) else { continue };
                    // Past its deadline: refused by the answer task.
                    if pending.in_flight || pending.deadline <= Instant::now() {
                        continue;
                    }
                    pending.in_flight = true;
                    pending.attempts += 1;
                    let attempt = pending.attempts;
                    inner.in_flight += 1;
                    inner.sent.push_back((Instant::now(), key, attempt));
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
                inner.again.push_back((Instant::now() + RETRY_PAUSE, key));
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
    let stats = shared.ingest_client.statistics();
    let mut connects = stats.connects.load(Ordering::Relaxed);
    let key_of = |subject: &str| subject.rsplit('.').next().and_then(|k| k.parse::<u64>().ok());
    loop {
        let wake_at = {
            let inner = appender.inner.borrow();
            let deadline = inner.deadlines.front().map(|(at, _)| *at);
            let again = inner.again.front().map(|(at, _)| *at);
            // At least every LOOK_EVERY, for a reconnect.
            deadline.into_iter().chain(again).chain([Instant::now() + LOOK_EVERY]).min().expect("one at least")
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
            // Sent to a server the ingest connection left as silent: its
            // answer will not come (the same ID again is stored once).
            Ok(()) = moved.changed() => appender.send_again("the ingest connection left a silent server"),
            () = appender.clock.notified() => {}
            () = tokio::time::sleep_until(wake_at) => {}
        }
        // Sent on a connection that has ended since (its server died):
        // no answer will come either.
        let now_connects = stats.connects.load(Ordering::Relaxed);
        if now_connects != connects {
            connects = now_connects;
            appender.send_again("the ingest connection reconnected");
        }
        appender.keep_time(Instant::now(), shared.stopping.load(Ordering::Acquire));
        appender.send_answers();
        appender.send.notify_one();
    }
}

impl Appender {
    /// Send again, at once, every append sent and not answered, `why`.
    fn send_again(&self, why: &str) {
        let mut inner = self.inner.borrow_mut();
        let inner = &mut *inner;
        let now = Instant::now();
        for (key, pending) in inner.pending.iter_mut().filter(|(_, p)| p.in_flight) {
            pending.in_flight = false;
            why.clone_into(&mut pending.why);
            inner.again.push_back((now, key));
        }
        inner.in_flight = 0;
    }

    /// Refuse what ran out of time; queue again what paused long enough
    /// (refuse it when the broker stops).
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
                inner.again.push_back((now, key));
            }
        }
        while inner.again.front().is_some_and(|(at, _)| *at <= now) {
            let (_, key) = inner.again.pop_front().expect("checked");
            if stopping {
                self.finish(inner, key, Err(IngestError::Unavailable("the broker is stopping".to_owned())));
            } else if inner.pending.contains(key) {
                inner.to_send.push_back(key);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pending() -> Pending {
        Pending {
            subject: Subject::from("s"),
            id: String::new(),
            properties: Vec::new(),
            payload: bytes::Bytes::new(),
            deadline: Instant::now(),
            started: std::time::Instant::now(),
            attempts: 0,
            in_flight: false,
            why: String::new(),
            reply: AppendReply::Oneshot(tokio::sync::oneshot::channel().0),
            _ticket: None,
        }
    }

    proptest::proptest! {
        /// The ring holds exactly the keys pushed and not removed, in
        /// any order of removal, and shrinks from its oldest end.
        #[test]
        fn the_ring_holds_what_was_pushed_and_not_removed(removals in proptest::collection::vec(0u64..40, 0..80)) {
            let mut ring = Ring::default();
            let mut held = std::collections::BTreeSet::new();
            for key in 5..45 {
                ring.push(key, pending());
                held.insert(key);
            }
            for key in removals {
                let key = key + 5;
                proptest::prop_assert_eq!(ring.remove(key).is_some(), held.remove(&key));
                for k in 0..50 {
                    proptest::prop_assert_eq!(ring.contains(k), held.contains(&k));
                    proptest::prop_assert_eq!(ring.get_mut(k).is_some(), held.contains(&k));
                }
                proptest::prop_assert_eq!(ring.iter_mut().map(|(k, _)| k).collect::<Vec<_>>(), held.iter().copied().collect::<Vec<_>>());
                proptest::prop_assert_eq!(ring.is_empty(), held.is_empty());
                if let Some(first) = held.first() {
                    proptest::prop_assert_eq!(ring.first, *first);
                }
            }
        }
    }
}
