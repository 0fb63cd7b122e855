//! A checked flow's publisher: `{prefix}/{i}` at `--qos`, open loop at
//! `--rate` or closed loop under `--window`, at most 1000 (or Receive
//! Maximum) unacknowledged. With `--through-restarts` it keeps a session,
//! reconnects when its connection drops and sends again what is
//! unacknowledged (see [`crate::inflight`]).

use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::BytesMut;
use fleetmq_core::packet::{Packet, QoS};

use super::{qos_of, Client, Ctx, SyncConn, BATCH, MAX_INFLIGHT, POLL};
use crate::client::{put_response, ClientError, PublishTemplate};
use crate::inflight::{Acked, InflightTable};
use crate::options::{BrokerUrl, Rate};
use crate::runtime::now_ns;
use crate::schedule::Schedule;

/// A client gives up reconnecting after this long without a connection.
const RECONNECT_FOR: Duration = Duration::from_secs(60);
/// First and longest wait between reconnection attempts.
const BACKOFF: (Duration, Duration) = (Duration::from_millis(50), Duration::from_secs(1));
/// After publishing, how long a publisher waits for what is unacknowledged
/// (reconnecting meanwhile if it must).
const ACK_WAIT: Duration = Duration::from_secs(30);

/// Connect `id` to `url` again after its connection dropped: Clean Start
/// 0 (3.1.1: Clean Session 0), Session Expiry `expiry` (MQTT 5), with
/// backoff, for at most [`RECONNECT_FOR`]. Counted in `reconnects`.
///
/// # Errors
/// The last attempt's error once [`RECONNECT_FOR`] has passed, or
/// [`ClientError::Closed`] when the run is over.
pub(super) fn connect_again(
    ctx: &Ctx,
    url: &BrokerUrl,
    id: &str,
    expiry: Option<u32>,
) -> Result<SyncConn, ClientError> {
    ctx.reconnects.fetch_add(1, Ordering::Relaxed);
    let give_up = now_ns() + RECONNECT_FOR.as_nanos() as u64;
    let mut wait = BACKOFF.0;
    loop {
        if ctx.over() {
            return Err(ClientError::Closed);
        }
        match SyncConn::connect(url, id, &ctx.cfg.connect, false, expiry) {
            Ok(conn) => return Ok(conn),
            Err(e) if now_ns() >= give_up || matches!(e, ClientError::Refused(_)) => return Err(e),
            Err(_) => {
                std::thread::sleep(wait);
                wait = (wait * 2).min(BACKOFF.1);
            }
        }
    }
}

/// What a publisher keeps across its connections.
struct PubState {
    /// Next sequence number.
    k: u64,
    /// QoS 1/2 publishes not yet completed.
    table: InflightTable,
    /// Responses (PUBREL) and resends to write.
    out: BytesMut,
    /// A new connection must first send again what is in flight.
    resend: bool,
    /// When the wait for acknowledgements after publishing ends, ns.
    give_up: Option<u64>,
}

/// Publisher `i`, from its first CONNECT to its last acknowledgement.
pub(super) fn publisher(ctx: &Ctx, i: usize) {
    let cfg = &ctx.cfg;
    let url = ctx.url(Client::Publisher(i));
    let id = format!("{}-vp{i}", cfg.client_id_prefix);
    let restarts = cfg.through_restarts;
    let expiry = restarts.then_some(cfg.session_expiry);
    // MQTT 5 starts a fresh session; 3.1.1 keeps one only with Clean
    // Session 0 from the first CONNECT.
    let clean = !restarts || cfg.connect.version.is_v5();
    let mut conn = match SyncConn::connect(url, &id, &cfg.connect, clean, expiry) {
        Ok(c) => c,
        Err(e) => {
            ctx.error(e.kind());
            ctx.fail(format!("{} ({id}): {e}", url.text));
            return;
        }
    };
    ctx.ready.fetch_add(1, Ordering::AcqRel);
    let mut st = PubState {
        k: 0,
        table: InflightTable::default(),
        out: BytesMut::new(),
        resend: false,
        give_up: None,
    };
    loop {
        let e = match publish(ctx, i, &mut conn, &mut st) {
            Ok(()) => break,
            Err(e) => e,
        };
        if !super::lost_connection(ctx, &e) {
            if !ctx.over() {
                ctx.error(e.kind());
                ctx.fail(format!("publisher {id}: {e}"));
            }
            return;
        }
        conn = match connect_again(ctx, url, &id, expiry) {
            Ok(c) => c,
            Err(e) => {
                if !ctx.over() {
                    ctx.error(e.kind());
                    ctx.fail(format!("publisher {id}: reconnecting: {e}"));
                }
                return;
            }
        };
        if !conn.session_present {
            ctx.sessions_lost.fetch_add(1, Ordering::Relaxed);
            ctx.error("session not present after reconnect");
        }
        st.resend = true;
    }
    conn.disconnect();
}

/// Publish on `conn` until the end of the run and every publish is
/// acknowledged (or the wait for that ends); first, on a new connection,
/// send again what is in flight.
fn publish(ctx: &Ctx, i: usize, conn: &mut SyncConn, st: &mut PubState) -> Result<(), ClientError> {
    let cfg = &ctx.cfg;
    let t0 = loop {
        if ctx.over() {
            return Ok(());
        }
        let t = ctx.t0.load(Ordering::Acquire);
        if t != 0 {
            break t;
        }
        std::thread::sleep(Duration::from_millis(1));
    };
    let end = ctx.end.load(Ordering::Acquire);
    let qos = qos_of(cfg.qos);
    let template = PublishTemplate::new(
        &format!("{}/{i}", cfg.prefix),
        qos,
        cfg.payload_size,
        conn.version,
    );
    if st.resend {
        st.out.clear();
        if st
            .table
            .resend(&template, conn.version, (i as u64) << 40, &mut st.out)
            > 0
        {
            conn.write(&st.out)?;
        }
        st.out.clear();
        st.resend = false;
    }
    let max_inflight = u64::from(conn.receive_maximum).min(MAX_INFLIGHT);
    let schedule = match cfg.rate {
        Rate::PerSecond(r) => Some(Schedule::new(r, cfg.publishers as u64, i as u64)),
        Rate::Max => None,
    };
    let last = schedule.map(|s| s.due_count(end - t0 - 1));
    // How long after the end an open-loop publisher may still catch up;
    // through restarts it was away for a while (a restart, the backoff).
    let backlog_grace: u64 = if cfg.through_restarts {
        10_000_000_000
    } else {
        2_000_000_000
    };
    let mut out = BytesMut::with_capacity(template.len() * BATCH as usize);
    while !ctx.over() {
        let now = now_ns();
        let want = match (schedule, last) {
            (Some(s), Some(last)) => {
                if st.k >= last {
                    break;
                }
                if now >= end + backlog_grace {
                    ctx.error("not sent: publisher backlog at the end");
                    break;
                }
                s.due_count(now.saturating_sub(t0))
                    .min(last)
                    .saturating_sub(st.k)
            }
            _ => {
                if now >= end {
                    break;
                }
                ctx.window_free()
            }
        };
        let mut want = want.min(BATCH);
        if qos != QoS::AtMostOnce {
            want = want.min(max_inflight.saturating_sub(st.table.len()));
        }
        if want == 0 {
            let wait = match schedule {
                Some(s) if st.table.len() < max_inflight || qos == QoS::AtMostOnce => {
                    Duration::from_nanos((t0 + s.due_at(st.k)).saturating_sub(now))
                }
                _ => Duration::from_millis(1),
            }
            .clamp(Duration::from_micros(100), POLL);
            if qos == QoS::AtMostOnce {
                std::thread::sleep(wait);
            } else {
                read_acks(ctx, i, conn, wait, st)?;
            }
            continue;
        }
        for _ in 0..want {
            let stamp = schedule.map_or(now, |s| t0 + s.due_at(st.k));
            let id = (qos != QoS::AtMostOnce).then(|| st.table.send(st.k, stamp));
            template.put(&mut out, stamp, (i as u64) << 40 | st.k, id);
            st.k += 1;
        }
        // Counted before the write: if it fails they are in flight and
        // sent again after a reconnect.
        ctx.sent[i].store(st.k, Ordering::Relaxed);
        ctx.published.fetch_add(want, Ordering::Relaxed);
        let written = conn.write(&out);
        out.clear();
        written?;
    }
    // Wait for the outstanding acknowledgements.
    let give_up = *st
        .give_up
        .get_or_insert(now_ns() + ACK_WAIT.as_nanos() as u64);
    while !st.table.is_empty() && !ctx.over() && now_ns() < give_up {
        read_acks(ctx, i, conn, POLL, st)?;
    }
    Ok(())
}

/// Read what came within `wait`: PUBACK, PUBREC (answered with PUBREL),
/// PUBCOMP. A refusal (MQTT 5 reason code 0x80 or above) ends the flow
/// without acknowledging the value, counted as an error.
fn read_acks(
    ctx: &Ctx,
    i: usize,
    conn: &mut SyncConn,
    wait: Duration,
    st: &mut PubState,
) -> Result<(), ClientError> {
    if !conn.fill(wait)? {
        return Ok(());
    }
    let (mut completed, mut acked) = (0, Vec::new());
    while let Some(p) = conn.decode()? {
        let result = match p {
            Packet::PubAck(a) if a.reason.is_error() => {
                refused(ctx, &mut st.table, a.packet_id.get())
            }
            Packet::PubAck(a) => st.table.puback(a.packet_id.get()),
            Packet::PubRec(r) if r.reason.is_error() => {
                refused(ctx, &mut st.table, r.packet_id.get())
            }
            Packet::PubRec(r) => {
                let result = st.table.pubrec(r.packet_id.get());
                if result != Acked::Unknown {
                    put_response(&mut st.out, conn.version, r.packet_id, Packet::PubRel);
                }
                result
            }
            Packet::PubComp(c) => st.table.pubcomp(c.packet_id.get()),
            Packet::Disconnect(_) => return Err(ClientError::Closed),
            _ => Acked::Unknown,
        };
        match result {
            Acked::Value { k, completed: c } => {
                acked.push(k);
                completed += u64::from(c);
            }
            Acked::Completed => completed += 1,
            Acked::Again | Acked::Unknown => {}
        }
    }
    if !acked.is_empty() {
        let mut set = ctx.acked_values[i]
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        for k in acked {
            set.insert(k);
        }
    }
    ctx.acked.fetch_add(completed, Ordering::Relaxed);
    if !st.out.is_empty() {
        let r = conn.write(&st.out);
        st.out.clear();
        r?;
    }
    Ok(())
}

/// The broker refused publish `id`: its flow ends, the value is not
/// acknowledged.
fn refused(ctx: &Ctx, table: &mut InflightTable, id: u16) -> Acked {
    if table.pubcomp(id) == Acked::Completed {
        ctx.error("publish refused");
    }
    Acked::Unknown
}
