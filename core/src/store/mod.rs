//! The local store's pure parts (DESIGN.md §7, `store.kind = "local"`):
//! the records of its log ([`record`]), how they are framed and checked in
//! a segment file ([`frame`]), and how recovery rebuilds retained messages
//! and persistent sessions from them ([`replay`]). Bytes in, records out:
//! the shards do the I/O (`shards/src/store/`).
//!
//! Layout on disk (in `store.dir`): one log per shard, `shard-{i}/`, made
//! of segments `{n:016x}.log` written in order, each starting with a
//! [`record::Record::Header`].

pub mod frame;
pub mod record;
pub mod replay;
pub mod settings;

pub use frame::{put_frame, scan, Corrupt, Scan};
pub use record::{Record, RecordError, StoredMessage, FORMAT_VERSION};
pub use replay::{Recovered, RecoveredSession, RecoveredWill};
