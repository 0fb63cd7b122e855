//! The newest record per client identifier on its way to a KV bucket
//! (bridge thread only), shared by the session record writer
//! (`session_state.rs`) and the cursor writer (`cursors.rs`).
//!
//! A shard sends a key's whole record at each change, in order. One write
//! is in flight per key (a key is here exactly while its write task
//! runs), and when it lands the newest record is written next: a key's
//! records land in the order they were made whatever JetStream or a retry
//! does, and a burst of changes costs one write or two. A waiter hears
//! `true` once a write of its record or a newer one landed, `false` if it
//! was given up (stale, or the bridge stopping).

use std::collections::HashMap;

use bytes::Bytes;
use tokio::sync::oneshot;

/// One key's records as the writer sees them.
struct Key {
    /// The newest record (`None`: delete), and its number.
    newest: (Option<Bytes>, u64),
    /// The number of the newest record that landed.
    landed: u64,
    /// Waiters, each with the record number it waits for.
    waiters: Vec<(u64, oneshot::Sender<bool>)>,
}

/// The newest record of every key with a write under way.
#[derive(Default)]
pub(crate) struct Newest {
    keys: HashMap<String, Key>,
    next: u64,
}

impl Newest {
    /// `key`'s record is now `record` (`None`: delete); `landed` hears
    /// whether it (or a newer one) landed. True when no write of `key` is
    /// under way: the caller starts its write task.
    pub(crate) fn put(&mut self, key: &str, record: Option<Bytes>, landed: Option<oneshot::Sender<bool>>) -> bool {
        self.next += 1;
        let number = self.next;
        let start = !self.keys.contains_key(key);
        let k = self.keys.entry(key.to_owned()).or_insert_with(|| Key { newest: (None, 0), landed: 0, waiters: Vec::new() });
        k.newest = (record, number);
        if let Some(landed) = landed {
            // Those that stopped waiting (the shard bounds its waits) go.
            k.waiters.retain(|(_, w)| !w.is_closed());
            k.waiters.push((number, landed));
        }
        start
    }

    /// The record to write for `key` and its number; `None` once the
    /// newest landed, or with `give_up`: its waiters are answered and the
    /// key is forgotten (its write task ends).
    pub(crate) fn next(&mut self, key: &str, give_up: bool) -> Option<(Option<Bytes>, u64)> {
        let k = self.keys.get_mut(key)?;
        if k.landed >= k.newest.1 || give_up {
            let landed = k.landed >= k.newest.1;
            for (_, waiter) in k.waiters.drain(..) {
                let _ = waiter.send(landed);
            }
            self.keys.remove(key);
            return None;
        }
        Some(k.newest.clone())
    }

    /// The write of `key`'s record `number` ended: landed (`ok`), or found
    /// stale and dropped. Its waiters and those of older records hear it.
    pub(crate) fn ended(&mut self, key: &str, number: u64, ok: bool) {
        let Some(k) = self.keys.get_mut(key) else { return };
        k.landed = number;
        let (done, waiting): (Vec<_>, Vec<_>) = std::mem::take(&mut k.waiters).into_iter().partition(|(wants, _)| *wants <= number);
        k.waiters = waiting;
        for (_, waiter) in done {
            let _ = waiter.send(ok);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_is_written_newest_first_and_every_waiter_hears_the_landing_that_covers_it() {
        let mut n = Newest::default();
        let (tx1, mut rx1) = oneshot::channel();
        assert!(n.put("c", Some(Bytes::from_static(b"1")), Some(tx1)));
        let (record, first) = n.next("c", false).expect("a write");
        assert_eq!(record.as_deref(), Some(&b"1"[..]));
        // Two more while the first is under way: no second task.
        let (tx3, mut rx3) = oneshot::channel();
        assert!(!n.put("c", Some(Bytes::from_static(b"2")), None));
        assert!(!n.put("c", None, Some(tx3)));
        n.ended("c", first, true);
        assert_eq!(rx1.try_recv(), Ok(true));
        assert!(rx3.try_recv().is_err(), "not yet");
        // Only the newest (the delete) is written next.
        let (record, last) = n.next("c", false).expect("the newest");
        assert_eq!(record, None);
        n.ended("c", last, true);
        assert_eq!(rx3.try_recv(), Ok(true));
        assert_eq!(n.next("c", false), None);
        // Forgotten: the next put starts a task again.
        assert!(n.put("c", None, None));
    }

    #[test]
    fn a_stale_or_given_up_write_answers_false() {
        let mut n = Newest::default();
        let (tx, mut rx) = oneshot::channel();
        n.put("c", Some(Bytes::from_static(b"1")), Some(tx));
        let (_, number) = n.next("c", false).unwrap();
        n.ended("c", number, false);
        assert_eq!(rx.try_recv(), Ok(false));
        let (tx, mut rx) = oneshot::channel();
        n.put("c", Some(Bytes::from_static(b"2")), Some(tx));
        assert_eq!(n.next("c", true), None);
        assert_eq!(rx.try_recv(), Ok(false));
    }
}
