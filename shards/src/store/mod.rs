//! Where accepted values become durable (DESIGN.md §7), as a shard sees it:
//! the store and the acknowledgements that wait for it.
//!
//! A connection's PUBACK, PUBREC, SUBACK and UNSUBACK (core's
//! [`Output::Acknowledge`](fleetmq_core::session::Output::Acknowledge)) may
//! be written only once what the packet caused is durable: the shard hands
//! them, after the packet's other outputs, to its [`ShardStore`], which
//! writes them once the store covers them, in order per connection. With `store.kind = "none"` there is nothing to wait for:
//! the acknowledgement is written at once, as before this module existed.
//!
//! The interface is store-agnostic: a store only hands out increasing
//! tokens and reports "durable up to T" or "failed up to T".

use std::rc::Rc;

use fleetmq_core::packet::Packet;

use crate::shard::ConnShared;

/// A shard's store.
pub(crate) enum ShardStore {
    /// `store.kind = "none"`: acknowledged on receipt.
    None,
}

impl ShardStore {
    /// True when acknowledgements wait for a store; false for `none`,
    /// whose acknowledgements the caller writes at once.
    pub(crate) fn is_durable(&self) -> bool {
        match self {
            ShardStore::None => false,
        }
    }

    /// Write `packets`, the acknowledgements of one packet from `conn`,
    /// once everything appended so far is durable. `conn` must be the
    /// connection's shared part (its writes go to its buffer).
    pub(crate) fn acknowledge(&self, conn: &Rc<ConnShared>, packets: &mut Vec<Packet>) {
        match self {
            ShardStore::None => {
                for packet in packets.drain(..) {
                    conn.send(&packet);
                }
            }
        }
    }
}
