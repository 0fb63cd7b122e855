//! The cursor gate of a session reading its session log (DESIGN.md §7,
//! issue 24): a QoS 2 value is exactly once across a replica's death.
//! Its PUBLISH from the log, and later its PUBREL, wait in the
//! connection's chain (`crate::store`) until a cursor listing it (with its
//! packet identifier; released, for the PUBREL) landed in
//! `mqtt-session-cursor`, written once for every such packet of the
//! shard's wake-up ([`Shard::cursor_gate`]). So a replica taking the
//! session up resends that PUBLISH with DUP and the same identifier, which
//! the client does not hand on again `[MQTT-4.3.3-10]`, or its PUBREL;
//! never the value as a new message. Whatever else goes to that
//! connection meanwhile (a QoS 0 value, a QoS 1 one) waits behind it, so
//! order is kept `[MQTT-4.6.0-6]`.

use std::rc::Rc;

use fleetmq_core::packet::{Packet, PacketId, QoS};
use fleetmq_core::session::Delivery;

use super::session_log::{Mode, Reader, CURSOR_EVERY, LOGGED};
use super::{Client, ConnShared, Shard, Slot};
use crate::store::{Outcome, Write};

impl Shard {
    /// Whether a PUBLISH of `delivery` with `packet_id` to the session of
    /// `client` waits for its cursor: a QoS 2 value from its session log
    /// (see the module documentation).
    pub(super) fn gates_delivery(client: &Client, delivery: &Delivery, packet_id: Option<PacketId>) -> bool {
        let stored = delivery.message.stored;
        delivery.qos == QoS::ExactlyOnce
            && packet_id.is_some()
            && stored != 0
            && stored != LOGGED
            && delivery.group.is_none()
            && client.log.as_ref().is_some_and(|r| r.mode != Mode::Starting)
    }

    /// Write `packet` (not a PUBLISH) to `conn`, the connection of the
    /// session whose reader is `log` (client key `key`, on `slot`): held
    /// until its cursor lists the delivery released when it is a PUBREL
    /// of a session reading its log, else behind what is held for the
    /// connection already ([`Shard::holds`]), else at once.
    pub(super) fn send_or_hold(&self, (log, key): (&mut Option<Box<Reader>>, u64), slot: Slot, conn: &Rc<ConnShared>, packet: Packet) {
        let gated = matches!(packet, Packet::PubRel(_)) && log.as_ref().is_some_and(|r| r.mode != Mode::Starting);
        match self.holds((log, key), slot, conn, gated) {
            Some(write) => self.store.hold_packet(conn, packet, write),
            None => conn.send(&packet),
        }
    }

    /// How a packet for the session of `client` (on `slot`, connected
    /// through `conn`) goes out: `None` at once; `Some(write)` held in the
    /// connection's chain, until `write` is done when `gated` (see
    /// [`Shard::cursor_gate`]), else behind what is held already (a
    /// session reading its log whose chain is not empty).
    pub(super) fn holds(&self, (log, key): (&mut Option<Box<Reader>>, u64), slot: Slot, conn: &ConnShared, gated: bool) -> Option<Option<Rc<Write>>> {
        let reader = log.as_mut()?;
        if gated {
            return Some(Some(self.cursor_gate(reader, key, slot, conn)));
        }
        self.store.acks_held(conn).then_some(None)
    }

    /// The write that QoS 2 packets to the session of `reader` (client key
    /// `key`, on `slot`, connected through `conn`) made in this wake-up
    /// wait for: once the
    /// shard's other tasks ran, its cursor (listing them all) is written
    /// and the write is done when it landed. Tried again every
    /// [`CURSOR_EVERY`] while the bridge cannot take it; done at once
    /// when the connection or the session is gone (its bytes go nowhere).
    fn cursor_gate(&self, reader: &mut Reader, key: u64, slot: Slot, conn: &ConnShared) -> Rc<Write> {
        if let Some(write) = reader.gate.as_ref().filter(|w| !w.is_resolved()) {
            return write.clone();
        }
        let write = self.store.gate(key, conn.key);
        reader.gate = Some(write.clone());
        let conn_key = conn.key;
        let shard = crate::cluster::shard_weak();
        let gate = write.clone();
        glommio::spawn_local(async move {
            let write = gate;
            loop {
                // The other packets of this wake-up join the write first.
                futures_lite::future::yield_now().await;
                let Some(shard) = shard.as_ref().and_then(std::rc::Weak::upgrade) else { break };
                let (landed, answer) = tokio::sync::oneshot::channel();
                {
                    let mut guard = shard.state.borrow_mut();
                    let st = &mut *guard;
                    let Some(client) = st.clients.get_mut(slot as usize).filter(|c| c.key == key) else { break };
                    // Later packets wait for a write of their own (this
                    // one's cursor is made now, or never: the connection
                    // is gone).
                    if let Some(reader) = client.log.as_mut().filter(|r| r.gate.as_ref().is_some_and(|g| Rc::ptr_eq(g, &write))) {
                        reader.gate = None;
                    }
                    if client.conn.as_ref().is_none_or(|c| c.key != conn_key) || client.log.is_none() {
                        break;
                    }
                    shard.write_cursor(st, slot, true, Some(landed));
                }
                if answer.await == Ok(true) {
                    break;
                }
                glommio::timer::sleep(CURSOR_EVERY).await;
            }
            write.resolve(Outcome::Done);
        })
        .detach();
        write
    }
}
