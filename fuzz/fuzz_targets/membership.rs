//! The membership state machine (core `cluster::membership`, DESIGN.md §5)
//! fed arbitrary sequences of heartbeats sent, landed, failed and lost,
//! store probes, watch reports (present, leaving, missing, for peers and
//! for itself) and ticks at arbitrary times. It must never panic, and:
//! it serves only while a write sent less than 7T/6 ago has landed; it
//! takes a peer for gone only while it decides for others, and only T/2
//! after that peer's entry went missing; a peer is reported gone or left
//! at most once between two joins; `next_deadline` is never in the past.
#![no_main]

use std::collections::HashMap;
use std::time::{Duration, Instant};

use fleetmq_core::cluster::membership::{Change, Membership};
use libfuzzer_sys::fuzz_target;

const PEERS: [&str; 3] = ["p0", "p1", "p2"];

fuzz_target!(|data: &[u8]| {
    let Some((&head, mut rest)) = data.split_first() else { return };
    let ttl = Duration::from_secs(5 + u64::from(head) % 116);
    let t0 = Instant::now();
    let mut now = t0;
    let mut m = Membership::new("me", ttl, t0);
    // Writes in flight: (id, send time).
    let mut in_flight: Vec<(u64, Instant)> = Vec::new();
    let mut last_landed_sent: Option<Instant> = None;
    let mut revision = 0u64;
    // Peer → when its entry went missing (this model's view), and whether
    // it is out (gone or left, reported).
    let mut missing_since: HashMap<&str, Instant> = HashMap::new();
    let mut out: HashMap<&str, bool> = HashMap::new();
    while let Some((&op, tail)) = rest.split_first() {
        let arg = tail.first().copied().unwrap_or(0);
        rest = tail.get(1..).unwrap_or_default();
        let peer = PEERS[usize::from(arg) % PEERS.len()];
        match op % 9 {
            0 => now += Duration::from_millis(u64::from(arg) * 40),
            1 => in_flight.push((m.sent(now), now)),
            2 | 3 if !in_flight.is_empty() => {
                let (id, sent) = in_flight.remove(usize::from(arg) % in_flight.len());
                if op % 9 == 2 {
                    revision += 1;
                    m.landed(id, revision);
                    last_landed_sent = Some(last_landed_sent.map_or(sent, |s| s.max(sent)));
                } else {
                    m.failed(id);
                }
            }
            4 => m.probe_answered(now),
            5 => {
                if let Some(Change::PeerJoined(p)) = m.entry_present(peer, revision + 1, now) {
                    assert_eq!(p, peer);
                    out.insert(peer, false);
                }
                missing_since.remove(peer);
            }
            6 => {
                m.entry_missing(peer, revision + 1, now);
                missing_since.entry(peer).or_insert(now);
            }
            7 => {
                if let Some(change) = m.entry_leaving(peer, revision + 1, now) {
                    assert_eq!(change, Change::PeerLeft(peer.to_owned()));
                    assert!(!out.get(peer).copied().unwrap_or(true), "{peer} left twice");
                    out.insert(peer, true);
                }
                missing_since.remove(peer);
            }
            _ => {
                let decides = m.decides_for_others(now);
                for change in m.tick(now) {
                    if let Change::PeerGone(p) = change {
                        let p = PEERS.iter().find(|q| **q == p).expect("a known peer");
                        assert!(decides, "{p} taken for gone by a replica that does not decide");
                        let since = missing_since.get(p).expect("gone without going missing");
                        assert!(now.duration_since(*since) >= ttl / 2, "{p} gone before T/2");
                        assert!(!out.get(p).copied().unwrap_or(true), "{p} gone twice");
                        out.insert(p, true);
                    }
                }
                if m.fenced().is_none() {
                    let sent = last_landed_sent.expect("serving before any write landed");
                    assert!(now.duration_since(sent) < ttl * 7 / 6, "serving past 7T/6");
                }
            }
        }
        assert!(m.next_deadline(now) >= now);
    }
});
