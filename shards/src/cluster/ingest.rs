//! The shard's side of `store.kind = "jetstream"` (DESIGN.md §7) and of
//! the session logs (issue 24): an accepted QoS 1/2 PUBLISH is appended
//! to the ingest stream `mqtt-ingest` and, when a persistent session of
//! the cluster wants it ([`wants_log`]), to its workspace's session log
//! `LOG_mqtt-sessions-<workspace>`, through the bridge (one request,
//! both appends pipelined there, `ingest.rs` and `session_log.rs` of the
//! bridge), and its PUBACK/PUBREC waits for JetStream's
//! acknowledgements: a refusal of either refuses the value.
//!
//! The acknowledgement waits through the machinery the cluster's retained
//! writes use: a [`Write`](crate::store::Write) of the shard's store,
//! resolved when the bridge answers, holds the connection's
//! acknowledgements from that one on (they leave in the order they were
//! parked, `[MQTT-4.6.0-2]` `[MQTT-4.6.0-3]`); the value's delivery to
//! live subscribers waits too ([`crate::shard::Shard::written`]), so that
//! a refused value was delivered to nobody (the client sends it again:
//! MQTT 5 §3.4.2.1; at QoS 2 a resend is never a second copy). A
//! publisher with 256 values unanswered, or any while its shard holds
//! 64 MiB of them, stops being read until JetStream answers
//! (`shard/held.rs`): memory stays bounded while NATS is slow or away.
//!
//! Refusals: not in the stream within `cluster.session_log_append_wait`
//! → 0x80 Unspecified error; the stream full (`store.max_bytes`, discard
//! new) or too many appends waiting for NATS → 0x97 Quota exceeded. MQTT
//! 3.1.1 has no refusal code: the connection is closed after the
//! acknowledgements of what came before (DESIGN.md §7; 3.1.1 §4.5: the
//! client sends the unacknowledged PUBLISH again after it reconnects).
//! Never acknowledged and then lost.
//!
//! The answers for the common case (the ingest stream only) come in
//! batches, as [`fleetmq_nats_bridge::Event::Appended`] in the shard's
//! mailbox ([`answered`]), rather than a one-shot channel and a task per
//! value; one whose answer is [`GIVE_UP_AFTER`] past the wait (the
//! bridge stopped) is refused with 0x80 ([`give_up_overdue`]).

use std::sync::Arc;

use fleetmq_core::cluster::ingest::{headers, subject, Headers, IngestValue};
use fleetmq_core::cluster::session_log;
use fleetmq_core::ring::Ring;
use fleetmq_core::packet::ReasonCode;
use fleetmq_core::session::Message;
use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::time::{Duration, Instant};

use fleetmq_nats_bridge::{AppendOutcome, AppendReply, IngestError, LogAppend, Qos2Flow, Request, StreamMessage};

use super::shard_state;
use crate::store::{Outcome, Write};

/// An append answered in batches ([`AppendReply::Shard`]) whose answer
/// has not come this long after `cluster.session_log_append_wait` (the
/// bridge refuses it at the wait: it stopped, or lost it) is refused
/// here: 0x80, as an append not taken in time.
const GIVE_UP_AFTER: Duration = Duration::from_secs(5);

/// How often the appends waiting for their answer are looked over for
/// one given up on.
const LOOK_EVERY: Duration = Duration::from_secs(1);

/// A value as the ingest stream records it, but its payload: made where
/// the PUBLISH is handled, from what borrows from it and its session.
pub(crate) struct IngestRecord {
    subject: std::borrow::Cow<'static, str>,
    headers: Headers,
}

impl IngestRecord {
    /// `value`'s subject and headers
    /// ([`fleetmq_core::cluster::ingest::headers`]).
    pub(crate) fn of(value: &IngestValue<'_>) -> IngestRecord {
        IngestRecord { subject: subject(value.workspace), headers: headers(value) }
    }
}

/// An append of this shard waiting for its batched answer.
pub(crate) struct Waiting {
    write: Rc<Write>,
    /// Cleared when JetStream had the value already (see
    /// [`outcome`]).
    hand_on: Rc<Cell<bool>>,
    /// When it is refused without its answer: set at the first look after
    /// it was sent ([`give_up_overdue`], within [`LOOK_EVERY`]; no clock
    /// reading per append).
    give_up: Option<Instant>,
}

/// The appends of a shard answered in batches ([`AppendReply::Shard`]),
/// by the shard's number for each (shard-local).
#[derive(Default)]
pub(crate) struct Appends {
    next: Cell<u64>,
    waiting: RefCell<Ring<Waiting>>,
    looked: Cell<Option<Instant>>,
}

impl Appends {
    /// A new number for an append.
    pub(crate) fn token(&self) -> u64 {
        let token = self.next.get();
        self.next.set(token + 1);
        token
    }

    /// Keep `waiting` under `token`, the newest one [`Appends::token`]
    /// gave.
    fn insert(&self, token: u64, waiting: Waiting) {
        self.waiting.borrow_mut().push(token, waiting);
    }
}

/// The acknowledgement's outcome for the bridge's `answer` (`None`: none
/// will come), clearing `hand_on` when JetStream had the value already.
fn outcome(answer: Option<AppendOutcome>, hand_on: &Cell<bool>) -> Outcome {
    match answer {
        Some(Ok(appended)) => {
            hand_on.set(!appended.duplicate);
            Outcome::Done
        }
        Some(Err(IngestError::Unavailable(_))) | None => Outcome::Refused(ReasonCode::UNSPECIFIED_ERROR),
        Some(Err(_)) => Outcome::Refused(ReasonCode::QUOTA_EXCEEDED),
    }
}

/// The bridge's batched `answers` for this shard's appends
/// ([`fleetmq_nats_bridge::Event::Appended`]): each resolves its write.
pub(crate) fn answered(answers: Vec<(u64, AppendOutcome)>) {
    let found: Vec<_> = shard_state(|sc| {
        let mut waiting = sc.appends.waiting.borrow_mut();
        answers.into_iter().filter_map(|(token, answer)| Some((waiting.remove(token)?, answer))).collect()
    });
    for (waiting, answer) in found {
        waiting.write.resolve(outcome(Some(answer), &waiting.hand_on));
    }
}

/// Refuse the appends whose answer is overdue (see [`GIVE_UP_AFTER`]);
/// looks at most every [`LOOK_EVERY`].
pub(crate) fn give_up_overdue(now: Instant) {
    let overdue: Vec<Waiting> = shard_state(|sc| {
        let appends = &sc.appends;
        if appends.looked.get().is_some_and(|at| now < at + LOOK_EVERY) {
            return Vec::new();
        }
        appends.looked.set(Some(now));
        let wait = sc.node.borrow().as_ref().map_or(Duration::ZERO, |node| node.append_wait);
        let mut waiting = appends.waiting.borrow_mut();
        let mut due = Vec::new();
        for (token, w) in waiting.iter_mut() {
            match w.give_up {
                Some(at) if at <= now => due.push(token),
                Some(_) => {}
                None => w.give_up = Some(now + wait + GIVE_UP_AFTER),
            }
        }
        due.into_iter().filter_map(|token| waiting.remove(token)).collect()
    });
    for waiting in overdue {
        waiting.write.resolve(outcome(None, &waiting.hand_on));
    }
}

/// Whether a QoS 1/2 value on `topic` (with its workspace prefix) goes to
/// its workspace's session log: a persistent session of the cluster
/// wants it (see [`session_log::Interest`]). One read lock on the publish
/// path of QoS 1/2 values in cluster mode only; none when no persistent
/// session wants anything.
pub(crate) fn wants_log(topic: &str) -> bool {
    shard_state(|sc| {
        let node = sc.node.borrow();
        let interest = node.as_ref()?.bridge.interest().read().ok()?;
        Some(!interest.is_empty() && interest.wants(topic))
    })
    .unwrap_or(false)
}

/// Append `message` (QoS 1/2, from a client) to the ingest stream as
/// `ingest` records it and/or to the session log of `workspace`, its
/// acknowledgement waiting for the answer (both) through a
/// [`Write`](crate::store::Write) of `store` (joined with a retained write
/// of the same value, if any). `qos2`: a QoS 2 value of a persistent
/// session, its flow recorded in `mqtt-session-qos2` once the appends
/// landed (see `qos2.rs`; with nothing to append, only that). `held`: the write number its delivery
/// already waits for (a retained value); else a new one from
/// `next_write`. Returns the write number its delivery waits for (see
/// [`crate::shard::Shard::written`]), or `None` when the shard is not a
/// cluster's or there is nothing to append (delivered now).
pub(crate) fn append_ingest(
    message: &Arc<Message>,
    ingest: Option<IngestRecord>,
    workspace: Option<&str>,
    qos2: Option<Box<Qos2Flow>>,
    store: &crate::store::ShardStore,
    held: Option<u64>,
    next_write: impl FnOnce() -> u64,
) -> Option<u64> {
    let (node, shard) = shard_state(|sc| Some((sc.node.borrow().clone()?, sc.shard.borrow().clone()?)))?;
    let ingest = ingest.map(|IngestRecord { subject, headers }| {
        Box::new(StreamMessage { subject, headers, payload: message.payload.clone() })
    });
    let session_log = workspace.and_then(|workspace| {
        let encoded = session_log::encode(workspace, message, crate::store::unix_ms())?;
        let message = StreamMessage { subject: encoded.subject.into(), headers: encoded.headers, payload: encoded.payload };
        Some(Box::new(LogAppend { workspace: workspace.to_owned(), message }))
    });
    if ingest.is_none() && session_log.is_none() && qos2.is_none() {
        return None;
    }
    // The common case (the ingest stream only) is answered in batches
    // through the shard's mailbox; the others through a one-shot channel.
    let batched = shard
        .upgrade()
        .filter(|_| ingest.is_some() && session_log.is_none() && qos2.is_none())
        .map(|s| (s.id, shard_state(|sc| sc.appends.token())));
    let (reply, answer) = match batched {
        Some((shard, token)) => (AppendReply::Shard { shard, token }, None),
        None => {
            let (reply, answer) = tokio::sync::oneshot::channel();
            (AppendReply::Oneshot(reply), Some(answer))
        }
    };
    let request = Request::IngestAppend { ingest, session_log, qos2, wait: node.append_wait, reply };
    let write = store.expect_write(message.origin);
    // Not handed on when JetStream had it already: a flow another replica
    // recorded and stored (see `qos2.rs`), which handed it on then.
    let hand_on = Rc::new(Cell::new(true));
    let write_no = match held {
        Some(write_no) => write_no,
        None => {
            let write_no = next_write();
            let origin = message.origin;
            let hand_on = hand_on.clone();
            write.then(move |stored| {
                if let Some(shard) = shard.upgrade() {
                    shard.written(origin, write_no, stored && hand_on.get());
                }
            });
            write_no
        }
    };
    // Refused before NATS (the bridge counted and logged it): 0x97, as
    // a full stream.
    let sent = node.bridge.send(request).is_ok();
    if let (true, Some((_, token))) = (sent, batched) {
        shard_state(|sc| sc.appends.insert(token, Waiting { write, hand_on, give_up: None }));
        return Some(write_no);
    }
    glommio::spawn_local(async move {
        // glommio runs a task it spawns at once: the shard's state is
        // borrowed until the caller is done (the write's `then` delivers).
        futures_lite::future::yield_now().await;
        let outcome = match (sent, answer) {
            (true, Some(answer)) => outcome(answer.await.ok(), &hand_on),
            _ => Outcome::Refused(ReasonCode::QUOTA_EXCEEDED),
        };
        write.resolve(outcome);
    })
    .detach();
    Some(write_no)
}
