//! Appends to the ingest stream `mqtt-ingest` (`store.kind =
//! "jetstream"`, DESIGN.md §7) and to the session logs (issue 24, see
//! `session_log.rs`): one stream message per accepted QoS 1/2 PUBLISH
//! in each that takes it, whose PUBACK/PUBREC waits for JetStream's
//! acknowledgements.
//!
//! Pipelined: an append that goes to the ingest stream only (no
//! persistent session wants the value, no QoS 2 flow to record: the
//! common case) goes through one pipeline for all (`appender.rs`); any
//! other is a task of its own on the bridge thread (taken in batches
//! each wake-up, see `bridge.rs`). Either way thousands of
//! publish acknowledgements are in flight at once (async-nats' window is
//! 5,000) rather than one round trip at a time (notes/jetstream.md §3:
//! ~100–170k/s pipelined against ~10k/s awaited). What waits is bounded
//! by [`crate::INGEST_WAITING_MAX`] and [`crate::INGEST_WAITING_BYTES`].
//!
//! # The message ID
//! `Nats-Msg-Id` is `<instance>.i<n>`: `instance` the random 64-bit ID
//! of this broker process (hex, [`crate::BridgeConfig::instance`]) and
//! `n` a counter of the process's appends. It is unique per accepted
//! value (no two processes share an instance; the counter never repeats
//! within one), and stable across the bridge's retries: every attempt of
//! one append publishes the same ID, so a publish that timed out but
//! landed after all (notes/jetstream.md §2.3.4) and its retry are stored
//! once (within `store.ingest_duplicate_window`). It is deliberately not
//! the (client identifier, packet identifier) pair: MQTT reuses a packet
//! identifier as soon as its flow ends, often within milliseconds, while
//! the duplicate window is minutes long, so such a key would make
//! JetStream drop a real new value as a "duplicate" and acknowledge it.

use std::borrow::Cow;
use std::future::IntoFuture as _;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::context::{PublishAckFuture, PublishErrorKind};
use async_nats::jetstream::message::PublishMessage;
use async_nats::header::HeaderName;
use fleetmq_core::cluster::ingest::{may_repeat, Headers};
use bytes::Bytes;
use tokio::time::Instant;
use tracing::warn;

use crate::bridge::Shared;
use crate::order::Place;
use crate::request::{Appended, IngestError, LogAppend, Qos2Flow, StreamMessage};

/// A rejected append (no stream leader yet, NATS reconnecting) is tried
/// again after this pause, while its wait lasts.
const RETRY_PAUSE: Duration = Duration::from_millis(100);

/// Refusals logged at most once per this period.
const WARN_EVERY: Duration = Duration::from_secs(1);

/// What one attempt came to.
pub(crate) enum Fate {
    /// Stored, at this stream sequence; `true`: found a duplicate (an
    /// earlier attempt, or an earlier append of the same ID).
    Stored(u64, bool),
    /// The stream is full: no retry helps.
    Full(String),
    /// Not stored, or not known to be: try again while the wait lasts.
    Retry(String),
}

/// The bytes an append counts against [`crate::INGEST_WAITING_BYTES`]:
/// its subject, headers and payload.
pub(crate) fn size(subject: &str, headers: &Headers, payload: &Bytes) -> usize {
    subject.len() + payload.len() + headers.iter().map(|(n, v)| n.len() + v.len() + 4).sum::<usize>()
}

/// Append `ingest` to the ingest stream and `session_log` to its
/// workspace's session log (either may be absent), at once, within
/// `wait`; both messages carry one `Nats-Msg-Id` (see the module
/// documentation: each stream keeps its own duplicate window). A refusal
/// of either refuses the value.
///
/// With `qos2`, the flow is recorded in `mqtt-session-qos2` with that
/// message ID *before* the appends, within the same wait (not recorded
/// refuses the value too): a replica that takes the session up after
/// this one died at any point of the appends finds the flow, and the
/// PUBLISH its client sends again is appended again under the same ID
/// ([`Qos2Flow::message_id`]), stored once whether the first append
/// landed or not (DESIGN.md §7: exactly once whichever replica dies). A
/// refused value's flow is deleted again (best effort, also one appended
/// again for a take-up), so that its packet identifier, free once the
/// refusing PUBREC went out (MQTT 5 §4.3.3), is not taken up as that
/// flow.
///
/// # Errors
/// As [`append`]; the session log's stream not created or not as the
/// settings ask: [`IngestError::Unavailable`].
pub(crate) async fn append_both(
    shared: &Arc<Shared>,
    ingest: Option<Box<StreamMessage>>,
    session_log: Option<Box<LogAppend>>,
    qos2: Option<Box<Qos2Flow>>,
    wait: Duration,
) -> Result<Appended, IngestError> {
    // A flow another replica recorded keeps its ID (see above).
    let reopened = qos2.as_ref().and_then(|flow| flow.message_id.clone()).filter(|id| !id.is_empty());
    let id = reopened.unwrap_or_else(|| message_id(shared));
    let deadline = Instant::now() + wait;
    // Would be refused by every attempt until the deadline.
    for message in ingest.as_deref().into_iter().chain(session_log.as_deref().map(|l| &l.message)) {
        too_large(shared, message, &id)?;
    }
    if let Some(flow) = &qos2 {
        // Before the value is stored (see above), and before its PUBREC
        // (DESIGN.md §7).
        let recorded = if ingest.is_some() || session_log.is_some() { id.as_str() } else { "" };
        crate::qos2::open(shared, &flow.client_id, flow.packet_id, recorded, deadline).await.map_err(IngestError::Unavailable)?;
    }
    let appended = append_stored(shared, ingest.as_deref(), session_log.as_deref(), &id, deadline).await;
    if let (Err(_), Some(flow)) = (&appended, &qos2) {
        // Refused: the flow goes again. Its identifier is free (MQTT 5
        // §4.3.3): a new value under it must not be taken for this one
        // (stored under this ID, it could be dropped as a duplicate and
        // lost). A 3.1.1 client sends the value again after its
        // connection closed: a new flow, possibly a second copy if the
        // refused append landed late (at least once, never lost).
        let _ = crate::qos2::release(shared, &flow.client_id, flow.packet_id, FLOW_UNDO_WAIT).await;
    }
    appended
}

/// The headers of an append: `Nats-Msg-Id` `id` (the duplicate window's
/// key) and `properties`, appended, never inserted: a user property may
/// come more than once (MQTT 5 §3.3.2.3.7), each its own header.
pub(crate) fn header_map(id: &str, properties: &Headers) -> async_nats::HeaderMap {
    let mut headers = async_nats::HeaderMap::new();
    headers.insert(async_nats::header::NATS_MESSAGE_ID, id);
    for (name, value) in properties {
        let value = &**value;
        // The contract's names cost no allocation and no validation; a
        // name that comes once, one hash.
        match (name, may_repeat(name)) {
            (Cow::Borrowed(known), false) => headers.insert(HeaderName::from_static(known), value),
            (Cow::Borrowed(known), true) => headers.append(HeaderName::from_static(known), value),
            (Cow::Owned(other), false) => headers.insert(other.as_str(), value),
            (Cow::Owned(other), true) => headers.append(other.as_str(), value),
        }
    }
    headers
}

/// `subject` as async-nats takes it: a borrowed one (the default
/// workspace's) costs no allocation, and none is made again per attempt.
pub(crate) fn nats_subject(subject: Cow<'static, str>) -> async_nats::Subject {
    match subject {
        Cow::Borrowed(known) => async_nats::Subject::from_static(known),
        Cow::Owned(other) => async_nats::Subject::from(other),
    }
}

/// The size NATS counts for `message` published with the
/// `Nats-Msg-Id` `id`: its header block (`NATS/1.0\r\n`, a
/// `name: value\r\n` line each, `\r\n`) and its payload, bytes.
pub(crate) fn wire_size(message: &StreamMessage, id: &str) -> usize {
    header_size(message, id) + message.payload.len()
}

/// The size of `message`'s header block with the `Nats-Msg-Id` `id`
/// (see [`wire_size`]), bytes.
fn header_size(message: &StreamMessage, id: &str) -> usize {
    let line = |name: &str, value: &str| name.len() + value.len() + 4;
    12 + line("Nats-Msg-Id", id) + message.headers.iter().map(|(n, v)| line(n, v)).sum::<usize>()
}

/// The most header bytes JetStream stores with a message (nats-server
/// answers a larger block with error 10097, "header size exceeds maximum
/// allowed of 64k", to every attempt).
const STREAM_HEADERS_MAX: usize = 65_535;

/// Refuse `message` when no attempt would ever be taken: it cannot be one
/// NATS message (the server's `max_payload`), or its headers (MQTT 5
/// user properties, mostly) exceed what a stream stores
/// ([`STREAM_HEADERS_MAX`]).
///
/// # Errors
/// [`IngestError::TooLarge`].
pub(crate) fn too_large(shared: &Shared, message: &StreamMessage, id: &str) -> Result<(), IngestError> {
    let (size, limit) = (wire_size(message, id), shared.state_client.max_payload());
    if size > limit {
        return Err(IngestError::TooLarge { size, limit });
    }
    let headers = header_size(message, id);
    if headers > STREAM_HEADERS_MAX {
        return Err(IngestError::HeadersTooLarge { size: headers, limit: STREAM_HEADERS_MAX });
    }
    Ok(())
}

/// A new append's `Nats-Msg-Id` (see the module documentation).
pub(crate) fn message_id(shared: &Shared) -> String {
    format!("{}.i{}", shared.status.instance, shared.writes.fetch_add(1, Ordering::Relaxed))
}

/// How long a refused value's flow record is tried to be deleted.
const FLOW_UNDO_WAIT: Duration = Duration::from_secs(2);

/// The appends of [`append_both`] under `id` by `deadline`, counted.
async fn append_stored(
    shared: &Arc<Shared>,
    ingest: Option<&StreamMessage>,
    session_log: Option<&LogAppend>,
    id: &str,
    deadline: Instant,
) -> Result<Appended, IngestError> {
    let to_ingest = async {
        let Some(message) = ingest else { return Ok(None) };
        append(shared, (fleetmq_core::cluster::ingest::STREAM, message), id, deadline).await.map(Some)
    };
    let to_log = async {
        let Some(log) = session_log else { return Ok(None) };
        crate::session_log::ensure(shared, &log.workspace, deadline).await.map_err(IngestError::Unavailable)?;
        let stream = fleetmq_core::cluster::session_log::stream(&log.workspace);
        append(shared, (&stream, &log.message), id, deadline).await.map(Some)
    };
    let (ingest_seq, log_seq) = tokio::join!(to_ingest, to_log);
    let (ingest_seq, log_seq) = (ingest_seq?, log_seq?);
    // Stored before under this ID in every stream it went to: whoever
    // appended it first handed it on (or will) once its appends landed.
    // One stream new means that one never completed: handed on now.
    let duplicate = (ingest_seq.is_some() || log_seq.is_some()) && [ingest_seq, log_seq].into_iter().flatten().all(|(_, d)| d);
    let appended = Appended { ingest: ingest_seq.map(|(s, _)| s), session_log: log_seq.map(|(s, _)| s), duplicate };
    let stats = &shared.status.stats;
    if appended.ingest.is_some() {
        stats.ingest_appended.fetch_add(1, Ordering::Relaxed);
    }
    if appended.session_log.is_some() {
        stats.log_appended.fetch_add(1, Ordering::Relaxed);
    }
    Ok(appended)
}

/// Append `message` with the ID `id` by `deadline`; returns the stream
/// sequence, and whether JetStream had a message of that ID already.
///
/// # Errors
/// [`IngestError::Full`] when JetStream answered that the stream is full
/// (`store.max_bytes` reached: discard new); [`IngestError::Unavailable`]
/// when it did not take it by the deadline (it may still land; the client
/// is refused and sends it again: at least once).
///
/// `stream`: the stream's name. After an attempt to it failed, its
/// oldest append goes alone until one is stored, then the others in
/// order (`order.rs`): the stream keeps the order in which they were
/// made.
async fn append(shared: &Shared, (stream, message): (&str, &StreamMessage), id: &str, deadline: Instant) -> Result<(u64, bool), IngestError> {
    let mut why = String::new();
    let mut attempts = 0u32;
    let place = shared.orders.take(stream);
    // Every attempt's acknowledgement is awaited until the deadline: one
    // given up after `ANSWER_WAIT` may still come (NATS slow, not gone).
    let mut acks = futures_util::stream::FuturesUnordered::new();
    while Instant::now() < deadline && !shared.stopping.load(Ordering::Acquire) {
        if tokio::time::timeout_at(deadline, place.turn()).await.is_err() {
            if why.is_empty() {
                why = format!("older appends to {stream} not stored in time");
            }
            break;
        }
        attempts += 1;
        match attempt(shared, message, id, (deadline, &place), &mut acks).await {
            // A duplicate of this process's own earlier attempt is no
            // sign of an earlier store by another replica.
            Fate::Stored(sequence, duplicate) => {
                place.stored();
                return Ok((sequence, duplicate && attempts == 1));
            }
            Fate::Full(e) => return Err(IngestError::Full(e)),
            Fate::Retry(e) => {
                place.failed();
                why = e;
            }
        }
        let left = deadline.saturating_duration_since(Instant::now());
        tokio::time::sleep(RETRY_PAUSE.min(left)).await;
    }
    if why.is_empty() {
        why = "the broker is stopping".to_owned();
    }
    Err(IngestError::Unavailable(why))
}

/// One publish of the append `id`, and an acknowledgement of it or of an
/// earlier attempt (`acks`, kept across attempts: they carry the same ID,
/// stored once), by `deadline`, awaited [`crate::appender::ANSWER_WAIT`]
/// at most: unanswered that long, the attempt was lost with the server or
/// the stream's leader it went to (as the ingest pipeline's,
/// `appender.rs`), and it is a failure, after which the stream's appends
/// go in order (`order.rs`); a later answer to it still counts. An error
/// answer (no stream leader, a connection lost) is tried again with the
/// same ID; so is one sent before the state connection was forced away
/// from a silent server (see `liveness.rs`).
///
/// `place`: told once the attempt was handed to the connection (the next
/// append of the stream may go then, `order.rs`).
async fn attempt(
    shared: &Shared,
    message: &StreamMessage,
    id: &str,
    (deadline, place): (Instant, &Place),
    acks: &mut futures_util::stream::FuturesUnordered<<PublishAckFuture as std::future::IntoFuture>::IntoFuture>,
) -> Fate {
    use futures_util::StreamExt as _;
    let publish = PublishMessage::build().payload(message.payload.clone()).headers(header_map(id, &message.headers));
    let mut moved = shared.state_moved.subscribe();
    let published = shared.publish_by(&message.subject, publish, deadline).await;
    place.sent();
    match published {
        Ok(ack) => acks.push(ack.into_future()),
        Err(e) => return Fate::Retry(e),
    }
    let answer_by = deadline.min(Instant::now() + crate::appender::ANSWER_WAIT);
    loop {
        tokio::select! {
            acked = tokio::time::timeout_at(answer_by, acks.next()) => match acked {
                Ok(Some(Ok(ack))) => return Fate::Stored(ack.sequence, ack.duplicate),
                Ok(Some(Err(e))) if e.kind() == PublishErrorKind::Other && is_full(&e.to_string()) => return Fate::Full(e.to_string()),
                // Another attempt may still be answered.
                Ok(Some(Err(_))) if !acks.is_empty() => {}
                Ok(Some(Err(e))) => return Fate::Retry(e.to_string()),
                Ok(None) | Err(_) => return Fate::Retry("no acknowledgement from JetStream in time".to_owned()),
            },
            // Sent to a server the state connection left as silent: its
            // answer will not come (the same ID again is stored once).
            Ok(()) = moved.changed() => return Fate::Retry("the state connection left a silent server".to_owned()),
        }
    }
}

/// What JetStream's answer `answer` to a publish says (as async-nats
/// reads a publish acknowledgement: [`Fate::Retry`] for no responders, an
/// error answer other than the stream full, or one that is no answer).
pub(crate) fn fate_of(answer: &async_nats::Message) -> Fate {
    use async_nats::jetstream::{publish::PublishAck, response::Response};
    if answer.status == Some(async_nats::StatusCode::NO_RESPONDERS) {
        return Fate::Retry("no responders: the stream has no leader".to_owned());
    }
    if let Some(fate) = plain_ack(&answer.payload) {
        return fate;
    }
    match serde_json::from_slice::<Response<PublishAck>>(&answer.payload) {
        Ok(Response::Ok(ack)) => Fate::Stored(ack.sequence, ack.duplicate),
        Ok(Response::Err { error }) if is_full(&error.to_string()) => Fate::Full(error.to_string()),
        Ok(Response::Err { error }) => Fate::Retry(error.to_string()),
        Err(e) => Fate::Retry(format!("not a publish acknowledgement: {e}")),
    }
}

/// The common answer, `{"stream":"<name>","seq":<n>}` with maybe
/// `"duplicate":true` (and a domain), read without a JSON parser (a
/// tenth of the bridge's time at ~50k appends/s, perf/RESULTS.md session
/// 44); `None` for anything else (an error, another shape), which
/// [`fate_of`] parses.
fn plain_ack(payload: &[u8]) -> Option<Fate> {
    const SEQ: &[u8] = b"\",\"seq\":";
    if !payload.starts_with(b"{\"stream\":\"") || !payload.ends_with(b"}") || find(payload, b"\"error\"").is_some() {
        return None;
    }
    let at = find(payload, SEQ)? + SEQ.len();
    let digits = payload[at..].iter().take_while(|b| b.is_ascii_digit()).count();
    let sequence = std::str::from_utf8(&payload[at..at + digits]).ok()?.parse().ok()?;
    let duplicate = find(payload, b"\"duplicate\":true").is_some();
    Some(Fate::Stored(sequence, duplicate))
}

/// Where `needle` starts in `haystack` first.
fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// Whether the failure `why` of an append (a [`Fate::Retry`], or the
/// attempt's loss) is the stream's or the connection's, which the appends
/// after it meet too (no leader, JetStream unavailable, no answer), not
/// one of its own content: newer appends then wait for it (see
/// `appender.rs`, which keeps the stream in order).
pub(crate) fn transient(why: &str) -> bool {
    const MARKS: [&str; 6] = ["no responders", "temporarily unavailable", "503", "leader", "timed out", "no acknowledgement"];
    MARKS.iter().any(|mark| why.contains(mark))
}

/// Whether a JetStream publish error says the stream is full: with
/// discard new, nats-server answers "maximum bytes exceeded" (or
/// "maximum messages exceeded") as error 10077.
fn is_full(error: &str) -> bool {
    error.contains("maximum bytes exceeded") || error.contains("maximum messages exceeded")
}

/// Count a refused append by reason and log it at most once per
/// [`WARN_EVERY`] (with how many were not logged).
pub(crate) fn refused(shared: &Shared, error: &IngestError) {
    let stats = &shared.status.stats;
    match error {
        IngestError::Full(_) => stats.ingest_refused_full.fetch_add(1, Ordering::Relaxed),
        IngestError::Unavailable(_) => stats.ingest_refused_unavailable.fetch_add(1, Ordering::Relaxed),
        IngestError::Queue(_) => stats.ingest_refused_queue.fetch_add(1, Ordering::Relaxed),
        IngestError::TooLarge { .. } | IngestError::HeadersTooLarge { .. } => stats.ingest_refused_too_large.fetch_add(1, Ordering::Relaxed),
    };
    let Ok(mut warned) = shared.ingest_warned.lock() else { return };
    let now = std::time::Instant::now();
    if warned.0.is_some_and(|at| now.duration_since(at) < WARN_EVERY) {
        warned.1 += 1;
        return;
    }
    let unlogged = std::mem::take(&mut warned.1);
    warned.0 = Some(now);
    warn!(target: "cluster", %error, unlogged, "cluster: a QoS 1/2 publish was refused: not in the ingest stream");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(payload: &str, status: Option<async_nats::StatusCode>) -> async_nats::Message {
        async_nats::Message {
            subject: "_INBOX.x.1".into(),
            reply: None,
            payload: Bytes::from(payload.to_owned()),
            headers: None,
            status,
            description: None,
            length: payload.len(),
        }
    }

    #[test]
    fn a_publish_answer_reads_as_stored_full_or_try_again() {
        let stored = answer(r#"{"stream":"mqtt-ingest","seq":42,"duplicate":true}"#, None);
        assert!(matches!(fate_of(&stored), Fate::Stored(42, true)));
        let fresh = answer(r#"{"stream":"mqtt-ingest","seq":7}"#, None);
        assert!(matches!(fate_of(&fresh), Fate::Stored(7, false)));
        let domain = answer(r#"{"stream":"mqtt-ingest","domain":"hub","seq":9,"duplicate":true}"#, None);
        assert!(matches!(fate_of(&domain), Fate::Stored(9, true)));
        let spaced = answer(r#"{ "stream": "mqtt-ingest", "seq": 11 }"#, None);
        assert!(matches!(fate_of(&spaced), Fate::Stored(11, false)), "another shape: parsed as JSON");
        let full = answer(r#"{"error":{"code":400,"err_code":10077,"description":"maximum bytes exceeded"}}"#, None);
        assert!(matches!(fate_of(&full), Fate::Full(e) if e.contains("maximum bytes exceeded")));
        let no_leader = answer(r#"{"error":{"code":503,"err_code":10008,"description":"JetStream system temporarily unavailable"}}"#, None);
        assert!(matches!(fate_of(&no_leader), Fate::Retry(e) if e.contains("temporarily unavailable")));
        assert!(matches!(fate_of(&no_leader), Fate::Retry(e) if transient(&e)));
        let own = answer(r#"{"error":{"code":400,"err_code":10054,"description":"message size exceeds maximum allowed"}}"#, None);
        assert!(matches!(fate_of(&own), Fate::Retry(e) if !transient(&e)), "an append's own refusal holds no line");
        assert!(matches!(fate_of(&answer("", Some(async_nats::StatusCode::NO_RESPONDERS))), Fate::Retry(e) if e.contains("no responders")));
        assert!(matches!(fate_of(&answer("not json", None)), Fate::Retry(e) if e.contains("not a publish acknowledgement")));
    }

    proptest::proptest! {
        /// The fast read of an acknowledgement agrees with async-nats'
        /// JSON parse on every shape nats-server writes, and leaves any
        /// other bytes to it.
        #[test]
        fn the_fast_read_of_an_acknowledgement_agrees_with_the_json_parse(
            seq in proptest::prelude::any::<u64>(),
            duplicate in proptest::prelude::any::<bool>(),
            domain in proptest::option::of("[a-z]{1,8}"),
            noise in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..64),
        ) {
            use async_nats::jetstream::{publish::PublishAck, response::Response};
            let domain = domain.map(|d| format!(",\"domain\":\"{d}\"")).unwrap_or_default();
            let dup = if duplicate { ",\"duplicate\":true" } else { "" };
            let json = format!("{{\"stream\":\"mqtt-ingest\"{domain},\"seq\":{seq}{dup}}}");
            let Some(Fate::Stored(fast_seq, fast_dup)) = plain_ack(json.as_bytes()) else { panic!("{json}: not read") };
            let Ok(Response::Ok(ack)) = serde_json::from_str::<Response<PublishAck>>(&json) else { panic!("{json}: not JSON") };
            proptest::prop_assert_eq!((fast_seq, fast_dup), (ack.sequence, ack.duplicate));
            // Anything: no panic; read only when it is the plain shape.
            if let Some(Fate::Stored(..)) = plain_ack(&noise) {
                let plain = noise.starts_with(br#"{"stream":""#);
                proptest::prop_assert!(plain);
            }
        }
    }

    #[test]
    fn the_stream_full_answers_of_nats_server_are_recognised() {
        assert!(is_full("maximum bytes exceeded"));
        assert!(is_full("nats: error code 10077: maximum messages exceeded"));
        assert!(!is_full("no responders"));
    }
}
