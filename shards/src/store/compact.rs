//! Online compaction of the local store: while the broker serves, a
//! worker thread (`fleetmq-compactor`) replaces the snapshot and the
//! shards' sealed log segments by one new snapshot of what is live, so the
//! log stays near what is live (values acknowledged or expired, replaced
//! retained values and ended sessions are dropped) and within
//! `store.max_bytes`.
//!
//! **The cut.** A snapshot covers every record up to a log sequence number
//! `C` and nothing above it (recovery skips records at or below the
//! snapshot's number). The compactor takes `C` from the node-wide counter
//! and asks every shard to roll its log at `C`: the shard writes what it
//! appended up to `C` to its current segment, starts a new segment for
//! what comes after, and reports the new segment's number; the segments
//! before it hold only records at or below `C`. The handshake ([`Roll`]):
//! the compactor raises `request`, then takes `C` (a `fetch_add` on the
//! counter), then publishes `cut`. A shard's committer looks at `request`
//! right before it takes its pending records; records it took before
//! seeing the request were numbered before `C` was taken (all `SeqCst`),
//! and once it sees the request it waits for `cut`, so every record it
//! appends after that is above `C`. The records it holds then are split at
//! `C` (each shard numbers its records in increasing order).
//!
//! **The rest runs off the shards' threads** (at nice 10): read the newest
//! snapshot and the sealed segments, replay them as recovery does, write
//! the new snapshot (`.tmp`, sync, rename, sync the directory), then
//! remove the old snapshot and the sealed segments. A kill at any moment
//! leaves either the old snapshot with every segment, or the new one with
//! some segments it covers (skipped at recovery): nothing acknowledged is
//! lost. The shard's only pause is the roll: one extra write and sync and
//! a new segment file.
//!
//! **When** ([`due`]): when the segments written since the last snapshot
//! are at least as large as the snapshot and an eighth of
//! `store.max_bytes` (so compaction costs O(1) per byte logged), when the
//! log passes half of `store.max_bytes` with a sixteenth of it new, and,
//! while the store is full, at most once a second and only if records were
//! committed since the last compaction began (an acknowledgement, an ended
//! session: what may free space). The segment headers a compaction's own
//! roll writes do not count: a store full of live data that nobody touches
//! is not rewritten again and again.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use tracing::{info, warn};

use super::health::Health;
use super::open::{files, number, replay, unix_ms, write_snapshot, Repair};
use crate::shutdown::Shutdown;

/// How often the compactor looks at the log's size (the shards also wake
/// it when a compaction becomes due).
const POLL: Duration = Duration::from_millis(100);

/// How long the compactor waits for every shard to roll its log.
const ROLL_WAIT: Duration = Duration::from_secs(10);

/// While the store is full, at most one compaction this often (and only
/// after records were committed since the last one began).
const FULL_RETRY: Duration = Duration::from_secs(1);

/// The compactor's request to the shards to roll their logs at a cut (see
/// the module documentation).
#[derive(Debug)]
pub(crate) struct Roll {
    /// The newest request (0: none yet).
    request: AtomicU64,
    /// The cut of the newest request, 0 until published.
    cut: AtomicU64,
    /// Per shard: the newest request it rolled for, and the number of the
    /// segment it started then.
    sealed: Mutex<Vec<(u64, u64)>>,
}

impl Roll {
    /// No request yet, for `shards` shards.
    pub(crate) fn new(shards: usize) -> Roll {
        Roll {
            request: AtomicU64::new(0),
            cut: AtomicU64::new(0),
            sealed: Mutex::new(vec![(0, 0); shards]),
        }
    }

    /// Shard side: the newest request, if it is newer than `rolled` (the
    /// last one the shard rolled for).
    pub(crate) fn asked(&self, rolled: u64) -> Option<u64> {
        let request = self.request.load(Ordering::SeqCst);
        (request > rolled).then_some(request)
    }

    /// Shard side: the cut of the newest request, once published.
    pub(crate) fn cut(&self) -> Option<u64> {
        Some(self.cut.load(Ordering::SeqCst)).filter(|&c| c != 0)
    }

    /// Shard side: `shard` rolled for `request`, starting segment `first_open`.
    pub(crate) fn rolled(&self, shard: usize, request: u64, first_open: u64) {
        let mut sealed = self.sealed.lock().unwrap_or_else(|e| e.into_inner());
        sealed[shard] = (request, first_open);
    }

    /// Ask for a roll: `next_lsn` hands out the cut. Returns the request
    /// and its cut.
    fn ask(&self, next_lsn: &AtomicU64) -> (u64, u64) {
        self.cut.store(0, Ordering::SeqCst);
        let request = self.request.load(Ordering::SeqCst) + 1;
        self.request.store(request, Ordering::SeqCst);
        let cut = next_lsn.fetch_add(1, Ordering::SeqCst);
        self.cut.store(cut, Ordering::SeqCst);
        (request, cut)
    }

    /// Every shard's first open segment, once all rolled for `request`.
    fn all_rolled(&self, request: u64) -> Option<Vec<u64>> {
        let sealed = self.sealed.lock().unwrap_or_else(|e| e.into_inner());
        sealed
            .iter()
            .all(|(r, _)| *r >= request)
            .then(|| sealed.iter().map(|(_, s)| *s).collect())
    }
}

/// Whether a compaction is due for a log of `bytes` whose newest snapshot
/// holds `snapshot` of them, bounded by `max`; `full_retry`: the store is
/// full, the last compaction was at least [`FULL_RETRY`] ago and records
/// were committed since it began.
pub(crate) fn due(bytes: u64, snapshot: u64, max: u64, full_retry: bool) -> bool {
    let new = bytes.saturating_sub(snapshot);
    new >= snapshot.max(max / 8) || (bytes >= max / 2 && new >= max / 16) || (full_retry && new > 0)
}

/// The compactor thread; stops with the broker.
pub(crate) struct Compactor {
    thread: Option<std::thread::JoinHandle<()>>,
    stop: Arc<AtomicBool>,
}

/// What the compactor works with.
pub(crate) struct CompactorContext {
    pub(crate) dir: PathBuf,
    pub(crate) lsn: Arc<AtomicU64>,
    pub(crate) roll: Arc<Roll>,
    pub(crate) health: Arc<Health>,
    pub(crate) shutdown: Shutdown,
}

/// What one compaction did.
struct Report {
    cut: u64,
    read_bytes: u64,
    snapshot: PathBuf,
    snapshot_bytes: u64,
    removed_segments: usize,
    took: Duration,
}

impl Compactor {
    /// Start the compactor thread.
    ///
    /// # Errors
    /// The thread cannot be made.
    pub(crate) fn start(ctx: CompactorContext) -> std::io::Result<Compactor> {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let health = ctx.health.clone();
        let thread = std::thread::Builder::new()
            .name("fleetmq-compactor".into())
            .spawn(move || run(ctx, &flag))?;
        health.wake_on_growth(thread.thread().clone());
        Ok(Compactor {
            thread: Some(thread),
            stop,
        })
    }

    /// Stop (a compaction under way is abandoned; what it wrote is removed
    /// at the next start) and join.
    pub(crate) fn stop(mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            let _ = t.join();
        }
    }
}

fn run(ctx: CompactorContext, stop: &AtomicBool) {
    // SAFETY: setpriority on this thread (who = 0 means the calling
    // thread on Linux); a failure only leaves the priority as it was.
    unsafe {
        libc::setpriority(libc::PRIO_PROCESS, 0, 10);
    }
    let stopping = || stop.load(Ordering::Acquire) || ctx.shutdown.is_triggered();
    let mut last: Option<Instant> = None;
    // `Health::records` when the last compaction began: a full store is
    // retried only once records were committed after that (the roll's new
    // segment headers are no reason to rewrite what is live again).
    let mut records_then: Option<u64> = None;
    while !stopping() {
        std::thread::park_timeout(POLL);
        let health = &ctx.health;
        let full_retry = health.refusing()
            && last.is_none_or(|l| l.elapsed() >= FULL_RETRY)
            && records_then != Some(health.records());
        if stopping()
            || !due(
                health.bytes(),
                health.snapshot_bytes(),
                health.max_bytes(),
                full_retry,
            )
        {
            continue;
        }
        last = Some(Instant::now());
        records_then = Some(health.records());
        health.compacting(true);
        let result = compact(&ctx, &stopping);
        health.compacting(false);
        match result {
            Ok(Some(r)) => info!(
                target: "store",
                cut = r.cut,
                read_bytes = r.read_bytes,
                snapshot = %r.snapshot.display(),
                snapshot_bytes = r.snapshot_bytes,
                removed_segments = r.removed_segments,
                log_bytes = health.bytes(),
                elapsed_ms = r.took.as_millis() as u64,
                "store compacted"
            ),
            Ok(None) => {}
            Err(e) => {
                warn!(target: "store", error = %format!("{e:#}"), "store: compaction failed; the log is kept as it is")
            }
        }
    }
}

/// One compaction; `None` when the broker stopped first.
fn compact(ctx: &CompactorContext, stopping: &dyn Fn() -> bool) -> anyhow::Result<Option<Report>> {
    let started = Instant::now();
    let (request, cut) = ctx.roll.ask(&ctx.lsn);
    let first_open = loop {
        if let Some(first_open) = ctx.roll.all_rolled(request) {
            break first_open;
        }
        if stopping() {
            return Ok(None);
        }
        if started.elapsed() > ROLL_WAIT {
            bail!("a shard did not roll its log within {ROLL_WAIT:?}");
        }
        std::thread::sleep(Duration::from_millis(1));
    };
    let files = files(&ctx.dir)?;
    // Segments before each shard's first open one; every segment of a
    // shard directory no running shard writes (more shards before).
    let sealed: Vec<(usize, Vec<PathBuf>)> = files
        .shards
        .iter()
        .map(|(i, segments)| {
            let open = first_open.get(*i).copied().unwrap_or(u64::MAX);
            (
                *i,
                segments
                    .iter()
                    .filter(|p| number(p).is_some_and(|n| n < open))
                    .cloned()
                    .collect(),
            )
        })
        .collect();
    let segments: Vec<&[PathBuf]> = sealed.iter().map(|(_, s)| &s[..]).collect();
    let base = files.snapshots.last();
    let read = replay(base.map(PathBuf::as_path), &segments, Repair::ReadOnly)?;
    let mut recovered = read.recovered;
    recovered.finish(unix_ms());
    if stopping() {
        return Ok(None);
    }
    let generation = base.and_then(|p| number(p)).unwrap_or(0) + 1;
    let (snapshot, snapshot_bytes) = write_snapshot(&ctx.dir, generation, &recovered, cut)?;
    drop(recovered);
    for old in &files.snapshots {
        remove(old)?;
    }
    let mut removed = Vec::new();
    let mut removed_segments = 0;
    for ((shard, paths), lens) in sealed.iter().zip(&read.segment_bytes) {
        for (path, len) in paths.iter().zip(lens) {
            remove(path)?;
            removed.push((*shard, *len));
            removed_segments += 1;
        }
    }
    let took = started.elapsed();
    ctx.health
        .compacted(&removed, read.snapshot_bytes, snapshot_bytes, took);
    Ok(Some(Report {
        cut,
        read_bytes: read.read_bytes,
        snapshot,
        snapshot_bytes,
        removed_segments,
        took,
    }))
}

fn remove(path: &Path) -> anyhow::Result<()> {
    std::fs::remove_file(path).with_context(|| format!("store: cannot remove {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compaction_is_due_when_the_new_log_outgrows_the_snapshot_or_nears_the_bound() {
        let max = 1 << 30;
        assert!(!due(10 << 20, 0, max, false), "little logged");
        assert!(
            due(128 << 20, 0, max, false),
            "an eighth of the bound, nothing live"
        );
        assert!(!due(400 << 20, 300 << 20, max, false), "less new than live");
        assert!(due(600 << 20, 300 << 20, max, false), "as much new as live");
        assert!(
            due(540 << 20, 470 << 20, max, false),
            "past half with a sixteenth new"
        );
        assert!(!due(520 << 20, 470 << 20, max, false));
        assert!(
            due(max + 1, max, max, true),
            "full: retried while anything is new"
        );
        assert!(
            !due(max, max, max, true),
            "full of live data: nothing to gain"
        );
    }

    #[test]
    fn a_roll_is_seen_by_the_shards_and_collected_when_all_rolled() {
        let roll = Roll::new(2);
        let lsn = AtomicU64::new(41);
        assert_eq!(roll.asked(0), None);
        let (request, cut) = roll.ask(&lsn);
        assert_eq!((request, cut), (1, 41));
        assert_eq!(
            lsn.load(Ordering::SeqCst),
            42,
            "the cut is a number no record gets"
        );
        assert_eq!((roll.asked(0), roll.cut()), (Some(1), Some(41)));
        roll.rolled(0, 1, 5);
        assert_eq!(roll.all_rolled(1), None);
        roll.rolled(1, 1, 3);
        assert_eq!(roll.all_rolled(1), Some(vec![5, 3]));
        assert_eq!(roll.asked(1), None);
    }
}
