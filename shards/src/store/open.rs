//! Opening the local store at start: the lock and recovery from the
//! newest snapshot and every shard's log. Compaction (writing a new
//! snapshot and removing what it replaces) runs while the broker serves
//! ([`super::compact`]), so a start only reads.
//!
//! Files in `store.dir`: `LOCK` (holds the PID of the process that owns the
//! directory, locked with `flock` while it runs), `snapshot-{n:016x}.log`
//! (the newest is the base: it holds the state up to the log sequence
//! number in its header), `shard-{i}/{n:016x}.log` (what each shard
//! appended; records at or below the snapshot's number are already in it).
//! Everything is read with ordinary reads.

use std::fs::{self, File, OpenOptions};
use std::io::{BufWriter, Read, Seek, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context};
use bytes::{Bytes, BytesMut};
use fleetmq_core::store::{put_frame, scan, Record, Recovered, FORMAT_VERSION};
use tracing::{info, warn};

/// The store directory, held, and what was recovered from it.
pub(crate) struct Opened {
    /// The directory.
    pub(crate) dir: PathBuf,
    /// Holds the `flock` on `LOCK` while it is open (see [`Opened::take_lock`]).
    lock: Option<File>,
    /// State recovered.
    pub(crate) recovered: Recovered,
    /// The next log sequence number to hand out.
    pub(crate) next_lsn: u64,
    /// Bytes of the newest snapshot.
    pub(crate) snapshot_bytes: u64,
    /// Per shard directory index, bytes of its segments.
    pub(crate) segment_bytes: Vec<(usize, u64)>,
}

impl Opened {
    /// The open `LOCK` file: the directory stays held as long as it is
    /// open, so the caller keeps it for the life of the process (the rest
    /// of `Opened` is dropped once the shards took what they need).
    pub(crate) fn take_lock(&mut self) -> Option<File> {
        self.lock.take()
    }
}

/// Unix milliseconds now.
pub(crate) fn unix_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// Take `dir` (creating it) and recover what its snapshot and logs hold.
/// Older snapshots (which the newest replaces) are removed.
///
/// # Errors
/// Another process holds the directory (naming its PID); a log damaged in
/// the middle (naming file and offset) unless `truncate_corrupt`; a record
/// of an unknown format; any I/O error, naming the path.
pub(crate) fn open(dir: &Path, truncate_corrupt: bool) -> anyhow::Result<Opened> {
    let started = Instant::now();
    fs::create_dir_all(dir).with_context(|| format!("store.dir {}: cannot create it", dir.display()))?;
    let lock = lock(dir)?;
    let files = files(dir)?;
    let segments: Vec<&[PathBuf]> = files.shards.iter().map(|(_, s)| &s[..]).collect();
    let read = replay(files.snapshots.last().map(PathBuf::as_path), &segments, Repair::AtStart { truncate_corrupt })?;
    let mut recovered = read.recovered;
    recovered.finish(unix_ms());
    recovered.wills_due(unix_ms());
    if let Some((_, older)) = files.snapshots.split_last() {
        for old in older {
            fs::remove_file(old).with_context(|| format!("store: cannot remove {}", old.display()))?;
        }
    }
    let next_lsn = recovered.last_lsn.max(read.covered) + 1;
    info!(
        target: "store",
        dir = %dir.display(),
        read_bytes = read.read_bytes,
        sessions = recovered.sessions.len(),
        retained = recovered.retained.len(),
        values = recovered.values.len(),
        elapsed_ms = started.elapsed().as_millis() as u64,
        "store recovered"
    );
    Ok(Opened {
        dir: dir.to_owned(),
        lock: Some(lock),
        recovered,
        next_lsn,
        snapshot_bytes: read.snapshot_bytes,
        segment_bytes: files.shards.iter().zip(&read.segment_bytes).map(|((i, _), b)| (*i, b.iter().sum())).collect(),
    })
}

/// How [`replay`] treats damage.
#[derive(Clone, Copy)]
pub(crate) enum Repair {
    /// At start: a torn tail is truncated; damage in the middle stops the
    /// start unless `truncate_corrupt`.
    AtStart { truncate_corrupt: bool },
    /// While serving (compaction): files are only read; any damage is an
    /// error.
    ReadOnly,
}

/// What [`replay`] read.
pub(crate) struct Replayed {
    /// The state (not yet [`Recovered::finish`]ed).
    pub(crate) recovered: Recovered,
    /// The log sequence number the snapshot covers (0 without one).
    pub(crate) covered: u64,
    /// Bytes read.
    pub(crate) read_bytes: u64,
    /// Bytes of the snapshot.
    pub(crate) snapshot_bytes: u64,
    /// Per segment given, its length up to its last correct frame, in the
    /// order given.
    pub(crate) segment_bytes: Vec<Vec<u64>>,
}

/// Replay `snapshot` and then the records above what it covers in every
/// shard's `segments` (each shard's in order), in log sequence order.
///
/// # Errors
/// See [`open`]; with [`Repair::ReadOnly`] any damage is an error.
pub(crate) fn replay(snapshot: Option<&Path>, segments: &[&[PathBuf]], repair: Repair) -> anyhow::Result<Replayed> {
    let mut recovered = Recovered::default();
    let (mut covered, mut read_bytes, mut snapshot_bytes) = (0, 0u64, 0);
    if let Some(base) = snapshot {
        let (records, _, len) = read_file(base, repair, &mut read_bytes)?;
        snapshot_bytes = len;
        recovered.reading_snapshot(true);
        for (i, (lsn, record)) in records.into_iter().enumerate() {
            if i == 0 {
                covered = lsn;
            }
            recovered.apply(lsn, record);
        }
        recovered.reading_snapshot(false);
    }
    let mut records = Vec::new();
    let mut segment_bytes = Vec::new();
    for shard_segments in segments {
        let mut lens = Vec::new();
        for (i, path) in shard_segments.iter().enumerate() {
            let (mut r, cut, len) = read_file(path, repair, &mut read_bytes)?;
            r.retain(|(lsn, _)| *lsn > covered);
            records.append(&mut r);
            lens.push(len);
            if cut {
                // Dropping what follows a damaged record means the rest of
                // this shard's log too (only at start: `read_file` cuts
                // nothing otherwise).
                for later in &shard_segments[i + 1..] {
                    fs::remove_file(later).with_context(|| format!("store: cannot remove {}", later.display()))?;
                }
                break;
            }
        }
        segment_bytes.push(lens);
    }
    // Stable: a record found twice (rewritten after a failed roll) stays
    // next to itself, and applying it again changes nothing.
    records.sort_by_key(|(lsn, _)| *lsn);
    for (lsn, record) in records {
        recovered.apply(lsn, record);
    }
    Ok(Replayed { recovered, covered, read_bytes, snapshot_bytes, segment_bytes })
}

/// How long a start waits for the lock of a process that has ended: the
/// kernel releases a killed process's lock only once it has torn down its
/// io_uring rings, measured here at up to 0.5 s after `kill -9`, so a
/// supervisor that restarts at once would otherwise be refused.
const ENDED_HOLDER_WAIT: Duration = Duration::from_secs(5);

/// Lock `dir/LOCK` for this process and write its PID there. A lock held
/// by a process that has ended (its PID gone, a zombie, or this process's
/// own PID, as after a container restart) is waited for up to
/// [`ENDED_HOLDER_WAIT`]; one held by a live process refuses at once.
fn lock(dir: &Path) -> anyhow::Result<File> {
    let path = dir.join("LOCK");
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .with_context(|| format!("store.dir: cannot open {}", path.display()))?;
    let started = Instant::now();
    let mut said = false;
    // SAFETY: flock on a descriptor this function owns.
    while unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let mut holder = String::new();
        file.rewind()?;
        let _ = file.read_to_string(&mut holder);
        let holder = holder.trim().to_owned();
        if !has_ended(&holder) || started.elapsed() >= ENDED_HOLDER_WAIT {
            bail!(
                "store.dir {} is in use by another fleetmq process (PID {holder}, lock file {}): one process per directory",
                dir.display(),
                path.display()
            );
        }
        if !said {
            said = true;
            info!(target: "store", pid = %holder, "store: waiting for the lock of a process that ended");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    file.set_len(0)?;
    file.rewind()?;
    writeln!(file, "{}", std::process::id())?;
    file.sync_all()?;
    Ok(file)
}

/// Whether the process whose PID the lock file names has ended: no such
/// process, a zombie, or this process's own PID. A PID that cannot be
/// read is taken for a live process.
fn has_ended(pid: &str) -> bool {
    let Ok(pid) = pid.parse::<u32>() else { return false };
    if pid == std::process::id() {
        return true;
    }
    match fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the command name in parentheses: Z zombie, X dead.
        Ok(stat) => stat.rsplit_once(") ").is_some_and(|(_, rest)| rest.starts_with('Z') || rest.starts_with('X')),
        Err(e) => e.kind() == std::io::ErrorKind::NotFound,
    }
}

/// The files of a store directory.
pub(crate) struct Files {
    /// Snapshots, oldest first.
    pub(crate) snapshots: Vec<PathBuf>,
    /// Each shard directory's index and segments, in order.
    pub(crate) shards: Vec<(usize, Vec<PathBuf>)>,
}

/// The snapshots and each shard's segments, in order. A snapshot left
/// unfinished (`.tmp`) is removed.
pub(crate) fn files(dir: &Path) -> anyhow::Result<Files> {
    let mut snapshots = Vec::new();
    let mut shards = Vec::new();
    for entry in fs::read_dir(dir).with_context(|| format!("store.dir {}", dir.display()))? {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with("snapshot-") && name.ends_with(".log") {
            snapshots.push(entry.path());
        } else if name.starts_with("snapshot-") && name.ends_with(".tmp") {
            // A snapshot that was not finished.
            fs::remove_file(entry.path())?;
        } else if let Some(index) = name.strip_prefix("shard-").and_then(|i| i.parse::<usize>().ok()) {
            if !entry.path().is_dir() {
                continue;
            }
            let mut segments: Vec<PathBuf> = fs::read_dir(entry.path())?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "log"))
                .collect();
            segments.sort();
            shards.push((index, segments));
        }
    }
    snapshots.sort();
    shards.sort();
    Ok(Files { snapshots, shards })
}

/// The number in a `...-{n:016x}.log` or `{n:016x}.log` file name.
pub(crate) fn number(path: &Path) -> Option<u64> {
    let stem = path.file_stem()?.to_str()?;
    u64::from_str_radix(stem.rsplit('-').next()?, 16).ok()
}

/// The records of one file and its length up to the last correct frame.
/// At start a torn tail is cut off (and the file truncated there); damage
/// in the middle is an error, or with `truncate_corrupt` the file is cut
/// there too and the second value is true (what follows in this shard's
/// log must be dropped). Read-only, any damage is an error.
fn read_file(path: &Path, repair: Repair, read_bytes: &mut u64) -> anyhow::Result<(Records, bool, u64)> {
    let data = Bytes::from(fs::read(path).with_context(|| format!("store: cannot read {}", path.display()))?);
    *read_bytes += data.len() as u64;
    let mut dropped = None;
    let truncate_corrupt = matches!(repair, Repair::AtStart { truncate_corrupt: true });
    let scan = match scan(&data) {
        Ok(scan) => scan,
        Err(corrupt) if truncate_corrupt => {
            dropped = Some(corrupt.offset);
            let cut = data.slice(..corrupt.offset as usize);
            scan(&cut).expect("the part before the damage reads")
        }
        Err(corrupt) => bail!(
            "store: {} is damaged at byte offset {} (a record fails its checksum and a correct one follows at {}): \
             refusing to start, because acknowledged values may lie beyond it. To start anyway, dropping the damaged \
             record and everything after it in this shard's log, set store.truncate_corrupt = true",
            path.display(),
            corrupt.offset,
            corrupt.next_good
        ),
    };
    if scan.torn || dropped.is_some() {
        let cut = scan.valid_len;
        if matches!(repair, Repair::ReadOnly) {
            bail!("store: {} has a torn or damaged record at byte offset {cut}", path.display());
        }
        warn!(target: "store", file = %path.display(), offset = cut, "store: dropping a torn or damaged tail");
        let file = OpenOptions::new().write(true).open(path)?;
        file.set_len(cut)?;
        file.sync_all()?;
    }
    let mut records = Vec::with_capacity(scan.frames.len());
    for (offset, body) in scan.frames {
        let (lsn, record) = Record::decode(body)
            .with_context(|| format!("store: {} at byte offset {offset}: a record this build cannot read", path.display()))?;
        if let Record::Header { version, .. } = record {
            if version != FORMAT_VERSION {
                bail!("store: {} has record format {version}, this build reads {FORMAT_VERSION}", path.display());
            }
        }
        records.push((lsn, record));
    }
    if let Some(offset) = dropped {
        warn!(
            target: "store",
            file = %path.display(),
            offset,
            "store: a damaged record and everything after it in this shard's log were dropped (store.truncate_corrupt)"
        );
    }
    Ok((records, dropped.is_some(), scan.valid_len))
}

/// Records with their log sequence numbers.
type Records = Vec<(u64, Record)>;

/// Write `recovered` as snapshot `generation` covering the log up to
/// sequence `cut`: its header (numbered `cut`), then its records. Written
/// to a `.tmp` file, synced and renamed, so a snapshot is whole or absent.
/// Returns its path and size.
///
/// # Errors
/// Any I/O error, naming the path.
pub(crate) fn write_snapshot(dir: &Path, generation: u64, recovered: &Recovered, cut: u64) -> anyhow::Result<(PathBuf, u64)> {
    let path = dir.join(format!("snapshot-{generation:016x}.log"));
    let tmp = path.with_extension("tmp");
    let file = File::create(&tmp).with_context(|| format!("store: cannot create {}", tmp.display()))?;
    let mut out = BufWriter::with_capacity(1 << 20, file);
    let mut frame = BytesMut::new();
    let mut body = BytesMut::new();
    let mut bytes = 0u64;
    let header = (cut, Record::Header { version: FORMAT_VERSION, shard: u16::MAX, segment: generation });
    for (lsn, record) in std::iter::once(header).chain(recovered.snapshot(cut)) {
        body.clear();
        frame.clear();
        record.encode(lsn, &mut body);
        put_frame(&mut frame, &body);
        out.write_all(&frame).with_context(|| format!("store: cannot write {}", tmp.display()))?;
        bytes += frame.len() as u64;
    }
    let file = out.into_inner().map_err(|e| e.into_error()).with_context(|| format!("store: cannot write {}", tmp.display()))?;
    file.sync_all()?;
    fs::rename(&tmp, &path)?;
    File::open(dir)?.sync_all()?;
    Ok((path, bytes))
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use fleetmq_core::packet::{Props, QoS};
    use fleetmq_core::store::StoredMessage;

    use super::*;

    #[test]
    fn a_lock_holder_has_ended_when_gone_a_zombie_or_this_process() {
        assert!(has_ended(&std::process::id().to_string()));
        assert!(!has_ended("1"), "init is alive");
        assert!(!has_ended("not a pid"));
        let mut child = std::process::Command::new("sleep").arg("30").spawn().unwrap();
        let pid = child.id().to_string();
        assert!(!has_ended(&pid), "running");
        child.kill().unwrap();
        // Killed and not reaped: a zombie once the signal is taken.
        let deadline = Instant::now() + Duration::from_secs(5);
        while !has_ended(&pid) {
            assert!(Instant::now() < deadline, "never a zombie");
            std::thread::sleep(Duration::from_millis(10));
        }
        child.wait().unwrap();
        assert!(has_ended(&pid), "reaped");
    }

    fn temp(what: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("fleetmq-open-{what}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// A shard log: a header and three retained values (lsn 1..=4); returns
    /// its bytes and where the last record starts.
    fn log() -> (Vec<u8>, usize) {
        let mut out = BytesMut::new();
        let mut body = BytesMut::new();
        Record::Header { version: FORMAT_VERSION, shard: 0, segment: 0 }.encode(1, &mut body);
        put_frame(&mut out, &body);
        let mut last = 0;
        for i in 0..3u64 {
            body.clear();
            let m = StoredMessage {
                topic: format!("t/{i}").into(),
                payload: Bytes::from(format!("value {i}")),
                qos: QoS::AtLeastOnce,
                retain: true,
                properties: Props::default(),
                received_ms: unix_ms(),
                origin: 0,
            };
            Record::Value(m).encode(2 + i, &mut body);
            last = out.len();
            put_frame(&mut out, &body);
        }
        (out.to_vec(), last)
    }

    #[test]
    fn a_last_record_cut_at_any_byte_is_dropped_and_the_file_truncated() {
        let (data, last) = log();
        for cut in last + 1..data.len() {
            let dir = temp("torn");
            fs::create_dir_all(dir.join("shard-0")).unwrap();
            let path = dir.join("shard-0").join(format!("{:016x}.log", 0));
            fs::write(&path, &data[..cut]).unwrap();
            let mut read = 0;
            let (records, cut_rest, _) = read_file(&path, Repair::AtStart { truncate_corrupt: false }, &mut read).unwrap();
            assert_eq!((records.len(), cut_rest), (3, false), "cut at {cut}");
            assert_eq!(fs::metadata(&path).unwrap().len(), last as u64, "truncated at the torn record");
            let opened = open(&dir, false).unwrap();
            let mut topics: Vec<&str> = opened.recovered.retained.keys().map(|t| &**t).collect();
            topics.sort();
            assert_eq!(topics, ["t/0", "t/1"], "cut at {cut}");
            drop(opened);
            fs::remove_dir_all(&dir).unwrap();
        }
    }

    #[test]
    fn a_store_dir_is_recovered_the_same_after_each_start() {
        let (data, _) = log();
        let dir = temp("again");
        fs::create_dir_all(dir.join("shard-0")).unwrap();
        fs::write(dir.join("shard-0").join(format!("{:016x}.log", 0)), &data).unwrap();
        let first = open(&dir, false).unwrap();
        let lsn = first.next_lsn;
        drop(first);
        let second = open(&dir, false).unwrap();
        assert_eq!(second.recovered.retained.len(), 3);
        assert_eq!(second.next_lsn, lsn, "a start only reads");
        drop(second);
        fs::remove_dir_all(&dir).unwrap();
    }

    /// A snapshot covers the records at or below its number: the same
    /// records still in a segment (a crash before the segment was
    /// removed) are not applied twice, later ones are applied on top, and
    /// older snapshots are removed at start.
    #[test]
    fn a_snapshot_replaces_the_records_it_covers() {
        let (data, _) = log();
        let dir = temp("snap");
        fs::create_dir_all(dir.join("shard-0")).unwrap();
        let segment = dir.join("shard-0").join(format!("{:016x}.log", 0));
        fs::write(&segment, &data).unwrap();
        let mut r = open(&dir, false).unwrap();
        drop(r.take_lock());
        // Cover lsn 1..=3 (t/0, t/1), as if compacted before t/2 came.
        let mut state = Recovered::default();
        for (lsn, record) in read_file(&segment, Repair::ReadOnly, &mut 0).unwrap().0.into_iter().take(3) {
            state.apply(lsn, record);
        }
        state.finish(unix_ms());
        fs::write(dir.join("snapshot-0000000000000001.log"), b"old").unwrap();
        write_snapshot(&dir, 2, &state, 3).unwrap();
        let again = open(&dir, false).unwrap();
        let mut topics: Vec<&str> = again.recovered.retained.keys().map(|t| &**t).collect();
        topics.sort();
        assert_eq!(topics, ["t/0", "t/1", "t/2"]);
        assert_eq!(again.recovered.retained["t/1"].0, 3, "values keep their numbers");
        assert!(!dir.join("snapshot-0000000000000001.log").exists());
        assert!(dir.join("snapshot-0000000000000002.log").exists());
        drop(again);
        drop(r);
        fs::remove_dir_all(&dir).unwrap();
    }
}
