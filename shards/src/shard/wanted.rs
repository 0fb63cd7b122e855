//! The filters this shard's sessions subscribe to, as `mqtt-routes` must
//! say (cluster mode only; DESIGN.md §4, §10, issue 25).
//!
//! Each shard counts its sessions per filter as subscribed (workspace
//! prefix; a shared subscription's whole `$share/<group>/<filter>`, counted
//! on the member's shard, whichever shard owns the group) and tells the
//! bridge when a filter gains its first or loses its last one here; the
//! bridge keeps one entry per filter for the replica (see
//! `fleetmq_nats_bridge` `routes.rs`).
//!
//! The SUBACK of a SUBSCRIBE that needs a route written waits for it, at
//! most [`ROUTE_WAIT`], the way a retained PUBACK waits for
//! `mqtt-retained`: a [`Write`](crate::store::Write) of the shard's store
//! holds it, in order with the connection's other acknowledgements, and a
//! task resolves it when the bridge answers or the wait is over (then the
//! SUBACK goes anyway and `fleetmq_routes_late_total` counts it). Once
//! the write landed, the filter is announced over the mesh (protocol
//! version 3) to each peer whose link is up, and the SUBACK waits for
//! each one's answer too, within the same [`ROUTE_WAIT`]: the peer
//! applied the route on all of its shards, so a value published there
//! once the client holds its SUBACK reaches it [MQTT-4.5.0-1] (without
//! it, a peer learns the route from its watch of `mqtt-routes` a few
//! milliseconds later, and a value published meanwhile went to nobody
//! here). A peer whose link is down is not waited for (values for this
//! replica wait in its buffer, DESIGN.md §6); one linked with an older
//! version learns it from its watch, as before. A subscription to a
//! filter already written here sends its SUBACK at once.
//! Alone nothing of this runs (one branch per SUBSCRIBE).

use std::cell::Cell;
use std::rc::Rc;
use std::time::{Duration, Instant};

use bytestring::ByteString;
use tokio::sync::oneshot;

use super::{Shard, Slot, State};
use crate::store::Outcome;

/// How long a SUBACK waits for its route (DESIGN.md §10).
pub(crate) const ROUTE_WAIT: Duration = Duration::from_secs(2);

/// One filter wanted here.
pub(super) struct Want {
    /// Subscriptions to it on this shard.
    count: u32,
    /// The bridge said the replica's entry is written.
    landed: Rc<Cell<bool>>,
}

/// What a SUBACK waits for.
pub(super) enum RouteWait {
    /// A route: the bridge's answer (the put's revision), where to note
    /// it, and the filter (to announce it over the mesh).
    Route(oneshot::Receiver<Option<u64>>, Rc<Cell<bool>>, ByteString),
    /// The session's record in `mqtt-session-state` (true: written).
    Saved(oneshot::Receiver<bool>),
    /// Its workspace's session log tail started (a new session's position
    /// is where it starts, see `session_log.rs`).
    LogStarted(oneshot::Receiver<bool>),
}

impl Shard {
    /// Cluster mode: a session here subscribed to `filter` (`fresh`: it
    /// had no such subscription before). A route to wait for is pushed to
    /// `waits` unless the filter is written already.
    pub(super) fn want_route(&self, st: &mut State, filter: &ByteString, fresh: bool, waits: &mut Vec<RouteWait>) {
        let want = st.wanted.entry(filter.clone()).or_insert_with(|| Want { count: 0, landed: Rc::new(Cell::new(false)) });
        if fresh {
            want.count += 1;
        }
        if want.count == 0 {
            st.wanted.remove(filter);
            return;
        }
        if want.landed.get() {
            return;
        }
        // The first here, or one that is not written yet: ask (a second
        // ask for one filter is idempotent, and answered when it lands).
        let (landed, answer) = oneshot::channel();
        if crate::cluster::want_route(filter, self.id, true, Some(landed)) {
            waits.push(RouteWait::Route(answer, want.landed.clone(), filter.clone()));
        }
    }

    /// Cluster mode: a session here no longer subscribes to `filter`.
    pub(super) fn unwant_route(&self, st: &mut State, filter: &ByteString) {
        let Some(want) = st.wanted.get_mut(filter) else { return };
        want.count = want.count.saturating_sub(1);
        if want.count == 0 {
            st.wanted.remove(filter);
            crate::cluster::want_route(filter, self.id, false, None);
        }
    }

    /// Cluster mode: the shard's cluster task started (its node is known):
    /// what the shard wanted before (sessions restored from the local
    /// store) is told to the bridge now.
    pub(crate) fn announce_routes(&self) {
        let st = self.state.borrow();
        for (filter, want) in st.wanted.iter().filter(|(_, w)| w.count > 0) {
            let (landed, answer) = oneshot::channel();
            if crate::cluster::want_route(filter, self.id, true, Some(landed)) {
                let noted = want.landed.clone();
                glommio::spawn_local(async move {
                    if matches!(answer.await, Ok(Some(_))) {
                        noted.set(true);
                    }
                })
                .detach();
            }
        }
    }

    /// The SUBACK of the packet of the session on `slot` being handled
    /// waits for `waits` (at most [`ROUTE_WAIT`]).
    pub(super) fn subscribed_after_routes(&self, st: &State, slot: Slot, waits: Vec<RouteWait>) {
        let Some(client) = st.clients.get(slot as usize) else { return };
        let write = self.store.expect_write(client.key);
        glommio::spawn_local(async move {
            // glommio runs a task it spawns at once: the shard's state is
            // borrowed until the caller is done.
            futures_lite::future::yield_now().await;
            if !routes_ready(waits).await {
                crate::cluster::route_late();
            }
            write.resolve(Outcome::Done);
        })
        .detach();
    }
}

/// Routes (and session records) a packet's answer waits for: a SUBACK,
/// or the CONNACK of a session taken up from another replica.
#[derive(Default)]
pub(crate) struct RouteWaits(pub(super) Vec<RouteWait>);

impl RouteWaits {
    /// Nothing to wait for.
    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Wait (at most [`ROUTE_WAIT`]) until each route is written and
    /// announced to the peers linked in version 3 (see the module
    /// documentation); a wait past it is counted in
    /// `fleetmq_routes_late_total`.
    pub(crate) async fn ready(self) {
        if !routes_ready(self.0).await {
            crate::cluster::route_late();
        }
    }
}

/// Wait for `waits` within [`ROUTE_WAIT`]: each route written, then
/// announced to the peers linked in version 3 and applied by them. False
/// when the time ran out first.
async fn routes_ready(waits: Vec<RouteWait>) -> bool {
    let deadline = Instant::now() + ROUTE_WAIT;
    let mut late = false;
    let mut peers = Vec::new();
    for wait in waits {
        let left = deadline.saturating_duration_since(Instant::now());
        let (answer, noted, filter) = match wait {
            RouteWait::Route(answer, noted, filter) => (answer, noted, filter),
            RouteWait::Saved(answer) | RouteWait::LogStarted(answer) => {
                late |= within(left, answer).await.is_none();
                continue;
            }
        };
        match within(left, answer).await {
            Some(Ok(Some(revision))) => {
                noted.set(true);
                // The peers linked with version 3 apply it now, not when
                // their watch brings it.
                peers.extend(crate::cluster::announce_route(&filter, revision, true));
            }
            // Unsubscribed meanwhile, or the bridge stopped.
            Some(_) => {}
            None => late = true,
        }
    }
    for applied in peers {
        let left = deadline.saturating_duration_since(Instant::now());
        // Err: the link went down meanwhile (not waited for).
        late |= within(left, applied).await.is_none();
    }
    !late
}

/// `future`'s output, or `None` when `left` runs out first.
async fn within<T>(left: Duration, future: impl std::future::Future<Output = T>) -> Option<T> {
    futures_lite::future::or(async { Some(future.await) }, async {
        glommio::timer::sleep(left).await;
        None
    })
    .await
}
