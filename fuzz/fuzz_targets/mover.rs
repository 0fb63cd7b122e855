//! Fuzz the move decision (`fleetmq_core::placement::Mover`): any sequence
//! of (shards reached, time step) pairs. It must never panic, and must only
//! ever send a publisher to the one shard every message so far reached
//! (never its own), after `MOVE_AFTER` messages since it was last judged,
//! and never once a message reached anything else.
#![no_main]

use std::cell::Cell;
use std::time::{Duration, Instant};

use fleetmq_core::placement::{Mover, MOVE_AFTER};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|steps: Vec<(u64, u16)>| {
    let (mut mover, unmovable) = (Mover::default(), Cell::new(false));
    let mut now = Instant::now();
    let mut seen = 0u64;
    let mut since_judged = 0u16;
    let here = 0;
    for (reach, micros) in steps {
        now += Duration::from_micros(u64::from(micros));
        seen |= reach;
        since_judged += u16::from(reach != 0 && !unmovable.get());
        let answer = mover.note(reach, here, now, &unmovable);
        let clean = seen.count_ones() <= 1 && seen & (1 << here) == 0;
        assert_eq!(unmovable.get(), !clean);
        if let Some(to) = answer {
            assert!(clean);
            assert_eq!(1u64 << to, seen);
            assert_eq!(since_judged, MOVE_AFTER);
        }
        if since_judged == MOVE_AFTER || !clean {
            since_judged = 0;
        }
    }
});
