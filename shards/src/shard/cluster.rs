//! What the cluster asks of a shard (DESIGN.md §5): close every
//! connection when the replica fences, close one whose client identifier
//! another replica took over.

use fleetmq_core::packet::ReasonCode;

use super::Shard;

impl Shard {
    /// Ask every connection of this shard to close with `reason` (MQTT 5:
    /// a DISCONNECT with it), wills not published here: the replica is
    /// fenced and hands them over to the cluster.
    pub(crate) fn close_connections(&self, reason: ReasonCode) {
        let st = self.state.borrow();
        for (_, client) in st.clients.iter() {
            if let Some(conn) = &client.conn {
                conn.request_close(Some(reason), false);
            }
        }
    }

    /// Ask the connection of `client_id`, if one is served here, to close
    /// with `reason`; `true` if there was one.
    pub(crate) fn close_client(&self, client_id: &str, reason: ReasonCode) -> bool {
        let st = self.state.borrow();
        let Some(slot) = st.by_id.get(&st.clients, client_id) else {
            return false;
        };
        match &st.clients[slot as usize].conn {
            Some(conn) => {
                conn.request_close(Some(reason), false);
                true
            }
            None => false,
        }
    }
}
