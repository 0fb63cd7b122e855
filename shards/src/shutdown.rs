//! The shutdown signal shared by the binary's signal thread and the shards.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// A one-way flag: once triggered, the server stops accepting, sends MQTT 5
/// clients DISCONNECT 0x8B (server shutting down) and returns from
/// [`crate::server::run`]. Shards poll it every 50 ms, so a trigger takes
/// effect within that period. Cloning shares the flag.
#[derive(Clone, Debug, Default)]
pub struct Shutdown(Arc<AtomicBool>);

impl Shutdown {
    /// A new, untriggered signal.
    pub fn new() -> Shutdown {
        Shutdown::default()
    }

    /// Ask the server to stop. Idempotent; callable from any thread
    /// (including a signal-handling thread).
    pub fn trigger(&self) {
        self.0.store(true, Ordering::Release);
    }

    /// True once [`Shutdown::trigger`] was called.
    pub fn is_triggered(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }
}
