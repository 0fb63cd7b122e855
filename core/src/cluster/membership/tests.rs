use super::*;
use proptest::prelude::*;

fn secs(s: f64) -> Duration {
    Duration::from_secs_f64(s)
}

/// A replica whose first heartbeat (sent at `t0`) landed as revision 1.
fn serving(ttl: Duration, t0: Instant) -> Membership {
    let mut m = Membership::new("r1", ttl, t0);
    let id = m.sent(t0);
    m.landed(id, 1);
    assert_eq!(m.tick(t0), vec![Change::Unfenced]);
    m
}

#[test]
fn a_replica_starts_fenced_until_its_first_write_lands() {
    let t0 = Instant::now();
    let mut m = Membership::new("r1", secs(10.0), t0);
    assert_eq!(m.fenced(), Some(FenceReason::Starting));
    assert!(m.heartbeat_due(t0));
    let id = m.sent(t0);
    assert!(m.tick(t0 + secs(0.5)).is_empty(), "still starting while the write is in flight");
    m.landed(id, 1);
    assert_eq!(m.tick(t0 + secs(0.5)), vec![Change::Unfenced]);
    assert_eq!(m.fenced(), None);
}

#[test]
fn heartbeats_are_due_every_tenth_of_the_ttl_whether_or_not_earlier_ones_landed() {
    for ttl in [10.0, 20.0] {
        let t0 = Instant::now();
        let mut m = Membership::new("r1", secs(ttl), t0);
        m.sent(t0);
        assert!(!m.heartbeat_due(t0 + secs(ttl / 10.0 - 0.01)));
        assert!(m.heartbeat_due(t0 + secs(ttl / 10.0)), "T/10 after the last send, T = {ttl}");
        m.sent(t0 + secs(ttl / 10.0));
        assert!(!m.heartbeat_due(t0 + secs(ttl / 10.0 + 0.01)));
    }
}

#[test]
fn a_replica_fences_seven_sixths_of_the_ttl_after_the_send_time_of_its_last_landed_write() {
    for ttl in [10.0, 20.0] {
        let t0 = Instant::now();
        let mut m = serving(secs(ttl), t0);
        // Later heartbeats are sent but never land.
        for i in 1..20 {
            m.sent(t0 + secs(ttl / 10.0 * f64::from(i)));
        }
        m.probe_answered(t0 + secs(ttl));
        let fence_at = ttl * 7.0 / 6.0;
        assert!(m.tick(t0 + secs(fence_at - 0.01)).is_empty(), "T = {ttl}");
        assert_eq!(m.tick(t0 + secs(fence_at)), vec![Change::Fenced(FenceReason::LeaseLapsed)]);
        assert!(!m.decides_for_others(t0 + secs(fence_at)));
    }
}

#[test]
fn a_write_that_lands_late_counts_from_its_own_send_time() {
    let t0 = Instant::now();
    let mut m = serving(secs(10.0), t0);
    let late = m.sent(t0 + secs(5.0));
    // At 11 s the write sent at 5 s lands: the fence moves to 5 + 11.67 s.
    m.landed(late, 2);
    m.probe_answered(t0 + secs(12.0));
    assert!(m.tick(t0 + secs(12.0)).is_empty(), "the landed write sent at 5 s holds the lease");
    assert_eq!(
        m.tick(t0 + secs(5.0 + 70.0 / 6.0)),
        vec![Change::Fenced(FenceReason::LeaseLapsed)]
    );
}

#[test]
fn a_write_that_lands_after_the_fence_ends_it_only_if_it_was_sent_recently() {
    let t0 = Instant::now();
    let mut m = serving(secs(10.0), t0);
    let old = m.sent(t0 + secs(1.0));
    assert_eq!(m.tick(t0 + secs(13.0)), vec![Change::Fenced(FenceReason::LeaseLapsed)]);
    // Sent at 1 s, landed at 14 s: 13 s since its send, still lapsed.
    m.landed(old, 2);
    assert!(m.tick(t0 + secs(14.0)).is_empty());
    let fresh = m.sent(t0 + secs(14.0));
    m.landed(fresh, 3);
    assert_eq!(m.tick(t0 + secs(14.1)), vec![Change::Unfenced]);
}

#[test]
fn the_own_entry_found_missing_fences_at_once_and_a_new_write_ends_it() {
    for ttl in [10.0, 20.0] {
        let t0 = Instant::now();
        let mut m = serving(secs(ttl), t0);
        m.entry_missing("r1", 2, t0 + secs(0.2));
        assert_eq!(m.tick(t0 + secs(0.2)), vec![Change::Fenced(FenceReason::OwnEntryMissing)]);
        let id = m.sent(t0 + secs(0.3));
        m.landed(id, 3);
        assert_eq!(m.tick(t0 + secs(0.4)), vec![Change::Unfenced]);
    }
}

#[test]
fn a_missing_marker_older_than_the_last_landed_write_is_ignored() {
    let t0 = Instant::now();
    let mut m = serving(secs(10.0), t0);
    let id = m.sent(t0 + secs(1.0));
    m.landed(id, 5);
    m.entry_missing("r1", 4, t0 + secs(1.1));
    assert!(m.tick(t0 + secs(1.2)).is_empty());
}

#[test]
fn a_store_that_answers_nothing_fences_after_fifteen_seconds() {
    let t0 = Instant::now();
    let mut m = serving(secs(20.0), t0);
    // Heartbeats (lease connection) keep landing.
    for i in 1u32..=16 {
        let at = t0 + secs(f64::from(i));
        let id = m.sent(at);
        m.landed(id, 1 + u64::from(i));
        if i < 15 {
            assert!(m.tick(at).is_empty(), "at {i} s");
        }
    }
    assert_eq!(m.tick(t0 + secs(15.0)), vec![Change::Fenced(FenceReason::StoreSilent)]);
    m.probe_answered(t0 + secs(16.0));
    assert_eq!(m.tick(t0 + secs(16.0)), vec![Change::Unfenced]);
}

#[test]
fn a_peer_is_taken_for_gone_half_a_ttl_after_its_entry_went_missing() {
    for ttl in [10.0, 20.0] {
        let t0 = Instant::now();
        let mut m = serving(secs(ttl), t0);
        assert_eq!(m.entry_present("r2", 7, t0), Some(Change::PeerJoined("r2".into())));
        assert_eq!(m.entry_present("r2", 8, t0 + secs(1.0)), None);
        assert_eq!(m.live_peers(), vec!["r2".to_owned()]);
        // Its last write at 1 s; the entry expires at 1 + T.
        let expired = t0 + secs(1.0 + ttl);
        m.entry_missing("r2", 9, expired);
        for i in 0u32..(ttl as u32) {
            // Our own heartbeats keep landing.
            let at = t0 + secs(f64::from(i));
            let id = m.sent(at);
            m.landed(id, 100 + u64::from(i));
        }
        m.probe_answered(expired);
        assert!(m.tick(expired + secs(ttl / 2.0 - 0.01)).is_empty(), "T = {ttl}");
        assert_eq!(m.tick(expired + secs(ttl / 2.0)), vec![Change::PeerGone("r2".into())]);
        let later = m.tick(expired + secs(ttl));
        assert!(!later.iter().any(|c| matches!(c, Change::PeerGone(_))), "reported once: {later:?}");
        assert!(m.live_peers().is_empty());
        // It comes back.
        assert_eq!(
            m.entry_present("r2", 10, expired + secs(ttl)),
            Some(Change::PeerJoined("r2".into()))
        );
    }
}

#[test]
fn a_peer_back_before_half_a_ttl_is_not_gone() {
    let t0 = Instant::now();
    let mut m = serving(secs(10.0), t0);
    m.entry_present("r2", 1, t0);
    m.entry_missing("r2", 2, t0 + secs(1.0));
    m.entry_present("r2", 3, t0 + secs(4.0));
    let id = m.sent(t0 + secs(5.0));
    m.landed(id, 9);
    assert!(m.tick(t0 + secs(7.0)).is_empty());
}

#[test]
fn only_a_replica_with_a_current_lease_decides_for_others() {
    let t0 = Instant::now();
    let m = serving(secs(10.0), t0);
    assert!(m.decides_for_others(t0 + secs(9.99)));
    assert!(!m.decides_for_others(t0 + secs(10.0)));
}

proptest! {
    /// Whatever lands when, the replica serves exactly when a write sent
    /// less than 7T/6 ago has landed, the probe answered within 15 s and
    /// the own entry is not missing.
    #[test]
    fn fenced_exactly_when_no_recent_write_landed(
        ttl_s in 5u64..120,
        events in proptest::collection::vec((0u64..60, 0u64..600, any::<bool>()), 1..60),
        probe_every in 2u64..400,
    ) {
        let ttl = Duration::from_secs(ttl_s);
        let t0 = Instant::now();
        let mut m = Membership::new("r1", ttl, t0);
        // (send offset ms, delay ms, lands?)
        let mut sends: Vec<(u64, u64, bool)> =
            events.into_iter().map(|(s, d, l)| (s * 50, d * 50, l)).collect();
        let probe_every_ms = probe_every * 50;
        sends.sort();
        let horizon = sends.iter().map(|s| s.0 + s.1).max().unwrap_or(0) + 1;
        let mut ids = Vec::new();
        let mut landed_sent: Option<u64> = None;
        let mut rev = 0;
        let mut last_probe = 0u64;
        let mut step = 0u64;
        while step <= horizon {
            let now = t0 + Duration::from_millis(step);
            for (i, (sent, delay, lands)) in sends.iter().enumerate() {
                if *sent == step {
                    ids.push((i, m.sent(now)));
                }
                if *lands && sent + delay == step {
                    if let Some((_, id)) = ids.iter().find(|(j, _)| *j == i) {
                        rev += 1;
                        m.landed(*id, rev);
                        landed_sent = Some(landed_sent.map_or(*sent, |s: u64| s.max(*sent)));
                    }
                }
            }
            if step.is_multiple_of(probe_every_ms) {
                m.probe_answered(now);
                last_probe = step;
            }
            m.tick(now);
            let expect_serving = landed_sent.is_some_and(|s| step - s < ttl.as_millis() as u64 * 7 / 6)
                && step - last_probe < 15_000;
            prop_assert_eq!(m.fenced().is_none(), expect_serving, "at {} ms", step);
            step += 50;
        }
    }
}

#[test]
fn deciding_for_others_follows_the_send_time_of_the_last_landed_write_not_the_fence() {
    for ttl in [10.0, 20.0] {
        let t0 = Instant::now();
        let mut m = serving(secs(ttl), t0);
        // A write sent at T/2 lands late, at T: it extends the decision
        // from its own send time.
        let late = m.sent(t0 + secs(ttl / 2.0));
        m.landed(late, 2);
        assert!(m.decides_for_others(t0 + secs(ttl * 1.5 - 0.01)), "T = {ttl}");
        assert!(!m.decides_for_others(t0 + secs(ttl * 1.5)), "T = {ttl}");
        // Still serving then (the fence is at 7T/6 after T/2), yet not
        // deciding: the others may no longer see its entry.
        m.probe_answered(t0 + secs(ttl * 1.5));
        assert!(m.tick(t0 + secs(ttl * 1.5)).is_empty());
        assert_eq!(m.fenced(), None);
        assert_eq!(m.decides_until(), Some(t0 + secs(ttl * 1.5)));
    }
}

#[test]
fn a_replica_whose_own_entry_went_missing_does_not_decide_for_others() {
    let t0 = Instant::now();
    let mut m = serving(secs(10.0), t0);
    m.entry_missing("r1", 2, t0 + secs(1.0));
    assert!(!m.decides_for_others(t0 + secs(1.0)));
    assert_eq!(m.decides_until(), None);
    let id = m.sent(t0 + secs(2.0));
    m.landed(id, 3);
    assert!(m.decides_for_others(t0 + secs(2.0)));
}

#[test]
fn a_replica_that_cannot_decide_declares_no_peer_gone_until_it_can() {
    let t0 = Instant::now();
    let mut m = serving(secs(10.0), t0);
    m.entry_present("r2", 5, t0);
    m.entry_missing("r2", 6, t0 + secs(1.0));
    m.probe_answered(t0 + secs(10.0));
    // Its own writes stopped landing at 0 s: at 10 s it no longer decides,
    // and r2 (missing for 9 s > T/2) is not declared gone by it.
    assert!(m.tick(t0 + secs(10.0)).is_empty());
    assert_eq!(m.live_peers(), vec!["r2".to_owned()]);
    // A write lands again: it decides, and declares r2 gone.
    let id = m.sent(t0 + secs(10.5));
    m.landed(id, 7);
    assert_eq!(m.tick(t0 + secs(10.5)), vec![Change::PeerGone("r2".into())]);
}

#[test]
fn a_peer_that_said_it_leaves_is_reported_left_at_once_and_its_expiry_later_is_nothing() {
    let t0 = Instant::now();
    let mut m = serving(secs(10.0), t0);
    m.entry_present("r2", 5, t0);
    assert_eq!(m.entry_leaving("r2", 6, t0 + secs(0.5)), Some(Change::PeerLeft("r2".into())));
    assert!(m.live_peers().is_empty());
    assert_eq!(m.entry_leaving("r2", 6, t0 + secs(0.5)), None, "reported once");
    m.entry_missing("r2", 7, t0 + secs(1.5));
    let id = m.sent(t0 + secs(9.0));
    m.landed(id, 9);
    m.probe_answered(t0 + secs(9.0));
    assert!(m.tick(t0 + secs(9.0)).is_empty(), "not gone after having left");
    // Started again: it joins.
    assert_eq!(m.entry_present("r2", 8, t0 + secs(9.5)), Some(Change::PeerJoined("r2".into())));
}

#[test]
fn a_replica_that_no_longer_decides_does_not_ask_for_a_tick_at_once() {
    let t0 = Instant::now();
    let mut m = serving(secs(10.0), t0);
    m.sent(t0 + secs(10.4));
    m.probe_answered(t0 + secs(10.5));
    // Past T since the last landed write: the next deadline is the next
    // heartbeat (11.4 s), not now.
    let now = t0 + secs(10.5);
    assert!(m.next_deadline(now) > now + secs(0.4), "{:?}", m.next_deadline(now) - now);
}
