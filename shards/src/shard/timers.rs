//! What the shard's tick looks at: keep-alive and credential deadlines
//! ([`Shard::check_deadlines`]), expired sessions and wills
//! ([`Shard::expire`]) and the `$SYS` topics ([`Shard::publish_sys`]).

use super::*;

impl Shard {
    /// Close the connections whose keep alive ran out (no packet for 1.5 ×
    /// Keep Alive `[MQTT-3.1.2-22]`: DISCONNECT 0x8D) or whose credential
    /// expired (a JWT's `exp`: DISCONNECT 0xA0). Each connection with a
    /// deadline has one entry in a heap, looked at when it falls due (from
    /// the shard's 50 ms tick) and pushed back when traffic moved the
    /// deadline, so no connection holds a timer of its own.
    pub(crate) fn check_deadlines(&self, now: Instant) {
        let mut st = self.state.borrow_mut();
        let st = &mut *st;
        self.tick_strays(st, now);
        while let Some(&Reverse((at, slot, key))) = st.deadlines.peek() {
            if at > now {
                break;
            }
            st.deadlines.pop();
            let conn = st
                .clients
                .get(slot as usize)
                .and_then(|c| c.conn.as_ref())
                .filter(|c| c.key == key);
            let Some(conn) = conn else { continue };
            match conn.next_deadline() {
                Some(next) if next > now => {
                    push_deadline(&mut st.deadlines, Reverse((next, slot, key)))
                }
                Some(_) => conn.check_deadlines(now),
                None => {}
            }
        }
    }

    /// Periodic work: publish wills whose delay ran out, end sessions whose
    /// expiry ran out (MQTT 5 §3.1.2.11.2), and, with `park_idle`, ask
    /// connections without traffic since the last call (1-2 s, called once
    /// a second) to park (see [`crate::park`]). O(sessions) once a second.
    pub(crate) fn expire(&self, now: Instant, park_idle: bool) {
        let mut st = self.state.borrow_mut();
        let st = &mut *st;
        self.catch_up(st);
        st.retained.prune(now);
        let mut due_wills = std::mem::take(&mut st.restored_wills);
        let mut expired = Vec::new();
        let mut connected = 0;
        for (slot, client) in st.clients.iter_mut() {
            if let Some(conn) = &client.conn {
                connected += 1;
                // No traffic either way since the last look (1-2 s): ask
                // the connection to park (see `crate::park`).
                if !conn.active.replace(false)
                    && park_idle
                    && conn.parkable.get()
                    && conn.parked.get().is_none()
                    && !conn.park_requested.get()
                {
                    conn.park_requested.set(true);
                    conn.write_signal.notify();
                }
            }
            if client.pending_will.as_ref().is_some_and(|p| p.0 <= now) {
                let will = client.pending_will.take().map(|p| p.1).expect("checked");
                due_wills.push((client.session.client_id().clone(), will));
            }
            if let Some(since) = client.offline_since {
                if session_expires_at(since, client.session.session_expiry())
                    .is_some_and(|at| at <= now)
                {
                    expired.push(slot as Slot);
                }
            }
        }
        compact_deadlines(&mut st.deadlines, &st.clients, connected);
        for slot in expired {
            let client = &mut st.clients[slot as usize];
            if let Some(pending) = client.pending_will.take() {
                due_wills.push((client.session.client_id().clone(), pending.1));
            }
            self.remove_client(st, slot);
        }
        for (client_id, will) in due_wills {
            self.publish_will(st, Some(&client_id), will, now);
        }
    }

    /// Publish the `$SYS/broker/...` topics (retained, QoS 0), as Mosquitto
    /// names them. `#` does not match them `[MQTT-4.7.2-1]`.
    pub(crate) fn publish_sys(&self, totals: &crate::metrics::Totals) {
        let now = Instant::now();
        let mut st = self.state.borrow_mut();
        let st = &mut *st;
        let figures: [(&str, String); 9] = [
            (
                "$SYS/broker/version",
                format!("fleetmq {}", env!("CARGO_PKG_VERSION")),
            ),
            (
                "$SYS/broker/uptime",
                format!("{} seconds", totals.uptime_seconds),
            ),
            ("$SYS/broker/shards", self.shards.to_string()),
            (
                "$SYS/broker/clients/connected",
                totals.clients_connected.to_string(),
            ),
            (
                "$SYS/broker/messages/received",
                totals.messages_in.to_string(),
            ),
            ("$SYS/broker/messages/sent", totals.messages_out.to_string()),
            (
                "$SYS/broker/messages/dropped",
                totals.messages_dropped.to_string(),
            ),
            ("$SYS/broker/bytes/received", totals.bytes_in.to_string()),
            ("$SYS/broker/bytes/sent", totals.bytes_out.to_string()),
        ];
        for (topic, value) in figures {
            let message = Message {
                topic: ByteString::from_static(topic),
                payload: Bytes::from(value),
                qos: QoS::AtMostOnce,
                retain: true,
                properties: Props::default(),
                received_at: now,
                origin: u64::MAX,
                stored: 0,
                from_mesh: false,
                groups: fleetmq_core::session::GroupPick::ALL,
            };
            self.route(st, Arc::new(message), now);
        }
    }
}
