//! `mqtt-session-cursor` (DESIGN.md §4; issue 24): this replica's writes
//! of its persistent sessions' cursors in their session logs, and the
//! read of a session's cursor at a take-up.
//!
//! Shards send a session's whole cursor when it changed (at most every
//! ~100 ms, and when its connection ends; `None` when the session ends),
//! written newest first, one write in flight per client identifier
//! ([`crate::newest`]). A replica taking the session up reads the last
//! one that landed: a QoS 1 value delivered after it may come again (at
//! least once); a QoS 2 PUBLISH or PUBREL waits until a cursor that lists
//! it landed (exactly once). A replica the session moved away from writes
//! none (the shard's reader is gone by then).

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::message::PublishMessage;
use bytes::Bytes;
use fleetmq_core::cluster::records::{bucket, client_key};
use tracing::debug;

use crate::bridge::Shared;

/// The first pause after a failed write; doubled up to 5 s.
const FIRST_BACKOFF: Duration = Duration::from_millis(100);

/// The cursors on their way to the bucket (bridge thread only).
pub(crate) struct Writer {
    shared: Arc<Shared>,
    keys: crate::newest::Newest,
}

/// The writer, shared by the bridge's loop and its write tasks.
pub(crate) type Writers = Rc<RefCell<Writer>>;

impl Writer {
    /// Nothing written yet.
    pub(crate) fn new(shared: Arc<Shared>) -> Writers {
        Rc::new(RefCell::new(Writer { shared, keys: Default::default() }))
    }
}

/// `client_id`'s cursor is now `record` (`None`: the session ended);
/// `landed` hears once it (or a newer one) is in the bucket.
pub(crate) fn request(writers: &Writers, client_id: String, record: Option<Bytes>, landed: Option<tokio::sync::oneshot::Sender<bool>>) {
    let start = writers.borrow_mut().keys.put(&client_id, record, landed);
    if start {
        tokio::task::spawn_local(write_key(writers.clone(), client_id));
    }
}

/// Write `client_id`'s newest cursor until the newest landed. Counted in
/// flight, so that the bridge's stop waits for it (at most its drain):
/// the cursors written when a stop closes the connections are the ones a
/// replica taking the sessions up reads. At the stop a write that fails
/// is not tried again.
async fn write_key(writers: Writers, client_id: String) {
    let shared = writers.borrow().shared.clone();
    let _in_flight = crate::stats::InFlight::new(&shared.status.stats);
    let mut backoff = FIRST_BACKOFF;
    loop {
        let Some((record, number)) = writers.borrow_mut().keys.next(&client_id, false) else { return };
        let subject = format!("$KV.{}.{}", bucket::SESSION_CURSOR, client_key(&client_id));
        let publish = match record {
            Some(record) => PublishMessage::build().payload(record),
            None => crate::setup::delete_marker(),
        };
        let started = std::time::Instant::now();
        let outcome = match shared.state.send_publish(subject, publish).await {
            Ok(ack) => ack.await.map(|_| ()).map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        shared.status.stats.record(crate::OpKind::Session, started.elapsed());
        match outcome {
            Ok(()) => {
                backoff = FIRST_BACKOFF;
                writers.borrow_mut().keys.ended(&client_id, number, true);
            }
            Err(e) if shared.stopping.load(Ordering::Acquire) => {
                debug!(target: "cluster", %client_id, error = %e, "cluster: cursor not written at the stop");
                writers.borrow_mut().keys.next(&client_id, true);
                return;
            }
            Err(e) => {
                debug!(target: "cluster", %client_id, error = %e, "cluster: cursor not written, trying again");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
        }
    }
}

/// `client_id`'s cursor as the bucket's leader holds it (`None`: none,
/// or deleted; see [`crate::setup::leader_value`]).
///
/// # Errors
/// JetStream did not answer (the text of its error).
pub(crate) async fn get(shared: &Shared, client_id: &str) -> Result<Option<Bytes>, String> {
    crate::setup::leader_value(&shared.cursors, &client_key(client_id)).await
}
