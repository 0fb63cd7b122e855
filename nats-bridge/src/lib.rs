//! fleetmq-nats-bridge: every JetStream round trip of a replica passes
//! through one named OS thread running a tokio current-thread runtime and
//! async-nats (DESIGN.md §3, §4, §5, §14).
//!
//! - Shards send [`Request`]s over a bounded crossbeam channel paired with
//!   a wake signal, and await a oneshot completion; glommio wakers may be
//!   woken from this thread, so the shard's task wakes through its own
//!   eventfd.
//! - The bridge drains what is queued each turn and runs each request as a
//!   task of its own: many JetStream operations are in flight at once, and
//!   one slow round trip holds up only the request that waits on it.
//! - Events for the shards (fencing, a client identifier taken over by
//!   another replica) go to each shard's [`Mailbox`].
//! - Two NATS connections: the state connection (everything) and the lease
//!   connection (this replica's membership writes only).
//! - [`Bridge::stop`] drains what is queued, then joins the thread.
//!
//! Only this crate imports async-nats.

mod appender;
mod bridge;
mod budget;
mod config;
mod cursors;
mod expiry;
mod floor;
mod ingest;
mod leader;
mod liveness;
mod mailbox;
mod membership;
mod newest;
mod order;
mod ownership;
mod patience;
mod qos2;
mod releases;
mod request;
mod retained;
mod routes;
mod session_log;
mod session_state;
mod setup;
mod shared;
mod stats;
mod status;
mod sweeper;
mod watch;

pub use bridge::{AppendOutcome, AppendReply, Appended, Bridge, TURN_AT_LEAST, ClaimError, Claimed, ClusterStatus, Event, IngestError, LogAppend, LogBatch, LogEntry, Qos2Flow, Request, RetainedError, StartError, StreamMessage};
pub use budget::{Ticket, INGEST_WAITING_BYTES, INGEST_WAITING_MAX, RETAINED_UNDOS_BYTES, RETAINED_UNDOS_MAX, RETAINED_WAITING_BYTES, RETAINED_WAITING_MAX};
pub use config::BridgeConfig;
pub use mailbox::Mailbox;
pub use ownership::FLAP_DELAY;
pub use request::Applied;
pub use routes::Announce;
pub use stats::{BridgeStats, OpKind};
