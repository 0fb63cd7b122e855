//! fleetmq-core: the broker's protocol core, with no I/O, no async and no
//! clock reads (DESIGN.md §2).
//!
//! - [`cluster`]: membership and fencing, stored records, `[cluster]` settings.
//! - [`packet`]: the MQTT 3.1 / 3.1.1 / 5.0 packet model and codec.
//! - [`topic`]: topic name and filter validation and matching.
//! - [`trie`]: the per-shard subscription trie.
//! - [`route`]: the node-wide route table (filter → shards).
//! - [`session`]: the session and connection state machines; time is an input.
//! - [`shared`]: shared subscription groups and their strategies.
//! - [`placement`]: when a publisher moves to its subscribers' shard.
//! - [`store`]: the local store's records, log framing and recovery.
//! - [`settings`]: settings with defaults, units and ranges (DESIGN.md §9, §15).

pub mod cluster;
pub mod packet;
pub mod mesh;
pub mod placement;
pub mod ring;
pub mod route;
pub mod session;
pub mod settings;
pub mod shared;
pub mod store;
pub mod topic;
pub mod trie;
