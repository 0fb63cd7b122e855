//! Deadlines derived from the protocol's intervals. Pure functions of the
//! time the caller passes in, so tests drive them with a fake clock.

use std::time::{Duration, Instant};

/// When a connection with Keep Alive `keep_alive` seconds that last sent a
/// packet at `last_packet` is considered dead: one and a half times the
/// interval later `[MQTT-3.1.2-22]`. `None` when Keep Alive is 0.
pub fn keep_alive_deadline(last_packet: Instant, keep_alive: u16) -> Option<Instant> {
    if keep_alive == 0 {
        return None;
    }
    Some(last_packet + Duration::from_millis(u64::from(keep_alive) * 1500))
}

/// When a session that went offline at `disconnected_at` with Session
/// Expiry Interval `interval` seconds expires. `u32::MAX` means never
/// (MQTT 5 §3.1.2.11.2): `None`.
pub fn session_expires_at(disconnected_at: Instant, interval: u32) -> Option<Instant> {
    if interval == u32::MAX {
        return None;
    }
    Some(disconnected_at + Duration::from_secs(u64::from(interval)))
}

/// When the Will Message of a connection that ended at `disconnected_at` is
/// published: after the Will Delay Interval, or when the session ends if
/// that comes first `[MQTT-3.1.3-9]`.
pub fn will_due_at(disconnected_at: Instant, will_delay: u32, session_expiry: u32) -> Instant {
    disconnected_at + Duration::from_secs(u64::from(will_delay.min(session_expiry)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keep_alive_expires_after_one_and_a_half_intervals() {
        let t0 = Instant::now();
        assert_eq!(keep_alive_deadline(t0, 10), Some(t0 + Duration::from_secs(15)));
        assert_eq!(keep_alive_deadline(t0, 1), Some(t0 + Duration::from_millis(1500)));
    }

    #[test]
    fn keep_alive_zero_never_expires() {
        assert_eq!(keep_alive_deadline(Instant::now(), 0), None);
    }

    #[test]
    fn session_expiry_max_means_never() {
        let t0 = Instant::now();
        assert_eq!(session_expires_at(t0, u32::MAX), None);
        assert_eq!(session_expires_at(t0, 0), Some(t0));
        assert_eq!(session_expires_at(t0, 60), Some(t0 + Duration::from_secs(60)));
    }

    #[test]
    fn will_is_due_at_the_earlier_of_delay_and_session_end() {
        let t0 = Instant::now();
        assert_eq!(will_due_at(t0, 30, 10), t0 + Duration::from_secs(10));
        assert_eq!(will_due_at(t0, 5, 10), t0 + Duration::from_secs(5));
        assert_eq!(will_due_at(t0, 0, 0), t0);
    }
}
