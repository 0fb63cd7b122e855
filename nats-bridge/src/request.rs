//! What shards ask of the bridge ([`Request`], answered through a oneshot)
//! and what the bridge tells them ([`Event`], through each shard's
//! mailbox), and the handler that carries out each request on the bridge
//! thread, as a task of its own.

use std::sync::Arc;
use std::time::Duration;

use fleetmq_core::cluster::membership::FenceReason;
use tokio::sync::oneshot;

use crate::bridge::Shared;
use crate::{ownership, retained, sweeper};

/// A request from a shard.
#[derive(Debug)]
#[non_exhaustive]
pub enum Request {
    /// Claim `client_id` for connection `conn` of this process in
    /// `mqtt-sessions` (create, or compare-and-set on the revision read).
    Claim {
        /// The client identifier.
        client_id: String,
        /// The connection, unique for this process's life.
        conn: u64,
        /// The CONNECT has Clean Start 1 (see [`OwnerRecord::clean_start`]).
        ///
        /// [`OwnerRecord::clean_start`]: fleetmq_core::cluster::records::OwnerRecord::clean_start
        clean_start: bool,
        /// The outcome.
        reply: oneshot::Sender<Result<Claimed, ClaimError>>,
    },
    /// Write a retained message (`record`: a [`RetainedRecord`]
    /// encoded) for `topic`, or clear it (`None`), in `mqtt-retained`
    /// (DESIGN.md §7). With a `reply`, the publisher's acknowledgement
    /// waits: answered once JetStream has it, or refused after `wait`; a
    /// refused write that lands anyway is undone (the topic gets
    /// `previous` back) unless another write followed it.
    ///
    /// [`RetainedRecord`]: fleetmq_core::cluster::retained::RetainedRecord
    RetainedPut {
        /// The topic, with its workspace prefix.
        topic: String,
        /// The record, or `None` to clear.
        record: Option<bytes::Bytes>,
        /// The topic's retained message before this write, as this
        /// replica knows it (`None`: none).
        previous: Option<Arc<fleetmq_core::session::Message>>,
        /// How long the publisher waits (`cluster.session_log_append_wait`).
        wait: Duration,
        /// The revision written, or why not; `None`: nobody waits (QoS
        /// 0, wills): a failure is logged and counted.
        reply: Option<oneshot::Sender<Result<u64, RetainedError>>>,
    },
    /// Append one accepted QoS 1/2 value to the ingest stream
    /// (`store.kind = "jetstream"`, DESIGN.md §7) and/or to its
    /// workspace's session log (a persistent session wants it, issue 24)
    /// within `wait`; its PUBACK/PUBREC waits for the answer, which comes
    /// once both took it (or either refused it). Each is retried with the
    /// same `Nats-Msg-Id` until JetStream takes it or the wait ends (see
    /// `ingest.rs` for the ID); a session log stream is created on its
    /// first append (see `session_log.rs`).
    IngestAppend {
        /// The ingest stream's message
        /// ([`fleetmq_core::cluster::ingest::subject`] and
        /// [`fleetmq_core::cluster::ingest::headers`]), or `None`.
        ingest: Option<Box<StreamMessage>>,
        /// The session log's message, or `None`.
        session_log: Option<Box<LogAppend>>,
        /// A QoS 2 value of a persistent session: its flow, recorded in
        /// `mqtt-session-qos2` with the value's message ID before the
        /// appends (the PUBREC waits for all; see `qos2.rs`), or `None`.
        qos2: Option<Box<Qos2Flow>>,
        /// `cluster.session_log_append_wait`.
        wait: Duration,
        /// Where the stream sequences, or why not, go.
        reply: AppendReply,
    },
    /// Delete `client_id`'s inbound QoS 2 flow `packet_id` from
    /// `mqtt-session-qos2` (its PUBREL came; the PUBCOMP waits for the
    /// answer), within `wait`.
    Qos2Release {
        /// The flow.
        flow: Box<Qos2Flow>,
        /// `cluster.session_log_append_wait`.
        wait: Duration,
        /// Deleted, or why not.
        reply: oneshot::Sender<Result<(), String>>,
    },
    /// Read the packet identifiers of `client_id`'s open inbound QoS 2
    /// flows in `mqtt-session-qos2` (to take up a session another
    /// replica served), ascending.
    Qos2List {
        /// The client identifier.
        client_id: String,
        /// The identifiers, each with the message ID of its value (empty:
        /// nothing was appended for it), or why JetStream did not answer.
        reply: oneshot::Sender<Result<Vec<(u16, String)>, String>>,
    },
    /// Remove every inbound QoS 2 flow of `client_id` from
    /// `mqtt-session-qos2`: its session ended. Nobody waits.
    Qos2Purge {
        /// The client identifier.
        client_id: String,
    },
    /// Answered at once with the bridge's clock: measures the queue, the
    /// bridge's turn and the wake of the waiting task (no NATS involved).
    Ping {
        /// When the bridge answered.
        reply: oneshot::Sender<std::time::Instant>,
    },
    /// Store `client_id`'s will (`record`: a `WillRecord` encoded) in
    /// `mqtt-session-will`.
    WillPut {
        /// The client identifier.
        client_id: String,
        /// The record.
        record: bytes::Bytes,
        /// The CONNECT has Clean Start 1: a delayed will of another
        /// replica's connection with this client identifier, whose
        /// session this ends, is kept for the sweeper (see
        /// [`fleetmq_core::cluster::records::ended_will_key`]) rather than
        /// replaced.
        clean_start: bool,
        /// The revision written, or why not.
        reply: oneshot::Sender<Result<u64, String>>,
    },
    /// The connection that declared `client_id`'s will (stored at
    /// `revision`) ended with the will's delay still running: record when
    /// this replica sends it (`due_at_ms`, Unix milliseconds), so that the
    /// sweeper sends it then if this replica is gone by then.
    WillDelayed {
        /// The client identifier.
        client_id: String,
        /// The revision of the connection's will.
        revision: u64,
        /// When the will is due, Unix milliseconds.
        due_at_ms: u64,
        /// The revision rewritten, or why not (the will was replaced, or
        /// the store did not answer).
        reply: oneshot::Sender<Result<u64, String>>,
    },
    /// Delete `client_id`'s will if `revision` is still its latest.
    WillDelete {
        /// The client identifier.
        client_id: String,
        /// The revision of this connection's will.
        revision: u64,
    },
    /// Shard `shard` gained its first local subscriber of `filter`
    /// (`add`) or lost its last: the replica's entry in `mqtt-routes` is
    /// written when the first shard wants the filter and deleted after the
    /// last (see `routes.rs`). Taken in order on the bridge's own loop, so
    /// that one shard's changes of a filter apply in the order sent; may be
    /// sent with [`Bridge::send_quietly`](crate::Bridge::send_quietly)
    /// when nobody waits.
    Route {
        /// The filter as the shards keep it (workspace prefix; a shared
        /// subscription's whole `$share/<group>/<filter>`).
        filter: String,
        /// The shard, `0..shards`.
        shard: usize,
        /// Wanted (first subscriber) or not (last one gone).
        add: bool,
        /// Hears the revision of the put once the entry is in the bucket
        /// (at once when it already is), `None` when no shard wants the
        /// filter any more before that; dropped when the bridge stops.
        landed: Option<oneshot::Sender<Option<u64>>>,
    },
    /// `client_id`'s persistent session is now `record` (a
    /// [`SessionRecord`] encoded), or ended (`None`), in
    /// `mqtt-session-state` (see `session_state.rs`). Taken in order on
    /// the bridge's own loop; one write in flight per client identifier,
    /// the newest record written next.
    ///
    /// [`SessionRecord`]: fleetmq_core::cluster::sessions::SessionRecord
    SessionPut {
        /// The client identifier.
        client_id: String,
        /// The record, or `None` to delete it.
        record: Option<bytes::Bytes>,
        /// Hears `true` once this record (or a newer one) is in the
        /// bucket, `false` when the bridge stops first.
        landed: Option<oneshot::Sender<bool>>,
    },
    /// Read `client_id`'s record in `mqtt-session-state` (to take up a
    /// session another replica served).
    SessionGet {
        /// The client identifier.
        client_id: String,
        /// The record's bytes (`None`: no session), or why JetStream did
        /// not answer.
        reply: oneshot::Sender<Result<Option<bytes::Bytes>, String>>,
    },
    /// `client_id`'s cursor is now `record` (a [`CursorRecord`] encoded),
    /// or gone with its session (`None`), in `mqtt-session-cursor`: as
    /// [`Request::SessionPut`], one write in flight per client
    /// identifier, the newest written next.
    ///
    /// [`CursorRecord`]: fleetmq_core::cluster::cursor::CursorRecord
    CursorPut {
        /// The client identifier.
        client_id: String,
        /// The record, or `None` to delete it.
        record: Option<bytes::Bytes>,
        /// Hears `true` once this record (or a newer one) is in the
        /// bucket, `false` when the bridge stops first: a QoS 2 PUBLISH
        /// or PUBREL to the session waits for it (DESIGN.md §7).
        landed: Option<oneshot::Sender<bool>>,
    },
    /// Read `client_id`'s cursor in `mqtt-session-cursor` (to take up a
    /// session another replica served).
    CursorGet {
        /// The client identifier.
        client_id: String,
        /// The record's bytes (`None`: none), or why JetStream did not
        /// answer.
        reply: oneshot::Sender<Result<Option<bytes::Bytes>, String>>,
    },
    /// Follow `workspace`'s session log on this replica (at most one tail
    /// per workspace and process; later requests do nothing): every shard
    /// hears [`Event::LogValues`], first with no value and the sequence
    /// the tail starts after, then with every value appended, in order.
    LogTail {
        /// The workspace.
        workspace: String,
    },
    /// Read up to `max` values of `workspace`'s session log from sequence
    /// `from` on, with batched direct gets (no consumer).
    LogRead {
        /// The workspace.
        workspace: String,
        /// The first sequence wanted.
        from: u64,
        /// Values at most.
        max: usize,
        /// The values read, or why not.
        reply: oneshot::Sender<Result<LogBatch, String>>,
    },
    /// Give `client_id` up if the claim at `revision` is still the latest.
    /// Off every CONNECT's path: held while claims are in flight, up to
    /// 1 s (see `releases.rs`), so may be sent with
    /// [`Bridge::send_quietly`](crate::Bridge::send_quietly).
    Release {
        /// The client identifier.
        client_id: String,
        /// The revision of this replica's claim.
        revision: u64,
    },
}

/// An inbound QoS 2 flow of a persistent session
/// ([`fleetmq_core::cluster::qos2`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Qos2Flow {
    /// The publishing client's identifier.
    pub client_id: String,
    /// The PUBLISH's packet identifier, 1..=65,535.
    pub packet_id: u16,
    /// The message ID the flow was recorded with at the replica the
    /// session left (`Qos2List`): the PUBLISH sent again there is
    /// appended again under that ID, which JetStream drops when the first
    /// append landed ([`Appended::duplicate`]); `None` for a new flow.
    pub message_id: Option<String>,
}

/// One message to append to a stream: `Nats-Msg-Id` is the bridge's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamMessage {
    /// The subject.
    pub subject: std::borrow::Cow<'static, str>,
    /// The headers, `Nats-Msg-Id` excepted.
    pub headers: fleetmq_core::cluster::ingest::Headers,
    /// The payload.
    pub payload: bytes::Bytes,
}

impl StreamMessage {
    /// The bytes it counts against [`crate::INGEST_WAITING_BYTES`]: its
    /// subject, headers and payload.
    pub fn size(&self) -> usize {
        crate::ingest::size(&self.subject, &self.headers, &self.payload)
    }
}

/// A value for a workspace's session log
/// ([`fleetmq_core::cluster::session_log::encode`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogAppend {
    /// The workspace (`""` or `"default"`: the default one): its stream
    /// is [`fleetmq_core::cluster::session_log::stream`].
    pub workspace: String,
    /// The message.
    pub message: StreamMessage,
}

/// One value of a session log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogEntry {
    /// Its sequence in the log.
    pub seq: u64,
    /// The value ([`fleetmq_core::cluster::session_log::decode`]d), its
    /// [`Message::stored`](fleetmq_core::session::Message::stored) the
    /// sequence.
    pub message: Arc<fleetmq_core::session::Message>,
}

/// What a [`Request::LogRead`] found.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LogBatch {
    /// The values, in order.
    pub values: Vec<LogEntry>,
    /// The log had nothing after these when it was read (the server said
    /// no message was pending past the batch, or none at or after its
    /// start).
    pub end: bool,
}

/// What a [`Request::IngestAppend`] is answered: where it landed, or
/// why not.
pub type AppendOutcome = Result<Appended, IngestError>;

/// Where the answer to a [`Request::IngestAppend`] goes.
#[derive(Debug)]
pub enum AppendReply {
    /// A one-shot channel (the requester awaits it).
    Oneshot(oneshot::Sender<AppendOutcome>),
    /// An [`Event::Appended`] to shard `shard`, carrying `token` (the
    /// shard's number for the append). The answers of one wake-up of the
    /// bridge go to a shard together: one mailbox push and one wake for
    /// all of them, where a one-shot channel costs a wake (and the
    /// shard a task) per value. Taken by the ingest pipeline
    /// (`appender.rs`: the ingest stream only, the common case of
    /// `store.kind = "jetstream"`); an answer that never comes (the
    /// bridge stopped) is for the shard to give up on after its wait.
    Shard {
        /// The shard's index.
        shard: usize,
        /// The shard's number for the append.
        token: u64,
    },
}

/// Where an [`Request::IngestAppend`] landed: each stream's sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Appended {
    /// In the ingest stream.
    pub ingest: Option<u64>,
    /// In the session log.
    pub session_log: Option<u64>,
    /// JetStream had a message of this ID already in every stream it went
    /// to (an append of a flow another replica recorded,
    /// [`Qos2Flow::message_id`], that landed there; or one of another
    /// connection of the same ID that landed first): the value was
    /// stored, and is handed on, by whoever appended it first.
    pub duplicate: bool,
}

/// Why a retained write was refused (see [`Request::RetainedPut`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RetainedError {
    /// JetStream did not take it within the wait (MQTT 5: PUBACK or
    /// PUBREC 0x80 Unspecified error).
    #[error("not stored: {0}")]
    Unavailable(String),
    /// The record does not fit the server's `max_payload` (MQTT 5: 0x97
    /// Quota exceeded).
    #[error("a record of {size} bytes does not fit: at most {limit} bytes (the NATS max_payload less 512 for the write's headers)")]
    TooLarge {
        /// The record's size, bytes.
        size: usize,
        /// The largest record that fits: the server's `max_payload` less
        /// the room kept for the write's headers, bytes.
        limit: usize,
    },
}

/// Why an ingest append was refused (see [`Request::IngestAppend`]); the
/// publisher's PUBACK/PUBREC is refused with the reason code each names
/// (MQTT 3.1.1: the connection is closed after what came before).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum IngestError {
    /// JetStream did not take it within `cluster.session_log_append_wait`
    /// (MQTT 5: 0x80 Unspecified error). It may still land.
    #[error("not in the ingest stream within the wait: {0}")]
    Unavailable(String),
    /// The stream is full (`store.max_bytes`, discard new) (MQTT 5: 0x97
    /// Quota exceeded).
    #[error("the ingest stream is full: {0}")]
    Full(String),
    /// Not queued: [`crate::INGEST_WAITING_MAX`] appends or
    /// [`crate::INGEST_WAITING_BYTES`] already wait for NATS, or the
    /// bridge's queue is full (MQTT 5: 0x97 Quota exceeded).
    #[error("not queued for NATS: {0}")]
    Queue(String),
    /// The value with its headers does not fit one NATS message (the
    /// server's `max_payload`), so no stream can take it (MQTT 5: 0x97
    /// Quota exceeded), at once.
    #[error("a value of {size} bytes with its headers does not fit the NATS max_payload of {limit} bytes")]
    TooLarge {
        /// The message's size as NATS counts it (headers and payload), bytes.
        size: usize,
        /// The server's `max_payload`, bytes.
        limit: usize,
    },
    /// Its headers (the MQTT 5 user properties, mostly) exceed what a
    /// JetStream stream stores with a message (MQTT 5: 0x97 Quota
    /// exceeded), at once.
    #[error("the value's headers take {size} bytes, more than the {limit} JetStream stores with a message")]
    HeadersTooLarge {
        /// The header block's size, bytes.
        size: usize,
        /// JetStream's limit, bytes.
        limit: usize,
    },
}

/// A claim that landed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claimed {
    /// The revision of the claim in `mqtt-sessions`: a later revision by
    /// another replica takes the client identifier over.
    pub revision: u64,
    /// The replica that owned the client identifier before, when another
    /// and known (read from the bucket).
    pub previous: Option<String>,
    /// Another process (replica) held the client identifier's entry
    /// before this claim, as far as this replica saw (its watch, or a
    /// read); or the client identifier has a session record in
    /// `mqtt-session-state` that another process wrote (as the watch
    /// brought it: a gone replica's session whose claim was swept).
    pub moved: bool,
}

/// Why a claim did not land.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ClaimError {
    /// This replica is fenced.
    #[error("replica fenced")]
    Fenced,
    /// JetStream did not take the claim.
    #[error("store unavailable: {0}")]
    Unavailable(String),
}

/// An event for a shard.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Event {
    /// Answers to [`Request::IngestAppend`]s sent with
    /// [`AppendReply::Shard`] to this shard: (token, outcome) each, in no
    /// particular order.
    Appended(Vec<(u64, AppendOutcome)>),
    /// The replica fenced: close every connection (MQTT 5: DISCONNECT
    /// 0x8B) and refuse CONNECT until [`Event::Unfenced`].
    Fenced(FenceReason),
    /// The replica serves again.
    Unfenced,
    /// Publish the will of a connection of a stopped, fenced or gone
    /// replica (this replica holds the leader lock and sends it once).
    PublishWill {
        /// The will, its topic with the workspace prefix.
        will: fleetmq_core::packet::Will,
    },
    /// A retained message changed (any replica's write, this one's
    /// included), at `revision` of `mqtt-retained`: apply it in that order
    /// (an empty payload clears the topic).
    Retained {
        /// The bucket revision: the sequence of the change.
        revision: u64,
        /// The message (empty payload: cleared).
        message: Arc<fleetmq_core::session::Message>,
    },
    /// Another replica claimed `client_id` at `revision`: a connection
    /// with that identifier here whose claim is older is taken over (MQTT
    /// 5: DISCONNECT 0x8E).
    TakenOver {
        /// The client identifier.
        client_id: String,
        /// The revision of the other replica's claim.
        revision: u64,
        /// The replica that claimed it.
        replica: String,
        /// The claim's CONNECT had Clean Start 1: the session ended here,
        /// and a delayed will waiting here is sent at once (MQTT 5
        /// §3.1.2.5); else the session goes on there and the will is not
        /// sent `[MQTT-3.1.3-9]`.
        clean_start: bool,
    },
    /// The live peer replicas changed (a member joined, left, restarted or
    /// was taken for gone): the whole list, this replica excluded. The
    /// mesh links to each (DESIGN.md §11).
    Peers(Arc<[fleetmq_core::cluster::peers::Peer]>),
    /// Values of `workspace`'s session log as this replica's tail reads
    /// them: every value of sequence in (the previous event's `through`,
    /// `through`], in order (the first event of a tail has none: it
    /// starts after `through`).
    LogValues {
        /// The workspace.
        workspace: Arc<str>,
        /// The tail has read every value up to this sequence.
        through: u64,
        /// The values.
        values: Arc<[LogEntry]>,
    },
    /// Other replicas' entries of `mqtt-routes` changed, in bucket order
    /// (the start sends every entry present). A peer taken for gone has
    /// its routes removed here too.
    Routes(Arc<[fleetmq_core::cluster::peers::RouteChange]>),
    /// Every event sent to the shard before this one is taken: the shard
    /// says so ([`Applied::shard_done`]). Sent after the changes of a
    /// route announce (see [`Bridge::announced`](crate::Bridge::announced)).
    Applied(Arc<Applied>),
    /// This replica's delete of its entry for `filter` landed at
    /// `revision` of `mqtt-routes` (the last shard that wanted it gets
    /// this): announce it to the peers over the mesh (nobody waits).
    RouteDeleted {
        /// The filter.
        filter: String,
        /// The delete's revision.
        revision: u64,
    },
}

/// What the shards still have to take before a route announce is applied
/// everywhere: the last one resolves the waiter.
#[derive(Debug)]
pub struct Applied {
    left: std::sync::atomic::AtomicUsize,
    done: std::sync::Mutex<Option<oneshot::Sender<()>>>,
}

/// Two countdowns are equal when they are the same one.
impl PartialEq for Applied {
    fn eq(&self, other: &Self) -> bool {
        std::ptr::eq(self, other)
    }
}

impl Eq for Applied {}

impl Applied {
    /// A countdown of `shards`, resolving `done` at zero.
    pub(crate) fn new(shards: usize, done: oneshot::Sender<()>) -> Arc<Applied> {
        Arc::new(Applied { left: std::sync::atomic::AtomicUsize::new(shards), done: std::sync::Mutex::new(Some(done)) })
    }

    /// One shard took every event before this one.
    pub fn shard_done(&self) {
        if self.left.fetch_sub(1, std::sync::atomic::Ordering::AcqRel) == 1 {
            if let Some(done) = self.done.lock().unwrap_or_else(|e| e.into_inner()).take() {
                let _ = done.send(());
            }
        }
    }
}

/// Carry out `request` (a task of its own on the bridge thread) and count
/// it finished.
pub(crate) async fn handle(shared: Arc<Shared>, request: Request, ticket: Option<crate::Ticket>) {
    match request {
        Request::Claim { client_id, conn, clean_start, reply } => {
            let outcome = if shared.status.is_fenced() {
                Err(ClaimError::Fenced)
            } else {
                ownership::claim(&shared, &client_id, (conn, clean_start), &|| reply.is_closed()).await
            };
            shared.claims_in_flight.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
            // Nobody waits any more (the CONNECT was refused past its
            // budget): the claim that landed is given up again.
            if let Err(Ok(claimed)) = reply.send(outcome) {
                ownership::release(&shared, &client_id, claimed.revision).await;
            }
        }
        Request::Release { client_id, revision } => ownership::release(&shared, &client_id, revision).await,
        Request::WillPut { client_id, record, clean_start, reply } => {
            // A will whose CONNECT was refused meanwhile is deleted again:
            // no will for a refused device (DESIGN.md §6).
            if let Err(Ok(revision)) = reply.send(sweeper::put_will(&shared, &client_id, record, clean_start).await) {
                let _ = sweeper::delete_will(&shared, &client_id, revision).await;
            }
        }
        Request::WillDelayed { client_id, revision, due_at_ms, reply } => {
            let _ = reply.send(sweeper::will_delayed(&shared, &client_id, revision, due_at_ms).await);
        }
        Request::WillDelete { client_id, revision } => {
            if let Err(e) = sweeper::delete_will(&shared, &client_id, revision).await {
                tracing::debug!(target: "cluster", %client_id, error = %e, "cluster: will not deleted (replaced, or store unavailable)");
            }
        }
        Request::SessionGet { client_id, reply } => {
            let got = crate::patience::patiently(&shared, &reply, || crate::session_state::get(&shared, &client_id)).await;
            let _ = reply.send(got);
        }
        Request::CursorGet { client_id, reply } => {
            let got = crate::patience::patiently(&shared, &reply, || crate::cursors::get(&shared, &client_id)).await;
            let _ = reply.send(got);
        }
        Request::LogRead { workspace, from, max, reply } => {
            let started = std::time::Instant::now();
            let outcome = crate::session_log::read(&shared, &workspace, from, max).await;
            shared.status.stats.record(crate::OpKind::Session, started.elapsed());
            let _ = reply.send(outcome);
        }
        // Taken by the bridge's loop itself (`routes::request`,
        // `session_state::request`).
        Request::Route { .. } | Request::SessionPut { .. } | Request::CursorPut { .. } | Request::LogTail { .. } => {}
        Request::IngestAppend { ingest, session_log, qos2, wait, reply } => {
            let started = std::time::Instant::now();
            let outcome = crate::ingest::append_both(&shared, ingest, session_log, qos2, wait).await;
            drop(ticket);
            shared.status.stats.record(crate::OpKind::Ingest, started.elapsed());
            if let Err(e) = &outcome {
                crate::ingest::refused(&shared, e);
            }
            shared.answer_append(reply, outcome);
        }
        Request::Qos2Release { flow, wait, reply } => {
            let started = std::time::Instant::now();
            let outcome = crate::qos2::release(&shared, &flow.client_id, flow.packet_id, wait).await;
            shared.status.stats.record(crate::OpKind::Session, started.elapsed());
            let _ = reply.send(outcome);
        }
        Request::Qos2List { client_id, reply } => {
            let got = crate::patience::patiently(&shared, &reply, || crate::qos2::list(&shared, &client_id)).await;
            let _ = reply.send(got);
        }
        Request::Qos2Purge { client_id } => crate::qos2::purge(&shared, &client_id, Duration::from_secs(10)).await,
        Request::Ping { reply } => {
            let _ = reply.send(std::time::Instant::now());
        }
        Request::RetainedPut { topic, record, previous, wait, reply } => {
            let started = std::time::Instant::now();
            let put = retained::Put { topic, record, previous, wait, waited: reply.is_some() };
            let outcome = retained::put(&shared, &put, ticket).await;
            shared.status.stats.record(crate::OpKind::Retained, started.elapsed());
            if let Err(e) = &outcome {
                retained::failed(&shared, &put, e);
            }
            if let Some(reply) = reply {
                let _ = reply.send(outcome);
            }
        }
    }
    shared.status.stats.finished();
}
