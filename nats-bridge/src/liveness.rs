//! Noticing a frozen NATS server, and leaving it (DESIGN.md §5, §6 "one
//! NATS server lost").
//!
//! A NATS server that dies closes its sockets, and async-nats reconnects
//! to another server of the cluster at once. A server that is frozen
//! (SIGSTOP, a VM paused, a path that drops every packet) keeps the TCP
//! connection open and silent: async-nats' pings notice it only after
//! three unanswered ones (15 s at the bridge's 5 s interval), and before
//! that the membership lease (7T/6) or the store probe (15 s) fences the
//! replica, though the cluster's other servers serve. Measured before
//! this module: one of three servers frozen fenced every replica whose
//! connection used it after ~14 s.
//!
//! So each of the bridge's connections (the state connection, which
//! carries the requests, the session-log appends and the watches; the
//! lease connection, which carries the membership heartbeats; with
//! `store.kind = "jetstream"`, the ingest connection, which carries the
//! ingest stream's appends) sends itself an **echo** every [`echo_every`] (T/10): a
//! core NATS message to an inbox the same connection subscribes to,
//! which the server it is connected to answers alone (no JetStream, no
//! other server, no stream leader involved, so a frozen *other* server or
//! a leader election is not taken for this one's silence). When the
//! oldest unanswered echo is [`silence_bound`] old (T/2), the connection
//! is forced to reconnect (`Client::force_reconnect`), and goes to the
//! next server of its pool (`config::Rotation`): logged once per event
//! (warn), counted (`fleetmq_cluster_nats_reconnects_forced_total`), and
//! on the state and ingest connections the appends that wait for an
//! acknowledgement are sent again at once (same `Nats-Msg-Id`: stored
//! once, [`Shared::state_moved`], [`Shared::ingest_moved`]).
//!
//! # Why T/2
//! The replica fences when no heartbeat landed for 7T/6, counted from the
//! send time of the last one that did (sent at most T/10 before the
//! freeze). The silence is found at most T/2 + T/10 after the freeze (the
//! first unanswered echo leaves within T/10), the reconnect to a live
//! server takes milliseconds, and the next heartbeat leaves within T/10:
//! it lands about 0.7T after the freeze, leaving about 0.35T (3.5 s at the
//! default T = 10 s) for JetStream to elect a new leader of
//! `KV_mqtt-members` if the frozen server led it. Shorter would take a
//! slow server for a frozen one: DESIGN.md §6 promises full service up to
//! 2 s a round trip and no fence up to 6 s; at T/2 (5 s by default) a
//! round trip slower than that costs one reconnect, after which the bound
//! doubles (T, then 2T at most) until an echo comes back within T/2 again,
//! so a slow cluster is not left again and again.
//!
//! A connection whose pool holds one server only (one URL: a proxy, or a
//! service address without advertised servers) is never forced: a
//! reconnect would go back where it was. async-nats' pings stay the
//! bound there.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_nats::connection::State;
use futures_util::StreamExt;
use tokio::time::Instant;
use tracing::{debug, warn};

use crate::bridge::Shared;

/// Which of the bridge's connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Connection {
    /// Requests, appends, watches.
    State,
    /// Membership heartbeats.
    Lease,
    /// The ingest stream's appends (`store.kind = "jetstream"`).
    Ingest,
}

impl Connection {
    /// The `connection` label value.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Connection::State => "state",
            Connection::Lease => "lease",
            Connection::Ingest => "ingest",
        }
    }
}

/// How often a connection sends itself an echo: T/10, as often as the
/// heartbeats go.
pub(crate) fn echo_every(member_ttl: Duration) -> Duration {
    member_ttl / 10
}

/// How old the oldest unanswered echo may grow before the connection is
/// forced to reconnect: T/2 (5 s at the default T; see the module
/// documentation for why).
pub(crate) fn silence_bound(member_ttl: Duration) -> Duration {
    member_ttl / 2
}

/// What a connection's echoes saw: the bound the next silence is held to
/// and the echoes not yet answered. Time is an input (tested below).
#[derive(Debug)]
pub(crate) struct Echoes {
    base: Duration,
    bound: Duration,
    /// Echoes sent and not answered: number, send time.
    open: VecDeque<(u64, Instant)>,
    next: u64,
}

impl Echoes {
    pub(crate) fn new(member_ttl: Duration) -> Echoes {
        let base = silence_bound(member_ttl);
        Echoes { base, bound: base, open: VecDeque::new(), next: 0 }
    }

    /// An echo leaves now: its number.
    pub(crate) fn sent(&mut self, now: Instant) -> u64 {
        let n = self.next;
        self.next += 1;
        self.open.push_back((n, now));
        n
    }

    /// Echo `n` came back now: it and every earlier one are answered (the
    /// server keeps a connection's order). One back within the base bound
    /// puts the bound back to it.
    pub(crate) fn answered(&mut self, n: u64, now: Instant) {
        while let Some(&(m, at)) = self.open.front() {
            if m > n {
                break;
            }
            self.open.pop_front();
            if m == n && now.saturating_duration_since(at) < self.base {
                self.bound = self.base;
            }
        }
    }

    /// The connection is not up (async-nats reconnects it by itself): what
    /// was sent on the old one is not waited for.
    pub(crate) fn forget(&mut self) {
        self.open.clear();
    }

    /// Whether the oldest unanswered echo is as old as the bound: if so,
    /// the connection is to be forced, the open echoes are forgotten and
    /// the bound doubles (up to 4× the base: 2T).
    pub(crate) fn silent(&mut self, now: Instant) -> Option<Duration> {
        let &(_, oldest) = self.open.front()?;
        let silent = now.saturating_duration_since(oldest);
        if silent < self.bound {
            return None;
        }
        self.open.clear();
        self.bound = (self.bound * 2).min(self.base * 4);
        Some(silent)
    }
}

/// Watch `which` of the bridge's connections until the bridge stops (see
/// the module documentation).
pub(crate) async fn watch(shared: Arc<Shared>, which: Connection) {
    let client = match which {
        Connection::State => shared.state_client.clone(),
        Connection::Lease => shared.lease.client(),
        Connection::Ingest => shared.ingest_client.clone(),
    };
    let ttl = shared.config.cluster.member_ttl;
    let every = echo_every(ttl);
    let inbox = client.new_inbox();
    let mut subscription = loop {
        match client.subscribe(inbox.clone()).await {
            Ok(s) => break s,
            Err(e) => {
                debug!(target: "bridge", connection = which.name(), error = %e, "bridge: echo subscription not made; trying again");
                tokio::time::sleep(every).await;
            }
        }
        if shared.stopping.load(Ordering::Acquire) {
            return;
        }
    };
    let mut echoes = Echoes::new(ttl);
    // Every reconnect of this connection (forced or not) is counted in
    // `BridgeStats::reconnects` here, at the next tick.
    let statistics = client.statistics();
    let mut connects = statistics.connects.load(Ordering::Relaxed);
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while !shared.stopping.load(Ordering::Acquire) {
        tokio::select! {
            _ = tick.tick() => {}
            Some(message) = subscription.next() => {
                if let Some(n) = std::str::from_utf8(&message.payload).ok().and_then(|p| p.parse().ok()) {
                    echoes.answered(n, Instant::now());
                }
                continue;
            }
            () = shared.stop.notified() => break,
        }
        let now_connects = statistics.connects.load(Ordering::Relaxed);
        if now_connects > connects {
            shared.status.stats.reconnects.fetch_add(now_connects - connects, Ordering::Relaxed);
            connects = now_connects;
        }
        let now = Instant::now();
        if client.connection_state() != State::Connected {
            echoes.forget();
            continue;
        }
        if let Some(silent) = echoes.silent(now) {
            force(&shared, &client, which, silent).await;
            continue;
        }
        let n = echoes.sent(now);
        // Queued for the connection (its command queue has room unless it
        // is wedged: then the next ticks find the echo unanswered).
        let _ = tokio::time::timeout(every, client.publish(inbox.clone(), n.to_string().into())).await;
    }
}

/// Force `client` (`which`) to reconnect after `silent` without an echo
/// back, unless its pool has one server only.
async fn force(shared: &Shared, client: &async_nats::Client, which: Connection, silent: Duration) {
    let pool = tokio::time::timeout(Duration::from_secs(1), client.server_pool()).await;
    let servers = match pool {
        Ok(Ok(pool)) => pool.len(),
        // The connection does not take commands: it is wedged.
        _ => usize::MAX,
    };
    if servers < 2 {
        debug!(target: "bridge", connection = which.name(), ?silent, "bridge: NATS server silent; one server in the pool: not left");
        return;
    }
    let server = client.server_info();
    warn!(target: "bridge", connection = which.name(), server = %server.server_name, silent_ms = silent.as_millis() as u64,
        "bridge: NATS server {} silent for {silent:?}: reconnecting to another server", server.server_name);
    let counter: &AtomicU64 = match which {
        Connection::State => &shared.status.stats.reconnects_forced_state,
        Connection::Lease => &shared.status.stats.reconnects_forced_lease,
        Connection::Ingest => &shared.status.stats.reconnects_forced_ingest,
    };
    counter.fetch_add(1, Ordering::Relaxed);
    // Before the reconnect is asked for: the ingest pipeline sends what
    // waited again ahead of anything newer (see `appender.rs`).
    if which == Connection::Ingest {
        if let Ok(mut left) = shared.ingest_left.lock() {
            *left = Some((server.server_name.clone(), std::time::Instant::now()));
        }
        shared.ingest_moved.send_modify(|n| *n += 1);
    }
    if tokio::time::timeout(Duration::from_secs(1), client.force_reconnect()).await.is_err() {
        warn!(target: "bridge", connection = which.name(), "bridge: the NATS connection took no reconnect request within 1 s (its queue is full); async-nats' pings close it");
    }
    if which == Connection::State {
        shared.state_moved.send_modify(|n| *n += 1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: Duration = Duration::from_secs(10);

    #[test]
    fn the_bounds_derive_from_member_ttl() {
        assert_eq!(echo_every(T), Duration::from_secs(1));
        assert_eq!(silence_bound(T), Duration::from_secs(5));
        // A silence is found and left (with a heartbeat sent after) well
        // before the fence (7T/6).
        assert!(silence_bound(T) + echo_every(T) * 2 + Duration::from_secs(3) < T * 7 / 6);
    }

    #[test]
    fn an_echo_unanswered_for_half_the_ttl_forces_a_reconnect_and_answered_ones_never_do() {
        let t0 = Instant::now();
        let mut e = Echoes::new(T);
        let s = |secs: f64| t0 + Duration::from_secs_f64(secs);
        for i in 0..20 {
            let n = e.sent(s(f64::from(i)));
            e.answered(n, s(f64::from(i) + 0.001));
            assert_eq!(e.silent(s(f64::from(i) + 0.5)), None);
        }
        // Frozen from 20 s: echoes at 20, 21, … go unanswered.
        for i in 20..25 {
            e.sent(s(f64::from(i)));
            assert_eq!(e.silent(s(f64::from(i) + 0.5)), None, "{i}");
        }
        assert_eq!(e.silent(s(25.0)), Some(Duration::from_secs(5)));
        // The open echoes are forgotten: nothing more until new ones.
        assert_eq!(e.silent(s(26.0)), None);
    }

    #[test]
    fn a_slow_server_is_left_once_then_the_bound_doubles_until_an_echo_is_quick_again() {
        let t0 = Instant::now();
        let s = |secs: f64| t0 + Duration::from_secs_f64(secs);
        let mut e = Echoes::new(T);
        e.sent(s(0.0));
        assert!(e.silent(s(5.0)).is_some());
        // Now 10 s (T): an echo 6 s late is not silence.
        let n = e.sent(s(6.0));
        assert_eq!(e.silent(s(15.0)), None);
        e.answered(n, s(12.0));
        let n = e.sent(s(13.0));
        assert_eq!(e.silent(s(22.9)), None);
        assert!(e.silent(s(23.0)).is_some());
        // 20 s (2T) at most.
        e.sent(s(24.0));
        assert_eq!(e.silent(s(43.9)), None);
        assert!(e.silent(s(44.0)).is_some());
        e.sent(s(45.0));
        assert_eq!(e.silent(s(64.9)), None);
        // A quick answer: back to T/2.
        let _ = n;
        let n = e.sent(s(65.0));
        e.answered(n, s(65.1));
        e.sent(s(66.0));
        assert!(e.silent(s(71.0)).is_some());
    }

    #[test]
    fn a_connection_down_forgets_its_echoes() {
        let t0 = Instant::now();
        let mut e = Echoes::new(T);
        e.sent(t0);
        e.forget();
        assert_eq!(e.silent(t0 + T), None);
    }
}
