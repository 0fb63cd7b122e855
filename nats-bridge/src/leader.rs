//! The ingest connection follows the ingest stream's leader
//! (`store.kind = "jetstream"`, DESIGN.md §7).
//!
//! The ingest connection is made at start to the server that leads
//! `mqtt-ingest` (`shared.rs`): an append made at another server is
//! relayed to the leader and its acknowledgement back, which cost 15–20 %
//! of the QoS 1 ingest throughput (perf/RESULTS.md, session 45). The
//! leader moves (an election after a server was lost or restarted), and
//! the connection moves too (it leaves a silent server, or its server
//! dies): so every [`LOOK_EVERY`] the stream's leader is asked for, and
//! when it is another server of `cluster.nats_urls` than the one the
//! connection uses, the connection is moved there as `liveness.rs` moves
//! it away from a silent server (what waits for an acknowledgement is
//! sent again first, in order: see `appender.rs`). Logged (info) and
//! counted (`fleetmq_cluster_ingest_connection_moves_total`). A server
//! the connection left as silent less than [`SHUNNED_FOR`] ago is not
//! gone back to (a frozen server can still be named the leader of a
//! stream with one copy); a leader whose URL is not known (its server did
//! not answer when the replica started) has the URLs of
//! `cluster.nats_urls` not known yet asked again. Both are logged once
//! per leader.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::Context;
use tracing::{info, warn};

use crate::bridge::Shared;

/// How often the stream's leader is asked for.
pub(crate) const LOOK_EVERY: Duration = Duration::from_secs(5);

/// How long a server the ingest connection left as silent is not gone
/// back to.
const SHUNNED_FOR: Duration = Duration::from_secs(60);

/// The name of the server that leads `mqtt-ingest` (`None`: not known,
/// or a stream without a cluster).
pub(crate) async fn ingest_leader(state: &Context) -> Option<String> {
    let stream = state.get_stream(fleetmq_core::cluster::ingest::STREAM).await.ok()?;
    stream.cached_info().cluster.as_ref()?.leader.clone()
}

/// Move the ingest connection to the stream's leader whenever it is
/// elsewhere, until the bridge stops (see the module documentation).
pub(crate) async fn follow(shared: Arc<Shared>) {
    if shared.config.cluster.nats_urls.len() < 2 {
        return;
    }
    // The leader last logged as not moved to.
    let mut told: Option<String> = None;
    // The leader whose URL was last looked for: the URLs silent then are
    // asked again for a new leader only (one probe each per election).
    let mut looked_for: Option<String> = None;
    let mut tick = tokio::time::interval(LOOK_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    while !shared.stopping.load(Ordering::Acquire) {
        tokio::select! {
            _ = tick.tick() => {}
            () = shared.stop.notified() => break,
        }
        let client = &shared.ingest_client;
        if client.connection_state() != async_nats::connection::State::Connected {
            continue;
        }
        let Some(leader) = ingest_leader(&shared.state).await else { continue };
        let at = client.server_info().server_name.clone();
        if leader == at {
            continue;
        }
        let shunned = shared.ingest_left.lock().ok().and_then(|left| left.clone());
        if let Some((_, when)) = shunned.filter(|(name, when)| *name == leader && when.elapsed() < SHUNNED_FOR) {
            if told.as_ref() != Some(&leader) {
                info!(target: "bridge", at = %at, %leader, left_ago_s = when.elapsed().as_secs(),
                    "bridge: ingest connection not moved to the leader of mqtt-ingest: it left that server as silent less than {SHUNNED_FOR:?} ago");
                told = Some(leader);
            }
            continue;
        }
        // Not held across the probes: a copy, put back.
        let mut urls = shared.server_urls.lock().map(|u| u.clone()).unwrap_or_default();
        if looked_for.as_ref() != Some(&leader) {
            urls.ask_silent_again();
            looked_for = Some(leader.clone());
        }
        let url = crate::shared::url_of(&shared.config, &mut urls, &leader).await;
        if let Ok(mut known) = shared.server_urls.lock() {
            *known = urls;
        }
        let Some(url) = url else {
            if told.as_ref() != Some(&leader) {
                warn!(target: "bridge", at = %at, %leader,
                    "bridge: the leader of mqtt-ingest is none of cluster.nats_urls that answer: its appends are relayed there");
                told = Some(leader);
            }
            continue;
        };
        told = None;
        info!(target: "bridge", from = %at, to = %leader, %url, "bridge: ingest connection moving to the leader of mqtt-ingest");
        shared.status.stats.ingest_connection_moves.fetch_add(1, Ordering::Relaxed);
        shared.ingest_rotation.steer(&url);
        // Before the reconnect is asked for (see `appender.rs`).
        shared.ingest_moved.send_modify(|n| *n += 1);
        if tokio::time::timeout(Duration::from_secs(1), client.force_reconnect()).await.is_err() {
            warn!(target: "bridge", "bridge: the ingest connection took no reconnect request within 1 s");
        }
    }
}

