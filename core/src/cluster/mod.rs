//! The cluster's pure parts (DESIGN.md §4–§5, §10): the membership and
//! fencing machine, the records stored in JetStream and their keys, and
//! the `[cluster]` settings. No I/O and no clock reads: the bridge
//! (`fleetmq-nats-bridge`) drives them.

pub mod cursor;
pub mod ingest;
pub mod keys;
pub mod membership;
pub mod names;
pub mod peers;
pub mod qos2;
pub mod records;
pub mod retained;
pub mod routes;
pub mod sessions;
pub mod session_log;
pub mod settings;
pub mod wills;
